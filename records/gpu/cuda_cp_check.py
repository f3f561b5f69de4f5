"""CUDA path of the CP loss against the dense path, on the GPU, with bf16 tolerances (records/gpu/gpu_check.sh).

FlexAttention (compiled, bf16 q/k) computes the two masked log-sum-exps; the dense chunked path computes
them in fp32 from the same inputs. Values and gradients (q, k, sink key, logits) are compared on a packed
row with several documents and with targets that never occur in their context. Exit code 1 on a mismatch.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import train_gpt_cplm as tg  # noqa: E402


def packed_row(T, bos, vocab, generator):
    ids = torch.randint(0, vocab, (1, T), generator=generator)
    ids[ids == bos] = 0
    ids[0, torch.randint(1, T, (T // 700,), generator=generator)] = bos  # documents of ~700 tokens
    ids[0, 0] = bos
    return ids


def run(backend, logits, q, k, sink, ids, targets, copy_id, compiled):
    inputs = [x.detach().clone().requires_grad_() for x in (logits, q, k, sink)]
    doc_ids = tg.doc_ids_of(ids, 50256)
    copyable = tg.target_in_context(ids, targets, doc_ids, logits.size(-1))
    fn = compiled if backend == "flex" else tg.cplm_target_log_prob
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(inputs[0], inputs[1], inputs[2], inputs[3], ids, targets, doc_ids, copyable, copy_id, backend=backend)
    out["log_p"].sum().backward()
    torch.cuda.synchronize()
    return out["log_p"].detach(), [x.grad for x in inputs], time.perf_counter() - t0, copyable


def main():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    T, d, Vp, copy_id = 8192, 64, 50304, 50257
    ids = packed_row(T, 50256, 2000, g)  # a small alphabet: most targets are copyable
    targets = torch.roll(ids, -1, 1)
    targets[0, ::97] = 45000  # never in the context
    logits = (torch.randn(1, T, Vp, generator=g) * 3)
    q, k = torch.randn(2, 1, T, d, generator=g).unbind(0)
    sink = torch.randn(d, generator=g)
    ids, targets, logits = ids.to(dev), targets.to(dev), logits.to(dev)
    q, k, sink = q.to(dev).bfloat16(), k.to(dev).bfloat16(), sink.to(dev)
    compiled = torch.compile(tg.cplm_target_log_prob, dynamic=False)
    run("flex", logits, q, k, sink, ids, targets, copy_id, compiled)  # compile
    fast, fast_grads, fast_s, copyable = run("flex", logits, q, k, sink, ids, targets, copy_id, compiled)
    dense, dense_grads, dense_s, _ = run("dense", logits, q.float(), k.float(), sink, ids, targets, copy_id, None)
    ok = True

    def check(name, a, b, rtol, atol):
        nonlocal ok
        a, b = a.float(), b.float()
        finite = bool(torch.isfinite(a).all())
        err = ((a - b).abs() - atol - rtol * b.abs()).max().item()
        max_abs = (a - b).abs().max().item()
        passed = finite and err <= 0
        ok &= passed
        print(f"{name:>10}: max |fast - dense| = {max_abs:.3e} (scale {b.abs().max().item():.3e}) "
              f"finite={finite} {'ok' if passed else 'MISMATCH'}")

    print(f"T={T} d={d} copyable share={copyable.float().mean().item():.3f}")
    check("log p(y)", fast, dense, 2e-2, 2e-2)
    for name, a, b in zip(["logits", "q", "k", "sink"], fast_grads, dense_grads):
        check("d/d " + name, a, b, 5e-2, 5e-2 * b.abs().max().item() / 10)
    print(f"fwd+bwd time: flex {1000 * fast_s:.1f} ms, dense chunked {1000 * dense_s:.1f} ms")
    print("cuda cp check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
