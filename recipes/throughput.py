"""Training throughput of every model family against ``LlamaForCausalLM`` (SDPA) of the same size, in one run.

    python recipes/throughput.py [--configs recipes/configs/tinystories_*.yaml] [--batch-size 64] [--seq-len 256]
        [--steps 30] [--warmup 10] [--dtype bf16] [--device cuda] [--model-set key=value ...]
        [--output results/throughput]

For each recipe (default: ``tinystories_<family>.yaml`` for every family, the Llama baseline included) the model is
built exactly as ``pretrain.py`` builds it (same sizes, same parameter matching) and timed on random tokens over
``--steps`` optimizer steps after ``--warmup`` untimed ones: forward + backward + ``AdamW`` step (``fused=True`` where
the device supports it) under ``torch.autocast(dtype)`` (bf16 by default on CUDA, off on CPU), with the model's weights
in float32 as ``Trainer`` keeps them.  Time is taken between CUDA-synchronised points.  A recipe whose family is not
registered in this checkout is listed as skipped.

Writes ``<output>.json`` (per model: tokens/s, ms per step, peak memory, parameter counts, the attention backend each
layer used) and ``<output>.md`` (a table with tokens/s relative to Llama).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from recipes.pretrain_config import load_config, parse_value
from recipes.pretrain_models import (
    attention_backends,
    available_families,
    build_config,
    build_model,
    count_parameters,
    resolve_model_config,
)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEFAULT_ORDER = ("llama", "dot", "rbf", "gka", "scalar_sort", "hybrid_sort")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def default_configs() -> list[str]:
    """``tinystories_<family>.yaml`` in :data:`DEFAULT_ORDER`, then any other ``tinystories_*.yaml``."""
    found = sorted(glob.glob(os.path.join(CONFIG_DIR, "tinystories_*.yaml")))
    key = {f"tinystories_{f}.yaml": i for i, f in enumerate(DEFAULT_ORDER)}
    return sorted(found, key=lambda p: (key.get(os.path.basename(p), len(key)), p))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_model(model, *, batch_size: int, seq_len: int, steps: int, warmup: int, device, dtype, lr: float = 1e-3):
    """Tokens per second of full training steps on random tokens."""
    model.to(device).train()
    fused = device.type in ("cuda", "cpu")
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    except (RuntimeError, TypeError):
        fused = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (batch_size, seq_len), generator=gen).to(device) for _ in range(2)]

    def step(i: int):
        ids = batches[i % 2]
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup):
        step(i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    _sync(device)
    seconds = time.perf_counter() - t0
    result = {
        "tokens_per_second": batch_size * seq_len * steps / seconds,
        "ms_per_step": 1000.0 * seconds / steps,
        "final_loss": float(loss.detach()),
        "fused_adamw": fused,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    return result


def run(configs, *, batch_size, seq_len, steps, warmup, device, dtype_name, model_overrides=(), log=print) -> dict:
    device = torch.device(device)
    dtype = DTYPES[dtype_name]
    families = available_families()
    results = []
    for path in configs:
        cfg = load_config(path, output_dir="unused")
        family = cfg["model"]["family"]
        name = cfg["run_name"]
        if family not in families:
            log(f"[skip] {name}: family {family!r} is not registered in this checkout")
            results.append({"name": name, "family": family, "config": path, "skipped": "family not registered"})
            continue
        for assignment in model_overrides:
            key, _, text = assignment.partition("=")
            cfg["model"]["config"][key] = parse_value(text)
            cfg["model"]["expected_num_parameters"] = None
        length = seq_len or cfg["data"]["block_size"]
        vocab = cfg["model"]["config"].get("vocab_size", cfg["tokenizer"]["vocab_size"])
        kwargs, _ = resolve_model_config(cfg["model"], vocab, length, {})
        kwargs["max_position_embeddings"] = max(kwargs.get("max_position_embeddings", length), length)
        torch.manual_seed(0)
        model = build_model(build_config(family, kwargs))
        params = count_parameters(model)
        try:
            timing = time_model(
                model, batch_size=batch_size, seq_len=length, steps=steps, warmup=warmup, device=device, dtype=dtype
            )
        except torch.OutOfMemoryError as e:  # a family without a fused kernel may not fit: record it, go on
            timing = {"error": f"out of memory: {str(e)[:200]}"}
        row = {
            "name": name,
            "family": family,
            "config": os.path.relpath(path),
            "num_parameters": params["total"],
            "num_parameters_non_embedding": params["non_embedding"],
            "intermediate_size": kwargs.get("intermediate_size"),
            "batch_size": batch_size,
            "seq_len": length,
            "attention_backends": sorted(set(attention_backends(model))),
            **timing,
        }
        results.append(row)
        if "tokens_per_second" in row:
            log(
                f"{name:28s} {row['tokens_per_second']:>14,.0f} tokens/s  {row['ms_per_step']:8.2f} ms/step  "
                f"{params['total']:>11,} params  {', '.join(row['attention_backends'])}"
            )
        else:
            log(f"{name:28s} {row['error']}")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ref = next((r for r in results if r.get("family") == "llama" and r.get("tokens_per_second")), None)
    for r in results:
        if ref and r.get("tokens_per_second"):
            r["relative_to_llama"] = r["tokens_per_second"] / ref["tokens_per_second"]
    import transformers

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": dtype_name,
        "batch_size": batch_size,
        "steps": steps,
        "warmup": warmup,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": results,
    }


def markdown_table(report: dict) -> str:
    lines = [
        (
            f"Training throughput on {report['device']} "
            f"({'float32, no autocast' if report['dtype'] == 'fp32' else report['dtype'] + ' autocast'}, "
            f"batch {report['batch_size']}, "
            f"{report['steps']} timed steps after {report['warmup']}; forward + backward + AdamW step)"
        ),
        "",
        "| model | family | parameters | seq | tokens/s | ms/step | vs Llama (SDPA) | peak GiB | attention backends |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r.get("skipped"):
            lines.append(f"| {r['name']} | {r['family']} | | | skipped: {r['skipped']} | | | | |")
            continue
        if "error" in r:
            lines.append(
                f"| {r['name']} | {r['family']} | {r['num_parameters']:,} | {r['seq_len']} | {r['error']} | | | | |"
            )
            continue
        mem = f"{r['peak_memory_gib']:.2f}" if r.get("peak_memory_gib") is not None else ""
        rel = f"{r['relative_to_llama']:.2f}x" if r.get("relative_to_llama") else ""
        lines.append(
            f"| {r['name']} | {r['family']} | {r['num_parameters']:,} | {r['seq_len']} | "
            f"{r['tokens_per_second']:,.0f} | {r['ms_per_step']:.2f} | {rel} | {mem} | "
            f"{', '.join(r['attention_backends'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=None, help="recipe files (default: tinystories_*.yaml)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=None, help="default: each recipe's block_size")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="autocast dtype (default bf16 on CUDA)")
    parser.add_argument(
        "--model-set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override model config keys of every recipe (e.g. for a quick CPU check)",
    )
    parser.add_argument("--output", default="outputs/throughput", help="writes <output>.json and <output>.md")
    args = parser.parse_args(argv)
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    report = run(
        args.configs or default_configs(),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
        dtype_name=dtype,
        model_overrides=args.model_set,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    table = markdown_table(report)
    with open(args.output + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
