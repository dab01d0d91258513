"""RoPE of a hybrid decode step inside the sorted cache's one-launch insert (``modeling_decoder.rope_in_insert``,
``kernels_cache_append``): the kernel's rotated queries, keys and buffers against the fused RoPE kernel with the plain
insert (bit for bit) and against a float64 reference; the cache's torch fallback; generations with the RoPE in the
insert equal, bit for bit, to those with RoPE in a launch of its own, in every layer configuration a hybrid model
has; the steps that must keep their own RoPE.  The kernels run in Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_generate import build  # noqa: E402
from decoder_settings import decoder_settings  # noqa: E402

pytest.importorskip("triton")

from hf_rbf import cache_sorted_scalar, modeling_decoder, modeling_hybrid_sort  # noqa: E402
from hf_rbf.kernels_cache_append import (  # noqa: E402
    append_one_fused,
    append_one_reason,
    append_one_reference,
    rotate_pair_reference,
)
from hf_rbf.kernels_rotary import rotary_fused  # noqa: E402

# one rounding of the float32 rotation to the dtype, relative to the float64 value (and float32's own error)
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _step(b, h, g, d, dv, dtype, table_rows, seed=0, device="cpu"):
    """Buffers of 9 slots and a new token as a joint projection gives it: q and k ``[B, H, 1, D]`` head-major views
    of one ``[B, 1, 2 H D + 1]`` tensor; tables ``[table_rows, 1, D/2]`` float32."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    cap = 9
    buffers = [rand(b, h, cap), rand(b, h, cap, d), rand(b, g, cap, dv),
               (torch.rand(b, cap, generator=gen) > 0.5).to(device),
               torch.randint(0, 99, (b, cap), generator=gen).to(device)]  # fmt: skip
    joint = rand(b, 1, 2 * h * d + 1)
    q = joint[..., : h * d].view(b, 1, h, d).transpose(1, 2)
    k = joint[..., h * d : 2 * h * d].view(b, 1, h, d).transpose(1, 2)
    angles = torch.randn(table_rows, 1, d // 2, generator=gen, dtype=torch.float64) * 3
    tables = (angles.cos().float().to(device), angles.sin().float().to(device))
    new = (rand(b, h, 1), k, rand(b, 1, g, dv).transpose(1, 2))
    return buffers, joint, q, new, tables, angles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("b, h, g, d, dv, table_rows", [(1, 4, 4, 8, 8, 1), (2, 6, 2, 12, 20, 2), (3, 4, 1, 6, 16, 1)])
def test_rope_in_the_insert_equals_the_rope_kernel_then_the_insert(dtype, b, h, g, d, dv, table_rows):
    """Against ``kernels_rotary`` then the plain fused insert: the same rotated q and k (written in place into the
    joint projection, nothing else in it touched) and the same five buffers, bit for bit; and the rotation within one
    rounding of the float64 one."""
    buffers, joint, q, new, (cos, sin), angles = _step(b, h, g, d, dv, dtype, table_rows)
    expected = [t.clone() for t in buffers]
    before = joint.clone()
    q_rot, k_rot = rotary_fused(q.clone(), new[1].clone(), cos, sin, 1)
    assert append_one_reason(*new, (q, cos, sin)) is None
    append_one_fused(*buffers, 5, 4321, *new, None, (q, cos, sin))
    append_one_fused(*expected, 5, 4321, new[0], k_rot, new[2])
    assert torch.equal(q, q_rot) and torch.equal(new[1], k_rot)
    assert torch.equal(joint[..., -1], before[..., -1])  # (the column after q and k: untouched)
    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)

    def rotated64(x):
        x1, x2 = x.double().chunk(2, dim=-1)
        c, s = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    hd = h * d
    q0 = before[..., :hd].view(b, 1, h, d).transpose(1, 2)
    k0 = before[..., hd : 2 * hd].view(b, 1, h, d).transpose(1, 2)
    for got, source in ((q, q0), (new[1], k0)):
        want = rotated64(source)
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err <= TOL[dtype], f"{dtype}: relative error {err:.2e} against float64"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_reference_insert_with_rope_matches_the_kernel(dtype):
    """``append_one_reference(..., rotary=...)`` (the torch fallback) against the kernel: equal in float32; in
    bfloat16 within one rounding (the interpreter's float32 -> bfloat16 cast and torch's can differ in the last bit)."""
    buffers, joint, q, new, tables, _ = _step(2, 4, 2, 8, 8, dtype, 2, seed=4)
    ref_buffers = [t.clone() for t in buffers]
    ref_joint = joint.clone()
    hd = 4 * 8
    ref_q = ref_joint[..., :hd].view(2, 1, 4, 8).transpose(1, 2)
    ref_k = ref_joint[..., hd : 2 * hd].view(2, 1, 4, 8).transpose(1, 2)
    append_one_fused(*buffers, 2, 9, *new, None, (q, *tables))
    append_one_reference(*ref_buffers, 2, 9, new[0], ref_k, new[2], None, (ref_q, *tables))
    tol = 0 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(joint, ref_joint, rtol=tol, atol=tol)
    for got, want in zip(buffers, ref_buffers):
        if got.is_floating_point():
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        else:
            assert torch.equal(got, want)


def test_reasons_and_bad_arguments():
    """Layouts the kernel cannot read are reasons (the torch path serves them); wrong shapes, devices and settings are
    errors naming the argument."""
    _, _, q, new, (cos, sin), _ = _step(1, 4, 4, 8, 8, torch.float32, 1)
    assert "queries are not contiguous" in append_one_reason(*new, (torch.randn(1, 4, 1, 16)[..., ::2], cos, sin))
    assert "cos table" in append_one_reason(*new, (q, torch.randn(1, 1, 8)[..., ::2], sin))
    layer = cache_sorted_scalar.SortedScalarCacheLayer(num_heads=4, num_value_groups=4, decode_backend="triton")
    ks, vk, v = new[0], new[1], new[2]
    bad = {
        "takes one token": (torch.randn(1, 4, 2), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), (q, cos, sin)),
        "and no vector keys": (ks, None, v, (q, cos, sin)),
        "must be a tuple": (ks, vk, v, [q, cos, sin]),
        "the vector keys' shape": (ks, vk, v, (torch.randn(1, 4, 1, 6), cos, sin)),
        r"cos must be \[1 or 1, 1, 4\]": (ks, vk, v, (q, torch.randn(1, 1, 8), sin)),
        "sin must be": (ks, vk, v, (q, cos, torch.randn(2, 1, 4))),
        "sin is on meta": (ks, vk, v, (q, cos, torch.empty(1, 1, 4, device="meta"))),
    }
    for message, (k_, vk_, v_, rotary) in bad.items():
        with pytest.raises(ValueError, match=message):
            layer.append(k_, v_, vk_, rotary=rotary)
    assert not layer.is_initialized  # (checked before anything is written)
    with pytest.raises(ValueError, match="rope_in_insert must be one of"):
        with decoder_settings({"rope_in_insert": "yes"}):
            modeling_decoder.rotates_in_insert()


@pytest.mark.parametrize("decode_backend", ["triton", "torch"])
def test_the_cache_rotates_whichever_way_the_insert_goes(decode_backend):
    """``SortedScalarCacheLayer.append(..., rotary=...)``: through the fused launch ("triton") or the slice copies
    after a torch rotation ("torch"), the cache holds the rotated key and q is rotated in place: what an insert of
    keys rotated beforehand gives."""
    b, h, d = 2, 4, 8
    gen = torch.Generator().manual_seed(2)
    prompt = (torch.randn(b, h, 3, generator=gen), torch.randn(b, h, 3, d, generator=gen),
              torch.randn(b, h, 3, d, generator=gen))  # fmt: skip
    q, k = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
    ks, v = torch.randn(b, h, 1, generator=gen), torch.randn(b, h, 1, d, generator=gen)
    angles = torch.randn(1, 1, d // 2, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    layers, fused = [], []
    original = cache_sorted_scalar.append_one_fused
    for rotate_first in (False, True):
        layer = cache_sorted_scalar.SortedScalarCacheLayer(num_heads=h, num_value_groups=h,
                                                           decode_backend=decode_backend)  # fmt: skip
        layer.append(prompt[0], prompt[2], prompt[1])
        q_, k_ = q.clone(), k.clone()
        if rotate_first:
            rotate_pair_reference(q_, k_, cos, sin)
            layer.append(ks, v, k_)
        else:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(cache_sorted_scalar, "append_one_fused", lambda *a: fused.append(a[-1]) or original(*a))
                layer.append(ks, v, k_, rotary=(q_, cos, sin))
        layers.append((layer, q_, k_))
    (a, qa, ka), (r, qr, kr) = layers
    # "triton": the one launch took the rotation; "torch": no launch, torch rotated first
    assert [r is not None for r in fused] == ([True] if decode_backend == "triton" else [])
    assert torch.equal(qa, qr) and torch.equal(ka, kr) and not torch.equal(qa, q)
    assert torch.equal(a.vector_keys, r.vector_keys) and torch.equal(a.keys, r.keys)
    assert torch.equal(a.values, r.values) and torch.equal(a.token_index, r.token_index)


SIZE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            decode_backend="triton")  # fmt: skip
CASES = {
    "hybrid_sort": {},
    "registers, mixed heads": {"num_register_tokens": 1, "head_kinds": ["hybrid", "scalar", "dot", "hybrid"]},
    "two registers, per-token tau, no sink": {"num_register_tokens": 2, "tau_mode": "per_token", "scalar_sink": False},
    "grouped values, window, token bound": {"num_value_groups": 2, "decode_window": 3, "max_cache_tokens": 8},
    "triton attention": {"attention_backend": "triton"},
}


ROTARY, APPEND = modeling_hybrid_sort.apply_rotary_pair, cache_sorted_scalar.append_one_fused


def _generate(case: str, setting: str, monkeypatch):
    torch.manual_seed(0)
    model = build("hybrid_sort", 48, "cpu", dict(SIZE, **CASES[case]))
    rotary_calls, fused = [], []
    monkeypatch.setattr(modeling_hybrid_sort, "apply_rotary_pair",
                        lambda q, *a: rotary_calls.append(q.shape[2]) or ROTARY(q, *a))  # fmt: skip
    monkeypatch.setattr(cache_sorted_scalar, "append_one_fused",
                        lambda *a: fused.append(a[-1] is not None) or APPEND(*a))  # fmt: skip
    ids = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with decoder_settings({"rope_in_insert": setting}), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    return out, rotary_calls, fused


@pytest.mark.parametrize("case", sorted(CASES))
def test_generations_with_rope_in_the_insert_equal_those_with_its_own_launch(case, monkeypatch):
    """Greedy generate from a left-padded batch, RoPE in the insert ("on") against its own launch ("off"): the same
    tokens and logits, bit for bit (float32: the torch RoPE and the kernel's rotation round alike); with "on" the
    layers' RoPE ran only for the prompt (one call per layer), and every decode step's insert rotated."""
    on, rotary_on, fused_on = _generate(case, "on", monkeypatch)
    off, rotary_off, fused_off = _generate(case, "off", monkeypatch)
    layers, steps = SIZE["num_hidden_layers"], 4
    assert rotary_on == [6] * layers and rotary_off == [6] * layers + [1] * (layers * steps)
    assert fused_on == [True] * (layers * steps) and fused_off == [False] * (layers * steps)
    assert torch.equal(on.sequences, off.sequences)
    for a, b in zip(on.logits, off.logits):
        assert torch.equal(a, b)


def test_steps_that_keep_their_own_rope(monkeypatch):
    """No deferral where the insert would not fuse or there is no sorted layer to insert into: decode_backend "torch"
    (the torch inserts), rotary_backend "torch", gradients enabled, the static cache."""
    torch.manual_seed(0)
    model = build("hybrid_sort", 48, "cpu", dict(SIZE, decode_backend="torch"))
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 1, SIZE["hidden_size"])
    layer = cache_sorted_scalar.SortedScalarCacheLayer(num_heads=4, num_value_groups=4, decode_backend="torch")
    layer.append(torch.randn(1, 4, 2), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    with torch.no_grad():
        assert not attn._defers_rope(layer, x)
        layer.decode_backend = "triton"
        assert attn._defers_rope(layer, x)
        assert not attn._defers_rope(layer, torch.randn(1, 2, SIZE["hidden_size"]))  # (two rows: a prompt chunk)
        with decoder_settings({"rotary_backend": "torch"}):
            assert not attn._defers_rope(layer, x)
        with decoder_settings({"rope_in_insert": "off"}):
            assert not attn._defers_rope(layer, x)
        empty = cache_sorted_scalar.SortedScalarCacheLayer(num_heads=4, num_value_groups=4, decode_backend="triton")
        assert not attn._defers_rope(empty, x)
        assert not attn._defers_rope(None, x)
    assert not attn._defers_rope(layer, x)  # (gradients enabled)
    # the static cache: RoPE in the layer, the same tokens either way
    ids = torch.randint(2, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    outs = []
    for setting in ("on", "off"):
        with decoder_settings({"rope_in_insert": setting}), torch.no_grad():
            outs.append(model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static"))
    assert torch.equal(*outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rope_in_the_insert_on_cuda(dtype):
    """The compiled kernel: the d768 shape (H12, D64) and grouped values against the fused RoPE kernel then the plain
    insert (bit for bit), and a bf16 generation on CUDA ("auto") with RoPE in the insert against its own launch."""
    for b, h, g, d, dv, rows in ((1, 12, 12, 64, 64, 1), (3, 8, 2, 128, 96, 3)):
        buffers, joint, q, new, (cos, sin), _ = _step(b, h, g, d, dv, dtype, rows, device="cuda")
        expected = [t.clone() for t in buffers]
        q_rot, k_rot = rotary_fused(q.clone(), new[1].clone(), cos, sin, 1)
        append_one_fused(*buffers, 7, 70000, *new, None, (q, cos, sin))
        append_one_fused(*expected, 7, 70000, new[0], k_rot, new[2])
        torch.testing.assert_close(q, q_rot, rtol=TOL[dtype], atol=TOL[dtype])
        torch.testing.assert_close(new[1], k_rot, rtol=TOL[dtype], atol=TOL[dtype])
        for got, want in zip(buffers, expected):
            if got.is_floating_point():
                torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
            else:
                assert torch.equal(got, want)
    size = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    outs = []
    for setting in ("on", "off"):
        torch.manual_seed(0)
        model = build("hybrid_sort", 64, "cuda", size)
        ids = torch.randint(2, 128, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with decoder_settings({"rope_in_insert": setting}), torch.no_grad():
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True))  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b_ in zip(outs[0].logits, outs[1].logits):
        torch.testing.assert_close(a, b_, rtol=2e-2, atol=2e-2)
