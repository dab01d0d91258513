"""Convert a trained dot-product causal LM to distance attention, then recover it with LoRA and full fine-tuning.

    python recipes/convert_to_rbf.py --config recipes/configs/cpu_convert.yaml [--set key=value ...]
        [--model DIR] [--targets rbf hybrid_sort] [--steps 150] [--learning-rate 1e-3] [--lora-rank 8]
        [--hybrid-set KEY=VALUE ...] [--speed-rounds 5] [--output outputs/convert_to_rbf] [--retrain]

1. The dot-product model: ``--model DIR`` (any causal LM whose attention dispatches through transformers'
   ``ALL_ATTENTION_FUNCTIONS``, with its tokenizer), or, without it, the recipe's model trained by
   ``recipes/pretrain.py`` (``cpu_convert.yaml``: a Llama at the main job's size, data and schedule).  A finished
   ``<output_dir>/final`` of the recipe is reused (``--retrain`` trains it again).
2. The targets (``--targets``, both by default):

   * ``rbf``: the same model switched to ``attn_implementation="rbf"`` (``docs/stock_models.md``: gamma = scaling / 2
     keeps the dot-product logits and adds a key-norm penalty).  It needs nothing but the attention interface.
   * ``hybrid_sort``: the weights converted into our :class:`~hf_rbf.HybridSortForCausalLM`
     (:func:`hf_rbf.convert_llama.convert_llama`), score ``q.k / sqrt(d) - (qs - ks)^2 / tau``.  It needs our model
     classes: a stock model has no scalar projections.  It starts with the original's logits (``qs_proj`` small and
     random, ``ks_proj`` zero: the scalar term is a constant per query, which the softmax removes; both at zero would
     never get a gradient) and has to learn its scalar term.  Llama-architecture sources only (Llama, Mistral, Qwen2).
     ``--hybrid-set KEY=VALUE`` sets a field of its config (e.g. ``tau_init_range=[0.5,1.0]``).

3. For each target: validation loss right after the switch, after LoRA (rank ``--lora-rank`` on W_Q, W_K, W_V, W_O; the
   hybrid's new scalar projections ``qs_proj`` / ``ks_proj`` are trained in full, as PEFT ``modules_to_save``: they
   are ``H x D`` each, smaller than a LoRA pair) and after full fine-tuning.  Every recovery uses ``Trainer`` with the
   same steps, batch and learning rate on the recipe's training blocks.
4. Controls: the dot-product model fine-tuned the same two ways (the extra steps alone also lower the loss).
5. Forward tokens/s over validation blocks: the original and every converted model, ``--speed-rounds`` rounds
   interleaved in this process, the best of each.
6. For the hybrid: how much its scalar term does, before and after the recoveries (:func:`scalar_term_share`).

Writes ``<output>/conversion.json`` and ``conversion.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
import yaml

from recipes.pretrain_config import load_config

TARGETS = ("rbf", "hybrid_sort")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The hybrid's new parameters that LoRA runs train in full (PEFT modules_to_save).
HYBRID_NEW_MODULES = ("qs_proj", "ks_proj")
# Windows of the hybrid's captured mass (the recipes' blocks are 128 tokens: the last 64 queries see 65 to 128 keys).
CAPTURED_MASS_WINDOWS = (16, 32)
TARGET_TITLES = {
    "rbf": 'switched to `attn_implementation="rbf"`',
    "hybrid_sort": "converted to `HybridSortForCausalLM` (scalar term from zero)",
}


def validation_loss(model, blocks, batch_size: int = 16) -> float:
    """Mean next-token loss over the validation blocks (every block has the same length).  Computed from the logits:
    a hybrid with regularizers (``--hybrid-set align_loss_weight=...``) adds them to its ``loss``."""
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            ids = torch.stack([torch.as_tensor(x, dtype=torch.long) for x in blocks[start : start + batch_size]])
            ids = ids.to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            total += float(loss) * ids.shape[0]
            count += ids.shape[0]
    return total / max(count, 1)


def max_logit_difference(model, reference, blocks, batch_size: int = 16) -> float:
    """Largest absolute difference between the logits of ``model`` and ``reference`` on the first validation blocks."""
    device = next(model.parameters()).device
    ids = torch.stack([torch.as_tensor(x, dtype=torch.long) for x in blocks[:batch_size]]).to(device)
    model.eval()
    reference.eval()
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=False).logits
        b = reference(input_ids=ids, use_cache=False).logits
    return float((a.float() - b.float()).abs().max())


def scalar_term_share(model, blocks, batch_size: int = 8) -> float:
    """How much the hybrid's scalar term moves the attention, relative to its dot-product term.

    Per layer, head and query ``i``: the standard deviation over the visible keys ``j <= i`` of the scalar score
    ``-(qs_i - ks_j)^2 / tau`` and of the dot score ``q_i.k_j / sqrt(d)`` (a constant shift of a row changes nothing in
    the softmax, its spread over keys is what selects them); the ratio of their means over queries, heads and layers.
    0 = the scalar term does nothing (the converted model's start), 1 = it moves the scores as much as the dot product.
    """
    from hf_rbf.modeling_hybrid_sort import HybridSortAttention

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = [m for m in inner.modules() if isinstance(m, HybridSortAttention)]
    if not layers:
        raise ValueError("scalar_term_share needs a model with HybridSortAttention layers")
    captured = {}

    def hook(module, args, kwargs):
        captured[module] = (args[0], kwargs["position_embeddings"])

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers]
    device = next(model.parameters()).device
    ids = torch.stack([torch.as_tensor(x, dtype=torch.long) for x in blocks[:batch_size]]).to(device)
    scalar_spread, dot_spread = 0.0, 0.0
    try:
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
            n = ids.shape[1]
            visible = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            for m in layers:
                x, position_embeddings = captured[m]
                proj = m.project(x, position_embeddings)
                tau = m.temperature(x).float()
                tau = tau.view(1, -1, 1, 1) if tau.dim() == 1 else tau.unsqueeze(-1)
                scalar = -((proj.qs.float().unsqueeze(-1) - proj.ks.float().unsqueeze(-2)) ** 2) / tau
                scale = m._scale(device)
                scale = scale.view(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else scale
                dot = scale * (proj.q.float() @ proj.k.float().transpose(-1, -2))
                scalar_spread += float(_masked_row_std(scalar, visible).mean())
                dot_spread += float(_masked_row_std(dot, visible).mean())
    finally:
        for h in handles:
            h.remove()
    return scalar_spread / max(dot_spread, 1e-30)


def window_captured_mass(model, blocks, windows=CAPTURED_MASS_WINDOWS, batch_size: int = 8) -> dict:
    """The hybrid's captured mass (:func:`hf_rbf.eval.captured_mass_callback.batch_captured_mass`): the share of each
    query's exact attention that the sorted cache's window of the ``k`` keys nearest in scalar space would read, mean
    over layers, heads and the last 64 queries of validation blocks; ``{str(k): mass}``.  It says whether the learned
    scalar term makes the cache sortable, which is what the hybrid is for."""
    from hf_rbf.eval.captured_mass_callback import batch_captured_mass

    ids = torch.stack([torch.as_tensor(x, dtype=torch.long) for x in blocks[:batch_size]])
    result = batch_captured_mass(model, ids, windows=windows)
    return {str(k): v for k, v in result["mean"].items()}


def _masked_row_std(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Standard deviation over the visible keys of each row ``[B, H, N, N]`` -> ``[B, H, N - 1]`` (row 0 has one key and
    is left out)."""
    count = visible.sum(-1).to(scores.dtype)
    zero = scores.new_zeros(())
    mean = torch.where(visible, scores, zero).sum(-1) / count
    var = torch.where(visible, (scores - mean.unsqueeze(-1)) ** 2, zero).sum(-1) / count
    return var[..., 1:].sqrt()


def forward_tokens_per_second(models: dict, blocks, batch_size: int = 16, rounds: int = 5) -> dict:
    """Forward tokens/s of each model on the same batch of validation blocks: rounds interleaved across the models
    (the host is shared and noisy), the best round of each reported."""
    best = {name: 0.0 for name in models}
    first = next(iter(models.values()))
    device = next(first.parameters()).device
    ids = torch.stack([torch.as_tensor(x, dtype=torch.long) for x in blocks[:batch_size]]).to(device)
    with torch.no_grad():
        for model in models.values():
            model.eval()
            model(input_ids=ids, use_cache=False)  # warm-up
        for _ in range(rounds):
            for name, model in models.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                best[name] = max(best[name], ids.numel() / (time.perf_counter() - t0))
    return best


def fine_tune(model, train, *, steps: int, learning_rate: float, batch_size: int, output_dir: str, seed: int):
    """``Trainer`` for ``steps`` optimizer steps on the packed training blocks (constant learning rate after a short
    warm-up, no checkpoints)."""
    from transformers import Trainer, TrainingArguments

    from recipes.pretrain_data import collate_blocks

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=max(1, steps // 10),
        weight_decay=0.0,
        logging_steps=max(1, steps // 5),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate_blocks)
    trainer.train()
    return model


def last_attention_backend(target: str, model) -> str:
    """The backend that served the converted model's last forward."""
    import hf_rbf

    if target == "rbf":
        return hf_rbf.last_backend("rbf_attention")
    return model.model.layers[0].self_attn.last_backend


def convert(
    cfg: dict,
    model_dir: str,
    *,
    steps: int,
    learning_rate: float,
    lora_rank: int,
    output: str,
    targets=TARGETS,
    hybrid_overrides: dict | None = None,
    speed_rounds: int = 5,
    log=print,
):
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rbf  # noqa: F401  (registers attn_implementation="rbf")
    from hf_rbf.convert_llama import convert_llama
    from recipes.pretrain_data import prepare_data

    if cfg.get("cpu_threads") is not None and not torch.cuda.is_available():
        # as recipes/pretrain.py (also when its trained model is reused and it does not run in this process)
        torch.set_num_threads(cfg["cpu_threads"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = prepare_data(cfg, tokenizer, log=log)
    val_blocks = [row["input_ids"] for row in data["validation"]]
    batch = int(cfg["global_batch_size"])
    seed = int(cfg["seed"])
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def load(implementation="sdpa"):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=implementation, dtype=torch.float32)
        return model.to(device)

    def converted(target: str):
        """A fresh copy of the original, converted to ``target``."""
        if target == "rbf":
            model = load()
            model.set_attn_implementation("rbf")
            assert model.config._attn_implementation == "rbf"
            return model
        return convert_llama(load(), "hybrid_sort", seed=seed, **(hybrid_overrides or {}))

    result = {
        "model": os.path.abspath(model_dir),
        "steps": steps,
        "learning_rate": learning_rate,
        "lora_rank": lora_rank,
        "batch_size": batch,
        "validation_blocks": len(val_blocks),
        "targets": {target: {} for target in targets},
    }
    if "hybrid_sort" in targets:
        result["targets"]["hybrid_sort"]["config_overrides"] = dict(hybrid_overrides or {})
    original = load()
    result["loss_original"] = validation_loss(original, val_blocks)
    log(f"[convert] validation loss of the original: {result['loss_original']:.4f}")
    switched = {}
    for target in targets:
        r = result["targets"][target]
        switched[target] = converted(target)
        r["loss_after_switch"] = validation_loss(switched[target], val_blocks)
        r["backend"] = last_attention_backend(target, switched[target])
        r["max_abs_logit_difference"] = max_logit_difference(switched[target], original, val_blocks)
        if target == "hybrid_sort":
            r["scalar_term_share_after_switch"] = scalar_term_share(switched[target], val_blocks)
            r["captured_mass_after_switch"] = window_captured_mass(switched[target], val_blocks)
        log(
            f"[convert] {target}: right after the switch {r['loss_after_switch']:.4f} (max |logit difference| "
            f"{r['max_abs_logit_difference']:.3g}, backend {r['backend']})"
        )
    speed = forward_tokens_per_second({"original": original, **switched}, val_blocks, rounds=speed_rounds)
    result["speed_rounds"] = speed_rounds
    result["tokens_per_s_original"] = speed["original"]
    for target in targets:
        result["targets"][target]["tokens_per_s"] = speed[target]
    del original

    def recover(model, record: dict, stage: str, run_name: str) -> float:
        """Fine-tune ``model`` with the shared settings; record its trainable parameters and seconds; its loss."""
        record[f"{stage}_trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        t0 = time.time()
        fine_tune(
            model,
            data["train"],
            steps=steps,
            learning_rate=learning_rate,
            batch_size=batch,
            output_dir=os.path.join(output, run_name),
            seed=seed,
        )
        record[f"{stage}_seconds"] = time.time() - t0
        return validation_loss(model, val_blocks)

    def lora(model, hybrid: bool):
        config = peft.LoraConfig(
            r=lora_rank,
            lora_alpha=2 * lora_rank,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            modules_to_save=list(HYBRID_NEW_MODULES) if hybrid else None,
            task_type="CAUSAL_LM",
        )
        return peft.get_peft_model(model, config)

    for target in targets:
        r = result["targets"][target]
        lora_model = lora(switched.pop(target), target == "hybrid_sort")
        r["loss_after_lora"] = recover(lora_model, r, "lora", f"{target}-lora")
        if target == "hybrid_sort":
            r["scalar_term_share_after_lora"] = scalar_term_share(lora_model, val_blocks)
            r["captured_mass_after_lora"] = window_captured_mass(lora_model, val_blocks)
        log(f"[convert] {target}: after LoRA (rank {lora_rank}, {steps} steps): {r['loss_after_lora']:.4f}")
        del lora_model
        full = converted(target)
        r["loss_after_full"] = recover(full, r, "full", f"{target}-full")
        if target == "hybrid_sort":
            r["scalar_term_share_after_full"] = scalar_term_share(full, val_blocks)
            r["captured_mass_after_full"] = window_captured_mass(full, val_blocks)
        log(f"[convert] {target}: after full fine-tuning ({steps} steps): {r['loss_after_full']:.4f}")
        del full
    # The controls: the dot-product model fine-tuned the same two ways, so the recoveries are compared with what the
    # extra steps alone give.
    result["loss_control_lora"] = recover(lora(load(), False), result, "control_lora", "control-lora")
    result["loss_control_full"] = recover(load(), result, "control", "control")
    log(
        f"[convert] controls: the dot-product model fine-tuned the same {steps} steps: LoRA "
        f"{result['loss_control_lora']:.4f}, full {result['loss_control_full']:.4f}"
    )
    return result


def markdown(result: dict) -> str:
    r = result
    lines = [
        "| model | stage | validation loss | trainable parameters | forward tokens/s |",
        "|---|---|---|---|---|",
        f"| dot product (SDPA) | as trained | {r['loss_original']:.4f} | | {r['tokens_per_s_original']:,.0f} |",
    ]
    for target, t in r["targets"].items():
        name = TARGET_TITLES[target]
        lines += [
            (
                f"| {name} | right after the switch | {t['loss_after_switch']:.4f} | | "
                f"{t['tokens_per_s']:,.0f} ({t['backend']}) |"
            ),
            f"| {name} | + LoRA r{r['lora_rank']} on q/k/v/o"
            + (" (qs/ks in full)" if target == "hybrid_sort" else "")
            + f", {r['steps']} steps | {t['loss_after_lora']:.4f} | {t['lora_trainable_parameters']:,} | |",
            (
                f"| {name} | + full fine-tuning, {r['steps']} steps | {t['loss_after_full']:.4f} | "
                f"{t['full_trainable_parameters']:,} | |"
            ),
        ]
    lines += [
        (
            f"| control: dot product | + LoRA r{r['lora_rank']} on q/k/v/o, {r['steps']} steps | "
            f"{r['loss_control_lora']:.4f} | {r['control_lora_trainable_parameters']:,} | |"
        ),
        (
            f"| control: dot product | + full fine-tuning, {r['steps']} steps | {r['loss_control_full']:.4f} | "
            f"{r['control_trainable_parameters']:,} | |"
        ),
    ]
    hybrid = r["targets"].get("hybrid_sort")
    if hybrid is not None:
        lines += [
            "",
            f"Hybrid start: max |logit difference| to the original {hybrid['max_abs_logit_difference']:.2g}.",
            "",
            "| hybrid | scalar term's spread over keys / dot term's | "
            + " | ".join(f"captured mass, window {k}" for k in hybrid["captured_mass_after_switch"])
            + " |",
            "|---|---|" + "---|" * len(hybrid["captured_mass_after_switch"]),
        ]
        for stage, title in (("switch", "right after the switch"), ("lora", "after LoRA"), ("full", "after full")):
            mass = hybrid[f"captured_mass_after_{stage}"]
            lines.append(
                f"| {title} | {hybrid[f'scalar_term_share_after_{stage}']:.3f} | "
                + " | ".join(f"{m:.3f}" for m in mass.values())
                + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe (data, batch, seed; and the model to train)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model", default=None, help="a trained dot-product checkpoint (default: train the recipe)")
    parser.add_argument(
        "--targets", nargs="+", default=list(TARGETS), metavar="TARGET", help=f"any of {', '.join(TARGETS)}"
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--speed-rounds", type=int, default=5, help="interleaved forward rounds; the best is reported")
    parser.add_argument("--output", default="outputs/convert_to_rbf")
    parser.add_argument("--retrain", action="store_true", help="train the recipe's model even if its final/ exists")
    parser.add_argument(
        "--hybrid-set",
        dest="hybrid_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a HybridSortConfig field of the converted hybrid (YAML value), e.g. tau_init_range=[0.5,1.0]",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "lora_rank", "speed_rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.learning_rate <= 0:
        parser.error("--learning-rate must be positive")
    bad = [t for t in args.targets if t not in TARGETS]
    if bad or len(set(args.targets)) != len(args.targets):
        parser.error(f"--targets must be distinct names from {', '.join(TARGETS)}; got {args.targets}")
    if not os.path.isfile(args.config):
        parser.error(f"--config must be a recipe file; {args.config!r} does not exist")
    if args.model is not None and not os.path.isdir(args.model) and (os.sep in args.model or args.model[:1] == "."):
        parser.error(f"--model must be a checkpoint directory (or a hub name); {args.model!r} does not exist")
    hybrid_overrides = {}
    for item in args.hybrid_overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--hybrid-set must be KEY=VALUE; got {item!r}")
        hybrid_overrides[key] = yaml.safe_load(value)
    if hybrid_overrides:
        from transformers import LlamaConfig

        from hf_rbf.convert_llama import hf_rbf_config_from_llama

        try:  # the field checks need no model: a tiny Llama config stands in for the source
            hf_rbf_config_from_llama(
                LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2),
                "hybrid_sort",
                **hybrid_overrides,
            )
        except (TypeError, ValueError) as error:
            parser.error(f"--hybrid-set must be a valid HybridSortConfig field and value: {error}")
    cfg = load_config(args.config, args.overrides)
    model_dir = args.model
    if model_dir is None:
        final = os.path.join(cfg["output_dir"], "final")
        if not args.retrain and os.path.isfile(os.path.join(final, "config.json")):
            print(f"[convert] reusing the trained model in {final} (--retrain trains it again)")
            model_dir = final
        else:
            from recipes.pretrain import run

            model_dir = run(cfg)["final_dir"]
    if "hybrid_sort" in args.targets:
        from transformers import AutoConfig

        from hf_rbf.convert_llama import check_source_config

        try:
            check_source_config(AutoConfig.from_pretrained(model_dir))
        except ValueError as error:
            parser.error(f"--targets hybrid_sort must have a Llama-architecture --model: {error}")
    os.makedirs(args.output, exist_ok=True)
    result = convert(
        cfg,
        model_dir,
        steps=args.steps,
        learning_rate=args.learning_rate,
        lora_rank=args.lora_rank,
        output=args.output,
        targets=tuple(args.targets),
        hybrid_overrides=hybrid_overrides,
        speed_rounds=args.speed_rounds,
    )
    with open(os.path.join(args.output, "conversion.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    table = markdown(result)
    with open(os.path.join(args.output, "conversion.md"), "w", encoding="utf-8") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
