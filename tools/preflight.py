"""GPU pre-flight on a machine without a GPU: every graph the CUDA path compiles, pushed through inductor's
lowering as far as a CPU machine can go, so that the first GPU call can fail only where a GPU is needed.

Tracing a graph (aot_eager, as test_cplm.py's CUDA-path test does) is not enough: inductor's *lowering* of
that graph is a separate step with its own failures (the CP head's flex backward once received grad_out =
None there and raised `'NoneType' object has no attribute 'make_loader'`, which no eager run can show).

How it gets there on a CPU:
  - torch.compile with inductor's own compile_fx (pre-grad passes, AOT autograd with inductor's
    decompositions, the joint-graph passes, the min-cut partitioner), whose per-graph step compile_fx_inner
    is wrapped: it runs the real one and then runs the graph eagerly, so the step goes on and the backward
    graph is produced and lowered too;
  - inductor's `cpu_backend = "triton"`: the CPU graph is scheduled for Triton, the GPU code generator;
  - FlexAttention's lowerings are told the device is CUDA (the forward would otherwise take its C++ CPU
    template, which the GPU never runs), and their Python API's CPU device check is lifted;
  - where a FlexAttention lowering reaches its Triton template, which needs a GPU toolchain, the pre-flight
    records that stop and puts placeholders of the op's output shapes in its place, so that the lowering of
    the rest of the graph goes on. Each graph then ends at code generation, which needs Triton.

Where it stops (asserted per graph by `expect_gpu_stops`): `No module named 'triton'` on a build without
Triton (the CPU wheels, e.g. torch 2.13.0+cpu), `0 active drivers` where Triton is installed but no GPU is
present (the default CUDA wheels, e.g. 2.11 and 2.14.1, on a CPU machine); inside a FlexAttention lowering
also at a query of the CUDA device's properties. Anything else is a finding.
With Triton installed (`pip install triton==3.6.0`), `lower(..., sm90=True)` goes further for the
FlexAttention ops: Triton's driver is replaced by one whose target is sm_90 and the CUDA device's properties
by an H200's, so inductor renders each FlexAttention kernel with the CUDA heuristics (the configs an H100/H200
gets), and `compile_cubin` compiles it to sm_90 machine code with Triton's bundled ptxas: shared memory,
registers and spills, as the GPU would get them (test_gpu_kernels.py). `with card("sm_80")` (an A100) or
`card("sm_89")` (an RTX 4090, L4, L40S) does the same for that card: its heuristics, its machine code.
What only a GPU can show: autotuning, FP8 matmuls in hardware, memory, speed (records/gpu/README.md).
"""
import contextlib
import dataclasses
import importlib.util
import os
import re
import subprocess
import tempfile
import types
import unittest.mock

import torch
import torch._inductor.config as inductor_config
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.graph import GraphLowering
from torch.utils._pytree import tree_map

# the messages at which a CPU machine legitimately stops: no Triton at all; Triton without a GPU driver...
TRITON_NEEDED = ("No module named 'triton'", "0 active drivers", "0 compatible backends for target (cpu)")
# ...and, inside a FlexAttention lowering only (told the device is CUDA), a query of the CUDA device
GPU_NEEDED = TRITON_NEEDED + ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver",
                              "No CUDA GPUs are available")


def gpu_needed(exc: BaseException, messages=GPU_NEEDED) -> str | None:
    """The first of `messages` found in exc or the exceptions it wraps, else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = f"{type(exc).__name__}: {exc}"
        for message in messages:
            if message in text:
                return message
        exc = exc.__cause__ or exc.__context__
    return None


@dataclasses.dataclass
class GraphResult:
    kind: str                 # "forward", "backward" or "inference"
    ops: int                  # call_function nodes in the graph
    flex_stops: list          # (flex op, message) for each FlexAttention op lowered up to a GPU-only step
    stop: str | None = None   # the TRITON_NEEDED message at which the graph's compilation stopped; None: none
    codegen: bool = False     # the whole graph was lowered and code generation began
    error: str | None = None  # anything else that stopped it: a finding
    kernels: list = dataclasses.field(default_factory=list)  # sm90=True: the FlexKernels its flex ops rendered

    def line(self):
        end = f"FAILED: {self.error}" if self.error else (
            f"code generation stopped at {self.stop!r}" if self.stop else "compiled")
        return (f"{self.kind:9s} graph: {self.ops} ops, {len(self.flex_stops)} FlexAttention op(s) lowered up to "
                f"a GPU-only step; {end}")


def _flex_ops():
    return [getattr(torch.ops.higher_order, name) for name in ("flex_attention", "flex_attention_backward")
            if hasattr(torch.ops.higher_order, name)]


# the cards as CUDA reports them (torch.cuda.get_device_properties): what inductor's heuristics read. The shared
# memory a kernel may ask for (opt-in, per block) decides whether it launches: sm_90 227 KiB, sm_80 163, sm_89 99
H200 = types.SimpleNamespace(
    name="NVIDIA H200 (the pre-flight's stand-in)", major=9, minor=0, multi_processor_count=132, warp_size=32,
    regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
    shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
    total_memory=143771 * 2 ** 20, L2_cache_size=60 * 2 ** 20, gcnArchName="", uuid="00000000")
A100 = types.SimpleNamespace(**{**vars(H200), **dict(
    name="NVIDIA A100-SXM4-80GB (the pre-flight's stand-in)", major=8, minor=0, multi_processor_count=108,
    shared_memory_per_block_optin=166912, shared_memory_per_multiprocessor=167936, total_memory=81920 * 2 ** 20,
    L2_cache_size=40 * 2 ** 20)})
RTX_4090 = types.SimpleNamespace(**{**vars(H200), **dict(  # sm_89, as the L4 and L40S
    name="NVIDIA GeForce RTX 4090 (the pre-flight's stand-in)", major=8, minor=9, multi_processor_count=128,
    max_threads_per_multi_processor=1536, shared_memory_per_block_optin=101376,
    shared_memory_per_multiprocessor=102400, total_memory=24564 * 2 ** 20, L2_cache_size=72 * 2 ** 20)})
CARDS = {"sm_90": H200, "sm_80": A100, "sm_89": RTX_4090}
_card = H200  # the card the lowering and the compiler target: card(name) sets it


@contextlib.contextmanager
def card(name):
    """Kernels rendered (inductor's heuristics for that capability and properties) and compiled for CARDS[name]."""
    global _card
    saved, _card = _card, CARDS[name]
    try:
        yield _card
    finally:
        _card = saved


def capability():
    return _card.major * 10 + _card.minor


@dataclasses.dataclass
class FlexKernel:
    """One FlexAttention kernel as inductor rendered it for the card (a Triton template's module)."""
    op: str             # flex_attention or flex_attention_backward
    module_path: str
    kernel_name: str
    num_warps: int
    num_stages: int
    options: dict       # the template's constants: BLOCK_M, BLOCK_N, QK_HEAD_DIM, ...
    source: str         # the kernel's source: equal sources compile to the same machine code

    def label(self):
        o = self.options
        blocks = f"BLOCK_M{o.get('BLOCK_M', o.get('BLOCK_M1'))}/N{o.get('BLOCK_N', o.get('BLOCK_N1'))}"
        return (f"{'backward' if self.op.endswith('backward') else 'forward'} head_dim {o.get('QK_HEAD_DIM')} "
                f"{blocks} warps {self.num_warps} stages {self.num_stages}")


@contextlib.contextmanager
def _as_gpu():
    """Triton's driver and torch's CUDA queries answer as the card (default an H200, sm_90) would; nothing runs
    on it."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver
    major_minor = (_card.major, _card.minor)

    class Gpu(DriverBase):  # what inductor asks the driver while it renders a kernel
        is_active = classmethod(lambda cls: True)
        get_current_target = lambda self: GPUTarget("cuda", capability(), 32)  # noqa: E731
        get_active_torch_device = lambda self: torch.device("cuda", 0)  # noqa: E731
        get_current_device = lambda self: 0  # noqa: E731
        get_device_capability = lambda self, *a: major_minor  # noqa: E731

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_benchmarker(self):
            raise RuntimeError("no GPU to benchmark on")

    saved = driver._active
    driver.set_active(Gpu())
    props = lambda *a, **k: _card  # noqa: E731
    try:
        with unittest.mock.patch("torch.cuda.get_device_properties", props), \
                unittest.mock.patch("torch._dynamo.device_interface.CudaInterface.get_device_properties", props), \
                unittest.mock.patch("torch.cuda.get_device_capability", lambda *a, **k: major_minor):
            yield
    finally:
        driver._active = saved


def _rendered_templates(into: list):
    """Records every Triton template inductor renders (its choices for a FlexAttention op)."""
    from torch._inductor import select_algorithm
    generate = select_algorithm.TritonTemplate.generate

    def recording(self, *args, **kwargs):
        choice = generate(self, *args, **kwargs)
        if choice is not None and getattr(choice, "bmreq", None) is not None:
            into.append(choice)
        return choice
    return unittest.mock.patch.object(select_algorithm.TritonTemplate, "generate", recording)


@contextlib.contextmanager
def _flex_lowered_as_on_gpu(stops: list, kernels: list | None = None):
    """FlexAttention's lowerings see a CUDA device and, where they reach Triton, leave placeholders.
    kernels (a list): render each op's kernel for the card instead (Triton needed), keep it there, and leave
    placeholders in the graph, whose other nodes stay on the CPU."""
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings
    from torch._inductor.virtualized import V

    def placeholder(val):
        if not isinstance(val, torch.Tensor):
            return val
        return lowerings[torch.ops.aten.empty_strided.default](
            list(val.shape), list(val.stride()), dtype=val.dtype, device=torch.device("cpu"))

    def rendered_for_sm90(op, lower, args, kwargs):
        graph = V.graph
        n_buffers, n_operations, choices = len(graph.buffers), len(graph.operations), []
        with contextlib.ExitStack() as stack:  # every IR node made here is on the GPU, not only TensorBoxes
            for cls in [c for c in vars(ir).values() if isinstance(c, type) and "get_device" in c.__dict__]:
                stack.enter_context(unittest.mock.patch.object(cls, "get_device", lambda self: torch.device("cuda", 0)))
            stack.enter_context(_as_gpu())
            stack.enter_context(_rendered_templates(choices))
            lower(*args, **kwargs)
        # the rendered kernel's buffers leave the (CPU) graph again: placeholders take their place
        for buf in graph.buffers[n_buffers:]:
            graph.name_to_buffer.pop(buf.get_name(), None)
        for operation in graph.operations[n_operations:]:
            graph.name_to_op.pop(operation.get_operation_name(), None)
        del graph.buffers[n_buffers:], graph.operations[n_operations:]
        graph.device_types.discard("cuda")
        for choice in choices:
            module = _load(choice.bmreq.module_path)
            kernel = getattr(module, choice.bmreq.kernel_name)
            kernels.append(FlexKernel(str(op).rsplit(".", 1)[-1], choice.bmreq.module_path, choice.bmreq.kernel_name,
                                      choice.bmreq.num_warps, choice.bmreq.num_stages,
                                      dict(kernel.inductor_meta.get("config_args", {})), kernel.fn.src))
        stops.append((str(op), f"rendered for sm_{capability()}"))
        return tree_map(placeholder, V.graph.current_node.meta["val"])

    def wrap(op, lower):
        def as_on_gpu(*args, **kwargs):
            if kernels is not None:
                return rendered_for_sm90(op, lower, args, kwargs)
            try:
                with unittest.mock.patch.object(ir.TensorBox, "get_device", lambda self: torch.device("cuda", 0)):
                    return lower(*args, **kwargs)
            except Exception as e:
                message = gpu_needed(e)
                if message is None:
                    raise
                stops.append((str(op), message))
                return tree_map(placeholder, V.graph.current_node.meta["val"])
        return as_on_gpu

    with flex_lowerings_wrapped(wrap):
        yield


@contextlib.contextmanager
def flex_lowerings_wrapped(wrap):
    """FlexAttention's inductor lowerings replaced by wrap(op, lowering) while the context lasts."""
    from torch._inductor.lowering import lowerings
    saved = {op: lowerings[op] for op in _flex_ops()}
    try:
        for op, lower in saved.items():
            lowerings[op] = wrap(op, lower)
        yield
    finally:
        lowerings.update(saved)


class _Lowered(Exception):
    """sm90 mode: the graph was lowered whole; its CPU code generation is skipped (the plain mode covers it)."""


def _lowered(exc):
    while exc is not None and not isinstance(exc, _Lowered):
        exc = exc.__cause__ or exc.__context__
    return exc is not None


def _shaped_outputs(gm):
    """The graph's stand-in at run time: empty tensors of its outputs' shapes (uncommitted memory), no compute."""
    from functorch.compile import make_boxed_func
    outputs = [getattr(v, "meta", {}).get("val", v) for v in gm.graph.find_nodes(op="output")[0].args[0]]
    return make_boxed_func(lambda *args: [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
                                          if isinstance(v, torch.Tensor) else v for v in outputs])


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lower(fn, *inputs, backward=True, sm90=False, generate=False):
    """Compiles fn (a function or module) on `inputs` as torch.compile(fullgraph=True, dynamic=False) would on
    CUDA, runs it once (and its backward, when `backward` and the output needs a gradient), and returns a
    GraphResult per graph inductor lowered. The run itself is eager (FlexAttention's math path on CPU).
    sm90: each FlexAttention op's kernel is rendered for the card (card(): sm_90 unless set; GraphResult.kernels),
    each graph stops once lowered, and nothing is computed: each graph returns empty tensors of its outputs'
    shapes, so the speedrun's shapes (48Ki-token rows) cost no more memory or time than small ones; with
    generate, code generation still runs (allocations() reads it)."""
    import torch.nn.attention.flex_attention as flex_module
    from functorch.compile import make_boxed_func
    results = []

    def inner(gm, example_inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        stops = []
        result = GraphResult(kind, sum(n.op == "call_function" for n in gm.graph.nodes), stops)
        codegen = GraphLowering.codegen

        def codegen_reached(self, *args, **kwargs):  # lowering is over: every node of the graph was lowered
            result.codegen = True
            if sm90 and not generate:
                raise _Lowered
            return codegen(self, *args, **kwargs)
        try:
            with _flex_lowered_as_on_gpu(stops, result.kernels if sm90 else None), \
                    unittest.mock.patch.object(GraphLowering, "codegen", codegen_reached):
                compile_fx_inner(gm, example_inputs, **kwargs)
            result.codegen = True
        except Exception as e:
            if _lowered(e):
                results.append(result)
                return _shaped_outputs(gm)
            result.stop = gpu_needed(e, TRITON_NEEDED)
            if result.stop is None:
                result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        results.append(result)
        return _shaped_outputs(gm) if sm90 else make_boxed_func(gm.forward)  # run eagerly, so the step (and its backward) goes on

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    torch._dynamo.reset()
    patches = {"cpu_backend": "triton", "fx_graph_cache": False, "force_disable_caches": True}
    try:
        with unittest.mock.patch.object(flex_module, "_validate_device", lambda *a, **k: None), \
                inductor_config.patch(patches):
            out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
            loss = out if isinstance(out, torch.Tensor) else None
            if backward and loss is not None and loss.requires_grad:
                loss.sum().backward()
    finally:
        torch._dynamo.reset()
    return results


def distinct_kernels(results):
    """The FlexKernels of these graphs, one per distinct source (the long and short windows share theirs)."""
    kernels = {}
    for r in results:
        for k in r.kernels:
            kernels.setdefault(k.source, k)
    return list(kernels.values())


def triton_tool(name):
    """Triton's bundled CUDA tools (ptxas, cuobjdump): no CUDA toolkit needed."""
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_cubin(kernel: FlexKernel) -> dict:
    """The kernel compiled to the card's machine code (sm_90 unless card() says otherwise) as inductor would on it
    (its signature, constants, divisibility hints, warps and stages), and ptxas's report on it: shared memory
    (bytes, dynamic), registers per thread, stack frame and spills (bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    autotuner = getattr(_load(kernel.module_path), kernel.kernel_name)
    meta = autotuner.triton_meta
    source = ASTSource(autotuner.fn, meta["signature"], meta.get("constants", {}), meta["configs"][0])
    binary = triton.compile(source, target=GPUTarget("cuda", capability(), 32),
                            options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages, debug=False))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(binary.asm["ptx"])
        arch = next(a for a in (f"sm_{capability()}a", f"sm_{capability()}") if a in binary.asm["ptx"])
        report = subprocess.run([triton_tool("ptxas"), "-v", f"--gpu-name={arch}", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(re.search(pattern, report)[1])  # noqa: E731
    return dict(arch=arch, cubin_bytes=len(binary.asm["cubin"]), shared=binary.metadata.shared,
                registers=number(r"Used (\d+) registers"), stack=number(r"(\d+) bytes stack frame"),
                spill_stores=number(r"(\d+) bytes spill stores"), spill_loads=number(r"(\d+) bytes spill loads"))


def expect_gpu_stops(results, kinds):
    """Asserts that the graphs of these kinds were lowered whole (code generation began), each stopping only
    where Triton is needed (and its FlexAttention ops only where a GPU is)."""
    assert sorted(r.kind for r in results) == sorted(kinds), [r.line() for r in results]
    for r in results:
        assert r.error is None, r.line()
        assert r.codegen, f"lowering did not reach code generation: {r.line()}"
    return results


def flex_role(kernel: FlexKernel) -> str:
    """What the kernel computes, from its head dim and the tensors its mask reads: attention (128), the CP
    head's document mask (reads document ids) or its match mask (also tokens, targets, copyable)."""
    if kernel.options.get("QK_HEAD_DIM") != 64:
        return "attention"
    captured = [a for a in _load(kernel.module_path).__dict__[kernel.kernel_name].triton_meta["signature"]
                if a.startswith("in_ptr")]
    return "CP document mask" if len(captured) == 1 else "CP match mask"


def cuda_path_model(cplm, max_seq_len, **config):
    """The model as CUDA holds it (the FP8 head where the card has FP8, sm_89+, else bf16; bf16 embeddings, flex
    attention), on the CPU: the speedrun preset's size unless config (GPTConfig's fields) says otherwise."""
    import train_gpt_cplm as tg
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(fp8_head=int(capability() >= 89), cplm=cplm, max_seq_len=max_seq_len, **config))
    model.attention_backend = model.cp_backend = "flex"
    model.head_loss = tg.HeadLoss(model.config.logit_softcap, model.config.copy_id)
    for m in model.modules():  # as on CUDA: bf16 embeddings make the activations bf16
        if isinstance(m, torch.nn.Embedding):
            m.bfloat16()
    return model


def packed_row(T, seed, doc_len=3000, bos=50256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, bos, (1, T + 1), generator=g)
    ids[0, ::doc_len] = bos
    return ids[:, :-1], ids[:, 1:]


def speedrun_kernels(cplm, train_len=48 * 1024, val_len=256 * 1024):
    """Every FlexAttention kernel the speedrun preset compiles on a GPU in one mode, rendered for the card (card())
    at the preset's shapes: training (one 48Ki-token row per GPU, forward and backward) and evaluation (one
    256Ki-token row). Returns [(graph, FlexKernel)], one per op (kernel_table keeps one per distinct source)."""
    model = cuda_path_model(cplm, val_len)
    window = torch.tensor(14, dtype=torch.int32)  # the record's final long window, 1728 tokens in 128-token blocks
    found = [("training", k) for r in lower(model, *packed_row(train_len, 0), window, sm90=True) for k in r.kernels]
    model.eval()
    with torch.no_grad():
        found += [("evaluation", k) for r in lower(lambda a, b, w: model(a, b, w, token_stats=True),
                                                   *packed_row(val_len, 1), window, sm90=True) for k in r.kernels]
    return found


def kernel_table(cplm_modes=(0, 1)):
    """Rows (mode, graph, role, kernel label, compile_cubin's report) for every distinct FlexAttention kernel of
    the speedrun preset's modes, for the card (card(); an H200 by default); a kernel both modes compile is listed
    once, under vanilla."""
    rows, seen = [], set()
    for cplm in cplm_modes:
        for graph, kernel in speedrun_kernels(cplm):
            if kernel.source not in seen:
                seen.add(kernel.source)
                rows.append(("CPLM" if cplm else "vanilla", graph, flex_role(kernel), kernel, compile_cubin(kernel)))
    return rows


def markdown_table(rows):
    lines = ["| mode | graph | kernel | direction, blocks, warps, stages | shared memory | registers | stack | "
             "spill stores / loads |", "|---|---|---|---|---|---|---|---|"]
    for mode, graph, role, kernel, r in rows:
        lines.append(f"| {mode} | {graph} | {role} | {kernel.label().replace('head_dim ', 'd')} | "
                     f"{r['shared'] / 1024:.1f} KiB | {r['registers']} | {r['stack']} B | "
                     f"{r['spill_stores']} / {r['spill_loads']} B |")
    return "\n".join(lines)


def allocations(fn, *inputs):
    """The buffers inductor's compiled code for fn allocates and frees, in order, as its wrapper code says:
    [(name, bytes) or (name, None) for a free]. Lowered and scheduled as on CUDA with the card's driver (Triton
    needed; FlexAttention ops are placeholders of their outputs' shapes), nothing computed: so the peak of a
    256Ki-token evaluation can be read from its graph on a CPU."""
    events = []
    codegen = GraphLowering.codegen

    def read_wrapper(self, *args, **kwargs):
        code, *rest = codegen(self, *args, **kwargs)
        text = code if isinstance(code, str) else getattr(code, "value", str(code))
        for line in text.splitlines():
            if m := re.match(r"\s*(buf\w+) = empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)", line):
                numel = 1
                for n in filter(None, (x.strip() for x in m[2].split(","))):
                    numel *= int(n)
                events.append((m[1], numel * getattr(torch, m[3]).itemsize))
            elif m := re.match(r"\s*(buf\w+) = (buf\w+); del \2", line):  # a buffer reused under a new name
                events.append((m[1], ("reuse", m[2])))
            elif m := re.match(r"\s*del ([\w, ]+)$", line):
                events.extend((name.strip(), None) for name in m[1].split(",") if name.strip().startswith("buf"))
        raise _Lowered

    with _as_gpu(), unittest.mock.patch.object(GraphLowering, "codegen", read_wrapper):
        lower(fn, *inputs, sm90=True, generate=True)
    return events


def peak_bytes(events):
    """Peak of the bytes live at once, and the largest single buffer, from allocations()' events."""
    live, peak, largest = {}, 0, 0
    for name, size in events:
        if isinstance(size, tuple):
            live[name] = live.pop(size[1], 0)
        elif size is None:
            live.pop(name, None)
        else:
            live[name] = size
            largest = max(largest, size)
        peak = max(peak, sum(live.values()))
    return peak, largest


def evaluation_memory(cplm, T=256 * 1024, **config):
    """What one validation row of T tokens holds on the GPU, read from its lowered graph: (peak of the graph's
    own buffers, its largest buffer, the bytes of weights and optimizer states that stay resident), bytes."""
    import train_gpt_cplm as tg
    model = cuda_path_model(cplm, T, **config).eval()
    window = torch.tensor(14, dtype=torch.int32)
    with torch.no_grad():
        events = allocations(lambda a, b, w: model(a, b, w, token_stats=True), *packed_row(T, 1), window)
    peak, largest = peak_bytes(events)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    adam, muon = tg.build_optimizers(model, tg.Hyperparameters(cplm=cplm), 0, 1)
    states = sum(p.numel() * p.element_size() * (2 if opt is adam else 1)  # Adam: two moments; Muon: momentum
                 for opt in (adam, muon) for g in opt.param_groups for p in g["params"])
    return peak, largest, weights + states


if __name__ == "__main__":  # records/gpu/README.md's tables: python3 tools/preflight.py [sm_90 sm_80 sm_89] (Triton)
    import sys
    import time
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import triton
    names = sys.argv[1:] or ["sm_90"]
    for name in names:
        t0 = time.perf_counter()
        with card(name) as gpu:
            table = kernel_table()
        too_big = [row for row in table if row[4]["shared"] > gpu.shared_memory_per_block_optin]
        print(f"torch {torch.__version__}, triton {triton.__version__}; {name}, {gpu.name}, "
              f"{gpu.shared_memory_per_block_optin} B of shared memory a block ({time.perf_counter() - t0:.0f}s); "
              f"{len(too_big)} kernels would not launch", flush=True)
        print(markdown_table(table), flush=True)
    if "sm_90" in names:
        for cplm in (0, 1):
            peak, largest, resident = evaluation_memory(cplm)
            print(f"{'CPLM' if cplm else 'vanilla'}: a 256Ki-token validation row: its graph's buffers peak at "
                  f"{peak / 2 ** 30:.1f} GiB (largest {largest / 2 ** 30:.1f} GiB); weights and optimizer states "
                  f"{resident / 2 ** 30:.1f} GiB; together {(peak + resident) / 2 ** 30:.1f} GiB")
