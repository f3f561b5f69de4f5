"""Scores checkpoints on a held-out test slice, with the neural-cache baseline on vanilla's.

    python experiments/test_slice.py CHECKPOINT_OR_RUN_FOLDER... [--out records/prose_long/test_slice]

The two slices, both cut from the run's validation shards (the prose corpus's val split, documents in a
seeded shuffled order) and packed in rows of the run's val_seq_len as train_gpt_cplm.evaluate packs them:
- tuning slice: the first --val_tokens (32Ki) tokens, the slice every log's val_loss is on, on which the
  learning rates were chosen. The neural cache's theta and lambda are chosen here, and nothing else.
- test slice: whole documents from the first one that starts at or after token --test_start (64Ki, past the
  tuning slice), until --test_tokens (256Ki) tokens are reached; no choice was made on it. Or, with
  --test_documents FIRST:END, the val split's documents FIRST..END-1 (numbered from 0 in its order, which every
  tokenization of the prose corpus shares): the same text whatever the tokenizer, for rows of different V.
  The headline's slice on the V = 8192 corpus is documents 19:142.
Bits per byte: the test loss in bits over the UTF-8 bytes of the slice's documents (BOS has none), the unit
in which rows of different tokenizers compare. The bytes of a token come from the corpus's tokenizer.json
beside the val shards (byte-level BPE: one character of a token's string is one byte), or V = 257 bytes.

Each checkpoint gets its test loss (nats per token), over copyable targets (seen earlier in their document)
and the others. A vanilla checkpoint also gets the neural cache of Grave et al. 2017: with h_i the final
normed hidden state and x_{i+1} the token that followed position i,
    p_cache(w | t) = sum_{i < t, same document, x_{i+1} = w} softmax_i(theta h_t . h_i),
    p(w) = (1 - lambda) p_LM(w) + lambda p_cache(w)     (p_LM alone where the cache is empty),
no training; (theta, lambda) minimise the tuning slice's loss over a grid, then the test slice is scored.
Writes <out>.json (one record per checkpoint: its losses, per-document sums for intervals over documents, and
the scorer's version) and <out>.md (a table), and prints the table.
"""
import contextlib
import glob
import hashlib
import json
import math
import os
import re
import sys

import numpy as np
import torch

from cli import ROOT, OneLineParser  # experiments/cli.py
import inference  # noqa: E402  (the repository root is on sys.path now)
import race_report  # noqa: E402  (experiments/race_report.py)
import run_files  # noqa: E402
import train_gpt_cplm as tg  # noqa: E402

# the scorer's version in every record: the commit (+dirty) and the sha256 of this file and of what it imports
SCORED_BY = {"git": run_files.git_state(ROOT),
             **{f"sha256 {name}": run_files.file_sha256(os.path.join(ROOT, name))
                for name in ("experiments/test_slice.py", "train_gpt_cplm.py", "inference.py")}}
THETAS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)  # h is RMS-normed: h . h = D (128 at the cpu preset)
LAMBDAS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)


class EvalError(Exception):
    """Bad input: said in one line, exit 1."""


def mode_of(hp):
    return "vanilla" if not hp.cplm else ("sentinel" if getattr(hp, "copy_gate", "lm") == "sentinel" else "cplm")


def expand(paths):
    """Checkpoint files, and every state_step*.pt of each folder, in step order per folder."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(glob.escape(path), "state_step*.pt")))
            if not found:
                raise EvalError(f"{path}: no state_step*.pt checkpoints in this folder")
            out += found
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise EvalError(f"{path}: no such checkpoint file or run folder")
    seen = set()  # a checkpoint given twice (its folder and itself) is scored once
    return [p for p in out if not (os.path.realpath(p) in seen or seen.add(os.path.realpath(p)))]


def val_pattern(hp):
    """The run's val shards: its path as given where that matches, else relative to the repository."""
    return hp.val_files if glob.glob(hp.val_files) or os.path.isabs(hp.val_files) else os.path.join(
        ROOT, hp.val_files)


def slices(hp, test_start, test_tokens, documents=None):
    """(tuning tokens, test tokens, test documents): 1-D int64 tensors of n + 1 tokens (inputs and the shifted
    targets), the test slice whole documents only: by token position, or documents = (first, end) by number."""
    pattern = val_pattern(hp)
    tokens = np.concatenate([tg.load_shard(p, hp.vocab_size) for p in tg.find_shards(pattern)])  # 2 bytes a token
    if len(tokens) < hp.val_tokens + 1:
        raise EvalError(f"{pattern}: {len(tokens)} val tokens, the tuning slice needs {hp.val_tokens + 1}")
    starts = torch.from_numpy(np.flatnonzero(tokens == hp.bos_id))
    if documents:
        first_doc, end_doc = documents
        if end_doc >= len(starts):  # a document's end is the next one's BOS: the split's last has none
            raise EvalError(f"--test_documents {first_doc}:{end_doc}: the val split of {pattern} has "
                            f"{len(starts)} documents, so END can be at most {len(starts) - 1}")
        begin, end = int(starts[first_doc]), int(starts[end_doc])
        if begin < hp.val_tokens:
            raise EvalError(f"--test_documents {first_doc}:{end_doc}: document {first_doc} starts at token {begin}, "
                            f"inside the tuning slice ({hp.val_tokens} tokens) of {pattern}")
    else:
        first = starts[starts >= test_start]
        if test_start < hp.val_tokens or len(first) == 0:
            raise EvalError(f"--test_start {test_start}: it must lie past the tuning slice ({hp.val_tokens} tokens) "
                            f"and before the last document of the val split ({len(tokens)} tokens)")
        begin = int(first[0])
        later = starts[starts >= begin + test_tokens]
        if len(later) == 0:
            raise EvalError(f"--test_tokens {test_tokens}: the val split has {len(tokens) - begin} tokens after "
                            f"--test_start {test_start}")
        end = int(later[0])  # the test slice ends where the next document starts
    as_ids = lambda x: torch.from_numpy(x.astype(np.int64))  # noqa: E731
    return (as_ids(tokens[:hp.val_tokens + 1]), as_ids(tokens[begin:end + 1]),
            int(((starts >= begin) & (starts < end)).sum()))


def token_bytes(hp):
    """(V,) int64: the UTF-8 bytes of each token id of hp's corpus (BOS: 0; -1: an id its tokenizer lacks), or
    None where race_report cannot count them (no byte-level tokenizer.json beside the val shards, not the
    V = 257 byte corpus)."""
    shards = tg.find_shards(val_pattern(hp))
    lengths = race_report.token_byte_lengths(os.path.dirname(shards[0]), hp.vocab_size)
    return None if lengths is None else torch.from_numpy(lengths)


def rows_of(tokens, seq_len, bos_id):
    """(inputs, targets, valid) rows of seq_len, as evaluate cuts them. A last, shorter row is padded to whole
    128-token blocks with BOS (a document of its own after every real position, so causal attention hides
    it); valid marks the real positions."""
    n = len(tokens) - 1
    rows = []
    for lo in range(0, n, seq_len):
        x, y = tokens[lo:min(lo + seq_len, n)], tokens[lo + 1:min(lo + seq_len, n) + 1]
        pad = -len(x) % tg.BLOCK
        valid = torch.arange(len(x) + pad) < len(x)
        x, y = (torch.cat([t, t.new_full((pad,), bos_id)]) for t in (x, y))
        rows.append((x[None], y[None], valid[None]))
    return rows


def cache_log_p(h, input_ids, target_ids, doc_ids, theta):
    """log p_cache(y_t) (B, T) of the neural cache: -inf where no earlier position of the document was followed
    by y_t, nan where the cache is empty (the first position of a document)."""
    T = input_ids.size(-1)
    pos = torch.arange(T)
    earlier = (pos[None, :] < pos[:, None]) & (doc_ids[:, :, None] == doc_ids[:, None, :])  # (B, t, i): i < t
    scores = theta * (h.double() @ h.double().transpose(-1, -2))
    followed_by = target_ids  # position i was followed by x_{i+1} = target_ids[i]
    match = earlier & (followed_by[:, None, :] == target_ids[:, :, None])
    lse_all = scores.masked_fill(~earlier, -math.inf).logsumexp(-1)
    lse_match = scores.masked_fill(~match, -math.inf).logsumexp(-1)
    return torch.where(earlier.any(-1), lse_match - lse_all, math.nan)


def mix_cache(log_p_lm, log_p_cache, lam):
    """log of (1 - lam) p_LM + lam p_cache, and p_LM alone where the cache is empty (nan)."""
    mixed = torch.logaddexp(math.log1p(-lam) + log_p_lm, math.log(lam) + log_p_cache.nan_to_num(nan=-math.inf))
    return torch.where(log_p_cache.isnan(), log_p_lm, mixed)


@torch.no_grad()
def score(model, hp, step, tokens, with_cache, theta_lambda=None):
    """Sums over the slice's targets: nll, and over copyable targets; with_cache: the cache's nll for every
    (theta, lambda) of the grid (theta_lambda: that pair only, and per document as well). "per_document": the
    same sums for each document of the slice (a target belongs to the document of its input token), in order."""
    window = torch.tensor(tg.window_blocks(step, hp), dtype=torch.int32)
    grid = [theta_lambda] if theta_lambda else [(t, lam) for t in THETAS for lam in LAMBDAS]
    sums = {"n": 0, "nll": 0.0, "n_copy": 0, "nll_copy": 0.0, "cache": {g: [0.0, 0.0] for g in grid}}
    doc_of = (torch.cumsum(tokens[:-1] == hp.bos_id, 0) - 1).clamp(min=0)  # each target's document
    docs = int(doc_of[-1]) + 1
    per_doc = {k: torch.zeros(docs, dtype=torch.float64) for k in
               ("targets", "nll", "copyable", "nll_copyable", "cache_nll", "cache_nll_copyable")}
    offset = 0
    for x, y, valid in rows_of(tokens, hp.val_seq_len, hp.bos_id):
        stats = model(x, y, window, token_stats=True)
        nll, copyable = stats["nll"].double() * valid, stats["copyable"] & valid
        real = int(valid.sum())
        row_docs = doc_of[offset:offset + real]
        offset += real

        def add(key, values):  # the row's real positions into their documents' sums
            per_doc[key].index_add_(0, row_docs, values[0, :real].double())
        add("targets", valid.double())
        add("nll", nll)
        add("copyable", copyable.double())
        add("nll_copyable", nll * copyable)
        sums["n"] += real
        sums["nll"] += float(nll.sum())
        sums["n_copy"] += int(copyable.sum())
        sums["nll_copy"] += float((nll * copyable).sum())
        if with_cache:
            h, doc_ids = model.hidden_states(x, window)
            log_p_lm = -nll
            for theta in sorted({t for t, _ in grid}):
                log_p_cache = cache_log_p(h, x, y, doc_ids, theta)
                for t, lam in grid:
                    if t == theta:
                        c_nll = -mix_cache(log_p_lm, log_p_cache, lam) * valid
                        sums["cache"][(t, lam)][0] += float(c_nll.sum())
                        sums["cache"][(t, lam)][1] += float((c_nll * copyable).sum())
                        if theta_lambda:
                            add("cache_nll", c_nll)
                            add("cache_nll_copyable", c_nll * copyable)
    sums["per_document"] = {k: v.tolist() for k, v in per_doc.items()
                            if with_cache and theta_lambda or not k.startswith("cache")}
    return sums


def summary(sums, n_bytes=None):
    n, n_copy = sums["n"], sums["n_copy"]
    out = {"loss": sums["nll"] / n, "copyable": sums["nll_copy"] / max(n_copy, 1),
           "other": (sums["nll"] - sums["nll_copy"]) / max(n - n_copy, 1), "copy_share": n_copy / n, "tokens": n}
    if n_bytes:
        out.update(bytes=n_bytes, bits_per_byte=sums["nll"] / math.log(2) / n_bytes)
    return out


def per_document(sums, cached=False):
    """The slice's per-document sums (targets, nll, copyable targets, their nll), rounded to 1e-6 nats."""
    d = sums["per_document"]
    nll, nll_copyable = (d["cache_nll"], d["cache_nll_copyable"]) if cached else (d["nll"], d["nll_copyable"])
    return {"targets": [int(x) for x in d["targets"]], "copyable": [int(x) for x in d["copyable"]],
            "nll": [round(x, 6) for x in nll], "nll_copyable": [round(x, 6) for x in nll_copyable]}


def file_id(path, missing=None):
    """Size and modification time: a checkpoint rewritten since it was scored (another run, --overwrite) differs.
    A file that is gone: `missing`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None if missing is None else list(missing)
    return [st.st_size, st.st_mtime_ns]


def checkpoint_name(path):
    """How a record names its checkpoint: relative to the repository inside it, else absolute (so that the same
    file has one name from whatever folder the script runs)."""
    full = os.path.abspath(path)
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else full


def on_disk(name):
    return name if os.path.isabs(name) else os.path.join(ROOT, name)


def slice_key(test_start, test_tokens, documents):
    return ["documents", *documents] if documents else [test_start, test_tokens]


def read_checked(path, mmap=False):
    """(its run's Hyperparameters, step, weights) of a checkpoint, refused in one line (EvalError) unless
    inference.read_model_checkpoint takes it (its settings a run's: inference.check_settings), its run has a tuning
    slice where the neural cache needs one (a vanilla run's val_tokens 0 would divide by zero in the scoring), and
    the val shards are the bytes it validated on."""
    try:
        a, step, weights = inference.read_model_checkpoint(path, mmap=mmap)
    except tg.DataError as e:
        raise EvalError(str(e))
    if mode_of(a) == "vanilla" and a.val_tokens == 0:
        raise EvalError(f"{path}: its run has val_tokens 0, so no tuning slice for the neural cache's theta and lambda")
    check_val_shards(path, a)
    return a, step, weights


def check_val_shards(path, a):
    """The val shards are the bytes the run validated on (their sha256, which the checkpoint carries): a slice of
    rebuilt shards is other text, and its scores must not pool with the records'. Checkpoints saved before the
    hashes were carried are not checked."""
    try:
        saved = run_files.read_checkpoint(path, "cpu", verify=False, mmap=True, resumable=False).get("shards") or {}
        now = [run_files.file_sha256(p) for p in tg.find_shards(val_pattern(a))] if saved.get("val") else None
    except tg.DataError as e:
        raise EvalError(str(e))
    if now is not None and now != saved["val"]:
        raise EvalError(f"{path}: its run validated on other bytes than {val_pattern(a)} holds now (sha256 "
                        f"{saved['val'][0][:12]}... then, {now[0][:12] if now else 'none'}... now): rebuilt shards are "
                        "other text, whose scores would pool with the records' under one caption")


def load_model(path):
    """inference.load_model with the settings checked (read_checked) before the model is built."""
    a, step, weights = read_checked(path)
    return inference.model_from(path, a, weights), a, step


def file_key(path):
    """(size and modification time, device and inode): a checkpoint rewritten since it was scored differs in the
    first; a hard link of a scored checkpoint has its inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns], [st.st_dev, st.st_ino]


# Which run a record belongs to. A run re-trained under its run_id (--overwrite, or deleted by hand and trained
# again) replaces the old one, whose scores must go; a live run's --keep_checkpoints deletes its older checkpoints,
# whose scores stay. The checkpoints' content cannot tell these apart (the checkpoints of one run share no bytes:
# each step's weights differ, and the older ones are gone); the run's log can: a run only ever appends to
# <log_dir>/<run_id>.txt (a resume too), and a new run under that run_id writes a new one. So a record keeps the
# log's size and sha256 when it was scored, and goes once the log no longer starts with those bytes.


def run_log(path, run_id):
    """The log of the run that saved this checkpoint, <log_dir>/<run_id>.txt beside its folder <log_dir>/<run_id>/
    (a linked folder: beside the link, else beside its target); None outside a run's folder (set aside, copied)."""
    for folder in (os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.realpath(path))):
        log = os.path.join(os.path.dirname(folder), f"{run_id}.txt")
        if os.path.basename(folder) == run_id and os.path.isfile(log):
            return log
    return None


def log_identity(path, run_id):
    """The run's log as it is now (its name, size and sha256), or None where the checkpoint has none."""
    log = run_log(path, run_id)
    if log is None:
        return None
    try:
        with open(log, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return {"name": checkpoint_name(log), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def replaced_run(record):
    """True for a record of a run replaced since it was scored: its log no longer starts with the bytes it had
    then, or its checkpoint was moved to <run folder>/replaced_<time>/ by an --overwrite (of the whole run, or of
    the branch after a resumed step: the log is appended to, and that branch's checkpoints are set aside)."""
    log = record.get("log")
    if log:
        try:
            with open(on_disk(log["name"]), "rb") as f:
                if hashlib.sha256(f.read(log["bytes"])).hexdigest() != log["sha256"]:
                    return True
        except OSError:  # the log deleted or packed away, and no new one: nothing says the run was replaced
            pass
    path = on_disk(record["checkpoint"])
    return not os.path.exists(path) and any(
        file_key(old)[0] == record["file"]  # os.replace keeps the size and modification time
        for old in glob.glob(os.path.join(glob.escape(os.path.dirname(path)), "replaced_*", os.path.basename(path))))


def evaluate_checkpoint(path, test_start, test_tokens, documents=None):
    model, hp, step = load_model(path)
    inference.use_dense_paths(model)
    tuning, test, n_documents = slices(hp, test_start, test_tokens, documents)
    lengths = token_bytes(hp)
    if lengths is None and documents:
        raise EvalError(f"{path}: --test_documents reports bits per byte, and its corpus has no tokenizer.json "
                        "beside the val shards")
    if lengths is not None and bool((lengths[test[1:]] < 0).any()):
        raise EvalError(f"{path}: the slice holds token ids that the corpus's tokenizer.json lacks")
    n_bytes = int(lengths[test[1:]].sum()) if lengths is not None else None
    mode = mode_of(hp)
    file, inode = file_key(path)
    record = {"checkpoint": checkpoint_name(path), "run_id": hp.run_id,
              "step": step, "mode": mode, "seed": hp.seed, "vocab_size": hp.vocab_size,
              "test_documents": n_documents, "file": file, "inode": inode, "log": log_identity(path, hp.run_id),
              "slice": slice_key(test_start, test_tokens, documents), "scored_by": SCORED_BY}
    if record["log"] is None:
        del record["log"]
    if mode != "vanilla":
        test_sums = score(model, hp, step, test, with_cache=False)
        record["test"] = {**summary(test_sums, n_bytes), "per_document": per_document(test_sums)}
        return record
    tune = score(model, hp, step, tuning, with_cache=True)
    best = min(tune["cache"], key=lambda g: tune["cache"][g][0])
    test_sums = score(model, hp, step, test, with_cache=True, theta_lambda=best)  # one pass: alone and cached
    cached = test_sums["cache"][best]
    record["test"] = {**summary(test_sums, n_bytes), "per_document": per_document(test_sums)}
    record["cache"] = {"theta": best[0], "lambda": best[1], "tuning_loss": tune["cache"][best][0] / tune["n"],
                       **summary({**test_sums, "nll": cached[0], "nll_copy": cached[1]}, n_bytes),
                       "per_document": per_document(test_sums, cached=True)}
    return record


def slice_name(slice_):
    return (f"--test_documents {slice_[1]}:{slice_[2]}" if slice_[0] == "documents" else
            f"--test_start {slice_[0]} --test_tokens {slice_[1]}")


def markdown(records, command):
    fmt = lambda x, key: f"{x[key]:.4f}" if x and key in x else "-"  # noqa: E731
    slice_of = lambda r: tuple(r.get("slice", ()))  # noqa: E731  (records older than the field: one slice)
    several = len({slice_of(r) for r in records}) > 1  # then each row says its slice
    lines = [f"    {command}", "", "| run | step | mode | V | test loss | bits/byte | copyable | other | "
             "+ neural cache (theta, lambda) | cache: bits/byte | cache: copyable | cache: other |"
             + (" slice |" if several else ""), "|---|---|---|---|---|---|---|---|---|---|---|---|"
             + ("---|" if several else "")]
    for r in records:
        t, c = r["test"], r.get("cache")
        cache = f"{c['loss']:.4f} ({c['theta']}, {c['lambda']})" if c else ""
        lines.append(f"| {r['run_id']} | {r['step']} | {r['mode']} | {r.get('vocab_size', '-')} | {t['loss']:.4f} | "
                     f"{fmt(t, 'bits_per_byte')} | {t['copyable']:.4f} | {t['other']:.4f} | {cache} | "
                     f"{fmt(c, 'bits_per_byte') if c else ''} | {fmt(c, 'copyable') if c else ''} | "
                     f"{fmt(c, 'other') if c else ''} |" + (f" {slice_name(slice_of(r))} |" if several else ""))
    groups = {}
    for r in records:  # the seeds of one configuration on one slice: its run_id without the _s<seed> suffix
        name = re.sub(rf"_s{r['seed']}$", "", r["run_id"])
        groups.setdefault((name, r["mode"], r.get("vocab_size"), r["step"], slice_of(r)), []).append(r)
    if any(len(g) > 1 for g in groups.values()):
        lines += ["", "Mean over seeds (sample standard deviation):", "",
                  "| configuration | step | seeds | test loss | bits/byte | + neural cache | cache: bits/byte |",
                  "|---|---|---|---|---|---|---|"]
        for (name, _, _, step, slice_), rs in groups.items():
            def stat(values):
                if any(v is None for v in values):
                    return "-"
                return race_report.pm(*race_report.compare.mean_std(values), ".4f")
            pick = lambda part, key: [(r.get(part) or {}).get(key) for r in rs]  # noqa: E731
            label = f"{name} ({slice_name(slice_)})" if several else name
            seeds = [r["seed"] for r in rs]
            if len(set(seeds)) < len(seeds):  # two runs claim one seed: they are not two samples
                lines.append(f"| {label} | {step} | {','.join(map(str, seeds))} | a seed repeated: not averaged "
                             "| - | - | - |")
                continue
            lines.append(f"| {label} | {step} | {','.join(map(str, seeds))} | {stat(pick('test', 'loss'))} "
                         f"| {stat(pick('test', 'bits_per_byte'))} | {stat(pick('cache', 'loss'))} | "
                         f"{stat(pick('cache', 'bits_per_byte'))} |")
    pairs = paired_gaps(groups, several)
    if pairs:
        lines += ["", "Gaps over the seeds both ran (mean +- sd of the per-seed differences, nats per token and bits "
                  "per byte; p: one-sided paired t-test of gap > 0):", "",
                  "| configuration | step | seeds | vanilla - it | bits/byte | p | vanilla + neural cache - it | "
                  "bits/byte | p |", "|---|---|---|---|---|---|---|---|---|"]
        lines += pairs
    described = {}  # (V, slice) -> the slice in V's tokens (with --test_documents: the same documents under every V)
    for r in [r for r in records if "vocab_size" in r] or records:  # records older than the field: the others
        t = r["test"]
        if (r.get("vocab_size"), slice_of(r)) not in described:
            described[(r.get("vocab_size"), slice_of(r))] = (
                f"{t['tokens']} targets in {r['test_documents']} whole documents"
                f"{', %d bytes' % t['bytes'] if 'bytes' in t else ''}, {t['copy_share']:.1%} of the targets copyable")
    if len(described) == 1:
        lines += ["", f"Test slice: {next(iter(described.values()))}."]
    elif described:
        lines += ["", "Test slice, under each tokenizer:" if not several else "Test slices:", ""]
        lines += [f"- {slice_name(slice_) + ', ' if several else ''}V = {vocab}: {text}"
                  for (vocab, slice_), text in described.items()]
    return "\n".join(lines) + "\n"


def paired_gaps(groups, several=False):
    """Table rows: each CPLM or sentinel configuration against its vanilla partner (race.py's names: the mode's
    word replaced by "vanilla"; the same V, step and slice), over the seeds both have."""
    rows = []
    for (name, mode, vocab, step, slice_), rs in groups.items():
        partner = groups.get((re.sub(rf"(^|_){mode}(_|$)", r"\1vanilla\2", name), "vanilla", vocab, step, slice_))
        if mode == "vanilla" or not partner:
            continue
        mine, theirs = {r["seed"]: r for r in rs}, {r["seed"]: r for r in partner}
        if len(mine) < len(rs) or len(theirs) < len(partner):
            continue  # a seed repeated on either side: no pairing (the means table says so)
        seeds = sorted(set(mine) & set(theirs))
        if not seeds:
            continue
        cells = []
        for part in ("test", "cache"):
            if not all(part in theirs[s] for s in seeds):
                cells += ["-", "-", "-"]
                continue
            gap = lambda key: race_report.gap_test(  # noqa: E731
                {s: theirs[s][part].get(key) for s in seeds}, {s: mine[s]["test"].get(key) for s in seeds}, float)
            m, sd, p = gap("loss")
            # bits per byte: the unit in which the gaps of configurations of different V compare, when each was
            # scored on the same documents (--test_documents)
            has_bytes = all("bits_per_byte" in x[s][k] for s in seeds for x, k in ((theirs, part), (mine, "test")))
            cells += [race_report.pm(m, sd, ".4f"), race_report.pm(*gap("bits_per_byte")[:2], ".4f") if has_bytes
                      else "-", "-" if p is None else f"{p:.2g}"]
        label = f"{name} ({slice_name(slice_)})" if several else name
        rows.append(f"| {label} | {step} | {','.join(map(str, seeds))} | {' | '.join(cells)} |")
    return rows


def read_done(path):
    """The records of an earlier OUT.json (--keep_done), refused in one line (EvalError) unless each has the
    fields this script reads, of their types: the file is then left as it is."""
    def bad(why):
        return EvalError(f"--keep_done: {path} is not this script's output ({why}); move it away, or choose another "
                         "--out")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except OSError as e:
        raise EvalError(f"--keep_done: {path}: cannot read it ({e.strerror})")
    except ValueError as e:  # not UTF-8, not JSON
        raise bad(f"not JSON: {str(e)[:100]}")
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise bad("no list of records")
    for i, r in enumerate(records):
        if problem := record_problem(r):
            raise bad(f"record {i}: {problem}")
    return records


NUMBER, INTEGER = "a number", "an integer"
RECORD_FIELDS = {"checkpoint": str, "run_id": str, "mode": str, "step": INTEGER, "seed": INTEGER,
                 "test_documents": INTEGER, "test": dict}
OPTIONAL_FIELDS = {"vocab_size": INTEGER, "file": list, "inode": list, "slice": list, "log": dict, "cache": dict}
PART_FIELDS = {"test": {"loss": NUMBER, "copyable": NUMBER, "other": NUMBER, "copy_share": NUMBER, "tokens": INTEGER},
               "cache": {"loss": NUMBER, "copyable": NUMBER, "other": NUMBER, "theta": NUMBER, "lambda": NUMBER},
               "log": {"name": str, "bytes": INTEGER, "sha256": str}}
OPTIONAL_PART_FIELDS = {"test": {"bytes": INTEGER, "bits_per_byte": NUMBER}, "cache": {"bits_per_byte": NUMBER}}


def record_problem(r):
    """What is wrong with one record of OUT.json (a field this script reads missing, or not of its type), or None."""
    def is_a(value, kind):
        if kind in (NUMBER, INTEGER):
            return isinstance(value, int if kind == INTEGER else (int, float)) and not isinstance(value, bool)
        return isinstance(value, kind)

    def check(fields, where, required):
        for key, kind in fields.items():
            if (required or key in where) and not is_a(where.get(key), kind):
                return f"{key} {where.get(key)!r:.60} is not {kind if isinstance(kind, str) else 'a ' + kind.__name__}"
    if not isinstance(r, dict):
        return f"a {type(r).__name__}, not an object"
    problem = check(RECORD_FIELDS, r, True) or check(OPTIONAL_FIELDS, r, False)
    for part in PART_FIELDS:
        if part in r and not problem:
            problem = (check(PART_FIELDS[part], r[part], True)
                       or check(OPTIONAL_PART_FIELDS.get(part, {}), r[part], False))
            problem = problem and f"{part}: {problem}"
    if problem:
        return problem
    for key in ("file", "inode"):
        if key in r and not (len(r[key]) == 2 and all(is_a(x, INTEGER) for x in r[key])):
            return f"{key} {r[key]!r:.60} is not two integers"
    if "slice" in r and not all(isinstance(x, (str, int)) for x in r["slice"]):
        return f"slice {r['slice']!r:.60} is not a list of numbers and names"
    if "\0" in r["checkpoint"] + r.get("log", {}).get("name", ""):
        return "a file name holds a NUL byte"
    return None


def plan(paths, done, this_slice):
    """(the records of OUT.json that stay, [(checkpoint, its record to reuse or None: score it)]). A checkpoint is
    its file, whatever the path to it (through a linked folder, or a hard link: its realpath or inode), named once;
    a record is reused where its file is unchanged since (size, modification time) on the same slice. Every other
    record stays (other slices, checkpoints not named now or rotated away by their live run), except those of
    checkpoints rewritten since, and of runs replaced since (replaced_run)."""
    kept, seen = [], set()
    for r in done:
        if "file" not in r or "slice" not in r or replaced_run(r):  # older records: scored again
            continue
        key = (os.path.realpath(on_disk(r["checkpoint"])), tuple(r["file"]), tuple(r["slice"]))
        if key not in seen:  # the same checkpoint under two names (an earlier version's output): once
            seen.add(key)
            kept.append(r)
    named, inodes = [], {}
    for path in paths:
        try:
            file, inode = file_key(path)
        except FileNotFoundError:
            print(f"test_slice.py: {path} is gone (rotated away by its run): skipped", file=sys.stderr)
            continue
        if tuple(inode) in inodes:
            print(f"test_slice.py: {path} is {inodes[tuple(inode)]} (a link to it): scored once", file=sys.stderr)
            continue
        inodes[tuple(inode)] = path
        named.append((path, os.path.realpath(path), file, inode))

    def same(r, real, file, inode):  # the record's checkpoint is this one: by its path, or a hard link unchanged
        return tuple(r["slice"]) == this_slice and (os.path.realpath(on_disk(r["checkpoint"])) == real or
                                                    (r.get("inode") == inode and r["file"] == file))
    todo = [(path, next((r for r in kept if same(r, real, file, inode) and r["file"] == file), None))
            for path, real, file, inode in named]
    kept = [r for r in kept if not any(same(r, *checkpoint[1:]) for checkpoint in named)
            and file_id(on_disk(r["checkpoint"]), missing=r["file"]) == r["file"]]
    return kept, todo


def write_outputs(out, command, records):
    """OUT.json and OUT.md, each whole or not at all: both written to temporary files first, then renamed."""
    texts = {".json": json.dumps({"command": command, "records": records}, indent=1), ".md": markdown(records, command)}
    written = []
    try:
        for ext, text in texts.items():
            written.append(f"{out}{ext}.{os.getpid()}.tmp")
            with open(written[-1], "w") as f:
                f.write(text)
        for ext, tmp in zip(texts, written):
            os.replace(tmp, out + ext)
    except OSError as e:
        for tmp in written:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise EvalError(f"--out {out}: cannot write {e.filename} ({e.strerror})")


def main(argv=None):
    p = OneLineParser(prog="test_slice.py", description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", help="checkpoint files or run folders (logs/<run_id>/)")
    p.add_argument("--test_start", type=int, default=65536)
    p.add_argument("--test_tokens", type=int, default=262144)
    p.add_argument("--test_documents", default="", metavar="FIRST:END",
                   help="the val split's documents FIRST..END-1 instead of --test_start/--test_tokens: the same "
                        "text for every tokenizer (the headline's slice: 19:142)")
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--keep_done", type=int, default=0, choices=(0, 1),
                   help="1: reuse OUT.json's records of checkpoints scored on the same slice and not rewritten since "
                        "(a run still training: score its new checkpoints only); the records of a run trained again "
                        "under its run_id go")
    args = p.parse_args(argv)
    if args.test_tokens < 1 or args.test_start < 0 or not 0 <= args.threads <= 1024:
        p.error("--test_tokens must be >= 1, --test_start >= 0, --threads in 0..1024")
    documents = None
    if args.test_documents:
        parts = args.test_documents.split(":")
        if len(parts) != 2 or not all(x.isdigit() for x in parts) or int(parts[0]) >= int(parts[1]):
            p.error(f"--test_documents must be FIRST:END with 0 <= FIRST < END (got {args.test_documents!r})")
        documents = (int(parts[0]), int(parts[1]))
    folder = os.path.dirname(os.path.abspath(args.out))
    try:
        os.makedirs(folder, exist_ok=True)  # before hours of work: a bad --out fails now
        if os.path.isdir(args.out + ".json") or os.path.isdir(args.out + ".md"):
            raise EvalError(f"--out {args.out}: {args.out}.json or .md is a folder")
        probe = f"{args.out}.probe{os.getpid()}"  # a read-only folder fails now, not after the scoring
        with open(probe, "a"):
            pass
        os.remove(probe)
    except OSError as e:
        print(f"test_slice.py: error: --out {args.out}: {e.strerror}", file=sys.stderr)
        return 1
    except EvalError as e:
        print(f"test_slice.py: error: {e}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python experiments/test_slice.py " + " ".join(argv if argv is not None else sys.argv[1:])
    this_slice = tuple(slice_key(args.test_start, args.test_tokens, documents))
    try:
        done = read_done(args.out + ".json") if args.keep_done and os.path.isfile(args.out + ".json") else []
        records, todo = plan(expand(args.checkpoints), done, this_slice)
        for path, reuse in todo:  # every checkpoint to score is checked before any is scored: a bad one, and
            try:  # nothing is written (a mmap: its settings, not its weights)
                if reuse is None:
                    read_checked(path, mmap=True)
            except EvalError:
                if os.path.exists(path):
                    raise  # (one that is gone: skipped at its turn)
        for path, reuse in todo:
            if reuse is None and not os.path.exists(path):  # a live run's checkpoint rotated away before its turn
                print(f"test_slice.py: {path} is gone (rotated away by its run while others were scored): skipped",
                      file=sys.stderr)
                continue
            try:
                records.append(reuse or evaluate_checkpoint(path, args.test_start, args.test_tokens, documents))
            except (EvalError, tg.DataError):
                if os.path.exists(path):
                    raise
                print(f"test_slice.py: {path} is gone (rotated away by its run while it was read): skipped",
                      file=sys.stderr)
                continue
            print(json.dumps(records[-1]), flush=True)
            write_outputs(args.out, command, records)  # after each checkpoint: nothing lost
    except (EvalError, tg.DataError) as e:
        print(f"test_slice.py: error: {e}", file=sys.stderr)
        return 1
    print(markdown(records, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
