"""Decode time per generated token against the context length: the sorted scalar cache's windowed step versus exact
attention over the whole cache.

Two measurements:

* ``layer``: one attention layer's decode step on a cache of ``n`` tokens (``H`` heads, ``G`` value groups of width
  ``Dv``): the sorted cache's full step (insert the new key, binary search, window gather, softmax, value sum, and
  the amortised merges of its recent buffer) against ``scalar_attention`` over all ``n`` keys (the library's best
  backend for the device).  The insert cost is reported apart (step minus read).  ``cache_buffer_size=1`` merges
  every step: the cost of keeping one sorted array by shifting, ``O(n)`` per insert.
* ``model``: a small scalar-sort model's per-token ``forward`` after an exact (chunked) prefill of ``n`` tokens, with
  ``decode_window=k`` against ``decode_window=None``: what ``generate`` sees, projections and MLPs included.

    python recipes/bench_sorted_decode.py --device cpu --output outputs/bench_sorted_decode
    python recipes/bench_sorted_decode.py --device cuda --output outputs/bench_sorted_decode_gpu   # to 1M tokens

Writes ``bench_sorted_decode.csv``, ``bench_sorted_decode.md`` and ``bench_sorted_decode.png`` into ``--output``.
Timings are wall-clock medians over repeated steps (``torch.cuda.synchronize`` around each timed block on CUDA);
the eager torch step launches tens of small kernels, so on a GPU it measures launch overhead more than memory
traffic (a fused kernel, one launch per layer step, is the next step: see docs/scalar_sort.md).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import contextlib
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import hf_rbf  # noqa: E402, F401
from hf_rbf import last_backend, scalar_attention  # noqa: E402
from hf_rbf.cache_sorted_scalar import SortedScalarCacheLayer  # noqa: E402
from hf_rbf.kernels_sorted_decode import kernel_unavailable_reason  # noqa: E402

logger = logging.getLogger("bench_sorted_decode")

PRESETS = {
    "cpu": dict(
        layer_contexts=[1024, 4096, 16384, 65536, 262144],
        model_contexts=[1024, 4096, 16384],
        dtype=torch.float32,
        steps=32,
        exact_backends="auto",
    ),
    "cuda": dict(
        layer_contexts=[1024, 4096, 16384, 65536, 262144, 1048576],
        model_contexts=[1024, 4096, 16384, 65536],
        dtype=torch.bfloat16,
        steps=64,
        exact_backends="auto,naive,triton,sdpa:flash,sdpa:efficient,sdpa:cudnn",
    ),
}
LAYER_SHAPE = dict(heads=16, groups=4, value_dim=64)
# (window k, cache_buffer_size R, decode backend); the fused kernel is added where it can run (CUDA)
SORTED_VARIANTS = [(32, 64, "torch"), (64, 64, "torch"), (64, 256, "torch"), (64, 1, "torch")]
KERNEL_VARIANTS = [(64, 64, "triton"), (64, 256, "triton")]


SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")


def parse_exact_backends(spec: str) -> list[str]:
    """``"auto,naive,sdpa:cudnn"`` -> the list, each a scalar_attention backend with an optional SDPA kernel after a
    colon (only for "sdpa"); a bad entry raises, naming the option and the allowed values."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise ValueError("--exact-backends: empty; give e.g. auto,naive")
    for entry in entries:
        backend, colon, kernel = entry.partition(":")
        if backend not in hf_rbf.BACKENDS:
            raise ValueError(f"--exact-backends: unknown backend {backend!r} in {entry!r}; allowed: {', '.join(hf_rbf.BACKENDS)}")
        if colon and (backend != "sdpa" or kernel not in SDPA_KERNELS):
            raise ValueError(
                f"--exact-backends: {entry!r}: a kernel after ':' is only for sdpa, one of {', '.join(SDPA_KERNELS)}"
            )
    return entries


@contextlib.contextmanager
def sdpa_kernels(name: str):
    """Restrict torch's SDPA to one kernel (one of SDPA_KERNELS); "" leaves torch's choice."""
    if not name:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    with sdpa_kernel(kernels[name]):
        yield


def sorted_variants(device) -> list[tuple]:
    return SORTED_VARIANTS + (KERNEL_VARIANTS if kernel_unavailable_reason(device) is None else [])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def bench_layer(n: int, device, dtype, steps: int, exact_backends=("auto",)) -> list[dict]:
    h, g, dv = LAYER_SHAPE["heads"], LAYER_SHAPE["groups"], LAYER_SHAPE["value_dim"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    total = n + 4 * (steps + 8)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    keys, values = randn(1, h, total), randn(1, g, total, dv)
    queries = randn(1, h, total)
    tau = torch.full((h,), 0.05, device=device)
    sink_k, sink_v = (
        torch.zeros(1, h, 1, device=device, dtype=dtype),
        torch.zeros(1, g, 1, dv, device=device, dtype=dtype),
    )
    rows = []

    # exact: attention of the newest query over every cached key (written in place, no copy), once per backend
    for spec in exact_backends:
        backend, _, sdpa_kernel_name = spec.partition(":")
        pos = [n]

        def exact_step():
            i = pos[0]
            with sdpa_kernels(sdpa_kernel_name):
                scalar_attention(queries[..., i : i + 1], keys[..., : i + 1], values[:, :, : i + 1], tau,
                                 backend=backend)  # fmt: skip
            pos[0] = i + 1

        try:
            ms = _median_ms(exact_step, device, steps)
        except (RuntimeError, ValueError) as e:  # a backend or SDPA kernel that cannot serve this shape: recorded
            logger.info("layer, context %d: exact %s failed: %s", n, spec, str(e).splitlines()[0])
            ms = float("nan")
        name = last_backend("scalar_attention") if backend == "auto" else backend
        rows.append(dict(bench="layer", method=f"exact ({spec if backend != 'auto' else 'auto=' + name})",
                         context=n, window="", buffer="", step_ms=ms, read_ms=ms, insert_ms=0.0))  # fmt: skip
        logger.info("layer, context %d: exact %s %.3f ms", n, spec, ms)

    for k, r, backend in sorted_variants(device):
        layer = SortedScalarCacheLayer(num_heads=h, num_value_groups=g, decode_window=k, cache_buffer_size=r,
                                       decode_backend=backend)  # fmt: skip
        for start in range(0, n, 1 << 16):  # fill in chunks, then merge everything: a cache after a long prompt
            stop = min(n, start + (1 << 16))
            layer.append(keys[..., start:stop], values[:, :, start:stop])
        layer._merge_buffer()
        pos = [n]

        def sorted_step():
            i = pos[0]
            layer.append(keys[..., i : i + 1], values[:, :, i : i + 1])
            layer.attend(queries[..., i : i + 1], tau, num_new=1, prefix_ks=sink_k, prefix_v=sink_v)
            layer.end_step(queries[..., i : i + 1])
            pos[0] = i + 1

        def read_only():
            i = pos[0] - 1
            layer.attend(queries[..., i : i + 1], tau, num_new=1, prefix_ks=sink_k, prefix_v=sink_v)

        # the step median over at least one merge period of the buffer (R steps) is dominated by the non-merge
        # steps; the mean includes the merges' amortised share
        step_times = []
        for _ in range(3):
            sorted_step()
        count = max(steps, min(2 * r, 4 * steps)) if r > 1 else steps
        for _ in range(count):
            _sync(device)
            t = time.perf_counter()
            sorted_step()
            _sync(device)
            step_times.append((time.perf_counter() - t) * 1e3)
        read = _median_ms(read_only, device, steps)
        mean = statistics.fmean(step_times)
        rows.append(dict(bench="layer", method=f"sorted-{backend}", context=n, window=k, buffer=r, step_ms=mean,
                         read_ms=read, insert_ms=max(0.0, mean - read)))  # fmt: skip
    return rows


@torch.no_grad()
def bench_model(n: int, device, dtype, steps: int, exact_backend: str = "auto") -> list[dict]:
    cfg = AutoConfig.for_model(
        "scalar_sort",
        vocab_size=4096,
        hidden_size=512,
        num_attention_heads=8,
        num_hidden_layers=4,
        intermediate_size=1376,
        attention_backend=exact_backend,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, n + steps + 8), device=device)
    rows = []
    variants = [(None, "torch"), (32, "torch"), (64, "torch")]
    if kernel_unavailable_reason(device) is None:
        variants += [(32, "triton"), (64, "triton")]
    for window, backend in variants:
        cache = model.make_cache(decode_window=None, decode_backend=backend)
        for start in range(0, n, 1024):  # exact chunked prefill (no n x n matrix)
            model(ids[:, start : min(n, start + 1024)], cache=cache, use_cache=True)
        for layer in cache.layers:
            layer.decode_window = window
        pos = [n]

        def step():
            i = pos[0]
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
            pos[0] = i + 1

        ms = _median_ms(step, device, steps)
        rows.append(
            dict(
                bench="model",
                method="exact" if window is None else f"sorted-{backend}",
                context=n,
                window="" if window is None else window,
                buffer=64,
                step_ms=ms,
                read_ms="",
                insert_ms="",
            )
        )
    return rows


def markdown(rows) -> str:
    lines = ["# Decode time per token: sorted cache vs exact attention", ""]
    layer_rows = [r for r in rows if r["bench"] == "layer"]
    if layer_rows:
        h, g, dv = LAYER_SHAPE["heads"], LAYER_SHAPE["groups"], LAYER_SHAPE["value_dim"]
        lines += [
            f"One layer step (H={h}, G={g}, Dv={dv}), milliseconds: exact = attention over every key; sorted "
            "(k, R) = insert + search + window (step), of which read = search + window alone.",
            "",
        ]
        variants = sorted({(r["method"], r["window"], r["buffer"]) for r in layer_rows if r["method"].startswith("sorted")},
                          key=lambda v: (v[0], v[1], -v[2] if v[2] != 1 else 0))  # fmt: skip
        names = [f"{m} k={k} R={b}" for m, k, b in variants]
        exact_names = list(dict.fromkeys(r["method"] for r in layer_rows if r["method"].startswith("exact")))
        lines.append(f"| context | {' | '.join(exact_names)} | " + " | ".join(f"{v} step (read)" for v in names) + " |")
        lines.append("|" + "---|" * (1 + len(exact_names) + len(variants)))
        for n in sorted({r["context"] for r in layer_rows}):
            cells = []
            for name in exact_names:
                r = next((r for r in layer_rows if r["context"] == n and r["method"] == name), None)
                cells.append(f"{r['step_ms']:.3f}" if r is not None else "")
            for m, k, b in variants:
                r = next(r for r in layer_rows
                         if r["context"] == n and r["method"] == m and r["window"] == k and r["buffer"] == b)  # fmt: skip
                cells.append(f"{r['step_ms']:.3f} ({r['read_ms']:.3f})")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    model_rows = [r for r in rows if r["bench"] == "model"]
    if model_rows:
        variants = sorted({(r["method"], r["window"]) for r in model_rows if r["method"] != "exact"})
        lines += ["Whole model (scalar-sort, d=512, H=8, 4 layers) per-token forward after an exact prefill of "
                  "`context` tokens, milliseconds:", "",
                  "| context | exact | " + " | ".join(f"{m} k={k}" for m, k in variants) + " |",
                  "|" + "---|" * (2 + len(variants))]  # fmt: skip
        for n in sorted({r["context"] for r in model_rows}):
            cell = {(r["method"], r["window"]): r["step_ms"] for r in model_rows if r["context"] == n}
            lines.append(
                f"| {n} | {cell[('exact', '')]:.2f} | " + " | ".join(f"{cell[v]:.2f}" for v in variants) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    layer_rows = [r for r in rows if r["bench"] == "layer"]
    series = sorted({(r["method"], r["window"], r["buffer"]) for r in layer_rows}, key=str)
    for method, k, b in series:
        pts = sorted((r["context"], r["step_ms"]) for r in layer_rows
                     if r["method"] == method and r["window"] == k and r["buffer"] == b)  # fmt: skip
        label = method if method.startswith("exact") else f"{method} k={k} R={b}"
        axes[0].plot(*zip(*pts), marker="o", label=label)
    axes[0].set_title("one layer decode step")
    model_rows = [r for r in rows if r["bench"] == "model"]
    for method, window in sorted({(r["method"], r["window"]) for r in model_rows}, key=str):
        pts = sorted(
            (r["context"], r["step_ms"]) for r in model_rows if r["method"] == method and r["window"] == window
        )
        axes[1].plot(*zip(*pts), marker="o", label="exact" if method == "exact" else f"{method} k={window}")
    axes[1].set_title("whole model, per token")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--output", default="outputs/bench_sorted_decode")
    parser.add_argument("--layer-contexts", type=int, nargs="*")
    parser.add_argument("--model-contexts", type=int, nargs="*")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup-steps", type=int, default=64,
                        help="steps of the discarded first pass (compiles kernels; >= the buffer size to reach a merge)")
    parser.add_argument(
        "--exact-backends",
        help="comma-separated backends of the exact attention (scalar_attention), an SDPA kernel after a colon, "
        "e.g. auto,naive,triton,sdpa:flash,sdpa:efficient,sdpa:cudnn (default: auto on the CPU; on CUDA auto, naive, "
        "triton and sdpa with each of its kernels).  The whole-model rows use the first.",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    preset = dict(PRESETS[args.device])
    for name in ("layer_contexts", "model_contexts", "steps"):
        if getattr(args, name) is not None:
            preset[name] = getattr(args, name)
    device = torch.device(args.device)
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    exact = parse_exact_backends(args.exact_backends or preset["exact_backends"])
    os.makedirs(args.output, exist_ok=True)
    # a discarded pass first: kernel compilation and autotuning (the sorted step's buffer merge included) stay out
    # of the timings (none with --warmup-steps 0: the first timed steps then include them)
    if args.warmup_steps > 0:
        bench_layer(preset["layer_contexts"][0], device, preset["dtype"], args.warmup_steps, exact)
    rows = []
    for n in preset["layer_contexts"]:
        rows += bench_layer(n, device, preset["dtype"], preset["steps"], exact)
        logger.info("layer, context %d done", n)
    for n in preset["model_contexts"]:
        rows += bench_model(n, device, preset["dtype"], preset["steps"], exact[0])
        logger.info("model, context %d done", n)
    with open(os.path.join(args.output, "bench_sorted_decode.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    report = markdown(rows)
    with open(os.path.join(args.output, "bench_sorted_decode.md"), "w") as f:
        f.write(report + "\n")
    plot(rows, os.path.join(args.output, "bench_sorted_decode.png"))
    print(report)


if __name__ == "__main__":
    main()
