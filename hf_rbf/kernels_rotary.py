"""RoPE (rotate-half convention) of a layer's queries and keys in one fused launch, forward and backward.

``x' = [x1 cos - x2 sin, x2 cos + x1 sin]`` with ``x = [x1, x2]`` split at ``D / 2`` and ``cos / sin [B|1, N, D/2]``;
the reference is :func:`hf_rbf.modeling_decoder.apply_rotary_reference` (plain torch).

Why a kernel: the torch form costs 7 elementwise kernels per tensor forward (two casts of the tables, four products,
a sum and a difference, a ``cat``) and as many backward, each reading or writing the whole ``[B, H, N, D]`` tensor;
measured on an H100 at d768 (``benchmarks/results/h100-2026-11-26d``) RoPE's products and concatenations were the
largest elementwise item of a hybrid_sort training step after the GEMMs.  Here one program rotates one token's
query and key heads (both tensors in one launch), computing in float32 and rounding once, and the backward is the
same kernel with the inverse rotation (``sin -> -sin``).

Layouts: the inputs are ``[B, H, N, D]`` (``head_dim=1``) or ``[B, N, H, D]`` (``head_dim=2``) with any strides whose
last one is 1 (views of a joint projection included); the outputs are new ``[B, N, H, D]``-contiguous tensors,
returned in the layout asked for (for ``head_dim=1`` a transposed view, which the attention kernels and SDPA read
without a copy).

``rotary_pair`` is a ``torch.library`` custom op (with a fake and autograd), so ``torch.compile`` traces it; eager
calls go through ``_RotaryFunction`` (the same kernels without the custom op's dispatch cost), or, where nothing
needs a gradient, straight to the launch.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
from torch import Tensor

from .kernels_common import HAS_TRITON, next_pow2, triton_unavailable_reason
from .kernels_launch import launch_jit

if HAS_TRITON:
    import triton
    import triton.language as tl

_NS = "hf_rbf" if __name__ == "hf_rbf.kernels_rotary" else "hf_rbf_" + hashlib.sha1(__name__.encode()).hexdigest()[:12]


if HAS_TRITON:

    @triton.jit
    def _rotate_heads(
        X,
        OUT,
        sxb,
        sxn,
        sxh,
        b,
        n,
        c,
        s,
        N,
        H,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """Rotate the ``H`` heads of token ``(b, n)`` of ``X`` (strides ``sxb, sxn, sxh``, last 1) into the
        contiguous ``[B, N, H, 2 HALF]`` ``OUT``; ``c``, ``s``: ``[HALF_PAD]`` float32."""
        offs_h = tl.arange(0, BLOCK_H)
        offs_f = tl.arange(0, HALF_PAD)
        ok = (offs_h[:, None] < H) & (offs_f[None, :] < HALF)
        src = X + b * sxb + n * sxn + offs_h[:, None] * sxh + offs_f[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        dst = OUT + ((b * N + n) * H + offs_h[:, None]) * (2 * HALF) + offs_f[None, :]
        tl.store(dst, (x1 * c[None, :] - x2 * s[None, :]).to(OUT.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotary_kernel(
        Q,
        K,
        COS,
        SIN,
        QO,
        KO,
        sqb,
        sqn,
        sqh,
        skb,
        skn,
        skh,
        scb,
        scn,
        N,
        HQ,
        HK,
        SIGN,
        HAS_K: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
    ):
        """One program per token ``(b, n)``: its cos / sin row read once for the query and the key heads.
        ``SIGN`` -1 is the inverse rotation (the backward)."""
        row = tl.program_id(0)
        b = row // N
        n = row % N
        offs_f = tl.arange(0, HALF_PAD)
        f_ok = offs_f < HALF
        c = tl.load(COS + b * scb + n * scn + offs_f, mask=f_ok, other=0.0).to(tl.float32)
        s = tl.load(SIN + b * scb + n * scn + offs_f, mask=f_ok, other=0.0).to(tl.float32) * SIGN
        _rotate_heads(Q, QO, sqb, sqn, sqh, b, n, c, s, N, HQ, HALF, HALF_PAD, BLOCK_HQ)
        if HAS_K:
            _rotate_heads(K, KO, skb, skn, skh, b, n, c, s, N, HK, HALF, HALF_PAD, BLOCK_HK)


def _token_major(x: Tensor, head_dim: int) -> tuple[Tensor, tuple[int, int, int, int], tuple[int, int, int]]:
    """``(x with its last dim contiguous, its [B, N, H, D] sizes, its (b, n, h) strides)``: the token-major reading of
    ``x`` without a transposed view (an op per tensor and call on the host, where a decode step is bound by it)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if head_dim == 1:
        b, h, n, d = x.shape
        return x, (b, n, h, d), (x.stride(0), x.stride(2), x.stride(1))
    return x, tuple(x.shape), (x.stride(0), x.stride(1), x.stride(2))


def _new_output(like: Tensor, sizes: tuple[int, int, int, int], head_dim: int) -> Tensor:
    """A fresh ``[B, N, H, D]``-contiguous tensor in the layout of the inputs: for ``head_dim=1`` the ``[B, H, N, D]``
    view of that memory, allocated as such (no transpose op after)."""
    b, n, h, d = sizes
    if head_dim == 1:
        return torch.empty_strided((b, h, n, d), (n * h * d, d, h * d, 1), device=like.device, dtype=like.dtype)
    return torch.empty(b, n, h, d, device=like.device, dtype=like.dtype)


def _launch(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, head_dim: int, sign: float):
    """Rotate ``q`` (and ``k``) and return the results in the layout of the inputs (see the module docstring)."""
    q, (bsz, n, hq, d), sq = _token_major(q, head_dim)
    if k is not None:
        k, (_, _, hk, _), sk = _token_major(k, head_dim)
    else:
        hk, sk = 1, (0, 0, 0)
    half = d // 2
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    qo = _new_output(q, (bsz, n, hq, d), head_dim)
    ko = None if k is None else _new_output(k, (bsz, n, hk, d), head_dim)
    cos_b = cos.stride(0) if cos.shape[0] > 1 else 0
    launch_jit(
        _rotary_kernel,
        (bsz * n,),
        (
            q,
            q if k is None else k,
            cos,
            sin,
            qo,
            qo if ko is None else ko,
            *sq,
            *sk,
            cos_b,
            cos.stride(1),
            n,
            hq,
            hk,
            sign,
        ),
        dict(
            HAS_K=k is not None,
            HALF=half,
            HALF_PAD=next_pow2(max(half, 1)),
            BLOCK_HQ=next_pow2(hq),
            BLOCK_HK=next_pow2(hk),
        ),
    )
    return qo, ko


def rotary_reason(x: Tensor, cos: Tensor) -> str | None:
    """None when the fused kernel can rotate ``x`` with tables ``cos``; otherwise why not."""
    reason = triton_unavailable_reason(x.device, x.dtype)
    if reason is not None:
        return reason
    if x.shape[-1] % 2:
        return f"the head dim ({x.shape[-1]}) is odd"
    if cos.device != x.device:
        return f"the position tables are on {cos.device}, the tensor on {x.device}"
    return None


@torch.library.custom_op(f"{_NS}::rotary_pair", mutates_args=())
def rotary_pair_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, head_dim: int, sign: float) -> tuple[Tensor, Tensor]:
    return _launch(q, k, cos, sin, head_dim, sign)


@rotary_pair_op.register_fake
def _(q, k, cos, sin, head_dim, sign):
    def like(t):
        bsz, h, n, d = t.shape if head_dim == 1 else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])
        out = t.new_empty(bsz, n, h, d)
        return out.transpose(1, 2) if head_dim == 1 else out

    return like(q), like(k)


def _op_setup(ctx, inputs, output):
    _, _, cos, sin, head_dim, sign = inputs
    ctx.save_for_backward(cos, sin)
    ctx.head_dim, ctx.sign = head_dim, sign


def _op_backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq = torch.zeros_like(dk) if dq is None else dq
    dk = torch.zeros_like(dq) if dk is None else dk
    gq, gk = rotary_pair_op(dq, dk, cos, sin, ctx.head_dim, -ctx.sign)
    return gq, gk, None, None, None, None


rotary_pair_op.register_autograd(_op_backward, setup_context=_op_setup)


class _RotaryFunction(torch.autograd.Function):
    """Eager path of the same kernel (no custom-op dispatch): ``k`` may be None (one tensor)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, head_dim):
        ctx.save_for_backward(cos, sin)
        ctx.head_dim = head_dim
        return _launch(q, k, cos, sin, head_dim, 1.0)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        if dq is None:
            dq = torch.zeros_like(dk) if dk is not None else None
        gq, gk = _launch(dq, dk, cos, sin, ctx.head_dim, -1.0)
        return gq, gk, None, None, None


def rotary_fused(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, head_dim: int = 1):
    """``(rotated q, rotated k or None)`` by the fused kernel (callers check :func:`rotary_reason` first)."""
    if torch.compiler.is_compiling():
        if k is None:
            return rotary_pair_op(q, q, cos, sin, head_dim, 1.0)[0], None
        return rotary_pair_op(q, k, cos, sin, head_dim, 1.0)
    if not torch.is_grad_enabled() or not (q.requires_grad or (k is not None and k.requires_grad)):
        # nothing to differentiate (a decode step): the launch itself, without the autograd.Function's context and
        # its saved tables (about 5 us of host time per layer and step on this project's CPU); the same kernel and
        # outputs (the tables never get a gradient)
        return _launch(q, k, cos, sin, head_dim, 1.0)
    return _RotaryFunction.apply(q, k, cos, sin, head_dim)
