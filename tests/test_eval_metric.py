"""The core_centered ``evaluate`` metric: loaded by local path with no hub access, centered scores, labels."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_helpers import CORE_SAMPLE, isolate_hf_caches  # noqa: E402

from hf_rbf.eval.core import METRIC_DIR, load_core_centered_metric  # noqa: E402
from hf_rbf.eval.core_tasks import CORE_TASKS, read_meta_csv  # noqa: E402


@pytest.fixture
def metric(tmp_path, monkeypatch):
    isolate_hf_caches(monkeypatch, tmp_path / "hf_home")
    return load_core_centered_metric()


def test_loads_by_path_in_an_offline_process(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    env.pop("HF_MODULES_CACHE", None)
    code = (
        "import evaluate, sys; m = evaluate.load(sys.argv[1], keep_in_memory=True); "
        "print(m.compute(correct=[1, 1, 0, 1], task=['boolq'] * 4)['centered']['boolq'])"
    )
    proc = subprocess.run([sys.executable, "-c", code, METRIC_DIR], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) == pytest.approx((0.75 - 0.62) / 0.38)
    assert os.path.isdir(tmp_path / "hf_home" / "modules")  # the module copy went to the temporary HF_HOME


def test_per_example_and_per_task_inputs(metric):
    out = metric.compute(correct=[1, 0, 1, 1, 0, 0, 0, 1], task=["copa"] * 2 + ["arc_easy"] * 4 + ["jeopardy"] * 2)
    assert out["accuracy"] == {"copa": 0.5, "arc_easy": 0.5, "jeopardy": 0.5}
    assert out["count"] == {"copa": 2, "arc_easy": 4, "jeopardy": 2}
    assert out["centered"]["copa"] == pytest.approx(0.0)
    assert out["centered"]["arc_easy"] == pytest.approx((0.5 - 0.25) / 0.75)
    assert out["centered"]["jeopardy"] == pytest.approx(0.5)
    assert out["core_metric"] == pytest.approx((0 + 1 / 3 + 0.5) / 3)
    assert out["label"] == "CORE-3" and len(out["missing_tasks"]) == 19
    # one row per task holding its accuracy gives the same centered scores
    per_task = metric.compute(correct=[0.5, 0.5, 0.5], task=["copa", "arc_easy", "jeopardy"])
    assert per_task["centered"] == pytest.approx(out["centered"]) and per_task["core_metric"] == pytest.approx(out["core_metric"])


def test_baseline_tables_match_the_dclm_csvs(metric):
    v1 = read_meta_csv(os.path.join(CORE_SAMPLE, "dclm_eval_meta_data_v1.csv"))
    v2 = read_meta_csv(os.path.join(CORE_SAMPLE, "dclm_eval_meta_data.csv"))
    for version, table in (("v1", v1), ("v2", v2)):
        out = metric.compute(correct=[0.0] * len(CORE_TASKS), task=list(CORE_TASKS), baseline_version=version)
        assert out["random_baseline"] == {t: table[t] for t in CORE_TASKS}
        assert out["label"] == "CORE" and out["missing_tasks"] == [] and out["num_tasks"] == 22
        for t in CORE_TASKS:
            b = table[t] / 100
            assert out["centered"][t] == pytest.approx(-b / (1 - b))


def test_labels_overrides_and_errors(metric):
    twenty = [t for t in CORE_TASKS if t not in ("squad", "coqa")]
    out = metric.compute(correct=[1.0] * 20, task=twenty)
    assert out["label"] == "CORE-20" and out["missing_tasks"] == ["squad", "coqa"] and out["core_metric"] == pytest.approx(1.0)
    out = metric.compute(correct=[0.6], task=["my_task"], random_baseline_percent={"my_task": 20})
    assert out["label"] == "mean-centered-1" and out["centered"]["my_task"] == pytest.approx(0.5)
    out = metric.compute(correct=[0.6], task=["copa"], random_baseline_percent={"copa": 20})
    assert out["random_baseline"]["copa"] == 20
    with pytest.raises(ValueError, match="no random baseline"):
        metric.compute(correct=[1], task=["my_task"])
    with pytest.raises(ValueError, match="outside"):
        metric.compute(correct=[1.5], task=["copa"])
    with pytest.raises(ValueError, match="baseline_version"):
        metric.compute(correct=[1], task=["copa"], baseline_version="v3")
    with pytest.raises(ValueError, match="percentage"):
        metric.compute(correct=[1], task=["copa"], random_baseline_percent={"copa": 100})
