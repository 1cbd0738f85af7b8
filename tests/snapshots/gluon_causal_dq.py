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
def k_compute(W: tl.constexpr, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g0_ptr, g0_s0, g0_s1, g0_s2, g0_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, f0, f1, hi, k_smem, v_smem, q_smem, do_smem, own_bar, k_ready, k_empty, v_ready, v_empty):
    rowstats_sm = 2
    STAGES: tl.constexpr = k_smem.type.shape[0]
    BLOCK_N: tl.constexpr = k_smem.type.shape[1]
    DK: tl.constexpr = k_smem.type.shape[2]
    S_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    DQ_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DK, 16])
    DS_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=DQ_LAYOUT, k_width=2)
    start_m = pid_m * 128 + W * 64  # this warpgroup's queries
    offs_m = start_m + tl.arange(0, 64, layout=tl.SliceLayout(1, S_LAYOUT))
    q = q_smem.slice(W * 64, 64)
    do = do_smem.slice(W * 64, 64)
    zero_s = tl.zeros([64, BLOCK_N], tl.float32, S_LAYOUT)
    dq0 = tl.zeros([64, DK], tl.float32, DQ_LAYOUT)
    # this warpgroup's row statistics, once
    r0_s = tl.load(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 0)[:, None]
    dr1 = tl.load(drow_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 1)[:, None]
    mbarrier.wait(own_bar, 0)
    # the masked blocks [lo, f0) and [f1, hi) first, then the mask-free run [f0, f1): the loader's order
    n_head = f0 - lo
    n_mask = n_head + hi - f1
    for i in range(0, n_mask):
        j = tl.where(i < n_head, lo + i, f1 + i - n_head)
        st = i % STAGES
        ph = (i // STAGES) & 1
        start_n = j * BLOCK_N
        mbarrier.wait(k_ready.index(st), ph)
        kb = k_smem.index(st)
        qk0 = warpgroup_mma(q, kb.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # S = Q K^T
        mbarrier.wait(v_ready.index(st), ph)
        dp = warpgroup_mma(do, v_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)  # dP = dR V^T
        offs_n = start_n + tl.arange(0, BLOCK_N, layout=tl.SliceLayout(0, S_LAYOUT))
        qk0 = warpgroup_mma_wait(1, deps=(qk0, ))  # S done, dP in flight
        t16 = (offs_n[None, :] - offs_m[:, None])
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
        mbarrier.arrive(v_empty.index(st), count=1)
        dsb = tl.convert_layout(ds.to(k_smem.dtype), DS_LAYOUT)
        dq0 = warpgroup_mma(dsb, kb, dq0, is_async=True)  # dQ += dS K
        dq0, dsb = warpgroup_mma_wait(0, deps=(dq0, dsb))
        mbarrier.arrive(k_empty.index(st), count=1)
    for i in range(n_mask, hi - lo):
        j = f0 + i - n_mask
        st = i % STAGES
        ph = (i // STAGES) & 1
        start_n = j * BLOCK_N
        mbarrier.wait(k_ready.index(st), ph)
        kb = k_smem.index(st)
        qk0 = warpgroup_mma(q, kb.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # S = Q K^T
        mbarrier.wait(v_ready.index(st), ph)
        dp = warpgroup_mma(do, v_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)  # dP = dR V^T
        offs_n = start_n + tl.arange(0, BLOCK_N, layout=tl.SliceLayout(0, S_LAYOUT))
        qk0 = warpgroup_mma_wait(1, deps=(qk0, ))  # S done, dP in flight
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
        mbarrier.arrive(v_empty.index(st), count=1)
        dsb = tl.convert_layout(ds.to(k_smem.dtype), DS_LAYOUT)
        dq0 = warpgroup_mma(dsb, kb, dq0, is_async=True)  # dQ += dS K
        dq0, dsb = warpgroup_mma_wait(0, deps=(dq0, dsb))
        mbarrier.arrive(k_empty.index(st), count=1)
    g0_s3 = 1
    g0_ptr = tl.multiple_of(g0_ptr, 16)
    g0_s0 = tl.multiple_of(g0_s0, 8)
    g0_s1 = tl.multiple_of(g0_s1, 8)
    g0_s2 = tl.multiple_of(g0_s2, 8)
    dq0_r = start_m + tl.arange(0, 64, layout=tl.SliceLayout(1, DQ_LAYOUT))
    dq0_d = tl.arange(0, DK, layout=tl.SliceLayout(0, DQ_LAYOUT))
    tl.store(g0_ptr + b0 * g0_s0 + b1 * g0_s1 + dq0_r[:, None] * g0_s2 + dq0_d[None, :] * g0_s3, (dq0 * 0.08838834764831843).to(g0_ptr.dtype.element_ty))


@gluon.jit
def k_compute0(in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g0_ptr, g0_s0, g0_s1, g0_s2, g0_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, f0, f1, hi, k_smem, v_smem, q_smem, do_smem, own_bar, k_ready, k_empty, v_ready, v_empty):
    k_compute(0, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g0_ptr, g0_s0, g0_s1, g0_s2, g0_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, f0, f1, hi, k_smem, v_smem, q_smem, do_smem, own_bar, k_ready, k_empty, v_ready, v_empty)


@gluon.jit
def k_compute1(in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g0_ptr, g0_s0, g0_s1, g0_s2, g0_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, f0, f1, hi, k_smem, v_smem, q_smem, do_smem, own_bar, k_ready, k_empty, v_ready, v_empty):
    k_compute(1, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g0_ptr, g0_s0, g0_s1, g0_s2, g0_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, f0, f1, hi, k_smem, v_smem, q_smem, do_smem, own_bar, k_ready, k_empty, v_ready, v_empty)


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
    g0_ptr,
    g0_s0,
    g0_s1,
    g0_s2,
    g0_s3,
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
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    b1 = pid_b % B1
    rest1 = pid_b // B1
    b0 = rest1 % B0
    m_lo = pid_m * BLOCK_M
    m_hi = tl.minimum(m_lo + BLOCK_M, M) - 1
    SCAN2: tl.constexpr = tl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    SCAN_ROWS: tl.constexpr = tl.SliceLayout(1, SCAN2)
    SCAN_COLS: tl.constexpr = tl.SliceLayout(0, SCAN2)
    # block sparsity: skip key blocks where not(le(sub(n, m), 0))
    blk = tl.arange(0, SCAN_BLOCKS, layout=SCAN_ROWS)
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
    q_row = ((b0 * in0_s0 + b1 * in0_s1) // in0_s2).to(tl.int32) + m_lo.to(tl.int32)
    do_row = (pid_b * (ddot_sb // ddot_sm) + m_lo).to(tl.int32)  # dR: our own [batch * M, DV] rows
    k_row = ((b0 * in1_s0 + b1 * in1_s1) // in1_s2).to(tl.int32)
    v_row = ((b0 * in2_s0 + b1 * in2_s1) // in2_s2).to(tl.int32)
    lo = lo5
    hi = tl.maximum(hi6, lo)
    f0 = tl.minimum(tl.maximum(f9, lo), hi)
    f1 = tl.minimum(tl.maximum(f10, f0), hi)
    k_smem = tl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, DK], k_desc.layout)
    v_smem = tl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
    q_smem = tl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, DK], q_desc.layout)
    do_smem = tl.allocate_shared_memory(do_desc.dtype, [BLOCK_M, DV], do_desc.layout)
    own_bar = tl.allocate_shared_memory(tl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(own_bar, count=1)
    for i in tl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a buffer
        mbarrier.init(v_empty.index(i), count=2)
    compute_args = (in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, g0_ptr, g0_s0, g0_s1, g0_s2, g0_s3, rowstats_ptr, drow_ptr, rowstats_sb, rowstats_sm, ddot_ptr, ddot_sb, ddot_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, f0, f1, hi, k_smem, v_smem, q_smem, do_smem, own_bar, k_ready, k_empty, v_ready, v_empty)
    tl.warp_specialize([
        (k_loader, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, own_bar, k_ready, k_empty, v_ready, v_empty, k_row, v_row, q_row, do_row, lo, f0, f1, hi)),
        (k_compute0, compute_args),
        (k_compute1, compute_args),
    ], [4, 4], [240, 240])
