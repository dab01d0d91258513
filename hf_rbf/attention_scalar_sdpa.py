"""Scalar sort attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).

The softmax drops the row constant ``-qs_i^2 / tau_i``, leaving ``2 qs_i ks_j / tau_i - ks_j^2 / tau_i + log w_j``:
``q' = [2 qs / tau, -1 / tau, 1]`` and ``k' = [ks, ks^2, log w]``.  When ``tau`` does not vary over the queries
(a float or per head) ``-ks^2 / tau + log w`` is one per-key bias column.  The grouped values are expanded to the
heads.  Half precision splits the scalar columns in two (see :mod:`hf_rbf.attention_sdpa_utils`).
"""

from __future__ import annotations

import torch

from .attention_sdpa_utils import ScoreFeatures, padded_sdpa, sdpa_reason
from .attention_utils import MaskArgs, compute_dtype, expand_value_groups


def add_scalar_kernel(features: ScoreFeatures, qs, ks, tau, mask: MaskArgs, ct) -> None:
    """Add ``-(qs_i - ks_j)^2 / tau_i + log w_j`` (less the row constant) to ``features``; shared with hybrid."""
    qf, kf = qs.to(ct), ks.to(ct)
    inv_tau = 1.0 / tau if isinstance(tau, float) else 1.0 / tau.to(ct)  # float or [B|1, H|1, Nq|1]
    features.add_product(2.0 * qf * inv_tau, ks, b_exact=True)
    bias = None
    if isinstance(inv_tau, float) or inv_tau.shape[-1] == 1:
        bias = -kf.square() * inv_tau  # inv_tau [B|1, H|1, 1] broadcasts over the keys
    else:
        features.add_product(-inv_tau, kf.square())
    if mask.key_log_weights is not None:
        klw = mask.key_log_weights.to(ct)
        bias = klw if bias is None else bias + klw
    if bias is not None:
        features.add_key_bias(bias)


def scalar_attention_sdpa(qs, ks, v, tau, mask: MaskArgs) -> torch.Tensor:
    """The sdpa backend of :func:`hf_rbf.scalar_attention` (arguments already validated)."""
    ct = compute_dtype(v.dtype)
    b, h, nq = qs.shape
    features = ScoreFeatures(v.dtype, ct, b, h, nq, mask.nk, v.device)
    add_scalar_kernel(features, qs, ks, tau, mask, ct)
    return padded_sdpa(features, expand_value_groups(v, h), mask)


def scalar_sdpa_reason(mask: MaskArgs) -> str | None:
    """Why :func:`scalar_attention_sdpa` cannot serve a call, or None."""
    return sdpa_reason(mask)
