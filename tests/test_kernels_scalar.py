"""Fused Triton kernels of scalar (sort) attention:
the output and every gradient against the float64 naive reference.

The shared cases (where they run, shapes, dtypes, masks, tolerances) are described in
``tests/kernel_family_checks.py``; this file adds the family's own tests.
"""

import math

import pytest  # noqa: F401
import torch  # noqa: F401
from kernel_env import IN_PROCESS

from kernel_family_checks import (  # noqa: F401 (the shared tests, collected here; imported before triton)
    DEVICE,
    ON_GPU,
    _kernels_runnable,
    kc,
    pytest_generate_tests,
    test_full_shapes_on_gpu,
    test_in_interpreter_subprocess,
    test_matches_float64_reference,
)

FAMILY = "scalar"


@pytest.mark.parametrize("heads_per_program", [2, 4])
def test_stacked_heads_of_a_value_group(heads_per_program, monkeypatch):
    """The stacked layout (several heads of a value group per program, each value tile read once) against float64;
    the autotuner may prefer one head per program, so this path is forced here."""
    from hf_rbf import kernels_scalar_bwd, kernels_scalar_fwd

    monkeypatch.setenv("HF_RBF_SCALAR_HEADS_PER_PROGRAM", str(heads_per_program))
    case = kc.Case("scalar", h=4, groups=1, tau="token", klw="bh", window=7, prefix=2, pad=3, seed=21)
    res = kc.check_case(case, DEVICE)
    assert res.ok, f"{case.name}: {res.summary()} {res.errors}"
    for tuner in (
        kernels_scalar_fwd._scalar_fwd,
        kernels_scalar_bwd._scalar_bwd_dkv,
        kernels_scalar_bwd._scalar_bwd_dq,
    ):
        assert tuner.best_config.kwargs["HP"] == heads_per_program


def _grads_vs_float64(qs, ks, v, tau, dout, **kw):
    """Output and gradients of the triton backend against the float64 naive reference on the same inputs."""
    leaves = [t for t in (qs, ks, v, tau) if isinstance(t, torch.Tensor)]
    results = []
    for backend, cast in (("triton", lambda t: t), ("naive", lambda t: t.double())):
        xs = [cast(t.detach()).requires_grad_(True) for t in leaves]
        args = xs + ([tau] if not isinstance(tau, torch.Tensor) else [])
        out = hf_rbf_scalar(*args, backend=backend, **kw)
        out.backward(dout.to(out.dtype))
        results.append((out.detach(), [x.grad for x in xs]))
    (out, grads), (out_ref, grads_ref) = results
    return kc.rel_err(out, out_ref), [kc.rel_err(g, r) for g, r in zip(grads, grads_ref)]


def hf_rbf_scalar(qs, ks, v, tau, **kw):
    import hf_rbf

    return hf_rbf.scalar_attention(qs, ks, v, tau, **kw)


@pytest.mark.parametrize(
    "tau_shape, tau_dtype, dtype, heads_per_program, kw",
    [
        # a per-batch temperature [B, 1, 1] and a per-position one [1, 1, Nq]: broadcast strides read in-kernel
        ((2, 1, 1), torch.float32, torch.float32, 0, dict(window=6, prefix=2)),
        ((1, 1, 9), torch.float32, torch.bfloat16, 2, dict(klw=True)),
        # a bfloat16 temperature tensor: the kernels upcast it before the reciprocal, as 1 / tau.float() did
        ((1, 4, 1), torch.bfloat16, torch.float16, 4, dict(causal=False, prefix=1)),
        # a float temperature (no tensor: beta passed as a kernel argument) with stacked heads and key weights
        (None, None, torch.bfloat16, 2, dict(klw=True, window=5, prefix=3)),
        (None, None, torch.float32, 4, dict(causal=False, pad=True)),
    ],
)
def test_tau_forms_and_stacked_heads(tau_shape, tau_dtype, dtype, heads_per_program, kw, monkeypatch):
    """Temperature forms the shared case list does not cover, read by the kernels themselves (the op takes ``tau``,
    not ``beta = 1 / tau``), each with grouped values and the stacked-heads layout forced where given."""
    if heads_per_program:
        monkeypatch.setenv("HF_RBF_SCALAR_HEADS_PER_PROGRAM", str(heads_per_program))
    g = torch.Generator().manual_seed(5)
    b, h, groups, nq, nk, dv = 2, 4, 1, 9, 23, 16
    qs = torch.randn(b, h, nq, generator=g).to(DEVICE, dtype)
    ks = torch.randn(b, h, nk, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, groups, nk, dv, generator=g).to(DEVICE, dtype)
    tau = 0.7 if tau_shape is None else (0.5 + torch.rand(*tau_shape, generator=g)).to(DEVICE, tau_dtype)
    dout = torch.randn(b, h, nq, dv, generator=g).to(DEVICE, torch.float64)
    call = dict(causal=kw.get("causal", True), window=kw.get("window"), num_prefix_keys=kw.get("prefix", 0))
    if kw.get("klw"):
        call["key_log_weights"] = (0.5 * torch.randn(b, h, nk, generator=g)).to(DEVICE)
    if kw.get("pad"):
        am = torch.ones(b, nk, dtype=torch.long, device=DEVICE)
        am[1, :4] = 0
        call["attention_mask"] = am
    err_out, err_grads = _grads_vs_float64(qs, ks, v, tau, dout, **call)
    tol_out, tol_grad = kc.TOLERANCES[dtype]
    if tau_dtype == torch.bfloat16:
        tol_grad = max(tol_grad, kc.TOLERANCES[torch.bfloat16][1])  # tau's own gradient is rounded to bfloat16
    assert err_out <= tol_out, err_out
    assert len(err_grads) == (3 if tau_shape is None else 4)
    assert all(e <= tol_grad for e in err_grads), err_grads


def test_host_path_has_no_temperature_ops():
    """A forward+backward with a learnable per-head tau: three launches and, besides allocations and views, only the
    sum that reduces tau's per-row gradient (no reciprocal, no elementwise ops for its gradient, no casts of the
    query / key gradients: the kernels write them in the inputs' dtype)."""
    import count_host_ops  # benchmarks/: counts aten ops outside the triton launches (the interpreter's own work)

    import hf_rbf

    count_host_ops._patch_triton_run()
    g = torch.Generator().manual_seed(0)
    qs, ks = (torch.randn(1, 4, 20, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True) for _ in range(2))
    v = torch.randn(1, 2, 20, 16, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True)
    tau = torch.full((4,), 0.3, device=DEVICE, requires_grad=True)
    hf_rbf.scalar_attention(qs, ks, v, tau, backend="triton").float().sum().backward()  # warm-up (autotune)
    out = hf_rbf.scalar_attention(qs, ks, v, tau, backend="triton")
    dout = torch.ones_like(out)
    for t in (qs, ks, v, tau):
        t.grad = None  # a fresh gradient, not an accumulation (add_)
    with count_host_ops.counting() as counter:
        out = hf_rbf.scalar_attention(qs, ks, v, tau, backend="triton")
        out.backward(dout)
    assert sum(counter.launches.values()) == 3, counter.launches
    compute = {op: n for op, n in counter.ops.items() if op not in count_host_ops.NO_KERNEL_OPS}
    assert compute == {"sum": 1}, dict(counter.ops)
    assert qs.grad.dtype == torch.bfloat16 and ks.grad.dtype == torch.bfloat16 and tau.grad.shape == (4,)


def test_decode_rows_take_the_split_k_decode_kernel(monkeypatch):
    """A few query rows without gradients go through the distance family's split-K decode kernel (the scalar term
    alone); with gradients, or with more rows, the scalar family's own kernels serve.  Both against float64."""
    import hf_rbf
    from hf_rbf import attention_scalar_triton

    calls = []
    real = attention_scalar_triton.distance_attention

    def recording(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(attention_scalar_triton, "distance_attention", recording)
    g = torch.Generator().manual_seed(3)
    b, h, groups, nk, dv = 2, 4, 2, 37, 16
    ks = torch.randn(b, h, nk, generator=g).to(DEVICE)
    v = torch.randn(b, groups, nk, dv, generator=g).to(DEVICE)
    tau = (0.5 + torch.rand(h, generator=g)).to(DEVICE)
    for nq, grad, decode in ((1, False, True), (16, False, True), (17, False, False), (1, True, False)):
        calls.clear()
        qs = torch.randn(b, h, nq, generator=g).to(DEVICE).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = hf_rbf.scalar_attention(qs, ks, v, tau, num_prefix_keys=1, backend="triton")
            ref = hf_rbf.scalar_attention(qs.double(), ks.double(), v.double(), tau.double(), num_prefix_keys=1,
                                          backend="naive")  # fmt: skip
        assert (len(calls) == 1) == decode, (nq, grad, calls)
        assert kc.rel_err(out.detach(), ref.detach()) <= kc.TOLERANCES[torch.float32][0]


def test_auto_takes_triton_for_decode_rows_on_cuda_at_every_length():
    """On CUDA "auto" serves a decode step of any length with "triton" (the split-K kernel); SDPA (the padding trick,
    which rebuilds a cuDNN plan at every new key length) goes first only for training-sized calls from
    ``SCALAR_SDPA_MIN_KEYS`` keys on."""
    from types import SimpleNamespace

    from hf_rbf.attention_scalar import SCALAR_SDPA_MIN_KEYS, _candidates
    from hf_rbf.attention_utils import MaskArgs

    cuda = SimpleNamespace(device=torch.device("cuda"))
    for nq, nk, first in ((1, 512, "triton"), (1, 4 * SCALAR_SDPA_MIN_KEYS, "triton"), (16, 100_000, "triton"),
                          (1024, 4 * SCALAR_SDPA_MIN_KEYS, "sdpa"), (1024, 1024, "triton")):  # fmt: skip
        mask = MaskArgs(causal=True, window=None, num_prefix_keys=0, key_log_weights=None, attention_mask=None,
                        nq=nq, nk=nk)  # fmt: skip
        assert next(iter(_candidates(None, None, cuda, None, mask, "auto"))) == first, (nq, nk)


def test_prefix_values_alone_requiring_grad_take_the_training_kernels():
    """Decode-sized rows whose only differentiable input is ``prefix_values`` (learnable register values over a
    frozen cache): the training kernels serve (the decode kernel has no backward), and the prefix values' gradient
    equals the float64 reference's."""
    import hf_rbf

    g = torch.Generator().manual_seed(8)
    b, h, groups, nq, nk, r, dv = 2, 4, 2, 2, 21, 2, 16
    qs = torch.randn(b, h, nq, generator=g).to(DEVICE)
    ks = torch.randn(b, h, r + nk, generator=g).to(DEVICE)
    v = torch.randn(b, groups, nk, dv, generator=g).to(DEVICE)
    pv = torch.randn(1, groups, r, dv, generator=g).to(DEVICE)
    grads = []
    for backend, dtype in (("triton", torch.float32), ("naive", torch.float64)):
        p = pv.to(dtype).clone().requires_grad_(True)
        out = hf_rbf.scalar_attention(qs.to(dtype), ks.to(dtype), v.to(dtype), 0.7, prefix_values=p, backend=backend)
        out.square().sum().backward()
        grads.append(p.grad)
    assert grads[0] is not None and kc.rel_err(grads[0], grads[1]) <= kc.TOLERANCES[torch.float32][1]


# measured under the interpreter (fp32 inputs, N 40, seeds 0-5, both tau forms): out and lse 1e-7 .. 4e-7 relative,
# dqs 6e-7 .. 1.2e-5 (the same before the kernels took the scores over beta)
SCALAR_TOL = {"out": 2e-6, "lse": 2e-6, "dqs": 2e-5}


def _forward_and_query_grad_errors(tau_form: str, n: int = 40, dv: int = 16, seed: int = 3) -> dict:
    """``scalar_forward`` / ``scalar_backward`` against float64: the output, ``lse`` (the true ``log2 sum_j 2^s``,
    which the backward reads) and ``dqs`` (the dQ pass recomputes the scores the forward's way).  fp32 inputs; scalars
    up to about 20 (score terms of hundreds beside small ones), a key bias (log2 units) on heads 0 and 2; head 1 with
    ``tau = inf`` (no scalar term: uniform over the allowed keys), head 3 with every key masked (``lse = inf``, zero
    output and gradient, no NaN).  ``tau_form``: one tau per head ``[1, H, 1]`` or per query ``[B, H, Nq]``."""
    from hf_rbf.kernels_scalar_bwd import scalar_backward
    from hf_rbf.kernels_scalar_fwd import scalar_forward

    b, h = 2, 4
    gen = torch.Generator().manual_seed(seed)
    qs, ks = (10 * torch.randn(b, h, n, generator=gen) for _ in range(2))
    v = torch.randn(b, 1, n, dv, generator=gen)
    tau = torch.rand(1 if tau_form == "head" else b, h, 1 if tau_form == "head" else n, generator=gen) + 0.5
    tau[:, 1] = float("inf")
    kb = torch.randn(b, h, n, generator=gen)
    kb[:, 1] = 0.0
    kb[:, 3] = float("-inf")
    dout = torch.randn(b, h, n, dv, generator=gen)
    call = dict(causal=True, window=None, num_prefix_keys=0)
    t = [x.to(DEVICE) for x in (qs, ks, v, kb, tau)]
    out, lse = scalar_forward(*t, **call)
    dqs = scalar_backward(dout.to(DEVICE), *t, lse, **call, need_dtau=False)[0]

    leaf = qs.double().requires_grad_()
    dd = leaf[..., :, None] - ks.double()[..., None, :]
    s = -dd * dd / tau.double()[..., None] + math.log(2) * kb.double()[..., None, :]  # the kernels' bias: log2 units
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse_ref = torch.logsumexp(s, -1).detach() / math.log(2)
    out_ref = torch.nan_to_num(torch.softmax(s, -1)) @ v.double()
    out_ref.backward(dout.double())
    out, lse, dqs = out.double().cpu(), lse.double().cpu(), dqs.double().cpu()
    assert torch.isfinite(out).all() and torch.isfinite(dqs).all()
    assert (out[:, 3] == 0).all() and (dqs[:, 3] == 0).all() and (lse[:, 3] == float("inf")).all()
    live = [0, 1, 2]
    return {
        "out": ((out - out_ref)[:, live].norm() / out_ref[:, live].norm()).item(),
        "lse": ((lse - lse_ref)[:, live].abs() / lse_ref[:, live].abs().clamp(min=1)).max().item(),
        "dqs": ((dqs - leaf.grad)[:, live].norm() / leaf.grad[:, live].norm()).item(),
    }


@pytest.mark.skipif(not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 (run this file alone)")
@pytest.mark.parametrize("tau_form", ["head", "query"])
def test_forward_lse_and_query_gradient_match_float64(tau_form):
    errors = _forward_and_query_grad_errors(tau_form)
    assert all(errors[name] < tol for name, tol in SCALAR_TOL.items()), errors


def _fixed_reference_case(offset: float, seed: int = 5, n: int = 37, dv: int = 16, **call):
    """bfloat16 values, no key bias: heads 0 and 2 with small scalars (every row's own key near it; head 2 with
    ``tau = inf``), heads 1 and 3 where every key ``j`` sits on query ``j + 1`` (each row's nearest key is its
    predecessor) and row ``i``'s own key lies ``offset`` away: ``offset 40`` puts the own key's score near -2,300
    (log2 units), far past the fixed reference's span, ``offset 7.3`` at about -77 (inside it, the largest weight
    near ``2^38``).  Returns the kernel's ``(out, lse)`` and float64's."""
    from hf_rbf.kernels_scalar_fwd import scalar_forward

    b, h = 2, 4
    gen = torch.Generator().manual_seed(seed)
    qs, ks = torch.randn(b, h, n, generator=gen), torch.randn(b, h, n, generator=gen)
    for head in (1, 3):
        qs[:, head] = torch.linspace(-3, 3, n)
        ks[:, head, :-1] = qs[:, head, 1:]
        ks[:, head, -1] = qs[:, head, -1] + offset
        ks[:, head, :-1] += offset * (torch.arange(n - 1) % 2 == 0)  # every other key far from both queries
    v = torch.randn(b, 2, n, dv, generator=gen).to(torch.bfloat16)
    tau = torch.ones(1, h, 1)
    tau[:, 2] = float("inf")
    out, lse = scalar_forward(*(x.to(DEVICE) for x in (qs, ks, v)), None, tau.to(DEVICE), **call)
    window, causal = call["window"], call["causal"]
    dd = qs.double()[..., :, None] - ks.double()[..., None, :]
    s = -dd * dd / tau.double()[..., None]
    pos = torch.arange(n)
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= (pos[:, None] - pos[None, :]).abs() < window
    s = s.masked_fill(~allowed, float("-inf"))
    vv = v.double().repeat_interleave(2, dim=1)
    return out.double().cpu(), lse.double().cpu(), torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1) / math.log(2)


@pytest.mark.skipif(not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 (run this file alone)")
@pytest.mark.parametrize(
    "call", [dict(causal=True, window=None), dict(causal=True, window=9), dict(causal=False, window=None)]
)
@pytest.mark.parametrize("offset", [40.0, 7.3])
def test_forward_without_a_maximum_matches_float64_and_falls_back_where_it_must(offset, call, monkeypatch):
    """The forward's loop without a row maximum (bfloat16 values, no key bias; ``_fixed_reference``) against
    float64, beside programs that must fall back to the online maximum.  Which loop each program ran is recorded
    (the interpreter calls ``_fwd_tiles`` through the module): every program of the small-scalar heads takes the
    fixed reference; with ``offset 40`` a reference of half the own key's score would overflow (``2^1150``), so the
    far heads' programs must take the online loop, and the output stays finite and right; with ``offset 7.3`` they
    take the fixed one with weights up to about ``2^38``."""
    import hf_rbf.kernels_scalar_fwd as fwd

    if ON_GPU:
        pytest.skip("records the interpreter's calls of the tile loop")
    taken = []
    tiles = fwd._fwd_tiles

    def recording(*args):
        taken.append(bool(args[-10]))  # FIXED_MAX
        return tiles(*args)

    monkeypatch.setattr(fwd, "_fwd_tiles", recording)
    out, lse, out_ref, lse_ref = _fixed_reference_case(offset, num_prefix_keys=0, **call)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # out: the bfloat16 output's rounding; lse (fp32): the fixed reference's exponent rounding, at most ulp(60)
    assert kc.rel_err(out, out_ref) <= kc.TOLERANCES[torch.bfloat16][0], kc.rel_err(out, out_ref)
    assert ((lse - lse_ref).abs() / lse_ref.abs().clamp(min=1)).max() <= 1e-5
    # the interpreter runs the grid (query blocks, batch x head) with the query block outermost
    per_head = torch.tensor(taken).view(-1, 2, 4).permute(1, 2, 0)  # [batch, head, query block]
    assert per_head[:, [0, 2]].all(), per_head
    if offset > 20:
        assert not per_head[:, [1, 3]].any(), per_head
    else:
        assert per_head[:, [1, 3]].all(), per_head
