"""Meshes and graphs: per-node measures, ready to be used as attention keys (``key_log_weights``).

When the tokens are the vertices of a triangle mesh (a surface, or a planar domain meshed finer where it matters),
each vertex stands for the piece of surface around it, and those pieces differ: a mesh refined near a feature has
many small vertex cells there and few large ones elsewhere.  Plain attention averages against the density of
vertices; weighting each key by its vertex area turns it into a quadrature of the continuous kernel average over the
surface (see :mod:`hf_rbf.geometry_measure` for the argument).  Two standard vertex areas:

* ``"barycentric"`` (lumped mass): each triangle gives a third of its area to each of its corners.  The rule
  ``sum_v A_v f(v)`` is then *exactly* the integral of the piecewise-linear interpolant of ``f``, so it converges at
  second order on any shape-regular mesh, however graded.
* ``"mixed_voronoi"`` (Meyer, Desbrun, Schroeder and Barr, "Discrete differential-geometry operators for
  triangulated 2-manifolds", 2003): the area of the vertex's Voronoi cell inside each non-obtuse triangle
  (``(|PR|^2 cot Q + |PQ|^2 cot R) / 8`` for corner ``P``), and for an obtuse triangle half its area to the obtuse
  corner and a quarter to each other corner (the Voronoi cell would leave the triangle).  The cells still tile the
  surface, and on a regular grid every interior vertex gets the same area (the barycentric rule favours the corners
  where more triangles meet).

For a graph without geometry the natural measure of a node is its degree (the sum of the weights of its edges):
the volume of spectral graph theory (``vol(S) = sum_{i in S} d_i``), the stationary distribution of the random
walk, and the mass matrix of the normalised graph Laplacian.  When the graph is a neighbourhood graph of points
sampled with an uneven density (an epsilon-ball or k-NN graph of a point cloud), the degree grows *with* the local
density, so the cell a node stands for shrinks like ``1 / degree``: ``weighting="inverse_degree"`` gives that
density-compensating measure (the area per point of a ball-count density estimate).  Nodes of degree 0 get a zero
measure (``log(eps)`` after the log) with ``"degree"``, and an error with ``"inverse_degree"``.  When the cell areas
of the nodes are known (a graph that is the dual of a mesh, a Voronoi diagram of the nodes), pass them to
:func:`hf_rbf.geometry_measure.log_weights_from_measure` directly.

Tensors in, tensors out: vertices ``[V, 2]`` / ``[V, 3]`` or a batch ``[B, V, 2|3]`` sharing one ``faces [F, 3]``
(a mesh deforming over time, a batch of poses), edge weights ``[E]`` or ``[B, E]`` sharing one ``edge_index``.  The
areas are computed in float64 and returned in the vertices' dtype; the log-weights are ``[1, V]`` (broadcasting over
the batch) or ``[B, V]``, the shape every attention function and model takes as ``key_log_weights``.
"""

from __future__ import annotations

import torch

from .geometry_measure import DEFAULT_LOG_EPS, log_weights_from_measure

VERTEX_AREA_SCHEMES = ("barycentric", "mixed_voronoi")
GRAPH_WEIGHTINGS = ("degree", "inverse_degree")
DEGREE_DIRECTIONS = ("both", "source", "target")


def _check_choice(fn: str, name: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{fn}: `{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")
    return value


def _check_mesh(fn: str, vertices, faces) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(vertices, torch.Tensor) or not vertices.is_floating_point():
        raise TypeError(f"{fn}: `vertices` must be a floating-point tensor [V, 2|3] or [B, V, 2|3]")
    if vertices.dim() not in (2, 3) or vertices.shape[-1] not in (2, 3) or vertices.shape[-2] < 3:
        raise ValueError(
            f"{fn}: `vertices` must have shape [V, 2|3] or [B, V, 2|3] with V >= 3; got {tuple(vertices.shape)}"
        )
    if not bool(torch.isfinite(vertices).all()):
        raise ValueError(f"{fn}: `vertices` must be finite")
    if not isinstance(faces, torch.Tensor) or faces.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: `faces` must be an integer tensor [F, 3] of vertex indices")
    if faces.dim() != 2 or faces.shape[1] != 3 or faces.shape[0] < 1:
        raise ValueError(
            f"{fn}: `faces` must have shape [F, 3] with F >= 1 (shared by the batch); got {tuple(faces.shape)}"
        )
    if faces.device != vertices.device:
        raise ValueError(f"{fn}: `faces` is on {faces.device}; `vertices` is on {vertices.device}")
    num_vertices = vertices.shape[-2]
    if int(faces.min()) < 0 or int(faces.max()) >= num_vertices:
        raise ValueError(
            f"{fn}: `faces` must index vertices in [0, {num_vertices - 1}]; "
            f"got [{int(faces.min())}, {int(faces.max())}]"
        )
    f = faces.long()
    if bool(((f[:, 0] == f[:, 1]) | (f[:, 1] == f[:, 2]) | (f[:, 0] == f[:, 2])).any()):
        raise ValueError(f"{fn}: every face in `faces` needs three distinct vertices")
    return vertices, f


def _corners(vertices: torch.Tensor, faces: torch.Tensor):
    """The three corners ``[..., F, 3]`` (3-D, float64) of every face; planar vertices get z = 0."""
    v = vertices.to(torch.float64)
    if v.shape[-1] == 2:
        v = torch.cat((v, torch.zeros_like(v[..., :1])), dim=-1)
    return v[..., faces[:, 0], :], v[..., faces[:, 1], :], v[..., faces[:, 2], :]


def triangle_areas(vertices: torch.Tensor, faces: torch.Tensor) -> torch.Tensor:
    """Area of every triangle, ``|(b - a) x (c - a)| / 2``: ``[F]`` or ``[B, F]`` in the vertices' dtype.

    Args:
        vertices: ``[V, 2]`` (planar) or ``[V, 3]`` (surface in space) positions, or a batch ``[B, V, 2|3]``.
        faces: ``[F, 3]`` integer vertex indices (orientation does not matter), shared by the batch.
    """
    vertices, faces = _check_mesh("triangle_areas", vertices, faces)
    a, b, c = _corners(vertices, faces)
    return (0.5 * torch.linalg.cross(b - a, c - a).norm(dim=-1)).to(vertices.dtype)


def _mixed_voronoi_corner_areas(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Meyer et al.'s mixed Voronoi area of each corner of each triangle: ``[..., F, 3]`` (corners a, b, c)."""
    twice_area = torch.linalg.cross(b - a, c - a).norm(dim=-1)
    area = 0.5 * twice_area
    # dot products at each corner: the sign says whether its angle is obtuse, dot / (2 area) is its cotangent
    dot_a = ((b - a) * (c - a)).sum(-1)
    dot_b = ((a - b) * (c - b)).sum(-1)
    dot_c = ((a - c) * (b - c)).sum(-1)
    degenerate = twice_area <= 0
    safe = torch.where(degenerate, torch.ones_like(twice_area), twice_area)
    cot_a, cot_b, cot_c = dot_a / safe, dot_b / safe, dot_c / safe
    len2_ab = ((b - a) ** 2).sum(-1)
    len2_bc = ((c - b) ** 2).sum(-1)
    len2_ca = ((a - c) ** 2).sum(-1)
    # Voronoi cell of a corner within the triangle: each adjacent edge |e|^2 times the cotangent of the opposite angle
    voronoi = torch.stack(
        (
            (len2_ab * cot_c + len2_ca * cot_b) / 8.0,
            (len2_ab * cot_c + len2_bc * cot_a) / 8.0,
            (len2_bc * cot_a + len2_ca * cot_b) / 8.0,
        ),
        dim=-1,
    )
    dots = torch.stack((dot_a, dot_b, dot_c), dim=-1)
    obtuse_corner = dots < 0
    obtuse_triangle = obtuse_corner.any(dim=-1, keepdim=True)
    area3 = area.unsqueeze(-1).expand_as(voronoi)
    fallback = torch.where(obtuse_corner, 0.5 * area3, 0.25 * area3)
    out = torch.where(obtuse_triangle, fallback, voronoi)
    return torch.where(degenerate.unsqueeze(-1), torch.zeros_like(out), out)


def mesh_vertex_areas(vertices: torch.Tensor, faces: torch.Tensor, *, scheme: str = "barycentric") -> torch.Tensor:
    """Area each vertex of a triangle mesh stands for: ``[V]`` or ``[B, V]``, summing to the mesh's area.

    Args:
        vertices: ``[V, 2|3]`` or ``[B, V, 2|3]`` positions (float).
        faces: ``[F, 3]`` integer vertex indices, shared by the batch.
        scheme: "barycentric" (a third of each adjacent triangle: the lumped mass matrix, exact for the
            piecewise-linear interpolant) or "mixed_voronoi" (Meyer et al. 2003: Voronoi cells clipped to the
            triangles).  A vertex that no face uses gets area 0.
    """
    fn = "mesh_vertex_areas"
    _check_choice(fn, "scheme", scheme, VERTEX_AREA_SCHEMES)
    vertices, faces = _check_mesh(fn, vertices, faces)
    a, b, c = _corners(vertices, faces)
    if scheme == "barycentric":
        third = torch.linalg.cross(b - a, c - a).norm(dim=-1) / 6.0
        corner_areas = third.unsqueeze(-1).expand(*third.shape, 3)
    else:
        corner_areas = _mixed_voronoi_corner_areas(a, b, c)
    num_vertices = vertices.shape[-2]
    out = corner_areas.new_zeros(*corner_areas.shape[:-2], num_vertices)
    index = faces.reshape(-1).expand(*corner_areas.shape[:-2], -1)
    out = out.scatter_add(-1, index, corner_areas.reshape(*corner_areas.shape[:-2], -1))
    return out.to(vertices.dtype)


def mesh_key_log_weights(
    vertices: torch.Tensor,
    faces: torch.Tensor,
    *,
    scheme: str = "barycentric",
    eps: float = DEFAULT_LOG_EPS,
    batch_size: int | None = None,
) -> torch.Tensor:
    """``key_log_weights`` for attention over the vertices of a mesh: ``log(A_v / mean(A) + eps)``.

    Returns ``[1, V]`` (broadcasts over the batch) or ``[batch_size, V]`` for unbatched ``vertices [V, 2|3]``, and
    ``[B, V]`` for ``vertices [B, V, 2|3]``.  See :func:`mesh_vertex_areas` for ``scheme``.
    """
    areas = mesh_vertex_areas(vertices, faces, scheme=scheme)
    return log_weights_from_measure(areas, eps=eps, batch_size=batch_size)


def graph_node_degree(
    edge_index: torch.Tensor,
    num_nodes: int,
    *,
    edge_weight: torch.Tensor | None = None,
    direction: str = "both",
) -> torch.Tensor:
    """Weighted degree of every node: ``[N]``, or ``[B, N]`` for ``edge_weight [B, E]``.

    Args:
        edge_index: ``[2, E]`` integer (source, target) pairs (PyTorch Geometric's layout).
        num_nodes: number of nodes ``N`` (nodes without edges get degree 0).
        edge_weight: ``[E]`` or ``[B, E]`` non-negative edge weights; default 1 per edge.
        direction: "both": each column adds its weight to both of its nodes (an undirected graph listing each edge
            once); "source" / "target": only to ``edge_index[0]`` / ``edge_index[1]`` (the out- / in-degree; for an
            undirected graph that lists each edge in both directions, as PyTorch Geometric does, either gives the
            degree).  A self-loop counts once per endpoint it is added to.
    """
    fn = "graph_node_degree"
    _check_choice(fn, "direction", direction, DEGREE_DIRECTIONS)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"{fn}: `num_nodes` must be an int >= 1; got {num_nodes!r}")
    if not isinstance(edge_index, torch.Tensor) or edge_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: `edge_index` must be an integer tensor [2, E]")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"{fn}: `edge_index` must have shape [2, E]; got {tuple(edge_index.shape)}")
    num_edges = edge_index.shape[1]
    if num_edges and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise ValueError(f"{fn}: `edge_index` must index nodes in [0, {num_nodes - 1}] (`num_nodes` = {num_nodes})")
    if edge_weight is None:
        w = torch.ones(num_edges, dtype=torch.float64, device=edge_index.device)
        out_dtype = torch.float32
    else:
        if not isinstance(edge_weight, torch.Tensor) or not edge_weight.is_floating_point():
            raise TypeError(f"{fn}: `edge_weight` must be a floating-point tensor [E] or [B, E]")
        if edge_weight.dim() not in (1, 2) or edge_weight.shape[-1] != num_edges:
            raise ValueError(
                f"{fn}: `edge_weight` must have shape [E] or [B, E] with E = {num_edges}; "
                f"got {tuple(edge_weight.shape)}"
            )
        if edge_weight.device != edge_index.device:
            raise ValueError(f"{fn}: `edge_weight` is on {edge_weight.device}; `edge_index` is on {edge_index.device}")
        if not bool(torch.isfinite(edge_weight).all()) or bool((edge_weight < 0).any()):
            raise ValueError(f"{fn}: `edge_weight` must be finite and >= 0")
        w = edge_weight.to(torch.float64)
        out_dtype = edge_weight.dtype
    ends = {"both": (0, 1), "source": (0,), "target": (1,)}[direction]
    degree = w.new_zeros(*w.shape[:-1], num_nodes)
    for end in ends:
        degree = degree.scatter_add(-1, edge_index[end].long().expand_as(w), w)
    return degree.to(out_dtype)


def graph_key_log_weights(
    edge_index: torch.Tensor,
    num_nodes: int,
    *,
    edge_weight: torch.Tensor | None = None,
    weighting: str = "degree",
    direction: str = "both",
    eps: float = DEFAULT_LOG_EPS,
    batch_size: int | None = None,
) -> torch.Tensor:
    """``key_log_weights`` for attention over the nodes of a graph, from their degrees.

    Args:
        edge_index, num_nodes, edge_weight, direction: see :func:`graph_node_degree`.
        weighting: "degree" (the node's volume ``d_i``: the random walk's stationary measure) or "inverse_degree"
            (``1 / d_i``: the cell of a node of a neighbourhood graph of unevenly sampled points, where the degree
            counts the points in a ball and grows with the sampling density; every node needs degree > 0).
        eps, batch_size: see :func:`hf_rbf.geometry_measure.log_weights_from_measure`.

    Returns ``[1, N]`` / ``[batch_size, N]`` (``edge_weight`` None or ``[E]``) or ``[B, N]`` (``edge_weight [B, E]``).
    For known node cell areas use :func:`hf_rbf.geometry_measure.log_weights_from_measure` on them.
    """
    fn = "graph_key_log_weights"
    _check_choice(fn, "weighting", weighting, GRAPH_WEIGHTINGS)
    degree = graph_node_degree(edge_index, num_nodes, edge_weight=edge_weight, direction=direction)
    if weighting == "inverse_degree":
        if bool((degree <= 0).any()):
            isolated = int((degree <= 0).nonzero()[0, -1])
            raise ValueError(
                f"{fn}: weighting='inverse_degree' needs every node to have a positive degree; node {isolated} has 0"
            )
        measure = 1.0 / degree.to(torch.float64)
        return log_weights_from_measure(measure, eps=eps, batch_size=batch_size).to(degree.dtype)
    return log_weights_from_measure(degree, eps=eps, batch_size=batch_size)
