"""benchmarks/probe_hopper_forward.py's probe kernels (tensor descriptors; the off-band loop plain, warp-specialised,
or issuing the next tile's product before this tile's softmax) against the float64 reference, in triton's CPU
interpreter: its ``--check``, in a subprocess (the probe sets triton's allocator for the whole process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_probe_variant_matches_float64_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "benchmarks/probe_hopper_forward.py", "--check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "every probe variant agrees with the float64 reference" in out.stdout
