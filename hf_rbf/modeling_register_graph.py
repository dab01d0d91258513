"""The register step of a layer replayed as two CUDA graphs, one for its forward and one for its backward.

Register tokens attend only to each other, so their states at every layer are a function of the parameters alone: the
same ``[1, R, D]`` rows in every training step until the optimiser changes the weights (``modeling_decoder``,
``register_layer_step``).  Computed as a stream beside the text, the step of one layer is about 48 kernels forward and
backward even when compiled (one-row GEMMs, norms, the registers' own attention), launched one by one: host work that
kept models with registers host-bound on an H100 (``benchmarks/results/h100-2026-11-26e``).  Captured once as a CUDA
graph per layer and direction, it costs one graph launch each.

Why a graph of our own and not ``torch.compile(mode="reduce-overhead")``: cudagraph trees manage the outputs of every
replay as one generation of a shared pool, and an evaluation or a ``generate`` between training steps read outputs a
later replay had overwritten (``h100-2026-11-26e``, calls 8 and 9).  Here each layer owns its graphs and their memory,
only forwards with gradients replay them (a forward without gradients runs the step as before), and a replay writes
the same values an earlier one did as long as the parameters are unchanged: two forwards before one backward (the
case that corrupts any CUDA-graphed training step) read identical register values.

What a replay assumes, checked on every call (``RegisterStepGraphs.key_for``): the parameters' storage (a capture reads
the weights where they were: ``model.to(...)`` or a ``load_state_dict(..., assign=True)`` change it and trigger a new
capture; a layer that needs more than ``MAX_CAPTURES`` captures goes back to the plain step, with a warning), which of
them require gradients (LoRA), the states' shape and dtype, the autocast state, and training mode.  Dropout inside the
step would be replayed with fresh random numbers, as CUDA graphs do.

Under FSDP2 (``fully_shard``: the layer is an ``FSDPModule``) the unsharded weights are gathered into new memory for
every forward, so a capture cannot read them where they are.  There the graphs own a copy of the layer's parameters
(``copies_parameters``): each replay first copies the current unsharded weights into it (one ``_foreach_copy_``
launch, a read and write of the layer's weights in the compute dtype), the capture depends on the parameters' dtypes
and shapes instead of their addresses, and the backward hands the gradients to the parameters of this forward, which
FSDP2 reduce-scatters as any other.  The copy costs that memory once more per layer (at d768 in bf16 about 14 MB a
layer).

The gradients a backward replay returns are copied out of the graph's buffers: autograd may keep a returned gradient
as a parameter's ``.grad``, and the next replay would then overwrite it (gradient accumulation would lose a step).
That copy is one read and write of the layer's parameter gradients per step; the graph's own gradient buffers hold
one more copy of them (the price of a graph that computes full weight gradients: about 4 bytes per parameter).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
from torch import nn
from torch._C._nn import unflatten_dense_tensors  # views of a flat buffer shaped as templates, one C++ loop
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps with

logger = logging.getLogger(__name__)

# warm-up runs before a capture (lazy initialisation, cuBLAS workspaces and the compiled step's first call must not
# happen inside the capture), and the captures a layer may need before it goes back to the plain step
WARMUP_RUNS = 2
MAX_CAPTURES = 4
# ``torch.cuda.graph``'s ``capture_error_mode`` (``HF_RBF_REGISTER_GRAPH_CAPTURE_MODE``): "global" (PyTorch's default:
# a CUDA call of any thread that is unsafe during a capture fails it), "thread_local" (only the capturing thread's) or
# "relaxed".  (Under DDP the backward capture once failed with "operation would make the legacy stream depend on a
# capturing blocking stream" in "global" and "thread_local" mode alike: not another thread but the parameters'
# gradient accumulators, which ``_run``'s aliases now keep out of the capture; benchmarks/results/h100-2026-11-27h.)
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
capture_error_mode = os.environ.get("HF_RBF_REGISTER_GRAPH_CAPTURE_MODE", "global")


def _autocast_state(device_type: str) -> tuple:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class RegisterStepGraphs:
    """``step(layer, states) -> (next states, prefix tuple)`` of one layer, captured for ``states`` as it is now.

    ``replay(states)`` runs the captured forward (the backward replays with autograd); ``key_for(layer, states)``
    says what the capture depends on (``key``: its value at the capture).  ``capture`` and the two ``_replay_*``
    methods are the CUDA mechanics; a test substitutes them on the CPU to check everything else."""

    def __init__(self, step, layer: nn.Module, states: torch.Tensor):
        self.names = tuple(name for name, p in layer.named_parameters() if p.requires_grad)
        self.params = tuple(p for p in layer.parameters() if p.requires_grad)
        self.copies_parameters = copies_parameters(layer)
        self.key = self.key_for(layer, states, self.params)
        # with copies_parameters the capture reads its own copy of the weights, refreshed before every replay
        self.static_params = [p.detach().clone() for p in self.params] if self.copies_parameters else None
        self.static_states = states.detach().clone().requires_grad_(states.requires_grad)
        self.capture(step, layer)

    @staticmethod
    def key_for(layer: nn.Module, states: torch.Tensor, params: tuple | None = None) -> tuple:
        if params is None:
            params = tuple(p for p in layer.parameters() if p.requires_grad)
        if copies_parameters(layer):  # the weights are copied in: their layout matters, not where they are
            where = ("copied", tuple((p.dtype, tuple(p.shape)) for p in params))
        else:
            where = tuple(p.data_ptr() for p in params)
        return (
            tuple(states.shape),
            states.dtype,
            states.device,
            states.requires_grad,
            _autocast_state(states.device.type),
            layer.training,
            where,
        )

    def _run(self, step, layer):
        """The step on the static input: its tensors (``next states, *prefix``), the prefix's None entries left out
        (``self.layout`` says where they go back).

        The step reads the trainable parameters through aliases made here, swapped in for the run: new leaves on
        the parameters' memory (``p.detach().requires_grad_()``: a replay reads the weights where the optimiser
        updates them), and ``self.surface`` (what ``_grads`` differentiates by) holds the aliases, not the
        parameters, so the parameters' gradient accumulators take no part in a capture.  Those accumulators record
        the stream they were made on:

        - differentiated by the parameters, the backward capture under DDP (which keeps them alive from its
          construction on the default stream) touched the default (legacy) stream and failed ("operation would make
          the legacy stream depend on a capturing blocking stream", benchmarks/results/h100-2026-11-27h, calls 2-3);
        - aliases that were views (``p.view_as(p)``) made each parameter's accumulator on the capture's side stream
          when none existed yet (a first training step without DDP) and kept it alive through ``self.surface``: every
          later backward then accumulated across streams ("The AccumulateGrad node's stream does not match the
          stream of the node that produced the incoming gradient", benchmarks/results/h100-2026-11-27j, call 6)."""
        sources = self.params if self.static_params is None else self.static_params
        aliases = {name: p.detach().requires_grad_() for name, p in zip(self.names, sources)}
        with _reparametrize_module(layer, aliases):
            h, prefix = step(layer, self.static_states)
        self.surface = tuple(t for t in (self.static_states, *aliases.values()) if t.requires_grad)
        self.layout = tuple(p is not None for p in prefix)
        return (h, *(p for p in prefix if p is not None))

    def _grads(self, outputs, grad_outputs):
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
        if not pairs or not self.surface:
            return tuple(None for _ in self.surface)
        return torch.autograd.grad(
            [o for o, _ in pairs], self.surface, [g for _, g in pairs], allow_unused=True
        )

    def capture(self, step, layer) -> None:
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"hf_rbf.modeling_register_graph.capture_error_mode must be one of {CAPTURE_ERROR_MODES}; got "
                f"{capture_error_mode!r} (set in code or through the HF_RBF_REGISTER_GRAPH_CAPTURE_MODE environment "
                "variable)"
            )
        device = self.static_states.device
        if device.type != "cuda":
            raise ValueError(
                f"register_path 'graphed' captures CUDA graphs: it needs the model on a CUDA device, not "
                f"{device.type!r} (use 'compiled', 'stream' or 'rows' there)"
            )
        enabled, dtype = _autocast_state(device.type)
        # the capture records the autocast casts of this forward; autocast's cache (weights cast once per autocast
        # region) would keep casts made inside the capture alive outside it, which CUDA graphs do not allow
        with torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=False):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    outputs = self._run(step, layer)
                    self._grads(outputs, [torch.ones_like(o) if o.requires_grad else None for o in outputs])
            torch.cuda.current_stream(device).wait_stream(side)
            del outputs
            pool = torch.cuda.graph_pool_handle()
            self._fwd, self._bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._fwd, pool=pool, capture_error_mode=capture_error_mode):
                outputs = self._run(step, layer)
            self.static_grad_outputs = tuple(torch.zeros_like(o) if o.requires_grad else None for o in outputs)
            with torch.cuda.graph(self._bwd, pool=pool, capture_error_mode=capture_error_mode):
                self._pack_grads(self._grads(outputs, self.static_grad_outputs))
            self._keep_outputs(outputs)

    def _pack_grads(self, grads) -> None:
        """Lay the captured gradients out in one flat buffer per dtype (a ``cat`` inside the backward capture), so
        that a replay's gradients leave the graph's memory in one copy per dtype instead of one per parameter
        (``_ReplayStep.backward``: 15-20 per layer, each a launch and an allocation on the host).  ``grad_slots[i]``:
        ``(dtype, offset, numel, shape)`` of gradient ``i`` (None for an unused one)."""
        groups: dict = {}
        for i, g in enumerate(grads):
            if g is not None:
                groups.setdefault(g.dtype, []).append(i)
        slots = [None] * len(grads)
        flat = {}
        for dtype, indices in groups.items():
            flat[dtype] = torch.cat([grads[i].reshape(-1) for i in indices])
            offset = 0
            for i in indices:
                slots[i] = (dtype, offset, grads[i].numel(), tuple(grads[i].shape))
                offset += grads[i].numel()
        self.grad_slots = tuple(slots)
        self.flat_grads = flat
        # what a replay's backward cuts each flat copy into, in one C++ call per dtype (``unflatten_dense_tensors``:
        # a narrow and a view per gradient, without a Python round trip each): shape templates on the meta device
        self.grad_templates = {
            dtype: [torch.empty(slots[i][3], device="meta") for i in indices] for dtype, indices in groups.items()
        }
        order = [None] * len(grads)
        for dtype, indices in groups.items():
            for j, i in enumerate(indices):
                order[i] = (dtype, j)
        self.grad_order = tuple(order)

    def _keep_outputs(self, outputs) -> None:
        """Keep the captured outputs as buffers without their autograd history.  Kept with it, they kept the
        capture's autograd nodes alive, among them the parameters' gradient accumulators, which record the stream
        they were made on: every later backward then accumulated the parameters' gradients across streams (an
        H100 run warned "The AccumulateGrad node's stream does not match ...", session 9)."""
        self.differentiable = tuple(o.requires_grad for o in outputs)
        self.static_outputs = tuple(o.detach() for o in outputs)

    def _replay_forward(self) -> None:
        self._fwd.replay()

    def _replay_backward(self) -> None:
        self._bwd.replay()

    def replay(self, states: torch.Tensor, layer: nn.Module | None = None):
        """``(next states, prefix)`` from the captured forward; differentiable (the backward replays its graph).
        ``layer``: where the parameters of this forward are read with ``copies_parameters`` (FSDP2 swaps the
        unsharded ones in for each forward); the gradients go to them."""
        params = self.params
        if self.copies_parameters:
            params = tuple(p for p in layer.parameters() if p.requires_grad)
        outputs = _ReplayStep.apply(self, states, *params)
        tensors = iter(outputs[1:])
        return outputs[0], tuple(next(tensors) if present else None for present in self.layout)


class _ReplayStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: RegisterStepGraphs, states: torch.Tensor, *params):
        ctx.graphs = graphs
        if states.data_ptr() != graphs.static_states.data_ptr():
            graphs.static_states.detach().copy_(states)
        if graphs.static_params is not None:
            torch._foreach_copy_(graphs.static_params, list(params))
        graphs._replay_forward()
        outputs = tuple(o.detach() for o in graphs.static_outputs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, graphs.differentiable) if not d])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        graphs = ctx.graphs
        for buffer, grad in zip(graphs.static_grad_outputs, grad_outputs):
            if buffer is not None:
                buffer.copy_(grad)
        graphs._replay_backward()
        # one copy of each flat buffer: autograd may keep a returned tensor as a parameter's .grad, which the next
        # replay would overwrite; the gradients are contiguous views of it, shaped as the parameters (a captured
        # [1, H] gradient with strides (1, 1) made DDP warn "grad strides do not match bucket view strides")
        views = {
            dtype: unflatten_dense_tensors(buffer.clone(), graphs.grad_templates[dtype])
            for dtype, buffer in graphs.flat_grads.items()
        }
        grads = iter(None if where is None else views[where[0]][where[1]] for where in graphs.grad_order)
        states_grad = next(grads) if graphs.static_states.requires_grad else None
        param_grads = tuple(next(grads) for _ in graphs.params)
        return (None, states_grad, *param_grads)


# one entry per layer (weak: the graphs go with the model); the layers that went back to the plain step
_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GIVEN_UP: weakref.WeakSet = weakref.WeakSet()
graphs_class = RegisterStepGraphs  # a test's CPU emulation replaces it
_checkpoint_logged = False  # the checkpointing fallback is logged once per process


def graphed_register_step(step, layer: nn.Module, states: torch.Tensor):
    """``step(layer, states)`` through the layer's captured graphs: captured at the first call, and again when what
    the capture assumed changed (``RegisterStepGraphs.key_for``); ``step`` itself where gradients are off, under
    activation checkpointing (logged once), and for a layer that needed more than ``MAX_CAPTURES`` captures (its
    weights move every step: FSDP1, offloading; FSDP2's are copied in, see ``copies_parameters``)."""
    if not torch.is_grad_enabled() or layer in _GIVEN_UP:
        return step(layer, states)
    if getattr(layer, "gradient_checkpointing", False):
        # activation checkpointing runs the layer again inside the backward, and the non-reentrant kind checks that
        # the recomputation saves as many tensors as the forward did: a capture inside the first forward saves more
        global _checkpoint_logged
        if not _checkpoint_logged:
            _checkpoint_logged = True
            logger.info("register steps under activation checkpointing run without CUDA graphs (register_path "
                        "'graphed' keeps the compiled step there)")
        return step(layer, states)
    graphs = _GRAPHS.get(layer)
    if graphs is None or graphs.key != graphs_class.key_for(layer, states):
        count = _CAPTURES.get(layer, 0) + 1
        _CAPTURES[layer] = count
        if count > MAX_CAPTURES:
            logger.warning(
                "register step of layer %s captured %d times (its parameters or settings keep changing): it runs "
                "without CUDA graphs from now on", getattr(getattr(layer, "self_attn", None), "layer_idx", "?"),
                count - 1,
            )
            _GIVEN_UP.add(layer)
            _GRAPHS.pop(layer, None)
            return step(layer, states)
        _GRAPHS.pop(layer, None)  # free the old capture's memory first
        graphs = graphs_class(step, layer, states)
        _GRAPHS[layer] = graphs
    return graphs.replay(states, layer)


def copies_parameters(layer: nn.Module) -> bool:
    """Whether ``layer``'s graphs copy its parameters in before each replay: under FSDP2 (``fully_shard`` mixes
    ``FSDPModule`` into the layer's class), whose unsharded parameters are new tensors in new memory every forward."""
    return _is_fsdp2_module(type(layer))


@functools.lru_cache(maxsize=None)
def _is_fsdp2_module(cls: type) -> bool:
    return any(c.__name__ == "FSDPModule" for c in cls.__mro__)


def captures(layer: nn.Module) -> int:
    """How many times ``layer``'s register step has been captured (0: never)."""
    return _CAPTURES.get(layer, 0)
