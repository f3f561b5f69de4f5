"""Why CPLM works, measured on checkpoints: how much gradient each head passes into the backbone, and
which attention heads the backbone grows (induction heads).

    OMP_NUM_THREADS=1 python experiments/mechanism.py grad \\
        --checkpoints records/prose_race/logs/prose_vanilla_lr1_s0 records/prose_race/logs/prose_cplm_lr1_s0 \\
        --rows 4 --out records/mechanism/grad
    OMP_NUM_THREADS=1 python experiments/mechanism.py induction \\
        --checkpoints records/prose_race/logs/prose_vanilla_lr1_s0/state_step001000.pt \\
                      records/prose_race/logs/prose_cplm_lr1_s0/state_step001000.pt --out records/mechanism/induction

--checkpoints takes checkpoint files (state_stepN.pt, written by train_gpt_cplm.py with --checkpoint_every or
--save_checkpoint 1) and run folders (logs/<run_id>/: every state_step*.pt in it). Step 0 is the run's seeded
initialisation, rebuilt from the checkpoint's hyperparameters and seed exactly as train_gpt_cplm.train builds
it; --step0 1 adds it for every run given, 0 never, -1 (default) for runs given as a folder. Passing a
vanilla and a CPLM run (files or folders) puts them side by side in every table and plot. Everything runs on
the CPU in float32 with the dense attention path; --out PREFIX writes PREFIX.md, PREFIX.json and PREFIX.png
(induction: heat maps of the checkpoints, or of each run's last one when more than 8 are given, and with
several steps also PREFIX_steps.png, the scores against the step); without --out the markdown goes to stdout.

grad: the gradient bottleneck, per token. For one token t with loss L_t = -log p(y_t) (the training loss:
the cross-entropy of train_gpt_cplm.vanilla_nll in vanilla mode; the CPLM mixture of cplm_target_log_prob
in CPLM mode) and h the final hidden states (after the final norm: the heads' input),

    LM ratio_t = ||dL_t/dh via the LM head|| / ||dL_t/du_t||,   u_t = W_U h_t  (the LM head's output over
                 the padded vocabulary, <copy> included, before the soft-cap: the V-dimensional logits whose
                 gradient the D x V map squeezes; dL_t/dh via the LM head = W_U^T dL_t/du_t, at h_t only)
    CP ratio_t = ||dL_t/dH via the CP head|| / ||dL_t/da_t||,  a_t = (a_t(tau) for tau <= t in t's document,
                 a_t(sink)): the CP head's logits. Their gradient reaches h through the query q_t = W_Q h_t
                 (at h_t) and through the keys k_tau = W_K h_tau (at every h_tau): dL_t/dH is the gradient
                 with respect to all positions' h, and its norm is the Frobenius norm over (position, D).

Only the head in question is followed (the other head's path to h is not added). The soft-cap's Jacobian
is diagonal with entries in (0, 1]: it belongs to the loss, not to the D x V map, so the LM ratio is taken
at the head's linear output u. Gradients with respect to u and a are per token exactly (u_t and a_t enter
L_t only), and the ratio does not depend on the loss's 1/N scale. The CP-head path uses an explicit score
matrix and a dense copy of the mixture (mixture_log_p); every run checks that its values and its gradient
with respect to h equal those of train_gpt_cplm.cplm_target_log_prob (the training loss) on the same batch.
Buckets: a token's context position n = its index in its document within the row (n + 1 positions it can
attend to and copy from); early, middle, late = n in the first, second, last third of the row length T.
The table reports, per bucket, the plain mean over tokens of the per-token ratios (every token weighs the
same; tokens whose logit gradient is exactly 0 are skipped), on --rows of the run's validation rows
(val_tokens in rows of val_seq_len, as train_gpt_cplm.evaluate cuts them), evenly spaced over them.
The ratio is not bounded by 1: it carries the scale of W_U (or W_Q, W_K), which training changes; what it
says is how much of the gradient norm at the logits reaches the backbone. So the table adds a scale-free
share for the LM head,

    LM span_t  = ||P dL_t/du_t|| / ||dL_t/du_t||,  P the orthogonal projection onto the column space of W_U
                 (at most D of the V logit directions): the part of the logit gradient that W_U^T passes at
                 all, whatever its scale; the rest is annihilated. About sqrt(D / V) for a random direction.

For the CP head that share is 1 (generically): through the key path every score a_t(tau) has an input of
its own, h_tau, so no direction of dL_t/da_t is annihilated.

induction: on repeated random sequences (T = 2 x --period tokens: --period tokens drawn uniformly from the
vocabulary without BOS, repeated once; no BOS, as the many training rows that start inside a document),
for every head of every attention layer, with the attention pattern computed explicitly from the layer's
q and k (the model's own norms, rotary and scale, its dense mask; each run checks that pattern @ v equals
the heads' output that the layer hands to c_proj):
  prefix-matching score = mean over the second copy's positions i (and the batch) of the attention from
      i to i - period + 1, the token after the earlier occurrence of the current token;
  copying score (the empirical version, not the OV-eigenvalue one: this backbone has value embeddings, x0
      mixes, U-net skips and RMS norms between the embedding and every head, so no single W_U W_O W_V W_E
      matrix is the head's circuit; the empirical score measures what the head does in context) = mean over
      the same positions of sum_j alpha_ij * g_l / rms_i * [W_U W_O^h v_j]_(x_j), centred over the
      vocabulary: for each position j the head attends to, the logit that j's value alone would add, along
      the direct path to the LM head, to j's own token x_j, averaged with the head's attention weights. An
      OV-copying measure taken on the values and the attention the head really has: for a head that attends
      to one position (an induction head) it is the logit the head adds to the token it copies; for a head
      that spreads its attention over n positions, each token gets about 1/n of it. v_j is head h's value
      at j (value embedding included), W_O^h its slice of c_proj, g_l the scalar gain of layer l's residual
      path to the last block's output (block mixes and U-net skips, measured by injecting a constant; see
      direct_path_gains), rms_i the final norm's divisor at i (frozen, as in direct logit attribution); in
      logits before the soft-cap. In a CPLM the copying that matters goes through the CP head, which this
      score does not see.
  previous-token score = mean attention from the same positions i to i - 1: the other half of an
      induction circuit (a head that writes the previous token into each position, for a later head's keys;
      or, in a CPLM, for the CP head's keys).
  CP head prefix (CPLM) = the same prefix-matching score for the CP head's pointer alpha_i(tau) (keys at the
      inputs: a pointer to i - period + 1 copies the token that followed the earlier occurrence of x_i, the
      next token). An induction head made of a previous-token head in the backbone (for the keys) and the CP
      head (for the match) scores high here and nowhere in the attention heads' columns.
  Ablation: the loss on the second copy again, with one head's output zeroed where it enters c_proj, for every
      head; the tables give it for the strongest previous-token head and the largest over the other heads.
  A head counts as an induction head when its prefix-matching score is above --threshold (0.4: at least 40%
  of the head's attention on the one position out of about 100 visible ones that an induction head
  attends to, 25-50x what uniform attention puts there (1/(i+1): 0.016 at i = 64, 0.008 at i = 127);
  previous-token and sink heads score near 0). The tables also count those whose copying score is positive, and the
  model's next-token loss on the first and the second copy (the in-context learning the heads buy).

Exit codes: 0 done; 2 a bad command line or a missing, unreadable or mismatched checkpoint (one line);
1 missing or malformed validation data (one line, train_gpt_cplm's DataError).
"""
import glob
import json
import math
import os
import re
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cli import ROOT, OneLineParser  # experiments/cli.py: also puts the repository root on sys.path

import train_gpt_cplm as tg  # noqa: E402
import inference  # noqa: E402

BUCKETS = ("early", "middle", "late")
SCORES = ("prefix", "previous", "copying")  # induction: the per-head scores
HEAD_NAMES = {"lm": "LM", "cp": "CP", "lm_span": "LM span (scale-free)"}
CHECK_TOLERANCE = 1e-3  # relative: the dense mixture against the training loss, explicit attention against the layer


class CheckpointError(Exception):
    """A missing, unreadable or mismatched checkpoint: one line, exit 2."""


# ----------------------------------------------------------------------------------------------------
# checkpoints


@dataclass
class Entry:
    """One model to analyse: a checkpoint file, or (path None) the seeded initialisation of a run."""
    run_id: str
    step: int
    hp: tg.Hyperparameters
    path: str | None

    @property
    def mode(self):
        return "cplm" if self.hp.cplm else "vanilla"


def step_of(path):
    m = re.search(r"state_step(\d+)\.pt$", path)
    return int(m.group(1)) if m else None


def expand_checkpoints(paths, step0):
    """Entries for --checkpoints (files and run folders), in the order given, each run's by step. Reads only
    the hyperparameters here; the weights are loaded one model at a time by build_model."""
    entries = []
    for given in paths:
        if os.path.isdir(given):
            files = sorted(glob.glob(os.path.join(given, "state_step*.pt")), key=lambda p: (step_of(p) or 0, p))
            if not files:
                raise CheckpointError(f"{given}: a folder without checkpoints (state_step*.pt)")
        elif os.path.exists(given):
            files = [given]
        else:
            raise CheckpointError(f"{given}: no such checkpoint file or run folder")
        run = []
        for path in files:
            try:
                hp, step, _ = inference.read_model_checkpoint(path, mmap=True)  # mmap: the weights are not read here
            except tg.DataError as e:  # a bad checkpoint is a bad argument here: exit 2, as documented
                raise CheckpointError(str(e))
            run.append(Entry(hp.run_id or os.path.basename(os.path.dirname(os.path.abspath(path))), step, hp, path))
        if step0 == 1 or (step0 == -1 and os.path.isdir(given)):
            first = run[0]
            run.insert(0, Entry(first.run_id, 0, first.hp, None))
        entries += run
    seen, unique = set(), []
    for e in entries:  # a checkpoint given twice (in its folder and as a file) is analysed once
        key = (e.run_id, e.step, e.path and os.path.realpath(e.path))
        if key not in seen:
            seen.add(key)
            unique.append(e)
    return unique


def build_model(entry: Entry):
    """The model of an entry in eval mode on the CPU, float32, dense attention and dense CP sums. The step-0
    model is built as train_gpt_cplm.train builds it: torch.manual_seed(seed), then GPT(GPTConfig)."""
    if entry.path is None:
        torch.manual_seed(entry.hp.seed)
        model = tg.GPT(tg.GPTConfig.from_args(entry.hp)).eval()
    else:
        try:
            model = inference.load_model(entry.path)[0]
        except tg.DataError as e:
            raise CheckpointError(str(e))
    if model.config.copy_gate != "lm":
        raise CheckpointError(f"{entry.path}: a pointer-sentinel model (--copy_gate {model.config.copy_gate}): these "
                              "studies read the paper's <copy> gate, which it does not have")
    return inference.use_dense_paths(model)  # FlexAttention only where it is compiled for CUDA


def window_of(entry: Entry):
    """The long layers' window at the entry's step, as train_gpt_cplm evaluates it."""
    return torch.tensor(tg.window_blocks(entry.step, entry.hp), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------
# grad: the gradient norm that each head passes from its logits into h


def mixture_log_p(u, scores, a_sink, input_ids, target_ids, doc_ids, copyable, copy_id, copy_bias, softcap):
    """log p(y_t) of the CPLM mixture from an explicit (B, T, T) score matrix a_t(tau) and the sink scores
    (B, T), so the loss can be differentiated with respect to the CP head's logits. The same formulas as
    train_gpt_cplm.cplm_target_log_prob (its LM terms are that script's lm_head_terms); only the two
    log-sum-exps over the CP scores are taken densely here, with the same masks (document-causal; and the
    target's occurrences, with a row's own position standing in where the target never occurred)."""
    lse_without_copy, z_copy, z_y = tg.lm_head_terms(u, target_ids, copy_id, softcap)
    z_copy = z_copy + copy_bias
    log_z = torch.logaddexp(lse_without_copy, z_copy)
    log_c, log_1mc, log_p_full_y = z_copy - log_z, lse_without_copy - log_z, z_y - log_z
    T = input_ids.size(1)
    pos = torch.arange(T, device=u.device)
    doc_causal = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (pos[:, None] >= pos[None, :])
    hit = input_ids[:, None, :] == target_ids[:, :, None]
    match = doc_causal & (hit | (~copyable[:, :, None] & (pos[:, None] == pos[None, :])))
    lse_doc = scores.masked_fill(~doc_causal, float("-inf")).logsumexp(-1)
    lse_match = scores.masked_fill(~match, float("-inf")).logsumexp(-1)
    lse_all = torch.logaddexp(lse_doc, a_sink)
    log_s = a_sink - lse_all
    log_1ml = torch.logaddexp(log_1mc, log_c + log_s)
    lm_term = log_1ml - log_1mc + log_p_full_y
    copy_term = torch.where(copyable, log_c + lse_match - lse_all, float("-inf"))
    return torch.logaddexp(lm_term, copy_term)


def relative_difference(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def context_positions(doc_ids):
    """(B, T): each position's index in its document within the row (0 at a BOS and at the row's start)."""
    pos = torch.arange(doc_ids.size(-1)).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return pos - torch.where(start, pos, 0).cummax(-1).values


def head_gradient_norms(model, input_ids, target_ids, window=None):
    """Per-token gradient norms (B, T) each: lm_logits = ||dL_t/du_t||, lm_h = ||dL_t/dh via the LM head||
    and, for a CPLM, cp_logits = ||dL_t/da_t|| (positions and sink), cp_h = ||dL_t/dH via the CP head||;
    also nll (B, T), the context position (B, T) and, for a CPLM, check: the largest relative differences
    between this dense mixture and the training loss (values, gradient with respect to h)."""
    cfg = model.config
    with torch.no_grad():
        h, doc_ids = model.hidden_states(input_ids, window)
    h = h.detach().float().requires_grad_()
    u = model.lm_head(h)  # the head's linear output (B, T, padded vocab)
    out = {"context_position": context_positions(doc_ids)}
    if model.cp_head is None:
        nll = tg.vanilla_nll(u, target_ids, cfg.logit_softcap, reduction="none").view_as(target_ids)
        (g_u,) = torch.autograd.grad(nll.sum(), u, retain_graph=True)
    else:
        q, k, sink_key = model.cp_head(h)
        copyable = tg.target_in_context(input_ids, target_ids, doc_ids, cfg.padded_vocab)
        scale = q.size(-1) ** -0.5
        scores = (q @ k.transpose(-1, -2)) * scale
        a_sink = (q @ sink_key) * scale
        nll = -mixture_log_p(u, scores, a_sink, input_ids, target_ids, doc_ids, copyable, cfg.copy_id,
                             model.copy_logit_bias, cfg.logit_softcap)
        g_h, g_u, G, g_sink = torch.autograd.grad(nll.sum(), [h, u, scores, a_sink], retain_graph=True)
        training = -tg.cplm_target_log_prob(u, q, k, sink_key, input_ids, target_ids, doc_ids, copyable, cfg.copy_id,
                                            model.copy_logit_bias, cfg.logit_softcap, backend="dense")["log_p"]
        (g_h_training,) = torch.autograd.grad(training.sum(), h, retain_graph=True)
        out["check"] = {"loss": relative_difference(nll, training), "grad_h": relative_difference(g_h, g_h_training)}
        if max(out["check"].values()) > CHECK_TOLERANCE:
            raise RuntimeError(f"mixture_log_p no longer matches train_gpt_cplm.cplm_target_log_prob ({out['check']}): "
                               "update it to the training loss")
        out.update(cp_gradient_norms(q.detach(), k.detach(), sink_key.detach(), G, g_sink,
                                     model.cp_head.w_q.weight.detach(), model.cp_head.w_k.weight.detach()))
    (g_h_lm,) = torch.autograd.grad(u, h, g_u)  # the LM head's own backward: W_U^T g, at h_t only
    basis = column_space(model.lm_head.weight.detach().float())
    out.update(lm_logits=g_u.norm(dim=-1), lm_h=g_h_lm.norm(dim=-1), lm_span=(g_u @ basis).norm(dim=-1),
               nll=nll.detach())
    return out


def column_space(w, rtol=1e-5):
    """An orthonormal basis (V, rank) of the column space of the head's weight w (V, D): the logit directions
    that W^T does not annihilate. Rank 0 for a zero head."""
    U, S, _ = torch.linalg.svd(w, full_matrices=False)
    return U[:, S > rtol * S.max()] if S.numel() and S.max() > 0 else w.new_zeros(w.size(0), 0)


def cp_gradient_norms(q, k, sink_key, G, g_sink, w_q, w_k):
    """||dL_t/da_t|| and ||dL_t/dH via the CP head|| per token, from G[t, tau] = dL_t/da_t(tau) (B, T, T) and
    g_sink[t] = dL_t/da_t(sink) (B, T). With s = 1/sqrt(d) and r_t = W_K^T q_t, token t's gradient reaches
      h_t:           W_Q^T s (sum_tau G[t, tau] k_tau + g_sink[t] k_sink) + s G[t, t] r_t   (query; own key)
      h_tau, tau<t:  s G[t, tau] r_t                                                        (keys)
    so its squared norm is ||at h_t||^2 + s^2 ||r_t||^2 sum_{tau != t} G[t, tau]^2, without a (T, T, D) tensor."""
    s = q.size(-1) ** -0.5
    G_diag = G.diagonal(dim1=-2, dim2=-1)
    r = q @ w_k  # (B, T, D): W_K^T q_t
    dq = s * (G @ k + g_sink[..., None] * sink_key)  # dL_t/dq_t
    at_t = dq @ w_q + s * G_diag[..., None] * r
    off_diagonal = (G.square().sum(-1) - G_diag.square()).clamp_min(0)
    cp_h = (at_t.square().sum(-1) + s * s * r.square().sum(-1) * off_diagonal).sqrt()
    cp_logits = (G.square().sum(-1) + g_sink.square()).sqrt()
    return {"cp_logits": cp_logits, "cp_h": cp_h}


def bucket_means(norms, T):
    """{head: {bucket: (mean ratio, tokens)}} over the tokens of each context-position bucket and all."""
    bucket = (3 * norms["context_position"] // T).clamp(max=2)
    result = {}
    for head, numerator, denominator in (("lm", "lm_h", "lm_logits"), ("cp", "cp_h", "cp_logits"),
                                         ("lm_span", "lm_span", "lm_logits")):
        if numerator not in norms:
            continue
        num, den = norms[numerator], norms[denominator]
        ok = den > 0
        ratio = num / den.clamp_min(1e-30)
        result[head] = {}
        for b, name in [*enumerate(BUCKETS), (None, "all")]:
            sel = ok if b is None else ok & (bucket == b)
            n = int(sel.sum())
            result[head][name] = (float(ratio[sel].mean()) if n else float("nan"), n)
    return result


_val_cache = {}


def validation_rows(hp, rows, val_files=None):
    """`rows` of the run's validation rows (inputs, targets), as train_gpt_cplm.evaluate cuts them (val_tokens
    in rows of val_seq_len), evenly spaced over them: the first rows alone may all lie in one long document."""
    pattern = val_files or hp.val_files
    if not val_files and not os.path.isabs(pattern) and not glob.glob(pattern):
        pattern = os.path.join(ROOT, pattern)  # the run's relative path, from the repository root
    available = hp.val_tokens // hp.val_seq_len
    if rows > available:
        raise CheckpointError(f"--rows {rows}: the run's validation set has {available} rows of {hp.val_seq_len}")
    key = (pattern, hp.val_seq_len, hp.val_tokens, rows, hp.vocab_size)
    if key not in _val_cache:
        picked = [i * available // rows for i in range(rows)]
        tokens = tg.load_val_tokens(pattern, (picked[-1] + 1) * hp.val_seq_len, hp.vocab_size).long()
        x = torch.stack([tokens[i * hp.val_seq_len:(i + 1) * hp.val_seq_len + 1] for i in picked])
        _val_cache[key] = (x[:, :-1], x[:, 1:])
    return _val_cache[key]


def grad_command(args, entries):
    results = []
    for e in entries:
        model = build_model(e)
        inputs, targets = validation_rows(e.hp, args.rows, args.val_files)
        norms = head_gradient_norms(model, inputs, targets, window_of(e))
        results.append({"run_id": e.run_id, "step": e.step, "mode": e.mode, "rows": args.rows,
                        "row_tokens": inputs.size(1), "loss": float(norms["nll"].mean()),
                        "random_direction_share": math.sqrt(e.hp.model_dim / model.config.padded_vocab),
                        "ratios": bucket_means(norms, inputs.size(1)), "check": norms.get("check")})
        del model
    return results


def seed_groups(results):
    """{run id without its _s<seed> suffix: {step: [results of its seeds]}} for the runs given with two or more
    seeds (the race's run ids end in _s0, _s1, ...); {} when no run has a second seed."""
    groups = {}
    for r in results:
        stem = re.sub(r"_s\d+$", "", r["run_id"])
        groups.setdefault(stem, {}).setdefault(r["step"], []).append(r)
    return {stem: by_step for stem, by_step in groups.items()
            if len({r["run_id"] for rs in by_step.values() for r in rs}) >= 2}


def mean_std(values):
    """'mean +- sample std' of a list (the std over seeds), or the one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return f"{mean:.3g}"
    return f"{mean:.3g} +- {math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)):.2g}"


def grad_markdown(results, command):
    lines = ["# Gradient norm through each head: ||dL/dh via head|| / ||dL/d(head logits)||", "",
             f"`{command}`", "",
             "Per token, then the plain mean over the tokens of each bucket (context position n in the first, "
             "second, last third of the row). LM: the LM head's linear output u (padded vocabulary, before the "
             "soft-cap) to h. CP: the CP head's scores over the context positions and the sink to every h (query "
             "and key paths). LM span: the share of dL/du in the column space of W_U (scale-free, at most 1). "
             "Definitions: experiments/mechanism.py. loss: the mean next-token loss on these rows.",
             "", "| run | step | mode | loss | head | " + " | ".join(BUCKETS) + " | all |",
             "| --- | ---: | --- | ---: | --- | " + " | ".join("---:" for _ in BUCKETS) + " | ---: |"]
    groups = seed_groups(results)
    if groups:  # the seeds' mean first: the table to read; every checkpoint follows
        lines[-2:-2] = ["Mean +- std over the seeds of each run (steps every seed has), then every checkpoint.", "",
                        "| runs | seeds | step | loss | head | " + " | ".join(BUCKETS) + " | all |",
                        "| --- | ---: | ---: | ---: | --- | " + " | ".join("---:" for _ in BUCKETS) + " | ---: |"]
        seeds_lines = []
        for stem, by_step in groups.items():
            n = max(len(rs) for rs in by_step.values())
            for step, rs in sorted(by_step.items()):
                if len(rs) < n:
                    continue
                for head in rs[0]["ratios"]:
                    seeds_lines.append(f"| {stem}_s* | {n} | {step} | {mean_std([r['loss'] for r in rs])} | "
                                       f"{HEAD_NAMES[head]} | " + " | ".join(
                                           mean_std([r["ratios"][head][b][0] for r in rs]) for b in (*BUCKETS, "all"))
                                       + " |")
        lines[-2:-2] = seeds_lines + [""]
    for r in results:
        for head, cells in r["ratios"].items():
            lines.append(f"| {r['run_id']} | {r['step']} | {r['mode']} | {r['loss']:.3f} | {HEAD_NAMES[head]} | "
                         + " | ".join(f"{cells[b][0]:.4g}" for b in (*BUCKETS, "all")) + " |")
    if results:
        r = results[0]
        counts = ", ".join(f"{b} {r['ratios']['lm'][b][1]}" for b in (*BUCKETS, "all"))
        lines += ["", f"Tokens per bucket ({r['run_id']}; the same rows for every checkpoint of a corpus): {counts}; "
                  f"{r['rows']} validation rows of {r['row_tokens']}, evenly spaced. A random direction's LM span "
                  f"share would be sqrt(D / V) = {r['random_direction_share']:.3f}."]
    checks = [r["check"] for r in results if r["check"]]
    if checks:
        lines += [f"Dense mixture vs the training loss (largest relative difference over CPLM checkpoints): loss "
                  f"{max(c['loss'] for c in checks):.1e}, gradient at h {max(c['grad_h'] for c in checks):.1e}."]
    return "\n".join(lines) + "\n"


def import_pyplot(what):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"mechanism.py: matplotlib is not installed; no {what} plot written", file=sys.stderr)
        return None


def grad_plot(results, path):
    """Top: the ratio per head against the training step (log axis; a zero head, as at step 0, drops out);
    bottom: the LM head's scale-free span share. One column per bucket."""
    plt = import_pyplot("grad")
    if plt is None:
        return False
    fig, axes = plt.subplots(2, len(BUCKETS) + 1, figsize=(16, 7), sharex=True, sharey="row",
                             gridspec_kw={"height_ratios": [2, 1]})
    runs = list(dict.fromkeys(r["run_id"] for r in results))
    for col, bucket in enumerate((*BUCKETS, "all")):
        for ri, run in enumerate(runs):
            rows = [r for r in results if r["run_id"] == run]
            for ax, head, style in ((axes[0][col], "lm", "-"), (axes[0][col], "cp", "--"),
                                    (axes[1][col], "lm_span", ":")):
                pts = [(r["step"], r["ratios"][head][bucket][0]) for r in rows if head in r["ratios"]]
                pts = [(s, v) for s, v in pts if math.isfinite(v) and (v > 0 or head == "lm_span")]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", markersize=3, color=f"C{ri}",
                            label=f"{run} ({rows[0]['mode']}), {HEAD_NAMES[head]}")
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{bucket} positions" if bucket != "all" else "all positions")
        share = results[0]["random_direction_share"]
        axes[1][col].axhline(share, color="0.5", linewidth=0.8,
                             label=f"sqrt(D / V) = {share:.3f} ({results[0]['run_id']})")
        axes[1][col].set_xlabel("training step")
        axes[1][col].set_ylim(bottom=0)
        for ax in axes[:, col]:
            ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("||dL/dh via head|| / ||dL/d logits||")
    axes[1][0].set_ylabel("LM head: share of dL/du\nin the column space of W_U")
    axes[0][-1].legend(fontsize=7)
    axes[1][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------
# induction: prefix matching and copying on repeated random sequences


def repeated_sequences(batch, period, vocab_size, bos_id, seed=0):
    """(batch, 2 period) token ids: `period` tokens uniform over the vocabulary without BOS, then the same again."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab_size - 1, (batch, period), generator=g)
    first = first + (first >= bos_id).long()  # skip BOS
    return torch.cat([first, first], 1)


def prefix_matching_scores(pattern, period):
    """Mean attention from each position i of the second copy to i - period + 1 (the token after the earlier
    occurrence of x_i). pattern (..., T, T) with T >= 2 period, rows are queries; returns (...)."""
    i = torch.arange(period, 2 * period)
    return pattern[..., i, i - period + 1].mean(-1)


def previous_token_scores(pattern, period):
    """Mean attention from each position i of the second copy to i - 1: the other half of an induction circuit
    (a head that writes the previous token into position i, for a later head's keys, or the CP head's)."""
    i = torch.arange(period, 2 * period)
    return pattern[..., i, i - 1].mean(-1)


def run_hooked(model, input_ids, window, handles):
    """The backbone's forward pass (no gradients) with the hooks `handles` in place; they are removed after it,
    whatever happens."""
    try:
        with torch.no_grad():
            model.hidden_states(input_ids, window)
    finally:
        for hd in handles:
            hd.remove()


def attention_layers(model, input_ids, window=None):
    """Every attention layer's pattern, computed explicitly: {layer: dict(pattern (B, H, T, T), v (B, T, H, hd),
    w_o: c_proj's weight (D, D))} and the last block's output x_final (B, T, D) (the residual stream before
    the final norm). The pattern comes from the layer's own q and k (its norms, rotary, scale and the mask the model
    passed it); pattern @ v must equal what the layer hands to c_proj, else RuntimeError."""
    captured, handles = {}, []
    for i, block in enumerate(model.blocks):
        if block.attn is not None:
            handles.append(block.attn.register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, args)))
            handles.append(block.attn.c_proj.register_forward_hook(  # its input: the heads' outputs, concatenated
                lambda mod, args, out, i=i: captured.__setitem__(("y", i), args[0])))
    handles.append(model.blocks[-1].register_forward_hook(lambda mod, args, out: captured.__setitem__("final", out)))
    run_hooked(model, input_ids, window, handles)
    layers = {}
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            if block.attn is None:
                continue
            x, value_embed, mask = captured[i]
            attn = block.attn
            B, T, _ = x.shape
            H, hd = attn.num_heads, attn.head_dim
            qkv = F.linear(x, attn.qkv_w.flatten(end_dim=1).type_as(x)).view(B, T, 3 * H, hd)
            q, k, v = qkv.chunk(3, dim=-2)
            q, k = attn.rotary(tg.norm(q)), attn.rotary(tg.norm(k))
            v = attn.lambdas[0] * v + (attn.lambdas[1] * value_embed.view_as(v) if value_embed is not None else 0)
            scores = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * tg.ATTN_SCALE
            if not torch.is_tensor(mask) or mask.dtype != torch.bool:
                raise RuntimeError("attention_layers needs the dense (boolean) attention mask")
            pattern = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            y = torch.einsum("bhij,bjhd->bihd", pattern, v.float()).reshape(B, T, H * hd)
            if relative_difference(y, captured[("y", i)].float()) > CHECK_TOLERANCE:
                raise RuntimeError(f"layer {i}: the explicit attention no longer reproduces CausalSelfAttention's "
                                   "output: update attention_layers to the training script")
            layers[i] = {"pattern": pattern, "v": v.float(), "w_o": attn.c_proj.weight.float()}
    return layers, captured["final"].float()


def direct_path_gains(model, input_ids, window=None):
    """{layer: g_l}: what a vector added by layer l's attention becomes in the last block's output along the
    residual path alone (block mixes lambda_0, U-net skips). A scalar in this architecture; measured, not
    re-derived from the U-net: with the token embedding, every MLP and every other attention output held at
    0, layer l's attention output is replaced by ones, and the last block's output must be g_l everywhere."""
    gains = {}
    for layer, block in enumerate(model.blocks):
        if block.attn is None:
            continue
        captured, handles = {}, [model.embed.register_forward_hook(lambda mod, args, out: torch.zeros_like(out))]
        for i, b in enumerate(model.blocks):
            if b.attn is not None:
                handles.append(b.attn.register_forward_hook(
                    lambda mod, args, out, i=i: torch.ones_like(out) if i == layer else torch.zeros_like(out)))
            handles.append(b.mlp.register_forward_hook(lambda mod, args, out: torch.zeros_like(out)))
        handles.append(model.blocks[-1].register_forward_hook(lambda mod, args, out: captured.__setitem__(0, out)))
        run_hooked(model, input_ids, window, handles)
        out = captured[0].float()
        gains[layer] = float(out.mean())
        if (out - gains[layer]).abs().max() > 1e-5 * max(1.0, abs(gains[layer])):
            raise RuntimeError(f"layer {layer}: the residual path is not a scalar gain; update direct_path_gains")
    return gains


def copying_scores(pattern, self_logits, scale, period):
    """Mean over the second copy's positions i of scale_i * sum_j pattern[i, j] self_logits[j]: the logit each
    attended position's value adds to its own token, weighed by the attention. pattern (B, H, T, T),
    self_logits (B, H, T), scale (B, T)."""
    per_query = torch.einsum("bhij,bhj->bhi", pattern, self_logits) * scale[:, None, :]
    return per_query[..., period:2 * period].mean(-1)


@torch.no_grad()
def induction_scores(model, input_ids, period, window=None):
    """{layer: {"prefix", "previous", "copying"}: (H,) each} for every attention layer, means over the batch."""
    layers, x_final = attention_layers(model, input_ids, window)
    gains = direct_path_gains(model, input_ids, window)
    eps = torch.finfo(torch.float32).eps  # F.rms_norm's, so 1 / rms is the final norm's own factor
    inv_rms = (x_final.square().mean(-1) + eps).rsqrt()
    V = model.config.vocab_size
    w_u = model.lm_head.weight[:V].float()
    w_u_centred = w_u - w_u.mean(0)  # a logit minus the mean logit over the vocabulary
    rows = w_u_centred[input_ids]  # (B, T, D): the unembedding row of the token at each position
    out = {}
    for i, layer in layers.items():
        pattern, v, w_o = layer["pattern"], layer["v"], layer["w_o"]
        H, hd = v.size(2), v.size(3)
        w_o_heads = w_o.view(w_o.size(0), H, hd)  # c_proj's columns of each head
        written = torch.einsum("bjhe,dhe->bhjd", v, w_o_heads)  # (B, H, T, D): head h's output from source j alone
        self_logits = torch.einsum("bhjd,bjd->bhj", written, rows)
        out[i] = {"prefix": prefix_matching_scores(pattern, period).mean(0),
                  "previous": previous_token_scores(pattern, period).mean(0),
                  "copying": copying_scores(pattern, self_logits, gains[i] * inv_rms, period).mean(0)}
    return out


def cp_pattern(model, input_ids, window=None):
    """The CP head's alpha_t(tau) over the positions (B, T, T), rows the queries; the sink's share is the rest
    of each row. With the inputs as keys, a pointer to tau copies x_tau: on the second copy, the earlier
    occurrence of the next token sits at i - period + 1, where prefix_matching_scores looks."""
    with torch.no_grad():
        h, doc_ids = model.hidden_states(input_ids, window)
        q, k, sink_key = (x.float() for x in model.cp_head(h))
        scale = q.size(-1) ** -0.5
        T = input_ids.size(-1)
        allowed = torch.ones(T, T, dtype=torch.bool).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        a_sink = (q @ sink_key * scale)[..., None]
        return torch.cat([scores, a_sink], -1).softmax(-1)[..., :T]


def in_context_loss(model, input_ids, period, window=None):
    """Mean next-token loss on the first copy (targets 1 .. period - 1) and on the second (targets period + 1 ..
    2 period - 1)."""
    with torch.no_grad():
        nll = model(input_ids[:, :-1], input_ids[:, 1:], window, token_stats=True)["nll"]
    return float(nll[:, :period - 1].mean()), float(nll[:, period:].mean())


def second_copy_loss_without(model, input_ids, period, layer, head, window=None, mean=False):
    """The loss on the second copy with one head's output replaced where it enters c_proj (a causal test: a head
    the copying relies on raises it): by zero, or with mean=True by its mean over every position of the same
    input. Mean-ablation keeps what the head adds on average and removes only what it says about each position,
    so a rise there is not just the residual stream thrown off its usual scale."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)
    fill = 0.0
    if mean:
        seen = []
        run_hooked(model, input_ids[:, :-1], window, [attn.c_proj.register_forward_pre_hook(
            lambda module, args: seen.append(args[0][..., cols].reshape(-1, attn.head_dim).mean(0)))])
        fill = seen[0]

    def replace_head(module, args):
        y = args[0].clone()
        y[..., cols] = fill
        return (y,)

    handle = attn.c_proj.register_forward_pre_hook(replace_head)
    try:
        return in_context_loss(model, input_ids, period, window)[1]
    finally:
        handle.remove()


def induction_command(args, entries):
    results = []
    for e in entries:
        if 2 * args.period > max(e.hp.seq_len, e.hp.val_seq_len):
            raise CheckpointError(f"--period {args.period}: 2 x period exceeds the model's rotary length")
        model = build_model(e)
        ids = repeated_sequences(args.batch, args.period, e.hp.vocab_size, e.hp.bos_id, args.seed)
        window = window_of(e)
        scores = induction_scores(model, ids, args.period, window)
        first, second = in_context_loss(model, ids, args.period, window)
        cp_prefix = (float(prefix_matching_scores(cp_pattern(model, ids, window), args.period).mean())
                     if model.cp_head is not None else None)
        L, H = len(model.blocks), model.config.num_heads
        per_head = {key: [[float(scores[i][key][h]) if i in scores else None for h in range(H)] for i in range(L)]
                    for key in SCORES}
        for key, mean in (("ablated", False), ("mean_ablated", True)):
            per_head[key] = [[second_copy_loss_without(model, ids, args.period, i, h, window, mean) if i in scores
                              else None for h in range(H)] for i in range(L)]
        results.append({"run_id": e.run_id, "step": e.step, "mode": e.mode, "layers": L, "heads": H, **per_head,
                        "nll_first_copy": first, "nll_second_copy": second, "cp_prefix": cp_prefix})
        del model
    return results


def induction_counts(r, threshold):
    heads = [(p, q, c) for lp, lq, lc in zip(r["prefix"], r["previous"], r["copying"])
             for p, q, c in zip(lp, lq, lc) if p is not None]
    ablated = [a for la in r["ablated"] for a in la if a is not None]
    mean_ablated = [a for la in r["mean_ablated"] for a in la if a is not None]
    top = max(range(len(heads)), key=lambda j: heads[j][1], default=None)  # the strongest previous-token head
    return {"heads": len(heads), "induction": sum(p > threshold for p, _, _ in heads),
            "top_previous_ablated": ablated[top] if top is not None else float("nan"),
            "top_previous_mean_ablated": mean_ablated[top] if top is not None else float("nan"),
            "others_ablated": max((a for j, a in enumerate(ablated) if j != top), default=float("nan")),
            "induction_copying": sum(p > threshold and c > 0 for p, _, c in heads),
            "previous_token": sum(q > threshold for _, q, _ in heads),
            "max_prefix": max((p for p, _, _ in heads), default=float("nan")),
            "max_previous": max((q for _, q, _ in heads), default=float("nan"))}


def cp_prefix_cell(r):
    return "-" if r.get("cp_prefix") is None else f"{r['cp_prefix']:.3f}"


def induction_markdown(results, args, command):
    t = args.threshold
    lines = ["# Induction heads on repeated random sequences", "", f"`{command}`", "",
             f"{args.batch} sequences of {args.period} random tokens (uniform, no BOS) repeated once, T = "
             f"{2 * args.period}, seed {args.seed}. Over the second copy's positions i: prefix = mean attention to "
             f"i - {args.period - 1} (the token after the earlier occurrence of x_i); previous = mean attention to "
             "i - 1; copying = the logit (before the soft-cap, centred over the vocabulary) that the value of each "
             "attended position j alone would add to j's own token along the direct path to the LM head, averaged "
             f"with the head's attention weights. Induction head: prefix > {t}. "
             "CP head prefix: the same prefix-matching score for the CP head's pointer alpha (CPLM): its weight on "
             "the earlier occurrence of the next token, the position an induction head copies from. "
             "NLL: the model's next-token loss on the first copy (unpredictable) and on the second (copyable); "
             "then on the second with the strongest previous-token head's output zeroed, the same with it replaced "
             "by its mean over the input's positions (mean-ablation), and the largest it gets with any other single "
             "head zeroed (a causal test of what the copying relies on). "
             "Definitions: experiments/mechanism.py.", "",
             f"| run | step | mode | attention heads | prefix > {t} | ... and copying > 0 | max prefix | "
             f"previous > {t} | max previous | CP head prefix | NLL first copy | NLL second copy | "
             "... that head zeroed | ... mean-ablated | ... another zeroed (max) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    groups = seed_groups(results)
    if groups:  # the seeds' mean first, then every checkpoint
        head = lines[-2:]
        lines[-2:] = ["Mean +- std over the seeds of each run (steps every seed has), then every checkpoint.", "",
                      f"| runs | seeds | step | prefix > {t} | max prefix | previous > {t} | max previous | "
                      "CP head prefix | NLL first copy | NLL second copy | ... top previous head zeroed | "
                      "... mean-ablated | ... another zeroed (max) |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for stem, by_step in groups.items():
            n = max(len(rs) for rs in by_step.values())
            for step, rs in sorted(by_step.items()):
                if len(rs) < n:
                    continue
                cs = [induction_counts(r, t) for r in rs]
                lines.append(f"| {stem}_s* | {n} | {step} | " + " | ".join(
                    mean_std([c[k] for c in cs]) for k in ("induction", "max_prefix", "previous_token", "max_previous"))
                    + f" | {mean_std([r['cp_prefix'] for r in rs]) if rs[0].get('cp_prefix') is not None else '-'}"
                    + f" | {mean_std([r['nll_first_copy'] for r in rs])} | {mean_std([r['nll_second_copy'] for r in rs])}"
                    + " | " + " | ".join(mean_std([c[k] for c in cs]) for k in (
                        "top_previous_ablated", "top_previous_mean_ablated", "others_ablated")) + " |")
        lines += [""] + head
    for r in results:
        c = induction_counts(r, t)
        lines.append(f"| {r['run_id']} | {r['step']} | {r['mode']} | {c['heads']} | {c['induction']} | "
                     f"{c['induction_copying']} | {c['max_prefix']:.3f} | {c['previous_token']} | "
                     f"{c['max_previous']:.3f} | {cp_prefix_cell(r)} | {r['nll_first_copy']:.3f} | "
                     f"{r['nll_second_copy']:.3f} | {c['top_previous_ablated']:.3f} | "
                     f"{c['top_previous_mean_ablated']:.3f} | {c['others_ablated']:.3f} |")
    if results:
        H = max(r["heads"] for r in results)
        lines += ["", "Per head: prefix / previous / copying; '-': a layer without attention.", "",
                  "| run | step | layer | " + " | ".join(f"head {h}" for h in range(H)) + " |",
                  "| --- | ---: | ---: | " + " | ".join("---" for _ in range(H)) + " |"]
    for r in results:
        for i, (lp, lq, lc) in enumerate(zip(r["prefix"], r["previous"], r["copying"])):
            cells = ["-" if p is None else f"{p:.3f} / {q:.3f} / {c:+.3g}" for p, q, c in zip(lp, lq, lc)]
            lines.append(f"| {r['run_id']} | {r['step']} | {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def induction_steps_plot(results, path, threshold):
    """Per run against the training step: the largest prefix-matching and previous-token scores of its heads,
    and the loss on the second copy."""
    plt = import_pyplot("induction")
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ri, run in enumerate(dict.fromkeys(r["run_id"] for r in results)):
        rows = [r for r in results if r["run_id"] == run]
        steps = [r["step"] for r in rows]
        counts = [induction_counts(r, threshold) for r in rows]
        label = f"{run} ({rows[0]['mode']})"
        axes[0].plot(steps, [c["max_prefix"] for c in counts], "-o", markersize=3, color=f"C{ri}",
                     label=f"{label}: max prefix-matching")
        axes[0].plot(steps, [c["max_previous"] for c in counts], "--s", markersize=3, color=f"C{ri}",
                     label=f"{label}: max previous-token")
        axes[1].plot(steps, [r["nll_second_copy"] for r in rows], "-o", markersize=3, color=f"C{ri}", label=label)
    axes[0].axhline(threshold, color="0.5", linewidth=0.8, label=f"threshold {threshold}")
    axes[0].set_ylim(0, 1)
    axes[0].set_ylabel("largest score over the heads")
    axes[1].set_ylabel("next-token loss on the second copy")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def induction_plot(results, path, threshold):
    """Heat maps (layers x heads), one row per checkpoint, one column per score: prefix matching, previous
    token, copying. With more than 8 checkpoints, only each run's last one."""
    plt = import_pyplot("induction")
    if plt is None:
        return False
    import numpy as np
    if len(results) > 8:
        runs = dict.fromkeys(r["run_id"] for r in results)
        results = [[r for r in results if r["run_id"] == run][-1] for run in runs]
    L, H = max(r["layers"] for r in results), max(r["heads"] for r in results)
    fig, axes = plt.subplots(len(results), 3, squeeze=False, layout="constrained",
                             figsize=(3 * (0.55 * H + 1.6), len(results) * (0.3 * L + 0.9) + 1.0))
    bound = max([abs(v) for r in results for row in r["copying"] for v in row if v is not None] + [1e-6])
    styles = {"prefix": ("viridis", 0.0, 1.0, f"prefix-matching score (bold: > {threshold})"),
              "previous": ("viridis", 0.0, 1.0, f"previous-token score (bold: > {threshold})"),
              "copying": ("RdBu_r", -bound, bound, "copying score (logit per unit attention)")}
    for ri, r in enumerate(results):
        for ki, key in enumerate(SCORES):
            cmap, vmin, vmax, name = styles[key]
            ax = axes[ri][ki]
            data = np.array([[np.nan if v is None else v for v in layer] for layer in r[key]], dtype=float)
            image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
            ax.set_facecolor("0.85")
            for li in range(data.shape[0]):
                for h in range(data.shape[1]):
                    v = data[li, h]
                    strong = key != "copying" and not np.isnan(v) and v > threshold
                    ax.text(h, li, "no attn" if np.isnan(v) else f"{v:.2f}" if key != "copying" else f"{v:+.2f}",
                            ha="center", va="center", fontsize=7, fontweight="bold" if strong else "normal",
                            color="white" if key != "copying" and not np.isnan(v) and v < 0.5 else "black")
            ax.set_xticks(range(data.shape[1]))
            ax.set_yticks(range(data.shape[0]))
            ax.tick_params(labelsize=7)
            ax.set_ylabel(f"{r['run_id']}\n{r['mode']}, step {r['step']}\nlayer" if ki == 0 else "layer", fontsize=7)
            if ri == len(results) - 1:
                ax.set_xlabel("head", fontsize=7)
            if ri == 0:
                ax.set_title(name.split(" (")[0], fontsize=8)
            if ri == len(results) - 1:
                fig.colorbar(image, ax=axes[:, ki].tolist(), location="bottom", shrink=0.9, aspect=25, label=name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------
# command line


def command_line(argv):
    prefix = "OMP_NUM_THREADS=" + os.environ["OMP_NUM_THREADS"] + " " if "OMP_NUM_THREADS" in os.environ else ""
    return prefix + " ".join(["python", "experiments/mechanism.py", *argv])


def parse_args(argv):
    p = OneLineParser(prog="mechanism.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    commands = {"grad": sub.add_parser("grad", help="gradient norm through each head, per position bucket"),
                "induction": sub.add_parser("induction", help="prefix-matching and copying scores per head")}
    for name, q in commands.items():
        q.add_argument("--checkpoints", nargs="+", required=True, metavar="PATH",
                       help="checkpoint files (state_stepN.pt) and/or run folders holding them")
        q.add_argument("--step0", type=int, default=-1, choices=(-1, 0, 1),
                       help="add each run's seeded initialisation as step 0: 1 always, 0 never, -1 for folders")
        q.add_argument("--out", default="", help="write OUT.md, OUT.json and OUT.png (default: markdown to stdout)")
    commands["grad"].add_argument("--rows", type=int, default=4,
                                  help="validation rows (of the run's val_seq_len), evenly spaced over its val_tokens")
    commands["grad"].add_argument("--val_files", default="", help="validation shards (default: the run's own)")
    commands["induction"].add_argument("--period", type=int, default=64, help="random tokens, repeated once")
    commands["induction"].add_argument("--batch", type=int, default=32, help="sequences")
    commands["induction"].add_argument("--threshold", type=float, default=0.4,
                                       help="prefix-matching score above which a head counts as an induction head")
    commands["induction"].add_argument("--seed", type=int, default=0, help="of the random sequences")
    args = p.parse_args(argv)
    q = commands[args.command]
    if args.command == "grad" and args.rows < 1:
        q.error("--rows must be >= 1")
    if args.command == "induction" and (args.period < 2 or args.batch < 1 or not 0 <= args.threshold < 1):
        q.error("--period must be >= 2, --batch >= 1 and --threshold in [0, 1)")
    if args.out and os.path.isdir(args.out):
        q.error(f"--out {args.out} is a folder: give a file prefix, e.g. {os.path.join(args.out, args.command)}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    tg.import_cpu_head().use_heap_for_large_tensors()  # as train_gpt_cplm does on CPU: no page faults for every (T, T) tensor
    try:
        entries = expand_checkpoints(args.checkpoints, args.step0)
        if args.command == "grad":
            results = grad_command(args, entries)
            markdown = grad_markdown(results, command_line(argv))
        else:
            results = induction_command(args, entries)
            markdown = induction_markdown(results, args, command_line(argv))
    except CheckpointError as e:
        print(f"mechanism.py: error: {e}", file=sys.stderr)
        return 2
    except tg.DataError as e:
        print(f"mechanism.py: error: {e}", file=sys.stderr)
        return 1
    print(markdown, end="")
    if args.out:
        if os.path.dirname(args.out):
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(markdown)
        with open(args.out + ".json", "w") as f:
            json.dump({"command": command_line(argv), "results": results}, f, indent=1)
        if args.command == "grad":
            grad_plot(results, args.out + ".png")
        else:
            induction_plot(results, args.out + ".png", args.threshold)
            if len({r["step"] for r in results}) > 1:
                induction_steps_plot(results, args.out + "_steps.png", args.threshold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
