"""Flash-style backward kernels shared by RBF, GKA and hybrid attention (FlashAttention-2 layout, no atomics).

With ``W_ij = 2^(s_ij - lse_i)`` from the forward, ``dP_ij = dO_i . v_j`` and ``delta_i = dO_i . O_i`` the gradient of
the natural-log score is ``dS_ij = W_ij (dP_ij - delta_i)`` (softmax, with or without GKA's eps) or
``W_ij dP_ij`` (softmax-free).  Two launches, in this order:

1. ``_distance_bwd_dq_kernel``: one program per query block; key tiles streamed as in the forward.  It computes
   ``delta_i`` from its own ``O`` and ``dO`` tiles (no pre-pass launch) and writes it for the next kernel; besides
   ``dQ`` it writes per-row partial sums for the per-head parameter gradients (``q_i . sum_j dS_ij k_j`` and
   ``rowsum(dS)_i ||q_i||^2``), the scalar-query gradient and (on request) the ``beta = 1/tau`` gradient.
2. ``_distance_bwd_dkdv_kernel``: one program per key block and *value group*; K, V stationary, query tiles
   streamed (the allowed rows of a key block are an interval: the same masked / unmasked / masked split as the
   forward).  The heads of a value group run one after the other in the program so that grouped values (the
   hybrid's ``[B, G, Nk, Dv]``) get ``dV`` summed over their heads without atomics.  It also forms the per-key
   sums ``C_j = sum_i dS_ij`` (the gradient of the key bias): it writes them for the key log-weights' gradient
   (on request) and ``C_j ||k_j||^2`` for the norm coefficient's (the key norms from the stationary key tile), and
   the scalar-key gradient.

The per-row and per-key partial sums of the per-head gradients share one fp32 work buffer with ``delta``, and one
``sum`` reduces them (``distance_backward``): no atomics anywhere, and the same gradients on every run.

``rowsum(dS)`` (needed for the query-norm term of GKA / softmax-free RBF) has a closed form, so no extra reduction
runs in the inner loop: softmax with eps: ``delta_i * eps 2^(-r_i - lse_i)``, plain softmax: 0,
softmax-free: ``delta_i``.
"""

from __future__ import annotations

import math

import torch

from .kernels_common import (
    HAS_TRITON,
    autotune,
    autotune_subset,
    bcast_strides,
    dot_precision,
    key_block_grid,
    launch_tuned,
    make_configs,
    n_bucket,
    padded_dim,
    planes_bucket,
    shared_memory_fits,
    wrap_triton,
)
from .kernels_flash_fwd import launch_inputs, prefix_args
from .kernels_launch import direct_plan, keep_plan, launch_plan, plan_allowed, tensor_signature

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .kernels_common import (
        _allowed,
        _dot,
        _key_range,
        _load_tile,
        _query_range,
        _row_sq_norms,
        _tile_range,
    )
    from .kernels_flash_fwd import _key_value_bases


# dK/dV: BLOCK_N stationary keys, BLOCK_M streamed queries.  The Triton tutorial's Hopper tiles (128 keys x 32
# queries) first; 64 x 64 for the larger head dims; 64 x 32 with 8 warps keeps head dim 256 in registers.
DKDV_CONFIGS = [
    # first (autotuning off, and lengths up to SMALL_N_BUCKET): compiled offline for sm_90
    # (benchmarks/offline_kernel_report.py) it spills nothing at D64 for rbf, GKA and hybrid (at most 88 bytes at
    # D128), where the 4-warp version of the same tiles spills 192-312 bytes per thread at D64
    ({"BLOCK_N": 128, "BLOCK_M": 32}, 8, 3),
    ({"BLOCK_N": 128, "BLOCK_M": 32}, 4, 3),
    ({"BLOCK_N": 64, "BLOCK_M": 64}, 4, 3),
    ({"BLOCK_N": 128, "BLOCK_M": 64}, 8, 3),
    ({"BLOCK_N": 64, "BLOCK_M": 32}, 4, 2),
    ({"BLOCK_N": 64, "BLOCK_M": 32}, 8, 2),
]
# dQ: BLOCK_M stationary queries, BLOCK_N streamed keys (the tutorial's 128 x 32 tiles first).
DQ_CONFIGS = [
    # first: the same tiles with 8 warps compile without spills at D64 and D128 for every family (offline sm_90
    # compile), where 4 warps spill 8-112 bytes at D64 and 712-1,016 bytes at D128
    ({"BLOCK_M": 128, "BLOCK_N": 32}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 32}, 4, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 32}, 4, 2),
]
_INTERPRET_CONFIG_DKDV = ({"BLOCK_N": 16, "BLOCK_M": 16}, 1, 1)
_INTERPRET_CONFIG_DQ = ({"BLOCK_M": 16, "BLOCK_N": 16}, 1, 1)


def _make_prune(rows_key, cols_key, acc_cols):
    def prune(configs, nargs, **kwargs):
        nargs = {**nargs, **kwargs}  # triton 3.6 passes the constexpr arguments separately
        d_pad, dv_pad = nargs["D_PAD"], nargs["DV_PAD"]
        el = nargs["Q"].element_size()
        out = []
        for c in configs:
            rows, cols = c.kwargs[rows_key], c.kwargs[cols_key]
            acc = rows * acc_cols(d_pad, dv_pad) * 4 / (32 * c.num_warps * 4)  # fp32 accumulator registers
            if shared_memory_fits(rows, cols, d_pad, dv_pad, c.num_stages, el) and acc <= 128:
                out.append(c)
        out = out or configs[-1:]
        return autotune_subset(out, nargs)

    return prune


_prune_dkdv = _make_prune("BLOCK_N", "BLOCK_M", lambda d, dv: d + dv)
_prune_dq = _make_prune("BLOCK_M", "BLOCK_N", lambda d, dv: d)


if HAS_TRITON:
    # Key rows j of a block in the order the kernels see them, [prefix keys; sequence keys].  With separate prefix
    # tensors (SEP_PREFIX, see the forward kernel) a block is all prefix or all sequence keys, so one of the two masked
    # accesses touches nothing: the same code for every block, no branch on the block kind.
    @triton.jit
    def _load_key_rows(
        SEQ,
        seq_n,
        PRE,
        pre_n,
        j,
        P,
        key_ok,
        cols,
        NCOLS: tl.constexpr,
        NCOLS_PAD: tl.constexpr,
        SEP_PREFIX: tl.constexpr,
    ):
        """``[BLOCK_N, NCOLS_PAD]`` rows ``j`` (``SEQ``/``PRE``: the (batch, head) bases, ``*_n`` their row strides)."""
        if SEP_PREFIX:
            x = _load_tile(PRE + j[:, None] * pre_n + cols[None, :], key_ok & (j < P), cols, NCOLS, NCOLS_PAD, True)
            x += _load_tile(
                SEQ + (j - P)[:, None] * seq_n + cols[None, :], key_ok & (j >= P), cols, NCOLS, NCOLS_PAD, True
            )
        else:
            x = _load_tile(SEQ + j[:, None] * seq_n + cols[None, :], key_ok, cols, NCOLS, NCOLS_PAD, True)
        return x

    @triton.jit
    def _store_key_rows(x, SEQ, seq_n, PRE, pre_n, j, P, key_ok, cols, NCOLS: tl.constexpr, SEP_PREFIX: tl.constexpr):
        """Store the ``[BLOCK_N, *]`` rows ``x`` of keys ``j`` (the prefix ones into ``PRE``), in each target's dtype."""
        col_ok = cols[None, :] < NCOLS
        if SEP_PREFIX:
            tl.store(
                PRE + j[:, None] * pre_n + cols[None, :],
                x.to(PRE.dtype.element_ty),
                mask=(key_ok & (j < P))[:, None] & col_ok,
            )
            tl.store(
                SEQ + (j - P)[:, None] * seq_n + cols[None, :],
                x.to(SEQ.dtype.element_ty),
                mask=(key_ok & (j >= P))[:, None] & col_ok,
            )
        else:
            tl.store(
                SEQ + j[:, None] * seq_n + cols[None, :], x.to(SEQ.dtype.element_ty), mask=key_ok[:, None] & col_ok
            )

    @triton.jit
    def _lane_rowsum(x):
        """``[BLOCK_M, BLOCK_N] -> [BLOCK_M, 4]``: column ``c`` sums the columns ``8 i + 2 c + {0, 1}`` of each row.

        In the tensor-core accumulator layout (Hopper's wgmma, and mma.sync) the 4 threads of a quad hold a row's
        columns exactly so, thread ``c`` of the quad those of column ``c`` here: the sums stay in the thread (no
        shuffles per key tile), and the 4 partial sums of a row are added (across the quad) once, after the loops.
        """
        m: tl.constexpr = x.shape[0]
        n: tl.constexpr = x.shape[1]
        tl.static_assert(n % 8 == 0, "_lane_rowsum: the summed axis must be a multiple of 8")
        y = tl.permute(tl.reshape(x, [m, n // 8, 4, 2]), (0, 2, 1, 3))  # [row, c, i, pair]: one in-thread sum
        return tl.sum(tl.reshape(y, [m, 4, n // 4]), 2)

    @triton.jit
    def _dkdv_tiles(
        dk,
        dv,
        c_acc,
        dks_acc,
        k,
        v,
        kb,
        ks,
        s_k,
        is_prefix,
        Q_ptr,
        DO_ptr,
        LSE_ptr,
        DELTA_ptr,
        QS_ptr,
        BETA_ptr,
        beta_h,
        sqn,
        son,
        sqsn,
        sbn,
        lo,
        hi,
        t0,
        NQ,
        a,
        WINDOW,
        MODE: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        D_PAD: tl.constexpr,
        DV_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        SCALAR: tl.constexpr,
        TAU_IN: tl.constexpr,
        BETA_ROWS: tl.constexpr,
        NORMALIZE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """Query tiles ``lo .. hi`` against the stationary key tile (transposed scores ``[BLOCK_N, BLOCK_M]``).

        MODE 0: every row valid and allowed; 1: rows masked by bounds and position (prefix key blocks: bounds only).
        ``beta_h``: without ``BETA_ROWS`` (one beta for every query of the head) the scalar term's ``beta log2(e)``,
        formed once per head by the caller; with it the per-query betas are loaded (and with ``TAU_IN`` inverted)
        per tile.
        """
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < NQ
            q = _load_tile(Q_ptr + offs_m[:, None] * sqn + offs_d[None, :], row_ok, offs_d, D, D_PAD, MODE != 0)
            do = _load_tile(DO_ptr + offs_m[:, None] * son + offs_dv[None, :], row_ok, offs_dv, DV, DV_PAD, MODE != 0)
            if MODE == 0:
                lse = tl.load(LSE_ptr + offs_m)
                delta = tl.load(DELTA_ptr + offs_m)
            else:
                lse = tl.load(LSE_ptr + offs_m, mask=row_ok, other=float("inf"))
                delta = tl.load(DELTA_ptr + offs_m, mask=row_ok, other=0.0)
            sT = _dot(k, tl.trans(q), None, DOT_PREC) * a
            if HAS_KB:
                sT += kb[:, None]
            if SCALAR:
                if MODE == 0:
                    qs = tl.load(QS_ptr + offs_m * sqsn).to(tl.float32)
                else:
                    qs = tl.load(QS_ptr + offs_m * sqsn, mask=row_ok, other=0.0).to(tl.float32)
                if BETA_ROWS:
                    if TAU_IN:  # the scalar tensor holds tau: beta = 1 / tau, IEEE-rounded as in the dQ kernel
                        tau = tl.load(BETA_ptr + offs_m * sbn, mask=row_ok, other=1.0).to(tl.float32)
                        beta = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tau)
                    else:
                        beta = tl.load(BETA_ptr + offs_m * sbn, mask=row_ok, other=0.0).to(tl.float32)
                    bl = (beta * 1.4426950408889634)[None, :]
                else:
                    bl = beta_h
                dd = qs[None, :] - ks[:, None]
                # u = beta_i log2(e) (qs_i - ks_j) serves the score (one fma) and the scalar-key gradient below (its
                # log2(e) taken out once per key at the store): one multiply per pair fewer than two products
                u = dd * bl
                # lse first: a q.k . a - lse_i fma, then the scalar term's fma (no separate subtraction per pair)
                sT = (sT - lse[None, :]) - u * dd
            if MODE == 1:
                ok = row_ok[None, :] & (
                    _allowed((t0 + offs_m)[None, :], s_k[:, None], WINDOW, CAUSAL, HAS_WINDOW) | is_prefix
                )
                sT = tl.where(ok, sT, float("-inf"))
            if SCALAR:
                pT = tl.math.exp2(sT)
            else:
                pT = tl.math.exp2(sT - lse[None, :])
            dv = _dot(pT.to(do.dtype), do, dv, DOT_PREC)
            dpT = _dot(v, tl.trans(do), None, DOT_PREC)
            if NORMALIZE:
                dsT = pT * (dpT - delta[None, :])
            else:
                dsT = pT * dpT
            dk = _dot(dsT.to(q.dtype), q, dk, DOT_PREC)
            if HAS_KB:
                c_acc += tl.sum(dsT, 1)
            if SCALAR:
                dks_acc += _lane_rowsum(dsT * u)
        return dk, dv, c_acc, dks_acc

    @triton.jit
    def _distance_bwd_dkdv_kernel(
        Q,
        K,
        V,
        KB,
        QS,
        KS,
        BETA,
        A,
        BC,
        PK,
        PV,
        DO,
        LSE,
        WORK,
        DK,
        DV,
        DKB,
        DKS,
        DPK,
        DPV,
        sqb,
        sqh,
        sqn,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sdob,
        sdoh,
        sdon,
        sqsb,
        sqsh,
        sqsn,
        sksb,
        sksh,
        sksn,
        sbb,
        sbh,
        sbn,
        spkb,
        spkh,
        spkn,
        spvb,
        spvh,
        spvn,
        sdkb,
        sdkh,
        sdkn,
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
        D: tl.constexpr,
        DV_: tl.constexpr,
        D_PAD: tl.constexpr,
        DV_PAD: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        KNORM: tl.constexpr,
        KNORM_INLINE: tl.constexpr,
        KEY_BIAS: tl.constexpr,
        STORE_DKB: tl.constexpr,
        SCALAR: tl.constexpr,
        TAU_IN: tl.constexpr,
        BETA_ROWS: tl.constexpr,
        NORMALIZE: tl.constexpr,
        KV_SAME: tl.constexpr,
        SEP_PREFIX: tl.constexpr,
        TIED: tl.constexpr,
        A_LOG: tl.constexpr,
        DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        bg = tl.program_id(1).to(tl.int64)
        G = H // HPG
        b = bg // G
        g = bg % G
        S = NK - P
        t0 = S - NQ
        n_prefix_blocks = tl.cdiv(P, BLOCK_N)
        is_prefix = pid_n < n_prefix_blocks
        # one row of the work buffer [3, B, H, Nq + Nk] (see distance_backward); the grid's second axis is B * G
        plane = tl.num_programs(1).to(tl.int64) * HPG * (NQ + NK)
        ip = tl.minimum(n_prefix_blocks - pid_n, 1)
        ip = tl.maximum(
            ip, 0
        )  # 1 for a prefix key block, else 0 (integer select: a scalar tl.where is not 0-d in triton 3.6's interpreter)
        # key tiles never straddle the prefix boundary: prefix blocks first, then sequence blocks from key P
        s0 = ip * (pid_n * BLOCK_N - P) + (1 - ip) * ((pid_n - n_prefix_blocks) * BLOCK_N)
        j0 = P + s0
        offs_n = tl.arange(0, BLOCK_N)
        j = j0 + offs_n
        s_k = s0 + offs_n
        key_ok = j < ip * P + (1 - ip) * NK
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)

        # the query rows that see this key block
        s_last = tl.minimum(s0 + BLOCK_N, S) - 1
        q_start, q_full_lo, q_full_hi, q_end = _query_range(s0, s_last, t0, NQ, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_M)
        p_start, p_full_lo, p_full_hi, p_end = _tile_range(0, 0, NQ - 1, NQ - 1, NQ, BLOCK_M)
        q_start = ip * p_start + (1 - ip) * q_start
        q_full_lo = ip * p_full_lo + (1 - ip) * q_full_lo
        q_full_hi = ip * p_full_hi + (1 - ip) * q_full_hi
        q_end = ip * p_end + (1 - ip) * q_end

        if not KV_SAME:
            v = _load_key_rows(
                V + b * svb + g * svh,
                svn,
                PV + b * spvb + g * spvh,
                spvn,
                j,
                P,
                key_ok,
                offs_dv,
                DV_,
                DV_PAD,
                SEP_PREFIX,
            )
        dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
        for hh in range(0, HPG):
            h = g * HPG + hh
            bh = b * H + h
            k = _load_key_rows(
                K + b * skb + h * skh, skn, PK + b * spkb + h * spkh, spkn, j, P, key_ok, offs_d, D, D_PAD, SEP_PREFIX
            )
            if KV_SAME:
                vt = k  # x is key and value: the tile is read once
            else:
                vt = v
            a_nat = tl.load(A + h).to(tl.float32)  # natural-log units; the scores use base 2
            if A_LOG:  # A holds log sigma_h: c_h = exp(-2 log sigma_h) / 2, as the forward forms it
                a_nat = 0.5 * tl.exp(-2.0 * a_nat)
            if TIED:  # the distance form (see the forward kernel)
                b_nat = -a_nat
                a_nat = 2.0 * a_nat
            else:
                b_nat = tl.load(BC + h).to(tl.float32)
            a = a_nat * 1.4426950408889634
            if KNORM:
                kf = k.to(tl.float32)
                kn = tl.sum(kf * kf, 1)  # ||k_j||^2 from the stationary tile: free here
            if HAS_KB:
                kb = tl.load(KB + bh * NK + j, mask=key_ok, other=float("-inf"))
            else:
                kb = tl.zeros([BLOCK_N], dtype=tl.float32)
            if KNORM_INLINE:
                kb += kn * (b_nat * 1.4426950408889634)
            if SCALAR:
                ks = tl.load(KS + b * sksb + h * sksh + j * sksn, mask=key_ok, other=0.0).to(tl.float32)
            else:
                ks = tl.zeros([BLOCK_N], dtype=tl.float32)
            dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
            c_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            dks_acc = tl.zeros([BLOCK_N, 4], dtype=tl.float32)  # 4 partial sums per key (see _lane_rowsum)
            Q_ptr = Q + b * sqb + h * sqh
            DO_ptr = DO + b * sdob + h * sdoh
            QS_ptr = QS + b * sqsb + h * sqsh
            BETA_ptr = BETA + b * sbb + h * sbh
            beta_h = 0.0
            if SCALAR:
                if not BETA_ROWS:  # one beta for the head's queries: formed here, not per query tile
                    if TAU_IN:
                        beta_h = tl.math.div_rn(1.0, tl.load(BETA_ptr).to(tl.float32)) * 1.4426950408889634
                    else:
                        beta_h = tl.load(BETA_ptr).to(tl.float32) * 1.4426950408889634
            dk, dv, c_acc, dks_acc = _dkdv_tiles(
                dk,
                dv,
                c_acc,
                dks_acc,
                k,
                vt,
                kb,
                ks,
                s_k,
                is_prefix,
                Q_ptr,
                DO_ptr,
                LSE + bh * NQ,
                WORK + 2 * plane + bh * (NQ + NK),
                QS_ptr,
                BETA_ptr,
                beta_h,
                sqn,
                sdon,
                sqsn,
                sbn,
                q_start,
                q_full_lo,
                t0,
                NQ,
                a,
                WINDOW,
                1,
                D,
                DV_,
                D_PAD,
                DV_PAD,
                BLOCK_M,
                CAUSAL,
                HAS_WINDOW,
                KEY_BIAS,
                SCALAR,
                TAU_IN,
                BETA_ROWS,
                NORMALIZE,
                DOT_PREC,
            )
            dk, dv, c_acc, dks_acc = _dkdv_tiles(
                dk,
                dv,
                c_acc,
                dks_acc,
                k,
                vt,
                kb,
                ks,
                s_k,
                is_prefix,
                Q_ptr,
                DO_ptr,
                LSE + bh * NQ,
                WORK + 2 * plane + bh * (NQ + NK),
                QS_ptr,
                BETA_ptr,
                beta_h,
                sqn,
                sdon,
                sqsn,
                sbn,
                q_full_lo,
                q_full_hi,
                t0,
                NQ,
                a,
                WINDOW,
                0,
                D,
                DV_,
                D_PAD,
                DV_PAD,
                BLOCK_M,
                CAUSAL,
                HAS_WINDOW,
                KEY_BIAS,
                SCALAR,
                TAU_IN,
                BETA_ROWS,
                NORMALIZE,
                DOT_PREC,
            )
            dk, dv, c_acc, dks_acc = _dkdv_tiles(
                dk,
                dv,
                c_acc,
                dks_acc,
                k,
                vt,
                kb,
                ks,
                s_k,
                is_prefix,
                Q_ptr,
                DO_ptr,
                LSE + bh * NQ,
                WORK + 2 * plane + bh * (NQ + NK),
                QS_ptr,
                BETA_ptr,
                beta_h,
                sqn,
                sdon,
                sqsn,
                sbn,
                q_full_hi,
                q_end,
                t0,
                NQ,
                a,
                WINDOW,
                1,
                D,
                DV_,
                D_PAD,
                DV_PAD,
                BLOCK_M,
                CAUSAL,
                HAS_WINDOW,
                KEY_BIAS,
                SCALAR,
                TAU_IN,
                BETA_ROWS,
                NORMALIZE,
                DOT_PREC,
            )
            # natural-log units: the kernels' scores carry log2(e); dS and the values do not
            dk = dk * a_nat
            # the key columns of the per-head reduction rows (see distance_backward): 0 for the dot coefficient, the
            # key-norm part of the norm coefficient's gradient C_j ||k_j||^2
            W_keys = WORK + bh * (NQ + NK) + NQ + j
            if KNORM:
                # k converted again rather than an fp32 copy kept live (registers) through the query loop
                dk += (2.0 * b_nat) * c_acc[:, None] * k.to(tl.float32)
                ckn = c_acc * kn
            else:
                ckn = tl.zeros([BLOCK_N], dtype=tl.float32)
            if TIED:  # one row: d/dc = 2 d/da - d/db
                if A_LOG:  # the row in units of log sigma (A_LOG, see distance_backward): dc/dlog sigma = -2c = 2 b
                    tl.store(W_keys, (-2.0 * b_nat) * ckn, mask=key_ok)
                else:
                    tl.store(W_keys, -ckn, mask=key_ok)
            else:
                tl.store(W_keys, tl.zeros([BLOCK_N], dtype=tl.float32), mask=key_ok)
                tl.store(W_keys + plane, ckn, mask=key_ok)
            if KV_SAME:
                dk += dv  # x is key and value: one gradient
                dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
            # the prefix gradient per batch element into DPK [B, H, P, D] (contiguous), summed by the caller
            _store_key_rows(
                dk, DK + b * sdkb + h * sdkh, sdkn, DPK + (b * H + h) * P * D, D, j, P, key_ok, offs_d, D, SEP_PREFIX
            )
            if STORE_DKB:
                tl.store(DKB + bh * NK + j, c_acc, mask=key_ok)
            if SCALAR:
                dks_val = (2.0 * 0.6931471805599453) * tl.sum(dks_acc, 1)  # 2 ln(2): see u
                tl.store(DKS + bh * NK + j, dks_val.to(DKS.dtype.element_ty), mask=key_ok)
        if not KV_SAME:
            _store_key_rows(
                dv,
                DV + b * sdvb + g * sdvh,
                sdvn,
                DPV + (b * G + g) * P * DV_,
                DV_,
                j,
                P,
                key_ok,
                offs_dv,
                DV_,
                SEP_PREFIX,
            )

    @triton.jit
    def _dq_tiles(
        dq,
        dacc,
        a1,
        b1,
        a2,
        b2,
        q,
        do,
        lse,
        delta,
        qs_r,
        beta_r,
        t_r,
        K_ptr,
        V_ptr,
        KB_ptr,
        KS_ptr,
        skn,
        svn,
        sksn,
        lo,
        hi,
        key_base,
        bound,
        a,
        kn_coef,
        WINDOW,
        MODE: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        D_PAD: tl.constexpr,
        DV_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        KNORM_INLINE: tl.constexpr,
        SCALAR: tl.constexpr,
        NORMALIZE: tl.constexpr,
        KV_SAME: tl.constexpr,
        NEED_DBETA: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """Key tiles for the dQ program; MODE as in the forward's ``_fwd_tiles``."""
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            j = key_base + offs_n
            col_ok = offs_n < bound
            k = _load_tile(K_ptr + j[:, None] * skn + offs_d[None, :], col_ok, offs_d, D, D_PAD, MODE != 0)
            s = _dot(q, tl.trans(k), None, DOT_PREC) * a
            if HAS_KB:
                s += tl.load(KB_ptr + j, mask=col_ok, other=float("-inf"))[None, :]
            if KNORM_INLINE:  # a load of its own: see kernels_common._row_sq_norms
                kn = _row_sq_norms(K_ptr + j[:, None] * skn + offs_d[None, :], col_ok, offs_d, D, D_PAD, MODE != 0)
                s += (kn * kn_coef)[None, :]
            if SCALAR:
                if MODE == 0:
                    ks = tl.load(KS_ptr + j * sksn).to(tl.float32)
                else:
                    ks = tl.load(KS_ptr + j * sksn, mask=col_ok, other=0.0).to(tl.float32)
                dd = qs_r[:, None] - ks[None, :]
                dd2 = dd * dd
                # lse first: a q.k . a - lse_i fma, then the scalar term's fma
                s = (s - lse[:, None]) - dd2 * (beta_r * 1.4426950408889634)[:, None]
            if MODE == 1:
                ok = _allowed(t_r[:, None], offs_n[None, :], WINDOW, CAUSAL, HAS_WINDOW) & col_ok[None, :]
                s = tl.where(ok, s, float("-inf"))
            elif MODE == 2:
                s = tl.where(col_ok[None, :], s, float("-inf"))
            if SCALAR:
                p = tl.math.exp2(s)
            else:
                p = tl.math.exp2(s - lse[:, None])
            if KV_SAME:
                v = k
            else:
                v = _load_tile(V_ptr + j[:, None] * svn + offs_dv[None, :], col_ok, offs_dv, DV, DV_PAD, MODE != 0)
            dp = _dot(do, tl.trans(v), None, DOT_PREC)
            if NORMALIZE:
                ds = p * (dp - delta[:, None])
            else:
                ds = p * dp
            dq = _dot(ds.to(k.dtype), k, dq, DOT_PREC)
            if SCALAR:
                # Row sums for the scalar-query / temperature gradients with the *exact* delta*_i = sum_j W_ij dP_ij
                # (the dS above uses delta_i = dO.O with O rounded to the input dtype, which in bf16 costs the
                # temperature gradient, a sum of cancelling terms, several per cent).  With that dS:
                # sum_j W_ij (dP_ij - delta*_i) d_ij^k = A_k - (delta*_i - delta_i) B_k, A_k = sum_j dS_ij d_ij^k,
                # B_k = sum_j W_ij d_ij^k, and delta*_i - delta_i = sum_j dS_ij + delta_i (sum_j W_ij - 1) (dacc
                # sums dS; see the caller).  dS serves as it is (no W dP product per pair) and the correction is
                # small (delta*_i - delta_i is delta's rounding error).  Softmax-free: dS = W dP has no delta, so A1
                # and A2 are the sums themselves.
                dacc += _lane_rowsum(ds)
                a1 += _lane_rowsum(ds * dd)
                if NORMALIZE:
                    b1 += _lane_rowsum(p * dd)
                if NEED_DBETA:
                    a2 += _lane_rowsum(ds * dd2)
                    if NORMALIZE:
                        b2 += _lane_rowsum(p * dd2)
        return dq, dacc, a1, b1, a2, b2

    @triton.jit
    def _distance_bwd_dq_kernel(
        Q,
        K,
        V,
        KB,
        QS,
        KS,
        BETA,
        A,
        BC,
        PK,
        PV,
        DO,
        LSE,
        WORK,
        OUT,
        DQ,
        DQS,
        DBETA,
        sqb,
        sqh,
        sqn,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sdob,
        sdoh,
        sdon,
        sqsb,
        sqsh,
        sqsn,
        sksb,
        sksh,
        sksn,
        sbb,
        sbh,
        sbn,
        spkb,
        spkh,
        spkn,
        spvb,
        spvh,
        spvn,
        sdqb,
        sdqh,
        sdqn,
        sob,
        soh,
        son,
        H,
        HPG,
        NQ,
        NK,
        P,
        WINDOW,
        LOG2_EPS,
        N_BUCKET,
        PLANES,
        D: tl.constexpr,
        DV: tl.constexpr,
        D_PAD: tl.constexpr,
        DV_PAD: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        KNORM_INLINE: tl.constexpr,
        QNORM: tl.constexpr,
        SCALAR: tl.constexpr,
        TAU_IN: tl.constexpr,
        NORMALIZE: tl.constexpr,
        HAS_EPS: tl.constexpr,
        KV_SAME: tl.constexpr,
        NEED_DBETA: tl.constexpr,
        SEP_PREFIX: tl.constexpr,
        TIED: tl.constexpr,
        A_LOG: tl.constexpr,
        DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        g = h // HPG
        S = NK - P
        t0 = S - NQ
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < NQ
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        q = _load_tile(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], row_ok, offs_d, D, D_PAD, True)
        do = _load_tile(
            DO + b * sdob + h * sdoh + offs_m[:, None] * sdon + offs_dv[None, :], row_ok, offs_dv, DV, DV_PAD, True
        )
        lse = tl.load(LSE + bh * NQ + offs_m, mask=row_ok, other=float("inf"))
        # delta_i = dO_i . O_i (fp32) from this row block's tiles: no pre-pass launch (the dK/dV kernel, which runs
        # after this one, reads it from the work buffer)
        o = _load_tile(
            OUT + b * sob + h * soh + offs_m[:, None] * son + offs_dv[None, :], row_ok, offs_dv, DV, DV_PAD, True
        )
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        # the work buffer [3, B, H, Nq + Nk] (see distance_backward): row 0 the q.k gradient, 1 the query-norm
        # gradient, 2 delta; the grid's second axis is B * H
        plane = tl.num_programs(1).to(tl.int64) * (NQ + NK)
        W_rows = WORK + bh * (NQ + NK) + offs_m
        a_nat = tl.load(A + h).to(tl.float32)  # natural-log units; the scores use base 2
        if A_LOG:  # A holds log sigma_h: c_h = exp(-2 log sigma_h) / 2, as the forward forms it
            a_nat = 0.5 * tl.exp(-2.0 * a_nat)
        if TIED:  # the distance form (see the forward kernel)
            b_nat = -a_nat
            a_nat = 2.0 * a_nat
        else:
            b_nat = tl.load(BC + h).to(tl.float32)
        a = a_nat * 1.4426950408889634
        b_log2 = b_nat * 1.4426950408889634
        if SCALAR:
            qs_r = tl.load(QS + b * sqsb + h * sqsh + offs_m * sqsn, mask=row_ok, other=0.0).to(tl.float32)
            if TAU_IN:  # the scalar tensor holds tau: beta = 1 / tau, IEEE-rounded (torch's 1 / tau; `/` is div.full)
                tau_r = tl.load(BETA + b * sbb + h * sbh + offs_m * sbn, mask=row_ok, other=1.0).to(tl.float32)
                beta_r = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tau_r)
            else:
                beta_r = tl.load(BETA + b * sbb + h * sbh + offs_m * sbn, mask=row_ok, other=0.0).to(tl.float32)
        else:
            qs_r = tl.zeros([BLOCK_M], dtype=tl.float32)
            beta_r = tl.zeros([BLOCK_M], dtype=tl.float32)
        dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        # the scalar term's row sums as 4 partial sums per row (see _lane_rowsum), added up after the loops
        dacc = tl.zeros([BLOCK_M, 4], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_M, 4], dtype=tl.float32)
        b1 = tl.zeros([BLOCK_M, 4], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_M, 4], dtype=tl.float32)
        b2 = tl.zeros([BLOCK_M, 4], dtype=tl.float32)
        t_r = t0 + offs_m
        PK_ptr, PV_ptr, pkn, pvn, K_seq, V_seq = _key_value_bases(
            K, V, PK, PV, b, h, g, skb, skh, skn, svb, svh, svn, spkb, spkh, spkn, spvb, spvh, spvn, P, SEP_PREFIX
        )
        KB_ptr = KB + bh * NK
        KS_ptr = KS + b * sksb + h * sksh

        dq, dacc, a1, b1, a2, b2 = _dq_tiles(
            dq,
            dacc,
            a1,
            b1,
            a2,
            b2,
            q,
            do,
            lse,
            delta,
            qs_r,
            beta_r,
            t_r,
            PK_ptr,
            PV_ptr,
            KB_ptr,
            KS_ptr,
            pkn,
            pvn,
            sksn,
            0,
            P,
            0,
            P,
            a,
            b_log2,
            WINDOW,
            2,
            D,
            DV,
            D_PAD,
            DV_PAD,
            BLOCK_N,
            CAUSAL,
            HAS_WINDOW,
            HAS_KB,
            KNORM_INLINE,
            SCALAR,
            NORMALIZE,
            KV_SAME,
            NEED_DBETA,
            DOT_PREC,
        )
        t_first = t0 + pid_m * BLOCK_M
        t_last = t0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
        start, full_lo, full_hi, end = _key_range(t_first, t_last, S, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_N)
        dq, dacc, a1, b1, a2, b2 = _dq_tiles(
            dq,
            dacc,
            a1,
            b1,
            a2,
            b2,
            q,
            do,
            lse,
            delta,
            qs_r,
            beta_r,
            t_r,
            K_seq,
            V_seq,
            KB_ptr,
            KS_ptr,
            skn,
            svn,
            sksn,
            start,
            full_lo,
            P,
            S,
            a,
            b_log2,
            WINDOW,
            1,
            D,
            DV,
            D_PAD,
            DV_PAD,
            BLOCK_N,
            CAUSAL,
            HAS_WINDOW,
            HAS_KB,
            KNORM_INLINE,
            SCALAR,
            NORMALIZE,
            KV_SAME,
            NEED_DBETA,
            DOT_PREC,
        )
        dq, dacc, a1, b1, a2, b2 = _dq_tiles(
            dq,
            dacc,
            a1,
            b1,
            a2,
            b2,
            q,
            do,
            lse,
            delta,
            qs_r,
            beta_r,
            t_r,
            K_seq,
            V_seq,
            KB_ptr,
            KS_ptr,
            skn,
            svn,
            sksn,
            full_lo,
            full_hi,
            P,
            S,
            a,
            b_log2,
            WINDOW,
            0,
            D,
            DV,
            D_PAD,
            DV_PAD,
            BLOCK_N,
            CAUSAL,
            HAS_WINDOW,
            HAS_KB,
            KNORM_INLINE,
            SCALAR,
            NORMALIZE,
            KV_SAME,
            NEED_DBETA,
            DOT_PREC,
        )
        dq, dacc, a1, b1, a2, b2 = _dq_tiles(
            dq,
            dacc,
            a1,
            b1,
            a2,
            b2,
            q,
            do,
            lse,
            delta,
            qs_r,
            beta_r,
            t_r,
            K_seq,
            V_seq,
            KB_ptr,
            KS_ptr,
            skn,
            svn,
            sksn,
            full_hi,
            end,
            P,
            S,
            a,
            b_log2,
            WINDOW,
            1,
            D,
            DV,
            D_PAD,
            DV_PAD,
            BLOCK_N,
            CAUSAL,
            HAS_WINDOW,
            HAS_KB,
            KNORM_INLINE,
            SCALAR,
            NORMALIZE,
            KV_SAME,
            NEED_DBETA,
            DOT_PREC,
        )

        qf = q.to(tl.float32)
        # sum_ij dS_ij q_i.k_j per row: the gradient of the dot coefficient
        qr = tl.sum(qf * dq, 1)
        dq = dq * a_nat
        if QNORM:
            qn = tl.sum(qf * qf, 1)
            if NORMALIZE:
                if HAS_EPS:
                    e = LOG2_EPS - qn * b_log2
                    rs = delta * tl.math.exp2(e - lse)
                else:
                    rs = tl.zeros([BLOCK_M], dtype=tl.float32)
            else:
                rs = delta
            dq += (2.0 * b_nat) * rs[:, None] * qf
            rsq = rs * qn
        else:
            rsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        if TIED:  # one row: d/dc = 2 d/da - d/db
            if A_LOG:  # the row in units of log sigma (A_LOG, see distance_backward): dc/dlog sigma = -2c = 2 b
                tl.store(W_rows, (2.0 * b_nat) * (2.0 * qr - rsq), mask=row_ok)
            else:
                tl.store(W_rows, 2.0 * qr - rsq, mask=row_ok)
        else:
            tl.store(W_rows, qr, mask=row_ok)
            tl.store(W_rows + plane, rsq, mask=row_ok)
        tl.store(
            DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqn + offs_d[None, :],
            dq.to(DQ.dtype.element_ty),
            mask=row_ok[:, None] & (offs_d[None, :] < D),
        )
        if SCALAR:
            dacc = tl.sum(dacc, 1)
            a1 = tl.sum(a1, 1)
            b1 = tl.sum(b1, 1)
            a2 = tl.sum(a2, 1)
            b2 = tl.sum(b2, 1)
            if NORMALIZE:  # sum_j W_ij (dP_ij - delta*_i) d_ij^k = A_k - (delta*_i - delta_i) B_k (see _dq_tiles)
                if HAS_EPS:  # sum_j W_ij = 1 - eps 2^(-r_i - lse_i) (the closed form of rowsum(dS) above)
                    if QNORM:
                        e_w = LOG2_EPS - qn * b_log2
                    else:
                        e_w = LOG2_EPS
                    dacc -= delta * tl.math.exp2(e_w - lse)
                a1 -= dacc * b1
                a2 -= dacc * b2
                dacc += delta  # the exact delta*
            dqs_val = -2.0 * beta_r * a1
            tl.store(DQS + bh * NQ + offs_m, dqs_val.to(DQS.dtype.element_ty), mask=row_ok)
            if NEED_DBETA:  # d/dbeta = -a2; with TAU_IN the tau gradient -beta^2 d/dbeta instead
                tl.store(DBETA + bh * NQ + offs_m, a2 * beta_r * beta_r if TAU_IN else -a2, mask=row_ok)
            # the exact delta, not the rounded one, for the dK/dV kernel, which runs after this one
            tl.store(W_rows + 2 * plane, dacc, mask=row_ok)
        else:
            tl.store(W_rows + 2 * plane, delta, mask=row_ok)

    _BWD_KEY = ["D_PAD", "DV_PAD", "N_BUCKET", "PLANES", "CAUSAL", "HAS_WINDOW", "SCALAR", "NORMALIZE", "KV_SAME"]
    _distance_bwd_dkdv = autotune(make_configs(DKDV_CONFIGS, _INTERPRET_CONFIG_DKDV), _BWD_KEY, _prune_dkdv)(
        _distance_bwd_dkdv_kernel
    )
    _distance_bwd_dq = autotune(make_configs(DQ_CONFIGS, _INTERPRET_CONFIG_DQ), _BWD_KEY, _prune_dq)(
        _distance_bwd_dq_kernel
    )


def backward_plan_key(tensors, kb, qs, b, prefix, dbeta, device, *options):
    """``(key, addresses)`` of a backward's two launches (see ``kernels_flash_fwd.forward_plan_key``): the signature
    of every tensor either launch takes (inputs and fresh outputs), which are absent, the device, ``options`` (the
    flags of :func:`distance_backward` the launches read) and tf32."""
    signature, pointers = tensor_signature(tensors)
    absent = (kb is None, qs is None, b is None, prefix is None, dbeta is None)
    return (signature, device, absent, options, dot_precision(tensors[0].dtype)), pointers


def distance_backward(
    dout,
    q,
    k,
    v,
    kb,
    qs,
    ks,
    beta,
    a,
    b,
    out,
    lse,
    *,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    need_dbeta,
    need_ab=True,
    need_dkb=True,
    prefix=None,
    knorm_inline=None,
    tau_in=False,
    a_log=False,
    traced=False,
):
    """Gradients of :func:`kernels_flash_fwd.distance_forward`: two launches (dQ, then dK/dV) and one sum.

    ``kb``: the key-bias vector of the forward (key log-weights, padding, and with ``knorm`` the key norms), or
    None: then the key norms (``knorm``) are computed from the key tiles inside the kernels, as in the forward.
    ``prefix``: None or the separate prefix keys / values ``(pk, pv)`` of the forward (see ``distance_forward``);
    ``knorm_inline``: the forward's choice (default: ``knorm`` without ``kb``); ``tau_in``: ``beta`` holds the
    temperature ``tau`` (the kernels take ``1 / tau``, and ``dbeta`` is then ``tau``'s gradient); ``a_log`` (the
    distance form only): ``a`` holds the learnable log bandwidths ``log sigma_h`` (GKA), the kernels form ``c_h =
    exp(-2 log sigma_h) / 2`` as the forward did, and ``dab`` is ``log sigma``'s gradient, each row's term multiplied
    by ``dc / dlog sigma = -2 c_h`` in the kernels (no torch ops for the conversion per call: see
    ``attention_distance_triton._DistanceFunction``); ``traced``: called
    from the ``triton_op`` that ``torch.compile`` traces (``attention_distance_triton.distance_bwd_t``): the launches
    go through ``wrap_triton`` (see ``distance_forward``).

    Returns ``dq, dk, dv, dkb, dab, dqs, dks, dbeta``: ``dq``/``dk``/``dv`` in the inputs' dtypes (with ``kv_same``
    ``dk`` holds key plus value gradient and ``dv`` is empty); fp32 ``dkb [B,H,Nk]`` (``sum_i dS_ij``, the key
    log-weights' gradient: with ``kb`` and ``need_dkb`` only), ``dab [2, H]`` (the per-head gradients of the dot
    coefficient ``a`` and the norm coefficient ``b``, ``need_ab`` only; ``[1, H]``, the gradient of ``a``, for the
    distance form ``b = None``: see ``distance_forward``), ``dqs [B,H,Nq]``, ``dks [B,H,Nk]`` (in qs's / ks's dtypes),
    ``dbeta [B,H,Nq]`` (scalar term, natural-log-score gradients; of ``tau`` with ``tau_in``), ``dpk``, ``dpv``
    (the separate prefix's gradients in its shapes and dtype: summed over the batch when it is shared).  Unused
    outputs are None (no allocation: the custom op ``distance_bwd`` turns them into the empty tensors its schema needs).

    The per-head gradients are sums over the batch and the rows or keys of per-row and per-key terms written by the
    kernels into one fp32 work buffer ``[3, B, H, Nq + Nk]`` (query columns, then key columns):

    * row 0: ``sum_j dS_ij q_i.k_j`` per query (dQ kernel), 0 per key (dK/dV kernel): ``da``;
    * row 1: ``rowsum(dS)_i ||q_i||^2`` per query (query norm) and ``sum_i dS_ij ||k_j||^2`` per key (key norm),
      0 where the term is absent: ``db``;
    * row 2: ``delta_i = dO_i . O_i`` per query, computed by the dQ kernel and read by the dK/dV kernel.

    In the distance form (``b`` None, ``a_h = 2 c_h``, ``b_h = -c_h``) row 0 holds ``2 (row 0) - (row 1)`` of the
    above, the gradient of ``c_h``, and row 1 is unused.  So ``dab`` is one ``sum`` over ``(B, Nq + Nk)`` of rows
    0-1 (row 0).  Why not fp32 atomics into an ``[H]`` buffer: that
    buffer would need zeroing (a fill launch, or a kernel that runs before the dQ kernel, which now also computes
    delta) and the order of the additions, so the per-head gradients, would change from run to run; one buffer and
    one deterministic ``sum`` is the same number of launches.
    """
    bsz, heads, nq, d = q.shape
    nk = k.shape[2] + (num_prefix_keys if prefix is not None else 0)  # every key, the prefix included
    groups, dv_dim = v.shape[1], v.shape[3]
    dev = q.device
    f32 = {"device": dev, "dtype": torch.float32}
    scalar = qs is not None
    store_dkb = kb is not None and need_dkb

    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = None if kv_same else torch.empty_like(v)
    work = torch.empty(3, bsz, heads, nq + nk, **f32)
    dkb = torch.empty(bsz, heads, nk, **f32) if store_dkb else None
    # the scalar gradients in qs's / ks's dtypes (the kernels cast at the store): no cast op per call after them
    dqs = torch.empty(bsz, heads, nq, device=dev, dtype=qs.dtype) if scalar else None
    dks = torch.empty(bsz, heads, nk, device=dev, dtype=ks.dtype) if scalar else None
    dbeta = torch.empty(bsz, heads, nq, **f32) if scalar and need_dbeta else None
    dpk = dpv = None
    if prefix is not None:
        # per batch element (each dK/dV program writes its own); fp32 when a sum over a shared prefix follows
        pk, pv = prefix
        shared = pk.shape[0] == 1 and bsz > 1
        dpk = torch.empty(bsz, heads, num_prefix_keys, d, device=dev, dtype=torch.float32 if shared else pk.dtype)
        if not kv_same:
            dpv = torch.empty(bsz, groups, num_prefix_keys, dv_dim, device=dev, dtype=dpk.dtype)
    if nq == 0 or nk == 0:  # no scores: every gradient is 0 (not the hot path)
        dab = torch.zeros(1 if b is None else 2, heads, **f32) if need_ab else None
        if prefix is not None:
            dpk = torch.zeros_like(prefix[0])
            dpv = None if kv_same else torch.zeros_like(prefix[1])
        outs = (dq, dk, dv, dkb, dab, dqs, dks, dbeta, dpk, dpv)
        return tuple(None if t is None else t.zero_() for t in outs)
    dvt = dv if not kv_same else dk
    ins = (*launch_inputs(q, k, v, kb, qs, ks, beta, a, b, prefix), dout, lse, work)
    outs_q = (out, dq, dqs if scalar else a, dbeta if dbeta is not None else a)
    outs_kv = (
        dk,
        dvt,
        dkb if store_dkb else a,
        dks if scalar else a,
        dpk if dpk is not None else a,
        dpv if dpv is not None else a,
    )
    args_q_t, args_kv_t = ins + outs_q, ins + outs_kv  # the tensors of each launch, in its order
    plan_key = None
    planned = None
    if not traced:  # a call signature launched before: its plans (see kernels_launch.direct_plan; GPU only)
        device = torch.cuda.current_device() if q.is_cuda else -1
        plan_key, pointers = backward_plan_key(
            ins + outs_q + outs_kv, kb, qs, b, prefix, dbeta, device,
            causal, window, num_prefix_keys, normalize, qnorm, knorm, kv_same, eps, store_dkb, knorm_inline, tau_in,
            a_log,
        )  # fmt: skip
        planned = _BWD_PLANS.get(plan_key)  # (none on the CPU: direct_plan makes none there)
        if planned is not None and not (plan_allowed(planned[0]) and plan_allowed(planned[1])):
            planned = None
    if planned is not None:
        n_in = len(ins)
        launch_plan(planned[0], pointers[: n_in + len(outs_q)], device)
        launch_plan(planned[1], pointers[:n_in] + pointers[n_in + len(outs_q) :], device)
    else:
        _, _, sprefix = prefix_args(prefix, k, v, bsz)
        if scalar:
            sqs = bcast_strides(qs, (bsz, heads, nq))
            sks = bcast_strides(ks, (bsz, heads, nk))
            sbeta = bcast_strides(beta, (bsz, heads, nq))
        else:
            sqs = sks = sbeta = (0, 0, 0)
        strides = (
            (
                *q.stride()[:3],
                *k.stride()[:3],
                *v.stride()[:3],
                *dout.stride()[:3],
            )
            + sqs
            + sks
            + sbeta
            + sprefix
        )
        common = {
            "D_PAD": padded_dim(d),
            "DV_PAD": padded_dim(dv_dim),
            "CAUSAL": causal,
            "HAS_WINDOW": window is not None,
            "HAS_KB": kb is not None,
            "KNORM_INLINE": (knorm and kb is None) if knorm_inline is None else knorm_inline,
            "SCALAR": scalar,
            "TAU_IN": scalar and tau_in,
            "NORMALIZE": normalize,
            "KV_SAME": kv_same,
            "SEP_PREFIX": prefix is not None,
            "TIED": b is None,
            "A_LOG": b is None and a_log,
            "DOT_PREC": dot_precision(q.dtype),
        }
        sizes = (heads, heads // groups, nq, nk, num_prefix_keys, window or 0)  # both kernels' H .. WINDOW
        nb = n_bucket(max(nq, nk))
        planes = planes_bucket(bsz * heads)
        grid_q = lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), bsz * heads)  # noqa: E731
        args_q = (
            *ins,
            *outs_q,
            *strides,
            *dq.stride()[:3],
            *out.stride()[:3],
            *sizes,
            math.log2(eps) if eps > 0 else 0.0,
            nb,
            planes,
        )
        kw_q = dict(
            D=d,
            DV=dv_dim,
            QNORM=qnorm,
            HAS_EPS=normalize and eps > 0,
            NEED_DBETA=dbeta is not None,
            **common,
        )
        if traced:
            wrap_triton(_distance_bwd_dq)[grid_q](*args_q, **kw_q)
        else:
            launch_tuned(_distance_bwd_dq, grid_q, *args_q, **kw_q)
            plan_q = None if plan_key is None else direct_plan(_distance_bwd_dq, grid_q, args_q, kw_q, len(args_q_t))
        grid_kv = key_block_grid(num_prefix_keys, nk, bsz * groups)
        args_kv = (
            *ins,
            *outs_kv,
            *strides,
            *dk.stride()[:3],
            *dvt.stride()[:3],
            *sizes,
            nb,
            planes,
        )
        kw_kv = dict(
            D=d,
            DV_=dv_dim,
            KNORM=knorm,
            KEY_BIAS=kb is not None or knorm,  # a key-bias term in the scores (loaded, inline, or both)
            STORE_DKB=store_dkb,
            # a beta per query (else one per head, e.g. the hybrid's per-head tau: formed once per head, not per tile)
            BETA_ROWS=bool(scalar and nq > 1 and sbeta[2] != 0),
            **common,
        )
        if traced:
            wrap_triton(_distance_bwd_dkdv)[grid_kv](*args_kv, **kw_kv)
        else:
            launch_tuned(_distance_bwd_dkdv, grid_kv, *args_kv, **kw_kv)
            plan_kv = None
            if plan_key is not None:
                plan_kv = direct_plan(_distance_bwd_dkdv, grid_kv, args_kv, kw_kv, len(args_kv_t))
            if plan_q is not None and plan_kv is not None:
                keep_plan(_BWD_PLANS, plan_key, (plan_q, plan_kv))
    # the tied form (b None) has its one coefficient's terms in row 0 alone
    dab = work[: 1 if b is None else 2].sum(dim=(1, 3)) if need_ab else None
    if prefix is not None and shared:
        dpk = dpk.sum(0, keepdim=True).to(prefix[0].dtype)
        dpv = None if dpv is None else dpv.sum(0, keepdim=True).to(prefix[1].dtype)
    return dq, dk, dv, dkb, dab, dqs, dks, dbeta, dpk, dpv


# call signature -> (kernels_launch.direct_plan of the dQ launch, of the dK/dV launch)
_BWD_PLANS: dict = {}
