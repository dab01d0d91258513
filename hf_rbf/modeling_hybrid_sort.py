"""Hybrid scalar + dot-product decoder (``model_type="hybrid_sort"``): the shared backbone with
:class:`HybridSortAttention` layers (``q.k / sqrt(d) - (qs - ks)^2 / tau`` per head, with per-head kinds), optionally
mixed with scalar sort layers and "dot" layers, the sorted KV cache and the gist's regularizers.

A decode step with ``decode_window = k`` takes the ``k`` cached keys nearest to the query in scalar space, loads their
vector keys and values and computes the full score over them (the gist's six-step procedure); "dot" heads read every
cached key.

PEFT LoRA target modules: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``qs_proj``, ``ks_proj``, ``tau_proj``
(per-token tau), ``gate_proj``, ``up_proj``, ``down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin

from .attention_hybrid import OP as HYBRID_OP
from .attention_hybrid import hybrid_attention, hybrid_attention_triton
from .attention_utils import MaskArgs, note_backend_choice, per_head_param
from .cache_sorted_scalar import SortedScalarCache, SortedScalarCacheLayer
from .cache_static import StaticDecoderCache
from .configuration_hybrid_sort import HybridSortConfig
from .modeling_decoder import (
    DecoderForCausalLM,
    DecoderModel,
    DecoderPreTrainedModel,
    DotAttention,
    apply_rotary_pair,
    rotates_in_insert,
)
from .modeling_scalar_sort import (
    RegularizedCausalLMMixin,
    ScalarSortAttention,
    SortedCacheModelMixin,
    _Projections,
)


class HybridSortAttention(ScalarSortAttention):
    """Hybrid attention: ``q_proj``, ``k_proj`` (vector, RoPE), ``qs_proj``, ``ks_proj`` (scalar), ``v_proj``
    (``G`` groups), ``o_proj``, the temperature, the sink and the registers (vector offsets ``register_position``,
    scalar offsets ``register_scalar_position``).

    Per-head kinds (``config.head_kinds``): "hybrid" heads use both terms, "scalar" heads have a dot-product scale of
    0, "dot" heads have their scalar query and key multiplied by 0 (so the whole layer is one ``hybrid_attention``
    call).  The sink's vector key is zero (its score is the scalar term alone).
    """

    kind = "hybrid"
    has_vector_term = True

    def __init__(self, config: HybridSortConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, hd = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.use_rope = config.position_embedding_type == "rope"
        self.head_kinds = list(config.head_kinds)
        self._scalar_head_flags = [kind != "dot" for kind in self.head_kinds]
        self._dot_heads = [kind != "scalar" for kind in self.head_kinds]
        # what the forward asks of the per-head kinds, as three bools fixed here: `all(self._dot_heads)` read in the
        # forward made a compiled decode step guard on every element of both lists (2 * (heads + 2) guards per layer,
        # 336 at 12 layers of 12 heads, checked before every step); a bool attribute is one guard
        self._all_dot = all(self._dot_heads)
        self._no_dot = not any(self._dot_heads)
        self._all_scalar = all(self._scalar_head_flags)

    @property
    def scalar_head_list(self) -> list[bool]:
        return list(self._scalar_head_flags)

    def _scale(self, device):
        """``1 / sqrt(head_dim)`` for heads with the dot term, 0 for pure scalar heads (float when uniform)."""
        base = self.head_dim**-0.5
        if self._all_dot:
            return base
        if self._no_dot:
            return 0.0
        return self._head_constant("scale", [base if dot else 0.0 for dot in self._dot_heads], torch.float32, device)

    def decode_scale(self):
        # (the device only where the heads' scales differ: `_scale` returns a float otherwise, and the parameter read
        # costs two `nn.Module.__getattr__` calls, twice per layer and decode step)
        uniform = self._all_dot or self._no_dot
        scale = self._scale(None if uniform else self.q_proj.weight.device)
        return None if isinstance(scale, float) and scale == 0.0 else scale

    def _scalar_heads(self, qs: torch.Tensor, ks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qs, ks = super()._scalar_heads(qs, ks)
        if not self._all_scalar:
            mask = self._scalar_head_mask(qs.device).view(1, -1, 1).to(qs.dtype)
            qs, ks = qs * mask, ks * mask
        return qs, ks

    def _input_projections(self) -> tuple[nn.Linear, ...]:
        return (*super()._input_projections(), self.q_proj, self.k_proj)

    def _projections_of(self, outputs: tuple[torch.Tensor, ...]) -> _Projections:
        proj = super()._projections_of(outputs[:3])
        proj.q, proj.k = self._split_heads(outputs[3]), self._split_heads(outputs[4])
        return proj

    def _text_positions(self, proj: _Projections, position_embeddings, defer_rope: bool = False) -> _Projections:
        if self.use_rope:
            cos, sin = position_embeddings
            if defer_rope:  # (the insert rotates q and k in place: `_defers_rope`)
                proj.rotary = (cos, sin)
            else:
                proj.q, proj.k = apply_rotary_pair(proj.q, proj.k, cos, sin)
        return proj

    def _defers_rope(self, layer, x: torch.Tensor) -> bool:
        """RoPE inside the sorted cache's insert (``modeling_decoder.rope_in_insert``): for one new row per batch
        element into a filled ``SortedScalarCacheLayer`` whose one-token insert takes the fused launch, eager and
        without gradients.  Where the insert then finds a reason not to fuse (key weights, a dtype), it rotates with
        torch ops first: the result is the same either way."""
        return (
            self.use_rope
            and x.shape[1] == 1
            and isinstance(layer, SortedScalarCacheLayer)
            and layer.is_initialized
            and rotates_in_insert()
            and layer.appends_fused_on(x.device)
        )

    def _register_offsets(self, proj: _Projections, detach_offsets: bool = False) -> _Projections:
        out = super()._register_offsets(proj, detach_offsets)
        # the projections' dtype, not the residual stream's: under autocast they differ (bf16 vs float32)
        position = self.register_position.to(proj.q.dtype)
        if detach_offsets:
            position = position.detach()
        out.q, out.k = proj.q + position, proj.k + position
        return out

    def pair_scores(self, queries: _Projections, keys: _Projections, tau, ct: torch.dtype) -> torch.Tensor:
        """The scalar scores plus the dot term ``scale_h q.k`` (0 for pure scalar heads; the sink's vector key is
        zero), each ``[1, H, 1]``."""
        scores = super().pair_scores(queries, keys, tau, ct)
        scale = self._scale(queries.qs.device)
        if isinstance(scale, float) and scale == 0.0:
            return scores
        dot = (queries.q.to(ct) * keys.k.to(ct)).sum(-1)
        scale = scale if isinstance(scale, float) else scale.to(ct).view(1, -1, 1)
        return scores + scale * dot

    def _fused_head_dims(self) -> tuple:
        """The head dims ``hybrid_triton_reason`` checks."""
        return (("head dim D", self.head_dim), ("value dim Dv", self.value_head_dim))

    def _fused_decode(self, proj: _Projections, keys: _Projections, prefix, tau, mask: MaskArgs) -> torch.Tensor:
        """``hybrid_attention``'s triton call for :meth:`_decode_directly` (``tau`` and ``scale`` normalised as it
        does)."""
        device = proj.qs.device
        note_backend_choice(HYBRID_OP, "triton", device, self.backend)
        tau = self._query_tau(HYBRID_OP, tau, proj.qs)
        scale = self._scale(device)
        if not (isinstance(scale, float) and scale == 0):
            scale = per_head_param(HYBRID_OP, "scale", scale, self.num_heads, device)
        return hybrid_attention_triton(
            proj.q,
            keys.k,
            keys.v,
            proj.qs,
            keys.ks,
            tau,
            scale,
            mask,
            prefix=None if prefix is None else (prefix.k, prefix.v),
        )

    def attention_function(
        self,
        queries: _Projections,
        keys: _Projections,
        tau,
        backend: str | None = None,
        prefix: _Projections | None = None,
        **mask_args,
    ) -> torch.Tensor:
        """The layer's exact attention over ``keys`` (``hybrid_attention``); returns ``[B, H, Nq, Dv]``.

        ``backend`` overrides ``config.attention_backend`` (the register rows use ``register_backend``); ``prefix``:
        vector keys and values in front of ``keys`` (see :meth:`attend_with_prefix`).
        """
        out = hybrid_attention(
            queries.q,
            keys.k,
            keys.v,
            queries.qs,
            keys.ks,
            tau,
            scale=self._scale(queries.qs.device),
            backend=self.backend if backend is None else backend,
            prefix_keys=None if prefix is None else prefix.k,
            prefix_values=None if prefix is None else prefix.v,
            **mask_args,
        )
        self._note_backend("hybrid_attention")
        return out


class HybridSortPreTrainedModel(DecoderPreTrainedModel):
    """Base class of the hybrid-sort family: its config class and its layer kinds ("hybrid", "scalar", "dot")."""

    config_class = HybridSortConfig
    attention_classes = {"hybrid": HybridSortAttention, "scalar": ScalarSortAttention, "dot": DotAttention}
    # PEFT LoRA ``target_modules`` covering every projection of the family (absent names are ignored by PEFT).
    lora_target_modules = (
        "q_proj", "k_proj", "v_proj", "o_proj", "qs_proj", "ks_proj", "tau_proj", "gate_proj", "up_proj", "down_proj",
    )  # fmt: skip


class HybridSortModel(SortedCacheModelMixin, HybridSortPreTrainedModel, DecoderModel):
    """The hybrid-sort decoder without the LM head (``AutoModel``)."""


class HybridSortForCausalLM(RegularizedCausalLMMixin, HybridSortPreTrainedModel, DecoderForCausalLM, GenerationMixin):
    """The hybrid-sort decoder with its LM head (``AutoModelForCausalLM``); ``generate`` uses a
    :class:`~hf_rbf.cache_sorted_scalar.SortedScalarCache`."""

    base_model_class = HybridSortModel

    def __init__(self, config: HybridSortConfig):
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
HybridSortConfig.register_for_auto_class()
HybridSortModel.register_for_auto_class("AutoModel")
HybridSortForCausalLM.register_for_auto_class("AutoModelForCausalLM")


__all__ = ["HybridSortAttention", "HybridSortForCausalLM", "HybridSortModel", "HybridSortPreTrainedModel"]
