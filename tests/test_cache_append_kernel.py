"""A decode step's token written into the sorted cache in one launch (``hf_rbf.kernels_cache_append``): the same
buffers as the torch slice copies it replaces (every dtype, grouped values, with and without vector keys), and the
same generations through the cache (padding, a token bound with evictions), in Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_generate import build  # noqa: E402

pytest.importorskip("triton")

from hf_rbf import cache_sorted_scalar  # noqa: E402
from hf_rbf.kernels_cache_append import append_one_fused, append_one_reason, append_one_reference  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, h, g, d, dv", [(1, 4, 4, 8, 8), (2, 6, 2, 12, 20), (3, 4, 1, 0, 16)])
@pytest.mark.parametrize("slot", [0, 8])
def test_fused_append_writes_what_the_slice_copies_write(dtype, b, h, g, d, dv, slot):
    gen = torch.Generator().manual_seed(b * 100 + h * 10 + slot)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    cap = 9
    buffers = [rand(b, h, cap), rand(b, h, cap, d) if d else None, rand(b, g, cap, dv),
               torch.rand(b, cap, generator=gen) > 0.5, torch.randint(0, 99, (b, cap), generator=gen)]  # fmt: skip
    expected = [None if t is None else t.clone() for t in buffers]
    # the new entries as the projections give them: head-major views of token-major tensors
    new_keys = rand(b, h, 1)
    new_vector_keys = rand(b, 1, h, d).transpose(1, 2) if d else None
    new_values = rand(b, 1, g, dv).transpose(1, 2)
    assert append_one_reason(new_keys, new_vector_keys, new_values) is None
    append_one_fused(*buffers, slot, 1234567, new_keys, new_vector_keys, new_values)
    append_one_reference(*expected, slot, 1234567, new_keys, new_vector_keys, new_values)
    for got, want in zip(buffers, expected):
        assert (got is None and want is None) or torch.equal(got, want)
    # a padded batch's step: its own validity per row
    new_valid = torch.arange(b).view(b, 1) % 2 == 0
    append_one_fused(*buffers, slot, 7, new_keys, new_vector_keys, new_values, new_valid)
    append_one_reference(*expected, slot, 7, new_keys, new_vector_keys, new_values, new_valid)
    for got, want in zip(buffers, expected):
        assert (got is None and want is None) or torch.equal(got, want)


def test_fused_append_writes_through_the_buffers_strides():
    """Buffers whose slot dim is not the contiguous one (scalar keys, validity, token index as transposed views)."""
    b, h, g, d, dv, cap = 2, 4, 2, 8, 8, 7
    gen = torch.Generator().manual_seed(3)
    buffers = [torch.randn(b, cap, h, generator=gen).transpose(1, 2), torch.randn(b, h, cap, d, generator=gen),
               torch.randn(b, g, cap, dv, generator=gen), torch.zeros(cap, b, dtype=torch.bool).t(),
               torch.zeros(cap, b, dtype=torch.long).t()]  # fmt: skip
    expected = [t.clone() for t in buffers]
    new = (torch.randn(b, h, 1, generator=gen), torch.randn(b, h, 1, d, generator=gen),
           torch.randn(b, g, 1, dv, generator=gen))  # fmt: skip
    append_one_fused(*buffers, 4, 11, *new)
    append_one_reference(*expected, 4, 11, *new)
    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)


def test_strided_new_values_are_refused_with_a_reason():
    values = torch.randn(1, 2, 1, 8)[..., ::2]
    assert "not contiguous" in append_one_reason(torch.randn(1, 4, 1), None, values)


CASES = {
    "scalar_sort": {},
    "hybrid_sort, grouped values": {"num_value_groups": 2},
    "scalar_sort, token bound": {"max_cache_tokens": 7},
    "hybrid_sort, token bound, window": {"max_cache_tokens": 8, "decode_window": 3},
}


def _generate(case: str, backend: str, monkeypatch):
    family = case.partition(",")[0]
    size = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                decode_backend=backend, **CASES[case])  # fmt: skip
    torch.manual_seed(0)
    model = build(family, 48, "cpu", size)
    calls = []
    original = cache_sorted_scalar.append_one_fused
    monkeypatch.setattr(cache_sorted_scalar, "append_one_fused", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the prompt's insert carries a validity, the decode steps' do not
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    return out, calls


@pytest.mark.parametrize("case", sorted(CASES))
def test_generations_through_the_fused_append_equal_the_torch_ones(case, monkeypatch):
    """decode_backend "triton" (the fused insert, and the fused windowed step where there is a window) against
    "torch": the same tokens and logits; every decode step of both layers went through the fused insert."""
    fused, calls = _generate(case, "triton", monkeypatch)
    plain, plain_calls = _generate(case, "torch", monkeypatch)
    assert len(calls) == 2 * 4 and not plain_calls
    assert torch.equal(fused.sequences, plain.sequences)
    for a, b in zip(fused.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_append_on_cuda(dtype):
    """The compiled kernel on the GPU: the slice copies' buffers for the d768 shapes (H12, D64) and grouped values,
    and a generation through the cache ("auto": the fused insert on CUDA) equal to the torch inserts'."""
    dev = torch.device("cuda")
    for b, h, g, d, dv in ((1, 12, 12, 64, 64), (3, 12, 4, 0, 64), (2, 8, 2, 128, 96)):
        cap = 40
        buffers = [torch.randn(b, h, cap, device=dev).to(dtype),
                   torch.randn(b, h, cap, d, device=dev).to(dtype) if d else None,
                   torch.randn(b, g, cap, dv, device=dev).to(dtype), torch.rand(b, cap, device=dev) > 0.5,
                   torch.randint(0, 99, (b, cap), device=dev)]  # fmt: skip
        expected = [None if t is None else t.clone() for t in buffers]
        new = (torch.randn(b, h, 1, device=dev).to(dtype),
               torch.randn(b, 1, h, d, device=dev).to(dtype).transpose(1, 2) if d else None,
               torch.randn(b, 1, g, dv, device=dev).to(dtype).transpose(1, 2))  # fmt: skip
        for slot, token in ((0, 5), (17, 70000), (cap - 1, 3)):
            append_one_fused(*buffers, slot, token, *new)
            append_one_reference(*expected, slot, token, *new)
        for got, want in zip(buffers, expected):
            assert (got is None and want is None) or torch.equal(got, want)

    size = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    outs = []
    for backend in ("auto", "torch"):
        torch.manual_seed(0)
        model = build("hybrid_sort", 64, "cuda", dict(size, decode_backend=backend))
        ids = torch.randint(2, 128, (2, 9), device=dev, generator=torch.Generator(dev).manual_seed(1))
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True))  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b_ in zip(outs[0].logits, outs[1].logits):
        assert torch.equal(a, b_)  # (the same cache contents: the same attention, bit for bit)
