"""The fused distance-attention kernels (RBF, GKA, hybrid) as ``torch.library`` custom ops with autograd.

All three families are one score (natural-log units)

    S_ij = a_h q_i.k_j + b_h (||q_i||^2 [qnorm] + ||k_j||^2 [knorm]) - beta_i (qs_i - ks_j)^2 [scalar] + log w_j

with ``a``/``b`` per-head tensors: RBF ``a = 2 gamma, b = -gamma`` (the softmax drops ``||q||^2``), GKA
``a = 1/sigma^2, b = -1/(2 sigma^2)`` with ``x`` as query, key and value, hybrid ``a = scale, b = 0`` plus the scalar
term with ``beta = 1/tau``.  ``b = None`` is the distance form ``a = 2 c, b = -c`` (RBF ``c = gamma``, GKA
``c = 1/(2 sigma^2)``): ``a`` then holds ``c``, the kernels derive both coefficients and reduce the gradient of ``c``
themselves, so no torch op per call builds them or sums their gradients.  The family adapters (the "triton" sections
of ``attention_<family>.py``) build ``a``, ``b`` and ``beta`` from their parameters with ordinary differentiable torch
ops, so autograd chains the op's gradients into ``gamma``, ``log_sigma``, ``scale`` and ``tau``.

Ops (registered under a namespace unique to this module's import name, so that a checkpoint's remote-code copy can
be imported next to the installed package):

* ``distance_fwd``: the flash forward; returns ``(out, lse, kb)`` (``kb``: the key bias of the key log-weights and
  padding, with the key norms folded in, kept for the backward; an empty tensor when there are neither: then the
  kernels compute the key norms from the key tiles they load anyway, and no key-bias pass runs).
* ``distance_bwd``: its gradients (see ``kernels_flash_bwd.distance_backward``).
* ``distance_decode``: the split-K forward for a few query rows (a decode step), no autograd; used by
  :func:`distance_attention` when at most ``DECODE_MAX_QUERIES`` rows are asked for and no gradient is needed.

Each has a fake (meta) implementation, so ``torch.compile`` traces through them.

``distance_fwd_t`` / ``distance_bwd_t``: the same forward and backward as ``torch.library.triton_op``s, used instead
of ``distance_fwd`` only while ``torch.compile`` traces, for all three forms (RBF, GKA, hybrid), and only
with ``TRITON_OP`` on (``HF_RBF_TRITON_OP``, default ``1``; ``0`` keeps the custom ops).  AOTAutograd then decomposes them into their kernel
launches (``triton_kernel_wrapper_functional``) and Inductor launches the kernels from its generated code, instead
of calling this module's Python at every step (docs/triton_op_plan.md, step 0).  Eager calls never go through them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Optional

import torch
from torch import Tensor

from .attention_utils import MaskArgs, is_all_true_mask
from .kernels_common import DEFINED_INTERPRETED, HAS_TRITON, key_bias, triton_unavailable_reason
from .kernels_flash_bwd import distance_backward
from .kernels_flash_fwd import distance_decode, distance_forward
from .kernels_launch import parse_switch

_NS = (
    "hf_rbf"
    if __name__ == "hf_rbf.attention_distance_triton"
    else "hf_rbf_" + hashlib.sha1(__name__.encode()).hexdigest()[:12]
)

logger = logging.getLogger(__name__)

# Up to this many query rows without gradients go through the split-K decode kernel.
DECODE_MAX_QUERIES = 16

# While torch.compile traces: the RBF, GKA and hybrid forms through the triton_ops ``distance_fwd_t`` /
# ``distance_bwd_t`` (True, the default since 2026-11-28) instead of the custom ops ``distance_fwd`` /
# ``distance_bwd`` (False: ``HF_RBF_TRITON_OP=0``), whose Python ran at every call inside the compiled graph.  On an
# H200, compiled training steps with it against without (one process each, x Llama's tokens/s): d256 rbf 0.88x ->
# 1.12x, rbf with a register and SuSiE 0.84x -> 1.15x, GKA 0.97x -> 1.09x, hybrid_sort 0.54x -> 0.66x; d768
# hybrid_sort 0.88x -> 0.92x (benchmarks/results/h200x2-2026-11-28d and -28e); its GPU tests, the graphed register
# steps and their FSDP2 tests pass with it.  Read by :func:`distance_attention` when it is traced (dynamo guards on
# the value: a model compiled with one value recompiles if it later runs with the other), so a benchmark can set it
# per model (benchmarks/profile_training.py's "..., triton_op)" and "..., custom op)" variants).  Not used where the
# kernels run in Triton's CPU interpreter, which cannot trace a triton_op (a warning once if HF_RBF_TRITON_OP asked
# for it).
TRITON_OP = parse_switch(os.environ.get("HF_RBF_TRITON_OP", "1"))
TRITON_OP_REQUESTED = "HF_RBF_TRITON_OP" in os.environ
_TRITON_OP_IGNORED_LOGGED: list = []


# Where the key norms come from a key-bias pass instead of the key tiles (``_knorm_inline``): from this head dim, or
# from this many keys.  The kernels read the norms of each key tile through a second load of the tile (see
# ``kernels_common._row_sq_norms``), once per query block; the pass reads the keys once and the loops then load one
# fp32 value per key.  On an H100 (``benchmarks/probe_forward_variants.py``, benchmarks/results/h100-2026-11-27l,
# call 3; causal bf16 forward, 32k tokens, H16) the pass plus the forward took 0.97-0.85x the inline forward's time
# at head dim 128 (every N from 512 to 8192) and at N 4096 / 8192 with head dim 64, and 1.02-1.12x at head dim 64
# up to N 2048 (there the pass's own 0.07 ms is most of a call).
KNORM_PASS_MIN_HEAD_DIM = 128
KNORM_PASS_MIN_KEYS = 4096


def _knorm_inline(knorm: bool, key_log_weights, attention_mask, prefix_k, head_dim: int = 0, nk: int = 0) -> bool:
    """Whether the forward's kernels add the key norms themselves: never when the key-bias pass runs anyway (key
    log-weights, padding), else below ``KNORM_PASS_MIN_HEAD_DIM`` and ``KNORM_PASS_MIN_KEYS`` (``head_dim`` / ``nk``:
    of the keys).  Separate prefix keys (``prefix_k``) go through the pass as the first keys."""
    if not knorm:
        return False
    if _has_kb(key_log_weights, attention_mask):
        return False
    return head_dim < KNORM_PASS_MIN_HEAD_DIM and nk < KNORM_PASS_MIN_KEYS


def _knorm_pass(knorm: bool, key_log_weights, attention_mask, prefix_k, head_dim: int, nk: int) -> bool:
    """Whether the forward runs the key-bias pass (``key_bias``): for key log-weights or padding, and for the key
    norms where the kernels do not add them (``_knorm_inline``)."""
    if _has_kb(key_log_weights, attention_mask):
        return True
    return knorm and not _knorm_inline(knorm, key_log_weights, attention_mask, prefix_k, head_dim, nk)


def _knorm_inline_backward(knorm: bool, kb, prefix_k) -> bool:
    """The backward's ``knorm_inline``: the forward's choice, read from what it saved (``kb`` holds the key norms,
    the prefix keys' included, whenever the forward ran the key-bias pass)."""
    return knorm and kb is None


def _has_kb(key_log_weights, attention_mask) -> bool:
    """Whether the key-bias pass runs whatever the key norms: for key log-weights or padding."""
    return key_log_weights is not None or attention_mask is not None


def _contig(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def inverse_two_variances(log_sigma: Tensor) -> Tensor:
    """``c_h = 1 / (2 sigma_h^2) = exp(-2 log sigma_h) / 2`` in float32: the distance form's coefficient of a per-head
    log bandwidth (GKA), the same ops wherever it is formed (recorded by autograd or not), so the values agree."""
    return 0.5 * torch.exp(-2.0 * log_sigma.float())


def _forward_impl(
    q,
    k,
    v,
    qs,
    ks,
    beta,
    a,
    b,
    key_log_weights,
    attention_mask,
    prefix_k,
    prefix_v,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    tau_in,
    traced=False,
    a_log=False,
):
    """Launch the key-bias pass (key weights, padding, or the key norms: ``_knorm_pass``) and the flash forward:
    ``(out, lse, kb | None)``.  ``traced``: called from the triton_op ``distance_fwd_t`` while it is traced (the
    launches go through ``wrap_triton``); ``a_log``: ``a`` holds log bandwidths (see :func:`distance_attention`),
    which the forward kernel turns into ``c_h`` itself."""
    kb = None
    d, nk_seq = k.shape[3], k.shape[2]
    inline = _knorm_inline(knorm, key_log_weights, attention_mask, prefix_k, d, nk_seq)
    if _knorm_pass(knorm, key_log_weights, attention_mask, prefix_k, d, nk_seq):
        bsz, heads, _, _ = q.shape
        nk = k.shape[2] + (num_prefix_keys if prefix_k is not None else 0)
        if b is not None:
            norm_coef = b.float().contiguous()
        else:  # the distance form: the norm coefficient is -c_h (formed here from log sigma with a_log)
            norm_coef = -(inverse_two_variances(a) if a_log else a.float())
        kb, _ = key_bias(
            k,
            norm_coef,
            key_log_weights,
            attention_mask,
            heads,
            nk,
            bsz,
            knorm and not inline,
            prefix_k,
            traced=traced,
        )
    out, lse = distance_forward(
        q,
        k,
        v,
        kb,
        qs,
        ks,
        beta,
        a,
        b,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        normalize=normalize,
        qnorm=qnorm,
        kv_same=kv_same,
        eps=eps,
        knorm_inline=inline,
        prefix=None if prefix_k is None else (prefix_k, prefix_v),
        tau_in=tau_in,
        a_log=a_log,
        traced=traced,
    )
    return out, lse, kb


@torch.library.custom_op(f"{_NS}::distance_fwd", mutates_args=())
def distance_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qs: Optional[Tensor],
    ks: Optional[Tensor],
    beta: Optional[Tensor],
    a: Tensor,
    b: Optional[Tensor],
    key_log_weights: Optional[Tensor],
    attention_mask: Optional[Tensor],
    prefix_k: Optional[Tensor],
    prefix_v: Optional[Tensor],
    causal: bool,
    window: Optional[int],
    num_prefix_keys: int,
    normalize: bool,
    qnorm: bool,
    knorm: bool,
    kv_same: bool,
    eps: float,
    tau_in: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    out, lse, kb = _forward_impl(
        q,
        k,
        v,
        qs,
        ks,
        beta,
        a,
        b,
        key_log_weights,
        attention_mask,
        prefix_k,
        prefix_v,
        causal,
        window,
        num_prefix_keys,
        normalize,
        qnorm,
        knorm,
        kv_same,
        eps,
        tau_in,
    )
    # an empty placeholder: a custom op returns tensors
    kb = torch.empty(0, device=q.device, dtype=torch.float32) if kb is None else kb
    return out, lse, kb


@distance_fwd.register_fake
def _(
    q,
    k,
    v,
    qs,
    ks,
    beta,
    a,
    b,
    key_log_weights,
    attention_mask,
    prefix_k,
    prefix_v,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    tau_in,
):
    if TRITON_OP is True and TRITON_OP_REQUESTED and DEFINED_INTERPRETED and not _TRITON_OP_IGNORED_LOGGED:
        # here, not in distance_attention: dynamo runs a fake implementation natively (a log call in traced code
        # would break the graph)
        _TRITON_OP_IGNORED_LOGGED.append(True)
        logger.warning(
            "hf_rbf: HF_RBF_TRITON_OP (attention_distance_triton.TRITON_OP) is ignored: the kernels run in Triton's "
            "CPU interpreter, which cannot trace a triton_op; the custom op distance_fwd is traced instead"
        )
    bsz, heads, nq, _ = q.shape
    nk = k.shape[2] + (num_prefix_keys if prefix_k is not None else 0)
    out = q.new_empty(bsz, heads, nq, v.shape[3])
    lse = q.new_empty(bsz, heads, nq, dtype=torch.float32)
    kb_pass = _knorm_pass(knorm, key_log_weights, attention_mask, prefix_k, k.shape[3], k.shape[2])
    kb_shape = (bsz, heads, nk) if kb_pass else (0,)
    kb = q.new_empty(kb_shape, dtype=torch.float32)
    return out, lse, kb


def _backward_impl(
    dout,
    q,
    k,
    v,
    qs,
    ks,
    beta,
    a,
    b,
    kb,
    prefix_k,
    prefix_v,
    out,
    lse,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    need_dbeta,
    need_ab,
    need_dkb,
    tau_in,
    traced=False,
    a_log=False,
):
    """The backward kernels: ``(dq, dk, dv, dkb, dab, dqs, dks, dbeta, dpk, dpv)`` (see ``distance_backward``;
    ``a_log``: ``a`` holds log bandwidths, from which the kernels form ``c_h``; ``dab`` is their gradient)."""
    return distance_backward(
        dout,
        q,
        k,
        v,
        kb,
        qs,
        ks,
        beta,
        a,
        b,
        out,
        lse,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        normalize=normalize,
        qnorm=qnorm,
        knorm=knorm,
        kv_same=kv_same,
        eps=eps,
        need_dbeta=need_dbeta,
        need_ab=need_ab,
        need_dkb=need_dkb,
        prefix=None if prefix_k is None else (prefix_k, prefix_v),
        knorm_inline=_knorm_inline_backward(knorm, kb, prefix_k),
        tau_in=tau_in,
        a_log=a_log,
        traced=traced,
    )


@torch.library.custom_op(f"{_NS}::distance_bwd", mutates_args=())
def distance_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qs: Optional[Tensor],
    ks: Optional[Tensor],
    beta: Optional[Tensor],
    a: Tensor,
    b: Optional[Tensor],
    kb: Tensor,
    prefix_k: Optional[Tensor],
    prefix_v: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    causal: bool,
    window: Optional[int],
    num_prefix_keys: int,
    normalize: bool,
    qnorm: bool,
    knorm: bool,
    kv_same: bool,
    eps: float,
    need_dbeta: bool,
    need_ab: bool,
    need_dkb: bool,
    tau_in: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _backward_impl(
        dout,
        q,
        k,
        v,
        qs,
        ks,
        beta,
        a,
        b,
        kb if kb.dim() == 3 else None,
        prefix_k,
        prefix_v,
        out,
        lse,
        causal,
        window,
        num_prefix_keys,
        normalize,
        qnorm,
        knorm,
        kv_same,
        eps,
        need_dbeta,
        need_ab,
        need_dkb,
        tau_in,
    )
    return _backward_outputs(grads, q, v)


def _backward_outputs(grads, q: Tensor, v: Tensor) -> tuple:
    """``distance_bwd`` / ``distance_bwd_t``'s outputs: the unused gradients as empty tensors (an op returns tensors,
    and its outputs must not alias each other)."""
    return tuple(
        torch.empty(0, device=q.device, dtype=v.dtype if i == 2 else torch.float32) if t is None else t
        for i, t in enumerate(grads)
    )


@distance_bwd.register_fake
def _(
    dout,
    q,
    k,
    v,
    qs,
    ks,
    beta,
    a,
    b,
    kb,
    prefix_k,
    prefix_v,
    out,
    lse,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    need_dbeta,
    need_ab,
    need_dkb,
    tau_in,
):
    bsz, heads, nq, _ = q.shape
    nk = k.shape[2] + (num_prefix_keys if prefix_k is not None else 0)
    f32 = {"dtype": torch.float32}
    scalar = qs is not None
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        v.new_empty((0,)) if kv_same else torch.empty_like(v),
        q.new_empty((bsz, heads, nk) if kb.dim() == 3 and need_dkb else (0,), **f32),
        # the distance form (b None) has one coefficient: dab [1, H] (see distance_backward)
        q.new_empty((1 if b is None else 2, heads) if need_ab else (0,), **f32),
        q.new_empty((bsz, heads, nq), dtype=qs.dtype) if scalar else q.new_empty((0,), **f32),
        q.new_empty((bsz, heads, nk), dtype=ks.dtype) if scalar else q.new_empty((0,), **f32),
        q.new_empty((bsz, heads, nq) if scalar and need_dbeta else (0,), **f32),
        q.new_empty((0,), **f32) if prefix_k is None else torch.empty_like(prefix_k),
        q.new_empty((0,), **f32) if prefix_k is None or kv_same else torch.empty_like(prefix_v),
    )


_FWD_ARGS = ("q", "k", "v", "qs", "ks", "beta", "a", "b", "key_log_weights", "attention_mask", "prefix_k", "prefix_v")


def _setup_context(ctx, inputs, output):
    q, k, v, qs, ks, beta, a, b, klw, _am, pk, pv = inputs[:12]
    out, lse, kb = output
    ctx.save_for_backward(q, k, v, qs, ks, beta, a, b, out, lse, kb, pk, pv)
    ctx.flags = tuple(inputs[12:])  # causal, window, num_prefix_keys, normalize, qnorm, knorm, kv_same, eps, tau_in
    ctx.klw_shape = None if klw is None else tuple(klw.shape)
    ctx.klw_dtype = None if klw is None else klw.dtype
    ctx.mark_non_differentiable(lse, kb)


def _reduce_to(grad: Tensor, shape) -> Tensor:
    """Sum a ``[B, H, N]`` gradient over the dims that the input broadcast (size 1 in ``shape``)."""
    dims = [i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _gradients(ctx, dout, run_backward):
    """The input gradients from the backward kernels' outputs; shared by the custom op's autograd (traced under
    ``torch.compile``) and :class:`_DistanceFunction` (eager).  ``run_backward`` is ``distance_bwd`` (the op) or
    ``_backward_impl`` (the same kernels without the op's dispatch)."""
    q, k, v, qs, ks, beta, a, b, out, lse, kb, pk, pv = ctx.saved_tensors
    causal, window, num_prefix_keys, normalize, qnorm, knorm, kv_same, eps, tau_in = ctx.flags
    need = dict(zip(_FWD_ARGS, ctx.needs_input_grad[: len(_FWD_ARGS)]))
    need_ab = bool(need["a"] or need["b"])
    # _DistanceFunction with a_log: `a` holds the input log sigma (the kernels form c_h), whose dtype this is
    a_log_dtype = getattr(ctx, "a_log_dtype", None)
    dq, dk, dv, dkb, dab, dqs, dks, dbeta, dpk, dpv = run_backward(
        dout,
        q,
        k,
        v,
        qs,
        ks,
        beta,
        a,
        b,
        kb,
        pk,
        pv,
        out,
        lse,
        causal,
        window,
        num_prefix_keys,
        normalize,
        qnorm,
        knorm,
        kv_same,
        eps,
        bool(need["beta"]),
        need_ab,
        bool(need["key_log_weights"]),
        tau_in,
        **({} if a_log_dtype is None else {"a_log": True}),  # (the custom ops take no a_log)
    )
    grads = {"q": dq, "k": dk, "v": None if kv_same else dv}
    if pk is not None:
        grads["prefix_k"] = dpk
        grads["prefix_v"] = None if kv_same else dpv
    if need_ab:
        # dab [2, H]: the per-head sums of the dot and norm terms, reduced by distance_backward ([1, H]: the
        # distance form's one coefficient)
        da_db = dab.unbind(0)
        grads["a"] = da_db[0].to(a.dtype if a_log_dtype is None else a_log_dtype) if need["a"] else None
        grads["b"] = da_db[1].to(b.dtype) if need["b"] else None
    if need["key_log_weights"]:
        grads["key_log_weights"] = _reduce_to(dkb, ctx.klw_shape).to(ctx.klw_dtype)
    if qs is not None:
        if need["qs"]:
            grads["qs"] = dqs.to(qs.dtype)
        if need["ks"]:
            grads["ks"] = dks.to(ks.dtype)
        if need["beta"]:
            grads["beta"] = _reduce_to(dbeta, tuple(beta.shape)).to(beta.dtype)
    return tuple(grads.get(name) for name in _FWD_ARGS) + (None,) * 9  # no gradients for the 9 flags


def _backward(ctx, dout, _dlse, _dkb):
    return _gradients(ctx, dout, distance_bwd)


distance_fwd.register_autograd(_backward, setup_context=_setup_context)


try:
    # True while a triton_op's body is traced (dynamo's fake run, AOTAutograd's decomposition: ``wrap_triton`` wraps
    # kernels), False in the op's eager backend (``wrap_triton`` returns the kernel itself); what triton_op's own
    # backend switches (torch 2.11-2.13)
    from torch._library.triton import is_wrap_triton_enabled as _wrapping_triton
except ImportError:  # a torch without it: the triton_op path is not offered (use_triton_op)
    _wrapping_triton = None


if HAS_TRITON and _wrapping_triton is not None:

    @torch.library.triton_op(f"{_NS}::distance_fwd_t", mutates_args=())
    def distance_fwd_t(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        qs: Optional[Tensor],
        ks: Optional[Tensor],
        beta: Optional[Tensor],
        a: Tensor,
        b: Optional[Tensor],
        key_log_weights: Optional[Tensor],
        attention_mask: Optional[Tensor],
        prefix_k: Optional[Tensor],
        prefix_v: Optional[Tensor],
        causal: bool,
        window: Optional[int],
        num_prefix_keys: int,
        normalize: bool,
        qnorm: bool,
        knorm: bool,
        kv_same: bool,
        eps: float,
        tau_in: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``distance_fwd`` as a triton_op (see the module docstring and ``TRITON_OP``)."""
        out, lse, kb = _forward_impl(
            q,
            k,
            v,
            qs,
            ks,
            beta,
            a,
            b,
            key_log_weights,
            attention_mask,
            prefix_k,
            prefix_v,
            causal,
            window,
            num_prefix_keys,
            normalize,
            qnorm,
            knorm,
            kv_same,
            eps,
            tau_in,
            _wrapping_triton(),
        )
        kb = torch.empty(0, device=q.device, dtype=torch.float32) if kb is None else kb
        return out, lse, kb

    @torch.library.triton_op(f"{_NS}::distance_bwd_t", mutates_args=())
    def distance_bwd_t(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        qs: Optional[Tensor],
        ks: Optional[Tensor],
        beta: Optional[Tensor],
        a: Tensor,
        b: Optional[Tensor],
        kb: Tensor,
        prefix_k: Optional[Tensor],
        prefix_v: Optional[Tensor],
        out: Tensor,
        lse: Tensor,
        causal: bool,
        window: Optional[int],
        num_prefix_keys: int,
        normalize: bool,
        qnorm: bool,
        knorm: bool,
        kv_same: bool,
        eps: float,
        need_dbeta: bool,
        need_ab: bool,
        need_dkb: bool,
        tau_in: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``distance_bwd`` as a triton_op."""
        grads = _backward_impl(
            dout,
            q,
            k,
            v,
            qs,
            ks,
            beta,
            a,
            b,
            kb if kb.dim() == 3 else None,
            prefix_k,
            prefix_v,
            out,
            lse,
            causal,
            window,
            num_prefix_keys,
            normalize,
            qnorm,
            knorm,
            kv_same,
            eps,
            need_dbeta,
            need_ab,
            need_dkb,
            tau_in,
            _wrapping_triton(),
        )
        return _backward_outputs(grads, q, v)

    def _backward_t(ctx, dout, _dlse, _dkb):
        return _gradients(ctx, dout, distance_bwd_t)

    distance_fwd_t.register_autograd(_backward_t, setup_context=_setup_context)


def use_triton_op() -> bool:
    """Whether :func:`distance_attention`, traced by torch.compile, calls the triton_op ``distance_fwd_t`` (see
    ``TRITON_OP``): the flag on, kernels that are not interpreted.  Every form of the op takes it: RBF, GKA (``x`` as
    key and value: the dK/dV kernel writes no DV / DPV with ``KV_SAME``, so the names it shares with ``dk`` / the
    placeholder are read-only and functionalization clones nothing twice; docs/triton_op_plan.md, fix 9) and the
    hybrid (scalar term, ``tau_in``: its extra gradients are outputs of ``distance_bwd_t`` as of ``distance_bwd``)."""
    if not isinstance(TRITON_OP, bool):
        raise ValueError(
            f"HF_RBF_TRITON_OP (attention_distance_triton.TRITON_OP) must be 0/1, true/false, on/off; got {TRITON_OP!r}"
        )
    offered = HAS_TRITON and not DEFINED_INTERPRETED and _wrapping_triton is not None
    return TRITON_OP and offered


class _DistanceFunction(torch.autograd.Function):
    """The same kernels and gradients as ``distance_fwd`` for eager mode, without the custom op's dispatch.

    Measured on an H100 (``benchmarks/profile_training.py``, ``benchmarks/results/h100-profile-2026-11-25``): through
    the custom op one forward+backward of ``rbf_attention`` cost 2.4 ms of host time against 0.36 ms for SDPA; a
    d256 model was host-bound (9 ms of GPU work in a 37-53 ms step), the op's Python autograd wrapper and the
    backward op's dispatch taking about 2 ms per layer and step.  ``torch.compile`` still traces the custom op
    (:func:`distance_attention` picks it while compiling), so graphs keep their fake implementations.
    """

    @staticmethod
    def forward(ctx, *args):
        """``args``: those of ``distance_fwd`` (tensors ``q .. prefix_v``, then the flags), then ``a_log``: ``a``
        holds per-head log bandwidths ``log sigma_h`` (the distance form, GKA).  The kernels form ``c_h = exp(-2 log
        sigma_h) / 2`` themselves, the forward's and the backward's alike, and the backward kernels write ``log
        sigma``'s gradient (``dc / dlog sigma = -2 c_h`` applied per row): no autograd nodes and no torch ops for the
        conversion per layer (before 2026-11-29 three ops here, and before that three recorded ops and their backward
        nodes in front of the call)."""
        *args, a_log = args
        if a_log:
            ctx.a_log_dtype = args[6].dtype
        out, lse, kb = _forward_impl(*args, a_log=a_log)
        q, k, v, qs, ks, beta, a, b, klw, _am, pk, pv = args[:12]
        ctx.save_for_backward(q, k, v, qs, ks, beta, a, b, out, lse, kb, pk, pv)
        ctx.flags = tuple(args[12:])  # causal .. eps, tau_in (as in _setup_context)
        ctx.klw_shape = None if klw is None else tuple(klw.shape)
        ctx.klw_dtype = None if klw is None else klw.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        return _gradients(ctx, dout, _backward_impl) + (None,)  # (a_log)


def _decode_impl(
    q,
    k,
    v,
    qs,
    ks,
    beta,
    a,
    b,
    key_log_weights,
    attention_mask,
    prefix_k,
    prefix_v,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    tau_in,
):
    bsz, heads, _, _ = q.shape
    nk = k.shape[2] + (num_prefix_keys if prefix_k is not None else 0)
    # key norms inside the decode kernel (knorm): only the weights / padding go through the key-bias pass
    if key_log_weights is None and attention_mask is not None and is_all_true_mask(attention_mask):
        # keys known to be valid (the sorted cache's mask while no slot is padding or evicted): no bias at all, as
        # without a mask; not the pass's launch, its output allocation and the mask's int8 cast per layer and decode
        # step, nor a view of kept zeros (two ops per layer and step on the host: until 2026-11-29), and the kernel
        # reads no bias (a zero bias added nothing: the same scores bit for bit)
        kb = None
    else:
        kb, _ = key_bias(None, None, key_log_weights, attention_mask, heads, nk, bsz, False)
    return distance_decode(
        q,
        k,
        v,
        kb,
        qs,
        ks,
        beta,
        a,
        b,
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        normalize=normalize,
        qnorm=qnorm,
        knorm=knorm,
        kv_same=kv_same,
        eps=eps,
        prefix=None if prefix_k is None else (prefix_k, prefix_v),
        tau_in=tau_in,
    )


@torch.library.custom_op(f"{_NS}::distance_decode", mutates_args=())
def distance_decode_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qs: Optional[Tensor],
    ks: Optional[Tensor],
    beta: Optional[Tensor],
    a: Tensor,
    b: Optional[Tensor],
    key_log_weights: Optional[Tensor],
    attention_mask: Optional[Tensor],
    prefix_k: Optional[Tensor],
    prefix_v: Optional[Tensor],
    causal: bool,
    window: Optional[int],
    num_prefix_keys: int,
    normalize: bool,
    qnorm: bool,
    knorm: bool,
    kv_same: bool,
    eps: float,
    tau_in: bool,
) -> Tensor:
    return _decode_impl(
        q,
        k,
        v,
        qs,
        ks,
        beta,
        a,
        b,
        key_log_weights,
        attention_mask,
        prefix_k,
        prefix_v,
        causal,
        window,
        num_prefix_keys,
        normalize,
        qnorm,
        knorm,
        kv_same,
        eps,
        tau_in,
    )


@distance_decode_op.register_fake
def _(
    q,
    k,
    v,
    qs,
    ks,
    beta,
    a,
    b,
    key_log_weights,
    attention_mask,
    prefix_k,
    prefix_v,
    causal,
    window,
    num_prefix_keys,
    normalize,
    qnorm,
    knorm,
    kv_same,
    eps,
    tau_in,
):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def distance_reason(tensors, head_dims) -> str | None:
    """Why the fused kernels cannot serve these inputs (None when they can)."""
    first = tensors[0]
    return triton_unavailable_reason(first.device, first.dtype, head_dims)


def _check_prefix(prefix, q, k, v, mask: MaskArgs, kv_same: bool):
    """Validate separate prefix keys / values (see :func:`distance_attention`); returns them last-dim contiguous."""
    pk, pv = prefix
    pv = pk if kv_same else pv
    bsz, heads = q.shape[:2]
    n_prefix = mask.num_prefix_keys
    for name, t, ref in (("prefix keys", pk, k), ("prefix values", pv, v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"distance attention: the {name} must be a 4-d tensor [B or 1, heads, P, dim]")
        if t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError(
                f"distance attention: the {name} are {t.dtype} on {t.device}; the sequence ones {ref.dtype} on "
                f"{ref.device}"
            )
        expected = (ref.shape[1], n_prefix, ref.shape[3])
        if t.shape[0] not in (1, bsz) or tuple(t.shape[1:]) != expected:
            raise ValueError(
                f"distance attention: the {name} must have shape [{bsz} or 1, {expected[0]}, {expected[1]} "
                f"(num_prefix_keys), {expected[2]}]; got {tuple(t.shape)}"
            )
    return _contig(pk), _contig(pv)


def distance_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qs: Optional[Tensor],
    ks: Optional[Tensor],
    beta: Optional[Tensor],
    a: Tensor,
    b: Optional[Tensor],
    mask: MaskArgs,
    *,
    normalize: bool,
    qnorm: bool,
    knorm: bool,
    kv_same: bool,
    eps: float,
    prefix: tuple[Tensor, Tensor] | None = None,
    tau_in: bool = False,
    prefix_checked: bool = False,
    a_log: bool = False,
) -> Tensor:
    """Run the fused op: the split-K decode kernel for a few query rows without gradients, else the flash op.

    ``prefix``: None, or the ``mask.num_prefix_keys`` prefix keys and values as separate tensors ``(pk [B|1, H, P,
    D], pv [B|1, G, P, Dv])`` (a batch of 1 is shared by every batch element; with ``kv_same`` ``pv`` is ignored):
    the result is that of ``k = cat([pk.expand(B, ...), k], 2)`` (and ``v`` alike), without the copies.  ``k`` and
    ``v`` then hold only the sequence keys, while ``mask`` (key log-weights, padding) and the scalar keys ``ks``
    cover all ``P + N`` keys.  ``tau_in``: ``beta`` holds the temperature ``tau`` of the scalar term (the kernels take
    ``1 / tau`` per row and write ``tau``'s gradient: no reciprocal op and its backward per call).
    ``prefix_checked``: the caller (a public attention function's triton backend) validated the prefix tensors' shapes,
    dtype and device against its inputs already; they are then only made last-dim contiguous here, not checked a
    second time in every layer and decode step.
    ``a_log`` (the distance form, ``b`` None): ``a`` holds per-head log bandwidths ``log sigma_h`` and the kernels
    use ``c_h = exp(-2 log sigma_h) / 2`` (GKA's learnable bandwidth).  In eager training and eager forwards of more
    than ``DECODE_MAX_QUERIES`` rows the kernels form ``c`` and (training) write ``log sigma``'s gradient themselves
    (:class:`_DistanceFunction`): no torch ops for it per call.  Traced calls and decode steps form ``c`` first with
    :func:`inverse_two_variances` (the same value up to the last bit of ``exp``).
    """
    if a_log and b is not None:
        raise ValueError("distance attention: `a_log` takes the distance form only (b = None)")
    q, k, a, b = _contig(q), _contig(k), _contig(a), _contig(b)
    v = k if kv_same else _contig(v)
    pk = pv = None
    if prefix is not None:
        if prefix_checked:
            pk, pv = _contig(prefix[0]), _contig(prefix[0] if kv_same else prefix[1])
        else:
            pk, pv = _check_prefix(prefix, q, k, v, mask, kv_same)
    args = (
        q,
        k,
        v,
        qs,
        ks,
        beta,
        a,
        b,
        mask.key_log_weights,
        mask.attention_mask,
        pk,
        pv,
        mask.causal,
        mask.window,
        mask.num_prefix_keys,
        normalize,
        qnorm,
        knorm,
        kv_same,
        float(eps),
        bool(tau_in),
    )
    differentiable = (q, k, v, qs, ks, beta, a, b, mask.key_log_weights, pk, pv)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)
    compiling = torch.compiler.is_compiling()
    if needs_grad and not compiling:
        return _DistanceFunction.apply(*args, a_log)
    if not compiling and mask.nq > DECODE_MAX_QUERIES:  # eager, no gradients: the training forward's kernel
        return _forward_impl(*args, a_log=a_log)[0]
    if a_log:  # (traced, or a decode step) c_h formed first, as gka_attention_triton does without a_log
        args = args[:6] + (inverse_two_variances(a),) + args[7:]
    if mask.nq <= DECODE_MAX_QUERIES and not needs_grad:
        return distance_decode_op(*args) if compiling else _decode_impl(*args)
    # (traced: every eager call returned above)
    if use_triton_op():
        return distance_fwd_t(*args)[0]
    return distance_fwd(*args)[0]
