"""The guards of every family's compiled static decode step against Llama's of the same size (issue 13).

Before every decode step of ``generate(..., cache_implementation="static")`` Dynamo evaluates the compiled step's
guards on the host (``TorchDynamo Cache Lookup``), and ``generate`` waits for each step's token, so this time adds to
the per-token latency.  ``benchmarks/count_decode_guards.py`` measures it; here, on tiny 2-layer models with the
d768 models' 12 heads (head dim 8):

* no family guards materially more than Llama: at most 1.33x Llama's leaf guards, and at most 1.25x its guarded
  tensors plus the family's parameters beyond Llama's (each parameter the step reads is a guarded tensor it cannot
  avoid).  Measured (torch 2.13, transformers 5.24): leaf guards llama 453, gka 421, rbf 486, scalar_sort 520,
  hybrid_sort 574 (1.27x; 629 = 1.39x before its per-head lists were read as bools); guarded tensors llama 31, gka 25,
  rbf 34, scalar_sort 38, hybrid_sort 43 (7 parameters more than Llama).  The check time follows the guarded tensors
  (a ``TENSOR_MATCH``, five dynamic-marking ``hasattr`` guards and an aliasing check each, against one dict lookup or
  comparison for most other guards); the leaf-guard margin leaves room for the families' extra attention attributes
  (``DICT_CONTAINS`` / ``EQUALS_MATCH``, tens of nanoseconds each) but not for a per-layer or per-head list, dict or
  cache buffer growing the tree again (the cache's tensors per layer before ``StackedBuffers``: 258 guarded tensors
  against Llama's 151 at 12 layers);
* no guard reads a per-head Python list of an attention module (``hybrid_sort``'s ``_dot_heads`` and
  ``_scalar_head_flags`` were read with ``all()`` / ``any()`` and a list comprehension in the forward: a guard per
  element, 55 more guards at 2 layers of 12 heads): a ``LENGTH_CHECK`` under an attention module is one.

The decode step is compiled with the eager backend (``CompileConfig(backend="eager", fullgraph=True)``): Dynamo builds
the same guard tree as with transformers' inductor default (the benchmark's ``--compile``), in seconds.
"""

from __future__ import annotations

import collections

import pytest
import torch

from benchmarks.count_decode_guards import build, decode_step_guards, walk  # the repository root is on the path

FAMILIES = ("rbf", "gka", "scalar_sort", "hybrid_sort")
LAYERS = 2
HEADS = 12  # the d768 models' heads: what a per-head guard costs there
GUARDS_MARGIN = 1.33  # leaf guards, x Llama's
TENSORS_MARGIN = 1.25  # guarded tensors, x Llama's, beyond the family's extra parameters (see _extra_parameters)


def _sources(manager, out: list) -> None:
    """(source, leaf guard kind) of every leaf guard of the tree."""
    for leaf in manager.get_leaf_guards():
        out.append((manager.get_source(), type(leaf).__name__))
    children = list(manager.get_child_managers())
    if hasattr(manager, "get_key_value_managers"):
        for key_manager, value_manager in manager.get_key_value_managers().values():
            children += [m for m in (key_manager, value_manager) if m is not None]
    for child in children:
        _sources(child, out)


_TREES: dict = {}


def decode_tree(variant: str) -> dict:
    if variant not in _TREES:
        model = build(variant, LAYERS, heads=HEADS)
        ids = torch.randint(2, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
        (manager, _), trees, capture = decode_step_guards(model, variant, ids, 4, how="eager")
        if manager is None:
            pytest.skip("no guard tree captured (torch without guard_manager_testing_hook_fn)")
        counts, tensors, sources = collections.Counter(), [], []
        walk(manager.root, counts, tensors)
        _sources(manager.root, sources)
        params = sum(1 for _ in model.parameters())
        _TREES[variant] = dict(
            guards=sum(counts.values()), tensors=len(tensors), sources=sources, params=params,
            recompiles=capture.recompiles, trees=trees,
        )  # fmt: skip
        torch._dynamo.reset()
    return _TREES[variant]


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_guards_no_more_than_llamas(family):
    llama, ours = decode_tree("llama"), decode_tree(family)
    assert ours["trees"] == 1 and ours["recompiles"] == 0, ours["trees"]
    assert ours["guards"] <= GUARDS_MARGIN * llama["guards"], (family, ours["guards"], llama["guards"])
    # the parameters a family has beyond Llama's are guarded tensors it cannot avoid (each parameter the step reads
    # is one); everything else the step reads (cache buffers, kept constants) must stay within the margin
    extra_parameters = max(0, ours["params"] - llama["params"])
    assert ours["tensors"] <= TENSORS_MARGIN * llama["tensors"] + extra_parameters, (
        family, ours["tensors"], llama["tensors"], extra_parameters,
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_no_guard_on_an_attention_modules_python_list(family):
    attention = "_modules['self_attn']"
    lists = sorted({s for s, kind in decode_tree(family)["sources"] if attention in s and kind == "LENGTH_CHECK"})
    per_head = sorted({s for s, _ in decode_tree(family)["sources"] if "_dot_heads" in s or "_scalar_head_flags" in s})
    assert not lists and not per_head, (lists, per_head)
