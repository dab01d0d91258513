"""Time and check this tree's fused attention against a second copy of the package in one process.

A kernel change is judged by an A/B on one GPU in one process (the hosts are noisy between calls).  The base is
another commit's package imported under another name, which works because every module imports its siblings
relatively and registers its custom ops under a namespace of its own import name (the remote-code design):

    git archive <commit> hf_rbf | tar x -C /tmp/base && mv /tmp/base/hf_rbf /tmp/base/hf_rbf_base
    PYTHONPATH=.:/tmp/base python benchmarks/compare_package_copies.py --base hf_rbf_base --out OUT

For each family (bf16, causal, H heads, ``--tokens`` tokens per call so B = tokens / N) it reports:

* forward+backward milliseconds of both copies and of SDPA's flash backend (median of the rounds' medians; the
  rounds interleave the three), the ratio to flash and new / base, and the peak memory of a call;
* at ``--check-n`` (B2), the relative error of the output and of every gradient against the float64 naive
  reference, for both copies (the scalar term's gradients -- the scalar query and key, the temperature -- are the
  ones a backward change of the scalar sums moves).

The temperature is a learnable tensor (``--tau head``: ``[1, H, 1]``; ``token``: ``[B, H, N]``), as in training.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_rbf  # noqa: E402

FAMILIES = ("rbf", "hybrid", "scalar")


def make_inputs(family: str, b: int, h: int, n: int, d: int, tau_form: str, seed: int, dtype=torch.bfloat16):
    """Leaf tensors of one call (on the GPU, requiring grad) and the call taking a package and a backend."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        x = torch.randn(*shape, device="cuda", generator=gen) * scale
        return x.to(dtype).requires_grad_()

    t = {}
    if family in ("rbf", "hybrid"):
        t["q"], t["k"] = rnd(b, h, n, d), rnd(b, h, n, d)
    t["v"] = rnd(b, h, n, d)
    if family in ("hybrid", "scalar"):
        t["qs"], t["ks"] = rnd(b, h, n, scale=2.0), rnd(b, h, n, scale=2.0)
        shape = (1, h, 1) if tau_form == "head" else (b, h, n)
        t["tau"] = (torch.rand(*shape, device="cuda", generator=gen) + 0.5).requires_grad_()
    if family == "rbf":
        t["gamma"] = torch.full((h,), 0.5 / d**0.5, device="cuda").requires_grad_()

    def call(pkg, x, backend):
        if family == "rbf":
            return pkg.rbf_attention(x["q"], x["k"], x["v"], gamma=x["gamma"], causal=True, backend=backend)
        if family == "hybrid":
            return pkg.hybrid_attention(
                x["q"], x["k"], x["v"], x["qs"], x["ks"], x["tau"], causal=True, backend=backend
            )
        return pkg.scalar_attention(x["qs"], x["ks"], x["v"], x["tau"], causal=True, backend=backend)

    return t, call


def fwd_bwd(fn, grad):
    """One forward+backward of ``fn`` (returns the output)."""
    out = fn()
    out.backward(grad)
    return out


def time_ms(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` calls, each timed by CUDA events (after one untimed call)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def timing_rows(family, base, args):
    rows = []
    for n in args.n:
        b = max(1, args.tokens // n)
        t, call = make_inputs(family, b, args.heads, n, args.d, args.tau, seed=1)
        grad = torch.randn(b, args.heads, n, args.d, device="cuda", dtype=torch.bfloat16)
        q = t.get("q", t["v"]).detach().requires_grad_()
        k = t.get("k", t["v"]).detach().requires_grad_()
        v = t["v"].detach().requires_grad_()

        def flash():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), grad)

        fns = {
            "SDPA flash": flash,
            "new": lambda: fwd_bwd(lambda: call(hf_rbf, t, "triton"), grad),
            "base": lambda: fwd_bwd(lambda: call(base, t, "triton"), grad),
        }
        for fn in fns.values():  # compile and autotune first
            fn()
        torch.cuda.synchronize()
        per = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                per[name].append(time_ms(fn, args.reps))
        ms = {name: statistics.median(v) for name, v in per.items()}
        mem = {name: peak_mb(fn) for name, fn in fns.items()}
        row = dict(family=family, n=n, b=b, d=args.d, ms=ms, rounds=per, peak_mb=mem)
        row["new_vs_flash"] = ms["new"] / ms["SDPA flash"]
        row["base_vs_flash"] = ms["base"] / ms["SDPA flash"]
        row["new_vs_base"] = ms["new"] / ms["base"]
        print(
            f"[time] {family:6s} N{n:5d} B{b:3d}: flash {ms['SDPA flash']:.3f} ms, new {ms['new']:.3f} "
            f"({row['new_vs_flash']:.3f}x), base {ms['base']:.3f} ({row['base_vs_flash']:.3f}x), "
            f"new/base {row['new_vs_base']:.3f}; peak MB new {mem['new']:.0f} base {mem['base']:.0f} "
            f"flash {mem['SDPA flash']:.0f}",
            flush=True,
        )
        rows.append(row)
        fns.clear()  # (the closures hold this length's tensors)
        torch.cuda.empty_cache()
    return rows


def error_rows(family, base, args):
    """Relative errors of the output and every gradient against float64, both copies."""
    t, call = make_inputs(family, 2, args.heads, args.check_n, args.d, args.tau, seed=2)
    grad = torch.randn(2, args.heads, args.check_n, args.d, device="cuda", dtype=torch.bfloat16, generator=None)
    ref_t = {name: x.detach().double().requires_grad_() for name, x in t.items()}
    ref = call(hf_rbf, ref_t, "naive")
    ref.backward(grad.double())
    out = {}
    for label, pkg in (("new", hf_rbf), ("base", base)):
        for x in t.values():
            x.grad = None
        o = call(pkg, t, "triton")
        o.backward(grad)

        def rel(x, r):
            return ((x.double() - r).norm() / r.norm()).item()

        errs = {"out": rel(o.detach(), ref.detach())}
        errs.update({f"d{name}": rel(x.grad, ref_t[name].grad) for name, x in t.items()})
        out[label] = errs
        print(f"[error] {family:6s} N{args.check_n} {label:4s}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return dict(family=family, n=args.check_n, tau=args.tau, errors=out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="import name of the other package copy, e.g. hf_rbf_base")
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", type=lambda s: s.split(","), default=list(FAMILIES))
    ap.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--tau", choices=["head", "token"], default="head")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check-n", type=int, default=2048)
    args = ap.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"--families takes a comma-separated subset of {', '.join(FAMILIES)}; got {unknown}")
    base = importlib.import_module(args.base)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args), errors=[], timing=[])
    for family in args.families:
        res["errors"].append(error_rows(family, base, args))
        (out / "compare.json").write_text(json.dumps(res, indent=1))
    for family in args.families:
        res["timing"] += timing_rows(family, base, args)
        (out / "compare.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
