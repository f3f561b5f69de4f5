"""The GPU turn: the GPU check's jobs compile side by side and take turns for their timed parts, through one file
lock that first_call.py names in $GPU_CHECK_TURN (unset: no turn to take, as in a run of one job alone)."""
import fcntl
import os


def take_turn():
    """Waits for the lock and returns it held (released when closed, or when the process ends); None without
    $GPU_CHECK_TURN. Says 'gpu turn taken' on stdout: first_call.py times a job's turn from that line."""
    path = os.environ.get("GPU_CHECK_TURN")
    if not path:
        return None
    turn = open(path, "a")
    fcntl.flock(turn, fcntl.LOCK_EX)
    print("gpu turn taken", flush=True)
    return turn


def limit_gpu_memory():
    """Caps this process's caching allocator at $GPU_CHECK_MEMORY_GIB GiB (first_call.py sets it for each training
    job from what the job needs, so that the jobs side by side fit the card; unset: no cap). The allocator keeps what
    a process's peak reserved until it exits, so jobs that each reserved 45-55 GiB would not fit one card together;
    capped, an allocator that reaches its cap frees its cache and tries again. The GiB become a fraction of this
    card's total memory here, where the job runs (at most all of it). Called before the allocator starts, with the
    training script's setting."""
    import torch
    gib = os.environ.get("GPU_CHECK_MEMORY_GIB")
    if gib and torch.cuda.is_available():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train_gpt_cplm.main
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib) * 2 ** 30 / total))
