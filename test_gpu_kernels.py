"""The GPU pre-flight to machine code, on a CPU machine: every FlexAttention kernel that the speedrun preset
compiles on an H100/H200, in both modes, rendered by inductor at the preset's shapes with the CUDA heuristics
and compiled to sm_90 machine code by Triton's bundled ptxas (tools/preflight.py: `lower(sm90=True)`,
`compile_sm90`). Each must fit the H200's shared memory; the CP head's kernels must not spill.

Needs Triton (the CUDA wheels of torch bring it; with the CPU build, `pip install triton==3.6.0`); skipped
without it. Slow (minutes: the 12-layer model is traced and lowered four times):
    python3 -m pytest -m slow test_gpu_kernels.py
"""
import os
import sys

import pytest
import torch

import train_gpt_cplm as tg

pytest.importorskip("triton", reason="the sm_90 pre-flight needs Triton: pip install triton==3.6.0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
import preflight  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def table():
    return preflight.kernel_table()


def test_every_flex_kernel_compiles_for_the_h200(table):
    """Both modes' FlexAttention kernels (attention forward and backward, the CP head's document and match
    masks forward and backward, evaluation's forwards) reach sm_90 machine code, each within the H200's
    shared memory per block. The table is records/gpu/README.md's."""
    print("\n" + preflight.markdown_table(table))
    roles = {(mode, graph, role, kernel.op) for mode, graph, role, kernel, _ in table}
    for graph, ops in (("training", ("flex_attention", "flex_attention_backward")), ("evaluation", ("flex_attention",))):
        for op in ops:
            assert ("vanilla", graph, "attention", op) in roles, (graph, op)
            for role in ("CP document mask", "CP match mask"):
                assert ("CPLM", graph, role, op) in roles, (graph, role, op)
    for mode, graph, role, kernel, r in table:
        assert r["cubin_bytes"] > 0 and r["arch"].startswith("sm_90")
        assert r["shared"] <= preflight.H200_SHARED_PER_BLOCK, (mode, graph, role, kernel.label(), r)


def test_the_cp_head_kernels_do_not_spill(table):
    """CP_KERNEL_OPTIONS was chosen by this report: with inductor's default for head dim 64 on sm_90 (4 warps
    for a 128 x 128 tile) both forward kernels spilled (0.5 / 1.1 KB of stores per thread)."""
    for mode, graph, role, kernel, r in table:
        if role.startswith("CP"):
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (graph, role, kernel.label(), r)


def test_the_default_cp_options_spill(monkeypatch):
    """Before and after: with no kernel options (inductor's default tile for head dim 64) the CP forward
    kernels spill, which the check above catches; with CP_KERNEL_OPTIONS they do not."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_gpu_preflight import cp_inputs, flex_copy_loss
    spills = {}
    for name, options in (("default", {}), ("chosen", tg.CP_KERNEL_OPTIONS)):
        monkeypatch.setattr(tg, "CP_KERNEL_OPTIONS", options)
        kernels = preflight.distinct_kernels(preflight.lower(flex_copy_loss, *cp_inputs(T=512), sm90=True))
        spills[name] = [preflight.compile_sm90(k)["spill_stores"] for k in kernels if k.op == "flex_attention"]
    assert all(s > 0 for s in spills["default"]) and all(s == 0 for s in spills["chosen"]), spills


def logits_buffers(fn, T, model):
    window = torch.tensor(14, dtype=torch.int32)
    sizes = [s for _, s in preflight.allocations(fn, *preflight.packed_row(T, 1), window) if isinstance(s, int)]
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
