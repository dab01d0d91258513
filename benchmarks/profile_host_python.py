"""Which Python functions the host spends an attention call in: cProfile over repeated forward+backward calls of
each fused attention function at a tiny shape (B1 H4 N128 D64, bf16), where the GPU is idle and the host is the
whole cost.  Complements ``profile_training.py`` (which times the calls and whole training steps).

    PYTHONPATH=. python benchmarks/profile_host_python.py --out benchmarks/results/<name> [--calls 300]

Writes ``host_python.txt``: per call, the top functions by own time and by cumulative time (triton's launcher and
autotuner, our wrappers, torch ops).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import hf_rbf

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)

    b, h, n, d = 1, 4, 128, 64
    q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
    qs, ks = rnd(b, h, n), rnd(b, h, n)
    gamma = torch.full((h,), 1.0 / math.sqrt(d), device="cuda", requires_grad=True)
    log_sigma = torch.full((h,), 0.25 * math.log(d), device="cuda", requires_grad=True)
    tau = torch.full((h,), 0.3, device="cuda", requires_grad=True)
    calls = {
        "rbf_attention": lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, causal=True, backend="triton"),
        "gka_attention": lambda: hf_rbf.gka_attention(q, log_sigma, causal=True, backend="triton"),
        "hybrid_attention": lambda: hf_rbf.hybrid_attention(q, k, v, qs, ks, tau, causal=True, backend="triton"),
        "sdpa (dot product)": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    text = []
    for name, fn in calls.items():
        for _ in range(20):
            fn().float().sum().backward()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn().float().sum().backward()
        prof.disable()
        torch.cuda.synchronize()
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            total = stats.total_tt
            stats.sort_stats(order).print_stats(30)
            text.append(
                f"==== {name}: forward+backward, {args.calls} calls, {1e3 * total / args.calls:.3f} ms of profiled "
                f"host time per call; sorted by {order} ====\n" + buf.getvalue()
            )
        print(text[-2][:4000], flush=True)
    (out / "host_python.txt").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
