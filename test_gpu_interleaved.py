"""The interleaved A/B's arithmetic (gpu_check/interleaved.py): the ratio's interval from a moving-block bootstrap
over rounds, the per-phase table, the third model (vanilla through CPLM's loss), the flag checks, and the profile's
reduction to a table. The A/B itself runs in the GPU check's dry run
(test_gpu_preflight.py)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "gpu_check"))
import interleaved  # noqa: E402
from conftest import as_a_command  # noqa: E402


def ar1(rng, n, rho, sd):
    """An AR(1) series with lag-1 autocorrelation rho and marginal sd: what one process's step times look like
    (the H200's 200-step logs: lag-1 autocorrelation 0.16-0.55, sd 3-4%)."""
    x = np.empty(n)
    x[0] = rng.normal(0, sd)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + rng.normal(0, sd * (1 - rho ** 2) ** 0.5)
    return x


def coverage(block_of, rho, sims=150, rounds=200, truth=1.03, seed=0):
    """How often the 95% interval holds the true ratio, over simulated A/Bs: both modes' steps share the card's
    drift and each has its own autocorrelated noise."""
    rng = np.random.default_rng(seed)
    hits = 0
    for k in range(sims):
        drift = np.linspace(0, 0.07, rounds)  # the 200-step call's steps slowed ~7% over the run, both modes alike
        vanilla = 100 * (1 + drift) * np.exp(ar1(rng, rounds, rho, 0.03))
        cplm = truth * 100 * (1 + drift) * np.exp(ar1(rng, rounds, rho, 0.03))
        lo, hi = interleaved.block_bootstrap_ratio(cplm, vanilla, block_of(rounds), resamples=1000, seed=k)
        hits += lo <= truth <= hi
    return hits / sims


def test_the_block_bootstrap_interval_covers_an_autocorrelated_ratio():
    """With the steps' autocorrelation at the top of what the H200 showed (0.55), the moving-block interval holds the
    true ratio about 95% of the time; resampling single rounds (an iid bootstrap) would not: its interval is too
    narrow by about sqrt((1 + rho) / (1 - rho)), 1.9x."""
    blocks = coverage(interleaved.block_length, rho=0.55)
    single = coverage(lambda rounds: 1, rho=0.55)
    assert 0.88 <= blocks <= 0.995, blocks
    assert single < 0.82 and single < blocks - 0.1, (single, blocks)


def test_the_interval_is_tight_enough_for_a_half_percent_question():
    """At the H200's noise within one process (sd 3% a step, lag-1 autocorrelation 0.35: a standard error of about
    0.4% at 200 rounds, as the 200-step call's logs said), the 95% half-width averages about 0.8% at 200 rounds and
    0.5% at 500 (the call's 120 s of rounds at about 0.21 s a round: ~570)."""
    rng = np.random.default_rng(1)
    widths = {}
    for rounds in (200, 500):
        halves = []
        for k in range(40):
            vanilla = 100 * np.exp(ar1(rng, rounds, 0.35, 0.03))
            cplm = 103 * np.exp(ar1(rng, rounds, 0.35, 0.03))
            lo, hi = interleaved.block_bootstrap_ratio(cplm, vanilla, interleaved.block_length(rounds), 500, seed=k)
            halves.append((hi - lo) / 2 / (cplm.sum() / vanilla.sum()))
        widths[rounds] = np.mean(halves)
    assert 0.0065 < widths[200] < 0.0095 and 0.004 < widths[500] < 0.006, widths


def test_the_profile_reduction_takes_nesting_apart_and_finds_what_only_cplm_runs():
    """reduce_profile on hand-made traces: nested CPU operators count their own time only (a child's time leaves its
    parent), the busy time is the union of the intervals (a gap between operators is idle), inductor's per-graph
    kernel numbers are dropped so the same kernel in both modes is one row; the table names the kernels only CPLM
    runs with their total, and the shared kernels' difference."""
    # (name, start us, duration us, thread): over 2 steps of 1000 us each
    vanilla = [("aten::mm", 0, 400, 1), ("aten::mul", 100, 100, 1), ("triton_poi_fused_add_3", 500, 300, 1),
               ("aten::mm", 1000, 400, 1), ("triton_poi_fused_add_0", 1500, 300, 1)]
    cplm = vanilla + [("triton_tem_fused_flex_7", 1850, 100, 1), ("triton_tem_fused_flex_2", 850, 100, 1)]
    profiles = {"vanilla": interleaved.reduce_profile(vanilla, 2, 2.0),
                "cplm": interleaved.reduce_profile(cplm, 2, 2.0)}
    v = profiles["vanilla"]
    assert v["kernels"]["aten::mm"] == (0.35, 1.0)  # (400 - 100 + 400) us over 2 steps; one launch a step
    assert v["kernels"]["aten::mul"] == (0.05, 0.5)
    assert v["kernels"]["triton_poi_fused_add"] == (0.3, 1.0)
    assert abs(v["busy"] - 0.7) < 1e-9 and v["wall"] == 1.0  # 1400 us of 2000 busy
    assert abs(profiles["cplm"]["busy"] - 0.8) < 1e-9
    lines = interleaved.profile_table(profiles, "vanilla", "cplm", interleaved.torch.device("cpu"), 2)
    text = "\n".join(lines)
    assert "  vanilla: step 1.00 ms, busy 0.70 ms, idle 0.30 ms (30.0%: host-bound gaps), 2.5 launches a step" in text
    assert "  kernels only cplm runs: 1, 1 launches, 0.100 ms a step: triton_tem_fused_flex 0.100" in text
    assert "  kernels only vanilla runs: 0, 0.000 ms a step" in text
    assert "  kernels both run: 3, vanilla 0.700 ms, cplm 0.700 ms a step, difference +0.000 ms" in text
    assert lines[3] == "  | kernel | vanilla ms | cplm ms | cplm - vanilla |"


def test_the_phase_table_gives_each_phase_its_difference_and_splits_cplms_extra():
    """phase_lines on made-up rounds: forward, backward and optimizer summed into the step, each mode minus vanilla
    with an interval that covers the true difference, and CPLM's extra split into the loss's form (cplm_loss -
    vanilla) and the CP head's part (cplm - cplm_loss), the two adding up to the whole."""
    rng = np.random.default_rng(0)
    R = 200
    base = {"forward": 10.0, "backward": 20.0, "optimizer": 5.0}
    extra = {"vanilla": {}, "cplm_loss": {"forward": 0.5}, "cplm": {"forward": 1.0, "backward": 1.5}}
    phases = {m: {ph: [(base[ph] + e.get(ph, 0) + rng.normal(0, 0.2), 1.0, 0) for _ in range(R)] for ph in base}
              for m, e in extra.items()}
    lines = interleaved.phase_lines(["vanilla", "cplm_loss", "cplm"], phases, interleaved.torch.device("cpu"))
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("  | ") and "phase" not in line}
    assert list(rows) == ["forward", "backward", "optimizer", "step"]

    def diff(cell):  # "+2.50 [+2.43, +2.57]" -> (2.5, 2.43, 2.57)
        return tuple(float(x) for x in re.findall(r"[+-]\d+\.\d+", cell))

    cells = {ph: [c.strip() for c in row.split("|")[2:-1]] for ph, row in rows.items()}
    for ph, true in [("forward", 1.0), ("backward", 1.5), ("optimizer", 0.0), ("step", 2.5)]:
        d, lo, hi = diff(cells[ph][4])  # cplm - vanilla
        assert lo <= true <= hi and hi - lo < 0.5, (ph, cells[ph])
    assert abs(float(cells["step"][0]) - 35.0) < 0.1  # the step is the phases' sum
    # on a GPU each cell also gives the host's time and the share of rounds the GPU had run out of work
    phases["cplm"]["optimizer"] = [(5.0, 4.0, r % 2) for r in range(R)]
    gpu_lines = interleaved.phase_lines(["vanilla", "cplm_loss", "cplm"], phases, interleaved.torch.device("cuda"))
    optimizer = next(line for line in gpu_lines if line.startswith("  | optimizer |"))
    assert optimizer.split("|")[4].strip() == "5.00 (4.00, GPU idle 50%)", optimizer
    split = next(line for line in lines if "CPLM's extra" in line)
    whole, loss_part, head_part = (diff(x)[0] for x in re.findall(r"[+-]\d+\.\d+ \[[^]]*\]", split))
    assert abs(whole - (loss_part + head_part)) < 0.011 and abs(loss_part - 0.5) < 0.1, split


def test_cplm_loss_mode_trains_on_vanillas_loss_value_and_gradients():
    """The third model of the A/B (cplm_loss) computes vanilla's loss through CPLM's head terms: the same value and
    gradients as vanilla's model (same seed), through the eager CPU head and through the form written for inductor."""
    tg = interleaved.tg
    a = tg.dataclasses.replace(tg.parse_args(["--preset", "cpu", "--num_layers", "2", "--model_dim", "32",
                                             "--num_heads", "2", "--vocab_size", "300", "--seq_len", "128",
                                             "--batch_size", "128"]), bos_id=299)
    x = interleaved.torch.randint(1, 300, (1, 128))
    y = interleaved.torch.randint(1, 300, (1, 128))
    for inductor_form in (False, True):
        losses, grads = [], []
        for cls in (tg.GPT, interleaved.VanillaThroughCPLMLoss):
            interleaved.torch.manual_seed(0)
            model = cls(tg.GPTConfig.from_args(a))
            if inductor_form:
                model.head_loss = tg.HeadLoss(a.logit_softcap, model.config.copy_id)
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            grads.append(interleaved.torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert abs(losses[0] - losses[1]) < 1e-5, losses
        assert interleaved.torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_bad_timing_flags_are_refused_in_one_line_before_any_model_is_built(monkeypatch):
    """The first in a real process (its exit code, no traceback); the others through main in this process, where a
    model built (interleaved.Mode) would be seen."""
    built = []
    monkeypatch.setattr(interleaved, "Mode", lambda *a, **k: built.append(a))
    for i, flags in enumerate((["--rounds_s", "nan"], ["--end_in_s", "nan"], ["--end_in_s", "-1"],
                               ["--profile_steps", "-2"], ["--profile_reserve_s", "inf"],
                               ["--modes", "vanilla,cplm_loss,vanilla"])):
        out = as_a_command(interleaved.main, flags) if i else subprocess.run(
            [sys.executable, os.path.join(ROOT, "gpu_check", "interleaved.py"), *flags], capture_output=True, text=True,
            timeout=120)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and "error: --" in out.stderr.strip().splitlines()[-1], (flags, out.stderr)
    assert built == []


def fake_kernel_node(*modules):
    """A scheduler node as kernel_parts reads one: its FX nodes' module paths."""
    from types import SimpleNamespace

    class FXNode:  # hashable, as torch.fx.Node is
        def __init__(self, meta):
            self.meta = meta

    fx = [FXNode({"nn_module_stack": {"0": (m, None)}} if m else {}) for m in modules]
    inner = SimpleNamespace(node=SimpleNamespace(origins=fx))
    return SimpleNamespace(get_nodes=lambda: [inner])


def test_kernels_are_grouped_by_the_model_part_recorded_when_they_were_generated(tmp_path):
    """kernel_parts: a kernel's part is what most of its FX nodes compute; a file of parts read back (a line cut by a
    killed writer skipped, a name two graphs gave different parts marked ambiguous); a profile's kernels summed by
    part, library calls and unrecorded generated kernels apart; the table prints the parts' differences."""
    import json
    import kernel_parts
    cp, attn = "CP head and mixture", "attention"
    assert kernel_parts.part_of_schedule([fake_kernel_node("L['self'].cp_head", "L['self'].cp_head", "")]) == cp
    assert kernel_parts.part_of_schedule([fake_kernel_node("L['self'].blocks[0].attn", "")]) == attn
    path = tmp_path / "parts.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in [
        {"kernel": "triton_tem_fused_flex_attention_5", "part": cp},
        {"kernel": "triton_tem_fused_flex_attention_2", "part": attn},
        {"kernel": "triton_poi_fused_add_0", "part": attn}, {"kernel": "triton_poi_fused_add_0", "part": "MLP"}])
        + '\n{"kernel": "triton_red_fu')
    parts = kernel_parts.read_parts(str(path))
    assert parts == {"triton_tem_fused_flex_attention_5": cp, "triton_tem_fused_flex_attention_2": attn,
                     "triton_poi_fused_add_0": "ambiguous: MLP / attention"}
    vanilla = [("triton_tem_fused_flex_attention_2", 0, 400, 1), ("sm90_xmma_gemm_bf16", 500, 200, 1)]
    cplm = vanilla + [("triton_tem_fused_flex_attention_5", 800, 100, 1), ("triton_poi_fused_new_9", 950, 50, 1)]
    profiles = {"vanilla": interleaved.reduce_profile(vanilla, 1, 1.0, parts),
                "cplm": interleaved.reduce_profile(cplm, 1, 1.0, parts)}
    assert profiles["cplm"]["parts"] == {attn: 0.4, kernel_parts.LIBRARY: 0.2, cp: 0.1, kernel_parts.UNKNOWN: 0.05}
    text = "\n".join(interleaved.profile_table(profiles, "vanilla", "cplm", interleaved.torch.device("cuda"), 1))
    assert f"  | {cp} | 0.000 | 0.100 | +0.100 |" in text and f"  | {attn} | 0.400 | 0.400 | +0.000 |" in text


@pytest.mark.slow
def test_inductor_records_each_generated_kernels_part_as_it_names_it(tmp_path, monkeypatch):
    """kernel_parts.record_into on a real compile (inductor's C++ kernels on a CPU; Triton's go through the same
    hook): the kernels of a module under `cp_head` are recorded as the CP head's, under the names inductor gave."""
    import kernel_parts
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.triton import TritonScheduling
    torch = interleaved.torch
    for scheduling in (CppScheduling, TritonScheduling):
        monkeypatch.setattr(scheduling, "define_kernel", scheduling.define_kernel)  # put back after the test
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return ((x * self.w).sigmoid() * 3).exp()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cp_head = Gate()

        def forward(self, x):
            return self.cp_head(x).sum()

    kernel_parts.record_into(str(tmp_path / "parts.jsonl"))
    torch._dynamo.reset()
    torch.compile(Model())(torch.randn(8, 16, requires_grad=True)).backward()
    parts = kernel_parts.read_parts(str(tmp_path / "parts.jsonl"))
    assert parts and all(name.startswith("cpp_") for name in parts), parts
    assert set(parts.values()) == {"CP head and mixture"}, parts


def test_each_mode_takes_each_place_in_a_round_equally_often():
    """The first step of a round starts on an idle GPU after the round's sync: with three modes, reversing the order
    alone never put the middle one first. round_order rotates, so over any whole number of cycles every mode is in
    every place equally often."""
    for order in (["vanilla", "cplm"], ["vanilla", "cplm", "cplm_loss"], list("abcd")):
        k = len(order)
        places = {(m, i): 0 for m in order for i in range(k)}
        for r in range(2 * k * 5):
            for i, m in enumerate(interleaved.round_order(order, r)):
                places[(m, i)] += 1
        assert set(places.values()) == {10}, places


def test_the_three_model_ab_runs_on_a_cpu_and_prints_the_split(tmp_path):
    """interleaved.py end to end on a CPU, tiny: vanilla, cplm_loss and cplm built, warmed up and alternated, the
    ratio lines, the phase table and CPLM's extra split into the loss's part and the CP head's, then the profile."""
    from conftest import toy_corpus, write_shard
    write_shard(tmp_path / "toy_train_000000.bin", toy_corpus(60_000, 0))
    write_shard(tmp_path / "toy_val_000000.bin", toy_corpus(20_000, 2))
    flags = ["--preset", "cpu", "--num_layers", "2", "--model_dim", "64", "--num_heads", "1", "--batch_size", "256",
             "--seq_len", "256", "--warmup_steps", "1", "--train_files", str(tmp_path / "toy_train_*.bin"),
             "--val_files", str(tmp_path / "toy_val_*.bin")]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "gpu_check", "interleaved.py"), "--modes",
                          "vanilla,cplm_loss,cplm", "--rounds_s", "1", "--min_rounds", "12", "--end_in_s", "300",
                          "--profile_steps", "1", "--profile_reserve_s", "5", "--kernel_parts",
                          str(tmp_path / "parts.jsonl"), "--", *flags], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = [line[len("REPORT "):] for line in out.stdout.splitlines() if line.startswith("REPORT ")]
    assert any(re.match(r"cplm_loss/vanilla step time ratio \(interleaved, \d+ rounds\)", r) for r in report)
    assert any(re.match(r"cplm/vanilla step time ratio \(interleaved, \d+ rounds\)", r) for r in report)
    table = [r for r in report if r.startswith("  | ")]
    assert table[0] == "  | phase | vanilla | cplm_loss | cplm | cplm_loss - vanilla | cplm - vanilla |"
    assert [r.split("|")[1].strip() for r in table[1:5]] == ["forward", "backward", "optimizer", "step"]
    assert any(r.startswith("  CPLM's extra a step, ") and "(cplm - cplm_loss)" in r for r in report), report
    assert sum(r.startswith("profile: ") for r in report) == 2  # cplm_loss and cplm, each against vanilla
