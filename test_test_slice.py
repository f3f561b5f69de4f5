"""Tests of experiments/test_slice.py's bookkeeping against a hostile tester: --keep_done never mixes two slices
of one checkpoint, counts a checkpoint reached through a link once and drops the scores of a run trained again
under its run_id; crafted checkpoints and a bad OUT.json are one-line errors with nothing written.
`python3 -m pytest -q test_test_slice.py` (seconds, CPU; tiny models)."""
import json
import os

import numpy as np
import pytest
import torch

import train_gpt_cplm as tg
from conftest import _load_experiment, write_shard

BOS, VOCAB = 99, 100
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
ts = _load_experiment("test_slice")
SLICE = ["--test_start", "400", "--test_tokens", "300"]


# ----------------------------------------------------------------------------------------------------
# helpers (as test_baselines.py builds its tiny checkpoints)


def toy_val_split(folder):
    """folder/toy_val_000000.bin: documents of 40-120 tokens over 12 ids, 1400+ tokens."""
    rng = np.random.default_rng(0)
    tokens = []
    while len(tokens) < 1400:
        tokens += [BOS] + rng.integers(0, 12, int(rng.integers(40, 120))).tolist()
    write_shard(folder / "toy_val_000000.bin", tokens, vocab=VOCAB)


def tiny_checkpoint(folder, run_id="tiny", step=2, cplm=1, salt=0):
    """folder/logs/<run_id>/state_step<step>.pt of a random 2 x 32 model (salt: other weights); CPLM by default,
    which is scored without the neural cache's grid (faster)."""
    hp = tg.parse_args(["--preset", "cpu", "--vocab_size", str(VOCAB), "--bos_id", str(BOS), "--num_layers", "2",
                        "--model_dim", "32", "--num_heads", "2", "--seq_len", "128", "--val_seq_len", "128",
                        "--batch_size", "128", "--val_tokens", "256", "--cplm", str(cplm), "--seed", "3",
                        "--val_files", str(folder / "toy_val_*.bin"), "--run_id", run_id,
                        "--log_dir", str(folder / "logs")])
    torch.manual_seed(hp.seed + 1000 * salt)
    model = tg.GPT(tg.GPTConfig.from_args(hp))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.1)
    path = folder / "logs" / run_id / f"state_step{step:06d}.pt"

    class Loader:
        def state(self):
            return {"position": 0}
    tg.run_files.save_checkpoint(str(path), model, tg.build_optimizers(model, hp, 0, 1), step, Loader(), 0.0, hp, [])
    return path


def crafted(path, name, change):
    """A copy of the checkpoint with change(state) applied and its digest made to match (a careful forger)."""
    state = torch.load(path, weights_only=True)
    change(state)
    state["digest"] = tg.run_files.tensor_digest([state["model"], state["optimizers"],
                                                  tg.run_files.checkpoint_scalars(state)])
    out = path.parent / f"state_step{name}.pt"
    torch.save(state, out)
    return out


def records_of(out):
    return json.loads(out.with_suffix(".json").read_text())["records"]


def count_scored(monkeypatch):
    calls = []
    real = ts.evaluate_checkpoint
    monkeypatch.setattr(ts, "evaluate_checkpoint", lambda *a: calls.append(a[0]) or real(*a))
    return calls


def one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("test_slice.py: error: ") and "Traceback" not in err, err
    return err


def record(run_id, seed, mode, loss, slice_):
    return {"checkpoint": f"/nowhere/{run_id}.pt", "run_id": run_id, "seed": seed, "mode": mode, "vocab_size": 100,
            "step": 10, "test_documents": 3, "slice": slice_, "file": [1, 2],
            "test": {"loss": loss, "copyable": 1.0, "other": 2.0, "copy_share": 0.5, "tokens": 10}}


# ----------------------------------------------------------------------------------------------------
# --keep_done: what one table pools


def test_keep_done_never_averages_two_slices_of_one_checkpoint_as_seeds(tmp_path):
    """Hostile tester: one checkpoint scored on two slices (--keep_done keeps both) showed "| tiny | 2 | 3,3 |",
    the two slices averaged as if two seeds."""
    toy_val_split(tmp_path)
    path = tiny_checkpoint(tmp_path)
    out = tmp_path / "slice"
    for tokens in ("300", "600"):
        assert ts.main([str(path.parent), "--out", str(out), "--keep_done", "1", "--test_start", "400",
                        "--test_tokens", tokens]) == 0
    assert len(records_of(out)) == 2
    table = out.with_suffix(".md").read_text()
    assert "3,3" not in table and "Mean over seeds" not in table
    assert "| --test_start 400 --test_tokens 600 |" in table  # each row says its slice
    assert not list(tmp_path.glob("*.tmp"))  # the outputs went through temporary files, none left
    # two seeds on one slice are averaged; the same seeds on another slice are their own row; a seed that two
    # records claim on one slice is not a sample of two
    rows = [record("m_cplm_s0", 0, "cplm", 4.0, [1, 2]), record("m_cplm_s1", 1, "cplm", 4.2, [1, 2]),
            record("m_cplm_s0", 0, "cplm", 9.0, [5, 6]), record("m_cplm_s1", 1, "cplm", 9.2, [5, 6]),
            record("m_vanilla_s0", 0, "vanilla", 5.0, [1, 2]), record("m_vanilla_s1", 1, "vanilla", 5.2, [1, 2]),
            record("m_vanilla_s0", 0, "vanilla", 0.0, [5, 6])]
    table = ts.markdown(rows, "cmd")
    assert "| m_cplm (--test_start 1 --test_tokens 2) | 10 | 0,1 | 4.1000 +- 0.1414 |" in table
    assert "| m_cplm (--test_start 5 --test_tokens 6) | 10 | 0,1 | 9.1000 +- 0.1414 |" in table
    assert "| m_cplm (--test_start 1 --test_tokens 2) | 10 | 0,1 | 1.0000 +- 0.0000 |" in table  # gaps: one slice
    assert "| m_cplm (--test_start 5 --test_tokens 6) | 10 | 0 | -9.0000 |" in table
    repeated = ts.markdown(rows[:2] + [{**rows[0], "checkpoint": "/elsewhere.pt", "test": rows[2]["test"]}], "cmd")
    assert "| m_cplm | 10 | 0,1,0 | a seed repeated: not averaged | - | - | - |" in repeated


def test_keep_done_counts_a_checkpoint_reached_through_a_link_once(tmp_path, monkeypatch, capsys):
    """Hostile tester: the same checkpoint scored again through a linked folder was a second record (a second
    sample in every mean); a hard link too."""
    toy_val_split(tmp_path)
    path = tiny_checkpoint(tmp_path)
    scored = count_scored(monkeypatch)
    out = tmp_path / "slice"
    keep = ["--out", str(out), "--keep_done", "1", *SLICE]
    assert ts.main([str(path.parent), *keep]) == 0
    (tmp_path / "alias").symlink_to(tmp_path / "logs", target_is_directory=True)
    assert ts.main([str(tmp_path / "alias" / "tiny"), *keep]) == 0
    assert len(records_of(out)) == 1 and len(scored) == 1
    hard = tmp_path / "hard_link.pt"
    os.link(path, hard)
    assert ts.main([str(hard), *keep]) == 0  # another name, the same file: the record stands for it
    assert len(records_of(out)) == 1 and len(scored) == 1
    capsys.readouterr()
    assert ts.main([str(path), str(hard), "--out", str(tmp_path / "fresh"), *SLICE]) == 0  # both named at once
    assert "(a link to it): scored once" in capsys.readouterr().err
    assert len(records_of(tmp_path / "fresh")) == 1 and len(scored) == 2


def test_keep_done_drops_the_scores_of_a_run_trained_again_under_its_run_id(tmp_path, monkeypatch):
    """Hostile tester: a run re-trained under its run_id kept the old run's score beside the new run's. A run only
    appends to its log, so a log that no longer starts as it did says the run was replaced; a checkpoint that
    --overwrite set aside (<run>/replaced_<time>/) was replaced too. A checkpoint its own live run rotated away
    keeps its score."""
    toy_val_split(tmp_path)
    log = tmp_path / "logs" / "r.txt"
    log.parent.mkdir()
    log.write_text("the first run's header\nstep:0/200 val_loss:4.6 train_time:1ms\n")
    out = tmp_path / "slice"
    argv = [str(tmp_path / "logs" / "r"), "--out", str(out), "--keep_done", "1", *SLICE]
    first = tiny_checkpoint(tmp_path, "r", step=2)
    assert ts.main(argv) == 0
    # the same run goes on: its log grows, it saves step 4 and rotates step 2 away: step 2's score stays
    with open(log, "a") as f:
        f.write("step:4/200 val_loss:4.5 train_time:2ms\n")
    tiny_checkpoint(tmp_path, "r", step=4, salt=1)
    first.unlink()
    assert ts.main(argv) == 0
    assert [r["step"] for r in records_of(out)] == [2, 4]
    # trained again by hand (log and checkpoints deleted, a new run under the name): its step 6 alone
    log.unlink()
    (tmp_path / "logs" / "r" / "state_step000004.pt").unlink()
    log.write_text("the second run's header\nstep:0/200 val_loss:4.7 train_time:1ms\n")
    tiny_checkpoint(tmp_path, "r", step=6, salt=2)
    assert ts.main(argv) == 0
    assert [r["step"] for r in records_of(out)] == [6]
    # an --overwrite resume of step 6 would branch: that log goes on, step 6 is set aside, the branch saves 8
    with open(log, "a") as f:
        f.write("resumed from logs/r/state_step000006.pt\n")
    aside = tmp_path / "logs" / "r" / "replaced_20260101_000000_1"
    aside.mkdir()
    os.replace(tmp_path / "logs" / "r" / "state_step000006.pt", aside / "state_step000006.pt")
    tiny_checkpoint(tmp_path, "r", step=8, salt=3)
    scored = count_scored(monkeypatch)
    assert ts.main(argv) == 0
    assert [r["step"] for r in records_of(out)] == [8] and len(scored) == 1
    assert records_of(out)[0]["log"]["bytes"] == log.stat().st_size  # what the next run compares
    assert "3,3" not in out.with_suffix(".md").read_text()


# ----------------------------------------------------------------------------------------------------
# bad inputs: one line, exit 1, nothing written


@pytest.mark.parametrize("change,says", [
    (lambda s: s["hyperparameters"].update(num_layers="x"), "num_layers 'x' is not an integer"),  # was a TypeError
    (lambda s: s["hyperparameters"].update(num_iterations="x"), "num_iterations 'x' is not an integer"),
    (lambda s: s["hyperparameters"].update(val_tokens=0, cplm=0), "val_tokens 0"),  # was a ZeroDivisionError
    (lambda s: s["hyperparameters"].update(val_seq_len=0), "--val_seq_len must be"),  # was a ValueError
    (lambda s: s["hyperparameters"].update(num_layers=1000), "do not describe its weights"),  # not 1000 layers built
    (lambda s: s.update(step=-7), "step -7"),
    (lambda s: s.update(step=500), "step 500 is past its run's num_iterations 200"),  # was scored silently
], ids=["num_layers_str", "num_iterations_str", "no_tuning_slice", "val_seq_len_0", "layers_not_in_weights",
        "negative_step", "step_past_the_end"])
def test_crafted_checkpoint_is_one_line_and_nothing_is_written(tmp_path, monkeypatch, capsys, change, says):
    """Hostile tester: crafted checkpoints raised TypeError / ZeroDivisionError tracebacks. Every checkpoint named
    is checked before any is scored, so a good one named first is not scored and written either."""
    toy_val_split(tmp_path)
    good = tiny_checkpoint(tmp_path)
    bad = crafted(good, "_bad", change)
    scored = count_scored(monkeypatch)
    out = tmp_path / "report" / "slice"
    assert ts.main([str(good), str(bad), "--out", str(out), *SLICE]) == 1
    err = one_line_error(capsys)
    assert str(bad) in err and says in err
    assert scored == [] and os.listdir(tmp_path / "report") == []
    out.with_suffix(".json").write_text(json.dumps({"records": [record("m_cplm_s0", 0, "cplm", 4.0, [1, 2])]}))
    before = out.with_suffix(".json").read_bytes()
    assert ts.main([str(good), str(bad), "--out", str(out), "--keep_done", "1", *SLICE]) == 1
    assert says in one_line_error(capsys)
    assert out.with_suffix(".json").read_bytes() == before and os.listdir(tmp_path / "report") == ["slice.json"]


@pytest.mark.parametrize("text", [
    b"not json", b"\xff\xfe\x00", b"[]", b'{"records": 5}', b'{"records": [1]}',
    json.dumps({"records": [{k: v for k, v in record("a_s0", 0, "cplm", 4.0, [400, 300]).items()
                             if k != "test"}]}).encode(),  # was a KeyError in the table
    json.dumps({"records": [{**record("a_s0", 0, "cplm", 4.0, [400, 300]),
                             "test": {**record("a_s0", 0, "cplm", 4.0, [1])["test"], "loss": "x"}}]}).encode(),
    json.dumps({"records": [{**record("a_s0", 0, "cplm", 4.0, [[400], 300])}]}).encode(),
    json.dumps({"records": [{**record("a_s0", 0, "cplm", 4.0, [400, 300]), "file": [1]}]}).encode(),
    json.dumps({"records": [{**record("a_s0", 0, "cplm", 4.0, [400, 300]), "seed": "0"}]}).encode(),
], ids=["text", "not_utf8", "a_list", "records_not_a_list", "record_not_an_object", "no_test", "loss_not_a_number",
        "slice_of_lists", "file_of_one", "seed_str"])
def test_keep_done_refuses_a_bad_out_json_and_leaves_it_untouched(tmp_path, monkeypatch, capsys, text):
    toy_val_split(tmp_path)
    path = tiny_checkpoint(tmp_path)
    scored = count_scored(monkeypatch)
    (tmp_path / "slice.json").write_bytes(text)
    os.utime(tmp_path / "slice.json", ns=(1, 1))
    assert ts.main([str(path), "--out", str(tmp_path / "slice"), "--keep_done", "1", *SLICE]) == 1
    err = one_line_error(capsys)
    assert f"{tmp_path / 'slice.json'}" in err and "not this script's output" in err
    assert (tmp_path / "slice.json").read_bytes() == text and (tmp_path / "slice.json").stat().st_mtime_ns == 1
    assert scored == [] and not (tmp_path / "slice.md").exists()


def test_a_checkpoint_whose_val_shards_were_rebuilt_is_refused(tmp_path, capsys):
    """A hostile tester's: after the val shard was rebuilt, a run was scored on the new text and pooled with records
    scored on the old (1138 against 1062 targets) under one caption, exit 0. The checkpoint carries its shards'
    sha256: other bytes are one line, exit 1, nothing written."""
    toy_val_split(tmp_path)
    good = tiny_checkpoint(tmp_path)
    shard = tmp_path / "toy_val_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x00\x00")  # the last token changed: another build
    out = tmp_path / "report" / "slice"
    assert ts.main([str(good), "--out", str(out), *SLICE]) == 1
    assert "validated on other bytes" in one_line_error(capsys)
    assert not out.with_suffix(".json").exists()
