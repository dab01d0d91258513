"""The scalar sort gist's regularizers for efficient inference: ``L_align``, ``L_spread`` and ``L_tau``.

Each function returns ``(sum, count)`` so that a model can average over valid tokens and heads first and over layers
second; :class:`~hf_rbf.ScalarSortForCausalLM` adds ``weight * mean`` to the loss and reports the means.

``L_align`` (attention-weighted scalar distance)
    Per query row ``i`` of a scalar head: ``sum_j sg(w_ij) (qs_i - ks_j)^2`` over the keys it attends to (prefix
    included), ``w`` the layer's attention weights (combined weights for hybrid heads), ``sg`` the stop-gradient;
    ``L_align`` is the mean over valid query rows and scalar heads.  (The gist's ``(w * sq_dist).mean()`` over a
    ``[B, H, T, T]`` tensor is this divided by ``T``: we keep the per-row expectation so the value does not shrink
    with the context length.)  Expanding the square,
    ``sum_j w_ij (qs_i - ks_j)^2 = qs_i^2 - 2 qs_i E_w[ks] + E_w[ks^2]``: the two moments are *attention outputs* with
    the values ``(ks_j, ks_j^2)``.  So ``L_align`` is one more call of the layer's own attention function with
    detached scores and those two value channels (:func:`align_moment_values`, :func:`align_rows`): whatever backend
    computes the attention (a fused kernel included) accumulates it in one pass, and no ``N x N`` matrix is ever
    materialised beyond what that backend itself does.  The gradient reaches the scalar projections only: the layer
    computes ``qs`` / ``ks`` for it from the *detached* layer input, the weights come from detached scores, and the
    moments carry gradient through their values alone.

``L_spread`` (key spread)
    Per sequence and scalar head, the valid keys sorted (the order detached, the values not) against uniform quantile
    targets ``linspace(a, b, n)``: the mean of ``(ks_sorted - target)^2`` over valid tokens and scalar heads.  The
    range is fixed ``[a, b]`` or adaptive, ``mean(ks) +- width * std(ks)`` per sequence and head (detached).

``L_tau`` (bandwidth)
    ``sum_h log(1 + tau_h)`` over the scalar heads, averaged over valid tokens for per-token temperatures.
"""

from __future__ import annotations

import torch


def align_moment_values(scalar_keys: torch.Tensor) -> torch.Tensor:
    """``[B, H, Nk]`` -> ``[B, H, Nk, 2]`` the value channels ``(ks, ks^2)`` whose attention outputs are the moments
    ``E_w[ks]`` and ``E_w[ks^2]`` (one value group per head)."""
    return torch.stack([scalar_keys, scalar_keys * scalar_keys], dim=-1)


def align_rows(scalar_queries: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """``sum_j w_ij (qs_i - ks_j)^2 = qs^2 - 2 qs E_w[ks] + E_w[ks^2]``: ``[B, H, N]`` from ``qs [B, H, N]`` and the
    moments ``[B, H, N, 2]``.  Clamped at 0 against rounding."""
    qs = scalar_queries
    return (qs * qs - 2.0 * qs * moments[..., 0] + moments[..., 1]).clamp_min(0.0)


def align_rows_reference(
    scalar_queries: torch.Tensor, scalar_keys: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The gist's materialised form per row: ``sum_j w_ij (qs_i - ks_j)^2`` with ``weights [B, H, N, Nk]``
    (detached here), ``qs [B, H, N]``, ``ks [B, H, Nk]``."""
    sq = (scalar_queries.unsqueeze(-1) - scalar_keys.unsqueeze(-2)) ** 2
    return (weights.detach() * sq).sum(-1)


def masked_sum(values: torch.Tensor, valid: torch.Tensor | None, head_mask: torch.Tensor | None):
    """``(sum, count)`` of ``values [B, H, N]`` over valid tokens ``[B, N]`` and heads ``[H]``."""
    b, h, n = values.shape
    mask = torch.ones(b, h, n, dtype=torch.bool, device=values.device)
    if valid is not None:
        mask = mask & valid.to(torch.bool).unsqueeze(1)
    if head_mask is not None:
        mask = mask & head_mask.to(torch.bool).view(1, h, 1)
    return values.masked_fill(~mask, 0.0).sum(), mask.sum()


def spread_loss(
    scalar_keys: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    value_range,
    adaptive_width: float = 3.0,
    head_mask: torch.Tensor | None = None,
):
    """``L_spread``: ``(sum, count)`` of ``(sort(ks) - linspace(a, b, n))^2`` per sequence and head.

    Args:
        scalar_keys: ``[B, H, N]`` keys (gradient flows through the values; the sort order is detached).
        valid: ``[B, N]`` real tokens (padding excluded from the sort and the count).
        value_range: ``(a, b)`` or ``"adaptive"`` (``mean +- adaptive_width * std`` per sequence and head, detached).
        head_mask: ``[H]`` heads to include.
    """
    b, h, n = scalar_keys.shape
    ks = scalar_keys.to(torch.promote_types(scalar_keys.dtype, torch.float32))
    if valid is None:
        valid = torch.ones(b, n, dtype=torch.bool, device=ks.device)
    valid = valid.to(torch.bool)
    count = valid.sum(-1).view(b, 1, 1).to(ks.dtype)  # tokens per sequence
    order = torch.sort(ks.detach().masked_fill(~valid.unsqueeze(1), float("inf")), dim=-1).indices
    ks_sorted = ks.gather(-1, order)
    j = torch.arange(n, device=ks.device, dtype=ks.dtype).view(1, 1, n)
    frac = j / (count - 1).clamp_min(1.0)
    if isinstance(value_range, str):
        if value_range != "adaptive":
            raise ValueError(f"spread_loss: `value_range` must be a pair (a, b) or 'adaptive'; got {value_range!r}")
        kd = ks.detach().masked_fill(~valid.unsqueeze(1), 0.0)
        mean = kd.sum(-1, keepdim=True) / count.clamp_min(1.0)
        var = ((kd - mean) ** 2).masked_fill(~valid.unsqueeze(1), 0.0).sum(-1, keepdim=True) / count.clamp_min(1.0)
        std = var.sqrt()
        lo, hi = mean - adaptive_width * std, mean + adaptive_width * std
    else:
        lo, hi = float(value_range[0]), float(value_range[1])
    targets = lo + (hi - lo) * frac
    mask = (j < count).expand(b, h, n)  # the first `count` sorted entries are the valid keys
    if head_mask is not None:
        mask = mask & head_mask.to(torch.bool).view(1, h, 1)
    err = ((ks_sorted - targets) ** 2).masked_fill(~mask, 0.0)
    return err.sum(), mask.sum()


def tau_loss(tau: torch.Tensor, valid: torch.Tensor | None = None, head_mask: torch.Tensor | None = None):
    """``L_tau``: ``(sum, count)`` of ``sum_h log(1 + tau_h)``: ``tau [H]`` (count 1) or per token ``[B, H, N]``
    (summed over heads, counted over valid tokens)."""
    t = tau.to(torch.promote_types(tau.dtype, torch.float32))
    if t.dim() == 1:
        if head_mask is not None:
            t = t[head_mask.to(torch.bool)]
        return torch.log1p(t).sum(), torch.tensor(1, device=t.device)
    per_token = torch.log1p(t)
    if head_mask is not None:
        per_token = per_token.masked_fill(~head_mask.to(torch.bool).view(1, -1, 1), 0.0)
    per_token = per_token.sum(1)  # [B, N]
    if valid is None:
        return per_token.sum(), torch.tensor(per_token.numel(), device=t.device)
    valid = valid.to(torch.bool)
    return per_token.masked_fill(~valid, 0.0).sum(), valid.sum()


__all__ = ["align_moment_values", "align_rows", "align_rows_reference", "masked_sum", "spread_loss", "tau_loss"]
