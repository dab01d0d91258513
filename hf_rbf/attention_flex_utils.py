"""FlexAttention plumbing shared by the four families: block masks, the compiled call, the LSE and the limits.

Each family's flex module writes its score as ``score_mod(q'.k', b, h, q_idx, kv_idx)``: the vector part comes from
flex's own ``q'.k'`` (so its gradients are flex's native ``dq``/``dk``), the rest from captured float32 tensors
(a per-key bias ``[B, H, Nk]``, scalar queries and keys), so the score is formed in float32 inside the kernel.
Normalisers that are not a plain softmax (GKA's ``eps``, softmax-free RBF) are applied afterwards from the
log-sum-exp that flex returns (natural log, float32, ``-inf`` for a row without any allowed key), which flex
differentiates.

The mask semantics of :mod:`hf_rbf.attention_utils` become a ``mask_mod`` and a ``BlockMask`` (fully masked
blocks are skipped, so sliding windows cost only their band).  On CUDA the call goes through ``torch.compile`` (the
fused Triton kernel, forward and backward); elsewhere flex runs eagerly (it materialises the scores, fine for tests
and small CPU calls).

One compiled callable per call signature (score_mod builder, shapes, dtypes, grad mode, mask): Dynamo keeps its
graphs, guards and recompilation count per code object, so a single ``torch.compile(fn)`` serving every shape and
family recompiled at each new one, turned dimensions dynamic, and after ``recompile_limit`` (8) distinct calls ran
the rest *eagerly*, scores materialised (Dynamo's documented behaviour; the likely cause of the training-speed
issue's sweep measuring our flex backend 5-14x slower than SDPA-flash where FlexAttention compiled per shape ran
1.3-1.9x; not yet re-measured on a GPU).  Here every signature gets a function with a code
object of its own, compiled with ``dynamic=False``: it compiles once, is never guarded against another shape, and
the least recently used of ``FLEX_CACHE_SIZE`` signatures is dropped.  ``create_block_mask`` is compiled the same
way.

What this torch's flex cannot do is stated, not hidden: flex has no backward outside CUDA, and on CUDA the
compiled backward could not differentiate scalar queries/keys/temperatures captured by a score_mod (torch 2.11:
the backward lowering failed for scalar attention and the hybrid backward fell back to atomics, about 300 times
slower).  :func:`flex_reason` turns those into sentences for the families' ``_candidates``.
"""

from __future__ import annotations

import collections
import types
import warnings

import torch

from .attention_utils import MaskArgs, allowed_key_counts


try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention
    create_block_mask = flex_attention = None
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # older torch: the LSE comes from return_lse=True
    AuxRequest = None


# Score biases are clamped to this magnitude (float32 captured tensors): a log-weight of -inf becomes a finite
# score whose weight is exactly zero next to any ordinary key, and never turns into NaN in the backward.
BIAS_LIMIT = 1e30
_BLOCK_MASK_CACHE: dict = {}
_BLOCK_MASK_CACHE_SIZE = 32
# compiled callables by call signature (see the module docstring), least recently used first
FLEX_CACHE_SIZE = 64
_COMPILED: collections.OrderedDict = collections.OrderedDict()
# the device types whose flex calls are compiled (tests add "cpu" with a cheap backend to check the caching)
COMPILE_DEVICE_TYPES = {"cuda"}
COMPILE_BACKEND = "inductor"


def flex_reason(device: torch.device, mask: MaskArgs, inputs: dict, captured_scalars: dict | None = None) -> str | None:
    """Why flex cannot serve a call, or None.

    Args:
        device: the inputs' device.
        mask: the validated mask arguments.
        inputs: every differentiable input by name (tensors or floats); decides whether a backward is needed.
        captured_scalars: the inputs that reach the score_mod as captured scalar tensors (qs, ks, tau): flex
            cannot differentiate them on CUDA (see the module docstring).
    """
    if flex_attention is None:
        return f"flex needs torch.nn.attention.flex_attention (torch >= 2.5); this is torch {torch.__version__}"
    if mask.nk == 0:
        return "there are no keys (Nk = 0)"
    if not torch.is_grad_enabled():
        return None
    needs_grad = [n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if needs_grad and device.type != "cuda":
        return (
            f"flex has no backward on {device.type} in torch {torch.__version__} and {_names(needs_grad)} "
            "require grad; call it under torch.no_grad() or use another backend"
        )
    grads = [n for n, t in (captured_scalars or {}).items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if grads:
        return (
            f"flex cannot differentiate {_names(grads)}: they enter its score_mod as captured tensors, whose "
            "compiled backward fails or falls back to atomics on CUDA; use sdpa or triton for training"
        )
    return None


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _mask_mod(mask: MaskArgs):
    """The mask semantics of :mod:`hf_rbf.attention_utils` as a flex ``mask_mod``."""
    p, w, causal = mask.num_prefix_keys, mask.window, mask.causal
    offset = mask.nk - p - mask.nq  # query i sits at position i + offset
    real = mask.attention_mask  # [B, Nk] bool or None

    def mask_mod(b, h, q_idx, kv_idx):
        t = q_idx + offset
        s = kv_idx - p
        if causal:
            ok = s <= t
            if w is not None:
                ok = ok & (t - s < w)
        elif w is not None:
            ok = (t - s < w) & (s - t < w)
        else:
            ok = kv_idx >= 0
        ok = ok | (kv_idx < p)
        if real is not None:
            ok = ok & real[b, kv_idx]
        return ok

    return mask_mod


# The smallest head dim compiled FlexAttention accepts for queries, keys and values (torch 2.11).
FLEX_MIN_DIM = 16


def block_mask_for(mask: MaskArgs, batch: int, device: torch.device):
    """The ``BlockMask`` of a call; cached by its shape and arguments when there is no padding mask."""
    key = None
    if mask.attention_mask is None:
        key = (mask.causal, mask.window, mask.num_prefix_keys, mask.nq, mask.nk, str(device))
        cached = _BLOCK_MASK_CACHE.get(key)
        if cached is not None:
            return cached
    b = batch if mask.attention_mask is not None else None
    signature = (mask.causal, mask.window, mask.num_prefix_keys, mask.nq, mask.nk, b, str(device))
    block_mask = _block_mask_builder(device, signature)(_mask_mod(mask), b, None, mask.nq, mask.nk, device)
    if key is not None:
        if len(_BLOCK_MASK_CACHE) >= _BLOCK_MASK_CACHE_SIZE:
            _BLOCK_MASK_CACHE.pop(next(iter(_BLOCK_MASK_CACHE)))
        _BLOCK_MASK_CACHE[key] = block_mask
    return block_mask


def _block_mask_builder(device: torch.device, signature: tuple):
    """``create_block_mask``, compiled on CUDA (so that it never materialises the ``[Nq, Nk]`` mask), the way torch
    2.11 asks for it: ``torch.compile(create_block_mask)`` (its ``_compile=True`` flag is deprecated), one compiled
    callable per mask signature."""
    if device.type not in COMPILE_DEVICE_TYPES:
        return create_block_mask
    return compiled_for(("block_mask", *signature), _create_block_mask)


def _create_block_mask(mask_mod, b, h, nq, nk, device):
    return create_block_mask(mask_mod, b, h, nq, nk, device=device)


def compiled_for(signature: tuple, fn):
    """``torch.compile(fn, dynamic=False)`` for one call signature, through a copy of ``fn`` with its own code object
    (Dynamo's caches and recompilation counts live on code objects); cached, least recently used dropped."""
    compiled = _COMPILED.get(signature)
    if compiled is not None:
        _COMPILED.move_to_end(signature)
        return compiled
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{len(_COMPILED)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    compiled = torch.compile(copy, dynamic=False, backend=COMPILE_BACKEND)
    _COMPILED[signature] = compiled
    if len(_COMPILED) > FLEX_CACHE_SIZE:
        _COMPILED.popitem(last=False)
    return compiled


def bias_score_mod(bias: torch.Tensor):
    """``score + bias[b, h, kv]``: a per-key bias ``[B, H, Nk]`` (float32), indexed once (flex can differentiate it)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, kv_idx]

    return score_mod


def _fixed_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view with its own sizes and strides: the same values, but Inductor gives the view a fixed layout
    (its ``as_strided`` lowering), which its flex_attention lowering needs of every input."""
    return torch.as_strided(t, t.shape, t.stride())


def _flex_call(q, k, v, block_mask, make_score_mod, captured: tuple, return_lse: bool, prepare=None):
    # The score_mod closure is built here, inside the compiled region, from tensors that are plain arguments:
    # a fresh closure passed from outside would make Dynamo guard on (and recompile for) every new function object.
    # `prepare` (a module-level function) turns the call's inputs into flex's: inside the compiled region its
    # elementwise ops and reductions (scaled queries, key-norm biases) fuse into a few kernels, forward and backward,
    # where eagerly each was a pass over q or k of its own.
    extra = None
    if prepare is not None:
        q0, k0, v0 = q, k, v
        q, k, v, captured, extra = prepare(q, k, v, *captured)
        # Inductor (torch 2.11) lowers flex_attention only over inputs of a fixed layout: a query computed in the
        # graph failed with "convert FlexibleLayout to FixedLayout first" (H100, benchmarks/results/
        # h100-2026-11-27o).  A view with explicit strides fixes each computed input's layout; the call's own
        # tensors have one already.
        q = q if q is q0 else _fixed_layout(q)
        k = k if k is k0 else _fixed_layout(k)
        v = v if v is v0 else _fixed_layout(v)
        captured = tuple(None if t is None else _fixed_layout(t) for t in captured)
    score_mod = make_score_mod(*captured)
    kwargs = {"score_mod": score_mod, "block_mask": block_mask, "scale": 1.0}
    if not return_lse:
        return flex_attention(q, k, v, **kwargs), None, extra
    if AuxRequest is not None:
        out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
        return out, aux.lse, extra
    out, lse = flex_attention(q, k, v, return_lse=True, **kwargs)
    return out, lse, extra


def _flex_callable(q, k, v, mask: MaskArgs, make_score_mod, captured: tuple, return_lse: bool, prepare=None):
    """``_flex_call`` itself (eager) off the compiled devices, else its compiled copy for this call's signature."""
    if q.device.type not in COMPILE_DEVICE_TYPES:
        return _flex_call

    def desc(t):
        # captured tensors may be None (no key log-weights): the score_mod then skips that term
        return None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)

    signature = (
        "flex",
        make_score_mod,
        prepare,
        return_lse,
        torch.is_grad_enabled(),
        str(q.device),
        desc(q),
        desc(k),
        desc(v),
        tuple(desc(t) for t in captured),
        (mask.causal, mask.window, mask.num_prefix_keys, mask.attention_mask is not None),
    )
    return compiled_for(signature, _flex_call)


def run_flex(q, k, v, make_score_mod, captured: tuple, mask: MaskArgs, *, return_lse: bool):
    """``flex_attention(q, k, v, make_score_mod(*captured), block_mask, scale=1)``; returns ``(out, lse or None)``.

    ``q``/``k``/``v`` are ``[B, H, N, *]`` in one dtype; ``make_score_mod`` is a module-level function building the
    score_mod from the ``captured`` tensors.  ``lse`` is the natural-log log-sum-exp ``[B, H, Nq]`` in float32
    (float64 for float64 inputs), ``-inf`` for rows without an allowed key.
    """
    out, lse, _ = run_flex_prepared(q, k, v, make_score_mod, captured, mask, return_lse=return_lse)
    return out, lse


def run_flex_prepared(q, k, v, make_score_mod, captured: tuple, mask: MaskArgs, *, return_lse: bool, prepare=None):
    """:func:`run_flex` with a ``prepare`` step inside the compiled call: ``prepare(q, k, v, *captured)`` (a
    module-level function) returns ``(q', k', v', captured', extra)``, flex runs on ``q', k', v'`` with
    ``make_score_mod(*captured')``, and ``(out, lse or None, extra)`` comes back.  ``q, k, v`` here are the call's
    own tensors (a family's unscaled queries, its keys), padded to flex's smallest head dim with zero columns, which
    must leave ``prepare``'s results unchanged (norms, dot products)."""
    if not torch.is_grad_enabled():
        # flex refuses leaf tensors that require grad outside CUDA even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    block_mask = block_mask_for(mask, q.shape[0], q.device)
    dv = v.shape[-1]
    # Compiled flex refuses head dims below 16 (found on the H200 with Dv = 8).  Zero columns change neither q.k nor
    # the output's real columns, and the padded output columns are sliced away; done on every device so the CPU
    # tests run the same padding.
    if q.shape[-1] < FLEX_MIN_DIM:
        q = torch.nn.functional.pad(q, (0, FLEX_MIN_DIM - q.shape[-1]))
        k = torch.nn.functional.pad(k, (0, FLEX_MIN_DIM - k.shape[-1]))
    if dv < FLEX_MIN_DIM:
        v = torch.nn.functional.pad(v, (0, FLEX_MIN_DIM - dv))
    captured = tuple(captured)
    fn = _flex_callable(q, k, v, mask, make_score_mod, captured, return_lse, prepare)
    with warnings.catch_warnings():
        # eager flex on CPU warns that it materialises the scores: that is the intended CPU path
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, lse, extra = fn(q, k, v, block_mask, make_score_mod, captured, return_lse, prepare)
    return out[..., :dv], lse, extra


def key_bias(bias: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """A per-key score bias ``[B|1, H|1, Nk]`` as the contiguous, finite ``[B, H, Nk]`` a score_mod indexes."""
    bias = torch.nan_to_num(bias, nan=0.0, posinf=BIAS_LIMIT, neginf=-BIAS_LIMIT).clamp(-BIAS_LIMIT, BIAS_LIMIT)
    return bias.expand(batch, heads, bias.shape[-1]).contiguous()


def per_query(t, batch: int, heads: int, nq: int, dtype, device) -> torch.Tensor:
    """A float or a tensor broadcastable to ``[B, H, Nq]`` as the contiguous ``[B, H, Nq]`` a score_mod indexes."""
    if not isinstance(t, torch.Tensor):
        return torch.full((batch, heads, nq), float(t), dtype=dtype, device=device)
    return t.to(dtype).expand(batch, heads, nq).contiguous()


def zero_rows_without_live_keys(out: torch.Tensor, mask: MaskArgs) -> torch.Tensor:
    """Zero the rows whose allowed keys all have log-weight ``-inf`` (the naive reference returns zeros there).

    The block mask already gives zeros for rows without any allowed key; a row whose keys only carry the clamped
    ``-BIAS_LIMIT`` bias would otherwise average them.
    """
    if mask.key_log_weights is None:
        return out
    counts = allowed_key_counts(mask, out.device, key_live=mask.key_log_weights > float("-inf"))
    return torch.where((counts == 0).unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
