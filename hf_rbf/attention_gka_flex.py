"""Gaussian kernel attention with FlexAttention.

With ``s = 1 / sigma^2``: ``q' = s x_i`` (or the separate ``query``), ``k' = x_j`` and the score_mod adds the
per-key bias ``-s ||x_j||^2 / 2 + log w_j`` (one captured float32 tensor, indexed once), so flex computes
``O_i = sum_j K_ij x_j / Z_i`` with ``Z_i = sum_j K_ij`` and returns ``lse_i = log Z_i + s ||x_i||^2 / 2`` (that
row shift is computed as the kernel sees it, see :func:`hf_rbf.attention_gka_sdpa.row_shift`).
The paper's ``eps`` then enters exactly: ``sum_j K_ij x_j / (Z_i + eps) = O_i * sigmoid(log Z_i - log eps)``.
"""

from __future__ import annotations

import math

import torch

from .attention_flex_utils import bias_score_mod, flex_reason, key_bias, run_flex, zero_rows_without_live_keys
from .attention_gka_sdpa import row_shift
from .attention_utils import MaskArgs, compute_dtype


def gka_attention_flex(query, x, log_sigma, eps: float, mask: MaskArgs) -> torch.Tensor:
    """The flex backend of :func:`hf_rbf.gka_attention` (arguments already validated)."""
    ct = compute_dtype(x.dtype)
    b, h = x.shape[:2]
    if isinstance(log_sigma, float):
        inv_var = inv_var4 = math.exp(-2.0 * log_sigma)
    else:
        inv_var = torch.exp(-2.0 * log_sigma.to(ct)).view(1, -1, 1)  # [1, H, 1]
        inv_var4 = inv_var.unsqueeze(-1)
    qf = query.to(ct)
    q_scaled = (inv_var4 * qf).to(x.dtype)
    norm_bias = -0.5 * inv_var * x.to(ct).square().sum(-1)
    bias = norm_bias if mask.key_log_weights is None else norm_bias + mask.key_log_weights.to(ct)
    bias = key_bias(bias, b, h)
    out, lse = run_flex(q_scaled, x, x, bias_score_mod, (bias,), mask, return_lse=eps > 0)
    if eps == 0:
        return zero_rows_without_live_keys(out, mask)
    # lse_i = log Z_i + r_i; r_i as the kernel sees it (see attention_gka_sdpa.row_shift)
    log_z = lse.to(ct) - row_shift(q_scaled, qf, x, norm_bias, inv_var, ct)
    # Z / (Z + eps) = sigmoid(log Z - log eps); 0 for a row without keys (log Z = -inf)
    return (out.to(ct) * torch.sigmoid(log_z - math.log(eps)).unsqueeze(-1)).to(x.dtype)


def gka_flex_reason(query, x, log_sigma, mask: MaskArgs) -> str | None:
    """Why :func:`gka_attention_flex` cannot serve a call, or None."""
    inputs = {"x": x, "query": query, "log_sigma": log_sigma, "key_log_weights": mask.key_log_weights}
    return flex_reason(x.device, mask, inputs)
