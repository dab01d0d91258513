"""Forward kernel of scalar (sort) attention: a rank-1 Gaussian score and grouped values.

``s_ij = -beta_i (qs_i - ks_j)^2 + kb_j`` (log2 units, ``beta = log2(e) / tau``): the score needs no tensor-core
product at all, only three fp32 operations per pair (the exact difference, not the expanded ``qs ks`` product, which
would cancel badly for large scalar keys).  The only matrix product is ``P @ V``.

Grouped values: ``HP`` heads of one value group may share a program.  Their query rows are then stacked,
``ROWS = HP * BLOCK_M`` rows ordered (head, query), so each value tile is loaded once and multiplied by a
``[ROWS, BLOCK_N]`` weight tile: the heads of a group read V once instead of ``HP`` times.  The per-head scalar keys
of a tile are loaded as ``[HP, BLOCK_N]`` and broadcast to the stacked rows with a reshape (no gather).  ``HP`` is
autotuned like a tile size (1, 2 or 4, dividing the group size): the first H200 run, with HP fixed at 4, was four
times slower than the flash forward, which points at the reshape's layout conversions; ``HP = 1`` is a plain
two-dimensional tile whose values come from L2 for the group's other heads.  Masks, prefix and the online softmax
follow ``kernels_flash_fwd.py``.

Row maximum: with bfloat16 values and no key bias every score is at most 0 and the row's own key bounds the maximum
from below, so a program whose rows all have their own key near enough runs its tile loop with a fixed reference
instead of the online maximum (no maximum, no rescale per tile: ``_fixed_reference``); the others run the online
loop.  The loop is bound by issuing instructions (offline sm_90: 630 -> 471 per 128 x 64 tile, the exponentials'
own 512 cycles now the bound; ``benchmarks/results/offline-sm90-2026-11-29c``).
"""

from __future__ import annotations

import os

import torch

from .kernels_common import (
    HAS_TRITON,
    autotune,
    autotune_subset,
    bcast_strides,
    dot_precision,
    launch_tuned,
    make_configs,
    n_bucket,
    padded_dim,
    planes_bucket,
    shared_memory_fits,
    wrap_triton,
)
from .kernels_launch import direct_plan, keep_plan, launch_plan, plan_allowed, tensor_signature

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .kernels_common import _allowed, _dot, _key_range, _load_tile


# ROWS = query rows per program = HP heads x BLOCK_M queries.  HP (heads of one value group stacked in a program)
# is tuned like a tile size: HP = 1 keeps every tile two-dimensional (each head re-reads the group's values from L2),
# HP > 1 reads each value tile once per group at the price of broadcasting the per-head keys to the stacked rows.
SCALAR_FWD_CONFIGS = [
    # first (the choice with autotuning off): no spills, 169 registers per thread in an offline sm_90 compile
    # (benchmarks/offline_kernel_report.py, after the score tile took the tensor-core layout: see _mma_anchor)
    ({"ROWS": 128, "BLOCK_N": 64, "HP": 1}, 8, 3),
    ({"ROWS": 128, "BLOCK_N": 128, "HP": 1}, 8, 3),
    ({"ROWS": 128, "BLOCK_N": 64, "HP": 1}, 4, 3),
    ({"ROWS": 64, "BLOCK_N": 64, "HP": 1}, 4, 3),
    ({"ROWS": 128, "BLOCK_N": 32, "HP": 1}, 4, 3),
    ({"ROWS": 128, "BLOCK_N": 64, "HP": 4}, 4, 3),
    ({"ROWS": 256, "BLOCK_N": 64, "HP": 4}, 8, 3),
    ({"ROWS": 64, "BLOCK_N": 64, "HP": 2}, 4, 3),
]
# the interpreter runs the first fitting entry (HP = 1), or the one HF_RBF_SCALAR_HEADS_PER_PROGRAM asks for
INTERPRET_CONFIGS = [
    ({"ROWS": 16, "BLOCK_N": 16, "HP": 1}, 1, 1),
    ({"ROWS": 32, "BLOCK_N": 16, "HP": 2}, 1, 1),
    ({"ROWS": 64, "BLOCK_N": 16, "HP": 4}, 1, 1),
]


def requested_heads_per_program() -> int:
    """``HF_RBF_SCALAR_HEADS_PER_PROGRAM`` (tests and experiments): force HP; 0 lets the autotuner choose."""
    return int(os.environ.get("HF_RBF_SCALAR_HEADS_PER_PROGRAM", "0"))


def prune_scalar(configs, nargs, stationary_rows_key, acc_rows_key):
    """Configs whose HP divides the group size (and matches HP_REQ), with at least 16 query rows per head, the fp32
    accumulator in registers and the tiles in shared memory."""
    hpg, dv_pad, hp_req = nargs["HPG"], nargs["DV_PAD"], nargs["HP_REQ"]
    el = nargs["V"].element_size()
    out = []
    for c in configs:
        hp, rows = c.kwargs["HP"], c.kwargs["ROWS"]
        if hpg % hp or (hp_req and hp != hp_req) or rows < 16 * hp:
            continue
        if c.kwargs[acc_rows_key] * dv_pad * 4 / (32 * c.num_warps * 4) > 128:
            continue
        stationary = c.kwargs[stationary_rows_key]
        streamed = c.kwargs["BLOCK_N"] if stationary_rows_key == "ROWS" else rows
        if not shared_memory_fits(stationary, streamed, 0, dv_pad, c.num_stages, el):
            continue
        out.append(c)
    if not out:
        hp = hp_req if hp_req and hpg % hp_req == 0 else 1
        out = [triton.Config({"ROWS": 16 * hp, "BLOCK_N": 32, "HP": hp}, num_warps=4, num_stages=2)]
    return autotune_subset(out, nargs)


def _prune(configs, nargs, **kwargs):
    return prune_scalar(configs, {**nargs, **kwargs}, "ROWS", "ROWS")


if HAS_TRITON:

    @triton.jit
    def _mma_anchor(M: tl.constexpr, N: tl.constexpr):
        """A ``[M, N]`` fp32 tile of zeros in the tensor-core accumulator layout: the product of two zero tiles.

        The scalar score tile is built from broadcast row and column vectors, not by a ``tl.dot``, so nothing ties it
        to the layout of the ``P @ V`` product that consumes it.  Triton then gave the score tile a blocked layout,
        converted it through shared memory for the product and for the row statistics every tile, and computed it
        twice (once per layout): compiled offline for sm_90 (``benchmarks/offline_kernel_report.py``, ROWS 128 x
        BLOCK_N 64, 4 warps) the forward spilled 1,744 bytes per thread, with 1,937 local-memory and 1,613
        shared-memory instructions.  Moving the row vectors into this tile's row layout once per program
        (:func:`_rows_of`) makes every tile in the loop inherit it: no spills, 28 + 87 shared-memory instructions,
        a third of the instructions.  One ``[M, 16] x [16, N]`` product per program is the price.
        """
        return tl.dot(tl.zeros([M, 16], tl.float16), tl.zeros([16, N], tl.float16))

    @triton.jit
    def _rows_of(anchor, x):
        """``x [M]`` in the row layout of ``anchor [M, N]`` (see :func:`_mma_anchor`): the maximum of ``N`` exact
        copies, so the values are ``x`` itself (integers too)."""
        return tl.max(anchor.to(x.dtype) + x[:, None], 1)

    @triton.jit
    def _stacked(x, HP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """``[HP, BLOCK_N]`` per-head key values -> rows ``HP * BLOCK_M`` (row r reads head r // BLOCK_M).

        With one head per program the ``[1, BLOCK_N]`` tile simply broadcasts (no reshape, no layout change).
        """
        if HP == 1:
            out = x
        else:
            out = tl.reshape(tl.broadcast_to(x[:, None, :], (HP, BLOCK_M, BLOCK_N)), (HP * BLOCK_M, BLOCK_N))
        return out

    @triton.jit
    def _segment(SEG: tl.constexpr, start, full_lo, full_hi, end):
        """Tile range ``[lo, hi)`` of segment ``SEG`` of a program's loop over the sequence tiles of the other side.

        Every pass visits its tiles in segments: SEG 0 the ``P`` prefix keys (visible to every query: only the bound
        is masked; the forward and dQ passes visit them first), then the ranges of ``kernels_common._tile_range``:
        SEG 1 and 3 the partly masked edges (the diagonal and the window's far edge: position mask), SEG 2 the fully
        allowed middle (no mask at all).  The passes loop over SEG with ``tl.static_range``, so each segment is
        compiled on its own with SEG a constant: the same code as separately written loops, and the middle range
        carries no mask arithmetic.
        """
        if SEG == 1:
            lo = start
            hi = full_lo
        elif SEG == 2:
            lo = full_lo
            hi = full_hi
        else:
            lo = full_hi
            hi = end
        return lo, hi

    @triton.jit
    def _segment_keys(SEG: tl.constexpr, t0, NQ, P, S, WINDOW, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        """Key tiles ``[lo, hi)`` of segment ``SEG`` for the forward's and dQ pass's block of query rows, with the
        keys' base index and bound: SEG 0 the ``P`` prefix keys (``0 .. P``), SEG 1-3 the sequence keys ``P + 0 ..
        P + S`` this block may see (``_segment``; the range is recomputed per segment, integer work once per
        program)."""
        if SEG == 0:
            lo = 0
            hi = P
            key_base = 0
            bound = P
        else:
            pid_m = tl.program_id(0)
            t_first = t0 + pid_m * BLOCK_M
            t_last = t0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
            start, full_lo, full_hi, end = _key_range(t_first, t_last, S, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_N)
            lo, hi = _segment(SEG, start, full_lo, full_hi, end)
            key_base = P
            bound = S
        return lo, hi, key_base, bound

    @triton.jit
    def _program_rows(H, HPG, NQ, NK, P, HP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
        """The stacked query rows of a forward / dQ program (grid ``(query blocks, B * H / HP)``): batch ``b``, first
        head ``h0``, value group ``g``, the sequence length ``S`` and query row 0's position ``t0``, and per row
        (ordered head-major) its query index ``i``, head ``h_r`` and whether it exists."""
        pid_m = tl.program_id(0)
        pid_c = tl.program_id(1).to(tl.int64)  # 64-bit offsets from here on
        n_chunks = H // HP
        b = pid_c // n_chunks
        h0 = (pid_c % n_chunks) * HP
        g = h0 // HPG
        S = NK - P  # sequence keys (after the P prefix keys)
        t0 = S - NQ  # position of query row 0 (bottom-right alignment)
        offs_r = tl.arange(0, ROWS)
        i = pid_m * BLOCK_M + offs_r % BLOCK_M
        h_r = h0 + offs_r // BLOCK_M
        return b, h0, g, S, t0, i, h_r, i < NQ

    @triton.jit
    def _row_beta(TAU, BETA_VALUE, b, h_r, i, row_ok, stb, sth, stn, TAU_TENSOR: tl.constexpr, ROWS: tl.constexpr):
        """``beta = 1 / tau`` of each stacked row, from the temperature itself (no torch op per call).

        TAU_TENSOR (constexpr): a ``[B|1, H|1, Nq|1]`` tensor read through its broadcast strides, and the reciprocal
        taken with IEEE rounding (``div_rn``: Triton's ``/`` on fp32 is the approximate ``div.full``), the value
        ``1.0 / tau.float()`` gives in torch; otherwise a global float, passed as ``BETA_VALUE = 1 / tau`` (fp32):
        no load at all.  Rows past the end read ``tau = 1`` (finite, never stored).
        """
        if TAU_TENSOR:
            tau = tl.load(TAU + b * stb + h_r * sth + i * stn, mask=row_ok, other=1.0).to(tl.float32)
            beta = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tau)
        else:
            beta = tl.full([ROWS], BETA_VALUE, tl.float32)
        return beta

    @triton.jit
    def _log2_beta(beta, ROWS: tl.constexpr):
        """``(beta, 1 / beta)`` with ``beta`` in log2 units (times ``log2(e)``), at least ``2^-60``: the kernels work
        with the scores over beta (``_scores``) and take beta back by a multiply, so beta must be positive.
        ``tau = inf`` (beta 0, no scalar term) then keeps ``-inf * beta = -inf`` for masked keys and changes a score
        by at most ``2^-60 (qs - ks)^2`` (tau <= 0 is outside the contract and not checked on the device).
        ``1 / beta`` (``div_rn``) scales the key bias; without one it is unused and compiled away."""
        beta = tl.maximum(beta * 1.4426950408889634, 8.673617379884035e-19)
        return beta, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), beta)

    @triton.jit
    def _scores(
        start_n,
        key_base,
        bound,
        qs_r,
        inv_beta_r,
        t_r,
        offs_h,
        KS_ptr,
        KB_ptr,
        sksh,
        sksn,
        NK,
        WINDOW,
        SEG: tl.constexpr,
        HP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
    ):
        """The ``[ROWS, BLOCK_N]`` score tile of the stacked query rows against the key tile at ``start_n`` (keys
        ``j = key_base + start_n + n``, valid where ``col_ok``), divided by the row's ``beta`` (log2 units, times
        ``log2(e)``): ``s / beta = -(qs_i - ks_j)^2 + kb_j / beta`` (``inv_beta_r``: ``1 / beta``, read only with key
        weights), masked as segment ``SEG`` requires, and ``dd = qs_i - ks_j`` (the dQ pass's gradient factor; the
        forward drops it).  The callers take ``beta`` back in one fma per element, ``exp2(s' * beta - m)``, where the
        score ``s' * beta`` used to cost a multiply of its own (``beta > 0``: the row maximum of ``s'`` times beta is
        that of the scores).  Returns ``(s', dd, j, col_ok)``.  Shared by the forward and dQ passes, which must see
        the same scores.  ``offs_h``: ``tl.arange(0, HP)``, the program's heads (made once, outside the tile loop)."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        j = key_base + offs_n
        col_ok = offs_n < bound
        if SEG == 2:  # the full middle range: every key exists, no mask (it costs a select per loaded pair)
            ks = tl.load(KS_ptr + offs_h[:, None] * sksh + j[None, :] * sksn)
        else:
            ks = tl.load(KS_ptr + offs_h[:, None] * sksh + j[None, :] * sksn, mask=col_ok[None, :], other=0.0)
        dd = qs_r[:, None] - _stacked(ks.to(tl.float32), HP, BLOCK_M, BLOCK_N)
        s = -(dd * dd)
        if HAS_KB:  # key log-weights / padding: one fp32 load per key (constexpr: no load without them)
            kb = tl.load(KB_ptr + offs_h[:, None] * NK + j[None, :], mask=col_ok[None, :], other=float("-inf"))
            s += _stacked(kb, HP, BLOCK_M, BLOCK_N) * inv_beta_r[:, None]
        if SEG == 0:
            s = tl.where(col_ok[None, :], s, float("-inf"))
        elif SEG != 2:
            ok = _allowed(t_r[:, None], offs_n[None, :], WINDOW, CAUSAL, HAS_WINDOW) & col_ok[None, :]
            s = tl.where(ok, s, float("-inf"))
        return s, dd, j, col_ok

    # A fixed reference m may stand in for the row maximum as long as every exponent s - m stays in [-60, 60]
    # (log2 units) for the keys that matter: no overflow, and the largest term at least 2^-60, so the terms that
    # underflow (below 2^-126) change the sum by less than 2^-66 each.
    FIXED_REFERENCE_SPAN = tl.constexpr(60.0)

    @triton.jit
    def _fixed_reference(qs, beta, t, h_r, row_ok, KS_b, sksh, sksn, P, S, WINDOW, CAUSAL: tl.constexpr,
                         HAS_WINDOW: tl.constexpr):  # fmt: skip
        """Each row's fixed reference for the forward's loop without a maximum, or ``-inf`` where it has none.

        Without a key bias every score ``-beta (qs - ks)^2`` is at most 0, and the row's own key (the diagonal,
        allowed under every mask) gives a lower bound ``L`` on its maximum.  So ``m = L / 2`` keeps every exponent
        ``s - m`` within ``[L / 2, -L / 2]`` for the row's largest score, which is in range while ``L >= -2 *
        FIXED_REFERENCE_SPAN``.  Rows past the end take 0.  A row whose own key is far (``L`` below that), masked or
        absent gets ``-inf``: then the program runs the online maximum instead.

        Why: with a rank-1 score the row maximum and the rescale of the accumulator cost two of the loop's eight
        instructions per score element, in a loop bound by issuing them (offline sm_90 SASS).  The bound costs an
        exponent's rounding at most ``ulp(60)`` (2.6e-6 relative), far below the bfloat16 rounding of the weights
        before the value product, which is why only bfloat16 values take this path."""
        has = row_ok & (t >= 0) & (t < S) & _allowed(t, t, WINDOW, CAUSAL, HAS_WINDOW)
        ks = tl.load(KS_b + h_r * sksh + (P + t) * sksn, mask=has, other=0.0).to(tl.float32)
        d = qs - ks
        half = -0.5 * (d * d) * beta
        m = tl.where(has & (half >= -FIXED_REFERENCE_SPAN), half, float("-inf"))
        return tl.where(row_ok, m, 0.0)

    @triton.jit
    def _fwd_tiles(
        acc,
        l_i,
        m_i,
        qs_r,
        beta_r,
        inv_beta_r,
        t_r,
        t0,
        KS_ptr,
        V_ptr,
        KB_ptr,
        sksh,
        sksn,
        svn,
        NQ,
        NK,
        P,
        S,
        WINDOW,
        FIXED_MAX: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_KB: tl.constexpr,
        DOT_PREC: tl.constexpr,
        HP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The forward's tile loop over the prefix and the sequence keys (segments, see ``_segment``), accumulating
        ``acc = sum_j 2^(s_ij - m_i) v_j`` and ``l_i = sum_j 2^(s_ij - m_i)``.  FIXED_MAX (constexpr): ``m_i`` is a
        fixed reference chosen by the caller (see ``_fixed_reference``), else the online maximum (flash's rescale)."""
        offs_h = tl.arange(0, HP)
        offs_dv = tl.arange(0, DV_PAD)
        for SEG in tl.static_range(4):
            lo, hi, key_base, bound = _segment_keys(SEG, t0, NQ, P, S, WINDOW, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
            for start_n in range(lo, hi, BLOCK_N):
                s, _, j, col_ok = _scores(
                    start_n,
                    key_base,
                    bound,
                    qs_r,
                    inv_beta_r,
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
                if FIXED_MAX:  # m_i is the row's fixed reference: no maximum, no rescale of l_i and acc
                    p = tl.math.exp2(s * beta_r[:, None] - m_i[:, None])
                    l_i += tl.sum(p, 1)
                else:
                    # s is the score over beta: the row maximum in score units is max(s) * beta (beta > 0), and
                    # the exponent s * beta - m one fma per element
                    m_new = tl.maximum(m_i, tl.max(s, 1) * beta_r)
                    # A row that has seen no allowed key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.math.exp2(s * beta_r[:, None] - m_use[:, None])
                    alpha = tl.math.exp2(m_i - m_use)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None]
                    m_i = m_new
                # the full middle range needs no row mask on the value tile (SEG is a constant: no code for it)
                v = _load_tile(V_ptr + j[:, None] * svn + offs_dv[None, :], col_ok, offs_dv, DV, DV_PAD, SEG != 2)
                acc = _dot(p.to(v.dtype), v, acc, DOT_PREC)

        return acc, l_i, m_i

    @triton.jit
    def _scalar_fwd_kernel(
        QS,
        KS,
        V,
        KB,
        TAU,
        BETA_VALUE,
        OUT,
        LSE,
        sqsb,
        sqsh,
        sqsn,
        sksb,
        sksh,
        sksn,
        svb,
        svh,
        svn,
        sob,
        soh,
        son,
        stb,
        sth,
        stn,
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
        FIXED_OK: tl.constexpr,
        DOT_PREC: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HP: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = ROWS // HP
        b, h0, g, S, t0, i, h_r, row_ok = _program_rows(H, HPG, NQ, NK, P, HP, BLOCK_M, ROWS)
        qs_r = tl.load(QS + b * sqsb + h_r * sqsh + i * sqsn, mask=row_ok, other=0.0).to(tl.float32)
        beta_r = _row_beta(TAU, BETA_VALUE, b, h_r, i, row_ok, stb, sth, stn, TAU_TENSOR, ROWS)
        beta_r, inv_beta_r = _log2_beta(beta_r, ROWS)
        t_r = t0 + i
        if FIXED_OK:
            m_fix = _fixed_reference(
                qs_r, beta_r, t_r, h_r, row_ok, KS + b * sksb, sksh, sksn, P, S, WINDOW, CAUSAL, HAS_WINDOW
            )
        # the row vectors in the score tile's tensor-core layout (see _mma_anchor)
        anchor = _mma_anchor(ROWS, BLOCK_N)
        qs_r = _rows_of(anchor, qs_r)
        beta_r = _rows_of(anchor, beta_r)
        inv_beta_r = _rows_of(anchor, inv_beta_r)
        t_r = _rows_of(anchor, t_r)
        acc = tl.zeros([ROWS, DV_PAD], dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        KS_ptr = KS + b * sksb + h0 * sksh
        V_ptr = V + b * svb + g * svh
        KB_ptr = KB + (b * H + h0) * NK
        # bfloat16 values, no key bias: the loop without a maximum where every row has a reference.  Three calls, not
        # two: triton compiles both arms of a runtime branch, and a Python default for the choice is not folded, so
        # without FIXED_OK only the online loop may appear (fp32 / fp16 would otherwise compile the fixed one too).
        if FIXED_OK:
            m_fix = _rows_of(anchor, m_fix)
            if tl.min(m_fix, 0) > float("-inf"):
                acc, l_i, m_i = _fwd_tiles(
                    acc, l_i, m_fix, qs_r, beta_r, inv_beta_r, t_r, t0, KS_ptr, V_ptr, KB_ptr, sksh, sksn, svn,
                    NQ, NK, P, S, WINDOW, True, DV, DV_PAD, CAUSAL, HAS_WINDOW, HAS_KB, DOT_PREC, HP, BLOCK_M, BLOCK_N,
                )  # fmt: skip
            else:
                acc, l_i, m_i = _fwd_tiles(
                    acc, l_i, m_i, qs_r, beta_r, inv_beta_r, t_r, t0, KS_ptr, V_ptr, KB_ptr, sksh, sksn, svn,
                    NQ, NK, P, S, WINDOW, False, DV, DV_PAD, CAUSAL, HAS_WINDOW, HAS_KB, DOT_PREC, HP, BLOCK_M, BLOCK_N,
                )  # fmt: skip
        else:
            acc, l_i, m_i = _fwd_tiles(
                acc, l_i, m_i, qs_r, beta_r, inv_beta_r, t_r, t0, KS_ptr, V_ptr, KB_ptr, sksh, sksn, svn,
                NQ, NK, P, S, WINDOW, False, DV, DV_PAD, CAUSAL, HAS_WINDOW, HAS_KB, DOT_PREC, HP, BLOCK_M, BLOCK_N,
            )  # fmt: skip

        offs_dv = tl.arange(0, DV_PAD)
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse = tl.where(l_i > 0, m_use + tl.math.log2(l_i), float("inf"))
        out = acc * tl.math.exp2(m_i - lse)[:, None]
        tl.store(
            OUT + b * sob + h_r[:, None] * soh + i[:, None] * son + offs_dv[None, :],
            out.to(OUT.dtype.element_ty),
            mask=row_ok[:, None] & (offs_dv[None, :] < DV),
        )
        tl.store(LSE + (b * H + h_r) * NQ + i, lse, mask=row_ok)

    SCALAR_KEY = ["DV_PAD", "HPG", "HP_REQ", "N_BUCKET", "PLANES", "CAUSAL", "HAS_WINDOW"]
    _scalar_fwd = autotune(make_configs(SCALAR_FWD_CONFIGS, INTERPRET_CONFIGS), SCALAR_KEY, _prune)(_scalar_fwd_kernel)


def tau_args(tau, bsz: int, heads: int, nq: int, dummy):
    """``(TAU, BETA_VALUE, (stb, sth, stn), TAU_TENSOR)`` kernel arguments of a temperature: a float (passed as
    ``1 / tau``) or a ``[B|1, H|1, Nq|1]`` tensor read in-kernel through its broadcast strides (computed in Python:
    no ``expand`` op)."""
    if isinstance(tau, torch.Tensor):
        return tau, 1.0, bcast_strides(tau, (bsz, heads, nq)), True
    return dummy, 1.0 / float(tau), (0, 0, 0), False


def scalar_forward(qs, ks, v, kb, tau, *, causal, window, num_prefix_keys, traced=False):
    """Launch the scalar forward.  ``qs [B,H,Nq]``, ``ks [B,H,Nk]`` (any strides), ``v [B,G,Nk,Dv]`` (last dim
    contiguous), ``kb``: key bias ``[B,H,Nk]`` fp32 or None, ``tau``: a positive float or a ``[B|1,H|1,Nq|1]`` tensor
    (the kernel takes ``beta = 1 / tau`` itself).  ``traced``: called from the triton_op ``scalar_fwd_t`` while it
    is traced (the launch goes through a literal ``wrap_triton``, Inductor launches the kernel).

    Returns ``(out [B,H,Nq,Dv] in v's dtype, lse [B,H,Nq] fp32)``.  Written: ``OUT``, ``LSE`` only (``KB`` / ``TAU``
    on the ``lse`` placeholder are read under ``HAS_KB`` / ``TAU_TENSOR`` alone).
    """
    bsz, heads, nq = qs.shape
    nk = ks.shape[2]
    groups, dv = v.shape[1], v.shape[3]
    hpg = heads // groups
    out = torch.empty(bsz, heads, nq, dv, device=v.device, dtype=v.dtype)
    lse = torch.empty(bsz, heads, nq, device=v.device, dtype=torch.float32)
    if nq == 0:
        return out, lse
    plan_key = None
    if not traced:  # a call signature launched before: its plan (see kernels_launch.direct_plan; GPU only)
        device = torch.cuda.current_device() if v.is_cuda else -1
        plan_key, pointers = scalar_plan_key([qs, ks, v], kb, tau, device, causal, window, num_prefix_keys)
        plan = _FWD_PLANS.get(plan_key)  # (none on the CPU: direct_plan makes none there)
        p_out, p_lse = out.data_ptr(), lse.data_ptr()
        if plan is not None and plan_allowed(plan) and not (p_out | p_lse) & 15:  # (fresh blocks always are)
            rest = iter(pointers[3:])  # kb, tau: those that are tensors, in this order; else lse stands in
            p_kb = next(rest) if kb is not None else p_lse
            p_tau = next(rest) if isinstance(tau, torch.Tensor) else p_lse
            launch_plan(plan, pointers[:3] + [p_kb, p_tau, p_out, p_lse], device)
            return out, lse
    tau_t, beta_value, stau, tau_tensor = tau_args(tau, bsz, heads, nq, lse)
    grid = lambda meta: (triton.cdiv(nq, meta["ROWS"] // meta["HP"]), bsz * (heads // meta["HP"]))  # noqa: E731
    args = (
        qs,
        ks,
        v,
        kb if kb is not None else lse,
        tau_t,
        beta_value,
        out,
        lse,
        *bcast_strides(qs, (bsz, heads, nq)),
        *bcast_strides(ks, (bsz, heads, nk)),
        *v.stride()[:3],
        *out.stride()[:3],
        *stau,
        heads,
        hpg,
        nq,
        nk,
        num_prefix_keys,
        window or 0,
        n_bucket(max(nq, nk)),
        planes_bucket(bsz * heads),
        requested_heads_per_program(),
    )
    kwargs = dict(
        DV=dv,
        DV_PAD=padded_dim(dv),
        CAUSAL=causal,
        HAS_WINDOW=window is not None,
        HAS_KB=kb is not None,
        TAU_TENSOR=tau_tensor,
        FIXED_OK=kb is None and v.dtype == torch.bfloat16,
        DOT_PREC=dot_precision(v.dtype),
    )
    if traced:
        wrap_triton(_scalar_fwd)[grid](*args, **kwargs)
        return out, lse
    launch_tuned(_scalar_fwd, grid, *args, **kwargs)
    if plan_key is not None:
        plan = direct_plan(_scalar_fwd, grid, args, kwargs, 7)  # QS, KS, V, KB, TAU, OUT, LSE
        if plan is not None:
            keep_plan(_FWD_PLANS, plan_key, plan)
    return out, lse


# call signature -> kernels_launch.direct_plan of the scalar forward
_FWD_PLANS: dict = {}


def scalar_plan_key(tensors: list, kb, tau, device, *options):
    """``(key, addresses)`` of a scalar launch (see ``kernels_flash_fwd.forward_plan_key``): the signature of
    ``tensors`` plus the key bias and ``tau`` where they are tensors, which of the two are, a float ``tau``'s value
    (the kernels take ``1 / tau``), the device, ``options`` (the call's other arguments), the heads-per-program
    setting and tf32.  The addresses come in that order (the caller puts them in the kernels' slots)."""
    tau_tensor = isinstance(tau, torch.Tensor)
    signature, pointers = tensor_signature(tensors + ([kb] if kb is not None else []) + ([tau] if tau_tensor else []))
    absent = (kb is None, None if tau_tensor else float(tau))
    key = (signature, device, absent, options, requested_heads_per_program(), dot_precision(tensors[2].dtype))
    return key, pointers
