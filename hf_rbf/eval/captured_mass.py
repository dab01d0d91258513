"""Captured attention mass of the sorted cache's window: the share of a query's exact attention mass that falls on
the keys its ``decode_window`` would read (plus the always-present prefix: sink, registers).

The window is the one :func:`hf_rbf.sorted_window_attention` uses: among the keys the query sees (positions
``0 .. t``), ordered by the order keys (own scalar keys under "per_head", the group's sort head's under
"sort_head"), the ``k`` consecutive keys starting at ``max(0, min(r - k // 2, n - k))``, ``r`` = the number of order
keys below the query.  A mass of 1 means the windowed decode step is exact for that query.
"""

from __future__ import annotations

import torch


def order_keys_for(scalar_keys: torch.Tensor, scheme: str, num_value_groups: int, sort_head: int = 0) -> torch.Tensor:
    """The keys each head searches: ``scalar_keys [H, N]`` itself ("per_head") or, for every head, the keys of its
    value group's sort head ("sort_head")."""
    h = scalar_keys.shape[0]
    if scheme == "per_head":
        return scalar_keys
    if scheme != "sort_head":
        raise ValueError(f"order_keys_for: `scheme` must be 'per_head' or 'sort_head'; got {scheme!r}")
    per_group = h // num_value_groups
    sort_heads = (torch.arange(h) // per_group) * per_group + sort_head
    return scalar_keys[sort_heads.to(scalar_keys.device)]


def window_masks(
    order_keys: torch.Tensor, scalar_queries: torch.Tensor, query_rows: torch.Tensor, windows: list[int]
) -> dict[int, torch.Tensor]:
    """``{k: bool [H, Q, N]}``: which text keys each query's window of ``k`` holds.

    Args:
        order_keys: ``[H, N]`` the keys each head searches.
        scalar_queries: ``[H, Q]`` the queries.
        query_rows: ``[Q]`` positions (query ``q`` sees keys ``0 .. query_rows[q]``).
        windows: the window sizes ``k``.
    """
    h, n = order_keys.shape
    masks = {k: torch.zeros(h, len(query_rows), n, dtype=torch.bool, device=order_keys.device) for k in windows}
    for qi, t in enumerate(query_rows.tolist()):
        visible = order_keys[:, : t + 1]
        perm = torch.sort(visible, dim=-1, stable=True).indices
        rank = torch.empty_like(perm).scatter_(-1, perm, torch.arange(t + 1, device=perm.device).expand(h, -1))
        below = (visible < scalar_queries[:, qi : qi + 1]).sum(-1, keepdim=True)  # [H, 1]
        for k in windows:
            start = torch.minimum((below - k // 2).clamp_min(0), torch.full_like(below, max(t + 1 - k, 0)))
            masks[k][:, qi, : t + 1] = (rank >= start) & (rank < start + k)
    return masks


def captured_mass(
    weights: torch.Tensor,
    num_prefix: int,
    order_keys: torch.Tensor,
    scalar_queries: torch.Tensor,
    query_rows: torch.Tensor,
    windows: list[int],
) -> dict[int, torch.Tensor]:
    """``{k: [H, Q]}`` the exact attention mass inside each query's window (prefix included).

    ``weights [H, Q, P + N]`` are the exact weights of the queries over the prefix and the ``N`` text keys (rows sum
    to 1); the other arguments as :func:`window_masks`."""
    prefix_mass = weights[..., :num_prefix].sum(-1)
    text = weights[..., num_prefix:]
    return {
        k: prefix_mass + (text * mask).sum(-1)
        for k, mask in window_masks(order_keys, scalar_queries, query_rows, windows).items()
    }


__all__ = ["captured_mass", "order_keys_for", "window_masks"]
