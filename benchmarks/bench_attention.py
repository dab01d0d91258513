"""Attention benchmark: the fused Triton kernels against FlexAttention, the SDPA padding trick, naive and
dot-product SDPA (flash and cuDNN), all in one run on one GPU.

Training shapes: B2 H16, N in {1k, 2k, 4k, 8k, 16k}, D in {64, 128}, causal and causal with a 1024 window,
bfloat16.  For every family (rbf, gka, scalar, hybrid) and implementation (triton, flex, sdpa, naive) it measures the
forward and the forward+backward median time, model TFLOP/s and peak memory, and prints ratios against dot-product
SDPA with the flash backend (the causal run at the same N and D: SDPA has no sliding window, so windowed rows show
what the window saves against full causal attention).  A row that cannot run says why (the backend's own reason,
an exception, "does not fit").  Decode: microseconds per layer step for one query against cache lengths 8k..1M,
our exact split-K kernels against dense SDPA decode; :data:`DECODE_IMPLS` is where the scalar-sort cache's
sorted-window kernel registers when it exists.

    PYTHONPATH=. python benchmarks/bench_attention.py --out benchmarks/results/<name>

Writes ``results.json``, ``results.csv`` and ``results.md`` (tables) and ``kernels.md`` (the compiler's report on the
chosen kernels: registers, spills, shared memory, tiles) to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("rbf", "gka", "scalar", "hybrid")
IMPLS = ("triton", "flex", "sdpa", "naive")
OPS = {"rbf": "rbf_attention", "gka": "gka_attention", "scalar": "scalar_attention", "hybrid": "hybrid_attention"}
SCALAR_GROUPS = 4  # value groups of the scalar family (H16 -> 4 heads per group), as in the reference measurement


# --------------------------------------------------------------------------------------------------------------
# inputs and calls
# --------------------------------------------------------------------------------------------------------------


def make_inputs(family, b, h, n, d, dtype, device, grad: bool, nq: int | None = None):
    """Model-like inputs: RBF with gamma = 1/sqrt(D) (fixed, as in the blog), GKA with a learnable per-head
    log sigma, scalar with learnable per-head tau and G=4 value groups, hybrid with learnable per-head tau."""
    import torch

    nq = n if nq is None else nq
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_(grad)

    def param(x):
        return x.to(device).requires_grad_(grad)

    if family == "rbf":
        return dict(q=rnd(b, h, nq, d), k=rnd(b, h, n, d), v=rnd(b, h, n, d)), {}
    if family == "gka":
        t = dict(x=rnd(b, h, n, d), log_sigma=param(torch.full((h,), 0.5 * math.log(d))))
        if nq != n:
            t["query"] = rnd(b, h, nq, d)
        return t, {"eps": 1e-6}
    if family == "scalar":
        return dict(
            qs=rnd(b, h, nq), ks=rnd(b, h, n), v=rnd(b, SCALAR_GROUPS, n, d), tau=param(torch.full((h,), 1.0))
        ), {}
    return dict(
        q=rnd(b, h, nq, d),
        k=rnd(b, h, n, d),
        v=rnd(b, h, n, d),
        qs=rnd(b, h, nq),
        ks=rnd(b, h, n),
        tau=param(torch.full((h,), 1.0)),
    ), {}


def call(family, t, extra, backend, causal, window):
    import hf_rbf

    kw = dict(causal=causal, window=window, backend=backend, **extra)
    if family == "rbf":
        return hf_rbf.rbf_attention(t["q"], t["k"], t["v"], **kw)
    if family == "gka":
        return hf_rbf.gka_attention(t["x"], t["log_sigma"], query=t.get("query"), **kw)
    if family == "scalar":
        return hf_rbf.scalar_attention(t["qs"], t["ks"], t["v"], t["tau"], **kw)
    return hf_rbf.hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], **kw)


def allowed_pairs(n, causal, window):
    """Number of (query, key) pairs that a causal / windowed mask allows (N queries over N keys)."""
    if not causal:
        return n * n if window is None else sum(min(n, i + window) - max(0, i - window + 1) for i in range(n))
    if window is None:
        return n * (n + 1) // 2
    w = min(window, n)
    return w * (w + 1) // 2 + (n - w) * w


def model_flops(family, b, h, n, d, causal, window, backward: bool) -> float:
    """Matrix-product FLOPs: 2 products of 2*pairs*D forward (one for scalar, whose score has no product) and the
    usual 2.5x forward for the backward (scalar: 2 products)."""
    pairs = allowed_pairs(n, causal, window) * b * h
    if family == "scalar":
        fwd = 2.0 * pairs * d
        return fwd * (3.0 if backward else 1.0)
    fwd = 4.0 * pairs * d
    return fwd * (3.5 if backward else 1.0)


# --------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------


def bench_ms(fn, grad_to_none=None, rep=40):
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def measure(run_fwd, run_fwdbwd, leaves):
    """(fwd ms, fwd+bwd ms, fwd+bwd peak MB above the inputs) for one implementation."""
    import torch

    out = {}
    with torch.no_grad():
        run_fwd()
        out["fwd_ms"] = bench_ms(run_fwd)
    if run_fwdbwd is not None:
        run_fwdbwd()
        torch.cuda.synchronize()
        for t in leaves:
            t.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_fwdbwd()
        torch.cuda.synchronize()
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out["fwdbwd_ms"] = bench_ms(run_fwdbwd, grad_to_none=leaves)
    return out


def naive_fits(b, h, n) -> bool:
    import torch

    need = 8 * b * h * n * n * 4  # about eight fp32 N x N tensors live in the materialised forward + backward
    free, _ = torch.cuda.mem_get_info()
    return need < 0.7 * free


def bench_family(family, impl, b, h, n, d, causal, window, dtype):
    import torch

    leaves_t, extra = make_inputs(family, b, h, n, d, dtype, "cuda", grad=True)
    leaves = [t for t in leaves_t.values() if t.requires_grad]
    gen = torch.Generator(device="cpu").manual_seed(1)
    dout = torch.randn(b, h, n, d, generator=gen).to(device="cuda", dtype=dtype)

    def fwd():
        return call(family, leaves_t, extra, impl, causal, window)

    def fwdbwd():
        fwd().backward(dout)

    res = measure(fwd, fwdbwd, leaves)
    res["backend"] = __import__("hf_rbf").last_backend(OPS[family])
    return res


def bench_sdpa_dot(backend_name, b, h, n, d, dtype):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, n, d, generator=g).to("cuda", dtype)

    def fwd():
        with sdpa_kernel([kind]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwdbwd():
        fwd().backward(dout)

    return measure(fwd, fwdbwd, [q, k, v])


_FLEX_DIRECT = {}


def bench_flex_direct(b, h, n, d, dtype):
    """FlexAttention used the way its documentation shows, with the RBF score: ``torch.compile(flex_attention)``, a
    causal ``create_block_mask`` made once, ``q' = 2 gamma q`` and a ``score_mod`` adding the per-key bias
    ``-gamma ||k_j||^2`` (float32, computed per call in eager mode and differentiated).  The yardstick of issue 18's
    "the flex backend at least as fast as FlexAttention used directly": the rbf/flex row does the same through
    ``hf_rbf.rbf_attention(backend="flex")``."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX_DIRECT:
        _FLEX_DIRECT["fn"] = torch.compile(flex_attention)
    flex = _FLEX_DIRECT["fn"]
    block_mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, n, n, device="cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, n, d, generator=g).to("cuda", dtype)
    gamma = 1.0 / math.sqrt(d)

    def fwd():
        bias = -gamma * k.float().square().sum(-1)  # [B, H, N]

        def score_mod(score, b_, h_, qi, ki):
            return score + bias[b_, h_, ki]

        return flex(q * (2.0 * gamma), k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0)

    def fwdbwd():
        fwd().backward(dout)

    return measure(fwd, fwdbwd, [q, k, v])


# --------------------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------------------


def _decode_sdpa(L, h, d, dtype):
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, h, 1, d, generator=g).to("cuda", dtype)
    k = torch.randn(1, h, L, d, generator=g).to("cuda", dtype)
    v = torch.randn(1, h, L, d, generator=g).to("cuda", dtype)
    return lambda: F.scaled_dot_product_attention(q, k, v)


def _decode_family(family):
    def make(L, h, d, dtype):

        t, extra = make_inputs(family, 1, h, L, d, dtype, "cuda", grad=False, nq=1)
        if family == "gka":
            t["query"] = t["x"][:, :, -1:].clone()
        return lambda: call(family, t, extra, "triton", True, None)

    return make


# name -> factory(L, H, D, dtype) returning a no-argument step function.  The scalar-sort cache work registers its
# sorted-window kernel here ("scalar-sorted-window") next to the dense baselines.
DECODE_IMPLS = {
    "sdpa-dot (dense)": _decode_sdpa,
    "rbf triton (exact, split-K)": _decode_family("rbf"),
    "gka triton (exact, split-K)": _decode_family("gka"),
    "hybrid triton (exact, split-K)": _decode_family("hybrid"),
}


def bench_decode(lengths, h, d, dtype):
    import torch
    import triton

    rows = []
    for L in lengths:
        for name, factory in DECODE_IMPLS.items():
            row = dict(kind="decode", impl=name, cache_len=L, h=h, d=d)
            try:
                with torch.no_grad():
                    step = factory(L, h, d, dtype)
                    step()
                    torch.cuda.synchronize()
                    row["eager_us"] = 1e3 * triton.testing.do_bench(step, warmup=5, rep=30, return_mode="median")
                    try:
                        row["graph_us"] = 1e3 * triton.testing.do_bench_cudagraph(step, rep=30, return_mode="median")
                    except Exception as exc:  # noqa: BLE001
                        row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            print(
                f"decode L={L:>8} {name:<32} "
                + (
                    f"{row.get('eager_us', float('nan')):8.1f} us eager  "
                    f"{row.get('graph_us', float('nan')):8.1f} us graph"
                    if "error" not in row
                    else row["error"]
                ),
                flush=True,
            )
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------------------
# compiler report
# --------------------------------------------------------------------------------------------------------------


def kernel_report() -> list[dict]:
    """Registers, spills, shared memory and the chosen tiles of every compiled fused kernel in this process."""
    from hf_rbf import kernels_flash_bwd, kernels_flash_fwd, kernels_scalar_bwd, kernels_scalar_fwd

    tuners = {
        "distance_fwd": kernels_flash_fwd._distance_fwd,
        "distance_decode": kernels_flash_fwd._distance_decode,
        "distance_bwd_dkdv": kernels_flash_bwd._distance_bwd_dkdv,
        "distance_bwd_dq": kernels_flash_bwd._distance_bwd_dq,
        "scalar_fwd": kernels_scalar_fwd._scalar_fwd,
        "scalar_bwd_dkv": kernels_scalar_bwd._scalar_bwd_dkv,
        "scalar_bwd_dq": kernels_scalar_bwd._scalar_bwd_dq,
    }
    rows = []
    for name, tuner in tuners.items():
        chosen = {str(k): str(v) for k, v in getattr(tuner, "cache", {}).items()}
        fn = tuner.fn
        caches = getattr(fn, "device_caches", None)
        kernels = []
        if caches:
            for dev_cache in caches.values():
                cache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
                kernels += list(cache.items())
        elif hasattr(fn, "cache"):
            for dev_cache in fn.cache.values():
                kernels += list(dev_cache.items())
        for key, kern in kernels:
            try:
                if hasattr(kern, "_init_handles"):
                    kern._init_handles()
                md = kern.metadata
                consts = " ".join(str(key).split())
                rows.append(
                    dict(
                        kernel=name,
                        n_regs=getattr(kern, "n_regs", None),
                        n_spills=getattr(kern, "n_spills", None),
                        shared=getattr(md, "shared", None),
                        num_warps=getattr(md, "num_warps", None),
                        num_stages=getattr(md, "num_stages", None),
                        constants=consts[-600:],
                    )
                )
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel=name, error=str(exc)[:200]))
        rows.append(dict(kernel=name, autotune_choices=chosen))
    return rows


# --------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------


def warm_compile(args):
    """Compile every triton kernel variant of the benchmark in parallel worker processes (Triton's on-disk cache
    then serves the main process; compilation, not timing, dominates a cold run)."""
    jobs = []
    env = dict(os.environ)
    for fam in args.families:
        for d in args.d:
            for mask in args.masks:
                cmd = [
                    sys.executable,
                    __file__,
                    "--warm-only",
                    "--families",
                    fam,
                    "--d",
                    str(d),
                    "--masks",
                    mask,
                    "--n",
                    "512",
                    "--out",
                    args.out,
                ]
                jobs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failures = []
    for job in jobs:
        out, _ = job.communicate()
        if job.returncode != 0:
            failures.append(out[-2000:])
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--d", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    ap.add_argument("--masks", type=lambda s: s.split(","), default=["causal", "window1024"])
    ap.add_argument("--families", type=lambda s: s.split(","), default=list(FAMILIES))
    ap.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    ap.add_argument(
        "--flex-n",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="sequence lengths with flex rows (default: all); flex compiles per shape",
    )
    ap.add_argument(
        "--flex-d",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="head dims with flex rows (default: all)",
    )
    ap.add_argument("--flex-masks", type=lambda s: s.split(","), default=None, help="masks with flex rows")
    ap.add_argument(
        "--decode-lens",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8192, 32768, 131072, 524288, 1048576],
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per call: batch = tokens / N at each N (the training-speed issue's tables use 32768); default B2",
    )
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop timing new rows after this many seconds")
    ap.add_argument("--no-warm", action="store_true", help="skip the parallel compile warm-up")
    ap.add_argument("--profile", action="store_true", help="per-kernel CUDA times, triton rows (D64, --profile-n)")
    ap.add_argument(
        "--profile-n",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2048, 8192],
        help="sequence lengths of --profile (B = --tokens / N where --tokens is given, else 2)",
    )
    ap.add_argument("--naive-max-n", type=int, default=None, help="naive rows only up to this N (time)")
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens is not None and args.tokens < 1:
        ap.error(f"--tokens must be a positive number of tokens per call; got {args.tokens}")
    if not args.profile_n or min(args.profile_n) < 1:
        ap.error(f"--profile-n takes positive sequence lengths, comma-separated; got {args.profile_n}")

    import torch

    import hf_rbf  # noqa: F401

    dtype = torch.bfloat16
    b, h = 2, 16
    if args.warm_only:
        for d in args.d:
            for mask in args.masks:
                window = 1024 if mask.startswith("window") else None
                for fam in args.families:
                    t, extra = make_inputs(fam, b, h, 512, d, dtype, "cuda", grad=True)
                    out = call(fam, t, extra, "triton", True, window)
                    out.backward(torch.ones_like(out))
                    if fam != "scalar":
                        with torch.no_grad():
                            t1, extra1 = make_inputs(fam, 1, h, 4096, d, dtype, "cuda", grad=False, nq=1)
                            if fam == "gka":
                                t1["query"] = t1["x"][:, :, -1:].clone()
                            call(fam, t1, extra1, "triton", True, None)
        torch.cuda.synchronize()
        return 0

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    env = dict(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(),
        triton=__import__("triton").__version__,
        shapes=(f"B = {args.tokens} tokens / N" if args.tokens else f"B{b}") + f" H{h} bf16",
        started=time.strftime("%Y-%m-%d %H:%M"),
    )
    print(json.dumps(env), flush=True)
    if "triton" in args.impls and not args.no_warm:
        t0 = time.time()
        fails = warm_compile(args)
        print(f"parallel compile warm-up: {time.time() - t0:.0f}s, {len(fails)} failures", flush=True)
        for f in fails:
            print(f)

    if args.profile and "triton" in args.impls:
        profile_headline(args, out_dir, b, h, dtype)
    rows = []
    shapes = [(d, mask, n) for d in args.d for mask in args.masks for n in args.n]
    # the headline shape first, so that it is measured whatever the time budget allows
    shapes.sort(key=lambda s: (s != (64, "causal", 8192), s))
    have_ref = set()
    for d, mask, n in shapes:
        window = 1024 if mask.startswith("window") else None
        b = max(1, args.tokens // n) if args.tokens else 2
        for ref in ("flash", "cudnn"):
            if (n, d, ref) in have_ref:  # one causal dot-product reference per (N, D), whatever the mask
                continue
            have_ref.add((n, d, ref))
            row = dict(kind="train", family="dot", impl=f"sdpa-{ref}", b=b, n=n, d=d, mask="causal")
            try:
                row.update(bench_sdpa_dot(ref, b, h, n, d, dtype))
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            row["tflops_fwdbwd"] = (
                model_flops("rbf", b, h, n, d, True, None, True) / row.get("fwdbwd_ms", math.inf) / 1e9
            )
            rows.append(row)
            _print_row(row)
        if "flex" in args.impls and _flex_selected(args, n, d, "causal") and (n, d, "flex-direct") not in have_ref:
            have_ref.add((n, d, "flex-direct"))
            row = dict(kind="train", family="dot", impl="flex-direct (rbf score)", b=b, n=n, d=d, mask="causal")
            try:
                row.update(bench_flex_direct(b, h, n, d, dtype))
                row["tflops_fwdbwd"] = model_flops("rbf", b, h, n, d, True, None, True) / row["fwdbwd_ms"] / 1e9
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            _print_row(row)
        for fam in args.families:
            for impl in args.impls:
                row = dict(kind="train", family=fam, impl=impl, b=b, n=n, d=d, mask=mask)
                if time.time() - t_start > args.budget_s:
                    row["error"] = "not run: time budget of this run spent"
                elif impl == "flex" and not _flex_selected(args, n, d, mask):
                    row["error"] = "not run in this benchmark run: flex compiles per shape (see --flex-n/-d/-masks)"
                elif impl == "naive" and not naive_fits(b, h, n):
                    row["error"] = "does not fit: the materialised scores exceed the GPU memory"
                elif impl == "naive" and args.naive_max_n is not None and n > args.naive_max_n:
                    row["error"] = f"not run in this benchmark run: naive rows only up to N={args.naive_max_n} (time)"
                else:
                    try:
                        row.update(bench_family(fam, impl, b, h, n, d, True, window, dtype))
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                if "fwdbwd_ms" in row:
                    row["tflops_fwdbwd"] = model_flops(fam, b, h, n, d, True, window, True) / row["fwdbwd_ms"] / 1e9
                    row["tflops_fwd"] = model_flops(fam, b, h, n, d, True, window, False) / row["fwd_ms"] / 1e9
                rows.append(row)
                _print_row(row)
                # the tables so far after every row: a job cut by its time limit still leaves them (a cut during the
                # first shape left none, benchmarks/results/h100-2026-11-27j call 2); the kernel report per shape
                _write(out_dir, env, rows, [])
                if impl == "naive":
                    torch.cuda.empty_cache()
        _write(out_dir, env, rows, [], kernel_report())

    decode_rows = bench_decode(args.decode_lens, h, 64, dtype) if args.decode_lens else []
    report = kernel_report()
    _write(out_dir, env, rows, decode_rows, report)
    if args.profile and (out_dir / "profile.md").exists():
        with open(out_dir / "kernels.md", "a") as f:
            f.write((out_dir / "profile.md").read_text())
    print(open(out_dir / "results.md").read())
    print(f"total {time.time() - t_start:.0f}s")
    return 0


def profile_headline(args, out_dir: Path, b, h, dtype):
    """Per-kernel CUDA time and the host time of one forward+backward (D64, causal, each N of ``--profile-n``; the
    batch ``--tokens / N`` where ``--tokens`` is given, as in the timed rows, else ``b``): the triton path of each
    family and dot-product SDPA-flash, to separate kernel time from launch overhead (a wall time well above the
    kernels' total is host work)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    lines = ["", "# Profiler: one forward+backward, D64 causal bf16 (CUDA time per kernel, host time)", ""]
    batch = b
    for n in args.profile_n:
        b = max(1, args.tokens // n) if args.tokens else batch
        cases = []
        for fam in args.families:
            t, extra = make_inputs(fam, b, h, n, 64, dtype, "cuda", grad=True)
            cases.append((f"{fam} triton", lambda t=t, extra=extra, fam=fam: call(fam, t, extra, "triton", True, None)))
        qkv = [torch.randn(b, h, n, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]

        def flash(qkv=qkv):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(*qkv, is_causal=True)

        cases.append(("dot sdpa-flash", flash))
        dout = torch.randn(b, h, n, 64, device="cuda", dtype=dtype)
        for name, fn in cases:
            for _ in range(3):
                fn().backward(dout)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn().backward(dout)
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
            events.sort(key=lambda e: -e.self_device_time_total)
            total = sum(e.self_device_time_total for e in events) / 1e3
            lines.append(
                f"## N{n} B{b} {name}: kernels {total:.3f} ms of GPU time, {wall:.2f} ms wall under the profiler"
            )
            lines.append("")
            lines += [f"- {e.key[:90]}: {e.self_device_time_total / 1e3:.3f} ms x{e.count}" for e in events[:8]]
            lines.append("")
            print(lines[-len(events[:8]) - 3], flush=True)
    (out_dir / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def _flex_selected(args, n, d, mask) -> bool:
    return (
        (args.flex_n is None or n in args.flex_n)
        and (args.flex_d is None or d in args.flex_d)
        and (args.flex_masks is None or mask in args.flex_masks)
    )


def _print_row(row):
    if "error" in row:
        print(
            f"{row['family']:>6} {row['impl']:<12} N{row['n']:>6} D{row['d']:<4} {row['mask']:<11} {row['error']}",
            flush=True,
        )
    else:
        print(
            f"{row['family']:>6} {row['impl']:<12} N{row['n']:>6} D{row['d']:<4} {row['mask']:<11} "
            f"fwd {row['fwd_ms']:8.3f} ms  fwd+bwd {row.get('fwdbwd_ms', float('nan')):8.3f} ms  "
            f"peak {row.get('peak_mb', float('nan')):8.0f} MB  [{row.get('backend', '')}]",
            flush=True,
        )


def _fmt(x, spec):
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _write(out_dir: Path, env, rows, decode_rows, report=None):
    with open(out_dir / "results.json", "w") as f:
        json.dump(dict(env=env, train=rows, decode=decode_rows, kernels=report or []), f, indent=1)
    keys = [
        "family",
        "impl",
        "n",
        "d",
        "mask",
        "fwd_ms",
        "fwdbwd_ms",
        "tflops_fwd",
        "tflops_fwdbwd",
        "peak_mb",
        "backend",
        "error",
    ]
    with open(out_dir / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    ref = {(r["n"], r["d"]): r for r in rows if r["impl"] == "sdpa-flash" and "fwdbwd_ms" in r}
    lines = [
        f"# Attention benchmark ({env['device']}, torch {env['torch']}, triton {env['triton']}, {env['shapes']}, "
        f"{env['started']})",
        "",
        "Ratios are time / dot-product SDPA-flash causal time at the same N and D (for window rows too: SDPA has "
        "no sliding window); memory ratio is fwd+bwd peak / SDPA-flash's.",
        "",
        "| family | impl | mask | N | D | fwd ms | fwd+bwd ms | x flash (fwd+bwd) | x flash (fwd) | TFLOP/s f+b | "
        "peak MB | x flash mem | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rf = ref.get((r["n"], r["d"]))
        ratio = r["fwdbwd_ms"] / rf["fwdbwd_ms"] if rf and "fwdbwd_ms" in r else None
        ratio_f = r["fwd_ms"] / rf["fwd_ms"] if rf and "fwd_ms" in r else None
        mem = r["peak_mb"] / rf["peak_mb"] if rf and "peak_mb" in r and rf.get("peak_mb") else None
        note = r.get("error", "") or (f"served by {r['backend']}" if r.get("backend") not in (None, r["impl"]) else "")
        lines.append(
            f"| {r['family']} | {r['impl']} | {r['mask']} | {r['n']} | {r['d']} | {_fmt(r.get('fwd_ms'), '.3f')} "
            f"| {_fmt(r.get('fwdbwd_ms'), '.3f')} | {_fmt(ratio, '.2f')} | {_fmt(ratio_f, '.2f')} | "
            f"{_fmt(r.get('tflops_fwdbwd'), '.0f')} | {_fmt(r.get('peak_mb'), '.0f')} | {_fmt(mem, '.2f')} | "
            f"{note.replace('|', '/')} |"
        )
    if decode_rows:
        lines += [
            "",
            "## Decode (one query, B1 H16 D64, bf16, one layer step)",
            "",
            "| impl | cache length | eager us | CUDA-graph us | note |",
            "|---|---|---|---|---|",
        ]
        for r in decode_rows:
            lines.append(
                f"| {r['impl']} | {r['cache_len']} | {_fmt(r.get('eager_us'), '.1f')} | "
                f"{_fmt(r.get('graph_us'), '.1f')} | {r.get('error', r.get('graph_error', ''))} |"
            )
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    if report:
        klines = [
            "# Compiled fused kernels (registers, spills, shared memory, tiles)",
            "",
            "| kernel | regs | spills | shared B | warps | stages | constants |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report:
            if "autotune_choices" in r:
                for k, v in r["autotune_choices"].items():
                    klines.append(f"| {r['kernel']} autotune | | | | | | key {k[:200]} -> {v} |")
            elif "error" in r:
                klines.append(f"| {r['kernel']} | | | | | | {r['error']} |")
            else:
                klines.append(
                    f"| {r['kernel']} | {r['n_regs']} | {r['n_spills']} | {r['shared']} | {r['num_warps']} "
                    f"| {r['num_stages']} | {r['constants'].replace('|', '/')} |"
                )
        (out_dir / "kernels.md").write_text("\n".join(klines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
