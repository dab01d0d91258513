"""Scalar sort attention decoder (``model_type="scalar_sort"``): the shared backbone with :class:`ScalarSortAttention`
layers, the sorted KV cache (:class:`~hf_rbf.cache_sorted_scalar.SortedScalarCache`) and the gist's regularizers.

Per head a scalar query and key, ``softmax_j(-(qs_i - ks_j)^2 / tau)``, grouped values, W_O; an optional scalar sink
and register tokens are prefix keys in training and decoding alike.  ``generate`` builds a ``SortedScalarCache``;
with ``decode_window = k`` every query after the prompt reads only its ``k`` nearest keys in scalar order.

PEFT LoRA target modules: ``qs_proj``, ``ks_proj``, ``v_proj``, ``o_proj``, ``tau_proj`` (per-token tau), ``q_proj``,
``k_proj`` ("dot" layers), ``gate_proj``, ``up_proj``, ``down_proj``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention_scalar import OP as SCALAR_OP
from .attention_scalar import scalar_attention
from .attention_scalar_triton import scalar_attention_triton
from .attention_utils import MaskArgs, note_backend_choice, parameter_values_keepable, per_query_param
from .cache_names import cache_field, output_cache, resolve_cache_argument
from .cache_sorted_scalar import ByteBudgetSlidingWindowLayer, SortedScalarCache, SortedScalarCacheLayer
from .cache_sorted_static import StaticSortedLayer, default_block_size
from .cache_static import StaticDecoderCache, StaticKeyValueLayer, static_cache_len_for_bytes
from .configuration_scalar_sort import ScalarSortConfig, override_cache_settings
from .modeling_decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderModel,
    DecoderPreTrainedModel,
    DotAttention,
    decodes_directly,
    project_together,
    signature_once,
)
from .kernels_common import triton_unavailable_reason
from .scalar_regularizers import align_moment_values, align_rows, masked_sum, spread_loss, tau_loss


@dataclass
class ScalarSortCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus the parts of the loss (reported so ``Trainer`` can log them).

    Args:
        loss: ``lm_loss`` plus the weighted regularizers (when ``labels`` are given).
        lm_loss: the language-modelling loss alone.
        align_loss, spread_loss, tau_loss: the unweighted ``L_align``, ``L_spread``, ``L_tau`` of this batch (means
            over the scalar layers; see :mod:`hf_rbf.scalar_regularizers`), detached; ``None`` when their weight is 0.
    """

    lm_loss: torch.FloatTensor | None = None
    align_loss: torch.FloatTensor | None = None
    spread_loss: torch.FloatTensor | None = None
    tau_loss: torch.FloatTensor | None = None


def _inverse_softplus(y: float) -> float:
    """``x`` with ``softplus(x) = y`` (``y > 0``), stable for small and large ``y``."""
    return y + math.log(-math.expm1(-y))


def tau_init_values(config: ScalarSortConfig, heads: int) -> list[float]:
    """Initial temperatures: per head log-spaced over ``tau_init_range``; one value (the geometric mean) when global."""
    lo, hi = config.tau_init_range
    if config.tau_mode == "global" or heads == 1:
        return [math.sqrt(lo * hi)]
    return [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * h / (heads - 1)) for h in range(heads)]


def _split_row_heads(t: torch.Tensor | None, text_shape: tuple[int, int]):
    """A head-major projection of the flat rows, ``[1, C, B * N + R, ...]``, as text ``[B, C, N, ...]`` and registers
    ``[1, C, R, ...]`` (None without register rows); views, no copy.  ``(None, None)`` for None."""
    if t is None:
        return None, None
    b, n = text_shape
    registers = None
    if t.shape[2] > b * n:  # one split, not two slices (see split_rows: its backward is one cat)
        t, registers = t.split([b * n, t.shape[2] - b * n], dim=2)
    return t.unflatten(2, (b, n)).squeeze(0).movedim(1, 0), registers


@dataclass
class _Projections:
    """One set of per-token projections: scalar queries / keys ``[B, H, N]``, values ``[B, G, N, Dv]`` and, for the
    hybrid, vector queries / keys ``[B, H, N, D]``."""

    qs: torch.Tensor
    ks: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    # (cos, sin) while ``q`` and ``k`` still wait for their RoPE, which the sorted cache's insert applies in place
    # (see ``modeling_decoder.rope_in_insert``); None otherwise
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None


class ScalarSortAttention(DecoderAttention):
    """Scalar sort attention: ``qs_proj``, ``ks_proj`` (``hidden_size -> H``), ``v_proj`` (``-> G * Dv``), ``o_proj``
    (``H * Dv -> hidden_size``), the temperature (``tau_bias`` ``[1]`` / ``[H]`` or ``tau_proj``), the sink value
    ``sink_value [G, Dv]`` and the registers' scalar offsets ``register_scalar_position [R, H]``.

    Temperature: ``tau = tau_min + softplus(raw)`` (then ``min(tau, tau_max)`` if capped), ``raw`` the parameter
    ``tau_bias`` (global / per head) or ``tau_proj(x)`` (per token, whose bias plays the same role); computed in
    float32.  It is named a bias so that ``Trainer`` does not weight-decay it: decay would pull every ``tau`` towards
    ``tau_min + softplus(0)`` (about 0.69), a drift that has nothing to do with the data.

    Keys of a text query: ``[sink; registers; cached and new text]`` (the first ``P`` are the prefix, always
    visible).  Register rows attend to ``[sink; registers]`` causally.  With a
    :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCacheLayer` the first forward (the prompt) and
    ``decode_window=None`` are exact; later queries with a window read through
    :func:`~hf_rbf.sorted_window_attention`.  ``last_backend`` is "sorted_window" after a windowed step.

    ``output_attentions`` (see :class:`~hf_rbf.modeling_decoder.DecoderAttention`): the weights cover ``[sink;
    registers; text]``; they are available without a cache, through sliding cache layers and for the prompt forward
    into an empty sorted cache layer, and refused (ValueError, before any layer runs) for a later step through a sorted
    cache layer, which reads only a window of its keys.
    """

    kind = "scalar"
    has_vector_term = False
    # every head has the scalar term (`scalar_head_list` all True); the hybrid family sets it per layer.  The forward
    # reads this bool rather than the per-head list: under torch.compile a read list is a guard per element
    _all_scalar = True

    def __init__(self, config: ScalarSortConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # per-head constants as device tensors, made once per (device, dtype): see `_head_constant`
        self._head_constants: dict = {}
        d, h = config.hidden_size, self.num_heads
        self.num_value_groups = config.num_value_groups
        self.value_head_dim = config.value_head_dim
        bias = config.attention_bias
        self.qs_proj = nn.Linear(d, h, bias=bias)
        self.ks_proj = nn.Linear(d, h, bias=bias)
        self.v_proj = nn.Linear(d, self.num_value_groups * self.value_head_dim, bias=bias)
        self.o_proj = nn.Linear(h * self.value_head_dim, d, bias=bias)
        self.tau_mode = config.tau_mode
        self.tau_min = config.tau_min
        self.tau_max = config.tau_max
        self.tau_init = tau_init_values(config, h)
        if self.tau_mode == "per_token":
            self.tau_proj = nn.Linear(d, h, bias=True)
            self.tau_bias = None
        else:
            self.tau_proj = None
            self.tau_bias = nn.Parameter(torch.tensor([_inverse_softplus(t - self.tau_min) for t in self.tau_init]))
        self.sink_key = config.sink_key
        self.sink_value = (
            nn.Parameter(torch.zeros(self.num_value_groups, self.value_head_dim)) if config.scalar_sink else None
        )
        self.num_sink = 1 if config.scalar_sink else 0
        if self.num_registers > 0:
            self.register_scalar_position = nn.Parameter(torch.zeros(self.num_registers, h))
            if not self.has_vector_term:
                self.register_position = None  # scalar layers have no vector q / k to offset
        else:
            self.register_scalar_position = None
        self.cache_settings = config.sorted_cache_settings()

    # -- parameters ----------------------------------------------------------------------------------------------
    def _init_own_parameters(self) -> None:
        super()._init_own_parameters()
        raw = [_inverse_softplus(t - self.tau_min) for t in self.tau_init]
        if self.tau_bias is not None:
            init.copy_(self.tau_bias, torch.tensor(raw, dtype=self.tau_bias.dtype))
        else:
            init.copy_(self.tau_proj.bias, torch.tensor(raw, dtype=self.tau_proj.bias.dtype))
        if self.sink_value is not None:
            init.zeros_(self.sink_value)
        if self.register_scalar_position is not None:
            init.zeros_(self.register_scalar_position)

    @property
    def scalar_head_list(self) -> list[bool]:
        """Which heads have the scalar term (all of a scalar layer)."""
        return [True] * self.num_heads

    def _head_constant(self, name: str, values: list, dtype: torch.dtype, device) -> torch.Tensor:
        """A per-head constant of this layer (``values``, one per head) on ``device``, built once per (device, dtype).
        A tensor made from a Python list is a blocking host-to-device copy, which on CUDA synchronises the stream: at
        every layer of every forward and decode step the host could no longer run ahead of the GPU."""
        if torch.compiler.is_compiling():  # a graph constant: nothing is copied when the graph replays
            return torch.tensor(values, dtype=dtype, device=device)
        key = (name, torch.device(device), dtype)
        t = self._head_constants.get(key)
        if t is None:
            t = self._head_constants[key] = torch.tensor(values, dtype=dtype, device=device)
        return t

    def _scalar_head_mask(self, device) -> torch.Tensor:
        return self._head_constant("scalar_heads", self.scalar_head_list, torch.bool, device)

    def temperature(self, x: torch.Tensor) -> torch.Tensor:
        """``tau``: ``[H]`` (global / per head) or ``[B, H, N]`` (per token, from ``x [B, N, D]``), float32 (float64
        for float64 parameters), ``>= tau_min`` and ``<= tau_max`` when capped.

        Global / per head, without gradients (a decode step) and outside ``torch.compile``, ``tau`` is a function of
        ``tau_bias`` alone: it is computed once and kept while the parameter is the same tensor with the same data
        (its version counter counts every in-place write: an optimiser step, ``load_state_dict``), not four ops per
        layer and step again.  The kept tensor is only ever read."""
        if self.tau_proj is not None:
            return self._temperature_of(self.tau_proj(x).transpose(1, 2))
        bias = self.tau_bias
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or not parameter_values_keepable(bias.device):
            return self._temperature_of(bias.expand(self.num_heads))
        state = (bias._version, bias.data_ptr(), bias.dtype, bias.device, self.num_heads, self.tau_min, self.tau_max)
        kept = self.__dict__.get("_tau_kept")
        if kept is not None and kept[0] is bias and kept[1] == state:
            return kept[2]
        tau = self._temperature_of(bias.expand(self.num_heads))
        self._tau_kept = (bias, state, tau)
        return tau

    def _temperature_of(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.to(torch.promote_types(raw.dtype, torch.float32))
        tau = self.tau_min + F.softplus(raw)
        if self.tau_max is not None:
            tau = tau.clamp(max=self.tau_max)
        return tau

    # -- projections ---------------------------------------------------------------------------------------------
    def scalar_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scalar queries and keys ``[B, H, N]`` of ``x [B, N, D]``."""
        qs, ks = project_together(x, (self.qs_proj, self.ks_proj))
        return self._scalar_heads(qs, ks)

    def _scalar_heads(self, qs: torch.Tensor, ks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``qs_proj`` / ``ks_proj`` outputs ``[B, N, H]`` as scalar queries and keys ``[B, H, N]``, copied to that
        layout: the kernels read them along ``N``, and as views of the projection (a row of ``H`` values, or of all
        the layer's projections together) each of those reads would touch its own memory sector.  The copies are
        ``H`` values per token."""
        return qs.transpose(1, 2).contiguous(), ks.transpose(1, 2).contiguous()

    def _value_heads(self, v: torch.Tensor) -> torch.Tensor:
        b, n, _ = v.shape
        return v.view(b, n, self.num_value_groups, self.value_head_dim).transpose(1, 2)

    def _input_projections(self) -> tuple[nn.Linear, ...]:
        """The projections of a row, in the order :meth:`_projections_of` takes their outputs."""
        return (self.qs_proj, self.ks_proj, self.v_proj)

    def _projections_of(self, outputs: tuple[torch.Tensor, ...]) -> _Projections:
        qs, ks = self._scalar_heads(*outputs[:2])
        return _Projections(qs=qs, ks=ks, v=self._value_heads(outputs[2]))

    def _row_projections(self, x: torch.Tensor) -> _Projections:
        """The projections of rows ``x [B, N, D]``, head-major, before positions or register offsets: one GEMM for
        all of them (:func:`~hf_rbf.modeling_decoder.project_together`)."""
        return self._projections_of(project_together(x, self._input_projections(), keep_copy=True))

    def _text_positions(self, proj: _Projections, position_embeddings, defer_rope: bool = False) -> _Projections:
        """Positions of the text rows (none in scalar layers).  ``defer_rope``: RoPE is left to the cache's insert
        (:meth:`_defers_rope`)."""
        return proj

    def _defers_rope(self, layer, x: torch.Tensor) -> bool:
        """Whether this step's RoPE of rows ``x`` goes into the insert into the cache layer ``layer`` (no RoPE in
        scalar layers)."""
        return False

    def _register_offsets(self, proj: _Projections, detach_offsets: bool = False) -> _Projections:
        """The register rows' learned scalar offsets (``register_scalar_position``)."""
        qs, ks = proj.qs, proj.ks
        offset = self.register_scalar_position.to(qs.dtype).t().unsqueeze(0) * self._scalar_head_mask(qs.device).view(
            1, -1, 1
        )
        if detach_offsets:
            offset = offset.detach()
        return _Projections(qs=qs + offset, ks=ks + offset, v=proj.v, q=proj.q, k=proj.k)

    def project(self, x: torch.Tensor, position_embeddings, defer_rope: bool = False) -> _Projections:
        """Text projections (no positions in scalar layers; see :meth:`_text_positions` for ``defer_rope``)."""
        return self._text_positions(self._row_projections(x), position_embeddings, defer_rope)

    def project_registers(self, r: torch.Tensor, detach_offsets: bool = False) -> _Projections:
        """Register projections ``[1, ...]`` with their learned scalar offsets (``register_scalar_position``)."""
        return self._register_offsets(self._row_projections(r), detach_offsets)

    @property
    def takes_rows(self) -> bool:
        """The flat-rows path (see :meth:`project_rows`) where there are register rows to merge; without them it
        would only add views.  Rows without register rows (the register stream, whose prefix comes as
        ``register_prefix``) take the text path of a model without registers: :meth:`project_rows` would split and
        re-view every projection for nothing (9 to 15 views per layer and decode step)."""
        return self.num_registers > 0

    def project_rows(
        self, rows: torch.Tensor, text_shape: tuple[int, int], position_embeddings, defer_rope: bool = False
    ):
        """Text and register projections from the flat ``[B * N + R, D]`` rows, one matmul per projection for both:
        ``(text, registers or None, tau of the text rows, tau of the register rows or None)``, the same values as
        :meth:`project`, :meth:`project_registers` and :meth:`temperature` of the two views (views, no copy)."""
        proj = self._row_projections(rows.unsqueeze(0))
        parts = {f: _split_row_heads(getattr(proj, f), text_shape) for f in ("qs", "ks", "v", "q", "k")}
        text = _Projections(**{f: t for f, (t, _) in parts.items()})
        text = self._text_positions(text, position_embeddings, defer_rope)
        registers = None
        if rows.shape[0] > text_shape[0] * text_shape[1]:
            registers = self._register_offsets(_Projections(**{f: r for f, (_, r) in parts.items()}))
        tau = self.temperature(rows.unsqueeze(0))
        if tau.dim() == 1:  # global / per head: one value for every row
            return text, registers, tau, tau
        tau_text, tau_registers = _split_row_heads(tau, text_shape)
        return text, registers, tau_text, tau_registers

    def sink_entries(self, dtype, device) -> _Projections | None:
        """The sink as a key set of length 1: scalar key ``sink_key``, value ``sink_value`` (zero vector key).

        Without gradients and outside ``torch.compile`` the tensors are kept while ``sink_value`` keeps its data (as
        :meth:`temperature`'s): a decode step reads the same sink in every step."""
        if self.sink_value is None:
            return None
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or not parameter_values_keepable(device):
            return self._sink_entries(dtype, device)
        value = self.sink_value
        state = (value._version, value.data_ptr(), value.dtype, value.device, dtype, torch.device(device),
                 self.sink_key)  # fmt: skip
        kept = self.__dict__.get("_sink_kept")
        if kept is None or kept[0] is not value or kept[1] != state:
            kept = self._sink_kept = (value, state, self._sink_entries(dtype, device))
        sink = kept[2]
        return _Projections(qs=sink.qs, ks=sink.ks, v=sink.v, q=sink.q, k=sink.k)

    def _sink_entries(self, dtype, device) -> _Projections:
        h = self.num_heads
        # the key parts are constants of the layer (made once per device and dtype, see `_head_constant`)
        # (not a list over the heads where every head has the scalar term: under torch.compile each element read is
        # a guard of the step, `_all_scalar` one)
        keys = [self.sink_key] * h if self._all_scalar else [self.sink_key if s else 0.0 for s in self.scalar_head_list]
        ks = self._head_constant("sink_key", keys, dtype, device).view(1, h, 1)
        v = self.sink_value.to(dtype).view(1, self.num_value_groups, 1, self.value_head_dim)
        k = None
        if self.has_vector_term:
            k = self._head_constant("sink_vector_key", [[0.0] * self.head_dim] * h, dtype, device).view(
                1, h, 1, self.head_dim
            )
        return _Projections(qs=ks, ks=ks, v=v, q=k, k=k)

    # -- attention -----------------------------------------------------------------------------------------------
    def attention_function(
        self,
        queries: _Projections,
        keys: _Projections,
        tau,
        backend: str | None = None,
        prefix: _Projections | None = None,
        **mask_args,
    ) -> torch.Tensor:
        """The layer's exact attention over ``keys`` (``scalar_attention``); returns ``[B, H, Nq, Dv]``, or
        ``(out, weights [B, H, Nq, Nk])`` when ``mask_args`` holds ``return_weights=True`` (with ``backend="naive"``).

        ``backend`` overrides ``config.attention_backend`` (the register rows use ``register_backend``); ``prefix``:
        values in front of ``keys`` (see :meth:`attend_with_prefix`).
        """
        backend = self.backend if backend is None else backend
        out = scalar_attention(
            queries.qs,
            keys.ks,
            keys.v,
            tau,
            backend=backend,
            prefix_values=None if prefix is None else prefix.v,
            **mask_args,
        )
        self._note_backend("scalar_attention")
        return out

    def attend_with_prefix(
        self, queries: _Projections, prefix: _Projections | None, keys: _Projections, tau, **mask_args
    ) -> torch.Tensor:
        """:meth:`attention_function` over the ``prefix`` keys (sink, registers; batch 1, or None) followed by
        ``keys``.  Only the scalar keys are concatenated: the prefix's values (and vector keys) go as separate
        tensors, which the decode kernel reads in place (no copy of the cached values per layer and step)."""
        if prefix is None:
            return self.attention_function(queries, keys, tau, **mask_args)
        batch = keys.ks.shape[0]
        prefix_ks = prefix.ks
        if prefix_ks.shape[0] != batch or torch.compiler.is_compiling():  # (eagerly no view op at batch 1)
            prefix_ks = prefix_ks.expand(batch, -1, -1)
        ks = torch.cat([prefix_ks, keys.ks], dim=2)
        return self.attention_function(
            queries, _Projections(qs=None, ks=ks, v=keys.v, k=keys.k), tau, prefix=prefix, **mask_args
        )

    def decode_scale(self):
        """The dot-product scale passed to the windowed decode step (None: no dot term)."""
        return None

    # -- exact decode steps without the public function's checks (see modeling_decoder.direct_decode_calls) ---------
    def _decodes_directly(self, proj: _Projections) -> bool:
        """Whether this exact step over the cache (one query row) calls the fused decode backend directly: see
        ``hf_rbf.modeling_decoder.direct_decode_calls``; triton's support of the dtype and head dims is asked once per
        device and dtype (a layer's dims are fixed)."""
        qs = proj.qs
        if qs.shape[-1] != 1 or not decodes_directly(self.backend, qs):
            return False
        key = (qs.device, qs.dtype)
        memo = self.__dict__.setdefault("_direct_decode_reasons", {})
        if key not in memo:
            memo[key] = triton_unavailable_reason(qs.device, qs.dtype, self._fused_head_dims())
        return memo[key] is None

    def _fused_head_dims(self) -> tuple:
        """The head dims ``scalar_triton_reason`` checks (the value dim)."""
        return (("value dim Dv", self.value_head_dim),)

    def _decode_directly(self, proj: _Projections, prefix, cached: _Projections, tau, attention_mask, num_prefix):
        """:meth:`attend_with_prefix` of one query row over ``prefix`` + ``cached`` (``causal``, ``attention_mask``
        ``[B|1, P + S]`` bool or None: every key visible, no log-weights) through the fused backend, with the
        arguments the public function would normalise and pass it (``tau`` per ``per_query_param``, the mask as
        ``normalize_mask_args`` builds it): without its checks, which a layer's own tensors pass by construction."""
        b, h, nq = proj.qs.shape
        ks = cached.ks
        if prefix is not None:
            prefix_ks = prefix.ks if prefix.ks.shape[0] == b else prefix.ks.expand(b, -1, -1)
            ks = torch.cat([prefix_ks, ks], dim=2)
        nk = ks.shape[-1]
        am = attention_mask
        if am is not None:
            am = am if am.dtype == torch.bool else am != 0
            am = am if am.shape[0] == b else am.expand(b, nk)
        mask = MaskArgs(
            causal=True, window=None, num_prefix_keys=num_prefix, key_log_weights=None, attention_mask=am, nq=nq, nk=nk
        )
        out = self._fused_decode(proj, _Projections(qs=None, ks=ks, v=cached.v, k=cached.k), prefix, tau, mask)
        if self.__dict__.get("last_backend") != "triton":  # (nn.Module.__setattr__ only when it changes)
            self.last_backend = "triton"
        return out

    def _query_tau(self, op: str, tau, qs: torch.Tensor):
        """``tau`` as ``per_query_param`` normalises it (``[B|1, H|1, Nq|1]`` or a float); the ``[1, H, 1]`` view of
        the kept per-head temperature (:meth:`temperature`) is kept with it (not one view op per layer and step)."""
        kept = self.__dict__.get("_tau_kept")
        if kept is not None and kept[2] is tau:
            view = self.__dict__.get("_tau_view")
            if view is None or view[0] is not tau:
                view = self._tau_view = (tau, per_query_param(op, "tau", tau, *qs.shape, qs.device))
            return view[1]
        return per_query_param(op, "tau", tau, *qs.shape, qs.device)

    def _fused_decode(self, proj: _Projections, keys: _Projections, prefix, tau, mask: MaskArgs) -> torch.Tensor:
        """``scalar_attention``'s triton call for :meth:`_decode_directly`."""
        device = proj.qs.device
        note_backend_choice(SCALAR_OP, "triton", device, self.backend)
        tau = self._query_tau(SCALAR_OP, tau, proj.qs)
        return scalar_attention_triton(
            proj.qs, keys.ks, keys.v, tau, mask, prefix_values=None if prefix is None else prefix.v
        )

    def register_attention(self, registers: _Projections, sink: _Projections | None, tau) -> torch.Tensor:
        """The register rows' attention over the sink (:meth:`sink_entries`, or None) and the registers (causal):
        ``[1, H, R, Dv]``.

        One register (the recipes' setting) sees at most two keys, the sink and itself, so its softmax is a sigmoid
        of the score difference and needs no attention call: ``out = v_sink + sigmoid(s_self - s_sink) (v_self -
        v_sink)``, or ``v_self`` alone without a sink (weight 1, as rbf's register).  The call it replaces cost a
        fused launch or a materialised attention forward and backward, with its host work, in every layer and step.
        Several registers go through :meth:`attention_function` (``register_backend``).
        """
        if self.num_registers > 1:
            return self.attention_function(
                registers,
                self._cat_keys([sink, registers], 1),
                tau,
                backend=self.register_backend,
                causal=True,
                num_prefix_keys=self.num_sink,
            )
        heads_per_group = self.num_heads // self.num_value_groups

        def per_head(v):  # [1, G, 1, Dv] -> [1, H, 1, Dv] (no op with one head per group)
            return v if heads_per_group == 1 else v.repeat_interleave(heads_per_group, dim=1)

        v_self = per_head(registers.v)
        if sink is None:
            return v_self
        v_sink = per_head(sink.v)
        w_self = self._one_register_self_weight(registers, sink, tau).unsqueeze(-1)  # [1, H, 1, 1]
        ct = w_self.dtype
        return (v_sink.to(ct) + w_self * (v_self.to(ct) - v_sink.to(ct))).to(v_self.dtype)

    def _one_register_self_weight(self, registers: _Projections, sink: _Projections, tau) -> torch.Tensor:
        """The softmax weight ``[1, H, 1]`` that one register puts on itself next to the sink (the rest on the sink)."""
        ct = torch.promote_types(registers.qs.dtype, torch.float32)
        gap = self.pair_scores(registers, registers, tau, ct) - self.pair_scores(registers, sink, tau, ct)
        return torch.sigmoid(gap)

    @torch.no_grad()
    def one_register_weights(self, register_states: torch.Tensor) -> torch.Tensor:
        """The weights ``[1, H, 1, S + 1]`` of one register row over the sink (``S`` = 0 or 1) and itself, as
        :meth:`register_attention` applies them without an attention call (``recipes/visualize.py`` reads them)."""
        registers = self.project_registers(register_states)
        sink = self.sink_entries(registers.qs.dtype, registers.qs.device)
        if sink is None:
            return registers.qs.new_ones(1, self.num_heads, 1, 1, dtype=torch.float32)
        w_self = self._one_register_self_weight(registers, sink, self.temperature(register_states)).float()
        return torch.stack([1.0 - w_self, w_self], dim=-1)

    def pair_scores(self, queries: _Projections, keys: _Projections, tau, ct: torch.dtype) -> torch.Tensor:
        """Scores ``-(qs - ks)^2 / tau`` (natural log) of one query row against one key, each ``[1, H, 1]``; ``tau``
        as :meth:`temperature` returns it (``[H]`` or ``[1, H, 1]``), computed in ``ct``."""
        tau = tau.to(ct).view(1, -1, 1) if tau.dim() == 1 else tau.to(ct)
        diff = queries.qs.to(ct) - keys.ks.to(ct)
        return -(diff * diff) / tau

    @staticmethod
    def _cat_keys(parts: list[_Projections | None], batch: int) -> _Projections:
        parts = [p for p in parts if p is not None]

        def cat(name, dim):
            ts = [getattr(p, name) for p in parts]
            if ts[0] is None:
                return None
            ts = [t if t.shape[0] == batch else t.expand(batch, *t.shape[1:]) for t in ts]
            # one part (the sink alone as the prefix, every layer and step): the tensor itself, not a copy of it
            return ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)

        return _Projections(qs=None, ks=cat("ks", 2), v=cat("v", 2), k=cat("k", 2))

    def _prefix(self, register_keys: _Projections | None, dtype, device) -> tuple[_Projections | None, int]:
        return self._prefix_of(self.sink_entries(dtype, device), register_keys)

    def _prefix_of(self, sink: _Projections | None, register_keys: _Projections | None):
        """The keys in front of the text keys (sink, then registers) and their count."""
        if register_keys is None and sink is not None and sink.ks.shape[0] == 1:
            # the sink alone (every layer and step without registers): its tensors, as `_cat_keys` returns them
            return _Projections(qs=None, ks=sink.ks, v=sink.v, k=sink.k), sink.ks.shape[-1]
        parts = [p for p in (sink, register_keys) if p is not None]
        if not parts:
            return None, 0
        prefix = self._cat_keys(parts, 1)
        return prefix, prefix.ks.shape[-1]

    def _mask_args(self, num_text_keys: int, num_prefix: int, attention_mask, key_log_weights):
        """Slice the text-key mask / log-weights to the keys attended and prepend the prefix (visible, weight 0)."""
        am = attention_mask[:, -num_text_keys:] if attention_mask is not None else None
        klw = key_log_weights[..., -num_text_keys:] if key_log_weights is not None else None
        if num_prefix > 0:
            if am is not None:
                am = torch.cat([am.new_ones(am.shape[0], num_prefix), am], dim=1)
            if klw is not None:
                klw = torch.cat([klw.new_zeros(*klw.shape[:-1], num_prefix), klw], dim=-1)
        return am, klw

    def register_forward(self, register_states: torch.Tensor):
        """The register rows' attention (over the sink and the registers, causally): ``(out [1, R, D] after o_proj,
        prefix)``, with ``prefix = (ks, v, k)`` the keys the text rows see in front of theirs (the sink, then the
        registers; ``k`` None without a vector term), as :meth:`_prefix_of` makes them."""
        register_keys = self.project_registers(register_states)
        sink = self.sink_entries(register_keys.ks.dtype, register_keys.ks.device)
        register_out = self.register_attention(register_keys, sink, self.temperature(register_states))
        prefix, _ = self._prefix_of(sink, register_keys)
        return self.o_proj(self._merge_heads(register_out)), (prefix.ks, prefix.v, prefix.k)

    def forward(
        self,
        hidden_states: torch.Tensor,
        register_states: torch.Tensor | None,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        key_log_weights: torch.Tensor | None = None,
        output_attentions: bool = False,
        rows: torch.Tensor | None = None,
        register_prefix: tuple | None = None,
    ):
        """Text ``[B, N, D]`` and register ``[1, R, D]`` rows -> ``(text out, register out or None, weights)``; with
        ``rows`` (the flat ``[B * N + R, D]`` buffer the two are views of, as ``DecoderLayer`` passes it) one matmul
        per projection and one ``o_proj`` serve both, and the result is ``(out rows [B * N + R, D], None,
        weights)``.  With ``register_prefix`` (:meth:`register_forward`'s prefix, computed by the register stream)
        the registers are not computed here: ``rows`` / ``register_states`` hold no register rows."""
        b, n, _ = hidden_states.shape
        layer = None if cache is None else cache.layers[self.layer_idx]
        defer_rope = self._defers_rope(layer, hidden_states)
        register_keys = tau_registers = register_out = register_out_rows = None
        if rows is not None and rows.shape[0] > b * n:
            proj, register_keys, tau, tau_registers = self.project_rows(rows, (b, n), position_embeddings, defer_rope)
        else:
            proj = self.project(hidden_states, position_embeddings, defer_rope)
            tau = self.temperature(hidden_states)
            if self.num_registers > 0 and register_prefix is None:
                register_out_rows, register_prefix = self.register_forward(register_states)

        if register_prefix is not None:
            ks, v, k = register_prefix
            prefix, num_prefix = _Projections(qs=None, ks=ks, v=v, k=k), ks.shape[-1]
        else:
            # the flat rows path: the register rows' projections came with the text's
            sink = self.sink_entries(proj.ks.dtype, proj.ks.device)
            if register_keys is not None:
                register_out = self.register_attention(register_keys, sink, tau_registers)
            prefix, num_prefix = self._prefix_of(sink, register_keys)

        weights = None
        if isinstance(layer, StaticSortedLayer):
            out = self._attend_static_sorted(layer, proj, tau, prefix, num_prefix, attention_mask)
        elif isinstance(layer, SortedScalarCacheLayer):
            out = self._attend_sorted(
                layer,
                proj,
                tau,
                prefix,
                num_prefix,
                attention_mask,
                key_log_weights,
                output_attentions,
                prefill=getattr(cache, "prefilling", False),
            )
            if output_attentions:
                out, weights = out
        else:
            keys = proj
            if layer is not None:
                # sliding layers: transformers' sliding cache with the scalar key packed before the vector key
                packed = proj.ks.unsqueeze(-1) if proj.k is None else torch.cat([proj.ks.unsqueeze(-1), proj.k], -1)
                packed, values = cache.update(packed, proj.v, self.layer_idx)
                keys = _Projections(
                    qs=None, ks=packed[..., 0], v=values, k=packed[..., 1:] if proj.k is not None else None
                )
            am, klw = self._mask_args(keys.ks.shape[-1], num_prefix, attention_mask, key_log_weights)
            if isinstance(layer, StaticKeyValueLayer):
                # a static sliding layer knows the validity of the keys it returned (its whole ring in a decode step)
                am = layer.slot_mask
                if num_prefix:
                    am = torch.cat([am.new_ones(b, num_prefix), am], dim=1)
            out = self.attend_with_prefix(
                proj,
                prefix,
                keys,
                tau,
                causal=True,
                window=self.window,
                attention_mask=am,
                key_log_weights=klw,
                num_prefix_keys=num_prefix,
                **self._text_call_options(None, output_attentions),
            )
            if output_attentions:
                out, weights = out
                weights = self._weights_over_all_text_keys(weights, num_prefix, cache)
        if rows is not None:
            return self.o_proj(self._heads_to_rows(out, register_out)), None, weights
        return self.o_proj(self._merge_heads(out)), register_out_rows, weights

    def output_attentions_error(self, cache) -> str | None:
        """Weights need every key: a decode step through a filled sorted cache layer reads only a window of it."""
        layers = getattr(cache, "layers", None) or []
        layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
        return self._sorted_decode_weights_error(layer)

    def _sorted_decode_weights_error(self, layer) -> str | None:
        if isinstance(layer, SortedScalarCacheLayer) and layer.get_seq_length() > 0:
            return (
                f"output_attentions=True is not available with the sorted cache during decoding: layer "
                f"{self.layer_idx} ({self.kind!r}) reads its {layer.get_seq_length()} cached tokens through a "
                "SortedScalarCacheLayer, whose decode step sees only a window of the cached keys (decode_window; "
                "merged or evicted under max_cache_tokens), so there are no weights over all keys to return.  To get "
                "the attention weights run a forward without a cache (use_cache=False) over the whole sequence "
                "(prompt and generated tokens), or ask for them on the prompt forward into an empty cache"
            )
        return None

    def _attend_sorted(
        self,
        layer,
        proj,
        tau,
        prefix,
        num_prefix,
        attention_mask,
        key_log_weights,
        output_attentions=False,
        prefill=False,
    ):
        """The text call through a sorted cache layer; ``(out, weights)`` with ``output_attentions`` (the prompt
        only: see :meth:`output_attentions_error`), else ``out``.  ``prefill`` (``generate``'s prefill, possibly in
        chunks): exact attention for every chunk, like an unchunked prompt."""
        b, h, n = proj.qs.shape
        first = layer.get_seq_length() == 0
        if output_attentions and not first:
            raise ValueError(self._sorted_decode_weights_error(layer))
        valid = attention_mask[:, -n:].to(torch.bool) if attention_mask is not None else None
        log_weight = None
        if key_log_weights is not None:
            log_weight = key_log_weights[..., -n:]
            if log_weight.dim() == 2:
                log_weight = log_weight.unsqueeze(1)
            log_weight = log_weight.expand(b, h, n).to(proj.ks.dtype)
        # (with `proj.rotary` the insert applies the query's and key's RoPE in place: see `_defers_rope`)
        rotary = None if proj.rotary is None else (proj.q, *proj.rotary)
        layer.append(proj.ks, proj.v, proj.k, valid=valid, log_weight=log_weight, rotary=rotary)
        proj.rotary = None
        if first or prefill or layer.decode_window is None or layer.decode_window >= layer.num_slots:
            # the prompt, exact mode, or a window covering every cached key: the exact function (same numerics as a
            # forward without cache)
            out = self._exact_over_cache(layer, proj, tau, prefix, num_prefix, output_attentions)
        else:
            out = layer.attend(
                proj.qs,
                tau,
                num_new=n,
                q=proj.q,
                scale=self.decode_scale(),
                prefix_ks=None if prefix is None else prefix.ks,
                prefix_v=None if prefix is None else prefix.v,
                prefix_k=None if prefix is None else prefix.k,
            )
            if not self._all_scalar:
                # heads without a scalar term cannot be windowed: they read every cached key
                exact = self._exact_over_cache(layer, proj, tau, prefix, num_prefix)
                mask = ~self._scalar_head_mask(out.device).view(1, h, 1, 1)
                out = torch.where(mask, exact, out)
            self.last_backend = "sorted_window"
        layer.end_step(proj.qs, valid, tau=tau, q=proj.q, scale=self.decode_scale())
        return out

    def _attend_static_sorted(self, layer, proj, tau, prefix, num_prefix, attention_mask):
        """The text call through a fixed-capacity sorted layer (:mod:`hf_rbf.cache_sorted_static`): multi-token steps
        (prompt, prefill chunks) are exact over the cached tokens; a single-token step reads the window (exact when
        ``decode_window`` is None or covers the capacity).  No host synchronisation on the single-token path."""
        b, h, n = proj.qs.shape
        valid = attention_mask[:, -n:].to(torch.bool) if attention_mask is not None else None
        layer.append(proj.ks, proj.v, proj.k, valid=valid)
        if n > 1 or not layer.windowed:
            return self._exact_over_static(layer, proj, tau, prefix, num_prefix, n)
        out = layer.attend(
            proj.qs,
            tau,
            q=proj.q,
            scale=self.decode_scale(),
            prefix_ks=None if prefix is None else prefix.ks,
            prefix_v=None if prefix is None else prefix.v,
            prefix_k=None if prefix is None else prefix.k,
        )
        if not self._all_scalar:
            # heads without a scalar term cannot be windowed: they read every cached key
            exact = self._exact_over_static(layer, proj, tau, prefix, num_prefix, n)
            mask = ~self._scalar_head_mask(out.device).view(1, h, 1, 1)
            out = torch.where(mask, exact, out)
        if not torch.compiler.is_compiling():
            self.last_backend = "sorted_window"
        return out

    def _exact_over_static(self, layer, proj, tau, prefix, num_prefix, n):
        b = proj.qs.shape[0]
        # one query: every slot, masked; several (eager): the tokens in sequence order, causal
        ks, v, k, valid = layer.full_view() if n == 1 else layer.sequence_view(layer.get_seq_length())
        cached = _Projections(qs=None, ks=ks, v=v, k=k)
        am = torch.cat([valid.new_ones(b, num_prefix), valid], dim=1) if num_prefix else valid
        if n == 1 and self._decodes_directly(proj):
            return self._decode_directly(proj, prefix, cached, tau, am, num_prefix)
        return self.attend_with_prefix(
            proj, prefix, cached, tau, causal=True, attention_mask=am, num_prefix_keys=num_prefix
        )

    def _exact_over_cache(self, layer, proj, tau, prefix, num_prefix, output_attentions=False):
        # the key mask comes with the prefix's visible columns in front (a view of an all-True buffer while no slot
        # is padding or evicted: no allocation and `cat` per layer and decode step)
        direct = layer.log_weight is None and not output_attentions and self._decodes_directly(proj)
        # (the direct call takes no mask for keys known valid: not even the all-True view)
        ks, v, k, am, log_weight = layer.exact_view(num_prefix, all_valid_mask=not direct)
        cached = _Projections(qs=None, ks=ks, v=v, k=k)
        if direct:
            return self._decode_directly(proj, prefix, cached, tau, am, num_prefix)
        klw = None
        if log_weight is not None:
            klw = torch.cat([log_weight.new_zeros(*log_weight.shape[:-1], num_prefix), log_weight], dim=-1)
        return self.attend_with_prefix(
            proj,
            prefix,
            cached,
            tau,
            causal=True,
            attention_mask=am,
            key_log_weights=klw,
            num_prefix_keys=num_prefix,
            **self._text_call_options(None, output_attentions),
        )

    # -- cache plug points ---------------------------------------------------------------------------------------
    def make_cache_layer(self, settings: dict | None = None):
        """A sorted cache layer (full layers) or transformers' sliding layer (sliding layers, keys packed)."""
        settings = dict(self.cache_settings if settings is None else settings)
        limit, budget = settings.get("max_cache_tokens"), settings.get("max_cache_bytes")
        if self.window is not None:
            if budget is not None:
                return ByteBudgetSlidingWindowLayer(budget, window=self.window)
            return DynamicSlidingWindowLayer(
                sliding_window=self.window if limit is None else min(self.window, limit + 1)
            )
        if not any(self.scalar_head_list):
            settings["decode_window"] = None  # nothing to window with
        return SortedScalarCacheLayer(
            num_heads=self.num_heads,
            num_value_groups=self.num_value_groups,
            scalar_heads=self.scalar_head_list,
            **settings,
        )

    def accepts_cache_layer(self, layer) -> bool:
        if self.window is not None:
            return isinstance(layer, DynamicSlidingWindowLayer)
        return isinstance(layer, SortedScalarCacheLayer)

    def make_static_cache_layer(
        self,
        max_cache_len: int,
        settings: dict | None = None,
        block_size: int | None = None,
        batch_size: int | None = None,
    ):
        """A fixed-capacity layer: sorted blocks for full layers (:class:`StaticSortedLayer`), a ring of packed keys
        for sliding layers.  Eviction (``max_cache_tokens`` / ``max_cache_bytes`` of the config) is a dynamic-cache
        feature: refused here.  ``settings["static_decode_backend"]``, when given, picks the single-token step of the
        sorted layers (:class:`StaticSortedLayer`'s own default otherwise)."""
        settings = dict(self.cache_settings if settings is None else settings)
        for budget in ("max_cache_tokens", "max_cache_bytes"):
            if settings.get(budget) is not None:
                raise ValueError(
                    "cache_implementation='static' keeps every token (capacity = max_cache_len) and cannot evict: set "
                    f"`{budget}=None` or use the dynamic SortedScalarCache (got {budget}={settings[budget]}); to size "
                    "the static cache in bytes pass `max_cache_bytes` to `make_static_cache` (or in `cache_config`)"
                )
        if self.window is not None:
            return StaticKeyValueLayer(max_cache_len, sliding_window=self.window, share_key=self.kind)
        heads_per_group = self.num_heads // self.num_value_groups
        if settings["sort_scheme"] == "per_head":
            order_heads = list(range(self.num_heads))
        else:
            order_heads = [grp * heads_per_group + settings["sort_head"] for grp in range(self.num_value_groups)]
        # `generate(..., cache_config={"static_decode_backend": ...})` reaches the layers; absent: the layer's default
        backend = (
            {"static_decode_backend": settings["static_decode_backend"]} if "static_decode_backend" in settings else {}
        )
        return StaticSortedLayer(
            max_cache_len=max_cache_len,
            num_heads=self.num_heads,
            num_value_groups=self.num_value_groups,
            order_heads=order_heads,
            decode_window=settings["decode_window"] if any(self.scalar_head_list) else None,
            block_size=block_size,
            batch_size=batch_size,
            share_key=self.kind,  # layers of one kind hold their buffers stacked (one guarded tensor per kind)
            **backend,
        )

    @torch.no_grad()
    def attention_weights(
        self,
        x: torch.Tensor,
        register_x: torch.Tensor | None,
        position_embeddings,
        query_rows: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The exact attention weights of some text queries (for analysis: the attention functions never return
        them).  Full (non-sliding) layers, no cache.

        Args:
            x: the layer's normalised input ``[B, N, D]``; register_x: the registers' ``[1, R, D]`` or None.
            position_embeddings: the ``(cos, sin)`` the backbone passes to the layer.
            query_rows: ``[Q]`` int64 positions of the queries (each sees keys ``0 .. row``).
            attention_mask: ``[B, N]`` padding mask or None.

        Returns:
            ``(weights [B, H, Q, P + N] float32, qs [B, H, Q], ks [B, H, N], P)``: weights over the prefix (sink,
            registers) then the text keys, the queries' scalar queries and every text key's scalar key.
        """
        if self.window is not None:
            raise ValueError("attention_weights: sliding-window layers are not supported (full layers only)")
        f32 = torch.float32
        b, n, _ = x.shape
        proj = self.project(x, position_embeddings)
        tau = self.temperature(x).to(f32)
        register_keys = self.project_registers(register_x) if register_x is not None else None
        prefix, p = self._prefix(register_keys, x.dtype, x.device)
        keys = self._cat_keys([prefix, proj], b)
        qs = proj.qs[:, :, query_rows].to(f32)
        ks = keys.ks.to(f32)
        if tau.dim() == 1:
            tau_q = tau.view(1, -1, 1, 1)
        else:
            tau_q = tau[:, :, query_rows].unsqueeze(-1)
        scores = -((qs.unsqueeze(-1) - ks.unsqueeze(-2)) ** 2) / tau_q
        if self.has_vector_term:
            scale = self._scale(x.device)
            scale = scale.view(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else scale
            q = proj.q[:, :, query_rows].to(f32)
            scores = scores + scale * (q @ keys.k.to(f32).transpose(-1, -2))
        key_pos = torch.arange(p + n, device=x.device) - p
        allowed = (key_pos.view(1, -1) <= query_rows.view(-1, 1)).view(1, 1, len(query_rows), p + n)
        if attention_mask is not None:
            am = torch.cat([attention_mask.new_ones(b, p), attention_mask], 1).to(torch.bool)
            allowed = allowed & am.view(b, 1, 1, p + n)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return weights, qs, proj.ks.to(f32), p

    # -- regularizers --------------------------------------------------------------------------------------------
    def regularizer_terms(
        self,
        x: torch.Tensor,
        register_x: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None,
        position_embeddings,
        align: bool,
        spread: bool,
        tau: bool,
        spread_range,
        spread_adaptive_width: float,
        align_gradient: str = "upstream",
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(sum, count)`` of the requested regularizers for this layer (see :mod:`hf_rbf.scalar_regularizers`).

        ``x [B, N, D]`` is the layer's normalised input (with its graph), ``register_x [1, R, D]`` the registers',
        ``attention_mask [B, N]`` the padding mask (no cache: training forwards); ``align_gradient`` as
        :class:`~hf_rbf.ScalarSortConfig`."""
        terms = {}
        valid = attention_mask.to(torch.bool) if attention_mask is not None else None
        heads = self._scalar_head_mask(x.device)
        if align:
            if align_gradient not in ("upstream", "scalar_projections"):
                raise ValueError(
                    f"regularizer_terms: `align_gradient` must be 'upstream' or 'scalar_projections'; got "
                    f"{align_gradient!r}"
                )
            upstream = align_gradient == "upstream"
            terms["align"] = self._align_terms(x, register_x, valid, position_embeddings, heads, upstream)
        if spread:
            ks = self.scalar_qk(x)[1]
            terms["spread"] = spread_loss(
                ks, valid, value_range=spread_range, adaptive_width=spread_adaptive_width, head_mask=heads
            )
        if tau:
            terms["tau"] = tau_loss(self.temperature(x), valid, head_mask=heads)
        return terms

    def _align_terms(self, x, register_x, valid, position_embeddings, heads, upstream: bool):
        """``L_align`` of the layer; the weights are always detached.  ``upstream``: ``qs`` / ``ks`` are the layer's
        own (gradient reaches the scalar projections, the register offsets and, through ``x``, every module below);
        otherwise they are recomputed from the detached input, so only ``qs_proj`` / ``ks_proj`` receive gradient."""
        f32 = torch.float32
        b = x.shape[0]
        xd = x.detach()
        source = x if upstream else xd
        live = self.project(source, position_embeddings)
        tau = self.temperature(xd).detach().to(f32)
        register_keys = None
        if register_x is not None:
            rx = register_x if upstream else register_x.detach()
            register_keys = self.project_registers(rx, detach_offsets=not upstream)
        prefix, num_prefix = self._prefix(register_keys, x.dtype, x.device)
        keys = self._cat_keys([prefix, live], b)
        moments = align_moment_values(keys.ks.to(f32))
        detached_keys = _Projections(
            qs=None, ks=keys.ks.detach().to(f32), v=moments, k=None if keys.k is None else keys.k.detach().to(f32)
        )
        queries = _Projections(
            qs=live.qs.detach().to(f32), ks=None, v=None, q=None if live.q is None else live.q.detach().to(f32)
        )
        am, _ = self._mask_args(keys.ks.shape[-1] - num_prefix, num_prefix, valid, None)
        e = self.attention_function(
            queries, detached_keys, tau, causal=True, window=self.window, attention_mask=am, num_prefix_keys=num_prefix
        )
        return masked_sum(align_rows(live.qs.to(f32), e), valid, heads)


class ScalarSortPreTrainedModel(DecoderPreTrainedModel):
    """Base class of the scalar-sort family: its config class and its layer kinds ("scalar", "dot")."""

    config_class = ScalarSortConfig
    attention_classes = {"scalar": ScalarSortAttention, "dot": DotAttention}
    # PEFT LoRA ``target_modules`` covering every projection of the family (absent names are ignored by PEFT).
    lora_target_modules = (
        "qs_proj", "ks_proj", "v_proj", "o_proj", "tau_proj", "q_proj", "k_proj", "gate_proj", "up_proj", "down_proj",
    )  # fmt: skip


def cache_layer_for(attn: DecoderAttention, settings: dict):
    """The cache layer an attention module of a scalar-sort / hybrid-sort model needs under ``settings``: the
    family's own layers decide for themselves; "dot" layers get transformers' layers, bounded by
    ``max_cache_tokens`` (keeping the most recent tokens) when it is set."""
    if isinstance(attn, ScalarSortAttention):
        return attn.make_cache_layer(settings)
    limit, budget, window = settings.get("max_cache_tokens"), settings.get("max_cache_bytes"), attn.window
    if budget is not None:
        return ByteBudgetSlidingWindowLayer(budget, window=window)
    if limit is None:
        return attn.make_cache_layer()
    return DynamicSlidingWindowLayer(sliding_window=limit + 1 if window is None else min(window, limit + 1))


class SortedCacheModelMixin:
    """``make_cache`` / ``_prepare_cache_layers`` of the scalar-sort and hybrid-sort base models: they build a
    :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCache` and complete a user's cache layer by layer."""

    def make_cache(self, **settings) -> SortedScalarCache:
        """An empty ``SortedScalarCache`` with every layer built; ``settings`` override the config's cache fields."""
        cache = SortedScalarCache(**settings)
        self._prepare_cache_layers(cache)
        return cache

    def _static_cache_orders(self, settings: dict) -> int:
        """Sort orders per row of a full scalar layer's static cache (what its insert writes per token): one per head
        under ``"per_head"``, one per value group under ``"sort_head"``."""
        for layer in self.layers:
            attn = layer.self_attn
            if isinstance(attn, ScalarSortAttention):
                return attn.num_heads if settings["sort_scheme"] == "per_head" else attn.num_value_groups
        return 1

    def make_static_cache(
        self,
        max_cache_len: int | None = None,
        block_size: int | None = None,
        *,
        max_cache_bytes: int | None = None,
        batch_size: int | None = None,
        **settings,
    ) -> StaticDecoderCache:
        """An empty fixed-capacity cache (:mod:`hf_rbf.cache_sorted_static`); ``settings`` override the config's
        sorted-cache fields (e.g. ``decode_window``) and may pick ``static_decode_backend``; ``block_size`` is the
        length of the sorted blocks (None: :func:`~hf_rbf.cache_sorted_static.default_block_size` of the capacity and
        the window, which keeps long contexts on the fused decode step).

        ``max_cache_bytes`` sizes the cache in bytes instead: its capacity is the largest ``max_cache_len`` whose
        layers keep their per-token buffers within ``max_cache_bytes`` bytes per batch row each, for the model's
        dtype (:func:`~hf_rbf.cache_static.static_cache_len_for_bytes`); ``max_cache_len``, when given too (as
        ``generate`` does: prompt + new tokens), must fit in it.  A static cache never evicts, so this replaces the
        config's eviction budget (``max_cache_tokens`` / ``max_cache_bytes``)."""
        if max_cache_bytes is not None:
            if block_size is None:
                # the block length follows the capacity, which the budget bounds: the length the budget allows
                # unrounded, then that length's default block, to whose multiple the capacity is rounded down
                unrounded = static_cache_len_for_bytes(self.config, max_cache_bytes, self.dtype, block_size=1)
                chosen = override_cache_settings(self.config.sorted_cache_settings(), settings)
                block_size = default_block_size(
                    unrounded,
                    chosen.get("decode_window"),
                    batch_size=1 if batch_size is None else batch_size,
                    num_orders=self._static_cache_orders(chosen),
                    round_down=True,  # whole blocks inside the budget
                )
            capacity = static_cache_len_for_bytes(self.config, max_cache_bytes, self.dtype, block_size=block_size)
            if max_cache_len is not None and max_cache_len > capacity:
                raise ValueError(
                    f"make_static_cache: `max_cache_len` ({max_cache_len} tokens, e.g. prompt + max_new_tokens) does "
                    f"not fit in `max_cache_bytes` ({max_cache_bytes} bytes per layer and row = {capacity} tokens in "
                    f"{self.dtype}); raise `max_cache_bytes` or generate fewer tokens"
                )
            max_cache_len = capacity
            settings = dict(settings, max_cache_tokens=None, max_cache_bytes=None)
        elif max_cache_len is None:
            raise ValueError("make_static_cache: pass `max_cache_len` (tokens) or `max_cache_bytes` (bytes per layer)")
        resolved = override_cache_settings(self.config.sorted_cache_settings(), settings)
        layers = []
        for layer in self.layers:
            attn = layer.self_attn
            if isinstance(attn, ScalarSortAttention):
                layers.append(attn.make_static_cache_layer(max_cache_len, resolved, block_size, batch_size))
            else:
                layers.append(attn.make_static_cache_layer(max_cache_len))
        return StaticDecoderCache(layers, max_cache_len)

    def _prepare_cache_layers(self, cache) -> None:
        if isinstance(cache, StaticDecoderCache):
            return DecoderModel._prepare_cache_layers(self, cache)
        if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
            raise TypeError(
                "`cache` (`past_key_values`) must be a transformers Cache (a SortedScalarCache, e.g. from a previous forward or "
                f"`SortedScalarCache(...)`, or a DynamicCache); got {type(cache).__name__}"
            )
        settings = None
        for idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            if idx < len(cache.layers):
                existing = cache.layers[idx]
                if attn.accepts_cache_layer(existing):
                    continue
                if not (type(existing) is DynamicLayer and not existing.is_initialized):
                    raise TypeError(
                        f"`cache` (`past_key_values`) layer {idx} is a {type(existing).__name__}, which cannot serve a "
                        f"{attn.kind!r} attention layer; pass a SortedScalarCache (or a DynamicCache, completed with "
                        "sorted layers on the first forward)"
                    )
            if settings is None:
                if isinstance(cache, SortedScalarCache):
                    settings = cache.resolved_settings(self.config)
                else:
                    settings = self.config.sorted_cache_settings()
            new_layer = cache_layer_for(attn, settings)
            if idx < len(cache.layers):
                cache.layers[idx] = new_layer
            else:
                cache.layers.append(new_layer)


class ScalarSortModel(SortedCacheModelMixin, ScalarSortPreTrainedModel, DecoderModel):
    """The scalar-sort decoder without the LM head (``AutoModel``)."""


def _capture_layer_inputs(module, args, kwargs):
    """Forward pre-hook of every decoder layer: while the LM collects regularizer inputs, keep the layer's inputs
    (text and register states with their graphs, position embeddings, mask).  Outside any gradient checkpoint in
    transformers 5.23; inside it in 5.17, where the inputs are still the outer tensors."""
    store = getattr(module, "_hf_rbf_capture", None)
    if store is not None and not store:
        store.append((args, kwargs))


class RegularizedCausalLMMixin:
    """The causal-LM forward of the scalar-sort and hybrid-sort families: the language-modelling loss plus the
    gist's regularizers, each reported in :class:`ScalarSortCausalLMOutput`.

    With ``num_items_in_batch`` (``Trainer``'s gradient-accumulation normaliser), each regularizer is scaled by
    ``(label tokens in this batch) / num_items_in_batch``, like the summed cross-entropy, so accumulating micro-batches
    gives the token-weighted mean and the same gradients as one large batch.
    """

    # The optimizer step that drives the regularizer schedule (``*_loss_start_step``, ``*_loss_warmup_steps``): set by
    # HfRbfTrainer before every forward, or by ``set_regularizer_step`` in a loop of one's own.  The forward reads only
    # the weights at that step (``_step_weights``), never the step itself: under torch.compile a new step then costs
    # no recompilation unless a weight changes (every step of a warmup, once at a start step without warmup).
    regularizer_step: int | None = None
    _step_weights: dict[str, float] | None = None

    def set_regularizer_step(self, step: int | None) -> None:
        """Tell the model the current optimizer step (``Trainer``'s ``state.global_step``) for the regularizer
        schedule; ``None`` forgets it."""
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"set_regularizer_step: `step` must be an int >= 0 or None; got {step!r}")
        self.regularizer_step = step
        weights = None
        if step is not None:
            weights = {name: self.config.regularizer_weight(name, step) for name in ("align", "spread", "tau")}
        if weights != self._step_weights:
            self._step_weights = weights

    def regularizer_weights(self) -> dict[str, float]:
        """The weight of each regularizer at the current step (the config's weights times their schedule factors;
        the full weights when no step is known)."""
        if self._step_weights is not None:
            return dict(self._step_weights)
        return {name: self.config.regularizer_weight(name, None) for name in ("align", "spread", "tau")}

    def _register_capture_hooks(self) -> None:
        for layer in self.model.layers:
            # set from the start: the forward resets it to None afterwards, and under torch.compile an attribute that
            # appears after the first call is a guard failure (a recompile at the second step)
            layer._hf_rbf_capture = None
            layer.register_forward_pre_hook(_capture_layer_inputs, with_kwargs=True)

    @signature_once
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        key_log_weights: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> ScalarSortCausalLMOutput:
        r"""
        Args: those of :meth:`hf_rbf.DecoderForCausalLM.forward`.  With ``labels`` and a non-zero regularizer weight
        (and no filled cache), ``loss = lm_loss + align_loss_weight * L_align + spread_loss_weight * L_spread +
        tau_loss_weight * L_tau`` and the terms are returned in ``align_loss``, ``spread_loss``, ``tau_loss``.  Each
        weight follows its schedule at ``regularizer_step`` (see :meth:`regularizer_weights`); a term whose weight is 0
        at this step is not computed (its field is None).
        """
        cfg = self.config
        cache = resolve_cache_argument(cache, past_key_values)
        collect = labels is not None and cfg.regularizers_enabled and (cache is None or cache.get_seq_length() == 0)
        if collect and self.training and self._step_weights is None and cfg.regularizer_schedule_enabled:
            raise ValueError(
                f"{type(self).__name__}: the config schedules the regularizers (`*_loss_start_step` / "
                "`*_loss_warmup_steps`) but the model does not know the optimizer step: train with "
                "hf_rbf.trainer.HfRbfTrainer, or call `model.set_regularizer_step(step)` before each step of your own "
                "loop (in eval mode the full weights are used)"
            )
        weights = self.regularizer_weights() if collect else None
        collect = collect and any(w > 0 for w in weights.values())
        layers = self.model.layers
        if collect:
            for layer in layers:
                layer._hf_rbf_capture = []
        try:
            out = super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                key_log_weights=key_log_weights,
                output_hidden_states=output_hidden_states,
                output_attentions=output_attentions,
                return_dict=True,
                **kwargs,
            )
            captured = [layer._hf_rbf_capture[0] for layer in layers] if collect else None
        finally:
            # (only where this forward set them: without collecting every store stays None, as the last forward left
            # it, and the per-layer writes, `nn.Module.__setattr__` calls, cost host time at every decode step)
            if collect:
                for layer in layers:
                    layer._hf_rbf_capture = None

        result = ScalarSortCausalLMOutput(
            loss=out.loss,
            lm_loss=out.loss,
            logits=out.logits,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            **cache_field(output_cache(out)),
        )
        if collect:
            means = self._regularizer_means(captured, {name: w > 0 for name, w in weights.items()})
            scale = 1.0
            num_items = kwargs.get("num_items_in_batch")
            if num_items is not None:
                tokens = (labels[..., 1:] != -100).sum()
                scale = tokens.to(out.loss.dtype) / torch.as_tensor(num_items, device=out.loss.device).to(
                    out.loss.dtype
                )
            total = out.loss
            for name, value in means.items():
                total = total + weights[name] * scale * value.to(out.loss.dtype)
                setattr(result, f"{name}_loss", value.detach())
            result.loss = total
        if return_dict is False:
            return result.to_tuple()
        return result

    def _regularizer_means(self, captured, want: dict[str, bool]) -> dict[str, torch.Tensor]:
        """Per regularizer wanted, the mean over the scalar layers of the layer means."""
        cfg = self.config
        per_layer: dict[str, list[torch.Tensor]] = {name: [] for name, on in want.items() if on}
        for layer, inputs in zip(self.model.layers, captured):
            attn = layer.self_attn
            if not isinstance(attn, ScalarSortAttention) or not any(attn.scalar_head_list) or inputs is None:
                continue
            args, kwargs = inputs
            hidden = args[0] if args else kwargs["hidden_states"]
            registers = args[1] if len(args) > 1 else kwargs.get("register_states")
            x = layer.input_layernorm(hidden)
            rx = layer.input_layernorm.capped(registers) if registers is not None else None
            terms = attn.regularizer_terms(
                x,
                rx,
                attention_mask=kwargs.get("attention_mask"),
                position_embeddings=kwargs["position_embeddings"],
                spread_range=cfg.spread_range,
                spread_adaptive_width=cfg.spread_adaptive_width,
                align_gradient=cfg.align_gradient,
                **want,
            )
            for name, (total, count) in terms.items():
                per_layer[name].append(total / count.clamp_min(1))
        return {name: torch.stack(values).mean() for name, values in per_layer.items() if values}


class ScalarSortForCausalLM(RegularizedCausalLMMixin, ScalarSortPreTrainedModel, DecoderForCausalLM, GenerationMixin):
    """The scalar-sort decoder with its LM head (``AutoModelForCausalLM``); ``generate`` uses a
    :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCache`."""

    base_model_class = ScalarSortModel

    def __init__(self, config: ScalarSortConfig):
        super().__init__(config)
        self._register_capture_hooks()

    def make_cache(self, **settings) -> SortedScalarCache:
        """An empty ``SortedScalarCache`` for this model (``settings`` override the config's cache fields)."""
        return self.model.make_cache(**settings)

    def make_static_cache(self, max_cache_len: int | None = None, **settings) -> StaticDecoderCache:
        """An empty fixed-capacity cache (what ``generate(..., cache_implementation="static")`` builds): of
        ``max_cache_len`` tokens, or sized in bytes with ``max_cache_bytes``; see
        :meth:`~hf_rbf.modeling_scalar_sort.SortedCacheModelMixin.make_static_cache`."""
        return self.model.make_static_cache(max_cache_len, **settings)


# Remote code: save_pretrained writes these classes into config.json's auto_map and copies this file and its
# relative imports next to the weights.
ScalarSortConfig.register_for_auto_class()
ScalarSortModel.register_for_auto_class("AutoModel")
ScalarSortForCausalLM.register_for_auto_class("AutoModelForCausalLM")


__all__ = [
    "RegularizedCausalLMMixin",
    "ScalarSortAttention",
    "ScalarSortCausalLMOutput",
    "ScalarSortForCausalLM",
    "ScalarSortModel",
    "ScalarSortPreTrainedModel",
    "SortedCacheModelMixin",
    "cache_layer_for",
]
