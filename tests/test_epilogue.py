"""Epilogue fusion (capture/epilogue.py): per-head norms, gates after the transpose back to the
model's layout, and trailing reshapes run in the kernel after the last N block; the rest of the
graph still gets the same values."""
import operator
import types

import torch

import flashlight
from flashlight.examples import diff_attention, evoformer
from flashlight.testing import reference, rel_error
from helpers import check_fused, check_grads

B, H, M, N, D = 1, 2, 37, 70, 16


def _ops(report) -> set[str]:
    """Ops left in the graphs, besides the getitem that takes the region's output from
    (output, row statistics). Without gradients the graph calls ``region_direct`` (the inference
    op's implementation)."""
    return {getattr(n.target, "__name__", "") if isinstance(n.target, types.FunctionType) else str(n.target)
            for g in report.graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem}


def test_diff_attention_rmsnorm_and_head_merge_are_in_the_kernel():
    _, report = check_fused(diff_attention.attention, *diff_attention.make_inputs(B=B, H=H, M=M, N=N, D=D))
    r = report.regions[0]
    assert {"epilogue-norm", "permuted-store"} <= set(r.features)
    assert "sum_dv" in r.ir and "tl.sum(tl.where(mask_dv" in r.kernel_source
    assert _ops(report) == {"region_direct"}       # no pow / mean / rsqrt / reshape left


def test_evoformer_gate_after_the_transpose_is_in_the_kernel():
    _, report = check_fused(evoformer.attention, *evoformer.make_inputs(B=1, H=2, M=37, D=16))
    assert "permuted-store" in report.regions[0].features
    assert _ops(report) == {"region_direct"}       # no sigmoid, mul, transpose


def test_layernorm_epilogue():
    def attention(q, k, v, w, bias):
        o = torch.softmax(q @ k.mT * 0.25, -1) @ v
        mu = o.mean(-1, keepdim=True)
        var = ((o - mu) ** 2).mean(-1, keepdim=True)
        return (o - mu) * torch.rsqrt(var + 1e-5) * w + bias
    q, k, v = torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    _, report = check_fused(attention, q, k, v, torch.randn(D), torch.randn(D))
    assert "epilogue-norm" in report.regions[0].features
    # the generated backward reverses the dv-sums in its row kernel (ir.derivative's sum_dv row)
    check_grads(attention, [q[..., :21, :], k[..., :30, :], v[..., :30, :], torch.randn(D), torch.randn(D)])


def test_head_dim_padding_does_not_enter_the_norm():
    """DV = 20 is padded to a 32-wide tile: padded columns must not count in the row sum."""
    q, k, v, lam, w = diff_attention.make_inputs(B=B, H=H, M=M, N=N, D=20)
    check_fused(diff_attention.attention, q, k, v, lam, w)
    check_grads(diff_attention.attention, [q[:1, :, :19], k[:1, :, :23], v[:1, :, :23], lam, w])  # the sum's adjoint


def test_output_used_twice_keeps_the_epilogue_outside():
    """When the attention output is also returned, the norm cannot replace it: the region ends at
    P @ V and the norm runs outside, on the same values."""
    def attention(q, k, v):
        o = torch.softmax(q @ k.mT * 0.25, -1) @ v
        return o, o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5)
    q, k, v = torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    report = flashlight.explain(attention, q, k, v)
    assert len(report.regions) == 1 and "epilogue-norm" not in report.regions[0].features
    got = torch.compile(attention, backend="flashlight")(q, k, v)
    for i in range(2):
        assert rel_error(got[i], reference(lambda *a: attention(*a)[i], q, k, v)) < 1e-5


def test_pointwise_after_a_reshape_stays_outside():
    """A reshape only moves the tile; an op after it runs outside on the stored result."""
    def attention(q, k, v, g):
        o = (torch.softmax(q @ k.mT * 0.25, -1) @ v).transpose(1, 2).reshape(B, M, H * D)
        return o * g
    args = (torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D), torch.randn(B, M, H * D))
    _, report = check_fused(attention, *args)
    assert "permuted-store" in report.regions[0].features and "aten.mul.Tensor" in _ops(report)


def test_evoformer_gradients_through_the_permuted_store():
    """The generated backward's row kernel reads dO through the forward's permuted store index
    (``kernel.out_offsets``), for the 5-D row-wise and column-wise Evoformer layouts."""
    check_grads(evoformer.attention, evoformer.make_inputs(B=1, H=2, M=21, D=16))

    def column_attention(q, k, v, gate):       # over the sequence dim S, per residue
        qt, kt, vt = (x.permute(0, 2, 3, 1, 4) for x in (q, k, v))     # [B, R, H, S, C]
        o = (torch.softmax(qt @ kt.mT * q.shape[-1] ** -0.5, -1) @ vt).permute(0, 3, 1, 2, 4)
        return (o * torch.sigmoid(gate)).flatten(-2)
    q, k, v, _, _, gate = evoformer.make_inputs(B=1, H=2, M=5, D=16, S=19)
    check_grads(column_attention, [q, k, v, gate])


def test_head_merging_store_with_one_query():
    """M = 1 (a decoding step) with the heads merged into [B, 1, H * D]: no store index term
    varies along m, so the store pointer (and the backward's dO load) is broadcast to the whole
    tile (fuzz seeds 14/15, epilogue=merge_heads, all M = 1 programs crashed at launch)."""
    def attention(q, k, v):
        o = torch.softmax(q @ k.mT * 0.25, -1) @ v
        return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    q, k, v = torch.randn(2, 3, 1, 16), torch.randn(2, 3, 29, 16), torch.randn(2, 3, 29, 16)
    check_fused(attention, q, k, v)
    check_grads(attention, [q, k, v])


def test_norm_without_epsilon_keeps_padded_rows_out_of_weight_gradients():
    """An L2 normalisation without epsilon: rows past M (a ragged last query block) have o = 0
    and their adjoint of the weight is 0 * inf there; the row kernel zeroes padded rows and
    columns before summing a broadcast input's gradient over them (found in review)."""
    def attention(q, k, v, w):
        o = torch.softmax(q @ k.mT * 0.25, -1) @ v
        return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True)) * w
    q, k, v = torch.randn(1, 2, 21, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    check_grads(attention, [q, k, v, torch.randn(16)])
