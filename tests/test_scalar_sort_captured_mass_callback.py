"""Captured mass during training: ``batch_captured_mass`` agrees with the offline recipe
(``recipes/measure_captured_mass.py``) and with its limits, and ``CapturedMassCallback`` logs it through
``Trainer.log`` every N steps of a real (tiny, CPU) training run."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model

from hf_rbf.eval.captured_mass_callback import CapturedMassCallback, batch_captured_mass


# transformers contract (Trainer): CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract

CASES = [
    ("scalar-r1-g2", "scalar_sort", dict(num_register_tokens=1, num_value_groups=2)),
    ("hybrid-kinds-dot-layer", "hybrid_sort", dict(num_hidden_layers=3, attention_layers=["hybrid", "dot", "scalar"],
                                                   head_kinds=["hybrid", "scalar", "dot", "hybrid"])),
]  # fmt: skip


def _ids(n=24, batch=1, seed=0):
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_the_offline_recipe(case):
    from recipes.measure_captured_mass import measure

    _, family, overrides = case
    model = build_model(family, overrides)
    ids = _ids(24)
    size = dict(device="cpu", contexts=[24], query_rows=12, chunk=24, windows=[2, 4, 8])
    rows, _ = measure(model, ids[0], size, "tiny")
    for scheme in ("per_head", "sort_head"):
        got = batch_captured_mass(model, ids, [2, 4, 8], num_queries=12, sort_scheme=scheme)
        scalar_layers = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.kind != "dot"]
        assert got["layers"] == scalar_layers
        for row in rows:
            if row["scheme"] != scheme:
                continue
            value = got["per_head"][row["k"]][scalar_layers.index(row["layer"]), row["head"]].item()
            assert value == pytest.approx(row["mean_mass"], abs=2e-6), row
        if family == "hybrid_sort":  # the hybrid layer's "dot" head has no window: NaN, left out of the means
            assert math.isnan(got["per_head"][2][0, 2].item())
            assert not math.isnan(got["mean"][2])


def test_limits_and_batches():
    model = build_model("scalar_sort", dict(num_register_tokens=1))
    model.train()
    ids = _ids(16, batch=3)
    got = batch_captured_mass(model, ids, [1, 4, 16], num_queries=8)
    assert model.training  # mode restored
    assert got["mean"][16] == pytest.approx(1.0, abs=1e-5) and got["worst_head"][16] == pytest.approx(1.0, abs=1e-5)
    assert got["mean"][1] < got["mean"][4] < got["mean"][16]
    assert 0.0 < got["prefix"] < got["mean"][1]
    # a batch is the mean of its sequences
    singles = [batch_captured_mass(model, ids[i : i + 1], [4], num_queries=8)["per_head"][4] for i in range(3)]
    assert torch.allclose(got["per_head"][4], torch.stack(singles).mean(0), atol=1e-6)


def test_bad_arguments_name_themselves():
    model = build_model("scalar_sort", {})
    with pytest.raises(ValueError, match="windows"):
        batch_captured_mass(model, _ids(), [0])
    with pytest.raises(ValueError, match="attention_mask.*padding"):
        batch_captured_mass(model, _ids(), [4], attention_mask=torch.tensor([[0] + [1] * 23]))
    with pytest.raises(ValueError, match="sort_scheme"):
        batch_captured_mass(model, _ids(), [4], sort_scheme="global")
    with pytest.raises(ValueError, match="no scalar-sort / hybrid-sort model"):
        batch_captured_mass(build_model("rbf", {}), _ids(), [4])
    with pytest.raises(ValueError, match="every_n_steps"):
        CapturedMassCallback(_ids(), every_n_steps=0)


def test_callback_logs_through_the_trainer(tmp_path):
    from transformers import TrainingArguments

    from hf_rbf.trainer import HfRbfTrainer

    model = build_model("hybrid_sort", dict(align_loss_weight=1.0), randomize=False)
    model.train()
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 128, (16,), generator=gen)} for _ in range(10)]

    def collate(batch):
        ids = torch.stack([b["input_ids"] for b in batch])
        return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=5, logging_steps=1,
                             learning_rate=3e-3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)  # fmt: skip
    trainer = HfRbfTrainer(model=model, args=args, train_dataset=data, data_collator=collate)
    callback = CapturedMassCallback(_ids(16, batch=2, seed=1), every_n_steps=2, windows=(2, 8), num_queries=8)
    callback.attach(trainer)
    trainer.train()
    rows = [entry for entry in trainer.state.log_history if "captured_mass_k2" in entry]
    assert [entry["step"] for entry in rows] == [2, 4, 5]  # every 2 steps and the last
    for entry in rows:
        assert 0.0 < entry["captured_mass_k2"] <= entry["captured_mass_k8"] <= 1.0 + 1e-6
        assert entry["captured_mass_k2_worst_head"] <= entry["captured_mass_k2"]
        assert 0.0 <= entry["captured_mass_prefix"] <= 1.0
    # the last logged value is a measurement of the trained model on the held-out batch
    assert rows[-1]["captured_mass_k2"] == pytest.approx(callback.metrics(model)["captured_mass_k2"], abs=1e-6)
    assert rows[0]["captured_mass_k2"] != rows[-1]["captured_mass_k2"]  # training changed the model in between
    # passed through `callbacks=` without attach, it says how to attach it
    lone = CapturedMassCallback(_ids(16), every_n_steps=1)
    trainer2 = HfRbfTrainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[lone])
    with pytest.raises(RuntimeError, match="attach"):
        trainer2.train()
