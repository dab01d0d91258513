"""The compiled static-cache decode step on the code path a GPU takes: the fused Triton attention (custom ops) and
inductor's GPU lowering, reproduced on the CPU.

On CUDA, ``generate(..., cache_implementation="static")`` compiles the decode step with inductor, whose GPU (Triton)
backend lowers some ops differently from its CPU (C++) backend: ``searchsorted`` becomes an inline bucketize that
needs its sorted sequence as a named buffer, which inductor 2.11 could not take from a view (the sorted families failed
with ``InductorError: NotImplementedError: View`` on an H100).  Here the attention runs on ``backend="triton"``
(Triton's interpreter, ``TRITON_INTERPRET=1``) and the step graph goes through inductor with
``cpu_backend="triton"`` up to the scheduler (lowering, fusion decisions); only the kernels' code generation, which
needs a GPU driver, is left out, and the captured graph then runs eagerly.

* every family's decode step lowers as one graph (fullgraph), equals eager dynamic-cache decoding, and several steps
  reuse it (no recompilation as the cache fills);
* a later ``generate`` with fewer new tokens keeps the static cache's capacity (as transformers' own static cache
  does), so it reuses the compiled step instead of recompiling.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from sorted_cache_helpers import left_padded

from hf_rbf import kernels_common
from hf_rbf.cache_names import CACHE_NAME


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract

TOL = 3e-5
FAMILIES = {
    "rbf": {},
    "gka": {},
    # a sliding layer (the fused scalar / hybrid op over the window's ring) and a full one (the sorted blocks)
    "scalar_sort": dict(decode_window=3, window_pattern="SL", sliding_window=3),
    "hybrid_sort": dict(
        head_kinds=["hybrid", "scalar", "dot", "hybrid"],
        num_value_groups=2,
        decode_window=3,
        window_pattern="SL",
        sliding_window=3,
    ),
}
SORTED_FAMILIES = ("scalar_sort", "hybrid_sort")


class _Lowered(Exception):
    """Raised where inductor would start generating kernel code: everything before it (lowering) succeeded."""


def gpu_lowering_backend(gm, example_inputs):
    """A ``torch.compile`` backend: inductor's lowering and scheduling of the graph as for a GPU (Triton code
    generation: ``cpu_backend="triton"``), stopped before kernel code generation (it needs a GPU driver); the
    captured graph then runs eagerly, so the step's results and guards are still checked."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.scheduler import Scheduler

    def stop(*args, **kwargs):
        raise _Lowered()

    original = Scheduler.codegen
    Scheduler.codegen = stop
    try:
        with config.patch(cpu_backend="triton"):
            compile_fx(gm, example_inputs)
    except Exception as err:  # inductor wraps the stop (InductorError / BackendCompilerFailed)
        cause = err
        while cause is not None and not isinstance(cause, _Lowered):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
    else:
        raise AssertionError("inductor compiled the graph without reaching the scheduler's code generation")
    finally:
        Scheduler.codegen = original
    return gm.forward


@pytest.mark.skipif(
    not kernels_common.DEFINED_INTERPRETED,
    reason="the triton attention runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1 before triton's "
    "import: tests/conftest.py sets it)",
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_decode_step_lowers_for_the_gpu_as_one_graph(family):
    torch._dynamo.reset()
    model = build_model(family, dict(FAMILIES[family], attention_backend="triton"))
    ids, mask = left_padded(model.config.vocab_size, [6, 3])
    settings = {"block_size": 4} if family in SORTED_FAMILIES else {}
    static, dynamic = model.make_static_cache(12, **settings), model.make_cache()
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: static})
            ref = model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: dynamic})
            step = torch.compile(model.forward, fullgraph=True, backend=gpu_lowering_backend)
            token = ref.logits[:, -1].argmax(-1, keepdim=True)
            for i in range(3):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                with torch.compiler.set_stance("fail_on_recompile" if i > 0 else "default"):
                    compiled = step(input_ids=token, attention_mask=torch.ones_like(token), **{CACHE_NAME: static})
                eager = model(input_ids=token, attention_mask=mask, **{CACHE_NAME: dynamic})
                assert (compiled.logits - eager.logits).abs().max().item() < TOL, i
                token = eager.logits[:, -1].argmax(-1, keepdim=True)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["rbf", "scalar_sort"])
def test_shorter_generate_reuses_the_compiled_step(family):
    """``generate`` with 6 then 3 new tokens (a forced fullgraph compile_config, as on a GPU): the second call's static
    cache keeps the first one's capacity, so the compiled step serves it without a recompilation."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = build_model(family, FAMILIES[family])
    ids, mask = left_padded(model.config.vocab_size, [5, 3])
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    capacities = []
    try:
        for new in (6, 3):
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                    cache_implementation="static",
                    compile_config=config,
                    return_dict_in_generate=True,
                )
            capacities.append(getattr(out, CACHE_NAME).max_cache_len)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert capacities[1] == capacities[0] >= ids.shape[1] + 5
    assert graphs == 1


@pytest.mark.parametrize("family", ["hybrid_sort"])  # the mask and the cache are the backbone's: one family
def test_batch_one_generate_compiles_once_and_reuses_its_cache(family):
    """Batch 1, three ``generate`` calls (a forced fullgraph compile_config, as on a GPU): every decode step runs the
    one compiled graph, and every call gets the same cache object, reset in place, so a CUDA graph recorded for its
    buffers' addresses is replayed rather than recorded again.

    At batch 1 the mask slice ``[1, N]`` that ``create_masks_for_generate`` passes counts as contiguous and kept the
    stride of the growing mask, so each decode step failed the compiled step's stride guard (on an H100: a dynamic
    recompilation, then a new CUDA graph per token, 18-22 ms per token).  The tokens equal eager dynamic decoding."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = build_model(family, FAMILIES[family])
    ids = torch.randint(2, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    kwargs = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
    )
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    torch._dynamo.reset()
    counters.clear()
    caches, outputs = [], []
    try:
        for _ in range(3):
            with torch.no_grad():
                out = model.generate(
                    ids, **kwargs, cache_implementation="static", compile_config=config, return_dict_in_generate=True
                )
            caches.append(getattr(out, CACHE_NAME))
            outputs.append(out.sequences)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs == 1
    assert caches[0] is caches[1] is caches[2]
    for seq in outputs:
        assert torch.equal(seq, expected)
