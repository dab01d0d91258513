"""CORE evaluation: prompt rendering, few-shot draws, scored spans, cropping, scoring, aggregation, batching, CLI."""

import json
import math
import os
import random
import sys

import pytest
import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_helpers import (  # noqa: E402
    CORE_SAMPLE,
    TableLM,
    byte_bpe_tokenizer,
    isolate_hf_caches,
    sample_texts,
    save_tiny_llama,
    tiny_llama,
    word_tokenizer,
)

from hf_rbf.eval.core import evaluate_core, evaluate_task, resolve_bos_id, score_sequences, task_sequences  # noqa: E402
from hf_rbf.eval.core_prompts import (  # noqa: E402
    ScoredSequence,
    build_sequences,
    common_length,
    crop_left,
    draw_fewshot,
    hf_encoder,
    render_language_modeling,
    render_multiple_choice,
    render_schema,
)
from hf_rbf.eval.core_tasks import CORE_TASKS, load_core_tasks, load_random_baselines, shuffle_and_cap  # noqa: E402


@pytest.fixture(autouse=True)
def _hf_caches(tmp_path, monkeypatch):
    isolate_hf_caches(monkeypatch, tmp_path / "hf_home")


# ---------------------------------------------------------------------------------------------------------------
# Prompt rendering (hand-written expected strings)


def test_render_multiple_choice_zero_shot():
    item = {"query": "Question: Which is a fruit?", "choices": ["apple", "chair"], "gold": 0}
    assert render_multiple_choice(item, "\nAnswer: ") == [
        "Question: Which is a fruit?\nAnswer: apple",
        "Question: Which is a fruit?\nAnswer: chair",
    ]


def test_render_multiple_choice_few_shot_shows_gold_choices():
    shots = [
        {"query": "2+2 =", "choices": ["3", "4"], "gold": 1},
        {"query": "Sky color:", "choices": ["blue", "red", "green"], "gold": 0},
    ]
    item = {"query": "1+1 =", "choices": ["2", "5"], "gold": 0}
    assert render_multiple_choice(item, " ", shots) == [
        "2+2 = 4\n\nSky color: blue\n\n1+1 = 2",
        "2+2 = 4\n\nSky color: blue\n\n1+1 = 5",
    ]


def test_render_schema_few_shot():
    shot = {"context_options": ["Ann fed the cat because Ann", "Ann fed the cat because the cat"],
            "continuation": "was hungry.", "gold": 1}
    item = {"context_options": ["Tom thanked Bob because Tom", "Tom thanked Bob because Bob"],
            "continuation": "had helped.", "gold": 1}
    assert render_schema(item, " ", [shot]) == [
        "Ann fed the cat because the cat was hungry.\n\nTom thanked Bob because Tom had helped.",
        "Ann fed the cat because the cat was hungry.\n\nTom thanked Bob because Bob had helped.",
    ]


def test_render_language_modeling_trims_contexts_and_the_answerless_prompt():
    shot = {"context": "Capital of Italy?\n", "continuation": "Rome"}
    item = {"context": "  Capital of France? ", "continuation": "Paris"}
    without, with_answer = render_language_modeling(item, "\nAnswer: ", [shot])
    assert without == "Capital of Italy?\nAnswer: Rome\n\nCapital of France?\nAnswer:"
    assert with_answer == "Capital of Italy?\nAnswer: Rome\n\nCapital of France?\nAnswer: Paris"
    assert render_language_modeling({"context": "The cat sat on the", "continuation": "mat"}, " ") == (
        "The cat sat on the",
        "The cat sat on the mat",
    )


def test_fewshot_draw_is_seeded_per_example_and_never_the_example():
    data = [{"id": i} for i in range(6)]
    # nanochat's rule: random.Random(1234 + idx).sample(<indices other than idx>, k)
    assert [d["id"] for d in draw_fewshot(data, 2, 3)] == [5, 4, 3]
    assert [d["id"] for d in draw_fewshot(data, 0, 2)] == [4, 1]
    assert draw_fewshot(data, 3, 0) == []
    for idx in range(6):
        shots = draw_fewshot(data, idx, 5)
        assert sorted(d["id"] for d in shots) == [i for i in range(6) if i != idx]
        assert shots == draw_fewshot(data, idx, 5)
    with pytest.raises(ValueError, match="num_fewshot=6"):
        draw_fewshot(data, 0, 6)


def test_shuffle_then_cap_uses_seed_1337():
    data = list(range(8))
    assert shuffle_and_cap(data) == [0, 3, 7, 2, 1, 6, 4, 5]
    assert shuffle_and_cap(data, 3) == [0, 3, 7]
    assert data == list(range(8))


def test_rendering_on_the_sample_bundle_copa():
    tasks, _, _ = load_core_tasks(CORE_SAMPLE, ["copa"])
    item = {"query": "The man turned on the faucet, therefore", "gold": 1,
            "choices": ["the toilet filled with water.", "water flowed from the spout."]}
    assert item in tasks[0].data
    assert render_multiple_choice(item, tasks[0].continuation_delimiter) == [
        "The man turned on the faucet, therefore the toilet filled with water.",
        "The man turned on the faucet, therefore water flowed from the spout.",
    ]


# ---------------------------------------------------------------------------------------------------------------
# Scored spans and cropping

WORDS = ["sky", "is", "grass", "roses", "are", "blue", "green", "red", "very", "the", "a", "cat", "dog",
         "barks", "meows", "loudly", "x", "y", "xy"]
NEXT = {"is": "blue", "are": "red", "very": "blue", "dog": "barks", "cat": "meows", "barks": "loudly"}
HIGH = 5.0


@pytest.fixture(scope="module")
def words():
    tok = word_tokenizer(WORDS)
    table = torch.zeros(len(tok), len(tok))
    for w, nxt in NEXT.items():
        table[tok.convert_tokens_to_ids(w), tok.convert_tokens_to_ids(nxt)] = HIGH
    return tok, table


def _losses(vocab):
    """(loss of the favoured next token, loss of any other token) for a row with one HIGH logit, and a uniform row."""
    z = math.exp(HIGH) + vocab - 1
    return math.log(z) - HIGH, math.log(z), math.log(vocab)


def test_common_length():
    assert common_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_length([[1, 2, 3], [1, 2, 3]]) == 3
    assert common_length([[5, 2, 3], [1, 2, 3]], from_end=True) == 2
    assert common_length([[9, 1], [8, 1], [7, 2]], from_end=True) == 0


def test_spans_per_task_type(words):
    tok, _ = words
    ids = tok.convert_tokens_to_ids
    enc = hf_encoder(tok)
    # multiple choice: the common token prefix (here also the shared word "very") is not scored
    seqs, fb = build_sequences("multiple_choice", ["sky is very blue", "sky is very green"], enc, 0)
    assert not fb
    assert [s.tokens for s in seqs] == [[0] + ids(["sky", "is", "very", "blue"]), [0] + ids(["sky", "is", "very", "green"])]
    assert [(s.start, s.end) for s in seqs] == [(4, 5), (4, 5)]
    # schema: only the common suffix
    seqs, _ = build_sequences("schema", ["the cat barks loudly", "a dog barks loudly"], enc, 0)
    assert [(s.start, s.end) for s in seqs] == [(3, 5), (3, 5)]
    # language modeling: the answer's tokens
    seqs, fb = build_sequences("language_modeling", ["roses are", "roses are very red"], enc, 0)
    assert len(seqs) == 1 and not fb
    assert (seqs[0].tokens, seqs[0].start, seqs[0].end) == ([0] + ids(["roses", "are", "very", "red"]), 3, 5)


def test_language_modeling_boundary_merge_is_counted(words):
    tok, _ = words
    ids = tok.convert_tokens_to_ids
    # "x" + "y" is the single word "xy": the answerless prompt is not a token prefix of the full one
    prompts = list(render_language_modeling({"context": "x", "continuation": "y"}, ""))
    assert prompts == ["x", "xy"]
    seqs, fallback = build_sequences("language_modeling", prompts, hf_encoder(tok), 0)
    assert fallback
    assert (seqs[0].tokens, seqs[0].start, seqs[0].end) == ([0, ids("x"), ids("y")], 2, 3)


def test_crop_left_keeps_the_right_end_and_the_span():
    seq = ScoredSequence(list(range(10)), 6, 9)
    assert crop_left(seq, 12) is seq
    cropped = crop_left(seq, 5)
    assert cropped.tokens == [5, 6, 7, 8, 9]
    assert (cropped.start, cropped.end, cropped.cropped) == (1, 4, 5)
    assert cropped.tokens[cropped.start:cropped.end] == seq.tokens[seq.start:seq.end]
    with pytest.raises(ValueError, match="max_len=3"):
        crop_left(seq, 3)  # the 3 span tokens need a token before them


# ---------------------------------------------------------------------------------------------------------------
# Scoring against a model with hand-set logits


@pytest.mark.parametrize("with_keep", [True, False])
def test_scores_equal_hand_computation(words, with_keep):
    tok, table = words
    good, bad, uniform = _losses(len(tok))
    model = TableLM(table, with_logits_to_keep=with_keep)
    enc = hf_encoder(tok)
    (s0, s1), _ = build_sequences("multiple_choice", ["sky is very blue", "sky is green"], enc, 0)
    (lm,), _ = build_sequences("language_modeling", ["the dog", "the dog barks loudly"], enc, 0)
    scores = score_sequences(model, [s0, s1, lm], batch_size=2, pad_id=0)
    assert scores[0].num_tokens == 2 and scores[0].mean_loss == pytest.approx((bad + good) / 2, rel=1e-6)
    assert scores[1].num_tokens == 1 and scores[1].mean_loss == pytest.approx(bad, rel=1e-6)
    assert scores[2].sum_loss == pytest.approx(2 * good, rel=1e-6) and scores[2].greedy_match
    assert not scores[0].greedy_match and not scores[1].greedy_match
    if with_keep:
        # both calls computed logits only for the positions some row scores
        assert len(model.calls) == 2


def _write_toy_bundle(root):
    tasks = {
        "mc_toy": ("multiple_choice", 0, 50, [
            {"query": "sky is", "choices": ["blue", "green"], "gold": 0},        # right
            {"query": "grass is", "choices": ["blue", "green"], "gold": 1},      # wrong: the model says blue after "is"
            {"query": "roses are", "choices": ["red", "blue"], "gold": 0},       # right
            {"query": "sky is", "choices": ["very blue", "green"], "gold": 0},   # right: mean(bad, good) < bad
        ]),
        "schema_toy": ("schema", 0, 50, [
            {"context_options": ["the cat", "the dog"], "continuation": "barks", "gold": 1},         # right
            {"context_options": ["the dog", "the cat"], "continuation": "meows", "gold": 1},         # right
            {"context_options": ["a cat", "a dog"], "continuation": "barks loudly", "gold": 0},      # wrong
        ]),
        "lm_toy": ("language_modeling", 1, 0, [
            {"context": "roses are", "continuation": "red"},                     # right
            {"context": "grass is ", "continuation": "green"},                   # wrong: greedy says blue
            {"context": "the dog", "continuation": "barks loudly"},              # right
        ]),
    }
    entries = []
    for label, (task_type, shots, baseline, rows) in tasks.items():
        os.makedirs(os.path.join(root, "eval_data", "toy"), exist_ok=True)
        with open(os.path.join(root, "eval_data", "toy", f"{label}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        entries.append({"label": label, "dataset_uri": f"toy/{label}.jsonl", "num_fewshot": [shots],
                        "icl_task_type": task_type, "random_baseline_v1": baseline, "random_baseline_v2": baseline})
    entries.append({"label": "absent_toy", "dataset_uri": "toy/absent.jsonl", "num_fewshot": [0],
                    "icl_task_type": "multiple_choice", "random_baseline_v1": 25, "random_baseline_v2": 25,
                    "available": False})
    with open(os.path.join(root, "core.yaml"), "w") as f:
        yaml.safe_dump({"icl_tasks": entries}, f)
    return root


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_known_accuracy_centered_scores_and_mean(words, tmp_path, batch_size):
    tok, table = words
    bundle = _write_toy_bundle(str(tmp_path / "toy"))
    out = evaluate_core(TableLM(table), tok, bundle, batch_size=batch_size, max_seq_len=None, log=None)
    t = out["tasks"]
    assert [t[k]["accuracy"] for k in ("mc_toy", "schema_toy", "lm_toy")] == pytest.approx([3 / 4, 2 / 3, 2 / 3])
    assert t["mc_toy"]["centered"] == pytest.approx((0.75 - 0.5) / 0.5)
    assert t["schema_toy"]["centered"] == pytest.approx((2 / 3 - 0.5) / 0.5)
    assert t["lm_toy"]["centered"] == pytest.approx(2 / 3)
    assert out["core_metric"] == pytest.approx((0.5 + 1 / 3 + 2 / 3) / 3)
    assert out["label"] == "mean-centered-3" and out["num_tasks"] == 3
    assert [t[k]["num_examples"] for k in ("mc_toy", "schema_toy", "lm_toy")] == [4, 3, 3]
    json.dumps(out)


def test_tie_goes_to_the_first_option(words, tmp_path):
    tok, _ = words
    bundle = _write_toy_bundle(str(tmp_path / "toy"))
    flat = torch.zeros(len(tok), len(tok))  # every option has the same loss
    out = evaluate_core(TableLM(flat), tok, bundle, tasks=["mc_toy"], max_seq_len=None, log=None)
    assert out["tasks"]["mc_toy"]["accuracy"] == pytest.approx(3 / 4)  # gold is option 0 in three of four


def test_left_cropping_in_evaluation(words, tmp_path):
    tok, table = words
    bundle = _write_toy_bundle(str(tmp_path / "toy"))
    # "sky is very blue" has 5 tokens with BOS: a 4-token context drops the BOS, the bigram scores stay the same
    model = TableLM(table, max_len=4)
    out = evaluate_core(model, tok, bundle, tasks=["mc_toy", "schema_toy"], max_seq_len="auto", log=None)
    assert out["settings"]["max_seq_len"] == 4
    assert out["tasks"]["mc_toy"]["accuracy"] == pytest.approx(3 / 4)
    assert out["tasks"]["mc_toy"]["num_cropped"] == 1
    assert max(shape[1] for shape in model.calls) == 4
    # a 2-token context cannot hold the two-token continuation of the schema example plus a token before it
    with pytest.raises(ValueError, match="schema_toy"):
        evaluate_core(TableLM(table), tok, bundle, tasks=["schema_toy"], max_seq_len=2, log=None)


# ---------------------------------------------------------------------------------------------------------------
# The sample bundle with a real (tiny, random) transformer


@pytest.fixture(scope="module")
def llama():
    tok = byte_bpe_tokenizer(sample_texts())
    return tiny_llama(len(tok), max_position_embeddings=128), tok


def test_bundle_loading_and_baselines():
    tasks, skipped, source = load_core_tasks(CORE_SAMPLE)
    assert skipped == ["squad", "coqa"]
    assert [t.label for t in tasks] == [t for t in CORE_TASKS if t not in ("squad", "coqa")]
    assert all(len(t.data) == 12 for t in tasks)
    assert source == "core.yaml:random_baseline_v1"
    labels = [t.label for t in tasks]
    for version, csv_name in (("v1", "dclm_eval_meta_data_v1.csv"), ("v2", "dclm_eval_meta_data.csv")):
        from_yaml, _ = load_random_baselines(CORE_SAMPLE, labels, version)
        from_csv, _ = load_random_baselines(CORE_SAMPLE, labels, version, os.path.join(CORE_SAMPLE, csv_name))
        assert from_yaml == from_csv
    v1, _ = load_random_baselines(CORE_SAMPLE, labels, "v1")
    v2, _ = load_random_baselines(CORE_SAMPLE, labels, "v2")
    assert {k for k in labels if v1[k] != v2[k]} == {"commonsense_qa", "agi_eval_lsat_ar", "bigbench_language_identification"}
    with pytest.raises(ValueError, match="baselines='v3'"):
        load_core_tasks(CORE_SAMPLE, baselines="v3")
    with pytest.raises(FileNotFoundError, match="squad"):
        load_core_tasks(CORE_SAMPLE, tasks=["squad"])
    with pytest.raises(ValueError, match="not_a_task"):
        load_core_tasks(CORE_SAMPLE, tasks=["not_a_task"])


def test_nanochat_bundle_layout_reads_v1_from_eval_meta_data_csv(tmp_path):
    # nanochat's bundle: core.yaml without baselines, and eval_meta_data.csv holding the v1 values
    bundle = tmp_path / "bundle"
    os.makedirs(bundle / "eval_data" / "commonsense_reasoning")
    with open(os.path.join(CORE_SAMPLE, "core.yaml")) as f:
        entries = [e for e in yaml.safe_load(f)["icl_tasks"] if e["label"] in ("copa", "commonsense_qa")]
    for e in entries:
        for key in ("random_baseline_v1", "random_baseline_v2", "note"):
            e.pop(key, None)
        src = os.path.join(CORE_SAMPLE, "eval_data", e["dataset_uri"])
        with open(src) as f_in, open(bundle / "eval_data" / e["dataset_uri"], "w") as f_out:
            f_out.write(f_in.read())
    with open(bundle / "core.yaml", "w") as f:
        yaml.safe_dump({"icl_tasks": entries}, f)
    with open(os.path.join(CORE_SAMPLE, "dclm_eval_meta_data_v1.csv")) as f_in, open(bundle / "eval_meta_data.csv", "w") as f_out:
        f_out.write(f_in.read())
    tasks, _, source = load_core_tasks(str(bundle))
    assert {t.label: t.random_baseline for t in tasks} == {"copa": 50.0, "commonsense_qa": 20.0}
    assert source.endswith("eval_meta_data.csv")
    with pytest.raises(FileNotFoundError, match="no v2 random baselines"):
        load_core_tasks(str(bundle), baselines="v2")


def test_batched_equals_unbatched(llama):
    model, tok = llama
    tasks, _, _ = load_core_tasks(CORE_SAMPLE, ["hellaswag", "winograd", "bigbench_operators"])
    enc, bos = hf_encoder(tok), resolve_bos_id(tok)
    for task in tasks:
        per_example, _ = task_sequences(task, enc, bos, 128)
        flat = [s for seqs in per_example for s in seqs]
        one = score_sequences(model, flat, batch_size=1, pad_id=bos)
        many = score_sequences(model, flat, batch_size=11, pad_id=bos)
        full_logits = score_sequences(model, flat, batch_size=11, pad_id=bos, logits_to_keep="off")
        for a, b, c in zip(one, many, full_logits):
            assert b.sum_loss == pytest.approx(a.sum_loss, rel=1e-5, abs=1e-5)
            assert c.sum_loss == pytest.approx(a.sum_loss, rel=1e-5, abs=1e-5)
            assert a.greedy_match == b.greedy_match == c.greedy_match
    for task in tasks:
        r1 = evaluate_task(model, task, enc, bos, 128, batch_size=1)
        r2 = evaluate_task(model, task, enc, bos, 128, batch_size=7)
        assert r1.num_cropped > 0 or task.label == "winograd"
        assert r1.predictions == r2.predictions and r1.correct == r2.correct


def test_core20_on_the_sample_bundle(llama):
    model, tok = llama
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = evaluate_core(model, tok, CORE_SAMPLE, max_per_task=11, batch_size=32, log=None)
    finally:
        hook.remove()
    assert max(seen) <= 128  # left-cropped to max_position_embeddings
    assert out["label"] == "CORE-20" and out["num_tasks"] == 20
    assert out["missing_tasks"] == ["squad", "coqa"]
    assert sum(t["num_cropped"] for t in out["tasks"].values()) > 0
    centered = []
    for label, t in out["tasks"].items():
        assert t["num_examples"] == 11
        b = t["random_baseline"] / 100
        assert t["centered"] == pytest.approx((t["accuracy"] - b) / (1 - b))
        centered.append(t["centered"])
    assert out["core_metric"] == pytest.approx(sum(centered) / 20)
    json.dumps(out)


def test_cli_writes_json_and_table(tmp_path, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    import eval_core

    model_dir = save_tiny_llama(str(tmp_path / "model"))
    output = tmp_path / "results.json"
    eval_core.main([
        "--model", model_dir, "--bundle", CORE_SAMPLE, "--tasks", "copa,winograd,jeopardy", "--max-per-task", "11",
        "--batch-size", "5", "--device", "cpu", "--dtype", "float32", "--trust-remote-code", "--output", str(output),
    ])
    printed = capsys.readouterr().out
    with open(output) as f:
        out = json.load(f)
    assert out["label"] == "CORE-3" and list(out["tasks"]) == ["copa", "winograd", "jeopardy"]
    assert out["settings"]["max_seq_len"] == 256 and out["settings"]["dtype"] == "torch.float32"
    assert "CORE-3 (v1 baselines)" in printed and "missing from the 22-task CORE" in printed
    assert f"{out['core_metric']:.4f}" in printed


def test_empty_scored_span_cannot_win(words, tmp_path):
    tok, table = words
    root = tmp_path / "b"
    os.makedirs(root / "eval_data")
    rows = [
        # "sky is blue" is a token prefix of "sky is blue very": the first choice has nothing left to score
        {"query": "sky is", "choices": ["blue", "blue very"], "gold": 1},
        {"query": "sky is", "choices": ["blue", "blue"], "gold": 0},  # identical choices: the first is taken
    ]
    (root / "eval_data" / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "core.yaml").write_text(yaml.safe_dump({"icl_tasks": [{
        "label": "t", "dataset_uri": "t.jsonl", "num_fewshot": [0], "icl_task_type": "multiple_choice",
        "random_baseline_v1": 50}]}))
    out = evaluate_core(TableLM(table), tok, str(root), max_seq_len=None, log=None)
    assert out["tasks"]["t"]["accuracy"] == 1.0
