"""GPU correctness check of the fused Triton kernels at full shapes: prints a pass/fail table, exit code 1 on failure.

The same checks as ``tests/test_kernels_<family>.py`` (``benchmarks/kernel_checks.py``): output and every gradient
of ``backend="triton"`` against the naive reference run in float64 on the same inputs, relative error per quantity.
Run on a CUDA machine from the repository root:

    PYTHONPATH=. python benchmarks/check_kernels_gpu.py [--workers 8] [--small] [--out results_dir]

Cases run in a pool of worker processes (compilation dominates, and each case is its own kernel specialisation);
autotuning is off here (``HF_RBF_TRITON_AUTOTUNE=0``): correctness does not depend on the tile choice.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_RBF_TRITON_AUTOTUNE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _worker(case):
    import kernel_checks as kc
    import torch

    t0 = time.time()
    res = kc.check_case(case, "cuda")
    torch.cuda.empty_cache()
    return case.name, res.ok, res.summary(), {k: list(v) for k, v in res.errors.items()}, res.error, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="also run the small (CPU-test) cases on the GPU")
    ap.add_argument("--out", type=str, default=None, help="folder for check_results.json")
    ap.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=None,
        help="run only the cases whose name contains one of these comma-separated substrings",
    )
    args = ap.parse_args()

    import kernel_checks as kc
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run the CPU interpreter tests instead (pytest tests/test_kernels_*.py)")
        return 2
    cases = kc.full_cases()
    if args.small:
        cases += [c for fam_cases in kc.small_cases().values() for c in fam_cases]
    if args.only:
        cases = [c for c in cases if any(sub in c.name for sub in args.only)]
    print(f"{len(cases)} cases on {torch.cuda.get_device_name()} with {args.workers} workers", flush=True)
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        rows = pool.map(_worker, cases, chunksize=1)
    failed = [r for r in rows if not r[1]]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'case':<{width}}  status  detail (relative error vs float64, tolerance)")
    for name, ok, summary, _, _, secs in rows:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL'}    {summary}  [{secs:.0f}s]")
    print(f"\n{len(rows) - len(failed)}/{len(rows)} passed in {time.time() - t0:.0f}s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "check_results.json", "w") as f:
            json.dump([dict(case=r[0], ok=r[1], summary=r[2], errors=r[3], error=r[4]) for r in rows], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
