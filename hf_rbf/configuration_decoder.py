"""The shared configuration of hf_rbf's pre-norm decoder backbone.

Every family config (:class:`~hf_rbf.RbfConfig`, :class:`~hf_rbf.GkaConfig`, ...) derives from
:class:`DecoderConfig`, which holds the fields the backbone needs, validates them at construction (every error names
the field and the allowed values) and writes the standard transformers ``layer_types`` from the window pattern.
"""

from __future__ import annotations

import math

from transformers import PreTrainedConfig


ATTENTION_BACKENDS = ("auto", "naive", "sdpa", "flex", "triton")
WINDOW_LETTERS = {"S": "sliding_attention", "L": "full_attention"}
LAYER_TYPES = tuple(WINDOW_LETTERS.values())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(config_name: str, name: str, value, *, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{config_name}: `{name}` must be an int >= {minimum}; got {value!r}")


def check_float(config_name: str, name: str, value, *, positive: bool = False, minimum: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and positive:
        ok = value > 0
    if ok and minimum is not None:
        ok = value >= minimum
    if not ok:
        what = "a positive finite float" if positive else "a finite float"
        if minimum is not None:
            what += f" >= {minimum}"
        raise ValueError(f"{config_name}: `{name}` must be {what}; got {value!r}")


def check_bool(config_name: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{config_name}: `{name}` must be True or False; got {value!r}")


def check_choice(config_name: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{config_name}: `{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")


class DecoderConfig(PreTrainedConfig):
    r"""Fields shared by every hf_rbf decoder (a pre-norm, RMSNorm + SwiGLU decoder with per-layer attention kinds).

    Not used on its own: each family subclasses it, sets ``model_type``, ``family_kind`` (the default layer kind) and
    ``allowed_layer_kinds``, and adds its own fields.

    Args:
        vocab_size (`int`, defaults to 32000): number of token ids.
        hidden_size (`int`, defaults to 768): model width ``D``.
        intermediate_size (`int`, defaults to 2048): SwiGLU hidden width.
        num_hidden_layers (`int`, defaults to 12): number of decoder layers.
        num_attention_heads (`int`, defaults to 12): heads per attention layer; must divide ``hidden_size``, and the
            head dim ``hidden_size // num_attention_heads`` must be even (RoPE / SuSiE pair dimensions).
        max_position_embeddings (`int`, defaults to 2048): the context length the model is meant for (positions are
            computed on the fly, so longer inputs run, untrained).
        rms_norm_eps (`float`, defaults to 1e-6): epsilon of every RMSNorm.
        initializer_range (`float`, defaults to 0.02): std of the normal init of linear and embedding weights.
        tie_word_embeddings (`bool`, defaults to True): share the LM head with the token embedding.
        attention_layers (`list[str]`, *optional*): the attention kind of each layer, from the family's
            ``allowed_layer_kinds`` (e.g. ``["gka", "gka", "gka", "dot"]``: the GKA paper's hybrid designs).  A list
            shorter than ``num_hidden_layers`` is tiled (layer ``i`` gets ``attention_layers[i % len]``); it is stored
            expanded.  Default: every layer is the family kind.
        window_pattern (`str`, *optional*): one letter per layer, tiled the same way: ``"S"`` = sliding window of
            ``sliding_window`` positions, ``"L"`` = full causal attention (nanochat's ``"SSSL"``).  Default: ``"S"``
            when ``sliding_window`` is set, ``"L"`` otherwise.
        sliding_window (`int`, *optional*): the window ``W`` of the ``"S"`` layers: a query at position ``t`` sees the
            keys ``t - W < s <= t`` (itself included), plus the register tokens.
        num_register_tokens (`int`): learnable, zero-initialised register tokens prepended inside the model (never
            visible in inputs, outputs, labels, positions or the cache); text tokens see them, they see only themselves.
        attention_backend (`str`, defaults to "auto"): the implementation of the family's attention function: one of
            "auto", "naive", "sdpa", "flex", "triton" (see :mod:`hf_rbf.attention_utils`).  "dot" layers run
            ``dot_attention`` with "naive" when this is "naive" and "sdpa" otherwise.  Each attention module records
            the backend that served its last call in ``module.last_backend``.
        rope_theta (`float`, defaults to 10000.0): base of the RoPE / SuSiE frequencies.
        attention_bias (`bool`, defaults to False): bias on the attention projections.
        qk_norm (`bool`, defaults to False): QK-norm on the "dot" layers (the RBF blog's postscript: the industry's
            answer to magnitude bullying, as in Gemma 2/3, OLMo 2, Qwen3, ViT-22B): q and k are RMS-normalised per head,
            with a learnable scale ``[head_dim]`` shared by the heads (``q_norm`` / ``k_norm``), after W_Q / W_K and
            before RoPE; the logit scale stays ``1 / sqrt(head_dim)``.  Register rows get the scale but not the
            normalisation (their zero-initialised states would sit where RMS norm is singular; see ``DecoderLayer``).
            Only "dot" layers have q/k projections to normalise; the distance kinds ignore it.
        mlp_bias (`bool`, defaults to False): bias on the SwiGLU projections.
        use_cache (`bool`, defaults to True): return a KV cache from evaluation forwards.
        pad_token_id, bos_token_id, eos_token_id (`int`, *optional*): special token ids.
        layer_types (`list[str]`, *optional*): the standard transformers field, ``"full_attention"`` or
            ``"sliding_attention"`` per layer.  Written from ``window_pattern``; when given (e.g. from a saved
            config.json) it must agree with it, or it defines the pattern when ``window_pattern`` is not given.
        head_dim (`int`, *optional*): always ``hidden_size // num_attention_heads``; accepted only to check a saved
            value.
    """

    model_type = ""
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # set by each family
    family_kind = ""
    allowed_layer_kinds = ()
    default_num_register_tokens = 0

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 768,
        intermediate_size: int = 2048,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        attention_layers: list[str] | None = None,
        window_pattern: str | None = None,
        sliding_window: int | None = None,
        num_register_tokens: int | None = None,
        attention_backend: str = "auto",
        rope_theta: float = 10000.0,
        attention_bias: bool = False,
        qk_norm: bool = False,
        mlp_bias: bool = False,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        layer_types: list[str] | None = None,
        head_dim: int | None = None,
        **kwargs,
    ):
        name = type(self).__name__
        check_int(name, "vocab_size", vocab_size, minimum=1)
        check_int(name, "hidden_size", hidden_size, minimum=1)
        check_int(name, "intermediate_size", intermediate_size, minimum=1)
        check_int(name, "num_hidden_layers", num_hidden_layers, minimum=1)
        check_int(name, "num_attention_heads", num_attention_heads, minimum=1)
        check_int(name, "max_position_embeddings", max_position_embeddings, minimum=1)
        if hidden_size % num_attention_heads != 0:
            raise ValueError(
                f"{name}: `num_attention_heads` ({num_attention_heads}) must divide `hidden_size` ({hidden_size})"
            )
        derived_head_dim = hidden_size // num_attention_heads
        if derived_head_dim % 2 != 0:
            raise ValueError(
                f"{name}: the head dim `hidden_size // num_attention_heads` = {derived_head_dim} must be even "
                "(RoPE and SuSiE act on pairs of dimensions)"
            )
        if head_dim is not None and head_dim != derived_head_dim:
            raise ValueError(
                f"{name}: `head_dim` is always `hidden_size // num_attention_heads` = {derived_head_dim}; "
                f"got {head_dim!r}"
            )
        check_float(name, "rms_norm_eps", rms_norm_eps, positive=True)
        check_float(name, "initializer_range", initializer_range, minimum=0.0)
        check_float(name, "rope_theta", rope_theta, positive=True)
        for flag, value in (
            ("tie_word_embeddings", tie_word_embeddings),
            ("attention_bias", attention_bias),
            ("qk_norm", qk_norm),
            ("mlp_bias", mlp_bias),
            ("use_cache", use_cache),
        ):
            check_bool(name, flag, value)
        check_choice(name, "attention_backend", attention_backend, ATTENTION_BACKENDS)
        if num_register_tokens is None:
            num_register_tokens = self.default_num_register_tokens
        check_int(name, "num_register_tokens", num_register_tokens, minimum=0)

        # attention kinds
        if attention_layers is None:
            attention_layers = [self.family_kind] * num_hidden_layers
        if isinstance(attention_layers, str) or not isinstance(attention_layers, (list, tuple)) or not attention_layers:
            raise ValueError(
                f"{name}: `attention_layers` must be a non-empty list of layer kinds from "
                f"{list(self.allowed_layer_kinds)}; got {attention_layers!r}"
            )
        for kind in attention_layers:
            if kind not in self.allowed_layer_kinds:
                raise ValueError(
                    f"{name}: unknown layer kind {kind!r} in `attention_layers`; allowed: "
                    f"{', '.join(repr(k) for k in self.allowed_layer_kinds)}"
                )
        if len(attention_layers) > num_hidden_layers:
            raise ValueError(
                f"{name}: `attention_layers` has {len(attention_layers)} entries for {num_hidden_layers} layers "
                "(`num_hidden_layers`); give one kind per layer or a shorter pattern to tile"
            )
        attention_layers = [attention_layers[i % len(attention_layers)] for i in range(num_hidden_layers)]

        # window pattern <-> layer_types
        if sliding_window is not None:
            check_int(name, "sliding_window", sliding_window, minimum=1)
        if layer_types is not None:
            if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_hidden_layers:
                raise ValueError(
                    f"{name}: `layer_types` must be a list of {num_hidden_layers} entries (`num_hidden_layers`) from "
                    f"{list(LAYER_TYPES)}; got {layer_types!r}"
                )
            for lt in layer_types:
                check_choice(name, "layer_types[...]", lt, LAYER_TYPES)
        if window_pattern is None:
            if layer_types is not None:
                window_pattern = "".join("S" if lt == "sliding_attention" else "L" for lt in layer_types)
            else:
                window_pattern = "S" if sliding_window is not None else "L"
        if not isinstance(window_pattern, str) or not window_pattern:
            raise ValueError(
                f"{name}: `window_pattern` must be a non-empty string of 'S' and 'L'; got {window_pattern!r}"
            )
        bad = sorted(set(window_pattern) - set(WINDOW_LETTERS))
        if bad:
            raise ValueError(
                f"{name}: `window_pattern` {window_pattern!r} has letters {bad}; allowed letters: 'S' (sliding window "
                "of `sliding_window` positions) and 'L' (full attention)"
            )
        derived_types = [WINDOW_LETTERS[window_pattern[i % len(window_pattern)]] for i in range(num_hidden_layers)]
        if "sliding_attention" in derived_types and sliding_window is None:
            raise ValueError(
                f"{name}: `window_pattern` {window_pattern!r} has 'S' layers, so `sliding_window` must be a "
                "positive int; "
                "got None"
            )
        if layer_types is not None and list(layer_types) != derived_types:
            raise ValueError(
                f"{name}: `layer_types` {list(layer_types)} disagrees with `window_pattern` {window_pattern!r} "
                f"(which gives {derived_types}); pass only one of them"
            )

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = derived_head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = float(rms_norm_eps)
        self.initializer_range = float(initializer_range)
        self.tie_word_embeddings = tie_word_embeddings
        self.attention_layers = list(attention_layers)
        self.window_pattern = window_pattern
        self.sliding_window = sliding_window
        self.layer_types = derived_types
        self.num_register_tokens = num_register_tokens
        self.attention_backend = attention_backend
        self.rope_theta = float(rope_theta)
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        self.mlp_bias = mlp_bias
        self.use_cache = use_cache
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        super().__init__(**kwargs)

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (``None`` = full causal attention)."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def layer_kind(self, layer_idx: int) -> str:
        """The attention kind of layer ``layer_idx`` (e.g. ``"gka"`` or ``"dot"``)."""
        return self.attention_layers[layer_idx]
