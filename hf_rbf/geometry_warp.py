"""Warped images: the area of the original plane behind each patch, as attention key weights.

An image is often stored on a grid that samples some original plane unevenly: a fisheye or wide-angle lens packs
the periphery into fewer pixels, a foveated or log-polar resampling spends pixels on the centre, an image resampled
with ``torch.nn.functional.grid_sample`` on a non-uniform grid does whatever its grid says.  If ``T`` maps the
stored image's coordinates ``u`` to the original plane ``x = T(u)``, a patch ``P`` of the stored image stands for
the region ``T(P)`` of the original plane, of area

    |T(P)| = integral_P |det J_T(u)| du,

and attention that should average over the original plane (``integral K(x, y) v(y) dy``) needs those areas as key
weights: plain attention averages against the density of samples, ``1 / |det J_T|``, however fine the grid (see
:mod:`hf_rbf.geometry_measure`).  Two ways to give the warp:

* a callable ``warp`` (:func:`warp_patch_areas`, :func:`warp_key_log_weights`): ``det J_T`` by autograd at the
  Gauss-Legendre nodes of each patch (``quadrature_order`` per axis), so a warp with a polynomial determinant of
  degree ``< 2 * quadrature_order`` per axis gets exact patch areas (a linear warp: any order);
* a sampling grid of coordinates (:func:`grid_patch_areas`, :func:`grid_key_log_weights`): the layout of
  ``grid_sample``'s ``grid``, ``[H, W, 2]`` (or ``[B, H, W, 2]``) holding the original-plane point ``(x, y)`` of every
  pixel.  With ``points="centers"`` (pixel centres, what ``grid_sample`` takes) ``det J`` comes from second-order
  central finite differences of the grid (``torch.gradient``), exact for a linear grid and accurate to ``O(h^2)``
  for a smooth one; with ``points="corners"`` the grid is ``[H + 1, W + 1, 2]`` pixel corners and every pixel gets
  the exact area of its straight-edged quadrilateral.

Coordinates: the stored image spans ``extent = (x_min, x_max, y_min, y_max)`` (default ``(-1, 1, -1, 1)``,
``grid_sample``'s normalised coordinates with ``align_corners=False``); column ``j`` runs along x, row ``i`` along y
(row 0 at ``y_min``); patches are ``patch_h x patch_w`` pixels, ordered row-major (``index = row * n_cols + col``),
the order of a ViT patch embedding.  Only ratios of the areas matter for attention, so the units of the original
plane are free.  A warp that folds over (``det J`` changing sign) is not one-to-one and is rejected.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .geometry_measure import DEFAULT_LOG_EPS, log_weights_from_measure

GRID_POINTS = ("centers", "corners")


def _check_int(fn: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{fn}: `{name}` must be an int >= {minimum}; got {value!r}")
    return value


def _check_patches(fn: str, height: int, width: int, patch_h, patch_w) -> tuple[int, int]:
    patch_h = _check_int(fn, "patch_h", patch_h)
    patch_w = _check_int(fn, "patch_w", patch_w)
    if height % patch_h:
        raise ValueError(f"{fn}: the image height ({height}) must be a multiple of `patch_h` ({patch_h})")
    if width % patch_w:
        raise ValueError(f"{fn}: the image width ({width}) must be a multiple of `patch_w` ({patch_w})")
    return patch_h, patch_w


def _sum_patches(pixel_areas: torch.Tensor, patch_h: int, patch_w: int) -> torch.Tensor:
    """``[..., H, W]`` per-pixel areas -> ``[..., (H / patch_h) * (W / patch_w)]`` per-patch sums, row-major."""
    *lead, h, w = pixel_areas.shape
    blocks = pixel_areas.reshape(*lead, h // patch_h, patch_h, w // patch_w, patch_w)
    return blocks.sum(dim=(-3, -1)).reshape(*lead, -1)


def _one_signed(fn: str, signed: torch.Tensor, what: str) -> torch.Tensor:
    """``|signed|`` after checking that it does not take both signs (a fold: the warp is not one-to-one)."""
    if bool((signed > 0).any()) and bool((signed < 0).any()):
        raise ValueError(f"{fn}: {what} changes sign: the warp folds over itself (it is not one-to-one)")
    return signed.abs()


def warp_patch_areas(
    warp: Callable[[torch.Tensor], torch.Tensor],
    height: int,
    width: int,
    patch_h: int = 1,
    patch_w: int = 1,
    *,
    extent: tuple[float, float, float, float] = (-1.0, 1.0, -1.0, 1.0),
    quadrature_order: int = 3,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """Area in the original plane of every patch of an image stored through ``warp``: ``[n_rows * n_cols]``.

    Args:
        warp: maps stored-image points ``[M, 2]`` (x, y; float64) to original-plane points ``[M, 2]``, point by
            point, with differentiable torch operations (its Jacobian is taken by autograd).
        height, width: stored image size in pixels; multiples of ``patch_h``, ``patch_w``.
        patch_h, patch_w: patch size in pixels (default 1: one token per pixel).
        extent: ``(x_min, x_max, y_min, y_max)`` spanned by the stored image in ``warp``'s input coordinates.
        quadrature_order: Gauss-Legendre nodes per axis and patch (``>= 1``; 1 is the midpoint rule).
        dtype, device: of the result (computed in float64 on the CPU).
    """
    fn = "warp_patch_areas"
    if not callable(warp):
        raise TypeError(f"{fn}: `warp` must be a callable mapping points [M, 2] to points [M, 2]; got {type(warp)}")
    height = _check_int(fn, "height", height)
    width = _check_int(fn, "width", width)
    patch_h, patch_w = _check_patches(fn, height, width, patch_h, patch_w)
    order = _check_int(fn, "quadrature_order", quadrature_order)
    try:
        x_min, x_max, y_min, y_max = (float(e) for e in extent)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: `extent` must be 4 floats (x_min, x_max, y_min, y_max); got {extent!r}")
    if not (x_min < x_max and y_min < y_max):
        raise ValueError(f"{fn}: `extent` must have x_min < x_max and y_min < y_max; got {extent!r}")
    n_rows, n_cols = height // patch_h, width // patch_w
    hx, hy = (x_max - x_min) / n_cols, (y_max - y_min) / n_rows  # patch size in the stored image's coordinates
    nodes, weights = (torch.as_tensor(a, dtype=torch.float64) for a in np.polynomial.legendre.leggauss(order))
    xs = x_min + hx * (torch.arange(n_cols, dtype=torch.float64)[:, None] + 0.5 * (nodes[None, :] + 1.0))  # [C, q]
    ys = y_min + hy * (torch.arange(n_rows, dtype=torch.float64)[:, None] + 0.5 * (nodes[None, :] + 1.0))  # [R, q]
    # points [R, q_y, C, q_x, 2]
    px = xs[None, None, :, :].expand(n_rows, order, n_cols, order)
    py = ys[:, :, None, None].expand(n_rows, order, n_cols, order)
    # autograd also under torch.no_grad() / torch.inference_mode() (e.g. inside a model's eval loop)
    with torch.inference_mode(False), torch.enable_grad():
        points = torch.stack((px, py), dim=-1).reshape(-1, 2).clone().requires_grad_(True)
        mapped = warp(points)
        if not isinstance(mapped, torch.Tensor) or mapped.shape != points.shape:
            got = tuple(mapped.shape) if isinstance(mapped, torch.Tensor) else type(mapped)
            raise ValueError(f"{fn}: `warp` must return points of the input's shape {tuple(points.shape)}; got {got}")
        if not mapped.requires_grad:
            raise ValueError(
                f"{fn}: `warp`'s output does not depend differentiably on its input (autograd sees no graph)"
            )
        # the warp is point by point, so the gradient of sum_m T_c(u_m) with respect to u_m is row c of J_T(u_m)
        grad_x = torch.autograd.grad(mapped[:, 0].sum(), points, retain_graph=True)[0]
        grad_y = torch.autograd.grad(mapped[:, 1].sum(), points)[0]
    det = (grad_x[:, 0] * grad_y[:, 1] - grad_x[:, 1] * grad_y[:, 0]).to(torch.float64)
    if not bool(torch.isfinite(det).all()):
        raise ValueError(f"{fn}: the Jacobian of `warp` is not finite at some quadrature node")
    det = _one_signed(fn, det, "the Jacobian determinant of `warp`")
    w2 = (weights[:, None] * weights[None, :]) * (0.25 * hx * hy)  # [q_y, q_x]: the GL weights mapped to a patch
    areas = (det.reshape(n_rows, order, n_cols, order) * w2[None, :, None, :]).sum(dim=(1, 3))
    return areas.reshape(-1).to(dtype=dtype, device=device)


def warp_key_log_weights(
    warp: Callable[[torch.Tensor], torch.Tensor],
    height: int,
    width: int,
    patch_h: int = 1,
    patch_w: int = 1,
    *,
    extent: tuple[float, float, float, float] = (-1.0, 1.0, -1.0, 1.0),
    quadrature_order: int = 3,
    eps: float = DEFAULT_LOG_EPS,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """``key_log_weights`` ``[1, N]`` (or ``[batch_size, N]``) for the patches of an image stored through ``warp``.

    See :func:`warp_patch_areas` for the arguments and :func:`hf_rbf.geometry_measure.log_weights_from_measure` for
    ``eps`` and ``batch_size``.
    """
    areas = warp_patch_areas(
        warp, height, width, patch_h, patch_w, extent=extent, quadrature_order=quadrature_order, dtype=torch.float64
    )
    return log_weights_from_measure(areas, eps=eps, batch_size=batch_size).to(dtype=dtype, device=device)


def grid_patch_areas(
    grid: torch.Tensor,
    patch_h: int = 1,
    patch_w: int = 1,
    *,
    points: str = "centers",
) -> torch.Tensor:
    """Area in the original plane of every patch of an image resampled on ``grid``: ``[N]`` or ``[B, N]``.

    Args:
        grid: original-plane coordinates ``(x, y)`` of the stored image's pixels, ``[H, W, 2]`` or ``[B, H, W, 2]``
            (``grid_sample``'s layout) for ``points="centers"``; of the pixel corners, ``[H + 1, W + 1, 2]`` or
            ``[B, H + 1, W + 1, 2]``, for ``points="corners"``.
        patch_h, patch_w: patch size in pixels; ``H`` and ``W`` must be multiples.
        points: "centers" (``|det J|`` by second-order finite differences of the grid times the pixel; needs
            ``H, W >= 3``) or "corners" (the exact area of each pixel's quadrilateral).

    Returns the areas in the grid's dtype (computed in float64), in the grid's units.
    """
    fn = "grid_patch_areas"
    if points not in GRID_POINTS:
        raise ValueError(f"{fn}: `points` must be one of {', '.join(repr(p) for p in GRID_POINTS)}; got {points!r}")
    layout = "[H, W, 2] or [B, H, W, 2]" if points == "centers" else "[H + 1, W + 1, 2] or [B, H + 1, W + 1, 2]"
    if not isinstance(grid, torch.Tensor) or not grid.is_floating_point():
        raise TypeError(f"{fn}: `grid` must be a floating-point tensor {layout}")
    if grid.dim() not in (3, 4) or grid.shape[-1] != 2:
        raise ValueError(f"{fn}: `grid` must have shape {layout}; got {tuple(grid.shape)}")
    if not bool(torch.isfinite(grid).all()):
        raise ValueError(f"{fn}: `grid` must be finite")
    g = grid.to(torch.float64)
    if points == "centers":
        height, width = g.shape[-3], g.shape[-2]
        if height < 3 or width < 3:
            raise ValueError(f"{fn}: points='centers' needs a grid of at least 3 x 3 pixels; got {height} x {width}")
        # d(x, y) / d(row) and d(x, y) / d(col), one pixel = one unit: |det| is the pixel's area
        d_row, d_col = torch.gradient(g, dim=(-3, -2), edge_order=2)
        signed = d_col[..., 0] * d_row[..., 1] - d_col[..., 1] * d_row[..., 0]
        what = "the finite-difference Jacobian determinant of `grid`"
    else:
        height, width = g.shape[-3] - 1, g.shape[-2] - 1
        if height < 1 or width < 1:
            raise ValueError(f"{fn}: points='corners' needs at least 2 x 2 corners; got {tuple(grid.shape)}")
        p00, p01 = g[..., :-1, :-1, :], g[..., :-1, 1:, :]
        p10, p11 = g[..., 1:, :-1, :], g[..., 1:, 1:, :]
        d1, d2 = p11 - p00, p10 - p01  # the diagonals: a quadrilateral's area is half their cross product
        signed = 0.5 * (d1[..., 0] * d2[..., 1] - d1[..., 1] * d2[..., 0])
        what = "the signed area of the pixels of `grid`"
    patch_h, patch_w = _check_patches(fn, height, width, patch_h, patch_w)
    areas = _one_signed(fn, signed, what)
    return _sum_patches(areas, patch_h, patch_w).to(grid.dtype)


def grid_key_log_weights(
    grid: torch.Tensor,
    patch_h: int = 1,
    patch_w: int = 1,
    *,
    points: str = "centers",
    eps: float = DEFAULT_LOG_EPS,
    batch_size: int | None = None,
) -> torch.Tensor:
    """``key_log_weights`` for the patches of an image resampled on ``grid``: ``[1, N]``, ``[batch_size, N]`` or
    ``[B, N]`` for a batched grid.  See :func:`grid_patch_areas` and
    :func:`hf_rbf.geometry_measure.log_weights_from_measure`."""
    return log_weights_from_measure(
        grid_patch_areas(grid, patch_h, patch_w, points=points), eps=eps, batch_size=batch_size
    )
