"""Captured attention mass of the sorted cache's window (the scalar sort gist's experiments 2 to 4).

Trains small scalar-sort and hybrid-sort models on the shipped TinyStories sample, with and without the gist's
regularizers (L_align + L_spread + L_tau), then measures, per layer and head, the share of each query's *exact*
attention mass that falls inside the ``k``-window the sorted cache would read (plus the always-present sink), against
the context length and ``k``, for both window schemes: "per_head" (each head searches its own key order) and
"sort_head" (every head of a value group searches the order of the group's designated sort head, the gist's shared
store).  A mass of 1 means the windowed decode step is exact for that query.

    python recipes/measure_captured_mass.py --size cpu --output outputs/captured_mass      # minutes on 2 CPU cores
    python recipes/measure_captured_mass.py --size gpu --output outputs/captured_mass_gpu  # GPU: contexts to 8192
    # under a per-command time limit: --families scalar_sort, then --families hybrid_sort, then --reuse (all)

Writes into ``--output``: ``captured_mass.csv`` (model, layer, head, context, k, scheme: mean and 10th percentile
over the measured queries), ``captured_mass.md`` (tables: mean over layers and heads, and the worst head),
``captured_mass.png``, ``summary.json`` (validation loss, temperatures, alignment, settings) and the trained models
(``models/<name>``; ``--reuse`` loads them instead of training again).

The queries measured at context ``L`` are the last ``min(query_rows, L / 2)`` positions of an ``L``-token stretch of
the validation stories; their hidden states come from an exact chunked prefill through the model's own
``SortedScalarCache`` (``decode_window=None``), so long contexts need no ``L x L`` matrix.  Needs ``tokenizers``
(a transformers dependency) and matplotlib; not ``datasets``.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import lzma
import math
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments  # noqa: E402

import hf_rbf  # noqa: E402, F401  (registers the families)
from hf_rbf.eval.captured_mass import captured_mass, order_keys_for  # noqa: E402
from hf_rbf.trainer import HfRbfTrainer  # noqa: E402

logger = logging.getLogger("measure_captured_mass")
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "tinystories")
EOT = "<|endoftext|>"

SIZES = {
    "cpu": dict(
        hidden_size=128,
        num_attention_heads=8,
        num_hidden_layers=2,
        intermediate_size=344,
        vocab_size=2048,
        train_len=128,
        batch_size=16,
        steps=300,
        lr=3e-3,
        contexts=[128, 256, 512, 1024, 2048],
        windows=[8, 16, 32, 64],
        query_rows=64,
        chunk=512,
        device="cpu",
    ),
    "gpu": dict(
        hidden_size=512,
        num_attention_heads=8,
        num_hidden_layers=6,
        intermediate_size=1376,
        vocab_size=8192,
        train_len=512,
        batch_size=32,
        steps=1500,
        lr=1e-3,
        contexts=[128, 256, 512, 1024, 2048, 4096, 8192],
        windows=[8, 16, 32, 64],
        query_rows=256,
        chunk=1024,
        device="cuda",
    ),
}
# The regularized variant: L_align dominant (the gist's advice), L_spread on the fixed range [-3, 3], L_tau.
# L_align's gradient reaches the scalar projections only, as in the runs behind the model cards' numbers (the
# config's default, "upstream", is the gist's code; docs/scalar_sort.md).
REGULARIZERS = dict(
    align_loss_weight=1.0, spread_loss_weight=0.1, tau_loss_weight=0.1, align_gradient="scalar_projections"
)
FAMILIES = {
    # G = 2 value groups of 4 heads (the family default for H = 8), so the sort-head scheme differs from per-head
    "scalar_sort": dict(),
    # the hybrid's default G is H; 4 groups of 2 heads give the sort-head scheme something to share
    "hybrid_sort": dict(num_value_groups=4),
}
SCHEMES = ("per_head", "sort_head")


# ----------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------


def read_text(path: str) -> str:
    """A UTF-8 text file, optionally ``.xz``; a ``.jsonl[.xz]`` file gives its ``text`` fields joined by ``EOT``."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if ".jsonl" in path:
            return f"\n{EOT}\n".join(json.loads(line)["text"] for line in f if line.strip())
        return f.read()


def stories(text: str) -> list[str]:
    return [s.strip() for s in text.split(EOT) if s.strip()]


def train_tokenizer(texts: list[str], vocab_size: int, path: str):
    """A byte-level BPE trained on ``texts`` (kept in ``path`` and reused)."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.trainers import BpeTrainer

    if os.path.exists(path):
        return Tokenizer.from_file(path)
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = ByteLevelDecoder()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(path)
    return tok


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """Stories joined by the end-of-text token, as one id stream."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def blocks(stream: torch.Tensor, length: int) -> list[dict]:
    n = len(stream) // length
    return [{"input_ids": stream[i * length : (i + 1) * length]} for i in range(n)]


def collate(batch):
    ids = torch.stack([b["input_ids"] for b in batch])
    return {"input_ids": ids, "labels": ids.clone()}


# ----------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------


def model_config(family: str, size: dict, regularized: bool, vocab_size: int):
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=size["hidden_size"],
        num_attention_heads=size["num_attention_heads"],
        num_hidden_layers=size["num_hidden_layers"],
        intermediate_size=size["intermediate_size"],
        max_position_embeddings=max(size["contexts"]),
        attention_backend="auto",
    )
    kwargs.update(FAMILIES[family])
    if regularized:
        kwargs.update(REGULARIZERS)
    return AutoConfig.for_model(family, **kwargs)


def train(family, size, regularized, train_blocks, vocab_size, out_dir, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(family, size, regularized, vocab_size))
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=size["batch_size"],
        max_steps=size["steps"],
        learning_rate=size["lr"],
        lr_scheduler_type="cosine",
        warmup_steps=max(1, size["steps"] // 10),
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=max(1, size["steps"] // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=size["device"] == "cpu",
        bf16=size["device"] == "cuda",
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = HfRbfTrainer(model=model, args=args, train_dataset=train_blocks, data_collator=collate)
    start = time.time()
    trainer.train()
    model.save_pretrained(out_dir)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return model, logs, time.time() - start


@torch.no_grad()
def validation_loss(model, val_blocks, batch_size: int, device) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(val_blocks), batch_size):
        batch = collate(val_blocks[i : i + batch_size])
        ids = batch["input_ids"].to(device)
        logits = model(ids, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                 reduction="sum")  # fmt: skip
        total += loss.item()
        count += ids[:, 1:].numel()
    return total / count


# ----------------------------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------------------------


def _capture(store, index, module, args, kwargs):
    store.setdefault(index, []).append((args, kwargs))


@torch.no_grad()
def layer_inputs(model, ids: torch.Tensor, chunk: int) -> list[tuple]:
    """Per layer: ``(layer module, x [1, L, D], register_x or None, (cos, sin) [1, L, d/2])`` of the context ``ids``,
    captured during an exact chunked prefill through the model's sorted cache."""
    store: dict[int, list] = {}
    hooks = [
        layer.register_forward_pre_hook(partial(_capture, store, i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        cache = model.make_cache(decode_window=None)
        for start in range(0, ids.shape[1], chunk):
            model(ids[:, start : start + chunk], cache=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, layer in enumerate(model.model.layers):
        calls = store[i]
        x = layer.input_layernorm(torch.cat([a[0] for a, _ in calls], dim=1))
        reg = calls[0][0][1]
        rx = layer.input_layernorm.capped(reg) if reg is not None else None
        cos = torch.cat([kw["position_embeddings"][0] for _, kw in calls], dim=1)
        sin = torch.cat([kw["position_embeddings"][1] for _, kw in calls], dim=1)
        out.append((layer, x, rx, (cos, sin)))
    return out


@torch.no_grad()
def measure(model, stream, size, name) -> tuple[list[dict], dict]:
    """Captured mass for every context length, layer, head, window and scheme; and per-context diagnostics."""
    device = size["device"]
    rows, diag = [], {}
    for length in size["contexts"]:
        ids = stream[:length].unsqueeze(0).to(device)
        q = min(size["query_rows"], length // 2)
        query_rows = torch.arange(length - q, length, device=device)
        sink_share, align = [], []
        for layer_idx, (layer, x, rx, pos) in enumerate(layer_inputs(model, ids, size["chunk"])):
            attn = layer.self_attn
            if attn.kind == "dot" or attn.window is not None:
                continue
            weights, qs, ks, p = attn.attention_weights(x, rx, pos, query_rows)
            weights, qs, ks = weights[0].cpu(), qs[0].cpu(), ks[0].cpu()
            heads = [h for h, on in enumerate(attn.scalar_head_list) if on]
            sink_share.append(weights[heads, :, :p].sum(-1).mean().item())
            # the gist's alignment: expected squared scalar distance under the attention weights (text keys)
            d2 = (qs.unsqueeze(-1) - ks.unsqueeze(-2)) ** 2
            align.append((weights[heads, :, p:] * d2[heads]).sum(-1).mean().item())
            # the best any k keys could do: the k largest weights (plus the prefix), an upper bound for every scheme
            text = weights[..., p:]
            oracle = {k: weights[..., :p].sum(-1) + text.topk(min(k, text.shape[-1]), -1).values.sum(-1)
                      for k in size["windows"]}  # fmt: skip
            for scheme in SCHEMES:
                order = order_keys_for(ks, scheme, attn.num_value_groups, sort_head=0)
                mass = captured_mass(weights, p, order, qs, query_rows.cpu(), size["windows"])
                for k, m in mass.items():
                    for h in heads:
                        rows.append(
                            dict(
                                model=name,
                                layer=layer_idx,
                                head=h,
                                head_kind=getattr(attn, "head_kinds", ["scalar"] * attn.num_heads)[h],
                                context=length,
                                k=k,
                                scheme=scheme,
                                mean_mass=round(m[h].mean().item(), 6),
                                p10_mass=round(torch.quantile(m[h].double(), 0.1).item(), 6),
                                oracle_mass=round(oracle[k][h].mean().item(), 6),
                            )
                        )
        diag[length] = dict(sink_share=sum(sink_share) / len(sink_share), align=sum(align) / len(align))
        logger.info("%s: context %d measured", name, length)
    return rows, diag


def temperatures(model) -> list[list[float]]:
    """Per scalar layer, the per-head tau (for a per-token tau: at a zero input)."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.kind == "dot":
            continue
        x = torch.zeros(1, 1, model.config.hidden_size, device=model.device, dtype=model.dtype)
        out.append([round(t, 4) for t in attn.temperature(x).flatten().tolist()])
    return out


# ----------------------------------------------------------------------------------------------------------------
# reports
# ----------------------------------------------------------------------------------------------------------------


def _mean(rows, **where):
    vals = [r["mean_mass"] for r in rows if all(r[k] == v for k, v in where.items())]
    return sum(vals) / len(vals) if vals else float("nan")


def _oracle(rows, **where):
    vals = [r["oracle_mass"] for r in rows if all(r[k] == v for k, v in where.items())]
    return sum(vals) / len(vals) if vals else float("nan")


def _worst(rows, **where):
    """The worst (layer, head) average: per head, the mean over its queries; the minimum over heads."""
    vals = [r["mean_mass"] for r in rows if all(r[k] == v for k, v in where.items())]
    return min(vals) if vals else float("nan")


def markdown(rows, size, summary) -> str:
    models = sorted({r["model"] for r in rows})
    lines = ["# Captured attention mass of the sorted cache's window", ""]
    lines.append(
        "Share of each query's exact attention mass inside its `k`-window (plus the sink), averaged over the last "
        f"{size['query_rows']} query positions (at most half the context), the scalar heads and the layers; "
        "`worst head` = the lowest single (layer, head) average; `top-k oracle` = the mass of the k largest weights "
        "(the best any k keys could capture); `sink share` = the mass on the sink; `E_w[(qs-ks)^2]` = the gist's "
        "alignment (expected squared scalar distance under the attention weights, text keys).  Models: "
        f"d={size['hidden_size']}, H={size['num_attention_heads']}, {size['num_hidden_layers']} layers, trained "
        f"{size['steps']} steps on {size['train_len']}-token blocks of the TinyStories sample."
    )
    lines.append("")
    for name in models:
        s = summary["models"][name]
        lines.append(f"## {name}")
        lines.append("")
        lines.append(f"validation loss {s['validation_loss']:.3f}; tau per layer (mean over heads): "
                     + ", ".join(f"{sum(t) / len(t):.3f}" for t in s["tau"]))  # fmt: skip
        lines.append("")
        for scheme in SCHEMES:
            kmax = size["windows"][-1]
            header = ("| context | " + " | ".join(f"k={k}" for k in size["windows"])
                      + f" | worst head k={kmax} | top-{kmax} oracle | sink share | E_w[(qs-ks)^2] |")  # fmt: skip
            lines.append(f"{scheme} windows:")
            lines.append("")
            lines.append(header)
            lines.append("|" + "---|" * (len(size["windows"]) + 5))
            for length in size["contexts"]:
                cells = [f"{_mean(rows, model=name, scheme=scheme, context=length, k=k):.3f}" for k in size["windows"]]
                worst = _worst(rows, model=name, scheme=scheme, context=length, k=kmax)
                oracle = _oracle(rows, model=name, scheme=scheme, context=length, k=kmax)
                d = s["diagnostics"][str(length)]
                lines.append(f"| {length} | " + " | ".join(cells) + f" | {worst:.3f} | {oracle:.3f} | "
                             f"{d['sink_share']:.3f} | {d['align']:.4f} |")  # fmt: skip
            lines.append("")
    return "\n".join(lines)


def plot(rows, size, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["model"].rsplit("-", 1)[0] for r in rows})
    fig, axes = plt.subplots(len(families), len(SCHEMES), figsize=(6 * len(SCHEMES), 4 * len(families)), squeeze=False)
    colors = plt.cm.viridis([i / max(1, len(size["windows"]) - 1) for i in range(len(size["windows"]))])
    for fi, family in enumerate(families):
        for si, scheme in enumerate(SCHEMES):
            ax = axes[fi][si]
            for variant, style in (("regularized", "-"), ("plain", "--")):
                name = f"{family}-{variant}"
                for k, color in zip(size["windows"], colors):
                    ys = [_mean(rows, model=name, scheme=scheme, context=c, k=k) for c in size["contexts"]]
                    ax.plot(size["contexts"], ys, style, color=color, marker="o", ms=3, label=f"k={k} {variant}")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("context length")
            ax.set_ylabel("captured attention mass")
            ax.set_title(f"{family}, {scheme} windows")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--output", default="outputs/captured_mass")
    parser.add_argument("--train-files", nargs="*", default=[os.path.join(DATA, "train.txt")],
                        help="training text (.txt, .xz, .jsonl[.xz] with a 'text' field); stories split on "
                        f"{EOT!r}")  # fmt: skip
    parser.add_argument("--validation-file", default=os.path.join(DATA, "validation.txt"))
    parser.add_argument("--steps", type=int, help="override the size's training steps")
    parser.add_argument("--contexts", type=int, nargs="*", help="override the size's context lengths")
    parser.add_argument("--reuse", action="store_true", help="load models trained by an earlier run in --output")
    parser.add_argument("--families", nargs="*", choices=sorted(FAMILIES), default=list(FAMILIES),
                        help="train / measure only these families (e.g. one per call under a time limit, then a "
                        "final --reuse run over all of them)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    if args.contexts:
        size["contexts"] = sorted(args.contexts)
    if size["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--size gpu needs a CUDA device")
    os.makedirs(args.output, exist_ok=True)

    train_texts = [s for path in args.train_files for s in stories(read_text(path))]
    val_texts = stories(read_text(args.validation_file))
    tok = train_tokenizer(train_texts, size["vocab_size"], os.path.join(args.output, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    train_stream = encode_stream(tok, train_texts)
    val_stream = encode_stream(tok, val_texts)
    if len(val_stream) < max(size["contexts"]):
        raise SystemExit(f"the validation text has {len(val_stream)} tokens; contexts up to {max(size['contexts'])} "
                         "need more (pass a longer --validation-file)")  # fmt: skip
    train_blocks = blocks(train_stream, size["train_len"])
    val_blocks = blocks(val_stream, size["train_len"])
    logger.info("tokens: train %d, validation %d (vocab %d)", len(train_stream), len(val_stream), vocab)

    all_rows, summary = [], {"size": size, "regularizers": REGULARIZERS, "families": FAMILIES, "models": {}}
    previous = {}
    if args.reuse and os.path.exists(os.path.join(args.output, "summary.json")):
        with open(os.path.join(args.output, "summary.json")) as f:
            previous = json.load(f).get("models", {})
    for family in args.families:
        for variant in ("plain", "regularized"):
            name = f"{family}-{variant}"
            path = os.path.join(args.output, "models", name)
            logs, seconds = [], None
            if args.reuse and os.path.exists(os.path.join(path, "config.json")):
                model = AutoModelForCausalLM.from_pretrained(path)
                logs = [previous[name]["last_log"]] if previous.get(name, {}).get("last_log") else []
                seconds = previous.get(name, {}).get("train_seconds")
            else:
                model, logs, seconds = train(family, size, variant == "regularized", train_blocks, vocab, path,
                                             args.seed)  # fmt: skip
            model.to(size["device"]).eval()
            if size["device"] == "cuda":
                model.to(torch.bfloat16)
            val_loss = validation_loss(model, val_blocks, size["batch_size"], size["device"])
            rows, diag = measure(model, val_stream, size, name)
            all_rows.extend(rows)
            summary["models"][name] = dict(
                validation_loss=val_loss,
                tau=temperatures(model),
                diagnostics={str(k): v for k, v in diag.items()},
                train_seconds=seconds,
                last_log=logs[-1] if logs else None,
            )
            logger.info("%s: validation loss %.3f", name, val_loss)

    with open(os.path.join(args.output, "captured_mass.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(all_rows[0]))
        writer.writeheader()
        writer.writerows(all_rows)
    report = markdown(all_rows, size, summary)
    with open(os.path.join(args.output, "captured_mass.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(args.output, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    plot(all_rows, size, os.path.join(args.output, "captured_mass.png"))
    print(report)


if __name__ == "__main__":
    main()
