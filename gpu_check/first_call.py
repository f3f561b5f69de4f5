"""The GPU check: one command for a short, time-limited GPU allocation that always comes back with a report.

    python3 gpu_check/first_call.py --out "$OUT"                 # on a machine with a GPU (records/gpu/README.md)
    python3 gpu_check/first_call.py --dry_run --out /tmp/fc      # the same program on a CPU, tiny: about a minute

Needs one CUDA GPU (FP8 and 80 GB or more, e.g. an H100 or H200), torch with Triton and this repository; no
internet and no data. Returns $OUT/report.txt (written line by line, flushed) and $OUT/logs.tar.gz (every job's
log and stdout), nothing else, within --deadline_s (570 s: one 590 s command). An $OUT that holds a report already
is refused.

--data is checked first: train and val shards there and readable (a bad or missing split: one line naming the
command that makes them, exit 1); no shards at all: synthetic FineWeb-like documents made in the work folder
(prepare_gpu_data.synthetic_tokens, no tokenizer), which the report says. Then jobs, each its own process, by value:
as many training processes at once as fit the card, at most three (each one's allocator capped at what the job needs,
NEED_GIB below: the caching allocator keeps a process's peak until it exits; two on an 80 GB H100, three on a 141 GB
H200), their timed parts taking turns on the GPU (a file lock, gpu_turn.py), each as soon as its process is
warm; a job that outlives its time is killed and reported:
  1. ab (interleaved.py): vanilla and CPLM built and compiled in one process, their training steps alternated on the
     same batches for --ab_s (100 s; at least 200 rounds on the GPU), each step timed with CUDA events: the report's
     `cplm/vanilla step time ratio (interleaved, R rounds): X.XXX [LO, HI]`, a 95% interval from a moving-block
     bootstrap over rounds; each step split into forward, backward and optimizer (the GPU's time, the host's, and
     whether the GPU ran out of work; each difference with its interval); then a profile of the modes (the top
     kernels, those only CPLM runs, the shared ones' difference, idle gaps, and the kernels by model part, as
     recorded by whichever process generated them, kernel_parts.py). It depends on no other job: the ratio comes out
     if the separate jobs hang; not warm by 390 s, it is killed. (CPLM's extra split into its loss's part and its
     CP head's, with a third model, is a call of its own: records/gpu/README.md);
  2. vanilla and cplm, started beside it (job.py: train_gpt_cplm.main itself; --steps timed steps of one
     48Ki-token row, one validation row of 256Ki tokens in the warm-up and after the timed steps; the train loss
     every quarter): compile time, step time, peak memory in training and validation, recompiles in and after
     the warm-up, train losses. Their ratio is the fallback where ab gives none: then a mode timed while another job
     compiled is timed again alone (vanilla_quiet, cplm_quiet). If CPLM (flex) fails before its warm-up ends, or
     the reference check finds flex unusable, CPLM with the dense CP sums (cplm_dense) takes its place;
  3. refcheck (cuda_cp_check.py, the CUDA CP loss against the dense reference) and devices (device_checks.py:
     versions, a bf16 GEMM rate, an FP8 smoke test), small, started at once, each within a time limit;
  4. once ab's rounds and profile are over (so that no other job's compile or warm-up shares its rounds):
     vanilla_accum and cplm_accum, the record's 393,216 tokens a step on one GPU (8 accumulation micro-steps, the
     FP8 gradient scale under them): step time and peak memory; and ab_sentinel, the pointer sentinel
     (--copy_gate sentinel) against vanilla, interleaved as in 1, while time is left.
The report says what each job gave as it ends, and at the end: the interleaved ratios, the separate-process ratio
and the accumulation runs; a job not started says why. $OUT only ever holds the two files: the children's logs live
in a work folder under $TMPDIR, packed again whole and moved in by one rename each time a job ends, so a kill at
any moment leaves the report as far as it got. Ctrl-C (SIGINT), SIGTERM and SIGHUP kill the jobs, pack the logs,
add a `stopped: SIGINT` (SIGTERM, SIGHUP) line to the report, say so in one line and exit 128 + the signal (130,
143, 129). An $OUT that cannot be written (read-only, full): one line, exit 1, the jobs killed, the work folder
removed, and an $OUT that got no line left as it was.

Time. Of --deadline_s (570 s), 25 s are kept for the report and the packing: the jobs have 545 s. The phases are
budgeted for a p90 compile: CPLM 237 s cold, vanilla 140 s cold or 45 s from the compile cache (the slower of the
two H200 calls in records/gpu, three jobs compiling side by side, plus the two calls' spread: CPLM 175 and 206 s,
vanilla 104 and 122 s, from the cache 25 and 35 s). The A/B is then warm by 282 s where three training processes
fit the card (vanilla from the cache the separate vanilla job filled) or 377 s where two do (an 80 GB H100: the
separate vanilla job waits for a slot, so the A/B compiles both modes cold); it is killed if not warm by 390 s. Its
wait for the GPU (a separate job's timed steps, 7-9 s on the H200; 20 s allowed), rounds (100 s) and profile
(30 s) then end by 527 s at the latest. What gives way when time runs short, first to last: the sentinel's A/B
(started only with 180 s left), the accumulation runs (150 s), the fallback where it is needed (the quiet re-runs,
120 s; the dense CP job, 150 s), then the A/B's rounds (cut to the time left less the profile's 30 s); the profile
and the report's 25 s are kept. The report's first lines give this plan and this order for the call's card and
options. In a dry run each job's time limits count the CPU time it gets (the wall clock while it gets none, as a
hung job does), so a loaded machine stretches them as much as it slows the jobs, and an injected hang is still
killed on time.

--dry_run does all of it on a CPU at a tiny size; the tests inject faults into any job (--inject).
"""
import argparse
import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECORD_STEP_MS = 99.9  # the 2025-01-26 record: 2.93 min over its 1760 timed steps on 8xH100, communication included
RECORD_BATCH = 8 * 48 * 1024  # the record's tokens a step: 8 GPUs x one 48Ki-token row
# The GPU's compile + warm-up (3 warm-up steps and a validation row), seconds, in the two H200 calls of records/gpu
# (2026-12-04 and 2026-12-04-200-steps: vanilla, CPLM and the reference check compiling side by side on 16 cores):
# CPLM, vanilla, and vanilla's re-run from the compile cache. Two calls give no percentile: the plan's p90 is the
# slower call's time plus the two calls' spread (p90_compile).
COMPILE_S = {"cplm": (175, 206), "vanilla": (104, 122), "vanilla_cached": (25, 35)}
TURN_WAIT_S = 20  # the A/B, once warm, waits for a separate job's timed part (7-9 s in those calls), sizes its rounds
# seconds, on the GPU and (dry run) on a CPU; test_gpu_preflight.py checks the plan (ab_plan) against COMPILE_S
BUDGET = {
    "report_reserve": (25, 8),  # kept back at the end for the report and the packing
    "devices": (90, 30),  # the device checks' job: killed past this
    "refcheck_turn": (30, 20),  # the reference check holds the GPU (its timed part and the reference) at most this
    "ab_rounds": (100, 6),  # the interleaved A/B's timed rounds (about 0.21 s a round on the H200: ~475 rounds)
    "ab_warm": (390, 90),  # the interleaved A/B warm by then (p90: 282 s on three slots, 377 s on two), or killed: the
    # fallback needs the rest (390 + TURN_WAIT_S + ab_rounds + ab_profile = 540 s, inside the jobs' 545)
    "ab_profile": (30, 10),  # kept after the rounds for the profile
    "sentinel_rounds": (60, 4),  # the sentinel's A/B, after the rest
    # each later job starts only with this much left; the larger need goes first when time runs short (give_way)
    "dense_min": (150, 20),  # the dense CP fallback: a compile and the steps
    "rerun_min": (120, 15),  # a quiet re-run: a warm-cache compile and the steps
    "accum_min": (150, 15),  # an accumulation job: a compile (the FP8 gradient scale makes new graphs) and 6 steps
    "sentinel_min": (180, 20),  # the sentinel's A/B: two modes' compiles (mostly from the cache) and 60 s of rounds
}
BIG_SLOTS = 3  # training processes alive at once at most (16 cores); fewer where their memory caps do not fit the card
# Memory: each training job's allocator is capped at MEMORY_MARGIN times what it needs, and jobs run side by side only
# while their caps fit the card. The need is the peak allocated measured on the H200 (records/gpu/README.md, "What it
# found": world size 1, one 48Ki-token row; vanilla 30,851 MiB in training, 29,804 in validation; CPLM 30,943 and
# 29,904), plus, where a job holds more, what it adds by preflight.step_memory's reading (the same README, "Memory
# per GPU"); those additions are not measured
ONE_MODEL_GIB = 30943 / 1024  # the larger measured peak, CPLM's in training: 30.2 GiB
NEED_GIB = {  # every other training job (vanilla, cplm, their quiet re-runs): ONE_MODEL_GIB
    # two models, whose steps take turns (gradients freed after each): one model's peak and the other's weights,
    # optimizer states and rotary tables (3.3 GiB)
    "ab": ONE_MODEL_GIB + 3.3, "ab_sentinel": ONE_MODEL_GIB + 3.3,
    "vanilla_accum": ONE_MODEL_GIB + 0.74, "cplm_accum": ONE_MODEL_GIB + 0.74,  # the gradients across micro-steps
    # the dense CP sums in one chunk of 48Ki queries: float32 (T, T) scores (9 GiB), in the backward recomputed beside
    # their gradient
    "cplm_dense": ONE_MODEL_GIB + 18, "cplm_dense_quiet": ONE_MODEL_GIB + 18,
}
MEMORY_MARGIN = 1.15  # a job's cap over its need: the allocator's slack (fragmentation, compile-time buffers)
RESERVE_GIB = 5  # of the card, outside the caps: each process's CUDA context and kernels, the small jobs' tensors
INJECTIONS = ("fail", "hang", "stall", "slow_compile", "after")
JOBS = ("ab", "vanilla", "cplm", "cplm_dense", "refcheck", "devices", "vanilla_quiet", "cplm_quiet",
        "cplm_dense_quiet", "vanilla_accum", "cplm_accum", "ab_sentinel")
TIMED = ("vanilla", "cplm", "cplm_dense")  # the separate jobs whose ratio is the fallback
SMALL = ("refcheck", "devices")  # no slot: they hold little memory and few cores
MARKERS = {"warm-up done": "warm-up done", "gpu turn": "gpu turn", "final": "^(final |done in )"}  # in a job's stdout


class Stopped(Exception):
    """A signal that ends the call: SIGINT (Ctrl-C), SIGTERM (`timeout`, schedulers), SIGHUP (a closed terminal)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.name = signal.Signals(signum).name


class OutError(Exception):
    """$OUT cannot be written (a read-only or full file system): one line, exit 1."""


class Signals:
    """Turns the stop signals into Stopped, raised wherever the driver is, except inside held(): there (a job started
    but not yet in the list the clean-up kills, the clean-up itself) it is raised once the block ends. The caller's
    handlers come back with restore() (the tests call main in their process)."""
    STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.signum, self.depth = None, 0
        self.before = {s: signal.signal(s, self.on_signal) for s in self.STOP}

    def on_signal(self, signum, _frame):
        self.signum = self.signum or signum
        if not self.depth:
            raise Stopped(signum)

    @contextlib.contextmanager
    def held(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.signum and not self.depth:
            raise Stopped(self.signum)

    def restore(self):
        for s, handler in self.before.items():
            signal.signal(s, handler)


def cpu_seconds_by_group():
    """{process group: CPU seconds of its processes, and of the children they reaped} from /proc ({} without it)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    try:
        pids = [x for x in os.listdir("/proc") if x.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        group = int(fields[2])  # fields from the state on: state ppid pgrp ... utime(11) stime cutime cstime(14)
        out[group] = out.get(group, 0) + sum(int(x) for x in fields[11:15]) / tick
    return out


class Job:
    """One child process with its own stdout file; killed with its whole process group. Its time limits are counted on
    its clock: the wall clock on the GPU; in a dry run the CPU time its process group gets, and the wall clock while
    it gets none (a hang, a stall), so that a loaded machine stretches the limits as much as it slows the job."""

    def __init__(self, name, cmd, work, env=None, limit_s=None, warm_limit_s=None):
        self.name, self.cmd, self.limit_s, self.warm_limit_s = name, cmd, limit_s, warm_limit_s
        self.stdout_path = os.path.join(work, "logs", f"{name}.stdout")
        self.started = time.monotonic()
        self.events = {}  # marker -> when (time.monotonic()) it was first seen in stdout
        self.ended = self.killed = None
        self.relayed = 0  # REPORT lines already copied into the report
        self.clock, self.last_tick = 0.0, (self.started, None)  # its clock, and (when, CPU seconds) at the last tick
        with open(self.stdout_path, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                         start_new_session=True)

    def tick(self, now, cpu=None):
        """Advances its clock to `now`: by the CPU seconds its group got since the last tick (cpu: their total now), at
        most the wall time; by the wall time where it got none, or where cpu is None (on the GPU)."""
        then, cpu_then = self.last_tick
        wall, got = now - then, (None if cpu is None or cpu_then is None else cpu - cpu_then)
        self.clock += wall if got is None or got <= 0 else min(got, wall)
        self.last_tick = (now, cpu)

    def poll(self, now):
        text = self.text()
        for marker, pattern in MARKERS.items():
            if marker not in self.events and re.search(pattern, text, re.M):
                self.events[marker] = now
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = now
        return rc

    def new_report_lines(self):
        """The lines for the report (`REPORT ...`) it printed since the last call."""
        lines = re.findall(r"^REPORT (.*)$", self.text(), re.M)
        new, self.relayed = lines[self.relayed:], len(lines)
        return new

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
        """SIGKILL to its process group, then reaped (waited for, at most 10 s)."""
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
        lines = [x for x in self.text().splitlines() if x.strip() and not x.startswith(("  ", "REPORT", "USDT"))]
        return lines[-1][:300] if lines else "(no output)"


class Report:
    """$OUT: report.txt, written line by line (flushed), and logs.tar.gz, the work folder's logs packed whole
    beside them and moved in by one rename. Nothing else is ever written there, so a kill at any moment leaves
    at most these two files."""

    def __init__(self, out, work):
        self.out, self.work, self.lines = out, work, 0
        try:
            self.file = open(os.path.join(out, "report.txt"), "w")
        except OSError as e:
            raise OutError(f"--out {out}: cannot write report.txt there ({e.strerror})")

    def __call__(self, line=""):
        """The line on stdout and in report.txt; OutError where report.txt cannot take it (the file is then closed).
        A stdout that cannot take it (a closed terminal after SIGHUP: EIO) is passed over: the file is what counts."""
        with contextlib.suppress(OSError):
            print(line, flush=True)
        if self.file is None:
            raise OutError(f"--out {self.out}: report.txt could not be written")
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except OSError as e:
            with contextlib.suppress(OSError):  # what the failed flush left buffered would fail again at exit
                self.file.close()
            self.file = None
            raise OutError(f"--out {self.out}: cannot write report.txt ({e.strerror})")
        self.lines += 1

    def safe(self, line=""):
        """The line where it can still be written (the clean-up: nothing there may stop it)."""
        with contextlib.suppress(OutError):
            self(line)

    def pack(self, say=None):
        """The work folder's logs into $OUT/logs.tar.gz, whole; True if they got there."""
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
            (say or self)(f"  packing the logs failed: {type(e).__name__}: {e}")
            return False
        return True


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


def make_synthetic_data(args, work, until):
    """No shards at --data: FineWeb-like synthetic documents in the work folder (prepare_gpu_data.synthetic_tokens:
    no text, no tokenizer, no preparation), enough for the timed rows and an accumulation step (the loader starts
    over when they are used up); args.data then names them. Returns the report's line; stops at `until`."""
    import numpy as np
    from prepare_gpu_data import synthetic_tokens, write_shard  # beside this file
    t0, given = time.monotonic(), args.data
    args.data = os.path.join(work, "data")
    os.makedirs(args.data)
    row, eval_row = row_lengths(args)
    rng = np.random.default_rng(0)
    for split, n in (("train", max(args.steps + 8, 10 * 8) * row), ("val", eval_row + 1)):
        write_shard(os.path.join(args.data, f"synthetic_{split}_000000.bin"), synthetic_tokens(n, rng, until=until))
    return (f"no shards at --data {given}: synthetic FineWeb-like documents instead, made in "
            f"{time.monotonic() - t0:.1f}s "
            "(gpu_check/prepare_gpu_data.py's synthetic_tokens: log-normal lengths, Zipf ids, copied spans; no "
            "tokenizer): the step times hold, the losses are not English text's")


def model_flags(args, mode_flags=()):
    """The speedrun preset as one of the record's 8 GPUs runs it (one 48Ki-token row a step), world size 1; in a dry
    run the cpu preset, tiny: the same program path on a CPU in seconds. Validation rows of the record's 256Ki
    tokens (512 in a dry run), the rotary tables sized for them."""
    val_row = str(row_lengths(args)[1])
    data = ["--train_files", os.path.join(args.data, "*_train_*.bin"),
            "--val_files", os.path.join(args.data, "*_val_*.bin"), "--val_tokens", val_row, "--val_seq_len", val_row]
    if args.dry_run:
        return ["--preset", "cpu", "--num_layers", "2", "--model_dim", "64", "--num_heads", "2", "--batch_size", "256",
                "--seq_len", "256", "--warmup_steps", "1", *data, *mode_flags]
    return ["--preset", "speedrun", "--coordinate_descent", "0", "--batch_size", "49152", "--warmup_steps", "3",
            *data, *mode_flags]


MODE_FLAGS = {"vanilla": ["--cplm", "0"], "cplm": ["--cplm", "1"],
              "cplm_dense": ["--cplm", "1", "--cp_backend", "dense"]}


def train_cmd(args, work, base, name):
    """A training job (job.py: train_gpt_cplm.main) of base (vanilla, cplm, cplm_dense) under its own name: --steps
    timed steps, a validation row in the warm-up (which compiles the evaluation graph) and after the last step
    (outside the timed window), the train loss every quarter, each read after a host sync, so the train_time on
    those lines is exact. <base>_accum: the record's tokens a step (8 micro-steps), 6 steps, no validation."""
    flags = MODE_FLAGS[base] + (["--cp_chunk", str(row_lengths(args)[0])] if base == "cplm_dense" else [])
    run = ["--run_id", name, "--log_dir", os.path.join(work, "logs"), "--overwrite", "1", "--val_loss_every", "0"]
    if name.endswith("_accum"):
        batch = str(8 * row_lengths(args)[0])
        return [sys.executable, os.path.join(HERE, "job.py"), *model_flags(args, flags), *run, "--batch_size", batch,
                "--num_iterations", "6", "--train_loss_every", "3", "--val_tokens", "0"]
    return [sys.executable, os.path.join(HERE, "job.py"), *model_flags(args, flags), *run,
            "--num_iterations", str(args.steps), "--train_loss_every", str(max(1, args.steps // 4))]


def ab_cmd(args, modes, rounds_s, end_in_s, profile):
    """The interleaved A/B (interleaved.py) of modes over the record's schedule (1770 steps; the cpu preset's 200)."""
    return [sys.executable, os.path.join(HERE, "interleaved.py"), "--modes", modes, "--rounds_s", f"{rounds_s:.0f}",
            "--min_rounds", "20" if args.dry_run else "200", "--end_in_s", f"{end_in_s:.0f}",
            "--profile_steps", "3" if profile else "0", "--profile_reserve_s", f"{budget(args, 'ab_profile'):.0f}",
            "--", *model_flags(args)]


def budget(args, name):
    return BUDGET[name][1 if args.dry_run else 0]


def p90_compile(kind):
    """The plan's p90 compile + warm-up of COMPILE_S's kind, seconds: the slower call's time plus the spread."""
    fast, slow = COMPILE_S[kind]
    return slow + (slow - fast)


def ab_plan(slots_n, ab_s, deadline_s):
    """(when the A/B is warm, when its rounds and profile are over, the jobs' deadline), seconds from the start, on
    the GPU with a p90 compile. Three training processes side by side: the separate vanilla job compiles beside the
    A/B, whose vanilla then comes from the cache; fewer: the vanilla job waits for a slot, so the A/B compiles both
    modes cold."""
    warm = p90_compile("cplm") + p90_compile("vanilla_cached" if slots_n >= 3 else "vanilla")
    end = warm + TURN_WAIT_S + ab_s + BUDGET["ab_profile"][0]
    return warm, end, deadline_s - BUDGET["report_reserve"][0]


def give_way(dry_run):
    """What gives way when time runs short, first to last: each later job starts only with its minimum left (the
    larger minimum first to go), the A/B's rounds are cut by interleaved.py's --end_in_s."""
    b = {name: BUDGET[name][1 if dry_run else 0] for name in BUDGET}
    return (f"when time runs short, given up first to last: ab_sentinel (started only with {b['sentinel_min']}s "
            f"left), cplm_accum and vanilla_accum ({b['accum_min']}s), the fallback where it is needed (the quiet "
            f"re-runs, {b['rerun_min']}s; cplm_dense, {b['dense_min']}s), then the A/B's rounds (cut to the time left "
            f"less its profile's {b['ab_profile']}s); the profile and the report's {b['report_reserve']}s are kept")


def plan_line(args, slots_n, ab_s):
    """The report's plan: on the GPU, when the A/B is warm and done on a p90 compile, and what does not fit; in a dry
    run, its limits and how they are counted."""
    if args.dry_run:
        return (f"plan (a dry run): the A/B killed if not warm after {budget(args, 'ab_warm')}s, its rounds "
                f"{ab_s:.0f}s and profile {budget(args, 'ab_profile')}s; each job's time limits count the CPU time it "
                "gets (the wall clock while it gets none, as a hung job), so a loaded machine stretches them as it "
                "slows the jobs")
    warm, end, jobs_end = ab_plan(slots_n, ab_s, args.deadline_s)
    line = (f"plan on a p90 compile (CPLM {p90_compile('cplm')}s, vanilla {p90_compile('vanilla')}s cold or "
            f"{p90_compile('vanilla_cached')}s from the cache: the slower of records/gpu's two H200 calls plus their "
            f"spread): the A/B warm by {warm}s ("
            + ("vanilla from the cache the separate vanilla job filled" if slots_n >= 3 else
               f"{slots_n} training processes side by side: both modes cold" if slots_n == 2 else
               "one training process at a time: both modes cold")
            + f"; killed if not warm by {budget(args, 'ab_warm')}s), its rounds ({ab_s:.0f}s) and profile "
            f"({budget(args, 'ab_profile')}s) over by {end}s, of the {jobs_end:.0f}s the jobs have")
    rounds = jobs_end - (end - ab_s)
    if warm > min(budget(args, "ab_warm"), jobs_end) or rounds < 10:
        line += ": no time for its rounds on such a compile (a longer --deadline_s)"
    elif end > jobs_end:
        line += f": its rounds cut to {rounds:.0f}s on such a compile"
    return line


def card_memory_gib():
    """The GPU's total memory in GiB: nvidia-smi's (the smallest card it lists), else torch's read in a subprocess (a
    CUDA start: seconds); None where neither reads it."""
    for cmd, unit in ((["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], 2 ** 20),
                      ([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
                       1)):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
            return min(int(x) for x in out.split()) * unit / 2 ** 30
        except (OSError, subprocess.SubprocessError, ValueError):  # not there, hung, no number (no card)
            continue
    return None


def memory_plan(card_gib):
    """(caps, usable): each training job's cap in GiB, MEMORY_MARGIN times its need, never above the card's usable
    memory (its total less RESERVE_GIB), and that usable memory; ({}, None) where the card's memory is unknown (a dry
    run): no caps."""
    if card_gib is None:
        return {}, None
    usable = card_gib - RESERVE_GIB
    return {n: min(MEMORY_MARGIN * NEED_GIB.get(n, ONE_MODEL_GIB), usable) for n in JOBS if n not in SMALL}, usable


def may_start(name, alive, caps, usable):
    """Whether training job `name` may start beside the training jobs `alive` (names): fewer than BIG_SLOTS of them,
    and their caps and its own within the usable memory; a job alone always may (one capped at the whole usable
    memory runs alone). No caps: the slots alone decide."""
    return len(alive) < BIG_SLOTS and (not caps or not alive or sum(caps[n] for n in alive) + caps[name] <= usable)


def slots(caps, usable):
    """How many of the first training jobs (ab, cplm, vanilla, started at once) run side by side."""
    alive = []
    for name in ("ab", "cplm", "vanilla"):
        if may_start(name, alive, caps, usable):
            alive.append(name)
    return len(alive)


def memory_line(dry_run, card_gib, caps, usable):
    """The report's line: the card, each training job's cap and how many run side by side."""
    n = slots(caps, usable)
    side = f"{n} training process{'es' if n > 1 else ''} side by side (at most {BIG_SLOTS})"
    if not caps:
        return ("memory: no caps (" + ("a dry run" if dry_run else "the card's total memory unknown: neither "
                                       "nvidia-smi nor torch read it") + f"); {side}")
    by_cap = {}
    for name, cap in caps.items():
        by_cap.setdefault(round(cap, 1), []).append(name)
    too_big = [n for n in caps if MEMORY_MARGIN * NEED_GIB.get(n, ONE_MODEL_GIB) > usable]
    return (f"memory: card {card_gib:.1f} GiB, {RESERVE_GIB} kept back; each training job's allocator capped at "
            f"{MEMORY_MARGIN}x its need (from the peaks measured in records/gpu/README.md): "
            + "; ".join(f"{', '.join(names)} {cap:.1f} GiB" for cap, names in sorted(by_cap.items())) + f"; {side}"
            + (f"; more than the card holds, so capped at {usable:.1f} GiB and run alone: {', '.join(too_big)}"
               if too_big else ""))


def run_jobs(jobs, deadline, report, on_poll, on_exit, cpu_clock=False):
    """Polls the jobs until each has ended and on_poll() starts no more (it adds what it starts to jobs), or the
    deadline comes; copies their REPORT lines into the report as they come; kills what is left at the deadline, and a
    job past its time limit. A job that holds the GPU (its timed part) longer than its turn budget is killed, so that
    one hang cannot take the others' turns: the budget is its own (turn_budget, set when it was started) or its share
    of the time left when it took the GPU, shared with the training jobs still to time, itself included, at most its
    turn_cap. Limits and turns are counted on each job's clock (Job.tick; cpu_clock: a dry run's CPU time).
    on_exit(job) is called once a job has ended."""
    while True:
        on_poll()
        if all(getattr(j, "reported", False) for j in jobs):
            break
        time.sleep(0.5)
        now = time.monotonic()  # one time a round: events seen in the same round are simultaneous
        cpu = cpu_seconds_by_group() if cpu_clock else {}
        for j in list(jobs):
            seen = set(j.events)
            j.poll(now)
            j.tick(now, cpu.get(j.proc.pid) if cpu_clock else None)
            for marker in [m for m in j.events if m not in seen and m != "final"]:
                report(f"  [{now - T0:5.0f}s] {j.name}: {marker}")
            for line in j.new_report_lines():
                report(f"  {line}")
        for j in jobs:
            if j.rc is None and j.limit_s is not None and j.clock > j.limit_s:
                j.kill(f"past its time limit, {j.limit_s:.0f}s")
            elif j.rc is None and j.warm_limit_s is not None and j.compiled() is None and j.clock > j.warm_limit_s:
                j.kill(f"not warm after {j.warm_limit_s:.0f}s")
            elif j.rc is None and "gpu turn" in j.events:
                if not hasattr(j, "turn_taken"):
                    waiting = [x for x in jobs if x.rc is None and "final" not in x.events
                               and not hasattr(x, "turn_taken") and x.name not in SMALL]
                    share = (deadline - now) / max(len(waiting), 1)
                    j.turn_budget = getattr(j, "turn_budget", None) or min(share, getattr(j, "turn_cap", share))
                    j.turn_taken = j.clock
                elif j.clock - j.turn_taken > j.turn_budget and "final" not in j.events:
                    j.kill(f"past its share of the GPU, {j.turn_budget:.0f}s")
        for j in list(jobs):
            if j.rc is not None and not getattr(j, "reported", False):
                j.reported = True
                for line in j.new_report_lines():
                    report(f"  {line}")
                report(f"  [{time.monotonic() - T0:5.0f}s] {j.name}: {j.status()}"
                       + ("" if j.rc == 0 else f" -- {j.last_line()}"))
                on_exit(j)
        if time.monotonic() > deadline:
            for j in jobs:
                if j.rc is None:
                    j.kill("at the deadline")
                    j.reported = True
                    report(f"  [{time.monotonic() - T0:5.0f}s] {j.name}: {j.status()} -- last line: {j.last_line()}")
            break
    return jobs


def compiling_beside(job, jobs):
    """The other jobs seen compiling (or, the device checks, running) at some moment of job's timed part (from its
    GPU turn to its final line), or None if it has no whole timed part. A compile beside a timed loop shares the
    CPU cores and, warming up and autotuning, the GPU."""
    start, end = job.events.get("gpu turn"), job.events.get("final")
    if start is None or end is None:
        return None
    return [x.name for x in jobs if x is not job and x.started < end and (x.compiled() or time.monotonic()) > start]


def parse_train_log(path):
    """What a (possibly cut-off) training log holds; never raises."""
    out = dict(train_loss=[], val_loss=[], steps=0, peak_train=None, peak_eval=None, grad_accum=None)
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
    m = re.search(r"grad_accum: (\d+)", text)
    out["grad_accum"] = int(m[1]) if m else None
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


def recompiles(stdout_text):
    """(recompiles in the warm-up, after it) from TORCH_LOGS=recompiles; after is None if it never got warm."""
    before, marker, after = stdout_text.partition("warm-up done")
    return len(re.findall(r"Recompiling function", before)), (
        len(re.findall(r"Recompiling function", after)) if marker else None)


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
    in_warmup, after = recompiles(j.text())
    accum = f"{log['grad_accum']} micro-steps a step; " if log["grad_accum"] and log["grad_accum"] > 1 else ""
    line = (f"{j.name}: {j.status()}; {accum}"
            + (f"compile + warm-up {warm - j.started:.0f}s" if warm else "never finished compiling") + "; "
            + f"steps {log['steps']}; step time "
            + (f"{timed[0]:.2f} ms ({words}; 1/{timed[2] - timed[1]} ms resolution)" if timed else "none") + "; "
            + f"train loss {', '.join(f'{s}:{v:.4f}' for s, v, _ in log['train_loss']) or 'none'}; "
            + f"peak memory training {log['peak_train'] or '-'} MiB, validation {log['peak_eval'] or '-'} MiB; "
            + (f"val loss {log['val_loss'][-1][1]:.4f}; " if log["val_loss"] else "")
            + f"recompiles in warm-up {in_warmup}, after it {after}")
    return line, window


def ab_result(j, jobs):
    """The interleaved A/B's line: its status, compile time, recompiles after warm-up, what compiled beside its
    rounds (other jobs' compiles and warm-ups share the cores and the GPU), and its ratio lines (also relayed as
    they came)."""
    warm, beside = j.events.get("warm-up done"), compiling_beside(j, jobs)
    _, after = recompiles(j.text())
    ratios = re.findall(r"^REPORT (\w+/\w+ step time ratio \(interleaved.*)$", j.text(), re.M)
    line = (f"{j.name}: {j.status()}; " + (f"compile + warm-up {warm - j.started:.0f}s" if warm else "never warm")
            + "; " + ("rounds and profile: " + (f"timed while {', '.join(beside)} compiled" if beside else
                                               "no compile beside them") + "; " if beside is not None else "")
            + f"recompiles after warm-up {after}")
    return line, ratios


def write_summary(report, args, work, jobs, not_started):
    report("")
    report("== per job ==")
    window, interleaved = {}, {}  # training job -> (ms a step, its window in words); ab job -> its ratio lines
    for j in jobs:
        if j.name in SMALL:
            lines = [x for x in j.text().splitlines()
                     if x.strip() and not x.startswith(("REPORT", "USDT", "gpu turn taken"))]
            shown = ("; " + " | ".join(lines[-12:])) if lines and j.name == "refcheck" else ""
            report(f"{j.name}: {j.status()}{shown}")
        elif j.name.startswith("ab"):
            line, interleaved[j.name] = ab_result(j, jobs)
            report(line)
        else:
            line, timed = job_result(j, jobs, work)
            if timed:
                window[j.name] = timed
            report(line)
        if j.rc != 0:
            report(f"  why: {j.last_line()}")
    for name, why in not_started.items():
        report(f"{name}: not started ({why})")
    report("")
    report("== the race ==")
    for name in ("ab", "ab_sentinel"):
        for line in interleaved.get(name, []):
            report(line)
    if not interleaved.get("ab"):
        ab = next((j for j in jobs if j.name == "ab"), None)
        report(f"cplm/vanilla step time ratio (interleaved): none (ab {ab.status() if ab else 'not started'}: "
               f"{ab.last_line() if ab else not_started.get('ab', '')})")
    # the separate processes' ratio compares two windows with no compile beside them (a compile shares the cores
    # and, autotuning, the GPU): a mode's quiet re-run where it had one, else its own window if nothing compiled
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
        report(f"{cplm}/vanilla step time ratio (separate processes): {window[cplm][0] / window[vanilla][0]:.3f} "
               f"({cplm}: {window[cplm][1]}; {vanilla}: {window[vanilla][1]}"
               + ("; the dense CP sums: flex failed)" if cplm.startswith("cplm_dense") else ")"))
    else:
        why = "; ".join(f"{name}: {w[1]}" for name, w in window.items() if name not in clean and "accum" not in name)
        report("cplm/vanilla step time ratio (separate processes): none (" + (
            f"a mode has no window with no compile beside it (its re-run alone is made only where the interleaved "
            f"A/B gave no ratio, and must fit the time left): {why})" if why else
            "a mode gave no step time: see above)"))
    accum = {n: window[n][0] for n in ("vanilla_accum", "cplm_accum") if n in window}
    logs = {n: parse_train_log(os.path.join(work, "logs", f"{n}.txt")) for n in ("vanilla_accum", "cplm_accum")}
    report(f"the record's {RECORD_BATCH:,} tokens a step on one GPU (8 micro-steps of {row_lengths(args)[0]} tokens; "
           f"{8 * row_lengths(args)[0]:,} in a dry run): " + "; ".join(
               f"{n.split('_')[0]} " + (f"{accum[n]:.1f} ms a step" if n in accum else "no step time")
               + f", peak memory training {logs[n]['peak_train'] or '-'} MiB" for n in logs)
           + (f"; cplm/vanilla {accum['cplm_accum'] / accum['vanilla_accum']:.3f} (two processes, 3 steps each)"
              if len(accum) == 2 else ""))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="first_call.py", description=__doc__.splitlines()[0],
                                epilog=f"Time: {give_way(False)[0].upper()}{give_way(False)[1:]} (a dry run: "
                                "the same order, shorter minima). Ctrl-C, SIGTERM, SIGHUP: the jobs killed, the "
                                "logs packed, a `stopped:` line; exit 128 + the signal. The docstring has the plan.")
    p.error = lambda message: (_ for _ in ()).throw(ValueError(message))  # one line, not argparse's usage block
    p.add_argument("--out", required=True, help="report.txt and logs.tar.gz go here ($OUT); not a call's folder")
    p.add_argument("--data", default=".gpu_data", help="shards from gpu_check/prepare_gpu_data.py (none: synthetic)")
    p.add_argument("--deadline_s", type=float, default=570, help="everything done by then, the report included "
                   "(570: inside a 590 s command)")
    p.add_argument("--steps", type=int, default=40,
                   help="timed steps of the separate jobs (a train loss every quarter)")
    p.add_argument("--ab_s", type=float, help=f"the interleaved A/B's timed rounds, seconds (default "
                   f"{BUDGET['ab_rounds'][0]}; dry run {BUDGET['ab_rounds'][1]})")
    p.add_argument("--bos", type=int, default=50256)
    p.add_argument("--dry_run", action="store_true", help="CPU, tiny model: the whole program in about a minute")
    p.add_argument("--inject", default="", help="tests: JOB:fail, JOB:hang (in its timed part, holding the GPU), "
                   "JOB:stall (never warm, never ends), JOB:slow_compile[=S], "
                   "JOB:after=OTHER (starts once OTHER ended); "
                   f"comma-separated; JOB one of {', '.join(JOBS)}")
    args = p.parse_args(argv)
    try:
        args.inject = dict(x.split(":", 1) for x in args.inject.split(",") if x)
    except ValueError:
        raise ValueError(f"--inject {args.inject}: JOB:KIND pairs, comma-separated")
    for job, how in args.inject.items():
        kind, _, value = how.partition("=")
        if job not in JOBS or kind not in INJECTIONS or (kind == "after" and value not in JOBS):
            raise ValueError(f"--inject {job}:{how}: JOB one of {', '.join(JOBS)}; KIND one of fail, hang, stall, "
                             "slow_compile[=S], after=JOB")
    if not 0 < args.deadline_s < 1e6:  # nan too: nothing would ever be killed at the deadline
        raise ValueError(f"--deadline_s must be a number of seconds in (0, 1e6), not {args.deadline_s}")
    if args.ab_s is not None and not 0 < args.ab_s < 1e6:
        raise ValueError(f"--ab_s must be a number of seconds in (0, 1e6), not {args.ab_s}")
    if args.steps < 2:
        raise ValueError(f"--steps must be 2 or more (a timed window lies between two train_loss lines), "
                         f"not {args.steps}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file: it names the folder report.txt and logs.tar.gz go into")
    held = [n for n in ("report.txt", "logs.tar.gz") if os.path.exists(os.path.join(args.out, n))]
    if held:
        raise ValueError(f"--out {args.out} holds a call's {' and '.join(held)} already: name a new folder")
    return args


def injected(args, name, cmd, work):
    """The command a job runs with its --inject fault (the tests' way to make a job fail, hang or be late)."""
    how = args.inject.get(name, "")
    kind, _, value = how.partition("=")
    if kind == "fail":
        return [sys.executable, "-c", "import sys; print('injected failure before warm-up'); sys.exit(7)"]
    if kind == "hang":  # takes the GPU turn, as a timed part would, and never ends
        return [sys.executable, "-c", "import fcntl, os, time; f = open(os.environ['GPU_CHECK_TURN'], 'a'); "
                "fcntl.flock(f, fcntl.LOCK_EX); print('warm-up done; gpu turn: injected hang', flush=True); "
                "time.sleep(10**6)"]
    if kind == "stall":  # never warm, never ends
        return [sys.executable, "-c", "import time; print('injected: stalled', flush=True); time.sleep(10**6)"]
    if kind == "slow_compile":  # the real job, late: a compile 10 s (or =S s) longer
        return [sys.executable, "-c", f"import os, sys, time; time.sleep({float(value or 10)}); "
                "os.execv(sys.executable, [sys.executable] + sys.argv[1:])", *cmd[1:]]
    if kind == "after":  # the real job, once OTHER has ended: an order no machine's speed changes
        flag = os.path.join(work, "ended", value)
        return [sys.executable, "-c", f"import os, sys, time\nwhile not os.path.exists({flag!r}): time.sleep(0.2)\n"
                "os.execv(sys.executable, [sys.executable] + sys.argv[1:])", *cmd[1:]]
    return cmd


def main(argv=None):
    """The call: 0 when it ran to its end (whatever its jobs gave), 1 bad data or an $OUT it cannot write, 2 bad
    arguments, 128 + the signal when stopped by one; each failure one line on stderr."""
    signals = Signals()  # from the first moment: a Ctrl-C is one line, never a traceback
    try:
        return call(argv, signals)
    except Stopped as e:  # before the work folder and the report existed: nothing to kill, pack or remove
        print(f"first_call.py: stopped by {e.name}: nothing was started", file=sys.stderr)
        return 128 + signals.signum
    finally:
        signals.restore()


def call(argv, signals):
    global T0
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"first_call.py: error: {e}", file=sys.stderr)
        return 2
    synthetic = not glob.glob(os.path.join(ROOT, args.data, "*_*_*.bin"))  # nothing prepared: made below
    problem = None if synthetic else check_data(args.data)
    if problem:  # before anything is started or written
        print(f"first_call.py: error: {problem}; make them where tiktoken has its GPT-2 files (the GPU machine needs "
              "no internet): python3 gpu_check/prepare_gpu_data.py; or name a folder with no shards for synthetic "
              "documents", file=sys.stderr)
        return 1
    made_out = not os.path.isdir(args.out)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        print(f"first_call.py: error: --out {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    T0 = time.monotonic()
    deadline = T0 + args.deadline_s - budget(args, "report_reserve")
    ab_s = args.ab_s if args.ab_s is not None else budget(args, "ab_rounds")
    jobs, not_started, report, stopped, failed = [], {}, None, None, None
    try:
        with signals.held():  # the report and the work folder come into being together, or a failure removes both
            report = Report(args.out, None)  # first: an $OUT that cannot be written fails before anything is made
            # the children's logs and the GPU turn's lock: never in $OUT
            report.work = work = tempfile.mkdtemp(prefix="first_call_")
            os.makedirs(os.path.join(work, "logs"))
            os.makedirs(os.path.join(work, "ended"))
        report(f"GPU check: deadline {args.deadline_s:.0f}s; the interleaved A/B's rounds {ab_s:.0f}s; {args.steps} "
               "timed steps a separate job" + (" (dry run on CPU)" if args.dry_run else "") + f"; work folder {work}")
        card = None if args.dry_run else card_memory_gib()
        caps, usable = memory_plan(card)
        report(memory_line(args.dry_run, card, caps, usable))
        report(plan_line(args, slots(caps, usable), ab_s))
        report(give_way(args.dry_run))
        run_plan(args, work, report, jobs, not_started, caps, usable, ab_s, deadline, synthetic, signals)
    except Stopped as e:
        stopped = e
    except OutError as e:
        failed = str(e)
    except OSError as e:  # the work folder (under $TMPDIR) cannot be made or written: no room, read-only
        failed = f"{e.filename or 'the work folder'}: {e.strerror}"
    finally:  # whatever happened above: no child left running, the logs packed into $OUT, the work folder gone
        signals.depth += 1  # a second Ctrl-C does not cut the clean-up short
        if signals.signum and not (stopped or failed):  # one that came while a job was being started
            stopped = Stopped(signals.signum)
        for j in jobs:
            j.kill("the driver stopped")
        unwritten = failed and (report is None or report.lines == 0)  # failed before a line: $OUT as it was
        if report is not None and report.work is not None:
            if stopped:
                report.safe(f"stopped: {stopped.name}")
            if not unwritten:
                packed = report.pack(say=report.safe)
                report.safe(("logs packed into logs.tar.gz" if packed else "the logs not packed (above)") +
                            f"; total {time.monotonic() - T0:.0f}s of a {args.deadline_s:.0f}s deadline")
            shutil.rmtree(report.work, ignore_errors=True)
        if unwritten:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(args.out, "report.txt"))
            if made_out:
                with contextlib.suppress(OSError):
                    os.rmdir(args.out)
    if stopped:
        with contextlib.suppress(OSError):  # a closed terminal's stderr
            print(f"first_call.py: stopped by {stopped.name}: its jobs killed, the report and the logs in {args.out}",
                  file=sys.stderr)
        return 128 + signals.signum
    if failed:
        with contextlib.suppress(OSError):
            print(f"first_call.py: error: {failed}" + ("; its jobs were killed" if jobs else "; nothing was started"),
                  file=sys.stderr)
        return 1
    return 0


def run_plan(args, work, report, jobs, not_started, caps, usable, ab_s, deadline, synthetic, signals):
    """Starts the jobs by value as their time comes (each added to jobs at once, so the clean-up kills it), runs them
    to the end or the deadline, and writes the summary."""
    env = {"GPU_CHECK_TURN": os.path.join(work, "gpu_turn.lock"), "TORCH_LOGS": "recompiles", "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 3) // slots(caps, usable)))}
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"  # several processes on a few cores: one thread each

    def start(name, cmd, limit_s=None, turn_budget=None, warm_limit_s=None):
        job_env = dict(env)
        if name in caps:
            job_env["GPU_CHECK_MEMORY_GIB"] = f"{caps[name]:.2f}"
        with signals.held():  # no signal between the child's start and its place in the list the clean-up kills
            job = Job(name, injected(args, name, cmd, work), work, job_env, limit_s, warm_limit_s)
            jobs.append(job)
        if turn_budget is not None:
            job.turn_budget = turn_budget
        else:  # a training job's timed steps and validation row: 6-25 s on the H200 for 40 steps (0.9 s a step of
            # 8 micro-steps); a hang gives the GPU back after this
            job.turn_cap = (20 + 2 * args.steps) if args.dry_run else (60 + 0.5 * args.steps)
        return job

    def left():
        return deadline - time.monotonic()

    def ended(name):
        return any(j.name == name and j.rc is not None for j in jobs)

    def started(name):
        return any(j.name == name for j in jobs)

    def ab_gave_ratio():
        return any(j.name == "ab" and re.search(r"^REPORT cplm/vanilla step time ratio \(interleaved", j.text(), re.M)
                   for j in jobs)

    def ab_done():  # its timed part over: rounds and profile
        return any(j.name == "ab" and ("final" in j.events or j.rc is not None) for j in jobs)

    def flex_failed():
        cplm = next((j for j in jobs if j.name == "cplm"), None)
        refcheck = next((j for j in jobs if j.name == "refcheck"), None)
        return cplm is not None and "warm-up done" not in cplm.events and (
            (cplm.rc not in (None, 0)) or (refcheck is not None and refcheck.rc == 3))

    def first_pass_over():
        return all(x.rc is not None for x in jobs if x.name in ("ab", "vanilla", "cplm", "cplm_dense"))

    def quiet_wanted(name):  # ab gave no ratio: the separate processes' ratio is the answer, from clean windows
        j = next((j for j in jobs if j.name == name), None)
        return (j is not None and j.rc == 0 and first_pass_over() and not ab_gave_ratio()
                and bool(compiling_beside(j, jobs)))

    def alone():  # no training job running: a quiet re-run has the machine to itself
        return not any(j.rc is None and j.name not in SMALL for j in jobs)

    def fallback_over():  # the accumulation runs and the sentinel come after the fallback, where it is needed
        return ab_gave_ratio() or first_pass_over() and all(
            not quiet_wanted(m) or ended(f"{m}_quiet") or f"{m}_quiet" in not_started for m in TIMED)

    refcheck = [sys.executable, os.path.join(HERE, "cuda_cp_check.py")] + (["--dry_run"] if args.dry_run else [])
    devices = [sys.executable, os.path.join(HERE, "device_checks.py")] + (["--dry_run"] if args.dry_run else [])
    ab_turn = ab_s + budget(args, "ab_profile") + (20 if args.dry_run else 60)
    # the plan, by value: (job, when it may start, the time it needs left, how to start it); each starts at most once,
    # as soon as its condition holds, a training slot and its memory are free and the time it needs is left
    plan = [
        ("devices", lambda: True, 0, lambda: start("devices", devices, limit_s=budget(args, "devices"))),
        ("refcheck", lambda: True, 0, lambda: start("refcheck", refcheck,
                                                    turn_budget=budget(args, "refcheck_turn"))),
        ("ab", lambda: True, 0, lambda: start("ab", ab_cmd(args, "vanilla,cplm", ab_s, left(), profile=True),
                                              turn_budget=ab_turn, warm_limit_s=budget(args, "ab_warm"))),
        ("cplm", lambda: True, 0, lambda: start("cplm", train_cmd(args, work, "cplm", "cplm"))),
        ("vanilla", lambda: True, 0, lambda: start("vanilla", train_cmd(args, work, "vanilla", "vanilla"))),
        ("cplm_dense", flex_failed, budget(args, "dense_min"),
         lambda: start("cplm_dense", train_cmd(args, work, "cplm_dense", "cplm_dense"))),
        *[(f"{m}_quiet", lambda m=m: quiet_wanted(m) and alone(), budget(args, "rerun_min"),
           lambda m=m: start(f"{m}_quiet", train_cmd(args, work, m, f"{m}_quiet"))) for m in TIMED],
        ("cplm_accum", lambda: ab_done() and fallback_over(), budget(args, "accum_min"),
         lambda: start("cplm_accum", train_cmd(args, work, "cplm", "cplm_accum"))),
        ("vanilla_accum", lambda: ab_done() and fallback_over(), budget(args, "accum_min"),
         lambda: start("vanilla_accum", train_cmd(args, work, "vanilla", "vanilla_accum"))),
        ("ab_sentinel", lambda: ab_done() and fallback_over(), budget(args, "sentinel_min"),
         lambda: start("ab_sentinel", ab_cmd(args, "vanilla,sentinel", min(budget(args, "sentinel_rounds"), left()),
                                             left(), profile=False),
                       turn_budget=budget(args, "sentinel_rounds") + (20 if args.dry_run else 60))),
    ]

    def on_poll():
        """Starts the plan's jobs whose time has come."""
        for name, when, need_s, launch in plan:
            if started(name) or name in not_started or not when():
                continue
            alive = [j.name for j in jobs if j.rc is None and j.name not in SMALL]
            if name not in SMALL and not may_start(name, alive, caps, usable):
                continue
            if need_s and left() < need_s:
                not_started[name] = f"{left():.0f}s left, it needs {need_s}s"
                continue
            launch()
            report(f"  [{time.monotonic() - T0:5.0f}s] {name}: started")

    def on_exit(job):
        open(os.path.join(work, "ended", job.name), "w").close()  # for the tests' --inject JOB:after=OTHER
        if job.name.startswith("ab"):
            report(f"  {ab_result(job, jobs)[0]}")
        elif job.name not in SMALL:  # its numbers now: a call killed later keeps them
            report(f"  {job_result(job, jobs, work)[0]}")
        report.pack()

    if synthetic:
        try:
            report(make_synthetic_data(args, work, until=deadline))
        except TimeoutError as e:
            report(f"no shards at --data {args.data}, and the synthetic documents were not made by the deadline "
                   f"({e}): nothing was started (fewer --steps, or a longer --deadline_s)")
            return
    report("")
    report("== jobs (each timed part takes its turn on the GPU as soon as its job is warm) ==")
    run_jobs(jobs, deadline, report, on_poll, on_exit, cpu_clock=args.dry_run)
    for name, when, need_s, launch in plan:
        if not started(name) and name not in not_started and when():
            not_started[name] = "no time, or no free slot or memory, before the deadline"
    write_summary(report, args, work, jobs, not_started)


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
