"""The shared pre-norm decoder backbone of every hf_rbf model family.

token embedding -> N x DecoderLayer [RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual]
-> RMSNorm -> LM head

* Each layer's attention class comes from the config (``attention_layers``: one kind per layer) through the family's
  ``attention_classes`` table, so one model can mix kinds (GKA layers with "dot" layers) and windows (``"SSSL"``).
* Register tokens (``num_register_tokens = R``) are R extra rows of batch 1 that run through every layer with the
  text (one flat ``[B * N + R, D]`` buffer, see ``DecoderLayer``): register rows attend only to registers
  (causally), text rows see the R registers as a prefix (``num_prefix_keys=R``) plus their causal / windowed text.  They depend on the parameters alone, so every forward
  recomputes them (batch 1, R rows) and they are never stored in the KV cache: cache lengths, positions,
  ``attention_mask`` and outputs only ever count text tokens.
* The KV cache is a transformers ``DynamicCache`` whose layers each attention module builds
  (:meth:`DecoderAttention.make_cache_layer`): RBF / dot layers store positioned keys and values, GKA layers store
  each token's feature once; sliding-window layers use transformers' sliding cache layer.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .attention_dot import dot_attention
from .attention_utils import last_backend, parameter_values_keepable
from .cache_names import CACHE_NAME, cache_field, generation_cache, output_cache, resolve_cache_argument
from .cache_static import StaticDecoderCache, StaticKeyValueLayer, static_cache_len_for_bytes
from .configuration_decoder import DecoderConfig
from .kernels_common import pin_triton_cache_dir
from .kernels_rotary import rotary_fused, rotary_reason
from .modeling_register_graph import copies_parameters, graphed_register_step

logger = logging.getLogger("hf_rbf")


# ----------------------------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------------------------


def signature_once(fn):
    """Keep ``fn``'s signature on it (``__signature__``, which ``inspect.signature`` returns as it is).

    For a model registered for the auto classes (``is_remote_code()``: every hf_rbf model) transformers' ``generate``
    reads ``inspect.signature(self.forward)`` in ``prepare_inputs_for_generation`` at every decode step, about 40 us of
    host time per token on this project's CPU (7 us with the signature kept); Llama does not pay it."""
    fn.__signature__ = inspect.signature(fn)
    return fn


def _autocast_off(device_type: str):
    """A context with autocast disabled on ``device_type`` when it is on there (else a no-op context)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()


class DecoderRMSNorm(nn.Module):
    """RMSNorm with a learnable scale (computed in float32, as Llama)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, num_register_rows: int = 0) -> torch.Tensor:
        """``num_register_rows``: the last rows of a flat ``[rows, D]`` input (the register rows, see ``DecoderLayer``)
        get :meth:`capped`'s normalisation instead.

        A float32 input and weight (the residual stream of autocast training) go through ``F.rms_norm``: one fused
        kernel forward and one backward on CUDA, where the chain below (power, mean, add, rsqrt, two products) costs 6
        elementwise kernels forward and about 10 backward over the whole ``[tokens, D]`` float32 tensor, in every norm
        of every layer.  Other dtypes compute the chain's values, which are Llama's to the last bit (float32 math, the
        scale applied after the cast back: what the Llama conversion's exactness relies on).

        A bfloat16 / float16 input (FSDP2's mixed precision: bf16 weights and a bf16 residual stream, as accelerate's
        ``MixedPrecisionPolicy`` casts every layer's inputs) goes through one ``F.rms_norm`` without a weight and
        then the scale, as the chain: the same bits on the CPU, one fused kernel forward and one backward on CUDA,
        where the chain's casts, power, mean, rsqrt and products cost about 8 forward and 10 backward, which FSDP2
        added to every norm of every layer (issue 17, benchmarks/results/cpu-fsdp2-ops)."""
        shape, eps = (hidden_states.shape[-1],), self.variance_epsilon
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if not num_register_rows:
                return F.rms_norm(hidden_states, shape, self.weight, eps)
            if torch.compiler.is_compiling():
                return self.weight * self._rows_with_registers(hidden_states, num_register_rows)
            # one split and one cat (their backwards are a cat and views): no slice, whose backward zero-fills a
            # full-size gradient
            text, registers = hidden_states.split([hidden_states.shape[0] - num_register_rows, num_register_rows])
            return torch.cat([F.rms_norm(text, shape, self.weight, eps), self.capped(registers)])
        input_dtype = hidden_states.dtype
        if input_dtype in (torch.bfloat16, torch.float16):
            # Outside autocast: CUDA's autocast runs rms_norm in float32 (a cast of the input before the fused kernel
            # and of its output after, both ways, where the kernel does float32 math on the half input itself), and
            # autocast's cat refuses a float16 pair under bfloat16 autocast.  One product with the weight over all
            # rows, as the chain: the weight's gradient sums in the same order.
            with _autocast_off(hidden_states.device.type):
                if not num_register_rows:
                    rows = F.rms_norm(hidden_states, shape, eps=eps)
                else:
                    text, registers = hidden_states.split(
                        [hidden_states.shape[0] - num_register_rows, num_register_rows]
                    )
                    rows = torch.cat([F.rms_norm(text, shape, eps=eps), self._capped_rows(registers)])
            return self.weight * rows
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        if num_register_rows:
            text_var, register_var = variance.split([variance.shape[0] - num_register_rows, num_register_rows])
            variance = torch.cat([text_var + self.variance_epsilon, register_var.clamp(min=1.0)])
        else:
            variance = variance + self.variance_epsilon
        hidden_states = hidden_states * torch.rsqrt(variance)
        return self.weight * hidden_states.to(input_dtype)

    def _rows_with_registers(self, hidden_states: torch.Tensor, num_register_rows: int) -> torch.Tensor:
        """The float32 forward's normalised rows (before the scale) as one elementwise expression over all rows, a
        row mask choosing each row's variance term: what a traced model runs.

        Inductor's partitioner recomputes elementwise ops in the backward instead of keeping their results.  The
        eager form (a split, ``F.rms_norm`` of the text rows, the capped register rows, a cat) made a compiled step
        keep, per norm, the text rows' normalised values as a float32 ``[tokens, D]`` buffer *and*, through the
        register rows (a view), the whole input: 48 MiB more per norm, 1.15 GiB of a d768 L12 B16 T1024 step on an
        H200 (benchmarks/results/h200-2026-11-29c, ``probe_compiled_memory.py``).  This form keeps the input, a float
        per row and the mask, as Llama's RMSNorm does; the values are the chain's."""
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        rows = hidden_states.shape[0]
        is_register = torch.arange(rows, device=hidden_states.device).unsqueeze(-1) >= rows - num_register_rows
        variance = torch.where(is_register, variance.clamp(min=1.0), variance + self.variance_epsilon)
        return hidden_states * torch.rsqrt(variance)

    def capped(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The register rows' norm (see ``DecoderLayer``): rows whose RMS exceeds 1 are scaled to RMS 1, smaller ones
        pass unchanged, then the learnable scale.  Identity near zero, where the registers start (RMS norm is singular
        there), and bounded like RMS norm for large states (unnormalised, the register stream grew doubly
        exponentially with depth through the SwiGLU MLPs: a 16-layer model's reached 1e19 and gave NaN gradients)."""
        return self.weight * self._capped_rows(hidden_states)

    @staticmethod
    def _capped_rows(hidden_states: torch.Tensor) -> torch.Tensor:
        """:meth:`capped` without the learnable scale (float32 math, input dtype out)."""
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp(min=1.0))
        return x.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free RMS norm over the last dimension (float32 math, input dtype out): ``F.rms_norm``, one fused
    kernel on CUDA (the chain of casts, powers and means it replaces was 6 kernels forward and 10 backward)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def _plain_linear(m: nn.Module, like: nn.Linear) -> bool:
    """An ``nn.Linear`` itself (not a subclass: PEFT's LoRA layers, quantised linears) whose forward nothing wraps or
    hooks (accelerate's offloading replaces ``forward``), with ``like``'s weight dtype and device."""
    return (
        type(m) is nn.Linear
        and "forward" not in m.__dict__
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and m.weight.dtype == like.weight.dtype
        and m.weight.device == like.weight.device
    )


def _param(m: nn.Module, name: str):
    """``getattr(m, name)`` for a parameter, read from ``_parameters`` without ``nn.Module.__getattr__``'s Python
    fallback (eager mode only: what Dynamo traces keeps plain attribute reads)."""
    params = m.__dict__["_parameters"]
    return params[name] if name in params else getattr(m, name)


def _plain_linear_eager(m: nn.Module, like: nn.Linear) -> bool:
    """:func:`_plain_linear` outside ``torch.compile``, read from the instance dict: it runs for every projection of
    every layer at every decode step, where ``nn.Module.__getattr__`` (a Python call per attribute read) cost more
    than the check itself."""
    if type(m) is not nn.Linear:
        return False
    attrs = m.__dict__
    if "forward" in attrs or attrs["_forward_hooks"] or attrs["_forward_pre_hooks"]:
        return False
    weight, ref = _param(m, "weight"), _param(like, "weight")
    return weight.dtype == ref.dtype and weight.device == ref.device


# `project_together` calls the modules one by one (no weight `cat`) on inputs of at most this many rows in eval mode:
# decode steps (one row per sequence), where the GEMMs are weight-bandwidth bound.
SEPARATE_PROJECTION_MAX_ROWS = 64


def _few_rows_in_eval(x: torch.Tensor, linears) -> bool:
    """Whether the modules are in eval mode and ``x`` has at most ``SEPARATE_PROJECTION_MAX_ROWS`` rows (a static
    count: a symbolic one keeps the single GEMM, no guard on it).  The mode, not the grad mode, decides: a forward
    and its gradient-checkpointing recompute (train mode, one without and one with gradients) must take the same
    path to get the same values, and so must an eval forward with and without ``torch.no_grad``."""
    if linears[0].training:
        return False
    rows = 1
    for d in x.shape[:-1]:
        if not isinstance(d, int):
            return False
        rows *= d
    return rows <= SEPARATE_PROJECTION_MAX_ROWS


# While torch.compile traces a decode step (`_few_rows_in_eval`), projections with at most this many outputs (hidden ->
# heads: the scalar queries and keys, a per-token temperature) are computed together as one multiply-and-sum that
# Inductor turns into a single reduction kernel, instead of a GEMM each.
SMALL_PROJECTION_MAX_OUT = 64


def _small_projections(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, m.weight, m.bias) for m in linears)`` as one multiply-and-sum over the modules'
    concatenated weights, accumulated in float32 like the GEMMs (float64 for float64), in ``F.linear``'s dtype (the
    autocast dtype under autocast).  For torch.compile only (:func:`project_together`'s decode-step branch): Inductor fuses the weights'
    ``cat`` into the loads of one reduction kernel.

    Why: cuBLAS runs a ``hidden -> heads`` GEMM of one row as a gemv of two kernels (``dot_kernel`` and
    ``reduce_1Block_kernel``); in the static-cache decode step of a d768 L12 scalar_sort model on an H200 the two
    scalar projections of each layer took 82 us of the 663 us of GPU time per token, about 3.4 us per projection
    (benchmarks/results/h200x2-2026-11-28f/README.md, call 1)."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    acc = torch.promote_types(dtype, torch.float32)  # float64 stays float64
    weight = torch.cat([m.weight for m in linears]).to(dtype)
    out = (x.to(dtype).unsqueeze(-2).to(acc) * weight.to(acc)).sum(-1)
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears])
        out = out + bias.to(dtype).to(acc)
    return out.to(dtype).split([m.out_features for m in linears], dim=-1)


# Concatenated projection weights for the eager decode steps of one generation.  A batch-1 decode step on a GPU is
# bound by the host, and there `project_together`'s one-by-one branch (below) costs a `F.linear` per projection: five
# per hybrid_sort layer (q, k, v, scalar q, scalar k), three per scalar_sort layer, each 25-35 us of host time on an
# H200 host (benchmarks/results/h200-2026-11-29f), and the scalar ones run as cuBLAS gemv (two kernels each).  With a
# copy of the concatenated weights kept for the generation, a step takes one `F.linear` per layer for all of them.
#   "auto"  on CUDA ("on"), not elsewhere (on a CPU the host is not the bottleneck, and the separate GEMMs keep the
#           values of the uncached forward of the same rows);
#   "on"    wherever a forward runs with a cache, without gradients, outside torch.compile (which fuses the projections
#           itself);
#   "off"   never.
# The copies live on the model (`DecoderModel.projection_copies`, one per layer's projection set: memory bounded by
# one copy of the weights, whatever the number of caches alive) and are dropped at the start and the end of every
# `generate` (`DecoderForCausalLM._prefill`, `.generate`) and by `model.train()`; a decode loop by hand keeps them.
# A copy is also rebuilt whenever a weight's storage or version changes (an optimiser step, a `load_state_dict`,
# `.to()`); writes through `.data` bump no version, so weights changed that way in the middle of a generation are
# seen from the next one on (the register steps' memo has the same rule).  Memory: the attention projections'
# weights once more after a generation's first decode step (d768 hybrid_sort / rbf: 3.6 MB per layer, a fifth of the
# model's weights; scalar_sort 1.2 MB); SwiGLU's gate and up keep their two GEMMs, as Llama's do.  None are kept where
# `attention_utils.parameter_values_keepable` says no: in a process with torch.distributed initialised (FSDP2 writes
# each forward's gathered weights into the same tensors, versions unchanged), while a CUDA graph is captured, off the
# default stream.
DECODE_PROJECTION_COPIES = ("auto", "on", "off")
decode_projection_copies = os.environ.get("HF_RBF_DECODE_PROJECTION_COPIES", "auto")
# the copies of the forward running now (see `decode_projection_copies`), None outside such a forward
_PROJECTION_COPIES: dict | None = None

# Whether the sorted families' exact single-row decode steps call the fused decode backend directly.  A dynamic-cache
# decode step is bound by the host; on an H200 host the public attention function's validation, dispatch and
# wrappers between a layer and its decode kernel took about 150 us per layer and step (hybrid_sort d768: 1.8 of
# 12.4 ms per token; benchmarks/decode_step_sections.py, benchmarks/results/h200-2026-11-29g).  A layer builds
# those arguments itself, consistent by construction, so in an eager forward without gradients or autocast, one query
# row, no key log-weights and no weights to return, where the public function would choose "triton" (the layer's
# backend "triton", or "auto" on CUDA: the fused split-K decode kernel serves every decode step there), the layer
# calls the backend function with the normalised arguments the public function would have passed it: the same
# kernel, the same result.
#   "on"   (default) as above;
#   "off"  every call through the public function (``HF_RBF_DIRECT_DECODE_CALLS=off``; for an A/B).
DIRECT_DECODE_CALLS = ("on", "off")
direct_decode_calls = os.environ.get("HF_RBF_DIRECT_DECODE_CALLS", "on")


def decodes_directly(backend: str, x: torch.Tensor) -> bool:
    """Whether a layer whose attention backend is ``backend`` may call the fused decode backend directly for a query
    row ``x`` (see ``direct_decode_calls``; the layer still checks that triton serves its dtype and head dims)."""
    if direct_decode_calls not in DIRECT_DECODE_CALLS:
        raise ValueError(
            f"hf_rbf.modeling_decoder.direct_decode_calls must be one of {DIRECT_DECODE_CALLS}; got "
            f"{direct_decode_calls!r} (set in code or through the HF_RBF_DIRECT_DECODE_CALLS environment variable)"
        )
    if direct_decode_calls == "off" or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    device_type = x.device.type
    if backend != "triton" and not (backend == "auto" and device_type == "cuda"):
        return False
    return not torch.is_autocast_enabled(device_type)


# Whether a hybrid layer with RoPE rotates a decode step's new query and key inside the sorted cache's one-launch
# insert (``kernels_cache_append``) instead of in a RoPE launch of its own.  A dynamic-cache decode step is bound by
# the host; the RoPE launch, its output allocations and stride checks were most of the 110 us per layer by which
# hybrid_sort's projections cost more than scalar_sort's on an H200 host (benchmarks/results/h200-2026-11-29g).  It
# applies to one-token steps into a filled ``SortedScalarCacheLayer`` whose insert takes the fused launch
# (``appends_fused_on``), eager, without gradients, where ``rotary_backend`` is not "torch"; the rotation is the
# fused RoPE kernel's (float32, rounded once).
#   "on"   (default) as above;
#   "off"  RoPE in the layer's projections at every step (``HF_RBF_ROPE_IN_INSERT=off``; for an A/B).
ROPE_IN_INSERT = ("on", "off")
rope_in_insert = os.environ.get("HF_RBF_ROPE_IN_INSERT", "on")


def rotates_in_insert() -> bool:
    """Whether a decode step's RoPE may go into the sorted cache's insert now (see ``rope_in_insert``; the layer
    still checks its cache layer)."""
    if rope_in_insert not in ROPE_IN_INSERT:
        raise ValueError(
            f"hf_rbf.modeling_decoder.rope_in_insert must be one of {ROPE_IN_INSERT}; got {rope_in_insert!r} (set in "
            "code or through the HF_RBF_ROPE_IN_INSERT environment variable)"
        )
    if rope_in_insert == "off" or rotary_backend == "torch":
        return False
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling())


def projection_copies_for(model: nn.Module, cache, device: torch.device) -> dict | None:
    """``model``'s dict of concatenated projection weights for an eager forward with ``cache`` and without gradients
    on ``device`` (see ``decode_projection_copies``), or None where the forward keeps none."""
    if decode_projection_copies not in DECODE_PROJECTION_COPIES:
        raise ValueError(
            f"hf_rbf.modeling_decoder.decode_projection_copies must be one of {DECODE_PROJECTION_COPIES}; got "
            f"{decode_projection_copies!r} (set in code or through the HF_RBF_DECODE_PROJECTION_COPIES environment "
            "variable)"
        )
    if cache is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if decode_projection_copies == "off" or (decode_projection_copies == "auto" and device.type != "cuda"):
        return None
    if not parameter_values_keepable(device):  # torch.distributed (FSDP2 rewrites weights in place), a CUDA graph
        return None
    return model.projection_copies


def drop_projection_copies(model: nn.Module) -> None:
    """Free the concatenated projection weights every ``DecoderModel`` inside ``model`` keeps."""
    for module in model.modules():
        copies = module.__dict__.get("projection_copies")
        if copies:
            copies.clear()


def _kept_concatenation(copies: dict, linears) -> tuple:
    """``(weight, bias or None, split sizes)`` of ``linears`` concatenated, from ``copies`` while every weight and
    bias has the storage and version it had when the copy was made, else made again."""
    params = [(_param(m, "weight"), _param(m, "bias")) for m in linears]
    state = tuple(
        (w.data_ptr(), w._version) + (() if b is None else (b.data_ptr(), b._version)) for w, b in params
    )
    key = tuple(id(m) for m in linears)
    kept = copies.get(key)
    if kept is None or kept[0] != state:
        weight = torch.cat([w for w, _ in params])
        bias = None
        if any(b is not None for _, b in params):
            bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in params])
        kept = copies[key] = (state, weight, bias, [w.shape[0] for w, _ in params])
    return kept[1:]


def project_together(x: torch.Tensor, linears, keep_copy: bool = False) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)``, computed as one GEMM over the modules' concatenated weights when every one is
    a plain ``nn.Linear`` (see ``_plain_linear``); otherwise every module is called, so that wrapped or hooked modules
    (a LoRA adapter on ``q_proj``) keep working.  The outputs are one ``split`` of the product (views).

    Why: several projections of the same input (an attention layer's q / k / v and scalar keys, SwiGLU's gate and up)
    otherwise cost a GEMM, an autocast weight cast and a ``dx`` GEMM each, plus a sum of the ``dx`` parts in the
    backward; the small scalar projections (``hidden -> heads``) are badly shaped GEMMs that read the whole input
    for a few outputs.  Together: one cast, one GEMM forward, two backward (the split's backward is one ``cat`` of the
    output gradients), and the parameters stay separate (checkpoints, PEFT target names, weight decay groups).
    ``torch.cat`` of the weights is a parameter-sized copy per call, small next to the activations it saves.

    Except in eval mode on a few rows (at most ``SEPARATE_PROJECTION_MAX_ROWS`` rows: a decode step): there each
    GEMM only streams its weight once, and the ``cat`` would read and write every weight again first, three times
    the weight traffic of the step.  Those calls take the modules one by one (the same values up to the GEMMs'
    rounding).  In the compiled decode step of a d768 L12 scalar_sort model on an H100, two ``triton_poi_fused_cat_*``
    kernels took 95 us per generated token, a tenth of its GPU time (benchmarks/results/h100-2026-11-27p/
    diagnose-512k-b); their time matches these copies (6.3 MB of SwiGLU weights and 1.2 MB of q-scalar / k-scalar /
    value weights per layer, read and written at ~2 TB/s), and the CPU-compiled step has no other ``cat`` (not yet
    re-measured on the GPU).  Compiled, the small ones among them (at most ``SMALL_PROJECTION_MAX_OUT`` outputs)
    are one reduction kernel together (:func:`_small_projections`).  ``keep_copy``: in a generation's eager decode
    steps, one GEMM over a concatenation kept for the generation (``decode_projection_copies``; the attention
    projections pass it).
    """
    eager = not torch.compiler.is_compiling()
    plain = _plain_linear_eager if eager else _plain_linear
    if len(linears) == 1 or not (
        torch.nn.modules.module._global_forward_hooks == {}
        and torch.nn.modules.module._global_forward_pre_hooks == {}
        and all(plain(m, linears[0]) for m in linears)
    ):
        return tuple(m(x) for m in linears)
    if _few_rows_in_eval(x, linears):
        if eager:
            copies = _PROJECTION_COPIES if keep_copy else None
            if copies is not None:  # a generation's decode step: one GEMM over the kept concatenation
                weight, bias, sizes = _kept_concatenation(copies, linears)
                return F.linear(x, weight, bias).split(sizes, dim=-1)
            # what `nn.Linear.forward` computes, its parameters read without `nn.Module.__getattr__`
            return tuple(F.linear(x, _param(m, "weight"), _param(m, "bias")) for m in linears)
        small = [m for m in linears if m.out_features <= SMALL_PROJECTION_MAX_OUT]
        if not small:
            return tuple(F.linear(x, m.weight, m.bias) for m in linears)
        outputs = iter(_small_projections(x, small))
        return tuple(next(outputs) if m.out_features <= SMALL_PROJECTION_MAX_OUT else F.linear(x, m.weight, m.bias)
                     for m in linears)  # fmt: skip
    weight = torch.cat([m.weight for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears])
    return F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1)


class DecoderMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (gate and up as one GEMM: :func:`project_together`)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_together(x, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)


class SinusoidFrequencies(nn.Module):
    """Angles ``t * w_f`` of text positions, shared by RoPE and SuSiE: ``w_f = theta^(-2f / head_dim)``.

    ``inv_freq`` is a non-persistent buffer (not in checkpoints); ``DecoderPreTrainedModel._init_weights`` recomputes
    it, so it is right after ``from_pretrained`` too.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device=None) -> torch.Tensor:
        exponents = (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / self.head_dim
        )
        return 1.0 / (self.theta**exponents)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B|1, N]`` -> ``(cos, sin)``, each float32 ``[B|1, N, head_dim // 2]``."""
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(position_ids.device)
        return angles.cos(), angles.sin()


# Which RoPE implementation `apply_rotary` uses: "auto" (the fused kernel of `kernels_rotary` on CUDA, the torch
# reference elsewhere, the Triton interpreter included: it would make every CPU model test crawl; and the torch
# reference wherever torch.compile traces, because inductor fuses those few elementwise ops with their neighbours,
# while the custom op's Python ran at every call inside the compiled graph: 0.19 ms of host time per call, 4.5 ms of a
# compiled d768 hybrid_sort training step's 52.8 on an H200, benchmarks/results/h200x2-2026-11-28e), "triton" (the
# kernel wherever it can run, the interpreter and compiled graphs too: what the CPU tests of the fused path set) or
# "torch".
ROTARY_BACKENDS = ("auto", "triton", "torch")
rotary_backend = "auto"
_ROTARY_LOGGED: set = set()


def _rotary_uses_kernel(x: torch.Tensor, cos: torch.Tensor) -> bool:
    if rotary_backend not in ROTARY_BACKENDS:
        raise ValueError(
            f"hf_rbf.modeling_decoder.rotary_backend must be one of {ROTARY_BACKENDS}; got {rotary_backend!r}"
        )
    if rotary_backend == "torch" or (rotary_backend == "auto" and x.device.type != "cuda"):
        use, reason = False, f"rotary_backend={rotary_backend!r} on {x.device.type}"
    elif rotary_backend == "auto" and torch.compiler.is_compiling():
        use, reason = False, "rotary_backend='auto' under torch.compile (inductor fuses the torch form)"
    else:
        reason = rotary_reason(x, cos)
        use = reason is None
        if not use and rotary_backend == "triton":
            raise ValueError(f"rotary_backend='triton' cannot serve this call: {reason}")
    if not torch.compiler.is_compiling() and (x.device.type, use) not in _ROTARY_LOGGED:
        _ROTARY_LOGGED.add((x.device.type, use))
        logger.info("RoPE on %s: %s", x.device.type, "fused Triton kernel" if use else f"torch ({reason})")
    return use


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """RoPE in the rotate-half convention: ``x [B, H, N, D]`` (``head_dim=1``) or ``[B, N, H, D]`` (``head_dim=2``: a
    projection's own layout, whose transposed result the fused kernels read without a copy); ``cos/sin [B|1, N, D/2]``.
    On CUDA one fused kernel each way (``kernels_rotary``; see ``rotary_backend``), else
    :func:`apply_rotary_reference`."""
    if _rotary_uses_kernel(x, cos):
        return rotary_fused(x, None, cos, sin, head_dim)[0]
    return apply_rotary_reference(x, cos, sin, head_dim)


def apply_rotary_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int = 1):
    """:func:`apply_rotary` of a layer's queries and keys, one launch for both on the fused path."""
    if _rotary_uses_kernel(q, cos):
        return rotary_fused(q, k, cos, sin, head_dim)
    return apply_rotary_reference(q, cos, sin, head_dim), apply_rotary_reference(k, cos, sin, head_dim)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """RoPE in plain torch (the reference of the fused kernel; arguments as :func:`apply_rotary`)."""
    cos = cos.unsqueeze(head_dim).to(x.dtype)
    sin = sin.unsqueeze(head_dim).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# (cos, sin, dtype, sin as [B|1, 1, N, D/2] in dtype, cos alike) of the last forward without gradients: the same
# for every layer of a forward (see `susie_embedding`)
_SUSIE_ANGLES: tuple | None = None


def _susie_angles(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``sin`` and ``cos`` as ``[B|1, 1, N, D/2]`` in ``dtype``.  Every layer of a forward gets the same ``cos`` /
    ``sin`` tensors (``DecoderModel`` computes them once), so without gradients and outside ``torch.compile`` the
    first layer's views and casts serve the others (two to four ops per layer and decode step on the host, two of
    them a cast kernel each in bfloat16).  Kept are the tensors themselves, compared by identity."""
    global _SUSIE_ANGLES
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return sin.unsqueeze(1).to(dtype), cos.unsqueeze(1).to(dtype)
    kept = _SUSIE_ANGLES
    if kept is None or kept[0] is not cos or kept[1] is not sin or kept[2] != dtype:
        kept = _SUSIE_ANGLES = (cos, sin, dtype, sin.unsqueeze(1).to(dtype), cos.unsqueeze(1).to(dtype))
    return kept[3], kept[4]


def susie_embedding(cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SuSiE's additive position term ``[sin, cos] * weight``: ``[B|1, H, N, D]`` from ``cos/sin [B|1, N, D/2]`` and
    the per-head, per-frequency ``weight [H, D/2]`` (shared by the sin and cos of a frequency)."""
    w = weight.to(dtype).reshape(1, weight.shape[0], 1, weight.shape[1])  # (one view op; [None, :, None, :] is two)
    sin4, cos4 = _susie_angles(cos, sin, dtype)
    return torch.cat((sin4 * w, cos4 * w), dim=-1)


def dot_backend_for(config: DecoderConfig) -> str:
    """The backend of "dot" layers: ``dot_attention`` has "naive" and "sdpa" only (see ``attention_backend``)."""
    return "naive" if config.attention_backend == "naive" else "sdpa"


# ----------------------------------------------------------------------------------------------------------------
# attention base class and the "dot" kind
# ----------------------------------------------------------------------------------------------------------------


class DecoderAttention(nn.Module):
    """Base class of every attention kind of the backbone.

    ``forward(hidden_states [B, N, D], register_states [1, R, D] | None, *, position_embeddings, cache,
    attention_mask, key_log_weights, output_attentions=False)`` returns ``(text_out [B, N, D], register_out [1, R, D] |
    None, weights)``: the inputs are already RMS-normalised, the outputs go into the residual stream.
    ``attention_mask`` ``[B, past + N]`` and ``key_log_weights`` ``[B|1, (H,) past + N]`` cover text keys only; each
    layer slices them to the keys its cache returns and prepends the registers (always visible, log-weight 0).

    ``weights`` is None unless ``output_attentions``; then the text call runs the materialised reference
    (``backend="naive", return_weights=True``, so ``last_backend`` is "naive") and ``weights`` are the text rows'
    attention weights ``[B, H, N, P + past + N]`` in the dtype of the text call: the ``P`` prefix keys first (the
    ``R`` registers; for scalar-sort / hybrid-sort layers the sink, then the registers), then every text key in
    sequence order (the ``past`` cached ones, then the ``N`` new ones).  Disallowed keys (padding, future, outside the
    window) get 0, and so do text keys the layer's cache no longer holds (a sliding layer keeps only the last
    ``window - 1``: they are outside every current query's window).  The rows are the normalised weights (they sum to
    1 over the allowed keys; GKA's ``eps`` makes the sum slightly less, RBF's ``rbf_normalize=False`` gives the
    unnormalised kernel values ``exp(score)``); a row without any allowed key is all zeros.  The register rows'
    weights are not returned.  A kind that cannot return weights for some cache says why in
    :meth:`output_attentions_error`.

    A kind that needs its own cache layer overrides :meth:`make_cache_layer` and :meth:`accepts_cache_layer`.
    Subclasses own ``o_proj`` and call :meth:`_init_own_parameters` from ``_init_weights`` for their extra parameters.
    """

    kind = ""
    # Register rows are R queries of batch 1 over R keys: the materialised reference is a handful of tiny ops, while a
    # fused kernel or the SDPA padding trick would spend far longer launching than computing (measured host overhead
    # of ~1 ms per forward+backward of the fused path on an H100, against microseconds of work).
    register_backend = "naive"

    def __init__(self, config: DecoderConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.window = config.layer_window(layer_idx)
        self.num_registers = config.num_register_tokens
        self.last_backend = None  # the backend that served the last text call (set at every forward)
        if self.num_registers > 0:
            # Registers' position embedding, added in place of the text position term (zero-init: the origin).
            self.register_position = nn.Parameter(torch.zeros(self.num_registers, self.head_dim))
        else:
            self.register_position = None

    @property
    def backend(self) -> str:
        """The backend of the text call: ``config.attention_backend``, read at every call so that
        ``model.set_attn_implementation(...)`` and ``from_pretrained(..., attn_implementation=...)`` reach every layer."""
        return self.config.attention_backend

    # -- cache ---------------------------------------------------------------------------------------------------
    def make_cache_layer(self):
        """A fresh cache layer for this attention layer (sliding layers keep only the last ``window - 1`` keys)."""
        if self.window is not None:
            return DynamicSlidingWindowLayer(sliding_window=self.window)
        return DynamicLayer()

    def accepts_cache_layer(self, layer) -> bool:
        """Whether an existing cache layer (e.g. from a user's ``DynamicCache``) can serve this attention layer."""
        return isinstance(layer, DynamicLayer)

    def make_static_cache_layer(self, max_cache_len: int):
        """A fixed-capacity cache layer (``cache_implementation="static"``; see :mod:`hf_rbf.cache_static`)."""
        return StaticKeyValueLayer(max_cache_len, sliding_window=self.window, share_key=self.kind)

    # -- the layer's entry point ----------------------------------------------------------------------------------
    # Kinds whose ``forward`` also takes ``rows=`` (the flat normalised buffer the two views come from) and then
    # returns the output rows ``[B * N + R, D]`` in place of the text output (one matmul per projection for text and
    # registers together).  The layer still calls the module (hooks see the text and register views as before).
    takes_rows = False

    def forward_rows(self, rows: torch.Tensor, text_shape: tuple[int, int], **kwargs):
        """``rows [B * N + R, D]`` (normalised text rows, then register rows) -> ``(out rows [B * N + R, D],
        weights)``, through the module's ``__call__`` (so forward hooks run)."""
        hidden, registers = split_rows(rows, text_shape)
        if self.takes_rows:
            out_rows, _, weights = self(hidden, registers, rows=rows, **kwargs)
            return out_rows, weights
        text_out, register_out, weights = self(hidden, registers, **kwargs)
        return join_rows(text_out, register_out), weights

    def _row_heads(self, projected: torch.Tensor, text_shape: tuple[int, int]):
        """A projection of the flat rows ``[B * N + R, H * D]`` as heads: text ``[B, H, N, D]`` and registers
        ``[1, H, R, D]`` (None without registers); views, no copy."""
        text, registers = split_rows(projected, text_shape)
        return self._split_heads(text), (self._split_heads(registers) if registers is not None else None)

    def _heads_to_rows(self, out: torch.Tensor, register_out: torch.Tensor | None) -> torch.Tensor:
        """Text ``[B, H, N, Dv]`` and register ``[1, H, R, Dv]`` outputs as flat rows ``[B * N + R, H * Dv]``: one
        ``cat`` (merging the heads copies anyway, unless the kernel wrote ``out`` row-major).  Not ``copy_`` into
        slices of a fresh buffer: autograd's ``CopySlices`` backward clones the full gradient and zero-fills each
        slice."""
        b, h, n, dv = out.shape
        text = out.transpose(1, 2).reshape(b * n, h * dv)
        if register_out is None:
            return text
        return torch.cat([text, register_out[0].transpose(0, 1).reshape(-1, h * dv)])

    # -- helpers -------------------------------------------------------------------------------------------------
    def _init_own_parameters(self) -> None:
        if self.register_position is not None:
            init.zeros_(self.register_position)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, -1).transpose(1, 2)

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = x.shape
        return x.transpose(1, 2).reshape(b, n, -1)

    def _key_arguments(self, num_text_keys: int, attention_mask, key_log_weights, cache=None):
        """Slice the text-key mask / log-weights to the keys the cache returned and prepend the registers.  A static
        cache layer knows the validity of the keys it returned (its whole buffer in a decode step): its slot mask."""
        r = self.num_registers
        layer = cache.layers[self.layer_idx] if isinstance(cache, StaticDecoderCache) else None
        if layer is not None:
            am = layer.slot_mask
        else:
            am = attention_mask[:, -num_text_keys:] if attention_mask is not None else None
        klw = key_log_weights[..., -num_text_keys:] if key_log_weights is not None else None
        if r > 0:
            if am is not None:
                am = torch.cat([am.new_ones(am.shape[0], r), am], dim=1)
            if klw is not None:
                klw = torch.cat([klw.new_zeros(*klw.shape[:-1], r), klw], dim=-1)
        return am, klw

    def _note_backend(self, op: str) -> None:
        if not torch.compiler.is_compiling():
            self.last_backend = last_backend(op)

    # -- output_attentions ---------------------------------------------------------------------------------------
    def output_attentions_error(self, cache) -> str | None:
        """Why this layer cannot return its attention weights for a forward with ``cache`` (None: it can).  The
        backbone asks every layer before the first one runs, so a refused call leaves the cache untouched."""
        return None

    @staticmethod
    def _text_call_options(backend: str, output_attentions: bool) -> dict:
        """The text call's backend keywords: the materialised reference with weights when they are asked for."""
        if output_attentions:
            return {"backend": "naive", "return_weights": True}
        return {"backend": backend}

    def _weights_over_all_text_keys(self, weights: torch.Tensor, num_prefix: int, cache) -> torch.Tensor:
        """``[B, H, N, P + seen]`` -> ``[B, H, N, P + past + N]``: zeros for the oldest text keys the layer's cache no
        longer returned (a sliding layer keeps ``window - 1``), so that column ``P + j`` is always text token ``j``."""
        if cache is None:
            return weights
        total = cache.layers[self.layer_idx].get_seq_length()
        missing = total - (weights.shape[-1] - num_prefix)
        if missing <= 0:
            return weights
        zeros = weights.new_zeros(*weights.shape[:-1], missing)
        return torch.cat([weights[..., :num_prefix], zeros, weights[..., num_prefix:]], dim=-1)


class DotAttention(DecoderAttention):
    """The "dot" kind: learned W_Q, W_K, W_V, W_O, RoPE, softmax dot product (``dot_attention``, SDPA).

    PEFT LoRA targets: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``.
    """

    kind = "dot"

    def __init__(self, config: DecoderConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, hd = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(hd, d, bias=config.attention_bias)
        # QK-norm (``config.qk_norm``): per-head RMSNorm of q and k with a learnable [head_dim] scale, before RoPE.
        self.q_norm = DecoderRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = DecoderRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None

    @property
    def dot_backend(self) -> str:
        return dot_backend_for(self.config)

    projects_values = True  # False: no `v_proj`, the values are the input rows

    def _project(self, x: torch.Tensor, registers: bool = False):
        if not self.projects_values:  # the values are the rows themselves (GKA's "vlt" layers)
            q, k = (self._split_heads(t) for t in project_together(x, (self.q_proj, self.k_proj), keep_copy=True))
            return (*self._normalize_qk(q, k, registers), self._split_heads(x))
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (self._split_heads(t) for t in project_together(x, projections, keep_copy=True))
        return (*self._normalize_qk(q, k, registers), v)

    def _normalize_qk(self, q: torch.Tensor, k: torch.Tensor, registers: bool = False):
        if self.q_norm is not None:
            # register rows: the capped norm (their zero-initialised states sit where RMS norm is singular)
            q = self.q_norm.capped(q) if registers else self.q_norm(q)
            k = self.k_norm.capped(k) if registers else self.k_norm(k)
        return q, k

    def register_forward(self, register_states: torch.Tensor):
        """The register rows' attention (over the registers, causally): ``(out [1, R, D] after o_proj, prefix)``, with
        ``prefix = (keys, values)`` ``[1, H, R, head_dim]``, what the text rows see in front of their keys."""
        qr, kr, vr = self._project(register_states, registers=True)
        qr, kr = qr + self.register_position.to(qr.dtype), kr + self.register_position.to(kr.dtype)
        register_out = dot_attention(qr, kr, vr, causal=True, backend=self.register_backend)
        return self.o_proj(self._merge_heads(register_out)), (kr, vr)

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
        register_prefix: tuple | None = None,
    ):
        b = hidden_states.shape[0]
        q, k, v = self._project(hidden_states)
        cos, sin = position_embeddings
        q, k = apply_rotary_pair(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        am, klw = self._key_arguments(k.shape[2], attention_mask, key_log_weights, cache)

        register_out = None
        if self.num_registers > 0:
            if register_prefix is None:
                register_out, register_prefix = self.register_forward(register_states)
            kr, vr = register_prefix
            k = torch.cat([kr.expand(b, -1, -1, -1), k], dim=2)
            v = torch.cat([vr.expand(b, -1, -1, -1), v], dim=2)

        out = dot_attention(
            q,
            k,
            v,
            causal=True,
            window=self.window,
            key_log_weights=klw,
            attention_mask=am,
            num_prefix_keys=self.num_registers,
            **self._text_call_options(self.dot_backend, output_attentions),
        )
        self._note_backend("dot_attention")
        weights = None
        if output_attentions:
            out, weights = out
            weights = self._weights_over_all_text_keys(weights, self.num_registers, cache)
        return self.o_proj(self._merge_heads(out)), register_out, weights


# ----------------------------------------------------------------------------------------------------------------
# decoder layer
# ----------------------------------------------------------------------------------------------------------------


class DecoderLayer(GradientCheckpointingLayer):
    """RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual, for the text and the register rows.

    The layer works on one flat ``[B * N + R, D]`` buffer: the text rows of every sequence, then the R register rows.
    Norms, projections, the MLP and the residual adds are then one launch each for text
    and registers together, where a separate ``[1, R, D]`` register stream cost as many launches again (a
    host-bound 2x slower training step at d768 with one register: ``benchmarks/results/h100-profile-2026-11-25``).

    The register rows get a capped norm (``DecoderRMSNorm.capped``): rows of RMS above 1 are normalised to RMS 1, smaller
    ones pass unchanged.  Their states are learned constants that start at exactly zero (so their keys start at the
    origin), and RMS normalisation is singular there: its Jacobian at zero is ``1 / sqrt(eps)`` (1000 for eps = 1e-6)
    and compounds from layer to layer, which gave the zero-initialised registers gradient norms of 1e6 (RBF) to 1e7
    (GKA) in a 4-layer model at initialisation: six orders of magnitude above every other parameter, enough to make
    global gradient clipping freeze the rest of the model.  Left unnormalised instead (until 2026-11-26), the register
    stream grew doubly exponentially with depth, since a SwiGLU MLP is quadratic in a large input: in the 16-layer 1B
    rbf recipe its largest entry went 9, 90, 4e3, 6e6, 2e13 over layers 11-15 within 26 steps, and the last layer's
    MLP weight gradients became NaN (``inf`` activations times the zero gradient of the sliced register row;
    ``benchmarks/find_nonfinite_grads.py``).  The capped norm is the identity near zero and bounded like RMS norm.
    """

    def __init__(self, config: DecoderConfig, layer_idx: int, attention_class: type[DecoderAttention]):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_registers = config.num_register_tokens
        self.self_attn = attention_class(config, layer_idx)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        register_states: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        key_log_weights: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool = False,
        register_memo: dict | None = None,
        register_step_path: str | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns ``(rows, attention weights or None, register states or None)``.

        ``rows`` is the flat buffer that ``hidden_states [B, N, D]`` and ``register_states [1, R, D]`` are views of
        (``DecoderModel`` passes all three: the views are what forward pre-hooks read, e.g. the scalar-sort
        regularizers and the captured-mass tools; the layer computes on ``rows``).  Without it, the views are joined.
        Positional, so that a (re-entrant) gradient checkpoint sees it as an input.

        Where ``rows`` holds the text rows alone (``[B * N, D]``) while the layer has registers, the registers travel
        beside it (the register stream, see :func:`register_path_for`): :func:`register_layer_step` gives the
        registers' next states and the prefix keys the text attends to, and those states are returned third.  A
        ``register_memo`` dict (``DecoderModel`` passes one per cache in inference) keeps that step's result per layer:
        the registers depend on the weights alone, so the steps of one generation compute them once.
        ``register_step_path`` is the path the model chose for this forward ("stream" or "compiled"; None: chosen
        here by ``register_path_for``).
        """
        text_shape = tuple(hidden_states.shape[:2])
        if rows is None:
            rows = join_rows(hidden_states, register_states)
        r = self.num_registers
        call = dict(
            position_embeddings=position_embeddings,
            cache=cache,
            attention_mask=attention_mask,
            key_log_weights=key_log_weights,
            output_attentions=output_attentions,
        )
        if r and rows.shape[0] == text_shape[0] * text_shape[1]:  # the register stream
            idx = self.self_attn.layer_idx
            step = None if register_memo is None else register_memo.get(idx)
            if step is None:
                step = register_step_function(rows.device, self, register_step_path)(self, register_states)
                if register_memo is not None:
                    register_memo[idx] = step
            register_states, prefix = step
            attn_rows, weights = self.self_attn.forward_rows(
                self.input_layernorm(rows), text_shape, register_prefix=prefix, **call
            )
            rows = rows + attn_rows
            rows = rows + self.mlp(self.post_attention_layernorm(rows))
            return rows, weights, register_states
        normed = self.input_layernorm(rows, r)
        attn_rows, weights = self.self_attn.forward_rows(normed, text_shape, **call)
        rows = rows + attn_rows
        rows = rows + self.mlp(self.post_attention_layernorm(rows, r))
        return rows, weights, None


def register_layer_step(layer: DecoderLayer, register_states: torch.Tensor):
    """One layer for the register rows alone (``[1, R, D]``; they attend only to each other, so they never depend on
    the text): ``(next register states, prefix)``, where ``prefix`` is what the layer's text rows attend to in front
    of their own keys (``DecoderAttention.register_forward``).  The same values as the register rows of the flat
    ``[B * N + R, D]`` path; a function of the parameters alone, of one shape per model."""
    x = layer.input_layernorm.capped(register_states)
    attn_out, prefix = layer.self_attn.register_forward(x)
    h = register_states + attn_out
    h = h + layer.mlp(layer.post_attention_layernorm.capped(h))
    return h, prefix


# How the register rows travel through the layers (see ``DecoderLayer``):
#   "rows"      one flat ``[B * N + R, D]`` buffer of text and register rows: the projections, MLP and residual adds
#               serve both in one launch, but every layer pays the register rows' own ops beside them (their capped
#               norms, offsets, attention, the split and cat of the buffer): about 100-230 aten ops per layer and
#               training step (``benchmarks/count_model_host_ops.py``), which is what makes a model with registers
#               host-bound on a GPU;
#   "stream"    the register rows as a separate ``[1, R, D]`` stream, one ``register_layer_step`` per layer, eagerly;
#   "compiled"  the stream, each layer's ``register_layer_step`` one ``torch.compile`` graph (``fullgraph``, backend
#               ``register_compile_backend``): a handful of fused kernels forward and backward in place of those ops.
#               The graph depends on the model's shapes and settings only: every layer of a model shares it, and the
#               compiled code is cached on disk like any ``torch.compile`` graph;
#   "graphed"   the compiled step of each layer captured as two CUDA graphs, forward and backward, replayed by forwards
#               with gradients (``modeling_register_graph``): one launch each in place of those kernels; forwards
#               without gradients run the compiled step.  CUDA only;
#   "auto"      on CUDA "graphed" where a capture stays valid from step to step (``_graphs_fit``: the parameters keep
#               their storage: one process or DDP; or FSDP2, whose gathered weights the graphs copy in; not under
#               checkpointing), else "compiled"; "rows" elsewhere (on a CPU the host is not the
#               bottleneck) and inside a graph being compiled (``torch.compile`` of the model, the static decode step:
#               the whole graph fuses anyway).  On an H100 (benchmarks/results/h100-2026-11-27h) the graphed step took
#               the d768 training step from 56.3 / 57.2 / 75.9 ms (compiled) to 47.0 / 47.2 / 62.2 ms (rbf /
#               scalar_sort / hybrid_sort with one register; Llama 72.6), and its GPU tests (training steps with an
#               evaluation forward and a cached ``generate`` between them) pass for every family.
# On the stream, a forward with a cache and without gradients (``generate``, a chat loop) computes the registers' steps
# once per cache and reuses them in every later call with that cache (``DecoderModel._register_memo``): the registers
# depend on the weights alone.  On CUDA "auto" runs those steps eagerly ("stream": once per generation, not worth a
# compilation).  On a CPU "auto" keeps the rows path throughout, so that a forward gives the same bits with and
# without gradients or a cache (the two paths differ by float rounding: their matmuls have other shapes).
# The three settings below start from the environment (``HF_RBF_REGISTER_PATH``, ``HF_RBF_REGISTER_COMPILE_BACKEND``,
# ``HF_RBF_REGISTER_COMPILE_MODE``), so that a launcher (``accelerate launch``, ``torchrun``) can set them for every
# process; they are checked where they are used.
REGISTER_PATHS = ("auto", "rows", "stream", "compiled", "graphed")
register_path = os.environ.get("HF_RBF_REGISTER_PATH", "auto")
register_compile_backend = os.environ.get("HF_RBF_REGISTER_COMPILE_BACKEND", "inductor")
# ``torch.compile``'s ``mode`` for the compiled step: "default" (inductor's kernels, launched one by one: about 48
# launches per layer and training step for one register), "reduce-overhead" (the step's forward and backward replayed
# as CUDA graphs by cudagraph trees: one replay each per layer) or "auto": "reduce-overhead" on CUDA where the layer's
# parameters keep their addresses from step to step (what a CUDA graph needs), "default" where they may not (FSDP,
# whose unsharded parameters are reallocated every step, accelerate's offloading hooks, DeepSpeed ZeRO-3, activation
# checkpointing, which runs the step again inside the backward).
# "default" is the default: the CUDA graphs are an opt-in experiment.  On an H100 (benchmarks/results/h100-2026-11-26e)
# they took the d768 training step from 64.3 / 70.5 / 83.4 ms to 54.5 / 50.7 / 66.2 ms (rbf / scalar_sort /
# hybrid_sort, Llama 72.7) in one call, but only from 69.2 / 73.7 / 83.9 to 68.7 / 67.6 / 79.7 in another (with the
# per-forward step mark below); and a dynamic-cache ``generate`` of rbf failed in both calls with cudagraph trees'
# "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run".
REGISTER_COMPILE_MODES = ("auto", "default", "reduce-overhead")
register_compile_mode = os.environ.get("HF_RBF_REGISTER_COMPILE_MODE", "default")
# every family's register step on one function: more graphs than dynamo's default limit of 8 per function (models of
# several families in one process, training and no-grad) must not silently turn it back into eager code
REGISTER_STEP_RECOMPILE_LIMIT = 64
_REGISTER_PATH_LOGGED: set = set()
_REGISTER_MODE_LOGGED: set = set()
_COMPILED_REGISTER_STEPS: dict = {}


def register_path_for(device: torch.device, memoised: bool = False, layer: nn.Module | None = None) -> str:
    """The register path (``register_path``) of a forward on ``device``: "rows", "stream", "compiled" or "graphed";
    ``memoised``: the forward reuses the registers' steps of an earlier call (a cached forward without gradients);
    ``layer``: a decoder layer of the model, for "auto"'s choice between "graphed" and "compiled" (None: "compiled")."""
    if register_path not in REGISTER_PATHS:
        raise ValueError(
            f"hf_rbf.modeling_decoder.register_path must be one of {REGISTER_PATHS}; got {register_path!r} (set in "
            "code or through the HF_RBF_REGISTER_PATH environment variable)"
        )
    if torch.compiler.is_compiling():
        if register_path == "auto":
            return "rows"
        return "stream" if register_path in ("compiled", "graphed") else register_path
    path = register_path
    if path == "auto":
        if device.type != "cuda":
            path = "rows"
        elif memoised:
            path = "stream"
        else:
            path = "graphed" if layer is not None and _graphs_fit(layer) else "compiled"
    if (device.type, path) not in _REGISTER_PATH_LOGGED:
        _REGISTER_PATH_LOGGED.add((device.type, path))
        detail = f", torch.compile backend {register_compile_backend!r}" if path in ("compiled", "graphed") else ""
        logger.info("register rows on %s: the %r path (register_path=%r%s)", device.type, path, register_path, detail)
    return path


def _keeps_parameter_addresses(layer: nn.Module) -> bool:
    """Whether the layer's parameters keep their storage from step to step (see ``register_compile_mode``): not under
    activation checkpointing, accelerate's hooks (``_hf_hook``), FSDP2 (``fully_shard`` makes the layer an
    ``FSDPModule``), FSDP1 (``_is_fsdp_managed_module``) or DeepSpeed ZeRO-3 (``ds_id`` on the parameters)."""
    if getattr(layer, "gradient_checkpointing", False) or hasattr(layer, "_hf_hook"):
        return False
    if getattr(layer, "_is_fsdp_managed_module", False) or any(c.__name__ == "FSDPModule" for c in type(layer).__mro__):
        return False
    first = next(layer.parameters(), None)
    return first is None or not hasattr(first, "ds_id")


def _graphs_fit(layer: nn.Module) -> bool:
    """Whether "auto" replays ``layer``'s register step as CUDA graphs ("graphed"): its parameters keep their storage
    (``_keeps_parameter_addresses``: one process or DDP), or the graphs copy them in before each replay (FSDP2,
    ``modeling_register_graph.copies_parameters``), outside activation checkpointing and accelerate's hooks.  On 2
    H100s DDP with the graphed step matches the rows path's losses
    (``test_ddp_with_graphed_register_steps_matches_the_rows_path``) and scales at 0.98 (rbf) / 0.93 (hybrid_sort)
    against 0.94 / 0.95 on the compiled step, at 5% / 6% more tokens per GPU (benchmarks/results/h100-2026-11-27h,
    call 4).  Under FSDP2 the compiled step's launches came 0.9 ms late per layer (benchmarks/results/h100-2026-11-27k,
    call 3)."""
    if _keeps_parameter_addresses(layer):
        return True
    moving = getattr(layer, "gradient_checkpointing", False) or hasattr(layer, "_hf_hook")
    return not moving and copies_parameters(layer)


def register_compile_mode_for(layer: nn.Module, device: torch.device) -> str:
    """The ``torch.compile`` mode of ``layer``'s compiled register step on ``device`` (``register_compile_mode``)."""
    if register_compile_mode not in REGISTER_COMPILE_MODES:
        raise ValueError(
            f"hf_rbf.modeling_decoder.register_compile_mode must be one of {REGISTER_COMPILE_MODES}; got "
            f"{register_compile_mode!r} (set in code or through the HF_RBF_REGISTER_COMPILE_MODE environment variable)"
        )
    if register_compile_mode != "auto":
        return register_compile_mode
    return "reduce-overhead" if device.type == "cuda" and _keeps_parameter_addresses(layer) else "default"


def register_step_function(device: torch.device, layer: nn.Module | None = None, path: str | None = None):
    """``register_layer_step`` as the register path runs it for ``layer``: compiled (once per backend and mode) or as
    it is.  ``path``: the path the model chose for this forward (a cached forward without gradients takes the eager
    stream: its steps run once per generation); None: ``register_path_for(device)``."""
    if path is None:
        path = register_path_for(device)
    if torch.compiler.is_compiling() or path not in ("compiled", "graphed"):
        return register_layer_step
    if path == "graphed":
        compiled = register_step_function(device, None, "compiled")
        return lambda layer_, states: graphed_register_step(compiled, layer_, states)
    mode = register_compile_mode_for(layer, device) if layer is not None else "default"
    key = (register_compile_backend, mode)
    fn = _COMPILED_REGISTER_STEPS.get(key)
    if fn is None:
        import torch._dynamo as dynamo

        pin_triton_cache_dir()  # before inductor's first compilation moves it (see the function)
        if mode not in _REGISTER_MODE_LOGGED:
            _REGISTER_MODE_LOGGED.add(mode)
            logger.info("compiled register step: torch.compile mode %r (register_compile_mode=%r)", mode,
                        register_compile_mode)
        options = dict(backend=register_compile_backend, fullgraph=True, dynamic=False, mode=mode)
        compiled = torch.compile(register_layer_step, **options)
        fn = dynamo.config.patch(recompile_limit=REGISTER_STEP_RECOMPILE_LIMIT)(compiled)
        _COMPILED_REGISTER_STEPS[key] = fn
    return fn


def split_rows(rows: torch.Tensor, text_shape: tuple[int, int]):
    """Views of a flat ``[B * N + R, ...]`` buffer: text ``[B, N, ...]`` and registers ``[1, R, ...]`` (None if R = 0).

    One ``split``, not two slices: the backward of two slices is a zero-filled full-size gradient and a copy for each,
    then an add of the two (5 kernels and 3 full-size writes), that of a split one ``cat``."""
    b, n = text_shape
    if rows.shape[0] == b * n:
        return rows.view(b, n, *rows.shape[1:]), None
    text, registers = rows.split([b * n, rows.shape[0] - b * n])
    return text.view(b, n, *rows.shape[1:]), registers.unsqueeze(0)


def join_rows(text: torch.Tensor, registers: torch.Tensor | None) -> torch.Tensor:
    """``[B, N, ...]`` text and ``[1, R, ...]`` registers (or None) as one flat ``[B * N + R, ...]`` buffer."""
    flat = text.reshape(-1, *text.shape[2:])
    if registers is None:
        return flat
    return torch.cat([flat, registers.reshape(-1, *registers.shape[2:])])


# ----------------------------------------------------------------------------------------------------------------
# pretrained-model base, model, causal LM
# ----------------------------------------------------------------------------------------------------------------


# transformers' `attn_implementation` names -> our `attention_backend`: "eager" is the materialised reference (as
# transformers' eager path), "sdpa" the dimension-padding trick into F.scaled_dot_product_attention, "flex_attention"
# FlexAttention with our score.  None (nothing asked) keeps `config.attention_backend` ("auto" by default).
ATTN_IMPLEMENTATION_BACKENDS = {"eager": "naive", "sdpa": "sdpa", "flex_attention": "flex"}


def backend_for_attn_implementation(attn_implementation) -> str | None:
    """Our backend for a transformers ``attn_implementation`` request (None when nothing was asked)."""
    if attn_implementation is None:
        return None
    if attn_implementation not in ATTN_IMPLEMENTATION_BACKENDS:
        raise ValueError(
            f"`attn_implementation` must be one of {', '.join(repr(k) for k in ATTN_IMPLEMENTATION_BACKENDS)} or "
            f"None for hf_rbf models (they select the backends {', '.join(repr(v) for v in ATTN_IMPLEMENTATION_BACKENDS.values())}; "
            f"`attention_backend` in the config also takes 'auto' and 'triton'); got {attn_implementation!r}"
        )
    return ATTN_IMPLEMENTATION_BACKENDS[attn_implementation]


def _auto_map_name(cls) -> str:
    return f"{cls.__module__.split('.')[-1]}.{cls.__name__}"


class DecoderPreTrainedModel(PreTrainedModel):
    """Weight init, gradient checkpointing and the remote-code ``auto_map`` shared by every family."""

    config_class = DecoderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    # What transformers' attention switches may ask for (`attn_implementation=`, `set_attn_implementation`): "eager",
    # "sdpa" and "flex_attention" select our "naive", "sdpa" and "flex" backends (ATTN_IMPLEMENTATION_BACKENDS).
    # flash-attn and AttentionInterface kernels cannot compute distance scores, so those flags stay False.
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = False
    _supports_attention_backend = False
    # Sequence-parallel SDPA hooks (context parallelism) do not reach our attention functions.
    _supports_context_parallel = False
    # With the static cache (`cache_implementation="static"`, hf_rbf.cache_static / cache_sorted_static) a decode step
    # compiles with fullgraph=True (tests/test_model_static_cache.py); the dynamic caches stay the default.
    _can_compile_fullgraph = True
    _is_stateful = False
    # the attention kind -> class table of the family (set by each family's PreTrainedModel)
    attention_classes: dict[str, type[DecoderAttention]] = {}
    # Parameters that must not be weight-decayed (regexes on parameter names, read by hf_rbf.trainer.HfRbfTrainer):
    # the kernels' own log-bandwidths / log-gammas / temperatures (decay would pull them to a fixed width), the SuSiE
    # weights, register tokens and their positions, and the scalar sink's value.
    _no_weight_decay_patterns = (
        r"log_sigma$",
        r"log_gamma$",
        r"tau_bias$",
        r"susie_weight$",
        r"register_",
        r"sink_value$",
    )

    # -- attn_implementation -------------------------------------------------------------------------------------
    @classmethod
    def _from_config(cls, config, **kwargs):
        """``from_config(config, attn_implementation=...)``: the request also selects our backend."""
        backend = backend_for_attn_implementation(kwargs.get("attn_implementation"))
        if backend is not None:
            config = copy.deepcopy(config)
            config.attention_backend = backend
        return super()._from_config(config, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``from_pretrained(path, attn_implementation=...)``: the request also selects our backend (a config
        override, so the saved checkpoint is untouched)."""
        backend = backend_for_attn_implementation(kwargs.get("attn_implementation"))
        if backend is not None:
            config = kwargs.get("config")
            if isinstance(config, DecoderConfig):
                config = copy.deepcopy(config)
                config.attention_backend = backend
                kwargs["config"] = config
            else:
                kwargs["attention_backend"] = backend
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        """transformers' switch, also selecting our backend for every layer (see ``ATTN_IMPLEMENTATION_BACKENDS``)."""
        requested = attn_implementation.get("", None) if isinstance(attn_implementation, dict) else attn_implementation
        backend = backend_for_attn_implementation(requested)
        result = super().set_attn_implementation(attn_implementation, *args, **kwargs)
        if backend is not None:
            self.config.attention_backend = backend
        return result

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DecoderRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, SinusoidFrequencies):
            init.copy_(module.inv_freq, module.compute_inv_freq(device=module.inv_freq.device))
        elif isinstance(module, DecoderAttention):
            module._init_own_parameters()
        elif isinstance(module, DecoderModel):
            if module.register_tokens is not None:
                init.zeros_(module.register_tokens)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` with an ``auto_map`` listing AutoConfig, AutoModel and
        AutoModelForCausalLM, so the checkpoint loads with ``trust_remote_code=True`` where hf_rbf is not installed
        (the modeling files and their relative imports are copied by transformers)."""
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map["AutoConfig"] = _auto_map_name(type(self.config))
        module = sys.modules[type(self).__module__]
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == module.__name__:
                auto_class = obj.__dict__.get("_auto_class")
                if auto_class is not None:
                    auto_map[auto_class] = _auto_map_name(obj)
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)


def _check_input_tensors(input_ids, inputs_embeds, hidden_size: int) -> None:
    """Exactly one of ``input_ids`` (integer ``[B, N]``) and ``inputs_embeds`` (floating ``[B, N, D]``), checked before
    any op so a wrong rank or dtype is named instead of failing deep inside (e.g. an unpacking error)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of `input_ids` or `inputs_embeds`")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"`input_ids` must be a tensor of token ids [B, N]; got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must have shape [B, N] (2 dims); got {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"`input_ids` must hold integer token ids (torch.long); got {input_ids.dtype}")
    else:
        if not isinstance(inputs_embeds, torch.Tensor):
            raise TypeError(f"`inputs_embeds` must be a tensor [B, N, D]; got {type(inputs_embeds).__name__}")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
            raise ValueError(
                f"`inputs_embeds` must have shape [B, N, D] with D = hidden_size = {hidden_size}; "
                f"got {tuple(inputs_embeds.shape)}"
            )
        if not inputs_embeds.is_floating_point():
            raise TypeError(f"`inputs_embeds` must be a floating-point tensor; got {inputs_embeds.dtype}")


def _check_key_tensor(name: str, t, batch: int, total: int, heads: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a tensor {layout}; got {type(t).__name__}")
    ok = t.dim() in (2, 3) and t.shape[0] in (1, batch) and t.shape[-1] == total
    if ok and t.dim() == 3:
        ok = t.shape[1] in (1, heads)
    if not ok:
        raise ValueError(f"`{name}` must have shape {layout}; got {tuple(t.shape)}")


class DecoderModel(DecoderPreTrainedModel):
    """The backbone without the LM head: returns the final (RMS-normalised) hidden states of the text tokens."""

    def __init__(self, config: DecoderConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(config, i, self.attention_classes[config.layer_kind(i)])
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = DecoderRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.position_frequencies = SinusoidFrequencies(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )
        self.last_register_path = None  # the register path of the last forward (see `register_path`), None without
        # concatenated attention projection weights of eager decode steps (see `decode_projection_copies`)
        self.projection_copies = {}
        if config.num_register_tokens > 0:
            self.register_tokens = nn.Parameter(torch.zeros(config.num_register_tokens, config.hidden_size))
        else:
            self.register_tokens = None
        self.gradient_checkpointing = False
        self.post_init()

    def _register_memo(self, cache, registers: torch.Tensor) -> dict | None:
        """The per-layer register steps kept on ``cache`` for the forwards of one generation (see ``register_path``):
        a dict ``layer index -> (next register states, prefix)``, fresh whenever the model, the registers' dtype or
        device, or the register tokens' version (an optimiser step or a ``load_state_dict`` bumps it) differ from
        what the cache saw last.  None for a cache object that takes no attributes."""
        key = (id(self), registers.dtype, registers.device, self.register_tokens._version)
        memo = getattr(cache, "_hf_rbf_register_memo", None)
        if memo is None or memo[0] != key:
            memo = (key, {})
            try:
                cache._hf_rbf_register_memo = memo
            except AttributeError:
                return None
        return memo[1]

    def train(self, mode: bool = True):
        """``nn.Module.train``; training drops the decode steps' projection copies (``decode_projection_copies``)."""
        if mode:
            self.projection_copies.clear()
        return super().train(mode)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # -- cache ---------------------------------------------------------------------------------------------------
    def make_cache(self) -> DynamicCache:
        """An empty ``DynamicCache`` whose layers are those the model's attention layers need."""
        cache = DynamicCache()
        cache.layers = [layer.self_attn.make_cache_layer() for layer in self.layers]
        return cache

    def make_static_cache(
        self, max_cache_len: int | None = None, *, max_cache_bytes: int | None = None, batch_size: int | None = None
    ) -> StaticDecoderCache:
        """An empty fixed-capacity cache for sequences of at most ``max_cache_len`` tokens (prompt + generated).

        ``max_cache_bytes`` sizes it in bytes instead: the capacity is the largest length whose layers keep their
        per-token buffers within ``max_cache_bytes`` bytes per batch row each, in the model's dtype
        (:func:`~hf_rbf.cache_static.static_cache_len_for_bytes`); ``max_cache_len``, when given too (as ``generate``
        does: prompt + new tokens), must fit in it.  ``batch_size``: the rows it will hold, when known (the sorted
        families size their blocks by it; the layers here allocate at the first write, whatever the batch)."""
        if batch_size is not None and (type(batch_size) is not int or batch_size < 1):
            raise ValueError(f"make_static_cache: `batch_size` must be None or an int >= 1; got {batch_size!r}")
        if max_cache_bytes is not None:
            capacity = static_cache_len_for_bytes(self.config, max_cache_bytes, self.dtype)
            if max_cache_len is not None and max_cache_len > capacity:
                raise ValueError(
                    f"make_static_cache: `max_cache_len` ({max_cache_len} tokens, e.g. prompt + max_new_tokens) does "
                    f"not fit in `max_cache_bytes` ({max_cache_bytes} bytes per layer and row = {capacity} tokens in "
                    f"{self.dtype}); raise `max_cache_bytes` or generate fewer tokens"
                )
            max_cache_len = capacity
        elif max_cache_len is None:
            raise ValueError("make_static_cache: pass `max_cache_len` (tokens) or `max_cache_bytes` (bytes per layer)")
        layers = [layer.self_attn.make_static_cache_layer(max_cache_len) for layer in self.layers]
        return StaticDecoderCache(layers, max_cache_len)

    def _prepare_cache(self, cache) -> None:
        """:meth:`_prepare_cache_layers`, skipped for a cache whose type and layer types this model already accepted
        (every decode step of a generation passes the same cache): whether a layer fits is a matter of its type
        alone, and the check of every layer, at every step, cost more host time than a layer's cache update."""
        layers = getattr(cache, "layers", None)
        if torch.compiler.is_compiling() or not isinstance(layers, list):
            self._prepare_cache_layers(cache)
            return
        known = self.__dict__.get("_hf_rbf_cache_layouts")
        if known is not None and (type(cache), *map(type, layers)) in known:
            return
        self._prepare_cache_layers(cache)
        if known is None or len(known) >= 16:
            known = self._hf_rbf_cache_layouts = set()
        known.add((type(cache), *map(type, cache.layers)))

    def _prepare_cache_layers(self, cache) -> None:
        """Make a user's cache (e.g. a plain ``DynamicCache()``) fit the model: add the missing layers, replace empty
        layers of the wrong type, reject filled ones."""
        if isinstance(cache, StaticDecoderCache):
            if len(cache.layers) != len(self.layers):
                raise ValueError(
                    f"the static cache has {len(cache.layers)} layers but the model has {len(self.layers)}; build it "
                    "with `model.make_static_cache(max_cache_len)`"
                )
            return
        if not isinstance(cache, Cache) or not hasattr(cache, "layers"):
            raise TypeError(
                "`cache` (`past_key_values`) must be a transformers Cache (a DynamicCache, e.g. from a previous forward, or "
                f"`DynamicCache()`); got {type(cache).__name__}"
            )
        for idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            if idx >= len(cache.layers):
                cache.layers.append(attn.make_cache_layer())
                continue
            existing = cache.layers[idx]
            if attn.accepts_cache_layer(existing):
                continue
            if type(existing) is DynamicLayer and not existing.is_initialized:
                cache.layers[idx] = attn.make_cache_layer()
                continue
            raise TypeError(
                f"`cache` (`past_key_values`) layer {idx} is a {type(existing).__name__}, which cannot serve a {attn.kind!r} "
                f"attention layer (it needs a {type(attn.make_cache_layer()).__name__}); pass a DynamicCache "
                "(or a static cache from `model.make_static_cache`; quantized caches are not supported)"
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        key_log_weights: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `[B, N]`): token ids (or pass `inputs_embeds` `[B, N, D]`).
            attention_mask (`torch.Tensor` of shape `[B, past + N]`, *optional*): 1 for real tokens, 0 for padding,
                over the cached and the current tokens (as `generate` passes it).
            position_ids (`torch.LongTensor` of shape `[B|1, N]`, *optional*): text positions (for RoPE / SuSiE);
                default: from `attention_mask` (`cumsum - 1`, so left padding starts real tokens at 0) or from the cache
                length.
            cache (`Cache`, *optional*): a `DynamicCache` (from a previous call, `DynamicCache()`, or
                `model.make_cache()`); it holds text keys only, never registers.  Also accepted as `past_key_values`
                (its name before transformers 5.24); the output holds it under the installed name (`CACHE_NAME`).
            use_cache (`bool`, *optional*): create a cache when none is given, and return it; default: True when
                a cache is given, else `config.use_cache` in eval mode and False in training mode.  A given
                cache is always extended.
            key_log_weights (`torch.Tensor` of shape `[B|1, past + N]` or `[B|1, H, past + N]`, *optional*): a
                log-measure
                added to every score of each key (geometry-aware attention: quadrature weights of non-uniform
                samples), covering the same tokens as `attention_mask`; registers get 0.
            output_hidden_states (`bool`, *optional*): also return the text hidden states entering each layer and the
                final normalised ones.
            output_attentions (`bool`, *optional*): also return each layer's attention weights in `attentions`, a
                tuple of `num_hidden_layers` tensors `[B, H, N, P + past + N]` (default: `config.output_attentions`).
                Row `i` is text query `i` of this call; the columns are the layer's `P` prefix keys first (the `R`
                register tokens; scalar-sort / hybrid-sort layers with a sink: the sink, then the registers, so `P`
                can differ between layers), then every text token in order (`past` cached, then the `N` new ones).
                Padded, future and out-of-window keys get 0; rows are normalised (sum 1 over the allowed keys, up to
                GKA's `eps`; `rbf_normalize=False` gives the unnormalised kernel values).  Register rows are not
                included.  The text attention then runs the materialised "naive" reference (`O(N * (P + past + N))`
                memory per layer); the outputs equal those of the configured backend up to rounding.  Not available
                for a decode step through a `SortedScalarCache` (it reads a window of the cache): run a forward without
                a cache (`use_cache=False`) over the whole sequence instead.
        """
        cache = resolve_cache_argument(cache, past_key_values)
        _check_input_tensors(input_ids, inputs_embeds, self.config.hidden_size)
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        if output_attentions is None:
            output_attentions = bool(getattr(self.config, "output_attentions", False))
        if use_cache is None:
            use_cache = cache is not None or (self.config.use_cache and not self.training)
        if (
            self.gradient_checkpointing
            and self.training
            and torch.is_grad_enabled()
            and (use_cache or cache is not None)
        ):
            # A checkpointed layer runs twice (forward, then the backward's replay), so it must not write a cache.
            # transformers' GradientCheckpointingLayer drops the cache argument itself, but under the name of the
            # installed version (`past_key_values` before 5.24, `cache` after): dropped here, for both.
            use_cache, cache = False, None

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, seq_len = inputs_embeds.shape[:2]

        if use_cache and cache is None:
            cache = self.make_cache()
        if cache is not None:
            self._prepare_cache(cache)
        if output_attentions:
            # before any layer runs: a refused call must not leave some cache layers extended
            for layer in self.layers:
                problem = layer.self_attn.output_attentions_error(cache)
                if problem is not None:
                    raise ValueError(problem)
        static = isinstance(cache, StaticDecoderCache)
        # A static cache's step over a mask of the new tokens only (or no mask) needs no host-side length: its
        # positions come from the cache, and reading the length would synchronise with the device on every token.
        step_mask_only = static and attention_mask is not None and attention_mask.shape[-1] == seq_len
        needs_length = cache is not None and not (static and (attention_mask is None or step_mask_only))
        past_len = cache.get_seq_length() if needs_length else 0
        total = past_len + seq_len
        if static and (key_log_weights is not None or output_attentions):
            raise ValueError(
                "`key_log_weights` and `output_attentions` are not available with the static cache "
                "(cache_implementation='static'); use the dynamic cache"
            )

        # A static cache also takes a mask over the new tokens only ([B, N]; generate passes that, so a decode step has
        # the same shapes at every length): it remembers the padding and the positions of the cached tokens.
        if attention_mask is not None and (step_mask_only or isinstance(total, torch.Tensor)):
            # (a compiled step over a static cache: the length is a device tensor, checked in eager mode only)
            attention_mask = attention_mask.to(inputs_embeds.device)
        elif attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                raise ValueError(
                    "`attention_mask` must be a 2-D padding mask [B, past + N] (1 = real token, 0 = padding); got "
                    f"{getattr(attention_mask, 'shape', attention_mask)}"
                )
            if attention_mask.shape[0] not in (1, batch) or attention_mask.shape[1] != total:
                raise ValueError(
                    f"`attention_mask` must have shape [B, past + N] = [{batch}, {past_len} + {seq_len}] "
                    "(it covers the "
                    f"cached tokens too); got {tuple(attention_mask.shape)}"
                )
            attention_mask = attention_mask.to(inputs_embeds.device)
        if key_log_weights is not None:
            _check_key_tensor(
                "key_log_weights",
                key_log_weights,
                batch,
                total,
                self.config.num_attention_heads,
                f"[B, past + N] or [B, H, past + N] = [{batch}, {total}] or "
                f"[{batch}, {self.config.num_attention_heads}, {total}]",
            )
            key_log_weights = key_log_weights.to(inputs_embeds.device)

        # A mask with no padding is dropped so the kernels can take their unmasked fast paths.  Not with a static
        # cache: its layers take the padding from the cache (slot masks), and the check (a device read) would
        # synchronise every decode step.
        drop_check = attention_mask is not None and not static and not torch.compiler.is_compiling()
        mask_rows = None
        if drop_check and bool(attention_mask.all()):
            mask_rows, attention_mask = attention_mask.shape[0], None

        if position_ids is None and static:
            step_valid = attention_mask[:, -seq_len:].to(torch.bool) if attention_mask is not None else None
            position_ids = cache.positions(step_valid, batch, seq_len, inputs_embeds.device)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -seq_len:]
            else:
                # (a dropped mask had no padding: `cumsum - 1` of it is this range, in as many rows; one op, not five)
                position_ids = torch.arange(past_len, past_len + seq_len, device=inputs_embeds.device).unsqueeze(0)
                if mask_rows is not None and mask_rows != 1:
                    position_ids = position_ids.expand(mask_rows, -1)
        position_ids = position_ids.to(inputs_embeds.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.dim() != 2 or position_ids.shape[-1] != seq_len:
            raise ValueError(
                f"`position_ids` must have shape [B, N] with N = {seq_len}; got {tuple(position_ids.shape)}"
            )
        position_embeddings = self.position_frequencies(position_ids)
        if static:
            # every static layer records which of this step's tokens are padding (its slot mask)
            step_valid = attention_mask[:, -seq_len:].to(torch.bool) if attention_mask is not None else None
            cache.begin_step(step_valid, batch, seq_len, inputs_embeds.device)

        # one flat buffer of text rows then register rows, or the text rows with the registers beside them (the
        # register stream; see DecoderLayer and `register_path`)
        text_shape = (batch, seq_len)
        registers = None
        if self.register_tokens is not None:
            registers = self.register_tokens.to(inputs_embeds.dtype).unsqueeze(0)
        memoised = registers is not None and cache is not None and not torch.is_grad_enabled()
        path = register_path_for(inputs_embeds.device, memoised, self.layers[0]) if registers is not None else None
        stream = path is not None and path != "rows"
        if path is not None and not torch.compiler.is_compiling():
            # visible: the register path of the last forward ("compiled (<torch.compile mode>)" for the compiled one)
            shown = path
            if path == "compiled":
                mode = register_compile_mode_for(self.layers[0], inputs_embeds.device)
                if mode == "reduce-overhead":
                    # Every forward is a new step for cudagraph trees: the register graphs' outputs of an earlier
                    # forward (an evaluation between training steps, the previous step) are no longer read, so
                    # the next replays may reuse their memory.  Without this mark, an evaluation forward between
                    # two training steps read outputs a replay had overwritten, and interleaved models fell off the
                    # graphs' fast path ("pending, uninvoked backwards"; benchmarks/results/h100-2026-11-26e).
                    torch.compiler.cudagraph_mark_step_begin()
                shown = f"compiled ({mode})"
            self.last_register_path = shown
        rows = inputs_embeds.reshape(-1, inputs_embeds.shape[-1]) if stream else join_rows(inputs_embeds, registers)
        register_memo = self._register_memo(cache, registers) if stream and memoised else None

        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        global _PROJECTION_COPIES
        outer_copies = _PROJECTION_COPIES
        _PROJECTION_COPIES = projection_copies_for(self, cache, inputs_embeds.device)  # `decode_projection_copies`
        try:
            for layer in self.layers:
                if stream:
                    hidden_states, register_states = rows.view(*text_shape, -1), registers
                else:
                    hidden_states, register_states = split_rows(rows, text_shape)
                if output_hidden_states:
                    all_hidden_states += (hidden_states,)
                rows, weights, registers = layer(
                    hidden_states,
                    register_states,
                    rows,
                    position_embeddings=position_embeddings,
                    cache=cache,
                    attention_mask=attention_mask,
                    key_log_weights=key_log_weights,
                    use_cache=use_cache,
                    output_attentions=output_attentions,
                    register_memo=register_memo,
                    register_step_path=path,
                )
                if output_attentions:
                    all_attentions += (weights,)
        finally:
            _PROJECTION_COPIES = outer_copies
        hidden_states = self.norm(rows.view(*text_shape, -1) if stream else split_rows(rows, text_shape)[0])
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            **cache_field(cache),
        )
        if return_dict is False:
            return output.to_tuple()
        return output


class DecoderForCausalLM(DecoderPreTrainedModel, GenerationMixin):
    """The backbone with a (tied by default) LM head; the loss goes through ``self.loss_function``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    base_model_class: type[DecoderModel] = DecoderModel

    def __init__(self, config: DecoderConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def make_cache(self) -> DynamicCache:
        """An empty cache with the layers this model needs (what ``generate`` uses)."""
        return self.model.make_cache()

    def make_static_cache(self, max_cache_len: int | None = None, **settings):
        """An empty fixed-capacity cache (what ``generate(..., cache_implementation="static")`` uses; ``settings``:
        ``max_cache_bytes`` (size it in bytes instead of tokens) and the sorted families' overrides, e.g.
        ``decode_window``, ``block_size``)."""
        return self.model.make_static_cache(max_cache_len, **settings)

    def create_masks_for_generate(self, *args, attention_mask=None, inputs_embeds=None, **kwargs):
        """``generate`` turns the 2-D padding mask into transformers' 4-D masks for compileable caches; our layers take
        the 2-D mask.  With our static cache only the new tokens' columns are passed (``[B, N]``: the cache keeps the
        padding and positions of the cached ones), so a decode step has fixed shapes and a compiled step (transformers
        compiles it on the GPU) does not recompile as the sequence grows."""
        cache = kwargs.get(CACHE_NAME, kwargs.get("cache", kwargs.get("past_key_values")))
        if isinstance(cache, StaticDecoderCache) and attention_mask is not None and inputs_embeds is not None:
            # A copy with canonical strides: the slice's strides grow with the sequence, and a compiled step guards on
            # them.  `.contiguous()` is not enough: at batch 1 the [1, N] slice already counts as contiguous and keeps
            # its stride, so every decode step failed the guard, recompiled with a dynamic stride, and CUDA graphs
            # then recorded a new graph per step (measured on an H100: 18-22 ms per token instead of about 1).
            return attention_mask[:, -inputs_embeds.shape[1] :].clone(memory_format=torch.contiguous_format)
        return attention_mask

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """Create the model's own cache for ``generate`` (same signature from transformers 5.17 to 5.24); it goes into
        ``model_kwargs`` under the installed cache name only (5.24 warns at every step when both names are there)."""
        if generation_cache(model_kwargs) is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        implementation = generation_config.cache_implementation
        if implementation not in (None, "dynamic", "static"):
            raise ValueError(
                f"{type(self).__name__}: `cache_implementation={implementation!r}` is not supported; use None / "
                "'dynamic' (the model's own dynamic cache) or 'static' (its fixed-capacity cache, for torch.compile)"
            )
        if implementation == "static":
            model_kwargs[CACHE_NAME] = self._static_cache_for_generation(generation_config, *args, **kwargs)
            return
        cache = self.model.make_cache()
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording()
        model_kwargs[CACHE_NAME] = cache

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``; the concatenated projection weights its decode steps kept
        (``decode_projection_copies``) are freed when it returns."""
        try:
            return super().generate(*args, **kwargs)
        finally:
            drop_projection_copies(self)

    def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        """transformers' prefill (chunked with ``generate(..., prefill_chunk_size=...)``), with the cache marked as
        prefilling: the sorted caches then attend exactly for every prompt chunk, as for an unchunked prompt (their
        windowed read is for decode steps), so chunked prefill gives the logits of unchunked prefill.

        Prompt chunks run eagerly even where ``generate`` compiles the decode step (CUDA + a compileable cache): a
        chunk's cache writes and reads are sized by host-side lengths, which a compiled step would specialise on and
        recompile for at every chunk; a chunk is large enough to be compute-bound anyway."""
        drop_projection_copies(self)  # a generation starts from the weights as they are now
        cache = generation_cache(model_kwargs)
        if cache is None:
            return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        if generation_config.prefill_chunk_size is not None and not generation_config.disable_compile:
            generation_config = copy.copy(generation_config)
            generation_config.disable_compile = True
        cache.prefilling = True
        try:
            return super()._prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        finally:
            cache.prefilling = False

    def _static_cache_for_generation(self, generation_config, *args, **kwargs):
        """The static cache of ``generate``: ``max_cache_length`` (the last argument transformers 5.17-5.24 pass to
        ``_prepare_cache_for_generation``, prompt + new tokens) raised to ``generation_config.max_cache_len``."""
        if getattr(generation_config, "is_assistant", False):
            raise ValueError("cache_implementation='static' cannot serve assisted decoding (it needs cache cropping)")
        max_len = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
        if max_len is None:
            max_len = generation_config.max_length
        max_len = max(int(max_len), int(getattr(generation_config, "max_cache_len", None) or 0))
        # As transformers' own static cache: never smaller than the previous call's, so that a later generate with
        # fewer new tokens or a shorter prompt reuses the compiled decode step (a new capacity is a new buffer shape,
        # i.e. a recompilation, then a dynamic-shape graph)
        max_len = max(max_len, getattr(self, "_previous_max_cache_length", -1))
        self._previous_max_cache_length = max_len
        # `generate(..., cache_config={...})`: the sorted families' static settings (e.g. "block_size", "decode_window")
        settings = dict(generation_config.cache_config or {})
        # As transformers' own static cache: the same cache object (its buffers reset in place) serves every generate
        # call with the same batch size, capacity and settings.  A new cache means new buffer addresses, and the CUDA
        # graphs of a compiled decode step are recorded for the addresses they saw (a new cache: a re-recording).
        batch = kwargs.get("batch_size", args[1] if len(args) > 1 else None)
        key = (batch, max_len, repr(sorted(settings.items())), self.dtype, self.device)
        reusable = getattr(self, "_generation_static_cache", None)
        if reusable is not None and reusable[0] == key and reusable[1].buffer_batch_size() in (None, batch):
            reusable[1].reset()
            return reusable[1]
        # the batch only sizes the sorted families' blocks (their insert's traffic grows with the rows)
        cache = self.make_static_cache(max_len, **{"batch_size": batch, **settings})
        self._generation_static_cache = (key, cache)
        return cache

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
    ) -> CausalLMOutputWithPast:
        r"""
        Args: those of the base model's forward, plus
            labels (`torch.LongTensor` of shape `[B, N]`, *optional*): next-token targets in the usual HF convention
                (not shifted; -100 = ignored).  The loss is
                ``self.loss_function(logits, labels, vocab_size, **kwargs)``,
                so `num_items_in_batch` (passed by `Trainer`) makes gradient accumulation exact.
            logits_to_keep (`int` or `torch.Tensor`): compute logits only for the last `logits_to_keep` positions
                (0 = all) or for the given indices.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=resolve_cache_argument(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            key_log_weights=key_log_weights,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **cache_field(output_cache(outputs)),
        )
        if return_dict is False:
            return output.to_tuple()
        return output


__all__ = [
    "DecoderAttention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderMLP",
    "DecoderModel",
    "DecoderPreTrainedModel",
    "DecoderRMSNorm",
    "DotAttention",
    "SinusoidFrequencies",
    "apply_rotary",
    "apply_rotary_pair",
    "apply_rotary_reference",
    "project_together",
    "rms_normalize",
    "susie_embedding",
]
