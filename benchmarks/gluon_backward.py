"""A hand-written dK/dV backward kernel in Gluon for the H200, in the form of the Gluon forward
(``codegen/gluon.py``): can warp specialisation do for the backward what it did for the forward
at D=128? On the H200 (session 11, run 1; B=4 H=16 N=4096 D=128) it matched float64 (rel. error
2.3e-3 in dK and dV) and ran 1681 us full / 967 us causal against the generated Triton dK/dV
kernel's 2316 / 1145 in the same process (1.38x / 1.18x). Run it with a timeout: a wrong barrier
phase hangs.

    timeout 300 python -m benchmarks.gluon_backward [--b 4 --h 16 --n 4096 --d 128] [--offline]

Full or causal attention, bf16, [B, H, N, D] contiguous, N a multiple of 128. One program owns
128 keys: two compute warpgroups of 64 keys each, never waiting for each other, and a loader
partition that copies this program's K and V once and then every query block's Q and dO through
a 2-deep ring. Per query block of 64 rows a warpgroup computes S^T = K Q^T and dP^T = V dO^T (both
in flight together), P^T = exp2(S^T * scale * log2(e) - lse2), dS^T = P^T (dP^T - Delta), and
accumulates dV += P^T dO and dK += dS^T Q with P^T and dS^T as register operands. lse2 (the row
logsumexp in base 2) and Delta (rowsum(dO * O)) come from torch here; dQ is not computed (the
generated backward's dQ kernel stays, or a second Gluon kernel).

On a GPU it checks dK and dV against float64 autograd and prints its time next to the generated
backward's dK/dV kernel (``benchmarks.kernels.kernel_times`` of a Flashlight training step, same
process). ``--offline`` compiles it for sm_90 here and prints registers, spills and the SASS mix.
"""
from __future__ import annotations

import argparse
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
BLOCK_M = 64         # query rows per block of the loop
BLOCK_N = 128        # keys per program: two warpgroups of 64
STAGES = 2


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
            do_ready, do_empty, row0, key0, first, n_blocks):
    """K and V of this program once, then Q and dO of query blocks first.. through the ring."""
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [key0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [key0, 0], kv_bar, v_smem)
    for i in range(n_blocks):
        s = i % STAGES
        ph = (i // STAGES) & 1
        m0 = row0 + (first + i) * BLOCK_M
        mbarrier.wait(q_empty.index(s), ph ^ 1)        # an empty barrier starts with phase 1 complete
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [m0, 0], q_ready.index(s), q_smem.index(s))
        mbarrier.wait(do_empty.index(s), ph ^ 1)
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [m0, 0], do_ready.index(s), do_smem.index(s))


@gluon.jit
def _block(i, MASK: gl.constexpr, dk, dv, keys, k, v, zero_s, lse_ptr, delta_ptr, q_smem, do_smem, q_ready,
           q_empty, do_ready, do_empty, row0, first, qk_scale, a_layout: gl.constexpr):
    """One query block of a compute warpgroup: dV += P^T dO, dK += dS^T Q."""
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    cols: gl.constexpr = gl.SliceLayout(0, zero_s.type.layout)
    st = i % STAGES
    ph = (i // STAGES) & 1
    q0 = (first + i) * BLOCK_M
    mbarrier.wait(q_ready.index(st), ph)
    q = q_smem.index(st)
    s = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)        # S^T = K Q^T
    mbarrier.wait(do_ready.index(st), ph)
    do = do_smem.index(st)
    dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)      # dP^T = V dO^T
    queries = q0 + gl.arange(0, BLOCK_M, layout=cols)
    lse = gl.load(lse_ptr + row0 + queries)
    delta = gl.load(delta_ptr + row0 + queries)
    s = warpgroup_mma_wait(1, deps=(s, ))
    p = gl.exp2(s * qk_scale - lse[None, :])
    if MASK:
        p = gl.where(keys[:, None] <= queries[None, :], p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp, ))
    ds = p * (dp - delta[None, :])
    pb = gl.convert_layout(p.to(gl.bfloat16), a_layout)
    dsb = gl.convert_layout(ds.to(gl.bfloat16), a_layout)
    dv = warpgroup_mma(pb, do, dv, is_async=True)             # dV += P^T dO
    dk = warpgroup_mma(dsb, q, dk, is_async=True)             # dK += dS^T Q
    dv, dk, pb, dsb = warpgroup_mma_wait(0, deps=(dv, dk, pb, dsb))
    mbarrier.arrive(q_empty.index(st), count=1)
    mbarrier.arrive(do_empty.index(st), count=1)
    return dk, dv


@gluon.jit
def _compute(W: gl.constexpr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready,
             q_empty, do_ready, do_empty, row0, key0, first, n_blocks, qk_scale, sm_scale, causal):
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    HEAD_D: gl.constexpr = q_smem.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    keys = key0 - row0 + W * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))    # within the head
    k = k_smem.slice(W * 64, 64)        # this warpgroup's keys
    v = v_smem.slice(W * 64, 64)
    zero_s = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    dv = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar, 0)
    # causal: only the first two query blocks meet this program's keys on the diagonal (64-row
    # query blocks, 128 keys); the later ones see every key, so they skip the mask
    n_masked = gl.minimum(n_blocks, 2) if causal else 0
    for i in range(n_masked):
        dk, dv = _block(i, True, dk, dv, keys, k, v, zero_s, lse_ptr, delta_ptr, q_smem, do_smem, q_ready,
                        q_empty, do_ready, do_empty, row0, first, qk_scale, a_layout)
    for i in range(n_masked, n_blocks):
        dk, dv = _block(i, False, dk, dv, keys, k, v, zero_s, lse_ptr, delta_ptr, q_smem, do_smem, q_ready,
                        q_empty, do_ready, do_empty, row0, first, qk_scale, a_layout)
    # store: this warpgroup's 64 keys of dK (times the softmax scale) and dV, our own contiguous rows
    rows = key0 + W * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    offs = rows[:, None] * HEAD_D + gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))[None, :]
    gl.store(dk_ptr + offs, (dk * sm_scale).to(gl.bfloat16))
    gl.store(dv_ptr + offs, dv.to(gl.bfloat16))


@gluon.jit
def _compute0(dk_ptr, dv_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
              do_ready, do_empty, row0, key0, first, n_blocks, qk_scale, sm_scale, causal):
    _compute(0, dk_ptr, dv_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
             do_ready, do_empty, row0, key0, first, n_blocks, qk_scale, sm_scale, causal)


@gluon.jit
def _compute1(dk_ptr, dv_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
              do_ready, do_empty, row0, key0, first, n_blocks, qk_scale, sm_scale, causal):
    _compute(1, dk_ptr, dv_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
             do_ready, do_empty, row0, key0, first, n_blocks, qk_scale, sm_scale, causal)


@gluon.jit
def dkdv_kernel(q_desc, do_desc, k_desc, v_desc, dk_ptr, dv_ptr, lse_ptr, delta_ptr, N, qk_scale, sm_scale,
                CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = bh * N                       # this head's first row in the [B * H * N, D] views
    key0 = row0 + pid_n * BLOCK_N
    first = (pid_n * BLOCK_N) // BLOCK_M if CAUSAL else 0      # query blocks before it see none of its keys
    n_blocks = N // BLOCK_M - first
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, HEAD_D], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)     # both compute warpgroups release a buffer
        mbarrier.init(do_empty.index(i), count=2)
    causal = gl.to_tensor(CAUSAL)       # constexprs reach partitions as tensors in triton 3.6
    args = (dk_ptr, dv_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
            do_ready, do_empty, row0, key0, first, n_blocks, qk_scale, sm_scale, causal)
    gl.warp_specialize([
        (_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                   do_ready, do_empty, row0, key0, first, n_blocks)),
        (_compute0, args),
        (_compute1, args),
    ], [4, 4], [240, 240])


def launch(q, k, v, do, lse2, delta, causal: bool, run: bool = True):
    """dK, dV of softmax(q k^T / sqrt(D)) v for the output gradient ``do``; ``lse2``: the rows'
    logsumexp of the scaled scores in base 2, ``delta``: rowsum(do * o), both fp32 [B, H, N]."""
    B, H, N, D = q.shape
    assert N % BLOCK_N == 0 and q.dtype == torch.bfloat16
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    rows = lambda x: x.reshape(B * H * N, D)       # noqa: E731
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)    # noqa: E731
    descs = [TensorDescriptor.from_tensor(rows(x), [b, D], lay([b, D]))
             for x, b in ((q, BLOCK_M), (do, BLOCK_M), (k, BLOCK_N), (v, BLOCK_N))]
    args = (*descs, dk, dv, lse2, delta, N, D ** -0.5 * LOG2E, D ** -0.5)
    meta = dict(CAUSAL=causal, STAGES=STAGES, num_warps=4, maxnreg=168)
    if not run:
        return dkdv_kernel, args, meta
    dkdv_kernel[(N // BLOCK_N, B * H)](*args, **meta)
    return dk, dv


def statistics(q, k, v, do, causal: bool):
    """lse2 and Delta from torch (fp32): what the generated forward and row kernel provide."""
    s = (q.float() @ k.float().mT) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse2 = torch.logsumexp(s, -1) * LOG2E
    o = torch.softmax(s, -1) @ v.float()
    return lse2.contiguous(), (do.float() * o).sum(-1).contiguous()


def offline(d: int, causal: bool) -> None:
    from .offline import compile_sm90, ptxas_usage, sass_counts
    x = torch.empty(1, 1, 256, d, dtype=torch.bfloat16)
    st = torch.empty(1, 1, 256, dtype=torch.float32)
    fn, args, meta = launch(x, x, x, x, st, st, causal, run=False)
    ck = compile_sm90(fn, args, meta)
    print(f"D={d} causal={causal}: {ptxas_usage(ck.asm['ptx'])} smem={ck.metadata.shared} "
          f"{dict(sass_counts(ck.asm['cubin']))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--h", type=int, default=16)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--offline", action="store_true")
    args = p.parse_args()
    if args.offline:
        for causal in (False, True):
            offline(args.d, causal)
        return
    from triton.testing import do_bench
    import flashlight  # noqa: F401 — registers the backend
    from flashlight.examples import VARIANTS
    from .kernels import kernel_times
    torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    shape = (args.b, args.h, args.n, args.d)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for causal in (False, True):
        small = [x[:1, :2, :512].contiguous() for x in (q, k, v, do)]
        ref_in = [x.double().requires_grad_() for x in small[:3]]
        name = "causal" if causal else "vanilla"
        ref = VARIANTS[name].attention(*ref_in)
        ref_dk, ref_dv = torch.autograd.grad(ref, ref_in[1:], small[3].double())
        dk, dv = launch(*small, *statistics(*small, causal), causal)
        err = [float((a.double() - b).norm() / b.norm()) for a, b in ((dk, ref_dk), (dv, ref_dv))]
        stats = statistics(q, k, v, do, causal)
        ms = do_bench(lambda: launch(q, k, v, do, *stats, causal), return_mode="median")
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        fn = torch.compile(VARIANTS[name].attention, backend="flashlight", dynamic=False)

        def step():
            torch.autograd.grad(fn(*leaves), leaves, do)
        times = kernel_times(step, 10)
        ours = {n: t for n, (t, _) in times.items() if n.startswith("fl_bwd") and not n.endswith(("_dq", "_rows"))}
        print(f"causal={causal}: rel err dK {err[0]:.1e} dV {err[1]:.1e}; gluon dK/dV {ms * 1e3:.0f} us; "
              f"generated dK/dV kernel {ours}", flush=True)


if __name__ == "__main__":
    main()
