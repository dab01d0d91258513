"""RBF attention with FlexAttention.

``q' = 2 gamma q`` and ``k' = k`` give flex's ``q'.k'``; the score_mod adds the per-key bias
``-gamma ||k_j||^2 + log w_j`` (one captured float32 tensor ``[B, H, Nk]``, indexed once, which flex
differentiates).  The softmax drops the query norm.  Softmax-free (``normalize=False``):
``out_i = sum_j exp(s_ij) v_j = softmax_out_i * exp(lse_i - gamma ||q_i||^2)``, from flex's log-sum-exp.
"""

from __future__ import annotations

import torch

from .attention_flex_utils import bias_score_mod, flex_reason, key_bias, run_flex, zero_rows_without_live_keys
from .attention_utils import MaskArgs, compute_dtype


def rbf_attention_flex(q, k, v, gamma, normalize: bool, mask: MaskArgs) -> torch.Tensor:
    """The flex backend of :func:`hf_rbf.rbf_attention` (arguments already validated)."""
    ct = compute_dtype(q.dtype)
    b, h = q.shape[:2]
    g = gamma if isinstance(gamma, float) else gamma.to(ct).view(1, -1, 1)  # [1, H, 1]
    qf = q.to(ct)
    q_scaled = (2.0 * (g if isinstance(g, float) else g.unsqueeze(-1)) * qf).to(q.dtype)
    bias = -g * k.to(ct).square().sum(-1)
    if mask.key_log_weights is not None:
        bias = bias + mask.key_log_weights.to(ct)
    bias = key_bias(bias, b, h)
    out, lse = run_flex(q_scaled, k, v, bias_score_mod, (bias,), mask, return_lse=not normalize)
    if normalize:
        return zero_rows_without_live_keys(out, mask)
    # lse_i = log sum_j exp(s_ij + gamma ||q_i||^2): remove the row shift; exp(-inf) = 0 for empty rows
    log_z = lse.to(ct) - g * qf.square().sum(-1)
    return (out.to(ct) * torch.exp(log_z).unsqueeze(-1)).to(q.dtype)


def rbf_flex_reason(q, k, v, gamma, mask: MaskArgs) -> str | None:
    """Why :func:`rbf_attention_flex` cannot serve a call, or None."""
    inputs = {"q": q, "k": k, "v": v, "gamma": gamma, "key_log_weights": mask.key_log_weights}
    return flex_reason(q.device, mask, inputs)
