"""Where a dynamic-cache decode step's time goes, for every family against ``LlamaForCausalLM`` of the same size:
``torch.profiler`` and ``cProfile`` of ``generate`` with the default (dynamic) cache, per generated token.

    PYTHONPATH=. python benchmarks/profile_decode.py --out DIR [--case 1x512] [--tokens 33]
        [--variants "llama;rbf;gka;scalar_sort;hybrid_sort"] [--device cuda] [--stacks]

Per variant (the models of ``bench_generate.py``: d768 L12 H12, bf16 on CUDA, random prompt, greedy, no EOS), after
a warm-up ``generate`` (compilation, autotuning):

* ``ms/token``: ``(t(tokens) - t(1)) / (tokens - 1)`` without any profiler, best of three;
* the same two ``generate`` calls under ``torch.profiler``; every figure below is the difference of the two
  profiles divided by ``tokens - 1`` (the prefill and the first token cancel): per token the number of kernel
  launches, of host-device synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, device-to-host
  copies, ``aten::item`` / ``_local_scalar_dense``), the GPU kernel time, the aten ops, and the ops with the largest
  host (self CPU) time and the kernels with the largest GPU time;
* with ``--stacks``, the Python frames (this project's and transformers') of every host-device copy and
  synchronisation, per token;
* ``cProfile`` of the long call less the short one: the Python functions with the largest own time per token (a
  function that waits for the GPU, e.g. through ``.item()``, shows the wait as its own time).

GPU kernel time well below ms/token means the step is bound by the host (the Python and launch figures say which
part); kernel time near ms/token means the GPU work itself.  Writes ``profile_decode.json`` and
``profile_decode.md``.  On a machine without CUDA, ``--device cpu`` runs the same (float32; the kernel columns are
then empty).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import SIZE, build, parse_variant  # noqa: E402
from decoder_settings import decoder_settings  # noqa: E402

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _generate(model, ids, tokens: int, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
        )
    _sync(device)
    assert out.shape[1] == ids.shape[1] + tokens
    return time.perf_counter() - t0


def profile_tables(prof) -> dict:
    """name -> (count, self CPU us, device us) of one profile's events; kernel events under ``kernel:``."""
    table: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for ev in prof.events():
        device_type = str(getattr(ev, "device_type", ""))
        if device_type.endswith("CUDA"):
            row = table["kernel:" + ev.name]
            row[0] += 1
            row[2] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            continue
        row = table[ev.name]
        row[0] += 1
        row[1] += ev.self_cpu_time_total
    return table


STACK_EVENTS = ("cudaMemcpyAsync", "cudaStreamSynchronize", "aten::_local_scalar_dense")


def stack_table(prof) -> dict:
    """``"event < its callers"`` -> count, for the copy and synchronisation events."""
    table: dict = defaultdict(int)
    for ev in prof.events():
        if ev.name not in STACK_EVENTS:
            continue
        # runtime events (the copy, the synchronisation) carry no stack: with ``with_stack`` their enclosing ops and
        # Python calls are their parents, the innermost first
        names, op = [], ev
        while op is not None and len(names) < 8:
            if not op.name.startswith("torch/"):
                names.append(op.name)
            op = op.cpu_parent
        table[" < ".join(dict.fromkeys(names))] += 1
    return table


def torch_profile(model, ids, tokens: int, device: str, stacks: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    tables, stack_tables = [], []
    for n in (1, tokens):
        with profile(activities=activities, with_stack=stacks) as prof:
            _generate(model, ids, n, device)
        tables.append(profile_tables(prof))
        if stacks:
            stack_tables.append(stack_table(prof))
    short, long = tables
    per = tokens - 1
    diff = {}
    for name in set(short) | set(long):
        a, b = short.get(name, [0, 0.0, 0.0]), long.get(name, [0, 0.0, 0.0])
        diff[name] = [(b[0] - a[0]) / per, (b[1] - a[1]) / per, (b[2] - a[2]) / per]
    kernels = {k[len("kernel:"):]: v for k, v in diff.items() if k.startswith("kernel:")}
    ops = {k: v for k, v in diff.items() if not k.startswith("kernel:")}
    where = {}
    if stacks:
        a, b = stack_tables
        where = {k: (b.get(k, 0) - a.get(k, 0)) / per for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}
    return dict(
        copies_and_syncs_by_stack=sorted(([k, v] for k, v in where.items()), key=lambda r: -r[1])[:20],
        launches_per_token=sum(ops.get(n, [0])[0] for n in LAUNCH_EVENTS),
        syncs_per_token={n: ops[n][0] for n in SYNC_EVENTS + ("cudaMemcpyAsync",) if n in ops and ops[n][0] > 0},
        aten_ops_per_token=sum(v[0] for k, v in ops.items() if k.startswith("aten::")),
        kernel_ms_per_token=sum(v[2] for v in kernels.values()) / 1e3,
        host_self_ms_per_token=sum(v[1] for v in ops.values()) / 1e3,
        top_host_ops=sorted(([k, v[0], v[1]] for k, v in ops.items()), key=lambda r: -r[2])[:20],
        top_kernels=sorted(([k[:90], v[0], v[2]] for k, v in kernels.items()), key=lambda r: -r[2])[:12],
    )


def python_profile(model, ids, tokens: int, device: str) -> list:
    """``[function, calls per token, own ms per token]`` of the long call less the short one, the largest first."""
    stats = []
    for n in (1, tokens):
        prof = cProfile.Profile()
        prof.enable()
        _generate(model, ids, n, device)
        prof.disable()
        own = pstats.Stats(prof).stats.items()
        stats.append({f"{os.path.basename(k[0])}:{k[1]}({k[2]})": (v[1], v[2]) for k, v in own})
    short, long = stats
    per = tokens - 1
    rows = [
        [name, (calls - short.get(name, (0, 0.0))[0]) / per, 1e3 * (own - short.get(name, (0, 0.0))[1]) / per]
        for name, (calls, own) in long.items()
    ]
    return sorted(rows, key=lambda r: -r[2])[:25]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", default="1x512", help="BATCHxPROMPT")
    ap.add_argument("--tokens", type=int, default=33, help="generated tokens of the long call (the short one: 1)")
    ap.add_argument("--variants", default="llama;rbf;gka;scalar_sort;hybrid_sort")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default=None, help="JSON of config overrides (default: bench_generate's d768 L12 H12)")
    ap.add_argument("--stacks", action="store_true",
                    help="also the Python frames of every host-device copy and synchronisation (with_stack)")
    args = ap.parse_args()
    if args.tokens < 2:
        raise ValueError(f"--tokens must be >= 2, got {args.tokens}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = dict(SIZE, **json.loads(args.size)) if args.size else dict(SIZE)
    batch, prompt = (int(x) for x in args.case.split("x"))
    ids = torch.randint(2, size["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    import transformers

    res = dict(
        device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        case=args.case,
        tokens=args.tokens,
        rows=[],
    )
    for variant in args.variants.split(";"):
        try:
            model = build(variant, prompt + args.tokens + 8, args.device, size)
            with decoder_settings(parse_variant(variant)[2]):
                _generate(model, ids, 4, args.device)  # compile and tune
                times = [
                    (_generate(model, ids, args.tokens, args.device) - _generate(model, ids, 1, args.device))
                    for _ in range(3)
                ]
                row = dict(variant=variant, ms_per_token=1e3 * min(times) / (args.tokens - 1))
                row.update(torch_profile(model, ids, args.tokens, args.device, args.stacks))
                row["python"] = python_profile(model, ids, args.tokens, args.device)
        except Exception as err:  # noqa: BLE001  (a failing family must not hide the others)
            row = dict(variant=variant, error=f"{type(err).__name__}: {err}"[:400])
        res["rows"].append(row)
        hidden = ("top_host_ops", "top_kernels", "python", "copies_and_syncs_by_stack")
        print(json.dumps({k: v for k, v in row.items() if k not in hidden}), flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    (out / "profile_decode.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"# Dynamic-cache decode, per generated token ({res['device']}, torch {res['torch']}, transformers "
        f"{res['transformers']}; case {args.case}, {args.tokens} tokens less 1)",
        "",
        "| model | ms/token | kernel ms | host self ms (profiled) | launches | aten ops | syncs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][:120]} | | | | | |")
            continue
        syncs = ", ".join(f"{k} {v:.1f}" for k, v in r["syncs_per_token"].items())
        lines.append(
            f"| {r['variant']} | {r['ms_per_token']:.2f} | {r['kernel_ms_per_token']:.2f} | "
            f"{r['host_self_ms_per_token']:.2f} | {r['launches_per_token']:.0f} | {r['aten_ops_per_token']:.0f} | "
            f"{syncs} |"
        )
    for r in res["rows"]:
        if "error" in r:
            continue
        lines += ["", f"## {r['variant']}", "", "Host ops (calls, self ms per token):", ""]
        lines += [f"- {name}: {n:.1f}, {us / 1e3:.3f}" for name, n, us in r["top_host_ops"]]
        lines += ["", "Kernels (launches, ms per token):", ""]
        lines += [f"- {name}: {n:.1f}, {us / 1e3:.3f}" for name, n, us in r["top_kernels"]]
        lines += ["", "Python functions (calls, own ms per token):", ""]
        lines += [f"- {name}: {n:.1f}, {ms:.3f}" for name, n, ms in r["python"]]
        if r["copies_and_syncs_by_stack"]:
            lines += ["", "Copies and synchronisations by where they were called (per token):", ""]
            lines += [f"- {where}: {n:.2f}" for where, n in r["copies_and_syncs_by_stack"]]
    (out / "profile_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:4 + len(res["rows"])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
