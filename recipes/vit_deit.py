"""The DeiT training ingredients of the GKA paper's vision recipe (section 4.1), from timm, for recipes/train_vit.py.

The paper trains every ViT "following the DeiT recipe": RandAugment (n=2, m=9), random erasing (p=0.25), Mixup
(alpha=0.8) and CutMix (alpha=1.0) with label smoothing 0.1, repeated augmentation (3 repeats) and an EMA of the
weights (decay 0.99996) whose top-1 is the reported accuracy.  Each comes from timm (``pip install hf_rbf[deit]``),
switched on by its own option (:class:`DeitOptions`, filled from the recipe's YAML config or command line); with
every option at its "off" value nothing of timm is imported.

* RandAugment: :func:`timm.data.auto_augment.rand_augment_transform` on the PIL image (grayscale works: the fill
  colour is one channel; posterize to 0 bits, which recent Pillow refuses, gives a black image as it used to).
* Random erasing: :class:`timm.data.random_erasing.RandomErasing` on the normalised batch, per image ("pixel" mode:
  normal noise, as DeiT).
* Mixup / CutMix: :class:`timm.data.Mixup` on the batch (label smoothing moves into it; the labels become soft
  targets, so the Trainer's loss is :class:`timm.loss.SoftTargetCrossEntropy`; timm needs an even batch, so an odd
  last batch leaves its last image unmixed).
* Repeated augmentation: :class:`timm.data.distributed_sampler.RepeatAugSampler` (one replica: accelerate shards the
  batches across processes), ``selected_round=0`` so a small dataset still gives full epochs: an epoch has
  ``len(dataset)`` samples, each image repeated ``repeated_augmentation`` times (differently augmented).
* EMA: :class:`timm.utils.ModelEmaV3`, updated after every optimizer step by :class:`EmaCallback`; the recipe
  evaluates and saves the EMA model next to the raw one.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import TrainerCallback


@dataclasses.dataclass
class DeitOptions:
    """The switches; the "off" value of each is the default.  DeiT's values in brackets."""

    ema_decay: float = 0.0  # EMA of the weights [0.99996]; 0 = off
    rand_augment: str | None = None  # timm RandAugment config string ["rand-m9-mstd0.5-inc1"]; None = off
    random_erasing: float = 0.0  # probability [0.25]; 0 = off
    mixup_alpha: float = 0.0  # [0.8]; 0 = off
    cutmix_alpha: float = 0.0  # [1.0]; 0 = off
    mixup_prob: float = 1.0  # probability of mixing a batch at all
    mixup_switch_prob: float = 0.5  # probability of CutMix instead of Mixup when both are on
    repeated_augmentation: int = 0  # repeats [3]; 0 or 1 = off

    def __post_init__(self):
        for name in ("ema_decay", "random_erasing", "mixup_prob", "mixup_switch_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"DeitOptions: `{name}` must be a number in [0, 1]; got {value!r}")
        if self.ema_decay == 1.0:
            raise ValueError("DeitOptions: `ema_decay` must be < 1 (1 would never move the EMA); use 0 to turn it off")
        for name in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"DeitOptions: `{name}` must be a number >= 0 (0 = off); got {value!r}")
        r = self.repeated_augmentation
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"DeitOptions: `repeated_augmentation` must be an int >= 0 (0 or 1 = off); got {r!r}")
        if self.rand_augment is not None and (
            not isinstance(self.rand_augment, str) or not self.rand_augment.startswith("rand")
        ):
            raise ValueError(
                "DeitOptions: `rand_augment` must be None or a timm RandAugment string such as "
                f"'rand-m9-mstd0.5-inc1'; got {self.rand_augment!r}"
            )

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def uses_timm(self) -> bool:
        return (
            self.ema_decay > 0
            or self.rand_augment is not None
            or self.random_erasing > 0
            or self.mixes
            or self.repeated_augmentation > 1
        )


def require_timm():
    """Import timm, or say what to install (it is the ``deit`` extra, not a dependency of the models)."""
    try:
        import timm  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "recipes/train_vit.py: the DeiT options (ema_decay, rand_augment, random_erasing, mixup_alpha, "
            "cutmix_alpha, repeated_augmentation) use timm: pip install 'hf_rbf[deit]'"
        ) from e


def _posterize_keeping_zero_bits(img, bits_to_keep, **kwargs):
    """Posterize that accepts 0 bits (an all-black image, what Pillow gave before it started refusing 0): timm's
    increasing posterize reaches 0 bits at magnitude 10, which DeiT's "m9-mstd0.5" samples now and then, and recent
    Pillow raises there."""
    if bits_to_keep <= 0:
        from PIL import Image

        return Image.new(img.mode, img.size)
    from timm.data.auto_augment import posterize

    return posterize(img, bits_to_keep, **kwargs)


def rand_augment(config_str: str, image_size: int):
    """timm's RandAugment for ``image_size`` grayscale images (translations up to 45% of the side, as timm's
    ``create_transform``; fill 0, the background of MNIST)."""
    from timm.data.auto_augment import rand_augment_transform

    transform = rand_augment_transform(config_str, {"translate_const": int(image_size * 0.45), "img_mean": (0,)})
    for op in transform.ops:
        if op.name.startswith("Posterize"):
            op.aug_fn = _posterize_keeping_zero_bits
    return transform


def random_erasing(probability: float):
    """timm's RandomErasing on a normalised ``[B, C, H, W]`` batch (per-image decisions, normal-noise fill)."""
    from timm.data.random_erasing import RandomErasing

    return RandomErasing(probability=probability, mode="pixel", device="cpu")


class MixupBatch:
    """timm's Mixup / CutMix as the collator's ``batch_transform``: ``(pixels, labels) -> (mixed, soft targets)``."""

    def __init__(self, options: DeitOptions, num_classes: int, label_smoothing: float):
        from timm.data import Mixup

        self.mixup = Mixup(
            mixup_alpha=options.mixup_alpha,
            cutmix_alpha=options.cutmix_alpha,
            prob=options.mixup_prob,
            switch_prob=options.mixup_switch_prob,
            mode="batch",
            label_smoothing=label_smoothing,
            num_classes=num_classes,
        )

    def __call__(self, pixel_values: torch.Tensor, labels: torch.Tensor):
        if pixel_values.shape[0] % 2 == 0:
            return self.mixup(pixel_values, labels)
        # timm mixes a batch with its reverse and needs an even size: an odd batch (the epoch's last) mixes all but
        # its last image, which keeps its own (smoothed) target
        mixed, targets = self.mixup(pixel_values[:-1], labels[:-1])
        off = self.mixup.label_smoothing / self.mixup.num_classes
        last = torch.full((1, self.mixup.num_classes), off, dtype=targets.dtype, device=targets.device)
        last[0, labels[-1]] = 1.0 - self.mixup.label_smoothing + off
        return torch.cat([mixed, pixel_values[-1:]]), torch.cat([targets, last])


def soft_target_loss(outputs, labels, num_items_in_batch=None):
    """The Trainer's ``compute_loss_func`` under Mixup: timm's SoftTargetCrossEntropy on soft targets ``[B, K]``,
    plain cross-entropy on class indices (the evaluation batches, which are not mixed)."""
    from timm.loss import SoftTargetCrossEntropy

    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    if labels.dim() == 1:
        return F.cross_entropy(logits, labels)
    return SoftTargetCrossEntropy()(logits, labels)


def repeat_aug_sampler(dataset, repeats: int, seed: int):
    """timm's RepeatAugSampler over one replica (see the module docstring)."""
    from timm.data.distributed_sampler import RepeatAugSampler

    sampler = RepeatAugSampler(dataset, num_replicas=1, rank=0, shuffle=True, num_repeats=repeats, selected_round=0)
    sampler.set_epoch(seed)
    return sampler


class EmaCallback(TrainerCallback):
    """Keeps timm's ModelEmaV3 of the model, updated after every optimizer step; ``ema.module`` is the EMA model."""

    def __init__(self, model: torch.nn.Module, decay: float):
        from timm.utils import ModelEmaV3

        self.ema = ModelEmaV3(model, decay=decay)
        self.updates = 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.ema.update(model, step=state.global_step)
        self.updates += 1


__all__ = [
    "DeitOptions",
    "EmaCallback",
    "MixupBatch",
    "rand_augment",
    "random_erasing",
    "repeat_aug_sampler",
    "require_timm",
    "soft_target_loss",
]
