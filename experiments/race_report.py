"""The headline table of a CPU race: vanilla against CPLM, group against group, over seeds.

    python experiments/race_report.py LOG_DIR --pair ROW=VANILLA_PREFIX:CPLM_PREFIX [--pair ...]
        [--fractions 0.25,0.5,1] [--out TABLE.md]
    python experiments/race_report.py LOG_DIR --sweep PREFIX_vanilla_lr,PREFIX_cplm_lr

A group is every log LOG_DIR/<prefix>_s<seed>.txt. For each pair (a row) it reports:
- final val loss of each mode, mean +- std over seeds;
- the gap at equal steps (vanilla minus CPLM: > 0 means CPLM is lower) at the given fractions of training,
  mean +- std of the per-seed differences where both modes ran the same seeds (same data order, so paired),
  and the one-sided p-value of "the gap is > 0" (paired t-test; Welch's t-test when the seeds differ);
- steps to targets: the targets are vanilla's mean val-loss curve (over seeds) at those fractions of its
  training (the last one is its final loss). Vanilla's steps are the first crossing of its mean curve, CPLM's
  the first crossing of each seed's curve (mean +- std), both interpolated linearly between evaluations; the
  ratio is CPLM's over vanilla's (< 1: CPLM gets there sooner);
- at the last evaluation: the NLL on copyable targets (the target occurs earlier in its document) and on
  the others, for both modes, and CPLM's mean gate lambda (share of probability on the copy path);
- the final val loss in bits per UTF-8 byte of the scored text, where the log's val shards can be read and
  their tokenizer says how many bytes each id stands for: a `tokenizer.json` (byte-level BPE) beside the
  shards, or the byte-level encoding (257 ids, 256 = BOS). Rows of different tokenizers score different
  units (a token of a 2k vocabulary is fewer bytes than one of a 32k vocabulary); bits per byte do not.
  They still score different lengths of text: the first val_tokens tokens of the same val documents.
  A summary table of every row comes first; a row whose modes ran different seeds is marked unpaired (its
  gap is the difference of the means, its p Welch's).
`--sweep` prints the final val loss of every learning-rate scale of each mode (seed 0), the basis of the
choice of each mode's best scale.
"""
import glob
import json
import math
import os
import re
import sys

import numpy as np

from cli import ROOT, OneLineParser  # experiments/cli.py

sys.path.insert(0, os.path.join(ROOT, "tools"))
import compare  # noqa: E402  (tools/compare.py: log parsing and the t distribution)
import train_gpt_cplm as tg  # noqa: E402  (the shard reader)

BYTE_LEVEL_VOCAB = 257  # data/tokenize_corpus.py --encoding bytes, data/prose_corpus.py 257: ids 0-255 are bytes


def load_group(log_dir, prefix):
    """{seed: parsed log} of the finished runs LOG_DIR/<prefix>_s<seed>.txt."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(log_dir, f"{glob.escape(prefix)}_s*.txt"))):
        m = re.fullmatch(re.escape(prefix) + r"_s(\d+)\.txt", os.path.basename(path))
        if not m:
            continue
        log = compare.parse_log(path)
        if log["val"][-1]["step"] == log["val"][-1]["total"]:  # finished runs only
            runs[int(m.group(1))] = log
    return runs


def loss_at(log, step):
    """Val loss at `step`, interpolated linearly between the two evaluations around it."""
    val = log["val"]
    for prev, cur in zip(val, val[1:]):
        if prev["step"] <= step <= cur["step"]:
            frac = (step - prev["step"]) / (cur["step"] - prev["step"])
            return prev["loss"] + frac * (cur["loss"] - prev["loss"])
    return val[-1]["loss"] if step >= val[-1]["step"] else val[0]["loss"]


def mean_curve(logs):
    """The seeds' mean val-loss curve, as a log with only "val" (the runs share their evaluation steps)."""
    runs = list(logs.values())
    steps = [v["step"] for v in runs[0]["val"]]
    if any([v["step"] for v in log["val"]] != steps for log in runs):
        raise compare.LogError("the runs of a group were evaluated at different steps")
    return {"val": [dict(step=s, time_ms=0, loss=sum(log["val"][i]["loss"] for log in runs) / len(runs))
                    for i, s in enumerate(steps)]}


def token_byte_lengths(shard_dir, vocab_size):
    """UTF-8 bytes each id stands for (special tokens: 0; -1: an id the tokenizer lacks), or None if the
    tokenizer is not one this can count. A byte-level BPE's vocabulary entries spell bytes one character each
    (GPT-2's byte-to-unicode map), so an entry's length is its byte count, as long as nothing rewrites the
    text (a normalizer) or marks pieces (subword prefixes, suffixes, byte fallback)."""
    path = os.path.join(shard_dir, "tokenizer.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        model = spec.get("model") or {}
        if ((spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel" or model.get("type") != "BPE"
                or spec.get("normalizer") or model.get("byte_fallback") or model.get("continuing_subword_prefix")
                or model.get("end_of_word_suffix")):
            return None
        lengths = np.full(vocab_size, -1, dtype=np.int64)
        for piece, i in model["vocab"].items():
            lengths[i] = len(piece)
        for added in spec.get("added_tokens", []):
            lengths[added["id"]] = 0 if added.get("special") else len(added["content"].encode("utf-8"))
        return lengths
    if vocab_size == BYTE_LEVEL_VOCAB:
        return np.array([1] * 256 + [0], dtype=np.int64)
    return None


_BYTES_PER_TOKEN = {}


def bytes_per_token(log):
    """Mean UTF-8 bytes per scored val target of a run (its first val_tokens + 1 val tokens, less the first,
    as `evaluate` scores them), or None where its shards or tokenizer cannot be read."""
    h = log.get("hyperparameters") or {}
    if "val_files" not in h or "val_tokens" not in h:
        return None
    pattern = h["val_files"] if os.path.isabs(h["val_files"]) else os.path.join(ROOT, h["val_files"])
    key = (pattern, h["val_tokens"])
    if key not in _BYTES_PER_TOKEN:
        try:
            vocab_size = tg.run_files.header_vocab_size([pattern])
            lengths = token_byte_lengths(os.path.dirname(pattern), vocab_size) if vocab_size else None
            if lengths is None:
                _BYTES_PER_TOKEN[key] = None
            else:
                per_target = lengths[tg.load_val_tokens(pattern, h["val_tokens"], vocab_size)[1:].numpy()]
                # a target the tokenizer does not know: its bytes are unknown, so is the whole count
                _BYTES_PER_TOKEN[key] = None if (per_target < 0).any() else float(per_target.mean())
        except (tg.DataError, OSError, ValueError, KeyError, IndexError, AttributeError, TypeError):
            _BYTES_PER_TOKEN[key] = None  # unreadable shards or tokenizer: the report goes on without bits per byte
    return _BYTES_PER_TOKEN[key]


def bpb_known(*groups):
    """Whether every run of the groups has a final val loss in bits per byte."""
    return all(final_bpb(log) is not None for logs in groups for log in logs.values())


def final_bpb(log):
    """The final val loss in bits per byte: nats per target / (ln 2 x bytes per target)."""
    b = bytes_per_token(log)
    return None if not b else log["val"][-1]["loss"] / (math.log(2) * b)


def steps_to(log, target):
    crossing = compare.target_crossing(log["val"], target)
    return crossing["interp_step"] if crossing else None


def gap_test(vanilla, cplm, values, cplm_values=None):
    """Mean +- std of vanilla - CPLM of values(log) (cplm_values(log) for CPLM's logs, if given) over seeds
    and the one-sided p of "gap > 0": paired over the common seeds when both modes ran the same seeds, else
    Welch's two-sample test."""
    cplm_values = cplm_values or values
    common = sorted(set(vanilla) & set(cplm))
    if common and len(common) == len(vanilla) == len(cplm):
        diffs = [values(vanilla[s]) - cplm_values(cplm[s]) for s in common]
        m, sd = compare.mean_std(diffs)
        if sd is None:
            return m, None, None
        if sd == 0:
            return m, sd, 0.0 if m > 0 else 1.0
        return m, sd, compare.students_t_sf(m / (sd / math.sqrt(len(diffs))), len(diffs) - 1)
    a, b = [values(x) for x in vanilla.values()], [cplm_values(x) for x in cplm.values()]
    (ma, sa), (mb, sb) = compare.mean_std(a), compare.mean_std(b)
    if sa is None or sb is None:
        return ma - mb, None, None
    va, vb = sa * sa / len(a), sb * sb / len(b)
    if va + vb == 0:
        return ma - mb, 0.0, 0.0 if ma > mb else 1.0
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    sd_of_diff = math.sqrt(sa * sa + sb * sb)  # the spread of one seed's difference, comparable to the paired std
    return ma - mb, sd_of_diff, compare.students_t_sf((ma - mb) / math.sqrt(va + vb), df)


def pm(m, sd, spec=".3f"):
    if m is None:
        return "-"
    return f"{m:{spec}}" + (f" +- {sd:{spec}}" if sd is not None else "")


def p_str(p):
    return "-" if p is None else (f"{p:.1e}" if p < 1e-3 else f"{p:.3f}")


def last_diag(log, key):
    diags = [d for d in log["diagnostics"] if key in d]
    return diags[-1][key] if diags else None


def mean_of(logs, fn):
    values = [fn(x) for x in logs.values()]
    return compare.mean_std([v for v in values if v is not None]) if all(v is not None for v in values) else (None, None)


def row_report(name, vanilla, cplm, fractions):
    total = vanilla[min(vanilla)]["val"][-1]["total"]
    minutes = [sum(log["val"][-1]["time_ms"] for log in logs.values()) / 60000 for logs in (vanilla, cplm)]
    lines = [f"### {name}: vanilla seeds {sorted(vanilla)}, CPLM seeds {sorted(cplm)}, {total} steps", "",
             f"Compute: {minutes[0]:.0f} min of training for vanilla, {minutes[1]:.0f} for CPLM (all seeds, one "
             "thread each, two runs sharing the 2 cores; evaluation and compilation not counted).", ""]
    lines += ["| | vanilla | CPLM | vanilla - CPLM | p (gap > 0) |", "|---|---|---|---|---|"]
    for frac in fractions:
        step = round(frac * total)
        m, sd, p = gap_test(vanilla, cplm, lambda log: loss_at(log, step))
        lines.append(f"| val loss at step {step} | {pm(*mean_of(vanilla, lambda log: loss_at(log, step)))} | "
                     f"{pm(*mean_of(cplm, lambda log: loss_at(log, step)))} | {pm(m, sd)} | {p_str(p)} |")
    if bpb_known(vanilla, cplm):
        m, sd, p = gap_test(vanilla, cplm, final_bpb)
        lines.append(f"| final val loss, bits per byte | {pm(*mean_of(vanilla, final_bpb))} | "
                     f"{pm(*mean_of(cplm, final_bpb))} | {pm(m, sd)} | {p_str(p)} |")
    for key, label in (("nll_copyable", "final NLL, copyable targets"), ("nll_other", "final NLL, other targets")):
        if any(last_diag(log, key) is None for log in [*vanilla.values(), *cplm.values()]):
            continue  # a log without the copy diagnostics
        m, sd, p = gap_test(vanilla, cplm, lambda log: last_diag(log, key))
        lines.append(f"| {label} | {pm(*mean_of(vanilla, lambda log: last_diag(log, key)))} | "
                     f"{pm(*mean_of(cplm, lambda log: last_diag(log, key)))} | {pm(m, sd)} | {p_str(p)} |")
    lines.append(f"| final mean gate lambda | | {pm(*mean_of(cplm, lambda log: last_diag(log, 'lam')))} | | |")
    if all(last_diag(log, "gate_cost_other") is not None for log in cplm.values()):
        # on a target with nothing to copy CPLM's NLL is -log(1 - lambda) - log p_LM(y | not <copy>): the gate's
        # cost plus the LM head's own loss, which compares with vanilla's NLL there; a gated run in the vanilla
        # column (the pointer sentinel) has its gate's cost taken off too: like for like
        lm_own = lambda log: last_diag(log, "nll_other") - (last_diag(log, "gate_cost_other") or 0.0)  # noqa: E731
        lines.append(f"| other targets: lambda | | {pm(*mean_of(cplm, lambda log: last_diag(log, 'lam_other')))} | | |")
        lines.append(f"| other targets: gate cost -log(1 - lambda) | | "
                     f"{pm(*mean_of(cplm, lambda log: last_diag(log, 'gate_cost_other')))} | | |")
        m, sd, p = gap_test(vanilla, cplm, lm_own)
        lines.append(f"| other targets: LM head's own NLL (NLL - gate cost, where there is a gate) | "
                     f"{pm(*mean_of(vanilla, lm_own))} | {pm(*mean_of(cplm, lm_own))} | {pm(m, sd)} | {p_str(p)} |")
    lines.append(f"| copy share of val targets | {pm(*mean_of(vanilla, lambda log: last_diag(log, 'copy_share')))} |"
                 " | | |")
    lines += ["", "| target (vanilla's mean loss at) | target | vanilla steps | CPLM steps | CPLM / vanilla |",
              "|---|---|---|---|---|"]
    vanilla_mean = mean_curve(vanilla)
    for frac in fractions:
        step = round(frac * total)
        target = loss_at(vanilla_mean, step)
        v_steps = steps_to(vanilla_mean, target)
        c_steps = [steps_to(log, target) for log in cplm.values()]
        if None in c_steps:
            c_cell, ratio = f"{sum(s is not None for s in c_steps)}/{len(c_steps)} seeds reach it", None
        else:
            c_mean, c_sd = compare.mean_std(c_steps)
            c_cell, ratio = pm(c_mean, c_sd, ".0f"), c_mean / v_steps
        lines.append(f"| step {step} | {target:.4f} | {v_steps:.0f} | {c_cell} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    return lines


def overview(rows):
    """One line per row: final val loss in nats per token and in bits per byte, the gap and its share of
    vanilla's loss (paired over seeds as in the row's own table)."""
    final = lambda log: log["val"][-1]["loss"]  # noqa: E731
    lines = ["| row | seeds | bytes / token | final loss, vanilla / CPLM (nats per token) | gap | p (gap > 0) | "
             "bits per byte, vanilla / CPLM | gap (bits per byte) | gap / vanilla |", "|---|---|---|---|---|---|---|---|---|"]
    for name, vanilla, cplm in rows:
        m, sd, p = gap_test(vanilla, cplm, final)
        seeds = (",".join(map(str, sorted(vanilla))) if sorted(vanilla) == sorted(cplm) else
                 f"vanilla {','.join(map(str, sorted(vanilla)))}, CPLM {','.join(map(str, sorted(cplm)))} (unpaired)")
        cells = [name, seeds, "-",
                 f"{pm(*mean_of(vanilla, final))} / {pm(*mean_of(cplm, final))}", pm(m, sd), p_str(p), "-", "-", "-"]
        if bpb_known(vanilla, cplm):
            bm, bsd, _ = gap_test(vanilla, cplm, final_bpb)
            per_token = sorted({round(bytes_per_token(log), 2) for logs in (vanilla, cplm) for log in logs.values()})
            v_bpb = mean_of(vanilla, final_bpb)
            cells[2] = " / ".join(f"{b:.2f}" for b in per_token)
            cells[6:] = [f"{pm(*v_bpb)} / {pm(*mean_of(cplm, final_bpb))}", pm(bm, bsd), f"{100 * bm / v_bpb[0]:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def sweep_report(log_dir, prefixes):
    lines = ["| run | final val loss (seed 0) |", "|---|---|"]
    for prefix in prefixes:
        for path in sorted(glob.glob(os.path.join(log_dir, f"{glob.escape(prefix)}*_s0.txt"))):
            log = compare.parse_log(path)
            done = log["val"][-1]["step"] == log["val"][-1]["total"]
            lines.append(f"| {os.path.basename(path)[:-4]} | {log['val'][-1]['loss']:.4f}"
                         f"{'' if done else ' (unfinished, step %d)' % log['val'][-1]['step']} |")
    return lines


def main(argv=None):
    p = OneLineParser(prog="race_report.py", description=__doc__.splitlines()[0])
    p.add_argument("log_dir")
    p.add_argument("--pair", action="append", default=[], help="ROW=VANILLA_PREFIX:CPLM_PREFIX")
    p.add_argument("--sweep", default="", help="comma list of run-name prefixes (before the scale)")
    p.add_argument("--fractions", default="0.25,0.5,1")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if not os.path.isdir(args.log_dir):
        p.error(f"{args.log_dir} is not a directory")
    try:
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        p.error(f"--fractions must be numbers separated by commas (got {args.fractions!r})")
    if not all(0 < f <= 1 for f in fractions):
        p.error(f"--fractions must lie in (0, 1] (got {args.fractions})")
    if not args.pair and not args.sweep:
        p.error("give --pair or --sweep")
    lines, rows = [], []
    if args.sweep:
        lines += sweep_report(args.log_dir, args.sweep.split(",")) + [""]
    for spec in args.pair:
        # the row's name may hold "=" ("V = 2048 (V/D = 16)"): the prefixes come after its last one
        m = re.fullmatch(r"(.+)=([^=:]+):([^=:]+)", spec)
        if not m:
            p.error(f"--pair must look like ROW=VANILLA_PREFIX:CPLM_PREFIX (got {spec!r})")
        name, v_prefix, c_prefix = m.groups()
        try:
            vanilla, cplm = load_group(args.log_dir, v_prefix), load_group(args.log_dir, c_prefix)
        except compare.LogError as e:
            print(f"race_report.py: error: {e}", file=sys.stderr)
            return 1
        if not vanilla or not cplm:
            missing = v_prefix if not vanilla else c_prefix
            print(f"race_report.py: error: no finished runs {args.log_dir}/{missing}_s*.txt", file=sys.stderr)
            return 1
        lines += row_report(name, vanilla, cplm, fractions) + [""]
        rows.append((name, vanilla, cplm))
    if rows:
        lines = overview(rows) + [""] + lines
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
