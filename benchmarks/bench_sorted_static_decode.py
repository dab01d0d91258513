"""Per-layer decode step of the fixed-capacity sorted cache (``StaticSortedLayer``): the fused Triton launch against
the PyTorch static path and against dense SDPA decode of one query, at long cache lengths.

    PYTHONPATH=. python benchmarks/bench_sorted_static_decode.py --out DIR
        [--lengths 8192 32768 131072 524288 1048576] [--heads 12 16] [--batches 1 8] [--kinds scalar hybrid]
        [--window 64] [--block-size auto] [--reps 50] [--max-gib 60]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_sorted_static_decode.py --smoke --out DIR   (CPU check)

One step = what a layer does per generated token: ``append`` of the new token (insert into its sorted block) and
``attend`` (search, window of ``k`` keys, softmax with the sink, value sum) for every row and head; dense SDPA is
``scaled_dot_product_attention`` of one query over ``n`` keys and values ``[B, H, n, D]`` (no insert).  Every step
is timed with CUDA events, the median of ``--reps`` after ``--warmup`` steps, eagerly and as a CUDA graph replayed
(the graph captures one step; each replay inserts one more token, reading the length from the device).  The cache is
filled with ``n`` random tokens first, so the step runs at length ``n`` (plus the few hundred timed steps).

Layers: "scalar" (scalar keys, ``G = H / 4`` value groups of width ``D``: the 110M config's layout) and "hybrid"
(scalar and ``D``-wide vector keys, ``G = H``), one order per head (``sort_scheme="per_head"``).  ``--block-size
auto`` takes the layer's default (``cache_sorted_static.default_block_size``: a power-of-two number of blocks, the
one its measured cost model of the step prefers for this batch and one order per head); ``blocksN`` forces ``N``.
Configurations whose buffers (the sorted layer, or the dense K / V) would exceed ``--max-gib`` are skipped and listed.

Writes ``sorted_static_decode.json`` and ``sorted_static_decode.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_rbf.cache_sorted_static import StaticSortedLayer, default_block_size  # noqa: E402
import hf_rbf.kernels_sorted_static_decode as static_decode  # noqa: E402


def layer_bytes(kind: str, b: int, h: int, c: int, d: int, elem: int) -> int:
    g = h if kind == "hybrid" else max(1, h // 4)
    per_slot = h * elem + g * d * elem + 1 + h * (elem + 4) + (h * d * elem if kind == "hybrid" else 0)  # int32 slots
    return b * c * per_slot + 8 * c


class Timer:
    """Median time of a callable: CUDA events on the GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def median_us(self, fn, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def graphed(fn, device: torch.device, steps: int = 1):
    """``steps`` calls of ``fn`` captured in one CUDA graph (after one eager warm-up call on a side stream); returns
    the replay.  One replay of one step is timed with the graph's launch latency in it (a floor of ~20 us on an H100
    host, session 20), so the timings capture ``--graph-steps`` steps per graph and divide."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    return graph.replay


def kernel_us(replay, steps: int, reps: int, name: str) -> float | None:
    """Mean GPU time per step of the kernels whose name contains ``name`` (torch.profiler, ``reps`` replays of a
    graph of ``steps`` steps): the kernel alone, without launch latency or the gaps between graph nodes."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.events():
        if name in e.name:
            total += getattr(e, "device_time", None) or e.cuda_time
    return total / (reps * steps) if total else None


def build_layer(kind, backend, *, b, h, d, n, capacity, window, block_size, device, dtype, fill_chunk, gen):
    g = h if kind == "hybrid" else max(1, h // 4)
    layer = StaticSortedLayer(
        max_cache_len=capacity,
        num_heads=h,
        num_value_groups=g,
        order_heads=list(range(h)),
        decode_window=window,
        block_size=block_size,
        static_decode_backend=backend,
    )
    # fill in chunks (each re-sorts only the blocks it touched), so the inputs never double the memory
    for lo in range(0, n, fill_chunk):
        m = min(fill_chunk, n - lo)
        ks = torch.randn(b, h, m, device=device, generator=gen).to(dtype)
        v = torch.randn(b, g, m, d, device=device, generator=gen).to(dtype)
        vk = torch.randn(b, h, m, d, device=device, generator=gen).to(dtype) if kind == "hybrid" else None
        layer.append(ks, v, vk)
    return layer, g


def step_fn(layer, kind, *, b, h, g, d, device, dtype, gen):
    """One decode step over static input buffers (what a CUDA graph replays)."""
    token = {
        "ks": torch.randn(b, h, 1, device=device, generator=gen).to(dtype),
        "v": torch.randn(b, g, 1, d, device=device, generator=gen).to(dtype),
        "vk": torch.randn(b, h, 1, d, device=device, generator=gen).to(dtype) if kind == "hybrid" else None,
        "qs": torch.randn(b, h, 1, device=device, generator=gen).to(dtype),
        "q": torch.randn(b, h, 1, d, device=device, generator=gen).to(dtype) if kind == "hybrid" else None,
    }
    tau = torch.full((h,), 0.5, device=device)
    scale = torch.full((h,), d**-0.5, device=device) if kind == "hybrid" else None
    prefix = {
        "prefix_ks": torch.zeros(1, h, 1, device=device, dtype=dtype),
        "prefix_v": torch.randn(1, g, 1, d, device=device, generator=gen).to(dtype),
        "prefix_k": torch.zeros(1, h, 1, d, device=device, dtype=dtype) if kind == "hybrid" else None,
    }

    def step():
        layer.append(token["ks"], token["v"], token["vk"])
        return layer.attend(token["qs"], tau, q=token["q"], scale=scale, **prefix)

    return step


def dense_fn(*, b, h, d, n, device, dtype, gen):
    q = torch.randn(b, h, 1, d, device=device, generator=gen).to(dtype)
    k = torch.randn(b, h, n, d, device=device, generator=gen).to(dtype)
    v = torch.randn(b, h, n, d, device=device, generator=gen).to(dtype)
    return lambda: F.scaled_dot_product_attention(q, k, v)


def block_size_for(spec: str, capacity: int, window: int, batch: int, heads: int) -> int:
    """``--block-size`` entries: "auto" (the layer's default, :func:`default_block_size` for this batch and one order
    per head), an int ``T``, or "blocksN": ``N`` blocks exactly (``T = ceil(C / N)`` rounded up to a multiple of 64,
    so that the candidate tile has no padded block rows)."""
    if spec == "auto":
        return default_block_size(capacity, window, batch_size=batch, num_orders=heads)
    if spec.startswith("blocks"):
        blocks = int(spec[len("blocks"):])
        return -(-(-(-capacity // blocks)) // 64) * 64
    return int(spec)


def run_case(args, kind, b, h, n, device, dtype, timer, spec="auto"):
    d, window = args.head_dim, args.window
    # steps appended while timing (eager, graph capture, replays; once more per --alternatives entry)
    k = args.graph_steps
    n_alt = len(args.alternatives)
    extra = (args.warmup + args.reps) * (1 + 2 * k + k * n_alt) + (k + 1) * (3 + 2 * n_alt)
    extra += (args.reps + 1) * k * (1 + n_alt)  # the profiled replays
    capacity = n + extra
    block_size = block_size_for(spec, capacity, window, b, h)
    row = {"kind": kind, "batch": b, "heads": h, "head_dim": d, "tokens": n, "window": window, "block_size": block_size,
           "block_spec": spec, "blocks": -(-capacity // block_size)}
    elem = torch.finfo(dtype).bits // 8
    # the dense K / V and each backend's layer are alive one at a time
    need = max(layer_bytes(kind, b, h, capacity, d, elem), 2 * b * h * n * d * elem)
    row["buffers_gib"] = round(need / 2**30, 2)
    if need > args.max_gib * 2**30:
        row["skipped"] = f"buffers {need / 2**30:.1f} GiB > --max-gib {args.max_gib}"
        return row
    gen = torch.Generator(device=device).manual_seed(0)
    dense = dense_fn(b=b, h=h, d=d, n=n, device=device, dtype=dtype, gen=gen)
    row["dense_sdpa_us"] = timer.median_us(dense, args.warmup, args.reps)
    if device.type == "cuda":
        row["dense_sdpa_graph_us"] = timer.median_us(graphed(dense, device, k), args.warmup, args.reps) / k
    del dense
    for backend in args.backends:
        try:
            layer, g = build_layer(kind, backend, b=b, h=h, d=d, n=n, capacity=capacity, window=window,
                                   block_size=block_size, device=device, dtype=dtype, fill_chunk=args.fill_chunk,
                                   gen=gen)  # fmt: skip
        except ValueError as exc:  # static_decode_backend="triton" where the kernel cannot run: say why
            row[f"{backend}_us"] = None
            row[f"{backend}_note"] = f"not available: {exc}"
            continue
        if layer.decode_backend_used != backend:
            row[f"{backend}_us"] = None
            row[f"{backend}_note"] = f"not available: {layer.decode_backend_reason}"
            continue
        step = step_fn(layer, kind, b=b, h=h, g=g, d=d, device=device, dtype=dtype, gen=gen)
        if backend == "triton" and device.type == "cuda":
            for name, settings in args.alternatives:  # kernel settings, each replayed as a CUDA graph
                kept = {attr: getattr(static_decode, attr) for attr in settings}
                try:
                    for attr, value in settings.items():
                        setattr(static_decode, attr, value)
                    replay = graphed(step, device, k)
                    row[f"triton_graph_us[{name}]"] = timer.median_us(replay, args.warmup, args.reps) / k
                    row[f"triton_kernel_us[{name}]"] = kernel_us(replay, k, args.reps, "_static_sorted_decode")
                finally:
                    for attr, value in kept.items():
                        setattr(static_decode, attr, value)
        row[f"{backend}_us"] = timer.median_us(step, args.warmup, args.reps)
        if device.type == "cuda":
            try:
                replay = graphed(step, device, k)
                row[f"{backend}_graph_us"] = timer.median_us(replay, args.warmup, args.reps) / k
                if backend == "triton":
                    row["triton_kernel_us"] = kernel_us(replay, k, args.reps, "_static_sorted_decode")
            except Exception as exc:  # noqa: BLE001 - a path that cannot be captured is a result, not a crash
                row[f"{backend}_graph_us"] = None
                row[f"{backend}_note"] = f"CUDA graph capture failed: {type(exc).__name__}: {exc}"[:300]
        del layer, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def parse_alternative(entry: str) -> dict:
    """``"span=k,fanout=64,warps=8"`` -> the module attributes of :mod:`hf_rbf.kernels_sorted_static_decode` to set."""
    settings = {}
    for part in entry.split(","):
        key, _, value = part.partition("=")
        if key == "span" and value in static_decode.CANDIDATE_SPANS:
            settings["CANDIDATE_SPAN"] = value
        elif key == "fanout" and value.isdigit() and int(value) in static_decode.FANOUT_CHOICES:
            settings["FANOUT"] = int(value)
        elif key == "warps" and value.isdigit() and int(value) in static_decode.NUM_WARPS_CHOICES:
            settings["NUM_WARPS"] = int(value)
        else:
            raise ValueError(
                f"--alternatives: {part!r} in {entry!r} is not span=k|2k, fanout=<a power of two 2..256> or "
                "warps=1|2|4|8|16|32"
            )
    return settings


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(rows, meta) -> str:
    lines = [
        "# Static sorted cache: one layer's decode step (microseconds, median)",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['dtype']}; window k = "
        f"{meta['window']}; eager = one step launched from Python, graph = {meta.get('graph_steps', 1)} steps replayed "
        "as one CUDA graph, per step; kernel = the fused kernel's GPU time per step (torch.profiler).",
        "",
        "| layer | B | H | tokens | T (blocks) | triton eager | triton graph | triton kernel | torch eager | "
        "torch graph | SDPA eager | SDPA graph | graph: SDPA / triton |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['kind']} | {r['batch']} | {r['heads']} | {r['tokens']} | {r['block_size']} ({r['blocks']}) |"
        if "skipped" in r:
            lines.append(head + f" skipped: {r['skipped']} |||||||")
            continue
        tg, sg = r.get("triton_graph_us"), r.get("dense_sdpa_graph_us")
        ratio = f"{sg / tg:.1f}x" if tg and sg else "-"
        lines.append(
            head + f" {fmt(r.get('triton_us'))} | {fmt(tg)} | {fmt(r.get('triton_kernel_us'))} | "
            f"{fmt(r.get('torch_us'))} | "
            f"{fmt(r.get('torch_graph_us'))} | {fmt(r.get('dense_sdpa_us'))} | {fmt(sg)} | {ratio} |"
        )
    alts = list(dict.fromkeys(k[16:-1] for r in rows for k in r if k.startswith("triton_graph_us[")))
    if alts:
        lines += ["", "Fused step with other kernel settings (`--alternatives`), graph / kernel (us per step):", ""]
        lines.append("| layer | B | H | tokens | T (blocks) | " + " | ".join(alts) + " |")
        lines.append("|---|---|---|---|---|" + "---|" * len(alts))
        for r in rows:
            cells = " | ".join(f"{fmt(r.get(f'triton_graph_us[{a}]'))} / {fmt(r.get(f'triton_kernel_us[{a}]'))}"
                               for a in alts)  # fmt: skip
            lines.append(
                f"| {r['kind']} | {r['batch']} | {r['heads']} | {r['tokens']} | {r['block_size']} ({r['blocks']}) | "
                f"{cells} |"
            )
    notes = [f"* {r['kind']} B{r['batch']} H{r['heads']} n={r['tokens']}: {r[k]}" for r in rows for k in r
             if k.endswith("_note")]  # fmt: skip
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 524288, 1048576])
    ap.add_argument("--heads", type=int, nargs="+", default=[12, 16])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kinds", nargs="+", default=["scalar", "hybrid"], choices=["scalar", "hybrid"])
    ap.add_argument("--backends", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--block-size", nargs="+", default=["auto"],
                    help='one case per entry: "auto", a block length T, or "blocksN" (N blocks of ceil(C / N))')
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--fill-chunk", type=int, default=65536)
    ap.add_argument("--graph-steps", type=int, default=16, help="steps captured per CUDA graph (timed per step)")
    ap.add_argument("--max-gib", type=float, default=60.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (set TRITON_INTERPRET=1 for triton)")
    ap.add_argument(
        "--num-warps",
        type=int,
        nargs="*",
        default=[],
        help="also time the fused step (CUDA graph) with these warps per program (kernels_sorted_static_decode."
        "NUM_WARPS); the table's columns keep the default heuristic",
    )
    ap.add_argument(
        "--alternatives",
        nargs="*",
        default=[],
        help='also time the fused step (CUDA graph) with other kernel settings, one entry each: comma-separated '
        '"span=k|2k" (CANDIDATE_SPAN), "fanout=N" (FANOUT), "warps=N" (NUM_WARPS), e.g. "span=2k,fanout=64"; '
        "the table's columns keep the defaults",
    )
    args = ap.parse_args(argv)
    bad = [w for w in args.num_warps if w not in static_decode.NUM_WARPS_CHOICES]
    if bad:
        ap.error(f"--num-warps takes 1, 2, 4, 8, 16 or 32; got {bad}")
    try:
        args.alternatives = [(f"warps={w}", {"NUM_WARPS": w}) for w in args.num_warps] + [
            (entry, parse_alternative(entry)) for entry in args.alternatives
        ]
    except ValueError as exc:
        ap.error(str(exc))
    for spec in args.block_size:
        number = spec[6:] if spec.startswith("blocks") else spec
        if spec != "auto" and not (number.isdigit() and int(number) > 0):
            ap.error(f'--block-size takes "auto", a positive int or "blocksN" (N >= 1); got {spec!r}')
    if args.smoke:
        device = torch.device("cpu")
        args.lengths, args.heads, args.batches, args.head_dim, args.window = [60, 250], [4], [2], 16, 4
        args.warmup, args.reps, args.fill_chunk, args.dtype = 1, 3, 64, "float32"
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: run on the GPU, or pass --smoke for the CPU check")
        device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    meta = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) if argv is None else str(argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor()})",
        "torch": torch.__version__,
        "triton": triton_version,
        "dtype": args.dtype,
        "window": args.window,
        "graph_steps": args.graph_steps,
    }
    timer = Timer(device)
    rows = []
    with torch.no_grad():
        for kind in args.kinds:
            for h in args.heads:
                for b in args.batches:
                    for n in args.lengths:
                        for spec in args.block_size:
                            row = run_case(args, kind, b, h, n, device, dtype, timer, spec)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sorted_static_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "sorted_static_decode.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
