"""Draft tests for experiments/spamlang.py, to merge into test_cplm.py (they run from either place):
    python -m pytest -q experiments/_test_spamlang_draft.py        (about 10 s on 2 cores)
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _load_spamlang():
    here = Path(__file__).resolve().parent
    for path in (here / "spamlang.py", here / "experiments" / "spamlang.py"):
        if path.exists():
            spec = importlib.util.spec_from_file_location("spamlang", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module, path
    raise FileNotFoundError("experiments/spamlang.py")


spamlang, SPAMLANG = _load_spamlang()
REPO = SPAMLANG.parent.parent


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
