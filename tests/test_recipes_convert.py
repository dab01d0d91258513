"""recipes/convert_to_rbf.py end to end at test size: train a tiny Llama, switch it to attn_implementation="rbf",
recover with LoRA and full fine-tuning, write the table."""

from __future__ import annotations

import json
import math
import os

import pytest

from recipes import convert_to_rbf


# transformers contract (Trainer, PEFT, AttentionInterface): CI also runs this module against the oldest versions
pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_conversion_recipe_runs_and_reports_every_stage(tmp_path):
    out = tmp_path / "out"
    config = os.path.join(REPO, "tests", "data", "convert_tiny.yaml")
    rc = convert_to_rbf.main(
        ["--config", config, "--set", f"output_dir={tmp_path / 'run'}", "--steps", "4", "--output", str(out)]
    )
    assert rc == 0
    result = json.loads((out / "conversion.json").read_text())
    for key in ("loss_original", "loss_after_switch", "loss_after_lora", "loss_after_full", "loss_control_full"):
        assert math.isfinite(result[key]) and 0 < result[key] < 10, key
    # the switch changes the attention (the key-norm penalty), so the loss moves, and both recoveries train something
    assert result["loss_after_switch"] != result["loss_original"]
    assert 0 < result["lora_trainable_parameters"] < result["full_trainable_parameters"]
    assert result["rbf_backend"] in ("naive", "sdpa", "flex", "triton")
    assert 'switched to `attn_implementation="rbf"`' in (out / "conversion.md").read_text()


@pytest.mark.parametrize(
    "bad, named",
    [
        (["--steps", "0"], "--steps"),
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--learning-rate", "0"], "--learning-rate"),
        (["--config", "no/such/recipe.yaml"], "--config"),
        (["--model", "no/such/checkpoint"], "--model"),
    ],
)
def test_bad_arguments_are_refused(bad, named, capsys):
    config = os.path.join(REPO, "tests", "data", "convert_tiny.yaml")
    with pytest.raises(SystemExit):
        convert_to_rbf.main(["--config", config, *bad])
    err = capsys.readouterr().err
    assert named in err and "must be" in err
