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
def k_loader(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, k_row, v_row, lo, hi):
    # the live key blocks [lo, hi) in order, through a ring of STAGES buffers per operand
    STAGES: tl.constexpr = k_smem.type.shape[0]
    BLOCK_N: tl.constexpr = k_smem.type.shape[1]
    for i in range(hi - lo):
        s = i % STAGES
        ph = (i // STAGES) & 1
        n0 = (lo + i) * BLOCK_N
        # an empty barrier starts with its phase 1 complete: the first STAGES waits pass
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + n0, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row + n0, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def k_compute(W: tl.constexpr, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, out_ptr, out_s0, out_s1, out_s2, out_s3, rowstats_ptr, rowstats_sb, rowstats_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, hi, f0, f1, stats, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty):
    STAGES: tl.constexpr = k_smem.type.shape[0]
    BLOCK_N: tl.constexpr = k_smem.type.shape[1]
    DK: tl.constexpr = k_smem.type.shape[2]
    DV: tl.constexpr = v_smem.type.shape[2]
    S_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: tl.constexpr = tl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    P_LAYOUT: tl.constexpr = tl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    m0 = pid_m * 128 + W * 64
    q = q_smem.index(W)  # stored by the kernel before the fork
    offs_m = m0 + tl.arange(0, 64, layout=tl.SliceLayout(1, S_LAYOUT))
    mask_m = offs_m < M
    zero_s = tl.zeros([64, BLOCK_N], tl.float32, S_LAYOUT)
    acc = tl.zeros([64, DV], tl.float32, O_LAYOUT)
    m_i = tl.full([64], float("-inf"), tl.float32, tl.SliceLayout(1, S_LAYOUT))
    l_i = tl.zeros([64], tl.float32, tl.SliceLayout(1, S_LAYOUT))
    alpha = l_i
    if hi > lo:
        j = lo
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        start_n = j * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N, layout=tl.SliceLayout(0, S_LAYOUT))
        mask_n = offs_n < N
        qk0 = s
        t11 = (offs_n[None, :] - offs_m[:, None])
        t12 = (t11 <= (0))
        t13 = (t12 == 0)
        t14 = (tl.where(t13, (float("-inf")), qk0))
        m_new = tl.maximum(m_i, tl.max(tl.where(mask_n[None, :], t14, float("-inf")), 1) * 0.12751743082459868)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, not NaN
        alpha = tl.exp2(m_i - m_safe)
        t15 = (qk0 * (0.12751743082459868))
        t16 = (tl.where(t13, (float("-inf")), t15))
        t17 = (t16 - m_safe[:, None])
        t18 = (tl.exp2(t17))
        p_f32 = tl.where(mask_n[None, :], t18, 0.0)
        l_i = l_i * alpha + tl.sum(p_f32, 1)
        m_i = m_new
        p = tl.convert_layout(p_f32.to(v_smem.dtype), P_LAYOUT)
        for i in range(1, hi - lo):
            j = lo + i
            st = i % STAGES
            prev = (i - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (i // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = acc * tl.convert_layout(alpha, tl.SliceLayout(1, O_LAYOUT))[:, None]
            mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))  # QK^T done, P @ V still in flight
            mbarrier.arrive(k_empty.index(st), count=1)
            start_n = j * BLOCK_N
            offs_n = start_n + tl.arange(0, BLOCK_N, layout=tl.SliceLayout(0, S_LAYOUT))
            mask_n = offs_n < N
            qk0 = s
            if (j >= f0) & (j < f1):
                m_new = tl.maximum(m_i, tl.max(qk0, 1) * 0.12751743082459868)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, not NaN
                alpha = tl.exp2(m_i - m_safe)
                t19 = (qk0 * (0.12751743082459868))
                t20 = (t19 - m_safe[:, None])
                t21 = (tl.exp2(t20))
                p_f32 = t21
                l_i = l_i * alpha + tl.sum(p_f32, 1)
                m_i = m_new
            else:
                t22 = (offs_n[None, :] - offs_m[:, None])
                t23 = (t22 <= (0))
                t24 = (t23 == 0)
                t25 = (tl.where(t24, (float("-inf")), qk0))
                m_new = tl.maximum(m_i, tl.max(tl.where(mask_n[None, :], t25, float("-inf")), 1) * 0.12751743082459868)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, not NaN
                alpha = tl.exp2(m_i - m_safe)
                t26 = (qk0 * (0.12751743082459868))
                t27 = (tl.where(t24, (float("-inf")), t26))
                t28 = (t27 - m_safe[:, None])
                t29 = (tl.exp2(t28))
                p_f32 = tl.where(mask_n[None, :], t29, 0.0)
                l_i = l_i * alpha + tl.sum(p_f32, 1)
                m_i = m_new
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p = tl.convert_layout(p_f32.to(v_smem.dtype), P_LAYOUT)
        last = (hi - lo - 1) % STAGES
        acc = acc * tl.convert_layout(alpha, tl.SliceLayout(1, O_LAYOUT))[:, None]
        mbarrier.wait(v_ready.index(last), ((hi - lo - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(v_empty.index(last), count=1)
    out_s3 = 1
    out_s0 = tl.multiple_of(out_s0, 16)
    out_s1 = tl.multiple_of(out_s1, 16)
    out_s2 = tl.multiple_of(out_s2, 16)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    # statistics for the backward (see rowstat_columns)
    if stats:
        tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 0, m_safe, mask=mask_m)
        tl.store(rowstats_ptr + pid_b * rowstats_sb + offs_m * rowstats_sm + 1, l_i, mask=mask_m)
    ROW_O: tl.constexpr = tl.SliceLayout(1, O_LAYOUT)
    offs_m = m0 + tl.arange(0, 64, layout=ROW_O)
    mask_m = offs_m < M
    offs_dv = tl.arange(0, DV, layout=tl.SliceLayout(0, O_LAYOUT))
    mask_dv = offs_dv < DV
    m_o = tl.convert_layout(m_i, ROW_O)  # the raw max, as the Triton epilogue reads it
    l_o = tl.convert_layout(l_i, ROW_O)
    t30 = (tl.where(l_o[:, None] == 0, 0.0, acc / tl.where(l_o[:, None] == 0, 1.0, l_o[:, None])))
    tl.store(out_ptr + b0 * out_s0 + b1 * out_s1 + offs_m[:, None] * out_s2 + offs_dv[None, :] * out_s3, t30.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


@gluon.jit
def k_compute0(in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, out_ptr, out_s0, out_s1, out_s2, out_s3, rowstats_ptr, rowstats_sb, rowstats_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, hi, f0, f1, stats, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty):
    k_compute(0, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, out_ptr, out_s0, out_s1, out_s2, out_s3, rowstats_ptr, rowstats_sb, rowstats_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, hi, f0, f1, stats, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)


@gluon.jit
def k_compute1(in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, out_ptr, out_s0, out_s1, out_s2, out_s3, rowstats_ptr, rowstats_sb, rowstats_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, hi, f0, f1, stats, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty):
    k_compute(1, in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, out_ptr, out_s0, out_s1, out_s2, out_s3, rowstats_ptr, rowstats_sb, rowstats_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, hi, f0, f1, stats, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)


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
    SCAN_BLOCKS: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    pid_m = tl.program_id(0)
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
    k_row = ((b0 * in1_s0 + b1 * in1_s1) // in1_s2).to(tl.int32)
    v_row = ((b0 * in2_s0 + b1 * in2_s1) // in2_s2).to(tl.int32)
    lo = lo5
    hi = tl.maximum(hi6, lo)
    f0 = f9
    f1 = f10
    stats = tl.to_tensor(STATS)
    q_smem = tl.allocate_shared_memory(k_desc.dtype, [2, 64, DK], k_desc.layout)  # Q's layout is K's
    Q_LAYOUT: tl.constexpr = tl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    gq_k = tl.arange(0, DK, layout=tl.SliceLayout(0, Q_LAYOUT))
    gq_mask_k = gq_k < DK
    gq0_m = pid_m * 128 + 0 + tl.arange(0, 64, layout=tl.SliceLayout(1, Q_LAYOUT))
    gq0_mask_m = gq0_m < M
    ld31 = tl.load(in0_ptr + b0 * in0_s0 + b1 * in0_s1 + gq0_m[:, None] * in0_s2 + gq_k[None, :] * in0_s3, mask=gq_mask_k[None, :] & gq0_mask_m[:, None], other=0)
    q_smem.index(0).store(ld31.to(k_desc.dtype))
    gq1_m = pid_m * 128 + 64 + tl.arange(0, 64, layout=tl.SliceLayout(1, Q_LAYOUT))
    gq1_mask_m = gq1_m < M
    ld32 = tl.load(in0_ptr + b0 * in0_s0 + b1 * in0_s1 + gq1_m[:, None] * in0_s2 + gq_k[None, :] * in0_s3, mask=gq_mask_k[None, :] & gq1_mask_m[:, None], other=0)
    q_smem.index(1).store(ld32.to(k_desc.dtype))
    fence_async_shared()  # generic-proxy stores, then wgmma reads (after the fork's barrier)
    k_smem = tl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, DK], k_desc.layout)
    v_smem = tl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
    k_ready = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = tl.allocate_shared_memory(tl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in tl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a buffer
        mbarrier.init(v_empty.index(i), count=2)
    compute_args = (in0_ptr, in0_s0, in0_s1, in0_s2, in0_s3, in1_ptr, in1_s0, in1_s1, in1_s2, in1_s3, in2_ptr, in2_s0, in2_s1, in2_s2, in2_s3, out_ptr, out_s0, out_s1, out_s2, out_s3, rowstats_ptr, rowstats_sb, rowstats_sm, B0, B1, M, N, pid_m, pid_b, b0, b1, lo, hi, f0, f1, stats, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)
    # the loader is the default partition: triton 3.6 verifies a reduction as it is built, and
    # the default partition's ops are built before it has a warp count, so reductions must be
    # in a worker; it keeps what registers the compute warpgroups leave (MAXNREG per thread)
    tl.warp_specialize([
        (k_loader, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, k_row, v_row, lo, hi)),
        (k_compute0, compute_args),
        (k_compute1, compute_args),
    ], [4, 4], [240, 240])
