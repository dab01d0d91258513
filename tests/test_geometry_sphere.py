"""Sphere grids, per-token measures and the convergence of area-weighted attention to the spherical integral.

The convergence tests use attention (rbf_attention, gka_attention) as a kernel smoother over a sphere grid and
compare it with the continuous kernel average, computed in closed form here (Funk-Hecke; checked against a direct
numpy quadrature below).  They assert both that the area-weighted smoother converges (error -> ~0 at second order on
the equiangular grid, to round-off on the Gauss-Legendre grid) and that the unweighted one stalls at a clearly
non-zero error: dropping the weights fails them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_rbf import gka_attention, rbf_attention
from hf_rbf.geometry_measure import log_weights_from_measure
from hf_rbf.geometry_sphere import (
    equiangular_grid,
    gauss_legendre_grid,
    latlon_grid_from_edges,
    sphere_points,
)


FOUR_PI = 4 * math.pi
GAMMA = 2.0  # rbf kernel exp(-GAMMA |x - y|^2), i.e. exp(KAPPA x.y) up to a constant
KAPPA = 2 * GAMMA
GKA_SIGMA = 0.5


# ---------------------------------------------------------------------------------------------------------------
# an independent statement of the continuous target
# ---------------------------------------------------------------------------------------------------------------


def f_parts(p):
    x, y, z = p[..., 0], p[..., 1], p[..., 2]
    return 1.0 + 0 * x, 0.7 * x - 0.4 * z + 0.2 * y, (3 * z * z - 1) + 1.5 * x * y - 0.5 * y * z


def f(p):
    a, b, c = f_parts(p)
    return a + b + c


def ratios(kappa):
    coth = 1 / math.tanh(kappa)
    return coth - 1 / kappa, 1 + 3 / kappa**2 - 3 * coth / kappa


def exact_rbf_smoothing(q):
    r1, r2 = ratios(KAPPA)
    a, b, c = f_parts(q)
    return a + r1 * b + r2 * c


def queries(n=96, seed=1):
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=-1, keepdims=True)
    poles = np.array([[0, 0, 1.0], [0, 0, -1.0], [np.sin(0.1), 0, np.cos(0.1)], [1.0, 0, 0]])
    return np.concatenate([poles, v])


def test_closed_form_matches_direct_quadrature():
    q = queries(12)
    x, wx = np.polynomial.legendre.leggauss(96)
    phi = np.arange(192) * (2 * math.pi / 192)
    s = np.sqrt(1 - x**2)
    pts = np.stack([np.outer(s, np.cos(phi)).ravel(), np.outer(s, np.sin(phi)).ravel(), np.repeat(x, 192)], -1)
    w = np.repeat(wx, 192)
    k = np.exp(-GAMMA * ((q[:, None, :] - pts[None]) ** 2).sum(-1)) * w
    direct = (k * f(pts)).sum(-1) / k.sum(-1)
    np.testing.assert_allclose(direct, exact_rbf_smoothing(q), rtol=0, atol=1e-11)


# ---------------------------------------------------------------------------------------------------------------
# grids and measures
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid",
    [
        equiangular_grid(7, 12, dtype=torch.float64),
        equiangular_grid(9, dtype=torch.float64, poles=True),
        gauss_legendre_grid(6, dtype=torch.float64),
        latlon_grid_from_edges([0.0, 0.2, 1.0, 1.1, 2.5, math.pi], 5, dtype=torch.float64),
    ],
    ids=["equiangular", "equiangular_poles", "gauss_legendre", "edges"],
)
def test_grid_points_and_total_area(grid):
    n_lat, n_lon = grid.shape
    assert grid.points.shape == (n_lat * n_lon, 3)
    torch.testing.assert_close(grid.points.norm(dim=-1), torch.ones(grid.num_points, dtype=torch.float64))
    torch.testing.assert_close(grid.points, sphere_points(grid.colatitude, grid.longitude))
    assert float(grid.weights.sum()) == pytest.approx(FOUR_PI, rel=1e-12)
    assert bool((grid.weights > 0).all())
    # row by row, north to south, longitude fastest
    assert bool((grid.colatitude.view(n_lat, n_lon).diff(dim=0) > 0).all())
    klw = grid.key_log_weights()
    assert klw.shape == (1, grid.num_points) and bool(torch.isfinite(klw).all())
    assert grid.key_log_weights(batch_size=3).shape == (3, grid.num_points)


def test_equiangular_cell_centre_area_is_proportional_to_sin():
    g = equiangular_grid(10, 20, dtype=torch.float64)
    ratio = g.weights / torch.sin(g.colatitude)
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(ratio[0])))
    # "area" and the blog's "sin" rule are the same grid without poles
    torch.testing.assert_close(equiangular_grid(10, 20, dtype=torch.float64, weighting="sin").weights, g.weights)
    assert float(g.colatitude.min()) > 0 and float(g.colatitude.max()) < math.pi  # no row on a pole


def test_pole_rows():
    g = equiangular_grid(9, 16, dtype=torch.float64, poles=True)
    pole = g.colatitude == 0
    assert int(pole.sum()) == 16
    cap = 2 * math.pi * (1 - math.cos(math.pi / 8 / 2))  # cap of half-width dtheta/2, shared by the 16 copies
    torch.testing.assert_close(g.weights[pole], torch.full((16,), cap / 16, dtype=torch.float64))
    s = equiangular_grid(9, 16, dtype=torch.float64, poles=True, weighting="sin")
    klw = s.key_log_weights(eps=1e-12)
    assert bool(torch.isfinite(klw).all())
    assert float(klw[0, pole].max()) < -25  # sin(0) = 0 -> log(eps): the pole copies are in effect dropped
    assert float(s.weights.sum()) == pytest.approx(FOUR_PI, rel=1e-12)


def test_gauss_legendre_is_exact_for_band_limited_functions():
    g = gauss_legendre_grid(8, 17, dtype=torch.float64)
    x, y, z = g.points.unbind(-1)
    assert float(g.integrate(z**2)) == pytest.approx(FOUR_PI / 3, rel=1e-13)
    assert float(g.integrate(z**10)) == pytest.approx(FOUR_PI / 11, rel=1e-13)
    assert float(g.integrate(x**2 * y**2)) == pytest.approx(FOUR_PI / 15, rel=1e-12)
    assert abs(float(g.integrate(x * z))) < 1e-14


def test_log_weights_from_measure_shapes_and_invariances():
    m = torch.tensor([1.0, 2.0, 4.0, 1.0], dtype=torch.float64)
    lw = log_weights_from_measure(m, eps=0.0)
    assert lw.shape == (1, 4)
    torch.testing.assert_close(lw[0], torch.log(m / m.mean()))
    torch.testing.assert_close(log_weights_from_measure(37.5 * m), log_weights_from_measure(m))  # only ratios
    assert log_weights_from_measure(np.ones(5)).abs().max() < 1e-6  # equal cells: exactly the plain attention
    assert log_weights_from_measure(m, batch_size=3).shape == (3, 4)
    assert log_weights_from_measure(torch.rand(2, 3, 4) + 0.1).shape == (2, 3, 4)
    assert log_weights_from_measure(torch.rand(2, 4) + 0.1).shape == (2, 4)
    zero = log_weights_from_measure(torch.tensor([0.0, 1.0, 1.0]), eps=1e-9)
    assert bool(torch.isfinite(zero).all()) and float(zero[0, 0]) == pytest.approx(math.log(1e-9), abs=1e-3)
    assert log_weights_from_measure([1, 2, 3]).dtype == torch.float32
    assert log_weights_from_measure(m, dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(measure=[-1.0, 1.0]), ">= 0"),
        (dict(measure=[0.0, 0.0]), "positive total"),
        (dict(measure=[1.0, float("nan")]), "finite"),
        (dict(measure=torch.ones(2, 2, 2, 2)), r"\[N\], \[B, N\] or \[B, H, N\]"),
        (dict(measure=[1.0, 2.0], eps=-1.0), "eps"),
        (dict(measure=torch.ones(2, 3), batch_size=4), "batch_size"),
    ],
)
def test_log_weights_from_measure_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        log_weights_from_measure(**bad)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: equiangular_grid(0), "n_lat"),
        (lambda: equiangular_grid(1, poles=True), "n_lat"),
        (lambda: equiangular_grid(4, weighting="cos"), "weighting"),
        (lambda: gauss_legendre_grid(4, 0), "n_lon"),
        (lambda: latlon_grid_from_edges([0.0, 1.0, 0.5], 4), "increasing"),
    ],
)
def test_grid_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_key_log_weights_multiply_the_kernel():
    """Through rbf_attention, key_log_weights = log w is the same as multiplying each key's kernel by w."""
    g = latlon_grid_from_edges(np.linspace(0, math.pi, 6) ** 1.0, 7, dtype=torch.float64)
    q = torch.as_tensor(queries(5), dtype=torch.float64)
    out = rbf_attention(
        q[None, None], g.points[None, None], f(g.points)[None, None, :, None], gamma=GAMMA, causal=False,
        key_log_weights=g.key_log_weights(eps=0.0),
    )[0, 0, :, 0]
    k = torch.exp(-GAMMA * torch.cdist(q, g.points) ** 2) * g.weights
    ref = (k * f(g.points)).sum(-1) / k.sum(-1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# convergence: the weighted smoother converges to the spherical integral, the unweighted one does not
# ---------------------------------------------------------------------------------------------------------------


RESOLUTIONS = (8, 16, 32, 64)


def rbf_errors(make_grid, weighted):
    q = queries()
    exact = exact_rbf_smoothing(q)
    qt = torch.as_tensor(q, dtype=torch.float64)
    errs = []
    for n in RESOLUTIONS:
        g = make_grid(n)
        out = rbf_attention(
            qt[None, None], g.points[None, None], f(g.points)[None, None, :, None], gamma=GAMMA, causal=False,
            key_log_weights=g.key_log_weights() if weighted else None,
        )
        errs.append(float(np.abs(out[0, 0, :, 0].numpy() - exact).max()))
    return np.array(errs)


def gka_errors(make_grid, weighted):
    q = queries()
    exact = ratios(1 / GKA_SIGMA**2)[0] * q  # GKA smooths its own features: the identity map
    qt = torch.as_tensor(q, dtype=torch.float64)
    errs = []
    for n in RESOLUTIONS:
        g = make_grid(n)
        out = gka_attention(
            g.points[None, None], math.log(GKA_SIGMA), causal=False, eps=0.0, query=qt[None, None],
            key_log_weights=g.key_log_weights() if weighted else None,
        )
        errs.append(float(np.linalg.norm(out[0, 0].numpy() - exact, axis=-1).max()))
    return np.array(errs)


def irregular(n):
    rng = np.random.default_rng(n)
    steps = rng.uniform(0.4, 1.6, size=n)
    return latlon_grid_from_edges(np.concatenate([[0], np.cumsum(steps)]) * (math.pi / steps.sum()), 2 * n,
                                  dtype=torch.float64)


GRIDS = {
    "equiangular": lambda n: equiangular_grid(n, dtype=torch.float64),
    "equiangular_poles": lambda n: equiangular_grid(n + 1, dtype=torch.float64, poles=True),
    "irregular": irregular,
}


@pytest.mark.parametrize("errors", [rbf_errors, gka_errors], ids=["rbf", "gka"])
@pytest.mark.parametrize("kind", list(GRIDS))
def test_weighted_attention_converges_at_second_order(kind, errors):
    weighted = errors(GRIDS[kind], True)
    unweighted = errors(GRIDS[kind], False)
    # area-weighted: the midpoint rule's O(h^2), about 4x per doubling of n_lat, small at the finest grid
    assert weighted[-1] < 1e-3, weighted
    assert weighted[-1] < weighted[-2] / 3 and weighted[-2] < weighted[-3] / 3, weighted
    # unweighted: stalls at an O(1) error; refining the grid does not help
    assert unweighted.min() > 0.1, unweighted
    assert unweighted[-1] > 0.5 * unweighted[0], unweighted
    assert unweighted[-1] > 100 * weighted[-1]


@pytest.mark.parametrize("errors", [rbf_errors, gka_errors], ids=["rbf", "gka"])
def test_gauss_legendre_weighted_attention_is_exact_to_round_off(errors):
    make = lambda n: gauss_legendre_grid(n, dtype=torch.float64)  # noqa: E731
    weighted = errors(make, True)
    unweighted = errors(make, False)
    assert weighted[1:].max() < 1e-10, weighted  # spectral: the smooth integrand is resolved at n_lat = 16
    assert unweighted.min() > 0.1, unweighted


def test_convergence_in_float32():
    """The same in float32, the dtype models use: weighted reaches ~1e-3, unweighted stays O(1)."""
    q = torch.as_tensor(queries(), dtype=torch.float32)
    exact = exact_rbf_smoothing(queries())
    g = equiangular_grid(48)
    out_w = rbf_attention(q[None, None], g.points[None, None], f(g.points)[None, None, :, None], gamma=GAMMA,
                          causal=False, key_log_weights=g.key_log_weights())[0, 0, :, 0]
    out_u = rbf_attention(q[None, None], g.points[None, None], f(g.points)[None, None, :, None], gamma=GAMMA,
                          causal=False)[0, 0, :, 0]
    assert np.abs(out_w.double().numpy() - exact).max() < 2e-3
    assert np.abs(out_u.double().numpy() - exact).max() > 0.3
