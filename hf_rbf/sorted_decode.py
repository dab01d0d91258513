"""One decode step of the sorted scalar cache: binary search, window gather, softmax and value sum.

:func:`sorted_window_attention` is what a scalar / hybrid layer runs for every query after the prompt when
``decode_window = k`` is set; :func:`sorted_window_attention_reference` is its plain definition (sort every visible
key from scratch, per query, in Python loops) that the tests compare it against.

The window (the semantics both functions implement)
---------------------------------------------------
For query ``i`` of head ``h`` (scalar ``qs``, token index ``t_i``): take every cached key it may see (valid, token
index ``<= t_i``), order them by the *order keys* of ``h`` (its own scalar keys under the "per_head" scheme; the
scalar keys of its group's designated sort head under "sort_head"), ties broken by slot.  With ``r`` = the number of
them whose order key is ``< qs`` (the binary-search insertion point) and ``n`` = how many there are, the window is
the ``k`` consecutive keys starting at ``max(0, min(r - k // 2, n - k))``: ``k // 2`` below the insertion point and
the rest above, shifted inward at the ends, all ``n`` when ``n <= k``.  The query then attends, with its *own*
scalar key distance (and, for the hybrid, the dot product), to the window plus the prefix (the scalar sink and the
registers, always present):
``softmax(-(qs - ks_j)^2 / tau + scale * q.k_j + log w_j)`` over prefix and window, values of the head's group.

The state (what one fused kernel reads: see :class:`SortedCacheState`)
----------------------------------------------------------------------
Per batch row, keys, values and bookkeeping live *by slot* (insertion order) in contiguous capacity buffers; the
search structure is, per row and order ``o``, a sorted array of order keys with the slot of each entry
(``sorted_keys`` / ``sorted_slots``, ``+inf`` padding after ``sorted_count`` valid entries).  Slots
``[num_sorted, num_slots)`` are the *recent buffer*: appended but not yet merged into the sorted arrays (the cache
merges them before an insert that would make the buffer exceed its size, so sorted entries are always older than the
step's queries and only buffered keys need a causal check).  A decode step therefore reads: ``2k`` entries around the
insertion point of the sorted array (binary search, ``O(log M)``), the ``R`` recent-buffer keys (a scan), picks the window
among these ``<= 2k + R`` candidates (they provably contain it: the ``k`` nearest below and above in the sorted part,
and every recent key), then gathers ``k`` own keys, ``k`` value rows (and ``k`` vector keys) by slot.  Cost per
(row, head, query): ``O(log M + k + R)`` key reads and ``k * Dv`` value reads, independent of the cache length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_utils import compute_dtype, per_query_param


@dataclass
class SortedCacheState:
    """One layer's sorted scalar cache, as read by a decode step (all tensors on one device).

    Shapes: ``B`` rows, ``H`` heads, ``G`` value groups (H divisible by G), ``C`` slot capacity (``>= num_slots``),
    ``O`` orders (H under "per_head", G under "sort_head"), ``M`` sorted entries.

    Attributes:
        scalar_keys: ``[B, H, C]`` every head's scalar key, by slot.
        values: ``[B, G, C, Dv]`` the group values, by slot.
        vector_keys: ``[B, H, C, D]`` vector keys by slot (hybrid layers) or None.
        log_weight: ``[B, H, C]`` log-weight added to each key's score (stored key weights, merged multiplicities) or
            None.
        valid: ``[B, C]`` bool: the slot holds a real token (not padding, not evicted, not cropped).
        token_index: ``[B, C]`` int64: the token's index in the sequence (for causality inside a multi-token step).
        sorted_keys: ``[B, O, M]`` order keys in ascending order, ``+inf`` after ``sorted_count`` valid entries.
        sorted_slots: ``[B, O, M]`` int64 slot of each sorted entry.
        sorted_count: ``[B, O]`` int64 number of valid sorted entries.
        order_head: ``[O]`` int64: the head whose scalar keys define order ``o``.
        num_slots: ``S``: slots ``[0, S)`` are in use; ``[M, S)`` is the unsorted recent buffer (``M = num_sorted``).
    """

    scalar_keys: torch.Tensor
    values: torch.Tensor
    vector_keys: torch.Tensor | None
    log_weight: torch.Tensor | None
    valid: torch.Tensor
    token_index: torch.Tensor
    sorted_keys: torch.Tensor
    sorted_slots: torch.Tensor
    sorted_count: torch.Tensor
    order_head: torch.Tensor
    num_slots: int

    @property
    def num_sorted(self) -> int:
        return self.sorted_keys.shape[-1]


def order_of_heads(num_heads: int, num_orders: int, device=None) -> torch.Tensor:
    """``[H]`` int64: the order each head searches (order ``o`` serves heads ``o * H/O .. (o+1) * H/O - 1``)."""
    return torch.arange(num_heads, device=device) // (num_heads // num_orders)


def window_candidates(
    state: SortedCacheState, qs: torch.Tensor, window: int, query_token_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of each query's window.

    Args:
        state: the layer's cache state.
        qs: scalar queries ``[B, H, Nq]``.
        window: ``k >= 1``.
        query_token_index: ``[Nq]`` int64 token index of each query (causality for the recent buffer).

    Returns:
        ``(slots [B, H, Nq, k] int64, ok [B, H, Nq, k] bool)``: the window's slots in ascending order-key order;
        ``ok`` is False for the unused tail when fewer than ``k`` keys are visible.
    """
    b, h, nq = qs.shape
    device = qs.device
    k = window
    num_orders, m = state.sorted_keys.shape[1], state.sorted_keys.shape[2]
    s = state.num_slots
    order = order_of_heads(h, num_orders, device)  # [H]
    inf = float("inf")
    search = qs.to(state.sorted_keys.dtype).contiguous()
    cand_keys, cand_slots, cand_ok = [], [], []

    if m > 0:
        # 1. binary search: heads of one order are contiguous, so the queries reshape to [B, O, (H/O) * Nq]
        p = torch.searchsorted(state.sorted_keys, search.reshape(b, num_orders, -1)).view(b, h, nq)
        # 2. the 2k sorted entries around the insertion point hold the k nearest below and above it
        j = p.unsqueeze(-1) + torch.arange(-k, k, device=device)  # [B, H, Nq, 2k]
        count = state.sorted_count[:, order].view(b, h, 1, 1)
        ok = (j >= 0) & (j < count)
        base = ((torch.arange(b, device=device).view(b, 1) * num_orders + order.view(1, h)) * m).view(b, h, 1, 1)
        flat = base + j.clamp(0, m - 1)
        cand_keys.append(state.sorted_keys.reshape(-1)[flat].masked_fill(~ok, inf))
        cand_slots.append(state.sorted_slots.reshape(-1)[flat])
        cand_ok.append(ok)
    if s > m:
        # 3. every key of the recent buffer is a candidate (a scan of at most R keys)
        r = s - m
        buf_keys = state.scalar_keys[:, state.order_head, m:s][:, order]  # [B, H, R]
        visible = state.valid[:, m:s].unsqueeze(1) & (
            state.token_index[:, m:s].unsqueeze(1) <= query_token_index.view(1, nq, 1)
        )  # [B, Nq, R]
        ok = visible.unsqueeze(1).expand(b, h, nq, r)
        cand_keys.append(buf_keys.unsqueeze(2).to(state.sorted_keys.dtype).expand(b, h, nq, r).masked_fill(~ok, inf))
        cand_slots.append(torch.arange(m, s, device=device).expand(b, h, nq, r))
        cand_ok.append(ok)
    if not cand_keys:
        empty = torch.zeros(b, h, nq, k, dtype=torch.long, device=device)
        return empty, empty.bool()

    keys = torch.cat(cand_keys, dim=-1)
    slots = torch.cat(cand_slots, dim=-1)
    ok = torch.cat(cand_ok, dim=-1)
    # 4. rank of the query among the candidates, and the window start (shifted inward at the ends)
    n_visible = ok.sum(-1)
    rank = ((keys < search.unsqueeze(-1)) & ok).sum(-1)
    start = torch.minimum((rank - k // 2).clamp_min(0), (n_visible - k).clamp_min(0))
    # Stable sort: the sorted part comes first and is already in (key, slot) order, the buffer is in slot order.
    order_in_cands = torch.sort(keys, dim=-1, stable=True).indices
    pos = start.unsqueeze(-1) + torch.arange(k, device=device)
    win_ok = pos < n_visible.unsqueeze(-1)
    pos = pos.clamp(max=keys.shape[-1] - 1)
    win_slots = slots.gather(-1, order_in_cands.gather(-1, pos))
    return win_slots, win_ok


def _scale_per_head(scale, heads: int, ct, device):
    if scale is None or isinstance(scale, (int, float)):
        return None if not scale else float(scale)
    return scale.to(device=device, dtype=ct).view(1, heads, 1, 1)


def _softmax_combine(scores_list, allowed_list, values_list, out_shape, ct):
    """``softmax`` over the concatenated score blocks (each ``[B, H, Nq, n_i]``) and the weighted sum of their values
    (``[B, H, Nq, n_i, Dv]`` or ``[B|1, H, 1, n_i, Dv]``); rows with no allowed entry give zeros."""
    neg = torch.finfo(ct).min
    scores = [s.masked_fill(~a, neg) for s, a in zip(scores_list, allowed_list)]
    row_max = torch.stack([s.amax(-1) for s in scores], -1).amax(-1, keepdim=True)
    out = torch.zeros(out_shape, dtype=ct, device=scores[0].device)
    denom = torch.zeros(out_shape[:-1] + (1,), dtype=ct, device=scores[0].device)
    for s, a, v in zip(scores, allowed_list, values_list):
        p = torch.exp(s - row_max).masked_fill(~a, 0.0)
        denom = denom + p.sum(-1, keepdim=True)
        out = out + (p.unsqueeze(-1) * v).sum(-2)
    return out / torch.where(denom > 0, denom, torch.ones_like(denom))


def sorted_window_attention(
    state: SortedCacheState,
    qs: torch.Tensor,
    tau,
    *,
    window: int,
    query_token_index: torch.Tensor,
    q: torch.Tensor | None = None,
    scale=None,
    prefix_ks: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    prefix_k: torch.Tensor | None = None,
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Windowed attention of new queries over a sorted scalar cache (the module docstring gives the semantics).

    Args:
        state: the layer's :class:`SortedCacheState` (the new tokens already appended).
        qs: scalar queries ``[B, H, Nq]``.
        tau: temperature: a positive float, ``[H]`` or broadcastable to ``[B, H, Nq]``.
        window: ``k >= 1`` keys per query (prefix not counted).
        query_token_index: ``[Nq]`` int64 token index of each query.
        q: vector queries ``[B, H, Nq, D]`` (hybrid layers; ``state.vector_keys`` must be set) or None.
        scale: the dot-product scale (float or ``[H]``; 0 / None means no dot term).
        prefix_ks: ``[B|1, H, P]`` prefix scalar keys (sink, registers), always attended; prefix_v ``[B|1, G, P, Dv]``;
            prefix_k ``[B|1, H, P, D]`` (hybrid).
        candidates: ``(slots [B, H, Nq, k], ok [B, H, Nq, k])``, the window already found by another search structure
            (the fixed-capacity cache's sorted blocks, :mod:`hf_rbf.cache_sorted_static`); then only the by-slot
            tensors of ``state`` are read.

    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``state.values``.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sorted_window_attention: `window` must be an int >= 1; got {window!r}")
    b, h, nq = qs.shape
    values = state.values
    g, cap, dv = values.shape[1], values.shape[2], values.shape[3]
    device = qs.device
    ct = compute_dtype(values.dtype)
    tau = per_query_param("sorted_window_attention", "tau", tau, b, h, nq, device)
    inv_tau = 1.0 / tau if isinstance(tau, float) else (1.0 / tau.to(ct)).unsqueeze(-1)
    scale = _scale_per_head(scale, h, ct, device)
    group = torch.arange(h, device=device) // (h // g)

    if candidates is None:
        candidates = window_candidates(state, qs, window, query_token_index)
    slots, ok = candidates
    k = slots.shape[-1]
    row = torch.arange(b, device=device).view(b, 1, 1, 1)
    head_flat = (row * h + torch.arange(h, device=device).view(1, h, 1, 1)) * cap + slots  # [B, H, Nq, k]
    qsf = qs.to(ct).unsqueeze(-1)
    ks_w = state.scalar_keys.reshape(-1)[head_flat].to(ct)
    scores = -((qsf - ks_w) ** 2) * inv_tau
    if state.log_weight is not None:
        scores = scores + state.log_weight.reshape(-1)[head_flat].to(ct)
    if q is not None and scale is not None:
        d = q.shape[-1]
        k_w = state.vector_keys.reshape(-1, d)[head_flat.reshape(-1)].view(b, h, nq, k, d).to(ct)
        scores = scores + scale * torch.einsum("bhqd,bhqkd->bhqk", q.to(ct), k_w)
    value_flat = (row * g + group.view(1, h, 1, 1)) * cap + slots
    v_w = values.reshape(-1, dv)[value_flat.reshape(-1)].view(b, h, nq, k, dv).to(ct)

    scores_list, allowed_list, values_list = [scores], [ok], [v_w]
    if prefix_ks is not None and prefix_ks.shape[-1] > 0:
        p = prefix_ks.shape[-1]
        p_scores = -((qsf - prefix_ks.to(ct).unsqueeze(2)) ** 2) * inv_tau  # [B|1 -> B, H, Nq, P]
        if q is not None and scale is not None and prefix_k is not None:
            p_scores = p_scores + scale * torch.einsum(
                "bhqd,bhpd->bhqp", q.to(ct), prefix_k.to(ct).expand(b, -1, -1, -1)
            )
        p_scores = p_scores.expand(b, h, nq, p)
        p_values = prefix_v.to(ct)[:, group].unsqueeze(2)  # [B|1, H, 1, P, Dv]
        scores_list.insert(0, p_scores)
        allowed_list.insert(0, torch.ones_like(p_scores, dtype=torch.bool))
        values_list.insert(0, p_values)
    out = _softmax_combine(scores_list, allowed_list, values_list, (b, h, nq, dv), ct)
    return out.to(values.dtype)


def sorted_window_attention_reference(
    scalar_keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    token_index: torch.Tensor,
    qs: torch.Tensor,
    tau,
    *,
    window: int | None,
    query_token_index: torch.Tensor,
    order_head: torch.Tensor,
    log_weight: torch.Tensor | None = None,
    q: torch.Tensor | None = None,
    vector_keys: torch.Tensor | None = None,
    scale=None,
    prefix_ks: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    prefix_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """The definition, by brute force in float64 (Python loops: for tests at small sizes).

    ``scalar_keys [B, H, S]``, ``values [B, G, S, Dv]``, ``valid [B, S]``, ``token_index [B, S]`` describe the cached
    tokens in any slot order; ``order_head [O]`` gives the head whose keys order each of the ``O`` orders (head ``h``
    uses order ``h // (H / O)``).  ``window=None`` attends to every visible key.  Other arguments as
    :func:`sorted_window_attention`.
    """
    b, h, nq = qs.shape
    g, s, dv = values.shape[1], values.shape[2], values.shape[3]
    f64 = torch.float64
    tau = per_query_param("reference", "tau", tau, b, h, nq, qs.device)
    tau_full = torch.full((b, h, nq), tau, dtype=f64) if isinstance(tau, float) else tau.to(f64).expand(b, h, nq)
    num_orders = order_head.shape[0]
    scale_full = None
    if q is not None and scale is not None:
        scale_full = (
            torch.as_tensor(scale, dtype=f64).expand(h) if not isinstance(scale, torch.Tensor) else scale.to(f64)
        )
    out = torch.zeros(b, h, nq, dv, dtype=f64)
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // g)
            oh = int(order_head[hi // (h // num_orders)])
            for qi in range(nq):
                t = int(query_token_index[qi])
                visible = [j for j in range(s) if bool(valid[bi, j]) and int(token_index[bi, j]) <= t]
                visible.sort(key=lambda j: (float(scalar_keys[bi, oh, j]), j))
                qv = float(qs[bi, hi, qi])
                if window is not None and len(visible) > window:
                    r = sum(1 for j in visible if float(scalar_keys[bi, oh, j]) < qv)
                    start = max(0, min(r - window // 2, len(visible) - window))
                    visible = visible[start : start + window]
                entries = []  # (score, value)
                if prefix_ks is not None:
                    pb = bi if prefix_ks.shape[0] > 1 else 0
                    for pi in range(prefix_ks.shape[-1]):
                        sc = -((qv - float(prefix_ks[pb, hi, pi])) ** 2) / float(tau_full[bi, hi, qi])
                        if scale_full is not None and prefix_k is not None:
                            sc += float(scale_full[hi]) * float(q[bi, hi, qi].to(f64) @ prefix_k[pb, hi, pi].to(f64))
                        entries.append((sc, prefix_v[pb, gi, pi].to(f64)))
                for j in visible:
                    sc = -((qv - float(scalar_keys[bi, hi, j])) ** 2) / float(tau_full[bi, hi, qi])
                    if log_weight is not None:
                        sc += float(log_weight[bi, hi, j])
                    if scale_full is not None:
                        sc += float(scale_full[hi]) * float(q[bi, hi, qi].to(f64) @ vector_keys[bi, hi, j].to(f64))
                    entries.append((sc, values[bi, gi, j].to(f64)))
                if not entries:
                    continue
                sc = torch.tensor([e[0] for e in entries], dtype=f64)
                w = torch.softmax(sc, dim=0)
                out[bi, hi, qi] = (w.unsqueeze(-1) * torch.stack([e[1] for e in entries])).sum(0)
    return out


__all__ = [
    "SortedCacheState",
    "order_of_heads",
    "sorted_window_attention",
    "sorted_window_attention_reference",
    "window_candidates",
]
