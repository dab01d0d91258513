"""Scale-out on the CPU (gloo): a checkpoint saved by 2 processes resumes on 1 and the reverse, with the losses of an
uninterrupted run; the scaling benchmark's dry run with 1 and 2 processes; the FSDP2 accelerate configs.

Why resuming across process counts is exact here: the recipe fixes the *global* batch (``global_batch_size``), so 2
processes get 4 blocks each where 1 process gets 8, and accelerate shards each global batch of the one seeded
sampler across the processes (process i takes the i-th per-device slice of it), so every optimizer step sees the same
8 blocks whatever the process count; the resumed run skips ``step x global_batch`` blocks either way.  The checkpoint
holds the full model, optimizer and scheduler state (DDP replicates them; rank 0 writes them).  What differs is only
the order of float additions: the mean loss and the gradient are averaged over 2 halves (DDP's all-reduce) instead of
over 8 blocks at once, about 1e-7 relative per step; after 8 AdamW steps the logged losses agree to 1e-4 (measured:
at most 9.5e-7, 2 float32 ulps of a loss near 5.5).  Per-process RNG states (``rng_state_<rank>.pth``) cannot carry over to another process count; the
models here have no dropout, so nothing draws from them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

# transformers contract: Trainer checkpoints and resume (CI also runs this module against the oldest versions)
pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_TEST = os.path.join(REPO, "recipes", "configs", "cpu_test.yaml")
NO_EXTRAS = [
    "evaluation.remote_code_check=false",
    "evaluation.generation.enabled=false",
    "evaluation.bpb.enabled=false",
    "training.eval_strategy='no'",  # quoted: YAML reads a bare no as false
    "cpu_threads=1",
]
LOSS_TOLERANCE = 1e-4  # 1 vs 2 processes: float summation order only (see the module docstring)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pretrain(output_dir, processes: int, *extra: str) -> None:
    """``recipes/pretrain.py`` on cpu_test.yaml, through ``accelerate launch --multi_gpu`` (gloo on the CPU) for 2
    processes, as a plain script for 1."""
    script = [os.path.join(REPO, "recipes", "pretrain.py"), "--config", CPU_TEST, "--output-dir", str(output_dir)]
    script += [*extra, "--set", *NO_EXTRAS]
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
        cmd += ["--num_machines", "1", "--main_process_port", str(_free_port()), "--mixed_precision", "no"]
        cmd += ["--dynamo_backend", "no", *script]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.json")) as f:
        rows = json.load(f)["log_history"]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """8 uninterrupted steps on 1 process (the reference curve)."""
    out = tmp_path_factory.mktemp("scaling") / "straight"
    _pretrain(out, 1)
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_process_count(straight_run, tmp_path, saved_on, resumed_on):
    out = tmp_path / f"saved{saved_on}_resumed{resumed_on}"
    _pretrain(out, saved_on, "--stop-at-step", "4")
    assert os.path.isdir(out / "checkpoint-4") and not os.path.isdir(out / "final")
    first = _losses(out)
    _pretrain(out, resumed_on, "--resume")
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["world_size"] == resumed_on and summary["global_batch_size"] == 8 and summary["steps"] == 8
    assert summary["resumed_from"].endswith("checkpoint-4")
    resumed = _losses(out)
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(straight_run[step], abs=LOSS_TOLERANCE), (step, resumed, straight_run)
    # the losses after the resume are not the ones before it: the test would see a restart from scratch
    assert abs(resumed[5] - straight_run[1]) > 10 * LOSS_TOLERANCE
