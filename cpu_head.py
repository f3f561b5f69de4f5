"""cpu_head.py: the LM head's losses for eager CPU training, and the heap setting CPU runs need. The CPU evidence
(records/) trains with these; the speedrun never runs them. train_gpt_cplm.py imports this file only on a CPU
(`eager_cpu_head_loss`), each CPU run's log holds its source, and the suite tests each against the
record's bits (test_cplm.py: VanillaLossCPU, LMHeadTermsCPU).

Eager CPU fuses nothing: written as train_gpt_cplm's HeadLoss is (for inductor), each elementwise step over the
(N, V) logits would be a full float32 pass to memory and back, and several such tensors alive at once fragment
the heap. Here every pass goes over a few rows at a time, with a hand-written backward.
"""
import ctypes

import torch
import torch.nn.functional as F


# train_gpt_cplm.py's soft_cap and vanilla_nll, the record's formulas, restated so that this file imports nothing
# from the script that imports it (test_imports.py checks the two pairs agree bit for bit)
def soft_cap(u, cap):
    return 2 * cap * torch.sigmoid(u.float() / (cap / 2)) if cap > 0 else u.float()


def vanilla_nll(head_out, target_ids, softcap, reduction="mean"):
    return F.cross_entropy(soft_cap(head_out, softcap).flatten(0, -2), target_ids.flatten(), reduction=reduction)


class VanillaLossCPU(torch.autograd.Function):
    """vanilla_nll's mean for eager CPU training in chunks of rows: the record's loss keeps about five (N, V)
    float32 tensors alive, which fragmented the CPU heap (peak 3.8-4.6 GB against 1.7). The forward makes each
    chunk's gradient for an upstream 1 while it is in cache; the backward scales it by a power of two (exact)
    or recomputes. The record's bits (loss and gradient, tested) where V > 4096 (below, the softmax kernels'
    32 KiB row groups meet chunk edges) and with 1, 2 or 4 threads (3, 5, 6: ~1e-13 in a few entries)."""

    @staticmethod
    def forward(ctx, head_out, target_ids, softcap, chunk=32):
        u, t = head_out.flatten(0, -2), target_ids.flatten()
        grad = torch.empty_like(u) if ctx.needs_input_grad[0] else None
        nll = VanillaLossCPU.chunks(u, t, softcap, chunk, grad, torch.ones((), device=u.device))
        ctx.save_for_backward(u, t)
        ctx.grad = grad  # handed over once (not saved_tensors, which would keep it alive after the backward)
        ctx.softcap, ctx.chunk, ctx.shape = softcap, chunk, head_out.shape
        return VanillaLossCPU.mean(nll)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (u, t), grad, ctx.grad = ctx.saved_tensors, ctx.grad, None
        # not a power of two (scaling would round) or a second backward (retain_graph): make it with g itself
        if grad is None or torch.frexp(g).mantissa.abs() != 0.5:
            grad = torch.empty_like(u)
            VanillaLossCPU.chunks(u, t, ctx.softcap, ctx.chunk, grad, g)
        elif g != 1:
            grad.mul_(g)
        return grad.view(ctx.shape), None, None, None

    @staticmethod
    def mean(nll):
        """The mean of per-token nll (N,), summed in F.cross_entropy's own order (the same bits)."""
        return F.nll_loss(-nll[:, None], torch.zeros(nll.size(0), dtype=torch.long, device=nll.device))

    @staticmethod
    def chunks(u, t, softcap, chunk, grad=None, upstream=None):
        """Per-row nll (N,) of the flattened logits u, chunk rows at a time; with grad, also d(upstream x mean
        nll)/du into grad, computed as the mean's backward does (upstream / N handed to every row). Without
        grad, autograd records the chunks as usual (evaluation, or training on per-token losses)."""
        nll = []
        for lo in range(0, u.size(0), chunk):
            if grad is None:
                nll.append(vanilla_nll(u[lo:lo + chunk], t[lo:lo + chunk], softcap, reduction="none"))
                continue
            with torch.enable_grad():
                x = u[lo:lo + chunk].detach().requires_grad_()
                nll.append(vanilla_nll(x, t[lo:lo + chunk], softcap, reduction="none"))
                row_grad = (upstream / u.size(0)).expand_as(nll[-1])
                grad[lo:lo + chunk] = torch.autograd.grad(nll[-1], x, row_grad)[0]
            nll[-1] = nll[-1].detach()
        return torch.cat(nll)

    @staticmethod
    def token_nll(head_out, target_ids, softcap, chunk=32):
        """vanilla_nll(reduction="none"), flattened, in chunks of rows (the same values where V > 4096)."""
        return VanillaLossCPU.chunks(head_out.flatten(0, -2), target_ids.flatten(), softcap, chunk)


class LMHeadTermsCPU(torch.autograd.Function):
    """lm_head_terms for eager CPU runs, forward and backward in chunks of rows small enough for the cache,
    each pass in place: eager CPU fuses nothing, and written as lm_head_terms is, each elementwise step would
    be a full (N, V) float32 pass to memory and back, forward and backward (a CPLM step cost 1.3x vanilla's)."""

    @staticmethod
    def forward(ctx, head_out, target_ids, copy_id, softcap, chunk=16):
        u, t = head_out.flatten(0, -2), target_ids.flatten()
        lse = u.new_empty(u.size(0), dtype=torch.float32)
        for lo in range(0, u.size(0), chunk):
            if softcap > 0:  # z = 2 cap sigmoid(2 u / cap) lies in (0, 2 cap): exp(z) needs no max subtracted
                e = u[lo:lo + chunk].float().mul(2 / softcap).sigmoid_().mul_(2 * softcap).exp_()
                e[:, copy_id] = 0
                lse[lo:lo + chunk] = e.sum(-1).log_()
            else:
                z = u[lo:lo + chunk].float().clone()
                z[:, copy_id] = float("-inf")
                lse[lo:lo + chunk] = z.logsumexp(-1)
        z_copy = soft_cap(u[:, copy_id], softcap)  # two single logits: (N,) each
        z_y = soft_cap(u.gather(1, t[:, None])[:, 0], softcap)
        ctx.save_for_backward(u, t, lse)
        ctx.copy_id, ctx.softcap, ctx.chunk, ctx.shape = copy_id, softcap, chunk, head_out.shape
        return tuple(x.view(head_out.shape[:-1]) for x in (lse, z_copy, z_y))

    @staticmethod
    def backward(ctx, g_lse, g_copy, g_y):
        u, t, lse = ctx.saved_tensors
        g_lse, g_copy, g_y = (g.flatten().float() for g in (g_lse, g_copy, g_y))
        cap, c, copy_id = ctx.softcap, ctx.chunk, ctx.copy_id
        grad = torch.empty_like(u)
        # d lse / d z_v = softmax over the slots but <copy>; dz/du = 4 s (1 - s), s = sigmoid(2 u / cap)
        row_scale = (g_lse * torch.exp(-lse) * (4 if cap > 0 else 1))[:, None]
        for lo in range(0, u.size(0), c):
            g = grad[lo:lo + c]
            if cap > 0:
                sig = u[lo:lo + c].float().mul(2 / cap).sigmoid_()
                torch.mul(sig, 2 * cap, out=g).exp_().mul_(row_scale[lo:lo + c]).mul_(sig)
                g.mul_(sig.neg_().add_(1))
            else:
                torch.exp(u[lo:lo + c].float(), out=g).mul_(row_scale[lo:lo + c])
        # the two single logits: <copy> is out of the softmax; the target's own term is added
        rows = torch.arange(u.size(0))
        def dz_du(x):
            if cap == 0:
                return torch.ones_like(x, dtype=torch.float32)
            sig = torch.sigmoid(x.float() * (2 / cap))
            return 4 * sig * (1 - sig)
        grad[:, copy_id] = g_copy * dz_du(u[:, copy_id])
        grad[rows, t] += g_y * dz_du(u[rows, t])
        return grad.view(ctx.shape), None, None, None, None


class EagerCPUHeadLoss:
    """train_gpt_cplm.HeadLoss's quantities for eager CPU runs, which fuse nothing: in chunks of rows (VanillaLossCPU,
    LMHeadTermsCPU). Without gradients (validation) the head runs 1024 positions at a time: its (T, V) tensors
    then fit the holes that training's leave in the heap (use_heap_for_large_tensors), so validation adds
    nothing to the peak."""

    def __init__(self, softcap, copy_id):
        self.softcap, self.copy_id = softcap, copy_id

    def vanilla_mean(self, lm_head, h, target_ids):
        if lm_head.out_features <= 4096:  # VanillaLossCPU is the record's bits only above (and small tensors)
            return vanilla_nll(lm_head(h), target_ids, self.softcap)
        return VanillaLossCPU.apply(lm_head(h), target_ids, self.softcap)

    def vanilla_token_nll(self, lm_head, h, target_ids):
        return torch.cat([VanillaLossCPU.token_nll(lm_head(h[:, p]), target_ids[:, p], self.softcap).view_as(
            target_ids[:, p]) for p in self.pieces(h)], 1)

    def terms(self, lm_head, h, target_ids):
        pieces = [slice(None)] if torch.is_grad_enabled() else self.pieces(h)
        return [torch.cat(t, 1) for t in zip(*(
            LMHeadTermsCPU.apply(lm_head(h[:, p]), target_ids[:, p], self.copy_id, self.softcap) for p in pieces))]

    @staticmethod
    def pieces(h):
        return [slice(lo, lo + 1024) for lo in range(0, h.size(1), 1024)]


def use_heap_for_large_tensors():
    """On CPU: glibc hands every large freed block (a (T, V) logit tensor) back to the kernel and page-faults
    it in again at the next allocation, which costs more than the arithmetic on those tensors. Keep freed
    memory in the heap instead (glibc only; elsewhere nothing changes)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1)
    except (OSError, AttributeError):
        pass
