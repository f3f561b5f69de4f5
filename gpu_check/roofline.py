"""Where CPLM's extra step time should go on an H200, estimated on a CPU: a roofline over every kernel of both modes'
compiled training step (the speedrun preset, one 48Ki-token row, forward and backward) and the optimizer's.

    python3 gpu_check/roofline.py > records/gpu/roofline.md      # about 5 minutes on 2 busy cores; no Triton needed

How: each mode's model as CUDA holds it (preflight.cuda_path_model: FP8 head, bf16 embeddings, FlexAttention) is
traced and pushed through inductor's own pipeline (compile_fx: decompositions, AOT autograd, the joint graph's
passes, the partitioner, lowering) with its Triton code generator and FlexAttention's lowerings told the device is
CUDA, as the pre-flight does, up to the scheduler: the kernels are inductor's fused nodes, each one Triton kernel
or one library call (matmuls, sorts, the FP8 head's ops), with inductor's own count of the bytes each reads and
writes from memory and the FLOPs of its matmuls. The FlexAttention ops are counted from their tiles: the 128 x 128
(query, key) tiles each visits on a representative row (gpu_check/prepare_gpu_data.synthetic_tokens, the GPU
check's data: documents of ~1140 tokens), the attention windows averaged over the record's schedule. Each kernel
is then timed by the roofline of an H200 (4.8 TB/s; 790 TFLOP/s bf16 as measured there, FP8 twice that), with a
floor per launch. What it cannot see: the CPU's scheduling differs from sm_90's in a few heuristics (reduction
splits), cuBLAS and FlexAttention reach a fraction of the roofline (assumed below), caches, the host; the
optimizer's Adam and Muon's eager steps are counted from the parameters' sizes, not read.
"""
import argparse
import collections
import contextlib
import math
import os
import re
import sys
import tempfile
import time
import unittest.mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._inductor import scheduler as inductor_scheduler  # noqa: E402
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: E402

import preflight  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402
from prepare_gpu_data import synthetic_tokens  # noqa: E402

BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
BF16_FLOPS = 790e12  # a bf16 GEMM at 8192^3 on the H200 (records/gpu/2026-12-04: 787-810 TFLOP/s)
FP8_FLOPS = 2 * BF16_FLOPS  # the FP8 head's _scaled_mm: twice bf16's rate on Hopper
FLEX_EFFICIENCY = 0.4  # FlexAttention's share of the bf16 rate (FlashAttention-2 reaches 35-50% for head dims
# 64-128 with causal masks; FlexAttention about 90% of it): an assumption, not a measurement
LAUNCH_FLOOR_S = 5e-6  # a kernel's least time on the GPU's timeline when the host launches them one by one
CATEGORIES = ("LM head and loss", "CP head and mixture", "attention", "MLP", "other: embeddings, norms, residual")


class _Scheduled(Exception):
    """The scheduler was built and read: the rest of the compile (code generation, Triton) is not needed."""


@contextlib.contextmanager
def reading_the_scheduler(kind, into, vocab):
    """Each graph's scheduler, once built (its nodes fused), read into `into` as Kernel dicts, then stopped."""
    build = inductor_scheduler.Scheduler.__init__

    def read(self, *args, **kwargs):
        build(self, *args, **kwargs)
        into.extend(kernel_of(node, kind, vocab) for node in self.nodes if counts(node))
        raise _Scheduled

    with unittest.mock.patch.object(inductor_scheduler.Scheduler, "__init__", read):
        yield


def counts(node):
    """A node that is a kernel: not a view or an empty buffer (FlexAttention's placeholders), not a FlexAttention
    op's (counted from its tiles)."""
    if isinstance(node, inductor_scheduler.NopKernelSchedulerNode):
        return False
    return not any(o.target in preflight._flex_ops() for o in origins(node))


def origins(node):
    found = set()
    for sub in node.get_nodes():
        if getattr(sub, "node", None) is not None:
            found |= set(sub.node.origins)
    return found


CP_FUNCTIONS = {"copy_lses", "cplm_target_log_prob", "target_in_context", "_dense_copy_lse_chunk"}
HEAD_FUNCTIONS = {"lm_head_terms", "vanilla_nll", "vanilla_mean", "vanilla_token_nll", "lm_logits"}
MASK_FUNCTIONS = {"flex_document_mask", "document_blocks", "within_window", "doc_ids_of"}


def origin_category(o):
    """The part of the model an FX node computes (a backward node: the part whose gradient it is), from its
    source lines and its module."""
    functions = set(re.findall(r", in (\w+)", o.meta.get("stack_trace") or ""))
    stack = o.meta.get("nn_module_stack") or o.meta.get("fwd_nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else ""
    if functions & CP_FUNCTIONS or "cp_head" in module:
        return CATEGORIES[1]
    if functions & HEAD_FUNCTIONS or "lm_head" in module:
        return CATEGORIES[0]
    if ".attn" in module or functions & MASK_FUNCTIONS:
        return CATEGORIES[2]
    if ".mlp" in module:
        return CATEGORIES[3]
    return CATEGORIES[4]


def category(node, op_name, vocab):
    """A kernel's part of the model: a library call's (a matmul, a sort) is its op's; a fused kernel that makes or
    reads a (T, V) tensor is the LM head's (those bytes are most of any kernel they are in: the CP mixture's
    pointwise steps fuse into the head's reductions); any other fused kernel's is what most of its FX nodes compute
    (a matmul's inputs and a fused kernel's edges reach into the parts beside it)."""
    if "fp8_matmul" in op_name:
        return CATEGORIES[0]
    inner = getattr(node, "node", None)
    origin = inner.get_origin_node() if isinstance(node, inductor_scheduler.ExternKernelSchedulerNode) else None
    if origin is not None:
        return origin_category(origin)
    found = origins(node)
    if any(vocab in getattr(t, "shape", ()) for o in found for a in (o, *o.all_input_nodes)
           for t in [a.meta.get("val")] if isinstance(t, torch.Tensor)):
        return CATEGORIES[0]
    votes = collections.Counter(origin_category(o) for o in found)
    return max(CATEGORIES, key=lambda c: (votes[c], -CATEGORIES.index(c))) if votes else CATEGORIES[4]


def kernel_of(node, kind, vocab):
    """One kernel: its graph, what it is, its category, the bytes it moves, its FLOPs and its roofline time."""
    inner = getattr(node, "node", None)
    op_name = str(getattr(inner, "op_overload", "") or getattr(inner, "python_kernel_name", "") or "")
    extern = isinstance(node, inductor_scheduler.ExternKernelSchedulerNode)
    nbytes = node.get_read_write_buffers_sizes()
    flops, rate = node.estimate_flops() or 0, BF16_FLOPS
    if "fp8_matmul" in op_name:  # the FP8 head's custom ops: _scaled_mm at FP8's rate (one matmul forward, two back)
        T, D, Vp = _fp8_shapes(inner)
        flops, rate = (4 if "backward" in op_name else 2) * T * D * Vp, FP8_FLOPS
        if "backward" in op_name:  # inside it, beyond its inputs and outputs: the e5m2 gradient written, its
            nbytes += 5 * T * Vp  # transposed copy read and written, both read by the two matmuls (1 byte each)
    what = (op_name.split(".")[-2] if "." in op_name else op_name) if extern else \
        ("reduction" if node.is_reduction() else "pointwise")
    seconds = max(nbytes / BANDWIDTH, flops / rate)
    return dict(graph=kind, what=what or "extern", category=category(node, op_name, vocab), bytes=nbytes, flops=flops,
                seconds=seconds, name=",".join(sorted(o.name for o in origins(node)))[:80])


def _fp8_shapes(inner):
    """(tokens, model width, padded vocabulary) of an FP8 head op, from its first two inputs."""
    a, b = (tuple(int(s) for s in x.get_size()) for x in inner.inputs[:2])
    if "backward" in str(inner.op_overload):  # (grad (T, V), x8 (T, D), ...)
        return a[0], b[1], a[1]
    return a[0], a[1], b[0]  # (x (T, D), w (V, D))


def flex_op_of(fx_node, kind):
    """A FlexAttention op of the graph: its direction, head count and dim, and its role (attention, several heads of
    128; the CP head's one head of 64: its document mask, whose mask reads one tensor, or its match mask, four)."""
    q = fx_node.args[0].meta["val"]
    _, H, T, d = q.shape
    captured = len(fx_node.args[-1]) if isinstance(fx_node.args[-1], (list, tuple)) else 0
    role = "attention" if H > 1 or d != 64 else ("CP document mask" if captured == 1 else "CP match mask")
    backward = "backward" in str(fx_node.target)
    return dict(graph=kind, role=role, backward=backward, H=int(H), T=int(T), d=int(d))


def graph_kernels(fn, inputs, backward=True, vocab=50304):
    """([Kernel], [flex op]) of the graphs inductor compiles for fn on the CUDA path (forward and backward, or one
    inference graph), read at the scheduler: nothing is computed, so the speedrun's shapes cost no memory or time."""
    import torch.nn.attention.flex_attention as flex_module
    kernels, flex = [], []

    def inner(gm, example_inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        flex.extend(flex_op_of(n, kind) for n in gm.graph.nodes
                    if n.op == "call_function" and n.target in preflight._flex_ops())
        try:
            with preflight._flex_lowered_as_on_gpu([]), reading_the_scheduler(kind, kernels, vocab):
                compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as e:
            while e is not None and not isinstance(e, _Scheduled):
                e = e.__cause__ or e.__context__
            if e is None:
                raise
        return preflight._shaped_outputs(gm)

    torch._dynamo.reset()
    try:  # inductor keeps a stopped compile's folder in its cache folder: a temporary one
        with tempfile.TemporaryDirectory(prefix="roofline_") as cache, \
                unittest.mock.patch.dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache), \
                unittest.mock.patch.object(flex_module, "_validate_device", lambda *a, **k: None), \
                unittest.mock.patch.object(tg, "update_dtype", lambda device: torch.bfloat16), \
                inductor_config.patch(cpu_backend="triton", fx_graph_cache=False, force_disable_caches=True):
            out = torch.compile(fn, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner), fullgraph=True,
                                dynamic=False)(*inputs)
            if backward:
                out.sum().backward()
    finally:
        torch._dynamo.reset()
    return kernels, flex


def step_kernels(cplm, T, **config):
    """([Kernel], [flex op]) of one training step of the speedrun preset's model (config: GPTConfig's fields
    otherwise) on the CUDA path, both graphs."""
    model = preflight.cuda_path_model(cplm, T, **config)
    ids, targets = preflight.packed_row(T, 0, bos=model.config.bos_id)
    return graph_kernels(model, (ids % model.config.vocab_size, targets % model.config.vocab_size,
                                 torch.tensor(14, dtype=torch.int32)), vocab=model.config.padded_vocab)


def representative_tiles(T, seed=0):
    """Tiles a FlexAttention op visits on a synthetic row like the GPU check's (documents of ~1140 tokens, up to
    16Ki): the long and short attention windows averaged over the record's schedule (1 -> 14 blocks), the CP head's
    masks (whole documents, no window). Per op: (tiles, of them partial, the most one query block visits). A
    query block's tiles are one thread block's loop, in order: the longest loop bounds the kernel however many SMs."""
    tokens = synthetic_tokens(T + 1, np.random.default_rng(seed))
    ids = torch.from_numpy(tokens[:T].astype(np.int64))[None]
    doc_ids = tg.doc_ids_of(ids, 50256)
    tiles = tg.document_blocks(doc_ids)

    def count(window):
        (p_count, _), (f_count, _) = tg.within_window(tiles, window)
        return int(p_count.sum() + f_count.sum()), int(p_count.sum()), int((p_count + f_count).max())

    a = tg.Hyperparameters()  # the record's schedule
    steps = a.num_iterations
    schedule = collections.Counter(tg.window_blocks(s, a) for s in range(steps))
    mean = {}
    for name, shrink in (("long", 1), ("short", 2)):
        per_window = {w: count(torch.tensor(w // shrink)) for w in schedule}
        mean[name] = tuple(sum(per_window[w][i] * n for w, n in schedule.items()) / steps for i in (0, 1, 2))
    whole = count(None)
    return {"attention long": mean["long"], "attention short": mean["short"], "CP document mask": whole,
            "CP match mask": (whole[0], whole[0], whole[2])}  # all partial: the token test runs in every tile


SMS = 132  # the H200's streaming multiprocessors; a FlexAttention thread block (8 warps here) takes one


def flex_cost(op, tiles):
    """(bytes, FLOPs, seconds) of a FlexAttention op from its tiles: per tile two matmuls forward (Q K^T, P V) and
    five backward, 128 x 128 x d each; HBM bytes: q, k, v, the output and the LSE (forward), q, k, v, the output's
    gradient, dq, dk, dv, the LSE and delta (backward), bf16; K and V re-read per tile from L2, not HBM. Its time:
    the tiles spread over the SMs, or the longest loop one query block runs (its tiles one after another, at one
    SM's share of the rate), whichever is longer; the backward's key-block loops are as long (whole documents
    visited from both sides)."""
    total, _, longest = tiles
    per_tile = (10 if op["backward"] else 4) * 128 * 128 * op["d"]
    flops = per_tile * total * op["H"]
    vectors = op["T"] * op["H"] * op["d"] * 2
    nbytes = (7 if op["backward"] else 4) * vectors + (2 if op["backward"] else 1) * op["T"] * op["H"] * 4
    tile_s = per_tile / (FLEX_EFFICIENCY * BF16_FLOPS / SMS)
    return nbytes, flops, max(nbytes / BANDWIDTH, tile_s * max(total * op["H"] / SMS, longest))


def optimizer_cost(cplm):
    """(bytes, FLOPs, launches, seconds) of the optimizer step as build_optimizers sets it up on CUDA. Muon, per
    matrix: Newton-Schulz compiled as on CUDA (bf16; its kernels read at the scheduler like the model's, once per
    shape) and three eager kernels (the momentum's two lerps and the update: 36 bytes a parameter). Adam, fused: each
    parameter, its gradient and two moments read, three written, in the parameter's dtype (the embeddings bf16 on
    CUDA), about one launch a parameter group. The same in both modes but for the CP head's two matrices (Adam's)."""
    with torch.device("meta"):
        model = tg.GPT(tg.GPTConfig(cplm=cplm, fp8_head=1))
    adam, muon = tg.build_optimizers(model, tg.Hyperparameters(cplm=cplm), 0, 1)
    embeddings = {id(model.embed.weight)} | {id(e.weight) for e in model.value_embeds}
    nbytes = sum(7 * (2 if id(p) in embeddings else 4) * p.numel() for g in adam.param_groups for p in g["params"])
    flops, launches = 0, len(adam.param_groups)
    shapes = collections.Counter(tuple(p.shape) for g in muon.param_groups for p in g["params"])
    for shape, n in shapes.items():
        kernels, _ = graph_kernels(tg.newton_schulz, (torch.zeros(shape),), backward=False)
        nbytes += n * (sum(k["bytes"] for k in kernels) + 36 * math.prod(shape))
        flops += n * sum(k["flops"] for k in kernels)
        launches += n * (len(kernels) + 3)
    return nbytes, flops, launches, max(nbytes / BANDWIDTH, flops / BF16_FLOPS)


def mode_table(T):
    """Per mode: its kernels (with the flex ops as kernels) and the optimizer's cost."""
    tiles = representative_tiles(T)
    out = {}
    for cplm in (0, 1):
        t0 = time.perf_counter()
        kernels, flex = step_kernels(cplm, T)
        attention = [op for op in flex if op["role"] == "attention"]
        for direction in (False, True):  # 3 long-window layers of the 11 with attention, 8 short, as window_pattern
            ops = [op for op in attention if op["backward"] == direction]
            for i, op in enumerate(ops):
                op["role"] = "attention long" if i < len(ops) * 3 // 11 else "attention short"
        for op in flex:
            nbytes, flops, seconds = flex_cost(op, tiles[op["role"]])
            kernels.append(dict(graph=op["graph"], what="flex " + ("backward" if op["backward"] else "forward"),
                                category=CATEGORIES[1] if op["role"].startswith("CP") else CATEGORIES[2],
                                bytes=nbytes, flops=flops, seconds=seconds, name=op["role"],
                                tiles=tiles[op["role"]]))
        out["CPLM" if cplm else "vanilla"] = dict(kernels=kernels, optimizer=optimizer_cost(cplm),
                                                  seconds=time.perf_counter() - t0)
    return out, tiles


def totals(kernels):
    seconds = sum(k["seconds"] for k in kernels)
    floored = sum(max(k["seconds"], LAUNCH_FLOOR_S) for k in kernels)
    return dict(launches=len(kernels), bytes=sum(k["bytes"] for k in kernels), flops=sum(k["flops"] for k in kernels),
                seconds=seconds, floored=floored)


def markdown(modes, tiles, T, wall_s):
    gb, tf, ms = 1e9, 1e12, 1e3
    lines = ["# CPLM's extra step time on an H200, estimated on a CPU (a roofline)", "",
             f"`python3 gpu_check/roofline.py > records/gpu/roofline.md` (torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}, {wall_s:.0f} s on 2 busy cores). The speedrun preset's training step, one "
             f"{T // 1024}Ki-token row on one GPU (forward, backward, optimizer), each kernel as inductor fuses it for "
             "the CUDA path (gpu_check/roofline.py's docstring says how, and what it cannot see). A kernel's time is "
             f"max(bytes / {BANDWIDTH / 1e12:.1f} TB/s, FLOPs / rate): bf16 {BF16_FLOPS / tf:.0f} TFLOP/s, FP8 twice "
             f"that, FlexAttention {FLEX_EFFICIENCY:.0%} of bf16's; 'with launches' puts a floor of "
             f"{LAUNCH_FLOOR_S * 1e6:.0f} us under every kernel (the GPU waiting on the host's launches).", ""]
    lines += ["## Both modes", "",
              "| mode | kernels a step (forward, backward, optimizer) | HBM bytes | FLOPs | roofline | with launches |",
              "|---|---|---|---|---|---|"]
    for mode, m in modes.items():
        t = totals(m["kernels"])
        ob, of, ol, os_ = m["optimizer"]
        by = collections.Counter(k["graph"] for k in m["kernels"])
        lines.append(f"| {mode} | {by['forward']}, {by['backward']}, ~{ol} | {(t['bytes'] + ob) / gb:.1f} GB | "
                     f"{(t['flops'] + of) / tf:.2f} T | {(t['seconds'] + os_) * ms:.1f} ms | "
                     f"{(t['floored'] + os_ + ol * LAUNCH_FLOOR_S) * ms:.1f} ms |")
    lines += ["", "Measured on the H200 (records/gpu/README.md): vanilla 99.8-107.5 ms a step, CPLM 102.4-111.7 ms, "
              "CPLM / vanilla 1.03-1.04 (+2.6 to +4.2 ms).", "",
              "## By part of the model (forward and backward; the optimizer apart)", "",
              "| part | vanilla: kernels, GB, TFLOP, ms (with launches) | "
              "CPLM: kernels, GB, TFLOP, ms (with launches) | CPLM - vanilla, ms (with launches) |",
              "|---|---|---|---|"]
    diff_total = diff_floored = 0.0
    for cat in CATEGORIES:
        cells, t = [], {}
        for mode, m in modes.items():
            t[mode] = totals([k for k in m["kernels"] if k["category"] == cat])
            cells.append(f"{t[mode]['launches']}, {t[mode]['bytes'] / gb:.2f}, {t[mode]['flops'] / tf:.3f}, "
                         f"{t[mode]['seconds'] * ms:.2f} ({t[mode]['floored'] * ms:.2f})")
        d, df = t["CPLM"]["seconds"] - t["vanilla"]["seconds"], t["CPLM"]["floored"] - t["vanilla"]["floored"]
        diff_total, diff_floored = diff_total + d, diff_floored + df
        lines.append(f"| {cat} | {cells[0]} | {cells[1]} | {d * ms:+.2f} ({df * ms:+.2f}) |")
    opt = modes["CPLM"]["optimizer"][3] - modes["vanilla"]["optimizer"][3]
    lines.append(f"| optimizer (analytic) | | | {opt * ms:+.3f} |")
    lines.append(f"| **all** | | | **{(diff_total + opt) * ms:+.2f} ({(diff_floored + opt) * ms:+.2f})** |")
    lines += ["", "## The CP head's FlexAttention ops and attention's, from their tiles", "",
              f"Tiles of 128 x 128 visited on a {T // 1024}Ki-token synthetic row (sum L^2 / T^2 as the GPU check's "
              "data); attention's windows averaged over the record's 1770 steps. A query block's tiles are one thread "
              f"block's loop: an op takes at least its longest loop, however many of the {SMS} SMs are idle.", "",
              "| op | tiles a head (partial) | the longest loop (tiles) | heads x dim | "
              "forward + backward: GB, TFLOP, ms | ms if balanced |", "|---|---|---|---|---|---|"]
    flex = collections.OrderedDict()
    for k in modes["CPLM"]["kernels"]:
        if k["what"].startswith("flex"):
            flex.setdefault(k["name"], []).append(k)
    for role, ks in flex.items():
        H, d = (6, 128) if role.startswith("attention") else (1, 64)
        n_ops = len(ks) // 2
        balanced = sum(max(k["bytes"] / BANDWIDTH, k["flops"] / (FLEX_EFFICIENCY * BF16_FLOPS)) for k in ks)
        lines.append(f"| {role} ({n_ops} layer{'s' if n_ops != 1 else ''}) | {ks[0]['tiles'][0]:.0f} "
                     f"({ks[0]['tiles'][1]:.0f}) | {ks[0]['tiles'][2]:.0f} | {H} x {d} | "
                     f"{sum(k['bytes'] for k in ks) / gb:.3f}, {sum(k['flops'] for k in ks) / tf:.3f}, "
                     f"{sum(k['seconds'] for k in ks) * ms:.2f} | {balanced * ms:.2f} |")
    cp = sorted((k for k in modes["CPLM"]["kernels"] if k["category"] == CATEGORIES[1]), key=lambda k: -k["seconds"])
    lines += ["", f"## The CP head's kernels ({len(cp)}), by time", "",
              "| graph | kernel | HBM bytes | FLOPs | roofline us | FX nodes (first) |", "|---|---|---|---|---|---|"]
    for k in cp[:25]:
        lines.append(f"| {k['graph']} | {k['what']} | {k['bytes'] / 1e6:.2f} MB | {k['flops'] / 1e9:.2f} G | "
                     f"{k['seconds'] * 1e6:.1f} | {k['name'][:60]} |")
    small = sum(1 for k in cp if k["seconds"] < LAUNCH_FLOOR_S)
    lines += ["", f"{small} of the CP head's {len(cp)} kernels take under {LAUNCH_FLOOR_S * 1e6:.0f} us by the "
              "roofline."]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_len", type=int, default=48 * 1024, help="tokens in the row (the speedrun's 48Ki)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    modes, tiles = mode_table(args.seq_len)
    print(markdown(modes, tiles, args.seq_len, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
