"""core_centered: DCLM's centered accuracy per task and its mean over tasks (the CORE score), as an ``evaluate`` metric.

Load it by path, no hub access needed::

    metric = evaluate.load("<repo>/hf_rbf/eval/metrics/core_centered")
"""

import math

import datasets
import evaluate


_CITATION = """\
@article{li2024datacomplm,
  title={DataComp-LM: In search of the next generation of training sets for language models},
  author={Li, Jeffrey and Fang, Alex and Smyrnis, Georgios and others},
  journal={arXiv preprint arXiv:2406.11794},
  year={2024}
}
"""

_DESCRIPTION = """\
Centered accuracy (acc - b) / (1 - b) of each task, with b the task's random baseline (a fraction), and the plain
mean of the centered accuracies over the tasks given. Over DCLM's 22 "low variance" tasks that mean is the CORE score
(nanochat's base-model metric); over those 20 without squad and coqa it is labelled CORE-20.
"""

_KWARGS_DESCRIPTION = """
Args:
    correct (`list` of `float` in [0, 1]): one entry per example, 1 for a correct answer and 0 otherwise. A task
        can also be given as a single row holding its accuracy: the task's accuracy is the mean of its rows.
    task (`list` of `str`): the task label of each row.
    random_baseline_percent (`dict` of `str` to `float`, optional): random baseline of each task, in percent as in
        DCLM's eval_meta_data CSV (25 means b = 0.25). Tasks not listed take the built-in CORE table of
        `baseline_version`; a task in neither is an error.
    baseline_version (`str`, optional, default "v1"): the built-in table, "v1" (DCLM's values before Sept 2025,
        used by nanochat) or "v2" (DCLM's corrected values).
Returns:
    accuracy (`dict`): per-task accuracy.
    centered (`dict`): per-task centered accuracy (acc - b) / (1 - b).
    count (`dict`): rows per task.
    random_baseline (`dict`): the baseline used per task, in percent.
    core_metric (`float`): the mean of the centered accuracies.
    num_tasks (`int`): how many tasks the mean is over.
    label (`str`): "CORE" when the tasks are the 22 CORE tasks, "CORE-<n>" for a subset of them (so "CORE-20"
        without squad and coqa), "mean-centered-<n>" when some task is not a CORE task.
    missing_tasks (`list`): CORE tasks that were not given.
Examples:
    >>> metric = evaluate.load("hf_rbf/eval/metrics/core_centered")
    >>> out = metric.compute(correct=[1, 0, 1, 1], task=["copa", "copa", "piqa", "piqa"])
    >>> out["centered"]
    {'copa': 0.0, 'piqa': 1.0}
"""

CORE_TASKS = (
    "hellaswag_zeroshot", "jeopardy", "bigbench_qa_wikidata", "arc_easy", "arc_challenge", "copa", "commonsense_qa",
    "piqa", "openbook_qa", "lambada_openai", "hellaswag", "winograd", "winogrande", "bigbench_dyck_languages",
    "agi_eval_lsat_ar", "bigbench_cs_algorithms", "bigbench_operators", "bigbench_repeat_copy_logic", "squad", "coqa",
    "boolq", "bigbench_language_identification",
)

# Random baselines in percent: mlfoundations/dclm eval/eval_meta_data_v1.csv (v1, nanochat's bundle) and
# eval/eval_meta_data.csv (v2) at commit 361714bdd60bb9b7f4b2d8354cebbf0dec0c329e.  Only four tasks differ.
_V1 = {task: 0.0 for task in CORE_TASKS}
_V1.update({
    "hellaswag_zeroshot": 25.0, "arc_easy": 25.0, "arc_challenge": 25.0, "copa": 50.0, "commonsense_qa": 20.0,
    "piqa": 50.0, "openbook_qa": 25.0, "hellaswag": 25.0, "winograd": 50.0, "winogrande": 50.0,
    "agi_eval_lsat_ar": 20.0, "boolq": 62.0, "bigbench_language_identification": 9.1,
})
_V2 = dict(_V1, commonsense_qa=40.3, agi_eval_lsat_ar=25.0, bigbench_language_identification=25.0)
RANDOM_BASELINES = {"v1": _V1, "v2": _V2}


def core_label(tasks):
    """The name of a mean over ``tasks`` and the CORE tasks it leaves out."""
    tasks = set(tasks)
    missing = [t for t in CORE_TASKS if t not in tasks]
    if not tasks <= set(CORE_TASKS):
        return f"mean-centered-{len(tasks)}", missing
    return ("CORE" if not missing else f"CORE-{len(tasks)}"), missing


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class CoreCentered(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"correct": datasets.Value("float64"), "task": datasets.Value("string")}),
            reference_urls=[
                "https://arxiv.org/abs/2406.11794",
                "https://github.com/mlfoundations/dclm",
                "https://github.com/karpathy/nanochat",
            ],
        )

    def _compute(self, correct, task, random_baseline_percent=None, baseline_version="v1"):
        if baseline_version not in RANDOM_BASELINES:
            raise ValueError(f"baseline_version={baseline_version!r}: allowed values are {sorted(RANDOM_BASELINES)}")
        if len(correct) == 0:
            raise ValueError("correct: no rows given")
        table = dict(RANDOM_BASELINES[baseline_version])
        table.update(random_baseline_percent or {})
        sums, counts = {}, {}
        for value, label in zip(correct, task):
            value = float(value)
            if not 0.0 <= value <= 1.0 or math.isnan(value):
                raise ValueError(f"correct: {value} for task {label!r} is outside [0, 1]")
            sums[label] = sums.get(label, 0.0) + value
            counts[label] = counts.get(label, 0) + 1
        unknown = [label for label in sums if label not in table]
        if unknown:
            raise ValueError(f"task: no random baseline for {unknown}; pass random_baseline_percent={{task: percent}}")
        accuracy, centered, baselines = {}, {}, {}
        for label in sums:
            b = float(table[label])
            if not 0.0 <= b < 100.0:
                raise ValueError(f"random_baseline_percent[{label!r}]={b}: must be a percentage in [0, 100)")
            acc = sums[label] / counts[label]
            accuracy[label] = acc
            baselines[label] = b
            centered[label] = (acc - 0.01 * b) / (1.0 - 0.01 * b)
        label, missing = core_label(sums)
        return {
            "accuracy": accuracy,
            "centered": centered,
            "count": counts,
            "random_baseline": baselines,
            "core_metric": sum(centered.values()) / len(centered),
            "num_tasks": len(centered),
            "label": label,
            "missing_tasks": missing,
        }
