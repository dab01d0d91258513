"""What the compiled decode step of a static cache guards on, and how the cache's stacked buffers are written (issue
13).

A compiled step checks its guards on the host before every call (``TorchDynamo Cache Lookup``), one ``TENSOR_MATCH``
(dtype, device, sizes, strides, dispatch keys) per tensor it reads from its inputs.  With a tensor per layer and buffer
kind, the 12-layer scalar_sort step guarded 270 tensors against Llama's 150 (474 us of host time per token on an H100
host).  The static layers of one cache now hold each buffer kind of all their layers in one tensor
(``hf_rbf.cache_static.StackedBuffers``):

* the guarded tensors of the compiled step (and Dynamo's graph inputs) grow per layer by the layer's parameters only:
  the cache's tensors are the same for 2 and 4 layers (scalar_sort on its torch and its fused Triton step, hybrid_sort,
  rbf with "dot" layers, sliding layers);
* a layer's buffers are slices of the stacked tensors, the stacks hold exactly the layers' bytes and keep their
  addresses across ``generate`` calls (reset in place, as CUDA graphs of the compiled step need);
* a layer whose shapes differ from its group's gets buffers of its own (and stays exact);
* inductor writes the stacks in place: the lowered step (as for a GPU) copies no input buffer (no ``select_scatter``
  of a stack, no clone of an input, no out-of-place ``index_put``), which a write into a layer's slice caused.

``benchmarks/count_decode_guards.py`` measures the counts and the guard-check time at 2, 4 and 12 layers.
"""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import build_model
from sorted_cache_helpers import left_padded

from benchmarks.count_decode_guards import walk  # the repository root is on the path (conftest)
from hf_rbf import kernels_common
from hf_rbf.cache_names import CACHE_NAME
from hf_rbf.cache_sorted_static import StaticSortedLayer
from hf_rbf.cache_static import StackedBuffers, StaticDecoderCache, StaticKeyValueLayer


CASES = {
    # a sliding layer (StaticKeyValueLayer ring) and a full one (StaticSortedLayer) per pair of layers
    "scalar_sort": ("scalar_sort", dict(decode_window=3, window_pattern="SL", sliding_window=3), {}),
    "scalar_sort-triton": (
        "scalar_sort",
        dict(decode_window=3, window_pattern="SL", sliding_window=3),
        {"static_decode_backend": "triton"},
    ),
    "hybrid_sort": ("hybrid_sort", dict(decode_window=3, num_value_groups=2), {}),
    "rbf-dot": ("rbf", dict(attention_layers=["rbf", "dot"]), {}),
}


def compiled_decode_step(family: str, overrides: dict, cache_config: dict, layers: int) -> dict:
    """Run ``generate`` with the static cache and the decode step compiled as on a GPU (a forced fullgraph
    ``compile_config``); return the step's guarded tensors (those reached through the cache apart), its graph inputs
    and the parameters of one decoder layer."""
    import torch._dynamo.guards as guards
    from transformers import CompileConfig

    model = build_model(family, dict(overrides, num_hidden_layers=layers))
    graphs, managers = [], []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op == "placeholder"))
        return gm.forward

    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True
    hook = hasattr(guards, "guard_manager_testing_hook_fn")
    if hook:
        previous = guards.guard_manager_testing_hook_fn
        guards.guard_manager_testing_hook_fn = lambda manager, scope, builder: managers.append(manager)
    ids = torch.randint(2, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
                pad_token_id=0,
                cache_implementation="static",
                cache_config=dict(cache_config) or None,
                compile_config=config,
            )
    finally:
        torch._dynamo.reset()
        if hook:
            guards.guard_manager_testing_hook_fn = previous
    assert len(graphs) == 1, graphs  # one compiled decode step
    out = {"graph_inputs": graphs[0], "layer_params": len(list(model.model.layers[0].parameters()))}
    if managers:
        counts, tensors = collections.Counter(), []
        walk(managers[-1].root, counts, tensors)  # the benchmark's count of the guard tree
        out["tensors"] = len(tensors)
        out["cache_tensors"] = sorted(s for s in tensors if f"['{CACHE_NAME}']" in s)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_guarded_tensors_grow_per_layer_by_its_parameters_only(case):
    family, overrides, cache_config = CASES[case]
    if cache_config.get("static_decode_backend") == "triton" and not kernels_common.DEFINED_INTERPRETED:
        pytest.skip("the fused step runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)")
    two = compiled_decode_step(family, overrides, cache_config, 2)
    four = compiled_decode_step(family, overrides, cache_config, 4)
    per_layer = two["layer_params"]
    # before the stacked buffers: +10 (scalar_sort) to +11 (fused step, hybrid) cache tensors per layer
    assert four["graph_inputs"] - two["graph_inputs"] <= 2 * per_layer, (two, four)
    if "tensors" in two:  # torch's guard-manager hook (private API) is there
        assert four["cache_tensors"] == two["cache_tensors"], (two["cache_tensors"], four["cache_tensors"])
        assert four["tensors"] - two["tensors"] <= 2 * per_layer, (two["tensors"], four["tensors"], per_layer)


def _storages(cache) -> dict:
    """Every distinct storage the cache's layers hold: ``data_ptr -> bytes``."""
    seen = {}
    for layer in cache.layers:
        for t in layer.buffers().values():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return seen


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort", "gka"])
def test_layers_hold_slices_of_one_tensor_per_kind_at_fixed_addresses(family):
    overrides = dict(num_hidden_layers=4, window_pattern="SL", sliding_window=3)
    if family != "gka":
        overrides["decode_window"] = 3
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [5, 3])
    kwargs = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        first = model.generate(ids, **kwargs, cache_implementation="static", return_dict_in_generate=True)
        cache = getattr(first, CACHE_NAME)
        addresses = _storages(cache)
        second = model.generate(ids, **kwargs, cache_implementation="static", return_dict_in_generate=True)
        dynamic = model.generate(ids, **kwargs)
    assert getattr(second, CACHE_NAME) is cache and _storages(cache) == addresses  # reset in place, same buffers
    assert torch.equal(first.sequences, second.sequences) and torch.equal(first.sequences, dynamic)
    groups = collections.defaultdict(list)
    for layer in cache.layers:
        groups[id(layer._stack)].append(layer)
    assert len(groups) == 2  # sliding layers, full layers: one stack each
    held = 0
    for members in groups.values():
        stack = members[0]._stack
        assert isinstance(stack, StackedBuffers) and stack.size == stack.next_slot == len(members) == 2
        assert sorted(layer._slot for layer in members) == [0, 1]
        for layer in members:
            assert type(layer) is type(members[0])
            for name, t in layer.buffers().items():
                base = getattr(stack, name)
                assert t.data_ptr() == base[layer._slot].data_ptr() and t.is_contiguous(), name
                held += t.nbytes
        if isinstance(members[0], StaticSortedLayer):
            assert members[0].keys.untyped_storage().data_ptr() == members[1].keys.untyped_storage().data_ptr()
    assert sum(addresses.values()) == held  # the stacks hold the layers' bytes, nothing more


def test_a_layer_of_other_shapes_gets_buffers_of_its_own():
    layers = [StaticKeyValueLayer(8, share_key="k"), StaticKeyValueLayer(8, share_key="k"), StaticKeyValueLayer(8)]
    cache = StaticDecoderCache(layers, 8)
    assert layers[0]._stack is layers[1]._stack is not None and layers[2]._stack is None
    gen = torch.Generator().manual_seed(0)
    widths = (4, 2, 4)  # layer 1 gets other keys than layer 0's group was allocated for
    for step in range(3):
        n = 3 if step == 0 else 1
        for idx, d in enumerate(widths):
            k, v = torch.randn(2, 2, n, d, generator=gen), torch.randn(2, 2, n, d, generator=gen)
            keys, values = cache.update(k, v, idx)
            if n == 1:
                assert torch.equal(keys[:, :, step + 2], k[:, :, 0]) and torch.equal(values[:, :, step + 2], v[:, :, 0])
            else:
                assert torch.equal(keys, k) and torch.equal(values, v)
    assert layers[1]._stack is not layers[0]._stack and layers[1]._stack.size == 1 and layers[1]._slot == 0
    assert layers[0].keys.shape == (2, 2, 8, 4) and layers[1].keys.shape == (2, 2, 8, 2)
    assert int(layers[0].cumulative_length) == int(layers[1].cumulative_length) == 5
    with pytest.raises(AttributeError, match="in place"):
        layers[0].keys = torch.zeros(1)


def _lowered_step_graph(family: str, overrides: dict, cache_config: dict):
    """The post-grad graph (after inductor's reinplacing) of the decode step lowered as for a GPU."""
    import torch._inductor.compile_fx as compile_fx
    from test_model_static_compile import gpu_lowering_backend

    model = build_model(family, dict(overrides, attention_backend="triton"))
    ids, mask = left_padded(model.config.vocab_size, [6, 3])
    cache = model.make_static_cache(12, block_size=4, **cache_config)
    graphs = []
    original = compile_fx._recursive_post_grad_passes

    def capture(gm, *args, **kwargs):
        out = original(gm, *args, **kwargs)
        graphs.append(gm.graph)
        return out

    torch._dynamo.reset()
    compile_fx._recursive_post_grad_passes = capture
    try:
        # no compile caches: the post-grad passes must run (and be seen) in this process
        no_cache = torch._functorch.config.patch(enable_autograd_cache=False)
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), no_cache:
            model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: cache})
            token = torch.ones(2, 1, dtype=torch.long)
            step = torch.compile(model.forward, fullgraph=True, backend=gpu_lowering_backend)
            step(input_ids=token, attention_mask=torch.ones_like(token), **{CACHE_NAME: cache})
    finally:
        compile_fx._recursive_post_grad_passes = original
        torch._dynamo.reset()
    assert graphs
    return graphs[-1], model.config.num_hidden_layers


@pytest.mark.skipif(
    not kernels_common.DEFINED_INTERPRETED,
    reason="the triton attention runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1)",
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inductor_writes_the_stacked_buffers_in_place(backend):
    """A write into a layer's slice of a stack (``stack[slot].index_copy_``) was functionalised into a
    ``select_scatter`` of the whole stack that inductor did not reinplace: every step copied every layer's buffer.
    The writes go to the stack itself (one ``index_put_``; the fused op takes the stacks): nothing copies an input."""
    aten = torch.ops.aten
    graph, layers = _lowered_step_graph(
        "scalar_sort", dict(num_hidden_layers=4, decode_window=3, window_pattern="SL", sliding_window=3),
        {"static_decode_backend": backend},
    )  # fmt: skip
    inputs = {n for n in graph.nodes if n.op == "placeholder"}
    scatters = (aten.select_scatter.default, aten.slice_scatter.default, aten.as_strided_scatter.default)
    copies = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        numel = val.numel() if isinstance(val, torch.Tensor) else 0
        if node.target in scatters and numel > layers:  # the [L] lengths vector is the only one allowed
            copies.append(node.format_node())
        elif node.target in (aten.clone.default, aten.index_put.default, aten.index_copy.default):
            if node.args and node.args[0] in inputs:  # an input buffer copied (not written in place)
                copies.append(node.format_node())
        elif "auto_functionalized" in str(node.target):
            copies.append(node.format_node())
    assert not copies, copies
    if backend == "triton":
        assert any("static_sorted_decode_step" in str(n.target) for n in graph.nodes)
