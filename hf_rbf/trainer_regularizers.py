"""A ``transformers.Trainer`` that also logs the regularizer terms a model reports next to its loss.

``Trainer`` logs only ``loss``.  The scalar-sort and hybrid-sort models return ``align_loss``, ``spread_loss`` and
``tau_loss`` (unweighted, detached) in their output (:class:`~hf_rbf.ScalarSortCausalLMOutput`);
:class:`RegularizerLoggingTrainer` collects them in ``compute_loss`` (the documented override point) and adds their
means since the last log to every training log (``log_history``, TensorBoard, W&B, ...), averaged over processes.
The optimised loss is the model's ``loss`` unchanged.

Not imported by any model file (remote-code checkpoints do not need it)::

    from hf_rbf.trainer_regularizers import RegularizerLoggingTrainer
    trainer = RegularizerLoggingTrainer(model=model, args=args, train_dataset=ds, data_collator=collate)
"""

from __future__ import annotations

import torch
from transformers import Trainer


class RegularizerLoggingTrainer(Trainer):
    """``Trainer`` plus the logging of ``log_fields`` from the model output (means over the micro-batches since the
    last training log; a field the model leaves as None is not logged)."""

    log_fields = ("align_loss", "spread_loss", "tau_loss")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._term_sums: dict[str, torch.Tensor] = {}
        self._term_counts: dict[str, int] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
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

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._term_sums:
            for name, total in self._term_sums.items():
                mean = total / self._term_counts[name]
                mean = self.accelerator.reduce(mean.to(self.accelerator.device), reduction="mean")
                logs[name] = round(float(mean), 6)
            self._term_sums, self._term_counts = {}, {}
        super().log(logs, *args, **kwargs)


__all__ = ["RegularizerLoggingTrainer"]
