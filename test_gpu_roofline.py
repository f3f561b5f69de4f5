"""gpu_check/roofline.py, read on a small model: the kernels inductor fuses for each mode's training step on the
CUDA path, each put in the part of the model it computes, with its bytes and FLOPs, timed by each card's roofline.
records/gpu/roofline.md is the same reading at the speedrun's size, records/one_gpu_race/roofline_gpu1.md at the
one-GPU race's (--preset gpu1)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check"))
import roofline  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402

SMALL = dict(num_layers=2, no_attention_layer=-1, model_dim=256, num_heads=2)  # attention: head dim 128
T, D, VOCAB = 1024, 256, 50304


@pytest.fixture(scope="module")
def tiles():
    return roofline.representative_tiles(T)


@pytest.fixture(scope="module")
def kernels(tiles):
    return {cplm: roofline.mode_kernels(cplm, T, tiles, **SMALL) for cplm in (0, 1)}


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
    backward among them."""
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
    assert all(k["bytes"] >= 0 and k["flops"] >= 0 for k in cplm)


def test_every_matmul_of_the_backbone_is_counted_and_flexattention_by_its_tiles(kernels):
    """Each weight of attention (q, k, v and the output projection) and of the MLPs costs 6 T FLOPs a step: once
    forward, twice backward (the input's gradient and the weight's). The output projection's input gradient feeds
    only FlexAttention's backward, whose stand-in reads nothing: it was dropped as dead before, 0.64 TFLOP at the
    speedrun's size. FlexAttention's own matmuls come from its tiles: per tile and head Q K^T and P V forward, five
    backward (after its delta kernel, no matmul), each 2 x 128 x 128 x head dim."""
    for found, _ in kernels.values():
        def matmuls(part):
            return sum(k["flops"] for k in found if k["what"] == "mm" and k["category"] == part)
        assert matmuls("attention") == 6 * T * SMALL["num_layers"] * 4 * D * D
        assert matmuls("MLP") == 6 * T * SMALL["num_layers"] * 2 * D * 4 * D
    op = dict(graph="forward", role="attention", backward=False, H=2, T=T, d=128)
    tile = 2 * 128 * 128 * 128
    assert [k["flops"] for k in roofline.flex_kernels(op, (10, 4, 3))] == [10 * 2 * 2 * tile]
    assert [k["flops"] for k in roofline.flex_kernels(dict(op, backward=True), (10, 4, 3))] == [0, 10 * 2 * 5 * tile]
    # a value narrower than the queries (the CP head's 16-wide zero): P V, dP and dV at its width, and its bytes
    narrow = dict(op, dv=16)
    assert [k["flops"] for k in roofline.flex_kernels(narrow, (10, 4, 3))] == [10 * 2 * 2 * 128 * 128 * (128 + 16)]
    assert roofline.flex_kernels(dict(narrow, backward=True), (10, 4, 3))[1]["flops"] == \
        10 * 2 * 2 * 128 * 128 * (3 * 128 + 2 * 16)
    assert roofline.flex_kernels(narrow, (10, 4, 3))[0]["bytes"] == T * 2 * 2 * (2 * 128 + 2 * 16) + T * 2 * 4
    cp = [k for k in kernels[1][0] if k["what"] == "flex forward" and k["name"].startswith("CP")]
    assert len(cp) == 2 and all(k["tile_flops"] == 2 * 128 * 128 * (64 + 16) for k in cp)  # read from the graph
    flex = [k for k in kernels[0][0] if k["what"] == "flex forward"]
    assert len(flex) == 2 and all(k["flops"] == k["tiles"][0] * 2 * 2 * tile for k in flex)


def test_both_losses_read_the_logits_once_forward_and_once_backward(kernels):
    """The head's loss as inductor schedules it for CUDA: its online softmax (max and sum of exponentials in one
    pass) and no float32 (T, V) buffer, so the record's cross-entropy, like lm_head_terms, reads the bf16 logits once
    forward (the target's logit is one element a row) and once backward, writing the bf16 gradient. Read with the
    CPU's heuristics (they write the soft-capped logits out in float32) and inductor's own byte count (a fused
    kernel's gather charged the whole buffer), vanilla's forward moved 10 bytes a logit, not 2."""
    logits = T * VOCAB
    for found, _ in kernels.values():
        head = [k for k in found if k.get("logits")]
        forward = sum(k["bytes"] for k in head if k["graph"] == "forward")
        backward = sum(k["bytes"] for k in head if k["graph"] == "backward")
        assert 2 * logits <= forward < 2.01 * logits, forward / logits
        assert 4 * logits <= backward < 4.01 * logits, backward / logits
        assert all(k["category"] == roofline.CATEGORIES[0] for k in head)


def test_a_library_call_is_charged_every_byte_of_a_buffer_over_a_billion_elements():
    """Inductor's byte count takes a library call's (and a fused kernel's) loops as 1e9 elements: the FP8 head's
    logits, 2.5e9 elements at 48Ki tokens, counted 1e9. Here the FP8 matmul writes 1.26e9 bf16 logits (nothing is
    computed or allocated: the graph is read at its scheduler)."""
    rows, width = 25_000, 64
    x, w = torch.zeros(rows, width, dtype=torch.bfloat16), torch.zeros(VOCAB, width)
    def head(x, w):
        logits, x8, w8 = tg.fp8_matmul(x, w, 1.0, 1.0, 1.0)
        return logits.float().sum(), x8, w8
    found, _ = roofline.graph_kernels(head, (x, w), backward=False)
    fp8 = [k for k in found if k["what"] == "fp8_matmul"]
    # x and w read; the logits, x and w in FP8 written
    assert [k["bytes"] for k in fp8] == [rows * width * 2 + VOCAB * width * 4 + rows * VOCAB * 2 + rows * width
                                         + VOCAB * width]


def test_each_card_runs_at_its_achievable_bandwidth_and_rate():
    """Bytes run at the rate a streaming copy reaches (BabelStream's Copy: 2.90 of the H100's 3.35 TB/s, 4.01 of
    the H200's 4.8), as the GEMM rate is a measured one, not the spec sheet's; FP8 twice bf16."""
    h100, h200 = roofline.CARDS["h100"], roofline.CARDS["h200"]
    for card, spec, copy, bf16 in ((h100, 3.35e12, 2.90e12, 794.5e12), (h200, 4.8e12, 4.01e12, 790e12)):
        assert card.spec_bandwidth == spec and card.derating == pytest.approx(copy / spec)
        assert roofline.seconds(dict(bytes=1e12, flops=0, rate="bf16"), card) == pytest.approx(1e12 / copy)
        assert roofline.seconds(dict(bytes=0, flops=1e15, rate="fp8"), card) == pytest.approx(1e15 / (2 * bf16))
    assert roofline.parser().parse_args(["--card", "h100"]).card == "h100"
    assert roofline.parser().parse_args([]).card == "both"


def test_the_three_changes_are_costed_against_the_kernels_they_replace(kernels, tiles):
    """The reading's three changes, by the corrected roofline on the small model: one LSE-only kernel each way
    for the CP head's two ops (four kernels and two delta kernels) saves time on both cards; CPLM's head loss
    already reads the logits once each way (nothing to save); the match mask's lists, built again in copy_lses,
    become one kernel. The report gives each card's floors and these savings."""
    modes = {name: dict(kernels=found, flex=flex, optimizer=(0, 0, 0), vocab=VOCAB)
             for name, (found, flex) in zip(("vanilla", "CPLM"), (kernels[0], kernels[1]))}
    for card in roofline.CARDS.values():
        lse, head, masks = (roofline.changes(modes, tiles, card)[name] for name in roofline.CHANGES)
        assert lse[:2] == (6, 2) and lse[2][0] > 0
        assert head[0] >= 2 and abs(head[2][0]) < 0.01 * sum(roofline.seconds(k, card) for k in kernels[1][0]
                                                               if k.get("logits"))
        assert masks[0] >= 2 and masks[1] == 1 and masks[2][1] > 0
    report = roofline.markdown(modes, tiles, T, 0.0, list(roofline.CARDS.values()))
    for card in roofline.CARDS.values():
        assert f"| {card.name} | CPLM / vanilla |" in report
    assert all(f"| {name} |" in report for name in roofline.CHANGES)


def test_the_kernel_as_written_visits_the_cp_heads_tiles_and_saves_its_time(kernels, tiles):
    """cp_kernel.py as the roofline costs it: at 128 x 128 its loops visit exactly the CP document mask's tiles
    (representative_tiles, FlexAttention's count), from either side; at its 64 x 64, three to four times as many
    tiles of a quarter of the work, and a longest loop about twice as long (so half the work: 64-row query
    blocks); its three kernels replace the two ops' six and save time on both cards."""
    whole = tiles["CP document mask"]
    at128, at64 = roofline.kernel_tiles(T, 128), roofline.kernel_tiles(T, 64)
    for side in ("queries", "keys"):
        assert (at128[side][0], at128[side][2]) == (whole[0], whole[2]), (side, at128, whole)
        assert 3 * at128[side][0] <= at64[side][0] <= 4 * at128[side][0], (side, at128, at64)
        assert 2 * at128[side][2] - 2 <= at64[side][2] <= 2 * at128[side][2], (side, at128, at64)
    modes = {name: dict(kernels=found, flex=flex, optimizer=(0, 0, 0), vocab=VOCAB)
             for name, (found, flex) in zip(("vanilla", "CPLM"), (kernels[0], kernels[1]))}
    for card in roofline.CARDS.values():
        now, after, (saved, with_launches) = roofline.as_written(modes, card)
        assert (now, after) == (6, 3) and saved > 0 and with_launches > 0, (card.name, saved, with_launches)
    assert "| the first as cp_kernel.py writes it" in roofline.markdown(modes, tiles, T, 0.0,
                                                                        list(roofline.CARDS.values()))


def test_the_representative_row_visits_whole_documents_for_the_cp_head():
    """The tiles behind the FlexAttention estimates: the CP head's masks cover whole documents (no window), so they
    visit more tiles a head than attention's long window, which visits more than the short one; the match mask's
    tiles are all partial (its token test runs in each)."""
    tiles = roofline.representative_tiles(16 * 1024)
    assert tiles["CP document mask"][0] > tiles["attention long"][0] > tiles["attention short"][0] > 0
    assert tiles["CP match mask"][:2] == (tiles["CP document mask"][0],) * 2
    assert tiles["CP document mask"][1] < tiles["CP document mask"][0]


def test_a_preset_sets_the_model_row_and_schedule_it_reads(kernels, tiles):
    """--preset gpu1 reads the one-GPU race's model (4 x 768, attention in every layer: 2 of 4 layers long, as
    window_pattern), its 32Ki-token row and its 500-step schedule; the speedrun's 12 layers without layer 7 have 3
    long of 11. A shape the model cannot take is a one-line error. The report names the preset and its shape
    (records/one_gpu_race/roofline_gpu1.md is that report at gpu1's size)."""
    def roles(**config):
        layers = config.get("num_layers", 12)
        n = layers - (0 <= config.get("no_attention_layer", 7) < layers)  # layers with attention
        flex = [dict(role="attention", backward=b) for b in (False,) * n + (True,) * n]
        found = [op["role"].split()[1] for op in roofline.attention_windows(flex, **config)]
        return found[:n], found[n:]
    gpu1 = roofline.hyperparameters(roofline.parser().parse_args(["--preset", "gpu1"]))
    assert (gpu1.seq_len, gpu1.num_iterations) == (32 * 1024, 500)
    assert roofline.model_config(gpu1) == dict(num_layers=4, model_dim=768, num_heads=6, no_attention_layer=-1,
                                               cp_dim=64)
    assert roles(**roofline.model_config(gpu1)) == (["long", "short", "short", "long"],) * 2
    forward, backward = roles()
    assert forward.count("long") == 3 and len(forward) == 11 and backward == forward[::-1]
    assert roofline.hyperparameters(roofline.parser().parse_args(
        ["--preset", "gpu1", "--num_layers", "6", "--no_attention_layer", "2"])).num_layers == 6
    for bad in (["--num_layers", "3"], ["--no_attention_layer", "12"], ["--seq_len", "1000"]):
        with pytest.raises(ValueError):
            roofline.hyperparameters(roofline.parser().parse_args(bad))
    modes = {name: dict(kernels=found, flex=flex, optimizer=(0, 0, 0), vocab=VOCAB)
             for name, (found, flex) in zip(("vanilla", "CPLM"), (kernels[0], kernels[1]))}
    report = roofline.markdown(modes, tiles, T, 0.0, list(roofline.CARDS.values()), a=gpu1, command="CMD")
    assert "`CMD`" in report and "The gpu1 preset's training step (4 x 768, 6 heads, attention in every layer)" \
        in report and "the gpu1 preset's 500 steps" in report and "Not measured at this size" in report
