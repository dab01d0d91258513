"""Why a family's ``generate(..., cache_implementation="static")`` is (or is not) faster than its dynamic cache on the
GPU: compile counters, CUDA-graph skips and a profile of the decode steps, every family beside Llama, one process.

    PYTHONPATH=. TORCH_LOGS=recompiles,graph_breaks,cudagraphs,perf_hints \\
        python benchmarks/diagnose_static_decode.py --out DIR [--variants "llama;rbf;gka;scalar_sort;hybrid_sort"]
        [--prompt 512] [--batch 1] [--prefill-chunk N] [--new-tokens 33] [--skip-dynamic] [--no-manual]
        [--step-clock]

Per variant (the d768 L12 H12 model of ``bench_generate.py``, ``--batch`` rows (1) of a ``--prompt``-token prompt,
512 by default; long prompts go through the cache ``--prefill-chunk`` tokens at a time):

* ms per generated token of ``generate`` with the dynamic and the static cache (``(t(n) - t(1)) / (n - 1)``,
  ``n = --new-tokens``, 33 by default, after a warm-up call of each; with ``--step-clock`` the static steps are timed
  inside one ``generate``, one prefill instead of four);
* ``torch._dynamo.utils.counters`` after the static calls (graphs, graph breaks, recompiles, inductor's CUDA-graph
  skips and their reasons);
* a ``torch.profiler`` trace of the decode steps of one static ``generate`` of 9 new tokens (the profiler starts
  when the prefill's logits reach a logits processor, so a long prefill never enters the trace): CUDA graph
  launches, kernel launches per step and the CPU ops that took the most host time (where the step's host time goes
  when no graph replays); and the GPU time per generated token by kernel, the kernels inside replayed CUDA graphs
  included: what a long-context step spends where;
* ms per step of a hand-compiled decode step (``torch.compile(model.forward, mode="reduce-overhead",
  fullgraph=True)`` over ``model.make_static_cache``), the floor ``generate`` could reach: hf_rbf families only.

Writes ``diagnose.json`` and ``diagnose.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_generate import build, step_timed_generate, timed_generate  # noqa: E402

PROMPT = 512
NEW = 33
PROFILED = 9  # new tokens of the profiled static generate


def ms_per_token(model, ids, mode: str, prefill_chunk: int | None = None, new: int = NEW) -> float:
    t1, _ = timed_generate(model, ids, 1, mode, prefill_chunk)
    tn, _ = timed_generate(model, ids, new, mode, prefill_chunk)
    return 1e3 * (tn - t1) / (new - 1)


def counters_snapshot() -> dict:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items() if v}


def _kernel_us(prof) -> Counter:
    """GPU microseconds by kernel name (device-side events: kernels, also those a replayed CUDA graph ran)."""
    out = Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return out


class _StartProfiler:
    """A logits processor that starts ``prof`` when the prefill's logits reach it: the trace then holds the decode
    steps alone (a 512k-token prefill's kernels would take minutes to parse and only cancel out)."""

    def __init__(self, prof):
        self.prof, self.calls = prof, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 1:
            if scores.is_cuda:
                torch.cuda.synchronize()
            self.prof.start()
        return scores


def profile_static(model, ids, prefill_chunk: int | None = None, new: int = PROFILED) -> dict:
    """Launch counts, the top host ops and the GPU time per generated token by kernel of the decode steps of one
    static ``generate`` of ``new`` tokens: the profiler starts once the prefill's logits exist, so the trace holds the
    ``new - 1`` decode forwards (and their sampling) only."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LogitsProcessorList

    from benchmarks.bench_generate import generate_kwargs

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else []))
    start = _StartProfiler(prof)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([start]),
                       **generate_kwargs(model, new, "static", prefill_chunk))
    if ids.is_cuda:
        torch.cuda.synchronize()
    prof.stop()
    if start.calls != new:
        raise RuntimeError(f"profile_static: {start.calls} logits calls for {new} new tokens")
    kernels = _kernel_us(prof)
    names = Counter()
    for e in prof.events():
        if e.name.startswith(("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpy", "cudaStreamSync")):
            names[e.name] += 1
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    per_token = {k: v / (new - 1) for k, v in kernels.items() if v > 0}
    per_token = dict(sorted(per_token.items(), key=lambda kv: -kv[1]))
    return dict(launches={k: v / (new - 1) for k, v in names.items()}, top_cpu=table,
                kernel_us_per_token=per_token, kernel_ms_per_token=sum(per_token.values()) / 1e3)


def manual_step_ms(model, ids, prompt: int = PROMPT) -> float:
    """ms per decode step of ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` over the
    family's own static cache (prompt prefilled eagerly), after 3 warm-up steps, 30 timed."""
    from hf_rbf.cache_names import CACHE_NAME

    cache = model.make_static_cache(max_cache_len=prompt + 64)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), **{CACHE_NAME: cache})
        token = out.logits[:, -1:].argmax(-1)
        step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        one = torch.ones_like(token)
        for _ in range(3):
            token = step(input_ids=token, attention_mask=one, **{CACHE_NAME: cache}).logits[:, -1:].argmax(-1).clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(30):
            token = step(input_ids=token, attention_mask=one, **{CACHE_NAME: cache}).logits[:, -1:].argmax(-1).clone()
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / 30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="llama;rbf;gka;scalar_sort;hybrid_sort")
    ap.add_argument("--no-manual", action="store_true", help="skip the hand-compiled decode step")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens (the cache holds them and the new ones)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate (random, all of --prompt tokens)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="generate's prefill_chunk_size (long prompts)")
    ap.add_argument("--skip-dynamic", action="store_true", help="skip the dynamic-cache timing")
    ap.add_argument("--new-tokens", type=int, default=NEW,
                    help="tokens of the long timed call; with long prompts the prefill's run-to-run spread divides by "
                         "this (at 131k tokens a 33-token call left +-0.3 ms per token of it)")
    ap.add_argument("--step-clock", action="store_true",
                    help="time the static decode steps inside one generate (a CUDA event per step) instead of "
                         "(t(n) - t(1)) / (n - 1) over four calls: one prefill instead of four (long prompts)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chunk = args.prefill_chunk
    ids = torch.randint(2, 8192, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    rows = []
    for variant in args.variants.split(";"):
        row = dict(variant=variant)
        rows.append(row)
        model = None
        try:
            torch._dynamo.reset()
            from torch._dynamo.utils import counters

            counters.clear()
            model = build(variant, args.prompt + max(128, args.new_tokens + 8))
            if not args.skip_dynamic:
                ms_per_token(model, ids, "dynamic", chunk, args.new_tokens)  # warm-up
                row["dynamic_ms"] = ms_per_token(model, ids, "dynamic", chunk, args.new_tokens)
            t0 = time.perf_counter()
            # compiles; the longest call first, so that every later call fits the static cache it made (a longer
            # call than the first one gets a bigger cache and recompiles the step for its size)
            timed_generate(model, ids, args.new_tokens, "static", chunk)
            row["first_static_s"] = time.perf_counter() - t0
            if args.step_clock:
                row["static_ms"] = step_timed_generate(model, ids, args.new_tokens, "static", chunk, skip=1)[0]
            else:
                ms_per_token(model, ids, "static", chunk, args.new_tokens)
                row["static_ms"] = ms_per_token(model, ids, "static", chunk, args.new_tokens)
            row["counters"] = counters_snapshot()
            row.update(profile_static(model, ids, chunk))
            if variant != "llama" and not args.no_manual:
                torch._dynamo.reset()
                row["manual_step_ms"] = manual_step_ms(model, ids, args.prompt)
        except Exception as err:  # noqa: BLE001  (one family's failure must not hide the others)
            row["error"] = f"{type(err).__name__}: {err}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]
        print(json.dumps({k: v for k, v in row.items() if k not in ("top_cpu", "traceback")}, default=str), flush=True)
        print(row.get("top_cpu", ""), row.get("traceback", ""), flush=True)
        del model
        torch.cuda.empty_cache()
    (out / "diagnose.json").write_text(json.dumps(rows, indent=1, default=str))
    lines = [
        f"# static-cache decode diagnosis ({torch.cuda.get_device_name(0)}, torch {torch.__version__}; d768 L12 H12 "
        f"bf16, batch {args.batch}, {args.prompt}-token prompt{f', prefill chunks of {chunk}' if chunk else ''})",
        "",
        "| model | dynamic ms/token | static ms/token | hand-compiled step ms | first static generate s | "
        "graphs | graph breaks | cudagraph skips | launches per decode step | GPU kernel ms per static "
        "token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.get("counters", {})
        lines.append(
            f"| {r['variant']} | {r.get('dynamic_ms', float('nan')):.2f} | {r.get('static_ms', float('nan')):.2f} | "
            f"{r.get('manual_step_ms', float('nan')):.2f} | {r.get('first_static_s', float('nan')):.1f} | "
            f"{c.get('stats', {}).get('unique_graphs', '')} | {sum(c.get('graph_break', {}).values())} | "
            f"{c.get('inductor', {}).get('cudagraph_skips', 0)} | {r.get('launches', r.get('error', ''))} | "
            f"{r.get('kernel_ms_per_token', float('nan')):.3f} |"
        )
    for r in rows:
        lines += ["", f"## {r['variant']}", "", "GPU us per static token by kernel (top 15):", ""]
        lines += [f"- {k}: {v:.1f}" for k, v in list(r.get("kernel_us_per_token", {}).items())[:15]]
        lines += ["", "```", json.dumps(r.get("counters", {}), default=str)[:3000]]
        lines += [r.get("top_cpu", ""), r.get("traceback", ""), "```"]
    (out / "diagnose.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
