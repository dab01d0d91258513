"""Host-side work of one training forward+backward of a whole model: aten ops (all, and those that launch a kernel)
and triton launches per step, for ``LlamaForCausalLM`` with SDPA and every family's default config on the fused
backend, so the per-layer overhead of each family over Llama is visible without a GPU.

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/count_model_host_ops.py [--layers 2] [--verbose] [--json PATH]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/count_model_host_ops.py --decode [--layers 2]

``--decode`` counts one generated token instead (batch 1, after a 16-token prefill and one warm-up step, no
gradients), with the default dynamic cache and with the static cache ``generate(cache_implementation="static")``
builds (256 slots); at batch 1 a decode step is bound by exactly this host work.  The register rows take the path
``register_path="auto"`` takes on CUDA for a cached forward without gradients, "stream" (their layer steps memoised
once per cache, ``DecoderModel._register_memo``), also on the CPU, where "auto" would run the "rows" path (the register
rows recomputed in every step beside the text, 70-85 more aten ops per layer for the sorted families than a GPU's
decode step runs); ``--register-path rows`` counts that one.  The sorted families decode through
a window of 8 (``decode_window``, shorter than the cached tokens, as at long context) and both their dynamic and
static layers take the fused step (``decode_backend`` / ``static_decode_backend="triton"``, here in the interpreter,
as "auto" does on CUDA).

Counting is ``benchmarks/count_host_ops.py``'s (a ``TorchDispatchMode`` below autograd; triton's ``run`` wrapped).
On the CPU the kernels run in triton's interpreter (a tiny shape: d=64, 2 heads, B2 T32), whose own tensor work is
not counted.  On an H100 host each dispatcher round trip costs microseconds and each triton launch tens of
microseconds (``benchmarks/results/h100-profile-2026-11-25``), so these counts say where a host-bound step's time
goes; the per-layer difference to Llama is ``(ops - llama ops) / layers``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from count_host_ops import NO_KERNEL_OPS, _patch_triton_run, counting

import hf_rbf  # noqa: F401

VARIANTS = {
    "llama (SDPA)": ("llama", {}),
    "rbf (1 register, SuSiE)": ("rbf", {}),
    "rbf (no registers, RoPE)": ("rbf", {"num_register_tokens": 0, "position_embedding_type": "rope"}),
    "gka": ("gka", {}),
    "hybrid_sort": ("hybrid_sort", {}),
    "scalar_sort": ("scalar_sort", {}),
    # the recipes' setting (recipes/configs/tinystories_*_sort.yaml, scale_*_sort.yaml): one register
    "hybrid_sort (1 register)": ("hybrid_sort", {"num_register_tokens": 1}),
    "scalar_sort (1 register)": ("scalar_sort", {"num_register_tokens": 1}),
}


def build(family: str, overrides: dict, layers: int, device: str):
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    size = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
    }
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**size, attn_implementation="sdpa")).to(device)
    backend = {} if family == "scalar_sort" else {"attention_backend": "triton"}  # scalar: its own auto choice
    cfg = AutoConfig.for_model(family, **size, **backend, **overrides)
    return AutoModelForCausalLM.from_config(cfg).to(device)


def count_step(model, ids) -> dict:
    """Aten ops and launches of one forward and of one forward+backward (after a warm-up step)."""
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    with counting() as c:
        model(input_ids=ids, labels=ids)
    fwd_ops, fwd_launches = collections.Counter(c.ops), sum(c.launches.values())
    with counting() as c:
        model(input_ids=ids, labels=ids).loss.backward()
    ops = collections.Counter(c.ops)
    model.zero_grad(set_to_none=True)
    return {
        "fwd_aten_ops": sum(fwd_ops.values()),
        "fwd_launches": fwd_launches,
        "fwdbwd_aten_ops": sum(ops.values()),
        "fwdbwd_aten_compute_ops": sum(n for op, n in ops.items() if op not in NO_KERNEL_OPS),
        "fwdbwd_launches": sum(c.launches.values()),
        "fwd_aten_ops_by_name": dict(fwd_ops),
        "fwdbwd_aten_ops_by_name": dict(ops),
    }


SORTED_DECODE_WINDOW = 8  # the sorted families decode through their window (k < the cached tokens), as at long context


def _static_cache(model, max_len: int):
    if hasattr(model, "make_static_cache"):
        settings = {}
        if getattr(model.config, "decode_window", None) is not None:
            # the fused sorted step, as on CUDA (here in the Triton interpreter): "auto" keeps it to CUDA
            settings["static_decode_backend"] = "triton"
        return model.make_static_cache(max_len, **settings)
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def count_decode_step(model, prompt_len: int = 16) -> dict:
    """Aten ops and launches of one decode step (B1), dynamic and static cache, after a prefill and one warm-up
    step: the calls ``generate`` makes per token (minus its logits processing)."""
    from transformers import DynamicCache

    model.eval()
    device = next(model.parameters()).device
    ids = torch.randint(0, 128, (1, prompt_len + 2), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for kind in ("dynamic", "static"):
        # capacity beyond the window, so that the sorted layers take their windowed step
        cache = _static_cache(model, 256) if kind == "static" else DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(prompt_len, device=device))
            steps = []
            for t in (prompt_len, prompt_len + 1):  # the first step warms up, the second is counted
                with counting() as c:
                    model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([t], device=device))
                steps.append((collections.Counter(c.ops), sum(c.launches.values())))
        ops, launches = steps[-1]
        out[f"{kind}_aten_ops"] = sum(ops.values())
        out[f"{kind}_aten_compute_ops"] = sum(n for op, n in ops.items() if op not in NO_KERNEL_OPS)
        out[f"{kind}_launches"] = launches
        out[f"{kind}_aten_ops_by_name"] = dict(ops)
    return out


def main_decode(rows: dict, layers: int, verbose: bool, register_path: str = "stream") -> None:
    base = rows.get("llama (SDPA)")
    print(
        f"# torch {torch.__version__}; d=64, 2 heads, {layers} layers, B1, one decode step after a 16-token prompt; "
        f"register_path={register_path!r}"
    )
    print(
        "| model | dynamic: aten ops | of which compute | triton launches | static: aten ops | of which compute | "
        "triton launches | extra aten ops per layer vs Llama (dynamic / static) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        extra = ""
        if base is not None:
            extra = " / ".join(
                f"{(r[f'{k}_aten_ops'] - base[f'{k}_aten_ops']) / layers:+.1f}" for k in ("dynamic", "static")
            )
        print(
            f"| {name} | {r['dynamic_aten_ops']} | {r['dynamic_aten_compute_ops']} | {r['dynamic_launches']} | "
            f"{r['static_aten_ops']} | {r['static_aten_compute_ops']} | {r['static_launches']} | {extra} |"
        )
        if verbose:
            for k in ("dynamic", "static"):
                print(f"    {k}:", sorted(r[f"{k}_aten_ops_by_name"].items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--only", default=None, help="comma-separated substrings of the variant names")
    p.add_argument("--verbose", action="store_true", help="print the forward's aten ops by name")
    p.add_argument("--json", default=None)
    p.add_argument("--decode", action="store_true", help="one decode step (B1) instead of a training step")
    p.add_argument(
        "--register-path",
        default=None,
        choices=("auto", "rows", "stream", "compiled", "graphed"),
        help="hf_rbf.modeling_decoder.register_path for the count (default: 'stream' with --decode, the path 'auto' "
        "takes on CUDA in a decode step; 'auto' otherwise)",
    )
    args = p.parse_args(argv)
    from hf_rbf import modeling_decoder

    register_path = args.register_path or ("stream" if args.decode else "auto")
    modeling_decoder.register_path = register_path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _patch_triton_run()
    rows = {}
    for name, (family, overrides) in VARIANTS.items():
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        torch.manual_seed(0)
        if args.decode and family.endswith("_sort"):
            # the dynamic cache's fused step, as "auto" takes it on CUDA (here in the Triton interpreter)
            overrides = {**overrides, "decode_window": SORTED_DECODE_WINDOW, "decode_backend": "triton"}
        model = build(family, overrides, args.layers, device)
        if args.decode:
            rows[name] = count_decode_step(model)
        else:
            ids = torch.randint(0, 128, (2, 32), device=device)
            rows[name] = count_step(model, ids)
        del model
    if args.decode:
        main_decode(rows, args.layers, args.verbose, register_path)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"layers": args.layers, "device": device, "decode": True, "rows": rows}, f, indent=1)
        return 0
    base = rows.get("llama (SDPA)")
    print(f"# torch {torch.__version__}, {device}; d=64, 2 heads, {args.layers} layers, B2 T32, one training step")
    print(
        "| model | fwd aten ops | fwd launches | fwd+bwd aten ops | of which compute | fwd+bwd launches | "
        "extra aten ops per layer vs Llama |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        extra = "" if base is None else f"{(r['fwdbwd_aten_ops'] - base['fwdbwd_aten_ops']) / args.layers:+.1f}"
        print(
            f"| {name} | {r['fwd_aten_ops']} | {r['fwd_launches']} | {r['fwdbwd_aten_ops']} | "
            f"{r['fwdbwd_aten_compute_ops']} | {r['fwdbwd_launches']} | {extra} |"
        )
        if args.verbose:
            print("    fwd:", sorted(r["fwd_aten_ops_by_name"].items(), key=lambda kv: -kv[1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "device": device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
