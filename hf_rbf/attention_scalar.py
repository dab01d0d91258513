"""Scalar sort attention: a Gaussian kernel on one scalar query and key per head, with grouped values.

``w_ij`` proportional to ``exp(-(qs_i - ks_j)^2 / tau + log w_j)``; head ``h`` reads value group ``h // (H // G)``.
"""

from __future__ import annotations

import torch

from .attention_flex_utils import flex_reason, key_bias, per_query, run_flex, zero_rows_without_live_keys
from .attention_scalar_triton import scalar_attention_triton, scalar_triton_reason
from .attention_sdpa_utils import ScoreFeatures, padded_sdpa, sdpa_reason
from .attention_utils import (
    MaskArgs,
    allowed_mask,
    autocast_inputs,
    check_dim,
    check_return_weights,
    check_same,
    check_tensor,
    choose_backend,
    choose_weights_backend,
    compute_dtype,
    expand_value_groups,
    flex_auto_reason,
    masked_kernel_average,
    normalize_mask_args,
    per_query_param,
)
from .kernels_common import DECODE_ROWS, auto_order

OP = "scalar_attention"


def scalar_scores(qs: torch.Tensor, ks: torch.Tensor, tau, ct: torch.dtype) -> torch.Tensor:
    """``-(qs_i - ks_j)^2 / tau`` in dtype ``ct``; ``tau`` is a float or ``[B|1, H|1, Nq|1]``."""
    diff = qs.to(ct).unsqueeze(-1) - ks.to(ct).unsqueeze(-2)
    inv_tau = 1.0 / tau if isinstance(tau, float) else (1.0 / tau.to(ct)).unsqueeze(-1)
    return -(diff * diff) * inv_tau


def scalar_attention_naive(qs, ks, v, tau, mask: MaskArgs, return_weights: bool = False):
    """Materialised reference (float32, or float64 for float64 inputs).

    With ``return_weights`` returns ``(out, weights [B, H, Nq, Nk])`` (see :func:`scalar_attention`)."""
    ct = compute_dtype(v.dtype)
    scores = scalar_scores(qs, ks, tau, ct)
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.to(ct).unsqueeze(-2)
    values = expand_value_groups(v.to(ct), qs.shape[1])
    if return_weights:
        out, weights = masked_kernel_average(scores, values, allowed_mask(mask, v.device), return_weights=True)
        return out.to(v.dtype), weights.to(v.dtype)
    out = masked_kernel_average(scores, values, allowed_mask(mask, v.device))
    return out.to(v.dtype)


# Without a window and from this many keys, the padding trick into SDPA-flash runs the scalar score faster than our
# rank-1 Triton kernel; below it Triton wins.  H200, bf16 causal H16 D64, B = 32768 / N, fwd+bwd ms (Triton / SDPA):
# 0.90 / 2.01 at N 256, 1.13 / 2.72 at 1024, 1.80 / 2.72 at 2048, 3.19 / 3.09 at 4096, 5.94 / 5.00 at 8192
# (benchmarks/results/h200x4-2026-11-26b/).  Triton also needs 0.15x SDPA's memory there.  With a window SDPA needs a
# dense mask and Triton wins at every length.
SCALAR_SDPA_MIN_KEYS = 8192


def _candidates(qs, ks, v, tau, mask, backend):
    """Backends in order of preference for "auto" (fastest first), each with the reason it cannot serve (None
    when it can), worked out only when ``choose_backend`` reaches it."""
    candidates = {
        "triton": (scalar_attention_triton, lambda: scalar_triton_reason(qs, ks, v, tau, mask)),
        "sdpa": (scalar_attention_sdpa, lambda: scalar_sdpa_reason(mask)),
        "flex": (
            scalar_attention_flex,
            lambda: flex_auto_reason(v.device, backend) or scalar_flex_reason(qs, ks, v, tau, mask),
        ),
        "naive": (scalar_attention_naive, None),
    }
    if mask.window is None and mask.nk >= SCALAR_SDPA_MIN_KEYS and mask.nq > DECODE_ROWS:
        # training-sized calls only: a decode step takes the split-K decode kernel (through "triton") at every length
        candidates = {name: candidates[name] for name in ("sdpa", "triton", "flex", "naive")}
    return auto_order(candidates, v.device, mask.nq)


def check_grouped_values(op: str, v: torch.Tensor, batch: int, heads: int, nk: int) -> None:
    check_dim(op, "v", v, 0, batch, "batch size")
    check_dim(op, "v", v, 2, nk, "key length")
    groups = v.shape[1]
    if groups < 1 or heads % groups != 0:
        raise ValueError(
            f"{op}: `v` has {groups} value groups (shape {tuple(v.shape)}); the number of groups G must divide "
            f"the number of heads H = {heads}"
        )


def scalar_attention(
    qs: torch.Tensor,
    ks: torch.Tensor,
    v: torch.Tensor,
    tau,
    *,
    causal: bool = True,
    window: int | None = None,
    key_log_weights: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    num_prefix_keys: int = 0,
    backend: str = "auto",
    return_weights: bool = False,
    prefix_values: torch.Tensor | None = None,
):
    """Scalar Gaussian-kernel attention.

    Args:
        qs: scalar queries ``[B, H, Nq]``.
        ks: scalar keys ``[B, H, Nk]``.
        v: grouped values ``[B, G, Nk, Dv]`` with G dividing H.
        tau: temperature: a positive float (global), a tensor ``[H]`` (per head) or a tensor broadcastable to
            ``[B, H, Nq]`` (per query token); tensors may require grad.  A float is checked; a tensor's values are
            not (that would synchronise with the device), and a non-positive entry gives undefined results.
        causal, window, key_log_weights, attention_mask, num_prefix_keys: the shared mask arguments (see
            :mod:`hf_rbf.attention_utils`).
        backend: "auto", "naive", "sdpa", "flex" or "triton".
        return_weights: also return the attention weights, computed by the materialised reference: ``backend`` must
            be "auto" (which then serves with "naive") or "naive".
        prefix_values: ``R`` values ``[B or 1, G, R, Dv]`` in front of ``v`` (a sink, register tokens) as a separate
            tensor: the result is that of ``v = torch.cat([prefix_values.expand(B, ...), v], 2)`` with
            ``num_prefix_keys=R`` (0 or R); ``ks`` and the mask arguments then cover all ``R + Nk`` keys.  The
            split-K decode kernel reads them in place (no copy of the cached values per decode step); the other
            paths concatenate.

    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``v``; with ``return_weights`` ``(out, weights)``, ``weights``
        ``[B, H, Nq, Nk]`` (the softmax weights, 0 on disallowed keys) in the same dtype, so that head ``h``'s output
        is ``weights[:, h] @ v[:, h // (H // G)]``.
    """
    check_return_weights(OP, return_weights, backend)
    check_tensor(OP, "qs", qs, 3, "[B, H, Nq]")
    check_tensor(OP, "ks", ks, 3, "[B, H, Nk]")
    check_tensor(OP, "v", v, 4, "[B, G, Nk, Dv]")
    qs, ks, v, prefix_values = autocast_inputs(qs, ks, v, prefix_values)
    check_same(OP, {"qs": qs, "ks": ks, "v": v})
    b, h, nq = qs.shape
    nk = ks.shape[2]
    check_dim(OP, "ks", ks, 0, b, "batch size")
    check_dim(OP, "ks", ks, 1, h, "head count")
    if prefix_values is not None:
        num_prefix_keys = _check_prefix_values(v, prefix_values, num_prefix_keys, b)
    check_grouped_values(OP, v, b, h, nk - (0 if prefix_values is None else num_prefix_keys))
    tau = per_query_param(OP, "tau", tau, b, h, nq, qs.device)
    mask = normalize_mask_args(
        OP,
        batch=b,
        heads=h,
        nq=nq,
        nk=nk,
        device=qs.device,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        key_log_weights=key_log_weights,
        attention_mask=attention_mask,
    )
    if return_weights:
        choose_weights_backend(OP, backend, qs.device)
        if prefix_values is not None:
            v = torch.cat([prefix_values.expand(b, -1, -1, -1), v], dim=2)
        return scalar_attention_naive(qs, ks, v, tau, mask, return_weights=True)
    _, fn = choose_backend(OP, backend, qs.device, _candidates(qs, ks, v, tau, mask, backend))
    if prefix_values is None:
        return fn(qs, ks, v, tau, mask)
    if fn is scalar_attention_triton:
        return scalar_attention_triton(qs, ks, v, tau, mask, prefix_values=prefix_values)
    return fn(qs, ks, torch.cat([prefix_values.expand(b, -1, -1, -1), v], dim=2), tau, mask)


def _check_prefix_values(v: torch.Tensor, prefix_values: torch.Tensor, num_prefix_keys: int, batch: int) -> int:
    """Validate separate prefix values against ``v``; returns their count ``R``."""
    check_tensor(OP, "prefix_values", prefix_values, 4, "[B or 1, G, R, Dv]")
    check_same(OP, {"v": v, "prefix_values": prefix_values})
    g, r, dv = v.shape[1], prefix_values.shape[2], v.shape[3]
    if prefix_values.shape[0] not in (1, batch) or prefix_values.shape[1] != g or prefix_values.shape[3] != dv:
        raise ValueError(
            f"{OP}: `prefix_values` must have shape [{batch} or 1, {g}, R, {dv}] (as `v` [B, G, Nk, Dv]); got "
            f"{tuple(prefix_values.shape)}"
        )
    if num_prefix_keys not in (0, r):
        raise ValueError(
            f"{OP}: with `prefix_values` the prefix is its R = {r} keys; `num_prefix_keys` must be 0 or {r}, got "
            f"{num_prefix_keys!r}"
        )
    return r


# --------------------------------------------------------------------------------------------------------------------
# the "sdpa" backend (the dimension-padding trick)
# --------------------------------------------------------------------------------------------------------------------
# Scalar sort attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).
#
# The softmax drops the row constant ``-qs_i^2 / tau_i``, leaving ``2 qs_i ks_j / tau_i - ks_j^2 / tau_i + log w_j``:
# ``q' = [2 qs / tau, -1 / tau, 1]`` and ``k' = [ks, ks^2, log w]``.  When ``tau`` does not vary over the queries
# (a float or per head) ``-ks^2 / tau + log w`` is one per-key bias column.  The grouped values are expanded to the
# heads.  Half precision splits the scalar columns in two (see :mod:`hf_rbf.attention_sdpa_utils`).


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


# --------------------------------------------------------------------------------------------------------------------
# the "flex" backend (FlexAttention)
# --------------------------------------------------------------------------------------------------------------------
# Scalar sort attention with FlexAttention.
#
# The score_mod computes ``-(qs_i - ks_j)^2 / tau_i + log w_j`` in float32 from captured tensors (the difference is
# formed before squaring, so large ``qs``/``ks`` lose nothing to cancellation).  There is no vector part: flex is
# given zero queries and keys of width 16 (its smallest tile), whose zero product the score_mod still adds (flex's
# backward expects the score to be used).  The grouped values are expanded to the heads.


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
