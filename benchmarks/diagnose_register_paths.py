"""Which register path or attention backend moves a model's float32 results: every (register path, backend) against
the rows path with the naive backend in float64, step by step.

    PYTHONPATH=. python benchmarks/diagnose_register_paths.py [--families hybrid_sort,rbf] [--registers 1,2]
        [--device cuda] [--steps 3] [--out DIR]

A tiny model (d=64, 2 heads, the tests' ``build_model`` initialisation) trains ``--steps`` SGD steps (lr 0.1) on one
batch per (path, backend); each step's logits and gradients are compared with the float64 reference's: the logits'
largest difference over their largest magnitude, and the worst parameter gradient's norm-wise relative error (with
its name).  Written for the GPU tests that found hybrid_sort's register paths 1e-3 apart from its rows path in float32
(benchmarks/results/h100-2026-11-27l, call 4): a row near 1e-6 is float32 rounding, one near 1e-3 is a path or
kernel that computes something else or in lower precision.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from hf_rbf import modeling_decoder  # noqa: E402


def train(family, registers, path, backend, dtype, device, steps, seed=0):
    from conftest import build_model

    modeling_decoder.register_path = path
    overrides = dict(num_register_tokens=registers, attention_backend=backend, hidden_size=64, num_attention_heads=2)
    model = build_model(family, overrides).to(device=device, dtype=dtype).train()
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(seed)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        res = model(input_ids=ids, labels=ids)
        res.loss.backward()
        grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((res.logits.detach().double(), grads))
        opt.step()
    return out


def compare(ref, got):
    rows = []
    for (lr, gr), (lg, gg) in zip(ref, got):
        logit_err = ((lg - lr).abs().max() / lr.abs().max()).item()
        worst, name = 0.0, ""
        for n, g in gr.items():
            if n not in gg:
                worst, name = float("inf"), f"{n} (missing)"
                continue
            e = ((gg[n] - g).norm() / g.norm().clamp(min=1e-30)).item()
            if e > worst:
                worst, name = e, n
        rows.append(dict(logits=logit_err, grad=worst, grad_name=name))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="hybrid_sort,rbf")
    ap.add_argument("--registers", default="1,2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    paths = ["rows", "stream", "compiled"] if device.type == "cuda" else ["rows", "stream"]
    backends = ["auto", "naive"]
    report = {}
    for family in args.families.split(","):
        for registers in (int(r) for r in args.registers.split(",")):
            ref = train(family, registers, "rows", "naive", torch.float64, device, args.steps)
            for path in paths:
                for backend in backends:
                    try:
                        got = train(family, registers, path, backend, torch.float32, device, args.steps)
                        rows = compare(ref, got)
                    except Exception as e:  # noqa: BLE001 (a failing combination is a row)
                        rows = f"error: {type(e).__name__}: {str(e)[:200]}"
                    key = f"{family} R{registers} {path} {backend}"
                    report[key] = rows
                    if isinstance(rows, str):
                        print(key, rows, flush=True)
                    else:
                        print(key, "  ".join(f"step{i + 1}: logits {r['logits']:.1e} grad {r['grad']:.1e} "
                                             f"({r['grad_name']})" for i, r in enumerate(rows)), flush=True)
    modeling_decoder.register_path = "auto"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "register_paths.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
