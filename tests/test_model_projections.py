"""``project_together``: several projections of one input as one GEMM, with the separate modules' results and
gradients, and the modules themselves called wherever something wraps or hooks them (PEFT, accelerate)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from torch import nn

from hf_rbf.modeling_decoder import project_together


def _linears(bias_pattern=(True, False, True)):
    torch.manual_seed(0)
    return [nn.Linear(16, width, bias=b).double() for width, b in zip((16, 3, 8), bias_pattern)]


@pytest.mark.parametrize("bias_pattern", [(True, False, True), (False, False, False)])
def test_outputs_and_gradients_equal_separate_calls(bias_pattern):
    linears = _linears(bias_pattern)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    together = project_together(x, linears)
    separate = [m(x) for m in linears]
    for a, b in zip(together, separate):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    weights = [torch.randn_like(t) for t in separate]
    grads_together = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip(together, weights)), [x, *(p for m in linears for p in m.parameters())]
    )
    grads_separate = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip(separate, weights)), [x, *(p for m in linears for p in m.parameters())]
    )
    for a, b in zip(grads_together, grads_separate):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_one_gemm_when_plain(monkeypatch):
    linears = _linears()
    calls = []
    monkeypatch.setattr(
        torch.nn.functional, "linear", lambda *a, **k: calls.append(a[1].shape) or torch._C._nn.linear(*a, **k)
    )
    project_together(torch.randn(4, 16, dtype=torch.float64), linears)
    assert calls == [torch.Size([27, 16])]


def test_hooked_or_wrapped_modules_are_called():
    """A forward hook (what accelerate and many tools use), a replaced ``forward`` and an ``nn.Linear`` subclass
    (PEFT's LoRA layer, quantised linears) each make every module run on its own, so they still take effect."""
    x = torch.randn(4, 16, dtype=torch.float64)
    linears = _linears()
    seen = []
    handle = linears[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    project_together(x, linears)
    handle.remove()
    assert seen == [torch.Size([4, 3])]

    linears = _linears()
    linears[0].forward = lambda inp: torch.zeros(inp.shape[0], 16, dtype=inp.dtype)
    assert project_together(x, linears)[0].abs().sum() == 0

    class Scaled(nn.Linear):
        def forward(self, inp):
            return 2 * super().forward(inp)

    linears = _linears()
    scaled = Scaled(16, 3, bias=False).double()
    scaled.load_state_dict(linears[1].state_dict())
    torch.testing.assert_close(project_together(x, [linears[0], scaled, linears[2]])[1], 2 * linears[1](x))


def test_lora_on_q_proj_changes_the_model_output():
    """PEFT LoRA on ``q_proj`` / ``v_proj`` of an rbf model: the adapter's contribution reaches the output (the fused
    projection steps aside for the wrapped modules)."""
    peft = pytest.importorskip("peft")
    model = build_model("rbf", {}).double()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    base = model(input_ids=ids).logits
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    adapted = lora(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-6
    with lora.disable_adapter():
        torch.testing.assert_close(lora(input_ids=ids).logits, base, rtol=1e-10, atol=1e-10)


def test_inference_on_few_rows_reads_each_weight_once(monkeypatch):
    """A decode step (eval mode, at most ``SEPARATE_PROJECTION_MAX_ROWS`` rows) takes the modules one by one: a
    ``torch.cat`` of the weights would read and write every weight before the GEMM reads it again (on an H100, cat
    kernels of that size took 95 us of the 955 us of GPU work per token of a d768 L12 model at 512k tokens).  Many
    rows, or train mode (with or without gradients: a checkpointed forward and its recompute must agree), keep the
    one GEMM over the concatenation."""
    from hf_rbf import modeling_decoder

    linears = _linears()
    calls = []
    monkeypatch.setattr(
        torch.nn.functional, "linear", lambda *a, **k: calls.append(a[1].shape) or torch._C._nn.linear(*a, **k)
    )
    x = torch.randn(1, 1, 16, dtype=torch.float64)
    for m in linears:
        m.eval()
    for grad in (False, True):
        calls.clear()
        with torch.set_grad_enabled(grad):
            out = project_together(x, linears)
        assert calls == [torch.Size([16, 16]), torch.Size([3, 16]), torch.Size([8, 16])]
        for a, m in zip(out, linears):
            torch.testing.assert_close(a, m(x), rtol=0, atol=0)
    calls.clear()
    project_together(torch.randn(modeling_decoder.SEPARATE_PROJECTION_MAX_ROWS + 1, 16, dtype=torch.float64), linears)
    assert calls == [torch.Size([27, 16])]
    for m in linears:
        m.train()
    for grad in (False, True):
        calls.clear()
        with torch.set_grad_enabled(grad):
            project_together(x, linears)
        assert calls == [torch.Size([27, 16])]


@pytest.mark.parametrize("family", ["scalar_sort", "rbf"])
def test_decode_step_concatenates_no_weights(family):
    """A static-cache decode step without gradients copies no projection weight: no ``aten.cat`` result as large as
    the smallest weight that ``project_together`` joins (the SwiGLU gate and up projections)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_rbf.cache_names import CACHE_NAME

    class Cats(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default:
                self.sizes.append(out.numel())
            return out

    model = build_model(family, {}).eval()  # generate runs models in eval mode (from_pretrained sets it)
    ids = torch.randint(2, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    cache = model.make_static_cache(16)
    mlp = model.model.layers[0].mlp
    smallest = min(mlp.gate_proj.weight.numel(), mlp.up_proj.weight.numel())
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), **{CACHE_NAME: cache})
        token = torch.tensor([[3]])
        with Cats() as cats:
            model(input_ids=token, attention_mask=torch.ones_like(token), **{CACHE_NAME: cache})
    assert cats.sizes, "the probe saw no cat at all (the attention mask's prefix is one)"
    assert max(cats.sizes) < smallest, f"weight-sized cats in a decode step: {cats.sizes} (weights: {smallest})"


def _compiled_graph_ops(fn, *args):
    """``fn(*args)`` compiled with a backend that records the aten ops of its (only) graph and runs it as traced."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    ops = []

    def record(gm, _inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=record), fullgraph=True)(*args)
    return out, ops


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_decode_step_joins_the_small_projections_into_one_reduction(dtype, bias):
    """Compiled, on a decode step's few rows in eval mode, the projections with at most ``SMALL_PROJECTION_MAX_OUT``
    outputs (hidden -> heads: scalar queries and keys) are one multiply-and-sum over their joined weights (Inductor:
    one reduction kernel, where cuBLAS ran a gemv of two kernels for each), the large ones stay one GEMM each (no
    weight-sized ``cat``), and the values are the modules' own up to float32 accumulation order, in their dtype."""
    from hf_rbf import modeling_decoder

    torch.manual_seed(0)
    big = modeling_decoder.SMALL_PROJECTION_MAX_OUT + 1
    widths = (big, 12, 12, big + 16)  # the hybrid's shape: a vector projection, scalar q / k, values
    linears = [nn.Linear(48, w, bias=bias).to(dtype).eval() for w in widths]
    x = torch.randn(1, 1, 48, dtype=dtype)
    with torch.no_grad():
        out, ops = _compiled_graph_ops(lambda t: project_together(t, linears), x)
        expected = [m(x) for m in linears]
    gemms = [op for op in ops if op.startswith(("aten.mm", "aten.addmm", "aten.bmm", "aten.linear"))]
    assert len(gemms) == 2, ops  # the big projection's and the values'; the two scalar ones in the reduction
    assert "aten.sum.dim_IntList" in ops, ops
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}.get(
        dtype, dict(rtol=1e-2, atol=1e-2)
    )
    for a, b in zip(out, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)
    # the reduction in float32 (the GEMMs' accumulation): the scalar outputs match a float64 product to the output
    # dtype's rounding
    x64 = x.double()
    for a, m in zip(out[1:3], linears[1:3]):
        ref = torch.nn.functional.linear(x64, m.weight.double(), None if m.bias is None else m.bias.double())
        rtol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 2**-7)
        torch.testing.assert_close(a.double(), ref, rtol=rtol, atol=rtol)


def test_compiled_training_and_many_rows_keep_the_joined_gemm():
    """Train mode, or more than ``SEPARATE_PROJECTION_MAX_ROWS`` rows, keep the one GEMM over the joined weights
    when compiled (no reduction form)."""
    from hf_rbf import modeling_decoder

    torch.manual_seed(0)
    linears = [nn.Linear(16, w) for w in (16, 3, 3)]
    few = torch.randn(1, 1, 16)
    many = torch.randn(1, modeling_decoder.SEPARATE_PROJECTION_MAX_ROWS + 1, 16)
    for x, train in ((few, True), (many, False)):
        for m in linears:
            m.train(train)
        with torch.no_grad():
            _, ops = _compiled_graph_ops(lambda t: project_together(t, linears), x)
        assert "aten.sum.dim_IntList" not in ops, ops
        assert len([op for op in ops if op.startswith(("aten.mm", "aten.addmm"))]) == 1, ops
