"""Evaluation of causal LMs: the CORE suite (DCLM / nanochat), bits per byte, and the ``core_centered`` metric.

Models never import this sub-package.  Entry points: :func:`evaluate_core`, :func:`bits_per_byte`, and the CLIs
``recipes/eval_core.py`` and ``recipes/eval_bpb.py``; see ``docs/evaluation.md``.
"""

from .bpb import bits_per_byte, read_documents
from .core import METRIC_DIR, evaluate_core, format_table, load_core_centered_metric
from .core_tasks import CORE_TASKS, load_core_tasks
from .loading import load_model_and_tokenizer


__all__ = [
    "CORE_TASKS",
    "METRIC_DIR",
    "bits_per_byte",
    "evaluate_core",
    "format_table",
    "load_core_centered_metric",
    "load_core_tasks",
    "load_model_and_tokenizer",
    "read_documents",
]
