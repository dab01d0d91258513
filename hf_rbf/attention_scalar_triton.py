"""Scalar (sort) attention on the fused Triton kernels (``backend="triton"``), as a ``torch.library`` custom op.

``S_ij = -(qs_i - ks_j)^2 / tau_i + log w_j`` with grouped values ``[B, G, Nk, Dv]``: see ``kernels_scalar_fwd.py``
(heads of a value group share a program, so each value tile is read once per group) and ``kernels_scalar_bwd.py``.
``tau`` goes to the kernels as it is, a float or a ``[B|1, H|1, Nq|1]`` tensor: they form ``beta = 1 / tau`` per
query row (IEEE division, the value torch's ``1 / tau`` gives) and the dQ kernel writes ``tau``'s gradient per row,
so a call spends no torch op on the temperature (before: a reciprocal in the forward, three elementwise ops for its
gradient, and a ``torch.full`` for a float ``tau``).

Decode: a few query rows without gradients (an exact decode step over every cached key) run through the distance
family's split-K decode kernel with the scalar term alone (:func:`_scalar_decode`): the key range is split over
programs, so one query row fills the GPU at any cache length, where this family's own forward gives each (row, group)
one program that walks every key (0.16 ms at 1K keys, 42 ms at 1M on an H200).  The sorted-window decode (binary
search in a key-sorted cache, the scalar-sort paper's O(log n + k) step) belongs to the sorted-cache data structure
(``cache_sorted_scalar.py``, ``kernels_sorted_decode.py``).

``scalar_fwd_t`` / ``scalar_bwd_t``: the same forward and backward as ``torch.library.triton_op``s (their launches
go through ``wrap_triton``, so Inductor launches the kernels from its generated code), used instead of
``scalar_fwd`` only while ``torch.compile`` traces and only with ``SCALAR_TRITON_OP`` on (``HF_RBF_SCALAR_TRITON_OP``,
default ``1``; ``0`` keeps the custom ops) and ``attention_distance_triton.TRITON_OP`` on (docs/triton_op_plan.md,
"Scalar as built").  Eager calls never go through them.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import torch
from torch import Tensor

from . import attention_distance_triton as _adt
from .attention_distance_triton import DECODE_MAX_QUERIES, distance_attention
from .attention_utils import MaskArgs, constant_vector, tensors_keepable
from .kernels_common import HAS_TRITON, key_bias, triton_unavailable_reason
from .kernels_launch import parse_switch
from .kernels_scalar_bwd import scalar_backward
from .kernels_scalar_fwd import scalar_forward

_NS = (
    "hf_rbf"
    if __name__ == "hf_rbf.attention_scalar_triton"
    else "hf_rbf_" + hashlib.sha1(__name__.encode()).hexdigest()[:12]
)

# While torch.compile traces: the scalar family through the triton_ops ``scalar_fwd_t`` / ``scalar_bwd_t`` (True)
# (the default) instead of the custom ops ``scalar_fwd`` / ``scalar_bwd`` (False, ``HF_RBF_SCALAR_TRITON_OP=0``), as
# the distance op's forms do with ``attention_distance_triton.TRITON_OP``; both flags must be on
# (:func:`use_scalar_triton_op`).  On by default since GPU session 25 (2026-11-28, H200): the GPU tests passed (14 of
# 14) and compiled scalar_sort (1 register) trained at 1.22x Llama at d256 (custom ops 0.85x) and 1.28x at d768
# (1.04x) in the same processes (benchmarks/results/h200x2-2026-11-28f/README.md).  Read when dynamo traces
# :func:`scalar_attention_triton` (guarded: a change recompiles).
SCALAR_TRITON_OP = parse_switch(os.environ.get("HF_RBF_SCALAR_TRITON_OP", "1"))


def _forward_impl(
    qs, ks, v, tau, tau_value, key_log_weights, attention_mask, causal, window, num_prefix_keys, traced=False
):
    """The key-bias pass and the forward kernel: ``(out, lse, kb | None)``.  ``traced``: called from the triton_op
    ``scalar_fwd_t`` while it is traced (the launches go through ``wrap_triton``)."""
    bsz, heads, nq = qs.shape
    nk = ks.shape[2]
    kb, _ = key_bias(None, None, key_log_weights, attention_mask, heads, nk, bsz, False, traced=traced)
    out, lse = scalar_forward(
        qs,
        ks,
        v,
        kb,
        tau_value if tau is None else tau,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        traced=traced,
    )
    return out, lse, kb


@torch.library.custom_op(f"{_NS}::scalar_fwd", mutates_args=())
def scalar_fwd(
    qs: Tensor,
    ks: Tensor,
    v: Tensor,
    tau: Optional[Tensor],
    tau_value: float,
    key_log_weights: Optional[Tensor],
    attention_mask: Optional[Tensor],
    causal: bool,
    window: Optional[int],
    num_prefix_keys: int,
) -> tuple[Tensor, Tensor, Tensor]:
    out, lse, kb = _forward_impl(
        qs, ks, v, tau, tau_value, key_log_weights, attention_mask, causal, window, num_prefix_keys
    )
    if kb is None:
        kb = torch.empty(0, device=v.device, dtype=torch.float32)
    return out, lse, kb


@scalar_fwd.register_fake
def _(qs, ks, v, tau, tau_value, key_log_weights, attention_mask, causal, window, num_prefix_keys):
    bsz, heads, nq = qs.shape
    nk = ks.shape[2]
    has_kb = key_log_weights is not None or attention_mask is not None
    return (
        v.new_empty(bsz, heads, nq, v.shape[3]),
        v.new_empty((bsz, heads, nq), dtype=torch.float32),
        v.new_empty((bsz, heads, nk) if has_kb else (0,), dtype=torch.float32),
    )


@torch.library.custom_op(f"{_NS}::scalar_bwd", mutates_args=())
def scalar_bwd(
    dout: Tensor,
    qs: Tensor,
    ks: Tensor,
    v: Tensor,
    tau: Optional[Tensor],
    tau_value: float,
    kb: Tensor,
    lse: Tensor,
    causal: bool,
    window: Optional[int],
    num_prefix_keys: int,
    need_dtau: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _backward_impl(dout, qs, ks, v, tau, tau_value, kb, lse, causal, window, num_prefix_keys, need_dtau)
    return _backward_outputs(grads, v)


def _backward_outputs(grads, v):
    """An op returns tensors: empty ones stand for the gradients that were not asked for (``scalar_bwd`` and
    ``scalar_bwd_t``)."""
    return tuple(torch.empty(0, device=v.device, dtype=torch.float32) if g is None else g for g in grads)


def _backward_impl(
    dout, qs, ks, v, tau, tau_value, kb, lse, causal, window, num_prefix_keys, need_dtau, traced=False
):
    """The backward kernels: ``(dqs, dks, dv, dkb | None, dtau | None)`` (``kb``: None or, from the op, an empty
    tensor for none)."""
    return scalar_backward(
        dout,
        qs,
        ks,
        v,
        kb if kb is not None and kb.numel() else None,
        tau_value if tau is None else tau,
        lse,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        need_dtau=need_dtau,
        traced=traced,
    )


@scalar_bwd.register_fake
def _(dout, qs, ks, v, tau, tau_value, kb, lse, causal, window, num_prefix_keys, need_dtau):
    bsz, heads, nq = qs.shape
    nk = ks.shape[2]
    f32 = dict(dtype=torch.float32)
    return (
        qs.new_empty((bsz, heads, nq)),
        ks.new_empty((bsz, heads, nk)),
        torch.empty_like(v),
        qs.new_empty((bsz, heads, nk) if kb.numel() else (0,), **f32),
        qs.new_empty((bsz, heads, nq) if need_dtau else (0,), **f32),
    )


def _save(ctx, inputs, lse, kb):
    qs, ks, v, tau, tau_value, klw, _am, causal, window, num_prefix_keys = inputs
    # the backward needs no output (exact delta in-kernel); tau may be None (a float temperature)
    ctx.save_for_backward(qs, ks, v, tau, lse, kb)
    ctx.flags = (tau_value, causal, window, num_prefix_keys)
    ctx.klw_shape = None if klw is None else tuple(klw.shape)
    ctx.klw_dtype = None if klw is None else klw.dtype


def _setup_context(ctx, inputs, output):
    out, lse, kb = output
    _save(ctx, inputs, lse, kb)
    ctx.mark_non_differentiable(lse, kb)


def _reduce_to(grad: Tensor, shape) -> Tensor:
    dims = [i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _gradients(ctx, dout, run_backward):
    """Input gradients from the backward kernels; ``run_backward`` is ``scalar_bwd`` (the op, traced under
    ``torch.compile``) or ``_backward_impl`` (eager, :class:`_ScalarFunction`).  The kernels write ``dqs`` / ``dks``
    in the inputs' dtypes and ``dtau`` per row (``-beta^2 dbeta``): what is left here is the sum over ``tau``'s
    broadcast dims (none for a per-token ``tau``) and over the key log-weights'."""
    qs, ks, v, tau, lse, kb = ctx.saved_tensors
    tau_value, causal, window, num_prefix_keys = ctx.flags
    need_qs, need_ks, need_v, need_tau, _, need_klw = ctx.needs_input_grad[:6]
    dqs, dks, dv, dkb, dtau = run_backward(
        dout, qs, ks, v, tau, tau_value, kb, lse, causal, window, num_prefix_keys, bool(need_tau)
    )
    return (
        dqs if need_qs else None,
        dks if need_ks else None,
        dv if need_v else None,
        _reduce_to(dtau, tuple(tau.shape)).to(tau.dtype) if need_tau else None,
        None,
        _reduce_to(dkb, ctx.klw_shape).to(ctx.klw_dtype) if need_klw else None,
        None,
        None,
        None,
        None,
    )


def _backward(ctx, dout, _dlse, _dkb):
    return _gradients(ctx, dout, scalar_bwd)


scalar_fwd.register_autograd(_backward, setup_context=_setup_context)


_wrapping_triton = _adt._wrapping_triton  # torch._library.triton.is_wrap_triton_enabled, or None


if HAS_TRITON and _wrapping_triton is not None:

    @torch.library.triton_op(f"{_NS}::scalar_fwd_t", mutates_args=())
    def scalar_fwd_t(
        qs: Tensor,
        ks: Tensor,
        v: Tensor,
        tau: Optional[Tensor],
        tau_value: float,
        key_log_weights: Optional[Tensor],
        attention_mask: Optional[Tensor],
        causal: bool,
        window: Optional[int],
        num_prefix_keys: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``scalar_fwd`` as a triton_op (see ``SCALAR_TRITON_OP``)."""
        out, lse, kb = _forward_impl(
            qs,
            ks,
            v,
            tau,
            tau_value,
            key_log_weights,
            attention_mask,
            causal,
            window,
            num_prefix_keys,
            _wrapping_triton(),
        )
        kb = torch.empty(0, device=v.device, dtype=torch.float32) if kb is None else kb
        return out, lse, kb

    @torch.library.triton_op(f"{_NS}::scalar_bwd_t", mutates_args=())
    def scalar_bwd_t(
        dout: Tensor,
        qs: Tensor,
        ks: Tensor,
        v: Tensor,
        tau: Optional[Tensor],
        tau_value: float,
        kb: Tensor,
        lse: Tensor,
        causal: bool,
        window: Optional[int],
        num_prefix_keys: int,
        need_dtau: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``scalar_bwd`` as a triton_op."""
        grads = _backward_impl(
            dout,
            qs,
            ks,
            v,
            tau,
            tau_value,
            kb,
            lse,
            causal,
            window,
            num_prefix_keys,
            need_dtau,
            _wrapping_triton(),
        )
        return _backward_outputs(grads, v)

    def _backward_t(ctx, dout, _dlse, _dkb):
        return _gradients(ctx, dout, scalar_bwd_t)

    scalar_fwd_t.register_autograd(_backward_t, setup_context=_setup_context)


def use_scalar_triton_op() -> bool:
    """Whether :func:`scalar_attention_triton`, traced by torch.compile, calls the triton_op ``scalar_fwd_t``:
    ``SCALAR_TRITON_OP`` and ``attention_distance_triton.TRITON_OP`` on, kernels that are not interpreted
    (``attention_distance_triton.use_triton_op``)."""
    if not isinstance(SCALAR_TRITON_OP, bool):
        raise ValueError(
            "HF_RBF_SCALAR_TRITON_OP (attention_scalar_triton.SCALAR_TRITON_OP) must be 0/1, true/false, on/off; "
            f"got {SCALAR_TRITON_OP!r}"
        )
    return SCALAR_TRITON_OP and _adt.use_triton_op() and _wrapping_triton is not None


class _ScalarFunction(torch.autograd.Function):
    """``scalar_fwd`` with its gradients for eager mode, without the custom op's dispatch (see
    ``attention_distance_triton._DistanceFunction`` for the measurement that motivated it)."""

    @staticmethod
    def forward(ctx, *args):
        out, lse, kb = _forward_impl(*args)
        _save(ctx, args, lse, kb)
        return out

    @staticmethod
    def backward(ctx, dout):
        return _gradients(ctx, dout, _backward_impl)


# The split-K decode kernel's vector part for the scalar family: a zero row of this width (the kernels' smallest
# padded head dim), broadcast with stride 0 over every query and key, so its product is 0 and only the scalar term
# scores (one 16-wide tensor-core product per key tile, nothing read from memory but one row).
_ZERO_VECTOR_DIM = 16


# stride-0 views of the zero row by (shape, dtype, device): a decode step's query and prefix views have the same
# shape at every step (the key view's length grows), so each is one view made once, not an op per layer and step
_ZERO_ROWS: dict = {}


def _zero_rows(zero: Tensor, shape: tuple) -> Tensor:
    """``zero.expand(shape)`` (``zero``: a cached constant row of :func:`constant_vector`), kept per shape."""
    if torch.compiler.is_compiling() or not tensors_keepable(zero.device):
        return zero.expand(shape)
    key = (shape, zero.dtype, zero.device)
    view = _ZERO_ROWS.get(key)
    if view is None or view._base is not zero:  # (a cleared constant store made a new row)
        if len(_ZERO_ROWS) >= 256:
            _ZERO_ROWS.clear()
        view = _ZERO_ROWS[key] = zero.expand(shape)
    return view


def _scalar_decode(qs, ks, v, tau, mask: MaskArgs, prefix_values=None) -> torch.Tensor:
    """A few query rows without gradients: the distance family's split-K decode kernel with the scalar term alone
    (``-(qs - ks)^2 / tau`` plus the key log-weights and padding, grouped values read in place), a zero
    dot-product coefficient and zero vector keys; ``prefix_values`` ``[B|1, G, R, Dv]`` read in place too."""
    b, h, nq = qs.shape
    groups, nk = v.shape[1], v.shape[2]
    zero = constant_vector(0.0, (_ZERO_VECTOR_DIM,), v.device, v.dtype)
    q = _zero_rows(zero, (b, h, nq, _ZERO_VECTOR_DIM))
    k = zero.expand(b, groups, nk, _ZERO_VECTOR_DIM)
    prefix = None
    if prefix_values is not None:
        prefix = (_zero_rows(zero, (1, groups, prefix_values.shape[2], _ZERO_VECTOR_DIM)), prefix_values)
    a = constant_vector(0.0, (h,), v.device)
    # tau as it is: the kernel takes 1 / tau per row (tau_in), as the hybrid family's call does
    tau_t = tau if isinstance(tau, torch.Tensor) else constant_vector(float(tau), (1, 1, 1), v.device)
    # (the prefix: zero keys made here, values validated by scalar_attention's _check_prefix_values)
    return distance_attention(
        q, k, v, qs, ks, tau_t, a, a, mask, normalize=True, qnorm=False, knorm=False, kv_same=False, eps=0.0,
        prefix=prefix, tau_in=True, prefix_checked=True,
    )  # fmt: skip


def _needs_grad(qs, ks, v, tau, mask: MaskArgs, prefix_values=None) -> bool:
    if not torch.is_grad_enabled():
        return False
    differentiable = (qs, ks, v, tau if isinstance(tau, torch.Tensor) else None, mask.key_log_weights, prefix_values)
    return any(t is not None and t.requires_grad for t in differentiable)


def scalar_attention_triton(qs, ks, v, tau, mask: MaskArgs, prefix_values=None) -> torch.Tensor:
    """Fused scalar attention; same arguments and result as ``scalar_attention_naive``.

    ``tau`` goes to the kernels as it is (a float, or a ``[B|1, H|1, Nq|1]`` tensor read through its strides): they
    take ``beta = 1 / tau`` and return ``tau``'s gradient, so a call spends no torch op on the temperature.  Up to
    ``DECODE_MAX_QUERIES`` query rows without gradients take the split-K decode kernel (:func:`_scalar_decode`),
    which reads separate ``prefix_values`` (see :func:`hf_rbf.scalar_attention`) in place; the training kernels take
    them concatenated in front of ``v``.
    """
    v = v if v.stride(-1) == 1 else v.contiguous()
    needs_grad = _needs_grad(qs, ks, v, tau, mask, prefix_values)
    if mask.nq <= DECODE_MAX_QUERIES and not needs_grad:
        return _scalar_decode(qs, ks, v, tau, mask, prefix_values)
    if prefix_values is not None:
        v = torch.cat([prefix_values.expand(v.shape[0], -1, -1, -1), v], dim=2)
    tau_t = tau if isinstance(tau, torch.Tensor) else None
    tau_value = 1.0 if tau_t is not None else float(tau)
    args = (
        qs,
        ks,
        v,
        tau_t,
        tau_value,
        mask.key_log_weights,
        mask.attention_mask,
        mask.causal,
        mask.window,
        mask.num_prefix_keys,
    )
    if torch.compiler.is_compiling():
        if use_scalar_triton_op():
            return scalar_fwd_t(*args)[0]
        return scalar_fwd(*args)[0]
    if needs_grad:
        return _ScalarFunction.apply(*args)
    return _forward_impl(*args)[0]


def scalar_triton_reason(qs, ks, v, tau, mask) -> str | None:
    """None when ``scalar_attention_triton`` can serve the call, else why not."""
    return triton_unavailable_reason(v.device, v.dtype, (("value dim Dv", v.shape[-1]),))
