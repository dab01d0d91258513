"""The sorted scalar KV cache: a transformers ``Cache`` whose scalar / hybrid layers keep their keys sortable.

:class:`SortedScalarCache` is what scalar-sort and hybrid-sort models build for ``generate`` (and in ``forward`` when
``use_cache`` is set); a user can pass one too (``cache=SortedScalarCache(decode_window=32)`` to a forward, or
``**{hf_rbf.CACHE_NAME: SortedScalarCache(...)}`` to ``generate``: transformers 5.24 renamed ``past_key_values``).  Its
layers are :class:`SortedScalarCacheLayer` for full-attention "scalar" / "hybrid" layers and transformers' own
``DynamicLayer`` / ``DynamicSlidingWindowLayer`` for "dot" layers and sliding-window layers.

Layout of a :class:`SortedScalarCacheLayer` (per batch row; see :class:`hf_rbf.sorted_decode.SortedCacheState`)
---------------------------------------------------------------------------------------------------------------
* By slot (insertion order, contiguous capacity buffers that double when full): every head's scalar key
  ``[B, H, C]``, the group values ``[B, G, C, Dv]``, the vector keys ``[B, H, C, D]`` (hybrid), a validity flag and
  the token index ``[B, C]``, and, once needed, a log-weight ``[B, H, C]`` (stored key weights, merged
  multiplicities).
* The search structure: per row and order (one per head under ``sort_scheme="per_head"``, one per value group, that
  of its sort head, under ``"sort_head"``) a sorted array of order keys with the slot of each entry.  Padding,
  evicted and cropped tokens are ``+inf`` entries after the valid ones (their count is a device tensor, so nothing
  needs a host synchronisation).
* The recent buffer: the last ``num_slots - num_sorted`` slots, not yet merged.  An insert first merges the waiting
  buffer when it would exceed ``cache_buffer_size`` with the new tokens, then writes them: every sorted entry is then
  older than every query of the step (the search needs no causal mask), and a step scans at most
  ``cache_buffer_size + N`` buffered keys (N = tokens of the step; a prompt waits whole until the next step).

Costs (``n`` cached tokens, ``k`` window, ``R`` buffer size, per row and order; no step synchronises with the host)
------------------------------------------------------------------------------------------------------------------
* insert: write the new token's keys and values at the next slot, ``O(H + G Dv (+ H D))``; amortised ``O(1)`` copies
  for capacity doubling.
* merge (every ``R`` inserts): sort the ``R`` buffered keys, place them with two ``searchsorted`` calls and scatter:
  ``O((n + R) log R)`` work, so ``O(n log R / R)`` per insert amortised.
* decode: one binary search ``O(log n)``, ``2k`` sorted entries + ``R`` buffer keys scanned, a sort of those
  ``2k + R`` candidates, ``k`` key and ``k`` value-row gathers: ``O(log n + (k + R) log(k + R) + k Dv)``.
* crop / eviction / beam reordering: ``O(n)`` gathers and scatters (rare steps).

Memory and budgets
------------------
Per token and row, the by-slot tensors and one sorted entry per order (see
:func:`hf_rbf.cache_static.cache_bytes_per_token`, :meth:`SortedScalarCacheLayer.bytes_per_token`).  The slot
buffers double when full; a bounded layer (``max_cache_tokens`` or ``max_cache_bytes``, which the layer turns into
``max_cache_tokens = max_cache_bytes // bytes_per_token()`` when it first sees the dtype and widths of what it caches)
never grows them past its bound and shrinks them back to it after a prompt longer than the bound was evicted, so its
per-token buffers stay within ``max_cache_bytes`` (except while eviction is deferred for assisted decoding).

The window semantics do not depend on the buffer (the candidates always contain the window), so results are the
same for every ``cache_buffer_size``; ``decode_window=None`` runs the layer's exact attention function over the
cached tokens instead.
"""

from __future__ import annotations

import logging
import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .attention_utils import all_true_mask
from .cache_static import sorted_layer_bytes_per_token
from .configuration_scalar_sort import check_sorted_cache_settings, override_cache_settings
from .kernels_cache_append import append_one_fused, append_one_reason, rotate_pair_reference
from .kernels_sorted_decode import kernel_unavailable_reason, sorted_window_attention_triton
from .sorted_decode import SortedCacheState, sorted_window_attention

logger = logging.getLogger("hf_rbf")
# The fused step holds a query's 2k window candidates in registers (one program per row, head and query), and the
# window is a compile-time constant: "auto" keeps it to windows measured on a GPU (k = 64, docs/scalar_sort.md) and a
# few doublings beyond; "triton" takes any window.
AUTO_FUSED_MAX_WINDOW = 256
_LOGGED_DECODE: set = set()


_INF = float("inf")
_APPEND_REASONS_LOGGED: set = set()


def _merge_groups_(t: torch.Tensor, members, survivor, weights, chosen) -> None:
    """In place: for every chosen group (slots ``members [B, P, m]`` of each row), write the weighted average
    ``sum_i weights[..., i] * t[members[..., i]]`` (``weights [B, P, m]``, summing to 1) at the ``survivor [B, P]`` slot
    of ``t`` (slot axis 2: ``[B, X, C, ...]``)."""
    b, groups, size = members.shape
    trail = [1] * (t.dim() - 3)
    shape = list(t.shape[:2]) + [groups * size] + list(t.shape[3:])
    gathered = t.gather(2, members.reshape(b, 1, groups * size, *trail).expand(shape))
    gathered = gathered.view(*t.shape[:2], groups, size, *t.shape[3:])
    w = weights.to(t.dtype).view(b, 1, groups, size, *trail)
    merged = (w * gathered).sum(3)  # [B, X, P, ...]
    idx_s = survivor.view(b, 1, groups, *trail).expand(list(t.shape[:2]) + [groups] + list(t.shape[3:]))
    keep = chosen.view(b, 1, groups, *trail)
    t.scatter_(2, idx_s, torch.where(keep, merged, t.gather(2, idx_s)))


def _check_rotary(rotary, vector_keys: torch.Tensor | None, n: int) -> None:
    """``SortedScalarCacheLayer.append``'s ``rotary = (queries, cos, sin)``: one token's queries of the vector keys'
    shape ``[B, H, 1, D]`` (D even) and RoPE tables ``[B|1, 1, D/2]`` on their device; a ValueError naming what is
    wrong otherwise."""
    where = "SortedScalarCacheLayer.append: `rotary`"
    if not (isinstance(rotary, tuple) and len(rotary) == 3):
        raise ValueError(f"{where} must be a tuple (queries, cos, sin)")
    if vector_keys is None or n != 1:
        raise ValueError(f"{where} takes one token's vector keys; got {n} tokens"
                         + ("" if vector_keys is not None else " and no vector keys"))  # fmt: skip
    q, cos, sin = rotary
    if q.shape != vector_keys.shape or q.shape[-1] % 2:
        raise ValueError(f"{where}: the queries must have the vector keys' shape {tuple(vector_keys.shape)} with an "
                         f"even head dim; got {tuple(q.shape)}")  # fmt: skip
    rows, half = q.shape[0], q.shape[-1] // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 3 or table.shape[0] not in (1, rows) or table.shape[1:] != (1, half):
            raise ValueError(f"{where}: {name} must be [1 or {rows}, 1, {half}] (one position, half the head dim); "
                             f"got {tuple(table.shape)}")  # fmt: skip
        if table.device != q.device:
            raise ValueError(f"{where}: {name} is on {table.device}, the queries on {q.device}")


class SortedScalarCacheLayer(CacheLayerMixin):
    """One scalar / hybrid layer of a :class:`SortedScalarCache` (see the module docstring for layout and costs).

    Args:
        num_heads, num_value_groups: ``H`` and ``G`` of the layer.
        scalar_heads (`list[bool]`, *optional*): which heads have a scalar term (hybrid layers' "dot" heads do not;
            they are ignored by geometric eviction, the sink zone and density merging).  Default: all.
        decode_window, sort_scheme, sort_head, cache_buffer_size, max_cache_tokens, max_cache_bytes, cache_eviction,
            eviction_radius, eviction_recent_queries, eviction_batch, sink_zone, decode_backend,
            density_merge_weighting, density_merge_size: as in :class:`~hf_rbf.ScalarSortConfig`.  With
            ``max_cache_bytes`` the token bound ``max_cache_tokens`` (and the default ``eviction_batch``) is set at
            the first insert, from :meth:`bytes_per_token`.

    The attention module calls :meth:`append` (before attending, so a token sees itself), then either
    :meth:`slot_view` (exact attention over every cached token) or :meth:`attend` (the window), then
    :meth:`end_step` (records the queries for geometric eviction and enforces the bound).  ``update`` is the
    transformers entry point with keys packed as ``[B, H, N, 1 (+ D)]`` (scalar key first).
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False
    supports_early_init = False

    def __init__(
        self,
        *,
        num_heads: int,
        num_value_groups: int,
        scalar_heads: list[bool] | None = None,
        decode_window: int | None = None,
        sort_scheme: str = "per_head",
        sort_head: int = 0,
        cache_buffer_size: int = 64,
        max_cache_tokens: int | None = None,
        cache_eviction: str = "geometric",
        eviction_radius: float = 0.5,
        eviction_recent_queries: int = 16,
        eviction_batch: int | None = None,
        sink_zone: list[float] | None = None,
        decode_backend: str = "auto",
        density_merge_weighting: str = "multiplicity",
        density_merge_size: int = 2,
        max_cache_bytes: int | None = None,
    ):
        super().__init__()
        name = type(self).__name__
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"{name}: `num_heads` must be an int >= 1; got {num_heads!r}")
        if not isinstance(num_value_groups, int) or num_value_groups < 1 or num_heads % num_value_groups:
            raise ValueError(
                f"{name}: `num_value_groups` ({num_value_groups!r}) must be a positive int dividing `num_heads` "
                f"({num_heads})"
            )
        self.sink_zone = check_sorted_cache_settings(
            name,
            num_heads=num_heads,
            num_value_groups=num_value_groups,
            decode_window=decode_window,
            sort_scheme=sort_scheme,
            sort_head=sort_head,
            cache_buffer_size=cache_buffer_size,
            max_cache_tokens=max_cache_tokens,
            cache_eviction=cache_eviction,
            eviction_radius=eviction_radius,
            eviction_recent_queries=eviction_recent_queries,
            eviction_batch=eviction_batch,
            sink_zone=sink_zone,
            decode_backend=decode_backend,
            density_merge_weighting=density_merge_weighting,
            density_merge_size=density_merge_size,
            max_cache_bytes=max_cache_bytes,
        )
        if scalar_heads is not None and len(scalar_heads) != num_heads:
            raise ValueError(f"{name}: `scalar_heads` must have {num_heads} entries; got {len(scalar_heads)}")
        self.num_heads = num_heads
        self.num_value_groups = num_value_groups
        self.scalar_heads = list(scalar_heads) if scalar_heads is not None else [True] * num_heads
        self.decode_window = decode_window
        self.sort_scheme = sort_scheme
        self.sort_head = sort_head
        self.cache_buffer_size = cache_buffer_size
        self.max_cache_tokens = max_cache_tokens
        self.max_cache_bytes = max_cache_bytes
        self.cache_eviction = cache_eviction
        self.eviction_radius = float(eviction_radius)
        self.eviction_recent_queries = eviction_recent_queries
        self._given_eviction_batch = eviction_batch  # None: derived from the token bound
        if max_cache_tokens is not None and eviction_batch is None:
            eviction_batch = max(1, max_cache_tokens // 16)
        self.eviction_batch = eviction_batch
        heads_per_group = num_heads // num_value_groups
        if sort_scheme == "per_head":
            self.order_head_list = list(range(num_heads))
        else:
            self.order_head_list = [grp * heads_per_group + sort_head for grp in range(num_value_groups)]
        self.decode_backend = decode_backend
        self.density_merge_weighting = density_merge_weighting
        self.density_merge_size = density_merge_size
        self.last_decode_backend = None  # "torch" or "triton": what served the last windowed step
        self.last_decode_reason = None  # why the last windowed step did not take the fused kernel (None when it did)
        self.last_append_reason = None  # why the last one-token insert did not take the fused launch (None: it did)
        self.record_past = False
        self._clear()

    # ------------------------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.is_initialized = False
        self.keys = None  # the scalar keys [B, H, C] (named `keys` for transformers' generic code)
        self.values = None  # [B, G, C, Dv]
        self.vector_keys = None  # [B, H, C, D] or None
        self.log_weight = None  # [B, H, C] or None
        self.multiplicity = None  # [B, C] tokens represented by each slot (density merging) or None
        self.valid = None  # [B, C] bool
        # (the `valid` tensor, its `_version`) while every slot below `num_slots` is known to be valid (None: not
        # known): any write to `valid` other than `append`'s own bumps its version, so the record cannot outlive it
        self._all_valid_at = None
        self.token_index = None  # [B, C] int64
        self.sorted_keys = None  # [B, O, M]
        self.sorted_slots = None  # [B, O, M] int64
        self.sorted_count = None  # [B, O] int64
        self.recent_qs = None  # [B, H, Q] the last queries (geometric eviction)
        self.recent_valid = None  # [B, Q] bool
        self.recent_token_index = None  # [B, Q] int64
        self.recent_tau = None  # [B, H, Q] the recent queries' temperatures (attention-weighted density merging)
        self.recent_q = None  # [B, H, Q, D] the recent vector queries (hybrid layers)
        self.recent_scale = None  # the dot-product scale of the recent queries (float or [H]; hybrid layers)
        self.num_slots = 0  # S
        self.num_sorted = 0  # M
        self.seen_tokens = 0
        # Number of trailing slots known to hold the most recent tokens, in order, in every row (crop can then
        # truncate instead of leaving holes).
        self.tail_tokens = 0

    @property
    def num_orders(self) -> int:
        return len(self.order_head_list)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-1]

    @property
    def batch_size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate from packed keys ``[B, H, N, 1 (+ D)]`` and values ``[B, G, N, Dv]``."""
        b, h, _, width = key_states.shape
        if h != self.num_heads or value_states.shape[1] != self.num_value_groups:
            raise ValueError(
                f"SortedScalarCacheLayer: keys must have {self.num_heads} heads and values {self.num_value_groups} "
                f"groups; got {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        g, dv = value_states.shape[1], value_states.shape[3]
        if self.max_cache_bytes is not None:
            self._apply_byte_budget(
                self.layer_bytes_per_token(
                    value_bytes_per_row=g * dv * value_states.element_size(), vector_dim=width - 1
                )
            )
        # a bounded layer never holds more than its bound (the insert evicts first): no slot beyond it
        cap = 16 if self.max_cache_tokens is None else min(16, self.max_cache_tokens)
        dev = self.device
        self.keys = torch.zeros(b, h, cap, dtype=self.dtype, device=dev)
        self.values = torch.zeros(b, g, cap, dv, dtype=value_states.dtype, device=dev)
        self.vector_keys = torch.zeros(b, h, cap, width - 1, dtype=self.dtype, device=dev) if width > 1 else None
        self.valid = torch.zeros(b, cap, dtype=torch.bool, device=dev)
        self._all_valid_at = (self.valid, self.valid._version)  # no slot yet
        self.token_index = torch.zeros(b, cap, dtype=torch.long, device=dev)
        self.sorted_keys = torch.zeros(b, self.num_orders, 0, dtype=self.dtype, device=dev)
        self.sorted_slots = torch.zeros(b, self.num_orders, 0, dtype=torch.long, device=dev)
        self.sorted_count = torch.zeros(b, self.num_orders, dtype=torch.long, device=dev)
        q = self.eviction_recent_queries
        self.recent_qs = torch.zeros(b, h, q, dtype=self.dtype, device=dev)
        self.recent_valid = torch.zeros(b, q, dtype=torch.bool, device=dev)
        self.recent_token_index = torch.zeros(b, q, dtype=torch.long, device=dev)
        self._order_head = torch.tensor(self.order_head_list, dtype=torch.long, device=dev)
        self._scalar_head_mask = torch.tensor(self.scalar_heads, dtype=torch.bool, device=dev)
        self.is_initialized = True

    def layer_bytes_per_token(self, *, value_bytes_per_row: int, vector_dim: int) -> int:
        """Bytes per held token and row for values of ``value_bytes_per_row`` bytes and vector keys of ``vector_dim``
        elements (0: a scalar layer), in this layer's dtype
        (:func:`~hf_rbf.cache_static.sorted_layer_bytes_per_token`)."""
        return sorted_layer_bytes_per_token(
            num_heads=self.num_heads,
            value_bytes_per_row=value_bytes_per_row,
            vector_dim=vector_dim,
            num_orders=self.num_orders,
            dtype=self.dtype,
            cache="dynamic",
            density=self.cache_eviction == "density",
            log_weight=self.log_weight is not None,
        )

    def bytes_per_token(self) -> int:
        """Bytes one held token takes per batch row in this (allocated) layer: by slot the scalar keys, values, vector
        keys, validity and token index (and the log-weight and multiplicity of density merging or key weights), and
        one key and one int64 slot per order in the sorted arrays."""
        if not self.is_initialized:
            raise ValueError(f"{type(self).__name__}.bytes_per_token: the layer holds nothing yet (no dtype)")
        vector_dim = 0 if self.vector_keys is None else self.vector_keys.shape[-1]
        value_bytes = self.values.shape[1] * self.values.shape[3] * self.values.element_size()
        return self.layer_bytes_per_token(value_bytes_per_row=value_bytes, vector_dim=vector_dim)

    def _apply_byte_budget(self, per_token: int) -> None:
        """``max_cache_bytes`` -> ``max_cache_tokens`` (and the default ``eviction_batch``) for ``per_token`` bytes."""
        name = type(self).__name__
        tokens = self.max_cache_bytes // per_token
        if tokens < 1:
            raise ValueError(
                f"{name}: `max_cache_bytes` ({self.max_cache_bytes}) is below one cached token of this layer "
                f"({per_token} bytes per token and row in {self.dtype})"
            )
        batch = self._given_eviction_batch
        if batch is not None and batch > tokens:
            raise ValueError(
                f"{name}: `eviction_batch` ({batch}) must be at most the token bound of `max_cache_bytes` "
                f"({self.max_cache_bytes} bytes = {tokens} tokens of {per_token} bytes)"
            )
        self.max_cache_tokens = tokens
        self.eviction_batch = batch if batch is not None else max(1, tokens // 16)

    def _per_row_tensors(self) -> list[str]:
        return [
            "keys", "values", "vector_keys", "log_weight", "multiplicity", "valid", "token_index", "sorted_keys",
            "sorted_slots", "sorted_count", "recent_qs", "recent_valid", "recent_token_index", "recent_tau", "recent_q",
        ]  # fmt: skip

    def _slot_tensors(self) -> list[tuple[str, int]]:
        """(name, slot dim) of every tensor indexed by slot."""
        return [
            ("keys", 2), ("values", 2), ("vector_keys", 2), ("log_weight", 2), ("multiplicity", 1), ("valid", 1),
            ("token_index", 1),
        ]  # fmt: skip

    def _ensure_capacity(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        limit = self.max_cache_tokens
        if limit is not None and not self.record_past:
            # a bounded layer evicts before it inserts: more slots than the bound only for a longer single step
            new_cap = max(needed, min(new_cap, limit))
        self._resize_slots(new_cap)

    def _resize_slots(self, new_cap: int) -> None:
        """Reallocate every by-slot tensor with ``new_cap`` slots, keeping the first ``min(capacity, new_cap)``."""
        keep = min(self.capacity, new_cap)
        for name, dim in self._slot_tensors():
            t = getattr(self, name)
            if t is None:
                continue
            shape = list(t.shape)
            shape[dim] = new_cap
            resized = torch.zeros(shape, dtype=t.dtype, device=t.device)
            resized.narrow(dim, 0, keep).copy_(t.narrow(dim, 0, keep))
            setattr(self, name, resized)

    def _ensure_log_weight(self) -> None:
        if self.log_weight is None:
            self.log_weight = torch.zeros_like(self.keys)

    def _ensure_multiplicity(self) -> None:
        if self.multiplicity is None:
            self.multiplicity = torch.ones(self.keys.shape[0], self.capacity, dtype=self.keys.dtype, device=self.device)

    # ------------------------------------------------------------------------------------------------------------
    # the step API used by the attention modules
    # ------------------------------------------------------------------------------------------------------------
    def append(
        self,
        scalar_keys: torch.Tensor,
        values: torch.Tensor,
        vector_keys: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        log_weight: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Insert ``N`` new tokens: ``scalar_keys [B, H, N]``, ``values [B, G, N, Dv]``, ``vector_keys [B, H, N, D]``
        (hybrid), ``valid [B, N]`` (False = padding; default all True), ``log_weight [B, H, N]`` (key weights).

        ``rotary = (queries [B, H, 1, D], cos, sin)`` (one token, tables ``[B|1, 1, D/2]``): the token's vector queries
        and keys still need RoPE; both are rotated in place and the keys stored rotated, by the one-launch insert
        where it serves the step (:meth:`appends_fused_on`), else by torch ops first
        (``kernels_cache_append.rotate_pair_reference``)."""
        b, h, n = scalar_keys.shape
        if rotary is not None:
            _check_rotary(rotary, vector_keys, n)
        if not self.is_initialized:
            packed = (
                scalar_keys.unsqueeze(-1)
                if vector_keys is None
                else torch.cat([scalar_keys.unsqueeze(-1), vector_keys], dim=-1)
            )
            self.lazy_initialization(packed, values)
        if b != self.keys.shape[0]:
            raise ValueError(
                f"SortedScalarCacheLayer: the cache holds {self.keys.shape[0]} rows but {b} were given; use "
                "batch_select_indices / batch_repeat_interleave / reorder_cache to change rows"
            )
        if (vector_keys is None) != (self.vector_keys is None):
            raise ValueError("SortedScalarCacheLayer: vector keys must be given at every update or never")
        all_valid = self._all_valid()
        # Make room first, so the cache never holds more than max_cache_tokens (deferred while recording the past).
        limit = self.max_cache_tokens
        if limit is not None and not self.record_past and self.num_slots > 0 and self.num_slots + n > limit:
            self._evict_to(max(0, limit - n - self.eviction_batch))
            all_valid = False
        # Merge the waiting buffer *before* writing: every sorted entry must be older than every query of the step
        # (the search has no causal mask); the new tokens wait in the buffer, where causality is checked per query.
        if self.num_slots - self.num_sorted + n > self.cache_buffer_size:
            self._merge_buffer()
        s = self.num_slots
        if s + n > self.keys.shape[-1]:
            self._ensure_capacity(s + n)  # (a resize keeps the slots' validity)
        if n == 1 and self.log_weight is None and self.multiplicity is None and self._appends_fused(
            scalar_keys, vector_keys, values, rotary
        ):
            # a decode step's token: one launch writes it into the five buffers (kernels_cache_append)
            new_valid = None if valid is None else valid.to(torch.bool)
            append_one_fused(self.keys, self.vector_keys, self.values, self.valid, self.token_index, s,
                             self.seen_tokens, scalar_keys, vector_keys, values, new_valid, rotary)  # fmt: skip
            # (the kernel's write bumps no version counter: the record is the buffer's current version, as below;
            # a given validity is not read back from the device: unknown)
            all_valid = all_valid and valid is None
            self._all_valid_at = (self.valid, self.valid._version) if all_valid else None
            self.num_slots = s + n
            self.seen_tokens += n
            self.tail_tokens += n
            return
        if rotary is not None:
            rotate_pair_reference(rotary[0], vector_keys, rotary[1], rotary[2])
        # `narrow(...).copy_` / `fill_`: the slice assignments' ops without their Python indexing (per layer and decode
        # step on the host); `fill_` with a Python scalar is one op, where an assignment of True wraps it in a tensor
        # first (lift_fresh), and a decode step's single token index needs no arange
        self.keys.narrow(2, s, n).copy_(scalar_keys)
        self.values.narrow(2, s, n).copy_(values)
        if vector_keys is not None:
            self.vector_keys.narrow(2, s, n).copy_(vector_keys)
        if valid is None:
            self.valid.narrow(1, s, n).fill_(True)
        else:
            self.valid.narrow(1, s, n).copy_(valid.to(torch.bool))
            all_valid = False  # (not read back from the device: unknown)
        self._all_valid_at = (self.valid, self.valid._version) if all_valid else None
        if n == 1:
            self.token_index.narrow(1, s, 1).fill_(self.seen_tokens)
        else:
            self.token_index[:, s : s + n] = torch.arange(self.seen_tokens, self.seen_tokens + n, device=self.device)
        if log_weight is not None:
            self._ensure_log_weight()
        if self.log_weight is not None:
            self.log_weight[:, :, s : s + n] = 0.0 if log_weight is None else log_weight
        if self.multiplicity is not None:
            self.multiplicity[:, s : s + n] = 1.0
        self.num_slots = s + n
        self.seen_tokens += n
        self.tail_tokens += n

    def _backend_fuses_on(self, device: torch.device) -> bool:
        """``decode_backend``'s rule for the one-launch insert: "auto" on CUDA, "triton" wherever the kernel runs
        (the interpreter included), "torch" never."""
        backend = self.decode_backend
        return backend == "triton" or (backend == "auto" and device.type == "cuda")

    def appends_fused_on(self, device: torch.device) -> bool:
        """Whether this layer's one-token inserts on ``device`` may take the fused launch: the part of
        :meth:`_appends_fused` that does not depend on the new entries."""
        return self._backend_fuses_on(device) and self._append_kernel_reason(device) is None

    def _append_kernel_reason(self, device: torch.device) -> str | None:
        """Why the insert kernel cannot run on ``device`` (None: it can); asked once per device."""
        reasons = self.__dict__.get("_append_kernel_reasons")
        if reasons is None:
            reasons = self._append_kernel_reasons = {}
        if device not in reasons:
            reasons[device] = kernel_unavailable_reason(device)
        return reasons[device]

    def _appends_fused(self, scalar_keys, vector_keys, values, rotary=None) -> bool:
        """Whether a one-token insert goes through the fused launch (:meth:`appends_fused_on`, and the new entries
        as :func:`append_one_reason` needs them), and why not otherwise (``last_append_reason``, logged once per
        reason)."""
        device = scalar_keys.device
        if not self._backend_fuses_on(device):
            return False  # (the backend's choice: no reason to log)
        reason = self._append_kernel_reason(device) or append_one_reason(scalar_keys, vector_keys, values, rotary)
        if reason is None and (values.dtype != self.values.dtype or scalar_keys.dtype != self.keys.dtype):
            reason = "the new entries' dtype differs from the cache's"
        if reason != self.last_append_reason:
            self.last_append_reason = reason
            if reason is not None and reason not in _APPEND_REASONS_LOGGED:
                _APPEND_REASONS_LOGGED.add(reason)
                logger.info("SortedScalarCacheLayer: one-token inserts through torch ops (decode_backend=%r): %s",
                            self.decode_backend, reason)  # fmt: skip
        return reason is None

    def _all_valid(self) -> bool:
        """Whether every slot below ``num_slots`` is known to be valid (no padding, eviction or crop since the layer
        was filled), from the host-side record alone: nothing is read back from the device."""
        known = self._all_valid_at
        return known is not None and known[0] is self.valid and known[1] == self.valid._version

    def exact_view(self, num_prefix: int = 0, all_valid_mask: bool = True):
        """What an exact step over every cached token reads: :meth:`slot_view`'s scalar keys, values, vector keys and
        log-weights, and the key mask ``[B, num_prefix + S]`` bool: ``num_prefix`` always visible keys in front (the
        sink, registers), then the slots' validity.  While every slot is known to be valid (:meth:`_all_valid`: no
        padding given, nothing evicted) the mask is a view of a shared all-True buffer, not a new ``[B, P]`` block
        concatenated to the validity at every layer and decode step; the values are the same.  With
        ``all_valid_mask=False`` it is None then (every key visible: for a caller that takes None as that)."""
        s = self.num_slots
        # (`narrow`: the views of `[:, :, :s]` without Python's indexing machinery)
        vk = None if self.vector_keys is None else self.vector_keys.narrow(2, 0, s)
        lw = None if self.log_weight is None else self.log_weight.narrow(2, 0, s)
        if not all_valid_mask and self._all_valid():
            mask = None
        elif num_prefix == 0:
            valid = self._all_valid()
            mask = all_true_mask(self.keys.shape[0], s, self.device) if valid else self.valid.narrow(1, 0, s)
        elif self._all_valid():
            mask = all_true_mask(self.keys.shape[0], num_prefix + s, self.device)
        else:
            valid = self.valid.narrow(1, 0, s)
            mask = torch.cat([valid.new_ones(valid.shape[0], num_prefix), valid], dim=1)
        return self.keys.narrow(2, 0, s), self.values.narrow(2, 0, s), vk, mask, lw

    def slot_view(self):
        """The cached tokens in slot order (views): ``(scalar_keys [B, H, S], values [B, G, S, Dv],
        vector_keys [B, H, S, D] | None, valid [B, S] bool, log_weight [B, H, S] | None)``.  The newest tokens are the
        last slots, so the usual bottom-right causal mask applies."""
        s = self.num_slots
        vk = None if self.vector_keys is None else self.vector_keys[:, :, :s]
        lw = None if self.log_weight is None else self.log_weight[:, :, :s]
        return self.keys[:, :, :s], self.values[:, :, :s], vk, self.valid[:, :s], lw

    def state(self) -> SortedCacheState:
        """The :class:`~hf_rbf.sorted_decode.SortedCacheState` a decode step reads."""
        return SortedCacheState(
            scalar_keys=self.keys,
            values=self.values,
            vector_keys=self.vector_keys,
            log_weight=self.log_weight,
            valid=self.valid,
            token_index=self.token_index,
            sorted_keys=self.sorted_keys,
            sorted_slots=self.sorted_slots,
            sorted_count=self.sorted_count,
            order_head=self._order_head,
            num_slots=self.num_slots,
        )

    def attend(
        self,
        qs: torch.Tensor,
        tau,
        *,
        num_new: int,
        q: torch.Tensor | None = None,
        scale=None,
        prefix_ks: torch.Tensor | None = None,
        prefix_v: torch.Tensor | None = None,
        prefix_k: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Windowed attention of the ``num_new`` queries just appended (see :func:`~hf_rbf.sorted_window_attention`);
        exact when ``decode_window`` is None (the window then spans every cached token)."""
        window = self.decode_window if self.decode_window is not None else max(1, self.num_slots)
        query_index = torch.arange(self.seen_tokens - num_new, self.seen_tokens, device=qs.device)
        fn = sorted_window_attention
        backend, reason = "torch", "requested"
        if self.decode_backend != "torch":
            reason = kernel_unavailable_reason(qs.device)
            if self.decode_backend == "auto" and window > AUTO_FUSED_MAX_WINDOW:
                reason = f"'auto' takes the fused kernel for windows up to {AUTO_FUSED_MAX_WINDOW} keys; got {window}"
            elif reason is None and self.decode_backend == "auto" and qs.device.type != "cuda":
                # "auto" takes the fused kernel on CUDA only: on the CPU it would run in Triton's interpreter
                reason = "'auto' takes the fused kernel on CUDA only"
            if reason is None:
                fn, backend = sorted_window_attention_triton, "triton"
            elif self.decode_backend == "triton":
                raise ValueError(f"SortedScalarCacheLayer: decode_backend='triton' cannot serve this step: {reason}")
        key = (self.decode_backend, backend, qs.device.type, reason)
        if key not in _LOGGED_DECODE:
            _LOGGED_DECODE.add(key)
            logger.info("sorted decode step: backend=%r on %s (requested %r)%s", backend, qs.device.type,
                        self.decode_backend, "" if reason is None else f": {reason}")  # fmt: skip
        self.last_decode_backend, self.last_decode_reason = backend, reason
        return fn(
            self.state(),
            qs,
            tau,
            window=window,
            query_token_index=query_index,
            q=q,
            scale=scale,
            prefix_ks=prefix_ks,
            prefix_v=prefix_v,
            prefix_k=prefix_k,
        )

    def end_step(
        self,
        qs: torch.Tensor,
        valid: torch.Tensor | None = None,
        tau: torch.Tensor | float | None = None,
        q: torch.Tensor | None = None,
        scale=None,
    ) -> None:
        """Record the step's queries ``[B, H, N]`` (``valid [B, N]``) for geometric eviction and, with their
        temperature ``tau`` (``[H]`` or ``[B, H, N]``), vector queries ``q [B, H, N, D]`` and dot-product ``scale``
        (hybrid layers), for attention-weighted density merging; enforce the bound when a prompt longer than
        ``max_cache_tokens`` was just inserted."""
        if not self.is_initialized or self.max_cache_tokens is None:
            # without a bound nothing is ever evicted, and the recorded queries serve eviction alone: a decode step
            # saves their dozen small ops per layer (a bound set later records from its next step on)
            return
        b, h, n = qs.shape
        keep = self.eviction_recent_queries
        new_valid = torch.ones(b, n, dtype=torch.bool, device=qs.device) if valid is None else valid.bool()
        new_index = torch.arange(self.seen_tokens - n, self.seen_tokens, device=qs.device).expand(b, n)
        if tau is not None or self.recent_tau is not None:
            # queries recorded without a temperature have tau = NaN: attention weighting ignores them
            if tau is None:
                tau = torch.full((b, h, n), float("nan"), device=qs.device)
            tau_dtype = torch.promote_types(self.dtype, torch.float32)
            tau = torch.as_tensor(tau, device=qs.device).to(tau_dtype)
            tau = (tau.view(1, -1, 1) if tau.dim() <= 1 else tau).expand(b, h, n)
            if self.recent_tau is None:
                size = (b, h, self.recent_qs.shape[-1])
                self.recent_tau = torch.full(size, float("nan"), dtype=tau_dtype, device=qs.device)
            self.recent_tau = torch.cat([self.recent_tau, tau], dim=-1)[..., -keep:]
        if q is not None and self.vector_keys is not None:
            if self.recent_q is None:
                self.recent_q = torch.zeros(
                    b, h, self.recent_qs.shape[-1], q.shape[-1], dtype=self.dtype, device=qs.device
                )
            self.recent_q = torch.cat([self.recent_q, q.to(self.dtype)], dim=2)[:, :, -keep:]
            self.recent_scale = scale
        self.recent_qs = torch.cat([self.recent_qs, qs.to(self.recent_qs.dtype)], dim=-1)[..., -keep:]
        self.recent_valid = torch.cat([self.recent_valid, new_valid], dim=-1)[..., -keep:]
        self.recent_token_index = torch.cat([self.recent_token_index, new_index], dim=-1)[..., -keep:]
        self._enforce_bound()

    def _enforce_bound(self) -> None:
        limit = self.max_cache_tokens
        if limit is not None and not self.record_past and self.num_slots > limit:
            self._evict_to(max(0, limit - self.eviction_batch))

    # ------------------------------------------------------------------------------------------------------------
    # sorted arrays
    # ------------------------------------------------------------------------------------------------------------
    def _order_keys(self, start: int, stop: int) -> torch.Tensor:
        """``[B, O, stop - start]`` order keys of slots ``[start, stop)``, ``+inf`` for invalid slots."""
        k = self.keys[:, self._order_head, start:stop]
        return k.masked_fill(~self.valid[:, start:stop].unsqueeze(1), _INF)

    def _merge_buffer(self) -> None:
        """Merge the recent buffer (slots ``[M, S)``) into the sorted arrays: ``O((M + R) log R)``, no host sync."""
        m, s = self.num_sorted, self.num_slots
        if s == m:
            return
        kb = self._order_keys(m, s)
        kb, idx = torch.sort(kb, dim=-1, stable=True)
        sb = idx + m
        cb = (kb < _INF).sum(-1)
        if m == 0:
            self.sorted_keys, self.sorted_slots, self.sorted_count = kb, sb, cb
        else:
            km, sm = self.sorted_keys, self.sorted_slots
            # Ties: sorted entries (older slots) first, so the merged arrays stay in (key, slot) order.
            pos_m = torch.arange(m, device=self.device) + torch.searchsorted(kb, km, side="left")
            pos_b = torch.arange(s - m, device=self.device) + torch.searchsorted(km, kb, side="right")
            shape = (km.shape[0], km.shape[1], s)
            keys = torch.empty(shape, dtype=km.dtype, device=self.device)
            slots = torch.empty(shape, dtype=torch.long, device=self.device)
            keys.scatter_(-1, pos_m, km).scatter_(-1, pos_b, kb)
            slots.scatter_(-1, pos_m, sm).scatter_(-1, pos_b, sb)
            self.sorted_keys, self.sorted_slots = keys, slots
            self.sorted_count = self.sorted_count + cb
        self.num_sorted = s

    def _drop_invalid_sorted(self) -> None:
        """Move sorted entries whose slot became invalid (crop, eviction) behind the valid ones: ``O(M)``."""
        m = self.num_sorted
        if m == 0:
            return
        b, o = self.sorted_keys.shape[:2]
        in_count = torch.arange(m, device=self.device) < self.sorted_count.unsqueeze(-1)
        slot_ok = self.valid.gather(1, self.sorted_slots.reshape(b, o * m)).view(b, o, m)
        ok = in_count & slot_ok
        ok_l = ok.long()
        n_ok = ok_l.sum(-1, keepdim=True)
        pos = torch.where(ok, ok_l.cumsum(-1) - 1, n_ok + (1 - ok_l).cumsum(-1) - 1)
        self.sorted_keys = torch.empty_like(self.sorted_keys).scatter_(-1, pos, self.sorted_keys.masked_fill(~ok, _INF))
        self.sorted_slots = torch.empty_like(self.sorted_slots).scatter_(-1, pos, self.sorted_slots)
        self.sorted_count = n_ok.squeeze(-1)

    def _rebuild_sorted(self) -> None:
        """Sort every slot from scratch (after density merging changed keys): ``O(S log S)``."""
        s = self.num_slots
        keys, idx = torch.sort(self._order_keys(0, s), dim=-1, stable=True)
        self.sorted_keys, self.sorted_slots = keys, idx
        self.sorted_count = (keys < _INF).sum(-1)
        self.num_sorted = s

    # ------------------------------------------------------------------------------------------------------------
    # eviction
    # ------------------------------------------------------------------------------------------------------------
    def valid_counts(self) -> torch.Tensor:
        """``[B]`` tokens currently held by each row."""
        return self.valid[:, : self.num_slots].sum(-1)

    def _protected(self, s: int) -> torch.Tensor:
        """``[B, S]`` tokens inside the sink zone in some scalar head."""
        if self.sink_zone is None:
            return torch.zeros(self.keys.shape[0], s, dtype=torch.bool, device=self.device)
        lo, hi = self.sink_zone
        ks = self.keys[:, :, :s]
        inside = (ks >= lo) & (ks <= hi) & self._scalar_head_mask.view(1, -1, 1)
        return inside.any(1)

    def _geometric_distance(self, s: int) -> torch.Tensor:
        """``[B, S]``: how far outside ``[min recent qs - r, max recent qs + r]`` each token lies, in the scalar head
        where it lies closest (0 inside the range of some head)."""
        r = self.eviction_radius
        rv = self.recent_valid.unsqueeze(1)
        q = self.recent_qs.float()
        lo = q.masked_fill(~rv, _INF).amin(-1, keepdim=True) - r  # [B, H, 1]
        hi = q.masked_fill(~rv, -_INF).amax(-1, keepdim=True) + r
        ks = self.keys[:, :, :s].float()
        dist = (lo - ks).clamp_min(0) + (ks - hi).clamp_min(0)
        dist = torch.nan_to_num(dist, nan=0.0, posinf=0.0)  # rows without recent queries: no geometric preference
        dist = dist.masked_fill(~self._scalar_head_mask.view(1, -1, 1), _INF)
        dist = dist.amin(1)
        return torch.where(torch.isfinite(dist), dist, torch.zeros_like(dist))

    def _keep_mask(self, target: int, policy: str) -> torch.Tensor:
        """``[B, S]`` bool: the tokens each row keeps so that it holds at most ``target``: victims in decreasing
        priority (geometric distance, or none for "oldest"), then oldest first; sink-zone tokens last."""
        s = self.num_slots
        valid = self.valid[:, :s]
        excess = (valid.sum(-1, keepdim=True) - target).clamp_min(0)
        if policy == "geometric":
            priority = self._geometric_distance(s)
        else:
            priority = torch.zeros(valid.shape, dtype=torch.float32, device=self.device)
        priority = priority.masked_fill(self._protected(s), -1.0).masked_fill(~valid, -_INF)
        by_age = torch.sort(self.token_index[:, :s], dim=-1, stable=True).indices
        by_priority = torch.sort(priority.gather(1, by_age), dim=-1, descending=True, stable=True).indices
        victims_in_order = by_age.gather(1, by_priority)
        rank = torch.empty_like(victims_in_order).scatter_(
            1, victims_in_order, torch.arange(s, device=self.device).expand_as(victims_in_order)
        )
        return valid & ~(rank < excess)

    def _token_log_importance(self, s: int) -> torch.Tensor:
        """``[B, S]``: the log of the attention mass the recent queries give each cached token, averaged over the
        queries and heads: per head and query ``softmax_j(-(qs - ks_j)^2 / tau + log w_j (+ scale q.k_j))`` over the
        valid cached tokens the query could see (token index ``<=`` its own), the sink and registers left out (they
        are never merged).  ``-inf`` for tokens no recent query sees.  ``O(H Q S)`` for ``Q`` recent queries."""
        if self.recent_tau is None:
            raise ValueError(
                "SortedScalarCacheLayer: density_merge_weighting='attention' needs the recent queries' temperatures: "
                "pass `tau` to end_step (the scalar-sort and hybrid-sort attention layers do)"
            )
        f32 = torch.promote_types(self.keys.dtype, torch.float32)  # float64 for a float64 cache
        ks = self.keys[:, :, :s].to(f32)  # [B, H, S]
        tau = self.recent_tau.to(f32)  # [B, H, Q]
        query_ok = self.recent_valid.unsqueeze(1) & torch.isfinite(tau)  # [B, H, Q]
        safe_tau = torch.where(query_ok, tau, torch.ones_like(tau))
        scores = -((self.recent_qs.to(f32).unsqueeze(-1) - ks.unsqueeze(-2)) ** 2) / safe_tau.unsqueeze(-1)
        if self.log_weight is not None:
            scores = scores + self.log_weight[:, :, :s].to(f32).unsqueeze(-2)
        if self.recent_q is not None and self.vector_keys is not None:
            scale = self.recent_scale
            scale = scale.to(f32).view(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else float(scale)
            dots = self.recent_q.to(f32) @ self.vector_keys[:, :, :s].to(f32).transpose(-1, -2)
            scores = scores + scale * dots
        sees = self.valid[:, :s].view(-1, 1, 1, s) & (
            self.token_index[:, :s].view(-1, 1, 1, s)
            <= self.recent_token_index.view(-1, 1, self.recent_qs.shape[-1], 1)
        )
        allowed = sees & query_ok.unsqueeze(-1)  # [B, H, Q, S]
        scores = scores.masked_fill(~allowed, -_INF)
        log_z = torch.logsumexp(scores, dim=-1, keepdim=True)
        log_w = (scores - torch.where(torch.isfinite(log_z), log_z, torch.zeros_like(log_z))).masked_fill(
            ~allowed, -_INF
        )
        return torch.logsumexp(log_w.flatten(1, 2), dim=1)  # [B, S]: log of the summed mass (a constant off the mean)

    def _density_merge(self, target: int) -> None:
        """Merge groups of ``density_merge_size`` (``m``) entries adjacent in the first order into one entry, the
        groups with the smallest key range first (the Euclidean norm over the scalar heads of each head's range: the
        densest stretches of the scalar axis), until each row holds ``<= target`` (a group frees ``m - 1`` entries).

        The merged entry: keys, values and vector keys are averages of the group's entries weighted by
        ``density_merge_weighting``: ``"multiplicity"`` (the tokens each entry already stands for) or ``"attention"``
        (:meth:`_token_log_importance`, normalised inside the group; a group no recent query sees falls back to the
        multiplicities, as it has no attention to weigh by); the log-weight is the log of the summed weights
        (``logsumexp``), so the entry carries the kernel mass of every token it replaces; the multiplicities add up;
        the entry keeps the newest token's slot and index."""
        self._ensure_log_weight()
        self._ensure_multiplicity()
        size = self.density_merge_size
        rounds = math.ceil(math.log(max(self.num_slots, 2) / max(target, 1)) / math.log(size)) + 1
        b, h = self.keys.shape[:2]
        head_mask = self._scalar_head_mask.view(1, -1, 1, 1)
        for _ in range(rounds):
            self._merge_buffer()
            s, m = self.num_slots, self.num_sorted
            groups = m // size
            if groups == 0:
                break
            excess = (self.valid[:, :s].sum(-1, keepdim=True) - target).clamp_min(0)  # [B, 1]
            needed = torch.div(excess + size - 2, size - 1, rounding_mode="floor")  # groups to merge
            members = self.sorted_slots[:, 0, : groups * size].reshape(b, groups, size)  # [B, P, m]
            flat = members.reshape(b, groups * size)
            last = torch.arange(groups, device=self.device) * size + size - 1
            group_ok = last < self.sorted_count[:, :1]  # every member is a valid sorted entry
            keys = self.keys.gather(2, flat.unsqueeze(1).expand(-1, h, -1)).view(b, h, groups, size).float()
            spread = (keys.amax(-1, keepdim=True) - keys.amin(-1, keepdim=True)).masked_fill(~head_mask, 0.0)
            gap = (spread.squeeze(-1) ** 2).sum(1).sqrt()  # [B, P]
            protected = self._protected(s).gather(1, flat).view(b, groups, size).any(-1)
            blocked = ~group_ok | protected
            gap = gap.masked_fill(blocked, _INF)
            rank = torch.empty_like(gap, dtype=torch.long).scatter_(
                1, torch.sort(gap, dim=-1, stable=True).indices, torch.arange(groups, device=self.device).expand(b, -1)
            )
            chosen = (rank < needed) & ~blocked  # [B, P]

            multiplicity = self.multiplicity.gather(1, flat).view(b, groups, size)
            weights = multiplicity / multiplicity.sum(-1, keepdim=True)
            if self.density_merge_weighting == "attention":
                importance = self._token_log_importance(s).gather(1, flat).view(b, groups, size)
                seen = torch.isfinite(importance).any(-1, keepdim=True)
                by_attention = torch.softmax(torch.where(seen, importance, torch.zeros_like(importance)), dim=-1)
                weights = torch.where(seen, by_attention, weights)
            tokens = self.token_index.gather(1, flat).view(b, groups, size)
            newest = tokens.argmax(-1, keepdim=True)  # [B, P, 1]
            survivor = members.gather(2, newest).squeeze(-1)  # [B, P]
            is_victim = torch.ones_like(members, dtype=torch.bool).scatter_(2, newest, False) & chosen.unsqueeze(-1)

            for name in ("keys", "values", "vector_keys"):
                t = getattr(self, name)
                if t is not None:
                    _merge_groups_(t, members, survivor, weights, chosen)
            lw = self.log_weight.gather(2, flat.unsqueeze(1).expand(-1, h, -1)).view(b, h, groups, size)
            idx_s = survivor.unsqueeze(1).expand(-1, h, -1)
            self.log_weight.scatter_(
                2, idx_s, torch.where(chosen.unsqueeze(1), torch.logsumexp(lw, -1), self.log_weight.gather(2, idx_s))
            )
            self.multiplicity.scatter_(
                1, survivor, torch.where(chosen, multiplicity.sum(-1), self.multiplicity.gather(1, survivor))
            )
            self.token_index.scatter_(
                1, survivor, torch.where(chosen, tokens.amax(-1), self.token_index.gather(1, survivor))
            )
            self.valid.scatter_(1, flat, self.valid.gather(1, flat) & ~is_victim.view(b, groups * size))
            self._rebuild_sorted()

    def _evict_to(self, target: int) -> None:
        """Make every row hold at most ``target`` tokens with the configured policy, then compact the slots to
        ``target`` (``O(S log S)``; runs once every ``eviction_batch`` steps)."""
        if self.num_slots == 0:
            return
        self._merge_buffer()
        if self.cache_eviction == "density":
            self._density_merge(target)
            keep = self._keep_mask(target, "oldest")  # guarantees the bound if merging could not
        else:
            keep = self._keep_mask(target, self.cache_eviction)
        self.valid[:, : self.num_slots] = keep
        self._compact(max(target, 0))
        limit = self.max_cache_tokens
        if limit is not None and self.capacity > max(limit, self.num_slots):
            # a prompt longer than the bound grew the buffers past it: give the memory back
            self._resize_slots(max(limit, self.num_slots))

    def _compact(self, new_slots: int) -> None:
        """Pack each row's valid slots (in slot order) into the first ``new_slots`` slots (every row must hold at most
        that many) and remap the sorted arrays."""
        self._merge_buffer()
        s = self.num_slots
        new_slots = min(new_slots, s)
        b = self.keys.shape[0]
        keep = self.valid[:, :s]
        src = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[:, :new_slots]  # kept slots first
        count = keep.sum(-1, keepdim=True)
        slot_map = torch.where(keep, keep.long().cumsum(-1) - 1, -1)
        self._drop_invalid_sorted()
        for name, dim in self._slot_tensors():
            t = getattr(self, name)
            if t is None:
                continue
            view = [b] + [1] * (t.dim() - 1)
            view[dim] = new_slots
            shape = list(t.shape)
            shape[dim] = new_slots
            moved = t.narrow(dim, 0, s).gather(dim, src.view(view).expand(shape))
            t.narrow(dim, 0, new_slots).copy_(moved)
        self.valid[:, :new_slots] &= torch.arange(new_slots, device=self.device) < count
        self.valid[:, new_slots:] = False
        m = min(self.num_sorted, new_slots)
        o = self.num_orders
        slots = self.sorted_slots[:, :, :m]
        self.sorted_slots = slot_map.gather(1, slots.reshape(b, o * m)).view(b, o, m).clamp_min(0)
        self.sorted_keys = self.sorted_keys[:, :, :m].contiguous()
        self.num_slots = new_slots
        self.num_sorted = m
        self.tail_tokens = 0

    # ------------------------------------------------------------------------------------------------------------
    # transformers' CacheLayerMixin API
    # ------------------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict | None = None, *args, **kwargs
    ):
        """Append packed keys ``[B, H, N, 1 (+ D)]`` (scalar key first) and values ``[B, G, N, Dv]``;
        ``cache_kwargs`` may hold ``valid [B, N]`` and ``log_weight [B, H, N]``.  Returns every cached token's packed
        keys ``[B, H, S, 1 (+ D)]`` and values ``[B, G, S, Dv]`` in slot order (see :meth:`slot_view` for validity)."""
        cache_kwargs = cache_kwargs or {}
        vk = key_states[..., 1:] if key_states.shape[-1] > 1 else None
        self.append(
            key_states[..., 0],
            value_states,
            vk,
            valid=cache_kwargs.get("valid"),
            log_weight=cache_kwargs.get("log_weight"),
        )
        ks, v, vk, _, _ = self.slot_view()
        packed = ks.unsqueeze(-1) if vk is None else torch.cat([ks.unsqueeze(-1), vk], dim=-1)
        return packed, v

    def get_seq_length(self) -> int:
        """Tokens seen (positions, attention masks and ``generate`` count every token, evicted ones included)."""
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def activate_past_recording(self) -> None:
        """Defer eviction until :meth:`crop` (assisted / prompt-lookup decoding roll back rejected tokens)."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the ``-tokens_to_remove`` most recent tokens (transformers 5.x passes a negative count; a positive
        value is the legacy "keep that many tokens"); then apply any eviction deferred while recording."""
        if tokens_to_remove > 0:
            tokens_to_remove = tokens_to_remove - self.seen_tokens
        n = min(-tokens_to_remove, self.seen_tokens)
        if self.is_initialized and n > 0:
            cutoff = self.seen_tokens - n
            s = self.num_slots
            self.valid[:, :s] &= self.token_index[:, :s] < cutoff
            self.recent_valid &= self.recent_token_index < cutoff
            if n <= self.tail_tokens:
                # The last n slots hold exactly the removed tokens in every row: drop them.
                self.num_slots = s - n
                self.tail_tokens -= n
            self._drop_invalid_sorted()
            if self.num_sorted > self.num_slots:
                self.sorted_keys = self.sorted_keys[:, :, : self.num_slots].contiguous()
                self.sorted_slots = self.sorted_slots[:, :, : self.num_slots].contiguous()
                self.num_sorted = self.num_slots
            self.valid[:, self.num_slots :] = False
            self.seen_tokens = cutoff
        if self.is_initialized:
            self._enforce_bound_after_recording()

    def _enforce_bound_after_recording(self) -> None:
        limit = self.max_cache_tokens
        if limit is not None and self.num_slots > limit:
            self._evict_to(max(0, limit - self.eviction_batch))

    def _index_rows(self, fn) -> None:
        for name in self._per_row_tensors():
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the rows for beam search."""
        if self.is_initialized:
            self._index_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._index_rows(lambda t: t[indices].contiguous())

    def reset(self) -> None:
        self._clear()

    def offload(self) -> None:
        if self.is_initialized:
            self._index_rows(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self._index_rows(lambda t: t.to(self.device, non_blocking=True))

    def __repr__(self) -> str:
        return (
            f"SortedScalarCacheLayer(heads={self.num_heads}, groups={self.num_value_groups}, "
            f"window={self.decode_window}, scheme={self.sort_scheme!r}, tokens={self.seen_tokens}, "
            f"slots={self.num_slots}, sorted={self.num_sorted})"
        )


_FROM_CONFIG = object()


class SortedScalarCache(Cache):
    """A transformers ``Cache`` for scalar-sort / hybrid-sort models.

    Every argument defaults to the model config's field of the same name (see :class:`~hf_rbf.ScalarSortConfig`);
    pass one to override it, e.g. ``SortedScalarCache(decode_window=32)`` or ``SortedScalarCache(decode_window=None,
    max_cache_tokens=4096, cache_eviction="density")``.  The model fills the layers on the first forward (or
    ``model.make_cache(**settings)`` builds a filled one).

    Args:
        decode_window (`int` or None): the window ``k`` (None = exact).
        sort_scheme, sort_head, cache_buffer_size, max_cache_tokens, max_cache_bytes, cache_eviction, eviction_radius,
            eviction_recent_queries, eviction_batch, sink_zone, decode_backend, density_merge_weighting,
            density_merge_size: see :class:`~hf_rbf.ScalarSortConfig`.  The eviction budget is given in tokens or
            in bytes: passing one of ``max_cache_tokens`` / ``max_cache_bytes`` replaces the config's budget in the
            other unit too (``max_cache_tokens=None`` alone turns eviction off); passing both non-None is an error.
        layers (`list`, *optional*): pre-built layers.
    """

    def __init__(
        self,
        decode_window=_FROM_CONFIG,
        *,
        sort_scheme=_FROM_CONFIG,
        sort_head=_FROM_CONFIG,
        cache_buffer_size=_FROM_CONFIG,
        max_cache_tokens=_FROM_CONFIG,
        max_cache_bytes=_FROM_CONFIG,
        cache_eviction=_FROM_CONFIG,
        eviction_radius=_FROM_CONFIG,
        eviction_recent_queries=_FROM_CONFIG,
        eviction_batch=_FROM_CONFIG,
        sink_zone=_FROM_CONFIG,
        decode_backend=_FROM_CONFIG,
        density_merge_weighting=_FROM_CONFIG,
        density_merge_size=_FROM_CONFIG,
        layers: list | None = None,
    ):
        given = dict(
            decode_window=decode_window,
            sort_scheme=sort_scheme,
            sort_head=sort_head,
            cache_buffer_size=cache_buffer_size,
            max_cache_tokens=max_cache_tokens,
            max_cache_bytes=max_cache_bytes,
            cache_eviction=cache_eviction,
            eviction_radius=eviction_radius,
            eviction_recent_queries=eviction_recent_queries,
            eviction_batch=eviction_batch,
            sink_zone=sink_zone,
            decode_backend=decode_backend,
            density_merge_weighting=density_merge_weighting,
            density_merge_size=density_merge_size,
        )
        self.settings = {k: v for k, v in given.items() if v is not _FROM_CONFIG}
        self._check_given(self.settings)
        super().__init__(layers=list(layers) if layers is not None else [])

    @staticmethod
    def _check_given(settings: dict) -> None:
        """Checks that need no model (the rest is checked against the model's heads when the layers are built)."""
        name = "SortedScalarCache"
        defaults = dict(
            decode_window=None, sort_scheme="per_head", sort_head=0, cache_buffer_size=64, max_cache_tokens=None,
            max_cache_bytes=None, cache_eviction="geometric", eviction_radius=0.5, eviction_recent_queries=16,
            eviction_batch=None, sink_zone=None, decode_backend="auto", density_merge_weighting="multiplicity",
            density_merge_size=2,
        )  # fmt: skip
        merged = dict(defaults, **settings)
        sort_head = merged["sort_head"]
        if not isinstance(sort_head, int) or isinstance(sort_head, bool) or sort_head < 0:
            raise ValueError(
                f"{name}: `sort_head` must be an int >= 0 (an index inside a value group); got {sort_head!r}"
            )
        check_sorted_cache_settings(name, num_heads=1, num_value_groups=1, **dict(merged, sort_head=0))

    def resolved_settings(self, config) -> dict:
        """The settings for a model: the config's fields overridden by those given to this cache."""
        settings = override_cache_settings(config.sorted_cache_settings(), self.settings)
        check_sorted_cache_settings(
            "SortedScalarCache",
            num_heads=config.num_attention_heads,
            num_value_groups=config.num_value_groups,
            **settings,
        )
        return settings

    @property
    def decode_window(self):
        """The window of the first sorted layer (None = exact or no sorted layer yet)."""
        for layer in self.layers:
            if isinstance(layer, SortedScalarCacheLayer):
                return layer.decode_window
        return self.settings.get("decode_window")


class ByteBudgetSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding layer bounded by a byte budget (``max_cache_bytes`` on the "dot" and sliding layers of
    a scalar-sort / hybrid-sort model): at the first update it converts ``max_cache_bytes`` into a token bound from
    the bytes per token and row of the keys and values it is given, ``max_cache_tokens = max_cache_bytes //
    bytes_per_token``, then keeps the last ``max_cache_tokens`` tokens (and at most ``window - 1`` for a sliding
    attention layer), as ``DynamicSlidingWindowLayer(min(window, max_cache_tokens + 1))`` does under
    ``max_cache_tokens``.

    Args:
        max_cache_bytes: the budget, bytes per batch row (int >= 1).
        window: the attention layer's sliding window (None: full attention).
    """

    _UNBOUNDED = 2**62  # the window until the first update sets it (no mask is sized before a token is cached)

    def __init__(self, max_cache_bytes: int, window: int | None = None):
        name = type(self).__name__
        if not isinstance(max_cache_bytes, int) or isinstance(max_cache_bytes, bool) or max_cache_bytes < 1:
            raise ValueError(f"{name}: `max_cache_bytes` must be an int >= 1; got {max_cache_bytes!r}")
        super().__init__(sliding_window=self._UNBOUNDED if window is None else window)
        self.max_cache_bytes = max_cache_bytes
        self.attention_window = window
        self.max_cache_tokens = None
        self.bytes_per_token = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        per_token = (
            key_states.shape[1] * key_states.shape[-1] * key_states.element_size()
            + value_states.shape[1] * value_states.shape[-1] * value_states.element_size()
        )
        tokens = self.max_cache_bytes // per_token
        if tokens < 1:
            raise ValueError(
                f"{type(self).__name__}: `max_cache_bytes` ({self.max_cache_bytes}) is below one cached token of this "
                f"layer ({per_token} bytes per token and row in {key_states.dtype})"
            )
        self.bytes_per_token, self.max_cache_tokens = per_token, tokens
        window = tokens + 1 if self.attention_window is None else min(self.attention_window, tokens + 1)
        self.sliding_window = window
        self._sliding_window_tensor = torch.tensor(window, dtype=torch.long)
        super().lazy_initialization(key_states, value_states)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_cache_bytes={self.max_cache_bytes}, window={self.attention_window}, "
            f"max_cache_tokens={self.max_cache_tokens})"
        )


__all__ = ["ByteBudgetSlidingWindowLayer", "SortedScalarCache", "SortedScalarCacheLayer"]
