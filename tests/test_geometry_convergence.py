"""recipes/geometry_convergence.py at small size: over a warped image (weights by autograd and by a sampling grid)
and a graded mesh (barycentric and mixed Voronoi vertex areas), the weighted attention's error against the plane
integral falls at second order with refinement while the unweighted one does not fall; and the script writes its
table, plot and doc block."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from recipes import geometry_convergence as demo


@pytest.fixture(scope="module")
def rows():
    return demo.convergence_table(resolutions=(8, 16, 32), domains=demo.DEFAULT_DOMAINS, num_queries=48)


def test_target_quadrature_is_converged():
    q = demo.query_points(8)
    coarse = demo.exact_smoothed(q, 2.0, 0.5, m=120)
    fine = demo.exact_smoothed(q, 2.0, 0.5, m=200)
    for a, b in zip(coarse, fine):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_fisheye_warp_maps_the_square_onto_itself():
    u = torch.linspace(-1, 1, 9, dtype=torch.float64)
    edges = torch.cat([torch.stack((u, torch.full_like(u, s)), -1) for s in (-1.0, 1.0)])
    mapped = demo.fisheye_warp(edges)
    torch.testing.assert_close(mapped[:, 1].abs(), torch.ones(18, dtype=torch.float64))
    torch.testing.assert_close(mapped[[0, 8, 9, 17], 0].abs(), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("domain", demo.DEFAULT_DOMAINS)
def test_weighted_error_falls_and_unweighted_does_not(rows, domain):
    rs = [r for r in rows if r["domain"] == domain]
    assert [r["n"] for r in rs] == [8, 16, 32]
    for op in ("rbf", "gka"):
        weighted = np.array([r[f"{op}_weighted_max_err"] for r in rs])
        unweighted = np.array([r[f"{op}_unweighted_max_err"] for r in rs])
        assert (weighted[1:] < weighted[:-1] / 3).all(), (op, weighted)  # second order: ~4x per halving of h
        assert weighted[-1] < 5e-3, (op, weighted)
        assert unweighted.min() > 0.05, (op, unweighted)  # the average against the sample density instead
        assert unweighted[-1] > 0.8 * unweighted[0], (op, unweighted)  # refining does not help
        assert unweighted[-1] > 20 * weighted[-1], (op, weighted, unweighted)


def test_unknown_domain_is_named():
    with pytest.raises(ValueError, match="unknown domain 'sphere'"):
        demo.make_tokens("sphere", 8)


def test_main_writes_table_plot_and_doc_block(tmp_path):
    doc = tmp_path / "geometry.md"
    doc.write_text("before\n<!-- geometry_convergence:start -->\nold\n<!-- geometry_convergence:end -->\nafter\n")
    out = tmp_path / "out"
    demo.main(
        [
            "--out-dir",
            str(out),
            "--resolutions",
            "4,8",
            "--domains",
            "warp_grid,mesh_barycentric",
            "--num-queries",
            "8",
            "--doc",
            str(doc),
        ]
    )
    for ext in ("md", "csv", "json", "png"):
        assert (out / f"geometry_convergence.{ext}").stat().st_size > 0
    data = json.loads((out / "geometry_convergence.json").read_text())
    assert [(r["domain"], r["n"]) for r in data["rows"]] == [
        ("warp_grid", 4),
        ("warp_grid", 8),
        ("mesh_barycentric", 4),
        ("mesh_barycentric", 8),
    ]
    assert all(math.isfinite(r["rbf_weighted_max_err"]) for r in data["rows"])
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert (
        "| warp_grid | 8 | 64 |" in text and "Made by `PYTHONPATH=$PWD python recipes/geometry_convergence.py" in text
    )
    with pytest.raises(SystemExit):
        demo.main(["--out-dir", str(out), "--domains", "sphere"])
