"""Hybrid attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).

``scale q.k - (qs - ks)^2 / tau + log w`` less its row constant is the dot product of
``q' = [scale q, 2 qs / tau, -1 / tau, 1]`` and ``k' = [k, ks, ks^2, log w]`` (see
:mod:`hf_rbf.attention_scalar_sdpa` for the scalar part).  A float ``scale`` of 0 drops the vector part.
"""

from __future__ import annotations

import torch

from .attention_scalar_sdpa import add_scalar_kernel
from .attention_sdpa_utils import ScoreFeatures, padded_sdpa, sdpa_reason
from .attention_utils import MaskArgs, compute_dtype, expand_value_groups


def hybrid_attention_sdpa(q, k, v, qs, ks, tau, scale, mask: MaskArgs) -> torch.Tensor:
    """The sdpa backend of :func:`hf_rbf.hybrid_attention` (arguments already validated)."""
    ct = compute_dtype(q.dtype)
    b, h, nq, _ = q.shape
    features = ScoreFeatures(q.dtype, ct, b, h, nq, mask.nk, q.device)
    if isinstance(scale, float):
        if scale != 0.0:
            features.add_dot(scale * q.to(ct), k)
    else:
        features.add_dot(scale.to(ct).view(1, -1, 1, 1) * q.to(ct), k)
    add_scalar_kernel(features, qs, ks, tau, mask, ct)
    return padded_sdpa(features, expand_value_groups(v, h), mask)


def hybrid_sdpa_reason(mask: MaskArgs) -> str | None:
    """Why :func:`hybrid_attention_sdpa` cannot serve a call, or None."""
    return sdpa_reason(mask)
