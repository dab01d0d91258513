"""benchmarks/find_nonfinite_grads.py's recorder: it names the step, the parameters and the attention where a NaN is
born, and stays quiet on a finite step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_rbf  # noqa: F401  (registers the families)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import find_nonfinite_grads as nf


class _NanGradient(torch.autograd.Function):
    """Identity forward; a NaN in the gradient it passes back (an attention that makes a NaN in its backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad


def _model():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "rbf",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=48,
        num_register_tokens=1,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _step(model, recorder, step):
    recorder.begin_step(step)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return recorder.end_step(float(out.loss.detach()))


def test_recorder_names_the_attention_and_parameters_of_a_nan(tmp_path):
    model = _model()
    recorder = nf.NonFiniteRecorder(model)
    clean = _step(model, recorder, 1)
    assert clean["nonfinite_grads"] == []
    names = [f"model.layers.{i}.self_attn" for i in range(3)]
    assert sorted(clean["attention"]) == names
    for entry in clean["attention"].values():
        assert entry["output_finite"] and entry["output_grad_finite"] and entry["input_grad_finite"]
        assert entry["input_absmax"] > 0 and entry["output_absmax"] >= 0
    assert "model.register_tokens" in clean["small_parameters"]

    # layer 1's attention now makes a NaN in its backward: the gradient reaching its output is finite, the one it
    # sends to its input is not, and only parameters at or below it get NaN gradients
    attn = model.model.layers[1].self_attn
    attn.q_proj.register_forward_hook(lambda mod, args, out: _NanGradient.apply(out))
    bad = _step(model, recorder, 2)
    layer1 = bad["attention"]["model.layers.1.self_attn"]
    assert layer1["output_grad_finite"] and not layer1["input_grad_finite"]
    assert bad["attention"]["model.layers.2.self_attn"]["input_grad_finite"]
    assert "model.layers.1.self_attn.q_proj.weight" in bad["nonfinite_grads"]
    assert not any(name.startswith("model.layers.2.") for name in bad["nonfinite_grads"])
    recorder.remove()

    path = tmp_path / "nonfinite.json"
    path.write_text(json.dumps({"first_nonfinite_step": 2, "steps": recorder.records}))
    summary = nf.summarize(str(path))
    assert "first non-finite step: 2" in summary
    assert "NaN born in attention of ['model.layers.1.self_attn']" in summary
