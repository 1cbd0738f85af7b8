import triton
import triton.language as tl

@triton.jit
def fl_floordiv(a, b):
    # Python floor division for integers of any sign (Triton's // truncates)
    q = a // b
    return q - tl.where((a % b != 0) & ((a < 0) != (b < 0)), 1, 0)


@triton.jit
def fl_mod(a, b):
    # Python remainder: takes the sign of the divisor
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def fl_fwd_snapshot(
    in0_ptr,
    in0_s0,
    in0_s1,
    in0_s2,
    in1_ptr,
    in1_s0,
    in1_s1,
    in1_s2,
    in2_ptr,
    in2_s0,
    in2_s1,
    in2_s2,
    out_ptr,
    out_s0,
    out_s1,
    out_s2,
    rowstats_ptr,
    rowstats_sb,
    rowstats_sm,
    B0,
    M,
    N,
    DK: tl.constexpr,
    DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    TMA: tl.constexpr,
):
    # region batch rank 1, DK=4 DV=4
    #   in0: q rank 3 torch.float32
    #   in1: k rank 3 torch.float32
    #   in2: v rank 3 torch.float32
    #   dot0: q=in0[b0, m, dk]  k=in1[b0, n, dk]
    #   red0 = max_n mul(dot0, 0.7213475204444817) base2
    #   red1 = sum_n exp2(sub(mul(dot0, 0.7213475204444817), red0)) online(red0)
    #   red2 = dot_n exp2(sub(mul(dot0, 0.7213475204444817), red0)) v=in2[b0, n, dv] online(red0)
    #   out = div_safe(red2, red1) torch.float32
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    b0 = pid_b % B0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = tl.full([BLOCK_M], 1, tl.int1) if EVEN_M else offs_m < M
    m_lo = pid_m * BLOCK_M
    m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1
    mask_dk = tl.full([BLOCK_DK], 1, tl.int1) if DK == BLOCK_DK else offs_dk < DK
    mask_dv = tl.full([BLOCK_DV], 1, tl.int1) if DV == BLOCK_DV else offs_dv < DV
    # pass 0: reductions [0, 1, 2] over N
    r0 = tl.full([BLOCK_M, 1], float("-inf"), tl.float32)
    r1 = tl.full([BLOCK_M, 1], 0.0, tl.float32)
    r2 = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    ld2 = tl.load(in0_ptr + b0 * in0_s0 + offs_m[:, None] * in0_s1 + offs_dk[None, :] * in0_s2, mask=mask_dk[None, :] & mask_m[:, None], other=0)
    if TMA:
        desc4 = tl.make_tensor_descriptor(in1_ptr + b0 * in1_s0, [N, DK], [in1_s1, 1], [BLOCK_N, BLOCK_DK])
    if TMA:
        desc9 = tl.make_tensor_descriptor(in2_ptr + b0 * in2_s0, [N, DV], [in2_s1, 1], [BLOCK_N, BLOCK_DV])
    for start_n in range((0) * BLOCK_N, (N // BLOCK_N) * BLOCK_N, BLOCK_N):  # full blocks: no masks
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
        if TMA:
            ld3 = desc4.load([start_n, 0]).T
        else:
            ld3 = tl.load(in1_ptr + b0 * in1_s0 + offs_n[None, :] * in1_s1 + offs_dk[:, None] * in1_s2, mask=mask_dk[:, None] & mask_n[None, :], other=0)
        qk0 = tl.dot(ld2, ld3, input_precision="ieee")
        r0_new = tl.maximum(r0, tl.max(qk0, 1, keep_dims=True) * 0.7213475204444817)
        r0_safe = tl.where(r0_new == float("-inf"), 0.0, r0_new)  # exp(-inf - 0) = 0, not NaN
        alpha0 = tl.exp2(r0 - r0_safe)  # rescale of sums taken under the old max
        t5 = (qk0 * (0.7213475204444817))
        t6 = (t5 - r0_safe)
        t7 = (tl.exp2(t6))
        r1 = r1 * alpha0 + tl.sum(t7, 1, keep_dims=True)
        if TMA:
            ld8 = desc9.load([start_n, 0])
        else:
            ld8 = tl.load(in2_ptr + b0 * in2_s0 + offs_n[:, None] * in2_s1 + offs_dv[None, :] * in2_s2, mask=mask_dv[None, :] & mask_n[:, None], other=0)
        p10 = t7.to(tl.float32)
        r2 = tl.dot(p10, ld8, r2 * alpha0, input_precision="ieee")
        r0 = r0_new
    if not EVEN_N:
        for start_n in range((N // BLOCK_N) * BLOCK_N, (tl.cdiv(N, BLOCK_N)) * BLOCK_N, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = tl.full([BLOCK_N], 1, tl.int1) if EVEN_N else offs_n < N
            if TMA:
                ld12 = desc4.load([start_n, 0]).T
            else:
                ld12 = tl.load(in1_ptr + b0 * in1_s0 + offs_n[None, :] * in1_s1 + offs_dk[:, None] * in1_s2, mask=mask_dk[:, None] & mask_n[None, :], other=0)
            qk0 = tl.dot(ld2, ld12, input_precision="ieee")
            r0_new = tl.maximum(r0, tl.max(tl.where(mask_n[None, :], qk0, float("-inf")), 1, keep_dims=True) * 0.7213475204444817)
            r0_safe = tl.where(r0_new == float("-inf"), 0.0, r0_new)  # exp(-inf - 0) = 0, not NaN
            alpha0 = tl.exp2(r0 - r0_safe)  # rescale of sums taken under the old max
            t13 = (qk0 * (0.7213475204444817))
            t14 = (t13 - r0_safe)
            t15 = (tl.exp2(t14))
            r1 = r1 * alpha0 + tl.sum(tl.where(mask_n[None, :], t15, 0.0), 1, keep_dims=True)
            if TMA:
                ld16 = desc9.load([start_n, 0])
            else:
                ld16 = tl.load(in2_ptr + b0 * in2_s0 + offs_n[:, None] * in2_s1 + offs_dv[None, :] * in2_s2, mask=mask_dv[None, :] & mask_n[:, None], other=0)
            p17 = tl.where(mask_n[None, :], t15, 0.0).to(tl.float32)
            r2 = tl.dot(p17, ld16, r2 * alpha0, input_precision="ieee")
            r0 = r0_new
    r0_s = tl.where(r0 == float("-inf"), 0.0, r0)
    # statistics for the backward (see rowstat_columns); STATS is off when no
    # gradient is needed (flashlight::region_infer)
    if STATS:
        tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm + 0, r0_s, mask=mask_m[:, None])
        tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm + 1, r1, mask=mask_m[:, None])
    t18 = (tl.where(r1 == 0, 0.0, r2 / tl.where(r1 == 0, 1.0, r1)))
    tl.store(out_ptr + b0 * out_s0 + offs_m[:, None] * out_s1 + offs_dv[None, :] * out_s2, t18.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])
