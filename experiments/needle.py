"""Needle in a haystack: can a checkpoint recall a 7-digit number stated once, far back in its context?

    python experiments/needle.py logs/RUN/state_step001000.pt --contexts 1024,2048,4096 --trials 5
    python experiments/needle.py CKPT                 # contexts: 1, 2, 4, 8 and 16 x the training length

The paper's test (cplm-method.md: a sliding-window CPLM retrieves the needle at up to 16x its training
context, SW 14.3 -> 99.4): one sentence "The magic number is 4817263." at one of 8 depths (0, 1/7, ...,
1 of the way through the filler) in neutral text, the context ending with the cue "What is the magic
number? The magic number is", then greedy decoding (generate, temperature 0) of as many tokens as the
number takes. A trial is right when the first number in the continuation is exactly the needle's.

Filler: real sentences from the checkpoint's own validation split (its --val_files, decoded with its
tokenizer), never seen in training: sentences of 40-400 characters without digits (so the needle is the
only number) from the first documents of the split, a pool of 8 times the longest context (at least 32Ki
tokens), each encoded on its own with a leading space and concatenated until the context is full.
Trial i of a cell draws its number and the sentence to start from with random.Random(seed, context, depth,
i), so a cell's trials differ and a rerun repeats them. The context is one document: BOS, filler with
the needle, cue; its length is the nominal context minus at most one sentence.

Attention uses the window the checkpoint was trained with at its step (--attention trained) unless
--attention full; the CP head, when there is one, always sees the whole document. Writes a markdown table
(exact-match accuracy per context and depth), the raw trials as JSON and, when matplotlib is installed, a
heat map PNG into --out. Exit codes: 0 done, 1 unreadable checkpoint, tokenizer or data, 2 bad command line.
"""
import contextlib
import json
import os
import random
import re
import sys
import textwrap
import time

import numpy as np
import torch

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path
from codec import CodecError, codec_for

import train_gpt_cplm as tg  # noqa: E402
import inference  # noqa: E402

NEEDLE = " The magic number is {}."
CUE = " What is the magic number? The magic number is"
NUM_DEPTHS = 8
MAX_CONTEXT = 262144  # 4 x the paper's longest needle context (64k); its filler pool, 8 contexts, is 2M tokens


def parse_args(argv=None):
    p = OneLineParser(prog="needle.py", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a checkpoint written by train_gpt_cplm.py")
    p.add_argument("--contexts", default="", help="context lengths in tokens, comma-separated "
                   "(default: 1, 2, 4, 8, 16 x the checkpoint's --seq_len)")
    p.add_argument("--trials", type=int, default=5, help="trials per (context, depth) cell (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the numbers and filler offsets (default 0)")
    p.add_argument("--attention", choices=("trained", "full"), default="trained",
                   help="trained: the checkpoint's sliding window; full: whole documents (default trained)")
    p.add_argument("--tokenizer", default=None, help="a tokenizers tokenizer.json (default: found from the checkpoint)")
    p.add_argument("--val_files", default=None, help="shards to take the filler from (default: the checkpoint's)")
    p.add_argument("--out", default=os.path.join("records", "needle"), help="folder for the results")
    p.add_argument("--name", default=None, help="file name stem (default: the checkpoint's run_id and step)")
    args = p.parse_args(argv)
    try:
        args.contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    except ValueError:
        p.error(f"--contexts takes token counts separated by commas, not {args.contexts!r}")
    if any(c < 64 or c > MAX_CONTEXT for c in args.contexts):
        p.error(f"--contexts must lie in 64..{MAX_CONTEXT} tokens each (the needle and the cue need room; the "
                "filler pool is 8 contexts long)")
    if args.trials < 1 or args.seed < 0:
        p.error("--trials must be >= 1 and --seed >= 0")
    if args.name is not None and not re.fullmatch(r"[\w.-]+", args.name) or args.name in (".", ".."):
        p.error(f"--name must be a plain file stem (letters, digits, '.', '_', '-'), not {args.name!r}")
    return args


def filler_sentences(val_files, codec, bos_id, tokens_wanted):
    """[(text, ids)]: digit-free sentences of 40-400 characters from the validation documents, in order,
    until they hold tokens_wanted tokens (or the split ends)."""
    sentences, have = [], 0
    for path in tg.find_shards(val_files):
        tokens = np.asarray(tg.load_shard(path))
        starts = np.flatnonzero(tokens == bos_id).tolist() + [len(tokens)]
        for lo, hi in zip(starts[:-1], starts[1:]):
            text = codec.decode(tokens[lo + 1:hi].tolist())
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
                if 40 <= len(sentence) <= 400 and not re.search(r"\d", sentence) and sentence[0].isupper():
                    ids = codec.encode(" " + sentence)
                    sentences.append(ids)
                    have += len(ids)
            if have >= tokens_wanted:
                return sentences
    if not sentences:
        raise tg.DataError(f"{val_files}: no usable filler sentences (digit-free, 40-400 characters)")
    return sentences


def haystack(sentences, codec, bos_id, context, depth, rng):
    """(ids, number, index of the needle's first token): one document of at most `context` tokens: BOS, filler from a random sentence on
    (wrapping around) with the needle after the filler sentence nearest depth x the filler, then the cue."""
    number = str(rng.randrange(1_000_000, 10_000_000))
    needle, cue = codec.encode(NEEDLE.format(number)), codec.encode(CUE)
    budget = context - 1 - len(needle) - len(cue)
    filler, start = [], rng.randrange(len(sentences))
    for i in range(len(sentences)):
        s = sentences[(start + i) % len(sentences)]
        if sum(map(len, filler)) + len(s) > budget:
            break
        filler.append(s)
    total = sum(map(len, filler))
    lengths = np.cumsum([0] + [len(s) for s in filler])
    at = int(np.abs(lengths - depth * total).argmin())  # needle after `at` filler sentences
    before = [bos_id] + [t for s in filler[:at] for t in s]
    ids = before + needle + [t for s in filler[at:] for t in s] + cue
    return ids, number, len(before)


def first_number(text):
    match = re.match(r"\s*(\d+)", text)
    return match.group(1) if match else None


class AnswerProbe:
    """What the CP head does at the answer (the prompt's last position, where generate asks its first query):
    the copy path's opening lambda = c (1 - s), the share of the pointer (alpha without the sink) on the
    needle's digit tokens, and its share on every position holding the answer's first token: p_CP of the
    right next token, so lambda times it is what the copy path gives the right answer. Reads the query from a
    hook on the CP head's W_Q and the keys from generate's cache."""

    def __init__(self, model):
        self.model, self.h, self.q = model, None, None

    def __enter__(self):
        def first_query(module, args, out):
            if self.q is None:
                self.h, self.q = args[0].float(), out.float()
        self.handle = self.model.cp_head.w_q.register_forward_hook(first_query)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    @torch.no_grad()
    def read(self, cache, prompt_len, needle_positions, answer_positions):
        """The prompt is one document from its BOS at 0, so its CP keys are cache.cp_keys[:, :prompt_len].
        needle_positions: the needle's digit tokens; answer_positions: every position holding the answer's
        first token."""
        if cache.doc_start != 0:
            raise RuntimeError("the prompt's document is gone from the cache (a generated BOS): nothing to read")
        m, copy_id = self.model, self.model.config.copy_id
        logits = m.lm_logits(self.h).float()[0, -1]
        logits[copy_id] += m.copy_logit_bias.float()
        c = logits.softmax(-1)[copy_id]
        q, keys = self.q[0, -1], cache.cp_keys[0, :prompt_len].float()
        alpha = (torch.cat([keys @ q, (m.cp_head.sink_key.float() @ q)[None]]) * q.numel() ** -0.5).softmax(-1)
        s = alpha[-1]
        return dict(lam=float(c * (1 - s)), needle_share=float(alpha[needle_positions].sum() / (1 - s)),
                    answer_share=float(alpha[answer_positions].sum() / (1 - s)))


def run(model, codec, a, step, contexts, trials, seed, attention, val_files, log=print):
    """Every trial of every (context, depth) cell: [{context, depth, trial, number, answer, correct}]."""
    window = tg.window_blocks(step, a) if attention == "trained" else None
    # a pool of several contexts' worth, so the trials of a cell start from different text
    sentences = filler_sentences(val_files, codec, a.bos_id, max(8 * max(contexts), 32768))
    results = []
    for context in contexts:
        t0 = time.perf_counter()
        for d in range(NUM_DEPTHS):
            depth = d / (NUM_DEPTHS - 1)
            for trial in range(trials):
                rng = random.Random(f"{seed}-{context}-{d}-{trial}")
                ids, number, needle_at = haystack(sentences, codec, a.bos_id, context, depth, rng)
                cache = inference.InferenceCache(model, window)
                with AnswerProbe(model) if model.cp_head is not None else contextlib.nullcontext() as probe:
                    new = inference.generate(model, ids, len(codec.encode(" " + number)) + 1, temperature=0.0,
                                      window_blocks=window, cache=cache)
                answer = codec.decode(new)
                results.append(dict(context=context, depth=round(depth, 4), trial=trial, tokens=len(ids), number=number,
                                    answer=answer, correct=first_number(answer) == number))
                if probe is not None:
                    needle = codec.encode(NEEDLE.format(number))
                    digits = [needle_at + j for j, t in enumerate(needle) if any(ch.isdigit() for ch in codec.piece(t))]
                    # the answer's first token is the needle's first digit token, wherever else it occurs
                    answer_positions = [j for j, t in enumerate(ids) if t == ids[digits[0]]]
                    results[-1].update(probe.read(cache, len(ids), digits, answer_positions))
        acc = np.mean([r["correct"] for r in results if r["context"] == context])
        log(f"context {context}: accuracy {100 * acc:.1f}% ({time.perf_counter() - t0:.0f}s)")
    return results


def table(results, contexts, title):
    depths = sorted({r["depth"] for r in results})
    lines = [title, "", "| context | " + " | ".join(f"depth {d:.2f}" for d in depths) + " | mean |",
             "|---:|" + "---:|" * (len(depths) + 1)]
    for c in contexts:
        cells = [np.mean([r["correct"] for r in results if r["context"] == c and r["depth"] == d]) for d in depths]
        lines.append(f"| {c:,} | " + " | ".join(f"{100 * x:.0f}" for x in cells) + f" | {100 * np.mean(cells):.1f} |")
    if results and "lam" in results[0]:  # CPLM: the CP head at the answer, over every trial of a context
        lines += ["", "The CP head at the answer (the prompt's last position; means over the trials): lambda = c (1 - s), "
                  "how open the copy path is; needle share = the pointer's weight (sink excluded) on the needle's "
                  "digit tokens, and lambda x needle share, the probability mass the copy path puts there; answer share = "
                  "the pointer's weight on every position holding the answer's first token (p_CP of the right next "
                  "token), and lambda x answer share, the probability the copy path gives the right first token.", "",
                  "| context | lambda | needle share | lambda x needle share | answer share | lambda x answer share |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for c in contexts:
            rs = [r for r in results if r["context"] == c]
            mean = lambda f: np.mean([f(r) for r in rs])  # noqa: E731
            lines.append(f"| {c:,} | {mean(lambda r: r['lam']):.3f} | {mean(lambda r: r['needle_share']):.3f} "
                         f"| {mean(lambda r: r['lam'] * r['needle_share']):.3f} | {mean(lambda r: r['answer_share']):.3f} "
                         f"| {mean(lambda r: r['lam'] * r['answer_share']):.3f} |")
    return "\n".join(lines) + "\n"


def heat_map(results, contexts, path, title):
    """A PNG of accuracy per (context, depth); None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    depths = sorted({r["depth"] for r in results})
    grid = np.array([[np.mean([r["correct"] for r in results if r["context"] == c and r["depth"] == d])
                      for d in depths] for c in contexts])
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(depths), 1.2 + 0.5 * len(contexts)))
    im = ax.imshow(100 * grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_yticks(range(len(contexts)), [f"{c:,}" for c in contexts])
    ax.set_xlabel("needle depth (fraction of the filler before it)")
    ax.set_ylabel("context (tokens)")
    for i in range(len(contexts)):
        for j in range(len(depths)):
            ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="exact-match accuracy (%)")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    try:  # before the computation (minutes): a results folder that cannot be written loses nothing yet
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, f".needle_probe{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        print(f"needle.py: error: --out {args.out}: cannot write results there ({e.strerror})", file=sys.stderr)
        return 1
    try:
        _, a, step = inference.load_model(args.checkpoint)
        if a.copy_gate != "lm":
            raise tg.DataError(f"{args.checkpoint} is a pointer-sentinel checkpoint (--copy_gate {a.copy_gate}): "
                               "the needle test reads the paper's <copy> gate c, which it does not have")
        contexts = args.contexts or [m * a.seq_len for m in (1, 2, 4, 8, 16)]
        model, a, step = inference.load_model(args.checkpoint, max_seq_len=tg.next_multiple(max(contexts) + 16, tg.BLOCK))
        codec = codec_for(a, args.tokenizer)
        val_files = args.val_files or a.val_files
        results = run(model, codec, a, step, contexts, args.trials, args.seed, args.attention, val_files)
    except (tg.DataError, CodecError) as e:
        print(f"needle.py: error: {e}", file=sys.stderr)
        return 1
    name = args.name or f"{a.run_id or 'model'}_step{step}_{args.attention}"
    window = tg.window_blocks(step, a)
    attention = (f"the trained window: long layers {window * tg.BLOCK} tokens, short {max(window // 2, 1) * tg.BLOCK}"
                 if args.attention == "trained" else "full (whole document)")
    title = (f"Needle in a haystack: {a.run_id} step {step} ({'CPLM' if a.cplm else 'vanilla'}, trained on "
             f"{a.seq_len}-token rows; attention: {attention}); exact-match accuracy (%), {args.trials} trials a cell")
    os.makedirs(args.out, exist_ok=True)
    command = "python experiments/needle.py " + " ".join(sys.argv[1:]) if argv is None else ""
    text = table(results, contexts, f"# {title}") + (f"\n`{command}`\n" if command else "")
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(checkpoint=args.checkpoint, step=step, attention=args.attention, results=results), f, indent=1)
    png = heat_map(results, contexts, os.path.join(args.out, f"{name}.png"), title)
    print(text + (f"heat map: {png}" if png else "no heat map: matplotlib is not installed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
