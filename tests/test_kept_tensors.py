"""Tensors kept between calls -- the fused ops' constants, the split-K decode's scratch, values kept per parameter --
are only made where they may outlive the call (``attention_utils.tensors_keepable``): not during a CUDA graph
capture, and on CUDA only on the device's default stream.

Why: ``generate(..., cache_implementation="static")`` compiles the decode step with CUDA graphs (cudagraph trees),
which run our custom ops' Python in their warm-up and recording on a stream of their own, with the thread's
allocations routed to their memory pool.  The decode scratch kept there (four buffers) made the next model's recording
fail ("Detected 4 tensor(s) in the cudagraph pool not tracked as outputs"): every family's static generate after
another model's, on an H200 (benchmarks/results/h200x2-2026-11-28e).  On the CPU the CUDA state is faked; the
``gpu`` tests run the real streams, a real capture and the failing sequence of static generates.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from hf_rbf import (
    attention_gka,
    attention_scalar_triton,
    attention_utils,
    kernels_flash_fwd,
    kernels_sorted_decode,
    modeling_gka,
)
from hf_rbf.attention_utils import tensors_keepable

# every module that decides through `tensors_keepable` (the name imported into it)
DECIDING_MODULES = (attention_utils, attention_scalar_triton, modeling_gka, kernels_sorted_decode, kernels_flash_fwd)


def _fake_cuda(monkeypatch, *, stream: int, capturing: bool) -> None:
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)


@pytest.mark.parametrize(
    "stream, capturing, keepable",
    [(0, False, True), (0x7F00, False, False), (0, True, False)],
    ids=["default-stream", "side-stream", "capturing"],
)
def test_keepable_on_cuda_only_on_the_default_stream_outside_a_capture(monkeypatch, stream, capturing, keepable):
    _fake_cuda(monkeypatch, stream=stream, capturing=capturing)
    assert tensors_keepable(torch.device("cuda")) is keepable
    assert tensors_keepable("cuda:0") is keepable
    assert attention_utils.parameter_values_keepable(torch.device("cuda")) is keepable
    assert tensors_keepable(torch.device("cpu")) is True and tensors_keepable("cpu") is True


def test_every_module_that_keeps_tensors_asks_first():
    """The modules that import ``tensors_keepable`` are the ones this file's switch covers (a new kept tensor in
    another module must be added to ``DECIDING_MODULES`` and to the cases below)."""
    package = pathlib.Path(attention_utils.__file__).parent
    users = {p.stem for p in package.glob("*.py") if re.search(r"\btensors_keepable\b", p.read_text())}
    assert users == {m.__name__.rsplit(".", 1)[1] for m in DECIDING_MODULES}


def _switch(monkeypatch, keepable: bool) -> None:
    for module in DECIDING_MODULES:
        monkeypatch.setattr(module, "tensors_keepable", lambda device, keepable=keepable: keepable)


def _storage(t):
    """The memory a result lives in (the tensor itself for a zero-size one, which has none)."""
    t = t[0] if isinstance(t, tuple) else t
    return t.untyped_storage().data_ptr() if t.numel() else id(t)


_CPU = torch.device("cpu")
_LOG_SIGMA = torch.nn.Parameter(torch.zeros(3))
KEPT = {
    "constant_vector": lambda: attention_utils.constant_vector(1.25, (3,), _CPU),
    "all_true_mask": lambda: attention_utils.all_true_mask(2, 5, _CPU),
    "zero_rows": lambda: attention_scalar_triton._zero_rows(attention_utils.constant_vector(0.0, (4,), _CPU), (2, 4)),
    "zero_width": lambda: modeling_gka._zero_width(torch.zeros(2, 3, 4)),
    "sorted_decode_constant": lambda: kernels_sorted_decode._constant((1, 2), 0.5, _CPU, torch.float32),
    "decode_scratch": lambda: kernels_flash_fwd._decode_scratch(_CPU, 4, 3, 1, 16),
    "inverse_two_variances": lambda: attention_gka._inverse_two_variances(_LOG_SIGMA),
}


@pytest.mark.parametrize("name", list(KEPT))
def test_a_kept_tensor_is_made_again_where_it_may_not_be_kept(monkeypatch, name):
    make = KEPT[name]
    with torch.no_grad():
        _switch(monkeypatch, True)
        first = make()
        assert _storage(make()) == _storage(first)  # kept: the same memory at the next call
        _switch(monkeypatch, False)
        fresh = [make() for _ in range(2)]
    assert len({_storage(first), *(_storage(t) for t in fresh)}) == 3  # each call its own memory
    for t in fresh:
        ref = first if not isinstance(first, tuple) else first[0]
        got = t if not isinstance(t, tuple) else t[0]
        assert got.shape == ref.shape and got.dtype == ref.dtype
        if name != "decode_scratch":  # (scratch is uninitialised by design)
            assert torch.equal(got, ref)
    if name == "all_true_mask":
        assert attention_utils.is_all_true_mask(first) and not attention_utils.is_all_true_mask(fresh[0])


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_kept_temperature_and_sink_follow_the_switch(monkeypatch, family):
    """The scalar heads' temperature and sink, kept per parameter state in a decode step, are recomputed per call
    where nothing may be kept."""
    from conftest import build_model

    model = build_model(family, {})
    attn = next(m for m in model.modules() if hasattr(m, "sink_entries") and hasattr(m, "temperature"))
    x = torch.randn(1, 2, model.config.hidden_size)
    calls = {
        "temperature": lambda: attn.temperature(x),
        "sink": lambda: attn.sink_entries(torch.float32, _CPU),
    }
    with torch.no_grad():
        for what, call in calls.items():
            if what == "sink" and attn.sink_value is None:
                continue
            _switch(monkeypatch, True)
            first = call()
            first = first if isinstance(first, torch.Tensor) else first.v
            again = call()
            assert (again if isinstance(again, torch.Tensor) else again.v) is first, what
            _switch(monkeypatch, False)
            fresh = call()
            fresh = fresh if isinstance(fresh, torch.Tensor) else fresh.v
            assert fresh is not first and torch.equal(fresh, first), what


# ---------------------------------------------------------------------------------------------------------------
# GPU: real streams, a real capture, and the sequence of static generates that failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nothing_is_kept_on_a_side_stream_or_in_a_capture():
    dev = torch.device("cuda")
    kept = attention_utils.constant_vector(2.0, (3,), dev)
    assert attention_utils.constant_vector(2.0, (3,), dev) is kept
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = attention_utils.constant_vector(3.0, (3,), dev)
        assert attention_utils.constant_vector(3.0, (3,), dev) is not on_side
        scratch = kernels_flash_fwd._decode_scratch(dev, 4, 3, 1, 16)
        assert kernels_flash_fwd._decode_scratch(dev, 4, 3, 1, 16)[0].data_ptr() != scratch[0].data_ptr()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_utils.constant_vector(5.0, (3,), dev)
    # the capture's tensor (filled only when the graph replays) is not what an eager call gets
    eager = attention_utils.constant_vector(5.0, (3,), dev)
    assert eager is not captured and torch.equal(eager, torch.full((3,), 5.0, device=dev))


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_static_generate_of_every_family_after_another_models_in_one_process():
    """``generate(..., cache_implementation="static")`` (the decode step compiled with CUDA graphs) of Llama, then of
    each family, in one process: each gives the tokens of its dynamic-cache generate.  Before ``tensors_keepable``
    every family's static generate after the first model's failed in cudagraph trees' pool check."""
    from conftest import build_model

    torch.compiler.reset()
    dev = torch.device("cuda")
    models = {"llama": _tiny_llama()}
    for family in ("rbf", "gka", "scalar_sort", "hybrid_sort"):
        models[family] = build_model(family, {})
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(1)).to(dev)
    failures = {}
    for name, model in models.items():
        model.to(dev)
        with torch.no_grad():
            dynamic = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            static = [
                model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
                for _ in range(2)  # (the second call replays the recorded graphs)
            ]
        for s in static:
            if not torch.equal(s, dynamic):
                failures[name] = (dynamic.tolist(), s.tolist())
    assert not failures, failures
