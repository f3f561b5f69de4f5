"""Where CPLM's extra step time should go on an H100 and an H200, estimated on a CPU: a roofline over every kernel of
both modes' compiled training step (a preset's model, one row, forward and backward) and the optimizer's.

    python3 gpu_check/roofline.py > records/gpu/roofline.md      # the speedrun preset: 12 x 768, one 48Ki-token row;
                                                                 # about 2 minutes on 2 busy cores; no Triton needed
    python3 gpu_check/roofline.py --preset gpu1 > records/one_gpu_race/roofline_gpu1.md   # the one-GPU race's model:
                                                                 # 4 x 768, attention in every layer, one 32Ki row;
                                                                 # about 1 minute

--preset takes train_gpt_cplm's preset (its model's shape, its row and its schedule, which sets the attention
windows averaged over); --num_layers, --no_attention_layer and --seq_len change it.

How: each mode's model as CUDA holds it (preflight.cuda_path_model: FP8 head, bf16 embeddings, FlexAttention) is
traced and pushed through inductor's own pipeline (compile_fx: decompositions, AOT autograd, the joint graph's
passes, the partitioner, lowering) with its Triton code generator and FlexAttention's lowerings told the device is
CUDA, as the pre-flight does, up to the scheduler: the kernels are inductor's fused nodes, each one Triton kernel
or one library call (matmuls, sorts, the FP8 head's ops), with the bytes each reads and writes from memory (by
inductor's own rule, per fused part: moved_bytes) and the FLOPs of its matmuls; inductor's decisions that ask
whether a node is on a CPU are answered as on CUDA, and its online softmax (a row's max and sum of exponentials in
one pass, a rewrite it makes for CUDA graphs only) is applied (decisions_as_on_cuda). The FlexAttention ops are
counted from their tiles: the 128 x 128 (query, key) tiles each visits on a representative row
(gpu_check/prepare_gpu_data.synthetic_tokens, the GPU check's data: documents of ~1140 tokens), the attention
windows averaged over the preset's schedule; what they read stays in the graph (a stand-in that read nothing let
inductor drop the matmul that makes attention's output gradient). Each kernel is then timed by the roofline of each
card (CARDS: an achievable bandwidth and GEMM rate, not the spec sheet's), with a floor per launch. What it cannot
see: the CPU's scheduling differs from sm_90's in a few more heuristics (how reductions are split, loop orders
normalised, matmuls with a dimension of 1 decomposed), cuBLAS and FlexAttention reach a fraction of the roofline
(assumed below), caches, the host; the optimizer's Adam and Muon's eager steps are counted from the parameters'
sizes, not read.
"""
import argparse
import collections
import contextlib
import dataclasses
import functools
import math
import os
import re
import shlex
import sys
import tempfile
import time
import typing
import unittest.mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._inductor import ir  # noqa: E402
from torch._inductor import scheduler as inductor_scheduler  # noqa: E402
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: E402
from torch._inductor.virtualized import V  # noqa: E402

import preflight  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402
from prepare_gpu_data import synthetic_tokens  # noqa: E402


class Card(typing.NamedTuple):
    """A card's roofline: HBM bandwidth as a streaming kernel reaches it (the spec sheet's times derating), the bf16
    GEMM rate as measured, FP8 twice that (Hopper's FP8 tensor cores), FlexAttention a share of bf16's."""
    name: str
    spec_bandwidth: float  # bytes/s, the spec sheet's
    derating: float  # the share of it a streaming copy reaches
    bf16: float  # FLOP/s
    sms: int  # streaming multiprocessors: a FlexAttention thread block (8 warps here) takes one
    fp8_rate: float = 0.0  # FLOP/s; 0: twice bf16's

    @property
    def bandwidth(self):
        return self.spec_bandwidth * self.derating

    @property
    def fp8(self):
        return self.fp8_rate or 2 * self.bf16


# Derating: BabelStream's Copy (an array read, one written) on Azure's ND H100 v5 and ND H200 v5, published in
# Azure/AI-benchmarking-guide: 2.90 TB/s of 3.35 and 4.01 of 4.8 (a streaming kernel's best; inductor's fused kernels
# read and write the same way). The records hold no bandwidth measurement: the report shows the floors at others.
# bf16: the H200's GEMM at 8192^3 in records/gpu/2026-12-04 (787-810 TFLOP/s); the H100's "maximum achievable matmul
# FLOPS" in stas00/ml-engineering (compute/accelerator/README.md: 794.5 TFLOP/s, torch 2.7, a search over shapes).
CARDS = {"h100": Card("H100 SXM 80 GB", 3.35e12, 2.90 / 3.35, 794.5e12, 132),
         "h200": Card("H200 141 GB", 4.8e12, 4.01 / 4.8, 790e12, 132)}
# FP8 as measured in the same table (1402.6 and 1453.4 TFLOP/s, 1.77x and 1.84x bf16's): the report's variant
FP8_MEASURED = {CARDS["h100"].name: 1402.6e12, CARDS["h200"].name: 1453.4e12}
FLEX_EFFICIENCY = 0.4  # FlexAttention's share of the bf16 rate (FlashAttention-2 reaches 35-50% for head dims
# 64-128 with causal masks; FlexAttention about 90% of it): an assumption, not a measurement
LAUNCH_FLOOR_S = 5e-6  # a kernel's least time on the GPU's timeline when the host launches them one by one
CATEGORIES = ("LM head and loss", "CP head and mixture", "attention", "MLP", "other: embeddings, norms, residual")
SHAPE = ("num_layers", "model_dim", "num_heads", "no_attention_layer", "cp_dim")  # the model's fields a preset sets
RECORDS = {"speedrun": "records/gpu/roofline.md", "gpu1": "records/one_gpu_race/roofline_gpu1.md"}


def preset_hyperparameters(preset="speedrun", **overrides):
    """train_gpt_cplm's Hyperparameters of a preset (its model's shape, its row, its schedule), overrides on top."""
    return dataclasses.replace(tg.Hyperparameters(), **{**tg.PRESETS[preset], **overrides, "preset": preset})


def model_config(a):
    """GPTConfig's fields of the model's shape, from Hyperparameters."""
    return {name: getattr(a, name) for name in SHAPE}


def shape_words(a):
    attention = "attention in every layer" if not 0 <= a.no_attention_layer < a.num_layers else \
        f"no attention in layer {a.no_attention_layer}"
    return f"{a.num_layers} x {a.model_dim}, {a.num_heads} heads, {attention}"


class _Scheduled(Exception):
    """The scheduler was built and read: the rest of the compile (code generation, Triton) is not needed."""


@contextlib.contextmanager
def reading_the_scheduler(kind, into, vocab, kept=()):
    """Each graph's scheduler, once built (its nodes fused), read into `into` as Kernel dicts, then stopped. kept:
    buffers a FlexAttention op reads, which its stand-in (it reads nothing) must not let inductor drop as dead."""
    build = inductor_scheduler.Scheduler.__init__
    eliminate = inductor_scheduler.Scheduler.dead_node_elimination

    def read(self, *args, **kwargs):
        build(self, *args, **kwargs)
        into.extend(kernel_of(node, kind, vocab) for node in self.nodes if counts(node))
        raise _Scheduled

    def keeping(self):
        for name in kept:
            if name in self.name_to_buf:
                self.name_to_buf[name].users.append(
                    inductor_scheduler.NodeUser(inductor_scheduler.OutputNode(inductor_scheduler.StarDep(name))))
        eliminate(self)

    with unittest.mock.patch.object(inductor_scheduler.Scheduler, "__init__", read), \
            unittest.mock.patch.object(inductor_scheduler.Scheduler, "dead_node_elimination", keeping):
        yield


def counts(node):
    """A node that is a kernel: not a view or an empty buffer (FlexAttention's placeholders), not one output of a
    library call's several (its call is the kernel), not a FlexAttention op's (counted from its tiles)."""
    if isinstance(node, inductor_scheduler.NopKernelSchedulerNode) or isinstance(getattr(node, "node", None),
                                                                                 ir.MultiOutput):
        return False
    return not any(o.target in preflight._flex_ops() for o in origins(node))


def origins(node):
    found = set()
    for sub in node.get_nodes():
        if getattr(sub, "node", None) is not None:
            found |= set(sub.node.origins)
    return found


def buffer_bytes(scheduler, name):
    """A buffer's whole size in bytes (a library call's tuple of outputs: the sum of its parts)."""
    buf = V.graph.name_to_buffer.get(name) or V.graph.graph_inputs.get(name)
    if buf is None or isinstance(buf, ir.TorchBindObject):
        return 0
    layout = buf.get_output_spec() if hasattr(buf, "get_output_spec") else buf.layout
    if isinstance(layout, ir.MultiOutputLayout):
        return sum(buffer_bytes(scheduler, out.get_name()) for user in scheduler.name_to_buf[name].users
                   if isinstance(getattr(user.node, "node", None), ir.MultiOutput) for out in user.node.get_outputs())
    if isinstance(layout, ir.NoneLayout):
        return sum(buffer_bytes(scheduler, m) for m in buf.get_mutation_names())
    return math.prod(int(s) for s in buf.get_size()) * buf.get_dtype().itemsize


def moved_bytes(node):
    """The HBM bytes a kernel reads and writes. Inductor's own count (get_read_write_buffers_sizes) takes a fused
    kernel's or a library call's loops as 1e9 elements, so a (T, V) buffer (2.5e9 elements at 48Ki tokens) counted
    1e9 and a gather of one element a row counted the whole buffer; here each fused part counts by inductor's rule
    with its own loops (a buffer: the elements they index, at most the buffer, once a kernel), a library call reads
    and writes its buffers whole, and a buffer made and used only inside the kernel counts nothing."""
    scheduler = node.scheduler
    if isinstance(node, inductor_scheduler.ExternKernelSchedulerNode):
        names = {d.name for d in node.read_writes.reads | node.read_writes.writes}
        return sum(buffer_bytes(scheduler, name) for name in names)
    parts = node.get_nodes()
    inside = {d.name for part in parts for d in part.read_writes.writes
              if d.name in scheduler.name_to_buf
              and all(u.node in parts for u in scheduler.name_to_buf[d.name].users)} if len(parts) > 1 else set()
    per_buffer = {}
    for part in parts:
        for name, nbytes in part.get_read_write_buffer_accesses(include_reads=True, include_writes=True).items():
            if name not in inside:
                per_buffer[name] = max(per_buffer.get(name, 0), nbytes)
    return sum(per_buffer.values())


CP_FUNCTIONS = {"copy_lses", "cplm_target_log_prob", "target_in_context", "_dense_copy_lse_chunk"}
HEAD_FUNCTIONS = {"lm_head_terms", "vanilla_nll", "vanilla_mean", "vanilla_token_nll", "lm_logits"}
MASK_FUNCTIONS = {"flex_document_mask", "document_blocks", "within_window", "doc_ids_of"}


def functions_of(o):
    return set(re.findall(r", in (\w+)", o.meta.get("stack_trace") or ""))


def origin_category(o):
    """The part of the model an FX node computes (a backward node: the part whose gradient it is), from its
    source lines and its module."""
    functions = functions_of(o)
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
    """A kernel's part of the model: a library call's (a matmul, a sort) is its op's; a fused kernel that writes or
    reads a (T, V) buffer is the LM head's (those bytes are most of any kernel they are in: the CP mixture's
    pointwise steps fuse into the head's reductions); any other fused kernel's is what most of its FX nodes compute
    (a matmul's inputs and a fused kernel's edges reach into the parts beside them)."""
    if "fp8_matmul" in op_name:
        return CATEGORIES[0]
    inner = getattr(node, "node", None)
    origin = inner.get_origin_node() if isinstance(node, inductor_scheduler.ExternKernelSchedulerNode) else None
    if origin is not None:
        return origin_category(origin)
    if touches_logits(node, vocab):
        return CATEGORIES[0]
    return majority_category(origins(node))


def majority_category(fx_nodes):
    """The part most of these FX nodes compute (a tie: the earlier category; none: the rest's)."""
    votes = collections.Counter(origin_category(o) for o in fx_nodes)
    return max(CATEGORIES, key=lambda c: (votes[c], -CATEGORIES.index(c))) if votes else CATEGORIES[-1]


def touches_logits(node, vocab):
    """The kernel reads or writes a (T, V) buffer."""
    for part in node.get_nodes():
        for dep in part.read_writes.reads | part.read_writes.writes:
            buf = V.graph.name_to_buffer.get(dep.name) or V.graph.graph_inputs.get(dep.name)
            layout = getattr(buf, "layout", None)
            size = [int(s) for s in layout.size] if isinstance(layout, ir.Layout) else []
            if size and size[-1] == vocab and math.prod(size) > vocab:
                return True
    return False


def rebuilt(o):
    """An FX node of copy_lses that builds the match mask's tiles again from the document ids (document_blocks,
    all partial) and its BlockMask's lists (document_block_mask, not the document mask's flex_document_mask)."""
    functions = functions_of(o)
    return "copy_lses" in functions and ("document_blocks" in functions or (
        "document_block_mask" in functions and "flex_document_mask" not in functions))


def kernel_of(node, kind, vocab):
    """One kernel: its graph, what it is, its category, the bytes it moves, its FLOPs and the rate they run at."""
    inner = getattr(node, "node", None)
    op_name = str(getattr(inner, "op_overload", "") or getattr(inner, "python_kernel_name", "") or "")
    extern = isinstance(node, inductor_scheduler.ExternKernelSchedulerNode)
    nbytes = moved_bytes(node)
    flops, rate = node.estimate_flops() or 0, "bf16"
    if "fp8_matmul" in op_name:  # the FP8 head's custom ops: _scaled_mm at FP8's rate (one matmul forward, two back)
        T, D, Vp = _fp8_shapes(inner)
        flops, rate = (4 if "backward" in op_name else 2) * T * D * Vp, "fp8"
        if "backward" in op_name:  # inside it, beyond its inputs and outputs: the e5m2 gradient written, its
            nbytes += 5 * T * Vp  # transposed copy read and written, both read by the two matmuls (1 byte each)
    what = (op_name.split(".")[-2] if "." in op_name else op_name) if extern else \
        ("reduction" if node.is_reduction() else "pointwise")
    found = origins(node)
    return dict(graph=kind, what=what or "extern", category=category(node, op_name, vocab), bytes=nbytes, flops=flops,
                rate=rate, logits=not extern and touches_logits(node, vocab),
                match_tiles=bool(found) and all(rebuilt(o) for o in found),
                name=",".join(sorted(o.name for o in found))[:80])


def _fp8_shapes(inner):
    """(tokens, model width, padded vocabulary) of an FP8 head op, from its first two inputs."""
    a, b = (tuple(int(s) for s in x.get_size()) for x in inner.inputs[:2])
    if "backward" in str(inner.op_overload):  # (grad (T, V), x8 (T, D), ...)
        return a[0], b[1], a[1]
    return a[0], a[1], b[0]  # (x (T, D), w (V, D))


def flex_op_of(fx_node, kind):
    """A FlexAttention op of the graph: its direction, head count and dim, and its role (attention, several heads of
    128; the CP head's one head of 64: its document mask, whose mask reads one tensor, or its match mask, four)."""
    q, v = fx_node.args[0].meta["val"], fx_node.args[2].meta["val"]
    _, H, T, d = q.shape
    captured = len(fx_node.args[-1]) if isinstance(fx_node.args[-1], (list, tuple)) else 0
    role = "attention" if H > 1 or d != 64 else ("CP document mask" if captured == 1 else "CP match mask")
    backward = "backward" in str(fx_node.target)
    return dict(graph=kind, role=role, backward=backward, H=int(H), T=int(T), d=int(d), dv=int(v.shape[-1]))


@contextlib.contextmanager
def flex_inputs_kept(names):
    """FlexAttention's lowerings record the buffers they read (each realized, as the CUDA lowering realizes them):
    the stand-in the pre-flight's lowering leaves reads nothing, and inductor would drop them, and what makes them
    (attention's output gradient, a matmul), as dead."""
    from torch.utils._pytree import tree_leaves

    def wrap(op, lower):
        def lowered(*args, **kwargs):
            out = lower(*args, **kwargs)
            for x in tree_leaves((args, kwargs)):
                if isinstance(x, ir.TensorBox):
                    name = ir.ExternKernel.realize_input(x).maybe_get_name()
                    if name:
                        names.add(name)
            return out
        return lowered

    with preflight.flex_lowerings_wrapped(wrap):
        yield


_ONLINE_SOFTMAX = []


@contextlib.contextmanager
def decisions_as_on_cuda():
    """The graph read here is the CUDA one on CPU buffers: inductor's heuristics that ask whether a node is on a CPU
    or a GPU answer as on CUDA (on a CPU it writes out any reused result of an exp, a log or a sigmoid, the record's
    soft-capped logits among them; it neither fuses reductions of two loop orders nor reorders loops; it unrolls
    fewer small reductions), and its online softmax (a row's max and sum of exponentials in one pass, a post-grad
    rewrite it makes only for CUDA graphs) is registered again without that check."""
    if not _ONLINE_SOFTMAX:
        from torch._inductor.fx_passes import post_grad
        from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement
        passes = PatternMatcherPass()
        register_replacement(post_grad.prepare_softmax_pattern, post_grad.prepare_softmax_replacement,
                             [torch.empty(4, 8)], scalar_workaround=dict(dim=-1), trace_fn=fwd_only,
                             pass_dicts=passes, extra_check=lambda match: inductor_config.online_softmax)
        _ONLINE_SOFTMAX.append(passes.apply)
    gpu = lambda device_type: device_type in ("cuda", "xpu", "cpu")  # noqa: E731
    node = inductor_scheduler.BaseSchedulerNode
    with unittest.mock.patch.object(ir, "is_cpu", lambda x: False), \
            unittest.mock.patch.object(ir, "is_gpu", gpu), \
            unittest.mock.patch.object(node, "is_cpu", lambda self: False), \
            unittest.mock.patch.object(node, "is_gpu", lambda self: True), \
            unittest.mock.patch.object(inductor_scheduler, "_is_gpu_triton_backend", lambda a, b: True), \
            inductor_config.patch(post_grad_custom_pre_pass=_ONLINE_SOFTMAX[0]):
        yield


def graph_kernels(fn, inputs, backward=True, vocab=50304):
    """([Kernel], [flex op]) of the graphs inductor compiles for fn on the CUDA path (forward and backward, or one
    inference graph), read at the scheduler: nothing is computed, so the speedrun's shapes cost no memory or time."""
    import torch.nn.attention.flex_attention as flex_module
    kernels, flex = [], []

    def inner(gm, example_inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        flex.extend(flex_op_of(n, kind) for n in gm.graph.nodes
                    if n.op == "call_function" and n.target in preflight._flex_ops())
        kept = set()
        try:
            with preflight._flex_lowered_as_on_gpu([]), flex_inputs_kept(kept), \
                    reading_the_scheduler(kind, kernels, vocab, kept):
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
                inductor_config.patch(cpu_backend="triton", fx_graph_cache=False, force_disable_caches=True), \
                decisions_as_on_cuda():
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


def representative_tiles(T, seed=0, a=None):
    """Tiles a FlexAttention op visits on a synthetic row like the GPU check's (documents of ~1140 tokens, up to
    16Ki): the long and short attention windows averaged over the schedule of a (Hyperparameters; the record's
    by default: 1 -> 14 blocks over 1770 steps), the CP head's masks (whole documents, no window). Per op: (tiles,
    of them partial, the most one query block visits). A query block's tiles are one thread block's loop, in order:
    the longest loop bounds the kernel however many SMs."""
    tokens = synthetic_tokens(T + 1, np.random.default_rng(seed))
    ids = torch.from_numpy(tokens[:T].astype(np.int64))[None]
    doc_ids = tg.doc_ids_of(ids, 50256)
    tiles = tg.document_blocks(doc_ids)

    def count(window):
        (p_count, _), (f_count, _) = tg.within_window(tiles, window)
        return int(p_count.sum() + f_count.sum()), int(p_count.sum()), int((p_count + f_count).max())

    a = a or tg.Hyperparameters()  # the record's schedule
    steps = a.num_iterations
    schedule = collections.Counter(tg.window_blocks(s, a) for s in range(steps))
    mean = {}
    for name, shrink in (("long", 1), ("short", 2)):
        per_window = {w: count(torch.tensor(w // shrink)) for w in schedule}
        mean[name] = tuple(sum(per_window[w][i] * n for w, n in schedule.items()) / steps for i in (0, 1, 2))
    whole = count(None)
    return {"attention long": mean["long"], "attention short": mean["short"], "CP document mask": whole,
            "CP match mask": (whole[0], whole[0], whole[2])}  # all partial: the token test runs in every tile


def flex_kernels(op, tiles, matmuls=None, vectors=None, lses=None, delta=None, block=128):
    """The kernels of a FlexAttention op, from its tiles: per tile two matmuls forward (Q K^T, P V) and five backward
    (Q K^T again, dP, dV, dQ, dK), 128 x 128 x d each (x dv, the value's width, for P V, dP and dV); HBM bytes: q,
    k, v, the output and the LSE (forward), q, k, v, the output's gradient, dq, dk, dv, the LSE and delta
    (backward), bf16; K and V re-read per tile from L2, not
    HBM. The backward starts with its own kernel for delta (the row sums of the output times its gradient). matmuls,
    vectors, lses, delta, block (its tiles' side): another kernel's (an LSE-only one). Timed by seconds()."""
    backward = op["backward"]
    d, dv = op["d"], op.get("dv", op["d"])  # the value's width (the CP head's: 16, a zero) sets P V's, dP's, dV's
    lses = lses or (2 if backward else 1)
    row, lse = op["T"] * op["H"] * 2, op["T"] * op["H"] * 4  # bytes of one bf16 column a head; an LSE row
    if matmuls is None:  # forward Q K^T (d), P V (dv); backward Q K^T, dQ, dK (d), dP, dV (dv)
        tile_flops = 2 * 128 * 128 * ((3 * d + 2 * dv) if backward else (d + dv))
    else:  # an LSE-only kernel's: every matmul d wide
        tile_flops = matmuls * 2 * block * block * d
    # forward q, k (d wide), v, the output (dv); backward q, k, dq, dk (d) and v, the output's gradient, dv (dv)
    moved = vectors * d * row if vectors is not None else row * ((4 * d + 3 * dv) if backward else (2 * d + 2 * dv))
    kernel = dict(graph=op["graph"], what="flex " + ("backward" if backward else "forward"),
                  category=CATEGORIES[1] if op["role"].startswith("CP") else CATEGORIES[2],
                  bytes=moved + lses * lse, flops=tile_flops * tiles[0] * op["H"], rate="flex",
                  name=op["role"], tiles=tiles, heads=op["H"], dim=op["d"], tile_flops=tile_flops)
    if not (backward if delta is None else delta):
        return [kernel]
    return [dict(kernel, what="flex delta", bytes=2 * dv * row + lse, flops=0, rate="bf16", tiles=None), kernel]


def seconds(k, card):
    """A kernel's time on the card by its roofline. A FlexAttention kernel's: its tiles spread over the SMs, or the
    longest loop one query block runs (its tiles one after another, at one SM's share of the rate), whichever is
    longer; the backward's key-block loops are as long (whole documents visited from both sides)."""
    if k.get("tiles"):
        total, _, longest = k["tiles"]
        tile_s = k["tile_flops"] / (FLEX_EFFICIENCY * card.bf16 / card.sms)
        return max(k["bytes"] / card.bandwidth, tile_s * max(total * k["heads"] / card.sms, longest))
    return max(k["bytes"] / card.bandwidth, k["flops"] / (card.fp8 if k["rate"] == "fp8" else card.bf16))


def optimizer_cost(cplm, a=None):
    """(bytes, FLOPs, launches) of the optimizer step as build_optimizers sets it up on CUDA. Muon, per matrix:
    Newton-Schulz compiled as on CUDA (bf16; its kernels read at the scheduler like the model's, once per shape) and
    three eager kernels (the momentum's two lerps and the update: 36 bytes a parameter). Adam, fused: each parameter,
    its gradient and two moments read, three written, in the parameter's dtype (the embeddings bf16 on CUDA), about
    one launch a parameter group. The same in both modes but for the CP head's two matrices (Adam's). a:
    Hyperparameters (the model's shape, the optimizers' settings); the speedrun preset's by default."""
    a = dataclasses.replace(a or tg.Hyperparameters(), cplm=cplm)
    with torch.device("meta"):
        model = tg.GPT(tg.GPTConfig(cplm=cplm, fp8_head=1, **model_config(a)))
    adam, muon = tg.build_optimizers(model, a, 0, 1)
    embeddings = {id(model.embed.weight)} | {id(e.weight) for e in model.value_embeds}
    nbytes = sum(7 * (2 if id(p) in embeddings else 4) * p.numel() for g in adam.param_groups for p in g["params"])
    flops, launches = 0, len(adam.param_groups)
    shapes = collections.Counter(tuple(p.shape) for g in muon.param_groups for p in g["params"])
    for shape, n in shapes.items():
        kernels, _ = graph_kernels(tg.newton_schulz, (torch.zeros(shape),), backward=False)
        nbytes += n * (sum(k["bytes"] for k in kernels) + 36 * math.prod(shape))
        flops += n * sum(k["flops"] for k in kernels)
        launches += n * (len(kernels) + 3)
    return nbytes, flops, launches


def optimizer_seconds(optimizer, card):
    nbytes, flops, _ = optimizer
    return max(nbytes / card.bandwidth, flops / card.bf16)


def attention_windows(flex, **config):
    """Each attention op's role, long or short window, as window_pattern gives its layer (config: GPTConfig's fields;
    the record: 3 of its 11 layers with attention long, gpu1 2 of 4): forward ops in the layers' order, backward ops
    in reverse. Which op is which matters only for its tiles."""
    shape = tg.GPTConfig(**config)
    long = [w for i, w in enumerate(tg.window_pattern(shape.num_layers)) if i != shape.no_attention_layer]
    attention = [op for op in flex if op["role"] in ("attention", "attention long", "attention short")]
    for direction in (False, True):
        ops = [op for op in attention if op["backward"] == direction]
        assert len(ops) == len(long), (len(ops), len(long))
        for op, is_long in zip(ops, long[::-1] if direction else long):
            op["role"] = "attention long" if is_long else "attention short"
    return flex


def mode_kernels(cplm, T, tiles, **config):
    """([Kernel], [flex op]) of one mode's step (config: GPTConfig's fields): the kernels read at the scheduler,
    then its FlexAttention ops' kernels from their tiles."""
    kernels, flex = step_kernels(cplm, T, **config)
    attention_windows(flex, **config)
    for op in flex:
        kernels.extend(flex_kernels(op, tiles[op["role"]]))
    return kernels, flex


def mode_table(T, a=None):
    """Per mode: its kernels (with the flex ops' kernels), its flex ops and the optimizer's cost, for the model and
    schedule of a (Hyperparameters; the speedrun preset's by default) at T tokens a row."""
    a = a or tg.Hyperparameters()
    tiles = representative_tiles(T, a=a)
    out = {}
    for cplm in (0, 1):
        t0 = time.perf_counter()
        kernels, flex = mode_kernels(cplm, T, tiles, **model_config(a))
        out["CPLM" if cplm else "vanilla"] = dict(kernels=kernels, flex=flex, optimizer=optimizer_cost(cplm, a),
                                                  vocab=tg.GPTConfig().padded_vocab, seconds=time.perf_counter() - t0)
    return out, tiles


def totals(kernels, card):
    times = [seconds(k, card) for k in kernels]
    return dict(launches=len(kernels), bytes=sum(k["bytes"] for k in kernels), flops=sum(k["flops"] for k in kernels),
                seconds=sum(times), floored=sum(max(t, LAUNCH_FLOOR_S) for t in times))


def step_floor(mode, card):
    """(roofline, with launches) of a whole step: the kernels and the optimizer."""
    t = totals(mode["kernels"], card)
    opt = optimizer_seconds(mode["optimizer"], card)
    return t["seconds"] + opt, t["floored"] + opt + mode["optimizer"][2] * LAUNCH_FLOOR_S


CHANGES = ("one LSE-only kernel for both CP log-sum-exps", "one read of the logits for the head's three terms",
           "the document tiles reused between the two CP flex calls")


def changes(modes, tiles, card):
    """{change: (kernels now, kernels after, (ms saved by the roofline, with launches))} on the card, for the three
    changes the reading names. 1: one LSE-only FlexAttention kernel for both CP log-sum-exps over the document tiles
    (the match set is a subset): forward one matmul a tile (Q K^T) reading q and k and writing two LSEs, backward
    three (Q K^T, dQ, dK) reading q, k, both LSEs and their gradients and writing dq and dk, for the two ops' four
    kernels and their delta kernels. 2: the head's three terms from one read of the bf16 logits forward, one read
    and the gradient's one write backward, for CPLM's kernels over the (T, V) logits (the FP8 matmuls apart). 3: the
    match mask's lists (both directions) made in one small kernel from the document mask's, which hold the same
    tiles, for the kernels that build them again from the document ids."""
    cplm = modes["CPLM"]["kernels"]
    op = next(o for o in modes["CPLM"]["flex"] if o["role"] == "CP document mask")
    T, Vp, nb = op["T"], modes["CPLM"]["vocab"], -(-op["T"] // tg.BLOCK)
    one = [*flex_kernels(dict(op, backward=False), tiles["CP document mask"], matmuls=1, vectors=2, lses=2),
           *flex_kernels(dict(op, backward=True), tiles["CP document mask"], matmuls=3, vectors=4, lses=4,
                         delta=False)]
    plain = lambda nbytes: dict(bytes=nbytes, flops=0, rate="bf16")  # noqa: E731
    now = (cp_flex_kernels(cplm),
           [k for k in cplm if k.get("logits")],
           [k for k in cplm if k.get("match_tiles")])
    after = (one, [plain(2 * T * Vp), plain(4 * T * Vp)],
             [plain(6 * (nb * nb + nb) * 4)])  # the four lists of the document mask read, the two written

    out = {}
    for name, old, new in zip(CHANGES, now, after):
        (a, b), (c, d) = cost(old, card), cost(new if old else [], card)
        out[name] = (len(old), len(new) if old else 0, (a - c, b - d))
    return out


def cp_flex_kernels(kernels):
    """The CP head's FlexAttention kernels among a mode's (its two ops' forward, backward and delta kernels)."""
    return [k for k in kernels if k["category"] == CATEGORIES[1] and k["what"].startswith("flex")]


def cost(kernels, card):
    """(seconds, seconds with the launch floor under each kernel) of these kernels on the card (totals')."""
    t = totals(kernels, card)
    return t["seconds"], t["floored"]


@functools.lru_cache(maxsize=None)  # as_written asks once a card for the same row
def kernel_tiles(T, block, seed=0):
    """The tiles cp_kernel.py's programs visit on the representative row (representative_tiles'), block x block:
    {"queries": ..., "keys": ...}, each (tiles, 0, the longest loop). A query block's loop (the forward, dq) runs from
    its first query's document start to itself; a key block's (dk) from itself to its last key's document end."""
    ids = torch.from_numpy(synthetic_tokens(T + 1, np.random.default_rng(seed))[:T].astype(np.int64))
    doc_ids = tg.doc_ids_of(ids[None], 50256)[0]
    start = torch.searchsorted(doc_ids, doc_ids, side="left")
    end = torch.searchsorted(doc_ids, doc_ids, side="right") - 1
    first = torch.arange(0, T, block)
    last = torch.clamp(first + block, max=T) - 1
    loops = {"queries": first // block - start[first] // block + 1, "keys": end[last] // block - first // block + 1}
    return {side: (int(n.sum()), 0, int(n.max())) for side, n in loops.items()}


def as_written(modes, card):
    """(kernels now, kernels after, (ms saved, with launches)) on the card for the LSE-only kernel as cp_kernel.py
    writes it: a forward (one matmul a tile; reads q and k, writes both LSEs), dq (two: Q K^T again and dS K) and dk
    (Q K^T and dS^T Q), each reading q, k, both LSEs and their gradients; 64 x 64 tiles from kernel_tiles; the int32
    ids, targets, document ids and bounds and the int8 flags, 21 bytes a token, counted as 5.25 float rows."""
    op = next(o for o in modes["CPLM"]["flex"] if o["role"] == "CP document mask")
    tiles = kernel_tiles(op["T"], 64)
    ints = 21 / 4
    new = [*flex_kernels(dict(op, backward=False), tiles["queries"], matmuls=1, vectors=2, lses=2 + ints, block=64),
           *flex_kernels(dict(op, backward=True), tiles["queries"], matmuls=2, vectors=3, lses=4 + ints, delta=False,
                         block=64),
           *flex_kernels(dict(op, backward=True), tiles["keys"], matmuls=2, vectors=3, lses=4 + ints, delta=False,
                         block=64)]
    old = cp_flex_kernels(modes["CPLM"]["kernels"])
    (a, b), (c, d) = cost(old, card), cost(new, card)
    return len(old), len(new), (a - c, b - d)


def markdown(modes, tiles, T, wall_s, cards, a=None, command=None):
    """The report: a (Hyperparameters) the model's and schedule's preset (the speedrun's by default), command the
    one that made it."""
    gb, tf, ms = 1e9, 1e12, 1e3
    a = a or tg.Hyperparameters(preset="speedrun")
    command = command or f"python3 gpu_check/roofline.py > {RECORDS['speedrun']}"
    names = " and ".join("an " + card.name.split()[0] for card in cards)
    lines = [f"# CPLM's extra step time on {names}, estimated on a CPU (a roofline"
             + ("" if a.preset == "speedrun" else f" of the {a.preset} preset") + ")", "",
             f"`{command}` (torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}, {wall_s:.0f} s on 2 busy cores). The {a.preset} preset's training step "
             f"({shape_words(a)}), one "
             f"{T // 1024}Ki-token row on one GPU (forward, backward, optimizer), each kernel as inductor fuses it for "
             "the CUDA path (gpu_check/roofline.py's docstring says how, and what it cannot see). A kernel's time is "
             "max(bytes / bandwidth, FLOPs / rate) on each card; 'with launches' puts a floor of "
             f"{LAUNCH_FLOOR_S * 1e6:.0f} us under every kernel (the GPU waiting on the host's launches).", "",
             "| card | HBM: spec, achievable (share) | bf16 GEMM | FP8 | FlexAttention | SMs |",
             "|---|---|---|---|---|---|"]
    for card in cards:
        lines.append(f"| {card.name} | {card.spec_bandwidth / tf:.2f}, {card.bandwidth / tf:.2f} TB/s "
                     f"({card.derating:.3f}) | {card.bf16 / tf:.1f} TFLOP/s | {card.fp8 / tf:.0f} TFLOP/s | "
                     f"{FLEX_EFFICIENCY:.0%} of bf16's | {card.sms} |")
    lines += ["", "Achievable bandwidth: BabelStream's Copy (an array read, one written) as Azure's "
              "AI-benchmarking-guide publishes it for its ND H100 v5 (2.90 TB/s) and ND H200 v5 (4.01 TB/s) machines; "
              "no bandwidth was measured for these records (the floors at other shares are below). bf16: the H200's "
              "GEMM at 8192^3 in records/gpu/2026-12-04 (787-810 TFLOP/s); the H100's maximum achievable matmul FLOPS "
              "in stas00/ml-engineering (794.5 TFLOP/s, torch 2.7, a search over shapes; the same table gives FP8 "
              "1403 TFLOP/s on the H100 and 1453 on the H200, under twice bf16). FlexAttention's share is an "
              "assumption (FlashAttention-2 reaches 35-50% of the bf16 rate for head dims 64-128 with causal "
              "masks).", "",
              "## The floor of a step, per card", "",
              "| card | mode | kernels a step (forward, backward, optimizer) | HBM bytes | FLOPs | roofline | "
              "with launches |", "|---|---|---|---|---|---|---|"]
    for card in cards:
        for mode, m in modes.items():
            t = totals(m["kernels"], card)
            ob, of, ol = m["optimizer"]
            by = collections.Counter(k["graph"] for k in m["kernels"])
            roof, floored = step_floor(m, card)
            lines.append(f"| {card.name} | {mode} | {by['forward']}, {by['backward']}, ~{ol} | "
                         f"{(t['bytes'] + ob) / gb:.1f} GB | {(t['flops'] + of) / tf:.2f} T | {roof * ms:.1f} ms | "
                         f"{floored * ms:.1f} ms |")
        (vr, vf), (cr, cf) = step_floor(modes["vanilla"], card), step_floor(modes["CPLM"], card)
        lines.append(f"| {card.name} | CPLM / vanilla | | | | {cr / vr:.4f} ({(cr - vr) * ms:+.2f} ms) | "
                     f"{cf / vf:.4f} ({(cf - vf) * ms:+.2f} ms) |")
    record = a.preset == "speedrun" and T == 48 * 1024 and model_config(a) == model_config(tg.Hyperparameters())
    lines += ["", "Measured on the H200 (records/gpu/README.md): vanilla 99.8-107.5 ms a step, CPLM 102.4-111.7 ms, "
              "CPLM / vanilla 1.03-1.04 (+2.6 to +4.2 ms). Not measured on an H100." if record else
              "Not measured at this size: the step times measured on the H200 (records/gpu/README.md) are the "
              "speedrun preset's (12 x 768, one 48Ki-token row).", "",
              "How the floors move with the bandwidth's share (the measured copy's share is the table's; 0.92: "
              "torchao's roofline takes 92% for large pointwise Triton kernels on its H100s) and with FP8 at the "
              "measured 1403 / 1453 TFLOP/s instead of twice bf16:", "",
              "| bandwidth share | " + " | ".join(f"{card.name}: vanilla, CPLM, CPLM - vanilla (ms)" for card in cards)
              + " |", "|---|" + "---|" * len(cards)]
    variants = [("copy (the table's)", list(cards))]
    variants += [(f"{share:.2f}", [card._replace(derating=share) for card in cards]) for share in (0.80, 0.92, 1.00)]
    variants.append(("copy; FP8 as measured", [card._replace(fp8_rate=FP8_MEASURED[card.name]) for card in cards]))
    for label, row_cards in variants:
        cells = []
        for card in row_cards:
            v, c = (step_floor(modes[m], card)[0] for m in ("vanilla", "CPLM"))
            cells.append(f"{v * ms:.1f}, {c * ms:.1f}, {(c - v) * ms:+.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## The floor by part of the model, per card (forward and backward; the optimizer analytic)", "",
              "| part | " + " | ".join(f"{card.name.split()[0]}: vanilla, CPLM, ms (with launches)" for card in cards)
              + " |", "|---|" + "---|" * len(cards)]
    for cat in CATEGORIES:
        cells = []
        for card in cards:
            v, c = (totals([k for k in modes[m]["kernels"] if k["category"] == cat], card) for m in ("vanilla", "CPLM"))
            cells.append(f"{v['seconds'] * ms:.2f}, {c['seconds'] * ms:.2f} ({v['floored'] * ms:.2f}, "
                         f"{c['floored'] * ms:.2f})")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    cells = []
    for card in cards:
        v, c = (optimizer_seconds(modes[m]["optimizer"], card) for m in ("vanilla", "CPLM"))
        nv, nc = (modes[m]["optimizer"][2] * LAUNCH_FLOOR_S for m in ("vanilla", "CPLM"))
        cells.append(f"{v * ms:.2f}, {c * ms:.2f} ({(v + nv) * ms:.2f}, {(c + nc) * ms:.2f})")
    lines.append("| optimizer (analytic) | " + " | ".join(cells) + " |")
    lines += ["", "## By part of the model (forward and backward; the optimizer apart)", "",
              "| part | vanilla: kernels, GB, TFLOP | CPLM: kernels, GB, TFLOP | "
              + " | ".join(f"CPLM - vanilla on the {card.name.split()[0]}, ms (with launches)" for card in cards)
              + " |",
              "|---|---|---|" + "---|" * len(cards)]
    diffs = [[0.0, 0.0] for _ in cards]
    for cat in CATEGORIES:
        cells, diff_cells = [], []
        for mode, m in modes.items():
            t = totals([k for k in m["kernels"] if k["category"] == cat], cards[0])
            cells.append(f"{t['launches']}, {t['bytes'] / gb:.2f}, {t['flops'] / tf:.3f}")
        for i, card in enumerate(cards):
            v, c = (totals([k for k in modes[m]["kernels"] if k["category"] == cat], card) for m in ("vanilla", "CPLM"))
            d, df = c["seconds"] - v["seconds"], c["floored"] - v["floored"]
            diffs[i][0] += d
            diffs[i][1] += df
            diff_cells.append(f"{d * ms:+.2f} ({df * ms:+.2f})")
        lines.append(f"| {cat} | {cells[0]} | {cells[1]} | " + " | ".join(diff_cells) + " |")
    opt = [optimizer_seconds(modes["CPLM"]["optimizer"], card) - optimizer_seconds(modes["vanilla"]["optimizer"], card)
           for card in cards]
    lines.append("| optimizer (analytic) | | | " + " | ".join(f"{o * ms:+.3f}" for o in opt) + " |")
    lines.append("| **all** | | | " + " | ".join(f"**{(d + o) * ms:+.2f} ({(df + o) * ms:+.2f})**"
                                                for (d, df), o in zip(diffs, opt)) + " |")
    lines += ["", "## The LM head's loss: its kernels over the (T, V) logits (the FP8 matmuls apart)", "",
              f"The logits are {T} x {modes['CPLM']['vocab']} bf16 ({T * modes['CPLM']['vocab'] * 2 / gb:.2f} GB); "
              "vanilla's loss is the record's `F.cross_entropy`, CPLM's `lm_head_terms`, each as inductor schedules it "
              "for CUDA (its online softmax included).", "",
              "| mode | graph | kernel | HBM bytes | " + " | ".join(f"{card.name.split()[0]} ms" for card in cards)
              + " | FX nodes (first) |", "|---|---|---|---|" + "---|" * len(cards) + "---|"]
    for mode, m in modes.items():
        for k in m["kernels"]:
            if k["category"] == CATEGORIES[0] and k.get("logits"):
                lines.append(f"| {mode} | {k['graph']} | {k['what']} | {k['bytes'] / gb:.2f} GB | "
                             + " | ".join(f"{seconds(k, card) * ms:.2f}" for card in cards) + f" | {k['name'][:60]} |")
    lines += ["", "## The three changes the reading names: CPLM's step time each saves by this roofline", "",
              "| change | kernels now, after | " + " | ".join(f"{card.name.split()[0]}: ms (with launches)"
                                                           for card in cards) + " |", "|---|---|" + "---|" * len(cards)]
    per_card = [changes(modes, tiles, card) for card in cards]
    for name in per_card[0]:
        now, after, _ = per_card[0][name]
        lines.append(f"| {name} | {now}, {after} | " + " | ".join(
            f"{c[name][2][0] * ms:.2f} ({c[name][2][1] * ms:.2f})" for c in per_card) + " |")
    lines.append("| all three | | " + " | ".join(
        f"{sum(v[2][0] for v in c.values()) * ms:.2f} ({sum(v[2][1] for v in c.values()) * ms:.2f})"
        for c in per_card) + " |")

    def ratio_cells(saved):
        """CPLM / vanilla on each card after saving (seconds, with the launch floor) there."""
        cells = []
        for card, (sr, sf) in zip(cards, saved):
            (vr, vf), (cr, cf) = step_floor(modes["vanilla"], card), step_floor(modes["CPLM"], card)
            cells.append(f"{(cr - sr) / vr:.4f} ({(cf - sf) / vf:.4f})")
        return " | ".join(cells)
    lines.append("| CPLM / vanilla after all three | | " + ratio_cells(
        [tuple(sum(v[2][i] for v in c.values()) for i in (0, 1)) for c in per_card]) + " |")
    written = [as_written(modes, card) for card in cards]
    lines.append(f"| the first as cp_kernel.py writes it (--cp_backend lse_kernel: a forward, dq and dk; 64 x 64 "
                 f"tiles) | {written[0][0]}, {written[0][1]} | " + " | ".join(
                     f"{w[2][0] * ms:.2f} ({w[2][1] * ms:.2f})" for w in written) + " |")
    lines.append("| CPLM / vanilla with cp_kernel.py | | " + ratio_cells([w[2] for w in written]) + " |")
    lines += ["", "## The CP head's FlexAttention ops and attention's, from their tiles", "",
              f"Tiles of 128 x 128 visited on a {T // 1024}Ki-token synthetic row (sum L^2 / T^2 as the GPU check's "
              f"data); attention's windows averaged over the {a.preset} preset's {a.num_iterations} steps "
              f"({a.attn_window_start} -> {a.attn_window} tokens). A query block's tiles are one thread "
              f"block's loop: an op takes at least its longest loop, however many of the {cards[0].sms} SMs are "
              "idle. Each backward starts with its delta kernel (counted here).", "",
              "| op | tiles a head (partial) | the longest loop (tiles) | heads x dim | "
              "forward + backward: GB, TFLOP | "
              + " | ".join(f"{card.name.split()[0]}: ms (if balanced)" for card in cards) + " |",
              "|---|---|---|---|---|" + "---|" * len(cards)]
    flex = collections.OrderedDict()
    for k in modes["CPLM"]["kernels"]:
        if k["what"].startswith("flex"):
            flex.setdefault(k["name"], []).append(k)
    for role, ks in flex.items():
        n_ops = sum(1 for k in ks if k["what"] == "flex forward")
        tiled = [k for k in ks if k.get("tiles")]
        H, d = tiled[0]["heads"], tiled[0]["dim"]
        cells = []
        for card in cards:
            balanced = sum(max(k["bytes"] / card.bandwidth, k["flops"] / (FLEX_EFFICIENCY * card.bf16))
                           if k.get("tiles") else seconds(k, card) for k in ks)
            cells.append(f"{sum(seconds(k, card) for k in ks) * ms:.2f} ({balanced * ms:.2f})")
        lines.append(f"| {role} ({n_ops} layer{'s' if n_ops != 1 else ''}) | {tiled[0]['tiles'][0]:.0f} "
                     f"({tiled[0]['tiles'][1]:.0f}) | {tiled[0]['tiles'][2]:.0f} | {H} x {d} | "
                     f"{sum(k['bytes'] for k in ks) / gb:.3f}, {sum(k['flops'] for k in ks) / tf:.3f} | "
                     + " | ".join(cells) + " |")
    cp = sorted((k for k in modes["CPLM"]["kernels"] if k["category"] == CATEGORIES[1]),
                key=lambda k: -seconds(k, cards[-1]))
    lines += ["", f"## The CP head's kernels ({len(cp)}), by time", "",
              "| graph | kernel | HBM bytes | FLOPs | " + " | ".join(f"{card.name.split()[0]} us" for card in cards)
              + " | FX nodes (first) |", "|---|---|---|---|" + "---|" * len(cards) + "---|"]
    for k in cp[:25]:
        lines.append(f"| {k['graph']} | {k['what']} | {k['bytes'] / 1e6:.2f} MB | {k['flops'] / 1e9:.2f} G | "
                     + " | ".join(f"{seconds(k, card) * 1e6:.1f}" for card in cards) + f" | {k['name'][:60]} |")
    small = sum(1 for k in cp if seconds(k, cards[0]) < LAUNCH_FLOOR_S)
    lines += ["", f"{small} of the CP head's {len(cp)} kernels take under {LAUNCH_FLOOR_S * 1e6:.0f} us by the "
              f"{cards[0].name}'s roofline."]
    return "\n".join(lines)


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=tuple(RECORDS), default="speedrun",
                   help="train_gpt_cplm's preset whose model, row and schedule it reads (speedrun: 12 x 768, 48Ki "
                        "tokens; gpu1, the one-GPU race's: 4 x 768, attention in every layer, 32Ki)")
    p.add_argument("--seq_len", type=int, default=None, help="tokens in the row (default: the preset's)")
    p.add_argument("--num_layers", type=int, default=None, help="transformer blocks (default: the preset's)")
    p.add_argument("--no_attention_layer", type=int, default=None,
                   help="the layer with an MLP only, -1 none (default: the preset's)")
    p.add_argument("--card", choices=(*CARDS, "both"), default="both", help="the card(s) whose roofline times it")
    return p


def hyperparameters(args):
    """The preset's Hyperparameters with the command line's changes; a bad shape is a one-line error."""
    given = {k: getattr(args, k) for k in ("seq_len", "num_layers", "no_attention_layer")
             if getattr(args, k) is not None}
    a = preset_hyperparameters(args.preset, **given)
    if a.seq_len <= 0 or a.seq_len % tg.BLOCK:
        raise ValueError(f"--seq_len must be a positive multiple of {tg.BLOCK}, not {a.seq_len}")
    if a.num_layers < 2 or a.num_layers % 2 or a.no_attention_layer >= a.num_layers or a.no_attention_layer < -1:
        raise ValueError(f"--num_layers must be even and >= 2 and --no_attention_layer -1 or below it, not "
                         f"{a.num_layers} and {a.no_attention_layer}")
    return a


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    try:
        a = hyperparameters(args)
    except ValueError as e:
        print(f"roofline.py: error: {e}", file=sys.stderr)
        return 2
    cards = list(CARDS.values()) if args.card == "both" else [CARDS[args.card]]
    command = shlex.join(["python3", "gpu_check/roofline.py", *argv])
    if [x for x in argv if x not in ("--preset", args.preset)] == []:  # the preset as recorded: where it is kept
        command += f" > {RECORDS[args.preset]}"
    t0 = time.perf_counter()
    modes, tiles = mode_table(a.seq_len, a)
    print(markdown(modes, tiles, a.seq_len, time.perf_counter() - t0, cards, a=a, command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
