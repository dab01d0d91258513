"""Shared helpers of the attention tests.

* float64 references of the four families written from the formulas, independently of ``hf_rbf`` (explicit
  pairwise differences, the mask built by Python loops over positions);
* :func:`check_backend`: one backend against the float64 reference, outputs and gradients, with the tolerance
  rule of the project (:func:`assert_within_rule`).

The tolerance rule.  The float64 reference sees the float64 "master" inputs; naive and the backend see them rounded
to the dtype.  A backend's relative error ``||got - ref64|| / ||ref64||`` may be at most ``FACTOR`` times the error
of the naive reference run on the same rounded inputs, or a floor, whichever is larger::

    err(backend) <= max(FACTOR * err(naive), FLOOR[dtype])          outputs
    err(backend) <= max(FACTOR * err(naive), GRAD_FLOOR[dtype])     gradients

The floors are multiples of the dtype's unit roundoff ``u`` (2^-8 for bfloat16, 2^-11 for float16).  Outputs get
about ``u``.  Gradients in half precision get ``64 u``: a flash-style backward (SDPA's and flex's) forms
``delta_i = sum_d dO_id O_id`` from the output *rounded to the dtype*, so every ``dS_ij`` carries an error of about
``u P_ij |dO_i| |O_i|`` that does not cancel where ``sum_j P_ij ds_ij/dtheta`` is large (queries far from the keys
they attend, per-head temperatures summed over rows); the naive reference works in float32 inside and has no such
term.  float32 gets ``5e-5`` for both: the padding trick expands ``(a - b)^2`` into terms that cancel in float32
accumulation (about ``1e-5`` at 30-fold input norms).  The gradient of a per-head parameter (gamma, log_sigma, scale,
tau per head) is a sum over all query rows; its error is measured against the norm of the per-row terms
(:func:`per_row_scales`) when that is larger than the sum, since a sum of rounded terms is accurate relative to its
terms, not to what is left after they cancel.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch


# ----------------------------------------------------------------------------------------------------------------
# the tolerance rule
# ----------------------------------------------------------------------------------------------------------------

FACTOR = 3.0
FLOOR = {torch.float64: 1e-10, torch.float32: 5e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
GRAD_FLOOR = {torch.float64: 1e-10, torch.float32: 5e-5, torch.bfloat16: 64 * 2.0**-8, torch.float16: 64 * 2.0**-11}
LOW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def autograd_node_names(grad_fn) -> list[str]:
    """The class names of ``grad_fn`` and every autograd node behind it (each node once)."""
    seen, names, stack = set(), [], [grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def rel_err(got: torch.Tensor, ref: torch.Tensor, scale: float | None = None) -> float:
    """``||got - ref|| / max(||ref||, scale)`` in float64 (the plain difference norm when both are zero)."""
    got, ref = got.double(), ref.double()
    denom = max(ref.norm().item(), scale or 0.0)
    return ((got - ref).norm() / (denom if denom > 0 else 1.0)).item()


def assert_within_rule(what: str, got, naive, ref, dtype, *, gradient: bool = False, scale=None) -> None:
    """The tolerance rule of the module docstring (and ``got`` finite).

    ``scale``: for the gradient of a per-head parameter (a sum over all query rows), the norm of the per-row
    contributions; errors are measured against it when the sum cancels (a sum of terms computed to precision
    ``u`` is accurate to ``u`` times the terms, not times the sum).
    """
    assert got is not None and ref is not None, f"{what}: missing gradient"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = rel_err(got, ref, scale)
    base = rel_err(naive, ref, scale) if naive is not None else 0.0
    limit = max(FACTOR * base, (GRAD_FLOOR if gradient else FLOOR)[dtype])
    assert err <= limit, f"{what}: relative error {err:.3e} > {limit:.3e} (naive in {dtype}: {base:.3e})"


# ----------------------------------------------------------------------------------------------------------------
# mask semantics, written out position by position
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _positions(nq: int, nk: int, causal: bool, window, prefix: int) -> torch.Tensor:
    allowed = torch.zeros(nq, nk, dtype=torch.bool)
    n_seq = nk - prefix
    for i in range(nq):
        t = n_seq - nq + i  # queries are the last nq positions
        for j in range(nk):
            if j < prefix:
                allowed[i, j] = True
                continue
            s = j - prefix
            if causal:
                ok = s <= t and (window is None or t - s < window)
            else:
                ok = window is None or abs(t - s) < window
            allowed[i, j] = ok
    return allowed


def allowed_ref(batch, nq, nk, causal, window, prefix, attention_mask) -> torch.Tensor:
    """Bool ``[B, 1, Nq, Nk]`` from the definition in the design notes."""
    allowed = _positions(nq, nk, causal, window, prefix).clone().expand(batch, nq, nk).clone()
    if attention_mask is not None:
        for b in range(batch):
            for j in range(nk):
                if attention_mask[b if attention_mask.shape[0] > 1 else 0, j] == 0:
                    allowed[b, :, j] = False
    return allowed[:, None]


def kernel_average_ref(scores, allowed, values, *, normalize=True, eps=0.0):
    """``sum_j w_ij v_j`` over allowed keys with finite score; ``w = exp(s) / (sum exp(s) + eps)`` or ``exp(s)``.

    Rows without such a key give zeros.  float64, differentiable without NaN (masked entries go through where).
    """
    allowed = allowed.expand(scores.shape)
    live = allowed & (scores > float("-inf"))
    safe = torch.where(live, scores, torch.zeros_like(scores))
    if not normalize:
        return torch.where(live, torch.exp(safe), torch.zeros_like(safe)) @ values
    m = torch.where(live, scores, torch.full_like(scores, float("-inf"))).amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.where(live, torch.exp(safe - m), torch.zeros_like(safe))
    denom = w.sum(-1, keepdim=True) + eps * torch.exp(-m)
    w = w / torch.where(denom > 0, denom, torch.ones_like(denom))
    return w @ values


def _klw4(klw):
    """``[B|1, Nk]`` or ``[B|1, H|1, Nk]`` -> ``[B|1, H|1, 1, Nk]``."""
    if klw is None:
        return 0.0
    if klw.dim() == 2:
        klw = klw[:, None]
    return klw[:, :, None, :]


def _sq_dist(a, b):
    """``||a_i - b_j||^2`` by explicit differences: ``[B, H, Nq, D]``, ``[B, H, Nk, D]`` -> ``[B, H, Nq, Nk]``."""
    diff = a[:, :, :, None, :] - b[:, :, None, :, :]
    return (diff * diff).sum(-1)


def _per_head(p, heads):
    if isinstance(p, torch.Tensor):
        return p.reshape(1, heads, 1, 1) if p.dim() <= 1 else p
    return p


def _per_query(tau, heads):
    """tau as ``[B|1, H|1, Nq|1, 1]`` (a 1-D tensor is per head)."""
    if not isinstance(tau, torch.Tensor):
        return tau
    if tau.dim() <= 1:
        return tau.reshape(1, -1, 1, 1).expand(1, heads, 1, 1)
    while tau.dim() < 3:
        tau = tau[None]
    return tau[..., None]


def expand_groups_ref(v, heads):
    """``[B, G, N, Dv]`` -> ``[B, H, N, Dv]``, head ``h`` reading group ``h // (H // G)``."""
    per = heads // v.shape[1]
    return torch.stack([v[:, h // per] for h in range(heads)], dim=1)


def _mask_args(q_like, nk, kw):
    b, _, nq = q_like.shape[:3]
    return allowed_ref(
        b, nq, nk, kw.get("causal", True), kw.get("window"), kw.get("num_prefix_keys", 0), kw.get("attention_mask")
    )


def rbf_ref(q, k, v, *, gamma=None, key_log_weights=None, normalize=True, **kw):
    h, d = q.shape[1], q.shape[-1]
    g = _per_head(1.0 / math.sqrt(d) if gamma is None else gamma, h)
    scores = -g * _sq_dist(q, k) + _klw4(key_log_weights)
    return kernel_average_ref(scores, _mask_args(q, k.shape[2], kw), v, normalize=normalize)


def gka_ref(x, log_sigma, *, query=None, key_log_weights=None, eps=1e-6, **kw):
    h = x.shape[1]
    query = x if query is None else query
    ls = _per_head(log_sigma, h)
    inv_two_var = 0.5 * (torch.exp(-2.0 * ls) if isinstance(ls, torch.Tensor) else math.exp(-2.0 * ls))
    scores = -_sq_dist(query, x) * inv_two_var + _klw4(key_log_weights)
    return kernel_average_ref(scores, _mask_args(query, x.shape[2], kw), x, eps=eps)


def _scalar_part(qs, ks, tau, heads):
    diff = qs[..., :, None] - ks[..., None, :]
    return -(diff * diff) / _per_query(tau, heads)


def scalar_ref(qs, ks, v, tau, *, key_log_weights=None, **kw):
    h = qs.shape[1]
    scores = _scalar_part(qs, ks, tau, h) + _klw4(key_log_weights)
    return kernel_average_ref(scores, _mask_args(qs[..., None], ks.shape[2], kw), expand_groups_ref(v, h))


def hybrid_ref(q, k, v, qs, ks, tau, *, scale=None, key_log_weights=None, **kw):
    h, d = q.shape[1], q.shape[-1]
    s = _per_head(1.0 / math.sqrt(d) if scale is None else scale, h)
    dots = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)
    scores = s * dots + _scalar_part(qs, ks, tau, h) + _klw4(key_log_weights)
    return kernel_average_ref(scores, _mask_args(q, k.shape[2], kw), expand_groups_ref(v, h))


# ----------------------------------------------------------------------------------------------------------------
# running a backend against the reference
# ----------------------------------------------------------------------------------------------------------------


def backend_params(cases: dict, flex_half_cases: tuple, serves=lambda backend, dtype, case: True) -> list:
    """``(backend, dtype, case name)`` parameters: sdpa on every case and dtype; flex on every case in float32 and on
    ``flex_half_cases`` in half precision (on CPU flex runs torch's eager emulation, slow enough to ration; those
    cases carry what flex does differently per dtype: the LSE factors, extreme log-weights, padding)."""
    params = []
    for backend in ("sdpa", "flex"):
        for dtype in LOW_DTYPES:
            for name, case in cases.items():
                if backend == "flex" and dtype != torch.float32 and name not in flex_half_cases:
                    continue
                if serves(backend, dtype, case):
                    params.append(pytest.param(backend, dtype, name, id=f"{backend}-{str(dtype)[6:]}-{name}"))
    return params


def run_with_grads(fn, inputs: dict, kwargs: dict, upstream: torch.Tensor | None):
    """``fn(**inputs, **kwargs)`` and the gradients of ``sum(out * upstream)`` w.r.t. every tensor in ``inputs``."""
    leaves = {
        n: t.detach().clone().requires_grad_(upstream is not None) if isinstance(t, torch.Tensor) else t
        for n, t in inputs.items()
    }
    out = fn(**leaves, **kwargs)
    if upstream is None:
        return out.detach(), {}
    names = [n for n, t in leaves.items() if isinstance(t, torch.Tensor)]
    grads = torch.autograd.grad((out.double() * upstream).sum(), [leaves[n] for n in names], allow_unused=True)
    # an input the output does not depend on (e.g. q and k when the hybrid scale is the float 0) has zero gradient
    grads = [torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads)]
    return out.detach(), dict(zip(names, grads))


def cast_inputs(inputs: dict, dtype) -> dict:
    return {n: t.to(dtype) if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def cast_kwargs(kwargs: dict, device) -> dict:
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in kwargs.items()}


def check_backend(
    ref_fn, lib_fn, inputs64: dict, kwargs: dict, backend: str, dtype, *, grads="rule", seed=0, device="cpu"
):
    """Backend ``backend`` of ``lib_fn`` against ``ref_fn`` (float64, CPU): the output and every input gradient.

    ``inputs64``: the differentiable inputs by keyword (float64 tensors, or floats); ``kwargs``: the rest.
    ``grads``: "rule" (gradients within the tolerance rule), "finite" (gradients only free of Inf/NaN) or None
    (no backward).  Returns the backend's output (on CPU).
    """
    ref_out, _ = run_with_grads(ref_fn, inputs64, kwargs, None)
    gen = torch.Generator().manual_seed(seed + 1234)
    upstream = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64) if grads else None
    ref_out, ref_grads = run_with_grads(ref_fn, inputs64, kwargs, upstream)
    low = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in cast_inputs(inputs64, dtype).items()}
    kw = cast_kwargs(kwargs, device)
    up = None if upstream is None else upstream.to(device)
    naive_out, naive_grads = run_with_grads(functools.partial(lib_fn, backend="naive"), low, kw, up)
    out, out_grads = run_with_grads(functools.partial(lib_fn, backend=backend), low, kw, up)
    assert out.dtype == dtype and out.shape == ref_out.shape
    out, naive_out = out.cpu(), naive_out.cpu()
    assert_within_rule(f"{backend} output ({dtype})", out, naive_out, ref_out, dtype)
    if grads == "finite":
        for name, g in out_grads.items():
            assert torch.isfinite(g).all(), f"{backend} d/d{name} ({dtype}): non-finite values"
    elif grads:
        scales = per_row_scales(ref_fn, inputs64, kwargs, upstream, ref_out.shape)
        for name, ref_g in ref_grads.items():
            assert_within_rule(
                f"{backend} d/d{name} ({dtype})",
                out_grads[name].cpu(),
                naive_grads[name].cpu(),
                ref_g,
                dtype,
                gradient=True,
                scale=scales.get(name),
            )
    return out


PER_HEAD_PARAMS = ("gamma", "log_sigma", "scale", "tau")


def per_row_scales(ref_fn, inputs64: dict, kwargs: dict, upstream, out_shape) -> dict:
    """For each per-head parameter ``[H]``: the norm of its gradient's per-row contributions (float64 reference).

    The reference is run with the parameter expanded to one copy per query row (``[B, H, Nq]`` for tau,
    ``[B, H, Nq, 1]`` for the others, which the references broadcast); the gradient of that copy holds the
    per-row terms whose sum is the parameter's gradient.
    """
    b, h, nq = out_shape[:3]
    scales = {}
    for name in PER_HEAD_PARAMS:
        t = inputs64.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            continue
        expanded = t.reshape(1, h, 1).expand(b, h, nq) if name == "tau" else t.reshape(1, h, 1, 1).expand(b, h, nq, 1)
        _, grads = run_with_grads(ref_fn, {**inputs64, name: expanded.clone()}, kwargs, upstream)
        scales[name] = grads[name].norm().item()
    return scales


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Let the flex backend run its backward on CPU, through flex's own autograd function (eager math backward).

    torch's public frontend refuses CPU inputs that require grad, and so does our ``_candidates`` (on CPU that is
    the truth for users).  The tests still want to see that our wiring around flex (captured biases, the LSE
    factors of eps and normalize=False) has the right gradients, so this fixture lifts both refusals.
    """
    import hf_rbf.attention_gka as gka
    import hf_rbf.attention_hybrid as hybrid
    import hf_rbf.attention_rbf as rbf
    import hf_rbf.attention_scalar as scalar
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    for module, name in (
        (rbf, "rbf_flex_reason"),
        (gka, "gka_flex_reason"),
        (scalar, "scalar_flex_reason"),
        (hybrid, "hybrid_flex_reason"),
    ):
        monkeypatch.setattr(module, name, lambda *args, **kwargs: None)


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def rand(*shape, seed: int, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(*shape, generator=gen, dtype=torch.float64)


def padding_mask(batch: int, nk: int, seed: int, prefix: int = 0) -> torch.Tensor:
    """``[B, Nk]`` padding mask: batch row 0 fully padded, the others with a random left padding of the sequence
    keys (the ``prefix`` keys, registers in the models, stay real)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, nk, dtype=torch.long)
    mask[0] = 0
    n_seq = nk - prefix
    for b in range(1, batch):
        pad = int(torch.randint(0, max(n_seq // 2, 1) + 1, (1,), generator=gen))
        mask[b, prefix : prefix + pad] = 0
    return mask


def extreme_log_weights(batch: int, heads: int, nk: int, seed: int) -> torch.Tensor:
    """``[B, H, Nk]`` log-weights with ``-inf`` and ``-1e9`` entries; batch 1, head 0 has only ``-inf``.

    Key 0 stays ordinary so that every causal row keeps one ordinary key (a row whose keys are all ``-1e9`` has
    no defined answer in finite precision).
    """
    klw = randn(batch, heads, nk, seed=seed, scale=0.5)
    if nk > 1:
        klw[:, :, 1] = float("-inf")
    if nk > 2:
        klw[:, :, 2] = -1e9
    if batch > 1:
        klw[1, 0, :] = float("-inf")
    return klw
