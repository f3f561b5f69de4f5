"""What the CP head costs on CPU, measured in one run.

    python experiments/cp_cost.py step_time [--steps 20]   # cpu preset: CPLM / vanilla step time, median
    python experiments/cp_cost.py memory [--lengths 4096,16384]   # peak memory of the CP loss vs a naive one
    python experiments/cp_cost.py parameters   # the CP head's parameter count and share, per preset

step_time builds both models from the same seed and alternates their training steps (forward, backward,
optimizer) on the same real batches, so both see the same machine load; the ratio is of medians.
memory runs every (implementation, length) in a fresh subprocess and reports its peak RSS above the
process's baseline: the chunked dense path of train_gpt_cplm (what the CPU trains with) against a naive
dense one that builds the full (T, T) score and mask matrices.
"""
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path

import train_gpt_cplm as tg  # noqa: E402


def step_time(args):
    hp = tg.resolve_vocabulary(tg.parse_args(["--preset", "cpu"] + args.extra))
    loader = tg.TrainLoader(hp.train_files, hp.batch_size, hp.seq_len, 0, 1, hp.vocab_size)
    tg.use_heap_for_large_tensors()  # as train_gpt_cplm.main does on CPU; after the checks, as it is process-wide
    models, optimizers = {}, {}
    for mode in (0, 1):
        torch.manual_seed(hp.seed)
        models[mode] = tg.GPT(tg.GPTConfig.from_args(tg.dataclasses.replace(hp, cplm=mode)))
        optimizers[mode] = tg.build_optimizers(models[mode], tg.dataclasses.replace(hp, cplm=mode), 0, 1)
    times = {0: [], 1: []}
    for step in range(args.steps + 2):
        batch = loader.next_batch("cpu")
        for mode in ((0, 1) if step % 2 == 0 else (1, 0)):  # alternate who goes first
            t0 = time.perf_counter()
            for inputs, targets in batch:
                (models[mode](inputs, targets) / len(batch)).backward()
            for opt in optimizers[mode]:
                opt.step()
            models[mode].zero_grad(set_to_none=True)
            if step >= 2:  # the first steps warm the allocator
                times[mode].append(time.perf_counter() - t0)
    result = {"preset": "cpu", "tokens_per_step": hp.batch_size, "steps": args.steps, "threads": torch.get_num_threads(),
              "vanilla_median_ms": 1000 * statistics.median(times[0]), "cplm_median_ms": 1000 * statistics.median(times[1]),
              "vanilla_ms": [round(1000 * t, 1) for t in times[0]], "cplm_ms": [round(1000 * t, 1) for t in times[1]]}
    result["ratio"] = result["cplm_median_ms"] / result["vanilla_median_ms"]
    # the per-step ratio (CPLM's step over vanilla's in the same pair of steps): its spread says how stable it is
    pair_ratios = sorted(c / v for v, c in zip(times[0], times[1]))
    result["pair_ratio_quartiles"] = [round(statistics.quantiles(pair_ratios, n=4)[i], 3) for i in (0, 2)]

    def spread(ms):
        q = statistics.quantiles(ms, n=4)
        return f"median {statistics.median(ms):.0f} ms, quartiles {q[0]:.0f}-{q[2]:.0f}, range {min(ms):.0f}-{max(ms):.0f}"
    print(json.dumps(result))
    print(f"train files: {hp.train_files}")
    print(f"vanilla: {spread([1000 * t for t in times[0]])}")
    print(f"cplm:    {spread([1000 * t for t in times[1]])}")
    print(f"cpu preset step time: vanilla {result['vanilla_median_ms']:.0f} ms, cplm {result['cplm_median_ms']:.0f} ms "
          f"(medians of {args.steps}); cplm/vanilla = {result['ratio']:.3f} (per-pair ratio quartiles "
          f"{result['pair_ratio_quartiles'][0]:.3f}-{result['pair_ratio_quartiles'][1]:.3f})")


def parameters(args):
    for preset in ("speedrun", "cpu"):
        hp = tg.parse_args(["--preset", preset, "--cplm", "1", "--vocab_size", str(tg.GPT2_VOCAB_SIZE),
                            "--bos_id", str(tg.GPT2_VOCAB_SIZE - 1)])
        with torch.device("meta"):  # counts only: no memory
            model = tg.GPT(tg.GPTConfig.from_args(hp))
        total = sum(p.numel() for p in model.parameters())
        cp = sum(p.numel() for p in model.cp_head.parameters()) + model.copy_logit_bias.numel()
        tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
        print(f"{preset}: {total:,} parameters, {total - tables:,} outside the embedding tables; CP head + <copy> "
              f"bias {cp:,} = {100 * cp / total:.3f}% of all, {100 * cp / (total - tables):.3f}% of the rest")


def naive_copy_lses(q, k, input_ids, target_ids, doc_ids):
    """The same two LSEs with full (T, T) matrices: what the chunked path avoids."""
    T = q.size(1)
    scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    doc_causal = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    match = doc_causal & (input_ids[:, None, :] == target_ids[:, :, None])
    lse_match = scores.masked_fill(~match, float("-inf")).logsumexp(-1)
    return scores.masked_fill(~doc_causal, float("-inf")).logsumexp(-1), lse_match


def measure_one(impl, T):
    """Peak RSS (MiB) of one forward + backward of the CP log-sum-exps above the inputs' baseline."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3000, (1, T), generator=g)
    ids[0, ::2048] = 50256  # documents of 2048 tokens
    targets = torch.roll(ids, -1, 1)
    doc_ids = tg.doc_ids_of(ids, 50256)
    copyable = tg.target_in_context(ids, targets, doc_ids, 50304)
    q, k = (torch.randn(1, T, 64, generator=g).requires_grad_() for _ in range(2))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if impl == "chunked":
        lse_doc, lse_match = tg.copy_lses(q, k, ids, targets, doc_ids, copyable, "dense")
    else:
        lse_doc, lse_match = naive_copy_lses(q, k, ids, targets, doc_ids)
    # rows with nothing to copy drop out, as in the loss (the naive path's gradient there would be NaN)
    lse_match = torch.where(copyable, lse_match, 0.0)
    (lse_doc.sum() + lse_match.sum()).backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"impl": impl, "T": T, "peak_mib_above_baseline": (peak - base) / 1024, "seconds": seconds}))


def memory(args):
    rows = []
    for T in args.lengths:
        for impl in ("chunked", "naive"):
            out = subprocess.run([sys.executable, __file__, "_measure", impl, str(T)], capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(out.stderr)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]))
    print(f"{'T':>6} {'chunked MiB':>12} {'naive MiB':>10} {'chunked s':>10} {'naive s':>8}")
    for T in sorted({r["T"] for r in rows}):
        c, n = (next(r for r in rows if r["T"] == T and r["impl"] == i) for i in ("chunked", "naive"))
        print(f"{T:>6} {c['peak_mib_above_baseline']:>12.0f} {n['peak_mib_above_baseline']:>10.0f} "
              f"{c['seconds']:>10.2f} {n['seconds']:>8.2f}")


def main(argv=None):
    parser = OneLineParser(prog="cp_cost.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("step_time")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("extra", nargs="*", help="train_gpt_cplm flags after --, e.g. -- --attn_window 256")
    p = sub.add_parser("memory")
    p.add_argument("--lengths", default="4096,16384")
    sub.add_parser("parameters")
    args = parser.parse_args(argv)
    if args.what == "step_time" and args.steps < 1:
        parser.error(f"--steps must be >= 1 (got {args.steps})")
    if args.what == "memory":
        raw = args.lengths
        try:
            args.lengths = [int(x) for x in raw.split(",")]
        except ValueError:
            args.lengths = []
        if not args.lengths or min(args.lengths) < 1:
            parser.error(f"--lengths must be positive integers separated by commas (got {raw!r})")
    try:
        {"step_time": step_time, "memory": memory, "parameters": parameters}[args.what](args)
    except tg.UsageError as e:  # a bad train_gpt_cplm flag after --
        print(f"cp_cost.py: error: {e} (see python train_gpt_cplm.py --help)", file=sys.stderr)
        return 2
    except tg.DataError as e:  # e.g. the cpu preset's corpus not built yet
        print(f"cp_cost.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_measure":
        measure_one(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
