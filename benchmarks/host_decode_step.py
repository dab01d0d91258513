"""Host time of one dynamic-cache decode step (batch 1) of every family against ``LlamaForCausalLM``, on the CPU, at a
tiny size where the kernels cost next to nothing and the host (Python + dispatch) is the step.

    PYTHONPATH=. python benchmarks/host_decode_step.py [--path gpu|cpu]
        [--variants "llama;rbf;gka;scalar_sort;hybrid_sort"] [--size '{"hidden_size": 64, ...}'] [--prompt 64]
        [--tokens 200] [--reps 3] [--profile 25] [--json PATH]

Per variant (``bench_generate.build``: float32 on the CPU, greedy, no EOS) one warm-up ``generate``, then ``--reps``
greedy ``generate`` calls of ``--tokens`` new tokens with the default dynamic cache; a logits processor
(``bench_generate.StepClock``) stamps every step, and the figure is the median of the step-to-step times over every
step of every call (the machine is shared: the median ignores the steps another process delayed; the 10th percentile
is the least disturbed figure, another process only ever adds time).  That is the time ``generate`` spends per
token: the model's forward and ``generate``'s own work (logits processing, the mask's growth, stopping checks), the
latter the same for every model.

``--path gpu`` (the default) runs the host path a CUDA decode step takes, with the kernels left out: the families'
attention on ``attention_backend="triton"`` and the fused RoPE, as "auto" picks them on CUDA, the register stream
(``register_path="stream"``, what "auto" takes for a cached forward without gradients on CUDA), the attention
projections as one GEMM over their kept concatenation (``decode_projection_copies="on"``, "auto" on CUDA), all under
Triton's interpreter (``TRITON_INTERPRET=1``) with every launch returning at once (``count_host_ops``' stub): what is
timed is our Python, the aten ops around the launches and triton's interpreter-side call (not the compiled launcher
of a GPU, nor ``kernels_launch``'s direct-launch key, which only runs on CUDA).  The outputs of the stubbed kernels
are uninitialised memory, so the tokens are meaningless; the host path does not depend on them, but the sorted
families' cached keys then hold NaN, and the merge of their recent buffer (one step in ``cache_buffer_size``) sorts and
searches NaN keys in milliseconds on the CPU: the median leaves those steps out, a cProfile total does not.
``--path cpu`` runs the CPU defaults instead (the "naive" / "sdpa" backends, the register rows path): real work, not
the GPU's host path.  ``--threads`` (default 1): torch's intra-op threads.

``--profile N`` also prints, per variant, the N Python functions with the largest own time per step (cProfile over
one ``generate``, divided by its tokens) and the aten ops per step (a ``TorchDispatchMode`` over one decode step).
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import json
import os
import pstats
import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_GPU_PATH = "--path" not in sys.argv or sys.argv[sys.argv.index("--path") + 1] == "gpu"
if _GPU_PATH:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from bench_generate import StepClock, build, parse_variant  # noqa: E402
from decoder_settings import decoder_settings  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, intermediate_size=128)


def _gpu_path_model(variant: str, max_positions: int, size: dict):
    """The variant's model with the attention backend CUDA's "auto" takes (the fused kernels)."""
    family = variant.partition(" (")[0]
    if family == "llama":
        return build(variant, max_positions, "cpu", size)
    if family in ("scalar_sort", "hybrid_sort") and "torch inserts" not in variant:
        # (the sorted cache's one-launch insert, as "auto" takes it on CUDA)
        size = dict(size, decode_backend="triton")
    return build(variant, max_positions, "cpu", dict(size, attention_backend="triton"))


def _stub_kernels() -> None:
    from count_host_ops import _COUNTER, _patch_triton_run

    _patch_triton_run()
    _COUNTER.skip_kernels = True


def _generate(model, ids, tokens: int, clock=None):
    from transformers import LogitsProcessorList

    extra = {} if clock is None else {"logits_processor": LogitsProcessorList([clock])}
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
            **extra,
        )
    assert out.shape[1] == ids.shape[1] + tokens
    return out


def step_times_ms(model, ids, tokens: int, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        clock = StepClock(False)
        _generate(model, ids, tokens, clock)
        times += [1e3 * (b - a) for a, b in zip(clock.marks[1:-1], clock.marks[2:])]
    return times


def python_profile(model, ids, tokens: int, top: int) -> list:
    prof = cProfile.Profile()
    prof.enable()
    _generate(model, ids, tokens)
    prof.disable()
    rows = [
        (f"{os.path.basename(k[0])}:{k[1]}({k[2]})", v[1] / tokens, 1e3 * v[2] / tokens, 1e3 * v[3] / tokens)
        for k, v in pstats.Stats(prof).stats.items()
    ]
    return sorted(rows, key=lambda r: -r[2])[:top]


def aten_ops_per_step(model, ids) -> collections.Counter:
    """Aten ops of one decode step (the model's forward, after a prefill and one step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    cache = model.make_cache() if hasattr(model, "make_cache") else None
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    n = ids.shape[1]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        for t in range(2):
            mask = torch.ones(1, n + t + 1, dtype=ids.dtype)
            step = ids[:, -1:]
            if t == 1:
                with Count():
                    model(input_ids=step, attention_mask=mask, past_key_values=cache, use_cache=True)
            else:
                model(input_ids=step, attention_mask=mask, past_key_values=cache, use_cache=True)
    return ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--variants", default="llama;rbf;gka;scalar_sort;hybrid_sort")
    p.add_argument("--size", default=None, help="JSON of config overrides of the tiny size")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, help="print the top N Python functions and the aten ops")
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: at these sizes threads only add waits, which a core busy with "
                   "another process turns into milliseconds: Llama's CPU SDPA took 4-60 ms per step with 2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = dict(TINY, **json.loads(args.size)) if args.size else dict(TINY)
    torch.manual_seed(0)
    ids = torch.randint(2, size["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0))
    settings = {}
    if args.path == "gpu":
        _stub_kernels()
        # what "auto" takes on CUDA: the register stream, the fused RoPE, the kept projection concatenations
        settings = {"register_path": "stream", "rotary_backend": "triton", "decode_projection_copies": "on"}
    rows = {}
    with decoder_settings(settings):
        for variant in args.variants.split(";"):
            torch.manual_seed(0)
            model = (_gpu_path_model if args.path == "gpu" else
                     (lambda v, m, s: build(v, m, "cpu", s)))(variant, args.prompt + args.tokens + 8, size)
            variant_settings = parse_variant(variant)[2]  # (a variant's own options, e.g. "checked decode")
            with decoder_settings(variant_settings):
                _generate(model, ids, 8)  # warm-up
                times = step_times_ms(model, ids, args.tokens, args.reps)
            row = dict(ms_per_step=statistics.median(times), p25=statistics.quantiles(times, n=4)[0],
                       p10=statistics.quantiles(times, n=10)[0], steps=len(times))
            if args.profile:
                with decoder_settings(variant_settings):
                    ops = aten_ops_per_step(model, ids)
                    row["aten_ops"] = sum(ops.values())
                    row["top_aten_ops"] = ops.most_common(args.profile)
                    row["python"] = python_profile(model, ids, args.tokens, args.profile)
            rows[variant] = row
            print(json.dumps({"variant": variant, "ms_per_step": round(row["ms_per_step"], 3),
                              "p25": round(row["p25"], 3), "aten_ops": row.get("aten_ops")}), flush=True)
            del model
    base = rows.get("llama", {}).get("ms_per_step")
    print(f"\n# host time per decode step ({args.path} path), torch {torch.__version__}, size {json.dumps(size)}, "
          f"B1, prompt {args.prompt}, {args.tokens} tokens x {args.reps}, median over steps")
    base10 = rows.get("llama", {}).get("p10")
    print("| model | ms/step (median) | 25th pct | 10th pct | x Llama (median) | x Llama (10th pct) | aten ops/step |")
    print("|---|---|---|---|---|---|---|")
    for v, r in rows.items():
        ratio = f"{r['ms_per_step'] / base:.2f}" if base else ""
        ratio10 = f"{r['p10'] / base10:.2f}" if base10 else ""
        print(f"| {v} | {r['ms_per_step']:.3f} | {r['p25']:.3f} | {r['p10']:.3f} | {ratio} | {ratio10} | "
              f"{r.get('aten_ops', '')} |")
    if args.profile:
        for v, r in rows.items():
            print(f"\n## {v}\naten ops per step: {r['top_aten_ops']}\nPython (calls/step, own ms/step, cum ms/step):")
            for name, calls, own, cum in r["python"]:
                print(f"  {name}: {calls:.1f}, {own:.4f}, {cum:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": args.path, "size": size, "prompt": args.prompt, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
