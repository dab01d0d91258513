"""The key-bias pass (``kernels_common.key_bias``: ``||k_j||^2`` and the per-key bias in one read of the keys) on the
GPU alone: its keys-per-program / warps choices one by one, against a copy of the keys and torch's own norm reduction
(the bandwidth yardsticks), in two timings; then the rbf forward with the norms inline, from the pass, and without a
norm term, next to SDPA flash / cuDNN, in the same two timings.

    PYTHONPATH=. python benchmarks/probe_key_bias.py --out DIR [--d 64,128] [--n 512,1024,4096] [--tokens 32768]
        [--heads 16] [--rounds 3]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/probe_key_bias.py --check   # CPU: every config is exact

Two timings per cell, because at these sizes a call's host time is as long as its GPU time:
- "GPU us": the call captured 20 times in a CUDA graph and replayed (``triton.testing.do_bench_cudagraph``): kernel
  time alone, no host.
- "stream us": 50 calls back to back between two CUDA events, no synchronisation between them: what a model's
  stream of calls pays, the host included where the host is the slower side.
Every pass config is first checked against ``torch.linalg.vector_norm`` in float32, and the forward's two norm
sources against the naive float32 attention (``probe_forward_variants.check_cell``); the run stops on a mismatch.
Keys come in two layouts: contiguous ``[B, H, N, D]`` and the heads-interleaved view of a ``[B, N, H, D]`` projection
output (what a model's ``.view(...).transpose(1, 2)`` passes).  Writes ``key_bias.json`` / ``key_bias.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_rbf.kernels_common import key_bias, key_bias_config  # noqa: E402
from probe_forward_variants import check_cell  # noqa: E402

# (keys per program, warps) tried one by one
PASS_CONFIGS = [(32, 1), (32, 2), (64, 2), (64, 4), (128, 2), (128, 4), (128, 8), (256, 4), (256, 8), (512, 8)]
LOG2E = 1.4426950408889634


def make_keys(b, h, n, d, layout, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if layout == "interleaved":
        return torch.randn(b, n, h, d, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype)


def check_pass(k, gamma, block, warps):
    """The pass at ``(block, warps)`` against the float32 torch reduction; raises on a mismatch."""
    b, h, n, _ = k.shape
    kb, kn = key_bias(k, -gamma, None, None, h, n, b, True, block=block, num_warps=warps)
    ref = torch.linalg.vector_norm(k.float(), dim=-1).square()
    err = ((kn - ref).abs().max() / ref.abs().max()).item()
    err_b = ((kb - (-gamma.view(1, -1, 1) * ref * LOG2E)).abs().max() / (gamma.max() * ref.abs().max())).item()
    if max(err, err_b) > 1e-5:
        raise AssertionError(f"key-bias pass block={block} warps={warps}: relative error {max(err, err_b):.2e}")
    return max(err, err_b)


def check_on_cpu():
    """Under the interpreter: every config on odd lengths, both layouts, two head dims."""
    for layout in ("contiguous", "interleaved"):
        for d in (16, 40):
            k = make_keys(2, 3, 37, d, layout, "cpu", torch.float32)
            gamma = torch.rand(3) + 0.1
            for block, warps in [(16, 1), (32, 2), (64, 4)]:
                check_pass(k, gamma, block, warps)
    print("every key-bias config agrees with torch's norm")


def gpu_us(fn):
    import triton

    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as e:  # noqa: BLE001 (a call that cannot be captured keeps its stream timing)
        print(f"no CUDA-graph timing: {type(e).__name__}: {str(e)[:160]}", flush=True)
        torch.cuda.synchronize()
        return math.nan


def stream_us(fn, calls=50):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / calls


def forward_fns(q, k, v, gamma):
    """SDPA's backends; the rbf forward kernel with inline norms, from the pass, and without a norm term
    (``probe_forward_variants.variants``); GKA's forward through ``gka_attention``; rbf's forward + backward through
    ``rbf_attention`` next to SDPA flash's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    import hf_rbf
    from probe_forward_variants import variants

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return call

    fns = {"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION)}
    for name, fn in variants(q, k, v, gamma).items():
        if name != "key-bias pass alone":
            fns[f"fwd {name}"] = fn
    log_sigma = torch.full((q.shape[1],), 0.5 * math.log(math.sqrt(q.shape[-1])), device=q.device)
    fns["gka fwd"] = lambda: hf_rbf.gka_attention(k, log_sigma, causal=True, backend="triton")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = hf_rbf.rbf_attention(*leaves, gamma=gamma, causal=True, backend="triton")
        return torch.autograd.grad(out, leaves, dout)

    def sdpa_fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        return torch.autograd.grad(out, leaves, dout)

    fns["SDPA flash fwd+bwd"] = sdpa_fwd_bwd
    fns["rbf fwd+bwd"] = fwd_bwd
    return fns


def measure(fns, rounds):
    best = {}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            g, s = gpu_us(fn), stream_us(fn)
            old = best.get(name, (math.inf, math.inf))
            best[name] = (old[0] if math.isnan(g) else min(old[0], g), min(old[1], s))  # inf: never captured
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="key_bias")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="512,1024,4096")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="CPU check of every config under the interpreter")
    ap.add_argument("--forward-only", action="store_true", help="skip the pass's configs: only the forward rows")
    args = ap.parse_args()
    if args.check:
        check_on_cpu()
        return 0
    import triton

    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    started = time.time()
    rows = []
    for d in (int(x) for x in args.d.split(",")):
        for n in (int(x) for x in args.n.split(",")):
            b = max(1, args.tokens // n)
            gamma = torch.full((args.heads,), 0.5 / math.sqrt(d), device=dev)
            for layout in () if args.forward_only else ("contiguous", "interleaved"):
                k = make_keys(b, args.heads, n, d, layout, dev, torch.bfloat16)
                h = args.heads
                fns = {"copy of the keys (read + write)": lambda k=k: k.clone(),
                       "torch vector_norm (fp32)": lambda k=k: torch.linalg.vector_norm(k, dim=-1,
                                                                                       dtype=torch.float32)}
                for block, warps in PASS_CONFIGS:
                    check_pass(k, gamma, block, warps)
                    fns[f"pass {block} keys, {warps} warps"] = (
                        lambda k=k, block=block, warps=warps: key_bias(k, -gamma, None, None, h, n, b, True,
                                                                       block=block, num_warps=warps))
                res = measure(fns, args.rounds)
                key_bytes = k.numel() * k.element_size()
                for name, (g, s) in res.items():
                    rows.append(dict(d=d, n=n, b=b, layout=layout, name=name, gpu_us=g, stream_us=s,
                                     key_gb_per_s=key_bytes / (g * 1e-6) / 1e9))
                print(f"D{d} N{n} {layout}:", {k_: (round(g, 1), round(s, 1)) for k_, (g, s) in res.items()},
                      flush=True)
                del k
            q, k, v = (make_keys(b, args.heads, n, d, "contiguous", dev, torch.bfloat16, seed=i) for i in range(3))
            # the forward with inline norms and with the pass's norms, on the first batch element, against the naive
            # float32 attention before any timing (raises over 3e-2: a timing of a wrong kernel is no timing)
            error = check_cell(q, k, v, gamma)
            res = measure(forward_fns(q, k, v, gamma), args.rounds)
            for name, (g, s) in res.items():
                rows.append(dict(d=d, n=n, b=b, layout="contiguous", name=name, gpu_us=g, stream_us=s,
                                 error_vs_naive=None if name.startswith(("SDPA", "fwd no norm")) else error))
            print(f"D{d} N{n} forward:", {k_: (round(g, 1), round(s, 1)) for k_, (g, s) in res.items()}, flush=True)
            del q, k, v
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                tokens=args.tokens, heads=args.heads, shipped=key_bias_config(),
                seconds=round(time.time() - started, 1))
    with open(os.path.join(args.out, "key_bias.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# The key-bias pass and the rbf forward ({meta['device']}, torch {meta['torch']}, triton "
             f"{meta['triton']}; causal bf16, {args.tokens} tokens per call, H{args.heads}; best of {args.rounds} "
             "rounds; GPU us = CUDA-graph replay, stream us = 50 calls back to back)", "",
             "| D | N | layout | what | GPU us | stream us | key GB/s (GPU) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = f"{r['key_gb_per_s']:.0f}" if "key_gb_per_s" in r else ""
        lines.append(f"| {r['d']} | {r['n']} | {r['layout']} | {r['name']} | {r['gpu_us']:.1f} | "
                     f"{r['stream_us']:.1f} | {bw} |")
    with open(os.path.join(args.out, "key_bias.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
