"""The device checks of the GPU check: versions, the GPU, a bf16 GEMM rate and an FP8 (_scaled_mm) smoke test, each
guarded (a failure is a line, not an end). first_call.py runs this as a job of its own with a time limit, so that a
hang here costs its lines, not the report; lines for the report start with REPORT.

    python3 gpu_check/device_checks.py [--dry_run]
"""
import platform
import subprocess
import sys
import time

import torch


def report(line):
    print(f"REPORT {line}", flush=True)


def timed(fn, device, repeats):
    """Seconds a call: CUDA events on a GPU, the wall clock on a CPU."""
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


def main(dry_run):
    device = "cpu" if dry_run else "cuda"
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
    return 0


if __name__ == "__main__":
    sys.exit(main("--dry_run" in sys.argv[1:]))
