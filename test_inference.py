"""Inference tests: `python3 -m pytest -q test_inference.py` (CPU, well under a minute).

Generation with caches (train_gpt_cplm.InferenceCache, generate) against the dense reference
(GPT.next_token_log_probs recomputed on the whole sequence at every step), and the inference scripts in
experiments/ (sample, needle, inference_memory, copy_picture) on tiny checkpoints written here."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt_cplm as tg

ROOT = Path(__file__).resolve().parent
VOCAB, BOS = 500, 499
WINDOW = 2  # blocks of 128 tokens: long layers see 256 tokens, short ones 128; the contexts below are longer
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tiny_model(cplm, max_seq_len=1024):
    """4 layers (long, short, no attention, long), random weights everywhere (no zero-initialised heads),
    in CPLM mode a gate that starts open so copying weighs in the mixture."""
    torch.manual_seed(0)
    cfg = tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=4, model_dim=32, num_heads=2, no_attention_layer=2,
                       max_seq_len=max_seq_len, cplm=cplm, cp_dim=16, copy_gate_init=0.3 if cplm else 0.0)
    model = tg.GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and not p.any():
                p.normal_(0, 0.1)
        if cplm:
            model.cp_head.sink_key.normal_(0, 0.5)
    return model.eval()


def two_documents(n_first=70, n_second=290, seed=0):
    """A BOS, a short document, a BOS in mid-block (position n_first + 1), then a document longer than
    the long window. Tokens from a small alphabet, so they repeat and copying has something to copy."""
    rng = np.random.default_rng(seed)
    return [BOS] + rng.integers(0, 40, n_first).tolist() + [BOS] + rng.integers(0, 40, n_second).tolist()


def reference_generate(model, prompt, max_new_tokens, temperature, top_k, seed, window):
    """The oracle: the dense reference on the whole sequence at every step, the same sampler."""
    generator = torch.Generator().manual_seed(seed)
    ids, log_probs = list(prompt), []
    for _ in range(max_new_tokens):
        lp = model.next_token_log_probs(torch.tensor([ids]), window)[0, -1]
        log_probs.append(lp)
        ids.append(tg.sample_next(lp, VOCAB, temperature, top_k, generator))
    return ids[len(prompt):], log_probs


# ----------------------------------------------------------------------------------------------------
# the caches against the dense reference


@pytest.mark.parametrize("cplm", [0, 1])
@pytest.mark.parametrize("window", [None, WINDOW, 1])
def test_every_position_matches_the_reference(cplm, window):
    """Fed in uneven pieces (a chunked prefill whose chunks cut through the BOS and the window edges,
    then single tokens), the cached path's log p(next) equals the reference's at every position."""
    model = tiny_model(cplm)
    ids = two_documents()
    reference = model.next_token_log_probs(torch.tensor([ids]), window)[0]
    cache = tg.InferenceCache(model, window, prefill_chunk=50)
    got, lo = [], 0
    for size in [1, 63, 131, 7] + [1] * (len(ids) - 202):
        got.append((lo + size - 1, cache.extend(ids[lo:lo + size])))
        lo += size
    assert lo == len(ids)
    for t, lp in got:
        finite = torch.isfinite(reference[t])
        assert torch.equal(finite, torch.isfinite(lp)), t
        torch.testing.assert_close(lp[finite], reference[t][finite], atol=2e-5, rtol=1e-5, msg=f"position {t}")


@pytest.mark.parametrize("cplm", [0, 1])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_generate_equals_the_reference_token_for_token(cplm, window):
    """Greedy and seeded sampling (temperature, top-k) give the reference's tokens, and every step's
    log-probs agree within float tolerance; the context ends past the window, in the prompt's second document."""
    model = tiny_model(cplm)
    prompt = two_documents(n_second=230)
    for temperature, top_k, seed in [(0.0, 0, 0), (1.0, 0, 1), (0.8, 20, 2)]:
        want, want_log_probs = reference_generate(model, prompt, 30, temperature, top_k, seed, window)
        cache = tg.InferenceCache(model, window, prefill_chunk=100)
        got = tg.generate(model, prompt, 30, temperature, top_k, seed, window_blocks=window, cache=cache)
        assert got == want, (temperature, top_k)
        assert cache.end == len(prompt) + 29  # the last token is drawn, never fed
        cache = tg.InferenceCache(model, window)  # the same path, step by step: its log-probs
        lp = cache.extend(prompt)
        for step, (token, ref) in enumerate(zip(want, want_log_probs)):
            finite = torch.isfinite(ref)
            assert torch.equal(finite, torch.isfinite(lp))
            torch.testing.assert_close(lp[finite], ref[finite], atol=2e-5, rtol=1e-5, msg=f"step {step}")
            lp = cache.extend([token])


def test_caches_hold_only_what_a_later_token_can_see():
    """Window layers keep at most window x 128 positions of the current document, full attention the
    whole document, the layer without attention nothing; the CP keys and ids cover the current document
    from its BOS; a new BOS drops the document before it."""
    model = tiny_model(1)
    ids = two_documents()  # second document: positions 71..361
    cache = tg.InferenceCache(model, WINDOW)
    cache.extend(ids)
    lengths = [None if kv is None else kv[0].size(1) for kv in cache.kv]
    end = len(ids)
    assert lengths[2] is None  # no attention: nothing cached
    long_from, short_from = (end // 128 - WINDOW + 1) * 128, (end // 128) * 128
    assert lengths == [end - long_from, end - short_from, None, end - long_from]
    assert cache.cp_keys.shape == (1, end - 71, 16) and cache.cp_ids[0].tolist() == ids[71:]
    full = tg.InferenceCache(model, None)
    full.extend(ids)
    assert [None if kv is None else kv[0].size(1) for kv in full.kv] == [end - 71, end - 71, None, end - 71]
    full.extend([5, BOS, 7, 8])
    assert [None if kv is None else kv[0].size(1) for kv in full.kv] == [3, 3, None, 3]
    assert full.cp_ids[0].tolist() == [BOS, 7, 8] and full.doc_start == end + 1
    sizes = full.nbytes()
    assert sizes == {"kv": 3 * 2 * 3 * 32 * 4, "cp_keys": 3 * 16 * 4, "cp_ids": 3 * 4}


def test_sampler_draws_the_distribution_it_is_given():
    """Frequencies over many draws match p^(1/T) renormalised over the real ids (never <copy> or a
    padding slot); top_k keeps the k most likely; temperature 0 and top_k 1 are the argmax."""
    log_p = torch.full((8,), float("-inf"))
    log_p[:5] = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    log_p[6] = math.log(0.5)  # a padding slot with mass: must never be drawn (vocab_size 6)
    g = torch.Generator().manual_seed(0)
    draws = [tg.sample_next(log_p, 6, 1.0, 0, g) for _ in range(4000)]
    freq = np.bincount(draws, minlength=8) / len(draws)
    assert freq[5:].sum() == 0
    np.testing.assert_allclose(freq[:5], [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.03)
    hot = np.bincount([tg.sample_next(log_p, 6, 0.5, 2, g) for _ in range(2000)], minlength=8) / 2000
    np.testing.assert_allclose(hot[:2], [0.16 / 0.25, 0.09 / 0.25], atol=0.04)  # p^2 over the top 2
    assert hot[2:].sum() == 0
    assert tg.sample_next(log_p, 6, 0.0) == 0 and tg.sample_next(log_p, 6, 1.0, 1, g) == 0


def test_generate_refuses_what_it_cannot_do():
    model = tiny_model(0, max_seq_len=256)
    with pytest.raises(ValueError, match="max_seq_len"):
        tg.generate(model, two_documents(), 4)
    with pytest.raises(ValueError, match="temperature"):
        tg.generate(model, [BOS, 1], 4, temperature=-1)
    with pytest.raises(ValueError, match="at least one token"):
        tg.generate(model, [], 4)
    assert tg.generate(model, [BOS, 1, 2], 0) == []
