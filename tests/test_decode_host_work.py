"""The host work of a dynamic-cache decode step (issue 13): what a step no longer does per layer, and that every value
it keeps or skips is the one it computed before, to the bit.

At batch 1 a decode step is bound by its host work (the H100 profiles of ``benchmarks/results/h100-2026-11-27m``:
0.9-1.8 ms of kernels in 10-17 ms per token), so every aten op and every Python call per layer counts.  The op counts
below are those of one decode step through the path CUDA takes (the fused kernels, here in Triton's interpreter, whose
own tensor work is not counted; the register stream), before / after:

* the sorted families' key mask: ``cat([valid.new_ones(B, P), valid])`` per layer became a view of a shared all-True
  buffer while every slot is known valid (``SortedScalarCacheLayer.exact_view``);
* the temperature (``tau_min + softplus(tau_bias)``), the sink's tensors, GKA's ``1 / (2 sigma^2)`` and SuSiE's
  ``sin`` / ``cos`` views are computed once and kept while their parameter (or the forward's angles) is unchanged;
* the positions of a mask without padding are one ``arange``, not ``cumsum`` of the mask;
* ``project_together`` reads the projections' parameters without ``nn.Module.__getattr__``; the cache layers are
  checked once per cache layout; ``inspect.signature(model.forward)`` (which ``generate`` reads at every step for
  remote-code models) is kept on the function;
* the split-K decode launch (``kernels_flash_fwd.distance_decode``) allocates its output only: the partial results go
  to scratch kept per (device, stream, thread, shape) (``empty`` 5 -> 1, ``empty_like`` 1 -> 0 per layer), and its
  constexprs and fixed arguments are built once per configuration (``_decode_plan``); the fused RoPE runs without
  its ``autograd.Function`` when nothing needs a gradient.

``benchmarks/host_decode_step.py`` times the step (host ms per token against Llama's).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import types

import pytest
import torch
from conftest import build_model
from torch.utils._python_dispatch import TorchDispatchMode

from hf_rbf import modeling_decoder
from hf_rbf.modeling_decoder import project_together, susie_embedding

FAMILIES = ["rbf", "gka", "scalar_sort", "hybrid_sort"]


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched outside Triton launches (the interpreter's own tensor work is not host work of
    the step on a GPU)."""

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()
        self.launches = collections.Counter()  # by kernel name (see `_counting`)
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting(monkeypatch):
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    mode = _Ops()
    original = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            mode.launches[getattr(self, "__name__", type(self).__name__)] += 1
        mode.paused += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    with mode:
        yield mode


def _gpu_path(monkeypatch):
    """The host path of a CUDA decode step: fused kernels (here interpreted), fused RoPE, the register stream, the
    attention projections as one GEMM over their kept concatenation."""
    from hf_rbf.kernels_common import DEFINED_INTERPRETED

    if not DEFINED_INTERPRETED:
        pytest.skip("needs the kernels in Triton's interpreter (TRITON_INTERPRET=1, as conftest sets on a CPU)")
    monkeypatch.setattr(modeling_decoder, "rotary_backend", "triton")
    monkeypatch.setattr(modeling_decoder, "register_path", "stream")
    monkeypatch.setattr(modeling_decoder, "decode_projection_copies", "on")


def _decode_ops(model, monkeypatch, prompt: int = 6):
    """Aten ops of one decode step (batch 1, the all-ones mask ``generate`` passes) after a prefill and one step."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + 2), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache()
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], attention_mask=torch.ones(1, prompt, dtype=torch.long), cache=cache)
        for t in (prompt, prompt + 1):
            step = dict(input_ids=ids[:, t : t + 1], attention_mask=torch.ones(1, t + 1, dtype=torch.long), cache=cache)
            if t == prompt:
                model(**step)
                continue
            with _counting(monkeypatch) as mode:
                model(**step)
    return mode


# Per family (conftest's tiny config, two layers, attention_backend="triton"): the bound on the aten ops of one decode
# step (the count after these changes; before: rbf 144, gka 125, scalar_sort 187, hybrid_sort 225; before the decode
# launch's kept scratch 138, 115, 159, 199), the counts of the ops that went (before -> after), and the Triton launches
# that went.  ``empty``: per layer the decode output (and the fused RoPE's outputs: GKA 1, hybrid 2, now
# ``empty_strided``), no longer the four split-K buffers (empty 4 -> 0, empty_like 1 -> 0 per layer: rbf empty
# 10 -> 2, hybrid 14 -> 6):
_BUDGETS = {
    # the mask's positions: cumsum (and sub, clamp_min, slice) -> arange; SuSiE: sin / cos unsqueezed once per forward,
    # not per layer, and the weight's [None, :, None, :] one view (unsqueeze 10 -> 5: the 3 of the step, 2 kept views)
    # the kept projection concatenation: one GEMM for q / k / v (mm 15 -> 11; before it 130 ops)
    "rbf": (124, {"cumsum": 0, "unsqueeze": 5, "empty": 2, "empty_like": 0, "mm": 11}, {}),
    # 1 / (2 sigma^2) kept (mul, exp, mul per layer); the zero-width values kept (new_empty per layer)
    "gka": (107, {"cumsum": 0, "exp": 0, "new_empty": 0, "empty": 4, "empty_like": 0}, {}),
    # the key mask a view (new_ones + cat per layer), and with every key valid no key-bias pass (its launch, output
    # allocation and the mask's int8 cast per layer: _to_copy 3 -> 1); tau kept (expand, promote_types, softplus,
    # add per layer); the sink's scalar keys not expanded to the batch of 1; the zero query / prefix views kept
    # (expand 12 -> 2: the keys'); one GEMM for the scalar queries, keys and values (mm 15 -> 11; before it 151 ops);
    # the exact step's direct call of the fused backend (no reshape of tau, no view of zero key bias, no view of the
    # all-True mask: 137 -> 129)
    "scalar_sort": (
        129,
        {"cumsum": 0, "new_ones": 0, "softplus": 0, "cat": 2, "expand": 2, "_to_copy": 1, "empty": 2, "empty_like": 0,
         "mm": 11},
        {"_key_bias_kernel": 0},
    ),
    # one GEMM for q / k / v / scalar q / scalar k (mm 19 -> 11; before it 191 ops); the exact step's direct call of
    # the fused backend (no reshape of tau, no view of zero key bias or of the all-True mask: 161 -> 145 with the
    # next) and the fused RoPE reading and writing head-major views through their strides (transpose 16 -> 12; its
    # outputs allocated head-major: empty_strided)
    "hybrid_sort": (
        145,
        {"cumsum": 0, "new_ones": 0, "softplus": 0, "cat": 2, "expand": 0, "_to_copy": 1, "empty": 2,
         "empty_strided": 4, "empty_like": 0, "mm": 11, "transpose": 12},
        {"_key_bias_kernel": 0},
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_host_ops_are_bounded(family, monkeypatch):
    _gpu_path(monkeypatch)
    model = build_model(family, {"attention_backend": "triton"})
    mode = _decode_ops(model, monkeypatch)
    names = mode.names
    bound, exact, launches = _BUDGETS[family]
    assert {op: names.get(op, 0) for op in exact} == exact, dict(names)
    assert {k: mode.launches.get(k, 0) for k in launches} == launches, dict(mode.launches)
    assert sum(names.values()) <= bound, (sum(names.values()), dict(names))


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_fused_insert_replaces_the_slice_copies(family, monkeypatch):
    """With the insert kernel (decode_backend "triton", what "auto" takes on CUDA) a decode step writes each layer's
    token in one launch: none of the insert's slices, copies and fills (per layer: 3 or 4 slices, 2 or 3 copies and
    2 fills; the two fills left are the prompt mask's), one ``_append_one_kernel`` launch per layer."""
    _gpu_path(monkeypatch)
    torch_inserts = _decode_ops(build_model(family, {"attention_backend": "triton", "decode_backend": "torch"}),
                                monkeypatch).names  # fmt: skip
    mode = _decode_ops(build_model(family, {"attention_backend": "triton", "decode_backend": "triton"}), monkeypatch)
    copies = 2 if family == "scalar_sort" else 3
    for op, per_layer in (("copy_", copies), ("fill_", 2), ("slice", copies + 2)):
        assert torch_inserts.get(op, 0) - mode.names.get(op, 0) == 2 * per_layer, (op, dict(mode.names))
    assert mode.launches.get("_append_one_kernel", 0) == 2, dict(mode.launches)


def test_rope_in_the_insert_removes_the_rope_launch():
    """hybrid_sort with the insert kernel: RoPE in the insert (``rope_in_insert`` "on") against its own launch
    ("off"): per layer and decode step one ``_rotary_kernel`` launch and its two head-major outputs (``empty_strided``)
    fewer, nothing added."""
    counts = {}
    for setting in ("off", "on"):
        with pytest.MonkeyPatch.context() as patch:  # (one counting wrapper at a time)
            _gpu_path(patch)
            patch.setattr(modeling_decoder, "rope_in_insert", setting)
            model = build_model("hybrid_sort", {"attention_backend": "triton", "decode_backend": "triton"})
            counts[setting] = _decode_ops(model, patch)
    off, on = counts["off"], counts["on"]
    assert off.launches.get("_rotary_kernel", 0) == 2 and on.launches.get("_rotary_kernel", 0) == 0
    assert off.launches.get("_append_one_kernel", 0) == on.launches.get("_append_one_kernel", 0) == 2
    assert off.names.get("empty_strided", 0) - on.names.get("empty_strided", 0) == 4, dict(on.names)
    assert all(on.names.get(op, 0) <= n for op, n in off.names.items()), (dict(off.names), dict(on.names))
    assert sum(on.names.values()) == sum(off.names.values()) - 4


# -- the sorted cache's key mask ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_sorted_key_mask_view_gives_the_logits_of_the_concatenated_mask(family, backend):
    """While no slot is padding the exact decode step reads a view of an all-True mask; forcing the concatenation
    (the record of known-valid slots dropped before every step) gives the same logits, to the bit."""
    overrides = {"attention_backend": backend, "num_register_tokens": 1}
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    logits = []
    for forced in (False, True):
        model = build_model(family, overrides)
        cache = model.make_cache()
        steps = []
        with torch.no_grad():
            for t in range(4, 10):
                if forced:
                    for layer in cache.layers:
                        layer._all_valid_at = None
                span = slice(0, t) if t == 4 else slice(t - 1, t)
                out = model(input_ids=ids[:, span], attention_mask=torch.ones(1, t, dtype=torch.long), cache=cache)
                steps.append(out.logits)
        logits.append(torch.cat(steps, dim=1))
        assert all(layer._all_valid() == (not forced) for layer in cache.layers if hasattr(layer, "_all_valid"))
    assert torch.equal(logits[0], logits[1])


def test_sorted_key_mask_is_concatenated_again_once_a_slot_is_padding_or_written():
    from hf_rbf.cache_sorted_scalar import SortedScalarCacheLayer

    layer = SortedScalarCacheLayer(num_heads=2, num_value_groups=1)
    ks, v = torch.randn(1, 2, 3), torch.randn(1, 1, 3, 4)
    layer.append(ks, v)
    mask = layer.exact_view(2)[3]
    assert mask.dtype == torch.bool and mask.shape == (1, 5) and bool(mask.all())
    assert layer._all_valid()
    layer.valid[0, 1] = False  # any write to the validity (eviction, crop, a user) drops the record
    assert not layer._all_valid()
    assert layer.exact_view(2)[3].tolist() == [[True, True, True, False, True]]
    layer.append(ks[..., :1], v[:, :, :1], valid=torch.tensor([[True]]))
    assert not layer._all_valid()  # (a given validity is not read back from the device)
    assert layer.exact_view(1)[3].tolist() == [[True, True, False, True, True]]


# -- values kept per parameter ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_kept_temperature_and_sink_follow_their_parameters(family):
    model = build_model(family, {})
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 1, model.config.hidden_size)
    with torch.no_grad():
        first = attn.temperature(x)
        assert attn.temperature(x) is first  # kept
        sink = attn.sink_entries(torch.float32, x.device)
        again = attn.sink_entries(torch.float32, x.device)
        assert again.v is sink.v and again.ks is sink.ks
        attn.tau_bias.add_(0.5)  # an in-place write (an optimiser step, load_state_dict) bumps the version
        attn.sink_value.mul_(2.0)
        moved = attn.temperature(x)
        assert moved is not first and torch.equal(moved, attn._temperature_of(attn.tau_bias.expand(attn.num_heads)))
        assert torch.equal(attn.sink_entries(torch.float32, x.device).v, attn._sink_entries(torch.float32, x.device).v)
    tau = attn.temperature(x)  # with gradients: computed, differentiable
    assert tau.requires_grad and tau is not moved
    torch.testing.assert_close(tau.detach(), moved, rtol=0, atol=0)


def test_kept_gka_scale_follows_log_sigma():
    from hf_rbf.attention_gka import _inverse_two_variances

    log_sigma = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        c = _inverse_two_variances(log_sigma)
        assert _inverse_two_variances(log_sigma) is c
        assert torch.equal(c, 0.5 * torch.exp(-2.0 * log_sigma.float()))
        log_sigma.add_(1.0)
        assert torch.equal(_inverse_two_variances(log_sigma), 0.5 * torch.exp(-2.0 * log_sigma.float()))
    assert _inverse_two_variances(log_sigma).requires_grad


def _write_keeping_the_version(p: torch.Tensor, value: torch.Tensor) -> None:
    """What FSDP2's all-gather does to an unsharded parameter: new data in the same tensor, at the same address,
    with the version counter preserved."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
        p.copy_(value)


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_kept_values_are_not_kept_in_a_distributed_process(family, one_rank_gloo_group):
    """With ``torch.distributed`` initialised (FSDP2, ZeRO-3) the temperature, the sink and GKA's scale are computed
    at every call: FSDP2 rewrites a parameter's data in place with its version counter preserved, where a kept value
    went stale (an evaluation forward between training steps under FSDP2).  Fails with the values kept."""
    from hf_rbf.attention_gka import _inverse_two_variances

    model = build_model(family, {})
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 1, model.config.hidden_size)
    log_sigma = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        attn.temperature(x), attn.sink_entries(torch.float32, x.device), _inverse_two_variances(log_sigma)
        version = attn.tau_bias._version
        _write_keeping_the_version(attn.tau_bias, attn.tau_bias + 0.5)
        _write_keeping_the_version(attn.sink_value, attn.sink_value * 2.0)
        _write_keeping_the_version(log_sigma, log_sigma + 1.0)
        assert attn.tau_bias._version == version  # invisible to the version counter
        tau = attn.temperature(x)
        assert torch.equal(tau, attn._temperature_of(attn.tau_bias.expand(attn.num_heads)))
        assert torch.equal(attn.sink_entries(torch.float32, x.device).v, attn._sink_entries(torch.float32, x.device).v)
        assert torch.equal(_inverse_two_variances(log_sigma), 0.5 * torch.exp(-2.0 * log_sigma.float()))


def test_kept_susie_angles_give_the_formula_bits():
    cos, sin = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    weight = torch.randn(2, 4)
    w = weight[None, :, None, :]
    reference = torch.cat((sin.unsqueeze(1) * w, cos.unsqueeze(1) * w), -1)
    with torch.no_grad():
        first = susie_embedding(cos, sin, weight, torch.float32)
        with _Ops() as ops:
            second = susie_embedding(cos, sin, weight, torch.float32)  # the second layer of the same forward
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert ops.names["unsqueeze"] == 0, dict(ops.names)
    other = torch.randn(1, 3, 4)  # a new forward's angles: not the kept ones
    with torch.no_grad():
        expected = torch.cat((sin.unsqueeze(1) * w, other.unsqueeze(1) * w), -1)
        assert torch.equal(susie_embedding(other, sin, weight, torch.float32), expected)


# -- positions, cache checks, projections, signature ---------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_of_a_mask_without_padding_are_the_cumsum_positions(family):
    """A mask without padding is dropped; its positions are then a range, which is ``cumsum - 1`` of the mask."""
    model = build_model(family, {})
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model.make_cache()
        mask = torch.ones(2, 5, dtype=torch.long)
        model(input_ids=ids[:, :5], attention_mask=mask, cache=cache)
        with _Ops() as ops:
            got = model(input_ids=ids[:, 5:], attention_mask=torch.ones(2, 7, dtype=torch.long), cache=cache).logits
        assert ops.names["cumsum"] == 0
        cache = model.make_cache()
        model(input_ids=ids[:, :5], attention_mask=mask, cache=cache)
        positions = (torch.ones(2, 7, dtype=torch.long).cumsum(-1) - 1)[:, 5:]
        ref = model(input_ids=ids[:, 5:], position_ids=positions, cache=cache).logits
    assert torch.equal(got, ref)


def test_cache_layers_are_checked_once_per_layout(monkeypatch):
    model = build_model("scalar_sort", {})
    calls = []
    original = type(model.model)._prepare_cache_layers
    monkeypatch.setattr(
        type(model.model), "_prepare_cache_layers", lambda self, cache: calls.append(1) or original(self, cache)
    )
    ids = torch.randint(0, 128, (1, 4))
    cache = model.make_cache()
    with torch.no_grad():
        for t in range(1, 4):
            model(input_ids=ids[:, t - 1 : t], cache=cache)
    assert len(calls) == 2  # make_cache, then the first forward; the later steps know the layout
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    bad = DynamicCache()
    bad.layers = [DynamicSlidingWindowLayer(sliding_window=4) for _ in model.model.layers]
    with pytest.raises(TypeError, match="cannot serve"):
        model(input_ids=ids[:, :1], cache=bad)


def test_decode_rows_projections_skip_module_getattr(monkeypatch):
    """In eval mode on decode rows the projections' parameters are read from ``_parameters`` (``nn.Module.__getattr__``
    is a Python call per read, several per projection and layer at every step); the results are the modules'."""
    linears = [torch.nn.Linear(8, n) for n in (4, 6, 2)]
    for m in linears:
        m.eval()
    x = torch.randn(1, 1, 8)
    reads = []
    getattr_ = torch.nn.Module.__getattr__
    monkeypatch.setattr(torch.nn.Module, "__getattr__", lambda self, name: reads.append(name) or getattr_(self, name))
    outs = project_together(x, linears)
    assert reads == []
    monkeypatch.undo()
    for out, m in zip(outs, linears):
        assert torch.equal(out, m(x))


@pytest.mark.parametrize("family", ["rbf", "scalar_sort"])
def test_forward_signature_is_kept(family):
    """transformers' ``generate`` reads ``inspect.signature(self.forward)`` at every step for remote-code models."""
    model = build_model(family, {})
    forward = type(model).forward
    assert "__signature__" in vars(forward)
    # the signature of the same code without the kept one
    bare = types.FunctionType(forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__,
                              forward.__closure__)  # fmt: skip
    bare.__kwdefaults__, bare.__annotations__ = forward.__kwdefaults__, forward.__annotations__
    assert inspect.signature(bare) == inspect.signature(forward)
    assert list(inspect.signature(model.forward).parameters) == list(inspect.signature(bare).parameters)[1:]


# -- the split-K decode launch: kept scratch and configuration ----------------------------------------------------


def _decode_call(nk: int, seed: int = 0, prefix: int = 1):
    """A decode-step call of the distance op (one query row, RBF's distance form, prefix keys as separate tensors)."""
    from hf_rbf.attention_utils import MaskArgs

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 4, nk, 16, generator=g), torch.randn(1, 4, nk, 16, generator=g)
    pk, pv = torch.randn(1, 4, prefix, 16, generator=g), torch.randn(1, 4, prefix, 16, generator=g)
    gamma = torch.rand(4, generator=g) + 0.1
    mask = MaskArgs(True, None, prefix, None, None, 1, prefix + nk)
    return (q, k, v, None, None, None, gamma, None, mask), dict(
        normalize=True, qnorm=False, knorm=True, kv_same=False, eps=0.0, prefix=(pk, pv), prefix_checked=True
    )


def _fresh_decode(args, kwargs):
    """The call with every kept plan and scratch buffer dropped first (what each call allocated before)."""
    from hf_rbf import kernels_flash_fwd
    from hf_rbf.attention_distance_triton import distance_attention

    kernels_flash_fwd._DECODE_PLANS.clear()
    kernels_flash_fwd._DECODE_SCRATCH.clear()
    kernels_flash_fwd._DECODE_SCRATCH_BYTES[0] = 0
    return distance_attention(*args, **kwargs)


def test_decode_scratch_is_reused_and_gives_the_bits_of_fresh_buffers(monkeypatch):
    """Decode calls over a growing key range (the split count grows: 2, 3, ... splits of 32 keys in the interpreter)
    reuse one set of scratch buffers, grown when a call needs more splits; every output is the one a call with new
    buffers gives, to the bit, and a fresh tensor that later calls do not overwrite."""
    pytest.importorskip("triton")
    from hf_rbf import kernels_flash_fwd
    from hf_rbf.attention_distance_triton import distance_attention
    from hf_rbf.kernels_common import DEFINED_INTERPRETED

    if not DEFINED_INTERPRETED:
        pytest.skip("needs the kernels in Triton's interpreter (TRITON_INTERPRET=1, as conftest sets on a CPU)")
    lengths = (40, 70, 100, 45, 130)
    expected = [_fresh_decode(*_decode_call(n, seed=n)) for n in lengths]
    kernels_flash_fwd._DECODE_SCRATCH.clear()
    kernels_flash_fwd._DECODE_SCRATCH_BYTES[0] = 0
    outs = []
    for n, ref in zip(lengths, expected):
        args, kwargs = _decode_call(n, seed=n)
        with torch.no_grad(), _counting(monkeypatch) as ops:
            outs.append(distance_attention(*args, **kwargs))
        assert torch.equal(outs[-1], ref)
        if n in (45, 130):  # 45: fewer splits than the kept buffers hold, only the output is new; 130: more
            assert ops.names["empty"] + ops.names["empty_like"] == (1 if n == 45 else 5), dict(ops.names)
    assert len({o.untyped_storage().data_ptr() for o in outs}) == len(outs)
    for out, ref in zip(outs, expected):
        assert torch.equal(out, ref)  # (not overwritten by the later calls)
    assert len(kernels_flash_fwd._DECODE_SCRATCH) == 1
    (n_split, buffers, size), = kernels_flash_fwd._DECODE_SCRATCH.values()
    assert n_split == kernels_flash_fwd.decode_splits(1, 4, 1, 130, torch.device("cpu"))
    assert size == 4 * sum(t.numel() for t in buffers) == kernels_flash_fwd._DECODE_SCRATCH_BYTES[0]


def test_eager_decode_over_few_keys_runs_unsplit(monkeypatch):
    """The split count of a decode launch (``kernels_flash_fwd.decode_splits``): an eager step over at most
    ``EAGER_SINGLE_SPLIT_MAX_KEYS`` keys runs unsplit (no combine launch); over more keys, with the rule off (0), or
    traced by ``torch.compile`` it splits as before.  In the interpreter (the rule off there) a launch whose split
    count is 1 writes its output itself, one launch; a longer one launches the combine: the output matches the
    float64 reference either way."""
    pytest.importorskip("triton")
    from hf_rbf import kernels_flash_fwd
    from hf_rbf.kernels_common import DEFINED_INTERPRETED

    cpu = torch.device("cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels_flash_fwd, "DEFINED_INTERPRETED", False)
        assert kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS == 1024
        assert kernels_flash_fwd.decode_splits(1, 12, 1, 1024, cpu) == 1
        assert kernels_flash_fwd.decode_splits(1, 12, 1, 1025, cpu) == 3  # (16 nominal SMs on a CPU: 2 waves of 12)
        patch.setattr(kernels_flash_fwd, "EAGER_SINGLE_SPLIT_MAX_KEYS", 0)
        assert kernels_flash_fwd.decode_splits(1, 12, 1, 512, cpu) == 2
        for bad in (-1, 1.5, "1024"):
            patch.setattr(kernels_flash_fwd, "EAGER_SINGLE_SPLIT_MAX_KEYS", bad)
            with pytest.raises(ValueError, match="EAGER_SINGLE_SPLIT_MAX_KEYS must be an int >= 0"):
                kernels_flash_fwd.decode_splits(1, 12, 1, 512, cpu)
        patch.setattr(kernels_flash_fwd, "EAGER_SINGLE_SPLIT_MAX_KEYS", 1024)
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert kernels_flash_fwd.decode_splits(1, 12, 1, 512, cpu) == 2
    if not DEFINED_INTERPRETED:
        pytest.skip("the launches need the kernels in Triton's interpreter (TRITON_INTERPRET=1, as conftest sets)")
    from hf_rbf.attention_distance_triton import distance_attention

    split = {"_distance_fwd_kernel": 1, "_decode_combine_kernel": 1}
    for nk, launches in ((20, {"_distance_fwd_kernel": 1}), (60, split)):
        args, kwargs = _decode_call(nk, seed=nk)
        with torch.no_grad(), _counting(monkeypatch) as ops:
            out = distance_attention(*args, **kwargs)
        assert dict(ops.launches) == launches
        q, k, v, gamma = args[0], args[1], args[2], args[6]
        pk, pv = kwargs["prefix"]
        keys, values = torch.cat([pk, k], 2).double(), torch.cat([pv, v], 2).double()
        scores = -gamma.double().view(1, -1, 1, 1) * torch.cdist(q.double(), keys) ** 2  # (one row: every key visible)
        ref = torch.softmax(scores, -1) @ values
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, (nk, err)


def test_decode_scratch_is_kept_per_thread_and_bounded(monkeypatch):
    pytest.importorskip("triton")
    import threading

    from hf_rbf import kernels_flash_fwd

    device = torch.device("cpu")
    kernels_flash_fwd._DECODE_SCRATCH.clear()
    kernels_flash_fwd._DECODE_SCRATCH_BYTES[0] = 0
    mine = kernels_flash_fwd._decode_scratch(device, 4, 3, 1, 16)
    assert kernels_flash_fwd._decode_scratch(device, 4, 2, 1, 16) is mine  # (fewer splits: the same buffers)
    other = []
    thread = threading.Thread(target=lambda: other.append(kernels_flash_fwd._decode_scratch(device, 4, 3, 1, 16)))
    thread.start()
    thread.join()
    assert other[0][0].data_ptr() != mine[0].data_ptr()  # another thread: buffers of its own
    # bounded in bytes: a set that would pass the limit empties the store; one larger than the limit is not kept
    size = 4 * (4 * 3 * 16 + 2 * 4 * 3 + 4)
    monkeypatch.setattr(kernels_flash_fwd, "DECODE_SCRATCH_MAX_BYTES", 3 * size)
    for dv_heads in range(5, 12):
        kernels_flash_fwd._decode_scratch(device, dv_heads, 3, 1, 16)
        assert kernels_flash_fwd._DECODE_SCRATCH_BYTES[0] <= 3 * size
        kept = kernels_flash_fwd._DECODE_SCRATCH.values()
        assert kernels_flash_fwd._DECODE_SCRATCH_BYTES[0] == sum(size for _, _, size in kept)
    kernels_flash_fwd._decode_scratch(device, 64, 3, 1, 16)
    assert kernels_flash_fwd._DECODE_SCRATCH_BYTES[0] <= 3 * size


def test_decode_plan_is_built_once_per_configuration(monkeypatch):
    """The launch's constexprs (``_flags``) are built at the first decode call of a configuration only; a change of
    what they depend on -- here torch's tf32 switch, which sets the float32 dot precision -- gives a new plan."""
    pytest.importorskip("triton")
    from hf_rbf import kernels_flash_fwd

    calls = []
    flags = kernels_flash_fwd._flags
    monkeypatch.setattr(kernels_flash_fwd, "_flags", lambda *a, **k: calls.append(1) or flags(*a, **k))
    kernels_flash_fwd._DECODE_PLANS.clear()
    q = torch.randn(1, 4, 1, 16)
    v = torch.randn(1, 2, 9, 8)
    options = dict(causal=True, window=None, num_prefix_keys=1, normalize=True, qnorm=False, knorm=True,
                   kv_same=False, eps=0.0, prefix=(q, v), tau_in=False)  # fmt: skip

    def plan():
        o = options
        return kernels_flash_fwd._decode_plan(q, v, None, None, None, o["causal"], o["window"], o["num_prefix_keys"],
                                              o["normalize"], o["qnorm"], o["knorm"], o["kv_same"], o["eps"],
                                              o["prefix"], o["tau_in"])  # fmt: skip

    first = plan()
    assert plan() is first and len(calls) == 1
    assert first[1] == (4, 2, 1) and first[0]["DV"] == 8 and first[0]["SPLIT"] is True
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not tf32
        other = plan()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert other[0]["DOT_PREC"] != first[0]["DOT_PREC"] and len(calls) == 2
    options["window"] = 4
    assert plan()[2] == (1, 4, 0.0) and len(calls) == 3


def test_rotary_without_gradients_skips_the_autograd_function(monkeypatch):
    pytest.importorskip("triton")
    from hf_rbf import kernels_rotary
    from hf_rbf.kernels_common import DEFINED_INTERPRETED

    if not DEFINED_INTERPRETED:
        pytest.skip("needs the kernels in Triton's interpreter (TRITON_INTERPRET=1, as conftest sets on a CPU)")
    applied = []
    apply = kernels_rotary._RotaryFunction.apply
    monkeypatch.setattr(kernels_rotary._RotaryFunction, "apply", lambda *a: applied.append(1) or apply(*a))
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with torch.no_grad():
        got = kernels_rotary.rotary_fused(q, k, cos, sin, 1)
    assert applied == []
    plain = kernels_rotary.rotary_fused(q, k, cos, sin, 1)  # grad mode on, no input requiring grad: no Function
    assert applied == []
    leaf = q.clone().requires_grad_()
    ref = kernels_rotary.rotary_fused(leaf, k, cos, sin, 1)
    assert applied == [1] and ref[0].requires_grad
    for a, b, c in zip(got, plain, ref):
        assert torch.equal(a, b) and torch.equal(a, c.detach())
