"""Hybrid scalar + dot-product attention: ``w_ij`` proportional to
``exp(scale * q_i.k_j - (qs_i - ks_j)^2 / tau + log w_j)``.

A per-head ``scale`` of 0 gives a pure scalar head; scalar inputs that are zero for a head give a plain dot-product
head, so one call serves the per-head mixes of the hybrid model.
"""

from __future__ import annotations

import math

import torch

from .attention_distance_triton import distance_attention, distance_reason
from .attention_flex_utils import flex_reason, run_flex, zero_rows_without_live_keys
from .attention_scalar import add_scalar_kernel, check_grouped_values, scalar_captured, scalar_score_mod, scalar_scores
from .attention_sdpa_utils import ScoreFeatures, padded_sdpa, sdpa_reason
from .attention_utils import (
    MaskArgs,
    allowed_mask,
    autocast_inputs,
    check_dim,
    check_prefix,
    check_return_weights,
    check_same,
    check_tensor,
    choose_backend,
    choose_weights_backend,
    compute_dtype,
    constant_vector,
    expand_value_groups,
    flex_auto_reason,
    masked_kernel_average,
    normalize_mask_args,
    per_head_param,
    per_query_param,
    with_prefix,
)
from .kernels_common import auto_order

OP = "hybrid_attention"


def hybrid_attention_naive(q, k, v, qs, ks, tau, scale, mask: MaskArgs, return_weights: bool = False):
    """Materialised reference (float32, or float64 for float64 inputs).

    With ``return_weights`` returns ``(out, weights [B, H, Nq, Nk])`` (see :func:`hybrid_attention`)."""
    ct = compute_dtype(q.dtype)
    s = scale if isinstance(scale, float) else scale.to(ct).view(1, -1, 1, 1)
    scores = s * (q.to(ct) @ k.to(ct).transpose(-1, -2)) + scalar_scores(qs, ks, tau, ct)
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.to(ct).unsqueeze(-2)
    values = expand_value_groups(v.to(ct), q.shape[1])
    if return_weights:
        out, weights = masked_kernel_average(scores, values, allowed_mask(mask, q.device), return_weights=True)
        return out.to(q.dtype), weights.to(q.dtype)
    out = masked_kernel_average(scores, values, allowed_mask(mask, q.device))
    return out.to(q.dtype)


def _candidates(q, k, v, qs, ks, tau, scale, mask, backend):
    """Backends in order of preference for "auto" (fastest first), each with the reason it cannot serve (None
    when it can), worked out only when ``choose_backend`` reaches it."""
    candidates = {
        "triton": (hybrid_attention_triton, lambda: hybrid_triton_reason(q, k, v, qs, ks, tau, scale, mask)),
        "sdpa": (hybrid_attention_sdpa, lambda: hybrid_sdpa_reason(mask)),
        "flex": (
            hybrid_attention_flex,
            lambda: flex_auto_reason(q.device, backend) or hybrid_flex_reason(q, k, v, qs, ks, tau, scale, mask),
        ),
        "naive": (hybrid_attention_naive, None),
    }
    return auto_order(candidates, q.device, mask.nq)


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qs: torch.Tensor,
    ks: torch.Tensor,
    tau,
    *,
    scale=None,
    causal: bool = True,
    window: int | None = None,
    key_log_weights: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    num_prefix_keys: int = 0,
    backend: str = "auto",
    return_weights: bool = False,
    prefix_keys: torch.Tensor | None = None,
    prefix_values: torch.Tensor | None = None,
):
    """Hybrid attention: scaled dot product minus the scalar Gaussian penalty.

    Args:
        q: queries ``[B, H, Nq, D]``; k: keys ``[B, H, Nk, D]``.
        v: values ``[B, G, Nk, Dv]`` with G dividing H (G = H for one value head per head).
        qs: scalar queries ``[B, H, Nq]``; ks: scalar keys ``[B, H, Nk]``.
        tau: temperature as in :func:`hf_rbf.scalar_attention` (float, ``[H]`` or broadcastable to ``[B, H, Nq]``).
        scale: dot-product scale; ``None`` means ``1 / sqrt(D)``; a float >= 0 or a per-head tensor ``[H]``.
        causal, window, key_log_weights, attention_mask, num_prefix_keys: the shared mask arguments (see
            :mod:`hf_rbf.attention_utils`).
        backend: "auto", "naive", "sdpa", "flex" or "triton".
        return_weights: also return the attention weights, computed by the materialised reference: ``backend`` must
            be "auto" (which then serves with "naive") or "naive".
        prefix_keys, prefix_values: ``R`` vector keys ``[B or 1, H, R, D]`` and values ``[B or 1, G, R, Dv]`` in front
            of ``k`` / ``v`` (a sink, register tokens), as separate tensors: the result is that of ``k =
            torch.cat([prefix_keys.expand(B, ...), k], 2)`` (``v`` alike) with ``num_prefix_keys=R`` (0 or R).  The
            fused kernels read them in place (no copy of the keys and values per call); the other backends
            concatenate.  ``ks`` and the mask arguments then cover all ``R + Nk`` keys.

    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; with ``return_weights`` ``(out, weights)``, ``weights``
        ``[B, H, Nq, Nk]`` (the softmax weights, 0 on disallowed keys) in the dtype of ``q``, so that head ``h``'s
        output is ``weights[:, h] @ v[:, h // (H // G)]``.
    """
    check_return_weights(OP, return_weights, backend)
    check_tensor(OP, "q", q, 4, "[B, H, Nq, D]")
    check_tensor(OP, "k", k, 4, "[B, H, Nk, D]")
    check_tensor(OP, "v", v, 4, "[B, G, Nk, Dv]")
    check_tensor(OP, "qs", qs, 3, "[B, H, Nq]")
    check_tensor(OP, "ks", ks, 3, "[B, H, Nk]")
    q, k, v, qs, ks, prefix_keys, prefix_values = autocast_inputs(q, k, v, qs, ks, prefix_keys, prefix_values)
    check_same(OP, {"q": q, "k": k, "v": v, "qs": qs, "ks": ks})
    b, h, nq, d = q.shape
    nk = k.shape[2]
    check_dim(OP, "k", k, 0, b, "batch size")
    check_dim(OP, "k", k, 1, h, "head count")
    check_dim(OP, "k", k, 3, d, "head dim")
    check_grouped_values(OP, v, b, h, nk)
    if prefix_keys is not None or prefix_values is not None:
        num_prefix_keys = check_prefix(OP, q, k, v, prefix_keys, prefix_values, num_prefix_keys)
        nk += num_prefix_keys
    for name, t, n in (("qs", qs, nq), ("ks", ks, nk)):
        check_dim(OP, name, t, 0, b, "batch size")
        check_dim(OP, name, t, 1, h, "head count")
        check_dim(OP, name, t, 2, n, "length")
    tau = per_query_param(OP, "tau", tau, b, h, nq, q.device)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale == 0:
        scale = 0.0
    else:
        scale = per_head_param(OP, "scale", 1.0 / math.sqrt(d) if scale is None else scale, h, q.device)
    mask = normalize_mask_args(
        OP,
        batch=b,
        heads=h,
        nq=nq,
        nk=nk,
        device=q.device,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        key_log_weights=key_log_weights,
        attention_mask=attention_mask,
    )
    if return_weights:
        choose_weights_backend(OP, backend, q.device)
        if prefix_keys is not None:
            k, v = with_prefix(k, v, prefix_keys, prefix_values)
        return hybrid_attention_naive(q, k, v, qs, ks, tau, scale, mask, return_weights=True)
    _, fn = choose_backend(OP, backend, q.device, _candidates(q, k, v, qs, ks, tau, scale, mask, backend))
    if prefix_keys is not None:
        if fn is hybrid_attention_triton:
            return hybrid_attention_triton(q, k, v, qs, ks, tau, scale, mask, prefix=(prefix_keys, prefix_values))
        k, v = with_prefix(k, v, prefix_keys, prefix_values)
    return fn(q, k, v, qs, ks, tau, scale, mask)


# --------------------------------------------------------------------------------------------------------------------
# the "sdpa" backend (the dimension-padding trick)
# --------------------------------------------------------------------------------------------------------------------
# Hybrid attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).
#
# ``scale q.k - (qs - ks)^2 / tau + log w`` less its row constant is the dot product of
# ``q' = [scale q, 2 qs / tau, -1 / tau, 1]`` and ``k' = [k, ks, ks^2, log w]`` (see
# the sdpa section of :mod:`hf_rbf.attention_scalar` for the scalar part).  A float ``scale`` of 0 drops the vector part.


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


# --------------------------------------------------------------------------------------------------------------------
# the "flex" backend (FlexAttention)
# --------------------------------------------------------------------------------------------------------------------
# Hybrid attention with FlexAttention: flex's ``(scale q).k`` plus the scalar score_mod of
# the flex section of :mod:`hf_rbf.attention_scalar` (``-(qs_i - ks_j)^2 / tau_i + log w_j`` in float32).


def hybrid_attention_flex(q, k, v, qs, ks, tau, scale, mask: MaskArgs) -> torch.Tensor:
    """The flex backend of :func:`hf_rbf.hybrid_attention` (arguments already validated)."""
    ct = compute_dtype(q.dtype)
    h = q.shape[1]
    s = scale if isinstance(scale, float) else scale.to(ct).view(1, -1, 1, 1)
    q_scaled = (s * q).to(q.dtype)  # float32 math by type promotion (a float: opmath), no float32 copy of q
    captured = scalar_captured(qs, ks, tau, mask, ct)
    out, _ = run_flex(q_scaled, k, expand_value_groups(v, h), scalar_score_mod, captured, mask, return_lse=False)
    return zero_rows_without_live_keys(out, mask)


def hybrid_flex_reason(q, k, v, qs, ks, tau, scale, mask: MaskArgs) -> str | None:
    """Why :func:`hybrid_attention_flex` cannot serve a call, or None."""
    inputs = {"q": q, "k": k, "v": v, "qs": qs, "ks": ks, "tau": tau, "scale": scale}
    inputs["key_log_weights"] = mask.key_log_weights
    return flex_reason(q.device, mask, inputs, captured_scalars={"qs": qs, "ks": ks, "tau": tau})


# --------------------------------------------------------------------------------------------------------------------
# the "triton" backend (the fused kernels)
# --------------------------------------------------------------------------------------------------------------------
# Hybrid scalar + dot-product attention on the fused Triton kernels (``backend="triton"``).
#
# ``S_ij = scale_h q_i.k_j - (qs_i - ks_j)^2 / tau_i + log w_j``: the shared distance op with ``a = scale``, ``b = 0``
# and the scalar term with ``beta = 1 / tau`` (formed per row inside the kernels from ``tau``: ``tau_in``) evaluated
# per score element in fp32 (the exact difference, not an expanded product, so large scalar keys lose no precision).
# Grouped values ``[B, G, Nk, Dv]`` are indexed by group in the forward and their gradient is summed over the group's
# heads inside the dK/dV program.


def hybrid_attention_triton(q, k, v, qs, ks, tau, scale, mask: MaskArgs, prefix=None) -> torch.Tensor:
    """Fused hybrid attention; same arguments and result as ``hybrid_attention_naive`` (``prefix``: the separate
    ``(prefix_keys, prefix_values)`` of :func:`hf_rbf.hybrid_attention`, read in place)."""
    if isinstance(scale, torch.Tensor):
        a = scale.float()
    else:
        a = constant_vector(float(scale), (q.shape[1],), q.device)
    # tau as it is (the kernels take 1 / tau per row and write tau's gradient: no reciprocal op and backward per call)
    tau_t = tau.float() if isinstance(tau, torch.Tensor) else constant_vector(float(tau), (1, 1, 1), q.device)
    return distance_attention(
        q,
        k,
        v,
        qs,
        ks,
        tau_t,
        a,
        a if not a.requires_grad else a.detach(),  # b: unread without norm terms (qnorm = knorm = False)
        mask,
        normalize=True,
        qnorm=False,
        knorm=False,
        kv_same=False,
        eps=0.0,
        prefix=prefix,
        tau_in=True,
        prefix_checked=True,  # (validated by hybrid_attention: check_prefix)
    )


def hybrid_triton_reason(q, k, v, qs, ks, tau, scale, mask) -> str | None:
    """None when ``hybrid_attention_triton`` can serve the call, else why not."""
    return distance_reason((q, k, v), (("head dim D", q.shape[-1]), ("value dim Dv", v.shape[-1])))
