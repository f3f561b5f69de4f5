"""Peak memory (max RSS) of both modes at the cpu preset, as a user runs them: each mode a fresh process of
train_gpt_cplm.py, training and validating, repeated; the peak is the log's own `peak memory` line.

    python experiments/cpu_memory.py [--steps 50] [--repeats 2] [-- more train_gpt_cplm flags]

Prints one line per run and, per mode, the largest peak seen. Not a timed benchmark: other load on the
machine changes the times, not the memory (glibc's heap layout still varies from run to run, hence repeats).
"""
import os
import re
import subprocess
import sys
import tempfile

from cli import ROOT, OneLineParser  # experiments/cli.py


def peak_of(log_text):
    m = re.search(r"^peak memory \(max RSS of rank 0\): (\d+) MiB", log_text, re.M)
    return int(m.group(1)) if m else None


def main(argv=None):
    p = OneLineParser(prog="cpu_memory.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("extra", nargs="*", help="more train_gpt_cplm flags, after --")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    peaks = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as log_dir:
        for r in range(args.repeats):
            for mode in (0, 1):
                run_id = f"mem_cplm{mode}_{r}"
                cmd = [sys.executable, "train_gpt_cplm.py", "--preset", "cpu", "--cplm", str(mode),
                       "--num_iterations", str(args.steps), "--val_loss_every", str(max(args.steps // 2, 1)),
                       "--log_dir", log_dir, "--run_id", run_id, *args.extra]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if done.returncode:
                    print(f"cpu_memory.py: error: {' '.join(cmd[1:])} failed: {done.stderr.strip()[-300:]}",
                          file=sys.stderr)
                    return 1
                peak = peak_of(open(os.path.join(log_dir, run_id + ".txt")).read())
                peaks[mode].append(peak)
                print(f"cplm={mode} run {r}: peak RSS {peak} MiB ({args.steps} steps, 3 validations)", flush=True)
    for mode in (0, 1):
        print(f"{'CPLM' if mode else 'vanilla'}: largest peak RSS {max(peaks[mode])} MiB over {args.repeats} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
