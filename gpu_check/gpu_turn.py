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
    """$GPU_CHECK_MEMORY_FRACTION (first_call.py sets it where several jobs share the GPU): this process's share of
    the GPU's memory. The caching allocator keeps what a process's peak reserved until it exits, so three jobs
    that each reserved 45-55 GiB would not fit one card together; with a share, an allocator that reaches it frees
    its cache and tries again. Called before the allocator starts, with the training script's setting."""
    import torch
    fraction = os.environ.get("GPU_CHECK_MEMORY_FRACTION")
    if fraction and torch.cuda.is_available():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train_gpt_cplm.main
        torch.cuda.set_per_process_memory_fraction(float(fraction))
