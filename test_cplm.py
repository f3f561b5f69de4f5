"""CPU test suite: `python -m pytest -q test_cplm.py` (a few minutes on 2 cores, no GPU, no internet)."""
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import inference
import run_files
import train_gpt_cplm as tg

ROOT = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(ROOT, "train_gpt_cplm.py")


def _load(relative_path):
    """One of the repository's scripts as a module, its folder on sys.path as when it runs as a script
    (experiments/ import experiments/cli.py; data/ and records/ scripts import their neighbours)."""
    path = Path(ROOT) / relative_path
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_experiment(name):
    return _load(f"experiments/{name}.py")


compare = _load("tools/compare.py")  # the judge (its own tests: test_compare.py)
BOS, VOCAB = 499, 500  # the toy corpora's tokenizer: ids 0..499, BOS 499
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# ----------------------------------------------------------------------------------------------------
# helpers: an independent shard writer and a tiny corpus


def write_shard(path, tokens, version=1, vocab=VOCAB, magic=20240520, truncate=0):
    header = np.zeros(256, dtype="<i4")
    header[:4] = [magic, version, len(tokens), vocab]
    body = np.asarray(tokens, dtype="<u2" if version == 1 else "<u4").tobytes()
    with open(path, "wb") as f:
        f.write(header.tobytes() + body[:len(body) - truncate])


def toy_corpus(n, seed, vocab=VOCAB, bos=BOS):
    """Documents of 20-300 tokens from a small alphabet, so tokens recur inside documents."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        out += [bos] + list(rng.integers(0, 60, rng.integers(20, 300)))
    return out[:n]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    write_shard(d / "toy_train_000000.bin", toy_corpus(60_000, 0))
    write_shard(d / "toy_train_000001.bin", toy_corpus(60_000, 1))
    write_shard(d / "toy_val_000000.bin", toy_corpus(20_000, 2))
    return d


def tiny_flags(data_dir, log_dir, **over):
    flags = dict(preset="cpu", train_files=f"{data_dir}/toy_train_*.bin", val_files=f"{data_dir}/toy_val_*.bin",
                 vocab_size=VOCAB, bos_id=BOS, num_layers=2, model_dim=64, num_heads=2, batch_size=1024,
                 seq_len=256, val_seq_len=512, val_tokens=2048, num_iterations=6, val_loss_every=3,
                 attn_window=256, attn_window_start=128, log_dir=log_dir, run_id="run")
    flags.update(over)
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def run_cli(args, nproc=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT]
    cmd = (cmd if nproc else [sys.executable, SCRIPT]) + args
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def log_values(path, kind):
    return log_values_in(open(path).read().split("=" * 100 + "\n", 1)[1], kind)


def log_values_in(text, kind):
    return [float(x) for x in re.findall(rf"^step:\d+/\d+ {kind}:([-\d.naif]+)", text, re.M)]


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


def random_documents(B, T, bos, seed, vocab=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    ids[ids == bos] = 0
    ids[:, 0] = bos
    starts = torch.randint(1, T, (B, 4), generator=g)  # a few more documents per row
    ids.scatter_(1, starts, bos)
    return ids


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
    chunked = tg.VanillaLossCPU.apply(u, y, cap, chunk)
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
        assert isinstance(model.head_loss, tg.EagerCPUHeadLoss)
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
    monkeypatch.setattr(tg, "header_vocab_size", lambda patterns: 0)  # FineWeb's shards state no vocabulary
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


# ----------------------------------------------------------------------------------------------------
# the command line, end to end


@pytest.mark.parametrize("gate", ["lm", "sentinel"])
def test_cli_run_writes_a_complete_log(toy_data, tmp_path, gate):
    r = run_cli(tiny_flags(toy_data, tmp_path, cplm=1, copy_gate=gate))
    assert r.returncode == 0, r.stderr[-2000:]
    log = open(tmp_path / "run.txt").read()
    assert log.startswith(open(SCRIPT).read())  # the code that ran
    assert re.search(r"^hyperparameters: \{.*\"cplm\": 1", log, re.M)
    # the one scalar that starts the gate closed, named for the gate it belongs to
    assert re.search(rf"^parameters: [\d,]+ \(CP head and {'<copy>' if gate == 'lm' else 'sink'} bias: ", log, re.M)
    assert len(log_values(tmp_path / "run.txt", "train_loss")) == 6
    assert len(log_values(tmp_path / "run.txt", "val_loss")) == 3  # steps 0, 3, 6
    assert re.search(r"^step:6/6 copy_share:[\d.]+ nll_copyable:[\d.]+ nll_other:[\d.]+ lam:[\d.]+ c:[\d.]+ s:[\d.]+ "
                     r"lam_other:[\d.]+ gate_cost_other:[\d.]+$",
                     log, re.M)
    assert re.search(r"^peak memory", log, re.M) and re.search(r"^final val_loss:[\d.]+", log, re.M)


@pytest.mark.parametrize("args, message", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--cplm", "2"], "--cplm must be 0 or 1"),
])
def test_bad_flags_exit_2_with_one_line(args, message):
    r = run_cli(args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--num_iterations", "many"], "invalid int value: 'many'"),
    (["--seq_len", "1000"], "multiple of 128"),
    (["--preset", "tpu"], "--preset must be one of"),
    (["--copy_gate_init", "1"], "must lie in [0, 1)"),
    (["--num_heads", "0"], "--num_heads must be >= 1"),
    (["--num_heads", "-2"], "--num_heads must be >= 1"),
    (["--model_dim", "0"], "--model_dim >= --num_heads"),
    (["--run_id", "a/b"], "must be a plain name"),
    (["--lr_head", "-0.1"], "--lr_head -0.1"),
    (["--lr_muon", "inf"], "--lr_muon inf"),
    (["--cp_stop_grad", "7"], "must be 0 or 1"),
    (["--val_loss_every", "-5"], "--val_loss_every -5"),
    (["--checkpoint_every", "-1"], "--checkpoint_every -1"),
    (["--keep_checkpoints", "0"], "--keep_checkpoints must be >= 1"),
    (["--vocab_size", "-3"], "--vocab_size must be >= 0"),
    # a hostile tester's: huge sizes that failed much later (a 256 GB allocation, an overflow, a C++ traceback)
    (["--num_layers", "100000"], "--num_layers 100000 (at most 1024)"),
    (["--attn_window", "99999999999"], "--attn_window 99999999999"),
    (["--cp_dim", "10000000"], "--cp_dim 10000000"),
    (["--vocab_size", "4000000000"], "--vocab_size 4000000000"),
    (["--dist_timeout_s", "99999999999999"], "--dist_timeout_s 99999999999999"),
    (["--logit_softcap", "inf"], "--logit_softcap must lie in [0, 1000]"),
    (["--logit_softcap", "1e30"], "--logit_softcap must lie in [0, 1000]"),
    (["--logit_softcap", "nan"], "--logit_softcap must lie in [0, 1000]"),
    (["--preset", "cpu", "--no_attention_layer", "99"], "--no_attention_layer 99 is not a layer of a 4-layer model"),
    (["--copy_gate_init", "0.5", "--cplm", "0"], "--copy_gate_init sets the CP head's gate: it needs --cplm 1"),
    (["--copy_gate", "pointer"], "--copy_gate is lm or sentinel (got 'pointer')"),
    (["--data_seed", "-2"], "--data_seed in [-1, 2^63)"),
    (["--copy_gate", "sentinel", "--cplm", "0"], "sentinel needs --cplm 1 and no --copy_gate_init"),
    (["--copy_gate", "sentinel", "--cplm", "1", "--copy_gate_init", "0.5"], "sentinel needs --cplm 1"),
    (["--preset", "cpu", "--cp_backend", "flex"], "--cp_backend flex needs a CUDA GPU"),
    (["--run_id", "r" * 300], "--run_id is 300 characters: at most 200"),
    (["--log_dir", ""], "--log_dir must name a folder"),
    (["--num_layers", "3"], "--num_layers must be even"),
    (["--target_val_loss", "nan"], "must be >= 0: --target_val_loss nan"),  # once: "must be >= 0: " and nothing
    (["--cp_stop_grad", "1", "--cplm", "0"], "--cp_stop_grad is an ablation of the CP head: it needs --cplm 1"),  # once accepted, then 'pop from empty list' (U-net)
])
def test_bad_values_are_usage_errors(args, message):
    with pytest.raises(tg.UsageError, match=re.escape(message)):
        tg.parse_args(args)


def test_help_describes_every_flag():
    helps = {f.name: tg.FIELD_HELP.get(f.name, "") for f in tg.dataclasses.fields(tg.Hyperparameters)}
    assert all(len(text) > 5 for text in helps.values()), [k for k, v in helps.items() if len(v) <= 5]


def test_log_dir_and_run_id_problems_are_one_line(toy_data, tmp_path):
    (tmp_path / "file").write_text("x")
    r = run_cli(tiny_flags(toy_data, tmp_path / "file" / "logs"))  # a directory under a regular file
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot write there" in r.stderr
    first = run_cli(tiny_flags(toy_data, tmp_path, num_iterations=1, val_loss_every=0))
    assert first.returncode == 0
    again = run_cli(tiny_flags(toy_data, tmp_path, num_iterations=1, val_loss_every=0))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "run.txt exists" in again.stderr
    assert len(re.findall("^final val_loss", (tmp_path / "run.txt").read_text(), re.M)) == 1  # the log is intact
    assert run_cli(tiny_flags(toy_data, tmp_path, num_iterations=1, val_loss_every=0, overwrite=1)).returncode == 0


def test_a_vocabulary_stated_by_a_header_has_the_flags_limit(tmp_path):
    """A hostile tester's: a header stating 20,000,000 ids passed where --vocab_size 20000000 is refused (a 5 GB
    embedding, then a traceback under a memory limit and a stray log)."""
    for name in ("h_train_000000.bin", "h_val_000000.bin"):
        write_shard(tmp_path / name, toy_corpus(3000, 0), vocab=20_000_000)
    a = tg.parse_args(["--preset", "cpu", "--train_files", str(tmp_path / "h_train_*.bin"),
                       "--val_files", str(tmp_path / "h_val_*.bin")])
    with pytest.raises(tg.DataError, match="state a vocabulary of 20000000 ids, more than 2\\^24"):
        tg.resolve_vocabulary(a)


def test_shard_problems_stop_before_the_model_in_one_line(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    write_shard(data / "toy_train_000000.bin", toy_corpus(60_000, 0))
    write_shard(data / "toy_train_000001.bin", toy_corpus(100, 1) + [BOS, 600, 3])  # an id past VOCAB = 500
    write_shard(data / "toy_val_000000.bin", toy_corpus(20_000, 2))
    r = run_cli(tiny_flags(data, tmp_path))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "toy_train_000001.bin: holds token id 600, but --vocab_size is 500" in r.stderr
    assert not (tmp_path / "run.txt").exists()  # refused before the model: no log left to block the rerun
    # a hostile tester's: a train glob that takes the validation shard too trained on it silently
    (data / "toy_train_000001.bin").unlink()
    r = run_cli(tiny_flags(data, tmp_path, train_files=f"{data}/toy_*.bin"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "share" in r.stderr and "toy_val_000000.bin" in r.stderr and not (tmp_path / "run.txt").exists()
    # a byte-level corpus states its vocabulary: it sets vocab_size and bos_id, and a different flag is refused
    for name, tokens in (("train", toy_corpus(8000, 0, vocab=200, bos=256)), ("val", toy_corpus(4000, 1, vocab=200, bos=256))):
        write_shard(data / f"bytes_{name}_000000.bin", tokens, vocab=257)
    flags = dict(train_files=f"{data}/bytes_train_*.bin", val_files=f"{data}/bytes_val_*.bin", num_iterations=1,
                 val_loss_every=0, vocab_size=0, bos_id=-1)
    r = run_cli(tiny_flags(data, tmp_path, run_id="bytes", **flags))
    assert r.returncode == 0, r.stderr
    hp = json.loads(re.search(r"^hyperparameters: (.*)$", (tmp_path / "bytes.txt").read_text(), re.M).group(1))
    assert (hp["vocab_size"], hp["bos_id"]) == (257, 256)
    r = run_cli(tiny_flags(data, tmp_path, run_id="bytes2", **{**flags, "vocab_size": 50257}))
    assert r.returncode == 1 and "written for a vocabulary of 257 ids, --vocab_size is 50257" in r.stderr


def test_resume_continues_the_run_exactly_and_refuses_what_does_not_fit(toy_data, tmp_path):
    """kill -9 then --resume: the same losses, the clock where it stopped, the log continued; checkpoints
    rotate, and a half-written one left by a kill is removed; new learning rates apply; a checkpoint past
    the end, unreadable, or of another model is refused."""
    full = run_cli(tiny_flags(toy_data, tmp_path, run_id="full", checkpoint_every=1, keep_checkpoints=2))
    assert full.returncode == 0, full.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["state_step000005.pt", "state_step000006.pt"]
    assert not list(tmp_path.glob(".*.lock")), "a finished run leaves no lock file"
    ckpt = tmp_path / "full" / "state_step000005.pt"
    log = (tmp_path / "full.txt").read_text()
    logged_ms = float(re.search(r"^step:5/6 train_loss:\S+ train_time:(\d+)ms", log, re.M).group(1))
    saved_ms = torch.load(ckpt, weights_only=False)["training_time_ms"]
    assert abs(saved_ms - logged_ms) < 200 and saved_ms > 0  # the clock at the checkpoint, not at the last val
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a writer killed while saving: its pid is gone
    half = tmp_path / "full" / f"state_step000009.pt.{dead}.tmp"
    half.write_bytes(b"half a checkpoint")
    # step 6's checkpoint is there: resuming from step 5 would replace it, so that needs --overwrite 1
    refused = run_cli(tiny_flags(toy_data, tmp_path, run_id="", resume=ckpt))
    assert refused.returncode == 2 and "holds checkpoints after this one (state_step000006.pt)" in refused.stderr
    abandoned = tmp_path / "full" / "state_step000009.pt"  # a later step of the branch --overwrite abandons
    abandoned.write_bytes(b"a later checkpoint")
    flags = tiny_flags(toy_data, tmp_path, run_id="", resume=ckpt, overwrite=1)
    del flags[flags.index("--log_dir"):flags.index("--log_dir") + 2]  # its own log is found beside the checkpoints
    resumed = run_cli(flags)  # continues run "full"
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = (tmp_path / "full.txt").read_text()
    assert log.count("def main(argv=None)") == 1 and "resumed from" in log  # one log, a section appended
    assert "removed" in log and not half.exists() and not abandoned.exists()
    assert sorted(p.name for p in (tmp_path / "full").glob("*.pt")) == ["state_step000005.pt", "state_step000006.pt"]
    aside, = (tmp_path / "full").glob("replaced_*")  # the abandoned branch's, none of them resumable into this log
    assert sorted(p.name for p in aside.iterdir()) == ["state_step000006.pt", "state_step000009.pt"]
    first, second = log.split("=" * 100 + "\n", 1)[1].split("=" * 100 + "\nresumed from")
    for kind in ("train_loss", "val_loss"):
        np.testing.assert_allclose(log_values_in(second, kind)[-1], log_values_in(first, kind)[-1], rtol=1e-6)
    last_ms, last_avg = map(float, re.findall(r"^step:6/6 train_loss:\S+ train_time:(\d+)ms step_avg:([\d.]+)ms",
                                             log, re.M)[-1])
    assert last_ms > saved_ms and last_avg == pytest.approx(last_ms / 6, abs=0.1)  # train_time is rounded
    parsed = compare.parse_log(tmp_path / "full.txt")  # both sections, the resumed one winning where they overlap
    assert [v["step"] for v in parsed["val"]] == [0, 3, 6] and [t["step"] for t in parsed["train"]] == list(range(1, 7))
    # new learning rates on the command line apply, and the log says so
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="new_rate", resume=ckpt, lr_head=0.004, val_loss_every=0))
    assert r.returncode == 0, r.stderr[-2000:]
    log = (tmp_path / "new_rate.txt").read_text()
    assert re.search(r"changed on the command line: .*--lr_head 0\.008 -> 0\.004", log)
    # past the end: nothing to do, nothing written
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="late", num_iterations=4, resume=ckpt))
    assert r.returncode == 0 and "nothing to train: the checkpoint is at step 5" in r.stdout
    assert not (tmp_path / "late").exists() and not (tmp_path / "late.txt").exists()
    # into another run's name with --overwrite (a hostile tester's: "new_rate.txt appeared while this run was
    # starting" and a stray temporary log): said, nothing written, the other run's log untouched
    before = (tmp_path / "new_rate.txt").read_bytes()
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="new_rate", num_iterations=4, resume=ckpt, overwrite=1))
    assert r.returncode == 0 and "nothing to train" in r.stdout, r.stderr[-2000:]
    assert (tmp_path / "new_rate.txt").read_bytes() == before and not list(tmp_path.glob(".new_rate.txt.starting*"))
    # a fresh run replacing "full" (--overwrite 1) replaces its checkpoints too: no old one is left to resume
    # into the new log (copied aside first: the checks below still need one)
    shutil.copy(ckpt, tmp_path / "kept.pt")
    ckpt = tmp_path / "kept.pt"
    # --keep_checkpoints counts the run's checkpoints, not one process's: continuing it to step 8 rotates 5 and 6 out
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="", resume=tmp_path / "full" / "state_step000006.pt",
                           num_iterations=8, val_loss_every=0))
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "full").glob("*.pt")) == [
        "state_step000007.pt", "state_step000008.pt"], r.stderr[-2000:]
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="full", overwrite=1, num_iterations=3, checkpoint_every=1,
                           keep_checkpoints=2, val_loss_every=0))
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "full").glob("*.pt")) == [
        "state_step000002.pt", "state_step000003.pt"]
    # unreadable and mismatched checkpoints: one line, exit 1, and no log left behind
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "cut.pt").write_bytes(ckpt.read_bytes()[:5000])
    for bad, message in ((tmp_path / "junk.pt", "not a readable checkpoint"), (tmp_path / "cut.pt", "not a readable checkpoint")):
        r = run_cli(tiny_flags(toy_data, tmp_path, run_id="bad", resume=bad))
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="bad", resume=ckpt, model_dim=32, cplm=1))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "model_dim 64 -> 32" in r.stderr and "cplm 0 -> 1" in r.stderr
    assert not (tmp_path / "bad.txt").exists()


def test_nothing_is_replaced_unless_asked_and_started(toy_data, tmp_path):
    """Faults a hostile tester found: --resume into another run's id wrote into that finished run; a refused
    --overwrite run deleted the old log; a resume took changed settings silently (and a forgotten
    --num_iterations extended the run to the preset's 200 steps); a checkpoint whose tensor bytes changed
    resumed silently."""
    def log_of(run):
        return (tmp_path / f"{run}.txt").read_bytes()

    assert run_cli(tiny_flags(toy_data, tmp_path, run_id="a", checkpoint_every=2)).returncode == 0
    assert run_cli(tiny_flags(toy_data, tmp_path, run_id="b", checkpoint_every=2)).returncode == 0
    a_ckpt, b_ckpt = tmp_path / "a" / "state_step000004.pt", tmp_path / "b" / "state_step000004.pt"
    before = {p: p.read_bytes() for p in (tmp_path / "a.txt", tmp_path / "b.txt", b_ckpt)}
    # 1. resuming a's checkpoint under b's id: refused, b untouched
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="b", resume=a_ckpt))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "b.txt exists" in r.stderr
    assert all(p.read_bytes() == b for p, b in before.items())
    # 2. --overwrite 1 with a bad shard: refused before it started, the old log and checkpoints intact
    bad = tmp_path / "bad"
    bad.mkdir()
    write_shard(bad / "toy_train_000000.bin", toy_corpus(5000, 0), magic=1)
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="b", overwrite=1, train_files=f"{bad}/toy_train_*.bin"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert all(p.read_bytes() == b for p, b in before.items()) and not list(tmp_path.glob(".b.txt*"))
    # 3. a resume continues with the checkpoint's settings: a forgotten --num_iterations is the run's 6, not the
    # preset's 200; a changed setting is applied and listed
    args = tiny_flags(toy_data, tmp_path, run_id="", resume=a_ckpt)
    i = args.index("--num_iterations")
    r = run_cli(args[:i] + args[i + 2:] + ["--logit_softcap", "20", "--overwrite", "1"])  # step 6's is replaced
    assert r.returncode == 0, r.stderr[-2000:]
    log = log_of("a").decode()
    assert "continuing at step 4" in log and "changed on the command line: --logit_softcap 15.0 -> 20.0" in log
    run_lines = log.split("=" * 100 + "\n", 1)[1]  # after the script's own source
    assert run_lines.count("resumed from") == 1 and "final val_loss" in log.split("continuing at step 4")[1]
    assert re.findall(r"^step:(\d+)/(\d+) train_loss", log, re.M)[-1] == ("6", "6")
    # 4. a checkpoint whose tensor bytes changed (a valid file: the zip reader would not notice) is refused
    state = torch.load(b_ckpt, weights_only=True)
    state["model"]["embed.weight"][3, :8] = 9.5e14
    torch.save(state, tmp_path / "corrupt.pt")
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="c", resume=tmp_path / "corrupt.pt"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "do not match the digest" in r.stderr
    # a checkpoint from before the digest (no "digest" key) still resumes
    del state["digest"]
    state["model"]["embed.weight"][3, :8] = 0.0
    torch.save(state, tmp_path / "old.pt")
    assert run_cli(tiny_flags(toy_data, tmp_path, run_id="d", resume=tmp_path / "old.pt")).returncode == 0


def test_a_pipe_among_the_inputs_is_refused_not_waited_on(toy_data, tmp_path):
    """A FIFO matched by --train_files once blocked the trainer forever (np.fromfile waits for a writer), and
    one inside a tokenizer input folder blocked the tokenizer: now a one-line refusal, and a skipped file."""
    data = tmp_path / "d"
    shutil.copytree(toy_data, data)
    os.mkfifo(data / "toy_train_000009.bin")
    r = run_cli(tiny_flags(data, tmp_path), timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not a regular file" in r.stderr
    assert not (tmp_path / "run.txt").exists() and not list(tmp_path.glob(".run.txt*"))
    folder = tmp_path / "texts"
    _text_files(folder)
    os.mkfifo(folder / "pipe.txt")
    out = tmp_path / "out"
    assert tc.main([str(folder), "--encoding", "bytes", "--out_dir", str(out), "--name", "t"]) == 0
    r = _run([TOKENIZE, folder / "pipe.txt", "--encoding", "bytes", "--out_dir", out, "--name", "u"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "neither a regular file nor a folder" in r.stderr


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """A full disk during a checkpoint once gave a 23-line traceback: now a DataError (one line from the
    command line), no temporary file, and the previous checkpoint untouched."""
    a = tg.Hyperparameters(keep_checkpoints=2)
    model = torch.nn.Linear(4, 4)
    opts = [torch.optim.Adam(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)]
    loader = types.SimpleNamespace(state=lambda: {"position": 0})
    written, first = [], str(tmp_path / "run" / "state_step000001.pt")
    tg.save_checkpoint(first, model, opts, 1, loader, 10.0, a, written)
    saved = open(first, "rb").read()

    def full_disk(obj, path):
        open(path, "wb").write(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tg.torch, "save", full_disk)
    with pytest.raises(tg.DataError, match="cannot save the checkpoint \\(No space left on device\\)"):
        tg.save_checkpoint(str(tmp_path / "run" / "state_step000002.pt"), model, opts, 2, loader, 20.0, a, written)
    assert sorted(os.listdir(tmp_path / "run")) == ["state_step000001.pt"] and open(first, "rb").read() == saved


@pytest.mark.slow
def test_finished_two_process_jobs_exit_0_every_time(toy_data, tmp_path):
    """A finished 2-process job once exited 1 in about 3 of 8 runs (a rank tore its gloo connections down while
    the other still used them: "terminate called without an active exception"). Ten in a row must exit 0."""
    for i in range(10):
        r = run_cli(tiny_flags(toy_data, tmp_path, run_id=f"r{i}", num_iterations=4, val_loss_every=2, cplm=1), nproc=2)
        assert r.returncode == 0 and "terminate called" not in r.stderr, (i, r.stderr[-1500:])


def test_a_usage_error_under_torchrun_is_said_once(toy_data, tmp_path):
    """Both ranks once printed the same error; now rank 0 alone says it (torchrun adds its own report)."""
    r = run_cli(tiny_flags(toy_data, tmp_path, cplm=7), nproc=2)
    assert r.returncode != 0 and r.stderr.count("--cplm must be 0 or 1") == 1


def test_a_refused_start_under_torchrun_ends_at_once(toy_data, tmp_path):
    """A hostile tester's: only rank 0 checked the log's name, so rank 1 waited in the rendezvous until torchrun
    killed it (~33 s). Every rank now makes the read-only checks and refuses at once."""
    import time
    assert run_cli(tiny_flags(toy_data, tmp_path, num_iterations=0)).returncode == 0
    t0 = time.monotonic()
    r = run_cli(tiny_flags(toy_data, tmp_path, num_iterations=0), nproc=2)
    assert r.returncode != 0 and r.stderr.count("run.txt exists") == 1, r.stderr[-2000:]
    assert time.monotonic() - t0 < 25
    # the same for the run's lock, which only rank 0 takes: every rank hears of the refusal after the rendezvous
    import fcntl
    with open(tmp_path / ".other.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        r = run_cli(tiny_flags(toy_data, tmp_path, num_iterations=0, run_id="other"), nproc=2)
    assert r.returncode != 0 and r.stderr.count("is training in another process") == 1, r.stderr[-2000:]
    assert time.monotonic() - t0 < 25


def test_sigterm_ends_the_log_with_a_stopped_line(toy_data, tmp_path):
    """A scheduler's SIGTERM once left a log without a "stopped:" line, ended mid-run."""
    import signal as sig
    import time
    args = [sys.executable, SCRIPT] + tiny_flags(toy_data, tmp_path, num_iterations=100000, val_loss_every=0)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not re.search(r"^step:3/", (tmp_path / "run.txt").read_text()
                                                          if (tmp_path / "run.txt").exists() else "", re.M):
        time.sleep(0.2)
    proc.send_signal(sig.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "stopped by signal SIGTERM" in err
    assert (tmp_path / "run.txt").read_text().splitlines()[-1] == "stopped: SystemExit: stopped by signal SIGTERM"


def test_missing_data_names_the_download_command(tmp_path):
    r = run_cli(["--preset", "cpu", "--train_files", str(tmp_path / "none_*.bin"), "--log_dir", str(tmp_path)])
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "python data/cached_fineweb10B.py" in r.stderr
    assert not list(tmp_path.glob("*.txt"))  # refused before it started: no log to block the rerun


def test_two_processes_equal_one_with_accumulation_and_warmup_changes_nothing(toy_data, tmp_path):
    """1 process x 4 micro-steps after 2 warm-up steps, and 2 processes x 2 micro-steps (gloo) with none, train
    on the same data: the same losses. So the split over ranks changes nothing, and neither does the warm-up
    (its steps and its validation row compile the kernels; model, optimizers and loader are then reset)."""
    flags = dict(num_iterations=4, val_loss_every=2, cplm=1)
    one = run_cli(tiny_flags(toy_data, tmp_path, run_id="one", warmup_steps=2, **flags))
    two = run_cli(tiny_flags(toy_data, tmp_path, run_id="two", **flags), nproc=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    for kind in ("train_loss", "val_loss"):
        a, b = log_values(tmp_path / "one.txt", kind), log_values(tmp_path / "two.txt", kind)
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4)
    assert "world_size: 2" in open(tmp_path / "two.txt").read()
    assert "warm-up done: 2 steps" in open(tmp_path / "one.txt").read()


def test_one_and_two_processes_agree_with_the_default_thread_counts(tmp_path):
    """Without OMP_NUM_THREADS a single process takes every core and each of two ranks half of them, so their
    sums split differently. Rows of 512 x 128 are summed in parallel, and at V = 8192 the closed gate (c = 1/V)
    made CPLM drift by 2.5e-4 in 3 steps: its random W_Q sent the backbone's scalars rounding noise at step 0
    (about 1e-10, where RMSnorm makes their gradient exactly zero) and Adam (eps 1e-10) made full-size steps of
    it. With W_Q starting at zero both modes agree to 1e-4, the README's promise."""
    for name, seed in (("toy_train_000000.bin", 0), ("toy_train_000001.bin", 1), ("toy_val_000000.bin", 2)):
        write_shard(tmp_path / name, toy_corpus(60_000, seed), vocab=8192)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for cplm in (0, 1):
        flags = dict(vocab_size=8192, num_layers=2, model_dim=128, seq_len=512, val_seq_len=512, batch_size=2048,
                     val_tokens=4096, attn_window=512, num_iterations=4, val_loss_every=2, cplm=cplm)
        for run_id, nproc in (("one", None), ("two", 2)):
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
            cmd = [sys.executable, *launcher, SCRIPT, *tiny_flags(tmp_path, tmp_path, run_id=f"{run_id}{cplm}", **flags)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
            assert r.returncode == 0, r.stderr[-2000:]
        for kind in ("train_loss", "val_loss"):
            a, b = (log_values(tmp_path / f"{run_id}{cplm}.txt", kind) for run_id in ("one", "two"))
            assert len(a) == len(b) > 0
            np.testing.assert_allclose(a, b, rtol=1e-4, err_msg=f"cplm={cplm} {kind}")


def test_ranks_started_with_different_flags_are_refused_together(toy_data, tmp_path):
    """A hostile tester's: --lr_muon or --seq_len given to rank 1 only trained to exit 0 with wrong losses. The ranks
    compare a digest of their settings after the rendezvous and all refuse, in one line, before anything trains."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank, extra in ((0, []), (1, ["--lr_muon", "0.01"])):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *tiny_flags(toy_data, tmp_path), *extra], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert "different settings" in outs[0][1] and outs[0][1].count("\n") == 1
    assert not (tmp_path / "run.txt").exists()


@pytest.mark.slow
def test_a_stuck_rank_ends_the_job(toy_data, tmp_path):
    """Stop (not kill) one of two ranks mid-run: after --dist_timeout_s the other rank's collective fails and
    torchrun ends the job with a non-zero exit, instead of both waiting forever."""
    import signal
    import time
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
           *tiny_flags(toy_data, tmp_path, run_id="stuck", num_iterations=100000, val_loss_every=0, dist_timeout_s=5)]
    job = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        log = tmp_path / "stuck.txt"
        deadline = time.time() + 120
        while not (log.exists() and "step:3/" in log.read_text()) and time.time() < deadline:
            time.sleep(0.5)
        ranks = {}
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and int(open(f"/proc/{pid}/stat").read().split(") ")[1].split()[1]) == job.pid:
                    env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
                    ranks[env.get("RANK")] = int(pid)
            except OSError:
                continue
        os.kill(ranks["1"], signal.SIGSTOP)
        started = time.time()
        assert job.wait(timeout=180) != 0
        assert time.time() - started < 120
        assert re.search(r"^stopped: .*", log.read_text(), re.M)  # rank 0's log says why
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:  # the job has ended, as it should
            pass


def test_nan_loss_stops_with_a_message(toy_data, tmp_path):
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="nan", lr_scalar="1e30", lr_muon="1e30",
                           num_iterations=20, val_loss_every=0))
    assert r.returncode == 1
    log = open(tmp_path / "nan.txt").read()
    assert re.search(r"^stopped: train_loss is nan", log, re.M)

# ====================================================================================================
# data/tokenize_corpus.py and data/cached_fineweb10B.py

TOKENIZE = Path(ROOT) / "data" / "tokenize_corpus.py"
DOWNLOAD = Path(ROOT) / "data" / "cached_fineweb10B.py"
tc = _load("data/tokenize_corpus.py")
dl = _load("data/cached_fineweb10B.py")


def _run(args, env_update=None, unset=(), cwd=None):
    """python ARGS (a script and its arguments) in a subprocess, its environment updated and unset."""
    env = dict(os.environ)
    env.update(env_update or {})
    for k in unset:
        env.pop(k, None)
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def _split_docs(tokens, bos):
    """Split a token stream into documents at BOS (each document starts with BOS)."""
    starts = np.flatnonzero(tokens == bos).tolist()
    assert starts and starts[0] == 0, "stream must start with BOS"
    return [tokens[a:b] for a, b in zip(starts, starts[1:] + [len(tokens)])]


def _read_split(out_dir, name, split):
    files = sorted(Path(out_dir).glob(f"{name}_{split}_*.bin"))
    headers, arrays = zip(*(tc.read_shard(f) for f in files))
    return files, list(headers), np.concatenate(arrays)


def _make_corpus(root):
    """Files on disk + the documents they should produce, in order, for inputs [a.txt, tree/, e.jsonl]."""
    (root / "tree" / "sub").mkdir(parents=True)
    (root / "tree" / ".hidden").mkdir()
    files = {
        "a.txt": "plain text file\nwith two lines\n",
        "tree/b.md": "# markdown\n",
        "tree/c.py": "print('hi')  # <|endoftext|> is just text here\n",
        "tree/sub/d.txt": "caf\u00e9 \u2603 non-ascii\n",
        "tree/empty.txt": "  \n\n",          # whitespace only: skipped
        "tree/skip.bin": "not matched by --glob",  # filtered out
        "tree/.hidden/h.txt": "hidden folder: skipped",
    }
    for rel, text in files.items():
        (root / rel).write_text(text, encoding="utf-8")
    (root / "tree" / "sub" / "bad.txt").write_bytes(b"bad \xff\xfe bytes\n")  # undecodable: replaced
    records = [{"text": "first json doc", "id": 1}, {"text": ""}, {"text": "second \"json\" doc\n"},
               {"text": "third <|endoftext|> doc"}]
    (root / "e.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    docs = [files["a.txt"], files["tree/b.md"], files["tree/c.py"], "bad \ufffd\ufffd bytes\n", files["tree/sub/d.txt"],
            "first json doc", "second \"json\" doc\n", "third <|endoftext|> doc"]
    return [root / "a.txt", root / "tree", root / "e.jsonl"], docs


# ----------------------------------------------------------------------------------------------------
# tokenize_corpus.py

def test_bytes_corpus_split_and_headers(tmp_path, capsys):
    inputs, docs = _make_corpus(tmp_path)
    out = tmp_path / "out"
    frac, seed = 0.4, 3
    rc = tc.main([*map(str, inputs), "--encoding", "bytes", "--out_dir", str(out), "--name", "toy",
                  "--val_fraction", str(frac), "--seed", str(seed)])
    assert rc == 0
    assert "docs" in capsys.readouterr().out
    expected = [np.array([256] + list(d.encode("utf-8")), dtype=np.uint32) for d in docs]
    got = {}
    for split in ("val", "train"):
        files, headers, tokens = _read_split(out, "toy", split)
        assert [f.name for f in files] == [f"toy_{split}_000000.bin"]
        for h, f in zip(headers, files):
            assert (h["magic"], h["version"], h["vocab_size"]) == (20240520, 1, 257)
            assert f.stat().st_size == 1024 + 2 * h["num_tokens"]
        assert sum(h["num_tokens"] for h in headers) == len(tokens)
        got[split] = _split_docs(tokens, 256)
    # the split follows the hash rule (unless a split would be empty), is disjoint and covers every doc in order
    val_idx = [i for i in range(len(docs)) if tc.is_val(seed, i, frac)]
    assert 0 < len(val_idx) < len(docs), "pick a seed giving both splits for this test"
    assert [d.tolist() for d in got["val"]] == [expected[i].tolist() for i in val_idx]
    assert [d.tolist() for d in got["train"]] == [expected[i].tolist() for i in range(len(docs)) if i not in val_idx]
    assert sum(map(len, got["val"] + got["train"])) == sum(map(len, expected))
    assert not list(out.glob(".*")), "no temporary files left"


def test_shard_cutting_stale_files_and_max_tokens(tmp_path):
    inputs, docs = _make_corpus(tmp_path)
    out = tmp_path / "out"
    stream = np.concatenate([[256] + list(d.encode("utf-8")) for d in docs])
    common = [*map(str, inputs), "--encoding", "bytes", "--out_dir", str(out), "--name", "s", "--val_fraction", "0.2"]
    assert tc.main(common + ["--shard_tokens", "16"]) == 0
    train_files, headers, train = _read_split(out, "s", "train")
    _, _, val = _read_split(out, "s", "val")
    assert len(train_files) > 3 and all(h["num_tokens"] == 16 for h in headers[:-1])
    assert 1 <= headers[-1]["num_tokens"] <= 16 and train[0] == 256
    assert len(train) + len(val) == len(stream)
    # a rerun with bigger shards replaces the set: no stale shard of the earlier run remains
    assert tc.main(common + ["--shard_tokens", "1000000"]) == 0
    assert [f.name for f in sorted(out.glob("s_*.bin"))] == ["s_train_000000.bin", "s_val_000000.bin"]
    # --max_tokens caps the total (the last document is truncated), both splits still non-empty
    assert tc.main(common + ["--max_tokens", "40"]) == 0
    _, _, train = _read_split(out, "s", "train")
    _, _, val = _read_split(out, "s", "val")
    assert len(train) + len(val) == 40 and train[0] == 256 and val[0] == 256


def test_small_corpus_forces_both_splits(tmp_path):
    (tmp_path / "x.txt").write_text("one")
    (tmp_path / "y.txt").write_text("two")
    out = tmp_path / "out"
    assert tc.main([str(tmp_path / "x.txt"), str(tmp_path / "y.txt"), "--encoding", "bytes",
                    "--out_dir", str(out), "--name", "p"]) == 0
    _, _, val = _read_split(out, "p", "val")
    _, _, train = _read_split(out, "p", "train")
    assert len(_split_docs(val, 256)) == 1 and len(_split_docs(train, 256)) == 1


class _WideEncoding:
    """A fake tokenizer whose ids exceed uint16."""
    name, n_vocab, eot_token = "wide", 70_000, 69_999

    def encode_ordinary(self, text):
        return [65_536 + ord(c) % 4000 for c in text]


def test_version2_when_ids_exceed_uint16(tmp_path):
    docs = ["abc", "hello world", "zzz", "more text"]
    summary = tc.tokenize_corpus(iter(docs), _WideEncoding(), tmp_path, "w", val_fraction=0.3, num_threads=1,
                                 log=lambda *a: None)
    assert summary["versions"] == [2]
    alltok = []
    for split in ("val", "train"):
        files, headers, tokens = _read_split(tmp_path, "w", split)
        assert all((h["version"], h["vocab_size"]) == (2, 70_000) for h in headers)
        assert all(f.stat().st_size == 1024 + 4 * h["num_tokens"] for f, h in zip(files, headers))
        assert tokens.dtype == np.uint32 and tokens[0] == 69_999
        alltok.append(tokens)
    assert sorted(np.concatenate(alltok).tolist()) == sorted(
        sum(([69_999] + _WideEncoding().encode_ordinary(d) for d in docs), []))
    # write_shard on its own: uint16 up to a 65536 vocabulary, ids checked against the vocabulary
    p = tmp_path / "one.bin"
    assert tc.write_shard(p, [0, 65_535], 65_536) == 1
    assert tc.read_shard(p)[1].tolist() == [0, 65_535]
    with pytest.raises(ValueError):
        tc.write_shard(p, [50_257], 50_257)
    p.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError):
        tc.read_shard_header(p)


@pytest.mark.skipif(not os.environ.get("TIKTOKEN_CACHE_DIR"),
                    reason="needs GPT-2's tokenizer files offline: set TIKTOKEN_CACHE_DIR to a folder holding them "
                           "(tiktoken fills one on first use with internet)")
def test_gpt2_roundtrip(tmp_path):
    try:
        enc = tc.load_encoding("gpt2")
    except tc.TokenizerUnavailable:
        pytest.skip("TIKTOKEN_CACHE_DIR holds no gpt2 files: run tiktoken.get_encoding('gpt2') once with "
                    "internet and that folder set")
    inputs, docs = _make_corpus(tmp_path)
    out = tmp_path / "out"
    assert tc.main([*map(str, inputs), "--out_dir", str(out), "--name", "g", "--val_fraction", "0.3",
                    "--threads", "2"]) == 0
    decoded = []
    for split in ("val", "train"):
        _, headers, tokens = _read_split(out, "g", split)
        assert all((h["version"], h["vocab_size"]) == (1, 50_257) for h in headers)
        decoded += [(i, enc.decode(d[1:].tolist())) for i, d in enumerate(_split_docs(tokens, 50_256))]
    # a literal "<|endoftext|>" in the text is plain text, not a BOS: one BOS per document exactly
    assert sorted(t for _, t in decoded) == sorted(docs)


def test_gpt2_unavailable_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    import tiktoken

    def offline(name):
        raise ConnectionError("no route to openaipublic.blob.core.windows.net")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    (tmp_path / "a.txt").write_text("x")
    rc = tc.main([str(tmp_path / "a.txt"), "--out_dir", str(tmp_path / "o"), "--name", "n"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert "GPT-2 tokenizer" in err[0] and "TIKTOKEN_CACHE_DIR" in err[0] and "--encoding bytes" in err[0]


def test_bad_inputs_exit_2_nothing_written(tmp_path):
    out = tmp_path / "out"
    r = _run([TOKENIZE, tmp_path / "missing.txt", "--encoding", "bytes", "--out_dir", out, "--name", "m"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "missing.txt" in r.stderr
    r = _run([TOKENIZE, "--encoding", "bytes", "--out_dir", out, "--name", "m"])  # no input at all
    assert r.returncode == 2
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    r = _run([TOKENIZE, tmp_path / "ok.txt", tmp_path / "bad.jsonl", "--encoding", "bytes", "--out_dir", out,
              "--name", "m"])
    assert r.returncode == 2 and "bad.jsonl:3" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir()), "nothing (not even a temporary file) is left"
    r = _run([TOKENIZE, tmp_path / "ok.txt", "--encoding", "bytes", "--out_dir", out, "--name", "m"])
    assert r.returncode == 2 and "at least 2" in r.stderr  # a single document cannot be split


def test_stdlib_listing():
    files = tc.stdlib_files()
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == tc.stdlib_files()  # deterministic


# ----------------------------------------------------------------------------------------------------
# cached_fineweb10B.py

UNREACHABLE = {"HF_ENDPOINT": "http://127.0.0.1:9"}


def _fake_shard(path, ntok=5):
    path.parent.mkdir(parents=True, exist_ok=True)
    tc.write_shard(path, np.full(ntok, 50256), 50257)


def test_download_skips_present_files(tmp_path):
    # a copy of the script in a fresh folder: the default target is next to the script, whatever the cwd
    (tmp_path / "data").mkdir()
    script = tmp_path / "data" / "cached_fineweb10B.py"
    script.write_text(DOWNLOAD.read_text())
    for name in ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]:
        _fake_shard(tmp_path / "data" / "fineweb10B" / name)
    r = _run([script, "2"], UNREACHABLE, unset=["HF_HUB_OFFLINE"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    skipped = [l for l in r.stdout.splitlines() if l.startswith("skip ")]
    assert len(skipped) == 3 and str(tmp_path / "data" / "fineweb10B") in skipped[0]
    assert "fineweb_train_000002.bin" in skipped[2]
    # --edu uses its own names and folder
    for name in ["finewebedu_val_000000.bin", "finewebedu_train_000001.bin"]:
        _fake_shard(tmp_path / "edu" / name)
    r = _run([script, "1", "--edu", "--dir", tmp_path / "edu"], UNREACHABLE, unset=["HF_HUB_OFFLINE"])
    assert r.returncode == 0, r.stderr
    assert sum(l.startswith("skip ") for l in r.stdout.splitlines()) == 2


def test_download_unreachable_hub_one_line_exit_1(tmp_path):
    target = tmp_path / "fw"
    r = _run([DOWNLOAD, "1", "--dir", target], UNREACHABLE, unset=["HF_HUB_OFFLINE"])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "huggingface.co" in lines[0] and "fineweb_val_000000.bin" in lines[0]
    assert not target.exists(), "nothing left behind"


def test_download_bad_args_and_broken_local_file(tmp_path):
    assert _run([DOWNLOAD, "0", "--dir", tmp_path]).returncode == 2
    assert _run([DOWNLOAD, "two", "--dir", tmp_path]).returncode == 2
    (tmp_path / "fineweb_val_000000.bin").write_bytes(b"\0" * 2000)  # not a shard
    r = _run([DOWNLOAD, "1", "--dir", tmp_path], UNREACHABLE, unset=["HF_HUB_OFFLINE"])
    assert r.returncode == 1 and "delete it" in r.stderr


def test_download_failure_midway_leaves_no_partial_file(tmp_path, monkeypatch):
    import huggingface_hub
    calls, failing = [], {"fineweb_train_000001.bin"}

    def fake_download(repo_id, filename, repo_type, local_dir):
        assert repo_type == "dataset" and repo_id == "kjj0/fineweb10B-gpt2"
        calls.append(filename)
        if filename in failing:  # dies half way, as hf_hub_download would: a partial .incomplete file
            hfdir = Path(local_dir) / ".cache" / "huggingface" / "download"
            hfdir.mkdir(parents=True, exist_ok=True)
            (hfdir / f"abc.{filename}.incomplete").write_bytes(b"partial")
            raise OSError("connection reset by peer")
        _fake_shard(Path(local_dir) / filename)
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(dl, "_hub_unreachable", lambda endpoint: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    target = tmp_path / "fw"
    assert dl.download(2, local_dir=target, out=lambda *a: None) == 1
    assert calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert sorted(p.name for p in target.iterdir()) == [".cache", "fineweb_val_000000.bin"]
    assert not list(target.rglob("*.incomplete"))
    # the rerun skips the finished file and fetches the rest
    calls.clear()
    failing.clear()
    assert dl.download(2, local_dir=target, out=lambda *a: None) == 0
    assert calls == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]

# ====================================================================================================
# experiments/race.py and experiments/cp_cost.py


def test_race_configurations_are_valid_command_lines():
    race = _load_experiment("race")
    for name, flags in {**race.CONFIGS, **race.GATE_CONFIGS}.items():
        args = tg.parse_args(["--preset", "cpu", *flags, *race.RACE_FLAGS])
        assert args.num_iterations == 100 and args.cplm == (0 if "vanilla" in name else 1), name
    assert tg.parse_args(["--preset", "cpu", *race.CONFIGS["sw_cplm"]]).attn_window == 128
    byte_level = tg.parse_args(["--preset", "cpu", *race.CONFIGS["bytes_cplm"]])
    assert byte_level.vocab_size < byte_level.model_dim  # the control's point: no softmax bottleneck
    # the prose race: the same learning-rate scales for both modes, rows of one length, validation every 5%
    for name, flags in race.PROSE_CONFIGS.items():
        args = tg.parse_args(["--preset", "cpu", *[("7" if x == "{seed}" else x) for x in flags]])
        scale = float(name.rsplit("_lr", 1)[1])
        assert args.lr_muon == pytest.approx(0.04 * scale) and args.lr_head == pytest.approx(0.008 * scale), name
        assert args.seq_len == args.val_seq_len and args.val_loss_every <= 0.05 * args.num_iterations
        assert args.num_iterations >= 1000 and args.copy_gate_init == (0.5 if "open" in name else 0.0)
    assert {n.rsplit("_lr", 1)[1] for n in race.PROSE_CONFIGS if "vanilla" in n} == set(race.LR_SCALES)


def test_cp_cost_naive_baseline_computes_the_same_lses():
    cp_cost = _load_experiment("cp_cost")
    ids = random_documents(1, 300, 7, 5)
    targets = torch.roll(ids, -1, 1)
    doc_ids = tg.doc_ids_of(ids, 7)
    copyable = tg.target_in_context(ids, targets, doc_ids, 16)
    q, k = torch.randn(2, 1, 300, 8).unbind(0)
    naive = cp_cost.naive_copy_lses(q, k, ids, targets, doc_ids)
    chunked = tg.copy_lses(q, k, ids, targets, doc_ids, copyable, "dense", chunk=64)
    torch.testing.assert_close(naive[0], chunked[0])
    torch.testing.assert_close(naive[1][copyable], chunked[1][copyable])
    assert torch.isneginf(naive[1][~copyable]).all()


# ====================================================================================================
# experiments/spamlang.py

spamlang = _load_experiment("spamlang")
SPAMLANG = Path(ROOT) / "experiments" / "spamlang.py"
REPO = Path(ROOT)


def _in_context(inputs, targets):
    """(B, T) bool by brute force: the target occurs at some position <= t of the row."""
    B, T = inputs.shape
    return torch.tensor([[bool((inputs[b, :t + 1] == targets[b, t]).any()) for t in range(T)] for b in range(B)])


def test_spamlang_repeat_batch():
    V, B, T = 1000, 5, 16
    x, y, copy = spamlang.make_batch("repeat", V, B, T, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == copy.shape == (B, T) and copy.dtype == torch.bool
    assert (x[:, 0] == V - 1).all() and torch.equal(x[:, 1:], y[:, :-1])
    first = y[:, :1]
    assert (first < V - 1).all() and (y == first).all() and (x[:, 1:] == first).all()
    assert not copy[:, 0].any() and copy[:, 1:].all()
    assert torch.equal(copy, _in_context(x, y))  # every target after the first token is a copy
    again = spamlang.make_batch("repeat", V, B, T, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip((x, y, copy), again))


@pytest.mark.parametrize("T", [8, 32, 64])
def test_spamlang_span_batch(T):
    V, B = 300, 40
    x, y, copy = spamlang.make_batch("span", V, B, T, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == copy.shape == (B, T)
    assert (x[:, 0] == V - 1).all() and (x[:, 1:] != V - 1).all() and (y != V - 1).all()
    assert torch.equal(x[:, 1:], y[:, :-1])
    in_context = _in_context(x, y)
    for b in range(B):
        pos = copy[b].nonzero().flatten().tolist()
        n = len(pos) + 1  # span length: its first token is not a copy position
        assert spamlang.MIN_SPAN <= n <= min(spamlang.MAX_SPAN, T // 2)
        assert pos == list(range(pos[0], pos[0] + n - 1))  # one contiguous recurrence
        # in context = the copy positions plus the recurrence's first token (in context, not predictable);
        # nothing else repeats, so every copy target is unambiguous
        expect = copy[b].clone()
        expect[pos[0] - 1] = True
        assert torch.equal(in_context[b], expect)
        src = [int((x[b] == y[b, t]).nonzero()[0]) for t in pos]  # where each copied token first occurs
        assert src == list(range(src[0], src[0] + n - 1)) and src[-1] < pos[0]
    with pytest.raises(ValueError):
        spamlang.make_batch("nope", V, B, T, torch.Generator())


@pytest.mark.parametrize("task,cplm", [("repeat", 0), ("repeat", 1), ("span", 1)])
def test_spamlang_run_one_tiny(task, cplm, tmp_path):
    log = tmp_path / "run.txt"
    r = spamlang.run_one(task, 512, cplm, steps=3, batch=2, seq_len=32, seed=0, eval_seqs=4, eval_every=2,
                         log_path=str(log))
    assert 0 <= r["copy_acc"] <= 1 and 0 <= r["copy_acc_step0"] <= 1 and r["wall_s"] > 0
    assert r["mode"] == ("cplm" if cplm else "vanilla") and r["train_loss"] == r["train_loss"]  # finite
    assert ("lam" in r) == bool(cplm) and (0 <= r["lam"] <= 1 if cplm else True)
    lines = log.read_text().splitlines()
    assert lines[0].startswith("config: ") and json.loads(lines[0][8:])["vocab_size"] == 512
    steps = [line.split()[0] for line in lines if line.startswith("step:")]
    assert steps == ["step:0/3", "step:2/3", "step:3/3"]
    assert lines[-1].startswith("final copy_acc:")


def test_spamlang_cli_writes_results(tmp_path):
    out = tmp_path / "out"
    args = ["--task", "both", "--vocabs", "512", "--steps", "2", "--batch", "2", "--seq_len", "32",
            "--eval_seqs", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(SPAMLANG), *args], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    md = (out / "results.md").read_text()
    assert "python experiments/spamlang.py " + " ".join(args) in md.split("|")[0]  # the command comes first
    assert sum(line.startswith(("| repeat |", "| span |")) for line in md.splitlines()) == 4
    data = json.loads((out / "results.json").read_text())
    assert {(r["task"], r["mode"]) for r in data["results"]} == {(t, m) for t in ("repeat", "span")
                                                                  for m in ("vanilla", "cplm")}
    assert all(0 <= r["copy_acc"] <= 1 and r["vocab_size"] == 512 for r in data["results"])
    assert len(list(out.glob("*_V512_*_seed0.txt"))) == 4
    assert (out / "spamlang.png").exists() or "no plot written" in p.stdout
    with pytest.raises(SystemExit) as exit_info:
        spamlang.parse_args(["--task", "nope"])
    assert exit_info.value.code == 2


def test_spamlang_import_has_no_side_effects(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("spamlang_again", SPAMLANG)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert capsys.readouterr().out == "" and not list(tmp_path.iterdir())


def test_spamlang_gate_init_is_recorded(tmp_path):
    log = tmp_path / "run.txt"
    spamlang.run_one("repeat", 512, 1, steps=1, batch=1, seq_len=16, seed=0, eval_seqs=1, log_path=str(log),
                     copy_gate_init=0)  # closed: c = 1 / padded vocabulary (640 slots)
    lines = log.read_text().splitlines()
    assert json.loads(lines[0][8:])["copy_gate_init"] == pytest.approx(1 / 640)
    c0 = float(lines[1].split(" c:")[1].split()[0])
    assert c0 == pytest.approx(1 / 640, abs=1e-4)


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
    """tools/cuda_cp_check.py, the GPU session's reference check, run here at a small size with
    FlexAttention's math path (its CPU device check lifted), so a rare GPU session gets a working script. A
    planted fault, the LSEs' gradients scaled by 0.95, stays inside the elementwise tolerances (bf16's) and is
    caught by the gradients' norm-wise error."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    check = _load("tools/cuda_cp_check.py")
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


# ----------------------------------------------------------------------------------------------------
# bad input to the entry points other than the training script: one line, exit 2 (usage) or 1 (data)


COMPARE = Path(ROOT) / "tools" / "compare.py"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"  # the first bytes of a PNG image
ELF = b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00>\x00"  # ... and of a Linux executable


def assert_one_line(stderr, *words):
    """The rule for bad input: exactly one line on stderr, no traceback, saying what was found."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def _text_files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("first document\n")
    (folder / "b.txt").write_text("second document\n")
    return [folder / "a.txt", folder / "b.txt"]


# ----------------------------------------------------------------------------------------------------
# every entry point: a bad flag is one line and exit 2


@pytest.mark.parametrize("script,args", [
    (TOKENIZE, ["--out_dir", "o", "--name", "n"]),             # no input
    (TOKENIZE, ["x.txt", "--out_dir", "o", "--name", "n", "--seed", "one"]),
    (DOWNLOAD, ["two"]),
    (COMPARE, []),                                             # no log given
    (COMPARE, ["logs/*.txt", "--target", "abc"]),
])
def test_stdlib_tools_usage_errors_are_one_line(tmp_path, script, args):
    r = _run([script, *args], cwd=tmp_path)
    assert r.returncode == 2
    assert_one_line(r.stderr, "error:", "--help")
    assert not list(tmp_path.iterdir()), "nothing written"


# ----------------------------------------------------------------------------------------------------
# data/tokenize_corpus.py


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_tokenize_unwritable_out_dir_is_one_line_exit_1(tmp_path, where):
    inputs = _text_files(tmp_path / "in")
    (tmp_path / "plain").write_text("a regular file")
    out = tmp_path / "plain" / "shards" if where == "under_a_file" else tmp_path / "plain"
    r = _run([TOKENIZE, *inputs, "--encoding", "bytes", "--out_dir", out, "--name", "t"])
    assert r.returncode == 1
    assert_one_line(r.stderr, "--out_dir", str(out))
    assert (tmp_path / "plain").read_text() == "a regular file"


def test_tokenize_removes_temporary_files_of_a_killed_run(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # what a killed run leaves: a shard written under its temporary name, never renamed
    killed = tc._SplitWriter(out, "t", "train", 4, 257)
    killed.add(np.arange(6, dtype=np.uint32))
    stale = killed.written[0][0]
    assert stale.exists() and stale.name.startswith(".t_train_000000.bin.tmp")
    other = out / ".other_train_000000.bin.tmp1"  # another corpus's: not ours to remove
    other.write_bytes(b"x")
    assert tc.main([*map(str, _text_files(tmp_path / "in")), "--encoding", "bytes", "--out_dir", str(out),
                    "--name", "t"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "interrupted run" in line]
    assert len(said) == 1 and stale.name in said[0]
    assert not stale.exists() and other.exists()
    assert sorted(p.name for p in out.iterdir()) == [other.name, "t_train_000000.bin", "t_val_000000.bin"]


def test_tokenize_leaves_other_corpora_alone(tmp_path, capsys):
    """The stale-shard clean-up removes only this corpus's own shards: corpus x must not take x_val's
    (x_val_train_000000.bin once matched x_val_*.bin), and a name with glob characters is refused."""
    out = tmp_path / "out"
    out.mkdir()
    inputs = [*map(str, _text_files(tmp_path / "in"))]
    others = [out / n for n in ("x_val_train_000000.bin", "x_val_val_000000.bin", "x_train_000000.bin.bak",
                                "xx_train_000000.bin", ".x_val_train_000000.bin.tmp9")]
    for f in others:
        f.write_bytes(b"another corpus")
    assert tc.main(inputs + ["--encoding", "bytes", "--out_dir", str(out), "--name", "x"]) == 0
    assert all(f.read_bytes() == b"another corpus" for f in others)
    for name in ("*", "x?", "[x]", "../x", ""):
        with pytest.raises(SystemExit) as e:
            tc.main(inputs + ["--encoding", "bytes", "--out_dir", str(out), "--name", name])
        assert e.value.code == 2
    assert all(f.exists() for f in others) and (out / "x_train_000000.bin").exists()


def test_tokenize_skips_binary_files(tmp_path, capsys):
    folder = tmp_path / "tree"
    _text_files(folder)
    (folder / "logo.txt").write_bytes(PNG + b"\x00" * 64)  # matches --glob, but is an image
    elf = tmp_path / "prog"
    elf.write_bytes(ELF + b"text after the header")  # named explicitly
    out = tmp_path / "out"
    assert tc.main([str(folder), str(elf), "--encoding", "bytes", "--out_dir", str(out), "--name", "t"]) == 0
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipping binary file")]
    assert len(notices) == 2 and "logo.txt" in notices[0] and str(elf) in notices[1]
    tokens = np.concatenate([tc.read_shard(p)[1] for p in sorted(out.glob("t_*.bin"))])
    assert (tokens == 256).sum() == 2 and 0 not in tokens  # the two text documents, and no NUL byte


def test_tokenize_only_binary_inputs_is_one_line_exit_1(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    (tmp_path / "b.bin").write_bytes(ELF)
    out = tmp_path / "out"
    r = _run([TOKENIZE, tmp_path / "a.png", tmp_path / "b.bin", "--encoding", "bytes", "--out_dir", out, "--name", "t"])
    assert r.returncode == 1
    assert_one_line(r.stderr, "binary")
    assert not out.exists() or not any(out.iterdir()), "nothing written"


# ----------------------------------------------------------------------------------------------------
# data/cached_fineweb10B.py


def test_download_docstring_and_help_agree_with_the_code(capsys):
    default = dl.parse_args([]).num_train
    usage = re.search(r"cached_fineweb10B\.py +# val shard \+ first (\d+) train shards", dl.__doc__)
    assert usage and int(usage.group(1)) == default
    hp = tg.Hyperparameters()  # the speedrun preset
    tokens = hp.num_iterations * hp.batch_size + 1  # the loader reads one token past each batch
    need = math.ceil(tokens / 100_000_000)
    assert default >= need
    assert f"{need} train shards the speedrun reads" in dl.__doc__
    with pytest.raises(SystemExit):
        dl.parse_args(["--help"])
    assert f"{hp.num_iterations} x {hp.batch_size:,} tokens = {tokens / 1e8:.1f} shards" in \
        " ".join(capsys.readouterr().out.split())


def test_download_dir_under_a_file_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def must_not_download(**kwargs):
        raise AssertionError("downloaded into an impossible folder")
    monkeypatch.setattr(dl, "_hub_unreachable", lambda endpoint: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", must_not_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    (tmp_path / "plain").write_text("a regular file")
    target = tmp_path / "plain" / "fw"
    assert dl.download(1, local_dir=target, out=lambda *a: None) == 1
    assert_one_line(capsys.readouterr().err, str(target), "--dir")


def test_download_a_folder_where_a_shard_should_be_is_one_line_exit_1(tmp_path, capsys):
    """A directory named like a shard was an IsADirectoryError traceback."""
    (tmp_path / "fineweb_val_000000.bin").mkdir()
    assert dl.download(0, local_dir=tmp_path, out=lambda *a: None) == 1
    assert_one_line(capsys.readouterr().err, "fineweb_val_000000.bin", "not a regular file")


# ----------------------------------------------------------------------------------------------------
# run.sh, requirements.txt and CI


FAKE_PYTHON = """#!/usr/bin/env bash
# records its command line; `-c CODE` fails when CODE names a module listed in FAKE_MISSING that no
# `-m pip install` has installed since
echo "$*" >> "$FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "$FAKE_LOG.installed"; fi
if [ "$1" = "-c" ]; then
    for m in $FAKE_MISSING; do
        case "$2" in *"$m"*) grep -qs " $m" "$FAKE_LOG.installed" || exit 1;; esac
    done
    case "$2" in *device_count*) echo 0;; esac
fi
exit 0
"""


def _run_sh(tmp_path, missing, *args):
    shutil.copy(Path(ROOT) / "run.sh", tmp_path / "run.sh")
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.txt"
    log.unlink(missing_ok=True)
    (tmp_path / "calls.txt.installed").unlink(missing_ok=True)
    env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "FAKE_MISSING": missing,
           "PATH": str(tmp_path / "no_gpu") + ":" + os.environ["PATH"]}
    (tmp_path / "no_gpu").mkdir(exist_ok=True)  # an nvidia-smi that finds no GPU, whatever the machine has
    (tmp_path / "no_gpu" / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (tmp_path / "no_gpu" / "nvidia-smi").chmod(0o755)
    r = subprocess.run(["bash", str(tmp_path / "run.sh"), *args], capture_output=True, text=True, timeout=60, env=env)
    return r, log.read_text().splitlines() if log.exists() else []


def test_run_sh_installs_the_cpu_torch_only_where_none_is_installed(tmp_path):
    r, calls = _run_sh(tmp_path, "torch", "--num_iterations", "5")
    assert r.returncode == 0, r.stderr
    pip = [c for c in calls if c.startswith("-m pip")]
    assert pip[0] == "-m pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert "no GPU: installing the CPU build" in r.stdout and "TORCH_PIP=torch bash run.sh" in r.stdout
    r, calls = _run_sh(tmp_path, "nothing")
    assert not any("install torch" in c for c in calls), "a torch already there is never replaced"


@pytest.mark.parametrize("flag", [["--cplm", "1"], ["--run_id", "foo"], ["--log_dir=X"], ["--preset", "speedrun"],
                                  ["--resume", "logs/x/state_step000004.pt"], ["--overwrite=1"]])
def test_run_sh_refuses_the_flags_the_race_sets(tmp_path, flag):
    """A hostile tester's: run.sh passed its arguments after its own flags, so they won: --cplm 1 trained CPLM
    twice (one log named _vanilla), --run_id foo had the CPLM run refused after vanilla trained, --log_dir made
    compare fail after both. Now refused in one line before anything is built or trained."""
    r, calls = _run_sh(tmp_path, "nothing", "--num_iterations", "5", *flag)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and flag[0].split("=")[0] in r.stderr, r.stderr
    assert not any(c.startswith(("train_gpt_cplm.py", "data/")) for c in calls), calls


def test_run_sh_without_a_gpu_runs_the_race(tmp_path):
    r, calls = _run_sh(tmp_path, "tiktoken", "--num_iterations", "5")
    assert r.returncode == 0, r.stderr
    pip = [c for c in calls if c.startswith("-m pip")]
    assert len(pip) == 1 and "tiktoken" in pip[0] and "torch" not in pip[0]
    train = [c for c in calls if c.startswith("train_gpt_cplm.py")]
    assert [c.split("--cplm ")[1].split()[0] for c in train] == ["0", "1"]  # vanilla, then CPLM
    assert all("--preset cpu" in c and "--save_checkpoint 1" in c and c.endswith("--num_iterations 5") for c in train)
    race = re.search(r"--run_id (cpu_race_\d+_\d+_\d+)_vanilla", train[0]).group(1)
    assert f"--run_id {race}_cplm" in train[1]
    assert calls[-1] == (f"tools/compare.py logs/{race}_vanilla.txt logs/{race}_cplm.txt --target_from vanilla "
                         f"--plot logs/{race}.png")
    assert f"logs/{race}_vanilla.txt and logs/{race}_cplm.txt" in r.stdout  # the logs named before training


def test_overwrite_destroys_nothing_before_the_new_run_can_replace_it(toy_data, tmp_path, monkeypatch):
    """A hostile tester's: --overwrite 1 deleted the old run's checkpoints and replaced its log before the step-0
    validation; a run that crashed there left nothing of either run. Now the log is replaced after the first
    validation, and the old checkpoints are set aside then."""
    assert run_cli(tiny_flags(toy_data, tmp_path, run_id="old", checkpoint_every=2)).returncode == 0
    before = {p: p.read_bytes() for p in [tmp_path / "old.txt", *(tmp_path / "old").iterdir()]}
    monkeypatch.setattr(tg, "evaluate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted crash")))
    with pytest.raises(RuntimeError, match="planted crash"):
        tg.main(tiny_flags(toy_data, tmp_path, run_id="old", overwrite=1, warmup_steps=0))
    after = {p: p.read_bytes() for p in [tmp_path / "old.txt", *(tmp_path / "old").iterdir()]}
    assert after == before and not list(tmp_path.glob(".old.txt.starting*"))


def test_a_replaced_runs_checkpoints_never_continue_the_new_log(toy_data, tmp_path):
    """A hostile tester's: --overwrite kept the old run's checkpoints until the new run's first save, so a new run
    that saved none (or was killed first) left them resumable into its log: one log, two runs' weights and clocks.
    They are set aside when the new log takes the name; resumed from there they start a run of their own."""
    assert run_cli(tiny_flags(toy_data, tmp_path, checkpoint_every=2)).returncode == 0
    r = run_cli(tiny_flags(toy_data, tmp_path, overwrite=1, num_iterations=2, lr_muon=0.01))  # saves nothing
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list((tmp_path / "run").glob("*.pt")) and "checkpoint(s) moved to" in (tmp_path / "run.txt").read_text()
    r = run_cli(tiny_flags(toy_data, tmp_path, resume=tmp_path / "run" / "state_step000006.pt"))
    assert r.returncode == 2 and "no such checkpoint file" in r.stderr
    aside, = (tmp_path / "run").glob("replaced_*")
    r = run_cli(tiny_flags(toy_data, tmp_path, run_id="branch", resume=aside / "state_step000004.pt"))
    assert r.returncode == 0, r.stderr[-2000:]
    body = (tmp_path / "run.txt").read_text().split("=" * 100 + "\n", 1)[1]
    assert "resumed from" not in body and (tmp_path / "branch.txt").exists()  # the new log untouched


def test_a_full_disk_while_logging_is_one_error_and_no_half_line(tmp_path, monkeypatch):
    """A hostile tester's: a full disk while writing the log was an OSError traceback from Logger.__call__ and a
    log cut mid-line. Now the log ends with its last whole line, and a DataError says why."""
    a = tg.parse_args(["--preset", "cpu", "--log_dir", str(tmp_path), "--run_id", "full"])
    log = run_files.Logger(a, True, sources=())
    log.start()
    log("step:1/2 val_loss:1.0", console=False)
    real_open = open

    class HalfWrite:
        def __init__(self, path, mode):
            self.f = real_open(path, mode)

        def __enter__(self):
            return self

        def write(self, text):
            self.f.write(text[:5])
            self.f.flush()
            raise OSError(28, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(run_files, "open", HalfWrite, raising=False)
    with pytest.raises(tg.DataError, match="full.txt: cannot write the log \\(No space left on device\\)"):
        log("step:2/2 val_loss:0.5", console=False)
    assert (tmp_path / "full.txt").read_text().endswith("step:1/2 val_loss:1.0\n")


def test_a_full_disk_while_saving_ends_in_one_error(toy_data, tmp_path, monkeypatch):
    """A hostile tester's (tmpfs): a full disk while saving ended in a 4-level chained traceback, since the log's
    `stopped:` line could not be written either. Now the save's one DataError is what comes out."""
    def full_disk(path, *args):
        raise tg.DataError(f"{path}: cannot save the checkpoint (No space left on device)")
    writes = tg.Logger.__call__

    def log_on_a_full_disk(self, line, *args, **kwargs):
        if line.startswith("stopped:"):
            raise OSError(28, "No space left on device")
        return writes(self, line, *args, **kwargs)
    monkeypatch.setattr(tg, "save_checkpoint", full_disk)
    monkeypatch.setattr(tg.Logger, "__call__", log_on_a_full_disk)
    with pytest.raises(tg.DataError, match="No space left") as raised:
        tg.main(tiny_flags(toy_data, tmp_path, checkpoint_every=2, warmup_steps=0))
    assert raised.value.__context__ is None


def test_a_diverged_model_saves_no_checkpoint_over_good_ones(tmp_path):
    """A hostile tester's: with --checkpoint_every 1 --keep_checkpoints 2 and diverging learning rates, only NaN
    checkpoints remained. A state with a non-finite weight is refused in one line; the good one stays."""
    model, loader = torch.nn.Linear(2, 2), types.SimpleNamespace(state=lambda: {"position": 0})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a, written = tg.parse_args(["--preset", "cpu", "--keep_checkpoints", "1"]), []
    tg.save_checkpoint(str(tmp_path / "run" / "state_step000001.pt"), model, [opt], 1, loader, 0.0, a, written)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(tg.DataError, match=r"weights are not finite .*newest: .*state_step000001\.pt"):
        tg.save_checkpoint(str(tmp_path / "run" / "state_step000002.pt"), model, [opt], 2, loader, 0.0, a, written)
    assert os.listdir(tmp_path / "run") == ["state_step000001.pt"]


def test_start_up_leaves_a_live_writers_temporary_checkpoint(tmp_path):
    """A hostile tester's: --resume of a live run's checkpoint deleted that run's *.pt.tmp mid-save, and the live
    run died. Temporary checkpoints carry their writer's pid; only a dead writer's are removed (and a folder
    name with glob characters matches only itself)."""
    folder, lookalike = tmp_path / "L[1]", tmp_path / "L1"
    folder.mkdir()
    lookalike.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for path in (folder / f"state_step000002.pt.{live.pid}.tmp", folder / f"state_step000003.pt.{dead}.tmp",
                     lookalike / f"state_step000003.pt.{dead}.tmp"):
            path.write_bytes(b"partial")
        removed = tg.remove_dead_writers_files([str(folder)], "state_step*.pt.*.tmp")
    finally:
        live.kill()
    assert removed == [str(folder / f"state_step000003.pt.{dead}.tmp")]
    assert (folder / f"state_step000002.pt.{live.pid}.tmp").exists()
    assert (lookalike / f"state_step000003.pt.{dead}.tmp").exists()
    # a hostile tester's: on a shared filesystem another node's live writer had a pid that is dead here. Names
    # carry the host: another machine's temporary files stay, this one's dead writer's go
    here, there = f"{dead}@{socket.gethostname()}", f"{dead}@another-node.example"
    for name in (f"state_step000004.pt.{here}.tmp", f"state_step000005.pt.{there}.tmp"):
        (folder / name).write_bytes(b"partial")
    assert tg.remove_dead_writers_files([str(folder)], "state_step*.pt.*.tmp") == [
        str(folder / f"state_step000004.pt.{here}.tmp")]
    assert (folder / f"state_step000005.pt.{there}.tmp").exists()
    assert re.fullmatch(r"\d+@.+", run_files.writer_tag())


def test_a_fresh_run_refuses_a_folder_of_earlier_checkpoints(tmp_path):
    """A hostile tester's: with logs/<run_id>.txt gone, a fresh run silently replaced logs/<run_id>/'s
    checkpoints. The folder is the run's, like its log: refused without --overwrite 1."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state_step000004.pt").write_bytes(b"an earlier run's")
    flags = ["--preset", "cpu", "--log_dir", str(tmp_path), "--run_id", "run"]
    with pytest.raises(tg.UsageError, match="holds checkpoints of an earlier run"):
        tg.check_log_target(tg.parse_args(flags))
    tg.check_log_target(tg.parse_args(flags + ["--overwrite", "1"]))


def test_one_process_per_run_id(tmp_path):
    """The hostile tester's #8: two resumes of one checkpoint both ran, appending to one log. Every start takes
    the run's lock (an flock, released when the process ends): a second start of the same run_id is refused."""
    import fcntl
    flags = ["--preset", "cpu", "--log_dir", str(tmp_path), "--run_id", "run"]
    with open(tmp_path / ".run.lock", "a") as held:  # another process's run
        fcntl.flock(held, fcntl.LOCK_EX)
        assert tg.check_log_target(tg.parse_args(flags)) is None  # not taken: main refuses, on every rank
        with pytest.raises(tg.UsageError, match="run run is training in another process"):
            tg.main(flags)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock"]  # nothing written
    tg.check_log_target(tg.parse_args(flags)).close()


def test_a_released_run_lock_leaves_no_file_and_no_gap(tmp_path, monkeypatch):
    """A finished run removes its lock file. Removing it opens a race: a process that opened the file just before
    the removal locks a file no longer at the path while a third locks the path's new file, and both would run.
    Whoever locks re-checks that its file is the path's, and retries."""
    import fcntl
    path = str(tmp_path / ".run.lock")
    lock = run_files.take_run_lock(path)
    assert run_files.take_run_lock(path) is None  # held
    run_files.release_run_lock(lock)
    assert not os.path.exists(path)
    real_flock, calls = fcntl.flock, []

    def released_meanwhile(f, how):  # the holder releases (and removes the file) between this open and this lock
        if not calls:
            os.remove(path)
        calls.append(f)
        return real_flock(f, how)
    monkeypatch.setattr(run_files.fcntl, "flock", released_meanwhile)
    lock = run_files.take_run_lock(path)
    assert len(calls) == 2 and calls[0].closed  # the removed file let go, the path's new one locked
    assert os.fstat(lock.fileno()).st_ino == os.stat(path).st_ino
    monkeypatch.setattr(run_files.fcntl, "flock", real_flock)
    assert run_files.take_run_lock(path) is None
    run_files.release_run_lock(lock)
    third = []

    def released_and_retaken(f, how):  # ... and a third process creates the path's new file and locks it first
        if not third:
            os.remove(path)
            third.append(open(path, "a"))
            real_flock(third[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real_flock(f, how)  # the removed file's lock is free: only the inode check tells
    monkeypatch.setattr(run_files.fcntl, "flock", released_and_retaken)
    assert run_files.take_run_lock(path) is None  # the third's run holds the run_id
    third[0].close()


def test_resume_checks_flags_against_the_checkpoints_settings(tmp_path, monkeypatch):
    """The hostile tester's #13: flags given with --resume were checked against the preset's defaults
    (--seq_len 4096 on a batch-4096 checkpoint was refused), and --copy_gate_init was listed as changed although
    the loaded bias wins."""
    saved = dataclasses.asdict(tg.parse_args(["--preset", "cpu", "--batch_size", "4096", "--cplm", "1"]))
    a = tg.parse_args(["--preset", "cpu", "--resume", "x.pt", "--seq_len", "4096", "--copy_gate_init", "0.5"])
    merged, changed = tg.settings_on_resume(a, saved)
    tg.check_args(dataclasses.replace(merged, resume=""))  # the merged settings make a run
    assert (merged.batch_size, merged.seq_len, merged.cplm, merged.copy_gate_init) == (4096, 4096, 1, 0.0)
    assert changed == ["--seq_len 1024 -> 4096",
                       "--copy_gate_init 0.5 ignored (the checkpoint's weights are loaded)"]


def test_data_scripts_refuse_what_would_fail_later(capsys):
    """Hostile tester's minors: `cached_fineweb10B.py 1000000000` ended in a MemoryError (a list of a billion
    names); a corpus named c_val made c_val_*.bin (its val glob) match its train shards too."""
    for bad in (["1000000000"], ["0"]):
        with pytest.raises(SystemExit) as e:
            dl.parse_args(bad)
        assert e.value.code == 2 and "1..103" in capsys.readouterr().err
    assert dl.parse_args(["103"]).num_train == 103
    with pytest.raises(SystemExit) as e:
        tc.main(["x.txt", "--out_dir", "o", "--name", "c_val"])
    assert e.value.code == 2 and "ends in _val or _train" in capsys.readouterr().err


def test_run_sh_test_runs_every_test_file_and_shows_skip_reasons(tmp_path):
    r, calls = _run_sh(tmp_path, "pytest", "test")
    assert r.returncode == 0, r.stderr
    assert [c for c in calls if c.startswith("-m pip")] == ["-m pip install -q pytest"]
    pytest_call = calls[-1].split()
    assert pytest_call[:4] == ["-m", "pytest", "-q", "-rs"]
    assert sorted(pytest_call[4:]) == sorted(p.name for p in Path(ROOT).glob("test_*.py"))


def test_requirements_state_the_need_and_ci_pins_the_cpu_build():
    def requirements(path):
        return [l.split("#")[0].strip() for l in path.read_text().splitlines() if l.split("#")[0].strip()]
    assert requirements(Path(ROOT) / "requirements.txt") == ["torch>=2.11", "numpy", "tiktoken", "huggingface_hub", "pytest",
                                                               "matplotlib"]
    assert requirements(Path(ROOT) / ".ci" / "constraints.txt") == ["torch==2.13.0"]
    ci = (Path(ROOT) / ".ci" / "run").read_text().strip().splitlines()
    install = [l for l in ci if "pip install" in l]
    assert len(install) == 1 and "-r requirements.txt" in install[0] and "-c .ci/constraints.txt" in install[0]
    # README's first code block is exactly the two commands, and CI runs the second
    block = re.search(r"```\n(.*?)```", (Path(ROOT) / "README.md").read_text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["bash run.sh", "bash run.sh test"] and ci[-1] == "bash run.sh test"


# ----------------------------------------------------------------------------------------------------
# experiments/*.py


@pytest.mark.parametrize("argv,code,words", [
    ([], 2, ["what"]),
    (["memory", "--lengths", "4k"], 2, ["--lengths"]),
    (["step_time", "--steps", "0"], 2, ["--steps"]),
    (["step_time", "--", "--cplm", "7"], 2, ["--cplm"]),  # a bad flag of the training script
    (["step_time", "--", "--train_files", "nowhere/none_*.bin"], 1, ["nowhere/none_*.bin"]),  # missing data
])
def test_cp_cost_bad_input_is_one_line(argv, code, words, capsys):
    cp_cost = _load_experiment("cp_cost")
    try:
        rc = cp_cost.main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == code
    assert_one_line(capsys.readouterr().err, *words)


@pytest.mark.parametrize("argv,words", [
    (["--only", "full_cplm,nope"], ["nope"]),
    (["--study", "gate", "--only", "full_cplm"], ["full_cplm"]),
    (["--jobs", "0"], ["--jobs"]),
    (["--seeds", "0,one"], ["--seeds"]),
    (["--study", "nope"], ["--study"]),
    (["--scale", "0.25"], ["--scale", "--stage rows"]),
    (["--study", "prose", "--stage", "rows", "--scale", "3"], ["--scale", "3"]),
])
def test_race_checks_its_flags_before_building_corpora(argv, words, monkeypatch, capsys):
    race = _load_experiment("race")
    monkeypatch.setattr(race, "ensure_corpora", lambda: pytest.fail("corpora built before the flags were checked"))
    with pytest.raises(SystemExit) as e:
        race.main(argv)
    assert e.value.code == 2
    assert_one_line(capsys.readouterr().err, *words)


def test_reordered_rows_train_on_their_seeds_own_data_order(tmp_path, monkeypatch):
    race = _load_experiment("race")
    for v in (8192, 2048, 32768, 257):
        (tmp_path / f"data/prose{v}").mkdir(parents=True)
        (tmp_path / f"data/prose{v}/prose{v}_val_000000.bin").write_bytes(b"")
    monkeypatch.setattr(race, "ROOT", str(tmp_path))
    monkeypatch.setattr(race, "best_scales", lambda log_dir: {"vanilla": "1", "cplm": "0.5"})
    monkeypatch.setattr(race, "summarize", lambda *a: None)
    monkeypatch.setattr(race.time, "sleep", lambda s: None)
    started = []

    class Done:
        returncode = 0

        def __init__(self, cmd, **kw):
            started.append(cmd)

        def poll(self):
            return 0
    monkeypatch.setattr(race.subprocess, "Popen", Done)
    argv = ["--study", "prose", "--stage", "rows", "--only", "cplm_reordered,sentinel", "--seeds", "3,4"]
    assert race.main(argv) == 0
    flags = {(cmd[cmd.index("--run_id") + 1]): cmd for cmd in started}
    assert set(flags) == {f"prose_{row}_lr0.5_s{s}" for row in ("cplm_reordered", "sentinel") for s in (3, 4)}
    for s in (3, 4):
        cmd = flags[f"prose_cplm_reordered_lr0.5_s{s}"]
        assert cmd[cmd.index("--data_seed") + 1] == cmd[cmd.index("--seed") + 1] == str(s)
        assert "--data_seed" not in flags[f"prose_sentinel_lr0.5_s{s}"]
        sentinel = flags[f"prose_sentinel_lr0.5_s{s}"]
        assert sentinel[sentinel.index("--copy_gate") + 1] == "sentinel"


def test_race_stops_when_the_tokenizer_fails(tmp_path, monkeypatch, capfd):
    race = _load_experiment("race")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenize_corpus.py").write_text(
        "import sys\nprint('error: could not load the GPT-2 tokenizer', file=sys.stderr)\nsys.exit(1)\n")
    monkeypatch.setattr(race, "ROOT", str(tmp_path))
    monkeypatch.setattr(race, "summarize", lambda *a: pytest.fail("the race went on without its corpus"))
    assert race.main(["--only", "full_cplm", "--seeds", "0"]) == 1
    assert_one_line(capfd.readouterr().err, "GPT-2 tokenizer")


@pytest.mark.parametrize("argv,words", [
    (["--vocabs", "8k"], ["--vocabs", "8k"]),
    (["--seeds", "0,x"], ["--seeds"]),
    (["--modes", "cplm,other"], ["--modes"]),
])
def test_spamlang_bad_flags_are_one_line(argv, words, capsys):
    spamlang = _load_experiment("spamlang")
    with pytest.raises(SystemExit) as e:
        spamlang.parse_args(argv)
    assert e.value.code == 2
    assert_one_line(capsys.readouterr().err, *words)


def test_spamlang_out_under_a_file_is_one_line_exit_1(tmp_path, capsys):
    spamlang = _load_experiment("spamlang")
    (tmp_path / "plain").write_text("a regular file")
    out = tmp_path / "plain" / "results"
    assert spamlang.main(["--vocabs", "512", "--steps", "1", "--out", str(out)]) == 1
    assert_one_line(capsys.readouterr().err, "--out", str(out))


# ----------------------------------------------------------------------------------------------------
# the prose corpus builder (data/prose_corpus.py) and experiments/copy_share.py: tiny trees, no apt, no network


pc = _load("data/prose_corpus.py")
cs = _load_experiment("copy_share")

PROSE = ("The kernel keeps a list of the tasks that are ready to run, and it picks the next one when the\n"
         "current task blocks or uses up its time slice. This is what we call scheduling, and it is one of\n"
         "the oldest problems in the design of an operating system; it has been studied for decades.\n")
CODE = ("static int foo(struct bar *b)\n{\n\tint i, n = b->len;\n\tfor (i = 0; i < n; i++)\n"
        "\t\tb->v[i] = bar_get(b, i) + 1;\n\treturn n ? b->v[0] : -EINVAL;\n}\n") * 3
TABLE = ("| 0x00 | RESET   | 0   | r/w | 32 |\n| 0x04 | STATUS  | 1   | ro  | 16 |\n"
         "| 0x08 | CONTROL | 0xff | rw | 8 |\n") * 4
GERMAN = ("Der Kern verwaltet eine Liste der Aufgaben, die bereit sind, und er wählt die nächste aus, wenn\n"
          "die aktuelle Aufgabe blockiert oder ihre Zeitscheibe aufgebraucht hat. Das nennt man Planung.\n") * 2


def _run_script(script, *args):
    return _run([Path(ROOT) / script, *args], cwd=ROOT)


def assert_one_line_error(res, code):
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert_one_line(res.stderr)


# ----------------------------------------------------------------------------------------------------
# the prose corpus's builder: pinned Debian packages (data/prose_packages.txt), checked shards

FAKE_APT_GET = """#!/bin/sh
echo "apt-get $*" >> "$FAKE_LOG"
[ "$1" = download ] || exit 0
case "$3" in
  docpkg=1.0) [ -n "$FAKE_HAS_PIN" ] || { echo "E: Version '1.0' for 'docpkg' was not found"; exit 100; }
              printf "$FAKE_HAS_PIN" > docpkg_1.0_all.deb ;;
  *) printf today > "$(echo "$3" | tr = _)_all.deb" ;;
esac
"""
FAKE_CORPUS = """import os, sys
if "--list_packages" in sys.argv:
    print("docs docpkg-new|docpkg")
    sys.exit(0)
print("prose_corpus.py", *sys.argv[1:])
if os.environ["FAKE_SHARD"]:  # empty: this build writes no V = 8192 shard (another vocabulary)
    os.makedirs("data/prose8192", exist_ok=True)
    open("data/prose8192/prose8192_train_000000.bin", "w").write(os.environ["FAKE_SHARD"])
"""


def _run_build(tmp_path, *args, has_pin="pinned", shard="the corpus", pins=None, mirror=None):
    data, bin_dir, fake_py = tmp_path / "data", tmp_path / "bin", tmp_path / "py" / "tokenizers"
    for d in (data, bin_dir, fake_py):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(ROOT) / "data" / "build_prose_corpus.sh", data)
    (data / "prose_corpus.py").write_text(FAKE_CORPUS)
    (fake_py / "__init__.py").write_text("")
    sha = lambda text: hashlib.sha256(text.encode()).hexdigest()  # noqa: E731
    (data / "prose_packages.txt").write_text(pins or f"# package version sha256\r\ndocpkg 1.0 {sha('pinned')}\r\n"
                                             f"shard prose8192/prose8192_train_000000.bin {sha('the corpus')}\r\n")
    for tool, text in (("apt-get", FAKE_APT_GET), ("man", "#!/bin/sh\n"),
                       ("apt-cache", '#!/bin/sh\necho "apt-cache $*" >> "$FAKE_LOG"\necho "Version: 9.9"\n'),
                       ("dpkg-deb", '#!/bin/sh\n[ "$1" = -f ] && { basename "$2" | cut -d_ -f2; exit 0; }\n'
                                    'mkdir -p "$3" && cp "$2" "$3/"\n')):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "apt.txt").unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(fake_py.parent),
           "FAKE_LOG": str(tmp_path / "apt.txt"), "FAKE_HAS_PIN": has_pin, "FAKE_SHARD": shard,
           "PROSE_DEBIAN_MIRROR": mirror or (tmp_path / "no_mirror").as_uri()}
    r = subprocess.run(["bash", str(data / "build_prose_corpus.sh"), *args], capture_output=True, text=True,
                       timeout=60, env=env)
    calls = (tmp_path / "apt.txt").read_text().splitlines() if (tmp_path / "apt.txt").exists() else []
    return r, calls


def test_the_prose_builder_takes_the_pinned_packages_and_checks_the_shards(tmp_path):
    """The corpus followed Debian's packages of the day, so a rebuild gave another corpus than the one records/
    trained on. The builder takes each package at its pinned version (the .deb's sha256), from data/prose/debs/
    or apt, and says whether the shards it wrote are the pinned corpus's."""
    (tmp_path / "data/prose/root/docpkg-new").mkdir(parents=True)  # a newer alternative's tree, left by --latest
    r, calls = _run_build(tmp_path, "--vocab_sizes", "8192")
    assert r.returncode == 0, r.stderr
    assert calls[-1] == "apt-get download -q docpkg=1.0"  # the pinned one of its group, not the newest alternative
    assert (tmp_path / "data/prose/root/docpkg/docpkg_1.0_all.deb").read_text() == "pinned"
    assert not (tmp_path / "data/prose/root/docpkg-new").exists()  # the source would read the newest tree there
    assert "prose_corpus.py --vocab_sizes 8192" in r.stdout and "the pinned corpus's" in r.stdout
    r, calls = _run_build(tmp_path, shard="other bytes")  # every pinned .deb here: no apt at all
    assert r.returncode == 0 and calls == [] and "docpkg already unpacked" in r.stdout, r.stderr
    assert "differs from the pinned corpus's sha256" in r.stdout
    r, calls = _run_build(tmp_path, shard="")  # a shard this build did not write is not vouched for
    assert r.returncode == 0 and "pinned corpus" not in r.stdout


def test_the_prose_builder_refuses_what_is_not_the_pinned_package_in_one_line(tmp_path):
    (tmp_path / "data/prose/debs").mkdir(parents=True)
    (tmp_path / "data/prose/debs/docpkg_1.0_all.deb").write_text("changed")  # not the pinned bytes: fetched again
    r, calls = _run_build(tmp_path, has_pin="")
    assert r.returncode == 1 and "apt-get download -q docpkg=1.0" in calls
    assert_one_line(r.stderr, "neither apt-get nor Debian's pool has docpkg 1.0", "snapshot.debian.org/binary/docpkg/",
                    "--latest")
    assert "prose_corpus.py" not in r.stdout  # nothing built
    r, _ = _run_build(tmp_path, has_pin="other bytes")  # the archive's file is not the pinned one
    assert r.returncode == 1 and "prose_corpus.py" not in r.stdout
    assert_one_line(r.stderr, "docpkg_1.0_all.deb has sha256", "not the pinned")
    r, _ = _run_build(tmp_path, pins="docpkg 1.0\n")  # a pin without its sha256 would check nothing
    assert r.returncode == 1
    assert_one_line(r.stderr, "the line of docpkg needs a version and a sha256")
    r, calls = _run_build(tmp_path, "--latest")  # today's packages: the first alternative apt knows, its version
    assert r.returncode == 0 and "apt-get download -q docpkg-new=9.9" in calls, r.stderr
    assert "prose_corpus.py\n" in r.stdout and "pinned corpus" not in r.stdout  # --latest is not passed on


def test_the_prose_builder_takes_a_pin_apt_has_dropped_from_debians_pool(tmp_path):
    """On 2026-12-03 apt's lists no longer had four of the sixteen pinned versions (superseded security updates),
    which Debian's pool still served: the builder fetches the pin from its place there and checks its sha256."""
    sha = hashlib.sha256(b"pinned").hexdigest()
    pins = (f"docpkg 1.0 {sha} debian-security/pool/updates/main/d/docsrc/docpkg_1.0_all.deb\n"
            f"shard prose8192/prose8192_train_000000.bin {hashlib.sha256(b'the corpus').hexdigest()}\n")
    pool = tmp_path / "mirror/debian-security/pool/updates/main/d/docsrc"
    pool.mkdir(parents=True)
    (pool / "docpkg_1.0_all.deb").write_text("pinned")
    mirror = (tmp_path / "mirror").as_uri()
    r, calls = _run_build(tmp_path, has_pin="", pins=pins, mirror=mirror)  # apt: "Version '1.0' was not found"
    assert r.returncode == 0 and "apt-get download -q docpkg=1.0" in calls, r.stderr
    assert "docs: downloaded docpkg_1.0_all.deb" in r.stdout and "the pinned corpus's" in r.stdout
    assert (tmp_path / "data/prose/root/docpkg/docpkg_1.0_all.deb").read_text() == "pinned"
    (pool / "docpkg_1.0_all.deb").write_text("other bytes")  # the pool's file is not the pinned one: refused
    shutil.rmtree(tmp_path / "data/prose")
    r, _ = _run_build(tmp_path, has_pin="", pins=pins, mirror=mirror)
    assert r.returncode == 1 and "prose_corpus.py" not in r.stdout
    assert_one_line(r.stderr, "Debian's pool's docpkg_1.0_all.deb has sha256", "not the pinned")
    assert not (tmp_path / "data/prose/debs/docpkg_1.0_all.deb").exists()  # not kept to be taken later
    (pool / "docpkg_1.0_all.deb").unlink()  # gone from the pool too: snapshot.debian.org, in one line
    r, _ = _run_build(tmp_path, has_pin="", pins=pins, mirror=mirror)
    assert r.returncode == 1
    assert_one_line(r.stderr, "neither apt-get nor Debian's pool has docpkg 1.0", "snapshot.debian.org")


# ----------------------------------------------------------------------------------------------------
# the prose filter and the readers

def test_prose_filter_keeps_prose_and_drops_code_tables_and_other_languages():
    assert pc.is_prose(PROSE)
    assert pc.is_prose(PROSE + "\n.. code-block:: c\n\n\tfoo(1);\n")  # a little code in prose is fine
    for text in (CODE, TABLE, GERMAN, "- one\n- two\n- three\n" * 20):
        assert not pc.is_prose(text), text[:40]
    share, stop = pc.prose_stats(PROSE + CODE)
    assert 0.0 < share < 1.0 and 0.0 < stop < 0.5


def test_html_to_text_drops_page_furniture_and_keeps_pre():
    html = ("<html><head><title>T</title><style>p {}</style></head><body><nav>Home | Next</nav>"
            "<div class='navheader'><div>Prev</div> Up</div><h1>Title</h1><p>One   two\nthree &amp; four.</p>"
            "<script>var x = 1;</script><pre>a\n    b</pre><footer>debug info</footer></body></html>")
    assert pc.html_to_text(html) == "Title\n\nOne two three & four.\n\na\n    b\n"


def test_split_long_cuts_at_paragraphs_and_loses_nothing():
    text = "".join(f"paragraph {i} " + "word " * (i % 7 * 20) + "\n\n" for i in range(50)) + "x" * 3000
    pieces = pc.split_long(text, 1000)
    assert "".join(pieces) == text and all(len(p) <= 1000 for p in pieces)
    assert sum(p.endswith("\n\n") for p in pieces) >= len(pieces) - 4
    assert pc.split_long("short", 1000) == ["short"]


def test_filter_documents_counts_each_drop():
    docs = [("a", PROSE), ("b", "tiny"), ("c", CODE), ("d", PROSE + "\n"), ("e", PROSE * 3)]
    kept, counts = pc.filter_documents(docs, min_chars=200, max_doc_chars=100_000)
    assert [n for n, _ in kept] == ["a", "e"]
    assert counts == {"pieces": 5, "tiny": 1, "not_prose": 1, "duplicate": 1}
    seen = set()  # a shared `seen` drops a later source's copy too
    pc.filter_documents([("x", PROSE)], seen=seen)
    assert pc.filter_documents([("y", PROSE)], seen=seen)[1]["duplicate"] == 1


def test_split_jargon_and_bible():
    jargon = ("The Jargon File\n\nfront matter text\n\nChapter 1. Hacker Slang\n\nchapter text\n\nGlossary\n\n   0\n\n"
              "   :0: n.\n\n   Numeric zero.\n\n   :ACK: interj.\n\n   Acknowledge.\n\n   :abbrev: n.\n\n   Short.\n\n"
              "   :BASIC: n.\n\n   A language.\n\nAppendix A. Hacker Folklore\n\nstories\n")
    names = [n for n, _ in pc.split_jargon(jargon)]
    assert names == ["front matter", "Chapter 1", "Glossary", "lexicon 0-9", "lexicon A", "lexicon B", "Appendix A"]
    bible = ("\nGenesis 1\n\n  1 In the beginning God created the heaven\nand the earth.\n  2 And the earth was void.\n"
             "\nGenesis 2\n\n  1 Thus the heavens were finished.\n\nSong of Solomon 1\n\n  1 The song of songs.\n")
    books = dict(pc.split_bible(bible))
    assert list(books) == ["Genesis", "Song of Solomon"]
    assert books["Genesis"] == ("Genesis 1\n\nIn the beginning God created the heaven and the earth.\n"
                                "And the earth was void.\n\nGenesis 2\n\nThus the heavens were finished.\n")


# ----------------------------------------------------------------------------------------------------
# order and split

def test_shuffle_and_split_are_seeded_and_independent_of_reading_order():
    docs = [("s", f"doc{i:03d}", f"text {i}") for i in range(200)]
    a = pc.shuffle_documents(docs, seed=0)
    assert a == pc.shuffle_documents(list(reversed(docs)), seed=0)  # reading order does not matter
    assert a != docs and sorted(a) == docs                          # not source order, nothing lost
    assert a != pc.shuffle_documents(docs, seed=1)
    f = pc.split_flags(len(a), seed=0, val_fraction=0.1)
    assert f == pc.split_flags(len(a), seed=0, val_fraction=0.1) and 5 <= sum(f) <= 40
    assert f != pc.split_flags(len(a), seed=1, val_fraction=0.1)


def test_straddling_finds_val_pieces_whose_siblings_are_in_train():
    docs = [("a", "book#0", ""), ("a", "page", ""), ("a", "book#1", ""), ("b", "book#2", ""), ("a", "book#2", ""),
            ("b", "book#0", ""), ("a", "other#0", "")]
    flags = [False, True, True, True, False, True, True]  # val: page, a book#1, b book#2, b book#0, other#0
    # a's book has two pieces in train; b's book (another source) has none there, nor has other
    assert pc.straddling(docs, flags) == [(1, "a", "book#1", 2)]
    assert pc.straddling(docs, [False] * 7) == [] and pc.straddling(docs, [True] * 7) == []


# ----------------------------------------------------------------------------------------------------
# tokenizer and shards (a fake unpacked-package tree, two sources)

def _fake_work(tmp_path, n_docs=40):
    root = tmp_path / "work" / "root"
    git = root / "git-doc/usr/share/doc/git-doc"
    gimp = root / "gimp-help-en/usr/share/gimp/2.0/help/en"
    git.mkdir(parents=True)
    gimp.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = "the of and a to in is it that for tool layer image brush commit branch merge color".split()
    for i in range(n_docs):
        body = "\n".join(" ".join(rng.choice(words, 10)) + "." for _ in range(8 + i % 5))
        if i % 2:
            (git / f"doc{i}.txt").write_text(f"Document {i} of git, on <|bos|> and more.\n{body}\n")
        else:
            (gimp / f"page{i}.html").write_text(f"<html><body><h1>Page {i}</h1><p>{body}</p></body></html>")
    (git / "code.txt").write_text(CODE)  # dropped as not prose
    return tmp_path / "work"


def test_build_trains_on_train_split_and_writes_shards_with_bos_last(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers", reason="needs the tokenizers library: pip install -r experiments/requirements.txt")
    work = _fake_work(tmp_path)
    seen_texts = []
    real_train = pc.train_tokenizer
    monkeypatch.setattr(pc, "train_tokenizer", lambda texts, V, threads=None: (
        seen_texts.extend(texts), real_train(seen_texts, V, threads))[1])
    logs = []
    s = pc.build(work, tmp_path / "out", vocab_sizes=[300], sources=["git", "gimp"], seed=3, val_fraction=0.25,
                 min_chars=100, threads=1, log=logs.append)
    assert s["sources"]["git"]["not_prose"] == 1 and s["documents"] == 40
    v = s["vocab"][300]
    V = v["vocab_size"]
    assert V == 300 and v["bos"] == V - 1
    # the tokenizer saw exactly the train documents of the shuffled, seeded split
    docs = pc.shuffle_documents([(src, n, t) for src in ("git", "gimp") for n, t in
                                 pc.filter_documents(pc.load_source(next(x for x in pc.SOURCES if x.name == src),
                                                                    work / "root", work / "docs", 1)[0], 100)[0]], 3)
    flags = pc.split_flags(len(docs), 3, 0.25)
    assert seen_texts == [t for (_, _, t), f in zip(docs, flags) if not f]
    assert v["docs"] == {"val": sum(flags), "train": len(docs) - sum(flags)}
    tok = pc.HFEncoding(pc._tokenizers().Tokenizer.from_file(str(tmp_path / "out/prose300/tokenizer.json")), "t")
    for split in ("train", "val"):
        path = tmp_path / f"out/prose300/prose300_{split}_000000.bin"
        header, tokens = pc.read_shard_header(path), np.fromfile(path, dtype="<u2", offset=1024)
        assert header["vocab_size"] == V and header["version"] == 1 and header["num_tokens"] == tokens.size
        assert tokens[0] == V - 1 and (tokens == V - 1).sum() == v["docs"][split]  # BOS starts every document
        assert tokens.max() == V - 1
        first = tokens[1:np.flatnonzero(tokens == V - 1)[1] if v["docs"][split] > 1 else None]
        texts = [t for (_, _, t), f in zip(docs, flags) if f == (split == "val")]
        assert tok.decode(first.tolist()) == texts[0]  # and "<|bos|>" in a text stayed text
    assert any("targets" in line for line in logs)
    # a second build reuses the tokenizer and the document caches
    logs.clear()
    pc.build(work, tmp_path / "out", vocab_sizes=[300], sources=["git", "gimp"], seed=3, val_fraction=0.25,
             min_chars=100, threads=1, log=logs.append)
    assert any("reusing" in line for line in logs) and any("(cached)" in line for line in logs)


def test_literal_bos_text_is_not_the_bos_id():
    pytest.importorskip("tokenizers", reason="needs the tokenizers library: pip install -r experiments/requirements.txt")
    tok = pc.train_tokenizer([PROSE * 5, "<|bos|> appears here"], 300, threads=1)
    enc = pc.HFEncoding(tok, "t")
    assert enc.eot_token == enc.n_vocab - 1
    ids = enc.encode_ordinary_batch(["a <|bos|> b"])[0]
    assert enc.eot_token not in ids and enc.decode(ids) == "a <|bos|> b"


# ----------------------------------------------------------------------------------------------------
# copy share

def _brute_force(tokens, bos, w):
    n = copy = 0
    start = 0
    for t, x in enumerate(tokens):
        if x == bos:
            start = t
            continue
        n += 1
        lo = max(start, t - w) if w else start
        copy += x in tokens[lo:t]
    return n, copy


def test_copy_share_matches_brute_force(tmp_path):
    rng = np.random.default_rng(1)
    V = 40
    docs = [np.concatenate([[V - 1], rng.integers(0, 12 if i % 2 else V - 1, rng.integers(1, 300))]) for i in range(30)]
    tokens = np.concatenate([rng.integers(0, 5, 7)] + docs)  # a headless first document too
    cut = tokens.size // 2
    tc.write_shard(tmp_path / "c_000000.bin", tokens[:cut], V)
    tc.write_shard(tmp_path / "c_000001.bin", tokens[cut:], V)  # a document spans the two files
    paths = sorted(tmp_path.glob("c_*.bin"))
    for chunk in (16, 1 << 20):
        dist = np.concatenate([cs.copy_distances(p, V - 1) for p in cs.document_chunks(paths, V - 1, chunk)])
        assert dist.size == tokens.size
    r = cs.copy_share(paths, [1, 5, 64])
    assert r["docs"] == 30 and r["bos"] == V - 1
    lst = tokens.tolist()
    for w, key in ((1, "1"), (5, "5"), (64, "64"), (0, "doc")):
        n, copy = _brute_force(lst, V - 1, w)
        assert r["tokens"] == n and r["copyable"][key] == copy, key
    out = _run_script("experiments/copy_share.py", str(tmp_path / "c_*.bin"), "--windows", "1,5")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])["corpora"][0]
    assert row["copyable"]["5"] == _brute_force(lst, V - 1, 5)[1]


# ----------------------------------------------------------------------------------------------------
# one-line errors

def test_scripts_give_one_line_errors(tmp_path):
    assert_one_line_error(_run_script("data/prose_corpus.py", "--vocab_sizes", "100"), 2)
    assert_one_line_error(_run_script("data/prose_corpus.py", "--vocab_sizes", "8k"), 2)
    assert_one_line_error(_run_script("data/prose_corpus.py", "--sources", "nonsense"), 2)
    assert_one_line_error(_run_script("data/prose_corpus.py", "--work_dir", tmp_path / "none", "--sources", "git"), 1)
    assert_one_line_error(_run_script("experiments/copy_share.py", tmp_path / "none_*.bin"), 1)
    (tmp_path / "x.bin").write_bytes(b"not a shard" * 200)
    assert_one_line_error(_run_script("experiments/copy_share.py", tmp_path / "x.bin"), 1)
    assert_one_line_error(_run_script("experiments/copy_share.py", tmp_path / "x.bin", "--windows", "a,b"), 2)
    assert_one_line_error(_run_script("experiments/copy_share.py"), 2)


# ====================================================================================================
# experiments/spamlang.py --study v2: the lookup task, held-out rows of well-seen tokens, the plateau rule,
# the V/D break point, parallel runs (helpers above: spamlang, SPAMLANG, REPO, _in_context)

from collections import Counter  # noqa: E402


@pytest.mark.parametrize("T", [4, 16, 40])
def test_spamlang_lookup_target_is_an_earlier_token_never_the_current_one(T):
    V, B = 300, 60
    x, y, copy = spamlang.make_batch("lookup", V, B, T, torch.Generator().manual_seed(2))
    assert x.shape == y.shape == copy.shape == (B, T)
    assert (x[:, 0] == V - 1).all() and (x[:, 1:] != V - 1).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(copy, _in_context(x, y))  # copy positions: exactly those whose target occurred before
    periods = set()
    for b in range(B):
        P = int(copy[b].nonzero()[0])  # the first copy position is the period
        periods.add(P)
        assert len(set(x[b, 1:P + 1].tolist())) == P  # one block of distinct tokens
        for t in range(P, T):
            assert y[b, t] == x[b, t - P + 1] and y[b, t] != x[b, t]  # a lookup P - 1 back, never tau = t
    assert periods == set(range(spamlang.MIN_PERIOD, min(spamlang.MAX_PERIOD, T // 2) + 1))


def test_spamlang_span_rows_drawn_from_a_pool_hold_the_span_twice():
    V, B, T = 1000, 30, 24
    pool = torch.arange(100, 140)
    x, y, copy = spamlang.make_batch("span", V, B, T, torch.Generator().manual_seed(3), tokens=pool)
    assert (x[:, 0] == V - 1).all() and torch.equal(copy, _in_context(x, y) & copy)
    for b in range(B):
        counts = Counter(y[b].tolist())  # the row after BOS
        assert set(counts) <= set(pool.tolist())
        copied = y[b][copy[b]].tolist()  # the recurrence after its first token
        twice = {t for t, c in counts.items() if c == 2}
        assert set(counts.values()) <= {1, 2} and len(twice) == len(copied) + 1 and set(copied) <= twice
        assert spamlang.MIN_SPAN <= len(twice) <= min(spamlang.MAX_SPAN, T // 2)


@pytest.mark.parametrize("task,seq_len", [("repeat", 4), ("lookup", 16), ("span", 16)])
def test_spamlang_held_out_targets_were_copy_targets_of_k_training_rows(task, seq_len):
    V, k = 200, 3
    gen = torch.Generator().manual_seed(5)
    train = [spamlang.make_batch(task, V, 16, seq_len, gen) for _ in range(20)]
    rows_with = Counter()  # brute force: in how many training rows each token is a copy target (once per row)
    for _, y, copy in train:
        for b in range(y.size(0)):
            rows_with.update(set(y[b][copy[b]].tolist()))
    assert torch.equal(spamlang.copy_target_exposures(train, V),
                       torch.tensor([rows_with[t] for t in range(V)]))
    (x, y, copy), summary = spamlang.held_out_set(task, V, 30, seq_len, torch.Generator().manual_seed(6), train, k)
    eligible = {t for t, n in rows_with.items() if n >= k}
    targets = y[copy].tolist()
    assert targets and min(rows_with[t] for t in targets) >= k
    assert set(y.flatten().tolist()) <= eligible  # every token of the held-out rows, not only the targets
    assert summary["exposures_min"] == min(rows_with[t] for t in targets)
    assert summary["eligible_tokens"] == len(eligible) < V - 1  # the restriction removed tokens
    with pytest.raises(ValueError, match="copy target of >= 10000"):
        spamlang.held_out_set(task, V, 30, seq_len, torch.Generator(), train, 10_000)


def test_spamlang_plateau_rule():
    steps = range(0, 101, 10)
    assert not spamlang.plateaued([(s, s / 100, 5 - s / 50) for s in steps])  # still rising
    assert spamlang.plateaued([(s, 0.30 + 0.005 * (s % 20 == 0), 2.0) for s in steps])  # flat within noise
    # accuracy flat at 0 while the NLL still falls (as before an induction circuit forms): not a plateau
    assert not spamlang.plateaued([(s, 0.0, 8 - s / 20) for s in steps])
    assert spamlang.plateaued([(s, 1.0, 1 - s / 200) for s in steps])  # solved: the NLL no longer matters
    assert not spamlang.plateaued([(0, 0.0, 8.0)])
    flat = [(s, 0.5, 2.0) for s in range(0, 80, 10)]  # a gain of 1.5 points in the last quarter; of 0.5 points
    assert not spamlang.plateaued(flat + [(80, 0.5, 2.0), (90, 0.515, 2.0), (100, 0.5, 2.0)])
    assert spamlang.plateaued(flat + [(80, 0.5, 2.0), (90, 0.505, 2.0), (100, 0.5, 2.0)])


def test_spamlang_short_runs_of_both_modes(tmp_path):
    common = dict(steps=30, batch=32, seq_len=4, seed=0, eval_seqs=32, model_dim=32, min_exposures=4,
                  copy_gate_init=0)
    vanilla = spamlang.run_one("repeat", 64, 0, **common)
    cplm = spamlang.run_one("repeat", 64, 1, **common)
    # vanilla: a flat LM head at step 0 (argmax: token 0), then it learns x -> x (V/D = 2: no bottleneck)
    assert vanilla["copy_acc_step0"] <= 0.1 and vanilla["copy_acc"] >= 0.9 and "lam" not in vanilla
    # CPLM: pointing at its own position is right before any training (y_t = x_t), and stays right
    assert cplm["copy_acc_step0"] >= 0.5 and cplm["copy_acc"] >= 0.99 and 0 < cplm["lam"] <= 1
    assert all(r["exposures_min"] >= 4 and r["steps_done"] == 30 and r["stop"] == "steps" for r in (vanilla, cplm))
    # lookup: tau = t gains nothing, so the CPLM's step-0 accuracy is a guess among the block's tokens
    lookup = spamlang.run_one("lookup", 64, 1, steps=2, batch=8, seq_len=16, seed=0, eval_seqs=16, model_dim=32,
                              min_exposures=1, copy_gate_init=0)
    assert 0 < lookup["copy_acc_step0"] < 0.6 and 0 <= lookup["copy_acc"] <= 1
    log = tmp_path / "plateau.txt"
    r = spamlang.run_one("repeat", 64, 1, steps=400, batch=32, seq_len=4, seed=0, eval_seqs=32, eval_every=2,
                         model_dim=32, min_exposures=4, plateau_min_steps=8, copy_gate_init=0, log_path=str(log))
    assert r["stop"] == "plateau" and 8 <= r["steps_done"] < 400 and r["copy_acc"] >= 0.99
    lines = log.read_text().splitlines()
    assert lines[1].startswith("held-out: ") and json.loads(lines[1][10:])["exposures_min"] >= 4
    assert f"stopped: plateau at step {r['steps_done']}" in lines and lines[-1].startswith("final copy_acc:")
    assert lines[-3].startswith(f"step:{r['steps_done']}/400 ")  # the plateau's evaluation is the final one


def test_spamlang_v2_holds_the_training_rows_fixed_across_widths():
    specs = spamlang.v2_specs([0, 1])
    assert len({s.name for s in specs}) == len(specs)
    assert all(s.copy_gate_init == 0 and s.min_exposures == spamlang.MIN_EXPOSURES for s in specs)
    for task in ("repeat", "lookup"):
        rows = [s for s in specs if s.part == "sweep" and s.task == task]
        # one training stream per seed at every width: V, steps, batch, rows and held-out rows all equal
        assert len({(s.vocab_size, s.steps, s.batch, s.seq_len, s.eval_seqs, s.plateau_min_steps) for s in rows}) == 1
        assert {s.vocab_size // s.model_dim for s in rows} == {16, 32, 64, 128, 256}
        assert {(s.mode, s.seed) for s in rows} == {(m, k) for m in ("vanilla", "cplm") for k in (0, 1)}
    span = [s for s in specs if s.part == "plateau"]
    assert {s.task for s in span} == {"span"} and all(0 < s.plateau_min_steps < s.steps for s in span)


def _sweep_row(task, dim, mode, acc, **extra):
    return dict(part="sweep", task=task, vocab_size=4096, model_dim=dim, mode=mode, seed=0, copy_acc=acc,
                copy_acc_step0=0.0, copy_nll=1.0, steps=10, steps_done=10, exposures_min=8, exposures_median=16.0,
                wall_s=1.0, **extra)


def test_spamlang_v2_break_point_and_results(tmp_path):
    results = [_sweep_row("repeat", 256, "vanilla", 1.0), _sweep_row("repeat", 128, "vanilla", 0.9),
               _sweep_row("repeat", 64, "vanilla", 0.4), _sweep_row("repeat", 32, "vanilla", 0.6),
               _sweep_row("repeat", 16, "vanilla", 0.1), _sweep_row("repeat", 16, "cplm", 1.0, lam=0.9),
               _sweep_row("lookup", 256, "vanilla", 0.7), _sweep_row("lookup", 16, "vanilla", 0.6),
               dict(_sweep_row("span", 64, "cplm", 0.8, lam=0.5), part="plateau", copy_acc_best=0.81, steps=600,
                    stop="plateau")]
    assert spamlang.vanilla_break(results, "repeat") == (32, 64)  # the first V/D below 50%, scanning upwards
    assert spamlang.vanilla_break(results, "lookup") == (256, None)
    assert spamlang.vanilla_break([_sweep_row("repeat", 256, "vanilla", 0.2)], "repeat") == (None, 16)
    spamlang.write_v2_results(results, str(tmp_path), "python experiments/spamlang.py --study v2", 12.0)
    md = (tmp_path / "results.md").read_text()
    assert "repeat: vanilla breaks between V/D = 32 (>= 50%) and 64 (below)." in md
    assert "lookup: vanilla stays >= 50% at every V/D of the sweep (up to 256)." in md
    assert "| repeat | 64 | 64 | vanilla | 0.0% | 40.0% |" in md and "| repeat | 256 | 16 | cplm |" not in md
    assert "| span | 64 | 64 | cplm | 0.0% | 80.0% | 81.0% | 1.000 | 0.500 | 10 (600) | plateau |" in md
    assert len(json.loads((tmp_path / "results.json").read_text())["results"]) == len(results)


@pytest.mark.parametrize("argv,words", [
    (["--study", "v2", "--steps", "5"], ["--study v2", "--steps"]),
    (["--dims", "12"], ["--dims"]),
    (["--task", "lookup,nope"], ["--task", "nope"]),
    (["--jobs", "0"], ["--jobs"]),
    (["--plateau_min_steps", "10", "--eval_every", "5"], ["--plateau_min_steps"]),
])
def test_spamlang_v2_bad_flags_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        spamlang.parse_args(argv)
    assert e.value.code == 2
    assert_one_line(capsys.readouterr().err, *words)


def test_spamlang_unsuppliable_held_out_set_is_one_line_exit_1(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--task", "repeat", "--vocabs", "64", "--dims", "16", "--steps", "1", "--min_exposures", "50",
            "--out", str(out)]
    assert spamlang.main(argv) == 1
    assert_one_line(capsys.readouterr().err, "copy target of >= 50")
    assert not list(out.iterdir())  # no log, no results


def test_spamlang_runs_in_parallel_processes_of_one_thread(tmp_path, monkeypatch):
    # the worker processes (spawned: a fresh interpreter each) import this module by name, as a script run does
    monkeypatch.setitem(sys.modules, spamlang.__name__, spamlang)
    monkeypatch.syspath_prepend(str(SPAMLANG.parent))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args, specs = spamlang.parse_args(["--task", "lookup", "--vocabs", "64", "--dims", "16", "--steps", "2", "--batch",
                                       "4", "--seq_len", "16", "--eval_seqs", "2", "--min_exposures", "1"])
    seen = []
    results = spamlang.run_study(specs, str(tmp_path), 2, lambda so_far: seen.append(len(so_far)))
    assert [(r["task"], r["mode"]) for r in results] == [("lookup", "vanilla"), ("lookup", "cplm")]  # spec order
    assert seen == [1, 2]  # written after each run
    for r in results:
        config = json.loads((tmp_path / f"lookup_V64_D16_{r['mode']}_seed0.txt").read_text().splitlines()[0][8:])
        assert config["threads"] == 1 and config["model_dim"] == 16


# ---------------------------------------------------------------------------------------------------------
# the prose race's driver and report (experiments/race.py, experiments/race_report.py)

def _race_log(path, cplm, seed, losses, every=10, diags=None, **hparams):
    """A minimal training log: hyperparameters, val lines at steps 0, every, 2 every, ..., diagnostics, final."""
    total = every * (len(losses) - 1)
    lines = ["hyperparameters: " + json.dumps({"cplm": cplm, "seed": seed, "run_id": path.stem, **hparams})]
    for i, loss in enumerate(losses):
        lines.append(f"step:{i * every}/{total} val_loss:{loss:.4f} train_time:{i * 1000}ms step_avg:1.00ms")
    lines.append(f"step:{total}/{total} " + " ".join(f"{k}:{v}" for k, v in (diags or {}).items()))
    lines.append(f"final val_loss:{losses[-1]:.4f} train_time:{total * 1000}ms steps:{total}")
    path.write_text("\n".join(lines) + "\n")


def test_race_report_gaps_targets_and_the_gate_cost(tmp_path):
    race_report = _load_experiment("race_report")
    # vanilla falls linearly 5 -> 3 over 40 steps; CPLM is 0.5 lower at every evaluation, seed 1 another 0.1
    for seed in (0, 1):
        v = [5.0 - 0.5 * i + 0.05 * seed for i in range(5)]
        _race_log(tmp_path / f"v_s{seed}.txt", 0, seed, v,
                  diags=dict(copy_share=0.6, nll_copyable=2.0, nll_other=4.0 + seed * 0.1))
        _race_log(tmp_path / f"c_s{seed}.txt", 1, seed, [x - 0.5 - 0.1 * seed for x in v],
                  diags=dict(copy_share=0.6, nll_copyable=1.0, nll_other=4.5, lam=0.4, lam_other=0.3,
                             gate_cost_other=0.25 + 0.1 * seed))
    _race_log(tmp_path / "c_other_s0.txt", 1, 0, [9.0] * 5)  # a name that only starts like the group's
    out = tmp_path / "table.md"
    assert race_report.main([str(tmp_path), "--pair", "row=v:c", "--fractions", "0.5,1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "vanilla seeds [0, 1], CPLM seeds [0, 1], 40 steps" in text
    # the gap at step 20 is 0.5 and 0.6 (paired): mean 0.55, std 0.071; p of a t of 11 with 1 df
    row = next(line for line in text.splitlines() if line.startswith("| val loss at step 20 "))
    assert "| 0.550 +- 0.071 |" in row and "| 0.029 |" in row
    # targets: vanilla's mean curve (5.025 - 0.5 i) at steps 20 and 40; CPLM (4.5 - 0.5 i, 4.45 - 0.5 i)
    # reaches 4.025 at step 10 (4.5 - 4.025) / 0.5 = 9.5 and 10 (4.45 - 4.025) / 0.5 = 8.5: 9 +- 0.7 of 20
    row = next(line for line in text.splitlines() if line.startswith("| step 20 |"))
    assert "| 4.0250 | 20 | 9 +- 1 | 0.45x |" in row, row
    row = next(line for line in text.splitlines() if line.startswith("| step 40 |"))
    assert row.startswith("| step 40 | 3.0250 | 40 |")
    # NLL on other targets: vanilla 4.0 / 4.1, CPLM 4.5 (worse), of which the gate costs 0.25 / 0.35
    row = next(line for line in text.splitlines() if "LM head's own NLL" in line)
    assert "| 4.050 +- 0.071 | 4.200 +- 0.071 | -0.150 +- 0.141 |" in row, row
    assert "| other targets: gate cost -log(1 - lambda) | | 0.300 +- 0.071 |" in text
    # a gated run in the vanilla column (the pointer sentinel against CPLM): its gate's cost comes off as well
    assert race_report.main([str(tmp_path), "--pair", "gated=c:c", "--fractions", "1", "--out", str(out)]) == 0
    row = next(line for line in out.read_text().splitlines() if "LM head's own NLL" in line)
    assert "| 4.200 +- 0.071 | 4.200 +- 0.071 | 0.000 +- 0.000 |" in row, row
    # bad input: one line, exit 2
    with pytest.raises(SystemExit) as e:
        race_report.main([str(tmp_path), "--pair", "nonsense"])
    assert e.value.code == 2
    assert race_report.main([str(tmp_path), "--pair", "row=v:missing"]) == 1


def test_race_report_bits_per_byte_from_the_val_shards_tokenizer(tmp_path):
    race_report = _load_experiment("race_report")
    # byte-level shards (257 ids, BOS 256): a target is one byte, BOS none
    text = "h\u00e9llo w\u00f6rld\n".encode("utf-8")  # 14 bytes
    (tmp_path / "b").mkdir()
    write_shard(tmp_path / "b" / "x_val_000000.bin", [256, *text, 256, *text], vocab=257)
    assert race_report.token_byte_lengths(str(tmp_path / "b"), 257).tolist() == [1] * 256 + [0]
    log = {"hyperparameters": {"val_files": str(tmp_path / "b" / "x_val_*.bin"), "val_tokens": 16}}
    assert race_report.bytes_per_token(log) == 15 / 16  # targets: 14 bytes, BOS, 1 byte
    # a byte-level BPE: each character of a vocabulary entry is one byte (GPT-2's map: 0xC3 0xA9 -> "\u00c3\u00a9",
    # a space -> "\u0120"), special tokens none
    (tmp_path / "t").mkdir()
    vocab = {"h": 0, "\u00c3\u00a9": 1, "llo": 2, "\u0120w": 3, "<|bos|>": 4}
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps({
        "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": vocab, "merges": []},
        "added_tokens": [{"id": 4, "content": "<|bos|>", "special": True}]}))
    write_shard(tmp_path / "t" / "y_val_000000.bin", [4, 0, 1, 2, 3, 4, 0, 1, 2], vocab=5)
    assert race_report.token_byte_lengths(str(tmp_path / "t"), 5).tolist() == [1, 2, 3, 2, 0]
    val = str(tmp_path / "t" / "y_val_*.bin")
    for seed in (0, 1):  # targets [0, 1, 2, 3, 4, 0, 1, 2]: 1 + 2 + 3 + 2 + 0 + 1 + 2 + 3 = 14 bytes in 8 tokens
        _race_log(tmp_path / f"v_s{seed}.txt", 0, seed, [5.0, 4.0 + seed], val_files=val, val_tokens=8)
        _race_log(tmp_path / f"c_s{seed}.txt", 1, seed, [5.0, 3.0 + seed], val_files=val, val_tokens=8)
    out = tmp_path / "table.md"
    assert race_report.main([str(tmp_path), "--pair", "V = 5 (V/D = 1)=v:c", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    bpb = lambda nats: nats * 8 / (math.log(2) * 14)  # noqa: E731
    row = next(line for line in lines if line.startswith("| final val loss, bits per byte |"))
    assert f"| {bpb(4.5):.3f} +- {bpb(0.7071):.3f} | {bpb(3.5):.3f} +- {bpb(0.7071):.3f} | {bpb(1):.3f} +- 0.000 |" in row
    row = next(line for line in lines if line.startswith("| V = 5 (V/D = 1) |"))  # the overview, "=" in the name
    assert "| 1.75 | 4.500 +- 0.707 / 3.500 +- 0.707 | 1.000 +- 0.000 |" in row
    assert f"| {bpb(1):.3f} +- 0.000 | {100 / 4.5:.1f}% |" in row
    # modes that ran different seeds: the overview says so
    os.remove(tmp_path / "c_s1.txt")
    assert race_report.main([str(tmp_path), "--pair", "row=v:c", "--out", str(out)]) == 0
    assert "| row | vanilla 0,1, CPLM 0 (unpaired) | 1.75 |" in out.read_text()
    # a tokenizer that rewrites text, an id the tokenizer lacks, or no tokenizer: no bits per byte anywhere
    spec = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    for broken in ({**spec, "normalizer": {"type": "NFC"}}, {**spec, "model": {**spec["model"], "vocab": {"h": 0}}},
                   [spec], None):
        race_report._BYTES_PER_TOKEN.clear()
        if broken is None:
            os.remove(tmp_path / "t" / "tokenizer.json")
        else:
            (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(broken))
        assert race_report.main([str(tmp_path), "--pair", "row=v:c", "--out", str(out)]) == 0
        text = out.read_text()
        assert "bits per byte |" not in text.split("### row")[1] and "| row | vanilla 0,1, CPLM 0 (unpaired) | - |" in text


def test_prose_race_picks_each_modes_best_scale_and_runs_the_headline_first(tmp_path, monkeypatch):
    race = _load_experiment("race")
    monkeypatch.setattr(race, "ROOT", str(tmp_path))
    logs = tmp_path / "logs"
    logs.mkdir()
    with pytest.raises(ValueError, match="sweep is not finished"):
        race.prose_queue("rows", "logs", ["0", "1"], [])
    finals = {"vanilla": {"0.25": 4.3, "0.5": 4.1, "1": 4.0, "2": 4.2}, "cplm": {"0.25": 3.75, "0.5": 3.7, "1": 3.9, "2": 3.8}}
    for mode, by_scale in finals.items():
        for scale, loss in by_scale.items():
            _race_log(logs / f"prose_{mode}_lr{scale}_s0.txt", int(mode == "cplm"), 0, [9.0, loss])
    assert race.best_scales("logs") == {"vanilla": "1", "cplm": "0.5"}
    queue = race.prose_queue("rows", "logs", ["0", "1"], ["vanilla", "cplm", "cplm_open", "v2048_vanilla"])
    assert queue == [("prose_vanilla_lr1", "0"), ("prose_vanilla_lr1", "1"), ("prose_cplm_lr0.5", "0"),
                     ("prose_cplm_lr0.5", "1"), ("prose_cplm_open_lr0.5", "0"), ("prose_v2048_vanilla_lr1", "0"),
                     ("prose_cplm_open_lr0.5", "1"), ("prose_v2048_vanilla_lr1", "1")]
    # a row's own sweep: --scale runs it at that scale instead of its mode's best
    assert race.prose_queue("rows", "logs", ["0"], ["bytes_vanilla", "bytes_cplm"], "0.25") == [
        ("prose_bytes_vanilla_lr0.25", "0"), ("prose_bytes_cplm_lr0.25", "0")]
    # every configuration runs the same budget and differs from the headline's only where its row says
    base = race.PROSE_CONFIGS["prose_cplm_lr0.5"]
    # a run stopped before its end continues from its newest checkpoint, or starts again over its partial log
    assert race.continuation("logs", "prose_vanilla_lr1_s1") == []
    (logs / "prose_vanilla_lr1_s1.txt").write_text("step:0/1000 val_loss:9.0 train_time:0ms\n")
    assert race.continuation("logs", "prose_vanilla_lr1_s1") == ["--overwrite", "1"]
    (logs / "prose_vanilla_lr1_s1").mkdir()
    for step in (100, 200):
        (logs / "prose_vanilla_lr1_s1" / f"state_step{step:06d}.pt").write_bytes(b"")
    assert race.continuation("logs", "prose_vanilla_lr1_s1") == [
        "--resume", os.path.join("logs", "prose_vanilla_lr1_s1", "state_step000200.pt")]
    flag_values = lambda flags: dict(zip(flags[::2], flags[1::2]))  # noqa: E731
    assert flag_values(race.PROSE_CONFIGS["prose_cplm_open_lr0.5"]) == {**flag_values(base), "--copy_gate_init": "0.5"}
    assert "--num_iterations" in base and base[base.index("--num_iterations") + 1] == "1000"
    assert race.PROSE_CONFIGS["prose_bytes_cplm_lr1"][race.PROSE_CONFIGS["prose_bytes_cplm_lr1"].index(
        "--train_files") + 1] == "data/prose257/prose257_train_*.bin"


def test_prose_summary_reports_a_rows_own_sweep_next_to_its_best_scale(tmp_path, monkeypatch):
    race = _load_experiment("race")
    monkeypatch.setattr(race, "ROOT", str(tmp_path))
    logs = tmp_path / "out" / "logs"
    logs.mkdir(parents=True)
    for mode in ("vanilla", "cplm"):
        for scale in race.LR_SCALES:
            best = 1.0 if mode == "vanilla" else 0.5  # the modes' best scales differ
            _race_log(logs / f"prose_{mode}_lr{scale}_s0.txt", int(mode == "cplm"), 0, [9.0, 4.0 + abs(float(scale) - best)])
        for scale in ("0.5", "0.25"):
            _race_log(logs / f"prose_bytes_{mode}_lr{scale}_s0.txt", int(mode == "cplm"), 0, [6.0, 1.5])
    _race_log(logs / "prose_bytes_vanilla_lr1_s0.txt", 0, 0, [6.0, 1.5])  # its CPLM pair did not run
    # the open gate at CPLM's best: no extra pair with the sweep's vanilla at that scale
    _race_log(logs / "prose_cplm_open_lr0.5_s0.txt", 1, 0, [9.0, 3.9])
    calls = []
    monkeypatch.setattr(race.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        types.SimpleNamespace(returncode=0, stdout="", stderr=""))
    assert race.summarize_prose("out") == 0
    pairs = [calls[0][i + 1] for i, x in enumerate(calls[0]) if x == "--pair"]
    assert pairs == ["headline=prose_vanilla_lr1:prose_cplm_lr0.5",
                     "open gate=prose_vanilla_lr1:prose_cplm_open_lr0.5",
                     "bytes (V = 257, D = 256)=prose_bytes_vanilla_lr1:prose_bytes_cplm_lr0.5",
                     "bytes (V = 257, D = 256), scale 0.25=prose_bytes_vanilla_lr0.25:prose_bytes_cplm_lr0.25",
                     "bytes (V = 257, D = 256), scale 0.5=prose_bytes_vanilla_lr0.5:prose_bytes_cplm_lr0.5"]
    # a sweep missing a corner (only the edges a later study closed): the summary is left as it was, not
    # replaced by a table of the sweep alone
    (logs / "prose_vanilla_lr2_s0.txt").unlink()
    calls.clear()
    assert race.summarize_prose("out") == 0 and calls == []


def test_build_writes_a_byte_level_corpus_without_a_tokenizer(tmp_path):
    work = _fake_work(tmp_path)
    s = pc.build(work, tmp_path / "out", vocab_sizes=[257], sources=["git", "gimp"], seed=3, val_fraction=0.25,
                 min_chars=100, threads=1, log=lambda line: None)
    v = s["vocab"][257]
    assert v["vocab_size"] == 257 and v["bos"] == 256 and not (tmp_path / "out/prose257/tokenizer.json").exists()
    docs = pc.shuffle_documents([(src, n, t) for src in ("git", "gimp") for n, t in
                                 pc.filter_documents(pc.load_source(next(x for x in pc.SOURCES if x.name == src),
                                                                    work / "root", work / "docs", 1)[0], 100)[0]], 3)
    flags = pc.split_flags(len(docs), 3, 0.25)
    for split in ("train", "val"):
        path = tmp_path / f"out/prose257/prose257_{split}_000000.bin"
        tokens = np.fromfile(path, dtype="<u2", offset=1024)
        texts = [t for (_, _, t), f in zip(docs, flags) if f == (split == "val")]
        expected = np.concatenate([np.r_[256, np.frombuffer(t.encode(), np.uint8).astype(np.uint16)] for t in texts])
        np.testing.assert_array_equal(tokens, expected)  # BOS, then each document's UTF-8 bytes
        assert v["tokens"][split] == expected.size
    assert pc.parse_args(["--vocab_sizes", "257,2048"]).vocab_sizes == [257, 2048]
    with pytest.raises(SystemExit):
        pc.parse_args(["--vocab_sizes", "258"])


def test_gate_buckets_split_the_nll_by_the_gate_and_read_checkpoints(toy_data, tmp_path, capsys):
    gb = _load_experiment("gate_buckets")
    # by hand, one token per bucket: on a non-copyable target CPLM's NLL = -log(1 - lam) + the LM's own
    vanilla = {"nll": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)}
    cplm = {"nll": torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64),
            "c": torch.tensor([0.005, 0.05, 0.3, 0.9], dtype=torch.float64),
            "lam": torch.tensor([0.0, 0.5, 0.2, 0.9], dtype=torch.float64),
            "copyable": torch.tensor([False, True, False, True])}
    rows = gb.bucket_table(vanilla, cplm)
    assert [r["share"] for r in rows] == [0.25] * 4 and [r["copyable"] for r in rows] == [0, 1, 0, 1]
    assert (rows[0]["vanilla"], rows[0]["cplm"], rows[0]["other_gate_cost"]) == (1.0, 0.5, 0.0)
    assert rows[2]["other_gate_cost"] == pytest.approx(-math.log(0.8))
    assert rows[2]["other_cplm_lm"] == pytest.approx(2.0 + math.log(0.8))
    assert math.isnan(rows[1]["other_vanilla"]) and rows[3]["vanilla"] == 4.0
    # end to end on checkpoints in the training script's format
    paths = []
    for cplm_mode in (0, 1):
        a = tg.parse_args(tiny_flags(toy_data, tmp_path, cplm=cplm_mode))
        torch.manual_seed(cplm_mode)
        model = tg.GPT(tg.GPTConfig.from_args(a))
        paths.append(str(tmp_path / f"mode{cplm_mode}.pt"))
        torch.save(dict(step=0, model=model.state_dict(), hyperparameters=dataclasses.asdict(a)), paths[-1])
    out = tmp_path / "buckets.md"
    assert gb.main(["--pair", f"{paths[0]}:{paths[1]}", "--tokens", "1024", "--out", str(out)]) == 0
    text = out.read_text()
    first_table = text.split("Non-copyable")[0]
    shares = [float(line.split("|")[2]) for line in first_table.splitlines() if line.startswith("| [")]
    assert len(shares) == 4 and sum(shares) == pytest.approx(1, abs=0.003)
    # a swapped pair, a corrupt checkpoint, a malformed flag: one line each
    capsys.readouterr()
    assert gb.main(["--pair", f"{paths[1]}:{paths[0]}"]) == 1
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    assert gb.main(["--pair", f"{paths[0]}:{tmp_path / 'bad.pt'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "first must be a vanilla" in err[0] and "not a readable checkpoint" in err[1]
    with pytest.raises(SystemExit) as e:
        gb.main(["--pair", "no-colon"])
    assert e.value.code == 2
