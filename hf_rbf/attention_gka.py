"""Gaussian Kernel Attention (GKA, arXiv:2605.02144): projection-free kernel smoothing of per-head features.

``K_ij = exp(-||x_i - x_j||^2 / (2 sigma_h^2)) * w_j`` on the allowed pairs, ``W_ij = K_ij / (sum_j' K_ij' + eps)``,
``out_i = sum_j W_ij x_j`` (the paper's equations 3, 4 and 7).  The same features ``x`` are query, key and value.
Because of ``eps`` the weights are not shift-invariant, so the query norm stays in the distance.
"""

from __future__ import annotations

import math
import weakref

import torch

from .attention_distance_triton import distance_attention, distance_reason, inverse_two_variances
from .attention_flex_utils import bias_score_mod, flex_reason, key_bias, run_flex_prepared, zero_rows_without_live_keys
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
    constant_vector,
    flex_auto_reason,
    masked_kernel_average,
    normalize_mask_args,
    parameter_values_keepable,
    per_head_param,
)
from .kernels_common import auto_order

OP = "gka_attention"


def gka_attention_naive(
    query: torch.Tensor,
    x: torch.Tensor,
    log_sigma,
    eps: float,
    mask: MaskArgs,
    return_weights: bool = False,
):
    """Materialised reference (float32, or float64 for float64 inputs).  ``query`` is ``x`` itself without a cache.

    With ``return_weights`` returns ``(out, weights [B, H, Nq, Nk])`` (see :func:`gka_attention`)."""
    ct = compute_dtype(x.dtype)
    qf, xf = query.to(ct), x.to(ct)
    if isinstance(log_sigma, float):
        inv_two_sigma_sq = 0.5 * torch.exp(torch.tensor(-2.0 * log_sigma, dtype=ct, device=x.device))
    else:
        inv_two_sigma_sq = 0.5 * torch.exp(-2.0 * log_sigma.to(ct)).view(1, -1, 1, 1)
    q_sq = (qf * qf).sum(-1).unsqueeze(-1)
    x_sq = (xf * xf).sum(-1).unsqueeze(-2)
    dist_sq = (q_sq + x_sq - 2.0 * (qf @ xf.transpose(-1, -2))).clamp_min(0.0)
    scores = -dist_sq * inv_two_sigma_sq
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.to(ct).unsqueeze(-2)
    if return_weights:
        out, weights = masked_kernel_average(
            scores, xf, allowed_mask(mask, x.device), normalize=True, eps=eps, return_weights=True
        )
        return out.to(x.dtype), weights.to(x.dtype)
    out = masked_kernel_average(scores, xf, allowed_mask(mask, x.device), normalize=True, eps=eps)
    return out.to(x.dtype)


def _candidates(query, x, log_sigma, eps, mask, backend):
    """Backends in order of preference for "auto" (fastest first), each with the reason it cannot serve (None
    when it can), worked out only when ``choose_backend`` reaches it."""
    candidates = {
        "triton": (gka_attention_triton, lambda: gka_triton_reason(query, x, log_sigma, eps, mask)),
        "sdpa": (gka_attention_sdpa, lambda: gka_sdpa_reason(mask)),
        "flex": (
            gka_attention_flex,
            lambda: flex_auto_reason(x.device, backend) or gka_flex_reason(query, x, log_sigma, mask),
        ),
        "naive": (gka_attention_naive, None),
    }
    return auto_order(candidates, x.device, mask.nq)


def gka_attention(
    x: torch.Tensor,
    log_sigma,
    *,
    causal: bool = True,
    window: int | None = None,
    eps: float = 1e-6,
    key_log_weights: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    num_prefix_keys: int = 0,
    query: torch.Tensor | None = None,
    prefix_features: torch.Tensor | None = None,
    backend: str = "auto",
    return_weights: bool = False,
):
    """Gaussian kernel attention.

    Args:
        x: features ``[B, H, N, d]``; query, key and value at once.
        log_sigma: per-head log bandwidth, a tensor ``[H]`` (may require grad) or a float shared by all heads.
        eps: the denominator's epsilon (paper eq. 4); ``>= 0``.
        query: optional separate query features ``[B, H, Nq, d]`` for a KV-cache decode step, where ``x`` then holds
            the cached features (keys and values); the queries are the last ``Nq`` positions of ``x``.
        causal, window, key_log_weights, attention_mask, num_prefix_keys: the shared mask arguments (see
            :mod:`hf_rbf.attention_utils`).
        prefix_features: ``R`` features ``[B or 1, H, R, d]`` (keys and values: register tokens, sinks) in front of
            ``x``, shared by the batch when their batch size is 1: the result is that of ``x = torch.cat(
            [prefix_features.expand(B, -1, -1, -1), x], 2)`` with ``num_prefix_keys=R`` (which must then be 0 or R) and
            ``query`` the features of ``x`` without the prefix (its default), without the copy on the fused backend.
            The mask arguments cover all ``R + N`` keys.
        backend: "auto", "naive", "sdpa", "flex" or "triton".
        return_weights: also return the attention weights, computed by the materialised reference: ``backend`` must
            be "auto" (which then serves with "naive") or "naive".

    Returns:
        ``[B, H, Nq, d]`` in the dtype of ``x``; with ``return_weights`` ``(out, weights)``, ``weights``
        ``[B, H, Nq, Nk]`` in the dtype of ``x``: ``W_ij = K_ij / (sum_j' K_ij' + eps)`` (rows sum to slightly less
        than 1 because of ``eps``), 0 on disallowed keys, so that ``out = weights @ x``.
    """
    check_return_weights(OP, return_weights, backend)
    check_tensor(OP, "x", x, 4, "[B, H, N, d]")
    x, query, prefix_features = autocast_inputs(x, query, prefix_features)
    b, h, nk, d = x.shape
    if prefix_features is not None:
        num_prefix_keys = _check_prefix_features(x, prefix_features, num_prefix_keys)
        nk += num_prefix_keys
    if query is None:
        query = x
    else:
        check_tensor(OP, "query", query, 4, "[B, H, Nq, d]")
        check_same(OP, {"x": x, "query": query})
        check_dim(OP, "query", query, 0, b, "batch size")
        check_dim(OP, "query", query, 1, h, "head count")
        check_dim(OP, "query", query, 3, d, "feature dim")
    nq = query.shape[2]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{OP}: `eps` must be a float >= 0; got {eps!r}")
    log_sigma = per_head_param(OP, "log_sigma", log_sigma, h, x.device, positive=False)
    mask = normalize_mask_args(
        OP,
        batch=b,
        heads=h,
        nq=nq,
        nk=nk,
        device=x.device,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        key_log_weights=key_log_weights,
        attention_mask=attention_mask,
    )
    eps = float(eps)
    if return_weights:
        choose_weights_backend(OP, backend, x.device)
        if prefix_features is not None:
            x = _with_prefix_features(x, prefix_features)
        return gka_attention_naive(query, x, log_sigma, eps, mask, return_weights=True)
    _, fn = choose_backend(OP, backend, x.device, _candidates(query, x, log_sigma, eps, mask, backend))
    if prefix_features is not None:
        if fn is gka_attention_triton:  # the prefix read where it is, no copy of the features
            return gka_attention_triton(query, x, log_sigma, eps, mask, prefix=prefix_features)
        x = _with_prefix_features(x, prefix_features)
    return fn(query, x, log_sigma, eps, mask)


def _check_prefix_features(x: torch.Tensor, prefix: torch.Tensor, num_prefix_keys) -> int:
    """Validate ``prefix_features`` ``[B or 1, H, R, d]`` against ``x``; returns ``R`` (``num_prefix_keys`` must be 0
    or ``R``)."""
    check_tensor(OP, "prefix_features", prefix, 4, "[B or 1, H, R, d]")
    check_same(OP, {"x": x, "prefix_features": prefix})
    b, h, _, d = x.shape
    if prefix.shape[0] not in (1, b) or prefix.shape[1] != h or prefix.shape[3] != d:
        raise ValueError(
            f"{OP}: `prefix_features` must have shape [{b} or 1, {h}, R, {d}] (batch, heads, prefix length, feature "
            f"dim of `x`); got {tuple(prefix.shape)}"
        )
    r = prefix.shape[2]
    if num_prefix_keys not in (0, r):
        raise ValueError(
            f"{OP}: with `prefix_features` the prefix is its R = {r} keys; `num_prefix_keys` must be 0 or {r}, got "
            f"{num_prefix_keys!r}"
        )
    return r


def _with_prefix_features(x: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The prefix concatenated in front of the features (the backends that take no separate prefix)."""
    return torch.cat([prefix.expand(x.shape[0], -1, -1, -1), x], dim=2)


# --------------------------------------------------------------------------------------------------------------------
# the "sdpa" backend (the dimension-padding trick)
# --------------------------------------------------------------------------------------------------------------------
# Gaussian kernel attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).
#
# ``W_ij = K_ij / (sum_j' K_ij' + eps)`` with ``K_ij = exp(-||x_i - x_j||^2 / (2 sigma^2) + log w_j)`` is a softmax
# over the keys plus one dummy key of score ``log eps`` and value 0.  Writing ``s = 1 / sigma^2``::
#
#     q'_i = [s x_i, 1, s ||x_i||^2 / 2 + log eps]      k'_j = [x_j, -s ||x_j||^2 / 2 + log w_j, 0]
#     dummy key k* = [0, 0, 1]                            (value 0)
#
# gives ``q'_i . k'_j = -s ||x_i - x_j||^2 / 2 + log w_j + r_i`` and ``q'_i . k* = log eps + r_i`` with the same row
# shift ``r_i = s ||x_i||^2 / 2`` on both, so the softmax is exactly the paper's ``W``.  With ``eps = 0`` the dummy key
# is dropped and the query norm is a plain row constant.  The scalar columns are split in two for half precision
# (see :mod:`hf_rbf.attention_sdpa_utils`), and ``r_i`` is taken from the query's own key as the kernel computes it
# (:func:`row_shift`), so that a query's own key keeps its exact score next to ``log eps`` at any norm.


def gka_attention_sdpa(query, x, log_sigma, eps: float, mask: MaskArgs) -> torch.Tensor:
    """The sdpa backend of :func:`hf_rbf.gka_attention` (arguments already validated)."""
    ct = compute_dtype(x.dtype)
    b, h, nq, _ = query.shape
    if isinstance(log_sigma, float):
        inv_var = math.exp(-2.0 * log_sigma)
        inv_var4 = inv_var
    else:
        inv_var = torch.exp(-2.0 * log_sigma.to(ct)).view(1, -1, 1)  # [1, H, 1]
        inv_var4 = inv_var.unsqueeze(-1)
    qf = query.to(ct)
    q_scaled = (inv_var4 * qf).to(x.dtype)  # rounded once: the row shift below must use the same q
    features = ScoreFeatures(x.dtype, ct, b, h, nq, mask.nk, x.device)
    features.add_dot(q_scaled, x)
    norm_bias = -0.5 * inv_var * x.to(ct).square().sum(-1)
    bias = norm_bias if mask.key_log_weights is None else norm_bias + mask.key_log_weights.to(ct)
    features.add_key_bias(bias)
    if eps > 0:
        features.add_dummy_key(row_shift(q_scaled, qf, x, norm_bias, inv_var, ct) + math.log(eps))
    return padded_sdpa(features, x, mask)


def row_shift(q_scaled, qf, x, norm_bias, inv_var, ct) -> torch.Tensor:
    """The row shift ``r_i = s ||x_i||^2 / 2`` of the scores, computed the way the kernel sees it.

    For any key ``j``, ``r_i = q'_i . x_j - s ||x_j||^2 / 2 + s ||q_i - x_j||^2 / 2`` exactly.  Taking for ``j`` the
    query's own position (``Nk - Nq + i``) and the *rounded* ``q'`` that the kernel uses, the query's own key gets
    exactly its true score ``-s ||q_i - x_j||^2 / 2`` (0 in self-attention) next to the dummy key's ``log eps``:
    computing ``r_i`` from ``||q_i||^2`` instead would leave the kernel's rounding of ``q' . x_j`` (large for large
    norms in half precision) in the balance between the kernel and ``eps``.
    """
    nq, nk = qf.shape[2], x.shape[2]
    own = (torch.arange(nq, device=x.device) + (nk - nq)).clamp(0, nk - 1)
    x_own = x.to(ct).index_select(2, own)  # [B, H, Nq, d]
    dot = (q_scaled.to(ct) * x_own).sum(-1)
    dist = 0.5 * inv_var * (qf - x_own).square().sum(-1)
    return dot + norm_bias.index_select(-1, own) + dist


def gka_sdpa_reason(mask: MaskArgs) -> str | None:
    """Why :func:`gka_attention_sdpa` cannot serve a call, or None."""
    return sdpa_reason(mask)


# --------------------------------------------------------------------------------------------------------------------
# the "flex" backend (FlexAttention)
# --------------------------------------------------------------------------------------------------------------------
# Gaussian kernel attention with FlexAttention.
#
# With ``s = 1 / sigma^2``: ``q' = s x_i`` (or the separate ``query``), ``k' = x_j`` and the score_mod adds the
# per-key bias ``-s ||x_j||^2 / 2 + log w_j`` (one captured float32 tensor, indexed once), so flex computes
# ``O_i = sum_j K_ij x_j / Z_i`` with ``Z_i = sum_j K_ij`` and returns ``lse_i = log Z_i + s ||x_i||^2 / 2`` (that
# row shift is computed as the kernel sees it, see :func:`row_shift` above).
# The paper's ``eps`` then enters exactly: ``sum_j K_ij x_j / (Z_i + eps) = O_i * sigmoid(log Z_i - log eps)``.


def _gka_flex_inputs(query, x, log_sigma, key_log_weights):
    """``(q' = s x_i, the per-key bias -s ||x_j||^2 / 2 + log w_j, the norm part alone, s, query in float32)``, with
    ``s = 1 / sigma^2`` (float32 math, ``q'`` rounded once to ``x``'s dtype)."""
    ct = compute_dtype(x.dtype)
    b, h = x.shape[:2]
    inv_var = torch.exp(-2.0 * log_sigma.to(ct)).reshape(1, -1, 1)  # [1, H|1, 1]
    qf = query.to(ct)
    q_scaled = (inv_var.unsqueeze(-1) * qf).to(x.dtype)
    norm_bias = -0.5 * inv_var * x.to(ct).square().sum(-1)
    bias = norm_bias if key_log_weights is None else norm_bias + key_log_weights.to(ct)
    return q_scaled, key_bias(bias, b, h), norm_bias, inv_var, qf


def _gka_flex_prepare(query, x, v, log_sigma, key_log_weights):
    """Inside the compiled flex call (``run_flex_prepared``): :func:`_gka_flex_inputs`, and as the extra output each
    row's shift :func:`row_shift` (what ``eps > 0`` needs after the call)."""
    q_scaled, bias, norm_bias, inv_var, qf = _gka_flex_inputs(query, x, log_sigma, key_log_weights)
    return q_scaled, x, v, (bias,), row_shift(q_scaled, qf, x, norm_bias, inv_var, compute_dtype(x.dtype))


def _gka_flex_prepare_no_eps(query, x, v, log_sigma, key_log_weights):
    """:func:`_gka_flex_prepare` for ``eps = 0``: no row shift."""
    q_scaled, bias = _gka_flex_inputs(query, x, log_sigma, key_log_weights)[:2]
    return q_scaled, x, v, (bias,), None


def gka_attention_flex(query, x, log_sigma, eps: float, mask: MaskArgs) -> torch.Tensor:
    """The flex backend of :func:`hf_rbf.gka_attention` (arguments already validated).  The query scaling, the
    key-norm bias and the row shift run inside the compiled call (:func:`_gka_flex_prepare`), fused there."""
    ct = compute_dtype(x.dtype)
    if not isinstance(log_sigma, torch.Tensor):
        log_sigma = torch.full((), float(log_sigma), device=x.device, dtype=ct)
    out, lse, shift = run_flex_prepared(
        query, x, x, bias_score_mod, (log_sigma, mask.key_log_weights), mask, return_lse=eps > 0,
        prepare=_gka_flex_prepare if eps > 0 else _gka_flex_prepare_no_eps,
    )
    if eps == 0:
        return zero_rows_without_live_keys(out, mask)
    # lse_i = log Z_i + r_i; r_i as the kernel sees it (see row_shift above)
    log_z = lse.to(ct) - shift
    # Z / (Z + eps) = sigmoid(log Z - log eps); 0 for a row without keys (log Z = -inf)
    return (out.to(ct) * torch.sigmoid(log_z - math.log(eps)).unsqueeze(-1)).to(x.dtype)


def gka_flex_reason(query, x, log_sigma, mask: MaskArgs) -> str | None:
    """Why :func:`gka_attention_flex` cannot serve a call, or None."""
    inputs = {"x": x, "query": query, "log_sigma": log_sigma, "key_log_weights": mask.key_log_weights}
    return flex_reason(x.device, mask, inputs)


# --------------------------------------------------------------------------------------------------------------------
# the "triton" backend (the fused kernels)
# --------------------------------------------------------------------------------------------------------------------
# Gaussian kernel attention on the fused Triton kernels (``backend="triton"``).
#
# ``S_ij = -||x_i - x_j||^2 / (2 sigma_h^2) + log w_j`` and ``W_ij = e^S_ij / (sum_j e^S_ij + eps)``: the shared
# distance op with ``a = 1/sigma^2``, ``b = -1/(2 sigma^2)``, the query norm kept (``eps`` breaks shift invariance)
# and ``x`` as key *and* value (``kv_same``: every key tile is read once and serves both products; the backward
# writes one gradient for both roles, and autograd adds the query role's).  ``log_sigma`` gets its gradient through
# ``a`` and ``b``.


# id(log_sigma) -> (a weak reference to it, its data state, 1 / (2 sigma^2)): see `_inverse_two_variances`
_INVERSE_TWO_VARIANCES: dict = {}


def _inverse_two_variances(log_sigma: torch.Tensor) -> torch.Tensor:
    """``1 / (2 sigma_h^2) = 0.5 exp(-2 log_sigma)`` in float32 (``[H]``).  Without gradients and outside
    ``torch.compile`` it is kept per ``log_sigma`` tensor while that tensor keeps its data (the version counter counts
    every in-place write: an optimiser step, ``load_state_dict``): a model passes its parameter, the same at every
    decode step, where the three ops per layer and step computed the same values again.  Only ever read."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not parameter_values_keepable(log_sigma.device):
        return inverse_two_variances(log_sigma)
    state = (log_sigma._version, log_sigma.data_ptr(), log_sigma.dtype, log_sigma.device, tuple(log_sigma.shape))
    kept = _INVERSE_TWO_VARIANCES.get(id(log_sigma))
    if kept is None or kept[0]() is not log_sigma or kept[1] != state:
        if len(_INVERSE_TWO_VARIANCES) >= 256:
            _INVERSE_TWO_VARIANCES.clear()
        c = inverse_two_variances(log_sigma)
        # (a weak reference: the entry neither keeps a deleted model's parameter alive nor outlives it by its id)
        kept = _INVERSE_TWO_VARIANCES[id(log_sigma)] = (weakref.ref(log_sigma), state, c)
    return kept[2]


def gka_attention_triton(query, x, log_sigma, eps: float, mask: MaskArgs, prefix=None) -> torch.Tensor:
    """Fused GKA; same arguments and result as ``gka_attention_naive``; ``prefix``: None or the prefix features
    ``[B or 1, H, R, d]`` in front of ``x`` (read where they are: see ``distance_attention``)."""
    heads = x.shape[1]
    # a learnable bandwidth in training goes in as it is: the fused call forms c and writes log sigma's gradient,
    # with no autograd ops in front of it (distance_attention's `a_log`)
    a_log = isinstance(log_sigma, torch.Tensor) and log_sigma.requires_grad and torch.is_grad_enabled()
    if a_log:
        c = log_sigma
    elif isinstance(log_sigma, torch.Tensor):
        c = _inverse_two_variances(log_sigma)
    else:
        c = inverse_two_variances(constant_vector(float(log_sigma), (heads,), x.device))
    return distance_attention(
        query,
        x,
        x,
        None,
        None,
        None,
        c,
        None,  # the distance form: the kernels use a = 2c, b = -c
        mask,
        normalize=True,
        qnorm=True,
        knorm=True,
        kv_same=True,
        eps=eps,
        prefix=None if prefix is None else (prefix, prefix),
        prefix_checked=True,  # (validated by gka_attention: _check_prefix_features)
        a_log=a_log,
    )


def gka_triton_reason(query, x, log_sigma, eps, mask) -> str | None:
    """None when ``gka_attention_triton`` can serve the call, else why not."""
    return distance_reason((query, x), (("feature dim d", x.shape[-1]),))
