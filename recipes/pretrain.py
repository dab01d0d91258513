"""Pretrain a causal LM of any hf_rbf family (or the dot-product / Llama baselines) with ``Trainer``.

    python recipes/pretrain.py --config recipes/configs/cpu_quick.yaml [--set training.max_steps=50 ...]
        [--output-dir DIR] [--resume [CHECKPOINT]] [--prepare-only] [--train-only] [--stop-at-step N]
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/pretrain.py --config ...   # several GPUs

Steps: train (or load) a byte-level BPE tokenizer with ``tokenizers``; load the text with ``datasets`` (local files or
a hub dataset), split it into documents, encode them with EOS between documents and pack the stream into
``block_size`` blocks; build the model (``AutoConfig.for_model(family, ...)`` for hf_rbf families, ``"dot"`` for the
backbone with dot-product attention, ``"llama"`` for ``LlamaForCausalLM`` of the same size); train with ``Trainer``
(progress bar, checkpoints that resume exactly with ``--resume``); write ``metrics.json`` / ``metrics.csv`` /
``loss_curve.png``; evaluate the validation loss and bits per byte; print a story from ``model.generate``; save the
final model and tokenizer to ``<output_dir>/final`` and check that it loads with ``trust_remote_code=True`` in a process
where hf_rbf cannot be imported and gives the same logits; write ``summary.json`` and print a summary.

The recipe format is described in ``recipes/pretrain_config.py`` and ``docs/recipes.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: make `hf_rbf` and `recipes` importable
    sys.path.insert(0, REPO_ROOT)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import yaml

from recipes.pretrain_config import load_config

logger = logging.getLogger("pretrain")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Pretrain an hf_rbf model (or a dot-product / Llama baseline) with transformers' Trainer.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--config", required=True, help="recipe YAML (recipes/configs/*.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override recipe keys, e.g. --set training.max_steps=50 model.config.hidden_size=64 (values are YAML)",
    )
    parser.add_argument("--output-dir", default=None, help="override the recipe's output_dir")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="resume from the latest checkpoint in the output dir, or from the checkpoint folder given",
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="train/load the tokenizer and pack the data (cached), then stop"
    )
    parser.add_argument(
        "--train-only",
        action="store_true",
        help="stop after training: no final evaluation, saved model, story or checks (speed runs; summary.json still "
        "holds the training numbers)",
    )
    parser.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="stop after this many steps and save a checkpoint there, keeping the schedule of training.max_steps "
        "(simulates an interrupted job; continue it with --resume)",
    )
    args = parser.parse_args(argv)
    if args.train_only and args.prepare_only:
        parser.error("--train-only and --prepare-only exclude each other (--prepare-only stops before training)")
    args.overrides = [item for group in args.overrides for item in group]
    return args


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_training_args(cfg: dict):
    """``TrainingArguments`` from the recipe's ``training`` section, with the run's output dir and seed, and
    ``per_device_train_batch_size`` derived from ``global_batch_size`` when that is set."""
    from transformers import TrainingArguments

    kwargs = dict(cfg["training"])
    kwargs["output_dir"] = cfg["output_dir"]
    kwargs.setdefault("seed", cfg["seed"])
    kwargs.setdefault("report_to", "none")
    kwargs.setdefault("remove_unused_columns", False)
    kwargs.setdefault("dataloader_pin_memory", torch.cuda.is_available())
    # without a GPU say so: only then does Trainer set up gloo for several CPU processes (torchrun / accelerate)
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    gbs = cfg["global_batch_size"]
    if gbs is not None:
        accumulation = int(kwargs.get("gradient_accumulation_steps", 1))
        kwargs["per_device_train_batch_size"] = per_device_batch_size(gbs, world_size(), accumulation)
        kwargs.setdefault("per_device_eval_batch_size", kwargs["per_device_train_batch_size"])
    return TrainingArguments(**kwargs)


def per_device_batch_size(global_batch_size: int, processes: int, accumulation: int) -> int:
    """Blocks per process and micro-step so that ``processes x accumulation x blocks = global_batch_size``."""
    if global_batch_size % (processes * accumulation) != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by processes ({processes}) x "
            f"gradient_accumulation_steps ({accumulation})"
        )
    return global_batch_size // (processes * accumulation)


def get_tokenizer(cfg: dict, train_docs, resume: bool, log):
    """Load ``tokenizer.path``, or (on resume) the run's saved tokenizer, or train one on the training documents and
    save it to ``<output_dir>/tokenizer``."""
    from transformers import AutoTokenizer

    from recipes.pretrain_data import train_tokenizer

    tok_cfg = cfg["tokenizer"]
    saved = os.path.join(cfg["output_dir"], "tokenizer")
    if tok_cfg["path"]:
        log(f"[tokenizer] loading {tok_cfg['path']}")
        return AutoTokenizer.from_pretrained(tok_cfg["path"])
    if resume and os.path.isdir(saved):
        log(f"[tokenizer] resuming with {saved}")
        return AutoTokenizer.from_pretrained(saved)
    t0 = time.time()
    tokenizer = train_tokenizer(
        iter(train_docs["text"]),
        tok_cfg["vocab_size"],
        min_frequency=tok_cfg["min_frequency"],
        eos_token=tok_cfg["eos_token"],
        pad_token=tok_cfg["pad_token"],
        max_train_chars=tok_cfg["max_train_chars"],
    )
    tokenizer.save_pretrained(saved)
    log(f"[tokenizer] trained a byte-level BPE of {len(tokenizer)} tokens in {time.time() - t0:.1f}s -> {saved}")
    return tokenizer


def _special_ids(tokenizer) -> dict:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _latest_checkpoint(output_dir: str):
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def generate_story(model, tokenizer, gen_cfg: dict, device, *, use_cache: bool = True) -> str:
    """``model.generate`` from ``gen_cfg["prompt"]`` (BOS first, as in training after a document separator)."""
    prompt = gen_cfg.get("prompt", "Once upon a time")
    ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([ids], device=device)
    kwargs = {k: v for k, v in gen_cfg.items() if k not in ("prompt", "seed")}
    torch.manual_seed(int(gen_cfg.get("seed", 0)))
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=use_cache,
            **kwargs,
        )
    return tokenizer.decode(out[0, 1:], skip_special_tokens=True)


def _bpb_texts(texts: list[str], bpb_cfg: dict) -> list[str]:
    if bpb_cfg.get("max_documents") is not None:
        texts = texts[: int(bpb_cfg["max_documents"])]
    if bpb_cfg.get("max_chars") is not None:
        kept, used = [], 0
        for t in texts:
            if used >= bpb_cfg["max_chars"]:
                break
            kept.append(t[: int(bpb_cfg["max_chars"]) - used])
            used += len(kept[-1])
        texts = kept
    return texts


def post_training(cfg, trainer, tokenizer, data, final_dir, log) -> dict:
    """Main process only: reload the saved model, compare with the trained one, bits per byte, a story, the
    remote-code check."""
    from transformers import AutoModelForCausalLM

    from hf_rbf.eval.bpb import bits_per_byte
    from hf_rbf.eval.loading import resolve_device
    from recipes.remote_code_check import remote_code_check

    ev = cfg["evaluation"]
    device = resolve_device(ev["device"])
    out: dict = {}
    model = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).to(device).eval()
    sample = data["validation"][0]["input_ids"].unsqueeze(0).long()

    if not trainer.is_fsdp_enabled:
        trained = trainer.model
        was_training = trained.training
        trained.eval()
        # Under bf16/fp16 training accelerate wraps the trained model's forward in autocast: the reloaded model is
        # run under the same autocast, so the check compares like with like (the weights are compared exactly).
        amp_dtype = torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else None
        with torch.no_grad():
            dev = next(trained.parameters()).device
            a = trained(sample.to(dev)).logits.float().cpu()
            with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                b = model(sample.to(device)).logits.float().cpu()
            reloaded = dict(model.named_parameters())
            trained_params = dict(trained.named_parameters())
            if trained_params.keys() != reloaded.keys():
                raise RuntimeError(
                    "the saved model's parameters differ from the trained model's: missing "
                    f"{sorted(trained_params.keys() - reloaded.keys())}, extra {sorted(reloaded.keys() - trained_params.keys())}"
                )
            param_diff = max(
                (p.detach().float().cpu() - reloaded[n].detach().float().cpu()).abs().max().item()
                for n, p in trained_params.items()
            )
        trained.train(was_training)
        out["reload_max_abs_diff"] = (a - b).abs().max().item()
        out["reload_max_param_diff"] = param_diff
        out["reload_autocast"] = str(amp_dtype).replace("torch.", "") if amp_dtype is not None else None
        log(
            f"[check] saved and reloaded model vs trained model: max |logit diff| = {out['reload_max_abs_diff']:.3g}"
            f" (autocast {out['reload_autocast']}), max |parameter diff| = {param_diff:.3g}"
        )

    if ev["bpb"].get("enabled", True):
        texts = _bpb_texts(data["validation_texts"], ev["bpb"])
        t0 = time.time()
        bpb = bits_per_byte(
            model,
            tokenizer,
            texts,
            max_seq_len=cfg["data"]["block_size"],
            stride=ev["bpb"].get("stride"),
            batch_size=int(ev["bpb"].get("batch_size", 16)),
            device=device,
        )
        bpb["seconds"] = time.time() - t0
        out["bpb"] = bpb
        log(
            f"[eval] bits per byte {bpb['bits_per_byte']:.4f} on {bpb['num_documents']} validation documents "
            f"({bpb['num_bytes']} bytes, {bpb['num_tokens']} tokens, window {bpb['max_seq_len']}, stride "
            f"{bpb['stride']})"
        )

    gen_cfg = dict(ev.get("generation") or {})
    if gen_cfg.pop("enabled", True):
        story = generate_story(model, tokenizer, gen_cfg, device)
        out["story"] = story
        log("[generate] " + gen_cfg.get("prompt", "") + " ->\n" + story + "\n")
        # The same seed without the KV cache must give the same story: a cache the model silently ignores (as with
        # transformers 5.24's rename of `past_key_values`) makes cached decoding diverge after a few tokens.
        uncached = generate_story(model, tokenizer, gen_cfg, device, use_cache=False)
        out["story_cache_check"] = {"ok": uncached == story, "story_without_cache": uncached}
        if uncached == story:
            log("[check] the story generated without the KV cache is identical")
        else:
            log("[check] generate with the KV cache DIFFERS from generate without it:\n" + uncached + "\n")

    if ev.get("remote_code_check", True):
        ids = sample[:, : min(64, sample.shape[1])]
        t0 = time.time()
        check = remote_code_check(final_dir, ids)
        check["seconds"] = time.time() - t0
        out["remote_code_check"] = check
        if check["ok"]:
            log(
                f"[check] {final_dir} loads with trust_remote_code=True without hf_rbf ({check['model_module']}."
                f"{check['model_class']}); same logits (max |diff| {check['max_abs_diff']:.3g}) and the same greedy "
                f"tokens with and without the cache"
            )
        else:
            log(f"[check] remote-code load FAILED: {json.dumps(check)[:2000]}")
    return out


def _versions() -> dict:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def run(
    cfg: dict, *, resume=None, stop_at_step=None, prepare_only=False, train_only=False, log=print, callbacks=()
) -> dict:
    """Run a recipe (see the module docstring); returns the summary (also written to ``summary.json``).  ``callbacks``:
    more ``TrainerCallback``s for the Trainer (benchmarks/bench_scaling.py adds its peak-memory one).  ``train_only``:
    stop after training (speed runs: no final evaluation, no saved model, no story or checks; the summary holds the
    training numbers and ``"train_only": true``).  ``model.register_path`` (not null) sets
    ``hf_rbf.modeling_decoder.register_path`` for this run and restores it after (one process may run several recipes:
    benchmarks/bench_scaling.py)."""
    register_path = cfg["model"].get("register_path")
    if register_path is not None:
        import hf_rbf.modeling_decoder as modeling_decoder

        if register_path not in modeling_decoder.REGISTER_PATHS:
            raise ValueError(
                f"model.register_path must be null or one of {modeling_decoder.REGISTER_PATHS}; got {register_path!r}"
            )
        if modeling_decoder.register_path != register_path:
            previous, modeling_decoder.register_path = modeling_decoder.register_path, register_path
            try:
                return run(
                    cfg, resume=resume, stop_at_step=stop_at_step, prepare_only=prepare_only, train_only=train_only,
                    log=log, callbacks=callbacks,
                )
            finally:
                modeling_decoder.register_path = previous
    import datasets
    import transformers
    from transformers import set_seed

    from hf_rbf.trainer import FSDPPrefetchCallback, HfRbfTrainer

    from recipes.pretrain_callbacks import MetricsCallback, StopAtStepCallback, ThroughputCallback
    from recipes.pretrain_data import collate_blocks, load_split_documents, prepare_data
    from recipes.pretrain_models import (
        attention_backends,
        build_config,
        build_model,
        count_parameters,
        resolve_model_config,
    )

    t_start = time.time()
    if cfg["cpu_threads"] is not None and not torch.cuda.is_available():
        torch.set_num_threads(cfg["cpu_threads"])
    transformers.logging.set_verbosity_warning()
    datasets.disable_progress_bars()  # keep the console for Trainer's progress bar
    out_dir = cfg["output_dir"]
    args = make_training_args(cfg)
    is_main = args.process_index == 0
    if not is_main:
        log = lambda *a, **k: None
    os.makedirs(out_dir, exist_ok=True)
    if is_main:
        with open(os.path.join(out_dir, "recipe.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)

    resume_from = None
    if resume is not None:
        resume_from = _latest_checkpoint(out_dir) if resume == "latest" else resume
        if resume_from is None:
            raise FileNotFoundError(f"--resume: no checkpoint-* folder in {out_dir}")
        log(f"[resume] from {resume_from}")

    # tokenizer and data: the main process builds them (and the cache), the others then load them
    t0 = time.time()
    with args.main_process_first(desc="tokenizer and data"):
        documents = load_split_documents(cfg)
        if is_main:
            tokenizer = get_tokenizer(cfg, documents[0], resume_from is not None, log)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(cfg["tokenizer"]["path"] or os.path.join(out_dir, "tokenizer"))
        data = prepare_data(cfg, tokenizer, documents, log)
    log(
        f"[data] {data['train_documents']} training documents -> {data['train_tokens']:,} tokens -> "
        f"{len(data['train'])} blocks of {cfg['data']['block_size']}; validation {data['validation_documents']} "
        f"documents -> {len(data['validation'])} blocks ({time.time() - t0:.1f}s)"
    )
    if prepare_only:
        return {"tokenizer": os.path.join(out_dir, "tokenizer"), "data_cache": data["cache"]}

    # model
    model_kwargs, match = resolve_model_config(
        cfg["model"], len(tokenizer), cfg["data"]["block_size"], _special_ids(tokenizer)
    )
    if model_kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"model.config.vocab_size={model_kwargs['vocab_size']} < the tokenizer's {len(tokenizer)}")
    config = build_config(cfg["model"]["family"], model_kwargs)
    set_seed(args.seed)
    model = build_model(config)
    params = count_parameters(model)
    expected = cfg["model"]["expected_num_parameters"]
    if expected is not None and expected != params["total"]:
        raise ValueError(
            f"model has {params['total']:,} parameters; the recipe states expected_num_parameters={expected:,}"
        )
    if match:
        log(
            f"[model] intermediate_size={match['intermediate_size']} matches {match['reference_family']}'s "
            f"{match['reference_num_parameters']:,} parameters ({match['num_parameters']:,})"
        )
    log(
        f"[model] {cfg['model']['family']} ({type(model).__name__}): {params['total']:,} parameters "
        f"({params['non_embedding']:,} without embeddings)"
    )

    tokens_per_step = (
        args.per_device_train_batch_size
        * args.gradient_accumulation_steps
        * args.world_size
        * cfg["data"]["block_size"]
    )
    metrics_cb = MetricsCallback(out_dir, tokens_per_step, cfg["run_name"])
    throughput_cb = ThroughputCallback(tokens_per_step)
    callbacks = [metrics_cb, throughput_cb, *callbacks]
    if stop_at_step is not None:
        callbacks.append(StopAtStepCallback(stop_at_step))
    prefetch_cb = None
    if cfg["fsdp_prefetch_layers"] is not None:
        prefetch_cb = FSDPPrefetchCallback(cfg["fsdp_prefetch_layers"])
        callbacks.append(prefetch_cb)
    # HfRbfTrainer: Trainer plus the model's no-decay parameters and the regularizer terms in the logs
    trainer = HfRbfTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=collate_blocks,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    t_train = time.time()
    train_result = trainer.train(resume_from_checkpoint=resume_from)
    train_seconds = time.time() - t_train
    throughput = throughput_cb.result()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    summary = {
        "run_name": cfg["run_name"],
        "family": cfg["model"]["family"],
        "model_type": config.model_type,
        "config_file": cfg["config_file"],
        "output_dir": os.path.abspath(out_dir),
        "num_parameters": params["total"],
        "num_parameters_non_embedding": params["non_embedding"],
        "parameter_matching": match or None,
        "model_config": {k: v for k, v in model_kwargs.items()},
        "block_size": cfg["data"]["block_size"],
        "vocab_size": len(tokenizer),
        "world_size": args.world_size,
        "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
        "tokens_per_step": tokens_per_step,
        "steps": trainer.state.global_step,
        "train_tokens": trainer.state.global_step * tokens_per_step,
        "train_data_tokens": data["train_tokens"],
        "epochs": trainer.state.epoch,
        "train_seconds": train_seconds,
        "train_runtime": train_result.metrics.get("train_runtime"),
        "tokens_per_second": throughput["tokens_per_second"],
        "throughput": throughput,
        "final_train_loss": losses[-1] if losses else None,  # the last logged loss (None if nothing was logged)
        "mean_train_loss": train_result.training_loss,
        "attention_backends": sorted(set(attention_backends(trainer.model))),
        # how the register rows ran (hf_rbf.modeling_decoder.register_path): "rows", "stream", "compiled (<mode>)"
        "register_path": getattr(getattr(trainer.model, "model", None), "last_register_path", None),
        # FSDP2 layers set to prefetch explicitly (fsdp_prefetch_layers); None: not asked, 0: no FSDP2 in this run
        "fsdp_prefetch_units": None if prefetch_cb is None else prefetch_cb.units,
        "device": str(args.device),
        "bf16": bool(args.bf16),
        "versions": _versions(),
        "resumed_from": resume_from,
    }
    if stop_at_step is not None and trainer.state.global_step < trainer.state.max_steps:
        summary["stopped_at_step"] = trainer.state.global_step
        if is_main:
            _write_json(os.path.join(out_dir, "summary.json"), summary)
        log(f"[stop] stopped at step {trainer.state.global_step} of {trainer.state.max_steps}; continue with --resume")
        return summary
    if train_only:
        summary["train_only"] = True
        summary["total_seconds"] = time.time() - t_start
        if is_main:
            _write_json(os.path.join(out_dir, "summary.json"), summary)
            log(
                f"[train-only] {summary['steps']} steps, {_fmt(summary['tokens_per_second'], ',.0f')} tokens/s, "
                f"final train loss {_fmt(summary['final_train_loss'], '.4f')}"
            )
        trainer.accelerator.wait_for_everyone()
        return summary

    last_eval = [row for row in trainer.state.log_history if "eval_loss" in row]
    if last_eval and last_eval[-1].get("step") == trainer.state.global_step:
        eval_metrics = last_eval[-1]  # the schedule already evaluated the final weights
    else:
        eval_metrics = trainer.evaluate()
    summary["eval_loss"] = eval_metrics["eval_loss"]
    summary["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
    summary["eval_tokens"] = len(data["validation"]) * cfg["data"]["block_size"]
    final_dir = os.path.join(out_dir, "final")
    trainer.model.config.use_cache = True  # Trainer turns it off for training; the saved model is for inference
    trainer.save_model(final_dir)
    summary["final_dir"] = os.path.abspath(final_dir)
    if is_main:
        tokenizer.save_pretrained(final_dir)
        summary.update(post_training(cfg, trainer, tokenizer, data, final_dir, log))
        summary["total_seconds"] = time.time() - t_start
        summary["bits_per_byte"] = summary.get("bpb", {}).get("bits_per_byte")
        summary["generation_prompt"] = (cfg["evaluation"].get("generation") or {}).get("prompt")
        _write_json(os.path.join(out_dir, "summary.json"), summary)
        print_summary(summary, log)
    trainer.accelerator.wait_for_everyone()
    return summary


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _check_word(check) -> str:
    return "not checked" if not check else "ok" if check.get("ok") else "FAILED"


def print_summary(s: dict, log=print) -> None:
    tps = f"{s['tokens_per_second']:,.0f}" if s.get("tokens_per_second") else "n/a"
    bpb = f"{s['bits_per_byte']:.4f}" if s.get("bits_per_byte") is not None else "n/a"
    check = s.get("remote_code_check", {})
    lines = [
        "=" * 78,
        (
            f"run            {s['run_name']}  ({s['family']}, {s['num_parameters']:,} parameters, "
            f"{s['num_parameters_non_embedding']:,} without embeddings)"
        ),
        (
            f"training       {s['steps']} steps x {s['tokens_per_step']:,} tokens = {s['train_tokens']:,} tokens in "
            f"{s['train_seconds']:.0f}s ({tps} tokens/s, {s['world_size']} process(es), {s['device']})"
        ),
        (
            f"final loss     train {_fmt(s['final_train_loss'], '.4f')}   validation {s['eval_loss']:.4f} "
            f"(perplexity {s['eval_perplexity']:.2f})"
        ),
        f"bits per byte  {bpb}",
        f"attention      {', '.join(s.get('attention_backends') or []) or 'n/a'} (kind:backend)",
        f"remote code    {'ok' if check.get('ok') else 'not checked' if not check else 'FAILED'}"
        + (" (logits and greedy generate with / without cache)" if check.get("ok") else ""),
        f"cached story   {_check_word(s.get('story_cache_check'))} (identical with and without the KV cache)",
        f"saved          {s['final_dir']}",
        f"total time     {s['total_seconds']:.0f}s",
        "=" * 78,
    ]
    log("\n".join(lines))


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides, output_dir=args.output_dir)
    summary = run(
        cfg,
        resume=args.resume,
        stop_at_step=args.stop_at_step,
        prepare_only=args.prepare_only,
        train_only=args.train_only,
    )
    for name in ("remote_code_check", "story_cache_check"):
        check = summary.get(name)
        if check is not None and not check.get("ok"):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
