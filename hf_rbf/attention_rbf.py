"""RBF attention: weights proportional to ``exp(-gamma * ||q_i - k_j||^2 + log w_j)``.

Public entry point :func:`rbf_attention` and its plain PyTorch reference :func:`rbf_attention_naive`.
With ``normalize=True`` (softmax) the query norm is a per-row constant and drops out, leaving the score
``2 * gamma * q.k - gamma * ||k||^2`` (the blog's "regularised key norm" form).  With ``normalize=False`` (the
blog's softmax-free variant) ``out_i = sum_j exp(-gamma * ||q_i - k_j||^2 + log w_j) v_j``: the query norm stays.
"""

from __future__ import annotations

import math

import torch

from .attention_rbf_flex import rbf_attention_flex, rbf_flex_reason
from .attention_rbf_sdpa import rbf_attention_sdpa, rbf_sdpa_reason
from .attention_rbf_triton import rbf_attention_triton, rbf_triton_reason
from .attention_utils import (
    MaskArgs,
    autocast_inputs,
    allowed_mask,
    check_dim,
    check_same,
    check_return_weights,
    check_tensor,
    choose_backend,
    choose_weights_backend,
    compute_dtype,
    flex_auto_reason,
    masked_kernel_average,
    normalize_mask_args,
    per_head_param,
)
from .kernels_common import auto_order


OP = "rbf_attention"


def rbf_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma,
    normalize: bool,
    mask: MaskArgs,
    return_weights: bool = False,
):
    """Materialised reference: float32 math (float64 for float64 inputs), any mask, any head dim.

    With ``return_weights`` returns ``(out, weights [B, H, Nq, Nk])`` (see :func:`rbf_attention`)."""
    ct = compute_dtype(q.dtype)
    qf, kf, vf = q.to(ct), k.to(ct), v.to(ct)
    g = gamma if isinstance(gamma, float) else gamma.to(ct).view(1, -1, 1, 1)
    k_sq = (kf * kf).sum(-1).unsqueeze(-2)  # [B, H, 1, Nk]
    qk = qf @ kf.transpose(-1, -2)
    if normalize:
        scores = g * (2.0 * qk - k_sq)  # -gamma*||q||^2 is a row constant: dropped
    else:
        q_sq = (qf * qf).sum(-1).unsqueeze(-1)
        scores = -g * (q_sq + k_sq - 2.0 * qk).clamp_min(0.0)
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.to(ct).unsqueeze(-2)
    if return_weights:
        out, weights = masked_kernel_average(
            scores, vf, allowed_mask(mask, q.device), normalize=normalize, return_weights=True
        )
        return out.to(q.dtype), weights.to(q.dtype)
    out = masked_kernel_average(scores, vf, allowed_mask(mask, q.device), normalize=normalize)
    return out.to(q.dtype)


def _candidates(q, k, v, gamma, normalize, mask, backend):
    """Backends in order of preference for "auto" (fastest first), each with the reason it cannot serve or None."""
    candidates = {
        "triton": (rbf_attention_triton, rbf_triton_reason(q, k, v, gamma, normalize, mask)),
        "sdpa": (rbf_attention_sdpa, rbf_sdpa_reason(q, normalize, mask)),
        "flex": (rbf_attention_flex, flex_auto_reason(q.device, backend) or rbf_flex_reason(q, k, v, gamma, mask)),
        "naive": (rbf_attention_naive, None),
    }
    return auto_order(candidates, q.device, mask.nq)


def rbf_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    gamma=None,
    causal: bool = True,
    window: int | None = None,
    normalize: bool = True,
    key_log_weights: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    num_prefix_keys: int = 0,
    backend: str = "auto",
    return_weights: bool = False,
):
    """Scaled RBF attention.

    Args:
        q: queries ``[B, H, Nq, D]``.
        k: keys ``[B, H, Nk, D]``.
        v: values ``[B, H, Nk, Dv]``.
        gamma: kernel scale; ``None`` means ``1 / sqrt(D)``; a positive float or a per-head tensor ``[H]``
            (may require grad).
        causal, window, key_log_weights, attention_mask, num_prefix_keys: the shared mask arguments (see
            :mod:`hf_rbf.attention_utils`).
        normalize: softmax over the allowed keys (True) or the softmax-free sum (False).
        backend: "auto", "naive", "sdpa", "flex" or "triton".
        return_weights: also return the attention weights, computed by the materialised reference: ``backend`` must
            be "auto" (which then serves with "naive") or "naive".

    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; with ``return_weights`` ``(out, weights)``, ``weights``
        ``[B, H, Nq, Nk]`` in the dtype of ``q``: the softmax weights (``normalize=True``) or the unnormalised kernel
        weights ``exp(score)`` (``normalize=False``), 0 on disallowed keys, so that ``out = weights @ v``.
    """
    check_return_weights(OP, return_weights, backend)
    check_tensor(OP, "q", q, 4, "[B, H, Nq, D]")
    check_tensor(OP, "k", k, 4, "[B, H, Nk, D]")
    check_tensor(OP, "v", v, 4, "[B, H, Nk, Dv]")
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
    if not isinstance(normalize, bool):
        raise TypeError(f"{OP}: `normalize` must be True or False; got {normalize!r}")
    gamma = per_head_param(OP, "gamma", 1.0 / math.sqrt(d) if gamma is None else gamma, h, q.device)
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
        return rbf_attention_naive(q, k, v, gamma, normalize, mask, return_weights=True)
    _, fn = choose_backend(OP, backend, q.device, _candidates(q, k, v, gamma, normalize, mask, backend))
    return fn(q, k, v, gamma, normalize, mask)
