"""One decode step's token written into the sorted cache's slot buffers in one launch.

:meth:`hf_rbf.cache_sorted_scalar.SortedScalarCacheLayer.append` stores a new token's scalar keys ``[B, H]``, vector
keys ``[B, H, D]`` (hybrid layers), values ``[B, G, Dv]``, its validity and its token index into slot ``s`` of five
buffers.  In torch that is five slice views and five copy / fill kernels per layer and decode step; a batch-1
dynamic-cache decode step is bound by the host, and on an H200 host those ops took 80-106 us per layer and step
(``benchmarks/decode_step_sections.py``, benchmarks/results/h200-2026-11-29g), against 25-30 us for Llama's
``DynamicLayer.update`` (two ``cat``).  Here one program per ``(row, head)`` writes that head's scalar and vector
key, the head that opens a value group writes the group's value, and head 0 writes the row's validity (True, or the
step's own for a padded batch) and token index: one launch, no views.  The reference is
:func:`append_one_reference` (the torch ops it replaces).

With ``rotary`` (hybrid layers with RoPE) the same launch also applies the step's RoPE: the program of head ``h``
rotates that head's new query and vector key in place (float32, rounded once, as ``kernels_rotary`` does) and stores
the rotated key into the slot.  The layer then skips its own RoPE launch, its two output allocations and its stride
checks: about 60 us of host time per layer and step on an H200 host (hybrid_sort's projections with RoPE took 193 us
per layer against scalar_sort's 83 without, ``benchmarks/results/h200-2026-11-29g``).  The reference is
:func:`rotate_pair_reference`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels_common import HAS_TRITON, next_pow2
from .kernels_launch import launch_jit

if HAS_TRITON:
    import triton
    import triton.language as tl

if HAS_TRITON:

    # (`slot` and `token` grow by one per decode step: not specialised on their values, one compiled kernel serves all)
    @triton.jit(do_not_specialize=["slot", "token"])
    def _append_one_kernel(
        KS,
        VK,
        V,
        VALID,
        TOKEN,
        NEW_KS,
        NEW_VK,
        NEW_V,
        NEW_VALID,
        s_ks_b,
        s_ks_h,
        s_ks_n,
        s_vk_b,
        s_vk_h,
        s_vk_n,
        s_v_b,
        s_v_g,
        s_v_n,
        s_valid_b,
        s_valid_n,
        s_token_b,
        s_token_n,
        n_ks_b,
        n_ks_h,
        n_vk_b,
        n_vk_h,
        n_v_b,
        n_v_g,
        n_valid_b,
        Q,
        COS,
        SIN,
        n_q_b,
        n_q_h,
        s_cos_b,
        s_sin_b,
        slot,
        token,
        HEADS_PER_GROUP: tl.constexpr,
        HAS_VK: tl.constexpr,
        HAS_VALID: tl.constexpr,
        ROPE: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
    ):
        """Program ``(b, h)``: slot ``slot`` of row ``b`` gets head ``h``'s new scalar key (and vector key); the
        first head of a value group writes the group's value; head 0 the row's validity (``NEW_VALID``'s, else
        True) and token index."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        ks = tl.load(NEW_KS + b * n_ks_b + h * n_ks_h)
        tl.store(KS + b * s_ks_b + h * s_ks_h + slot * s_ks_n, ks.to(KS.dtype.element_ty))
        if ROPE:
            # RoPE (rotate-half) of this head's new query and key, in place, and the rotated key into the slot:
            # x' = [x1 c - x2 s, x2 c + x1 s], x = [x1, x2] split at D / 2, tables [B|1, 1, D/2]
            half = D // 2
            offs_f = tl.arange(0, HALF_PAD)
            f_ok = offs_f < half
            c = tl.load(COS + b * s_cos_b + offs_f, mask=f_ok, other=0.0).to(tl.float32)
            s = tl.load(SIN + b * s_sin_b + offs_f, mask=f_ok, other=0.0).to(tl.float32)
            src_q = Q + b * n_q_b + h * n_q_h + offs_f
            q1 = tl.load(src_q, mask=f_ok, other=0.0).to(tl.float32)
            q2 = tl.load(src_q + half, mask=f_ok, other=0.0).to(tl.float32)
            tl.store(src_q, (q1 * c - q2 * s).to(Q.dtype.element_ty), mask=f_ok)
            tl.store(src_q + half, (q2 * c + q1 * s).to(Q.dtype.element_ty), mask=f_ok)
            src_k = NEW_VK + b * n_vk_b + h * n_vk_h + offs_f
            k1 = tl.load(src_k, mask=f_ok, other=0.0).to(tl.float32)
            k2 = tl.load(src_k + half, mask=f_ok, other=0.0).to(tl.float32)
            # (rounded to the new key's dtype first, then to the cache's: the value the unfused path stores)
            r1 = (k1 * c - k2 * s).to(NEW_VK.dtype.element_ty)
            r2 = (k2 * c + k1 * s).to(NEW_VK.dtype.element_ty)
            tl.store(src_k, r1, mask=f_ok)
            tl.store(src_k + half, r2, mask=f_ok)
            dst_k = VK + b * s_vk_b + h * s_vk_h + slot * s_vk_n + offs_f
            tl.store(dst_k, r1.to(VK.dtype.element_ty), mask=f_ok)
            tl.store(dst_k + half, r2.to(VK.dtype.element_ty), mask=f_ok)
        elif HAS_VK:
            offs_d = tl.arange(0, D_PAD)
            vk = tl.load(NEW_VK + b * n_vk_b + h * n_vk_h + offs_d, mask=offs_d < D)
            dst = VK + b * s_vk_b + h * s_vk_h + slot * s_vk_n + offs_d
            tl.store(dst, vk.to(VK.dtype.element_ty), mask=offs_d < D)
        if h % HEADS_PER_GROUP == 0:
            g = h // HEADS_PER_GROUP
            offs_v = tl.arange(0, DV_PAD)
            v = tl.load(NEW_V + b * n_v_b + g * n_v_g + offs_v, mask=offs_v < DV)
            tl.store(V + b * s_v_b + g * s_v_g + slot * s_v_n + offs_v, v.to(V.dtype.element_ty), mask=offs_v < DV)
        if h == 0:
            if HAS_VALID:
                tl.store(VALID + b * s_valid_b + slot * s_valid_n, tl.load(NEW_VALID + b * n_valid_b))
            else:
                tl.store(VALID + b * s_valid_b + slot * s_valid_n, 1)
            tl.store(TOKEN + b * s_token_b + slot * s_token_n, token)


def append_one_reference(
    keys: Tensor,
    vector_keys: Tensor | None,
    values: Tensor,
    valid: Tensor,
    token_index: Tensor,
    slot: int,
    token: int,
    new_keys: Tensor,
    new_vector_keys: Tensor | None,
    new_values: Tensor,
    new_valid: Tensor | None = None,
    rotary: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Slot ``slot`` of the buffers ``keys [B, H, C]``, ``vector_keys [B, H, C, D]`` (or None), ``values [B, G, C,
    Dv]``, ``valid [B, C]`` and ``token_index [B, C]`` set to the new token's ``new_keys [B, H, 1]``,
    ``new_vector_keys [B, H, 1, D]``, ``new_values [B, G, 1, Dv]``, ``new_valid [B, 1]`` bool (None: True) and
    ``token`` (plain torch).  ``rotary = (new_queries [B, H, 1, D], cos, sin)``: the new queries and vector keys are
    rotated in place first (:func:`rotate_pair_reference`)."""
    if rotary is not None:
        rotate_pair_reference(rotary[0], new_vector_keys, rotary[1], rotary[2])
    keys.narrow(2, slot, 1).copy_(new_keys)
    values.narrow(2, slot, 1).copy_(new_values)
    if vector_keys is not None:
        vector_keys.narrow(2, slot, 1).copy_(new_vector_keys)
    if new_valid is None:
        valid.narrow(1, slot, 1).fill_(True)
    else:
        valid.narrow(1, slot, 1).copy_(new_valid)
    token_index.narrow(1, slot, 1).fill_(token)


def rotate_pair_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """RoPE (rotate-half) of ``q`` and ``k`` ``[B, H, 1, D]`` in place, with tables ``cos / sin [B|1, 1, D/2]``:
    computed in float32 and rounded once, as the fused kernels do (plain torch)."""
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def append_one_reason(
    new_keys: Tensor,
    new_vector_keys: Tensor | None,
    new_values: Tensor,
    rotary: tuple[Tensor, Tensor, Tensor] | None = None,
) -> str | None:
    """None when :func:`append_one_fused` can write these new entries (their last dims contiguous, as the
    projections and position tables come; the shapes are the caller's to check); otherwise why not."""
    others = () if rotary is None else (("queries", rotary[0]), ("cos table", rotary[1]), ("sin table", rotary[2]))
    for name, t in (("vector keys", new_vector_keys), ("values", new_values), *others):
        if t is not None and t.stride(-1) != 1:
            return f"the new {name} are not contiguous in their last dim (strides {tuple(t.stride())})"
    return None


def append_one_fused(
    keys: Tensor,
    vector_keys: Tensor | None,
    values: Tensor,
    valid: Tensor,
    token_index: Tensor,
    slot: int,
    token: int,
    new_keys: Tensor,
    new_vector_keys: Tensor | None,
    new_values: Tensor,
    new_valid: Tensor | None = None,
    rotary: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """:func:`append_one_reference` in one launch (arguments the same; any strides, except that the vector keys',
    values' and queries' last dims, the buffers' and the new entries', are contiguous: :func:`append_one_reason`)."""
    bsz, heads = new_keys.shape[:2]
    groups, dv = new_values.shape[1], new_values.shape[3]
    has_vk = vector_keys is not None
    d = new_vector_keys.shape[3] if has_vk else 1
    vk, new_vk = (vector_keys, new_vector_keys) if has_vk else (keys, new_keys)  # (unread placeholders)
    if rotary is None:
        q = cos = sin = new_keys  # (unread placeholders)
        rope_strides = (0, 0, 0, 0)
    else:
        q, cos, sin = rotary
        rope_strides = (q.stride(0), q.stride(1), cos.stride(0) if cos.shape[0] > 1 else 0,
                        sin.stride(0) if sin.shape[0] > 1 else 0)  # fmt: skip
    launch_jit(
        _append_one_kernel,
        (bsz, heads),
        (
            keys,
            vk,
            values,
            valid,
            token_index,
            new_keys,
            new_vk,
            new_values,
            valid if new_valid is None else new_valid,  # (an unread placeholder without one)
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            *((vk.stride(0), vk.stride(1), vk.stride(2)) if has_vk else (0, 0, 0)),
            values.stride(0),
            values.stride(1),
            values.stride(2),
            valid.stride(0),
            valid.stride(1),
            token_index.stride(0),
            token_index.stride(1),
            new_keys.stride(0),
            new_keys.stride(1),
            *((new_vk.stride(0), new_vk.stride(1)) if has_vk else (0, 0)),
            new_values.stride(0),
            new_values.stride(1),
            0 if new_valid is None else new_valid.stride(0),
            q,
            cos,
            sin,
            *rope_strides,
            slot,
            token,
        ),
        dict(
            HEADS_PER_GROUP=heads // groups,
            HAS_VK=has_vk,
            HAS_VALID=new_valid is not None,
            ROPE=rotary is not None,
            D=d,
            D_PAD=next_pow2(d),
            HALF_PAD=next_pow2(max(d // 2, 1)),
            DV=dv,
            DV_PAD=next_pow2(dv),
        ),
    )
