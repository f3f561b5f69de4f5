"""Where a CPLM copies from: for every token of a text, the earlier position its CP head pointed at most
(argmax alpha) and how open the copy path was (lambda), as a self-contained HTML page and a PNG.

    python experiments/copy_picture.py logs/RUN/state_step001000.pt --text notes.txt --out records/copy_picture

The text is one document (BOS, then its tokens, at most --max_tokens). Token x_{t+1} is predicted at
position t, so each token is shown with the CP head's state at the position before it:
  lambda = c (1 - s)  how much of p comes through the copy path (c: the <copy> gate, s: the sink's share);
  source              argmax over tau <= t of alpha_t(tau): the position it pointed at most, with alpha there
                      (and, since alpha is often spread over many occurrences of the token, the strongest
                      earlier occurrence of the token itself: where the copied probability came from most);
  copy share          lambda p_CP(x_{t+1}) / p(x_{t+1}): the part of the probability the model gave the
                      actual token that came from copying (0 when the token never occurred before).
In the HTML each token's background is lambda (white 0 -> green 1), it is underlined when the copy share
is above one half, and hovering shows the source position, its text in context, alpha, c, s and the copy
share. The PNG plots lambda along the text over the copy map (the source position of every token, coloured
by the copy share). Computed densely (T x T scores, the training forward with the checkpoint's window),
so texts of a few thousand tokens. Exit codes: 0 done, 1 unreadable checkpoint, tokenizer or text,
2 bad command line or a vanilla checkpoint (it has no CP head).
"""
import html
import json
import os
import sys

import torch

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path
from codec import CodecError, codec_for

import train_gpt_cplm as tg  # noqa: E402
import inference  # noqa: E402


def parse_args(argv=None):
    p = OneLineParser(prog="copy_picture.py", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a CPLM checkpoint written by train_gpt_cplm.py (--cplm 1)")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--out", default=os.path.join("records", "copy_picture"), help="folder for the HTML and PNG")
    p.add_argument("--name", default=None, help="file name stem (default: the text file's name)")
    p.add_argument("--max_tokens", type=int, default=1024, help="tokens of the text used, BOS included (default 1024)")
    p.add_argument("--attention", choices=("trained", "full"), default="trained",
                   help="trained: the checkpoint's sliding window; full: whole documents (default trained)")
    p.add_argument("--tokenizer", default=None, help="a tokenizers tokenizer.json (default: found from the checkpoint)")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max_tokens must be >= 2")
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # refused before the model is read
        p.error(f"--out {args.out} is a file: it names a folder for the HTML and PNG")
    return args


@torch.no_grad()
def copy_trace(model: tg.GPT, ids, window_blocks=None) -> dict:
    """Per position t of one document (ids (T,)), the CP head's view of the next token: lists of length
    T - 1 for the tokens x_1..x_{T-1}: source (argmax tau of alpha_t), alpha (there), lam, c, s and
    copy_share (lambda p_CP(x_{t+1}) / p(x_{t+1}))."""
    x = torch.as_tensor(ids)[None]
    T = x.size(1)
    if window_blocks is not None:
        window_blocks = torch.tensor(window_blocks, dtype=torch.int32)
    h, _ = model.hidden_states(x, window_blocks)
    log_p_full = model.lm_logits(h)
    copy_id = model.config.copy_id
    log_p_full[..., copy_id] += model.copy_logit_bias
    log_p_full = log_p_full.log_softmax(-1)[0]
    q, k, sink_key = model.cp_head(h)
    scale = q.size(-1) ** -0.5
    scores = (q[0].float() @ k[0].float().T * scale).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    a_sink = q[0].float() @ sink_key.float() * scale
    alpha = torch.cat([scores, a_sink[:, None]], 1).softmax(-1)  # last column: the sink
    s = alpha[:, -1]
    c = log_p_full[:, copy_id].exp()
    lam = c * (1 - s)
    source = alpha[:, :-1].argmax(-1)
    # the mixture's probability of the actual next token, and the copy path's part of it
    log_p = inference.mixture_log_probs(model, model.lm_logits(h), q, k, x)[0]
    nxt = x[0, 1:]
    p_y = log_p[:-1].gather(-1, nxt[:, None])[:, 0].exp()
    same = x[0][None, :] == nxt[:, None]  # (T - 1, T): key tau holds the next token
    copy_mass = (alpha[:-1, :-1] * same).sum(-1)  # c * this = the copy term lambda p_CP(y)
    copy_share = (c[:-1] * copy_mass / p_y).clamp(0, 1)
    # alpha is often spread over many occurrences of the token: the strongest one, -1 where there is none
    on_token = alpha[:-1, :-1].masked_fill(~same.tril(), -1.0)
    token_source = torch.where(on_token.amax(-1) >= 0, on_token.argmax(-1), -1)
    rows = torch.arange(T - 1)
    return {"source": source[:-1].tolist(), "alpha": alpha[rows, source[:-1]].tolist(),
            "token_source": token_source.tolist(), "token_alpha": on_token.amax(-1).clamp_min(0).tolist(),
            "lam": lam[:-1].tolist(), "c": c[:-1].tolist(), "s": s[:-1].tolist(), "copy_share": copy_share.tolist()}


def render_html(pieces, trace, title):
    """One span per token x_1..x_{T-1}: background lambda, underline when mostly copied, hover the source."""
    def context(tau, width=6):
        left = "".join(pieces[max(1, tau - width):tau])
        return f"{left}[{pieces[tau]}]{''.join(pieces[tau + 1:tau + 1 + width])}"

    spans = []
    for t, piece in enumerate(pieces[1:]):
        lam, share, tau = trace["lam"][t], trace["copy_share"][t], trace["source"][t]
        hover = (f"token {t + 1}; lambda {lam:.2f} (c {trace['c'][t]:.2f}, s {trace['s'][t]:.2f}); "
                 f"copy share {share:.2f}; points at position {tau} (alpha {trace['alpha'][t]:.2f}): {context(tau)}")
        own = trace["token_source"][t]
        hover += (f"; strongest earlier occurrence of this token: position {own} (alpha {trace['token_alpha'][t]:.2f}): "
                  f"{context(own)}" if own >= 0 else "; the token did not occur before")
        style = f"background: rgba(30, 160, 60, {lam:.3f});" + (" text-decoration: underline;" if share > 0.5 else "")
        spans.append(f'<span style="{style}" title="{html.escape(hover, quote=True)}">{html.escape(piece)}</span>')
    body = "".join(spans)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
.text {{ font-family: monospace; white-space: pre-wrap; line-height: 1.6; }}
span:hover {{ outline: 1px solid #333; }}</style></head>
<body><h3>{html.escape(title)}</h3>
<p>Background: lambda, how open the copy path was for the token (white 0, green 1). Underlined: more than half
of the probability the model gave the token came from copying. Hover a token: the earlier position the CP head
pointed at most (argmax alpha), in context, the strongest earlier occurrence of the token itself, and the gates.</p>
<div class="text">{body}</div></body></html>
"""


def render_png(trace, path, title):
    """lambda along the text over the copy map; None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = list(range(1, len(trace["lam"]) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    top.plot(t, trace["lam"], lw=0.8, color="tab:green")
    top.set_ylabel("lambda")
    top.set_ylim(0, 1)
    top.set_title(title, fontsize=9)
    points = bottom.scatter(t, trace["source"], c=trace["copy_share"], s=6, cmap="viridis", vmin=0, vmax=1)
    bottom.plot([0, len(t)], [0, len(t)], lw=0.5, color="grey")
    bottom.set_xlabel("token position")
    bottom.set_ylabel("source position (argmax alpha)")
    fig.colorbar(points, ax=bottom, label="copy share of p(token)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    try:
        model, a, step = inference.load_model(args.checkpoint, max_seq_len=args.max_tokens)
        if not a.cplm:
            print(f"copy_picture.py: error: {args.checkpoint} is a vanilla checkpoint: it has no CP head "
                  "(pass one trained with --cplm 1)", file=sys.stderr)
            return 2
        if a.copy_gate != "lm":
            print(f"copy_picture.py: error: {args.checkpoint} is a pointer-sentinel checkpoint (--copy_gate "
                  f"{a.copy_gate}): the picture reads the paper's <copy> gate c, which it does not have",
                  file=sys.stderr)
            return 2
        codec = codec_for(a, args.tokenizer)
        try:
            text = open(args.text, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise tg.DataError(f"--text {args.text}: cannot read it as UTF-8 text ({type(e).__name__})")
    except (tg.DataError, CodecError) as e:
        print(f"copy_picture.py: error: {e}", file=sys.stderr)
        return 1
    ids = ([a.bos_id] + codec.encode(text))[:args.max_tokens]
    if len(ids) < 2:
        print(f"copy_picture.py: error: --text {args.text} holds no tokens", file=sys.stderr)
        return 1
    window = tg.window_blocks(step, a) if args.attention == "trained" else None
    trace = copy_trace(model, ids, window)
    pieces = ["<BOS>"] + [codec.piece(i) for i in ids[1:]]  # position 0 is the BOS; the page shows 1..T-1
    name = args.name or os.path.splitext(os.path.basename(args.text))[0]
    title = (f"{a.run_id} step {step}: what the CP head copied in {os.path.basename(args.text)} "
             f"({len(ids) - 1} tokens, mean lambda {sum(trace['lam']) / len(trace['lam']):.2f})")
    os.makedirs(args.out, exist_ok=True)
    page = os.path.join(args.out, f"{name}.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(render_html(pieces, trace, title))
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(checkpoint=args.checkpoint, step=step, tokens=ids, **trace), f)
    png = render_png(trace, os.path.join(args.out, f"{name}.png"), title)
    print(f"wrote {page}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
