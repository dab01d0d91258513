"""Warped images: patch areas from the warp's Jacobian (autograd) or from a sampling grid (finite differences, exact
quadrilaterals), checked on hand-computed warps, against each other, and through rbf_attention.

The convergence of attention over a warped image to the plane integral is tested with the recipe's core function in
tests/test_geometry_convergence.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_rbf import rbf_attention
from hf_rbf.geometry_warp import grid_key_log_weights, grid_patch_areas, warp_key_log_weights, warp_patch_areas
from recipes.geometry_convergence import fisheye_warp

A = torch.tensor([[2.0, 1.0], [0.5, 3.0]], dtype=torch.float64)  # det 5.5
OFFSET = torch.tensor([0.3, -7.0], dtype=torch.float64)


def linear_warp(p):
    return p @ A.T + OFFSET


def pixel_grid(height, width, corners=False, extent=(-1.0, 1.0, -1.0, 1.0)):
    """Pixel centres ``[H, W, 2]`` (or corners ``[H + 1, W + 1, 2]``) of an image spanning ``extent``, float64."""
    x0, x1, y0, y1 = extent
    if corners:
        xs, ys = (
            torch.linspace(x0, x1, width + 1, dtype=torch.float64),
            torch.linspace(y0, y1, height + 1, dtype=torch.float64),
        )
    else:
        xs = x0 + (torch.arange(width, dtype=torch.float64) + 0.5) * (x1 - x0) / width
        ys = y0 + (torch.arange(height, dtype=torch.float64) + 0.5) * (y1 - y0) / height
    return torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1)


def test_linear_warp_has_its_determinant_everywhere():
    """Stored image 4 x 6 pixels of unit size, 2 x 3 patches: every patch's area is |det A| * 6 = 33."""
    extent = (0.0, 6.0, 0.0, 4.0)
    expected = torch.full((4,), 33.0, dtype=torch.float64)
    for order in (1, 3):
        areas = warp_patch_areas(linear_warp, 4, 6, 2, 3, extent=extent, quadrature_order=order, dtype=torch.float64)
        torch.testing.assert_close(areas, expected, rtol=1e-14, atol=0)
    centres = linear_warp(pixel_grid(4, 6, extent=extent))
    torch.testing.assert_close(grid_patch_areas(centres, 2, 3), expected, rtol=1e-14, atol=0)
    corners = linear_warp(pixel_grid(4, 6, corners=True, extent=extent))
    torch.testing.assert_close(grid_patch_areas(corners, 2, 3, points="corners"), expected, rtol=1e-14, atol=0)
    # equal areas: the weights are the plain attention's (float64 logs; float32 by default)
    assert (
        warp_key_log_weights(linear_warp, 4, 6, 2, 3, extent=extent, eps=0.0, dtype=torch.float64).abs().max() < 1e-15
    )
    assert grid_key_log_weights(centres, 2, 3).shape == (1, 4)


def test_quadratic_warp_by_hand():
    """T(u, v) = (u^2, v) on [0, 1]^2, det J = 2u: column j of 4 (rows of 2) has area ((j + 1)^2 - j^2) / 16 / 2."""
    warp = lambda p: torch.stack((p[:, 0] ** 2, p[:, 1]), -1)
    areas = warp_patch_areas(warp, 2, 4, extent=(0.0, 1.0, 0.0, 1.0), quadrature_order=1, dtype=torch.float64)
    expected = torch.tensor([1.0, 3.0, 5.0, 7.0], dtype=torch.float64).repeat(2) / 32
    torch.testing.assert_close(areas, expected, rtol=1e-14, atol=0)  # det is linear: the midpoint rule is exact
    klw = warp_key_log_weights(warp, 2, 4, extent=(0.0, 1.0, 0.0, 1.0), eps=0.0, dtype=torch.float64)
    torch.testing.assert_close(klw[0], torch.log(expected / expected.mean()))
    # the corners of the same warp: every pixel is a rectangle [j^2, (j + 1)^2] / 16 x [0, 1/2]
    corners = warp(pixel_grid(2, 4, corners=True, extent=(0.0, 1.0, 0.0, 1.0)).reshape(-1, 2)).reshape(3, 5, 2)
    torch.testing.assert_close(grid_patch_areas(corners, points="corners"), expected, rtol=1e-14, atol=0)


def test_autograd_finite_differences_and_corners_agree_on_a_smooth_warp():
    """The recipe's fisheye-like warp: the three routes agree, the grid routes to O(h^2) of the pixel size."""
    n = 64
    exact = warp_patch_areas(fisheye_warp, n, n, 4, 4, quadrature_order=6, dtype=torch.float64)
    assert float(exact.sum()) == pytest.approx(4.0, rel=1e-12)  # T maps the square [-1, 1]^2 onto itself
    assert float(exact.max() / exact.min()) > 5  # strongly uneven: about 6x smaller near the centre
    order3 = warp_patch_areas(fisheye_warp, n, n, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(order3, exact, rtol=1e-6, atol=0)
    centres = grid_patch_areas(fisheye_warp(pixel_grid(n, n)), 4, 4)
    corners = grid_patch_areas(fisheye_warp(pixel_grid(n, n, corners=True)), 4, 4, points="corners")
    errs = []
    for routed in (centres, corners):
        errs.append(float(((routed - exact) / exact).abs().max()))
    assert max(errs) < 5e-3, errs
    # second order: halving the pixels (same patches in the plane) shrinks the finite-difference error about 4x
    finer = grid_patch_areas(fisheye_warp(pixel_grid(2 * n, 2 * n)), 8, 8)
    assert float(((finer - exact) / exact).abs().max()) < errs[0] / 3


def test_batched_grid_and_dtypes():
    g = fisheye_warp(pixel_grid(8, 12))
    batch = torch.stack((g, 3.0 * g))
    areas = grid_patch_areas(batch, 2, 3)
    assert areas.shape == (2, 16)
    torch.testing.assert_close(areas[1], 9.0 * areas[0])
    klw = grid_key_log_weights(batch, 2, 3)
    assert klw.shape == (2, 16)
    torch.testing.assert_close(klw[0], klw[1])  # only ratios matter
    assert grid_patch_areas(g.float()).dtype == torch.float32 and grid_patch_areas(g.float()).shape == (96,)
    assert warp_patch_areas(fisheye_warp, 4, 4).dtype == torch.float32
    assert warp_key_log_weights(fisheye_warp, 4, 4, 2, 2, batch_size=3).shape == (3, 4)
    reference = warp_patch_areas(fisheye_warp, 4, 4)
    with torch.no_grad():  # the Jacobian by autograd also in an evaluation loop
        torch.testing.assert_close(warp_patch_areas(fisheye_warp, 4, 4), reference)
    with torch.inference_mode():
        torch.testing.assert_close(warp_patch_areas(fisheye_warp, 4, 4), reference)


def test_warp_weights_multiply_the_kernel_in_rbf_attention():
    n, gamma = 12, 2.0
    uv = pixel_grid(n, n).reshape(-1, 2)
    keys = fisheye_warp(uv)
    values = torch.cos(2 * keys[:, 0]) + keys[:, 1]
    q = torch.tensor([[0.0, 0.0], [0.9, -0.8], [-1.0, 1.0]], dtype=torch.float64)
    klw = warp_key_log_weights(fisheye_warp, n, n, eps=0.0, dtype=torch.float64)
    out = rbf_attention(
        q[None, None], keys[None, None], values[None, None, :, None], gamma=gamma, causal=False, key_log_weights=klw
    )[0, 0, :, 0]
    k = torch.exp(-gamma * torch.cdist(q, keys) ** 2) * warp_patch_areas(fisheye_warp, n, n, dtype=torch.float64)
    torch.testing.assert_close(out, (k * values).sum(-1) / k.sum(-1), rtol=1e-12, atol=1e-12)


def test_a_folding_warp_is_rejected():
    fold = lambda p: torch.stack((p[:, 0] ** 2, p[:, 1]), -1)
    with pytest.raises(ValueError, match="folds over itself"):
        warp_patch_areas(fold, 4, 4)
    with pytest.raises(ValueError, match="folds over itself"):
        grid_patch_areas(fold(pixel_grid(4, 4).reshape(-1, 2)).reshape(4, 4, 2))
    with pytest.raises(ValueError, match="folds over itself"):
        grid_patch_areas(fold(pixel_grid(4, 4, corners=True).reshape(-1, 2)).reshape(5, 5, 2), points="corners")
    # a mirror image does not fold: the areas are |det|
    mirror = lambda p: torch.stack((-p[:, 0], p[:, 1]), -1)
    torch.testing.assert_close(warp_patch_areas(mirror, 2, 2, dtype=torch.float64), torch.ones(4, dtype=torch.float64))


GRID = pixel_grid(4, 6)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: warp_patch_areas("fisheye", 4, 4), TypeError, "`warp` must be a callable"),
        (
            lambda: warp_patch_areas(fisheye_warp, 4, 6, 3, 2),
            ValueError,
            r"height \(4\) must be a multiple of `patch_h`",
        ),
        (
            lambda: warp_patch_areas(fisheye_warp, 4, 6, 2, 4),
            ValueError,
            r"width \(6\) must be a multiple of `patch_w`",
        ),
        (lambda: warp_patch_areas(fisheye_warp, 0, 4), ValueError, "`height` must be an int >= 1"),
        (lambda: warp_patch_areas(fisheye_warp, 4, 4, quadrature_order=0), ValueError, "quadrature_order"),
        (lambda: warp_patch_areas(fisheye_warp, 4, 4, extent=(1.0, -1.0, 0.0, 1.0)), ValueError, "x_min < x_max"),
        (lambda: warp_patch_areas(fisheye_warp, 4, 4, extent=(0.0, 1.0)), ValueError, "`extent` must be 4 floats"),
        (lambda: warp_patch_areas(lambda p: p[:, :1], 4, 4), ValueError, "must return points of the input's shape"),
        (lambda: warp_patch_areas(lambda p: p.detach() * 2, 4, 4), ValueError, "differentiabl"),
        (lambda: warp_patch_areas(lambda p: p / 0.0, 4, 4), ValueError, "not finite"),
        (lambda: grid_patch_areas(GRID, points="pixels"), ValueError, "`points` must be one of 'centers', 'corners'"),
        (lambda: grid_patch_areas(GRID.long()), TypeError, "`grid` must be a floating-point tensor"),
        (lambda: grid_patch_areas(GRID[..., :1]), ValueError, r"`grid` must have shape \[H, W, 2\]"),
        (lambda: grid_patch_areas(GRID[:2]), ValueError, "at least 3 x 3"),
        (lambda: grid_patch_areas(GRID, 3, 2), ValueError, r"height \(4\) must be a multiple of `patch_h` \(3\)"),
        (lambda: grid_patch_areas(GRID, 1, 2, points="corners"), ValueError, r"width \(5\) must be a multiple"),
        (lambda: grid_patch_areas(GRID * math.inf), ValueError, "finite"),
    ],
)
def test_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_weights_feed_the_gka_vision_transformer():
    """The helpers' [1, N] row-major patch weights are what GkaVitForImageClassification takes as key_log_weights."""
    from hf_rbf import GkaVitConfig, GkaVitForImageClassification

    torch.manual_seed(0)
    model = GkaVitForImageClassification(GkaVitConfig.from_preset("mnist-tiny")).eval()  # 28 x 28, 7 x 7 patches
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    fisheye = warp_key_log_weights(fisheye_warp, 28, 28, 7, 7)
    assert fisheye.shape == (1, model.config.num_patches)
    flat = grid_key_log_weights(linear_warp(pixel_grid(28, 28)), 7, 7)  # equal areas: exactly the plain model
    with torch.no_grad():
        plain = model(pixel_values=x).logits
        torch.testing.assert_close(model(pixel_values=x, key_log_weights=flat).logits, plain, rtol=1e-5, atol=1e-5)
        weighted = model(pixel_values=x, key_log_weights=fisheye).logits
    assert torch.isfinite(weighted).all() and (weighted - plain).abs().max() > 1e-4
