"""SpamLang: synthetic copy tasks that show when a vanilla LM's head fails (V >> D) and what a CP head adds.

    OMP_NUM_THREADS=1 python experiments/spamlang.py --study v2 --jobs 2   # the controlled study: records/spamlang_v2
    OMP_NUM_THREADS=1 python experiments/spamlang.py --copy_gate_init 0    # the first study, kept for records/spamlang
    python experiments/spamlang.py --task lookup --vocabs 4096 --dims 32 --steps 200   # any grid of runs

Tasks (each sequence is one document, generated on the fly from a seeded generator; BOS = V - 1):
  repeat  [BOS, x, x, x, ...]: x uniform; every target after the first x is a copy. Here y_t = x_t, and the CP
          head may point at tau = t itself, so a CPLM gets it right before any training (see below).
  lookup  [BOS, a_1..a_P, a_1..a_P, ...]: a block of P (2..8) distinct tokens, repeated; the copy positions are
          t >= P, whose target y_t = x_{t-P+1} is never x_t: pointing at its own position gains the CP head
          nothing, it must find the earlier occurrence (a real lookup), as vanilla must (an induction circuit).
  span    [BOS, r_1, r_2, ...]: distinct random tokens, except that one span of 4-16 of them recurs later in the
          row; the copy positions are the recurrence's tokens after its first one.
The metric is next-token argmax accuracy on the copy positions of held-out sequences, from the full next-token
distribution (`inference.next_token_log_probs`: the CPLM mixture through the dense reference, or the LM softmax in
vanilla mode). Both modes get the same model (train_gpt_cplm.GPT, 2 layers), data, steps, batch, optimizers
(`build_optimizers`, `lr_multiplier`, the training script's learning rates) and the gate starting closed
(`copy_gate_init` 0: c = 1/padded V, the paper's start). Every run reports its accuracy at step 0 beside the final
one: what the architecture gives before it learns anything.

`--study v2` answers the audit of the first study (records/spamlang, the default grid below):
  1. There, vanilla failed by construction: at V >= 32k no held-out target had ever been a training target, and
     the zero-initialised untied LM head cannot rank a token it never saw. In v2 every held-out sequence is drawn
     only from tokens that were the copy target of at least MIN_EXPOSURES (8) training sequences (a sequence
     counts once, however often the token recurs in it).
  2. There, V = 512 against 8192 changed the exposures per token 16-fold along with V/D. v2 fixes V = 4096 and
     the training stream (one seed: the same batches, hence the same exposures for every width) and varies the
     width D = 16..256, so V/D = 256..16 is the only thing that changes; it reports the smallest V/D at which
     vanilla's accuracy falls below 50% (the V/D where it breaks). Varying V at a fixed D with the steps grown
     in proportion would do the same at a cost that grows as V^2 (steps x LM-head size); fixing V costs the same
     at every V/D. Both repeat (the LM head alone: y_t = x_t needs no lookup) and lookup (an induction lookup
     before the head) run at every width, at one fixed budget.
  3. There, CPLM's repeat score was 99% before training. v2 prints step 0 next to the final accuracy and adds
     lookup, where copying needs a learned pointer (before training a CPLM can only guess among the block's
     tokens, by how often each occurs in the context).
  4. There, the span task ran 100 steps and neither mode learned it. v2 trains it at D = 64 (V/D = 64, inside
     the paper's 24-85) until the held-out accuracy plateaus (`plateaued`: over the last quarter of the steps
     so far neither the accuracy rose by more than 1 point nor the copy NLL fell by more than 0.05 nats, or the
     accuracy is >= 99%), checked at every evaluation from a minimum number of steps on, up to a step cap; the
     learning rate follows the training script's schedule over the cap, so a run that stops early stopped before
     its cool-down. The minimum keeps a long flat stretch before an induction circuit forms from passing as a
     plateau, and the NLL clause keeps a slow but steady improvement from passing as one.
Under --out (default records/spamlang_v2 for v2, records/spamlang for the grid): one log per run, results.md,
results.json and spamlang.png. Each run is its own process when --jobs > 1 (one thread each).
Cost of v2 (CPU time of one thread, measured over a few steps and one evaluation of every run on the 2-core CPU
machine, while other jobs ran): the sweep ~73 CPU-minutes (D = 256 alone ~37: Muon's Newton-Schulz on 256-wide
matrices, ~0.4 s a step), the two span runs ~15 at their minimum and at most ~40 if they reach the cap; so
~90-115 CPU-minutes, 45-60 minutes with --jobs 2 (the span runs start first, the widest sweep runs next).

The grid (`--study grid`, the default, whose flags define the runs) keeps the first study's defaults, so
`python experiments/spamlang.py --copy_gate_init 0` reruns records/spamlang's setting: 100 steps of 2 x 64 tokens
at V = 8k..512k, D = 64, 32 held-out rows, about 20 minutes on one core; read its flaws above. (Its CPLM rows
were trained with a random W_Q, before W_Q started at zero: a rerun gives its vanilla rows again, not its CPLM
rows.)
"""
import concurrent.futures
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

import torch

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path

import inference  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402

TASKS = ("repeat", "lookup", "span")
DEFAULT_VOCABS = (8192, 32768, 131072, 524288)
MIN_SPAN, MAX_SPAN = 4, 16  # span: the recurring span's length
MIN_PERIOD, MAX_PERIOD = 2, 8  # lookup: the repeated block's length P

# one small width for every vocabulary in the grid, so that V >> D everywhere (V / D = 128 at 8k, 8192 at 512k)
MODEL = dict(num_layers=2, model_dim=64, num_heads=2)
# the training script's learning rates, used as they are
OPTIM = dict(lr_embed=0.6, lr_head=0.008, lr_scalar=0.04, lr_muon=0.05, lr_cp=0.008, cooldown_frac=0.4)

# --study v2 (see the docstring for the design and its measured cost)
V2_VOCAB = 4096
V2_DIMS = (256, 128, 64, 32, 16)  # V/D = 16 .. 256; widest first, the longest runs start first
MIN_EXPOSURES = 8  # a held-out target was the copy target of at least this many training sequences
BREAK_ACCURACY = 0.5  # vanilla "breaks" where its held-out accuracy falls below this
V2_SWEEP = {  # the same budget at every width: 1024 steps
    # 64 rows of one token each a step: 65536 rows, 16 per token on average
    "repeat": dict(steps=1024, batch=64, seq_len=8, eval_seqs=256, eval_every=256),
    # 16 rows of P = 2..8 tokens (5 on average) a step: 16 copy-target rows per token on average
    "lookup": dict(steps=1024, batch=16, seq_len=32, eval_seqs=64, eval_every=256),
}
V2_SPAN_DIM = 64
# 3000 to 8000 steps of 8 rows (~9 copy targets each: ~53 copy-target rows per token by the minimum). The minimum
# is long because a flat start proves little: in a first try with a minimum of 1000 steps vanilla stopped there,
# at chance, while the CPLM's accuracy was only beginning to rise (its log here shows when it does).
V2_SPAN = dict(steps=8000, batch=8, seq_len=64, eval_seqs=128, eval_every=100, plateau_min_steps=3000)
PLATEAU_WINDOW, PLATEAU_ACC_GAIN, PLATEAU_NLL_DROP, SOLVED = 0.25, 0.01, 0.05, 0.99


# -----------------------------------------------------------------------------------------------------
# Data


def make_batch(task, vocab_size, batch, seq_len, generator, tokens=None):
    """(inputs, targets, copy_mask), each (batch, seq_len): targets are the inputs shifted by one and copy_mask
    marks the positions whose target is a copy of an earlier token of the row. tokens (1-D ids, optional): the
    ids the rows are drawn from (held-out rows of tokens seen in training); default every id but BOS."""
    bos = vocab_size - 1
    high = bos if tokens is None else len(tokens)  # rows draw indices into the allowed ids

    def ids(index):
        return index if tokens is None else tokens[index]

    copy = torch.zeros(batch, seq_len, dtype=torch.bool)
    seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
    if task == "repeat":
        if high < 1:
            raise ValueError("repeat needs at least one token")
        seq[:] = ids(torch.randint(0, high, (batch, 1), generator=generator))
        copy[:, 1:] = True  # the target at position 0 is the first x: not predictable
    elif task == "lookup":
        max_period = min(MAX_PERIOD, seq_len // 2)
        if max_period < MIN_PERIOD or high < max_period:
            raise ValueError(f"lookup needs seq_len >= {2 * MIN_PERIOD} and at least {max_period} tokens to draw "
                             f"from, not {high}")
        for b in range(batch):
            period = _randint(MIN_PERIOD, max_period, generator)
            block = ids(_distinct_tokens(high, period, generator))
            seq[b, 1:] = block.repeat(-(-seq_len // period))[:seq_len]
            copy[b, period:] = True  # input position t >= P: its target x_{t+1} = x_{t+1-P} is in the context
    elif task == "span":
        if high < seq_len or seq_len < 2 * MIN_SPAN:
            raise ValueError(f"span needs seq_len >= {2 * MIN_SPAN} and more tokens to draw from than seq_len "
                             f"({high} for {seq_len})")
        max_span = min(MAX_SPAN, seq_len // 2)
        for b in range(batch):
            # distinct tokens: the recurrence is the only repetition, so every copy target is unambiguous
            seq[b, 1:] = ids(_distinct_tokens(high, seq_len, generator))
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


def copy_target_exposures(batches, vocab_size):
    """(vocab_size,) int64: in how many training rows each token was the target of a copy position. A row counts
    once per token, however often the token recurs in it (a repeat row is one example, not seq_len of them)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for _, targets, copy_mask in batches:
        rows = torch.arange(targets.size(0))[:, None].expand_as(targets)
        row_token = torch.unique((rows * vocab_size + targets)[copy_mask])
        counts += torch.bincount(row_token % vocab_size, minlength=vocab_size)
    return counts


def held_out_set(task, vocab_size, rows, seq_len, generator, training_batches, min_exposures):
    """(held-out batch, exposure summary). min_exposures > 0: the rows draw only tokens that were the copy target
    of at least min_exposures of the training rows (ValueError if too few were); 0: any token, summary {}."""
    if not min_exposures:
        return make_batch(task, vocab_size, rows, seq_len, generator), {}
    counts = copy_target_exposures(training_batches, vocab_size)
    pool = (counts >= min_exposures).nonzero().flatten()
    if len(pool) < tokens_needed(task, seq_len):
        raise ValueError(f"only {len(pool)} tokens were the copy target of >= {min_exposures} rows in the first "
                         f"{len(training_batches)} steps; {task} rows need {tokens_needed(task, seq_len)}: raise the "
                         "steps or the batch, or lower the exposures")
    held_out = make_batch(task, vocab_size, rows, seq_len, generator, tokens=pool)
    held_counts = counts[held_out[1][held_out[2]]].double()
    return held_out, dict(eligible_tokens=len(pool), exposures_min=int(held_counts.min()),
                          exposures_median=float(held_counts.median()))


def tokens_needed(task, seq_len):
    """How many distinct ids a held-out row of this task draws."""
    return {"repeat": 1, "lookup": min(MAX_PERIOD, seq_len // 2), "span": seq_len}[task]


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
        log_p = inference.next_token_log_probs(model, x)
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


def plateaued(history, window=PLATEAU_WINDOW, acc_gain=PLATEAU_ACC_GAIN, nll_drop=PLATEAU_NLL_DROP, solved=SOLVED):
    """history: [(step, copy_acc, copy_nll), ...] in step order. True when the evaluations in the last `window`
    of the steps so far improve on the best before them by at most acc_gain in accuracy and at most nll_drop
    nats in NLL (or the accuracy is at least `solved`, where the NLL no longer matters)."""
    last = history[-1][0]
    before = [h for h in history if h[0] <= (1 - window) * last]
    recent = [h for h in history if h[0] > (1 - window) * last]
    if not before or not recent:
        return False
    best_recent = max(acc for _, acc, _ in recent)
    gain = best_recent - max(acc for _, acc, _ in before)
    drop = min(nll for *_, nll in before) - min(nll for *_, nll in recent)
    return gain <= acc_gain and (drop <= nll_drop or best_recent >= solved)


# -----------------------------------------------------------------------------------------------------
# One run


def run_one(task, vocab_size, cplm, steps, batch, seq_len, seed, eval_seqs=32, eval_every=0, log_path=None,
            optim=None, momentum_warmup_frac=0.2, copy_gate_init=None, print_lines=False, model_dim=None,
            min_exposures=0, plateau_min_steps=0):
    """Trains one model on one task; returns a dict with the final copy accuracy, the one at step 0, the mean
    gate (CPLM), the final train loss and the wall time. Evaluates at step 0, at the end and, with
    eval_every > 0, every eval_every steps. copy_gate_init: the CPLM gate c at step 0 (None: the training
    script's default; 0: closed, c = 1 / padded vocabulary, i.e. a zero bias on the <copy> logit).
    model_dim: the width D (default MODEL's). min_exposures > 0: the held-out rows use only tokens that were the
    copy target of at least that many rows of the first `plateau_min_steps or steps` training steps (0: any
    token, the first study's held-out set). plateau_min_steps > 0: from that step on, stop at the first
    evaluation where `plateaued` holds (steps is then the cap)."""
    t_start = time.perf_counter()
    model_shape = {**MODEL, **({"model_dim": model_dim} if model_dim else {})}
    o = {**OPTIM, **(optim or {})}
    a = tg.Hyperparameters(vocab_size=vocab_size, bos_id=vocab_size - 1, seq_len=seq_len, cplm=cplm,
                           num_iterations=steps, seed=seed,
                           muon_momentum_warmup_steps=max(1, round(momentum_warmup_frac * steps)), **model_shape, **o)
    model_config = tg.GPTConfig(vocab_size=vocab_size, bos_id=vocab_size - 1, max_seq_len=seq_len, cplm=cplm,
                                cp_dim=a.cp_dim, **model_shape)
    if copy_gate_init is not None:
        model_config.copy_gate_init = copy_gate_init or 1 / model_config.padded_vocab
    if plateau_min_steps and not (eval_every > 0 and plateau_min_steps <= steps):
        raise ValueError("plateau stopping needs eval_every > 0 and plateau_min_steps <= steps")
    config = dict(task=task, vocab_size=vocab_size, mode="cplm" if cplm else "vanilla", steps=steps, batch=batch,
                  seq_len=seq_len, seed=seed, eval_seqs=eval_seqs, **model_shape, **o,
                  muon_momentum=a.muon_momentum, muon_momentum_warmup_steps=a.muon_momentum_warmup_steps,
                  copy_gate_init=model_config.copy_gate_init if cplm else None, cp_dim=a.cp_dim,
                  logit_softcap=model_config.logit_softcap, min_exposures=min_exposures,
                  plateau_min_steps=plateau_min_steps, eval_every=eval_every, torch=torch.__version__,
                  threads=torch.get_num_threads())
    # the data first (their own generators), so a held-out set the training rows cannot supply leaves no log;
    # with min_exposures the first steps' batches are drawn ahead (the same stream), to know what they teach
    train_gen = torch.Generator().manual_seed(1000 + seed)
    early = [make_batch(task, vocab_size, batch, seq_len, train_gen)
             for _ in range(plateau_min_steps or steps)] if min_exposures else []
    held_out, exposure = held_out_set(task, vocab_size, eval_seqs, seq_len,
                                      torch.Generator().manual_seed(2_000_000 + seed), early, min_exposures)
    log_file = open(log_path, "w") if log_path else None

    def log(line):
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()
        if print_lines:
            print(line, flush=True)

    try:
        log("config: " + json.dumps(config))
        if exposure:
            log("held-out: " + json.dumps(exposure))
        torch.manual_seed(seed)
        model = tg.GPT(model_config)
        optimizers = tg.build_optimizers(model, a, 0, 1)

        seen = torch.zeros(vocab_size, dtype=torch.bool)  # tokens that were training targets so far

        def eval_line(step, train_loss, copy_nll):
            result = evaluate(model, *held_out, seen=seen)
            log(f"step:{step}/{steps} train_loss:{train_loss:.4f} train_copy_nll:{copy_nll:.4f} "
                + " ".join(f"{k}:{v:.4f}" for k, v in result.items())
                + f" wall:{time.perf_counter() - t_start:.1f}s")
            history.append((step, result["copy_acc"], result["copy_nll"]))
            return result

        history = []
        train_loss = copy_nll = float("nan")
        result = step0 = eval_line(0, train_loss, copy_nll)  # where the model starts (CPLM: > 0, see docstring)
        done, stop = 0, "steps"
        for step in range(steps):
            inputs, targets, copy_mask = (early[step] if step < len(early)
                                          else make_batch(task, vocab_size, batch, seq_len, train_gen))
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
                stop = "non-finite loss"
                break
            done = step + 1
            if eval_every > 0 and done % eval_every == 0 and done < steps:
                result = eval_line(done, train_loss, copy_nll)
                if plateau_min_steps and done >= plateau_min_steps and plateaued(history):
                    log(f"stopped: plateau at step {done}")
                    stop = "plateau"
                    break
        if stop != "plateau":  # a plateau was found by an evaluation at `done`
            result = eval_line(done, train_loss, copy_nll)
        wall = time.perf_counter() - t_start
        log(f"final copy_acc:{result['copy_acc']:.4f}" + (f" lambda:{result['lam']:.4f}" if cplm else "")
            + f" train_loss:{train_loss:.4f} steps:{done} wall:{wall:.1f}s")
    finally:
        if log_file:
            log_file.close()
    return dict(task=task, vocab_size=vocab_size, model_dim=model_shape["model_dim"], mode=config["mode"],
                cplm=cplm, seed=seed, steps=steps, steps_done=done, stop=stop, batch=batch, seq_len=seq_len,
                train_loss=train_loss, train_copy_nll=copy_nll, wall_s=wall, copy_acc_step0=step0["copy_acc"],
                copy_nll_step0=step0["copy_nll"], copy_acc_best=max(acc for _, acc, _ in history),
                min_exposures=min_exposures, **exposure, **result)


# -----------------------------------------------------------------------------------------------------
# Studies: a list of runs, each a RunSpec, run --jobs at a time


@dataclass
class RunSpec:
    part: str  # the table it belongs to: grid | sweep | plateau
    task: str
    vocab_size: int
    model_dim: int
    mode: str  # vanilla | cplm
    seed: int
    steps: int
    batch: int
    seq_len: int
    eval_seqs: int
    eval_every: int = 0
    min_exposures: int = 0
    plateau_min_steps: int = 0
    copy_gate_init: float | None = None
    momentum_warmup_frac: float = 0.2
    optim: dict | None = None

    @property
    def name(self):
        return f"{self.task}_V{self.vocab_size}_D{self.model_dim}_{self.mode}_seed{self.seed}"


def v2_specs(seeds):
    """The controlled study: the V/D sweep (repeat and lookup at V = 4096, D = 256..16, one budget) and the span
    task trained to a plateau at D = 64; both modes, the gate starting closed. Longest runs first."""
    specs = [RunSpec("plateau", "span", V2_VOCAB, V2_SPAN_DIM, mode, seed, min_exposures=MIN_EXPOSURES,
                     copy_gate_init=0, **V2_SPAN) for seed in seeds for mode in ("vanilla", "cplm")]
    specs += [RunSpec("sweep", task, V2_VOCAB, dim, mode, seed, min_exposures=MIN_EXPOSURES, copy_gate_init=0,
                      **budget)
              for dim in V2_DIMS for task, budget in V2_SWEEP.items() for seed in seeds for mode in ("vanilla", "cplm")]
    return specs


def run_spec(spec: RunSpec, out_dir):
    return run_one(spec.task, spec.vocab_size, int(spec.mode == "cplm"), spec.steps, spec.batch, spec.seq_len,
                   spec.seed, eval_seqs=spec.eval_seqs, eval_every=spec.eval_every,
                   log_path=os.path.join(out_dir, spec.name + ".txt"), optim=spec.optim,
                   momentum_warmup_frac=spec.momentum_warmup_frac, copy_gate_init=spec.copy_gate_init,
                   model_dim=spec.model_dim, min_exposures=spec.min_exposures,
                   plateau_min_steps=spec.plateau_min_steps) | {"part": spec.part}


def _one_thread():
    torch.set_num_threads(1)


def run_study(specs, out_dir, jobs, on_result):
    """Runs every spec (jobs > 1: that many processes, one thread each); calls on_result(results so far, in spec
    order) after each run, so partial results survive a crash. Returns the results in spec order."""
    done = {}

    def finish(i, result):
        done[i] = result
        on_result([done[k] for k in sorted(done)])
        lam = f" lambda {result['lam']:.3f}" if "lam" in result else ""
        print(f"{specs[i].name}: copy_acc {100 * result['copy_acc']:.1f}% (step 0: "
              f"{100 * result['copy_acc_step0']:.1f}%){lam} steps {result['steps_done']} wall "
              f"{result['wall_s']:.0f}s", flush=True)

    if jobs == 1:
        for i, spec in enumerate(specs):
            finish(i, run_spec(spec, out_dir))
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_one_thread) as pool:
            futures = {pool.submit(run_spec, spec, out_dir): i for i, spec in enumerate(specs)}
            try:
                for future in concurrent.futures.as_completed(futures):
                    finish(futures[future], future.result())
            except BaseException:  # a failed run: start no more (the ones under way finish)
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    return [done[i] for i in range(len(specs))]


# -----------------------------------------------------------------------------------------------------
# Outputs


def vanilla_break(results, task):
    """(last V/D where vanilla's mean accuracy over seeds is >= BREAK_ACCURACY, first V/D where it is below),
    scanning the sweep's V/D upwards; None for a side that does not occur."""
    ratios = sorted({r["vocab_size"] / r["model_dim"] for r in results
                     if r["part"] == "sweep" and r["task"] == task and r["mode"] == "vanilla"})
    holds = breaks = None
    for ratio in ratios:
        accs = [r["copy_acc"] for r in results if r["part"] == "sweep" and r["task"] == task
                and r["mode"] == "vanilla" and r["vocab_size"] / r["model_dim"] == ratio]
        if sum(accs) / len(accs) >= BREAK_ACCURACY:
            if breaks is None:
                holds = ratio
        elif breaks is None:
            breaks = ratio
    return holds, breaks


def break_sentence(results, task):
    holds, breaks = vanilla_break(results, task)
    if breaks is None:
        return f"{task}: vanilla stays >= {BREAK_ACCURACY:.0%} at every V/D of the sweep (up to {holds:g})."
    if holds is None:
        return f"{task}: vanilla is below {BREAK_ACCURACY:.0%} already at the smallest V/D, {breaks:g}."
    return f"{task}: vanilla breaks between V/D = {holds:g} (>= {BREAK_ACCURACY:.0%}) and {breaks:g} (below)."


def _pct(x):
    return f"{100 * x:.1f}%"


def write_v2_results(results, out_dir, command, wall_s):
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(command=command, wall_s=wall_s, results=results), f, indent=1)
    sweep = [r for r in results if r["part"] == "sweep"]
    plateau = [r for r in results if r["part"] == "plateau"]
    lines = ["# SpamLang v2 results", "", "Produced by:", "", f"    {command}", "",
             f"Wall time: {wall_s:.0f}s for the whole study; per run below (sum "
             f"{sum(r['wall_s'] for r in results):.0f}s).",
             "", "Model: train_gpt_cplm.GPT with " + ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "model_dim")
             + ", the width D per row; optimizers, learning rates and schedule of train_gpt_cplm.py ("
             + ", ".join(f"{k}={v}" for k, v in OPTIM.items()) + "); the CPLM gate starts closed (c = 1/padded V)."
             " acc: next-token argmax accuracy on the copy positions of held-out rows, from the mixture (CPLM) or"
             " the LM softmax (vanilla); acc @0: the same before training; NLL: held-out NLL on those positions"
             " (nats); lambda: the mean copy gate there. Held-out rows use only tokens that were the copy target of"
             f" >= {MIN_EXPOSURES} training rows (exposures: the min and median over the held-out copy targets).", ""]
    if sweep:
        vocabs = ", ".join(str(v) for v in sorted({r["vocab_size"] for r in sweep}))
        lines += [f"## V/D sweep: V = {vocabs}, the same training rows at every width D (one budget)", "",
                  "| task | D | V/D | mode | acc @0 | acc | NLL | lambda | steps | exposures min / median | wall |",
                  "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in sorted(sweep, key=lambda r: (TASKS.index(r["task"]), -r["model_dim"], r["mode"] != "vanilla",
                                              r["seed"])):
            lam = f"{r['lam']:.3f}" if "lam" in r else "-"
            lines.append(f"| {r['task']} | {r['model_dim']} | {r['vocab_size'] // r['model_dim']} | {r['mode']} "
                         f"| {_pct(r['copy_acc_step0'])} | {_pct(r['copy_acc'])} | {r['copy_nll']:.3f} | {lam} "
                         f"| {r['steps_done']} | {r['exposures_min']} / {r['exposures_median']:g} "
                         f"| {r['wall_s']:.0f}s |")
        lines += [""] + [break_sentence(results, task) for task in TASKS if any(r["task"] == task for r in sweep)]
        lines += [""]
    if plateau:
        lines += ["## Trained to a plateau", "",
                  "| task | D | V/D | mode | acc @0 | acc | best acc | NLL | lambda | steps (cap) | stopped by "
                  "| exposures min / median | wall |",
                  "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
        for r in plateau:
            lam = f"{r['lam']:.3f}" if "lam" in r else "-"
            lines.append(f"| {r['task']} | {r['model_dim']} | {r['vocab_size'] // r['model_dim']} | {r['mode']} "
                         f"| {_pct(r['copy_acc_step0'])} | {_pct(r['copy_acc'])} | {_pct(r['copy_acc_best'])} "
                         f"| {r['copy_nll']:.3f} | {lam} | {r['steps_done']} ({r['steps']}) | {r['stop']} "
                         f"| {r['exposures_min']} / {r['exposures_median']:g} | {r['wall_s']:.0f}s |")
        lines += ["", f"Plateau: over the last {PLATEAU_WINDOW:.0%} of the steps so far the accuracy rose by at most "
                  f"{100 * PLATEAU_ACC_GAIN:g} point and the NLL fell by at most {PLATEAU_NLL_DROP} nats (or the "
                  f"accuracy is >= {SOLVED:.0%}), checked every evaluation from the minimum number of steps on.", ""]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines))


def write_results(results, out_dir, command, settings):
    """The grid's results.md and results.json (the first study's format, with D)."""
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(command=command, settings=settings, results=results), f, indent=1)
    lines = ["# SpamLang results", "", "Produced by:", "", f"    {command}", "",
             "Model: " + ", ".join(f"{k}={v}" for k, v in MODEL.items() if k != "model_dim")
             + f", model_dim (D) per row; steps={settings['steps']}, batch={settings['batch']} sequences of"
             f" seq_len={settings['seq_len']}, {settings['eval_seqs']} held-out sequences per run.",
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
             "| task | V | D | mode | seed | copy acc | copy acc @0 | copy NLL | lambda | seen | acc seen "
             "| final train loss | wall time |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lam = f"{r['lam']:.3f}" if "lam" in r else "-"
        lines.append(f"| {r['task']} | {r['vocab_size']} | {r['model_dim']} | {r['mode']} | {r['seed']} "
                     f"| {_pct(r['copy_acc'])} | {_pct(r['copy_acc_step0'])} | {max(r['copy_nll'], 0.0):.3f} | {lam} "
                     f"| {_pct(r['seen'])} | {_pct(r['copy_acc_seen'])} | {r['train_loss']:.4f} | {r['wall_s']:.0f}s |")
    lines += ["", f"Total wall time: {sum(r['wall_s'] for r in results):.0f}s", ""]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines))


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("spamlang: matplotlib is not installed; no plot written")
        return None


def plot_results(results, path):
    """The grid: accuracy against V, one line per task and mode."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, task in enumerate(TASKS):
        for mode in ("vanilla", "cplm"):
            rows = [r for r in results if r["task"] == task and r["mode"] == mode]
            vocabs = sorted({r["vocab_size"] for r in rows})
            if not vocabs:
                continue
            acc = [100 * sum(r["copy_acc"] for r in rows if r["vocab_size"] == v)
                   / sum(1 for r in rows if r["vocab_size"] == v) for v in vocabs]
            ax.plot(vocabs, acc, marker="o" if mode == "cplm" else "s", linestyle="-" if mode == "cplm" else "--",
                    markersize=7 if mode == "cplm" else 5, color=f"C{i}", label=f"{task}, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("copy accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title("SpamLang, D = " + ", ".join(str(d) for d in sorted({r["model_dim"] for r in results})))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_v2_results(results, path):
    """The sweep: accuracy against V/D, final (solid) and at step 0 (dotted), one colour per task and mode."""
    sweep = [r for r in results if r["part"] == "sweep"]
    plt = _pyplot() if sweep else None
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colour = 0
    for task in TASKS:
        for mode in ("vanilla", "cplm"):
            rows = [r for r in sweep if r["task"] == task and r["mode"] == mode]
            if not rows:
                continue
            ratios = sorted({r["vocab_size"] / r["model_dim"] for r in rows})
            for key, style, label in (("copy_acc", "-", f"{task}, {mode}"), ("copy_acc_step0", ":", None)):
                acc = [100 * sum(r[key] for r in rows if r["vocab_size"] / r["model_dim"] == q)
                       / sum(1 for r in rows if r["vocab_size"] / r["model_dim"] == q) for q in ratios]
                ax.plot(ratios, acc, linestyle=style, marker="o" if style == "-" else None, color=f"C{colour}",
                        label=label)
            colour += 1
    ax.axhline(100 * BREAK_ACCURACY, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("V / D  (V = " + ", ".join(str(v) for v in sorted({r["vocab_size"] for r in sweep})) + ")")
    ax.set_ylabel("held-out copy accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title("SpamLang v2: final (solid), at step 0 (dotted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def command_line(argv):
    prefix = "OMP_NUM_THREADS=" + os.environ["OMP_NUM_THREADS"] + " " if "OMP_NUM_THREADS" in os.environ else ""
    nice = os.nice(0) if hasattr(os, "nice") else 0
    prefix += f"nice -n {nice} " if nice else ""
    return prefix + " ".join(["python", "experiments/spamlang.py", *argv])


# -----------------------------------------------------------------------------------------------------
# Command line

# the grid's flags and defaults (the first study's); --study v2 fixes them all
GRID_DEFAULTS = dict(task="both", vocabs=",".join(map(str, DEFAULT_VOCABS)), dims=str(MODEL["model_dim"]),
                     modes="vanilla,cplm", steps=100, batch=2, seq_len=64, eval_seqs=32, eval_every=0,
                     min_exposures=0, plateau_min_steps=0, momentum_warmup_frac=0.2, copy_gate_init=None, **OPTIM)


def _int_list(p, flag, text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{flag} takes integers separated by commas, not {text!r}")
    if not values:
        p.error(f"{flag} needs at least one value")
    return values


def parse_args(argv):
    """Returns (args, specs): the checked flags and the runs they ask for."""
    p = OneLineParser(prog="spamlang.py", description=__doc__.split("\n")[0])
    p.add_argument("--study", default="grid", choices=["grid", "v2"],
                   help="grid (default): the runs the flags below define; v2: the controlled study (fixed runs)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each its own process with one thread")
    p.add_argument("--out", default=None, help="default records/spamlang_v2 (v2), records/spamlang (grid)")
    g = p.add_argument_group("grid (the first study's defaults)")
    g.add_argument("--task", help=f"comma-separated: {', '.join(TASKS)}; both = repeat,span; all")
    g.add_argument("--vocabs")
    g.add_argument("--dims", help="widths D, multiples of 8")
    g.add_argument("--modes", help="comma-separated: vanilla, cplm")
    g.add_argument("--steps", type=int, help="steps (with --plateau_min_steps: the cap)")
    g.add_argument("--batch", type=int, help="sequences per step")
    g.add_argument("--seq_len", type=int)
    g.add_argument("--eval_seqs", type=int, help="held-out sequences per run")
    g.add_argument("--eval_every", type=int, help="steps between evaluations; 0: only at step 0 and at the end")
    g.add_argument("--min_exposures", type=int,
                   help="held-out rows only from tokens that were the copy target of >= this many training rows")
    g.add_argument("--plateau_min_steps", type=int, help="> 0: stop at a plateau from this step on")
    for k in OPTIM:
        g.add_argument(f"--{k}", type=float)
    g.add_argument("--momentum_warmup_frac", type=float)
    g.add_argument("--copy_gate_init", type=float,
                   help="CPLM gate at step 0 (default: the training script's; 0: closed, c = 1/padded vocab)")
    args = p.parse_args(argv)
    seeds = _int_list(p, "--seeds", args.seeds)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    given = [k for k in GRID_DEFAULTS if getattr(args, k) is not None]
    if args.study == "v2":
        if given:
            p.error(f"--study v2 fixes its runs: drop --{given[0]} (or use --study grid)")
        args.out = args.out or "records/spamlang_v2"
        return args, v2_specs(seeds)
    for k, v in GRID_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.out = args.out or "records/spamlang"
    named = {"both": ["repeat", "span"], "all": list(TASKS)}
    tasks = named.get(args.task) or [t.strip() for t in args.task.split(",") if t.strip()]
    if not tasks or not set(tasks) <= set(TASKS):
        p.error(f"--task: comma-separated {', '.join(TASKS)}, or both or all; not {args.task!r}")
    vocabs = _int_list(p, "--vocabs", args.vocabs)
    dims = _int_list(p, "--dims", args.dims)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if min(vocabs) < 2:
        p.error("--vocabs: sizes of at least 2")
    if min(dims) < 8 or any(d % 8 for d in dims):
        p.error("--dims: multiples of 8 (2 heads whose rotary halves need 4 dimensions each)")
    if not modes or not set(modes) <= {"vanilla", "cplm"}:
        p.error("--modes: vanilla and/or cplm")
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2 or args.eval_seqs < 1:
        p.error("--steps, --batch, --eval_seqs must be >= 1, --seq_len >= 2")
    if args.eval_every < 0 or args.min_exposures < 0 or args.plateau_min_steps < 0:
        p.error("--eval_every, --min_exposures, --plateau_min_steps must be >= 0")
    if args.plateau_min_steps and not (0 < 4 * args.eval_every <= args.plateau_min_steps <= args.steps):
        p.error("--plateau_min_steps needs --eval_every > 0, at least 4 evaluations before it, and <= --steps")
    if args.copy_gate_init is not None and not 0 <= args.copy_gate_init < 1:
        p.error("--copy_gate_init must lie in [0, 1)")
    if "span" in tasks and (args.seq_len < 2 * MIN_SPAN or min(vocabs) - 1 < args.seq_len):
        p.error(f"span needs --seq_len >= {2 * MIN_SPAN} and every vocabulary larger than --seq_len")
    if "lookup" in tasks and (args.seq_len < 2 * MIN_PERIOD or min(vocabs) - 1 < min(MAX_PERIOD, args.seq_len // 2)):
        p.error(f"lookup needs --seq_len >= {2 * MIN_PERIOD} and every vocabulary larger than its block")
    optim = {k: getattr(args, k) for k in OPTIM}
    specs = [RunSpec("grid", task, vocab, dim, mode, seed, args.steps, args.batch, args.seq_len, args.eval_seqs,
                     args.eval_every, args.min_exposures, args.plateau_min_steps, args.copy_gate_init,
                     args.momentum_warmup_frac, optim)
             for task in tasks for vocab in vocabs for dim in dims for mode in modes for seed in seeds]
    return args, specs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, specs = parse_args(argv)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:  # e.g. a file where the folder should be
        print(f"spamlang.py: error: cannot create --out {args.out} ({e.strerror}); choose another folder",
              file=sys.stderr)
        return 1
    tg.import_cpu_head().use_heap_for_large_tensors()
    command = command_line(argv)
    print(f"spamlang: {command}", flush=True)
    t0 = time.perf_counter()
    if args.study == "v2":
        def on_result(results):
            write_v2_results(results, args.out, command, time.perf_counter() - t0)
    else:
        settings = dict(tasks=sorted({s.task for s in specs}, key=TASKS.index),
                        vocabs=sorted({s.vocab_size for s in specs}), dims=sorted({s.model_dim for s in specs}),
                        modes=sorted({s.mode for s in specs}), seeds=sorted({s.seed for s in specs}),
                        steps=args.steps, batch=args.batch, seq_len=args.seq_len, eval_seqs=args.eval_seqs,
                        eval_every=args.eval_every, min_exposures=args.min_exposures,
                        plateau_min_steps=args.plateau_min_steps, optim=specs[0].optim,
                        momentum_warmup_frac=args.momentum_warmup_frac,
                        copy_gate_init=(tg.GPTConfig.copy_gate_init if args.copy_gate_init is None
                                        else args.copy_gate_init or "closed (1/padded vocab)"),
                        threads=torch.get_num_threads(), jobs=args.jobs)

        def on_result(results):
            write_results(results, args.out, command, settings)
    try:
        results = run_study(specs, args.out, args.jobs, on_result)
    except ValueError as e:  # a held-out set that the training rows cannot supply, found once the rows exist
        print(f"spamlang.py: error: {e}", file=sys.stderr)
        return 1
    if args.study == "v2":
        plot_v2_results(results, os.path.join(args.out, "spamlang.png"))
    else:
        plot_results(results, os.path.join(args.out, "spamlang.png"))
    wall = time.perf_counter() - t0
    print(f"spamlang: wrote {os.path.join(args.out, 'results.md')}; wall time {wall:.0f}s for: {command}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
