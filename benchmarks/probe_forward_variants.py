"""Where the fused forward's time goes against SDPA's: the rbf forward kernel as shipped, with the key norms from a
key-bias pass instead of the key tiles, and without any norm term (a plain scaled dot-product softmax: what the same
kernel costs as a FlashAttention-2-shaped kernel), next to SDPA's flash and cuDNN backends; then the forward's tile
configs one by one at one shape.

    PYTHONPATH=. python benchmarks/probe_forward_variants.py --out DIR [--d 64,128] [--n 512,1024,2048,4096,8192]
        [--tokens 32768] [--heads 16] [--sweep-n 2048] [--sweep-d 128] [--no-sweep] [--rounds 3] [--backward]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/probe_forward_variants.py --check   # CPU: the variants agree

Causal, bf16, ``B = tokens / N``.  Each cell: every variant once per round (interleaved), a round's time the median
of ``--iters`` launches after warm-up (CUDA events), the best round kept.  The autotuner's choice for the shipped
variant is reported per cell, and each cell is first checked against the naive float32 attention on the GPU
(``check_cell``: the run stops on a relative error over 3e-2).  Writes ``forward_variants.json`` / ``.md``.

What the rows say: "no norm term" against flash is the kernel's own shape (tiles, pipelining); "inline norms" against
"no norm term" is what computing ``||k||^2`` from a second read of each key tile costs; "key-bias pass" trades that
for one more launch that reads the keys once (its own time in its own row).  ``--backward`` adds the backward kernels
alone (dQ and dK/dV on saved forward outputs) of the three variants and SDPA flash's backward: the same split for the
backward, whose dQ loop streams the key tiles as the forward does.
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
from hf_rbf.kernels_flash_bwd import distance_backward  # noqa: E402
from hf_rbf.kernels_flash_fwd import distance_forward  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried one by one at the sweep shape (some may not fit: reported)
SWEEP_CONFIGS = [
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 4),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 32, 4, 2),
]


def rbf_inputs(b, h, n, d, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    gamma = torch.full((h,), 0.5 / math.sqrt(d), device=device, dtype=torch.float32)
    return q, k, v, gamma


# the variants that compute the rbf score (checked against the reference before any timing)
CHECKED = ("inline norms (shipped)", "key-bias pass + forward")


def variants(q, k, v, gamma):
    """name -> callable returning the output, for one set of inputs."""
    b, h, n, _ = q.shape
    common = dict(causal=True, window=None, num_prefix_keys=0, normalize=True, qnorm=False, kv_same=False, eps=0.0)

    def inline():
        return distance_forward(q, k, v, None, None, None, None, gamma, None, knorm_inline=True, **common)[0]

    def kb_pass():
        kb, _ = key_bias(k, -gamma, None, None, h, n, b, True)
        return distance_forward(q, k, v, kb, None, None, None, gamma, None, **common)[0]

    def kb_alone():
        return key_bias(k, -gamma, None, None, h, n, b, True)[0]

    def no_norm():
        return distance_forward(q, k, v, None, None, None, None, gamma, None, **common)[0]

    return {"inline norms (shipped)": inline, "key-bias pass + forward": kb_pass, "key-bias pass alone": kb_alone,
            "no norm term": no_norm}


def backward_variants(q, k, v, gamma, dout):
    """name -> callable running the backward kernels (dQ, dK/dV) of one variant on saved forward outputs: the key
    norms from a second read of the key tiles (``knorm_inline``), from the key-bias pass's vector, and no norm term."""
    b, h, n, _ = q.shape
    common = dict(causal=True, window=None, num_prefix_keys=0, normalize=True, qnorm=False, kv_same=False, eps=0.0)
    bwd = dict(common, need_dbeta=False, need_ab=True, need_dkb=False)
    out_inline, lse_inline = distance_forward(q, k, v, None, None, None, None, gamma, None, knorm_inline=True,
                                              **common)
    kb, _ = key_bias(k, -gamma, None, None, h, n, b, True)
    out_kb, lse_kb = distance_forward(q, k, v, kb, None, None, None, gamma, None, **common)
    out_plain, lse_plain = distance_forward(q, k, v, None, None, None, None, gamma, None, **common)

    def inline():
        return distance_backward(dout, q, k, v, None, None, None, None, gamma, None, out_inline, lse_inline,
                                 knorm=True, knorm_inline=True, **bwd)

    def from_pass():
        return distance_backward(dout, q, k, v, kb, None, None, None, gamma, None, out_kb, lse_kb,
                                 knorm=True, knorm_inline=False, **bwd)

    def no_norm():
        return distance_backward(dout, q, k, v, None, None, None, None, gamma, None, out_plain, lse_plain,
                                 knorm=False, knorm_inline=False, **bwd)

    return {"bwd inline norms": inline, "bwd norms from the pass": from_pass, "bwd no norm term": no_norm}


def sdpa_backward(q, k, v, dout):
    """SDPA flash's backward alone, on a saved forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    return {"SDPA flash bwd": lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)}


def sdpa_variants(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        out[name] = call
    return out


def time_ms(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def chosen_config(tuner) -> str:
    """The configs the autotuner has chosen so far (its cache), as text."""
    seen = []
    for cfg in getattr(tuner, "cache", {}).values():
        text = f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def measure(cells, rounds, iters):
    """cells: list of (label, {name: fn}); returns {label: {name: best ms or error}}."""
    results = {}
    for label, fns in cells:
        best = {}
        for name, fn in fns.items():  # warm-up: compile and tune
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (a config that does not fit is a row, not a crash)
                best[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
        for _ in range(rounds):
            for name, fn in fns.items():
                if isinstance(best.get(name), str):
                    continue
                t = time_ms(fn, iters)
                best[name] = min(best.get(name, float("inf")), t)
        results[label] = best
        print(label, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()}, flush=True)
    return results


def force_config(cfg):
    """Make the forward's autotuner launch exactly ``cfg`` (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    import triton

    tuner = kernels_flash_fwd._distance_fwd
    bm, bn, w, s = cfg
    tuner.configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)]
    tuner.cache.clear()
    tuner.__dict__.pop("_hf_rbf_direct", None)  # the direct launches remember the config they launched with


def check_on_cpu():
    """Under the interpreter: the three rbf variants give the same output, and that equals a float64 reference."""
    q, k, v, gamma = rbf_inputs(1, 2, 37, 16, "cpu", torch.float32)
    outs = {name: fn() for name, fn in variants(q, k, v, gamma).items() if name != "key-bias pass alone"}
    qd, kd, vd = (t.double() for t in (q, k, v))
    s = -gamma.double().view(1, -1, 1, 1) * torch.cdist(qd, kd).square()
    s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ vd
    for name in CHECKED:
        err = (outs[name].double() - ref).abs().max().item()
        assert err < 1e-4, (name, err)
    assert (outs["no norm term"].double() - ref).abs().max().item() > 1e-3  # it is a different score
    # the backward variants: dq / dk / dv of the two norm sources against autograd of the float64 reference
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.detach().requires_grad_() for t in (qd, kd, vd)]
    s = -gamma.double().view(1, -1, 1, 1) * torch.cdist(leaves[0], leaves[1]).square()
    s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    ref_grads = torch.autograd.grad(torch.softmax(s, -1) @ leaves[2], leaves, dout.double())
    for name, fn in backward_variants(q, k, v, gamma, dout).items():
        dq, dk, dv = fn()[:3]
        errs = [((g.double() - r).norm() / r.norm()).item() for g, r in zip((dq, dk, dv), ref_grads)]
        if name != "bwd no norm term":
            assert max(errs) < 1e-4, (name, errs)
    check_cell(q, k, v, gamma, dout)  # what main runs on the GPU before timing a cell
    print("variants agree with the float64 reference:", {n: o.shape for n, o in outs.items()}, "and the backward")


def check_cell(q, k, v, gamma, dout=None) -> float:
    """Before a cell is timed on the GPU: the two norm sources' forwards (and, with ``dout``, backwards) on the
    first batch element against the float32 naive rbf attention (its autograd for the gradients); returns the
    largest relative error and raises over 3e-2 (bfloat16 inputs): a timing of a wrong kernel is no timing."""
    import hf_rbf

    q1, k1, v1 = (t[:1].contiguous() for t in (q, k, v))
    leaves = [t.float().requires_grad_(dout is not None) for t in (q1, k1, v1)]
    ref = hf_rbf.rbf_attention(*leaves, gamma=gamma, causal=True, backend="naive")
    worst = 0.0

    def rel(a, r):
        return ((a.float() - r).norm() / r.norm()).item()

    fns = variants(q1, k1, v1, gamma)
    for name in CHECKED:
        worst = max(worst, rel(fns[name](), ref.detach()))
    if dout is not None:
        d1 = dout[:1].contiguous()
        ref_grads = torch.autograd.grad(ref, leaves, d1.float())
        for name, fn in backward_variants(q1, k1, v1, gamma, d1).items():
            if name != "bwd no norm term":
                worst = max(worst, *(rel(g, r) for g, r in zip(fn()[:3], ref_grads)))
    if worst > 3e-2:
        raise AssertionError(f"the probe's variants disagree with the naive reference: relative error {worst:.2e}")
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="forward_variants")
    parser.add_argument("--d", default="64,128")
    parser.add_argument("--n", default="512,1024,2048,4096,8192")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sweep-n", type=int, default=2048)
    parser.add_argument("--sweep-d", default="128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--check", action="store_true", help="CPU check of the variants under the interpreter")
    parser.add_argument("--backward", action="store_true",
                        help="also the backward kernels alone: inline norms, norms from the pass, no norm term, and "
                             "SDPA flash's backward")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-config sweep")
    args = parser.parse_args()
    if args.check:
        check_on_cpu()
        return
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    started = time.time()
    table = {}
    for d in (int(x) for x in args.d.split(",")):
        for n in (int(x) for x in args.n.split(",")):
            b = max(1, args.tokens // n)
            q, k, v, gamma = rbf_inputs(b, args.heads, n, d, dev, torch.bfloat16)
            fns = {**sdpa_variants(q, k, v), **variants(q, k, v, gamma)}
            dout = None
            if args.backward:
                dout = torch.randn_like(q)
                fns.update(sdpa_backward(q, k, v, dout))
                fns.update(backward_variants(q, k, v, gamma, dout))
            error = check_cell(q, k, v, gamma, dout)
            res = measure([(f"D{d} N{n} B{b}", fns)], args.rounds, args.iters)
            row = res[f"D{d} N{n} B{b}"]
            row["autotuned config"] = chosen_config(kernels_flash_fwd._distance_fwd)
            row["error vs naive"] = error
            table[f"D{d} N{n}"] = row
            kernels_flash_fwd._distance_fwd.cache.clear()  # the next cell's choice reported alone
            del q, k, v
    sweep = {}
    original = list(kernels_flash_fwd._distance_fwd.configs)
    for d in ([] if args.no_sweep else [int(x) for x in args.sweep_d.split(",")]):
        n = args.sweep_n
        b = max(1, args.tokens // n)
        q, k, v, gamma = rbf_inputs(b, args.heads, n, d, dev, torch.bfloat16)
        base = sdpa_variants(q, k, v)
        ours = variants(q, k, v, gamma)
        for cfg in SWEEP_CONFIGS:
            force_config(cfg)
            label = f"D{d} N{n} BM{cfg[0]} BN{cfg[1]} w{cfg[2]} s{cfg[3]}"
            fns = {"SDPA flash": base["SDPA flash"], "inline norms (shipped)": ours["inline norms (shipped)"],
                   "no norm term": ours["no norm term"]}
            sweep[label] = measure([(label, fns)], args.rounds, args.iters)[label]
    kernels_flash_fwd._distance_fwd.configs = original
    props = torch.cuda.get_device_properties(0)
    import triton

    meta = dict(device=props.name, torch=torch.__version__, triton=triton.__version__, tokens=args.tokens,
                heads=args.heads, seconds=round(time.time() - started, 1))
    with open(os.path.join(args.out, "forward_variants.json"), "w") as f:
        json.dump(dict(meta=meta, table=table, sweep=sweep), f, indent=1)
    lines = [f"# Forward variants, causal bf16 ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
             f"{args.tokens} tokens per call, H{args.heads}; ms, best of {args.rounds} interleaved rounds of the "
             f"median of {args.iters})", ""]
    names = ["SDPA flash", "SDPA cuDNN", "inline norms (shipped)", "key-bias pass + forward", "key-bias pass alone",
             "no norm term"]
    if args.backward:
        names += ["SDPA flash bwd", "bwd inline norms", "bwd norms from the pass", "bwd no norm term"]
    lines += ["| shape | " + " | ".join(names) + " | shipped / flash | no norm / flash | autotuned config | "
              "error vs naive |", "|---" * (len(names) + 5) + "|"]

    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    for shape, row in table.items():
        flash = row.get("SDPA flash")
        ratio = lambda name: (f"{row[name] / flash:.2f}x" if isinstance(row.get(name), float)  # noqa: E731
                              and isinstance(flash, float) else "")
        lines.append(f"| {shape} | " + " | ".join(fmt(row.get(n, "")) for n in names)
                     + f" | {ratio('inline norms (shipped)')} | {ratio('no norm term')} | {row['autotuned config']} | "
                     f"{row['error vs naive']:.1e} |")
    lines += ["", "## Tile configs one by one (the forward's autotuner forced to each)", "",
              "| config | SDPA flash | inline norms | no norm term | inline / flash |", "|---|---|---|---|---|"]
    for label, row in sweep.items():
        flash, inl = row.get("SDPA flash"), row.get("inline norms (shipped)")
        r = f"{inl / flash:.2f}x" if isinstance(inl, float) and isinstance(flash, float) else ""
        lines.append(f"| {label} | {fmt(flash)} | {fmt(inl)} | {fmt(row.get('no norm term', ''))} | {r} |")
    with open(os.path.join(args.out, "forward_variants.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
