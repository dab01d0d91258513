"""Scaled dot-product attention with the shared mask semantics: the "dot" layer kind's kernel and the speed reference.

``w_ij`` proportional to ``exp(scale * q_i . k_j + log w_j)`` over the allowed keys (see
:mod:`hf_rbf.attention_utils` for causal / window / prefix / padding semantics, identical for every family).

Public entry point :func:`dot_attention`; :func:`dot_attention_naive` is the plain PyTorch reference and
:func:`dot_attention_sdpa` the native ``torch.nn.functional.scaled_dot_product_attention`` path (``is_causal`` fast
path when nothing else restricts the keys, an explicit mask otherwise; rows without any allowed key return zeros).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .attention_utils import (
    MaskArgs,
    allowed_mask,
    autocast_inputs,
    check_dim,
    check_same,
    check_return_weights,
    check_tensor,
    choose_backend,
    choose_weights_backend,
    compute_dtype,
    masked_kernel_average,
    normalize_mask_args,
)


OP = "dot_attention"


def dot_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: MaskArgs, return_weights: bool = False
):
    """Materialised reference: float32 math (float64 for float64 inputs), any mask.

    With ``return_weights`` returns ``(out, weights [B, H, Nq, Nk])`` (see :func:`dot_attention`)."""
    ct = compute_dtype(q.dtype)
    scores = (q.to(ct) @ k.to(ct).transpose(-1, -2)) * scale
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.to(ct).unsqueeze(-2)
    if return_weights:
        out, weights = masked_kernel_average(
            scores, v.to(ct), allowed_mask(mask, q.device), normalize=True, return_weights=True
        )
        return out.to(q.dtype), weights.to(q.dtype)
    out = masked_kernel_average(scores, v.to(ct), allowed_mask(mask, q.device), normalize=True)
    return out.to(q.dtype)


def _needs_no_mask(mask: MaskArgs) -> bool:
    """A causal single-query step with nothing else restricting the keys sees every key: no mask at all."""
    return (
        mask.causal
        and mask.nq == 1
        and mask.window is None
        and mask.key_log_weights is None
        and mask.attention_mask is None
    )


def dot_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: MaskArgs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``: flash / memory-efficient kernels when the mask allows them."""
    if mask.is_plain:
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal and mask.nq > 1, scale=scale)
    if _needs_no_mask(mask):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    allowed = allowed_mask(mask, q.device)  # [B|1, 1, Nq, Nk]
    row_ok = allowed.any(dim=-1, keepdim=True)
    # SDPA returns NaN for a row without any allowed key.  Such rows (left padding, a query before every key) are
    # opened to all keys and zeroed afterwards: the result is zeros with zero gradient, as in the reference.
    open_mask = allowed | ~row_ok
    if mask.key_log_weights is None:
        attn_mask = open_mask
    else:
        klw = mask.key_log_weights.to(q.dtype).unsqueeze(-2)  # [B|1, H|1, 1, Nk]
        attn_mask = klw.masked_fill(~open_mask, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return out.masked_fill(~row_ok, 0.0)


def _candidates(q, k, v, scale, mask):
    """Backends in order of preference for "auto" (fastest first), each with the reason it cannot serve or None."""
    return {"sdpa": (dot_attention_sdpa, None), "naive": (dot_attention_naive, None)}


def dot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    key_log_weights: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    num_prefix_keys: int = 0,
    backend: str = "auto",
    return_weights: bool = False,
):
    """Softmax dot-product attention with the same mask semantics as the distance-based families.

    Args:
        q: queries ``[B, H, Nq, D]``.
        k: keys ``[B, H, Nk, D]``.
        v: values ``[B, H, Nk, Dv]``.
        scale: logit scale; ``None`` means ``1 / sqrt(D)``.
        causal, window, key_log_weights, attention_mask, num_prefix_keys: the shared mask arguments (see
            :mod:`hf_rbf.attention_utils`).
        backend: "auto" (= "sdpa"), "sdpa" or "naive".
        return_weights: also return the attention weights, computed by the materialised reference: ``backend`` must
            be "auto" (which then serves with "naive") or "naive".

    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; with ``return_weights`` ``(out, weights)``, ``weights``
        ``[B, H, Nq, Nk]`` (the softmax weights, 0 on disallowed keys) in the dtype of ``q``, so that
        ``out = weights @ v``.
    """
    check_return_weights(OP, return_weights, backend)
    check_tensor(OP, "q", q, 4, "[B, H, Nq, D]")
    check_tensor(OP, "k", k, 4, "[B, H, Nk, D]")
    check_tensor(OP, "v", v, 4, "[B, H, Nk, Dv]")
    # the "vlt" kind's values are the float32 residual stream (no W_V casts them): autocast's dtype, as SDPA casts
    q, k, v = autocast_inputs(q, k, v)
    check_same(OP, {"q": q, "k": k, "v": v})
    b, h, nq, d = q.shape
    nk = k.shape[2]
    check_dim(OP, "k", k, 0, b, "batch size")
    check_dim(OP, "v", v, 0, b, "batch size")
    check_dim(OP, "k", k, 1, h, "head count")
    check_dim(OP, "v", v, 1, h, "head count")
    check_dim(OP, "k", k, 3, d, "head dim")
    check_dim(OP, "v", v, 2, nk, "key length")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{OP}: `scale` must be None or a positive finite float; got {scale!r}")
    mask = normalize_mask_args(
        OP,
        batch=b,
        heads=h,
        nq=nq,
        nk=nk,
        device=q.device,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        key_log_weights=key_log_weights,
        attention_mask=attention_mask,
    )
    if return_weights:
        choose_weights_backend(OP, backend, q.device)
        return dot_attention_naive(q, k, v, float(scale), mask, return_weights=True)
    _, fn = choose_backend(OP, backend, q.device, _candidates(q, k, v, float(scale), mask))
    return fn(q, k, v, float(scale), mask)
