"""Per-token measures (areas, volumes, quadrature weights) -> ``key_log_weights`` for the attention functions.

Why attention needs the measure
-------------------------------
When the tokens are samples of a continuous domain (cells of a sphere grid, patches of a warped image, nodes of an
irregular mesh), the output we actually want is a *continuous* kernel average over the domain,

    out(x) = integral K(x, y) v(y) dmu(y) / integral K(x, y) dmu(y),

with ``K(x, y) = exp(s(x, y))`` the attention kernel and ``mu`` the domain's measure (area on a sphere).  The
attention layer can only see the N tokens, so it evaluates a quadrature of both integrals.  A quadrature rule
replaces ``dmu(y)`` by a weight ``w_j`` per node ``y_j``: ``integral g dmu ~ sum_j w_j g(y_j)``.  Plain softmax
attention uses the *same* weight for every key, which is the right rule only when every token stands for the same
amount of domain.  When the cells differ (on a latitude-longitude grid a cell near a pole is far smaller than one at
the equator), the unweighted sum converges to a *different* integral, one taken against the density of the
sampling points instead of the domain's measure, however fine the grid.  The fix is to put the cell's measure into
the weight of its key:

    alpha_j(x) = w_j exp(s_j) / sum_i w_i exp(s_i) = exp(s_j + log w_j) / sum_i exp(s_i + log w_i).

Three remarks follow from that formula.

* Only ratios matter.  Multiplying every ``w_j`` by one constant cancels between numerator and denominator, so any
  quantity *proportional* to the cell measures will do (``sin(colatitude)`` on an equiangular grid: the grid
  spacings are a common factor).  We normalise the weights to a mean of 1, so that equal cells give log-weights of
  exactly 0 and the weighted attention equals the plain one.  (GKA's ``eps`` in the denominator is the one place
  where the scale is not arbitrary; with mean-1 weights ``eps`` keeps the meaning it has without weights.)
* Why a log: the weight multiplies ``exp(s_j)``, so it enters as an additive bias ``log w_j`` on the score.  An
  additive score bias is what every attention kernel already supports (it is a float attention mask for SDPA, a
  ``score_mod`` for FlexAttention, one extra add in a fused kernel), and it keeps the softmax's max-subtraction
  stable: no separate multiply after the exponential, no underflow of small weights times small kernels.
* A cell of zero measure would give ``log 0 = -inf``.  A small ``eps`` is added to the normalised weight before
  the log so that such a key gets a negligible but finite weight.  (To *exclude* a key, use ``attention_mask``.)

The grids of :mod:`hf_rbf.geometry_sphere` build on :func:`log_weights_from_measure`.
"""

from __future__ import annotations

import torch


DEFAULT_LOG_EPS = 1e-12


def log_weights_from_measure(
    measure,
    *,
    eps: float = DEFAULT_LOG_EPS,
    batch_size: int | None = None,
    dtype: torch.dtype | None = None,
    device=None,
) -> torch.Tensor:
    """Turn per-token measures (areas, volumes, quadrature weights) into ``key_log_weights``.

    Args:
        measure: non-negative per-token measures, any array-like or tensor of shape ``[N]``, ``[B, N]`` or
            ``[B, H, N]``; only ratios along the last axis matter.  Each row (last axis) must have a positive sum.
        eps: added to the mean-normalised weight before the log (``log(w / mean(w) + eps)``); ``>= 0``.  With
            ``eps = 0`` a zero measure gives ``-inf`` (allowed by the attention functions, but not recommended).
        batch_size: for a 1-D ``measure``, expand the result to ``[batch_size, N]``; by default a 1-D measure
            gives ``[1, N]``, which the attention functions broadcast over the batch.
        dtype, device: of the result (default: the input's floating dtype, else float32; the input's device).

    Returns:
        ``key_log_weights`` of shape ``[1, N]`` / ``[batch_size, N]`` (1-D input), ``[B, N]`` or ``[B, H, N]``,
        with ``log w`` normalised so that equal measures give exactly zero.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"log_weights_from_measure: `eps` must be a float >= 0; got {eps!r}")
    if isinstance(measure, torch.Tensor):
        m = measure
    else:
        m = torch.as_tensor(measure)
    if not m.is_floating_point():
        m = m.to(torch.float32)
    if dtype is not None:
        m = m.to(dtype)
    if device is not None:
        m = m.to(device)
    if m.dim() not in (1, 2, 3) or m.shape[-1] == 0:
        raise ValueError(
            f"log_weights_from_measure: `measure` must have shape [N], [B, N] or [B, H, N] with N >= 1; got "
            f"{tuple(m.shape)}"
        )
    if not bool(torch.isfinite(m).all()):
        raise ValueError("log_weights_from_measure: `measure` must be finite")
    if bool((m < 0).any()):
        raise ValueError("log_weights_from_measure: `measure` must be >= 0 (areas, volumes or quadrature weights)")
    mean = m.mean(dim=-1, keepdim=True)
    if bool((mean <= 0).any()):
        raise ValueError("log_weights_from_measure: every row of `measure` needs a positive total")
    out = torch.log(m / mean + eps)
    if out.dim() == 1:
        out = out.unsqueeze(0)
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"log_weights_from_measure: `batch_size` must be a positive int; got {batch_size!r}")
            out = out.expand(batch_size, -1)
    elif batch_size is not None:
        raise ValueError("log_weights_from_measure: `batch_size` only applies to a 1-D `measure` [N]")
    return out
