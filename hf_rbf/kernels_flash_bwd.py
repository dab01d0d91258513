"""Flash-style backward kernels shared by RBF, GKA and hybrid attention (FlashAttention-2 layout, no atomics).

With ``W_ij = 2^(s_ij - lse_i)`` from the forward, ``dP_ij = dO_i . v_j`` and ``delta_i = dO_i . O_i`` the gradient of
the natural-log score is ``dS_ij = W_ij (dP_ij - delta_i)`` (softmax, with or without GKA's eps) or
``W_ij dP_ij`` (softmax-free).  Three launches:

1. ``_bwd_preprocess_kernel``: ``delta_i`` (fp32).
2. ``_distance_bwd_dkdv_kernel``: one program per key block and *value group*; K, V stationary, query tiles
   streamed (the allowed rows of a key block are an interval: the same masked / unmasked / masked split as the
   forward).  The heads of a value group run one after the other in the program so that grouped values (the
   hybrid's ``[B, G, Nk, Dv]``) get ``dV`` summed over their heads without atomics.  It also writes the per-key
   sums ``C_j = sum_i dS_ij`` (the gradient of the key bias: key log-weights, the key-norm coefficient) and the
   scalar-key gradient.
3. ``_distance_bwd_dq_kernel``: one program per query block; key tiles streamed as in the forward.  Besides ``dQ``
   it writes per-row partial sums for the per-head parameter gradients (``q_i . sum_j dS_ij k_j`` and
   ``rowsum(dS)_i ||q_i||^2``), the scalar-query gradient and (on request) the ``beta = 1/tau`` gradient.

Per-head gradients are then sums of those fp32 vectors (done by the caller): no atomics anywhere.

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
    autotune_enabled,
    autotune_subset,
    dot_precision,
    launch_tuned,
    make_configs,
    n_bucket,
    padded_dim,
    shared_memory_fits,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .kernels_common import _allowed, _dot, _key_range, _load_tile, _query_range, _tile_range


# dK/dV: BLOCK_N stationary keys, BLOCK_M streamed queries.  The Triton tutorial's Hopper choice (128 keys x 32
# queries, 4 warps) first; 64 x 64 for the larger head dims; 64 x 32 with 8 warps keeps head dim 256 in registers.
DKDV_CONFIGS = [
    ({"BLOCK_N": 128, "BLOCK_M": 32}, 4, 3),
    ({"BLOCK_N": 64, "BLOCK_M": 64}, 4, 3),
    ({"BLOCK_N": 128, "BLOCK_M": 64}, 8, 3),
    ({"BLOCK_N": 64, "BLOCK_M": 32}, 4, 2),
    ({"BLOCK_N": 64, "BLOCK_M": 32}, 8, 2),
]
# dQ: BLOCK_M stationary queries, BLOCK_N streamed keys (the tutorial's 128 x 32 first).
DQ_CONFIGS = [
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

    @triton.jit
    def _bwd_preprocess_kernel(
        OUT, DO, DELTA, sob, soh, son, sdb, sdh, sdn, H, NQ, DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        offs_dv = tl.arange(0, DV_PAD)
        ok = offs < NQ
        o = _load_tile(OUT + b * sob + h * soh + offs[:, None] * son + offs_dv[None, :], ok, offs_dv, DV, DV_PAD, True)
        do = _load_tile(DO + b * sdb + h * sdh + offs[:, None] * sdn + offs_dv[None, :], ok, offs_dv, DV, DV_PAD, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh * NQ + offs, delta, mask=ok)

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
        NORMALIZE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """Query tiles ``lo .. hi`` against the stationary key tile (transposed scores ``[BLOCK_N, BLOCK_M]``).

        MODE 0: every row valid and allowed; 1: rows masked by bounds and position (prefix key blocks: bounds only).
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
                qs = tl.load(QS_ptr + offs_m * sqsn, mask=row_ok, other=0.0).to(tl.float32)
                beta = tl.load(BETA_ptr + offs_m * sbn, mask=row_ok, other=0.0).to(tl.float32)
                dd = qs[None, :] - ks[:, None]
                sT -= dd * dd * (beta * 1.4426950408889634)[None, :]
            if MODE == 1:
                ok = row_ok[None, :] & (
                    _allowed((t0 + offs_m)[None, :], s_k[:, None], WINDOW, CAUSAL, HAS_WINDOW) | is_prefix
                )
                sT = tl.where(ok, sT, float("-inf"))
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
                dks_acc += tl.sum(dsT * dd * beta[None, :], 1)
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
        DO,
        LSE,
        DELTA,
        DK,
        DV,
        DKB,
        CKN,
        DKS,
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
        SCALAR: tl.constexpr,
        NORMALIZE: tl.constexpr,
        KV_SAME: tl.constexpr,
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
            v = _load_tile(
                V + b * svb + g * svh + j[:, None] * svn + offs_dv[None, :], key_ok, offs_dv, DV_, DV_PAD, True
            )
        dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
        for hh in range(0, HPG):
            h = g * HPG + hh
            bh = b * H + h
            k = _load_tile(K + b * skb + h * skh + j[:, None] * skn + offs_d[None, :], key_ok, offs_d, D, D_PAD, True)
            if KV_SAME:
                vt = k  # x is key and value: the tile is read once
            else:
                vt = v
            a_nat = tl.load(A + h).to(tl.float32)  # natural-log units; the scores use base 2
            a = a_nat * 1.4426950408889634
            b_nat = tl.load(BC + h).to(tl.float32)
            if KNORM:
                kf = k.to(tl.float32)
                kn = tl.sum(kf * kf, 1)  # ||k_j||^2 from the stationary tile: free here
            if HAS_KB:
                kb = tl.load(KB + bh * NK + j, mask=key_ok, other=float("-inf"))
            elif KNORM_INLINE:
                kb = kn * (b_nat * 1.4426950408889634)
            else:
                kb = tl.zeros([BLOCK_N], dtype=tl.float32)
            if SCALAR:
                ks = tl.load(KS + b * sksb + h * sksh + j * sksn, mask=key_ok, other=0.0).to(tl.float32)
            else:
                ks = tl.zeros([BLOCK_N], dtype=tl.float32)
            dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
            c_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            dks_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            Q_ptr = Q + b * sqb + h * sqh
            DO_ptr = DO + b * sdob + h * sdoh
            QS_ptr = QS + b * sqsb + h * sqsh
            BETA_ptr = BETA + b * sbb + h * sbh
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
                DELTA + bh * NQ,
                QS_ptr,
                BETA_ptr,
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
                DELTA + bh * NQ,
                QS_ptr,
                BETA_ptr,
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
                DELTA + bh * NQ,
                QS_ptr,
                BETA_ptr,
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
                NORMALIZE,
                DOT_PREC,
            )
            # natural-log units: the kernels' scores carry log2(e); dS and the values do not
            dk = dk * a_nat
            if KNORM:
                dk += (2.0 * b_nat) * c_acc[:, None] * kf
                # the key-norm part of the norm coefficient's gradient, sum_j C_j ||k_j||^2, per key
                tl.store(CKN + bh * NK + j, c_acc * kn, mask=key_ok)
            if KV_SAME:
                dk += dv  # x is key and value: one gradient
                dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
            dk_mask = key_ok[:, None] & (offs_d[None, :] < D)
            tl.store(
                DK + b * sdkb + h * sdkh + j[:, None] * sdkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=dk_mask
            )
            if HAS_KB:
                tl.store(DKB + bh * NK + j, c_acc, mask=key_ok)
            if SCALAR:
                tl.store(DKS + bh * NK + j, 2.0 * dks_acc, mask=key_ok)
        if not KV_SAME:
            tl.store(
                DV + b * sdvb + g * sdvh + j[:, None] * sdvn + offs_dv[None, :],
                dv.to(DV.dtype.element_ty),
                mask=key_ok[:, None] & (offs_dv[None, :] < DV_),
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
            if KNORM_INLINE:
                kf = k.to(tl.float32)
                s += (tl.sum(kf * kf, 1) * kn_coef)[None, :]
            if SCALAR:
                ks = tl.load(KS_ptr + j * sksn, mask=col_ok, other=0.0).to(tl.float32)
                dd = qs_r[:, None] - ks[None, :]
                s -= dd * dd * (beta_r * 1.4426950408889634)[:, None]
            if MODE == 1:
                ok = _allowed(t_r[:, None], offs_n[None, :], WINDOW, CAUSAL, HAS_WINDOW) & col_ok[None, :]
                s = tl.where(ok, s, float("-inf"))
            elif MODE == 2:
                s = tl.where(col_ok[None, :], s, float("-inf"))
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
                # Row sums for the scalar-query / temperature gradients with the *exact* delta_i = sum_j W_ij dP_ij
                # (the dS above uses dO.O with O rounded to the input dtype, which in bf16 costs the temperature
                # gradient, a sum of cancelling terms, several per cent): sum_j dS_ij d_ij = A1_i - delta_i B1_i.
                pd = p * dp
                dacc += tl.sum(pd, 1)
                a1 += tl.sum(pd * dd, 1)
                b1 += tl.sum(p * dd, 1)
                if NEED_DBETA:
                    dd2 = dd * dd
                    a2 += tl.sum(pd * dd2, 1)
                    b2 += tl.sum(p * dd2, 1)
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
        DO,
        LSE,
        DELTA,
        DQ,
        QR,
        RSQ,
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
        sdqb,
        sdqh,
        sdqn,
        H,
        HPG,
        NQ,
        NK,
        P,
        WINDOW,
        LOG2_EPS,
        N_BUCKET,
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
        NORMALIZE: tl.constexpr,
        HAS_EPS: tl.constexpr,
        KV_SAME: tl.constexpr,
        NEED_DBETA: tl.constexpr,
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
        delta = tl.load(DELTA + bh * NQ + offs_m, mask=row_ok, other=0.0)
        a_nat = tl.load(A + h).to(tl.float32)  # natural-log units; the scores use base 2
        a = a_nat * 1.4426950408889634
        b_nat = tl.load(BC + h).to(tl.float32)
        b_log2 = b_nat * 1.4426950408889634
        if SCALAR:
            qs_r = tl.load(QS + b * sqsb + h * sqsh + offs_m * sqsn, mask=row_ok, other=0.0).to(tl.float32)
            beta_r = tl.load(BETA + b * sbb + h * sbh + offs_m * sbn, mask=row_ok, other=0.0).to(tl.float32)
        else:
            qs_r = tl.zeros([BLOCK_M], dtype=tl.float32)
            beta_r = tl.zeros([BLOCK_M], dtype=tl.float32)
        dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        dacc = tl.zeros([BLOCK_M], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        b1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        b2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        t_r = t0 + offs_m
        K_ptr = K + b * skb + h * skh
        V_ptr = V + b * svb + g * svh
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
            K_ptr,
            V_ptr,
            KB_ptr,
            KS_ptr,
            skn,
            svn,
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
            K_ptr,
            V_ptr,
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
            K_ptr,
            V_ptr,
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
            K_ptr,
            V_ptr,
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
        tl.store(QR + bh * NQ + offs_m, tl.sum(qf * dq, 1), mask=row_ok)
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
            tl.store(RSQ + bh * NQ + offs_m, rs * qn, mask=row_ok)
        tl.store(
            DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqn + offs_d[None, :],
            dq.to(DQ.dtype.element_ty),
            mask=row_ok[:, None] & (offs_d[None, :] < D),
        )
        if SCALAR:
            tl.store(DQS + bh * NQ + offs_m, -2.0 * beta_r * (a1 - dacc * b1), mask=row_ok)
            if NEED_DBETA:
                tl.store(DBETA + bh * NQ + offs_m, dacc * b2 - a2, mask=row_ok)
            # the exact delta replaces the rounded one for the dK/dV kernel, which runs after this one
            tl.store(DELTA + bh * NQ + offs_m, dacc, mask=row_ok)

    _BWD_KEY = ["D_PAD", "DV_PAD", "N_BUCKET", "CAUSAL", "HAS_WINDOW", "SCALAR", "NORMALIZE", "KV_SAME"]
    _distance_bwd_dkdv = autotune(make_configs(DKDV_CONFIGS, _INTERPRET_CONFIG_DKDV), _BWD_KEY, _prune_dkdv)(
        _distance_bwd_dkdv_kernel
    )
    _distance_bwd_dq = autotune(make_configs(DQ_CONFIGS, _INTERPRET_CONFIG_DQ), _BWD_KEY, _prune_dq)(
        _distance_bwd_dq_kernel
    )


def _strides3(t, b, h, n):
    e = t.expand(b, h, n)
    return e.stride(0), e.stride(1), e.stride(2)


def bwd_delta(out, dout):
    """``delta_i = dO_i . O_i`` in fp32, ``[B, H, Nq]``."""
    bsz, heads, nq, dv = out.shape
    delta = torch.empty(bsz, heads, nq, device=out.device, dtype=torch.float32)
    if nq == 0:
        return delta
    block = 16 if not autotune_enabled() and dout.device.type == "cpu" else 64
    _bwd_preprocess_kernel[(triton.cdiv(nq, block), bsz * heads)](
        out,
        dout,
        delta,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        dout.stride(0),
        dout.stride(1),
        dout.stride(2),
        heads,
        nq,
        DV=dv,
        DV_PAD=padded_dim(dv),
        BLOCK=block,
        num_warps=4,
    )
    return delta


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
):
    """Gradients of :func:`kernels_flash_fwd.distance_forward`.

    ``kb``: the key-bias vector of the forward (key log-weights, padding, and with ``knorm`` the key norms), or
    None: then the key norms (``knorm``) are computed from the key tiles inside the kernels, as in the forward.

    Returns ``dq, dk, dv, dkb, qr, rsq, ckn, dqs, dks, dbeta``: ``dq``/``dk``/``dv`` in the inputs' dtypes (with
    ``kv_same`` ``dk`` holds key plus value gradient and ``dv`` is empty); fp32 vectors ``dkb [B,H,Nk]``
    (``sum_i dS_ij``, only with ``kb``), ``qr [B,H,Nq]`` (``sum_j dS_ij q_i.k_j``), ``rsq [B,H,Nq]``
    (``rowsum(dS)_i ||q_i||^2``, qnorm only), ``ckn [B,H,Nk]`` (``sum_i dS_ij ||k_j||^2``, knorm only), ``dqs [B,H,Nq]``,
    ``dks [B,H,Nk]``, ``dbeta [B,H,Nq]`` (scalar term; natural-log-score gradients).  Unused outputs are empty
    tensors.
    """
    bsz, heads, nq, d = q.shape
    nk = k.shape[2]
    groups, dv_dim = v.shape[1], v.shape[3]
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)

    def empty():  # outputs of a custom op must not alias each other: one fresh empty tensor each
        return torch.empty(0, **f32)

    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = bwd_delta(out, dout) if (normalize or qnorm) else torch.zeros(bsz, heads, nq, **f32)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty(0, device=dev, dtype=v.dtype) if kv_same else torch.empty_like(v)
    dkb = torch.empty(bsz, heads, nk, **f32) if kb is not None else empty()
    ckn = torch.empty(bsz, heads, nk, **f32) if knorm else empty()
    qr = torch.empty(bsz, heads, nq, **f32)
    rsq = torch.empty(bsz, heads, nq, **f32) if qnorm else empty()
    scalar = qs is not None
    dqs = torch.empty(bsz, heads, nq, **f32) if scalar else empty()
    dks = torch.empty(bsz, heads, nk, **f32) if scalar else empty()
    dbeta = torch.empty(bsz, heads, nq, **f32) if scalar and need_dbeta else empty()
    if nq == 0 or nk == 0:
        return (
            dq.zero_(),
            dk.zero_(),
            dv.zero_(),
            dkb.zero_(),
            qr.zero_(),
            rsq.zero_(),
            ckn.zero_(),
            dqs.zero_(),
            dks.zero_(),
            dbeta.zero_(),
        )
    dummy = a
    if scalar:
        sqs, sks, sbeta = _strides3(qs, bsz, heads, nq), _strides3(ks, bsz, heads, nk), _strides3(beta, bsz, heads, nq)
    else:
        sqs = sks = sbeta = (0, 0, 0)
    ins = (
        q,
        k,
        v,
        kb if kb is not None else dummy,
        qs if scalar else dummy,
        ks if scalar else dummy,
        beta if scalar else dummy,
        a,
        b,
        dout,
        lse,
        delta,
    )
    strides = (
        (
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            dout.stride(0),
            dout.stride(1),
            dout.stride(2),
        )
        + sqs
        + sks
        + sbeta
    )
    common = dict(
        D_PAD=padded_dim(d),
        DV_PAD=padded_dim(dv_dim),
        CAUSAL=causal,
        HAS_WINDOW=window is not None,
        HAS_KB=kb is not None,
        KNORM_INLINE=knorm and kb is None,
        SCALAR=scalar,
        NORMALIZE=normalize,
        KV_SAME=kv_same,
        DOT_PREC=dot_precision(q.dtype),
    )
    hpg = heads // groups
    nb = n_bucket(max(nq, nk))
    grid_q = lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), bsz * heads)  # noqa: E731
    launch_tuned(
        _distance_bwd_dq,
        grid_q,
        *ins,
        dq,
        qr,
        rsq if qnorm else dummy,
        dqs if scalar else dummy,
        dbeta if dbeta.numel() else dummy,
        *strides,
        dq.stride(0),
        dq.stride(1),
        dq.stride(2),
        heads,
        hpg,
        nq,
        nk,
        num_prefix_keys,
        window or 0,
        math.log2(eps) if eps > 0 else 0.0,
        nb,
        D=d,
        DV=dv_dim,
        QNORM=qnorm,
        HAS_EPS=normalize and eps > 0,
        NEED_DBETA=bool(dbeta.numel()),
        **common,
    )
    grid_kv = lambda meta: (  # noqa: E731
        triton.cdiv(num_prefix_keys, meta["BLOCK_N"]) + triton.cdiv(nk - num_prefix_keys, meta["BLOCK_N"]),
        bsz * groups,
    )
    dvt = dv if not kv_same else dk
    launch_tuned(
        _distance_bwd_dkdv,
        grid_kv,
        *ins,
        dk,
        dvt,
        dkb if kb is not None else dummy,
        ckn if knorm else dummy,
        dks if scalar else dummy,
        *strides,
        dk.stride(0),
        dk.stride(1),
        dk.stride(2),
        dvt.stride(0),
        dvt.stride(1),
        dvt.stride(2),
        heads,
        hpg,
        nq,
        nk,
        num_prefix_keys,
        window or 0,
        nb,
        D=d,
        DV_=dv_dim,
        KNORM=knorm,
        KEY_BIAS=kb is not None or knorm,
        **common,
    )
    return dq, dk, dv, dkb, qr, rsq, ckn, dqs, dks, dbeta
