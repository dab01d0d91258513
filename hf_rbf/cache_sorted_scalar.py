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

The window semantics do not depend on the buffer (the candidates always contain the window), so results are the
same for every ``cache_buffer_size``; ``decode_window=None`` runs the layer's exact attention function over the
cached tokens instead.
"""

from __future__ import annotations

import logging
import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .configuration_scalar_sort import check_sorted_cache_settings
from .kernels_sorted_decode import kernel_unavailable_reason, sorted_window_attention_triton
from .sorted_decode import SortedCacheState, sorted_window_attention

logger = logging.getLogger("hf_rbf")
_LOGGED_DECODE: set = set()


_INF = float("inf")


def _merge_pairs_(t: torch.Tensor, a, c, survivor, frac_a, chosen) -> None:
    """In place: for every chosen pair (slots ``a``, ``c`` of each row, ``[B, P]``), write
    ``frac_a * t[a] + (1 - frac_a) * t[c]`` at the ``survivor`` slot of ``t`` (slot axis 2: ``[B, X, C, ...]``)."""
    b, pairs = a.shape
    view = [b, 1, pairs] + [1] * (t.dim() - 3)
    shape = list(t.shape[:2]) + [pairs] + list(t.shape[3:])
    fa = frac_a.view(view).to(t.dtype)
    merged = fa * t.gather(2, a.view(view).expand(shape)) + (1 - fa) * t.gather(2, c.view(view).expand(shape))
    idx_s = survivor.view(view).expand(shape)
    t.scatter_(2, idx_s, torch.where(chosen.view(view), merged, t.gather(2, idx_s)))


class SortedScalarCacheLayer(CacheLayerMixin):
    """One scalar / hybrid layer of a :class:`SortedScalarCache` (see the module docstring for layout and costs).

    Args:
        num_heads, num_value_groups: ``H`` and ``G`` of the layer.
        scalar_heads (`list[bool]`, *optional*): which heads have a scalar term (hybrid layers' "dot" heads do not;
            they are ignored by geometric eviction, the sink zone and density merging).  Default: all.
        decode_window, sort_scheme, sort_head, cache_buffer_size, max_cache_tokens, cache_eviction, eviction_radius,
            eviction_recent_queries, eviction_batch, sink_zone, decode_backend: as in
            :class:`~hf_rbf.ScalarSortConfig`.

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
        decode_backend: str = "torch",
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
        self.cache_eviction = cache_eviction
        self.eviction_radius = float(eviction_radius)
        self.eviction_recent_queries = eviction_recent_queries
        if max_cache_tokens is not None and eviction_batch is None:
            eviction_batch = max(1, max_cache_tokens // 16)
        self.eviction_batch = eviction_batch
        heads_per_group = num_heads // num_value_groups
        if sort_scheme == "per_head":
            self.order_head_list = list(range(num_heads))
        else:
            self.order_head_list = [grp * heads_per_group + sort_head for grp in range(num_value_groups)]
        self.decode_backend = decode_backend
        self.last_decode_backend = None  # "torch" or "triton": what served the last windowed step
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
        self.token_index = None  # [B, C] int64
        self.sorted_keys = None  # [B, O, M]
        self.sorted_slots = None  # [B, O, M] int64
        self.sorted_count = None  # [B, O] int64
        self.recent_qs = None  # [B, H, Q] the last queries (geometric eviction)
        self.recent_valid = None  # [B, Q] bool
        self.recent_token_index = None  # [B, Q] int64
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
        cap = 16
        g, dv = value_states.shape[1], value_states.shape[3]
        dev = self.device
        self.keys = torch.zeros(b, h, cap, dtype=self.dtype, device=dev)
        self.values = torch.zeros(b, g, cap, dv, dtype=value_states.dtype, device=dev)
        self.vector_keys = torch.zeros(b, h, cap, width - 1, dtype=self.dtype, device=dev) if width > 1 else None
        self.valid = torch.zeros(b, cap, dtype=torch.bool, device=dev)
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

    def _per_row_tensors(self) -> list[str]:
        return [
            "keys", "values", "vector_keys", "log_weight", "multiplicity", "valid", "token_index", "sorted_keys",
            "sorted_slots", "sorted_count", "recent_qs", "recent_valid", "recent_token_index",
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
        for name, dim in self._slot_tensors():
            t = getattr(self, name)
            if t is None:
                continue
            shape = list(t.shape)
            shape[dim] = new_cap
            grown = torch.zeros(shape, dtype=t.dtype, device=t.device)
            grown.narrow(dim, 0, cap).copy_(t)
            setattr(self, name, grown)

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
    ) -> None:
        """Insert ``N`` new tokens: ``scalar_keys [B, H, N]``, ``values [B, G, N, Dv]``, ``vector_keys [B, H, N, D]``
        (hybrid), ``valid [B, N]`` (False = padding; default all True), ``log_weight [B, H, N]`` (key weights)."""
        b, h, n = scalar_keys.shape
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
        # Make room first, so the cache never holds more than max_cache_tokens (deferred while recording the past).
        limit = self.max_cache_tokens
        if limit is not None and not self.record_past and self.num_slots > 0 and self.num_slots + n > limit:
            self._evict_to(max(0, limit - n - self.eviction_batch))
        # Merge the waiting buffer *before* writing: every sorted entry must be older than every query of this step
        # (the search has no causal mask); the new tokens wait in the buffer, where causality is checked per query.
        if self.num_slots - self.num_sorted + n > self.cache_buffer_size:
            self._merge_buffer()
        s = self.num_slots
        self._ensure_capacity(s + n)
        self.keys[:, :, s : s + n] = scalar_keys
        self.values[:, :, s : s + n] = values
        if vector_keys is not None:
            self.vector_keys[:, :, s : s + n] = vector_keys
        self.valid[:, s : s + n] = True if valid is None else valid.to(torch.bool)
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
        backend = "torch"
        if self.decode_backend != "torch":
            reason = kernel_unavailable_reason(qs.device)
            if reason is None:
                fn, backend = sorted_window_attention_triton, "triton"
            elif self.decode_backend == "triton":
                raise ValueError(f"SortedScalarCacheLayer: decode_backend='triton' cannot serve this step: {reason}")
        key = (self.decode_backend, backend, qs.device.type)
        if key not in _LOGGED_DECODE:
            _LOGGED_DECODE.add(key)
            logger.info("sorted decode step: backend=%r on %s (requested %r)", backend, qs.device.type,
                        self.decode_backend)  # fmt: skip
        self.last_decode_backend = backend
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

    def end_step(self, qs: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Record the step's queries ``[B, H, N]`` (``valid [B, N]``) for geometric eviction; enforce the bound when a
        prompt longer than ``max_cache_tokens`` was just inserted."""
        if not self.is_initialized:
            return
        n = qs.shape[-1]
        q = self.eviction_recent_queries
        new_valid = torch.ones(qs.shape[0], n, dtype=torch.bool, device=qs.device) if valid is None else valid.bool()
        new_index = torch.arange(self.seen_tokens - n, self.seen_tokens, device=qs.device).expand(qs.shape[0], n)
        self.recent_qs = torch.cat([self.recent_qs, qs.to(self.recent_qs.dtype)], dim=-1)[..., -q:]
        self.recent_valid = torch.cat([self.recent_valid, new_valid], dim=-1)[..., -q:]
        self.recent_token_index = torch.cat([self.recent_token_index, new_index], dim=-1)[..., -q:]
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

    def _density_merge(self, target: int) -> None:
        """Merge pairs of tokens adjacent in the first order with the smallest key distance (over all scalar heads)
        into one entry: keys and values are multiplicity-weighted averages, the log-weight the log of the summed
        weights, so a merged entry carries the mass of both.  Rounds until each row holds ``<= target``."""
        self._ensure_log_weight()
        self._ensure_multiplicity()
        rounds = math.ceil(math.log2(max(self.num_slots, 2) / max(target, 1))) + 1
        b = self.keys.shape[0]
        for _ in range(rounds):
            self._merge_buffer()
            s, m = self.num_slots, self.num_sorted
            pairs = m // 2
            if pairs == 0:
                break
            excess = (self.valid[:, :s].sum(-1, keepdim=True) - target).clamp_min(0)  # [B, 1]
            order0 = self.sorted_slots[:, 0]
            a, c = order0[:, 0 : 2 * pairs : 2], order0[:, 1 : 2 * pairs : 2]  # [B, P]
            pair_ok = (torch.arange(pairs, device=self.device) * 2 + 1) < self.sorted_count[:, :1]
            ka = self.keys.gather(2, a.unsqueeze(1).expand(-1, self.num_heads, -1)).float()
            kc = self.keys.gather(2, c.unsqueeze(1).expand(-1, self.num_heads, -1)).float()
            head_mask = self._scalar_head_mask.view(1, -1, 1)
            gap = ((ka - kc) ** 2).masked_fill(~head_mask, 0.0).sum(1).sqrt()
            protected = self._protected(s)
            blocked = ~pair_ok | protected.gather(1, a) | protected.gather(1, c)
            gap = gap.masked_fill(blocked, _INF)
            rank = torch.empty_like(a).scatter_(
                1, torch.sort(gap, dim=-1, stable=True).indices, torch.arange(pairs, device=self.device).expand(b, -1)
            )
            chosen = (rank < excess) & ~blocked  # [B, P]
            ta, tc = self.token_index.gather(1, a), self.token_index.gather(1, c)
            keep_c = tc >= ta
            survivor, victim = torch.where(keep_c, c, a), torch.where(keep_c, a, c)
            wa = self.multiplicity.gather(1, a)
            wc = self.multiplicity.gather(1, c)
            frac_a = (wa / (wa + wc)).to(self.keys.dtype)  # [B, P]

            for name in ("keys", "values", "vector_keys"):
                t = getattr(self, name)
                if t is not None:
                    _merge_pairs_(t, a, c, survivor, frac_a, chosen)
            la = self.log_weight.gather(2, a.unsqueeze(1).expand(-1, self.num_heads, -1))
            lc = self.log_weight.gather(2, c.unsqueeze(1).expand(-1, self.num_heads, -1))
            idx_s = survivor.unsqueeze(1).expand(-1, self.num_heads, -1)
            old = self.log_weight.gather(2, idx_s)
            self.log_weight.scatter_(2, idx_s, torch.where(chosen.unsqueeze(1), torch.logaddexp(la, lc), old))
            self.multiplicity.scatter_(1, survivor, torch.where(chosen, wa + wc, self.multiplicity.gather(1, survivor)))
            self.token_index.scatter_(
                1, survivor, torch.where(chosen, torch.maximum(ta, tc), self.token_index.gather(1, survivor))
            )
            self.valid.scatter_(1, victim, self.valid.gather(1, victim) & ~chosen)
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
        sort_scheme, sort_head, cache_buffer_size, max_cache_tokens, cache_eviction, eviction_radius,
            eviction_recent_queries, eviction_batch, sink_zone, decode_backend: see
            :class:`~hf_rbf.ScalarSortConfig`.
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
        cache_eviction=_FROM_CONFIG,
        eviction_radius=_FROM_CONFIG,
        eviction_recent_queries=_FROM_CONFIG,
        eviction_batch=_FROM_CONFIG,
        sink_zone=_FROM_CONFIG,
        decode_backend=_FROM_CONFIG,
        layers: list | None = None,
    ):
        given = dict(
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
            cache_eviction="geometric", eviction_radius=0.5, eviction_recent_queries=16, eviction_batch=None,
            sink_zone=None, decode_backend="torch",
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
        settings = config.sorted_cache_settings()
        settings.update(self.settings)
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


__all__ = ["SortedScalarCache", "SortedScalarCacheLayer"]
