"""Tests of experiments/mechanism.py (gradient bottleneck, induction heads): `python3 -m pytest -q test_mechanism.py`
(seconds on one core, no GPU). Tiny random models built with train_gpt_cplm's GPTConfig."""
import importlib.util
import json
import math
import os
import runpy
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import inference
import train_gpt_cplm as tg

ROOT = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(ROOT, "experiments", "mechanism.py")
BOS, VOCAB = 99, 100
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

sys.path.insert(0, os.path.dirname(SCRIPT))  # experiments/, as when the script runs: it imports experiments/cli.py
_spec = importlib.util.spec_from_file_location("mechanism", SCRIPT)
mech = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mech)


def tiny_model(cplm, num_layers=2, seed=0, **over):
    """2 x 32 by default; the zero-initialised matrices get random values, so every head says something."""
    torch.manual_seed(seed)
    cfg = tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=num_layers, model_dim=32, num_heads=2,
                       max_seq_len=256, cplm=cplm, **over)
    model = tg.GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 1 and not p.any():
                p.normal_(0, 0.3)
        if cplm:
            model.copy_logit_bias.fill_(1.5)  # a gate well open (the default bias is 0)
    return inference.use_dense_paths(model).eval()


def packed_rows(B, T, seed, alphabet=12):
    """Rows of two documents each (a BOS at 0 and in the middle), tokens from a small alphabet: many copies."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, alphabet, (B, T + 1), generator=g)
    x[:, 0] = BOS
    x[:, T // 2] = BOS
    return x[:, :-1], x[:, 1:]


# ----------------------------------------------------------------------------------------------------
# grad


@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_lm_ratio_is_the_head_transpose_applied_to_the_logit_gradient(softcap):
    model = tiny_model(0, logit_softcap=softcap)
    ids, targets = packed_rows(2, 24, seed=1)
    norms = mech.head_gradient_norms(model, ids, targets)
    with torch.no_grad():  # by hand: g = softmax(z) - onehot(y) at z = cap(u), times the cap's derivative
        h, _ = model.hidden_states(ids)
        W = model.lm_head.weight
        u = h @ W.T
        z = tg.soft_cap(u, softcap)
        g = z.softmax(-1) - F.one_hot(targets, W.size(0)).float()
        if softcap:
            sig = torch.sigmoid(2 * u / softcap)
            g = g * 4 * sig * (1 - sig)
        expected = (g @ W).norm(dim=-1) / g.norm(dim=-1)
        Q, _ = torch.linalg.qr(W)  # (V, D): the logit directions W^T does not annihilate
        share = (g @ Q).norm(dim=-1) / g.norm(dim=-1)
    assert torch.allclose(norms["lm_logits"], g.norm(dim=-1), rtol=1e-4)
    assert torch.allclose(norms["lm_h"] / norms["lm_logits"], expected, rtol=1e-4)
    assert torch.allclose(norms["lm_span"] / norms["lm_logits"], share, rtol=1e-4)
    assert (share < 1).all() and (share > 0).all()
    assert "cp_h" not in norms
    assert torch.allclose(norms["nll"].mean(), model(ids, targets), rtol=1e-5)  # the training loss's own value


def test_cp_ratio_matches_per_token_autograd_through_the_training_loss():
    """Brute force, one backward pass per token, through train_gpt_cplm.cplm_target_log_prob itself: the
    numerator with respect to h (the CP head's query and key paths only), the denominator with respect to
    explicit scores. The training loss takes q and k, not scores: with d = T, q' = sqrt(T) I and k' = A^T
    (and the sink key = the sink scores) its scores are exactly A, so it can be differentiated by A."""
    model = tiny_model(1, cp_dim=8)
    T = 16
    ids, targets = packed_rows(1, T, seed=2, alphabet=5)
    norms = mech.head_gradient_norms(model, ids, targets)
    assert max(norms["check"].values()) < 1e-5
    cfg = model.config
    with torch.no_grad():
        h, doc_ids = model.hidden_states(ids)
    copyable = tg.target_in_context(ids, targets, doc_ids, cfg.padded_vocab)
    u = model.lm_head(h)  # no path from the LM head to the h below: only the CP head is followed
    h_cp = h.clone().requires_grad_()
    q, k, sink = model.cp_head(h_cp)

    def log_p(q, k, sink):
        return tg.cplm_target_log_prob(u, q, k, sink, ids, targets, doc_ids, copyable, cfg.copy_id,
                                       model.copy_logit_bias, cfg.logit_softcap, backend="dense")["log_p"][0]

    scale = cfg.cp_dim ** -0.5
    A = (q @ k.transpose(-1, -2) * scale).detach().requires_grad_()
    a_sink = (q @ sink * scale).detach()[0].requires_grad_()
    q_eye = math.sqrt(T) * torch.eye(T)[None]
    reparametrised = log_p(q_eye, A.transpose(-1, -2), a_sink)
    assert torch.allclose(reparametrised, log_p(q, k, sink), atol=1e-5)
    numerator, denominator = [], []
    for t in range(T):
        (g_h,) = torch.autograd.grad(-log_p(q, k, sink)[t], h_cp, retain_graph=True)
        g_A, g_s = torch.autograd.grad(-reparametrised[t], [A, a_sink], retain_graph=True)
        assert g_A[0, :t].abs().sum() == 0 and g_A[0, t + 1:].abs().sum() == 0 and g_s[:t].abs().sum() == 0
        numerator.append(g_h.norm())
        denominator.append((g_A.square().sum() + g_s.square().sum()).sqrt())
    assert torch.allclose(norms["cp_h"][0], torch.stack(numerator), rtol=1e-4, atol=1e-7)
    assert torch.allclose(norms["cp_logits"][0], torch.stack(denominator), rtol=1e-4, atol=1e-7)
    assert (norms["cp_h"] > 0).all() and (norms["lm_h"] > 0).all()


def test_buckets_are_thirds_of_the_row_by_position_in_the_document():
    doc_ids = tg.doc_ids_of(torch.tensor([[5, 5, BOS, 5, 5, 5, 5, 5, 5]]), BOS)
    assert mech.context_positions(doc_ids).tolist() == [[0, 1, 0, 1, 2, 3, 4, 5, 6]]
    ones = torch.ones(1, 9)
    norms = {"context_position": mech.context_positions(doc_ids), "lm_h": torch.arange(9.0)[None], "lm_logits": ones}
    got = mech.bucket_means(norms, T=9)["lm"]  # buckets of n: [0, 3), [3, 6), [6, 9)
    assert got["early"] == (pytest.approx((0 + 1 + 2 + 3 + 4) / 5), 5)
    assert got["middle"] == (pytest.approx((5 + 6 + 7) / 3), 3)
    assert got["late"] == (pytest.approx(8.0), 1)
    assert got["all"] == (pytest.approx(4.0), 9)


# ----------------------------------------------------------------------------------------------------
# induction


def test_prefix_matching_score_of_hand_built_patterns():
    period, T = 64, 128
    exact = torch.zeros(T, T)
    exact[:, 0] = 1  # the first copy: anything
    i = torch.arange(period, T)
    exact[i] = 0
    exact[i, i - period + 1] = 1
    assert mech.prefix_matching_scores(exact, period).item() == 1.0
    uniform = torch.ones(T, T).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    expected = (1 / (i + 1).double()).mean().item()  # ~1/i: about 0.011 over the second copy
    assert mech.prefix_matching_scores(uniform, period).item() == pytest.approx(expected, rel=1e-6)
    previous_token = torch.zeros(T, T)
    previous_token[torch.arange(1, T), torch.arange(T - 1)] = 1
    assert mech.prefix_matching_scores(previous_token, period).item() == 0.0
    assert mech.previous_token_scores(previous_token, period).item() == 1.0
    assert mech.previous_token_scores(exact, period).item() == 0.0


def test_copying_score_weighs_each_attended_token_by_its_own_logit():
    B, H, period = 1, 2, 4
    T = 2 * period
    self_logits = torch.arange(B * H * T, dtype=torch.float32).view(B, H, T)
    pattern = torch.zeros(B, H, T, T)
    i = torch.arange(T)
    pattern[:, 0, i, (i - period + 1).clamp(min=0)] = 1  # head 0: induction
    pattern[:, 1, i, 0] = 1  # head 1: always position 0
    scale = torch.full((B, T), 2.0)
    got = mech.copying_scores(pattern, self_logits, scale, period)[0]
    second = torch.arange(period, T)
    assert got[0].item() == pytest.approx(2 * self_logits[0, 0, second - period + 1].mean().item())
    assert got[1].item() == pytest.approx(2 * self_logits[0, 1, 0].item())


def test_explicit_attention_reproduces_the_layers_and_skips_layers_without_attention():
    model = tiny_model(1, num_layers=2, no_attention_layer=1)
    ids = mech.repeated_sequences(3, 8, VOCAB, BOS, seed=0)
    assert ids.shape == (3, 16) and (ids != BOS).all() and torch.equal(ids[:, :8], ids[:, 8:])
    outputs = {}
    handle = model.blocks[0].attn.register_forward_hook(lambda m, a, out: outputs.__setitem__(0, out))
    layers, x_final = mech.attention_layers(model, ids)
    handle.remove()
    assert list(layers) == [0]
    pattern = layers[0]["pattern"]
    assert torch.allclose(pattern.sum(-1), torch.ones(3, 2, 16), atol=1e-5)
    assert pattern.triu(1).abs().max() == 0  # causal
    y = torch.einsum("bhij,bjhd->bihd", pattern, layers[0]["v"]).reshape(3, 16, 32)
    assert torch.allclose(model.blocks[0].attn.c_proj(y), outputs[0], atol=1e-5)
    scores = mech.induction_scores(model, ids, 8)
    assert list(scores) == [0] and all(scores[0][key].shape == (2,) for key in ("prefix", "previous", "copying"))


def test_direct_path_gains_follow_the_block_mixes_and_skips():
    model = tiny_model(0, num_layers=4, no_attention_layer=2)
    a = [0.9, 0.8, 0.7, 0.6]
    w = [0.3, 0.2]
    with torch.no_grad():
        for block, ai in zip(model.blocks, a):
            block.lambdas[0] = ai
        model.skip_weights.copy_(torch.tensor(w))
    gains = mech.direct_path_gains(model, packed_rows(1, 16, seed=0)[0])
    # layer i's output feeds layer i+1's mix; layer 2 adds the skip of layer 1, layer 3 that of layer 0
    expected = {0: a[3] * (a[2] * a[1] * (1 + w[0]) + w[1]), 1: a[3] * a[2] * (1 + w[0]), 3: 1.0}
    assert gains.keys() == expected.keys()
    for layer, g in expected.items():
        assert gains[layer] == pytest.approx(g, rel=1e-5)


def test_copying_score_is_the_heads_direct_logit_effect():
    """Brute force on a sequence of one repeated token (so every attended token is that token): run the model
    with only head h of layer l (then with none of its heads), every other attention and MLP output frozen at
    its clean value; the difference of the last block's outputs, through the frozen final norm and the
    centred unembedding, is the head's direct logit effect on that token."""
    model = tiny_model(0, num_layers=2)
    period, token = 8, 7
    ids = torch.full((2, 2 * period), token)
    scores = mech.induction_scores(model, ids, period)
    clean = {}
    modules = [m for b in model.blocks for m in (b.attn, b.mlp) if m is not None]
    hooks = [m.register_forward_hook(lambda mod, a, out: clean.__setitem__(mod, out)) for m in modules]
    hooks.append(model.blocks[-1].register_forward_hook(lambda mod, a, out: clean.__setitem__("final", out)))
    with torch.no_grad():
        model.hidden_states(ids)
    for hd in hooks:
        hd.remove()
    inv_rms = (clean["final"].square().mean(-1) + torch.finfo(torch.float32).eps).rsqrt()
    W = model.lm_head.weight[:VOCAB]
    for layer in (0, 1):
        attn = model.blocks[layer].attn
        for head in range(2):
            def run(keep):
                final = {}
                hooks = [m.register_forward_hook(lambda mod, a, out: clean[mod]) for m in modules if m is not attn]
                mask = torch.zeros(32)
                mask[head * 16:(head + 1) * 16] = keep
                hooks.append(attn.c_proj.register_forward_pre_hook(lambda mod, a: (a[0] * mask,)))
                hooks.append(model.blocks[-1].register_forward_hook(lambda mod, a, out: final.__setitem__(0, out)))
                with torch.no_grad():
                    model.hidden_states(ids)
                for hd in hooks:
                    hd.remove()
                return final[0]

            logits = ((run(1.0) - run(0.0)) * inv_rms[..., None]) @ W.T
            effect = (logits[..., token] - logits.mean(-1))[:, period:].mean()
            assert scores[layer]["copying"][head].item() == pytest.approx(effect.item(), rel=1e-4, abs=1e-6)


# ----------------------------------------------------------------------------------------------------
# the command line, on a checkpoint written by train_gpt_cplm.save_checkpoint


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:4] = [20240520, 1, len(tokens), VOCAB]
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())


class StubLoader:
    def state(self):
        return {"position": 0}


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """logs/run/state_step000002.pt of a tiny CPLM 2 x 32 whose LM head and W_Q are no longer zero; val shard
    beside it."""
    d = tmp_path_factory.mktemp("mech")
    rng = np.random.default_rng(0)
    tokens = [BOS] + list(rng.integers(0, 20, 600))
    tokens[300] = BOS
    write_shard(d / "toy_val_000000.bin", tokens)
    hp = tg.parse_args(["--preset", "cpu", "--vocab_size", str(VOCAB), "--bos_id", str(BOS), "--num_layers", "2",
                        "--model_dim", "32", "--num_heads", "2", "--seq_len", "128", "--val_seq_len", "128",
                        "--batch_size", "128", "--val_tokens", "256", "--cplm", "1", "--seed", "3",
                        "--val_files", str(d / "toy_val_*.bin"), "--run_id", "tiny", "--log_dir", str(d / "logs")])
    torch.manual_seed(hp.seed)
    model = tg.GPT(tg.GPTConfig.from_args(hp))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.1)
        model.cp_head.w_q.weight.normal_(0, 0.1)
    path = str(d / "logs" / "tiny" / "state_step000002.pt")
    tg.run_files.save_checkpoint(path, model, tg.build_optimizers(model, hp, 0, 1), 2, StubLoader(), 0.0, hp, [])
    return d


def run_cli(argv, monkeypatch):
    """experiments/mechanism.py as `python experiments/mechanism.py ARGV` runs it (its __main__ block), in this
    process: a subprocess would spend most of the test importing torch again."""
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(SystemExit) as e:
        runpy.run_path(SCRIPT, run_name="__main__")
    return e.value.code


def test_cli_grad_on_a_run_folder_adds_the_seeded_step_0(run_folder, tmp_path, monkeypatch):
    out = tmp_path / "report" / "grad"
    assert run_cli(["grad", "--checkpoints", str(run_folder / "logs" / "tiny"), "--rows", "2", "--out", str(out)],
                   monkeypatch) == 0
    results = json.loads((tmp_path / "report" / "grad.json").read_text())["results"]
    assert [(x["run_id"], x["step"], x["mode"]) for x in results] == [("tiny", 0, "cplm"), ("tiny", 2, "cplm")]
    # at step 0 the zero-initialised LM head and W_Q pass the backbone nothing; by step 2 both pass something
    assert results[0]["ratios"]["lm"]["all"][0] == results[0]["ratios"]["cp"]["all"][0] == 0.0
    assert results[0]["ratios"]["lm_span"]["all"][0] == 0.0
    assert results[1]["ratios"]["lm"]["all"][0] > 0 and results[1]["ratios"]["cp"]["all"][0] > 0
    assert results[1]["ratios"]["cp"]["all"][1] == 256  # 2 rows of 128 tokens
    assert results[0]["loss"] == pytest.approx(math.log(128), abs=0.05)  # uniform over the padded vocabulary
    md = (tmp_path / "report" / "grad.md").read_text()
    assert "| tiny | 2 | cplm |" in md and "experiments/mechanism.py grad" in md
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "report" / "grad.png").stat().st_size > 0


def test_step_0_is_the_runs_seeded_initialisation(run_folder):
    entries = mech.expand_checkpoints([str(run_folder / "logs" / "tiny")], -1)
    assert [(e.step, e.path is None) for e in entries] == [(0, True), (2, False)]
    rebuilt = mech.build_model(entries[0]).state_dict()
    torch.manual_seed(3)
    fresh = tg.GPT(tg.GPTConfig.from_args(entries[0].hp)).state_dict()
    assert rebuilt.keys() == fresh.keys() and all(torch.equal(rebuilt[k], fresh[k]) for k in fresh)
    assert [e.step for e in mech.expand_checkpoints([entries[1].path], -1)] == [2]
    assert [e.step for e in mech.expand_checkpoints([entries[1].path], 1)] == [0, 2]
    folder = str(run_folder / "logs" / "tiny")
    again = mech.expand_checkpoints([folder, os.path.join(folder, ".", "state_step000002.pt")], -1)
    assert [e.step for e in again] == [0, 2]  # the file given twice is analysed once


def test_cli_induction_side_by_side(run_folder, tmp_path, capsys):
    path = str(run_folder / "logs" / "tiny" / "state_step000002.pt")
    out = str(tmp_path / "induction")
    assert mech.main(["induction", "--checkpoints", path, "--step0", "1", "--period", "8", "--batch", "4",
                      "--out", out]) == 0
    results = json.load(open(out + ".json"))["results"]
    assert [r["step"] for r in results] == [0, 2]
    assert all(len(r["prefix"]) == 2 and len(r["prefix"][0]) == 2 for r in results)
    assert all(0 <= p <= 1 for r in results for key in ("prefix", "previous") for layer in r[key] for p in layer)
    if importlib.util.find_spec("matplotlib"):
        assert os.path.getsize(out + ".png") > 0 and os.path.getsize(out + "_steps.png") > 0
    assert "| tiny | 2 | cplm | 4 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["grad"], "--checkpoints"),
    (["grad", "--checkpoints", "x.pt", "--rows", "0"], "--rows"),
    (["induction", "--checkpoints", "x.pt", "--threshold", "1.5"], "--threshold"),
    (["nothing"], "invalid choice"),
])
def test_bad_flags_exit_2_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        mech.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_missing_corrupt_and_mismatched_checkpoints_exit_2_in_one_line(run_folder, tmp_path, capsys):
    good = run_folder / "logs" / "tiny" / "state_step000002.pt"
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "truncated.pt").write_bytes(good.read_bytes()[:5000])
    state = torch.load(good, weights_only=True)
    del state["digest"]  # else refused first as a changed file
    state["hyperparameters"]["model_dim"] = 64
    torch.save(state, tmp_path / "other_shape.pt")
    (tmp_path / "empty").mkdir()
    for bad, message in [(tmp_path / "missing.pt", "no such checkpoint"), (tmp_path / "garbage.pt", "not a readable"),
                         (tmp_path / "truncated.pt", "not a readable"),
                         (tmp_path / "other_shape.pt", "do not describe its weights"),
                         (tmp_path / "empty", "without checkpoints")]:
        assert mech.main(["grad", "--checkpoints", str(bad)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert mech.main(["grad", "--checkpoints", str(good), "--rows", "3"]) == 2  # the toy run has 2 rows of 128
    err = capsys.readouterr().err
    assert "validation set has 2 rows" in err and err.count("\n") == 1, err


def test_seed_groups_average_the_seeds_of_a_run_and_only_steps_every_seed_has():
    def fake(run_id, step, lm):
        cells = {b: [lm, 10] for b in (*mech.BUCKETS, "all")}
        return {"run_id": run_id, "step": step, "mode": "vanilla", "loss": lm, "ratios": {"lm": cells},
                "rows": 1, "row_tokens": 10, "random_direction_share": 0.1, "check": None}
    results = [fake("a_s0", 0, 1.0), fake("a_s0", 100, 2.0), fake("a_s1", 0, 3.0), fake("b_s0", 0, 5.0)]
    groups = mech.seed_groups(results)
    assert list(groups) == ["a"] and sorted(groups["a"]) == [0, 100]  # b has one seed: no mean of it
    md = mech.grad_markdown(results, "cmd")
    mean_rows = [line for line in md.splitlines() if line.startswith("| a_s* |")]
    assert mean_rows == ["| a_s* | 2 | 0 | 2 +- 1.4 | LM | 2 +- 1.4 | 2 +- 1.4 | 2 +- 1.4 | 2 +- 1.4 |"]
    assert mech.mean_std([4.0]) == "4"


def test_cp_pattern_is_the_pointer_that_the_dense_mixture_copies_with():
    """p(v) = (1 - lam) / (1 - c) p_full(v) + c sum_{x_tau = v} alpha(tau), lam = c (1 - s), s = 1 - sum alpha:
    rebuilt from cp_pattern's alpha, it equals the dense reference's distribution at every slot."""
    model = tiny_model(1)
    ids, _ = packed_rows(2, 24, seed=3)
    alpha = mech.cp_pattern(model, ids)
    assert torch.all(alpha.triu(1) == 0) and torch.all(alpha.sum(-1) <= 1 + 1e-6)
    with torch.no_grad():
        h, _ = model.hidden_states(ids)
        logits = model.lm_logits(h).float()
        logits[..., model.config.copy_id] += model.copy_logit_bias
        p_full = logits.softmax(-1)
        c = p_full[..., model.config.copy_id]
        s = 1 - alpha.sum(-1)
        lam = c * (1 - s)
        copied = torch.zeros_like(p_full).scatter_add_(-1, ids[:, None, :].expand_as(alpha), alpha)
        p = ((1 - lam) / (1 - c))[..., None] * p_full + c[..., None] * copied
        p[..., model.config.copy_id] = 0
        expected = inference.next_token_log_probs(model, ids).exp()
    torch.testing.assert_close(p, expected, atol=1e-5, rtol=1e-4)



def test_zeroing_a_head_where_it_enters_c_proj_is_zeroing_its_columns_of_c_proj():
    model = tiny_model(1)
    ids = mech.repeated_sequences(3, 8, VOCAB, BOS, seed=1)
    ablated = mech.second_copy_loss_without(model, ids, 8, layer=1, head=1)
    assert ablated != mech.in_context_loss(model, ids, 8)[1]  # the hook is gone afterwards: the model is whole
    attn = model.blocks[1].attn
    with torch.no_grad():
        attn.c_proj.weight[:, attn.head_dim:2 * attn.head_dim] = 0
    assert abs(ablated - mech.in_context_loss(model, ids, 8)[1]) < 1e-5


def test_mean_ablation_replaces_a_head_by_its_mean_over_the_inputs_positions():
    model = tiny_model(1)
    ids = mech.repeated_sequences(3, 8, VOCAB, BOS, seed=1)
    attn, cols = model.blocks[1].attn, slice(attn_dim := model.blocks[1].attn.head_dim, 2 * attn_dim)
    mean_ablated = mech.second_copy_loss_without(model, ids, 8, layer=1, head=1, mean=True)
    zeroed = mech.second_copy_loss_without(model, ids, 8, layer=1, head=1)
    assert mean_ablated != zeroed
    # the head's mean output over the 3 x 15 positions the loss sees, recorded independently
    seen = []
    handle = attn.c_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0][..., cols].detach().clone()))
    mech.in_context_loss(model, ids, 8)
    handle.remove()
    assert seen[0].shape[:-1] == (3, 15)
    head_mean = seen[0].reshape(-1, attn_dim).mean(0)
    # the same as zeroing the head's columns of c_proj and adding their image of the mean to c_proj's output
    with torch.no_grad():
        constant = F.linear(head_mean, attn.c_proj.weight[:, cols].float())
        attn.c_proj.weight[:, cols] = 0
    handle = attn.c_proj.register_forward_hook(lambda m, args, out: out + constant.to(out.dtype))
    try:
        assert abs(mean_ablated - mech.in_context_loss(model, ids, 8)[1]) < 1e-5
    finally:
        handle.remove()


def test_a_pointer_sentinel_model_is_refused_in_one_line():
    """The studies read the paper's <copy> gate c; a --copy_gate sentinel model has none."""
    hp = tg.parse_args(["--preset", "cpu", "--vocab_size", str(VOCAB), "--bos_id", str(BOS), "--num_layers", "2",
                        "--model_dim", "32", "--num_heads", "2", "--cplm", "1", "--copy_gate", "sentinel"])
    with pytest.raises(mech.CheckpointError, match="pointer-sentinel model"):
        mech.build_model(mech.Entry("s", 0, hp, None))
