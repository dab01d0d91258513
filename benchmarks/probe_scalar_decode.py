"""Why exact scalar decode through "auto" took ~27 ms per step on the H200 from 4096 keys on (recipes/
bench_sorted_decode.py, 2026-11-21) while each SDPA kernel, forced, took under 1 ms: times one decode step per
backend choice and prints the profiler's top operators for the slow one.

    PYTHONPATH=. python benchmarks/probe_scalar_decode.py [--device cuda]
"""

import argparse
import time

import torch

import hf_rbf
from hf_rbf.attention_utils import last_backend
from recipes.bench_sorted_decode import SDPA_KERNELS, sdpa_kernels


def step_ms(fn, device, reps=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[reps // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, g, dv = 16, 4, 64
    for n in (1024, 4096, 65536):
        qs = torch.randn(1, h, 1, device=device, dtype=dtype)
        ks = torch.randn(1, h, n, device=device, dtype=dtype)
        v = torch.randn(1, g, n, dv, device=device, dtype=dtype)
        tau = torch.full((h,), 0.05, device=device)
        row = {}
        for name in ("auto", "sdpa", "naive", "triton"):
            try:
                row[name] = step_ms(lambda: hf_rbf.scalar_attention(qs, ks, v, tau, backend=name), device)
                row[name + " chose"] = last_backend("scalar_attention")
            except (RuntimeError, ValueError) as e:
                row[name] = f"failed: {str(e).splitlines()[0][:80]}"
        for kname in SDPA_KERNELS:
            try:
                with sdpa_kernels(kname):
                    row["sdpa:" + kname] = step_ms(lambda: hf_rbf.scalar_attention(qs, ks, v, tau, backend="sdpa"), device)
            except (RuntimeError, ValueError) as e:
                row["sdpa:" + kname] = f"failed: {str(e).splitlines()[0][:80]}"
        print(n, row, flush=True)
        if n == 4096:
            for name in ("auto", "sdpa"):
                with torch.profiler.profile() as prof:
                    for _ in range(5):
                        hf_rbf.scalar_attention(qs, ks, v, tau, backend=name)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                print(f"--- profile of backend={name}, 5 calls at n={n}")
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
