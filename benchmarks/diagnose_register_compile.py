"""Where the first training step of a model with registers spends its time on the compiled register stream
(``hf_rbf.modeling_decoder.register_path``): one process builds each model, runs its first step on the rows path (the
Triton kernels compile or load from their cache), then its first step on the compiled stream (dynamo traces the
register step; inductor compiles it or loads it from its caches), and prints both times with the compile counters.
Run it twice on one machine: the second process shows what a warm machine pays.

    PYTHONPATH=. python benchmarks/diagnose_register_compile.py [--size d256] [--variants "rbf (1 register, SuSiE);..."]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decoder_settings import decoder_settings  # noqa: E402
from profile_training import SIZES, VARIANTS, build  # noqa: E402


def first_step(model, ids) -> float:
    t0 = time.perf_counter()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="d256", choices=sorted(SIZES))
    p.add_argument(
        "--variants",
        default="rbf (1 register, SuSiE);scalar_sort (1 register);hybrid_sort (1 register)",
        help=f"semicolon-separated subset of profile_training's variants: {'; '.join(VARIANTS)}",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(";") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; allowed: {'; '.join(VARIANTS)}")
    import hf_rbf  # noqa: F401
    from torch._dynamo.utils import counters

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = SIZES[args.size]
    rows = {}
    for variant in args.variants.split(";"):
        model = build(variant, size, device)
        ids = torch.randint(0, 8192, (size["batch"], size["seq"]), device=device)
        counters.clear()
        with decoder_settings({"register_path": "rows"}):
            rows_s = first_step(model, ids)
        with decoder_settings({"register_path": "compiled"}):
            compiled_s = first_step(model, ids)
            again_s = first_step(model, ids)
        rows[variant] = dict(
            rows_first_s=rows_s,
            compiled_first_s=compiled_s,
            compiled_second_s=again_s,
            counters={k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd", "stats")},
        )
        print(
            f"{variant:32s} rows first step {rows_s:6.1f} s | compiled first step {compiled_s:6.1f} s, second "
            f"{again_s:6.2f} s | {json.dumps(rows[variant]['counters'])}",
            flush=True,
        )
        del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, size=args.size, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
