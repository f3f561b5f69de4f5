"""train_gpt_cplm.py: a NanoGPT-speedrun-style GPT on FineWeb, vanilla or Copy-Paste LM (CPLM).

    torchrun --standalone --nproc_per_node=8 train_gpt_cplm.py             # vanilla: the 2025-01-26 record
    torchrun --standalone --nproc_per_node=8 train_gpt_cplm.py --cplm 1    # the same run with a CP head
    python train_gpt_cplm.py --preset cpu                                  # small model on a CPU

Sections, in the order data flows: config -> data -> model (backbone, CP head) -> loss -> optimizer ->
distributed loop. The method, in short, is in README.md; here, look for `CopyPasteHead`,
`cplm_target_log_prob` (the mixture loss) and `Hyperparameters.cplm` (the switch). Beside this file:
run_files.py (the run's log, lock and checkpoints; its source follows this one's in every log) and
inference.py (the dense reference of the mixture, generation, loading a checkpoint): the speedrun never runs
inference.py.
"""
import argparse
import copy
import dataclasses
import inspect
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

import run_files  # the run's settings checks, shard checks, log, lock and checkpoints: nothing a step computes
from run_files import (DataError, UsageError, check_args, check_token_range, environment_lines, find_shards,
                       resolve_vocabulary, shard_header)
from run_files import GPT2_VOCAB_SIZE, read_checkpoint  # noqa: F401  (for importers: inference.py, experiments)

# -----------------------------------------------------------------------------------------------------
# Config


@dataclass
class Hyperparameters:
    preset: str = "auto"  # speedrun (8xH100) | gpu1 (one GPU) | cpu (2 cores) | auto: speedrun with CUDA, else cpu
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of train shards
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # glob of val shards
    val_tokens: int = 10485760  # the first val_tokens tokens of the val files are the validation set; 0: none
    vocab_size: int = 0  # tokenizer ids (<copy> is id vocab_size); 0: the shards' header, else GPT-2's 50257
    bos_id: int = -1  # starts every document (attention and copying never cross it); -1: vocab_size - 1
    # batch: one optimizer step sees batch_size tokens = (batch_size // seq_len) rows of seq_len tokens,
    # split over ranks and, when there are fewer ranks than rows, over gradient-accumulation micro-steps
    batch_size: int = 8 * 48 * 1024  # tokens a step
    seq_len: int = 48 * 1024  # tokens in one packed row (one micro-step of one rank); multiple of 128
    val_seq_len: int = 4 * 64 * 1024  # tokens in one validation row
    # model
    num_layers: int = 12  # transformer blocks
    model_dim: int = 768  # width of the residual stream
    num_heads: int = 6  # attention heads of model_dim / num_heads each
    no_attention_layer: int = 7  # this layer has an MLP only, as in the record (-1: attention everywhere)
    # sliding window: grows linearly over training from attn_window_start to attn_window tokens, rounded up
    # to whole 128-token blocks (at least one); "short" layers use half as many blocks as "long" ones
    attn_window_start: int = 0  # window (tokens) at step 0
    attn_window: int = 1728  # window (tokens) at the last step
    logit_softcap: float = 15.0  # z = 2 cap sigmoid(2 u / cap), the record's shifted tanh soft-cap; 0: none
    fp8_head: int = -1  # FP8 matmul in the LM head while training: 1 on, 0 off, -1 where the GPU has FP8
    # Copy-Paste head (see CopyPasteHead)
    cplm: int = 0  # 0: vanilla GPT; 1: CPLM (CP head + <copy> gate + mixture loss)
    cp_dim: int = 64  # width of the CP head's queries and keys
    cp_backend: str = "auto"  # CP sums by "flex", "dense" (chunked) or "lse_kernel" (cp_kernel.py); auto: flex on CUDA
    cp_chunk: int = 0  # dense CP sums: queries per chunk (each chunk a compiled shape); 0: 4096 on CUDA, 512 on CPU
    cp_optimizer: str = "adam"  # W_Q, W_K trained by "adam" (at lr_cp) or "muon" (at lr_muon)
    lr_cp: float = 0.008  # Adam learning rate of W_Q and W_K
    copy_gate_init: float = 0.0  # the gate c at step 0 (a bias on the <copy> logit); 0: closed as in the paper
    # "lm": lam = c (1 - s), c from the LM head's <copy> slot (the paper); "sentinel": lam = 1 - s, the
    # pointer-sentinel mixture of Merity et al. 2016 (the sink alone gates, <copy> unused): a baseline
    copy_gate: str = "lm"  # what gates copying: "lm" (the paper's <copy> slot) or "sentinel" (pointer sentinel)
    cp_stop_grad: int = 0  # ablation: 1 stops the CP head's gradient into the backbone
    # optimization
    num_iterations: int = 1770  # optimizer steps
    cooldown_frac: float = 0.4  # the learning rates decay linearly over this final fraction of steps
    lr_embed: float = 0.6  # Adam: token and value embeddings
    lr_head: float = 0.008  # Adam: LM head
    lr_scalar: float = 0.04  # Adam: scalars (block mixes, skip weights, sink key, <copy> bias)
    lr_muon: float = 0.05  # Muon: the hidden matrices
    muon_momentum: float = 0.95  # Muon momentum after its warm-up
    muon_momentum_warmup_steps: int = 300  # momentum rises linearly from 0.85 to muon_momentum
    # evaluation, logging, checkpoints
    val_loss_every: int = 125  # 0: validate only at the end
    train_loss_every: int = 0  # > 0: log the train loss every this many steps (a host sync; the record logs none)
    target_val_loss: float = 0.0  # > 0: stop at the first validation at or below it
    seed: int = 0  # initial weights
    data_seed: int = -1  # >= 0: the train documents in an order shuffled by this seed; -1: as stored (the record)
    run_id: str = ""  # log name; default: a fresh uuid
    log_dir: str = "logs"  # where logs and checkpoints go
    compile: int = -1  # torch.compile the model and Newton-Schulz; -1: on CUDA only
    coordinate_descent: int = 0  # 1: inductor's coordinate-descent kernel tuning on CUDA, as the record (~25 min)
    warmup_steps: int = 10  # untimed steps that compile kernels; the model and optimizers are then reset
    dist_timeout_s: int = 900  # a collective that waits longer ends the job instead of hanging it
    checkpoint_every: int = 0  # > 0: save a checkpoint every this many steps
    save_checkpoint: int = 0  # 1: save one at the end
    keep_checkpoints: int = 3  # checkpoints kept per run; older ones are deleted
    resume: str = ""  # path of a checkpoint to continue from (its log, same run_id, gets a "resumed" section)
    overwrite: int = 0  # 1: a fresh run may replace an earlier run of its run_id; a resume, drop its later steps


PRESETS = {
    # the 8xH100 speedrun: modded-nanogpt's 2025-01-26 record (1770 steps of 8 x 48Ki tokens); the defaults
    "speedrun": dict(),
    # one GPU (tools/run_race.py): the record's architecture at 4 x 768 (its V/D), 500 steps of one 32Ki-token row,
    # vanilla in ~22 s on an H100 (estimated); FineWeb's first train shard (records/one_gpu_race: why this size)
    "gpu1": dict(train_files="data/fineweb10B/fineweb_train_000001.bin", val_tokens=8 * 64 * 1024,
                 batch_size=32 * 1024, seq_len=32 * 1024, val_seq_len=64 * 1024, num_layers=4, no_attention_layer=-1,
                 num_iterations=500, val_loss_every=50, warmup_steps=3),
    # a 2-core CPU: a 4 x 128 model that trains in minutes on the Python standard library's source
    "cpu": dict(train_files="data/pystdlib/pystdlib_train_*.bin", val_files="data/pystdlib/pystdlib_val_*.bin",
                val_tokens=16384, batch_size=2 * 1024, seq_len=1024, val_seq_len=4096, num_layers=4, model_dim=128,
                num_heads=2, attn_window=1024, attn_window_start=1024, num_iterations=200, val_loss_every=25,
                train_loss_every=1, warmup_steps=0, lr_muon=0.04),
}


# --help shows each field's comment: the dataclass is the one place a flag is described
FIELD_HELP = dict(re.findall(r"^    (\w+): \w+ = .*?  # (.*)$", inspect.getsource(Hyperparameters), re.MULTILINE))


FLAGS_GIVEN = set()  # the flags of the last parse_args: a resumed run keeps its checkpoint's settings unless given


def parse_args(argv=None) -> Hyperparameters:
    """--field value for every Hyperparameters field; the preset sets defaults, explicit flags win."""
    defaults = Hyperparameters()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # one line, not usage
    for f in dataclasses.fields(Hyperparameters):
        kind = type(getattr(defaults, f.name))
        parser.add_argument(f"--{f.name}", type=kind, default=None, metavar=kind.__name__.upper(),
                            help=f"{FIELD_HELP.get(f.name, '')} (default {getattr(defaults, f.name)!r})")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    FLAGS_GIVEN.clear()
    FLAGS_GIVEN.update(given)
    preset = given.get("preset", "auto")
    if preset == "auto":
        preset = "speedrun" if torch.cuda.is_available() else "cpu"
    if preset not in PRESETS:
        raise UsageError(f"--preset must be one of {', '.join(PRESETS)} or auto, not {preset!r}")
    args = dataclasses.replace(defaults, **{**PRESETS[preset], **given, "preset": preset})
    if not args.resume:  # a resumed run is checked once its checkpoint's settings are merged in (main)
        check_args(args, FLAGS_GIVEN)
    return args


# -----------------------------------------------------------------------------------------------------
# Data: shards of a 256 x int32 header (magic 20240520, version, token count, vocabulary size) + tokens

def load_shard(path: str, vocab_size: int | None = None) -> np.ndarray:
    """Memory-maps the tokens of one shard after checking its header against the file."""
    dtype, count, header_vocab = shard_header(path)
    if vocab_size is not None and header_vocab > vocab_size:
        raise DataError(f"{path}: written for a vocabulary of {header_vocab} ids; pass --vocab_size {header_vocab}")
    return np.memmap(path, dtype=dtype, mode="r", offset=1024, shape=(count,))


class TrainLoader:
    """Reads the train shards as one stream of tokens, so their sizes do not matter; when what is left
    cannot fill a step, it starts over. Step s reads the same batch_size + 1 tokens for any world size;
    row i of the batch (seq_len + 1 tokens) goes to rank i % world_size, micro-step i // world_size, so 1,
    2, 4 or 8 ranks train on exactly the same data. Every shard is checked when the loader is made."""

    def __init__(self, pattern, batch_size, seq_len, rank, world_size, vocab_size, bos_id=None, data_seed=-1):
        self.files = find_shards(pattern)
        self.shards = [load_shard(path, vocab_size) for path in self.files]
        if vocab_size is not None:
            for path, tokens in zip(self.files, self.shards):
                check_token_range(tokens, vocab_size, path)
        if data_seed >= 0:  # another data order: seeds then differ in data as well as in initial weights. The
            # stream's documents are shuffled as a whole (one crosses a shard boundary), in memory: 2 bytes a token
            self.shards = [shuffle_documents(np.concatenate(self.shards), bos_id, data_seed)]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])  # where each shard starts in the stream
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        if self.offsets[-1] < batch_size + 1:
            raise DataError(f"{pattern}: {self.offsets[-1]} tokens in all, one step needs {batch_size + 1} "
                            f"(--batch_size + 1)")
        self.position = 0

    def state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = int(state["position"])

    def read(self, start, count) -> np.ndarray:
        """Tokens [start, start + count) of the stream, across shard boundaries."""
        pieces = []
        while count > 0:
            i = int(np.searchsorted(self.offsets, start, side="right")) - 1
            piece = self.shards[i][start - self.offsets[i]:start - self.offsets[i] + count]
            pieces.append(piece)
            start, count = start + len(piece), count - len(piece)
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def next_batch(self, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(inputs, targets)] for this rank's micro-steps, each (1, seq_len) int64."""
        if self.position + self.batch_size + 1 > self.offsets[-1]:  # the stream is used up: start over
            self.position = 0
        micro = []
        for i in range(self.rank, self.batch_size // self.seq_len, self.world_size):  # this rank's rows only
            row = torch.from_numpy(self.read(self.position + i * self.seq_len, self.seq_len + 1).astype(np.int64))
            if torch.device(device).type == "cuda":  # from pinned memory the copy is asynchronous: no GPU wait
                row = row.pin_memory()
            row = row.to(device, non_blocking=True)
            micro.append((row[None, :-1], row[None, 1:]))
        self.position += self.batch_size
        return micro


def load_val_tokens(pattern: str, num_tokens: int, vocab_size: int) -> torch.Tensor:
    """The first num_tokens + 1 tokens of the val shards (inputs and their shifted targets); every val
    shard's header is checked, and the ids of the tokens used."""
    shards = [(path, load_shard(path, vocab_size)) for path in find_shards(pattern)]
    parts, have = [], 0
    for path, tokens in shards:
        parts.append(tokens[:num_tokens + 1 - have])
        if vocab_size is not None:
            check_token_range(parts[-1], vocab_size, path)
        have += len(parts[-1])
        if have == num_tokens + 1:
            return torch.from_numpy(np.concatenate(parts).astype(np.int64))
    raise DataError(f"{pattern}: {have} val tokens, --val_tokens {num_tokens} needs {num_tokens + 1}")


# -----------------------------------------------------------------------------------------------------
# Model: the backbone (the GPT of modded-nanogpt's 2025-01-26 record)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def next_multiple(n, multiple):
    return -(-n // multiple) * multiple


# FP8 matmul for the LM head (training only, as in the record): x and W are scaled into float8_e4m3fn, the
# gradient into float8_e5m2 (more range, less precision); torch._scaled_mm undoes the scales. A custom op,
# so torch.compile treats it as one opaque kernel; its backward reuses the FP8 copies saved by the forward.


def _fp8_forward(x, w, x_scale, w_scale):
    x8, w8 = x.mul(x_scale).to(torch.float8_e4m3fn), w.mul(w_scale).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x8, w8.t(), out_dtype=torch.bfloat16, use_fast_accum=True,
                           scale_a=x.new_tensor(1 / x_scale, dtype=torch.float32),
                           scale_b=x.new_tensor(1 / w_scale, dtype=torch.float32))
    return out, x8, w8


def _fp8_backward(grad, x8, w8, x_scale, w_scale, grad_scale):
    g8 = grad.mul(grad_scale).to(torch.float8_e5m2)
    s_x, s_w, s_g = (grad.new_tensor(1 / s, dtype=torch.float32) for s in (x_scale, w_scale, grad_scale))
    # _scaled_mm wants its second operand column-major: .t().contiguous().t() lays it out so
    grad_x = torch._scaled_mm(g8, w8.t().contiguous().t(), out_dtype=torch.bfloat16, scale_a=s_g, scale_b=s_w)
    grad_w = torch._scaled_mm(x8.t().contiguous(), g8.t().contiguous().t(), out_dtype=torch.float32,
                              scale_a=s_x, scale_b=s_g).t()
    return grad_x, grad_w


_compiled_fp8 = {}


def _fp8_kernel(fn, device):
    """On CUDA each body is compiled once, as in the record: the casts and transposes fuse, and the scales
    become constants instead of host-to-device copies (which would make the host wait for the GPU)."""
    if device.type != "cuda":
        return fn
    if fn not in _compiled_fp8:
        _compiled_fp8[fn] = torch.compile(fn, dynamic=False)
    return _compiled_fp8[fn]


@torch.library.custom_op("cplm::fp8_matmul", mutates_args=())
def fp8_matmul(x: torch.Tensor, w: torch.Tensor, x_scale: float, w_scale: float,
               grad_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, in) @ w (out, in).T in FP8 -> bf16 (N, out); also returns the FP8 x and w for the backward."""
    return _fp8_kernel(_fp8_forward, x.device)(x, w, x_scale, w_scale)


@fp8_matmul.register_fake
def _(x, w, x_scale, w_scale, grad_scale):
    return (x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16), torch.empty_like(x, dtype=torch.float8_e4m3fn),
            torch.empty_like(w, dtype=torch.float8_e4m3fn))


@torch.library.custom_op("cplm::fp8_matmul_backward", mutates_args=())
def fp8_matmul_backward(grad: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, x_scale: float, w_scale: float,
                        grad_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x bf16 (N, in), grad_w fp32 (out, in), column-major) from the bf16 output gradient and the saved
    FP8 operands."""
    return _fp8_kernel(_fp8_backward, grad.device)(grad, x8, w8, x_scale, w_scale, grad_scale)


@fp8_matmul_backward.register_fake
def _(grad, x8, w8, x_scale, w_scale, grad_scale):
    # the strides must be the real ones (grad_w is a transposed view): inductor asserts them
    return grad.new_empty(x8.shape, dtype=torch.bfloat16), grad.new_empty(w8.shape[::-1], dtype=torch.float32).t()


def _fp8_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.scales = inputs[2:]
    ctx.set_materialize_grads(False)


def _fp8_autograd_backward(ctx, grad_out, *_):
    x8, w8 = ctx.saved_tensors
    grad_x, grad_w = fp8_matmul_backward(grad_out.contiguous(), x8, w8, *ctx.scales)
    return grad_x, grad_w, None, None, None


fp8_matmul.register_autograd(_fp8_autograd_backward, setup_context=_fp8_setup_context)


class CastedLinear(nn.Linear):
    """Linear without bias whose fp32 weight is cast to the activations' dtype (bf16 on GPU). With fp8_scales
    (x, w, grad), the training forward runs in FP8 (the record's LM head)."""

    def __init__(self, in_features, out_features, zero_init=False, fp8_scales=None):
        super().__init__(in_features, out_features, bias=False)
        self.fp8_scales = fp8_scales
        bound = 0.5 * (3 / in_features) ** 0.5  # uniform with std 0.5 / sqrt(in), as in the speedrun
        with torch.no_grad():
            self.weight.zero_() if zero_init else self.weight.uniform_(-bound, bound)

    def forward(self, x):
        if self.fp8_scales is not None and self.training:
            out = fp8_matmul(x.flatten(0, -2).contiguous(), self.weight, *self.fp8_scales)[0]
            return out.view(*x.shape[:-1], -1)
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    """Rotary embedding on half of each head's dimensions; the other half carries no position."""

    def __init__(self, head_dim, max_seq_len):
        super().__init__()
        freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4)
        freq = torch.cat([freq, freq.new_zeros(head_dim // 4)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x):  # (B, T, H, head_dim)
        cos, sin = self.cos[None, :x.size(1), None, :], self.sin[None, :x.size(1), None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


ATTN_SCALE = 0.12  # QK-normed queries and keys: a fixed scale a little above 1/sqrt(head_dim), as in the records
BLOCK = 128  # FlexAttention's block size; windows count whole blocks


def doc_ids_of(input_ids, bos_id):
    """Document index of every position: a new document starts at each BOS."""
    return (input_ids == bos_id).cumsum(-1)


def document_blocks(doc_ids, all_partial=False):
    """Which 128 x 128 (query block, key block) tiles attention visits, from the document boundaries alone
    (never by testing every (query, key) pair): 'full' tiles hold only causal same-document pairs, 'partial'
    ones some (the mask runs inside them). all_partial: every visited tile is partial (for masks that test
    more than documents). Returns (partial, full), each (counts (B, 1, nb), indices (B, 1, nb, nb)) with the
    nearest tile first, as FlexAttention's BlockMask takes them; within_window cuts them to a window."""
    B, T = doc_ids.shape
    nb = -(-T // BLOCK)
    padded = F.pad(doc_ids, (0, nb * BLOCK - T), value=-1)  # pads only the dense path's odd lengths
    padded = torch.where(padded < 0, doc_ids[:, -1:], padded).view(B, nb, BLOCK)
    first, last = padded[..., 0], padded[..., -1]
    qb = torch.arange(nb, device=doc_ids.device)[:, None]
    kb = torch.arange(nb, device=doc_ids.device)[None, :]
    any_doc = (first[:, :, None] <= last[:, None, :]) & (last[:, :, None] >= first[:, None, :])
    one_doc = (first[:, :, None] == last[:, None, :]) & (last[:, :, None] == first[:, None, :])
    visit = (qb >= kb) & any_doc
    full = visit & (qb > kb) & one_doc & (not all_partial)
    partial = visit & ~full

    def nearest_first(blocks):
        counts = blocks.sum(-1, dtype=torch.int32)
        order = torch.where(blocks, kb, -1).sort(dim=-1, descending=True).indices
        return counts[:, None].contiguous(), order.to(torch.int32)[:, None].contiguous()

    return nearest_first(partial), nearest_first(full)


def within_window(tiles, window_blocks=None):
    """The tiles of a sliding window of window_blocks blocks (a tensor, so a new size does not recompile):
    each query block keeps its nearest ones as the record does, at most w - 1 full ones and at least its own
    diagonal tile. None: all of them."""
    if window_blocks is None:
        return tiles
    (p_count, p_index), (f_count, f_index) = tiles
    p_count = torch.minimum(p_count, (window_blocks - f_count).clamp_min(1))
    f_count = torch.minimum(f_count, (window_blocks - 1).clamp_min(0))
    return (p_count, p_index), (f_count, f_index)


def document_block_mask(tiles, mask_mod):
    """FlexAttention BlockMask of the given tiles; mask_mod runs inside the partial ones."""
    partial, full = tiles
    return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=BLOCK, mask_mod=mask_mod)


def flex_document_mask(doc_ids, tiles):
    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return document_block_mask(tiles, document_causal)


def dense_attention_mask(doc_ids, tiles):
    """(B, 1, T, T) bool: exactly the pairs flex_document_mask lets through with these tiles, for SDPA."""
    T = doc_ids.size(-1)
    visited = []
    for counts, indices in tiles:
        nb = indices.size(-1)
        kept = torch.arange(nb, device=doc_ids.device) < counts[..., None]  # (B, 1, nb, nb) in list order
        visited.append(torch.zeros_like(kept).scatter_(-1, indices.long(), kept))  # back to block order
    visited = (visited[0] | visited[1])[:, 0].repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :T, :T]
    pos = torch.arange(T, device=doc_ids.device)
    causal_same_doc = (pos[:, None] >= pos[None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return (visited & causal_same_doc)[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, max_seq_len):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        bound = 0.5 * (3 / dim) ** 0.5
        self.qkv_w = nn.Parameter(torch.empty(3, dim, dim).uniform_(-bound, bound))  # merged q, k, v
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))  # mix of v and the value embedding
        self.rotary = Rotary(self.head_dim, max_seq_len)
        self.c_proj = CastedLinear(dim, dim, zero_init=True)

    def forward(self, x, value_embed, mask):
        B, T, _ = x.shape
        qkv = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(B, T, 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.chunk(3, dim=-2)
        q, k = self.rotary(norm(q)), self.rotary(norm(k))
        v = self.lambdas[0] * v + (self.lambdas[1] * value_embed.view_as(v) if value_embed is not None else 0)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if isinstance(mask, BlockMask):
            y = flex_attention(q, k, v, block_mask=mask, scale=ATTN_SCALE)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=ATTN_SCALE)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = CastedLinear(dim, 4 * dim)
        self.c_proj = CastedLinear(4 * dim, dim, zero_init=True)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, dim, num_heads, max_seq_len, has_attention=True):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, max_seq_len) if has_attention else None
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # mix of the residual stream and x0

    def forward(self, x, value_embed, x0, mask):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), value_embed, mask)
        return x + self.mlp(norm(x))


# -----------------------------------------------------------------------------------------------------
# Model: the Copy-Paste head


class CopyPasteHead(nn.Module):
    """Points at an earlier position of the document instead of a vocabulary entry: scores
    a_t(tau) = (W_Q h_t) . (W_K h_tau) / sqrt(cp_dim) for tau <= t, plus a learnable sink key whose share
    s_t closes the copy path when nothing in the context is worth copying. 2 x cp_dim x D + cp_dim params."""

    def __init__(self, dim, cp_dim):
        super().__init__()
        # W_Q starts at zero, as the record's output projections do: the CP head then sends the backbone an exact
        # zero at step 0, as vanilla's zero LM head does, not rounding noise (~1e-10) along the directions RMSnorm
        # ignores, which Adam (eps 1e-10) would turn into full-size steps that depend on the thread count
        self.w_q = CastedLinear(dim, cp_dim, zero_init=True)
        self.w_k = CastedLinear(dim, cp_dim)
        self.sink_key = nn.Parameter(torch.zeros(cp_dim))

    def forward(self, h):
        return self.w_q(h), self.w_k(h), self.sink_key


# -----------------------------------------------------------------------------------------------------
# Model: the GPT, with the CP head when cplm = 1


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    bos_id: int = 50256
    num_layers: int = 12  # transformer blocks
    model_dim: int = 768  # width of the residual stream
    num_heads: int = 6  # attention heads of model_dim / num_heads each
    no_attention_layer: int = 7
    max_seq_len: int = 64 * 1024
    logit_softcap: float = 15.0
    fp8_head: int = 0
    cplm: int = 0
    cp_dim: int = 64
    cp_backend: str = "auto"
    copy_gate_init: float = 0.0
    copy_gate: str = "lm"
    cp_stop_grad: int = 0
    cp_chunk: int = 0

    @property
    def padded_vocab(self):  # room for <copy>, rounded up to a multiple of 128 (50304 for GPT-2)
        return next_multiple(self.vocab_size + 1, 128)

    @property
    def copy_id(self):  # the first slot past the tokenizer's ids
        return self.vocab_size

    @classmethod
    def from_args(cls, a: Hyperparameters, fp8_head=0):  # fp8_head: resolved for the device (0 or 1)
        kept = {f.name for f in dataclasses.fields(cls)}
        if a.vocab_size <= 0 or a.bos_id < 0:
            raise ValueError("vocab_size and bos_id are not resolved yet: pass the Hyperparameters through "
                             "resolve_vocabulary(a) (it reads the shards' header)")
        given = {k: v for k, v in dataclasses.asdict(a).items() if k in kept}
        return cls(**{**given, "fp8_head": fp8_head}, max_seq_len=max(a.seq_len, a.val_seq_len))


def window_pattern(num_layers):
    """Long (True) or short window per layer: the record's [L S S S L S | S L S S S L] for 12 layers, i.e.
    every 4th encoder layer long, mirrored in the decoder."""
    encoder = [i % 4 == 0 for i in range(num_layers // 2)]
    return encoder + encoder[::-1]


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        V, D, L = c.padded_vocab, c.model_dim, c.num_layers
        self.embed = nn.Embedding(c.vocab_size, D)  # inputs are token ids only: no row for <copy> or padding
        # value embeddings feed the first and the last few layers (U-net symmetric)
        self.num_value_embeds = min(3, L // 2)
        self.value_embeds = nn.ModuleList([nn.Embedding(c.vocab_size, D) for _ in range(self.num_value_embeds)])
        self.blocks = nn.ModuleList([Block(D, c.num_heads, c.max_seq_len, i != c.no_attention_layer)
                                     for i in range(L)])
        self.long_window = window_pattern(L)
        # U-net: the first half's outputs are added, weighted, to the second half's inputs
        self.num_encoder_layers = L // 2
        self.skip_weights = nn.Parameter(torch.ones(L - self.num_encoder_layers))
        # the record's FP8 scales for x, W and the gradient (chosen for a zero-initialised 768 x 50304 head)
        self.lm_head = CastedLinear(D, V, zero_init=True, fp8_scales=(2.0, 2.0 ** 9, 2.0 ** 19) if c.fp8_head else None)
        self.cp_head = CopyPasteHead(D, c.cp_dim) if c.cplm else None
        self.copy_logit_bias = self.sink_bias = None
        if c.cplm and c.copy_gate == "sentinel":  # the pointer sentinel starts closed too: a bias on the sink's
            # score, so lam = 1 - s <= 1 / padded vocab at step 0 (W_Q = 0 there: every other score is 0)
            self.sink_bias = nn.Parameter(torch.tensor(math.log(c.max_seq_len * V)))
        if c.cplm and c.copy_gate == "lm":  # a bias on the <copy> logit; the zero-initialised head makes every
            # logit equal at step 0, so c = copy_gate_init there (0: no bias, c = 1 / padded vocab: the paper's
            # closed gate)
            c_init = c.copy_gate_init or 1 / V
            self.copy_logit_bias = nn.Parameter(torch.tensor(math.log(c_init / (1 - c_init)) + math.log(V - 1)))
        # chosen once for the device: "flex" (FlexAttention kernels, CUDA) or "dense" (masked SDPA and chunked
        # dense CP sums, any device); the LM head's loss fused by inductor, or row-chunked for eager CPU runs
        on_cuda = torch.cuda.is_available()
        self.attention_backend = "flex" if on_cuda else "dense"
        self.cp_backend = self.attention_backend if c.cp_backend == "auto" else c.cp_backend
        self.cp_chunk = c.cp_chunk or (4096 if on_cuda else 512)
        self.head_loss = (HeadLoss if on_cuda else import_cpu_head().EagerCPUHeadLoss)(c.logit_softcap, c.copy_id)

    @property
    def gate_bias(self):  # the gate's learnable bias: on the <copy> logit, or (pointer sentinel) on the sink's score
        return self.copy_logit_bias if self.sink_bias is None else self.sink_bias

    def hidden_states(self, input_ids, window_blocks=None):
        """Final normed hidden states h (B, T, D) and the document ids. window_blocks: the long layers'
        sliding window in 128-token blocks (an int32 tensor), short layers use half; None: whole documents."""
        c = self.config
        doc_ids = doc_ids_of(input_ids, c.bos_id)
        tiles = document_blocks(doc_ids)  # once; the long and short windows each keep their nearest tiles
        short_blocks = None if window_blocks is None else window_blocks // 2
        make_mask = flex_document_mask if self.attention_backend == "flex" else dense_attention_mask
        long = make_mask(doc_ids, within_window(tiles, window_blocks))
        short = long if window_blocks is None else make_mask(doc_ids, within_window(tiles, short_blocks))
        ve = [emb(input_ids) for emb in self.value_embeds]
        ve = ve + [None] * (c.num_layers - 2 * len(ve)) + ve
        x = x0 = norm(self.embed(input_ids))
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= self.num_encoder_layers:
                x = x + self.skip_weights[i - self.num_encoder_layers] * skips.pop()
            x = block(x, ve[i], x0, long if self.long_window[i] else short)
            if i < self.num_encoder_layers:
                skips.append(x)
        return norm(x), doc_ids

    def lm_logits(self, h):
        """Soft-capped LM-head logits over the padded vocabulary, float32."""
        return soft_cap(self.lm_head(h), self.config.logit_softcap)

    def forward(self, input_ids, target_ids, window_blocks=None, token_stats=False):
        """Mean next-token loss; with token_stats, a dict of per-token tensors (B, T): nll, copyable
        (the target occurs earlier in its document) and, in CPLM mode, the gates lam, c, s."""
        h, doc_ids = self.hidden_states(input_ids, window_blocks)
        if self.cp_head is None and not token_stats:
            return self.head_loss.vanilla_mean(self.lm_head, h, target_ids)  # the record's loss
        copyable = target_in_context(input_ids, target_ids, doc_ids, self.config.padded_vocab)
        if self.cp_head is None:
            stats = {"nll": self.head_loss.vanilla_token_nll(self.lm_head, h, target_ids)}
        else:
            head_terms = self.head_loss.terms(self.lm_head, h, target_ids)  # first: h's gradients sum in one order
            q, k, sink_key = self.cp_head(h.detach() if self.config.cp_stop_grad else h)
            stats = cplm_target_log_prob(None, q, k, sink_key, input_ids, target_ids, doc_ids, copyable,
                                         self.config.copy_id, self.gate_bias, backend=self.cp_backend,
                                         chunk=self.cp_chunk, gate=self.config.copy_gate, head_terms=head_terms)
            stats["nll"] = -stats.pop("log_p")
        return {**stats, "copyable": copyable} if token_stats else stats["nll"].mean()


# -----------------------------------------------------------------------------------------------------
# Loss: the CPLM mixture  p(v) = (1 - lam) p_LM(v) + lam p_CP(v),  lam = c (1 - s)
#   c = p_full(<copy>) from the LM head, s = the sink's share of the CP softmax; all in log space.


def target_in_context(input_ids, target_ids, doc_ids, vocab):
    """(B, T) bool: the target y_t occurs at some tau <= t of the same document (it can be copied).
    One sort of (document, token) keys and a binary search: O(T log T), no (T, T) tensor."""
    pos = torch.arange(input_ids.size(-1), device=input_ids.device).expand_as(input_ids)
    keys, order = torch.sort(doc_ids * vocab + input_ids, dim=-1, stable=True)  # earliest position first
    wanted = doc_ids * vocab + target_ids
    i = torch.searchsorted(keys, wanted).clamp(max=input_ids.size(-1) - 1)
    return (keys.gather(-1, i) == wanted) & (order.gather(-1, i) <= pos)


# the CP head's FlexAttention kernels: 8 warps for its 128 x 128 tiles (4 spilled on sm_90: records/gpu/README.md)
CP_KERNEL_OPTIONS = {"num_warps": 8}


def copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, backend, chunk=512):
    """The CP head's two row-wise log-sum-exps of a_t(tau) = q_t . k_tau / sqrt(d), over tau <= t in t's
    document (lse_doc) and over those with x_tau = y_t (lse_match). A row with nothing to copy gets its own
    position as the only key instead of an empty set (finite, no NaN gradient); the caller drops it."""
    scale = q.size(-1) ** -0.5
    if backend == "lse_kernel":  # both sums in one Triton kernel each way, no value (cp_kernel.py)
        import cp_kernel
        return cp_kernel.cp_lses(q, k, input_ids, target_ids, doc_ids, copyable)
    if backend == "flex":
        # imported here: vanilla asks no newer torch than the record's own code (AuxRequest came in 2.9)
        from torch.nn.attention.flex_attention import AuxRequest
        B, T, d = q.shape
        # one head, the value a 16-wide zero (a Triton dot's least): only LSEs enter the loss; P V, dV cost 1/4 of 64's
        q4, k4, v4 = q[:, None], k[:, None], q.new_zeros(B, 1, T, 16)

        def match_mod(b, h, q_idx, kv_idx):
            same = (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
            hit = input_ids[b, kv_idx] == target_ids[b, q_idx]
            return same & (hit | (~copyable[b, q_idx] & (q_idx == kv_idx)))

        doc_mask = flex_document_mask(doc_ids, document_blocks(doc_ids))
        match_mask = document_block_mask(document_blocks(doc_ids, all_partial=True), match_mod)
        doc_out, doc_aux = flex_attention(q4, k4, v4, block_mask=doc_mask, scale=scale, return_aux=AuxRequest(lse=True),
                                          kernel_options=CP_KERNEL_OPTIONS)
        match_out, match_aux = flex_attention(q4, k4, v4, block_mask=match_mask, scale=scale,
                                              return_aux=AuxRequest(lse=True), kernel_options=CP_KERNEL_OPTIONS)
        # an exact zero from each output (finite: a mean of zeros) gives flex's backward a real grad_out;
        # left unused, grad_out is None there, which eager replaces by zeros but inductor's lowering cannot
        doc_zero, match_zero = (0 * out[:, 0, :, 0].float() for out in (doc_out, match_out))
        return doc_aux.lse[:, 0] + doc_zero, match_aux.lse[:, 0] + match_zero

    # dense: chunks of queries against the keys of their documents, each chunk recomputed in the backward
    # pass (checkpoint), so memory stays O(chunk x T) instead of O(T x T)
    doc_start, parts = _document_starts(doc_ids), []
    for lo in range(0, q.size(1), chunk):
        hi = min(lo + chunk, q.size(1))
        # no key before the first query's document can be used (a host read: eager only)
        k_lo = 0 if torch.compiler.is_compiling() else int(doc_start[:, lo].min())
        parts.append(checkpoint(_dense_copy_lse_chunk, q[:, lo:hi], k[:, k_lo:hi], input_ids[:, k_lo:hi],
                                target_ids[:, lo:hi], doc_ids[:, lo:hi], doc_ids[:, k_lo:hi], copyable[:, lo:hi],
                                lo, k_lo, scale, use_reentrant=False))
    lse_doc, lse_match = zip(*parts)
    return torch.cat(lse_doc, 1), torch.cat(lse_match, 1)


def _document_starts(doc_ids):
    """Position of the first token of each position's document, (B, T)."""
    pos = torch.arange(doc_ids.size(-1), device=doc_ids.device).expand_as(doc_ids)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(is_start, pos, 0).cummax(-1).values


def _dense_copy_lse_chunk(q, k, key_ids, targets, q_docs, k_docs, copyable, q_lo, k_lo, scale):
    q_pos = torch.arange(q_lo, q_lo + q.size(1), device=q.device)[:, None]
    k_pos = torch.arange(k_lo, k_lo + k.size(1), device=q.device)[None, :]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    doc_causal = (q_docs[:, :, None] == k_docs[:, None, :]) & (q_pos >= k_pos)
    hit = key_ids[:, None, :] == targets[:, :, None]
    match = doc_causal & (hit | (~copyable[:, :, None] & (q_pos == k_pos)))
    neg_inf = float("-inf")
    return scores.masked_fill(~doc_causal, neg_inf).logsumexp(-1), scores.masked_fill(~match, neg_inf).logsumexp(-1)


def soft_cap(u, cap):
    """The record's soft-cap, z = 2 cap sigmoid(2 u / cap) = cap tanh(u / cap) + cap (the shift changes no
    softmax), in float32; cap 0: none."""
    return 2 * cap * torch.sigmoid(u.float() / (cap / 2)) if cap > 0 else u.float()


def vanilla_nll(head_out, target_ids, softcap, reduction="mean"):
    """The record's loss: cross-entropy over every slot of the soft-capped logits."""
    return F.cross_entropy(soft_cap(head_out, softcap).flatten(0, -2), target_ids.flatten(), reduction=reduction)


def lm_head_terms(head_out, target_ids, copy_id, softcap=0.0):
    """(B, T) each: the logsumexp of the soft-capped logits without <copy>, the <copy> logit, the target's.
    Written so torch.compile fuses every (N, V) step into the reductions: the two single logits are read
    from head_out (a select and a masked sum, whose gradients are elementwise) and soft-capped afterwards,
    so neither the forward nor the backward keeps an (N, V) float32 tensor (measured: experiments/lm_head_memory.py)."""
    slot = torch.arange(head_out.size(-1), device=head_out.device)
    z = soft_cap(head_out, softcap)
    if 0 < softcap <= 30:  # z in [0, 2 cap]: no exp overflows float32, so no max pass; read twice (max, then
        # sum), z became a written (N, V) float32 buffer: 52.7 GB at a 256Ki-token validation row
        lse_without_copy = torch.where(slot == copy_id, 0, z.exp()).sum(-1).log()
    else:
        lse_without_copy = torch.where(slot == copy_id, float("-inf"), z).logsumexp(-1)
    z_copy = soft_cap(head_out[..., copy_id], softcap)
    z_y = soft_cap(torch.where(slot == target_ids[..., None], head_out, 0).sum(-1), softcap)  # one term: exact
    return lse_without_copy, z_copy, z_y


class HeadLoss:
    """The LM head's part of the loss, from the final hidden states h, as written for inductor to fuse (CUDA, or
    a compiled CPU run): the record's mean cross-entropy (vanilla training), per-token nll (validation; no
    float32 (T, V) buffer at 256Ki-token rows) and lm_head_terms (CPLM)."""

    def __init__(self, softcap, copy_id):
        self.softcap, self.copy_id = softcap, copy_id

    def vanilla_mean(self, lm_head, h, target_ids):
        return vanilla_nll(lm_head(h), target_ids, self.softcap)

    def vanilla_token_nll(self, lm_head, h, target_ids):
        lse_without_copy, z_copy, z_y = self.terms(lm_head, h, target_ids)
        return torch.logaddexp(lse_without_copy, z_copy) - z_y

    def terms(self, lm_head, h, target_ids):
        return lm_head_terms(lm_head(h), target_ids, self.copy_id, self.softcap)


def import_cpu_head():
    """cpu_head.py: HeadLoss's quantities for eager CPU runs (rows in chunks, their own backward) and the heap
    setting, the CPU evidence's code, imported on a CPU only (it imports nothing from this file)."""
    import cpu_head
    return cpu_head


def cplm_target_log_prob(lm_logits, q, k, sink_key, input_ids, target_ids, doc_ids, copyable, copy_id,
                         copy_bias=0.0, softcap=0.0, backend="dense", chunk=512, head_terms=None, gate="lm"):
    """The training loss's quantities at the targets only: log p(y_t) of the mixture and the gates, each
    (B, T) float32. softcap > 0: lm_logits is the head's raw output and gets the soft-cap here; copy_bias
    is then added to the <copy> logit. Packed rows: copying stays inside each document. Never builds a
    (T, V) copy distribution; the dense backend never holds more than a (chunk, T) score block. head_terms:
    lm_head_terms' three outputs computed already (lm_logits is then unused). gate "sentinel": the pointer-
    sentinel mixture, lam = 1 - s, p_LM the softmax without <copy>, copy_bias added to the sink's score."""
    lse_without_copy, z_copy, z_y = head_terms or lm_head_terms(lm_logits, target_ids, copy_id, softcap)
    scale = q.size(-1) ** -0.5
    a_sink = (q.float() @ sink_key.float()) * scale  # fp32: the sink competes with every position's score
    if gate == "sentinel":
        a_sink = a_sink + copy_bias
    lse_doc, lse_match = copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, backend, chunk)
    lse_all = torch.logaddexp(lse_doc.float(), a_sink)
    log_s = a_sink - lse_all
    if gate == "sentinel":  # c = 1: lam = 1 - s, 1 - lam = s; p_LM is the softmax without <copy>, as below
        log_c, log_1ml = torch.zeros_like(log_s), log_s
        lm_term = log_s + z_y - lse_without_copy
    else:
        z_copy = z_copy + copy_bias
        log_z = torch.logaddexp(lse_without_copy, z_copy)
        log_c = z_copy - log_z
        log_1mc = lse_without_copy - log_z
        log_1ml = torch.logaddexp(log_1mc, log_c + log_s)  # 1 - lam = (1 - c) + c s
        lm_term = log_1ml - log_1mc + (z_y - log_z)  # (1 - lam) p_full(y) / (1 - c)
    copy_term = torch.where(copyable, log_c + lse_match.float() - lse_all, float("-inf"))
    log_p = torch.logaddexp(lm_term, copy_term)
    return {"log_p": log_p, "lam": -torch.expm1(log_1ml), "c": log_c.exp(), "s": log_s.exp()}


# -----------------------------------------------------------------------------------------------------
# Optimizer: Muon for the hidden matrices, Adam for embeddings, head and scalars


def update_dtype(device):
    """Muon's orthogonalisation and its all-gather run in bf16 on a GPU, as the record; in fp32 on a CPU, whose
    bf16 matmuls are slow (the cpu preset's matrices: 0.79 s a step in bf16, 0.04 s in fp32, one thread;
    records/cpu_preset/newton_schulz_dtype.txt)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(G, steps=5):
    """Approximately orthogonalises G (..., m, n): the quintic iteration of the speedrun."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(update_dtype(G.device))
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if transposed else X).to(G.dtype)


all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # renamed in torch 2.10+


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, then Newton-Schulz orthogonalisation, scaled by sqrt(max(1, rows / cols)).
    With several ranks, as in the record: each rank orthogonalises every world_size-th matrix of a group of
    equal-sized ones, and the updates (bf16 on GPU) are all-gathered asynchronously while the next ones are
    computed.
    Our own rather than torch.optim.Muon, which repeats every matrix on every rank. Every rank keeps every
    momentum buffer (a few elementwise ops more than the record), so a checkpoint from rank 0 resumes at
    any world size."""

    def __init__(self, params, lr, momentum, rank=0, world_size=1, orthogonalize=newton_schulz):
        params = sorted(params, key=lambda p: -p.numel())
        groups = [{"params": [p for p in params if p.numel() == n]} for n in dict.fromkeys(p.numel() for p in params)]
        super().__init__(groups, dict(lr=lr, momentum=momentum))
        self.rank, self.world_size, self.orthogonalize = rank, world_size, orthogonalize

    @torch.no_grad()
    def step(self, wait_for_gradient=lambda p: None):
        for group in self.param_groups:
            params, lr, momentum = group["params"], group["lr"], group["momentum"]
            for p in params:
                wait_for_gradient(p)
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - momentum)
            if self.world_size == 1:
                for p in params:
                    p.add_(self._update(p, momentum), alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)
                continue
            dtype = update_dtype(params[0].device)
            flat = torch.empty(self.world_size * params[0].numel(), dtype=dtype, device=params[0].device)
            gathered = flat.view(self.world_size, -1)  # row r: the update computed by rank r
            pending = None  # (the all-gather in flight, the matrices it updates)
            for base in range(0, len(params), self.world_size):
                owned = base + self.rank
                mine = self._update(params[owned], momentum).flatten() if owned < len(params) else gathered[self.rank]
                if pending is not None:
                    self._apply(*pending, gathered, lr)
                work = all_gather_single(flat, mine.to(dtype), async_op=True)
                pending = work, params[base:base + self.world_size]
            self._apply(*pending, gathered, lr)

    def _update(self, p, momentum):
        return self.orthogonalize(p.grad.lerp(self.state[p]["momentum_buffer"], momentum))

    @staticmethod
    def _apply(work, params, gathered, lr):
        work.wait()
        for p, update in zip(params, gathered):
            p.add_(update.view_as(p), alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)


def build_optimizers(model: GPT, a: Hyperparameters, rank, world_size, compiled=False):
    """[Adam, Muon], as the record sets them up; CPLM adds W_Q, W_K (Adam at lr_cp by default) and the two
    scalars of the CP path (sink key, <copy> bias) to Adam's scalar group."""
    matrices = [p for n, p in model.blocks.named_parameters() if p.ndim >= 2]
    cp_matrices = [model.cp_head.w_q.weight, model.cp_head.w_k.weight] if model.cp_head is not None else []
    scalars = [p for p in model.parameters() if p.ndim < 2 and p not in set(cp_matrices)]
    if a.cp_optimizer == "muon":
        matrices, cp_matrices = matrices + cp_matrices, []
    adam_groups = [
        dict(params=[model.lm_head.weight], lr=a.lr_head),
        dict(params=[model.embed.weight, *[e.weight for e in model.value_embeds]], lr=a.lr_embed),
        dict(params=scalars, lr=a.lr_scalar),  # block and skip scalars; CPLM: sink key, <copy> bias
    ] + ([dict(params=cp_matrices, lr=a.lr_cp)] if cp_matrices else [])
    fused = next(model.parameters()).is_cuda  # one kernel for all of Adam's tensors
    adam = torch.optim.Adam(adam_groups, betas=(0.8, 0.95), eps=1e-10, fused=fused or None)
    muon = Muon(matrices, lr=a.lr_muon, momentum=a.muon_momentum, rank=rank, world_size=world_size,
                orthogonalize=torch.compile(newton_schulz) if compiled else newton_schulz)
    optimizers = [adam, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    assert sum(len(g["params"]) for o in optimizers for g in o.param_groups) == len(list(model.parameters()))
    return optimizers


def lr_multiplier(step, a: Hyperparameters):
    """1 until the cooldown, then linear down to 0.1 at the last step."""
    x = step / max(a.num_iterations, 1)
    if x < 1 - a.cooldown_frac:
        return 1.0
    w = (1 - x) / a.cooldown_frac
    return w + (1 - w) * 0.1


def shuffle_documents(tokens: np.ndarray, bos_id: int, seed: int) -> np.ndarray:
    """The documents (each from its BOS to the next) in a seeded random order; tokens before the first BOS (a
    document begun elsewhere) stay first. The same order on every rank and resume."""
    starts = np.flatnonzero(tokens == bos_id)
    if len(starts) < 2:
        return tokens
    documents = np.split(tokens[starts[0]:], starts[1:] - starts[0])
    order = np.random.default_rng(seed).permutation(len(documents))
    return np.concatenate([tokens[:starts[0]], *(documents[i] for i in order)])


def window_blocks(step, a: Hyperparameters):
    """The long layers' sliding window in 128-token blocks: attn_window_start + (attn_window - attn_window_start)
    x (the fraction of training done) tokens, rounded up to whole blocks, at least one. The speedrun's
    0 -> 1728 gives 1 block (128 tokens) at step 0 and 14 (1792) at the end, as the record."""
    x = step / max(a.num_iterations, 1)
    return max(1, math.ceil((a.attn_window_start + (a.attn_window - a.attn_window_start) * x) / BLOCK))


# -----------------------------------------------------------------------------------------------------
# Distributed training loop


def all_reduce_sum(t: torch.Tensor, world_size):
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


@torch.no_grad()
def evaluate(model, val_tokens, a: Hyperparameters, window_blocks, rank, world_size, device):
    """Val loss over the first val_tokens tokens, in rows of val_seq_len dealt round-robin to the ranks,
    plus the copy diagnostics. The same numbers for every world size."""
    model.eval()
    num_rows = a.val_tokens // a.val_seq_len
    # sums over tokens: nll, count, copyable count, nll on copyable, lam, c, s, and on the other targets
    # (nothing to copy) lam and the gate's cost -log(1 - lam): what CPLM pays there for keeping the copy path open
    sums = torch.zeros(9, dtype=torch.float64, device=device)
    for i in range(rank, num_rows, world_size):
        row = val_tokens[i * a.val_seq_len:(i + 1) * a.val_seq_len + 1].to(device)
        stats = model(row[None, :-1], row[None, 1:], window_blocks, token_stats=True)
        nll, copyable = stats["nll"].double(), stats["copyable"]
        gates = [stats[g].double().sum() if g in stats else nll.new_zeros(()) for g in ("lam", "c", "s")]
        lam = stats["lam"].double() if "lam" in stats else torch.zeros_like(nll)
        other = ~copyable
        sums += torch.stack([nll.sum(), nll.new_tensor(nll.numel()), copyable.sum().double(),
                             (nll * copyable).sum(), *gates, (lam * other).sum(), -(torch.log1p(-lam) * other).sum()])
    all_reduce_sum(sums, world_size)
    model.train()
    total, count, n_copy, nll_copy, lam, c, s, lam_other, gate_cost_other = sums.tolist()
    n_other = max(count - n_copy, 1)
    out = {"val_loss": total / count, "copy_share": n_copy / count,
           "nll_copyable": nll_copy / max(n_copy, 1), "nll_other": (total - nll_copy) / n_other}
    if a.cplm:
        out.update(lam=lam / count, c=c / count, s=s / count, lam_other=lam_other / n_other,
                   gate_cost_other=gate_cost_other / n_other)
    return out


def use_fp8_head(flag, device):
    """--fp8_head: 1 on, 0 off, -1 where the GPU has FP8 matmuls (sm_89+: Ada, Hopper, Blackwell)."""
    return flag == 1 or flag == -1 and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _terminate(signum, frame):  # a signal that ends the run through the log's "stopped:" line
    raise SystemExit(f"stopped by signal {signal.Signals(signum).name}")


def main(argv=None, before_clock=None):
    """before_clock: called once the untimed warm-up is done, just before the clock starts (a GPU check's runner
    takes its turn on the GPU there)."""
    a = parse_args(argv)
    # SIGTERM (a scheduler) and SIGHUP (a closed terminal) end the run through its log's "stopped:" line; the
    # caller's own handlers come back when main returns (tests and tools/run_race.py call it in their process)
    handlers = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        a, checkpoint, changed = run_files.run_settings(a, FLAGS_GIVEN)  # --resume: the checkpoint's, flags win
        # distributed set-up: torchrun sets RANK / WORLD_SIZE; NCCL on GPU, gloo on CPU
        distributed = "WORLD_SIZE" in os.environ
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            # as the record: less fragmentation (read when the allocator starts, which happens below)
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            torch.empty(1, device=device, requires_grad=True).backward()  # as the record: avoids a bug on some systems
        else:
            device = torch.device("cpu")
            import_cpu_head().use_heap_for_large_tensors()
            if "OMP_NUM_THREADS" not in os.environ:  # share the cores among the local processes
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        if (a.batch_size // a.seq_len) % world_size:
            raise UsageError(f"--batch_size / --seq_len = {a.batch_size // a.seq_len} rows, not divisible by "
                             f"{world_size} processes")
        # the run's claim: its lock, the same settings and shards on every rank, a log that a refused start undoes
        with run_files.claim_run(a, rank, distributed, device, sources=(__file__, run_files.__file__)) as log:
            return train(a, log, rank, world_size, device, checkpoint, changed, before_clock)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def train(a: Hyperparameters, log, rank, world_size, device, checkpoint=None, changed=(), before_clock=None):
    for line in environment_lines(device, world_size, a if rank == 0 else None):
        log(line, console=False)
    log(f"run_id: {a.run_id}")
    # data first: every shard is checked (header, size, token ids) before any model is built
    a = resolve_vocabulary(a)
    loader = TrainLoader(a.train_files, a.batch_size, a.seq_len, rank, world_size, a.vocab_size, a.bos_id, a.data_seed)
    val_tokens = load_val_tokens(a.val_files, a.val_tokens, a.vocab_size)
    run_files.check_train_val_apart(loader.files, find_shards(a.val_files))
    grad_accum = a.batch_size // a.seq_len // world_size
    if checkpoint is not None:
        run_files.check_checkpoint_fits(a, checkpoint)
    if rank == 0:  # a kill during a save leaves a temporary file: the checkpoint it held never existed
        folders = {os.path.join(a.log_dir, a.run_id)} | ({os.path.dirname(a.resume)} if a.resume else set())
        for stale in run_files.remove_stale_saves(folders):
            log(f"removed {stale}, left by a run killed while saving")
    if checkpoint is not None and run_files.finished_before(a, checkpoint):  # said; no log written or replaced
        log(f"nothing to train: the checkpoint is at step {checkpoint['step']}, --num_iterations is {a.num_iterations}")
        log.undo()
        return 0
    log(f"hyperparameters: {json.dumps(dataclasses.asdict(a))}")
    if log.path:  # past the data checks, which refuse a run before it has a log
        print(f"log: {log.path}", flush=True)  # stdout only

    fp8_head = use_fp8_head(a.fp8_head, device)
    if a.fp8_head == -1 and device.type == "cuda" and not fp8_head:
        log(f"notice: {torch.cuda.get_device_name(device)} has no FP8 matmul: the LM head runs in bf16")
    compile_model = a.compile == 1 or (a.compile == -1 and device.type == "cuda")
    if compile_model and device.type == "cuda" and a.coordinate_descent:
        torch._inductor.config.coordinate_descent_tuning = True  # as the record: a longer compile, faster kernels
    torch.manual_seed(a.seed)
    model = GPT(GPTConfig.from_args(a, fp8_head=int(fp8_head))).to(device)
    if compile_model:  # inductor fuses the head's (N, V) passes: the loss written for it, on a CPU too
        model.head_loss = HeadLoss(a.logit_softcap, model.config.copy_id)
    if device.type == "cuda":  # bf16 embeddings make the whole forward pass bf16; weights of linears stay fp32
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.bfloat16()
    if fp8_head and grad_accum > 1:  # each micro-step's loss is divided by grad_accum: its gradient is scaled
        # back up before the e5m2 cast, so FP8 keeps the 8-GPU run's precision (exact for a power of 2)
        x_scale, w_scale, grad_scale = model.lm_head.fp8_scales
        model.lm_head.fp8_scales = (x_scale, w_scale, grad_scale * grad_accum)
    for p in model.parameters():  # the same initial weights on every rank
        if world_size > 1:
            dist.broadcast(p.detach(), 0)
    optimizers = build_optimizers(model, a, rank, world_size, compiled=compile_model)
    n_params = sum(p.numel() for p in model.parameters())
    n_cp = sum(p.numel() for p in model.cp_head.parameters()) + 1 if model.cp_head is not None else 0  # + the bias
    gate_bias = "<copy> bias" if a.copy_gate == "lm" else "sink bias"  # the one scalar that starts the gate closed
    log(f"parameters: {n_params:,} (CP head and {gate_bias}: {n_cp:,} = {100 * n_cp / n_params:.3f}%); "
        f"grad_accum: {grad_accum}; LM head: {'fp8' if fp8_head else 'bf16' if device.type == 'cuda' else 'fp32'}; "
        f"CP backend: {model.cp_backend if model.cp_head is not None else '-'}")
    compiled = torch.compile(model, dynamic=False) if compile_model else model
    # gradients are averaged over ranks in the order the optimizer needs them: Muon's matrices first, so it
    # orthogonalises while the embeddings' and head's (most of the bytes) are still on the wire
    adam, muon = optimizers
    reduce_order = [p for g in muon.param_groups for p in g["params"]] + \
                   [p for g in reversed(adam.param_groups) for p in g["params"]]
    window_tensors = {}  # one int32 tensor per window size, made once: no host-to-device copy per step

    def window_tensor(step):
        w = window_blocks(step, a)
        if w not in window_tensors:
            window_tensors[w] = torch.full((), w, dtype=torch.int32, device=device)  # a fill: no host copy
        return window_tensors[w]

    def train_step(step):
        window = window_tensor(step)
        loss_sum = torch.zeros((), device=device)
        for inputs, targets in loader.next_batch(device):
            loss = compiled(inputs, targets, window) / grad_accum
            loss.backward()
            loss_sum += loss.detach()
        pending = reduce_gradients(reduce_order, world_size)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_multiplier(step, a)
        warm = min(step / max(a.muon_momentum_warmup_steps, 1), 1)
        for group in muon.param_groups:
            group["momentum"] = (1 - warm) * 0.85 + warm * a.muon_momentum
        muon.step(wait_for_gradient=pending.wait)
        for p in reduce_order:
            pending.wait(p)
        adam.step()
        model.zero_grad(set_to_none=True)
        return loss_sum

    # untimed warm-up: compiles the training and evaluation graphs, then everything is reset to its initial
    # state (so no kernel compiles while the clock runs; the record instead restarts its clock at step 10)
    if a.warmup_steps > 0:
        initial = dict(model={k: v.clone() for k, v in model.state_dict().items()},
                       optimizers=[copy.deepcopy(o.state_dict()) for o in optimizers])
        for step in range(a.warmup_steps):
            train_step(step)
        if a.val_tokens > 0:  # --val_tokens 0 (a timing run): no evaluation graph to compile
            evaluate(compiled, val_tokens[:a.val_seq_len + 1], dataclasses.replace(a, val_tokens=a.val_seq_len),
                     window_tensor(0), 0, 1, device)
        model.load_state_dict(initial["model"])
        for opt, state in zip(optimizers, initial["optimizers"]):
            opt.load_state_dict(state)
        loader.set_state({"position": 0})
        log(f"warm-up done: {a.warmup_steps} steps" + (" and one validation row" if a.val_tokens else "")
            + ", untimed; model and optimizers reset")

    # the clock and the schedule continue where a checkpoint stopped; saves rotate (--keep_checkpoints)
    saves = run_files.Checkpoints(a, log, checkpoint, model, optimizers, loader, changed)
    start_step, training_time_ms = saves.start_step, saves.training_time_ms

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if before_clock is not None:
        waited = time.perf_counter()
        before_clock()
        log(f"before the clock: waited {time.perf_counter() - waited:.1f}s")
    peak_train = peak_eval = 0  # bytes: training and validation apart (validation rows can be much longer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize()
    t0 = time.perf_counter()
    step, result, start_ms, stuck = start_step, None, training_time_ms, None
    while True:
        last = step == a.num_iterations
        validate = a.val_tokens > 0 and (last or (a.val_loss_every > 0 and step % a.val_loss_every == 0))
        if validate or last:  # the clock stops during validation, and at the end
            synchronize()
            training_time_ms += 1000 * (time.perf_counter() - t0)
            if device.type == "cuda":
                peak_train = max(peak_train, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            if validate:
                result = evaluate(compiled, val_tokens, a, window_tensor(step), rank, world_size, device)
                if device.type == "cuda":
                    peak_eval = max(peak_eval, torch.cuda.max_memory_allocated())
                    torch.cuda.reset_peak_memory_stats()
                log(f"step:{step}/{a.num_iterations} val_loss:{result['val_loss']:.4f} "
                    f"train_time:{training_time_ms:.0f}ms step_avg:{training_time_ms / max(step, 1):.2f}ms")
                log(f"step:{step}/{a.num_iterations} " + " ".join(f"{k}:{v:.4f}" for k, v in result.items()
                                                                  if k != "val_loss"))
                if stuck == f"{result['val_loss']:.4f}" and step > start_step:  # not moved since the start: say so
                    log(f"warning: val_loss is still {stuck}, as at step {start_step}: a learning rate far too large "
                        "(or 0) leaves the model where it started")
                stuck = f"{result['val_loss']:.4f}" if step == start_step else None
                if not math.isfinite(result["val_loss"]):
                    log(f"stopped: val_loss is {result['val_loss']} at step {step}; "
                        "lower the learning rates or check the data")
                    return 1
                if 0 < a.target_val_loss and result["val_loss"] <= a.target_val_loss:
                    log(f"target val_loss {a.target_val_loss} reached at step {step}")
                    last = True
            synchronize()
            t0 = time.perf_counter()
        if not log.started:  # after the first validation: only now does an --overwrite run replace the old log
            log.start(overwrite=bool(a.overwrite))
        if rank == 0 and step > start_step and ((a.checkpoint_every > 0 and step % a.checkpoint_every == 0)
                                                or (last and a.save_checkpoint)):
            synchronize()
            training_time_ms += 1000 * (time.perf_counter() - t0)  # the clock stops while saving, and is saved
            saves.save(step, training_time_ms)
            t0 = time.perf_counter()
        if last:
            break
        train_loss = train_step(step)
        step += 1
        log_loss = a.train_loss_every > 0 and step % a.train_loss_every == 0
        if log_loss:  # .item() waits for the GPU before the clock is read: train_time on these lines is exact
            train_loss = all_reduce_sum(train_loss, world_size).item() / world_size
        approx_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
        timing = f"train_time:{approx_ms:.0f}ms step_avg:{approx_ms / step:.2f}ms"
        left_s = (approx_ms - start_ms) / (step - start_step) * (a.num_iterations - step) / 1000
        eta = f" (eta {int(left_s // 60)}m{int(left_s % 60):02d}s of training)"
        if log_loss:
            log(f"step:{step}/{a.num_iterations} train_loss:{train_loss:.4f} {timing}", console_extra=eta)
            if not math.isfinite(train_loss):
                log(f"stopped: train_loss is {train_loss} at step {step}; lower the learning rates or check the data")
                return 1
        else:
            log(f"step:{step}/{a.num_iterations} {timing}", console_extra=eta)

    if device.type == "cuda":
        log(f"peak memory allocated: {max(peak_train, peak_eval) // 2**20} MiB "
            f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
        log(f"peak memory allocated in training: {peak_train // 2**20} MiB, in validation: {peak_eval // 2**20} MiB")
    else:
        import resource
        log(f"peak memory (max RSS of rank 0): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
    val = f"val_loss:{result['val_loss']:.4f} " if result else ""  # --val_tokens 0: no val loss to give
    log(f"final {val}train_time:{training_time_ms:.0f}ms steps:{step}")
    return 0


class PendingReductions:
    """Asynchronous gradient all-reduces, one per parameter; wait(p) blocks until p's gradient is averaged."""

    def __init__(self, works, world_size, average_after):
        self.works, self.world_size, self.average_after = works, world_size, average_after

    def wait(self, p):
        work = self.works.pop(p, None)
        if work is not None:
            work.wait()
            if self.average_after:
                p.grad.div_(self.world_size)


def reduce_gradients(params, world_size) -> PendingReductions:
    """Starts averaging every gradient over the ranks, in the given order, without waiting. NCCL averages
    natively; gloo sums and the average follows the wait. Why not DDP's hooks during the backward pass: the
    compiled backward is one graph that hands over every gradient at its end, so they would start at the
    same moment as these; DDP gets a real overlap by splitting that graph at every bucket, which would cut
    FlexAttention's block masks across graphs."""
    if world_size == 1:
        return PendingReductions({}, 1, False)
    nccl = dist.get_backend() == "nccl"
    op = dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM
    return PendingReductions({p: dist.all_reduce(p.grad, op=op, async_op=True) for p in params}, world_size, not nccl)


if __name__ == "__main__":
    # under torchrun every rank fails alike: rank 0 says why, the others wait for torchrun to end them
    said_by_rank_0 = int(os.environ.get("RANK", 0)) > 0 and "TORCHELASTIC_RUN_ID" in os.environ
    try:
        sys.exit(main())
    except (UsageError, DataError, KeyboardInterrupt) as e:  # one line, no traceback
        code = 2 if isinstance(e, UsageError) else 130 if isinstance(e, KeyboardInterrupt) else 1
        said = "stopped by Ctrl-C (its log says so)" if code == 130 else f"error: {e}{' (see --help)' * (code == 2)}"
        if said_by_rank_0 and code != 130:  # exiting first had torchrun kill rank 0 before it said why; still
            time.sleep(60)  # here after a minute, rank 0 did not fail alike: this rank says it
        print(f"{os.path.basename(sys.argv[0])}: {said}", file=sys.stderr)
        sys.exit(code)
