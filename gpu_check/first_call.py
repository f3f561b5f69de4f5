"""The first call on a lent GPU machine: the race's numbers in one device call, whatever breaks.

    python3 gpu_check/first_call.py --out "$OUT"                 # on the GPU machine (records/gpu/README.md)
    python3 gpu_check/first_call.py --dry_run --out /tmp/fc      # the same program on a CPU, tiny, in a minute

--data is checked first: train and val shards there and readable (a bad or missing split: one line naming the
command that makes them, exit 1); no shards at all: synthetic FineWeb-like documents made in the work folder
(prepare_gpu_data.synthetic_tokens, no tokenizer), which the report says. Then, under one global deadline
(default 570 s, inside the device call's 590):
  1. three jobs started side by side, each its own process (plain python3, world size 1): vanilla and CPLM
     (flex) on the speedrun preset with one 48Ki-token row a step, and the CUDA CP loss against the dense
     reference (cuda_cp_check.py). They compile at the same time on the machine's cores; only the timed loops
     take turns on the GPU (a file lock, CPLM_GPU_TURN, taken after the untimed warm-up), each as soon as it
     is warm, whatever the others are doing: a slow CPLM compile costs nothing of vanilla's number. The
     training jobs validate on one row of the record's 256Ki tokens, in the warm-up (which compiles the
     evaluation graph beside the training's: gpu_check/preflight.py measures 30-40 s of one core's compile work a
     mode) and once after the timed steps, so each job's log has its peak memory in validation as well as in
     training (the warm-up's row runs outside the GPU turn, as the warm-up steps do; the H200's 141 GB holds
     both modes' peaks at once, 36 and 29 GiB by the pre-flight's reading); --train_loss_every 10;
     coordinate-descent tuning is off (--coordinate_descent 0): the record's kernels are tuned with it, these
     are not;
  2. meanwhile, in this process: versions, the GPU, a bf16 GEMM rate and an FP8 (_scaled_mm) smoke test;
  3. if CPLM (flex) dies before its warm-up ends and time is left, CPLM with the dense CP sums (one chunk
     per row: one compiled shape) in its place;
  4. once every job has ended, a mode whose timed loop ran while another job compiled is timed once more,
     alone (vanilla_quiet, cplm_quiet or cplm_dense_quiet; its compile cache is warm by then), one at a time
     while time is left; then up to --pairs pairs of re-runs, each alone, in ABBA order (cplm_rep1,
     vanilla_rep1, vanilla_rep2, cplm_rep2, ...), while time is left, until one fails: two vanilla processes can
     differ by more than the ratio's margin from its target (1.5% on the H200, 2026-12-04), so the ratio's
     spread over processes is measured. A re-run of a mode starts only with 1.5 times that mode's longest good
     re-run left (QUIET_MIN_S before it has one);
  5. the report, from whatever came back: per job the compile time, the step time over the second half of
     the timed steps (between two train_loss lines, each read after a host sync: steps 20-40, 1/20 ms
     resolution) and whether another job was compiling during its timed loop, the train losses (the sign
     that training works), peak memory in training and in validation, recompiles after warm-up; the CPLM /
     vanilla step-time ratio from two windows with no compile beside them (else no ratio, and why) and which
     windows it compares, then each pair's ratio, their median and range; sum L^2 / T^2 of the timed rows;
     which parts failed and why.
$OUT only ever holds report.txt (written line by line, flushed) and logs.tar.gz (the children's logs, kept in
a work folder under $TMPDIR and packed again, whole, each time a job ends): a kill at any moment leaves at
most those two files, and the device tool returns at most 8. A job that fails, hangs or outlives its share of
the deadline is killed and reported; the report always comes out. --dry_run does all of it on the CPU at a
tiny size; the test suite runs it with jobs made to fail, hang, compile slowly or compile forever (--inject).
"""
import argparse
import contextlib
import glob
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECORD_STEP_MS = 99.9  # the 2025-01-26 record: 2.93 min over its 1760 timed steps on 8xH100, communication included
REPORT_RESERVE_S = 25  # kept back at the end for the report and the packing (8 s in a dry run)
REFCHECK_TURN_S = 30  # the reference check holds the GPU (its timed part, the reference) at most this long (20 s dry)
QUIET_MIN_S = 120  # a mode's first re-run alone needs this much left: a warm-cache compile and 40 steps (15 s dry)
TIMED = ("vanilla", "cplm", "cplm_dense")  # each may be timed again alone as <name>_quiet
MARKERS = {"warm-up done": "warm-up done", "gpu turn": "gpu turn", "final": "^final "}  # in a job's stdout


class Job:
    """One child process with its own stdout file; killed with its whole process group."""

    def __init__(self, name, cmd, work, env=None):
        self.name, self.cmd = name, cmd
        self.stdout_path = os.path.join(work, "logs", f"{name}.stdout")
        self.started = time.monotonic()
        self.events = {}  # marker -> when (time.monotonic()) it was first seen in stdout
        self.ended = self.killed = None
        with open(self.stdout_path, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                         start_new_session=True)

    def poll(self, now):
        text = self.text()
        for marker, pattern in MARKERS.items():
            if marker not in self.events and re.search(pattern, text, re.M):
                self.events[marker] = now
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = now
        return rc

    def compiled(self):
        """When its compile (and warm-up) was seen to end: warm, its GPU turn taken, or the process ended."""
        return self.events.get("warm-up done") or self.events.get("gpu turn") or self.ended

    def text(self):
        try:
            with open(self.stdout_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self, why):
        if self.proc.poll() is None:
            self.killed, self.ended = why, time.monotonic()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a process freeing much GPU memory can take a while to go
                pass

    @property
    def rc(self):
        rc = self.proc.poll()
        return -9 if rc is None and self.killed else rc

    def status(self):
        if self.killed:
            return f"killed ({self.killed}) after {self.ended - self.started:.0f}s"
        if self.rc is None:
            return "running"
        return "ok" if self.rc == 0 else f"exit {self.rc}"

    def last_line(self):
        lines = [x for x in self.text().splitlines() if x.strip() and not x.startswith("  ")]
        return lines[-1][:300] if lines else "(no output)"


class Report:
    """$OUT: report.txt, written line by line (flushed), and logs.tar.gz, the work folder's logs packed whole
    beside them and moved in by one rename. Nothing else is ever written there, so a kill at any moment leaves
    at most these two files (the device tool returns at most 8)."""

    def __init__(self, out, work):
        self.out, self.work = out, work
        self.file = open(os.path.join(out, "report.txt"), "w")

    def __call__(self, line=""):
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def pack(self):
        logs, packed = os.path.join(self.work, "logs"), os.path.join(self.work, "logs.tar.gz")
        try:
            with tarfile.open(packed, "w:gz") as tar:
                for name in sorted(os.listdir(logs)):
                    with contextlib.suppress(OSError):  # a child may rename its log meanwhile
                        tar.add(os.path.join(logs, name), arcname=f"logs/{name}")
            try:
                os.replace(packed, os.path.join(self.out, "logs.tar.gz"))  # the old tarball or the new, whole
            except OSError:  # the work folder on another filesystem: copied in (a kill mid-copy cuts it short)
                shutil.copyfile(packed, os.path.join(self.out, "logs.tar.gz"))
        except (OSError, tarfile.TarError) as e:
            self(f"  packing the logs failed: {type(e).__name__}: {e}")


def device_checks(report, device, dry_run):
    """Versions, a bf16 GEMM rate and an FP8 smoke test, each guarded: a failure is a line, not an end."""
    import platform
    import torch
    report(f"python {platform.python_version()}  torch {torch.__version__}  cuda {torch.version.cuda}  "
           f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    if device == "cuda":
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            report(f"nvidia-smi: {smi.stdout.strip()}")
        except (OSError, subprocess.TimeoutExpired) as e:
            report(f"nvidia-smi: unavailable ({e})")
    n = 512 if dry_run else 8192
    try:
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):
            a @ b
        seconds = timed(lambda: a @ b, device, repeats=3 if dry_run else 20)
        report(f"bf16 GEMM {n}^3: {2 * n ** 3 / seconds / 1e12:.1f} TFLOP/s (while the jobs compile)")
    except Exception as e:
        report(f"bf16 GEMM: FAILED ({type(e).__name__}: {e})")
    try:
        x, w = torch.randn(n, n, device=device) * 0.5, torch.randn(n, n, device=device) * 0.02
        one = torch.tensor(1.0, device=device)
        out = torch._scaled_mm(x.to(torch.float8_e4m3fn), (w * 512).to(torch.float8_e4m3fn).t(), scale_a=one,
                               scale_b=torch.tensor(1 / 512, device=device), out_dtype=torch.bfloat16)
        ref = x @ w.t()
        report(f"FP8 _scaled_mm smoke test: relative error {((out.float() - ref).norm() / ref.norm()).item():.4f} "
               "against fp32 (e4m3 operands: about 0.03 expected)")
    except Exception as e:
        report(f"FP8 _scaled_mm smoke test: FAILED ({type(e).__name__}: {str(e)[:200]})")
    if device == "cuda":
        torch.cuda.empty_cache()  # this process keeps its CUDA context, not these buffers


def timed(fn, device, repeats):
    import torch
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def check_data(data):
    """What is wrong with --data (relative to the repository, as the jobs see it), or None."""
    for split in ("train", "val"):
        files = sorted(glob.glob(os.path.join(ROOT, data, f"*_{split}_*.bin")))
        if not files:
            return f"--data {data}: no *_{split}_*.bin shards there"
        for path in files:
            try:
                with open(path, "rb") as f:
                    header = f.read(1024)
            except OSError as e:
                return f"--data {data}: {os.path.basename(path)} cannot be read ({e.strerror})"
            if len(header) < 1024 or int.from_bytes(header[:4], "little") != 20240520:
                return f"--data {data}: {os.path.basename(path)} is not a shard (no 20240520 header)"
    return None


def row_lengths(args):
    """(training row, validation row) in tokens: the record's 48Ki and 256Ki; 256 and 512 in a dry run."""
    return (256, 512) if args.dry_run else (49152, 262144)


def make_synthetic_data(args, work):
    """No shards at --data: FineWeb-like synthetic documents in the work folder (prepare_gpu_data.synthetic_tokens:
    no text, no tokenizer, no preparation), as many as the call reads; args.data then names them. Says so."""
    import numpy as np
    from prepare_gpu_data import synthetic_tokens, write_shard  # beside this file
    t0, given = time.monotonic(), args.data
    args.data = os.path.join(work, "data")
    os.makedirs(args.data)
    row, eval_row = row_lengths(args)
    rng = np.random.default_rng(0)
    for split, n in (("train", (args.steps + 8) * row), ("val", eval_row + 1)):
        write_shard(os.path.join(args.data, f"synthetic_{split}_000000.bin"), synthetic_tokens(n, rng))
    return (f"no shards at --data {given}: synthetic FineWeb-like documents instead, made in {time.monotonic() - t0:.1f}s "
            "(gpu_check/prepare_gpu_data.py's synthetic_tokens: log-normal lengths, Zipf ids, copied spans; no "
            "tokenizer): the step times hold, the losses are not English text's")


def train_cmd(args, work, mode, name, extra=()):
    """One mode of the speedrun preset as one of the record's 8 GPUs runs it: one 48Ki-token row a step; one
    validation row of 256Ki tokens, the record's (512 in a dry run), in the warm-up and after the last step
    (outside the timed window); the train loss every quarter of the steps, each read after a host sync, so the
    train_time on those lines is exact."""
    val_row = str(row_lengths(args)[1])
    py = [sys.executable, "train_gpt_cplm.py", "--run_id", name, "--log_dir", os.path.join(work, "logs"),
          "--overwrite", "1", "--cplm", str(mode), "--train_files", os.path.join(args.data, "*_train_*.bin"),
          "--val_files", os.path.join(args.data, "*_val_*.bin"), "--num_iterations", str(args.steps),
          "--val_tokens", val_row, "--val_seq_len", val_row, "--val_loss_every", "0",
          "--train_loss_every", str(max(1, args.steps // 4))]
    if args.dry_run:  # the cpu preset, tiny: the same program path on a CPU in seconds
        return py + ["--preset", "cpu", "--num_layers", "2", "--model_dim", "64", "--num_heads", "2",
                     "--batch_size", "256", "--seq_len", "256", "--warmup_steps", "1", *extra]
    return py + ["--preset", "speedrun", "--coordinate_descent", "0", "--batch_size", "49152", "--warmup_steps", "3",
                 *extra]


def run_jobs(jobs, deadline, report, on_exit):
    """Polls the jobs until each has ended or the deadline comes; kills what is left at the deadline. A job
    that holds the GPU (its timed loop) longer than its share of the time left is killed, so that one hang
    cannot take the others' turns: the share is the time left when it took the GPU over the training jobs
    still to time, itself included. on_exit(job) is called once a job has ended and returns jobs to add."""
    while any(j.rc is None for j in jobs):
        time.sleep(0.5)
        now = time.monotonic()  # one time a round: events seen in the same round are simultaneous
        for j in list(jobs):
            seen = set(j.events)
            j.poll(now)
            for marker in [m for m in j.events if m not in seen and m != "final"]:
                report(f"  [{now - T0:5.0f}s] {j.name}: {marker}")
        for j in jobs:
            if j.rc is None and "gpu turn" in j.events:
                if not hasattr(j, "turn_budget"):
                    waiting = [x for x in jobs if x.rc is None and "final" not in x.events
                               and not hasattr(x, "turn_budget") and x.name != "refcheck"]
                    j.turn_budget = (deadline - now) / max(len(waiting), 1)
                    if j.name == "refcheck":  # one forward and backward, then the reference: seconds
                        j.turn_budget = min(j.turn_budget, REFCHECK_TURN_S)
                    j.turn_taken = now
                elif now - j.turn_taken > j.turn_budget and "final" not in j.events:
                    j.kill(f"past its share of the GPU, {j.turn_budget:.0f}s")
        for j in list(jobs):
            if j.rc is not None and not getattr(j, "reported", False):
                j.reported = True
                report(f"  [{time.monotonic() - T0:5.0f}s] {j.name}: {j.status()}"
                       + ("" if j.rc == 0 else f" -- {j.last_line()}"))
                jobs.extend(on_exit(j))
        if time.monotonic() > deadline:
            for j in jobs:
                if j.rc is None:
                    j.kill("at the deadline")
                    j.reported = True
                    report(f"  [{time.monotonic() - T0:5.0f}s] {j.name}: {j.status()} -- last line: {j.last_line()}")
    return jobs


def compiling_beside(job, jobs):
    """The other jobs seen compiling at some moment of job's timed loop (from its GPU turn to its final line),
    or None if it has no whole timed loop. A compile beside a timed loop shares the CPU cores and, autotuning,
    the GPU."""
    start, end = job.events.get("gpu turn"), job.events.get("final")
    if start is None or end is None:
        return None
    return [x.name for x in jobs if x is not job and x.started < end and (x.compiled() or time.monotonic()) > start]


def parse_train_log(path):
    """What a (possibly cut-off) training log holds; never raises."""
    out = dict(train_loss=[], val_loss=[], steps=0, peak_train=None, peak_eval=None)
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return out
    for kind in ("train_loss", "val_loss"):
        out[kind] = [(int(m[1]), float(m[2]), int(m[3])) for m in re.finditer(
            rf"^step:(\d+)/\d+ {kind}:([-\d.naif]+) train_time:(\d+)ms", text, re.M)]
    steps = re.findall(r"^step:(\d+)/\d+ (?:train_loss|train_time)", text, re.M)
    out["steps"] = int(steps[-1]) if steps else 0
    m = re.search(r"peak memory allocated in training: (\d+) MiB, in validation: (\d+) MiB", text)
    if m:
        out["peak_train"], out["peak_eval"] = int(m[1]), int(m[2])
    return out


def window_step_ms(losses):
    """(ms a step, first step, last step) over the second half of the timed steps: from the first train_loss
    line at or past half the last one's step to the last. Each such line's clock is read after the loss's
    host sync, so the window holds whole synchronised steps; train_time is in whole ms, so the resolution
    is 1 / (last - first) ms. None if there is no such window."""
    if len(losses) < 2:
        return None
    s1, _, t1 = losses[-1]
    s0, _, t0 = next(x for x in losses if 2 * x[0] >= s1)
    return ((t1 - t0) / (s1 - s0), s0, s1) if s1 > s0 else None


def row_concentration(data_glob, rows, row_len, bos):
    """sum L^2 / T^2 (prepare_gpu_data.concentration) over the first `rows` training rows, or None."""
    import numpy as np
    from prepare_gpu_data import concentration  # beside this file
    files = sorted(glob.glob(data_glob))
    tokens = np.fromfile(files[0], dtype=np.uint16, offset=256 * 4)[: rows * row_len] if files else []
    return concentration(tokens, row_len, bos) if len(tokens) >= row_len else None


def recompiles_after_warmup(stdout_text):
    _, marker, after = stdout_text.partition("warm-up done")
    return len(re.findall(r"Recompiling function", after)) if marker else None


def job_result(j, jobs, work):
    """A training job's numbers in one line, and its timed window: (ms a step, the window in words) or None.
    Written when the job ends (a call killed later keeps them) and again in the summary."""
    log = parse_train_log(os.path.join(work, "logs", f"{j.name}.txt"))
    timed, beside = window_step_ms(log["train_loss"]), compiling_beside(j, jobs)
    warm = j.events.get("warm-up done")
    window = None
    if timed:
        words = f"steps {timed[1]}-{timed[2]}, " + (
            f"timed while {', '.join(beside)} compiled" if beside else "no compile beside it")
        window = (timed[0], words)
    line = (f"{j.name}: {j.status()}; "
            + (f"compile + warm-up {warm - j.started:.0f}s" if warm else "never finished compiling") + "; "
            + f"steps {log['steps']}; step time "
            + (f"{timed[0]:.2f} ms ({words}; 1/{timed[2] - timed[1]} ms resolution)" if timed else "none") + "; "
            + f"train loss {', '.join(f'{s}:{v:.4f}' for s, v, _ in log['train_loss']) or 'none'}; "
            + f"peak memory training {log['peak_train'] or '-'} MiB, validation {log['peak_eval'] or '-'} MiB; "
            + (f"val loss {log['val_loss'][-1][1]:.4f}; " if log["val_loss"] else "")
            + f"recompiles after warm-up {recompiles_after_warmup(j.text())}")
    return line, window


def write_summary(report, args, work, jobs):
    report("")
    report("== per job ==")
    window = {}  # training job -> (ms a step, its window in words)
    for j in jobs:
        if j.name.startswith("refcheck"):
            lines = [x for x in j.text().splitlines() if x.strip()]
            report(f"{j.name}: {j.status()}; " + " | ".join(lines[-9:]) if lines else f"{j.name}: {j.status()}; no output")
            continue
        line, timed = job_result(j, jobs, work)
        if timed:
            window[j.name] = timed
        report(line)
        if j.rc != 0:
            report(f"  why: {j.last_line()}")
    report("")
    report("== the race ==")
    # the ratio compares two windows with no compile beside them (a compile shares the cores and, autotuning, the
    # GPU): a mode's quiet re-run where it had one, else its own window if nothing compiled beside it
    clean = {name: w for name, w in window.items() if w[1].endswith("no compile beside it")}
    vanilla = next((n for n in ("vanilla_quiet", "vanilla") if n in clean), None)
    cplm = next((n for n in ("cplm_quiet", "cplm", "cplm_dense_quiet", "cplm_dense") if n in clean), None)
    shown = vanilla or next((n for n in ("vanilla_quiet", "vanilla") if n in window), None)
    if shown:
        report(f"vanilla: {window[shown][0]:.2f} ms a step ({shown}; {window[shown][1].split(', ', 1)[1]}) for one "
               "48Ki-token row on one GPU, no communication, kernels tuned without coordinate descent (not the "
               f"record's configuration); the record's 8xH100 step, communication included: {RECORD_STEP_MS} ms")
    # a relative --data is the repository's (os.path.join keeps an absolute one as it is)
    concentration = row_concentration(os.path.join(ROOT, args.data, "*_train_*.bin"), args.steps,
                                      row_lengths(args)[0], args.bos)
    if concentration is not None:
        report(f"timed rows: sum L^2 / T^2 = {concentration:.3f} (mean over the first {args.steps} rows)")
    if vanilla and cplm:
        report(f"{cplm}/vanilla step time ratio: {window[cplm][0] / window[vanilla][0]:.3f} ({cplm}: "
               f"{window[cplm][1]}; {vanilla}: {window[vanilla][1]}"
               + ("; the dense CP sums: flex failed)" if cplm.startswith("cplm_dense") else ")"))
    else:
        why = "; ".join(f"{name}: {w[1]}" for name, w in window.items() if name not in clean)
        report("cplm/vanilla step time ratio: none (" + (f"a mode has no window with no compile beside it (its re-run "
               f"alone did not fit the time left, failed, or was itself timed beside a compile): {why})" if why else
               "a mode gave no step time: see above)"))
    if args.pairs:
        report(pairs_line(clean, args.pairs))


def pairs_line(clean, wanted):
    """The ratio over the pairs of re-runs (cplm_repK and vanilla_repK, each alone, in ABBA order): each pair's in
    run order, the median and the range; a pair counts where both its runs gave a step time."""
    ratios = {}
    for k in range(1, wanted + 1):
        cplm = next((clean[n] for n in (f"cplm_rep{k}", f"cplm_dense_rep{k}") if n in clean), None)
        if cplm and f"vanilla_rep{k}" in clean:
            ratios[k] = cplm[0] / clean[f"vanilla_rep{k}"][0]
    if not ratios:
        return (f"pairs of re-runs: none of {wanted} gave both step times (not started for want of time, or a run "
                "failed: see the jobs above)")
    r = sorted(ratios.values())
    return (f"cplm/vanilla step time ratio over {len(r)} of {wanted} pairs of processes, each timed alone in ABBA "
            f"order: median {statistics.median(r):.3f}, range {r[0]:.3f}-{r[-1]:.3f} (pair: ratio, in run order: "
            f"{', '.join(f'{k}: {v:.3f}' for k, v in ratios.items())})")


def main(argv=None):
    global T0, REPORT_RESERVE_S, REFCHECK_TURN_S, QUIET_MIN_S
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="report.txt and logs.tar.gz go here ($OUT on the device)")
    p.add_argument("--data", default=".gpu_data", help="shards from gpu_check/prepare_gpu_data.py (none: synthetic)")
    p.add_argument("--deadline_s", type=float, default=570)
    p.add_argument("--steps", type=int, default=40, help="timed steps per mode (a train loss every quarter)")
    p.add_argument("--pairs", type=int, default=3, help="then, while time is left, pairs of re-runs (each alone, "
                                                         "ABBA order): the ratio's spread over processes")
    p.add_argument("--bos", type=int, default=50256)
    p.add_argument("--dry_run", action="store_true", help="CPU, tiny model: the whole program in a minute")
    p.add_argument("--inject", default="", help="tests: JOB:fail, JOB:hang, JOB:slow_compile[=S] or JOB:compile_hang, "
                                                 "comma-separated")
    args = p.parse_args(argv)
    bad = ("--deadline_s must be a number of seconds in (0, 1e6), not " + str(args.deadline_s)
           if not 0 < args.deadline_s < 1e6 else  # nan too: nothing would ever be killed at the deadline
           f"--pairs must be 0 or more, not {args.pairs}" if args.pairs < 0 else
           f"--out {args.out} is a file: it names the folder report.txt and logs.tar.gz go into"
           if os.path.exists(args.out) and not os.path.isdir(args.out) else None)
    if bad:
        print(f"first_call.py: error: {bad}", file=sys.stderr)
        return 2
    synthetic = not glob.glob(os.path.join(ROOT, args.data, "*_*_*.bin"))  # nothing prepared: made below
    problem = None if synthetic else check_data(args.data)
    if problem:  # before anything is started or written
        print(f"first_call.py: error: {problem}; make them here (tiktoken has its GPT-2 files here, not on the GPU "
              "machine): python3 gpu_check/prepare_gpu_data.py; or name a folder with no shards for synthetic documents",
              file=sys.stderr)
        return 1
    T0 = time.monotonic()
    if args.dry_run:
        REPORT_RESERVE_S, REFCHECK_TURN_S, QUIET_MIN_S = 8, 20, 15
    deadline = T0 + args.deadline_s - REPORT_RESERVE_S
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="first_call_")  # the children's logs and the GPU turn's lock: never in $OUT
    os.makedirs(os.path.join(work, "logs"))
    report = Report(args.out, work)
    device = "cpu" if args.dry_run else "cuda"
    report(f"first call: deadline {args.deadline_s:.0f}s, {args.steps} timed steps a mode"
           + (" (dry run on CPU)" if args.dry_run else "") + f"; work folder {work}")
    injected = dict(x.split(":") for x in args.inject.split(",") if x)

    def maybe_injected(name, cmd):
        how = injected.get(name)
        if how == "fail":
            return [sys.executable, "-c", "import sys; print('injected failure before warm-up'); sys.exit(7)"]
        if how == "hang":  # takes the GPU turn, as a timed loop would, and never ends
            return [sys.executable, "-c", "import fcntl, os, time; f = open(os.environ['CPLM_GPU_TURN'], 'a'); "
                    "fcntl.flock(f, fcntl.LOCK_EX); print('warm-up done; gpu turn: injected hang', flush=True); "
                    "time.sleep(10**6)"]
        if how == "compile_hang":  # never warm
            return [sys.executable, "-c", "import time; print('injected: compiling forever', flush=True); "
                    "time.sleep(10**6)"]
        if how and how.startswith("slow_compile"):  # the real job, late: a compile 10 s (or =S s) longer
            return [sys.executable, "-c", f"import os, sys, time; time.sleep({float(how.partition('=')[2] or 10)}); "
                    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])", *cmd[1:]]
        return cmd

    # the GPU turn: a file lock; each timed loop takes it when its job is warm, whatever the others are doing
    env = {"CPLM_GPU_TURN": os.path.join(work, "gpu_turn.lock"), "TORCH_LOGS": "recompiles", "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 3) // 3))}
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"  # several processes on a few cores: one thread each
    refcheck = [sys.executable, os.path.join(HERE, "cuda_cp_check.py")] + (["--dry_run"] if args.dry_run else [])
    jobs = []

    def stopped(signum, _frame):  # `timeout` and schedulers send SIGTERM: end through the `finally` below, which
        report(f"stopped by signal {signum}")  # kills the jobs (sessions of their own) and packs the logs
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stopped)
    dense = ["--cp_backend", "dense", "--cp_chunk", str(row_lengths(args)[0])]

    def training_job(base, name):  # base's training run (vanilla, cplm or cplm_dense), under its own name
        mode, extra = (0, []) if base == "vanilla" else (1, dense if base == "cplm_dense" else [])
        return [Job(name, maybe_injected(name, train_cmd(args, work, mode, name, extra)), work, env)]

    try:
        if synthetic:
            report(make_synthetic_data(args, work))
        jobs += training_job("vanilla", "vanilla") + training_job("cplm", "cplm") + [
            Job("refcheck", maybe_injected("refcheck", refcheck), work, env)]
        report("jobs started, compiling side by side: vanilla, cplm (flex), refcheck; each timed loop takes its "
               "turn on the GPU as soon as its job is warm")
        report("")
        report("== device checks (while the jobs compile) ==")
        try:
            device_checks(report, device, args.dry_run)
        except Exception as e:
            report(f"device checks: FAILED ({type(e).__name__}: {e})")
        report("")
        report("== jobs ==")
        fell_back = []

        def on_exit(job):
            if not job.name.startswith("refcheck"):  # its numbers now: a call killed later keeps them
                report(f"  {job_result(job, jobs, work)[0]}")
            report.pack()
            return fallback(job) or quiet(job) or pair(job)  # a fallback just started runs: nothing beside it

        def fallback(job):  # CPLM (flex) died before its warm-up ended, or the reference check found flex
            # unusable (exit 3): the dense CP sums in its place, if time is left
            cplm = next(j for j in jobs if j.name == "cplm")
            flex_failed = (job.name == "cplm" and job.rc != 0) or (job.name == "refcheck" and job.rc == 3)
            if flex_failed and not fell_back and "warm-up done" not in cplm.events \
                    and deadline - time.monotonic() > (20 if args.dry_run else 150):
                cplm.kill("flex failed")
                fell_back.append(True)
                report("  CPLM (flex) failed before its warm-up ended: CPLM with the dense CP sums instead")
                return training_job("cplm_dense", "cplm_dense")
            return []

        def rerun_fits(mode):  # a re-run of mode starts only with 1.5 times its longest good re-run left (whole
            # process: start, warm-cache compile, warm-up, steps, validation), or QUIET_MIN_S before it has one
            took = [j.ended - j.started for j in jobs if j.rc == 0 and re.fullmatch(rf"{mode}_(quiet|rep\d+)", j.name)]
            return deadline - time.monotonic() > (1.5 * max(took) if took else QUIET_MIN_S)

        def quiet(job):  # a mode timed beside a compile: timed again alone, once every other job has ended
            if any(j.rc is None for j in jobs):
                return []
            for j in jobs:
                beside = compiling_beside(j, jobs) if j.name in TIMED and j.rc == 0 else None
                if beside and all(x.name != f"{j.name}_quiet" for x in jobs) and rerun_fits(j.name):
                    report(f"  {j.name} was timed while {', '.join(beside)} compiled: {j.name} once more, alone "
                           f"({j.name}_quiet; its compile cache is warm)")
                    return training_job(j.name, f"{j.name}_quiet")
            return []

        def pair(job):  # then both modes again, one at a time, in ABBA order (CPLM, vanilla, vanilla, CPLM, ...)
            # so that a drift of the card's speed over the pairs does not favour one mode; the first failure stops them
            reps = [j for j in jobs if "_rep" in j.name]
            ok = {j.name for j in jobs if j.rc == 0}
            cplm = "cplm_dense" if "cplm_dense" in ok else "cplm" if "cplm" in ok else None
            k, second = len(reps) // 2 + 1, len(reps) % 2
            base = (cplm, "vanilla")[second ^ (k % 2 == 0)]
            if any(j.rc is None for j in jobs) or len(reps) >= 2 * args.pairs or not (cplm and "vanilla" in ok) \
                    or any(j.rc != 0 for j in reps) or not rerun_fits(base):
                return []
            return training_job(base, f"{base}_rep{k}")

        run_jobs(jobs, deadline, report, on_exit)
        write_summary(report, args, work, jobs)
    finally:  # whatever happened above: no child left running, the logs packed into $OUT, the work folder gone
        for j in jobs:
            j.kill("the driver stopped")
        report.pack()
        report(f"logs packed into logs.tar.gz; total {time.monotonic() - T0:.0f}s of a {args.deadline_s:.0f}s deadline")
        shutil.rmtree(work, ignore_errors=True)
    return 0


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
