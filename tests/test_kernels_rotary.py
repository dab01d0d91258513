"""The fused RoPE kernel (``hf_rbf/kernels_rotary.py``) against the torch reference in float64: outputs and
gradients, both layouts, strided views of a joint projection, shared and per-row position tables, fewer key heads
than query heads, odd lengths, float32 / bfloat16 / float16; its custom op under ``torch.compile``; and models whose
RoPE runs through it equal the torch path.

On a machine without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``) at small shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # must happen before triton is imported: the kernels are decorated as interpreted functions at import time
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from conftest import build_model  # noqa: E402

from hf_rbf import kernels_common, kernels_rotary, modeling_decoder  # noqa: E402
from hf_rbf.kernels_rotary import rotary_fused, rotary_reason  # noqa: E402
from hf_rbf.modeling_decoder import apply_rotary_reference  # noqa: E402

ON_GPU = torch.cuda.is_available() and not kernels_common.DEFINED_INTERPRETED
IN_PROCESS = ON_GPU or kernels_common.DEFINED_INTERPRETED
DEVICE = "cuda" if ON_GPU else "cpu"
# relative error against float64: float32 is the kernel's own arithmetic; half precision rounds once per output
TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}

pytestmark = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 in this process (run this file alone)"
)


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tables(batch, n, half, gen):
    angles = torch.randn(batch, n, half, generator=gen, dtype=torch.float64) * 3
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "d,hq,hk,table_batch,head_dim", [(16, 3, 3, 1, 1), (64, 4, 2, 2, 2), (6, 2, 1, 1, 1), (32, 3, 1, 2, 2)]
)
def test_matches_float64_reference(dtype, d, hq, hk, table_batch, head_dim):
    gen = torch.Generator().manual_seed(d + hq)
    b, n = 2, 7
    # q and k as views of one joint projection [B, N, (HQ + HK + 1) * D], as the layers make them
    joint = torch.randn(b, n, (hq + hk + 1) * d, generator=gen, dtype=torch.float64)
    cos, sin = tables(table_batch, n, d // 2, gen)

    def heads(t, h):
        t = t.view(b, n, h, d)
        return t.transpose(1, 2) if head_dim == 1 else t

    def run(cast, fused):
        x = cast(joint).to(DEVICE).requires_grad_(True)
        q, k = heads(x[..., : hq * d], hq), heads(x[..., hq * d : (hq + hk) * d], hk)
        c, s = cos.to(DEVICE, torch.float32 if fused else torch.float64), sin.to(DEVICE, c_dtype(fused))
        if fused:
            qo, ko = rotary_fused(q, k, c, s, head_dim)
        else:
            qo, ko = apply_rotary_reference(q, c, s, head_dim), apply_rotary_reference(k, c, s, head_dim)
        weights = torch.randn(qo.shape, generator=gen, dtype=torch.float64).to(DEVICE)
        k_weights = weights[:, :hk] if head_dim == 1 else weights[:, :, :hk]
        ((qo.double() * weights).sum() + (ko.double() * k_weights).sum()).backward()
        return qo.detach(), ko.detach(), x.grad

    def c_dtype(fused):
        return torch.float32 if fused else torch.float64

    gen.manual_seed(1)
    got = run(lambda t: t.to(dtype), True)
    gen.manual_seed(1)
    ref = run(lambda t: t, False)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert rel_err(g, r) <= TOL[dtype], rel_err(g, r)
    assert got[0].dtype == dtype
    assert got[0].shape == ((b, hq, n, d) if head_dim == 1 else (b, n, hq, d))


def test_reason_names_what_cannot_run():
    x = torch.randn(1, 2, 3, 5, device=DEVICE)
    assert "odd" in rotary_reason(x, torch.randn(1, 3, 2, device=DEVICE))


def test_torch_compile_traces_the_custom_op():
    """``torch.compile(fullgraph=True)`` of a function applying the fused RoPE: one graph through the custom op, the
    same values and gradients as eager."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 5, 8, generator=gen, device="cpu").to(DEVICE).requires_grad_(True)
    k = torch.randn(2, 3, 5, 8, generator=gen, device="cpu").to(DEVICE).requires_grad_(True)
    cos, sin = (t.float().to(DEVICE) for t in tables(1, 5, 4, gen))

    def f(q, k):
        qo, ko = rotary_fused(q, k, cos, sin, 1)
        return (qo * 2).sum() + ko.square().sum()

    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        out = compiled(q, k)
        gq, gk = torch.autograd.grad(out, (q, k))
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    eager = f(q, k)
    eq, ek = torch.autograd.grad(eager, (q, k))
    assert graphs == 1
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gq, eq)
    torch.testing.assert_close(gk, ek)


@pytest.mark.parametrize(
    "family,overrides",
    [("rbf", {"position_embedding_type": "rope", "num_register_tokens": 1}), ("hybrid_sort", {}), ("gka", {})],
)
def test_models_with_the_fused_rope_equal_the_torch_path(family, overrides, monkeypatch):
    """A training step's loss and gradients through the fused RoPE (``rotary_backend="triton"``, here in the
    interpreter) equal those of the torch path."""
    model = build_model(family, dict(overrides, attention_backend="naive")).to(DEVICE)
    launch = kernels_rotary._launch
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def step(backend):
        monkeypatch.setattr(modeling_decoder, "rotary_backend", backend)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    launches = []
    monkeypatch.setattr(kernels_rotary, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    loss_t, grads_t = step("torch")
    assert not launches
    loss_f, grads_f = step("triton")
    assert len(launches) == 2 * model.config.num_hidden_layers  # one launch per layer forward, one backward
    torch.testing.assert_close(loss_f, loss_t, rtol=1e-5, atol=1e-6)
    assert grads_f.keys() == grads_t.keys()
    for name, g in grads_t.items():
        # norm-wise: the kernel rounds once (fused multiply-adds on a GPU), the torch path after every op, and the
        # difference of a few float32 ulps grows through the model (on an H100 up to 2.3e-5 for hybrid_sort's
        # temperature, a sum over every score); elementwise, near-zero entries would dominate.  A wrong rotation
        # or layout is an O(1) error.
        assert rel_err(grads_f[name], g.double()) <= 1e-4, (name, rel_err(grads_f[name], g.double()))
    monkeypatch.setattr(modeling_decoder, "rotary_backend", "fast")
    with pytest.raises(ValueError, match="rotary_backend must be one of"):
        model(input_ids=ids)


def test_auto_rope_under_torch_compile_is_the_torch_form_for_inductor_to_fuse(monkeypatch):
    """``rotary_backend="auto"`` takes the torch form wherever torch.compile traces, on CUDA too (inductor fuses it;
    the custom op's Python ran at every call of the compiled graph); "triton" keeps the kernel there."""
    import types

    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(modeling_decoder, "rotary_backend", "auto")
    assert modeling_decoder._rotary_uses_kernel(on_cuda, None) is False
    monkeypatch.setattr(modeling_decoder, "rotary_reason", lambda x, cos: None)
    monkeypatch.setattr(modeling_decoder, "rotary_backend", "triton")
    assert modeling_decoder._rotary_uses_kernel(on_cuda, None) is True
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(modeling_decoder, "rotary_backend", "auto")
    assert modeling_decoder._rotary_uses_kernel(on_cuda, None) is True  # eager on CUDA: the fused kernel
