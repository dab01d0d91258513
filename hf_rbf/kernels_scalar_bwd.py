"""Backward kernels of scalar (sort) attention (FlashAttention-2 layout, no atomics).

``dS_ij = W_ij (dO_i . v_j - delta_i)`` with ``W_ij = 2^(s_ij - lse_i)``.  The score is rank-1, so the query and key
gradients are row and column sums, not matrix products:

    dqs_i = -2 beta_i sum_j dS_ij (qs_i - ks_j),   dks_j = 2 sum_i dS_ij beta_i (qs_i - ks_j),
    dbeta_i = -sum_j dS_ij (qs_i - ks_j)^2,        dkb_j = sum_i dS_ij  (key log-weights).

Two launches:

* ``_scalar_bwd_dq_kernel`` (first): one program per stacked query block; its only matrix product is
  ``dP = dO V^T``.  It computes ``delta_i = sum_j W_ij dP_ij`` *exactly* in fp32 alongside the row sums
  (``sum_j dS_ij f_j = sum_j W_ij dP_ij f_j - delta_i sum_j W_ij f_j``) instead of FlashAttention's
  ``dO_i . O_i`` on the rounded output: in bf16 that rounding costs the temperature gradient, a sum of cancelling
  terms, several per cent, while here it costs two extra row sums.  It writes ``dqs`` (in qs's dtype), ``tau``'s
  per-row gradient ``-beta_i^2 dbeta_i`` (on request) and the work rows ``delta_i`` and ``beta_i = 1 / tau_i``.
* ``_scalar_bwd_dkv_kernel``: one program per key block and value group, the group's V tile stationary; the heads
  of the group are visited ``HP`` at a time with their query rows stacked (as in the forward), so ``dV = sum over
  heads and queries of W^T dO`` is one accumulator with no atomics; per-head ``dks``/``dkb`` come from a reshape of
  the transposed ``[BLOCK_N, HP * BLOCK_M]`` tile.  It reads the exact ``delta`` and ``beta`` from the work rows (a
  float ``tau`` is a kernel argument), so its loop takes no reciprocal.

No preprocessing kernel and no saved output are needed.
"""

from __future__ import annotations

import torch

from .kernels_common import (
    HAS_TRITON,
    autotune,
    bcast_strides,
    dot_precision,
    key_block_grid,
    launch_tuned,
    make_configs,
    n_bucket,
    padded_dim,
    planes_bucket,
    wrap_triton,
)
from .kernels_launch import direct_plan, keep_plan, launch_plan, plan_allowed
from .kernels_scalar_fwd import INTERPRET_CONFIGS, prune_scalar, requested_heads_per_program, scalar_plan_key, tau_args

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .kernels_common import _allowed, _dot, _load_tile, _query_range, _tile_range
    from .kernels_flash_bwd import _lane_rowsum
    from .kernels_scalar_fwd import (
        SCALAR_KEY,
        _log2_beta,
        _mma_anchor,
        _program_rows,
        _row_beta,
        _rows_of,
        _scores,
        _segment,
        _segment_keys,
    )


# dV: BLOCK_N stationary keys x ROWS streamed query rows (HP heads x BLOCK_M queries, HP tuned as in the forward).
SCALAR_DKV_CONFIGS = [
    # the first two compile without spills for sm_90 (benchmarks/offline_kernel_report.py); 64 x 64 tiles spill
    # 256-512 bytes per thread, 128 x 128 over 1 KB
    ({"BLOCK_N": 128, "ROWS": 32, "HP": 1}, 8, 3),
    ({"BLOCK_N": 64, "ROWS": 32, "HP": 1}, 4, 3),
    ({"BLOCK_N": 64, "ROWS": 64, "HP": 1}, 4, 3),
    ({"BLOCK_N": 128, "ROWS": 64, "HP": 1}, 8, 3),
    ({"BLOCK_N": 64, "ROWS": 32, "HP": 1}, 4, 2),
    ({"BLOCK_N": 64, "ROWS": 128, "HP": 4}, 8, 3),
    ({"BLOCK_N": 64, "ROWS": 64, "HP": 2}, 4, 3),
]
# dqs: ROWS stationary query rows x BLOCK_N streamed keys.
SCALAR_DQ_CONFIGS = [
    # first: no spills, 162 registers per thread for sm_90 (benchmarks/offline_kernel_report.py)
    ({"ROWS": 128, "BLOCK_N": 64, "HP": 1}, 8, 3),
    ({"ROWS": 128, "BLOCK_N": 128, "HP": 1}, 8, 3),
    ({"ROWS": 128, "BLOCK_N": 64, "HP": 1}, 4, 3),
    ({"ROWS": 64, "BLOCK_N": 64, "HP": 1}, 4, 3),
    ({"ROWS": 64, "BLOCK_N": 32, "HP": 1}, 4, 2),
    ({"ROWS": 128, "BLOCK_N": 64, "HP": 4}, 4, 3),
    ({"ROWS": 64, "BLOCK_N": 64, "HP": 2}, 4, 3),
]
_INTERPRET_DKV = [
    ({"BLOCK_N": 16, "ROWS": 16, "HP": 1}, 1, 1),
    ({"BLOCK_N": 16, "ROWS": 32, "HP": 2}, 1, 1),
    ({"BLOCK_N": 16, "ROWS": 64, "HP": 4}, 1, 1),
]


def _prune_dkv(configs, nargs, **kwargs):
    return prune_scalar(configs, {**nargs, **kwargs}, "BLOCK_N", "BLOCK_N")


def _prune_dq(configs, nargs, **kwargs):
    return prune_scalar(configs, {**nargs, **kwargs}, "ROWS", "ROWS")


if HAS_TRITON:

    @triton.jit
    def _stacked_t(x, HP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """``[HP, BLOCK_N]`` per-head key values -> columns ``HP * BLOCK_M`` of a ``[BLOCK_N, .]`` tile (column r
        reads head r // BLOCK_M); with one head the ``[BLOCK_N, 1]`` column simply broadcasts."""
        xt = tl.trans(x)
        if HP == 1:
            out = xt
        else:
            out = tl.reshape(tl.broadcast_to(xt[:, :, None], (BLOCK_N, HP, BLOCK_M)), (BLOCK_N, HP * BLOCK_M))
        return out

    @triton.jit
    def _per_head_colsum(xT, HP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """``[BLOCK_N, HP * BLOCK_M]`` -> ``[BLOCK_N, HP]``: sum over each head's query rows."""
        if HP == 1:
            out = tl.sum(xT, 1)[:, None]
        else:
            out = tl.sum(tl.reshape(xT, (BLOCK_N, HP, BLOCK_M)), 2)
        return out

    @triton.jit
    def _scalar_dkv_tiles(
        dv,
        dks,
        dkb,
        v,
        ksT,
        kbT,
        beta_h,
        s_k,
        is_prefix,
        QS_ptr,
        BETA_ptr,
        BETA_VALUE,
        DO_ptr,
        LSE_ptr,
        DELTA_ptr,
        sqsh,
        sqsn,
        sdoh,
        sdon,
        NQ,
        q_start,
        q_full_lo,
        q_full_hi,
        q_end,
        t0,
        WINDOW,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        HP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        TAU_TENSOR: tl.constexpr,
        BETA_ROWS: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """The query tiles of segments 1-3 (``_segment``) against a program's stationary key tile: transposed scores
        ``[BLOCK_N, HP * BLOCK_M]``, one head chunk of ``HP`` heads.  Edge tiles mask rows out of range and, for
        sequence key blocks, positions (a prefix key block, ``is_prefix``, is visible to every row); the middle
        range carries no mask (SEG is a constant in each unrolled copy of the loop)."""
        ROWS: tl.constexpr = HP * BLOCK_M
        offs_r = tl.arange(0, ROWS)
        hh = offs_r // BLOCK_M
        offs_dv = tl.arange(0, DV_PAD)
        for SEG in tl.static_range(1, 4):  # the edge, fully allowed and edge query tiles (see `_segment`)
            lo, hi = _segment(SEG, q_start, q_full_lo, q_full_hi, q_end)
            for start_m in range(lo, hi, BLOCK_M):
                i = start_m + offs_r % BLOCK_M
                row_ok = i < NQ
                # The row vectors are loaded by every thread that holds a column of the tile: each costs a dozen
                # instructions per tile, so the middle range (rows all in range) loads them without a mask, and a
                # temperature that does not vary along the rows comes in once per head (beta_h), not per tile.
                if SEG == 2:
                    qs = tl.load(QS_ptr + hh * sqsh + i * sqsn).to(tl.float32)
                    lse = tl.load(LSE_ptr + hh * NQ + i)
                    delta = tl.load(DELTA_ptr + hh * NQ + i)
                else:
                    qs = tl.load(QS_ptr + hh * sqsh + i * sqsn, mask=row_ok, other=0.0).to(tl.float32)
                    lse = tl.load(LSE_ptr + hh * NQ + i, mask=row_ok, other=float("inf"))
                    delta = tl.load(DELTA_ptr + hh * NQ + i, mask=row_ok, other=0.0)
                if BETA_ROWS:  # beta_i as the dQ pass wrote it: no reciprocal in this loop
                    beta = tl.load(BETA_ptr + hh * NQ + i, mask=row_ok, other=0.0)
                else:  # one temperature per head (beta_h) or a global one: no load here
                    beta = beta_h
                do = _load_tile(
                    DO_ptr + hh[:, None] * sdoh + i[:, None] * sdon + offs_dv[None, :],
                    row_ok,
                    offs_dv,
                    DV,
                    DV_PAD,
                    SEG != 2,
                )
                # ddn = -beta' dd (beta' = beta log2(e)): the exponent is one fma from it, -beta' dd^2 - lse, and
                # the key gradient's sum takes it as it is (dks_j = sum_i dS_ij beta_i dd_ij = -sum_i dS_ij ddn_ij
                # / log2(e), the factor applied once after the loops)
                ddn = (qs[None, :] - ksT) * (beta * -1.4426950408889634)[None, :]
                if HAS_KB:
                    sT = (qs[None, :] - ksT) * ddn + (kbT - lse[None, :])
                else:
                    sT = (qs[None, :] - ksT) * ddn - lse[None, :]
                if SEG != 2:  # edge tiles: rows out of range or position (prefix key blocks: range only)
                    ok = row_ok[None, :] & (
                        _allowed((t0 + i)[None, :], s_k[:, None], WINDOW, CAUSAL, HAS_WINDOW) | is_prefix
                    )
                    sT = tl.where(ok, sT, float("-inf"))
                pT = tl.math.exp2(sT)
                dv = _dot(pT.to(do.dtype), do, dv, DOT_PREC)
                dpT = _dot(v, tl.trans(do), None, DOT_PREC)
                dsT = pT * (dpT - delta[None, :])
                if HP == 1:  # per lane of the column's quad (see _lane_rowsum): no shuffles per tile
                    dks += _lane_rowsum(dsT * ddn)
                else:
                    dks += _per_head_colsum(dsT * ddn, HP, BLOCK_M, BLOCK_N)
                if HAS_KB:
                    dkb += _per_head_colsum(dsT, HP, BLOCK_M, BLOCK_N)
        return dv, dks, dkb

    @triton.jit
    def _scalar_bwd_dkv_kernel(
        QS,
        KS,
        V,
        KB,
        BETA_VALUE,
        DO,
        LSE,
        WORK,
        DV,
        DKS,
        DKB,
        sqsb,
        sqsh,
        sqsn,
        sksb,
        sksh,
        sksn,
        svb,
        svh,
        svn,
        sdob,
        sdoh,
        sdon,
        sdvb,
        sdvh,
        sdvn,
        H,
        HPG,
        NQ,
        NK,
        P,
        WINDOW,
        N_BUCKET,
        PLANES,
        HP_REQ,
        DV_: tl.constexpr,
        DV_PAD: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        TAU_TENSOR: tl.constexpr,
        BETA_ROWS: tl.constexpr,
        DOT_PREC: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HP: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = ROWS // HP
        pid_n = tl.program_id(0)
        bg = tl.program_id(1).to(tl.int64)
        G = H // HPG
        b = bg // G
        g = bg % G
        S = NK - P
        t0 = S - NQ
        n_prefix_blocks = tl.cdiv(P, BLOCK_N)
        is_prefix = pid_n < n_prefix_blocks
        ip = tl.minimum(n_prefix_blocks - pid_n, 1)
        ip = tl.maximum(
            ip, 0
        )  # 1 for a prefix key block, else 0 (integer select: a scalar tl.where is not 0-d in triton 3.6's interpreter)
        s0 = ip * (pid_n * BLOCK_N - P) + (1 - ip) * ((pid_n - n_prefix_blocks) * BLOCK_N)
        offs_n = tl.arange(0, BLOCK_N)
        j = P + s0 + offs_n
        s_k = s0 + offs_n
        key_ok = j < ip * P + (1 - ip) * NK
        offs_dv = tl.arange(0, DV_PAD)
        offs_h = tl.arange(0, HP)

        s_last = tl.minimum(s0 + BLOCK_N, S) - 1
        q_start, q_full_lo, q_full_hi, q_end = _query_range(s0, s_last, t0, NQ, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_M)
        p_start, p_full_lo, p_full_hi, p_end = _tile_range(0, 0, NQ - 1, NQ - 1, NQ, BLOCK_M)
        q_start = ip * p_start + (1 - ip) * q_start
        q_full_lo = ip * p_full_lo + (1 - ip) * q_full_lo
        q_full_hi = ip * p_full_hi + (1 - ip) * q_full_hi
        q_end = ip * p_end + (1 - ip) * q_end

        v = _load_tile(V + b * svb + g * svh + j[:, None] * svn + offs_dv[None, :], key_ok, offs_dv, DV_, DV_PAD, True)
        dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
        anchor = _mma_anchor(BLOCK_N, ROWS)
        for hc in range(0, HPG, HP):
            h0 = g * HPG + hc
            ks = tl.load(
                KS + b * sksb + (h0 + offs_h)[:, None] * sksh + j[None, :] * sksn, mask=key_ok[None, :], other=0.0
            ).to(tl.float32)
            ksT = _stacked_t(ks, HP, BLOCK_M, BLOCK_N)
            if HP == 1:  # the key column in the layout of the dP^T product's tile (see _mma_anchor)
                ksT = _rows_of(anchor, tl.sum(ks, 0))[:, None]
            if HAS_KB:
                kb = tl.load(
                    KB + (b * H + h0 + offs_h)[:, None] * NK + j[None, :], mask=key_ok[None, :], other=float("-inf")
                )
                kbT = _stacked_t(kb, HP, BLOCK_M, BLOCK_N)
                if HP == 1:
                    kbT = _rows_of(anchor, tl.sum(kb, 0))[:, None]
            else:
                kbT = ksT
            if HP == 1:  # the four lane sums of each key's quad, added after the loop
                dks = tl.zeros([BLOCK_N, 4], dtype=tl.float32)
            else:
                dks = tl.zeros([BLOCK_N, HP], dtype=tl.float32)
            dkb = tl.zeros([BLOCK_N, HP], dtype=tl.float32)
            QS_ptr = QS + b * sqsb + h0 * sqsh
            DO_ptr = DO + b * sdob + h0 * sdoh
            LSE_ptr = LSE + (b * H + h0) * NQ
            DELTA_ptr = WORK + (b * H + h0) * NQ  # the dQ pass's work rows: delta_i, then beta_i
            BETA_ptr = DELTA_ptr + tl.num_programs(1).to(tl.int64) * HPG * NQ
            hh = tl.arange(0, ROWS) // (ROWS // HP)
            if TAU_TENSOR and not BETA_ROWS:  # one temperature per head: row 0's beta, as the dQ pass wrote it
                beta_h = tl.load(BETA_ptr + hh * NQ)
            else:  # a global temperature (or per row: loaded in the loop)
                beta_h = tl.full([ROWS], BETA_VALUE, tl.float32)
            dv, dks, dkb = _scalar_dkv_tiles(
                dv,
                dks,
                dkb,
                v,
                ksT,
                kbT,
                beta_h,
                s_k,
                is_prefix,
                QS_ptr,
                BETA_ptr,
                BETA_VALUE,
                DO_ptr,
                LSE_ptr,
                DELTA_ptr,
                sqsh,
                sqsn,
                sdoh,
                sdon,
                NQ,
                q_start,
                q_full_lo,
                q_full_hi,
                q_end,
                t0,
                WINDOW,
                DV_,
                DV_PAD,
                HP,
                BLOCK_M,
                BLOCK_N,
                CAUSAL,
                HAS_WINDOW,
                HAS_KB,
                TAU_TENSOR,
                BETA_ROWS,
                DOT_PREC,
            )
            out_ptrs = (b * H + h0 + offs_h)[None, :] * NK + j[:, None]
            if HP == 1:
                dks = tl.sum(dks, 1)[:, None]
            # 2 sum_i dS_ij beta_i dd_ij, from the loop's sums of dS ddn (ddn = -beta log2(e) dd)
            tl.store(DKS + out_ptrs, (dks * -1.3862943611198906).to(DKS.dtype.element_ty), mask=key_ok[:, None])
            if HAS_KB:
                tl.store(DKB + out_ptrs, dkb, mask=key_ok[:, None])
        tl.store(
            DV + b * sdvb + g * sdvh + j[:, None] * sdvn + offs_dv[None, :],
            dv.to(DV.dtype.element_ty),
            mask=key_ok[:, None] & (offs_dv[None, :] < DV_),
        )

    @triton.jit
    def _scalar_bwd_dq_kernel(
        QS,
        KS,
        V,
        KB,
        TAU,
        BETA_VALUE,
        DO,
        LSE,
        WORK,
        DQS,
        DTAU,
        sqsb,
        sqsh,
        sqsn,
        sksb,
        sksh,
        sksn,
        svb,
        svh,
        svn,
        stb,
        sth,
        stn,
        sdob,
        sdoh,
        sdon,
        H,
        HPG,
        NQ,
        NK,
        P,
        WINDOW,
        N_BUCKET,
        PLANES,
        HP_REQ,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        TAU_TENSOR: tl.constexpr,
        NEED_DTAU: tl.constexpr,
        DOT_PREC: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HP: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = ROWS // HP
        b, h0, g, S, t0, i, h_r, row_ok = _program_rows(H, HPG, NQ, NK, P, HP, BLOCK_M, ROWS)
        offs_dv = tl.arange(0, DV_PAD)
        qs_r = tl.load(QS + b * sqsb + h_r * sqsh + i * sqsn, mask=row_ok, other=0.0).to(tl.float32)
        beta_r = _row_beta(TAU, BETA_VALUE, b, h_r, i, row_ok, stb, sth, stn, TAU_TENSOR, ROWS)
        lse = tl.load(LSE + (b * H + h_r) * NQ + i, mask=row_ok, other=float("inf"))
        do = _load_tile(
            DO + b * sdob + h_r[:, None] * sdoh + i[:, None] * sdon + offs_dv[None, :],
            row_ok,
            offs_dv,
            DV,
            DV_PAD,
            True,
        )
        t_r = t0 + i
        # the row sums of W dP (delta) and of W dP f, W f for f = dd and (with NEED_DTAU) dd^2
        # (per lane of the row's quad, see kernels_flash_bwd._lane_rowsum: no shuffles per tile; added after the loops)
        dacc = tl.zeros([ROWS, 4], dtype=tl.float32)
        a1 = tl.zeros([ROWS, 4], dtype=tl.float32)
        b1 = tl.zeros([ROWS, 4], dtype=tl.float32)
        a2 = tl.zeros([ROWS, 4], dtype=tl.float32)
        b2 = tl.zeros([ROWS, 4], dtype=tl.float32)
        KS_ptr = KS + b * sksb + h0 * sksh
        V_ptr = V + b * svb + g * svh
        KB_ptr = KB + (b * H + h0) * NK
        offs_h = tl.arange(0, HP)
        beta2_r, inv_beta2_r = _log2_beta(beta_r, ROWS)  # log2 units for the scores; dqs below takes beta itself
        # the row vectors in the layout of the dP product's tile (see kernels_scalar_fwd._mma_anchor)
        anchor = _mma_anchor(ROWS, BLOCK_N)
        qs_r = _rows_of(anchor, qs_r)
        beta2_r = _rows_of(anchor, beta2_r)
        inv_beta2_r = _rows_of(anchor, inv_beta2_r)
        lse = _rows_of(anchor, lse)
        t_r = _rows_of(anchor, t_r)
        # the forward's key segments and scores (see kernels_scalar_fwd._scalar_fwd_kernel)
        for SEG in tl.static_range(4):
            lo, hi, key_base, bound = _segment_keys(SEG, t0, NQ, P, S, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
            for start_n in range(lo, hi, BLOCK_N):
                s, dd, j, col_ok = _scores(
                    start_n,
                    key_base,
                    bound,
                    qs_r,
                    inv_beta2_r,
                    t_r,
                    offs_h,
                    KS_ptr,
                    KB_ptr,
                    sksh,
                    sksn,
                    NK,
                    WINDOW,
                    SEG,
                    HP,
                    BLOCK_M,
                    BLOCK_N,
                    CAUSAL,
                    HAS_WINDOW,
                    HAS_KB,
                )
                p = tl.math.exp2(s * beta2_r[:, None] - lse[:, None])  # s: the score over beta (see _scores)
                v = _load_tile(V_ptr + j[:, None] * svn + offs_dv[None, :], col_ok, offs_dv, DV, DV_PAD, SEG != 2)
                dp = _dot(do, tl.trans(v), None, DOT_PREC)
                pd = p * dp
                dacc += _lane_rowsum(pd)
                a1 += _lane_rowsum(pd * dd)
                b1 += _lane_rowsum(p * dd)
                if NEED_DTAU:  # only when tau requires grad: two more row sums per tile
                    if SEG == 2 and not HAS_KB:  # unmasked scores without a key bias are -dd^2: no multiply
                        a2 -= _lane_rowsum(pd * s)
                        b2 -= _lane_rowsum(p * s)
                    else:  # (a masked score is -inf, and 0 * -inf would poison the sums)
                        dd2 = dd * dd
                        a2 += _lane_rowsum(pd * dd2)
                        b2 += _lane_rowsum(p * dd2)
        # sum_j dS_ij f_j = sum_j W_ij dP_ij f_j - delta_i sum_j W_ij f_j with the exact delta_i = sum_j W_ij dP_ij
        out_rows = (b * H + h_r) * NQ + i
        dacc, a1, b1, a2, b2 = tl.sum(dacc, 1), tl.sum(a1, 1), tl.sum(b1, 1), tl.sum(a2, 1), tl.sum(b2, 1)
        dqs = -2.0 * beta_r * (a1 - dacc * b1)
        tl.store(DQS + out_rows, dqs.to(DQS.dtype.element_ty), mask=row_ok)  # in qs's dtype: no cast op after
        if NEED_DTAU:
            # dtau_i = -beta_i^2 dbeta_i, the reciprocal's derivative in torch's order (-(g * (beta * beta)))
            dbeta = dacc * b2 - a2
            tl.store(DTAU + out_rows, -(dbeta * (beta_r * beta_r)), mask=row_ok)
        # the work rows for the dK/dV pass: delta_i, and beta_i when tau is a tensor (so that pass takes no
        # reciprocal in its loop; with a float tau it has the constant)
        tl.store(WORK + out_rows, dacc, mask=row_ok)
        if TAU_TENSOR:
            tl.store(WORK + tl.num_programs(1).to(tl.int64) * HP * NQ + out_rows, beta_r, mask=row_ok)

    _scalar_bwd_dkv = autotune(make_configs(SCALAR_DKV_CONFIGS, _INTERPRET_DKV), SCALAR_KEY, _prune_dkv)(
        _scalar_bwd_dkv_kernel
    )
    _scalar_bwd_dq = autotune(make_configs(SCALAR_DQ_CONFIGS, INTERPRET_CONFIGS), SCALAR_KEY, _prune_dq)(
        _scalar_bwd_dq_kernel
    )


def scalar_backward(dout, qs, ks, v, kb, tau, lse, *, causal, window, num_prefix_keys, need_dtau, traced=False):
    """Gradients of :func:`kernels_scalar_fwd.scalar_forward` (``tau`` the same float or tensor).

    Returns ``dqs [B,H,Nq]`` (qs's dtype), ``dks [B,H,Nk]`` (ks's dtype), ``dv [B,G,Nk,Dv]`` (v's dtype), ``dkb
    [B,H,Nk]`` (fp32, ``sum_i dS_ij``; None without key bias) and ``dtau [B,H,Nq]`` (fp32, per row: the caller sums
    it over tau's broadcast dims; None unless ``need_dtau``).  ``traced``: called from the triton_op
    ``scalar_bwd_t`` while it is traced (literal ``wrap_triton`` launches).  Written: dQ ``WORK``, ``DQS`` and
    ``DTAU`` (only with ``NEED_DTAU``: otherwise the name is on ``work``, unwritten); dK/dV ``DV``, ``DKS`` and
    ``DKB`` (only with ``HAS_KB``: otherwise the name is on ``dks``, unwritten), ``WORK`` only read there; ``KB`` /
    ``TAU`` on the ``lse`` placeholder are read under ``HAS_KB`` / ``TAU_TENSOR`` alone.  So no tensor is written
    under two names (docs/triton_op_plan.md, fix 9).
    """
    bsz, heads, nq = qs.shape
    nk = ks.shape[2]
    groups, dv_dim = v.shape[1], v.shape[3]
    hpg = heads // groups
    dev = v.device
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dqs = torch.empty(bsz, heads, nq, device=dev, dtype=qs.dtype)
    dks = torch.empty(bsz, heads, nk, device=dev, dtype=ks.dtype)
    dv = torch.empty_like(v)
    dkb = torch.empty(bsz, heads, nk, device=dev, dtype=torch.float32) if kb is not None else None
    dtau = torch.empty(bsz, heads, nq, device=dev, dtype=torch.float32) if need_dtau else None
    if nq == 0 or nk == 0:
        return tuple(None if t is None else t.zero_() for t in (dqs, dks, dv, dkb, dtau))
    tau_t, beta_value, stau, tau_tensor = tau_args(tau, bsz, heads, nq, lse)
    # written by the dQ pass, read by the dK/dV pass: delta_i (exact, see the module docstring) and, for a tensor
    # tau, beta_i = 1 / tau_i
    work = torch.empty(2 if tau_tensor else 1, bsz, heads, nq, device=dev, dtype=torch.float32)
    plan_key = None
    if not traced:  # a call signature launched before: its plans (see kernels_launch.direct_plan; GPU only)
        device = torch.cuda.current_device() if v.is_cuda else -1
        signed = [qs, ks, v, dout, lse, work, dqs, dks, dv] + [t for t in (dtau, dkb) if t is not None]
        plan_key, pointers = scalar_plan_key(signed, kb, tau, device, causal, window, num_prefix_keys, need_dtau)
        plans = _BWD_PLANS.get(plan_key)  # (none on the CPU: direct_plan makes none there)
        if plans is not None and plan_allowed(plans[0]) and plan_allowed(plans[1]):
            p_qs, p_ks, p_v, p_dout, p_lse, p_work, p_dqs, p_dks, p_dv = pointers[:9]
            rest = iter(pointers[9:])  # dtau, dkb, kb, tau: those present, in this order
            p_dtau = next(rest) if dtau is not None else p_work
            p_dkb = next(rest) if dkb is not None else p_dks
            p_kb = next(rest) if kb is not None else p_lse
            p_tau = next(rest) if tau_tensor else p_lse
            head = [p_qs, p_ks, p_v, p_kb]
            launch_plan(plans[0], head + [p_tau, p_dout, p_lse, p_work, p_dqs, p_dtau], device)
            launch_plan(plans[1], head + [p_dout, p_lse, p_work, p_dv, p_dks, p_dkb], device)
            return dqs, dks, dv, dkb, dtau
    common = dict(
        DV_PAD=padded_dim(dv_dim),
        CAUSAL=causal,
        HAS_WINDOW=window is not None,
        HAS_KB=kb is not None,
        TAU_TENSOR=tau_tensor,
        DOT_PREC=dot_precision(v.dtype),
    )
    sizes = (
        *(heads, hpg, nq, nk, num_prefix_keys, window or 0),
        *(n_bucket(max(nq, nk)), planes_bucket(bsz * heads), requested_heads_per_program()),
    )
    s_qkv = (*bcast_strides(qs, (bsz, heads, nq)), *bcast_strides(ks, (bsz, heads, nk)), *v.stride()[:3])
    s_do = dout.stride()[:3]
    kbt = kb if kb is not None else lse
    grid_q = lambda meta: (triton.cdiv(nq, meta["ROWS"] // meta["HP"]), bsz * (heads // meta["HP"]))  # noqa: E731
    args_q = (
        qs,
        ks,
        v,
        kbt,
        tau_t,
        beta_value,
        dout,
        lse,
        work,
        dqs,
        dtau if need_dtau else work,
        *s_qkv,
        *stau,
        *s_do,
        *sizes,
    )
    kwargs_q = dict(DV=dv_dim, NEED_DTAU=need_dtau, **common)
    if traced:
        wrap_triton(_scalar_bwd_dq)[grid_q](*args_q, **kwargs_q)
    else:
        launch_tuned(_scalar_bwd_dq, grid_q, *args_q, **kwargs_q)
        plan_q = None if plan_key is None else direct_plan(_scalar_bwd_dq, grid_q, args_q, kwargs_q, 10)
    grid_kv = key_block_grid(num_prefix_keys, nk, bsz * groups)
    args_kv = (
        qs,
        ks,
        v,
        kbt,
        beta_value,
        dout,
        lse,
        work,
        dv,
        dks,
        dkb if kb is not None else dks,
        *s_qkv,
        *s_do,
        *dv.stride()[:3],
        *sizes,
    )
    # BETA_ROWS: the temperature varies along the query rows (else the dK/dV pass reads it once per head)
    kwargs_kv = dict(DV_=dv_dim, BETA_ROWS=tau_tensor and stau[2] != 0 and nq > 1, **common)
    if traced:
        wrap_triton(_scalar_bwd_dkv)[grid_kv](*args_kv, **kwargs_kv)
    else:
        launch_tuned(_scalar_bwd_dkv, grid_kv, *args_kv, **kwargs_kv)
        plan_kv = None if plan_key is None else direct_plan(_scalar_bwd_dkv, grid_kv, args_kv, kwargs_kv, 10)
        if plan_q is not None and plan_kv is not None:
            keep_plan(_BWD_PLANS, plan_key, (plan_q, plan_kv))
    return dqs, dks, dv, dkb, dtau


# call signature -> (kernels_launch.direct_plan of the dQ launch, of the dK/dV launch)
_BWD_PLANS: dict = {}
