#!/usr/bin/env python3
"""Compare training runs from their log files.

Each log (``logs/<run_id>.txt``) starts with the training script's own source
code, followed by the run's output.  Only lines that begin at column 0 and
match the log format are used:

    run_id: <id>
    hyperparameters: {...one-line JSON...}
    step:S/N val_loss:X train_time:Tms ...
    step:S/N [train_loss:X ]train_time:Tms ...  (train_loss only every --train_loss_every steps)
    step:S/N copy_share:... lambda:...        (optional diagnostics)
    stopped: <reason>                          (optional)
    peak memory allocated: M MiB ...

Runs are grouped into configurations (hyperparameters minus seed, run_id, log_dir and resume, or
only the keys given to --group_by).  For every run and group the tool reports
the final validation loss, when a target loss was reached, and a one-sided
one-sample Student t-test of "mean final val loss < target" (the speedrun's
record rule is p < 0.01).

Stand-alone: standard library only; matplotlib is needed only for --plot.

Usage:
    python tools/compare.py 'logs/*.txt' [--target 3.28] [--group_by k1,k2]
        [--ignore k1,k2] [--target_from LABEL_OR_key=value] [--plot out.png]
        [--json]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import sys

DEFAULT_TARGET = 3.28
# where a run was written, and how it was checkpointed or logged, is not what it was
ALWAYS_IGNORED = ("seed", "run_id", "log_dir", "resume", "overwrite", "checkpoint_every", "save_checkpoint",
                  "keep_checkpoints", "train_loss_every", "dist_timeout_s")

_FLOAT = r"[-+]?(?:nan|inf|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
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
RE_RESUMED_AT = re.compile(r"^(?:continuing|resumed from .*) at step (\d+), train_time")
RE_PEAK_MEM = re.compile(r"^peak memory allocated: (\d+) MiB(?: reserved: (\d+) MiB)?")


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
    diagnostics (list of {step, ...floats}), stopped (str or None),
    peak_mem_mib, reserved_mem_mib.  Raises LogError if the file cannot be
    read or has no val_loss lines.
    """
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror or e}") from None

    # The source code comes first, up to a line of "=": nothing in it is a measurement. A resumed run adds
    # sections (each from its own hyperparameters line); a resume at step N cuts what an earlier section logged
    # after N (a branch abandoned by --overwrite), and the last section's hyperparameters and stop reason count.
    separator = next((i for i, line in enumerate(lines) if len(line) >= 10 and set(line) == {"="}), None)
    if separator is None:  # no separator: trust only what follows the last hyperparameters line
        separator = max([i for i, line in enumerate(lines) if _hparams_of(line) is not None], default=0) - 1
    hparams = None
    run_id = None
    by_step = {"val": {}, "train": {}, "diags": {}}
    stopped, peak, reserved, finished = None, None, None, False
    for line in lines[separator + 1:]:
        obj = _hparams_of(line)
        if obj is not None:
            hparams, stopped, finished = obj, None, False
            continue
        if line.startswith("final val_loss:"):  # the last line of a run that ended normally
            finished = True
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
            # a run that diverged ended on its own (a non-finite loss): it counts, with that loss
            finished = finished or bool(re.match(r"(val|train)_loss is (nan|inf|-inf)", stopped))
            continue
        m = RE_PEAK_MEM.match(line)
        if m:
            peak = int(m.group(1))
            reserved = int(m.group(2)) if m.group(2) else None
    val, train, diags = ([d[k] for k in sorted(d)] for d in (by_step["val"], by_step["train"], by_step["diags"]))

    if not val:
        raise LogError(f"{path}: no val_loss lines")
    if run_id is None:
        run_id = (hparams or {}).get("run_id") or os.path.splitext(os.path.basename(path))[0]
    # two files with the same measurements are copies of one run, whatever their names
    fingerprint = hashlib.sha256(json.dumps([hparams, val, train], sort_keys=True, default=str).encode()).hexdigest()
    return dict(path=str(path), run_id=str(run_id), hyperparameters=hparams or {},
                val=val, train=train, diagnostics=diags, stopped=stopped, finished=finished,
                peak_mem_mib=peak, reserved_mem_mib=reserved, fingerprint=fingerprint)


# ---------------------------------------------------------------------------
# Per-run metrics
# ---------------------------------------------------------------------------

def target_crossing(val, target):
    """When does the val loss first reach ``target`` (loss <= target)?

    Returns None if never, else a dict with
      step, time_ms             -- the first evaluation with loss <= target
      interp_step, interp_time_ms -- linear interpolation between that
                                  evaluation and the previous one (equal to
                                  the evaluation itself if it is the first).
    """
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
            return dict(step=v["step"], time_ms=v["time_ms"],
                        interp_step=istep, interp_time_ms=itime)
        prev = v
    return None


def summarize_run(log, target):
    """Per-run summary: final val loss, steps, train time, target crossing."""
    last = log["val"][-1]
    all_steps = [v["step"] for v in log["val"]] + [t["step"] for t in log["train"]]
    all_times = [v["time_ms"] for v in log["val"]] + [t["time_ms"] for t in log["train"]]
    hp = log["hyperparameters"]
    return dict(
        run_id=log["run_id"], path=log["path"], seed=hp.get("seed"),
        final_val_loss=last["loss"], final_step=last["step"],
        final_time_ms=last["time_ms"], num_iterations=last["total"],
        steps=max(all_steps), train_time_ms=max(all_times),
        stopped=log["stopped"], peak_mem_mib=log["peak_mem_mib"], excluded=log.get("excluded"),
        last_diagnostics=log["diagnostics"][-1] if log["diagnostics"] else None,
        target=target, crossing=target_crossing(log["val"], target),
    )


# ---------------------------------------------------------------------------
# Grouping
# ---------------------------------------------------------------------------

def _split_keys(s):
    return [k.strip() for k in (s or "").split(",") if k.strip()]


def group_runs(logs, group_by=None, ignore=()):
    """Group parsed logs into configurations.

    Default: by hyperparameters without seed, run_id and ``ignore`` keys.
    With ``group_by`` (list of keys): by those keys only (missing -> None).
    Returns a list of {"label", "config", "logs"} in first-seen order; labels
    are built from the config keys whose values differ between groups.
    """
    groups = {}
    for log in logs:
        hp = log["hyperparameters"]
        if group_by:
            config = {k: hp.get(k) for k in group_by}
        else:
            drop = set(ALWAYS_IGNORED) | set(ignore or ())
            config = {k: v for k, v in hp.items() if k not in drop}
        key = json.dumps(config, sort_keys=True, default=str)
        groups.setdefault(key, {"config": config, "logs": []})["logs"].append(log)
    out = list(groups.values())
    labels = make_labels([g["config"] for g in out])
    for g, lab in zip(out, labels):
        g["label"] = lab
    return out


def _fmt_value(v):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True)


def make_labels(configs):
    """Short labels from the keys whose values differ between configs."""
    keys = []
    for c in configs:
        for k in c:
            if k not in keys:
                keys.append(k)
    def sig(c, k):
        return json.dumps([k in c, c.get(k)], sort_keys=True, default=str)
    differing = [k for k in keys if len({sig(c, k) for c in configs}) > 1]
    labels = []
    modes = {0: "vanilla", 1: "CPLM"}  # the modes by the names README gives them
    for c in configs:
        parts = [modes[c[k]] if k == "cplm" and c.get(k) in modes else f"{k}={_fmt_value(c.get(k))}"
                 for k in differing]
        labels.append(" ".join(parts) if parts else "all")
    return labels


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
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var)


def _betacf(a, b, x, max_iter=500, eps=1e-15):
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        # even step
        num = m * (b - m) * x / ((a + m2 - 1.0) * (a + m2))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        # odd step
        num = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a, b, x):
    """Regularized incomplete beta function I_x(a, b) for a, b > 0, 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    front = math.exp(log_front)
    # The continued fraction converges fast for x < (a+1)/(a+b+2); otherwise
    # use the symmetry I_x(a,b) = 1 - I_{1-x}(b,a).
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def students_t_sf(t, df):
    """P(T > t) for Student's t with ``df`` degrees of freedom (df > 0; inf -> normal)."""
    if math.isnan(t) or not df > 0:
        return float("nan")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if math.isinf(df):
        return 0.5 * math.erfc(t / math.sqrt(2.0))
    # P(|T| > |t|) = I_{df/(df+t^2)}(df/2, 1/2)
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def students_t_cdf(t, df):
    """P(T <= t) for Student's t."""
    return 1.0 - students_t_sf(t, df)


def one_sided_ttest_below(xs, target):
    """One-sample t-test of H1: mean(xs) < target.  Returns dict(t, df, p) or
    None when n < 2."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    n = len(xs)
    if n < 2:
        return None
    m, s = mean_std(xs)
    if s == 0.0:  # no spread: the test is undefined (identical runs are no evidence of anything)
        return dict(t=None, df=n - 1, p=None)
    t = (target - m) / (s / math.sqrt(n))
    return dict(t=t, df=n - 1, p=students_t_sf(t, n - 1))


def welch_ttest_below(xs, ys):
    """Welch's two-sample t-test of H1: mean(xs) < mean(ys), for a target that is itself an estimate (ys: the
    runs that define it). Returns dict(t, df, p) (Welch-Satterthwaite df), or None when either has n < 2."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    ys = [y for y in ys if y is not None and math.isfinite(y)]
    if len(xs) < 2 or len(ys) < 2:
        return None
    (mx, sx), (my, sy) = mean_std(xs), mean_std(ys)
    vx, vy = sx * sx / len(xs), sy * sy / len(ys)
    if vx + vy == 0.0:
        return dict(t=None, df=None, p=None)
    df = (vx + vy) ** 2 / (vx * vx / (len(xs) - 1) + vy * vy / (len(ys) - 1))
    t = (my - mx) / math.sqrt(vx + vy)
    return dict(t=t, df=df, p=students_t_sf(t, df))


def paired_ttest_below(pairs):
    """One-sided paired t-test of H1: x < y over (x, y) pairs (the same seed and data order), or None (n < 2)."""
    diffs = [y - x for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
    test = one_sided_ttest_below([-d for d in diffs], 0.0)
    return test


def summarize_group(group, target):
    """Statistics over the group's counted runs: finished, and each run once (mark_excluded)."""
    listed = [summarize_run(log, target) for log in group["logs"]]
    runs = [r for r in listed if r["excluded"] is None]
    finals = [r["final_val_loss"] for r in runs]
    finite = [x for x in finals if math.isfinite(x)]
    fm, fs = mean_std(finite)
    reached = [r for r in runs if r["crossing"] is not None]

    def ms(key):
        m, s = mean_std([r["crossing"][key] for r in reached])
        return {"mean": m, "std": s}

    return dict(
        label=group["label"], config=group["config"], n=len(runs),
        n_nonfinite=len(finals) - len(finite),
        final_val_loss={"mean": fm, "std": fs},
        final_step={"mean": mean_std([r["final_step"] for r in runs])[0]},
        final_time_ms={"mean": mean_std([r["final_time_ms"] for r in runs])[0]},
        n_reached=len(reached),
        steps_to_target=ms("step"), time_ms_to_target=ms("time_ms"),
        interp_steps_to_target=ms("interp_step"),
        interp_time_ms_to_target=ms("interp_time_ms"),
        ttest=one_sided_ttest_below(finite, target),
        runs=listed, n_excluded=len(listed) - len(runs),
    )


def mean_curve(group):
    """{step: mean val loss} over the group's counted runs, at the steps every one of them validated."""
    curves = [{v["step"]: v["loss"] for v in log["val"]} for log in group["logs"] if log["excluded"] is None]
    if not curves:
        return {}
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return {s: sum(c[s] for c in curves) / len(curves) for s in steps}


def race(groups):
    """The groups side by side: mean val loss at the steps all of them validated, and for each ordered pair the
    steps one needs to reach the other's final loss, by first crossing and by staying below from then on."""
    curves = {g["label"]: mean_curve(g) for g in groups}
    common = sorted(set.intersection(*(set(c) for c in curves.values()))) if all(curves.values()) else []
    pairs = []
    for a, ca in curves.items():
        for b, cb in curves.items():
            if a == b or not ca or not cb:
                continue
            goal = cb[max(cb)]  # b's final (mean) val loss
            steps = sorted(ca)
            first = next((s for s in steps if ca[s] <= goal), None)
            stays = next((s for i, s in enumerate(steps) if all(ca[t] <= goal for t in steps[i:])), None)
            pairs.append(dict(group=a, other=b, other_final=goal, other_final_step=max(cb), first_crossing=first,
                              stays_below=stays))
    return dict(steps=common, curves={k: {s: c[s] for s in common} for k, c in curves.items()}, pairs=pairs)


def mark_excluded(logs):
    """Sets log["excluded"] to why a run must not count in a group's mean and test: it never ended (killed or
    stopped: no final line), or it is a copy of an earlier file's run (the same measurements)."""
    first = {}
    for log in logs:
        if not log.get("finished", True):
            log["excluded"] = "incomplete: no final line" + (f" ({log['stopped']})" if log["stopped"] else "")
        elif log["fingerprint"] in first:
            log["excluded"] = f"copy of {first[log['fingerprint']]}"
        else:
            log["excluded"] = None
            first[log["fingerprint"]] = log["path"]


def find_reference(groups, spec):
    """Find the single group matching ``spec``: either key=value pairs (space
    or comma separated) matched against group configs, or a label substring.
    Raises ValueError when nothing or more than one group matches."""
    pairs = [p for p in re.split(r"[\s,]+", spec.strip()) if p]
    matches = []
    if pairs and all("=" in p for p in pairs):
        kv = [p.split("=", 1) for p in pairs]

        def ok(cfg):
            for k, v in kv:
                if k not in cfg:
                    return False
                if v not in (_fmt_value(cfg[k]), str(cfg[k])):
                    return False
            return True
        matches = [g for g in groups if ok(g["config"])]
    if not matches:
        matches = [g for g in groups if spec in g["label"]]
    if len(matches) != 1:
        labels = ", ".join(repr(g["label"]) for g in groups)
        what = "no group" if not matches else f"{len(matches)} groups"
        raise ValueError(f"--target_from {spec!r} matches {what} (groups: {labels})")
    return matches[0]


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def compare(logs, target=DEFAULT_TARGET, group_by=None, ignore=(), target_from=None):
    """Full analysis of parsed logs.  Returns a JSON-serialisable dict."""
    mark_excluded(logs)
    groups = group_runs(logs, group_by=group_by, ignore=ignore)
    ref = None
    target_source = "fixed"
    if target_from:
        ref = find_reference(groups, target_from)
        ref_final = [log["val"][-1]["loss"] for log in ref["logs"] if log["excluded"] is None]
        m, _ = mean_std([x for x in ref_final if math.isfinite(x)])
        if m is None:
            raise ValueError(f"reference group {ref['label']!r} has no finite final val loss")
        target = m
        target_source = f"mean final val loss of {ref['label']!r}"
    summaries = [summarize_group(g, target) for g in groups]
    result = dict(target=target, target_source=target_source, groups=summaries,
                  reference=None, race=race(groups) if len(groups) > 1 else None)
    if ref is not None:
        rs = summaries[groups.index(ref)]
        ref_steps = rs["final_step"]["mean"]
        ref_time = rs["final_time_ms"]["mean"]
        result["reference"] = dict(label=rs["label"], mean_final_step=ref_steps,
                                   mean_final_time_ms=ref_time)
        for s in summaries:
            if s is rs:
                s["convergence_ratio"] = None
                continue
            s["convergence_ratio"] = dict(
                steps=_ratio(s["interp_steps_to_target"]["mean"], ref_steps),
                time=_ratio(s["interp_time_ms_to_target"]["mean"], ref_time),
                n_reached=s["n_reached"],
            )
    return result


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

def format_table(headers, rows, align=None):
    """Fixed-width text table; ``align`` is a string of 'l'/'r' per column."""
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    align = align or "l" + "r" * (len(headers) - 1)

    def fmt(cells):
        out = []
        for i, c in enumerate(cells):
            out.append(c.ljust(widths[i]) if align[i] == "l" else c.rjust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def _f(x, spec=".4f"):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _pm(d, spec=".4f", scale=1.0):
    m, s = d["mean"], d["std"]
    if m is None:
        return "-"
    out = _f(m * scale, spec)
    if s is not None:
        out += " ± " + _f(s * scale, spec)
    return out


def _p_str(tt):
    if tt is None:
        return "needs n>=2"
    if tt["p"] is None:
        return "no spread"
    p = tt["p"]
    mark = " *" if p < 0.01 else ""
    return (f"{p:.2e}" if p < 1e-3 else f"{p:.4f}") + mark


def format_report(result):
    target = result["target"]
    out = [f"target val loss: {target:.4f} ({result['target_source']})", ""]
    out.append("Runs (first eval = first val evaluation with val_loss <= target;"
               " interp = linear interpolation between the two evaluations around the crossing)")
    rows = []
    for g in result["groups"]:
        for r in g["runs"]:
            c = r["crossing"]
            rows.append([
                g["label"], r["run_id"][:12], _fmt_value(r["seed"]),
                _f(r["final_val_loss"]), f"{r['final_step']}/{r['num_iterations']}",
                _f(r["train_time_ms"] / 1000.0, ".1f"),
                c["step"] if c else "not reached",
                _f(c["time_ms"] / 1000.0, ".1f") if c else "-",
                _f(c["interp_step"], ".1f") if c else "-",
                _f(c["interp_time_ms"] / 1000.0, ".1f") if c else "-",
                r["excluded"] or r["stopped"] or "",
            ])
    out.append(format_table(
        ["group", "run_id", "seed", "final_val", "step", "time_s",
         "first_eval_step", "first_eval_s", "interp_step", "interp_s", "stopped"],
        rows, align="lllrrrrrrrl"))
    out.append("")
    out.append("Groups (mean ± sample std; steps/time to target over runs that reached it;"
               " p = one-sided t-test that mean final val < target, * = p < 0.01)")
    has_ratio = result["reference"] is not None
    rows = []
    for g in result["groups"]:
        row = [
            g["label"], str(g["n"]) + (f" ({g['n_nonfinite']} nan)" if g["n_nonfinite"] else "")
            + (f" (+{g['n_excluded']} excluded)" if g["n_excluded"] else ""),
            _pm(g["final_val_loss"]), _p_str(g["ttest"]),
            f"{g['n_reached']}/{g['n']}",
            _pm(g["steps_to_target"], ".1f"),
            _pm(g["interp_steps_to_target"], ".1f"),
            _pm(g["interp_time_ms_to_target"], ".1f", 1e-3),
        ]
        if has_ratio:
            cr = g.get("convergence_ratio")
            if cr is None:
                row += ["(reference)", ""]
            else:
                row += [_f(cr["steps"], ".3f"), _f(cr["time"], ".3f")]
        rows.append(row)
    headers = ["group", "n", "final_val", "p", "reached",
               "first_eval_steps", "interp_steps", "interp_time_s"]
    if has_ratio:
        headers += ["ratio_steps", "ratio_time"]
    out.append(format_table(headers, rows))
    if has_ratio:
        ref = result["reference"]
        out.append("")
        out.append(
            f"convergence ratio = mean interpolated steps (time) to reach {target:.4f} / "
            f"reference {ref['label']!r} mean final step {_f(ref['mean_final_step'], '.1f')} "
            f"(time {_f(ref['mean_final_time_ms'] / 1000.0, '.1f')} s); < 1 is faster")
    if result.get("race") and result["race"]["steps"]:
        rc = result["race"]
        labels = list(rc["curves"])
        out += ["", "Val loss at equal steps (mean over each group's counted runs)"]
        out.append(format_table(["step"] + labels, [[s] + [_f(rc["curves"][k][s]) for k in labels] for s in rc["steps"]],
                                align="r" * (len(labels) + 1)))
        out += ["", "Steps to reach the other's final val loss (first crossing / staying below from then on)"]
        for pr in rc["pairs"]:
            out.append(f"  {pr['group']} to {pr['other']}'s {pr['other_final']:.4f} (its step {pr['other_final_step']}): "
                       f"{pr['first_crossing'] if pr['first_crossing'] is not None else 'not reached'} / "
                       f"{pr['stays_below'] if pr['stays_below'] is not None else 'not reached'}")
    return "\n".join(out)


def _json_clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_clean(v) for v in x]
    return x


def to_json(result):
    return json.dumps(_json_clean(result), indent=2, sort_keys=False)


PLOT_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif", "tiff", "webp")


def _import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


def plot_groups(groups, target, out_path):
    """Val loss vs step and vs train time, one color per group, one thin line
    per run, dashed target line.  ``groups`` as returned by group_runs()."""
    plt = _import_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    ys = []
    for gi, g in enumerate(groups):
        color = colors[gi % len(colors)]
        for ri, log in enumerate(g["logs"]):
            pts = [v for v in log["val"] if math.isfinite(v["loss"])]
            if not pts:
                continue
            steps = [v["step"] for v in pts]
            times = [v["time_ms"] / 1000.0 for v in pts]
            losses = [v["loss"] for v in pts]
            ys += [v["loss"] for v in pts if v["step"] > 0]
            label = f"{g['label']} (n={len(g['logs'])})" if ri == 0 else None
            axes[0].plot(steps, losses, color=color, lw=0.9, alpha=0.75, label=label)
            axes[1].plot(times, losses, color=color, lw=0.9, alpha=0.75)
    for ax, xl in zip(axes, ["step", "train time (s)"]):
        ax.axhline(target, color="k", ls="--", lw=1.0,
                   label=f"target {target:.4f}" if ax is axes[0] else None)
        ax.set_xlabel(xl)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
        if ys:
            lo = min(min(ys), target)
            hi = max(max(ys), target)
            pad = 0.05 * (hi - lo) or 0.1
            ax.set_ylim(lo - pad, hi + pad)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

def expand_paths(patterns):
    """Expand files, directories (their *.txt) and globs; sorted, de-duplicated."""
    out, seen = [], set()
    for p in patterns:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.txt")))
        elif os.path.isfile(p):
            found = [p]
        else:
            found = sorted(f for f in glob.glob(p) if os.path.isfile(f))
        for f in found:
            key = os.path.abspath(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    ap = OneLineParser(
        prog="compare.py",
        description="Compare training runs from their log files (grouped by configuration).")
    ap.add_argument("logs", nargs="+", help="log files, directories or glob patterns")
    ap.add_argument("--target", type=float, default=DEFAULT_TARGET,
                    help=f"target val loss (default {DEFAULT_TARGET})")
    ap.add_argument("--target_from", default=None,
                    help="use the mean final val loss of the group matching this label "
                         "substring or key=value as the target; report convergence ratios")
    ap.add_argument("--group_by", default=None,
                    help="comma list of hyperparameter keys to group by (default: all but "
                         "seed/run_id)")
    ap.add_argument("--ignore", default=None,
                    help="comma list of extra hyperparameter keys to ignore when grouping")
    ap.add_argument("--plot", default=None, metavar="OUT.png",
                    help="write val loss vs step / vs time plot")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    return ap


def _error(msg, code=2):
    print(f"compare.py: error: {msg}", file=sys.stderr)
    return code


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not math.isfinite(args.target):
        return _error(f"--target must be a finite loss, not {args.target}")
    paths = expand_paths(args.logs)
    if not paths:
        return _error("no log files matched: " + " ".join(args.logs))
    logs, bad = [], []
    for p in paths:
        try:
            logs.append(parse_log(p))
        except LogError as e:
            bad.append(str(e))
    if not logs:
        return _error(bad[0] if len(bad) == 1 else
                      f"no usable logs ({len(bad)} files; first: {bad[0]})")
    for msg in bad:
        print(f"compare.py: warning: skipping {msg}", file=sys.stderr)
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
        result = compare(logs, target=args.target, group_by=_split_keys(args.group_by),
                         ignore=_split_keys(args.ignore), target_from=args.target_from)
    except ValueError as e:
        return _error(str(e))
    if args.plot:
        groups = group_runs(logs, group_by=_split_keys(args.group_by),
                            ignore=_split_keys(args.ignore))
        try:
            plot_groups(groups, result["target"], args.plot)
        except OSError as e:
            return _error(f"cannot write the plot {args.plot}: {e.strerror or e}", code=1)
        result["plot"] = args.plot
    if args.json:
        print(to_json(result))
    else:
        print(format_report(result))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
