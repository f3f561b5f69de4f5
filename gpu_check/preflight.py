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
With a CUDA build of torch as well, `compile_every_kernel` compiles every kernel of each graph through inductor's
own CUDA path (fake CUDA tensors), and `step_memory` reads a rank's peak memory from the graphs' wrapper code.
What only a GPU can show: autotuning, FP8 matmuls in hardware, memory as allocated, speed (records/gpu/README.md).
"""
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import re
import subprocess
import tempfile
import time
import types
import unittest.mock

# without Triton, torch's flop counter warns once at import: the pre-flight counts no Triton kernels' flops, and a
# refusal stays the one line that says what to install
logging.getLogger("torch.utils.flop_counter").setLevel(logging.ERROR)
import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: E402
from torch._inductor.graph import GraphLowering  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

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
    _forget_the_card()
    try:
        with unittest.mock.patch("torch.cuda.get_device_properties", props), \
                unittest.mock.patch("torch._dynamo.device_interface.CudaInterface.get_device_properties", props), \
                unittest.mock.patch("torch.cuda.get_device_capability", lambda *a, **k: major_minor):
            yield
    finally:
        driver._active = saved
        _forget_the_card()


def _forget_the_card():
    """Inductor caches what it read of the device for the whole process (its capability, which the Triton compile
    targets, and SM count): one card's answers must not reach the next card's kernels."""
    from torch._inductor import utils
    from torch._inductor.runtime.hints import DeviceProperties
    from torch.utils import _triton
    for cached in (DeviceProperties.create, getattr(utils, "is_big_gpu", None), getattr(utils, "get_max_num_sms", None),
                   getattr(_triton, "triton_backend", None), getattr(_triton, "triton_hash_with_backend", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


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
    generate, code generation still runs (wrapper_graphs() reads it)."""
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
    # a graph stopped at code generation leaves its folder in inductor's cache folder: a temporary one, except where
    # the rendered kernels' modules are read afterwards (sm90: compile_cubin loads them)
    cache = contextlib.nullcontext() if sm90 else tempfile.TemporaryDirectory(prefix="preflight_")
    try:
        with cache as cache_dir, \
                unittest.mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache_dir} if cache_dir else {}), \
                unittest.mock.patch.object(flex_module, "_validate_device", lambda *a, **k: None), \
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
    return ptxas_report(binary)


def ptxas_report(binary) -> dict:
    """ptxas's report on a kernel Triton compiled for a CUDA card: its machine code's size, shared memory (bytes,
    dynamic), registers per thread, stack frame and spills (bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(binary.asm["ptx"])
        arch = re.search(r"^\.target\s+(sm_\w+)", binary.asm["ptx"], re.M)[1]  # as compiled: sm_90a where it may
        report = subprocess.run([triton_tool("ptxas"), "-v", f"--gpu-name={arch}", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(re.search(pattern, report)[1])  # noqa: E731
    return dict(arch=arch, cubin_bytes=len(binary.asm["cubin"]), shared=binary.metadata.shared,
                registers=number(r"Used (\d+) registers"), stack=number(r"(\d+) bytes stack frame"),
                spill_stores=number(r"(\d+) bytes spill stores"), spill_loads=number(r"(\d+) bytes spill loads"))


@dataclasses.dataclass
class CompiledKernel:
    """One Triton kernel of a graph as inductor's CUDA path compiled it for the card (one per config it tried)."""
    graph: str      # forward, backward or inference
    name: str
    cubin: bytes
    shared: int     # dynamic shared memory, bytes
    num_warps: int

    def usage(self):
        """cuobjdump's resource usage of the machine code: registers, stack and local memory (spills) per thread."""
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(self.cubin)
            f.flush()
            report = subprocess.run([triton_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                                    text=True, check=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", report)
        return dict(registers=int(m[1]), stack=int(m[2]), static_shared=int(m[3]), local=int(m[4]))


@contextlib.contextmanager
def _cuda_as_the_card():
    """torch and inductor see a CUDA device, the card (card()), so that a graph on fake CUDA tensors compiles as
    on it; Triton compiles every kernel for it with its bundled ptxas and nothing is loaded or launched."""
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor.runtime import triton_helpers
    with _as_gpu(), \
            unittest.mock.patch.object(CudaInterface, "is_available", staticmethod(lambda: True)), \
            unittest.mock.patch.object(CudaInterface, "is_bf16_supported", staticmethod(lambda **k: True)), \
            unittest.mock.patch("torch.cuda.current_device", lambda: 0), \
            unittest.mock.patch("torch.cuda.device_count", lambda: 1), \
            unittest.mock.patch("torch._inductor.scheduler.has_triton", lambda: True), \
            unittest.mock.patch("torch.utils._triton.has_triton", lambda: True), \
            unittest.mock.patch.object(triton_helpers, "set_driver_to_gpu", lambda: None), \
            inductor_config.patch(compile_threads=1):
        yield


def _on_fake_cuda(gm, example_inputs):
    """The graph (and its FlexAttention subgraphs) and its inputs moved to fake CUDA tensors: metadata only."""
    fake = torch._guards.detect_fake_mode(example_inputs) or torch._guards.TracingContext.get().fake_mode

    def move(v):
        if not isinstance(v, torch.Tensor) or v.device.type != "cpu":
            return v
        with fake:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
    for sub in [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]:
        for node in sub.graph.nodes:
            if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"].type == "cpu":
                node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
            if "val" in node.meta:
                node.meta["val"] = tree_map(move, node.meta["val"])
        sub.recompile()
    return gm, [move(x) for x in example_inputs]


def _cpu_seconds():
    """CPU time of this process and its children (ptxas): compile work, not the wall clock a busy CPU stretches."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def compile_every_kernel(fn, *inputs, backward=True):
    """Every Triton kernel of fn's graphs (pointwise, reductions, templates, FlexAttention's) compiled as inductor's
    CUDA path compiles it for the card (card(); an H200 by default): traced on the CPU, each graph is moved to
    fake CUDA tensors and compiled by the real compile_fx_inner, whose Triton compiles go to the card's machine
    code. Needs a CUDA build of torch (fake CUDA tensors) and Triton; nothing runs. Returns ([CompiledKernel],
    {graph kind, or "all": CPU seconds}, {graph kind: CPU seconds of Triton's compiles, ptxas included}): what a GPU
    machine's compile spends there, whatever else shares this CPU."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    import torch.nn.attention.flex_attention as flex_module
    kernels, seconds, compiling = [], {}, {}
    kind = ["?"]

    def record(self):  # instead of loading the machine code onto a GPU
        for result in self.compile_results:
            k = result.kernel
            cubin = getattr(k, "cubin_raw", None) or k.asm["cubin"]
            shared = k.shared if hasattr(k, "shared") else k.metadata.shared
            warps = k.num_warps if hasattr(k, "num_warps") else k.metadata.num_warps
            kernels.append(CompiledKernel(kind[0], self.fn.__name__, cubin, shared, warps))
        self.launchers = []
    precompile = CachingAutotuner.precompile

    def timed_precompile(self, *args, **kwargs):
        t0 = _cpu_seconds()
        try:
            return precompile(self, *args, **kwargs)
        finally:
            compiling[kind[0]] = compiling.get(kind[0], 0) + _cpu_seconds() - t0

    def inner(gm, example_inputs, **kwargs):
        kind[0] = ("backward" if kwargs.get("is_backward") else
                   "inference" if kwargs.get("is_inference") else "forward")
        t0 = _cpu_seconds()
        with _cuda_as_the_card():
            compile_fx_inner(*_on_fake_cuda(gm, example_inputs), **kwargs)
        seconds[kind[0]] = _cpu_seconds() - t0
        return _shaped_outputs(gm)

    torch._dynamo.reset()
    start = _cpu_seconds()
    try:
        with unittest.mock.patch.object(flex_module, "_validate_device", lambda *a, **k: None), \
                unittest.mock.patch.object(CachingAutotuner, "_make_launchers", record), \
                unittest.mock.patch.object(CachingAutotuner, "precompile", timed_precompile), \
                inductor_config.patch(fx_graph_cache=False, force_disable_caches=True):
            out = torch.compile(fn, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner), fullgraph=True,
                                dynamic=False)(*inputs)
            if backward and isinstance(out, torch.Tensor) and out.requires_grad:
                out.sum().backward()
        seconds["all"] = _cpu_seconds() - start  # with tracing and AOT autograd's partitioning
    finally:
        torch._dynamo.reset()
    return kernels, seconds, compiling


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


@dataclasses.dataclass
class WrapperGraph:
    """One graph's compiled wrapper code as memory sees it: its inputs (wrapper names = the FX graph's placeholder
    names, and their bytes as declared), what it allocates, aliases and frees, in order (("alloc", name, bytes),
    ("alias", name, of), ("free", name, None), ("op", name, opaque op) for a custom op whose insides the wrapper
    cannot see), and what it returns, by FX name: {FX output name: wrapper name}."""
    kind: str
    inputs: dict
    events: list
    outputs: dict

    def replay(self, live=None, inside=None):
        """(peak bytes live at once, {FX output name: (storage, bytes)} alive at the return). live: what is alive at
        the start ({input name: (storage, bytes)}; inputs not in it, such as parameters, are not counted); inside:
        {opaque op: bytes it holds while it runs beyond its outputs}."""
        ref = {name: storage for name, (storage, _) in (live or {}).items()}
        size = {storage: nbytes for storage, nbytes in (live or {}).values()}
        total = lambda: sum(size[s] for s in set(ref.values()))  # noqa: E731
        peak = total()
        for kind, name, arg in self.events:
            if kind == "alloc":  # storages named by graph: a backward's buf0 is not its forward's
                ref[name] = f"{self.kind}:{name}"
                size[ref[name]] = arg
            elif kind == "alias" and arg in ref:
                ref[name] = ref[arg]
            elif kind == "free":
                ref.pop(name, None)
            elif kind == "op":
                peak = max(peak, total() + (inside or {}).get(arg, 0))
            peak = max(peak, total())
        return peak, {fx: (ref[name], size[ref[name]]) for fx, name in self.outputs.items() if name in ref}

    def allocated(self):
        return [arg for kind, _, arg in self.events if kind == "alloc"]


def _storage_bytes(sizes, strides, dtype):
    """Bytes of the storage a (sizes, strides) tensor spans: strides decide, not the shape alone (padding)."""
    sizes, strides = [int(s) for s in sizes], [int(s) for s in strides]
    if any(s == 0 for s in sizes):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(sizes, strides))) * dtype.itemsize


def _ints(text):
    return [int(n) for n in text.replace(",", " ").split()]


_ALLOC = re.compile(r"(buf\w+) = empty_strided_\w+\(\(([\d, ]*)\), \(([\d, ]*)\), torch\.(\w+)\)")
_OP_CALL = re.compile(r"(buf\w+) = torch\.ops\.(\w+)\.(\w+)\.\w+\(")  # an op that allocates its own outputs
_OUTPUT_OF = re.compile(r"(buf\w+) = (buf\w+)(?:\[\d+\])+$")  # one of a multi-output op's outputs
_REUSE = re.compile(r"(\w+) = (?:reinterpret_tensor\(|aten\.view\.dtype\()?(\w+)\b.*; del \2  # reuse$")
_ALIAS = re.compile(r"(\w+) = (?:reinterpret_tensor\(|aten\.view\.dtype\()?(\w+)\b.*#\s*(?:alias|reuse)$")


def _wrapper_graph(graph, code):
    """Reads GraphLowering graph's wrapper code (text)."""
    kind = "backward" if graph.is_backward else ("inference" if graph.is_inference else "forward")
    inputs, events, returned, ops = {}, [], None, {}
    for line in (line.strip() for line in code.splitlines()):
        if m := _ALLOC.match(line):
            events.append(("alloc", m[1], _storage_bytes(_ints(m[2]), _ints(m[3]), getattr(torch, m[4]))))
        elif m := _OP_CALL.match(line):
            layout = getattr(graph.name_to_buffer.get(m[1]), "layout", None)
            if hasattr(layout, "stride"):  # one output: its own buffer
                events.append(("alloc", m[1], _storage_bytes(layout.size, layout.stride, layout.dtype)))
            else:  # several: each counted from the call on, though the code names it only later
                ops[m[1]] = len(events)
            events.append(("op", m[1], m[3]))
        elif (m := _OUTPUT_OF.match(line)) and m[2] in ops:
            layout = graph.name_to_buffer[m[1]].layout
            events.insert(ops[m[2]], ("alloc", m[1], _storage_bytes(layout.size, layout.stride, layout.dtype)))
            ops = {op: i + (i >= ops[m[2]]) for op, i in ops.items()}
        elif m := _REUSE.match(line):
            events += [("alias", m[1], m[2]), ("free", m[2], None)]
        elif m := _ALIAS.match(line):
            events.append(("alias", m[1], m[2]))
        elif m := re.fullmatch(r"del ([\w, ]+)", line):
            events += [("free", name.strip(), None) for name in m[1].split(",") if name.strip()]
        elif m := re.fullmatch(r"([\w, ]+) = args", line):
            names = [name.strip() for name in m[1].split(",") if name.strip()]
            inputs = {name: _input_bytes(graph.graph_inputs.get(name)) for name in names}
        elif line.startswith("return (") and inputs and returned is None:  # call()'s return
            body = line[len("return ("):-1]
            returned = [re.match(r"(?:reinterpret_tensor\(|aten\.view\.dtype\()?(\w+)", item.strip())[1]
                        for item in _top_level_items(body)]
    fx_outputs = [str(a) for a in graph.module.graph.find_nodes(op="output")[0].args[0]] if returned is not None else []
    assert len(fx_outputs) == len(returned or []), (len(fx_outputs), len(returned or []))
    return WrapperGraph(kind, inputs, events, dict(zip(fx_outputs, returned or [])))


def _top_level_items(text):
    """The comma-separated items of a tuple's body, commas inside parentheses kept."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


def _input_bytes(box):
    try:
        return _storage_bytes(box.get_size(), box.get_stride(), box.get_dtype())
    except Exception:  # a symbolic or non-tensor input
        return 0


def wrapper_graphs(fn, *inputs):
    """Every graph inductor compiles for fn on the card (forward and backward when the output needs a gradient,
    else one inference graph), read from its wrapper code: what it allocates and frees, in order. Lowered and
    scheduled as on CUDA with the card's driver (Triton needed; FlexAttention ops are placeholders of their
    outputs' shapes), nothing computed: so the peak of a 48Ki-token training step or a 256Ki-token evaluation
    can be read from its graphs on a CPU."""
    graphs = []
    codegen = GraphLowering.codegen

    def read_wrapper(self, *args, **kwargs):
        code, *rest = codegen(self, *args, **kwargs)
        graphs.append(_wrapper_graph(self, code if isinstance(code, str) else getattr(code, "value", str(code))))
        raise _Lowered

    with _as_gpu(), unittest.mock.patch.object(GraphLowering, "codegen", read_wrapper):
        lower(fn, *inputs, sm90=True, generate=True)
    return graphs


def _fp8_insides(model, T):
    """What the FP8 LM head's two ops hold while they run, beyond their outputs: their bodies are compiled apart
    (the model's wrapper sees only the call), so each body's graph is read the same way at the head's shapes
    (the backward: its e5m2 gradient, (T, V) bytes, in one layout and then the other)."""
    import train_gpt_cplm as tg
    if not model.config.fp8_head:
        return {}
    V, D = model.lm_head.weight.shape
    scales = model.lm_head.fp8_scales
    x8, w8 = torch.zeros(T, D, dtype=torch.float8_e4m3fn), torch.zeros(V, D, dtype=torch.float8_e4m3fn)
    bodies = {"fp8_matmul": (tg._fp8_forward, (torch.zeros(T, D, dtype=torch.bfloat16), torch.zeros(V, D),
                                               *scales[:2])),
              "fp8_matmul_backward": (tg._fp8_backward, (torch.zeros(T, V, dtype=torch.bfloat16), x8, w8, *scales))}
    inside = {}
    with torch.no_grad():
        for op, (body, args) in bodies.items():
            (graph,) = wrapper_graphs(body, *args)
            peak, returned = graph.replay()
            inside[op] = peak - sum(dict(returned.values()).values())
    return inside


def step_memory(cplm, T, training=True, token_stats=True, grad_accum=1, max_seq_len=None):
    """What one rank holds at its peak in a training step (a micro-batch of one T-token row) or an evaluation
    (one T-token row) of the speedrun preset on the card, read from the lowered graphs: dict of bytes.
    resident: weights, optimizer states and the rotary tables (fp32, max_seq_len rows: the script's
    max(--seq_len, --val_seq_len); default T); graphs: the graphs' own buffers at their peak (a backward starts
    with what its forward saved for it, each freed after the backward's last read of it, and the FP8 head's ops
    count what they hold inside); grads: gradients already there when a micro-step starts (from grad_accum = 2
    on: the weights' bytes). Not counted: the allocator's slack, NCCL's buffers, the optimizer step's
    temporaries (Muon's updates: at most world size x the largest matrix), what FlexAttention's kernels hold
    beyond their outputs."""
    import train_gpt_cplm as tg
    model = cuda_path_model(cplm, max(max_seq_len or T, T))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = sum(b.numel() * b.element_size() for b in model.buffers())
    adam, muon = tg.build_optimizers(model, tg.Hyperparameters(cplm=cplm), 0, 1)
    states = sum(p.numel() * p.element_size() * (2 if opt is adam else 1)  # Adam: two moments; Muon: momentum
                 for opt in (adam, muon) for g in opt.param_groups for p in g["params"])
    graphs = _graphs_peak(cplm, T, training, token_stats, capability())
    grads = weights if training and grad_accum > 1 else 0
    resident = weights + states + tables
    return dict(resident=resident, graphs=graphs, grads=grads, total=resident + graphs + grads)


@functools.lru_cache(maxsize=None)
def _graphs_peak(cplm, T, training, token_stats, capability):
    """The peak of the graphs' own buffers (step_memory), read once per shape and card kind."""
    model = cuda_path_model(cplm, T)
    window = torch.tensor(14, dtype=torch.int32)
    if training:
        inside = _fp8_insides(model, T)
        forward, backward = wrapper_graphs(model, *packed_row(T, 0), window)
        assert (forward.kind, backward.kind) == ("forward", "backward"), (forward.kind, backward.kind)
        forward_peak, saved = forward.replay(inside=inside)
        # the backward's inputs are named as the forward's outputs it saved: handed over by name
        handed = {name: saved[name] for name in backward.inputs if name in saved}
        return max(forward_peak, backward.replay(handed, inside=inside)[0])
    model.eval()
    with torch.no_grad():
        (inference,) = wrapper_graphs(lambda a, b, w: model(a, b, w, token_stats=token_stats), *packed_row(T, 1),
                                      window)
    return inference.replay()[0]


# README's "Which card, which flags": (card whose graphs are read, hardware, --seq_len, --val_seq_len,
# accumulation micro-steps); an sm_89 card reads as sm_90 (the same FP8 head, the same graphs' buffers)
SETTINGS = [("sm_90", "8xH100 80 GB", 48 * 1024, 256 * 1024, 1), ("sm_90", "1xH100 80 GB", 48 * 1024, 256 * 1024, 8),
            ("sm_80", "8xA100 80 GB", 48 * 1024, 256 * 1024, 1), ("sm_80", "1xA100 40 GB", 24 * 1024, 64 * 1024, 16),
            ("sm_90", "1x 24 GB card, sm_89", 16 * 1024, 64 * 1024, 24)]


def memory_table(train_lens=(48 * 1024, 24 * 1024, 16 * 1024, 12 * 1024),
                 val_lens=(256 * 1024, 128 * 1024, 64 * 1024, 32 * 1024), max_seq_len=256 * 1024):
    """step_memory for the speedrun preset on the card (card(): its LM head, FP8 or bf16), both modes: rows
    (mode, "training" or "evaluation", T, step_memory's dict), with the record's rotary tables (256Ki rows) and
    grad_accum 1 (accumulating adds the gradients, the weights' bytes)."""
    return [("CPLM" if cplm else "vanilla", graph, T,
             step_memory(cplm, T, training=graph == "training", max_seq_len=max_seq_len))
            for cplm in (0, 1) for graph, lens in (("training", train_lens), ("evaluation", val_lens)) for T in lens]


def every_kernel_table(train_len=48 * 1024, val_len=256 * 1024):
    """compile_every_kernel for the speedrun preset on the card, both modes: rows (mode, graph, [CompiledKernel],
    CPU seconds, of them Triton's), graph: the training step's forward or backward (lowering and Triton), "training,
    all" and "evaluation, all" (tracing and partitioning as well)."""
    rows = []
    for cplm in (0, 1):
        mode = "CPLM" if cplm else "vanilla"
        model = cuda_path_model(cplm, val_len)
        window = torch.tensor(14, dtype=torch.int32)
        kernels, seconds, compiling = compile_every_kernel(model, *packed_row(train_len, 0), window)
        rows += [(mode, g, [k for k in kernels if k.graph == g], seconds[g], compiling.get(g, 0))
                 for g in ("forward", "backward")]
        rows.append((mode, "training, all", kernels, seconds["all"], sum(compiling.values())))
        model.eval()
        with torch.no_grad():
            kernels, seconds, compiling = compile_every_kernel(
                lambda a, b, w: model(a, b, w, token_stats=True), *packed_row(val_len, 1), window)
        rows.append((mode, "evaluation, all", kernels, seconds["all"], compiling.get("inference", 0)))
    return rows


TABLES = ("memory", "every")  # besides the FlexAttention kernels' table (no WHAT)


def main(argv=None):
    """records/gpu/README.md's tables: python3 gpu_check/preflight.py [sm_90 sm_80 sm_89] [memory | every]."""
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="preflight.py", description="The GPU pre-flight's tables, on a machine without "
                                "a GPU: the FlexAttention kernels compiled for each card (no WHAT), what one rank "
                                "holds at its peak (memory), every kernel of a step compiled for the card (every; a "
                                "CUDA build of torch). Needs Triton: pip install triton==3.6.0 'numpy<2.3'.")
    p.add_argument("what", nargs="*", metavar="CARD_OR_WHAT", help=f"cards ({', '.join(CARDS)}; default sm_90) and "
                   f"at most one of {', '.join(TABLES)}")
    args = p.parse_args(argv)
    unknown = [w for w in args.what if w not in CARDS and w not in TABLES]
    if unknown:
        p.error(f"unknown {', '.join(unknown)}: name cards ({', '.join(CARDS)}) and one of {', '.join(TABLES)}")
    try:
        import triton
    except ImportError:  # the CPU build of torch comes without it
        print("preflight.py: error: the pre-flight compiles kernels with Triton, which this torch build lacks: "
              "pip install triton==3.6.0 'numpy<2.3'", file=sys.stderr)
        return 1
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    names = [n for n in args.what if n in CARDS] or ["sm_90"]
    what = set(args.what)
    for name in names:
        t0 = time.perf_counter()
        with card(name) as gpu:
            if "every" in what:
                print(f"torch {torch.__version__}, triton {triton.__version__}; {name}: every Triton kernel of the "
                      "speedrun preset, as inductor's CUDA path compiles it\n| mode | graph | kernels (distinct) | "
                      "largest shared memory | most registers | with a stack frame | compile CPU time, of it "
                      "Triton's |\n"
                      "|---|---|---|---|---|---|---|", flush=True)  # spilling: a stack frame (ptxas puts spills there)
                for mode, graph, kernels, seconds, compiling in every_kernel_table():
                    usage = [k.usage() for k in kernels]
                    over = sum(k.shared > gpu.shared_memory_per_block_optin for k in kernels)
                    stacks = [u["stack"] for u in usage]
                    print(f"| {mode} | {graph} | {len(kernels)} ({len({k.name for k in kernels})}) | "
                          f"{max(k.shared for k in kernels) / 1024:.1f} KiB{f' ({over} too big)' if over else ''} | "
                          f"{max(u['registers'] for u in usage)} | "
                          f"{sum(s > 0 for s in stacks)} (largest {max(stacks)} B)"
                          f" | {seconds:.0f} s, {compiling:.0f} s |", flush=True)
                continue
            if "memory" in what:
                print(f"torch {torch.__version__}; {name}: what one rank holds at its peak, GiB (LM head "
                      f"{'FP8' if capability() >= 89 else 'bf16'}; rotary tables of 256Ki rows)\n| mode | graph | "
                      "row (tokens) | graphs' buffers | weights, optimizer states, tables | total |\n"
                      "|---|---|---|---|---|---|", flush=True)
                for mode, graph, T, m in memory_table():
                    print(f"| {mode} | {graph} | {T // 1024}Ki | {m['graphs'] / 2 ** 30:.2f} | "
                          f"{m['resident'] / 2 ** 30:.2f} | {m['total'] / 2 ** 30:.2f} |", flush=True)
                print("| hardware | --seq_len | --val_seq_len | micro-steps | training vanilla / CPLM | validation |\n"
                      "|---|---|---|---|---|---|")
                for _, label, seq_len, val_len, accum in [row for row in SETTINGS if row[0] == name]:
                    longest = max(seq_len, val_len)
                    train = [step_memory(c, seq_len, grad_accum=accum, max_seq_len=longest)["total"] for c in (0, 1)]
                    val = [step_memory(c, val_len, training=False, max_seq_len=longest)["total"] for c in (0, 1)]
                    print(f"| {label} | {seq_len} | {val_len} | {accum} | {train[0] / 2 ** 30:.1f} / "
                          f"{train[1] / 2 ** 30:.1f} | {val[0] / 2 ** 30:.1f} / {val[1] / 2 ** 30:.1f} |", flush=True)
                continue
            table = kernel_table()
        too_big = [row for row in table if row[4]["shared"] > gpu.shared_memory_per_block_optin]
        print(f"torch {torch.__version__}, triton {triton.__version__}; {name}, {gpu.name}, "
              f"{gpu.shared_memory_per_block_optin} B of shared memory a block ({time.perf_counter() - t0:.0f}s); "
              f"{len(too_big)} kernels would not launch", flush=True)
        print(markdown_table(table), flush=True)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
