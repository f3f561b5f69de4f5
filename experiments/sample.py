"""Sample text from a trained checkpoint, vanilla or CPLM, through generate's caches.

    python experiments/sample.py logs/RUN/state_step001000.pt --prompt "The server" --max_new_tokens 100
    python experiments/sample.py CKPT --prompt "..." --temperature 0        # greedy
    python experiments/sample.py CKPT --prompt "..." --attention full      # no window, whatever training used

The prompt becomes one document: BOS, then its tokens (the tokenizer: see experiments/codec.py). The
continuation is drawn from the model's next-token distribution (CPLM: the mixture of the LM head and the
copy distribution) at --temperature among the --top_k most likely tokens, with --seed fixing the draws.
Attention uses the window the checkpoint was trained with at its step (--attention trained) unless
--attention full. Generation stops after --max_new_tokens, or at a BOS (the model ended the document).
Prints the prompt and the continuation. Exit codes: 0 done, 1 missing or unreadable checkpoint or
tokenizer, 2 bad command line.
"""
import math
import sys

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path
from codec import CodecError, codec_for

import train_gpt_cplm as tg  # noqa: E402
import inference  # noqa: E402


def parse_args(argv=None):
    p = OneLineParser(prog="sample.py", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a checkpoint written by train_gpt_cplm.py (logs/<run_id>/state_stepNNNNNN.pt)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top_k", type=int, default=50, help="draw among the k most likely tokens; 0: all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--tokenizer", default=None, help="a tokenizers tokenizer.json (default: found from the checkpoint)")
    p.add_argument("--attention", choices=("trained", "full"), default="trained",
                   help="trained: the checkpoint's sliding window; full: whole documents (default trained)")
    args = p.parse_args(argv)
    if not (0 <= args.max_new_tokens <= 2 ** 20 and 0 <= args.temperature < math.inf and args.top_k >= 0
            and 0 <= args.seed < 2 ** 63):
        p.error("need 0 <= --max_new_tokens <= 1048576, --top_k >= 0, 0 <= --seed < 2^63, --temperature finite and >= 0")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell could not decode arrive as lone surrogates
        p.error("--prompt is not valid UTF-8 text")
    return args


def inference_window(a: tg.Hyperparameters, step, attention):
    """The long layers' window (blocks) the checkpoint was trained with at its step, or None (full)."""
    return tg.window_blocks(step, a) if attention == "trained" else None


def main(argv=None):
    args = parse_args(argv)
    try:
        model, a, step = inference.load_model(args.checkpoint)
        codec = codec_for(a, args.tokenizer)
        prompt = [a.bos_id] + codec.encode(args.prompt)
        if len(prompt) + args.max_new_tokens > model.config.max_seq_len:  # room in the rotary table
            model, a, step = inference.load_model(args.checkpoint, max_seq_len=len(prompt) + args.max_new_tokens)
    except (tg.DataError, CodecError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 1
    new = generate_until_bos(model, prompt, args, inference_window(a, step, args.attention))
    print(args.prompt + codec.decode(new))
    return 0


def generate_until_bos(model, prompt, args, window):
    """generate's tokens up to the first BOS (the end of the document the prompt began)."""
    new = inference.generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, window_blocks=window)
    bos = model.config.bos_id
    return new[:new.index(bos)] if bos in new else new


if __name__ == "__main__":
    sys.exit(main())
