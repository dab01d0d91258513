"""What the four attention functions share: mask semantics, numerics at the edges, bad input, backend choice."""

import logging

import pytest
import torch

import hf_rbf
import hf_rbf.attention_utils as attention_utils
import hf_rbf.kernels_common as kernels_common
import test_attention_gka as gka_tests
import test_attention_hybrid as hybrid_tests
import test_attention_rbf as rbf_tests
import test_attention_scalar as scalar_tests
from attention_testing import (
    LOW_DTYPES,
    _positions,
    check_backend,
    flex_backward_on_cpu,  # noqa: F401  (fixture)
    gka_ref,
    hybrid_ref,
    kernel_average_ref,
    randn,
    rbf_ref,
    scalar_ref,
)


# family -> (case builder, float64 reference, library call, first case name, flex differentiable on CUDA)
FAMILIES = {
    "rbf": (rbf_tests.make_inputs, rbf_ref, hf_rbf.rbf_attention, rbf_tests.CASES, True),
    "gka": (gka_tests.make_inputs, gka_ref, hf_rbf.gka_attention, gka_tests.CASES, True),
    "scalar": (scalar_tests.make_inputs, scalar_ref, scalar_tests._scalar, scalar_tests.CASES, False),
    "hybrid": (hybrid_tests.make_inputs, hybrid_ref, hybrid_tests._hybrid, hybrid_tests.CASES, False),
}

# shapes of one family call: b=2, h=2, d=16 / dv=8, G=1 for the grouped families
BASE_CASE = {
    "rbf": dict(b=2, h=2, d=16, dv=8),
    "gka": dict(b=2, h=2, d=16, eps=0.1, query=True),
    "scalar": dict(b=2, h=2, g=1, dv=8, tau="head"),
    "hybrid": dict(b=2, h=2, d=16, g=1, dv=8, tau="head", scale="head"),
}


# ----------------------------------------------------------------------------------------------------------------
# mask semantics
# ----------------------------------------------------------------------------------------------------------------

MASK_GRID = [
    (nq, nk, causal, window, prefix)
    for nq, nk in ((1, 1), (7, 7), (3, 9), (6, 4), (1, 5))
    for causal in (True, False)
    for window in (None, 1, 3, 20)
    for prefix in (0, 1, 3)
    if prefix <= nk
]


def test_allowed_positions_match_the_definition():
    """The library's position mask equals the position-by-position definition of the design notes."""
    for nq, nk, causal, window, prefix in MASK_GRID:
        got = attention_utils.allowed_positions(nq, nk, causal, window, prefix, "cpu")
        assert torch.equal(got, _positions(nq, nk, causal, window, prefix)), (nq, nk, causal, window, prefix)


def test_allowed_key_counts_match_brute_force():
    gen = torch.Generator().manual_seed(0)
    for nq, nk, causal, window, prefix in MASK_GRID:
        am = (torch.rand(2, nk, generator=gen) > 0.3).long()
        live = torch.rand(2, 3, nk, generator=gen) > 0.2
        mask = attention_utils.normalize_mask_args(
            "test",
            batch=2,
            heads=3,
            nq=nq,
            nk=nk,
            device=torch.device("cpu"),
            causal=causal,
            window=window,
            num_prefix_keys=prefix,
            key_log_weights=None,
            attention_mask=am,
        )
        want = (
            _positions(nq, nk, causal, window, prefix)[None, None] & am.bool()[:, None, None, :] & live[:, :, None, :]
        ).sum(-1)
        got = attention_utils.allowed_key_counts(mask, "cpu", key_live=live)
        assert torch.equal(got.expand_as(want), want), (nq, nk, causal, window, prefix)


# ----------------------------------------------------------------------------------------------------------------
# numerics: rows without keys, large norms, half precision
# ----------------------------------------------------------------------------------------------------------------


def _dead_rows_inputs(family):
    """Rows with no key at all: a fully padded batch row, queries before the first key (Nq > Nk, causal), and
    (batch 1, head 0) whose every key has log-weight -inf.  The other rows keep key 0 ordinary."""
    make, *_ = FAMILIES[family]
    case = dict(BASE_CASE[family], nq=5, nk=3, klw="extreme")
    inputs, kwargs = make(case, seed=3)
    kwargs["attention_mask"] = torch.tensor([[0, 0, 0], [1, 1, 1]])
    return inputs, kwargs


def _flex_grads(family, backend):
    return "rule" if backend != "flex" or FAMILIES[family][4] else None


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend", ["naive", "sdpa", "flex"])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_rows_without_keys_are_zero_without_nan(family, backend, dtype, request):
    if backend == "flex":
        request.getfixturevalue("flex_backward_on_cpu")
    _, ref_fn, lib_fn, _, _ = FAMILIES[family]
    inputs, kwargs = _dead_rows_inputs(family)
    out = check_backend(ref_fn, lib_fn, inputs, kwargs, backend, dtype, grads=_flex_grads(family, backend))
    dead = torch.zeros(out.shape[:3], dtype=torch.bool)
    dead[0] = True  # fully padded batch row
    dead[:, :, :2] = True  # queries at positions -2 and -1 see no key
    dead[1, 0] = True  # only -inf log-weights
    assert torch.all(out[dead] == 0)
    assert torch.all(out[~dead].abs().sum(-1) > 0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend", ["naive", "sdpa", "flex"])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_large_norms(family, backend, dtype, request):
    """Inputs scaled by 30: outputs within the tolerance rule, outputs and gradients free of Inf/NaN.

    (Gradients are not held to the rule here: at 30-fold norms a flash-style backward's rounding of the output,
    times score derivatives that grow with the norms, dominates them; see attention_testing's docstring.)
    """
    if backend == "flex":
        request.getfixturevalue("flex_backward_on_cpu")
    make, ref_fn, lib_fn, cases, flex_grads = FAMILIES[family]
    name = next(iter(cases))
    inputs, kwargs = make(cases[name], seed=5, scale=30.0)
    grads = "finite" if backend != "flex" or flex_grads else None
    check_backend(ref_fn, lib_fn, inputs, kwargs, backend, dtype, grads=grads)


def test_rbf_softmax_free_large_weights_bfloat16():
    """normalize=False with large sums of weights (Z up to about Nk * e^3) stays exact in bfloat16 on sdpa."""
    q = randn(1, 2, 33, 16, seed=1, scale=0.2)
    k = randn(1, 2, 33, 16, seed=2, scale=0.2)
    v = randn(1, 2, 33, 8, seed=3)
    klw = torch.full((1, 33), 3.0, dtype=torch.float64)
    ref = rbf_ref(q, k, v, gamma=0.25, key_log_weights=klw, normalize=False)
    for backend in ("naive", "sdpa"):
        out = hf_rbf.rbf_attention(
            q.bfloat16(),
            k.bfloat16(),
            v.bfloat16(),
            gamma=0.25,
            key_log_weights=klw.bfloat16(),
            normalize=False,
            backend=backend,
        )
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, backend


def test_kernel_average_reference_sanity():
    """The test reference itself: a softmax, zeros for empty rows, eps in the denominator, -inf as no key."""
    scores = torch.tensor([[[[0.0, 0.0, float("-inf")], [1.0, 2.0, 3.0]]]], dtype=torch.float64)
    allowed = torch.tensor([[[[True, True, True], [False, False, False]]]])
    values = torch.eye(3, dtype=torch.float64)[None, None]
    out = kernel_average_ref(scores, allowed, values, eps=1.0)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([1 / 3, 1 / 3, 0.0], dtype=torch.float64))
    assert torch.all(out[0, 0, 1] == 0)


# ----------------------------------------------------------------------------------------------------------------
# bad input: the error names the argument and what is allowed
# ----------------------------------------------------------------------------------------------------------------

Q = torch.randn(1, 2, 5, 8)
QS = torch.randn(1, 4, 5)
V4 = torch.randn(1, 4, 5, 8)

BAD_CALLS = {
    "q-ndim": (lambda: hf_rbf.rbf_attention(Q[0], Q, Q), r"`q` must be a 4-D tensor \[B, H, Nq, D\]; got shape"),
    "k-head-dim": (lambda: hf_rbf.rbf_attention(Q, Q[..., :4], Q), r"`k` has head dim 4 .*expected 8"),
    "v-length": (lambda: hf_rbf.rbf_attention(Q, Q, Q[:, :, :3]), r"`v` has key length 3 .*expected 5"),
    "int-dtype": (
        lambda: hf_rbf.rbf_attention(Q.long(), Q.long(), Q.long()),
        r"`q` must have dtype float16, bfloat16, float32 or float64; got torch.int64",
    ),
    "dtype-mismatch": (
        lambda: hf_rbf.rbf_attention(Q, Q.double(), Q),
        r"`k` has dtype torch.float64 but `q` has torch.float32; all inputs must share one dtype",
    ),
    "device-mismatch": (
        lambda: hf_rbf.rbf_attention(Q, Q.to("meta"), Q),
        r"`k` is on meta but `q` is on cpu; all inputs must share one device",
    ),
    "groups-not-dividing-heads": (
        lambda: hf_rbf.scalar_attention(QS, QS, V4[:, :3], 1.0),
        r"`v` has 3 value groups .*G must divide the number of heads H = 4",
    ),
    "hybrid-groups": (
        lambda: hf_rbf.hybrid_attention(V4, V4, V4[:, :3], QS, QS, 1.0),
        r"G must divide the number of heads H = 4",
    ),
    "window-zero": (
        lambda: hf_rbf.rbf_attention(Q, Q, Q, window=0),
        r"`window` must be None or a positive int .*got 0",
    ),
    "window-negative": (
        lambda: hf_rbf.gka_attention(Q, 0.0, window=-2),
        r"`window` must be None or a positive int .*got -2",
    ),
    "window-float": (
        lambda: hf_rbf.scalar_attention(QS, QS, V4, 1.0, window=2.5),
        r"`window` must be None or a positive int .*got 2.5",
    ),
    "unknown-backend": (
        lambda: hf_rbf.rbf_attention(Q, Q, Q, backend="cuda"),
        r"`backend` must be one of 'auto', 'naive', 'sdpa', 'flex', 'triton'; got 'cuda'",
    ),
    "triton-float64": (
        lambda: hf_rbf.rbf_attention(Q.double(), Q.double(), Q.double(), backend="triton"),
        r"backend='triton' cannot serve this call: .*torch.float64",
    ),
    "key-log-weights-shape": (
        lambda: hf_rbf.rbf_attention(Q, Q, Q, key_log_weights=torch.zeros(1, 4)),
        r"`key_log_weights` must have shape \[B, Nk\] or \[B, H, Nk\] = \[1, 5\] or \[1, 2, 5\]",
    ),
    "attention-mask-shape": (
        lambda: hf_rbf.gka_attention(Q, 0.0, attention_mask=torch.ones(1, 4)),
        r"`attention_mask` must have shape \[B, Nk\] = \[1, 5\] \(1 = real token, 0 = padding\)",
    ),
    "prefix-too-long": (
        lambda: hf_rbf.rbf_attention(Q, Q, Q, num_prefix_keys=6),
        r"`num_prefix_keys` must be an int in \[0, Nk=5\]; got 6",
    ),
    "gamma-negative": (
        lambda: hf_rbf.rbf_attention(Q, Q, Q, gamma=-1.0),
        r"`gamma` must be a positive finite float or a tensor \[H\]; got -1.0",
    ),
    "gamma-shape": (
        lambda: hf_rbf.rbf_attention(Q, Q, Q, gamma=torch.ones(3)),
        r"`gamma` must be a float, a 0-d tensor or a tensor of shape \[H\] = \[2\]; got \(3,\)",
    ),
    "tau-shape": (
        lambda: hf_rbf.scalar_attention(QS, QS, V4, torch.ones(3)),
        r"a 1-D `tau` is per head and must have shape \[H\] = \[4\]; got \(3,\)",
    ),
    "eps-negative": (lambda: hf_rbf.gka_attention(Q, 0.0, eps=-1.0), r"`eps` must be a float >= 0; got -1.0"),
    "normalize-not-bool": (
        lambda: hf_rbf.rbf_attention(Q, Q, Q, normalize=1),
        r"`normalize` must be True or False; got 1",
    ),
    "causal-not-bool": (lambda: hf_rbf.rbf_attention(Q, Q, Q, causal=None), r"`causal` must be True or False"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_names_the_argument(name):
    call, message = BAD_CALLS[name]
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_backend_that_cannot_serve_says_why():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"backend='flex' cannot serve this call: flex has no backward on cpu .*`q`"):
        hf_rbf.rbf_attention(q, q, q, backend="flex")
    qs = torch.randn(1, 4, 5, requires_grad=True)
    with pytest.raises(ValueError, match=r"backend='flex' cannot serve this call: .*`qs`"):
        hf_rbf.scalar_attention(qs, qs, V4, 1.0, backend="flex")
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot serve this call: there are no keys \(Nk = 0\)"):
        hf_rbf.rbf_attention(Q, Q[:, :, :0], Q[:, :, :0], backend="sdpa")


def test_backend_reasons_are_worked_out_only_when_the_choice_reaches_them(monkeypatch):
    """A family's candidates give the later backends' reasons as functions: "auto" evaluates them in order up to the
    first backend that serves (the checks of the others cost host time on every call), an explicit backend only its
    own; the skipped ones still explain themselves."""
    evaluated = []

    def reason(name, value):
        def check():
            evaluated.append(name)
            return value

        return check

    candidates = {
        "triton": ("t", reason("triton", "no GPU")),
        "sdpa": ("s", reason("sdpa", None)),
        "flex": ("f", reason("flex", "never")),
        "naive": ("n", None),
    }
    assert attention_utils.choose_backend("op", "auto", torch.device("cpu"), candidates) == ("sdpa", "s")
    assert evaluated == ["triton", "sdpa"]
    evaluated.clear()
    assert attention_utils.choose_backend("op", "naive", torch.device("cpu"), candidates) == ("naive", "n")
    assert evaluated == []
    with pytest.raises(ValueError, match="backend='flex' cannot serve this call: never"):
        attention_utils.choose_backend("op", "flex", torch.device("cpu"), candidates)
    assert evaluated == ["flex"]
    evaluated.clear()
    del candidates["sdpa"]
    assert attention_utils.choose_backend("op", "auto", torch.device("cpu"), candidates) == ("naive", "n")
    assert evaluated == ["triton", "flex"]
    # the real families: a call served by the first backend never asks the others
    calls = []
    real = hf_rbf.attention_rbf.rbf_flex_reason
    monkeypatch.setattr(hf_rbf.attention_rbf, "rbf_flex_reason", lambda *a: calls.append(a) or real(*a))
    q = torch.randn(1, 2, 5, 8)
    hf_rbf.rbf_attention(q, q, q, gamma=0.5, backend="sdpa")
    assert calls == []


def test_flex_without_grad_mode_accepts_leaves_that_require_grad():
    """Under torch.no_grad() flex serves CPU calls even when the inputs are leaves that require grad."""
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    with torch.no_grad():
        out = hf_rbf.rbf_attention(q, q, q, backend="flex")
        want = hf_rbf.rbf_attention(q, q, q, backend="naive")
    torch.testing.assert_close(out, want)


def _compile_flex_on_cpu(monkeypatch, backend):
    """Make the flex adapters compile on the CPU (as on CUDA) with Dynamo backend ``backend``, from empty caches."""
    import torch._dynamo

    import hf_rbf.attention_flex_utils as flex_utils

    monkeypatch.setattr(flex_utils, "COMPILE_DEVICE_TYPES", {"cpu"})
    monkeypatch.setattr(flex_utils, "COMPILE_BACKEND", backend)
    monkeypatch.setattr(flex_utils, "_COMPILED", type(flex_utils._COMPILED)())
    monkeypatch.setattr(flex_utils, "_BLOCK_MASK_CACHE", {})
    torch._dynamo.reset()


def test_flex_compiles_once_per_call_signature(monkeypatch):
    """The compiled flex path (CUDA's; here on the CPU with Dynamo's cheap "eager" backend and no gradients) compiles
    one graph per call signature and never again for it: a sweep over families, lengths and masks that would pass
    Dynamo's recompile limit (8) on one shared callable, and then run eagerly, compiles each signature exactly once,
    and repeated calls reuse it.  Outputs equal the naive reference."""
    import torch._dynamo.testing

    import hf_rbf.attention_flex_utils as flex_utils

    counter = torch._dynamo.testing.CompileCounter()
    _compile_flex_on_cpu(monkeypatch, counter)
    g = torch.Generator().manual_seed(0)
    calls = []
    for n in (16, 24, 40, 56, 72):
        for window in (None, 8):
            x = torch.randn(1, 2, n, 16, generator=g)
            calls.append(("rbf", n, window, x))
    calls.append(("gka", 24, None, torch.randn(1, 2, 24, 16, generator=g)))
    calls.append(("gka", 40, None, torch.randn(1, 2, 40, 16, generator=g)))
    # scalar and hybrid capture None for the absent key log-weights (the GPU found that the signature choked on it)
    calls.append(("scalar", 24, None, torch.randn(1, 2, 24, 16, generator=g)))
    calls.append(("hybrid", 40, 8, torch.randn(1, 2, 40, 16, generator=g)))

    def run(family, window, x, backend):
        if family == "rbf":
            return hf_rbf.rbf_attention(x, x.flip(2), x, causal=True, window=window, backend=backend)
        if family == "scalar":
            return hf_rbf.scalar_attention(x[..., 0], x[..., 1], x, 0.5, causal=True, window=window, backend=backend)
        if family == "hybrid":
            return hf_rbf.hybrid_attention(
                x, x.flip(2), x, x[..., 0], x[..., 1], 0.5, causal=True, window=window, backend=backend
            )
        return hf_rbf.gka_attention(x, log_sigma=torch.zeros(2), causal=True, window=window, backend=backend)

    with torch.no_grad():
        for family, n, window, x in calls:
            torch.testing.assert_close(run(family, window, x, "flex"), run(family, window, x, "naive"))
        compiled = counter.frame_count
        # one flex graph per call signature (14), one block-mask graph per mask (10: GKA's, scalar's and hybrid's
        # share rbf's masks)
        masks = {(n, window) for _, n, window, _ in calls}
        assert compiled == len(calls) + len(masks) == 24, compiled
        for family, n, window, x in calls:  # the same signatures again: nothing new is compiled
            run(family, window, x, "flex")
    assert counter.frame_count == compiled
    assert len(flex_utils._COMPILED) == compiled
    torch._dynamo.reset()


def test_no_keys_gives_zeros_on_naive():
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    out = hf_rbf.rbf_attention(q, q[:, :, :0], q[:, :, :0])
    assert out.shape == (1, 2, 3, 8) and torch.all(out == 0)
    assert hf_rbf.last_backend("rbf_attention") == "naive"
    out.sum().backward()
    assert torch.all(q.grad == 0)


# ----------------------------------------------------------------------------------------------------------------
# backend choice
# ----------------------------------------------------------------------------------------------------------------


def test_auto_logs_its_choice_once_and_reports_it(caplog, monkeypatch):
    monkeypatch.setattr(attention_utils, "_LOGGED", set())
    q = torch.randn(1, 2, 20, 8)  # more rows than DECODE_ROWS: the padding trick's order
    with caplog.at_level(logging.INFO, logger="hf_rbf"):
        hf_rbf.rbf_attention(q, q, q)
        hf_rbf.rbf_attention(q, q, q)
    records = [r.getMessage() for r in caplog.records if r.name == "hf_rbf"]
    assert records == ["rbf_attention: backend='sdpa' on cpu (requested 'auto')"]
    assert hf_rbf.last_backend("rbf_attention") == "sdpa"

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_rbf"):
        hf_rbf.rbf_attention(q.half(), q.half(), q.half(), normalize=False)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "hf_rbf"]
    assert message.startswith("rbf_attention: backend='naive' on cpu (requested 'auto') (skipped: sdpa: sdpa cannot")
    assert "flex: auto uses flex only on CUDA" in message
    assert hf_rbf.last_backend("rbf_attention") == "naive"
    assert hf_rbf.last_backend()["rbf_attention"] == "naive"


@pytest.mark.parametrize("rows", [1, 16, 17, 64])
def test_auto_on_cpu_decodes_naive_and_prefills_through_sdpa(rows):
    """On the CPU the padding trick's per-call copies of every key make it up to 10x slower than the naive path for a
    handful of query rows (see kernels_common.auto_order); from DECODE_ROWS + 1 rows on it is the faster one."""
    h, n, d = 2, 40, 8
    q, k, v = torch.randn(1, h, rows, d), torch.randn(1, h, n, d), torch.randn(1, h, n, d)
    qs, ks, vg = torch.randn(1, h, rows), torch.randn(1, h, n), torch.randn(1, 1, n, d)
    expected = "naive" if rows <= kernels_common.DECODE_ROWS else "sdpa"
    with torch.no_grad():
        hf_rbf.rbf_attention(q, k, v)
        hf_rbf.gka_attention(k, torch.zeros(h), query=q)
        hf_rbf.scalar_attention(qs, ks, vg, 0.1)
        hf_rbf.hybrid_attention(q, k, vg, qs, ks, 0.1)
    for op in ("rbf_attention", "gka_attention", "scalar_attention", "hybrid_attention"):
        assert hf_rbf.last_backend(op) == expected, op


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_takes_sdpa_on_cpu_and_explicit_backends_report_themselves(family):
    make, _, lib_fn, cases, _ = FAMILIES[family]
    inputs, kwargs = make(next(iter(cases.values())), seed=1)
    op = {"rbf": "rbf_attention", "gka": "gka_attention", "scalar": "scalar_attention", "hybrid": "hybrid_attention"}
    inputs = {n: t.float() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
    nq = next(t for n, t in inputs.items() if n in ("q", "qs", "query", "x")).shape[2]
    with torch.no_grad():
        lib_fn(**inputs, **kwargs)
        # a few query rows on the CPU (decoding) go to the naive path, more to the padding trick
        assert hf_rbf.last_backend(op[family]) == ("naive" if nq <= kernels_common.DECODE_ROWS else "sdpa")
        for backend in ("naive", "flex", "sdpa"):
            lib_fn(**inputs, **kwargs, backend=backend)
            assert hf_rbf.last_backend(op[family]) == backend


# ----------------------------------------------------------------------------------------------------------------
# the GPU machine: compiled flex (with its own backward), SDPA's fused kernels
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_backends_match_reference(family):
    make, ref_fn, lib_fn, cases, flex_grads = FAMILIES[family]
    for backend in ("sdpa", "flex"):
        grads = "rule" if backend != "flex" or flex_grads else None
        for dtype in LOW_DTYPES:
            for name, case in cases.items():
                if family == "rbf" and not rbf_tests._serves(backend, dtype, case):
                    continue
                inputs, kwargs = make(case, seed=len(name))
                check_backend(ref_fn, lib_fn, inputs, kwargs, backend, dtype, grads=grads, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_auto_order():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hf_rbf.rbf_attention(q, q, q)
    assert hf_rbf.last_backend("rbf_attention") in ("triton", "sdpa")
    qs = torch.randn(1, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hf_rbf.scalar_attention(qs, qs, q.detach(), 1.0, backend="sdpa")
    # scalar: Triton below SCALAR_SDPA_MIN_KEYS keys or with a window, the SDPA padding trick from there on
    hf_rbf.scalar_attention(qs, qs, q.detach(), 1.0)
    assert hf_rbf.last_backend("scalar_attention") == "triton"
    n = hf_rbf.attention_scalar.SCALAR_SDPA_MIN_KEYS
    long_q = torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16)
    long_s = torch.randn(1, 2, n, device="cuda", dtype=torch.bfloat16)
    hf_rbf.scalar_attention(long_s, long_s, long_q, 1.0)
    assert hf_rbf.last_backend("scalar_attention") == "sdpa"
    hf_rbf.scalar_attention(long_s, long_s, long_q, 1.0, window=256)
    assert hf_rbf.last_backend("scalar_attention") == "triton"
    # a decode row over the same keys: triton (the split-K decode kernel), not the padding trick
    with torch.no_grad():
        hf_rbf.scalar_attention(long_s[:, :, -1:], long_s, long_q, 1.0)
    assert hf_rbf.last_backend("scalar_attention") == "triton"
    with pytest.raises(ValueError, match=r"flex cannot differentiate `qs`, `ks`"):
        hf_rbf.scalar_attention(qs, qs, q.detach(), 1.0, backend="flex")


def _aten_ops(fn) -> list[str]:
    """The aten ops ``fn()`` dispatches, outside triton's interpreter (its own tensor work is not the host path)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return ops


def test_float_coefficients_are_cached_device_constants():
    """A float gamma / scale / tau becomes the kernels' coefficient tensor once per (value, shape, device): the same
    tensor again (no fill op per call and layer), a different one for another value or shape."""
    a = attention_utils.constant_vector(0.5, (4,), torch.device("cpu"))
    assert attention_utils.constant_vector(0.5, (4,), "cpu") is a
    assert attention_utils.constant_vector(0.25, (4,), "cpu") is not a
    assert attention_utils.constant_vector(0.5, (1, 1, 1), "cpu").shape == (1, 1, 1)
    assert a.dtype == torch.float32 and torch.equal(a, torch.full((4,), 0.5))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
    qs, ks = torch.randn(1, 2, 5, generator=g), torch.randn(1, 2, 5, generator=g)
    calls = {
        "rbf": lambda: hf_rbf.rbf_attention(q, k, v, gamma=0.3, causal=True, backend="triton"),
        "hybrid": lambda: hf_rbf.hybrid_attention(q, k, v, qs, ks, 0.7, scale=0.25, causal=True, backend="triton"),
    }
    for name, fn in calls.items():
        first = fn()
        ops = _aten_ops(fn)
        assert "full" not in ops and "fill_" not in ops, f"{name}: {ops}"
        torch.testing.assert_close(fn(), first)


@pytest.mark.parametrize("family", ["rbf", "gka"])
def test_flex_prologue_runs_inside_the_compiled_call(family, monkeypatch):
    """rbf's and GKA's flex paths scale the queries and build the key-norm bias (GKA: and the row shift of ``eps``)
    inside the compiled call, where they fuse (eagerly they were separate passes over q and k, forward and backward:
    the flex backend measured 1.10x FlexAttention used directly).  Here on the CPU with Dynamo's "aot_eager" backend
    (without gradients: a compiled flex call has no CPU backward, even with flex's eager one lifted onto the CPU; the
    GPU test ``test_gpu_backends_match_reference`` differentiates the compiled call, and the CPU gradient tests of
    each family the same ``prepare`` uncompiled): the compiled graph holds the squares and sums of the key norms, and
    the output equals the naive reference's, with key log-weights and, for GKA, a separate query and ``eps`` (the
    row shift computed inside)."""
    import torch._dynamo


    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    _compile_flex_on_cpu(monkeypatch, backend)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 24, 16, generator=g, dtype=torch.float64) for _ in range(2))
    klw = torch.randn(1, 1, 24, generator=g, dtype=torch.float64)
    param = torch.tensor([0.2, -0.1], dtype=torch.float64)

    def run(backend):
        if family == "rbf":
            return hf_rbf.rbf_attention(q, k, k.flip(2), gamma=param.exp(), causal=True, key_log_weights=klw,
                                        backend=backend)
        return hf_rbf.gka_attention(k, log_sigma=param, query=q, causal=True, eps=1e-3, key_log_weights=klw,
                                    backend=backend)

    with torch.no_grad():
        torch.testing.assert_close(run("flex"), run("naive"))
    flex_graphs = [code for code in graphs if "flex_attention" in code]
    assert flex_graphs and all("square" in code and "sum" in code for code in flex_graphs), flex_graphs
    torch._dynamo.reset()
