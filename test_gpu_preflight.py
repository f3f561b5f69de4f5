"""GPU pre-flight on CPU (gpu_check/preflight.py): every graph the CUDA path compiles is pushed through
inductor's lowering, and must stop only where a GPU is needed (Triton, a CUDA device query), never at a
lowering error. Tracing alone (test_cplm.py's aot_eager test) cannot see a lowering failure."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import train_gpt_cplm as tg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check"))
import preflight  # noqa: E402

BOS, VOCAB = 499, 500


def packed_row(T, seed, docs=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (1, T + 1), generator=g)  # a small alphabet: many targets are copyable
    for start in torch.linspace(0, T - 8, docs).long():
        ids[0, start] = BOS
    return ids[:, :-1], ids[:, 1:]


def cp_inputs(T=256, d=64, seed=0):
    torch.manual_seed(seed)
    input_ids, target_ids = packed_row(T, seed)
    doc_ids = tg.doc_ids_of(input_ids, BOS)
    copyable = tg.target_in_context(input_ids, target_ids, doc_ids, VOCAB + 12)
    q, k = (torch.randn(1, T, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, input_ids, target_ids, doc_ids, copyable


def flex_copy_loss(q, k, input_ids, target_ids, doc_ids, copyable):
    lse_doc, lse_match = tg.copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, "flex")
    return lse_doc.sum() + lse_match.sum()


def test_cp_head_flex_backward_lowers():
    """Regression: the CP head keeps only flex's LSEs; with its outputs unused, flex's backward got
    grad_out = None, which inductor's lowering multiplies unconditionally ('NoneType' object has no attribute
    'make_loader'). Both graphs must now reach the GPU-only steps, the backward's two flex ops included."""
    results = preflight.lower(flex_copy_loss, *cp_inputs())
    preflight.expect_gpu_stops(results, ["forward", "backward"])
    backward = next(r for r in results if r.kind == "backward")
    assert len(backward.flex_stops) == 2, backward.line()


def test_cp_head_zero_coupling_is_exact():
    """The coupling that gives flex's backward its grad_out changes no value and no gradient (math path)."""
    import torch.nn.attention.flex_attention as flex_module
    q, k, input_ids, target_ids, doc_ids, copyable = cp_inputs(T=128, seed=1)
    original = flex_module._validate_device
    flex_module._validate_device = lambda *a, **kw: None
    try:
        flex = tg.copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, "flex")
        grads_flex = torch.autograd.grad(flex[0].sum() + 2 * flex[1].sum(), (q, k))
    finally:
        flex_module._validate_device = original
    dense = tg.copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, "dense")
    grads_dense = torch.autograd.grad(dense[0].sum() + 2 * dense[1].sum(), (q, k))
    for a, b in zip(flex, dense):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_flex, grads_dense):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def gpu_path_model(cplm):
    return preflight.cuda_path_model(cplm, 512, vocab_size=VOCAB, bos_id=BOS, num_layers=4, model_dim=64,
                                     num_heads=2, no_attention_layer=2)


@pytest.mark.parametrize("cplm", [0, 1])
def test_training_and_eval_graphs_lower(cplm):
    """Both modes' training forward and backward (FlexAttention masks, FP8 head, CP head) and evaluation
    (eval mode, token statistics) as train_gpt_cplm compiles them on CUDA."""
    model = gpu_path_model(cplm)
    x, y = packed_row(384, seed=2)
    window = torch.tensor(3, dtype=torch.int32)
    train = preflight.lower(model, x, y, window)
    preflight.expect_gpu_stops(train, ["forward", "backward"])
    # every attention layer's flex op, and the CP head's two, reached the GPU-only step in both directions
    flex_ops = 3 + 2 * cplm  # 4 layers, one without attention
    for r in train:
        assert len(r.flex_stops) == flex_ops, r.line()
    model.eval()
    xv, yv = packed_row(512, seed=3)
    with torch.no_grad():
        evaluation = preflight.lower(lambda a, b, w: model(a, b, w, token_stats=True), xv, yv, window)
    preflight.expect_gpu_stops(evaluation, ["inference"])


def test_fp8_and_newton_schulz_graphs_lower():
    """The FP8 head's two kernel bodies (compiled on their own on CUDA) and Muon's Newton-Schulz."""
    x, w = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(512, 64)
    with torch.no_grad():
        fwd = preflight.lower(tg._fp8_forward, x, w, 2.0, 2.0 ** 9)
        _, x8, w8 = tg._fp8_forward(x, w, 2.0, 2.0 ** 9)
        grad = torch.randn(256, 512, dtype=torch.bfloat16)
        bwd = preflight.lower(tg._fp8_backward, grad, x8, w8, 2.0, 2.0 ** 9, 2.0 ** 19)
        ns = preflight.lower(tg.newton_schulz, torch.randn(4, 64, 256))
    for results in (fwd, bwd, ns):
        preflight.expect_gpu_stops(results, ["inference"])


def test_preflight_reports_a_lowering_error():
    """A lowering error is reported as a finding, not taken for a GPU-only stop (the pre-flight can fail)."""
    from torch._inductor.lowering import lowerings
    op = torch.ops.aten.exp.default
    saved = lowerings[op]

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'make_loader'")
    lowerings[op] = broken
    try:
        results = preflight.lower(lambda t: t.exp().sum(), torch.randn(8, 8, requires_grad=True))
    finally:
        lowerings[op] = saved
    assert any(r.error and "make_loader" in r.error for r in results), [r.line() for r in results]
    with pytest.raises(AssertionError):
        preflight.expect_gpu_stops(results, ["forward", "backward"])


ROOT = os.path.dirname(os.path.abspath(__file__))
FIRST_CALL = [sys.executable, "gpu_check/first_call.py"]


def toy_shards(folder):
    """GPT-2-like train and val shards: ids below 300, documents each starting with 50256."""
    import numpy as np
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 40_000), ("val", 4_000)):
        tokens = rng.integers(0, 300, n)
        tokens[::rng.integers(150, 400)] = 50256
        tokens[0] = 50256
        header = np.zeros(256, dtype="<i4")
        header[:3] = [20240520, 1, n]
        (folder / f"toy_{split}_000000.bin").write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())


def start_first_call(tmp_path, inject, deadline, shards=True, pairs=0):
    """gpu_check/first_call.py --dry_run (CPU, tiny, 4 timed steps, `pairs` pairs of re-runs) with its work folder
    under tmp_path/tmp; without shards, --data names a folder that does not exist."""
    if shards:
        toy_shards(tmp_path / "data")
    (tmp_path / "tmp").mkdir()
    cmd = FIRST_CALL + ["--dry_run", "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--steps", "4",
                        "--deadline_s", str(deadline), "--inject", inject, "--pairs", str(pairs)]
    with open(tmp_path / "stdout.txt", "w") as stdout:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})


def watch_out(proc, out, until=lambda names: False, timeout=200):
    """Every name seen in $OUT while proc runs (polled every 50 ms), until proc ends or until(names) holds."""
    seen, t0 = set(), time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        names = set(os.listdir(out)) if out.exists() else set()
        seen |= names
        if until(names):
            break
        time.sleep(0.05)
    return seen


def run_first_call(tmp_path, inject, deadline, shards=True, pairs=0):
    """Runs it to the end: (its report, its wall time, every name seen in $OUT meanwhile)."""
    t0 = time.monotonic()
    proc = start_first_call(tmp_path, inject, deadline, shards, pairs)
    seen = watch_out(proc, tmp_path / "out", timeout=deadline + 30)
    assert proc.wait(timeout=30) == 0, (tmp_path / "stdout.txt").read_text()[-3000:]
    elapsed = time.monotonic() - t0
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
    assert seen <= {"logs.tar.gz", "report.txt"}, seen  # never more: within the device tool's 8 files
    assert not list((tmp_path / "tmp").glob("first_call_*"))  # the work folder (logs, the GPU turn's lock) removed
    return (tmp_path / "out" / "report.txt").read_text(), elapsed, seen


def test_first_call_dry_run_reports_through_a_failure_and_a_hang(tmp_path):
    """first_call.py on CPU at a tiny size, as the GPU machine would run it: CPLM (flex) made to fail before its
    warm-up (the dense CP fallback takes its place, made to compile 30 s longer) and the reference check made to
    take the GPU turn and hang (killed past its share). Vanilla is timed while the fallback compiles, so once the
    fallback is timed it is timed again (vanilla_quiet), and the ratio compares the two quiet windows; every
    training job validates once after its timed steps. The report comes out whole within the deadline and names
    what failed."""
    report, elapsed, _ = run_first_call(tmp_path, "cplm:fail,refcheck:hang,cplm_dense:slow_compile=30",
                                        deadline=180)
    assert elapsed < 180  # about 70 s on 2 busy cores; the deadline leaves room for a loaded machine
    assert "bf16 GEMM 512^3:" in report and "FP8 _scaled_mm smoke test: relative error" in report
    assert "cplm: exit 7 -- injected failure before warm-up" in report
    assert "CPLM with the dense CP sums instead" in report
    assert "refcheck: killed (past its share of the GPU, 20s)" in report
    losses = r"train loss 1:[\d.]+, 2:[\d.]+, 3:[\d.]+, 4:[\d.]+; peak memory training - MiB, validation - MiB; " \
        r"val loss \d+\.\d{4}; recompiles after warm-up 0$"
    assert re.search(r"^vanilla: ok; compile \+ warm-up \d+s; steps 4; step time [\d.]+ ms \(steps 2-4, timed while "
                     r"cplm_dense compiled; 1/2 ms resolution\); " + losses, report, re.M), report
    for name in ("cplm_dense", "vanilla_quiet"):
        assert re.search(rf"^{name}: ok; .*; steps 4; step time [\d.]+ ms \(steps 2-4, no compile beside it; 1/2 ms "
                         r"resolution\); " + losses, report, re.M), report
    assert re.search(r"^cplm_dense/vanilla step time ratio: \d\.\d{3} \(cplm_dense: steps 2-4, no compile beside it; "
                     r"vanilla_quiet: steps 2-4, no compile beside it; the dense CP sums: flex failed\)$", report, re.M)
    assert re.search(r"^vanilla: [\d.]+ ms a step \(vanilla_quiet; no compile beside it\)", report, re.M)
    assert re.search(r"^timed rows: sum L\^2 / T\^2 = 0\.\d{3}", report, re.M)


def test_first_call_dry_run_times_vanilla_while_cplm_never_compiles(tmp_path):
    """CPLM's compile never ends: vanilla is still timed (while CPLM compiles, which the report says), CPLM is
    reported as never compiled, and the report comes out within the deadline (which this test waits for: the
    reference check is made to fail at once, so that vanilla has the cores)."""
    report, elapsed, _ = run_first_call(tmp_path, "cplm:compile_hang,refcheck:fail", deadline=45)
    assert elapsed < 45
    assert re.search(r"^vanilla: ok; compile \+ warm-up \d+s; steps 4; step time [\d.]+ ms \(steps 2-4, timed while "
                     r"cplm compiled;", report, re.M), report
    assert re.search(r"^cplm: killed \(at the deadline\) after \d+s; never finished compiling; steps 0; step time none",
                     report, re.M), report
    assert "cplm/vanilla step time ratio: none (a mode has no window with no compile beside it (its re-run alone did " \
        "not fit the time left, failed, or was itself timed beside a compile): vanilla: steps 2-4, timed while cplm " \
        "compiled)" in report
    assert "vanilla_quiet" not in report


def test_first_call_dry_run_times_cplm_again_when_it_was_timed_beside_a_compile_and_makes_its_own_data(tmp_path):
    """Vanilla made to compile 10 s longer: CPLM is timed while vanilla compiles, so once every job has ended CPLM is
    timed again alone (cplm_quiet) and the ratio compares two windows with no compile beside them, never a
    contaminated one with a clean one. No shards at --data: the call makes synthetic FineWeb-like documents in its
    work folder and says so; training on them lowers the loss. The CUDA CP check (on CPU) runs to its PASS. Then
    pairs of re-runs (--pairs 3), each alone, in ABBA order, until one fails (the third's CPLM, made to): the two
    whole pairs' ratios in run order, their median and range."""
    report, elapsed, _ = run_first_call(tmp_path, "vanilla:slow_compile,cplm_rep3:fail", deadline=240, shards=False,
                                        pairs=3)
    assert elapsed < 240  # about 60 s on 2 busy cores; the pairs start only while 1.5x the longest re-run is left
    assert re.search(r"^refcheck: ok; .*\| cuda cp check: PASS$", report, re.M), report  # given the time to pass
    assert f"no shards at --data {tmp_path / 'data'}: synthetic FineWeb-like documents instead" in report
    assert re.search(r"^cplm: ok; .*\(steps 2-4, timed while vanilla(, refcheck)? compiled;", report, re.M), report
    assert re.search(r"cplm was timed while vanilla(, refcheck)? compiled: cplm once more, alone \(cplm_quiet", report)
    # vanilla's own window is clean unless the reference check was still compiling then (a loaded machine): then
    # vanilla is timed again alone too; either way the ratio compares two windows with no compile beside them
    assert re.search(r"^cplm_quiet/(vanilla|vanilla_quiet) step time ratio: \d\.\d{3} \(cplm_quiet: steps 2-4, no "
                     r"compile beside it; (vanilla|vanilla_quiet): steps 2-4, no compile beside it\)$", report,
                     re.M), report
    losses = [float(x) for x in re.search(r"^vanilla: ok; .*; train loss 1:([\d.]+), 2:[\d.]+, 3:[\d.]+, 4:([\d.]+);",
                                          report, re.M).groups()]
    assert losses[1] < losses[0] - 0.3
    # then the pairs of re-runs, each alone, ABBA, stopped by the first failure: each pair's ratio, median, range
    ended = re.findall(r"^  \[ *\d+s\] (\w+): (ok|exit 7)", report, re.M)
    assert ended[-5:] == [("cplm_rep1", "ok"), ("vanilla_rep1", "ok"), ("vanilla_rep2", "ok"), ("cplm_rep2", "ok"),
                          ("cplm_rep3", "exit 7")], report
    assert "vanilla_rep3" not in report
    ratios = re.search(r"^cplm/vanilla step time ratio over 2 of 3 pairs of processes, each timed alone in ABBA order: "
                       r"median (\d\.\d{3}), range (\d\.\d{3})-(\d\.\d{3}) \(pair: ratio, in run order: 1: "
                       r"(\d\.\d{3}), 2: (\d\.\d{3})\)$", report, re.M)
    assert ratios, report
    median, low, high, first, second = map(float, ratios.groups())
    assert (low, high) == (min(first, second), max(first, second)) and abs(median - (first + second) / 2) <= 0.0015


def test_first_call_killed_midway_leaves_only_the_report_and_the_tarball(tmp_path):
    """SIGKILLed (as the device tool does at its limit) right after the logs were first packed: $OUT holds
    report.txt, with what was known, and a whole logs.tar.gz, and never held anything else."""
    import tarfile
    proc = start_first_call(tmp_path, "cplm:fail,refcheck:hang", deadline=90)
    try:
        seen = watch_out(proc, tmp_path / "out", until=lambda names: "logs.tar.gz" in names, timeout=120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert seen <= {"logs.tar.gz", "report.txt"} and "logs.tar.gz" in seen, seen
        assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
        report = (tmp_path / "out" / "report.txt").read_text()
        assert "cplm: exit 7" in report and "== per job ==" not in report
        # each job's numbers are in report.txt from the moment it ends, not only in the final summary
        assert re.search(r"cplm: exit 7; never finished compiling; steps \d+; step time none; .*peak memory", report)
        with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
            assert "logs/cplm.stdout" in tar.getnames()
    finally:  # its jobs run in sessions of their own: they outlive it
        proc.kill()
        for _ in range(2):
            for pid in [int(x) for x in os.listdir("/proc") if x.isdigit() and int(x) != os.getpid()]:
                try:
                    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                except OSError:
                    continue
                if f"TMPDIR={tmp_path / 'tmp'}".encode() in environ:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)


def test_first_call_stopped_by_sigterm_kills_its_jobs_and_packs_the_logs(tmp_path):
    """A hostile tester's: SIGTERM (what `timeout` sends) killed the driver alone; its jobs, in sessions of their own,
    ran on, and no logs.tar.gz, final line or clean-up followed. Now the signal ends it through its clean-up."""
    proc = start_first_call(tmp_path, "vanilla:hang", deadline=120)
    try:
        watch_out(proc, tmp_path / "out", until=lambda names: "report.txt" in names, timeout=60)
        time.sleep(3)  # the jobs have started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
        report = (tmp_path / "out" / "report.txt").read_text()
        assert "stopped by signal 15" in report and "logs packed into logs.tar.gz" in report
        assert not list((tmp_path / "tmp").glob("first_call_*"))  # the work folder removed
        time.sleep(1)
        left = [pid for pid in (int(x) for x in os.listdir("/proc") if x.isdigit())
                if f"TMPDIR={tmp_path / 'tmp'}".encode() in _environ(pid)]
        assert left == [], "jobs outlived the driver"
    finally:
        proc.kill()
        for pid in (int(x) for x in os.listdir("/proc") if x.isdigit()):
            if f"TMPDIR={tmp_path / 'tmp'}".encode() in _environ(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _environ(pid):
    try:
        return open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return []


def test_first_call_with_bad_data_says_how_to_make_it(tmp_path):
    """Shards of one split only at --data, or a file that is not one (none at all: synthetic data, tested above):
    one line naming the command that makes them, exit 1, nothing started or written."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x_train_000000.bin").write_bytes(b"not a shard")
    toy_shards(tmp_path / "half")  # train shards, no val: a preparation gone wrong, not a missing one
    (tmp_path / "half" / "toy_val_000000.bin").unlink()
    for data, problem in ((tmp_path / "half", "no *_val_*.bin shards"), (tmp_path / "bad", "is not a shard")):
        r = subprocess.run(FIRST_CALL + ["--dry_run", "--out", str(tmp_path / "out"), "--data", str(data)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and problem in r.stderr, r.stderr
        assert "python3 gpu_check/prepare_gpu_data.py" in r.stderr
        assert not (tmp_path / "out").exists()


def test_first_call_refuses_a_file_as_out_and_a_deadline_that_is_not_a_number(tmp_path):
    """A hostile tester's: --out naming a file was a FileExistsError traceback, --deadline_s nan was accepted
    (nothing would ever be killed at the deadline). One line each, exit 2, nothing started."""
    (tmp_path / "a_file").write_text("x")
    for args, words in ((["--out", str(tmp_path / "a_file")], "is a file"),
                        (["--out", str(tmp_path / "out"), "--deadline_s", "nan"], "--deadline_s"),
                        (["--out", str(tmp_path / "out"), "--deadline_s", "-5"], "--deadline_s"),
                        (["--out", str(tmp_path / "out"), "--pairs", "-1"], "--pairs")):
        r = subprocess.run(FIRST_CALL + ["--dry_run", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
    assert (tmp_path / "a_file").read_text() == "x" and not (tmp_path / "out").exists()


def test_first_call_packs_across_filesystems(tmp_path, monkeypatch):
    """Where the work folder and $OUT are on different filesystems (no rename between them), the tarball is
    copied in; $OUT still holds only the two files."""
    import errno
    import tarfile
    import first_call  # gpu_check/, beside preflight
    (tmp_path / "out").mkdir()
    (tmp_path / "work" / "logs").mkdir(parents=True)
    (tmp_path / "work" / "logs" / "vanilla.stdout").write_text("warm-up done\n")
    report = first_call.Report(str(tmp_path / "out"), str(tmp_path / "work"))

    def no_rename(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    monkeypatch.setattr(first_call.os, "replace", no_rename)
    report.pack()
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert tar.getnames() == ["logs/vanilla.stdout"]


def test_synthetic_documents_look_like_the_prepared_ones():
    """first_call.py's data when nothing was prepared: documents of about the prepared prose pieces' length (1140
    tokens; sum L^2 / T^2 near their 0.055 at 48Ki-token rows, which sets the CP sums' cost), each starting with
    BOS, GPT-2 ids below it, about 2/3 of tokens seen earlier in their document (FineWeb-Edu: about 60%)."""
    import numpy as np
    sys.path.insert(0, os.path.join(ROOT, "gpu_check"))
    from prepare_gpu_data import concentration, synthetic_tokens
    tokens = synthetic_tokens(20 * 49152, np.random.default_rng(0))
    assert len(tokens) == 20 * 49152 and tokens[0] == 50256 and tokens.max() == 50256
    starts = np.flatnonzero(tokens == 50256).tolist() + [len(tokens)]
    assert 950 < len(tokens) / (len(starts) - 1) < 1350
    assert 0.04 < concentration(tokens, 49152) < 0.08
    first_seen = sum(len(np.unique(tokens[lo + 1:hi])) for lo, hi in zip(starts, starts[1:]))  # per document
    assert 0.6 < 1 - first_seen / (len(tokens) - len(starts) + 1) < 0.75


FORWARD_WRAPPER = """
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cuda((4, 256), (256, 1), torch.float32)
        buf1 = empty_strided_cuda((1024, ), (1, ), torch.bfloat16)
        buf2 = reinterpret_tensor(buf0, (1024, ), (1, ), 0); del buf0  # reuse
        buf3 = torch.ops.cplm.fp8_matmul.default(buf1, primals_2, 2.0)
        buf9 = empty_strided_cuda((8, 8), (16, 1), torch.float32)
        del buf9
        buf4 = buf3[0]
        buf5 = buf3[1][0]
        del buf3
        buf6 = reinterpret_tensor(buf4, (8, 64), (64, 1), 0)  # alias
        buf10 = buf5  # alias
        del buf1, buf4, buf5
        buf7 = buf2; del buf2  # reuse
        buf8 = torch.ops.cplm.one_output.default(buf7)
        del buf8
        return (buf6, reinterpret_tensor(buf7, (1024, ), (1, ), 0), primals_1, buf10, )
"""
BACKWARD_WRAPPER = """
    def call(self, args):
        mm_2, view_1, primals_1, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cuda((2048, ), (1, ), torch.float32)
        del view_1
        buf1 = mm_2;  # reuse
        return (buf0, buf1, )
"""


def test_the_memory_reading_follows_reuses_aliases_and_what_a_forward_hands_its_backward():
    """preflight.step_memory's arithmetic on wrapper code written by hand: a reused buffer is not new memory, a
    freed name whose storage an alias still holds frees nothing, a padded buffer is sized by its strides, a
    custom op's outputs count from its call on (the code names them later) with what the op holds inside, and
    what the forward returns is handed to the backward by name and stays live until its last read there."""
    from types import SimpleNamespace as NS
    layout = lambda size, stride, dtype: NS(layout=NS(size=size, stride=stride, dtype=dtype))  # noqa: E731
    fx = lambda names: NS(graph=NS(find_nodes=lambda op: [NS(args=(names,))]))  # noqa: E731
    graph = NS(is_backward=False, is_inference=False, module=fx(["loss", "view_1", "primals_1", "mm_2"]),
               graph_inputs={}, name_to_buffer={"buf3": NS(layout=NS(device="cuda")),
                                                "buf4": layout([512], [1], torch.bfloat16),
                                                "buf5": layout([256], [1], torch.float32),
                                                "buf8": layout([16], [1], torch.float32)})
    forward = preflight._wrapper_graph(graph, FORWARD_WRAPPER)
    assert (forward.kind, list(forward.inputs), forward.outputs) == (
        "forward", ["primals_1", "primals_2"], {"loss": "buf6", "view_1": "buf7", "primals_1": "primals_1",
                                                "mm_2": "buf10"})
    assert sorted(forward.allocated()) == [64, 480, 1024, 1024, 2048, 4096]  # buf9: 1 + 7 x 16 + 7 floats
    peak, saved = forward.replay(inside={"fp8_matmul": 500})
    # 4096 (buf0, renamed buf2, buf7) + 2048 (buf1) + 1024 + 1024 (the op's outputs) + 500 inside the op; buf4
    # and buf5 outlive their names in buf6 and buf10; primals_1 is a parameter (not counted)
    assert peak == 8692 and saved == {"loss": ("forward:buf4", 1024), "view_1": ("forward:buf0", 4096),
                                      "mm_2": ("forward:buf5", 1024)}
    backward = preflight._wrapper_graph(NS(is_backward=True, is_inference=False, module=fx(["grad_a", "grad_b"]),
                                           graph_inputs={}, name_to_buffer={}), BACKWARD_WRAPPER)
    handed = {name: saved[name] for name in backward.inputs if name in saved}
    peak, outputs = backward.replay(handed)
    assert peak == 5120 + 8192 and outputs == {"grad_a": ("backward:buf0", 8192), "grad_b": ("forward:buf5", 1024)}
