"""lm-evaluation-harness runs our checkpoints offline: ``lm_eval --model hf --model_args pretrained=<dir>,trust_remote_code=True``.

The task (tests/data/lm_eval_tasks/core_sample_copa.yaml) is COPA from the CORE sample bundle, read from the local
jsonl.  Beyond "it runs", each sample's log-likelihood that lm_eval reports is recomputed here with our own scorer
on the same tokens, so a model that lm_eval loads or tokenizes differently from transformers would fail.

To cover another model family, add a factory to ``MODEL_FACTORIES`` (a function saving a model and its tokenizer
into a folder and returning it), or list existing checkpoint folders in ``HF_RBF_LM_EVAL_MODEL_DIRS``
(comma-separated).
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_helpers import save_tiny_llama  # noqa: E402

from hf_rbf.eval.core import score_sequences  # noqa: E402
from hf_rbf.eval.core_prompts import ScoredSequence  # noqa: E402


pytest.importorskip("lm_eval", reason="lm-eval is an optional test dependency (pip install lm-eval)")

TASK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lm_eval_tasks")
LIMIT = 5

MODEL_FACTORIES = {
    "tiny_llama": lambda path: save_tiny_llama(path, max_position_embeddings=128),
}
_EXTRA_DIRS = [d for d in os.environ.get("HF_RBF_LM_EVAL_MODEL_DIRS", "").split(",") if d]
CASES = [(name, factory) for name, factory in MODEL_FACTORIES.items()] + [(d, d) for d in _EXTRA_DIRS]


def _model_dir(spec, tmp_path):
    return spec if isinstance(spec, str) else spec(str(tmp_path / "model"))


@pytest.mark.parametrize("spec", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_lm_eval_hf_runs_offline_and_matches_our_loglikelihoods(spec, tmp_path):
    model_dir = _model_dir(spec, tmp_path)
    out_dir = tmp_path / "lm_eval_out"
    env = dict(os.environ)
    env.update(
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", "hf",
        "--model_args", f"pretrained={model_dir},trust_remote_code=True,dtype=float32",
        "--tasks", "core_sample_copa",
        "--include_path", TASK_DIR,
        "--device", "cpu",
        "--batch_size", "2",
        "--limit", str(LIMIT),
        "--output_path", str(out_dir),
        "--log_samples",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    (results_path,) = glob.glob(str(out_dir / "*" / "results_*.json"))
    with open(results_path) as f:
        results = json.load(f)
    assert results["n-samples"]["core_sample_copa"] == {"original": 12, "effective": LIMIT}
    metrics = results["results"]["core_sample_copa"]
    assert 0.0 <= metrics["acc,none"] <= 1.0 and 0.0 <= metrics["acc_norm,none"] <= 1.0

    (samples_path,) = glob.glob(str(out_dir / "*" / "samples_core_sample_copa_*.jsonl"))
    with open(samples_path) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == LIMIT

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        ours = []
        for choice in doc["choices"]:
            # lm_eval's split: the context's tokens, then those the full string adds (the tokenizer's default
            # special tokens, as lm_eval's hf model encodes unless add_bos_token is given)
            context = tok(doc["query"])["input_ids"]
            whole = tok(doc["query"] + " " + choice)["input_ids"]
            (score,) = score_sequences(model, [ScoredSequence(whole, len(context), len(whole))])
            ours.append(-score.sum_loss)
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-3)
        correct += int(max(range(len(ours)), key=ours.__getitem__) == doc["gold"])
    assert metrics["acc,none"] == pytest.approx(correct / LIMIT)
