"""Tests of experiments/test_slice.py: the held-out test slice and the neural-cache baseline (Grave et al. 2017)
against an independent per-position oracle. `python3 -m pytest -q test_baselines.py` (seconds, CPU)."""
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

import train_gpt_cplm as tg
from conftest import _load_experiment, write_shard

BOS, VOCAB = 99, 100
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
ts = _load_experiment("test_slice")
long_report = _load_experiment("long_report")


def cache_oracle(h, input_ids, target_ids, theta, lam, log_p_lm):
    """Grave et al. 2017 as written, one position at a time in float64: the cache holds (h_i, x_{i+1}) for the
    earlier positions i of t's document (a BOS starts one)."""
    T = input_ids.size(0)
    out = torch.empty(T, dtype=torch.float64)
    for t in range(T):
        start = max(i for i in range(t + 1) if input_ids[i] == BOS) if (input_ids[:t + 1] == BOS).any() else 0
        keys = list(range(start, t))
        if not keys:
            out[t] = log_p_lm[t]
            continue
        weights = torch.stack([theta * h[t].double() @ h[i].double() for i in keys]).softmax(0)
        p_cache = sum(float(w) for w, i in zip(weights, keys) if input_ids[i + 1] == target_ids[t])
        out[t] = math.log((1 - lam) * math.exp(float(log_p_lm[t])) + lam * p_cache)
    return out


@pytest.mark.parametrize("theta,lam", [(0.3, 0.2), (0.0, 0.5), (2.0, 0.05)])
def test_neural_cache_matches_the_formula(theta, lam):
    g = torch.Generator().manual_seed(1)
    T = 40
    x = torch.randint(0, 6, (1, T + 1), generator=g)
    x[0, 0], x[0, 17] = BOS, BOS  # two documents
    ids, targets = x[:, :-1], x[:, 1:]
    h = torch.randn(1, T, 8, generator=g)
    log_p_lm = torch.rand(1, T, generator=g).log() - 1
    doc_ids = tg.doc_ids_of(ids, BOS)
    got = ts.mix_cache(log_p_lm.double(), ts.cache_log_p(h, ids, targets, doc_ids, theta), lam)
    torch.testing.assert_close(got[0], cache_oracle(h[0], ids[0], targets[0], theta, lam, log_p_lm[0].double()))
    assert torch.equal(got[0, [0, 17]], log_p_lm[0, [0, 17]].double())  # an empty cache leaves the LM alone


def test_test_slice_is_whole_documents_past_the_tuning_slice(tmp_path):
    tokens = []
    rng = np.random.default_rng(0)
    while len(tokens) < 3000:
        tokens += [BOS] + rng.integers(0, 20, int(rng.integers(30, 90))).tolist()
    write_shard(tmp_path / "v_val_000000.bin", tokens, vocab=VOCAB)
    hp = tg.Hyperparameters(val_files=str(tmp_path / "v_val_*.bin"), vocab_size=VOCAB, bos_id=BOS, val_tokens=512)
    tuning, test, documents = ts.slices(hp, 1000, 700)
    assert torch.equal(tuning, torch.tensor(tokens[:513]))
    begin = next(i for i in range(1000, len(tokens)) if tokens[i] == BOS)
    end = next(i for i in range(begin + 700, len(tokens)) if tokens[i] == BOS)
    assert torch.equal(test, torch.tensor(tokens[begin:end + 1]))
    assert documents == tokens[begin:end].count(BOS)
    with pytest.raises(ts.EvalError, match="past the tuning slice"):
        ts.slices(hp, 100, 700)
    with pytest.raises(ts.EvalError, match="--test_tokens 99999"):
        ts.slices(hp, 1000, 99999)


def byte_level_corpora(folder, n_docs=12):
    """The same documents (text over "ab ") as a V = 257 byte corpus and as a hand-made byte-level BPE corpus
    (greedy longest match, its tokenizer.json beside the shard): {V: Hyperparameters}, and the documents."""
    rng = np.random.default_rng(4)
    docs = ["".join(rng.choice(list("ab "), int(rng.integers(30, 120)))) for _ in range(n_docs)]
    pieces = ["a", "b", "\u0120", "ab", "\u0120a", "bab"]  # U+0120 is the byte-level alphabet's space
    bpe_bos = len(pieces)
    (folder / "bpe").mkdir()
    (folder / "bpe" / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": bpe_bos, "content": "<|bos|>", "special": True}], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {p: i for i, p in enumerate(pieces)}}}))

    def bpe(text):
        text, ids = text.replace(" ", "\u0120"), []
        while text:
            i = max((i for i, p in enumerate(pieces) if text.startswith(p)), key=lambda i: len(pieces[i]))
            ids.append(i)
            text = text[len(pieces[i]):]
        return ids
    # as the corpus builder writes them: a BOS before every document, none after the last
    write_shard(folder / "bpe" / "c_val_000000.bin", [x for d in docs for x in [bpe_bos] + bpe(d)], vocab=bpe_bos + 1)
    (folder / "bytes").mkdir()
    write_shard(folder / "bytes" / "c_val_000000.bin", [x for d in docs for x in [256] + list(d.encode())], vocab=257)
    hps = {V: tg.Hyperparameters(val_files=str(folder / sub / "c_val_*.bin"), vocab_size=V, bos_id=V - 1,
                                 val_tokens=64) for V, sub in ((bpe_bos + 1, "bpe"), (257, "bytes"))}
    return hps, docs


def test_test_documents_are_the_same_bytes_for_every_tokenizer(tmp_path):
    hps, docs = byte_level_corpora(tmp_path)
    for hp in hps.values():
        _, test, n = ts.slices(hp, 0, 0, documents=(3, 9))
        assert n == 6 and int(ts.token_bytes(hp)[test[1:]].sum()) == sum(len(d) for d in docs[3:9])
        assert int((test == hp.bos_id).sum()) == 7  # six documents and the next one's BOS (their end) as a target
    hp = hps[257]
    start_3 = 3 + sum(len(d) for d in docs[:3])  # document 3's BOS
    assert len(ts.slices(dataclasses.replace(hp, val_tokens=start_3), 0, 0, documents=(3, 9))[1])
    with pytest.raises(ts.EvalError, match="inside the tuning slice"):  # one token into it
        ts.slices(dataclasses.replace(hp, val_tokens=start_3 + 1), 0, 0, documents=(3, 9))
    assert len(ts.slices(hp, 0, 0, documents=(3, 11))[1])
    with pytest.raises(ts.EvalError, match="has 12 documents, so END can be at most 11"):  # the last has no end
        ts.slices(hp, 0, 0, documents=(3, 12))
    (tmp_path / "bpe" / "tokenizer.json").unlink()
    assert ts.token_bytes(hps[7]) is None


def test_padded_last_row_changes_no_real_position():
    """A row shorter than val_seq_len is padded with BOS to whole blocks: the real positions score as unpadded."""
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=2, model_dim=32, num_heads=2,
                                max_seq_len=256)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.1)
    tokens = torch.tensor([BOS] + list(np.random.default_rng(2).integers(0, 20, 300)))
    (x1, y1, v1), (x2, y2, v2), (x3, y3, v3) = ts.rows_of(tokens, 128, BOS)
    assert x3.size(1) == 128 and int(v3.sum()) == 300 - 256 and v1.all() and v2.all()
    assert torch.equal(x3[v3], tokens[256:300]) and (x3[~v3] == BOS).all()
    other = x3.masked_fill(~v3, 7), y3.masked_fill(~v3, 7)  # whatever the padding holds
    torch.testing.assert_close(model(x3, y3, token_stats=True)["nll"][v3], model(*other, token_stats=True)["nll"][v3],
                               rtol=0, atol=1e-6)


def toy_val_split(folder, seed):
    """folder/toy_val_000000.bin: documents of 40-120 tokens over 12 ids, 1400+ tokens; returns the tokens."""
    rng = np.random.default_rng(seed)
    tokens = []
    while len(tokens) < 1400:
        tokens += [BOS] + rng.integers(0, 12, int(rng.integers(40, 120))).tolist()
    write_shard(folder / "toy_val_000000.bin", tokens, vocab=VOCAB)
    return tokens


def tiny_checkpoint(folder, cplm):
    hp = tg.parse_args(["--preset", "cpu", "--vocab_size", str(VOCAB), "--bos_id", str(BOS), "--num_layers", "2",
                        "--model_dim", "32", "--num_heads", "2", "--seq_len", "128", "--val_seq_len", "128",
                        "--batch_size", "128", "--val_tokens", "256", "--cplm", str(cplm), "--seed", "3",
                        "--val_files", str(folder / "toy_val_*.bin"), "--run_id", f"tiny{cplm}",
                        "--log_dir", str(folder / "logs")])
    torch.manual_seed(hp.seed)
    model = tg.GPT(tg.GPTConfig.from_args(hp))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.1)
    path = folder / "logs" / f"tiny{cplm}" / "state_step000002.pt"

    class Loader:
        def state(self):
            return {"position": 0}
    tg.run_files.save_checkpoint(str(path), model, tg.build_optimizers(model, hp, 0, 1), 2, Loader(), 0.0, hp, [])
    return path


def test_cli_scores_both_modes_and_tunes_the_cache_on_the_tuning_slice_only(tmp_path, capsys):
    toy_val_split(tmp_path, seed=0)
    paths = [tiny_checkpoint(tmp_path, cplm) for cplm in (0, 1)]
    out = tmp_path / "report" / "slice"
    argv = [str(paths[0].parent), str(paths[1]), "--test_start", "400", "--test_tokens", "600", "--out", str(out)]
    assert ts.main(argv) == 0
    records = json.loads((tmp_path / "report" / "slice.json").read_text())["records"]
    assert [(r["mode"], r["step"]) for r in records] == [("vanilla", 2), ("cplm", 2)]
    vanilla, cplm = records
    assert "cache" in vanilla and "cache" not in cplm
    assert vanilla["cache"]["theta"] in ts.THETAS and vanilla["cache"]["lambda"] in ts.LAMBDAS
    assert vanilla["test"]["tokens"] >= 600 and vanilla["test"]["tokens"] == cplm["test"]["tokens"]
    # the tuned pair is the best on the tuning slice: scoring the tuning slice with every pair agrees
    model = ts.inference.load_model(str(paths[0]))[0]
    ts.inference.use_dense_paths(model)
    hp = ts.inference.read_model_checkpoint(str(paths[0]))[0]
    tuning, _, _ = ts.slices(hp, 400, 600)
    sums = ts.score(model, hp, 2, tuning, with_cache=True)
    best = min(sums["cache"], key=lambda g: sums["cache"][g][0])
    assert (vanilla["cache"]["theta"], vanilla["cache"]["lambda"]) == best
    assert "| tiny0 | 2 | vanilla | 100 |" in (tmp_path / "report" / "slice.md").read_text()
    assert "bytes" not in vanilla["test"]  # no tokenizer.json: no bits per byte
    # per-document sums: one entry per whole document of the slice, adding up to the slice's totals
    for record, part in ((vanilla, "test"), (vanilla, "cache"), (cplm, "test")):
        docs, totals = record[part]["per_document"], record[part]
        assert len(docs["nll"]) == record["test_documents"] and min(docs["targets"]) > 0
        assert sum(docs["targets"]) == totals["tokens"]
        assert sum(docs["nll"]) / totals["tokens"] == pytest.approx(totals["loss"], rel=1e-6)
        assert sum(docs["nll_copyable"]) / sum(docs["copyable"]) == pytest.approx(totals["copyable"], rel=1e-6)
    assert vanilla["test"]["per_document"]["targets"] == cplm["test"]["per_document"]["targets"]
    assert vanilla["cache"]["per_document"]["nll"] != vanilla["test"]["per_document"]["nll"]
    assert set(vanilla["scored_by"]) == {"git", "sha256 experiments/test_slice.py", "sha256 train_gpt_cplm.py",
                                         "sha256 inference.py"}
    capsys.readouterr()
    assert ts.main([str(tmp_path / "none.pt"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none.pt: no such checkpoint file or run folder" in err



def test_long_report_reads_resumed_logs_and_both_crossing_rules(tmp_path):
    def log(path, losses, resumed_at=None):
        lines = []
        for step, loss in losses.items():
            lines.append(f"step:{step}/90 val_loss:{loss:.4f} train_time:1ms step_avg:1.00ms")
            lines.append(f"step:{step}/90 copy_share:0.5 nll_copyable:{loss - 1:.4f} nll_other:{loss + 1:.4f}")
        if resumed_at is not None:  # a resumed run validates its checkpoint's step again: the last line wins
            lines.append(f"resumed from x at step {resumed_at}")
            lines.append(f"step:{resumed_at}/90 val_loss:{losses[resumed_at]:.4f} train_time:1ms step_avg:1.00ms")
        path.write_text("\n".join(lines) + "\n")
    log(tmp_path / "v.txt", {0: 9.0, 30: 6.0, 60: 5.0, 90: 4.5}, resumed_at=60)
    log(tmp_path / "c.txt", {0: 9.0, 30: 5.5, 60: 4.9, 90: 5.1})  # back above vanilla's step-60 loss at 90
    vanilla = long_report.read_log(str(tmp_path / "v.txt"))
    assert sorted(vanilla) == [0, 30, 60, 90] and vanilla[60]["nll_other"] == 6.0
    curve = {0: 9.0, 30: 5.5, 60: 4.9, 90: 5.1}
    assert long_report.crossings(6.0, curve) == (30, 30)
    assert long_report.crossings(5.0, curve) == (60, None)  # crossed at 60, not below from then on
    assert long_report.crossings(4.5, curve) == (None, None)
    out = tmp_path / "r"
    assert long_report.main(["--vanilla", str(tmp_path / "v.txt"), "--cplm", str(tmp_path / "c.txt"),
                             "--induction", str(tmp_path / "none.json"), "--test_slice", str(tmp_path / "none.json"),
                             "--out", str(out)]) == 0
    table = (tmp_path / "r.md").read_text()
    assert "| 60 | 5.0000 | 4.9000 | 0.100 | 0.100 | 0.100 | - | 60 / not yet |" in table
    assert "| 30 | 6.0000 | 5.5000 | 0.500 |" in table and "30 / 30 (1.00x / 1.00x)" in table


def test_cli_bits_per_byte_over_test_documents(tmp_path, capsys):
    tokens = toy_val_split(tmp_path, seed=0)
    path = tiny_checkpoint(tmp_path, 0)
    out = tmp_path / "slice"
    argv = [str(path), "--test_documents", "6:12", "--out", str(out)]
    assert ts.main(argv) == 1
    assert "no tokenizer.json" in capsys.readouterr().err
    pieces = {chr(0x100 + i) * (1 + i % 3): i for i in range(BOS)}  # token i is 1 + i % 3 bytes long
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": pieces},
        "added_tokens": [{"id": BOS, "content": "<|bos|>", "special": True}]}))
    assert ts.main(argv) == 0
    record = json.loads((tmp_path / "slice.json").read_text())["records"][0]
    starts = [i for i, x in enumerate(tokens) if x == BOS]
    targets = tokens[starts[6] + 1:starts[12] + 1]
    assert record["test_documents"] == 6 and record["test"]["tokens"] == len(targets)
    n_bytes = sum(1 + x % 3 for x in targets if x != BOS)
    assert record["test"]["bytes"] == n_bytes == record["cache"]["bytes"]
    for part in ("test", "cache"):
        got = record[part]
        assert got["bits_per_byte"] == pytest.approx(got["loss"] * len(targets) / math.log(2) / n_bytes)
    calls = []
    real = ts.evaluate_checkpoint
    ts.evaluate_checkpoint = lambda *a: calls.append(a) or real(*a)
    try:  # --keep_done reuses a record only on the slice it was scored on
        for slice_args in (["--test_documents", "6:12"], ["--test_start", "400", "--test_tokens", "300"],
                           ["--test_documents", "6:12"],
                           ["--test_documents", "6:11"]):
            assert ts.main([str(path), "--out", str(out), "--keep_done", "1", *slice_args]) == 0
    finally:
        ts.evaluate_checkpoint = real
    # each slice's scores stay beside the others': 6:12 is never scored again
    assert [c[3] for c in calls] == [None, (6, 11)]
    slices = [tuple(r["slice"]) for r in json.loads((tmp_path / "slice.json").read_text())["records"]]
    assert len(slices) == 3 and set(slices) == {("documents", 6, 12), (400, 300), ("documents", 6, 11)}
    with pytest.raises(SystemExit) as usage:
        ts.main([str(path), "--test_documents", "6:5", "--out", str(out)])
    assert usage.value.code == 2 and "FIRST:END" in capsys.readouterr().err


def test_keep_done_names_a_checkpoint_once_drops_rewritten_ones_and_skips_rotated_ones(tmp_path, monkeypatch, capsys):
    """A hostile tester's: relative paths from outside the repository doubled every record on each rerun; an
    overwritten run's old scores stayed beside the new ones; a checkpoint rotated away mid-scoring was a
    traceback that left the rest unscored."""
    toy_val_split(tmp_path, seed=0)
    paths = [tiny_checkpoint(tmp_path, cplm) for cplm in (0, 1)]
    monkeypatch.chdir(tmp_path)  # outside the repository, relative paths
    argv = ["logs/tiny0", "logs/tiny1", "--test_start", "400", "--test_tokens", "300", "--out", "slice",
            "--keep_done", "1"]
    for _ in range(2):
        assert ts.main(argv) == 0
    records = json.loads((tmp_path / "slice.json").read_text())["records"]
    assert sorted(r["checkpoint"] for r in records) == sorted(str(p) for p in paths)  # once each, one name
    old_loss = next(r for r in records if r["mode"] == "vanilla")["test"]["loss"]
    model = ts.inference.load_model(str(paths[0]))[0]  # the run is overwritten: other weights, same path
    state = ts.torch.load(paths[0], weights_only=True)
    state["model"]["lm_head.weight"] = state["model"]["lm_head.weight"] * 0.5
    state["digest"] = ts.run_files.tensor_digest([state["model"], state["optimizers"],
                                                 ts.run_files.checkpoint_scalars(state)])
    ts.torch.save(state, paths[0])
    del model
    assert ts.main(["logs/tiny1", *argv[2:]]) == 0  # scores only the other: the rewritten one's old score goes
    records = json.loads((tmp_path / "slice.json").read_text())["records"]
    assert [r["mode"] for r in records] == ["cplm"]
    assert ts.main(argv) == 0
    records = json.loads((tmp_path / "slice.json").read_text())["records"]
    assert len(records) == 2 and next(r for r in records if r["mode"] == "vanilla")["test"]["loss"] != old_loss
    real = ts.evaluate_checkpoint
    monkeypatch.setattr(ts, "evaluate_checkpoint",  # the run rotates tiny1's checkpoint away meanwhile
                        lambda path, *a: (paths[1].unlink(missing_ok=True), real(path, *a))[1])
    capsys.readouterr()
    assert ts.main(argv[:2] + argv[2:-2]) == 0  # without --keep_done: tiny0 is scored, tiny1 is gone by its turn
    assert "is gone (rotated away" in capsys.readouterr().err
    assert [r["mode"] for r in json.loads((tmp_path / "slice.json").read_text())["records"]] == ["vanilla"]


def test_markdown_means_over_the_seeds_of_one_configuration():
    def record(run_id, seed, mode, loss, bpb):
        return {"run_id": run_id, "seed": seed, "mode": mode, "vocab_size": 8192, "step": 1000, "test_documents": 3,
                "test": {"loss": loss, "bits_per_byte": bpb, "copyable": 1.0, "other": 2.0, "copy_share": 0.5,
                         "tokens": 10, "bytes": 40}}
    records = [record("prose_cplm_lr0.5_s0", 0, "cplm", 4.0, 1.0), record("prose_cplm_lr0.5_s1", 1, "cplm", 4.2, 1.2),
               record("prose_sentinel_lr0.5_s1", 1, "sentinel", 5.0, 2.0),
               record("prose_cplm_lr0.5_s12", 2, "cplm", 9.0, 9.0)]  # "_s12" is not seed 2's suffix: its own row
    table = ts.markdown(records, "cmd")
    assert "| prose_cplm_lr0.5 | 1000 | 0,1 | 4.1000 +- 0.1414 | 1.1000 +- 0.1414 | - | - |" in table
    assert "| prose_sentinel_lr0.5 | 1000 | 1 | 5.0000 | 2.0000 | - | - |" in table
    assert "| prose_cplm_lr0.5_s12 | 1000 | 2 | 9.0000 |" in table
    assert "Gaps over" not in table  # no vanilla partner: no gaps
    assert table.endswith("\nTest slice: 10 targets in 3 whole documents, 40 bytes, 50.0% of the targets copyable.\n")
    older = {k: v for k, v in records[0].items() if k != "vocab_size"}  # a record from before vocab_size was kept
    assert ts.markdown([older] + records, "cmd").endswith(table.splitlines()[-1] + "\n")
    other_v = {**records[0], "vocab_size": 2048, "test": {**records[0]["test"], "tokens": 12, "copy_share": 0.25}}
    assert ts.markdown(records + [other_v], "cmd").endswith(  # the same documents, cut by each tokenizer
        "Test slice, under each tokenizer:\n\n- V = 8192: 10 targets in 3 whole documents, 40 bytes, 50.0% of the "
        "targets copyable\n- V = 2048: 12 targets in 3 whole documents, 40 bytes, 25.0% of the targets copyable\n")
    vanilla = [record(f"prose_vanilla_lr0.5_s{s}", s, "vanilla", loss, 2.0) for s, loss in ((0, 5.0), (1, 5.3))]
    for r, cached in zip(vanilla, (4.5, 4.4)):
        r["cache"] = {**r["test"], "loss": cached, "bits_per_byte": 1.5, "theta": 0.1, "lambda": 0.3}
    gaps = ts.markdown(records + vanilla, "cmd").split("Gaps over")[-1]
    # vanilla - CPLM: 1.0 and 1.1 (paired over seeds 0 and 1); cache - CPLM: 0.5 and 0.2; sentinel: seed 1 only
    # bits per byte: vanilla 2.0 (cached 1.5) against CPLM's 1.0 and 1.2
    assert ("| prose_cplm_lr0.5 | 1000 | 0,1 | 1.0500 +- 0.0707 | 0.9000 +- 0.1414 | 0.015 | 0.3500 +- 0.2121 | "
            "0.4000 +- 0.1414 | 0.13 |") in gaps
    assert "| prose_sentinel_lr0.5 | 1000 | 1 | 0.3000 | 0.0000 | - | -0.6000 | -0.5000 | - |" in gaps
    # vanilla's name at another V is no partner: no gap across tokenizers is taken from per-token losses
    assert "Gaps over" not in ts.markdown(records + [{**r, "vocab_size": 2048} for r in vanilla], "cmd")
    del vanilla[0]["cache"]["bits_per_byte"]  # one side without bytes: that column blank, the rest as before
    gaps = ts.markdown(records + vanilla, "cmd").split("Gaps over")[-1]
    assert ("| prose_cplm_lr0.5 | 1000 | 0,1 | 1.0500 +- 0.0707 | 0.9000 +- 0.1414 | 0.015 | 0.3500 +- 0.2121 | "
            "- | 0.13 |") in gaps
    del records[1]["test"]["bits_per_byte"]  # a record without bytes: no bits-per-byte gap, the rest as before
    gaps = ts.markdown(records + vanilla, "cmd").split("Gaps over")[-1]
    assert "| prose_cplm_lr0.5 | 1000 | 0,1 | 1.0500 +- 0.0707 | - | 0.015 | 0.3500 +- 0.2121 | - | 0.13 |" in gaps


def test_keep_done_scores_only_new_or_rewritten_checkpoints(tmp_path, monkeypatch):
    calls = []
    real = ts.evaluate_checkpoint
    monkeypatch.setattr(ts, "evaluate_checkpoint", lambda *a: calls.append(a[0]) or real(*a))
    toy_val_split(tmp_path, seed=1)
    first = tiny_checkpoint(tmp_path, 1)
    out = str(tmp_path / "slice")
    argv = [str(first.parent), "--test_start", "400", "--test_tokens", "600", "--out", out, "--keep_done", "1"]
    assert ts.main(argv) == 0 and len(calls) == 1
    assert ts.main(argv) == 0 and len(calls) == 1  # nothing new: nothing scored
    second = first.parent / "state_step000004.pt"
    second.write_bytes(first.read_bytes())
    assert ts.main(argv) == 0 and calls[-1] == str(second) and len(calls) == 2  # the new one only
    os.utime(first, ns=(1, 1))  # rewritten since it was scored
    assert ts.main(argv) == 0 and calls[-1] == str(first) and len(calls) == 3
    assert [r["checkpoint"] for r in json.loads((tmp_path / "slice.json").read_text())["records"]] == [
        str(first), str(second)]
    # a hostile tester's: a checkpoint rotated away by --keep_checkpoints lost its score for good; it stays
    first.unlink()
    assert ts.main(argv) == 0 and len(calls) == 3
    assert sorted(r["checkpoint"] for r in json.loads((tmp_path / "slice.json").read_text())["records"]) == sorted(
        [str(first), str(second)])
