"""cp_kernel.py (--cp_backend lse_kernel) against the dense CP sums, in Triton's interpreter on the CPU: both
log-sum-exps and their gradients, at block sizes small enough that rows cross many tiles, through the whole
mixture loss, and compiled to sm_80 and sm_90 machine code by Triton's own ptxas (registers, spills).

In float32 and float16: the interpreter's tl.dot of bf16 operands returns garbage (a bf16 dot of two 16 x 16 tiles
was off by 1e10 in Triton 3.6 and 3.8, where float32 and float16 were exact), so the reduced-precision path (score
gradients rounded to q's dtype for the backward's dots, dq and dk stored in it) runs here in float16, and in bf16,
as training runs it, on a GPU against the dense sums (gpu_check/cuda_cp_check.py). That check's plumbing is tested
here with its GPU work replaced.

Needs Triton (the default CUDA wheel of torch brings it; with the CPU build, `pip install triton`); Triton 3.6
and older run their interpreter only with numpy < 2.3.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import train_gpt_cplm as tg


def skip_reason():
    if importlib.util.find_spec("triton") is None:
        return "the CP kernel's tests need Triton: pip install triton"
    import numpy
    import triton
    version = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:2])  # noqa: E731
    if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 3):
        return (f"Triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__} ('only 0-dimensional "
                "arrays can be converted to Python scalars'): use numpy < 2.3 or a newer Triton")
    return None


NEEDS_TRITON = skip_reason()  # the interpreted and compiled cases skip with it; the GPU check's plumbing runs anyway
HERE = os.path.dirname(os.path.abspath(__file__))
BOS, VP = 60, 64  # a small alphabet: many targets occur earlier in their document


def rows(B=2, T=160, seed=0):
    """Packed rows: documents that start mid-tile, one of a single token, one long enough to span many tiles,
    targets that never occur (45 is not in the alphabet of 40), and tokens repeated (x_t = y_t)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (B, T), generator=g)
    ids[:, 0] = BOS
    ids[0, [37, 38, 120]] = BOS  # a document of one token at 37
    ids[1, [7, 100]] = BOS
    ids[:, 130:140] = 5
    targets = torch.roll(ids, -1, 1)
    targets[:, ::13] = 45
    doc_ids = tg.doc_ids_of(ids, BOS)
    return ids, targets, doc_ids, tg.target_in_context(ids, targets, doc_ids, VP)


def lses_and_grads(backend, q, k, ids, targets, doc_ids, copyable, weights):
    q, k = (t.detach().clone().requires_grad_() for t in (q, k))
    lse_doc, lse_match = tg.copy_lses(q, k, ids, targets, doc_ids, copyable, backend)
    (lse_doc * weights[0] + lse_match * weights[1]).sum().backward()
    return dict(lse_doc=lse_doc, lse_match=lse_match, dq=q.grad, dk=k.grad)


def differences(fast, dense):
    """Per quantity: the largest |fast - dense|, the largest |dense|, |fast - dense| / |dense| as vectors, whether
    fast is finite everywhere, fast's dtype."""
    return {name: dict(max_abs=(a.float() - b.float()).abs().max().item(), max_ref=b.abs().max().item(),
                       relative=((a.float() - b.float()).norm() / b.float().norm()).item(),
                       finite=bool(torch.isfinite(a).all()), dtype=str(a.dtype).split(".")[-1])
            for (name, a), b in zip(fast.items(), dense.values())}


BLOCKS = [(64, 64), (16, 16), (32, 16), (16, 32)]


def run_cases():
    """Every case, in this process (which runs the kernels in Triton's interpreter): {case: differences}."""
    import cp_kernel
    results = {}
    for block_m, block_n in BLOCKS:  # rows cross many tiles; query and key tiles of different sizes
        cp_kernel.BLOCK_M, cp_kernel.BLOCK_N = block_m, block_n
        data = rows()
        g = torch.Generator().manual_seed(1)
        q, k = (torch.randn(2, 160, 16, generator=g) * 2 for _ in range(2))
        weights = torch.rand(2, 2, 160, generator=g)  # a random linear function of both: every gradient differs
        results[f"float32 {block_m}x{block_n}"] = differences(lses_and_grads("lse_kernel", q, k, *data, weights),
                                                              lses_and_grads("dense", q, k, *data, weights))
    cp_kernel.BLOCK_M, cp_kernel.BLOCK_N = BLOCKS[0]
    data = rows(seed=2)  # reduced precision as on a GPU (float16: the interpreter's bf16 dot is broken): float32 sums,
    g = torch.Generator().manual_seed(3)  # the score gradients rounded to q's dtype for the backward's dots
    q, k = ((torch.randn(2, 160, 64, generator=g) * 2).half() for _ in range(2))
    weights = torch.rand(2, 2, 160, generator=g)
    results["float16"] = differences(lses_and_grads("lse_kernel", q, k, *data, weights),
                                     lses_and_grads("dense", q.float(), k.float(), *data, weights))
    ids, targets, doc_ids, copyable = rows(seed=4)  # the script's mixture loss, its every input's gradient
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, 160, VP, generator=g) * 3, torch.randn(2, 160, 32, generator=g),
              torch.randn(2, 160, 32, generator=g), torch.randn(32, generator=g), torch.tensor(2.0)]
    weights = torch.rand(2, 160, generator=g)
    loss = []
    for backend in ("lse_kernel", "dense"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        log_p = tg.cplm_target_log_prob(*leaves[:4], ids, targets, doc_ids, copyable, BOS + 1, leaves[4], 15.0,
                                        backend=backend)["log_p"]
        (log_p * weights).sum().backward()
        loss.append(dict(zip(["log p", "d/du", "d/dq", "d/dk", "d/dsink", "d/dbias"],
                             [log_p] + [t.grad for t in leaves])))
    results["mixture"] = differences(*loss)
    sys.path.insert(0, os.path.join(HERE, "gpu_check"))
    import cuda_cp_check  # the GPU check's own line on the kernel, on its packed row (float32 here)
    g = torch.Generator().manual_seed(6)
    ids, targets = cuda_cp_check.packed_row(768, g)  # documents of ~700 tokens: one boundary
    q, k = (torch.randn(1, 768, 64, generator=g) * 2 for _ in range(2))
    results["gpu check line"] = cuda_cp_check.lse_kernel_line("cpu", ids, targets, q, k)
    cp_kernel.LOG2E = 1.0  # a planted fault: the kernel's scores in base e where it takes base 2
    results["gpu check line, base-2 slip"] = cuda_cp_check.lse_kernel_line("cpu", ids, targets, q, k)
    cp_kernel.LOG2E = 1.4426950408889634
    try:
        cp_kernel.cp_lses(torch.randn(2, 160, 48), torch.randn(2, 160, 48), *rows())
        results["cp_dim 48"] = "accepted"
    except ValueError as e:
        results["cp_dim 48"] = str(e)
    return results


@pytest.fixture(scope="module")
def interpreted():
    """run_cases() in a process of its own, with TRITON_INTERPRET=1 set before Triton is imported (a kernel
    interpreted after Triton's own functions were compiled as GPU code fails, and other test files import it)."""
    if NEEDS_TRITON:
        pytest.skip(NEEDS_TRITON)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("blocks", BLOCKS)
def test_both_lses_and_their_gradients_match_the_dense_sums(interpreted, blocks):
    for name, d in interpreted[f"float32 {blocks[0]}x{blocks[1]}"].items():
        assert d["finite"] and d["max_abs"] <= 1e-5 * max(1, d["max_ref"]), (blocks, name, d)


def test_float16_queries_and_keys_within_a_float16_rounding(interpreted):
    """The reduced-precision path training runs in bf16 on a GPU, here in float16 (the interpreter's float16 dot
    works, its bf16 one does not): the sums float32 from exact products, dq and dk in q's dtype from score gradients
    rounded to it (FlashAttention's and FlexAttention's backward round them too), about 0.05% a term."""
    for name, d in interpreted["float16"].items():
        assert d["finite"] and d["dtype"] == ("float32" if name.startswith("lse") else "float16"), (name, d)
        assert d["relative"] < (1e-6 if name.startswith("lse") else 2e-3), (name, d)


def test_the_mixture_loss_through_the_kernel_matches_the_dense_one(interpreted):
    """cplm_target_log_prob, the script's loss, with the kernel's sums against the dense ones: log p(y) and the
    gradients of every input (the LM head's output, q, k, the sink key, the <copy> bias)."""
    assert set(interpreted["mixture"]) == {"log p", "d/du", "d/dq", "d/dk", "d/dsink", "d/dbias"}
    for name, d in interpreted["mixture"].items():
        assert d["finite"] and d["max_abs"] <= 1e-5 * max(1, d["max_ref"]), (name, d)


def test_a_cp_dim_the_kernel_cannot_take_is_one_line(interpreted):
    assert interpreted["cp_dim 48"] == "--cp_backend lse_kernel needs --cp_dim a power of two from 16 to 256, not 48"


def test_the_gpu_checks_line_passes_the_kernel_and_fails_a_base_2_slip(interpreted):
    """gpu_check/cuda_cp_check.py's line on the kernel (run on a GPU with bf16 q and k) here in float32: ok, and
    MISMATCH once the kernel takes its scores in the wrong base."""
    assert interpreted["gpu check line"].endswith(" ok"), interpreted["gpu check line"]
    assert interpreted["gpu check line, base-2 slip"].endswith(" MISMATCH"), interpreted["gpu check line, base-2 slip"]


def test_the_gpu_checks_timing_line_says_which_is_faster():
    sys.path.insert(0, os.path.join(HERE, "gpu_check"))
    import cuda_cp_check
    line = cuda_cp_check.timing_line({"flex": [0.70, 0.72, 0.71], "lse_kernel": [0.40, 0.45, 0.41]})
    assert "flex 0.710 ms, lse_kernel 0.410 ms, the kernel saves 0.300 ms a row" in line, line
    assert "median of 3 alternating rounds" in line and "range 0.571-0.625" in line, line


def test_the_gpu_checks_kernel_part_says_its_lines_and_its_failure_in_one_line(monkeypatch, capsys):
    """cuda_cp_check.kernel_part's plumbing (its GPU work replaced): the check's line, then the timing's, taken in a
    turn of its own; a fault (as an illegal address would raise) is one line, and the process goes on."""
    sys.path.insert(0, os.path.join(HERE, "gpu_check"))
    import cuda_cp_check
    turns = []
    monkeypatch.setattr(cuda_cp_check, "lse_kernel_line", lambda *a: "lse kernel (bfloat16 q, k; T=4096) ... ok")
    monkeypatch.setattr(cuda_cp_check, "prepare_cp_sums_timing", lambda dev: {"flex": lambda: None,
                                                                              "lse_kernel": lambda: None})
    monkeypatch.setattr(cuda_cp_check, "time_cp_sums", lambda steps: {"flex": [0.7] * 3, "lse_kernel": [0.4] * 3})
    monkeypatch.setattr(cuda_cp_check, "take_turn", lambda: turns.append(1))
    cuda = types.SimpleNamespace(type="cuda")
    cuda_cp_check.kernel_part(cuda, None, None, None, None, exit_code=1)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "lse kernel (bfloat16 q, k; T=4096) ... ok" and turns == [1], out
    assert out[1].startswith("CP sums forward + backward on a 48Ki-token row") and len(out) == 2, out

    def fault(dev):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(cuda_cp_check, "prepare_cp_sums_timing", fault)
    cuda_cp_check.kernel_part(cuda, None, None, None, None, exit_code=1)
    assert "lse kernel: FAILED (RuntimeError: CUDA error: an illegal memory access was encountered)" in \
        capsys.readouterr().out.splitlines()


def test_a_kernel_part_past_its_time_ends_the_process_with_the_flex_checks_exit_code():
    """A kernel part that hangs (here: a compile that never ends) is stopped after KERNEL_PART_S by its own timer,
    whatever it is doing, with the flex check's exit code (1 here), so the report keeps the flex check's result."""
    code = ("import sys, time, types; sys.path[:0] = ['.', 'gpu_check']; import cuda_cp_check as c; "
            "c.KERNEL_PART_S = 0.5; c.lse_kernel_line = lambda *a: 'line'; "
            "c.prepare_cp_sums_timing = lambda dev: time.sleep(120); "
            "c.kernel_part(types.SimpleNamespace(type='cuda'), None, None, None, None, exit_code=1); "
            "print('not reached')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["line", "lse kernel: stopped after 0.5 s"], proc.stdout


def test_the_profile_puts_the_kernels_under_the_cp_head():
    """The A/B's profile by model part (gpu_check/kernel_parts.py): hand-written kernels are never named at
    inductor's define_kernel, so their part comes from their names (with or without a suffix inductor adds)."""
    sys.path.insert(0, os.path.join(HERE, "gpu_check"))
    import kernel_parts
    import roofline
    for name in ("cp_lses_forward", "cp_lses_backward", "cp_lses_backward_0"):
        assert kernel_parts.part_of_kernel(name, {}) == roofline.CATEGORIES[1] == "CP head and mixture"
    assert kernel_parts.part_of_kernel("triton_per_fused_0", {}) == kernel_parts.UNKNOWN


GPU_SIDE = """
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path[:0] = [".", "gpu_check"]
import cp_kernel
import preflight
import train_gpt_cplm as tg
pointers = dict(Q="*bf16", K="*bf16", IDS="*i32", TARGETS="*i32", DOCS="*i32", OWN_ONLY="*i8", DOC_START="*i32")
forward = dict(pointers, LSE_DOC="*fp32", LSE_MATCH="*fp32", T="i32")
backward = dict(pointers, DOC_END="*i32", LSE_DOC="*fp32", LSE_MATCH="*fp32", GRAD_DOC="*fp32", GRAD_MATCH="*fp32",
                DQ="*bf16", DK="*bf16", T="i32")
for capability in (80, 90):
    for name, fn, signature, extra in (("forward", cp_kernel.cp_lses_forward, forward, {}),
                                       ("backward dq", cp_kernel.cp_lses_backward, backward, dict(FOR_KEYS=False)),
                                       ("backward dk", cp_kernel.cp_lses_backward, backward, dict(FOR_KEYS=True))):
        constants = dict(D=64, BLOCK_M=cp_kernel.BLOCK_M, BLOCK_N=cp_kernel.BLOCK_N, SCALE_LOG2=cp_kernel.LOG2E / 8,
                         **extra, **({"SCALE": 1 / 8} if "FOR_KEYS" in extra else {}))
        # as every launch specializes them: aligned pointers, T a multiple of 16 (the speedrun's rows)
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in signature}
        signature = dict(signature, **{c: "constexpr" for c in constants})
        binary = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                                options=dict(num_warps=cp_kernel.NUM_WARPS))
        print(json.dumps(dict(preflight.ptxas_report(binary), kernel=name, capability=capability)))
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 3000, (1, 1024), generator=g)
ids[0, ::300] = 50256
targets = torch.roll(ids, -1, 1)
q, k = ((torch.randn(1, 1024, 64, generator=g)).bfloat16().requires_grad_() for _ in range(2))


def cp_sums(q, k, ids, targets):
    doc_ids = tg.doc_ids_of(ids, 50256)
    copyable = tg.target_in_context(ids, targets, doc_ids, 50304)
    lse_doc, lse_match = tg.copy_lses(q, k, ids, targets, doc_ids, copyable, "lse_kernel")
    return (lse_doc - lse_match).sum()


import logging
unread = []  # inductor's reading of which arguments each kernel writes, where it fails (it then copies them all)
handler = logging.Handler()
handler.emit = lambda record: unread.append(record.getMessage()) if "mutated" in record.getMessage() else None
logging.getLogger("torch._dynamo").addHandler(handler)
with preflight._as_gpu():
    graphs = preflight.lower(cp_sums, q, k, ids, targets, sm90=True)
print(json.dumps({"lowered": [[r.kind, r.codegen, r.error] for r in graphs], "unread": unread}))
"""


@pytest.fixture(scope="module")
def gpu_side():
    """The kernels compiled to sm_80 and sm_90 machine code (ptxas's reports), and the CP sums with this backend
    compiled as torch.compile compiles them on a GPU, in a process of its own (here the kernels are interpreted):
    [report per kernel and card], [(graph, code generation reached, error)]."""
    if NEEDS_TRITON:
        pytest.skip(NEEDS_TRITON)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", GPU_SIDE], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines[:-1], lines[-1]


@pytest.mark.parametrize("capability", [80, 90])
def test_the_kernels_compile_for_the_card_without_spilling(gpu_side, capability):
    """The kernels as the speedrun runs them (bf16 q and k, head dim 64) compiled to sm_80 and sm_90 machine code
    with Triton's bundled ptxas: nothing spills to local memory, and the tiles fit the shared memory a thread block
    may have on an A100 (163 KiB) or an H100 (227)."""
    reports = [r for r in gpu_side[0] if r["capability"] == capability]
    assert [r["kernel"] for r in reports] == ["forward", "backward dq", "backward dk"], gpu_side[0]
    for r in reports:
        assert r["arch"].startswith(f"sm_{capability}"), r
        assert r["spill_stores"] == r["spill_loads"] == 0, r
        assert r["shared"] <= 163 * 1024, r


def test_the_kernels_trace_and_lower_through_inductor_as_on_a_gpu(gpu_side):
    """The CP sums with --cp_backend lse_kernel under torch.compile as on a GPU (the kernels as opaque triton ops,
    their autograd): the forward and backward graphs lowered by inductor up to code generation, which read what each
    kernel writes (only the LSEs, dq and dk: no copies of the other inputs at each launch)."""
    assert gpu_side[1]["lowered"] == [["forward", True, None], ["backward", True, None]], gpu_side[1]
    assert gpu_side[1]["unread"] == [], gpu_side[1]["unread"]


@pytest.mark.slow
@pytest.mark.skipif(NEEDS_TRITON is not None, reason=str(NEEDS_TRITON))
@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="compiling every kernel needs fake CUDA tensors: a CUDA build of torch (the default wheel)")
def test_a_training_step_with_the_kernel_compiles_for_sm_90():
    """A CPLM training step with --cp_backend lse_kernel (2 layers, 1024-token rows) through inductor's CUDA path,
    every kernel compiled for an H100/H200 (sm_90), the CP kernels among them: inductor passes their float
    arguments as fp64 (a scale argument made the running sums fp64, which Triton refused), so they take constants;
    and its reading of which arguments a kernel writes (only the LSEs, dq, dk) finds a driver. About a minute
    (slow: -m slow)."""
    import logging
    sys.path.insert(0, os.path.join(HERE, "gpu_check"))
    import preflight
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo")  # where inductor says it could not read them
    logger.addHandler(handler)
    try:  # the driver answering as the card while dynamo traces too: inductor reads which arguments a kernel writes
        with preflight.card("sm_90") as gpu, preflight._as_gpu():
            model = preflight.cuda_path_model(1, 1024, num_layers=2)
            model.cp_backend = "lse_kernel"
            kernels, seconds, _ = preflight.compile_every_kernel(model, *preflight.packed_row(1024, 0),
                                                                 torch.tensor(14, dtype=torch.int32))
    finally:
        logger.removeHandler(handler)
    # without that reading inductor copies every input of the kernels at each launch, as if each were written
    assert not [w for w in warnings if "mutated" in w], warnings
    names = {(k.graph, k.name) for k in kernels}
    assert {("forward", "cp_lses_forward"), ("backward", "cp_lses_backward")} <= names, sorted(names)
    too_big = [(k.graph, k.name, k.shared) for k in kernels if k.shared > gpu.shared_memory_per_block_optin]
    assert not too_big and all(len(k.cubin) > 0 for k in kernels), too_big


if __name__ == "__main__":  # the interpreted cases (the fixture above runs this with TRITON_INTERPRET=1)
    print(json.dumps(run_cases()))
