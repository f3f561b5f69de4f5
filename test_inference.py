"""Inference tests: `python3 -m pytest -q test_inference.py` (CPU, well under a minute).

Generation with caches (train_gpt_cplm.InferenceCache, generate) against the dense reference
(inference.next_token_log_probs recomputed on the whole sequence at every step), and the inference scripts in
experiments/ (sample, needle, inference_memory, copy_picture) on tiny checkpoints written here."""
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_cplm as tg
import inference

ROOT = Path(__file__).resolve().parent
VOCAB, BOS = 500, 499
WINDOW = 2  # blocks of 128 tokens: long layers see 256 tokens, short ones 128; the contexts below are longer
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tiny_model(cplm, max_seq_len=1024):
    """4 layers (long, short, no attention, long), random weights everywhere (no zero-initialised heads),
    in CPLM mode a gate that starts open so copying weighs in the mixture; cplm "sentinel": the pointer-sentinel
    gate (--copy_gate sentinel)."""
    torch.manual_seed(0)
    gate = {"copy_gate": "sentinel"} if cplm == "sentinel" else {"copy_gate_init": 0.3 if cplm else 0.0}
    cfg = tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=4, model_dim=32, num_heads=2, no_attention_layer=2,
                       max_seq_len=max_seq_len, cplm=int(bool(cplm)), cp_dim=16, **gate)
    model = tg.GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and not p.any():
                p.normal_(0, 0.1)
        if cplm:
            model.cp_head.sink_key.normal_(0, 0.5)
    return model.eval()


def two_documents(n_first=70, n_second=290, seed=0):
    """A BOS, a short document, a BOS in mid-block (position n_first + 1), then a document longer than
    the long window. Tokens from a small alphabet, so they repeat and copying has something to copy."""
    rng = np.random.default_rng(seed)
    return [BOS] + rng.integers(0, 40, n_first).tolist() + [BOS] + rng.integers(0, 40, n_second).tolist()


def reference_generate(model, prompt, max_new_tokens, temperature, top_k, seed, window):
    """The oracle: the dense reference on the whole sequence at every step, the same sampler."""
    generator = torch.Generator().manual_seed(seed)
    ids, log_probs = list(prompt), []
    for _ in range(max_new_tokens):
        lp = inference.next_token_log_probs(model, torch.tensor([ids]), window)[0, -1]
        log_probs.append(lp)
        ids.append(inference.sample_next(lp, VOCAB, temperature, top_k, generator))
    return ids[len(prompt):], log_probs


# ----------------------------------------------------------------------------------------------------
# the caches against the dense reference


@pytest.mark.parametrize("cplm", [0, 1, "sentinel"])
@pytest.mark.parametrize("window", [None, WINDOW, 1])
def test_every_position_matches_the_reference(cplm, window):
    """Fed in uneven pieces (a chunked prefill whose chunks cut through the BOS and the window edges,
    then single tokens), the cached path's log p(next) equals the reference's at every position."""
    model = tiny_model(cplm)
    ids = two_documents()
    reference = inference.next_token_log_probs(model, torch.tensor([ids]), window)[0]
    cache = inference.InferenceCache(model, window, prefill_chunk=50)
    got, lo = [], 0
    for size in [1, 63, 131, 7] + [1] * (len(ids) - 202):
        got.append((lo + size - 1, cache.extend(ids[lo:lo + size])))
        lo += size
    assert lo == len(ids)
    for t, lp in got:
        finite = torch.isfinite(reference[t])
        assert torch.equal(finite, torch.isfinite(lp)), t
        torch.testing.assert_close(lp[finite], reference[t][finite], atol=2e-5, rtol=1e-5, msg=f"position {t}")


@pytest.mark.parametrize("cplm", [0, 1])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_generate_equals_the_reference_token_for_token(cplm, window):
    """Greedy and seeded sampling (temperature, top-k) give the reference's tokens, and every step's
    log-probs agree within float tolerance; the context ends past the window, in the prompt's second document."""
    model = tiny_model(cplm)
    prompt = two_documents(n_second=230)
    for temperature, top_k, seed in [(0.0, 0, 0), (1.0, 0, 1), (0.8, 20, 2)]:
        want, want_log_probs = reference_generate(model, prompt, 20, temperature, top_k, seed, window)
        cache = inference.InferenceCache(model, window, prefill_chunk=100)
        got = inference.generate(model, prompt, 20, temperature, top_k, seed, window_blocks=window, cache=cache)
        assert got == want, (temperature, top_k)
        assert cache.end == len(prompt) + 19  # the last token is drawn, never fed
        cache = inference.InferenceCache(model, window)  # the same path, step by step: its log-probs
        lp = cache.extend(prompt)
        for step, (token, ref) in enumerate(zip(want, want_log_probs)):
            finite = torch.isfinite(ref)
            assert torch.equal(finite, torch.isfinite(lp))
            torch.testing.assert_close(lp[finite], ref[finite], atol=2e-5, rtol=1e-5, msg=f"step {step}")
            lp = cache.extend([token])


def test_caches_hold_only_what_a_later_token_can_see():
    """Window layers keep at most window x 128 positions of the current document, full attention the
    whole document, the layer without attention nothing; the CP keys and ids cover the current document
    from its BOS; a new BOS drops the document before it."""
    model = tiny_model(1)
    ids = two_documents()  # second document: positions 71..361
    cache = inference.InferenceCache(model, WINDOW)
    cache.extend(ids)
    lengths = [None if kv is None else kv[0].size(1) for kv in cache.kv]
    end = len(ids)
    assert lengths[2] is None  # no attention: nothing cached
    long_from, short_from = (end // 128 - WINDOW + 1) * 128, (end // 128) * 128
    assert lengths == [end - long_from, end - short_from, None, end - long_from]
    assert cache.cp_keys.shape == (1, end - 71, 16) and cache.cp_ids[0].tolist() == ids[71:]
    full = inference.InferenceCache(model, None)
    full.extend(ids)
    assert [None if kv is None else kv[0].size(1) for kv in full.kv] == [end - 71, end - 71, None, end - 71]
    full.extend([5, BOS, 7, 8])
    assert [None if kv is None else kv[0].size(1) for kv in full.kv] == [3, 3, None, 3]
    assert full.cp_ids[0].tolist() == [BOS, 7, 8] and full.doc_start == end + 1
    sizes = full.nbytes()
    assert sizes == {"kv": 3 * 2 * 3 * 32 * 4, "cp_keys": 3 * 16 * 4, "cp_ids": 3 * 4}


def test_sampler_draws_the_distribution_it_is_given():
    """Frequencies over many draws match p^(1/T) renormalised over the real ids (never <copy> or a
    padding slot); top_k keeps the k most likely; temperature 0 and top_k 1 are the argmax."""
    log_p = torch.full((8,), float("-inf"))
    log_p[:5] = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    log_p[6] = math.log(0.5)  # a padding slot with mass: must never be drawn (vocab_size 6)
    g = torch.Generator().manual_seed(0)
    draws = [inference.sample_next(log_p, 6, 1.0, 0, g) for _ in range(4000)]
    freq = np.bincount(draws, minlength=8) / len(draws)
    assert freq[5:].sum() == 0
    np.testing.assert_allclose(freq[:5], [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.03)
    hot = np.bincount([inference.sample_next(log_p, 6, 0.5, 2, g) for _ in range(2000)], minlength=8) / 2000
    np.testing.assert_allclose(hot[:2], [0.16 / 0.25, 0.09 / 0.25], atol=0.04)  # p^2 over the top 2
    assert hot[2:].sum() == 0
    assert inference.sample_next(log_p, 6, 0.0) == 0 and inference.sample_next(log_p, 6, 1.0, 1, g) == 0


def test_generate_refuses_what_it_cannot_do():
    model = tiny_model(0, max_seq_len=256)
    with pytest.raises(ValueError, match="max_seq_len"):
        inference.generate(model, two_documents(), 4)
    with pytest.raises(ValueError, match="257 positions exceed"):  # checked before any work
        inference.generate(model, [BOS] * 200, 58)
    assert len(inference.generate(model, [BOS] * 200, 57)) == 57
    with pytest.raises(ValueError, match="window_blocks must be >= 1"):
        inference.generate(model, [BOS, 1], 4, window_blocks=0)
    with pytest.raises(ValueError, match="temperature"):
        inference.generate(model, [BOS, 1], 4, temperature=-1)
    with pytest.raises(ValueError, match="at least one token"):
        inference.generate(model, [], 4)
    assert inference.generate(model, [BOS, 1, 2], 0) == []


# ----------------------------------------------------------------------------------------------------
# checkpoints for the scripts: tiny byte-level models (V = 257) saved as the training script saves them

BYTES_BOS = 256
SENTENCES = ["The river runs past the old mill and into the quiet valley below.",
             "Every morning the baker opens the shop before the sun comes up.",
             "A small boat drifts slowly along the edge of the frozen lake.",
             "Nobody remembers who planted the tall trees beside the station.",
             "The library keeps its oldest maps in a cool room under the stairs."]


def _load(name):
    """experiments/<name>.py as a module, experiments/ on sys.path as when it runs as a script."""
    if str(ROOT / "experiments") not in sys.path:
        sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Loader:  # what save_checkpoint reads from the training loader
    def state(self):
        return {"position": 0}


def write_checkpoint(folder, cplm, attn_window=256, step=10, vocab=257):
    """A random byte-level model (every matrix non-zero) in save_checkpoint's format; its val shard holds
    the SENTENCES, so needle.py finds filler."""
    folder.mkdir(parents=True, exist_ok=True)
    val = folder / "bytes_val_000000.bin"
    if not val.exists():
        text = " ".join(SENTENCES * 4)
        tokens = np.array([BYTES_BOS] + list(text.encode()) + [BYTES_BOS] + list(text[::-1].encode()), dtype="<u2")
        header = np.zeros(256, dtype="<i4")
        header[:4] = [20240520, 1, len(tokens), vocab]
        val.write_bytes(header.tobytes() + tokens.tobytes())
    a = tg.Hyperparameters(preset="cpu", vocab_size=vocab, bos_id=vocab - 1, num_layers=2, model_dim=32, num_heads=2,
                           seq_len=256, val_seq_len=256, cplm=cplm, cp_dim=8, attn_window=attn_window,
                           attn_window_start=attn_window, num_iterations=20, run_id=f"tiny{cplm}",
                           train_files=str(folder / "bytes_train_*.bin"), val_files=str(val),
                           copy_gate_init=0.3 if cplm else 0.0)
    torch.manual_seed(cplm)
    model = tg.GPT(tg.GPTConfig.from_args(a))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and not p.any():
                p.normal_(0, 0.1)
    path = folder / f"tiny{cplm}" / f"state_step{step:06d}.pt"
    tg.run_files.save_checkpoint(str(path), model, [torch.optim.SGD(model.parameters(), lr=0.1)] * 2, step, _Loader(), 1.0, a, [])
    return path, model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    return {cplm: write_checkpoint(folder, cplm) for cplm in (0, 1)}


class Ran:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_script(name, *args, capsys):
    """The script's main() in this process (a subprocess would spend most of the test importing torch),
    with its exit code, stdout and stderr as a command line would see them."""
    module = _load(name)
    capsys.readouterr()
    try:
        code = module.main([str(x) for x in args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    return Ran(code, out, err)


def assert_one_line(stderr, *words):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_load_model_gives_back_the_saved_model_and_refuses_bad_files(checkpoints, tmp_path):
    path, saved = checkpoints[1]
    model, a, step = inference.load_model(str(path), max_seq_len=1000)
    assert step == 10 and a.cplm == 1 and a.run_id == "tiny1" and model.config.max_seq_len == tg.next_multiple(1000, 1)
    ids = torch.tensor([[BYTES_BOS] + list(b"copy this, copy this")])
    torch.testing.assert_close(inference.next_token_log_probs(model, ids),
                               inference.next_token_log_probs(saved.eval(), ids))
    with pytest.raises(tg.DataError, match="no such checkpoint"):
        inference.load_model(str(tmp_path / "missing.pt"))
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(tg.DataError, match="not a readable checkpoint"):
        inference.load_model(str(tmp_path / "garbage.pt"))
    state = torch.load(path, weights_only=True)  # what save_checkpoint writes loads without running any code
    # a file that would run code when unpickled (any object but tensors and plain containers) is refused
    torch.save({**state, "extra": PickledObject()}, tmp_path / "code.pt")
    with pytest.raises(tg.DataError, match="could run code"):
        inference.load_model(str(tmp_path / "code.pt"))
    # changed bytes (the digest no longer matches) and a diverged model are refused as --resume refuses them
    changed = {**state, "model": {**state["model"], "lm_head.weight": state["model"]["lm_head.weight"] * 2}}
    torch.save(changed, tmp_path / "changed.pt")
    with pytest.raises(tg.DataError, match="do not match the digest"):
        inference.load_model(str(tmp_path / "changed.pt"))
    nan = {**state, "model": {**state["model"], "lm_head.weight": state["model"]["lm_head.weight"] * float("nan")}}
    del nan["digest"]  # saved before digests existed, or (save_checkpoint refuses it) by another tool
    torch.save(nan, tmp_path / "nan.pt")
    with pytest.raises(tg.DataError, match="weights are not finite"):
        inference.load_model(str(tmp_path / "nan.pt"))
    del state["digest"]
    state["hyperparameters"]["model_dim"] = 64
    torch.save(state, tmp_path / "other_shape.pt")
    with pytest.raises(tg.DataError, match="do not describe its weights"):  # refused before a model is built
        inference.load_model(str(tmp_path / "other_shape.pt"))


def crafted_checkpoint(path, out, change):
    """A copy of the checkpoint with change(state) applied and its digest made to match (a careful forger)."""
    state = torch.load(path, weights_only=True)
    change(state)
    state["digest"] = tg.run_files.tensor_digest([state["model"], state["optimizers"],
                                                  tg.run_files.checkpoint_scalars(state)])
    torch.save(state, out)
    return out


@pytest.mark.parametrize("change,says", [
    (dict(num_layers="x"), "num_layers 'x' is not an integer"),  # was a TypeError in the model's constructor
    (dict(num_heads=3), "--model_dim must be num_heads x head_dim"),  # loaded: heads of 10.67 dims fail later
    (dict(bos_id=100000), "--bos_id a token id below it"),  # loaded: a BOS that no token id can be
    (dict(model_dim=65536), "do not describe its weights"),  # tried to allocate 48 GiB
    (dict(num_layers=100000), "--num_layers 100000 (at most 1024)"),  # built for over a minute
    (dict(num_layers=4), "do not describe its weights"),  # 4 layers over the weights of 2
    (dict(val_seq_len=2 ** 24, val_tokens=2 ** 24), "GiB of rotary tables"),  # tables of 2^24 positions a layer
], ids=["num_layers_str", "num_heads_3", "bos_id_past_vocab", "model_dim_65536", "num_layers_100000", "layers_4",
        "val_seq_len_2_24"])
def test_load_model_refuses_crafted_settings_before_building_anything(checkpoints, tmp_path, monkeypatch, capsys,
                                                                       change, says):
    """A hostile tester's checkpoints, their digests matching: load_model (sample.py, needle.py, copy_picture.py, ...)
    raised tracebacks, tried to allocate 48 GiB, built for minutes or loaded a model its settings cannot run. Each is
    now one DataError naming the file and the setting, raised before any model is built (the check that
    experiments/test_slice.py refuses them with), and the scripts print one line and exit 1."""
    bad = crafted_checkpoint(checkpoints[1][0], tmp_path / "state_step000010.pt",
                             lambda s: s["hyperparameters"].update(change))

    def no_build(config):
        raise AssertionError("a model was built from settings that describe none")
    monkeypatch.setattr(inference, "GPT", no_build)
    monkeypatch.setattr(inference.run_files, "machine_memory", lambda: 2 ** 30)  # the same answer on any machine
    for read in (inference.load_model, inference.read_model_checkpoint,
                 lambda p: inference.read_model_checkpoint(p, mmap=True)):
        with pytest.raises(tg.DataError) as e:
            read(str(bad))
        assert str(bad) in str(e.value) and says in str(e.value) and "\n" not in str(e.value), str(e.value)
    for script, args in (("sample", ["--prompt", "x"]), ("copy_picture", ["--text", bad, "--out", tmp_path / "o"])):
        r = run_script(script, bad, *args, capsys=capsys)
        assert r.returncode == 1 and r.stdout == "", (script, r.stdout)
        assert_one_line(r.stderr, f"{script}.py: error:", str(bad), says)
    assert not (tmp_path / "o").exists()


class PickledObject:
    """Stands for an arbitrary pickled object: torch.load(weights_only=False) would import and build it."""


# ----------------------------------------------------------------------------------------------------
# experiments/codec.py and experiments/sample.py


def test_codec_finds_the_checkpoints_tokenizer(tmp_path):
    codec = _load("codec")
    a = tg.Hyperparameters(vocab_size=257, bos_id=256)
    assert codec.codec_for(a).decode(codec.codec_for(a).encode("héllo") + [256]) == "héllo"
    prose = _load_prose_corpus()
    tok = prose.train_tokenizer(SENTENCES * 20, 300)
    folder = tmp_path / "prose300"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    (folder / "meta.json").write_text(json.dumps({"vocab_size": size, "bos_id": size - 1}))
    a = tg.Hyperparameters(vocab_size=size, bos_id=size - 1, train_files=str(folder / "prose300_train_*.bin"))
    found = codec.codec_for(a)
    ids = found.encode("The river runs.")
    assert found.decode(ids + [size - 1]) == "The river runs." and size - 1 not in ids
    assert "".join(found.piece(i) for i in ids) == "The river runs."
    with pytest.raises(codec.CodecError, match="pass --tokenizer"):
        codec.codec_for(tg.Hyperparameters(vocab_size=size + 1, bos_id=size, train_files=a.train_files))
    with pytest.raises(codec.CodecError, match=f"a tokenizer of {size} ids"):
        codec.codec_for(tg.Hyperparameters(vocab_size=999, bos_id=998), str(folder / "tokenizer.json"))


def _load_prose_corpus():
    pytest.importorskip("tokenizers", reason="needs the tokenizers library: pip install -r experiments/requirements.txt")
    spec = importlib.util.spec_from_file_location("prose_corpus", ROOT / "data" / "prose_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sample_prints_the_prompt_and_generates_continuation(checkpoints, capsys):
    path, model = checkpoints[1]
    r = run_script("sample", path, "--prompt", "The river", "--max_new_tokens", 12, "--temperature", 0, capsys=capsys)
    assert r.returncode == 0, r.stderr
    prompt = [BYTES_BOS] + list(b"The river")
    new = inference.generate(model, prompt, 12, temperature=0.0, window_blocks=tg.window_blocks(10, tg.Hyperparameters(
        attn_window=256, attn_window_start=256, num_iterations=20)))
    new = new[:new.index(BYTES_BOS)] if BYTES_BOS in new else new
    assert r.stdout == "The river" + bytes(new).decode("utf-8", errors="replace") + "\n"
    r = run_script("sample", path, "--prompt", "x", "--top_k", -1, capsys=capsys)
    assert r.returncode == 2
    assert_one_line(r.stderr, "--top_k", "--help")
    r = run_script("sample", path.parent / "missing.pt", "--prompt", "x", capsys=capsys)
    assert r.returncode == 1
    assert_one_line(r.stderr, "missing.pt", "no such checkpoint")
    # a hostile tester's: NaN temperature, a seed past 64 bits, a huge --max_new_tokens (a rotary table of that
    # length) and a prompt of bytes that are not UTF-8 were tracebacks
    for flag, value in (("--seed", 10 ** 23), ("--max_new_tokens", 10 ** 9)):
        r = run_script("sample", path, "--prompt", "x", flag, value, capsys=capsys)
        assert r.returncode == 2
        assert_one_line(r.stderr, flag)
    for temperature in ("nan", "inf"):
        r = run_script("sample", path, "--prompt", "x", "--temperature", temperature, capsys=capsys)
        assert r.returncode == 2
        assert_one_line(r.stderr, "--temperature")
    r = run_script("sample", path, "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape"), capsys=capsys)
    assert r.returncode == 2
    assert_one_line(r.stderr, "--prompt is not valid UTF-8")


# ----------------------------------------------------------------------------------------------------
# experiments/needle.py


def test_needle_haystack_places_the_needle_and_scores_exact_numbers():
    needle, codec = _load("needle"), _load("codec").byte_codec()
    sentences = [codec.encode(" " + s) for s in SENTENCES]
    import random
    seen = set()
    for depth, where in [(0.0, "start"), (1.0, "end"), (0.5, "middle")]:
        ids, number, needle_at = needle.haystack(sentences, codec, BYTES_BOS, 300, depth, random.Random(depth))
        seen.add(number)
        stated = codec.encode(needle.NEEDLE.format(number))
        assert ids[needle_at:needle_at + len(stated)] == stated
        text = codec.decode(ids)
        assert len(ids) <= 300 and ids[0] == BYTES_BOS and ids.count(BYTES_BOS) == 1 and len(number) == 7
        assert text.count(f"The magic number is {number}.") == 1 and text.endswith(needle.CUE)
        at = text.index("The magic number")
        filler = len(text) - len(needle.CUE) - len(needle.NEEDLE.format(number))  # characters of filler
        if where == "start":
            assert at == 1
        elif where == "end":
            assert at - 1 == filler
        else:
            assert 0.25 * filler < at < 0.75 * filler
    assert len(seen) == 3
    assert needle.first_number(" 4817263. It") == "4817263" and needle.first_number(" 48172634") == "48172634"
    assert needle.first_number(" no") is None


def test_needle_cli_writes_table_json_and_heat_map(checkpoints, tmp_path, monkeypatch, capsys):
    path, _ = checkpoints[0]
    r = run_script("needle", path, "--contexts", "128,192", "--trials", 1, "--out", tmp_path, capsys=capsys)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "tiny0_step10_trained.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| 1")]
    assert len(rows) == 2 and all(line.count("|") == 8 + 3 for line in rows)
    results = json.loads((tmp_path / "tiny0_step10_trained.json").read_text())["results"]
    assert len(results) == 2 * 8 and {r["context"] for r in results} == {128, 192}
    assert all(r["tokens"] <= r["context"] for r in results)
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "tiny0_step10_trained.png").read_bytes()[:4] == b"\x89PNG"
    # scoring: a model that always answers with the needle scores 100, one that answers another number 0
    needle = _load("needle")
    model, a, step = inference.load_model(str(path), max_seq_len=256)
    codec = _load("codec").byte_codec()
    for answer, expect in [(lambda ids: ids[-50:], 1.0), (lambda ids: list(b" 1234567"), 0.0)]:
        def fake_generate(model, ids, n, temperature, window_blocks, cache=None, answer=answer):
            text = codec.decode(ids)
            number = text[text.index("magic number is ") + 16:][:7]
            return list(f" {number}".encode()) if expect else answer(ids)
        monkeypatch.setattr(needle.inference, "generate", fake_generate)
        results = needle.run(model, codec, a, step, [160], 1, 0, "trained", a.val_files, log=lambda *_: None)
        assert np.mean([r["correct"] for r in results]) == expect
    for contexts in ("12x", "100000000"):  # the second grew to 3.6 GB in 12 s before it was bounded
        r = run_script("needle", path, "--contexts", contexts, capsys=capsys)
        assert r.returncode == 2
        assert_one_line(r.stderr, "--contexts")
    # a hostile tester's: --out a file or --name with a path lost every result after the computation; now
    # refused before it
    (tmp_path / "a_file").write_text("x")
    def must_not_run(*args, **kwargs):
        raise AssertionError("computed before the output was checked")
    monkeypatch.setattr(needle, "run", must_not_run)
    r = run_script("needle", path, "--out", tmp_path / "a_file", capsys=capsys)
    assert r.returncode == 1
    assert_one_line(r.stderr, "--out", "cannot write")
    r = run_script("needle", path, "--out", tmp_path, "--name", "../escape", capsys=capsys)
    assert r.returncode == 2
    assert_one_line(r.stderr, "--name")


def test_needle_of_a_cplm_adds_the_cp_head_at_the_answer(checkpoints, tmp_path, capsys):
    path, _ = checkpoints[1]
    r = run_script("needle", path, "--contexts", "128", "--trials", 1, "--out", tmp_path, "--name", "c", capsys=capsys)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "c.md").read_text()
    assert "| context | lambda | needle share | lambda x needle share | answer share | lambda x answer share |" in md
    results = json.loads((tmp_path / "c.json").read_text())["results"]
    assert all(0 <= r["lam"] <= 1 and 0 <= r[share] <= 1 for r in results for share in ("needle_share", "answer_share"))


def test_needle_probe_reads_the_gate_and_the_pointer_as_the_dense_reference_does():
    """lambda and the pointer's share on chosen positions at the prompt's last position, read from generate's
    caches (a prompt longer than the window), against the dense mixture on the whole prompt."""
    needle = _load("needle")
    model = tiny_model(1)
    ids = [BOS] + np.random.default_rng(1).integers(0, 40, 300).tolist()
    cache = inference.InferenceCache(model, 1)
    with needle.AnswerProbe(model) as probe:
        inference.generate(model, ids, 3, temperature=0.0, window_blocks=1, cache=cache)
    positions, answer = [5, 17, 200], [i for i, t in enumerate(ids) if t == ids[17]]
    got = probe.read(cache, len(ids), positions, answer)
    with torch.no_grad():
        h, _ = model.hidden_states(torch.tensor([ids]), torch.tensor(1, dtype=torch.int32))
        logits = model.lm_logits(h)[0, -1].float()
        logits[model.config.copy_id] += model.copy_logit_bias
        c = logits.softmax(-1)[model.config.copy_id]
        q, k, sink_key = model.cp_head(h)
        q = q[0, -1]
        alpha = (torch.cat([k[0] @ q, (sink_key @ q)[None]]) * q.numel() ** -0.5).softmax(-1)
    s = alpha[-1]
    assert got["lam"] == pytest.approx(float(c * (1 - s)), rel=1e-4)
    assert got["needle_share"] == pytest.approx(float(alpha[positions].sum() / (1 - s)), rel=1e-4)
    assert got["answer_share"] == pytest.approx(float(alpha[answer].sum() / (1 - s)), rel=1e-4)
    # the answer share is p_CP of that token: the dense reference's mixture is (1 - lam) p_LM + lam p_CP there
    with torch.no_grad():
        p_mix = inference.next_token_log_probs(model, torch.tensor([ids]), 1)[0, -1].exp()
    p_lm = logits.index_fill(0, torch.tensor([model.config.copy_id]), float("-inf")).softmax(-1)
    v = ids[17]
    assert float(p_mix[v]) == pytest.approx(float((1 - got["lam"]) * p_lm[v] + got["lam"] * got["answer_share"]), rel=1e-4)
    assert len(answer) > 1 and 0 < got["lam"] < 1 and 0 < got["needle_share"] < 1


# ----------------------------------------------------------------------------------------------------
# experiments/inference_memory.py


@pytest.mark.parametrize("cplm", [0, 1])
def test_memory_formula_is_what_the_caches_hold(cplm):
    memory = _load("inference_memory")
    cfg = tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=4, model_dim=32, num_heads=2, no_attention_layer=2,
                       max_seq_len=640, cplm=cplm, cp_dim=16)
    for window in (None, 1, 2):
        for context in (300, 640):
            computed = memory.measured_bytes(cfg, window, context, "cpu", prefill_chunk=128)
            assert computed == memory.formula_bytes(cfg, window, context)
            assert computed == memory.measured_bytes(cfg, window, context, "meta")
    # by hand: bf16 keys and values in 3 attention layers; window 1: each layer keeps its current block
    assert memory.formula_bytes(cfg, None, 300)["kv"] == 3 * 300 * 2 * 32 * 2
    assert memory.formula_bytes(cfg, 1, 300)["kv"] == 3 * (300 - 256) * 2 * 32 * 2
    assert memory.formula_bytes(cfg, 2, 300)["kv"] == (2 * (300 - 128) + (300 - 256)) * 2 * 32 * 2
    assert memory.formula_bytes(cfg, 2, 300)["cp_keys"] == (300 * 16 * 2 if cplm else 0)


def test_memory_cli_writes_the_speedrun_table(tmp_path, capsys):
    r = run_script("inference_memory", "--contexts", 300, "--computed", "", "--out", tmp_path / "m.md", capsys=capsys)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in (tmp_path / "m.md").read_text().splitlines() if line.startswith("| 300")]
    assert len(rows) == 6
    full = next(row for row in rows if "vanilla, full attention" in row[2])
    assert full[7].strip() == f"{11 * 2 * 768 * 2:,}"  # 11 attention layers x (key, value) x 768 x bf16
    r = run_script("inference_memory", "--contexts", "4k", capsys=capsys)
    assert r.returncode == 2
    assert_one_line(r.stderr, "--contexts")


# ----------------------------------------------------------------------------------------------------
# experiments/copy_picture.py


def test_copy_trace_gates_match_the_training_forward(checkpoints):
    copy_picture = _load("copy_picture")
    _, model = checkpoints[1]
    ids = [BYTES_BOS] + list(b"abcabc the cat and the cat and the hat")
    trace = copy_picture.copy_trace(model.eval(), ids, window_blocks=1)
    x = torch.tensor([ids])
    stats = model(x[:, :-1], x[:, 1:], torch.tensor(1, dtype=torch.int32), token_stats=True)
    for gate in ("lam", "c", "s"):
        torch.testing.assert_close(torch.tensor(trace[gate]), stats[gate][0], atol=1e-5, rtol=1e-5)
    # the copy share is the copy term's part of p(y), so where the target never occurred it is 0
    share = torch.tensor(trace["copy_share"])
    assert (share[~stats["copyable"][0]] == 0).all() and (share[stats["copyable"][0]] > 0).all()
    assert all(0 <= tau <= t for t, tau in enumerate(trace["source"]))
    for t, tau in enumerate(trace["token_source"]):  # an earlier occurrence of the token x_{t+1}, if any
        assert (tau == -1) == (not stats["copyable"][0, t]) and (tau == -1 or (ids[tau] == ids[t + 1] and tau <= t))


def test_copy_picture_cli_writes_html_and_png(checkpoints, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the cat and the cat <b>&</b>")
    r = run_script("copy_picture", checkpoints[1][0], "--text", text, "--out", tmp_path / "out", capsys=capsys)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "out" / "t.html").read_text()
    assert page.count("<span style=") == len(text.read_bytes())  # one per byte after the BOS
    assert all(f">{c}</span>" in page for c in ("&lt;", "&amp;", "&gt;"))  # the text is escaped
    assert "points at position" in page and "<script" not in page
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "t.png").read_bytes()[:4] == b"\x89PNG"
    r = run_script("copy_picture", checkpoints[0][0], "--text", text, "--out", tmp_path / "v", capsys=capsys)
    assert r.returncode == 2 and not (tmp_path / "v").exists()
    assert_one_line(r.stderr, "vanilla", "--cplm 1")
    r = run_script("copy_picture", checkpoints[1][0], "--text", tmp_path / "none.txt", capsys=capsys)
    assert r.returncode == 1
    assert_one_line(r.stderr, "none.txt")
    r = run_script("copy_picture", checkpoints[1][0], "--text", text, "--out", text, capsys=capsys)  # a file
    assert r.returncode == 2 and text.read_text() == "the cat and the cat <b>&</b>"
    assert_one_line(r.stderr, "--out", "is a file")


def test_training_script_has_no_generation_and_readme_lists_its_sections():
    """Generation lives in inference.py; README's table of the script's sections matches its ruler comments."""
    source = (ROOT / "train_gpt_cplm.py").read_text()
    for name in ("class InferenceCache", "def generate(", "def sample_next(", "def load_model(", "def layer_windows("):
        assert name not in source and name in (ROOT / "inference.py").read_text()
    lines = source.splitlines()
    rulers = [i for i, line in enumerate(lines) if line.startswith("# ----")] + [len(lines)]
    expected = [(lines[i + 1].lstrip("# ").strip(), f"{i + 1}-{j}") for i, j in zip(rulers, rulers[1:])]
    readme = (ROOT / "README.md").read_text()
    listed = re.findall(r"^\| (.+?) \| (\d+-\d+) \|$", readme, re.M)
    assert listed == expected
