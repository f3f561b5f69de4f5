"""cp_kernel.py: the CP head's two log-sum-exps in one Triton kernel each way (train_gpt_cplm.py's
`--cp_backend lse_kernel`, CUDA only; imported only when that backend runs, and then its source follows the
script's in the run's log).

What it computes is copy_lses' (train_gpt_cplm.py): for every query t, over the keys tau <= t of t's document,
    lse_doc[t]   = logsumexp_tau a_t(tau)
    lse_match[t] = logsumexp_tau a_t(tau) over those with x_tau = y_t (only tau = t where t has nothing to copy)
with a_t(tau) = q_t . k_tau / sqrt(d). The FlexAttention backend gets the same two numbers from two attention
calls, each with a value, an output and (backward) a delta kernel that the loss never needs. Here one forward
kernel visits each (query block, key block) tile once and keeps both running sums; the backward kernel, launched
twice, computes dq (a program per query block) and dk (a program per key block) from
    d lse / d a_t(tau) = g_doc[t] softmax_doc(t, tau) + g_match[t] softmax_match(t, tau).
Tiles are skipped by the document bounds alone: a query block starts at its first query's document start, a key
block's queries end at its last key's document end (documents are contiguous: doc_ids never decrease).

The roofline (gpu_check/roofline.py, records/gpu/roofline.md) puts the saving at up to 0.40 ms a step of the
speedrun on an H100 or H200 (CPLM / vanilla 1.010 -> 1.005): the 64-row query blocks halve the longest document's
loop, which sets the CP sums' time.
gpu_check/cuda_cp_check.py checks it against the dense reference and times it against FlexAttention on a GPU;
test_cp_kernel.py checks values and gradients in Triton's interpreter on a CPU and compiles it for sm_80/90.
"""
import torch
import triton
import triton.language as tl

BLOCK_M = BLOCK_N = 64  # a tile: the longest document's loop, not the tile count, sets the kernel's time
NUM_WARPS = 8  # with 4 the backward's dq spills on sm_80 (test_cp_kernel.py)
LOG2E = 1.4426950408889634


@triton.jit
def _online_lse(run_max, run_sum, s, keep):
    """One tile's update of a row-wise log-sum-exp in base 2, over the scores s where keep holds."""
    s = tl.where(keep, s, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(s, 1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key yet: no -inf - -inf
    run_sum = run_sum * tl.exp2(run_max - shift) + tl.sum(tl.exp2(s - shift[:, None]), 1)
    return new_max, run_sum


@triton.jit
def _masks(offs_m, offs_n, doc_q, doc_k, target_q, own_only_q, ids_k):
    """The document-causal mask and the match mask of a tile (keys past T carry doc -2: never a query's)."""
    causal_doc = (offs_m[:, None] >= offs_n[None, :]) & (doc_q[:, None] == doc_k[None, :])
    own = own_only_q[:, None] & (offs_m[:, None] == offs_n[None, :])
    return causal_doc, causal_doc & ((ids_k[None, :] == target_q[:, None]) | own)


@triton.jit
def _key_rows(K, DOCS, IDS, row, offs_n, T, D: tl.constexpr):
    """A key block: k, its documents and tokens (keys past T: zeros, document -2, token -2)."""
    in_n = offs_n < T
    k = tl.load(K + (row + offs_n)[:, None] * D + tl.arange(0, D)[None, :], mask=in_n[:, None], other=0.0)
    return k, tl.load(DOCS + row + offs_n, mask=in_n, other=-2), tl.load(IDS + row + offs_n, mask=in_n, other=-2)


@triton.jit
def _query_rows(Q, TARGETS, DOCS, OWN_ONLY, row, offs_m, T, D: tl.constexpr):
    """A query block: q, its targets, documents (-1 past T) and whether its only match is its own position."""
    in_m = offs_m < T
    q = tl.load(Q + (row + offs_m)[:, None] * D + tl.arange(0, D)[None, :], mask=in_m[:, None], other=0.0)
    return (q, tl.load(TARGETS + row + offs_m, mask=in_m, other=-1), tl.load(DOCS + row + offs_m, mask=in_m, other=-1),
            tl.load(OWN_ONLY + row + offs_m, mask=in_m, other=0) != 0)


@triton.jit
def _query_grads(LSE_DOC, LSE_MATCH, GRAD_DOC, GRAD_MATCH, row, offs_m, T):
    """A query block's two LSEs (base 2) and their gradients (zeros past T)."""
    in_m = offs_m < T
    return (tl.load(LSE_DOC + row + offs_m, mask=in_m, other=0.0) * 1.4426950408889634,
            tl.load(LSE_MATCH + row + offs_m, mask=in_m, other=0.0) * 1.4426950408889634,
            tl.load(GRAD_DOC + row + offs_m, mask=in_m, other=0.0),
            tl.load(GRAD_MATCH + row + offs_m, mask=in_m, other=0.0))


@triton.jit
def cp_lses_forward(Q, K, IDS, TARGETS, DOCS, OWN_ONLY, DOC_START, LSE_DOC, LSE_MATCH, T,
                    SCALE_LOG2: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Both log-sum-exps of a query block, in float32, over the key blocks from its document's start (base-2 sums:
    the scale is the score scale times log2 e; a constant, as a float argument would be fp64 under inductor)."""
    m_block, row = tl.program_id(0), tl.program_id(1) * T
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < T
    q, target_q, doc_q, own_only_q = _query_rows(Q, TARGETS, DOCS, OWN_ONLY, row, offs_m, T, D)
    doc_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    match_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    doc_sum = tl.zeros([BLOCK_M], tl.float32)
    match_sum = tl.zeros([BLOCK_M], tl.float32)
    lo = tl.load(DOC_START + row + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    hi = tl.minimum((m_block + 1) * BLOCK_M, T)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, doc_k, ids_k = _key_rows(K, DOCS, IDS, row, offs_n, T, D)
        s = tl.dot(q, tl.trans(k)) * SCALE_LOG2
        causal_doc, match = _masks(offs_m, offs_n, doc_q, doc_k, target_q, own_only_q, ids_k)
        doc_max, doc_sum = _online_lse(doc_max, doc_sum, s, causal_doc)
        match_max, match_sum = _online_lse(match_max, match_sum, s, match)
    tl.store(LSE_DOC + row + offs_m, (doc_max + tl.log2(doc_sum)) * 0.6931471805599453, mask=in_m)
    tl.store(LSE_MATCH + row + offs_m, (match_max + tl.log2(match_sum)) * 0.6931471805599453, mask=in_m)


@triton.jit
def _score_grads(q, k, offs_m, offs_n, doc_q, doc_k, target_q, own_only_q, ids_k, lse_doc2, lse_match2,
                 grad_doc, grad_match, scale_log2):
    """d loss / d a_t(tau) on a tile: each LSE's gradient times its softmax, where its mask holds."""
    s = tl.dot(q, tl.trans(k)) * scale_log2
    causal_doc, match = _masks(offs_m, offs_n, doc_q, doc_k, target_q, own_only_q, ids_k)
    ds = tl.where(causal_doc, grad_doc[:, None] * tl.exp2(s - lse_doc2[:, None]), 0.0)
    return ds + tl.where(match, grad_match[:, None] * tl.exp2(s - lse_match2[:, None]), 0.0)


@triton.jit
def cp_lses_backward(Q, K, IDS, TARGETS, DOCS, OWN_ONLY, DOC_START, DOC_END, LSE_DOC, LSE_MATCH, GRAD_DOC,
                     GRAD_MATCH, DQ, DK, T, SCALE: tl.constexpr, SCALE_LOG2: tl.constexpr,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOR_KEYS: tl.constexpr):
    """dq, a program per query block; or (FOR_KEYS, a launch of its own: fewer registers than both in one) dk, a
    program per key block."""
    pid, row = tl.program_id(0), tl.program_id(1) * T
    offs_d = tl.arange(0, D)
    if not FOR_KEYS:
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        q, target_q, doc_q, own_only_q = _query_rows(Q, TARGETS, DOCS, OWN_ONLY, row, offs_m, T, D)
        lse_doc2, lse_match2, grad_doc, grad_match = _query_grads(LSE_DOC, LSE_MATCH, GRAD_DOC, GRAD_MATCH, row,
                                                                  offs_m, T)
        dq = tl.zeros([BLOCK_M, D], tl.float32)
        lo = tl.load(DOC_START + row + pid * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid + 1) * BLOCK_M, T)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k, doc_k, ids_k = _key_rows(K, DOCS, IDS, row, offs_n, T, D)
            ds = _score_grads(q, k, offs_m, offs_n, doc_q, doc_k, target_q, own_only_q, ids_k, lse_doc2, lse_match2,
                              grad_doc, grad_match, SCALE_LOG2)
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + (row + offs_m)[:, None] * D + offs_d[None, :], (dq * SCALE).to(DQ.dtype.element_ty),
                 mask=(offs_m < T)[:, None])
    else:
        n_block = pid
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        k, doc_k, ids_k = _key_rows(K, DOCS, IDS, row, offs_n, T, D)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        lo = n_block * BLOCK_N // BLOCK_M * BLOCK_M
        hi = tl.load(DOC_END + row + tl.minimum((n_block + 1) * BLOCK_N, T) - 1) + 1
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q, target_q, doc_q, own_only_q = _query_rows(Q, TARGETS, DOCS, OWN_ONLY, row, offs_m, T, D)
            lse_doc2, lse_match2, grad_doc, grad_match = _query_grads(LSE_DOC, LSE_MATCH, GRAD_DOC, GRAD_MATCH, row,
                                                                      offs_m, T)
            ds = _score_grads(q, k, offs_m, offs_n, doc_q, doc_k, target_q, own_only_q, ids_k, lse_doc2, lse_match2,
                              grad_doc, grad_match, SCALE_LOG2)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(DK + (row + offs_n)[:, None] * D + offs_d[None, :], (dk * SCALE).to(DK.dtype.element_ty),
                 mask=(offs_n < T)[:, None])


def _document_bounds(doc_ids):
    """Each position's document's first and last position, int32 (B, T); documents are contiguous."""
    start = torch.searchsorted(doc_ids, doc_ids, side="left")
    end = torch.searchsorted(doc_ids, doc_ids, side="right") - 1
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


@torch.library.triton_op("cplm::cp_lses", mutates_args=())
def _cp_lses(q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor,
             own_only: torch.Tensor, doc_start: torch.Tensor,
             doc_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, D = q.shape
    lse_doc = torch.empty(B, T, device=q.device, dtype=torch.float32)
    lse_match = torch.empty_like(lse_doc)
    torch.library.wrap_triton(cp_lses_forward)[(triton.cdiv(T, BLOCK_M), B)](
        q, k, ids, targets, docs, own_only, doc_start, lse_doc, lse_match, T, SCALE_LOG2=D ** -0.5 * LOG2E,
        D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    return lse_doc, lse_match


@torch.library.triton_op("cplm::cp_lses_backward", mutates_args=())
def _cp_lses_backward(q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor,
                      docs: torch.Tensor, own_only: torch.Tensor, doc_start: torch.Tensor, doc_end: torch.Tensor,
                      lse_doc: torch.Tensor, lse_match: torch.Tensor, grad_doc: torch.Tensor,
                      grad_match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, D = q.shape
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    for for_keys, blocks in ((False, triton.cdiv(T, BLOCK_M)), (True, triton.cdiv(T, BLOCK_N))):
        torch.library.wrap_triton(cp_lses_backward)[(blocks, B)](
            q, k, ids, targets, docs, own_only, doc_start, doc_end, lse_doc, lse_match, grad_doc, grad_match, dq, dk,
            T, SCALE=D ** -0.5, SCALE_LOG2=D ** -0.5 * LOG2E, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            FOR_KEYS=for_keys, num_warps=NUM_WARPS)
    return dq, dk


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward_of_cp_lses(ctx, grad_doc, grad_match):
    q, k, *rest, lse_doc, lse_match = ctx.saved_tensors
    grads = [torch.zeros_like(lse) if g is None else g.float().contiguous()
             for g, lse in ((grad_doc, lse_doc), (grad_match, lse_match))]
    dq, dk = _cp_lses_backward(q, k, *rest, lse_doc, lse_match, *grads)
    return dq, dk, None, None, None, None, None, None


_cp_lses.register_autograd(_backward_of_cp_lses, setup_context=_setup_context)


def cp_lses(q, k, input_ids, target_ids, doc_ids, copyable):
    """(lse_doc, lse_match), float32 (B, T), as train_gpt_cplm.copy_lses returns them; q, k (B, T, d) with d a
    power of two from 16 to 256 (a Triton dot's), on a CUDA device (a CPU under TRITON_INTERPRET=1: float32 and
    float16 there, whose bf16 dot is broken), bf16 as training has them (float32 ones take TF32 dots on a GPU)."""
    d = q.size(-1)
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"--cp_backend lse_kernel needs --cp_dim a power of two from 16 to 256, not {d}")
    doc_start, doc_end = _document_bounds(doc_ids)
    as_int32 = (t.to(torch.int32).contiguous() for t in (input_ids, target_ids, doc_ids))
    return _cp_lses(q.contiguous(), k.contiguous(), *as_int32, (~copyable).to(torch.int8).contiguous(),
                    doc_start, doc_end)
