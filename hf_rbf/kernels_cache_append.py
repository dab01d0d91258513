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
"""

from __future__ import annotations

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
        slot,
        token,
        HEADS_PER_GROUP: tl.constexpr,
        HAS_VK: tl.constexpr,
        HAS_VALID: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
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
        if HAS_VK:
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
) -> None:
    """Slot ``slot`` of the buffers ``keys [B, H, C]``, ``vector_keys [B, H, C, D]`` (or None), ``values [B, G, C,
    Dv]``, ``valid [B, C]`` and ``token_index [B, C]`` set to the new token's ``new_keys [B, H, 1]``,
    ``new_vector_keys [B, H, 1, D]``, ``new_values [B, G, 1, Dv]``, ``new_valid [B, 1]`` bool (None: True) and
    ``token`` (plain torch)."""
    keys.narrow(2, slot, 1).copy_(new_keys)
    values.narrow(2, slot, 1).copy_(new_values)
    if vector_keys is not None:
        vector_keys.narrow(2, slot, 1).copy_(new_vector_keys)
    if new_valid is None:
        valid.narrow(1, slot, 1).fill_(True)
    else:
        valid.narrow(1, slot, 1).copy_(new_valid)
    token_index.narrow(1, slot, 1).fill_(token)


def append_one_reason(new_keys: Tensor, new_vector_keys: Tensor | None, new_values: Tensor) -> str | None:
    """None when :func:`append_one_fused` can write these new entries (their last dim contiguous, as the
    projections give them); otherwise why not."""
    for name, t in (("vector keys", new_vector_keys), ("values", new_values)):
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
) -> None:
    """:func:`append_one_reference` in one launch (arguments the same; any strides, except that the vector keys' and
    values' last dims, the buffers' and the new entries', are contiguous: :func:`append_one_reason`)."""
    bsz, heads = new_keys.shape[:2]
    groups, dv = new_values.shape[1], new_values.shape[3]
    has_vk = vector_keys is not None
    d = new_vector_keys.shape[3] if has_vk else 1
    vk, new_vk = (vector_keys, new_vector_keys) if has_vk else (keys, new_keys)  # (unread placeholders)
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
            slot,
            token,
        ),
        dict(
            HEADS_PER_GROUP=heads // groups,
            HAS_VK=has_vk,
            HAS_VALID=new_valid is not None,
            D=d,
            D_PAD=next_pow2(d),
            DV=dv,
            DV_PAD=next_pow2(dv),
        ),
    )
