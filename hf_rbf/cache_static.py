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
  ``attention_mask`` may cover the new tokens only).  This is also the path of chunked prefill (``generate(..., prefill_chunk_size=...)``).

Sliding-window layers keep a ring of ``min(window, max_cache_len)`` slots (token ``t`` at slot ``t % C``); full
layers keep ``max_cache_len`` slots.  Memory per cached token and layer: ``2 * H * head_dim * bytes`` (rbf / dot:
keys and values), ``H * head_dim * bytes`` (gka: one feature), plus one byte of slot mask per row.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class StaticKeyValueLayer(CacheLayerMixin):
    """One layer's fixed-capacity keys ``[B, H, C, Dk]`` and values ``[B, H, C, Dv]`` (``Dv = 0`` for GKA, whose
    values are its keys), the slot validity ``[B, C]`` and the token index of every slot ``[C]`` (-1 when empty).

    Args:
        max_cache_len: the most tokens one sequence may hold (prompt + generated), the capacity of full layers.
        sliding_window: the layer's window ``W`` (None: full attention); the layer then keeps a ring of
            ``min(W, max_cache_len)`` slots, enough for a query that sees its last ``W`` tokens (itself included).
    """

    is_compileable = True
    is_croppable = False
    supports_early_init = False

    def __init__(self, max_cache_len: int, sliding_window: int | None = None):
        super().__init__()
        if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
            raise ValueError(f"StaticKeyValueLayer: `max_cache_len` must be an int >= 1; got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.capacity = max_cache_len if sliding_window is None else min(sliding_window, max_cache_len)
        self.is_ring = self.capacity < max_cache_len
        # device-side length, as transformers' StaticLayer: a tensor so a compiled step does not specialise on it
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.decode_mode = False  # whether the last update returned the whole buffer
        # [B, keys returned] validity of the keys the last update returned (padding and unwritten slots False): the
        # text-key mask of the attention call, so a forward needs no mask over the cached tokens
        self.slot_mask = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        c = self.capacity
        self.keys = torch.zeros(b, h, c, dk, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(b, value_states.shape[1], c, dv, dtype=value_states.dtype, device=self.device)
        self.valid = torch.zeros(b, c, dtype=torch.bool, device=self.device)
        self.token_index = torch.full((c,), -1, dtype=torch.long, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not _compiling():
            for t in (self.keys, self.values, self.valid, self.token_index, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def _write(self, slots: torch.Tensor, positions: torch.Tensor, keys, values, valid) -> None:
        self.keys.index_copy_(2, slots, keys)
        if values.shape[-1] > 0:
            self.values.index_copy_(2, slots, values)
        self.valid.index_copy_(1, slots, valid)
        self.token_index.index_copy_(0, slots, positions)

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
            for name in ("keys", "values", "valid"):
                setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "valid"):
                setattr(self, name, getattr(self, name)[indices].contiguous())

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
        if self.row_tokens is None:
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

    def reset(self) -> None:
        super().reset()
        self.row_tokens = None

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


def static_cache_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> list[float]:
    """Bytes one cached token takes in each layer of the static cache, per batch row, computed from the config.

    rbf / dot / vlt layers: keys and values, ``2 * H * head_dim`` elements; gka: one feature, ``H * head_dim``; a full
    scalar / hybrid layer (:class:`~hf_rbf.cache_sorted_static.StaticSortedLayer`): scalar keys ``H``, values
    ``G * Dv``, vector keys ``H * head_dim`` (hybrid) and the sorted blocks (``O`` order keys and ``O`` int64 slots,
    ``O = H`` under "per_head", ``G`` under "sort_head"); a sliding scalar / hybrid layer: packed keys
    ``H * (1 + head_dim)`` (hybrid) or ``H`` (scalar) and values ``G * Dv``.  Every layer adds one byte (the slot's
    validity).  Sliding layers hold ``min(window, max_cache_len)`` slots, full layers ``max_cache_len``.
    """
    item = torch.empty((), dtype=dtype).element_size()
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    result = []
    for idx in range(config.num_hidden_layers):
        kind = config.layer_kind(idx)
        if kind in ("rbf", "dot", "vlt"):
            elements, extra = 2 * heads * head_dim, 0
        elif kind == "gka":
            elements, extra = heads * head_dim, 0
        elif kind in ("scalar", "hybrid"):
            groups, value_dim = config.num_value_groups, config.value_head_dim
            vector = heads * head_dim if kind == "hybrid" else 0
            elements, extra = heads + groups * value_dim + vector, 0
            if config.layer_window(idx) is None:
                orders = heads if config.sort_scheme == "per_head" else groups
                elements += orders
                extra = 8 * orders  # int64 slot of each sorted entry
        else:
            raise ValueError(f"static_cache_bytes_per_token: unknown layer kind {kind!r} of layer {idx}")
        result.append(float(elements * item + extra + 1))
    return result


__all__ = ["StaticDecoderCache", "StaticKeyValueLayer", "static_cache_bytes_per_token"]
