"""A run's files and the data it trusts (run_files.py, through train_gpt_cplm.main): temporary checkpoints of live
writers, the shards every rank reads, the validation set kept apart from the training set, resuming on the same
bytes, finishing a run killed after its final checkpoint, a vocabulary the machine can hold, crafted checkpoints,
a run whose loss never moves."""
import dataclasses
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import run_files
import train_gpt_cplm as tg
from conftest import SCRIPT, VOCAB, log_values, main_in_process, one_thread, tiny_flags, toy_corpus, write_shard


@pytest.fixture(autouse=True)
def _on_one_thread():
    """Each test's runs on one thread, as the command line's (run_cli: OMP_NUM_THREADS=1): what is tested here is a
    run's files, which the thread count does not change; two threads on two cores shared with another process
    made a 6-step tiny run take ~15 s instead of ~0.5 s."""
    with one_thread():
        yield


def test_a_live_writers_temporary_checkpoint_stays_whatever_its_pid_says(tmp_path):
    """A hostile tester's: a run saving inside another PID namespace (its pid dead out here) lost its temporary
    checkpoint to a --resume outside, and died. A writer holds an flock on its temporary file until the rename;
    only an unlocked file, quiet for a minute, is a killed writer's (and a folder with glob characters in its name
    matches only itself; another host's files stay)."""
    folder, lookalike = tmp_path / "L[1]", tmp_path / "L1"
    folder.mkdir()
    lookalike.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    here = f"{dead}@{socket.gethostname()}"
    live, killed, fresh = (folder / f"state_step00000{i}.pt.{here}.tmp" for i in (2, 3, 4))
    other_host, elsewhere = folder / f"state_step000005.pt.{dead}@another-node.example.tmp", lookalike / killed.name
    for path in (live, killed, fresh, other_host, elsewhere):
        path.write_bytes(b"partial")
    old = time.time() - 3600
    for path in (live, killed, other_host, elsewhere):
        os.utime(path, (old, old))
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'rb'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(live)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        removed = run_files.remove_stale_saves([str(folder)])
    finally:
        holder.kill()
    assert removed == [str(killed)]
    assert live.exists() and fresh.exists() and other_host.exists() and elsewhere.exists()
    # and save_checkpoint holds the lock while it writes: a save in progress cannot be taken for stale
    seen = {}

    def save_and_look(obj, f):
        probe = open(f.name, "rb")
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen["locked"] = False
        except BlockingIOError:
            seen["locked"] = True
        probe.close()
        torch.serialization.save(obj, f)
    model = torch.nn.Linear(2, 2)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1)] * 2
    loader = type("L", (), {"state": lambda self: {"position": 0}})()
    original, torch.save = torch.save, save_and_look
    try:
        run_files.save_checkpoint(str(tmp_path / "run" / "state_step000001.pt"), model, opts, 1, loader, 0.0,
                                  tg.Hyperparameters(), [])
    finally:
        torch.save = original
    assert seen == {"locked": True} and os.listdir(tmp_path / "run") == ["state_step000001.pt"]


@pytest.mark.slow  # over a minute on 2 cores (the default suite stays near 5 minutes): -m slow runs it
def test_ranks_that_see_different_shards_are_refused_together(tmp_path):
    """A hostile tester's: the same flags on two ranks, started in two folders whose relative globs find
    different shards (two nodes' local copies), trained to the end. The ranks' digest now covers the bytes."""
    for node, seed in (("a", 0), ("b", 5)):
        data = tmp_path / node / "data"
        data.mkdir(parents=True)
        write_shard(data / "toy_train_000000.bin", toy_corpus(60_000, seed))
        write_shard(data / "toy_val_000000.bin", toy_corpus(20_000, 2))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank, node in ((0, "a"), (1, "b")):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *tiny_flags("data", tmp_path / "logs")], env=env,
                                      cwd=tmp_path / node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert "see different shards" in outs[0][1] and outs[0][1].count("\n") == 1
    assert not (tmp_path / "logs" / "run.txt").exists()


@pytest.mark.parametrize("how", ["hard link", "copy"])
def test_a_train_shard_under_another_name_is_refused_as_the_validation_set(toy_data, tmp_path, how):
    """A hostile tester's: a hard link, bind mount or copy of a train shard was accepted as the validation set (the
    val loss fell to 5.83 from ~6.47). Inodes and bytes are compared, not paths."""
    val = tmp_path / "val"
    val.mkdir()
    (os.link if how == "hard link" else shutil.copy)(toy_data / "toy_train_000001.bin", val / "v_val_000000.bin")
    with pytest.raises(tg.DataError, match="would train on its validation set"):
        tg.main(tiny_flags(toy_data, tmp_path / "logs", val_files=f"{val}/v_val_*.bin"))
    assert not (tmp_path / "logs" / "run.txt").exists()


def _shards(folder, train_seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / "toy_train_000000.bin", toy_corpus(60_000, train_seed))
    write_shard(folder / "toy_val_000000.bin", toy_corpus(20_000, 2))
    return folder


def test_a_resume_on_other_bytes_is_refused(tmp_path):
    """A hostile tester's: a run resumed after its shards changed continued silently (two val sha256 in one log).
    The checkpoint carries the shards' hashes."""
    data = _shards(tmp_path / "data")
    logs = tmp_path / "logs"
    assert tg.main(tiny_flags(data, logs, num_iterations=4, checkpoint_every=2)) == 0
    _shards(data, train_seed=9)  # the same names, other bytes
    with pytest.raises(tg.DataError, match="train shards' bytes differ"):
        tg.main(["--resume", str(logs / "run" / "state_step000004.pt"), "--num_iterations", "6"])
    _shards(data, train_seed=0)  # the original bytes again: it continues
    assert tg.main(["--resume", str(logs / "run" / "state_step000004.pt"), "--num_iterations", "6"]) == 0


def test_a_run_killed_after_its_final_checkpoint_is_finished_by_its_resume(toy_data, tmp_path):
    """A hostile tester's: a run killed between its final checkpoint and its final line got "nothing to train" on
    resume, its log never finished, and the speedrun's driver started it again every 5 s. Its resume now runs the
    final validation and writes the final line; a finished run's resume still trains nothing and writes nothing."""
    logs = tmp_path / "logs"
    assert tg.main(tiny_flags(toy_data, logs, num_iterations=4, save_checkpoint=1)) == 0
    log = logs / "run.txt"
    finished = log.read_text()
    final = [line for line in finished.splitlines() if line.startswith("final ")]
    assert len(final) == 1
    log.write_text(finished[:finished.rindex("peak memory")])  # killed after saving, before its last lines
    assert tg.main(["--resume", str(logs / "run" / "state_step000004.pt")]) == 0
    lines = log.read_text().splitlines()
    assert [line for line in lines if line.startswith("final ")] and lines[-1].startswith("final val_loss:")
    assert sum(line.startswith("final ") for line in lines) == 1  # the killed section had none
    assert lines[-1].split()[1] == final[0].split()[1]  # the same weights: the same final val loss
    before = log.read_text()
    assert tg.main(["--resume", str(logs / "run" / "state_step000004.pt")]) == 0  # finished: nothing to train
    assert log.read_text() == before


def test_a_vocabulary_the_machine_cannot_hold_is_refused_before_any_model(toy_data, tmp_path, monkeypatch):
    """A hostile tester's: a header vocabulary of exactly 2^24 passed the "more than 2^24" check and built 3.2G
    parameters (an OOM kill with no line). The tables' bytes are checked against the machine's memory."""
    a = tg.parse_args(tiny_flags(toy_data, tmp_path, vocab_size=2 ** 24, bos_id=VOCAB - 1))
    monkeypatch.setattr(run_files, "header_vocab_size", lambda patterns: 0)
    monkeypatch.setattr(run_files, "machine_memory", lambda: 8 * 2 ** 30)
    with pytest.raises(tg.DataError, match=r"needs 80\.0 GiB for its tables alone, more than this machine's 8\.0"):
        tg.resolve_vocabulary(a)
    assert tg.resolve_vocabulary(tg.parse_args(tiny_flags(toy_data, tmp_path))).vocab_size == VOCAB


@pytest.mark.parametrize("field,value,words", [("num_layers", "x", "settings are not this script's"),
                                               ("step", -7, "not a readable checkpoint")])
def test_crafted_checkpoints_are_one_line(toy_data, tmp_path, field, value, words):
    """A hostile tester's: a non-numeric num_layers or a step of -7 in a checkpoint raised TypeError or
    ZeroDivisionError on --resume."""
    logs = tmp_path / "logs"
    assert tg.main(tiny_flags(toy_data, logs, num_iterations=2, save_checkpoint=1)) == 0
    path = logs / "run" / "state_step000002.pt"
    state = torch.load(path, weights_only=True)
    if field == "step":
        state["step"] = value
    else:
        state["hyperparameters"][field] = value
    state.pop("digest")  # a crafted file carries no valid digest
    torch.save(state, path)
    r = main_in_process(["--resume", path, "--run_id", "again"])
    assert r.returncode == 1 and words in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr[-2000:]


def test_a_loss_that_never_moves_is_said(toy_data, tmp_path):
    """A hostile tester's: --lr_muon 1e30 --lr_embed 1e30 kept the loss at its step-0 value for the whole run, exit 0,
    nothing said. The first validation after the start that shows the same loss says so."""
    logs = tmp_path / "logs"
    assert tg.main(tiny_flags(toy_data, logs, num_iterations=0)) == 0  # nothing trained: nothing to warn about
    flags = tiny_flags(toy_data, logs, run_id="still", lr_embed=0, lr_head=0, lr_scalar=0, lr_muon=0, lr_cp=0)
    assert tg.main(flags) == 0
    text = (logs / "still.txt").read_text()
    values = log_values(logs / "still.txt", "val_loss")
    warned = [line for line in text.splitlines() if line.startswith("warning: val_loss is still")]
    assert len(set(values)) == 1 and len(warned) == 1
    assert tg.main(tiny_flags(toy_data, logs, run_id="moves")) == 0
    assert not [line for line in (logs / "moves.txt").read_text().splitlines() if line.startswith("warning:")]
    assert np.isfinite(values).all()


def test_overwrite_destroys_nothing_before_the_new_run_can_replace_it(toy_data, tmp_path, monkeypatch):
    """A hostile tester's: --overwrite 1 deleted the old run's checkpoints and replaced its log before the step-0
    validation; a run that crashed there left nothing of either run. Now the log is replaced after the first
    validation, and the old checkpoints are set aside then."""
    assert main_in_process(tiny_flags(toy_data, tmp_path, run_id="old", checkpoint_every=2)).returncode == 0
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
    assert main_in_process(tiny_flags(toy_data, tmp_path, checkpoint_every=2)).returncode == 0
    r = main_in_process(tiny_flags(toy_data, tmp_path, overwrite=1, num_iterations=2, lr_muon=0.01))  # saves nothing
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list((tmp_path / "run").glob("*.pt")) and "checkpoint(s) moved to" in (tmp_path / "run.txt").read_text()
    r = main_in_process(tiny_flags(toy_data, tmp_path, resume=tmp_path / "run" / "state_step000006.pt"))
    assert r.returncode == 2 and "no such checkpoint file" in r.stderr
    aside, = (tmp_path / "run").glob("replaced_*")
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="branch", resume=aside / "state_step000004.pt"))
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
    writes = tg.run_files.Logger.__call__

    def log_on_a_full_disk(self, line, *args, **kwargs):
        if line.startswith("stopped:"):
            raise OSError(28, "No space left on device")
        return writes(self, line, *args, **kwargs)
    monkeypatch.setattr(tg.run_files, "save_checkpoint", full_disk)
    monkeypatch.setattr(tg.run_files.Logger, "__call__", log_on_a_full_disk)
    with pytest.raises(tg.DataError, match="No space left") as raised:
        tg.main(tiny_flags(toy_data, tmp_path, checkpoint_every=2, warmup_steps=0))
    assert raised.value.__context__ is None


def test_a_diverged_model_saves_no_checkpoint_over_good_ones(tmp_path):
    """A hostile tester's: with --checkpoint_every 1 --keep_checkpoints 2 and diverging learning rates, only NaN
    checkpoints remained. A state with a non-finite weight is refused in one line; the good one stays."""
    model, loader = torch.nn.Linear(2, 2), types.SimpleNamespace(state=lambda: {"position": 0})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a, written = tg.parse_args(["--preset", "cpu", "--keep_checkpoints", "1"]), []
    tg.run_files.save_checkpoint(str(tmp_path / "run" / "state_step000001.pt"), model, [opt], 1, loader, 0.0, a, written)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(tg.DataError, match=r"weights are not finite .*newest: .*state_step000001\.pt"):
        tg.run_files.save_checkpoint(str(tmp_path / "run" / "state_step000002.pt"), model, [opt], 2, loader, 0.0, a, written)
    assert os.listdir(tmp_path / "run") == ["state_step000001.pt"]


def test_a_fresh_run_refuses_a_folder_of_earlier_checkpoints(tmp_path):
    """A hostile tester's: with logs/<run_id>.txt gone, a fresh run silently replaced logs/<run_id>/'s
    checkpoints. The folder is the run's, like its log: refused without --overwrite 1."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state_step000004.pt").write_bytes(b"an earlier run's")
    flags = ["--preset", "cpu", "--log_dir", str(tmp_path), "--run_id", "run"]
    with pytest.raises(tg.UsageError, match="holds checkpoints of an earlier run"):
        tg.run_files.check_log_target(tg.parse_args(flags))
    # a resume of another run's checkpoint starts a new run in this folder: it would write over them too
    other = dataclasses.replace(tg.parse_args(flags), resume=str(tmp_path / "other" / "state_step000002.pt"))
    with pytest.raises(tg.UsageError, match="holds checkpoints of an earlier run"):
        tg.run_files.check_log_target(other)
    tg.run_files.check_log_target(tg.parse_args(flags + ["--overwrite", "1"]))


def test_one_process_per_run_id(tmp_path):
    """The hostile tester's #8: two resumes of one checkpoint both ran, appending to one log. Every start takes
    the run's lock (an flock, released when the process ends): a second start of the same run_id is refused."""
    import fcntl
    flags = ["--preset", "cpu", "--log_dir", str(tmp_path), "--run_id", "run"]
    with open(tmp_path / ".run.lock", "a") as held:  # another process's run
        fcntl.flock(held, fcntl.LOCK_EX)
        assert tg.run_files.check_log_target(tg.parse_args(flags)) is None  # not taken: main refuses, on every rank
        with pytest.raises(tg.UsageError, match="run run is training in another process"):
            tg.main(flags)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock"]  # nothing written
    tg.run_files.check_log_target(tg.parse_args(flags)).close()


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
    merged, changed = tg.run_files.settings_on_resume(a, saved, tg.FLAGS_GIVEN)
    tg.check_args(dataclasses.replace(merged, resume=""), tg.FLAGS_GIVEN)  # the merged settings make a run
    assert (merged.batch_size, merged.seq_len, merged.cplm, merged.copy_gate_init) == (4096, 4096, 1, 0.0)
    assert changed == ["--seq_len 1024 -> 4096",
                       "--copy_gate_init 0.5 ignored (the checkpoint's weights are loaded)"]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo ran > /dev/null",))


def test_the_small_refusals_say_what_is_wrong(toy_data, tmp_path):
    """A hostile tester's cosmetics: a malicious checkpoint's message quoted torch's advice to load it with
    weights_only=False; resuming a CPLM checkpoint as the sentinel was "Error(s) in loading state_dict";
    --target_val_loss inf was "reached at step 0"."""
    evil = tmp_path / "evil.pt"
    torch.save({"step": 1, "model": _RunsCode()}, evil)
    with pytest.raises(tg.DataError, match="could run code") as e:
        run_files.read_checkpoint(str(evil), "cpu")
    assert "weights_only" not in str(e.value)
    logs = tmp_path / "logs"
    assert tg.main(tiny_flags(toy_data, logs, num_iterations=2, save_checkpoint=1, cplm=1)) == 0
    with pytest.raises(tg.DataError, match="copy_gate 'lm' -> 'sentinel'"):
        tg.main(["--resume", str(logs / "run" / "state_step000002.pt"), "--run_id", "s", "--copy_gate", "sentinel"])
    with pytest.raises(tg.UsageError, match="--target_val_loss must be a finite loss"):
        tg.parse_args(tiny_flags(toy_data, logs, target_val_loss="inf"))


def test_a_stale_save_in_a_read_only_folder_is_left_without_an_error(tmp_path, monkeypatch):
    """A resume from a run folder on a read-only file system that holds a leftover temporary checkpoint: the file
    cannot be removed (EROFS), so it is left and the resume goes on (it raised before)."""
    import errno
    stale = tmp_path / f"state_step000002.pt.{99999}@{run_files.socket.gethostname()}.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600,) * 2)

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(run_files.os, "remove", read_only)
    assert run_files.remove_stale_saves([str(tmp_path)]) == [] and stale.exists()
