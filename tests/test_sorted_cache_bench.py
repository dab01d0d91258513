"""recipes/bench_sorted_decode.py at tiny sizes: every exact backend and sorted variant gets a timed row, the report
names the backend "auto" used, and bad --exact-backends entries are refused by name."""

import csv
import math

import pytest
import torch

from hf_rbf.kernels_sorted_decode import kernel_unavailable_reason
from recipes import bench_sorted_decode as bench


def test_bench_writes_a_row_per_backend_and_variant(tmp_path):
    out = tmp_path / "bench"
    bench.main(["--device", "cpu", "--output", str(out), "--layer-contexts", "48", "--model-contexts", "40",
                "--steps", "1", "--warmup-steps", "0", "--exact-backends", "auto,naive,sdpa:math"])  # fmt: skip
    with open(out / "bench_sorted_decode.csv") as f:
        rows = list(csv.DictReader(f))
    layer = {r["method"] for r in rows if r["bench"] == "layer"}
    # one query row on the CPU: "auto" decodes through the naive path, and says so
    assert {"exact (auto=naive)", "exact (naive)", "exact (sdpa:math)", "sorted-torch"} <= layer
    sorted_rows = [r for r in rows if r["bench"] == "layer" and r["method"] == "sorted-torch"]
    assert len(sorted_rows) == len(bench.SORTED_VARIANTS)
    # the fused kernel's rows wherever it can run (here: Triton's interpreter, set by conftest when triton is present)
    kernel_rows = [r for r in rows if r["bench"] == "layer" and r["method"] == "sorted-triton"]
    can_run = kernel_unavailable_reason(torch.device("cpu")) is None
    assert len(kernel_rows) == (len(bench.KERNEL_VARIANTS) if can_run else 0)
    assert all(math.isfinite(float(r["step_ms"])) and float(r["step_ms"]) > 0 for r in rows)
    model_methods = {(r["method"], r["window"]) for r in rows if r["bench"] == "model"}
    assert {("exact", ""), ("sorted-torch", "32"), ("sorted-torch", "64")} <= model_methods
    report = (out / "bench_sorted_decode.md").read_text()
    assert "exact (auto=naive)" in report and "| 48 |" in report and "| 40 |" in report
    assert (out / "bench_sorted_decode.png").stat().st_size > 0


@pytest.mark.parametrize(
    "spec, message",
    [("auto,fast", "unknown backend 'fast'"), ("naive:math", "only for sdpa"), ("sdpa:turbo", "only for sdpa"),
     (",", "empty")],  # fmt: skip
)
def test_bad_exact_backends_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match="--exact-backends") as err:
        bench.parse_exact_backends(spec)
    assert message in str(err.value)
