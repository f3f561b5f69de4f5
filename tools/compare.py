#!/usr/bin/env python3
"""The judge: steps and time to a target validation loss, per mode, from training logs.

    python tools/compare.py 'logs/*.txt' --target 3.28                  # your runs, the speedrun's target
    python tools/compare.py 'logs/*.txt' --target_from vanilla          # the target: vanilla's mean final
    python tools/compare.py 'records/cpu_speedrun/logs/*.txt' --target_from 'vanilla lr_muon=0.02' \\
        --step_times records/cpu_speedrun/step_time.txt                 # README's CPU speedrun row

What it does, in one definition for every table in the repo:
- **Groups.** A run's mode (vanilla, CPLM, sentinel, stop-grad CPLM or sentinel) and its schedule length
  (`num_iterations`) make its group; seeds and data orders (`seed`, `data_seed`) are pooled, as are the knobs
  that only name or place a run (`run_id`, `log_dir`, checkpoints, logging intervals). A *series* is one mode's
  groups at every schedule length, all other settings equal. A killed run (no final line), a log cut mid-line, a copy of
  another log and a log whose final line disagrees with its last validation are listed and not counted.
  **Upstream's logs** (modded-nanogpt's records: the code, a ruler, step lines, no settings and no final line)
  are read as they are: mode "upstream", grouped by their code's sha256 and their length, complete when their
  last validation is at their last step, each log a run of its own (they name no seed).
- **The target.** `--target X`: a fixed convention (the speedrun's 3.28); a group passes when its mean final
  val loss is below X by a one-sided one-sample t-test, p < 0.01 (the speedrun's record rule).
  `--target_from GROUP`: the mean final val loss of that group's runs, an estimate, so its uncertainty counts:
  Welch's one-sided two-sample t-test against the group's runs decides; the one-sample test, and the test
  paired by seed where the seeds match, are printed beside it.
- **Steps to target**, two readings. *The rule's*: the shortest schedule whose group passes (the longest
  failing one below it in brackets). *The crossing*: where the mean final loss, as a function of schedule
  length over the schedules run, meets the target, linearly interpolated between the two schedules around it,
  with a 95% interval (every group's mean drawn from its t distribution, the target's group's included). A
  series with one schedule only gets the *curve crossing* instead: the first step at which its mean
  validation curve meets the target (interpolated between validations); it reads the schedule before its
  cooldown has ended, so it flatters short runs less than a longer schedule would, and says so.
- **Time to target** = steps x step time. The step time comes from `--step_times FILE` (one process timing
  the modes alternated: experiments/cp_cost.py step_time's JSON line) or, without it, from the logs' own
  clocks (the median over a group's runs of train time / steps: noisy on a shared machine). The ratio is to
  the reference: the target's group (its own schedule), or, with a fixed target, vanilla's (or upstream's)
  time to it. A step-time file with each ratio's 95% interval (tools/run_race.py's) carries it into the times.
- **Clocks**, as upstream compares records: each group's mean train time at its last validation, and its
  difference to a baseline group (`--baseline`, else the target's group, else the other of two) with Welch's
  95% interval.
- **Provenance.** Runs compared must share a validation set (the logs' `data:` sha256 and the validation
  settings): otherwise the judge refuses. A group mixing code versions (`git:`), training data or a repeated
  seed is flagged (`--strict`: refused). A group's mean that lies below the target but fails the test is "not
  significant at n = k", not "not reached".

Needs scipy (the t-tests, as upstream's record READMEs compute them); matplotlib for --plot.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import hashlib
import json
import math
import os
import re
import signal
import sys

from scipy import stats  # the tests upstream's record READMEs compute

DEFAULT_TARGET = 3.28
P_PASS = 0.01  # the speedrun's record rule
# knobs that pick a seed or data order (pooled) and knobs that only name, place, checkpoint or log a run (ignored)
SEED_KEYS = ("seed", "data_seed")
ALWAYS_IGNORED = ("run_id", "log_dir", "resume", "overwrite", "checkpoint_every", "save_checkpoint",
                  "keep_checkpoints", "train_loss_every", "val_loss_every", "dist_timeout_s")
# settings that define the validation loss itself: runs that differ in them are not comparable
VALIDATION_KEYS = ("val_tokens", "val_seq_len", "vocab_size", "bos_id")
MODE_NAMES = ("upstream", "vanilla", "CPLM", "sentinel", "stop-grad CPLM", "stop-grad sentinel")
MODE_KEYS = ("cplm", "copy_gate", "cp_stop_grad")
MACHINES_FLAG = "runs from different machines"

_FLOAT = r"[-+]?(?:nan|inf|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"  # one way to read digits: no backtracking
RE_HPARAMS = re.compile(r"^hyperparameters: (\{.*\})$")
RE_RUN_ID = re.compile(r"^run_id: (\S+)\s*$")
RE_VAL = re.compile(
    r"^step:(\d+)/(\d+) val_loss:(" + _FLOAT + r") train_time:(\d+)ms", re.IGNORECASE
)
RE_TRAIN = re.compile(  # train_loss is optional: a step without --train_loss_every logs only its time
    r"^step:(\d+)/(\d+) (?:train_loss:(" + _FLOAT + r") )?train_time:(\d+)ms", re.IGNORECASE
)
RE_STEP_KV = re.compile(r"^step:(\d+)/(\d+) ((?:[A-Za-z_]\w*:\S+)(?: [A-Za-z_]\w*:\S+)*)\s*$")
RE_STOPPED = re.compile(r"^stopped:(.*)$")
RE_AT_TARGET = re.compile(r"^target val_loss \S+ reached at step (\d+)")  # --target_val_loss ended the run there
# why a run that diverged stopped: a non-finite loss, or non-finite weights found when a checkpoint was due
RE_DIVERGED = re.compile(r"^(?:\w+: )?(?:(?:val|train)_loss is (?:nan|inf|-inf)|step \d+: the weights are not finite)")
RE_RESUMED_AT = re.compile(r"^(?:continuing|resumed from .*) at step (\d+), train_time")
RE_PEAK_MEM = re.compile(r"^peak memory allocated: (\d+) MiB(?: reserved: (\d+) MiB)?")
RE_FINAL = re.compile(r"^final (?:val_loss:(" + _FLOAT + r") )?train_time:(\d+)ms steps:(\d+)\s*$", re.IGNORECASE)
RE_GIT = re.compile(r"^git: (\S+)")
RE_DATA = re.compile(r"^data: (.+) sha256 ([0-9a-f]{64})\s*$")
# the machine a run ran on: ours (`python X torch Y on PLATFORM`, `gpu: NAME cuda Z`), upstream's (`Running PyTorch Y`
# and nvidia-smi's table, whose GPU name is read from it)
RE_PLATFORM = re.compile(r"^python \S+ torch (\S+) on (\S+)\s*$|^Running PyTorch (\S+)")
RE_GPU = re.compile(r"^gpu: (.+?) cuda |\|\s+\d+\s+(NVIDIA [^|]*?)\s{2,}")


class LogError(ValueError):
    """A log file that cannot be used (unreadable, or no val_loss lines)."""


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------

def _to_float(s):
    try:
        return float(s)
    except ValueError:
        return float("nan")


def _hparams_of(line):
    """The hyperparameters dict of a `hyperparameters: {...}` line, else None."""
    m = RE_HPARAMS.match(line)
    if not m:
        return None
    try:
        obj = json.loads(m.group(1))
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_log(path):
    """Parse one log file.

    Returns a dict with keys: path, run_id, hyperparameters (dict), val (list
    of {step, total, loss, time_ms}), train (same with train loss, None where not logged),
    diagnostics (list of {step, ...floats}), stopped (str or None), finished (it ended: its final line, or a
    non-finite loss), problem (why a finished-looking log cannot be trusted, or None), git (the commit it ran),
    data ({shard path: sha256}), peak_mem_mib, reserved_mem_mib.  Raises LogError if the file cannot be
    read or has no val_loss lines.
    """
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # e.g. a file of NUL bytes from a crashed disk
        raise LogError(f"cannot read {path}: {e}") from None
    lines = text.splitlines()

    # The source code comes first, up to a line of "=": nothing in it is a measurement. A resumed run adds
    # sections (each from its own hyperparameters line); a resume at step N cuts what an earlier section logged
    # after N (a branch abandoned by --overwrite), and the last section's hyperparameters and stop reason count.
    separator = next((i for i, line in enumerate(lines) if len(line) >= 10 and set(line) == {"="}), None)
    if separator is None:  # no separator: trust only what follows the last hyperparameters line
        separator = max([i for i, line in enumerate(lines) if _hparams_of(line) is not None], default=0) - 1
    hparams = None
    run_id = None
    by_step = {"val": {}, "train": {}, "diags": {}}
    stopped, peak, reserved, finished, final, git, data = None, None, None, False, None, None, {}
    schedules = []  # num_iterations of each section: a resume that changed it made a schedule no group has
    at_target = None  # the step at which --target_val_loss stopped the run
    machine = {}  # torch, platform, gpu: where it ran
    for line in lines[separator + 1:separator + 400]:  # the header: versions and hardware come first
        m = RE_PLATFORM.match(line)
        if m and "torch" not in machine:
            machine.update(torch=m.group(1) or m.group(3), **({"platform": m.group(2)} if m.group(2) else {}))
        m = RE_GPU.search(line)
        if m and "gpu" not in machine:
            machine["gpu"] = (m.group(1) or m.group(2)).strip()
    for line in lines[separator + 1:]:
        obj = _hparams_of(line)
        if obj is not None:
            hparams, stopped, finished, final = obj, None, False, None
            schedules.append(obj.get("num_iterations"))
            continue
        if line.startswith("final val_loss:"):  # the last line of a run that ended normally
            m = RE_FINAL.match(line)
            finished = m is not None  # a line cut short (a full disk, a copy stopped midway) ends nothing
            final = (_to_float(m.group(1)) if m and m.group(1) else None, int(m.group(3))) if m else None
            continue
        m = RE_GIT.match(line) or RE_DATA.match(line)
        if m:
            if m.re is RE_GIT:
                git = m.group(1)
            else:
                data[m.group(1)] = m.group(2)
            continue
        m = RE_RUN_ID.match(line)
        if m:
            run_id = m.group(1)
            continue
        m = RE_RESUMED_AT.match(line)
        if m:
            for logged in by_step.values():
                for step in [s for s in logged if s > int(m.group(1))]:
                    del logged[step]
            continue
        m = RE_AT_TARGET.match(line)
        if m:
            at_target = int(m.group(1))
            continue
        if not line.startswith(("step:", "stopped:", "peak memory")):
            continue
        m = RE_VAL.match(line)
        if m:
            by_step["val"][int(m.group(1))] = dict(step=int(m.group(1)), total=int(m.group(2)),
                                                   loss=_to_float(m.group(3)), time_ms=int(m.group(4)))
            continue
        m = RE_TRAIN.match(line)
        if m:
            by_step["train"][int(m.group(1))] = dict(
                step=int(m.group(1)), total=int(m.group(2)), loss=_to_float(m.group(3)) if m.group(3) else None,
                time_ms=int(m.group(4)))
            continue
        m = RE_STEP_KV.match(line)
        if m:
            d = {"step": int(m.group(1))}
            for kv in m.group(3).split(" "):
                k, _, v = kv.partition(":")
                try:
                    d[k] = float(v)
                except ValueError:
                    d[k] = v
            by_step["diags"][d["step"]] = d
            continue
        m = RE_STOPPED.match(line)
        if m:
            stopped = m.group(1).strip() or "stopped"
            # a run that diverged ended on its own (a non-finite loss or weights): it counts, as diverged
            finished = finished or bool(RE_DIVERGED.match(stopped))
            continue
        m = RE_PEAK_MEM.match(line)
        if m:
            peak = int(m.group(1))
            reserved = int(m.group(2)) if m.group(2) else None
    val, train, diags = ([d[k] for k in sorted(d)] for d in (by_step["val"], by_step["train"], by_step["diags"]))

    if not val:
        raise LogError(f"{path}: no val_loss lines")
    upstream = hparams is None
    if upstream:  # modded-nanogpt's own log: its code (above the first ruler) and its length are its settings;
        # it ends with no final line, so it is complete when its last validation is at its last step
        code = "\n".join(lines[:max(separator, 0)])
        hparams = {"code_sha256": hashlib.sha256(code.encode()).hexdigest()[:16], "num_iterations": val[-1]["total"]}
        finished = finished or (stopped is None and val[-1]["step"] == val[-1]["total"])
    problem = None
    if len(set(schedules)) > 1:
        problem = (f"its schedule changed on a resume ({' -> '.join(map(str, dict.fromkeys(schedules)))} steps): "
                   "neither length's schedule was trained")
    elif finished and not text.endswith("\n"):
        finished, problem = False, "cut mid-line: the file does not end with a whole line"
    elif finished and final is not None and not (final[1] == val[-1]["step"] and (
            final[0] is None or (final[0] == round(val[-1]["loss"], 4) if math.isfinite(final[0])
                                 else str(final[0]) == str(val[-1]["loss"])))):
        problem = (f"its final line (val_loss {final[0]} at step {final[1]}) disagrees with its last validation "
                   f"({val[-1]['loss']} at step {val[-1]['step']})")
    if run_id is None:
        run_id = (hparams or {}).get("run_id") or os.path.splitext(os.path.basename(path))[0]
    # two files with the same measurements are copies of one run, whatever their names
    fingerprint = hashlib.sha256(json.dumps([hparams, val, train], sort_keys=True, default=str).encode()).hexdigest()
    return dict(path=str(path), run_id=str(run_id), hyperparameters=hparams or {},
                val=val, train=train, diagnostics=diags, stopped=stopped, finished=finished, problem=problem,
                upstream=upstream, machine=machine, at_target=at_target,
                peak_mem_mib=peak, reserved_mem_mib=reserved, fingerprint=fingerprint, git=git, data=data)



# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------

def mean_std(xs):
    """(mean, sample std with ddof=1); std is None for n<2; (None, None) if empty."""
    xs = [float(x) for x in xs]
    n = len(xs)
    if n == 0:
        return None, None
    m = sum(xs) / n
    if n < 2:
        return m, None
    var = sum((x - m) * (x - m) for x in xs) / (n - 1)  # a product: an overflow gives inf, not an error
    return m, math.sqrt(var)


def students_t_sf(t, df):
    """P(T > t) for Student's t with ``df`` degrees of freedom (df > 0; inf -> normal); nan for a nan t."""
    if math.isnan(t) or not df > 0:
        return float("nan")
    return float(stats.t.sf(t, df)) if math.isfinite(df) else float(stats.norm.sf(t))


def one_sided_ttest_below(xs, target):
    """One-sample t-test of H1: mean(xs) < target (scipy's ttest_1samp, alternative="less").  Returns dict(t,
    df, p), t > 0 when the mean is below; None when n < 2; p None when the runs have no spread."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if len(xs) < 2:
        return None
    if mean_std(xs)[1] == 0.0:  # no spread: the test is undefined (identical runs are no evidence of anything)
        return dict(t=None, df=len(xs) - 1, p=None)
    r = stats.ttest_1samp(xs, target, alternative="less")
    return dict(t=-float(r.statistic), df=len(xs) - 1, p=float(r.pvalue))


def welch_ttest_below(xs, ys):
    """Welch's two-sample t-test of H1: mean(xs) < mean(ys), for a target that is itself an estimate (ys: the
    runs that define it): scipy's ttest_ind(equal_var=False, alternative="less"). Returns dict(t, df, p)
    (Welch-Satterthwaite df), or None when either has n < 2."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    ys = [y for y in ys if y is not None and math.isfinite(y)]
    if len(xs) < 2 or len(ys) < 2:
        return None
    (_, sx), (_, sy) = mean_std(xs), mean_std(ys)
    if sx == 0.0 and sy == 0.0:
        return dict(t=None, df=None, p=None)
    r = stats.ttest_ind(xs, ys, equal_var=False, alternative="less")
    vx, vy = sx * sx / len(xs), sy * sy / len(ys)
    df = (vx + vy) ** 2 / (vx * vx / (len(xs) - 1) + vy * vy / (len(ys) - 1))
    return dict(t=-float(r.statistic), df=df, p=float(r.pvalue))


def mean_difference_interval(xs, ys, level=0.95):
    """mean(xs) - mean(ys) and its Welch interval (scipy), or None when either has n < 2 or neither varies."""
    if len(xs) < 2 or len(ys) < 2 or (mean_std(xs)[1] == 0.0 and mean_std(ys)[1] == 0.0):
        return None
    ci = stats.ttest_ind(xs, ys, equal_var=False).confidence_interval(level)
    return dict(diff=mean_std(xs)[0] - mean_std(ys)[0], lo=float(ci.low), hi=float(ci.high), level=level)


def paired_ttest_below(pairs):
    """One-sided paired t-test of H1: x < y over (x, y) pairs (the same seed and data order), or None (n < 2)."""
    diffs = [y - x for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
    test = one_sided_ttest_below([-d for d in diffs], 0.0)
    return test


# ---------------------------------------------------------------------------
# Runs, groups and series
# ---------------------------------------------------------------------------

def mode_of(hp):
    """The run's mode by README's names; "upstream": a modded-nanogpt log (no settings line)."""
    if "code_sha256" in hp and "cplm" not in hp:
        return "upstream"
    if not hp.get("cplm"):
        return "vanilla"
    name = "sentinel" if hp.get("copy_gate") == "sentinel" else "CPLM"
    return f"stop-grad {name}" if hp.get("cp_stop_grad") else name


def target_crossing(val, target):
    """The first validation at or below ``target``: None, or dict(step, time_ms, interp_step, interp_time_ms), the
    interp_ values linearly interpolated between that validation and the one before it."""
    prev = None
    for v in val:
        loss = v["loss"]
        if not math.isfinite(loss):
            prev = None
            continue
        if loss <= target:
            if prev is None:  # already below target at the first (valid) evaluation
                istep, itime = float(v["step"]), float(v["time_ms"])
            else:  # prev["loss"] > target >= loss
                frac = (prev["loss"] - target) / (prev["loss"] - loss)
                istep = prev["step"] + frac * (v["step"] - prev["step"])
                itime = prev["time_ms"] + frac * (v["time_ms"] - prev["time_ms"])
            return dict(step=v["step"], time_ms=v["time_ms"], interp_step=istep, interp_time_ms=itime)
        prev = v
    return None


def summarize_run(log):
    """One run: its final validation, its length, its clock."""
    last = log["val"][-1]
    times = [v["time_ms"] for v in log["val"]] + [t["time_ms"] for t in log["train"]]
    steps = max([v["step"] for v in log["val"]] + [t["step"] for t in log["train"]])
    hp = log["hyperparameters"]
    return dict(run_id=log["run_id"], path=log["path"], seed=hp.get("seed"), data_seed=hp.get("data_seed"),
                final_val_loss=last["loss"], final_step=last["step"], num_iterations=last["total"],
                steps=steps, train_time_ms=max(times), step_ms=max(times) / steps if steps else None,
                stopped=log["stopped"], excluded=log.get("excluded"), git=log.get("git"))


def mark_excluded(logs):
    """Sets log["excluded"] to why a run must not count: it never ended (killed, stopped: no final line), its log
    cannot be trusted (cut mid-line, a final line that disagrees), or it is a copy of an earlier file's run."""
    first = {}
    for log in logs:
        if log.get("problem"):
            log["excluded"] = log["problem"]
        elif not log.get("finished", True):
            log["excluded"] = "incomplete: no final line" + (f" ({log['stopped']})" if log["stopped"] else "")
        elif log["fingerprint"] in first:
            log["excluded"] = f"copy of {first[log['fingerprint']]}"
        else:
            log["excluded"] = None
            first[log["fingerprint"]] = log["path"]


def _key(d):
    return json.dumps(d, sort_keys=True, default=str)


def group_runs(logs, ignore=()):
    """Groups (one mode, one schedule length, all other settings equal; seeds pooled) in first-seen order, each
    {"config", "series" (its config without num_iterations), "mode", "steps", "logs"}; then labels."""
    drop = set(SEED_KEYS) | set(ALWAYS_IGNORED) | set(ignore or ())
    groups = {}
    for log in logs:
        config = {k: v for k, v in log["hyperparameters"].items() if k not in drop}
        groups.setdefault(_key(config), {"config": config, "logs": []})["logs"].append(log)
    out = list(groups.values())
    for g in out:
        g["series"] = {k: v for k, v in g["config"].items() if k != "num_iterations"}
        g["mode"] = mode_of(g["config"])
        g["steps"] = g["config"].get("num_iterations") or g["logs"][0]["val"][-1]["total"]
    label_series(out)
    return out


def _fmt_value(v):
    if v is None:
        return "-"
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def label_series(groups):
    """Each group's "series_label": its mode, and where one mode has several series the settings that tell them
    apart (a letter and a legend line when those do not fit in 24 characters); "label": that and n=steps."""
    series = {}
    for g in groups:
        series.setdefault(_key(g["series"]), g)
    by_mode = {}
    for key, g in series.items():
        by_mode.setdefault(g["mode"], []).append(key)
    names, legend = {}, {}
    for mode, keys in by_mode.items():
        configs = [series[k]["series"] for k in keys]
        differing = [k for k in dict.fromkeys(k for c in configs for k in c)
                     if k not in MODE_KEYS and len({_key([k in c, c.get(k)]) for c in configs}) > 1]
        tags = {key: " ".join(f"code {c[k][:8]}" if k == "code_sha256" and k in c else f"{k}={_fmt_value(c.get(k))}"
                              for k in differing) for key, c in zip(keys, configs)}
        digits = 4  # a long tag's short name is a hash of the settings that tell the series apart (not the order of
        # the files); lengthened until no two series of the mode share one
        while len({hashlib.sha256(t.encode()).hexdigest()[:digits] for t in tags.values()}) < len(tags) and digits < 64:
            digits += 2
        for key, tag in tags.items():
            if len(tag) > 24:
                short = f"({hashlib.sha256(tag.encode()).hexdigest()[:digits]})"
                legend[f"{mode} {short}"] = tag
                tag = short
            names[key] = f"{mode} {tag}".strip()
    for g in groups:
        g["series_label"] = names[_key(g["series"])]
        g["label"] = f"{g['series_label']} n={g['steps']}"
    return legend


def find_group(groups, spec, flag="--target_from"):
    """The one group that ``spec`` names: words that are a mode ("vanilla"), a label or a part of one, and
    key=value settings; a schedule length may be omitted when the series has one. ValueError otherwise."""
    words = [w for w in re.split(r"[\s,]+", spec.strip()) if w]
    settings = [["num_iterations" if w.startswith("n=") else w.split("=", 1)[0], w.split("=", 1)[1]]
                for w in words if "=" in w]  # a label's own n=STEPS is the schedule length
    text = " ".join(w for w in words if "=" not in w)

    def ok(g):
        if any(k not in g["config"] or v not in (_fmt_value(g["config"][k]), str(g["config"][k])) for k, v in settings):
            return False
        return not text or text in MODE_NAMES and g["mode"] == text or text not in MODE_NAMES and text in g["label"]
    matches = [g for g in groups if ok(g)]
    if len(matches) != 1:
        shown = ", ".join(repr(g["label"]) for g in (matches or groups)[:4])
        more = f" and {len(matches or groups) - 4} more" if len(matches or groups) > 4 else ""
        if matches:
            raise ValueError(f"{flag} {spec!r} matches {len(matches)} groups ({shown}{more}): name one "
                             "more setting, e.g. num_iterations=N")
        raise ValueError(f"{flag} {spec!r} matches no group (groups: {shown}{more})")
    return matches[0]


def val_identity(log):
    """What the validation loss was computed on: the validation settings, and the val shards' sha256 where the
    log names them (the script logs every shard it reads)."""
    hp = log["hyperparameters"]
    pattern = hp.get("val_files")
    shas = sorted(sha for path, sha in log.get("data", {}).items()
                  if pattern and (fnmatch.fnmatch(path, pattern) or path == pattern))
    return {**{k: hp.get(k) for k in VALIDATION_KEYS}, "val_sha256": shas or None}


def provenance(groups, counted_only=True):
    """(errors, warnings): runs on other validation sets are not comparable (an error); within a group, other code
    versions, other training data or a repeated (seed, data_seed) are flagged."""
    errors, warnings = [], []
    idents = {}
    for g in groups:
        for log in g["logs"]:
            if log["excluded"] is None or not counted_only:
                ident = val_identity(log)
                if ident["val_sha256"] is None:  # no data lines (an older log): the settings alone
                    ident = {k: v for k, v in ident.items() if k != "val_sha256"}
                idents.setdefault(_key(ident), []).append(log["path"])
    if len({k for k in idents if "val_sha256" in json.loads(k)}) > 1 or len(
            {_key({k: v for k, v in json.loads(k).items() if k != "val_sha256"}) for k in idents}) > 1:
        parts = [f"{os.path.basename(paths[0])} ({json.loads(k)})" for k, paths in idents.items()]
        errors.append("the runs were validated on different data or settings, not comparable: "
                      + "; ".join(parts[:3]))
    machines = {}  # where the counted runs ran: groups timed or trained on other machines do not compare exactly
    for g in groups:
        for log in g["logs"]:
            if log["excluded"] is None and log.get("machine"):
                machines.setdefault(" ".join(f"{k} {v}" for k, v in sorted(log["machine"].items())), {}).setdefault(
                    g["label"], 0)
                machines[" ".join(f"{k} {v}" for k, v in sorted(log["machine"].items()))][g["label"]] += 1
    if len(machines) > 1:
        warnings.append(MACHINES_FLAG + " (their floats and clocks differ): " + "; ".join(
            f"{name}: " + ", ".join(f"{label} x{n}" for label, n in groups_there.items())
            for name, groups_there in machines.items()))
    for g in groups:
        counted = [log for log in g["logs"] if log["excluded"] is None]
        gits = sorted({log.get("git") or "?" for log in counted})
        if len(gits) > 1:
            warnings.append(f"{g['label']}: runs of different code ({', '.join(x[:10] for x in gits)})")
        trains = {_key(sorted((p, s) for p, s in log.get("data", {}).items()
                              if not fnmatch.fnmatch(p, log["hyperparameters"].get("val_files") or "")))
                  for log in counted}
        if len(trains) > 1:
            warnings.append(f"{g['label']}: runs on different training shards (their sha256)")
        seen = {}
        for log in counted:
            seed = run_key(log)
            if seed in seen:
                warnings.append(f"{g['label']}: seed {seed[0]} (data_seed {seed[1]}) twice: "
                                f"{os.path.basename(seen[seed])} and {os.path.basename(log['path'])}")
            seen.setdefault(seed, log["path"])
    return errors, warnings


# ---------------------------------------------------------------------------
# The judgement
# ---------------------------------------------------------------------------

def run_key(log):
    """A run's place in its group: its (seed, data_seed), or, for a log that names no seed (upstream's), its file."""
    hp = log["hyperparameters"]
    return (hp.get("seed"), hp.get("data_seed")) if hp.get("seed") is not None else ("file", log["path"])


def diverged(log):
    """A run that stopped on a non-finite loss or weights."""
    return bool(RE_DIVERGED.match(log.get("stopped") or ""))


def finals_of(group):
    """{run_key: final val loss} of the group's counted runs (a repeated seed keeps the first)."""
    out = {}
    for log in group["logs"]:
        if log["excluded"] is None:
            # a run stopped by a non-finite train loss or weights diverged: its last validation is not its final
            out.setdefault(run_key(log), math.nan if diverged(log) else log["val"][-1]["loss"])
    return out


def times_of(group):
    """The counted runs' clocks at their last validation, in seconds (the speedrun's time of a record's run)."""
    return [log["val"][-1]["time_ms"] / 1000 for log in group["logs"] if log["excluded"] is None
            and not diverged(log)]  # a diverged run: no time to target


def decide(finals, target, reference=None):
    """Does a group's mean final loss lie below the target? With a reference group (the target is its mean):
    Welch's two-sample test decides, one-sample and paired beside; else the one-sample test. A non-finite
    final (a run that diverged) fails the group: its mean is infinite and no test is run."""
    values = list(finals.values())
    finite = [x for x in values if math.isfinite(x)]
    mean, sd = mean_std(values) if len(finite) == len(values) else (float("inf") if values else None, None)
    one = one_sided_ttest_below(finite, target) if len(finite) == len(values) else None
    out = dict(n=len(values), n_nonfinite=len(values) - len(finite), mean=mean, sd=sd, one_sample=one,
               welch=None, paired=None, test="one-sample")
    if reference is not None:
        out["test"] = "Welch"
        if len(finite) == len(values):
            out["welch"] = welch_ttest_below(finite, list(reference.values()))
            pairs = [(finals[s], reference[s]) for s in finals if s in reference]
            out["paired"] = paired_ttest_below(pairs) if len(pairs) >= 2 else None
    decider = out["welch"] if reference is not None else one
    out["p"] = decider and decider["p"]
    out["passed"] = bool(out["p"] is not None and mean is not None and mean < target and out["p"] < P_PASS)
    return out


def interpolate_crossing(points, target):
    """points: [(steps, loss)] sorted by steps. The steps where the piecewise-linear curve first meets ``target``
    from above, its bracket (the two points around it), or (None, None) when it never does; (steps0, None) when
    the first point is already at or below it."""
    if points and points[0][1] <= target:
        return points[0][0], None
    for (m0, l0), (m1, l1) in zip(points, points[1:]):
        if l0 > target >= l1:  # after a diverged schedule (inf) no interpolation: the next passing one
            return (m0 + (l0 - target) / (l0 - l1) * (m1 - m0) if math.isfinite(l0) else m1), (m0, m1)
    return None, None


def schedule_crossing(groups, target):
    """The crossing of a series run at several schedule lengths: the mean final loss against schedule length,
    interpolated; the spread over the seeds that ran both bracketing schedules (each seed's own crossing on them)."""
    finals = {g["steps"]: finals_of(g) for g in groups}
    # a schedule with a diverged run counts as never reaching the target (inf), not as missing
    points = [(m, mean_std(list(f.values()))[0] if all(math.isfinite(x) for x in f.values()) else math.inf)
              for m, f in sorted(finals.items()) if f]
    at, bracket = interpolate_crossing(points, target)
    if bracket is None:
        return dict(steps=at, sd=None, n_seeds=0, bracket=None, below_shortest=at is not None)
    a, b = (finals[m] for m in bracket)
    per_seed = []
    for seed in a.keys() & b.keys():
        l0, l1 = a[seed], b[seed]
        if math.isfinite(l0) and math.isfinite(l1) and l0 > l1:
            per_seed.append(bracket[0] + (l0 - target) / (l0 - l1) * (bracket[1] - bracket[0]))
    return dict(steps=at, sd=mean_std(per_seed)[1], n_seeds=len(per_seed), bracket=list(bracket),
                below_shortest=False)


def curve_table(group):
    """(steps every counted run validated at, [each run's losses at those steps])."""
    curves = [{v["step"]: v["loss"] for v in log["val"]} for log in group["logs"] if log["excluded"] is None]
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return common, [[c[step] for step in common] for c in curves]


def curve_crossing(group, target):
    """A single schedule: the first step at which the group's mean validation curve meets the target, interpolated
    between validations; the spread over the runs' own crossings."""
    common, curves = curve_table(group)
    if not curves:
        return dict(steps=None, sd=None, n_seeds=0)
    points = [(s, sum(c[i] for c in curves) / len(curves)) for i, s in enumerate(common)]
    at, _ = interpolate_crossing([(s, x) for s, x in points if math.isfinite(x)], target)
    own = [target_crossing(log["val"], target) for log in group["logs"] if log["excluded"] is None]
    own = [c["interp_step"] for c in own if c]
    if at is None and own and len(own) == len(curves):  # validated at other steps (runs stopped at their target):
        at = mean_std(own)[0]  # every run crossed, each on its own curve
    return dict(steps=at, sd=mean_std(own)[1], n_seeds=len(own))


DRAWS = 2000  # draws of the simulated and resampled intervals


def crossing_interval(members, reference, fixed_target, draws=DRAWS, seed=0):
    """The 95% interval of a series' crossing, by simulation: each draw takes every group's mean final loss (and
    the target's group's: the target's own error counts) from its t distribution, mean + sd / sqrt(n) x T(n - 1),
    the groups independently, and finds the crossing again (between schedules; for one schedule on the mean
    validation curve, every step moved by the same draw). A t draw, not a resample of the runs: at n = 3 a
    resample covers about 75%, this 95%. Draws that never cross: the upper end is None (open); draws already
    below the shortest schedule: the lower end is that schedule and a bound (lo_bound). None when a group has
    fewer than 2 runs (no spread to draw from)."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def sampler(values):  # (mean, standard error, degrees of freedom) of a group's finite finals
        values = [x for x in values if math.isfinite(x)]
        return (np.mean(values), np.std(values, ddof=1) / math.sqrt(len(values)), len(values) - 1) \
            if len(values) >= 2 else None

    ref = sampler((reference or {}).values()) if reference else None
    if reference and ref is None:
        return None
    if len(members) > 1:  # a group with a diverged run never reaches the target, as in the crossing itself
        groups = [(g["steps"], list(finals_of(g).values())) for g in sorted(members, key=lambda g: g["steps"])]
        groups = [(m, sampler(f) if all(math.isfinite(x) for x in f) else (math.inf, 0.0, 1)) for m, f in groups if f]
        if not groups or any(x is None for _, x in groups):
            return None
        steps = [m for m, _ in groups]
        mean, se, df = (np.array([x[i] for _, x in groups]) for i in range(3))
    else:
        steps, curves = curve_table(members[0])
        if len(curves) < 2:
            return None
        table = np.array(curves)
        mean, se, df = table.mean(axis=0), table.std(axis=0, ddof=1) / math.sqrt(len(curves)), len(curves) - 1
    out, below = [], 0
    for _ in range(draws):
        target = ref[0] + ref[1] * rng.standard_t(ref[2]) if ref else fixed_target
        drawn = mean + se * (rng.standard_t(df) if np.ndim(df) == 0 else np.array([rng.standard_t(d) for d in df]))
        points = [(m, x) for m, x in zip(steps, drawn) if not math.isnan(x)]
        at, _ = interpolate_crossing(points, target)
        below += bool(points and points[0][1] <= target)
        out.append(math.inf if at is None else at)
    lo, hi = np.percentile(out, [2.5, 97.5], method="inverted_cdf")  # drawn values only: never inf - inf
    return dict(lo=float(lo), hi=float(hi) if math.isfinite(hi) else None, lo_bound=below / draws > 0.025,
                draws=draws, never=sum(not math.isfinite(x) for x in out) / draws)


def median_ratio_interval(mode_ms, vanilla_ms, draws=DRAWS, seed=0):
    """The 95% interval of median(mode) / median(vanilla) over steps timed in alternation (experiments/cp_cost.py
    step_time), from a moving-block bootstrap over rounds (a round's two steps drawn together, and runs of
    neighbouring rounds, as gpu_check/interleaved.py does); None without such lists."""
    import numpy as np
    if not (isinstance(mode_ms, list) and isinstance(vanilla_ms, list) and len(mode_ms) == len(vanilla_ms) >= 5):
        return None
    a, b = np.asarray(mode_ms, dtype=float), np.asarray(vanilla_ms, dtype=float)
    n, block = len(a), max(1, math.ceil(math.sqrt(len(a))))  # moving blocks of sqrt(n) rounds: the drift is kept
    starts = np.random.default_rng(seed).integers(0, n - block + 1, (draws, math.ceil(n / block)))
    idx = (starts[:, :, None] + np.arange(block)).reshape(draws, -1)[:, :n]
    ratios = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    return [float(x) for x in np.percentile(ratios, [2.5, 97.5])]


def read_step_times(path):
    """{mode name: (step time over vanilla's, per-round ratio quartiles or None)} from a step-time file: the JSON
    line of experiments/cp_cost.py step_time (ratio_<mode>, pair_ratio_quartiles_<mode>). ValueError if none."""
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read --step_times {path}: {e.strerror or e}") from None
    for line in lines:
        if line.startswith("{"):
            try:
                measured = json.loads(line)
            except ValueError:
                continue
            names = {"cplm": "CPLM", "sentinel": "sentinel", "stopgrad": "stop-grad CPLM"}
            out = {"vanilla": (1.0, None)}
            for key, mode in names.items():
                r = measured.get(f"ratio_{key}")
                if isinstance(r, (int, float)) and math.isfinite(r) and r > 0:
                    q = measured.get(f"pair_ratio_quartiles_{key}")
                    ok = isinstance(q, list) and len(q) == 2 and all(isinstance(x, (int, float)) and math.isfinite(x)
                                                                     for x in q)
                    out[mode] = (float(r), tuple(q) if ok else None)
                    ci = measured.get(f"ratio_interval_95_{key}")  # tools/run_race.py: the ratio's own 95% interval
                    if not (isinstance(ci, list) and len(ci) == 2):  # cp_cost.py: from its alternated steps
                        ci = median_ratio_interval(measured.get(f"{key}_ms"), measured.get("vanilla_ms"))
                    if ci and all(isinstance(x, (int, float)) and x > 0 for x in ci):
                        out[mode + " interval"] = tuple(ci)
            if len(out) > 1:
                if isinstance(measured.get("settings"), dict):  # the model the ratios were measured on
                    out["settings"] = measured["settings"]
                return out
    raise ValueError(f"--step_times {path}: no JSON line with ratio_cplm or ratio_sentinel (the output of "
                     "experiments/cp_cost.py step_time)")


def judge(logs, target=DEFAULT_TARGET, target_from=None, step_times=None, ignore=(), strict=False, baseline=None,
          strict_machines=None):
    """The whole judgement of parsed logs; a JSON-serialisable dict. ValueError: not comparable, or (strict)
    flagged, or no group named by target_from."""
    merged = [k for k in ignore or () if k in MODE_KEYS + ("num_iterations", "code_sha256")]
    if merged:  # pooled, they would merge modes or schedule lengths into one group
        raise ValueError(f"--ignore {merged[0]}: it tells modes or schedules apart; it cannot be pooled like a seed")
    mark_excluded(logs)
    groups = group_runs(logs, ignore)
    legend = label_series(groups)
    order = {m: i for i, m in enumerate(MODE_NAMES)}
    groups.sort(key=lambda g: (order.get(g["mode"], len(order)), g["series_label"], g["steps"]))
    for g in groups:  # an upstream group is named by its code's hash: say where its logs are
        if g["mode"] == "upstream":
            folders = sorted({os.path.dirname(log["path"]) or "." for log in g["logs"]})
            legend[g["series_label"]] = f"the code of {len(g['logs'])} log(s) in " + ", ".join(folders[:3]) + (
                f" and {len(folders) - 3} more folders" if len(folders) > 3 else "")
    errors, warnings = provenance(groups)
    measured_on = (step_times or {}).get("settings") or {}
    for g in groups:  # ratios measured on another model do not time these runs
        other = {k: (v, g["config"][k]) for k, v in measured_on.items() if k in g["config"] and g["config"][k] != v}
        if other:
            warnings.append(f"{g['label']}: the step times were measured on another model ("
                            + ", ".join(f"{k} {a} against {b}" for k, (a, b) in other.items()) + ")")
    # --strict refuses every flag; a caller that has said its runs span machines (strict_machines=False) keeps
    # refusing the others
    refused = [w for w in warnings if strict_machines is not False or not w.startswith(MACHINES_FLAG)]
    if errors or (strict and refused):
        raise ValueError((errors or refused)[0] + ("" if errors else " (--strict)"))
    ref = find_group(groups, target_from) if target_from else None
    reference = finals_of(ref) if ref else None
    if ref is not None:
        values = list(reference.values())
        if not values or not all(math.isfinite(x) for x in values):
            raise ValueError(f"the target's group {ref['label']!r} has no counted run, or one that diverged")
        target = mean_std(values)[0]
    rows = []
    for g in groups:
        d = decide(finals_of(g), target, reference if g is not ref else None)
        # runs that --target_val_loss stopped early: their finals are cut at that loss, so no schedule's test
        # applies to them (neither a pass nor a fail); their crossing says when they got there
        d["at_target"] = sorted(log["at_target"] for log in g["logs"]
                                if log["excluded"] is None and log.get("at_target"))
        if d["at_target"]:
            d["passed"] = False
        runs = [summarize_run(log) for log in g["logs"]]
        counted = [r["step_ms"] for r in runs if r["excluded"] is None and r["step_ms"]]
        rows.append(dict(label=g["label"], series=g["series_label"], mode=g["mode"], steps=g["steps"], finals=[
                             {"seed": k[0], "data_seed": k[1], "loss": x} if k[0] != "file"
                             else {"file": k[1], "loss": x}
                             for k, x in finals_of(g).items()],
                         is_target=g is ref, decision=None if g is ref else d, n=d["n"], mean=d["mean"], sd=d["sd"],
                         step_ms=_median(counted), runs=runs, n_excluded=sum(r["excluded"] is not None for r in runs),
                         crossing=curve_crossing(g, target)))
    series = []
    for name in dict.fromkeys(g["series_label"] for g in groups):
        members = sorted((g for g in groups if g["series_label"] == name), key=lambda g: g["steps"])
        mrows = [r for r in rows if r["series"] == name]
        passing = [r["steps"] for r in mrows if r["decision"] and r["decision"]["passed"]]
        rule = min(passing) if passing else None
        failing = [r["steps"] for r in mrows if r["decision"] and not r["decision"]["passed"]
                   and not r["decision"]["at_target"] and (rule is None or r["steps"] < rule)]
        if ref is not None and name == ref["series_label"]:
            rule, failing = ref["steps"], []
        if len(members) > 1:
            crossing = {**schedule_crossing(members, target), "kind": "schedules"}
        else:
            crossing = {**mrows[0]["crossing"], "kind": "curve"}
        is_ref = ref is not None and name == ref["series_label"]
        crossing["interval"] = None if is_ref else crossing_interval(members, reference, target)
        series.append(dict(name=name, mode=members[0]["mode"], settings=members[0]["series"],
                           schedules=[g["steps"] for g in members],
                           rule_steps=rule, longest_failing=max(failing) if failing else None, crossing=crossing,
                           step_ms=_median([r["step_ms"] for r in mrows if r["step_ms"]])))
    result = dict(target=target, target_from=ref["label"] if ref else None, n_target=len(reference or {}),
                  test="Welch" if ref else "one-sample", p_pass=P_PASS, groups=rows, series=series, legend=legend,
                  warnings=warnings, step_times=None, reference=None, ignore=list(ignore or ()))
    # the clocks, as upstream compares records: each group's mean time, its difference to a baseline group (the
    # one named, else the target's, else the other of two) with Welch's 95% interval
    base = find_group(groups, baseline, "--baseline") if baseline else ref or (groups[0] if len(groups) == 2 else None)
    result["time_baseline"] = base["label"] if base else None
    for g, row in zip(groups, rows):
        times = times_of(g)
        row["time_s"], row["time_sd_s"] = mean_std(times)
        row["time_difference_s"] = (mean_difference_interval(times, times_of(base))
                                    if base is not None and g is not base else None)
    time_to_target(result, ref, step_times)
    return result


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def time_to_target(result, ref, step_times):
    """Adds each series' time to target over the reference's, reading for reading (the rule's over the rule's,
    the crossing over the crossing): steps x step time, the step times from the file (ratios to vanilla's,
    measured in one process) or from the logs' clocks. The reference is the target's group, whose both readings
    are its own length (it defines the target), or, with a fixed target, vanilla's series."""
    series = result["series"]
    if ref is not None:
        base = next(s for s in series if s["name"] == ref["series_label"])
        base_rule = base_crossing = ref["steps"]
    else:
        reached = [s for s in series if s["rule_steps"] or s["crossing"]["steps"] is not None]
        base = next((s for s in reached if s["mode"] == "vanilla"), None) or \
            next((s for s in reached if s["mode"] == "upstream"), None)
        base_rule, base_crossing = (base["rule_steps"], base["crossing"]["steps"]) if base else (None, None)
    result["step_times"] = "file" if step_times else "logs"
    if base is None:
        return
    result["reference"] = dict(series=base["name"], rule_steps=base_rule, crossing_steps=base_crossing)
    for s in series:
        if step_times:
            ratio, quartiles = step_times.get(s["mode"], (None, None)) if base["mode"] == "vanilla" else (None, None)
        else:
            ratio = s["step_ms"] / base["step_ms"] if s["step_ms"] and base["step_ms"] else None
            quartiles = None
        s.update(step_ratio=ratio, step_ratio_quartiles=quartiles, time_ratio_rule=None, time_ratio_bracket=None,
                 time_ratio_crossing=None)
        if ratio is None:
            continue
        if s["rule_steps"] and base_rule:
            s["time_ratio_rule"] = s["rule_steps"] * ratio / base_rule
            if quartiles and s is not base:
                s["time_ratio_bracket"] = [(s["longest_failing"] or 0) * quartiles[0] / base_rule,
                                           s["rule_steps"] * quartiles[1] / base_rule]
        if s["crossing"]["steps"] is not None and base_crossing:
            s["time_ratio_crossing"] = s["crossing"]["steps"] * ratio / base_crossing
        # the crossing's bootstrap interval times the step ratio's 95% interval (where measured): both carried
        ci, r_ci = s["crossing"].get("interval"), (step_times or {}).get(s["mode"] + " interval")
        if ci and ci["lo"] is not None and r_ci and base_crossing and s is not base:
            s["time_ratio_crossing_interval"] = [ci["lo"] * r_ci[0] / base_crossing,
                                                 ci["hi"] * r_ci[1] / base_crossing if ci["hi"] is not None else None]
            s["time_ratio_crossing_lo_bound"] = ci.get("lo_bound", False)
        if s.get("time_ratio_rule") is not None and s is not base and r_ci:  # the step ratio's interval only
            s["time_ratio_rule_interval"] = [s["rule_steps"] * r_ci[0] / base_rule,
                                             s["rule_steps"] * r_ci[1] / base_rule]


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

def format_table(headers, rows, align=None):
    cols = list(zip(*([headers] + rows))) if rows else [[h] for h in headers]
    widths = [max(len(str(x)) for x in col) for col in cols]
    align = align or ("l" + "r" * (len(headers) - 1))

    def fmt(row):
        return "  ".join(str(x).ljust(w) if a == "l" else str(x).rjust(w)
                         for x, w, a in zip(row, widths, align)).rstrip()
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _f(x, spec=".4f"):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _p(test):
    if test is None:
        return "-"
    if test["p"] is None:
        return "no spread"
    return f"{test['p']:.1e}" if test["p"] < 1e-3 else f"{test['p']:.3f}"


def _interval(ci, spec):
    """' [lo, hi]' of an interval dict: '<= lo' where the lower end is a bound, 'open' for a missing upper end."""
    if not ci or ci.get("lo") is None:
        return ""
    return (f" [{'<= ' if ci.get('lo_bound') else ''}{format(ci['lo'], spec)}, "
            + (format(ci["hi"], spec) if ci.get("hi") is not None else "open") + "]")


def _wrap(text, width=100, indent=""):
    import textwrap
    return textwrap.wrap(text, width, subsequent_indent=indent) or [""]


def format_report(result, show_runs=None):
    out = []
    target = result["target"]
    if result["target_from"]:
        runs = f"{result['n_target']} run" + ("s" if result["n_target"] != 1 else "")
        head = (f"target {target:.4f}: the mean final val loss of {result['target_from']!r} ({runs}); it is an "
                f"estimate, so Welch's one-sided two-sample t-test against those runs decides (p < "
                f"{result['p_pass']}); the one-sample test and the test paired by seed are beside it"
                + ("; a test needs 2 runs or more a side" if result["n_target"] < 2 else ""))
    else:
        head = (f"target {target:.4f}, a fixed number: the one-sided one-sample t-test decides "
                f"(mean final val loss below the target, p < {result['p_pass']}: the speedrun's record rule)")
    out += _wrap(head)
    for w in result["warnings"]:
        out += _wrap("flagged: " + w, indent="  ")
    out += ["", "Schedules: final val loss, mean ± sd over the runs (seeds and data orders pooled)"]
    welch = result["test"] == "Welch"
    rows = []
    for g in result["groups"]:
        d = g["decision"]
        n = f"{g['n']}" + (f" +{g['n_excluded']}x" if g["n_excluded"] else "")
        loss = _f(g["mean"]) + (f" ± {g['sd']:.4f}" if g["sd"] is not None else "")
        if d is None:
            rows.append([g["label"], n, loss, "(the target)", "", "", ""] if welch else
                        [g["label"], n, loss, "(the target)", ""])
            continue
        verdict = ("yes" if d["passed"] else "diverged" if d["n_nonfinite"] else
                   f"stopped at --target_val_loss (steps {', '.join(map(str, d['at_target']))})" if d.get("at_target")
                   else "no" if d["p"] is not None else "untested")
        rows.append([g["label"], n, loss, _p(d["welch"]), _p(d["one_sample"]), _p(d["paired"]), verdict] if welch
                    else [g["label"], n, loss, _p(d["one_sample"]), verdict])
    headers = (["group", "n", "final val loss", "p Welch", "p 1-sample", "p paired", "passes"] if welch
               else ["group", "n", "final val loss", "p 1-sample", "passes"])
    out.append(format_table(headers, rows, "lrrrrrl" if welch else "lrrrl"))
    if any(g["n_excluded"] for g in result["groups"]):
        out.append("+Nx: runs listed below and not counted")
    base = result.get("time_baseline")
    out += [""] + _wrap("Clocks: train time at the last validation, mean ± sd over the counted runs (runs that "
                        "shared a machine, or ran on other hardware, do not compare)" + (
                            f"; difference to {base!r} with Welch's 95% interval" if base else
                            "; --baseline GROUP gives each group's difference to it"))
    rows = []
    for g in result["groups"]:
        d = g.get("time_difference_s")
        diff = ("(the baseline)" if g["label"] == base else
                f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d else "-")
        rows.append([g["label"], str(g["n"]), _f(g["time_s"], ".3f") + (f" ± {g['time_sd_s']:.3f}"
                                                                        if g["time_sd_s"] is not None else ""), diff])
    out.append(format_table(["group", "n", "time (s)", "difference (s)"], rows, "lrrr"))
    ref = result["reference"]
    source = ("--step_times (ratios to vanilla's, measured in one process)" if result["step_times"] == "file"
              else "the logs' clocks (train time / steps, median over runs; noisy on a shared machine)")
    out += [""] + _wrap("Steps and time to target. rule: the shortest schedule that passes (the longest that "
                        "fails below it); crossing: where the mean final loss meets the target between the "
                        "schedules run, or, for one schedule, where its mean validation curve "
                        "does (curve). time = steps x step time over "
                        + (f"{ref['series']}'s" if ref else "the reference's") + f"; step times: {source}.")
    rows = []
    for s in result["series"]:
        c = s["crossing"]
        if ref and s["name"] == ref["series"] and result["target_from"]:
            rows.append([s["name"], f"{s['rule_steps']} (defines it)", "", _f(s.get("step_ratio"), ".3f"), "1", "1"])
            continue
        judged = [g for g in result["groups"] if g["series"] == s["name"] and g["decision"]
                  and not g["decision"].get("at_target")]
        tested = any(g["decision"]["p"] is not None for g in judged)
        below = [g for g in judged if g["mean"] is not None and g["mean"] < target]
        stopped = any(g["decision"] and g["decision"].get("at_target") for g in result["groups"]
                      if g["series"] == s["name"])
        rule = (str(s["rule_steps"]) if s["rule_steps"] is not None else
                f"not significant at n = {min(g['n'] for g in below)}" if below and tested
                else "not reached" if tested else "stopped at the target" if stopped else "untested")
        if s["rule_steps"] is not None and s["longest_failing"]:
            rule += f" ({s['longest_failing']} fails)"
        if c["steps"] is None:
            cross = "not reached"
        elif c.get("below_shortest"):
            cross = f"<= {c['steps']}"
        else:
            cross = f"{c['steps']:.0f}" + _interval(c.get("interval"), ".0f") + (
                " (curve)" if c["kind"] == "curve" else "")
        t_rule = _f(s.get("time_ratio_rule"), ".3f")
        if s.get("time_ratio_rule_interval"):
            t_rule += _interval(dict(zip(("lo", "hi"), s["time_ratio_rule_interval"])), ".3f")
        elif s.get("time_ratio_bracket"):
            t_rule += " {{{:.3f}, {:.3f}}}".format(*s["time_ratio_bracket"])
        t_cross = _f(s.get("time_ratio_crossing"), ".3f")
        if c.get("below_shortest") and s.get("time_ratio_crossing") is not None:
            t_cross = "<= " + t_cross  # the shortest schedule already passed: a bound, not a crossing
        elif s.get("time_ratio_crossing") is not None and s.get("time_ratio_crossing_interval"):
            t_cross += _interval(dict(zip(("lo", "hi"), s["time_ratio_crossing_interval"]),
                                      lo_bound=s.get("time_ratio_crossing_lo_bound")), ".3f")
        rows.append([s["name"], rule, cross, _f(s.get("step_ratio"), ".3f"), t_rule, t_cross])
    out.append(format_table(["series", "steps: rule", "steps: crossing", "step time", "time: rule",
                             "time: crossing"], rows, "lrrrrr"))
    out += _wrap("[ ]: 95% intervals. Steps by the crossing: every group's mean drawn from its t distribution, the "
                 "target's included (open: past the longest schedule; <=: below the shortest); time by the rule: "
                 "the step ratio's interval only (the rule's steps are a point of the grid); time by the crossing: "
                 "the two intervals' ends multiplied (wider than 95%).")
    if any(s.get("time_ratio_bracket") and not s.get("time_ratio_rule_interval") for s in result["series"]):
        out += _wrap("{ }: not an interval: the longest failing and the passing schedule, times the step ratio's "
                     "per-round quartiles.")
    for name, tag in result["legend"].items():
        out += _wrap(f"{name}: {tag}", indent="    ")
    runs = [(g["label"], r) for g in result["groups"] for r in g["runs"]]
    listed = runs if (show_runs or (show_runs is None and len(runs) <= 12)) else [x for x in runs if x[1]["excluded"]]
    if listed:
        out += ["", "Runs" + ("" if len(listed) == len(runs) else f" not counted ({len(runs)} runs in all; "
                                                                    "--runs lists each)")]
        rows = [[r["run_id"], label, _fmt_value(r["seed"]), _fmt_value(r["data_seed"]), _f(r["final_val_loss"]),
                 f"{r['final_step']}/{r['num_iterations']}", _f(r["train_time_ms"] / 1000, ".0f")]
                for label, r in listed]
        out.append(format_table(["run", "group", "seed", "data", "final val", "step", "time_s"], rows, "llrrrrr"))
        for label, r in listed:
            if r["excluded"]:
                out += _wrap(f"  {r['run_id']} not counted: {r['excluded']}", indent="    ")
    elif runs:
        out += ["", f"{len(runs)} runs, all counted (--runs lists each)"]
    return "\n".join(out)


def _json_clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_clean(v) for v in x]
    return x


def to_json(result):
    return json.dumps(_json_clean(result), indent=1)


# ---------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------

PLOT_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif", "tiff", "webp")


def _import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


def plot_groups(logs, result, out_path, title=None):
    """Validation loss against steps and against train time: one colour per series, a thin line per counted run,
    the target dashed, the legend outside the axes."""
    plt = _import_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    names = [s["name"] for s in result["series"]]
    by_label = {g["label"]: g["series"] for g in result["groups"]}
    groups = group_runs(logs, result.get("ignore"))
    machine = lambda log: _key(log.get("machine") or {})  # noqa: E731
    counts = {}
    for log in logs:
        counts[machine(log)] = counts.get(machine(log), 0) + 1
    usual = max(counts, key=counts.get) if counts else None  # runs from any other machine are drawn dotted
    ys, drawn = [], set()
    for g in groups:
        name = by_label.get(g["label"], g["series_label"])
        color = colors[names.index(name) % len(colors)] if name in names else "grey"
        for log in g["logs"]:
            pts = [v for v in log["val"] if math.isfinite(v["loss"])]
            if log.get("excluded") or not pts:
                continue
            ys += [v["loss"] for v in pts if v["step"] > 0]
            label = None if name in drawn else name
            drawn.add(name)
            style = "-" if machine(log) == usual else ":"
            axes[0].plot([v["step"] for v in pts], [v["loss"] for v in pts], color=color, lw=0.8, alpha=0.7,
                         label=label, ls=style)
            axes[1].plot([v["time_ms"] / 1000 for v in pts], [v["loss"] for v in pts], color=color, lw=0.8,
                         alpha=0.7, ls=style)
            for ax, x in zip(axes, (pts[-1]["step"], pts[-1]["time_ms"] / 1000)):  # the final: what is judged
                ax.plot([x], [pts[-1]["loss"]], "o", color=color, ms=2.5)
    target = result["target"]
    for ax, xlabel in zip(axes, ["step", "train time (s)"]):
        ax.axhline(target, color="k", ls="--", lw=1.0, label=f"target {target:.4f}" if ax is axes[0] else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
        if ys:  # the interesting part: from the best loss to a little above the target's neighbourhood
            lo, hi = min(min(ys), target), max(target, sorted(ys)[int(0.8 * (len(ys) - 1))])
            pad = 0.08 * (hi - lo) or 0.1
            ax.set_ylim(lo - pad, hi + pad)
    if len(counts) > 1:
        axes[0].plot([], [], color="grey", ls=":", lw=0.8, label="(dotted: runs from another machine)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out_path


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def expand_paths(patterns):
    """Expand files, directories (their *.txt) and globs; sorted, de-duplicated (a file reached twice, by a link or
    two patterns, counts once)."""
    out, seen = [], set()
    for p in patterns:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.txt")))
        elif os.path.isfile(p):
            found = [p]
        else:
            found = sorted(glob.glob(p))
        for f in found:
            if not os.path.isfile(f):
                continue
            key = os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    ap = OneLineParser(prog="compare.py", description="The judge: steps and time to a target validation loss, "
                       "per mode, from training logs (the module's docstring has every definition).")
    ap.add_argument("logs", nargs="+", help="log files, folders (their *.txt) or glob patterns")
    ap.add_argument("--target", type=float, default=None,
                    help=f"a fixed target val loss, judged by the one-sample t-test (default {DEFAULT_TARGET})")
    ap.add_argument("--target_from", default=None, metavar="GROUP",
                    help="the target is this group's mean final val loss, judged by Welch's test against its "
                         "runs: a mode ('vanilla'), a label or part of one, and key=value settings "
                         "('vanilla num_iterations=3237')")
    ap.add_argument("--step_times", default=None, metavar="FILE",
                    help="step times measured in one process (experiments/cp_cost.py step_time's output); "
                         "without it, the logs' own clocks")
    ap.add_argument("--baseline", default=None, metavar="GROUP",
                    help="the group whose clock the others' are compared with (default: the target's group, or the "
                         "other of two groups)")
    ap.add_argument("--ignore", default=None, help="comma list of more settings to pool over, like seeds")
    ap.add_argument("--strict", action="store_true",
                    help="refuse, not flag, groups mixing code versions, training data or a repeated seed")
    ap.add_argument("--allow_machines", action="store_true",
                    help="with --strict: runs from different machines are flagged, not refused")
    ap.add_argument("--runs", action="store_true", help="list every run (default: up to 12, and those not counted)")
    ap.add_argument("--plot", default=None, metavar="OUT.png", help="write val loss vs step and vs time")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    return ap


def _error(msg, code=2):
    print(f"compare.py: error: {msg}", file=sys.stderr)
    return code


def load(patterns, warn=None):
    """Parsed logs of the files the patterns name; (logs, skipped messages). ValueError when none is usable."""
    paths = expand_paths(patterns)
    if not paths:
        raise ValueError("no log files matched: " + " ".join(patterns))
    logs, bad = [], []
    for p in paths:
        try:
            logs.append(parse_log(p))
        except LogError as e:
            bad.append(str(e))
    if not logs:
        raise ValueError(bad[0] if len(bad) == 1 else f"no usable logs ({len(bad)} files; first: {bad[0]})")
    return logs, bad


def main(argv=None):
    if argv is None:  # a command line piped into `head`: stop quietly when the reader goes
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    if args.target is not None and args.target_from:
        return _error("give --target or --target_from, not both")
    target = DEFAULT_TARGET if args.target is None else args.target
    if not math.isfinite(target):
        return _error(f"--target must be a finite loss, not {target}")
    if args.plot:
        try:
            _import_pyplot()
        except RuntimeError as e:
            return _error(str(e))
        if not os.path.splitext(args.plot)[1]:  # matplotlib would write NAME.png: say that name
            args.plot += ".png"
        if os.path.splitext(args.plot)[1][1:].lower() not in PLOT_FORMATS:
            return _error(f"--plot {args.plot}: not an image format matplotlib writes ({', '.join(PLOT_FORMATS)})")
    try:
        logs, bad = load(args.logs)
        step_times = read_step_times(args.step_times) if args.step_times else None
        result = judge(logs, target=target, target_from=args.target_from, step_times=step_times,
                       ignore=[k.strip() for k in (args.ignore or "").split(",") if k.strip()], strict=args.strict,
                       baseline=args.baseline, strict_machines=False if args.allow_machines else None)
    except ValueError as e:
        return _error(str(e))
    for msg in bad:
        print(f"compare.py: warning: skipping {msg}", file=sys.stderr)
    if args.plot:
        try:
            plot_groups(logs, result, args.plot)
        except OSError as e:
            return _error(f"cannot write the plot {args.plot}: {e.strerror or e}", code=1)
        result["plot"] = args.plot
    if args.json:
        print(to_json(result))
    else:
        print(format_report(result, show_runs=True if args.runs else None))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
