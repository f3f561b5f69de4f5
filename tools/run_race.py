#!/usr/bin/env python3
"""The race: vanilla, CPLM and the pointer sentinel trained to vanilla's loss, on one GPU or on a CPU, then judged.

    python tools/run_race.py --out race      # one GPU: the gpu1 preset, within 570 s on an 80 GB H100 or an H200;
                                             # no GPU: the cpu preset at race size, about 20 min on 2 cores
    python tools/run_race.py --out race --seeds 0,1,2,3,4 --deadline_s 0 -- --lr_muon 0.04
                                             # flags after -- go to every run and to the step-time measurement
    python tools/run_race.py --plan h100     # the budget simulation of the one-GPU race (no GPU needed)

Data: on a GPU, FineWeb's first train shard and its val shard (`python data/cached_fineweb10B.py 1`) when they are
there, else the offline stand-in `data/prose_gpt2/` (English prose in GPT-2 tokens, 21M train tokens: a gpu1 run
of 16.4M tokens reads 0.78 of it; `bash data/build_prose_corpus.sh`, then `python3 gpu_check/prepare_gpu_data.py
--out_dir data/prose_gpt2 --name prose_gpt2 --train_tokens 0 --val_tokens 0`); on a CPU, the Python standard
library's source in GPT-2 tokens (made here if missing). `--train_files/--val_files` after `--` choose others.

What it does, in three phases, writing OUT/report.txt line by line as things happen:
1. **Training.** Vanilla at the preset's schedule N; CPLM (`--cplm 1`) and the sentinel (`--copy_gate sentinel`)
   at the shorter schedules --fractions x N, fixed before the race; every schedule on every seed (seed s sets
   the initial weights and the data order: `--seed s --data_seed s`). One process per mode runs its runs back to
   back (train_gpt_cplm.main each, its own log and clock as the speedrun's), so each mode compiles once. On a GPU
   the modes' processes share the card, as many at once as fit its memory (each capped at --memory_gib), the
   sentinel's started once CPLM's first compile is done so that it finds the CP head's kernels in the cache; on
   a CPU they run one after another. The schedules run in the order --fractions gives them, so a deadline cuts
   the last-named first.
2. **The step time ratio**, measured in one process with nothing else on the device: gpu_check/interleaved.py
   trains the three modes' steps alternated on the same batches (CUDA events on a GPU): OUT/step_time.json holds
   each ratio to vanilla's step and its 95% interval. The runs' own clocks are not used for it: on a GPU the
   modes shared the card.
3. **The judge**: tools/compare.py on OUT/logs with `--target_from vanilla` (the target is vanilla's mean final
   loss, so Welch's test decides) and the measured ratios: steps and time to target per mode, n and p, and
   OUT/race.png; OUT/judge.json holds every figure.

With --deadline_s (570 on a GPU, none on a CPU): training gets what is left after the reserves for phases 2 and
3; a run whose estimated time does not fit is not started (said), runs still going at that point are stopped
(their logs end with `stopped:` and are not counted) and phases 2 and 3 still run; a phase that fails is said
and the next one still runs. Running the command again with the same OUT continues: finished runs are kept,
the others run (a finished run made with other settings runs again). Exit 0 when the judge gave its table, 1 when
it could not, 2 on bad arguments.
"""
import argparse
import gc
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = {"vanilla": ["--cplm", "0"], "cplm": ["--cplm", "1"], "sentinel": ["--cplm", "1", "--copy_gate", "sentinel"]}
FINEWEB = ("data/fineweb10B/fineweb_train_000001.bin", "data/fineweb10B/fineweb_val_*.bin")
STAND_IN = ("data/prose_gpt2/prose_gpt2_train_*.bin", "data/prose_gpt2/prose_gpt2_val_*.bin")
PYSTDLIB = ("data/pystdlib/pystdlib_train_*.bin", "data/pystdlib/pystdlib_val_*.bin")
# the race on each kind of machine: preset, flags on top of it, the CP schedules (fractions of vanilla's N, in the
# order they run), seconds kept back for the step-time phase and for the judge, the device's deadline
SETTINGS = {
    "gpu": dict(preset="gpu1", flags=[], fractions="0.55,0.4,0.7", ab_reserve=100, report_reserve=20, deadline=570,
                rounds_s=25),
    # 100 steps of one 1024-token row: ~0.75 s a step on 2 cores
    "cpu": dict(preset="cpu", flags=["--batch_size", "1024", "--num_iterations", "100", "--val_loss_every", "20"],
                fractions="0.8,0.6", ab_reserve=60, report_reserve=20, deadline=0, rounds_s=20),
    # the tests: a 2 x 64 model, 256-token rows, 8 steps, seconds in all
    "dry": dict(preset="cpu", flags=["--num_layers", "2", "--model_dim", "64", "--num_heads", "1",
                                     "--batch_size", "256",
                                     "--seq_len", "256", "--val_seq_len", "512", "--val_tokens", "1024",
                                     "--attn_window", "256", "--attn_window_start", "256", "--num_iterations", "8",
                                     "--val_loss_every", "2", "--train_loss_every", "0"],
                fractions="0.5,0.75", ab_reserve=30, report_reserve=10, deadline=0, rounds_s=2),
}
# flags the race sets for every run itself (--num_iterations after -- sets vanilla's N, the others' schedules follow)
RACE_OWNS = ("preset", "cplm", "copy_gate", "seed", "data_seed", "run_id", "log_dir", "resume", "overwrite",
             "save_checkpoint", "checkpoint_every")
# a training process's GPU memory cap, by preset: gpu1 ~15 GiB estimated (records/one_gpu_race), 1.6x, so three fit
# an 80 GB card; speedrun 30.2 GiB measured on an H200 (records/gpu/README.md), 1.2x
MEMORY_GIB = {"gpu1": 25, "speedrun": 36}
INJECTIONS = ("fail", "hang")  # tests: a mode's worker that fails at once, or never ends
MODEL_KEYS = ("num_layers", "model_dim", "num_heads", "no_attention_layer", "batch_size", "seq_len", "cp_dim")
WARM = "race: compiled and warm"  # a worker's line once its first run's clock starts (its kernels are in the cache)


class Report:
    """OUT/report.txt, one line at a time, flushed: workers and the driver append to it (one write a line)."""

    def __init__(self, path, echo=True):
        self.path, self.echo = path, echo

    def __call__(self, line):
        stamp = time.strftime("%H:%M:%S")
        with open(self.path, "a") as f:
            f.write(f"[{stamp}] {line}\n")
        if self.echo:
            print(line, flush=True)


def final_line(log_path):
    """(final val loss or None, peak MiB or None) of a finished log; None when it has no final line."""
    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return None
    final = re.search(r"^final (?:val_loss:(\S+) )?train_time:\d+ms steps:\d+\s*$", text, re.M)
    if not final:
        return None
    peak = re.search(r"^peak memory allocated in training: (\d+) MiB", text, re.M)
    return (float(final.group(1)) if final.group(1) else None, int(peak.group(1)) if peak else None)


# ----------------------------------------------------------------------------------------------------------------
# The plan

def parse_fractions(text):
    try:
        fractions = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--fractions {text!r}: a comma list of numbers in (0, 1], like 0.55,0.4,0.7") from None
    if not fractions or not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"--fractions {text!r}: each a number in (0, 1], like 0.55,0.4,0.7")
    return fractions


def plan_runs(n_steps, fractions, seeds, modes):
    """{mode: [(run_id, steps, seed)]}: vanilla at N; each other mode at round(f x N) for each fraction in order;
    every schedule on every seed before the next schedule (a deadline then cuts whole schedules, last first)."""
    plan = {}
    for mode in modes:
        schedules = [n_steps] if mode == "vanilla" else []
        for f in ([] if mode == "vanilla" else fractions):
            steps = max(1, round(f * n_steps))
            if steps not in schedules:
                schedules.append(steps)
        plan[mode] = [(f"{mode}_n{steps}_s{seed}", steps, seed) for steps in schedules for seed in seeds]
    return plan


def run_argv(s, mode, run_id, steps, seed, log_dir, extra):
    """train_gpt_cplm's flags for one run of the race's settings s (the run's own last: they win)."""
    return ["--preset", s["preset"], *s["flags"], *extra, *MODES[mode], "--num_iterations", str(steps), "--seed",
            str(seed), "--data_seed", str(seed), "--run_id", run_id, "--log_dir", log_dir]


def fits(estimate_s, now, end_at):
    """Start a run only if its estimate ends before end_at (no end_at, or no estimate yet: start)."""
    return end_at is None or estimate_s is None or now + estimate_s <= end_at


# ----------------------------------------------------------------------------------------------------------------
# A mode's worker: its runs back to back in one process (one compile)

def same_settings(log_path, argv, tg):
    """Whether a finished log ran the settings this run would (all but where its files go): a race continued with
    other flags trains its runs again rather than pooling two configurations."""
    try:
        logged = [json.loads(line[len("hyperparameters: "):]) for line in open(log_path, errors="replace")
                  if line.startswith("hyperparameters: ")][-1]
        planned = tg.dataclasses.asdict(tg.resolve_vocabulary(tg.parse_args(argv)))
    except (IndexError, ValueError, OSError, tg.UsageError, tg.DataError):
        return False
    skip = {"run_id", "log_dir", "resume", "overwrite", "preset"}
    return all(logged.get(k) == v for k, v in planned.items() if k not in skip)


def judged_diverged(log_path):
    """Whether the judge reads the log as a run that diverged (its own definition, tools/compare.py's)."""
    import compare  # beside this file; its needs were checked before the race started
    try:
        return compare.diverged(compare.parse_log(log_path))
    except compare.LogError:  # no log, or no validation in it
        return False


def clock_starts(marks):
    """train_gpt_cplm.main's hook just before a run's clock starts: the warm-up (and compile) is over."""
    marks["clock"] = time.time()
    print(WARM, flush=True)


def worker(spec_path):
    spec = json.load(open(spec_path))
    report = Report(spec["report"], echo=True)
    mode, end_at = spec["mode"], spec["end_at"]
    if spec.get("inject") == "fail":
        report(f"{mode}: failed at start (injected)")
        return 1
    if spec.get("inject") == "hang":
        report(f"{mode}: hanging (injected)")
        while True:
            time.sleep(1)
    sys.path.insert(0, ROOT)
    import torch
    import train_gpt_cplm as tg
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # a new model a run
    if spec.get("memory_gib") and torch.cuda.is_available():  # bounded by need: processes share the card
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train_gpt_cplm.main
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["memory_gib"] * 2 ** 30 / total))
    per_step = later_warmup = None  # seconds a timed step, and a warm-up after the first (compiled) one
    trained = 0  # runs this process has started: the first one compiles
    for run_id, steps, argv in spec["runs"]:
        log_path = os.path.join(spec["log_dir"], f"{run_id}.txt")
        done = final_line(log_path)
        if done is not None and same_settings(log_path, argv, tg):
            report(f"{mode}: {run_id} kept: finished before (final val_loss {done[0]})")
            continue
        if done is not None:
            report(f"{mode}: {run_id} trained again: its log was made with other settings")
        estimate = None if per_step is None else steps * per_step * 1.15 + (later_warmup or 0)
        if not fits(estimate, time.time(), end_at):
            report(f"{mode}: {run_id} not started: needs ~{estimate:.0f}s, {end_at - time.time():.0f}s of training "
                   "time left")
            continue
        if os.path.exists(log_path):  # a stopped run's log: this run replaces it
            argv = argv + ["--overwrite", "1"]
        gc.collect()  # the last run's model and optimizers go before this one's are built (a failed run's too)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated() // 2 ** 20 if torch.cuda.is_available() else 0  # left by earlier runs
        marks, t0 = {}, time.time()
        trained += 1
        try:
            rc = tg.main(argv, before_clock=lambda: clock_starts(marks))
        except SystemExit as e:  # SIGTERM at the deadline: the run's log says "stopped:"; no more runs
            report(f"{mode}: {run_id} stopped ({e}); not counted")
            return 1
        except (tg.UsageError, tg.DataError) as e:  # every run of the race shares the flags and the data
            report(f"{mode}: error: {e}")
            return 2
        except Exception as e:  # noqa: BLE001  (one run's failure, said; the mode's other runs still run)
            text = str(e).splitlines()[0][:200] if str(e) else ""
            oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
            report(f"{mode}: {run_id} FAILED: {type(e).__name__}: {text}"
                   + (f" (this process's cap: {spec['memory_gib']} GiB, --memory_gib)" if oom else ""))
            if "CUDA error" in str(e) and not oom:  # the process's CUDA context is lost: its later runs would fail
                report(f"{mode}: its other runs not started: the CUDA context is lost after this error")
                return 1
            continue
        end = time.time()
        if "clock" in marks:
            per_step = (end - marks["clock"]) / max(steps, 1)
            if trained > 1:
                later_warmup = marks["clock"] - t0
        result = final_line(log_path)
        if rc != 0 or result is None:
            report(f"{mode}: {run_id} " + ("diverged (a non-finite loss): the judge counts it, and its group fails"
                                           if judged_diverged(log_path) else
                                           f"ended with exit {rc} and no final line: not counted"))
            continue
        val, peak = result
        warm = f", warm-up {marks['clock'] - t0:.0f}s" if "clock" in marks else ""
        report(f"{mode}: {run_id} done: {steps} steps, final val_loss {val}, {end - t0:.0f}s{warm}"
               + (f", peak {peak} MiB" if peak else "") + (f" ({held} MiB held from earlier runs)" if held else ""))
    return 0


# ----------------------------------------------------------------------------------------------------------------
# The driver

class Worker:
    def __init__(self, mode, spec, out):
        self.mode = mode
        self.stdout_path = os.path.join(out, "workers", f"{mode}.out")
        spec_path = os.path.join(out, "workers", f"{mode}.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if spec.get("compile_threads"):  # processes compiling side by side share the cores
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(spec["compile_threads"])
        with open(self.stdout_path, "w") as f:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", spec_path], cwd=ROOT,
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def compiling(self):
        """Still before its first run's clock (compiling): the cache its kernels fill is not full yet."""
        if self.proc.poll() is not None:
            return False
        try:
            return WARM not in open(self.stdout_path, errors="replace").read()
        except OSError:
            return True

    def last_lines(self, n=3):
        try:
            return open(self.stdout_path, errors="replace").read().strip().splitlines()[-n:]
        except OSError:
            return []


def stop_all(procs, grace_s):
    """SIGTERM to every process group at once (a run's log then says why it stopped), SIGKILL to those still there
    after grace_s: one shared wait, however many there are."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        os.killpg(p.pid, signal.SIGTERM)
    until = time.time() + grace_s
    for p in alive:
        try:
            p.wait(max(0.0, until - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def the_card():
    """(free GiB, shared) of the GPU the runs use (the first visible one), from nvidia-smi, so that this process
    holds no CUDA context; shared: its compute mode lets several processes use it ("Default"). Without
    nvidia-smi: torch's total memory, and shared assumed."""
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free,compute_mode", "--format=csv,noheader,nounits",
                              "-i", index], capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        free, mode = (x.strip() for x in out[0].split(","))
        return float(free) / 1024, mode == "Default"
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        import torch
        return torch.cuda.get_device_properties(0).total_memory / 2 ** 30, True


def choose_data(kind, given, preset_files):
    """(flags, what) for the race's data: --train_files / --val_files given after --; else the preset's own files
    where they are (no flags: FineWeb's first shard for gpu1, the standard library's source for cpu, tokenized here
    if missing); else, on a GPU, the offline stand-in. ValueError saying how to get data otherwise."""
    if "--train_files" in given or "--val_files" in given:
        if len(given) < 2:
            raise ValueError("give both --train_files and --val_files after --, or neither")
        return ["--train_files", given["--train_files"], "--val_files", given["--val_files"]], "the files given"
    have = lambda pattern: bool(glob.glob(os.path.join(ROOT, pattern)))  # noqa: E731
    what = {FINEWEB: "FineWeb (its first train shard, its val shard)",
            PYSTDLIB: "the Python standard library's source (GPT-2 tokens; code, copy-heavy)"}
    if preset_files == PYSTDLIB and not (have(PYSTDLIB[0]) and have(PYSTDLIB[1])):  # tiktoken fetches its files once
        made = subprocess.run([sys.executable, "data/tokenize_corpus.py", "--stdlib", "--out_dir", "data/pystdlib",
                               "--name", "pystdlib"], cwd=ROOT)
        if made.returncode != 0:
            raise ValueError("the standard library's source could not be tokenized (above: why); give data with "
                             "-- --train_files GLOB --val_files GLOB")
    if have(preset_files[0]) and have(preset_files[1]):
        return [], what.get(preset_files, " and ".join(preset_files))
    if kind == "gpu" and have(STAND_IN[0]) and have(STAND_IN[1]):
        return ["--train_files", STAND_IN[0], "--val_files", STAND_IN[1]], (
            "the stand-in for FineWeb: English prose in GPT-2 tokens (data/prose_gpt2; a gpu1 run reads 0.78 of its "
            "21M train tokens)")
    raise ValueError(f"no data at {preset_files[0]}: python data/cached_fineweb10B.py 1 (FineWeb's first shard and "
                     "val, needs internet), or offline: bash data/build_prose_corpus.sh && python3 "
                     "gpu_check/prepare_gpu_data.py --out_dir data/prose_gpt2 --name prose_gpt2 --train_tokens 0 "
                     "--val_tokens 0")


def step_time_phase(s, kind, args, data_flags, extra, out, report, end_s):
    """The interleaved A/B in one process: {mode: (ratio, lo, hi, rounds)}, written to OUT/step_time.json."""
    flags = ["--preset", s["preset"], *s["flags"], *data_flags, *extra]
    left = end_s - time.time()
    if left < 30:
        report(f"step time: not measured: {left:.0f}s left")
        return None
    # its own clock starts after torch is imported (seconds on a cold machine): 20 s kept for that and its report
    cmd = [sys.executable, os.path.join(ROOT, "gpu_check", "interleaved.py"), "--modes", ",".join(args.modes),
           "--rounds_s", str(args.rounds_s or s["rounds_s"]), "--min_rounds", "10", "--end_in_s", f"{left - 20:.0f}",
           "--profile_steps", "0", "--", *flags]
    report(f"step time: the interleaved A/B of {', '.join(args.modes)} in one process ({left:.0f}s left)")
    with open(os.path.join(out, "workers", "step_time.out"), "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            report("step time: killed at its deadline")
        finally:  # at its deadline, or when the race itself is stopped: it must not hold the GPU on
            stop_all([proc], grace_s=0)
    text = open(os.path.join(out, "workers", "step_time.out"), errors="replace").read()
    found = {m[0]: (float(m[2]), float(m[3]), float(m[4]), int(m[1])) for m in re.findall(
        r"^REPORT (\w+)/vanilla step time ratio \(interleaved, (\d+) rounds\): ([\d.]+) \[([\d.]+), ([\d.]+)\]",
        text, re.M)}
    for line in re.findall(r"^REPORT (.*)$", text, re.M):
        report(f"  {line}")
    if not found:
        tail = " | ".join(text.strip().splitlines()[-3:])
        report(f"step time: FAILED (exit {proc.returncode}): {tail[:300]}")
        return None
    record = {"source": "gpu_check/interleaved.py, the modes alternated in one process", "kind": kind,
              "settings": s["model"]}
    for mode, (ratio, lo, hi, rounds) in found.items():
        record.update({f"ratio_{mode}": ratio, f"ratio_interval_95_{mode}": [lo, hi], f"rounds_{mode}": rounds})
    with open(os.path.join(out, "step_time.json"), "w") as f:
        f.write(json.dumps(record) + "\n")
    return found


def judge_phase(out, shown_out, report, have_step_times, end_s):
    """tools/compare.py on the race's logs: its table into the report, then its JSON and the plot (a first
    matplotlib import can take long: the table comes first); True if it judged."""
    base = [sys.executable, os.path.join(HERE, "compare.py"), os.path.join(out, "logs"), "--target_from", "vanilla"]
    if have_step_times:
        base += ["--step_times", os.path.join(out, "step_time.json")]
    else:
        report("judge: no step time ratio measured: time to target from the logs' own clocks, which on a GPU "
               "shared the card between modes (a rough figure)")
    report("judge: " + " ".join(["python tools/compare.py", *[x.replace(out, shown_out) for x in base[2:]]]))
    try:
        table = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=max(60, end_s - time.time()))
    except subprocess.TimeoutExpired:
        report("judge: killed at the deadline")
        return False
    for line in (table.stdout + table.stderr).rstrip().splitlines():
        report(f"  {line}")
    if table.returncode != 0:
        return False
    try:
        import matplotlib  # noqa: F401
        plot = ["--plot", os.path.join(out, "race.png")]
    except ImportError:
        plot = []
        report("judge: no plot: matplotlib is not installed (pip install matplotlib)")
    try:
        js = subprocess.run(base + plot + ["--json"], cwd=ROOT, capture_output=True, text=True,
                            timeout=max(60, end_s - time.time()))
        if js.returncode == 0:
            with open(os.path.join(out, "judge.json"), "w") as f:
                f.write(js.stdout)
    except subprocess.TimeoutExpired:
        report("judge: its JSON and plot not written: killed at the deadline")
    return True


def check_dependencies():
    """The judge's needs, before any run starts: a race that trains for minutes and then cannot judge is refused."""
    try:
        import numpy  # noqa: F401
        import scipy
    except ImportError as e:
        raise ValueError(f"{e.name} is not installed, and the judge needs it: pip install scipy numpy") from None
    if tuple(int(x) for x in re.findall(r"\d+", scipy.__version__)[:2]) < (1, 11):
        raise ValueError(f"scipy {scipy.__version__} is too old for the judge's intervals: pip install 'scipy>=1.11'")


def drive(args, extra):
    started = time.time()
    check_dependencies()
    import torch
    kind = "dry" if args.dry_run else "gpu" if torch.cuda.is_available() else "cpu"
    s = SETTINGS[kind]
    if args.preset:  # another size on the same machine: the preset's own schedule and validation
        s = dict(s, preset=args.preset, flags=[])
    deadline = s["deadline"] if args.deadline_s is None else args.deadline_s
    end_all = started + deadline if deadline > 0 else None
    extra = [part for x in extra for part in (x.split("=", 1) if x.startswith("--") and "=" in x else [x])]
    given = {k: os.path.abspath(extra[i + 1]) for i, k in enumerate(extra[:-1])
             if k in ("--train_files", "--val_files")}  # globs from where the command was given
    extra = [x for i, x in enumerate(extra) if x not in ("--train_files", "--val_files")
             and (i == 0 or extra[i - 1] not in ("--train_files", "--val_files"))]
    sys.path.insert(0, ROOT)
    import train_gpt_cplm as tg
    try:  # every flag checked before anything is made or started
        hp = tg.parse_args(["--preset", s["preset"], *s["flags"], *extra])
    except tg.UsageError as e:
        raise ValueError(f"after --: {e}") from None
    data_flags, data_what = choose_data(kind, given, (hp.train_files, hp.val_files))
    hp = tg.parse_args(["--preset", s["preset"], *s["flags"], *data_flags, *extra])
    n_steps = hp.num_iterations
    s = dict(s, model={k: getattr(hp, k) for k in MODEL_KEYS})  # what the step times are measured on
    plan = plan_runs(n_steps, parse_fractions(args.fractions or s["fractions"]), args.seeds, args.modes)
    out = os.path.abspath(args.out)
    log_dir = os.path.join(out, "logs")
    os.makedirs(os.path.join(out, "workers"), exist_ok=True)
    report = Report(os.path.join(out, "report.txt"))
    report(f"race: {', '.join(args.modes)}; {kind}: preset " + " ".join([s["preset"], *s["flags"], *extra])
           + f"; data: {data_what}; seeds {','.join(map(str, args.seeds))}")
    for mode, runs in plan.items():
        schedules = sorted({steps for _, steps, _ in runs})
        report(f"  {mode}: {len(runs)} runs, schedules {', '.join(map(str, schedules))} steps")
    end_train = None
    if end_all:
        end_train = end_all - s["ab_reserve"] - s["report_reserve"]
        report(f"  deadline {deadline:.0f}s: training until {end_train - started:.0f}s, the step time until "
               f"{end_all - s['report_reserve'] - started:.0f}s, then the judge")
    slots, memory_gib = 1, None  # a CPU: one process at a time on all cores (two on one core each do no more work)
    if kind == "gpu":
        memory_gib = args.memory_gib or MEMORY_GIB.get(s["preset"], MEMORY_GIB["speedrun"])
        free, shared = the_card()
        slots = max(1, min(len(args.modes), int((free - 3) // memory_gib))) if shared else 1
        report(f"  the GPU: {free:.1f} GiB free" + ("" if shared else ", its compute mode exclusive")
               + f": {slots} training process{'es' if slots > 1 else ''} at once, each capped at {memory_gib} GiB")
    else:
        report("  one training process at a time")

    def stop(signum, frame):  # the workers are stopped in the finally below, the report says so
        raise SystemExit(f"stopped by signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
    running = []
    try:
        return race(args, kind, s, plan, data_flags, extra, out, log_dir, report, started, end_all, end_train,
                    slots, memory_gib, running)
    except SystemExit as e:
        report(f"race: {e} at {time.time() - started:.0f}s; the runs in progress are not counted")
        return 1
    finally:
        stop_all([w.proc for w in running], grace_s=10)


def race(args, kind, s, plan, data_flags, extra, out, log_dir, report, started, end_all, end_train, slots,
         memory_gib, running):
    # 1. training: one worker a mode
    pending = list(args.modes)
    injected = dict(item.split(":", 1) for item in args.inject)
    while pending or running:
        now = time.time()
        if end_train and now > end_train and running:
            report(f"training: {end_train - started:.0f}s reached: stopping {', '.join(w.mode for w in running)} "
                   "(a run in progress is not counted)")
            stop_all([w.proc for w in running], grace_s=15)
            running.clear()
        for mode in list(pending):
            cp_compiling = any(w.mode != "vanilla" and w.compiling() for w in running)
            if len(running) >= slots or (mode != "vanilla" and cp_compiling) or (end_train and now > end_train):
                break
            runs = [(rid, steps, run_argv(s, mode, rid, steps, seed, log_dir, data_flags + extra))
                    for rid, steps, seed in plan[mode]]
            spec = dict(mode=mode, runs=runs, end_at=end_train, report=report.path, log_dir=log_dir,
                        memory_gib=memory_gib, inject=injected.get(mode),
                        compile_threads=max(1, len(os.sched_getaffinity(0)) // slots) if kind == "gpu" else None)
            running.append(Worker(mode, spec, out))
            pending.remove(mode)
            report(f"{mode}: started ({time.time() - started:.0f}s)")
        if end_train and time.time() > end_train and pending:
            report(f"training: no time left to start {', '.join(pending)}")
            pending = []
        for w in list(running):
            rc = w.proc.poll()
            if rc is not None:
                running.remove(w)
                said = "" if rc == 0 else ": " + " | ".join(w.last_lines())[:300]
                report(f"{w.mode}: worker ended, exit {rc} ({time.time() - started:.0f}s){said}")
        time.sleep(0.2 if kind == "dry" else 1)

    # 2. the step time ratio, alone on the device
    ab_end = (end_all - s["report_reserve"]) if end_all else time.time() + 3600
    measured = None
    if len(args.modes) > 1 and "vanilla" in args.modes:
        measured = step_time_phase(s, kind, args, data_flags, extra, out, report, ab_end)
    # 3. the judge
    judged = judge_phase(out, args.out, report, measured is not None, end_all or time.time() + 600)
    report(f"race: done in {time.time() - started:.0f}s; report {os.path.join(args.out, 'report.txt')}, "
           f"plot {os.path.join(args.out, 'race.png')}")
    return 0 if judged else 1



# ----------------------------------------------------------------------------------------------------------------
# The budget simulation (--plan): the driver's own rules (plan_runs, fits, the slots, the cutoff) against assumed
# times, all estimates (records/one_gpu_race/README.md derives them). Step time: gpu1's own roofline floor per card
# (records/one_gpu_race/roofline_gpu1.md, `gpu_check/roofline.py --preset gpu1`: vanilla 22.9 ms on an H200, 27.1 on
# an H100) times 1.6. The factor: the H200 ran the speedrun preset (12 x 768, one 48Ki row) at 99.8-107.5 ms a step
# (records/gpu/README.md), 1.38-1.48x its 72.5 ms floor (records/gpu/roofline.md); 1.6 is that range's top and a
# margin for a small step's larger share of fixed host work; the simulation's 1.5x variant covers the gap above the
# floor with launches being all fixed (the H200: 25.8 + 19-27 ms = 45-53 ms). The H100's is unmeasured: the same
# factor on its own floor. Compile, from the H200's (three processes on 16 cores: vanilla 104-122 s, CPLM 175-206
# s, 25-35 s from a warm cache): 60% of the 12-layer model's for the backbone (fewer distinct graphs and nodes),
# the CP head's FlexAttention kernels +70 s as measured.
CARDS = {
    "h200": dict(name="one H200 (141 GB)", memory_gib=139.8, vanilla_step_ms=36.6),  # 22.9 ms x 1.6
    "h100": dict(name="one H100 SXM (80 GB)", memory_gib=79.1, vanilla_step_ms=43.4),  # 27.1 ms x 1.6
}
# cp_step_ratio: the roofline's at gpu1's size is 1.019 (H200) and 1.017 (H100); the upper bound used is the H200's
# measured CPLM extra at the speedrun's size (+2.6 to +4.2 ms a 48Ki row) times 32/48 for the shorter row (the CP
# head's work grows with the row, not the depth): 1.7-2.8 ms of 36.6, 1.05-1.08
ASSUMED = dict(cp_step_ratio=1.08,
               val_s=0.2,  # one validation of 512Ki tokens, forward only: about 16 x a third of a step
               compile_s={"vanilla": 65, "cplm": 135, "sentinel": 45},  # the sentinel: from CPLM's kernels in cache
               later_run_s=6,  # a worker's later run: model, loader (shuffle), warm-up steps, all compiled
               start_s=8, ab_s=75, judge_s=10,  # driver start; the A/B's compile from the cache and rounds; judge
               stop_s=10)  # stopping the processes still training at the cut-off (a SIGTERM handled in a compile)


def simulate(card, slow=1.0):
    """(timeline, runs finished): the one-GPU race on `card` (CARDS) by the driver's rules, every time assumed x
    `slow` (1: the estimate; 1.5: everything half as slow again). The GPU's time is shared evenly by the processes
    using it; processes stopped at the cut-off take ASSUMED["stop_s"]."""
    c, A, s = CARDS[card], ASSUMED, SETTINGS["gpu"]
    n, every = 500, 50  # gpu1's num_iterations and val_loss_every
    plan = plan_runs(n, parse_fractions(s["fractions"]), [0, 1, 2], list(MODES))
    end_train = s["deadline"] - s["ab_reserve"] - s["report_reserve"]
    slots = max(1, min(3, int((c["memory_gib"] - 3) // MEMORY_GIB["gpu1"])))

    def gpu_seconds(mode, steps):
        ratio = 1.0 if mode == "vanilla" else A["cp_step_ratio"]
        return slow * (steps * c["vanilla_step_ms"] * ratio / 1000 + (steps // every + 1) * A["val_s"])

    lines, t, dt, done, skipped = [], A["start_s"] * slow, 0.5, [], []
    pending = list(MODES)
    state = {}
    while (pending or state) and t < end_train:
        for mode in list(pending):
            if len(state) >= slots or (mode != "vanilla" and any(m != "vanilla" and st["phase"] == "compile"
                                                                 for m, st in state.items())):
                break
            state[mode] = dict(phase="compile", left=A["compile_s"][mode] * slow, run=0, per_step=None)
            pending.remove(mode)
            lines.append(f"  {t:5.0f}s  {mode}: started, compiling")
        on_gpu = [m for m, st in state.items() if st["phase"] == "gpu"]
        for mode, st in list(state.items()):
            st["left"] -= dt / len(on_gpu) if st["phase"] == "gpu" else dt
            if st["left"] > 0:
                continue
            if st["phase"] == "gpu":  # a run ends
                run_id, steps, _ = plan[mode][st["run"]]
                st["per_step"] = (t - st["gpu_from"]) / steps
                done.append(run_id)
                st["run"] += 1
            while st["run"] < len(plan[mode]):  # the next run that fits
                run_id, steps, _ = plan[mode][st["run"]]
                estimate = None if st["per_step"] is None else steps * st["per_step"] * 1.15 + A["later_run_s"] * slow
                if fits(estimate, t, end_train):
                    break
                skipped.append(run_id)
                st["run"] += 1
            if st["run"] >= len(plan[mode]):
                lines.append(f"  {t:5.0f}s  {mode}: all its runs done or skipped")
                del state[mode]
                continue
            if st["phase"] == "compile" and st["run"] == 0 and "gpu_from" not in st:
                lines.append(f"  {t:5.0f}s  {mode}: compiled, training")
            st.update(phase="gpu", left=gpu_seconds(mode, plan[mode][st["run"]][1]), gpu_from=t)
            if st["run"] > 0:
                st["left"] += A["later_run_s"] * slow / max(1, len(on_gpu))  # its set-up, roughly
        t += dt
    cut = [run_id for mode, st in state.items() for run_id, _, _ in plan[mode][st["run"]:]]
    never = [run_id for mode in pending for run_id, _, _ in plan[mode]]
    if state:
        t += A["stop_s"] * slow
        lines.append(f"  {t:5.0f}s  training cut: {', '.join(state)} stopped")
    t_ab = t + A["ab_s"] * slow
    end = t_ab + A["judge_s"] * slow
    lines.append(f"  {t_ab:5.0f}s  step time measured (the A/B: {A['ab_s'] * slow:.0f}s)")
    lines.append(f"  {end:5.0f}s  judged; deadline {s['deadline']}s")
    head = [f"{c['name']}, every assumed time x {slow}: {slots} processes at once; vanilla "
            f"{c['vanilla_step_ms'] * slow:.0f} ms a step alone, N = {n} -> {gpu_seconds('vanilla', n):.0f}s a "
            "vanilla run",
            f"  runs done {len(done)} of {sum(len(r) for r in plan.values())}"
            + (f"; not started {', '.join(skipped + never)}" if skipped or never else "")
            + (f"; stopped {', '.join(cut)}" if cut else "")]
    return "\n".join(head + lines), done

# ----------------------------------------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    extra = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    p = argparse.ArgumentParser(prog="run_race.py", description=__doc__.splitlines()[0])
    p.error = lambda message: (_ for _ in ()).throw(ValueError(message))
    p.add_argument("--out", help="the race's folder: report.txt, logs/, step_time.json, judge.json, race.png "
                                 "(the same folder again continues the race)")
    p.add_argument("--seeds", default="0,1,2", help="each sets a run's initial weights and data order (2 or more: a "
                   "test needs 2; the race's claims rest on 3)")
    p.add_argument("--fractions", default=None, help="CPLM's and the sentinel's schedules, fractions of vanilla's N "
                   "in the order they run (GPU: 0.55,0.4,0.7; CPU: 0.8,0.6)")
    p.add_argument("--modes", default="vanilla,cplm,sentinel", help="vanilla first")
    p.add_argument("--preset", choices=("gpu1", "speedrun", "cpu"), default=None,
                   help="train_gpt_cplm's preset instead of the race's size (GPU: gpu1; CPU: cpu at 100 steps); "
                        "--preset speedrun races the record itself on one card (about 25 min a vanilla run)")
    p.add_argument("--deadline_s", type=float, default=None, help="everything done by then (GPU: 570; CPU: 0, none)")
    p.add_argument("--memory_gib", type=float, default=None,
                   help="GPU memory cap of each training process (gpu1: 25, speedrun: 36); fewer run at once when "
                        "their caps do not fit the card's free memory")
    p.add_argument("--rounds_s", type=float, default=None, help="the step-time phase's timed rounds (GPU 25, CPU 20)")
    p.add_argument("--plan", choices=sorted(CARDS), help="print the budget simulation for this card and exit")
    p.add_argument("--dry_run", action="store_true", help="the whole race on a CPU at a tiny size (the tests)")
    p.add_argument("--inject", action="append", default=[], metavar="MODE:" + "|".join(INJECTIONS),
                   help="tests: a mode's worker fails at once or hangs")
    try:
        args = p.parse_args(argv)
        if args.plan:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
            print(simulate(args.plan)[0] + "\n\n" + simulate(args.plan, slow=1.5)[0])
            return 0
        if not args.out:
            raise ValueError("--out DIR is required")
        try:
            args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--seeds {args.seeds!r}: a comma list of integers") from None
        if len(set(args.seeds)) != len(args.seeds) or len(args.seeds) < 2 or min(args.seeds) < 0:
            raise ValueError(f"--seeds: 2 or more distinct integers >= 0 (a test needs 2), not {args.seeds}")
        args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not args.modes or args.modes[0] != "vanilla" or not set(args.modes) <= set(MODES) \
                or len(set(args.modes)) != len(args.modes):
            raise ValueError(f"--modes: vanilla first, then any of cplm, sentinel; not {','.join(args.modes)}")
        parse_fractions(args.fractions or "1")
        if args.memory_gib is not None and not (args.memory_gib > 0 and math.isfinite(args.memory_gib)):
            raise ValueError(f"--memory_gib must be a positive number of GiB, not {args.memory_gib}")
        if args.deadline_s is not None and not (args.deadline_s >= 0 and math.isfinite(args.deadline_s)):
            raise ValueError(f"--deadline_s must be >= 0 (0: none), not {args.deadline_s}")
        for item in args.inject:
            mode, _, what = item.partition(":")
            if mode not in MODES or what not in INJECTIONS:
                raise ValueError(f"--inject {item!r}: MODE:{'|'.join(INJECTIONS)}")
        for i, flag in enumerate(extra):
            if flag.startswith("--") and flag[2:].split("=")[0] in RACE_OWNS:
                raise ValueError(f"{flag.split('=')[0]} after --: the race sets it itself")
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise ValueError(f"--out {args.out}: a file, not a folder")
        return drive(args, extra)
    except ValueError as e:
        print(f"run_race.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
