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
What only a GPU can show: the Triton kernels' compilation, autotuning and correctness, FP8 matmuls in
hardware, memory, speed (records/gpu/README.md).
"""
import contextlib
import dataclasses
import unittest.mock

import torch
import torch._inductor.config as inductor_config
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.graph import GraphLowering
from torch.utils._pytree import tree_map

# the messages at which a CPU machine legitimately stops: no Triton at all; Triton without a GPU driver...
TRITON_NEEDED = ("No module named 'triton'", "0 active drivers")
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

    def line(self):
        end = f"FAILED: {self.error}" if self.error else (
            f"code generation stopped at {self.stop!r}" if self.stop else "compiled")
        return (f"{self.kind:9s} graph: {self.ops} ops, {len(self.flex_stops)} FlexAttention op(s) lowered up to "
                f"a GPU-only step; {end}")


def _flex_ops():
    return [getattr(torch.ops.higher_order, name) for name in ("flex_attention", "flex_attention_backward")
            if hasattr(torch.ops.higher_order, name)]


@contextlib.contextmanager
def _flex_lowered_as_on_gpu(stops: list):
    """FlexAttention's lowerings see a CUDA device and, where they reach Triton, leave placeholders."""
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings
    from torch._inductor.virtualized import V

    def placeholder(val):
        if not isinstance(val, torch.Tensor):
            return val
        return lowerings[torch.ops.aten.empty_strided.default](
            list(val.shape), list(val.stride()), dtype=val.dtype, device=torch.device("cpu"))

    def wrap(op, lower):
        def as_on_gpu(*args, **kwargs):
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

    saved = {op: lowerings[op] for op in _flex_ops()}
    try:
        for op, lower in saved.items():
            lowerings[op] = wrap(op, lower)
        yield
    finally:
        lowerings.update(saved)


def lower(fn, *inputs, backward=True):
    """Compiles fn (a function or module) on `inputs` as torch.compile(fullgraph=True, dynamic=False) would on
    CUDA, runs it once (and its backward, when `backward` and the output needs a gradient), and returns a
    GraphResult per graph inductor lowered. The run itself is eager (FlexAttention's math path on CPU)."""
    import torch.nn.attention.flex_attention as flex_module
    results = []

    def inner(gm, example_inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        stops = []
        result = GraphResult(kind, sum(n.op == "call_function" for n in gm.graph.nodes), stops)
        codegen = GraphLowering.codegen

        def codegen_reached(self, *args, **kwargs):  # lowering is over: every node of the graph was lowered
            result.codegen = True
            return codegen(self, *args, **kwargs)
        try:
            with _flex_lowered_as_on_gpu(stops), unittest.mock.patch.object(GraphLowering, "codegen", codegen_reached):
                compile_fx_inner(gm, example_inputs, **kwargs)
            result.codegen = True
        except Exception as e:
            result.stop = gpu_needed(e, TRITON_NEEDED)
            if result.stop is None:
                result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        results.append(result)
        from functorch.compile import make_boxed_func
        return make_boxed_func(gm.forward)  # run eagerly, so the step (and its backward) goes on

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


def expect_gpu_stops(results, kinds):
    """Asserts that the graphs of these kinds were lowered whole (code generation began), each stopping only
    where Triton is needed (and its FlexAttention ops only where a GPU is)."""
    assert sorted(r.kind for r in results) == sorted(kinds), [r.line() for r in results]
    for r in results:
        assert r.error is None, r.line()
        assert r.codegen, f"lowering did not reach code generation: {r.line()}"
    return results
