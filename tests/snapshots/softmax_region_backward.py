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
def fl_bwd_snapshot(
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
    g1_ptr,
    g1_s0,
    g1_s1,
    g1_s2,
    g2_ptr,
    g2_s0,
    g2_s1,
    g2_s2,
    rowstats_ptr,
    drow_ptr,
    rowstats_sb,
    rowstats_sm,
    ddot_ptr,
    ddot_sb,
    ddot_sm,
    B0,
    M,
    N,
    DK: tl.constexpr,
    DV: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr,
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
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    b0 = pid_b % B0
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_n = offs_n < N
    mask_dk = offs_dk < DK
    mask_dv = offs_dv < DV
    n_lo = start_n
    n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1
    blk = pid_n       # this program's key block, for the sparsity scan
    blk_valid = n_lo < N
    dk0 = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv0 = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo1 = 0
    f3 = 0
    f4 = tl.where((n_hi - n_lo == BLOCK_N - 1), M // BLOCK_M, 0)
    hi2 = tl.cdiv(M, BLOCK_M)
    if TMA:
        desc7 = tl.make_tensor_descriptor(in0_ptr + b0 * in0_s0, [M, DK], [in0_s1, 1], [BLOCK_M, BLOCK_DK])
    ld8 = tl.load(in1_ptr + b0 * in1_s0 + offs_n[:, None] * in1_s1 + offs_dk[None, :] * in1_s2, mask=mask_dk[None, :] & mask_n[:, None], other=0)
    ld9 = tl.load(in2_ptr + b0 * in2_s0 + offs_n[:, None] * in2_s1 + offs_dv[None, :] * in2_s2, mask=mask_dv[None, :] & mask_n[:, None], other=0)
    for start_m in range((f3) * BLOCK_M, (f4) * BLOCK_M, BLOCK_M):  # full blocks: no masks
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = tl.full([BLOCK_M], 1, tl.int1)
        # the forward's softmax shifts, and dL/d(reduction) from the output expression
        r0_s = tl.load(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 0, mask=mask_m, other=0.0)[None, :]
        dr1 = tl.load(drow_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 1, mask=mask_m, other=0.0)[None, :]
        dr2 = tl.load(ddot_ptr + pid_b * ddot_sb + offs_m[:, None] * ddot_sm + 0 + offs_dv[None, :], mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
        mask_mn = tl.full([BLOCK_N, BLOCK_M], 1, tl.int1)
        # recompute the score tiles
        if TMA:
            ld6 = desc7.load([start_m, 0]).T
        else:
            ld6 = tl.load(in0_ptr + b0 * in0_s0 + offs_m[None, :] * in0_s1 + offs_dk[:, None] * in0_s2, mask=mask_dk[:, None] & mask_m[None, :], other=0)
        qk0 = tl.dot(ld8, ld6, input_precision="ieee")
        # d body: dR (sum) or dR @ V^T (P @ V), and dV += body^T @ dR
        db1 = tl.where(mask_mn, dr1, 0.0)
        dp2 = tl.dot(ld9, tl.trans(dr2), input_precision="ieee")
        db2 = tl.where(mask_mn, dp2, 0.0)
        t10 = (qk0 * (0.7213475204444817))
        t11 = (t10 - r0_s)
        t12 = (tl.exp2(t11))
        p2 = tl.where(mask_mn, t12, 0.0)
        dv0 = tl.dot(p2, dr2, dv0, input_precision="ieee")
        # reverse through the bodies: loaded biases and tables, then dS -> dK
        t13 = (db1 + db2)
        t14 = (t13 * t12)
        ds0 = tl.where(mask_mn, tl.broadcast_to(t14, [BLOCK_N, BLOCK_M]), 0.0)
        dk0 = tl.dot(ds0, tl.trans(ld6), dk0, input_precision="ieee")
    i5_head = tl.maximum((f3) - (lo1), 0)  # masked blocks: [lo1, f3), then [f4, hi2)
    for i5 in range(0, i5_head + tl.maximum((hi2) - (f4), 0)):
        start_m = ((lo1) + i5 + tl.where(i5 < i5_head, 0, (f4) - (lo1) - i5_head)) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        # the forward's softmax shifts, and dL/d(reduction) from the output expression
        r0_s = tl.load(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 0, mask=mask_m, other=0.0)[None, :]
        dr1 = tl.load(drow_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 1, mask=mask_m, other=0.0)[None, :]
        dr2 = tl.load(ddot_ptr + pid_b * ddot_sb + offs_m[:, None] * ddot_sm + 0 + offs_dv[None, :], mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
        mask_mn = mask_n[:, None] & mask_m[None, :]  # of the [N, M] tile
        # recompute the score tiles
        if TMA:
            ld15 = desc7.load([start_m, 0]).T
        else:
            ld15 = tl.load(in0_ptr + b0 * in0_s0 + offs_m[None, :] * in0_s1 + offs_dk[:, None] * in0_s2, mask=mask_dk[:, None] & mask_m[None, :], other=0)
        qk0 = tl.dot(ld8, ld15, input_precision="ieee")
        # d body: dR (sum) or dR @ V^T (P @ V), and dV += body^T @ dR
        db1 = tl.where(mask_mn, dr1, 0.0)
        dp2 = tl.dot(ld9, tl.trans(dr2), input_precision="ieee")
        db2 = tl.where(mask_mn, dp2, 0.0)
        t16 = (qk0 * (0.7213475204444817))
        t17 = (t16 - r0_s)
        t18 = (tl.exp2(t17))
        p2 = tl.where(mask_mn, t18, 0.0)
        dv0 = tl.dot(p2, dr2, dv0, input_precision="ieee")
        # reverse through the bodies: loaded biases and tables, then dS -> dK
        t19 = (db1 + db2)
        t20 = (t19 * t18)
        ds0 = tl.where(mask_mn, tl.broadcast_to(t20, [BLOCK_N, BLOCK_M]), 0.0)
        dk0 = tl.dot(ds0, tl.trans(ld15), dk0, input_precision="ieee")
    # gradients of the K and V operands, accumulated over all query blocks
    dk0 = dk0 * 0.5
    tl.store(g1_ptr + b0 * g1_s0 + offs_n[:, None] * g1_s1 + offs_dk[None, :] * g1_s2, tl.broadcast_to(dk0, [BLOCK_N, BLOCK_DK]).to(g1_ptr.dtype.element_ty), mask=mask_dk[None, :] & mask_n[:, None])
    tl.store(g2_ptr + b0 * g2_s0 + offs_n[:, None] * g2_s1 + offs_dv[None, :] * g2_s2, tl.broadcast_to(dv0, [BLOCK_N, BLOCK_DV]).to(g2_ptr.dtype.element_ty), mask=mask_dv[None, :] & mask_n[:, None])


@triton.jit
def fl_bwd_snapshot_dq(
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
    g0_ptr,
    g0_s0,
    g0_s1,
    g0_s2,
    rowstats_ptr,
    drow_ptr,
    rowstats_sb,
    rowstats_sm,
    ddot_ptr,
    ddot_sb,
    ddot_sm,
    B0,
    M,
    N,
    DK: tl.constexpr,
    DV: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr,
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
    # the forward's softmax shifts, and dL/d(reduction) from the output expression
    r0_s = tl.load(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 0, mask=mask_m, other=0.0)[:, None]
    dr1 = tl.load(drow_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 1, mask=mask_m, other=0.0)[:, None]
    dr2 = tl.load(ddot_ptr + pid_b * ddot_sb + offs_m[:, None] * ddot_sm + 0 + offs_dv[None, :], mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
    dq0 = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)
    ld2 = tl.load(in0_ptr + b0 * in0_s0 + offs_m[:, None] * in0_s1 + offs_dk[None, :] * in0_s2, mask=mask_dk[None, :] & mask_m[:, None], other=0)
    if TMA:
        desc4 = tl.make_tensor_descriptor(in1_ptr + b0 * in1_s0, [N, DK], [in1_s1, 1], [BLOCK_N, BLOCK_DK])
    if TMA:
        desc6 = tl.make_tensor_descriptor(in2_ptr + b0 * in2_s0, [N, DV], [in2_s1, 1], [BLOCK_N, BLOCK_DV])
    for start_n in range((0) * BLOCK_N, (N // BLOCK_N) * BLOCK_N, BLOCK_N):  # full blocks: no masks
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
        mask_mn = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)
        # recompute the score tiles
        if TMA:
            ld3 = desc4.load([start_n, 0]).T
        else:
            ld3 = tl.load(in1_ptr + b0 * in1_s0 + offs_n[None, :] * in1_s1 + offs_dk[:, None] * in1_s2, mask=mask_dk[:, None] & mask_n[None, :], other=0)
        qk0 = tl.dot(ld2, ld3, input_precision="ieee")
        # d body: dR (sum) or dR @ V^T (P @ V)
        db1 = tl.where(mask_mn, dr1, 0.0)
        if TMA:
            ld5 = desc6.load([start_n, 0])
        else:
            ld5 = tl.load(in2_ptr + b0 * in2_s0 + offs_n[:, None] * in2_s1 + offs_dv[None, :] * in2_s2, mask=mask_dv[None, :] & mask_n[:, None], other=0)
        dp2 = tl.dot(dr2, tl.trans(ld5), input_precision="ieee")
        db2 = tl.where(mask_mn, dp2, 0.0)
        # reverse through the bodies: dS -> dQ
        t7 = (db1 + db2)
        t8 = (qk0 * (0.7213475204444817))
        t9 = (t8 - r0_s)
        t10 = (tl.exp2(t9))
        t11 = (t7 * t10)
        ds0 = tl.where(mask_mn, tl.broadcast_to(t11, [BLOCK_M, BLOCK_N]), 0.0)
        dq0 = tl.dot(ds0, tl.trans(ld3), dq0, input_precision="ieee")
    if not EVEN_N:
        for start_n in range((N // BLOCK_N) * BLOCK_N, (tl.cdiv(N, BLOCK_N)) * BLOCK_N, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = tl.full([BLOCK_N], 1, tl.int1) if EVEN_N else offs_n < N
            mask_mn = mask_m[:, None] & mask_n[None, :]
            # recompute the score tiles
            if TMA:
                ld13 = desc4.load([start_n, 0]).T
            else:
                ld13 = tl.load(in1_ptr + b0 * in1_s0 + offs_n[None, :] * in1_s1 + offs_dk[:, None] * in1_s2, mask=mask_dk[:, None] & mask_n[None, :], other=0)
            qk0 = tl.dot(ld2, ld13, input_precision="ieee")
            # d body: dR (sum) or dR @ V^T (P @ V)
            db1 = tl.where(mask_mn, dr1, 0.0)
            if TMA:
                ld14 = desc6.load([start_n, 0])
            else:
                ld14 = tl.load(in2_ptr + b0 * in2_s0 + offs_n[:, None] * in2_s1 + offs_dv[None, :] * in2_s2, mask=mask_dv[None, :] & mask_n[:, None], other=0)
            dp2 = tl.dot(dr2, tl.trans(ld14), input_precision="ieee")
            db2 = tl.where(mask_mn, dp2, 0.0)
            # reverse through the bodies: dS -> dQ
            t15 = (db1 + db2)
            t16 = (qk0 * (0.7213475204444817))
            t17 = (t16 - r0_s)
            t18 = (tl.exp2(t17))
            t19 = (t15 * t18)
            ds0 = tl.where(mask_mn, tl.broadcast_to(t19, [BLOCK_M, BLOCK_N]), 0.0)
            dq0 = tl.dot(ds0, tl.trans(ld13), dq0, input_precision="ieee")
    # gradients of the Q operands, accumulated over all key blocks
    dq0 = dq0 * 0.5
    tl.store(g0_ptr + b0 * g0_s0 + offs_m[:, None] * g0_s1 + offs_dk[None, :] * g0_s2, tl.broadcast_to(dq0, [BLOCK_M, BLOCK_DK]).to(g0_ptr.dtype.element_ty), mask=mask_dk[None, :] & mask_m[:, None])


@triton.jit
def fl_bwd_snapshot_rows(
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
    dout_ptr,
    dout_s0,
    dout_s1,
    dout_s2,
    rowstats_ptr,
    drow_ptr,
    rowstats_sb,
    rowstats_sm,
    ddot_ptr,
    ddot_sb,
    ddot_sm,
    B0,
    M,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    b0 = pid_b % B0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < M
    mask_dv = offs_dv < DV
    mask_o = mask_m[:, None] & mask_dv[None, :]
    row = pid_b * rowstats_sb + offs_m[:, None] * rowstats_sm
    do = tl.load(dout_ptr + b0 * dout_s0 + offs_m[:, None] * dout_s1 + offs_dv[None, :] * dout_s2, mask=mask_o, other=0.0).to(tl.float32)
    r1 = tl.load(rowstats_ptr + row + 1, mask=mask_m[:, None], other=0.0)
    r2 = tl.load(out_ptr + b0 * out_s0 + offs_m[:, None] * out_s1 + offs_dv[None, :] * out_s2, mask=mask_o, other=0.0).to(tl.float32) * r1
    t1 = (tl.where(r1 == 0, 0.0, r2 / tl.where(r1 == 0, 1.0, r1)))
    t2 = (do * t1)
    t3 = (tl.where(r1 == 0, 0.0, t2 / tl.where(r1 == 0, 1.0, r1)))
    t4 = (-t3)
    dr1 = tl.sum(tl.where(mask_o, tl.broadcast_to(t4, [BLOCK_M, BLOCK_DV]), 0.0), 1, keep_dims=True)
    tl.store(drow_ptr + row + 1, dr1, mask=mask_m[:, None])
    t5 = (tl.where(r1 == 0, 0.0, do / tl.where(r1 == 0, 1.0, r1)))
    tl.store(ddot_ptr + pid_b * ddot_sb + offs_m[:, None] * ddot_sm + 0 + offs_dv[None, :], tl.where(mask_o, tl.broadcast_to(t5, [BLOCK_M, BLOCK_DV]), 0.0).to(ddot_ptr.dtype.element_ty), mask=mask_o)
