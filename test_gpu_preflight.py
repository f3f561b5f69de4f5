"""GPU pre-flight on CPU (records/gpu/preflight.py): every graph the CUDA path compiles is pushed through
inductor's lowering, and must stop only where a GPU is needed (Triton, a CUDA device query), never at a
lowering error. Tracing alone (test_cplm.py's aot_eager test) cannot see a lowering failure."""
import os
import re
import sys

import pytest
import torch

import train_gpt_cplm as tg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "records", "gpu"))
import preflight  # noqa: E402

BOS, VOCAB = 499, 500


def packed_row(T, seed, docs=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (1, T + 1), generator=g)  # a small alphabet: many targets are copyable
    for start in torch.linspace(0, T - 8, docs).long():
        ids[0, start] = BOS
    return ids[:, :-1], ids[:, 1:]


def cp_inputs(T=256, d=64, seed=0):
    torch.manual_seed(seed)
    input_ids, target_ids = packed_row(T, seed)
    doc_ids = tg.doc_ids_of(input_ids, BOS)
    copyable = tg.target_in_context(input_ids, target_ids, doc_ids, VOCAB + 12)
    q, k = (torch.randn(1, T, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, input_ids, target_ids, doc_ids, copyable


def flex_copy_loss(q, k, input_ids, target_ids, doc_ids, copyable):
    lse_doc, lse_match = tg.copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, "flex")
    return lse_doc.sum() + lse_match.sum()


def test_cp_head_flex_backward_lowers():
    """Regression: the CP head keeps only flex's LSEs; with its outputs unused, flex's backward got
    grad_out = None, which inductor's lowering multiplies unconditionally ('NoneType' object has no attribute
    'make_loader'). Both graphs must now reach the GPU-only steps, the backward's two flex ops included."""
    results = preflight.lower(flex_copy_loss, *cp_inputs())
    preflight.expect_gpu_stops(results, ["forward", "backward"])
    backward = next(r for r in results if r.kind == "backward")
    assert len(backward.flex_stops) == 2, backward.line()


def test_cp_head_zero_coupling_is_exact():
    """The coupling that gives flex's backward its grad_out changes no value and no gradient (math path)."""
    import torch.nn.attention.flex_attention as flex_module
    q, k, input_ids, target_ids, doc_ids, copyable = cp_inputs(T=128, seed=1)
    original = flex_module._validate_device
    flex_module._validate_device = lambda *a, **kw: None
    try:
        flex = tg.copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, "flex")
        grads_flex = torch.autograd.grad(flex[0].sum() + 2 * flex[1].sum(), (q, k))
    finally:
        flex_module._validate_device = original
    dense = tg.copy_lses(q, k, input_ids, target_ids, doc_ids, copyable, "dense")
    grads_dense = torch.autograd.grad(dense[0].sum() + 2 * dense[1].sum(), (q, k))
    for a, b in zip(flex, dense):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_flex, grads_dense):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def gpu_path_model(cplm):
    torch.manual_seed(0)
    cfg = tg.GPTConfig(vocab_size=VOCAB, bos_id=BOS, num_layers=4, model_dim=64, num_heads=2, max_seq_len=512,
                       no_attention_layer=2, fp8_head=1, cplm=cplm)
    model = tg.GPT(cfg)
    model.attention_backend = model.cp_backend = "flex"
    for m in model.modules():  # as on CUDA: bf16 embeddings make the activations bf16
        if isinstance(m, torch.nn.Embedding):
            m.bfloat16()
    return model


@pytest.mark.parametrize("cplm", [0, 1])
def test_training_and_eval_graphs_lower(cplm):
    """Both modes' training forward and backward (FlexAttention masks, FP8 head, CP head) and evaluation
    (eval mode, token statistics) as train_gpt_cplm compiles them on CUDA."""
    model = gpu_path_model(cplm)
    x, y = packed_row(384, seed=2)
    window = torch.tensor(3, dtype=torch.int32)
    train = preflight.lower(model, x, y, window)
    preflight.expect_gpu_stops(train, ["forward", "backward"])
    # every attention layer's flex op, and the CP head's two, reached the GPU-only step in both directions
    flex_ops = 3 + 2 * cplm  # 4 layers, one without attention
    for r in train:
        assert len(r.flex_stops) == flex_ops, r.line()
    model.eval()
    xv, yv = packed_row(512, seed=3)
    with torch.no_grad():
        evaluation = preflight.lower(lambda a, b, w: model(a, b, w, token_stats=True), xv, yv, window)
    preflight.expect_gpu_stops(evaluation, ["inference"])


def test_fp8_and_newton_schulz_graphs_lower():
    """The FP8 head's two kernel bodies (compiled on their own on CUDA) and Muon's Newton-Schulz."""
    x, w = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(512, 64)
    with torch.no_grad():
        fwd = preflight.lower(tg._fp8_forward, x, w, 2.0, 2.0 ** 9)
        _, x8, w8 = tg._fp8_forward(x, w, 2.0, 2.0 ** 9)
        grad = torch.randn(256, 512, dtype=torch.bfloat16)
        bwd = preflight.lower(tg._fp8_backward, grad, x8, w8, 2.0, 2.0 ** 9, 2.0 ** 19)
        ns = preflight.lower(tg.newton_schulz, torch.randn(4, 64, 256))
    for results in (fwd, bwd, ns):
        preflight.expect_gpu_stops(results, ["inference"])


def test_preflight_reports_a_lowering_error():
    """A lowering error is reported as a finding, not taken for a GPU-only stop (the pre-flight can fail)."""
    from torch._inductor.lowering import lowerings
    op = torch.ops.aten.exp.default
    saved = lowerings[op]

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'make_loader'")
    lowerings[op] = broken
    try:
        results = preflight.lower(lambda t: t.exp().sum(), torch.randn(8, 8, requires_grad=True))
    finally:
        lowerings[op] = saved
    assert any(r.error and "make_loader" in r.error for r in results), [r.line() for r in results]
    with pytest.raises(AssertionError):
        preflight.expect_gpu_stops(results, ["forward", "backward"])


def test_first_call_dry_run_reports_through_a_failure_and_a_hang(tmp_path):
    """records/gpu/first_call.py on CPU at a tiny size, as the GPU machine would run it, with CPLM (flex)
    made to fail before its warm-up (the dense CP fallback takes its place) and the reference check made to
    take the GPU turn and hang (killed past its share): the report still comes out, whole, within the
    deadline, and names what failed."""
    import numpy as np
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 40_000), ("val", 4_000)):
        tokens = rng.integers(0, 300, n)
        tokens[::rng.integers(150, 400)] = 50256  # documents, each starting with GPT-2's end-of-text
        tokens[0] = 50256
        header = np.zeros(256, dtype="<i4")
        header[:3] = [20240520, 1, n]
        (data / f"toy_{split}_000000.bin").write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
    out = tmp_path / "out"
    deadline = 90
    locks = set(__import__("glob").glob("/tmp/cplm_gpu_turn_*.lock"))
    t0 = __import__("time").monotonic()
    r = __import__("subprocess").run(
        [sys.executable, "records/gpu/first_call.py", "--dry_run", "--out", str(out), "--data", str(data),
         "--steps", "6", "--deadline_s", str(deadline), "--inject", "cplm:fail,refcheck:hang"],
        cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True, timeout=deadline + 30)
    elapsed = __import__("time").monotonic() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert elapsed < deadline
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "report.txt"]  # within the device tool's 8 files
    assert set(__import__("glob").glob("/tmp/cplm_gpu_turn_*.lock")) <= locks  # its lock file removed
    report = (out / "report.txt").read_text()
    assert "bf16 GEMM 512^3:" in report and "FP8 _scaled_mm smoke test: relative error" in report
    assert "cplm: exit 7 -- injected failure before warm-up" in report
    assert "CPLM with the dense CP sums instead" in report
    assert "refcheck: killed (past its share of the GPU, 5s)" in report
    assert re.search(r"^vanilla: ok; compile \+ warm-up \d+s; steps 6; step time [\d.]+ ms", report, re.M), report
    assert re.search(r"^cplm_dense: ok; .*steps 6; step time [\d.]+ ms", report, re.M), report
    assert re.search(r"^cplm_dense/vanilla step time ratio: \d\.\d{3} \(the dense CP sums: flex failed\)$", report, re.M)
    assert re.search(r"^timed rows: sum L\^2 / T\^2 = 0\.\d{3}", report, re.M)
