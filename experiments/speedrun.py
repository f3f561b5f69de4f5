"""The CPU speedrun (records/cpu_speedrun): vanilla, CPLM and the pointer sentinel raced to a target validation
loss as the speedrun claims a record, at the 2025-01-26 record's tokens per non-embedding parameter.

    python experiments/speedrun.py run [--jobs 2] [--max_steps M] [--out OUT]   # the runs the rule asks for next
    python experiments/speedrun.py report [--out OUT]            # OUT/speedrun.md and .json (records/cpu_speedrun)

`run` starts every run the rule below asks for, --jobs at a time (one thread each), and keeps asking until the
rule has nothing more to run; stopped, it continues where it was (finished runs are read from their logs, a
stopped run resumes from its newest checkpoint, or starts again). The rule, fixed before any run:
1. The budget N: the record trains 1770 x 393,216 tokens for 82,575,412 non-embedding parameters (8.43 tokens
   each); the cpu preset's 786,450 at 2048 tokens a step gives N = 3237 steps (matched_steps()).
2. Vanilla at N on seeds 0-4; seed s sets the initial weights (--seed s) and the data order (--data_seed s).
   The target is the mean of the five final validation losses, written to OUT/target.json once all five have
   finished, before any other mode's result is read, and never recomputed.
3. CPLM and the pointer sentinel run the same seeds with schedules of M steps (the same shape: the cooldown is
   the last 40% of M). M passes when the mean of its five final validation losses is below the target with
   one-sided p < 0.01 (one-sample t-test, 4 degrees of freedom), the speedrun's rule for a record.
4. The search, per mode, on a grid of 100 steps: first M = 1000 (records/prose_v3's budget); then bisection
   between the longest failing M (0 at first) and the shortest passing one (N at first), the midpoint rounded
   down to the grid, until they are 100 steps apart; N itself is probed only when everything below it failed.
   The mode's steps to target is its shortest passing M.
5. Time to target: M x the mode's step time over N x vanilla's, the step times' ratio measured in one quiet run
   (OUT/step_time.txt: experiments/cp_cost.py step_time, the runs' configuration, the three modes alternated).
Each mode runs at its best learning-rate scale of the 1000-step sweeps (records/prose_v3, SCALES).
"""
import datetime
import json
import math
import os
import re
import sys
import time
import subprocess

import numpy as np
import torch

from cli import ROOT, OneLineParser  # experiments/cli.py
import race  # noqa: E402  (experiments/race.py: the prose corpus's flags, continuation of a stopped run)

sys.path.insert(0, os.path.join(ROOT, "tools"))
import compare  # noqa: E402  (tools/compare.py: log parsing and the t distribution)
import train_gpt_cplm as tg  # noqa: E402

SEEDS = ("0", "1", "2", "3", "4")
GRID = 100
FIRST_PROBE = 1000
P_RECORD = 0.01
# each mode's best scale of the learning rates in the 1000-step sweeps on the pinned corpus, seed 0
# (records/prose_v3: vanilla 0.25 / 0.5 / 1 / 2, CPLM 0.5 / 1 / 2, the sentinel 0.25 / 0.5 / 1 / 2)
SCALES = {"vanilla": "0.5", "cplm": "1", "sentinel": "1"}
MODE_FLAGS = {"vanilla": ["--cplm", "0"], "cplm": ["--cplm", "1"],
              "sentinel": ["--cplm", "1", "--copy_gate", "sentinel"]}
# validation on the first 32Ki val tokens every 250 steps and at the end; a checkpoint every 250 steps (a stopped
# run resumes from it) and at the end (the test slice scores it); only the newest kept
BUDGET = race.prose_data(8192) + ["--val_seq_len", "1024", "--val_loss_every", "250", "--val_tokens", "32768",
                                  "--compile", "1", "--checkpoint_every", "250", "--keep_checkpoints", "1",
                                  "--save_checkpoint", "1"]
RECORD_STEPS, RECORD_TOKENS_PER_STEP = 1770, 8 * 48 * 1024  # the 2025-01-26 record


def non_embedding_parameters(preset, vocab_size):
    """The vanilla model's parameters outside the embedding tables and the LM head (the usual count)."""
    hp = tg.parse_args(["--preset", preset, "--cplm", "0", "--vocab_size", str(vocab_size),
                        "--bos_id", str(vocab_size - 1)])
    with torch.device("meta"):  # counts only: no memory
        model = tg.GPT(tg.GPTConfig.from_args(hp))
    return hp, sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)


def matched_steps():
    """(N, record's tokens per parameter, the cpu preset's parameters): the cpu preset's steps that give it the
    record's tokens per non-embedding parameter."""
    _, record_params = non_embedding_parameters("speedrun", tg.GPT2_VOCAB_SIZE)
    cpu, cpu_params = non_embedding_parameters("cpu", 8192)
    per_param = RECORD_STEPS * RECORD_TOKENS_PER_STEP / record_params
    return round(per_param * cpu_params / cpu.batch_size), per_param, cpu_params, record_params


# Rules 8-10 (records/cpu_speedrun/README.md, written before their runs): each mode's rate checked at the budget
# it runs, two seeds of vanilla at N on each side of its scale, one seed of each copy head at its M
VANILLA_SWEEP = (("0.25", ("0", "1")), ("1", ("0", "1")))
COPY_RATE_CHECK = {"cplm": 1300, "sentinel": 1300}
COPY_RATE_SCALES = ("0.5", "2")
SCALE_MARGIN = 0.030  # a scale replaces vanilla's when its two-seed mean is lower by more than this (rule 9)


def run_id(mode, steps, seed, scale=None):
    return f"{mode}_lr{scale or SCALES[mode]}_n{steps}_s{seed}"


def tuning_runs(n):
    """(mode, steps, seed, scale) of rules 9 and 10: vanilla's sweep at N, then each copy head's rate at its M."""
    runs = [("vanilla", n, seed, scale) for scale, seeds in VANILLA_SWEEP for seed in seeds]
    return runs + [(mode, m, "0", scale) for mode, m in COPY_RATE_CHECK.items() for scale in COPY_RATE_SCALES]


def log_of(out, rid):
    return os.path.join(ROOT, out, "logs", rid + ".txt")


JUDGE_MODES = {"vanilla": "vanilla", "cplm": "CPLM", "sentinel": "sentinel"}  # this study's names -> the judge's


def final_of(path, mode, steps, seed):
    """The final val loss of a finished run's log, read as the judge reads it (tools/compare.py: a killed run, a
    log cut mid-line or whose final line disagrees with its last validation is unfinished), or None. A log whose
    settings are not what its name says (another mode, length or seed) stops the study in one line."""
    if not os.path.exists(path):
        return None
    try:
        log = compare.parse_log(path)
    except compare.LogError:
        return None  # no validation yet: a run that has just started
    hp = log["hyperparameters"]
    said = (JUDGE_MODES[mode], steps, int(seed), int(seed))
    found = (compare.mode_of(hp), hp.get("num_iterations"), hp.get("seed"), hp.get("data_seed"))
    if found != said:
        raise SystemExit(f"speedrun.py: error: {path} holds a run of {found} (mode, steps, seed, data_seed), "
                         f"not the {said} its name says: move it out of the study's folder")
    compare.mark_excluded([log])
    if log["excluded"] is not None:
        return None
    return next(iter(compare.finals_of({"logs": [log]}).values()))  # nan for a run that diverged


def finals(out, mode, steps, scale=None, seeds=SEEDS):
    """{seed: final val loss} of the finished runs of mode at this many steps."""
    losses = {s: final_of(log_of(out, run_id(mode, steps, s, scale)), mode, steps, s) for s in seeds}
    return {s: x for s, x in losses.items() if x is not None}


def read_target(out):
    path = os.path.join(ROOT, out, "target.json")
    return json.load(open(path)) if os.path.exists(path) else None


def fix_target(out, n):
    """Writes OUT/target.json once vanilla's five runs at N have finished; returns the target (or None)."""
    fixed = read_target(out)
    if fixed:
        return fixed
    losses = finals(out, "vanilla", n)
    if len(losses) < len(SEEDS):
        return None
    # only the first probe may run before the target is fixed: a later one means the target was fixed and lost
    others = [f for f in sorted(os.listdir(os.path.join(ROOT, out, "logs")))
              if f.endswith(".txt") and not f.startswith("vanilla") and f"_n{FIRST_PROBE}_" not in f]
    if others:
        raise SystemExit(f"speedrun.py: error: {out}/target.json is missing but other modes' logs exist "
                         f"({others[0]}, ...): restore target.json (git checkout) rather than fix it after them")
    mean, sd = compare.mean_std(list(losses.values()))
    if not math.isfinite(mean):  # a diverged vanilla run: no target can be fixed from these five
        raise SystemExit(f"speedrun.py: error: a vanilla run at N diverged ({losses}): rerun it before fixing the target")
    fixed = {"target": mean, "sd": sd, "steps": n, "finals": losses,
             "fixed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "rule": "the mean final val loss of vanilla at N over seeds 0-4, fixed before any other mode was read"}
    tmp = os.path.join(ROOT, out, "target.json.tmp")
    with open(tmp, "w") as f:
        json.dump(fixed, f, indent=1)
    os.replace(tmp, os.path.join(ROOT, out, "target.json"))
    return fixed


def probe_result(losses, target):
    """Rule 8, as the judge decides it (tools/compare.py decide()): Welch's test against vanilla's five finals at
    N decides; the one-sample test against their mean (rule 3) and the test paired by seed beside."""
    d = compare.decide(losses, target["target"], reference=target["finals"])
    return {"mean": d["mean"], "sd": d["sd"], "p": d["p"], "test": d["test"],
            "p_one_sample": d["one_sample"] and d["one_sample"]["p"], "p_paired": d["paired"] and d["paired"]["p"],
            "passed": d["passed"]}


def search(out, mode, n, target):
    """The rule's search for one mode: (probes {M: result}, next M to run or None, steps to target or None,
    longest failing M). next M is FIRST_PROBE until the target is fixed (its result is not read before)."""
    probes, lo, hi = {}, 0, None
    m = FIRST_PROBE
    while True:
        losses = finals(out, mode, m)
        if len(losses) < len(SEEDS) or target is None:
            return probes, m, None, lo
        probes[m] = {**probe_result(losses, target), "finals": losses}
        if probes[m]["passed"]:
            hi = m
        else:
            lo = m
        if hi is not None and hi - lo <= GRID:
            return probes, None, hi, lo
        upper = hi if hi is not None else n
        if lo >= n:  # N itself failed: no schedule up to N meets the target
            return probes, None, None, lo
        m = lo + GRID * ((upper - lo) // (2 * GRID))
        if m <= lo:  # less than two grid steps below N: N itself
            m = n


def wanted(out, n):
    """The runs the rule asks for now, in order (mode, steps, seed, scale or None for the mode's own): vanilla's at
    N, vanilla's sweep at N (rule 9), each copy mode's next probe (seeds interleaved), the copy rate checks."""
    target = fix_target(out, n)
    runs = [("vanilla", n, s, None) for s in SEEDS if s not in finals(out, "vanilla", n)]
    tuning = [r for r in tuning_runs(n) if r[2] not in finals(out, r[0], r[1], r[3], seeds=(r[2],))]
    runs += [r for r in tuning if r[0] == "vanilla"]
    probes = {mode: search(out, mode, n, target)[1] for mode in ("cplm", "sentinel")}
    done = {mode: finals(out, mode, m) for mode, m in probes.items() if m is not None}
    runs += [(mode, probes[mode], s, None) for s in SEEDS for mode in probes
             if probes[mode] is not None and s not in done[mode]]
    return runs + [r for r in tuning if r[0] != "vanilla"]


def command(out, mode, steps, seed, scale=None):
    rid = run_id(mode, steps, seed, scale)
    log_dir = os.path.join(out, "logs")
    return [sys.executable, "train_gpt_cplm.py", "--preset", "cpu", *MODE_FLAGS[mode],
            *race.scaled_lrs(scale or SCALES[mode]), *BUDGET, "--num_iterations", str(steps), "--seed", seed,
            "--data_seed", seed, "--run_id", rid, "--log_dir", log_dir, *race.continuation(log_dir, rid)]


def run(args, n):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running, failed, t0 = {}, set(), time.time()
    while True:
        for rid, proc in list(running.items()):
            if proc.poll() is not None:
                del running[rid]
                print(f"[{time.time() - t0:6.0f}s] {rid} ended ({proc.returncode})", flush=True)
                if proc.returncode:
                    failed.add(rid)
        todo = [r for r in wanted(args.out, n) if run_id(*r) not in running and run_id(*r) not in failed
                and r[1] <= (args.max_steps or n)]
        while todo and len(running) < args.jobs:
            rid = run_id(*todo[0])
            print(f"[{time.time() - t0:6.0f}s] start {rid}", flush=True)
            running[rid] = subprocess.Popen(command(args.out, *todo.pop(0)), cwd=ROOT, env=env,
                                            stdout=subprocess.DEVNULL)
        if not running:
            break
        time.sleep(5)
    if failed:
        print(f"speedrun.py: {len(failed)} run(s) failed (their logs end with why): {', '.join(sorted(failed))}",
              file=sys.stderr)
        return 1
    return report(args, n)


# The test slice's documents (numbered in it) that are pieces of a long document whose other pieces are in the
# train split, by slice (test_start, test_tokens) of the pinned corpus: the corpus is split by piece (the build's
# log names them: val document 133, sqlite's requirements.html#2, 27% of the slice's targets; the slice starts at
# val document 32). The seeds whose data order holds a sibling inside their budget score it far lower (vanilla at
# N: seed 1 2.54 nats, seed 0 4.01; at M = 2100 seeds 3 and 4 2.92-3.12, the others 3.63-3.76), so the gap is
# also given without them: a sensitivity reading, chosen after the rule was fixed.
STRADDLING_TEST_DOCUMENTS = {(65536, 262144): (101,)}
EQUIVALENCE_MARGIN = 0.02  # nats per token: "no better than the sentinel" needs the interval inside +- this


def bootstrap_gap(a, b, targets, draws=10000, seed=0):
    """Mean over seeds of (sum over documents of a - b) / (their targets), a and b (seeds, documents) nll sums of
    the same seeds and documents; and its 95% interval by a two-level bootstrap: seeds and documents resampled
    independently with replacement, `draws` times (percentile interval)."""
    a, b, targets = (np.asarray(x, dtype=np.float64) for x in (a, b, targets))
    diff = a - b
    point = float((diff.sum(1) / targets.sum()).mean())
    rng = np.random.default_rng(seed)
    n_seeds, n_docs = diff.shape
    gaps = np.empty(draws)
    for i in range(draws):
        seeds, docs = rng.integers(0, n_seeds, n_seeds), rng.integers(0, n_docs, n_docs)
        gaps[i] = (diff[np.ix_(seeds, docs)].sum(1) / targets[docs].sum()).mean()
    return point, [float(x) for x in np.percentile(gaps, [2.5, 97.5])]


def heads_at_equal_schedules(out, n):
    """CPLM against the sentinel on the test slice (OUT/test_slice.json), at every M both ran on all seeds: the
    gap sentinel - CPLM in nats per token, over all targets, copyable ones and the others, with its interval."""
    path = os.path.join(ROOT, out, "test_slice.json")
    if not os.path.exists(path):
        return []
    try:
        records = json.load(open(path))["records"]
        assert isinstance(records, list)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise SystemExit(f"speedrun.py: error: {path} is not test_slice.py's JSON (no list of records)") from None
    # (mode, M, seed, slice) -> the record of the run's final checkpoint, at the scale the rule runs each mode;
    # a slice is (start, tokens): records of two slices of one checkpoint are never mixed
    final = {}
    for r in records:
        m = re.fullmatch(r"(cplm|sentinel|vanilla)_lr([\d.]+)_n(\d+)_s(\d+)", str(r.get("run_id")))
        if m and m[2] == SCALES[m[1]] and r.get("step") == int(m[3]) and "per_document" in r.get("test", {}):
            final[(m[1], int(m[3]), m[4], tuple(r.get("slice", ())))] = r
    rows = []
    for steps in sorted({k[1] for k in final if k[0] == "cplm"}):
        common = [sl for sl in sorted({k[3] for k in final if k[1] == steps})
                  if all((mode, steps, s, sl) in final for mode in ("cplm", "sentinel") for s in SEEDS)]
        if not common:
            continue
        final_at = {(mode, m, s): r for (mode, m, s, sl), r in final.items() if sl == common[0]}
        doc = {mode: [final_at[(mode, steps, s)]["test"]["per_document"] for s in SEEDS]
               for mode in ("cplm", "sentinel")}
        row = {"steps": steps, "seeds": len(SEEDS), "documents": len(doc["cplm"][0]["nll"]), "slice": list(common[0]),
               "other_slices": [list(sl) for sl in common[1:]]}
        for part, (key, count) in {"all": ("nll", "targets"), "copyable": ("nll_copyable", "copyable")}.items():
            targets = doc["cplm"][0][count]
            row[part] = bootstrap_gap([d[key] for d in doc["sentinel"]], [d[key] for d in doc["cplm"]], targets)
        other = lambda d: np.subtract(d["nll"], d["nll_copyable"])  # noqa: E731
        row["other"] = bootstrap_gap([other(d) for d in doc["sentinel"]], [other(d) for d in doc["cplm"]],
                                     np.subtract(doc["cplm"][0]["targets"], doc["cplm"][0]["copyable"]))
        straddling = STRADDLING_TEST_DOCUMENTS.get(common[0])
        keep = [i for i in range(row["documents"]) if i not in (straddling or ())]
        row["all_but_straddling"] = None if straddling is None else bootstrap_gap(
            [np.take(d["nll"], keep) for d in doc["sentinel"]], [np.take(d["nll"], keep) for d in doc["cplm"]],
            np.take(doc["cplm"][0]["targets"], keep))
        lo, hi = row["all"][1]
        row["verdict"] = ("CPLM ahead" if lo > 0 else "the sentinel ahead" if hi < 0 else
                          f"equivalent within {EQUIVALENCE_MARGIN}" if -EQUIVALENCE_MARGIN < lo and hi < EQUIVALENCE_MARGIN
                          else "unresolved")
        rows.append(row)
    return rows


def judged(out, n, target):
    """The judge (tools/compare.py) on the study's logs, the target being vanilla's group at N at its rule's scale;
    strict: a group mixing code versions, data or a repeated seed is refused, not flagged; runs from two machines
    (the study's ran on two) are flagged. SystemExit (one line) when the logs no longer give the fixed target (target.json edited, or a vanilla log replaced)."""
    logs, skipped = compare.load([os.path.join(ROOT, out, "logs", "*.txt")])
    spec = f"vanilla num_iterations={n} lr_muon={race.CPU_LRS['lr_muon'] * float(SCALES['vanilla']):g}"
    step_file = os.path.join(ROOT, out, "step_time.txt")
    try:
        step_times = compare.read_step_times(step_file) if os.path.exists(step_file) else None
        result = compare.judge(logs, target_from=spec, step_times=step_times, strict=True, strict_machines=False)
    except ValueError as e:
        raise SystemExit(f"speedrun.py: error: {e}") from None
    if abs(result["target"] - target["target"]) > 5e-6 or result["n_target"] != len(target["finals"]):
        raise SystemExit(f"speedrun.py: error: {out}/target.json says {target['target']:.5f} over "
                         f"{len(target['finals'])} runs, vanilla's logs at N give {result['target']:.5f} over "
                         f"{result['n_target']}: the target or a vanilla log changed after it was fixed")
    return result, skipped


def _p(p):
    return "-" if p is None else f"{p:.0e}" if p < 1e-3 else f"{p:.2g}"


def readme_row(judgement, n):
    """README's CPU speedrun row's three cells (vanilla | the sentinel | CPLM), every figure from the judge's output
    (test_compare.py holds README to it)."""
    lr_of = {m: race.CPU_LRS["lr_muon"] * float(SCALES[m]) for m in SCALES}
    series = {m: next((s for s in judgement["series"] if s["mode"] == JUDGE_MODES[m]
                       and s["settings"].get("lr_muon") == float(f"{lr_of[m]:g}")), None) for m in SCALES}
    groups = {(g["series"], g["steps"]): g for g in judgement["groups"]}
    target = groups[(series["vanilla"]["name"], n)]
    cells = [f"{n} steps, 1x: the target, {judgement['target']:.3f} ± {target['sd']:.3f} (n = {target['n']})"]
    for mode in ("sentinel", "cplm"):
        s = series[mode]
        if s is None:
            cells.append("not run")
            continue
        c, ci = s["crossing"], s["crossing"].get("interval") or {}
        t_ci = s.get("time_ratio_crossing_interval") or [None, None]
        bound = "<= " if ci.get("lo_bound") else ""  # the lower end is the shortest schedule run: a bound
        span = lambda lo, hi, spec: (f" [{bound}{lo:{spec}}, " + (f"{hi:{spec}}" if hi is not None else "open") + "]"
                                     if lo is not None else "")  # noqa: E731
        cross = (f"crossing {c['steps']:.0f}{span(ci.get('lo'), ci.get('hi'), '.0f')} steps: "
                 f"{s['time_ratio_crossing']:.2f}x{span(t_ci[0], t_ci[1], '.2f')}"
                 if c["steps"] is not None and s.get("time_ratio_crossing") else "crossing: -")
        if s["rule_steps"] is None:
            cells.append(f"rule: not met up to the longest schedule run; {cross}")
            continue
        g = groups[(s["name"], s["rule_steps"])]
        d = g["decision"]
        r_ci = s.get("time_ratio_rule_interval") or [None, None]
        cells.append(f"rule: {s['rule_steps']} steps ({s['longest_failing']} fails; {g['mean']:.3f} ± {g['sd']:.3f}, "
                     f"Welch p = {_p(d['p'])}, one-sample {_p(d['one_sample'] and d['one_sample']['p'])}): "
                     f"**{s['time_ratio_rule']:.2f}x**" + (f" [{r_ci[0]:.2f}, {r_ci[1]:.2f}]" if r_ci[0] else "")
                     + f"; {cross}")
    return " | ".join(cells)


def report(args, n):
    """OUT/speedrun.md and OUT/speedrun.json: the judge's tables on the study's logs (every figure: tools/compare.py),
    the search's state, and the two heads at equal schedules on the test slice."""
    _, per_param, cpu_params, record_params = matched_steps()
    target = read_target(args.out)
    lines = [f"# The CPU speedrun: `python experiments/speedrun.py report --out {args.out}`", "",
             f"N = {n} steps of 2048 tokens: the record's {per_param:.2f} tokens per non-embedding parameter "
             f"({RECORD_STEPS} x {RECORD_TOKENS_PER_STEP:,} = {RECORD_STEPS * RECORD_TOKENS_PER_STEP:,} tokens / "
             f"{record_params:,}) times the cpu preset's {cpu_params:,}.", ""]
    result = {"N": n, "tokens_per_parameter": per_param, "cpu_non_embedding_parameters": cpu_params,
              "record_non_embedding_parameters": record_params, "target": target, "scales": SCALES}
    if not target:
        vanilla = finals(args.out, "vanilla", n)
        lines.append(f"Target: not fixed yet (vanilla at N has finished seeds {', '.join(sorted(vanilla)) or 'none'})")
    else:
        judgement, skipped = judged(args.out, n, target)
        result["judge"] = judgement
        lines += [f"Target fixed {target['fixed_at']} (`target.json`, equal to the logs' mean). The judge's output "
                  "(`python tools/compare.py` on the logs, the target from vanilla's group at N, "
                  "`--step_times step_time.txt`):", "", "```", compare.format_report(judgement), "```", ""]
        lines += [f"- skipped (not a log yet): {x}" for x in skipped]
        lines += ["README's row (vanilla | pointer sentinel | CPLM):", "", "| " + readme_row(judgement, n) + " |", ""]
        for mode in ("cplm", "sentinel"):
            probes, nxt, steps, lo = search(args.out, mode, n, target)
            result.setdefault("search", {})[mode] = {"next": nxt, "steps_to_target": steps, "longest_failing": lo}
            lines.append(f"- {mode}'s search (rule 4, Welch's test): " + (
                f"the next probe is M = {nxt} ({len(finals(args.out, mode, nxt))} of {len(SEEDS)} seeds done)"
                if nxt is not None else f"done: {steps} passes, {lo} fails" if steps else "no M up to N passes"))
    result["heads"] = heads_at_equal_schedules(args.out, n)
    if result["heads"]:
        lines += ["", "CPLM against the pointer sentinel at equal schedules, on the test slice (`test_slice.json`): "
                  "the gap sentinel - CPLM in nats per token, mean over seeds, [95% interval: seeds and documents "
                  "resampled, 10,000 draws]:", "",
                  "| M | seeds | documents | all targets | copyable | other | verdict | all, without the straddling "
                  "piece |", "|---|---|---|---|---|---|---|---|"]
        gap = lambda g: f"{g[0]:+.4f} [{g[1][0]:+.4f}, {g[1][1]:+.4f}]"  # noqa: E731
        lines += [f"| {r['steps']} | {r['seeds']} | {r['documents']} | {gap(r['all'])} | {gap(r['copyable'])} | "
                  f"{gap(r['other'])} | {r['verdict']} | "
                  f"{gap(r['all_but_straddling']) if r['all_but_straddling'] else '-'} |" for r in result["heads"]]
        lines += ["", "The straddling piece: a test-slice document that is a piece of a long document whose other "
                  "pieces are in the train split (`STRADDLING_TEST_DOCUMENTS`; '-': a slice it does not know). A "
                  "sensitivity reading chosen after the rule was fixed; the verdict is the rule's, on all documents."]
    with open(os.path.join(ROOT, args.out, "speedrun.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(ROOT, args.out, "speedrun.json"), "w") as f:
        f.write(compare.to_json(result) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None):
    p = OneLineParser(prog="speedrun.py", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["run", "report"])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="records/cpu_speedrun")
    p.add_argument("--max_steps", type=int, default=0,
                   help="run: start only runs of at most this many steps (what fits the time the machine has left)")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.max_steps < 0:
        p.error(f"--jobs must be >= 1 and --max_steps >= 0 (got {args.jobs}, {args.max_steps})")
    if args.what == "run" and not os.path.exists(os.path.join(ROOT, "data/prose8192/prose8192_val_000000.bin")):
        print("speedrun.py: error: no prose corpus of V = 8192: build it with `bash data/build_prose_corpus.sh`",
              file=sys.stderr)
        return 1
    os.makedirs(os.path.join(ROOT, args.out, "logs"), exist_ok=True)
    n = matched_steps()[0]
    return run(args, n) if args.what == "run" else report(args, n)


if __name__ == "__main__":
    sys.exit(main())
