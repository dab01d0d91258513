"""CORE evaluation (DCLM's in-context-learning suite, as nanochat's ``core_eval`` computes it) for any causal LM.

Per example (prompts and spans: :mod:`hf_rbf.eval.core_prompts`):

- multiple_choice / schema: the mean cross-entropy (nats per token) of each option's scored span; the option with the
  lowest mean is the prediction (the first one on a tie), correct when it is ``gold``;
- language_modeling: correct when the argmax of the logits equals the true next token at every position of the
  answer (the true tokens are fed in; no partial credit).

Per task the accuracy is the fraction correct, the centered score ``(acc - b) / (1 - b)`` with ``b`` the task's
random baseline, and the suite's score the plain mean of the centered scores; those last two come from the
``core_centered`` ``evaluate`` metric shipped in ``hf_rbf/eval/metrics/``.

Batching: all sequences of a task (every option of every example) are sorted by length and run ``batch_size`` at a
time, padded on the right.  Causal attention keeps a position from seeing the padding after it, and an
``attention_mask`` marks the padding too, so an example's scores do not depend on what it is batched with (up to
floating-point summation order).  When the model's ``forward`` takes ``logits_to_keep`` (transformers' causal LMs
do) only the logits of positions that some row scores are computed.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .core_prompts import (
    Encoder,
    ScoredSequence,
    build_sequences,
    crop_left,
    draw_fewshot,
    hf_encoder,
    render_example,
)
from .core_tasks import CORE_TASKS, CoreTask, load_core_tasks


logger = logging.getLogger(__name__)

METRIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "core_centered")


@dataclass
class SequenceScore:
    """Scores of one :class:`ScoredSequence`'s span.

    ``sum_loss``: summed cross-entropy in nats (accumulated in float64); ``mean_loss``: per scored token;
    ``greedy_match``: the argmax token equals the target at every position of the span.
    """

    sum_loss: float
    num_tokens: int
    greedy_match: bool

    @property
    def mean_loss(self) -> float:
        return self.sum_loss / self.num_tokens if self.num_tokens else math.nan


@dataclass
class TaskResult:
    """One task's outcome. ``correct[i]`` is example ``i`` of ``task.data`` (the shuffled, capped order)."""

    label: str
    task_type: str
    num_fewshot: int
    random_baseline: float
    correct: list = field(repr=False)
    predictions: list = field(repr=False)
    num_cropped: int = 0
    boundary_fallbacks: int = 0
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


def resolve_bos_id(tokenizer, bos="auto") -> int | None:
    """The id prepended to every prompt.

    ``"auto"``: the tokenizer's BOS token, else its EOS token (GPT-2 style tokenizers mark document starts with
    ``<|endoftext|>``, which nanochat also uses as BOS); ``None`` or ``"none"``: nothing prepended; an int: that id.
    """
    if bos is None or bos == "none":
        return None
    if isinstance(bos, int):
        return bos
    if bos != "auto":
        raise ValueError(f"bos={bos!r}: allowed values are 'auto', 'none' or a token id")
    for attr in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise ValueError("bos='auto': the tokenizer has neither a BOS nor an EOS token; pass bos=<id> or bos='none'")


def model_context_length(model) -> int | None:
    """The longest input the model takes, from its config (None when the config names no limit)."""
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx", "max_sequence_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return getattr(model, "max_seq_len", None)


def _accepts_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


@torch.no_grad()
def score_sequences(
    model,
    sequences: list[ScoredSequence],
    batch_size: int = 16,
    pad_id: int = 0,
    device=None,
    logits_to_keep: str = "auto",
) -> list[SequenceScore]:
    """Summed loss and greedy match of each sequence's span, running the model ``batch_size`` sequences at a time.

    Args:
        model: a causal LM; ``model(input_ids=..., attention_mask=...)`` returns an object with ``.logits``
            ``[B, T, V]`` (or ``[B, K, V]`` for ``logits_to_keep``).
        sequences: the spans to score; every ``start >= 1``.
        pad_id: the token written into right padding (never scored).
        logits_to_keep: "auto" passes the positions to keep when ``model.forward`` has that argument; "off" never.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if logits_to_keep not in ("auto", "off"):
        raise ValueError(f"logits_to_keep={logits_to_keep!r}: allowed values are 'auto', 'off'")
    if device is None:
        device = next(model.parameters()).device
    keep = logits_to_keep == "auto" and _accepts_logits_to_keep(model)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].tokens))
    results: list[SequenceScore | None] = [None] * len(sequences)
    for b in range(0, len(order), batch_size):
        rows = [sequences[i] for i in order[b : b + batch_size]]
        width = max(len(s.tokens) for s in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, s in enumerate(rows):
            input_ids[r, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
            attention_mask[r, : len(s.tokens)] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        kwargs = {}
        if keep:
            # Logit positions start-1 .. end-2 predict the span; keep their union over the rows.
            needed = sorted({p for s in rows for p in range(s.start - 1, s.end - 1)})
            positions = torch.tensor(needed, dtype=torch.long, device=device)
            kwargs["logits_to_keep"] = positions
            column = {p: c for c, p in enumerate(needed)}
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        if keep and logits.shape[1] != len(needed):
            raise RuntimeError(
                f"model returned logits for {logits.shape[1]} positions after logits_to_keep asked for {len(needed)}; "
                "use logits_to_keep='off' for this model"
            )
        # Gather every scored position of the batch at once: one cross-entropy, one transfer to the host.
        row_idx, col_idx, target_pos = [], [], []
        for r, s in enumerate(rows):
            for p in range(s.start - 1, s.end - 1):
                row_idx.append(r)
                col_idx.append(column[p] if keep else p)
                target_pos.append(p + 1)
        ri = torch.tensor(row_idx, dtype=torch.long, device=logits.device)
        ci = torch.tensor(col_idx, dtype=torch.long, device=logits.device)
        ti = torch.tensor(target_pos, dtype=torch.long, device=logits.device)
        picked = logits[ri, ci].float()
        targets = input_ids[ri, ti]
        losses = F.cross_entropy(picked, targets, reduction="none").cpu().double()
        misses = (picked.argmax(dim=-1) != targets).cpu().long()
        ri = ri.cpu()
        sums = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, ri, losses).tolist()
        wrong = torch.zeros(len(rows), dtype=torch.long).index_add_(0, ri, misses).tolist()
        for r, s in enumerate(rows):
            results[order[b + r]] = SequenceScore(sums[r], s.end - s.start, wrong[r] == 0)
    return results


def task_sequences(
    task: CoreTask, encode: Encoder, bos_id: int | None, max_len: int | None
) -> tuple[list[list[ScoredSequence]], int]:
    """Every example's scored sequences (after cropping to ``max_len``) and how many hit the LM boundary fallback."""
    per_example, fallbacks = [], 0
    for idx, item in enumerate(task.data):
        shots = draw_fewshot(task.data, idx, task.num_fewshot)
        prompts = render_example(task.task_type, item, task.continuation_delimiter, shots)
        sequences, fallback = build_sequences(task.task_type, prompts, encode, bos_id)
        fallbacks += fallback
        try:
            per_example.append([crop_left(s, max_len) for s in sequences])
        except ValueError as err:
            raise ValueError(f"task {task.label!r}, example {idx}: {err}") from None
    return per_example, fallbacks


def evaluate_task(
    model,
    task: CoreTask,
    encode: Encoder,
    bos_id: int | None,
    max_len: int | None = None,
    batch_size: int = 16,
    device=None,
    pad_id: int | None = None,
    logits_to_keep: str = "auto",
) -> TaskResult:
    """Score every example of one task (see the module docstring for the rule per task type)."""
    t0 = time.perf_counter()
    per_example, fallbacks = task_sequences(task, encode, bos_id, max_len)
    flat = [s for seqs in per_example for s in seqs]
    pad = pad_id if pad_id is not None else (bos_id if bos_id is not None else 0)
    scores = score_sequences(model, flat, batch_size, pad, device, logits_to_keep)
    correct, predictions, pos = [], [], 0
    for idx, seqs in enumerate(per_example):
        ex_scores = scores[pos : pos + len(seqs)]
        pos += len(seqs)
        if task.task_type == "language_modeling":
            ok = ex_scores[0].greedy_match
            predictions.append(ok)
        else:
            losses = [s.mean_loss for s in ex_scores]
            # An empty span (two identical options) has a NaN mean; it cannot win.
            ranked = [x if math.isfinite(x) else math.inf for x in losses]
            pred = ranked.index(min(ranked))
            ok = pred == task.data[idx]["gold"]
            predictions.append(pred)
        correct.append(bool(ok))
    return TaskResult(
        label=task.label,
        task_type=task.task_type,
        num_fewshot=task.num_fewshot,
        random_baseline=task.random_baseline,
        correct=correct,
        predictions=predictions,
        num_cropped=sum(1 for seqs in per_example if any(s.cropped for s in seqs)),
        boundary_fallbacks=fallbacks,
        seconds=time.perf_counter() - t0,
    )


def load_core_centered_metric():
    """The ``core_centered`` metric, loaded by local path (no hub access)."""
    import evaluate

    return evaluate.load(METRIC_DIR, keep_in_memory=True)


def aggregate(results: list[TaskResult], baseline_version: str = "v1") -> dict:
    """Per-task accuracy and centered score and their mean, through the ``core_centered`` metric."""
    metric = load_core_centered_metric()
    correct = [float(c) for r in results for c in r.correct]
    labels = [r.label for r in results for _ in r.correct]
    baselines = {r.label: r.random_baseline for r in results}
    return metric.compute(correct=correct, task=labels, random_baseline_percent=baselines, baseline_version=baseline_version)


def evaluate_core(
    model,
    tokenizer,
    bundle_dir: str,
    *,
    tasks: list[str] | None = None,
    max_per_task: int = -1,
    batch_size: int = 16,
    baselines: str = "v1",
    meta_csv: str | None = None,
    max_seq_len: int | str | None = "auto",
    bos="auto",
    device=None,
    logits_to_keep: str = "auto",
    encode: Encoder | None = None,
    log=print,
) -> dict:
    """Evaluate a causal LM on the CORE tasks of a bundle.

    Args:
        model: a causal LM (``AutoModelForCausalLM`` or anything returning ``.logits``), already on ``device``.
        tokenizer: its ``transformers`` tokenizer (used for encoding unless ``encode`` is given, and for the BOS id).
        bundle_dir: a bundle in the DCLM eval-bundle layout (see :mod:`hf_rbf.eval.core_tasks`).
        tasks: labels to evaluate (default: every task whose data is in the bundle).
        max_per_task: examples per task after nanochat's seeded shuffle (-1: all).
        batch_size: sequences per forward pass (an example has one per choice / option).
        baselines: "v1" (nanochat's, default) or "v2" (DCLM Core_v2).
        meta_csv: take the baselines from this DCLM meta CSV instead.
        max_seq_len: left-crop prompts to this many tokens; "auto" reads the model config
            (``max_position_embeddings`` and the like), None never crops.
        bos: "auto" (BOS, else EOS), "none" or a token id prepended to every prompt.
        log: called with progress lines (None for silence).

    Returns:
        A JSON-ready dict: ``label`` ("CORE" for all 22 tasks, "CORE-20" without squad and coqa, else
        "CORE-<n>"), ``core_metric`` (mean centered score), ``tasks`` (per task: accuracy, centered,
        num_examples, random_baseline, ...), ``missing_tasks`` (CORE tasks not evaluated), and the settings used.
    """
    log = log or (lambda *a, **k: None)
    if max_seq_len == "auto":
        max_seq_len = model_context_length(model)
    elif max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 2):
        raise ValueError(f"max_seq_len={max_seq_len!r}: allowed values are 'auto', None or an int >= 2")
    bos_id = resolve_bos_id(tokenizer, bos)
    encode = encode or hf_encoder(tokenizer)
    loaded, skipped, baseline_source = load_core_tasks(bundle_dir, tasks, max_per_task, baselines, meta_csv)
    if not loaded:
        raise ValueError(f"bundle={bundle_dir!r}: no task to evaluate")
    if skipped:
        log(f"not in the bundle, skipped: {', '.join(skipped)}")
    results = []
    for task in loaded:
        result = evaluate_task(model, task, encode, bos_id, max_seq_len, batch_size, device, logits_to_keep=logits_to_keep)
        results.append(result)
        log(
            f"{task.label:<34} {task.task_type:<17} {task.num_fewshot:>2}-shot  n={len(result.correct):<6} "
            f"acc={result.accuracy:.4f}  ({result.seconds:.1f}s)"
        )
        if result.boundary_fallbacks:
            log(f"  {task.label}: {result.boundary_fallbacks} answers encoded separately (tokenizer merged the boundary)")
    summary = aggregate(results, baselines)
    out = {
        "label": summary["label"],
        "core_metric": summary["core_metric"],
        "num_tasks": summary["num_tasks"],
        "missing_tasks": summary["missing_tasks"],
        "baselines": baselines,
        "baseline_source": baseline_source,
        "tasks": {},
        "settings": {
            "bundle": os.path.abspath(bundle_dir),
            "max_per_task": max_per_task,
            "batch_size": batch_size,
            "max_seq_len": max_seq_len,
            "bos_id": bos_id,
            "logits_to_keep": logits_to_keep == "auto" and _accepts_logits_to_keep(model),
            "few_shot_seed": "1234 + example index",
            "shuffle_seed": 1337,
        },
    }
    for r in results:
        out["tasks"][r.label] = {
            "task_type": r.task_type,
            "num_fewshot": r.num_fewshot,
            "num_examples": len(r.correct),
            "accuracy": summary["accuracy"][r.label],
            "random_baseline": r.random_baseline,
            "centered": summary["centered"][r.label],
            "num_cropped": r.num_cropped,
            "boundary_fallbacks": r.boundary_fallbacks,
            "seconds": round(r.seconds, 3),
        }
    return out


def format_table(out: dict) -> str:
    """A plain-text table of :func:`evaluate_core`'s output."""
    lines = [f"{'task':<34} {'type':<17} {'shots':>5} {'n':>6} {'accuracy':>9} {'baseline':>9} {'centered':>9}"]
    for label, t in out["tasks"].items():
        lines.append(
            f"{label:<34} {t['task_type']:<17} {t['num_fewshot']:>5} {t['num_examples']:>6} "
            f"{t['accuracy']:>9.4f} {t['random_baseline'] / 100:>9.3f} {t['centered']:>9.4f}"
        )
    lines.append(f"{out['label'] + ' (' + out['baselines'] + ' baselines)':<34} {'':<17} {'':>5} {'':>6} {'':>9} {'':>9} {out['core_metric']:>9.4f}")
    if out["missing_tasks"]:
        lines.append(f"missing from the 22-task CORE: {', '.join(out['missing_tasks'])}")
    return "\n".join(lines)


__all__ = [
    "CORE_TASKS",
    "METRIC_DIR",
    "SequenceScore",
    "TaskResult",
    "aggregate",
    "evaluate_core",
    "evaluate_task",
    "format_table",
    "load_core_centered_metric",
    "model_context_length",
    "resolve_bos_id",
    "score_sequences",
    "task_sequences",
]
