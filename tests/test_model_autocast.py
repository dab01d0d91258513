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
    # the "vlt" kind's values are the float32 residual stream (no W_V): it failed on the GPU under bf16 autocast
    ("gka", dict(attention_layers=["vlt", "gka"], num_register_tokens=1)),
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


@pytest.mark.parametrize("op", ["rbf", "gka", "hybrid", "scalar", "dot"])
def test_attention_functions_take_autocast_dtype(op):
    """Under autocast the attention functions cast their float32 inputs to autocast's dtype, as PyTorch's SDPA does
    (GKA's features come straight from the float32 residual stream: uncast, the fused kernels ran float32 matmuls)."""
    import hf_rbf

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    qs, ks = torch.randn(1, 2, 5, generator=g), torch.randn(1, 2, 5, generator=g)
    calls = {
        "rbf": lambda q, k, v, qs, ks: hf_rbf.rbf_attention(q, k, v),
        "gka": lambda q, k, v, qs, ks: hf_rbf.gka_attention(q, 0.3),
        "hybrid": lambda q, k, v, qs, ks: hf_rbf.hybrid_attention(q, k, v, qs, ks, 0.5),
        "scalar": lambda q, k, v, qs, ks: hf_rbf.scalar_attention(qs, ks, v, 0.5),
        "dot": lambda q, k, v, qs, ks: hf_rbf.dot_attention(q.bfloat16(), k.bfloat16(), v),  # v float32, as vlt's
    }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = calls[op](q, k, v, qs, ks)
        ref = calls[op](*(t.bfloat16() for t in (q, k, v, qs, ks)))  # what the cast must amount to
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
