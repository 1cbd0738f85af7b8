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
def fl_fwd_fd9f9d429004e553(
    in0_ptr,
    in0_s0,
    in0_s1,
    in0_s2,
    in0_s3,
    in1_ptr,
    in1_s0,
    in1_s1,
    in1_s2,
    in1_s3,
    in2_ptr,
    in2_s0,
    in2_s1,
    in2_s2,
    in2_s3,
    out_ptr,
    out_s0,
    out_s1,
    out_s2,
    out_s3,
    rowstats_ptr,
    rowstats_sb,
    rowstats_sm,
    B0,
    B1,
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
    # region batch rank 2, DK=128 DV=128
    #   in0: arg0_1 rank 4 torch.bfloat16
    #   in1: arg1_1 rank 4 torch.bfloat16
    #   in2: arg2_1 rank 4 torch.bfloat16
    #   dot0: q=in0[b0, b1, m, dk]  k=in1[b0, b1, n, dk]
    #   red0 = max_n where(not(le(sub(n, m), 0)), -inf, mul(dot0, 0.12751743082459868)) base2
    #   red1 = sum_n exp2(sub(where(not(le(sub(n, m), 0)), -inf, mul(dot0, 0.12751743082459868)), red0)) online(red0)
    #   red2 = dot_n exp2(sub(where(not(le(sub(n, m), 0)), -inf, mul(dot0, 0.12751743082459868)), red0)) v=in2[b0, b1, n, dv] online(red0)
    #   out = div_safe(red2, red1)
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    b1 = pid_b % B1
    rest1 = pid_b // B1
    b0 = rest1 % B0
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
    # block sparsity: skip key blocks where not(le(sub(n, m), 0))
    blk = tl.arange(0, SCAN_BLOCKS)
    blk_valid = blk < tl.cdiv(N, BLOCK_N)
    n_lo = blk * BLOCK_N
    n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1
    iv1 = n_lo - m_hi
    iv2 = n_hi - m_lo
    iv3 = iv1 <= 0
    iv4 = iv2 > 0
    blk_live = (iv3) & blk_valid
    blk_full = (iv4 == 0) & blk_live & (n_hi - n_lo == BLOCK_N - 1)
    lo5 = tl.min(tl.where(blk_live, blk, SCAN_BLOCKS), 0)
    hi6 = tl.max(tl.where(blk_live, blk, -1), 0) + 1
    ff7 = tl.min(tl.where(blk_full, blk, SCAN_BLOCKS), 0)
    fe8 = tl.min(tl.where((blk_full == 0) & (blk > ff7), blk, SCAN_BLOCKS), 0)
    f9 = tl.minimum(tl.maximum(ff7, lo5), hi6)
    f10 = tl.minimum(tl.maximum(fe8, f9), hi6)
    ld12 = tl.load(in0_ptr + b0 * in0_s0 + b1 * in0_s1 + offs_m[:, None] * in0_s2 + offs_dk[None, :] * in0_s3, mask=mask_dk[None, :] & mask_m[:, None], other=0)
    if TMA:
        desc14 = tl.make_tensor_descriptor(in1_ptr + b0 * in1_s0 + b1 * in1_s1, [N, DK], [in1_s2, 1], [BLOCK_N, BLOCK_DK])
    if TMA:
        desc19 = tl.make_tensor_descriptor(in2_ptr + b0 * in2_s0 + b1 * in2_s1, [N, DV], [in2_s2, 1], [BLOCK_N, BLOCK_DV])
    pend = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    palpha = tl.full([BLOCK_M, 1], 1.0, tl.float32)
    for start_n in range((f9) * BLOCK_N, (f10) * BLOCK_N, BLOCK_N):  # full blocks: no masks
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
        if TMA:
            ld13 = desc14.load([start_n, 0]).T
        else:
            ld13 = tl.load(in1_ptr + b0 * in1_s0 + b1 * in1_s1 + offs_n[None, :] * in1_s2 + offs_dk[:, None] * in1_s3, mask=mask_dk[:, None] & mask_n[None, :], other=0)
        qk0 = tl.dot(ld12, ld13)
        offs_np = tl.maximum(start_n - BLOCK_N, 0) + tl.arange(0, BLOCK_N)
        ldv = tl.load(in2_ptr + b0 * in2_s0 + b1 * in2_s1 + offs_np[:, None] * in2_s2 + offs_dv[None, :] * in2_s3)
        r2 = tl.dot(pend.to(tl.bfloat16), ldv, r2 * palpha)
        r0_new = tl.maximum(r0, tl.max(qk0, 1, keep_dims=True) * 0.12751743082459868)
        r0_safe = tl.where(r0_new == float("-inf"), 0.0, r0_new)  # exp(-inf - 0) = 0, not NaN
        alpha0 = tl.exp2(r0 - r0_safe)  # rescale of sums taken under the old max
        t15 = (qk0 * (0.12751743082459868))
        t16 = (t15 - r0_safe)
        t17 = (tl.exp2(t16))
        r1 = r1 * alpha0 + tl.sum(t17, 1, keep_dims=True)
        pend = t17
        palpha = alpha0
        r0 = r0_new
    i11_head = tl.maximum((f9) - (lo5), 0)  # masked blocks: [lo5, f9), then [f10, hi6)
    for i11 in range(0, i11_head + tl.maximum((hi6) - (f10), 0)):
        start_n = ((lo5) + i11 + tl.where(i11 < i11_head, 0, (f10) - (lo5) - i11_head)) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = tl.full([BLOCK_N], 1, tl.int1) if EVEN_N else offs_n < N
        if TMA:
            ld21 = desc14.load([start_n, 0]).T
        else:
            ld21 = tl.load(in1_ptr + b0 * in1_s0 + b1 * in1_s1 + offs_n[None, :] * in1_s2 + offs_dk[:, None] * in1_s3, mask=mask_dk[:, None] & mask_n[None, :], other=0)
        qk0 = tl.dot(ld12, ld21)
        ip = i11 - 1
        prev = tl.where(i11 == 0, tl.maximum(f10 - 1, 0), (lo5) + ip + tl.where(ip < i11_head, 0, (f10) - (lo5) - i11_head)) * BLOCK_N
        offs_np = prev + tl.arange(0, BLOCK_N)
        ldv = tl.load(in2_ptr + b0 * in2_s0 + b1 * in2_s1 + offs_np[:, None] * in2_s2 + offs_dv[None, :] * in2_s3, mask=mask_dv[None, :] & (offs_np < N)[:, None], other=0)
        r2 = tl.dot(pend.to(tl.bfloat16), ldv, r2 * palpha)
        t22 = (offs_n[None, :] - offs_m[:, None])
        t23 = (t22 <= (0))
        t24 = (t23 == 0)
        t25 = (tl.where(t24, (float("-inf")), qk0))
        r0_new = tl.maximum(r0, tl.max(tl.where(mask_n[None, :], t25, float("-inf")), 1, keep_dims=True) * 0.12751743082459868)
        r0_safe = tl.where(r0_new == float("-inf"), 0.0, r0_new)  # exp(-inf - 0) = 0, not NaN
        alpha0 = tl.exp2(r0 - r0_safe)  # rescale of sums taken under the old max
        t26 = (qk0 * (0.12751743082459868))
        t27 = (tl.where(t24, (float("-inf")), t26))
        t28 = (t27 - r0_safe)
        t29 = (tl.exp2(t28))
        r1 = r1 * alpha0 + tl.sum(tl.where(mask_n[None, :], t29, 0.0), 1, keep_dims=True)
        pend = tl.where(mask_n[None, :], t29, 0.0)
        palpha = alpha0
        r0 = r0_new
    last = tl.where(hi6 > f10, hi6 - 1, tl.where(f9 > lo5, f9 - 1, tl.maximum(f10 - 1, 0))) * BLOCK_N
    offs_np = last + tl.arange(0, BLOCK_N)
    ldv = tl.load(in2_ptr + b0 * in2_s0 + b1 * in2_s1 + offs_np[:, None] * in2_s2 + offs_dv[None, :] * in2_s3, mask=mask_dv[None, :] & (offs_np < N)[:, None], other=0)
    r2 = tl.dot(pend.to(tl.bfloat16), ldv, r2 * palpha)
    r0_s = tl.where(r0 == float("-inf"), 0.0, r0)
    # statistics for the backward (see rowstat_columns); STATS is off when no
    # gradient is needed (flashlight::region_infer)
    if STATS:
        tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm + 0, r0_s, mask=mask_m[:, None])
        tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm + 1, r1, mask=mask_m[:, None])
    t32 = (tl.where(r1 == 0, 0.0, r2 / tl.where(r1 == 0, 1.0, r1)))
    tl.store(out_ptr + b0 * out_s0 + b1 * out_s1 + offs_m[:, None] * out_s2 + offs_dv[None, :] * out_s3, t32.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])
