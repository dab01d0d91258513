"""bf16 autocast, as Trainer runs with ``bf16=True``: every family with registers, sinks and mixed layer kinds.

Under autocast the residual stream stays float32 while linear layers return bfloat16, so anything added to a
projection (register positions, scalar offsets, RoPE tables) must follow the projection's dtype, or the attention
functions see mixed dtypes.  A hybrid-sort layer's register rows did exactly that on the GPU; this runs the same
path on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_model


CASES = [
    ("rbf", dict(num_register_tokens=2)),
    ("rbf", dict(position_embedding_type="rope", rbf_normalize=False, num_register_tokens=1)),
    ("gka", dict(num_hidden_layers=4, attention_layers=["gka", "dot"], window_pattern="SSL", sliding_window=3,
                 num_register_tokens=2)),
    ("scalar_sort", dict(num_register_tokens=2, tau_mode="per_token")),
    ("hybrid_sort", dict(num_register_tokens=2)),
    ("hybrid_sort", dict(num_register_tokens=1, attention_layers=["hybrid", "scalar", "dot"], num_hidden_layers=3)),
]


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_bf16_autocast_forward_backward(family, overrides):
    model = build_model(family, overrides).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # the autocast loss is close to the float32 loss (bf16 matmuls, float32 softmax statistics)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids).loss
    assert abs(out.loss.item() - ref.item()) < 0.05 * abs(ref.item())
