"""Sphere grids with their cell areas, ready to be used as attention keys (``key_log_weights``).

Each token of a latitude-longitude grid stands for a cell of the sphere, and on a sphere those cells are not equal:
a cell ``dtheta x dphi`` at colatitude ``theta`` (0 at the north pole, pi at the south pole) has area
``dA = sin(theta) dtheta dphi`` (the meridian arc ``dtheta`` times the arc ``sin(theta) dphi`` of a circle of
latitude, whose radius is ``sin(theta)``).  Plain attention over such a grid treats every cell alike, so it
averages against the density of grid points, which piles up at the poles, instead of against area; refining the
grid does not remove that bias.  Weighting each key by its cell's area, i.e. adding ``log w_j`` to its score,
turns attention into a quadrature of the continuous spherical kernel average (see :mod:`hf_rbf.geometry_measure`
for the argument and for why only ratios of the weights matter and why they enter as logs).

Grids here:

* :func:`equiangular_grid`: equal steps in colatitude and longitude.  By default the rows sit at *cell centres*,
  ``theta_i = (i + 1/2) pi / n_lat``, so no row lies on a pole and every cell has a positive area.  The exact area
  of such a band cell, ``dphi (cos(theta_i - dtheta/2) - cos(theta_i + dtheta/2)) = 2 dphi sin(dtheta/2)
  sin(theta_i)``, is exactly proportional to ``sin(theta_i)``: the blog's ``w ~ sin(theta)`` rule *is* the exact
  cell area here.  With ``poles=True`` the rows include both poles (``theta_i = i pi / (n_lat - 1)``, the layout of
  ERA5-style 721 x 1440 grids); ``sin(theta)`` is then 0 on the pole rows, where the ``n_lon`` copies of a pole
  really stand for a polar cap of half-width ``dtheta/2``.  ``weighting="area"`` (default) gives every cell its
  exact area (the pole cap shared among the pole row's points), a consistent quadrature; ``weighting="sin"`` is the
  blog's rule verbatim, ``sin(theta)`` plus a small epsilon before the log, which in effect drops the pole rows;
  their caps have area ``O(dtheta^2)``, so the rule still converges at second order, with a larger constant
  (about twice the error of exact areas in ``recipes/sphere_convergence.py``).
* :func:`gauss_legendre_grid`: rows at the Gauss-Legendre nodes in ``cos(theta)`` with their Gauss weights times
  ``2 pi / n_lon``; exact for band-limited functions (degree < ``2 n_lat`` in ``cos(theta)``) and so far more
  accurate than the equiangular midpoint rule for smooth integrands.
* :func:`latlon_grid_from_edges`: any band edges (irregular, refined near the equator, ...), exact cell areas;
  this is the "arbitrary per-token areas" case (see also :func:`hf_rbf.geometry_measure.log_weights_from_measure`
  for areas that come from anywhere else).

Every grid is a :class:`SphereGrid` holding the 3-D unit vectors of its points, their angles and their area
weights (in steradians, summing to ``4 pi``), and :meth:`SphereGrid.key_log_weights` returns the tensor to pass as
``key_log_weights`` (``[1, N]`` broadcasting over the batch, or ``[B, N]``).  Points are ordered row by row (north
to south), longitude fastest, i.e. ``index = row * n_lon + column``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .geometry_measure import DEFAULT_LOG_EPS, log_weights_from_measure


FOUR_PI = 4.0 * math.pi


@dataclass
class SphereGrid:
    """Points of a sphere grid and their quadrature (area) weights.

    Attributes:
        points: unit vectors ``[N, 3]`` (x, y, z), ``z = cos(colatitude)``.
        colatitude: ``[N]`` radians, 0 at the north pole, pi at the south pole.
        longitude: ``[N]`` radians in ``[0, 2 pi)``.
        weights: ``[N]`` cell areas in steradians (sum ``4 pi`` for a grid covering the sphere); with
            ``weighting="sin"`` the blog's ``sin(colatitude)`` rule rescaled to the same total.
        shape: ``(n_lat, n_lon)``.
    """

    points: torch.Tensor
    colatitude: torch.Tensor
    longitude: torch.Tensor
    weights: torch.Tensor
    shape: tuple[int, int]

    @property
    def num_points(self) -> int:
        return int(self.points.shape[0])

    def key_log_weights(self, batch_size: int | None = None, *, eps: float = DEFAULT_LOG_EPS) -> torch.Tensor:
        """``log(w_j / mean(w) + eps)`` as ``[1, N]`` (broadcasts over the batch) or ``[batch_size, N]``."""
        return log_weights_from_measure(self.weights, eps=eps, batch_size=batch_size)

    def integrate(self, values: torch.Tensor) -> torch.Tensor:
        """Quadrature ``sum_j w_j values[..., j]`` of samples ``[..., N]`` taken at :attr:`points`."""
        return (values * self.weights.to(values.dtype)).sum(-1)


def sphere_points(colatitude: torch.Tensor, longitude: torch.Tensor) -> torch.Tensor:
    """Unit vectors ``[..., 3]`` for colatitude/longitude tensors of the same shape (radians)."""
    s = torch.sin(colatitude)
    return torch.stack((s * torch.cos(longitude), s * torch.sin(longitude), torch.cos(colatitude)), dim=-1)


def _check_count(fn: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{fn}: `{name}` must be an int >= {minimum}; got {value!r}")
    return value


def _tensor_grid(theta_rows: np.ndarray, row_weights: np.ndarray, n_lon: int, dtype, device) -> SphereGrid:
    """Outer product of rows (colatitude, total weight per cell of the row) and ``n_lon`` equal longitudes."""
    phi = np.arange(n_lon, dtype=np.float64) * (2.0 * math.pi / n_lon)
    theta = np.repeat(theta_rows, n_lon)
    lon = np.tile(phi, theta_rows.shape[0])
    w = np.repeat(row_weights, n_lon)
    theta_t = torch.as_tensor(theta, dtype=torch.float64)
    lon_t = torch.as_tensor(lon, dtype=torch.float64)
    pts = sphere_points(theta_t, lon_t)
    conv = dict(dtype=dtype, device=device)
    return SphereGrid(
        points=pts.to(**conv),
        colatitude=theta_t.to(**conv),
        longitude=lon_t.to(**conv),
        weights=torch.as_tensor(w, dtype=torch.float64).to(**conv),
        shape=(int(theta_rows.shape[0]), n_lon),
    )


def band_areas(colatitude_edges, n_lon: int) -> np.ndarray:
    """Area of one cell of each band ``[edges[i], edges[i+1]]`` split into ``n_lon`` equal longitude cells."""
    e = np.asarray(colatitude_edges, dtype=np.float64)
    return (2.0 * math.pi / n_lon) * (np.cos(e[:-1]) - np.cos(e[1:]))


def equiangular_grid(
    n_lat: int,
    n_lon: int | None = None,
    *,
    poles: bool = False,
    weighting: str = "area",
    dtype: torch.dtype = torch.float32,
    device=None,
) -> SphereGrid:
    """Equiangular latitude-longitude grid (``n_lat`` rows x ``n_lon`` columns).

    Args:
        n_lat: number of rows (``>= 1``; ``>= 2`` with ``poles=True``).
        n_lon: number of columns; default ``2 * n_lat`` (``2 * (n_lat - 1)`` with ``poles``: square cells).
        poles: False: rows at cell centres ``(i + 1/2) pi / n_lat`` (no row on a pole).  True: rows at
            ``i pi / (n_lat - 1)``, including both poles (each pole repeated ``n_lon`` times).
        weighting: "area" (exact cell areas; the pole rows get their share of the polar cap) or "sin" (the blog's
            ``w ~ sin(colatitude)``; zero on the pole rows, so :meth:`SphereGrid.key_log_weights` gives them
            ``log(eps)``).  Without poles the two are the same up to a constant factor.
        dtype, device: of the returned tensors (computed in float64).
    """
    fn = "equiangular_grid"
    n_lat = _check_count(fn, "n_lat", n_lat, 2 if poles else 1)
    if weighting not in ("area", "sin"):
        raise ValueError(f"{fn}: `weighting` must be 'area' or 'sin'; got {weighting!r}")
    if n_lon is None:
        n_lon = 2 * (n_lat - 1) if poles else 2 * n_lat
    n_lon = _check_count(fn, "n_lon", n_lon, 1)
    if poles:
        dtheta = math.pi / (n_lat - 1)
        theta = np.arange(n_lat, dtype=np.float64) * dtheta
        edges = np.clip(np.concatenate(([0.0], theta[:-1] + 0.5 * dtheta, [math.pi])), 0.0, math.pi)
    else:
        dtheta = math.pi / n_lat
        theta = (np.arange(n_lat, dtype=np.float64) + 0.5) * dtheta
        edges = np.arange(n_lat + 1, dtype=np.float64) * dtheta
    if weighting == "area":
        w = band_areas(edges, n_lon)
    else:
        w = np.sin(theta)
        w = np.where(np.abs(w) < 1e-15, 0.0, w)  # sin(pi) is 1.2e-16 in floating point, not 0
        w = w * (FOUR_PI / (w.sum() * n_lon))
    return _tensor_grid(theta, w, n_lon, dtype, device)


def gauss_legendre_grid(
    n_lat: int,
    n_lon: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> SphereGrid:
    """Gauss-Legendre grid: rows at the ``n_lat`` Gauss nodes of ``cos(colatitude)`` in ``[-1, 1]``.

    The weight of a point is its row's Gauss weight (the nodes' weights sum to 2 = the integral of ``d cos(theta)``)
    times ``2 pi / n_lon``.  Rows run north to south; ``n_lon`` defaults to ``2 * n_lat``.
    """
    fn = "gauss_legendre_grid"
    n_lat = _check_count(fn, "n_lat", n_lat, 1)
    n_lon = _check_count(fn, "n_lon", 2 * n_lat if n_lon is None else n_lon, 1)
    x, wx = np.polynomial.legendre.leggauss(n_lat)
    order = np.argsort(-x)  # north (cos theta = 1) first
    theta = np.arccos(np.clip(x[order], -1.0, 1.0))
    w = wx[order] * (2.0 * math.pi / n_lon)
    return _tensor_grid(theta, w, n_lon, dtype, device)


def latlon_grid_from_edges(
    colatitude_edges,
    n_lon: int,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> SphereGrid:
    """Latitude-longitude grid with arbitrary band edges (radians, strictly increasing, within ``[0, pi]``).

    Row ``i`` sits at the middle colatitude of its band ``[edges[i], edges[i+1]]`` and each of its ``n_lon`` cells
    gets the band cell's exact area.  Edges from 0 to pi cover the sphere (weights sum to ``4 pi``).
    """
    fn = "latlon_grid_from_edges"
    n_lon = _check_count(fn, "n_lon", n_lon, 1)
    e = np.asarray(colatitude_edges, dtype=np.float64)
    if e.ndim != 1 or e.shape[0] < 2:
        raise ValueError(f"{fn}: `colatitude_edges` must be 1-D with at least 2 entries; got shape {e.shape}")
    if not (np.all(np.diff(e) > 0) and e[0] >= 0.0 and e[-1] <= math.pi + 1e-12):
        raise ValueError(f"{fn}: `colatitude_edges` must be strictly increasing within [0, pi]")
    theta = 0.5 * (e[:-1] + e[1:])
    return _tensor_grid(theta, band_areas(e, n_lon), n_lon, dtype, device)
