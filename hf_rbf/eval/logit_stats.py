"""The largest attention logit of every layer and head: the measurement behind the RBF blog's stability claim.

The blog argues that RBF attention "naturally caps the logits": its score ``-gamma ||q - k||^2`` is at most 0, while
a dot-product score ``q.k / sqrt(d)`` grows with the norms (the growth QK-norm stops).  :func:`attention_logit_stats`
runs one forward pass and reports, per layer and head, the maximum pre-softmax logit over the query-key pairs the
layer's mask allows.  The logit is each kind's full score (as the blog writes it, not the shifted form the kernels
compute after dropping row constants), plus the key log-weights when the forward passes ``key_log_weights``:

* ``"dot"`` / ``"vlt"``: ``scale * q_i . k_j`` (``scale = 1 / sqrt(d)`` by default);
* ``"rbf"``: ``-gamma ||q_i - k_j||^2`` (at most 0);
* ``"gka"``: ``-||x_i - x_j||^2 / (2 sigma_h^2)`` (at most 0; also under ``gka_approximation``, whose kernel it
  approximates);
* ``"scalar"``: ``-(qs_i - ks_j)^2 / tau``; ``"hybrid"``: ``scale * q.k - (qs_i - ks_j)^2 / tau``.

How: inside the ``with`` block of :class:`record_attention_logits` the attention function each layer calls (looked
up in the modules of the layer's class and its bases, so remote-code models work too) is wrapped by a recorder that
computes the logits from the call's own arguments, then calls the original.  Outside the block nothing is wrapped:
training pays nothing.  The register rows' own call (registers attending to registers) counts as part of its layer.
The recorder materialises ``[B, H, Nq, Nk]`` logits per call: use evaluation-sized batches.

CLI::

    python -m hf_rbf.eval.logit_stats --model outputs/tinystories_rbf/final --text "Once upon a time" --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys

import torch

from ..attention_scalar import scalar_scores
from ..attention_utils import (
    allowed_mask,
    normalize_mask_args,
    per_head_param,
    per_query_param,
)

# the attention function each layer kind calls, by the name it has in the layer's module
KIND_FUNCTIONS = {
    "dot": ("dot_attention",),
    "vlt": ("dot_attention",),
    "rbf": ("rbf_attention",),
    "gka": ("gka_attention", "gka_attention_random_features"),
    "scalar": ("scalar_attention",),
    "hybrid": ("hybrid_attention",),
}


def _mask_of(op: str, args: dict, b: int, h: int, nq: int, nk: int, device):
    return normalize_mask_args(
        op,
        batch=b,
        heads=h,
        nq=nq,
        nk=nk,
        device=device,
        causal=args.get("causal", True),
        window=args.get("window"),
        num_prefix_keys=args.get("num_prefix_keys", 0),
        key_log_weights=args.get("key_log_weights"),
        attention_mask=args.get("attention_mask"),
    )


def _head_view(p, ct):
    return p if isinstance(p, float) else p.to(ct).view(1, -1, 1, 1)


def _keys(args: dict, ct) -> torch.Tensor:
    """The call's keys, with separate ``prefix_keys`` (rbf / hybrid: sink and registers read in place) in front."""
    k = args["k"].to(ct)
    prefix = args.get("prefix_keys")
    if prefix is not None:
        k = torch.cat([prefix.to(ct).expand(k.shape[0], -1, -1, -1), k], dim=2)
    return k


def call_logits(name: str, args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [B, H, Nq, Nk] float64, allowed [B|1, 1|H, Nq, Nk])`` of one call of attention function ``name``
    with its bound arguments ``args`` (the definitions in the module docstring)."""
    ct = torch.float64
    if name == "dot_attention":
        q, k = args["q"].to(ct), args["k"].to(ct)
        scale = args.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        logits = scale * (q @ k.transpose(-1, -2))
    elif name == "rbf_attention":
        q, k = args["q"].to(ct), _keys(args, ct)
        gamma = args.get("gamma")
        gamma = per_head_param(
            name, "gamma", 1.0 / math.sqrt(q.shape[-1]) if gamma is None else gamma, q.shape[1], q.device
        )
        dist = q.square().sum(-1, keepdim=True) + k.square().sum(-1).unsqueeze(-2) - 2.0 * q @ k.transpose(-1, -2)
        logits = -_head_view(gamma, ct) * dist.clamp_min(0.0)
    elif name in ("gka_attention", "gka_attention_random_features"):
        k = args["x"].to(ct)
        q = k if args.get("query") is None else args["query"].to(ct)
        prefix = args.get("prefix_features")  # registers read in place: in front of the features, not queries
        if prefix is not None:
            k = torch.cat([prefix.to(ct).expand(k.shape[0], -1, -1, -1), k], dim=2)
        log_sigma = per_head_param(name, "log_sigma", args["log_sigma"], k.shape[1], k.device, positive=False)
        inv_two_var = (
            0.5 * math.exp(-2.0 * log_sigma)
            if isinstance(log_sigma, float)
            else (0.5 * torch.exp(-2.0 * log_sigma.to(ct)).view(1, -1, 1, 1))
        )
        dist = q.square().sum(-1, keepdim=True) + k.square().sum(-1).unsqueeze(-2) - 2.0 * q @ k.transpose(-1, -2)
        logits = -inv_two_var * dist.clamp_min(0.0)
    elif name in ("scalar_attention", "hybrid_attention"):
        qs, ks = args["qs"], args["ks"]
        b, h, nq = qs.shape
        tau = per_query_param(name, "tau", args["tau"], b, h, nq, qs.device)
        logits = scalar_scores(qs, ks, tau, ct)
        if name == "hybrid_attention":
            q, k = args["q"].to(ct), _keys(args, ct)
            scale = args.get("scale")
            scale = per_head_param(name, "scale", 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, h, q.device)
            logits = logits + _head_view(scale, ct) * (q @ k.transpose(-1, -2))
    else:
        raise ValueError(f"logit_stats: no logit definition for the attention function {name!r}")
    b, h, nq, nk = logits.shape
    mask = _mask_of(name, args, b, h, nq, nk, logits.device)
    if mask.key_log_weights is not None:
        logits = logits + mask.key_log_weights.to(ct).unsqueeze(-2)
    return logits, allowed_mask(mask, logits.device)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of an hf_rbf decoder, in layer order (duck-typed: remote-code classes count too)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "kind", None), str) and hasattr(m, "layer_idx")]
    found = [m for m in found if m.kind]
    if not found:
        raise ValueError(
            f"logit_stats: {type(model).__name__} has no hf_rbf attention layers (modules with `kind` and "
            "`layer_idx`, as every hf_rbf decoder family has)"
        )
    unknown = sorted({m.kind for m in found} - set(KIND_FUNCTIONS))
    if unknown:
        raise ValueError(
            f"logit_stats: layer kinds {unknown} have no logit definition; known: {sorted(KIND_FUNCTIONS)}"
        )
    return sorted(found, key=lambda m: m.layer_idx)


class record_attention_logits:
    """Context manager: while open, every attention call of ``model`` updates the per-(layer, head) maximum logit.

    ``stats`` (after the block): one dict per layer, ``{"layer", "kind", "max_logit", "max_logit_per_head",
    "max_spread", "max_spread_per_head", "calls"}``.  ``max_spread`` is the largest within-row range
    ``max_j s_ij - min_j s_ij`` over the allowed keys: what the softmax actually sees (it ignores a row's constant), so
    it compares kinds whose logits sit at different offsets (RBF's are shifted down by ``gamma ||q||^2``).  Values are
    None for a layer that made no recorded call (e.g. a decode step through a sorted cache, which reads the cache by
    its own kernel).
    """

    def __init__(self, model: torch.nn.Module):
        self.modules = _attention_modules(model)
        self._current = None
        self._max = {}
        self._spread = {}
        self._calls = {}
        self._patches = []
        self._hooks = []

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)
        recorder = self

        def recorded(*args, **kwargs):
            if recorder._current is not None:
                bound = signature.bind(*args, **kwargs)
                with torch.no_grad():
                    logits, allowed = call_logits(name, dict(bound.arguments))
                    allowed = allowed.expand_as(logits)
                    row_max = logits.masked_fill(~allowed, float("-inf")).amax(dim=-1)
                    row_min = logits.masked_fill(~allowed, float("inf")).amin(dim=-1)
                    spread = (row_max - row_min).masked_fill(~allowed.any(dim=-1), float("-inf")).amax(dim=(0, 2))
                    per_head = row_max.amax(dim=(0, 2))
                idx = recorder._current.layer_idx
                for store, value in ((recorder._max, per_head), (recorder._spread, spread)):
                    prev = store.get(idx)
                    store[idx] = value if prev is None else torch.maximum(prev, value)
                recorder._calls[idx] = recorder._calls.get(idx, 0) + 1
            return original(*args, **kwargs)

        recorded.__wrapped__ = original
        return recorded

    def __enter__(self):
        namespaces = {}
        for module in self.modules:
            # the modules of the class and its bases: a kind's forward may live in a base class's module and call
            # a helper of the subclass's module (hybrid-sort layers)
            for cls in type(module).__mro__:
                namespace = vars(sys.modules[cls.__module__])
                for fname in KIND_FUNCTIONS[module.kind]:
                    if callable(namespace.get(fname)):
                        namespaces.setdefault((id(namespace), fname), (namespace, fname))
        for namespace, fname in namespaces.values():
            original = namespace[fname]
            self._patches.append((namespace, fname, original))
            namespace[fname] = self._wrap(fname, original)
        for module in self.modules:
            self._hooks.append(module.register_forward_pre_hook(self._enter_layer))
            self._hooks.append(module.register_forward_hook(self._leave_layer))
        return self

    def _enter_layer(self, module, args):
        self._current = module

    def _leave_layer(self, module, args, output):
        self._current = None

    def __exit__(self, *exc):
        for namespace, fname, original in reversed(self._patches):
            namespace[fname] = original
        for hook in self._hooks:
            hook.remove()
        self._patches, self._hooks, self._current = [], [], None
        return False

    @property
    def stats(self) -> list[dict]:
        out = []
        for module in self.modules:
            per_head = self._max.get(module.layer_idx)
            spread = self._spread.get(module.layer_idx)
            out.append(
                {
                    "layer": module.layer_idx,
                    "kind": module.kind,
                    "max_logit": None if per_head is None else float(per_head.max()),
                    "max_logit_per_head": None if per_head is None else [float(v) for v in per_head],
                    "max_spread": None if spread is None else float(spread.max()),
                    "max_spread_per_head": None if spread is None else [float(v) for v in spread],
                    "calls": self._calls.get(module.layer_idx, 0),
                }
            )
        return out


@torch.no_grad()
def attention_logit_stats(model: torch.nn.Module, **inputs) -> list[dict]:
    """One forward of ``model(**inputs, use_cache=False)`` (eval mode, no grad) and its per-layer, per-head maximum
    attention logits (see :class:`record_attention_logits` for the result's layout)."""
    was_training = model.training
    model.eval()
    try:
        with record_attention_logits(model) as recorder:
            model(**inputs, use_cache=False)
    finally:
        model.train(was_training)
    return recorder.stats


def format_stats(stats: list[dict]) -> str:
    """A plain-text table: one row per layer."""
    lines = ["layer  kind    max logit  max spread  per head (max logit / spread)"]
    for s in stats:
        if s["max_logit"] is None:
            lines.append(f"{s['layer']:>5}  {s['kind']:<6}  {'n/a':>9}  {'n/a':>10}  n/a")
            continue
        heads = " ".join(f"{m:.3f}/{w:.3f}" for m, w in zip(s["max_logit_per_head"], s["max_spread_per_head"]))
        lines.append(f"{s['layer']:>5}  {s['kind']:<6}  {s['max_logit']:>9.4f}  {s['max_spread']:>10.4f}  {heads}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description="Per-layer, per-head maximum attention logit of an hf_rbf model.")
    ap.add_argument("--model", required=True, help="a checkpoint folder or hub id (AutoModelForCausalLM)")
    ap.add_argument("--text", action="append", required=True, help="input text (repeat for a batch)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--json", default=None, help="also write the stats here")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rbf  # noqa: F401  (registers the model types)

    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    batch = tokenizer(args.text, return_tensors="pt", padding=True, truncation=True, max_length=args.max_length)
    stats = attention_logit_stats(model, **batch)
    print(format_stats(stats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=1)
    return stats


if __name__ == "__main__":
    main()


__all__ = ["attention_logit_stats", "call_logits", "format_stats", "record_attention_logits"]
