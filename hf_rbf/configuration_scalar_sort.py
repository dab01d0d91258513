"""Configuration of the scalar sort attention decoder (``model_type="scalar_sort"``).

Also holds the validation of the sorted-cache settings (:func:`check_sorted_cache_settings`), shared by the config and
by :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCache`, so both reject the same bad values with the same messages.
"""

from __future__ import annotations

import math

from .configuration_decoder import DecoderConfig, check_bool, check_choice, check_float, check_int

TAU_MODES = ("global", "per_head", "per_token")
SORT_SCHEMES = ("per_head", "sort_head")
EVICTION_POLICIES = ("oldest", "geometric", "density")
DECODE_BACKENDS = ("torch", "triton", "auto")
DENSITY_MERGE_WEIGHTINGS = ("multiplicity", "attention")
ALIGN_GRADIENTS = ("upstream", "scalar_projections")
REGULARIZERS = ("align", "spread", "tau")


def default_value_groups(heads: int) -> int:
    """The largest divisor of ``heads`` that is at most ``heads // 4`` (at least 1): G < H whenever H > 1."""
    best = 1
    for g in range(1, max(1, heads // 4) + 1):
        if heads % g == 0:
            best = g
    return best


def _check_pair(name: str, field: str, value, *, positive: bool, ordered: str) -> list[float]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if ok:
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
    if ok and positive:
        ok = value[0] > 0
    if ok:
        ok = value[0] <= value[1] if ordered == "<=" else value[0] < value[1]
    if not ok:
        what = "positive " if positive else ""
        raise ValueError(
            f"{name}: `{field}` must be a pair [low, high] of {what}finite floats with low {ordered} high; "
            f"got {value!r}"
        )
    return [float(value[0]), float(value[1])]


def check_sorted_cache_settings(
    name: str,
    *,
    num_heads: int,
    num_value_groups: int,
    decode_window,
    sort_scheme,
    sort_head,
    cache_buffer_size,
    max_cache_tokens,
    cache_eviction,
    eviction_radius,
    eviction_recent_queries,
    eviction_batch,
    sink_zone,
    decode_backend="auto",
    density_merge_weighting="multiplicity",
    density_merge_size=2,
    max_cache_bytes=None,
) -> list[float] | None:
    """Validate the sorted-cache settings; every error names the argument and the allowed values.

    Returns ``sink_zone`` as a list of two floats (or None)."""
    if decode_window is not None:
        check_int(name, "decode_window", decode_window, minimum=1)
    check_choice(name, "sort_scheme", sort_scheme, SORT_SCHEMES)
    heads_per_group = num_heads // num_value_groups
    if not isinstance(sort_head, int) or isinstance(sort_head, bool) or not 0 <= sort_head < heads_per_group:
        raise ValueError(
            f"{name}: `sort_head` must be an int in [0, {heads_per_group}) (the index of the designated sort head "
            f"inside each value group of {heads_per_group} heads); got {sort_head!r}"
        )
    check_int(name, "cache_buffer_size", cache_buffer_size, minimum=1)
    if max_cache_tokens is not None:
        check_int(name, "max_cache_tokens", max_cache_tokens, minimum=1)
    if max_cache_bytes is not None:
        check_int(name, "max_cache_bytes", max_cache_bytes, minimum=1)
        if max_cache_tokens is not None:
            raise ValueError(
                f"{name}: set at most one of `max_cache_tokens` ({max_cache_tokens}) and `max_cache_bytes` "
                f"({max_cache_bytes}): the eviction budget is given in tokens or in bytes, not both"
            )
    check_choice(name, "cache_eviction", cache_eviction, EVICTION_POLICIES)
    check_float(name, "eviction_radius", eviction_radius, minimum=0.0)
    check_int(name, "eviction_recent_queries", eviction_recent_queries, minimum=1)
    if eviction_batch is not None:
        check_int(name, "eviction_batch", eviction_batch, minimum=1)
        if max_cache_tokens is not None and eviction_batch > max_cache_tokens:
            raise ValueError(
                f"{name}: `eviction_batch` ({eviction_batch}) must be at most `max_cache_tokens` ({max_cache_tokens})"
            )
    if sink_zone is not None:
        sink_zone = _check_pair(name, "sink_zone", sink_zone, positive=False, ordered="<=")
    check_choice(name, "decode_backend", decode_backend, DECODE_BACKENDS)
    check_choice(name, "density_merge_weighting", density_merge_weighting, DENSITY_MERGE_WEIGHTINGS)
    check_int(name, "density_merge_size", density_merge_size, minimum=2)
    return sink_zone


CACHE_BUDGETS = ("max_cache_tokens", "max_cache_bytes")


def override_cache_settings(settings: dict, overrides: dict) -> dict:
    """``settings`` (e.g. a config's :meth:`ScalarSortConfig.sorted_cache_settings`) updated by ``overrides``.  The
    eviction budget is one setting given in one of two units: an override of ``max_cache_tokens`` or
    ``max_cache_bytes`` replaces the budget of ``settings`` in the other unit too (``SortedScalarCache(max_cache_tokens=
    4096)`` on a model saved with ``max_cache_bytes``; ``max_cache_tokens=None`` turns eviction off), unless both are
    overridden (then both are checked as given)."""
    merged = dict(settings)
    merged.update(overrides)
    for given, other in (CACHE_BUDGETS, CACHE_BUDGETS[::-1]):
        if given in overrides and other not in overrides:
            merged[other] = None
    return merged


def regularizer_schedule_factor(step: int, start: int, warmup: int) -> float:
    """The factor on a regularizer's weight at optimizer step ``step``: 0 before ``start``; ``(step - start) /
    warmup`` during the warmup (0 at ``start``, as transformers' linear warmup of the learning rate); 1 from ``start +
    warmup`` on (from ``start`` on when ``warmup`` is 0)."""
    if step < start:
        return 0.0
    if warmup == 0:
        return 1.0
    return min(1.0, (step - start) / warmup)


class ScalarSortConfig(DecoderConfig):
    r"""Configuration of :class:`~hf_rbf.ScalarSortModel` / :class:`~hf_rbf.ScalarSortForCausalLM`: a pre-norm decoder
    whose attention is scalar sort attention (the scalar sort attention gist): per head ``h`` a scalar query
    ``qs = x W_qs^h`` and a scalar key ``ks = x W_ks^h``, weights ``softmax_j(-(qs_i - ks_j)^2 / tau)``, ``G`` value
    groups (head ``h`` reads group ``h // (H / G)``) and W_O.  Scalar heads use no position embedding (the Gaussian
    kernel only sees the learned scalar coordinate; causal masking still orders the tokens).

    Takes every field of :class:`~hf_rbf.configuration_decoder.DecoderConfig` plus:

    Args:
        num_value_groups (`int`, *optional*): value projections ``G`` per layer; must divide ``num_attention_heads``.
            Default: the largest divisor of ``H`` that is at most ``H // 4`` (so ``G < H`` whenever ``H > 1``).
        value_head_dim (`int`, *optional*): width ``Dv`` of each value group (default ``head_dim``); W_O maps
            ``H * Dv`` to ``hidden_size``.
        tau_mode (`str`, defaults to "per_head"): the temperature: ``"global"`` (one learnable ``tau``),
            ``"per_head"`` (one per head) or ``"per_token"`` (``tau = f(x W_tau + b_tau)`` per head and token, a small
            ``hidden_size -> H`` projection ``tau_proj``).
        tau_init_range (`list[float]`, defaults to [0.03, 0.1]): initial temperatures (the gist's range).  Per head:
            log-spaced over the range across the heads; global: the geometric mean; per token: the bias of
            ``tau_proj`` is set so that ``tau`` equals the per-head values for a zero input.
        tau_min (`float`, defaults to 1e-4): floor (> 0): ``tau = tau_min + softplus(raw)`` in every mode, so ``tau``
            stays ``>= tau_min`` whatever the raw parameter or projection gives (softplus underflows to 0, never below).
        tau_max (`float`, *optional*): hard cap (the gist's alternative to ``L_tau``): ``tau = min(tau, tau_max)``,
            which bounds the window a query needs; the gradient is zero above the cap.
        scalar_sink (`bool`, defaults to True): a persistent sink entry with the fixed scalar key ``sink_key`` and a
            learnable value per value group (``sink_value``, zero-initialised: a neutral value), visible to every
            query in training and decoding alike (a prefix key; never windowed out or evicted).
        sink_key (`float`, defaults to 0.0): the sink's fixed scalar key.
        num_register_tokens (`int`, defaults to 0): register tokens as in the RBF family (prefix keys recomputed in
            every forward, never cached); their scalar queries and keys get a learnable offset per register and head.
        align_loss_weight, spread_loss_weight, tau_loss_weight (`float`, default 0 = off): weights of the gist's
            regularizers ``L_align``, ``L_spread`` and ``L_tau`` (see :mod:`hf_rbf.scalar_regularizers`), added to the
            loss when ``labels`` are given and reported separately in the output.
        align_loss_start_step, spread_loss_start_step, tau_loss_start_step (`int`, defaults to 0) and
            align_loss_warmup_steps, spread_loss_warmup_steps, tau_loss_warmup_steps (`int`, defaults to 0): the
            schedule of each regularizer's weight over the optimizer step ``s`` (the gist's tuning advice: ``L_align``
            first, ``L_spread`` after initial convergence): 0 before ``start``, then ``weight * (s - start) /
            warmup`` rising linearly to ``weight`` at ``start + warmup`` (at once when ``warmup`` is 0).  The step
            comes from :class:`~hf_rbf.trainer.HfRbfTrainer` (``Trainer``'s ``state.global_step``) or
            ``model.set_regularizer_step(step)`` in a loop of one's own; a scheduled model in training mode refuses a
            regularized forward without a step, and in eval mode uses the full weights (the trained objective).
        align_gradient (`str`, defaults to "upstream"): where ``L_align``'s gradient goes.  ``"upstream"`` (the gist's
            code: ``sq_dist`` is built from the model's own ``qs`` / ``ks``) lets it flow through ``qs`` / ``ks`` into
            ``qs_proj`` / ``ks_proj`` and everything below them (norms, earlier layers, embeddings);
            ``"scalar_projections"`` recomputes ``qs`` / ``ks`` from the detached layer input so that only the
            ``qs_proj`` / ``ks_proj`` weights (and biases) learn from it (the gist's text: "gradient flows only to the
            scalar projections").  The attention weights are detached in both.
        spread_range (`list[float]` or `"adaptive"`, defaults to [-3.0, 3.0]): the target range of ``L_spread``:
            fixed ``[a, b]`` or per sequence and head ``mean(ks) +- spread_adaptive_width * std(ks)``.
        spread_adaptive_width (`float`, defaults to 3.0): the width (in standard deviations) of the adaptive range.
        decode_window (`int`, *optional*): the sorted cache's window ``k``: after the first forward (the prompt, which
            is exact), every query attends to the ``k`` cached keys nearest to it in its sort order (``k // 2`` below
            its insertion point, the rest above, shifted inward at the ends) plus the prefix (sink, registers).
            ``None`` (default) or ``k`` >= the cache length is exact.
        sort_scheme (`str`, defaults to "per_head"): how a head finds its window: ``"per_head"`` (each head keeps its
            own order of its own keys) or ``"sort_head"`` (each value group keeps one order, that of its designated
            sort head; every head of the group binary-searches its own query in it: the gist's shared store).
        sort_head (`int`, defaults to 0): the designated sort head's index inside its group (``"sort_head"`` scheme).
        cache_buffer_size (`int`, defaults to 64): new keys wait in an unsorted buffer of up to this many tokens that
            every decode step scans, and are merged into the sorted arrays when it is full (the window semantics do
            not depend on it; it trades per-step scan cost against merge frequency).
        max_cache_tokens (`int`, *optional*): bound on the tokens each sorted layer keeps (per batch row); past it,
            ``cache_eviction`` chooses which go.  "dot" layers and sliding layers then keep the last
            ``max_cache_tokens`` tokens at most.
        max_cache_bytes (`int`, *optional*): the same bound in bytes (set at most one of the two): the bytes each
            layer's per-token buffers may take per batch row.  Every layer converts it into its own token bound
            ``max_cache_bytes // b``, ``b`` its bytes per cached token in the dtype the cache is filled with (by slot:
            scalar keys, values, vector keys, validity, token index, and the log-weight and multiplicity that
            ``"density"`` eviction keeps; one key and one int64 slot per order in the sorted arrays; see
            :func:`hf_rbf.cache_static.cache_bytes_per_token`), so a hybrid layer keeps fewer tokens than a scalar
            one, and a "dot" layer ``max_cache_bytes // (2 H head_dim item)``.
        cache_eviction (`str`, defaults to "geometric"): ``"geometric"`` (first the keys farthest outside
            ``[min recent qs - r, max recent qs + r]`` of every head, then the oldest), ``"density"`` (merge the
            closest adjacent keys into a centroid with the weighted-average value and summed weight) or ``"oldest"``.
        eviction_radius (`float`, defaults to 0.5): ``r`` of geometric eviction (>= 0).
        eviction_recent_queries (`int`, defaults to 16): how many recent queries define the geometric range.
        eviction_batch (`int`, *optional*): when the bound is reached, this many extra tokens are freed at once so
            eviction runs every ``eviction_batch`` steps instead of every step (default ``max(1, max_cache_tokens
            // 16)``).
        density_merge_weighting (`str`, defaults to "multiplicity"): how ``"density"`` eviction averages a group of
            adjacent keys: ``"multiplicity"`` (each entry weighted by the tokens it already stands for) or
            ``"attention"`` (the gist's "value = weighted average": each entry weighted by the attention mass the
            recent queries give it, ``eviction_recent_queries`` of them, with their own temperature, log-weights and,
            in hybrid layers, dot-product term).
        density_merge_size (`int`, defaults to 2): how many entries adjacent in the first order are merged into one
            (the gist's ``k``; at least 2).
        sink_zone (`list[float]`, *optional*): a reserved scalar range ``[a, b]``: tokens whose key (in any scalar
            head) lies inside it are evicted only when nothing else is left.
        decode_backend (`str`, defaults to "auto"): the windowed decode step of the dynamic sorted cache:
            ``"torch"`` (:func:`~hf_rbf.sorted_window_attention`, a few dozen small ops), ``"triton"`` (one fused
            kernel per layer step, :mod:`hf_rbf.kernels_sorted_decode`; CUDA, or the CPU under
            ``TRITON_INTERPRET=1``) or ``"auto"`` (triton on CUDA where it can run and the window is at most 256
            keys, else torch).  The layer records its choice in ``last_decode_backend`` (and why not triton in
            ``last_decode_reason``).  ("torch" was the default until 2026-11-26: on an H200 the fused
            step read the window in 0.08 ms per layer against 1.0 ms, ``docs/scalar_sort.md``.)  The same choice
            ("auto": on CUDA) writes a decode step's token into the cache in one launch
            (:mod:`hf_rbf.kernels_cache_append`; ``last_append_reason`` says why not) instead of five slice copies.

    Layer kinds (``attention_layers``): ``"scalar"`` and ``"dot"`` (learned projections, RoPE, softmax dot product).

    PEFT LoRA target modules: ``qs_proj``, ``ks_proj``, ``v_proj``, ``o_proj``, ``tau_proj`` (per-token tau),
    ``q_proj``, ``k_proj`` (dot layers), ``gate_proj``, ``up_proj``, ``down_proj``.
    """

    model_type = "scalar_sort"
    family_kind = "scalar"
    allowed_layer_kinds = ("scalar", "dot")
    default_num_register_tokens = 0

    def __init__(
        self,
        num_value_groups: int | None = None,
        value_head_dim: int | None = None,
        tau_mode: str = "per_head",
        tau_init_range: list[float] = (0.03, 0.1),
        tau_min: float = 1e-4,
        tau_max: float | None = None,
        scalar_sink: bool = True,
        sink_key: float = 0.0,
        align_loss_weight: float = 0.0,
        spread_loss_weight: float = 0.0,
        tau_loss_weight: float = 0.0,
        spread_range: list[float] | str = (-3.0, 3.0),
        spread_adaptive_width: float = 3.0,
        decode_window: int | None = None,
        sort_scheme: str = "per_head",
        sort_head: int = 0,
        cache_buffer_size: int = 64,
        max_cache_tokens: int | None = None,
        max_cache_bytes: int | None = None,
        cache_eviction: str = "geometric",
        eviction_radius: float = 0.5,
        eviction_recent_queries: int = 16,
        eviction_batch: int | None = None,
        sink_zone: list[float] | None = None,
        decode_backend: str = "auto",
        density_merge_weighting: str = "multiplicity",
        density_merge_size: int = 2,
        align_gradient: str = "upstream",
        align_loss_start_step: int = 0,
        align_loss_warmup_steps: int = 0,
        spread_loss_start_step: int = 0,
        spread_loss_warmup_steps: int = 0,
        tau_loss_start_step: int = 0,
        tau_loss_warmup_steps: int = 0,
        **kwargs,
    ):
        name = type(self).__name__
        heads = kwargs.get("num_attention_heads", 12)
        # The base class validates the shared fields; the family fields below need the head count first.
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            check_int(name, "num_attention_heads", heads, minimum=1)
        if num_value_groups is None:
            num_value_groups = self._default_value_groups(heads)
        check_int(name, "num_value_groups", num_value_groups, minimum=1)
        if heads % num_value_groups != 0:
            raise ValueError(
                f"{name}: `num_value_groups` ({num_value_groups}) must divide `num_attention_heads` ({heads}); "
                f"allowed: {[g for g in range(1, heads + 1) if heads % g == 0]}"
            )
        if value_head_dim is not None:
            check_int(name, "value_head_dim", value_head_dim, minimum=1)
        check_choice(name, "tau_mode", tau_mode, TAU_MODES)
        tau_init_range = _check_pair(name, "tau_init_range", tau_init_range, positive=True, ordered="<=")
        check_float(name, "tau_min", tau_min, positive=True)
        if tau_min >= tau_init_range[0]:
            raise ValueError(
                f"{name}: `tau_min` ({tau_min}) must be below the low end of `tau_init_range` ({tau_init_range[0]})"
            )
        if tau_max is not None:
            check_float(name, "tau_max", tau_max, positive=True)
            if tau_max < tau_init_range[1]:
                raise ValueError(
                    f"{name}: `tau_max` ({tau_max}) must be at least the high end of `tau_init_range` "
                    f"({tau_init_range[1]})"
                )
        check_bool(name, "scalar_sink", scalar_sink)
        check_float(name, "sink_key", sink_key)
        for field, value in (
            ("align_loss_weight", align_loss_weight),
            ("spread_loss_weight", spread_loss_weight),
            ("tau_loss_weight", tau_loss_weight),
        ):
            check_float(name, field, value, minimum=0.0)
        check_choice(name, "align_gradient", align_gradient, ALIGN_GRADIENTS)
        schedule = {
            "align_loss_start_step": align_loss_start_step,
            "align_loss_warmup_steps": align_loss_warmup_steps,
            "spread_loss_start_step": spread_loss_start_step,
            "spread_loss_warmup_steps": spread_loss_warmup_steps,
            "tau_loss_start_step": tau_loss_start_step,
            "tau_loss_warmup_steps": tau_loss_warmup_steps,
        }
        for field, value in schedule.items():
            check_int(name, field, value, minimum=0)
        if isinstance(spread_range, str):
            check_choice(name, "spread_range", spread_range, ("adaptive",))
        else:
            spread_range = _check_pair(name, "spread_range", spread_range, positive=False, ordered="<")
        check_float(name, "spread_adaptive_width", spread_adaptive_width, positive=True)
        sink_zone = check_sorted_cache_settings(
            name,
            num_heads=heads,
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

        self.num_value_groups = num_value_groups
        self.value_head_dim = value_head_dim
        self.tau_mode = tau_mode
        self.tau_init_range = tau_init_range
        self.tau_min = float(tau_min)
        self.tau_max = None if tau_max is None else float(tau_max)
        self.scalar_sink = scalar_sink
        self.sink_key = float(sink_key)
        self.align_loss_weight = float(align_loss_weight)
        self.spread_loss_weight = float(spread_loss_weight)
        self.tau_loss_weight = float(tau_loss_weight)
        self.spread_range = spread_range
        self.spread_adaptive_width = float(spread_adaptive_width)
        self.decode_window = decode_window
        self.sort_scheme = sort_scheme
        self.sort_head = sort_head
        self.cache_buffer_size = cache_buffer_size
        self.max_cache_tokens = max_cache_tokens
        self.max_cache_bytes = max_cache_bytes
        self.cache_eviction = cache_eviction
        self.eviction_radius = float(eviction_radius)
        self.eviction_recent_queries = eviction_recent_queries
        self.eviction_batch = eviction_batch
        self.sink_zone = sink_zone
        self.decode_backend = decode_backend
        self.density_merge_weighting = density_merge_weighting
        self.density_merge_size = density_merge_size
        self.align_gradient = align_gradient
        for field, value in schedule.items():
            setattr(self, field, value)
        super().__init__(**kwargs)
        if value_head_dim is None:
            self.value_head_dim = self.head_dim

    @staticmethod
    def _default_value_groups(heads: int) -> int:
        return default_value_groups(heads)

    @property
    def regularizers_enabled(self) -> bool:
        """Whether any of ``L_align``, ``L_spread``, ``L_tau`` has a non-zero weight."""
        return self.align_loss_weight > 0 or self.spread_loss_weight > 0 or self.tau_loss_weight > 0

    @property
    def regularizer_schedule_enabled(self) -> bool:
        """Whether any regularizer's weight follows a schedule (a start step or a warmup)."""
        return any(
            getattr(self, f"{name}_loss_start_step") > 0 or getattr(self, f"{name}_loss_warmup_steps") > 0
            for name in REGULARIZERS
        )

    def regularizer_weight(self, name: str, step: int | None) -> float:
        """The weight of regularizer ``name`` ("align", "spread" or "tau") at optimizer step ``step``: its
        ``{name}_loss_weight`` times the schedule factor (:func:`regularizer_schedule_factor`); ``step=None`` means
        the schedule is over (the full weight)."""
        check_choice(type(self).__name__, "name", name, REGULARIZERS)
        weight = getattr(self, f"{name}_loss_weight")
        if step is None:
            return weight
        start = getattr(self, f"{name}_loss_start_step")
        warmup = getattr(self, f"{name}_loss_warmup_steps")
        return weight * regularizer_schedule_factor(step, start, warmup)

    def sorted_cache_settings(self) -> dict:
        """The sorted-cache fields, as keyword arguments of :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCache`."""
        return dict(
            decode_window=self.decode_window,
            sort_scheme=self.sort_scheme,
            sort_head=self.sort_head,
            cache_buffer_size=self.cache_buffer_size,
            max_cache_tokens=self.max_cache_tokens,
            max_cache_bytes=self.max_cache_bytes,
            cache_eviction=self.cache_eviction,
            eviction_radius=self.eviction_radius,
            eviction_recent_queries=self.eviction_recent_queries,
            eviction_batch=self.eviction_batch,
            sink_zone=self.sink_zone,
            decode_backend=self.decode_backend,
            density_merge_weighting=self.density_merge_weighting,
            density_merge_size=self.density_merge_size,
        )


__all__ = ["ScalarSortConfig", "override_cache_settings", "regularizer_schedule_factor"]
