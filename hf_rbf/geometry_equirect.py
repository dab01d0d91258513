"""360-degree images and video (equirectangular frames): solid angle of each patch, as attention key weights.

An equirectangular frame of ``height x width`` pixels maps rows linearly to colatitude (0 at the top = north pole,
pi at the bottom) and columns linearly to longitude (0 to 2 pi).  A vision transformer cuts it into patches of
``patch_h x patch_w`` pixels, so every token is a latitude-longitude cell, and those cells are far from equal: a
patch at the top or bottom covers a sliver of sphere, one on the equator the most.  The exact solid angle of the
patch spanning colatitudes ``[theta_0, theta_1]`` and a longitude step ``dphi`` is the integral of
``dA = sin(theta) dtheta dphi`` over it,

    Omega = dphi (cos(theta_0) - cos(theta_1)),

and the patches of a full frame sum to ``4 pi``.  (For patch rows of equal height that is exactly proportional to
``sin`` of the patch's central colatitude, the blog's ``w ~ sin(theta)`` rule; the formula above also holds for a
frame cropped in latitude, ``colatitude_range``.)  With these as ``key_log_weights`` attention over the patches is a
quadrature of the continuous average over the sphere (see :mod:`hf_rbf.geometry_measure`).

Video adds a time axis: the tokens of ``T`` frames (``[T, N]``, flattened frame-major: token ``t * N + p``) stand
for a patch of sphere *times* the time a frame stands for, so the measure is ``Omega_p * dt_t``.  With a constant
frame rate ``dt`` is a common factor and only the solid angles matter; ``frame_durations`` takes the per-frame
durations of a variable-frame-rate clip or one with dropped frames.

Patch order is row-major (top to bottom, left to right: ``index = row * n_cols + col``), the order of a ViT patch
embedding (``Conv2d`` with stride = patch size, then ``flatten(2)``) and of :mod:`hf_rbf.geometry_sphere`'s grids.
"""

from __future__ import annotations

import math

import torch

from .geometry_measure import DEFAULT_LOG_EPS, log_weights_from_measure
from .geometry_sphere import sphere_points


def _check_int(fn: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{fn}: `{name}` must be an int >= {minimum}; got {value!r}")
    return value


def _patch_layout(fn, height, width, patch_h, patch_w, colatitude_range, longitude_span):
    """Validated ``(n_rows, n_cols, colatitude edges [n_rows + 1] float64, dphi)``."""
    height = _check_int(fn, "height", height)
    width = _check_int(fn, "width", width)
    patch_h = _check_int(fn, "patch_h", patch_h)
    patch_w = _check_int(fn, "patch_w", patch_w)
    if height % patch_h:
        raise ValueError(f"{fn}: `height` ({height}) must be a multiple of `patch_h` ({patch_h})")
    if width % patch_w:
        raise ValueError(f"{fn}: `width` ({width}) must be a multiple of `patch_w` ({patch_w})")
    try:
        top, bottom = (float(c) for c in colatitude_range)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: `colatitude_range` must be a pair (top, bottom) of radians; got {colatitude_range!r}")
    if not (0.0 <= top < bottom <= math.pi):
        raise ValueError(f"{fn}: `colatitude_range` must satisfy 0 <= top < bottom <= pi; got {colatitude_range!r}")
    if isinstance(longitude_span, bool) or not isinstance(longitude_span, (int, float)):
        raise TypeError(f"{fn}: `longitude_span` must be a float in (0, 2 pi]; got {longitude_span!r}")
    if not (0.0 < longitude_span <= 2.0 * math.pi + 1e-12):
        raise ValueError(f"{fn}: `longitude_span` must be a float in (0, 2 pi]; got {longitude_span!r}")
    n_rows, n_cols = height // patch_h, width // patch_w
    edges = torch.linspace(top, bottom, n_rows + 1, dtype=torch.float64)
    return n_rows, n_cols, edges, float(longitude_span) / n_cols


def equirect_patch_solid_angles(
    height: int,
    width: int,
    patch_h: int,
    patch_w: int,
    *,
    colatitude_range: tuple[float, float] = (0.0, math.pi),
    longitude_span: float = 2.0 * math.pi,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """Exact solid angle (steradians) of every patch of an equirectangular frame: ``[n_rows * n_cols]``, row-major.

    Args:
        height, width: frame size in pixels; multiples of ``patch_h``, ``patch_w``.
        patch_h, patch_w: patch size in pixels.
        colatitude_range: colatitudes (radians) of the frame's top and bottom edges; default the full sphere.
        longitude_span: longitude range (radians) of the frame's width; default ``2 pi`` (a full panorama).
        dtype, device: of the result (computed in float64).

    A full frame's patches sum to ``4 pi``.
    """
    fn = "equirect_patch_solid_angles"
    _, n_cols, edges, dphi = _patch_layout(fn, height, width, patch_h, patch_w, colatitude_range, longitude_span)
    band = dphi * (torch.cos(edges[:-1]) - torch.cos(edges[1:]))  # [n_rows]: the sin-band integral
    return band.repeat_interleave(n_cols).to(dtype=dtype, device=device)


def equirect_patch_centers(
    height: int,
    width: int,
    patch_h: int,
    patch_w: int,
    *,
    colatitude_range: tuple[float, float] = (0.0, math.pi),
    longitude_span: float = 2.0 * math.pi,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """Unit vectors ``[n_rows * n_cols, 3]`` of the patch centres (mid-colatitude, mid-longitude), row-major.

    Same convention as :func:`hf_rbf.geometry_sphere.sphere_points` (``z = cos(colatitude)``, longitude 0 at the
    frame's left edge): positions for a spherical position encoding or for checks like the convergence tests.
    """
    fn = "equirect_patch_centers"
    n_rows, n_cols, edges, dphi = _patch_layout(fn, height, width, patch_h, patch_w, colatitude_range, longitude_span)
    theta = 0.5 * (edges[:-1] + edges[1:])
    phi = (torch.arange(n_cols, dtype=torch.float64) + 0.5) * dphi
    points = sphere_points(theta.repeat_interleave(n_cols), phi.repeat(n_rows))
    return points.to(dtype=dtype, device=device)


def equirect_key_log_weights(
    height: int,
    width: int,
    patch_h: int,
    patch_w: int,
    *,
    num_frames: int | None = None,
    frame_durations=None,
    colatitude_range: tuple[float, float] = (0.0, math.pi),
    eps: float = DEFAULT_LOG_EPS,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """``key_log_weights`` for attention over the patches of equirectangular frames (a 360-degree image or video).

    Args:
        height, width, patch_h, patch_w, colatitude_range: see :func:`equirect_patch_solid_angles`.
        num_frames: ``T`` for a video whose tokens are ``T`` frames of patches, flattened frame-major
            (``t * N + p``); None for a single frame.
        frame_durations: optional ``[T]`` positive durations of the frames (variable frame rate, dropped frames);
            default equal.  Sets ``num_frames`` when that is None.
        eps, batch_size: see :func:`hf_rbf.geometry_measure.log_weights_from_measure`.
        dtype, device: of the result.

    Returns ``[1, N]`` / ``[1, T * N]`` (broadcasts over the batch) or ``[batch_size, ...]``.
    """
    fn = "equirect_key_log_weights"
    omega = equirect_patch_solid_angles(
        height, width, patch_h, patch_w, colatitude_range=colatitude_range, dtype=torch.float64
    )
    if frame_durations is not None:
        dt = torch.as_tensor(frame_durations, dtype=torch.float64)
        if dt.dim() != 1 or dt.shape[0] < 1:
            raise ValueError(f"{fn}: `frame_durations` must be 1-D [T] with T >= 1; got shape {tuple(dt.shape)}")
        if not bool(torch.isfinite(dt).all()) or bool((dt <= 0).any()):
            raise ValueError(f"{fn}: `frame_durations` must be finite and > 0")
        if num_frames is not None and _check_int(fn, "num_frames", num_frames) != dt.shape[0]:
            raise ValueError(f"{fn}: `num_frames` ({num_frames}) must equal len(`frame_durations`) ({dt.shape[0]})")
        measure = (dt[:, None] * omega[None, :]).reshape(-1)
    elif num_frames is not None:
        measure = omega.repeat(_check_int(fn, "num_frames", num_frames))
    else:
        measure = omega
    # the log in float64, then the requested dtype: equal patches give exactly 0
    return log_weights_from_measure(measure, eps=eps, batch_size=batch_size).to(dtype=dtype, device=device)
