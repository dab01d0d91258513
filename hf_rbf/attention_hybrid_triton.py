"""Hybrid scalar + dot-product attention on the fused Triton kernels (``backend="triton"``).

``S_ij = scale_h q_i.k_j - (qs_i - ks_j)^2 / tau_i + log w_j``: the shared distance op with ``a = scale``, ``b = 0``
and the scalar term with ``beta = 1 / tau`` evaluated per score element in fp32 (the exact difference, not an
expanded product, so large scalar keys lose no precision).  Grouped values ``[B, G, Nk, Dv]`` are indexed by group
in the forward and their gradient is summed over the group's heads inside the dK/dV program.
"""

from __future__ import annotations

import torch

from .attention_distance_triton import distance_attention, distance_reason
from .attention_utils import MaskArgs


def hybrid_attention_triton(q, k, v, qs, ks, tau, scale, mask: MaskArgs) -> torch.Tensor:
    """Fused hybrid attention; same arguments and result as ``hybrid_attention_naive``."""
    heads = q.shape[1]
    if isinstance(scale, torch.Tensor):
        a = scale.float()
    else:
        a = torch.full((heads,), float(scale), device=q.device, dtype=torch.float32)
    if isinstance(tau, torch.Tensor):
        beta = 1.0 / tau.float()
    else:
        beta = torch.full((1, 1, 1), 1.0 / float(tau), device=q.device, dtype=torch.float32)
    return distance_attention(
        q,
        k,
        v,
        qs,
        ks,
        beta,
        a,
        torch.zeros_like(a),
        mask,
        normalize=True,
        qnorm=False,
        knorm=False,
        kv_same=False,
        eps=0.0,
    )


def hybrid_triton_reason(q, k, v, qs, ks, tau, scale, mask) -> str | None:
    """None when ``hybrid_attention_triton`` can serve the call, else why not."""
    return distance_reason((q, k, v), (("head dim D", q.shape[-1]), ("value dim Dv", v.shape[-1])))
