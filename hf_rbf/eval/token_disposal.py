"""Emergent token disposal (the scalar sort gist: "with L_align active ... ignored tokens drift toward peripheral
regions of scalar space that no query occupies; at inference, binary search for any query never reaches them"):
how far each key lies from the queries that could read it, per layer and head, split by token class.

For a key at position ``j`` of a scalar head, the queries that can read it are the positions ``t >= j`` (``causal``,
within the layer's sliding window if it has one; all valid positions of the sequence with ``causal=False``).  Per key:

* ``distance``: ``min_t |ks_j - qs_t|``, the gap to the nearest such query scalar;
* ``outside``: whether ``ks_j`` lies outside ``[min_t qs_t, max_t qs_t]`` (the range no query of the sequence covers:
  the gist's "peripheral cold zone");
* ``scaled_distance``: ``distance / sqrt(tau)`` with the head's mean temperature over those queries, the gap in
  kernel widths (the kernel weight of the nearest query is ``exp(-scaled_distance^2)``).

:func:`disposal_stats` computes them from scalar queries and keys; :func:`token_disposal` runs a model on a batch
and reports, per measured layer, head and token class, the mean and median distance, the mean scaled distance, the
fraction outside the query range and the number of keys.  Classes are sets of token ids (:func:`frequency_classes`
and :func:`punctuation_token_ids` build the usual ones); keys in no class form ``"rest"``.  Not imported by any model
file.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

import torch

from .captured_mass_callback import layer_call_states, sorted_lm

STATS = ("distance_mean", "distance_median", "scaled_distance_mean", "outside_fraction")


def _reachable(n: int, causal: bool, window: int | None, valid: torch.Tensor) -> torch.Tensor:
    """``[N keys, N queries]`` bool: query ``t`` can read key ``j``."""
    j = torch.arange(n, device=valid.device).view(-1, 1)
    t = torch.arange(n, device=valid.device).view(1, -1)
    ok = valid.view(-1, 1) & valid.view(1, -1)
    if causal:
        ok = ok & (t >= j)
        if window is not None:
            ok = ok & (t - j < window)
    return ok


def disposal_stats(
    qs: torch.Tensor,
    ks: torch.Tensor,
    classes: dict[str, torch.Tensor],
    *,
    tau: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    causal: bool = True,
    window: int | None = None,
) -> dict[str, dict]:
    """Per class: ``{stat: [H] float64, "count": int}`` (stats as in the module docstring; NaN for a class with no
    key).

    Args:
        qs, ks: ``[H, N]`` scalar queries and keys of one sequence.
        classes: name -> ``[N]`` bool, which keys belong to the class.
        tau: ``[H]`` or ``[H, N]`` (per query) temperatures, for ``scaled_distance_mean`` (NaN without).
        valid: ``[N]`` real tokens (padding is neither key nor query).
        causal, window: which queries read a key (see the module docstring).
    """
    h, n = ks.shape
    f64 = torch.float64
    qs, ks = qs.to(f64), ks.to(f64)
    valid = torch.ones(n, dtype=torch.bool, device=ks.device) if valid is None else valid.to(torch.bool)
    reach = _reachable(n, causal, window, valid)  # [N, N]
    has_query = reach.any(-1)  # keys some query reads
    gap = (ks.unsqueeze(-1) - qs.unsqueeze(-2)).abs().masked_fill(~reach, float("inf"))  # [H, Nk, Nq]
    distance = gap.amin(-1)
    low = qs.unsqueeze(-2).masked_fill(~reach, float("inf")).amin(-1)
    high = qs.unsqueeze(-2).masked_fill(~reach, float("-inf")).amax(-1)
    outside = ((ks < low) | (ks > high)).to(f64)
    if tau is None:
        scaled = torch.full_like(distance, float("nan"))
    else:
        tau = tau.to(f64).to(ks.device)
        per_query = tau.view(h, 1).expand(h, n) if tau.dim() == 1 else tau
        mean_tau = (per_query.unsqueeze(-2) * reach).sum(-1) / reach.sum(-1).clamp_min(1)  # [H, Nk]
        scaled = distance / mean_tau.sqrt()
    out = {}
    for name, members in classes.items():
        keys = members.to(torch.bool).to(ks.device) & has_query
        count = int(keys.sum())
        if count == 0:
            nan = torch.full((h,), float("nan"), dtype=f64)
            out[name] = {stat: nan.clone() for stat in STATS} | {"count": 0}
            continue
        d = distance[:, keys]
        out[name] = {
            "distance_mean": d.mean(-1).cpu(),
            "distance_median": d.median(-1).values.cpu(),
            "scaled_distance_mean": scaled[:, keys].mean(-1).cpu(),
            "outside_fraction": outside[:, keys].mean(-1).cpu(),
            "count": count,
        }
    return out


def _class_masks(input_ids: torch.Tensor, token_classes: dict[str, Iterable[int]]) -> dict[str, torch.Tensor]:
    if not isinstance(token_classes, dict) or not token_classes:
        raise ValueError("token_disposal: `token_classes` must be a non-empty dict name -> token ids")
    if "rest" in token_classes:
        raise ValueError("token_disposal: `token_classes` may not name a class 'rest' (the tokens in no class)")
    masks, any_class = {}, torch.zeros_like(input_ids, dtype=torch.bool)
    for name, ids in token_classes.items():
        ids = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.long)
        mask = torch.isin(input_ids, ids.to(input_ids.device))
        masks[name] = mask
        any_class |= mask
    masks["rest"] = ~any_class
    return masks


@torch.no_grad()
def token_disposal(
    model,
    input_ids: torch.Tensor,
    token_classes: dict[str, Iterable[int]],
    *,
    attention_mask: torch.Tensor | None = None,
    causal: bool = True,
) -> dict:
    """Run ``model`` (a scalar-sort / hybrid-sort causal LM, or a wrapper around one) on ``input_ids [B, N]`` and
    measure, for every "scalar" / "hybrid" layer, how far each class's keys lie from the queries that can read them.

    Returns:
        ``{"layers": [layer indices], "classes": [names..., "rest"], "per_layer": [{class: {stat: [H] float64,
        "count": int}}], "summary": {class: {stat: float}}}``: per layer the statistics over every key of the batch in
        the class (heads without a scalar term are NaN); ``summary`` averages them over layers and scalar heads.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("token_disposal: `input_ids` must be a [B, N] tensor")
    lm = sorted_lm(model)
    device = next(lm.parameters()).device
    input_ids = input_ids.to(device)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    masks = _class_masks(input_ids, token_classes)

    captured: dict[int, tuple] = {}

    def hook(idx):
        def keep(module, args, kwargs):
            captured.setdefault(idx, (args, kwargs))

        return keep

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(lm.model.layers)]
    was_training = lm.training
    lm.eval()
    try:
        lm(input_ids=input_ids, attention_mask=None if attention_mask is None else valid.long(), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        lm.train(was_training)

    layers, per_layer = [], []
    for idx, layer in enumerate(lm.model.layers):
        attn = layer.self_attn
        if not hasattr(attn, "scalar_head_list") or not any(attn.scalar_head_list):
            continue
        args, kwargs = captured[idx]
        x = layer.input_layernorm(layer_call_states(args, kwargs)[0])
        proj = attn.project(x, kwargs["position_embeddings"])
        tau = attn.temperature(x)
        heads = torch.tensor(attn.scalar_head_list)
        sums = {}
        for b in range(input_ids.shape[0]):
            row_tau = tau if tau.dim() == 1 else tau[b]
            stats = disposal_stats(
                proj.qs[b],
                proj.ks[b],
                {name: mask[b] for name, mask in masks.items()},
                tau=row_tau,
                valid=valid[b],
                causal=causal,
                window=attn.window,
            )
            for name, s in stats.items():
                if s["count"] == 0:
                    continue
                acc = sums.setdefault(name, {"count": 0, **{stat: 0.0 for stat in STATS}})
                for stat in STATS:  # key-weighted over the rows (the median: key-weighted mean of row medians)
                    acc[stat] = acc[stat] + s[stat] * s["count"]
                acc["count"] += s["count"]
        result = {}
        for name in masks:
            acc = sums.get(name)
            if acc is None:
                result[name] = {
                    stat: torch.full((attn.num_heads,), float("nan"), dtype=torch.float64) for stat in STATS
                }
                result[name]["count"] = 0
                continue
            result[name] = {stat: (acc[stat] / acc["count"]).masked_fill(~heads, float("nan")) for stat in STATS}
            result[name]["count"] = acc["count"]
        layers.append(idx)
        per_layer.append(result)
    if not layers:
        raise ValueError("token_disposal: the model has no scalar or hybrid layer to measure")
    summary = {}
    for name in masks:
        summary[name] = {}
        for stat in STATS:
            values = torch.cat([entry[name][stat] for entry in per_layer])
            values = values[~values.isnan()]
            summary[name][stat] = float(values.mean()) if len(values) else float("nan")
        summary[name]["count"] = sum(entry[name]["count"] for entry in per_layer) // len(per_layer)
    return {"layers": layers, "classes": list(masks), "per_layer": per_layer, "summary": summary}


def frequency_classes(input_ids: torch.Tensor, num_frequent: int, attention_mask: torch.Tensor | None = None) -> dict:
    """``{"frequent": the num_frequent most frequent token ids of the batch}`` (ties by smaller id): the usual proxy
    for function words and punctuation, the tokens the gist expects to be parked."""
    if not isinstance(num_frequent, int) or isinstance(num_frequent, bool) or num_frequent < 1:
        raise ValueError(f"frequency_classes: `num_frequent` must be an int >= 1; got {num_frequent!r}")
    ids = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
    values, counts = torch.unique(ids.flatten(), return_counts=True)
    order = sorted(range(len(values)), key=lambda i: (-int(counts[i]), int(values[i])))
    return {"frequent": [int(values[i]) for i in order[:num_frequent]]}


def punctuation_token_ids(tokenizer) -> list[int]:
    """The ids of the tokenizer's vocabulary whose text is only punctuation and / or whitespace (and not empty)."""
    allowed = set(string.punctuation) | set(string.whitespace)
    out = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text and all(ch in allowed for ch in text):
            out.append(token_id)
    return out


__all__ = ["disposal_stats", "frequency_classes", "punctuation_token_ids", "token_disposal"]
