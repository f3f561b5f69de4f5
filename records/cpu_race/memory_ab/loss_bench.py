"""Vanilla's loss on one cpu-preset micro-step (1024 x 50304 logits), forward and backward: the record's
F.cross_entropy of the soft-capped logits against VanillaLossCPU at several chunk sizes, alternating in one
process, 6 rounds, median per variant; the heap policy of the training script on.

    python records/cpu_race/memory_ab/loss_bench.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import train_gpt_cplm as tg  # noqa: E402

tg.import_cpu_head().use_heap_for_large_tensors()
N, V = 1024, 50304
u = torch.randn(1, N, V).requires_grad_()
t = torch.randint(0, V, (1, N))


def record():
    tg.vanilla_nll(u, t, 15.0).backward()
    u.grad = None


def chunked(rows):
    tg.import_cpu_head().VanillaLossCPU.apply(u, t, 15.0, rows).backward()
    u.grad = None


variants = {"record": record, **{f"chunk{r}": (lambda r=r: chunked(r)) for r in (16, 32, 64, 128)}}
for f in variants.values():
    f()
times = {k: [] for k in variants}
for _ in range(6):
    for k, f in variants.items():
        t0 = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t0)
for k, v in times.items():
    print(f"{k} median {sorted(v)[3] * 1000:.0f} ms")
