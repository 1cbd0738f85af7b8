"""F.scaled_dot_product_attention with a mask the program builds fuses (capture/sdpa.py): the
mask's expression goes into the kernel; SDPA without such a mask stays SDPA, with the reason."""
import copy

import pytest
import torch
import torch.nn.functional as F

import flashlight
from flashlight import backend
from flashlight.codegen import CodegenError
from flashlight.examples.document_mask import doc_ids_for
from flashlight.testing import rel_error
from helpers import check_fused, check_grads


def document(q, k, v, ids):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ids[:, None, :, None] == ids[:, None, None, :])


def document_causal_gqa(q, k, v, ids):       # two K/V heads for four query heads, an explicit scale
    idx = torch.arange(q.shape[-2], device=q.device)
    mask = (ids[:, None, :, None] == ids[:, None, None, :]) & (idx[:, None] >= idx[None, :])
    return F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], attn_mask=mask, scale=0.3, enable_gqa=True)


def alibi_bias(q, k, v, ids):                # a float mask: added to the scores
    idx = torch.arange(q.shape[-2], device=q.device).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=-(idx[:, None] - idx[None, :]).abs() * 0.5)


def padding_and_causal(q, k, v, ids):        # key padding from per-row lengths, fully masked rows too
    lengths = ids.amax(-1) * 3                # 0 for a row of a single document: every key masked
    keep = torch.arange(k.shape[-2], device=q.device)[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], is_causal=False)


PROGRAMS = [document, document_causal_gqa, alibi_bias, padding_and_causal]


def inputs(M=45):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, M, 16, generator=g) for _ in range(3))
    ids = doc_ids_for(2, M, docs=4, generator=g)
    ids[1] = 0          # one batch row of one document
    return q, k, v, ids


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_sdpa_with_a_built_mask_fuses(fn):
    """Forward against float64 eager SDPA (fully masked rows 0, as SDPA's math gives), the
    kernel launched, no score-sized tensor left to Inductor; gradients of q, k, v against
    float64 (through the generated backward where it applies)."""
    xs = inputs()
    check_fused(fn, *xs)
    # the padding lengths reduced from ids inside the region (a pass before the softmax): its
    # backward is the reference VJP (codegen.backward declines reductions read by the softmax)
    check_grads(fn, list(xs), generated=fn is not padding_and_causal)


@pytest.mark.parametrize("fn, reason", [
    (lambda q, k, v, ids: F.scaled_dot_product_attention(q, k, v), "no mask built"),
    (lambda q, k, v, ids: F.scaled_dot_product_attention(q, k, v, is_causal=True), "no mask built"),
    (lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]), "passed in built"),
    (lambda q, k, v, ids: F.scaled_dot_product_attention(
        q, k, v, attn_mask=ids[:, None, :, None] == ids[:, None, None, :], dropout_p=0.1), "dropout_p"),
], ids=["plain", "causal", "given mask", "dropout"])
def test_sdpa_stays_sdpa_where_its_kernels_serve(fn, reason):
    """No mask (FlashAttention and cuDNN are the fastest there), a mask passed in ready-made
    (SDPA reads it as a kernel would), dropout: SDPA, with the reason in explain()."""
    q, k, v, ids = inputs()
    last = ids[:, None, :, None] == ids[:, None, None, :] if reason == "passed in built" else ids
    report = flashlight.explain(fn, q, k, v, last[:, 0] if reason == "passed in built" else last)
    assert not report.regions
    assert any(f.op == "scaled_dot_product_attention" and reason in f.reason for f in report.fallbacks), report
    assert "0 fallback(s), 1 SDPA call(s) left to SDPA" in str(report)      # by design, not a failure


def test_an_sdpa_program_that_does_not_fuse_goes_back_to_sdpa(monkeypatch):
    """The rewrite never leaves SDPA's work to unfused math: in a graph whose other attention
    fuses, an SDPA program whose region fails to lower is traced again as SDPA (the graph
    Inductor gets calls SDPA, computes no softmax), with the reason, and the result is exact."""
    lower = backend.lower

    def refuse_sdpa(region, max_autotune=False):
        if "scaled_dot_product_attention" in region.source:
            raise CodegenError("refused by the test")
        return lower(region, max_autotune)
    monkeypatch.setattr(backend, "lower", refuse_sdpa)

    def both(q, k, v, ids):
        written = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
        plain = F.scaled_dot_product_attention(q, k, v)     # stays SDPA: its reason, given once
        return document(q, k, v, ids), written, plain      # three outputs: a sum would merge regions
    xs = inputs()
    report = flashlight.explain(both, *xs)
    assert len(report.regions) == 1
    reasons = [f.reason for f in report.fallbacks]
    assert any("refused by the test" in r for r in reasons) and any("did not fuse" in r for r in reasons), reasons
    assert len(reasons) == len(set(reasons)), reasons
    (graph,) = report.graphs
    aten = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.scaled_dot_product_attention.default in aten
    assert not aten & {torch.ops.aten.softmax.int, torch.ops.aten._softmax.default, torch.ops.aten.matmul.default}
    torch.compiler.reset()
    for got, want in zip(torch.compile(both, backend="flashlight")(*xs), both(*xs)):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("layer", ["mha", "encoder"])
def test_torch_attention_modules_with_key_padding_fuse(layer):
    """``nn.MultiheadAttention`` with a key padding mask and ``nn.TransformerEncoderLayer`` with
    ``src_key_padding_mask``: Dynamo keeps ``multi_head_attention_forward`` as one call, whose
    SDPA call (the padding turned into a float mask inside it) the ATen-level rewrite reaches.
    One region; the output and the gradients of the input and of every parameter against the
    module in float64."""
    torch.manual_seed(0)
    if layer == "mha":
        module = torch.nn.MultiheadAttention(32, 2, batch_first=True)
        fn = lambda m, x, pad: m(x, x, x, key_padding_mask=pad, need_weights=False)[0]    # noqa: E731
    else:
        module = torch.nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
        fn = lambda m, x, pad: m(x, src_key_padding_mask=pad)                              # noqa: E731
    x = torch.randn(2, 37, 32)
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[0, 20:] = True
    report = flashlight.explain(lambda x, pad: fn(module, x, pad), x, pad)
    assert len(report.regions) == 1 and not report.fallbacks, report

    def run(m, call, x):
        x = x.clone().requires_grad_()
        out = call(m, x, pad)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        params = [p for p in m.parameters()]
        return [out, *torch.autograd.grad((out * w).sum(), [x, *params])]
    torch.compiler.reset()
    got = run(module, torch.compile(fn, backend="flashlight"), x)
    want = run(copy.deepcopy(module).double(), fn, x.double())
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_error(a, b) < 1e-3, i
