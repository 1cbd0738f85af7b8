"""Hand-written forwards (FA2 loop, B x H x N x D contiguous, N a multiple of the blocks) that
try one change of loop structure at a time against cuDNN SDPA, to say what the generated kernel
could still gain before the change goes into codegen. Needs a Hopper GPU:

    python -m benchmarks.hand_forward [--quick]      # table last; CSV to $OUT (default .)

Variants (constexpr flags of one kernel):
  - ``DEFER`` (1: P carried in bf16, 2: in fp32): each key block's P @ V is issued in the next iteration, after that block's
    QK^T, so the tensor cores run it while the exp2 of the next block's softmax runs (FA3's
    intra-warpgroup overlap). In Triton 3.6 a ``tl.dot`` whose result is used in the same
    iteration waits for every wgmma in flight; a product into a loop-carried accumulator does
    not. Without the change, QK^T waits for the previous P @ V, and the softmax runs with the
    tensor cores idle (both warpgroups of a program are kept in step by the loads' barriers).
    The first iteration multiplies a zero P (one wasted product per program).
  - ``TMA``: K and V through device-side tensor descriptors (session 6: 8-10% at D=128, not
    reproduced in the generated kernel).
  - ``CAUSAL``: mask-free blocks below the diagonal, then the masked diagonal blocks.
"""
import argparse
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _kv(k_ptr, v_ptr, kd, vd, base, start_k, start_v, offs_n, offs_d, D: tl.constexpr, BLOCK_N: tl.constexpr,
        TMA: tl.constexpr):
    if TMA:
        k = kd.load([start_k, 0]).T
        v = vd.load([start_v, 0])
    else:
        k = tl.load(k_ptr + base + (start_k + offs_n)[None, :] * D + offs_d[:, None])
        v = tl.load(v_ptr + base + (start_v + offs_n)[:, None] * D + offs_d[None, :])
    return k, v


@triton.jit
def _softmax(qk, m_i, l_i, scale_log2, mask):
    qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _blocks(q, acc, m_i, l_i, p, alpha, k_ptr, v_ptr, kd, vd, base, lo, hi, offs_m, offs_n, offs_d,
            scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DEFER: tl.constexpr,
            TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        if DEFER:       # V of the previous block (any block before the first: its P is 0), whose
            # P @ V runs during this block's softmax; an address from start_n alone pipelines
            k, v = _kv(k_ptr, v_ptr, kd, vd, base, start_n, tl.maximum(start_n - BLOCK_N, 0), offs_n, offs_d, D,
                       BLOCK_N, TMA)
        else:
            k, v = _kv(k_ptr, v_ptr, kd, vd, base, start_n, start_n, offs_n, offs_d, D, BLOCK_N, TMA)
        qk = tl.dot(q, k)
        if DEFER:
            acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])
        if MASKED:
            mask = offs_m[:, None] >= (start_n + offs_n)[None, :]
        else:
            mask = tl.full([1, 1], 1, tl.int1)
        pf, alpha, l_i, m_i = _softmax(qk, m_i, l_i, scale_log2, mask)
        p = pf.to(p.dtype)      # DEFER=2 carries fp32 P: converted next iteration, it is a register operand
        if not DEFER:
            acc = tl.dot(p, v, acc * alpha[:, None])
    return acc, m_i, l_i, p, alpha


@triton.jit
def fa_fwd(q_ptr, k_ptr, v_ptr, o_ptr, N, scale_log2,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
           CAUSAL: tl.constexpr, DEFER: tl.constexpr, TMA: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    base = bh * N * D
    q = tl.load(q_ptr + base + offs_m[:, None] * D + offs_d[None, :])
    kd = None
    vd = None
    if TMA:
        kd = tl.make_tensor_descriptor(k_ptr + base, [N, D], [D, 1], [BLOCK_N, D])
        vd = tl.make_tensor_descriptor(v_ptr + base, [N, D], [D, 1], [BLOCK_N, D])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # DEFER: the pending block's P (none yet); carried in bf16 it is stored to shared memory for
    # its product, in fp32 (DEFER=2) it stays in registers (twice their number)
    p = tl.zeros([BLOCK_M, BLOCK_N], tl.float32 if DEFER == 2 else q_ptr.dtype.element_ty)
    alpha = tl.full([BLOCK_M], 1.0, tl.float32)
    if CAUSAL:
        full_end = (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N
        hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N)
    else:
        full_end = N
        hi = N
    acc, m_i, l_i, p, alpha = _blocks(q, acc, m_i, l_i, p, alpha, k_ptr, v_ptr, kd, vd, base, 0, full_end, offs_m,
                                      offs_n, offs_d, scale_log2, D, BLOCK_N, False, DEFER, TMA)
    if CAUSAL:
        acc, m_i, l_i, p, alpha = _blocks(q, acc, m_i, l_i, p, alpha, k_ptr, v_ptr, kd, vd, base, full_end, hi,
                                          offs_m, offs_n, offs_d, scale_log2, D, BLOCK_N, True, DEFER, TMA)
    if DEFER:       # the last block's P @ V (its start in closed form: a loop-carried copy of the
        # induction variable stops Triton's pipeliner)
        last = (hi - 1) // BLOCK_N * BLOCK_N
        _, v = _kv(k_ptr, v_ptr, kd, vd, base, last, last, offs_n, offs_d, D, BLOCK_N, TMA)
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])
    o = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty))


def run(q, k, v, cfg, causal, defer, tma):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    bm, bn, w, s = cfg
    # heavy (long-row) causal blocks first is not done here: plain pid order, as generated
    fa_fwd[(N // bm, B * H)](q, k, v, o, N, D ** -0.5 * 1.4426950408889634, BLOCK_M=bm, BLOCK_N=bn, D=D,
                              CAUSAL=causal, DEFER=defer, TMA=tma, num_warps=w, num_stages=s)
    return o


def main():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 x 4096 only")
    args = p.parse_args()
    # device-side descriptors need global scratch (a standalone script: set process-wide)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    # (B, N, D, causal variants)
    shapes = [(4, 4096, 128, (0, 1)), (4, 4096, 64, (0, 1))] + ([] if args.quick else [(1, 16384, 128, (0,))])
    cfgs = {128: [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
            64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]}
    rows = []
    for (B, N, D, causals) in shapes:
        for causal in causals:
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, 16, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
                t_c = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)),
                               warmup=25, rep=100, return_mode="median")
            fl = 4 * B * 16 * N * N * D * ((N + 1) / (2 * N) if causal else 1)
            rows.append((B, N, D, causal, "cudnn", "", t_c, fl / t_c / 1e9, 0.0))
            print(rows[-1], flush=True)
            for cfg in cfgs[D]:
                for defer, tma in [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]:
                    tag = f"defer{defer} tma{tma}"
                    try:
                        o = run(q, k, v, cfg, causal, defer, tma)
                        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                        t = do_bench(lambda: run(q, k, v, cfg, causal, defer, tma), warmup=25, rep=100,
                                     return_mode="median")
                        rows.append((B, N, D, causal, "x".join(map(str, cfg)), tag, t, fl / t / 1e9, err))
                    except Exception as e:  # noqa: BLE001 — a config that does not fit is reported
                        rows.append((B, N, D, causal, "x".join(map(str, cfg)), f"{tag} {type(e).__name__}",
                                     float("nan"), 0, 0))
                    print(rows[-1], flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "hand_forward.csv"), "w") as f:
        f.write("B,N,D,causal,config,variant,ms,tflops,err\n")
        for r in rows:
            f.write(",".join(map(str, r)) + "\n")
    for r in rows:
        print(f"{r[0]}x{r[1]} D{r[2]} c{r[3]} {r[4]:14} {r[5]:30} {r[6]:.3f} ms {r[7]:.0f} TF/s err {r[8]:.1e}")


if __name__ == "__main__":
    main()
