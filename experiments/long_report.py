"""The long pair's read-out: the gap over training, beside vanilla's induction probe and the test slice.

    python experiments/long_report.py [--out records/prose_long/report]

Reads the two logs of records/prose_long (every validation: val loss, copyable and other targets, CPLM's
lambda), and where they exist the outputs of `experiments/mechanism.py induction` (records/prose_long/
induction.json) and `experiments/test_slice.py` (records/prose_long/test_slice.json) on the runs' checkpoints.
Writes OUT.md (one row per validation step both runs have reached) and OUT.png (both curves; the gap, over all
targets, copyable and other, on the validation slice and at each checkpoint on the test slice, alone and with
the neural cache, with vanilla's induction score beside it), and prints the table. A run still in
progress is read as far as it got; a log resumed from a checkpoint repeats some steps: the last line wins.

Convergence at each of vanilla's validation steps S (CPLM's steps to reach vanilla's val loss at S, over S):
first crossing = the first validation at or below it; staying below = the first from which every later
validation stays at or below it (up to CPLM's last one so far).
"""
import json
import os
import re
import sys

from cli import ROOT, OneLineParser  # experiments/cli.py

LOGS = "records/prose_long/logs"
VANILLA, CPLM = "prose_long_vanilla_lr0.5_s0", "prose_long_cplm_lr0.5_s0"


def read_log(path):
    """{step: {"val_loss", "nll_copyable", "nll_other", "copy_share", "lam"?}} of a training log."""
    rows = {}
    for m in re.finditer(r"^step:(\d+)/\d+ ((?:val_loss|copy_share):.*)$", open(path).read(), re.M):
        fields = dict(kv.split(":", 1) for kv in m[2].split())
        rows.setdefault(int(m[1]), {}).update(
            {k: float(v) for k, v in fields.items() if k not in ("train_time", "step_avg")})
    return {s: r for s, r in rows.items() if "val_loss" in r}


def crossings(reference_loss, curve):
    """(first crossing, staying below) steps of curve {step: loss} for a target loss; None when not (yet)."""
    steps = sorted(curve)
    first = next((s for s in steps if curve[s] <= reference_loss), None)
    stays = None
    for s in reversed(steps):
        if curve[s] > reference_loss:
            break
        stays = s
    return first, stays


def induction_by_step(path):
    """{(mode, step): (max prefix score over vanilla's heads, nll of the repeated copy)} from mechanism.py's json."""
    if not os.path.exists(path):
        return {}
    out = {}
    for r in json.load(open(path))["results"]:
        prefix = max((p for layer in r["prefix"] for p in layer if p is not None), default=float("nan"))
        out[(r["mode"], r["step"])] = (prefix, r["nll_first_copy"], r["nll_second_copy"])
    return out


def test_slice_by_step(path):
    if not os.path.exists(path):
        return {}
    return {(r["mode"], r["step"]): r for r in json.load(open(path))["records"]}


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def report(vanilla, cplm, induction, test_slice, command):
    steps = sorted(set(vanilla) & set(cplm))
    v_curve = {s: r["val_loss"] for s, r in vanilla.items()}
    c_curve = {s: r["val_loss"] for s, r in cplm.items()}
    lines = [f"    {command}", "",
             "| step | vanilla | CPLM | gap | gap, copyable | gap, other | CPLM lambda | CPLM reaches vanilla's loss "
             "here (first / stays below) | vanilla: max prefix score, nll 1st / 2nd copy | test slice: vanilla, "
             "+ neural cache, CPLM |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for s in steps:
        v, c = vanilla[s], cplm[s]
        first, stays = crossings(v["val_loss"], c_curve)
        ind = induction.get(("vanilla", s))
        tv, tc = test_slice.get(("vanilla", s)), test_slice.get(("cplm", s))
        conv = (f"{first} / {stays if stays is not None else 'not yet'}" if first is not None else "not yet") + (
            f" ({first / s:.2f}x / {stays / s:.2f}x)" if s and first is not None and stays is not None else "")
        rows.append({"step": s, "vanilla": v["val_loss"], "cplm": c["val_loss"], "gap": v["val_loss"] - c["val_loss"],
                     "gap_copyable": v.get("nll_copyable", float("nan")) - c.get("nll_copyable", float("nan")),
                     "gap_other": v.get("nll_other", float("nan")) - c.get("nll_other", float("nan")),
                     "first": first, "stays": stays, "induction": ind})
        r = rows[-1]
        lines.append(
            f"| {s} | {v['val_loss']:.4f} | {c['val_loss']:.4f} | {r['gap']:.3f} | {r['gap_copyable']:.3f} | "
            f"{r['gap_other']:.3f} | {fmt(c.get('lam'))} | {conv if s else '-'} | "
            f"{'-' if ind is None else f'{ind[0]:.2f}, {ind[1]:.2f} / {ind[2]:.2f}'} | "
            f"{'-' if tv is None else fmt(tv['test']['loss'])}, "
            f"{'-' if tv is None or 'cache' not in tv else fmt(tv['cache']['loss'])}, "
            f"{'-' if tc is None else fmt(tc['test']['loss'])} |")
    lines += ["", f"Vanilla validated to step {max(v_curve)}, CPLM to step {max(c_curve)}; val loss on the first 32Ki "
              "val tokens (the tuning slice). Gap = vanilla - CPLM, nats per token."]
    return "\n".join(lines) + "\n", rows


def plot(rows, vanilla, cplm, induction, test_slice, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, log in (("vanilla", vanilla), ("CPLM", cplm)):
        steps = sorted(s for s in log if s > 0)
        top.plot(steps, [log[s]["val_loss"] for s in steps], marker=".", label=name)
    top.set_ylabel("val loss (nats/token)")
    top.legend()
    top.grid(alpha=0.3)
    steps = [r["step"] for r in rows if r["step"] > 0]
    for key, label in (("gap", "all targets"), ("gap_copyable", "copyable"), ("gap_other", "other")):
        bottom.plot(steps, [r[key] for r in rows if r["step"] > 0], marker=".", label=f"gap, {label}")
    both = sorted(s for (mode, s) in test_slice if mode == "vanilla" and ("cplm", s) in test_slice)

    def scored(part):  # vanilla's test loss (alone or cached) minus CPLM's, at each checkpoint both have
        return [test_slice[("vanilla", s)][part]["loss"] - test_slice[("cplm", s)]["test"]["loss"]
                for s in both if part in test_slice[("vanilla", s)]]
    if both:  # the held-out test slice, every checkpoint
        bottom.plot(both, scored("test"), color="black", marker="s", ms=4, label="test slice: vanilla - CPLM")
        cached = scored("cache")
        if len(cached) == len(both):
            bottom.plot(both, cached, color="black", ls=":", marker="^", ms=4,
                        label="test slice: vanilla + neural cache - CPLM")
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("vanilla - CPLM (nats/token)")
    bottom.grid(alpha=0.3)
    probe = sorted((s, v[0]) for (mode, s), v in induction.items() if mode == "vanilla")
    if probe:
        twin = bottom.twinx()
        twin.plot([s for s, _ in probe], [p for _, p in probe], color="gray", ls="--", marker="x",
                  label="vanilla: max prefix-matching score")
        twin.set_ylabel("max prefix-matching score", color="gray")
        twin.set_ylim(0, 1)
        twin.legend(loc="upper left", fontsize=8)
    low, high = bottom.get_ylim()
    bottom.set_ylim(low, high + 0.6 * (high - low))  # room above the curves for the legends
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = OneLineParser(prog="long_report.py", description=__doc__.splitlines()[0])
    p.add_argument("--vanilla", default=os.path.join(LOGS, VANILLA + ".txt"))
    p.add_argument("--cplm", default=os.path.join(LOGS, CPLM + ".txt"))
    p.add_argument("--induction", default="records/prose_long/induction.json")
    p.add_argument("--test_slice", default="records/prose_long/test_slice.json")
    p.add_argument("--out", default="records/prose_long/report", help="writes OUT.md and OUT.png")
    args = p.parse_args(argv)
    where = lambda x: x if os.path.isabs(x) else os.path.join(ROOT, x)  # noqa: E731
    for flag in ("vanilla", "cplm"):
        if not os.path.isfile(where(getattr(args, flag))):
            p.error(f"--{flag} {getattr(args, flag)}: no such log")
    vanilla, cplm = read_log(where(args.vanilla)), read_log(where(args.cplm))
    if not vanilla or not cplm:
        p.error("a log has no validation line yet")
    induction, test_slice = induction_by_step(where(args.induction)), test_slice_by_step(where(args.test_slice))
    command = "python experiments/long_report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text, rows = report(vanilla, cplm, induction, test_slice, command.strip())
    os.makedirs(os.path.dirname(where(args.out)) or ".", exist_ok=True)
    with open(where(args.out) + ".md", "w") as f:
        f.write(text)
    try:
        plot(rows, vanilla, cplm, induction, test_slice, where(args.out) + ".png")
    except ImportError:
        print("long_report.py: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
