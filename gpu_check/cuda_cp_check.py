"""The CUDA CP loss against the dense reference, on the GPU, with the training settings (gpu_check/first_call.py).

cplm_target_log_prob with FlexAttention (compiled, as in training) on a packed 4096-token row of several
documents, with targets that never occur in their context, from a bf16 head output u soft-capped at 15, a
non-zero <copy> bias and bf16 queries and keys; against cplm_log_probs, the dense reference of the method
(full distributions, float32, one document at a time) on the same values. Values and gradients (u, q, k,
sink key, <copy> bias) within bf16 tolerances. Exit 0: pass; 1: a mismatch; 3: the flex CP path failed to
compile or run (first_call.py then times CPLM with --cp_backend dense and says so).

Then the candidate --cp_backend lse_kernel (cp_kernel.py, not the default; its result leaves the exit code alone):
its two sums and their gradients from the same bf16 q and k against the dense sums in float32 (the bf16 path the
CPU tests cannot run: Triton's interpreter has no working bf16 dot), and both CP backends' sums, forward and
backward, compiled and timed against each other on a 48Ki-token FineWeb-like row (the speedrun's row): the saving
the roofline puts at up to 0.40 ms a step (records/gpu/roofline.md).
"""
import functools
import os
import statistics
import sys
import threading
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import inference  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402
from gpu_turn import take_turn  # noqa: E402
from prepare_gpu_data import synthetic_tokens  # noqa: E402

BOS, COPY_ID, VP, CAP = 50256, 50257, 50304, 15.0
TIMING_T = 48 * 1024  # the CP sums timed on the speedrun's row
KERNEL_PART_S = 240  # the lse kernel's part at most: its check, both backends' compiles, the timing


def packed_row(T, generator):
    ids = torch.randint(0, 3000, (1, T), generator=generator)  # a small alphabet: most targets copyable
    ids[0, torch.randint(1, T, (T // 700,), generator=generator)] = BOS  # documents of ~700 tokens
    ids[0, 0] = BOS
    targets = torch.roll(ids, -1, 1)
    targets[0, ::97] = 45000  # never in any context
    return ids, targets


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def fast_path(u, q, k, sink, bias, ids, targets, fn):
    doc_ids = tg.doc_ids_of(ids, BOS)
    copyable = tg.target_in_context(ids, targets, doc_ids, VP)
    out = fn(u, q, k, sink, ids, targets, doc_ids, copyable, COPY_ID, bias, CAP, backend="flex")
    return out["log_p"], copyable


def reference(u, q, k, sink, bias, ids, targets):
    """log p(y) from the full mixture distribution, document by document, in float32."""
    z = tg.soft_cap(u, CAP)
    z = z.index_add(-1, torch.tensor([COPY_ID], device=z.device), bias.float().expand(*z.shape[:-1], 1))
    starts = (ids[0] == BOS).nonzero()[:, 0].tolist() + [ids.size(1)]
    parts = []
    for lo, hi in zip(starts, starts[1:]):
        log_p = inference.cplm_log_probs(z[:, lo:hi], q[:, lo:hi].float(), k[:, lo:hi].float(), sink.float(),
                                         ids[:, lo:hi], COPY_ID)
        parts.append(log_p.gather(-1, targets[:, lo:hi, None])[..., 0])
    return torch.cat(parts, 1)


def prepare_cp_sums_timing(dev, T=TIMING_T):
    """Both CP backends' sums (copy_lses), forward and backward, compiled as in training on a FineWeb-like row of T
    tokens (synthetic_tokens: documents of about 1140 tokens, up to 16Ki), each run once: {backend: one step}."""
    row = torch.from_numpy(synthetic_tokens(T + 1, np.random.default_rng(0)).astype(np.int64))[None, :T + 1].to(dev)
    ids, targets = row[:, :-1], row[:, 1:]
    doc_ids = tg.doc_ids_of(ids, BOS)
    copyable = tg.target_in_context(ids, targets, doc_ids, VP)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = ((torch.randn(1, T, 64, device=dev, generator=g) * 2).bfloat16().requires_grad_() for _ in range(2))
    grads = torch.randn(2, 1, T, device=dev, generator=g)
    steps = {}
    for backend in ("flex", "lse_kernel"):
        sums = torch.compile(functools.partial(tg.copy_lses, backend=backend), dynamic=False)

        def step(sums=sums):
            q.grad = k.grad = None
            torch.autograd.backward(sums(q, k, ids, targets, doc_ids, copyable), (grads[0], grads[1]))
        step()  # compiles
        steps[backend] = step
    synchronize(dev)
    return steps


def kernel_part(dev, ids, targets, q, k, exit_code):
    """The candidate lse_kernel, once the flex check has printed its result (a kernel fault can poison the CUDA
    context, so none may run before it): its line against the dense sums, then both CP backends' sums compiled
    (outside the turn) and timed in a GPU turn of its own. Past KERNEL_PART_S it says so and the process ends with
    the flex check's exit code, releasing the turn."""
    if dev.type != "cuda":
        print("lse kernel: not checked on a CPU (Triton's kernels need a CUDA GPU)")
        return

    def stop():
        print(f"lse kernel: stopped after {KERNEL_PART_S} s", flush=True)
        os._exit(exit_code)
    timer = threading.Timer(KERNEL_PART_S, stop)
    timer.daemon = True
    timer.start()
    try:
        print(lse_kernel_line(dev, ids, targets, q, k), flush=True)
        steps = prepare_cp_sums_timing(dev)
        turn = take_turn()
        try:
            for step in steps.values():  # warm-up in the turn: no GPU work of this job beside another's timed part
                step()
                step()
            print(timing_line(time_cp_sums(steps)), flush=True)
        finally:
            if turn is not None:
                turn.close()
    except Exception as e:
        traceback.print_exc()
        print(f"lse kernel: FAILED ({type(e).__name__}: {str(e)[:200]})", flush=True)
    finally:
        timer.cancel()


def time_cp_sums(steps, rounds=20, per_round=10):
    """Each backend's ms a step (forward and backward; per_round steps back to back between two CUDA events, so that
    the GPU's queue stays full), the backends alternating in order round by round: {backend: [ms, one a round]}."""
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_round):
                steps[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / per_round)
    return times


def lse_kernel_line(dev, ids, targets, q, k):
    """The candidate lse_kernel's two sums and their gradients (bf16 q and k as given) against the dense sums of
    the same values in float32, as a report line ending in ok or MISMATCH."""
    doc_ids = tg.doc_ids_of(ids, BOS)
    copyable = tg.target_in_context(ids, targets, doc_ids, VP)
    weights = torch.rand(2, *ids.shape, generator=torch.Generator().manual_seed(1)).to(dev)
    results = []
    for backend, (q_in, k_in) in (("lse_kernel", leaves(q, k)), ("dense", leaves(q.float(), k.float()))):
        lse_doc, lse_match = tg.copy_lses(q_in, k_in, ids, targets, doc_ids, copyable, backend)
        (lse_doc * weights[0] + lse_match * weights[1]).sum().backward()
        results.append((lse_doc, lse_match, q_in.grad, k_in.grad))
    parts, ok = [], True
    for name, a, b, tolerance in zip(("lse_doc", "lse_match", "dq", "dk"), *results, (1e-4, 1e-4, 2e-2, 2e-2)):
        a, b = a.float(), b.float()
        relative = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        ok &= bool(torch.isfinite(a).all()) and relative <= tolerance
        parts.append(f"{name} {relative:.1e} (<= {tolerance:g})")
    return (f"lse kernel ({str(q.dtype).split('.')[-1]} q, k; T={ids.size(1)}) against the dense sums, |kernel - "
            f"dense| / |dense|: " + ", ".join(parts) + (" ok" if ok else " MISMATCH"))


def timing_line(times, T=TIMING_T):
    """The CP sums' time per backend (time_cp_sums' rounds on a row of T tokens) as a report line."""
    flex, kernel = (statistics.median(times[b]) for b in ("flex", "lse_kernel"))
    ratios = sorted(a / b for a, b in zip(times["lse_kernel"], times["flex"]))
    return (f"CP sums forward + backward on a {T // 1024}Ki-token row, compiled (median of {len(ratios)} alternating "
            f"rounds): flex {flex:.3f} ms, lse_kernel {kernel:.3f} ms, the kernel saves {flex - kernel:.3f} ms a row "
            f"(kernel / flex {statistics.median(ratios):.3f}, the rounds' range {ratios[0]:.3f}-{ratios[-1]:.3f})")


def synchronize(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main(device="cuda", T=4096, compile_backend="inductor"):
    """The test suite runs this on CPU (T=512, backend aot_eager), so that the GPU check runs a working script."""
    started = time.perf_counter()
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    d = 64
    ids, targets = packed_row(T, g)
    u = (torch.randn(1, T, VP, generator=g) * 4).bfloat16()
    q, k = (torch.randn(1, T, d, generator=g) * 2).bfloat16(), (torch.randn(1, T, d, generator=g) * 2).bfloat16()
    sink, bias = torch.randn(d, generator=g), torch.tensor(2.5)
    ids, targets = ids.to(dev), targets.to(dev)
    inputs = [t.to(dev) for t in (u, q, k, sink, bias)]
    weights = torch.rand(1, T, generator=g).to(dev)  # a random linear function of log p: every gradient differs
    compiled = torch.compile(tg.cplm_target_log_prob, dynamic=False, backend=compile_backend)
    try:
        t0 = time.perf_counter()
        warm, _ = fast_path(*leaves(*inputs), ids, targets, compiled)  # compiles the forward...
        (warm * weights).sum().backward()  # ...and the backward, which compiles lazily at its first call
        synchronize(dev)
        compile_s = time.perf_counter() - t0
        gpu_turn = take_turn()  # first_call.py: the timed part takes its turn on the GPU
        fast_in = leaves(*inputs)
        synchronize(dev)
        t0 = time.perf_counter()
        fast, copyable = fast_path(*fast_in, ids, targets, compiled)
        (fast * weights).sum().backward()
        synchronize(dev)
        fast_ms = 1000 * (time.perf_counter() - t0)
    except Exception as e:  # the escape hatch: report, and let the timing runs use the dense CP path
        traceback.print_exc()
        print(f"flex CP path FAILED ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return 3
    ref_in = leaves(*inputs)  # the reference runs on the GPU too: it keeps the turn, so no timed loop shares it
    ref = reference(*ref_in, ids, targets)
    (ref * weights).sum().backward()
    synchronize(dev)
    if gpu_turn is not None:
        gpu_turn.close()
    ok = True

    def check(name, a, b, rtol, atol, norm_rtol=None):
        """Elementwise within atol + rtol |b|; a gradient also within norm_rtol of |b| as a whole (a kernel that
        scales a gradient by 0.95 stays inside the elementwise bounds; one bf16 rounding is about 0.4%)."""
        nonlocal ok
        a, b = a.float(), b.float()
        finite = bool(torch.isfinite(a).all())
        relative = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        passed = finite and bool(((a - b).abs() <= atol + rtol * b.abs()).all()) and relative <= (norm_rtol or 1)
        ok &= passed
        print(f"{name:>14}: max |flex - reference| {(a - b).abs().max().item():.3e} (max |reference| "
              f"{b.abs().max().item():.3e}), |flex - reference| / |reference| {relative:.2e} finite={finite} "
              f"{'ok' if passed else 'MISMATCH'}")

    print(f"T={T} d={d} documents={int((ids == BOS).sum())} copyable share={copyable.float().mean().item():.3f} "
          f"softcap={CAP} <copy> bias={bias.item()} q/k bf16, u bf16")
    check("log p(y)", fast, ref, 2e-2, 2e-2)
    for name, a, b in zip(["u", "q", "k", "sink key", "<copy> bias"], fast_in, ref_in):
        scale = b.grad.abs().max().item()
        check("d/d " + name, a.grad, b.grad, 5e-2, 2e-2 * scale, norm_rtol=2e-2)
    print(f"compile (forward and backward) {compile_s:.1f} s; flex fwd+bwd after it {fast_ms:.1f} ms")
    print("cuda cp check:", "PASS" if ok else "FAIL")
    # first_call.py's turn watchdog stops at this line: the candidate's part below guards its own time
    print(f"done in {time.perf_counter() - started:.0f} s: the flex check; the lse kernel's lines follow", flush=True)
    kernel_part(dev, ids, targets, inputs[1], inputs[2], exit_code=0 if ok else 1)
    return 0 if ok else 1


if __name__ == "__main__":
    if "--dry_run" in sys.argv[1:]:  # first_call.py --dry_run: the same check on CPU (FlexAttention's math path)
        import torch.nn.attention.flex_attention as flex_module
        flex_module._validate_device = lambda *args, **kwargs: None
        sys.exit(main("cpu", T=512, compile_backend="aot_eager"))
    sys.exit(main())
