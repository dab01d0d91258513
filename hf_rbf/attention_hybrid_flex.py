"""Hybrid attention with FlexAttention: flex's ``(scale q).k`` plus the scalar score_mod of
:mod:`hf_rbf.attention_scalar_flex` (``-(qs_i - ks_j)^2 / tau_i + log w_j`` in float32)."""

from __future__ import annotations

import torch

from .attention_flex_utils import flex_reason, run_flex, zero_rows_without_live_keys
from .attention_scalar_flex import scalar_captured, scalar_score_mod
from .attention_utils import MaskArgs, compute_dtype, expand_value_groups


def hybrid_attention_flex(q, k, v, qs, ks, tau, scale, mask: MaskArgs) -> torch.Tensor:
    """The flex backend of :func:`hf_rbf.hybrid_attention` (arguments already validated)."""
    ct = compute_dtype(q.dtype)
    h = q.shape[1]
    s = scale if isinstance(scale, float) else scale.to(ct).view(1, -1, 1, 1)
    q_scaled = (s * q.to(ct)).to(q.dtype)
    captured = scalar_captured(qs, ks, tau, mask, ct)
    out, _ = run_flex(q_scaled, k, expand_value_groups(v, h), scalar_score_mod, captured, mask, return_lse=False)
    return zero_rows_without_live_keys(out, mask)


def hybrid_flex_reason(q, k, v, qs, ks, tau, scale, mask: MaskArgs) -> str | None:
    """Why :func:`hybrid_attention_flex` cannot serve a call, or None."""
    inputs = {"q": q, "k": k, "v": v, "qs": qs, "ks": ks, "tau": tau, "scale": scale}
    inputs["key_log_weights"] = mask.key_log_weights
    return flex_reason(q.device, mask, inputs, captured_scalars={"qs": qs, "ks": ks, "tau": tau})
