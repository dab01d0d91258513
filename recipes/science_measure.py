"""The measurements of ``recipes/science_table.py`` on one trained run, beyond what ``pretrain.py`` records.

Per run (``measure_run``):

* ``attention_parameters``: the parameters of every layer's ``self_attn`` module (projections, registers' positions,
  SuSiE weights, temperatures, ...): what "far fewer attention parameters" compares.
* ``train_val_gap``: the final model's mean token loss on training blocks minus the same on validation blocks (both
  measured now, in eval mode, on the same number of blocks): the logged training loss is a running, noisy value from
  the weights of its step, not a comparable number.
* ``register_mass``: per layer, the mean attention weight the text queries put on the register keys (rows of
  ``output_attentions``, whose first keys are the prefix: the scalar sink first for scalar/hybrid layers, then the
  registers) over validation blocks, as a share of the row's total weight (the softmax-free RBF's rows are
  unnormalised kernel values, so the share is the comparable number).
* ``self_weight``: per layer, the mean share of each text query's weight on its own key (the diagonal: the column
  after the prefix keys), over validation blocks.  A Gaussian kernel over shared features (GKA: query = key = the
  token's feature) gives the own key the largest score, so this measures how close a layer is to the identity.
* ``gka_sigma``: per GKA layer, the bandwidth ``sigma = exp(log_sigma)`` averaged over heads, at initialisation and
  after training.
* ``tau``: per layer, the mean temperature over heads (and over the validation tokens for ``tau_mode="per_token"``) of
  scalar / hybrid layers, at initialisation and after training.  The initial model is rebuilt exactly as
  ``pretrain.py`` built it (``set_seed(seed)`` then ``build_model``), so no extra checkpoint is needed.
* ``captured_mass``: the share of exact attention mass inside the sorted cache's ``k``-window against the context
  length, through ``recipes/measure_captured_mass.py``'s ``measure`` (scalar / hybrid families; contexts above the
  model's ``max_position_embeddings`` or the validation stream's length are skipped and listed).
"""

from __future__ import annotations

import math

import torch


def attention_parameters(model) -> int:
    """Parameters of the modules named ``self_attn`` (every decoder family here and Llama name them so)."""
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "self_attn":
            total += sum(p.numel() for p in module.parameters())
    if total == 0:
        raise ValueError(f"{type(model).__name__} has no `self_attn` module: cannot count attention parameters")
    return int(total)


def _batches(blocks, num_blocks: int, batch_size: int):
    ids = torch.stack([torch.as_tensor(blocks[i]["input_ids"], dtype=torch.long) for i in range(num_blocks)])
    return ids.split(batch_size)


@torch.no_grad()
def mean_token_loss(model, blocks, num_blocks: int, batch_size: int, device) -> float:
    """Mean next-token cross-entropy (nats) over the first ``num_blocks`` blocks, every position of a block scored."""
    model.eval()
    total, count = 0.0, 0
    for ids in _batches(blocks, min(num_blocks, len(blocks)), batch_size):
        ids = ids.to(device)
        logits = model(ids, use_cache=False).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            ids[:, 1:].reshape(-1),
            reduction="sum",
        ).item()
        count += ids[:, 1:].numel()
    return total / count


def prefix_layout(attn) -> tuple[int, int]:
    """``(offset, count)`` of the register keys among an attention module's prefix keys: scalar / hybrid layers put
    their sink first (``sink_value`` exists), then the registers; the other kinds put the registers first."""
    registers = int(getattr(attn, "num_registers", 0) or 0)
    offset = 1 if getattr(attn, "sink_value", None) is not None else 0
    return offset, registers


def register_share(weights: torch.Tensor, offset: int, registers: int) -> torch.Tensor:
    """Per row, the share of the row's total weight on keys ``offset .. offset + registers`` of ``weights [B, H, N,
    K]``; rows without weight (fully masked) are left out.  Returns the shares of the kept rows (1-D, float64)."""
    w = weights.double()
    total = w.sum(-1)
    on_registers = w[..., offset : offset + registers].sum(-1)
    keep = total > 0
    return (on_registers[keep] / total[keep]).flatten()


@torch.no_grad()
def register_mass(model, blocks, num_blocks: int, batch_size: int, device) -> list[float] | None:
    """Per layer, the mean share of attention weight on the registers over the text queries of ``num_blocks``
    validation blocks; None for a model without registers.  A layer without registers gets None."""
    layers = model.model.layers
    layouts = [prefix_layout(layer.self_attn) for layer in layers]
    if not any(count for _, count in layouts):
        return None
    sums = [0.0] * len(layers)
    counts = [0] * len(layers)
    for ids in _batches(blocks, min(num_blocks, len(blocks)), batch_size):
        out = model(ids.to(device), use_cache=False, output_attentions=True)
        for i, (weights, (offset, count)) in enumerate(zip(out.attentions, layouts)):
            if count == 0 or weights is None:
                continue
            share = register_share(weights, offset, count)
            sums[i] += share.sum().item()
            counts[i] += share.numel()
    return [s / c if c else None for s, c in zip(sums, counts)]


def self_share(weights: torch.Tensor) -> torch.Tensor:
    """Per text row of ``weights [B, H, N, P + N]`` (``P`` prefix keys: sink, registers), the share of the row's total
    weight on its own key (column ``P + i`` of row ``i``); rows without weight are left out.  1-D, float64."""
    w = weights.double()
    n, k = w.shape[-2], w.shape[-1]
    if k < n:
        raise ValueError(f"self_share: {k} keys for {n} query rows; expected the prefix keys then every text key")
    rows = torch.arange(n, device=w.device)
    own = w[..., rows, (k - n) + rows]
    total = w.sum(-1)
    keep = total > 0
    return (own[keep] / total[keep]).flatten()


@torch.no_grad()
def self_weight(model, blocks, num_blocks: int, batch_size: int, device) -> list[float] | None:
    """Per layer, the mean share of attention weight a text query puts on its own key over ``num_blocks`` validation
    blocks (:func:`self_share`); None when the model returns no attention weights (e.g. Llama on SDPA)."""
    sums, counts = None, None
    for ids in _batches(blocks, min(num_blocks, len(blocks)), batch_size):
        attentions = model(ids.to(device), use_cache=False, output_attentions=True).attentions
        if not attentions or any(a is None for a in attentions):
            return None
        if sums is None:
            sums, counts = [0.0] * len(attentions), [0] * len(attentions)
        for i, weights in enumerate(attentions):
            share = self_share(weights)
            sums[i] += share.sum().item()
            counts[i] += share.numel()
    return None if sums is None else [s / c if c else None for s, c in zip(sums, counts)]


def gka_bandwidths(model) -> list[float] | None:
    """Per GKA layer, ``exp(log_sigma)`` averaged over heads; None when no layer has a ``log_sigma``."""
    sigmas = [
        layer.self_attn.log_sigma.detach().float().exp().mean().item()
        for layer in model.model.layers
        if isinstance(getattr(layer.self_attn, "log_sigma", None), torch.Tensor)
    ]
    return sigmas or None


@torch.no_grad()
def temperatures(model, blocks, num_blocks: int, batch_size: int, device) -> list[float] | None:
    """Per scalar / hybrid layer, the mean temperature over heads (per-token tau: over heads and the layer inputs of
    ``num_blocks`` validation blocks); None when no layer has a temperature."""
    layers = [layer for layer in model.model.layers if hasattr(layer.self_attn, "temperature")]
    layers = [layer for layer in layers if getattr(layer.self_attn, "kind", "") != "dot"]
    if not layers:
        return None
    per_token = [layer.self_attn.tau_proj is not None for layer in layers]
    if not any(per_token):
        x = torch.zeros(1, 1, model.config.hidden_size, device=device)
        return [layer.self_attn.temperature(x).double().mean().item() for layer in layers]
    inputs: dict[int, list] = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, i=i: inputs.setdefault(i, []).append(args[0].detach())
        )
        for i, layer in enumerate(layers)
    ]
    try:
        for ids in _batches(blocks, min(num_blocks, len(blocks)), batch_size):
            model(ids.to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [layer.self_attn.temperature(torch.cat(inputs[i])).double().mean().item() for i, layer in enumerate(layers)]


def capped_contexts(contexts: list[int], max_positions: int, stream_tokens: int) -> tuple[list[int], list[int]]:
    """``(measured, skipped)``: the contexts that fit both the model's positions and the validation stream."""
    kept = [c for c in contexts if c <= max_positions and c <= stream_tokens]
    return kept, [c for c in contexts if c not in kept]


def captured_mass_curve(model, stream: torch.Tensor, settings: dict, device, name: str) -> dict:
    """Captured mass of the sorted window per context and window size (mean over layers, heads and queries), with
    the rows of ``measure_captured_mass.measure`` kept for the record."""
    from recipes.measure_captured_mass import measure

    contexts, skipped = capped_contexts(
        list(settings["contexts"]),
        int(model.config.max_position_embeddings),
        int(stream.numel()),
    )
    if not contexts:
        return {
            "contexts": [],
            "skipped_contexts": skipped,
            "mean_mass": {},
            "rows": [],
        }
    size = {
        "device": device,
        "contexts": contexts,
        "windows": list(settings["windows"]),
        "query_rows": int(settings["query_rows"]),
        "chunk": int(settings["chunk"]),
    }
    rows, diagnostics = measure(model, stream, size, name)
    scheme = settings.get("scheme", "per_head")
    mean_mass = {}
    for context in contexts:
        for k in size["windows"]:
            vals = [r["mean_mass"] for r in rows if r["context"] == context and r["k"] == k and r["scheme"] == scheme]
            mean_mass[f"{context}:{k}"] = sum(vals) / len(vals) if vals else None
    return {
        "contexts": contexts,
        "skipped_contexts": skipped,
        "windows": size["windows"],
        "scheme": scheme,
        "mean_mass": mean_mass,
        "diagnostics": {str(k): v for k, v in diagnostics.items()},
        "rows": rows,
    }


def initial_model(summary: dict, seed: int):
    """The model ``pretrain.run`` started from: the same config kwargs, ``set_seed(seed)``, ``build_model``."""
    from transformers import set_seed

    from recipes.pretrain_models import build_config, build_model

    config = build_config(summary["family"], summary["model_config"])
    set_seed(seed)
    return build_model(config)


def _finite(x):
    return x if x is None or math.isfinite(x) else None


def measure_run(cfg: dict, summary: dict, settings: dict, log=print) -> dict:
    """Every measurement above for the run whose recipe is ``cfg`` and whose ``pretrain.run`` summary is ``summary``.

    ``settings``: ``{"blocks", "batch_size", "train_gap_blocks", "captured_mass": {contexts, windows, query_rows,
    chunk, scheme} | None, "device"}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rbf.eval.loading import resolve_device
    from recipes.pretrain_data import encode_stream, load_split_documents, prepare_data

    device = resolve_device(settings.get("device", "auto"))
    tokenizer = AutoTokenizer.from_pretrained(summary["final_dir"])
    data = prepare_data(cfg, tokenizer, load_split_documents(cfg), log=lambda *a, **k: None)
    model = AutoModelForCausalLM.from_pretrained(summary["final_dir"], dtype=torch.float32).to(device).eval()
    blocks, batch = int(settings["blocks"]), int(settings["batch_size"])
    gap_blocks = int(settings["train_gap_blocks"])

    out: dict = {"attention_parameters": attention_parameters(model)}
    # every variant's validation loss the same way: float32, the language-model term only (Trainer's eval_loss of a
    # scalar-sort / hybrid model with regularizers includes them), on all validation blocks
    out["validation_lm_loss"] = mean_token_loss(model, data["validation"], len(data["validation"]), batch, device)
    train_loss = mean_token_loss(model, data["train"], gap_blocks, batch, device)
    val_loss = mean_token_loss(model, data["validation"], gap_blocks, batch, device)
    out["train_val_gap"] = {
        "train_loss": train_loss,
        "validation_loss": val_loss,
        "gap": val_loss - train_loss,
        "blocks": min(gap_blocks, len(data["train"]), len(data["validation"])),
    }
    out["register_mass"] = register_mass(model, data["validation"], blocks, batch, device)
    out["self_weight"] = (
        self_weight(model, data["validation"], blocks, batch, device) if hasattr(model, "model") else None
    )
    tau_end = temperatures(model, data["validation"], blocks, batch, device)
    sigma_end = gka_bandwidths(model) if hasattr(model, "model") else None
    out["tau"], out["gka_sigma"] = None, None
    if tau_end is not None or sigma_end is not None:
        start = initial_model(summary, int(cfg["training"].get("seed", cfg["seed"]))).to(device).eval()
        if tau_end is not None:
            out["tau"] = {"start": temperatures(start, data["validation"], blocks, batch, device), "end": tau_end}
        if sigma_end is not None:
            out["gka_sigma"] = {"start": gka_bandwidths(start), "end": sigma_end}
        del start
    cm = settings.get("captured_mass")
    if cm and hasattr(model, "make_cache") and tau_end is not None:
        max_context = max(cm["contexts"])
        stream = torch.as_tensor(encode_stream(data["validation_texts"], tokenizer)[: max_context + 1]).long()
        t = captured_mass_curve(model, stream, cm, str(device), summary["run_name"])
        out["captured_mass"] = t
    else:
        out["captured_mass"] = None
    log(
        f"[measure] {summary['run_name']}: attention parameters {out['attention_parameters']:,}, train-validation gap "
        f"{out['train_val_gap']['gap']:.4f}, register mass {out['register_mass']}, tau {out['tau']}"
    )
    return out


REGULARIZER_TERMS = ("align", "spread", "tau")


def language_model_curve(log_history: list[dict], model_config: dict) -> list[dict]:
    """The loss curve of the language-model term: ``loss`` minus the weighted regularizer terms that
    ``HfRbfTrainer`` logs with it (their means over the same steps; the weight logged with the row when a schedule
    is set, else the config's); the ``eval_loss`` points are dropped for a regularized model (Trainer's evaluation
    does not split them).  Without regularizers the curve is the logged one."""
    weights = {t: float(model_config.get(f"{t}_loss_weight") or 0.0) for t in REGULARIZER_TERMS}
    regularized = any(weights.values())
    out = []
    for row in log_history:
        kept = {k: row[k] for k in ("step", "tokens_seen", "loss", "eval_loss") if k in row}
        if regularized:
            kept.pop("eval_loss", None)
            if "loss" in kept:
                kept["loss"] -= sum(
                    float(row.get(f"{t}_loss_weight", w)) * float(row.get(f"{t}_loss", 0.0)) for t, w in weights.items()
                )
        if "loss" in kept or "eval_loss" in kept:
            out.append(kept)
    return out


def curve_metrics(log_history: list[dict]) -> dict:
    """The numbers of the validation curve (Trainer's evaluations): ``first_eval_loss`` (the first scheduled
    evaluation: "converges faster"), ``best_eval_loss`` and ``best_eval_step`` (its lowest point: where a run that
    repeats its data many times stops improving and starts to overfit, the early-stopping point)."""
    evals = [row for row in log_history if row.get("eval_loss") is not None]
    best = min(evals, key=lambda row: row["eval_loss"], default=None)
    return {
        "first_eval_loss": evals[0]["eval_loss"] if evals else None,
        "best_eval_loss": None if best is None else best["eval_loss"],
        "best_eval_step": None if best is None else best.get("step"),
    }


# Every number ``flat_metrics`` gives a run: what a science config's claims may name as ``metric``.
RUN_METRICS = (
    "first_eval_loss",
    "best_eval_loss",
    "best_eval_step",
    "eval_loss",
    "trainer_eval_loss",
    "bits_per_byte",
    "core",
    "mean_train_loss",
    "train_val_gap",
    "num_parameters",
    "attention_parameters",
    "register_mass_mean",
    "register_mass_max",
    "self_weight_mean",
    "gka_sigma_end",
    "tau_start",
    "tau_end",
    "captured_mass_longest",
    "captured_mass_context",
    "tokens_per_second",
)


def flat_metrics(
    summary: dict,
    measured: dict,
    core: dict | None,
    log_history: list[dict],
    claim_window: int | None = None,
) -> dict:
    """The per-run numbers the table and the claims read (``None`` where a run has no such number).

    ``eval_loss`` is the measured language-model validation loss (``measure_run``), ``trainer_eval_loss`` Trainer's
    (with a regularized model's regularizers).  ``log_history`` is :func:`language_model_curve`'s.
    ``first_eval_loss`` (the validation loss at the first scheduled evaluation) and ``mean_train_loss`` (the mean of
    every training step's loss: the area under the curve) are the two "converges faster" numbers."""

    def mean(values):
        values = [v for v in values or [] if v is not None]
        return sum(values) / len(values) if values else None

    reg = measured.get("register_mass")
    tau = measured.get("tau") or {}
    cm = measured.get("captured_mass") or {}
    long_mass = None
    if cm.get("contexts"):
        k = claim_window if claim_window is not None else cm["windows"][-1]
        long_mass = cm["mean_mass"].get(f"{cm['contexts'][-1]}:{k}")
    return {
        **curve_metrics(log_history),
        "eval_loss": _finite(measured["validation_lm_loss"]),
        "trainer_eval_loss": _finite(summary.get("eval_loss")),
        "bits_per_byte": _finite(summary.get("bits_per_byte")),
        "core": (core or {}).get("core_metric"),
        "mean_train_loss": _finite(summary.get("mean_train_loss")),
        "train_val_gap": measured["train_val_gap"]["gap"],
        "num_parameters": summary.get("num_parameters"),
        "attention_parameters": measured["attention_parameters"],
        "register_mass_mean": mean(reg),
        "register_mass_max": max((v for v in reg or [] if v is not None), default=None),
        "self_weight_mean": mean(measured.get("self_weight")),
        "gka_sigma_end": mean((measured.get("gka_sigma") or {}).get("end")),
        "tau_start": mean(tau.get("start")),
        "tau_end": mean(tau.get("end")),
        "captured_mass_longest": long_mass,
        "captured_mass_context": cm["contexts"][-1] if cm.get("contexts") else None,
        "tokens_per_second": summary.get("tokens_per_second"),
    }


__all__ = [
    "RUN_METRICS",
    "attention_parameters",
    "capped_contexts",
    "captured_mass_curve",
    "flat_metrics",
    "gka_bandwidths",
    "initial_model",
    "language_model_curve",
    "mean_token_loss",
    "measure_run",
    "prefix_layout",
    "register_mass",
    "register_share",
    "self_share",
    "self_weight",
    "temperatures",
]
