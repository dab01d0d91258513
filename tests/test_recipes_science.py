"""recipes/science_table.py: the science table trained on recipes/configs/science/cpu_test.yaml (3 variants x 2 seeds
x 8 steps), interrupted and resumed (finished runs not redone, cut runs continue from their checkpoint, an incomplete
newest checkpoint skipped); the measurements against hand computations; the verdict rule, the table and the card
blocks on constructed numbers."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

# transformers contract (Trainer through recipes/pretrain.py): CI also runs this module on the oldest versions
pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIG = os.path.join(REPO, "recipes", "configs", "science", "cpu_test.yaml")


@pytest.fixture
def keep_threads():
    """pretrain.run sets torch's thread count from the recipe's cpu_threads: give the rest of the session its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _results(out, variant, seed):
    with open(os.path.join(out, "runs", variant, f"seed{seed}", "results.json")) as f:
        return json.load(f)


def _results_mtime(out, variant, seed):
    return os.path.getmtime(os.path.join(out, "runs", variant, f"seed{seed}", "results.json"))


def _summary(out, variant, seed):
    with open(os.path.join(out, "runs", variant, f"seed{seed}", "summary.json")) as f:
        return json.load(f)


def test_science_table_trains_resumes_and_fills_the_card(tmp_path, keep_threads):
    from recipes.science_table import main

    out, card, figures = (
        str(tmp_path / "out"),
        str(tmp_path / "card.md"),
        str(tmp_path / "figures"),
    )
    common = [
        "--config",
        CPU_CONFIG,
        "--output",
        out,
        "--card",
        card,
        "--figures",
        figures,
    ]

    # 0. a session whose time is already up starts nothing (but prepares the shared data and writes the card)
    assert main(common + ["--max-minutes", "0"]) == 0
    assert not os.path.exists(os.path.join(out, "runs")) and "| rbf | 0/2 |" in Path(card).read_text()

    # 1. one variant, both seeds, to the end; the others are listed as not run
    assert main(common + ["--only", "rbf"]) == 0
    first = {s: _results_mtime(out, "rbf", s) for s in (0, 1)}
    text = Path(card).read_text()
    assert "| dot | 0/2 |" in text and "not run: seed 0, 1" in text
    assert "| rbf | 2/2 |" in text

    # 2. everything, cut at step 4 (as a killed GPU session): rbf is not redone, the others stop with a checkpoint
    assert main(common + ["--stop-at-step", "4"]) == 0
    for s in (0, 1):
        assert _results_mtime(out, "rbf", s) == first[s]
        for v in ("dot", "scalar_sort_reg"):
            d = os.path.join(out, "runs", v, f"seed{s}")
            assert not os.path.exists(os.path.join(d, "results.json"))
            assert _summary(out, v, s)["stopped_at_step"] == 4
            assert os.path.exists(os.path.join(d, "checkpoint-4", "trainer_state.json"))
    # a run killed while saving its next checkpoint: the newest folder lacks trainer_state.json and must be skipped
    os.makedirs(os.path.join(out, "runs", "dot", "seed0", "checkpoint-6"))

    # 3. again: the cut runs continue from step 4 and finish; rbf still not redone
    assert main(common) == 0
    for s in (0, 1):
        assert _results_mtime(out, "rbf", s) == first[s]
        for v in ("dot", "scalar_sort_reg"):
            summary = _summary(out, v, s)
            assert summary["resumed_from"].endswith("checkpoint-4") and summary["steps"] == 8
            steps = [r["step"] for r in _results(out, v, s)["log_history"] if "loss" in r]
            assert steps == list(range(1, 9))  # the whole curve, the part before the cut included

    # the numbers each run records
    rbf, dot, ss = (_results(out, v, 0) for v in ("rbf", "dot", "scalar_sort_reg"))
    assert len(rbf["measurements"]["register_mass"]) == 2 and 0 < rbf["metrics"]["register_mass_max"] < 1
    assert dot["measurements"]["register_mass"] is None and dot["metrics"]["tau_start"] is None
    assert rbf["metrics"]["attention_parameters"] == 8256 and dot["metrics"]["attention_parameters"] == 8192
    gap = rbf["measurements"]["train_val_gap"]
    assert math.isclose(gap["gap"], gap["validation_loss"] - gap["train_loss"])
    tau = ss["measurements"]["tau"]
    # per-head tau starts log-spaced over tau_init_range (0.03, 0.1): 2 heads give the two ends, mean 0.065
    assert tau["start"] == pytest.approx([0.065, 0.065], abs=1e-6) and tau["end"] != tau["start"]
    cm = ss["measurements"]["captured_mass"]
    assert cm["contexts"] == [16, 32, 64] and cm["skipped_contexts"] == [128]  # 128 > max_position_embeddings 64
    assert all(0 < cm["mean_mass"][f"{c}:8"] <= 1 for c in cm["contexts"])
    assert ss["metrics"]["captured_mass_longest"] == cm["mean_mass"]["64:8"]

    # the regularized model: its table loss is the language-model term, below Trainer's (which adds the regularizers)
    assert ss["metrics"]["eval_loss"] == ss["measurements"]["validation_lm_loss"] < ss["metrics"]["trainer_eval_loss"]
    assert ss["metrics"]["first_eval_loss"] is None and all("eval_loss" not in r for r in ss["log_history"])
    logged = json.loads(Path(out, "runs", "scalar_sort_reg", "seed0", "metrics.json").read_text())["log_history"][0]
    lm = logged["loss"] - logged["align_loss"] - 0.1 * logged["spread_loss"] - 0.1 * logged["tau_loss"]
    assert ss["log_history"][0]["loss"] == pytest.approx(lm, abs=1e-12)
    assert rbf["metrics"]["first_eval_loss"] == next(r["eval_loss"] for r in rbf["log_history"] if "eval_loss" in r)

    core_json = os.path.join(out, "runs", "rbf", "seed0", "core.json")
    if os.path.isdir(os.path.join(REPO, "..", "shared", "data", "core")):  # the bundle is shared data, not shipped
        assert rbf["core"]["label"] == "CORE-1" and isinstance(rbf["metrics"]["core"], float)
        assert json.loads(Path(core_json).read_text())["tasks"]["copa"]["num_examples"] == 8
    else:
        assert rbf["metrics"]["core"] is None

    text = Path(card).read_text()
    for v in ("rbf", "dot", "scalar_sort_reg"):
        assert f"| {v} | 2/2 |" in text
    assert "not run" not in text.split("<!-- /results:science:cpu_test_table -->")[0]
    assert "<!-- results:science:cpu_test_claims -->" in text and "**" in text
    assert os.path.getsize(os.path.join(figures, "science_cpu_test_all.png")) > 10_000
    assert "](figures/science_cpu_test_all.png)" in text


def test_workers_train_runs_in_their_own_processes(tmp_path, keep_threads):
    """``--workers 2``: two runs at once, each in its own process with its log, the same numbers as a run in this
    process, and a finished run not redone."""
    from recipes.science_table import main

    out, out_serial = str(tmp_path / "workers"), str(tmp_path / "serial")
    common = ["--config", CPU_CONFIG, "--card", str(tmp_path / "card.md"), "--figures", str(tmp_path / "figures")]
    store = tmp_path / "store"
    assert (
        main(common + ["--output", out, "--only", "rbf,dot", "--seeds", "0", "--workers", "2", "--store", str(store)])
        == 0
    )
    assert (store / "runs" / "dot" / "seed0" / "results.json").read_text() == Path(
        out, "runs", "dot", "seed0", "results.json"
    ).read_text()
    for v in ("rbf", "dot"):
        log = Path(out, "runs", v, "seed0", "worker.log").read_text()
        assert f"[science] {v} seed 0: finished" in log
    assert "| rbf | 1/2 |" in Path(tmp_path / "card.md").read_text()
    mtime = _results_mtime(out, "rbf", 0)
    assert main(common + ["--output", out, "--only", "rbf", "--seeds", "0", "--workers", "2", "--no-report"]) == 0
    assert _results_mtime(out, "rbf", 0) == mtime

    assert main(common + ["--output", out_serial, "--only", "rbf", "--seeds", "0", "--no-report"]) == 0
    assert _results(out, "rbf", 0)["metrics"]["eval_loss"] == _results(out_serial, "rbf", 0)["metrics"]["eval_loss"]


def test_workers_spread_over_the_visible_gpus(tmp_path, monkeypatch):
    """With several GPUs each worker sees one (``CUDA_VISIBLE_DEVICES``), the least busy; the parent's own list is
    kept; with one GPU the workers share it and the environment is left alone."""
    import subprocess
    import types

    from recipes import science_table
    from recipes.science_table import pick_gpu, run_in_workers, visible_gpus

    assert pick_gpu([], []) is None
    assert pick_gpu(["0", "1", "2"], ["0", "1"]) == "2"
    assert pick_gpu(["0", "1"], ["0", "1", "0"]) == "1"
    assert pick_gpu(["3", "5"], []) == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert visible_gpus() == ["3", "5"]

    started = []

    class FakeProc:
        def __init__(self, cmd, stdout=None, stderr=None, env=None):
            started.append((cmd[cmd.index("--only") + 1], None if env is None else env["CUDA_VISIBLE_DEVICES"]))
            self.pid, self.returncode = len(started), 0

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeProc)
    monkeypatch.setattr(science_table.time, "sleep", lambda s: None)
    monkeypatch.setattr(science_table, "store_run", lambda *a: None)
    args = types.SimpleNamespace(workers=2, max_minutes=None, config=CPU_CONFIG, overrides=None, stop_at_step=None,
                                 store=None)
    jobs = [("rbf", 0), ("dot", 0), ("llama", 0)]
    assert run_in_workers(args, jobs, str(tmp_path), 0.0) == 0
    # each round starts two workers on the two GPUs; the third starts on the first GPU again once they finished
    assert started == [("rbf", "3"), ("dot", "5"), ("llama", "3")]

    started.clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_in_workers(args, jobs, str(tmp_path), 0.0) == 0
    assert started == [("rbf", None), ("dot", None), ("llama", None)]


def test_initial_model_is_the_one_pretrain_started_from(tmp_path, keep_threads):
    """With learning rate 0 the trained weights are the initial ones: the rebuilt start must equal them exactly."""
    from recipes.pretrain import run
    from recipes.pretrain_config import load_config
    from recipes.science_measure import initial_model

    sets = [
        "training.max_steps=1",
        "training.learning_rate=0.0",
        "training.warmup_steps=0",
        "seed=3",
        "model.family=scalar_sort",
        "model.expected_num_parameters=null",
        "model.config.tau_mode=per_token",
        "evaluation.remote_code_check=false",
        "evaluation.generation.enabled=false",
        "evaluation.bpb.enabled=false",
        "training.eval_strategy='no'",
        "training.save_strategy='no'",
    ]
    cfg = load_config(
        os.path.join(REPO, "recipes", "configs", "cpu_test.yaml"),
        sets,
        output_dir=str(tmp_path),
    )
    summary = run(cfg, log=lambda *a, **k: None)
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(summary["final_dir"]).state_dict()
    start = initial_model(summary, 3).state_dict()
    assert trained.keys() == start.keys()
    for name, value in trained.items():
        assert torch.equal(value, start[name]), name
    other = initial_model(summary, 4).state_dict()
    assert not all(torch.equal(v, other[k]) for k, v in trained.items())


def _tiny(family, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_rbf  # noqa: F401
    from recipes.pretrain_models import build_config, build_model

    base = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
    }
    base.update(kw)
    if family in ("llama", "dot"):
        return build_model(build_config(family, base))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **base))


def test_attention_parameters_and_prefix_layout():
    from recipes.science_measure import attention_parameters, prefix_layout

    assert attention_parameters(_tiny("llama")) == 2 * 4 * 16 * 16  # W_Q, W_K, W_V, W_O per layer, no bias
    gka = _tiny("gka", num_register_tokens=0)
    assert attention_parameters(gka) == 2 * (16 * 16 + 2)  # W_O and a log sigma per head
    assert prefix_layout(_tiny("rbf", num_register_tokens=1).model.layers[0].self_attn) == (0, 1)
    assert prefix_layout(_tiny("scalar_sort", num_register_tokens=2).model.layers[0].self_attn) == (1, 2)
    no_sink = _tiny("scalar_sort", num_register_tokens=1, scalar_sink=False)
    assert prefix_layout(no_sink.model.layers[0].self_attn) == (0, 1)
    assert prefix_layout(_tiny("dot").model.layers[0].self_attn) == (0, 0)


def test_register_share_and_mass_against_the_weights():
    from recipes.science_measure import register_mass, register_share

    w = torch.tensor([[[[0.1, 0.3, 0.6], [0.0, 0.0, 0.0], [2.0, 1.0, 1.0]]]])  # a masked row and an unnormalised one
    assert register_share(w, 1, 1).tolist() == pytest.approx([0.3, 0.25])
    model = _tiny("scalar_sort", num_register_tokens=1).eval()
    blocks = [{"input_ids": torch.randint(0, 64, (12,))} for _ in range(3)]
    got = register_mass(model, blocks, 3, 2, "cpu")
    ids = torch.stack([b["input_ids"] for b in blocks])
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    # sink first, then the register: key 1 of every row; float32 weights from batches of 2 against one batch of 3
    expected = [(a[..., 1].double() / a.double().sum(-1)).mean().item() for a in attentions]
    assert got == pytest.approx(expected, rel=1e-6)
    assert register_mass(_tiny("dot"), blocks, 3, 2, "cpu") is None


def test_self_share_weight_and_gka_bandwidths():
    from recipes.science_measure import gka_bandwidths, self_share, self_weight

    # one prefix key (column 0), then 2 text keys: row 0 puts 0.6 of 1.0 on itself, row 1 puts 1.0 of 4.0 on itself
    w = torch.tensor([[[[0.4, 0.6, 0.0], [2.0, 1.0, 1.0]]]])
    assert self_share(w).tolist() == pytest.approx([0.6, 0.25])
    with pytest.raises(ValueError, match="keys for 3 query rows"):
        self_share(torch.ones(1, 1, 3, 2))
    model = _tiny("gka", num_register_tokens=1).eval()
    blocks = [{"input_ids": torch.randint(0, 64, (10,))} for _ in range(3)]
    got = self_weight(model, blocks, 3, 2, "cpu")
    ids = torch.stack([b["input_ids"] for b in blocks])
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    n = ids.shape[1]
    expected = [
        (a[..., torch.arange(n), a.shape[-1] - n + torch.arange(n)].double() / a.double().sum(-1)).mean().item()
        for a in attentions
    ]
    assert got == pytest.approx(expected, rel=1e-6)
    # the Gaussian kernel over shared features: the own key has the largest weight of its row, more than uniform
    assert all(g > 1 / n for g in got)
    with torch.no_grad():
        model.model.layers[1].self_attn.log_sigma.copy_(torch.tensor([0.0, math.log(3.0)]))
    sigmas = gka_bandwidths(model)
    assert sigmas[1] == pytest.approx(2.0) and sigmas[0] == pytest.approx(
        math.exp(model.config.resolved_log_sigma_init)
    )
    assert gka_bandwidths(_tiny("dot")) is None


def test_temperatures_at_initialisation():
    from recipes.science_measure import temperatures

    blocks = [{"input_ids": torch.randint(0, 64, (8,))} for _ in range(2)]
    glob = _tiny("scalar_sort", tau_mode="global", tau_init_range=[0.04, 0.09])
    assert temperatures(glob, blocks, 2, 2, "cpu") == pytest.approx([0.06, 0.06], rel=1e-5)  # sqrt(0.04 * 0.09)
    per_head = _tiny("scalar_sort", tau_mode="per_head", tau_init_range=[0.04, 0.09])
    assert temperatures(per_head, blocks, 2, 2, "cpu") == pytest.approx([0.065, 0.065], rel=1e-5)  # both ends
    per_token = _tiny("scalar_sort", tau_mode="per_token")
    got = temperatures(per_token, blocks, 2, 2, "cpu")
    assert len(got) == 2 and all(t > 0 for t in got)
    assert temperatures(_tiny("rbf"), blocks, 2, 2, "cpu") is None


def test_language_model_curve():
    from recipes.science_measure import language_model_curve

    rows = [
        {"step": 1, "loss": 5.0, "align_loss": 0.5, "spread_loss": 2.0, "tau_loss": 1.0, "grad_norm": 1.0},
        {"step": 2, "loss": 4.0, "align_loss": 0.5, "align_loss_weight": 0.5, "spread_loss": 2.0, "tau_loss": 0.0},
        {"step": 2, "eval_loss": 4.5},
    ]
    weights = {"align_loss_weight": 1.0, "spread_loss_weight": 0.1, "tau_loss_weight": 0.1}
    assert language_model_curve(rows, weights) == [
        {"step": 1, "loss": 5.0 - 0.5 - 0.2 - 0.1},
        {"step": 2, "loss": 4.0 - 0.25 - 0.2},
    ]
    plain = language_model_curve(rows, {"align_loss_weight": 0.0})
    assert plain == [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "eval_loss": 4.5}]


def test_curve_metrics_find_the_early_stopping_point(tmp_path):
    """The lowest validation loss and its step (a run that overfits ends above it), also for runs stored before the
    report had these numbers (``collect_results`` derives them from the stored curve)."""
    import json

    from recipes.science_measure import curve_metrics
    from recipes.science_table import collect_results, run_dir

    curve = [{"step": 1, "loss": 4.0}, {"step": 2, "eval_loss": 3.5}, {"step": 4, "eval_loss": 2.8},
             {"step": 6, "eval_loss": 3.9}]
    assert curve_metrics(curve) == {"first_eval_loss": 3.5, "best_eval_loss": 2.8, "best_eval_step": 4}
    assert curve_metrics([{"step": 1, "loss": 4.0}]) == {
        "first_eval_loss": None, "best_eval_loss": None, "best_eval_step": None
    }
    science = {"variants": {"a": {}}, "seeds": [0]}
    d = run_dir(str(tmp_path), "a", 0)
    os.makedirs(d)
    with open(os.path.join(d, "results.json"), "w") as f:
        json.dump({"metrics": {"eval_loss": 3.9, "first_eval_loss": 3.4}, "log_history": curve}, f)
    results, _ = collect_results(science, str(tmp_path))
    metrics = results["a"][0]["metrics"]
    assert (metrics["best_eval_loss"], metrics["best_eval_step"], metrics["first_eval_loss"]) == (2.8, 4, 3.4)


def test_capped_contexts():
    from recipes.science_measure import capped_contexts

    assert capped_contexts([128, 256, 512, 8192], 256, 10_000) == (
        [128, 256],
        [512, 8192],
    )
    assert capped_contexts([128, 256, 512], 8192, 300) == ([128, 256], [512])


# ----------------------------------------------------------------------------------------------------------------
# the report on constructed numbers
# ----------------------------------------------------------------------------------------------------------------


def _fake(values: dict[str, list], metric="eval_loss") -> dict:
    return {v: {i: {"metrics": {metric: x}} for i, x in enumerate(xs)} for v, xs in values.items()}


def _claim(test, a="a", b="b", **kw):
    return dict(claim="c", source="s", metric="eval_loss", test=test, a=a, b=b, **kw)


def test_verdict_less_and_greater():
    from recipes.science_report import verdict

    # a = 3.0 ± 0.01, b = 3.1 ± 0.01: d = 0.1 > 2 * sqrt(2) * 0.01
    r = _fake({"a": [2.99, 3.0, 3.01], "b": [3.09, 3.1, 3.11]})
    assert verdict(_claim("less"), r)["verdict"] == "reproduced"
    assert verdict(_claim("greater"), r)["verdict"] == "not reproduced"
    out = verdict(_claim("less"), r)
    assert out["difference"] == pytest.approx(-0.1) and out["spread"] == pytest.approx(math.sqrt(2) * 0.01)
    # the same means with a spread of 0.05: d = 0.1 < 2 * 0.0707
    r = _fake({"a": [2.95, 3.0, 3.05], "b": [3.05, 3.1, 3.15]})
    assert verdict(_claim("less"), r)["verdict"] == "inconclusive"
    # factor: a < 0.5 b with exact numbers
    r = _fake({"a": [10, 10], "b": [40, 40]})
    assert verdict(_claim("less", factor=0.5), r)["verdict"] == "reproduced"
    assert verdict(_claim("less", factor=0.2), r)["verdict"] == "not reproduced"
    # a constant side
    r = _fake({"a": [0.3, 0.32, 0.31]})
    assert verdict(_claim("greater", b=0.1), r)["verdict"] == "reproduced"
    assert verdict(_claim("greater", b=0.5), r)["verdict"] == "not reproduced"


def test_claim_rule_in_words():
    from recipes.science_report import claim_rule

    assert claim_rule(_claim("less", a="gka", b="dot", factor=0.5)) == "gka < 0.5 x dot"
    assert claim_rule(_claim("greater", b=0.1)) == "a > 0.1"
    assert claim_rule(_claim("close", tolerance=0.05)) == "abs(a - b) <= 0.05"
    assert claim_rule(_claim("within", range=[0.35, 0.42])) == "0.35 <= a <= 0.42"


def test_verdict_close_within_and_missing():
    from recipes.science_report import verdict

    r = _fake({"a": [3.0, 3.01, 3.02], "b": [3.02, 3.03, 3.04]})  # |d| = 0.02, s = 0.01414
    assert verdict(_claim("close", tolerance=0.05), r)["verdict"] == "reproduced"  # 0.02 + 0.028 <= 0.05
    assert verdict(_claim("close", tolerance=0.03), r)["verdict"] == "inconclusive"
    r2 = _fake({"a": [3.0, 3.01, 3.02], "b": [3.3, 3.31, 3.32]})
    assert verdict(_claim("close", tolerance=0.05), r2)["verdict"] == "not reproduced"
    r = _fake({"a": [0.38, 0.39, 0.40]})
    assert verdict(_claim("within", range=[0.35, 0.42]), r)["verdict"] == "reproduced"
    assert verdict(_claim("within", range=[0.385, 0.42]), r)["verdict"] == "inconclusive"
    assert verdict(_claim("within", range=[0.03, 0.1]), r)["verdict"] == "not reproduced"
    # one seed: no spread, inconclusive; no result: not run
    assert verdict(_claim("less"), _fake({"a": [3.0], "b": [3.5]}))["verdict"] == "inconclusive (n < 2)"
    assert verdict(_claim("less"), _fake({"a": [3.0, 3.1]}))["verdict"] == "not run"
    assert verdict(_claim("less"), _fake({"b": [3.0, 3.1]}))["verdict"] == "not run"


def test_run_metrics_list_every_number_of_a_run():
    """The names a claim may use are exactly the numbers a run's results carry."""
    from recipes.science_measure import RUN_METRICS, flat_metrics

    measured = {"validation_lm_loss": 3.0, "train_val_gap": {"gap": 0.1}, "attention_parameters": 10}
    metrics = flat_metrics({"eval_loss": 3.1}, measured, None, [{"step": 2, "eval_loss": 3.2}])
    assert sorted(metrics) == sorted(RUN_METRICS)


def test_claim_and_config_errors(tmp_path):
    from recipes.science_report import check_claim
    from recipes.science_table import load_science_config

    with pytest.raises(ValueError, match="`test` must be one of"):
        check_claim(_claim("bigger"))
    with pytest.raises(ValueError, match="needs a numeric `tolerance`"):
        check_claim(_claim("close"))
    with pytest.raises(ValueError, match=r"needs `range: \[lo, hi\]`"):
        check_claim(_claim("within", range=[2, 1]))
    with pytest.raises(ValueError, match="`metric` must be one of .*'best_eval_loss'.*; got 'best_eval_los'"):
        check_claim({**_claim("less"), "metric": "best_eval_los"})
    path = tmp_path / "bad.yaml"
    path.write_text(f"variants: {{x: {{recipe: {os.path.join(REPO, 'recipes/configs/cpu_test.yaml')}}}}}\nseed: 1\n")
    with pytest.raises(ValueError, match="unknown keys \\['seed'\\]"):
        load_science_config(str(path))
    path.write_text(
        f"variants: {{x: {{recipe: {os.path.join(REPO, 'recipes/configs/cpu_test.yaml')}}}}}\n"
        "claims: [{claim: c, source: s, metric: eval_loss, test: less, a: x, b: y}]\n"
    )
    with pytest.raises(ValueError, match="`b: y` is not a variant"):
        load_science_config(str(path))


def test_shared_setup_is_enforced(tmp_path):
    from recipes.science_table import (
        check_shared_setup,
        load_science_config,
        variant_recipe,
    )

    science = load_science_config(CPU_CONFIG)
    recipes = {v: variant_recipe(science, v, 0, str(tmp_path)) for v in science["variants"]}
    assert check_shared_setup(recipes)["tokens"] == 8 * 8 * 32
    science["variants"]["dot"]["set"]["training.max_steps"] = 9
    recipes = {v: variant_recipe(science, v, 0, str(tmp_path)) for v in science["variants"]}
    with pytest.raises(ValueError, match="variant 'dot' differs from 'rbf' in `tokens`"):
        check_shared_setup(recipes)
    science["variants"]["dot"]["set"] = {"data.block_size": 16}
    recipes = {v: variant_recipe(science, v, 0, str(tmp_path)) for v in science["variants"]}
    with pytest.raises(ValueError, match="differs from 'rbf' in `data`"):
        check_shared_setup(recipes)


def test_results_table_lists_every_variant_and_seed():
    from recipes.science_report import results_table

    results = {
        "a": {
            0: {"metrics": {"eval_loss": 3.0, "num_parameters": 10}},
            1: {"metrics": {"eval_loss": 3.2, "num_parameters": 10}},
        },
        "b": {0: {"metrics": {"eval_loss": 3.5, "num_parameters": 12}}},
    }
    text = results_table(results, ["a", "b", "c"], [0, 1], failures={("b", 1): "boom"})
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "3.1000 ± 0.1414 (n=2)" in rows["a"] and rows["a"].endswith("| done |")
    assert "3.5000 (n=1)" in rows["b"] and "failed: seed 1" in rows["b"]
    assert rows["c"].count("not run") >= 2 and "not run: seed 0, 1" in rows["c"]
    assert "| not measured |" in rows["a"]  # CORE: every run has it, none measured it


def test_mean_curve_and_fill_blocks():
    from recipes.science_report import fill_blocks, mean_curve

    h1 = [
        {"step": 1, "loss": 4.0, "tokens_seen": 8},
        {"step": 2, "loss": 3.0, "eval_loss": 3.5, "tokens_seen": 16},
    ]
    h2 = [
        {"step": 1, "loss": 6.0, "tokens_seen": 8},
        {"step": 2, "loss": 5.0, "eval_loss": 4.5, "tokens_seen": 16},
        {"step": 3, "loss": 1.0, "tokens_seen": 24},
    ]
    rows = mean_curve([h1, h2])["log_history"]
    assert rows == [
        {"step": 1, "tokens_seen": 8, "loss": 5.0},
        {"step": 2, "tokens_seen": 16, "loss": 4.0, "eval_loss": 4.0},
    ]
    text = "# t\n\n<!-- results:science:x_table -->\nold\n<!-- /results:science:x_table -->\n<!-- results:tinystories:gka -->\nkeep\n<!-- /results:tinystories:gka -->\n"
    new = fill_blocks(text, {"x_table": "new\n", "x_claims": "claims\n"})
    assert "old" not in new and "new\n<!-- /results:science:x_table -->" in new and "keep" in new
    assert new.endswith("<!-- results:science:x_claims -->\nclaims\n<!-- /results:science:x_claims -->\n")
    assert fill_blocks(new, {"x_table": "new\n", "x_claims": "claims\n"}) == new
