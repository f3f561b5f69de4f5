"""Beside the training script: the dense reference of the mixture (cplm_log_probs: p(v) for every v, the oracle
the training loss is tested against), generation (a KV cache for the backbone, a CP-key cache for the copy head,
sampling) and loading a trained model from a checkpoint. The speedrun never runs this; experiments/ and the
tests import it. Generation mirrors train_gpt_cplm's forward token by token and is tested against
next_token_log_probs (the model's whole distribution through the dense reference).
"""
import dataclasses

import torch
import torch.nn.functional as F

from train_gpt_cplm import (ATTN_SCALE, BLOCK, CausalSelfAttention, DataError, GPT, GPTConfig, Hyperparameters,
                            Rotary, UsageError, check_args, norm, read_checkpoint)
import run_files
from cpu_head import EagerCPUHeadLoss


# -----------------------------------------------------------------------------------------------------
# Checkpoints, read-only


def read_model_checkpoint(path, device="cpu", mmap=False):
    """(its run's Hyperparameters, the step it was saved at, the weights) of a checkpoint that save_checkpoint
    wrote; mmap=True reads the weights from disk only when they are used (listing many checkpoints), unverified.
    A missing, unreadable, corrupted, diverged or unresolved file is a DataError (one line), and so is one whose
    settings are not a run's (check_settings)."""
    try:
        state = read_checkpoint(path, device, verify=not mmap, mmap=mmap, resumable=False)
    except (AttributeError, TypeError) as e:  # weights that are not tensors, past read_checkpoint's own checks
        raise DataError(f"{path}: not a checkpoint of this script ({type(e).__name__}: {str(e)[:200]})")
    saved, step, weights = state["hyperparameters"], state["step"], state["model"]
    known = {f.name for f in dataclasses.fields(Hyperparameters)}
    a = dataclasses.replace(Hyperparameters(), **{k: v for k, v in saved.items() if k in known})
    check_settings(path, a, step, weights)
    return a, step, weights


def check_settings(path, a, step, weights):
    """DataError (one line, naming path) unless a checkpoint's settings are a run's: each field of its field's type,
    together passing the checks every run passes at its start (check_args), its step inside its run's schedule, and
    describing the weights it holds. A crafted file fails here, in one line, and not as a TypeError in the model's
    constructor (num_layers "x"), a ZeroDivisionError or an IndexError (num_heads 3 of model_dim 64, bos_id past the
    vocabulary), or a build that takes minutes or more memory than the machine has (num_layers 100000, model_dim
    65536 over weights of 32). experiments/test_slice.py reads every checkpoint through here."""
    defaults = Hyperparameters()

    def fits(value, default):  # argparse gave every saved setting its field's type (bool is no int here)
        kind = (int, float) if isinstance(default, float) else type(default)
        return isinstance(value, kind) and not isinstance(value, bool)
    kinds = {int: "an integer", float: "a number", str: "a string"}
    wrong = [f"{f.name} {getattr(a, f.name)!r:.60} is not {kinds[type(getattr(defaults, f.name))]}"
             for f in dataclasses.fields(a) if not fits(getattr(a, f.name), getattr(defaults, f.name))]
    if wrong:
        raise DataError(f"{path}: its hyperparameters are not a run's settings: {', '.join(wrong)}")
    if a.vocab_size <= 0 or a.bos_id < 0:
        raise DataError(f"{path}: its hyperparameters have no resolved vocabulary "
                        f"(vocab_size {a.vocab_size}, bos_id {a.bos_id})")
    try:  # read on the dense paths: a GPU run's cp_backend "flex" is no reason to refuse it on a CPU
        check_args(dataclasses.replace(a, cp_backend="dense"))
    except UsageError as e:
        raise DataError(f"{path}: its hyperparameters fail the training script's checks ({e})")
    if step > a.num_iterations:  # the window's schedule is step / num_iterations: no run saves past its end
        raise DataError(f"{path}: step {step} is past its run's num_iterations {a.num_iterations}")
    if not all(isinstance(k, str) and torch.is_tensor(w) for k, w in weights.items()):
        raise DataError(f"{path}: not a checkpoint of this script (its weights are not named tensors)")
    embed = weights.get("embed.weight")
    blocks = {k.split(".")[1] for k in weights if k.startswith("blocks.")}
    if embed is None or tuple(embed.shape) != (a.vocab_size, a.model_dim) or len(blocks) != a.num_layers:
        raise DataError(f"{path}: its hyperparameters (vocab_size {a.vocab_size}, model_dim {a.model_dim}, num_layers "
                        f"{a.num_layers}) do not describe its weights (embed "
                        f"{tuple(embed.shape) if embed is not None else 'missing'}, {len(blocks)} blocks)")
    # every attention layer's rotary tables (cos and sin, float32) are as long as its longest row: a seq_len that
    # check_args lets through (2^24) over 12 layers of 64-wide heads is 48 GiB before a weight is read
    rows = max(a.seq_len, a.val_seq_len)
    rotary = a.num_layers * rows * (a.model_dim // a.num_heads) * 4
    have = run_files.machine_memory()
    if have and rotary > have / 2:
        raise DataError(f"{path}: its rows of {rows} tokens need {rotary / 2 ** 30:.1f} GiB of rotary tables, more "
                        f"than half this machine's {have / 2 ** 30:.1f} GiB")


def load_model(path, device="cpu", max_seq_len=0):
    """A trained model from a checkpoint that save_checkpoint wrote, for inference: (model in eval mode,
    its run's Hyperparameters, the step it was saved at). max_seq_len: the longest sequence it will run;
    the rotary table is not saved, so it is rebuilt this long (never shorter than training's). A missing,
    unreadable or mismatched file, or one whose settings are not a run's, is a DataError (one line), before any
    model is built."""
    a, step, weights = read_model_checkpoint(path, device)
    return model_from(path, a, weights, device, max_seq_len), a, step


def model_from(path, a, weights, device="cpu", max_seq_len=0):
    """The model (eval mode) that a checkpoint's settings describe, its weights loaded; DataError (one line, naming
    path) where the settings describe no model or the weights do not fit it."""
    try:
        config = GPTConfig.from_args(a)
    except ValueError as e:
        raise DataError(f"{path}: its hyperparameters do not describe a model ({e})")
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, max_seq_len))
    model = GPT(config).to(device)
    try:
        model.load_state_dict(weights)
    except (RuntimeError, ValueError, KeyError) as e:
        raise DataError(f"{path}: its weights do not fit the model its hyperparameters describe "
                        f"({str(e).splitlines()[0][:200]})")
    return model.eval()


def use_dense_paths(model: GPT) -> GPT:
    """The CPU's paths on any machine (SDPA, dense CP sums 512 queries at a time, the row-chunked head loss): for
    studies that run on the CPU where torch also sees a GPU (the model picks its paths by torch.cuda)."""
    model.attention_backend = model.cp_backend = "dense"
    model.cp_chunk = model.config.cp_chunk or 512
    model.head_loss = EagerCPUHeadLoss(model.config.logit_softcap, model.config.copy_id)
    return model


# -----------------------------------------------------------------------------------------------------
# The dense reference of the mixture (cplm-method's p(v) for every v): the oracle of the training loss and of
# the generation caches below


def cplm_log_probs(lm_logits, q, k, sink_key, key_ids, copy_id, allowed=None, gate="lm", sink_bias=None):
    """Dense reference of the mixture: log p(v) for every slot, (B, T, Vp) float32, <copy> at -inf.
    lm_logits (B, T, Vp) after the soft-cap; q (B, T, d) at the T positions scored; k (B, S, d) and
    key_ids (B, S) at the positions they may copy from; sink_key (d,). allowed (B, T, S) bool says which
    keys each query sees (every query must see at least one); None: S = T, one document, position t copies
    from every tau <= t. gate "sentinel": p = s p_vocab + (1 - s) p_ptr, the pointer sentinel (p_vocab the
    softmax without <copy>), sink_bias added to the sink's score. Builds (T, S) and (T, Vp) tensors: for tests,
    evaluation and sampling, not for training."""
    B, T, Vp = lm_logits.shape
    S = k.size(1)
    z = lm_logits.float()
    q, k, sink_key = q.float(), k.float(), sink_key.float()
    scale = q.size(-1) ** -0.5
    log_p_full = z.log_softmax(-1)
    log_c = log_p_full[..., copy_id]
    log_1mc = torch.logaddexp(log_p_full[..., :copy_id].logsumexp(-1), log_p_full[..., copy_id + 1:].logsumexp(-1))
    if allowed is None:
        allowed = torch.ones(T, S, dtype=torch.bool, device=z.device).tril()
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    a_sink = q @ sink_key * scale + (0 if sink_bias is None else sink_bias.float())
    lse_all = torch.logaddexp(scores.logsumexp(-1), a_sink)
    log_s = a_sink - lse_all
    # copy mass per token: sum of alpha_t(tau) over tau with x_tau = v, computed relative to the row max
    row_max = scores.amax(-1, keepdim=True)
    weights = (scores - row_max).exp()
    mass = torch.zeros_like(z).scatter_add_(-1, key_ids[:, None, :].long().expand(B, T, S), weights)
    safe_log_mass = torch.where(mass > 0, mass.clamp_min(1e-30).log(), float("-inf"))
    log_copy = log_c[..., None] + safe_log_mass + row_max - lse_all[..., None]
    log_1ml = torch.logaddexp(log_1mc, log_c + log_s)
    log_lm = (log_1ml - log_1mc)[..., None] + log_p_full
    if gate == "sentinel":  # c = 1: lam = 1 - s, and p_LM is the softmax without <copy>, as in the gated mixture
        log_copy = safe_log_mass + row_max - lse_all[..., None]
        log_lm = log_s[..., None] + log_p_full - log_1mc[..., None]
    out = torch.logaddexp(log_lm, log_copy)
    return out.index_fill(-1, torch.tensor([copy_id], device=z.device), float("-inf"))


@torch.no_grad()
def next_token_log_probs(model: GPT, input_ids, window_blocks=None):
    """log p(next token) at every position and vocabulary slot, (B, T, padded_vocab) float32, through the dense
    reference (cplm_log_probs). Packed rows work as in training (attention and copying stay inside each
    document); window_blocks as in GPT.hidden_states."""
    if window_blocks is not None and not isinstance(window_blocks, torch.Tensor):
        window_blocks = torch.tensor(window_blocks, dtype=torch.int32, device=input_ids.device)
    h, doc_ids = model.hidden_states(input_ids, window_blocks)
    logits = model.lm_logits(h)
    if model.cp_head is None:
        return logits.log_softmax(-1)
    q, k, _ = model.cp_head(h)
    T = input_ids.size(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=logits.device).tril()
    return mixture_log_probs(model, logits, q, k, input_ids, causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))


def mixture_log_probs(model: GPT, lm_logits, q, k, key_ids, allowed=None):
    """cplm_log_probs of this model: its gate (and the gate's bias) on soft-capped LM logits (B, T, Vp)."""
    if model.copy_logit_bias is not None:
        copy_slot = torch.tensor([model.config.copy_id], device=lm_logits.device)
        lm_logits = lm_logits.index_add(-1, copy_slot, model.copy_logit_bias.expand(*lm_logits.shape[:-1], 1))
    return cplm_log_probs(lm_logits, q, k, model.cp_head.sink_key, key_ids, model.config.copy_id, allowed,
                          model.config.copy_gate, model.sink_bias)


# -----------------------------------------------------------------------------------------------------
# Generation: the backbone's KV cache and the CP head's key cache, one token at a time


def layer_windows(model: GPT, window_blocks):
    """Per layer, the attention window in 128-token blocks as the training masks apply it (None: the whole
    document; 0: no attention, nothing cached): long layers window_blocks, short ones window_blocks // 2
    but at least their own block (within_window keeps the diagonal tile)."""
    out = []
    for block, long in zip(model.blocks, model.long_window):
        if block.attn is None:
            out.append(0)
        elif window_blocks is None:
            out.append(None)
        else:
            out.append(int(window_blocks) if long else max(int(window_blocks) // 2, 1))
    return out


def rotate(rotary: Rotary, x, positions):
    """Rotary.forward at the given absolute positions instead of 0..T-1 (the same table, so the same values)."""
    cos, sin = rotary.cos[None, positions, None, :], rotary.sin[None, positions, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


class InferenceCache:
    """What generation keeps between tokens, for one sequence, beside the model (nanochat's engine keeps
    its KV cache the same way). Only what a later token can still see is kept:
      - per attention layer, the keys and values of the current document's positions inside the layer's
        window: the positions [start, end) (a window of w blocks of 128 tokens holds at most 128 w of
        them, full attention the whole document, the layer without attention nothing);
      - in CPLM mode, one CP key (cp_dim wide) and one token id per position of the current document:
        the CP head copies from the whole document, beyond every window.
    A BOS starts a new document: what came before it is dropped, as training's masks never cross it.
    extend(ids) runs new tokens through the model against the caches (a prompt in chunks of prefill_chunk
    tokens, then one token at a time) and returns log p(next token): O(window + document) work per token."""

    def __init__(self, model: GPT, window_blocks=None, prefill_chunk=512):
        if window_blocks is not None and int(window_blocks) < 1:
            raise ValueError(f"window_blocks must be >= 1 block of {BLOCK} tokens (None: whole documents)")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.model, self.prefill_chunk = model, prefill_chunk
        self.windows = layer_windows(model, window_blocks)
        self.end = 0  # absolute position of the next token
        self.doc_start = 0  # absolute position where the current document starts
        self.kv = [None] * len(model.blocks)  # per layer (k, v), each (1, S, heads, head_dim), or None
        self.kv_start = [0] * len(model.blocks)  # absolute position of each layer's first cached entry
        self.cp_keys = None  # (1, S, cp_dim) for the positions [doc_start, end)
        self.cp_ids = None  # (1, S) int32: the token at each of those positions, what copying it emits

    @torch.no_grad()
    def extend(self, ids) -> torch.Tensor:
        """Feeds ids (a list or 1-D tensor of token ids) after what the cache holds; returns log p(next
        token) over the padded vocabulary, (padded_vocab,) float32, <copy> at -inf in CPLM mode."""
        device = next(self.model.parameters()).device
        ids = torch.as_tensor(ids, dtype=torch.long).view(-1).cpu()  # documents are found on the host
        if ids.numel() == 0:
            raise ValueError("extend needs at least one token")
        if self.end + ids.numel() > self.model.config.max_seq_len:
            raise ValueError(f"{self.end + ids.numel()} positions exceed the rotary table's max_seq_len "
                             f"{self.model.config.max_seq_len}: build the model with a larger max_seq_len")
        for lo in range(0, ids.numel(), self.prefill_chunk):
            h = self._extend_hidden(ids[None, lo:lo + self.prefill_chunk], device)
        return self._next_log_probs(h[:, -1:])[0, 0]

    def _extend_hidden(self, ids, device):
        """GPT.hidden_states for the new tokens only (ids (1, n) on the host), keys and values of earlier
        ones from the cache. Everything that depends on the tokens' values (where documents start) is
        decided on the host, so the device never waits, and a model on the meta device (shapes only:
        experiments/inference_memory.py) runs the same code."""
        model, c = self.model, self.model.config
        n = ids.size(1)
        bos_at = torch.nonzero(ids[0] == c.bos_id)[:, 0].tolist()
        new_doc_start = self.end + bos_at[-1] if bos_at else self.doc_start
        # document of every new position relative to the current one (0): a BOS starts the next
        docs = (ids[0] == c.bos_id).cumsum(0).to(device)
        ids = ids.to(device)
        positions = torch.arange(self.end, self.end + n, device=device)
        ve = [emb(ids) for emb in model.value_embeds]
        ve = ve + [None] * (c.num_layers - 2 * len(ve)) + ve
        x = x0 = norm(model.embed(ids))
        skips = []
        for i, block in enumerate(model.blocks):
            if i >= model.num_encoder_layers:
                x = x + model.skip_weights[i - model.num_encoder_layers] * skips.pop()
            x = block.lambdas[0] * x + block.lambdas[1] * x0
            if block.attn is not None:
                x = x + self._attend(i, block.attn, norm(x), ve[i], positions, docs, new_doc_start)
            x = x + block.mlp(norm(x))
            if i < model.num_encoder_layers:
                skips.append(x)
        h = norm(x)
        if model.cp_head is not None:  # the CP keys of the new positions join the current document's
            keys = model.cp_head.w_k(h)
            cp_keys = keys if self.cp_keys is None else torch.cat([self.cp_keys, keys], 1)
            cp_ids = ids.int() if self.cp_ids is None else torch.cat([self.cp_ids, ids.int()], 1)
            drop = new_doc_start - (self.end + n - cp_keys.size(1))
            self.cp_keys, self.cp_ids = cp_keys[:, drop:], cp_ids[:, drop:]
        self.end, self.doc_start = self.end + n, new_doc_start
        return h

    def _attend(self, i, attn: CausalSelfAttention, x, value_embed, positions, docs, new_doc_start):
        """CausalSelfAttention.forward for the new positions against layer i's cached keys and values; then
        the cache keeps only what the next positions can still see."""
        B, n, _ = x.shape
        qkv = F.linear(x, attn.qkv_w.flatten(end_dim=1).type_as(x)).view(B, n, 3 * attn.num_heads, attn.head_dim)
        q, k, v = qkv.chunk(3, dim=-2)
        q, k = rotate(attn.rotary, norm(q), positions), rotate(attn.rotary, norm(k), positions)
        v = attn.lambdas[0] * v + (attn.lambdas[1] * value_embed.view_as(v) if value_embed is not None else 0)
        if self.kv[i] is not None:
            k, v = torch.cat([self.kv[i][0], k], 1), torch.cat([self.kv[i][1], v], 1)
        start, window = self.kv_start[i], self.windows[i]
        key_pos = torch.arange(start, self.end + n, device=x.device)
        key_doc = torch.cat([docs.new_zeros(self.end - start), docs])  # cached keys: the current document
        allowed = (key_pos[None, :] <= positions[:, None]) & (key_doc[None, :] == docs[:, None])
        if window is not None:  # whole blocks: key block > query block - window, as within_window keeps them
            allowed &= key_pos[None, :] // BLOCK > positions[:, None] // BLOCK - window
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=allowed[None, None], scale=ATTN_SCALE)
        # keep the positions a later query may see: its document's, inside the window of the next position
        end = self.end + n
        keep_from = max(new_doc_start, 0 if window is None else (end // BLOCK - window + 1) * BLOCK)
        self.kv[i] = (k[:, keep_from - start:], v[:, keep_from - start:])
        self.kv_start[i] = keep_from
        return attn.c_proj(y.transpose(1, 2).reshape(B, n, -1))

    def _next_log_probs(self, h):
        """log p(next) at the hidden state h (1, 1, D): the LM head alone, or the mixture with copying
        from the cached CP keys (exactly next_token_log_probs' mixture, cplm_log_probs)."""
        model = self.model
        logits = model.lm_logits(h)
        if model.cp_head is None:
            return logits.log_softmax(-1)
        allowed = torch.ones(1, 1, self.cp_keys.size(1), dtype=torch.bool, device=h.device)
        return mixture_log_probs(model, logits, model.cp_head.w_q(h), self.cp_keys, self.cp_ids, allowed)

    def nbytes(self) -> dict:
        """Bytes the cache holds now: attention keys and values, CP keys, CP token ids."""
        kv = sum(t.numel() * t.element_size() for pair in self.kv if pair is not None for t in pair)
        cp_keys = 0 if self.cp_keys is None else self.cp_keys.numel() * self.cp_keys.element_size()
        cp_ids = 0 if self.cp_ids is None else self.cp_ids.numel() * self.cp_ids.element_size()
        return {"kv": kv, "cp_keys": cp_keys, "cp_ids": cp_ids}


def sample_next(log_probs, vocab_size, temperature=1.0, top_k=0, generator=None) -> int:
    """One token id from log p over the padded vocabulary: temperature 0 takes the most likely id; else
    ids are drawn in proportion to p(v)^(1 / temperature) among the top_k most likely (0: all). Only the
    tokenizer's ids 0..vocab_size - 1 are drawn: <copy> and the padding slots are no tokens (a trained
    model gives the padding ~0 and the mixture gives <copy> 0), so p is renormalised over real ids."""
    scores = log_probs[:vocab_size].float()
    if temperature == 0:
        return int(scores.argmax())
    scores = scores / temperature
    if 0 < top_k < vocab_size:
        cutoff = scores.topk(top_k).values[-1]
        scores = scores.masked_fill(scores < cutoff, float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: GPT, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, seed=0, window_blocks=None,
             cache: InferenceCache | None = None) -> list[int]:
    """Continues prompt_ids (token ids; a BOS inside starts a new document, as in training) by
    max_new_tokens tokens drawn from the model's next-token distribution: the LM head, or in CPLM mode
    the mixture p(v) = (1 - lam) p_LM(v) + lam p_CP(v). temperature 0: greedy. seed fixes the draws.
    window_blocks: the long layers' window in 128-token blocks, as the model was trained (a checkpoint's
    is window_blocks(step, hyperparameters)); None: whole documents. cache: pass an empty InferenceCache
    to read its size afterwards. Returns the new ids."""
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise ValueError("temperature, top_k and max_new_tokens must be >= 0")
    if len(prompt_ids) == 0:
        raise ValueError("the prompt needs at least one token (documents start with BOS)")
    cache = cache if cache is not None else InferenceCache(model, window_blocks)
    needed = cache.end + len(prompt_ids) + max(max_new_tokens - 1, 0)
    if needed > model.config.max_seq_len:
        raise ValueError(f"{needed} positions exceed the rotary table's max_seq_len {model.config.max_seq_len}: "
                         "build the model with a larger max_seq_len (load_model(path, max_seq_len=...))")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    out = []
    try:
        log_probs = cache.extend(prompt_ids)
        for step in range(max_new_tokens):
            out.append(sample_next(log_probs, model.config.vocab_size, temperature, top_k, generator))
            if step + 1 < max_new_tokens:
                log_probs = cache.extend([out[-1]])
    finally:
        model.train(was_training)
    return out
