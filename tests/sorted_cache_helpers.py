"""Shared pieces of the scalar-sort / hybrid-sort / sorted-cache tests: configurations, prompts, invariant checks."""

from __future__ import annotations

import torch

# float32 logits through two summation orders (sorted cache vs recomputation): ~1e-5 relative to logits of O(1)
TOL = 3e-5
PAD = 0

# (id, family, overrides): both families, every tau mode, sink on / off, registers 0 / 1 / 2, G < H and G = H, per-head
# kinds, mixed layer kinds with sliding ("S") layers.
SORT_CASES = [
    ("scalar-perhead", "scalar_sort", dict()),
    (
        "scalar-pertoken-r2-g2",
        "scalar_sort",
        dict(tau_mode="per_token", num_register_tokens=2, num_value_groups=2, tau_max=0.5),
    ),
    (
        "scalar-global-nosink-dot-window",
        "scalar_sort",
        dict(
            tau_mode="global",
            scalar_sink=False,
            num_hidden_layers=3,
            attention_layers=["scalar", "dot", "scalar"],
            window_pattern="LLS",
            sliding_window=3,
        ),
    ),
    (
        "hybrid-kinds-r1-g2",
        "hybrid_sort",
        dict(head_kinds=["hybrid", "scalar", "dot", "hybrid"], num_register_tokens=1, num_value_groups=2),
    ),
    (
        "hybrid-mixed-layers-window",
        "hybrid_sort",
        dict(
            num_hidden_layers=3,
            attention_layers=["hybrid", "scalar", "dot"],
            window_pattern="SLL",
            sliding_window=3,
            position_embedding_type="none",
            tau_mode="per_token",
        ),
    ),
]
CORE_SORT_CASES = [c for c in SORT_CASES if c[0] in ("scalar-pertoken-r2-g2", "hybrid-kinds-r1-g2")]


def left_padded(vocab: int, lengths, seed: int = 0):
    """Left-padded prompts ``[B, max(lengths)]`` and their mask."""
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.full((len(lengths), n), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, n - length :] = torch.randint(1, vocab, (length,), generator=gen)
        mask[b, n - length :] = 1
    return ids, mask


def check_layer_invariants(layer) -> None:
    """Structural invariants of a SortedScalarCacheLayer after any operation.

    * every order's sorted array is ascending, its first ``sorted_count`` entries are finite and the rest ``+inf``;
    * the sorted entries are exactly the valid slots below ``num_sorted``, each once, with the right order keys;
    * the recent buffer is ``[num_sorted, num_slots)``; no slot beyond ``num_slots`` is valid;
    * the bound holds: each row holds at most ``max_cache_tokens`` tokens (unless eviction is deferred).
    """
    if not layer.is_initialized:
        return
    s, m = layer.num_slots, layer.num_sorted
    assert 0 <= m <= s <= layer.capacity
    assert layer.sorted_keys.shape[-1] == m and layer.sorted_slots.shape[-1] == m
    assert not layer.valid[:, s:].any()
    keys = layer.sorted_keys
    if m > 1:
        assert (keys[..., 1:] >= keys[..., :-1]).all(), "sorted arrays must stay in ascending order"
    b, o = keys.shape[:2]
    order_head = layer._order_head
    for bi in range(b):
        expected = [j for j in range(m) if bool(layer.valid[bi, j])]
        for oi in range(o):
            cnt = int(layer.sorted_count[bi, oi])
            assert cnt == len(expected), (cnt, len(expected))
            assert torch.isfinite(keys[bi, oi, :cnt]).all() and torch.isinf(keys[bi, oi, cnt:]).all()
            slots = layer.sorted_slots[bi, oi, :cnt].tolist()
            assert sorted(slots) == expected
            own = layer.keys[bi, int(order_head[oi]), slots]
            assert torch.equal(own, keys[bi, oi, :cnt])
    if layer.max_cache_tokens is not None and not layer.record_past:
        assert int(layer.valid_counts().max()) <= layer.max_cache_tokens
        assert s <= max(layer.max_cache_tokens, 0) or s == 0
