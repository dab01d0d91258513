"""The backbone's flat row layout (text rows then register rows in one ``[B * N + R, D]`` buffer, see
``DecoderLayer``): the flat path of an attention kind equals its view path, the single-register shortcut equals the
register call it skips, and the norm gives register rows its capped form (identity near zero, RMS at most 1)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_rbf
from attention_testing import autograd_node_names
from conftest import build_model
from hf_rbf.modeling_decoder import DecoderRMSNorm, join_rows, split_rows


def _model(family, **extra):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        family, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, **extra
    )
    model = AutoModelForCausalLM.from_config(cfg).double()
    with torch.no_grad():  # move every parameter off its init (zero registers, unit norms) so all terms matter
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("registers", [1, 3])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("positions", ["susie", "rope"])
def test_rbf_rows_path_equals_view_path(registers, normalize, positions):
    model = _model("rbf", num_register_tokens=registers, rbf_normalize=normalize, position_embedding_type=positions)
    attn = model.model.layers[0].self_attn
    assert attn.takes_rows
    b, n, d = 2, 7, 32
    g = torch.Generator().manual_seed(1)
    text = torch.randn(b, n, d, generator=g, dtype=torch.float64)
    regs = torch.randn(1, registers, d, generator=g, dtype=torch.float64)
    ids = torch.arange(n).unsqueeze(0)
    pe = model.model.position_frequencies(ids)
    rows = join_rows(text, regs).requires_grad_(True)
    hidden, reg_view = split_rows(rows, (b, n))
    flat, none, _ = attn(hidden, reg_view, position_embeddings=pe, rows=rows)
    assert none is None and flat.shape == (b * n + registers, d)
    text_out, reg_out, _ = attn(hidden, reg_view, position_embeddings=pe)
    torch.testing.assert_close(flat, join_rows(text_out, reg_out), rtol=0, atol=1e-12)
    # gradients through both paths agree too
    (g1,) = torch.autograd.grad(flat.pow(2).sum(), rows)
    (g2,) = torch.autograd.grad(join_rows(text_out, reg_out).pow(2).sum(), rows)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-11)


def test_single_register_shortcut_equals_the_register_call():
    """One softmax register attends to itself alone: the skipped call gives exactly its value."""
    model = _model("rbf", num_register_tokens=1)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    qr, kr, vr = (torch.randn(1, 2, 1, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ref = hf_rbf.rbf_attention(qr, kr, vr, gamma=attn._gamma(), causal=True, backend="naive")
    torch.testing.assert_close(ref, vr, rtol=0, atol=0)


def test_model_with_registers_matches_the_two_stream_reference():
    """The whole model against a two-stream forward written out here (separate register stream, as before the flat
    layout): same logits and parameter gradients in float64."""
    model = _model("rbf", num_register_tokens=2)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=ids, labels=ids)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))

    def two_stream():
        inner = model.model
        h = inner.embed_tokens(ids)
        r = inner.register_tokens.unsqueeze(0)
        pe = inner.position_frequencies(torch.arange(ids.shape[1]).unsqueeze(0))
        for layer in inner.layers:
            a, ra, _ = layer.self_attn(
                layer.input_layernorm(h), layer.input_layernorm.capped(r), position_embeddings=pe
            )
            h, r = h + a, r + ra
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            r = r + layer.mlp(layer.post_attention_layernorm.capped(r))
        logits = model.lm_head(inner.norm(h))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)), logits

    loss, logits = two_stream()
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-6)  # the norm's float32 math on the flat rows
    for g, p_ref in zip(grads, torch.autograd.grad(loss, list(model.parameters()))):
        torch.testing.assert_close(g, p_ref, rtol=1e-5, atol=1e-7)


def test_norm_caps_the_last_rows():
    norm = DecoderRMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(5, 8, dtype=torch.float64)
    x[3] *= 0.1  # a register row of RMS below 1 passes unchanged, one above 1 is normalised
    x[4] *= 50.0
    y = norm(x, 2)
    torch.testing.assert_close(y[:3], norm(x[:3]))
    torch.testing.assert_close(y[3:], norm.capped(x[3:]))
    torch.testing.assert_close(y[3], norm.weight * x[3])
    torch.testing.assert_close(y[4], norm(x[4:5])[0])
    # identity at zero, where the registers start: a finite Jacobian (the weight), not RMS norm's 1 / sqrt(eps)
    zero = torch.zeros(1, 8, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(norm.capped, zero).reshape(8, 8)
    torch.testing.assert_close(jac, torch.diag(norm.weight.detach().double()))


@pytest.mark.parametrize("family", ["rbf", "gka", "scalar_sort"])
def test_register_stream_stays_bounded_in_a_deep_model(family):
    """The register rows' states stay bounded with depth and the gradients finite.  Unnormalised register rows (the
    backbone until 2026-11-26) grew doubly exponentially through the SwiGLU MLPs: with these weights the last layers'
    register states overflow and the last MLP's weight gradients are NaN (the 1B rbf recipe's failure on the GPU)."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=16,
        num_attention_heads=2,
        intermediate_size=64,
        num_register_tokens=1,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # MLPs with a gain above 1 for large inputs, and registers off the origin
        for layer in model.model.layers:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.weight.normal_(0.0, 0.5)
        model.model.register_tokens.fill_(2.0)
    states = []
    hooks = [
        layer.register_forward_hook(lambda m, a, out: states.append(out[0] if isinstance(out, tuple) else out))
        for layer in model.model.layers
    ]
    ids = torch.randint(0, 64, (2, 9))
    out = model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    register_rows = [s.reshape(-1, 32)[-1] for s in states]
    largest = max(float(r.detach().abs().max()) for r in register_rows)
    assert largest < 1e4, f"register state reached {largest:.3g}"
    out.loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, bad


class _HostDeviceTransfers(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a tensor's value on the host or build a tensor from host data: each is a stream
    synchronisation on CUDA (the host stops running ahead of the GPU)."""

    NAMES = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.lift_fresh")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.NAMES):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "family, extra",
    [
        ("rbf", {}),
        ("gka", {"num_register_tokens": 1}),
        ("scalar_sort", {"num_register_tokens": 1}),
        ("hybrid_sort", {"num_register_tokens": 1}),
        ("hybrid_sort", {"num_register_tokens": 2, "head_kinds": ["hybrid", "scalar", "dot", "hybrid"]}),
        ("gka", {"window_pattern": "SL", "sliding_window": 4, "position_embedding_type": "rope"}),
        ("rbf", {"attention_layers": ["rbf", "dot"], "window_pattern": "SL", "sliding_window": 4, "qk_norm": True}),
        ("scalar_sort", {"tau_mode": "per_token", "num_value_groups": 2, "window_pattern": "SL", "sliding_window": 4}),
    ],
    ids=[
        "rbf",
        "gka-r1",
        "scalar-r1",
        "hybrid-r1",
        "hybrid-kinds-r2",
        "gka-sl",
        "rbf-dot-sl-qknorm",
        "scalar-token-sl",
    ],
)
def test_training_step_makes_no_host_device_round_trip(family, extra):
    """A training forward and backward (no padding mask, as the pretraining recipes run) neither reads a device value
    on the host nor builds a tensor from host data: the sorted families made their per-head masks from Python lists
    at every layer (a blocking copy per layer on CUDA)."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        family, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, **extra
    )
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 64, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()  # first call: lazily built constants may be made here
    with _HostDeviceTransfers() as mode:
        model(input_ids=ids, labels=ids).loss.backward()
    assert mode.seen == [], mode.seen


class _AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["rbf", "gka", "scalar_sort", "hybrid_sort"])
def test_register_rows_split_off_and_joined_without_slices(family):
    """Text and register rows are split off the flat buffers (rows, head-major projections, norm variances) by one
    ``split`` each and joined by one ``cat``.  Two slices cost, in the backward, a zero-filled full-size gradient and a
    copy per slice plus an add (hybrid_sort with one register: 15 ``slice_backward`` per layer and step); ``copy_``
    into slices of a fresh buffer a ``CopySlices`` node that clones the full gradient and zero-fills each slice."""
    model = build_model(family, {"num_register_tokens": 1}).train()  # a training step: no cache
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    loss = model(input_ids=ids, labels=ids).loss
    nodes = autograd_node_names(loss.grad_fn)
    assert "SliceBackward0" not in nodes and "CopySlices" not in nodes, sorted(set(nodes))
    with _AtenOps() as ops:
        loss.backward()
    assert ops.names.count("slice_backward") == 0, sorted(set(ops.names))
    assert model.model.register_tokens.grad is not None and model.model.register_tokens.grad.abs().sum() > 0


def _norm_chain(norm, x, registers=0):
    """DecoderRMSNorm's chain of float32 ops (Llama's RMSNorm, the register rows capped): the reference of the fused
    paths."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    if registers:
        text, regs = variance.split([variance.shape[0] - registers, registers])
        variance = torch.cat([text + norm.variance_epsilon, regs.clamp(min=1.0)])
    else:
        variance = variance + norm.variance_epsilon
    return norm.weight * (h * torch.rsqrt(variance)).to(dtype)


@pytest.mark.parametrize("registers", [0, 2])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_norm_is_one_rms_norm_with_the_chains_bits(dtype, weight_dtype, registers, monkeypatch):
    """A bf16 / fp16 residual stream (FSDP2's mixed precision casts every layer's inputs and weights to bf16) goes
    through one ``F.rms_norm`` (one fused kernel on CUDA, where the chain was about 8 forward and 10 backward; issue
    17), with the chain's values, input and weight gradients to the bit on the CPU."""
    import torch.nn.functional as F

    calls = []
    rms_norm = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda x, *a, **k: calls.append(x.dtype) or rms_norm(x, *a, **k))
    norm = DecoderRMSNorm(16).to(dtype if weight_dtype == "same" else torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = 3 * torch.randn(9, 16, generator=torch.Generator().manual_seed(0))
    x[-1] *= 0.1  # a register row below RMS 1 (passes unnormalised)
    x = x.to(dtype)
    got_x, ref_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got = norm(got_x, registers)
    assert calls == [dtype]
    ref = _norm_chain(norm, ref_x, registers)
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(got.dtype)
    got_grads = torch.autograd.grad(got, [got_x, norm.weight], grad)
    ref_grads = torch.autograd.grad(ref, [ref_x, norm.weight], grad)
    for g, r in zip(got_grads, ref_grads):
        assert torch.equal(g, r)
    # under the other half dtype's autocast (a float16 model in a bfloat16 autocast region) the register rows' cat
    # must not reach autocast's cat, which refuses a float16 pair there ("Unexpected floating ScalarType")
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with torch.autocast("cpu", dtype=other):
        assert torch.equal(norm(x, registers), ref.detach())


def _saved_for_backward(fn, *inputs):
    """``(shape, dtype)`` of what AOTAutograd's min-cut partition (Inductor's: its decompositions and partitioner) keeps
    from ``fn``'s forward for its backward, with ``fn``'s output."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    saved = []

    def forward_compiler(gm, example_inputs):
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        vals = [o.meta["val"] for o in outputs if hasattr(o, "meta") and "val" in o.meta]
        saved[:] = [(tuple(v.shape), v.dtype) for v in vals]
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=forward_compiler,
            bw_compiler=lambda gm, _: make_boxed_func(gm),
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
        )

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return out, saved


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_traced_norm_with_registers_keeps_its_input_and_a_float_per_row(device):
    """Under torch.compile a float32 norm over text and register rows (the residual stream of autocast training) keeps
    for its backward the input and per-row values only, as Llama's RMSNorm: not a second ``[rows, D]`` float32
    buffer of normalised rows, which a compiled d768 step kept for every norm (1.15 GiB, H200; the eager form's split,
    cat and register view), and its values and gradients are the eager form's."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rows, width, registers = 131, 64, 3
    norm = DecoderRMSNorm(width).to(device)
    linear = torch.nn.Linear(width, 96, bias=False).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, width))
    g = torch.Generator().manual_seed(0)
    a, b = (3 * torch.randn(rows, width, generator=g) for _ in range(2))
    a[-1] *= 0.01  # one register row below RMS 1: passes unnormalised
    b[-1] *= 0.01

    def step(a, b):
        x = a + b  # the residual stream: an activation, not an input of the graph
        with torch.autocast(device, dtype=torch.bfloat16):
            h = linear(norm(x, registers))
        return h.float().pow(2).sum()

    leaves = [t.to(device).requires_grad_(True) for t in (a, b)]
    out, saved = _saved_for_backward(step, *leaves)
    grads = torch.autograd.grad(out, [leaves[0], norm.weight])
    full = [s for s in saved if s[1] == torch.float32 and torch.Size(s[0]).numel() >= (rows - registers) * width]
    assert full == [((rows, width), torch.float32)], saved  # the input alone
    ref_leaves = [t.to(device).requires_grad_(True) for t in (a, b)]
    ref = step(*ref_leaves)  # eager: F.rms_norm of the text rows, the capped register rows
    ref_grads = torch.autograd.grad(ref, [ref_leaves[0], norm.weight])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
