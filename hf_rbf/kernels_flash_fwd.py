"""Flash-style forward kernel shared by RBF, GKA and hybrid attention, and its split-K decode variant.

One program owns ``BLOCK_M`` query rows of one (batch, head) and streams key/value tiles through an online softmax
(memory linear in N).  The score, in log2 units, is

    s_ij = a_h * (q_i . k_j) + kb_j - beta_i * (qs_i - ks_j)^2  [+ r_i, folded into the row statistics]

with ``a_h`` the dot coefficient times ``log2(e)`` (``2 gamma`` for RBF, ``1 / sigma^2`` for GKA, ``scale`` for the
hybrid), ``kb_j`` the per-key bias (key norm, key log-weights, padding: the vector of ``kernels_common.key_bias``,
or with the key norm alone ``b_h ||k_j||^2`` computed from the key tile, ``KNORM_INLINE``) and the scalar term only
for the hybrid.  ``r_i = b_h ||q_i||^2`` (GKA, softmax-free RBF) never enters the inner loop:

* softmax with ``eps`` (GKA): ``W_ij = 2^(s_ij + r_i) / (sum_j 2^(s_ij + r_i) + eps)
  = 2^s_ij / (sum_j 2^s_ij + eps 2^(-r_i))``, so ``r_i`` only moves the ``eps`` term of the denominator;
* softmax-free RBF: ``2^(s_ij + r_i) = 2^(s_ij - m_i)`` with the fixed row "maximum" ``m_i = -r_i`` (the score is
  a negative distance, so no running maximum is needed and there is no row sum);
* plain softmax: ``r_i`` is shift-invariant and dropped.

Each row stores ``lse_i`` with ``W_ij = 2^(s_ij - lse_i)`` (``+inf`` for a row with no allowed key, giving zeros
and no NaN), which is all the backward needs.  With ``SPLIT`` the key range of each row block is cut into chunks over
a third grid axis (flash-decoding); each chunk writes its unnormalised ``(m, l, acc)`` and ``_decode_combine_kernel``
merges them: that is the exact single-query decode path, which keeps the GPU busy with few query rows.
"""

from __future__ import annotations

import logging
import math
import os
import threading

import torch

from .attention_utils import tensors_keepable
from .kernels_common import (
    DEFINED_INTERPRETED,
    HAS_TRITON,
    autotune,
    autotune_subset,
    bcast_strides,
    ceil_div,
    dot_precision,
    ensure_tma_allocator,
    launch_tuned,
    make_configs,
    n_bucket,
    next_pow2,
    padded_dim,
    planes_bucket,
    shared_memory_fits,
    tma_unavailable_reason,
    wrap_triton,
)
from .kernels_launch import direct_plan, keep_plan, launch_jit, launch_plan, plan_allowed, tensor_signature

logger = logging.getLogger(__name__)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .kernels_common import _allowed, _dot, _key_range, _load_tile, _row_sq_norms


# (tile sizes, num_warps, num_stages).  BLOCK_N = 64 with 4 warps is the Triton tutorial's Hopper choice at head dim
# 64; 128-wide key tiles and 8 warps pay at head dim 128 where one wgmma per tile amortises more; 64x32 tiles keep
# the fp32 accumulator of head dim 256 in registers.  Pruned by `_prune_fwd` (shared memory, registers, autotune off).
FWD_CONFIGS = [
    ({"BLOCK_M": 128, "BLOCK_N": 64}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128}, 8, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 64}, 4, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 32}, 4, 2),
]
# Decode: a handful of query rows, so the smallest tl.dot row count (16) and wide key tiles; split-K supplies the
# parallelism.
DECODE_CONFIGS = [
    ({"BLOCK_M": 16, "BLOCK_N": 128}, 4, 3),
    ({"BLOCK_M": 16, "BLOCK_N": 64}, 4, 3),
    ({"BLOCK_M": 16, "BLOCK_N": 32}, 4, 2),
]
_INTERPRET_CONFIG = ({"BLOCK_M": 16, "BLOCK_N": 16}, 1, 1)


def _fits(cfg, nargs, rows_key="BLOCK_M", cols_key="BLOCK_N") -> bool:
    d_pad, dv_pad = nargs["D_PAD"], nargs["DV_PAD"]
    el = nargs["Q"].element_size()
    rows, cols = cfg.kwargs[rows_key], cfg.kwargs[cols_key]
    if not shared_memory_fits(rows, cols, d_pad, dv_pad, cfg.num_stages, el):
        return False
    # fp32 accumulator + the stationary query tile per thread; past ~160 registers the compiler spills.  The TMA
    # path counts the accumulator alone: its tiles stream through shared memory, and the 128 x 64, 4-warp config
    # that this estimate removes at head dim 128 was the fastest descriptor loop there (0.77-0.80x SDPA flash,
    # benchmarks/probe_hopper_forward.py, results h100-2026-11-27p); the autotuner times it against the others.
    query = 0 if nargs.get("TMA") else rows * d_pad * el
    regs = (rows * dv_pad * 4 + query) / (4 * 32 * cfg.num_warps)
    return regs <= 160


def _prune_fwd(configs, nargs, **kwargs):
    nargs = {**nargs, **kwargs}  # triton 3.6 passes the constexpr arguments separately
    fitting = [c for c in configs if _fits(c, nargs)] or configs[-1:]
    if nargs["NQ"] <= 64:
        fitting = [c for c in fitting if c.kwargs["BLOCK_M"] <= 64] or fitting
    return autotune_subset(fitting, nargs)


if HAS_TRITON:

    @triton.jit
    def _key_value_bases(
        K,
        V,
        PK,
        PV,
        b,
        h,
        g,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        spkb,
        spkh,
        spkn,
        spvb,
        spvh,
        spvn,
        P,
        SEP_PREFIX: tl.constexpr,
    ):
        """``(PK_ptr, PV_ptr, pkn, pvn, K_seq, V_seq)``: where the tiles read prefix key / value ``j < P`` (at
        ``PK_ptr + j * pkn``) and sequence key ``j >= P`` (at ``K_seq + j * skn``) for batch ``b``, head ``h``, value
        group ``g``.

        With SEP_PREFIX the P prefix keys / values (registers) are their own tensors (batch stride 0 when every batch
        element shares them), so no concatenation in front of the sequence keys: the sequence tensors hold key P + s at
        row s, hence ``K_seq = K - P * skn``.  Without it the prefix is the first P rows of K / V."""
        K_ptr = K + b * skb + h * skh
        V_ptr = V + b * svb + g * svh
        if SEP_PREFIX:
            PK_ptr = PK + b * spkb + h * spkh
            PV_ptr = PV + b * spvb + g * spvh
            pkn = spkn
            pvn = spvn
            K_seq = K_ptr - P * skn
            V_seq = V_ptr - P * svn
        else:
            PK_ptr = K_ptr
            PV_ptr = V_ptr
            pkn = skn
            pvn = svn
            K_seq = K_ptr
            V_seq = V_ptr
        return PK_ptr, PV_ptr, pkn, pvn, K_seq, V_seq

    @triton.jit
    def _fwd_tiles(
        acc,
        l_i,
        m_i,
        q,
        qs_r,
        beta_r,
        t_r,
        K_ptr,
        V_ptr,
        desc_k,
        desc_v,
        KB_ptr,
        KS_ptr,
        skn,
        svn,
        sksn,
        lo,
        hi,
        skip_at,
        skip,
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
        SCALAR: tl.constexpr,
        BETA_HEAD: tl.constexpr,
        NORMALIZE: tl.constexpr,
        KV_SAME: tl.constexpr,
        KNORM_INLINE: tl.constexpr,
        DOT_PREC: tl.constexpr,
        TMA: tl.constexpr,
        GAP: tl.constexpr,
    ):
        """Key tiles ``lo .. hi`` (indices ``key_base + n``, valid below ``bound``); with GAP the tiles from
        ``skip_at`` on are shifted by ``skip``: ``[lo, skip_at)`` and ``[skip_at + skip, hi + skip)`` in one loop.

        MODE 0: fully allowed tiles, no mask; 1: sequence edge tiles (position mask and ``n < bound``); 2: prefix
        tiles (only ``n < bound``).  TMA: the key / value tiles come through the tensor descriptors ``desc_k`` /
        ``desc_v`` (sequence key ``n`` at row ``n``; rows past the end and the padded head-dim columns read as zeros)
        instead of pointer loads, and the key norms from the loaded tile (see the kernel's comment).

        BETA_HEAD (the scalar term with one ``beta`` per head): the tile's scores are ``s / beta`` (``a``,
        ``kn_coef`` and the key bias divided by ``beta``, the scalar term ``-(qs_i - ks_j)^2`` with no product),
        ``beta_r`` is that scalar ``beta``, and the row maximum and ``exp2``'s argument take it back:
        ``exp2(s' beta - m)`` in one fma (see the kernel's comment).
        """
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        for start_n in range(lo, hi, BLOCK_N):
            if GAP:
                start_n = start_n + tl.where(start_n >= skip_at, skip, 0)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            j = key_base + offs_n
            col_ok = offs_n < bound
            if TMA:
                k = desc_k.load([start_n, 0])
            else:
                k = _load_tile(K_ptr + j[:, None] * skn + offs_d[None, :], col_ok, offs_d, D, D_PAD, MODE != 0)
            s = _dot(q, tl.trans(k), None, DOT_PREC) * a
            if HAS_KB:
                kb = tl.load(KB_ptr + j, mask=col_ok, other=float("-inf"))
                if BETA_HEAD:
                    kb = kb * (1.0 / beta_r)
                s += kb[None, :]
            if KNORM_INLINE and TMA:
                # the descriptor's tile sits in shared memory: its norms need no second read.  Checked on an H100
                # against the float64 reference for separate keys and values (rbf: kernelcheck and
                # probe_hopper_forward.py, benchmarks/results/h100-2026-11-27p); with x as key and value (GKA) the
                # same reduction returned wrong outputs, so tma_path never sends that form here
                kf = k.to(tl.float32)
                s += (tl.sum(kf * kf, 1) * kn_coef)[None, :]
            elif KNORM_INLINE:
                # the key norms of this tile, read again from L1/L2 (see _row_sq_norms for why not from `k`): in decode
                # (memory-bound) a separate key-norm pass would read the whole cache a second time; in training this
                # saves the key-bias launch (see kernels_common's docstring)
                kn = _row_sq_norms(K_ptr + j[:, None] * skn + offs_d[None, :], col_ok, offs_d, D, D_PAD, MODE != 0)
                s += (kn * kn_coef)[None, :]
            if SCALAR:
                if MODE == 0:  # whole tiles: every key of the tile exists
                    ks = tl.load(KS_ptr + j * sksn).to(tl.float32)
                else:
                    ks = tl.load(KS_ptr + j * sksn, mask=col_ok, other=0.0).to(tl.float32)
                dd = qs_r[:, None] - ks[None, :]
                if BETA_HEAD:
                    s -= dd * dd
                else:
                    s -= dd * dd * beta_r[:, None]
            if MODE == 1:
                ok = _allowed(t_r[:, None], offs_n[None, :], WINDOW, CAUSAL, HAS_WINDOW)
                if not CAUSAL:
                    # causal: a stored row's position is at most S - 1, so `n <= t` implies `n < bound`; the tile's
                    # rows past the end read as zeros, and rows past NQ are not stored
                    ok = ok & col_ok[None, :]
                s = tl.where(ok, s, float("-inf"))
            elif MODE == 2:
                s = tl.where(col_ok[None, :], s, float("-inf"))
            if NORMALIZE:
                if BETA_HEAD:
                    m_new = tl.maximum(m_i, tl.max(s, 1) * beta_r)
                else:
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                # A row that has seen no allowed key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                if BETA_HEAD:
                    p = tl.math.exp2(s * beta_r - m_use[:, None])
                else:
                    p = tl.math.exp2(s - m_use[:, None])
                alpha = tl.math.exp2(m_i - m_use)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                m_i = m_new
            elif BETA_HEAD:
                p = tl.math.exp2(s * beta_r - m_i[:, None])
            else:
                p = tl.math.exp2(s - m_i[:, None])
            if KV_SAME:
                v = k
            elif TMA:
                v = desc_v.load([start_n, 0])
            else:
                v = _load_tile(V_ptr + j[:, None] * svn + offs_dv[None, :], col_ok, offs_dv, DV, DV_PAD, MODE != 0)
            acc = _dot(p.to(v.dtype), v, acc, DOT_PREC)
        return acc, l_i, m_i

    @triton.jit
    def _distance_fwd_kernel(
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
        OUT,
        LSE,
        LPART,
        EROW,
        sqb,
        sqh,
        sqn,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sob,
        soh,
        son,
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
        QNORM: tl.constexpr,
        SCALAR: tl.constexpr,
        TAU_IN: tl.constexpr,
        BETA_HEAD: tl.constexpr,
        NORMALIZE: tl.constexpr,
        HAS_EPS: tl.constexpr,
        KV_SAME: tl.constexpr,
        SPLIT: tl.constexpr,
        KNORM_INLINE: tl.constexpr,
        SEP_PREFIX: tl.constexpr,
        HAS_PREFIX: tl.constexpr,
        TIED: tl.constexpr,
        A_LOG: tl.constexpr,
        DOT_PREC: tl.constexpr,
        TMA: tl.constexpr,
        TMA_OUT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)  # 64-bit offsets: a 1M-token cache overflows int32 strides
        h = (bh % H).to(tl.int64)
        g = h // HPG
        S = NK - P  # sequence keys
        t0 = S - NQ  # position of query row 0 (bottom-right alignment)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < NQ
        offs_d = tl.arange(0, D_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        q = _load_tile(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], row_ok, offs_d, D, D_PAD, True)
        # the per-head coefficients (any float dtype, natural-log units) in the kernel's base-2 units
        a = tl.load(A + h).to(tl.float32)
        if A_LOG:  # A holds log sigma_h (the distance form, GKA's learnable bandwidth): c_h = exp(-2 log sigma_h) / 2
            a = 0.5 * tl.exp(-2.0 * a)
        a = a * 1.4426950408889634
        if SCALAR:
            qs_r = tl.load(QS + b * sqsb + h * sqsh + offs_m * sqsn, mask=row_ok, other=0.0).to(tl.float32)
            if BETA_HEAD:  # one tau for the head's queries (TAU_IN): loaded and inverted once, a scalar
                tau_h = tl.load(BETA + b * sbb + h * sbh).to(tl.float32)
                beta_r = tl.math.div_rn(1.0, tau_h) * 1.4426950408889634
                # tau > 0 is the documented contract; a floor keeps tau = inf (beta 0) finite: a beta below 2^-60
                # changes the score by less than 2^-60 (qs - ks)^2
                beta_r = tl.maximum(beta_r, 8.673617379884035e-19)
            elif TAU_IN:  # the scalar tensor holds tau: beta = 1 / tau, IEEE-rounded (torch's 1 / tau; `/` is div.full)
                tau_r = tl.load(BETA + b * sbb + h * sbh + offs_m * sbn, mask=row_ok, other=1.0).to(tl.float32)
                beta_r = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tau_r)
            else:
                beta_r = tl.load(BETA + b * sbb + h * sbh + offs_m * sbn, mask=row_ok, other=0.0).to(tl.float32)
            if not BETA_HEAD:
                beta_r = beta_r * 1.4426950408889634
        else:
            qs_r = tl.zeros([BLOCK_M], dtype=tl.float32)
            beta_r = tl.zeros([BLOCK_M], dtype=tl.float32)
        # b_h * log2(e): the norm coefficient (key norms with KNORM_INLINE, query norms with QNORM)
        if TIED:
            # the distance form: A holds c_h, and a_h = 2 c_h, b_h = -c_h (RBF, GKA): no torch ops to derive them
            kn_coef = -a
            a = 2.0 * a
        else:
            kn_coef = tl.load(BC + h).to(tl.float32) * 1.4426950408889634
        if QNORM:
            qf = q.to(tl.float32)
            r = tl.sum(qf * qf, 1) * kn_coef
        else:
            r = tl.zeros([BLOCK_M], dtype=tl.float32)
        if BETA_HEAD:
            # One beta per head: the tiles compute s / beta = a / beta q.k + kb / beta - (qs - ks)^2 and take the
            # row maximum and exp2's argument back as (s / beta) beta - m in one fma: per score element a subtract,
            # a multiply and two fmas, against a subtract, two multiplies, an fma and an add (SASS of the middle loop).
            # The difference qs - ks stays exact (no pre-scaled or expanded scalars); each score takes the same
            # number of roundings.  Needs beta > 0 (tau > 0: the contract; the floor above).
            a = tl.math.div_rn(a, beta_r)
            kn_coef = tl.math.div_rn(kn_coef, beta_r)
        if NORMALIZE:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        else:
            m_i = -r
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        t_r = t0 + offs_m

        PK_ptr, PV_ptr, pkn, pvn, K_seq, V_seq = _key_value_bases(
            K, V, PK, PV, b, h, g, skb, skh, skn, svb, svh, svn, spkb, spkh, spkn, spvb, spvh, spvn, P, SEP_PREFIX
        )
        KB_ptr = KB + bh * NK
        KS_ptr = KS + b * sksb + h * sksh
        if TMA:
            # Hopper's TMA unit streams the sequence tiles into shared memory (the Triton fused-attention tutorial's
            # Hopper path): no address arithmetic or masks per element, and the key norms come from the tile the
            # dot reads.  Measured on an H100 (benchmarks/probe_hopper_forward.py, results h100-2026-11-27p): the
            # tutorial-shaped forward with descriptors and norms from the tile ran at 0.76-0.92x SDPA flash where
            # the pointer-load kernel ran at 0.92-1.09x; this kernel with them, 0.91-0.97x at head dim 64 (pointer
            # loads 0.96-1.01x).  One descriptor per (batch, head) slice: its rows are this head's sequence keys, so
            # out-of-range rows and padded head-dim columns are zero-filled by the unit.
            desc_k = tl.make_tensor_descriptor(
                K_seq + P * skn, shape=[S, D], strides=[skn, 1], block_shape=[BLOCK_N, D_PAD]
            )
            desc_v = tl.make_tensor_descriptor(
                V_seq + P * svn, shape=[S, DV], strides=[svn, 1], block_shape=[BLOCK_N, DV_PAD]
            )
        else:
            desc_k = K_seq
            desc_v = V_seq

        # Each tile loop below is a software-pipelined loop of its own (with TMA: its own shared buffers and barriers),
        # and the state each keeps live crowds the others: at head dim 128 (128 x 64 tiles, 4 warps, TMA) the four
        # loops this kernel had (prefix, lower edge, middle, upper edge) spilled in every loop body, 47 local loads /
        # stores per middle tile where the two-loop probe (benchmarks/probe_hopper_forward.py) has 4; with the two
        # sequence loops below (and the output stored through a descriptor) the middle loop has 3, 943 instructions
        # against the probe's 964 (benchmarks/results/offline-sm90-2026-11-28).  So the prefix loop exists only for
        # calls with prefix keys (HAS_PREFIX), and the two edges of the key range share one masked loop.

        # the prefix (register tokens / sinks): visible to every query; split 0 owns it in decode
        if HAS_PREFIX:
            prefix_hi = P
            if SPLIT:
                prefix_hi = P - P * tl.minimum(tl.program_id(2), 1)
            acc, l_i, m_i = _fwd_tiles(
                acc,
                l_i,
                m_i,
                q,
                qs_r,
                beta_r,
                t_r,
                PK_ptr,
                PV_ptr,
                desc_k,
                desc_v,
                KB_ptr,
                KS_ptr,
                pkn,
                pvn,
                sksn,
                0,
                prefix_hi,
                0,
                0,
                0,
                P,
                a,
                kn_coef,
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
                SCALAR,
                BETA_HEAD,
                NORMALIZE,
                KV_SAME,
                KNORM_INLINE,
                DOT_PREC,
                False,
                False,
            )

        t_first = t0 + pid_m * BLOCK_M
        t_last = t0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
        start, full_lo, full_hi, end = _key_range(t_first, t_last, S, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_N)
        if SPLIT:
            n_split = tl.num_programs(2)
            chunk = tl.cdiv(tl.cdiv(end - start, n_split), BLOCK_N) * BLOCK_N
            c0 = start + tl.program_id(2) * chunk
            start = tl.minimum(c0, end)
            end = tl.minimum(c0 + chunk, end)
            full_lo = tl.minimum(tl.maximum(full_lo, start), end)
            full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
        # the tiles every row of the block sees whole: no mask
        acc, l_i, m_i = _fwd_tiles(
            acc,
            l_i,
            m_i,
            q,
            qs_r,
            beta_r,
            t_r,
            K_seq,
            V_seq,
            desc_k,
            desc_v,
            KB_ptr,
            KS_ptr,
            skn,
            svn,
            sksn,
            full_lo,
            full_hi,
            0,
            0,
            P,
            S,
            a,
            kn_coef,
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
            SCALAR,
            BETA_HEAD,
            NORMALIZE,
            KV_SAME,
            KNORM_INLINE,
            DOT_PREC,
            TMA,
            False,
        )
        # the edge tiles, masked: the upper edge [full_hi, end) and, with a window, the lower edge [start, full_lo)
        # in one loop (without a window start == full_lo)
        if HAS_WINDOW:
            edge_lo = start
            edge_hi = full_lo + (end - full_hi)
        else:
            edge_lo = full_hi
            edge_hi = end
        acc, l_i, m_i = _fwd_tiles(
            acc,
            l_i,
            m_i,
            q,
            qs_r,
            beta_r,
            t_r,
            K_seq,
            V_seq,
            desc_k,
            desc_v,
            KB_ptr,
            KS_ptr,
            skn,
            svn,
            sksn,
            edge_lo,
            edge_hi,
            full_lo,
            full_hi - full_lo,
            P,
            S,
            a,
            kn_coef,
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
            SCALAR,
            BETA_HEAD,
            NORMALIZE,
            KV_SAME,
            KNORM_INLINE,
            DOT_PREC,
            TMA,
            HAS_WINDOW,
        )

        if HAS_EPS:
            e = LOG2_EPS - r  # log2 of the eps term, relative to the scores without r
        else:
            e = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if SPLIT:
            # partial results: OUT = acc [BH, n_split, NQ, DV], LSE = m, LPART = l, EROW = e
            part = (bh * tl.num_programs(2) + tl.program_id(2)) * NQ + offs_m
            tl.store(OUT + part[:, None] * DV + offs_dv[None, :], acc, mask=row_ok[:, None] & (offs_dv[None, :] < DV))
            tl.store(LSE + part, m_i, mask=row_ok)
            tl.store(LPART + part, l_i, mask=row_ok)
            tl.store(EROW + bh * NQ + offs_m, e, mask=row_ok)  # every split writes the same value
        else:
            if NORMALIZE:
                big = tl.maximum(m_i, e)
                big = tl.where(big == float("-inf"), 0.0, big)
                den = l_i * tl.math.exp2(m_i - big) + tl.math.exp2(e - big)
                lse = tl.where(den > 0, big + tl.math.log2(den), float("inf"))
                out = acc * tl.math.exp2(m_i - lse)[:, None]
            else:
                lse = m_i
                out = acc
            if TMA_OUT:
                # the output tile through a descriptor too (rows past NQ and the padded columns are not written):
                # no per-element addresses and masks in the epilogue, fewer registers for the loops above it
                desc_o = tl.make_tensor_descriptor(
                    OUT + b * sob + h * soh, shape=[NQ, DV], strides=[son, 1], block_shape=[BLOCK_M, DV_PAD]
                )
                desc_o.store([pid_m * BLOCK_M, 0], out.to(OUT.dtype.element_ty))
            else:
                o_ptrs = OUT + b * sob + h * soh + offs_m[:, None] * son + offs_dv[None, :]
                tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
            tl.store(LSE + bh * NQ + offs_m, lse, mask=row_ok)

    @triton.jit
    def _decode_combine_kernel(
        ACC,
        MP,
        LP,
        EROW,
        OUT,
        sob,
        soh,
        son,
        H,
        NQ,
        NSPLIT,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        SPLIT_PAD: tl.constexpr,
        NORMALIZE: tl.constexpr,
        HAS_EPS: tl.constexpr,
    ):
        """Merge the split-K partial results of one query row: the same finalisation as the forward kernel."""
        row = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        offs_s = tl.arange(0, SPLIT_PAD)
        offs_dv = tl.arange(0, DV_PAD)
        s_ok = offs_s < NSPLIT
        part = (bh * NSPLIT + offs_s) * NQ + row
        acc = tl.load(
            ACC + part[:, None] * DV + offs_dv[None, :], mask=s_ok[:, None] & (offs_dv[None, :] < DV), other=0.0
        )
        if NORMALIZE:
            m = tl.load(MP + part, mask=s_ok, other=float("-inf"))
            l_part = tl.load(LP + part, mask=s_ok, other=0.0)
            if HAS_EPS:
                e = tl.load(EROW + bh * NQ + row)
            else:
                e = float("-inf")
            big = tl.maximum(tl.max(m, 0), e)
            big = tl.where(big == float("-inf"), 0.0, big)
            w = tl.math.exp2(m - big)
            den = tl.sum(l_part * w, 0) + tl.math.exp2(e - big)
            out = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
        else:
            out = tl.sum(acc, 0)
        tl.store(OUT + b * sob + h * soh + row * son + offs_dv, out.to(OUT.dtype.element_ty), mask=offs_dv < DV)

    # the key norms' source is part of the key: the best tiles of a loop that reads each key tile twice
    # (KNORM_INLINE) and of one that loads a bias per key (HAS_KB) differ
    _FWD_KEY = [
        *("D_PAD", "DV_PAD", "N_BUCKET", "PLANES"),
        *("CAUSAL", "HAS_WINDOW", "SCALAR", "QNORM", "NORMALIZE", "KV_SAME", "HAS_KB", "KNORM_INLINE", "TMA"),
    ]
    _distance_fwd = autotune(make_configs(FWD_CONFIGS, _INTERPRET_CONFIG), _FWD_KEY, _prune_fwd)(_distance_fwd_kernel)
    _distance_decode = autotune(make_configs(DECODE_CONFIGS, _INTERPRET_CONFIG), _FWD_KEY, _prune_fwd)(
        _distance_fwd_kernel
    )


def prefix_args(prefix, k, v, bsz: int):
    """``(pk, pv, strides)`` of separate prefix keys / values (``(pk, pv)`` or None) for the kernels' ``PK, PV`` and
    ``spkb .. spvn`` arguments: their ``[B, H|G, P]`` strides, 0 on a broadcast batch dim; without a prefix, the
    sequence tensors as (unread) placeholders."""
    if prefix is None:
        return k, v, (0, 0, 0, 0, 0, 0)
    pk, pv = prefix
    spk = bcast_strides(pk, (bsz, pk.shape[1], pk.shape[2], pk.shape[3]))[:3]
    spv = bcast_strides(pv, (bsz, pv.shape[1], pv.shape[2], pv.shape[3]))[:3]
    return pk, pv, spk + spv


def launch_inputs(q, k, v, kb, qs, ks, beta, a, b, prefix) -> tuple:
    """The input tensors of a forward or backward launch, in the kernels' order ``Q, K, V, KB, QS, KS, BETA, A, B,
    PK, PV``: ``a`` stands in for an absent key bias, scalar term or ``b`` (the tied form reads only A), the sequence
    keys / values for an absent separate prefix (unread placeholders)."""
    pk, pv = (k, v) if prefix is None else prefix
    return (
        q,
        k,
        v,
        kb if kb is not None else a,
        qs if qs is not None else a,
        ks if ks is not None else a,
        beta if beta is not None else a,
        a,
        a if b is None else b,
        pk,
        pv,
    )


def forward_plan_key(q, k, v, kb, qs, ks, beta, a, b, prefix, device, *options):
    """``(key, input addresses)`` of a training forward launch: the inputs' :func:`kernels_launch.tensor_signature`,
    which of them are absent, the current device, ``options`` (every other argument of :func:`distance_forward` but
    ``traced``), the TMA setting and tf32 (``dot_precision``): everything its launch is computed from but the
    addresses (``tests/test_kernels_launch.py`` checks that equal keys mean equal launches)."""
    signature, pointers = tensor_signature(launch_inputs(q, k, v, kb, qs, ks, beta, a, b, prefix))
    absent = (kb is None, qs is None, ks is None, beta is None, b is None, prefix is None)
    return (signature, device, absent, options, TMA_MODE, dot_precision(q.dtype)), pointers


def _launch_args(q, k, v, kb, qs, ks, beta, a, b, window, num_prefix_keys, eps, prefix=None):
    bsz, heads, nq, d = q.shape
    # with separate prefix tensors, k / v hold the sequence keys only
    nk = k.shape[2] + (num_prefix_keys if prefix is not None else 0)
    groups, dv = v.shape[1], v.shape[3]
    _, _, sprefix = prefix_args(prefix, k, v, bsz)
    if qs is not None:
        sqs = bcast_strides(qs, (bsz, heads, nq))
        sks = bcast_strides(ks, (bsz, heads, nk))
        sbeta = bcast_strides(beta, (bsz, heads, nq))
    else:
        sqs = sks = sbeta = (0, 0, 0)
    tensors = launch_inputs(q, k, v, kb, qs, ks, beta, a, b, prefix)
    strides = (
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
    )
    scalars = (
        heads,
        heads // groups,
        nq,
        nk,
        num_prefix_keys,
        window or 0,
        math.log2(eps) if eps > 0 else 0.0,
        n_bucket(max(nq, nk)),
        planes_bucket(bsz * heads),
    )
    return bsz, heads, nq, nk, d, dv, tensors, strides, sqs + sks + sbeta + sprefix, scalars


def _flags(q, d, dv, causal, window, kb, qs, qnorm, normalize, eps, kv_same, knorm_inline, prefix, tied, tau_in,
           num_prefix_keys, tma=False, tma_out=False, beta_head=False, a_log=False):
    """The forward kernel's constexprs; ``beta_head``: one ``tau`` per (batch, head) with ``tau_in`` (``BETA_HEAD``,
    see ``_distance_fwd_kernel``; the decode launches leave it off); ``a_log``: ``A`` holds log bandwidths (``A_LOG``,
    the tied form only; the decode launches leave it off)."""
    return dict(
        D=d,
        DV=dv,
        D_PAD=padded_dim(d),
        DV_PAD=padded_dim(dv),
        CAUSAL=causal,
        HAS_WINDOW=window is not None,
        HAS_KB=kb is not None,
        QNORM=qnorm,
        SCALAR=qs is not None,
        TAU_IN=qs is not None and tau_in,
        BETA_HEAD=qs is not None and tau_in and beta_head,
        NORMALIZE=normalize,
        HAS_EPS=normalize and eps > 0,
        KV_SAME=kv_same,
        KNORM_INLINE=knorm_inline,
        SEP_PREFIX=prefix is not None,
        HAS_PREFIX=num_prefix_keys > 0,
        TIED=tied,
        A_LOG=tied and a_log,
        DOT_PREC=dot_precision(q.dtype),
        TMA=tma,
        TMA_OUT=tma_out,
    )


def distance_forward(
    q,
    k,
    v,
    kb,
    qs,
    ks,
    beta,
    a,
    b,
    *,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    kv_same,
    eps,
    knorm_inline=False,
    prefix=None,
    tau_in=False,
    tma=None,
    a_log=False,
    traced=False,
):
    """Launch the fused forward.  Returns ``(out [B, H, Nq, Dv] in q's dtype, lse [B, H, Nq] fp32)``.

    ``q [B,H,Nq,D]``, ``k [B,H,Nk,D]``, ``v [B,G,Nk,Dv]`` (last dim contiguous; ``k is v`` with ``kv_same``);
    ``kb``: key bias from ``key_bias`` or None; ``qs [B,H,Nq]``, ``ks [B,H,Nk]``, ``beta [B|1,H|1,Nq|1]`` (the
    scalar term, ``1/tau``; with ``tau_in`` the temperature ``tau`` itself, whose reciprocal the kernel takes) or
    None; ``a``/``b``: ``[H]`` (contiguous, any float dtype) dot and norm coefficients
    in natural-log units (the kernel multiplies them by ``log2(e)``), or ``b`` None for the distance form: ``a``
    then holds ``c_h`` and the kernel uses ``a_h = 2 c_h``, ``b_h = -c_h``; ``knorm_inline``: add ``b_h ||k_j||^2``
    computed from the key tiles (the key norms without a key-bias pass; ``kb`` then holds at most the key
    log-weights and padding); ``prefix``: None, or the ``num_prefix_keys`` prefix keys and values ``(pk [B|1, H, P,
    D], pv [B|1, G, P, Dv])`` as separate tensors (then ``k`` / ``v`` hold only the sequence keys; ``kb``, ``ks``
    and the masks still cover all ``P + N`` keys); ``tma``: read the sequence key / value tiles through TMA tensor
    descriptors (True), pointer loads (False), or None: descriptors wherever :func:`tma_path` allows them; ``a_log``
    (the distance form, ``b`` None): ``a`` holds per-head log bandwidths ``log sigma_h``, and the kernel forms
    ``c_h = exp(-2 log sigma_h) / 2`` itself (GKA's learnable bandwidth: no torch ops for it per call);
    ``traced``: called from the ``triton_op`` that ``torch.compile`` traces (``attention_distance_triton
    .distance_fwd_t``, fake tensors): the launch goes through ``wrap_triton`` (Inductor launches the kernel from its
    generated code) and the TMA check reads no data pointer.
    """
    plan_key = None
    if not traced:  # a call signature launched before: its plan (see kernels_launch.direct_plan; GPU only)
        device = torch.cuda.current_device() if q.is_cuda else -1
        plan_key, pointers = forward_plan_key(
            q, k, v, kb, qs, ks, beta, a, b, prefix, device,
            causal, window, num_prefix_keys, normalize, qnorm, kv_same, eps, knorm_inline, tau_in, tma, a_log,
        )  # fmt: skip
        planned = _FWD_PLANS.get(plan_key)  # (none on the CPU: direct_plan makes none there)
        if planned is not None and plan_allowed(planned[0]):
            plan, uses_tma = planned
            out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3], device=q.device, dtype=q.dtype)
            lse = torch.empty(q.shape[0], q.shape[1], q.shape[2], device=q.device, dtype=torch.float32)
            p_out, p_lse = out.data_ptr(), lse.data_ptr()
            if not (p_out | p_lse) & 15:  # (fresh blocks always are: the signature assumes it)
                if uses_tma:
                    ensure_tma_allocator()
                launch_plan(plan, pointers + [p_out, p_lse, p_lse, p_lse], device)
                return out, lse
    bsz, heads, nq, nk, d, dv, tensors, strides, sstrides, scalars = _launch_args(
        q, k, v, kb, qs, ks, beta, a, b, window, num_prefix_keys, eps, prefix
    )
    out = torch.empty(bsz, heads, nq, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(bsz, heads, nq, device=q.device, dtype=torch.float32)
    if nq == 0:
        return out, lse
    tma = tma_path(k, v, tma, kv_same, traced)
    # the output tile goes through a descriptor too where its rows are 16-byte aligned: `out` is fresh and contiguous
    # (an allocator block's base), so every stride is a multiple of dv
    grid = lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), bsz * heads, 1)  # noqa: E731
    # LPART / EROW (split-K partials) are not written with SPLIT=False: lse stands in for them
    args = (*tensors, out, lse, lse, lse, *strides, *out.stride()[:3], *sstrides, *scalars)
    flags = _flags(
        q, d, dv, causal, window, kb, qs, qnorm, normalize, eps, kv_same, knorm_inline, prefix, b is None, tau_in,
        num_prefix_keys, tma, tma and (dv * out.element_size()) % 16 == 0,
        beta_head=qs is not None and bcast_strides(beta, (bsz, heads, nq))[2] == 0,
        a_log=a_log,
    )
    kwargs = {"SPLIT": False, **flags}
    if traced:
        wrap_triton(_distance_fwd)[grid](*args, **kwargs)
        return out, lse
    launch_tuned(_distance_fwd, grid, *args, **kwargs)
    if plan_key is not None:
        plan = direct_plan(_distance_fwd, grid, args, kwargs, len(tensors) + 4)  # the inputs, out, lse three times
        if plan is not None:
            keep_plan(_FWD_PLANS, plan_key, (plan, tma))
    return out, lse


# call signature -> (kernels_launch.direct_plan, TMA descriptors used) of the training forward
_FWD_PLANS: dict = {}


def _tma_setting(value: str):
    """``HF_RBF_TRITON_TMA``: ``auto`` (default; None), ``1`` / ``on`` (True: required), ``0`` / ``off`` (False)."""
    v = value.strip().lower()
    if v == "auto":
        return None
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    return value  # refused by tma_path at the first launch, naming the variable


# the forward's key / value tile reads when a call passes tma=None: None chooses TMA wherever it is possible
TMA_MODE = _tma_setting(os.environ.get("HF_RBF_TRITON_TMA", "auto"))
_TMA_LOGGED: set = set()


# Head dims up to this use TMA when the choice is automatic.  Measured on an H100 (benchmarks/probe_hopper_forward.py
# --whole): the kernel with four tile loops ran at 0.91-0.97x SDPA flash with TMA at head dim 64 (pointer loads
# 0.96-1.01x) but 1.16-1.18x at 128 (benchmarks/results/h100-2026-11-27p, h100-2026-11-28 call 3): it spilled in every
# tile loop.  With the two sequence loops (see the comment above its tile loops) the TMA forward runs at 0.85 / 0.84x
# flash at head dim 128, N 2048 / 8192, against 1.00 / 0.94x with pointer loads, and 0.89x at 64 (pointer loads
# 0.94-0.97x): benchmarks/results/h100-2026-11-28b, call 1.  Wider heads (256) keep pointer loads (not measured).
TMA_AUTO_MAX_HEAD_DIM = 128


def tma_path(k, v, tma: bool | None, kv_same: bool = False, traced: bool = False) -> bool:
    """Whether the forward reads its key / value tiles through TMA descriptors.  ``tma`` None takes ``TMA_MODE``
    (``HF_RBF_TRITON_TMA``); None there chooses them wherever ``kernels_common.tma_unavailable_reason`` finds nothing
    against them and the padded head dims are at most ``TMA_AUTO_MAX_HEAD_DIM`` (the pointer path's reason is logged
    once per reason: a visible choice, not a silent one); True requires them (ValueError naming the reason
    otherwise); False keeps pointer loads.  ``kv_same`` (``x`` as key and value: GKA) never takes TMA: one descriptor
    tile as both dot operands with its norms reduced from it gave GKA outputs 7x off the float64 reference on an H100
    (triton 3.6; 1.4e-2 against 2.0e-3 relative, kernelcheck of benchmarks/results/h100-2026-11-27p), the same
    pattern as the register-tile miscompile of ``kernels_common._row_sq_norms``.  ``traced``: fake tensors (see
    ``kernels_common.tma_unavailable_reason``)."""
    if tma is None:
        tma = TMA_MODE
    if tma is False:
        return False
    if tma not in (None, True):
        raise ValueError(
            f"tma (HF_RBF_TRITON_TMA, kernels_flash_fwd.TMA_MODE) must be auto/None, 1/True or 0/False; got {tma!r}"
        )
    if kv_same:
        reason = "x is both key and value (GKA): that form is not read through descriptors (see tma_path)"
    else:
        reason = tma_unavailable_reason(k.device, [("k", k, k.stride()[:3]), ("v", v, v.stride()[:3])], traced)
    if reason is None and tma is None and max(padded_dim(k.shape[-1]), padded_dim(v.shape[-1])) > TMA_AUTO_MAX_HEAD_DIM:
        reason = f"head dim above {TMA_AUTO_MAX_HEAD_DIM}: pointer loads measured faster (see TMA_AUTO_MAX_HEAD_DIM)"
    if reason is None:
        ensure_tma_allocator()
        return True
    if tma:
        raise ValueError(f"tma=True: the key / value tiles cannot be read through TMA descriptors: {reason}")
    if reason not in _TMA_LOGGED:
        _TMA_LOGGED.add(reason)
        logger.info("hf_rbf: the fused forward reads key / value tiles with pointer loads, not TMA: %s", reason)
    return False


_NUM_SMS: dict = {}  # cuda device index -> multiprocessor count (a property of the device: read once)


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 16  # the CPU interpreter: a nominal count under which the small test shapes split their key range
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _NUM_SMS.get(index)
    if count is None:
        count = _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


# An eager decode step over at most this many keys (per row, past the prefix) runs as one program per (row block,
# head), which writes the output itself (SPLIT=False): no split-K partials and no combine launch.  An eager batch-1
# decode step is bound by the host, on which the combine's launch cost about 15-20 us per layer and step (an H200
# host; `benchmarks/decode_step_sections.py`), while one program reads 1,024 keys of a head in a few microseconds of
# a GPU that waits for the host anyway.  A step under CUDA-graph capture or `torch.compile` (the static cache's)
# launches nothing from the host per step, so it keeps the split count that is fastest on the GPU.  0 turns the rule
# off (for an A/B).  Any launch whose split count comes out as 1 runs unsplit too.  In Triton's interpreter the rule
# is off: the split count's own rule there (chunks of at least 32 keys) runs up to 32 keys unsplit and splits longer
# test shapes, so that tests exercise both the unsplit launch and the merge.
EAGER_SINGLE_SPLIT_MAX_KEYS = 1024


def single_split_decode(span: int, device) -> bool:
    """Whether an eager decode launch over ``span`` keys runs unsplit (see ``EAGER_SINGLE_SPLIT_MAX_KEYS``)."""
    limit = EAGER_SINGLE_SPLIT_MAX_KEYS
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(
            f"hf_rbf.kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS must be an int >= 0 (0: every decode launch split "
            f"by the GPU's rule); got {limit!r}"
        )
    if DEFINED_INTERPRETED or span > limit or torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def decode_splits(bsz: int, heads: int, nq: int, span: int, device) -> int:
    """Split-K count: about two waves of programs over the SMs, each chunk at least 256 keys (32 in the
    interpreter, so that small test shapes exercise the merge); 1 for an eager step over a few keys
    (:func:`single_split_decode`)."""
    if single_split_decode(span, device):
        return 1
    rows_blocks = ceil_div(nq, 16)
    want = ceil_div(2 * _num_sms(device), bsz * heads * rows_blocks)
    min_chunk = 32 if DEFINED_INTERPRETED else 256
    return int(max(1, min(want, ceil_div(max(span, 1), min_chunk), 128)))


# A decode step launches the same configuration in every layer and at every step: only the key length (with it the
# split count and the length bucket), the strides of the growing cache and the tensors change.  The launch's
# constexprs and the arguments fixed by the configuration are worked out once per configuration (`_decode_plan`), and
# the split-K partial results go to scratch kept per (device, stream, thread, shape) (`_decode_scratch`), not to four
# fresh allocations per launch.  On the CPU of this project (Triton's interpreter, launches stubbed: the host path of
# benchmarks/host_decode_step.py) this took a decode-step layer's `distance_decode` from 28.7 to 19.6 us (rbf;
# 0.64-0.68x for every family, one-process A/B against the previous commit's package copy).
_DECODE_PLANS: dict = {}
_DECODE_PLANS_MAX = 256  # distinct configurations (a model has a few); the dict is emptied when it reaches this size


def _decode_plan(q, v, kb, qs, b, causal, window, num_prefix_keys, normalize, qnorm, knorm, kv_same, eps, prefix,
                 tau_in):  # fmt: skip
    """``(kernel keywords, fixed scalars before the key length, fixed scalars after it, combine keywords)`` of a
    decode launch: what ``_flags`` and ``_launch_args`` compute from the configuration alone, kept per key of every
    value they read (shapes, dtype, device, the flags, tf32 through ``dot_precision``)."""
    prec = dot_precision(q.dtype)  # (reads torch's tf32 switch, which may change between calls)
    key = (q.shape, v.shape[1], v.shape[3], q.dtype, q.device, prec, causal, window, num_prefix_keys, normalize, qnorm,
           knorm, kv_same, eps, tau_in, kb is None, qs is None, b is None, prefix is None)  # fmt: skip
    plan = _DECODE_PLANS.get(key)
    if plan is None:
        bsz, heads, _, d = q.shape
        groups, dv = v.shape[1], v.shape[3]
        flags = _flags(
            q, d, dv, causal, window, kb, qs, qnorm, normalize, eps, kv_same, knorm, prefix, b is None, tau_in,
            num_prefix_keys,
        )
        combine = dict(DV=dv, DV_PAD=padded_dim(dv), NORMALIZE=normalize, HAS_EPS=flags["HAS_EPS"], num_warps=4)
        plan = (
            {"SPLIT": True, **flags},
            (heads, heads // groups, q.shape[2]),
            (num_prefix_keys, window or 0, math.log2(eps) if eps > 0 else 0.0),
            planes_bucket(bsz * heads),
            combine,
        )
        if len(_DECODE_PLANS) >= _DECODE_PLANS_MAX:
            _DECODE_PLANS.clear()
        _DECODE_PLANS[key] = plan
    return plan


# Split-K scratch: (device, thread, inference mode, B * H, Nq, Dv) -> (acc, mp, lp, erow), sized for at least the
# split count of the call.  Reuse is safe where the launches that use one set of buffers run in order: the decode
# kernel writes every partial result the combine kernel of the same call reads (each split of each row, whatever was
# there before), the combine reads them before the next call's decode kernel (same stream: launches run in order),
# and the buffers never leave `distance_decode` (the output is fresh at every call).  So scratch is kept only for
# launches on the device's default stream (`tensors_keepable`: not on a stream of the caller's, whose launches may
# overlap the default stream's, nor during CUDA graph capture, whose graph replays on the addresses it recorded, nor in
# cudagraph trees' warm-up, whose allocations go to the trees' pool), per host thread (two threads queueing on one
# stream could interleave their decode and combine launches).  Bounded in bytes: emptied when a new set would pass the
# limit.
_DECODE_SCRATCH: dict = {}
_DECODE_SCRATCH_BYTES = [0]
DECODE_SCRATCH_MAX_BYTES = 64 * 2**20


def _decode_scratch(device, bh: int, n_split: int, nq: int, dv: int):
    """``(acc [B*H, >= n_split, Nq, Dv], mp, lp [B*H, >= n_split, Nq], erow [B*H, Nq])`` float32, reused across calls
    where that is safe (see above); the kernels address them from their base pointers with the call's split count."""
    if not tensors_keepable(device):  # a capture, or cudagraph trees' warm-up whose allocations go to their pool
        return _new_decode_scratch(device, bh, n_split, nq, dv)
    key = (device, threading.get_ident(), torch.is_inference_mode_enabled(), bh, nq, dv)
    entry = _DECODE_SCRATCH.get(key)
    if entry is not None and entry[0] >= n_split:
        return entry[1]
    buffers = _new_decode_scratch(device, bh, n_split, nq, dv)
    size = 4 * sum(t.numel() for t in buffers)
    if entry is not None:
        _DECODE_SCRATCH_BYTES[0] -= entry[2]
        del _DECODE_SCRATCH[key]
    if _DECODE_SCRATCH_BYTES[0] + size > DECODE_SCRATCH_MAX_BYTES:
        _DECODE_SCRATCH.clear()
        _DECODE_SCRATCH_BYTES[0] = 0
    if size <= DECODE_SCRATCH_MAX_BYTES:
        _DECODE_SCRATCH[key] = (n_split, buffers, size)
        _DECODE_SCRATCH_BYTES[0] += size
    return buffers


def _new_decode_scratch(device, bh: int, n_split: int, nq: int, dv: int):
    acc = torch.empty(bh, n_split, nq, dv, device=device, dtype=torch.float32)
    mp = torch.empty(bh, n_split, nq, device=device, dtype=torch.float32)
    return acc, mp, torch.empty_like(mp), torch.empty(bh, nq, device=device, dtype=torch.float32)


def distance_decode(
    q,
    k,
    v,
    kb,
    qs,
    ks,
    beta,
    a,
    b,
    *,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    prefix=None,
    tau_in=False,
):
    """Forward for a few query rows (a decode step) with the key range split over programs; output only.

    ``kb`` here holds only key log-weights and padding (or is None): with ``knorm`` the key norms are computed from
    the key tiles inside the kernel.  The arguments ``_launch_args`` / ``_flags`` build for the forward, with what the
    configuration fixes taken from ``_decode_plan``; the output is a fresh tensor.
    """
    flags, fixed, fixed_mid, planes, combine = _decode_plan(
        q, v, kb, qs, b, causal, window, num_prefix_keys, normalize, qnorm, knorm, kv_same, eps, prefix, tau_in
    )
    bsz, heads, nq, _ = q.shape
    dv = v.shape[3]
    nk = k.shape[2] + (num_prefix_keys if prefix is not None else 0)
    out = torch.empty(bsz, heads, nq, dv, device=q.device, dtype=q.dtype)
    if nq == 0:
        return out
    _, _, sprefix = prefix_args(prefix, k, v, bsz)
    if qs is not None:
        sscalar = bcast_strides(qs, (bsz, heads, nq)) + bcast_strides(ks, (bsz, heads, nk))
        sscalar += bcast_strides(beta, (bsz, heads, nq))
    else:
        sscalar = (0,) * 9
    span = nk - num_prefix_keys if window is None else min(nk - num_prefix_keys, window + nq)
    n_split = decode_splits(bsz, heads, nq, span, q.device)
    acc, mp, lp, erow = _decode_scratch(q.device, bsz * heads, n_split, nq, dv)
    grid = lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), bsz * heads, n_split)  # noqa: E731
    if n_split == 1:  # (the output written by the kernel, as the training forward does; its lse into scratch)
        outputs, out_strides, flags = (out, erow, erow, erow), out.stride()[:3], {**flags, "SPLIT": False}
    else:
        outputs, out_strides = (acc, mp, lp, erow), (0, 0, 0)
    launch_tuned(
        _distance_decode,
        grid,
        *launch_inputs(q, k, v, kb, qs, ks, beta, a, b, prefix),
        *outputs,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out_strides,
        *sscalar,
        *sprefix,
        *fixed,
        nk,
        *fixed_mid,
        n_bucket(max(nq, nk)),
        planes,
        **flags,
    )
    if n_split == 1:
        return out
    launch_jit(
        _decode_combine_kernel,
        (nq, bsz * heads),
        (acc, mp, lp, erow, out, *out.stride()[:3], heads, nq, n_split),
        {**combine, "SPLIT_PAD": max(2, next_pow2(n_split))},
    )
    return out
