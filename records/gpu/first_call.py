"""The first call on a lent GPU machine: the race's numbers in one device call, whatever breaks.

    python3 records/gpu/first_call.py --out "$OUT"                 # on the GPU machine (records/gpu/README.md)
    python3 records/gpu/first_call.py --dry_run --out /tmp/fc      # the same program on a CPU, tiny, in a minute

Under one global deadline (default 570 s, inside the device call's 590), and writing its report as it goes:
  1. versions, the GPU, a bf16 GEMM rate and an FP8 (_scaled_mm) smoke test, in this process;
  2. three jobs side by side, each its own process (plain python3, world size 1): vanilla and CPLM (flex) on
     the speedrun preset with one 48Ki-token row a step, and the CUDA CP loss against the dense reference
     (cuda_cp_check.py). They compile at the same time on the machine's cores; only the timed loops take
     turns on the GPU (a file lock, CPLM_GPU_TURN, taken after the untimed warm-up). Coordinate-descent
     tuning is off (--coordinate_descent 0): the record's kernels are tuned with it, these are not;
  3. if CPLM (flex) dies before its warm-up ends and time is left, CPLM with the dense CP sums (one chunk
     per row: one compiled shape) in its place;
  4. if time is left, one evaluation of each mode at the record's 256Ki-token rows (its memory);
  5. the report (report.txt), from whatever came back: per job the compile time, the step time over one
     synchronised window between two validations (0.1 ms), validation losses, peak memory of training and of
     validation apart, recompiles after warm-up; the CPLM / vanilla step-time ratio; sum L^2 / T^2 of the
     timed rows; which parts failed and why. The logs are packed into logs.tar.gz (the device tool returns
     at most 8 files).
A job that fails, hangs or outlives its share of the deadline is killed and reported; the report always comes
out. --dry_run does all of it on the CPU at a tiny size (the test suite runs it, with a job made to fail and
one made to hang).
"""
import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECORD_STEP_MS = 99.9  # the 2025-01-26 record: 2.93 min over its 1760 timed steps on 8xH100, communication included
REPORT_RESERVE_S = 25  # kept back at the end for the report and the packing
REFCHECK_TURN_S = 30  # the reference check's timed part holds the GPU at most this long (5 s in a dry run)


class Job:
    """One child process with its own stdout file; killed with its whole process group."""

    def __init__(self, name, cmd, out_dir, env=None):
        self.name, self.cmd = name, cmd
        self.stdout_path = os.path.join(out_dir, "logs", f"{name}.stdout")
        self.started = time.monotonic()
        self.events = {}  # marker -> seconds after start when it first appeared in stdout
        self.killed = None
        with open(self.stdout_path, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                         start_new_session=True)

    def poll(self):
        text = self.text()
        for marker in ("warm-up done", "gpu turn", "final val_loss"):
            if marker not in self.events and marker in text:
                self.events[marker] = time.monotonic() - self.started
        return self.proc.poll()

    def text(self):
        try:
            with open(self.stdout_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self, why):
        if self.proc.poll() is None:
            self.killed = why
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
            return f"killed ({self.killed}) after {time.monotonic() - self.started:.0f}s"
        if self.rc is None:
            return "running"
        return "ok" if self.rc == 0 else f"exit {self.rc}"

    def last_line(self):
        lines = [x for x in self.text().splitlines() if x.strip() and not x.startswith("  ")]
        return lines[-1][:300] if lines else "(no output)"


class Report:
    """report.txt, written line by line (flushed), so that a kill still leaves what was known."""

    def __init__(self, path):
        self.file = open(path, "w")

    def __call__(self, line=""):
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


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
        report(f"bf16 GEMM {n}^3: {2 * n ** 3 / seconds / 1e12:.1f} TFLOP/s")
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


def train_cmd(args, mode, name, extra=()):
    """One mode of the speedrun preset as one of the record's 8 GPUs runs it: one 48Ki-token row a step."""
    py = [sys.executable, "train_gpt_cplm.py", "--run_id", name, "--log_dir", os.path.join(args.out, "logs"),
          "--overwrite", "1", "--cplm", str(mode), "--train_files", os.path.join(args.data, "*_train_*.bin"),
          "--val_files", os.path.join(args.data, "*_val_*.bin")]
    if args.dry_run:  # the cpu preset, tiny: the same program path on a CPU in seconds
        return py + ["--preset", "cpu", "--num_layers", "2", "--model_dim", "64", "--num_heads", "2",
                     "--batch_size", "256", "--seq_len", "256", "--val_seq_len", "256", "--val_tokens", "512",
                     "--num_iterations", str(args.steps), "--val_loss_every", str(args.steps // 2),
                     "--warmup_steps", "1", *extra]
    return py + ["--preset", "speedrun", "--coordinate_descent", "0", "--batch_size", "49152",
                 "--num_iterations", str(args.steps), "--warmup_steps", "3", "--val_loss_every", str(args.steps // 2),
                 "--val_seq_len", "49152", "--val_tokens", str(4 * 49152), *extra]


def run_jobs(jobs, deadline, report, on_exit=None, hold=None):
    """Polls the jobs until each has ended or the deadline comes; kills what is left at the deadline. A job
    that holds the GPU (its timed loop) longer than its share of the time left is killed, so that one hang
    cannot take the others' turns: the share is the time left when it took the GPU over the training jobs
    still to time, itself included."""
    while any(j.rc is None for j in jobs):
        time.sleep(0.5)
        if hold is not None and not hold.closed and all(
                j.rc is not None or "warm-up done" in j.events for j in jobs if j.name != "refcheck"):
            hold.close()  # every training job has compiled: the timed loops may start, one at a time
            report(f"  [{time.monotonic() - T0:5.0f}s] every training job warmed up: the GPU turns begin")
        for j in jobs:
            if j.rc is None and "gpu turn" in j.events:
                if not hasattr(j, "turn_budget"):
                    waiting = [x for x in jobs if x.rc is None and "final val_loss" not in x.events
                               and not hasattr(x, "turn_budget") and x.name != "refcheck"]
                    j.turn_budget = (deadline - time.monotonic()) / max(len(waiting), 1)
                    if j.name == "refcheck":  # its timed part is one forward and backward: seconds
                        j.turn_budget = min(j.turn_budget, REFCHECK_TURN_S)
                    j.turn_taken = time.monotonic()
                elif time.monotonic() - j.turn_taken > j.turn_budget and "final val_loss" not in j.events:
                    j.kill(f"past its share of the GPU, {j.turn_budget:.0f}s")
        for j in list(jobs):
            if j.poll() is not None and not getattr(j, "reported", False):
                j.reported = True
                report(f"  [{time.monotonic() - T0:5.0f}s] {j.name}: {j.status()}"
                       + ("" if j.rc == 0 else f" -- {j.last_line()}"))
                if on_exit:
                    jobs.extend(on_exit(j))
        if time.monotonic() > deadline:
            for j in jobs:
                if j.rc is None:
                    j.kill("at the deadline")
                    j.reported = True
                    report(f"  [{time.monotonic() - T0:5.0f}s] {j.name}: {j.status()} -- last line: {j.last_line()}")
    return jobs


def parse_train_log(path):
    """What a (possibly cut-off) training log holds; never raises."""
    out = dict(val=[], steps=0, peak_train=None, peak_eval=None, hyperparameters={})
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return out
    for m in re.finditer(r"^step:(\d+)/\d+ val_loss:([\d.naif]+) train_time:(\d+)ms", text, re.M):
        out["val"].append((int(m[1]), float(m[2]), int(m[3])))
    steps = re.findall(r"^step:(\d+)/\d+ (?:train_loss|train_time)", text, re.M)
    out["steps"] = int(steps[-1]) if steps else 0
    m = re.search(r"peak memory allocated in training: (\d+) MiB, in validation: (\d+) MiB", text)
    if m:
        out["peak_train"], out["peak_eval"] = int(m[1]), int(m[2])
    m = re.search(r"^hyperparameters: (\{.*\})$", text, re.M)
    if m:
        out["hyperparameters"] = json.loads(m[1])
    return out


def window_step_ms(val):
    """Step time over the last window between two validations: the clock is stopped (after a sync) at each
    one, so the window holds only synchronised training steps."""
    if len(val) < 2:
        return None
    (s0, _, t0), (s1, _, t1) = val[-2], val[-1]
    return (t1 - t0) / (s1 - s0) if s1 > s0 else None


def row_concentration(data_glob, rows, row_len, bos):
    """sum L^2 / T^2 (prepare_gpu_data.concentration) over the first `rows` training rows, or None."""
    import glob
    import numpy as np
    from prepare_gpu_data import concentration  # beside this file
    files = sorted(glob.glob(data_glob))
    tokens = np.fromfile(files[0], dtype=np.uint16, offset=256 * 4)[: rows * row_len] if files else []
    return concentration(tokens, row_len, bos) if len(tokens) >= row_len else None


def recompiles_after_warmup(stdout_text):
    _, marker, after = stdout_text.partition("warm-up done")
    return len(re.findall(r"Recompiling function", after)) if marker else None


def write_summary(report, args, jobs):
    report("")
    report("== per job ==")
    step_ms = {}
    for j in jobs:
        if j.name.startswith("refcheck"):
            lines = [x for x in j.text().splitlines() if x.strip()]
            report(f"{j.name}: {j.status()}; " + " | ".join(lines[-9:]) if lines else f"{j.name}: {j.status()}; no output")
            continue
        log = parse_train_log(os.path.join(args.out, "logs", f"{j.name}.txt"))
        ms = window_step_ms(log["val"])
        compile_s = j.events.get("warm-up done")
        report(f"{j.name}: {j.status()}; compile + warm-up {f'{compile_s:.0f}s' if compile_s else 'not finished'}; "
               f"steps {log['steps']}; step time {f'{ms:.1f} ms' if ms else 'none (fewer than two validations)'}; "
               f"val {', '.join(f'{s}:{v:.4f}' for s, v, _ in log['val']) or 'none'}; "
               f"peak memory training {log['peak_train'] or '-'} MiB, validation {log['peak_eval'] or '-'} MiB; "
               f"recompiles after warm-up {recompiles_after_warmup(j.text())}")
        if j.rc != 0:
            report(f"  why: {j.last_line()}")
        if ms and j.name in ("vanilla", "cplm", "cplm_dense"):
            step_ms[j.name] = ms
    report("")
    report("== the race ==")
    cplm_name = "cplm" if "cplm" in step_ms else ("cplm_dense" if "cplm_dense" in step_ms else None)
    if "vanilla" in step_ms:
        report(f"vanilla: {step_ms['vanilla']:.1f} ms a step for one 48Ki-token row on one GPU, no communication, "
               f"kernels tuned without coordinate descent (not the record's configuration); the record's "
               f"8xH100 step, communication included: {RECORD_STEP_MS} ms")
    # a relative --data is the repository's (os.path.join keeps an absolute one as it is)
    concentration = row_concentration(os.path.join(ROOT, args.data, "*_train_*.bin"), args.steps,
                                      256 if args.dry_run else 49152, args.bos)
    if concentration is not None:
        report(f"timed rows: sum L^2 / T^2 = {concentration:.3f} (mean over the first {args.steps} rows)")
    if "vanilla" in step_ms and cplm_name:
        report(f"{cplm_name}/vanilla step time ratio: {step_ms[cplm_name] / step_ms['vanilla']:.3f}"
               + (" (the dense CP sums: flex failed)" if cplm_name == "cplm_dense" else ""))
    else:
        report("cplm/vanilla step time ratio: none (a mode gave no step time: see above)")


def main(argv=None):
    global T0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="report.txt and logs.tar.gz go here ($OUT on the device)")
    p.add_argument("--data", default=".gpu_data", help="shards from records/gpu/prepare_gpu_data.py")
    p.add_argument("--deadline_s", type=float, default=570)
    p.add_argument("--steps", type=int, default=40, help="timed steps per mode (validations at 0, half, end)")
    p.add_argument("--bos", type=int, default=50256)
    p.add_argument("--dry_run", action="store_true", help="CPU, tiny model: the whole program in a minute")
    p.add_argument("--inject", default="", help="tests: JOB:fail or JOB:hang, comma-separated")
    args = p.parse_args(argv)
    T0 = time.monotonic()
    if args.dry_run:
        global REFCHECK_TURN_S
        REFCHECK_TURN_S = 5
    deadline = T0 + args.deadline_s - REPORT_RESERVE_S
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    report = Report(os.path.join(args.out, "report.txt"))
    device = "cpu" if args.dry_run else "cuda"
    report(f"first call: deadline {args.deadline_s:.0f}s, {args.steps} timed steps a mode"
           + (" (dry run on CPU)" if args.dry_run else ""))
    try:
        device_checks(report, device, args.dry_run)
    except Exception as e:
        report(f"device checks: FAILED ({type(e).__name__}: {e})")
    injected = dict(x.split(":") for x in args.inject.split(",") if x)

    def maybe_injected(name, cmd):
        if injected.get(name) == "fail":
            return [sys.executable, "-c", "import sys; print('injected failure before warm-up'); sys.exit(7)"]
        if injected.get(name) == "hang":  # takes the GPU turn, as a timed loop would, and never ends
            return [sys.executable, "-c", "import fcntl, os, time; f = open(os.environ['CPLM_GPU_TURN'], 'a'); "
                    "fcntl.flock(f, fcntl.LOCK_EX); print('warm-up done; gpu turn: injected hang', flush=True); "
                    "time.sleep(10**6)"]
        return cmd

    # the GPU turn: a file lock outside $OUT; this process holds it until every training job has compiled, so
    # no timed loop runs while another job still compiles (16 cores shared) or autotunes on the GPU
    lock = os.path.join("/tmp", f"cplm_gpu_turn_{os.getpid()}.lock")
    import fcntl
    hold = open(lock, "a")
    fcntl.flock(hold, fcntl.LOCK_EX)
    env = {"CPLM_GPU_TURN": lock, "TORCH_LOGS": "recompiles", "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 3) // 3))}
    refcheck = [sys.executable, os.path.join(HERE, "cuda_cp_check.py")] + (["--dry_run"] if args.dry_run else [])
    report("")
    report("== jobs (compiling side by side; the timed loops take turns on the GPU) ==")
    jobs = [Job(name, maybe_injected(name, cmd), args.out, env) for name, cmd in (
        ("vanilla", train_cmd(args, 0, "vanilla")), ("cplm", train_cmd(args, 1, "cplm")), ("refcheck", refcheck))]

    dense = ["--cp_backend", "dense", "--cp_chunk", "256" if args.dry_run else "49152"]
    fell_back = []

    def fallback(job):  # CPLM (flex) died before its warm-up ended, or the reference check found flex
        # unusable (exit 3): the dense CP sums in its place, if time is left
        cplm = next(j for j in jobs if j.name == "cplm")
        flex_failed = (job.name == "cplm" and job.rc != 0) or (job.name == "refcheck" and job.rc == 3)
        if flex_failed and not fell_back and "warm-up done" not in cplm.events \
                and deadline - time.monotonic() > (20 if args.dry_run else 150):
            cplm.kill("flex failed")
            fell_back.append(True)
            report("  CPLM (flex) failed before its warm-up ended: CPLM with the dense CP sums instead")
            return [Job("cplm_dense", maybe_injected("cplm_dense", train_cmd(args, 1, "cplm_dense", dense)),
                        args.out, env)]
        return []

    try:
        run_jobs(jobs, deadline, report, on_exit=fallback, hold=hold)
        hold.close()
        finish(args, report, jobs, deadline, dense if fell_back else [])
    finally:  # whatever happened above, the logs go back packed, and the lock file goes
        pack(args, report)
        with contextlib.suppress(OSError):
            os.remove(lock)
    return 0


def finish(args, report, jobs, deadline, cplm_flags):
    env = {"TORCH_LOGS": "recompiles", "PYTHONUNBUFFERED": "1"}
    # the record's validation rows (256Ki tokens): memory of evaluation, if time is left
    if deadline - time.monotonic() > (10 if args.dry_run else 120) and not args.dry_run:
        report("")
        report("== evaluation at 256Ki-token rows (memory) ==")
        eval_jobs = []
        for name, mode, extra in (("cplm", 1, cplm_flags), ("vanilla", 0, [])):  # one at a time: memory
            eval_jobs.append(Job(f"eval256k_{name}", train_cmd(args, mode, f"eval256k_{name}", extra) + [
                "--num_iterations", "0", "--warmup_steps", "0", "--val_seq_len", "262144", "--val_tokens", "262144"],
                args.out, env))
            run_jobs(eval_jobs[-1:], deadline, report)
        for j in eval_jobs:
            log = parse_train_log(os.path.join(args.out, "logs", f"{j.name}.txt"))
            report(f"{j.name}: {j.status()}; peak memory of validation {log['peak_eval']} MiB"
                   + ("" if j.rc == 0 else f" -- {j.last_line()}"))
        jobs += eval_jobs
    write_summary(report, args, [j for j in jobs if not j.name.startswith("eval256k")])


def pack(args, report):
    """The logs into logs.tar.gz: the device tool brings back at most 8 files."""
    import shutil
    with tarfile.open(os.path.join(args.out, "logs.tar.gz"), "w:gz") as tar:
        tar.add(os.path.join(args.out, "logs"), arcname="logs")
    shutil.rmtree(os.path.join(args.out, "logs"), ignore_errors=True)
    report(f"logs packed into logs.tar.gz; total {time.monotonic() - T0:.0f}s of a {args.deadline_s:.0f}s deadline")


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
