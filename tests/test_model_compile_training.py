"""A training step of every family under ``torch.compile(fullgraph=True)`` on the code path a GPU takes: the fused
Triton attention through its ``torch.library`` custom ops (here in Triton's interpreter), forward and backward traced
by AOTAutograd, no graph break inside attention, no recompilation for new data of the same shape, and the same loss
and gradients as eager mode.  On an H100 the same models trained under ``torch.compile`` (default mode) in
``benchmarks/results/h100-profile-2026-11-25/run6-compiled``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_model
from hf_rbf import kernels_common

FAMILIES = {
    "rbf": dict(num_register_tokens=1, position_embedding_type="susie"),  # the family default: register + SuSiE
    "gka": dict(),
    "scalar_sort": dict(),
    "hybrid_sort": dict(),
}


@pytest.mark.skipif(
    not kernels_common.DEFINED_INTERPRETED,
    reason="the triton attention runs on the CPU only in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)",
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_step_compiles_as_one_graph(family):
    torch._dynamo.reset()
    model = build_model(family, dict(FAMILIES[family], attention_backend="triton")).train()
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    try:
        for i in range(2):
            ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
            with torch.compiler.set_stance("fail_on_recompile" if i > 0 else "default"):
                loss = compiled(ids)
            grads = torch.autograd.grad(loss, params)
            ref = loss_fn(ids)
            ref_grads = torch.autograd.grad(ref, params)
            assert abs(loss.item() - ref.item()) < 1e-5, (i, loss.item(), ref.item())
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
        assert model.model.layers[0].self_attn.last_backend in (None, "triton")
    finally:
        torch._dynamo.reset()
