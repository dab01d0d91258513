"""Mesh vertex areas and graph node measures as key_log_weights: hand-computed cases, an independent Voronoi
reference, and the convergence of weighted attention to the spherical integral over a sphere mesh / point cloud.

The convergence tests mesh the unit sphere by projecting a subdivided octahedron onto it: its triangles differ in
area by up to 7x (small near the octahedron's corners), so the unweighted smoother stalls at an O(0.1) error while
the area-weighted one converges at second order.  The target is the closed-form spherical kernel average of
recipes/sphere_convergence.py (Funk-Hecke, checked there against a direct quadrature).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_rbf import rbf_attention
from hf_rbf.geometry_mesh import (
    graph_key_log_weights,
    graph_node_degree,
    mesh_key_log_weights,
    mesh_vertex_areas,
    triangle_areas,
)
from recipes import sphere_convergence as sphere  # the module, not its names: pytest would collect test_function

GAMMA = 2.0
SQUARE = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
SQUARE_FACES = torch.tensor([[0, 1, 2], [0, 2, 3]])


def octahedron_sphere(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each octahedron face split into n^2 triangles, vertices projected onto the unit sphere (float64)."""
    pts, faces = [], []
    for sx in (1, -1):
        for sy in (1, -1):
            for sz in (1, -1):
                a, b, c = np.array([sx, 0, 0.0]), np.array([0, sy, 0.0]), np.array([0, 0, sz * 1.0])
                idx = {}
                for i in range(n + 1):
                    for j in range(n + 1 - i):
                        idx[i, j] = len(pts)
                        pts.append(a + (b - a) * i / n + (c - a) * j / n)
                for i in range(n):
                    for j in range(n - i):
                        faces.append((idx[i, j], idx[i + 1, j], idx[i, j + 1]))
                        if i + j < n - 1:
                            faces.append((idx[i + 1, j], idx[i + 1, j + 1], idx[i, j + 1]))
    unique, inverse = np.unique(np.round(np.array(pts), 12), axis=0, return_inverse=True)
    vertices = unique / np.linalg.norm(unique, axis=1, keepdims=True)
    return torch.as_tensor(vertices), torch.as_tensor(inverse.reshape(-1)[np.array(faces)])


# ---------------------------------------------------------------------------------------------------------------
# hand-computed cases
# ---------------------------------------------------------------------------------------------------------------


def test_unit_square_split_in_two_triangles():
    torch.testing.assert_close(triangle_areas(SQUARE, SQUARE_FACES), torch.tensor([0.5, 0.5], dtype=torch.float64))
    # barycentric: a third of each triangle; corners 0 and 2 touch both triangles
    bary = mesh_vertex_areas(SQUARE, SQUARE_FACES)
    torch.testing.assert_close(
        bary, torch.tensor([1 / 3, 1 / 6, 1 / 3, 1 / 6], dtype=torch.float64), rtol=0, atol=1e-15
    )
    # mixed Voronoi: right isosceles triangles, circumcentre at the square's centre -> four quarter squares
    voronoi = mesh_vertex_areas(SQUARE, SQUARE_FACES, scheme="mixed_voronoi")
    torch.testing.assert_close(voronoi, torch.full((4,), 0.25, dtype=torch.float64), rtol=0, atol=1e-15)
    klw = mesh_key_log_weights(SQUARE, SQUARE_FACES, eps=0.0)
    assert klw.shape == (1, 4)
    torch.testing.assert_close(klw[0], torch.log(torch.tensor([4 / 3, 2 / 3, 4 / 3, 2 / 3], dtype=torch.float64)))
    assert mesh_key_log_weights(SQUARE, SQUARE_FACES, scheme="mixed_voronoi", eps=0.0).abs().max() < 1e-15
    assert mesh_key_log_weights(SQUARE, SQUARE_FACES, batch_size=3).shape == (3, 4)


def test_obtuse_triangle_gives_half_to_the_obtuse_corner():
    v = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 0.25]], dtype=torch.float64)  # obtuse at vertex 2, area 1/4
    areas = mesh_vertex_areas(v, torch.tensor([[0, 1, 2]]), scheme="mixed_voronoi")
    torch.testing.assert_close(areas, torch.tensor([1 / 16, 1 / 16, 1 / 8], dtype=torch.float64), rtol=0, atol=1e-15)


def test_octahedron_surface_in_space():
    v = torch.tensor([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1.0]], dtype=torch.float64)
    f = torch.tensor([[a, b, c] for a in (0, 1) for b in (2, 3) for c in (4, 5)])
    face_area = math.sqrt(3) / 2  # equilateral, side sqrt(2)
    torch.testing.assert_close(triangle_areas(v, f), torch.full((8,), face_area, dtype=torch.float64))
    for scheme in ("barycentric", "mixed_voronoi"):  # each vertex touches 4 faces; by symmetry both give a sixth
        areas = mesh_vertex_areas(v, f, scheme=scheme)
        torch.testing.assert_close(areas, torch.full((6,), 4 * face_area / 3, dtype=torch.float64))
    # a batch sharing the faces: [B, V] areas and [B, V] log-weights, each row on its own
    north = v.clone()
    north[4, 2] = 3.0  # pull the north pole out: its 4 faces grow
    batch = torch.stack((v, 2.0 * v, north))
    areas = mesh_vertex_areas(batch, f)
    assert areas.shape == (3, 6)
    torch.testing.assert_close(areas[1], 4.0 * areas[0])
    klw = mesh_key_log_weights(batch, f)
    assert klw.shape == (3, 6)
    torch.testing.assert_close(klw[2], mesh_key_log_weights(batch[2], f)[0])
    assert float(klw[2, 4]) > float(klw[2, 0]) > float(klw[2, 5])  # 4, 2 and 0 grown faces


def _circumcentre_reference(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """Voronoi area of each vertex from the polygons (corner, edge midpoint, circumcentre, edge midpoint), planar."""
    out = np.zeros(vertices.shape[0])
    for face in faces:
        pts = vertices[face]
        a, b, c = pts
        d = 2 * (a[0] * (b[1] - c[1]) + b[0] * (c[1] - a[1]) + c[0] * (a[1] - b[1]))
        sa, sb, sc = (a**2).sum(), (b**2).sum(), (c**2).sum()
        centre = np.array(
            [
                (sa * (b[1] - c[1]) + sb * (c[1] - a[1]) + sc * (a[1] - b[1])) / d,
                (sa * (c[0] - b[0]) + sb * (a[0] - c[0]) + sc * (b[0] - a[0])) / d,
            ]
        )
        for k in range(3):
            p, q, r = pts[k], pts[(k + 1) % 3], pts[(k + 2) % 3]
            poly = np.array([p, (p + q) / 2, centre, (p + r) / 2])
            x, y = poly[:, 0], poly[:, 1]
            out[face[k]] += 0.5 * abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1)))
    return out


def _jittered_square_mesh(n: int, jitter: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    u = np.linspace(0.0, 1.0, n + 1)
    v = np.stack(np.meshgrid(u, u, indexing="xy"), -1)
    v[1:-1, 1:-1] += rng.uniform(-jitter, jitter, size=(n - 1, n - 1, 2)) / n
    faces = []
    for i in range(n):
        for j in range(n):
            a, b, c, d = i * (n + 1) + j, i * (n + 1) + j + 1, (i + 1) * (n + 1) + j + 1, (i + 1) * (n + 1) + j
            faces += [(a, b, c), (a, c, d)]
    return v.reshape(-1, 2), np.array(faces)


def _jittered_triangular_lattice(n: int, jitter: float, seed: int = 0):
    """Equilateral triangles (rows shifted by half a step), every vertex jittered: all angles stay acute."""
    rng = np.random.default_rng(seed)
    i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    vertices = np.stack((j + 0.5 * (i % 2), i * math.sqrt(3) / 2), -1).reshape(-1, 2).astype(np.float64)
    vertices += rng.uniform(-jitter, jitter, size=vertices.shape)
    faces = []
    for r in range(n):
        for c in range(n):
            a, b, d, e = r * (n + 1) + c, r * (n + 1) + c + 1, (r + 1) * (n + 1) + c, (r + 1) * (n + 1) + c + 1
            faces += [(a, b, d), (b, e, d)] if r % 2 == 0 else [(a, b, e), (a, e, d)]
    return vertices, np.array(faces)


def test_mixed_voronoi_matches_circumcentre_polygons():
    """Non-obtuse triangles: the cotangent formula against an independent construction of the Voronoi cells."""
    vertices, faces = _jittered_triangular_lattice(6, 0.05)
    tri = vertices[faces]
    for k in range(3):  # the reference is for non-obtuse triangles only
        assert (((tri[:, (k + 1) % 3] - tri[:, k]) * (tri[:, (k + 2) % 3] - tri[:, k])).sum(-1) >= 0).all()
    ours = mesh_vertex_areas(torch.as_tensor(vertices), torch.as_tensor(faces), scheme="mixed_voronoi")
    np.testing.assert_allclose(ours.numpy(), _circumcentre_reference(vertices, faces), rtol=1e-12, atol=0)


@pytest.mark.parametrize("scheme", ["barycentric", "mixed_voronoi"])
def test_vertex_areas_tile_the_mesh(scheme):
    vertices, faces = _jittered_square_mesh(7, 0.3, seed=3)  # strong jitter: obtuse triangles too
    v = torch.as_tensor(vertices)
    f = torch.as_tensor(faces)
    areas = mesh_vertex_areas(v, f, scheme=scheme)
    assert float(areas.sum()) == pytest.approx(float(triangle_areas(v, f).sum()), rel=1e-13)
    assert float(areas.sum()) == pytest.approx(1.0, rel=1e-13)
    assert bool((areas > 0).all())
    # float32 in, float32 out (computed in float64)
    assert mesh_vertex_areas(v.float(), f, scheme=scheme).dtype == torch.float32
    # a vertex no face uses gets 0, i.e. log(eps) after the log
    extra = torch.cat((v, torch.tensor([[5.0, 5.0]], dtype=torch.float64)))
    assert float(mesh_vertex_areas(extra, f, scheme=scheme)[-1]) == 0.0
    assert float(mesh_key_log_weights(extra, f, scheme=scheme, eps=1e-9)[0, -1]) == pytest.approx(
        math.log(1e-9), abs=1e-3
    )


def test_mesh_weights_multiply_the_kernel_in_rbf_attention():
    v, f = octahedron_sphere(3)
    q = torch.as_tensor(sphere.query_points(6))
    values = sphere.test_function(v)
    out = rbf_attention(
        q[None, None],
        v[None, None],
        values[None, None, :, None],
        gamma=GAMMA,
        causal=False,
        key_log_weights=mesh_key_log_weights(v, f, eps=0.0),
    )[0, 0, :, 0]
    k = torch.exp(-GAMMA * torch.cdist(q, v) ** 2) * mesh_vertex_areas(v, f)
    torch.testing.assert_close(out, (k * values).sum(-1) / k.sum(-1), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# convergence on a sphere mesh
# ---------------------------------------------------------------------------------------------------------------


def _sphere_errors(make, resolutions):
    q = sphere.query_points(64)
    exact = sphere.exact_smoothed(q, GAMMA)
    qt = torch.as_tensor(q)
    weighted, unweighted = [], []
    for n in resolutions:
        points, klw = make(n)
        for errs, weights in ((weighted, klw), (unweighted, None)):
            out = rbf_attention(
                qt[None, None],
                points[None, None],
                sphere.test_function(points)[None, None, :, None],
                gamma=GAMMA,
                causal=False,
                key_log_weights=weights,
            )
            errs.append(float(np.abs(out[0, 0, :, 0].numpy() - exact).max()))
    return np.array(weighted), np.array(unweighted)


@pytest.mark.parametrize("scheme", ["barycentric", "mixed_voronoi"])
def test_mesh_weighted_attention_converges_on_a_sphere_mesh(scheme):
    def make(n):
        v, f = octahedron_sphere(n)
        return v, mesh_key_log_weights(v, f, scheme=scheme)

    weighted, unweighted = _sphere_errors(make, (4, 8, 16, 32))
    # second order: about 4x per halving of the triangles' size
    assert (weighted[1:] < weighted[:-1] / 3).all(), weighted
    assert weighted[-1] < 2e-3, weighted
    # unweighted: converges to the average against the vertex density, 0.16 away from the spherical one
    assert unweighted.min() > 0.1 and unweighted[-1] > 0.9 * unweighted[1], unweighted
    assert unweighted[-1] > 50 * weighted[-1]


def test_graph_inverse_degree_converges_on_a_sphere_point_cloud():
    """The mesh's vertices as a point cloud: an epsilon-ball graph (radius 1.5 / sqrt(n)) and 1 / degree weights.

    No triangles, no areas: the ball count estimates the sampling density.  Slower than the mesh areas (the estimate
    has an O(radius^2) bias and a lattice noise that fall together only as the radius shrinks slower than the
    spacing), but it converges where no weights stall."""

    def make(n):
        v, _ = octahedron_sphere(n)
        close = torch.cdist(v, v) < 1.5 / math.sqrt(n)
        i, j = torch.triu(close, diagonal=1).nonzero(as_tuple=True)
        klw = graph_key_log_weights(torch.stack((i, j)), v.shape[0], weighting="inverse_degree")
        return v, klw.double()

    weighted, unweighted = _sphere_errors(make, (8, 16, 32))
    assert (weighted[1:] < weighted[:-1] / 1.5).all(), weighted
    assert weighted[-1] < 0.04, weighted
    assert unweighted.min() > 0.1, unweighted


# ---------------------------------------------------------------------------------------------------------------
# graphs: degrees by hand
# ---------------------------------------------------------------------------------------------------------------


TRIANGLE_PLUS_ISOLATED = torch.tensor([[0, 0, 1], [1, 2, 2]])  # edges 0-1, 0-2, 1-2; node 3 has none


def test_graph_degree_by_hand():
    e = TRIANGLE_PLUS_ISOLATED
    torch.testing.assert_close(graph_node_degree(e, 4), torch.tensor([2.0, 2.0, 2.0, 0.0]))
    torch.testing.assert_close(graph_node_degree(e, 4, direction="source"), torch.tensor([2.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(graph_node_degree(e, 4, direction="target"), torch.tensor([0.0, 1.0, 2.0, 0.0]))
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(
        graph_node_degree(e, 4, edge_weight=w), torch.tensor([3.0, 4.0, 5.0, 0.0], dtype=torch.float64)
    )
    batch = graph_node_degree(e, 4, edge_weight=torch.stack((w, 2 * w)))
    assert batch.shape == (2, 4)
    torch.testing.assert_close(batch[1], 2 * batch[0])
    # PyTorch Geometric's symmetric layout (each edge both ways): "source" gives the degree
    sym = torch.cat((e, e.flip(0)), dim=1)
    torch.testing.assert_close(graph_node_degree(sym, 4, direction="source"), graph_node_degree(e, 4))
    # a self-loop: once per endpoint it is added to
    loop = torch.tensor([[3], [3]])
    assert (
        float(graph_node_degree(loop, 4)[3]) == 2.0 and float(graph_node_degree(loop, 4, direction="source")[3]) == 1.0
    )


def test_graph_key_log_weights_by_hand():
    klw = graph_key_log_weights(TRIANGLE_PLUS_ISOLATED, 4, eps=1e-9)  # degrees 2, 2, 2, 0: mean 1.5
    assert klw.shape == (1, 4)
    torch.testing.assert_close(klw[0, :3], torch.full((3,), math.log(4 / 3 + 1e-9)))
    assert float(klw[0, 3]) == pytest.approx(math.log(1e-9), abs=1e-3)  # isolated: in effect no weight
    star = torch.tensor([[0, 0, 0], [1, 2, 3]])  # degrees 3, 1, 1, 1 -> inverse 1/3, 1, 1, 1, mean 5/6
    inv = graph_key_log_weights(star, 4, weighting="inverse_degree", eps=0.0)
    torch.testing.assert_close(inv[0], torch.log(torch.tensor([0.4, 1.2, 1.2, 1.2])))
    assert graph_key_log_weights(star, 4, batch_size=2).shape == (2, 4)
    w = torch.tensor([[1.0, 1.0, 1.0], [1.0, 2.0, 3.0]])
    assert graph_key_log_weights(star, 4, edge_weight=w).shape == (2, 4)


# ---------------------------------------------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: mesh_vertex_areas(SQUARE, SQUARE_FACES, scheme="cotan"), ValueError, "scheme.*'barycentric'"),
        (lambda: mesh_vertex_areas(SQUARE.long(), SQUARE_FACES), TypeError, "vertices"),
        (lambda: mesh_vertex_areas(SQUARE[:, :1], SQUARE_FACES), ValueError, r"vertices.*\[V, 2\|3\]"),
        (lambda: mesh_vertex_areas(SQUARE, SQUARE_FACES.double()), TypeError, "faces"),
        (lambda: mesh_vertex_areas(SQUARE, SQUARE_FACES[:, :2]), ValueError, r"faces.*\[F, 3\]"),
        (lambda: mesh_vertex_areas(SQUARE, SQUARE_FACES + 2), ValueError, r"faces.*\[0, 3\]"),
        (lambda: mesh_vertex_areas(SQUARE, torch.tensor([[0, 1, 1]])), ValueError, "distinct"),
        (lambda: triangle_areas(SQUARE * float("nan"), SQUARE_FACES), ValueError, "finite"),
        (lambda: graph_node_degree(TRIANGLE_PLUS_ISOLATED, 4, direction="in"), ValueError, "direction.*'both'"),
        (lambda: graph_node_degree(TRIANGLE_PLUS_ISOLATED, 0), ValueError, "num_nodes"),
        (lambda: graph_node_degree(TRIANGLE_PLUS_ISOLATED, 2), ValueError, r"edge_index.*\[0, 1\]"),
        (lambda: graph_node_degree(TRIANGLE_PLUS_ISOLATED.T, 4), ValueError, r"edge_index.*\[2, E\]"),
        (lambda: graph_node_degree(TRIANGLE_PLUS_ISOLATED.float(), 4), TypeError, "edge_index"),
        (lambda: graph_node_degree(TRIANGLE_PLUS_ISOLATED, 4, edge_weight=torch.ones(2)), ValueError, "edge_weight"),
        (lambda: graph_node_degree(TRIANGLE_PLUS_ISOLATED, 4, edge_weight=-torch.ones(3)), ValueError, ">= 0"),
        (lambda: graph_key_log_weights(TRIANGLE_PLUS_ISOLATED, 4, weighting="area"), ValueError, "weighting"),
        (
            lambda: graph_key_log_weights(TRIANGLE_PLUS_ISOLATED, 4, weighting="inverse_degree"),
            ValueError,
            "node 3 has 0",
        ),
    ],
)
def test_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
