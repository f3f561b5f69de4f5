"""tools/run_race.py, the race of vanilla, CPLM and the sentinel on one GPU or a CPU: its plan, its budget simulation for
an 80 GB H100 and an H200, its bad input, and the whole race on a CPU at a tiny size (a worker failing, then the same
command continuing). No test depends on two processes' relative speed: the dry run has no deadline."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import BOS, VOCAB, _load, _run, assert_one_line

race = _load("tools/run_race.py")
RACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "run_race.py")


def test_plan_runs_vanilla_at_n_the_copy_heads_at_fractions_in_order_every_seed_before_the_next_schedule():
    plan = race.plan_runs(500, [0.55, 0.4, 0.7], [0, 1, 2], ["vanilla", "cplm", "sentinel"])
    assert [r[1] for r in plan["vanilla"]] == [500, 500, 500]
    assert [(steps, seed) for _, steps, seed in plan["cplm"]] == \
        [(275, 0), (275, 1), (275, 2), (200, 0), (200, 1), (200, 2), (350, 0), (350, 1), (350, 2)]
    assert len({rid for runs in plan.values() for rid, _, _ in runs}) == 21  # every run its own log
    assert race.plan_runs(10, [0.5, 0.52], [0], ["vanilla", "cplm"])["cplm"] == [("cplm_n5_s0", 5, 0)]  # no repeat
    with pytest.raises(ValueError):
        race.parse_fractions("0,0.5")
    with pytest.raises(ValueError):
        race.parse_fractions("a")


def test_a_run_starts_only_if_its_estimate_ends_before_trainings_end():
    assert race.fits(None, 100, 50)  # the first run of a worker: no estimate yet
    assert race.fits(10, 100, None)  # no deadline
    assert race.fits(10, 100, 110) and not race.fits(10.5, 100, 110)


@pytest.mark.parametrize("card", ["h100", "h200"])
def test_budget_simulation_fits_the_call_and_judges_every_mode_on_both_cards(card):
    """At the assumed times every mode finishes at least one schedule on 3 seeds and the race ends before 570 s; at
    1.5x every assumed time it still ends before the deadline, cutting runs rather than the judge."""
    for slow in (1.0, 1.5):
        text, done = race.simulate(card, slow=slow)
        end = float(re.search(r"(\d+)s  judged; deadline 570s", text).group(1))
        assert end <= 570, text
        for mode in race.MODES:
            finished = [rid for rid in done if rid.startswith(mode + "_")]
            schedules = {rid.split("_")[1] for rid in finished}
            assert any(sum(rid.split("_")[1] == n for rid in finished) == 3 for n in schedules), (mode, text)


def test_the_gpu1_preset_keeps_the_records_architecture_and_v_over_d():
    import train_gpt_cplm as tg
    hp = tg.parse_args(["--preset", "gpu1", "--vocab_size", "50257", "--bos_id", "50256"])
    record = tg.parse_args(["--preset", "speedrun", "--vocab_size", "50257", "--bos_id", "50256"])
    assert hp.model_dim == record.model_dim == 768 and hp.num_heads == record.num_heads  # V/D 65.5 as the record
    assert (hp.attn_window, hp.attn_window_start, hp.logit_softcap, hp.lr_muon, hp.lr_embed) == \
        (record.attn_window, record.attn_window_start, record.logit_softcap, record.lr_muon, record.lr_embed)
    assert hp.batch_size == hp.seq_len == 32 * 1024 and hp.num_iterations == 500 and hp.num_layers == 4
    with torch.device("meta"):
        model = tg.GPT(tg.GPTConfig.from_args(hp))
    assert len(model.value_embeds) == 2 and model.num_encoder_layers == 2  # U-net and value embeddings kept


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("x")
    for args, words in [(["--out", str(tmp_path / "o"), "--modes", "cplm,vanilla"], ["vanilla first"]),
                        (["--out", str(tmp_path / "o"), "--seeds", "0,x"], ["--seeds"]),
                        (["--out", str(tmp_path / "o"), "--seeds", "1,1"], ["distinct"]),
                        (["--out", str(tmp_path / "o"), "--fractions", "0.5,2"], ["--fractions"]),
                        (["--out", str(tmp_path / "o"), "--", "--seed", "3"], ["--seed", "sets it itself"]),
                        (["--out", str(tmp_path / "o"), "--inject", "cplm:explode"], ["--inject"]),
                        (["--out", str(tmp_path / "file")], ["a file"]),
                        (["--seeds", "0"], ["--out"])]:
        r = _run([RACE, *args])
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert_one_line(r.stderr, *words)
    assert not (tmp_path / "o").exists()  # nothing written


def test_a_bad_training_flag_is_refused_before_anything_runs(tmp_path):
    r = _run([RACE, "--dry_run", "--out", str(tmp_path / "o"), "--", "--num_layers", "x"])
    assert r.returncode == 2
    assert_one_line(r.stderr, "--num_layers")
    assert not os.path.exists(tmp_path / "o" / "logs")


def test_dry_run_races_judges_and_continues(toy_data, tmp_path):
    """The whole race on a CPU: the sentinel's worker fails at once (said; vanilla and CPLM are still measured and
    judged), then the same command again runs only the sentinel's runs and judges all three."""
    out = tmp_path / "race"
    data = ["--", "--train_files", f"{toy_data}/toy_train_*.bin", "--val_files", f"{toy_data}/toy_val_*.bin",
            "--vocab_size", str(VOCAB), "--bos_id", str(BOS)]
    common = [RACE, "--dry_run", "--out", str(out), "--seeds", "0,1", "--fractions", "0.5"]
    first = _run(common + ["--inject", "sentinel:fail"] + data, env_update={"OMP_NUM_THREADS": "1"})
    report = (out / "report.txt").read_text()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "sentinel: failed at start (injected)" in report and "sentinel: worker ended, exit 1" in report
    for run in ("vanilla_n8_s0", "vanilla_n8_s1", "cplm_n4_s0", "cplm_n4_s1"):
        assert f"{run} done: " in report, report
    measured = json.loads((out / "step_time.json").read_text())
    lo, hi = measured["ratio_interval_95_cplm"]
    assert 0 < lo <= hi and measured["ratio_cplm"] > 0 and measured["settings"]["num_layers"] == 2
    assert "CPLM n=4" in report and "vanilla n=8" in report and "Welch" in report
    assert (out / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    judged = json.loads((out / "judge.json").read_text())
    assert judged["target_from"] and not any(s.get("mode") == "sentinel" for s in judged["series"])

    again = _run(common + data, env_update={"OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    report = (out / "report.txt").read_text()
    for run in ("vanilla_n8_s0", "cplm_n4_s1"):
        assert f"{run} kept: finished before" in report
    assert "sentinel_n4_s1 done: " in report and "sentinel n=4" in report.split("race: vanilla")[-1]
    assert sorted(os.listdir(out / "logs")) == sorted(f"{m}_n{n}_s{s}.txt" for m, n in
                                                      (("vanilla", 8), ("cplm", 4), ("sentinel", 4)) for s in (0, 1))


HUNG = "test_a_hung_worker_is_stopped_at_the_training_cut_off_and_the_race_still_ends"


@pytest.fixture(scope="module", autouse=True)
def hung_race(request, toy_data, tmp_path_factory):
    """The race HUNG checks, started with this module's first test where that test was chosen: it mostly waits (the
    hung worker until the cut-off), so the tests before HUNG (the dry run's whole race) run meanwhile; HUNG waits
    for its end. Either order of events a loaded machine gives is a pass there. Yields (the process, its OUT)."""
    if not any(item.module is request.module and item.name == HUNG for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("hung") / "race"
    args = [RACE, "--dry_run", "--out", str(out), "--modes", "vanilla", "--inject", "vanilla:hang", "--deadline_s", "50",
            "--", "--train_files", f"{toy_data}/toy_train_*.bin", "--val_files", f"{toy_data}/toy_val_*.bin",
            "--vocab_size", str(VOCAB), "--bos_id", str(BOS)]
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc, out
    finally:
        proc.kill()
        proc.communicate()


def test_a_hung_worker_is_stopped_at_the_training_cut_off_and_the_race_still_ends(hung_race):
    """A worker that never ends is stopped when training's share of the deadline is spent (50 s less the dry run's
    reserves: 10 s), and the race goes on to its judge, which says there is nothing to judge. Either order of
    events a loaded machine can give (the worker started, or no time left to start it) is a pass. The race is
    started with this module (hung_race)."""
    proc, out = hung_race
    proc.communicate(timeout=120)
    report = (out / "report.txt").read_text()
    assert proc.returncode == 1, report
    assert "stopping vanilla" in report or "no time left to start vanilla" in report, report
    assert "judge: " in report and "race: done in" in report
    assert not any("run_race.py --worker" in line for line in subprocess.run(
        ["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines() if str(out) in line)
