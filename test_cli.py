"""The training script's command line end to end (a tiny run, its log, resumes, bad flags, ranks), the entry points'
bad-input rule, run.sh, requirements.txt and CI."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_cplm as tg
from conftest import (BOS, COMPARE, DOWNLOAD, ROOT, SCRIPT, TOKENIZE, _load, _run, _text_files, assert_one_line,
                      log_values, log_values_in, main_in_process, run_cli, tiny_flags, toy_corpus, write_shard)

compare = _load("tools/compare.py")  # the judge
tc = _load("data/tokenize_corpus.py")
dl = _load("data/cached_fineweb10B.py")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# ----------------------------------------------------------------------------------------------------
# the command line, end to end


@pytest.mark.parametrize("gate", ["lm", "sentinel"])
def test_cli_run_writes_a_complete_log(toy_data, tmp_path, gate):
    """The command end to end in a process of its own (the lm gate); the sentinel's log in this process."""
    r = (run_cli if gate == "lm" else main_in_process)(tiny_flags(toy_data, tmp_path, cplm=1, copy_gate=gate))
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
    (["--lr_embed", "1e38"], "learning rates must lie in [0, 1e6]: --lr_embed 1e+38"),
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
    (["--preset", "cpu", "--cp_backend", "lse_kernel"], "--cp_backend lse_kernel needs a CUDA GPU"),
    (["--cp_backend", "triton"], "--cp_backend auto, flex, dense or lse_kernel"),
    (["--cp_backend", "lse_kernel", "--cp_dim", "48"], "--cp_backend lse_kernel needs --cp_dim a power of two"),
    (["--cp_backend", "lse_kernel", "--cp_dim", "512"], "--cp_backend lse_kernel needs --cp_dim a power of two"),
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
    r = main_in_process(tiny_flags(toy_data, tmp_path / "file" / "logs"))  # a directory under a regular file
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot write there" in r.stderr
    first = main_in_process(tiny_flags(toy_data, tmp_path, num_iterations=1, val_loss_every=0))
    assert first.returncode == 0
    again = main_in_process(tiny_flags(toy_data, tmp_path, num_iterations=1, val_loss_every=0))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "run.txt exists" in again.stderr
    assert len(re.findall("^final val_loss", (tmp_path / "run.txt").read_text(), re.M)) == 1  # the log is intact
    again = main_in_process(tiny_flags(toy_data, tmp_path, num_iterations=1, val_loss_every=0, overwrite=1))
    assert again.returncode == 0


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
    r = main_in_process(tiny_flags(data, tmp_path))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "toy_train_000001.bin: holds token id 600, but --vocab_size is 500" in r.stderr
    assert not (tmp_path / "run.txt").exists()  # refused before the model: no log left to block the rerun
    # a hostile tester's: a train glob that takes the validation shard too trained on it silently
    (data / "toy_train_000001.bin").unlink()
    r = main_in_process(tiny_flags(data, tmp_path, train_files=f"{data}/toy_*.bin"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "would train on its validation set" in r.stderr and "toy_val_000000.bin" in r.stderr
    assert not (tmp_path / "run.txt").exists()
    # a byte-level corpus states its vocabulary: it sets vocab_size and bos_id, and a different flag is refused
    for name, tokens in (("train", toy_corpus(8000, 0, vocab=200, bos=256)), ("val", toy_corpus(4000, 1, vocab=200, bos=256))):
        write_shard(data / f"bytes_{name}_000000.bin", tokens, vocab=257)
    flags = dict(train_files=f"{data}/bytes_train_*.bin", val_files=f"{data}/bytes_val_*.bin", num_iterations=1,
                 val_loss_every=0, vocab_size=0, bos_id=-1)
    r = main_in_process(tiny_flags(data, tmp_path, run_id="bytes", **flags))
    assert r.returncode == 0, r.stderr
    hp = json.loads(re.search(r"^hyperparameters: (.*)$", (tmp_path / "bytes.txt").read_text(), re.M).group(1))
    assert (hp["vocab_size"], hp["bos_id"]) == (257, 256)
    r = main_in_process(tiny_flags(data, tmp_path, run_id="bytes2", **{**flags, "vocab_size": 50257}))
    assert r.returncode == 1 and "written for a vocabulary of 257 ids, --vocab_size is 50257" in r.stderr


def test_resume_continues_the_run_exactly_and_refuses_what_does_not_fit(toy_data, tmp_path):
    """kill -9 then --resume: the same losses, the clock where it stopped, the log continued; checkpoints
    rotate, and a half-written one left by a kill is removed; new learning rates apply; a checkpoint past
    the end, unreadable, or of another model is refused."""
    full = main_in_process(tiny_flags(toy_data, tmp_path, run_id="full", checkpoint_every=1, keep_checkpoints=2))
    assert full.returncode == 0, full.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["state_step000005.pt", "state_step000006.pt"]
    assert not list(tmp_path.glob(".*.lock")), "a finished run leaves no lock file"
    ckpt = tmp_path / "full" / "state_step000005.pt"
    log = (tmp_path / "full.txt").read_text()
    logged_ms = float(re.search(r"^step:5/6 train_loss:\S+ train_time:(\d+)ms", log, re.M).group(1))
    saved_ms = torch.load(ckpt, weights_only=False)["training_time_ms"]
    assert abs(saved_ms - logged_ms) < 200 and saved_ms > 0  # the clock at the checkpoint, not at the last val
    half = tmp_path / "full" / f"state_step000009.pt.123@{socket.gethostname()}.tmp"  # killed while saving: no lock,
    half.write_bytes(b"half a checkpoint")  # and quiet for an hour
    os.utime(half, (time.time() - 3600, time.time() - 3600))
    # step 6's checkpoint is there: resuming from step 5 would replace it, so that needs --overwrite 1
    refused = main_in_process(tiny_flags(toy_data, tmp_path, run_id="", resume=ckpt))
    assert refused.returncode == 2 and "holds checkpoints after this one (state_step000006.pt)" in refused.stderr
    abandoned = tmp_path / "full" / "state_step000009.pt"  # a later step of the branch --overwrite abandons
    abandoned.write_bytes(b"a later checkpoint")
    flags = tiny_flags(toy_data, tmp_path, run_id="", resume=ckpt, overwrite=1)
    del flags[flags.index("--log_dir"):flags.index("--log_dir") + 2]  # its own log is found beside the checkpoints
    resumed = main_in_process(flags)  # continues run "full"
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = (tmp_path / "full.txt").read_text()
    assert log.count("\ndef main(") == 1 and "resumed from" in log  # one log, a section appended
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
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="new_rate", resume=ckpt, lr_head=0.004, val_loss_every=0))
    assert r.returncode == 0, r.stderr[-2000:]
    log = (tmp_path / "new_rate.txt").read_text()
    assert re.search(r"changed on the command line: .*--lr_head 0\.008 -> 0\.004", log)
    # past the end: nothing to do, nothing written
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="late", num_iterations=4, resume=ckpt))
    assert r.returncode == 0 and "nothing to train: the checkpoint is at step 5" in r.stdout
    assert not (tmp_path / "late").exists() and not (tmp_path / "late.txt").exists()
    # into another run's name with --overwrite (a hostile tester's: "new_rate.txt appeared while this run was
    # starting" and a stray temporary log): said, nothing written, the other run's log untouched
    before = (tmp_path / "new_rate.txt").read_bytes()
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="new_rate", num_iterations=4, resume=ckpt, overwrite=1))
    assert r.returncode == 0 and "nothing to train" in r.stdout, r.stderr[-2000:]
    assert (tmp_path / "new_rate.txt").read_bytes() == before and not list(tmp_path.glob(".new_rate.txt.starting*"))
    # a fresh run replacing "full" (--overwrite 1) replaces its checkpoints too: no old one is left to resume
    # into the new log (copied aside first: the checks below still need one)
    shutil.copy(ckpt, tmp_path / "kept.pt")
    ckpt = tmp_path / "kept.pt"
    # --keep_checkpoints counts the run's checkpoints, not one process's: continuing it to step 8 rotates 5 and 6 out
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="", resume=tmp_path / "full" / "state_step000006.pt",
                                   num_iterations=8, val_loss_every=0))
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "full").glob("*.pt")) == [
        "state_step000007.pt", "state_step000008.pt"], r.stderr[-2000:]
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="full", overwrite=1, num_iterations=3, checkpoint_every=1,
                                   keep_checkpoints=2, val_loss_every=0))
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "full").glob("*.pt")) == [
        "state_step000002.pt", "state_step000003.pt"]
    # unreadable and mismatched checkpoints: one line, exit 1, and no log left behind
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "cut.pt").write_bytes(ckpt.read_bytes()[:5000])
    for bad, message in ((tmp_path / "junk.pt", "not a readable checkpoint"), (tmp_path / "cut.pt", "not a readable checkpoint")):
        r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="bad", resume=bad))
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="bad", resume=ckpt, model_dim=32, cplm=1))
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

    assert main_in_process(tiny_flags(toy_data, tmp_path, run_id="a", checkpoint_every=2)).returncode == 0
    assert main_in_process(tiny_flags(toy_data, tmp_path, run_id="b", checkpoint_every=2)).returncode == 0
    a_ckpt, b_ckpt = tmp_path / "a" / "state_step000004.pt", tmp_path / "b" / "state_step000004.pt"
    before = {p: p.read_bytes() for p in (tmp_path / "a.txt", tmp_path / "b.txt", b_ckpt)}
    # 1. resuming a's checkpoint under b's id: refused, b untouched
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="b", resume=a_ckpt))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "b.txt exists" in r.stderr
    assert all(p.read_bytes() == b for p, b in before.items())
    # 2. --overwrite 1 with a bad shard: refused before it started, the old log and checkpoints intact
    bad = tmp_path / "bad"
    bad.mkdir()
    write_shard(bad / "toy_train_000000.bin", toy_corpus(5000, 0), magic=1)
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="b", overwrite=1, train_files=f"{bad}/toy_train_*.bin"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert all(p.read_bytes() == b for p, b in before.items()) and not list(tmp_path.glob(".b.txt*"))
    # 3. a resume continues with the checkpoint's settings: a forgotten --num_iterations is the run's 6, not the
    # preset's 200; a changed setting is applied and listed
    args = tiny_flags(toy_data, tmp_path, run_id="", resume=a_ckpt)
    i = args.index("--num_iterations")
    r = main_in_process(args[:i] + args[i + 2:] + ["--logit_softcap", "20", "--overwrite", "1"])  # step 6's is replaced
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
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="c", resume=tmp_path / "corrupt.pt"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "do not match the digest" in r.stderr
    # a checkpoint from before the digest (no "digest" key) still resumes
    del state["digest"]
    state["model"]["embed.weight"][3, :8] = 0.0
    torch.save(state, tmp_path / "old.pt")
    assert main_in_process(tiny_flags(toy_data, tmp_path, run_id="d", resume=tmp_path / "old.pt")).returncode == 0


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
    tg.run_files.save_checkpoint(first, model, opts, 1, loader, 10.0, a, written)
    saved = open(first, "rb").read()

    def full_disk(obj, f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tg.torch, "save", full_disk)
    with pytest.raises(tg.DataError, match="cannot save the checkpoint \\(No space left on device\\)"):
        tg.run_files.save_checkpoint(str(tmp_path / "run" / "state_step000002.pt"), model, opts, 2, loader, 20.0, a, written)
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


def test_a_rank_set_without_torchrun_says_its_error_itself():
    """A process given RANK > 0 by its environment (a cluster's or a container's), not by torchrun, has no rank 0
    to speak for it: it says its error at once (it once waited a silent minute)."""
    env = {**os.environ, "RANK": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    r = subprocess.run([sys.executable, SCRIPT, "--num_iterations", "-5"], capture_output=True, text=True,
                       timeout=50, cwd=ROOT, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--num_iterations" in r.stderr, r.stderr


def test_a_refused_start_under_torchrun_ends_at_once(toy_data, tmp_path):
    """A hostile tester's: only rank 0 checked the log's name, so rank 1 waited in the rendezvous until torchrun
    killed it (~33 s). Every rank now makes the read-only checks and refuses at once."""
    import time
    assert main_in_process(tiny_flags(toy_data, tmp_path, num_iterations=0)).returncode == 0
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


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_ends_the_log_with_a_stopped_line_and_one_line_on_stderr(toy_data, tmp_path, signum):
    """A scheduler's SIGTERM once left a log without a "stopped:" line, ended mid-run; a closed terminal's SIGHUP
    left no "stopped:" line and the lock file; Ctrl-C printed a traceback."""
    import signal as sig
    import time
    args = [sys.executable, SCRIPT] + tiny_flags(toy_data, tmp_path, num_iterations=100000, val_loss_every=0)
    # a shell without job control starts background jobs with SIGINT ignored, and the child would inherit that:
    # the script gets SIGINT as a terminal gives it
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: sig.signal(sig.SIGINT, sig.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not re.search(r"^step:3/", (tmp_path / "run.txt").read_text()
                                                          if (tmp_path / "run.txt").exists() else "", re.M):
        time.sleep(0.2)
    proc.send_signal(getattr(sig, signum))
    _, err = proc.communicate(timeout=60)
    last = (tmp_path / "run.txt").read_text().splitlines()[-1]
    if signum == "SIGINT":
        assert proc.returncode == 130 and err.strip().endswith("stopped by Ctrl-C (its log says so)"), err
        assert "Traceback" not in err and last.startswith("stopped: KeyboardInterrupt")
    else:
        assert proc.returncode != 0 and f"stopped by signal {signum}" in err
        assert last == f"stopped: SystemExit: stopped by signal {signum}"
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob(".*.lock"))  # the lock goes with the run


def test_main_gives_the_callers_signal_handlers_back(toy_data, tmp_path):
    """main() installed its SIGTERM handler for good: under pytest SIGINT/SIGTERM then no longer stopped the suite.
    A caller's handlers are its own again when main returns (tools/run_race.py runs main many times)."""
    import signal as sig
    mine = lambda signum, frame: None  # noqa: E731
    before = {s: sig.signal(s, mine) for s in (sig.SIGTERM, sig.SIGHUP)}
    try:
        assert tg.main(tiny_flags(toy_data, tmp_path, num_iterations=1, val_loss_every=0)) == 0
        assert sig.getsignal(sig.SIGTERM) is mine and sig.getsignal(sig.SIGHUP) is mine
    finally:
        for s, h in before.items():
            sig.signal(s, h)


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
    one = main_in_process(tiny_flags(toy_data, tmp_path, run_id="one", warmup_steps=2, **flags))
    two = run_cli(tiny_flags(toy_data, tmp_path, run_id="two", **flags), nproc=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    for kind in ("train_loss", "val_loss"):
        a, b = log_values(tmp_path / "one.txt", kind), log_values(tmp_path / "two.txt", kind)
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4)
    assert "world_size: 2" in open(tmp_path / "two.txt").read()
    assert "warm-up done: 2 steps" in open(tmp_path / "one.txt").read()


@pytest.mark.slow  # over a minute on 2 cores (the default suite stays near 5 minutes): -m slow runs it
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


def test_a_rank_that_dies_mid_run_costs_the_other_one_line_not_a_traceback(toy_data, tmp_path):
    """A hostile tester's: rank 1 killed mid-run gave rank 0 a gloo traceback (and, at exit, now and then gloo's
    std::terminate: exit -6). Now rank 0's log ends with the collective's error, its stderr holds one line saying
    that another process ended (its own output says why), and it exits 1."""
    import signal as sig
    import socket
    import time
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.pop("TORCHELASTIC_RUN_ID", None)
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *tiny_flags(toy_data, tmp_path, num_iterations=100000,
                                                                           val_loss_every=0)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 300
        while "step:3/" not in (open(tmp_path / "run.txt").read() if (tmp_path / "run.txt").exists() else ""):
            assert time.monotonic() < deadline and procs[0].poll() is None, "rank 0 never reached step 3"
            time.sleep(0.2)
        procs[1].send_signal(sig.SIGKILL)
        _, err = procs[0].communicate(timeout=300)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 1 and "Traceback" not in err and err.count("\n") == 1, err
    assert "another process of this run ended or stopped answering" in err, err
    assert re.search(r"^stopped: ", (tmp_path / "run.txt").read_text(), re.M)


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
    # the largest learning rates the checks let through, with no soft-cap on the logits: nan at step 17
    r = main_in_process(tiny_flags(toy_data, tmp_path, run_id="nan", logit_softcap="0", lr_head="1e6", lr_scalar="1e6",
                                   lr_muon="1e6", num_iterations=20, val_loss_every=0))
    assert r.returncode == 1
    log = open(tmp_path / "nan.txt").read()
    assert re.search(r"^stopped: train_loss is nan", log, re.M)


# ----------------------------------------------------------------------------------------------------
# bad input to the entry points other than the training script: one line, exit 2 (usage) or 1 (data)


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
    r, calls = _run_sh(tmp_path, "torch tiktoken", "--num_iterations", "5", *flag)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and flag[0].split("=")[0] in r.stderr, r.stderr
    assert calls == [], calls  # refused before anything was installed, tokenized or trained


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_run_sh_help_says_what_it_does_and_touches_nothing(tmp_path, flag):
    """A user's: `bash run.sh --help` installed matplotlib, tokenized the standard library and would have passed
    --help to two training runs."""
    r, calls = _run_sh(tmp_path, "torch numpy tiktoken", flag)
    assert r.returncode == 0 and calls == [] and r.stderr == ""
    for words in ("usage: bash run.sh", "With GPUs", "vanilla, the 2025-01-26 record", "--cplm 1", "Without a GPU",
                  "the CPU race", "bash run.sh test", "tools/compare.py"):
        assert words in r.stdout, words
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake_python", "no_gpu", "run.sh"]


def test_run_sh_without_a_gpu_runs_the_race(tmp_path):
    r, calls = _run_sh(tmp_path, "tiktoken", "--num_iterations", "5")
    assert r.returncode == 0, r.stderr
    pip = [c for c in calls if c.startswith("-m pip")]
    assert len(pip) == 1 and "tiktoken" in pip[0] and "torch" not in pip[0]
    race = re.fullmatch(r"tools/run_race.py --out (logs/race_\d+_\d+_\d+) -- --num_iterations 5", calls[-1])
    assert race, calls[-1]  # the flags go to every run
    assert f"{race.group(1)}/" in r.stdout  # the race's folder named before it starts
    r, calls = _run_sh(tmp_path, "nothing", "race", "--seeds", "0,1,2,3,4")  # its own arguments, on any machine
    assert re.fullmatch(r"tools/run_race.py --out logs/race_\d+_\d+_\d+ --seeds 0,1,2,3,4", calls[-1]), calls[-1]


def test_run_sh_refuses_exactly_the_flags_the_race_sets():
    race = _load("tools/run_race.py")
    text = (Path(ROOT) / "run.sh").read_text()
    refused = set(re.findall(r"--(\w+)\|--\1=\*", text))
    assert refused == set(race.RACE_OWNS), refused ^ set(race.RACE_OWNS)


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
                                                               "matplotlib", "scipy>=1.11"]
    assert requirements(Path(ROOT) / ".ci" / "constraints.txt") == ["torch==2.13.0", "triton==3.8.0"]
    ci = (Path(ROOT) / ".ci" / "run").read_text().strip().splitlines()
    install = [l for l in ci if "pip install" in l]
    assert len(install) == 1 and "-r requirements.txt" in install[0] and "-c .ci/constraints.txt" in install[0]
    # README's first code block is exactly the commands (the run, the tests, the help), and CI runs the tests
    block = re.search(r"```\n(.*?)```", (Path(ROOT) / "README.md").read_text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["bash run.sh", "bash run.sh race", "bash run.sh test", "bash run.sh --help"]
    assert ci[-1] == "bash run.sh test"
