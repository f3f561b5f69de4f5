"""CPU test suite: `python -m pytest -q test_cplm.py` (a few minutes on 2 cores, no GPU, no internet)."""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cpu_head
import inference
import train_gpt_cplm as tg
from conftest import BOS, VOCAB, _load, random_documents, toy_corpus, write_shard

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# ----------------------------------------------------------------------------------------------------
# data loader


def test_loader_reads_independently_written_shards(tmp_path):
    tokens = list(range(3000))
    write_shard(tmp_path / "a_train_000000.bin", tokens[:2000])
    write_shard(tmp_path / "a_train_000001.bin", tokens[2000:], version=2, vocab=70000)
    assert list(tg.load_shard(str(tmp_path / "a_train_000000.bin"))) == tokens[:2000]
    assert list(tg.load_shard(str(tmp_path / "a_train_000001.bin"))) == tokens[2000:]
    # 2 ranks x 2 micro-steps of 128 tokens: each rank gets its rows, targets shifted by one
    for rank in range(2):
        loader = tg.TrainLoader(str(tmp_path / "a_train_*.bin"), 512, 128, rank, 2, None)
        first = loader.next_batch("cpu")
        assert [x[0, 0].item() for x, _ in first] == [128 * rank, 128 * (rank + 2)]
        assert all(torch.equal(y[0, :-1], x[0, 1:]) and y[0, -1] == x[0, -1] + 1 for x, y in first)
        for _ in range(2):
            loader.next_batch("cpu")
        # the shards are one stream: the fourth batch's last row runs from shard 0 into shard 1
        rows = loader.next_batch("cpu")
        for (x, y), start in zip(rows, (1536 + 128 * rank, 1536 + 128 * (rank + 2))):
            assert x[0].tolist() == list(range(start, start + 128)) and y[0, -1] == start + 128
        loader.next_batch("cpu")  # tokens 2048..2560
        assert loader.next_batch("cpu")[0][0][0, 0] == 128 * rank  # 2560 + 513 > 3000: it starts over


def test_data_seed_shuffles_documents_the_same_on_every_rank(tmp_path):
    """--data_seed: the stream's documents in a seeded order (the leading partial document first, a document
    across a shard boundary kept whole), the same for 1 and 2 ranks and on every construction; -1 leaves the
    stream as stored."""
    rng = np.random.default_rng(0)
    docs = [[BOS] + rng.integers(0, 60, int(rng.integers(5, 40))).tolist() for _ in range(120)]
    stream = [7, 8, 9] + [t for d in docs for t in d]  # begins inside a document
    cut = stream.index(BOS, 1000) + 3  # the second shard begins inside a document
    write_shard(tmp_path / "d_train_000000.bin", stream[:cut])
    write_shard(tmp_path / "d_train_000001.bin", stream[cut:])
    pattern = str(tmp_path / "d_train_*.bin")

    def rows(world, seed):
        loaders = [tg.TrainLoader(pattern, 512, 128, r, world, VOCAB, BOS, seed) for r in range(world)]
        out = []
        for _ in range(3):
            per_rank = [[x[0].tolist() for x, _ in loader.next_batch("cpu")] for loader in loaders]
            out += [per_rank[i % world][i // world] for i in range(4)]  # row i of the step is rank i % world's
        return out
    assert rows(1, -1)[0] == stream[:128]
    shuffled = rows(1, 5)
    assert shuffled == rows(2, 5) == rows(1, 5) != rows(1, 6)
    assert shuffled[0][:3] == [7, 8, 9] and shuffled != rows(1, -1)
    loader = tg.TrainLoader(pattern, 512, 128, 0, 1, VOCAB, BOS, 5)
    tokens = loader.read(0, loader.offsets[-1])
    split = lambda seq: sorted(map(tuple, np.split(seq, np.flatnonzero(seq == BOS))))  # noqa: E731
    assert split(tokens) == split(np.array(stream, dtype=np.uint16))  # the same documents, whole


def test_loader_takes_shards_of_any_size_and_checks_them_all_first(tmp_path):
    """A remainder shard smaller than one batch is read through; a bad id or a truncated shard anywhere in
    the list stops the loader before the first step, naming the shard."""
    write_shard(tmp_path / "s_train_000000.bin", range(1000))
    write_shard(tmp_path / "s_train_000001.bin", range(1000, 1100))  # a remainder: less than a batch
    loader = tg.TrainLoader(str(tmp_path / "s_train_*.bin"), 512, 256, 0, 1, 2000)
    seen = [x[0, 0].item() for _ in range(4) for x, _ in loader.next_batch("cpu")]
    assert seen == [0, 256, 512, 768, 0, 256, 512, 768]  # 1100 tokens hold 2 steps; then it starts over
    with pytest.raises(tg.DataError, match="one step needs 2049"):
        tg.TrainLoader(str(tmp_path / "s_train_*.bin"), 2048, 256, 0, 1, 2000)
    write_shard(tmp_path / "s_train_000002.bin", [5, 60000, 7])
    with pytest.raises(tg.DataError, match=r"s_train_000002.bin: holds token id 60000, but --vocab_size is 2000"):
        tg.TrainLoader(str(tmp_path / "s_train_*.bin"), 512, 256, 0, 1, 2000)
    write_shard(tmp_path / "s_train_000002.bin", range(50), truncate=4)
    with pytest.raises(tg.DataError, match="s_train_000002.bin: truncated"):
        tg.TrainLoader(str(tmp_path / "s_train_*.bin"), 512, 256, 0, 1, 2000)


def test_loader_rejects_bad_shards(tmp_path):
    cases = {"magic": dict(magic=1234), "version": dict(version=3), "truncated": dict(truncate=10)}
    expect = {"magic": "not a token shard", "version": "unsupported shard version 3", "truncated": "truncated"}
    for name, kw in cases.items():
        path = tmp_path / f"{name}.bin"
        write_shard(path, range(100), **{k: v for k, v in kw.items()})
        with pytest.raises(tg.DataError, match=expect[name]):
            tg.load_shard(str(path))
    write_shard(tmp_path / "big.bin", range(100), vocab=70000)
    with pytest.raises(tg.DataError, match="--vocab_size 70000"):
        tg.load_shard(str(tmp_path / "big.bin"), vocab_size=50257)
    with pytest.raises(tg.DataError, match="cached_fineweb10B.py"):
        tg.find_shards(str(tmp_path / "nothing_*.bin"))


def test_val_tokens_span_files(tmp_path):
    write_shard(tmp_path / "v_val_000000.bin", range(100))
    write_shard(tmp_path / "v_val_000001.bin", range(100, 300))
    assert tg.load_val_tokens(str(tmp_path / "v_val_*.bin"), 256, None).tolist() == list(range(257))
    with pytest.raises(tg.DataError, match="needs 301"):
        tg.load_val_tokens(str(tmp_path / "v_val_*.bin"), 300, None)


# ----------------------------------------------------------------------------------------------------
# attention: the dense CPU path against FlexAttention, and the block structure against the token mask


def test_dense_attention_matches_flex_forward():
    """Whole documents. (FlexAttention's CPU forward evaluates mask_mod on every pair and ignores which
    tiles the BlockMask lists, so the windows, which live in those lists, are checked tile by tile below.)"""
    torch.manual_seed(0)
    B, H, T, d = 2, 2, 512, 16
    doc_ids = tg.doc_ids_of(random_documents(B, T, 7, 0), 7)
    q, k, v = torch.randn(3, B, H, T, d).unbind(0)
    tiles = tg.document_blocks(doc_ids)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=tg.dense_attention_mask(doc_ids, tiles), scale=0.12)
    flex = tg.flex_attention(q, k, v, block_mask=tg.flex_document_mask(doc_ids, tiles), scale=0.12)
    torch.testing.assert_close(dense, flex, atol=1e-5, rtol=1e-5)


def record_window_tiles(allowed, w, blk):
    """Independent oracle of the record's block window, per query block from the token mask: the visited
    tiles (any allowed pair), nearest first; the full ones (every pair allowed below the diagonal) capped at
    w - 1, the partial ones at max(w - #full, 1)."""
    B, T, _ = allowed.shape
    nb = T // blk
    tiles = allowed.view(B, nb, blk, nb, blk)
    kept = torch.zeros(B, nb, nb, dtype=torch.bool)
    for b in range(B):
        for qb in range(nb):
            visited = [kb for kb in range(qb, -1, -1) if tiles[b, qb, :, kb].any()]
            full = [kb for kb in visited if kb < qb and tiles[b, qb, :, kb].all()]
            partial = [kb for kb in visited if kb not in full]
            for kb in full[:min(len(full), max(w - 1, 0))] + partial[:min(len(partial), max(w - len(full), 1))]:
                kept[b, qb, kb] = True
    return kept


@pytest.mark.parametrize("w", [0, 1, 2, 5, 100])
def test_window_tiles_follow_the_record(w):
    """The block masks keep exactly the tiles the record's rule keeps, and 'full' tiles hold only allowed
    pairs (the eager FlexAttention used on CPU applies mask_mod everywhere, so the forward test alone cannot
    see a wrong 'full' tile)."""
    T, blk = 1024, 128
    doc_ids = tg.doc_ids_of(random_documents(2, T, 7, 1), 7)
    pos = torch.arange(T)
    allowed = (pos[:, None] >= pos[None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])
    window = torch.tensor(w, dtype=torch.int32)
    tiles_of_window = tg.within_window(tg.document_blocks(doc_ids), window)
    (p_count, p_index), (f_count, f_index) = tiles_of_window

    def tiles(counts, indices):
        out = torch.zeros(2, T // blk, T // blk, dtype=torch.bool)
        for b in range(2):
            for qb in range(T // blk):
                out[b, qb, indices[b, 0, qb, :counts[b, 0, qb]].long()] = True
        return out

    partial, full = tiles(p_count, p_index), tiles(f_count, f_index)
    block_mask = tg.flex_document_mask(doc_ids, tiles_of_window)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), partial | full)  # what the CUDA kernel visits
    assert not (partial & full).any()
    assert torch.equal(partial | full, record_window_tiles(allowed, w, blk))
    assert allowed.view(2, T // blk, blk, T // blk, blk).all(4).all(2)[full].all()
    expected = (record_window_tiles(allowed, w, blk).repeat_interleave(blk, 1).repeat_interleave(blk, 2) & allowed)
    assert torch.equal(tg.dense_attention_mask(doc_ids, tiles_of_window)[:, 0], expected)
    # in one long document the window is the query's own block and the w - 1 before it
    single = torch.zeros(1, T, dtype=torch.long)
    (p_count, _), (f_count, _) = tg.within_window(tg.document_blocks(single), window)
    assert (p_count + f_count)[0, 0].tolist() == [min(qb + 1, max(w, 1)) for qb in range(T // blk)]


def kernel_view(block_mask, T):
    """(B, T, T) int: how often a FlexAttention kernel lets each pair through with this BlockMask, read as the
    CUDA kernels read it: the tiles a query block lists as full taken whole (mask_mod never runs there), those
    it lists as partial through mask_mod; the forward reads the lists per query block, the backward (dk, dv)
    per key block, and both readings must agree. (Eager CPU FlexAttention evaluates mask_mod on every pair and
    ignores the lists: a missing or wrong tile passes every CPU test of the values.) BlockMask.from_kv_blocks derives
    the per-key lists from the per-query ones, so their agreement guards masks built any other way."""
    blk, B = block_mask.BLOCK_SIZE[0], block_mask.kv_num_blocks.size(0)
    m = block_mask
    readings = []
    for lists, by_query in (((m.kv_num_blocks, m.kv_indices), (m.full_kv_num_blocks, m.full_kv_indices)), True), \
                           (((m.q_num_blocks, m.q_indices), (m.full_q_num_blocks, m.full_q_indices)), False):
        hits = torch.zeros(B, T, T, dtype=torch.int32)
        for full, (counts, indices) in enumerate(lists):
            for b in range(B):
                for i in range(T // blk):
                    for j in indices[b, 0, i, :counts[b, 0, i]].tolist():
                        qb, kb = (i, j) if by_query else (j, i)
                        q_idx, kv_idx = torch.arange(qb * blk, (qb + 1) * blk), torch.arange(kb * blk, (kb + 1) * blk)
                        tile = torch.ones(blk, blk, dtype=torch.bool) if full else \
                            m.mask_mod(torch.tensor(b), torch.tensor(0), q_idx[:, None], kv_idx[None, :])
                        hits[b, qb * blk:(qb + 1) * blk, kb * blk:(kb + 1) * blk] += tile
        readings.append(hits)
    assert torch.equal(readings[0], readings[1]), "the forward's and the backward's lists disagree"
    return readings[0]


@pytest.mark.parametrize("cplm", [0, 1])
def test_every_block_mask_the_model_builds_read_as_the_kernel_reads_it(monkeypatch, cplm):
    """The model's forward with FlexAttention (attention with a long and a short window, and the CP head's
    document and match masks), its flex calls recorded instead of run: every BlockMask, read tile by tile as the
    CUDA kernels read it, lets through exactly the pairs of the dense masks, none twice. Rows of 1024 tokens
    with documents that span several full tiles, several short ones, and one whole-row document."""
    from types import SimpleNamespace
    T, bos, V = 1024, 7, 16
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (2, T), generator=g)
    ids[0, [0, 40, 600, 700, 710, 1000]] = bos  # 40-600 holds blocks 1-3 whole: full tiles (2, 1), (3, 1), (3, 2)
    ids[1, [0, 900]] = bos
    targets = torch.roll(ids, -1, 1)
    targets[:, ::37] = 12  # never in any context
    seen = []

    def recorded(q, k, v, block_mask=None, scale=None, return_aux=None, kernel_options=None):
        seen.append(block_mask)
        return (torch.zeros_like(q), SimpleNamespace(lse=torch.zeros(q.shape[:-1]))) if return_aux else torch.zeros_like(q)

    monkeypatch.setattr(tg, "flex_attention", recorded)
    model = tg.GPT(tg.GPTConfig(vocab_size=V, bos_id=bos, num_layers=4, model_dim=32, num_heads=2, max_seq_len=T,
                                cplm=cplm, cp_dim=8))
    model.attention_backend = model.cp_backend = "flex"
    with torch.no_grad():
        model(ids, targets, window_blocks=torch.tensor(3, dtype=torch.int32))
    doc_ids = tg.doc_ids_of(ids, bos)
    pos = torch.arange(T)
    allowed = (pos[:, None] >= pos[None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])
    expected = {f"window {w}": record_window_tiles(allowed, w, 128).repeat_interleave(128, 1).repeat_interleave(128, 2)
                & allowed for w in (3, 1)}  # the long window and the short one, half of it
    if cplm:
        copyable = tg.target_in_context(ids, targets, doc_ids, V + 1)
        hit = (ids[:, None, :] == targets[:, :, None]) | (~copyable[:, :, None] & torch.eye(T, dtype=torch.bool))
        expected.update({"CP document": allowed, "CP match": allowed & hit})
    masks = list({id(m): m for m in seen}.values())
    assert len(masks) == len(expected) and len(seen) == sum(b.attn is not None for b in model.blocks) + 2 * cplm
    found = []
    for m in masks:
        view = kernel_view(m, T)
        assert view.max() == 1, "a tile is listed twice"
        found += [name for name, dense in expected.items() if torch.equal(view.bool(), dense)]
    assert sorted(found) == sorted(expected), found
    assert any(m.full_kv_num_blocks.sum() > 0 for m in masks)  # the rows have full tiles, the check reads them


# ----------------------------------------------------------------------------------------------------
# the CPLM mixture: the dense reference against an independent per-position oracle


def oracle_log_probs(lm_logits, q, k, sink_key, input_ids, copy_id):
    """The method's equations in probability space, float64, one position at a time."""
    B, T, V = lm_logits.shape
    out = torch.empty(B, T, V, dtype=torch.float64)
    d = q.size(-1)
    for b in range(B):
        for t in range(T):
            p_full = lm_logits[b, t].double().softmax(-1)
            c = p_full[copy_id]
            p_lm = p_full / (1 - c)
            p_lm[copy_id] = 0
            scores = torch.cat([q[b, t].double() @ k[b, :t + 1].double().T, (q[b, t].double() @ sink_key.double())[None]])
            alpha = (scores / math.sqrt(d)).softmax(-1)
            s = alpha[-1]
            p_cp = torch.zeros(V, dtype=torch.float64).index_add_(0, input_ids[b, :t + 1], alpha[:-1]) / (1 - s)
            lam = c * (1 - s)
            out[b, t] = ((1 - lam) * p_lm + lam * p_cp).log()
    return out


def random_mixture_inputs(B=2, T=24, V=40, d=8, seed=0, vocab_used=6, gate=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    logits[..., V - 8] += gate  # copy_id = V - 8: a gate far from 0
    q, k = torch.randn(2, B, T, d, generator=g).unbind(0)
    sink = torch.randn(d, generator=g)
    ids = torch.randint(0, vocab_used, (B, T), generator=g)
    return logits, q, k, sink, ids, V - 8


def test_reference_matches_oracle_and_is_a_distribution():
    logits, q, k, sink, ids, copy_id = random_mixture_inputs()
    ref = inference.cplm_log_probs(logits, q, k, sink, ids, copy_id)
    assert ref.dtype == torch.float32 and ref.shape == logits.shape
    assert torch.isneginf(ref[..., copy_id]).all()
    torch.testing.assert_close(ref.logsumexp(-1), torch.zeros(ref.shape[:2]), atol=1e-5, rtol=0)
    torch.testing.assert_close(ref.double(), oracle_log_probs(logits, q, k, sink, ids, copy_id), atol=2e-5, rtol=1e-5)


def pointer_sentinel_oracle(lm_logits, q, k, sink_key, input_ids, copy_id, sink_bias=0.0):
    """Merity et al. 2016, one position at a time in float64: the pointer softmax over the context and a
    sentinel, g = the sentinel's share; p = g p_vocab + (1 - g) p_ptr, p_vocab the LM's softmax over every slot
    but <copy>, p_ptr the pointer softmax over the context alone."""
    B, T, V = lm_logits.shape
    out = torch.empty(B, T, V, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            z = lm_logits[b, t].double().clone()
            z[copy_id] = -math.inf
            p_vocab = z.softmax(-1)
            context = q[b, t].double() @ k[b, :t + 1].double().T / math.sqrt(q.size(-1))
            sentinel = q[b, t].double() @ sink_key.double() / math.sqrt(q.size(-1)) + sink_bias
            g = torch.cat([context, sentinel[None]]).softmax(-1)[-1]
            p_ptr = torch.zeros(V, dtype=torch.float64).index_add_(0, input_ids[b, :t + 1], context.softmax(-1))
            out[b, t] = (g * p_vocab + (1 - g) * p_ptr).log()
    return out


def test_sentinel_reference_matches_the_pointer_sentinel_formula():
    logits, q, k, sink, ids, copy_id = random_mixture_inputs(seed=4)
    bias = torch.tensor(0.7)
    ref = inference.cplm_log_probs(logits, q, k, sink, ids, copy_id, gate="sentinel", sink_bias=bias)
    assert torch.isneginf(ref[..., copy_id]).all()
    torch.testing.assert_close(ref.logsumexp(-1), torch.zeros(ref.shape[:2]), atol=1e-5, rtol=0)
    oracle = pointer_sentinel_oracle(logits, q, k, sink, ids, copy_id, sink_bias=0.7)
    torch.testing.assert_close(ref.double(), oracle, atol=2e-5, rtol=1e-5)
    # the <copy> logit plays no part: the sentinel alone gates
    logits[..., copy_id] += 7
    again = inference.cplm_log_probs(logits, q, k, sink, ids, copy_id, gate="sentinel", sink_bias=bias)
    torch.testing.assert_close(again, ref)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_sentinel_fast_loss_matches_reference_values_and_gradients(softcap):
    logits, q, k, sink, ids, copy_id = random_mixture_inputs(T=40, vocab_used=12, seed=6)
    ids[0, 17] = 3  # a second document in row 0
    targets = torch.randint(0, 12, ids.shape, generator=torch.Generator().manual_seed(7))
    targets[1, :4] = 30  # never in the context
    inputs = [x.clone().requires_grad_() for x in (logits, q, k, sink, torch.tensor(-0.4))]
    doc_ids = tg.doc_ids_of(ids, 3)
    allowed = torch.ones(40, 40, dtype=torch.bool).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])
    ref = inference.cplm_log_probs(tg.soft_cap(inputs[0], softcap), *inputs[1:4], ids, copy_id, allowed, gate="sentinel",
                            sink_bias=inputs[4])
    ref = ref.gather(-1, targets[..., None])[..., 0]
    ref_grads = torch.autograd.grad(ref.sum(), inputs)
    inputs2 = [x.clone().requires_grad_() for x in (logits, q, k, sink, torch.tensor(-0.4))]
    copyable = tg.target_in_context(ids, targets, doc_ids, logits.size(-1))
    fast = tg.cplm_target_log_prob(*inputs2[:4], ids, targets, doc_ids, copyable, copy_id, inputs2[4], softcap=softcap,
                                   chunk=5, gate="sentinel")
    torch.testing.assert_close(fast["log_p"], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast["lam"], 1 - fast["s"])
    names = ["logits", "q", "k", "sink", "sink bias"]
    for name, a, b in zip(names, torch.autograd.grad(fast["log_p"].sum(), inputs2), ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def fast_log_p(logits, q, k, sink, ids, targets, copy_id, bos=None, chunk=512):
    doc_ids = tg.doc_ids_of(ids, bos) if bos is not None else torch.zeros_like(ids)
    copyable = tg.target_in_context(ids, targets, doc_ids, logits.size(-1))
    return tg.cplm_target_log_prob(logits, q, k, sink, ids, targets, doc_ids, copyable, copy_id, chunk=chunk)


@pytest.mark.parametrize("chunk", [5, 512])
def test_fast_loss_matches_reference_values_and_gradients(chunk):
    logits, q, k, sink, ids, copy_id = random_mixture_inputs(T=40, vocab_used=12)
    targets = torch.randint(0, 12, ids.shape, generator=torch.Generator().manual_seed(5))
    targets[0, :3] = 30  # never in the context
    inputs = [x.clone().requires_grad_() for x in (logits, q, k, sink)]
    ref = inference.cplm_log_probs(*inputs, ids, copy_id).gather(-1, targets[..., None])[..., 0]
    ref_grads = torch.autograd.grad(ref.sum(), inputs)
    inputs2 = [x.clone().requires_grad_() for x in (logits, q, k, sink)]
    fast = fast_log_p(*inputs2, ids, targets, copy_id, chunk=chunk)
    fast_grads = torch.autograd.grad(fast["log_p"].sum(), inputs2)
    torch.testing.assert_close(fast["log_p"], ref, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(["logits", "q", "k", "sink"], fast_grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_lm_head_terms_match_autograd_and_cross_entropy():
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(2, 5, 40, generator=g) * 3).requires_grad_()
    y = torch.randint(0, 32, (2, 5), generator=g)
    weights = torch.randn(3, 2, 5, generator=g)
    terms = tg.lm_head_terms(z, y, 32)
    without_copy = torch.cat([z[..., :32], z[..., 33:]], -1).logsumexp(-1)
    expected = [without_copy, z[..., 32], z.gather(-1, y[..., None])[..., 0]]
    for a, b in zip(terms, expected):
        torch.testing.assert_close(a, b)
    grad = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, terms)), z)[0]
    grad_expected = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, expected)), z)[0]
    torch.testing.assert_close(grad, grad_expected)
    vanilla_nll = torch.logaddexp(terms[0], terms[1]) - terms[2]
    torch.testing.assert_close(vanilla_nll, F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").view(2, 5))
    # with the soft-cap applied inside: the same as autograd through the record's cap * tanh(u / cap) + cap
    u = (z.detach() * 4).requires_grad_()
    capped = 5 * torch.tanh(u / 5) + 5
    terms = tg.lm_head_terms(u, y, 32, softcap=5.0)
    expected = [torch.cat([capped[..., :32], capped[..., 33:]], -1).logsumexp(-1), capped[..., 32],
                capped.gather(-1, y[..., None])[..., 0]]
    for a, b in zip(terms, expected):
        torch.testing.assert_close(a, b)
    grad = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, terms)), u)[0]
    grad_expected = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, expected)), u)[0]
    torch.testing.assert_close(grad, grad_expected)


@pytest.mark.parametrize("rows,vocab,cap,chunk", [(1024, 50304, 15.0, 32), (333, 8320, 15.0, 32), (70, 4224, 0.0, 16)])
def test_vanilla_cpu_loss_is_the_record_loss_bit_for_bit(rows, vocab, cap, chunk):
    """VanillaLossCPU (eager CPU training) against the record's cross-entropy on the whole (N, V) tensor: the
    same loss and the same gradient, to the last bit, on random logits; rows not a multiple of the chunk."""
    g = torch.Generator().manual_seed(rows)
    u = (torch.randn(2, rows, vocab, generator=g) * 3).requires_grad_()
    y = torch.randint(0, vocab, (2, rows), generator=g)
    record = tg.vanilla_nll(u, y, cap)
    chunked = cpu_head.VanillaLossCPU.apply(u, y, cap, chunk)
    assert torch.equal(record, chunked)
    # upstream 1 (one process, no accumulation), 1/2 (the cpu preset's 2 micro-steps), anything else, and again:
    # every gradient kept until the end, so a later backward that rewrote an earlier one's memory would show
    upstreams = (1.0, 0.5, 0.37, 0.37)
    got = [torch.autograd.grad(chunked * x, u, retain_graph=True)[0] for x in upstreams]
    for x, grad in zip(upstreams, got):
        assert torch.equal(grad, torch.autograd.grad(record * x, u, retain_graph=True)[0]), x


def test_vanilla_cpu_training_uses_the_lean_loss_and_keeps_the_record_gradient():
    assert tiny_model(0)(*[torch.tensor([[BOS, 1, 2, 3]])] * 2).grad_fn.name() == "NllLossBackward0"  # V <= 4096
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(vocab_size=8192, bos_id=BOS, num_layers=2, model_dim=32, num_heads=2, max_seq_len=256))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.05)
    ids = torch.tensor(toy_corpus(257, 4))[None]
    loss = model(ids[:, :-1], ids[:, 1:])
    assert loss.grad_fn.name() == "VanillaLossCPUBackward"
    grads = torch.autograd.grad(loss, list(model.parameters()))
    h, _ = model.hidden_states(ids[:, :-1])
    record = tg.vanilla_nll(model.lm_head(h), ids[:, 1:], model.config.logit_softcap)
    assert torch.equal(loss, record)
    for a, b in zip(grads, torch.autograd.grad(record, list(model.parameters()))):
        assert torch.equal(a, b)
    with torch.no_grad():  # no gradient wanted: the same mean, no gradient made
        assert torch.equal(model(ids[:, :-1], ids[:, 1:]), record)


def test_cpu_evaluation_in_pieces_keeps_each_token_in_place():
    """Eager CPU evaluation runs the head 1024 positions at a time: with two rows of 1100 tokens each token's
    loss must land at its own (row, position), as the whole-row loss puts it (a review found the pieces
    flattened and concatenated before the reshape, which mixed the rows)."""
    torch.manual_seed(0)
    for cplm in (0, 1):
        model = tg.GPT(tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=2, model_dim=32, num_heads=2,
                                    max_seq_len=2048, cplm=cplm)).eval()
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.05)
        ids = torch.tensor([toy_corpus(1101, 5), toy_corpus(1101, 6)])
        assert isinstance(model.head_loss, cpu_head.EagerCPUHeadLoss)
        with torch.no_grad():
            pieces = model(ids[:, :-1], ids[:, 1:], token_stats=True)["nll"]
            model.head_loss = tg.HeadLoss(model.config.logit_softcap, model.config.copy_id)
            whole = model(ids[:, :-1], ids[:, 1:], token_stats=True)["nll"]
        torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


def test_packed_documents_equal_separate_rows():
    """Two documents packed in one row give the same log p and gradients as the two as separate rows."""
    bos = 5
    logits, q, k, sink, ids, copy_id = random_mixture_inputs(B=2, T=30, vocab_used=5)
    ids[:, 0] = bos
    targets = torch.randint(0, 7, ids.shape, generator=torch.Generator().manual_seed(1))
    separate = [x.clone().requires_grad_() for x in (logits, q, k, sink)]
    ref = inference.cplm_log_probs(*separate, ids, copy_id).gather(-1, targets[..., None])[..., 0]
    ref.sum().backward()
    packed_in = [x.detach().reshape(1, 60, *x.shape[2:]).clone().requires_grad_() for x in (logits, q, k)]
    sink_p = sink.clone().requires_grad_()
    packed = fast_log_p(*packed_in, sink_p, ids.reshape(1, 60), targets.reshape(1, 60), copy_id, bos=bos, chunk=7)
    packed["log_p"].sum().backward()
    torch.testing.assert_close(packed["log_p"].view(2, 30), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(packed_in + [sink_p], separate):
        torch.testing.assert_close(a.grad.view_as(b.grad), b.grad, atol=1e-5, rtol=1e-4)


def test_uncopyable_targets_fall_back_to_the_lm_term():
    logits, q, k, sink, ids, copy_id = random_mixture_inputs(T=16, vocab_used=3)
    targets = torch.full_like(ids, 20)  # never occurs
    inputs = [x.clone().requires_grad_() for x in (logits, q, k, sink)]
    out = fast_log_p(*inputs, ids, targets, copy_id)
    out["log_p"].sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in inputs)
    # log p(y) = log((1 - lam) p_LM(y))
    p_full = logits.softmax(-1)
    c = p_full[..., copy_id]
    expected = ((1 - out["lam"].detach()) * p_full[..., 20] / (1 - c)).log()
    torch.testing.assert_close(out["log_p"].detach(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["lam"].detach(), c * (1 - out["s"].detach()), atol=1e-6, rtol=1e-5)


def test_flex_path_forward_on_cpu_matches_dense():
    """The CUDA path's FlexAttention LSEs (forward runs on CPU) against the dense chunked path, packed."""
    bos = 7
    ids = random_documents(2, 256, bos, 3)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, :5] = 100  # some targets never seen
    doc_ids = tg.doc_ids_of(ids, bos)
    copyable = tg.target_in_context(ids, targets, doc_ids, 128)
    q, k = torch.randn(2, 2, 256, 16).unbind(0)
    dense = tg.copy_lses(q, k, ids, targets, doc_ids, copyable, "dense", chunk=64)
    flex = tg.copy_lses(q, k, ids, targets, doc_ids, copyable, "flex")
    for a, b in zip(dense, flex):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and the whole loss through each backend
    logits, sink = torch.randn(2, 256, 128) * 2, torch.randn(16)
    args = (logits, q, k, sink, ids, targets, doc_ids, copyable, 120)
    for key, value in tg.cplm_target_log_prob(*args, backend="flex").items():
        torch.testing.assert_close(value, tg.cplm_target_log_prob(*args, backend="dense")[key], atol=1e-5, rtol=1e-5)


def test_target_in_context_matches_brute_force():
    ids = random_documents(2, 200, 7, 4)
    targets = torch.randint(0, 9, ids.shape)
    doc_ids = tg.doc_ids_of(ids, 7)
    got = tg.target_in_context(ids, targets, doc_ids, 16)
    for b in range(2):
        for t in range(200):
            same_doc = (doc_ids[b, :t + 1] == doc_ids[b, t]) & (ids[b, :t + 1] == targets[b, t])
            assert got[b, t] == same_doc.any()


# ----------------------------------------------------------------------------------------------------
# the model in both modes


def tiny_model(cplm, **over):
    torch.manual_seed(0)
    cfg = tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=2, model_dim=32, num_heads=2, max_seq_len=256,
                       cplm=cplm, **over)
    model = tg.GPT(cfg)
    with torch.no_grad():  # leave the zero init, so the heads say something
        for p in model.parameters():
            if p.ndim == 2 and not p.any():
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("cplm", [0, 1, "sentinel"])
def test_model_loss_token_stats_and_log_probs_agree(cplm):
    gate = {"copy_gate": "sentinel"} if cplm == "sentinel" else {"copy_gate_init": 0.3} if cplm else {}
    model = tiny_model(int(bool(cplm)), **gate)
    assert (model.copy_logit_bias is None) == (cplm != 1)  # the pointer sentinel has no <copy> gate
    assert (model.sink_bias is None) == (cplm != "sentinel")  # but a bias on its sink's score
    ids = torch.tensor(toy_corpus(129, 3)[1:])[None]
    ids = torch.cat([torch.tensor([[BOS]]), ids[:, :127]], 1)  # one document
    targets = torch.cat([ids[:, 1:], torch.tensor([[ids[0, 3]]])], 1)
    loss = model(ids, targets)
    stats = model(ids, targets, token_stats=True)
    torch.testing.assert_close(loss, stats["nll"].mean())
    log_probs = inference.next_token_log_probs(model, ids)
    assert log_probs.shape == (1, 128, model.config.padded_vocab)
    torch.testing.assert_close(-log_probs.gather(-1, targets[..., None])[..., 0], stats["nll"], atol=1e-5, rtol=1e-5)
    assert set(stats) >= ({"nll", "copyable", "lam", "c", "s"} if cplm else {"nll", "copyable"})
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("cplm", [0, 1])
def test_at_step_0_only_the_heads_get_a_gradient(cplm):
    """As built (not tiny_model's re-randomised copy), the zero LM head gives the backbone an exact zero gradient
    at step 0, and so does the CP head, whose W_Q starts at zero. A random W_Q gave the backbone's scalars
    rounding noise there (their true gradient is zero: RMSnorm ignores the scale they set), which Adam turned
    into full-size steps that differed with the thread count."""
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(vocab_size=8192, bos_id=0, num_layers=4, model_dim=128, num_heads=2,
                                max_seq_len=1024, cplm=cplm))
    ids = torch.tensor(toy_corpus(1025, 5, bos=0))[None]
    model(ids[:, :-1], ids[:, 1:]).backward()
    heads = {"lm_head.weight", "copy_logit_bias", "cp_head.w_q.weight"}
    for name, p in model.named_parameters():
        assert (p.grad.abs().sum() > 0) == (name in heads), name


def test_the_pointer_sentinel_starts_closed_as_cplm_does():
    """As built, lam <= 1 / padded vocab at every position at step 0 in both gates (CPLM: c = 1 / V; the
    sentinel: the sink's score bias log(T V) against context scores that W_Q = 0 makes 0)."""
    ids = torch.tensor(toy_corpus(257, 8))[None]
    for gate in ("lm", "sentinel"):
        torch.manual_seed(0)
        model = tg.GPT(tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=2, model_dim=32, num_heads=2,
                                    max_seq_len=256, cplm=1, copy_gate=gate))
        lam = model(ids[:, :-1], ids[:, 1:], token_stats=True)["lam"]
        assert 0 < lam.max() <= 1 / model.config.padded_vocab, gate


def test_cplm_adds_only_the_cp_head_and_stop_grad_cuts_its_gradient():
    vanilla, cplm = tiny_model(0), tiny_model(1, cp_dim=16)
    extra = sum(p.numel() for p in cplm.parameters()) - sum(p.numel() for p in vanilla.parameters())
    assert extra == 2 * 16 * 32 + 16 + 1  # W_Q, W_K, the sink key, the <copy> bias
    assert cplm.config.padded_vocab == vanilla.config.padded_vocab == 512 and cplm.config.copy_id == VOCAB
    ids = torch.tensor([[BOS] + list(range(10)) * 6 + [1] * 3])
    targets = torch.roll(ids, -1, 1)
    grads = {}
    for stop in (0, 1):
        model = tiny_model(1, cp_dim=16, cp_stop_grad=stop)
        model(ids, targets).backward()
        grads[stop] = model.blocks[0].mlp.c_fc.weight.grad.clone()
        assert model.cp_head.w_q.weight.grad.abs().sum() > 0  # the CP head itself still learns
    assert not torch.allclose(grads[0], grads[1])  # the CP head's gradient reaches the backbone...
    # ...and with cp_stop_grad it is exactly the gradient of the loss with q, k held constant
    model = tiny_model(1, cp_dim=16)
    h, doc_ids = model.hidden_states(ids)
    q, k, sink = model.cp_head(h.detach())
    copyable = tg.target_in_context(ids, targets, doc_ids, model.config.padded_vocab)
    stats = tg.cplm_target_log_prob(model.lm_logits(h), q, k, sink, ids, targets, doc_ids, copyable, VOCAB,
                                    copy_bias=model.copy_logit_bias)
    (-stats["log_p"].mean()).backward()
    torch.testing.assert_close(model.blocks[0].mlp.c_fc.weight.grad, grads[1])


def test_speedrun_preset_is_the_record(monkeypatch):
    """The 2025-01-26 record's shapes and settings, counted independently from its source: 4 embedding tables
    of 50257 x 768, a 50304 x 768 head, 12 MLPs, attention in every layer but 7, long windows in layers
    0, 4, 7, 11; 8 x 48Ki tokens a step, 1770 steps, val on 10,485,760 tokens in 4 x 64Ki-token rows."""
    monkeypatch.setattr(tg.run_files, "header_vocab_size", lambda patterns: 0)  # FineWeb's shards state none
    a = tg.resolve_vocabulary(tg.parse_args(["--preset", "speedrun"]))
    assert (a.vocab_size, a.bos_id) == (50257, 50256)  # so GPT-2's
    assert (a.batch_size, a.seq_len, a.val_seq_len, a.val_tokens) == (8 * 48 * 1024, 48 * 1024, 4 * 64 * 1024, 10485760)
    assert (a.num_iterations, a.cooldown_frac, a.val_loss_every, a.logit_softcap) == (1770, 0.4, 125, 15.0)
    assert (a.lr_embed, a.lr_head, a.lr_scalar, a.lr_muon, a.muon_momentum) == (0.6, 0.008, 0.04, 0.05, 0.95)
    with torch.device("meta"):
        model = tg.GPT(tg.GPTConfig.from_args(a, fp8_head=1))
    mlp, attention = 2 * 768 * 3072 + 2, 3 * 768 * 768 + 768 * 768 + 2  # + each module's two mixing scalars
    record = 4 * 50257 * 768 + 50304 * 768 + 12 * mlp + 11 * attention + 6  # + 6 U-net skip weights
    assert sum(p.numel() for p in model.parameters()) == record
    assert [i for i, b in enumerate(model.blocks) if b.attn is None] == [7]
    assert [i for i, long in enumerate(model.long_window) if long] == [0, 4, 7, 11]
    assert model.lm_head.fp8_scales == (2.0, 2.0 ** 9, 2.0 ** 19)
    adam, muon = tg.build_optimizers(model, a, 0, 1)
    assert [g["lr"] for g in adam.param_groups] == [0.008, 0.6, 0.04] and adam.defaults["betas"] == (0.8, 0.95)
    assert adam.defaults["eps"] == 1e-10 and sum(len(g["params"]) for g in muon.param_groups) == 12 * 2 + 11 * 2


def test_fp8_head_matches_bf16_values_and_gradients():
    """The FP8 LM-head matmul (the record's scales) against the same product in float32: values and both
    gradients within FP8's precision (e4m3 operands: 3 mantissa bits; e5m2 gradient: 2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(1024, 64, generator=g) * 0.02).requires_grad_()
    grad_out = torch.randn(512, 1024, generator=g).bfloat16() * 1e-4  # the scale of a mean-loss gradient
    out = tg.fp8_matmul(x, w, 2.0, 2.0 ** 9, 2.0 ** 19)[0]
    out.backward(grad_out)
    x_ref, w_ref = x.detach().float().requires_grad_(), w.detach().requires_grad_()
    ref = x_ref @ w_ref.t()
    ref.backward(grad_out.float())

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel(out, ref) < 0.05 and rel(x.grad, x_ref.grad) < 0.1 and rel(w.grad, w_ref.grad) < 0.1
    # the module uses it only while training; evaluation is the bf16/fp32 product
    head = tg.CastedLinear(64, 1024, fp8_scales=(2.0, 2.0 ** 9, 2.0 ** 19))
    with torch.no_grad():
        head.weight.copy_(w)
    assert rel(head(x.detach()[None]), ref[None].detach()) < 0.05
    head.eval()
    torch.testing.assert_close(head(x.detach()), F.linear(x.detach(), w.detach().bfloat16()))


def test_fp8_gradient_scale_follows_gradient_accumulation():
    """One GPU accumulating 8 micro-steps of loss / 8 gets the 8-GPU gradient (the mean of 8 full-loss
    gradients) only if the FP8 gradient scale is multiplied by 8: a gradient 8x smaller would lose more of
    its tail in e5m2. With the scaling, every micro-step's FP8 gradient is bit for bit the 8-GPU one."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(256, 64, generator=g).bfloat16() for _ in range(8)]
    w = torch.randn(512, 64, generator=g) * 0.02
    # a mean loss over 48Ki tokens and 50304 slots has logit gradients of about 1e-10 to 1e-9: e5m2's tail
    grad_outs = [torch.randn(256, 512, generator=g).bfloat16() * 1e-9 for _ in range(8)]

    def weight_grad(scales, divide):
        wp = w.clone().requires_grad_()
        for x, go in zip(xs, grad_outs):
            tg.fp8_matmul(x, wp, *scales)[0].backward(go / divide)
        return wp.grad / (8 / divide)  # 8 GPUs: all-reduce average of the 8 per-GPU gradients

    record = (2.0, 2.0 ** 9, 2.0 ** 19)
    eight_gpus = weight_grad(record, divide=1)
    accumulated = weight_grad((2.0, 2.0 ** 9, 2.0 ** 19 * 8), divide=8)
    unscaled = weight_grad(record, divide=8)
    torch.testing.assert_close(accumulated, eight_gpus, rtol=1e-6, atol=0)
    assert (unscaled - eight_gpus).abs().max() > 1e-3 * eight_gpus.abs().max()  # what the fix prevents


def test_fp8_grad_scale_set_from_grad_accum():
    """train() multiplies the head's FP8 gradient scale by grad_accum (source check: the loop needs a GPU)."""
    import inspect
    src = inspect.getsource(tg.train)
    assert "model.lm_head.fp8_scales = (x_scale, w_scale, grad_scale * grad_accum)" in src
    assert src.index("grad_scale * grad_accum") < src.index("torch.compile(model")


def test_fp8_head_compiles_with_inductor():
    """Inductor checks a custom op's real output strides against its fake ones (grad_w is a transposed
    view): the FP8 head, compiled with the default backend, gives eager's loss and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    head = tg.CastedLinear(64, 512, fp8_scales=(2.0, 2.0 ** 9, 2.0 ** 19))
    x, y = torch.randn(1, 256, 64).bfloat16(), torch.randint(0, 500, (1, 256))

    def loss_and_grad(fn):
        head.weight.grad = None
        xx = x.clone().requires_grad_()
        loss = fn(xx, y)
        loss.backward()
        return loss.detach(), xx.grad, head.weight.grad.clone()

    eager = loss_and_grad(lambda xx, yy: tg.vanilla_nll(head(xx), yy, 15.0))
    compiled = loss_and_grad(torch.compile(lambda xx, yy: tg.vanilla_nll(head(xx), yy, 15.0), dynamic=False))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("cplm", [0, 1])
def test_cuda_path_traces_as_one_graph(cplm, monkeypatch):
    """The GPU code path (FlexAttention masks and CP sums, FP8 head, bf16 activations) traced on CPU under
    torch.compile(fullgraph=True): three training steps at three window sizes reuse one graph (the window
    is a tensor), gradients are finite, and evaluation adds exactly one graph (eval mode, longer rows).
    FlexAttention refuses a backward on CPU; lifting its device check runs its math path instead."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    torch._dynamo.reset()
    from test_gpu_preflight import gpu_path_model  # the CUDA path's model: flex, FP8 head, bf16 embeddings
    model = gpu_path_model(cplm)
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counter)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # steps, so zero-initialised layers pass gradients on
    rows = torch.tensor(toy_corpus(3 * 385, 5)).view(3, 385)
    for step, window in enumerate((1, 2, 3)):
        loss = compiled(rows[step:step + 1, :-1], rows[step:step + 1, 1:], torch.tensor(window, dtype=torch.int32))
        loss.backward()
        assert torch.isfinite(loss) and loss.dtype == torch.float32
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert model.lm_head.weight.grad.abs().sum() > 0
        assert step < 2 or model.blocks[0].attn.qkv_w.grad.abs().sum() > 0  # once c_proj has moved
        opt.step()
        model.zero_grad(set_to_none=True)
    assert counter.frame_count == 1  # one graph for every window size: no recompile
    model.eval()
    val = torch.tensor(toy_corpus(513, 6))[None]
    with torch.no_grad():
        stats = compiled(val[:, :-1], val[:, 1:], torch.tensor(4, dtype=torch.int32), token_stats=True)
    assert torch.isfinite(stats["nll"]).all() and stats["nll"].shape == (1, 512)
    assert counter.frame_count == 2
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------
# optimizers and schedules


def test_newton_schulz_orthogonalises_and_muon_scales():
    G = torch.randn(2, 64, 32)
    X = tg.newton_schulz(G)
    s = torch.linalg.svdvals(X.float())
    assert X.shape == G.shape and ((s > 0.5) & (s < 1.3)).all()  # the quintic's band around 1
    p = torch.nn.Parameter(torch.zeros(64, 32))
    p.grad = torch.randn(64, 32)
    opt = tg.Muon([p], lr=0.1, momentum=0.9)
    opt.step()
    expected = -0.1 * 2 ** 0.5 * tg.newton_schulz(p.grad.lerp(p.grad * 0.1, 0.9))
    torch.testing.assert_close(p.detach(), expected)


def test_schedules():
    a = tg.Hyperparameters(num_iterations=100, cooldown_frac=0.4)
    assert tg.lr_multiplier(0, a) == 1 and tg.lr_multiplier(59, a) == 1
    assert tg.lr_multiplier(80, a) == pytest.approx(0.55) and tg.lr_multiplier(100, a) == pytest.approx(0.1)
    # the record: next multiple of 128 of 1728 x step / steps, at least 128 tokens, in blocks of 128
    record = tg.Hyperparameters()
    for step in range(record.num_iterations + 1):
        tokens = 1728 * step / record.num_iterations
        expected = next(x for x in range(128, int(tokens) + 129, 128) if x >= tokens) // 128
        assert tg.window_blocks(step, record) == expected
    assert tg.window_blocks(0, record) == 1 and tg.window_blocks(1770, record) == 14
    assert tg.window_blocks(7, tg.Hyperparameters(attn_window_start=1024, attn_window=1024)) == 8


@pytest.mark.parametrize("capability, fp8", [((9, 0), True), ((8, 9), True), ((8, 6), False), ((8, 0), False)])
def test_the_fp8_head_is_chosen_where_the_gpu_has_fp8_matmuls(monkeypatch, capability, fp8):
    """--fp8_head -1 (the default): FP8 on Hopper and Ada (sm_89: RTX 4090, L4, L40S), bf16 on an A100 (sm_80) or
    an RTX 3090 (sm_86), never on a CPU; 1 and 0 force it; the model then holds the LM head's FP8 scales or none."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert tg.use_fp8_head(-1, cuda) is fp8 and not tg.use_fp8_head(-1, cpu)
    assert tg.use_fp8_head(1, cuda) and tg.use_fp8_head(1, cpu) and not tg.use_fp8_head(0, cuda)
    model = tg.GPT(tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=2, model_dim=32, num_heads=2, max_seq_len=64,
                                fp8_head=int(tg.use_fp8_head(-1, cuda))))
    assert (model.lm_head.fp8_scales is not None) is fp8


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the gradient times 0.95 (a planted kernel fault)."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 0.95 * grad


@pytest.mark.parametrize("fault", [None, "lse_grad_0.95"])
def test_gpu_cp_check_runs_and_passes_on_cpu(monkeypatch, capsys, fault):
    """The GPU check's CUDA-against-reference check (cuda_cp_check.py), run here at a small size with
    FlexAttention's math path (its CPU device check lifted), so the first GPU run gets a working script. A
    planted fault, the LSEs' gradients scaled by 0.95, stays inside the elementwise tolerances (bf16's) and is
    caught by the gradients' norm-wise error."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    check = _load("gpu_check/cuda_cp_check.py")
    if fault:
        copy_lses = tg.copy_lses
        monkeypatch.setattr(tg, "copy_lses", lambda *a, **k: tuple(map(_ScaledGradient.apply, copy_lses(*a, **k))))
    torch._dynamo.reset()
    assert check.main("cpu", T=512, compile_backend="aot_eager") == (1 if fault else 0)
    out = capsys.readouterr().out
    if fault:
        relative = re.search(r"d/d q: .* \|flex - reference\| / \|reference\| (\S+) finite=True MISMATCH", out)
        assert relative and 0.02 < float(relative[1]) < 0.1, out  # the scaling's share of dq: above the 2% bound
    else:
        assert "cuda cp check: PASS" in out and out.count(" ok") == 6
