"""``HfRbfTrainer``: a ``transformers.Trainer`` with the additions that hf_rbf models need, and a callback for FSDP2.

1. **No weight decay on the kernel's own parameters.**  ``Trainer`` decays every parameter except biases and norms.
   For distance-based attention that is wrong for the per-head log bandwidths / log gammas / temperatures (decay pulls
   ``log sigma`` to 0, i.e. sigma to 1, whatever the features' scale), the SuSiE weights, the register tokens and their
   positions, the scalar sink's value, and the ViT's CLS token and position embeddings (the GKA paper disables decay for
   exactly these).  A model lists them as regular expressions in ``_no_weight_decay_patterns``;
   :meth:`HfRbfTrainer.get_decay_parameter_names` (``Trainer``'s override point) leaves them out.  Models without the
   attribute (e.g. ``LlamaForCausalLM``) keep ``Trainer``'s rule.
2. **The regularizer terms in the logs.**  ``Trainer`` logs only ``loss``.  The scalar-sort and hybrid-sort models return ``align_loss``, ``spread_loss`` and
``tau_loss`` (unweighted, detached) in their output (:class:`~hf_rbf.ScalarSortCausalLMOutput`);
:class:`HfRbfTrainer` collects them in ``compute_loss`` (the documented override point) and adds their
means since the last log to every training log (``log_history``, TensorBoard, W&B, ...), averaged over processes.
The optimised loss is the model's ``loss`` unchanged.
3. **The regularizer schedule.**  The scalar-sort and hybrid-sort configs can start each regularizer at a given
   optimizer step and warm its weight up linearly (``*_loss_start_step``, ``*_loss_warmup_steps``: the gist's advice to
   weight ``L_align`` first and add ``L_spread`` later).  Before every forward, :class:`HfRbfTrainer` tells the model
   ``state.global_step`` (``set_regularizer_step``, found through PEFT or other wrappers), and while a schedule is set
   it logs the current weights (``align_loss_weight``, ...) with the terms.

4. **FSDP2 all-gathers issued early** (:class:`FSDPPrefetchCallback`).  Under ``fully_shard`` (accelerate's FSDP2)
   each decoder layer all-gathers its parameters when its forward starts on the host.  A model whose step is bound by
   host work (small layers, many launches: our families at d768, unlike Llama) reaches that point only when the GPU has
   already finished the previous layer, so every all-gather is waited for.  The callback makes each layer issue the
   all-gathers of the next ``layers`` layers (forward) and of the previous ones (backward) itself
   (``FSDPModule.set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``), one layer earlier on the
   host; ``layers >= 2`` keeps more layers gathered at once (more memory).  Without FSDP2 it does nothing.

Not imported by any model file (remote-code checkpoints do not need it)::

    from hf_rbf.trainer import HfRbfTrainer
    trainer = HfRbfTrainer(model=model, args=args, train_dataset=ds, data_collator=collate)
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

logger = logging.getLogger(__name__)


def no_weight_decay_patterns(model) -> tuple[str, ...]:
    """The ``_no_weight_decay_patterns`` of the first module in ``model`` that has them (so PEFT or other wrappers
    around an hf_rbf model are seen through), or ``()``."""
    for module in model.modules():
        patterns = getattr(type(module), "_no_weight_decay_patterns", None)
        if patterns is not None:
            return tuple(patterns)
    return ()


def scheduled_models(model) -> list:
    """The modules of ``model`` (itself included, wrappers seen through) that take the regularizer step
    (``set_regularizer_step``: the scalar-sort and hybrid-sort causal LMs)."""
    return [module for module in model.modules() if callable(getattr(module, "set_regularizer_step", None))]


class HfRbfTrainer(Trainer):
    """``Trainer`` plus the model's no-decay parameters and the logging of ``log_fields`` from the model output
    (means over the micro-batches since the last training log; a field the model leaves as None is not logged)."""

    log_fields = ("align_loss", "spread_loss", "tau_loss")

    def get_decay_parameter_names(self, model) -> list[str]:
        names = super().get_decay_parameter_names(model)
        patterns = [re.compile(p) for p in no_weight_decay_patterns(model)]
        return [n for n in names if not any(p.search(n) for p in patterns)]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._term_sums: dict[str, torch.Tensor] = {}
        self._term_counts: dict[str, int] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        for module in self._scheduled_models(model):
            module.set_regularizer_step(self.state.global_step)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            for name in self.log_fields:
                value = outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name, None)
                if value is None:
                    continue
                value = value.detach().float()
                self._term_sums[name] = self._term_sums.get(name, 0.0) + value
                self._term_counts[name] = self._term_counts.get(name, 0) + 1
        return (loss, outputs) if return_outputs else loss

    def _scheduled_models(self, model) -> list:
        if getattr(self, "_scheduled_cache", (None,))[0] is not model:
            self._scheduled_cache = (model, scheduled_models(model))
        return self._scheduled_cache[1]

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:
            for module in self._scheduled_models(self.model)[:1]:
                if module.config.regularizer_schedule_enabled:
                    for name, weight in module.regularizer_weights().items():
                        logs[f"{name}_loss_weight"] = weight
        if "loss" in logs and self._term_sums:
            for name, total in self._term_sums.items():
                mean = total / self._term_counts[name]
                mean = self.accelerator.reduce(mean.to(self.accelerator.device), reduction="mean")
                logs[name] = round(float(mean), 6)
            self._term_sums, self._term_counts = {}, {}
        super().log(logs, *args, **kwargs)


def fsdp_layer_units(model: nn.Module) -> list:
    """The FSDP2 units (``fully_shard``-ed modules) of ``model``'s layer stack, in forward order: the children of the
    first ``nn.ModuleList`` that holds any (a causal LM's ``model.layers``, wrappers such as PEFT seen through), or
    ``[]`` when nothing is sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units = [child for child in module if isinstance(child, FSDPModule)]
            if units:
                return units
    return []


def _check_prefetch_layers(layers, who: str) -> None:
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{who}: layers must be an integer >= 1; got {layers!r}")


def set_fsdp_prefetch(model: nn.Module, layers: int) -> int:
    """Explicit FSDP2 prefetching over ``model``'s layer stack: layer ``i`` issues the all-gathers of layers ``i+1 ..
    i+layers`` after its own in forward, and of ``i-1 .. i-layers`` in backward.  Returns the number of layers set (0
    without FSDP2)."""
    _check_prefetch_layers(layers, "FSDP prefetch")
    units = fsdp_layer_units(model)
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + layers])
        unit.set_modules_to_backward_prefetch(units[max(0, i - layers) : i][::-1])
    return len(units)


class FSDPPrefetchCallback(TrainerCallback):
    """Sets :func:`set_fsdp_prefetch` on the trained model once ``Trainer`` has sharded it (``on_train_begin`` runs
    after ``accelerator.prepare``); ``self.units``: how many layers it set (0: the model is not under FSDP2)."""

    def __init__(self, layers: int = 1):
        _check_prefetch_layers(layers, "FSDPPrefetchCallback")
        self.layers = layers
        self.units = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.units = set_fsdp_prefetch(model, self.layers) if model is not None else 0
        if self.units:
            logger.info("FSDP2: %d layers prefetch the all-gathers of %d layer(s) ahead", self.units, self.layers)


__all__ = [
    "FSDPPrefetchCallback",
    "HfRbfTrainer",
    "fsdp_layer_units",
    "no_weight_decay_patterns",
    "scheduled_models",
    "set_fsdp_prefetch",
]
