"""RBF attention for stock transformers models: ``attn_implementation="rbf"`` and ``"rbf_softmax_free"``.

``import hf_rbf`` registers both names with transformers' ``AttentionInterface`` (the functions) and
``AttentionMaskInterface`` (their mask), so any model that dispatches through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2,
Mistral, ...) can switch::

    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="rbf")

What the functions compute, per head: ``softmax_j(-gamma ||q_i - k_j||^2)`` over the allowed keys (``"rbf"``), or the
softmax-free sum ``sum_j exp(-gamma ||q_i - k_j||^2) v_j`` (``"rbf_softmax_free"``), through
:func:`hf_rbf.rbf_attention` and its backends (the fused kernels on CUDA, the SDPA padding trick or the reference
elsewhere; ``hf_rbf.last_backend("rbf_attention")`` says which).

**gamma.** ``config.rbf_gamma`` when the model's config has it (a positive float), else ``scaling / 2`` where
``scaling`` is what the model passes (``1 / sqrt(head_dim)`` for these models).  Why half the scale: with the softmax the
query norm is a row constant, so ``-gamma ||q - k||^2`` ranks keys as ``2 gamma q.k - gamma ||k||^2``.  With
``gamma = scaling / 2`` the dot-product logits of the original model are kept exactly and only the key-norm penalty
``-(scaling / 2) ||k||^2`` is added.  RoPE does not change this: rotations keep norms, so
``||R_m q - R_n k||^2 = ||q||^2 + ||k||^2 - 2 q.R_{n-m} k`` and the softmax still sees the rotated dot product plus the
key-norm penalty.  Converting a trained dot-product checkpoint therefore starts from its own logits minus a per-key
bias; that bias is what fine-tuning has to absorb.

**Masks.** The registered mask function hands the attention the 2-D padding mask (or None), like FlashAttention's;
causal alignment (the queries are the last positions of the keys, as with a KV cache) and the model's sliding window
(the ``sliding_window`` argument its layers pass) are applied by :func:`hf_rbf.rbf_attention`.  Masks these functions
cannot express are refused with an error instead of being ignored: packed sequences (position ids restarting inside a
row), custom ``or_mask``/``and_mask`` overlays, bidirectional attention, and static caches (whose keys include empty
slots).  Grouped-query attention repeats the key/value heads.
"""

from __future__ import annotations

import math

import torch

from .attention_rbf import rbf_attention

try:  # transformers >= 5 (the supported range)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError:  # pragma: no cover - a transformers without the interfaces cannot register anything
    AttentionInterface = AttentionMaskInterface = causal_mask_function = None


RBF_ATTENTION_IMPLEMENTATIONS = ("rbf", "rbf_softmax_free")


def rbf_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """The mask function registered for ``"rbf"`` / ``"rbf_softmax_free"``: the boolean padding mask ``[B, kv_length]``
    when there is padding, else None (causal order and the sliding window are applied inside the attention)."""
    if mask_function is not None and not _is_causal_or_sliding(mask_function):
        raise NotImplementedError(
            "attn_implementation='rbf' supports causal and sliding-window masks with padding; this model asked for "
            f"another mask pattern ({getattr(mask_function, '__qualname__', mask_function)}: packed sequences, "
            "custom or/and mask overlays or bidirectional attention)"
        )
    # The keys must be exactly the tokens seen so far (the last kv_length of them): a static cache's keys include
    # empty slots (its layers report the query offset as a tensor, and a capacity beyond the tokens seen).
    if isinstance(q_offset, torch.Tensor) or kv_offset + kv_length != q_offset + q_length:
        raise NotImplementedError(
            "attn_implementation='rbf' needs the keys to be exactly the tokens seen so far; a static (fixed-capacity) "
            "cache is not supported: use the default DynamicCache"
        )
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.all():
        return None
    return attention_mask


def _is_causal_or_sliding(mask_function) -> bool:
    """Whether transformers' mask pattern is the causal mask, possibly intersected with its sliding-window overlay
    (what ``sliding_window_causal_mask_function`` builds).  ``and_masks`` keeps its parts in its closure; anything else
    (packed-sequence masks, user overlays, ``or_masks``) is a pattern the padding mask cannot carry."""
    if mask_function is causal_mask_function:
        return True
    name = getattr(mask_function, "__qualname__", "")
    if name.startswith("sliding_window_overlay."):
        return True
    if name.startswith("and_masks.") and mask_function.__closure__:
        parts = [cell.cell_contents for cell in mask_function.__closure__ if isinstance(cell.cell_contents, tuple)]
        return bool(parts) and all(_is_causal_or_sliding(part) for group in parts for part in group)
    return False


def _gamma(module, scaling) -> float:
    config = getattr(module, "config", None)
    gamma = getattr(config, "rbf_gamma", None)
    if gamma is None:
        if scaling is None:
            head_dim = getattr(module, "head_dim", None)
            if head_dim is None:
                raise ValueError("rbf attention: the model passed no `scaling` and its module has no `head_dim`")
            scaling = 1.0 / math.sqrt(head_dim)
        return float(scaling) / 2.0
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma <= 0:
        raise ValueError(f"`config.rbf_gamma` must be a positive float (or absent: scaling / 2); got {gamma!r}")
    return float(gamma)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, H, S, D]`` for grouped-query attention."""
    groups = heads // x.shape[1]
    if groups == 1:
        return x
    b, hkv, s, d = x.shape
    return x[:, :, None].expand(b, hkv, groups, s, d).reshape(b, heads, s, d)


def _forward(module, query, key, value, attention_mask, scaling, dropout, sliding_window, normalize: bool):
    if dropout:
        raise NotImplementedError("attn_implementation='rbf' has no attention dropout; set attention_dropout=0")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "attn_implementation='rbf' takes the 2-D padding mask its mask function builds; got a mask of shape "
            f"{tuple(attention_mask.shape)} (a custom 4-D mask cannot be expressed as distances with a causal window)"
        )
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("attn_implementation='rbf' is causal (decoder) attention only")
    heads = query.shape[1]
    key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
    out = rbf_attention(
        query,
        key,
        value,
        gamma=_gamma(module, scaling),
        causal=True,
        window=int(sliding_window) if sliding_window else None,
        normalize=normalize,
        attention_mask=attention_mask,
    )
    return out.transpose(1, 2).contiguous(), None


def rbf_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """transformers ``AttentionInterface`` function ``"rbf"``: ``query [B, H, N, D]``, ``key``/``value``
    ``[B, Hkv, S, D]``; returns ``(out [B, N, H, D], None)``."""
    return _forward(module, query, key, value, attention_mask, scaling, dropout, sliding_window, normalize=True)


def rbf_softmax_free_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """``"rbf_softmax_free"``: ``out_i = sum_j exp(-gamma ||q_i - k_j||^2) v_j`` (no normalisation)."""
    return _forward(module, query, key, value, attention_mask, scaling, dropout, sliding_window, normalize=False)


def register_attention_functions() -> bool:
    """Register both names with transformers (idempotent); False when this transformers has no interfaces."""
    if AttentionInterface is None:
        return False
    AttentionInterface.register("rbf", rbf_attention_forward)
    AttentionInterface.register("rbf_softmax_free", rbf_softmax_free_attention_forward)
    for name in RBF_ATTENTION_IMPLEMENTATIONS:
        AttentionMaskInterface.register(name, rbf_padding_mask)
    return True


__all__ = [
    "RBF_ATTENTION_IMPLEMENTATIONS",
    "rbf_attention_forward",
    "rbf_padding_mask",
    "rbf_softmax_free_attention_forward",
    "register_attention_functions",
]
