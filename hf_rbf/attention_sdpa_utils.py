"""The dimension-padding trick: distance scores through ``torch.nn.functional.scaled_dot_product_attention``.

Every score of the four families is a sum of products of a per-query factor and a per-key factor::

    score_ij = a_i . b_j  (a vector dot product, e.g. 2 gamma q_i . k_j)
             + sum_t  alpha_t(i) * beta_t(j)  (scalar products, e.g. (2 qs_i / tau_i) * ks_j)
             + c_j                           (a per-key bias, e.g. -gamma ||k_j||^2 + log w_j)

so it is the plain dot product of padded vectors ``q'_i = [a_i, alpha(i), 1]`` and ``k'_j = [b_j, beta(j), c_j]``
and SDPA runs with ``scale=1``.  :class:`ScoreFeatures` collects those columns; :func:`padded_sdpa` runs SDPA on
them with the shared mask semantics (:mod:`hf_rbf.attention_utils`).  Gradients reach every input through plain
autograd of the concatenation, so nothing here needs a backward of its own.

Precision.  SDPA computes ``q' . k'`` with float32 accumulation, but ``q'`` and ``k'`` are stored in the input dtype.
A large scalar term such as ``gamma ||k||^2`` rounded to bfloat16 would carry an absolute error of about
``2^-9 * gamma ||k||^2``, several times the error the inputs' own rounding causes, and softmax weights feel
absolute score errors.  So in float16/bfloat16 every scalar column is split into a high and a low part
(``t = hi + lo``, both in the input dtype), which keeps about 16 significant bits, as the float32 reference does
to the precision that matters.  The vector part (``2 gamma q``) is rounded once, like the inputs themselves.
Gradients are those of SDPA's backward, which (like every flash-style backward) forms ``rowsum(dO * O)`` from the
output rounded to the input dtype: in half precision that limits the accuracy of gradients of temperature-like
parameters for queries far from every key they see (see ``tests/attention_testing.py`` for the measured bounds).

Range.  Per-key and per-query biases are clamped to ``[-limit, limit]`` (``1e30``; ``1e6`` in float16, where they
are also stored divided by ``2^8`` and multiplied back by a constant ``2^8`` column so that they fit the float16
range).  A clamped log-weight still gives the key a weight of exactly zero next to any key with an ordinary score;
a key log-weight of ``-inf`` (and a row whose every allowed key has one) is treated like padding, as the naive
reference does.

Extra keys.  GKA's ``eps`` and the softmax-free RBF variant need one *dummy* key that every query sees, with a
per-query score and its own value (see the families' sdpa modules).  It is prepended as an extra prefix key; for a
plain square causal call a dummy query row is prepended too, so the flash path (``is_causal=True``) still applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_utils import MaskArgs, allowed_key_counts, allowed_mask


HALF_DTYPES = (torch.float16, torch.bfloat16)
# head-dim multiple that keeps tensor-core kernels on their fast path
DIM_MULTIPLE = 8
# the flash and cuDNN kernels need q, k and v of one head dim (up to 256): pad v to the same width where it fits
MAX_COMMON_DIM = 256


def bias_limit(dtype: torch.dtype) -> float:
    """Largest magnitude a bias column may carry (see the module docstring)."""
    return 1e6 if dtype == torch.float16 else 1e30


def bias_scale(dtype: torch.dtype) -> float:
    """Power of two by which float16 bias columns are stored divided (so that up to ``bias_limit`` fits)."""
    return 256.0 if dtype == torch.float16 else 1.0


def split_columns(t: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """``t`` (float32/64) as a sum of columns in ``dtype``: itself, or ``hi + lo`` for float16/bfloat16.

    Gradients stay exact: the total derivative of ``lo = t - hi`` is ``1 - 1 = 0``, so the gradient reaches ``t``
    once, through ``hi`` (whose column pairs with the same partner as ``lo``'s).
    """
    hi = t.to(dtype)
    if dtype not in HALF_DTYPES:
        return [hi]
    return [hi, (t - hi.to(t.dtype)).to(dtype)]


def _col(t: torch.Tensor) -> torch.Tensor:
    """``[B|1, H|1, N|1]`` -> ``[B|1, H|1, N|1, 1]``."""
    return t.unsqueeze(-1)


class ScoreFeatures:
    """Collects the columns of ``q'`` (``[B, H, Nq, W]``) and ``k'`` (``[B, H, Nk, W]``) with ``q'_i . k'_j`` = score.

    Args:
        dtype: the input dtype (q' and k' are stored in it).
        compute: float32 or float64, the precision in which the scalar terms are formed before splitting.
        batch, heads, nq, nk: sizes.
        device: where the tensors live.
    """

    def __init__(self, dtype, compute, batch: int, heads: int, nq: int, nk: int, device):
        self.dtype, self.compute = dtype, compute
        self.batch, self.heads, self.nq, self.nk = batch, heads, nq, nk
        self.device = device
        self._q: list[torch.Tensor] = []  # [B|1, H|1, Nq|1, c]
        self._k: list[torch.Tensor] = []  # [B|1, H|1, Nk|1, c]
        self._key_bias = None  # [B|1, H|1, Nk] in `compute`
        self._dummy_score = None  # [B|1, H|1, Nq] in `compute`, or None: no dummy key

    # ------------------------------------------------------------------------------------------------------------
    def add_dot(self, qf: torch.Tensor, kf: torch.Tensor) -> None:
        """``score += qf_i . kf_j`` for vector features ``[B, H, Nq, D]`` and ``[B, H, Nk, D]`` (rounded once)."""
        self._q.append(qf.to(self.dtype))
        self._k.append(kf.to(self.dtype))

    def add_product(self, a: torch.Tensor, b: torch.Tensor, *, b_exact: bool = False) -> None:
        """``score += a_i * b_j`` for a per-query ``a`` ``[B|1, H|1, Nq]`` and a per-key ``b`` ``[B|1, H|1, Nk]``.

        ``b_exact``: ``b`` is already representable in the input dtype (e.g. the input ``ks`` itself), so it
        needs no low part.
        """
        a_cols = split_columns(a.to(self.compute), self.dtype)
        b_cols = split_columns(b.to(self.compute), self.dtype)
        if b_exact:
            b_cols = b_cols[:1]
        # (a_hi + a_lo)(b_hi + b_lo) to the precision that matters: drop a_lo * b_lo
        for ia, ib in ((0, 0), (0, 1), (1, 0)):
            if ia < len(a_cols) and ib < len(b_cols):
                self._q.append(_col(a_cols[ia]))
                self._k.append(_col(b_cols[ib]))

    def add_key_bias(self, c) -> None:
        """``score += c_j`` for a per-key bias ``[B|1, H|1, Nk]`` (summed with the other biases, split once)."""
        c = c.to(self.compute)
        self._key_bias = c if self._key_bias is None else self._key_bias + c

    def add_dummy_key(self, e) -> None:
        """Add one extra key that every query sees, with score ``e_i`` (``[B|1, H|1, Nq]``) for query ``i``."""
        self._dummy_score = e.to(self.compute)

    @property
    def has_dummy(self) -> bool:
        return self._dummy_score is not None

    # ------------------------------------------------------------------------------------------------------------
    def _bias_columns(self, bias: torch.Tensor) -> list[torch.Tensor]:
        limit, scale = bias_limit(self.dtype), bias_scale(self.dtype)
        # nan_to_num turns -inf (log 0) into the finite limit: a clamped key still gets exactly zero weight
        bias = torch.nan_to_num(bias, nan=0.0, posinf=limit, neginf=-limit).clamp(-limit, limit)
        return split_columns(bias / scale if scale != 1.0 else bias, self.dtype)

    def build(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(q', k', width)``: unpadded ``q'`` ``[B, H, Nq, w]``, ``k'`` ``[B, H, Nk(+1), w]`` (dummy key first)."""
        b, h, nq, nk = self.batch, self.heads, self.nq, self.nk
        dt, dev = self.dtype, self.device
        scale = bias_scale(dt)
        q_cols = [t.expand(b, h, nq, t.shape[-1]) for t in self._q]
        k_cols = [t.expand(b, h, nk, t.shape[-1]) for t in self._k]
        if self._key_bias is not None:
            for piece in self._bias_columns(self._key_bias):
                q_cols.append(torch.full((b, h, nq, 1), scale, dtype=dt, device=dev))
                k_cols.append(_col(piece).expand(b, h, nk, 1))
        dummy_cols = None
        if self._dummy_score is not None:
            pieces = self._bias_columns(self._dummy_score)
            for piece in pieces:
                q_cols.append(_col(piece).expand(b, h, nq, 1))
                k_cols.append(torch.zeros(b, h, nk, 1, dtype=dt, device=dev))
        qp = torch.cat(q_cols, dim=-1) if q_cols else torch.zeros(b, h, nq, 0, dtype=dt, device=dev)
        kp = torch.cat(k_cols, dim=-1) if k_cols else torch.zeros(b, h, nk, 0, dtype=dt, device=dev)
        if self._dummy_score is not None:
            # the dummy key: zero in every column but its own score columns, which hold the constant 2^8 / 1
            width = kp.shape[-1]
            dummy_cols = torch.zeros(b, h, 1, width, dtype=dt, device=dev)
            dummy_cols[..., width - len(pieces) :] = scale
            kp = torch.cat([dummy_cols, kp], dim=2)
        return qp, kp, qp.shape[-1]


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def padded_sdpa(
    features: ScoreFeatures,
    v: torch.Tensor,
    mask: MaskArgs,
    *,
    dummy_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run SDPA (scale 1) on the padded features; returns ``[B, H, Nq, Dv]`` in the input dtype.

    Args:
        features: the score columns (with or without a dummy key).
        v: values ``[B, H, Nk, Dv]`` (may be an expanded view).
        mask: the validated mask arguments of the call (``key_log_weights`` is already folded into ``features``;
            here it only decides which rows have no live key).
        dummy_value: the dummy key's value ``[Dv]`` (zeros when None).

    Rows with no allowed key give zeros, with no NaN in the output or the gradients.
    """
    qp, kp, width = features.build()
    b, h, nq, _ = qp.shape
    nk, dv = mask.nk, v.shape[-1]
    dt, dev = qp.dtype, qp.device
    v = v.to(dt)
    if features.has_dummy:
        dv_row = torch.zeros(dv, dtype=dt, device=dev) if dummy_value is None else dummy_value.to(dt)
        v = torch.cat([dv_row.expand(b, h, 1, dv), v.expand(b, h, nk, dv)], dim=2)

    # pad to a multiple of 8; one common width for q, k and v where the fused kernels allow it
    qk_width = _round_up(width, DIM_MULTIPLE)
    v_width = _round_up(dv, DIM_MULTIPLE)
    if max(qk_width, v_width) <= MAX_COMMON_DIM:
        qk_width = v_width = max(qk_width, v_width)
    qp = F.pad(qp, (0, qk_width - width))
    kp = F.pad(kp, (0, qk_width - width))
    v = F.pad(v, (0, v_width - dv))

    dummy = 1 if features.has_dummy else 0
    positional_plain = (
        mask.window is None
        and mask.num_prefix_keys == 0
        and mask.attention_mask is None
        and (not mask.causal or mask.nq == mask.nk)
    )
    dead = None  # [B|1, H|1, Nq] rows whose output must be zero
    if positional_plain:
        if mask.causal and dummy:
            # a dummy query row in front keeps the call square, so is_causal (top-left) still means "j <= i + 1"
            qp = torch.cat([torch.zeros_like(qp[:, :, :1]), qp], dim=2)
            out = F.scaled_dot_product_attention(qp, kp, v, is_causal=True, scale=1.0)[:, :, 1:]
        else:
            out = F.scaled_dot_product_attention(qp, kp, v, is_causal=mask.causal, scale=1.0)
    else:
        shifted = MaskArgs(
            causal=mask.causal,
            window=mask.window,
            num_prefix_keys=mask.num_prefix_keys + dummy,
            key_log_weights=None,
            attention_mask=None if mask.attention_mask is None else F.pad(mask.attention_mask, (dummy, 0), value=True),
            nq=nq,
            nk=nk + dummy,
        )
        allowed = allowed_mask(shifted, dev)  # [B|1, 1, Nq, Nk(+1)]
        if not dummy:
            # SDPA returns NaN for a row with no allowed key: open its first key, then zero the row below
            empty = ~allowed.any(dim=-1, keepdim=True)
            allowed = allowed.clone()
            allowed[..., :1] |= empty
            dead = empty[:, :, :, 0]
        out = F.scaled_dot_product_attention(qp, kp, v, attn_mask=allowed, scale=1.0)
    if not dummy and mask.key_log_weights is not None:
        # a row whose allowed keys all have log-weight -inf has no live key: zero, like the naive reference
        counts = allowed_key_counts(mask, dev, key_live=mask.key_log_weights > float("-inf"))
        no_live = counts == 0
        dead = no_live if dead is None else dead | no_live
    out = out[..., :dv]
    if dead is not None:
        out = torch.where(dead.unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=dev), out)
    return out


def sdpa_reason(mask: MaskArgs) -> str | None:
    """Why the sdpa backend cannot serve a call whatever the family, or None."""
    if mask.nk == 0:
        return "there are no keys (Nk = 0)"
    return None
