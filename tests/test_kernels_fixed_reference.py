"""The distance forward's middle tiles with a fixed reference instead of the online maximum
(``kernels_flash_fwd._fixed_reference``: rbf, GKA, the hybrid; bfloat16) against float64, beside programs that must
fall back to the online loop.  Which loop each program ran is recorded: the interpreter calls ``_fwd_tiles`` through
the module."""

import math

import pytest
import torch
from kernel_env import DEVICE, IN_PROCESS, ON_GPU

import kernel_checks as kc

# 70 rows: under the interpreter's 16 x 16 tiles every mask leaves whole middle tiles to most query blocks (a window
# of 33 too), and a partial last tile
N, D, HEADS, BATCH = 70, 16, 4, 2
MASKS = [dict(causal=True, window=None), dict(causal=True, window=33), dict(causal=False, window=None)]
MASK_IDS = ["causal", "causal-W33", "full"]


def _allowed(causal, window):
    pos = torch.arange(N)
    allowed = torch.ones(N, N, dtype=torch.bool)
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= (pos[:, None] - pos[None, :]).abs() < window
    return allowed


def _case(family: str, seed: int = 3):
    """``(distance_forward's positional inputs, its keywords, the float64 score in natural-log units as the kernel
    forms it (no row constant), the float64 row term that moves GKA's eps, the heads that must take the fixed
    reference, the heads that must fall back)``.

    rbf: ``gamma`` 0.05 (heads 0, 2: each row's nearest key within a few log2 units of its bound ``gamma
    ||q||^2``) against 20 (heads 1, 3: the nearest key hundreds of units below it, so the mean of bound and edge
    maximum would put 2^200 in the sum).  GKA (x as query, key and value; eps): the diagonal is each row's exact
    maximum, every head takes the reference, also head 3 with weights up to 2^~40 below it.  Hybrid (one tau per head):
    heads 0 and 2 (scale d^-1/2; head 2 with tau = inf) fixed, heads 1 and 3 with scale 12, whose bound ``|a| ||q||
    max ||k||`` lies far above any score, fall back."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(BATCH, HEADS, N, D, generator=gen).to(torch.bfloat16) for _ in range(3))
    common = dict(num_prefix_keys=0, normalize=True, kv_same=False, eps=0.0)
    if family == "rbf":
        c = torch.tensor([0.05, 20.0, 0.05, 20.0])
        s = c.double().view(1, HEADS, 1, 1) * (
            2 * q.double() @ k.double().transpose(-1, -2) - (k.double() ** 2).sum(-1)[..., None, :]
        )
        inputs = (q, k, v, None, None, None, None, c, None)
        return inputs, dict(common, qnorm=False, knorm_inline=True), s, None, [0, 2], [1, 3]
    if family == "gka":
        c = torch.tensor([0.05, 0.3, 0.02, 1.5])
        x = q
        s = c.double().view(1, HEADS, 1, 1) * (
            2 * x.double() @ x.double().transpose(-1, -2) - (x.double() ** 2).sum(-1)[..., None, :]
        )
        r = c.double().view(1, HEADS, 1) * (x.double() ** 2).sum(-1)
        inputs = (x, x, x, None, None, None, None, c, None)
        return inputs, dict(common, qnorm=True, knorm_inline=True, kv_same=True, eps=1e-3), s, r, [0, 1, 2, 3], []
    qs, ks = torch.randn(BATCH, HEADS, N, generator=gen), torch.randn(BATCH, HEADS, N, generator=gen)
    tau = torch.rand(1, HEADS, 1, generator=gen) + 0.5
    tau[:, 2] = float("inf")
    a = torch.tensor([D**-0.5, 12.0, D**-0.5, 12.0])
    dd = qs.double()[..., :, None] - ks.double()[..., None, :]
    s = a.double().view(1, HEADS, 1, 1) * (q.double() @ k.double().transpose(-1, -2))
    s = s - dd * dd / tau.double()[..., None]
    inputs = (q, k, v, None, qs, ks, tau, a, a)
    return inputs, dict(common, qnorm=False, knorm_inline=False, tau_in=True), s, None, [0, 2], [1, 3]


@pytest.mark.skipif(not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 (run this file alone)")
@pytest.mark.parametrize("edge_first", [False, True], ids=["own-key-bound", "edge-first"])
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("family", ["rbf", "gka", "hybrid"])
def test_middle_tiles_without_a_maximum_match_float64_and_fall_back_where_they_must(
    family, mask, edge_first, monkeypatch
):
    """Output and ``lse`` against float64; the heads whose bounds allow it run their middle tiles with the fixed
    reference in every program, the others run the online loop in every program, and the output stays finite.  The
    lower bound from each row's own key (the middle tiles first) and from the edge tiles (``FIXED_EDGE_FIRST``)."""
    import hf_rbf.kernels_flash_fwd as fwd

    if ON_GPU:
        pytest.skip("records the interpreter's calls of the tile loop")
    monkeypatch.setattr(fwd, "FIXED_EDGE_FIRST", edge_first)
    taken = []
    tiles = fwd._fwd_tiles

    def recording(*args):
        if int(args[25]) == 0:  # MODE 0: the middle tiles, from args[16] to args[17]
            taken.append((bool(args[-1]), int(args[17]) > int(args[16])))  # (FIXED_MAX, tiles to run)
        return tiles(*args)

    monkeypatch.setattr(fwd, "_fwd_tiles", recording)
    inputs, flags, s, r, fixed_heads, online_heads = _case(family)
    out, lse = fwd.distance_forward(*(x if x is None else x.to(DEVICE) for x in inputs), **flags, **mask)
    out, lse = out.double().cpu(), lse.double().cpu()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()

    s = s.masked_fill(~_allowed(**mask), float("-inf"))
    lse_nat = torch.logsumexp(s, -1)
    v = inputs[2].double()
    if r is None:
        out_ref = torch.softmax(s, -1) @ v
    else:  # GKA: W = e^(s - r) / (sum_j e^(s - r) + eps)
        lse_nat = torch.logaddexp(lse_nat, math.log(flags["eps"]) + r)
        out_ref = torch.exp(s - lse_nat[..., None]) @ v
    lse_ref = lse_nat / math.log(2)
    # out: the bfloat16 output's rounding; lse (fp32): the fixed reference's exponent rounding, at most ulp(60), on
    # the fixed heads (measured 1e-7 .. 4e-7); the online heads of rbf (gamma 20) form scores of +-1,400 log2 units
    # as a difference of two terms, whose fp32 rounding gives 3e-5 with or without the reference
    assert kc.rel_err(out, out_ref) <= kc.TOLERANCES[torch.bfloat16][0], kc.rel_err(out, out_ref)
    lse_err = ((lse - lse_ref).abs() / lse_ref.abs().clamp(min=1)).amax(dim=(0, 2))
    assert (lse_err[fixed_heads] <= 2e-6).all() and (lse_err <= 1e-4).all(), lse_err

    # the interpreter runs the grid (query blocks, batch x head) with the query block outermost
    taken = torch.tensor(taken).view(-1, BATCH, HEADS, 2).permute(1, 2, 0, 3)  # [batch, head, query block, 2]
    fixed, busy = taken[..., 0], taken[..., 1]
    assert busy.sum() >= BATCH * HEADS * 2, busy  # (the middle tiles of programs with none may run either loop)
    assert (fixed | ~busy)[:, fixed_heads].all(), taken
    assert not (fixed & busy)[:, online_heads].any(), taken


@pytest.mark.skipif(not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 (run this file alone)")
def test_key_weights_padding_and_other_dtypes_keep_the_online_maximum(monkeypatch):
    """Only bfloat16 softmax with a known bound may take the reference: key weights or padding in the key bias (the
    distance form's bound no longer holds), fp16 / fp32, the softmax-free form, and the switch
    ``HF_RBF_FIXED_REFERENCE=0`` (``FIXED_REFERENCE``) compile the online loop alone."""
    import hf_rbf.kernels_flash_fwd as fwd

    q = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    c = torch.ones(1)
    kb = torch.zeros(1, 1, 4)
    ok = fwd.fixed_reference_ok
    assert ok(q, q, None, None, True, False, True, False)  # rbf, inline norms
    assert ok(q, q, kb, None, True, False, False, True)  # rbf, a key-bias pass of the norms alone
    assert not ok(q, q, kb, None, True, False, False, False)  # key weights / padding in the bias
    assert not ok(q, q, None, None, True, False, False, False)  # the distance form without its norm term
    assert ok(q, q, None, c, True, False, False, False)  # the hybrid
    assert not ok(q, q, kb, c, True, False, False, False)  # the hybrid with key weights
    assert not ok(q, q, None, c, True, True, False, False)  # norm terms outside the distance form
    assert not ok(q, q, None, None, False, True, True, False)  # softmax-free rbf
    for dtype in (torch.float16, torch.float32):
        assert not ok(q.to(dtype), q.to(dtype), None, None, True, False, True, False)
    monkeypatch.setattr(fwd, "FIXED_REFERENCE", False)
    assert not ok(q, q, None, None, True, False, True, False)
