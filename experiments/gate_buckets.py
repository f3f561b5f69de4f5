"""Where CPLM gains and where it loses, token by token: the val NLL of a vanilla and a CPLM checkpoint on the
same tokens, bucketed by CPLM's copy gate c_t and by whether the target can be copied.

    python experiments/gate_buckets.py --pair VANILLA.pt:CPLM.pt [--pair ...] [--tokens 32768] [--out T.md]

The paper reports that "NLL drops even on tokens where the copy gate is near 0": CPLM would then be better
than vanilla in the lowest gate bucket, where the copy path adds (almost) nothing to p(y) and only the LM
head's own prediction counts. On a target with nothing to copy, CPLM's NLL is -log(1 - lambda_t) (the gate's
cost) plus the LM head's own -log p(y | not <copy>); the table splits the two.

Each pair (one seed of each mode, trained on the same data) is evaluated on the first --tokens val tokens of
the checkpoints' own val files, in rows of their val_seq_len, at the attention window of their last step.
Buckets are the CPLM model's gate c_t = p_full(<copy>) at each target. Per bucket: the share of tokens, the
share that are copyable, both models' mean NLL and the gap (vanilla - CPLM > 0: CPLM better), mean +- std
over the pairs.
"""
import math
import sys

import torch

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path

import train_gpt_cplm as tg  # noqa: E402
import inference  # noqa: E402

GATE_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0)  # c_t buckets: closed, nearly closed, partly open, mostly open


@torch.no_grad()
def token_stats(model, a, tokens):
    """Per-token nll, copyable and (CPLM) c and lam over the rows of `tokens`, each flattened."""
    window = torch.tensor(tg.window_blocks(a.num_iterations, a), dtype=torch.int32)
    out = {}
    for i in range(len(tokens) // a.val_seq_len):
        row = tokens[i * a.val_seq_len:(i + 1) * a.val_seq_len + 1]
        stats = model(row[None, :-1], row[None, 1:], window, token_stats=True)
        for key, value in stats.items():
            out.setdefault(key, []).append(value.flatten().double())
    return {key: torch.cat(values) for key, values in out.items()}


def bucket_table(vanilla, cplm, edges=GATE_EDGES):
    """One pair's rows: per gate bucket, the token share, copyable share, both NLLs, CPLM's gate cost and
    LM-own NLL on the non-copyable targets."""
    rows = []
    n = len(cplm["c"])
    for lo, hi in zip(edges, edges[1:]):
        inside = (cplm["c"] >= lo) & ((cplm["c"] < hi) if hi < 1 else (cplm["c"] <= hi))
        other = inside & ~cplm["copyable"].bool()
        gate_cost = -torch.log1p(-cplm["lam"][other])
        rows.append(dict(bucket=f"[{lo:g}, {hi:g}{']' if hi == 1 else ')'}", share=inside.sum().item() / n,
                         copyable=cplm["copyable"][inside].double().mean().item() if inside.any() else math.nan,
                         vanilla=vanilla["nll"][inside].mean().item() if inside.any() else math.nan,
                         cplm=cplm["nll"][inside].mean().item() if inside.any() else math.nan,
                         other_vanilla=vanilla["nll"][other].mean().item() if other.any() else math.nan,
                         other_gate_cost=gate_cost.mean().item() if other.any() else math.nan,
                         other_cplm_lm=(cplm["nll"][other] + torch.log1p(-cplm["lam"][other])).mean().item()
                         if other.any() else math.nan))
    return rows


def pm(values, spec=".3f"):
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    m = sum(values) / len(values)
    if len(values) < 2:
        return f"{m:{spec}}"
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{m:{spec}} +- {sd:{spec}}"


def format_tables(tables, pairs, num_tokens):
    lines = [f"{len(pairs)} pair(s), {num_tokens} val tokens each; mean +- std over the pairs",
             *[f"- {v} : {c}" for v, c in pairs], "",
             "| CPLM gate c_t | share of tokens | copyable | vanilla NLL | CPLM NLL | vanilla - CPLM |",
             "|---|---|---|---|---|---|"]
    for i, bucket in enumerate(t["bucket"] for t in tables[0]):
        r = [t[i] for t in tables]
        lines.append(f"| {bucket} | {pm([x['share'] for x in r])} | {pm([x['copyable'] for x in r])} | "
                     f"{pm([x['vanilla'] for x in r])} | {pm([x['cplm'] for x in r])} | "
                     f"{pm([x['vanilla'] - x['cplm'] for x in r])} |")
    lines += ["", "Non-copyable targets only: CPLM's NLL = gate cost -log(1 - lambda) + the LM head's own NLL", "",
              "| CPLM gate c_t | vanilla NLL | CPLM gate cost | CPLM LM-own NLL | vanilla - CPLM LM-own |",
              "|---|---|---|---|---|"]
    for i, bucket in enumerate(t["bucket"] for t in tables[0]):
        r = [t[i] for t in tables]
        lines.append(f"| {bucket} | {pm([x['other_vanilla'] for x in r])} | {pm([x['other_gate_cost'] for x in r])} | "
                     f"{pm([x['other_cplm_lm'] for x in r])} | "
                     f"{pm([x['other_vanilla'] - x['other_cplm_lm'] for x in r])} |")
    return "\n".join(lines)


def main(argv=None):
    p = OneLineParser(prog="gate_buckets.py", description=__doc__.splitlines()[0])
    p.add_argument("--pair", action="append", required=True, help="VANILLA.pt:CPLM.pt, one per seed")
    p.add_argument("--tokens", type=int, default=32768, help="val tokens (default 32768, the race's)")
    p.add_argument("--out", default="", help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1 (got {args.tokens})")
    pairs = []
    for spec in args.pair:
        if spec.count(":") != 1:
            p.error(f"--pair must be VANILLA.pt:CPLM.pt (got {spec!r})")
        pairs.append(tuple(spec.split(":")))
    torch.set_num_threads(1)
    tables = []
    try:
        for v_path, c_path in pairs:
            (vanilla, va, _), (cplm, ca, _) = inference.load_model(v_path), inference.load_model(c_path)
            if va.cplm or not ca.cplm or ca.copy_gate != "lm":
                raise tg.DataError(f"--pair {v_path}:{c_path}: the first must be a vanilla checkpoint, the second "
                                   "a CPLM one with the paper's <copy> gate (not --copy_gate sentinel)")
            if (va.val_files, va.val_seq_len, va.vocab_size) != (ca.val_files, ca.val_seq_len, ca.vocab_size):
                raise tg.DataError(f"--pair {v_path}:{c_path}: the two runs were validated on different data")
            tokens = tg.load_val_tokens(ca.val_files, args.tokens, ca.vocab_size)
            if len(tokens) < ca.val_seq_len + 1:
                raise tg.DataError(f"--tokens {args.tokens}: less than one val row of {ca.val_seq_len}")
            tables.append(bucket_table(token_stats(vanilla, va, tokens), token_stats(cplm, ca, tokens)))
    except tg.DataError as e:
        print(f"gate_buckets.py: error: {e}", file=sys.stderr)
        return 1
    text = format_tables(tables, pairs, args.tokens)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
