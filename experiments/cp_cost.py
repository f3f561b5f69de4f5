"""What the CP head costs on CPU, measured in one run.

    python experiments/cp_cost.py step_time [--steps 20] [--modes vanilla,cplm,sentinel] [-- --compile 1 ...]
                                                        # cpu preset: each mode's step time over vanilla's, medians
    python experiments/cp_cost.py memory [--lengths 4096,16384]   # peak memory of the CP loss vs a naive one
    python experiments/cp_cost.py parameters   # the CP head's parameter count and share, per preset

step_time builds each mode's model from the same seed and alternates their training steps (forward, backward,
optimizer) on the same real batches, so all see the same machine load; the ratios are of medians.
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


MODE_FLAGS = {"vanilla": {"cplm": 0}, "cplm": {"cplm": 1, "copy_gate": "lm"},
              "sentinel": {"cplm": 1, "copy_gate": "sentinel"}}  # the pointer-sentinel gate on the same CP head


def step_time(args):
    """The modes' training steps alternated on the same batches (compiled as the run compiles with --compile 1
    after --): the ratios to vanilla are of medians measured in one process, under one machine load."""
    hp = tg.resolve_vocabulary(tg.parse_args(["--preset", "cpu"] + args.extra))
    loader = tg.TrainLoader(hp.train_files, hp.batch_size, hp.seq_len, 0, 1, hp.vocab_size)
    tg.import_cpu_head().use_heap_for_large_tensors()  # as train_gpt_cplm.main does on CPU; after the checks, as it is process-wide
    compiled = hp.compile == 1
    window = torch.full((), tg.window_blocks(0, hp), dtype=torch.int32)
    steps, optimizers = {}, {}
    for mode in args.modes:
        mode_hp = tg.dataclasses.replace(hp, **MODE_FLAGS[mode])
        torch.manual_seed(hp.seed)
        model = tg.GPT(tg.GPTConfig.from_args(mode_hp))
        if compiled:  # as train_gpt_cplm.train: the head's loss written for inductor, the whole model compiled
            model.head_loss = tg.HeadLoss(hp.logit_softcap, model.config.copy_id)
        steps[mode] = (model, torch.compile(model, dynamic=False) if compiled else model)
        optimizers[mode] = tg.build_optimizers(model, mode_hp, 0, 1, compiled=compiled)
    times = {mode: [] for mode in args.modes}
    warmup = 3 if compiled else 2  # compiling (the first step of each mode) and warming the allocator: untimed
    for step in range(args.steps + warmup):
        batch = loader.next_batch("cpu")
        k = step % len(args.modes)
        for mode in args.modes[k:] + args.modes[:k]:  # each mode goes first in turn
            model, forward = steps[mode]
            t0 = time.perf_counter()
            for inputs, targets in batch:
                (forward(inputs, targets, window) / len(batch)).backward()
            for opt in optimizers[mode]:
                opt.step()
            model.zero_grad(set_to_none=True)
            if step >= warmup:
                times[mode].append(time.perf_counter() - t0)
    medians = {mode: 1000 * statistics.median(t) for mode, t in times.items()}
    result = {"preset": "cpu", "tokens_per_step": hp.batch_size, "vocab_size": hp.vocab_size, "compile": int(compiled),
              "steps": args.steps, "threads": torch.get_num_threads(), "train_files": hp.train_files,
              **{f"{mode}_median_ms": medians[mode] for mode in args.modes},
              **{f"{mode}_ms": [round(1000 * t, 1) for t in times[mode]] for mode in args.modes}}
    base = args.modes[0]
    for mode in args.modes[1:]:
        result[f"ratio_{mode}"] = medians[mode] / medians[base]
        # the per-step ratio (this mode's step over the first mode's in the same round): its spread says how stable
        pair_ratios = [m / b for b, m in zip(times[base], times[mode])]
        q = statistics.quantiles(pair_ratios, n=4)
        result[f"pair_ratio_quartiles_{mode}"] = [round(q[0], 3), round(q[2], 3)]
    print(json.dumps(result))
    print(f"train files: {hp.train_files}; compiled: {bool(compiled)}; {torch.get_num_threads()} thread(s)")
    for mode in args.modes:
        q = statistics.quantiles(times[mode], n=4)
        print(f"{mode:>9}: median {medians[mode]:.0f} ms, quartiles {1000 * q[0]:.0f}-{1000 * q[2]:.0f}, range "
              f"{1000 * min(times[mode]):.0f}-{1000 * max(times[mode]):.0f}")
    for mode in args.modes[1:]:
        print(f"{mode}/{base} = {result[f'ratio_{mode}']:.3f} (medians of {args.steps}; per-round ratio quartiles "
              f"{result[f'pair_ratio_quartiles_{mode}'][0]:.3f}-{result[f'pair_ratio_quartiles_{mode}'][1]:.3f})")


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
    p.add_argument("--modes", default="vanilla,cplm", help="comma list of vanilla, cplm, sentinel; ratios are to the first")
    p.add_argument("extra", nargs="*", help="train_gpt_cplm flags after --, e.g. -- --attn_window 256")
    p = sub.add_parser("memory")
    p.add_argument("--lengths", default="4096,16384")
    sub.add_parser("parameters")
    args = parser.parse_args(argv)
    if args.what == "step_time":
        if args.steps < 1:
            parser.error(f"--steps must be >= 1 (got {args.steps})")
        args.modes = args.modes.split(",")
        if len(set(args.modes)) != len(args.modes) or not set(args.modes) <= set(MODE_FLAGS):
            parser.error(f"--modes: distinct names from {', '.join(MODE_FLAGS)} (got {','.join(args.modes)})")
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
