"""GPU pre-flight on CPU (gpu_check/preflight.py): every graph the CUDA path compiles is pushed through
inductor's lowering, and must stop only where a GPU is needed (Triton, a CUDA device query), never at a
lowering error. Tracing alone (test_cplm.py's aot_eager test) cannot see a lowering failure."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import train_gpt_cplm as tg
from conftest import one_thread

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check"))
import preflight  # noqa: E402

BOS, VOCAB = 499, 500


@pytest.fixture(autouse=True)
def _on_one_thread():
    """torch on one thread in this process (conftest.one_thread): the call vanilla_hangs_call starts runs beside the
    tests here, and two threads on two cores shared with its jobs wait on each other (a tiny model's step several
    times slower). What is checked here (lowering, the GPU check's plan and files) does not depend on the count."""
    with one_thread():
        yield


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


def gpu_path_model(cplm, **config):
    return preflight.cuda_path_model(cplm, 512, **{**dict(vocab_size=VOCAB, bos_id=BOS, num_layers=4, model_dim=64,
                                                        num_heads=2, no_attention_layer=2), **config})


# vanilla and CPLM with the speedrun's layout (a layer without attention); the sentinel with gpu1's (attention in
# every layer): every mode and layout the one-GPU race compiles
@pytest.mark.parametrize("cplm,config", [(0, {}), (1, {}), (1, dict(copy_gate="sentinel", no_attention_layer=-1))])
def test_training_and_eval_graphs_lower(cplm, config):
    """Every mode's training forward and backward (FlexAttention masks, FP8 head, CP head) and evaluation
    (eval mode, token statistics) as train_gpt_cplm compiles them on CUDA."""
    model = gpu_path_model(cplm, **config)
    x, y = packed_row(384, seed=2)
    window = torch.tensor(3, dtype=torch.int32)
    train = preflight.lower(model, x, y, window)
    preflight.expect_gpu_stops(train, ["forward", "backward"])
    # every attention layer's flex op, and the CP head's two, reached the GPU-only step in both directions
    flex_ops = (3 if model.config.no_attention_layer == 2 else 4) + 2 * cplm  # 4 layers, one without attention or none
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
RATIO = r"(\d\.\d{3}) \[(\d\.\d{3}), (\d\.\d{3})\]"  # the interleaved ratio and its 95% interval


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


FAR = 1200  # a dry run's deadline far from its time (about 90 s on 2 busy cores): its limits count CPU time, not this
STALLED = "ab:stall,cplm:stall,vanilla:stall,refcheck:stall,devices:stall"  # five jobs that start at once and idle


def start_first_call(tmp_path, inject, deadline, shards=True, extra=()):
    """gpu_check/first_call.py --dry_run (CPU, tiny, 4 timed steps a separate job) with its work folder under
    tmp_path/tmp; without shards, --data names a folder that does not exist. Its stdout in stdout.txt, its stderr in
    stderr.txt."""
    if shards:
        toy_shards(tmp_path / "data")
    (tmp_path / "tmp").mkdir()
    cmd = FIRST_CALL + ["--dry_run", "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--steps", "4",
                        "--deadline_s", str(deadline), "--inject", inject, *extra]
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=stderr,
                                env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})


def wait_for(condition, timeout=300):
    """Until condition() holds (polled every 50 ms); the timeout only ends a test that would hang."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, "never came"
        time.sleep(0.05)


def text_of(path):
    return path.read_text() if path.exists() else ""


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


class FirstCall:
    """A call of first_call.py started (start_first_call) and watched from a thread of this process: every name seen in
    $OUT while it runs (polled every 50 ms), so that other tests can run meanwhile; result() waits for its end."""

    def __init__(self, tmp_path, inject, deadline, shards=True, extra=()):
        self.tmp_path, self.t0 = tmp_path, time.monotonic()
        self.proc = start_first_call(tmp_path, inject, deadline, shards, extra)
        self.seen = set()
        self.watcher = threading.Thread(target=lambda: self.seen.update(
            watch_out(self.proc, tmp_path / "out", timeout=deadline + 30)), daemon=True)
        self.watcher.start()

    def result(self):
        """Its end: (its report, its wall time, every name seen in $OUT meanwhile), with the checks every call passes:
        exit 0, $OUT holding the two files and never more, the work folder removed."""
        tmp_path = self.tmp_path
        self.watcher.join()
        assert self.proc.wait(timeout=30) == 0, ((tmp_path / "stdout.txt").read_text()[-3000:]
                                                 + (tmp_path / "stderr.txt").read_text()[-3000:])
        elapsed = time.monotonic() - self.t0
        assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
        assert self.seen <= {"logs.tar.gz", "report.txt"}, self.seen  # never more than the two files
        assert not list((tmp_path / "tmp").glob("first_call_*"))  # the work folder (logs, the GPU turn's lock) removed
        return (tmp_path / "out" / "report.txt").read_text(), elapsed, self.seen

    def stop(self):
        """Kills it and its jobs (in process groups of their own) where it still runs."""
        self.proc.kill()
        self.proc.wait()
        self.watcher.join()
        _kill_jobs_of(self.tmp_path)


def run_first_call(tmp_path, inject, deadline, shards=True, extra=()):
    """Runs it to the end: (its report, its wall time, every name seen in $OUT meanwhile)."""
    return FirstCall(tmp_path, inject, deadline, shards, extra).result()


VANILLA_HANGS = "test_first_call_dry_run_measures_everything_when_vanilla_hangs_in_its_timed_loop"


@pytest.fixture(scope="module", autouse=True)
def vanilla_hangs_call(request, tmp_path_factory):
    """The call VANILLA_HANGS checks, started with this module's first test where that test was chosen: about 80 s,
    most of it waiting (the hung job's 28 s, the GPU turns taken one at a time), which the in-process lowering tests
    above it fill; that test waits for its end. Nothing it checks depends on the load (see its docstring)."""
    chosen = [item for item in request.session.items if item.module is request.module and item.name == VANILLA_HANGS]
    if not chosen:
        yield None
        return
    call = FirstCall(tmp_path_factory.mktemp("vanilla_hangs"), "vanilla:hang", deadline=FAR, shards=False)
    try:
        yield call
    finally:
        call.stop()


def test_first_call_dry_run_measures_everything_when_vanilla_hangs_in_its_timed_loop(vanilla_hangs_call):
    """gpu_check/first_call.py on CPU at a tiny size, as the GPU machine runs it, with no shards (it makes synthetic
    FineWeb-like documents) and the separate vanilla job made to hang in its first timed loop (holding the GPU turn):
    once that job is killed past its share, the interleaved A/B (independent of the separate jobs) gives the ratio
    with its interval, the profile of both modes, the sentinel's ratio, the accumulation runs at the record's tokens
    a step, the reference check's PASS and the separate CPLM job's numbers, within the deadline. No assertion
    depends on which process is faster or on the machine's load: the deadline is far away, the rounds are at least 20
    however slow, and each job's limits count the CPU time it gets (under load the devices job once outlived a 30 s
    limit of wall time), while the hung job, which gets none, is killed after 28 s as on an idle machine. So the call
    is started with this module's first test (vanilla_hangs_call), and the tests before this one run while it waits."""
    import first_call as fc  # gpu_check/, beside preflight
    report, elapsed, _ = vanilla_hangs_call.result()  # started with this module (vanilla_hangs_call)
    tmp_path = vanilla_hangs_call.tmp_path
    assert "memory: no caps (a dry run); 3 training processes side by side (at most 3)" in report
    assert "\nplan (a dry run): the A/B killed if not warm after 90s" in report and fc.give_way(True) in report
    assert f"no shards at --data {tmp_path / 'data'}: synthetic FineWeb-like documents instead" in report
    assert "bf16 GEMM 512^3:" in report and "FP8 _scaled_mm smoke test: relative error" in report
    assert re.search(r"^vanilla: killed \(past its share of the GPU, 28s\)", report, re.M), report
    # the main measurement, exactly as specified, as it came and again in the summary; the interval holds the ratio
    found = re.findall(rf"^(?:  )?cplm/vanilla step time ratio \(interleaved, (\d+) rounds\): {RATIO}$", report, re.M)
    assert len(found) == 2 and found[0] == found[1], report
    rounds, ratio, lo, hi = int(found[0][0]), *map(float, found[0][1:])
    assert rounds >= 20 and lo <= ratio <= hi
    assert re.search(r"blocks of \d+, 2000 resamples; lag-1 autocorrelation", report)
    assert re.search(rf"^sentinel/vanilla step time ratio \(interleaved, \d+ rounds\): {RATIO}$", report, re.M), report
    # the profile of both modes, reduced in the call
    assert "  profile: 3 steps a mode after the rounds, CPU operators" in report
    for mode in ("vanilla", "cplm"):
        assert re.search(rf"^    {mode}: step [\d.]+ ms, busy [\d.]+ ms, idle -?[\d.]+ ms \([-\d.]+%: ", report, re.M)
    only = re.search(r"^    kernels only cplm runs: (\d+), \d+ launches, ([\d.]+) ms a step", report, re.M)
    assert only and int(only[1]) > 0 and float(only[2]) > 0, report  # the CP head's own operators
    assert re.search(r"^    kernels both run: \d+, vanilla [\d.]+ ms, cplm [\d.]+ ms a step, difference", report, re.M)
    assert re.search(r"^ab: ok; compile \+ warm-up \d+s; rounds and profile: .*; recompiles after warm-up 0$", report,
                     re.M), report
    # the record's tokens a step in one process (8 accumulation micro-steps): both modes' step times
    assert re.search(r"^the record's 393,216 tokens a step on one GPU \(8 micro-steps of 256 tokens; 2,048 in a dry "
                     r"run\): vanilla [\d.]+ ms a step, .*; cplm [\d.]+ ms a step, .*; cplm/vanilla \d\.\d{3}", report,
                     re.M), report
    assert re.search(r"^cplm_accum: ok; 8 micro-steps a step; .*; steps 6; step time [\d.]+ ms", report, re.M)
    assert re.search(r"^refcheck: ok; .*\| cuda cp check: PASS \| done in \d+ s: the flex check; .* \| "
                     r"lse kernel: not checked on a CPU .*$", report, re.M), report
    losses = [float(x) for x in re.search(r"^cplm: ok; .*; train loss 1:([\d.]+), 2:[\d.]+, 3:[\d.]+, 4:([\d.]+);",
                                          report, re.M).groups()]
    assert losses[1] < losses[0] - 0.3  # training on the synthetic documents works
    assert re.search(r"^cplm: ok; .*; recompiles in warm-up \d+, after it 0$", report, re.M)
    assert re.search(r"^timed rows: sum L\^2 / T\^2 = 0\.\d{3}", report, re.M)


@pytest.mark.slow  # over a minute on 2 cores (the default suite stays near 5 minutes): -m slow runs it
def test_first_call_dry_run_falls_back_to_separate_processes_when_the_ab_hangs(tmp_path):
    """Every other fault at once: the interleaved A/B hangs holding the GPU turn (killed past its turn), the device
    checks stall (killed at their limit), the reference check hangs on the GPU, CPLM (flex) fails before its warm-up
    (the dense CP sums take its place). With no interleaved ratio, the separate processes' ratio is the answer: the
    dense fallback starts only once vanilla has ended (--inject cplm_dense:after=vanilla: an order, not a race), so
    vanilla was timed beside its compile and is timed again alone; the ratio compares two windows with no compile
    beside them. The accumulation runs come after that fallback."""
    report, elapsed, _ = run_first_call(
        tmp_path, "ab:hang,devices:stall,refcheck:hang,cplm:fail,cplm_dense:after=vanilla", deadline=FAR)
    assert re.search(r"^  \[ *\d+s\] ab: killed \(past its share of the GPU, 36s\)", report, re.M), report
    assert re.search(r"^  \[ *\d+s\] devices: killed \(past its time limit, 30s\)", report, re.M), report
    assert re.search(r"^  \[ *\d+s\] refcheck: killed \(past its share of the GPU, 20s\)", report, re.M), report
    assert "cplm: exit 7 -- injected failure before warm-up" in report
    assert "cplm/vanilla step time ratio (interleaved): none (ab killed (past its share of the GPU, 36s)" in report
    assert re.search(r"^vanilla: ok; .*\(steps 2-4, timed while [\w, ]*cplm_dense[\w, ]* compiled;", report,
                     re.M), report
    assert re.search(r"^vanilla_quiet: ok; .*; steps 4; step time [\d.]+ ms \(steps 2-4, no compile beside it;", report,
                     re.M), report
    assert re.search(r"^cplm_dense(_quiet)?/vanilla step time ratio \(separate processes\): \d\.\d{3} \("
                     r"cplm_dense(_quiet)?: steps 2-4, no compile beside it; vanilla_quiet: steps 2-4, no compile "
                     r"beside it; the dense CP sums: flex failed\)$", report, re.M), report
    started = [m for m in re.findall(r"^  \[ *\d+s\] (\w+): started$", report, re.M)]
    assert started.index("vanilla_quiet") < started.index("vanilla_accum"), started
    assert re.search(r"^vanilla_accum: ok; 8 micro-steps a step;", report, re.M), report


def test_first_call_killed_midway_leaves_only_the_report_and_the_tarball(tmp_path):
    """SIGKILLed (as an allocation's limit does) right after the logs were first packed: $OUT holds report.txt, with
    what was known, and a whole logs.tar.gz, and never held anything else."""
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
    finally:  # its jobs run in process groups of their own: they outlive it
        proc.kill()
        for _ in range(2):
            _kill_jobs_of(tmp_path)
            time.sleep(0.5)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_first_call_stopped_by_a_signal_kills_its_jobs_and_packs_the_logs(tmp_path, signum):
    """Ctrl-C (SIGINT: a traceback, and no "stopped" line), SIGTERM (what `timeout` sends) and SIGHUP (a closed
    terminal; a hostile tester's: it orphaned the jobs, left the work folder and no "stopped" line) end the driver
    through its clean-up: the jobs, in process groups of their own, killed and reaped, the logs packed, a
    `stopped: SIG...` line in report.txt, one line on stderr, exit 128 + the signal, the work folder removed. The
    signal comes once the report says the last of the five first jobs started (an event, not a wait)."""
    import tarfile
    proc = start_first_call(tmp_path, STALLED, deadline=FAR)
    try:
        wait_for(lambda: "vanilla: started" in text_of(tmp_path / "out" / "report.txt"))
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum
        err = (tmp_path / "stderr.txt").read_text()
        name = signal.Signals(signum).name
        assert err.count("\n") == 1 and f"first_call.py: stopped by {name}" in err and "Traceback" not in err, err
        assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
        report = (tmp_path / "out" / "report.txt").read_text()
        assert f"\nstopped: {name}\n" in report and "logs packed into logs.tar.gz" in report, report
        with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
            assert "logs/vanilla.stdout" in tar.getnames()
        assert not list((tmp_path / "tmp").glob("first_call_*"))  # the work folder removed
        assert _jobs_of(tmp_path) == [], "jobs outlived the driver"  # killed and reaped before it exited
    finally:
        proc.kill()
        _kill_jobs_of(tmp_path)


def test_a_gpu_check_job_run_alone_stopped_by_ctrl_c_says_so_in_one_line(tmp_path):
    """gpu_check/job.py, a job's command run alone (as its docstring shows), gave a KeyboardInterrupt traceback on
    Ctrl-C; now one line and exit 130, as the training script itself. The Ctrl-C comes once its log shows a step."""
    import first_call as fc  # gpu_check/, beside preflight
    toy_shards(tmp_path / "data")
    (tmp_path / "logs").mkdir()
    args = fc.parse_args(["--dry_run", "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"),
                          "--steps", "100000"])
    proc = subprocess.Popen(fc.train_cmd(args, str(tmp_path), "vanilla", "vanilla"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal gives it
    try:
        wait_for(lambda: re.search(r"^step:2/", text_of(tmp_path / "logs" / "vanilla.txt"), re.M))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and err == "job.py: stopped by Ctrl-C (its log says so)\n", err
        assert text_of(tmp_path / "logs" / "vanilla.txt").splitlines()[-1].startswith("stopped: KeyboardInterrupt")
    finally:
        proc.kill()


def _in_process(fc, tmp_path, monkeypatch, report_open=None):
    """first_call.main's setting in this process: shards, the work folder under tmp_path/tmp (the jobs' TMPDIR too,
    so _jobs_of finds them), every Job it makes kept; report_open(path, real open) replaces how report.txt is
    opened."""
    import builtins
    import tempfile
    toy_shards(tmp_path / "data")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    made, real_job = [], fc.Job
    monkeypatch.setattr(fc, "Job", lambda *a, **k: made.append(real_job(*a, **k)) or made[-1])
    if report_open:
        monkeypatch.setattr(fc, "open", lambda path, *a, **k: report_open(path, *a, **k) if str(path).endswith(
            "report.txt") else builtins.open(path, *a, **k), raising=False)
    return made


class FullDisk:
    """A file on a disk that fills up at the line for which full(line) holds: that write and later ones fail."""

    def __init__(self, f, full):
        self.f, self.full, self.filled = f, full, False

    def write(self, text):
        import errno
        self.filled = self.filled or self.full(text)
        if self.filled:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(text)

    def flush(self):
        self.f.flush()

    def close(self):
        self.f.close()


@pytest.mark.parametrize("how", ["read_only", "full", "not_writable_here"])
def test_first_call_refuses_an_out_it_cannot_write_in_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, how):
    """$OUT on a read-only or full file system was a traceback that left the first_call_* work folder behind. Now
    one line, exit 1, nothing started, no work folder, and $OUT as it was (made by the call: removed again). Read-only
    and full are simulated (an OSError on opening report.txt, or on its first line); not_writable_here is a real
    folder that cannot take the file (chmod 555 where the tests are not root, /proc where they are)."""
    import builtins
    import errno
    import first_call as fc  # gpu_check/, beside preflight

    def read_only(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", path)
    report_open = {"read_only": read_only, "not_writable_here": None,
                   "full": lambda path, *a, **k: FullDisk(builtins.open(path, *a, **k), lambda line: True)}[how]
    made = _in_process(fc, tmp_path, monkeypatch, report_open)
    out = tmp_path / "out"
    if how == "not_writable_here":
        out = tmp_path / "locked"
        out.mkdir()
        out.chmod(0o555)
        if os.geteuid() == 0:  # root writes into a chmod'ed folder
            out = "/proc"
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    try:
        code = fc.main(["--dry_run", "--out", str(out), "--data", str(tmp_path / "data"), "--inject", STALLED])
    finally:
        _kill_jobs_of(tmp_path)
    err = capsys.readouterr().err
    says = {"read_only": "Read-only file system", "full": "No space left on device",
            "not_writable_here": "cannot write report.txt"}[how]
    assert code == 1 and err.count("\n") == 1 and says in err and "nothing was started" in err, err
    assert made == [] and not list((tmp_path / "tmp").glob("first_call_*"))
    assert not (tmp_path / "out").exists() and (how != "not_writable_here" or "report.txt" not in os.listdir(out))
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == handlers  # the caller's


def test_first_call_whose_out_fills_up_midway_kills_its_jobs_and_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """The disk under $OUT fills up once the five first jobs have started (the report's line for the last of them
    fails): the jobs are killed and reaped, the work folder removed, one line, exit 1; report.txt keeps its lines so
    far (a call cut short keeps what it had), among them the plan and what gives way when time runs short."""
    import builtins
    import first_call as fc  # gpu_check/, beside preflight
    made = _in_process(fc, tmp_path, monkeypatch, lambda path, *a, **k: FullDisk(
        builtins.open(path, *a, **k), lambda line: "vanilla: started" in line))
    try:
        code = fc.main(["--dry_run", "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"),
                        "--deadline_s", str(FAR), "--inject", STALLED])
    finally:  # a failing driver must not leave its jobs to the next tests
        leftover = _jobs_of(tmp_path)
        _kill_jobs_of(tmp_path)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err, err
    assert "its jobs were killed" in err
    assert [j.name for j in made] == ["devices", "refcheck", "ab", "cplm", "vanilla"]
    assert all(j.proc.returncode is not None for j in made)  # killed and reaped
    assert leftover == [] and not list((tmp_path / "tmp").glob("first_call_*"))
    report = (tmp_path / "out" / "report.txt").read_text()
    assert "ab: started" in report and "vanilla: started" not in report and fc.give_way(True) in report


def test_first_call_budget_fits_a_p90_compile_and_says_what_gives_way(capsys):
    """Issue 56's first item: the A/B and its profile finish on a p90 compile. The compile times the plan assumes
    are the two H200 calls' in records/gpu (their reports), its p90 the slower call's plus the spread; with them the
    A/B is warm before its warm limit on any card (three training slots: vanilla from the cache; fewer: both modes
    cold, where the old 330 s limit killed it), and the warm limit, the wait for the GPU, the rounds and the profile
    fit the jobs' 545 s; a kill at the warm limit leaves the fallback a quiet re-run. What gives way when time runs
    short needs the most time left, and --help, the docstring and the report (the dry-run tests) say the order."""
    import first_call as fc  # gpu_check/, beside preflight
    measured = {}
    for call in ("2026-12-04", "2026-12-04-200-steps"):
        text = open(os.path.join(ROOT, "records", "gpu", call, "report.txt")).read()
        for job, kind in (("cplm", "cplm"), ("vanilla", "vanilla"), ("vanilla_quiet", "vanilla_cached")):
            seconds = re.search(rf"^{job}: ok; compile \+ warm-up (\d+)s", text, re.M)[1]
            measured.setdefault(kind, []).append(int(seconds))
    assert {kind: tuple(sorted(v)) for kind, v in measured.items()} == fc.COMPILE_S
    assert fc.p90_compile("cplm") == 237 and fc.p90_compile("vanilla_cached") == 45
    gpu = {name: fc.BUDGET[name][0] for name in fc.BUDGET}
    jobs_s = 570 - gpu["report_reserve"]
    for slots_n in (1, 2, 3):
        warm, end, jobs_end = fc.ab_plan(slots_n, gpu["ab_rounds"], 570)
        assert warm <= gpu["ab_warm"] and end <= jobs_end == jobs_s, (slots_n, warm, end)
    assert gpu["ab_warm"] + fc.TURN_WAIT_S + gpu["ab_rounds"] + gpu["ab_profile"] <= jobs_s
    assert jobs_s - gpu["ab_warm"] >= gpu["rerun_min"]
    for i in (0, 1):  # on the GPU and in a dry run
        assert fc.BUDGET["sentinel_min"][i] > fc.BUDGET["accum_min"][i] >= fc.BUDGET["rerun_min"][i]
    with pytest.raises(SystemExit):
        fc.parse_args(["--help"])
    assert fc.give_way(False)[1:] in " ".join(capsys.readouterr().out.split())
    doc = " ".join(fc.__doc__.split())
    for number in (237, 140, 45, 282, 377, gpu["ab_warm"], gpu["ab_rounds"], gpu["ab_profile"], fc.TURN_WAIT_S,
                   fc.ab_plan(2, gpu["ab_rounds"], 570)[1], jobs_s, gpu["sentinel_min"], gpu["accum_min"]):
        assert f"{number} s" in doc, number
    assert "plan on a p90 compile" in fc.plan_line(fc.parse_args(["--out", "x"]), 2, gpu["ab_rounds"])


def test_first_call_dry_run_limits_count_the_cpu_time_a_job_gets():
    """A dry run's job limits were wall-clock seconds, which a loaded machine's slower jobs outlived. A job's clock now
    advances by the CPU time its process group gets (at most the wall time), and by the wall time where it gets none
    (a hung or stalled job: killed on time whatever the load); on the GPU by the wall time. The CPU time is read from
    /proc for the whole process group."""
    import first_call as fc  # gpu_check/, beside preflight

    def job():
        j = fc.Job.__new__(fc.Job)  # no process: the clock alone
        j.clock, j.last_tick = 0.0, (0.0, None)
        return j
    slow, hung, on_gpu = job(), job(), job()
    for k in range(1, 101):  # 50 s of polls every 0.5 s; the slow job gets a tenth of a core (a machine 10x loaded)
        slow.tick(0.5 * k, 3.0 + 0.05 * k)
        hung.tick(0.5 * k, 3.0)
        on_gpu.tick(0.5 * k)
    assert slow.clock == pytest.approx(0.5 + 99 * 0.05) and hung.clock == pytest.approx(50)
    assert on_gpu.clock == pytest.approx(50)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        wait_for(lambda: fc.cpu_seconds_by_group().get(busy.pid, 0) > 0.2, timeout=120)
    finally:
        busy.kill()
        busy.wait()


def _jobs_of(tmp_path):
    """The processes started with this test's TMPDIR: the driver's jobs."""
    def environ(pid):
        try:
            return open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            return []
    mark = f"TMPDIR={tmp_path / 'tmp'}".encode()
    return [pid for pid in (int(x) for x in os.listdir("/proc") if x.isdigit())
            if pid != os.getpid() and mark in environ(pid)]


def _kill_jobs_of(tmp_path):
    for pid in _jobs_of(tmp_path):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


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


def test_first_call_refuses_bad_arguments_in_one_line_and_starts_nothing(tmp_path):
    """Hostile testers': --out naming a file was a FileExistsError traceback, --out FILE/sub a NotADirectoryError,
    --deadline_s nan was accepted (nothing would ever be killed at the deadline), --inject foo was a traceback that
    left its work folder behind, --pairs x printed argparse's usage block, and --out naming a call's folder replaced
    its report and logs (a 9-second dry run over a recorded GPU report). One line each, exit 2, nothing started,
    written or left behind."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "call").mkdir()
    (tmp_path / "call" / "report.txt").write_text("a recorded report")
    (tmp_path / "tmp").mkdir()
    out = ["--out", str(tmp_path / "out")]
    for args, words in ((["--out", str(tmp_path / "a_file")], "is a file"),
                        (["--out", str(tmp_path / "a_file" / "sub")], "Not a directory"),
                        (["--out", str(tmp_path / "call")], "holds a call's report.txt already"),
                        (out + ["--deadline_s", "nan"], "--deadline_s"),
                        (out + ["--deadline_s", "-5"], "--deadline_s"),
                        (out + ["--ab_s", "0"], "--ab_s"),
                        (out + ["--inject", "foo"], "--inject foo"),
                        (out + ["--inject", "vanilla:explode"], "--inject vanilla:explode"),
                        (out + ["--pairs", "x"], "unrecognized arguments: --pairs x"),
                        (out + ["--steps", "x"], "--steps: invalid int value")):
        r = subprocess.run(FIRST_CALL + ["--dry_run", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, (args, r.stderr)
    assert (tmp_path / "a_file").read_text() == "x" and not (tmp_path / "out").exists()
    assert (tmp_path / "call" / "report.txt").read_text() == "a recorded report"
    assert sorted(os.listdir(tmp_path / "call")) == ["report.txt"] and os.listdir(tmp_path / "tmp") == []


def test_first_call_makes_its_data_within_the_deadline(tmp_path):
    """A hostile tester's: --steps 100000000 --deadline_s 10 was still making synthetic documents at 40 s. The data
    step obeys the deadline: the report says so, nothing is started, the two files come back."""
    proc = start_first_call(tmp_path, "", deadline=10, shards=False, extra=["--steps", "100000000"])
    assert proc.wait(timeout=300) == 0
    report = (tmp_path / "out" / "report.txt").read_text()
    assert int(re.search(r"total (\d+)s of a 10s deadline", report)[1]) <= 10  # its own clock: the interpreter's
    # start, which a busy machine stretches, is before it
    assert "the synthetic documents were not made by the deadline" in report and "nothing was started" in report
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
    assert not list((tmp_path / "tmp").glob("first_call_*"))


def test_first_call_memory_caps_and_slots_fit_the_card(monkeypatch):
    """first_call.py caps each training job's allocator at 1.15x its need (the peaks measured on the H200) and starts
    one only while the caps of those alive and its own fit the card less its reserve: on an 80 GB H100 (79.1 GiB as
    torch reads it, 79.6 as nvidia-smi does) no three training jobs run at once, on a 141 GB H200 the first three do;
    no cap is above the card, and a job whose cap would be (a 40 GB card) runs alone. No card known: no caps."""
    from itertools import combinations
    from types import SimpleNamespace
    import first_call as fc  # gpu_check/, beside preflight
    training = [n for n in fc.JOBS if n not in fc.SMALL]
    for card, most in ((79.11, 2), (81559 / 1024, 2), (139.8, 3), (143771 / 1024, 3), (40.0, 1)):
        caps, usable = fc.memory_plan(card)
        assert sorted(caps) == sorted(training) and max(caps.values()) <= usable < card, (card, caps)
        assert fc.slots(caps, usable) == most, card
        assert all(caps[n] >= 1.15 * 30943 / 1024 - 1e-9 for n in training if card > 80)  # each at least its need
        if most == 3:
            assert fc.may_start("vanilla", ["ab", "cplm"], caps, usable)
        for a, b, c in combinations(training, 3):  # whatever three, in whatever order: never all alive at once
            for x, y, z in ((a, b, c), (b, c, a), (c, a, b)):
                assert most == 3 or not (fc.may_start(y, [x], caps, usable) and fc.may_start(z, [x, y], caps, usable))
        for name in (n for n in training if caps[n] == usable):  # too big for the card: alone
            assert fc.may_start(name, [], caps, usable) and not any(
                fc.may_start(other, [name], caps, usable) for other in training)
        assert f"{most} training process" in fc.memory_line(False, card, caps, usable)
    assert fc.memory_plan(None) == ({}, None) and fc.slots({}, None) == fc.BIG_SLOTS
    assert not fc.may_start("vanilla", ["ab", "cplm", "cplm_dense"], {}, None)
    monkeypatch.setattr(fc.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout="143771\n81559\n"))
    assert fc.card_memory_gib() == 81559 / 1024  # nvidia-smi's MiB, the smallest card


def test_gpu_turn_memory_cap_is_gib_over_the_cards_total(monkeypatch):
    """gpu_turn.limit_gpu_memory turns $GPU_CHECK_MEMORY_GIB into a fraction of the card's total memory where the job
    runs, at most all of it; unset, no cap."""
    import gpu_turn
    fractions = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2 ** 30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fractions.append)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for gib in ("34.75", "120"):
        monkeypatch.setenv("GPU_CHECK_MEMORY_GIB", gib)
        gpu_turn.limit_gpu_memory()
    monkeypatch.delenv("GPU_CHECK_MEMORY_GIB")
    gpu_turn.limit_gpu_memory()
    assert fractions == [34.75 / 80, 1.0]


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
    assert report.pack() is True
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.txt"]
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert tar.getnames() == ["logs/vanilla.stdout"]
    # and where the logs cannot get there at all, pack says so (the report's last line then does not claim them)
    monkeypatch.setattr(first_call.shutil, "copyfile", no_rename)
    assert report.pack() is False
    report.file.close()
    assert "packing the logs failed: OSError" in (tmp_path / "out" / "report.txt").read_text()


@pytest.mark.parametrize("argv, code, words", [(["--help"], 0, "pip install triton==3.6.0"),
                                                (["sm_90", "memory"], 1, "pip install triton==3.6.0 'numpy<2.3'")])
def test_preflight_says_what_to_install_without_triton(argv, code, words):
    """A hostile tester's: gpu_check/preflight.py failed with ModuleNotFoundError: triton on every call, --help
    included, on the CPU build of torch that run.sh installs. --help works without Triton; a table, which needs it,
    says in one line what to install (Triton hidden here, so the test holds where it is installed too)."""
    no_triton = ("import runpy, sys; sys.modules['triton'] = None; sys.argv = ['preflight.py'] + sys.argv[1:]; "
                 "runpy.run_path('gpu_check/preflight.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", no_triton, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == code and words in (r.stdout if code == 0 else r.stderr), r.stdout + r.stderr
    if code:
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


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


def test_the_report_outlives_a_closed_terminal(tmp_path, monkeypatch):
    """After SIGHUP the terminal answers writes with EIO: the report's lines still reach report.txt (the clean-up's
    "stopped:" line included), and the driver's own line is not a traceback."""
    import errno
    import first_call as fc

    class HungUp:
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

        def flush(self):
            raise OSError(errno.EIO, "Input/output error")

    (tmp_path / "out").mkdir()
    report = fc.Report(str(tmp_path / "out"), None)
    monkeypatch.setattr(sys, "stdout", HungUp())
    report("a line")
    report.safe("stopped: SIGHUP")
    monkeypatch.undo()
    report.file.close()
    assert (tmp_path / "out" / "report.txt").read_text().splitlines()[-2:] == ["a line", "stopped: SIGHUP"]
