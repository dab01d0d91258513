"""Gaussian Kernel Attention (GKA, arXiv:2605.02144): projection-free kernel smoothing of per-head features.

``K_ij = exp(-||x_i - x_j||^2 / (2 sigma_h^2)) * w_j`` on the allowed pairs, ``W_ij = K_ij / (sum_j' K_ij' + eps)``,
``out_i = sum_j W_ij x_j`` (the paper's equations 3, 4 and 7).  The same features ``x`` are query, key and value.
Because of ``eps`` the weights are not shift-invariant, so the query norm stays in the distance.
"""

from __future__ import annotations

import torch

from .attention_gka_flex import gka_attention_flex, gka_flex_reason
from .attention_gka_sdpa import gka_attention_sdpa, gka_sdpa_reason
from .attention_gka_triton import gka_attention_triton, gka_triton_reason
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
    flex_auto_reason,
    masked_kernel_average,
    normalize_mask_args,
    per_head_param,
)
from .kernels_common import auto_order


OP = "gka_attention"


def gka_attention_naive(
    query: torch.Tensor,
    x: torch.Tensor,
    log_sigma,
    eps: float,
    mask: MaskArgs,
    return_weights: bool = False,
):
    """Materialised reference (float32, or float64 for float64 inputs).  ``query`` is ``x`` itself without a cache.

    With ``return_weights`` returns ``(out, weights [B, H, Nq, Nk])`` (see :func:`gka_attention`)."""
    ct = compute_dtype(x.dtype)
    qf, xf = query.to(ct), x.to(ct)
    if isinstance(log_sigma, float):
        inv_two_sigma_sq = 0.5 * torch.exp(torch.tensor(-2.0 * log_sigma, dtype=ct, device=x.device))
    else:
        inv_two_sigma_sq = 0.5 * torch.exp(-2.0 * log_sigma.to(ct)).view(1, -1, 1, 1)
    q_sq = (qf * qf).sum(-1).unsqueeze(-1)
    x_sq = (xf * xf).sum(-1).unsqueeze(-2)
    dist_sq = (q_sq + x_sq - 2.0 * (qf @ xf.transpose(-1, -2))).clamp_min(0.0)
    scores = -dist_sq * inv_two_sigma_sq
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.to(ct).unsqueeze(-2)
    if return_weights:
        out, weights = masked_kernel_average(
            scores, xf, allowed_mask(mask, x.device), normalize=True, eps=eps, return_weights=True
        )
        return out.to(x.dtype), weights.to(x.dtype)
    out = masked_kernel_average(scores, xf, allowed_mask(mask, x.device), normalize=True, eps=eps)
    return out.to(x.dtype)


def _candidates(query, x, log_sigma, eps, mask, backend):
    """Backends in order of preference for "auto" (fastest first), each with the reason it cannot serve or None."""
    candidates = {
        "triton": (gka_attention_triton, gka_triton_reason(query, x, log_sigma, eps, mask)),
        "sdpa": (gka_attention_sdpa, gka_sdpa_reason(mask)),
        "flex": (gka_attention_flex, flex_auto_reason(x.device, backend) or gka_flex_reason(query, x, log_sigma, mask)),
        "naive": (gka_attention_naive, None),
    }
    return auto_order(candidates, x.device, mask.nq)


def gka_attention(
    x: torch.Tensor,
    log_sigma,
    *,
    causal: bool = True,
    window: int | None = None,
    eps: float = 1e-6,
    key_log_weights: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    num_prefix_keys: int = 0,
    query: torch.Tensor | None = None,
    backend: str = "auto",
    return_weights: bool = False,
):
    """Gaussian kernel attention.

    Args:
        x: features ``[B, H, N, d]``; query, key and value at once.
        log_sigma: per-head log bandwidth, a tensor ``[H]`` (may require grad) or a float shared by all heads.
        eps: the denominator's epsilon (paper eq. 4); ``>= 0``.
        query: optional separate query features ``[B, H, Nq, d]`` for a KV-cache decode step, where ``x`` then holds
            the cached features (keys and values); the queries are the last ``Nq`` positions of ``x``.
        causal, window, key_log_weights, attention_mask, num_prefix_keys: the shared mask arguments (see
            :mod:`hf_rbf.attention_utils`).
        backend: "auto", "naive", "sdpa", "flex" or "triton".
        return_weights: also return the attention weights, computed by the materialised reference: ``backend`` must
            be "auto" (which then serves with "naive") or "naive".

    Returns:
        ``[B, H, Nq, d]`` in the dtype of ``x``; with ``return_weights`` ``(out, weights)``, ``weights``
        ``[B, H, Nq, Nk]`` in the dtype of ``x``: ``W_ij = K_ij / (sum_j' K_ij' + eps)`` (rows sum to slightly less
        than 1 because of ``eps``), 0 on disallowed keys, so that ``out = weights @ x``.
    """
    check_return_weights(OP, return_weights, backend)
    check_tensor(OP, "x", x, 4, "[B, H, N, d]")
    x, query = autocast_inputs(x, query)
    b, h, nk, d = x.shape
    if query is None:
        query = x
    else:
        check_tensor(OP, "query", query, 4, "[B, H, Nq, d]")
        check_same(OP, {"x": x, "query": query})
        check_dim(OP, "query", query, 0, b, "batch size")
        check_dim(OP, "query", query, 1, h, "head count")
        check_dim(OP, "query", query, 3, d, "feature dim")
    nq = query.shape[2]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{OP}: `eps` must be a float >= 0; got {eps!r}")
    log_sigma = per_head_param(OP, "log_sigma", log_sigma, h, x.device, positive=False)
    mask = normalize_mask_args(
        OP,
        batch=b,
        heads=h,
        nq=nq,
        nk=nk,
        device=x.device,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        key_log_weights=key_log_weights,
        attention_mask=attention_mask,
    )
    eps = float(eps)
    if return_weights:
        choose_weights_backend(OP, backend, x.device)
        return gka_attention_naive(query, x, log_sigma, eps, mask, return_weights=True)
    _, fn = choose_backend(OP, backend, x.device, _candidates(query, x, log_sigma, eps, mask, backend))
    return fn(query, x, log_sigma, eps, mask)
