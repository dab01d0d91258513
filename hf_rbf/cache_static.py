"""Fixed-capacity ("static") KV cache for the rbf / gka / dot layers: ``generate(..., cache_implementation="static")``.

Why a cache of our own and not transformers' ``StaticCache``: register tokens are a constant prefix that every forward
recomputes (they never enter the cache), GKA stores each token's feature once (keys = values), and our attention
functions take per-key masks (``attention_mask [B, Nk]``) rather than transformers' 4-D masks.  The layer keeps
transformers' ``StaticLayer`` contract (buffers allocated once, written in place with ``index_copy_`` at a device-side
``cumulative_length``, ``is_compileable = True``), so ``generate`` treats the cache as compileable and
``torch.compile(model.forward, fullgraph=True)`` of a decode step has no data-dependent shape and no host
synchronisation.

Two ways through a layer (chosen by the number of new tokens, a Python int known at trace time)
--------------------------------------------------------------------------------------------
* decode (1 new token, what is compiled): the token is written at its slot and the *whole* buffer is returned,
  ``[B, H, C, D]``; :meth:`StaticKeyValueLayer.slot_mask` ``[B, C]`` says which slots the query may see (written, not
  padding; for sliding layers the ring holds exactly the window).  With one query at the last key position, the
  attention functions' causal rule (bottom-right aligned) allows every slot, so the mask alone decides: exact.
* prefill (N > 1 new tokens, eager): the tokens are written and the keys are returned *in sequence order*, sliced
  to the tokens that exist (full layers: the first ``past + N`` slots; sliding layers: the last ``window - 1``
  cached tokens, gathered in order, then the new ones), so the usual causal / window / padding masks apply as in a
  ``DynamicCache`` (the padding of cached tokens comes from the layer's slot validity, so the step's
  ``attention_mask`` may cover the new tokens only).  This is also the path of chunked prefill
  (``generate(..., prefill_chunk_size=...)``).

Sliding-window layers keep a ring of ``min(window, max_cache_len)`` slots (token ``t`` at slot ``t % C``); full
layers keep ``max_cache_len`` slots.  Memory per cached token and layer: ``2 * H * head_dim * bytes`` (rbf / dot:
keys and values), ``H * head_dim * bytes`` (gka: one feature), plus one byte of slot mask per row.

One tensor per buffer kind for all the layers (:class:`StackedBuffers`)
----------------------------------------------------------------------
The layers of one :class:`StaticDecoderCache` built with the same ``share_key`` (the model passes the attention kind)
and the same sizes hold their buffers in one tensor per kind, the layers along dim 0 (``keys [L, B, H, C, D]``, ...);
a layer's ``keys`` is the slice ``[slot]`` of it (contiguous, at a fixed address).  Why: a compiled decode step
guards on every tensor it reads from its inputs, and the guards are checked on the host before every step
(``TorchDynamo Cache Lookup``): with a tensor per layer and kind a 12-layer scalar_sort step guarded 270 tensors
(Llama: 150), 474 us of host time per step on an H100 host (issue 13).  Through one stacked tensor per kind the
cache's buffers are guarded once, whatever the number of layers (``benchmarks/count_decode_guards.py``,
``tests/test_static_cache_guards.py``).  Slices of one base taken *outside* the step would each be an input of
their own (guarded, plus aliasing guards): the step reaches the stack through the layer and slices it itself.
Writes go to the stack itself (:func:`index_copy_into`: one ``index_put_`` on the stack), not to the layer's
slice: inductor writes a mutated graph input in place, but a mutated slice of one it rebuilt whole
(``select_scatter``), a copy of every layer's buffer at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class StackedBuffers:
    """The buffers of ``size`` cache layers that hold the same kinds of buffers with the same shapes: one tensor per
    kind, ``[size, *shape]``, the layers along dim 0 (see the module docstring for why).

    :meth:`claim` allocates every kind at the first layer's call (from that layer's shapes) and hands out slots;
    a layer reads its buffer of kind ``name`` as ``getattr(stack, name)[slot]`` and writes through
    :func:`index_copy_into`.  The tensors keep their addresses for the cache's lifetime (``reset`` of the layers fills
    their slices in place), as CUDA graphs of a compiled step need."""

    def __init__(self, size: int):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"StackedBuffers: `size` must be an int >= 1; got {size!r}")
        self.size = size
        self.layout = None  # {name: (shape, dtype, device)} of one layer, fixed by the first claim
        self.next_slot = 0

    def claim(self, specs: dict) -> int | None:
        """The slot of a layer whose buffers are ``specs`` (``name -> (shape, dtype, device, fill value)``, ``None``
        entries: kinds the layer does not hold); every kind is allocated (filled) at the first claim.  None when the
        stack is full or ``specs`` differ from the first layer's (the layer then holds buffers of its own, and its
        slot here stays unused: layers of one ``share_key`` are meant to have one layout)."""
        specs = {name: spec for name, spec in specs.items() if spec is not None}
        layout = {name: (tuple(spec[0]), spec[1], torch.device(spec[2])) for name, spec in specs.items()}
        if self.layout is None:
            self.layout = layout
            for name, (shape, dtype, device, fill) in specs.items():
                buffer = torch.full((self.size, *shape), fill, dtype=dtype, device=device)
                if not _compiling():
                    torch._dynamo.mark_static_address(buffer)
                setattr(self, name, buffer)
        elif layout != self.layout or self.next_slot >= self.size:
            return None
        slot = self.next_slot
        self.next_slot += 1
        return slot

    def get(self, name: str):
        return getattr(self, name, None)


def index_copy_into(stack: torch.Tensor, slot: int, dim: int, index: torch.Tensor, source: torch.Tensor) -> None:
    """``stack[slot].index_copy_(dim, index, source)`` as one ``index_put_`` on ``stack`` itself.

    Same result; under ``torch.compile`` inductor writes the stack (a graph input) in place, where the slice's
    ``index_copy_`` was functionalised into a ``select_scatter`` of the whole stack (a copy of every layer's buffer
    at every step).  ``index`` ``[n]`` int64 on the stack's device, distinct entries; ``source`` the slice's shape with
    ``n`` at ``dim``."""
    indices = [torch.full_like(index, slot)] + [None] * dim + [index]
    # the indexed dims of the result come first (non-adjacent advanced indices), or in place when dim == 0
    torch.ops.aten.index_put_(stack, indices, source.movedim(dim, 0))


def _stacked(name: str, doc: str) -> property:
    """A layer's buffer of kind ``name``: the slice ``[slot]`` of its :class:`StackedBuffers` (None before the
    layer's first write, or a kind the layer does not hold).  Eager code reads the slice taken once (``_views``, no
    view op per read); a compiled step takes it from the stacked tensor, its one graph input of that kind."""

    def get(self):
        if self._slot is None:
            return None
        if not _compiling():
            return self._views.get(name)
        buffer = self._stack.get(name)
        return None if buffer is None else buffer[self._slot]

    def set_(self, value):
        if value is not None:
            raise AttributeError(
                f"{type(self).__name__}.{name} is a slice of the cache's stacked buffers: write into it in place"
            )

    return property(get, set_, doc=doc)


class StackedLayerMixin:
    """The buffer bookkeeping of the static layers: ``_stack`` (a :class:`StackedBuffers`, shared by the layers of a
    cache with the same :attr:`stack_key`, or the layer's own) and ``_slot`` (the layer's index in it)."""

    _stack = None
    _slot = None
    _views = None  # {name: the slice [slot] of each stacked buffer}, for eager code
    share_key = None

    @property
    def stack_key(self):
        """Layers of one :class:`StaticDecoderCache` with equal, not-None keys share one :class:`StackedBuffers`."""
        return None

    def _claim_buffers(self, specs: dict) -> None:
        """Take a slot of the shared stack (or, when it cannot serve ``specs``, allocate buffers of the layer's own)."""
        slot = None if self._stack is None else self._stack.claim(specs)
        if slot is None:
            self._stack = StackedBuffers(1)
            slot = self._stack.claim(specs)
        self._slot = slot
        self._views = {name: getattr(self._stack, name)[slot] for name in self._stack.layout}

    def buffers(self) -> dict:
        """The layer's buffers by kind (its slices of the stacked tensors; empty before the first write)."""
        return dict(self._views or {})

    def _put(self, name: str, dim: int, index: torch.Tensor, source: torch.Tensor) -> None:
        """``self.<name>.index_copy_(dim, index, source)``: compiled, into the stack (:func:`index_copy_into`);
        eager, into the slice (the same memory, and a third of the host time of the ``index_put_``)."""
        if _compiling():
            index_copy_into(self._stack.get(name), self._slot, dim, index, source)
        else:
            self._views[name].index_copy_(dim, index, source)

    def _own_buffers(self, transform, names) -> None:
        """Move the layer to buffers of its own, ``transform(buffer)`` for the kinds in ``names`` (a batch change:
        beam expansion, selection), a copy for the others."""
        specs, data = {}, {}
        for name in self._stack.layout:
            buffer = getattr(self, name)
            new = transform(buffer) if name in names else buffer.clone()
            specs[name] = (tuple(new.shape), new.dtype, new.device, 0)
            data[name] = new
        self._stack, self._slot = StackedBuffers(1), None
        self._claim_buffers(specs)
        for name, new in data.items():
            getattr(self, name).copy_(new)


class StaticKeyValueLayer(StackedLayerMixin, CacheLayerMixin):
    """One layer's fixed-capacity keys ``[B, H, C, Dk]`` and values ``[B, H, C, Dv]`` (``Dv = 0`` for GKA, whose
    values are its keys), the slot validity ``[B, C]`` and the token index of every slot ``[C]`` (-1 when empty).

    Args:
        max_cache_len: the most tokens one sequence may hold (prompt + generated), the capacity of full layers.
        sliding_window: the layer's window ``W`` (None: full attention); the layer then keeps a ring of
            ``min(W, max_cache_len)`` slots, enough for a query that sees its last ``W`` tokens (itself included).
        share_key: layers of one :class:`StaticDecoderCache` with the same ``share_key`` (None: none) and capacity
            receive keys and values of the same shapes and hold their buffers stacked (:class:`StackedBuffers`); the
            model passes its attention kind.
    """

    is_compileable = True
    is_croppable = False
    supports_early_init = False

    keys = _stacked("keys", "``[B, H, C, Dk]``")
    values = _stacked("values", "``[B, Hv, C, Dv]`` (``Dv = 0`` for GKA)")
    valid = _stacked("valid", "``[B, C]`` bool: the slot holds a real (not padding) token")
    token_index = _stacked("token_index", "``[C]`` int64: the token at each slot (-1: empty)")
    _length = _stacked("cumulative_length", "``[]`` int64: the tokens seen")

    def __init__(self, max_cache_len: int, sliding_window: int | None = None, *, share_key=None):
        super().__init__()
        if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
            raise ValueError(f"StaticKeyValueLayer: `max_cache_len` must be an int >= 1; got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.capacity = max_cache_len if sliding_window is None else min(sliding_window, max_cache_len)
        self.is_ring = self.capacity < max_cache_len
        self.share_key = share_key
        self.decode_mode = False  # whether the last update returned the whole buffer
        # [B, keys returned] validity of the keys the last update returned (padding and unwritten slots False): the
        # text-key mask of the attention call, so a forward needs no mask over the cached tokens
        self.slot_mask = None

    @property
    def cumulative_length(self) -> torch.Tensor:
        """The device-side length, as transformers' ``StaticLayer``: a tensor, so a compiled step does not specialise
        on it (a slice of the cache's stacked lengths)."""
        length = self._length
        return torch.zeros((), dtype=torch.long) if length is None else length

    @property
    def stack_key(self):
        return None if self.share_key is None else (type(self), self.capacity, self.share_key)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        c, dev = self.capacity, self.device
        self._claim_buffers({
            "keys": ((b, h, c, dk), key_states.dtype, dev, 0),
            "values": ((b, value_states.shape[1], c, dv), value_states.dtype, dev, 0),
            "valid": ((b, c), torch.bool, dev, False),
            "token_index": ((c,), torch.long, dev, -1),
            "cumulative_length": ((), torch.long, dev, 0),
        })  # fmt: skip
        self.is_initialized = True

    def _write(self, slots: torch.Tensor, positions: torch.Tensor, keys, values, valid) -> None:
        self._put("keys", 2, slots, keys)
        if values.shape[-1] > 0:
            self._put("values", 2, slots, values)
        self._put("valid", 1, slots, valid)
        self._put("token_index", 0, slots, positions)

    def update(self, key_states, value_states, cache_kwargs: dict | None = None, *args, **kwargs):
        """Write ``N`` new tokens (``cache_kwargs["valid"] [B, N]``: False = padding) and return the keys / values the
        attention reads: the whole buffer for ``N == 1`` (see :attr:`slot_mask`), else the tokens in sequence order."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        b = key_states.shape[0]
        valid = (cache_kwargs or {}).get("valid")
        if valid is None:
            valid = torch.ones(b, n, dtype=torch.bool, device=self.device)
        valid = valid.to(device=self.device, dtype=torch.bool).expand(b, n)
        positions = torch.arange(n, device=self.device) + self.cumulative_length
        if n == 1:
            slots = positions % self.capacity if self.is_ring else positions
            self._write(slots, positions, key_states, value_states, valid)
            self.cumulative_length.add_(1)
            self.decode_mode = True
            self.slot_mask = self.valid & (self.token_index >= 0)
            return self.keys, self.values
        # prefill (eager): host-side lengths are fine here
        past = int(self.cumulative_length)
        if not self.is_ring and past + n > self.capacity:
            raise ValueError(
                f"static cache: {past} cached + {n} new tokens exceed `max_cache_len` = {self.capacity}; build the "
                "cache with a larger `max_cache_len` (generate sizes it from `max_length`)"
            )
        self.decode_mode = False
        if not self.is_ring:
            self._write(positions, positions, key_states, value_states, valid)
            self.cumulative_length.add_(n)
            self.slot_mask = self.valid[:, : past + n]
            return self.keys[:, :, : past + n], self.values[:, :, : past + n]
        # ring: the cached tokens the new ones may see (the last capacity - 1 at most), in order, then the new ones
        keep = min(past, self.capacity - 1)
        old_slots = torch.arange(past - keep, past, device=self.device) % self.capacity
        keys = torch.cat([self.keys.index_select(2, old_slots), key_states], dim=2)
        values = torch.cat([self.values.index_select(2, old_slots), value_states], dim=2)
        self.slot_mask = torch.cat([self.valid.index_select(1, old_slots), valid], dim=1)
        last = min(n, self.capacity)
        tail = positions[-last:]
        self._write(tail % self.capacity, tail, key_states[:, :, -last:], value_states[:, :, -last:], valid[:, -last:])
        self.cumulative_length.add_(n)
        return keys, values

    def get_seq_length(self):
        """Tokens seen: a Python int in eager mode, the device tensor while compiling (no host synchronisation)."""
        if not self.is_initialized:
            return 0
        return self.cumulative_length if _compiling() else int(self.cumulative_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.valid.zero_()
            self.token_index.fill_(-1)
            self.cumulative_length.zero_()
        self.decode_mode = False
        self.slot_mask = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            for name in ("keys", "values", "valid"):
                getattr(self, name).copy_(getattr(self, name).index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._own_buffers(lambda t: t.repeat_interleave(repeats, dim=0), ("keys", "values", "valid"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._own_buffers(lambda t: t[indices], ("keys", "values", "valid"))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "StaticKeyValueLayer cannot be cropped (assisted / prompt-lookup decoding): use the dynamic cache "
            "(cache_implementation=None)"
        )

    def __repr__(self) -> str:
        return f"StaticKeyValueLayer(capacity={self.capacity}, sliding_window={self.sliding_window})"


class StaticDecoderCache(Cache):
    """The fixed-capacity cache of an hf_rbf model (``model.make_static_cache(max_cache_len)`` or
    ``generate(..., cache_implementation="static")``).

    Layers are built by the model (each attention module's :meth:`make_static_cache_layer`); the backbone calls
    :meth:`begin_step` with the padding flags of the step's tokens before the layers run, so every layer records which
    of its slots are padding, and the cache counts each row's real tokens (:attr:`row_tokens`): a forward over a
    static cache may then take an ``attention_mask`` covering the new tokens only (``[B, N]``, what ``generate`` passes
    through :meth:`~hf_rbf.DecoderForCausalLM.create_masks_for_generate`), so that a decode step has the same input
    shapes at every length and a compiled step never recompiles.
    """

    def __init__(self, layers: list, max_cache_len: int):
        super().__init__(layers=list(layers))
        self.max_cache_len_value = max_cache_len
        self._step_valid = None
        self.row_tokens = None  # [B] int64: real (non-padding) tokens cached per row
        self._share_buffers()

    def _share_buffers(self) -> None:
        """Give the layers with equal :attr:`~StackedLayerMixin.stack_key` one :class:`StackedBuffers` (layers not
        yet written only): a compiled step then guards one tensor per buffer kind, not one per layer and kind."""
        groups = {}
        for layer in self.layers:
            key = getattr(layer, "stack_key", None)
            if key is not None and not getattr(layer, "is_initialized", False) and layer._stack is None:
                groups.setdefault(key, []).append(layer)
        for members in groups.values():
            if len(members) > 1:
                stack = StackedBuffers(len(members))
                for layer in members:
                    layer._stack = stack

    def positions(self, step_valid: torch.Tensor | None, batch: int, seq_len: int, device) -> torch.Tensor:
        """Text positions ``[B, N]`` of the step's tokens (as ``cumsum(mask) - 1`` over the whole sequence, clamped at
        0) from the real tokens already cached and the step's padding flags."""
        before = self.row_tokens if self.row_tokens is not None else torch.zeros(batch, dtype=torch.long, device=device)
        if step_valid is None:
            step = torch.arange(1, seq_len + 1, device=device).expand(batch, -1)
        else:
            step = step_valid.long().cumsum(-1)
        return (before.view(-1, 1) + step - 1).clamp_min(0)

    @property
    def max_cache_len(self) -> int:
        return self.max_cache_len_value

    def begin_step(self, step_valid: torch.Tensor | None, batch: int, seq_len: int, device) -> None:
        """``step_valid [B, N]`` bool (False = padding) or None (all real) for the tokens of the coming forward."""
        self._step_valid = step_valid
        if self.row_tokens is None or self.row_tokens.shape[0] != batch:
            self.row_tokens = torch.zeros(batch, dtype=torch.long, device=device)
            if not _compiling():
                torch._dynamo.mark_static_address(self.row_tokens)
        self.row_tokens.add_(seq_len if step_valid is None else step_valid.long().sum(-1))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.row_tokens is not None:
            self.row_tokens.copy_(self.row_tokens.index_select(0, beam_idx.to(self.row_tokens.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.row_tokens is not None:
            self.row_tokens = self.row_tokens.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.row_tokens is not None:
            self.row_tokens = self.row_tokens[indices].contiguous()

    def buffer_batch_size(self) -> int | None:
        """The batch size the layers' buffers were allocated for (None before the first write)."""
        for layer in self.layers:
            keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
            if keys is not None:
                return keys.shape[0]
        return None

    def reset(self) -> None:
        """Empty the cache in place (its buffers keep their addresses, which a compiled step's CUDA graphs read)."""
        super().reset()
        if self.row_tokens is not None:
            self.row_tokens.zero_()

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: dict | None = None, *args, **kwargs):
        kwargs_ = dict(cache_kwargs or {})
        kwargs_.setdefault("valid", self._step_valid)
        return self.layers[layer_idx].update(key_states, value_states, kwargs_)

    def get_seq_length(self, layer_idx: int = 0):
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} cannot be cropped (assisted / prompt-lookup decoding): use the dynamic cache"
        )


CACHE_TYPES = ("dynamic", "static")


@dataclass(frozen=True)
class CacheMemory:
    """What a cache of one model holds, by layer (:func:`cache_bytes_per_token`).  Bytes of layer ``l`` holding
    ``S`` token slots at batch ``B``: ``S * (B * per_row[l] + shared[l]) + B * fixed_per_row[l] + fixed_shared[l]``.

    Attributes:
        cache: "dynamic" or "static".
        dtype: the dtype the cache holds its keys and values in.
        kinds: the attention kind of every layer ("rbf", "dot", "vlt", "gka", "scalar", "hybrid").
        windows: every layer's sliding window (None: full attention).  A sliding layer holds at most
            ``min(window, max_cache_len)`` slots (static) or its last ``window - 1`` tokens (dynamic).
        per_row: bytes each cached token takes in each layer, per batch row.
        shared: bytes per cached token that every row shares (the static layers' token index ``[C]`` int64: 8).
        fixed_per_row: bytes per batch row whatever the token count (the dynamic sorted layers' recent queries,
            recorded under a bound only, and order counts, the static sorted layers' fill copies of the block being
            filled).
        fixed_shared: bytes whatever the batch and the token count (device-side lengths, order-head indices).
    """

    cache: str
    dtype: torch.dtype
    kinds: tuple
    windows: tuple
    per_row: tuple
    shared: tuple
    fixed_per_row: tuple
    fixed_shared: tuple

    def per_layer(self, batch: int = 1) -> list[float]:
        """Bytes one more cached token costs in each layer at batch ``batch`` (``batch * per_row + shared``)."""
        return [batch * r + s for r, s in zip(self.per_row, self.shared)]

    def total(self, batch: int = 1) -> float:
        """Bytes one more cached token costs summed over the layers (sliding layers included, as long as the token
        count is below their window)."""
        return float(sum(self.per_layer(batch)))


def _item(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def sorted_layer_bytes_per_token(
    *,
    num_heads: int,
    value_bytes_per_row: int,
    vector_dim: int,
    num_orders: int,
    dtype: torch.dtype,
    cache: str,
    density: bool = False,
    log_weight: bool = False,
) -> int:
    """Bytes per cached token and batch row of a full scalar / hybrid layer's sorted cache.

    By slot: the scalar keys ``H`` and, for hybrid layers, the vector keys ``H * vector_dim`` in ``dtype``, the values
    (``value_bytes_per_row``: ``G * Dv`` elements of the value dtype), the validity (1 byte); the dynamic layer also
    keeps the token index per row (int64; the static one shares it between rows) and, when ``density`` eviction
    merges tokens or key weights were given (``log_weight``), a log-weight per head; density merging also keeps a
    multiplicity per slot.  The search structure: per order one key (``dtype``) and one slot (int64 dynamic, int32
    static)."""
    if cache not in CACHE_TYPES:
        raise ValueError(f"sorted_layer_bytes_per_token: `cache` must be one of {CACHE_TYPES}; got {cache!r}")
    item = _item(dtype)
    by_slot = num_heads * item + value_bytes_per_row + num_heads * vector_dim * item + 1
    if cache == "dynamic":
        by_slot += 8  # token index [B, C] int64
        if density or log_weight:
            by_slot += num_heads * item  # log_weight [B, H, C]
        if density:
            by_slot += item  # multiplicity [B, C]
    return by_slot + num_orders * (item + (8 if cache == "dynamic" else 4))


def cache_bytes_per_token(
    config, cache: str = "dynamic", dtype: torch.dtype = torch.bfloat16, *, block_size: int = 64
) -> CacheMemory:
    """Memory of a model's cache per cached token, by layer, computed from its config (any hf_rbf family).

    Args:
        config: an hf_rbf decoder config (rbf, gka, scalar_sort, hybrid_sort; any mix of their layer kinds).
        cache: ``"dynamic"`` (what ``generate`` builds by default: ``DynamicCache`` layers for rbf / gka / "dot",
            :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCacheLayer` for full scalar / hybrid layers,
            transformers' sliding layers for sliding ones) or ``"static"`` (``cache_implementation="static"``:
            :class:`StaticKeyValueLayer`, :class:`~hf_rbf.cache_sorted_static.StaticSortedLayer`).
        dtype: the dtype of the cached keys and values (the model's dtype, or autocast's).
        block_size: the static sorted layers' block length ``T`` (their fill copies are ``O * 2 * T`` entries per
            row; assumes ``max_cache_len >= T``).

    Per token and row, ``item`` the bytes of ``dtype``, ``D = head_dim``, ``O`` orders (``H`` under
    ``sort_scheme="per_head"``, ``G`` under ``"sort_head"``):

    * rbf / dot / vlt: keys and values, ``2 H D item`` (+1 validity byte and a shared 8-byte token index, static);
    * gka: one feature (keys = values), ``H D item`` (+1, +8 shared, static);
    * full scalar / hybrid: :func:`sorted_layer_bytes_per_token` (``(H + G Dv (+ H D) + O) item + 8 O + 1``, dynamic
      ``+ 8`` for the token index and, under ``cache_eviction="density"``, ``+ (H + 1) item``; static ``4 O``
      instead of ``8 O`` (int32 slots), +8 shared);
    * sliding scalar / hybrid: the scalar key packed before the vector key and the values, ``(H (1 (+ D)) + G Dv)
      item`` (+1, +8 shared, static).

    What it leaves out: the dynamic sorted layers' slot buffers grow by doubling (up to twice the tokens held, or
    ``max_cache_tokens`` / ``max_cache_bytes`` when set) and their sorted arrays may lag ``cache_buffer_size``
    tokens behind the slots; key weights passed to the dynamic sorted cache add ``H item`` per token; transformers'
    sliding layer keeps its last ``window - 1`` tokens as a view of the step's concatenation (``window`` held); a
    static layer's slot mask of the last decode step (``[B, C]`` bool, rebuilt every step); the cache's row counters
    (``StaticDecoderCache.row_tokens``, ``[B]`` int64) and transient buffers of a step.  Tested against the bytes the
    layers hold in ``tests/test_cache_budget_bytes.py``.
    """
    if cache not in CACHE_TYPES:
        raise ValueError(f"cache_bytes_per_token: `cache` must be one of {CACHE_TYPES}; got {cache!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"cache_bytes_per_token: `block_size` must be an int >= 1; got {block_size!r}")
    item = _item(dtype)
    static = cache == "static"
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    kinds, windows, per_row, shared, fixed_row, fixed_shared = [], [], [], [], [], []
    for idx in range(config.num_hidden_layers):
        kind = config.layer_kind(idx)
        window = config.layer_window(idx)
        row, row_fixed, common = 0, 0, 0
        if kind in ("rbf", "dot", "vlt", "gka"):
            row = (1 if kind == "gka" else 2) * heads * head_dim * item
        elif kind in ("scalar", "hybrid"):
            groups, value_dim = config.num_value_groups, config.value_head_dim
            vector_dim = head_dim if kind == "hybrid" else 0
            if window is not None:
                row = (heads * (1 + vector_dim) + groups * value_dim) * item
            else:
                orders = heads if config.sort_scheme == "per_head" else groups
                row = sorted_layer_bytes_per_token(
                    num_heads=heads,
                    value_bytes_per_row=groups * value_dim * item,
                    vector_dim=vector_dim,
                    num_orders=orders,
                    dtype=dtype,
                    cache=cache,
                    density=config.cache_eviction == "density",
                )
                if static:
                    # fill copies [B, O, 2, T] of keys and int32 slots; finish counter (int32), order heads (int64)
                    row_fixed = orders * 2 * block_size * (item + 4)
                    common = 4 + 8 * orders
                else:
                    # recent queries [B, H, Q] (dtype), their temperatures (at least float32), vector queries
                    # (hybrid), validity and token index [B, Q]; sorted counts [B, O]; order heads, scalar-head mask.
                    # The recent buffers are the last Q entries of the step's concatenation: Q + 1 held after a
                    # decode step (Q + N after an N-token step, until the next one)
                    recent = config.eviction_recent_queries + 1
                    tau_item = _item(torch.promote_types(dtype, torch.float32))
                    row_fixed = heads * recent * (item + tau_item + vector_dim * item) + recent * 9 + 8 * orders
                    common = 8 * orders + heads
                    dot_heads = getattr(config, "dot_heads", None)
                    if kind == "hybrid" and any(dot_heads) and not all(dot_heads):
                        common += 4 * heads  # the recent queries' per-head dot-product scale (float32)
                    if config.max_cache_tokens is None and getattr(config, "max_cache_bytes", None) is None:
                        # without a bound no query is recorded (they serve eviction alone): the buffers keep their
                        # Q initial entries of queries, validity and token index
                        recent = config.eviction_recent_queries
                        row_fixed = heads * recent * item + recent * 9 + 8 * orders
                        common = 8 * orders + heads
        else:
            raise ValueError(f"cache_bytes_per_token: unknown layer kind {kind!r} of layer {idx}")
        full_sorted = kind in ("scalar", "hybrid") and window is None
        if static:
            row += 0 if full_sorted else 1  # the slot's validity (counted by sorted_layer_bytes_per_token)
            shared_bytes = 8  # the token index [C] (int64), one per slot for every row
            common += 8  # the device-side length
        else:
            shared_bytes = 0
            if window is not None:
                common += 8  # transformers' sliding layer keeps its window as a tensor
        kinds.append(kind)
        windows.append(window)
        per_row.append(float(row))
        shared.append(float(shared_bytes))
        fixed_row.append(float(row_fixed))
        fixed_shared.append(float(common))
    return CacheMemory(
        cache=cache,
        dtype=dtype,
        kinds=tuple(kinds),
        windows=tuple(windows),
        per_row=tuple(per_row),
        shared=tuple(shared),
        fixed_per_row=tuple(fixed_row),
        fixed_shared=tuple(fixed_shared),
    )


def static_cache_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> list[float]:
    """Bytes one cached token takes in each layer of the static cache, per batch row (the per-row part of
    ``cache_bytes_per_token(config, "static", dtype)``; every row also shares an 8-byte token index per slot).

    rbf / dot / vlt layers: keys and values, ``2 * H * head_dim`` elements; gka: one feature, ``H * head_dim``; a full
    scalar / hybrid layer (:class:`~hf_rbf.cache_sorted_static.StaticSortedLayer`): scalar keys ``H``, values
    ``G * Dv``, vector keys ``H * head_dim`` (hybrid) and the sorted blocks (``O`` order keys and ``O`` int64 slots,
    ``O = H`` under "per_head", ``G`` under "sort_head"); a sliding scalar / hybrid layer: packed keys
    ``H * (1 + head_dim)`` (hybrid) or ``H`` (scalar) and values ``G * Dv``.  Every layer adds one byte (the slot's
    validity).  Sliding layers hold ``min(window, max_cache_len)`` slots, full layers ``max_cache_len``.
    """
    return list(cache_bytes_per_token(config, "static", dtype).per_row)


def static_cache_len_for_bytes(
    config, max_cache_bytes: int, dtype: torch.dtype = torch.bfloat16, *, block_size: int = 64
) -> int:
    """The largest ``max_cache_len`` whose static cache keeps every layer's per-token buffers within
    ``max_cache_bytes`` bytes per batch row (a token costing ``per_row + shared`` bytes of
    :func:`cache_bytes_per_token`, i.e. at batch 1; the fixed overheads are not counted).  Sliding layers hold at
    most their window and bound it only when their window does not fit; full sorted layers round their capacity up to
    a multiple of ``block_size``, so their bound is rounded down to one (when it is at least one block)."""
    name = "static_cache_len_for_bytes"
    if not isinstance(max_cache_bytes, int) or isinstance(max_cache_bytes, bool) or max_cache_bytes < 1:
        raise ValueError(f"{name}: `max_cache_bytes` must be an int >= 1; got {max_cache_bytes!r}")
    memory = cache_bytes_per_token(config, "static", dtype, block_size=block_size)
    bound = None
    for idx, (kind, window, cost) in enumerate(zip(memory.kinds, memory.windows, memory.per_layer(1))):
        if window is not None and window * cost <= max_cache_bytes:
            continue
        tokens = int(max_cache_bytes // cost)
        if tokens < 1:
            raise ValueError(
                f"{name}: `max_cache_bytes` ({max_cache_bytes}) is below one token of layer {idx} ({kind!r}, "
                f"{cost:g} bytes per token in {dtype})"
            )
        if kind in ("scalar", "hybrid") and window is None and tokens >= block_size:
            tokens -= tokens % block_size
        bound = tokens if bound is None else min(bound, tokens)
    if bound is None:  # only sliding layers, every window fits: the budget does not bound the length
        raise ValueError(
            f"{name}: every layer is a sliding layer whose window fits in `max_cache_bytes` ({max_cache_bytes}); "
            "the budget does not bound the cache length: pass `max_cache_len`"
        )
    return bound


__all__ = [
    "CacheMemory",
    "StackedBuffers",
    "StaticDecoderCache",
    "StaticKeyValueLayer",
    "cache_bytes_per_token",
    "index_copy_into",
    "sorted_layer_bytes_per_token",
    "static_cache_bytes_per_token",
    "static_cache_len_for_bytes",
]
