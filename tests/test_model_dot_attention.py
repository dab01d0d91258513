"""``dot_attention`` (the "dot" layer kind's kernel): naive and SDPA backends against a float64 reference written
here, with the shared mask semantics (causal, window, prefix keys, padding, key log-weights, Nq < Nk), several dtypes,
gradients, and fully masked rows."""

from __future__ import annotations

import math

import pytest
import torch

from hf_rbf import dot_attention, last_backend


def reference(q, k, v, *, scale, causal, window, prefix, attention_mask, key_log_weights):
    """Float64, one (query, key) pair at a time for the mask: the semantics of hf_rbf.attention_utils restated."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    allowed = torch.zeros(b, 1, nq, nk, dtype=torch.bool)
    for bi in range(b):
        for i in range(nq):
            t = (nk - prefix) - nq + i
            for j in range(nk):
                s = j - prefix
                if j < prefix:
                    ok = True
                elif causal:
                    ok = s <= t and (window is None or t - s < window)
                else:
                    ok = window is None or abs(t - s) < window
                if attention_mask is not None and not attention_mask[bi, j]:
                    ok = False
                allowed[bi, 0, i, j] = ok
    scores = (q @ k.transpose(-1, -2)) * scale
    if key_log_weights is not None:
        klw = key_log_weights.double()
        klw = klw[:, None, None, :] if klw.dim() == 2 else klw[:, :, None, :]
        scores = scores + klw
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()


CASES = [
    # (B, H, Nq, Nk, D, causal, window, prefix, pad, klw)
    (2, 3, 13, 13, 16, True, None, 0, False, None),
    (2, 3, 13, 13, 16, True, 4, 0, True, "bn"),
    (1, 2, 11, 11, 24, False, 3, 0, False, "bhn"),
    (2, 2, 3, 15, 8, True, None, 2, True, None),  # decode-like: 3 queries over 2 registers + 13 cached keys
    (2, 4, 1, 9, 8, True, 5, 1, True, "bn"),
    (3, 2, 7, 10, 16, True, None, 3, False, "bhn"),
    (2, 2, 9, 9, 8, False, None, 0, True, None),
]


def _make(case, dtype, seed=0):
    b, h, nq, nk, d, causal, window, prefix, pad, klw = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=gen).to(dtype)
    k = torch.randn(b, h, nk, d, generator=gen).to(dtype)
    v = torch.randn(b, h, nk, d, generator=gen).to(dtype)
    mask = None
    if pad:
        mask = torch.ones(b, nk, dtype=torch.long)
        mask[0, prefix : prefix + 3] = 0  # left padding after the prefix keys
    weights = None
    if klw == "bn":
        weights = 0.5 * torch.randn(b, nk, generator=gen)
    elif klw == "bhn":
        weights = 0.5 * torch.randn(b, h, nk, generator=gen)
    kwargs = dict(causal=causal, window=window, num_prefix_keys=prefix, attention_mask=mask, key_log_weights=weights)
    return q, k, v, kwargs


def _ref_kwargs(kwargs, d):
    return dict(
        scale=1.0 / math.sqrt(d),
        causal=kwargs["causal"],
        window=kwargs["window"],
        prefix=kwargs["num_prefix_keys"],
        attention_mask=kwargs["attention_mask"],
        key_log_weights=kwargs["key_log_weights"],
    )


# relative-error tolerances against the float64 reference
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_forward_matches_float64_reference(case, dtype, backend):
    q, k, v, kwargs = _make(case, dtype)
    out = dot_attention(q, k, v, backend=backend, **kwargs)
    assert out.dtype == dtype and out.shape == q.shape
    assert last_backend("dot_attention") == backend
    ref = reference(q, k, v, **_ref_kwargs(kwargs, q.shape[-1]))
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_gradients_match_float64_reference(case, backend):
    q, k, v, kwargs = _make(case, torch.float32, seed=1)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(2))
    dot_attention(q, k, v, backend=backend, **kwargs).backward(grad_out)
    reference(q64, k64, v64, **_ref_kwargs(kwargs, q.shape[-1])).backward(grad_out.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert torch.isfinite(got).all()
        assert _rel(got, want) < 1e-5


def test_gradcheck_naive_float64():
    q, k, v, kwargs = _make((1, 2, 5, 7, 4, True, 3, 1, True, "bn"), torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: dot_attention(a, b, c, backend="naive", **kwargs), (q, k, v))


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_fully_masked_rows_give_zeros_without_nan(backend):
    b, h, n, d = 2, 2, 6, 8
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, :4] = 0  # rows 0..3 of batch 1 have no allowed key (left padding, causal)
    out = dot_attention(q, k, v, causal=True, attention_mask=mask, backend=backend)
    assert torch.isfinite(out).all()
    assert out[1, :, :4].abs().max() == 0
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert q.grad[1, :, :4].abs().max() == 0


def test_unsupported_backend_and_bad_arguments_raise():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="triton.*not available"):
        dot_attention(q, q, q, backend="triton")
    with pytest.raises(ValueError, match="backend.*'auto'"):
        dot_attention(q, q, q, backend="cuda")
    with pytest.raises(ValueError, match="scale"):
        dot_attention(q, q, q, scale=-1.0)
    with pytest.raises(ValueError, match="window"):
        dot_attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="attention_mask"):
        dot_attention(q, q, q, attention_mask=torch.ones(1, 3))


def test_auto_picks_sdpa():
    q = torch.randn(1, 2, 4, 8)
    dot_attention(q, q, q)
    assert last_backend("dot_attention") == "sdpa"
