"""The CORE suite's tasks, read from a bundle in the DCLM / llm-foundry eval-bundle layout.

A bundle is a folder with

- ``core.yaml``: ``icl_tasks``, a list of tasks, each with ``label``, ``dataset_uri`` (relative to ``eval_data/``),
  ``num_fewshot`` (a one-element list), ``icl_task_type`` (``multiple_choice``, ``schema`` or
  ``language_modeling``) and optionally ``continuation_delimiter`` (default one space).  The project's copy
  (``shared/data/core/core.yaml``) also carries ``random_baseline_v1`` / ``random_baseline_v2`` (percent) and
  ``available: false`` for tasks whose data is not shipped (squad, coqa).
- ``eval_data/<category>/<task>.jsonl``: one JSON object per line (schemas in :data:`REQUIRED_FIELDS`).
- a meta-data CSV with the columns ``Eval Task`` and ``Random baseline`` (percent).  nanochat's bundle calls its
  copy ``eval_meta_data.csv`` and it holds DCLM's *v1* baselines; DCLM's repository now ships the corrected *v2*
  values under that same name, so the project's bundle keeps them apart as ``dclm_eval_meta_data_v1.csv`` (v1) and
  ``dclm_eval_meta_data.csv`` (v2).

The CORE score is the mean over DCLM's 22 ``low_variance_datasets`` (:data:`CORE_TASKS`) of the centered accuracy
``(acc - b) / (1 - b)``.  Without squad and coqa it is a 20-task mean, reported as "CORE-20".
"""

from __future__ import annotations

import csv
import json
import os
import random
from dataclasses import dataclass, field

import yaml


# DCLM's low_variance_datasets (mlfoundations/dclm eval/additional_aggregation.json), in core.yaml's order.
CORE_TASKS = (
    "hellaswag_zeroshot",
    "jeopardy",
    "bigbench_qa_wikidata",
    "arc_easy",
    "arc_challenge",
    "copa",
    "commonsense_qa",
    "piqa",
    "openbook_qa",
    "lambada_openai",
    "hellaswag",
    "winograd",
    "winogrande",
    "bigbench_dyck_languages",
    "agi_eval_lsat_ar",
    "bigbench_cs_algorithms",
    "bigbench_operators",
    "bigbench_repeat_copy_logic",
    "squad",
    "coqa",
    "boolq",
    "bigbench_language_identification",
)

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")

REQUIRED_FIELDS = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}

BASELINE_VERSIONS = ("v1", "v2")

# Meta CSV file names searched in the bundle, per baseline version (first found wins).
META_CSV_NAMES = {
    "v1": ("dclm_eval_meta_data_v1.csv", "eval_meta_data_v1.csv", "eval_meta_data.csv"),
    "v2": ("dclm_eval_meta_data.csv", "eval_meta_data_v2.csv"),
}

# nanochat shuffles every task file with this seed before capping it with max_per_task.
SHUFFLE_SEED = 1337


@dataclass
class CoreTask:
    """One CORE task, ready to evaluate.

    ``data`` is the task file after the seeded shuffle and the optional cap; few-shot examples are drawn from
    ``data`` itself (as nanochat does), so capping also shrinks the few-shot pool.  ``random_baseline`` is in
    percent, as in the DCLM CSVs.
    """

    label: str
    task_type: str
    num_fewshot: int
    continuation_delimiter: str
    dataset_uri: str
    random_baseline: float
    data: list = field(repr=False, default_factory=list)
    num_examples_in_file: int = 0


def read_core_config(bundle_dir: str) -> list[dict]:
    """Return the ``icl_tasks`` list of ``<bundle_dir>/core.yaml``."""
    path = os.path.join(bundle_dir, "core.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"bundle={bundle_dir!r} has no core.yaml (expected the DCLM eval-bundle layout)")
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict) or not isinstance(config.get("icl_tasks"), list):
        raise ValueError(f"{path}: expected a mapping with an 'icl_tasks' list")
    return config["icl_tasks"]


def read_meta_csv(path: str) -> dict[str, float]:
    """Random baselines (percent) by task label from a DCLM meta-data CSV (``Eval Task``, ``Random baseline``)."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "Eval Task" not in reader.fieldnames or "Random baseline" not in reader.fieldnames:
            raise ValueError(f"{path}: expected the columns 'Eval Task' and 'Random baseline', got {reader.fieldnames}")
        return {row["Eval Task"]: float(row["Random baseline"]) for row in reader}


def find_meta_csv(bundle_dir: str, version: str) -> str | None:
    """The bundle's meta CSV for a baseline version, or None (see :data:`META_CSV_NAMES`)."""
    for name in META_CSV_NAMES[version]:
        path = os.path.join(bundle_dir, name)
        if os.path.isfile(path):
            return path
    return None


def load_random_baselines(
    bundle_dir: str, labels: list[str], version: str = "v1", meta_csv: str | None = None
) -> tuple[dict[str, float], str]:
    """Random baselines (percent) for ``labels`` and a note saying where they came from.

    Order: an explicit ``meta_csv``; else ``random_baseline_<version>`` in core.yaml when every listed task has it;
    else the bundle's CSV for that version (:data:`META_CSV_NAMES`).
    """
    if version not in BASELINE_VERSIONS:
        raise ValueError(f"baselines={version!r}: allowed values are {BASELINE_VERSIONS}")
    if meta_csv is not None:
        table, source = read_meta_csv(meta_csv), meta_csv
    else:
        key = f"random_baseline_{version}"
        entries = {t["label"]: t for t in read_core_config(bundle_dir)}
        if all(key in entries.get(label, {}) for label in labels):
            return {label: float(entries[label][key]) for label in labels}, f"core.yaml:{key}"
        path = find_meta_csv(bundle_dir, version)
        if path is None:
            raise FileNotFoundError(
                f"bundle={bundle_dir!r}: no {version} random baselines (core.yaml has no {key} and none of "
                f"{META_CSV_NAMES[version]} exists); pass meta_csv=<path to a DCLM eval_meta_data CSV>"
            )
        table, source = read_meta_csv(path), path
    missing = [label for label in labels if label not in table]
    if missing:
        raise ValueError(f"{source}: no random baseline for tasks {missing}")
    return {label: table[label] for label in labels}, source


def shuffle_and_cap(data: list, max_per_task: int = -1, seed: int = SHUFFLE_SEED) -> list:
    """nanochat's order: shuffle a copy with ``random.Random(seed)``, then keep the first ``max_per_task`` (-1: all)."""
    data = list(data)
    random.Random(seed).shuffle(data)
    if max_per_task is not None and max_per_task > 0:
        data = data[:max_per_task]
    return data


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_examples(label: str, task_type: str, data: list[dict], path: str) -> None:
    for i, item in enumerate(data):
        missing = [k for k in REQUIRED_FIELDS[task_type] if k not in item]
        if missing:
            raise ValueError(f"{path} line {i + 1}: a {task_type} example of task {label!r} lacks the fields {missing}")
        if task_type == "multiple_choice" and not 0 <= item["gold"] < len(item["choices"]):
            raise ValueError(f"{path} line {i + 1}: gold={item['gold']} is not an index of the {len(item['choices'])} choices")
        if task_type == "schema" and not 0 <= item["gold"] < len(item["context_options"]):
            raise ValueError(f"{path} line {i + 1}: gold={item['gold']} is not an index of the context options")


def load_core_tasks(
    bundle_dir: str,
    tasks: list[str] | None = None,
    max_per_task: int = -1,
    baselines: str = "v1",
    meta_csv: str | None = None,
) -> tuple[list[CoreTask], list[str], str]:
    """Read the tasks of a bundle.

    Args:
        bundle_dir: folder with ``core.yaml``, ``eval_data/`` and (unless core.yaml carries them) the meta CSVs.
        tasks: labels to load, in this order; None loads every task of core.yaml whose data file exists.
            Asking for a task whose data is absent is an error.
        max_per_task: keep this many examples per task after the shuffle (-1 or None: all).
        baselines: "v1" (nanochat's values, the default) or "v2" (DCLM's corrected Sept 2025 values).
        meta_csv: a CSV to take the baselines from instead.

    Returns:
        ``(tasks, skipped, baseline_source)``: the loaded :class:`CoreTask` list, the labels listed in core.yaml
        that were left out because their data is not in the bundle, and where the baselines came from.
    """
    entries = read_core_config(bundle_dir)
    by_label = {}
    for entry in entries:
        if "label" not in entry:
            raise ValueError(f"{bundle_dir}/core.yaml: a task entry has no label: {entry}")
        by_label[entry["label"]] = entry
    if tasks is not None:
        unknown = [t for t in tasks if t not in by_label]
        if unknown:
            raise ValueError(f"tasks={unknown} are not in {bundle_dir}/core.yaml; allowed values are {list(by_label)}")

    def data_path(entry):
        return os.path.join(bundle_dir, "eval_data", entry["dataset_uri"])

    wanted = list(tasks) if tasks is not None else list(by_label)
    skipped = []
    selected = []
    for label in wanted:
        entry = by_label[label]
        present = entry.get("available", True) and os.path.isfile(data_path(entry))
        if not present:
            if tasks is not None:
                raise FileNotFoundError(f"task {label!r}: data file {data_path(entry)} is not in the bundle")
            skipped.append(label)
            continue
        selected.append(entry)

    labels = [e["label"] for e in selected]
    baseline_table, baseline_source = load_random_baselines(bundle_dir, labels, baselines, meta_csv)

    loaded = []
    for entry in selected:
        label = entry["label"]
        task_type = entry.get("icl_task_type")
        if task_type not in TASK_TYPES:
            raise ValueError(f"task {label!r}: icl_task_type={task_type!r}; allowed values are {TASK_TYPES}")
        shots = entry.get("num_fewshot", [0])
        shots = shots[0] if isinstance(shots, list) else shots
        path = data_path(entry)
        raw = read_jsonl(path)
        _check_examples(label, task_type, raw, path)
        baseline = baseline_table[label]
        if not 0 <= baseline < 100:
            raise ValueError(f"task {label!r}: random baseline {baseline} must be a percentage in [0, 100)")
        loaded.append(
            CoreTask(
                label=label,
                task_type=task_type,
                num_fewshot=int(shots),
                continuation_delimiter=entry.get("continuation_delimiter", " "),
                dataset_uri=entry["dataset_uri"],
                random_baseline=baseline,
                data=shuffle_and_cap(raw, max_per_task),
                num_examples_in_file=len(raw),
            )
        )
    return loaded, skipped, baseline_source
