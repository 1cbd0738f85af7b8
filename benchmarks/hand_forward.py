"""A hand-written unmasked forward (FA2 loop, B x H x N x D contiguous, N a multiple of the
blocks) in three forms — the max on scaled scores, the max on raw scores (one FMA per score),
and that plus TMA descriptors for K and V — timed against cuDNN SDPA, to say what the generated
kernel could still gain (docs/notes.md, session 6: TMA gave 8-10% here, but made the generated
kernel slower). Needs a Hopper GPU:

    python -m benchmarks.hand_forward          # table last; CSV to $OUT (default .)
"""
import os

import torch
import triton
import triton.language as tl

@triton.jit
def fa_fwd(q_ptr, k_ptr, v_ptr, o_ptr, N, scale_log2,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
           FMA: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    base = bh * N * D
    q = tl.load(q_ptr + base + offs_m[:, None] * D + offs_d[None, :])
    if TMA:
        kd = tl.make_tensor_descriptor(k_ptr + base, [N, D], [D, 1], [BLOCK_N, D])
        vd = tl.make_tensor_descriptor(v_ptr + base, [N, D], [D, 1], [BLOCK_N, D])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in tl.range(0, N, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            k = kd.load([start_n, 0]).T
            v = vd.load([start_n, 0])
        else:
            k = tl.load(k_ptr + base + offs_n[None, :] * D + offs_d[:, None])
            v = tl.load(v_ptr + base + offs_n[:, None] * D + offs_d[None, :])
        qk = tl.dot(q, k)
        if FMA:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
            p = tl.exp2(qk * scale_log2 - m_new[:, None])
        else:
            t = qk * scale_log2
            m_new = tl.maximum(m_i, tl.max(t, 1))
            p = tl.exp2(t - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * D + offs_d[None, :], o.to(tl.bfloat16))


def run(q, k, v, cfg, FMA, TMA):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    bm, bn, w, s = cfg
    fa_fwd[(N // bm, B * H)](q, k, v, o, N, D ** -0.5 * 1.4426950408889634, BLOCK_M=bm, BLOCK_N=bn, D=D,
                              FMA=FMA, TMA=TMA, STAGES=s, num_warps=w, num_stages=s)
    return o


def main():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    # device-side descriptors need global scratch (a standalone script: set process-wide)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for (B, N, D) in [(4, 4096, 128), (1, 16384, 128), (1, 16384, 64)]:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, 16, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v)
            t_c = do_bench(lambda: F.scaled_dot_product_attention(q, k, v), warmup=25, rep=100)
        fl = 4 * B * 16 * N * N * D
        rows.append((B, N, D, "cudnn", "", t_c, fl / t_c / 1e9, 0.0))
        cfgs = ([(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3)] if D == 128
                else [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)])
        for cfg in cfgs:
            for FMA, TMA in [(0, 0), (1, 0), (1, 1)]:
                try:
                    o = run(q, k, v, cfg, FMA, TMA)
                    err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = do_bench(lambda: run(q, k, v, cfg, FMA, TMA), warmup=25, rep=100)
                    rows.append((B, N, D, cfg, f"fma{FMA} tma{TMA}", t, fl / t / 1e9, err))
                except Exception as e:
                    rows.append((B, N, D, cfg, f"fma{FMA} tma{TMA} ERR {type(e).__name__}: {str(e)[:120]}", float('nan'), 0, 0))
                print(rows[-1], flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "hand_forward.csv"), "w") as f:
        for r in rows:
            f.write(",".join(map(str, r)) + "\n")
    for r in rows:
        print(f"{r[0]}x{r[1]} D{r[2]} {str(r[3]):18} {r[4]:22} {r[5]:.3f} ms {r[6]:.0f} TF/s err {r[7]:.1e}")


if __name__ == "__main__":
    main()
