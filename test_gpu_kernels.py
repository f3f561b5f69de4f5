"""The GPU pre-flight to machine code, on a CPU machine: every FlexAttention kernel that the speedrun preset
compiles on a GPU, in both modes, rendered by inductor at the preset's shapes with the CUDA heuristics of each
card (an H200, sm_90; an A100, sm_80; an RTX 4090, sm_89, as the L4 and L40S) and compiled to its machine code
by Triton's bundled ptxas (gpu_check/preflight.py: `lower(sm90=True)` under `card(name)`, `compile_cubin`). Each
must fit its card's shared memory a block, or it would not launch; the CP head's kernels must not spill.

Needs Triton (the CUDA wheels of torch bring it; with the CPU build, `pip install triton==3.6.0`); skipped
without it. Slow (minutes a card: the 12-layer model is traced and lowered four times):
    python3 -m pytest -m slow test_gpu_kernels.py
"""
import os
import sys

import pytest
import torch

import train_gpt_cplm as tg

pytest.importorskip("triton", reason="the sm_90 pre-flight needs Triton: pip install triton==3.6.0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check"))
import preflight  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(preflight.CARDS))
def table(request):
    with preflight.card(request.param) as gpu:
        return request.param, gpu, preflight.kernel_table()


def test_every_flex_kernel_compiles_and_would_launch(table):
    """Both modes' FlexAttention kernels (attention forward and backward, the CP head's document and match
    masks forward and backward, evaluation's forwards) reach the card's machine code, each within its shared
    memory per block (opt-in). The tables are records/gpu/README.md's."""
    name, gpu, rows = table
    print(f"\n{name}, {gpu.name}\n" + preflight.markdown_table(rows))
    roles = {(mode, graph, role, kernel.op) for mode, graph, role, kernel, _ in rows}
    for graph, ops in (("training", ("flex_attention", "flex_attention_backward")), ("evaluation", ("flex_attention",))):
        for op in ops:
            assert ("vanilla", graph, "attention", op) in roles, (graph, op)
            for role in ("CP document mask", "CP match mask"):
                assert ("CPLM", graph, role, op) in roles, (graph, role, op)
    for mode, graph, role, kernel, r in rows:
        assert r["cubin_bytes"] > 0 and r["arch"].startswith(name)
        assert r["shared"] <= gpu.shared_memory_per_block_optin, (name, mode, graph, role, kernel.label(), r)


def test_the_cp_head_kernels_do_not_spill_much(table):
    """CP_KERNEL_OPTIONS was chosen by this report: with inductor's default for head dim 64 on sm_90 (4 warps
    for a 128 x 128 tile) both forward kernels spilled (0.5 / 1.1 KB of stores per thread). Now no CP kernel
    spills on sm_90 and no forward kernel on any card; on sm_80 and sm_89 inductor's 64 x 64 backward tile spills
    88-152 B per thread (torch 2.14.1), which a 32-row tile would not: not chosen without a GPU to time the two."""
    name, _, rows = table
    for mode, graph, role, kernel, r in rows:
        if role.startswith("CP"):
            bound = 0 if name == "sm_90" or kernel.op == "flex_attention" else 256
            assert r["spill_stores"] <= bound and r["spill_loads"] <= bound, (name, graph, role, kernel.label(), r)


def test_the_default_cp_options_spill(monkeypatch):
    """Before and after: with no kernel options (inductor's default tile for head dim 64) the CP forward
    kernels spill, which the check above catches; with CP_KERNEL_OPTIONS they do not."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_gpu_preflight import cp_inputs, flex_copy_loss
    spills = {}
    for name, options in (("default", {}), ("chosen", tg.CP_KERNEL_OPTIONS)):
        monkeypatch.setattr(tg, "CP_KERNEL_OPTIONS", options)
        kernels = preflight.distinct_kernels(preflight.lower(flex_copy_loss, *cp_inputs(T=512), sm90=True))
        spills[name] = [preflight.compile_cubin(k)["spill_stores"] for k in kernels if k.op == "flex_attention"]
    assert all(s > 0 for s in spills["default"]) and all(s == 0 for s in spills["chosen"]), spills


def logits_buffers(fn, T, model):
    window = torch.tensor(14, dtype=torch.int32)
    graphs = preflight.wrapper_graphs(fn, *preflight.packed_row(T, 1), window)
    sizes = [s for graph in graphs for s in graph.allocated()]
    V = model.config.padded_vocab
    return {"float32": sizes.count(T * V * 4), "bf16": sizes.count(T * V * 2), "largest": max(sizes) / (T * V)}


@pytest.mark.parametrize("cplm", [0, 1])
def test_evaluation_holds_no_float32_logits(cplm):
    """Evaluation with per-token statistics, as compiled on CUDA (2 layers, 2048-token rows): the bf16 logits
    are its one (T, V) buffer; a float32 copy would be 52.7 GB more at the record's 256Ki-token rows."""
    T = 2048
    model = preflight.cuda_path_model(cplm, T, num_layers=2, no_attention_layer=-1).eval()
    with torch.no_grad():
        found = logits_buffers(lambda a, b, w: model(a, b, w, token_stats=True), T, model)
    assert found == {"float32": 0, "bf16": 1, "largest": 2}, found


def test_the_float32_logits_check_can_fail():
    """The same reading finds them where they are: vanilla's training graph (the record's cross-entropy,
    kept as the record has it) writes float32 (T, V) buffers; CPLM's training graph does not."""
    T = 2048
    found = {}
    for cplm in (0, 1):
        model = preflight.cuda_path_model(cplm, T, num_layers=2, no_attention_layer=-1)
        found[cplm] = logits_buffers(model, T, model)
    assert found[0]["float32"] >= 1 and found[1]["float32"] == 0, found


@pytest.mark.parametrize("cplm", [0, 1])
def test_the_memory_reading_ends_a_backward_with_the_gradients_to_the_byte(cplm):
    """step_memory's reading of a training step (2 layers, 2048-token rows): the backward's buffers still alive
    at its return are the parameters' gradients, byte for byte; every tensor the backward takes, other than
    parameters and the loss's gradient, is one the forward handed it, at least as large as the backward
    declares it; and the FP8 head's backward holds its (T, V) e5m2 gradient inside, beyond its outputs."""
    T = 2048
    model = preflight.cuda_path_model(cplm, T, num_layers=2)
    window = torch.tensor(14, dtype=torch.int32)
    forward, backward = preflight.wrapper_graphs(model, *preflight.packed_row(T, 0), window)
    _, saved = forward.replay()
    taken = [name for name in backward.inputs if not name.startswith(("primals_", "tangents_"))]
    assert taken and all(name in saved and saved[name][1] >= backward.inputs[name] for name in taken), [
        (name, saved.get(name), backward.inputs[name]) for name in taken]
    _, alive = backward.replay({name: saved[name] for name in taken})
    assert sum(dict(alive.values()).values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    V = model.lm_head.weight.shape[0]
    assert preflight._fp8_insides(model, T)["fp8_matmul_backward"] >= T * V


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="compiling every kernel needs fake CUDA tensors: a CUDA build of torch (the default wheel)")
@pytest.mark.parametrize("name", list(preflight.CARDS))
def test_every_kernel_of_a_training_step_compiles_for_the_card(name):
    """Beyond the FlexAttention kernels: every Triton kernel inductor's CUDA path makes for a CPLM training step
    (pointwise, reductions, FlexAttention's templates with what inductor fused into them), compiled for the card
    at a small size (2 layers, 1024-token rows; the preset's: `python3 gpu_check/preflight.py every`), each within its
    shared memory a block."""
    with preflight.card(name) as gpu:
        model = preflight.cuda_path_model(1, 1024, num_layers=2)
        kernels, seconds, _ = preflight.compile_every_kernel(model, *preflight.packed_row(1024, 0),
                                                             torch.tensor(14, dtype=torch.int32))
    assert set(seconds) == {"forward", "backward", "all"} and len(kernels) > 50, (seconds, len(kernels))
    for graph, op in (("forward", "flex_attention"), ("backward", "flex_attention_backward")):
        assert any(k.graph == graph and op in k.name for k in kernels), (graph, op)
    too_big = [(k.graph, k.name, k.shared) for k in kernels if k.shared > gpu.shared_memory_per_block_optin]
    assert not too_big and all(len(k.cubin) > 0 for k in kernels), too_big
