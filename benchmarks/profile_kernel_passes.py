"""GPU time of every kernel launched by one forward+backward of each fused attention, with the config the autotuner
chose for it: the data behind a kernel redesign.

    PYTHONPATH=. python benchmarks/profile_kernel_passes.py --out DIR [--shapes 64x4x256x64,16x12x1024x64]

Shapes are ``BxHxNxD`` (default: the two model shapes of ``profile_training.py`` and B = 32768/N at N 1024 / 8192,
H16 D64).  Writes ``kernel_passes.json`` and ``kernel_passes.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.profile_training import attention_calls  # noqa: E402

DEFAULT_SHAPES = "64x4x256x64,16x12x1024x64,32x16x1024x64,4x16x8192x64,32x16x1024x128"
CALLS = ("sdpa (dot product)", "rbf_attention", "rbf_attention + 1 prefix key", "gka_attention", "hybrid_attention")


def tuned_choices() -> dict:
    """Every autotuned kernel's cache: tuning key -> chosen config, as strings."""
    from hf_rbf import kernels_flash_bwd, kernels_flash_fwd, kernels_scalar_bwd, kernels_scalar_fwd

    out = {}
    for mod in (kernels_flash_fwd, kernels_flash_bwd, kernels_scalar_fwd, kernels_scalar_bwd):
        for name, obj in vars(mod).items():
            cache = getattr(obj, "cache", None)
            if isinstance(cache, dict) and hasattr(obj, "configs"):
                for key, cfg in cache.items():
                    out[f"{mod.__name__.split('.')[-1]}.{name} {key}"] = str(cfg)
    return out


def passes(b, h, n, d, reps=10) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    calls = attention_calls(b, h, n, d, torch.bfloat16, True)
    for name in CALLS:
        fn, _ = calls[name]
        for _ in range(3):
            fn().float().sum().backward()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn().float().sum().backward()
        end.record()
        torch.cuda.synchronize()
        wall = start.elapsed_time(end) / reps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn().float().sum().backward()
            torch.cuda.synchronize()
        kernels = [
            dict(kernel=e.key[:90], calls=e.count / reps, ms=e.self_device_time_total / 1e3 / reps)
            for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
        ]
        kernels.sort(key=lambda r: -r["ms"])
        rows.append(dict(shape=f"{b}x{h}x{n}x{d}", call=name, gpu_ms_synced=wall, kernels=kernels))
        print(
            f"[{b}x{h}x{n}x{d}] {name:30s} {wall:.3f} ms "
            + ", ".join(f"{k['kernel'][:40]}={k['ms']:.3f}" for k in kernels[:6]),
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, rows=[])
    for shape in args.shapes.split(","):
        b, h, n, d = (int(x) for x in shape.split("x"))
        res["rows"] += passes(b, h, n, d)
        res["tuned"] = tuned_choices()
        (out / "kernel_passes.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Kernel passes (fwd+bwd, bf16, causal) on {res['gpu']}, torch {res['torch']}", ""]
    for r in res["rows"]:
        lines += [f"## {r['shape']} {r['call']}: {r['gpu_ms_synced']:.3f} ms per fwd+bwd (CUDA events)", ""]
        lines += ["| kernel | calls | ms |", "|---|---|---|"]
        lines += [f"| `{k['kernel']}` | {k['calls']:.0f} | {k['ms']:.3f} |" for k in r["kernels"]]
        lines.append("")
    lines += ["## Autotuner choices", ""] + [f"- `{k}`: {v}" for k, v in res["tuned"].items()]
    (out / "kernel_passes.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
