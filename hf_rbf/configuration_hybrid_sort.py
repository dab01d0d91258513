"""Configuration of the hybrid scalar + dot-product decoder (``model_type="hybrid_sort"``)."""

from __future__ import annotations

from .configuration_decoder import check_choice
from .configuration_scalar_sort import ScalarSortConfig

HEAD_KINDS = ("hybrid", "scalar", "dot")
HYBRID_POSITION_TYPES = ("rope", "none")


class HybridSortConfig(ScalarSortConfig):
    r"""Configuration of :class:`~hf_rbf.HybridSortModel` / :class:`~hf_rbf.HybridSortForCausalLM`: a pre-norm decoder
    whose attention score is ``q.k / sqrt(d) - (qs - ks)^2 / tau`` per head (the gist's "Hybrid Scalar + Dot-Product
    Attention"): learned W_Q, W_K (RoPE on the vector part), scalar W_qs, W_ks, grouped values and W_O.  The scalar
    term keeps the cache sortable: a decode step takes the ``decode_window`` keys nearest in scalar space and computes
    the full score over them (the gist's six-step procedure).

    Takes every field of :class:`~hf_rbf.ScalarSortConfig` (temperature, sink, registers, regularizers, sorted-cache
    settings) plus:

    Args:
        head_kinds (`list[str]`, *optional*): the kind of each head of a "hybrid" layer, tiled over the heads like
            ``attention_layers`` over the layers: ``"hybrid"`` (both terms), ``"scalar"`` (the scalar term alone: a
            pure scalar sort head) or ``"dot"`` (the dot product alone: a plain softmax head, which reads every
            cached key at decode time).  Default: every head ``"hybrid"``.  Stored expanded.
        position_embedding_type (`str`, defaults to "rope"): rotary embeddings on the vector q and k (``"rope"``) or
            none (``"none"``); the scalar term never has positions.
        num_value_groups (`int`, *optional*): value groups; default ``H`` (one value head per head, as standard
            attention).

    Layer kinds (``attention_layers``): ``"hybrid"``, ``"scalar"`` (a scalar sort layer) and ``"dot"``.

    PEFT LoRA target modules: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``qs_proj``, ``ks_proj``, ``tau_proj``
    (per-token tau), ``gate_proj``, ``up_proj``, ``down_proj``.
    """

    model_type = "hybrid_sort"
    family_kind = "hybrid"
    allowed_layer_kinds = ("hybrid", "scalar", "dot")
    default_num_register_tokens = 0

    def __init__(self, head_kinds: list[str] | None = None, position_embedding_type: str = "rope", **kwargs):
        name = type(self).__name__
        heads = kwargs.get("num_attention_heads", 12)
        check_choice(name, "position_embedding_type", position_embedding_type, HYBRID_POSITION_TYPES)
        if head_kinds is None:
            head_kinds = ["hybrid"]
        if isinstance(head_kinds, str) or not isinstance(head_kinds, (list, tuple)) or not head_kinds:
            raise ValueError(
                f"{name}: `head_kinds` must be a non-empty list of head kinds from {list(HEAD_KINDS)}; got "
                f"{head_kinds!r}"
            )
        for kind in head_kinds:
            check_choice(name, "head_kinds[...]", kind, HEAD_KINDS)
        if isinstance(heads, int) and heads >= 1:
            if len(head_kinds) > heads:
                raise ValueError(
                    f"{name}: `head_kinds` has {len(head_kinds)} entries for {heads} heads (`num_attention_heads`)"
                )
            head_kinds = [head_kinds[i % len(head_kinds)] for i in range(heads)]
        self.head_kinds = list(head_kinds)
        self.position_embedding_type = position_embedding_type
        super().__init__(**kwargs)

    @staticmethod
    def _default_value_groups(heads: int) -> int:
        return heads

    @property
    def scalar_heads(self) -> list[bool]:
        """Per head: whether a "hybrid" layer's head has the scalar term (``"hybrid"`` or ``"scalar"``)."""
        return [kind != "dot" for kind in self.head_kinds]

    @property
    def dot_heads(self) -> list[bool]:
        """Per head: whether a "hybrid" layer's head has the dot-product term (``"hybrid"`` or ``"dot"``)."""
        return [kind != "scalar" for kind in self.head_kinds]


__all__ = ["HybridSortConfig"]
