"""The fixed-capacity sorted scalar cache: scalar-sort / hybrid-sort decoding with ``cache_implementation="static"``.

:class:`StaticSortedLayer` serves the full-attention "scalar" / "hybrid" layers of a
:class:`~hf_rbf.cache_static.StaticDecoderCache` (sliding-window and "dot" layers use
:class:`~hf_rbf.cache_static.StaticKeyValueLayer`).  Unlike :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCacheLayer`
(capacity doubling, a recent buffer merged into one sorted array every ``cache_buffer_size`` steps, so the insert cost
grows with ``n`` and spikes), every buffer is allocated once and a decode step is the same fixed sequence of tensor ops
whatever the cache length: no ``.item()``, no data-dependent shape, nothing a CUDA graph could not capture.

Layout (per batch row; ``C`` = capacity, a multiple of the block size ``T``; ``O`` orders as in the dynamic cache)
--------------------------------------------------------------------------------------------------------------------
* by slot (token ``t`` at slot ``t``): scalar keys ``[B, H, C]``, group values ``[B, G, C, Dv]``, vector keys
  ``[B, H, C, D]`` (hybrid), validity ``[B, C]`` (False: padding or not yet written), token index ``[C]``.
* every buffer is a slice ``[slot]`` of a tensor that holds that kind for all the layers of the cache built with the
  same ``share_key`` and sizes (:class:`~hf_rbf.cache_static.StackedBuffers`: a compiled decode step then guards one
  tensor per kind, not one per layer and kind); writes go to the stacked tensor
  (:func:`~hf_rbf.cache_static.index_copy_into`), and the fused step receives the stacked tensors and the slot.
* the search structure: ``C / T`` *sorted blocks*: block ``i`` holds slots ``[iT, (i+1)T)``, its order keys sorted
  ascending (``sorted_keys [B, O, C/T, T]``, ``+inf`` for invalid slots) and the slot of each entry
  (``sorted_slots``).  A single-token insert places the token in its block's sorted run by a binary search and a
  shift (``O(T)``, constant: no sort); a multi-token step re-sorts the blocks it touched.  There is no unsorted tail
  and no merge at all: the insert cost does not depend on ``n``.

Decode step (one query per row and head, window ``k``)
------------------------------------------------------
A binary search in every block (``searchsorted`` over ``[B, O, C/T, T]``) gives the query's insertion point there;
the ``min(2k, T)`` entries around it hold that block's ``k`` nearest order keys below and above the query.  The union
over blocks therefore holds the global ``k`` nearest below and above, and the window is picked among these candidates
exactly as :func:`hf_rbf.sorted_decode.window_candidates` picks it (rank of the query, ``k // 2`` below, shifted inward
at the ends; ties by slot): the same window as the dynamic cache, so ``decode_window >= n`` equals dense decoding.
(The fused kernel takes fewer candidates, the ``min(k, T)`` entries from ``p - k // 2``, which hold each block's share
of the same window: :mod:`hf_rbf.kernels_sorted_static_decode`, step 2.)
Cost per (row, head): ``(C / T) log T`` compares and ``(C / T) * min(2k, T)`` candidates, then ``k`` key / value
gathers.  With ``C / T`` blocks the candidate set grows with the *capacity* (not with the tokens present); choose
``T`` near ``sqrt(C * k)`` for long contexts (a log-structured set of runs would make it ``O(k log n)``; not built).

Two implementations of the single-token step, chosen by ``static_decode_backend`` ("auto": "triton" on CUDA when
the kernel can serve the layer, else "torch"; the choice is logged once and kept in ``decode_backend_used``):
"torch" is the chain of PyTorch ops above (``append`` inserts, ``attend`` searches and attends: the reference);
"triton" is one fused launch per layer step (:mod:`hf_rbf.kernels_sorted_static_decode`: insert, search, window,
softmax with the prefix, value sum), registered as a ``torch.library`` op so that ``torch.compile(fullgraph=True)``
traces it.  For the fused step ``append`` of one token only records it and the following ``attend`` inserts it; any
other use of the layer in between inserts it first.  Both keep two *fill copies* of the block being filled (copy
``n % 2`` holds its run), which let the fused launch insert and search at once without a race.  The fused launch
writes a block's run into the block buffer only when it completes the block, so the run of the block being filled is
always read from fill copy ``n % 2`` (the torch insert writes both, so its search may read the block buffer).

Multi-token steps (the prompt, prefill chunks) attend exactly over the cached tokens (as the prompt of the dynamic
cache does), so chunked prefill equals unchunked prefill; single-token decode steps use the window.
"""

from __future__ import annotations

import logging
import math

import torch
from transformers.cache_utils import CacheLayerMixin

from .cache_static import StackedLayerMixin, _stacked
from .kernels_common import next_pow2
from .kernels_sorted_static_decode import (
    MAX_CANDIDATES,
    candidate_span,
    static_decode_unavailable_reason,
    static_sorted_decode_step,
)
from .sorted_decode import SortedCacheState, sorted_window_attention

_INF = float("inf")
logger = logging.getLogger("hf_rbf")
_LOGGED_BACKEND: set = set()
# `static_decode_backend`: "auto" takes the fused Triton launch on CUDA when it can serve the layer, else torch.
STATIC_DECODE_BACKENDS = ("auto", "triton", "torch")


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# The block length of layers without a window (exact decode: no search, the blocks only keep the structure).
EXACT_BLOCK_SIZE = 64
# The sorted runs and fill copies keep each entry's slot as int32 (a single-token insert rewrites a block's run, so
# its bytes are the insert's memory traffic: 4-byte slots instead of 8 cut it by 30-40%); capacities stay below this.
SLOT_DTYPE = torch.int32
SLOT_MAX = 2**31 - 1


# The fused step's cost model (benchmarks/results/h100-2026-11-28, call 4: one layer, H100, 16 steps per CUDA graph,
# kernel time by torch.profiler).  Readers (one program per row and head) run a chain of dependent rounds whose length
# grows with the candidate tile: about 10.5 us + 3.5 us per 1,024 candidates (2k per block then; with k per block the
# same constants put the H200's steps within 10%: benchmarks/results/h200-2026-11-29i, call 3).  Writers insert the
# token into its block: with int64 slots about 36 bytes of memory traffic per (row, order, block entry), ~12 ps per
# entry at the H100's bandwidth (read key and slot, write both into the block and the other fill copy: 30 bytes);
# with int32 slots (SLOT_DTYPE) and the block written only when complete the same count gives 12 bytes, so the
# constant is scaled to 14 (not yet re-measured).  Both kinds run in the same launch, so the step takes about the
# longer of the two plus part of the shorter.
_READER_US = 10.5
_READER_US_PER_CANDIDATE = 3.5 / 1024
_WRITER_US_PER_ENTRY = 14 / 3.0e6
# Block lengths are multiples of this (aligned rows; the writers' chunks of WRITE_CHUNK entries).
BLOCK_ALIGN = 64


def _modeled_step_us(tile: int, entries: int) -> float:
    reader = _READER_US + _READER_US_PER_CANDIDATE * tile
    writer = _WRITER_US_PER_ENTRY * entries
    return max(reader, writer) + 0.4 * min(reader, writer)


def default_block_size(
    max_cache_len: int,
    decode_window: int | None,
    *,
    batch_size: int = 1,
    num_orders: int = 1,
    round_down: bool = False,
) -> int:
    """The block length ``T`` a :class:`StaticSortedLayer` takes when none is given: for a power-of-two number of
    blocks ``NB`` (the fused kernel pads the candidate tile's block rows to a power of two, so any other count wastes
    up to half the tile), ``T = ceil(C / NB)`` rounded up to a multiple of ``BLOCK_ALIGN`` (``round_down``: ``floor``,
    rounded down, so that ``NB`` blocks fit in ``C``, for a capacity sized in bytes), the ``NB`` whose modeled step is
    the shortest (the candidate tile ``NB x next_pow2(W)``, ``W`` the fused kernel's candidates per block, against
    the insert's ``batch_size x num_orders x T`` entries, measured constants above) among those whose tile fits the
    kernel (``MAX_CANDIDATES``).
    ``EXACT_BLOCK_SIZE`` without a window.

    Why: a step reads ``W`` candidates per block in a chain of dependent rounds (more blocks, longer chain) and
    shifts its token into one block (longer blocks, more traffic, which grows with the batch).  The former default
    ``next_pow2(sqrt(2 k C))`` left 17 / 33 / 65 blocks at 128k / 512k / 1M tokens, i.e. a tile half padding:
    39.2 us per layer step at 512k and batch 1 against 18.3 us with 8 blocks, 80.4 against 23.3 us at 1M with 16
    (benchmarks/results/h100-2026-11-28, call 4).  A fixed small ``T`` (64, before 2026-11-27) made the tile too large
    for the kernel, and the PyTorch path sorted the candidates at every step (h100-2026-11-27n, call 3)."""
    for arg, value, allowed in (
        ("max_cache_len", max_cache_len, "an int >= 1"),
        ("decode_window", decode_window, "None or an int >= 1"),
        ("batch_size", batch_size, "an int >= 1"),
        ("num_orders", num_orders, "an int >= 1"),
    ):
        if value is None and arg == "decode_window":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"default_block_size: `{arg}` must be {allowed}; got {value!r}")
    if decode_window is None or decode_window >= max_cache_len:
        return min(EXACT_BLOCK_SIZE, max_cache_len)
    best = None
    blocks = 1
    while True:
        if round_down:
            t = max(1, (max_cache_len // blocks) // BLOCK_ALIGN * BLOCK_ALIGN or max_cache_len // blocks)
        else:
            t = min(-(-(-(-max_cache_len // blocks)) // BLOCK_ALIGN) * BLOCK_ALIGN, max_cache_len)
        tile = next_pow2(-(-max_cache_len // t)) * next_pow2(candidate_span(decode_window, t)[0])
        if tile <= MAX_CANDIDATES:
            cost = _modeled_step_us(tile, batch_size * num_orders * t)
            if best is None or cost < best[0]:
                best = (cost, t)
        if t <= 1 or blocks >= max_cache_len:
            break
        blocks *= 2
    if best is None:  # no count fits (a window near the capacity): the fewest blocks
        return max_cache_len
    return best[1]


def blocked_window_candidates(
    sorted_keys: torch.Tensor, sorted_slots: torch.Tensor, qs: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of each query's window from sorted blocks.

    Args:
        sorted_keys: ``[B, O, NB, T]`` order keys, ascending within each block, ``+inf`` for invalid entries.
        sorted_slots: ``[B, O, NB, T]`` slot of each entry (int32 or int64).
        qs: scalar queries ``[B, H, Nq]`` (head ``h`` searches order ``h // (H / O)``); every valid entry is visible
            to every query (single-token decode: the cache holds only past tokens and the query's own).
        window: ``k >= 1``.

    Returns:
        ``(slots [B, H, Nq, k] int64, ok [B, H, Nq, k] bool)`` as :func:`hf_rbf.sorted_decode.window_candidates`.
    """
    b, num_orders, nb, t = sorted_keys.shape
    h, nq = qs.shape[1], qs.shape[2]
    k = window
    w = min(2 * k, t)
    device = qs.device
    hq = (h // num_orders) * nq
    search = qs.to(sorted_keys.dtype).reshape(b, num_orders, 1, hq).expand(b, num_orders, nb, hq).contiguous()
    p = torch.searchsorted(sorted_keys, search)  # [B, O, NB, hq]
    start = (p - k).clamp(0, t - w)
    j = start.unsqueeze(-1) + torch.arange(w, device=device)  # [B, O, NB, hq, w]
    keys = sorted_keys.unsqueeze(3).expand(b, num_orders, nb, hq, t).gather(-1, j)
    slots = sorted_slots.unsqueeze(3).expand(b, num_orders, nb, hq, t).gather(-1, j)
    # [B, O, hq, NB * w] in block order (ties: block, then slot inside the block, i.e. slot order)
    keys = keys.permute(0, 1, 3, 2, 4).reshape(b, num_orders, hq, nb * w).view(b, h, nq, nb * w)
    slots = slots.permute(0, 1, 3, 2, 4).reshape(b, num_orders, hq, nb * w).view(b, h, nq, nb * w)
    ok = torch.isfinite(keys)
    n_visible = ok.sum(-1)
    rank = ((keys < qs.to(keys.dtype).unsqueeze(-1)) & ok).sum(-1)
    first = torch.minimum((rank - k // 2).clamp_min(0), (n_visible - k).clamp_min(0))
    order = torch.sort(keys, dim=-1, stable=True).indices
    pos = first.unsqueeze(-1) + torch.arange(k, device=device)
    win_ok = pos < n_visible.unsqueeze(-1)
    pos = pos.clamp(max=keys.shape[-1] - 1)
    return slots.gather(-1, order.gather(-1, pos)).long(), win_ok


class StaticSortedLayer(StackedLayerMixin, CacheLayerMixin):
    """One full-attention scalar / hybrid layer of a :class:`~hf_rbf.cache_static.StaticDecoderCache` (see the module
    docstring for the layout and costs).

    Args:
        max_cache_len: the most tokens one sequence may hold; the capacity is rounded up to a multiple of
            ``block_size``.
        num_heads, num_value_groups: ``H`` and ``G`` of the layer.
        order_heads: the head whose scalar keys define each order (``O`` entries: every head under "per_head", the
            sort head of each value group under "sort_head").
        decode_window: the window ``k`` of single-token steps (None: exact attention over every cached token).
        block_size: ``T``, the length of the sorted blocks (None: :func:`default_block_size` of ``max_cache_len``,
            ``decode_window``, the number of orders and ``batch_size``).
        static_decode_backend: the windowed single-token step: "auto" (default: "triton" on CUDA when the fused
            kernel can serve the layer, else "torch"), "triton" (the fused launch; an error where it cannot run) or
            "torch" (the PyTorch ops, the reference).  What was chosen is ``decode_backend_used`` (and logged once).
        share_key: layers of one :class:`~hf_rbf.cache_static.StaticDecoderCache` with the same ``share_key`` (None:
            none) and sizes receive keys and values of the same shapes and hold their buffers stacked
            (:class:`~hf_rbf.cache_static.StackedBuffers`); the model passes its attention kind.
        batch_size: the rows the cache will hold, when known (``generate`` passes it): only for choosing the default
            ``block_size`` (the insert's traffic grows with the rows; None: 1).
    """

    is_compileable = True
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    keys = _stacked("keys", "``[B, H, C]`` scalar keys by slot (named `keys` for transformers)")
    values = _stacked("values", "``[B, G, C, Dv]`` group values by slot")
    vector_keys = _stacked("vector_keys", "``[B, H, C, D]`` vector keys by slot (hybrid layers; None otherwise)")
    valid = _stacked("valid", "``[B, C]`` bool: the slot holds a real (not padding) token")
    token_index = _stacked("token_index", "``[C]`` int64: the token at each slot (-1: empty)")
    sorted_keys = _stacked("sorted_keys", "``[B, O, C / T, T]`` order keys, ascending in each block (+inf: empty)")
    sorted_slots = _stacked("sorted_slots", "``[B, O, C / T, T]`` int32: the slot of each sorted entry")
    fill_keys = _stacked("fill_keys", "``[B, O, 2, T]`` the run of the block being filled, twice (copy n % 2 current)")
    fill_slots = _stacked("fill_slots", "``[B, O, 2, T]`` int32: the slots of the fill copies")
    decode_counter = _stacked("decode_counter", "``[1]`` int32: the fused launch's finish counter")
    order_head = _stacked("order_head", "``[O]`` int64: the head whose scalar keys define each order")
    _length = _stacked("cumulative_length", "``[]`` int64: the tokens seen")

    def __init__(
        self,
        *,
        max_cache_len: int,
        num_heads: int,
        num_value_groups: int,
        order_heads: list[int],
        decode_window: int | None,
        block_size: int | None = None,
        static_decode_backend: str = "auto",
        share_key=None,
        batch_size: int | None = None,
    ):
        super().__init__()
        name = type(self).__name__
        for arg, value in (("max_cache_len", max_cache_len), ("block_size", block_size), ("batch_size", batch_size)):
            if value is None and arg != "max_cache_len":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: `{arg}` must be {'' if arg == 'max_cache_len' else 'None or '}an int >= 1; "
                                 f"got {value!r}")
        if decode_window is not None and (
            not isinstance(decode_window, int) or isinstance(decode_window, bool) or decode_window < 1
        ):
            raise ValueError(f"{name}: `decode_window` must be None or an int >= 1; got {decode_window!r}")
        self.max_cache_len = max_cache_len
        if block_size is None:
            block_size = default_block_size(
                max_cache_len, decode_window, batch_size=batch_size or 1, num_orders=max(1, len(order_heads))
            )  # (batch_size validated above: None or >= 1)
        self.block_size = min(block_size, max_cache_len)
        self.num_blocks = math.ceil(max_cache_len / self.block_size)
        self.capacity = self.num_blocks * self.block_size
        if self.capacity > SLOT_MAX:
            raise ValueError(
                f"{name}: `max_cache_len` rounded up to whole blocks ({self.capacity}) must be at most {SLOT_MAX} (the "
                f"sorted runs keep int32 slots); got max_cache_len={max_cache_len}, block_size={self.block_size}"
            )
        self.num_heads = num_heads
        self.num_value_groups = num_value_groups
        self.order_heads = list(order_heads)
        self.decode_window = decode_window
        self.share_key = share_key
        self.decode_backend_used = None  # "triton" or "torch", decided when the buffers are allocated
        self.decode_backend_reason = None  # why "auto" did not take the fused kernel (None when it did)
        self._pending = None  # a single token recorded by `append` for the fused step of `attend`
        self.static_decode_backend = static_decode_backend

    @property
    def static_decode_backend(self) -> str:
        return self._static_decode_backend

    @static_decode_backend.setter
    def static_decode_backend(self, value: str) -> None:
        if value not in STATIC_DECODE_BACKENDS:
            raise ValueError(
                f"{type(self).__name__}: `static_decode_backend` must be one of {STATIC_DECODE_BACKENDS}; got {value!r}"
            )
        if getattr(self, "_pending", None) is not None:
            self._flush_pending()
        self._static_decode_backend = value
        if self.is_initialized:
            self._choose_decode_backend()

    @property
    def cumulative_length(self) -> torch.Tensor:
        """The tokens written (device-side; a slice of the cache's stacked lengths)."""
        length = self._length
        return torch.zeros((), dtype=torch.long) if length is None else length

    @property
    def stack_key(self):
        if self.share_key is None:
            return None
        sizes = (self.capacity, self.block_size, self.num_heads, self.num_value_groups, self.num_orders)
        return (type(self), sizes, self.share_key)

    def _choose_decode_backend(self) -> None:
        """Resolve ``static_decode_backend`` for the allocated buffers (device, dtype, shape) into
        ``decode_backend_used``; "triton" where the kernel cannot serve the layer is an error naming why."""
        reason = None
        if self.windowed:
            reason = static_decode_unavailable_reason(
                self.device,
                self.dtype,
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                window=self.decode_window,
                value_dim=self.values.shape[-1],
                head_dim=0 if self.vector_keys is None else self.vector_keys.shape[-1],
            )
        else:
            reason = "the layer is not windowed (decode_window is None or covers the capacity): exact attention"
        requested = self._static_decode_backend
        if requested == "triton" and reason is not None and self.windowed:
            raise ValueError(f"{type(self).__name__}: static_decode_backend='triton' cannot serve this layer: {reason}")
        if requested == "torch":
            used, reason = "torch", "requested"
        elif requested == "triton":
            used = "triton" if reason is None else "torch"
        else:
            if reason is None and self.device.type != "cuda":
                reason = "'auto' takes the fused kernel on CUDA only (the CPU runs it in the Triton interpreter)"
            used = "triton" if reason is None else "torch"
        self.decode_backend_used, self.decode_backend_reason = used, (None if used == "triton" else reason)
        key = (requested, used, self.device.type, reason)
        if key not in _LOGGED_BACKEND and not _compiling():
            _LOGGED_BACKEND.add(key)
            logger.info(
                "static sorted decode step: backend=%r on %s (static_decode_backend=%r)%s",
                used,
                self.device.type,
                requested,
                "" if used == "triton" else f": {reason}",
            )

    def _fused_step(self) -> bool:
        return self.decode_backend_used == "triton" and self.windowed

    @property
    def num_orders(self) -> int:
        return len(self.order_heads)

    @property
    def windowed(self) -> bool:
        """Whether single-token steps read a window (a window covering the capacity is exact attention)."""
        return self.decode_window is not None and self.decode_window < self.capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate from packed keys ``[B, H, N, 1 (+ D)]`` and values ``[B, G, N, Dv]``."""
        b, h, _, width = key_states.shape
        if h != self.num_heads or value_states.shape[1] != self.num_value_groups:
            raise ValueError(
                f"{type(self).__name__}: keys must have {self.num_heads} heads and values {self.num_value_groups} "
                f"groups; got {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        dev, dt, c = key_states.device, key_states.dtype, self.capacity
        self.dtype, self.device = dt, dev
        shape = (b, self.num_orders, self.num_blocks, self.block_size)
        # the run of the block being filled, twice (copy n % 2 is current): see the module docstring
        fill_shape = (b, self.num_orders, 2, self.block_size)
        self._claim_buffers({
            "keys": ((b, h, c), dt, dev, 0),
            "values": ((b, self.num_value_groups, c, value_states.shape[-1]), value_states.dtype, dev, 0),
            "vector_keys": ((b, h, c, width - 1), dt, dev, 0) if width > 1 else None,
            "valid": ((b, c), torch.bool, dev, False),
            "token_index": ((c,), torch.long, dev, -1),
            "sorted_keys": (shape, dt, dev, _INF),
            "sorted_slots": (shape, SLOT_DTYPE, dev, 0),
            "fill_keys": (fill_shape, dt, dev, _INF),
            "fill_slots": (fill_shape, SLOT_DTYPE, dev, 0),
            "decode_counter": ((1,), torch.int32, dev, 0),
            "order_head": ((self.num_orders,), torch.long, dev, 0),
            "cumulative_length": ((), torch.long, dev, 0),
        })  # fmt: skip
        self.order_head.copy_(torch.tensor(self.order_heads, dtype=torch.long, device=dev))
        self.is_initialized = True
        self._choose_decode_backend()

    # -- insert ----------------------------------------------------------------------------------------------------
    def _resort_blocks(self, blocks: torch.Tensor) -> None:
        """Sort the order keys of the given blocks (``[nb]`` int64) again and write them into the search structure."""
        t = self.block_size
        b = self.keys.shape[0]
        slots = (blocks.view(-1, 1) * t + torch.arange(t, device=self.device)).view(-1)  # [nb * T]
        keys = self.keys.index_select(2, slots)[:, self.order_head]  # [B, O, nb * T]
        ok = self.valid.index_select(1, slots).unsqueeze(1)
        keys = keys.masked_fill(~ok, _INF).view(b, self.num_orders, -1, t)
        sorted_keys, idx = torch.sort(keys, dim=-1, stable=True)
        self._put("sorted_keys", 2, blocks, sorted_keys)
        self._put("sorted_slots", 2, blocks, (idx + (blocks * t).view(1, 1, -1, 1)).to(SLOT_DTYPE))
        # eager only (multi-token steps): the block being filled, if partly filled, goes to fill copy n % 2
        n = int(self.cumulative_length)
        if n % t != 0:
            block = torch.tensor([n // t], device=self.device)
            parity = torch.tensor([n % 2], device=self.device)
            self._put("fill_keys", 2, parity, self.sorted_keys.index_select(2, block))
            self._put("fill_slots", 2, parity, self.sorted_slots.index_select(2, block))

    def _insert_one(self, position: torch.Tensor, scalar_keys: torch.Tensor, valid: torch.Tensor) -> None:
        """Insert one token (``position [1]``) into its block's sorted run: a binary search and a shift, ``O(T)``
        (no sort).  ``right=True`` puts it after equal keys, i.e. in slot order as the stable sort would; an invalid
        token is ``+inf`` and lands past the end (the run is unchanged)."""
        b = self.keys.shape[0]
        block = position // self.block_size
        # The block's current run is fill copy `position % 2` (the fused step leaves the block buffer of the block
        # being filled as it was until the block completes), or empty where the token starts a block.  It is searched
        # as the [B, O, 1, T] buffer index_select / masked_fill make, not a squeezed view of it: inductor's GPU
        # lowering of searchsorted (torch 2.11) needs a named buffer and fails on a view ("NotImplementedError: View").
        fresh = (position % self.block_size == 0).view(1, 1, 1, 1)
        keys = self.fill_keys.index_select(2, position % 2).masked_fill(fresh, _INF)  # [B, O, 1, T]
        slots = self.fill_slots.index_select(2, position % 2).masked_fill(fresh, 0)
        new_key = scalar_keys[:, self.order_head].masked_fill(~valid.view(b, 1, 1), _INF).unsqueeze(-1)  # [B, O, 1, 1]
        at = torch.searchsorted(keys, new_key, right=True)
        j = torch.arange(self.block_size, device=self.device)
        shifted_keys = torch.cat([keys[..., :1], keys[..., :-1]], dim=-1)  # entry j - 1 at j
        shifted_slots = torch.cat([slots[..., :1], slots[..., :-1]], dim=-1)
        keys = torch.where(j < at, keys, torch.where(j == at, new_key, shifted_keys))
        slot = position.view(1, 1, 1, 1).to(SLOT_DTYPE)
        slots = torch.where(j < at, slots, torch.where(j == at, slot, shifted_slots))
        self._put("sorted_keys", 2, block, keys)
        self._put("sorted_slots", 2, block, slots)
        # the run is also fill copy (n + 1) % 2, for the fused step that may follow (the two backends interleave)
        parity = (position + 1) % 2
        self._put("fill_keys", 2, parity, keys)
        self._put("fill_slots", 2, parity, slots)

    def append(self, scalar_keys, values, vector_keys=None, valid=None) -> None:
        """Write ``N`` new tokens (``scalar_keys [B, H, N]``, ``values [B, G, N, Dv]``, ``vector_keys [B, H, N, D]``,
        ``valid [B, N]``) at the next slots and re-sort the blocks they fall in."""
        b, _, n = scalar_keys.shape
        if not self.is_initialized:
            packed = scalar_keys.unsqueeze(-1)
            if vector_keys is not None:
                packed = torch.cat([packed, vector_keys], dim=-1)
            self.lazy_initialization(packed, values)
        self._flush_pending()
        if n == 1 and self._fused_step():
            # the fused launch of `attend` inserts it (with the search, in one launch)
            self._pending = (scalar_keys, values, vector_keys, valid)
            return
        if n > 1 and not _compiling():
            past = int(self.cumulative_length)
            if past + n > self.capacity:
                raise ValueError(
                    f"static sorted cache: {past} cached + {n} new tokens exceed its capacity {self.capacity}; build "
                    "the cache with a larger `max_cache_len`"
                )
        if valid is None:
            valid = torch.ones(b, n, dtype=torch.bool, device=self.device)
        positions = torch.arange(n, device=self.device) + self.cumulative_length
        self._put("keys", 2, positions, scalar_keys)
        self._put("values", 2, positions, values)
        if self.vector_keys is not None:
            self._put("vector_keys", 2, positions, vector_keys)
        self._put("valid", 1, positions, valid.to(torch.bool).expand(b, n))
        self._put("token_index", 0, positions, positions)
        self.cumulative_length.add_(n)
        if n == 1:
            self._insert_one(positions, scalar_keys, valid.to(torch.bool).expand(b, 1))
            return
        # eager (prompt, chunks): sort the blocks the step touched again, once each
        first, last = int(positions[0]) // self.block_size, int(positions[-1]) // self.block_size
        self._resort_blocks(torch.arange(first, last + 1, device=self.device))

    def _flush_pending(self) -> None:
        """Insert a token that ``append`` recorded for the fused step, through the torch path (the layer is used
        otherwise before ``attend``)."""
        if self._pending is None:
            return
        scalar_keys, values, vector_keys, valid = self._pending
        self._pending = None
        backend, self.decode_backend_used = self.decode_backend_used, "torch"
        try:
            self.append(scalar_keys, values, vector_keys, valid=valid)
        finally:
            self.decode_backend_used = backend

    # -- read ------------------------------------------------------------------------------------------------------
    def sequence_view(self, num_tokens: int):
        """``(scalar_keys [B, H, S], values [B, G, S, Dv], vector_keys [B, H, S, D] | None, valid [B, S])`` of the
        first ``num_tokens`` slots (sequence order), for exact multi-token steps."""
        self._flush_pending()
        vk = self.vector_keys[:, :, :num_tokens] if self.vector_keys is not None else None
        return self.keys[:, :, :num_tokens], self.values[:, :, :num_tokens], vk, self.valid[:, :num_tokens]

    def full_view(self):
        """Every slot: ``(scalar_keys, values, vector_keys, valid)`` over the whole capacity (a single-token step)."""
        self._flush_pending()
        return self.keys, self.values, self.vector_keys, self.valid

    def attend(self, qs, tau, *, q=None, scale=None, prefix_ks=None, prefix_v=None, prefix_k=None) -> torch.Tensor:
        """The windowed single-token step (``qs [B, H, 1]``).  After ``append`` recorded the token for the fused step:
        one launch (:func:`~hf_rbf.kernels_sorted_static_decode.static_sorted_decode_step`) inserts it and attends.
        Otherwise (torch): :func:`blocked_window_candidates`, then the window attention of
        :func:`hf_rbf.sorted_decode.sorted_window_attention` over the by-slot buffers."""
        if self._pending is not None:
            scalar_keys, values, vector_keys, valid = self._pending
            self._pending = None
            return static_sorted_decode_step(
                self, scalar_keys, values, vector_keys, valid, qs, tau,
                q=q, scale=scale, prefix_ks=prefix_ks, prefix_v=prefix_v, prefix_k=prefix_k,
            )  # fmt: skip
        candidates = blocked_window_candidates(self.sorted_keys, self.sorted_slots, qs, self.decode_window)
        b = self.keys.shape[0]
        state = SortedCacheState(
            scalar_keys=self.keys,
            values=self.values,
            vector_keys=self.vector_keys,
            log_weight=None,
            valid=self.valid,
            token_index=self.token_index.expand(b, -1),
            sorted_keys=self.sorted_keys.flatten(2),
            sorted_slots=self.sorted_slots.flatten(2),
            sorted_count=None,
            order_head=self.order_head,
            num_slots=self.capacity,
        )
        return sorted_window_attention(
            state,
            qs,
            tau,
            window=self.decode_window,
            query_token_index=self.cumulative_length.view(1) - 1,
            q=q,
            scale=scale,
            prefix_ks=prefix_ks,
            prefix_v=prefix_v,
            prefix_k=prefix_k,
            candidates=candidates,
        )

    # -- transformers' CacheLayerMixin API ---------------------------------------------------------------------------
    def update(self, key_states, value_states, cache_kwargs: dict | None = None, *args, **kwargs):
        """Append packed keys ``[B, H, N, 1 (+ D)]`` (scalar key first) and values ``[B, G, N, Dv]``; returns the
        packed keys and values of every slot (see :meth:`full_view` for validity)."""
        vk = key_states[..., 1:] if key_states.shape[-1] > 1 else None
        self.append(key_states[..., 0], value_states, vk, valid=(cache_kwargs or {}).get("valid"))
        self._flush_pending()  # the caller reads every slot
        packed = self.keys.unsqueeze(-1)
        if self.vector_keys is not None:
            packed = torch.cat([packed, self.vector_keys], dim=-1)
        return packed, self.values

    def get_seq_length(self):
        if not self.is_initialized:
            return 0
        self._flush_pending()
        return self.cumulative_length if _compiling() else int(self.cumulative_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def _row_tensors(self) -> list[str]:
        return ["keys", "values", "vector_keys", "valid", "sorted_keys", "sorted_slots", "fill_keys", "fill_slots"]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._flush_pending()
        if self.is_initialized:
            for name in self._row_tensors():
                t = getattr(self, name)
                if t is not None:
                    t.copy_(t.index_select(0, beam_idx.to(self.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._flush_pending()
        if self.is_initialized:
            self._own_buffers(lambda t: t.repeat_interleave(repeats, dim=0), self._row_tensors())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._flush_pending()
        if self.is_initialized:
            self._own_buffers(lambda t: t[indices], self._row_tensors())

    def reset(self) -> None:
        self._pending = None
        if self.is_initialized:
            for name in ("keys", "values", "valid"):
                getattr(self, name).zero_()
            if self.vector_keys is not None:
                self.vector_keys.zero_()
            self.token_index.fill_(-1)
            self.sorted_keys.fill_(_INF)
            self.sorted_slots.zero_()
            self.fill_keys.fill_(_INF)
            self.fill_slots.zero_()
            self.decode_counter.zero_()
            self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "StaticSortedLayer cannot be cropped (assisted / prompt-lookup decoding): use the dynamic SortedScalarCache"
        )

    def __repr__(self) -> str:
        return (
            f"StaticSortedLayer(capacity={self.capacity}, block_size={self.block_size}, heads={self.num_heads}, "
            f"groups={self.num_value_groups}, window={self.decode_window}, decode_backend={self.decode_backend_used})"
        )


__all__ = ["STATIC_DECODE_BACKENDS", "StaticSortedLayer", "blocked_window_candidates", "default_block_size"]
