"""Pictures of trained models: attention maps with the register tokens on the axes, attention rollout, the GKA
bandwidths, the scalar-key layout of a sorted cache, and loss curves of several runs.  PNG files (matplotlib).

    python recipes/visualize.py attention --model DIR --prompt "Once upon a time" --output figs/   # maps + rollout
    python recipes/visualize.py sigma --model DIR [--model DIR2 ...] --output figs/                 # GKA sigmas
    python recipes/visualize.py sorted-keys --model DIR --prompt "..." --output figs/               # scalar keys
    python recipes/visualize.py loss --runs a=outputs/run_a b=outputs/run_b --output figs/loss.png

How the attention weights are obtained.  hf_rbf's attention functions never build the weight matrix, and the
models reject ``output_attentions=True``.  :func:`capture_attention` runs one ordinary forward while every hf_rbf
attention function that an attention module calls (``rbf_attention``, ``dot_attention``, ``gka_attention``,
``scalar_attention``, ``hybrid_attention``, looked up by identity in the module's Python module) is wrapped to record
its arguments and output.  Afterwards the weights are recomputed from the recorded arguments on the materialised
reference path:

* every function whose weights do not depend on the values (RBF, dot, scalar, hybrid) is called again with the
  values replaced by one-hot vectors (``v = I``), so the output *is* the weight matrix ``W [B, H, Nq, Nk]``;
* GKA (whose values are its features) recomputes ``K_ij / (sum_j K_ij + eps)`` from the recorded features, bandwidths
  and mask with the same reference helpers.

``W @ v`` equals the recorded output (``check_attention_capture``; the tests check it for every family), so the
pictures show what the model computed.  With registers each layer makes two calls (register rows over the registers,
text rows over registers + text); they are assembled into one ``(R + N) x (R + N)`` matrix per head with the
registers first.  Models without hf_rbf attention modules (``LlamaForCausalLM``) use transformers' own
``output_attentions=True`` with eager attention.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from recipes.plotting import _pyplot, plot_loss_curves, read_metrics

# ----------------------------------------------------------------------------------------------------------------
# capturing the attention weights
# ----------------------------------------------------------------------------------------------------------------


def _ops() -> dict:
    """The hf_rbf attention functions by name (what attention modules call)."""
    import hf_rbf

    return {
        name: getattr(hf_rbf, name)
        for name in ("rbf_attention", "dot_attention", "gka_attention", "scalar_attention", "hybrid_attention")
    }


@dataclass
class AttentionCall:
    """One recorded call of an attention function inside an attention module."""

    op: str
    arguments: dict
    output: torch.Tensor


@dataclass
class LayerAttention:
    """The attention of one layer for batch element 0.

    ``weights``: ``[H, S + R + N, S + R + N]`` float32, rows = queries, columns = keys in the order the layer's keys
    have: ``S`` sink entries (a scalar-sort layer's persistent sink; 0 elsewhere), the ``R`` registers, the ``N`` text
    tokens.  Register rows see only the sinks and registers; text rows see those plus their causal / windowed text.
    A sink is a constant entry with no query of its own: its row is the identity (it keeps itself, which is what the
    rollout needs).  ``kind``: the layer's attention kind.
    """

    layer: int
    kind: str
    num_registers: int
    weights: torch.Tensor
    calls: list
    num_sinks: int = 0

    @property
    def num_prefix(self) -> int:
        return self.num_sinks + self.num_registers


@contextmanager
def _recording(model, records: dict):
    """Wrap the hf_rbf attention functions used by ``model``'s attention modules; ``records[module]`` collects
    :class:`AttentionCall`s."""
    from hf_rbf.modeling_decoder import DecoderAttention

    ops = _ops()
    by_id = {id(fn): name for name, fn in ops.items()}
    modules = [m for m in model.modules() if isinstance(m, DecoderAttention)]
    current = []
    register_inputs = records.setdefault("register_inputs", {})  # module -> its register rows (R = 1 closed forms)
    patched = []  # (python module, attribute name, original)

    def make_wrapper(name, fn):
        signature = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            if current:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                records.setdefault(current[-1], []).append(AttentionCall(name, dict(bound.arguments), out.detach()))
            return out

        return wrapper

    for python_module in {sys.modules[type(m).__module__] for m in modules}:
        for attr, obj in list(vars(python_module).items()):
            if callable(obj) and id(obj) in by_id:
                name = by_id[id(obj)]
                patched.append((python_module, attr, obj))
                setattr(python_module, attr, make_wrapper(name, obj))

    def enter(mod, args):
        current.append(mod)
        if len(args) > 1:
            register_inputs[mod] = args[1]

    def leave(mod, args, out):
        current.pop()

    hooks = []
    for m in modules:
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave))
    try:
        yield modules
    finally:
        for h in hooks:
            h.remove()
        for python_module, attr, obj in patched:
            setattr(python_module, attr, obj)


def _float32(arguments: dict) -> dict:
    return {
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in arguments.items()
    }


def _prefix_in_front(a: dict) -> dict:
    """A call's arguments with ``prefix_keys`` / ``prefix_values`` (rbf's / hybrid's registers, passed to the kernels
    as separate tensors; the scalar family's ``prefix_values`` alone) concatenated in front of ``k`` / ``v``, and GKA's
    ``prefix_features`` in front of ``x`` (the query then the features without them): the same keys in the order the
    weights are read."""
    a = dict(a)
    prefix_keys, prefix_values = a.pop("prefix_keys", None), a.pop("prefix_values", None)
    if prefix_keys is not None:
        a["k"] = torch.cat([prefix_keys.expand(a["k"].shape[0], -1, -1, -1), a["k"]], dim=2)
    if prefix_values is not None:
        a["v"] = torch.cat([prefix_values.expand(a["v"].shape[0], -1, -1, -1), a["v"]], dim=2)
    prefix_features = a.pop("prefix_features", None)
    if prefix_features is not None:
        if a.get("query") is None:
            a["query"] = a["x"]
        a["x"] = torch.cat([prefix_features.expand(a["x"].shape[0], -1, -1, -1), a["x"]], dim=2)
        a["num_prefix_keys"] = prefix_features.shape[2]
    return a


def call_weights(call: AttentionCall) -> torch.Tensor:
    """The weight matrix ``[B, H, Nq, Nk]`` (float32) of a recorded call, on the reference ("naive") path."""
    ops = _ops()
    a = _float32(call.arguments)
    a["backend"] = "naive"
    a = _prefix_in_front(a)
    if call.op == "gka_attention":
        return _gka_weights(a)
    v = a["v"]
    nk = v.shape[-2]
    a["v"] = torch.eye(nk, dtype=torch.float32, device=v.device).expand(*v.shape[:-2], nk, nk).contiguous()
    return ops[call.op](**a)


def _gka_weights(a: dict) -> torch.Tensor:
    """``K_ij / (sum_j K_ij + eps)``, ``K_ij = exp(-||q_i - x_j||^2 / (2 sigma_h^2)) w_j`` on the allowed pairs (the
    same reference helpers as ``gka_attention_naive``, with one-hot values)."""
    from hf_rbf.attention_utils import allowed_mask, masked_kernel_average, normalize_mask_args, per_head_param

    x = a["x"]
    query = a["query"] if a["query"] is not None else x
    b, h, nk, _ = x.shape
    log_sigma = per_head_param("gka_attention", "log_sigma", a["log_sigma"], h, x.device, positive=False)
    mask = normalize_mask_args(
        "gka_attention",
        batch=b,
        heads=h,
        nq=query.shape[2],
        nk=nk,
        device=x.device,
        causal=a["causal"],
        window=a["window"],
        num_prefix_keys=a["num_prefix_keys"],
        key_log_weights=a["key_log_weights"],
        attention_mask=a["attention_mask"],
    )
    ls = torch.tensor(log_sigma) if isinstance(log_sigma, float) else log_sigma.float().view(1, -1, 1, 1)
    inv_two_sigma_sq = 0.5 * torch.exp(-2.0 * ls)
    dist_sq = (query * query).sum(-1).unsqueeze(-1) + (x * x).sum(-1).unsqueeze(-2) - 2.0 * query @ x.transpose(-1, -2)
    scores = -dist_sq.clamp_min(0.0) * inv_two_sigma_sq
    if mask.key_log_weights is not None:
        scores = scores + mask.key_log_weights.float().unsqueeze(-2)
    eye = torch.eye(nk, dtype=torch.float32, device=x.device).expand(b, h, nk, nk)
    return masked_kernel_average(scores, eye, allowed_mask(mask, x.device), normalize=True, eps=a["eps"])


def call_values(call: AttentionCall) -> torch.Tensor:
    """The values a recorded call averaged, per head: ``[B, H, Nk, Dv]`` (grouped values expanded, GKA features)."""
    a = _prefix_in_front(_float32(call.arguments))
    if call.op == "gka_attention":
        return a["x"]
    v = a["v"]
    heads = a["q"].shape[1] if "q" in a else a["qs"].shape[1]
    if v.shape[1] != heads:
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    return v


def check_attention_capture(calls: list) -> float:
    """Largest ``|W @ v - output|`` over the recorded calls, relative to the outputs' largest magnitude."""
    worst = 0.0
    for call in calls:
        recomputed = call_weights(call) @ call_values(call)
        out = call.output.float()
        scale = max(out.abs().max().item(), 1e-6)
        worst = max(worst, (recomputed - out).abs().max().item() / scale)
    return worst


def _is_hf_rbf_model(model) -> bool:
    from hf_rbf.modeling_decoder import DecoderAttention

    return any(isinstance(m, DecoderAttention) for m in model.modules())


@torch.no_grad()
def capture_attention(model, input_ids: torch.Tensor) -> list[LayerAttention]:
    """Run ``model`` on ``input_ids`` (``[1, N]``) and return every layer's attention (see the module docstring)."""
    model.eval()
    if not _is_hf_rbf_model(model):
        return _capture_transformers(model, input_ids)
    records: dict = {}
    with _recording(model, records) as modules:
        model(input_ids=input_ids, use_cache=False)
    layers = []
    for module in modules:
        calls = records.get(module, [])
        if not calls:
            raise RuntimeError(f"layer {module.layer_idx}: no hf_rbf attention function was called")
        r, sinks = module.num_registers, int(getattr(module, "num_sink", 0))
        text = call_weights(calls[-1])[0]  # [H, N, S + R + N]
        h, n, total = text.shape
        if total != sinks + r + n:
            raise RuntimeError(
                f"layer {module.layer_idx}: {total} keys for {n} text tokens, {r} registers and {sinks} sinks"
            )
        full = torch.zeros(h, total, total)
        full[:, total - n :, :] = text
        if sinks:
            full[:, :sinks, :sinks] = torch.eye(sinks)
        if r == 1 and len(calls) == 1 and getattr(module, "normalize", False):
            full[:, sinks, sinks] = (
                1.0  # a single softmax register attends to itself alone (RbfAttention skips the call)
            )
        elif r == 1 and len(calls) == 1 and hasattr(module, "one_register_weights"):
            # the sorted families' one register: a closed form over the sink and itself, no attention call
            full[:, sinks : sinks + 1, : sinks + 1] = module.one_register_weights(records["register_inputs"][module])[0]
        elif r > 0:
            if len(calls) < 2:
                raise RuntimeError(f"layer {module.layer_idx}: registers without a register call")
            full[:, sinks : sinks + r, : sinks + r] = call_weights(calls[0])[0]
        layers.append(LayerAttention(module.layer_idx, module.kind, r, full, calls, sinks))
    return _common_sinks(sorted(layers, key=lambda la: la.layer))


def _common_sinks(layers: list[LayerAttention]) -> list[LayerAttention]:
    """Give every layer the same key layout when only some have a sink (scalar layers mixed with "dot" layers): a
    layer without one gets the sink's row and column (identity row, no weight on it), so the pictures and the rollout
    line up."""
    most = max(la.num_sinks for la in layers)
    for la in layers:
        extra = most - la.num_sinks
        if extra:
            h, size, _ = la.weights.shape
            grown = torch.zeros(h, size + extra, size + extra)
            grown[:, extra:, extra:] = la.weights
            grown[:, :extra, :extra] = torch.eye(extra)
            la.weights, la.num_sinks = grown, most
    return layers


def _capture_transformers(model, input_ids) -> list[LayerAttention]:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:
        model.config._attn_implementation = "eager"
    out = model(input_ids=input_ids, output_attentions=True, use_cache=False)
    return [LayerAttention(i, "dot", 0, a[0].float(), []) for i, a in enumerate(out.attentions)]


# ----------------------------------------------------------------------------------------------------------------
# attention pictures
# ----------------------------------------------------------------------------------------------------------------


def token_labels(tokenizer, ids, num_registers: int, num_sinks: int = 0) -> list[str]:
    """Axis labels: ``[SINK]`` entries, ``[REG_0] ...``, then each token decoded on its own (spaces shown as a middle
    dot)."""
    labels = ["[SINK]"] * num_sinks + [f"[REG_{i}]" for i in range(num_registers)]
    for i in ids:
        text = tokenizer.decode([int(i)]) if tokenizer is not None else str(int(i))
        labels.append(text.replace(" ", "\u00b7").replace("\n", "\\n") or "\u2205")
    return labels


def plot_attention_maps(layers: list[LayerAttention], labels: list[str], path: str, *, title: str = "") -> str:
    """A grid of heatmaps, one row per layer and one column per head, with token labels on both axes."""
    plt = _pyplot()
    n_layers, n_heads = len(layers), layers[0].weights.shape[0]
    size = layers[0].weights.shape[-1]
    cell = max(2.2, min(4.5, 0.16 * size))
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads + 1, cell * n_layers + 0.8), squeeze=False)
    for row, la in enumerate(layers):
        for head in range(n_heads):
            ax = axes[row][head]
            w = la.weights[head].numpy()
            ax.imshow(w, cmap="viridis", vmin=0.0, vmax=max(float(w.max()), 1e-9), interpolation="nearest")
            ax.set_title(f"layer {la.layer} ({la.kind}) head {head}", fontsize=7)
            ticks = range(size)
            show = size <= 48
            ax.set_xticks(ticks if show else [])
            ax.set_yticks(ticks if show else [])
            if show:
                ax.set_xticklabels(labels, rotation=90, fontsize=5)
                ax.set_yticklabels(labels, fontsize=5)
            if la.num_prefix:
                r = la.num_prefix - 0.5
                ax.axhline(r, color="white", lw=0.6)
                ax.axvline(r, color="white", lw=0.6)
    fig.suptitle(title or "attention weights (rows: queries, columns: keys; sink and registers first)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def attention_rollout(layers: list[LayerAttention], residual: float = 0.5) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): ``A_l = (1 - residual) * mean_h W_l + residual * I`` (rows
    renormalised), multiplied from the first layer to the last: ``R = A_L ... A_1``, ``[R + N, R + N]``."""
    size = layers[0].weights.shape[-1]
    eye = torch.eye(size)
    rollout = eye.clone()
    for la in layers:
        a = (1.0 - residual) * la.weights.mean(0) + residual * eye
        a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
        rollout = a @ rollout
    return rollout


def plot_rollout(
    rollout: torch.Tensor, labels: list[str], path: str, *, num_registers: int = 0, title: str = ""
) -> str:
    plt = _pyplot()
    size = rollout.shape[0]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.22 * size + 1.5), max(3.6, 0.22 * size + 1.0)))
    im = ax.imshow(rollout.numpy(), cmap="magma", interpolation="nearest")
    if size <= 64:
        ax.set_xticks(range(size))
        ax.set_yticks(range(size))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_yticklabels(labels, fontsize=6)
    if num_registers:
        ax.axhline(num_registers - 0.5, color="white", lw=0.6)
        ax.axvline(num_registers - 0.5, color="white", lw=0.6)
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax.set_title(title or "attention rollout (all layers, heads averaged, residual 0.5)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------------------------
# GKA bandwidths
# ----------------------------------------------------------------------------------------------------------------


def gka_sigmas(model) -> tuple[np.ndarray, list[str]]:
    """``sigma = exp(log_sigma)`` as ``[layers, heads]`` (NaN for layers without a bandwidth, e.g. "dot") and the
    layer kinds."""
    from hf_rbf.modeling_decoder import DecoderAttention

    modules = sorted((m for m in model.modules() if isinstance(m, DecoderAttention)), key=lambda m: m.layer_idx)
    if not modules:
        raise ValueError("the model has no hf_rbf attention layers")
    heads = modules[0].num_heads
    out = np.full((len(modules), heads), np.nan)
    kinds = []
    for i, m in enumerate(modules):
        kinds.append(m.kind)
        log_sigma = getattr(m, "log_sigma", None)
        if isinstance(log_sigma, torch.Tensor):
            out[i] = log_sigma.detach().float().exp().cpu().numpy()
    if np.isnan(out).all():
        raise ValueError("the model has no GKA layer (no `log_sigma` parameter)")
    return out, kinds


def plot_sigma_heatmap(sigmas: np.ndarray, kinds: list[str], path: str, *, title: str = "") -> str:
    """Heads (rows) x layers (columns) heatmap of sigma, values written in the cells; non-GKA layers blank."""
    plt = _pyplot()
    data = sigmas.T  # [heads, layers]
    fig, ax = plt.subplots(figsize=(1.1 * data.shape[1] + 2.2, 0.5 * data.shape[0] + 1.6))
    masked = np.ma.masked_invalid(data)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
    im = ax.imshow(masked, cmap=cmap, aspect="auto")
    for (h, layer), value in np.ndenumerate(data):
        ax.text(
            layer, h, "" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=7, color="white"
        )
    ax.set_xticks(range(data.shape[1]))
    ax.set_xticklabels([f"{i}\n{k}" for i, k in enumerate(kinds)], fontsize=7)
    ax.set_yticks(range(data.shape[0]))
    ax.set_xlabel("layer")
    ax.set_ylabel("head")
    fig.colorbar(im, ax=ax, label="sigma")
    ax.set_title(title or "GKA bandwidth sigma per head and layer", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def plot_sigma_lines(sigmas_by_model: dict, path: str, *, title: str = "") -> str:
    """sigma against layer, one line per head (thin) and the head mean (thick), for one or several models."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, sigmas) in enumerate(sigmas_by_model.items()):
        color = colors[i % len(colors)]
        layers = np.arange(sigmas.shape[0])
        for h in range(sigmas.shape[1]):
            ax.plot(layers, sigmas[:, h], color=color, lw=0.7, alpha=0.5, marker=".")
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # layers without a sigma ("dot") have no mean
            mean = np.nanmean(sigmas, axis=1)
        ax.plot(layers, mean, color=color, lw=2.2, label=f"{label} (head mean)")
    ax.set_xlabel("layer")
    ax.set_xticks(range(max(s.shape[0] for s in sigmas_by_model.values())))
    ax.set_ylabel("sigma")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "GKA bandwidth by layer (thin lines: heads)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------------------------
# sorted scalar keys
# ----------------------------------------------------------------------------------------------------------------


def sorted_scalar_keys(model, input_ids) -> list[dict]:
    """Per layer with scalar keys (scalar / hybrid attention): the keys of batch element 0 sorted per head, as a
    sorted scalar cache holds them: ``{"layer", "kind", "keys": [H, N] ascending, "positions": [H, N] token position
    of each key (registers: -R .. -1), "queries": [H, N] scalar queries}``."""
    records: dict = {}
    model.eval()
    with torch.no_grad(), _recording(model, records) as modules:
        model(input_ids=input_ids, use_cache=False)
    out = []
    for module in modules:
        calls = [c for c in records.get(module, []) if c.op in ("scalar_attention", "hybrid_attention")]
        if not calls:
            continue
        text = calls[-1].arguments
        ks = text["ks"][0].float()  # [H, R + N] (registers first)
        r = ks.shape[-1] - input_ids.shape[-1]
        positions = torch.arange(-r, ks.shape[-1] - r).expand_as(ks)
        keys, order = ks.sort(dim=-1)
        out.append(
            {
                "layer": module.layer_idx,
                "kind": module.kind,
                "keys": keys,
                "positions": positions.gather(-1, order),
                "queries": text["qs"][0].float(),
            }
        )
    if not out:
        raise ValueError("the model has no layer with scalar keys (scalar / hybrid attention)")
    return out


def plot_sorted_keys(keys, positions=None, path: str = "sorted_keys.png", *, queries=None, title: str = "") -> str:
    """The layout of a sorted scalar-key cache, one row of panels per head.

    Args:
        keys: ``[H, N]`` per-head scalar keys in the cache's (ascending) order.
        positions: ``[H, N]`` token position of each cached key (optional; negative = register / sink entries).
        queries: ``[H, M]`` scalar queries to mark on the key axis (optional).

    Left panel: key value against its rank in the cache, coloured by token position (a query's window of nearest keys
    is a contiguous range of ranks).  Right panel: token position against rank (how far the sort permutes time).
    """
    plt = _pyplot()
    keys = np.asarray(torch.as_tensor(keys, dtype=torch.float32))
    if keys.ndim != 2:
        raise ValueError(f"keys must be [H, N] (per-head keys in sorted order); got shape {keys.shape}")
    if np.any(np.diff(keys, axis=-1) < 0):
        raise ValueError("keys must be sorted ascending along the last axis (the order of the sorted cache)")
    heads, n = keys.shape
    pos = None if positions is None else np.asarray(torch.as_tensor(positions, dtype=torch.float32))
    if pos is not None and pos.shape != keys.shape:
        raise ValueError(f"positions must have the shape of keys {keys.shape}; got {pos.shape}")
    ncols = 2 if pos is not None else 1
    fig, axes = plt.subplots(heads, ncols, figsize=(5.0 * ncols, 1.9 * heads + 0.6), squeeze=False)
    ranks = np.arange(n)
    for h in range(heads):
        ax = axes[h][0]
        sc = ax.scatter(ranks, keys[h], c=pos[h] if pos is not None else ranks, cmap="plasma", s=8)
        if queries is not None:
            for q in np.asarray(torch.as_tensor(queries, dtype=torch.float32))[h]:
                ax.axhline(q, color="gray", lw=0.3, alpha=0.4)
        ax.set_ylabel(f"head {h}\nkey", fontsize=8)
        ax.grid(alpha=0.3)
        if pos is not None:
            fig.colorbar(sc, ax=ax, label="token position")
            ax2 = axes[h][1]
            ax2.scatter(ranks, pos[h], s=8, color="tab:blue")
            ax2.set_ylabel("token position", fontsize=8)
            ax2.grid(alpha=0.3)
    axes[-1][0].set_xlabel("rank in the sorted cache")
    if ncols == 2:
        axes[-1][1].set_xlabel("rank in the sorted cache")
    fig.suptitle(title or "sorted scalar-key cache: key value and token position by rank", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------------------------
# helpers and CLI
# ----------------------------------------------------------------------------------------------------------------


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    _pyplot().close(fig)
    return path


def _load(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rbf  # noqa: F401

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tokenizer


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return torch.tensor([ids])


def attention_figures(model, tokenizer, prompt: str, output_dir: str, name: str = "attention") -> dict:
    """``<name>_maps.png`` (every layer and head) and ``<name>_rollout.png`` for ``prompt``."""
    ids = _prompt_ids(tokenizer, prompt)
    layers = capture_attention(model, ids)
    labels = token_labels(tokenizer, ids[0], layers[0].num_registers, layers[0].num_sinks)
    maps = plot_attention_maps(layers, labels, os.path.join(output_dir, f"{name}_maps.png"))
    rollout = plot_rollout(
        attention_rollout(layers),
        labels,
        os.path.join(output_dir, f"{name}_rollout.png"),
        num_registers=layers[0].num_prefix,
    )
    return {"maps": maps, "rollout": rollout}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("attention", help="attention maps per layer and head, and the rollout")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    p.add_argument("--output", required=True, help="folder")
    p = sub.add_parser("sigma", help="GKA sigma heatmap (heads x layers) and line plot")
    p.add_argument("--model", action="append", required=True, help="label=dir or dir; repeat for several models")
    p.add_argument("--output", required=True, help="folder")
    p = sub.add_parser("sorted-keys", help="scalar-key layout of the sorted cache (scalar / hybrid layers)")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    p.add_argument("--output", required=True, help="folder")
    p = sub.add_parser("loss", help="loss curves of several runs on one plot")
    p.add_argument("--runs", nargs="+", required=True, help="label=run dir (holding metrics.json) or run dir")
    p.add_argument("--output", required=True, help="PNG path")
    p.add_argument("--x", choices=("step", "tokens"), default="step")
    args = parser.parse_args(argv)

    if args.command == "attention":
        model, tokenizer = _load(args.model)
        print(attention_figures(model, tokenizer, args.prompt, args.output))
    elif args.command == "sigma":
        sig = {}
        for item in args.model:
            label, _, path = item.partition("=")
            if not path:
                label, path = os.path.basename(os.path.normpath(item)), item
            model, _ = _load(path)
            sig[label], kinds = gka_sigmas(model)
            plot_sigma_heatmap(
                sig[label],
                kinds,
                os.path.join(args.output, f"sigma_heatmap_{label}.png"),
                title=f"{label}: GKA sigma per head and layer",
            )
        plot_sigma_lines(sig, os.path.join(args.output, "sigma_lines.png"))
    elif args.command == "sorted-keys":
        model, tokenizer = _load(args.model)
        for entry in sorted_scalar_keys(model, _prompt_ids(tokenizer, args.prompt)):
            plot_sorted_keys(
                entry["keys"],
                entry["positions"],
                os.path.join(args.output, f"sorted_keys_layer{entry['layer']}.png"),
                queries=entry["queries"],
                title=f"layer {entry['layer']} ({entry['kind']})",
            )
    elif args.command == "loss":
        runs = {}
        for item in args.runs:
            label, _, path = item.partition("=")
            if not path:
                label, path = os.path.basename(os.path.normpath(item)), item
            runs[label] = read_metrics(path)
        plot_loss_curves(runs, args.output, x=args.x)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
