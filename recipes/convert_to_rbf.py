"""Convert a trained dot-product causal LM to RBF attention, then recover it with LoRA and with full fine-tuning.

    python recipes/convert_to_rbf.py --config recipes/configs/cpu_convert.yaml [--set key=value ...]
        [--model DIR] [--steps 150] [--learning-rate 1e-3] [--lora-rank 8] [--output outputs/convert_to_rbf]

1. The dot-product model: ``--model DIR`` (any causal LM whose attention dispatches through transformers'
   ``ALL_ATTENTION_FUNCTIONS``, with its tokenizer), or, without it, the recipe's model trained first by
   ``recipes/pretrain.py`` (``cpu_convert.yaml``: a Llama at the main job's size, data and schedule).
2. Validation loss on the recipe's validation blocks: with the model's own attention (SDPA), right after switching to
   ``attn_implementation="rbf"`` (``docs/stock_models.md``: gamma = scaling / 2 keeps the dot-product logits and adds
   the key-norm penalty), after LoRA on the attention projections, and after full fine-tuning.  Both recoveries use
   ``Trainer`` with the same steps, batch and learning rate on the recipe's training blocks.
3. A control: the dot-product model fine-tuned the same way (the extra steps alone also lower the loss).
4. Forward tokens/s over the validation blocks, the original against the converted model, in this process.

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

from recipes.pretrain_config import load_config

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def validation_loss(model, blocks, batch_size: int = 16) -> float:
    """Mean next-token loss over the validation blocks (every block has the same length)."""
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            ids = torch.stack([torch.as_tensor(x, dtype=torch.long) for x in blocks[start : start + batch_size]])
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            total += float(loss) * ids.shape[0]
            count += ids.shape[0]
    return total / max(count, 1)


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


def convert(cfg: dict, model_dir: str, *, steps: int, learning_rate: float, lora_rank: int, output: str, log=print):
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rbf  # noqa: F401  (registers attn_implementation="rbf")
    from recipes.pretrain_data import prepare_data

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = prepare_data(cfg, tokenizer, log=log)
    val_blocks = [row["input_ids"] for row in data["validation"]]
    batch = int(cfg["global_batch_size"])
    seed = int(cfg["seed"])

    def load(implementation):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=implementation, dtype=torch.float32)
        return model.to("cuda" if torch.cuda.is_available() else "cpu")

    result = {
        "model": os.path.abspath(model_dir),
        "steps": steps,
        "learning_rate": learning_rate,
        "lora_rank": lora_rank,
        "batch_size": batch,
        "validation_blocks": len(val_blocks),
    }
    original = load("sdpa")
    result["loss_original"] = validation_loss(original, val_blocks)
    switched = load("sdpa")
    switched.set_attn_implementation("rbf")
    assert switched.config._attn_implementation == "rbf"
    result["loss_after_switch"] = validation_loss(switched, val_blocks)
    speed = forward_tokens_per_second({"original": original, "rbf": switched}, val_blocks)
    result["tokens_per_s_original"], result["tokens_per_s_rbf"] = speed["original"], speed["rbf"]
    result["rbf_backend"] = hf_rbf.last_backend("rbf_attention")
    log(
        f"[convert] validation loss: original {result['loss_original']:.4f}, right after the switch "
        f"{result['loss_after_switch']:.4f}"
    )
    del original

    lora_config = peft.LoraConfig(
        r=lora_rank,
        lora_alpha=2 * lora_rank,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )

    def recover(model, stage: str) -> float:
        """Fine-tune ``model`` with the shared settings; record its trainable parameters and seconds; its loss."""
        result[f"{stage}_trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        t0 = time.time()
        fine_tune(
            model,
            data["train"],
            steps=steps,
            learning_rate=learning_rate,
            batch_size=batch,
            output_dir=os.path.join(output, stage),
            seed=seed,
        )
        result[f"{stage}_seconds"] = time.time() - t0
        return validation_loss(model, val_blocks)

    result["loss_after_lora"] = recover(peft.get_peft_model(switched, lora_config), "lora")
    log(f"[convert] after LoRA (rank {lora_rank}, {steps} steps): {result['loss_after_lora']:.4f}")
    del switched
    result["loss_after_full"] = recover(load("rbf"), "full")
    log(f"[convert] after full fine-tuning ({steps} steps): {result['loss_after_full']:.4f}")
    # The control: the dot-product model fine-tuned the same way, so the recoveries are compared with what the extra
    # steps alone give.
    result["loss_control_full"] = recover(load("sdpa"), "control")
    log(
        f"[convert] control: the dot-product model fine-tuned the same {steps} steps: {result['loss_control_full']:.4f}"
    )
    return result


def markdown(result: dict) -> str:
    r = result
    return (
        "| stage | validation loss | trainable parameters | forward tokens/s |\n|---|---|---|---|\n"
        f"| dot product (SDPA), as trained | {r['loss_original']:.4f} | | {r['tokens_per_s_original']:,.0f} |\n"
        f'| switched to `attn_implementation="rbf"` | {r["loss_after_switch"]:.4f} | | '
        f"{r['tokens_per_s_rbf']:,.0f} ({r['rbf_backend']}) |\n"
        f"| + LoRA r{r['lora_rank']} on q/k/v/o, {r['steps']} steps | {r['loss_after_lora']:.4f} | "
        f"{r['lora_trainable_parameters']:,} | |\n"
        f"| + full fine-tuning, {r['steps']} steps | {r['loss_after_full']:.4f} | {r['full_trainable_parameters']:,} | |\n"
        f"| control: dot product fine-tuned the same {r['steps']} steps | {r['loss_control_full']:.4f} | "
        f"{r['control_trainable_parameters']:,} | |\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe (data, batch, seed; and the model to train)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model", default=None, help="a trained dot-product checkpoint (default: train the recipe)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--output", default="outputs/convert_to_rbf")
    args = parser.parse_args(argv)
    for name in ("steps", "lora_rank"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.learning_rate <= 0:
        parser.error("--learning-rate must be positive")
    if not os.path.isfile(args.config):
        parser.error(f"--config must be a recipe file; {args.config!r} does not exist")
    if args.model is not None and not os.path.isdir(args.model) and (os.sep in args.model or args.model[:1] == "."):
        parser.error(f"--model must be a checkpoint directory (or a hub name); {args.model!r} does not exist")
    cfg = load_config(args.config, args.overrides)
    model_dir = args.model
    if model_dir is None:
        from recipes.pretrain import run

        summary = run(cfg)
        model_dir = summary["final_dir"]
    os.makedirs(args.output, exist_ok=True)
    result = convert(
        cfg, model_dir, steps=args.steps, learning_rate=args.learning_rate, lora_rank=args.lora_rank, output=args.output
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
