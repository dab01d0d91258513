"""The sorted families' exact decode steps calling the fused decode backend directly (``modeling_decoder.
direct_decode_calls``): the same tokens and logits, bit for bit, as the public attention functions with their
checks, for every kind of argument a layer builds (sink, registers, per-token temperature, per-head scales, padding,
the static cache); where the public function would not take the fused backend, the layer does not either.  The
kernels run in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``), as ``attention_backend="triton"``."""

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_generate import build  # noqa: E402
from decoder_settings import decoder_settings  # noqa: E402

pytest.importorskip("triton")

SIZE = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    attention_backend="triton",
)
CASES = {
    "scalar_sort": {},
    "scalar_sort, per-token tau, registers": {"tau_mode": "per_token", "num_register_tokens": 2},
    "scalar_sort, no sink": {"scalar_sink": False},
    "hybrid_sort": {},
    "hybrid_sort, mixed heads, registers": {"head_kinds": ["hybrid", "scalar", "dot", "hybrid"],
                                            "num_register_tokens": 1},
    "hybrid_sort, no sink, global tau": {"scalar_sink": False, "tau_mode": "global"},
}


def _model(case: str):
    family = case.partition(",")[0]
    torch.manual_seed(0)
    return build(family, 48, "cpu", dict(SIZE, **CASES[case]))


def _count_calls(monkeypatch, model, name: str) -> list:
    """Wrap ``name`` on every attention module of ``model``; returns the list its calls are appended to."""
    calls = []
    for layer in model.model.layers:
        attn = layer.self_attn
        original = getattr(attn, name)

        def counted(*args, _original=original, **kwargs):
            calls.append(name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(attn, name, counted)
    return calls


def _generate(model, ids, mask, setting: str, **kwargs):
    with decoder_settings({"direct_decode_calls": setting}), torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
            return_dict_in_generate=True, **kwargs,
        )


@pytest.mark.parametrize("case", sorted(CASES))
def test_direct_calls_give_the_public_functions_tokens_and_logits(case, monkeypatch):
    """Greedy generate from a left-padded batch with the direct calls ("on") against every call through the public
    function ("off"): the same tokens and the same logits bit for bit (the same kernel with the same arguments), and
    the "on" run's decode steps went the direct way (two layers x three decode steps)."""
    model = _model(case)
    _check_direct_equals_checked(model, "cpu", monkeypatch)
    assert all(layer.self_attn.last_backend == "triton" for layer in model.model.layers)


def _check_direct_equals_checked(model, device: str, monkeypatch) -> None:
    """Greedy generate from a left-padded batch, direct calls "on" against "off": the same tokens and logits, bit for
    bit, and every decode step of both layers went the direct way."""
    ids = torch.randint(2, SIZE["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: the cached keys' mask is not all True
    off = _generate(model, ids, mask, "off")
    direct = _count_calls(monkeypatch, model, "_decode_directly")
    on = _generate(model, ids, mask, "on")
    assert len(direct) == 2 * 3
    assert torch.equal(on.sequences, off.sequences)
    for a, b in zip(on.logits, off.logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["scalar_sort", "hybrid_sort, mixed heads, registers"])
def test_direct_calls_through_the_static_cache(case, monkeypatch):
    """The eager static sorted cache's exact single-row steps (``decode_window=None``) take the direct call too,
    with the public function's results."""
    model = _model(case)
    ids = torch.randint(2, SIZE["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    kwargs = dict(cache_implementation="static", cache_config={"decode_window": None}, compile_config=None)
    model.generation_config.disable_compile = True
    off = _generate(model, ids, mask, "off", **kwargs)
    direct = _count_calls(monkeypatch, model, "_decode_directly")
    on = _generate(model, ids, mask, "on", **kwargs)
    assert direct, "the static cache's decode steps did not take the direct call"
    assert torch.equal(on.sequences, off.sequences)
    for a, b in zip(on.logits, off.logits):
        assert torch.equal(a, b)


def test_no_direct_call_where_the_public_function_would_not_take_the_fused_backend():
    """Gradients, autocast, several query rows and a backend other than "triton" (or "auto" off CUDA) go through
    the public function."""
    model = _model("hybrid_sort")
    attn = model.model.layers[0].self_attn
    one_row = types.SimpleNamespace(qs=torch.zeros(1, 4, 1))
    with torch.no_grad():
        assert attn._decodes_directly(one_row)
        assert not attn._decodes_directly(types.SimpleNamespace(qs=torch.zeros(1, 4, 2)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not attn._decodes_directly(one_row)
        with decoder_settings({"direct_decode_calls": "off"}):
            assert not attn._decodes_directly(one_row)
    assert not attn._decodes_directly(one_row)  # gradients enabled
    for backend, expected in (("auto", False), ("naive", False), ("sdpa", False), ("triton", True)):
        model.config.attention_backend = backend
        with torch.no_grad():
            assert attn._decodes_directly(one_row) is expected, backend


def test_auto_takes_the_fused_backend_for_a_decode_row_on_cuda():
    """The rule ``decodes_directly`` encodes for "auto" (CUDA, one query row: the fused backend), read from the
    public functions' own order of candidates."""
    from hf_rbf import attention_hybrid, attention_scalar
    from hf_rbf.attention_utils import MaskArgs

    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    for nk in (8, 1 << 20):
        mask = MaskArgs(causal=True, window=None, num_prefix_keys=1, key_log_weights=None, attention_mask=None, nq=1,
                        nk=nk)  # fmt: skip
        hybrid = attention_hybrid._candidates(cuda, cuda, cuda, cuda, cuda, 1.0, 1.0, mask, "auto")
        scalar = attention_scalar._candidates(cuda, cuda, cuda, 1.0, mask, "auto")
        assert next(iter(hybrid)) == "triton" and next(iter(scalar)) == "triton"


def test_a_bad_setting_is_named():
    model = _model("scalar_sort")
    attn = model.model.layers[0].self_attn
    with decoder_settings({"direct_decode_calls": "sometimes"}), torch.no_grad():
        with pytest.raises(ValueError, match="direct_decode_calls must be one of"):
            attn._decodes_directly(types.SimpleNamespace(qs=torch.zeros(1, 4, 1)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["scalar_sort", "hybrid_sort, mixed heads, registers"])
def test_direct_calls_on_cuda(case, monkeypatch):
    """On CUDA with the default backend ("auto"): the decode steps take the direct call, with the public function's
    tokens and logits, bit for bit."""
    family = case.partition(",")[0]
    torch.manual_seed(0)
    model = build(family, 48, "cuda", dict(SIZE, attention_backend="auto", **CASES[case]))
    _check_direct_equals_checked(model, "cuda", monkeypatch)
