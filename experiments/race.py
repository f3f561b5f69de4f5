"""CPU races of vanilla against CPLM: English prose at the paper's V/D (`--study prose`), and the first race,
on the Python standard library's source (GPT-2 BPE, V >> D), kept for its records.

    python experiments/race.py [--jobs 2] [--seeds 0,1,2] [--only NAME,...] [--out records/race]

Runs the `cpu` preset of train_gpt_cplm.py (4 x 128, 2048 tokens a step; 100 steps) in these configurations, each
seed a separate run (one thread each, --jobs at a time), logs in OUT/logs/:
  full_{vanilla,cplm}    full attention over the 1024-token rows
  sw_{vanilla,cplm}      a sliding window of 128 tokens
  full_cplm_stopgrad     ablation: no gradient from the CP head into the backbone
  bytes_{vanilla,cplm}   control: byte-level tokens (V = 257 < D = 320), where the paper finds no gain
A run stopped before its end continues from its newest checkpoint when the command runs again.
Then writes OUT/summary.txt (tools/compare.py per attention type, convergence ratio against vanilla's
final val loss) and OUT/{full,sw,bytes}.png. Runs whose log already ends with a final line are not run
again. `--study gate` runs GATE_CONFIGS instead (records/gate_init): the choice of optimizer and gate start.
`--study prose` (records/prose_race) is the race on English prose at the paper's V/D, the one to read:
    python experiments/race.py --study prose --stage sweep --seeds 0     # 4 learning-rate scales x 2 modes
    python experiments/race.py --study prose --stage rows --seeds 0,1,2  # every row at the best scales
    python experiments/race.py --study prose --stage rows --seeds 0 --scale 0.25 --only bytes_vanilla,bytes_cplm
                                                                         # a row's own sweep: another scale
and writes OUT/summary.md (experiments/race_report.py). Its rows are described at PROSE_ROWS below.
"""
import glob
import os
import subprocess
import sys
import time

from cli import ROOT, OneLineParser  # experiments/cli.py

SW = ["--attn_window", "128", "--attn_window_start", "128"]
BYTES = ["--train_files", "data/pystdlib_bytes/pystdlib_bytes_train_*.bin",
         "--val_files", "data/pystdlib_bytes/pystdlib_bytes_val_*.bin",
         "--vocab_size", "257", "--bos_id", "256", "--model_dim", "320", "--num_heads", "4"]
CONFIGS = {
    "full_vanilla": ["--cplm", "0"],
    "full_cplm": ["--cplm", "1"],
    "sw_vanilla": ["--cplm", "0"] + SW,
    "sw_cplm": ["--cplm", "1"] + SW,
    "full_cplm_stopgrad": ["--cplm", "1", "--cp_stop_grad", "1"],
    "bytes_vanilla": ["--cplm", "0"] + BYTES,
    "bytes_cplm": ["--cplm", "1"] + BYTES,
}
SEEDS_OF = {"full_cplm_stopgrad": 1, "bytes_vanilla": 1, "bytes_cplm": 1}  # single-seed controls
# where the CP head's matrices are optimised and where the gate starts (CPLM, full attention, seed 0)
# (recorded when copy_gate_init was the <copy> logit's bias: 0 gave c = 1/50304 at step 0, 10.8 gave c = 0.494)
GATE_CONFIGS = {
    "gate_adam_closed": ["--cplm", "1", "--copy_gate_init", str(1 / 50304)],
    "gate_muon_closed": ["--cplm", "1", "--copy_gate_init", str(1 / 50304), "--cp_optimizer", "muon"],
    "gate_adam_open": ["--cplm", "1", "--copy_gate_init", "0.494"],
}
# the race's budget: 100 steps of 2048 tokens, validation on 16Ki tokens every 20 steps
RACE_FLAGS = ["--num_iterations", "100", "--val_loss_every", "20", "--val_tokens", "16384"]

# `--study prose`: English prose (data/build_prose_corpus.sh) with its own BPE of V = 8192 at D = 128
# (V/D = 64, inside the paper's 24-85), 1000 steps, validation every 50 (5%) on 32Ki tokens in rows as long as
# the training rows. In two stages:
#   --stage sweep: both modes get the same sweep of learning-rate scales (every rate times the scale, seed 0);
#   --stage rows:  each mode's best scale (lowest final val loss of the sweep) on every seed (the headline),
#                  then the other rows on every seed at the best scale of their mode (CPLM's for CPLM rows):
#                  the pointer sentinel (lam = 1 - s: the paper's gate taken out), the open gate (c = 0.5 at step
#                  0; the headline starts closed, c = 1/V), the stop-gradient
#                  ablation, the V/D study (BPE of 2048 and 32768 at the same D: V/D = 16 and 256 next to the
#                  headline's 64) and the byte-level control (V = 257 at D = 256: no bottleneck).
# The other rows are not swept themselves: a skeptic may say their best scale could differ. `--scale S` runs
# chosen rows at another scale (a row's own sweep); the summary reports them as extra rows.
# Rows compare only within one version of the script. The runs in records/prose_race trained with a random W_Q;
# since 2026-12-01 W_Q starts at zero, so the rows added since (the pointer sentinel, the reordered data) run
# together with a rerun of the headline, in a folder of their own and at the headline's scale (both modes' best
# was 0.5), which needs no sweep there:
#   python experiments/race.py --study prose --stage rows --scale 0.5 --out records/prose_v2 --seeds 0,1,2 \
#       --only vanilla,cplm,sentinel,vanilla_reordered,cplm_reordered
# and the V/D rows beside them (seed 0 in records/prose_v2), scored with the headline's on the same text under
# every tokenizer (bits per byte of the headline's test documents, documents 19:142 of the val split in every
# prose corpus):
#   python experiments/race.py --study prose --stage rows --scale 0.5 --out records/prose_v2 --seeds 0 \
#       --only v2048_vanilla,v2048_cplm,v32768_vanilla,v32768_cplm,bytes_vanilla,bytes_cplm
#   python experiments/test_slice.py \
#       records/prose_v2/logs/prose_{vanilla,cplm,v2048_*,v32768_*,bytes_*}_lr0.5_s0/state_step001000.pt \
#       --test_documents 19:142 --out records/prose_v2/vd_same_bytes
# The headline again on the pinned corpus build (data/prose_packages.txt, 2026-12-02), each mode's rate and the
# pointer sentinel's chosen on that build's validation slice (records/prose_v3; CPLM's best moved to 1):
#   python experiments/race.py --study prose --stage sweep --seeds 0 --out records/prose_v3 --only \
#       prose_vanilla_lr0.5,prose_vanilla_lr1,prose_cplm_lr0.5,prose_cplm_lr1
#   for s in 0.25 0.5 1 2; do python experiments/race.py --study prose --stage rows --scale $s --only sentinel \
#       --seeds 0 --out records/prose_v3; done
#   python experiments/race.py --study prose --stage rows --scale 1 --only cplm,sentinel --seeds 1,2 --out records/prose_v3
PROSE_BUDGET = ["--val_seq_len", "1024", "--num_iterations", "1000", "--val_loss_every", "50", "--val_tokens", "32768",
                "--compile", "1",  # inductor on CPU: a CPLM step 1.55 -> 1.1 s (one thread), after ~1 min compiling
                # checkpoints at 10%, 20%, ... of training for the mechanism studies (logs/<run_id>/, git-ignored
                # *.pt; step 0 is the seed's initialisation)
                "--checkpoint_every", "100", "--keep_checkpoints", "10"]


def prose_data(vocab):
    return ["--train_files", f"data/prose{vocab}/prose{vocab}_train_*.bin",
            "--val_files", f"data/prose{vocab}/prose{vocab}_val_*.bin"]


PROSE = prose_data(8192) + PROSE_BUDGET
CPU_LRS = {"lr_embed": 0.6, "lr_head": 0.008, "lr_scalar": 0.04, "lr_muon": 0.04, "lr_cp": 0.008}  # the cpu preset's
LR_SCALES = ("0.25", "0.5", "1", "2")  # 0.25 added when both modes came out best at 0.5, the edge


def scaled_lrs(scale):
    return [x for name, lr in CPU_LRS.items() for x in (f"--{name}", f"{lr * float(scale):g}")]


# row -> (mode whose best scale it uses, flags); the headline rows come first
PROSE_ROWS = {
    "vanilla": ("vanilla", ["--cplm", "0"] + PROSE),
    "cplm": ("cplm", ["--cplm", "1"] + PROSE),
    # the pointer-sentinel baseline (Merity et al. 2016): the same CP head, gated by its sink alone
    "sentinel": ("cplm", ["--cplm", "1", "--copy_gate", "sentinel"] + PROSE),
    # the headline pair with a data order of each seed's own ({seed}: the run's seed), so seeds vary the data too
    "vanilla_reordered": ("vanilla", ["--cplm", "0", "--data_seed", "{seed}"] + PROSE),
    "cplm_reordered": ("cplm", ["--cplm", "1", "--data_seed", "{seed}"] + PROSE),
    "cplm_open": ("cplm", ["--cplm", "1", "--copy_gate_init", "0.5"] + PROSE),
    "cplm_stopgrad": ("cplm", ["--cplm", "1", "--cp_stop_grad", "1"] + PROSE),
    **{f"v{V}_{mode}": (mode, ["--cplm", str(int(mode == "cplm"))] + prose_data(V) + PROSE_BUDGET)
       for V in (2048, 32768) for mode in ("vanilla", "cplm")},
    **{f"bytes_{mode}": (mode, ["--cplm", str(int(mode == "cplm")), "--model_dim", "256", "--num_heads", "4"]
                         + prose_data(257) + PROSE_BUDGET) for mode in ("vanilla", "cplm")},
}
HEADLINE_ROWS = ("vanilla", "cplm")  # the rows the sweep tunes; every other row runs at their best scales
# `--stage long`: the headline pair past the early snapshot, 9x the budget (about 18M tokens, under one epoch), at
# the headline's rate (scale 0.5, tuned at 1000 steps; the cooldown starts at step 5400), validation every 250
# steps and every checkpoint kept (every 500 steps: the probes and the test slice are read from them later)
LONG_STEPS = 9000
LONG_BUDGET = ["--val_seq_len", "1024", "--num_iterations", str(LONG_STEPS), "--val_loss_every", "250",
               "--val_tokens", "32768", "--compile", "1", "--checkpoint_every", "500",
               "--keep_checkpoints", str(LONG_STEPS // 500 + 1)]
LONG_SCALE = "0.5"
LONG_CONFIGS = {f"prose_long_{mode}_lr{LONG_SCALE}": ["--cplm", str(int(mode == "cplm")), *scaled_lrs(LONG_SCALE),
                                                      *prose_data(8192), *LONG_BUDGET]
                for mode in HEADLINE_ROWS}
PROSE_CONFIGS = {f"prose_{row}_lr{scale}": [*flags[:2], *scaled_lrs(scale), *flags[2:]]
                 for row, (_, flags) in PROSE_ROWS.items() for scale in LR_SCALES}
PROSE_SWEEP = [f"prose_{mode}_lr{scale}" for scale in LR_SCALES for mode in ("vanilla", "cplm")]


def final_val_loss(log_path):
    """The final val loss of a finished run's log, else None."""
    if not finished(log_path):
        return None
    line = [x for x in open(log_path).read().splitlines() if x.startswith("final val_loss:")][-1]
    return float(line.split()[1].split(":")[1])


def best_scales(log_dir):
    """{mode: its learning-rate scale with the lowest seed-0 final val loss in the sweep}; a one-line error
    (ValueError) while a sweep run is missing."""
    best = {}
    for mode in ("vanilla", "cplm"):
        losses = {s: final_val_loss(os.path.join(ROOT, log_dir, f"prose_{mode}_lr{s}_s0.txt")) for s in LR_SCALES}
        missing = [s for s, loss in losses.items() if loss is None]
        if missing:
            raise ValueError(f"the sweep is not finished (prose_{mode}_lr{missing[0]}_s0): run --stage sweep first")
        best[mode] = min(losses, key=losses.get)
    return best


def prose_queue(stage, log_dir, seeds, only, scale=None):
    """The (configuration, seed) pairs of a stage, in the order they should run. `scale` runs the rows at that
    learning-rate scale instead of their mode's best (a row's own sweep)."""
    if stage == "sweep":
        return [(name, "0") for name in PROSE_SWEEP if not only or name in only]
    best = {"vanilla": scale, "cplm": scale} if scale else best_scales(log_dir)  # --scale: no sweep needed
    rows = [row for row in PROSE_ROWS if not only or row in only]
    names = {row: f"prose_{row}_lr{scale or best[PROSE_ROWS[row][0]]}" for row in rows}
    headline = [r for r in rows if r in HEADLINE_ROWS]
    return ([(names[r], s) for r in headline for s in seeds]
            + [(names[r], s) for s in seeds for r in rows if r not in headline])


def ensure_corpora():
    """Builds the missing corpora; returns the tokenizer's exit code (it has said what went wrong) or 0."""
    if not os.path.exists(os.path.join(ROOT, "data/pystdlib/pystdlib_val_000000.bin")):
        rc = subprocess.run([sys.executable, "data/tokenize_corpus.py", "--stdlib", "--out_dir", "data/pystdlib",
                             "--name", "pystdlib"], cwd=ROOT).returncode
        if rc:
            return rc
    if not os.path.exists(os.path.join(ROOT, "data/pystdlib_bytes/pystdlib_bytes_val_000000.bin")):
        return subprocess.run([sys.executable, "data/tokenize_corpus.py", "--stdlib", "--encoding", "bytes",
                               "--out_dir", "data/pystdlib_bytes", "--name", "pystdlib_bytes"], cwd=ROOT).returncode
    return 0


def finished(log_path):
    return os.path.exists(log_path) and "\nfinal val_loss:" in open(log_path).read()


def continuation(log_dir, run_id):
    """Flags for a run that was stopped before its end (killed, or its machine went): resume from its newest checkpoint
    (the training script resumes exactly and appends to the log), or start it again over its partial log."""
    saved = sorted(glob.glob(os.path.join(ROOT, log_dir, run_id, "state_step*.pt")))
    if saved:
        return ["--resume", os.path.relpath(saved[-1], ROOT)]
    return ["--overwrite", "1"] if os.path.exists(os.path.join(ROOT, log_dir, run_id + ".txt")) else []


def main(argv=None):
    p = OneLineParser(prog="race.py", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default="", help="comma list of configuration names")
    p.add_argument("--study", choices=["race", "gate", "prose"], default="race")
    p.add_argument("--stage", choices=["sweep", "rows", "long"], default="sweep",
                   help="--study prose: the learning-rate sweep, every row at each mode's best scale, or the long "
                        "pair (records/prose_long)")
    p.add_argument("--scale", choices=LR_SCALES, default=None,
                   help="--stage rows: run the rows at this learning-rate scale instead of their mode's best")
    p.add_argument("--out", default=None, help="default records/race, records/gate_init or records/prose_race")
    p.add_argument("extra", nargs="*", help="more train_gpt_cplm flags for every run, after --")
    args = p.parse_args(argv)
    long_pair = args.study == "prose" and args.stage == "long"
    configs = LONG_CONFIGS if long_pair else {"race": CONFIGS, "gate": GATE_CONFIGS, "prose": PROSE_CONFIGS}[args.study]
    args.out = args.out or ("records/prose_long" if long_pair else {
        "race": "records/race", "gate": "records/gate_init", "prose": "records/prose_race"}[args.study])
    log_dir = os.path.join(args.out, "logs")
    names = args.only.split(",") if args.only else list(configs)
    if args.study == "gate":
        args.seeds = "0"
    # check the command line before the corpora are built (minutes) and runs started
    choices = PROSE_ROWS if args.study == "prose" and args.stage == "rows" else (
        PROSE_SWEEP if args.study == "prose" and args.stage == "sweep" else configs)
    unknown = [n for n in (args.only.split(",") if args.only else []) if n not in choices]
    if unknown:
        p.error(f"--only: unknown name(s) {', '.join(unknown)} for --study {args.study}"
                f"{' --stage ' + args.stage if args.study == 'prose' else ''}; choose from {', '.join(choices)}")
    if args.scale and not (args.study == "prose" and args.stage == "rows"):
        p.error("--scale goes with --study prose --stage rows")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1 (got {args.jobs})")
    if not all(s.strip().isdigit() for s in args.seeds.split(",")):
        p.error(f"--seeds must be integers separated by commas (got {args.seeds!r})")
    if args.study != "prose":
        rc = ensure_corpora()
        if rc:
            return rc
    seeds = [s.strip() for s in args.seeds.split(",")]
    if long_pair:
        pairs = [(name, seed) for name in names for seed in seeds]
    elif args.study == "prose":
        try:
            pairs = prose_queue(args.stage, log_dir, seeds, args.only.split(",") if args.only else [], args.scale)
        except ValueError as e:
            print(f"race.py: error: {e}", file=sys.stderr)
            return 1
    else:
        pairs = [(name, seed) for name in names for seed in seeds[:SEEDS_OF.get(name, 99)]]
    if args.study == "prose":  # the prose corpora these runs read (the V/D rows need their own builds)
        for vocab in sorted({f.split("/")[1][5:] for name, _ in pairs for f in configs[name] if f.startswith("data/prose")}):
            if not os.path.exists(os.path.join(ROOT, f"data/prose{vocab}/prose{vocab}_val_000000.bin")):
                print(f"race.py: error: no prose corpus of V = {vocab}: build it with "
                      f"`bash data/build_prose_corpus.sh --vocab_sizes {vocab}`", file=sys.stderr)
                return 1
    queue = []
    for name, seed in pairs:
        run_id = f"{name}_s{seed}"
        if not finished(os.path.join(ROOT, log_dir, run_id + ".txt")):
            # the prose study sets its own budget; RACE_FLAGS after it would cut it to 100 steps
            budget = [] if args.study == "prose" else RACE_FLAGS
            flags = [seed if x == "{seed}" else x for x in configs[name]]
            queue.append([sys.executable, "train_gpt_cplm.py", "--preset", "cpu", *budget, *flags,
                          "--seed", seed, "--run_id", run_id, "--log_dir", log_dir, *args.extra,
                          *continuation(log_dir, run_id)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = []
    t0 = time.time()
    while queue or running:
        while queue and len(running) < args.jobs:
            cmd = queue.pop(0)
            print(f"[{time.time() - t0:6.0f}s] start {cmd[cmd.index('--run_id') + 1]}", flush=True)
            running.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        time.sleep(2)
        for proc in [r for r in running if r.poll() is not None]:
            running.remove(proc)
            if proc.returncode:
                print(f"run failed ({proc.returncode}): {' '.join(proc.args)}", flush=True)
    if not long_pair:  # the long pair's read-out is experiments/long_report.py
        summarize(args.out, args.study, args.scale)
    return 0


def summarize(out, study, scale=None):
    if study == "prose":
        return summarize_prose(out, scale)
    compare = [sys.executable, "tools/compare.py"]
    lines = []
    groups = {"race": [("full", "cplm=0"), ("sw", "cplm=0"), ("bytes", "cplm=0")], "gate": [("gate", None)]}[study]
    for prefix, reference in groups:
        cmd = compare + [f"{out}/logs/{prefix}_*.txt", "--plot", f"{out}/{prefix}.png"]
        cmd += ["--target_from", reference] if reference else []
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        lines += [f"$ {' '.join(cmd[1:])}", res.stdout + res.stderr]
    open(os.path.join(ROOT, out, "summary.txt"), "w").write("\n".join(lines))
    print("\n".join(lines))


# the prose study's rows as (row, vanilla row, CPLM row) for experiments/race_report.py
PROSE_PAIRS = [("headline", "vanilla", "cplm"), ("pointer sentinel", "vanilla", "sentinel"),
               ("reordered data", "vanilla_reordered", "cplm_reordered"), ("open gate", "vanilla", "cplm_open"),
               ("stop-gradient", "vanilla", "cplm_stopgrad"), ("V = 2048 (V/D = 16)", "v2048_vanilla", "v2048_cplm"),
               ("V = 32768 (V/D = 256)", "v32768_vanilla", "v32768_cplm"),
               ("bytes (V = 257, D = 256)", "bytes_vanilla", "bytes_cplm")]


def summarize_prose(out, scale=None):
    """OUT/summary.md: the sweep and every row with finished runs of both of its modes (race_report.py)."""
    cmd = [sys.executable, "experiments/race_report.py", f"{out}/logs", "--sweep", "prose_vanilla_lr,prose_cplm_lr"]
    try:
        best = {"vanilla": scale, "cplm": scale} if scale else best_scales(os.path.join(out, "logs"))
    except ValueError as e:  # a sweep with a missing corner: a table of the sweep alone would replace the summary
        print(f"race.py: {out}/summary.md not rewritten: {e}")
        return 0
    both_finished = lambda v, c: all(finished(os.path.join(ROOT, out, "logs", f"{x}_s0.txt")) for x in (v, c))  # noqa: E731
    plots = []
    for name, vanilla, cplm in PROSE_PAIRS:
        v, c = (f"prose_{row}_lr{best[PROSE_ROWS[row][0]]}" for row in (vanilla, cplm))
        if both_finished(v, c):
            cmd += ["--pair", f"{name}={v}:{c}"]
            # the curves, mean over seeds (compare.py groups the runs by their hyperparameters)
            plots.append([sys.executable, "tools/compare.py", f"{out}/logs/{v}_s*.txt", f"{out}/logs/{c}_s*.txt",
                          "--target_from", "cplm=0", "--plot", f"{out}/{cplm}.png"])
    # a row's own sweep (--scale): the row again at each other scale where one of its own (non-headline) runs
    # ran off its mode's best; the headline's other scales are the sweep's table
    swept = lambda row, scale: row not in HEADLINE_ROWS and scale != best[PROSE_ROWS[row][0]]  # noqa: E731
    for name, vanilla, cplm in PROSE_PAIRS[1:]:
        for scale in LR_SCALES:
            v, c = (f"prose_{row}_lr{scale}" for row in (vanilla, cplm))
            if (swept(vanilla, scale) or swept(cplm, scale)) and both_finished(v, c):
                cmd += ["--pair", f"{name}, scale {scale}={v}:{c}"]
    cmd += ["--out", f"{out}/summary.md"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(res.stdout + res.stderr)
    for plot in plots:
        subprocess.run(plot, cwd=ROOT, capture_output=True)
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
