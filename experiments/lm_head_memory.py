"""Peak memory of the loss at the LM head, vanilla against CPLM, under torch.compile on CPU.

    python experiments/lm_head_memory.py [--tokens 8192] [--vocab 50304]

Each mode's loss runs forward and backward, compiled by inductor, on the same bf16 head output u
(tokens x vocab, as the FP8 head hands it over) and, for CPLM, random 64-wide queries and keys over
packed documents. torch.profiler records every allocation; the peak is the largest sum of live bytes above the
inputs, and every allocation of at least tokens x vocab bytes is listed, so an (N, V) float32 buffer
(4 bytes a slot) stands out from the (N, V) bf16 gradient that both modes must return.
vanilla: the record's F.cross_entropy on the soft-capped logits (train_gpt_cplm.vanilla_nll);
cplm: train_gpt_cplm.cplm_target_log_prob (its LM-head terms and the CP head's sums, dense backend).
"""
import json

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from cli import OneLineParser  # experiments/cli.py: also puts the repository root on sys.path

import train_gpt_cplm as tg  # noqa: E402

SOFTCAP, COPY_ID, CP_DIM = 15.0, 50257, 64


def inputs(tokens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(1, tokens, vocab, generator=g) * 3).bfloat16().requires_grad_()
    ids = torch.randint(0, 2000, (1, tokens), generator=g)  # a small alphabet: many targets are copyable
    ids[0, torch.randint(0, tokens, (tokens // 700,), generator=g)] = 50256  # documents of ~700 tokens
    targets = torch.roll(ids, -1, 1)
    q, k = (torch.randn(1, tokens, CP_DIM, generator=g).bfloat16().requires_grad_() for _ in range(2))
    sink = torch.zeros(CP_DIM, requires_grad=True)
    return u, ids, targets, q, k, sink


def vanilla_loss(u, ids, targets, q, k, sink):
    return tg.vanilla_nll(u, targets, SOFTCAP)


def cplm_loss(u, ids, targets, q, k, sink):
    doc_ids = tg.doc_ids_of(ids, 50256)
    copyable = tg.target_in_context(ids, targets, doc_ids, u.size(-1))
    out = tg.cplm_target_log_prob(u, q, k, sink, ids, targets, doc_ids, copyable, COPY_ID,
                                  copy_bias=torch.tensor(0.0), softcap=SOFTCAP, backend="dense")
    return -out["log_p"].mean()


def allocations(fn, args):
    """(peak live bytes above what existed before, [sizes of allocations >= threshold]) of fn(*args).backward()."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args).backward()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak, [size for _, size in sorted(events) if size > 0]


def main(argv=None):
    parser = OneLineParser(prog="lm_head_memory.py", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=50304)
    args = parser.parse_args(argv)
    if args.tokens < 128 or args.vocab <= COPY_ID:
        parser.error(f"need --tokens >= 128 and --vocab > {COPY_ID} (the <copy> slot)")
    nv = args.tokens * args.vocab
    result = {"tokens": args.tokens, "vocab": args.vocab, "torch": torch.__version__, "threads": torch.get_num_threads()}
    for name, fn in (("vanilla", vanilla_loss), ("cplm", cplm_loss)):
        compiled = torch.compile(fn, dynamic=False)
        data = inputs(args.tokens, args.vocab)
        compiled(*data).backward()  # compile outside the measurement
        for x in data:
            x.grad = None
        peak, sizes = allocations(compiled, data)
        big = [s for s in sizes if s >= nv]
        result[name] = {"peak_MiB": round(peak / 2 ** 20, 1),
                        "allocations_of_at_least_N_x_V_bytes_MiB": [round(s / 2 ** 20, 1) for s in big],
                        "fp32_NxV_buffers": sum(s >= 4 * nv for s in big)}
        print(f"{name:>8}: peak {peak / 2 ** 20:8.1f} MiB above the inputs; allocations >= N x V bytes (MiB): "
              f"{[round(s / 2 ** 20) for s in big]}", flush=True)
    ratio = result["cplm"]["peak_MiB"] / result["vanilla"]["peak_MiB"]
    result["cplm_over_vanilla_peak"] = round(ratio, 3)
    print(json.dumps(result))
    print(f"N={args.tokens} V={args.vocab}: cplm/vanilla LM-head peak memory = {ratio:.3f}")


if __name__ == "__main__":
    main()
