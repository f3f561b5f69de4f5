"""The interleaved A/B: vanilla and CPLM (or the pointer sentinel) built and compiled in one process as
train_gpt_cplm.train builds them, their training steps then alternated on the same batches, each step timed (CUDA
events on a GPU, the wall clock on a CPU). No process-to-process offset enters the ratio, and a drift of the card's
speed meets both modes alike; its 95% interval comes from a moving-block bootstrap over rounds, so the steps'
autocorrelation is kept. Each step is split into forward, backward and optimizer by events between them (the GPU's
time per phase, the host's time issuing it, and whether the GPU had run out of work by the phase's end), each
mode's difference to the baseline with the same interval. Then a profile of a few steps of each mode
(torch.profiler), reduced to a small table.

    python3 gpu_check/interleaved.py --modes vanilla,cplm_loss,cplm --rounds_s 90 --end_in_s 540 -- <flags>

Mode cplm_loss is vanilla trained through CPLM's form of the LM head's loss with no CP head: with it, CPLM's extra
time splits into the loss's part and the CP head's (its two sums and the mixture included). Mode cplm_kernel is
CPLM with its two sums in cp_kernel.py's kernel (--cp_backend lse_kernel, CUDA only): --modes cplm,cplm_kernel
measures what the kernel saves a step.

The first mode is the baseline: each other mode's ratio is to it. The rounds sample the flags' schedule
(--num_iterations, the record's 1770 by default) evenly: round r trains at step r x num_iterations / R, so the
attention window, learning rates and momentum cover the whole run, as a run's average step does. Each round runs
every mode once, the order rotated each round and reversed every other cycle (each mode in each place equally
often), with no host sync inside it (as in training) and one at its end. Lines for
the report start with REPORT (first_call.py copies them into report.txt as they come); the GPU turn
(gpu_turn.py) is taken for the rounds and the profile.
"""
import argparse
import collections
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import kernel_parts  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402
from gpu_turn import limit_gpu_memory, take_turn  # noqa: E402

MODES = {"vanilla": dict(cplm=0), "cplm_loss": dict(cplm=0), "cplm": dict(cplm=1, copy_gate="lm"),
         "sentinel": dict(cplm=1, copy_gate="sentinel"),
         "cplm_kernel": dict(cplm=1, copy_gate="lm", cp_backend="lse_kernel")}
PHASES = ("forward", "backward", "optimizer")


class VanillaThroughCPLMLoss(tg.GPT):
    """Mode cplm_loss: vanilla's model and vanilla's loss value, computed as CPLM computes the LM head's part of its
    loss (HeadLoss.terms: the log-sum-exp without <copy>, the <copy> logit, the target's; logaddexp of the first two
    minus the third is vanilla's cross-entropy), with no CP head. CPLM's extra time then splits in two measured
    parts: cplm_loss - vanilla (the loss's form) and cplm - cplm_loss (the CP head, its sums, the mixture)."""

    def forward(self, input_ids, target_ids, window_blocks=None):
        h, _ = self.hidden_states(input_ids, window_blocks)
        lse_without_copy, z_copy, z_y = self.head_loss.terms(self.lm_head, h, target_ids)  # as GPT.forward's CPLM
        return (torch.logaddexp(lse_without_copy, z_copy) - z_y).mean()


def report(line):
    print(f"REPORT {line}", flush=True)


class Mode:
    """One mode as train_gpt_cplm.train builds it (the FP8 head where the GPU has FP8 matmuls, the head's loss
    written for inductor when compiled, bf16 embeddings on CUDA, the FP8 gradient scale under accumulation, the
    record's optimizers) and its training step as train's train_step, at world size 1."""

    def __init__(self, name, a, device):
        self.a, self.device = a, device
        fp8_head = tg.use_fp8_head(a.fp8_head, device)
        compile_model = a.compile == 1 or (a.compile == -1 and device.type == "cuda")
        self.grad_accum = a.batch_size // a.seq_len
        torch.manual_seed(a.seed)
        model_class = VanillaThroughCPLMLoss if name == "cplm_loss" else tg.GPT
        model = model_class(tg.GPTConfig.from_args(a, fp8_head=int(fp8_head))).to(device)
        if compile_model:
            model.head_loss = tg.HeadLoss(a.logit_softcap, model.config.copy_id)
        if device.type == "cuda":
            for m in model.modules():
                if isinstance(m, nn.Embedding):
                    m.bfloat16()
        if fp8_head and self.grad_accum > 1:
            x_scale, w_scale, grad_scale = model.lm_head.fp8_scales
            model.lm_head.fp8_scales = (x_scale, w_scale, grad_scale * self.grad_accum)
        self.adam, self.muon = tg.build_optimizers(model, a, 0, 1, compiled=compile_model)
        self.reduce_order = [p for g in self.muon.param_groups for p in g["params"]] + \
                            [p for g in reversed(self.adam.param_groups) for p in g["params"]]
        self.model, self.compiled = model, (torch.compile(model, dynamic=False) if compile_model else model)
        self.windows = {}

    def step(self, step, batch, clock=None):
        """One optimizer step on batch ([(inputs, targets)] micro-steps); returns the loss, not read (no sync).
        clock: a PhaseClock, marked at the step's start and at the end of each forward, backward and the optimizer."""
        mark = clock.mark if clock is not None else (lambda phase: None)
        mark("start")
        a = self.a
        w = tg.window_blocks(step, a)
        if w not in self.windows:
            self.windows[w] = torch.full((), w, dtype=torch.int32, device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        for inputs, targets in batch:
            loss = self.compiled(inputs, targets, self.windows[w]) / self.grad_accum
            mark("forward")
            loss.backward()
            mark("backward")
            loss_sum += loss.detach()
        pending = tg.reduce_gradients(self.reduce_order, 1)
        for opt in (self.adam, self.muon):
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * tg.lr_multiplier(step, a)
        warm = min(step / max(a.muon_momentum_warmup_steps, 1), 1)
        for group in self.muon.param_groups:
            group["momentum"] = (1 - warm) * 0.85 + warm * a.muon_momentum
        self.muon.step(wait_for_gradient=pending.wait)
        self.adam.step()
        self.model.zero_grad(set_to_none=True)
        mark("optimizer")
        return loss_sum


class PhaseClock:
    """Marks in one step: a CUDA event on the GPU's timeline (no sync) and the host's clock at each. After a sync,
    phase_ms gives each phase's time, summed over micro-steps: on the GPU, what the stream spent between the marks
    (waiting for the host included); on the host, what issuing the phase took (Python, launches, and any wait for
    room in a full launch queue: so the host's time alone cannot say who waits). Whether the GPU waited is read at
    each mark: the previous mark's event already done (a non-blocking query) means the GPU had run out of work,
    the host behind it. On a CPU both times are the wall clock."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []  # (phase that ends here, host seconds, CUDA event or None, the GPU idle at this mark)

    def mark(self, phase):
        event, starved = None, False
        if self.cuda:
            starved = bool(self.marks) and self.marks[-1][2].query()  # all issued work done: the GPU waits
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((phase, time.perf_counter(), event, starved))

    def total_ms(self):
        (_, t0, e0, _), (_, t1, e1, _) = self.marks[0], self.marks[-1]
        return e0.elapsed_time(e1) if self.cuda else 1000 * (t1 - t0)

    def phase_ms(self):
        """{phase: (GPU ms, host ms, 1 if the GPU was found idle at the phase's end, else 0)} for PHASES."""
        out = {phase: [0.0, 0.0, 0] for phase in PHASES}
        for (_, t0, e0, _), (phase, t1, e1, starved) in zip(self.marks, self.marks[1:]):
            out[phase][0] += e0.elapsed_time(e1) if self.cuda else 1000 * (t1 - t0)
            out[phase][1] += 1000 * (t1 - t0)
            out[phase][2] = max(out[phase][2], int(starved))
        return {phase: tuple(v) for phase, v in out.items()}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def round_order(order, r):
    """The modes' order in round r: rotated by one each round and reversed every other cycle, so that each mode
    takes each place equally often (the first step of a round starts on an idle GPU after the round's sync; with
    three modes, reversing alone would never put the middle one first)."""
    k = len(order)
    rotated = order[r % k:] + order[:r % k]
    return rotated[::-1] if (r // k) % 2 else rotated


def timed_round(modes, order, step, batch, device):
    """Each mode's step on the same batch, in this order, with no host sync between them: {mode: (ms, loss,
    PhaseClock.phase_ms())}. CUDA events time each step on the GPU's own timeline (what it spent on the step,
    host-bound gaps included)."""
    clocks, losses = {}, {}
    for name in order:
        clocks[name] = PhaseClock(device)
        losses[name] = modes[name].step(step, batch, clocks[name])
    synchronize(device)
    return {name: (clock.total_ms(), losses[name], clock.phase_ms()) for name, clock in clocks.items()}


def block_length(rounds):
    """Rounds per bootstrap block: sqrt(R) (14 at 200 rounds), long enough for the lag-1 autocorrelation of
    0.16-0.55 measured within one process on the H200 (0.55^14: nothing left), short enough to draw many blocks."""
    return max(1, math.ceil(math.sqrt(rounds)))


def block_resamples(n, block, resamples=2000, seed=0):
    """(resamples, n) indices of a moving-block bootstrap over n rounds: runs of `block` consecutive rounds drawn
    with replacement until n are drawn (a round's steps stay together, and so does the autocorrelation inside a
    block)."""
    block = min(block, n)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - block + 1, size=(resamples, math.ceil(n / block)))
    return (starts[:, :, None] + np.arange(block)).reshape(resamples, -1)[:, :n]


def block_bootstrap_ratio(num, den, block, resamples=2000, seed=0):
    """The 95% interval of sum(num) / sum(den) from a moving-block bootstrap over rounds: the 2.5th and 97.5th
    percentiles of the resampled ratios."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    index = block_resamples(len(num), block, resamples, seed)
    return tuple(np.percentile(num[index].sum(1) / den[index].sum(1), [2.5, 97.5]))


def block_bootstrap_difference(x, y, block, resamples=2000, seed=0):
    """The 95% interval of mean(x) - mean(y), x and y measured in the same rounds, by the same bootstrap."""
    d = np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)
    index = block_resamples(len(d), block, resamples, seed)
    return tuple(np.percentile(d[index].mean(1), [2.5, 97.5]))


def lag1_autocorrelation(x):
    x = np.asarray(x, dtype=np.float64) - np.mean(x)
    return float((x[1:] * x[:-1]).sum() / (x * x).sum()) if len(x) > 2 and (x * x).sum() > 0 else float("nan")


def ratio_lines(base, mode, times, losses, steps_sampled, device):
    """The report's ratio line, exactly `MODE/BASE step time ratio (interleaved, R rounds): X.XXX [LO, HI]`, and a
    line of what is behind it."""
    num, den = np.array(times[mode]), np.array(times[base])
    R, block = len(num), block_length(len(num))
    lo, hi = block_bootstrap_ratio(num, den, block)
    clock = "CUDA events" if device.type == "cuda" else "the wall clock (CPU)"
    ratio = num.sum() / den.sum()
    return [f"{mode}/{base} step time ratio (interleaved, {R} rounds): {ratio:.3f} [{lo:.3f}, {hi:.3f}]",
            f"  {base} {den.mean():.2f} ms, {mode} {num.mean():.2f} ms a step (means over {R} rounds, each step timed "
            f"with {clock}, the order rotated each round, each mode in each place equally often; steps "
            f"{steps_sampled[0]}-{steps_sampled[-1]} of the "
            f"schedule); 95% interval: moving-block bootstrap over rounds, blocks of {block}, 2000 resamples; lag-1 "
            f"autocorrelation of the steps: {base} {lag1_autocorrelation(den):.2f}, {mode} "
            f"{lag1_autocorrelation(num):.2f}; train loss at the first and last round: {base} "
            f"{losses[base][0]:.3f} -> {losses[base][-1]:.3f}, {mode} {losses[mode][0]:.3f} -> {losses[mode][-1]:.3f}"]


def phase_lines(names, phases, device):
    """The per-phase table: each mode's forward, backward, optimizer and whole step in ms (means over rounds, the
    GPU's timeline; in parentheses the host's time issuing it and the share of rounds in which the GPU had run out
    of work by the phase's end: the host's wait, not the GPU's), each mode minus the baseline with its 95% interval;
    and, with cplm_loss and cplm both measured, CPLM's extra split into the loss's form and the CP head's part.
    phases: {mode: {phase: [(GPU ms, host ms, GPU idle at the end: 0 or 1)] a round}}."""
    base, others = names[0], names[1:]
    R = len(phases[base][PHASES[0]])
    block = block_length(R)
    gpu, host, idle = ({n: {ph: np.array([x[i] for x in phases[n][ph]], dtype=float) for ph in PHASES} for n in names}
                       for i in range(3))
    for n in names:
        gpu[n]["step"], host[n]["step"] = sum(gpu[n][ph] for ph in PHASES), sum(host[n][ph] for ph in PHASES)
        idle[n]["step"] = np.maximum.reduce([idle[n][ph] for ph in PHASES])

    def cell(n, ph):
        g, h, i = gpu[n][ph].mean(), host[n][ph].mean(), idle[n][ph].mean()
        return f"{g:.2f} ({h:.2f}, GPU idle {100 * i:.0f}%)" if device.type == "cuda" else f"{g:.2f}"

    def diff(x, y, ph):
        lo, hi = block_bootstrap_difference(gpu[x][ph], gpu[y][ph], block)
        return f"{gpu[x][ph].mean() - gpu[y][ph].mean():+.2f} [{lo:+.2f}, {hi:+.2f}]"

    clock = ("on the GPU's timeline; in parentheses the host's time issuing it and the share of rounds in which the "
             "GPU had run out of work by its end") if device.type == "cuda" else "the wall clock (CPU)"
    lines = [f"phases, ms a step (means over {R} rounds, {clock}); "
             f"each mode - {base} with its 95% interval (moving-block bootstrap, blocks of {block}):",
             "  | phase | " + " | ".join(names) + " | " + " | ".join(f"{n} - {base}" for n in others) + " |"]
    for ph in PHASES + ("step",):
        lines.append(f"  | {ph} | " + " | ".join(cell(n, ph) for n in names) + " | "
                     + " | ".join(diff(n, base, ph) for n in others) + " |")
    if base == "vanilla" and {"cplm_loss", "cplm"} <= set(names):
        lines.append(f"  CPLM's extra a step, {diff('cplm', 'vanilla', 'step')} ms: the LM head's loss in CPLM's form "
                     f"(cplm_loss - vanilla) {diff('cplm_loss', 'vanilla', 'step')}, the CP head, its two sums and "
                     f"the mixture (cplm - cplm_loss) {diff('cplm', 'cplm_loss', 'step')}")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# The profile: a few steps of each mode under torch.profiler, reduced to a table

def trace_events(prof, device):
    """[(name, start us, duration us, thread)] of what did the work: CUDA kernels, copies and sets on a GPU; on a
    CPU, its operators (nested; self_times takes the nesting apart). Read from the chrome trace, the profiler's
    most stable output across torch versions."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if device.type == "cuda" else ("cpu_op",)
    return [(e["name"], float(e["ts"]), float(e["dur"]), e.get("tid")) for e in events
            if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e]


def self_times(events):
    """Each event's own time, its children's (events inside it on the same thread) taken out: [(name, us)]; and the
    union of all events' intervals (the time something was running), in us."""
    out, busy = [], 0.0
    for tid in {e[3] for e in events}:
        stack = []  # [name, end, self time], innermost last
        covered_to = -math.inf
        for name, ts, dur, _ in sorted((e for e in events if e[3] == tid), key=lambda e: (e[1], -e[2])):
            while stack and stack[-1][1] <= ts:
                out.append(tuple(stack.pop()[::2]))
            if stack:
                stack[-1][2] -= dur
            stack.append([name, ts + dur, dur])
            busy += max(0.0, ts + dur - max(ts, covered_to))
            covered_to = max(covered_to, ts + dur)
        out += [tuple(s[::2]) for s in stack]
    return out, busy


def kernel_name(name):
    """Inductor numbers its kernels per graph (triton_poi_fused_add_mul_3): the number dropped, so that the same
    kernel in both modes' graphs is one row."""
    head, _, tail = name.rpartition("_")
    return head if tail.isdigit() and head.startswith("triton") else name


def reduce_profile(events, steps, wall_ms, parts=None):
    """{'kernels': {name: (ms a step, launches a step)}, 'busy': ms a step, 'wall': ms a step, 'parts': {model part:
    ms a step}} from one mode's trace of `steps` steps; parts: kernel_parts.read_parts's map (None: no grouping)."""
    own, busy_us = self_times(events)
    kernels, by_part = {}, collections.Counter()
    for name, us in own:
        ms, n = kernels.get(kernel_name(name), (0.0, 0))
        kernels[kernel_name(name)] = (ms + us / 1000 / steps, n + 1 / steps)
        if parts is not None:
            by_part[kernel_parts.part_of_kernel(name, parts)] += us / 1000 / steps
    return {"kernels": kernels, "busy": busy_us / 1000 / steps, "wall": wall_ms / steps, "parts": dict(by_part)}


def profile_table(profiles, base, mode, device, steps, top=10):
    """The profile's lines: each mode's step, its busy time and idle gaps; the top kernels; what only `mode` runs;
    the shared kernels' difference."""
    what = "CUDA kernels" if device.type == "cuda" else "CPU operators (a dry run: the same code path)"
    lines = [f"profile: {steps} steps a mode after the rounds, {what}; ms a step"]
    for name in (base, mode):
        p = profiles[name]
        idle = p["wall"] - p["busy"]
        launches = sum(n for _, n in p["kernels"].values())
        traced = " (the host's operators traced too: gaps overstated)" if p.get("host_traced") else ""
        bound = "host-bound gaps" if idle > 0.05 * p["wall"] else "not host-bound"
        lines.append(f"  {name}: step {p['wall']:.2f} ms, busy {p['busy']:.2f} ms, idle {idle:.2f} ms{traced} "
                     f"({100 * idle / max(p['wall'], 1e-9):.1f}%: {bound}), "
                     f"{launches:g} launches a step, {len(p['kernels'])} distinct")
    a, b = profiles[base]["kernels"], profiles[mode]["kernels"]
    lines.append(f"  | kernel | {base} ms | {mode} ms | {mode} - {base} |")
    for name in sorted(set(a) | set(b), key=lambda k: -max(a.get(k, (0,))[0], b.get(k, (0,))[0]))[:top]:
        x, y = a.get(name, (0.0, 0))[0], b.get(name, (0.0, 0))[0]
        lines.append(f"  | {name[:70]} | {x:.3f} | {y:.3f} | {y - x:+.3f} |")
    def largest(kernels):
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:5]
        return (": " + ", ".join(f"{k[:50]} {v[0]:.3f}" for k, v in top)) if top else ""

    only = {k: v for k, v in b.items() if k not in a}
    lines.append(f"  kernels only {mode} runs: {len(only)}, {sum(v[1] for v in only.values()):g} launches, "
                 f"{sum(v[0] for v in only.values()):.3f} ms a step" + largest(only))
    gone = {k: v for k, v in a.items() if k not in b}
    lines.append(f"  kernels only {base} runs: {len(gone)}, {sum(v[0] for v in gone.values()):.3f} ms a step"
                 + largest(gone))
    shared = set(a) & set(b)
    x, y = sum(a[k][0] for k in shared), sum(b[k][0] for k in shared)
    lines.append(f"  kernels both run: {len(shared)}, {base} {x:.3f} ms, {mode} {y:.3f} ms a step, "
                 f"difference {y - x:+.3f} ms")
    pa, pb = profiles[base].get("parts") or {}, profiles[mode].get("parts") or {}
    if pa or pb:
        lines.append(f"  by model part (each kernel's part recorded when inductor generated it): | part | {base} ms "
                     f"| {mode} ms | {mode} - {base} |")
        for part in sorted(set(pa) | set(pb), key=lambda k: -abs(pb.get(k, 0) - pa.get(k, 0))):
            lines.append(f"  | {part} | {pa.get(part, 0):.3f} | {pb.get(part, 0):.3f} | "
                         f"{pb.get(part, 0) - pa.get(part, 0):+.3f} |")
    return lines


def profile_mode(mode, step, batch, steps, device, parts=None):
    """`steps` steps of one mode under torch.profiler (after the rounds: warm): its reduced profile. On a GPU only
    the kernels are traced (CUPTI), so that the host is not slowed and the idle gaps are the step's own; if that
    trace holds no kernels, the host's operators are traced as well, which the result says."""
    from torch.profiler import ProfilerActivity, profile
    tries = [[ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]] if device.type == "cuda" \
        else [[ProfilerActivity.CPU]]
    for activities in tries:
        synchronize(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                mode.step(step, batch)
            synchronize(device)
            wall_ms = 1000 * (time.perf_counter() - t0)
        events = trace_events(prof, device)
        if events:
            break
    result = reduce_profile(events, steps, wall_ms, parts if device.type == "cuda" else None)
    result["host_traced"] = device.type == "cuda" and len(activities) == 2  # its idle gaps then overstated
    return result


# ----------------------------------------------------------------------------------------------------------------

def device_for_run():
    """The device as train_gpt_cplm.main sets it up (world size 1)."""
    if torch.cuda.is_available():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        limit_gpu_memory()
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.empty(1, device=device, requires_grad=True).backward()  # as the record: avoids a bug on some systems
        return device
    tg.import_cpu_head().use_heap_for_large_tensors()
    return torch.device("cpu")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="vanilla,cplm", help="the baseline first; vanilla, cplm_loss (vanilla's loss in "
                   "CPLM's form, no CP head), cplm, sentinel, cplm_kernel (CPLM's sums by cp_kernel.py, CUDA)")
    p.add_argument("--rounds_s", type=float, default=90, help="time for the timed rounds (after warm-up)")
    p.add_argument("--min_rounds", type=int, default=200, help="fewer only where --end_in_s leaves no time")
    p.add_argument("--end_in_s", type=float, default=1e9, help="everything done by then (the profile included)")
    p.add_argument("--profile_steps", type=int, default=3, help="steps a mode under the profiler (0: none)")
    p.add_argument("--profile_reserve_s", type=float, default=30, help="kept for the profile after the rounds")
    p.add_argument("--kernel_parts", default=os.environ.get("KERNEL_PARTS_FILE"),
                   help="a file of kernels' model parts (kernel_parts.py) to append to and read, shared with the "
                   "processes that compile the same graphs (default: $KERNEL_PARTS_FILE, else beside inductor's cache)")
    p.add_argument("train_flags", nargs="*", help="train_gpt_cplm's flags, after --")
    args = p.parse_args(argv)
    for flag in ("rounds_s", "end_in_s", "profile_reserve_s"):
        value = getattr(args, flag)
        if not math.isfinite(value) or value < 0 or (value == 0 and flag != "profile_reserve_s"):
            least = "0 or more" if flag == "profile_reserve_s" else "above 0"
            p.error(f"--{flag}: a finite number of seconds, {least} (got {value})")
    if args.profile_steps < 0 or args.min_rounds < 1:
        p.error("--profile_steps: 0 or more; --min_rounds: 1 or more")
    started = time.monotonic()
    end = started + args.end_in_s
    names = args.modes.split(",")
    if len(names) < 2 or len(set(names)) != len(names) or not set(names) <= set(MODES):
        p.error(f"--modes: two or more distinct names of {', '.join(MODES)}, the baseline first")
    a = tg.resolve_vocabulary(tg.parse_args(args.train_flags))
    device = device_for_run()
    if "cplm_kernel" in names and device.type != "cuda":
        p.error("--modes cplm_kernel needs a CUDA GPU (cp_kernel.py's Triton kernels)")
    if device.type == "cuda" and a.coordinate_descent and a.compile != 0:
        torch._inductor.config.coordinate_descent_tuning = True  # as train(): a longer compile, faster kernels
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)  # several models, one code
    loader = tg.TrainLoader(a.train_files, a.batch_size, a.seq_len, 0, 1, a.vocab_size, a.bos_id, a.data_seed)
    parts_file = args.kernel_parts or kernel_parts.default_path()
    kernel_parts.record_into(parts_file)  # every compile of this process: the warm-up's, any recompile after
    modes = {}
    # the modes other than the baseline compile first: a separate job compiling the baseline beside this process
    # (first_call.py's) is then the likelier to have filled the compile cache by the time the baseline compiles
    for name in names[1:] + names[:1]:
        t0 = time.monotonic()
        modes[name] = Mode(name, tg.dataclasses.replace(a, **MODES[name]), device)
        for step in range(max(a.warmup_steps, 1)):  # compiles; Newton-Schulz and the FP8 head recompile once
            modes[name].step(step, loader.next_batch(device))
        synchronize(device)
        print(f"{name}: built and warmed up in {time.monotonic() - t0:.0f}s", flush=True)
    print(f"warm-up done: {', '.join(names)}", flush=True)
    turn = take_turn()  # held for the rounds and the profile
    order = list(names)
    t0 = time.monotonic()  # one more round, to size the rounds by the wall clock (the loader and the sync included)
    timed_round(modes, order, 0, loader.next_batch(device), device)
    round_s = time.monotonic() - t0
    reserve = args.profile_reserve_s if args.profile_steps else 0
    budget = min(args.rounds_s, end - time.monotonic() - reserve)
    if budget < args.rounds_s:
        print(f"rounds cut to {budget:.0f}s by --end_in_s", flush=True)
    R = max(min(args.min_rounds, int((end - time.monotonic() - reserve) / round_s)), int(budget / round_s))
    if R < 10:
        report(f"interleaved A/B: no time for rounds ({end - time.monotonic():.0f}s left, {round_s:.2f}s a round)")
        return 1
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, steps_sampled = {n: [] for n in names}, {n: [] for n in names}, []
    phases = {n: {ph: [] for ph in PHASES} for n in names}
    for r in range(R):
        if r and time.monotonic() > end - reserve:  # the estimate was off: stop at the time, not the count
            break
        step = r * a.num_iterations // R
        result = timed_round(modes, round_order(order, r), step, loader.next_batch(device), device)
        steps_sampled.append(step)
        for n, (ms, loss, by_phase) in result.items():
            times[n].append(ms)
            for ph in PHASES:
                phases[n][ph].append(by_phase[ph])
            if r == 0 or r == R - 1:
                losses[n].append(loss.item())
    if len(losses[names[0]]) < 2:  # stopped early: the last round's losses
        for n in names:
            losses[n].append(modes[n].step(steps_sampled[-1], loader.next_batch(device)).item())
    print("rounds done", flush=True)
    for name in names[1:]:
        for line in ratio_lines(names[0], name, times, losses, steps_sampled, device):
            report(line)
    for line in phase_lines(names, phases, device):
        report(line)
    if device.type == "cuda":
        report(f"  peak memory allocated over the rounds, every model resident: "
               f"{torch.cuda.max_memory_allocated() // 2 ** 20} MiB")
    if args.profile_steps:
        try:
            batch = loader.next_batch(device)
            last = steps_sampled[-1]
            profiles, parts = {}, kernel_parts.read_parts(parts_file)
            for name in names:
                modes[name].step(last, batch)  # out of the profile: the rounds' last sync behind it
                profiles[name] = profile_mode(modes[name], last, batch, args.profile_steps, device, parts)
            for name in names[1:]:
                for line in profile_table(profiles, names[0], name, device, args.profile_steps):
                    report(line)
        except Exception as e:  # the ratio is out already: a profiler fault costs only the table
            report(f"profile: FAILED ({type(e).__name__}: {str(e)[:200]})")
    if turn is not None:
        turn.close()
    print(f"done in {time.monotonic() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except tg.UsageError as e:
        print(f"interleaved.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except tg.DataError as e:
        print(f"interleaved.py: error: {e}", file=sys.stderr)
        sys.exit(1)
