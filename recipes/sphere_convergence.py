"""Attention as a kernel smoother on the sphere: area-weighted keys converge to the continuous integral.

Keys are the points ``y_j`` of a sphere grid, queries are points ``x`` on the sphere, values are samples of a known
smooth function ``f``.  Attention with the Gaussian kernel in 3-D chordal distance,

    out(x) = sum_j exp(-gamma |x - y_j|^2 + log w_j) f(y_j) / sum_j exp(-gamma |x - y_j|^2 + log w_j),

is a quadrature of the continuous spherical kernel average

    S f(x) = integral exp(-gamma |x - y|^2) f(y) dA(y) / integral exp(-gamma |x - y|^2) dA(y),

*if* ``w_j`` is the area of cell ``j``.  Without the weights (``log w_j = 0``) it converges instead to the average
against the density of grid points, which on a latitude-longitude grid grows like ``1 / sin(colatitude)``: the
error stalls at a non-zero value however fine the grid.

The target is computed in closed form.  On the unit sphere ``|x - y|^2 = 2 - 2 x.y``, so the kernel is
``exp(kappa x.y)`` up to a constant, ``kappa = 2 gamma``, and by the Funk-Hecke formula a spherical harmonic
``Y_l`` of degree ``l`` is an eigenfunction: ``integral exp(kappa x.y) Y_l(y) dA(y) = 4 pi i_l(kappa) Y_l(x)``, with
``i_l`` the modified spherical Bessel functions.  Our ``f`` mixes degrees 0, 1 and 2, so
``S f = f_0 + r_1(kappa) f_1 + r_2(kappa) f_2`` with ``r_1 = coth(kappa) - 1/kappa`` (the Langevin function) and
``r_2 = 1 + 3/kappa^2 - 3 coth(kappa)/kappa``.  The script also checks the closed form against a direct
512 x 1024 Gauss-Legendre quadrature in numpy (no attention code involved) and prints the difference.

Two attention functions are exercised: ``rbf_attention`` smoothing ``f`` (values = ``f(y_j)``), and
``gka_attention``, whose values are its own features: with the 3-D points as features it smooths the identity map,
``S id(x) = r_1(1/sigma^2) x``.

Usage (writes sphere_convergence.csv / .md / .json / .png into --out-dir)::

    PYTHONPATH=$PWD python recipes/sphere_convergence.py --out-dir outputs/sphere
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch

from hf_rbf import gka_attention, rbf_attention
from hf_rbf.geometry_sphere import (
    SphereGrid,
    equiangular_grid,
    gauss_legendre_grid,
    latlon_grid_from_edges,
)


# ----------------------------------------------------------------------------------------------------------------
# the test function and its exact smoothing
# ----------------------------------------------------------------------------------------------------------------


def test_function_parts(p):
    """Degree 0, 1 and 2 parts of ``f`` at points ``p [..., 3]`` (numpy or torch)."""
    x, y, z = p[..., 0], p[..., 1], p[..., 2]
    f0 = 1.0 + 0.0 * x
    f1 = 0.8 * x - 0.5 * z + 0.3 * y
    f2 = 0.75 * (3.0 * z * z - 1.0) + 2.0 * x * y - 0.6 * x * z  # harmonic (trace-free) quadratics
    return f0, f1, f2


def test_function(p):
    f0, f1, f2 = test_function_parts(p)
    return f0 + f1 + f2


def smoothing_ratios(kappa: float) -> tuple[float, float]:
    """``i_1(kappa)/i_0(kappa)`` and ``i_2(kappa)/i_0(kappa)`` without overflow (``kappa > 0``)."""
    coth = 1.0 / math.tanh(kappa)
    return coth - 1.0 / kappa, 1.0 + 3.0 / kappa**2 - 3.0 * coth / kappa


def exact_smoothed(queries: np.ndarray, gamma: float) -> np.ndarray:
    """Closed-form ``S f`` at ``queries [Nq, 3]`` for the kernel ``exp(-gamma |x - y|^2)``."""
    r1, r2 = smoothing_ratios(2.0 * gamma)
    f0, f1, f2 = test_function_parts(queries)
    return f0 + r1 * f1 + r2 * f2


def quadrature_smoothed(queries: np.ndarray, gamma: float, n_lat: int = 512) -> np.ndarray:
    """``S f`` by a direct Gauss-Legendre quadrature in numpy: an independent check of the closed form."""
    x, wx = np.polynomial.legendre.leggauss(n_lat)
    n_lon = 2 * n_lat
    phi = np.arange(n_lon) * (2 * math.pi / n_lon)
    s = np.sqrt(1 - x**2)
    pts = np.stack(
        [np.outer(s, np.cos(phi)).ravel(), np.outer(s, np.sin(phi)).ravel(), np.repeat(x, n_lon)], axis=-1
    )
    w = np.repeat(wx, n_lon) * (2 * math.pi / n_lon)
    fy = test_function(pts)
    out = np.empty(queries.shape[0])
    for i, q in enumerate(queries):
        k = np.exp(-gamma * ((pts - q) ** 2).sum(-1)) * w
        out[i] = (k * fy).sum() / k.sum()
    return out


def query_points(n: int = 256, seed: int = 0) -> np.ndarray:
    """Random points on the sphere plus both poles and a few points near them and on the equator."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=-1, keepdims=True)
    theta = np.array([0.0, math.pi, 0.05, math.pi - 0.05, math.pi / 2, math.pi / 2, 0.3])
    phi = np.array([0.0, 0.0, 1.0, 2.0, 0.0, 2.5, 4.0])
    special = np.stack([np.sin(theta) * np.cos(phi), np.sin(theta) * np.sin(phi), np.cos(theta)], -1)
    return np.concatenate([special, v], 0)


# ----------------------------------------------------------------------------------------------------------------
# attention as the smoother
# ----------------------------------------------------------------------------------------------------------------


def rbf_smooth(grid: SphereGrid, queries: torch.Tensor, gamma: float, weighted: bool) -> torch.Tensor:
    """``rbf_attention`` with queries = query points, keys = grid points, values = f(grid points): ``[Nq]``."""
    q = queries[None, None]
    k = grid.points[None, None]
    v = test_function(grid.points)[None, None, :, None]
    klw = grid.key_log_weights() if weighted else None
    out = rbf_attention(q, k, v, gamma=gamma, causal=False, key_log_weights=klw)
    return out[0, 0, :, 0]


def gka_smooth(grid: SphereGrid, queries: torch.Tensor, sigma: float, weighted: bool) -> torch.Tensor:
    """``gka_attention`` over the grid points as features (keys = values = points), eps = 0: ``[Nq, 3]``."""
    klw = grid.key_log_weights() if weighted else None
    out = gka_attention(
        grid.points[None, None],
        math.log(sigma),
        causal=False,
        eps=0.0,
        key_log_weights=klw,
        query=queries[None, None],
    )
    return out[0, 0]


def make_grid(kind: str, n_lat: int, seed: int = 0) -> SphereGrid:
    """The grids of the study, in float64.  "irregular": band edges jittered at random (arbitrary cell areas)."""
    if kind == "equiangular":
        return equiangular_grid(n_lat, dtype=torch.float64)
    if kind == "equiangular_poles":
        return equiangular_grid(n_lat + 1, dtype=torch.float64, poles=True)
    if kind == "equiangular_poles_sin":
        return equiangular_grid(n_lat + 1, dtype=torch.float64, poles=True, weighting="sin")
    if kind == "gauss_legendre":
        return gauss_legendre_grid(n_lat, dtype=torch.float64)
    if kind == "irregular":
        rng = np.random.default_rng(seed + n_lat)
        steps = rng.uniform(0.4, 1.6, size=n_lat)
        edges = np.concatenate([[0.0], np.cumsum(steps)]) * (math.pi / steps.sum())
        return latlon_grid_from_edges(edges, 2 * n_lat, dtype=torch.float64)
    raise ValueError(f"unknown grid kind {kind!r}")


GRID_KINDS = ("equiangular", "gauss_legendre", "equiangular_poles", "equiangular_poles_sin", "irregular")


def convergence_table(
    resolutions=(8, 16, 32, 64, 128),
    kinds=GRID_KINDS,
    gamma: float = 2.0,
    gka_sigma: float = 0.5,
    num_queries: int = 256,
):
    """One row per (grid kind, n_lat): max errors of the weighted and unweighted smoothers against the exact value."""
    qnp = query_points(num_queries)
    queries = torch.as_tensor(qnp, dtype=torch.float64)
    exact_rbf = exact_smoothed(qnp, gamma)
    r1_gka, _ = smoothing_ratios(1.0 / gka_sigma**2)
    exact_gka = r1_gka * qnp
    rows = []
    for kind in kinds:
        for n_lat in resolutions:
            grid = make_grid(kind, n_lat)
            row = {"grid": kind, "n_lat": grid.shape[0], "n_lon": grid.shape[1], "num_keys": grid.num_points}
            for weighted in (True, False):
                tag = "weighted" if weighted else "unweighted"
                out = rbf_smooth(grid, queries, gamma, weighted).numpy()
                row[f"rbf_{tag}_max_err"] = float(np.abs(out - exact_rbf).max())
                out = gka_smooth(grid, queries, gka_sigma, weighted).numpy()
                row[f"gka_{tag}_max_err"] = float(np.linalg.norm(out - exact_gka, axis=-1).max())
            rows.append(row)
    return rows


COLUMNS = [
    "grid",
    "n_lat",
    "n_lon",
    "num_keys",
    "rbf_weighted_max_err",
    "rbf_unweighted_max_err",
    "gka_weighted_max_err",
    "gka_unweighted_max_err",
]


def to_markdown(rows, columns=COLUMNS) -> str:
    """The rows as a markdown table (floats in scientific notation); also used by ``geometry_convergence.py``."""
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    body = ""
    for r in rows:
        cells = [f"{r[c]:.2e}" if isinstance(r[c], float) else str(r[c]) for c in columns]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def plot(
    rows,
    path: str,
    gamma: float,
    gka_sigma: float,
    *,
    group: str = "grid",
    weighted_label: str = "area-weighted",
    xlabel: str = "number of keys (grid points)",
    suptitle: str = "Attention over a sphere grid vs the continuous spherical kernel average",
    legend_space: float = 0.1,
) -> None:
    """Max error against the number of keys, weighted and unweighted, one curve pair per value of ``group``, for rbf
    and gka side by side; also used by ``geometry_convergence.py``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r[group] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op, title in (
        (axes[0], "rbf", f"rbf_attention smoothing f (gamma={gamma:g})"),
        (axes[1], "gka", f"gka_attention smoothing the identity (sigma={gka_sigma:g})"),
    ):
        for i, kind in enumerate(kinds):
            rs = [r for r in rows if r[group] == kind]
            n = [r["num_keys"] for r in rs]
            c = colors[i % len(colors)]
            ax.loglog(n, [r[f"{op}_weighted_max_err"] for r in rs], "o-", color=c, label=f"{kind}, {weighted_label}")
            ax.loglog(n, [r[f"{op}_unweighted_max_err"] for r in rs], "x--", color=c, label=f"{kind}, unweighted")
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("max |attention - continuous integral| over queries")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=len(kinds))
    fig.suptitle(suptitle)
    fig.tight_layout(rect=(0, legend_space, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="outputs/sphere_convergence")
    ap.add_argument("--resolutions", default="8,16,32,64,128", help="comma-separated n_lat values")
    ap.add_argument("--gamma", type=float, default=2.0, help="rbf kernel exp(-gamma |x-y|^2)")
    ap.add_argument("--gka-sigma", type=float, default=0.5, help="GKA bandwidth sigma")
    ap.add_argument("--num-queries", type=int, default=256)
    ap.add_argument("--doc", default=None,
                    help="also rewrite the <!-- sphere_convergence:start/end --> block of this markdown file")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    qnp = query_points(32)
    check = float(np.abs(quadrature_smoothed(qnp, args.gamma) - exact_smoothed(qnp, args.gamma)).max())
    print(f"closed form vs 512x1024 Gauss-Legendre numpy quadrature: max diff {check:.2e}")

    t0 = time.time()
    resolutions = [int(s) for s in args.resolutions.split(",")]
    rows = convergence_table(resolutions, GRID_KINDS, args.gamma, args.gka_sigma, args.num_queries)
    md = to_markdown(rows)
    print(md)
    text = (
        f"Max error over {args.num_queries + 7} query points of attention (keys = grid points) against the "
        f"closed-form spherical kernel average; rbf gamma={args.gamma:g}, GKA sigma={args.gka_sigma:g}, "
        f"float64.  Closed form checked against a direct quadrature: max diff {check:.1e}.\n\n" + md
    )
    with open(os.path.join(args.out_dir, "sphere_convergence.md"), "w") as f:
        f.write(text)
    if args.doc:
        with open(args.doc) as f:
            doc = f.read()
        pattern = re.compile(r"(<!-- sphere_convergence:start -->\n).*?(<!-- sphere_convergence:end -->)", re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{args.doc} has no <!-- sphere_convergence:start --> ... :end --> block")
        given = argv if argv is not None else sys.argv[1:]
        cmd = "PYTHONPATH=$PWD python recipes/sphere_convergence.py " + " ".join(given)
        doc = pattern.sub(lambda m: m.group(1) + text + f"\nMade by `{cmd}`.\n" + m.group(2), doc, count=1)
        with open(args.doc, "w") as f:
            f.write(doc)
    with open(os.path.join(args.out_dir, "sphere_convergence.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out_dir, "sphere_convergence.json"), "w") as f:
        json.dump(
            {"gamma": args.gamma, "gka_sigma": args.gka_sigma, "closed_form_check": check, "rows": rows}, f, indent=1
        )
    plot(rows, os.path.join(args.out_dir, "sphere_convergence.png"), args.gamma, args.gka_sigma)
    print(f"wrote {args.out_dir}/sphere_convergence.{{md,csv,json,png}} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
