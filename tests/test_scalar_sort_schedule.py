"""The regularizer schedule (the gist's tuning advice: weight ``L_align`` first, add ``L_spread`` after initial
convergence): per-regularizer start step and linear warmup in the config, driven by ``HfRbfTrainer``'s global step."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from sorted_cache_helpers import left_padded

from hf_rbf import ScalarSortConfig
from hf_rbf.configuration_scalar_sort import regularizer_schedule_factor


# transformers contract (Trainer): CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract

SCHEDULED = dict(align_loss_weight=0.5, spread_loss_weight=2.0, spread_loss_start_step=3, spread_loss_warmup_steps=4,
                 tau_loss_weight=0.1, tau_loss_warmup_steps=2)  # fmt: skip


def test_schedule_factor():
    assert [regularizer_schedule_factor(s, 3, 4) for s in range(9)] == [0, 0, 0, 0, 0.25, 0.5, 0.75, 1, 1]
    assert [regularizer_schedule_factor(s, 2, 0) for s in range(4)] == [0, 0, 1, 1]
    assert [regularizer_schedule_factor(s, 0, 0) for s in range(2)] == [1, 1]
    cfg = ScalarSortConfig(**SCHEDULED)
    assert cfg.regularizer_schedule_enabled and not ScalarSortConfig(align_loss_weight=1.0).regularizer_schedule_enabled
    assert cfg.regularizer_weight("spread", 5) == pytest.approx(1.0) and cfg.regularizer_weight("spread", None) == 2.0
    assert cfg.regularizer_weight("tau", 1) == pytest.approx(0.05) and cfg.regularizer_weight("align", 0) == 0.5


@pytest.mark.parametrize(
    "field", ["align_loss_start_step", "spread_loss_warmup_steps", "tau_loss_start_step", "align_loss_warmup_steps"]
)
@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_schedule_fields_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}.*int >= 0"):
        ScalarSortConfig(**{field: value})


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_the_loss_follows_the_schedule(family):
    model = build_model(family, SCHEDULED)
    model.train()
    ids, mask = left_padded(model.config.vocab_size, [8, 6])
    labels = ids.masked_fill(mask == 0, -100)
    with pytest.raises(ValueError, match="set_regularizer_step"):
        model(ids, attention_mask=mask, labels=labels)  # training, scheduled, no step known
    seen = {}
    for step in (0, 1, 3, 5, 7, 20):
        model.set_regularizer_step(step)
        out = model(ids, attention_mask=mask, labels=labels)
        spread = 2.0 * regularizer_schedule_factor(step, 3, 4)
        tau = 0.1 * regularizer_schedule_factor(step, 0, 2)
        expected = out.lm_loss + 0.5 * out.align_loss
        if spread > 0:
            expected = expected + spread * out.spread_loss
        else:
            assert out.spread_loss is None  # not computed while its weight is 0
        if tau > 0:
            expected = expected + tau * out.tau_loss
        else:
            assert out.tau_loss is None
        assert torch.allclose(out.loss, expected), step
        seen[step] = out.loss.item()
    assert len(set(seen.values())) > 3
    # eval mode without a step: the full weights (the trained objective)
    model.eval().set_regularizer_step(None)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
    assert torch.allclose(out.loss, out.lm_loss + 0.5 * out.align_loss + 2.0 * out.spread_loss + 0.1 * out.tau_loss)
    with pytest.raises(ValueError, match="`step` must be an int >= 0"):
        model.set_regularizer_step(-3)


def test_trainer_drives_the_schedule_and_logs_the_weights(tmp_path):
    from transformers import TrainingArguments

    from hf_rbf.trainer import HfRbfTrainer

    model = build_model("scalar_sort", dict(align_loss_weight=1.0, spread_loss_weight=0.5, spread_loss_start_step=2,
                                            spread_loss_warmup_steps=2))  # fmt: skip
    model.train()
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 128, (8,), generator=gen)} for _ in range(12)]

    def collate(batch):
        ids = torch.stack([b["input_ids"] for b in batch])
        return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=5, logging_steps=1,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)  # fmt: skip
    trainer = HfRbfTrainer(model=model, args=args, train_dataset=data, data_collator=collate)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2, 3, 4, 5]
    # log of step s reports the forward at global step s - 1: spread weight 0, 0, 0, 0.25, 0.5
    assert [entry["spread_loss_weight"] for entry in logs] == [0.0, 0.0, 0.0, 0.25, 0.5]
    assert [entry["align_loss_weight"] for entry in logs] == [1.0] * 5
    assert ["spread_loss" in entry for entry in logs] == [False, False, False, True, True]
    assert all(entry["align_loss"] > 0 for entry in logs)
    assert model.regularizer_step == 4


def test_a_new_step_recompiles_only_when_a_weight_changes():
    """Under torch.compile the forward reads the weights at the step, not the step: steps 0, 1 share the weights
    (spread off), step 2 switches spread on (one recompilation), step 3 shares step 2's."""
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    model = build_model("scalar_sort", dict(align_loss_weight=1.0, spread_loss_weight=0.5, spread_loss_start_step=2))
    model.train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend)
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    counts = []
    for step in range(4):
        model.set_regularizer_step(step)
        compiles.clear()
        out = compiled(ids, labels=ids)
        out.loss.backward()
        counts.append(len(compiles))
    torch._dynamo.reset()
    assert counts[0] > 0 and counts[1] == 0 and counts[2] > 0 and counts[3] == 0, counts
    assert out.spread_loss is not None
