"""Gaussian kernel attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).

``W_ij = K_ij / (sum_j' K_ij' + eps)`` with ``K_ij = exp(-||x_i - x_j||^2 / (2 sigma^2) + log w_j)`` is a softmax
over the keys plus one dummy key of score ``log eps`` and value 0.  Writing ``s = 1 / sigma^2``::

    q'_i = [s x_i, 1, s ||x_i||^2 / 2 + log eps]      k'_j = [x_j, -s ||x_j||^2 / 2 + log w_j, 0]
    dummy key k* = [0, 0, 1]                            (value 0)

gives ``q'_i . k'_j = -s ||x_i - x_j||^2 / 2 + log w_j + r_i`` and ``q'_i . k* = log eps + r_i`` with the same row
shift ``r_i = s ||x_i||^2 / 2`` on both, so the softmax is exactly the paper's ``W``.  With ``eps = 0`` the dummy key
is dropped and the query norm is a plain row constant.  The scalar columns are split in two for half precision
(see :mod:`hf_rbf.attention_sdpa_utils`), and ``r_i`` is taken from the query's own key as the kernel computes it
(:func:`row_shift`), so that a query's own key keeps its exact score next to ``log eps`` at any norm.
"""

from __future__ import annotations

import math

import torch

from .attention_sdpa_utils import ScoreFeatures, padded_sdpa, sdpa_reason
from .attention_utils import MaskArgs, compute_dtype


def gka_attention_sdpa(query, x, log_sigma, eps: float, mask: MaskArgs) -> torch.Tensor:
    """The sdpa backend of :func:`hf_rbf.gka_attention` (arguments already validated)."""
    ct = compute_dtype(x.dtype)
    b, h, nq, _ = query.shape
    if isinstance(log_sigma, float):
        inv_var = math.exp(-2.0 * log_sigma)
        inv_var4 = inv_var
    else:
        inv_var = torch.exp(-2.0 * log_sigma.to(ct)).view(1, -1, 1)  # [1, H, 1]
        inv_var4 = inv_var.unsqueeze(-1)
    qf = query.to(ct)
    q_scaled = (inv_var4 * qf).to(x.dtype)  # rounded once: the row shift below must use the same q
    features = ScoreFeatures(x.dtype, ct, b, h, nq, mask.nk, x.device)
    features.add_dot(q_scaled, x)
    norm_bias = -0.5 * inv_var * x.to(ct).square().sum(-1)
    bias = norm_bias if mask.key_log_weights is None else norm_bias + mask.key_log_weights.to(ct)
    features.add_key_bias(bias)
    if eps > 0:
        features.add_dummy_key(row_shift(q_scaled, qf, x, norm_bias, inv_var, ct) + math.log(eps))
    return padded_sdpa(features, x, mask)


def row_shift(q_scaled, qf, x, norm_bias, inv_var, ct) -> torch.Tensor:
    """The row shift ``r_i = s ||x_i||^2 / 2`` of the scores, computed the way the kernel sees it.

    For any key ``j``, ``r_i = q'_i . x_j - s ||x_j||^2 / 2 + s ||q_i - x_j||^2 / 2`` exactly.  Taking for ``j`` the
    query's own position (``Nk - Nq + i``) and the *rounded* ``q'`` that the kernel uses, the query's own key gets
    exactly its true score ``-s ||q_i - x_j||^2 / 2`` (0 in self-attention) next to the dummy key's ``log eps``:
    computing ``r_i`` from ``||q_i||^2`` instead would leave the kernel's rounding of ``q' . x_j`` (large for large
    norms in half precision) in the balance between the kernel and ``eps``.
    """
    nq, nk = qf.shape[2], x.shape[2]
    own = (torch.arange(nq, device=x.device) + (nk - nq)).clamp(0, nk - 1)
    x_own = x.to(ct).index_select(2, own)  # [B, H, Nq, d]
    dot = (q_scaled.to(ct) * x_own).sum(-1)
    dist = 0.5 * inv_var * (qf - x_own).square().sum(-1)
    return dot + norm_bias.index_select(-1, own) + dist


def gka_sdpa_reason(mask: MaskArgs) -> str | None:
    """Why :func:`gka_attention_sdpa` cannot serve a call, or None."""
    return sdpa_reason(mask)
