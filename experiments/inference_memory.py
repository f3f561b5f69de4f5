"""Bytes that generation's caches hold per token of context: vanilla with full attention, vanilla with a
sliding window, and CPLM with a sliding window (the window's keys and values plus one CP key and one token
id per position of the document), at the speedrun model's size.

    python experiments/inference_memory.py                       # writes records/inference_memory/results.md
    python experiments/inference_memory.py --contexts 4096,16384,65536 --computed 1024

Why: beyond its window a sliding-window CPLM still copies from the whole document, and for that it caches
only the CP head's keys (cp_dim wide) and the tokens they emit, where full attention caches a key and a
value of model_dim in every attention layer. The paper reports 12x less memory at 4k tokens for a 1.7B SW
CPLM that matches full attention; this measures the same ratio for the speedrun's 12 x 768 model.

Three numbers per (configuration, context), which must agree:
  formula   from the config alone: per attention layer, the positions a window of w blocks of 128 tokens
            keeps (those the next token can see: at most 128 w, the whole document under full attention,
            none in the layer without attention) x 2 (key, value) x model_dim x 2 bytes (bf16); CPLM adds
            cp_dim x 2 bytes + a 4-byte token id per position of the document;
  meta      the tensor bytes of InferenceCache after generate's prefill of the context, the model on
            PyTorch's meta device: the same code builds the same tensors (shapes, dtypes) without arithmetic,
            which is how 64k tokens fit in minutes on a CPU;
  computed  the same with real arithmetic (random weights, bf16 activations as on a GPU: the embeddings
            in bf16, as train_gpt_cplm does on CUDA), at the --computed contexts that fit in about a minute
            of one CPU core each.
The model's weights (the same for every row) are not counted: only what grows with the context.
"""
import dataclasses
import os
import sys
import time

import torch

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path

import train_gpt_cplm as tg  # noqa: E402
import inference  # noqa: E402

BF16_BYTES, ID_BYTES = 2, 4
# (name, cplm, window in blocks of the long layers; None: full attention)
CONFIGS = [
    ("vanilla, full attention", 0, None),
    ("CPLM, full attention", 1, None),
    ("vanilla, window 1792/896 (the speedrun's final)", 0, 14),
    ("CPLM, window 1792/896 (the speedrun's final)", 1, 14),
    ("vanilla, window 256/128 (long layers at the window of the paper's SW needle model)", 0, 2),
    ("CPLM, window 256/128 (long layers at the window of the paper's SW needle model)", 1, 2),
]


def speedrun_config(cplm, max_seq_len) -> tg.GPTConfig:
    """GPTConfig of the speedrun preset (GPT-2's vocabulary, 12 x 768, 6 heads, cp_dim from the defaults)."""
    a = dataclasses.replace(tg.parse_args(["--preset", "speedrun"]), vocab_size=tg.GPT2_VOCAB_SIZE,
                            bos_id=tg.GPT2_VOCAB_SIZE - 1, cplm=cplm)
    return dataclasses.replace(tg.GPTConfig.from_args(a), max_seq_len=max_seq_len)


def formula_bytes(config: tg.GPTConfig, window, context, act_bytes=BF16_BYTES, id_bytes=ID_BYTES) -> dict:
    """The caches' bytes after a one-document context of `context` tokens, from the config alone."""
    long_window = tg.window_pattern(config.num_layers)
    kv = 0
    for layer in range(config.num_layers):
        if layer == config.no_attention_layer:
            continue
        w = None if window is None else (window if long_window[layer] else max(window // 2, 1))
        keep_from = 0 if w is None else max(0, (context // tg.BLOCK - w + 1) * tg.BLOCK)
        kv += (context - keep_from) * 2 * config.model_dim * act_bytes
    cp_keys = context * config.cp_dim * act_bytes if config.cplm else 0
    cp_ids = context * id_bytes if config.cplm else 0
    return {"kv": kv, "cp_keys": cp_keys, "cp_ids": cp_ids}


def measured_bytes(config: tg.GPTConfig, window, context, device, prefill_chunk=512, seed=0) -> dict:
    """InferenceCache.nbytes() after prefilling BOS + context - 1 random tokens, as generate does."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = tg.GPT(config)
    for module in model.modules():  # bf16 activations, as the training script sets up a GPU
        if isinstance(module, torch.nn.Embedding):
            module.bfloat16()
    ids = [config.bos_id] + torch.randint(0, config.vocab_size - 1, (context - 1,)).tolist()
    cache = inference.InferenceCache(model.eval(), window, prefill_chunk=prefill_chunk)
    cache.extend(ids)
    return cache.nbytes()


def parse_contexts(p, text, flag):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} takes token counts separated by commas, not {text!r}")
    if not values or min(values) < 1:
        p.error(f"{flag} needs positive token counts")
    return values


def parse_args(argv=None):
    p = OneLineParser(prog="inference_memory.py", description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="4096,16384,65536", help="contexts (tokens) for formula and meta device")
    p.add_argument("--computed", default="1024", help="contexts computed for real on the CPU ('' for none)")
    p.add_argument("--out", default=os.path.join("records", "inference_memory", "results.md"),
                   help="markdown file to write (default records/inference_memory/results.md)")
    args = p.parse_args(argv)
    args.contexts = parse_contexts(p, args.contexts, "--contexts")
    args.computed = parse_contexts(p, args.computed, "--computed") if args.computed.strip() else []
    return args


def mib(n):
    return f"{n / 2 ** 20:,.2f}"


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    rows = []
    longest = max(args.contexts + args.computed)
    for context in sorted(set(args.contexts) | set(args.computed)):
        full = sum(formula_bytes(speedrun_config(0, longest), None, context).values())
        for name, cplm, window in CONFIGS:
            config = speedrun_config(cplm, next_multiple_of_block(longest))
            formula = formula_bytes(config, window, context)
            how, t0 = [], time.perf_counter()
            measured = None
            if context in args.contexts:
                measured = measured_bytes(config, window, context, "meta", prefill_chunk=4096)
                how.append("meta")
            if context in args.computed:
                computed = measured_bytes(config, window, context, "cpu")
                if measured is not None and computed != measured:
                    raise AssertionError(f"{name} at {context}: computed {computed} != meta {measured}")
                measured = computed
                how.append("computed")
            if measured != formula:
                raise AssertionError(f"{name} at {context}: the caches hold {measured}, the formula says {formula}")
            total = sum(measured.values())
            rows.append((context, name, measured, total, full, "+".join(how), time.perf_counter() - t0))
            print(f"{context:6d} {name:55s} {mib(total):>10s} MiB  {full / total:6.1f}x less than full attention "
                  f"({'+'.join(how)}, {rows[-1][-1]:.0f}s)", flush=True)
    write_table(args, rows)
    return 0


def next_multiple_of_block(n):
    return tg.next_multiple(n, tg.BLOCK)


def write_table(args, rows):
    lines = ["# Inference memory: what generation caches per token of context", "",
             f"`python experiments/inference_memory.py --contexts {','.join(map(str, args.contexts))} "
             f"--computed {','.join(map(str, args.computed))}` (one CPU thread). The speedrun model: 12 layers x 768, "
             "6 heads, no attention in layer 7, long layers 0, 4, 7, 11 (layer 7 has none), cp_dim 64; caches in "
             "bf16, token ids int32. Window 1792/896: the long and short layers' windows at the end of the "
             "speedrun (14 and 7 blocks of 128 tokens); 256/128: long layers at 256 tokens, the window of the paper's SW model in the needle test, short ones at 128.", "",
             "Every row's bytes are the tensor bytes of `InferenceCache` after `generate`'s prefill of one "
             "document of that many tokens, and equal the formula from the config (the script checks it). "
             "`meta`: built on PyTorch's meta device (the same code and tensors, no arithmetic); `computed`: "
             "with real arithmetic on the CPU (random weights, bf16 activations), at the contexts that fit in "
             "about a minute each; 64k tokens of real arithmetic do not on this CPU.", "",
             "| context | configuration | KV MiB | CP keys MiB | CP ids MiB | total MiB | bytes / token | "
             "x less than vanilla full | measured |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for context, name, m, total, full, how, _ in rows:
        lines.append(f"| {context:,} | {name} | {mib(m['kv'])} | {mib(m['cp_keys'])} | {mib(m['cp_ids'])} | "
                     f"{mib(total)} | {total / context:,.0f} | {full / total:.1f} | {how} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
