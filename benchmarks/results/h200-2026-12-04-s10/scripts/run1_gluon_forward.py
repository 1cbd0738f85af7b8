"""A hand-written FA3-style attention forward in Gluon, for the H200: can Triton's lower-level
dialect close the D=128 gap to cuDNN that the generated Triton kernels cannot (docs/notes.md,
session 9: the softmax never overlaps the matrix products)?

    python -m benchmarks.gluon_forward [--b 4 --h 16 --n 4096 --d 128] [--offline]

The kernel is an experiment, not part of the library: full or causal attention, bf16,
[B, H, N, D] contiguous, N a multiple of 128. It is warp-specialised:

- a loader warp issues the TMA copies of Q (once) and of each K and V block into a ring of
  ``STAGES`` buffers, each with a ready and an empty mbarrier;
- two compute warpgroups each own 64 of the program's 128 query rows and run independently
  (no CTA-wide barrier in the loop), so one's softmax can overlap the other's wgmma;
- inside a warpgroup, block j's QK^T is issued before block j-1's P @ V is, and the softmax of
  block j runs while that P @ V is in flight (FA3's intra-warpgroup overlap).

``--offline`` compiles it for sm_90 on a machine without a GPU (``benchmarks.offline``) and
prints registers, spills and the SASS mix; on a GPU it checks the output against float64
attention and times it against cuDNN and flash SDPA.
"""
from __future__ import annotations

import argparse
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = 64           # query rows per compute warpgroup (the wgmma M of one warpgroup)
LOG2E = 1.4426950408889634


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
            q_row, kv_row, n_blocks):
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * 64, 0], q_bar.index(w), q_smem.index(w))
    for j in range(n_blocks):
        s = j % STAGES
        ph = (j // STAGES) & 1
        # an empty barrier starts with its phase 1 complete: the first STAGES waits pass
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, j, q0, n_blocks, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr):
    """One block's online softmax: P (fp32, in S's registers), the new row max and sum, and the
    factor that rescales the accumulator."""
    if CAUSAL:
        if j == n_blocks - 1:       # only the last block reaches past the diagonal
            rows = q0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _compute(W: gl.constexpr, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
             q_row, q0, n_blocks, qk_scale, CAUSAL: gl.constexpr):
    """One warpgroup's 64 rows, in FA3's order: block j's QK^T and block j-1's P @ V are in flight
    together, and block j's softmax runs between the two waits. The accumulator is rescaled
    before the product that adds to it, and P is converted to bf16 after the second wait, so
    nothing the softmax computes has to wait for the P @ V in flight."""
    # block sizes from the buffers: constexprs passed through warp_specialize arrive as tensors (triton 3.6)
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_D: gl.constexpr = k_smem.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q0 = q0 + W * 64
    mbarrier.wait(q_bar.index(W), 0)
    q = q_smem.index(W)
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)

    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, 0, q0, n_blocks, s_layout, BLOCK_N, CAUSAL)
    p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    for j in range(1, n_blocks):
        st = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))         # QK^T done, P @ V still in flight
        mbarrier.arrive(k_empty.index(st), count=1)
        p_next, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, j, q0, n_blocks, s_layout, BLOCK_N, CAUSAL)
        # the softmax's results are deps too: the wait then reads them, so ptxas cannot sink the
        # softmax below it (it schedules the wait early otherwise, and the P @ V runs alone)
        acc, p, p_next, l_i = warpgroup_mma_wait(0, deps=(acc, p, p_next, l_i))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p = gl.convert_layout(p_next.to(gl.bfloat16), p_layout)
    last = (n_blocks - 1) % STAGES
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(v_empty.index(last), count=1)
    acc = acc / gl.convert_layout(l_i, row_o)[:, None]
    q.store(acc.to(gl.bfloat16))        # O leaves through this warpgroup's Q buffer: Q is read no more
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + W * 64, 0], q)
    tma.store_wait(0)


@gluon.jit
def _compute0(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, q0,
              n_blocks, qk_scale, causal):
    _compute(0, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, q0,
             n_blocks, qk_scale, causal)


@gluon.jit
def _compute1(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, q0,
              n_blocks, qk_scale, causal):
    _compute(1, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, q0,
             n_blocks, qk_scale, causal)


@gluon.jit
def attention_fwd(q_desc, k_desc, v_desc, o_desc, N, qk_scale, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    num_m = gl.num_programs(0)
    pid_m = num_m - 1 - gl.program_id(0)        # causal: the longest rows first
    bh = gl.program_id(1)
    q0 = pid_m * 128
    q_row = bh * N + q0
    kv_row = bh * N
    if CAUSAL:
        n_blocks = gl.cdiv(q0 + 128, BLOCK_N)
    else:
        n_blocks = N // BLOCK_N

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)      # both compute warpgroups release a buffer
        mbarrier.init(v_empty.index(i), count=2)

    compute_args = (o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, q_row, q0,
                    n_blocks, qk_scale, CAUSAL)
    # The loader is the default partition: triton 3.6 verifies a reduction as it is built, and the
    # default partition's ops are built before it has a warp count, so reductions must live in a
    # worker. It keeps the leftover registers: maxnreg * 12 warps' worth, less 2 x 240.
    gl.warp_specialize([
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                   q_row, kv_row, n_blocks)),
        (_compute0, compute_args),
        (_compute1, compute_args),
    ], [4, 4], [240, 240])


def launch(q, k, v, causal: bool, block_n: int = 128, stages: int = 2, maxnreg: int = 168, run: bool = True):
    """Output of softmax(q k^T / sqrt(D)) v; ``run=False`` returns the kernel and its arguments
    (for an offline compile) instead."""
    B, H, N, D = q.shape
    assert N % 128 == 0 and N % block_n == 0 and q.dtype == torch.bfloat16
    o = torch.empty_like(q)
    rows = lambda x: x.reshape(B * H * N, D)       # noqa: E731 — contiguous [B, H, N, D] as one 2-D tensor
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)    # noqa: E731
    q_desc = TensorDescriptor.from_tensor(rows(q), [ROWS, D], lay([ROWS, D]))
    k_desc = TensorDescriptor.from_tensor(rows(k), [block_n, D], lay([block_n, D]))
    v_desc = TensorDescriptor.from_tensor(rows(v), [block_n, D], lay([block_n, D]))
    o_desc = TensorDescriptor.from_tensor(rows(o), [ROWS, D], lay([ROWS, D]))
    args = (q_desc, k_desc, v_desc, o_desc, N, D ** -0.5 * LOG2E)
    meta = dict(BLOCK_N=block_n, HEAD_D=D, STAGES=stages, CAUSAL=causal, num_warps=4, maxnreg=maxnreg)
    if not run:
        return attention_fwd, args, meta
    attention_fwd[(N // 128, B * H)](*args, **meta)
    return o


def reference(q, k, v, causal: bool) -> torch.Tensor:
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def offline(d: int, block_n: int, stages: int, maxnreg: int, causal: bool) -> None:
    from .offline import compile_sm90, ptxas_usage, sass_counts
    q = torch.empty(1, 1, 256, d, dtype=torch.bfloat16)
    fn, args, meta = launch(q, q, q, causal, block_n, stages, maxnreg, run=False)
    k = compile_sm90(fn, args, meta)
    use = ptxas_usage(k.asm["ptx"])
    mix = sass_counts(k.asm["cubin"])
    print(f"D={d} BN={block_n} s{stages} r{maxnreg} causal={causal}: {use} smem={k.metadata.shared} "
          f"{dict(mix)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4x4096x128,1x16384x128,4x4096x64,1x16384x64", help="BxNxD, H=16")
    p.add_argument("--configs", default="128s2,128s3,64s3", help="BLOCK_N and stages of the Gluon kernel")
    p.add_argument("--offline", action="store_true")
    args = p.parse_args()
    configs = [tuple(map(int, c.split("s"))) for c in args.configs.split(",")]
    if args.offline:
        for d in (128, 64):
            for causal in (False, True):
                for bn, st in configs:
                    offline(d, bn, st, 168, causal)
        return
    import csv
    import os
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    import flashlight  # noqa: F401 — registers the backend
    from flashlight.examples import VARIANTS
    torch._dynamo.config.cache_size_limit = 64
    rows = []
    for shape in args.shapes.split(","):
        B, N, D = map(int, shape.split("x"))
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, 16, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        small = [x[:1, :2] for x in (q, k, v)]
        for causal in (False, True):
            ref = reference(*small, causal)
            t = {}
            for bn, st in configs:
                name = f"gluon_{bn}s{st}"
                try:
                    got = launch(*small, causal, bn, st).double()
                    err = float((got - ref).norm() / ref.norm())
                    t[name] = do_bench(lambda: launch(q, k, v, causal, bn, st), return_mode="median")
                except Exception as e:  # noqa: BLE001 — a config that does not fit: recorded, not fatal
                    err, t[name] = float("nan"), float("nan")
                    print(f"{shape} causal={causal} {name}: {type(e).__name__}: {str(e)[:200]}")
                rows.append(dict(shape=shape, causal=causal, impl=name, ms=t[name], rel_err=err))
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(be):
                    t[name] = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal), return_mode="median")
            fn = torch.compile(VARIANTS["causal" if causal else "vanilla"].attention, backend="flashlight")
            with torch.no_grad():
                got = fn(*small).double()
                t["flashlight"] = do_bench(lambda: fn(q, k, v), return_mode="median")
            rows.append(dict(shape=shape, causal=causal, impl="flashlight", ms=t["flashlight"],
                             rel_err=float((got - ref).norm() / ref.norm())))
            rows += [dict(shape=shape, causal=causal, impl=n, ms=t[n], rel_err="") for n in ("cudnn", "flash")]
            best = min((n for n in t if n.startswith("gluon")), key=lambda n: t[n] if t[n] == t[n] else 1e9)
            print(f"{shape} causal={causal}: " + "  ".join(f"{n} {t[n]:.3f}" for n in t)
                  + f"  | best gluon {best}: x cudnn {t['cudnn'] / t[best]:.2f}, x flashlight "
                  f"{t['flashlight'] / t[best]:.2f}", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gluon_forward.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
