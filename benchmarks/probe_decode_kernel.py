"""Where the exact split-K decode step's time goes against dense SDPA decode at long context (issue 13: "exact
single-query decode for rbf/gka/hybrid no slower than dense SDPA decode at the same length").

    PYTHONPATH=. python benchmarks/probe_decode_kernel.py --out DIR [--lens 8192,32768,131072,524288] [--heads 12]
        [--d 64] [--sweep-len 131072] [--no-sweep]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/probe_decode_kernel.py --check   # CPU: the variants are exact

One query row over ``L`` cached keys, B1, bf16, the layer shape of the 110M model (H12 D64), one layer step.  Rows:
- SDPA (torch's default choice for the call, and its flash / efficient / cuDNN backends forced);
- the rbf decode kernel as shipped (key norms from each key tile, ``KNORM_INLINE``), with the norms read as one
  fp32 bias per key instead (what a cache that stored ``||k||^2`` at append would pass), and without any norm term;
- the GKA form (keys are values, ``kv_same``) with inline norms and with the stored-norm bias;
- at ``--sweep-len``: the decode kernel's tiles one by one and the split-K count scaled 0.5x-8x (stored norms).
Each: the step captured in a CUDA graph and replayed (``do_bench_cudagraph``: GPU time alone), and the effective
bandwidth over the bytes the step must read (keys and values once; GKA: the keys once).  Writes
``decode_kernel.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_rbf import kernels_flash_fwd  # noqa: E402
from hf_rbf.kernels_common import key_bias  # noqa: E402
from hf_rbf.kernels_flash_fwd import distance_decode  # noqa: E402

# (BLOCK_N, num_warps, num_stages) of the decode kernel tried one by one (BLOCK_M stays 16: one row padded)
SWEEP = [(64, 4, 3), (128, 4, 3), (128, 4, 4), (128, 8, 3), (256, 4, 3), (256, 8, 3), (256, 8, 2), (64, 2, 4)]
SPLIT_SCALES = [0.5, 1, 2, 4, 8]


def inputs(h, n, d, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, h, 1, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(1, h, n, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(1, h, n, d, generator=g).to(device=device, dtype=dtype)
    gamma = torch.full((h,), 0.5 / math.sqrt(d), device=device, dtype=torch.float32)
    return q, k, v, gamma


def variants(q, k, v, gamma):
    """name -> step; the stored-norm biases are computed once here, as a cache would hold them."""
    h, n = q.shape[1], k.shape[2]
    common = dict(causal=True, window=None, num_prefix_keys=0, normalize=True, qnorm=False, eps=0.0)
    kb_rbf, _ = key_bias(k, -gamma, None, None, h, n, 1, True)
    # GKA as the kernel sees it (kv_same, x = k): a = 1 / sigma^2 on x_i . x_j, b = -1 / (2 sigma^2) on ||x_j||^2
    inv_var = 2 * gamma
    kb_gka, _ = key_bias(k, -0.5 * inv_var, None, None, h, n, 1, True)
    return {
        "rbf inline norms (shipped)": lambda: distance_decode(q, k, v, None, None, None, None, gamma, None,
                                                              knorm=True, kv_same=False, **common),
        "rbf stored norms": lambda: distance_decode(q, k, v, kb_rbf, None, None, None, gamma * 2, -gamma,
                                                    knorm=False, kv_same=False, **common),
        "rbf no norm term": lambda: distance_decode(q, k, v, None, None, None, None, gamma * 2, -gamma,
                                                    knorm=False, kv_same=False, **common),
        "gka inline norms (shipped)": lambda: distance_decode(q, k, k, None, None, None, None, inv_var,
                                                              -0.5 * inv_var, knorm=True, kv_same=True, **common),
        "gka stored norms": lambda: distance_decode(q, k, k, kb_gka, None, None, None, inv_var, -0.5 * inv_var,
                                                    knorm=False, kv_same=True, **common),
    }


def sdpa_variants(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {"SDPA (default)": lambda: F.scaled_dot_product_attention(q, k, v)}
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA efficient",
                                                                     SDPBackend.EFFICIENT_ATTENTION),
                          ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        out[name] = call
    return out


def reference(q, k, v, gamma, kv_same=False):
    """float64 softmax(-gamma ||q - k||^2) v (GKA: v = k, the bandwidth from gamma as in ``variants``)."""
    qd, kd = q.double(), k.double()
    vd = kd if kv_same else v.double()
    g = gamma.double().view(1, -1, 1, 1)
    s = -g * torch.cdist(qd, kd).square()
    return torch.softmax(s, -1) @ vd


def check(q, k, v, gamma, fns, tol):
    ref = reference(q, k, v, gamma)
    ref_gka = reference(q, k, v, gamma, kv_same=True)
    errs = {}
    for name, fn in fns.items():
        if name.startswith("SDPA") or "no norm" in name:
            continue
        r = ref_gka if name.startswith("gka") else ref
        out = fn().double()
        errs[name] = ((out - r).norm() / r.norm()).item()
        if not errs[name] < tol:
            raise AssertionError(f"{name}: relative error {errs[name]:.2e} against float64 (tolerance {tol})")
    return errs


def check_on_cpu():
    q, k, v, gamma = inputs(3, 77, 16, "cpu", torch.float32)
    errs = check(q, k, v, gamma, variants(q, k, v, gamma), 1e-4)
    print("decode variants agree with the float64 reference:", {n: f"{e:.1e}" for n, e in errs.items()})


def force_decode_config(cfg):
    import triton

    tuner = kernels_flash_fwd._distance_decode
    bn, w, s = cfg
    tuner.configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": bn}, num_warps=w, num_stages=s)]
    tuner.cache.clear()
    tuner.__dict__.pop("_hf_rbf_direct", None)


def gpu_us(fn):
    import triton

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="decode_kernel")
    ap.add_argument("--lens", default="8192,32768,131072,524288")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--sweep-len", type=int, default=131072)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        check_on_cpu()
        return 0
    import triton

    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    started = time.time()
    rows = []
    with torch.no_grad():
        for n in (int(x) for x in args.lens.split(",")):
            q, k, v, gamma = inputs(args.heads, n, args.d, dev, torch.bfloat16)
            fns = {**sdpa_variants(q, k, v), **variants(q, k, v, gamma)}
            errs = check(q, k, v, gamma, fns, 2e-2)
            kv_bytes = (k.numel() + v.numel()) * k.element_size()
            for name, fn in fns.items():
                try:
                    fn()
                    us = gpu_us(fn)
                except Exception as e:  # noqa: BLE001 (a backend that refuses the call is a row)
                    rows.append(dict(len=n, name=name, error=f"{type(e).__name__}: {str(e)[:120]}"))
                    continue
                need = kv_bytes / 2 if name.startswith("gka") else kv_bytes
                rows.append(dict(len=n, name=name, us=us, gb_s=need / (us * 1e-6) / 1e9, error_vs_fp64=errs.get(name)))
            print(f"L{n}:", {r["name"]: round(r.get("us", float("nan")), 1) for r in rows if r["len"] == n},
                  flush=True)
            del q, k, v
        if not args.no_sweep:
            n = args.sweep_len
            q, k, v, gamma = inputs(args.heads, n, args.d, dev, torch.bfloat16)
            fns = variants(q, k, v, gamma)
            kv_bytes = (k.numel() + v.numel()) * k.element_size()
            original = list(kernels_flash_fwd._distance_decode.configs)
            for cfg in SWEEP:
                force_decode_config(cfg)
                for name in ("rbf inline norms (shipped)", "rbf stored norms", "gka stored norms"):
                    try:
                        fns[name]()
                        us = gpu_us(fns[name])
                        need = kv_bytes / 2 if name.startswith("gka") else kv_bytes
                        rows.append(dict(len=n, name=f"{name}, BN{cfg[0]} w{cfg[1]} s{cfg[2]}", us=us,
                                         gb_s=need / (us * 1e-6) / 1e9))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(len=n, name=f"{name}, BN{cfg[0]} w{cfg[1]} s{cfg[2]}",
                                         error=f"{type(e).__name__}: {str(e)[:120]}"))
            kernels_flash_fwd._distance_decode.configs = original
            kernels_flash_fwd._distance_decode.cache.clear()
            kernels_flash_fwd._distance_decode.__dict__.pop("_hf_rbf_direct", None)
            shipped_splits = kernels_flash_fwd.decode_splits
            for scale in SPLIT_SCALES:
                kernels_flash_fwd.decode_splits = (
                    lambda *a, scale=scale, **kw: max(1, min(512, round(shipped_splits(*a, **kw) * scale))))
                for name in ("rbf stored norms", "gka stored norms"):
                    fns[name]()
                    us = gpu_us(fns[name])
                    need = kv_bytes / 2 if name.startswith("gka") else kv_bytes
                    splits = kernels_flash_fwd.decode_splits(1, args.heads, 1, n, dev)
                    rows.append(dict(len=n, name=f"{name}, {splits} splits ({scale}x shipped)", us=us,
                                     gb_s=need / (us * 1e-6) / 1e9))
            kernels_flash_fwd.decode_splits = shipped_splits
            print("sweep:", {r["name"]: round(r.get("us", float("nan")), 1) for r in rows if "," in r["name"]},
                  flush=True)
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                heads=args.heads, d=args.d, seconds=round(time.time() - started, 1))
    with open(os.path.join(args.out, "decode_kernel.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# One decode step, one query row over L keys, B1 H{args.heads} D{args.d} bf16 ({meta['device']}, torch "
             f"{meta['torch']}, triton {meta['triton']}; CUDA-graph replay, median)", "",
             "| L | what | us | GB/s of the bytes it must read | error vs float64 |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['len']} | {r['name']} | error: {r['error']} | | |")
            continue
        err = r.get("error_vs_fp64")
        lines.append(f"| {r['len']} | {r['name']} | {r['us']:.1f} | {r['gb_s']:.0f} | "
                     f"{'' if err is None else f'{err:.1e}'} |")
    with open(os.path.join(args.out, "decode_kernel.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
