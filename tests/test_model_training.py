"""Training contract: loss through ``self.loss_function`` with ``num_items_in_batch`` (exact gradient accumulation in
``Trainer``), gradient checkpointing, no unused parameters in any configuration, parameter counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model, disable_activation_checkpointing, enable_activation_checkpointing, make_config

from hf_rbf import GkaForCausalLM, RbfForCausalLM


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


def _examples(vocab: int, seed: int = 0):
    """Four examples of different lengths with different numbers of ignored labels."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length, n_ignored in ((9, 0), (4, 2), (7, 5), (3, 1)):
        ids = torch.randint(1, vocab, (length,), generator=gen)
        labels = ids.clone()
        labels[:n_ignored] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _collate(batch):
    """Right padding (pad id 0, label -100)."""
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros(len(batch), n, dtype=torch.long)
    for i, b in enumerate(batch):
        m = len(b["input_ids"])
        ids[i, :m], labels[i, :m], mask[i, :m] = b["input_ids"], b["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_loss_uses_num_items_in_batch():
    model = build_model("rbf", {})
    batch = _collate(_examples(128))
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        shift_labels = batch["labels"][:, 1:].reshape(-1)
        token_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
        mean = model(**batch).loss
        with_items = model(**batch, num_items_in_batch=torch.tensor(100)).loss
    n_valid = (shift_labels != -100).sum()
    assert torch.allclose(mean, token_sum / n_valid, atol=1e-6)
    assert torch.allclose(with_items, token_sum / 100, atol=1e-6)


def _train_one_step(family, overrides, tmp_path, batch_size: int, accumulation: int):
    from transformers import Trainer, TrainingArguments

    model = build_model(family, overrides, randomize=False)
    model.train()
    args = TrainingArguments(
        output_dir=str(tmp_path / f"bs{batch_size}_ga{accumulation}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_examples(model.config.vocab_size), data_collator=_collate)
    assert trainer.model_accepts_loss_kwargs
    result = trainer.train()
    return result.training_loss, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize(
    "family,overrides",
    [("rbf", dict(num_register_tokens=2)), ("gka", dict(num_hidden_layers=2, attention_layers=["gka", "dot"]))],
)
def test_trainer_gradient_accumulation_equals_one_large_batch(family, overrides, tmp_path):
    loss_big, params_big = _train_one_step(family, overrides, tmp_path, batch_size=4, accumulation=1)
    loss_acc, params_acc = _train_one_step(family, overrides, tmp_path, batch_size=2, accumulation=2)
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)
    # one SGD step: equal parameters <=> equal gradients
    for name, p in params_big.items():
        assert torch.allclose(params_acc[name], p, atol=1e-6, rtol=1e-5), name


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.detach().clone() if p.grad is not None else None for n, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(core_case, reentrant):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    model.train()
    batch = _collate(_examples(model.config.vocab_size))
    plain = _grads(model, batch)
    enable_activation_checkpointing(model, use_reentrant=reentrant)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = _grads(model, batch)
    disable_activation_checkpointing(model)
    for name, g in plain.items():
        assert checkpointed[name] is not None and torch.allclose(checkpointed[name], g, atol=1e-6, rtol=1e-5), name


def test_every_parameter_gets_a_gradient(family_case):
    """Every parameter is in the autograd graph at initialisation (zero registers, constant SuSiE / sigma), so DDP needs
    no ``find_unused_parameters``, and every gradient is non-zero once the weights leave their initial values.

    (At initialisation the softmax-free RBF variant gives ``register_position`` an exactly zero gradient: the registers'
    values ``W_V * 0`` are zero, and without a softmax denominator nothing else depends on their keys.  The gradient
    still flows to ``register_tokens`` through those values, and the first step moves them off zero.)"""
    _, family, overrides = family_case
    for randomize in (False, True):
        model = build_model(family, overrides, randomize=randomize)
        model.train()
        batch = _collate(_examples(model.config.vocab_size))
        grads = _grads(model, batch)
        not_in_graph = [n for n, g in grads.items() if g is None]
        assert not not_in_graph, not_in_graph
        assert all(torch.isfinite(g).all() for g in grads.values())
        if randomize:
            zero = [n for n, g in grads.items() if g.abs().max() == 0]
            assert not zero, zero


def _attention_params(layer) -> int:
    return sum(p.numel() for p in layer.self_attn.parameters())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("registers", [0, 3])
def test_gka_attention_parameter_count_matches_the_paper(bias, registers):
    d, heads, layers = 64, 4, 3
    cfg = make_config(
        "gka",
        hidden_size=d,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        attention_bias=bias,
        num_register_tokens=registers,
    )
    model = GkaForCausalLM(cfg)
    head_dim = d // heads
    per_layer = d * d + (d if bias else 0) + heads + registers * head_dim
    for layer in model.model.layers:
        assert _attention_params(layer) == per_layer
        assert {n for n, _ in layer.self_attn.named_parameters()} == (
            {"o_proj.weight", "log_sigma"}
            | ({"o_proj.bias"} if bias else set())
            | ({"register_position"} if registers else set())
        )
    mlp = 3 * d * cfg.intermediate_size
    expected = cfg.vocab_size * d + layers * (per_layer + mlp + 2 * d) + d + registers * d
    assert model.num_parameters() == expected  # tied LM head counted once


def test_rbf_and_dot_parameter_counts():
    d, heads = 32, 4
    cfg = make_config(
        "rbf",
        num_hidden_layers=2,
        attention_layers=["rbf", "dot"],
        rbf_learnable_gamma=True,
        num_register_tokens=2,
        tie_word_embeddings=False,
    )
    model = RbfForCausalLM(cfg)
    head_dim = d // heads
    rbf_layer, dot_layer = model.model.layers
    assert _attention_params(rbf_layer) == 4 * d * d + heads + heads * head_dim // 2 + 2 * head_dim
    assert _attention_params(dot_layer) == 4 * d * d + 2 * head_dim
    assert model.lm_head.weight is not model.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["rbf", "gka"])
def test_zero_initialised_registers_get_ordinary_gradients(family):
    """Registers start at exactly zero; normalising them would multiply their gradient by 1/sqrt(eps) per layer
    (1e6 and more at initialisation), which would make global gradient clipping freeze every other parameter."""
    model = build_model(family, dict(num_hidden_layers=4, num_register_tokens=2), randomize=False)
    model.train()
    batch = _collate(_examples(model.config.vocab_size))
    norms = {n: g.norm().item() for n, g in _grads(model, batch).items()}
    register = max(v for n, v in norms.items() if "register" in n)
    others = max(v for n, v in norms.items() if "register" not in n)
    assert 0 < register < others


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("rbf", dict(num_register_tokens=2, rbf_learnable_gamma=True)),
        ("gka", dict(num_register_tokens=1)),
        ("scalar_sort", dict(num_register_tokens=1)),
        ("hybrid_sort", dict(num_register_tokens=1)),
    ],
)
def test_trainer_does_not_decay_the_kernel_parameters(family, overrides, tmp_path):
    """HfRbfTrainer decays projection and MLP weights but not log sigma / log gamma / tau, SuSiE weights, registers or
    the sink (Trainer's default rule would decay all of them)."""
    from transformers import Trainer, TrainingArguments

    from hf_rbf.trainer import HfRbfTrainer

    model = build_model(family, overrides)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], weight_decay=0.1)
    real = {n for n, _ in model.named_parameters()}  # Trainer's name list also holds parameters set to None
    decayed = set(HfRbfTrainer(model=model, args=args).get_decay_parameter_names(model)) & real
    default = set(Trainer(model=model, args=args).get_decay_parameter_names(model)) & real
    special = {
        n
        for n, _ in model.named_parameters()
        if any(key in n for key in ("log_sigma", "log_gamma", "tau_bias", "susie_weight", "register_", "sink_value"))
    }
    assert special, "the configuration should have kernel parameters"
    # Trainer alone would decay them (tau_bias already escapes through its name's "bias")
    assert {n for n in special if "bias" not in n} <= default
    assert not (special & decayed)
    assert decayed == default - special
    assert any(n.endswith("o_proj.weight") for n in decayed) and any(n.endswith("gate_proj.weight") for n in decayed)
