"""The fixed-capacity caches (``generate(..., cache_implementation="static")``) of every family, chunked prefill, and a
decode step under ``torch.compile(fullgraph=True)``.

* static decoding gives the tokens and logits of the dynamic caches (greedy, left-padded batches), windowed or not;
* the static sorted cache's blocked search finds the window the brute-force definition finds, and at
  ``decode_window >= n`` it equals dense decoding (float64);
* a decode step compiles as one graph (no graph break: no ``.item()``, no data-dependent shape) and equals eager;
* ``prefill_chunk_size`` gives the logits and tokens of an unchunked prefill, for the dynamic and the static caches.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_CASES, build_model
from sorted_cache_helpers import SORT_CASES, left_padded
from transformers import DynamicCache

from hf_rbf.cache_names import CACHE_NAME
from hf_rbf.cache_sorted_static import StaticSortedLayer
from hf_rbf.cache_static import StaticDecoderCache, StaticKeyValueLayer, static_cache_bytes_per_token
from hf_rbf.sorted_decode import sorted_window_attention_reference


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract

TOL = 3e-5
_DENSE = {c[0]: c for c in FAMILY_CASES}
_SORT = {c[0]: c for c in SORT_CASES}
# every family, sliding layers, "dot" layers, registers, G < H, per-head kinds; sorted cases windowed (k = 3)
CASES = [
    _DENSE["rbf-mixed-window-r2"],
    _DENSE["gka-sssl-dot-r2"],
    ("scalar-pertoken-r2-g2-k3", "scalar_sort", dict(_SORT["scalar-pertoken-r2-g2"][2], decode_window=3)),
    ("scalar-nosink-dot-window-k3", "scalar_sort", dict(_SORT["scalar-global-nosink-dot-window"][2], decode_window=3)),
    ("hybrid-kinds-r1-g2-k3", "hybrid_sort", dict(_SORT["hybrid-kinds-r1-g2"][2], decode_window=3)),
    ("hybrid-mixed-layers-window-k3", "hybrid_sort", dict(_SORT["hybrid-mixed-layers-window"][2], decode_window=3)),
]
SORTED_FAMILIES = ("scalar_sort", "hybrid_sort")


def _generate(model, ids, mask, **kwargs):
    """Greedy unless ``kwargs`` say otherwise; 8 new tokens; the step logits returned."""
    params = dict(do_sample=False, pad_token_id=0, max_new_tokens=8, min_new_tokens=8)
    params.update(kwargs)
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **params
        )


def _static_kwargs(family: str) -> dict:
    # small sorted blocks so that the prompt and the decode steps span several of them
    return dict(cache_implementation="static", cache_config={"block_size": 4} if family in SORTED_FAMILIES else None)


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_static_generate_equals_dynamic(case):
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [9, 4, 6])
    dynamic = _generate(model, ids, mask)
    static = _generate(model, ids, mask, **_static_kwargs(family))
    assert isinstance(getattr(static, CACHE_NAME), StaticDecoderCache)
    assert not isinstance(getattr(dynamic, CACHE_NAME), StaticDecoderCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert _max_diff(static.logits, dynamic.logits) < TOL


MODES = {
    "beam": dict(num_beams=3, num_return_sequences=2, early_stopping=False),
    "sample": dict(do_sample=True, top_k=0),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=[CASES[0][0], CASES[5][0]])
def test_static_beam_search_and_sampling_equal_dynamic(case, mode):
    """Beam search (the cache's rows reordered every step) and seeded sampling give the dynamic cache's tokens."""
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [7, 4, 5])
    outs = []
    for kwargs in ({}, _static_kwargs(family)):
        torch.manual_seed(0)
        outs.append(_generate(model, ids, mask, **MODES[mode], **kwargs))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert _max_diff(outs[0].logits, outs[1].logits) < TOL


@pytest.mark.parametrize("family", SORTED_FAMILIES)
def test_static_sorted_decode_reads_the_window(family):
    """A window shorter than the context changes the logits (the window is really applied) the same way in both
    caches; a window covering the capacity is the exact path."""
    overrides = dict(_SORT["hybrid-kinds-r1-g2"][2]) if family == "hybrid_sort" else {}
    model = build_model(family, dict(overrides, decode_window=2))
    ids, mask = left_padded(model.config.vocab_size, [9, 6])
    static = _generate(model, ids, mask, **_static_kwargs(family))
    dynamic = _generate(model, ids, mask)
    assert _max_diff(static.logits, dynamic.logits) < TOL
    exact = _generate(model, ids, mask, cache_implementation="static", cache_config={"decode_window": None})
    assert _max_diff(static.logits[1:], exact.logits[1:]) > 1e-3


@pytest.mark.parametrize("family", SORTED_FAMILIES)
def test_static_sorted_window_covering_the_tokens_equals_dense_decode(family):
    """``decode_window >= n`` through the blocked search (window < capacity, so the windowed path runs) equals dense
    decoding (``decode_window=None``), in float64."""
    overrides = dict(_SORT["hybrid-kinds-r1-g2"][2]) if family == "hybrid_sort" else {}
    model = build_model(family, overrides).double()
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    n = ids.shape[1] + 8  # every token of the longest row
    kwargs = dict(cache_implementation="static")  # capacity: n rounded up to whole blocks of 4 (16 > n = 15)
    windowed = _generate(model, ids, mask, cache_config={"block_size": 4, "decode_window": n}, **kwargs)
    cache = getattr(windowed, CACHE_NAME)
    assert any(isinstance(layer, StaticSortedLayer) and layer.windowed for layer in cache.layers)
    dense = _generate(model, ids, mask, cache_config={"block_size": 4, "decode_window": None}, **kwargs)
    assert torch.equal(windowed.sequences, dense.sequences)
    assert _max_diff(windowed.logits, dense.logits) < 1e-10


@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_blocked_search_equals_the_definition(scheme, window):
    """Tokens appended one by one and in chunks (padding included) into sorted blocks of 4; each single-token step's
    windowed attention equals the brute-force float64 definition (sort all visible keys, take the window)."""
    gen = torch.Generator().manual_seed(window)
    b, h, g, dv, d, steps = 2, 4, 2, 3, 5, 23
    order_heads = list(range(h)) if scheme == "per_head" else [0, 2]
    layer = StaticSortedLayer(
        max_cache_len=steps,
        num_heads=h,
        num_value_groups=g,
        order_heads=order_heads,
        decode_window=window,
        block_size=4,
    )
    f64 = torch.float64
    ks = torch.randn(b, h, steps, generator=gen, dtype=f64)
    v = torch.randn(b, g, steps, dv, generator=gen, dtype=f64)
    vk = torch.randn(b, h, steps, d, generator=gen, dtype=f64)
    valid = torch.ones(b, steps, dtype=torch.bool)
    valid[1, :4] = False  # left padding of row 1
    prompt = 6
    layer.append(ks[:, :, :prompt], v[:, :, :prompt], vk[:, :, :prompt], valid=valid[:, :prompt])
    tau = torch.rand(h, generator=gen, dtype=f64) + 0.2
    scale = torch.tensor([0.3, 0.0, 0.5, 0.2], dtype=f64)
    prefix_ks, prefix_v = (
        torch.randn(1, h, 1, generator=gen, dtype=f64),
        torch.randn(1, g, 1, dv, generator=gen, dtype=f64),
    )
    prefix_k = torch.zeros(1, h, 1, d, dtype=f64)
    for t in range(prompt, steps):
        layer.append(ks[:, :, t : t + 1], v[:, :, t : t + 1], vk[:, :, t : t + 1], valid=valid[:, t : t + 1])
        qs = torch.randn(b, h, 1, generator=gen, dtype=f64)
        q = torch.randn(b, h, 1, d, generator=gen, dtype=f64)
        args = dict(q=q, scale=scale, prefix_ks=prefix_ks, prefix_v=prefix_v, prefix_k=prefix_k)
        out = layer.attend(qs, tau, **args)
        ref = sorted_window_attention_reference(
            ks[:, :, : t + 1],
            v[:, :, : t + 1],
            valid[:, : t + 1],
            torch.arange(t + 1).expand(b, -1),
            qs,
            tau,
            window=window,
            query_token_index=torch.tensor([t]),
            order_head=torch.tensor(order_heads),
            vector_keys=vk[:, :, : t + 1],
            **args,
        )
        assert (out - ref).abs().max().item() < 1e-12, t


COMPILE_CASES = [CASES[0], CASES[1], CASES[5]]


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_decode_step_compiles_as_one_graph(case):
    """``torch.compile(model.forward, fullgraph=True)`` of decode steps over the static cache (aot_eager: the graph
    capture, no C++ build) equals eager decoding through the dynamic cache, and the step's mask covering the new
    token only (what ``generate`` passes) keeps every step in the first graph: no recompilation as the cache grows."""
    torch._dynamo.reset()
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [7, 4])
    settings = {"block_size": 4} if family in SORTED_FAMILIES else {}
    static, dynamic = model.make_static_cache(16, **settings), model.make_cache()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: static})
        ref = model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: dynamic})
        assert (out.logits - ref.logits).abs().max().item() < TOL
        step = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        token = ref.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(3):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            stance = "fail_on_recompile" if i > 0 else "default"
            with torch.compiler.set_stance(stance):
                # contiguous, as generate passes it (a strided view would be a different input to the guards)
                compiled = step(input_ids=token, attention_mask=mask[:, -1:].contiguous(), **{CACHE_NAME: static})
            eager = model(input_ids=token, attention_mask=mask, **{CACHE_NAME: dynamic})
            assert (compiled.logits - eager.logits).abs().max().item() < TOL
            token = eager.logits[:, -1].argmax(-1, keepdim=True)
    torch._dynamo.reset()


@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=[CASES[0][0], CASES[5][0]])
def test_generate_compiles_the_decode_step_into_one_graph(case):
    """What ``generate`` does on a GPU, forced on the CPU (``compile_config._compile_all_devices``, aot_eager): the
    decode steps of a static-cache generate with chunked prefill run through one fullgraph-compiled graph (no graph
    break, no recompilation as the sequence grows; prompt chunks run eagerly) and give the dynamic cache's tokens."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [11, 5, 8])
    dynamic = _generate(model, ids, mask)
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    static = _generate(model, ids, mask, compile_config=config, prefill_chunk_size=4, **_static_kwargs(family))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1
    assert torch.equal(static.sequences, dynamic.sequences)
    assert _max_diff(static.logits, dynamic.logits) < TOL


class _DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (``.item()``, ``int()``, ``bool()``) and the tensors made
    from host data (``torch.tensor(list, device=...)``, a blocking copy to the device): on a GPU each one waits for the
    device, so the host can no longer queue the next token's work while the GPU runs this one."""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.lift_fresh")

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(name) for name in self.READS):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_static_decode_step_reads_nothing_back_from_the_device(case):
    """An eager decode step over the static cache (the new token's mask, as ``generate`` passes it) never reads a
    device value on the host nor copies host data to the device: the cache's length, positions and padding stay
    device tensors, per-head constants are made once.  (The model used to read the cache length and check the mask
    every step, and the sorted families built their per-head masks from Python lists at every layer.)"""
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [7, 4])
    settings = {"block_size": 4} if family in SORTED_FAMILIES else {}
    cache = model.make_static_cache(16, **settings)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            with _DeviceReads() as mode:
                out = model(input_ids=token, attention_mask=torch.ones_like(token), **{CACHE_NAME: cache})
            assert mode.reads == [], mode.reads
            token = out.logits[:, -1].argmax(-1, keepdim=True)


def test_static_cache_takes_the_full_mask_or_the_new_tokens_mask():
    """Decode steps with the mask over the whole sequence and with the new token's column only give the same logits
    (positions and padding come from the cache), in a left-padded batch."""
    model = build_model(*CASES[0][1:])
    ids, mask = left_padded(model.config.vocab_size, [7, 3])
    caches = [model.make_static_cache(12), model.make_static_cache(12)]
    with torch.no_grad():
        outs = [model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: c}) for c in caches]
        token = outs[0].logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            full = model(input_ids=token, attention_mask=mask, **{CACHE_NAME: caches[0]})
            new = model(input_ids=token, attention_mask=mask[:, -1:], **{CACHE_NAME: caches[1]})
            assert (full.logits - new.logits).abs().max().item() < 1e-6
            token = full.logits[:, -1].argmax(-1, keepdim=True)


CHUNK_CASES = [
    _DENSE["rbf-mixed-window-r2"],
    _DENSE["gka-sssl-dot-r2"],
    ("scalar-pertoken-r2-g2-k3", "scalar_sort", dict(_SORT["scalar-pertoken-r2-g2"][2], decode_window=3)),
    ("hybrid-mixed-layers-window-k3", "hybrid_sort", dict(_SORT["hybrid-mixed-layers-window"][2], decode_window=3)),
]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("case", CHUNK_CASES, ids=[c[0] for c in CHUNK_CASES])
def test_chunked_prefill_equals_unchunked(case, static):
    """``generate(..., prefill_chunk_size=4)``: an 11-token prompt through the cache in chunks of 4 (sliding windows
    of 3 cross the chunk borders) gives the logits and tokens of one prefill; the sorted caches attend exactly over
    every prompt chunk, windowing only the decode steps."""
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [11, 5, 8])
    kwargs = _static_kwargs(family) if static else {}
    whole = _generate(model, ids, mask, **kwargs)
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        chunked = _generate(model, ids, mask, prefill_chunk_size=4, **kwargs)
    finally:
        hook.remove()
    assert calls[:3] == [4, 4, 3]
    assert torch.equal(chunked.sequences, whole.sequences)
    assert _max_diff(chunked.logits, whole.logits) < TOL


def test_static_cache_memory_per_token_matches_its_buffers():
    """``static_cache_bytes_per_token`` (the formula of docs/decoding.md) equals the bytes the buffers hold."""
    for family, overrides in (
        ("rbf", _DENSE["rbf-mixed-window-r2"][2]),
        ("gka", _DENSE["gka-sssl-dot-r2"][2]),
        ("scalar_sort", _SORT["scalar-pertoken-r2-g2"][2]),
        ("hybrid_sort", _SORT["hybrid-mixed-layers-window"][2]),
    ):
        model = build_model(family, overrides)
        capacity = 32
        cache = model.make_static_cache(capacity)
        ids, mask = left_padded(model.config.vocab_size, [5, 3])
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: cache})
        expected = static_cache_bytes_per_token(model.config, torch.float32)
        for idx, layer in enumerate(cache.layers):
            measured = sum(t.numel() * t.element_size() for t in layer_buffers(layer)) / (2 * layer.capacity)
            assert measured == pytest.approx(expected[idx]), (family, idx)


def layer_buffers(layer):
    """The per-row buffers of a static layer (what grows with the capacity)."""
    names = ["keys", "values", "valid"]
    if isinstance(layer, StaticSortedLayer):
        names += ["vector_keys", "sorted_keys", "sorted_slots"]
    return [getattr(layer, name) for name in names if getattr(layer, name, None) is not None]


def test_static_cache_refusals():
    model = build_model("rbf", {})
    ids, mask = left_padded(model.config.vocab_size, [5, 3])
    with pytest.raises(ValueError, match="cache_implementation"):
        _generate(model, ids, mask, cache_implementation="quantized")
    with pytest.raises(ValueError, match="max_cache_len"):
        model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: model.make_static_cache(4)})
    with pytest.raises(ValueError, match="key_log_weights"):
        model(input_ids=ids, key_log_weights=torch.zeros(2, 5), **{CACHE_NAME: model.make_static_cache(8)})
    sorted_model = build_model("scalar_sort", dict(max_cache_tokens=8))
    with pytest.raises(ValueError, match="max_cache_tokens"):
        sorted_model.make_static_cache(16)
    with pytest.raises(ValueError, match="block_size"):
        StaticSortedLayer(
            max_cache_len=8, num_heads=2, num_value_groups=1, order_heads=[0, 1], decode_window=2, block_size=0
        )
    with pytest.raises(ValueError, match="max_cache_len"):
        StaticKeyValueLayer(0)
    # a dynamic cache is still accepted as before
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: DynamicCache()})
