"""One fused Triton launch per layer for the decode step of the fixed-capacity sorted cache
(:class:`~hf_rbf.cache_sorted_static.StaticSortedLayer`): insert the new token, search every sorted block, pick the
window, score it with the scalar sink / registers prefix, softmax and value sum, for every row and head.

Its reference is the PyTorch static path (``StaticSortedLayer.append`` + ``StaticSortedLayer.attend``, i.e.
:func:`~hf_rbf.cache_sorted_static.blocked_window_candidates` then
:func:`~hf_rbf.sorted_decode.sorted_window_attention`), which stays beside it; tests compare the two (and a float64
brute force) under ``TRITON_INTERPRET=1``.

The state (all buffers of the layer, contiguous; ``T`` = block size, ``NB = C / T`` blocks, ``O`` orders)
----------------------------------------------------------------------------------------------------------
* by slot: scalar keys ``[B, H, C]``, values ``[B, G, C, Dv]``, vector keys ``[B, H, C, D]`` (hybrid), validity
  ``[B, C]``, token index ``[C]``, the length ``n`` (tokens written so far, a device scalar);
* sorted blocks ``sorted_keys / sorted_slots [B, O, NB, T]`` (order keys ascending, ``+inf`` = empty; int32 slots);
* two *fill copies* ``fill_keys / fill_slots [B, O, 2, T]``: copy ``n % 2`` holds the sorted run of the block being
  filled (block ``n // T``, when ``n % T != 0``).  They exist so that the insert can run in the same launch as the
  search without a race (below).

One launch, two kinds of programs
---------------------------------
*Writers* (``B * O * W_SPLIT`` programs; ``W_SPLIT`` chunks of the block so that the ``O(T)`` shift is spread over
programs and its latency stays that of one load round).  Writer ``(b, o, chunk)`` merges the new token's order key
into the fill copy ``n % 2`` (``new[j] = old[j]`` if ``old[j] <= key``, the key at the first ``j`` past them, else
``old[j - 1]``: the torch path's ``searchsorted(right=True)`` + shift, elementwise, no search needed) and writes the
result into the *other* fill copy, and into the block itself only when the token completes the block (the block
buffer of the block being filled is not current: everything reads that run from fill copy ``n % 2``); chunk 0 also
writes the token's by-slot entries.  The cost is ``O(T)``, whatever ``n``: about 12 bytes of traffic per entry with
bfloat16 keys and int32 slots.

*Readers* (``B * H`` programs, one per (row, head)).  A reader never reads what the writers of the same launch
write: the block being filled is read from fill copy ``n % 2`` (its state *before* this token), the blocks before it
from the block buffer (complete, untouched by this step), and the new token itself from the step's inputs, as one
extra candidate.  Readers read the length; the last program to finish (a counter, atomically) advances it.  Nothing
is synchronised with the host and every shape is fixed, so the launch is captured by CUDA graphs.

Why one program per (row, head) and not per (row, group): under ``sort_scheme="per_head"`` every head has its own
order, so there is nothing to share; under ``"sort_head"`` the heads of a group share the sorted runs but each has its
own scalar query, hence its own insertion points and window.  A per-group program would only save re-reads of runs
that sit in L2 anyway, and would run the dependent chain of loads of its ``H / G`` heads one after the other; at
batch 1 the launch has just ``H`` reader programs, so the latency of one program *is* the step's latency.

What a reader does (the torch path's window, exactly)
-----------------------------------------------------
1. In every block holding tokens (``<= n // T``, so the work follows the tokens present, not the capacity): the
   insertion point ``p`` of the query (number of order keys ``<`` it, compared in the keys' dtype as the torch path
   does) by a ``FANOUT``-ary search: each round probes ``FANOUT`` keys per block in one load, so ``T = 8192`` takes 4
   dependent rounds instead of 13.
2. The candidates: in each block the ``W = min(k, T)`` entries from ``clamp(p - k // 2, 0, len - W)``, plus the new
   token (:func:`candidate_span`; ``CANDIDATE_SPAN = "2k"`` takes the torch path's ``min(2k, T)`` from ``p - k``).
   The window holds at most ``k // 2`` keys below the query and ``k - k // 2`` at or above it, and a block's share of
   it is contiguous in its run (ending at ``p - 1`` below, starting at ``p`` above); where the block's run is
   clamped at one end it holds all of that side and more of the other.  At the ends of the global order, where the
   window shifts (fewer than ``k // 2`` keys below the query, or fewer than ``k - k // 2`` above), every block is
   clamped at that end and its ``k`` entries hold all of that side and what the shifted window takes of the other.
   So the candidates hold the window, the counts ``r`` / ``nv`` below decide the same shift as over every key, and
   the window depends only on the global (key, slot) order: this picks the torch path's window although its
   candidate set is not literally the same.
3. With ``r`` = candidates below the query and ``nv`` = candidates, the window is the candidates of rank
   ``[first, first + min(k, nv))`` in (key, slot) order, ``first = min(max(r - k // 2, 0), max(nv - k, 0))``.  The
   keys of rank ``first`` and ``first + k`` are found by bisection over the keys' bits (a monotone integer image of
   the float: 16 steps for bfloat16, up to 32 for float32), counting the candidate tile held in registers; ties are
   resolved by slot with a prefix sum over the blocks (a block's candidates are contiguous in slot order, the new
   token is the last of its ties).  Because each block's run is sorted, its part of the window is a contiguous range
   of its run, so the window is ``<= NB`` ranges whose lengths add up to ``min(k, nv)``.
4. The window's slots are read from those ranges, then their own scalar keys, value rows (and vector keys): ``k``
   gathers.  Scores ``-(qs - ks)^2 / tau`` (``+ scale * q.k`` for hybrid heads), the prefix (sink, registers) and
   the new token, an online softmax over chunks of ``KC`` window entries, the value sum.

Limits: the candidate tile ``next_pow2(NB) * next_pow2(W)`` must fit ``MAX_CANDIDATES`` (registers); for long
contexts choose ``T`` near ``sqrt(2 k C)`` (e.g. ``T = 4096``-``16384`` at ``C = 1M, k = 64``), which is also what
balances search and insert.  :func:`static_decode_unavailable_reason` says when the kernel cannot serve a layer.
A decode step past the capacity writes nothing (the torch path fails on its out-of-range index; a graph-safe kernel
cannot raise): size the cache with ``max_cache_len``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
from torch import Tensor

from .attention_utils import compute_dtype, per_query_param
from .kernels_common import next_pow2, triton_unavailable_reason

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is missing
    HAS_TRITON = False


_NS = (
    "hf_rbf"
    if __name__ == "hf_rbf.kernels_sorted_static_decode"
    else "hf_rbf_" + hashlib.sha1(__name__.encode()).hexdigest()[:12]
)

# Probes per block and search round: a [next_pow2(NB), FANOUT] gather per round (a power of two, 2 to 256).  The
# search is a chain of dependent loads, ceil(log_{FANOUT + 1} T) rounds long.
FANOUT = 16
FANOUT_CHOICES = (2, 4, 8, 16, 32, 64, 128, 256)
# The candidate tile (next_pow2(blocks) x next_pow2(W) order keys, W = candidate_span(...)[0]) lives in registers;
# beyond this it would spill, so the kernel refuses (see static_decode_unavailable_reason).
MAX_CANDIDATES = 32768
# Which entries of each block's run a reader takes around the query's insertion point p (module docstring, step 2):
# "k", the k entries from p - k // 2 (the fewest that hold the window's share of every block), or "2k", the torch
# path's 2k entries from p - k (kept for A/B runs: benchmarks/bench_sorted_static_decode.py --alternatives).  The
# candidate tile is the length of the chain of reductions each reader runs (bisection, counts), so "k" halves it.
CANDIDATE_SPAN = "k"
CANDIDATE_SPANS = ("k", "2k")
# Block entries per writer program (one load round each).
WRITE_CHUNK = 2048
# Window entries scored per step of the online softmax.
WINDOW_CHUNK = 64
# Largest window / head widths the kernel takes (register tiles [WINDOW_CHUNK, width]).
MAX_WINDOW = 4096
MAX_WIDTH = 512

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


if HAS_TRITON:

    @triton.jit
    def _sortable(x, KEY_INT: tl.constexpr, KEY_BITS: tl.constexpr, KEY_MAX: tl.constexpr, SHIFT: tl.constexpr):
        """A monotone integer image of the floats ``x`` (``a < b`` iff ``f(a) < f(b)``, ``-0.0`` and ``+0.0`` map to
        one value).  ``SHIFT`` drops mantissa bits that are zero for every value of the keys' dtype (16 for bfloat16,
        13 for float16), so the bisection over the image takes fewer steps."""
        x = tl.where(x == 0, 0.0, x)
        bits = x.to(KEY_INT, bitcast=True)
        return (bits ^ ((bits >> (KEY_BITS - 1)) & KEY_MAX)) >> SHIFT

    @triton.jit
    def _and(mask, cond):
        """``mask & cond`` for a tensor mask and a scalar condition, as a tensor of the mask's shape (Triton's
        interpreter mistypes the direct broadcast of a scalar int1 in a load mask)."""
        return mask & ((mask.to(tl.int32) * 0 + cond.to(tl.int32)) != 0)

    @triton.jit
    def _load_run(main_ptr, fill_ptr, row, col, is_fill, mask, other, T: tl.constexpr):
        """Entries ``col`` of block ``row`` of one (row, order): from the block buffer, or for the block being filled
        from its fill copy (two masked loads: a lane reads one of them)."""
        in_main = tl.load(main_ptr + row * T + col, mask=mask & (is_fill == 0), other=other)
        in_fill = tl.load(fill_ptr + col, mask=mask & (is_fill != 0), other=other)
        return tl.where(is_fill != 0, in_fill, in_main)

    @triton.jit
    def _candidates(main_k, fill_k, rows, is_fill, start, length, q_cmp, new_ok, new_key,
                    T: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, CT: tl.constexpr):  # fmt: skip
        """The candidate tile: entries ``[start, start + W)`` of every block's run (``[BLOCK_NB, BLOCK_W]`` order keys;
        ``ok``: in the run and not empty), then ``r`` / ``nv``, the candidates below the query and all of them, the
        new token counted."""
        cols = tl.arange(0, BLOCK_W)
        idx = start[:, None] + cols[None, :]
        in_run = (cols[None, :] < W) & (idx < length[:, None])
        key = _load_run(main_k, fill_k, rows[:, None], idx, is_fill[:, None], in_run, float("inf"), T).to(CT)
        ok = in_run & (key < float("inf"))
        below = tl.sum(tl.sum((ok & (key < q_cmp)).to(tl.int32), axis=1), axis=0)
        r = below + (new_ok & (new_key < q_cmp)).to(tl.int32)
        nv = tl.sum(tl.sum(ok.to(tl.int32), axis=1), axis=0) + new_ok.to(tl.int32)
        return key, ok, r, nv

    @triton.jit
    def _static_sorted_decode_kernel(
        # the new token: scalar keys [B, H], values [B, G, Dv], vector keys [B, H, D], validity [B] (uint8)
        nks_ptr, nval_ptr, nvk_ptr, nok_ptr,
        # the query: scalar [B, H], temperature [B|1, H|1], vector [B, H, D], dot scale [H]
        qs_ptr, tau_ptr, q_ptr, scale_ptr,
        # the prefix (sink, registers): scalar keys [Bp, H, P], values [Bp, G, P, Dv], vector keys [Bp, H, P, D]
        pks_ptr, pv_ptr, pk_ptr,
        # the layer (contiguous; written by the writer programs): by slot, sorted blocks, fill copies, order heads
        keys_ptr, val_ptr, vk_ptr, valid_ptr, tok_ptr,
        sk_ptr, ss_ptr, fk_ptr, fs_ptr, ohead_ptr,
        len_ptr, cnt_ptr,
        out_ptr,
        # sizes
        B, H, G, O, NB, C, DV, D, P, W_SPLIT,
        # strides of the inputs
        s_nks_b, s_nks_h, s_nval_b, s_nval_g, s_nvk_b, s_nvk_h,
        s_qs_b, s_qs_h, s_tau_b, s_tau_h, s_q_b, s_q_h,
        s_pks_b, s_pks_h, s_pks_p, s_pv_b, s_pv_g, s_pv_p, s_pk_b, s_pk_h, s_pk_p,
        T: tl.constexpr,
        K: tl.constexpr,
        W: tl.constexpr,
        LEAD: tl.constexpr,
        N_ROUNDS: tl.constexpr,
        FAN: tl.constexpr,
        BLOCK_NB: tl.constexpr,
        BLOCK_W: tl.constexpr,
        KC: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_HPO: tl.constexpr,
        WCHUNK: tl.constexpr,
        HAS_VEC: tl.constexpr,
        HAS_PREFIX_K: tl.constexpr,
        HAS_VK_BUF: tl.constexpr,
        CT: tl.constexpr,
        KEY_INT: tl.constexpr,
        KEY_BITS: tl.constexpr,
        KEY_MAX: tl.constexpr,
        SHIFT: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        inf = float("inf")
        pos = tl.load(len_ptr)  # the new token's slot (int64): tokens written before this step
        in_cap = pos < C
        fb = (pos // T).to(tl.int32)  # the block being filled
        rem = (pos % T).to(tl.int32)  # entries already in it
        par = (pos % 2).to(tl.int32)  # the fill copy holding its run before this token

        if pid < B * H:
            # ---------------------------------------------------------------------------------------- reader (b, h)
            b = pid // H
            h = pid % H
            o = h // (H // O)
            g = h // (H // G)
            oh = tl.load(ohead_ptr + o)
            bo = b * O + o
            main_k = sk_ptr + bo.to(tl.int64) * NB * T  # int64 offsets: B * O * C may pass 2^31
            main_s = ss_ptr + bo.to(tl.int64) * NB * T
            fill_k = fk_ptr + (bo * 2 + par) * T
            fill_s = fs_ptr + (bo * 2 + par) * T

            qs_raw = tl.load(qs_ptr + b * s_qs_b + h * s_qs_h)
            q_cmp = qs_raw.to(sk_ptr.dtype.element_ty).to(CT)  # order comparisons in the keys' dtype
            q_val = qs_raw.to(CT)
            inv_tau = 1.0 / tl.load(tau_ptr + b * s_tau_b + h * s_tau_h).to(CT)
            new_ok = (tl.load(nok_ptr + b) != 0) & in_cap
            new_key = tl.load(nks_ptr + b * s_nks_b + oh * s_nks_h).to(CT)  # its order key

            # 1. insertion point of the query in every block holding tokens (FAN-ary search)
            rows = tl.arange(0, BLOCK_NB)
            is_fill = (rows == fb).to(tl.int32)
            length = tl.where(rows < fb, T, tl.where(is_fill != 0, rem, 0))
            lo = tl.zeros([BLOCK_NB], dtype=tl.int32)
            hi = length
            fan = tl.arange(0, FAN)
            for _ in tl.static_range(N_ROUNDS):
                n = hi - lo
                probe = lo[:, None] + ((fan[None, :] + 1) * n[:, None]) // (FAN + 1)
                live = (n[:, None] > 0) & (fan[None, :] < FAN)
                key = _load_run(main_k, fill_k, rows[:, None], probe, is_fill[:, None], live, inf, T).to(CT)
                c = tl.sum((live & (key < q_cmp)).to(tl.int32), axis=1)
                new_lo = tl.where(c > 0, lo + (c * n) // (FAN + 1) + 1, lo)
                hi = tl.where(c < FAN, lo + ((c + 1) * n) // (FAN + 1), hi)
                lo = new_lo
            p = lo

            # 2. the candidates: W entries around p in each block (valid: finite), and the new token
            start = tl.maximum(tl.minimum(p - LEAD, length - W), 0)
            key, ok, r, nv = _candidates(main_k, fill_k, rows, is_fill, start, length, q_cmp, new_ok, new_key,
                                         T, W, BLOCK_W, CT)  # fmt: skip
            if LEAD < K:
                # Fewer than k - k // 2 candidates at or above the query: the window shifts down and may take up to k
                # keys below it from one block.  A block whose run ends in empty (+inf) entries (padding) is clamped
                # at its length, not at its last key, so its row may hold only LEAD keys below the query: such rows
                # (their last key inside the row) are loaded again, ending at their last key.  A branch on data: the
                # usual step does not pay the second load round.
                if nv - r < K - K // 2:
                    fin = tl.sum(ok.to(tl.int32), axis=1)
                    start = tl.maximum(tl.minimum(start, start + fin - W), 0)
                    key, ok, r, nv = _candidates(main_k, fill_k, rows, is_fill, start, length, q_cmp, new_ok, new_key,
                                                 T, W, BLOCK_W, CT)  # fmt: skip

            # 3. the window: ranks [r0, r1) of the candidates in (key, slot) order
            r0 = tl.minimum(tl.maximum(r - K // 2, 0), tl.maximum(nv - K, 0))
            r1 = r0 + tl.minimum(nv, K)
            s = _sortable(key, KEY_INT, KEY_BITS, KEY_MAX, SHIFT)
            s_new = _sortable(new_key, KEY_INT, KEY_BITS, KEY_MAX, SHIFT)
            vmin = tl.min(tl.min(tl.where(ok, s, KEY_MAX), axis=1), axis=0)
            vmax = tl.max(tl.max(tl.where(ok, s, -KEY_MAX), axis=1), axis=0)
            vmin = tl.where(new_ok, tl.minimum(vmin, s_new), vmin)
            vmax = tl.where(new_ok, tl.maximum(vmax, s_new), vmax)
            vmin = tl.where(nv > 0, vmin, 0)
            vmax = tl.where(nv > 0, vmax, 0)
            # bisection for x_R = the key of rank R (the largest x with count(key < x) <= R), R = r0 and r1, at once;
            # invariant count(< lo) <= R < count(< hi)
            lo0 = vmin
            hi0 = vmax + 1
            lo1 = vmin
            hi1 = vmax + 1
            while (lo0 + 1 < hi0) | (lo1 + 1 < hi1):
                m0 = (lo0 >> 1) + (hi0 >> 1) + (lo0 & hi0 & 1)  # floor((lo + hi) / 2) without overflow
                m1 = (lo1 >> 1) + (hi1 >> 1) + (lo1 & hi1 & 1)
                # both counts in one reduction: c0 in the low 16 bits, c1 above (counts <= MAX_CANDIDATES < 2^16)
                packed = (ok & (s < m0)).to(tl.int32) + ((ok & (s < m1)).to(tl.int32) << 16)
                packed = tl.sum(tl.sum(packed, axis=1), axis=0)
                c0 = (packed & 0xFFFF) + (new_ok & (s_new < m0)).to(tl.int32)
                c1 = ((packed >> 16) & 0xFFFF) + (new_ok & (s_new < m1)).to(tl.int32)
                lo0 = tl.where(c0 <= r0, m0, lo0)
                hi0 = tl.where(c0 <= r0, hi0, m0)
                lo1 = tl.where(c1 <= r1, m1, lo1)
                hi1 = tl.where(c1 <= r1, hi1, m1)
            # per block: how many of its candidates rank below r0 / r1 (ties at x_R in slot order: blocks in order,
            # inside a block in run order, the new token after all of them)
            lt0 = tl.sum((ok & (s < lo0)).to(tl.int32), axis=1)
            eq0 = tl.sum((ok & (s == lo0)).to(tl.int32), axis=1)
            all_lt0 = tl.sum(lt0, axis=0) + (new_ok & (s_new < lo0)).to(tl.int32)
            from0 = lt0 + tl.minimum(tl.maximum(r0 - all_lt0 - (tl.cumsum(eq0, axis=0) - eq0), 0), eq0)
            lt1 = tl.sum((ok & (s < lo1)).to(tl.int32), axis=1)
            eq1 = tl.sum((ok & (s == lo1)).to(tl.int32), axis=1)
            all_lt1 = tl.sum(lt1, axis=0) + (new_ok & (s_new < lo1)).to(tl.int32)
            to1 = lt1 + tl.minimum(tl.maximum(r1 - all_lt1 - (tl.cumsum(eq1, axis=0) - eq1), 0), eq1)
            rank_new = tl.sum(tl.sum((ok & (s <= s_new)).to(tl.int32), axis=1), axis=0)
            new_in = new_ok & (rank_new >= r0) & (rank_new < r1)
            # block i's part of the window: run entries start_i + [from0_i, to1_i), laid out one after the other
            span = to1 - from0
            span_end = tl.cumsum(span, axis=0)
            n_tile = tl.sum(span, axis=0)
            delta = start + from0 - (span_end - span)  # run index = delta[block] + window lane

            # 4. scores: the prefix and the new token first, then the window in chunks (online softmax)
            dvl = tl.arange(0, BLOCK_DV)
            dv_ok = dvl < DV
            pl = tl.arange(0, BLOCK_P)
            p_ok = pl < P
            pks = tl.load(pks_ptr + b * s_pks_b + h * s_pks_h + pl * s_pks_p, mask=p_ok, other=0.0).to(CT)
            s_pre = -(q_val - pks) * (q_val - pks) * inv_tau
            own_new = tl.load(nks_ptr + b * s_nks_b + h * s_nks_h).to(CT)
            s_tok = -(q_val - own_new) * (q_val - own_new) * inv_tau
            if HAS_VEC:
                dl = tl.arange(0, BLOCK_D)
                d_ok = dl < D
                scale_h = tl.load(scale_ptr + h).to(CT)
                qv = tl.load(q_ptr + b * s_q_b + h * s_q_h + dl, mask=d_ok, other=0.0).to(CT)
                if HAS_PREFIX_K:
                    pk = tl.load(pk_ptr + b * s_pk_b + h * s_pk_h + pl[:, None] * s_pk_p + dl[None, :],
                                 mask=p_ok[:, None] & d_ok[None, :], other=0.0).to(CT)  # fmt: skip
                    s_pre += scale_h * tl.sum(pk * qv[None, :], axis=1)
                vk_new = tl.load(nvk_ptr + b * s_nvk_b + h * s_nvk_h + dl, mask=d_ok, other=0.0).to(CT)
                s_tok += scale_h * tl.sum(vk_new * qv, axis=0)
            s_pre = tl.where(p_ok, s_pre, -inf)
            s_tok = tl.where(new_in, s_tok, -inf)
            m = tl.maximum(tl.max(s_pre, axis=0), s_tok)
            m_safe = tl.where(m == -inf, 0.0, m)
            e_pre = tl.where(p_ok, tl.exp(s_pre - m_safe), 0.0)
            e_tok = tl.where(new_in, tl.exp(s_tok - m_safe), 0.0)
            v_pre = tl.load(pv_ptr + b * s_pv_b + g * s_pv_g + pl[:, None] * s_pv_p + dvl[None, :],
                            mask=p_ok[:, None] & dv_ok[None, :], other=0.0).to(CT)  # fmt: skip
            v_tok = tl.load(nval_ptr + b * s_nval_b + g * s_nval_g + dvl, mask=dv_ok, other=0.0).to(CT)
            denom = tl.sum(e_pre, axis=0) + e_tok
            acc = tl.sum(e_pre[:, None] * v_pre, axis=0) + e_tok * v_tok

            lane = tl.arange(0, KC)
            key_row = (b * H + h).to(tl.int64) * C
            val_row = (b * G + g).to(tl.int64) * C
            for k0 in range(0, n_tile, KC):
                lanes = k0 + lane
                l_ok = lanes < n_tile
                blk = tl.sum((span_end[None, :] <= lanes[:, None]).to(tl.int32), axis=1)  # the block of each lane
                run_idx = tl.sum(tl.where(blk[:, None] == rows[None, :], delta[None, :], 0), axis=1) + lanes
                slot = _load_run(main_s, fill_s, blk, run_idx, (blk == fb).to(tl.int32), l_ok, 0, T)
                own = tl.load(keys_ptr + key_row + slot, mask=l_ok, other=0.0).to(CT)
                sc = -(q_val - own) * (q_val - own) * inv_tau
                if HAS_VEC:
                    kv = tl.load(vk_ptr + (key_row + slot)[:, None] * D + dl[None, :],
                                 mask=l_ok[:, None] & d_ok[None, :], other=0.0).to(CT)  # fmt: skip
                    sc += scale_h * tl.sum(kv * qv[None, :], axis=1)
                sc = tl.where(l_ok, sc, -inf)
                m_new = tl.maximum(m, tl.max(sc, axis=0))
                m_new_safe = tl.where(m_new == -inf, 0.0, m_new)
                alpha = tl.exp(m - m_new_safe)
                e = tl.where(l_ok, tl.exp(sc - m_new_safe), 0.0)
                v = tl.load(val_ptr + (val_row + slot)[:, None] * DV + dvl[None, :],
                            mask=l_ok[:, None] & dv_ok[None, :], other=0.0).to(CT)  # fmt: skip
                denom = denom * alpha + tl.sum(e, axis=0)
                acc = acc * alpha + tl.sum(e[:, None] * v, axis=0)
                m = m_new
            out = acc / tl.where(denom > 0, denom, 1.0)
            tl.store(out_ptr + (b * H + h) * DV + dvl, out.to(out_ptr.dtype.element_ty), mask=dv_ok)
        else:
            # ------------------------------------------------------------------------------- writer (b, o, chunk)
            w = pid - B * H
            chunk = w % W_SPLIT
            bo = w // W_SPLIT
            b = bo // O
            o = bo % O
            oh = tl.load(ohead_ptr + o)
            tok_ok = tl.load(nok_ptr + b) != 0
            new_key = tl.load(nks_ptr + b * s_nks_b + oh * s_nks_h).to(CT)
            new_key = tl.where(tok_ok, new_key, inf)  # an invalid token is +inf: the run stays as it is
            j = chunk * WCHUNK + tl.arange(0, WCHUNK)
            j_ok = _and(j < T, in_cap)
            has_run = rem > 0  # a fresh block starts empty (+inf, slot 0), as the block buffer holds it
            src_k = fk_ptr + (bo * 2 + par) * T
            src_s = fs_ptr + (bo * 2 + par) * T
            old = tl.load(src_k + j, mask=_and(j_ok, has_run), other=inf).to(CT)
            old_s = tl.load(src_s + j, mask=_and(j_ok, has_run), other=0)
            prev = tl.load(src_k + j - 1, mask=_and(j_ok & (j > 0), has_run), other=inf).to(CT)
            prev_s = tl.load(src_s + j - 1, mask=_and(j_ok & (j > 0), has_run), other=0)
            keep = old <= new_key  # before the insertion point (right=True: after equal keys)
            here = (j == 0) | (prev <= new_key)
            run_k = tl.where(keep, old, tl.where(here, new_key, prev)).to(sk_ptr.dtype.element_ty)
            run_s = tl.where(keep, old_s, tl.where(here, pos.to(old_s.dtype), prev_s))
            # The run goes to the other fill copy, where the next step's readers and writers take it; into the block
            # buffer only when this token completes the block (nothing reads the block being filled from there: the
            # torch path takes its run from the fill copy too), which keeps the insert's traffic at one copy.
            block_at = (bo.to(tl.int64) * NB + fb) * T
            completes = rem + 1 == T
            tl.store(sk_ptr + block_at + j, run_k, mask=_and(j_ok, completes))
            tl.store(ss_ptr + block_at + j, run_s, mask=_and(j_ok, completes))
            tl.store(fk_ptr + (bo * 2 + 1 - par) * T + j, run_k, mask=j_ok)
            tl.store(fs_ptr + (bo * 2 + 1 - par) * T + j, run_s, mask=j_ok)
            if chunk == 0:
                # the token's by-slot entries: the heads of order o, the value group whose first order is o
                hpo = H // O
                hl = tl.arange(0, BLOCK_HPO)
                hh = o * hpo + hl
                h_ok = _and(hl < hpo, in_cap)
                ks_new = tl.load(nks_ptr + b * s_nks_b + hh * s_nks_h, mask=h_ok, other=0.0)
                tl.store(keys_ptr + (b * H + hh).to(tl.int64) * C + pos, ks_new, mask=h_ok)
                if HAS_VK_BUF:
                    dl_w = tl.arange(0, BLOCK_D)
                    m_vk = h_ok[:, None] & (dl_w[None, :] < D)
                    vk_in = tl.load(nvk_ptr + b * s_nvk_b + hh[:, None] * s_nvk_h + dl_w[None, :], mask=m_vk, other=0.0)
                    tl.store(
                        vk_ptr + ((b * H + hh).to(tl.int64) * C + pos)[:, None] * D + dl_w[None, :], vk_in, mask=m_vk
                    )
                opg = O // G
                gw = o // opg
                dvl_w = tl.arange(0, BLOCK_DV)
                m_v = _and(_and(dvl_w < DV, in_cap), o % opg == 0)
                v_in = tl.load(nval_ptr + b * s_nval_b + gw * s_nval_g + dvl_w, mask=m_v, other=0.0)
                tl.store(val_ptr + ((b * G + gw).to(tl.int64) * C + pos) * DV + dvl_w, v_in, mask=m_v)
                if (o == 0) & in_cap:
                    tl.store(valid_ptr + b.to(tl.int64) * C + pos, tok_ok.to(tl.uint8))
                    if b == 0:
                        tl.store(tok_ptr + pos, pos)

        # The last program to finish advances the length.  The barrier makes every warp of this program pass its read
        # of the length before the program counts itself done (the writer has no cross-warp reduction that would
        # order them otherwise); the atomic (acq_rel) then orders those reads before the last program's store.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr, 1)
        if done == B * H + B * O * W_SPLIT - 1:
            tl.store(len_ptr, pos + 1)
            tl.store(cnt_ptr, 0)


def _search_rounds(block_size: int, fanout: int) -> int:
    """Rounds of the FANOUT-ary search: each leaves at most ``floor(n / (fanout + 1))`` of ``n`` candidates."""
    rounds, n = 0, block_size
    while n > 0:
        n //= fanout + 1
        rounds += 1
    return rounds


def candidate_span(window: int, block_size: int) -> tuple[int, int]:
    """``(W, lead)``: a reader takes the ``W`` entries of each block's run from ``clamp(p - lead, 0, len - W)``
    (``CANDIDATE_SPAN``)."""
    if CANDIDATE_SPAN == "k":
        return min(window, block_size), window // 2
    if CANDIDATE_SPAN == "2k":
        return min(2 * window, block_size), window
    raise ValueError(f'hf_rbf.kernels_sorted_static_decode.CANDIDATE_SPAN must be "k" or "2k"; got {CANDIDATE_SPAN!r}')


def _key_bits(dtype: torch.dtype) -> tuple[object, int, int]:
    """(integer type, its bits, mantissa bits that are zero in the float32 image of every value of ``dtype``)."""
    if dtype == torch.float64:
        return tl.int64, 64, 0
    shift = {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)
    return tl.int32, 32, shift


def static_decode_unavailable_reason(
    device: torch.device,
    dtype: torch.dtype,
    *,
    num_blocks: int,
    block_size: int,
    window: int,
    value_dim: int,
    head_dim: int = 0,
) -> str | None:
    """None when the fused static decode kernel can serve a layer of this shape on ``device``; otherwise why not."""
    reason = triton_unavailable_reason(device, torch.float32)
    if reason is not None:
        return reason
    if dtype not in _SUPPORTED_DTYPES:
        return f"the cache dtype {dtype} is not supported (float16, bfloat16, float32 or float64)"
    span = candidate_span(window, block_size)[0]
    tile = next_pow2(num_blocks) * next_pow2(span)
    if tile > MAX_CANDIDATES:
        suggestion = next_pow2(math.isqrt(window * num_blocks * block_size))
        return (
            f"{num_blocks} blocks x {span} candidates per block = a {tile}-entry candidate "
            f"tile, more than the kernel holds ({MAX_CANDIDATES}); use a larger `block_size` (about sqrt(window * "
            f"capacity), here {suggestion})"
        )
    if window > MAX_WINDOW:
        return f"`decode_window` = {window} is larger than the kernel's {MAX_WINDOW}"
    if max(value_dim, head_dim) > MAX_WIDTH:
        return f"value / head widths {value_dim} / {head_dim} exceed the kernel's {MAX_WIDTH}"
    return None


# Warps per program, by candidate-tile size (None: the heuristic of decode_num_warps).  The step is a chain of
# dependent rounds (search, bisection, gathers), each a reduction over the tile: more warps hold the tile in fewer
# registers but synchronise through shared memory at every round (76 barriers in an offline sm_90 compile with 4 warps
# at 8K tokens, 15 with one warp, which then holds 254 registers).  benchmarks/bench_sorted_static_decode.py
# --num-warps times the alternatives.
NUM_WARPS: int | None = None
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16, 32)


def decode_num_warps(tile: int) -> int:
    """Warps per program of the fused step for a candidate tile of ``tile`` order keys (``NUM_WARPS`` overrides)."""
    if NUM_WARPS is not None:
        if NUM_WARPS not in NUM_WARPS_CHOICES:
            raise ValueError(f"kernels_sorted_static_decode.NUM_WARPS must be 1, 2, 4, 8, 16 or 32; got {NUM_WARPS!r}")
        return NUM_WARPS
    return 4 if tile <= 2048 else (8 if tile <= 8192 else 16)


def _launch(
    new_scalar_keys, new_values, new_vector_keys, new_valid, qs, tau, q, scale, prefix_ks, prefix_v, prefix_k,
    keys, values, vector_keys, valid, token_index, sorted_keys, sorted_slots, fill_keys, fill_slots, order_head,
    length, counter, window,
):  # fmt: skip
    b, h, c = keys.shape
    g, dv = values.shape[1], values.shape[3]
    o, nb, t = sorted_keys.shape[1], sorted_keys.shape[2], sorted_keys.shape[3]
    out = torch.empty(b, h, 1, dv, device=keys.device, dtype=values.dtype)
    has_vk_buf = vector_keys is not None
    has_vec = q is not None and scale is not None
    d = vector_keys.shape[-1] if has_vk_buf else (q.shape[-1] if q is not None else 1)
    # unused pointer arguments get a buffer of the layer (never dereferenced: their constexpr switch is off)
    dummy = keys
    p = 0 if prefix_ks is None else prefix_ks.shape[-1]
    if p == 0:
        prefix_ks = prefix_v = prefix_k = None
    has_prefix_k = has_vec and prefix_k is not None

    def bstride(x, dim=0):
        return 0 if x is None or x.shape[dim] == 1 else x.stride(dim)

    def stride(x, dim):
        return 0 if x is None else x.stride(dim)

    w_span, lead = candidate_span(window, t)
    if FANOUT not in FANOUT_CHOICES:
        raise ValueError(
            f"hf_rbf.kernels_sorted_static_decode.FANOUT must be a power of two from 2 to 256; got {FANOUT!r}"
        )
    w_split = -(-t // min(WRITE_CHUNK, next_pow2(t)))
    num_warps = decode_num_warps(next_pow2(nb) * next_pow2(w_span))
    key_int, key_bits, shift = _key_bits(sorted_keys.dtype)
    grid = (b * h + b * o * w_split,)
    _static_sorted_decode_kernel[grid](
        new_scalar_keys, new_values, new_vector_keys if new_vector_keys is not None else dummy, new_valid,
        qs, tau, q if q is not None else dummy, scale if scale is not None else dummy,
        prefix_ks if prefix_ks is not None else dummy, prefix_v if prefix_v is not None else dummy,
        prefix_k if has_prefix_k else dummy,
        keys, values, vector_keys if has_vk_buf else dummy, valid.view(torch.uint8), token_index,
        sorted_keys, sorted_slots, fill_keys, fill_slots, order_head,
        length, counter,
        out,
        b, h, g, o, nb, c, dv, d, p, w_split,
        new_scalar_keys.stride(0), new_scalar_keys.stride(1), new_values.stride(0), new_values.stride(1),
        stride(new_vector_keys, 0), stride(new_vector_keys, 1),
        qs.stride(0), qs.stride(1), bstride(tau, 0), bstride(tau, 1),
        stride(q, 0), stride(q, 1),
        bstride(prefix_ks), stride(prefix_ks, 1), stride(prefix_ks, 2),
        bstride(prefix_v), stride(prefix_v, 1), stride(prefix_v, 2),
        bstride(prefix_k) if has_prefix_k else 0, stride(prefix_k, 1) if has_prefix_k else 0,
        stride(prefix_k, 2) if has_prefix_k else 0,
        T=t,
        K=window,
        W=w_span,
        LEAD=lead,
        N_ROUNDS=_search_rounds(t, FANOUT),
        FAN=FANOUT,
        BLOCK_NB=next_pow2(nb),
        BLOCK_W=next_pow2(w_span),
        KC=min(WINDOW_CHUNK, next_pow2(window)),
        BLOCK_DV=next_pow2(dv),
        BLOCK_D=next_pow2(d),
        BLOCK_P=next_pow2(max(p, 1)),
        BLOCK_HPO=next_pow2(h // o),
        WCHUNK=min(WRITE_CHUNK, next_pow2(t)),
        HAS_VEC=has_vec,
        HAS_PREFIX_K=has_prefix_k,
        HAS_VK_BUF=has_vk_buf,
        CT=tl.float64 if compute_dtype(values.dtype) == torch.float64 else tl.float32,
        KEY_INT=key_int,
        KEY_BITS=key_bits,
        KEY_MAX=(1 << (key_bits - 1)) - 1,
        SHIFT=shift,
        num_warps=num_warps,
    )  # fmt: skip
    return out


# the layer's stacked buffers the op takes, in its argument order (StaticSortedLayer's StackedBuffers kinds)
_STACKED = (
    "keys", "values", "vector_keys", "valid", "token_index", "sorted_keys", "sorted_slots", "fill_keys", "fill_slots",
    "order_head", "cumulative_length", "decode_counter",
)  # fmt: skip
_MUTATED = (
    "keys", "values", "vector_keys", "valid", "token_index", "sorted_keys", "sorted_slots", "fill_keys", "fill_slots",
    "length", "counter",
)  # fmt: skip


@torch.library.custom_op(f"{_NS}::static_sorted_decode_step", mutates_args=_MUTATED)
def static_sorted_decode_op(
    new_scalar_keys: Tensor,
    new_values: Tensor,
    new_vector_keys: Optional[Tensor],
    new_valid: Tensor,
    qs: Tensor,
    tau: Tensor,
    q: Optional[Tensor],
    scale: Optional[Tensor],
    prefix_ks: Optional[Tensor],
    prefix_v: Optional[Tensor],
    prefix_k: Optional[Tensor],
    keys: Tensor,
    values: Tensor,
    vector_keys: Optional[Tensor],
    valid: Tensor,
    token_index: Tensor,
    sorted_keys: Tensor,
    sorted_slots: Tensor,
    fill_keys: Tensor,
    fill_slots: Tensor,
    order_head: Tensor,
    length: Tensor,
    counter: Tensor,
    window: int,
    layer: int,
) -> Tensor:
    """The fused step as an opaque op (``torch.compile`` traces through its fake; the launch is graph-capturable).

    The layer's buffers (``keys`` ... ``counter``) come stacked over the layers of its cache (``[L, ...]``,
    :class:`~hf_rbf.cache_static.StackedBuffers`) and ``layer`` picks its slice, which the launch receives (a
    contiguous slice): the op mutates the stacked tensors themselves, graph inputs that inductor writes in place,
    where a mutated slice of one would be rebuilt whole at every step."""
    sliced = [
        None if x is None else x[layer]
        for x in (keys, values, vector_keys, valid, token_index, sorted_keys, sorted_slots, fill_keys, fill_slots,
                  order_head, length, counter)
    ]  # fmt: skip
    return _launch(
        new_scalar_keys, new_values, new_vector_keys, new_valid, qs, tau, q, scale, prefix_ks, prefix_v, prefix_k,
        *sliced, window,
    )  # fmt: skip


@static_sorted_decode_op.register_fake
def _(
    new_scalar_keys, new_values, new_vector_keys, new_valid, qs, tau, q, scale, prefix_ks, prefix_v, prefix_k,
    keys, values, vector_keys, valid, token_index, sorted_keys, sorted_slots, fill_keys, fill_slots, order_head,
    length, counter, window, layer,
):  # fmt: skip
    return values.new_empty(keys.shape[1], keys.shape[2], 1, values.shape[4])


def _last_contiguous(x: Tensor | None) -> Tensor | None:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def static_sorted_decode_step(
    layer,
    new_scalar_keys: Tensor,
    new_values: Tensor,
    new_vector_keys: Tensor | None,
    new_valid: Tensor | None,
    qs: Tensor,
    tau,
    *,
    q: Tensor | None = None,
    scale=None,
    prefix_ks: Tensor | None = None,
    prefix_v: Tensor | None = None,
    prefix_k: Tensor | None = None,
) -> Tensor:
    """Insert one token into ``layer`` (an initialised :class:`~hf_rbf.cache_sorted_static.StaticSortedLayer`) and
    return its windowed attention output ``[B, H, 1, Dv]``, in one launch.

    Args:
        layer: the layer; its buffers hold the tokens *before* this one.
        new_scalar_keys: ``[B, H, 1]``; new_values ``[B, G, 1, Dv]``; new_vector_keys ``[B, H, 1, D]`` (hybrid) or
            None; new_valid ``[B, 1]`` bool (False: padding) or None (all valid).
        qs, tau, q, scale, prefix_ks, prefix_v, prefix_k: as :func:`hf_rbf.sorted_decode.sorted_window_attention`
            (one query per row and head).

    Returns the output of ``layer.append(...)`` followed by ``layer.attend(...)`` (the torch static path); the layer
    ends in the same state (same by-slot buffers, sorted runs and length).
    """
    name = "static_sorted_decode_step"
    b, h, nq = qs.shape
    if nq != 1 or new_scalar_keys.shape[-1] != 1:
        raise ValueError(f"{name}: one query and one new token per row (`qs` [B, H, 1]); got {tuple(qs.shape)}")
    window = layer.decode_window
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{name}: the layer's `decode_window` must be an int >= 1; got {window!r}")
    keys, values = layer.keys, layer.values  # this layer's slices (the op receives the stacked buffers)
    device, dtype = keys.device, keys.dtype
    ct = compute_dtype(values.dtype)
    tau = per_query_param(name, "tau", tau, b, h, 1, device)
    if isinstance(tau, float):
        tau = torch.full((1, 1, 1), tau, device=device, dtype=ct)
    has_vec = q is not None and scale is not None and not (isinstance(scale, (int, float)) and float(scale) == 0.0)
    if has_vec:
        if layer.vector_keys is None:
            raise ValueError(f"{name}: `q` and `scale` need a layer with vector keys (a hybrid layer)")
        if isinstance(scale, (int, float)):
            scale = torch.full((h,), float(scale), device=device, dtype=ct)
        else:
            scale = scale.to(device=device, dtype=ct).reshape(h).contiguous()
        q = _last_contiguous(q)
    else:
        q, scale = None, None
    if new_valid is None:
        new_valid = torch.ones(b, device=device, dtype=torch.uint8)
    else:
        new_valid = new_valid.to(torch.bool).expand(b, 1).reshape(b).to(torch.uint8)
    vk = None if new_vector_keys is None else _last_contiguous(new_vector_keys.to(dtype))
    if (vk is None) != (layer.vector_keys is None):
        raise ValueError(f"{name}: `new_vector_keys` must be given exactly when the layer holds vector keys")
    step_inputs = (
        new_scalar_keys.to(dtype),
        _last_contiguous(new_values.to(values.dtype)),
        vk,
        new_valid,
        qs,
        tau,
        q,
        scale,
        prefix_ks,
        _last_contiguous(prefix_v),
        _last_contiguous(prefix_k),
    )
    if not torch.compiler.is_compiling():
        # eager: the launch on the layer's slices, taken once by the layer (the op would slice the stacks per call)
        return _launch(*step_inputs, *(layer._views.get(name) for name in _STACKED), window)
    # compiled: the op on the stacked buffers (graph inputs, one per kind, written in place) and the layer's slot
    return static_sorted_decode_op(*step_inputs, *(layer._stack.get(name) for name in _STACKED), window, layer._slot)


__all__ = [
    "HAS_TRITON",
    "MAX_CANDIDATES",
    "static_decode_unavailable_reason",
    "static_sorted_decode_op",
    "static_sorted_decode_step",
]
