"""Parameter and FLOP accounting of every model family against dot-product attention, computed from the model classes.

    python recipes/accounting.py [--output outputs/accounting]      # writes accounting.json and accounting.md

Two setups:

* ``tinystories``: the recipes ``tinystories_<family>.yaml`` (+ ``gka_sssl`` / ``dot_sssl``) exactly as
  ``pretrain.py`` builds them (d=256, 4 layers, 4 heads, sequence 256, vocabulary 8192, SwiGLU widened where a family
  is matched to the dot baseline's parameter budget);
* ``d768``: every family at d=768, 12 layers, 12 heads, sequence 1024, SwiGLU 2048, vocabulary 32000, *without*
  matching (the same MLP for all), which shows what the attention function itself saves or costs.

Parameters are counted on the instantiated model (``model.parameters()``, tied tensors once).  FLOPs are counted by
``torch.utils.flop_counter.FlopCounterMode`` on one forward of a batch of one sequence on the meta device (no memory,
no compute), through the reference ("naive") attention path, which forms every query-key product densely: matrix
products only (the convention of the 6N rule; softmax, exp, norms and the RBF key-norm subtraction are not counted).
Per module: attention projections (the ``nn.Linear`` layers of each attention module), attention core (the other
matrix products of the attention module: scores and weighted values, registers included), SwiGLU, LM head.  The
"causal" column multiplies each layer's attention core by the fraction of (query, key) pairs its mask allows (causal,
sliding window, register prefix), i.e. what a kernel that skips masked blocks does.  A backward pass costs about twice
the forward in matrix products, so training is about 3x the forward numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from recipes.pretrain_config import load_config
from recipes.pretrain_models import (
    available_families,
    build_config,
    build_model,
    count_parameters,
    resolve_model_config,
)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
TINYSTORIES_RECIPES = (
    "tinystories_llama",
    "tinystories_dot",
    "tinystories_rbf",
    "tinystories_gka",
    "tinystories_scalar_sort",
    "tinystories_hybrid_sort",
    "dot_sssl",
    "gka_sssl",
)
D768 = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=1024,
)
D768_FAMILY_EXTRA = {"rbf": {"num_register_tokens": 1}, "gka": {"num_register_tokens": 0}}


def _forward_flops(model, seq_len: int) -> dict:
    """Matrix-product FLOPs of one forward of ``[1, seq_len]`` tokens, per module path."""
    from torch.utils.flop_counter import FlopCounterMode

    device = next(model.parameters()).device
    ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    kwargs = {}
    if model.config.model_type == "llama":
        # a 4-D mask skips transformers' mask preprocessing, which reads tensor values (impossible on meta)
        kwargs["attention_mask"] = torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device).tril()
        kwargs["position_ids"] = torch.arange(seq_len, device=device)[None]
    counter = FlopCounterMode(display=False)
    with counter:  # (not under no_grad: the module tracker needs autograd nodes; meta tensors cost nothing)
        model(input_ids=ids, use_cache=False, **kwargs)
    return {path: sum(ops.values()) for path, ops in counter.get_flop_counts().items()}


def _attention_modules(model):
    """``[(module path, module, window or None, num_registers)]`` of each layer's attention module."""
    out = []
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            layer = int(name.split(".")[-2])
            window = getattr(module, "window", None)
            if window is None and model.config.model_type != "llama":
                window = model.config.layer_window(layer)
            registers = getattr(module, "num_registers", 0)
            out.append((name, module, window, registers))
    return out


def allowed_fraction(seq_len: int, window, registers: int) -> float:
    """Fraction of the (query, key) pairs of the text rows (keys: registers + text) that the mask allows."""
    from hf_rbf.attention_utils import allowed_positions

    allowed = allowed_positions(seq_len, seq_len + registers, True, window, registers, torch.device("cpu"))
    return float(allowed.float().mean())


def account_model(family: str, config_kwargs: dict, seq_len: int) -> dict:
    """Parameters and per-token forward FLOPs of one model (built on the meta device)."""
    kwargs = dict(config_kwargs)
    if family != "llama":
        kwargs["attention_backend"] = "naive"  # the reference path: every product is an explicit matmul
    model = build_model(build_config(family, kwargs), device="meta")
    params = count_parameters(model)
    flops = _forward_flops(model, seq_len)
    total = flops.get("Global", 0)
    prefix = type(model).__name__ + "."
    attn_proj = attn_core = attn_core_causal = 0
    attention_params = []
    for name, module, window, registers in _attention_modules(model):
        path = prefix + name
        module_flops = flops.get(path, 0)
        linear = sum(
            flops.get(f"{path}.{child}", 0)
            for child, sub in module.named_children()
            if isinstance(sub, torch.nn.Linear)
        )
        attn_proj += linear
        core = module_flops - linear
        attn_core += core
        attn_core_causal += core * allowed_fraction(seq_len, window, registers)
        attention_params.append(sum(p.numel() for p in module.parameters()))
    mlp = sum(v for k, v in flops.items() if k.endswith(".mlp"))
    head = flops.get(prefix + "lm_head", 0)
    causal_total = total - attn_core + attn_core_causal
    layer0 = model.model.layers[0]
    return {
        "family": family,
        "hidden_size": model.config.hidden_size,
        "num_hidden_layers": model.config.num_hidden_layers,
        "intermediate_size": model.config.intermediate_size,
        "vocab_size": model.config.vocab_size,
        "seq_len": seq_len,
        "num_parameters": params["total"],
        "num_parameters_non_embedding": params["non_embedding"],
        "attention_parameters_per_layer": attention_params,
        "mlp_parameters_per_layer": sum(p.numel() for p in layer0.mlp.parameters()),
        "num_register_tokens": getattr(model.config, "num_register_tokens", 0),
        "flops_per_token": {
            "total_dense": total / seq_len,
            "total_causal": causal_total / seq_len,
            "attention_projections": attn_proj / seq_len,
            "attention_core_dense": attn_core / seq_len,
            "attention_core_causal": attn_core_causal / seq_len,
            "mlp": mlp / seq_len,
            "lm_head": head / seq_len,
        },
    }


def tinystories_setup(names=TINYSTORIES_RECIPES) -> list[dict]:
    rows = []
    families = available_families()
    for name in names:
        path = os.path.join(CONFIG_DIR, f"{name}.yaml")
        cfg = load_config(path, output_dir="unused")
        family = cfg["model"]["family"]
        if family not in families:
            rows.append({"name": name, "family": family, "skipped": "family not registered in this checkout"})
            continue
        block = cfg["data"]["block_size"]
        kwargs, _ = resolve_model_config(cfg["model"], cfg["model"]["config"]["vocab_size"], block, {})
        rows.append({"name": name, **account_model(family, kwargs, block)})
    return rows


def d768_setup() -> list[dict]:
    rows = []
    for family in ["llama", "dot"] + [f for f in available_families() if f not in ("llama", "dot")]:
        kwargs = dict(D768, **D768_FAMILY_EXTRA.get(family, {}))
        if family == "llama":
            kwargs = dict(D768)
        rows.append({"name": f"d768_{family}", **account_model(family, kwargs, D768["max_position_embeddings"])})
    return rows


def _relative(rows: list[dict], reference: str) -> None:
    ref = next((r for r in rows if r.get("family") == reference and "skipped" not in r), None)
    for r in rows:
        if ref is None or "skipped" in r:
            continue
        r["vs_dot"] = {
            "parameters": r["num_parameters"] / ref["num_parameters"],
            "flops_dense": r["flops_per_token"]["total_dense"] / ref["flops_per_token"]["total_dense"],
            "flops_causal": r["flops_per_token"]["total_causal"] / ref["flops_per_token"]["total_causal"],
        }


def run() -> dict:
    setups = {"tinystories": tinystories_setup(), "d768": d768_setup()}
    for rows in setups.values():
        _relative(rows, "dot")
    return {
        "description": "parameters counted on the models; forward matrix-product FLOPs per token counted by "
        "FlopCounterMode on the meta device through the reference attention path (dense), and with each layer's "
        "attention core scaled by the fraction of (query, key) pairs its mask allows (causal)",
        "setups": setups,
    }


def markdown_table(rows: list[dict], highlight: str | None = None) -> str:
    lines = [
        (
            "| model | family | parameters | non-embedding | attention params / layer | SwiGLU width | "
            "fwd MFLOP / token (dense) | fwd MFLOP / token (causal) | attention core (causal) | vs dot (params, causal FLOPs) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['name']} | {r['family']} | {r['skipped']} | | | | | | | |")
            continue
        f = r["flops_per_token"]
        attn = sorted(set(r["attention_parameters_per_layer"]))
        attn_text = " / ".join(f"{a:,}" for a in attn)
        rel = r.get("vs_dot")
        rel_text = f"{rel['parameters']:.3f}x, {rel['flops_causal']:.3f}x" if rel else ""
        name = f"**{r['name']}**" if highlight and r["family"] == highlight else r["name"]
        lines.append(
            f"| {name} | {r['family']} | {r['num_parameters']:,} | {r['num_parameters_non_embedding']:,} | "
            f"{attn_text} | {r['intermediate_size']} | {f['total_dense'] / 1e6:.2f} | {f['total_causal'] / 1e6:.2f} | "
            f"{f['attention_core_causal'] / 1e6:.2f} | {rel_text} |"
        )
    return "\n".join(lines) + "\n"


def report_markdown(report: dict) -> str:
    ts = report["setups"]["tinystories"]
    d = report["setups"]["d768"]
    return (
        "## TinyStories recipes (d=256, 4 layers, sequence 256, vocabulary 8192, matched budgets)\n\n"
        + markdown_table(ts)
        + "\n## d=768, 12 layers, sequence 1024, SwiGLU 2048, vocabulary 32000 (no matching)\n\n"
        + markdown_table(d)
        + "\n"
        + report["description"]
        + ".\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="outputs/accounting", help="writes <output>.json and <output>.md")
    args = parser.parse_args(argv)
    report = run()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    text = report_markdown(report)
    with open(args.output + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
