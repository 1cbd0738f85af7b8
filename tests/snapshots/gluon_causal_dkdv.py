import triton
from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashlight.codegen import gluon_tl as tl

@gluon.jit
def fl_floordiv(a, b):
    # Python floor division for integers of any sign (Triton's // truncates)
    q = a // b
    return q - tl.where((a % b != 0) & ((a < 0) != (b < 0)), 1, 0)


@gluon.jit
def fl_mod(a, b):
    # Python remainder: takes the sign of the divisor
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@gluon.jit
def k_loader(a_desc, b_desc, x_desc, y_desc, a_smem, b_smem, x_smem, y_smem, own_bar, a_ready, a_empty,
                  b_ready, b_empty, a_row, b_row, x_row, y_row, lo, f0, f1, hi):
    # this program's own tiles x and y once (dK/dV: K, V; dQ: Q, dR), then a and b (dK/dV: Q, dR;
    # dQ: K, V) of every live block through a ring of STAGES buffers, in the compute warpgroups'
    # order: masked [lo, f0) and [f1, hi), then [f0, f1)
    STAGES: tl.constexpr = a_smem.type.shape[0]
    BLOCK: tl.constexpr = a_smem.type.shape[1]
    mbarrier.expect(own_bar, x_desc.block_type.nbytes + y_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [x_row, 0], own_bar, x_smem)
    tma.async_copy_global_to_shared(y_desc, [y_row, 0], own_bar, y_smem)
    n_head = f0 - lo
    n_mask = n_head + hi - f1
    for i in range(hi - lo):
        j = tl.where(i < n_head, lo + i, tl.where(i < n_mask, f1 + i - n_head, f0 + i - n_mask))
        s = i % STAGES
        ph = (i // STAGES) & 1
        r0 = j * BLOCK
        # an empty barrier starts with its phase 1 complete: the first STAGES waits pass
        mbarrier.wait(a_empty.index(s), ph ^ 1)
        mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [a_row + r0, 0], a_ready.index(s), a_smem.index(s))
        mbarrier.wait(b_empty.index(s), ph ^ 1)
        mbarrier.expect(b_ready.index(s), b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [b_row + r0, 0], b_ready.index(s), b_smem.index(s))


@gluon.jit
def k_compute(W: tl.constexpr, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g1_ptr, g1_s0, g1_s1, g1_s2, g1_s3, g2_ptr, g2_s0, g2_s1, g2_s2, g2_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_n, pid_b, b0, b1, lo, f0, f1, hi, q_smem, do_smem, k_smem, v_smem, own_bar, q_ready, q_empty, do_ready, do_empty):
    rowstats_sm = 2
    STAGES: tl.constexpr = q_smem.type.shape[0]
    BLOCK_M: tl.constexpr = q_smem.type.shape[1]
    DK: tl.constexpr = q_smem.type.shape[2]
    DV: tl.constexpr = do_smem.type.shape[2]
    S_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    DK_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DK, 16])
    DV_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    PT_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DV_LAYOUT, k_width=2)
    DST_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DK_LAYOUT, k_width=2)
    start_n = pid_n * 128 + W * 64  # this warpgroup's keys
    offs_n = start_n + tl.arange(0, 64, layout=tl.SliceLayout(1, S_LAYOUT))
    k = k_smem.slice(W * 64, 64)
    v = v_smem.slice(W * 64, 64)
    zero_s = tl.zeros([64, BLOCK_M], tl.float32, S_LAYOUT)
    dk0 = tl.zeros([64, DK], tl.float32, DK_LAYOUT)
    dv0 = tl.zeros([64, DV], tl.float32, DV_LAYOUT)
    mbarrier.wait(own_bar, 0)
    # the masked blocks [lo, f0) and [f1, hi) first, then the mask-free run [f0, f1): the loader's order
    n_head = f0 - lo
    n_mask = n_head + hi - f1
    for i in range(0, n_mask):
        j = tl.where(i < n_head, lo + i, f1 + i - n_head)
        st = i % STAGES
        ph = (i // STAGES) & 1
        start_m = j * BLOCK_M
        mbarrier.wait(q_ready.index(st), ph)
        q = q_smem.index(st)
        qk0 = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # S^T = K Q^T
        mbarrier.wait(do_ready.index(st), ph)
        do = do_smem.index(st)
        dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # dP^T = V dR^T
        offs_m = start_m + tl.arange(0, BLOCK_M, layout=tl.SliceLayout(0, S_LAYOUT))
        r0_s = tl.load(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 0)[None, :]
        dr1 = tl.load(drow_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 1)[None, :]
        qk0 = warpgroup_mma_wait(1, deps=(qk0, ))  # S^T done, dP^T in flight
        t16 = (offs_n[:, None] - offs_m[None, :])
        t17 = (t16 <= (0))
        t18 = (t17 == 0)
        t19 = (qk0 * (0.12751743082459868))
        t20 = (tl.where(t18, (float("-inf")), t19))
        t21 = (t20 - r0_s)
        t22 = (tl.exp2(t21))
        p = t22
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        db1 = dr1
        db2 = dp
        t23 = (db1 + db2)
        t24 = (t23 * t22)
        t25 = (tl.where(t18, (0.0), t24))
        ds = t25
        pb = tl.convert_layout(p.to(do_smem.dtype), PT_LAYOUT)
        dsb = tl.convert_layout(ds.to(q_smem.dtype), DST_LAYOUT)
        dv0 = warpgroup_mma(pb, do, dv0, is_async=True)  # dV += P^T dR
        dk0 = warpgroup_mma(dsb, q, dk0, is_async=True)  # dK += dS^T Q
        dv0, dk0, pb, dsb = warpgroup_mma_wait(0, deps=(dv0, dk0, pb, dsb))
        mbarrier.arrive(q_empty.index(st), count=1)
        mbarrier.arrive(do_empty.index(st), count=1)
    for i in range(n_mask, hi - lo):
        j = f0 + i - n_mask
        st = i % STAGES
        ph = (i // STAGES) & 1
        start_m = j * BLOCK_M
        mbarrier.wait(q_ready.index(st), ph)
        q = q_smem.index(st)
        qk0 = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # S^T = K Q^T
        mbarrier.wait(do_ready.index(st), ph)
        do = do_smem.index(st)
        dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # dP^T = V dR^T
        offs_m = start_m + tl.arange(0, BLOCK_M, layout=tl.SliceLayout(0, S_LAYOUT))
        r0_s = tl.load(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 0)[None, :]
        dr1 = tl.load(drow_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 1)[None, :]
        qk0 = warpgroup_mma_wait(1, deps=(qk0, ))  # S^T done, dP^T in flight
        t11 = (qk0 * (0.12751743082459868))
        t12 = (t11 - r0_s)
        t13 = (tl.exp2(t12))
        p = t13
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        db1 = dr1
        db2 = dp
        t14 = (db1 + db2)
        t15 = (t14 * t13)
        ds = t15
        pb = tl.convert_layout(p.to(do_smem.dtype), PT_LAYOUT)
        dsb = tl.convert_layout(ds.to(q_smem.dtype), DST_LAYOUT)
        dv0 = warpgroup_mma(pb, do, dv0, is_async=True)  # dV += P^T dR
        dk0 = warpgroup_mma(dsb, q, dk0, is_async=True)  # dK += dS^T Q
        dv0, dk0, pb, dsb = warpgroup_mma_wait(0, deps=(dv0, dk0, pb, dsb))
        mbarrier.arrive(q_empty.index(st), count=1)
        mbarrier.arrive(do_empty.index(st), count=1)
    g1_s3 = 1
    g1_ptr = tl.multiple_of(g1_ptr, 16)
    g1_s0 = tl.multiple_of(g1_s0, 8)
    g1_s1 = tl.multiple_of(g1_s1, 8)
    g1_s2 = tl.multiple_of(g1_s2, 8)
    g2_s3 = 1
    g2_ptr = tl.multiple_of(g2_ptr, 16)
    g2_s0 = tl.multiple_of(g2_s0, 8)
    g2_s1 = tl.multiple_of(g2_s1, 8)
    g2_s2 = tl.multiple_of(g2_s2, 8)
    dk0_r = start_n + tl.arange(0, 64, layout=tl.SliceLayout(1, DK_LAYOUT))
    dk0_d = tl.arange(0, DK, layout=tl.SliceLayout(0, DK_LAYOUT))
    tl.store(g1_ptr + b0 * g1_s0 + b1 * g1_s1 + dk0_r[:, None] * g1_s2 + dk0_d[None, :] * g1_s3, (dk0 * 0.08838834764831843).to(g1_ptr.dtype.element_ty))
    dv0_r = start_n + tl.arange(0, 64, layout=tl.SliceLayout(1, DV_LAYOUT))
    dv0_d = tl.arange(0, DV, layout=tl.SliceLayout(0, DV_LAYOUT))
    tl.store(g2_ptr + b0 * g2_s0 + b1 * g2_s1 + dv0_r[:, None] * g2_s2 + dv0_d[None, :] * g2_s3, (dv0).to(g2_ptr.dtype.element_ty))


@gluon.jit
def k_compute0(in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g1_ptr, g1_s0, g1_s1, g1_s2, g1_s3, g2_ptr, g2_s0, g2_s1, g2_s2, g2_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_n, pid_b, b0, b1, lo, f0, f1, hi, q_smem, do_smem, k_smem, v_smem, own_bar, q_ready, q_empty, do_ready, do_empty):
    k_compute(0, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g1_ptr, g1_s0, g1_s1, g1_s2, g1_s3, g2_ptr, g2_s0, g2_s1, g2_s2, g2_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_n, pid_b, b0, b1, lo, f0, f1, hi, q_smem, do_smem, k_smem, v_smem, own_bar, q_ready, q_empty, do_ready, do_empty)


@gluon.jit
def k_compute1(in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g1_ptr, g1_s0, g1_s1, g1_s2, g1_s3, g2_ptr, g2_s0, g2_s1, g2_s2, g2_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_n, pid_b, b0, b1, lo, f0, f1, hi, q_smem, do_smem, k_smem, v_smem, own_bar, q_ready, q_empty, do_ready, do_empty):
    k_compute(1, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g1_ptr, g1_s0, g1_s1, g1_s2, g1_s3, g2_ptr, g2_s0, g2_s1, g2_s2, g2_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_n, pid_b, b0, b1, lo, f0, f1, hi, q_smem, do_smem, k_smem, v_smem, own_bar, q_ready, q_empty, do_ready, do_empty)


@gluon.jit
def k(
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
    g1_ptr,
    g1_s0,
    g1_s1,
    g1_s2,
    g1_s3,
    g2_ptr,
    g2_s0,
    g2_s1,
    g2_s2,
    g2_s3,
    rowstats_ptr,
    drow_ptr,
    rowstats_sb,
    rowstats_sm,
    ddot_ptr,
    ddot_sb,
    ddot_sm,
    B0,
    B1,
    M,
    N,
    DK: tl.constexpr,
    DV: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    STAGES: tl.constexpr,
):
    # region batch rank 2, DK=128 DV=128
    #   in0: arg0_1 rank 4 torch.bfloat16
    #   in1: arg1_1 rank 4 torch.bfloat16
    #   in2: arg2_1 rank 4 torch.bfloat16
    #   dot0: q=in0[b0, b1, m, dk]  k=in1[b0, b1, n, dk]
    #   red0 = max_n where(not(le(sub(n, m), 0)), -inf, mul(dot0, 0.12751743082459868)) base2
    #   red1 = sum_n exp2(sub(where(not(le(sub(n, m), 0)), -inf, mul(dot0, 0.12751743082459868)), red0)) online(red0)
    #   red2 = dot_n exp2(sub(where(not(le(sub(n, m), 0)), -inf, mul(dot0, 0.12751743082459868)), red0)) v=in2[b0, b1, n, dv] online(red0)
    #   out = div_safe(red2, red1) torch.bfloat16
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    b1 = pid_b % B1
    rest1 = pid_b // B1
    b0 = rest1 % B0
    n_lo = pid_n * BLOCK_N
    n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1
    blk = pid_n       # this program's key block, for the sparsity scan
    blk_valid = n_lo < N
    SCAN2: tl.constexpr = tl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    SCAN_ROWS: tl.constexpr = tl.SliceLayout(1, SCAN2)
    SCAN_COLS: tl.constexpr = tl.SliceLayout(0, SCAN2)
    # block sparsity: visit only query blocks where not not(le(sub(n, m), 0))
    pid_m = tl.arange(0, SCAN_BLOCKS, layout=SCAN_ROWS)     # every query block, as a vector
    mblk_valid = pid_m < tl.cdiv(M, BLOCK_M)
    m_lo = pid_m * BLOCK_M
    m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1
    iv5 = n_lo - m_hi
    iv6 = n_hi - m_lo
    iv7 = iv5 <= 0
    iv8 = iv6 > 0
    mblk_live = (iv7) & mblk_valid & blk_valid
    mblk_full = (iv8 == 0) & mblk_live & (m_hi - m_lo == BLOCK_M - 1) & (n_hi - n_lo == BLOCK_N - 1)
    lo1 = tl.min(tl.where(mblk_live, pid_m, SCAN_BLOCKS), 0)
    hi2 = tl.max(tl.where(mblk_live, pid_m, -1), 0) + 1
    ff9 = tl.min(tl.where(mblk_full, pid_m, SCAN_BLOCKS), 0)
    fe10 = tl.min(tl.where((mblk_full == 0) & (pid_m > ff9), pid_m, SCAN_BLOCKS), 0)
    f3 = tl.minimum(tl.maximum(ff9, lo1), hi2)
    f4 = tl.minimum(tl.maximum(fe10, f3), hi2)
    q_row = ((b0 * in0_s0 + b1 * in0_s1) // in0_s2).to(tl.int32)
    do_row = (pid_b * (ddot_sb // ddot_sm)).to(tl.int32)  # dR: our own [batch * M, DV] rows
    k_row = ((b0 * in1_s0 + b1 * in1_s1) // in1_s2).to(tl.int32) + n_lo.to(tl.int32)
    v_row = ((b0 * in2_s0 + b1 * in2_s1) // in2_s2).to(tl.int32) + n_lo.to(tl.int32)
    lo = lo1
    hi = tl.maximum(hi2, lo)
    f0 = tl.minimum(tl.maximum(f3, lo), hi)
    f1 = tl.minimum(tl.maximum(f4, f0), hi)
    q_smem = tl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, DK], q_desc.layout)
    do_smem = tl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, DV], do_desc.layout)
    k_smem = tl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, DK], k_desc.layout)
    v_smem = tl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, DV], v_desc.layout)
    own_bar = tl.allocate_shared_memory(tl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(own_bar, count=1)
    for i in tl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both compute warpgroups release a buffer
        mbarrier.init(do_empty.index(i), count=2)
    compute_args = (in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g1_ptr, g1_s0, g1_s1, g1_s2, g1_s3, g2_ptr, g2_s0, g2_s1, g2_s2, g2_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_n, pid_b, b0, b1, lo, f0, f1, hi, q_smem, do_smem, k_smem, v_smem, own_bar, q_ready, q_empty, do_ready, do_empty)
    tl.warp_specialize([
        (k_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, own_bar, q_ready, q_empty, do_ready, do_empty, q_row, do_row, k_row, v_row, lo, f0, f1, hi)),
        (k_compute0, compute_args),
        (k_compute1, compute_args),
    ], [4, 4], [240, 240])
