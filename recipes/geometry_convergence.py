"""Attention over a warped image, a graded mesh and a point-cloud graph: weighted keys converge to the plane integral.

The domain is the square ``[-1, 1]^2`` of an *original* plane.  It is sampled unevenly, the way a lens or a
refined mesh does it: through the fisheye-like warp

    T(u, v) = (sinh(a(v) u) / sinh(a(v)), sinh(b v) / sinh(b)),   a(v) = 1.6 + 0.6 v,  b = 1.6,

a bijection of the square onto itself that packs samples near the centre (``|det J_T|`` is about 6x smaller there
than in the corners) and is not separable (the radial-like squeeze depends on ``v``).  Attention is used as a
kernel smoother: queries are points ``x`` of the square, keys the token positions ``y_j``, values ``f(y_j)``, and

    out(x) = sum_j exp(-gamma |x - y_j|^2 + log w_j) f(y_j) / sum_j exp(-gamma |x - y_j|^2 + log w_j)

is a quadrature of the continuous kernel average over the plane,

    S f(x) = integral exp(-gamma |x - y|^2) f(y) dy / integral exp(-gamma |x - y|^2) dy,

*if* ``w_j`` is the area token ``j`` stands for.  Without weights it converges to the average against the density
of samples instead, and refining does not help.  ``gka_attention`` smooths its own features (here the 2-D points),
so it must converge to ``S id(x)`` with the kernel ``exp(-|x - y|^2 / (2 sigma^2))``.  The targets are computed by a
Gauss-Legendre tensor quadrature of the square in numpy (no attention code; entire integrands, so 160 nodes per
axis are exact to round-off: the script prints the change from 160 to 240 nodes).

Token sets, at resolution ``n`` (``n x n`` tokens, or ``(n + 1)^2`` mesh vertices):

* ``warp_autograd``: a stored image of ``2n x 2n`` pixels, ``2 x 2`` patches, each token at ``T(patch centre)``;
  weights :func:`hf_rbf.geometry_warp.warp_key_log_weights` (``det J_T`` by autograd, Gauss-Legendre per patch).
* ``warp_grid``: the same tokens; weights :func:`hf_rbf.geometry_warp.grid_key_log_weights` from the
  ``grid_sample``-style grid of pixel centres (``det J`` by finite differences, no access to ``T``).
* ``mesh_barycentric`` / ``mesh_mixed_voronoi``: the ``(n + 1)^2`` vertices of a triangle mesh of the square, the
  uniform ``u``-grid jittered by up to a quarter cell and mapped through ``T`` (graded: fine near the centre),
  cells split along alternating diagonals; weights :func:`hf_rbf.geometry_mesh.mesh_key_log_weights`.
* ``graph_inverse_degree``: the same jittered, warped points without triangles, as an epsilon-ball graph
  (radius ``6 / n``, 1.3 to 4 times the spacing): weights :func:`hf_rbf.geometry_mesh.graph_key_log_weights` with
  ``weighting="inverse_degree"`` (a ball-count density estimate; biased by a factor up to 2-4 within one radius of
  the boundary, where the ball is cut off, so it converges at first order only and, up to ``n = 32``, is no better
  than no weights at all: not in the default table, ``--domains`` adds it).

Usage (writes geometry_convergence.csv / .md / .json / .png into --out-dir)::

    PYTHONPATH=$PWD python recipes/geometry_convergence.py --out-dir outputs/geometry_convergence
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
from hf_rbf.geometry_mesh import graph_key_log_weights, mesh_key_log_weights
from hf_rbf.geometry_warp import grid_key_log_weights, warp_key_log_weights

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from recipes import sphere_convergence  # noqa: E402  (its table and plot)

WARP_A0, WARP_A1, WARP_B = 1.6, 0.6, 1.6
GRAPH_RADIUS = 6.0  # the ball radius times n: covers the coarsest spacing (corners, 2.25 * 2 / n)
DOMAINS = ("warp_autograd", "warp_grid", "mesh_barycentric", "mesh_mixed_voronoi", "graph_inverse_degree")
# graph_inverse_degree is left out of the default table: on a domain with a boundary the ball-count weights are
# biased near it (see the module docstring); tests/test_geometry_mesh.py checks them on the sphere, which has none.
DEFAULT_DOMAINS = DOMAINS[:4]


# ----------------------------------------------------------------------------------------------------------------
# the warp, the test function and the exact smoothing
# ----------------------------------------------------------------------------------------------------------------


def fisheye_warp(uv: torch.Tensor) -> torch.Tensor:
    """``T(u, v)``: stored-image points ``[..., 2]`` -> original-plane points ``[..., 2]`` (torch, differentiable)."""
    u, v = uv[..., 0], uv[..., 1]
    a = WARP_A0 + WARP_A1 * v
    return torch.stack((torch.sinh(a * u) / torch.sinh(a), torch.sinh(WARP_B * v) / math.sinh(WARP_B)), dim=-1)


def target_function(p):
    """A smooth, non-symmetric ``f`` of points ``[..., 2]`` (numpy or torch)."""
    x, y = p[..., 0], p[..., 1]
    lib = torch if isinstance(p, torch.Tensor) else np
    return lib.cos(2.0 * x) + 0.5 * y * y + 0.6 * x * y + 0.3 * lib.sin(3.0 * y)


def square_quadrature(m: int):
    """Gauss-Legendre tensor rule on ``[-1, 1]^2``: nodes ``[m * m, 2]`` and weights ``[m * m]``."""
    x, w = np.polynomial.legendre.leggauss(m)
    pts = np.stack(np.meshgrid(x, x, indexing="xy"), axis=-1).reshape(-1, 2)
    return pts, np.outer(w, w).reshape(-1)


def exact_smoothed(queries: np.ndarray, gamma: float, gka_sigma: float, m: int = 160):
    """``S f`` (rbf kernel) ``[Nq]`` and ``S id`` (GKA kernel) ``[Nq, 2]`` at ``queries [Nq, 2]``, by quadrature."""
    pts, w = square_quadrature(m)
    d2 = ((queries[:, None, :] - pts[None, :, :]) ** 2).sum(-1)
    k = np.exp(-gamma * d2) * w
    s_f = (k * target_function(pts)).sum(-1) / k.sum(-1)
    k = np.exp(-d2 / (2.0 * gka_sigma**2)) * w
    s_id = (k @ pts) / k.sum(-1, keepdims=True)
    return s_f, s_id


def query_points(n: int = 128, seed: int = 0) -> np.ndarray:
    """Random points of the square plus its centre, corners and edge midpoints."""
    rng = np.random.default_rng(seed)
    special = np.array([[0, 0], [-1, -1], [1, -1], [-1, 1], [1, 1], [0, -1], [0, 1], [-1, 0], [1, 0.0]])
    return np.concatenate([special, rng.uniform(-1.0, 1.0, size=(n, 2))], 0)


# ----------------------------------------------------------------------------------------------------------------
# token sets: positions [N, 2] (float64) and key_log_weights [1, N], or None for the unweighted smoother
# ----------------------------------------------------------------------------------------------------------------


def warped_image_tokens(n: int, weights: str):
    """``n x n`` patches (``2 x 2`` pixels) of a ``2n x 2n`` image stored through :func:`fisheye_warp`."""
    pixels = 2 * n
    centres = -1.0 + (torch.arange(n, dtype=torch.float64) + 0.5) * (2.0 / n)
    uv = torch.stack(torch.meshgrid(centres, centres, indexing="xy"), dim=-1).reshape(-1, 2)  # row-major (y rows)
    positions = fisheye_warp(uv)
    if weights == "autograd":
        klw = warp_key_log_weights(fisheye_warp, pixels, pixels, 2, 2, dtype=torch.float64)
    else:
        pix = -1.0 + (torch.arange(pixels, dtype=torch.float64) + 0.5) * (2.0 / pixels)
        grid = fisheye_warp(torch.stack(torch.meshgrid(pix, pix, indexing="xy"), dim=-1))  # [H, W, 2]
        klw = grid_key_log_weights(grid, 2, 2)
    return positions, klw


def jittered_warped_vertices(n: int, seed: int = 0) -> torch.Tensor:
    """``(n + 1)^2`` points: the uniform ``u``-grid of the square, interior points jittered, mapped by ``T``."""
    rng = np.random.default_rng(seed + n)
    u = np.linspace(-1.0, 1.0, n + 1)
    uv = np.stack(np.meshgrid(u, u, indexing="xy"), axis=-1)
    jitter = rng.uniform(-0.25, 0.25, size=(n - 1, n - 1, 2)) * (2.0 / n)
    uv[1:-1, 1:-1] += jitter
    return fisheye_warp(torch.as_tensor(uv.reshape(-1, 2)))


def grid_triangles(n: int) -> torch.Tensor:
    """Faces ``[2 n^2, 3]`` of the ``(n + 1) x (n + 1)`` vertex grid, cells split along alternating diagonals."""
    faces = []
    for i in range(n):
        for j in range(n):
            a, b, c, d = i * (n + 1) + j, i * (n + 1) + j + 1, (i + 1) * (n + 1) + j + 1, (i + 1) * (n + 1) + j
            faces += [(a, b, c), (a, c, d)] if (i + j) % 2 == 0 else [(a, b, d), (b, c, d)]
    return torch.tensor(faces, dtype=torch.long)


def epsilon_graph(points: torch.Tensor, radius: float) -> torch.Tensor:
    """``edge_index [2, E]`` of the pairs closer than ``radius`` (each pair once, no self-loops)."""
    close = torch.cdist(points, points) < radius
    i, j = torch.triu(close, diagonal=1).nonzero(as_tuple=True)
    return torch.stack((i, j))


def make_tokens(domain: str, n: int):
    """Token positions ``[N, 2]`` and their ``key_log_weights`` ``[1, N]`` for one domain at resolution ``n``."""
    if domain == "warp_autograd":
        return warped_image_tokens(n, "autograd")
    if domain == "warp_grid":
        return warped_image_tokens(n, "grid")
    if domain in ("mesh_barycentric", "mesh_mixed_voronoi"):
        vertices = jittered_warped_vertices(n)
        scheme = domain[len("mesh_") :]
        return vertices, mesh_key_log_weights(vertices, grid_triangles(n), scheme=scheme)
    if domain == "graph_inverse_degree":
        points = jittered_warped_vertices(n)
        edges = epsilon_graph(points, GRAPH_RADIUS / n)
        return points, graph_key_log_weights(edges, points.shape[0], weighting="inverse_degree").double()
    raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")


# ----------------------------------------------------------------------------------------------------------------
# attention as the smoother
# ----------------------------------------------------------------------------------------------------------------


def rbf_smooth(positions, klw, queries: torch.Tensor, gamma: float) -> torch.Tensor:
    """``rbf_attention``: queries = query points, keys = token positions, values = f(positions): ``[Nq]``."""
    v = target_function(positions)[None, None, :, None]
    out = rbf_attention(queries[None, None], positions[None, None], v, gamma=gamma, causal=False, key_log_weights=klw)
    return out[0, 0, :, 0]


def gka_smooth(positions, klw, queries: torch.Tensor, sigma: float) -> torch.Tensor:
    """``gka_attention`` over the token positions as features (keys = values), eps = 0: ``[Nq, 2]``."""
    out = gka_attention(
        positions[None, None], math.log(sigma), causal=False, eps=0.0, key_log_weights=klw, query=queries[None, None]
    )
    return out[0, 0]


def convergence_table(
    resolutions=(8, 16, 32, 64, 128),
    domains=DEFAULT_DOMAINS,
    gamma: float = 2.0,
    gka_sigma: float = 0.5,
    num_queries: int = 128,
):
    """One row per (domain, n): max errors of the weighted and unweighted smoothers against the exact value."""
    qnp = query_points(num_queries)
    queries = torch.as_tensor(qnp, dtype=torch.float64)
    exact_f, exact_id = exact_smoothed(qnp, gamma, gka_sigma)
    rows = []
    for domain in domains:
        for n in resolutions:
            positions, klw = make_tokens(domain, n)
            row = {"domain": domain, "n": n, "num_keys": int(positions.shape[0])}
            for tag, weights in (("weighted", klw), ("unweighted", None)):
                out = rbf_smooth(positions, weights, queries, gamma).numpy()
                row[f"rbf_{tag}_max_err"] = float(np.abs(out - exact_f).max())
                out = gka_smooth(positions, weights, queries, gka_sigma).numpy()
                row[f"gka_{tag}_max_err"] = float(np.linalg.norm(out - exact_id, axis=-1).max())
            rows.append(row)
    return rows


COLUMNS = [
    "domain",
    "n",
    "num_keys",
    "rbf_weighted_max_err",
    "rbf_unweighted_max_err",
    "gka_weighted_max_err",
    "gka_unweighted_max_err",
]


def to_markdown(rows) -> str:
    return sphere_convergence.to_markdown(rows, COLUMNS)


def plot(rows, path: str, gamma: float, gka_sigma: float) -> None:
    sphere_convergence.plot(
        rows,
        path,
        gamma,
        gka_sigma,
        group="domain",
        weighted_label="weighted",
        xlabel="number of keys",
        suptitle="Attention over an unevenly sampled square vs the continuous kernel average over the plane",
        legend_space=0.12,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="outputs/geometry_convergence")
    ap.add_argument("--resolutions", default="8,16,32,64,128", help="comma-separated n (n x n tokens)")
    ap.add_argument(
        "--domains", default=",".join(DEFAULT_DOMAINS), help=f"comma-separated subset of {','.join(DOMAINS)}"
    )
    ap.add_argument("--gamma", type=float, default=2.0, help="rbf kernel exp(-gamma |x-y|^2)")
    ap.add_argument("--gka-sigma", type=float, default=0.5, help="GKA bandwidth sigma")
    ap.add_argument("--num-queries", type=int, default=128)
    ap.add_argument(
        "--doc",
        default=None,
        help="also rewrite the <!-- geometry_convergence:start/end --> block of this markdown file",
    )
    args = ap.parse_args(argv)
    domains = [d for d in args.domains.split(",") if d]
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        ap.error(f"--domains: unknown {unknown}; choose from {', '.join(DOMAINS)}")
    os.makedirs(args.out_dir, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    qnp = query_points(32)
    fine = exact_smoothed(qnp, args.gamma, args.gka_sigma, m=240)
    coarse = exact_smoothed(qnp, args.gamma, args.gka_sigma, m=160)
    check = max(float(np.abs(a - b).max()) for a, b in zip(fine, coarse))
    print(f"target quadrature, 160 vs 240 Gauss-Legendre nodes per axis: max diff {check:.2e}")

    t0 = time.time()
    resolutions = [int(s) for s in args.resolutions.split(",")]
    rows = convergence_table(resolutions, domains, args.gamma, args.gka_sigma, args.num_queries)
    md = to_markdown(rows)
    print(md)
    text = (
        f"Max error over {args.num_queries + 9} query points of attention (keys = tokens) against the continuous "
        f"kernel average over the square; rbf gamma={args.gamma:g}, GKA sigma={args.gka_sigma:g}, float64.  Target "
        f"by 160^2-node Gauss-Legendre quadrature (change at 240^2 nodes: {check:.1e}).\n\n" + md
    )
    with open(os.path.join(args.out_dir, "geometry_convergence.md"), "w") as f:
        f.write(text)
    if args.doc:
        with open(args.doc) as f:
            doc = f.read()
        pattern = re.compile(
            r"(<!-- geometry_convergence:start -->\n).*?(<!-- geometry_convergence:end -->)", re.DOTALL
        )
        if not pattern.search(doc):
            raise SystemExit(f"{args.doc} has no <!-- geometry_convergence:start --> ... :end --> block")
        given = argv if argv is not None else sys.argv[1:]
        cmd = "PYTHONPATH=$PWD python recipes/geometry_convergence.py " + " ".join(given)
        doc = pattern.sub(lambda m: m.group(1) + text + f"\nMade by `{cmd}`.\n" + m.group(2), doc, count=1)
        with open(args.doc, "w") as f:
            f.write(doc)
    with open(os.path.join(args.out_dir, "geometry_convergence.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out_dir, "geometry_convergence.json"), "w") as f:
        json.dump({"gamma": args.gamma, "gka_sigma": args.gka_sigma, "target_check": check, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(args.out_dir, "geometry_convergence.png"), args.gamma, args.gka_sigma)
    print(f"wrote {args.out_dir}/geometry_convergence.{{md,csv,json,png}} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
