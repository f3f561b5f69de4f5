"""SpamLang: a trivial copy task that a vanilla LM fails once V >> D and a CPLM solves at any vocabulary size.

    OMP_NUM_THREADS=1 python experiments/spamlang.py            # both tasks, V = 8k..512k, both modes
    python experiments/spamlang.py --task repeat --vocabs 8192 --steps 50

Tasks (each sequence is one document, generated on the fly from a seeded generator; BOS = V - 1):
  repeat  [BOS, x, x, x, ...]: x uniform over the vocabulary; every target after the first x is a copy.
  span    [BOS, r_1, r_2, ...]: distinct random tokens, except that one span of 4-16 of them recurs later
          in the row; the copy positions are the recurrence's tokens after its first one.
The metric is next-token argmax accuracy on the copy positions of held-out sequences, from the full
next-token distribution (`GPT.next_token_log_probs`: the CPLM mixture through the dense reference, or the
LM softmax in vanilla mode). Both modes get the same model, data, steps, batch and optimizer settings
(`build_optimizers` and `lr_multiplier` of train_gpt_cplm.py). Writes, under --out, one log per run,
results.md, results.json and spamlang.png.

The default budget (100 steps of 2 x 64 tokens, 32 held-out rows) is sized for about 30 minutes on one
busy core: at V = 512k a step costs about 2 s (the LM head and Adam over three 512k x 64 tables) and an
evaluation through the dense reference 20-40 s; the 512k runs take most of the time.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the training script lives in the repository root
    sys.path.insert(0, ROOT)
import train_gpt_cplm as tg  # noqa: E402

TASKS = ("repeat", "span")
DEFAULT_VOCABS = (8192, 32768, 131072, 524288)
MIN_SPAN, MAX_SPAN = 4, 16

# one small width for every vocabulary, so that V >> D everywhere (V / D = 128 at 8k, 8192 at 512k)
MODEL = dict(num_layers=2, model_dim=64, num_heads=2)
# the training script's learning rates, used as they are (see results.md)
OPTIM = dict(lr_embed=0.6, lr_head=0.008, lr_scalar=0.04, lr_muon=0.05, lr_cp=0.008, cooldown_frac=0.4)


# -----------------------------------------------------------------------------------------------------
# Data


def make_batch(task, vocab_size, batch, seq_len, generator):
    """(inputs, targets, copy_mask), each (batch, seq_len): targets are the inputs shifted by one and
    copy_mask marks the positions whose target is a copy of an earlier token of the row."""
    bos = vocab_size - 1
    copy = torch.zeros(batch, seq_len, dtype=torch.bool)
    if task == "repeat":
        first = torch.randint(0, bos, (batch, 1), generator=generator)
        seq = first.expand(batch, seq_len + 1).clone()
        copy[:, 1:] = True  # the target at position 0 is the first x: not predictable
    elif task == "span":
        if vocab_size - 1 < seq_len or seq_len < 2 * MIN_SPAN:
            raise ValueError(f"span needs seq_len >= {2 * MIN_SPAN} and vocab_size > seq_len")
        seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
        max_span = min(MAX_SPAN, seq_len // 2)
        for b in range(batch):
            # distinct tokens: the recurrence is the only repetition, so every copy target is unambiguous
            seq[b, 1:] = _distinct_tokens(bos, seq_len, generator)
            n = _randint(MIN_SPAN, max_span, generator)  # span length
            src = _randint(1, seq_len + 1 - 2 * n, generator)  # seq[src:src+n] recurs at seq[dst:dst+n]
            dst = _randint(src + n, seq_len + 1 - n, generator)
            seq[b, dst:dst + n] = seq[b, src:src + n]
            copy[b, dst:dst + n - 1] = True  # inputs seq[dst..dst+n-2] have targets seq[dst+1..dst+n-1]
    else:
        raise ValueError(f"task must be one of {TASKS}, not {task!r}")
    seq[:, 0] = bos
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), copy


def _randint(lo, hi, generator):
    """Uniform integer in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=generator))


def _distinct_tokens(high, n, generator):
    """n distinct ids in [0, high): rejection sampling, cheap even for a 512k vocabulary."""
    out = torch.randint(0, high, (n,), generator=generator)
    while True:
        _, first = _first_occurrence(out)
        if first.all():
            return out
        out[~first] = torch.randint(0, high, (int((~first).sum()),), generator=generator)


def _first_occurrence(x):
    sorted_x, order = torch.sort(x, stable=True)
    first_sorted = torch.ones_like(sorted_x, dtype=torch.bool)
    first_sorted[1:] = sorted_x[1:] != sorted_x[:-1]
    first = torch.empty_like(first_sorted)
    first[order] = first_sorted
    return sorted_x, first


# -----------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model, inputs, targets, copy_mask, seen=None, rows_per_chunk=None):
    """Argmax accuracy on the copy positions from the full next-token distribution, plus the NLL and (CPLM)
    the mean gates on the copy positions. seen (vocab_size bool, optional): the tokens that were training
    targets; adds the share of copy targets seen in training and the accuracy on those. Rows go through in
    chunks so that the (rows, T, padded_vocab) tensors of the dense reference stay near 256 MB."""
    model.eval()
    vocab, vp = model.config.vocab_size, model.config.padded_vocab
    if rows_per_chunk is None:
        rows_per_chunk = max(1, 2 ** 26 // (inputs.size(1) * vp))
    correct = total = correct_seen = total_seen = 0
    sums = {}
    for lo in range(0, inputs.size(0), rows_per_chunk):
        x, y, m = (t[lo:lo + rows_per_chunk] for t in (inputs, targets, copy_mask))
        log_p = model.next_token_log_probs(x)
        pred = log_p[..., :vocab].argmax(-1)  # the tokenizer's ids only: never <copy> or padding
        del log_p
        correct += int((pred == y)[m].sum())
        total += int(m.sum())
        if seen is not None:
            ms = m & seen[y]
            correct_seen += int((pred == y)[ms].sum())
            total_seen += int(ms.sum())
        stats = model(x, y, token_stats=True)
        for k in ("nll", "lam", "c", "s"):
            if k in stats:
                sums[k] = sums.get(k, 0.0) + float(stats[k][m].double().sum())
                if k == "lam":
                    sums["lam_all"] = sums.get("lam_all", 0.0) + float(stats[k].double().sum())
    model.train()
    out = {"copy_acc": correct / max(total, 1), "copy_nll": sums["nll"] / max(total, 1)}
    if seen is not None:
        out.update(seen=total_seen / max(total, 1), copy_acc_seen=correct_seen / max(total_seen, 1))
    if "lam" in sums:
        out.update(lam=sums["lam"] / max(total, 1), c=sums["c"] / max(total, 1), s=sums["s"] / max(total, 1),
                   lam_all=sums["lam_all"] / inputs.numel())
    return out


# -----------------------------------------------------------------------------------------------------
# One run


def run_one(task, vocab_size, cplm, steps, batch, seq_len, seed, eval_seqs=32, eval_every=0, log_path=None,
            optim=None, momentum_warmup_frac=0.2, copy_gate_init=None, print_lines=False):
    """Trains one model on one task and vocabulary; returns a dict with the final copy accuracy, the mean
    gate (CPLM), the final train loss and the wall time. Evaluates at step 0, at the end and, with
    eval_every > 0, every eval_every steps. copy_gate_init: the CPLM gate c at step 0 (None: the training
    script's default; 0: closed, c = 1 / padded vocabulary, i.e. a zero bias on the <copy> logit)."""
    t_start = time.perf_counter()
    o = {**OPTIM, **(optim or {})}
    a = tg.Hyperparameters(vocab_size=vocab_size, bos_id=vocab_size - 1, seq_len=seq_len, cplm=cplm,
                           num_iterations=steps, seed=seed,
                           muon_momentum_warmup_steps=max(1, round(momentum_warmup_frac * steps)), **MODEL, **o)
    model_config = tg.GPTConfig(vocab_size=vocab_size, bos_id=vocab_size - 1, max_seq_len=seq_len, cplm=cplm,
                                cp_dim=a.cp_dim, **MODEL)
    if copy_gate_init is not None:
        model_config.copy_gate_init = copy_gate_init or 1 / model_config.padded_vocab
    config = dict(task=task, vocab_size=vocab_size, mode="cplm" if cplm else "vanilla", steps=steps, batch=batch,
                  seq_len=seq_len, seed=seed, eval_seqs=eval_seqs, **MODEL, **o,
                  muon_momentum=a.muon_momentum, muon_momentum_warmup_steps=a.muon_momentum_warmup_steps,
                  copy_gate_init=model_config.copy_gate_init if cplm else None, cp_dim=a.cp_dim,
                  logit_softcap=model_config.logit_softcap, torch=torch.__version__, threads=torch.get_num_threads())
    log_file = open(log_path, "w") if log_path else None

    def log(line):
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()
        if print_lines:
            print(line, flush=True)

    log("config: " + json.dumps(config))
    torch.manual_seed(seed)
    model = tg.GPT(model_config)
    optimizers = tg.build_optimizers(model, a, 0, 1)
    train_gen = torch.Generator().manual_seed(1000 + seed)
    held_out = make_batch(task, vocab_size, eval_seqs, seq_len, torch.Generator().manual_seed(2_000_000 + seed))

    seen = torch.zeros(vocab_size, dtype=torch.bool)  # tokens that were training targets so far

    def eval_line(step, train_loss, copy_nll):
        result = evaluate(model, *held_out, seen=seen)
        log(f"step:{step}/{steps} train_loss:{train_loss:.4f} train_copy_nll:{copy_nll:.4f} "
            + " ".join(f"{k}:{v:.4f}" for k, v in result.items())
            + f" wall:{time.perf_counter() - t_start:.1f}s")
        return result

    train_loss = copy_nll = float("nan")
    acc0 = eval_line(0, train_loss, copy_nll)["copy_acc"]  # where the model starts (CPLM: often > 0, see notes)
    for step in range(steps):
        inputs, targets, copy_mask = make_batch(task, vocab_size, batch, seq_len, train_gen)
        seen[targets.flatten()] = True
        stats = model(inputs, targets, token_stats=True)
        loss = stats["nll"].mean()
        loss.backward()
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * tg.lr_multiplier(step, a)
        warm = min(step / a.muon_momentum_warmup_steps, 1)
        for group in optimizers[1].param_groups:
            group["momentum"] = (1 - warm) * 0.85 + warm * a.muon_momentum
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        train_loss = loss.item()
        copy_nll = float(stats["nll"].detach()[copy_mask].mean())
        if not math.isfinite(train_loss):
            log(f"stopped: train_loss is {train_loss} at step {step + 1}")
            break
        done = step + 1
        if eval_every > 0 and done % eval_every == 0 and done < steps:
            eval_line(done, train_loss, copy_nll)
    result = eval_line(steps, train_loss, copy_nll)
    wall = time.perf_counter() - t_start
    log(f"final copy_acc:{result['copy_acc']:.4f}" + (f" lambda:{result['lam']:.4f}" if cplm else "")
        + f" train_loss:{train_loss:.4f} wall:{wall:.1f}s")
    if log_file:
        log_file.close()
    return dict(task=task, vocab_size=vocab_size, mode=config["mode"], cplm=cplm, seed=seed, steps=steps,
                batch=batch, seq_len=seq_len, train_loss=train_loss, train_copy_nll=copy_nll, wall_s=wall,
                copy_acc_step0=acc0, **result)


# -----------------------------------------------------------------------------------------------------
# Outputs


def write_results(results, out_dir, command, settings):
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(command=command, settings=settings, results=results), f, indent=1)
    lines = ["# SpamLang results", "", "Produced by:", "", f"    {command}", "",
             "Model: " + ", ".join(f"{k}={v}" for k, v in MODEL.items())
             + f"; steps={settings['steps']}, batch={settings['batch']} sequences of seq_len={settings['seq_len']}"
             f", {settings['eval_seqs']} held-out sequences per run.",
             "Optimizer: build_optimizers / lr_multiplier of train_gpt_cplm.py with "
             + ", ".join(f"{k}={v}" for k, v in settings["optim"].items())
             + (" (the training script's defaults)" if settings["optim"] == OPTIM else " (changed from the "
                "training script's defaults, equally for both modes)")
             + f"; Muon momentum 0.85 -> 0.95 over the first {settings['momentum_warmup_frac']:.0%} of steps."
             f" CPLM gate at step 0: c = {settings['copy_gate_init']}."
             " Both modes: the same data, steps, batch and optimizer settings.",
             "copy acc: next-token argmax accuracy on the copy positions of the held-out sequences, from the full"
             " mixture (CPLM) or the LM softmax (vanilla). lambda: the mean copy gate on those positions.", "",
             "copy acc @0: the same before training. copy NLL: the held-out NLL on the copy positions (nats)."
             " seen: the share of held-out copy targets that were a training target at least once; acc seen:"
             " the accuracy on those. The LM head starts at zero, so at step 0 the LM distribution is flat: a"
             " vanilla model's argmax is then token 0, while any copy mass makes a CPLM's argmax a context token"
             " (copy acc @0 can be high for repeat); copy NLL and lambda show whether copying was learned.", "",
             "| task | V | mode | seed | copy acc | copy acc @0 | copy NLL | lambda | seen | acc seen "
             "| final train loss | wall time |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lam = f"{r['lam']:.3f}" if "lam" in r else "-"
        lines.append(f"| {r['task']} | {r['vocab_size']} | {r['mode']} | {r['seed']} | {100 * r['copy_acc']:.1f}% "
                     f"| {100 * r['copy_acc_step0']:.1f}% | {max(r['copy_nll'], 0.0):.3f} | {lam} | {100 * r['seen']:.1f}% "
                     f"| {100 * r['copy_acc_seen']:.1f}% | {r['train_loss']:.4f} | {r['wall_s']:.0f}s |")
    lines += ["", f"Total wall time: {sum(r['wall_s'] for r in results):.0f}s", ""]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines))


def plot_results(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("spamlang: matplotlib is not installed; no plot written")
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for task in TASKS:
        for mode in ("vanilla", "cplm"):
            rows = [r for r in results if r["task"] == task and r["mode"] == mode]
            vocabs = sorted({r["vocab_size"] for r in rows})
            if not vocabs:
                continue
            acc = [100 * sum(r["copy_acc"] for r in rows if r["vocab_size"] == v)
                   / sum(1 for r in rows if r["vocab_size"] == v) for v in vocabs]
            ax.plot(vocabs, acc, marker="o" if mode == "cplm" else "s", linestyle="-" if mode == "cplm" else "--",
                    markersize=7 if mode == "cplm" else 5,
                    color="C0" if task == "repeat" else "C1", label=f"{task}, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("copy accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"SpamLang, D={MODEL['model_dim']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def command_line(argv):
    prefix = "OMP_NUM_THREADS=" + os.environ["OMP_NUM_THREADS"] + " " if "OMP_NUM_THREADS" in os.environ else ""
    nice = os.nice(0) if hasattr(os, "nice") else 0
    prefix += f"nice -n {nice} " if nice else ""
    return prefix + " ".join(["python", "experiments/spamlang.py", *argv])


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv):
    p = OneLineParser(prog="spamlang.py", description=__doc__.split("\n")[0])
    p.add_argument("--task", default="both", choices=[*TASKS, "both"])
    p.add_argument("--vocabs", default=",".join(map(str, DEFAULT_VOCABS)))
    p.add_argument("--modes", default="vanilla,cplm", help="comma-separated: vanilla, cplm")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--seeds", default="0")
    p.add_argument("--eval_seqs", type=int, default=32, help="held-out sequences per run")
    p.add_argument("--eval_every", type=int, default=0,
                   help="steps between evaluations; 0 (default): only at step 0 and at the end")
    for k, v in OPTIM.items():
        p.add_argument(f"--{k}", type=float, default=v)
    p.add_argument("--momentum_warmup_frac", type=float, default=0.2)
    p.add_argument("--copy_gate_init", type=float, default=None,
                   help="CPLM gate at step 0 (default: the training script's; 0: closed, c = 1/padded vocab)")
    p.add_argument("--out", default="records/spamlang")
    args = p.parse_args(argv)
    tasks = list(TASKS) if args.task == "both" else [args.task]
    try:
        vocabs = [int(v) for v in args.vocabs.split(",") if v]
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError as e:
        p.error(f"--vocabs and --seeds take integers separated by commas ({e})")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(v < 2 for v in vocabs) or not vocabs:
        p.error("--vocabs: sizes of at least 2")
    if not set(modes) <= {"vanilla", "cplm"} or not modes:
        p.error("--modes: vanilla and/or cplm")
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2 or args.eval_seqs < 1 or not seeds:
        p.error("--steps, --batch, --eval_seqs must be >= 1, --seq_len >= 2, --seeds non-empty")
    if args.copy_gate_init is not None and not 0 <= args.copy_gate_init < 1:
        p.error("--copy_gate_init must lie in [0, 1)")
    if "span" in tasks and (args.seq_len < 2 * MIN_SPAN or min(vocabs) - 1 < args.seq_len):
        p.error(f"span needs --seq_len >= {2 * MIN_SPAN} and every vocabulary larger than --seq_len")
    return args, tasks, vocabs, modes, seeds


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, tasks, vocabs, modes, seeds = parse_args(argv)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:  # e.g. a file where the folder should be
        print(f"spamlang.py: error: cannot create --out {args.out} ({e.strerror}); choose another folder",
              file=sys.stderr)
        return 1
    tg.use_heap_for_large_tensors()
    command = command_line(argv)
    optim = {k: getattr(args, k) for k in OPTIM}
    eval_every = args.eval_every
    settings = dict(tasks=tasks, vocabs=vocabs, modes=modes, seeds=seeds, steps=args.steps, batch=args.batch,
                    seq_len=args.seq_len, eval_seqs=args.eval_seqs, eval_every=eval_every, optim=optim,
                    momentum_warmup_frac=args.momentum_warmup_frac, model=MODEL,
                    copy_gate_init=(tg.GPTConfig.copy_gate_init if args.copy_gate_init is None
                                    else args.copy_gate_init or "closed (1/padded vocab)"),
                    threads=torch.get_num_threads())
    print(f"spamlang: {command}", flush=True)
    results, t0 = [], time.perf_counter()
    for task in tasks:
        for vocab in vocabs:
            for mode in modes:
                for seed in seeds:
                    name = f"{task}_V{vocab}_{mode}_seed{seed}"
                    r = run_one(task, vocab, int(mode == "cplm"), args.steps, args.batch, args.seq_len, seed,
                                eval_seqs=args.eval_seqs, eval_every=eval_every,
                                log_path=os.path.join(args.out, name + ".txt"), optim=optim,
                                momentum_warmup_frac=args.momentum_warmup_frac, copy_gate_init=args.copy_gate_init)
                    results.append(r)
                    lam = f" lambda {r['lam']:.3f}" if "lam" in r else ""
                    print(f"{name}: copy_acc {100 * r['copy_acc']:.1f}%{lam} train_loss {r['train_loss']:.4f} "
                          f"wall {r['wall_s']:.0f}s (total {time.perf_counter() - t0:.0f}s)", flush=True)
                    write_results(results, args.out, command, settings)  # partial results survive a crash
    plot_results(results, os.path.join(args.out, "spamlang.png"))
    print(f"spamlang: wrote {os.path.join(args.out, 'results.md')} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
