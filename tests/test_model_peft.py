"""PEFT LoRA on each family: the documented target modules, a few training steps, merge_and_unload."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


PEFT_CASES = [
    ("rbf", dict(num_register_tokens=2), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("gka", dict(), ["o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("gka", dict(num_hidden_layers=2, attention_layers=["gka", "dot"], num_register_tokens=1), None),
]


@pytest.mark.parametrize("family,overrides,targets", PEFT_CASES, ids=["rbf", "gka", "gka-dot"])
def test_lora_train_and_merge(family, overrides, targets):
    peft = pytest.importorskip("peft")
    model = build_model(family, overrides)
    if targets is None:
        targets = list(type(model).lora_target_modules)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(model, lora)

    # every targeted linear got an adapter, and only adapters train
    wrapped = {name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    assert wrapped == set(targets) & present
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(5):
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1e-3, losses

    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids, attention_mask=mask).logits
        merged = peft_model.merge_and_unload()
        assert not any(hasattr(m, "lora_A") for m in merged.modules())
        assert type(merged) is type(model)
        merged_logits = merged(input_ids=ids, attention_mask=mask).logits
    assert (merged_logits - adapted).abs().max().item() < 1e-5
