"""Train GKA and DeiT (dot-product) vision transformers on MNIST with the HF Trainer; report accuracy, parameters,
throughput and peak memory as JSON.

Data: the MNIST IDX files (``--data-dir``, e.g. ``/work/shared/data/images/mnist``) loaded through ``datasets``
(:func:`vit_data.load_mnist`).  Light augmentation: random translations of up to ``--max-shift`` pixels.  Recipe
(DeiT-style, shortened for MNIST): AdamW, weight decay 0.05 except on biases, norms, [CLS], positions and GKA's
log-sigma, linear warmup then cosine decay, stochastic depth 0.1, gradient clipping 1.0; bf16 autocast on a GPU.

Examples::

    # CPU quick run of both kinds on a subset (a few minutes)
    PYTHONPATH=$PWD python recipes/train_vit.py --data-dir /work/shared/data/images/mnist --quick \\
        --attention-type gka,dot --output-dir outputs/vit_quick
    # the GPU run (full 60k / 10k): see recipes/gpu_vit_mnist.sh

Writes ``<output-dir>/<kind>/results.json`` (and the trained model + image processor in ``<kind>/model``) for each
kind, and ``<output-dir>/summary.json`` / ``summary.md`` comparing them.

Kinds: "gka", "dot" (DeiT) and "vlt" (the paper's Value-Less Transformer ablation, Table 5).

``--config FILE.yaml`` sets any option by its name with underscores (``epochs: 10``, ``attention_type: gka,vlt``,
``mixup_alpha: 0.8``); options given on the command line win.  The DeiT ingredients of the paper's recipe (EMA,
RandAugment, random erasing, Mixup / CutMix, repeated augmentation) are timm's, each switched by its own option and
off by default (see :mod:`vit_deit`; ``recipes/configs/vit/mnist_deit.yaml`` turns them all on); with an EMA the
results also hold ``ema_test_accuracy`` and the EMA model is saved in ``<kind>/model_ema``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import resource
import sys
import time

import numpy as np
import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vit_data import MnistCollator, load_mnist  # noqa: E402
import vit_deit  # noqa: E402
from vit_deit import DeitOptions  # noqa: E402

from hf_rbf.configuration_gka_vit import ATTENTION_TYPES, GkaVitConfig  # noqa: E402
from hf_rbf.image_processing_gka_vit import GkaVitImageProcessor  # noqa: E402
from hf_rbf.modeling_gka_vit import (  # noqa: E402
    GkaVitForImageClassification,
    attention_parameter_count,
    mlp_parameter_count,
)


def build_trainer_class():
    from hf_rbf.trainer import HfRbfTrainer

    class VitTrainer(HfRbfTrainer):
        """HfRbfTrainer (the DeiT weight-decay exclusions the model lists) with an augmentation-free collator for
        evaluation."""

        def __init__(self, *args, eval_data_collator=None, train_sampler=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.eval_data_collator = eval_data_collator
            self.train_sampler = train_sampler

        def _get_train_sampler(self, *args, **kwargs):
            """The repeated-augmentation sampler when there is one (DeiT), else Trainer's."""
            if self.train_sampler is not None:
                return self.train_sampler
            return super()._get_train_sampler(*args, **kwargs)

        def evaluate(self, *args, **kwargs):
            if self.eval_data_collator is None:
                return super().evaluate(*args, **kwargs)
            train_collator, self.data_collator = self.data_collator, self.eval_data_collator
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                self.data_collator = train_collator

    return VitTrainer


def accuracy_metrics(eval_pred):
    logits, labels = eval_pred
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"accuracy": float((np.asarray(logits).argmax(-1) == np.asarray(labels)).mean())}


def parameter_report(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    return {
        "total": total,
        "attention": attention_parameter_count(model),
        "mlp": mlp_parameter_count(model),
        "other": total - attention_parameter_count(model) - mlp_parameter_count(model),
    }


@torch.no_grad()
def measure_inference(model, pixel_values: torch.Tensor, batch_size: int, device, use_bf16: bool, iters: int = 20):
    """Images/s and peak memory of the forward pass at ``batch_size`` (after warm-up), on ``device``."""
    model.eval()
    x = pixel_values[:batch_size]
    if x.shape[0] < batch_size:
        x = x.repeat(math.ceil(batch_size / x.shape[0]), 1, 1, 1)[:batch_size]
    x = x.to(device)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else torch.autocast(device.type, enabled=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with ctx:
        for _ in range(3):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    out = {"batch_size": batch_size, "images_per_s": batch_size * iters / dt}
    if device.type == "cuda":
        out["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def peak_rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if platform.system() == "Darwin" else r / 1024


def train_one(kind: str, args, train_ds, test_ds, out_dir: str) -> dict:
    from transformers import TrainingArguments, set_seed

    set_seed(args.seed)
    overrides = {"attention_type": kind, "drop_path_rate": args.drop_path}
    if args.log_sigma_init is not None:
        overrides["gka_log_sigma_init"] = args.log_sigma_init
    config = GkaVitConfig.from_preset(
        args.preset, id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)}, **overrides
    )
    model = GkaVitForImageClassification(config)
    processor = GkaVitImageProcessor(size=config.image_size, num_channels=config.num_channels)
    deit = args.deit
    train_collator = MnistCollator(processor, max_shift=args.max_shift, seed=args.seed)
    train_sampler = None
    if deit.uses_timm:
        vit_deit.require_timm()
        if deit.rand_augment is not None:
            train_collator.image_transform = vit_deit.rand_augment(deit.rand_augment, config.image_size)
        if deit.random_erasing > 0:
            train_collator.pixel_transform = vit_deit.random_erasing(deit.random_erasing)
        if deit.mixes:
            train_collator.batch_transform = vit_deit.MixupBatch(deit, config.num_labels, args.label_smoothing)
        if deit.repeated_augmentation > 1:
            train_sampler = vit_deit.repeat_aug_sampler(train_ds, deit.repeated_augmentation, args.seed)
    cuda = torch.cuda.is_available() and not args.cpu
    use_bf16 = cuda and torch.cuda.is_bf16_supported() and not args.no_bf16
    device = torch.device("cuda" if cuda else "cpu")

    targs = TrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_ratio,
        max_grad_norm=1.0,
        # under Mixup / CutMix the smoothing is part of the soft targets (timm's Mixup)
        label_smoothing_factor=0.0 if deit.mixes else args.label_smoothing,
        bf16=use_bf16,
        use_cpu=not cuda,
        eval_strategy="epoch" if args.eval_every_epoch else "no",
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=args.logging_steps,
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=args.num_workers,
        seed=args.seed,
        disable_tqdm=not args.progress,
    )
    trainer = build_trainer_class()(
        model=model,
        args=targs,
        train_dataset=train_ds,
        eval_dataset=test_ds,
        data_collator=train_collator,
        eval_data_collator=MnistCollator(processor, max_shift=0),
        compute_metrics=accuracy_metrics,
        train_sampler=train_sampler,
        compute_loss_func=vit_deit.soft_target_loss if deit.mixes else None,
    )
    ema = None
    if deit.ema_decay > 0:
        ema = vit_deit.EmaCallback(trainer.model, deit.ema_decay)  # after the Trainer placed the model
        trainer.add_callback(ema)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train_out = trainer.train()
    train_time = time.perf_counter() - t0
    train_peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    ev = trainer.evaluate(test_ds)

    eval_batch = MnistCollator(processor)([test_ds[i] for i in range(min(len(test_ds), args.throughput_batch_size))])
    inference = measure_inference(model, eval_batch["pixel_values"], args.throughput_batch_size, device, use_bf16)

    model_dir = os.path.join(out_dir, "model")
    trainer.save_model(model_dir)
    processor.save_pretrained(model_dir)
    ema_eval = {}
    if ema is not None:
        # the EMA weights through the same evaluation (the paper's reported top-1 is the EMA model's)
        ema_trainer = build_trainer_class()(
            model=ema.ema.module, args=targs, eval_dataset=test_ds, data_collator=MnistCollator(processor),
            compute_metrics=accuracy_metrics,
        )
        ema_eval = ema_trainer.evaluate(test_ds)
        ema_trainer.save_model(os.path.join(out_dir, "model_ema"))
        processor.save_pretrained(os.path.join(out_dir, "model_ema"))

    log_sigma = None
    if kind == "gka":
        log_sigma = [layer.attention.log_sigma.detach().float().cpu().tolist() for layer in model.vit.layers]
    steps = train_out.global_step
    result = {
        "attention_type": kind,
        "preset": args.preset,
        "config": {k: getattr(config, k) for k in ("image_size", "patch_size", "hidden_size", "num_hidden_layers",
                                                   "num_attention_heads", "intermediate_size", "drop_path_rate")},
        "parameters": parameter_report(model),
        "test_accuracy": ev.get("eval_accuracy"),
        "test_loss": ev.get("eval_loss"),
        "ema_test_accuracy": ema_eval.get("eval_accuracy"),
        "ema_test_loss": ema_eval.get("eval_loss"),
        "ema_updates": None if ema is None else ema.updates,
        "deit": dataclasses.asdict(deit),
        "train_examples": len(train_ds),
        "test_examples": len(test_ds),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "optimizer_steps": steps,
        "learning_rate": args.lr,
        "train_time_s": train_time,
        "train_images_per_s": len(train_ds) * args.epochs / train_time,
        "train_loss": train_out.training_loss,
        "train_peak_memory_mb": train_peak,
        "inference": inference,
        "process_peak_rss_mb": peak_rss_mb(),
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "bf16": use_bf16,
        "learned_log_sigma": log_sigma,
        "model_dir": os.path.abspath(model_dir),
        "log_history": trainer.state.log_history,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "datasets": __import__("datasets").__version__},
        "command": args.command,
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def summary_markdown(results: list[dict]) -> str:
    head = ("| model | params (M) | attn params (M) | test acc (%) | train img/s | inference img/s | "
            "train peak mem (MB) | inference peak mem (MB) | train time (s) |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = ""
    for r in results:
        def fmt(v, spec):
            return "n/a" if v is None else format(v, spec)

        rows += (
            f"| {r['attention_type']} ({r['preset']}) | {r['parameters']['total'] / 1e6:.3f} | "
            f"{r['parameters']['attention'] / 1e6:.3f} | "
            f"{fmt(None if r['test_accuracy'] is None else 100 * r['test_accuracy'], '.2f')} | "
            f"{r['train_images_per_s']:.0f} | {r['inference']['images_per_s']:.0f} | "
            f"{fmt(r['train_peak_memory_mb'], '.0f')} | {fmt(r['inference'].get('peak_memory_mb'), '.0f')} | "
            f"{r['train_time_s']:.0f} |\n"
        )
    return head + rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="a YAML file of option values (names with underscores)")
    ap.add_argument("--data-dir", default=os.environ.get("MNIST_DIR"), help="folder with the MNIST IDX files")
    ap.add_argument("--output-dir", default="outputs/vit_mnist")
    ap.add_argument("--attention-type", default="gka,dot", help="gka, vlt, dot, comma-separated")
    ap.add_argument("--preset", default="mnist", help="GkaVitConfig preset (mnist, mnist-tiny, ...)")
    ap.add_argument("--epochs", type=float, default=10)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--eval-batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup-ratio", type=float, default=0.1)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--max-shift", type=int, default=2, help="random translation augmentation, pixels")
    ap.add_argument("--log-sigma-init", type=float, default=None, help="GKA initial log sigma (default 0.5 log d)")
    ap.add_argument("--max-train-samples", type=int, default=None)
    ap.add_argument("--max-eval-samples", type=int, default=None)
    ap.add_argument("--throughput-batch-size", type=int, default=512)
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--logging-steps", type=int, default=50)
    ap.add_argument("--eval-every-epoch", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--progress", action="store_true", help="show the Trainer's progress bars")
    ap.add_argument("--cache-dir", default=None, help="datasets cache (default: $HF_HOME/datasets)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU quick run: 5000 train / 1000 test images, 2 epochs, batch 50, throughput batch 128")
    deit = ap.add_argument_group("DeiT (timm; each off by default, DeiT's value in brackets)")
    deit.add_argument("--ema-decay", type=float, default=0.0, help="EMA of the weights [0.99996]; 0 = off")
    deit.add_argument("--rand-augment", default=None, help="timm RandAugment string [rand-m9-mstd0.5-inc1]")
    deit.add_argument("--random-erasing", type=float, default=0.0, help="random erasing probability [0.25]")
    deit.add_argument("--mixup-alpha", type=float, default=0.0, help="Mixup alpha [0.8]; 0 = off")
    deit.add_argument("--cutmix-alpha", type=float, default=0.0, help="CutMix alpha [1.0]; 0 = off")
    deit.add_argument("--mixup-prob", type=float, default=1.0, help="probability of mixing a batch [1.0]")
    deit.add_argument("--mixup-switch-prob", type=float, default=0.5, help="CutMix instead of Mixup [0.5]")
    deit.add_argument("--repeated-augmentation", type=int, default=0, help="repeats of each image [3]; 0 = off")
    return ap


def apply_config_file(ap: argparse.ArgumentParser, argv) -> None:
    """``--config FILE``: its values become the parser's defaults, so the command line still overrides them."""
    pre, _ = ap.parse_known_args(argv)
    if pre.config is None:
        return
    import yaml

    with open(pre.config) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        ap.error(f"--config {pre.config}: expected a mapping of option names to values")
    options = {a.dest: a for a in ap._actions if a.dest not in ("help", "config")}
    unknown = sorted(set(values) - set(options))
    if unknown:
        ap.error(f"--config {pre.config}: unknown options {unknown}; allowed: {sorted(options)}")
    if isinstance(values.get("attention_type"), list):
        values["attention_type"] = ",".join(values["attention_type"])
    for key, value in values.items():
        action = options[key]
        if value is not None and action.type is not None and not isinstance(value, bool):
            value = action.type(value)
        ap.set_defaults(**{key: value})


def parse_args(argv=None):
    ap = build_parser()
    apply_config_file(ap, argv)
    args = ap.parse_args(argv)
    args.command = "recipes/train_vit.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.data_dir is None:
        ap.error("--data-dir (or $MNIST_DIR) is required: the folder with the MNIST IDX files")
    if args.quick:
        args.max_train_samples = args.max_train_samples or 5000
        args.max_eval_samples = args.max_eval_samples or 1000
        args.epochs = 2
        args.batch_size = 50
        args.throughput_batch_size = 128
        args.logging_steps = 10
    kinds = [k.strip() for k in args.attention_type.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ATTENTION_TYPES]
    if bad or not kinds:
        ap.error(f"--attention-type must be a comma-separated list of {', '.join(ATTENTION_TYPES)}; "
                 f"got {args.attention_type!r}")
    args.kinds = kinds
    try:
        args.deit = DeitOptions(
            ema_decay=args.ema_decay, rand_augment=args.rand_augment, random_erasing=args.random_erasing,
            mixup_alpha=args.mixup_alpha, cutmix_alpha=args.cutmix_alpha, mixup_prob=args.mixup_prob,
            mixup_switch_prob=args.mixup_switch_prob, repeated_augmentation=args.repeated_augmentation,
        )
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    train_ds = load_mnist(args.data_dir, "train", args.max_train_samples, cache_dir=args.cache_dir)
    test_ds = load_mnist(args.data_dir, "test", args.max_eval_samples, cache_dir=args.cache_dir)
    print(f"MNIST: {len(train_ds)} train / {len(test_ds)} test images from {args.data_dir}")
    results = []
    for kind in args.kinds:
        out_dir = os.path.join(args.output_dir, kind)
        os.makedirs(out_dir, exist_ok=True)
        r = train_one(kind, args, train_ds, test_ds, out_dir)
        print(f"[{kind}] test accuracy {r['test_accuracy']}, {r['parameters']['total']:,} parameters, "
              f"train {r['train_images_per_s']:.0f} img/s, inference {r['inference']['images_per_s']:.0f} img/s, "
              f"{r['train_time_s']:.0f}s")
        results.append(r)
    md = summary_markdown(results)
    print(md)
    with open(os.path.join(args.output_dir, "summary.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "log_history"} for r in results], f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
