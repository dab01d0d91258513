"""RBF attention on the fused Triton kernels (``backend="triton"``).

``S_ij = -gamma_h ||q_i - k_j||^2 + log w_j``: the shared distance op with ``a = 2 gamma`` and ``b = -gamma``.
With the softmax (``normalize=True``) ``-gamma ||q_i||^2`` is a row constant and is dropped (the blog's
``2 gamma q.k - gamma ||k||^2`` form); the softmax-free variant keeps it (``qnorm``), folded into the row statistics.
"""

from __future__ import annotations

import torch

from .attention_distance_triton import distance_attention, distance_reason
from .attention_utils import MaskArgs


def _per_head(value, heads: int, device) -> torch.Tensor:
    """A float or a tensor ``[H]`` as a float32 tensor ``[H]`` (differentiable)."""
    if isinstance(value, torch.Tensor):
        return value.float()
    return torch.full((heads,), float(value), device=device, dtype=torch.float32)


def rbf_attention_triton(q, k, v, gamma, normalize: bool, mask: MaskArgs) -> torch.Tensor:
    """Fused RBF attention; same arguments and result as ``rbf_attention_naive``."""
    g = _per_head(gamma, q.shape[1], q.device)
    return distance_attention(
        q,
        k,
        v,
        None,
        None,
        None,
        2.0 * g,
        -g,
        mask,
        normalize=normalize,
        qnorm=not normalize,
        knorm=True,
        kv_same=False,
        eps=0.0,
    )


def rbf_triton_reason(q, k, v, gamma, normalize, mask) -> str | None:
    """None when ``rbf_attention_triton`` can serve the call, else why not."""
    return distance_reason((q, k, v), (("head dim D", q.shape[-1]), ("value dim Dv", v.shape[-1])))
