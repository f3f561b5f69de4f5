"""The experiments: race.py and race_report.py, cp_cost.py, spamlang.py (both studies), the other experiments'
bad-input rule."""
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import train_gpt_cplm as tg
from conftest import ROOT, _load_experiment, assert_one_line, random_documents, tiny_flags, write_shard

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


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
