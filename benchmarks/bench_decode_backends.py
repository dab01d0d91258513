"""Decode-sized calls (a few query rows over many keys) per backend for every family: the measurement behind the
decode rule of ``hf_rbf.kernels_common.auto_order`` (naive first for at most DECODE_ROWS query rows on the CPU).

    PYTHONPATH=. python benchmarks/bench_decode_backends.py [--device cpu] [--keys 256 4096] [--rows 1 4 16 64]

Prints one markdown table: median milliseconds per call, and the backend "auto" chose.
"""

import argparse
import time

import torch

import hf_rbf
from hf_rbf.kernels_common import DECODE_ROWS


def median_ms(fn, device, reps: int) -> float:
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


def calls(nq: int, nk: int, heads: int, dim: int, groups: int, device, dtype):
    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    q, k, v, x = r(1, heads, nq, dim), r(1, heads, nk, dim), r(1, heads, nk, dim), r(1, heads, nk, dim)
    qs, ks, vg = r(1, heads, nq), r(1, heads, nk), r(1, groups, nk, dim)
    log_sigma = torch.zeros(heads, device=device)
    return {
        "rbf_attention": lambda b: hf_rbf.rbf_attention(q, k, v, backend=b),
        "gka_attention": lambda b: hf_rbf.gka_attention(x, log_sigma, query=q, backend=b),
        "scalar_attention": lambda b: hf_rbf.scalar_attention(qs, ks, vg, 0.1, backend=b),
        "hybrid_attention": lambda b: hf_rbf.hybrid_attention(q, k, vg, qs, ks, 0.1, backend=b),
    }


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--keys", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--backends", nargs="+", default=["naive", "sdpa"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    print(f"Median ms per call, H=16, D=64, G=4 (scalar/hybrid values), {dtype}, {device}; DECODE_ROWS = {DECODE_ROWS}\n")
    print("| op | keys | query rows | " + " | ".join(args.backends) + " | auto chose |")
    print("|---|---|---|" + "---|" * (len(args.backends) + 1))
    for nk in args.keys:
        for nq in args.rows:
            for op, fn in calls(nq, nk, 16, 64, 4, device, dtype).items():
                cells = [f"{median_ms(lambda: fn(b), device, args.reps):.3f}" for b in args.backends]
                fn("auto")
                print(f"| {op} | {nk} | {nq} | " + " | ".join(cells) + f" | {hf_rbf.last_backend(op)} |")


if __name__ == "__main__":
    main()
