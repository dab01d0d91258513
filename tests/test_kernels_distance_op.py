"""The shared distance op of the fused kernels (``attention_distance_triton.distance_attention``) against a float64
reference of its general score, and the host work of one call.

The family tests (``test_kernels_rbf/gka/hybrid.py``) go through the public functions, where ``a`` and ``b`` are
tied (``a = -2 b`` for RBF and GKA, ``b = 0`` for the hybrid).  Here they are independent per-head tensors of any
float dtype, so a kernel that mixed up the dot and the norm coefficient, or dropped a unit conversion, fails:

    S_ij = a_h q_i.k_j + b_h (||q_i||^2 [qnorm] + ||k_j||^2 [knorm]) - beta_i (qs_i - ks_j)^2 [scalar] + log w_j

Covered: the key norms computed inside the kernels (knorm without key weights or padding: no key-bias pass) and the
key-bias path (key log-weights, padding), softmax / softmax-free / GKA's eps, ``x`` as key and value, the scalar
term, odd lengths, causal / windowed / bidirectional masks with prefix keys, float32 and bfloat16, gradients wrt
q, k, v, a, b (and the key log-weights, the scalar inputs).  The launch counts pin the host work per call.
"""


import pytest
import torch

from kernel_env import DEVICE, IN_PROCESS, ON_GPU, check_compiled_matches_eager  # noqa: E402 (first: sets TRITON_INTERPRET)

import count_host_ops  # noqa: E402

import hf_rbf  # noqa: E402
from hf_rbf.attention_distance_triton import distance_attention  # noqa: E402
from hf_rbf.attention_utils import MaskArgs, allowed_mask, masked_kernel_average  # noqa: E402

TOL = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (1.5e-2, 3e-2)}

pytestmark = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 in this process (run this file alone)"
)


def reference(q, k, v, qs, ks, beta, a, b, mask: MaskArgs, *, normalize, qnorm, knorm, eps):
    """The op's output in float64 from the materialised scores."""
    q, k, v, a, b = (t.double() for t in (q, k, v, a, b))
    s = a.view(1, -1, 1, 1) * (q @ k.transpose(-1, -2))
    if qnorm:
        s = s + b.view(1, -1, 1, 1) * (q * q).sum(-1, keepdim=True)
    if knorm:
        s = s + b.view(1, -1, 1, 1) * (k * k).sum(-1).unsqueeze(-2)
    if qs is not None:
        d = qs.double().unsqueeze(-1) - ks.double().unsqueeze(-2)
        s = s - beta.double().unsqueeze(-1) * d * d
    if mask.key_log_weights is not None:
        s = s + mask.key_log_weights.double().unsqueeze(-2)
    return masked_kernel_average(s, v, allowed_mask(mask, q.device), normalize=normalize, eps=eps)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values"
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def _make(
    *,
    dtype,
    b=2,
    h=3,
    nq=19,
    nk=19,
    d=24,
    dv=20,
    coef_dtype=torch.float32,
    kv_same=False,
    scalar=False,
    klw=False,
    pad=0,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)

    t = {"q": rnd(b, h, nq, d), "k": rnd(b, h, nk, d)}
    t["v"] = t["k"] if kv_same else rnd(b, h, nk, dv)
    # independent coefficients: a > 0, b < 0 (a distance-like score whose scale keeps the softmax soft)
    t["a"] = ((0.5 + torch.rand(h, generator=gen)) / d**0.5).to(DEVICE, coef_dtype)
    t["b"] = (-(0.2 + 0.3 * torch.rand(h, generator=gen)) / d**0.5).to(DEVICE, coef_dtype)
    if scalar:
        t["qs"], t["ks"] = rnd(b, h, nq), rnd(b, h, nk)
        t["beta"] = (0.5 + torch.rand(1, h, 1, generator=gen)).to(DEVICE)
    if klw:
        t["klw"] = (0.5 * torch.randn(b, 1, nk, generator=gen)).to(DEVICE)
    am = None
    if pad:
        am = torch.ones(b, nk, dtype=torch.bool)
        am[-1, :pad] = False
        am = am.to(DEVICE)
    return t, am


def _run(t, am, *, causal, window, prefix, normalize, qnorm, knorm, kv_same, eps, fn):
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in t.items() if not (kv_same and n == "v")}
    if kv_same:
        leaves["v"] = leaves["k"]
    nq, nk = t["q"].shape[2], t["k"].shape[2]
    mask = MaskArgs(causal, window, prefix, leaves.get("klw"), am, nq, nk)
    out = fn(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        leaves.get("qs"),
        leaves.get("ks"),
        leaves.get("beta"),
        leaves["a"],
        leaves.get("b"),  # absent: the distance form (b = None)
        mask,
        normalize=normalize,
        qnorm=qnorm,
        knorm=knorm,
        kv_same=kv_same,
        eps=eps,
    )
    gen = torch.Generator().manual_seed(123)
    dout = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    out.backward(dout)
    grads = {n: x.grad for n, x in leaves.items() if not (kv_same and n == "v")}
    return out.detach(), grads


def _reference_fn(q, k, v, qs, ks, beta, a, b, mask, **kw):
    kw.pop("kv_same")
    if b is None:  # the distance form: a holds c, the score uses 2c and -c
        a, b = 2.0 * a, -a
    return reference(q, k, v, qs, ks, beta, a, b, mask, **kw)


def _check(t, am, dtype, **flags):
    ref_t = {n: x.double() for n, x in t.items()}
    out_ref, g_ref = _run(ref_t, am, fn=_reference_fn, **flags)
    out, g = _run(t, am, fn=distance_attention, **flags)
    tol_out, tol_grad = TOL[dtype]
    assert out.dtype == t["q"].dtype
    errors = {"out": (rel_err(out, out_ref), tol_out)}
    for name, ref in g_ref.items():
        assert g[name] is not None, f"no gradient for {name}"
        assert g[name].dtype == t[name].dtype and g[name].shape == t[name].shape, name
        tol = tol_grad
        if name in ("a", "b"):
            # returned in the coefficient's own dtype: its rounding bounds the error
            tol = max(tol, torch.finfo(t[name].dtype).eps)
        norm_coefficient = name == "b" or (name == "a" and "b" not in t)  # the distance form's c carries -b
        if norm_coefficient and dtype == torch.bfloat16 and flags["normalize"]:
            # Under the softmax db = sum_ij dS_ij ||k_j||^2 is a sum of cancelling terms (every row of dS sums to
            # 0), and dS uses delta_i = dO_i . O_i with O rounded to bfloat16, as FlashAttention does: the relative
            # error of db is several per cent at these random shapes (3-5e-2 measured, the same before the key
            # norms moved into the kernels).  The dot coefficient's and the inputs' gradients keep the usual bound.
            tol = 8e-2
        errors[f"d{name}"] = (rel_err(g[name], ref), tol)
    bad = {n: e for n, e in errors.items() if not e[0] <= e[1]}
    assert not bad, f"errors over tolerance: {bad} (all: {errors})"


MASKS = {
    "causal": {"causal": True, "window": None, "prefix": 0},
    "causal-window-prefix": {"causal": True, "window": 5, "prefix": 2},
    "full-window": {"causal": False, "window": 4, "prefix": 0},
    "full-prefix": {"causal": False, "window": None, "prefix": 3},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", list(MASKS), ids=str)
def test_key_norms_inline_softmax(dtype, mask):
    """RBF-like: knorm only (no key weights, no padding), softmax, independent a and b."""
    t, am = _make(dtype=dtype, seed=1)
    _check(t, am, dtype, **MASKS[mask], normalize=True, qnorm=False, knorm=True, kv_same=False, eps=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_key_norms_inline_softmax_free(dtype):
    """Softmax-free RBF: the query norm in the row statistics, the key norm in the kernels."""
    t, am = _make(dtype=dtype, nq=13, nk=21, seed=2)
    _check(
        t, am, dtype, **MASKS["causal-window-prefix"], normalize=False, qnorm=True, knorm=True, kv_same=False, eps=0.0
    )


@pytest.mark.parametrize("eps", [0.0, 0.05])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_key_norms_inline_kv_same(dtype, eps):
    """GKA-like: x as key and value, both norms, eps in the denominator."""
    t, am = _make(dtype=dtype, d=16, kv_same=True, seed=3)
    _check(t, am, dtype, **MASKS["causal"], normalize=True, qnorm=True, knorm=True, kv_same=True, eps=eps)


@pytest.mark.parametrize("coef_dtype", [torch.bfloat16, torch.float64], ids=str)
def test_coefficients_of_any_float_dtype(coef_dtype):
    """``a`` / ``b`` are read in their own dtype inside the kernels; their gradients come back in it."""
    t, am = _make(dtype=torch.float32, coef_dtype=coef_dtype, nq=11, nk=17, seed=4)
    _check(
        t, am, torch.float32, **MASKS["full-prefix"], normalize=True, qnorm=False, knorm=True, kv_same=False, eps=0.0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_key_bias_path_with_weights_and_padding(dtype):
    """Key log-weights and padding keep the key-bias pass (norms folded into it); gradients wrt the weights."""
    t, am = _make(dtype=dtype, klw=True, pad=4, seed=5)
    _check(
        t, am, dtype, **MASKS["causal-window-prefix"], normalize=True, qnorm=False, knorm=True, kv_same=False, eps=0.0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scalar_term_softmax_free(dtype):
    """The scalar term without the softmax: dS = W dP has no delta, so the scalar-query and temperature gradients are
    the plain row sums (the dQ kernel once subtracted the softmax's delta term here too: 40-130% errors)."""
    t, am = _make(dtype=dtype, scalar=True, nq=15, nk=22, seed=6)
    _check(t, am, dtype, **MASKS["causal"], normalize=False, qnorm=True, knorm=True, kv_same=False, eps=0.0)


def test_scalar_term_with_norms():
    """The hybrid's scalar term next to both norm terms (a combination no family uses, every code path at once)."""
    t, am = _make(dtype=torch.float32, scalar=True, nq=15, nk=22, seed=6)
    _check(
        t,
        am,
        torch.float32,
        **MASKS["causal-window-prefix"],
        normalize=True,
        qnorm=True,
        knorm=True,
        kv_same=False,
        eps=0.01,
    )


DISTANCE_FORM_CASES = {
    "softmax": ({}, {"normalize": True, "qnorm": False, "knorm": True, "kv_same": False, "eps": 0.0}),
    "softmax-free": ({}, {"normalize": False, "qnorm": True, "knorm": True, "kv_same": False, "eps": 0.0}),
    "kv-same-eps": ({"kv_same": True}, {"normalize": True, "qnorm": True, "knorm": True, "kv_same": True, "eps": 0.05}),
    "weights-padding": (
        {"klw": True, "pad": 3},
        {"normalize": True, "qnorm": False, "knorm": True, "kv_same": False, "eps": 0.0},
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(DISTANCE_FORM_CASES))
def test_distance_form_one_coefficient(dtype, case):
    """``b = None``: ``a`` holds ``c``, the kernels use ``2c`` and ``-c`` and reduce the gradient of ``c`` themselves
    (RBF's gamma, GKA's 1 / (2 sigma^2)); against the reference with ``a = 2c, b = -c`` built by autograd."""
    make, flags = DISTANCE_FORM_CASES[case]
    t, am = _make(dtype=dtype, nq=15, nk=19, seed=8, **make)
    t["a"] = t["a"] / 2  # c = -b, of the size the RBF / GKA coefficients have
    del t["b"]
    _check(t, am, dtype, **MASKS["causal-window-prefix"], **flags)


def _host_work(t, am, **flags):
    """(triton launches, aten ops) by name of one forward+backward of the op, after a warm-up call (autotuning)."""
    count_host_ops._patch_triton_run()
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in t.items()}
    mask = MaskArgs(flags.pop("causal"), flags.pop("window"), flags.pop("prefix"), leaves.get("klw"), am, 8, 8)
    args = [leaves[n] for n in ("q", "k", "v")] + [None, None, None, leaves["a"], leaves["b"], mask]
    out = distance_attention(*args, **flags)
    dout = torch.ones_like(out)
    out.backward(dout)
    for x in leaves.values():
        x.grad = None
    with count_host_ops.counting() as c:
        distance_attention(*args, **flags).backward(dout)
    return dict(c.launches), dict(c.ops)


def test_host_work_per_forward_backward():
    """knorm alone: three launches (forward, dQ with delta inside, dK/dV), no zero fills, and buffers only for the
    outputs (out, lse; dq, dk, dv and one fp32 work buffer, reduced by one sum); the key-bias pass comes back only
    for key weights or padding."""
    flags = {**MASKS["causal"], "normalize": True, "qnorm": False, "knorm": True, "kv_same": False, "eps": 0.0}
    t, am = _make(dtype=torch.float32, b=1, h=2, nq=8, nk=8, d=16, dv=16)
    launches, ops = _host_work(t, am, **flags)
    assert launches == {"_distance_fwd_kernel": 1, "_distance_bwd_dq_kernel": 1, "_distance_bwd_dkdv_kernel": 1}
    assert not {"zeros", "zeros_like", "fill_", "zero_", "expand", "contiguous", "clone"} & set(ops), ops
    assert ops.get("empty", 0) == 3 and ops.get("empty_like", 0) == 3 and ops.get("sum", 0) == 1, ops
    t, am = _make(dtype=torch.float32, b=1, h=2, nq=8, nk=8, d=16, dv=16, klw=True)
    launches, _ = _host_work(t, am, **flags)
    assert launches.get("_key_bias_kernel") == 1 and sum(launches.values()) == 4, launches


# --------------------------------------------------------------------------------------------------------------------
# separate prefix keys / values (registers): kernel pointers instead of a concatenation in front of k / v
# --------------------------------------------------------------------------------------------------------------------


def _prefix_call(leaves, am, n_prefix, *, causal, window, scalar, fused, kv_same, flags):
    """The op with separate prefix tensors (``fused``) or the float64 reference on the concatenated keys."""
    q, k, v, pk, pv = (leaves[n] for n in ("q", "k", "v", "pk", "pv"))
    if kv_same:
        v, pv = k, pk
    bsz = q.shape[0]
    nk = n_prefix + k.shape[2]
    mask = MaskArgs(causal, window, n_prefix, leaves.get("klw"), am, q.shape[2], nk)
    qs, ks, beta = (leaves.get(n) for n in ("qs", "ks", "beta")) if scalar else (None, None, None)
    if fused:
        return distance_attention(q, k, v, qs, ks, beta, leaves["a"], leaves["b"], mask, prefix=(pk, pv), **flags)
    k_all = torch.cat([pk.expand(bsz, -1, -1, -1), k], dim=2)
    v_all = torch.cat([pv.expand(bsz, -1, -1, -1), v], dim=2)
    if v.shape[1] != q.shape[1]:  # grouped values: the reference expands them per head
        v_all = v_all.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    flags = {n: x for n, x in flags.items() if n != "kv_same"}
    return reference(q, k_all, v_all, qs, ks, beta, leaves["a"], leaves["b"], mask, **flags)


PREFIX_CASES = {
    # name: (dtype, prefix batch, n_prefix, mask, extra)
    "shared-causal-fp32": (torch.float32, 1, 2, MASKS["causal"], {}),
    "shared-window-bf16": (torch.bfloat16, 1, 3, {"causal": True, "window": 5}, {}),
    "per-batch-full-fp32": (torch.float32, 2, 1, {"causal": False, "window": None}, {}),
    "shared-weights-padding": (torch.float32, 1, 2, {"causal": True, "window": 6}, {"klw": True, "pad": 3}),
    "shared-kv-same-eps": (torch.float32, 1, 2, MASKS["causal"], {"kv_same": True}),
    "shared-softmax-free": (torch.float32, 1, 2, {"causal": True, "window": 4}, {"normalize": False}),
    "shared-scalar-groups": (torch.float32, 1, 2, MASKS["causal"], {"scalar": True, "groups": 1}),
    "shared-decode": (torch.float32, 1, 3, MASKS["causal"], {"decode": True}),
}


@pytest.mark.parametrize("name", list(PREFIX_CASES))
def test_separate_prefix_matches_concatenated_keys(name):
    dtype, prefix_batch, n_prefix, mask_kw, extra = PREFIX_CASES[name]
    kv_same, scalar, normalize = extra.get("kv_same", False), extra.get("scalar", False), extra.get("normalize", True)
    decode = extra.get("decode", False)
    b, h, d, dv = 2, 3, 16, 12
    groups = extra.get("groups", h)
    nq, nk = (3, 23) if decode else (17, 21)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)

    t = {"q": rnd(b, h, nq, d), "k": rnd(b, h, nk, d), "v": rnd(b, groups, nk, dv)}
    t["pk"], t["pv"] = rnd(prefix_batch, h, n_prefix, d), rnd(prefix_batch, groups, n_prefix, dv)
    if kv_same:
        del t["v"], t["pv"]
    t["a"] = ((0.5 + torch.rand(h, generator=gen)) / d**0.5).to(DEVICE)
    t["b"] = (-(0.2 + 0.3 * torch.rand(h, generator=gen)) / d**0.5).to(DEVICE)
    if scalar:
        t["qs"], t["ks"] = rnd(b, h, nq), rnd(b, h, n_prefix + nk)
        t["beta"] = (0.5 + torch.rand(1, h, 1, generator=gen)).to(DEVICE)
    if extra.get("klw"):
        t["klw"] = (0.5 * torch.randn(b, 1, n_prefix + nk, generator=gen)).to(DEVICE)
    am = None
    if extra.get("pad"):
        am = torch.ones(b, n_prefix + nk, dtype=torch.bool)
        am[-1, n_prefix : n_prefix + extra["pad"]] = False
        am = am.to(DEVICE)
    flags = {
        "normalize": normalize,
        "qnorm": kv_same or not normalize,
        "knorm": not scalar,
        "kv_same": kv_same,
        "eps": 0.05 if kv_same else 0.0,
    }
    call = {"causal": mask_kw["causal"], "window": mask_kw["window"], "scalar": scalar, "kv_same": kv_same}

    def run(tensors, fused):
        leaves = {n: x.detach().clone().requires_grad_(not decode) for n, x in tensors.items()}
        leaves.setdefault("v", leaves["k"])
        leaves.setdefault("pv", leaves["pk"])
        if decode:
            with torch.no_grad():
                return _prefix_call(leaves, am, n_prefix, fused=fused, flags=flags, **call), {}
        out = _prefix_call(leaves, am, n_prefix, fused=fused, flags=flags, **call)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device, out.dtype))
        return out.detach(), {n: leaves[n].grad for n in tensors}

    out_ref, g_ref = run({n: x.double() for n, x in t.items()}, fused=False)
    out, g = run(t, fused=True)
    tol_out, tol_grad = TOL[dtype]
    errors = {"out": (rel_err(out, out_ref), tol_out)}
    for n, ref in g_ref.items():
        if ref is None:  # an input the score does not use (b without norm terms): a zero gradient or none
            assert g[n] is None or not g[n].any(), n
            continue
        assert g[n] is not None and g[n].shape == t[n].shape and g[n].dtype == t[n].dtype, n
        tol = 8e-2 if (n == "b" and dtype == torch.bfloat16 and normalize) else tol_grad  # see _check
        errors[f"d{n}"] = (rel_err(g[n], ref), tol)
    bad = {n: e for n, e in errors.items() if not e[0] <= e[1]}
    assert not bad, f"errors over tolerance: {bad} (all: {errors})"


def test_separate_prefix_arguments_are_checked():
    t, am = _make(dtype=torch.float32, b=2, h=3, nq=5, nk=5, d=16, dv=16)
    mask = MaskArgs(True, None, 2, None, None, 5, 7)
    pk = torch.randn(1, 3, 2, 16, device=DEVICE)
    flags = {"normalize": True, "qnorm": False, "knorm": True, "kv_same": False, "eps": 0.0}
    args = (t["q"], t["k"], t["v"], None, None, None, t["a"], t["b"], mask)
    with pytest.raises(ValueError, match="prefix values must have shape"):
        distance_attention(*args, prefix=(pk, torch.randn(1, 3, 3, 16, device=DEVICE)), **flags)
    with pytest.raises(ValueError, match="prefix keys are torch.bfloat16"):
        distance_attention(*args, prefix=(pk.bfloat16(), pk), **flags)


def test_separate_prefix_launches_no_copy():
    """The prefix costs no extra launch and no copy: the same three launches as without it, one sum over the batch
    per prefix gradient."""
    count_host_ops._patch_triton_run()
    t, _ = _make(dtype=torch.float32, b=2, h=2, nq=8, nk=8, d=16, dv=16)
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in t.items()}
    pk = torch.randn(1, 2, 1, 16, device=DEVICE, requires_grad=True)
    pv = torch.randn(1, 2, 1, 16, device=DEVICE, requires_grad=True)
    mask = MaskArgs(True, None, 1, None, None, 8, 9)
    flags = {"normalize": True, "qnorm": False, "knorm": True, "kv_same": False, "eps": 0.0}
    args = [leaves[n] for n in ("q", "k", "v")] + [None, None, None, leaves["a"], leaves["b"], mask]
    out = distance_attention(*args, prefix=(pk, pv), **flags)
    dout = torch.ones_like(out)
    out.backward(dout)
    for x in [*leaves.values(), pk, pv]:
        x.grad = None
    with count_host_ops.counting() as c:
        distance_attention(*args, prefix=(pk, pv), **flags).backward(dout)
    assert sum(c.launches.values()) == 3, c.launches
    assert not {"cat", "copy_", "expand", "zeros", "zeros_like"} & set(c.ops), c.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rbf_attention_prefix_arguments(dtype):
    """``rbf_attention(prefix_keys=, prefix_values=)``: the triton backend (separate pointers) against the float64
    naive reference of the same call (which concatenates), with a window, odd lengths and a per-head gamma."""
    gen = torch.Generator().manual_seed(7)
    b, h, n, r, d = 2, 3, 19, 2, 16
    t = {
        "q": torch.randn(b, h, n, d, generator=gen),
        "k": torch.randn(b, h, n, d, generator=gen),
        "v": torch.randn(b, h, n, 8, generator=gen),
        "prefix_keys": torch.randn(1, h, r, d, generator=gen),
        "prefix_values": torch.randn(1, h, r, 8, generator=gen),
        "gamma": 0.1 + 0.1 * torch.rand(h, generator=gen),
    }
    dout = torch.randn(b, h, n, 8, generator=gen)

    def run(backend, cast):
        leaves = {name: cast(x).detach().clone().to(DEVICE).requires_grad_(True) for name, x in t.items()}
        kw = {name: leaves[name] for name in ("prefix_keys", "prefix_values", "gamma")}
        out = hf_rbf.rbf_attention(leaves["q"], leaves["k"], leaves["v"], window=7, backend=backend, **kw)
        assert hf_rbf.last_backend("rbf_attention") == backend
        out.backward(dout.to(DEVICE, out.dtype))
        return out.detach(), {name: x.grad for name, x in leaves.items()}

    def cast(x):
        return x.to(dtype) if x.dim() == 4 else x  # gamma stays float32

    out, grads = run("triton", cast)
    out_ref, grads_ref = run("naive", lambda x: cast(x).double())
    tol_out, tol_grad = TOL[dtype]
    assert rel_err(out, out_ref) <= tol_out
    for name, ref in grads_ref.items():
        assert grads[name].shape == t[name].shape, name
        assert rel_err(grads[name], ref) <= tol_grad, (name, rel_err(grads[name], ref))
    with pytest.raises(ValueError, match="go together"):
        hf_rbf.rbf_attention(t["q"], t["k"], t["v"], prefix_keys=t["prefix_keys"])
    with pytest.raises(ValueError, match="num_prefix_keys"):
        hf_rbf.rbf_attention(
            t["q"], t["k"], t["v"], prefix_keys=t["prefix_keys"], prefix_values=t["prefix_values"], num_prefix_keys=1
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hybrid_attention_prefix_arguments(dtype):
    """``hybrid_attention(prefix_keys=, prefix_values=)`` (the hybrid layer's sink and register keys): the triton
    backend reads the prefix in place, the float64 naive reference of the same call concatenates; grouped values, a
    window, odd lengths, per-head scale, per-query tau and scalar keys over all ``R + N`` keys; gradients of every
    input, the prefix's included."""
    gen = torch.Generator().manual_seed(11)
    b, h, g, n, r, d, dv = 2, 4, 2, 19, 2, 16, 8
    t = {
        "q": torch.randn(b, h, n, d, generator=gen),
        "k": torch.randn(b, h, n, d, generator=gen),
        "v": torch.randn(b, g, n, dv, generator=gen),
        "qs": torch.randn(b, h, n, generator=gen),
        "ks": torch.randn(b, h, r + n, generator=gen),
        "prefix_keys": torch.randn(1, h, r, d, generator=gen),
        "prefix_values": torch.randn(1, g, r, dv, generator=gen),
        "tau": 0.5 + torch.rand(b, h, n, generator=gen),
        "scale": torch.tensor([0.25, 0.0, 0.3, 0.2]),  # one pure scalar head
    }
    dout = torch.randn(b, h, n, dv, generator=gen)

    def run(backend, cast):
        leaves = {name: cast(name, x).detach().clone().to(DEVICE).requires_grad_(True) for name, x in t.items()}
        out = hf_rbf.hybrid_attention(
            *(leaves[name] for name in ("q", "k", "v", "qs", "ks", "tau")),
            scale=leaves["scale"].detach(),
            window=7,
            prefix_keys=leaves["prefix_keys"],
            prefix_values=leaves["prefix_values"],
            backend=backend,
        )
        assert hf_rbf.last_backend("hybrid_attention") == backend
        out.backward(dout.to(DEVICE, out.dtype))
        return out.detach(), {name: x.grad for name, x in leaves.items() if name != "scale"}

    out, grads = run("triton", lambda name, x: x if name in ("tau", "scale") else x.to(dtype))
    out_ref, grads_ref = run("naive", lambda name, x: x.double() if name != "scale" else x)
    tol_out, tol_grad = TOL[dtype]
    assert rel_err(out, out_ref) <= tol_out
    for name, ref in grads_ref.items():
        assert grads[name].shape == t[name].shape, name
        assert rel_err(grads[name], ref) <= tol_grad, (name, rel_err(grads[name], ref))
    with pytest.raises(ValueError, match="prefix_values. must have shape"):  # one value per head, not per group
        hf_rbf.hybrid_attention(
            *(t[name] for name in ("q", "k", "v", "qs", "ks", "tau")),
            prefix_keys=t["prefix_keys"],
            prefix_values=t["prefix_values"].repeat_interleave(h // g, dim=1),
        )


def test_rbf_attention_host_path_has_no_elementwise_ops():
    """One forward+backward of ``rbf_attention`` (triton, per-head gamma): three launches, and besides them only
    allocations, views and the one sum of the per-head gradient: no torch op builds or reduces a coefficient."""
    count_host_ops._patch_triton_run()
    calls = count_host_ops.make_calls(1, 2, 12, 16, torch.float32, DEVICE)
    fn, leaves = calls["rbf_attention"]
    out = fn()
    dout = torch.ones_like(out)
    out.backward(dout)
    for x in leaves:
        x.grad = None
    with count_host_ops.counting() as c:
        fn().backward(dout)
    assert sum(c.launches.values()) == 3, c.launches
    assert set(c.ops) <= {"empty", "empty_like", "slice", "sum", "unbind", "detach"}, c.ops
    assert c.ops["sum"] == 1, c.ops


def test_torch_compile_with_prefix_tensors():
    """``torch.compile`` (fullgraph) traces ``rbf_attention(prefix_keys=, prefix_values=)`` into the custom ops (the
    optional prefix inputs, their gradients and the distance form's ``b = None`` in the schemas): eager's loss and
    gradients.  aot_eager on the CPU (the interpreter's kernels cannot go through Inductor), Inductor on the GPU."""
    gen = torch.Generator().manual_seed(11)
    t = {
        "q": torch.randn(2, 2, 13, 16, generator=gen),
        "k": torch.randn(2, 2, 13, 16, generator=gen),
        "v": torch.randn(2, 2, 13, 16, generator=gen),
        "prefix_keys": torch.randn(1, 2, 2, 16, generator=gen),
        "prefix_values": torch.randn(1, 2, 2, 16, generator=gen),
        "gamma": torch.tensor([0.08, 0.12]),
    }

    def loss_fn(x):
        out = hf_rbf.rbf_attention(
            x["q"],
            x["k"],
            x["v"],
            gamma=x["gamma"],
            window=5,
            prefix_keys=x["prefix_keys"],
            prefix_values=x["prefix_values"],
            backend="triton",
        )
        return (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum()

    check_compiled_matches_eager(loss_fn, t)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "d, n_prefix, prefix_batch, window", [(64, 1, 1, None), (128, 4, 1, 512), (64, 3, 2, 300), (256, 2, 1, None)]
)
def test_separate_prefix_full_shapes_on_gpu(d, n_prefix, prefix_batch, window):
    """The prefix pointers at training shapes (the autotuner's tiles of 32-128 keys; the interpreter tests run 16):
    ``rbf_attention(prefix_keys=, prefix_values=)`` in bfloat16 against the float64 naive reference of the same
    call, output and every gradient."""
    gen = torch.Generator().manual_seed(d + n_prefix)
    b, h, n = 2, 4, 1023
    t = {
        "q": torch.randn(b, h, n, d, generator=gen),
        "k": torch.randn(b, h, n, d, generator=gen),
        "v": torch.randn(b, h, n, d, generator=gen),
        "prefix_keys": torch.randn(prefix_batch, h, n_prefix, d, generator=gen),
        "prefix_values": torch.randn(prefix_batch, h, n_prefix, d, generator=gen),
        "gamma": (0.3 + 0.4 * torch.rand(h, generator=gen)) / d**0.5,
    }
    dout = torch.randn(b, h, n, d, generator=gen).bfloat16()  # the same rounded values for both calls

    def run(backend, dtype):
        leaves = {
            name: x.to("cuda", dtype if x.dim() == 4 else torch.float32 if dtype != torch.float64 else dtype)
            .detach()
            .requires_grad_(True)
            for name, x in t.items()
        }
        kw = {name: leaves[name] for name in ("prefix_keys", "prefix_values", "gamma")}
        out = hf_rbf.rbf_attention(leaves["q"], leaves["k"], leaves["v"], window=window, backend=backend, **kw)
        out.backward(dout.to("cuda", out.dtype))
        return out.detach(), {name: x.grad for name, x in leaves.items()}

    out, grads = run("triton", torch.bfloat16)
    # the reference on the same bfloat16-rounded inputs
    t = {name: (x.bfloat16().double() if x.dim() == 4 else x.double()) for name, x in t.items()}
    out_ref, grads_ref = run("naive", torch.float64)
    tol_out, tol_grad = TOL[torch.bfloat16]
    assert rel_err(out, out_ref) <= tol_out
    for name, ref in grads_ref.items():
        tol = 8e-2 if name == "gamma" else tol_grad  # gamma's gradient carries -db (see _check)
        assert rel_err(grads[name], ref) <= tol, (name, rel_err(grads[name], ref))


@pytest.mark.parametrize("flags", ["softmax", "softmax-free", "kv-same-eps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_key_norms_from_the_key_bias_pass(dtype, flags, monkeypatch):
    """Where the key norms come from the key-bias pass (head dim >= ``KNORM_PASS_MIN_HEAD_DIM`` or keys >=
    ``KNORM_PASS_MIN_KEYS``; lowered to 0 here so that the small shapes take it): the forward loads them per key,
    the backward reads the forward's choice from the saved key bias, and the output and every gradient still match
    the float64 reference."""
    from hf_rbf import attention_distance_triton as adt

    monkeypatch.setattr(adt, "KNORM_PASS_MIN_HEAD_DIM", 0)
    passes = []
    key_bias = adt.key_bias

    def counted(k, coef, klw, am, heads, nk, bsz, knorm, prefix_k=None, **kwargs):
        passes.append(knorm)
        return key_bias(k, coef, klw, am, heads, nk, bsz, knorm, prefix_k, **kwargs)

    monkeypatch.setattr(adt, "key_bias", counted)
    if flags == "softmax":
        t, am = _make(dtype=dtype, seed=11)
        _check(t, am, dtype, **MASKS["causal"], normalize=True, qnorm=False, knorm=True, kv_same=False, eps=0.0)
    elif flags == "softmax-free":
        t, am = _make(dtype=dtype, nq=13, nk=21, seed=12)
        _check(t, am, dtype, **MASKS["full-window"], normalize=False, qnorm=True, knorm=True, kv_same=False, eps=0.0)
    else:
        t, am = _make(dtype=dtype, d=16, kv_same=True, seed=13)
        _check(t, am, dtype, **MASKS["causal"], normalize=True, qnorm=True, knorm=True, kv_same=True, eps=0.05)
    assert passes and all(passes)  # the norms went through the pass, in the reference-checked call


def test_where_the_key_norms_come_from():
    """``_knorm_inline`` / ``_knorm_pass``: the kernels add the norms at small head dims and lengths, the pass from
    head dim 128 or 4096 keys, separate prefix keys alike; key weights or padding always in the pass; the backward
    reads the forward's choice from the saved key bias."""
    from hf_rbf.attention_distance_triton import _knorm_inline, _knorm_inline_backward, _knorm_pass

    klw, pk = torch.zeros(1), torch.zeros(1)
    assert _knorm_inline(True, None, None, None, 64, 2048) and not _knorm_pass(True, None, None, None, 64, 2048)
    for d, n in ((128, 256), (64, 4096), (256, 8192)):
        assert not _knorm_inline(True, None, None, None, d, n) and _knorm_pass(True, None, None, None, d, n)
    assert not _knorm_inline(True, None, None, pk, 128, 8192) and _knorm_pass(True, None, None, pk, 128, 8192)
    assert _knorm_inline(True, None, None, pk, 64, 1024) and not _knorm_pass(True, None, None, pk, 64, 1024)
    assert not _knorm_inline(True, klw, None, None, 64, 16) and _knorm_pass(True, klw, None, None, 64, 16)
    assert not _knorm_inline(False, None, None, None, 128, 8192) and not _knorm_pass(False, None, None, None, 128, 8192)
    assert _knorm_pass(False, klw, None, None, 64, 16)
    assert _knorm_inline_backward(True, None, None) and not _knorm_inline_backward(True, torch.zeros(1), None)
    assert _knorm_inline_backward(True, None, pk) and not _knorm_inline_backward(True, torch.zeros(1), pk)
    assert not _knorm_inline_backward(False, None, None)


def test_torch_compile_with_the_key_norm_pass(monkeypatch):
    """``torch.compile`` (fullgraph) of ``rbf_attention`` where the key norms come from the key-bias pass (threshold
    lowered so that a small shape takes it): the custom op's fake key bias has the real one's shape, and loss and
    gradients equal eager's.  aot_eager on the CPU, Inductor on the GPU."""
    from hf_rbf import attention_distance_triton as adt

    monkeypatch.setattr(adt, "KNORM_PASS_MIN_HEAD_DIM", 0)
    gen = torch.Generator().manual_seed(12)
    t = {n: torch.randn(2, 2, 13, 16, generator=gen) for n in ("q", "k", "v")}
    t["gamma"] = torch.tensor([0.08, 0.12])

    def loss_fn(x):
        out = hf_rbf.rbf_attention(x["q"], x["k"], x["v"], gamma=x["gamma"], causal=True, backend="triton")
        return (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum()

    check_compiled_matches_eager(loss_fn, t)
    # the fake's key bias shaped as the real one's (what a compiled graph allocates and saves for the backward)
    q, k, v = (t[n].to(DEVICE) for n in ("q", "k", "v"))
    args = (q, k, v, None, None, None, t["gamma"].to(DEVICE), None, None, None, None, None,
            True, None, 0, True, False, True, False, 0.0, False)
    torch.library.opcheck(adt.distance_fwd, args, test_utils=("test_faketensor",))
    assert adt.distance_fwd(*args)[2].shape == (2, 2, 13)  # the pass ran: a key bias, not the empty placeholder


@pytest.mark.parametrize("prefix_batch", [1, 2])
def test_key_norm_pass_with_separate_prefix_keys(prefix_batch, monkeypatch):
    """Separate prefix keys (registers) on the key-bias pass's path: the pass reads their norms from the prefix
    tensor (batch-shared or per batch) and the sequence's from the keys; output and every gradient, the prefix's
    included, against the float64 naive reference of the same call (threshold lowered so that a small shape takes
    the pass)."""
    from hf_rbf import attention_distance_triton as adt

    monkeypatch.setattr(adt, "KNORM_PASS_MIN_HEAD_DIM", 0)
    passes = []
    key_bias = adt.key_bias

    def counted(*args, **kwargs):
        passes.append(args[-1] is not None)  # called with the prefix keys
        return key_bias(*args, **kwargs)

    monkeypatch.setattr(adt, "key_bias", counted)
    gen = torch.Generator().manual_seed(21 + prefix_batch)
    b, h, n, d, p = 2, 2, 19, 16, 3
    t = {
        "q": torch.randn(b, h, n, d, generator=gen),
        "k": torch.randn(b, h, n, d, generator=gen),
        "v": torch.randn(b, h, n, d, generator=gen),
        "prefix_keys": 2.0 * torch.randn(prefix_batch, h, p, d, generator=gen),  # norms unlike the sequence's
        "prefix_values": torch.randn(prefix_batch, h, p, d, generator=gen),
        "gamma": torch.tensor([0.07, 0.11]),
    }
    dout = torch.randn(b, h, n, d, generator=gen)

    def run(backend, dtype):
        leaves = {name: x.to(DEVICE, dtype).detach().requires_grad_(True) for name, x in t.items()}
        kw = {name: leaves[name] for name in ("prefix_keys", "prefix_values", "gamma")}
        out = hf_rbf.rbf_attention(leaves["q"], leaves["k"], leaves["v"], window=7, backend=backend, **kw)
        out.backward(dout.to(DEVICE, dtype))
        return out.detach(), {name: x.grad for name, x in leaves.items()}

    out, grads = run("triton", torch.float32)
    assert passes == [True]
    out_ref, grads_ref = run("naive", torch.float64)
    tol_out, tol_grad = TOL[torch.float32]
    assert rel_err(out, out_ref) <= tol_out
    for name, ref in grads_ref.items():
        assert rel_err(grads[name], ref) <= tol_grad, (name, rel_err(grads[name], ref))


TMA_CASES = {
    # name: (_make kwargs, flags); d / dv multiples of 8 keep every tile 16-byte aligned (the TMA path's condition)
    "rbf-causal": (dict(d=24, dv=16), dict(**MASKS["causal"], normalize=True, qnorm=False, knorm=True, kv_same=False,
                                          eps=0.0)),
    "rbf-window-prefix-padded-d": (dict(d=40, dv=24, nq=13, nk=21),
                                   dict(**MASKS["causal-window-prefix"], normalize=True, qnorm=False, knorm=True,
                                        kv_same=False, eps=0.0)),
    "key-bias-padding": (dict(d=24, dv=16, klw=True, pad=3), dict(**MASKS["full-window"], normalize=True, qnorm=False,
                                                                  knorm=True, kv_same=False, eps=0.0)),
    "scalar-softmax-free": (dict(d=16, dv=16, scalar=True), dict(**MASKS["full-prefix"], normalize=False, qnorm=True,
                                                                 knorm=True, kv_same=False, eps=0.0)),
}


@pytest.mark.parametrize("mode", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("name", list(TMA_CASES))
def test_tma_and_pointer_paths(name, mode, monkeypatch):
    """The forward's two ways of reading the key / value tiles (TMA descriptors, required here, and pointer loads,
    forced) against the float64 reference: key norms from the descriptor's tile or from a second load, padded head
    dims, prefix keys, windows, the key-bias vector and the scalar term."""
    from hf_rbf import kernels_flash_fwd

    monkeypatch.setattr(kernels_flash_fwd, "TMA_MODE", mode)
    used = []
    real = kernels_flash_fwd.tma_path
    monkeypatch.setattr(kernels_flash_fwd, "tma_path", lambda *a: used.append(real(*a)) or used[-1])
    make_kw, flags = TMA_CASES[name]
    for dtype in (torch.float32, torch.bfloat16):
        t, am = _make(dtype=dtype, seed=7, **make_kw)
        _check(t, am, dtype, **flags)
    assert used and all(u is mode for u in used), used


def test_tma_path_choice_and_errors(monkeypatch):
    """Automatic: TMA where every tile base is 16-byte aligned and the head dims are at most 128, pointer loads
    (logged, not an error) otherwise and always for x as key and value (GKA); required: a ValueError naming the
    reason; a bad setting names the variable."""
    from hf_rbf import kernels_flash_fwd

    k = torch.randn(1, 2, 9, 12, device=DEVICE, dtype=torch.bfloat16)  # row stride 24 bytes: not TMA-addressable
    v = torch.randn(1, 2, 9, 16, device=DEVICE, dtype=torch.bfloat16)
    assert kernels_flash_fwd.tma_path(v, v, None) is (not ON_GPU or torch.cuda.get_device_capability() >= (9, 0))
    assert kernels_flash_fwd.tma_path(k, v, None) is False
    assert kernels_flash_fwd.tma_path(v, v, None, kv_same=True) is False
    with pytest.raises(ValueError, match="x is both key and value"):
        kernels_flash_fwd.tma_path(v, v, True, kv_same=True)
    tma_gpu = not ON_GPU or torch.cuda.get_device_capability() >= (9, 0)
    d128 = torch.randn(1, 2, 9, 128, device=DEVICE, dtype=torch.bfloat16)
    assert kernels_flash_fwd.tma_path(d128, d128, None) is tma_gpu  # head dim 128: TMA measured faster
    wide = torch.randn(1, 2, 9, 256, device=DEVICE, dtype=torch.bfloat16)
    assert kernels_flash_fwd.tma_path(wide, wide, None) is False  # head dim 256: pointer loads unless required
    assert kernels_flash_fwd.tma_path(wide, wide, True) is tma_gpu
    with pytest.raises(ValueError, match=r"k has a stride of \d+ elements \(\d+ bytes\), not a multiple of 16"):
        kernels_flash_fwd.tma_path(k, v, True)
    monkeypatch.setattr(kernels_flash_fwd, "TMA_MODE", "maybe")
    with pytest.raises(ValueError, match="HF_RBF_TRITON_TMA"):
        kernels_flash_fwd.tma_path(v, v, None)


def test_tma_forward_keeps_the_128x64_four_warp_config_at_head_dim_128():
    """The forward's config pruning: at head dim 128 the pointer path drops 128 x 64 tiles on 4 warps (the query tile
    and the accumulator would spill), the TMA path keeps it for the autotuner (the probe's fastest descriptor loop)."""
    import triton

    from hf_rbf.kernels_flash_fwd import _fits

    cfg = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3)
    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    nargs = {"Q": q, "D_PAD": 128, "DV_PAD": 128}
    assert not _fits(cfg, {**nargs, "TMA": False})
    assert _fits(cfg, {**nargs, "TMA": True})
    assert _fits(cfg, {**nargs, "D_PAD": 64, "DV_PAD": 64, "TMA": False})  # head dim 64: kept on both paths


@pytest.mark.parametrize("mode", [True, False], ids=["tma", "pointer"])
def test_forward_reads_no_key_past_the_sequence(mode, monkeypatch):
    """Keys and values as views into longer buffers whose rows past the sequence hold inf and NaN: a tile that read
    past its (batch, head) slice would multiply them by zero probabilities and turn the output into NaN.  The TMA
    descriptor's shape (the slice's rows) zero-fills them; the pointer path masks them."""
    from hf_rbf import kernels_flash_fwd

    monkeypatch.setattr(kernels_flash_fwd, "TMA_MODE", mode)
    gen = torch.Generator().manual_seed(11)
    b, h, n, extra, d = 2, 3, 21, 11, 16
    bufs = []
    for fill in (float("inf"), float("nan")):
        buf = torch.full((b, h, n + extra, d), fill)
        buf[:, :, :n] = torch.randn(b, h, n, d, generator=gen)
        bufs.append(buf.to(DEVICE))
    k, v = bufs[0][:, :, :n], bufs[1][:, :, :n]
    q = torch.randn(b, h, n, d, generator=gen).to(DEVICE)
    c = torch.full((h,), 0.1, device=DEVICE)
    for causal in (True, False):
        out, lse = kernels_flash_fwd.distance_forward(
            q, k, v, None, None, None, None, c, None, causal=causal, window=None, num_prefix_keys=0, normalize=True,
            qnorm=False, kv_same=False, eps=0.0, knorm_inline=True,
        )
        s = 2 * c.view(1, -1, 1, 1) * (q @ k.transpose(-1, -2)) - c.view(1, -1, 1, 1) * k.square().sum(-1)[..., None, :]
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
        ref = torch.softmax(s.double(), -1) @ v.double()
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("form", ["tied", "untied", "scalar"])
def test_backward_op_fake_matches_the_real_outputs(form):
    """``distance_bwd``'s fake (meta) outputs have the real ones' shapes, strides and dtypes (``opcheck``'s fake-tensor
    test) for the distance form (``b`` None: one coefficient gradient ``[1, H]``), independent coefficients
    (``[2, H]``) and the scalar term.  Inductor asserts every custom op's output against its fake: a ``[2, H]`` fake
    for the distance form's ``[1, H]`` failed a compiled GKA training step on an H100
    (benchmarks/results/h100-2026-11-28b, call 3), where aot_eager on the CPU did not check it."""
    from hf_rbf import attention_distance_triton as adt

    gen = torch.Generator().manual_seed(13)
    b_, h, n, d = 2, 2, 11, 16
    q, k, v = (torch.randn(b_, h, n, d, generator=gen).to(DEVICE) for _ in range(3))
    a = torch.tensor([0.3, 0.2], device=DEVICE)
    bc = None if form == "tied" else torch.tensor([-0.1, -0.2], device=DEVICE)
    qs = ks = beta = None
    if form == "scalar":
        qs, ks = (torch.randn(b_, h, n, generator=gen).to(DEVICE) for _ in range(2))
        beta = torch.full((1, h, 1), 0.5, device=DEVICE)
    flags = (True, None, 0, True, False, form != "scalar", False, 0.0)  # causal .. eps
    out, lse, kb = adt.distance_fwd(q, k, v, qs, ks, beta, a, bc, None, None, None, None, *flags, False)
    dout = torch.randn(b_, h, n, d, generator=gen).to(DEVICE)
    args = (dout, q, k, v, qs, ks, beta, a, bc, kb, None, None, out, lse, *flags, form == "scalar", True, False, False)
    torch.library.opcheck(adt.distance_bwd, args, test_utils=("test_faketensor",))
    dab = adt.distance_bwd(*args)[4]
    assert dab.shape == (1 if form == "tied" else 2, h)
