"""The gist's regularizers: L_align equals its materialised definition and its gradient reaches the scalar
projections only; L_spread's gradient goes through the key values, not the sort order; L_tau; the loss and output
fields; gradient checkpointing; Trainer logs them and gradient accumulation matches one large batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model, disable_activation_checkpointing, enable_activation_checkpointing
from sorted_cache_helpers import left_padded

from hf_rbf import hybrid_attention, scalar_attention
from hf_rbf.scalar_regularizers import align_rows_reference, spread_loss, tau_loss

REG_CASES = [
    ("scalar-r2-sink-g2", "scalar_sort", dict(num_register_tokens=2, num_value_groups=2, tau_mode="per_token")),
    ("hybrid-kinds-r1", "hybrid_sort", dict(head_kinds=["hybrid", "scalar", "dot", "hybrid"], num_register_tokens=1)),
    ("scalar-window-dot", "scalar_sort", dict(num_hidden_layers=3, attention_layers=["scalar", "dot", "scalar"],
                                              window_pattern="SLL", sliding_window=3, scalar_sink=False)),
]  # fmt: skip


def _layer_inputs(model, ids, mask):
    """The (normalised) inputs of every layer, captured the way the model captures them for its regularizers."""
    captured = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, kw: captured.append((m, a, kw)), with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        model(ids, attention_mask=mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return captured


def _weights_and_keys(attn, x, rx, mask, pos):
    """Materialised attention weights ``[B, H, N, P + N]`` of a layer (identity values), and its qs / prefixed ks."""
    b, n, _ = x.shape
    proj = attn.project(x, pos)
    tau = attn.temperature(x)
    reg = attn.project_registers(rx) if rx is not None else None
    prefix, p = attn._prefix(reg, x.dtype, x.device)
    keys = attn._cat_keys([prefix, proj], b)
    nk = keys.ks.shape[-1]
    eye = torch.eye(nk, dtype=x.dtype).expand(b, attn.num_heads, nk, nk)
    am, _ = attn._mask_args(n, p, mask, None)
    common = dict(causal=True, window=attn.window, attention_mask=am, num_prefix_keys=p, backend="naive")
    if attn.has_vector_term:
        w = hybrid_attention(proj.q, keys.k, eye, proj.qs, keys.ks, tau, scale=attn._scale(x.device), **common)
    else:
        w = scalar_attention(proj.qs, keys.ks, eye, tau, **common)
    return w, proj.qs, keys.ks


@pytest.mark.parametrize("align_gradient", ["upstream", "scalar_projections"])
@pytest.mark.parametrize("case", REG_CASES, ids=[c[0] for c in REG_CASES])
def test_align_equals_the_materialised_definition_with_the_right_gradients(case, align_gradient):
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [9, 6])
    for module, args, kwargs in _layer_inputs(model, ids, mask):
        attn = module.self_attn
        if attn.kind == "dot":
            continue
        x = module.input_layernorm(args[0]).detach()
        rx = module.input_layernorm.capped(args[1]).detach() if args[1] is not None else None
        am, pos = kwargs["attention_mask"], kwargs["position_embeddings"]
        heads = attn._scalar_head_mask(x.device)
        valid = mask.bool()

        model.zero_grad()
        total, count = attn.regularizer_terms(x, rx, attention_mask=am, position_embeddings=pos, align=True,
                                              spread=False, tau=False, spread_range=[-3, 3], spread_adaptive_width=3.0,
                                              align_gradient=align_gradient)["align"]  # fmt: skip
        (total / count).backward()
        got = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}

        model.zero_grad()
        w, qs, ks = _weights_and_keys(attn, x, rx, am, pos)
        rows = align_rows_reference(qs, ks, w.detach())  # the gist's form, weights detached
        sel = valid.unsqueeze(1) & heads.view(1, -1, 1)
        ref = rows[sel].mean()
        ref.backward()
        want = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}

        assert torch.allclose(total / count, ref, rtol=1e-5, atol=1e-7)
        if align_gradient == "upstream":
            # the gist's code: gradient through qs / ks wherever they come from (register offsets included)
            assert set(got) == set(want), (set(got), set(want))
        else:
            # only the scalar projections receive gradient, and exactly the reference's gradient
            assert set(got) <= {"qs_proj.weight", "ks_proj.weight", "qs_proj.bias", "ks_proj.bias"}, set(got)
            assert set(got) == set(want) - {n for n in want if not n.startswith(("qs_proj", "ks_proj"))}
        for name in got:
            assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_model_align_gradient_reaches_upstream_or_only_the_scalar_projections(family):
    overrides = dict(num_register_tokens=1, align_loss_weight=1.0)
    if family == "hybrid_sort":
        overrides["head_kinds"] = ["hybrid", "dot"]
    touched = {}
    for mode in ("upstream", "scalar_projections"):
        model = build_model(family, dict(overrides, align_gradient=mode))
        model.train()
        ids, mask = left_padded(model.config.vocab_size, [8, 5])
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        (out.loss - out.lm_loss).backward()
        touched[mode] = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
    only = touched["scalar_projections"]
    assert only and all(n.endswith(("qs_proj.weight", "ks_proj.weight")) for n in only), only
    # upstream: the embedding, the first layer's norm and projections below the last layer's qs / ks learn from it
    up = touched["upstream"]
    assert "model.embed_tokens.weight" in up and "model.layers.0.input_layernorm.weight" in up, up
    assert "model.layers.0.self_attn.v_proj.weight" in up and only < up
    assert "model.embed_tokens.weight" not in only


def test_spread_gradient_goes_through_the_values_not_the_sort_order():
    gen = torch.Generator().manual_seed(0)
    ks = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :2] = False
    total, count = spread_loss(ks, valid, value_range=(-2.0, 1.0))
    (total / count).backward()
    # reference: per row, the valid keys sorted by a fixed permutation against linspace(a, b, n)
    ks2 = ks.detach().clone().requires_grad_(True)
    errs = []
    for b in range(2):
        idx = valid[b].nonzero().flatten()
        for h in range(3):
            vals = ks2[b, h, idx]
            perm = torch.argsort(vals.detach())
            errs.append((vals[perm] - torch.linspace(-2.0, 1.0, len(idx), dtype=torch.float64)) ** 2)
    ref = torch.cat(errs).mean()
    ref.backward()
    assert count == 3 * (7 + 5)
    assert torch.allclose(total / count, ref) and torch.allclose(ks.grad, ks2.grad)
    assert ks.grad[1, :, :2].abs().max() == 0  # padding gets no gradient

    # adaptive range: targets from the detached mean +- 3 std of each row
    ks3 = ks.detach().clone().requires_grad_(True)
    total, count = spread_loss(ks3, None, value_range="adaptive", adaptive_width=3.0)
    mean, std = ks3.detach().mean(-1, keepdim=True), ks3.detach().std(-1, unbiased=False, keepdim=True)
    targets = mean + std * torch.linspace(-3.0, 3.0, 7, dtype=torch.float64)
    ref = ((torch.sort(ks3, -1).values - targets) ** 2).mean()
    assert torch.allclose(total / count, ref)


def test_tau_loss_values():
    tau = torch.tensor([0.1, 0.5, 2.0])
    total, count = tau_loss(tau)
    assert torch.allclose(total / count, torch.log1p(tau).sum())
    per_token = torch.rand(2, 3, 4) + 0.1
    valid = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    total, count = tau_loss(per_token, valid, head_mask=torch.tensor([True, False, True]))
    ref = torch.log1p(per_token)[:, [0, 2]].sum(1)[valid].mean()
    assert torch.allclose(total / count, ref) and count == 7


@pytest.mark.parametrize("mode", ["per_head", "per_token"])
def test_loss_and_output_fields(mode):
    model = build_model(
        "scalar_sort",
        dict(
            tau_mode=mode, align_loss_weight=0.5, spread_loss_weight=0.25, tau_loss_weight=2.0, spread_range="adaptive"
        ),
    )
    ids, mask = left_padded(model.config.vocab_size, [8, 6])
    labels = ids.masked_fill(mask == 0, -100)
    model.train()
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.align_loss > 0 and out.spread_loss > 0 and out.tau_loss > 0
    expected = out.lm_loss + 0.5 * out.align_loss + 0.25 * out.spread_loss + 2.0 * out.tau_loss
    assert torch.allclose(out.loss, expected)
    out.loss.backward()
    # L_tau reaches the temperature parameters
    tau_param = "tau_bias" if mode == "per_head" else "tau_proj.weight"
    assert model.model.layers[0].self_attn.get_parameter(tau_param).grad.abs().max() > 0
    # with num_items_in_batch, each term is scaled like the summed cross-entropy
    n_tokens = (labels[:, 1:] != -100).sum()
    out2 = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(40))
    regs = 0.5 * out2.align_loss + 0.25 * out2.spread_loss + 2.0 * out2.tau_loss
    assert torch.allclose(out2.loss, out2.lm_loss + regs * n_tokens / 40, rtol=1e-6)
    # without labels, or with weights 0, nothing extra is computed
    assert model(ids).align_loss is None
    plain = build_model("scalar_sort", {})
    out3 = plain(ids, labels=ids)
    assert out3.align_loss is None and torch.equal(out3.loss, out3.lm_loss)
    assert len(plain(ids, labels=ids, return_dict=False)) >= 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_keeps_the_regularizer_gradients(reentrant):
    model = build_model(
        "hybrid_sort",
        dict(num_register_tokens=1, align_loss_weight=1.0, spread_loss_weight=1.0, tau_loss_weight=1.0,
             tau_mode="per_token"),
    )  # fmt: skip
    model.train()
    ids, mask = left_padded(model.config.vocab_size, [8, 5])
    labels = ids.masked_fill(mask == 0, -100)

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    enable_activation_checkpointing(model, use_reentrant=reentrant)
    checkpointed = grads()
    disable_activation_checkpointing(model)
    assert set(plain) == set(checkpointed)
    for name, g in plain.items():
        assert torch.allclose(checkpointed[name], g, atol=1e-6, rtol=1e-5), name


def _examples(vocab: int):
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, vocab, (n,), generator=gen)} for n in (9, 4, 7, 3)]


def _collate(batch):
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros(len(batch), n, dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, : len(b["input_ids"])] = b["input_ids"]
        mask[i, : len(b["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train_one_step(tmp_path, batch_size, accumulation, family="scalar_sort"):
    from transformers import TrainingArguments

    from hf_rbf.trainer import HfRbfTrainer

    model = build_model(
        family,
        dict(align_loss_weight=0.5, spread_loss_weight=0.1, tau_loss_weight=0.2, num_register_tokens=1),
        randomize=False,
    )
    model.train()
    args = TrainingArguments(
        output_dir=str(tmp_path / f"{family}_bs{batch_size}_ga{accumulation}"),
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
    trainer = HfRbfTrainer(
        model=model, args=args, train_dataset=_examples(model.config.vocab_size), data_collator=_collate
    )
    result = trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return result.training_loss, {k: v.detach().clone() for k, v in model.named_parameters()}, logs


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_trainer_logs_the_regularizers_and_accumulation_matches_one_batch(tmp_path, family):
    loss_big, params_big, logs = _train_one_step(tmp_path, batch_size=4, accumulation=1, family=family)
    loss_acc, params_acc, _ = _train_one_step(tmp_path, batch_size=2, accumulation=2, family=family)
    assert logs and all(k in logs[0] for k in ("align_loss", "spread_loss", "tau_loss"))
    assert logs[0]["align_loss"] > 0
    # the regularizers are token-weighted means under accumulation, so the two runs agree up to the per-micro-batch
    # means (exact for L_tau with a per-head tau; close for the others)
    assert loss_acc == pytest.approx(loss_big, rel=2e-2)
    for name, p in params_big.items():
        assert torch.allclose(params_acc[name], p, atol=5e-3, rtol=5e-2), name


def test_cross_entropy_part_is_the_standard_loss():
    model = build_model("scalar_sort", dict(align_loss_weight=1.0))
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
        ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.lm_loss, ce, atol=1e-6)
