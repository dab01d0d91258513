"""RBF attention: weights proportional to ``exp(-gamma * ||q_i - k_j||^2 + log w_j)``.

Public entry point :func:`rbf_attention` and its plain PyTorch reference :func:`rbf_attention_naive`.
With ``normalize=True`` (softmax) the query norm is a per-row constant and drops out, leaving the score
``2 * gamma * q.k - gamma * ||k||^2`` (the blog's "regularised key norm" form).  With ``normalize=False`` (the
blog's softmax-free variant) ``out_i = sum_j exp(-gamma * ||q_i - k_j||^2 + log w_j) v_j``: the query norm stays.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .attention_distance_triton import distance_attention, distance_reason
from .attention_flex_utils import bias_score_mod, flex_reason, key_bias, run_flex_prepared, zero_rows_without_live_keys
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
    flex_auto_reason,
    masked_kernel_average,
    normalize_mask_args,
    per_head_param,
    with_prefix,
)
from .kernels_common import auto_order

OP = "rbf_attention"


def rbf_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma,
    normalize: bool,
    mask: MaskArgs,
    return_weights: bool = False,
):
    """Materialised reference: float32 math (float64 for float64 inputs), any mask, any head dim.

    With ``return_weights`` returns ``(out, weights [B, H, Nq, Nk])`` (see :func:`rbf_attention`)."""
    ct = compute_dtype(q.dtype)
    qf, kf, vf = q.to(ct), k.to(ct), v.to(ct)
    g = gamma if isinstance(gamma, float) else gamma.to(ct).view(1, -1, 1, 1)
    k_sq = (kf * kf).sum(-1).unsqueeze(-2)  # [B, H, 1, Nk]
    qk = qf @ kf.transpose(-1, -2)
    if normalize:
        scores = g * (2.0 * qk - k_sq)  # -gamma*||q||^2 is a row constant: dropped
    else:
        q_sq = (qf * qf).sum(-1).unsqueeze(-1)
        scores = -g * (q_sq + k_sq - 2.0 * qk).clamp_min(0.0)
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.to(ct).unsqueeze(-2)
    if return_weights:
        out, weights = masked_kernel_average(
            scores, vf, allowed_mask(mask, q.device), normalize=normalize, return_weights=True
        )
        return out.to(q.dtype), weights.to(q.dtype)
    out = masked_kernel_average(scores, vf, allowed_mask(mask, q.device), normalize=normalize)
    return out.to(q.dtype)


def _candidates(q, k, v, gamma, normalize, mask, backend):
    """Backends in order of preference for "auto" (fastest first), each with the reason it cannot serve (None
    when it can), worked out only when ``choose_backend`` reaches it."""
    candidates = {
        "triton": (rbf_attention_triton, lambda: rbf_triton_reason(q, k, v, gamma, normalize, mask)),
        "sdpa": (rbf_attention_sdpa, lambda: rbf_sdpa_reason(q, normalize, mask)),
        "flex": (
            rbf_attention_flex,
            lambda: flex_auto_reason(q.device, backend) or rbf_flex_reason(q, k, v, gamma, mask),
        ),
        "naive": (rbf_attention_naive, None),
    }
    return auto_order(candidates, q.device, mask.nq)


def rbf_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    gamma=None,
    causal: bool = True,
    window: int | None = None,
    normalize: bool = True,
    key_log_weights: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    num_prefix_keys: int = 0,
    backend: str = "auto",
    return_weights: bool = False,
    prefix_keys: torch.Tensor | None = None,
    prefix_values: torch.Tensor | None = None,
):
    """Scaled RBF attention.

    Args:
        q: queries ``[B, H, Nq, D]``.
        k: keys ``[B, H, Nk, D]``.
        v: values ``[B, H, Nk, Dv]``.
        gamma: kernel scale; ``None`` means ``1 / sqrt(D)``; a positive float or a per-head tensor ``[H]``
            (may require grad).
        causal, window, key_log_weights, attention_mask, num_prefix_keys: the shared mask arguments (see
            :mod:`hf_rbf.attention_utils`).
        normalize: softmax over the allowed keys (True) or the softmax-free sum (False).
        backend: "auto", "naive", "sdpa", "flex" or "triton".
        return_weights: also return the attention weights, computed by the materialised reference: ``backend`` must
            be "auto" (which then serves with "naive") or "naive".
        prefix_keys, prefix_values: ``R`` keys ``[B or 1, H, R, D]`` and values ``[B or 1, H, R, Dv]`` in front of
            ``k`` / ``v`` and visible to every query (register tokens; a batch of 1 is shared by the whole batch):
            the result is that of ``k = torch.cat([prefix_keys.expand(B, -1, -1, -1), k], 2)`` (``v`` alike) with
            ``num_prefix_keys=R``, which must then be 0 or R.  The mask arguments cover all ``R + Nk`` keys.  The
            "triton" backend reads them through their own pointers (no copy of ``k`` / ``v`` per call, and their
            gradients come summed over the batch); the other backends concatenate.

    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; with ``return_weights`` ``(out, weights)``, ``weights``
        ``[B, H, Nq, Nk]`` in the dtype of ``q``: the softmax weights (``normalize=True``) or the unnormalised kernel
        weights ``exp(score)`` (``normalize=False``), 0 on disallowed keys, so that ``out = weights @ v``.
    """
    check_return_weights(OP, return_weights, backend)
    check_tensor(OP, "q", q, 4, "[B, H, Nq, D]")
    check_tensor(OP, "k", k, 4, "[B, H, Nk, D]")
    check_tensor(OP, "v", v, 4, "[B, H, Nk, Dv]")
    q, k, v, prefix_keys, prefix_values = autocast_inputs(q, k, v, prefix_keys, prefix_values)
    check_same(OP, {"q": q, "k": k, "v": v})
    b, h, nq, d = q.shape
    nk = k.shape[2]
    check_dim(OP, "k", k, 0, b, "batch size")
    check_dim(OP, "v", v, 0, b, "batch size")
    check_dim(OP, "k", k, 1, h, "head count")
    check_dim(OP, "v", v, 1, h, "head count")
    check_dim(OP, "k", k, 3, d, "head dim")
    check_dim(OP, "v", v, 2, nk, "key length")
    if prefix_keys is not None or prefix_values is not None:
        num_prefix_keys = check_prefix(OP, q, k, v, prefix_keys, prefix_values, num_prefix_keys)
        nk += num_prefix_keys
    if not isinstance(normalize, bool):
        raise TypeError(f"{OP}: `normalize` must be True or False; got {normalize!r}")
    gamma = per_head_param(OP, "gamma", 1.0 / math.sqrt(d) if gamma is None else gamma, h, q.device)
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
        return rbf_attention_naive(q, k, v, gamma, normalize, mask, return_weights=True)
    _, fn = choose_backend(OP, backend, q.device, _candidates(q, k, v, gamma, normalize, mask, backend))
    if prefix_keys is not None:
        if fn is rbf_attention_triton:
            return rbf_attention_triton(q, k, v, gamma, normalize, mask, prefix=(prefix_keys, prefix_values))
        k, v = with_prefix(k, v, prefix_keys, prefix_values)
    return fn(q, k, v, gamma, normalize, mask)


# --------------------------------------------------------------------------------------------------------------------
# the "sdpa" backend (the dimension-padding trick)
# --------------------------------------------------------------------------------------------------------------------
# RBF attention through ``F.scaled_dot_product_attention`` (the dimension-padding trick).
#
# With softmax the query norm is a row constant, so the score is ``2 gamma q.k - gamma ||k||^2 + log w``:
# ``q' = [2 gamma q, 1]`` and ``k' = [k, -gamma ||k||^2 + log w]`` (the scalar column split in two for half
# precision, see :mod:`hf_rbf.attention_sdpa_utils`).
#
# Softmax-free (``normalize=False``): ``out_i = sum_j exp(-gamma ||q_i - k_j||^2 + log w_j) v_j = A_i``.  A dummy key
# with score ``gamma ||q_i||^2`` and value ``[0, ..., 0, 1]`` next to values ``[v_j, 0]`` makes SDPA return
# ``[A_i, 1] / (Z_i + 1)`` with ``Z_i = sum_j exp(-gamma ||q_i - k_j||^2 + log w_j)``, so ``A_i`` is the ratio of the
# value part and the last column.  Both parts are softmax averages, so neither overflows; the last column is
# ``1 / (1 + Z_i)``, which float16 cannot hold once ``Z_i`` passes about 1.6e4, so float16 is left to other backends.


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


# --------------------------------------------------------------------------------------------------------------------
# the "flex" backend (FlexAttention)
# --------------------------------------------------------------------------------------------------------------------
# RBF attention with FlexAttention.
#
# ``q' = 2 gamma q`` and ``k' = k`` give flex's ``q'.k'``; the score_mod adds the per-key bias
# ``-gamma ||k_j||^2 + log w_j`` (one captured float32 tensor ``[B, H, Nk]``, indexed once, which flex
# differentiates).  The softmax drops the query norm.  Softmax-free (``normalize=False``):
# ``out_i = sum_j exp(s_ij) v_j = softmax_out_i * exp(lse_i - gamma ||q_i||^2)``, from flex's log-sum-exp.


def _rbf_flex_prepare(q, k, v, gamma, key_log_weights):
    """Inside the compiled flex call (``run_flex_prepared``): ``q' = 2 gamma q`` (float32 math on ``q`` as it is,
    rounded once) and the score_mod's per-key bias ``-gamma ||k_j||^2 + log w_j`` (float32, ``[B, H, Nk]``)."""
    ct = compute_dtype(q.dtype)
    b, h = q.shape[:2]
    g = gamma.to(ct).reshape(1, -1, 1)  # [1, H|1, 1]
    q_scaled = (2.0 * g.unsqueeze(-1) * q).to(q.dtype)
    bias = -g * k.to(ct).square().sum(-1)
    if key_log_weights is not None:
        bias = bias + key_log_weights.to(ct)
    return q_scaled, k, v, (key_bias(bias, b, h),), None


def rbf_attention_flex(q, k, v, gamma, normalize: bool, mask: MaskArgs) -> torch.Tensor:
    """The flex backend of :func:`hf_rbf.rbf_attention` (arguments already validated).  The query scaling and the
    key-norm bias run inside the compiled call (:func:`_rbf_flex_prepare`): fused there, where eagerly they were
    about seven passes over ``q`` / ``k`` forward and as many backward (benchmarks/results/h100-2026-11-27j:
    this backend 1.10x FlexAttention used directly)."""
    ct = compute_dtype(q.dtype)
    g = gamma if isinstance(gamma, torch.Tensor) else torch.full((), float(gamma), device=q.device, dtype=ct)
    out, lse, _ = run_flex_prepared(
        q, k, v, bias_score_mod, (g, mask.key_log_weights), mask, return_lse=not normalize, prepare=_rbf_flex_prepare
    )
    if normalize:
        return zero_rows_without_live_keys(out, mask)
    # lse_i = log sum_j exp(s_ij + gamma ||q_i||^2): remove the row shift; exp(-inf) = 0 for empty rows
    log_z = lse.to(ct) - g.to(ct).reshape(1, -1, 1) * q.to(ct).square().sum(-1)
    return (out.to(ct) * torch.exp(log_z).unsqueeze(-1)).to(q.dtype)


def rbf_flex_reason(q, k, v, gamma, mask: MaskArgs) -> str | None:
    """Why :func:`rbf_attention_flex` cannot serve a call, or None."""
    inputs = {"q": q, "k": k, "v": v, "gamma": gamma, "key_log_weights": mask.key_log_weights}
    return flex_reason(q.device, mask, inputs)


# --------------------------------------------------------------------------------------------------------------------
# the "triton" backend (the fused kernels)
# --------------------------------------------------------------------------------------------------------------------
# RBF attention on the fused Triton kernels (``backend="triton"``).
#
# ``S_ij = -gamma_h ||q_i - k_j||^2 + log w_j``: the shared distance op with ``a = 2 gamma`` and ``b = -gamma``, in
# its distance form (``gamma`` itself with ``b = None``: the kernels derive both coefficients and reduce the gradient of
# gamma, so no torch op per call builds ``2 gamma`` / ``-gamma`` or adds their gradients).
# With the softmax (``normalize=True``) ``-gamma ||q_i||^2`` is a row constant and is dropped (the blog's
# ``2 gamma q.k - gamma ||k||^2`` form); the softmax-free variant keeps it (``qnorm``), folded into the row statistics.


def _per_head(value, heads: int, device) -> torch.Tensor:
    """A float or a tensor ``[H]`` as a float32 tensor ``[H]`` (differentiable)."""
    if isinstance(value, torch.Tensor):
        return value.float()
    return constant_vector(float(value), (heads,), device)


def rbf_attention_triton(q, k, v, gamma, normalize: bool, mask: MaskArgs, prefix=None) -> torch.Tensor:
    """Fused RBF attention; same arguments and result as ``rbf_attention_naive``; ``prefix``: None or the prefix
    keys and values as separate tensors (see :func:`rbf_attention`)."""
    g = _per_head(gamma, q.shape[1], q.device)
    return distance_attention(
        q,
        k,
        v,
        None,
        None,
        None,
        g,
        None,
        mask,
        normalize=normalize,
        qnorm=not normalize,
        knorm=True,
        kv_same=False,
        eps=0.0,
        prefix=prefix,
        prefix_checked=True,  # (validated by rbf_attention: check_prefix)
    )


def rbf_triton_reason(q, k, v, gamma, normalize, mask) -> str | None:
    """None when ``rbf_attention_triton`` can serve the call, else why not."""
    return distance_reason((q, k, v), (("head dim D", q.shape[-1]), ("value dim Dv", v.shape[-1])))
