"""train_gpt_cplm.py: a NanoGPT-speedrun-style GPT on FineWeb, vanilla or Copy-Paste LM (CPLM), in one file.

    torchrun --standalone --nproc_per_node=8 train_gpt_cplm.py             # vanilla speedrun
    torchrun --standalone --nproc_per_node=8 train_gpt_cplm.py --cplm 1    # the same run with a CP head
    python train_gpt_cplm.py --preset cpu                                  # small model on a CPU

Sections, in the order data flows: config -> data -> model (backbone, CP head) -> loss -> optimizer ->
distributed loop -> logging. The method, in short, is in README.md; here, look for
`CopyPasteHead`, `cplm_target_log_prob` (the training loss), `cplm_log_probs` (the dense reference)
and `Hyperparameters.cplm` (the switch).
"""
import argparse
import ctypes
import dataclasses
import glob
import json
import math
import os
import platform
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------------------------------
# Config


@dataclass
class Hyperparameters:
    preset: str = "auto"  # speedrun (8xH100) | cpu (2 cores, minutes) | auto: speedrun with CUDA, else cpu
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10485760  # the first val_tokens tokens of the val files are the validation set
    vocab_size: int = 50257  # tokenizer ids; <copy> is id vocab_size; the head is padded to a multiple of 128
    bos_id: int = 50256  # starts every document: attention and copying never cross it
    # batch: one optimizer step sees batch_size tokens = (batch_size // seq_len) rows of seq_len tokens,
    # split over ranks and, when there are fewer ranks than rows, over gradient-accumulation micro-steps
    batch_size: int = 8 * 64 * 1024
    seq_len: int = 64 * 1024  # tokens in one packed row (one micro-step of one rank); multiple of 128
    val_seq_len: int = 64 * 1024
    # model
    num_layers: int = 12
    model_dim: int = 768
    num_heads: int = 6
    attn_window: int = 1792  # sliding-window size (tokens) at the end of training
    attn_window_start: int = 128  # window at step 0; it grows linearly to attn_window
    logit_softcap: float = 15.0
    # Copy-Paste head (see CopyPasteHead)
    cplm: int = 0  # 0: vanilla GPT; 1: CPLM (CP head + <copy> gate + mixture loss)
    cp_dim: int = 64  # width of the CP head's queries and keys
    # records/gate_init: W_Q, W_K trained by Muon or by Adam end level (3.032 vs 3.026 at 100 cpu steps), so
    # Adam, which keeps them out of Muon's all-gather; a gate that starts half open reaches the vanilla run's
    # final loss in half the steps of one that starts closed (c = 1/50304), and ends level (3.014 vs 3.026)
    cp_optimizer: str = "adam"  # "adam" (at lr_cp) or "muon" (at lr_muon)
    lr_cp: float = 0.008
    copy_gate_init: float = 0.5  # the gate c at step 0, set through a bias on the <copy> logit
    cp_stop_grad: int = 0  # ablation: 1 stops the CP head's gradient into the backbone
    # optimization
    num_iterations: int = 1770
    cooldown_frac: float = 0.4  # the learning rates decay linearly over this final fraction of steps
    lr_embed: float = 0.6
    lr_head: float = 0.008
    lr_scalar: float = 0.04
    lr_muon: float = 0.05
    muon_momentum: float = 0.95
    muon_momentum_warmup_steps: int = 300  # momentum rises linearly from 0.85 to muon_momentum
    # evaluation, logging, checkpoints
    val_loss_every: int = 125  # 0: validate only at the end
    target_val_loss: float = 0.0  # > 0: stop at the first validation at or below it
    seed: int = 0
    run_id: str = ""  # default: a fresh uuid
    log_dir: str = "logs"
    compile: int = -1  # torch.compile the model; -1: on CUDA only
    warmup_steps: int = 10  # untimed steps that compile kernels; the model and optimizers are then reset
    checkpoint_every: int = 0  # > 0: save a checkpoint every this many steps
    save_checkpoint: int = 0  # 1: save one at the end
    resume: str = ""  # path of a checkpoint to continue from


PRESETS = {
    # the 8xH100 speedrun: 1770 steps of 512Ki tokens; one 64Ki-token row per GPU and step
    "speedrun": dict(),
    # a 2-core CPU: a 4 x 128 model that trains in minutes on the Python standard library's source
    "cpu": dict(
        train_files="data/pystdlib/pystdlib_train_*.bin",
        val_files="data/pystdlib/pystdlib_val_*.bin",
        val_tokens=16384,
        batch_size=2 * 1024,
        seq_len=1024,
        val_seq_len=4096,
        num_layers=4,
        model_dim=128,
        num_heads=2,
        attn_window=1024,
        attn_window_start=1024,
        num_iterations=200,
        val_loss_every=25,
        warmup_steps=0,
        lr_muon=0.04,
    ),
}


class UsageError(Exception):
    """A bad command line: reported in one line, exit code 2."""


class DataError(Exception):
    """Missing or malformed data: reported in one line, exit code 1."""


def parse_args(argv=None) -> Hyperparameters:
    """--field value for every Hyperparameters field; the preset sets defaults, explicit flags win."""
    defaults = Hyperparameters()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # one line, not usage
    for f in dataclasses.fields(Hyperparameters):
        kind = type(getattr(defaults, f.name))
        parser.add_argument(f"--{f.name}", type=kind, default=None, metavar=kind.__name__.upper())
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    preset = given.get("preset", "auto")
    if preset == "auto":
        preset = "speedrun" if torch.cuda.is_available() else "cpu"
    if preset not in PRESETS:
        raise UsageError(f"--preset must be one of {', '.join(PRESETS)} or auto, not {preset!r}")
    args = dataclasses.replace(defaults, **{**PRESETS[preset], **given, "preset": preset})
    check_args(args)
    return args


def check_args(a: Hyperparameters):
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    need(a.cplm in (0, 1), f"--cplm must be 0 or 1, not {a.cplm}")
    need(a.seq_len > 0 and a.seq_len % 128 == 0, f"--seq_len must be a positive multiple of 128, not {a.seq_len}")
    need(a.val_seq_len > 0 and a.val_seq_len % 128 == 0, f"--val_seq_len must be a positive multiple of 128")
    need(a.batch_size > 0 and a.batch_size % a.seq_len == 0, "--batch_size must be a multiple of --seq_len")
    need(a.val_tokens > 0 and a.val_tokens % a.val_seq_len == 0, "--val_tokens must be a multiple of --val_seq_len")
    need(a.model_dim % a.num_heads == 0 and (a.model_dim // a.num_heads) % 4 == 0,
         "--model_dim must be num_heads x head_dim with head_dim a multiple of 4")
    need(a.num_layers >= 1 and a.num_iterations >= 0, "--num_layers must be >= 1 and --num_iterations >= 0")
    need(0 < a.attn_window_start <= a.attn_window, "need 0 < --attn_window_start <= --attn_window")
    need(0 <= a.bos_id < a.vocab_size, "--bos_id must be a token id below --vocab_size")
    need(a.cp_dim > 0 and a.cp_optimizer in ("adam", "muon"), "--cp_dim must be > 0, --cp_optimizer adam|muon")
    need(0 < a.copy_gate_init < 1, "--copy_gate_init is the gate's starting value: it must lie in (0, 1)")
    need(0 <= a.cooldown_frac <= 1, "--cooldown_frac must lie in [0, 1]")
    need(a.resume == "" or os.path.isfile(a.resume), f"--resume: no such checkpoint file: {a.resume}")


# -----------------------------------------------------------------------------------------------------
# Data: shards of a 256 x int32 header (magic 20240520, version, token count, vocabulary size) + tokens

SHARD_MAGIC = 20240520
SHARD_DTYPES = {1: np.uint16, 2: np.uint32}  # version -> token type


def load_shard(path: str, vocab_size: int | None = None) -> np.ndarray:
    """Memory-maps the tokens of one shard after checking its header against the file."""
    size = os.path.getsize(path)
    if size < 1024:
        raise DataError(f"{path}: {size} bytes, too short for the 1024-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: not a token shard (magic {header[0]}, expected {SHARD_MAGIC})")
    if header[1] not in SHARD_DTYPES:
        raise DataError(f"{path}: unsupported shard version {header[1]} (1 = uint16, 2 = uint32 tokens)")
    dtype, count = np.dtype(SHARD_DTYPES[int(header[1])]), int(header[2])
    if size != 1024 + count * dtype.itemsize:
        raise DataError(f"{path}: truncated or padded: header says {count} tokens, "
                        f"the file holds {(size - 1024) / dtype.itemsize:.0f}")
    if vocab_size is not None and header[3] > vocab_size:
        raise DataError(f"{path}: written for a vocabulary of {header[3]} ids; pass --vocab_size {header[3]}")
    return np.memmap(path, dtype=dtype, mode="r", offset=1024, shape=(count,))


def find_shards(pattern: str) -> list[str]:
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"no shards match {pattern}: fetch FineWeb with `python data/cached_fineweb10B.py 10`, "
                        "or build the CPU corpus with `bash run.sh` (see README.md)")
    return files


class TrainLoader:
    """Streams global batches through the shards in order. Step s reads the same batch_size + 1 tokens for
    any world size; row i of the batch (seq_len + 1 tokens) goes to rank i % world_size, micro-step
    i // world_size, so 1, 2, 4 or 8 ranks train on exactly the same data."""

    def __init__(self, pattern, batch_size, seq_len, rank, world_size, vocab_size):
        self.files, self.vocab_size = find_shards(pattern), vocab_size
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.set_state({"file_index": 0, "position": 0})

    def state(self):
        return {"file_index": self.file_index, "position": self.position}

    def set_state(self, state):
        self.file_index, self.position = state["file_index"], state["position"]
        self.tokens = load_shard(self.files[self.file_index], self.vocab_size)

    def next_batch(self, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(inputs, targets)] for this rank's micro-steps, each (1, seq_len) int64."""
        need = self.batch_size + 1
        if len(self.tokens) < need:
            raise DataError(f"{self.files[self.file_index]}: {len(self.tokens)} tokens, a batch needs {need}")
        if self.position + need > len(self.tokens):  # next shard; after the last one, start over
            self.set_state({"file_index": (self.file_index + 1) % len(self.files), "position": 0})
        micro = []
        for i in range(self.rank, self.batch_size // self.seq_len, self.world_size):  # this rank's rows only
            start = self.position + i * self.seq_len
            row = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
            row = row.to(device, non_blocking=True)
            micro.append((row[None, :-1], row[None, 1:]))
        self.position += self.batch_size
        return micro


def load_val_tokens(pattern: str, num_tokens: int, vocab_size: int) -> torch.Tensor:
    """The first num_tokens + 1 tokens of the val shards (inputs and their shifted targets)."""
    parts, have = [], 0
    for path in find_shards(pattern):
        parts.append(load_shard(path, vocab_size)[:num_tokens + 1 - have])
        have += len(parts[-1])
        if have == num_tokens + 1:
            return torch.from_numpy(np.concatenate(parts).astype(np.int64))
    raise DataError(f"{pattern}: {have} val tokens, --val_tokens {num_tokens} needs {num_tokens + 1}")


# -----------------------------------------------------------------------------------------------------
# Model: the backbone (GPT of the early-2025 speedrun records)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def next_multiple(n, multiple):
    return -(-n // multiple) * multiple


class CastedLinear(nn.Linear):
    """Linear without bias whose fp32 weight is cast to the activations' dtype (bf16 on GPU)."""

    def __init__(self, in_features, out_features, zero_init=False):
        super().__init__(in_features, out_features, bias=False)
        bound = 0.5 * (3 / in_features) ** 0.5  # uniform with std 0.5 / sqrt(in), as in the speedrun
        with torch.no_grad():
            self.weight.zero_() if zero_init else self.weight.uniform_(-bound, bound)

    def forward(self, x):
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


def doc_ids_of(input_ids, bos_id):
    """Document index of every position: a new document starts at each BOS."""
    return (input_ids == bos_id).cumsum(-1)


def dense_attention_mask(doc_ids, window):
    """(B, 1, T, T) bool: causal, same document, fewer than `window` positions back."""
    pos = torch.arange(doc_ids.size(-1), device=doc_ids.device)
    distance = pos[:, None] - pos[None, :]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & (distance >= 0) & (distance < window))[:, None]


def document_block_mask(doc_ids, window, mask_mod, all_partial=False, block=128):
    """FlexAttention BlockMask built from the document boundaries, never by evaluating mask_mod on every
    (query, key) pair: a 128 x 128 block is skipped when it holds no causal same-document pair within the
    window, 'full' when every pair qualifies, else 'partial' (mask_mod runs inside it). all_partial marks
    every visited block partial, for masks that test more than the documents (the CP head's token match)."""
    B, T = doc_ids.shape
    nb = T // block
    first, last = doc_ids.view(B, nb, block)[..., 0], doc_ids.view(B, nb, block)[..., -1]
    qb = torch.arange(nb, device=doc_ids.device)[:, None]
    kb = torch.arange(nb, device=doc_ids.device)[None, :]
    near = (qb - kb) * block - (block - 1) < window  # the closest pair is inside the window
    far_ok = (qb - kb) * block + (block - 1) < window  # the farthest pair is inside the window
    doc_overlap = (first[:, :, None] <= last[:, None, :]) & (last[:, :, None] >= first[:, None, :])
    one_doc = (first[:, :, None] == last[:, None, :]) & (last[:, :, None] == first[:, None, :])
    visit = (qb >= kb) & near & doc_overlap
    full = (qb > kb) & far_ok & one_doc & visit & (not all_partial)
    partial = visit & ~full

    def as_indices(blocks):  # (B, nb, nb) bool -> counts and indices, visited blocks first
        counts = blocks.sum(-1, dtype=torch.int32)[:, None]
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
        return counts.contiguous(), order.to(torch.int32)[:, None].contiguous()

    return BlockMask.from_kv_blocks(*as_indices(partial), *as_indices(full), BLOCK_SIZE=block, mask_mod=mask_mod)


def flex_document_mask(doc_ids, window):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return document_block_mask(doc_ids, window, mask_mod)


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
    def __init__(self, dim, num_heads, max_seq_len):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, max_seq_len)
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # mix of the residual stream and x0

    def forward(self, x, value_embed, x0, mask):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
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
        self.w_q = CastedLinear(dim, cp_dim)
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
    num_layers: int = 12
    model_dim: int = 768
    num_heads: int = 6
    max_seq_len: int = 64 * 1024
    logit_softcap: float = 15.0
    cplm: int = 0
    cp_dim: int = 64
    copy_gate_init: float = 0.5
    cp_stop_grad: int = 0

    @property
    def padded_vocab(self):  # room for <copy>, rounded up to a multiple of 128 (50304 for GPT-2)
        return next_multiple(self.vocab_size + 1, 128)

    @property
    def copy_id(self):  # the first slot past the tokenizer's ids
        return self.vocab_size

    @classmethod
    def from_args(cls, a: Hyperparameters):
        kept = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dataclasses.asdict(a).items() if k in kept},
                   max_seq_len=max(a.seq_len, a.val_seq_len))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        V, D, L = c.padded_vocab, c.model_dim, c.num_layers
        self.embed = nn.Embedding(V, D)
        # value embeddings feed the first and the last few layers (U-net symmetric)
        self.num_value_embeds = min(3, L // 2)
        self.value_embeds = nn.ModuleList([nn.Embedding(V, D) for _ in range(self.num_value_embeds)])
        self.blocks = nn.ModuleList([Block(D, c.num_heads, c.max_seq_len) for _ in range(L)])
        # U-net: the first half's outputs are added, weighted, to the second half's inputs
        self.num_encoder_layers = L // 2
        self.skip_weights = nn.Parameter(torch.ones(L - self.num_encoder_layers))
        self.lm_head = CastedLinear(D, V, zero_init=True)
        self.cp_head = CopyPasteHead(D, c.cp_dim) if c.cplm else None
        if c.cplm:  # a bias on the <copy> logit (after the soft-cap); the zero-initialised head makes every
            # other logit 0 at step 0, so c = copy_gate_init there
            bias = math.log(c.copy_gate_init / (1 - c.copy_gate_init)) + math.log(c.padded_vocab - 1)
            self.copy_logit_bias = nn.Parameter(torch.tensor(bias))
        # "flex" (FlexAttention kernels, CUDA) or "dense" (masked SDPA and chunked dense CP sums, any device)
        self.attention_backend = "flex" if torch.cuda.is_available() else "dense"

    def hidden_states(self, input_ids, window):
        """Final normed hidden states h (B, T, D) and the document ids."""
        c = self.config
        doc_ids = doc_ids_of(input_ids, c.bos_id)
        if self.attention_backend == "flex":
            mask = flex_document_mask(doc_ids, window)
        else:
            mask = dense_attention_mask(doc_ids, window)
        ve = [emb(input_ids) for emb in self.value_embeds]
        ve = ve + [None] * (c.num_layers - 2 * len(ve)) + ve
        x = x0 = norm(self.embed(input_ids))
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= self.num_encoder_layers:
                x = x + self.skip_weights[i - self.num_encoder_layers] * skips.pop()
            x = block(x, ve[i], x0, mask)
            if i < self.num_encoder_layers:
                skips.append(x)
        return norm(x), doc_ids

    def lm_logits(self, h):
        """Soft-capped LM-head logits over the padded vocabulary, float32."""
        cap = self.config.logit_softcap
        return cap * torch.tanh(self.lm_head(h).float() / cap)

    def forward(self, input_ids, target_ids, window=None, token_stats=False):
        """Mean next-token loss; with token_stats, a dict of per-token tensors (B, T): nll, copyable
        (the target occurs earlier in its document) and, in CPLM mode, the gates lam, c, s."""
        window = input_ids.size(-1) if window is None else window
        h, doc_ids = self.hidden_states(input_ids, window)
        head_out, cap, copy_id = self.lm_head(h), self.config.logit_softcap, self.config.copy_id
        copyable = None  # vanilla training never needs it: no sort on that hot path
        if self.cp_head is not None or token_stats:
            copyable = target_in_context(input_ids, target_ids, doc_ids, self.config.padded_vocab)
        if self.cp_head is None:  # cross-entropy over all slots, through the same LM-head kernel as CPLM
            lse_without_copy, z_copy, z_y = lm_head_terms(head_out, target_ids, copy_id, cap)
            stats = {"nll": torch.logaddexp(lse_without_copy, z_copy) - z_y}
        else:
            q, k, sink_key = self.cp_head(h.detach() if self.config.cp_stop_grad else h)
            stats = cplm_target_log_prob(head_out, q, k, sink_key, input_ids, target_ids, doc_ids, copyable,
                                         copy_id, self.copy_logit_bias, cap, backend=self.attention_backend)
            stats["nll"] = -stats.pop("log_p")
        return {**stats, "copyable": copyable} if token_stats else stats["nll"].mean()

    @torch.no_grad()
    def next_token_log_probs(self, input_ids):
        """log p(next token) at every position and vocabulary slot, (B, T, padded_vocab) float32, through
        the dense reference. Each row must be one document (no BOS after position 0)."""
        h, _ = self.hidden_states(input_ids, input_ids.size(-1))
        logits = self.lm_logits(h)
        if self.cp_head is None:
            return logits.log_softmax(-1)
        q, k, sink_key = self.cp_head(h)
        copy_slot = torch.tensor([self.config.copy_id], device=logits.device)
        logits = logits.index_add(-1, copy_slot, self.copy_logit_bias.expand(*logits.shape[:-1], 1))
        return cplm_log_probs(logits, q, k, sink_key, input_ids, self.config.copy_id)


# -----------------------------------------------------------------------------------------------------
# Loss: the CPLM mixture  p(v) = (1 - lam) p_LM(v) + lam p_CP(v),  lam = c (1 - s)
#   c = p_full(<copy>) from the LM head, s = the sink's share of the CP softmax; all in log space.


def cplm_log_probs(lm_logits, q, k, sink_key, input_ids, copy_id):
    """Dense reference of the mixture: log p(v) for every slot, (B, T, Vp) float32, <copy> at -inf.
    lm_logits (B, T, Vp) after the soft-cap; q, k (B, T, d); sink_key (d,); input_ids (B, T).
    Each row is one document; position t may copy from every tau <= t. Builds (T, T) and (T, Vp) tensors:
    for tests, evaluation and sampling, not for training."""
    B, T, Vp = lm_logits.shape
    z = lm_logits.float()
    q, k, sink_key = q.float(), k.float(), sink_key.float()
    scale = q.size(-1) ** -0.5
    log_p_full = z.log_softmax(-1)
    log_c = log_p_full[..., copy_id]
    log_1mc = torch.logaddexp(log_p_full[..., :copy_id].logsumexp(-1), log_p_full[..., copy_id + 1:].logsumexp(-1))
    causal = torch.ones(T, T, dtype=torch.bool, device=z.device).tril()
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
    a_sink = q @ sink_key * scale
    lse_all = torch.logaddexp(scores.logsumexp(-1), a_sink)
    log_s = a_sink - lse_all
    # copy mass per token: sum of alpha_t(tau) over tau with x_tau = v, computed relative to the row max
    row_max = scores.amax(-1, keepdim=True)
    weights = (scores - row_max).exp()
    mass = torch.zeros_like(z).scatter_add_(-1, input_ids[:, None, :].expand(B, T, T), weights)
    safe_log_mass = torch.where(mass > 0, mass.clamp_min(1e-30).log(), float("-inf"))
    log_copy = log_c[..., None] + safe_log_mass + row_max - lse_all[..., None]
    log_1ml = torch.logaddexp(log_1mc, log_c + log_s)
    log_lm = (log_1ml - log_1mc)[..., None] + log_p_full
    out = torch.logaddexp(log_lm, log_copy)
    return out.index_fill(-1, torch.tensor([copy_id], device=z.device), float("-inf"))


def target_in_context(input_ids, target_ids, doc_ids, vocab):
    """(B, T) bool: the target y_t occurs at some tau <= t of the same document (it can be copied).
    One sort of (document, token) keys and a binary search: O(T log T), no (T, T) tensor."""
    pos = torch.arange(input_ids.size(-1), device=input_ids.device).expand_as(input_ids)
    keys, order = torch.sort(doc_ids * vocab + input_ids, dim=-1, stable=True)  # earliest position first
    wanted = doc_ids * vocab + target_ids
    i = torch.searchsorted(keys, wanted).clamp(max=input_ids.size(-1) - 1)
    return (keys.gather(-1, i) == wanted) & (order.gather(-1, i) <= pos)


def copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, backend, chunk=512):
    """The CP head's two row-wise log-sum-exps of a_t(tau) = q_t . k_tau / sqrt(d), over tau <= t in t's
    document (lse_doc) and over those with x_tau = y_t (lse_match). A row with nothing to copy gets its own
    position as the only key instead of an empty set (finite, no NaN gradient); the caller drops it."""
    scale = q.size(-1) ** -0.5
    if backend == "flex":
        B, T, d = q.shape
        q4, k4 = q[:, None], k[:, None]  # one head

        def match_mod(b, h, q_idx, kv_idx):
            same = (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
            hit = input_ids[b, kv_idx] == target_ids[b, q_idx]
            return same & (hit | (~copyable[b, q_idx] & (q_idx == kv_idx)))

        doc_mask = flex_document_mask(doc_ids, T)
        match_mask = document_block_mask(doc_ids, T, match_mod, all_partial=True)
        # the value is k (unused): only the LSEs, with their gradients, enter the loss
        _, doc_aux = flex_attention(q4, k4, k4, block_mask=doc_mask, scale=scale, return_aux=AuxRequest(lse=True))
        _, match_aux = flex_attention(q4, k4, k4, block_mask=match_mask, scale=scale, return_aux=AuxRequest(lse=True))
        return doc_aux.lse[:, 0], match_aux.lse[:, 0]

    # dense: chunks of queries against the keys of their documents, each chunk recomputed in the backward
    # pass (checkpoint), so memory stays O(chunk x T) instead of O(T x T)
    doc_start = _document_starts(doc_ids)
    lse_doc, lse_match = [], []
    for lo in range(0, q.size(1), chunk):
        hi = min(lo + chunk, q.size(1))
        k_lo = int(doc_start[:, lo].min())  # no key before the first query's document can be used
        parts = checkpoint(_dense_copy_lse_chunk, q[:, lo:hi], k[:, k_lo:hi], input_ids[:, k_lo:hi],
                           target_ids[:, lo:hi], doc_ids[:, lo:hi], doc_ids[:, k_lo:hi], copyable[:, lo:hi],
                           lo, k_lo, scale, use_reentrant=False)
        lse_doc.append(parts[0])
        lse_match.append(parts[1])
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


class LMHeadTerms(torch.autograd.Function):
    """From the LM head's output u (N, Vp): the soft-capped logits z = cap tanh(u / cap) (cap 0: z = u), then
    the logsumexp over every slot but <copy>, z_copy and z_y. The same numbers as autograd through tanh,
    slices and gathers, but the hand-written backward builds one (N, Vp) tensor where autograd builds
    five: the (N, Vp) passes dominate a CPU step. Both modes use it (vanilla: nll = logsumexp(z) - z_y),
    so a CPLM / vanilla ratio measures the CP head, not two implementations of the LM-head softmax."""

    @staticmethod
    def forward(ctx, u, target_ids, copy_id, softcap):
        if softcap > 0:
            z = u.float().div(softcap).tanh_().mul_(softcap)
            row_max = torch.full_like(z[:, 0], softcap)  # |z| <= cap: exp(z - cap) cannot overflow
        else:
            z = u.float()
            row_max = torch.maximum(z[:, :copy_id].amax(-1), z[:, copy_id + 1:].amax(-1))
        e = (z - row_max[:, None]).exp_()
        e[:, copy_id] = 0
        lse_without_copy = e.sum(-1).log_() + row_max
        ctx.copy_id, ctx.softcap, ctx.dtype = copy_id, softcap, u.dtype
        ctx.save_for_backward(z, target_ids, lse_without_copy)
        return lse_without_copy, z[:, copy_id].clone(), z.gather(1, target_ids[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad_lse, grad_copy, grad_target):
        z, target_ids, lse_without_copy = ctx.saved_tensors
        grad = (z - lse_without_copy[:, None]).exp_().mul_(grad_lse[:, None])  # softmax without <copy>
        grad[:, ctx.copy_id] = grad_copy
        grad.scatter_add_(1, target_ids[:, None], grad_target[:, None])
        if ctx.softcap > 0:  # d z / d u = 1 - tanh^2 = 1 - (z / cap)^2
            grad.mul_(z.div(ctx.softcap).square_().neg_().add_(1))
        return grad.to(ctx.dtype), None, None, None


def lm_head_terms(head_out, target_ids, copy_id, softcap=0.0):
    """(B, T) each: logsumexp of the (soft-capped) logits without <copy>, the <copy> logit, the target's."""
    B, T, Vp = head_out.shape
    terms = LMHeadTerms.apply(head_out.reshape(B * T, Vp), target_ids.reshape(-1), copy_id, softcap)
    return [x.view(B, T) for x in terms]


def cplm_target_log_prob(lm_logits, q, k, sink_key, input_ids, target_ids, doc_ids, copyable, copy_id,
                         copy_bias=0.0, softcap=0.0, backend="dense", chunk=512):
    """The training loss's quantities at the targets only: log p(y_t) of the mixture and the gates, each
    (B, T) float32. softcap > 0: lm_logits is the head's raw output and gets the soft-cap here; copy_bias
    is then added to the <copy> logit. Packed rows: copying stays inside each document. Never builds a
    (T, V) copy distribution; the dense backend never holds more than a (chunk, T) score block."""
    lse_without_copy, z_copy, z_y = lm_head_terms(lm_logits, target_ids, copy_id, softcap)
    z_copy = z_copy + copy_bias
    log_z = torch.logaddexp(lse_without_copy, z_copy)
    log_c = z_copy - log_z
    log_1mc = lse_without_copy - log_z
    log_p_full_y = z_y - log_z

    scale = q.size(-1) ** -0.5
    a_sink = (q @ sink_key.type_as(q)).float() * scale
    lse_doc, lse_match = copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, backend, chunk)
    lse_all = torch.logaddexp(lse_doc.float(), a_sink)
    log_s = a_sink - lse_all
    log_1ml = torch.logaddexp(log_1mc, log_c + log_s)  # 1 - lam = (1 - c) + c s
    lm_term = log_1ml - log_1mc + log_p_full_y
    copy_term = torch.where(copyable, log_c + lse_match.float() - lse_all, float("-inf"))
    log_p = torch.logaddexp(lm_term, copy_term)
    return {"log_p": log_p, "lam": -torch.expm1(log_1ml), "c": log_c.exp(), "s": log_s.exp()}


# -----------------------------------------------------------------------------------------------------
# Optimizer: Muon for the hidden matrices, Adam for embeddings, head and scalars


def newton_schulz(G, steps=5):
    """Approximately orthogonalises G (..., m, n): the quintic iteration of the speedrun, in bf16."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.bfloat16()
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if transposed else X).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, then Newton-Schulz orthogonalisation, scaled by sqrt(max(1, rows / cols)).
    Our own rather than torch.optim.Muon: with several ranks, each orthogonalises only its share of the
    matrices and the updated weights are all-gathered (the speedrun's split of the work); torch.optim.Muon
    repeats every matrix on every rank. Every rank keeps every momentum buffer, so a checkpoint saved by
    rank 0 resumes at any world size."""

    def __init__(self, params, lr, momentum, rank=0, world_size=1):
        params = sorted(params, key=lambda p: -p.numel())
        groups = [{"params": [p for p in params if p.shape == shape]} for shape in dict.fromkeys(p.shape for p in params)]
        super().__init__(groups, dict(lr=lr, momentum=momentum))
        self.rank, self.world_size = rank, world_size

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params, lr, momentum = group["params"], group["lr"], group["momentum"]
            for p in params:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - momentum)
            for base in range(0, len(params), self.world_size):
                owned = base + self.rank
                if owned < len(params):
                    p = params[owned]
                    update = newton_schulz(p.grad.lerp(self.state[p]["momentum_buffer"], momentum))
                    p.add_(update, alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)
                if self.world_size > 1:
                    chunk = params[base:base + self.world_size]
                    gathered = [q.data for q in chunk] + [torch.empty_like(chunk[0])] * (self.world_size - len(chunk))
                    dist.all_gather(gathered, gathered[self.rank] if owned < len(params) else torch.empty_like(chunk[0]))


def build_optimizers(model: GPT, a: Hyperparameters, rank, world_size):
    matrices = [p for n, p in model.blocks.named_parameters() if p.ndim >= 2]
    cp_matrices = [model.cp_head.w_q.weight, model.cp_head.w_k.weight] if model.cp_head is not None else []
    scalars = [p for p in model.parameters() if p.ndim < 2 and p not in set(cp_matrices)]
    if a.cp_optimizer == "muon":
        matrices, cp_matrices = matrices + cp_matrices, []
    adam_groups = [
        dict(params=[model.embed.weight, *[e.weight for e in model.value_embeds]], lr=a.lr_embed),
        dict(params=[model.lm_head.weight], lr=a.lr_head),
        dict(params=scalars, lr=a.lr_scalar),  # block and skip scalars; CPLM: sink key, <copy> bias
    ] + ([dict(params=cp_matrices, lr=a.lr_cp)] if cp_matrices else [])
    adam = torch.optim.Adam(adam_groups, betas=(0.8, 0.95), eps=1e-10)
    muon = Muon(matrices, lr=a.lr_muon, momentum=a.muon_momentum, rank=rank, world_size=world_size)
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


def attention_window(step, a: Hyperparameters):
    """Sliding window in tokens, growing linearly from attn_window_start to attn_window, in steps of 128."""
    x = step / max(a.num_iterations, 1)
    grown = next_multiple(int(a.attn_window_start + (a.attn_window - a.attn_window_start) * x), 128)
    return min(a.attn_window, max(a.attn_window_start, grown))


# -----------------------------------------------------------------------------------------------------
# Distributed training loop


class Logger:
    """Rank 0 writes logs/<run_id>.txt: the script's source, the environment, then the run's lines."""

    def __init__(self, a: Hyperparameters, master: bool):
        self.path = os.path.join(a.log_dir, f"{a.run_id}.txt") if master else None
        if self.path:
            os.makedirs(a.log_dir, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(open(__file__).read() + "\n" + "=" * 100 + "\n")

    def __call__(self, line, console=True):
        if self.path:
            if console:
                print(line, flush=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")


def environment_lines(device, world_size):
    lines = [f"python {platform.python_version()} torch {torch.__version__} on {platform.platform()}",
             f"device: {device} world_size: {world_size} cpu_threads: {torch.get_num_threads()}"]
    if device.type == "cuda":
        lines.append(f"gpu: {torch.cuda.get_device_name(device)} cuda {torch.version.cuda}")
        try:
            lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    return lines


def all_reduce_sum(t: torch.Tensor, world_size):
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


@torch.no_grad()
def evaluate(model, val_tokens, a: Hyperparameters, window, rank, world_size, device):
    """Val loss over the first val_tokens tokens, in rows of val_seq_len dealt round-robin to the ranks,
    plus the copy diagnostics. The same numbers for every world size."""
    model.eval()
    num_rows = a.val_tokens // a.val_seq_len
    # sums over tokens: nll, count, copyable count, nll on copyable, lam, c, s
    sums = torch.zeros(7, dtype=torch.float64, device=device)
    for i in range(rank, num_rows, world_size):
        row = val_tokens[i * a.val_seq_len:(i + 1) * a.val_seq_len + 1].to(device)
        stats = model(row[None, :-1], row[None, 1:], window, token_stats=True)
        nll, copyable = stats["nll"].double(), stats["copyable"]
        gates = [stats[g].double().sum() if g in stats else nll.new_zeros(()) for g in ("lam", "c", "s")]
        sums += torch.stack([nll.sum(), nll.new_tensor(nll.numel()), copyable.sum().double(),
                             (nll * copyable).sum(), *gates])
    all_reduce_sum(sums, world_size)
    model.train()
    total, count, n_copy, nll_copy, lam, c, s = sums.tolist()
    out = {"val_loss": total / count, "copy_share": n_copy / count,
           "nll_copyable": nll_copy / max(n_copy, 1), "nll_other": (total - nll_copy) / max(count - n_copy, 1)}
    if a.cplm:
        out.update(lam=lam / count, c=c / count, s=s / count)
    return out


def save_checkpoint(path, model, optimizers, step, loader, training_time_ms, a):
    """Written to a temporary file and renamed, so a crash never leaves half a checkpoint."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = dict(step=step, model=model.state_dict(), optimizers=[o.state_dict() for o in optimizers],
                 loader=loader.state(), training_time_ms=training_time_ms, hyperparameters=dataclasses.asdict(a))
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


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


def main(argv=None):
    a = parse_args(argv)
    a.run_id = a.run_id or str(uuid.uuid4())
    # distributed set-up: torchrun sets RANK / WORLD_SIZE; NCCL on GPU, gloo on CPU
    distributed = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        use_heap_for_large_tensors()
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores among the local processes
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if (a.batch_size // a.seq_len) % world_size:
        raise UsageError(f"--batch_size / --seq_len = {a.batch_size // a.seq_len} rows, not divisible by "
                         f"{world_size} processes")
    if distributed:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=device if
                                device.type == "cuda" else None)
    master = rank == 0
    log = Logger(a, master)
    try:
        return train(a, log, rank, world_size, device)
    except BaseException as e:  # the log ends with why it stopped
        log(f"stopped: {type(e).__name__}: {e}", console=False)
        raise
    finally:
        if distributed:
            dist.destroy_process_group()


def train(a: Hyperparameters, log, rank, world_size, device):
    for line in environment_lines(device, world_size):
        log(line, console=False)
    log(f"run_id: {a.run_id}")
    log(f"hyperparameters: {json.dumps(dataclasses.asdict(a))}")

    # data first: a missing shard fails before any model is built
    loader = TrainLoader(a.train_files, a.batch_size, a.seq_len, rank, world_size, a.vocab_size)
    val_tokens = load_val_tokens(a.val_files, a.val_tokens, a.vocab_size)
    grad_accum = a.batch_size // a.seq_len // world_size

    torch.manual_seed(a.seed)
    model = GPT(GPTConfig.from_args(a)).to(device)
    if device.type == "cuda":  # bf16 embeddings make the whole forward pass bf16; weights of linears stay fp32
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.bfloat16()
    for p in model.parameters():  # the same initial weights on every rank
        if world_size > 1:
            dist.broadcast(p.detach(), 0)
    optimizers = build_optimizers(model, a, rank, world_size)
    n_params = sum(p.numel() for p in model.parameters())
    n_cp = sum(p.numel() for p in model.cp_head.parameters()) + 1 if model.cp_head is not None else 0
    log(f"parameters: {n_params:,} (CP head and <copy> bias: {n_cp:,} = {100 * n_cp / n_params:.3f}%); "
        f"grad_accum: {grad_accum}")
    compiled = torch.compile(model, dynamic=False) if a.compile == 1 or (a.compile == -1 and device.type == "cuda") else model
    params = list(model.parameters())

    def train_step(step):
        window = torch.tensor(attention_window(step, a), device=device)
        loss_sum = torch.zeros((), device=device)
        for inputs, targets in loader.next_batch(device):
            loss = compiled(inputs, targets, window) / grad_accum
            loss.backward()
            loss_sum += loss.detach()
        if world_size > 1:  # average gradients over ranks in one flat buffer
            flat = torch.cat([p.grad.flatten().float() for p in params])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p) / world_size)
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
            loss_sum /= world_size
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_multiplier(step, a)
        warm = min(step / max(a.muon_momentum_warmup_steps, 1), 1)
        for group in optimizers[1].param_groups:
            group["momentum"] = (1 - warm) * 0.85 + warm * a.muon_momentum
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        return loss_sum.item()

    # untimed warm-up (compiles the kernels), then everything is reset to its initial state
    if a.warmup_steps > 0 and not a.resume:
        initial = dict(model={k: v.clone() for k, v in model.state_dict().items()},
                       optimizers=[clone_state(o.state_dict()) for o in optimizers])
        for step in range(a.warmup_steps):
            train_step(step)
        model.load_state_dict(initial["model"])
        for opt, state in zip(optimizers, initial["optimizers"]):
            opt.load_state_dict(state)
        loader.set_state({"file_index": 0, "position": 0})

    start_step, training_time_ms = 0, 0.0
    if a.resume:
        state = torch.load(a.resume, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        for opt, opt_state in zip(optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        loader.set_state(state["loader"])
        start_step, training_time_ms = state["step"], state["training_time_ms"]
        log(f"resumed from {a.resume} at step {start_step}")

    def checkpoint_path(step):
        return os.path.join(a.log_dir, a.run_id, f"state_step{step:06d}.pt")

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize()
    t0 = time.perf_counter()
    step, result = start_step, None
    while True:
        last = step == a.num_iterations
        if last or (a.val_loss_every > 0 and step % a.val_loss_every == 0):
            synchronize()
            training_time_ms += 1000 * (time.perf_counter() - t0)  # the clock stops during validation
            window = torch.tensor(attention_window(step, a), device=device)  # a tensor: no recompile per size
            result = evaluate(compiled, val_tokens, a, window, rank, world_size, device)
            log(f"step:{step}/{a.num_iterations} val_loss:{result['val_loss']:.4f} "
                f"train_time:{training_time_ms:.0f}ms step_avg:{training_time_ms / max(step, 1):.2f}ms")
            log(f"step:{step}/{a.num_iterations} " + " ".join(f"{k}:{v:.4f}" for k, v in result.items()
                                                              if k != "val_loss"))
            if 0 < a.target_val_loss and result["val_loss"] <= a.target_val_loss:
                log(f"target val_loss {a.target_val_loss} reached at step {step}")
                last = True
            synchronize()
            t0 = time.perf_counter()
        if rank == 0 and step > start_step and ((a.checkpoint_every > 0 and step % a.checkpoint_every == 0)
                                                or (last and a.save_checkpoint)):
            save_checkpoint(checkpoint_path(step), model, optimizers, step, loader, training_time_ms, a)
            log(f"saved checkpoint {checkpoint_path(step)}")
        if last:
            break
        train_loss = train_step(step)
        step += 1
        approx_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
        log(f"step:{step}/{a.num_iterations} train_loss:{train_loss:.4f} train_time:{approx_ms:.0f}ms "
            f"step_avg:{approx_ms / (step - start_step):.2f}ms")
        if not math.isfinite(train_loss):
            log(f"stopped: train_loss is {train_loss} at step {step}; lower the learning rates or check the data")
            return 1

    if device.type == "cuda":
        log(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
            f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    else:
        import resource
        log(f"peak memory (max RSS of rank 0): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
    log(f"final val_loss:{result['val_loss']:.4f} train_time:{training_time_ms:.0f}ms steps:{step}")
    return 0


def clone_state(state):
    """A deep copy of an optimizer state dict (tensors cloned)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    return state


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e} (see --help)", file=sys.stderr)
        sys.exit(2)
    except DataError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        sys.exit(1)
