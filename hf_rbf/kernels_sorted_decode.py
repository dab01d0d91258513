"""One fused Triton kernel for the sorted cache's decode step: binary search, window selection, gather, softmax and
value sum for every (row, head, query) in one launch per layer step.

It computes exactly :func:`hf_rbf.sorted_decode.sorted_window_attention` (same window, same tie-breaking), which is
its reference; tests compare the two under ``TRITON_INTERPRET=1`` on random inputs.

One program per (row, head, query):

1. binary search of ``qs`` in the order's sorted keys (``ceil(log2(M + 1))`` dependent loads);
2. the ``2k`` sorted entries around the insertion point (``BLOCK_MAIN`` lanes) and every recent-buffer key
   (``BLOCK_BUF`` lanes, masked by validity and causality) are the candidates;
3. the rank of each candidate among them: sorted entries are already in (key, slot) order, so a sorted lane's rank is
   its offset from the first valid lane plus the buffered keys below it (ties: sorted entries first, they are older);
   a buffered lane's rank counts the sorted keys ``<=`` it and the buffered keys below it (ties by slot) -- the
   ``[2k, R]`` and ``[R, R]`` comparison blocks stay in registers, no sort is needed;
4. the window is the candidates of rank ``start .. start + k - 1``; their own scalar keys, value rows (and vector
   keys) are gathered with masked loads (only the ``k`` window rows are read), and an online-free two-pass softmax
   over prefix + window gives the output row.

Block sizes are powers of two chosen by the launcher: ``BLOCK_MAIN = next_pow2(2k)``, ``BLOCK_BUF =
next_pow2(R)`` (the current buffer), ``BLOCK_DV`` / ``BLOCK_D`` the value / key widths, ``BLOCK_P`` the prefix.
"""

from __future__ import annotations

import math

import torch

from .attention_utils import per_query_param, tensors_keepable
from .kernels_launch import launch_jit

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is missing
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _sorted_decode_kernel(
        # sorted arrays [B, O, M], counts [B, O]
        sk_ptr, ss_ptr, sc_ptr,
        # by-slot state: scalar keys [B, H, C], values [B, G, C, Dv], valid [B, C], token index [B, C],
        # log weights [B, H, C], vector keys [B, H, C, D]
        keys_ptr, val_ptr, valid_ptr, tok_ptr, lw_ptr, vk_ptr,
        # queries [B, H, Nq], tau (broadcast strides), query token index [Nq], vector queries [B, H, Nq, D],
        # scale [H], order head [O]
        qs_ptr, tau_ptr, qtok_ptr, q_ptr, scale_ptr, ohead_ptr,
        # prefix: scalar keys [Bp, H, P], values [Bp, G, P, Dv], vector keys [Bp, H, P, D]
        pks_ptr, pv_ptr, pk_ptr,
        out_ptr,
        # sizes
        H, G, NQ, M, S, C, DV, D, P, O, N_ITER,
        # strides
        s_sk_b, s_sk_o, s_sc_b,
        s_k_b, s_k_h, s_v_b, s_v_g, s_v_c, s_valid_b, s_tok_b, s_lw_b, s_lw_h, s_vk_b, s_vk_h, s_vk_c,
        s_qs_b, s_qs_h, s_qs_q, s_tau_b, s_tau_h, s_tau_q, s_q_b, s_q_h, s_q_q,
        s_pks_b, s_pks_h, s_pv_b, s_pv_g, s_pv_p, s_pk_b, s_pk_h, s_pk_p,
        s_o_b, s_o_h, s_o_q,
        K: tl.constexpr,
        BLOCK_MAIN: tl.constexpr,
        BLOCK_BUF: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,
        HAS_LW: tl.constexpr,
        HAS_VEC: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        qi = pid % NQ
        h = (pid // NQ) % H
        b = pid // (NQ * H)
        o = h // (H // O)
        g = h // (H // G)
        oh = tl.load(ohead_ptr + o)

        q = tl.load(qs_ptr + b * s_qs_b + h * s_qs_h + qi * s_qs_q).to(tl.float32)
        tau = tl.load(tau_ptr + b * s_tau_b + h * s_tau_h + qi * s_tau_q).to(tl.float32)
        inv_tau = 1.0 / tau
        t = tl.load(qtok_ptr + qi)
        count = tl.load(sc_ptr + b * s_sc_b + o).to(tl.int32)
        sk_base = sk_ptr + b * s_sk_b + o * s_sk_o
        ss_base = ss_ptr + b * s_sk_b + o * s_sk_o

        # 1. binary search: p = number of sorted keys < q (the +inf padding sits after `count`)
        lo = count * 0
        hi = count
        for _ in range(N_ITER):  # ceil(log2(M + 1)) halvings of [lo, hi)
            active = lo < hi
            mid = (lo + hi) // 2
            key = tl.load(sk_base + mid, mask=active & (mid < M), other=float("inf")).to(tl.float32)
            go_right = key < q
            lo = tl.where(active & go_right, mid + 1, lo)
            hi = tl.where(active & (~go_right), mid, hi)
        p = lo

        # 2. candidates: sorted lanes j = p - K .. p + K - 1, buffered lanes = slots M .. S - 1
        lane = tl.arange(0, BLOCK_MAIN)
        j = p - K + lane
        ok_m = (lane < 2 * K) & (j >= 0) & (j < count)
        km = tl.load(sk_base + j, mask=ok_m, other=float("inf")).to(tl.float32)
        slot_m = tl.load(ss_base + j, mask=ok_m, other=0)
        r_lane = tl.arange(0, BLOCK_BUF)
        slot_b = M + r_lane
        in_buf = slot_b < S
        vb = tl.load(valid_ptr + b * s_valid_b + slot_b, mask=in_buf, other=0) != 0
        tb = tl.load(tok_ptr + b * s_tok_b + slot_b, mask=in_buf, other=0)
        ok_b = in_buf & vb & (tb <= t)
        kb = tl.load(keys_ptr + b * s_k_b + oh * s_k_h + slot_b, mask=ok_b, other=float("inf")).to(tl.float32)

        # 3. ranks among the candidates: (key, sorted-before-buffer, slot) order, as a stable sort would give
        first_valid = tl.maximum(K - p, 0)
        below_b = tl.sum(((kb[None, :] < km[:, None]) & ok_b[None, :]).to(tl.int32), axis=1)
        rank_m = lane - first_valid + below_b
        le_m = tl.sum(((km[:, None] <= kb[None, :]) & ok_m[:, None]).to(tl.int32), axis=0)
        before_b = (kb[:, None] < kb[None, :]) | ((kb[:, None] == kb[None, :]) & (r_lane[:, None] < r_lane[None, :]))
        below_bb = tl.sum((before_b & ok_b[:, None]).to(tl.int32), axis=0)
        rank_b = le_m + below_bb
        n_vis = tl.sum(ok_m.to(tl.int32), axis=0) + tl.sum(ok_b.to(tl.int32), axis=0)
        r = tl.sum(((km < q) & ok_m).to(tl.int32), axis=0) + tl.sum(((kb < q) & ok_b).to(tl.int32), axis=0)
        start = tl.maximum(tl.minimum(r - K // 2, n_vis - K), 0)
        win_m = ok_m & (rank_m >= start) & (rank_m < start + K)
        win_b = ok_b & (rank_b >= start) & (rank_b < start + K)

        # 4. scores of the window and the prefix, softmax, value sum
        own_m = tl.load(keys_ptr + b * s_k_b + h * s_k_h + slot_m, mask=win_m, other=0.0).to(tl.float32)
        own_b = tl.load(keys_ptr + b * s_k_b + h * s_k_h + slot_b, mask=win_b, other=0.0).to(tl.float32)
        s_m = -(q - own_m) * (q - own_m) * inv_tau
        s_b = -(q - own_b) * (q - own_b) * inv_tau
        if HAS_LW:
            s_m += tl.load(lw_ptr + b * s_lw_b + h * s_lw_h + slot_m, mask=win_m, other=0.0).to(tl.float32)
            s_b += tl.load(lw_ptr + b * s_lw_b + h * s_lw_h + slot_b, mask=win_b, other=0.0).to(tl.float32)
        p_lane = tl.arange(0, BLOCK_P)
        ok_p = p_lane < P
        pks = tl.load(pks_ptr + b * s_pks_b + h * s_pks_h + p_lane, mask=ok_p, other=0.0).to(tl.float32)
        s_p = -(q - pks) * (q - pks) * inv_tau
        if HAS_VEC:
            d_lane = tl.arange(0, BLOCK_D)
            ok_d = d_lane < D
            scale = tl.load(scale_ptr + h).to(tl.float32)
            qv = tl.load(q_ptr + b * s_q_b + h * s_q_h + qi * s_q_q + d_lane, mask=ok_d, other=0.0).to(tl.float32)
            vk_base = vk_ptr + b * s_vk_b + h * s_vk_h
            km_vec = tl.load(vk_base + slot_m[:, None] * s_vk_c + d_lane[None, :], mask=win_m[:, None] & ok_d[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
            kb_vec = tl.load(vk_base + slot_b[:, None] * s_vk_c + d_lane[None, :], mask=win_b[:, None] & ok_d[None, :],
                             other=0.0).to(tl.float32)  # fmt: skip
            pk_vec = tl.load(pk_ptr + b * s_pk_b + h * s_pk_h + p_lane[:, None] * s_pk_p + d_lane[None, :],
                             mask=ok_p[:, None] & ok_d[None, :], other=0.0).to(tl.float32)  # fmt: skip
            s_m += scale * tl.sum(km_vec * qv[None, :], axis=1)
            s_b += scale * tl.sum(kb_vec * qv[None, :], axis=1)
            s_p += scale * tl.sum(pk_vec * qv[None, :], axis=1)
        s_m = tl.where(win_m, s_m, float("-inf"))
        s_b = tl.where(win_b, s_b, float("-inf"))
        s_p = tl.where(ok_p, s_p, float("-inf"))
        row_max = tl.maximum(tl.maximum(tl.max(s_m, axis=0), tl.max(s_b, axis=0)), tl.max(s_p, axis=0))
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        e_m = tl.where(win_m, tl.exp(s_m - row_max), 0.0)
        e_b = tl.where(win_b, tl.exp(s_b - row_max), 0.0)
        e_p = tl.where(ok_p, tl.exp(s_p - row_max), 0.0)
        denom = tl.sum(e_m, axis=0) + tl.sum(e_b, axis=0) + tl.sum(e_p, axis=0)
        denom = tl.where(denom > 0, denom, 1.0)

        dv_lane = tl.arange(0, BLOCK_DV)
        ok_dv = dv_lane < DV
        v_base = val_ptr + b * s_v_b + g * s_v_g
        v_m = tl.load(v_base + slot_m[:, None] * s_v_c + dv_lane[None, :], mask=win_m[:, None] & ok_dv[None, :],
                      other=0.0).to(tl.float32)  # fmt: skip
        v_b = tl.load(v_base + slot_b[:, None] * s_v_c + dv_lane[None, :], mask=win_b[:, None] & ok_dv[None, :],
                      other=0.0).to(tl.float32)  # fmt: skip
        v_p = tl.load(pv_ptr + b * s_pv_b + g * s_pv_g + p_lane[:, None] * s_pv_p + dv_lane[None, :],
                      mask=ok_p[:, None] & ok_dv[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc = (
            tl.sum(e_m[:, None] * v_m, axis=0) + tl.sum(e_b[:, None] * v_b, axis=0) + tl.sum(e_p[:, None] * v_p, axis=0)
        )
        out = acc / denom
        tl.store(out_ptr + b * s_o_b + h * s_o_h + qi * s_o_q + dv_lane, out.to(out_ptr.dtype.element_ty), mask=ok_dv)


def kernel_unavailable_reason(device: torch.device) -> str | None:
    """None when the fused kernel can run on tensors of ``device``; otherwise why not.  ``@triton.jit`` decides when
    it decorates whether the kernel is interpreted (``TRITON_INTERPRET=1``: CPU tensors only) or compiled (CUDA)."""
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    interpreted = type(_sorted_decode_kernel).__name__ == "InterpretedFunction"
    if device.type == "cuda" and not interpreted:
        return None
    if device.type == "cpu" and interpreted:
        return None
    if interpreted:
        return "the kernel was defined under TRITON_INTERPRET=1 and runs on CPU tensors only"
    return f"the inputs are on {device.type}; the kernel runs on CUDA (or the CPU under TRITON_INTERPRET=1)"


# Read-only operands the kernel takes where a feature is absent (a dummy pointer, an empty prefix) or a constant
# (a float temperature or scale), kept per shape, value, device and dtype: made per step, each was a fill kernel
# launched on every layer of every decode step.  The kernel never writes them.
_CONSTANTS: dict = {}


def _constant(shape: tuple, value: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if not tensors_keepable(device):  # (a CUDA graph's capture or pool: see attention_utils.tensors_keepable)
        return torch.full(shape, value, device=device, dtype=dtype)
    key = (shape, float(value), str(device), dtype)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 256:  # many distinct temperatures or shapes: start over rather than grow
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.full(shape, value, device=device, dtype=dtype)
    return t


def _pow2(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def sorted_window_attention_triton(
    state,
    qs: torch.Tensor,
    tau,
    *,
    window: int,
    query_token_index: torch.Tensor,
    q: torch.Tensor | None = None,
    scale=None,
    prefix_ks: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    prefix_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused decode step; arguments and result as :func:`hf_rbf.sorted_decode.sorted_window_attention`."""
    reason = kernel_unavailable_reason(qs.device)
    if reason is not None:
        raise RuntimeError(f"sorted_window_attention_triton: {reason}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sorted_window_attention_triton: `window` must be an int >= 1; got {window!r}")
    b, h, nq = qs.shape
    values = state.values
    g, cap, dv = values.shape[1], values.shape[2], values.shape[3]
    o, m = state.sorted_keys.shape[1], state.sorted_keys.shape[2]
    s = state.num_slots
    device = qs.device
    tau = per_query_param("sorted_window_attention_triton", "tau", tau, b, h, nq, device)
    if isinstance(tau, float):
        tau = _constant((1, 1, 1), tau, device, torch.float32)
    tau_strides = [0 if tau.shape[i] == 1 else tau.stride(i) for i in range(3)]
    out = torch.empty(b, h, nq, dv, device=device, dtype=values.dtype)
    dummy = _constant((1,), 0.0, device, values.dtype)
    if prefix_ks is None or prefix_ks.shape[-1] == 0:
        p = 0
        prefix_ks = _constant((1, h, 1), 0.0, device, values.dtype)
        prefix_v = _constant((1, g, 1, dv), 0.0, device, values.dtype)
    else:
        p = prefix_ks.shape[-1]
        prefix_ks, prefix_v = prefix_ks.contiguous(), prefix_v.contiguous()
    has_vec = q is not None and scale is not None and not (isinstance(scale, float) and scale == 0.0)
    if has_vec:
        d = q.shape[-1]
        scale_t = (
            _constant((h,), float(scale), device, torch.float32)
            if isinstance(scale, (int, float))
            else scale.to(device=device, dtype=torch.float32).contiguous()
        )
        vk = state.vector_keys
        q = q.contiguous()
        if prefix_k is None or p == 0:
            prefix_k = _constant((1, h, max(p, 1), d), 0.0, device, values.dtype)
        prefix_k = prefix_k.contiguous()
    else:
        d = 1
        scale_t, vk, prefix_k, q = dummy, dummy.view(1, 1, 1, 1), dummy.view(1, 1, 1, 1), dummy.view(1, 1, 1, 1)
    lw = state.log_weight if state.log_weight is not None else dummy.view(1, 1, 1)
    sorted_keys = state.sorted_keys if m > 0 else torch.full((b, o, 1), float("inf"), device=device,
                                                              dtype=state.sorted_keys.dtype)  # fmt: skip
    sorted_slots = state.sorted_slots if m > 0 else torch.zeros(b, o, 1, device=device, dtype=torch.long)

    def bstride(t, dim=0):
        return 0 if t.shape[dim] == 1 else t.stride(dim)

    grid = (b * h * nq,)
    launch_jit(
        _sorted_decode_kernel,
        grid,
        (
            sorted_keys, sorted_slots, state.sorted_count,
            state.scalar_keys, values, state.valid, state.token_index, lw, vk,
            qs, tau, query_token_index, q, scale_t, state.order_head,
            prefix_ks, prefix_v, prefix_k,
            out,
            h, g, nq, m, s, cap, dv, d, p, o, max(1, math.ceil(math.log2(m + 1))),
            sorted_keys.stride(0), sorted_keys.stride(1), state.sorted_count.stride(0),
            state.scalar_keys.stride(0), state.scalar_keys.stride(1),
            values.stride(0), values.stride(1), values.stride(2),
            state.valid.stride(0), state.token_index.stride(0), lw.stride(0), lw.stride(1),
            vk.stride(0), vk.stride(1), vk.stride(2),
            qs.stride(0), qs.stride(1), qs.stride(2), tau_strides[0], tau_strides[1], tau_strides[2],
            q.stride(0), q.stride(1), q.stride(2),
            bstride(prefix_ks), prefix_ks.stride(1), bstride(prefix_v), prefix_v.stride(1), prefix_v.stride(2),
            bstride(prefix_k), prefix_k.stride(1), prefix_k.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
        ),
        dict(
            K=window,
            BLOCK_MAIN=_pow2(2 * window),
            BLOCK_BUF=_pow2(max(1, s - m)),
            BLOCK_DV=_pow2(dv),
            BLOCK_D=_pow2(d),
            BLOCK_P=_pow2(max(1, p)),
            HAS_LW=state.log_weight is not None,
            HAS_VEC=has_vec,
        ),
    )  # fmt: skip
    return out


__all__ = ["HAS_TRITON", "kernel_unavailable_reason", "sorted_window_attention_triton"]
