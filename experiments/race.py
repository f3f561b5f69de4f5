"""The real-text race on CPU: vanilla vs CPLM on the Python standard library's source (GPT-2 BPE, V >> D).

    python experiments/race.py [--jobs 2] [--seeds 0,1,2] [--only NAME,...] [--out records/race]

Runs the `cpu` preset of train_gpt_cplm.py (4 x 128, 2048 tokens a step; 100 steps) in these configurations, each
seed a separate run (one thread each, --jobs at a time), logs in OUT/logs/:
  full_{vanilla,cplm}    full attention over the 1024-token rows
  sw_{vanilla,cplm}      a sliding window of 128 tokens
  full_cplm_stopgrad     ablation: no gradient from the CP head into the backbone
  bytes_{vanilla,cplm}   control: byte-level tokens (V = 257 < D = 320), where the paper finds no gain
Then writes OUT/summary.txt (records/compare.py per attention type, convergence ratio against vanilla's
final val loss) and OUT/{full,sw,bytes}.png. Runs whose log already ends with a final line are not run
again. `--study gate` runs GATE_CONFIGS instead (records/gate_init): the choice of optimizer and gate start.
`--study prose` runs PROSE_CONFIGS (records/prose_race): the race on English prose at the paper's V/D.
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
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
# the training rows. Both modes get the same sweep of learning-rate scales (every rate times the scale,
# seed 0); the headline then runs each mode's best scale on 3 seeds. The gate starts closed (the default);
# prose_cplm_open_* starts it half open, a separate row.
PROSE = ["--train_files", "data/prose8192/prose8192_train_*.bin", "--val_files", "data/prose8192/prose8192_val_*.bin",
         "--val_seq_len", "1024", "--num_iterations", "1000", "--val_loss_every", "50", "--val_tokens", "32768"]
CPU_LRS = {"lr_embed": 0.6, "lr_head": 0.008, "lr_scalar": 0.04, "lr_muon": 0.04, "lr_cp": 0.008}  # the cpu preset's
LR_SCALES = ("0.5", "1", "2")


def scaled_lrs(scale):
    return [x for name, lr in CPU_LRS.items() for x in (f"--{name}", f"{lr * float(scale):g}")]


PROSE_CONFIGS = {f"prose_{mode}_lr{scale}": ["--cplm", str(cplm), *scaled_lrs(scale), *PROSE]
                 for scale in LR_SCALES for mode, cplm in (("vanilla", 0), ("cplm", 1))}
PROSE_CONFIGS.update({f"prose_cplm_open_lr{scale}": ["--cplm", "1", "--copy_gate_init", "0.5", *scaled_lrs(scale),
                                                     *PROSE] for scale in LR_SCALES})


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


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv=None):
    p = OneLineParser(prog="race.py", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default="", help="comma list of configuration names")
    p.add_argument("--study", choices=["race", "gate", "prose"], default="race")
    p.add_argument("--out", default=None, help="default records/race, records/gate_init or records/prose_race")
    p.add_argument("extra", nargs="*", help="more train_gpt_cplm flags for every run, after --")
    args = p.parse_args(argv)
    configs = {"race": CONFIGS, "gate": GATE_CONFIGS, "prose": PROSE_CONFIGS}[args.study]
    args.out = args.out or {"race": "records/race", "gate": "records/gate_init", "prose": "records/prose_race"}[args.study]
    log_dir = os.path.join(args.out, "logs")
    names = args.only.split(",") if args.only else list(configs)
    if args.study == "gate":
        args.seeds = "0"
    # check the command line before the corpora are built (minutes) and runs started
    unknown = [n for n in names if n not in configs]
    if unknown:
        p.error(f"--only: unknown configuration(s) {', '.join(unknown)} for --study {args.study}; "
                f"choose from {', '.join(configs)}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1 (got {args.jobs})")
    if not all(s.strip().isdigit() for s in args.seeds.split(",")):
        p.error(f"--seeds must be integers separated by commas (got {args.seeds!r})")
    if args.study == "prose":
        if not os.path.exists(os.path.join(ROOT, "data/prose8192/prose8192_val_000000.bin")):
            print("race.py: error: no prose corpus: build it with `bash data/build_prose_corpus.sh`", file=sys.stderr)
            return 1
    else:
        rc = ensure_corpora()
        if rc:
            return rc
    queue = []
    for name in names:
        for seed in args.seeds.split(",")[:SEEDS_OF.get(name, 99)]:
            run_id = f"{name}_s{seed}"
            if not finished(os.path.join(ROOT, log_dir, run_id + ".txt")):
                queue.append([sys.executable, "train_gpt_cplm.py", "--preset", "cpu", *configs[name], "--seed", seed,
                              "--run_id", run_id, "--log_dir", log_dir, *RACE_FLAGS, *args.extra])
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
    summarize(args.out, args.study)
    return 0


def summarize(out, study):
    compare = [sys.executable, "records/compare.py"]
    lines = []
    groups = {"race": [("full", "cplm=0"), ("sw", "cplm=0"), ("bytes", "cplm=0")], "gate": [("gate", None)],
              "prose": [("prose", None)]}[study]
    for prefix, reference in groups:
        cmd = compare + [f"{out}/logs/{prefix}_*.txt", "--plot", f"{out}/{prefix}.png"]
        cmd += ["--target_from", reference] if reference else []
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        lines += [f"$ {' '.join(cmd[1:])}", res.stdout + res.stderr]
    open(os.path.join(ROOT, out, "summary.txt"), "w").write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
