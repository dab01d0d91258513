"""Scalar sort attention with FlexAttention.

The score_mod computes ``-(qs_i - ks_j)^2 / tau_i + log w_j`` in float32 from captured tensors (the difference is
formed before squaring, so large ``qs``/``ks`` lose nothing to cancellation).  There is no vector part: flex is
given zero queries and keys of width 16 (its smallest tile), whose zero product the score_mod still adds (flex's
backward expects the score to be used).  The grouped values are expanded to the heads.
"""

from __future__ import annotations

import torch

from .attention_flex_utils import flex_reason, key_bias, per_query, run_flex, zero_rows_without_live_keys
from .attention_utils import MaskArgs, compute_dtype, expand_value_groups


def scalar_score_mod(qs, ks, inv_tau, bias):
    """``score - (qs_i - ks_j)^2 * inv_tau_i (+ bias_j)`` from ``[B, H, Nq]``, ``[B, H, Nk]``, ``[B, H, Nq]`` and
    ``[B, H, Nk]`` or None (float32); ``score`` is flex's ``q'.k'`` (zero for scalar, ``scale q.k`` for hybrid)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        diff = qs[b, h, q_idx] - ks[b, h, kv_idx]
        out = score - (diff * diff) * inv_tau[b, h, q_idx]
        if bias is not None:
            out = out + bias[b, h, kv_idx]
        return out

    return score_mod


def scalar_captured(qs, ks, tau, mask: MaskArgs, ct) -> tuple:
    """The tensors :func:`scalar_score_mod` captures; shared with hybrid."""
    b, h, nq = qs.shape
    inv_tau = per_query(1.0 / tau if isinstance(tau, float) else 1.0 / tau.to(ct), b, h, nq, ct, qs.device)
    bias = None if mask.key_log_weights is None else key_bias(mask.key_log_weights.to(ct), b, h)
    return (qs.to(ct).contiguous(), ks.to(ct).contiguous(), inv_tau, bias)


def scalar_attention_flex(qs, ks, v, tau, mask: MaskArgs) -> torch.Tensor:
    """The flex backend of :func:`hf_rbf.scalar_attention` (arguments already validated)."""
    ct = compute_dtype(v.dtype)
    b, h, nq = qs.shape
    zeros_q = torch.zeros(b, h, nq, 16, dtype=v.dtype, device=v.device)
    zeros_k = torch.zeros(b, h, mask.nk, 16, dtype=v.dtype, device=v.device)
    captured = scalar_captured(qs, ks, tau, mask, ct)
    values = expand_value_groups(v, h)
    out, _ = run_flex(zeros_q, zeros_k, values, scalar_score_mod, captured, mask, return_lse=False)
    return zero_rows_without_live_keys(out, mask)


def scalar_flex_reason(qs, ks, v, tau, mask: MaskArgs) -> str | None:
    """Why :func:`scalar_attention_flex` cannot serve a call, or None."""
    inputs = {"qs": qs, "ks": ks, "v": v, "tau": tau, "key_log_weights": mask.key_log_weights}
    return flex_reason(v.device, mask, inputs, captured_scalars={"qs": qs, "ks": ks, "tau": tau})
