"""Gaussian kernel attention on the fused Triton kernels (``backend="triton"``).

``S_ij = -||x_i - x_j||^2 / (2 sigma_h^2) + log w_j`` and ``W_ij = e^S_ij / (sum_j e^S_ij + eps)``: the shared
distance op with ``a = 1/sigma^2``, ``b = -1/(2 sigma^2)``, the query norm kept (``eps`` breaks shift invariance)
and ``x`` as key *and* value (``kv_same``: every key tile is read once and serves both products; the backward
writes one gradient for both roles, and autograd adds the query role's).  ``log_sigma`` gets its gradient through
``a`` and ``b``.
"""

from __future__ import annotations

import torch

from .attention_distance_triton import distance_attention, distance_reason
from .attention_utils import MaskArgs


def gka_attention_triton(query, x, log_sigma, eps: float, mask: MaskArgs) -> torch.Tensor:
    """Fused GKA; same arguments and result as ``gka_attention_naive``."""
    heads = x.shape[1]
    if isinstance(log_sigma, torch.Tensor):
        ls = log_sigma.float()
    else:
        ls = torch.full((heads,), float(log_sigma), device=x.device, dtype=torch.float32)
    c = 0.5 * torch.exp(-2.0 * ls)  # 1 / (2 sigma^2)
    return distance_attention(
        query,
        x,
        x,
        None,
        None,
        None,
        2.0 * c,
        -c,
        mask,
        normalize=True,
        qnorm=True,
        knorm=True,
        kv_same=True,
        eps=eps,
    )


def gka_triton_reason(query, x, log_sigma, eps, mask) -> str | None:
    """None when ``gka_attention_triton`` can serve the call, else why not."""
    return distance_reason((query, x), (("feature dim d", x.shape[-1]),))
