"""Equirectangular (360-degree) frames: exact patch solid angles by hand, agreement with the sphere grids, video
time weights, and the convergence of weighted attention to the integral over the sphere (and over sphere x time).

Targets: the closed-form spherical kernel average of recipes/sphere_convergence.py (Funk-Hecke, checked there
against a direct quadrature) and, for video, its product with a 1-D kernel average over time computed by
Gauss-Legendre quadrature in numpy (the Gaussian kernel of (point, time) features is a product, so the space-time
average of f(p) g(t) is the product of the two averages).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_rbf import rbf_attention
from hf_rbf.geometry_equirect import (
    equirect_key_log_weights,
    equirect_patch_centers,
    equirect_patch_solid_angles,
)
from hf_rbf.geometry_sphere import equiangular_grid
from recipes import sphere_convergence as sphere  # the module, not its names: pytest would collect test_function

GAMMA = 2.0
PI = math.pi


def test_2x4_patch_grid_by_hand():
    """A 4 x 8 frame in 2 x 2 patches: 2 bands (north, south) of 4 patches; each is a quarter of a hemisphere."""
    omega = equirect_patch_solid_angles(4, 8, 2, 2, dtype=torch.float64)
    # band [0, pi/2]: dphi (cos 0 - cos pi/2) = (pi / 2) * 1
    torch.testing.assert_close(omega, torch.full((8,), PI / 2, dtype=torch.float64))
    assert float(omega.sum()) == pytest.approx(4 * PI, rel=1e-15)
    assert equirect_key_log_weights(4, 8, 2, 2, eps=0.0, dtype=torch.float64).abs().max() < 1e-15  # plain attention


def test_3x4_patch_grid_by_hand():
    """3 bands: [0, pi/3] -> (pi/2)(1 - 1/2) = pi/4, [pi/3, 2pi/3] -> (pi/2)(1/2 + 1/2) = pi/2, then pi/4."""
    omega = equirect_patch_solid_angles(6, 8, 2, 2, dtype=torch.float64).view(3, 4)
    expected = torch.tensor([PI / 4, PI / 2, PI / 4], dtype=torch.float64)[:, None].expand(3, 4)
    torch.testing.assert_close(omega, expected, rtol=1e-15, atol=1e-15)
    assert float(omega.sum()) == pytest.approx(4 * PI, rel=1e-15)
    klw = equirect_key_log_weights(6, 8, 2, 2, eps=0.0, dtype=torch.float64).view(3, 4)
    torch.testing.assert_close(klw[:, 0], torch.log(torch.tensor([0.75, 1.5, 0.75], dtype=torch.float64)))  # mean pi/3


def test_cropped_frame():
    """A frame covering only colatitudes [pi/3, 2pi/3] and half the longitudes: one band of 2 patches."""
    omega = equirect_patch_solid_angles(
        2, 4, 2, 2, colatitude_range=(PI / 3, 2 * PI / 3), longitude_span=PI, dtype=torch.float64
    )
    torch.testing.assert_close(omega, torch.full((2,), PI / 2, dtype=torch.float64))  # (pi/2) (1/2 + 1/2)


def test_matches_the_equiangular_sphere_grid():
    """A 2:1 frame in square patches is the cell-centred equiangular grid of geometry_sphere: same areas, points."""
    grid = equiangular_grid(8, 16, dtype=torch.float64)
    torch.testing.assert_close(equirect_patch_solid_angles(32, 64, 4, 4, dtype=torch.float64), grid.weights)
    centres = equirect_patch_centers(32, 64, 4, 4, dtype=torch.float64)
    # geometry_sphere puts longitude 0 on the first column's point, the frame on the left edge: half a column apart
    shift = torch.tensor(2 * PI / 16 / 2, dtype=torch.float64)
    rot = torch.stack(
        (
            torch.stack((shift.cos(), -shift.sin(), shift * 0)),
            torch.stack((shift.sin(), shift.cos(), shift * 0)),
            torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
        )
    )
    torch.testing.assert_close(centres, grid.points @ rot.T)
    torch.testing.assert_close(centres.norm(dim=-1), torch.ones(128, dtype=torch.float64))
    assert equirect_patch_centers(32, 64, 4, 4).dtype == torch.float32


def test_video_time_axis():
    omega = equirect_patch_solid_angles(6, 8, 2, 2, dtype=torch.float64)
    klw = equirect_key_log_weights(6, 8, 2, 2, num_frames=3, dtype=torch.float64)
    assert klw.shape == (1, 36)
    torch.testing.assert_close(klw.view(3, 12), equirect_key_log_weights(6, 8, 2, 2, dtype=torch.float64).expand(3, 12))
    dt = torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64)
    klw = equirect_key_log_weights(6, 8, 2, 2, frame_durations=dt, eps=0.0, dtype=torch.float64)
    measure = (dt[:, None] * omega[None]).reshape(-1)
    torch.testing.assert_close(klw[0], torch.log(measure / measure.mean()))  # frame-major: token t * N + p
    assert equirect_key_log_weights(6, 8, 2, 2, frame_durations=[1.0, 2.0], num_frames=2, batch_size=4).shape == (4, 24)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(height=5, width=8, patch_h=2, patch_w=2), r"`height` \(5\) must be a multiple of `patch_h` \(2\)"),
        (dict(height=4, width=8, patch_h=2, patch_w=3), r"`width` \(8\) must be a multiple of `patch_w` \(3\)"),
        (dict(height=0, width=8, patch_h=2, patch_w=2), "`height` must be an int >= 1"),
        (dict(height=4, width=8, patch_h=2.0, patch_w=2), "`patch_h` must be an int >= 1"),
        (dict(height=4, width=8, patch_h=2, patch_w=2, colatitude_range=(1.0, 0.5)), "colatitude_range"),
        (dict(height=4, width=8, patch_h=2, patch_w=2, colatitude_range=(0.0, 4.0)), "colatitude_range"),
        (dict(height=4, width=8, patch_h=2, patch_w=2, colatitude_range=1.0), "colatitude_range"),
    ],
)
def test_solid_angle_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        equirect_patch_solid_angles(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_frames=0), "`num_frames` must be an int >= 1"),
        (dict(frame_durations=[1.0, -1.0]), "frame_durations.*> 0"),
        (dict(frame_durations=[[1.0]]), r"frame_durations.*1-D"),
        (dict(frame_durations=[1.0, 1.0], num_frames=3), r"`num_frames` \(3\) must equal"),
        (dict(longitude_span=7.0), "longitude_span"),
    ],
)
def test_key_log_weights_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        if "longitude_span" in kwargs:
            equirect_patch_centers(4, 8, 2, 2, **kwargs)
        else:
            equirect_key_log_weights(4, 8, 2, 2, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# convergence
# ---------------------------------------------------------------------------------------------------------------


def test_weighted_attention_over_equirect_patches_converges():
    q = sphere.query_points(64)
    exact = sphere.exact_smoothed(q, GAMMA)
    qt = torch.as_tensor(q)
    weighted, unweighted = [], []
    for height in (16, 32, 64, 128):  # 2 x 2 patches: 8 ... 64 patch rows
        centres = equirect_patch_centers(height, 2 * height, 2, 2, dtype=torch.float64)
        klw = equirect_key_log_weights(height, 2 * height, 2, 2, dtype=torch.float64)
        values = sphere.test_function(centres)[None, None, :, None]
        for errs, weights in ((weighted, klw), (unweighted, None)):
            out = rbf_attention(
                qt[None, None], centres[None, None], values, gamma=GAMMA, causal=False, key_log_weights=weights
            )
            errs.append(float(np.abs(out[0, 0, :, 0].numpy() - exact).max()))
    weighted, unweighted = np.array(weighted), np.array(unweighted)
    assert (weighted[1:] < weighted[:-1] / 3).all() and weighted[-1] < 1e-3, weighted  # midpoint rule: O(h^2)
    assert unweighted.min() > 0.5 and unweighted[-1] > 0.9 * unweighted[0], unweighted


TIME_SCALE = 1.5  # time feature c * t: the kernel exp(-gamma (|x - y|^2 + c^2 (s - t)^2))


def _time_function(t):
    return np.cos(2.0 * t) + t


def _exact_time_smoothing(s: np.ndarray) -> np.ndarray:
    x, w = np.polynomial.legendre.leggauss(80)
    t, w = 0.5 * (x + 1.0), 0.5 * w  # [0, 1]
    k = np.exp(-GAMMA * TIME_SCALE**2 * (s[:, None] - t[None]) ** 2) * w
    return (k * _time_function(t)).sum(-1) / k.sum(-1)


def test_video_with_uneven_frame_times_converges_over_sphere_and_time():
    """Frames at uneven times (edges (k / T)^2: dense early): the time weights are needed as well as the areas."""
    rng = np.random.default_rng(0)
    q = sphere.query_points(48)
    s = rng.uniform(0.0, 1.0, size=q.shape[0])
    exact = sphere.exact_smoothed(q, GAMMA) * _exact_time_smoothing(s)
    qt = torch.as_tensor(np.concatenate((q, TIME_SCALE * s[:, None]), -1))
    errors = {"space_time": [], "space_only": [], "none": []}
    for n in (8, 16, 32):
        height, frames = 2 * n, n // 2
        edges = (np.arange(frames + 1) / frames) ** 2
        times, durations = 0.5 * (edges[1:] + edges[:-1]), np.diff(edges)
        centres = equirect_patch_centers(height, 2 * height, 2, 2, dtype=torch.float64)
        num = centres.shape[0]
        keys = torch.cat(
            (centres.repeat(frames, 1), TIME_SCALE * torch.as_tensor(times).repeat_interleave(num)[:, None]), -1
        )
        values = sphere.test_function(centres).repeat(frames) * torch.as_tensor(
            _time_function(times)
        ).repeat_interleave(num)
        weights = {
            "space_time": equirect_key_log_weights(
                height, 2 * height, 2, 2, frame_durations=durations, dtype=torch.float64
            ),
            "space_only": equirect_key_log_weights(height, 2 * height, 2, 2, num_frames=frames, dtype=torch.float64),
            "none": None,
        }
        for name, klw in weights.items():
            out = rbf_attention(
                qt[None, None],
                keys[None, None],
                values[None, None, :, None],
                gamma=GAMMA,
                causal=False,
                key_log_weights=klw,
            )
            errors[name].append(float(np.abs(out[0, 0, :, 0].numpy() - exact).max()))
    full, space_only, none = (np.array(errors[k]) for k in ("space_time", "space_only", "none"))
    assert (full[1:] < full[:-1] / 3).all() and full[-1] < 5e-3, full
    assert space_only.min() > 0.05 and space_only[-1] > 10 * full[-1], space_only  # the time weights matter
    assert none.min() > 0.3, none
