"""Shared pieces of the four attention functions: argument checks, the mask semantics and backend choice.

Mask semantics (the same for every family and every backend)
------------------------------------------------------------
Queries are ``[B, H, Nq, ...]`` and keys ``[B, H, Nk, ...]``.  The first ``num_prefix_keys`` keys (``P``) form a
*prefix* (register tokens, a scalar sink): every query may see them, whatever ``causal`` and ``window`` say.  The
other ``Nk - P`` keys are sequence keys at positions ``s = 0 .. Nk - P - 1``.  The queries are the *last* ``Nq``
sequence positions (bottom-right alignment, as in a KV-cache decode step): query ``i`` sits at position
``t_i = (Nk - P) - Nq + i``.  A sequence key ``s`` is allowed for query ``i`` when

* ``causal``: ``s <= t_i``; with ``window=W`` also ``t_i - s < W`` (the last ``W`` positions, itself included);
* not ``causal``: every ``s``; with ``window=W`` only ``|t_i - s| < W`` (a symmetric band).

``attention_mask`` is the usual Hugging Face padding mask over the keys, ``[B, Nk]`` with 1 for a real token and 0
for padding; padded keys get no weight.  ``key_log_weights`` (``[B, Nk]`` or ``[B, H, Nk]``, a batch size of 1
broadcasts) adds ``log w_j`` to every score of key ``j``; a log-weight of ``-inf`` gives the key no weight at all, like
padding.  A query row with no allowed key (or whose allowed keys all have log-weight ``-inf``) returns zeros.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch


logger = logging.getLogger("hf_rbf")

BACKENDS = ("auto", "naive", "sdpa", "flex", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


@dataclass
class MaskArgs:
    """Normalised masking arguments handed to every backend.

    ``key_log_weights`` is ``None`` or a float tensor ``[B or 1, H or 1, Nk]``; ``attention_mask`` is ``None`` or a
    bool tensor ``[B, Nk]`` (True = real key).  ``nq`` / ``nk`` are the query and key lengths.
    """

    causal: bool
    window: int | None
    num_prefix_keys: int
    key_log_weights: torch.Tensor | None
    attention_mask: torch.Tensor | None
    nq: int
    nk: int

    @property
    def is_plain(self) -> bool:
        """True when nothing but (possibly) a square causal mask restricts the keys."""
        return (
            self.window is None
            and self.num_prefix_keys == 0
            and self.key_log_weights is None
            and self.attention_mask is None
            and (not self.causal or self.nq == self.nk)
        )


# ----------------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------------


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def autocast_inputs(*tensors):
    """The floating tensors in autocast's lower-precision dtype where autocast is on for their device, as PyTorch casts
    the inputs of its own ``scaled_dot_product_attention``; None and integer tensors pass through.

    Without it, a float32 input under bf16 autocast -- GKA's features, which no projection casts, the residual stream
    being float32 -- ran the fused kernels' matmuls in float32: 65 ms per backward call at d768 instead of about 0.3
    (``benchmarks/results/h100-profile-2026-11-25/run4-register-rows``).
    """
    first = tensors[0]  # (q: the first input of every caller; the generator only where it is None)
    if first is None:
        first = next(t for t in tensors if t is not None)
    device_type = first.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (e.g. "meta", as parameter counting uses)
        return tensors
    if not enabled:
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def check_tensor(op: str, name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor {layout}; got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: `{name}` must be a {ndim}-D tensor {layout}; got shape {_shape(t)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: `{name}` must have dtype {_DTYPE_NAMES}; got {t.dtype}")


def check_same(op: str, tensors: dict[str, torch.Tensor]) -> None:
    """All tensors share one dtype and one device."""
    values = iter(tensors.values())
    first = next(values)
    dtype, device = first.dtype, first.device
    for t in values:
        if t.dtype != dtype or t.device != device:
            break
    else:
        return  # (every layer and decode step: the names below are only for the error)
    names = list(tensors)
    for name in names[1:]:
        t = tensors[name]
        if t.dtype != first.dtype:
            raise TypeError(
                f"{op}: `{name}` has dtype {t.dtype} but `{names[0]}` has {first.dtype}; all inputs must share one dtype"
            )
        if t.device != first.device:
            raise ValueError(
                f"{op}: `{name}` is on {t.device} but `{names[0]}` is on {first.device}; all inputs must share one device"
            )


def check_dim(op: str, name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{op}: `{name}` has {what} {t.shape[dim]} (shape {_shape(t)}); expected {expected}")


def check_backend(op: str, backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{op}: `backend` must be one of {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}")
    return backend


WEIGHTS_BACKENDS = ("auto", "naive")


def check_return_weights(op: str, return_weights, backend) -> bool:
    """Validate ``return_weights``: a bool; when True only the materialised reference ("auto" or "naive") can serve."""
    if not isinstance(return_weights, bool):
        raise TypeError(f"{op}: `return_weights` must be True or False; got {return_weights!r}")
    if return_weights:
        check_backend(op, backend)
        if backend not in WEIGHTS_BACKENDS:
            raise ValueError(
                f"{op}: `return_weights=True` needs the materialised reference path, so `backend` must be one of "
                f"{', '.join(repr(b) for b in WEIGHTS_BACKENDS)} (\"auto\" then serves with \"naive\"); got "
                f"backend={backend!r}"
            )
    return return_weights


def check_prefix(op: str, q, k, v, prefix_keys, prefix_values, num_prefix_keys) -> int:
    """Validate separate prefix keys ``[B or 1, H, R, D]`` and values ``[B or 1, G, R, Dv]`` (``G`` = the value heads of
    ``v``) against ``q`` / ``k`` / ``v``; returns their count ``R`` (``num_prefix_keys`` must be 0 or ``R``)."""
    if prefix_keys is None or prefix_values is None:
        raise ValueError(f"{op}: `prefix_keys` and `prefix_values` go together; got only one of them")
    check_tensor(op, "prefix_keys", prefix_keys, 4, "[B or 1, H, R, D]")
    check_tensor(op, "prefix_values", prefix_values, 4, "[B or 1, G, R, Dv]")
    check_same(op, {"q": q, "prefix_keys": prefix_keys, "prefix_values": prefix_values})
    b = q.shape[0]
    r = prefix_keys.shape[2]
    for name, t, ref in (("prefix_keys", prefix_keys, k), ("prefix_values", prefix_values, v)):
        if t.shape[0] not in (1, b) or t.shape[1] != ref.shape[1] or t.shape[2] != r or t.shape[3] != ref.shape[3]:
            raise ValueError(
                f"{op}: `{name}` must have shape [{b} or 1, {ref.shape[1]}, R, {ref.shape[3]}] with the same R as "
                f"`prefix_keys`; got {tuple(t.shape)}"
            )
    if num_prefix_keys not in (0, r):
        raise ValueError(
            f"{op}: with `prefix_keys` the prefix is its R = {r} keys; `num_prefix_keys` must be 0 or {r}, got "
            f"{num_prefix_keys!r}"
        )
    return r


def with_prefix(k: torch.Tensor, v: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor):
    """The prefix concatenated in front of the keys / values (the backends that take no separate prefix)."""
    b = k.shape[0]
    k = torch.cat([prefix_keys.expand(b, -1, -1, -1), k], dim=2)
    v = torch.cat([prefix_values.expand(b, -1, -1, -1), v], dim=2)
    return k, v


def normalize_mask_args(
    op: str,
    *,
    batch: int,
    heads: int,
    nq: int,
    nk: int,
    device: torch.device,
    causal,
    window,
    num_prefix_keys,
    key_log_weights,
    attention_mask,
) -> MaskArgs:
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: `causal` must be True or False; got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"{op}: `window` must be None or a positive int (the number of visible positions); got {window!r}")
    if isinstance(num_prefix_keys, bool) or not isinstance(num_prefix_keys, int) or not 0 <= num_prefix_keys <= nk:
        raise ValueError(f"{op}: `num_prefix_keys` must be an int in [0, Nk={nk}]; got {num_prefix_keys!r}")

    klw = None
    if key_log_weights is not None:
        if not isinstance(key_log_weights, torch.Tensor) or not key_log_weights.is_floating_point():
            raise TypeError(f"{op}: `key_log_weights` must be a floating-point tensor [B, Nk] or [B, H, Nk]")
        if key_log_weights.device != device:
            raise ValueError(f"{op}: `key_log_weights` is on {key_log_weights.device}; the inputs are on {device}")
        klw = key_log_weights
        if klw.dim() == 2:
            klw = klw.unsqueeze(1)
        if klw.dim() != 3 or klw.shape[0] not in (1, batch) or klw.shape[1] not in (1, heads) or klw.shape[2] != nk:
            raise ValueError(
                f"{op}: `key_log_weights` must have shape [B, Nk] or [B, H, Nk] = [{batch}, {nk}] or "
                f"[{batch}, {heads}, {nk}] (a batch size of 1 broadcasts); got {_shape(key_log_weights)}"
            )

    am = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"{op}: `attention_mask` must be a tensor [B, Nk] with 1 = real token, 0 = padding")
        if attention_mask.dim() != 2 or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[1] != nk:
            raise ValueError(
                f"{op}: `attention_mask` must have shape [B, Nk] = [{batch}, {nk}] (1 = real token, 0 = padding); "
                f"got {_shape(attention_mask)}"
            )
        if attention_mask.device != device:
            raise ValueError(f"{op}: `attention_mask` is on {attention_mask.device}; the inputs are on {device}")
        am = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        # (eagerly the same tensor where no expansion is needed: no view op per call; traced graphs keep the expand)
        if am.shape[0] != batch or torch.compiler.is_compiling():
            am = am.expand(batch, nk)

    return MaskArgs(
        causal=causal,
        window=window,
        num_prefix_keys=num_prefix_keys,
        key_log_weights=klw,
        attention_mask=am,
        nq=nq,
        nk=nk,
    )


# float arguments as the fused kernels' coefficient tensors, made once per (value, shape, device) and never written:
# a model's layers pass the same float at every call, and a new device tensor per call is one more op of host work per
# layer and step (bounded: cleared when it reaches _CONSTANTS_MAX entries)
_CONSTANTS: dict = {}
_CONSTANTS_MAX = 256


def parameter_values_keepable(device) -> bool:
    """Whether a value computed from a parameter on ``device`` (a decode step's temperature, sink, GKA's
    ``1 / (2 sigma^2)``) may be kept while the parameter is the same tensor with the same version counter and data
    pointer: where :func:`tensors_keepable` allows it.

    Not in a process where ``torch.distributed`` is initialised: FSDP2 writes each forward's gathered weights into the
    same unsharded parameter tensors with their version counters preserved, at addresses the allocator may repeat, so
    an evaluation forward between two training steps read a kept temperature from the step before (a flaky
    ``test_replays_under_fsdp2_copy_the_gathered_weights_in[hybrid_sort]``, 1e-4 off in 1 run of about 6);
    ZeRO-3-style sharding swaps ``.data`` alike.  There every call computes the value (a few microseconds per layer).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return tensors_keepable(device)


def tensors_keepable(device) -> bool:
    """Whether a tensor made now on ``device`` may be kept for later calls (this module's constants, the decode
    kernels' scratch, values kept per parameter): not while a CUDA graph is captured, and on CUDA only on the
    device's default stream.

    Where allocations may land in a CUDA graph's private memory pool, a kept tensor would outlive what the pool's
    owner tracks.  ``torch.compile(mode="reduce-overhead")`` (``generate``'s compiled static decode step) runs our
    custom ops' Python inside cudagraph trees' warm-up and recording, on the trees' own stream, with every allocation
    of the thread routed to their pool: the split-K decode's four scratch buffers kept there made the next model's
    recording fail with "Detected 4 tensor(s) in the cudagraph pool not tracked as outputs" (every family's static
    ``generate`` after another model's on an H200, benchmarks/results/h200x2-2026-11-28e), and a tensor filled during
    a capture holds nothing until the graph replays.  Both run on a side stream (a capture must), so the default
    stream is the test; a caller on a stream of its own computes its constants per call."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    return torch._C._cuda_getCurrentRawStream(-1 if device.index is None else device.index) == 0


def constant_vector(value: float, shape: tuple, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` (float32 unless given) filled with ``value`` on ``device``, cached
    (read-only: the kernels only read it; under ``torch.compile`` a fresh graph constant, and where
    :func:`tensors_keepable` says no, a fresh tensor)."""
    if torch.compiler.is_compiling() or not tensors_keepable(device):
        return torch.full(shape, value, device=device, dtype=dtype)
    key = (value, shape, str(device), dtype)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) >= _CONSTANTS_MAX:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.full(shape, value, device=device, dtype=dtype)
    return t


# [rows, capacity] all-True key masks per (device, rows, inference mode), and by id: see `all_true_mask`
_ALL_TRUE: dict = {}
_ALL_TRUE_BY_ID: dict = {}


def all_true_mask(rows: int, n: int, device: torch.device) -> torch.Tensor:
    """A read-only all-True bool key mask ``[rows, n]``: a view of a buffer kept per device and row count (grown by
    doubling), so that a decode step's mask over keys known to be valid costs one view, not an allocation and a fill
    per layer; :func:`is_all_true_mask` recognises it.  Read only: every consumer of a mask only reads it."""
    if not tensors_keepable(device):
        return torch.ones(rows, n, dtype=torch.bool, device=device)
    key = (torch.device(device), rows, torch.is_inference_mode_enabled())  # (inference tensors: no backward)
    t = _ALL_TRUE.get(key)
    if t is None or t.shape[1] < n:
        if t is None and len(_ALL_TRUE) >= _CONSTANTS_MAX:
            _ALL_TRUE.clear()
            _ALL_TRUE_BY_ID.clear()
        if t is not None:
            _ALL_TRUE_BY_ID.pop(id(t), None)
        width = max(n, 256 if t is None else 2 * t.shape[1])
        t = _ALL_TRUE[key] = torch.ones(rows, width, dtype=torch.bool, device=device)
        _ALL_TRUE_BY_ID[id(t)] = t
    return t.narrow(1, 0, n)


def is_all_true_mask(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is a view that :func:`all_true_mask` made (every key valid), without reading it."""
    base = mask._base
    return base is not None and _ALL_TRUE_BY_ID.get(id(base)) is base


def per_head_param(op: str, name: str, value, heads: int, device, *, positive: bool = True, allow_none=False):
    """A float or a per-head tensor ``[H]`` (a 0-d tensor is expanded to ``[H]``); returns a float or a tensor [H]."""
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{op}: `{name}` must be a float or a tensor of shape [H] = [{heads}]")
    if isinstance(value, bool):
        raise TypeError(f"{op}: `{name}` must be a float or a tensor of shape [H] = [{heads}]; got {value!r}")
    if isinstance(value, (int, float)):
        value = float(value)
        if not math.isfinite(value) or (positive and value <= 0):
            kind = "a positive finite" if positive else "a finite"
            raise ValueError(f"{op}: `{name}` must be {kind} float or a tensor [H]; got {value!r}")
        return value
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a float or a floating-point tensor of shape [H] = [{heads}]")
    if value.device != device:
        raise ValueError(f"{op}: `{name}` is on {value.device}; the inputs are on {device}")
    if value.dim() == 0:
        return value.expand(heads)
    if value.dim() != 1 or value.shape[0] != heads:
        raise ValueError(f"{op}: `{name}` must be a float, a 0-d tensor or a tensor of shape [H] = [{heads}]; got {_shape(value)}")
    return value


def per_query_param(op: str, name: str, value, batch: int, heads: int, nq: int, device):
    """A positive float, a per-head tensor ``[H]`` or a tensor broadcastable to ``[B, H, Nq]``.

    Returns a float or a 3-D tensor ``[B or 1, H or 1, Nq or 1]``.
    """
    layout = f"a positive float, a tensor [H] = [{heads}] (per head) or a tensor broadcastable to [B, H, Nq] = [{batch}, {heads}, {nq}]"
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{op}: `{name}` must be {layout}; got {value!r}")
    if isinstance(value, (int, float)):
        value = float(value)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{op}: `{name}` must be {layout}; got {value!r}")
        return value
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be {layout}; got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{op}: `{name}` is on {value.device}; the inputs are on {device}")
    if value.dim() == 0:
        return value.reshape(1, 1, 1)
    if value.dim() == 1:
        if value.shape[0] != heads:
            raise ValueError(f"{op}: a 1-D `{name}` is per head and must have shape [H] = [{heads}]; got {_shape(value)}")
        return value.reshape(1, heads, 1)
    if value.dim() > 3:
        raise ValueError(f"{op}: `{name}` must be {layout}; got shape {_shape(value)}")
    v3 = value.reshape((1,) * (3 - value.dim()) + tuple(value.shape))
    for size, full, what in zip(v3.shape, (batch, heads, nq), ("B", "H", "Nq")):
        if size not in (1, full):
            raise ValueError(f"{op}: `{name}` must be {layout}; got shape {_shape(value)} ({what} does not broadcast)")
    return v3


# ----------------------------------------------------------------------------------------------------------------
# the allowed-pairs mask (used by the naive and sdpa backends and by tests)
# ----------------------------------------------------------------------------------------------------------------


def allowed_positions(nq: int, nk: int, causal: bool, window: int | None, num_prefix_keys: int, device) -> torch.Tensor:
    """Bool ``[Nq, Nk]``: which keys each query may see, before padding (see the module docstring)."""
    p = num_prefix_keys
    t = torch.arange(nq, device=device).unsqueeze(1) + (nk - p - nq)  # query positions
    j = torch.arange(nk, device=device).unsqueeze(0)
    s = j - p  # key positions (negative for the prefix)
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (s <= t)
        if window is not None:
            allowed = allowed & (t - s < window)
    elif window is not None:
        allowed = allowed & ((t - s).abs() < window)
    return allowed | (j < p)


def allowed_mask(mask: MaskArgs, device) -> torch.Tensor:
    """Bool ``[B or 1, 1, Nq, Nk]``: positions and padding combined."""
    allowed = allowed_positions(mask.nq, mask.nk, mask.causal, mask.window, mask.num_prefix_keys, device)[None, None]
    if mask.attention_mask is not None:
        allowed = allowed & mask.attention_mask[:, None, None, :]
    return allowed


def allowed_key_counts(mask: MaskArgs, device, key_live: torch.Tensor | None = None) -> torch.Tensor:
    """Int ``[B or 1, H or 1, Nq]``: how many keys each query may see, in ``O(B * H * Nk)`` (no ``[Nq, Nk]`` mask).

    A key counts when the positions allow it, ``attention_mask`` marks it real and ``key_live`` (a bool
    ``[B or 1, H or 1, Nk]``, e.g. ``key_log_weights > -inf``) is true.  Every allowed set is the prefix plus one
    contiguous range of sequence positions, so a cumulative sum over the keys gives each row's count.
    """
    nq, nk, p, w = mask.nq, mask.nk, mask.num_prefix_keys, mask.window
    live = torch.ones(1, 1, nk, dtype=torch.bool, device=device)
    if mask.attention_mask is not None:
        live = live & mask.attention_mask[:, None, :]
    if key_live is not None:
        live = live & key_live
    # cum[..., j] = number of live keys among the first j keys
    cum = torch.nn.functional.pad(live.to(torch.int32).cumsum(-1), (1, 0))
    n_seq = nk - p
    t = torch.arange(nq, device=device) + (n_seq - nq)  # query positions
    if mask.causal:
        hi = t
        lo = t - w + 1 if w is not None else torch.zeros_like(t)
    else:
        hi = t + w - 1 if w is not None else torch.full_like(t, n_seq - 1)
        lo = t - w + 1 if w is not None else torch.zeros_like(t)
    lo = lo.clamp(min=0)
    hi = hi.clamp(max=n_seq - 1)
    nonempty = hi >= lo
    # keys lo..hi are columns p+lo .. p+hi, so their count is cum[p + hi + 1] - cum[p + lo]
    end = (p + hi + 1).clamp(0, nk)
    start = (p + lo).clamp(0, nk)
    seq_count = cum.index_select(-1, end) - cum.index_select(-1, start)
    seq_count = torch.where(nonempty, seq_count, torch.zeros_like(seq_count))
    return cum[..., p : p + 1] + seq_count


def expand_value_groups(v: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, G, N, Dv]`` -> ``[B, H, N, Dv]``: head ``h`` reads group ``h // (H // G)``."""
    groups = v.shape[1]
    return v if groups == heads else v.repeat_interleave(heads // groups, dim=1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the reference paths compute in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_kernel_average(
    scores: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    *,
    normalize: bool = True,
    eps: float = 0.0,
    return_weights: bool = False,
):
    """``out_i = sum_j w_ij v_j`` over the allowed ``j``, the reference core of every family.

    ``scores`` are log-weights ``[B, H, Nq, Nk]``; with ``normalize`` ``w_ij = exp(s_ij) / (sum_j' exp(s_ij') + eps)``
    (``eps = 0`` is the softmax); without it ``w_ij = exp(s_ij)``.  Rows without any allowed key give zeros and no NaN,
    in the output or in the gradients.

    Returns ``out`` ``[B, H, Nq, Dv]``, or ``(out, weights)`` with ``return_weights``: the ``w_ij`` ``[B, H, Nq, Nk]``
    in the dtype of ``scores``, 0 on disallowed keys (``out == weights @ values``).
    """
    if scores.shape[-1] == 0:
        # no keys at all: every row is empty; the (zero) product keeps the result in the autograd graph
        weights = scores.exp()
        return (weights @ values, weights) if return_weights else weights @ values
    neg_inf = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~allowed, neg_inf)
    if not normalize:
        weights = torch.exp(scores).masked_fill(~allowed, 0.0)
        return (weights @ values, weights) if return_weights else weights @ values
    # The row maximum is a constant shift: exp(s - m) / (sum exp(s - m) + eps * exp(-m)) is exact for any m.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_ok = allowed.any(dim=-1, keepdim=True) & torch.isfinite(row_max)
    row_max = torch.where(row_ok, row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max).masked_fill(~allowed, 0.0)
    denom = p.sum(dim=-1, keepdim=True)
    if eps:
        denom = denom + eps * torch.exp(-row_max)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    if return_weights:
        weights = p / denom
        return weights @ values, weights
    return (p / denom) @ values


# ----------------------------------------------------------------------------------------------------------------
# backend choice
# ----------------------------------------------------------------------------------------------------------------

_LOGGED: set = set()
_LAST_CHOICE: dict[str, str] = {}


def last_backend(op: str | None = None):
    """The backend that served the last call of ``op`` (e.g. ``"rbf_attention"``), or the whole table."""
    return dict(_LAST_CHOICE) if op is None else _LAST_CHOICE.get(op)


def note_backend_choice(op: str, backend: str, device: torch.device, requested: str) -> None:
    """Record (and log once) that ``backend`` served a call of ``op`` that a model made to a backend function directly
    (see ``hf_rbf.modeling_decoder.direct_decode_calls``), as ``choose_backend`` does for the public functions."""
    _note_choice(op, backend, device, requested, [])


def _note_choice(op: str, backend: str, device: torch.device, requested: str, skipped: list[str]) -> None:
    if torch.compiler.is_compiling():
        return
    _LAST_CHOICE[op] = backend
    key = (op, backend, device.type, requested)
    if key not in _LOGGED:
        _LOGGED.add(key)
        why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
        logger.info("%s: backend=%r on %s (requested %r)%s", op, backend, device.type, requested, why)


def flex_auto_reason(device: torch.device, requested: str) -> str | None:
    """"auto" takes flex only on CUDA: elsewhere flex runs eagerly and materialises the scores (ask for it by name)."""
    if requested == "auto" and device.type != "cuda":
        return f"auto uses flex only on CUDA (on {device.type} flex runs eagerly); ask for backend='flex' explicitly"
    return None


def choose_weights_backend(op: str, requested: str, device: torch.device) -> str:
    """The backend of a ``return_weights=True`` call (already validated by :func:`check_return_weights`): always
    "naive", recorded for :func:`last_backend` like any other choice."""
    skipped = ["return_weights=True needs the materialised weights"] if requested == "auto" else []
    _note_choice(op, "naive", device, requested, skipped)
    return "naive"


def choose_backend(op: str, requested: str, device: torch.device, candidates: dict) -> tuple[str, object]:
    """Pick the implementation.

    ``candidates`` maps a backend name to ``(fn, reason)`` where ``reason`` is ``None`` when the backend can serve
    this call and otherwise a sentence saying why not, or a function of no arguments that returns one of the two:
    such a reason is only worked out when the choice reaches its backend (the fastest backend usually serves, and the
    checks of the others cost host time on every call).  An explicit backend that cannot serve raises; "auto" takes
    the first that can in the order of ``candidates`` (fastest first) and logs its choice once.
    """
    check_backend(op, requested)
    if requested != "auto":
        if requested not in candidates:
            available = ", ".join(repr(b) for b in ("auto", *candidates))
            raise ValueError(f"{op}: backend={requested!r} is not available for this function (available: {available})")
        fn, reason = candidates[requested]
        reason = reason() if callable(reason) else reason
        if reason is not None:
            raise ValueError(f"{op}: backend={requested!r} cannot serve this call: {reason}")
        _note_choice(op, requested, device, requested, [])
        return requested, fn
    skipped = []
    for name, (fn, reason) in candidates.items():
        reason = reason() if callable(reason) else reason
        if reason is None:
            _note_choice(op, name, device, requested, skipped)
            return name, fn
        skipped.append(f"{name}: {reason}")
    raise ValueError(f"{op}: no backend can serve this call ({'; '.join(skipped)})")
