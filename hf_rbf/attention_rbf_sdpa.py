"""RBF attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).

With softmax the query norm is a row constant, so the score is ``2 gamma q.k - gamma ||k||^2 + log w``:
``q' = [2 gamma q, 1]`` and ``k' = [k, -gamma ||k||^2 + log w]`` (the scalar column split in two for half
precision, see :mod:`hf_rbf.attention_sdpa_utils`).

Softmax-free (``normalize=False``): ``out_i = sum_j exp(-gamma ||q_i - k_j||^2 + log w_j) v_j = A_i``.  A dummy key
with score ``gamma ||q_i||^2`` and value ``[0, ..., 0, 1]`` next to values ``[v_j, 0]`` makes SDPA return
``[A_i, 1] / (Z_i + 1)`` with ``Z_i = sum_j exp(-gamma ||q_i - k_j||^2 + log w_j)``, so ``A_i`` is the ratio of the
value part and the last column.  Both parts are softmax averages, so neither overflows; the last column is
``1 / (1 + Z_i)``, which float16 cannot hold once ``Z_i`` passes about 1.6e4, so float16 is left to other backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_sdpa_utils import ScoreFeatures, padded_sdpa, sdpa_reason
from .attention_utils import MaskArgs, compute_dtype


def rbf_attention_sdpa(q, k, v, gamma, normalize: bool, mask: MaskArgs) -> torch.Tensor:
    """The sdpa backend of :func:`hf_rbf.rbf_attention` (arguments already validated)."""
    ct = compute_dtype(q.dtype)
    b, h, nq, _ = q.shape
    g = gamma if isinstance(gamma, float) else gamma.to(ct).view(1, -1, 1)  # [1, H, 1]
    qf = q.to(ct)
    features = ScoreFeatures(q.dtype, ct, b, h, nq, mask.nk, q.device)
    features.add_dot(2.0 * (g if isinstance(g, float) else g.unsqueeze(-1)) * qf, k)
    bias = -g * k.to(ct).square().sum(-1)
    if mask.key_log_weights is not None:
        bias = bias + mask.key_log_weights.to(ct)
    features.add_key_bias(bias)
    if normalize:
        return padded_sdpa(features, v, mask)
    dv = v.shape[-1]
    features.add_dummy_key(g * qf.square().sum(-1))
    unit = torch.zeros(dv + 1, dtype=v.dtype, device=v.device)
    unit[dv] = 1.0
    out = padded_sdpa(features, F.pad(v, (0, 1)), mask, dummy_value=unit)
    # out = [A, 1] / (Z + 1): the last column is >= 1 / (1 + Z) > 0, so the division is safe
    return (out[..., :dv].to(ct) / out[..., dv:].to(ct)).to(q.dtype)


def rbf_sdpa_reason(q, normalize: bool, mask: MaskArgs) -> str | None:
    """Why :func:`rbf_attention_sdpa` cannot serve a call, or None."""
    reason = sdpa_reason(mask)
    if reason is None and not normalize and q.dtype == torch.float16:
        reason = (
            "sdpa cannot compute normalize=False exactly in float16 (its normaliser 1 / (1 + sum of weights) "
            "underflows float16); use bfloat16, float32 or another backend"
        )
    return reason
