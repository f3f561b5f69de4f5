"""The CUDA CP loss compiled as for an H200 (FlexAttention's Triton templates with the sm_90 configs, inductor's
Triton kernels), forward and backward, run on the CPU in Triton's interpreter against the dense reference:
gpu_check/cuda_cp_check.py's own main() (its inputs, reference() and tolerances), two passes as it makes.

How: inductor with cpu_backend="triton", under preflight._as_gpu() (codegen needs an active Triton driver). Each
FlexAttention lowering runs with every IR node reporting CUDA, so it takes its Triton template with the sm_90
configs instead of the C++ CPU template; the buffers it made are then given back the CPU device, so the template
is scheduled and rendered as a CPU Triton kernel and runs, like the other kernels, under TRITON_INTERPRET=1
(set in a subprocess, before triton is imported; every patch stays in that subprocess).

Slow (-m slow). Deviations from the GPU check, for the interpreter's cost (about 200 us per op on 1024 elements):
a vocabulary of VP=2112 instead of 50304 (the LM head's kernels at T=256 took 330 s a pass at 50304) and rows of
a 64-token alphabet with several documents and repeated tokens (x_t = y_t: the match mask's diagonal matters).
Planted faults must fail: "mask" (the match mask's q_idx >= kv_idx made q_idx > kv_idx, in copy_lses' source)
and "lse_grad" (the compiled flex backward gets the LSE's gradient times ln 2: a base-2/base-e slip).
Runs with train_gpt_cplm.CP_KERNEL_OPTIONS as the file sets it; `TRITON_INTERPRET=1 python test_gpu_interpreter.py
--T 256 --kernel_options '{"num_warps": 4}'` checks others. Times on 2 shared cores: T=256 85-95 s a case,
T=1024 270-295 s (the LM head's (T, VP) kernels take most of it; the flex templates 3-30 s).
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
VP, ALPHABET, NEVER = 2112, 64, 1500  # BOS = VP - 48, <copy> = BOS + 1, as 50256 / 50257 of 50304
LN2 = 0.6931471805599453


def skip_reason():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton==3.6.0)"
    import numpy
    if tuple(int(x) for x in re.findall(r"\d+", numpy.__version__)[:2]) >= (2, 3):
        return (f"numpy {numpy.__version__} >= 2.3 breaks Triton's interpreter ('only 0-dimensional arrays can be "
                f"converted to Python scalars'); use numpy < 2.3")
    import torch
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 13):
        return (f"torch {torch.__version__}: the harness's patches (CPU buffers inside the sm_90 flex lowering) fit "
                "inductor 2.13+; on 2.11 inductor asserts on a CPU buffer (the CUDA path itself lowers there: "
                "test_gpu_kernels.py)")
    return None


def run_check(T, fault=None, kernel_options=None, timeout=1800):
    """Runs this file as a script (the check) in a fresh interpreter with TRITON_INTERPRET=1; returns
    (exit code, output, seconds)."""
    cache = tempfile.TemporaryDirectory(prefix="inductor_interpret_")  # its kernels only: no stale ones
    env = dict(os.environ, TRITON_INTERPRET="1", TORCHINDUCTOR_COMPILE_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache.name)
    env.pop("GPU_CHECK_TURN", None)  # cuda_cp_check would wait for first_call.py's GPU turn
    cmd = [sys.executable, os.path.abspath(__file__), "--T", str(T)]
    if fault:
        cmd += ["--fault", fault]
    if kernel_options:
        cmd += ["--kernel_options", kernel_options]
    t0 = time.perf_counter()
    with cache:
        proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def check_lines(output):
    """{name: 'ok' or 'MISMATCH'} from cuda_cp_check's lines."""
    return {m[1].strip(): m[2] for m in re.finditer(r"^\s*(log p\(y\)|d/d [^:]+): .* (ok|MISMATCH)$", output, re.M)}


@pytest.mark.slow
@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
@pytest.mark.parametrize("T, fault", [(256, None), (1024, None), (256, "mask"), (256, "lse_grad")])
def test_compiled_cp_loss_in_triton_interpreter(T, fault):
    rc, out, seconds = run_check(T, fault)
    print(out[-4000:], f"\n[{seconds:.0f} s]")
    ran = re.search(r"flex templates run in the interpreter: (\d+) \(sm_90 configs\)", out)
    assert ran and int(ran[1]) >= 4, out[-6000:]  # per pass: 2 forward, 2 backward (doc and match masks)
    lines = check_lines(out)
    assert len(lines) == 6, out[-6000:]
    if fault is None:
        assert rc == 0 and "cuda cp check: PASS" in out, out[-6000:]
    else:  # a mismatch (exit 1), not a crash, and where the fault is
        assert rc == 1 and "cuda cp check: FAIL" in out, out[-6000:]
        if fault == "mask":
            assert lines["log p(y)"] == "MISMATCH", lines
        else:  # the values are untouched; the gradients through the LSEs (q, k) are wrong
            assert lines["log p(y)"] == "ok" and lines["d/d q"] == lines["d/d k"] == "MISMATCH", lines


# ------------------------------------------------------------------------------------------------------------
# the check itself: runs in the subprocess (TRITON_INTERPRET=1)

def _interpreter_fixes():
    """What Triton 3.6's interpreter lacks for inductor's kernels."""
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter
    from torch._inductor.runtime import triton_helpers

    # bf16 is held as uint16 and create_dot multiplies the raw bits: widen bf16 operands to fp32 (exact)
    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h
    interpreter.InterpreterBuilder.create_dot = lambda self, a, b, *rest: create_dot(self, widen(a), widen(b), *rest)

    # libdevice's generic stubs (`def exp(arg0): ...`) return None in the interpreter: numpy stand-ins
    def stand_in(fn):
        def call(*args):
            x = next(a for a in args if isinstance(a, tl.tensor))
            data = np.asarray(fn(*[a.handle.data if isinstance(a, tl.tensor) else a for a in args]))
            scalar = tl.int1 if data.dtype == bool else x.handle.dtype.scalar
            if data.dtype != bool:
                data = data.astype(x.handle.data.dtype)
            return tl.tensor(interpreter.TensorHandle(data, scalar), x.type.with_element_ty(scalar))
        return call

    def missing(name):
        def call(*args, **kwargs):
            raise NotImplementedError(f"libdevice.{name} has no interpreter stand-in in test_gpu_interpreter.py")
        return call
    numpy_fns = dict(exp=np.exp, exp2=np.exp2, expm1=np.expm1, log=np.log, log2=np.log2, log1p=np.log1p,
                     sqrt=np.sqrt, rsqrt=lambda x: 1 / np.sqrt(x), tanh=np.tanh, abs=np.abs, pow=np.power,
                     isinf=np.isinf, isnan=np.isnan, isfinited=np.isfinite)
    for name, value in list(vars(libdevice).items()):
        if callable(value) and getattr(value, "__module__", None) == libdevice.__name__:
            setattr(libdevice, name, stand_in(numpy_fns[name]) if name in numpy_fns else missing(name))

    # max2 / min2 reduce through a combine function, pair by pair in Python (over 150 s a kernel at VP=50304;
    # these kernels at VP=2112 have none): numpy's reductions
    tl_max, tl_min = tl.max, tl.min
    triton_helpers.max2 = lambda a, dim: tl_max(a, dim)
    triton_helpers.min2 = lambda a, dim: tl_min(a, dim)


def _packed_row(T, generator):
    """cuda_cp_check.packed_row's kind of row at a small vocabulary: documents of ~100 tokens (several in a
    128-token block and across blocks), a 64-token alphabet (most targets copyable), x_t = x_{t-1} at some
    positions (the target at t-1 is then x_{t-1} itself: its own key is a match), every 97th target never in
    any context."""
    import torch
    import cuda_cp_check as ccc
    ids = torch.randint(0, ALPHABET, (1, T), generator=generator)
    rep = torch.randint(1, T, (T // 16,), generator=generator)
    ids[0, rep] = ids[0, rep - 1]
    ids[0, torch.randint(1, T, (T // 100,), generator=generator)] = ccc.BOS
    ids[0, 0] = ccc.BOS
    targets = torch.roll(ids, -1, 1)
    targets[0, ::97] = NEVER
    return ids, targets


def _plant_mask_fault(tg):
    """copy_lses with the match mask's q_idx >= kv_idx made q_idx > kv_idx (its own source, edited)."""
    import inspect
    import textwrap
    source = textwrap.dedent(inspect.getsource(tg.copy_lses))
    match_mod = re.search(r"def match_mod\(.*?\n(.*?)\n\n", source, re.S)
    assert match_mod and match_mod[0].count("q_idx >= kv_idx") == 1, "copy_lses' match_mod changed: fault not planted"
    source = source.replace(match_mod[0], match_mod[0].replace("q_idx >= kv_idx", "q_idx > kv_idx"))
    exec(compile(source, tg.__file__, "exec"), tg.__dict__)


def _flex_on_sm90_templates(fault, sm90_configs):
    """FlexAttention's lowerings take their Triton templates with the sm_90 configs (every IR node reports CUDA
    while they run), and the buffers they made go back to the CPU, where the templates are rendered as CPU
    Triton kernels. sm90_configs gets each op's config from the sm_90 heuristics (what the GPU's would be);
fault "lse_grad": the backward's LSE gradient times ln 2."""
    import contextlib
    import unittest.mock
    import torch
    import preflight
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings
    from torch._inductor.virtualized import V
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def wrap(op, lower):
        def lowered(*args, **kwargs):
            graph = V.graph
            if fault == "lse_grad" and op is torch.ops.higher_order.flex_attention_backward:
                args = list(args)
                args[6] = lowerings[torch.ops.aten.mul.Tensor](args[6], LN2)  # grad_logsumexp
            head_dim, dtype = V.graph.sizevars.guard_int(args[0].get_size()[-1]), args[0].get_dtype()
            get = (V.choices.get_flex_attention_bwd_configs if "backward" in str(op)
                   else V.choices.get_flex_attention_fwd_configs)
            sm90_configs.setdefault(str(op).rsplit(".", 1)[-1], get(head_dim, dtype, "cuda")[0])
            first = len(graph.buffers)
            with contextlib.ExitStack() as stack:
                for cls in [c for c in vars(ir).values() if isinstance(c, type) and "get_device" in c.__dict__]:
                    stack.enter_context(unittest.mock.patch.object(cls, "get_device", lambda self: cuda))
                out = lower(*args, **kwargs)
            for buf in graph.buffers[first:]:
                object.__setattr__(buf.layout, "device", cpu)  # layouts are frozen dataclasses
            graph.device_types.discard("cuda")
            return out
        return lowered

    return preflight.flex_lowerings_wrapped(wrap)


def _count_launches(launches):
    """Records each Triton kernel launch: (name, warps, stages, inductor's config_args, seconds)."""
    from torch._inductor.runtime import triton_heuristics
    run = triton_heuristics.CachingAutotuner.run

    def counted(self, *args, **kwargs):
        c, t0 = self.configs[0], time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.append((self.inductor_meta.get("kernel_name", ""), c.num_warps, c.num_stages,
                             dict(self.inductor_meta.get("config_args", {})), time.perf_counter() - t0))
    triton_heuristics.CachingAutotuner.run = counted


def main(argv):
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--fault", choices=["mask", "lse_grad"])
    ap.add_argument("--kernel_options", help="JSON: train_gpt_cplm.CP_KERNEL_OPTIONS for this run")
    a = ap.parse_args(argv)
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (test_gpu_interpreter.run_check)"
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, "gpu_check"))
    import torch._inductor.config as inductor_config
    import torch.nn.attention.flex_attention as flex_module
    import unittest.mock
    import train_gpt_cplm as tg
    import preflight
    import cuda_cp_check as ccc

    _interpreter_fixes()
    ccc.VP, ccc.BOS, ccc.COPY_ID = VP, VP - 48, VP - 47  # read at call time by main, fast_path and reference
    ccc.packed_row = _packed_row
    if a.kernel_options is not None:
        tg.CP_KERNEL_OPTIONS = json.loads(a.kernel_options)
    if a.fault == "mask":
        _plant_mask_fault(tg)
    launches, expected = [], {}
    _count_launches(launches)
    patches = {"cpu_backend": "triton", "fx_graph_cache": False, "force_disable_caches": True}
    print(f"T={a.T} VP={VP} fault={a.fault} CP_KERNEL_OPTIONS={tg.CP_KERNEL_OPTIONS}", flush=True)
    t0 = time.perf_counter()
    with unittest.mock.patch.object(flex_module, "_validate_device", lambda *args, **kwargs: None), \
            inductor_config.patch(patches), preflight._as_gpu(), _flex_on_sm90_templates(a.fault, expected):
        rc = ccc.main("cpu", T=a.T, compile_backend="inductor")
    seconds = time.perf_counter() - t0

    # the flex kernels that ran: the sm_90 heuristic's configs (CP_KERNEL_OPTIONS may override them)
    options = tg.CP_KERNEL_OPTIONS
    templates = [launch for launch in launches if launch[0].startswith("triton_tem_")]
    mismatched = []
    for name, warps, stages, args, _ in templates:
        backward = "BLOCK_M1" in args
        conf = expected["flex_attention_backward" if backward else "flex_attention"]
        prefix = "bwd_" if backward else "fwd_"
        want = {"num_warps": conf.num_warps, "num_stages": conf.num_stages}
        want.update({"BLOCK_M1": conf.block_m1, "BLOCK_N1": conf.block_n1, "BLOCK_M2": conf.block_m2,
                     "BLOCK_N2": conf.block_n2} if backward else {"BLOCK_M": conf.block_m, "BLOCK_N": conf.block_n})
        want = {k: options.get(prefix + k, options.get(k, v)) for k, v in want.items()}
        got = dict(args, num_warps=warps, num_stages=stages)
        if any(got.get(k) != v for k, v in want.items()):
            mismatched.append((name, want, {k: got.get(k) for k in want}))
        print(f"flex {'backward' if backward else 'forward '}: " + " ".join(f"{k}={got.get(k)}" for k in want))
    if rc == 3:
        return rc
    if mismatched:
        print("flex templates NOT on the sm_90 configs:", mismatched)
        return 4
    print(f"flex templates run in the interpreter: {len(templates)} (sm_90 configs); all Triton kernels "
          f"{len(launches)}; {seconds:.0f} s, of which in kernels: flex {sum(x[-1] for x in templates):.0f} s, "
          f"others {sum(x[-1] for x in launches) - sum(x[-1] for x in templates):.0f} s")
    by_name = {}
    for launch in launches:
        by_name[launch[0]] = by_name.get(launch[0], 0) + launch[-1]
    for name, s in sorted(by_name.items(), key=lambda kv: -kv[1])[:4]:
        print(f"  {s:6.1f} s {name[:100]}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
