"""benchmarks/gpu_lanes.sh: how a lane spec reaches its gpu_session.sh run (here a stub that records what it got)."""

from __future__ import annotations

import os
import subprocess
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = """#!/usr/bin/env bash
echo "ARGS: $*"
echo "GPUTESTS: ${GPUTESTS:-}"
echo "DEVICES: ${CUDA_VISIBLE_DEVICES:-}"
mkdir -p "$1"
"""


def _run_lanes(tmp_path, *specs):
    stub = tmp_path / "session_stub.sh"
    stub.write_text(STUB)
    out = tmp_path / "out"
    env = {**os.environ, "GPU_SESSION": str(stub)}
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "benchmarks", "gpu_lanes.sh"), str(out), *specs],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=60,
    )
    return proc, out


def test_lane_spec_splits_at_the_first_spaced_colon(tmp_path):
    """Pytest node ids hold "::" (and brackets): the lane's head ends at the first " : ", not at the first colon."""
    tests = "tests/test_attention_common.py::test_gpu_backends_match_reference[scalar] tests/test_x.py::test_y"
    proc, out = _run_lanes(tmp_path, f'0,1 GPUTESTS="{tests}" : gputests:150 bench', "2 : profile:300")
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(out / "lanes.tar.gz") as tar:
        logs = {
            os.path.basename(m.name): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
            if m.name.endswith(".log")
        }
    assert f"GPUTESTS: {tests}\n" in logs["lane0.log"]
    assert "DEVICES: 0,1\n" in logs["lane0.log"]
    assert "ARGS: " in logs["lane0.log"] and logs["lane0.log"].split("ARGS: ")[1].split("\n")[0].endswith(
        "lanes/lane0 gputests:150 bench"
    )
    assert "DEVICES: 2\n" in logs["lane1.log"] and "lanes/lane1 profile:300" in logs["lane1.log"]


@pytest.mark.parametrize("spec", ["0 gputests:100", "0:gputests"])
def test_lane_spec_without_a_spaced_colon_is_refused(tmp_path, spec):
    proc, _ = _run_lanes(tmp_path, spec)
    assert proc.returncode == 2
    assert "a lane is 'GPUS [VAR=VALUE ...] : JOB ...'" in proc.stderr
