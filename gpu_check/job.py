"""One training job of the GPU check: train_gpt_cplm.main as the script runs it, with the GPU turn taken once the
untimed warm-up is done, just before the clock starts (so a job's timed steps never share the GPU with another
job's); the lock is held until the job ends.

    python3 gpu_check/job.py --cplm 1 --num_iterations 40 ...     (train_gpt_cplm.py's flags)
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import kernel_parts  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402
from gpu_turn import limit_gpu_memory, take_turn  # noqa: E402


def main(argv=None):
    held = []  # the turn's lock, kept open until the process ends
    limit_gpu_memory()
    # the kernels this job compiles, by model part, for the A/B's profile (kernel_parts.py)
    kernel_parts.record_into(os.environ.get("KERNEL_PARTS_FILE") or kernel_parts.default_path())
    try:
        return tg.main(argv, before_clock=lambda: held.append(take_turn()))
    except tg.UsageError as e:
        print(f"job.py: error: {e} (see python3 train_gpt_cplm.py --help)", file=sys.stderr)
        return 2
    except tg.DataError as e:
        print(f"job.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C on a job run alone (the GPU check's jobs get SIGKILL): one line, as the script
        print("job.py: stopped by Ctrl-C (its log says so)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
