"""gpu_check/roofline.py, read on a small model: the kernels inductor fuses for each mode's training step on the
CUDA path, each put in the part of the model it computes, with its bytes and FLOPs. records/gpu/roofline.md is the
same reading at the speedrun's size."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check"))
import roofline  # noqa: E402

SMALL = dict(num_layers=2, no_attention_layer=-1, model_dim=256, num_heads=2)  # attention: head dim 128


@pytest.fixture(scope="module")
def kernels():
    return {cplm: roofline.step_kernels(cplm, 1024, **SMALL) for cplm in (0, 1)}


def by_category(found):
    totals = {}
    for k in found:
        n, nbytes, flops = totals.get(k["category"], (0, 0, 0))
        totals[k["category"]] = (n + 1, nbytes + k["bytes"], flops + k["flops"])
    return totals


def test_the_backbone_reads_the_same_in_both_modes_and_the_cp_head_only_in_cplm(kernels):
    """The CP head changes nothing of attention or the MLPs: their kernels, bytes and FLOPs read the same in both
    modes (a kernel put in the wrong part would show here: the CP head's matmuls and the LM head's (T, V)
    reductions reach into the parts beside them). Only CPLM has CP kernels, its two FlexAttention ops forward and
    backward among them; vanilla's head loss moves more bytes than CPLM's (the record's cross-entropy writes a
    float32 (T, V) gradient, lm_head_terms none)."""
    (vanilla, vanilla_flex), (cplm, cplm_flex) = kernels[0], kernels[1]
    v, c = by_category(vanilla), by_category(cplm)
    assert v["MLP"] == c["MLP"], (v["MLP"], c["MLP"])
    # attention's: the same FLOPs and bytes within 1% (its document-mask kernels fuse with the CP head's uses of the
    # document ids in CPLM: a few kilobytes move between the parts)
    (_, v_bytes, v_flops), (_, c_bytes, c_flops) = v["attention"], c["attention"]
    assert v_flops == c_flops and abs(v_bytes - c_bytes) < 0.01 * v_bytes, (v["attention"], c["attention"])
    cp = roofline.CATEGORIES[1]
    assert cp not in v and c[cp][0] > 10 and c[cp][2] > 0, c.get(cp)
    assert sorted((op["role"], op["backward"]) for op in cplm_flex if op["role"].startswith("CP")) == [
        ("CP document mask", False), ("CP document mask", True), ("CP match mask", False), ("CP match mask", True)]
    assert not any(op["role"].startswith("CP") for op in vanilla_flex)
    head = roofline.CATEGORIES[0]
    assert v[head][1] > 1.2 * c[head][1], (v[head], c[head])
    assert all(k["bytes"] >= 0 and k["seconds"] >= 0 for k in cplm)
    assert any(k["what"] == "mm" and k["flops"] > 0 for k in vanilla)  # the matmuls' FLOPs are counted


def test_the_representative_row_visits_whole_documents_for_the_cp_head():
    """The tiles behind the FlexAttention estimates: the CP head's masks cover whole documents (no window), so they
    visit more tiles a head than attention's long window, which visits more than the short one; the match mask's
    tiles are all partial (its token test runs in each)."""
    tiles = roofline.representative_tiles(16 * 1024)
    assert tiles["CP document mask"][0] > tiles["attention long"][0] > tiles["attention short"][0] > 0
    assert tiles["CP match mask"][:2] == (tiles["CP document mask"][0],) * 2
    assert tiles["CP document mask"][1] < tiles["CP document mask"][0]
