"""Captured mass while training: the gist's primary metric ("monitor inference approximation error directly: the
fraction of combined attention mass captured by top-k nearest scalar neighbors") as a ``transformers``
``TrainerCallback`` that measures it on a held-out batch every ``N`` optimizer steps and logs it through
``Trainer.log`` (so it lands in ``log_history``, TensorBoard, W&B, ... like the loss).

The measurement is :func:`batch_captured_mass`: for every full-attention "scalar" / "hybrid" layer, the exact
attention weights of the last ``num_queries`` positions (``ScalarSortAttention.attention_weights``) and the share of
each query's mass inside the window the sorted cache would read (:func:`hf_rbf.eval.captured_mass.captured_mass`,
plus the always-read prefix: sink, registers).  Not imported by any model file::

    from hf_rbf.eval.captured_mass_callback import CapturedMassCallback
    trainer = HfRbfTrainer(model=model, args=args, train_dataset=train, data_collator=collate)
    CapturedMassCallback(held_out_ids, every_n_steps=200, windows=(16, 64)).attach(trainer)
    trainer.train()   # logs captured_mass_k16, captured_mass_k64, ..._worst_head, captured_mass_prefix
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from .captured_mass import captured_mass, order_keys_for

SORT_SCHEMES = ("per_head", "sort_head")


def sorted_lm(model):
    """The scalar-sort / hybrid-sort model inside ``model`` (itself, or under PEFT / DDP wrappers): the first module
    whose ``model.layers`` have attention layers with ``attention_weights``."""
    for module in model.modules():
        layers = getattr(getattr(module, "model", None), "layers", None)
        if layers is not None and any(hasattr(layer.self_attn, "attention_weights") for layer in layers):
            return module
    raise ValueError(
        f"captured mass: `model` ({type(model).__name__}) holds no scalar-sort / hybrid-sort model (no decoder layer "
        "with scalar or hybrid attention)"
    )


def layer_call_states(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden [B, N, D], registers [1, R, D] or None)``: the text and register states a decoder layer was called
    with, as a forward pre-hook sees the call (``DecoderModel`` passes them positionally, views of its flat rows)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    registers = args[1] if len(args) > 1 else kwargs.get("register_states")
    return hidden, registers


def _check_windows(windows) -> list[int]:
    ok = isinstance(windows, (list, tuple)) and len(windows) > 0
    ok = ok and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in windows)
    if not ok:
        raise ValueError(f"captured mass: `windows` must be a non-empty list of ints >= 1; got {windows!r}")
    return sorted(set(windows))


@torch.no_grad()
def batch_captured_mass(
    model,
    input_ids: torch.Tensor,
    windows=(16, 64),
    *,
    num_queries: int = 64,
    sort_scheme: str | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict:
    """Captured mass of the sorted cache's window on one batch of unpadded sequences.

    Args:
        model: a scalar-sort / hybrid-sort causal LM (or a wrapper around one); run in eval mode here, its mode
            restored afterwards.
        input_ids: ``[B, N]`` token ids (no padding: a batch of held-out text blocks).
        windows: the window sizes ``k``.
        num_queries: the last ``min(num_queries, N)`` positions are the queries (they see the most keys).
        sort_scheme: "per_head" or "sort_head" (default: the config's ``sort_scheme``; ``sort_head`` from the config).
        attention_mask: optional, must be all ones (padding would put padded keys into the windows).

    Returns:
        ``{"per_head": {k: [L, H] float32}, "mean": {k: float}, "worst_head": {k: float}, "prefix": float,
        "layers": [layer indices measured]}``: per measured layer and head (heads without a scalar term are NaN) the
        mean over sequences and queries; its mean over layers and scalar heads; the smallest head mean; the mean mass
        on the prefix (sink, registers).
    """
    windows = _check_windows(windows)
    if not isinstance(num_queries, int) or isinstance(num_queries, bool) or num_queries < 1:
        raise ValueError(f"captured mass: `num_queries` must be an int >= 1; got {num_queries!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"captured mass: `input_ids` must be a [B, N] tensor; got {type(input_ids).__name__}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("captured mass: `attention_mask` has padding; pass unpadded sequences (equal-length blocks)")
    lm = sorted_lm(model)
    scheme = lm.config.sort_scheme if sort_scheme is None else sort_scheme
    if scheme not in SORT_SCHEMES:
        raise ValueError(f"captured mass: `sort_scheme` must be one of {SORT_SCHEMES}; got {scheme!r}")
    device = next(lm.parameters()).device
    input_ids = input_ids.to(device)
    n = input_ids.shape[1]
    rows = torch.arange(n - min(num_queries, n), n, device=device)

    captured: dict[int, tuple] = {}

    def hook(idx):
        def keep(module, args, kwargs):
            captured.setdefault(idx, (args, kwargs))

        return keep

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(lm.model.layers)]
    was_training = lm.training
    lm.eval()
    try:
        lm(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        lm.train(was_training)

    per_head = {k: [] for k in windows}
    prefix_mass, measured = [], []
    for idx, layer in enumerate(lm.model.layers):
        attn = layer.self_attn
        if not hasattr(attn, "attention_weights") or attn.window is not None or not any(attn.scalar_head_list):
            continue  # "dot" layers and sliding layers have no sorted window
        args, kwargs = captured[idx]
        hidden, registers = layer_call_states(args, kwargs)
        x = layer.input_layernorm(hidden)
        rx = layer.input_layernorm.capped(registers) if registers is not None else None
        weights, qs, ks, p = attn.attention_weights(x, rx, kwargs["position_embeddings"], rows)
        heads = torch.tensor(attn.scalar_head_list, device=weights.device)
        sums = {k: torch.zeros(attn.num_heads, device=weights.device) for k in windows}
        for b in range(input_ids.shape[0]):
            order = order_keys_for(ks[b], scheme, attn.num_value_groups, lm.config.sort_head)
            mass = captured_mass(weights[b], p, order, qs[b], rows, windows)
            for k in windows:
                sums[k] += mass[k].mean(-1)
        for k in windows:
            head_mean = (sums[k] / input_ids.shape[0]).masked_fill(~heads, float("nan"))
            per_head[k].append(head_mean.float().cpu())
        prefix_mass.append(weights[:, heads, :, :p].sum(-1).mean().item() if p else 0.0)
        measured.append(idx)
    if not measured:
        raise ValueError("captured mass: the model has no full-attention scalar or hybrid layer to measure")
    table = {k: torch.stack(v) for k, v in per_head.items()}
    return {
        "per_head": table,
        "mean": {k: float(t[~t.isnan()].mean()) for k, t in table.items()},
        "worst_head": {k: float(t[~t.isnan()].min()) for k, t in table.items()},
        "prefix": sum(prefix_mass) / len(prefix_mass),
        "layers": measured,
    }


class CapturedMassCallback(TrainerCallback):
    """Every ``every_n_steps`` optimizer steps (and at the last step), measure :func:`batch_captured_mass` on
    ``input_ids`` (a held-out batch) and log ``{prefix}_k{k}`` (mean over layers, scalar heads, sequences, queries),
    ``{prefix}_k{k}_worst_head`` and ``{prefix}_prefix`` (the mass on sink and registers) through ``Trainer.log``.

    ``Trainer`` gives callbacks no handle on itself, and logging through it is what makes the numbers reach
    ``log_history`` and every reporting integration; so the callback is attached with :meth:`attach` (which adds it
    to the trainer) rather than passed in ``callbacks=``.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        every_n_steps: int = 100,
        windows=(16, 64),
        *,
        num_queries: int = 64,
        sort_scheme: str | None = None,
        prefix: str = "captured_mass",
    ):
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"CapturedMassCallback: `every_n_steps` must be an int >= 1; got {every_n_steps!r}")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
            raise ValueError("CapturedMassCallback: `input_ids` must be a non-empty [B, N] tensor of token ids")
        if sort_scheme is not None and sort_scheme not in SORT_SCHEMES:
            raise ValueError(f"CapturedMassCallback: `sort_scheme` must be one of {SORT_SCHEMES}; got {sort_scheme!r}")
        self.input_ids = input_ids
        self.every_n_steps = every_n_steps
        self.windows = _check_windows(windows)
        self.num_queries = num_queries
        self.sort_scheme = sort_scheme
        self.prefix = prefix
        self.trainer = None
        self.last = None  # the last measurement (batch_captured_mass's dict)

    def attach(self, trainer) -> CapturedMassCallback:
        """Add this callback to ``trainer`` and log through it; returns ``self``."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def metrics(self, model) -> dict[str, float]:
        """Measure now and return the log entries."""
        self.last = batch_captured_mass(
            model, self.input_ids, self.windows, num_queries=self.num_queries, sort_scheme=self.sort_scheme
        )
        logs = {}
        for k in self.windows:
            logs[f"{self.prefix}_k{k}"] = round(self.last["mean"][k], 6)
            logs[f"{self.prefix}_k{k}_worst_head"] = round(self.last["worst_head"][k], 6)
        logs[f"{self.prefix}_prefix"] = round(self.last["prefix"], 6)
        return logs

    def on_step_end(self, args, state, control, model=None, **kwargs):
        due = state.global_step % self.every_n_steps == 0 or state.global_step >= state.max_steps
        if not due:
            return
        if self.trainer is None:
            raise RuntimeError(
                "CapturedMassCallback: attach it with `callback.attach(trainer)` (it logs through Trainer.log), not "
                "through `callbacks=`"
            )
        self.trainer.log(self.metrics(model if model is not None else self.trainer.model))


__all__ = ["CapturedMassCallback", "batch_captured_mass", "layer_call_states", "sorted_lm"]
