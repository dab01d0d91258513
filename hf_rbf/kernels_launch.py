"""Launching a compiled Triton kernel again without triton's per-launch Python.

``fn[grid](*args, **kwargs)`` (``JITFunction.run``) does the same work at every launch: it binds and specialises
every argument (the "binder": the type, 16-byte alignment and small-integer flags of each of our 40-60 arguments and
20-30 constexprs), turns that into a string cache key, looks the compiled kernel up, evaluates the grid, builds the
launch metadata for the profiler hooks and finally calls the compiled launcher.  On the CPU of this project's
machines everything before the launcher takes 27-31 us per forward launch, against 11-13 us here (triton 3.6,
``benchmarks/probe_triton_binder_offline.py``); on the H100 hosts a whole launch cost 0.05-0.18 ms
(``benchmarks/results/h100-2026-11-27j``), three per forward+backward of every layer.

:func:`launch_jit` keeps, per kernel, a dict from a cheap key of the call (tensor dtypes and 16-byte alignment, the
values of the integer and other non-float arguments, the keyword arguments, the device) to what triton compiled for
it (the launcher, the CUDA function and its packed metadata, the constexpr values in signature order).  The key is
at least as fine as triton's specialisation (equal keys mean equal specialisations), so a hit launches exactly the
kernel ``fn.run`` would, through the same launcher call; a miss goes through ``fn.run`` (which compiles if needed)
and records the result.  Nothing is skipped that could change the launch: launches with triton's launch hooks
(proton, ``knobs.runtime.launch_enter_hook``), pre-run hooks or a stage-inspection hook installed go through
``fn.run``, as do launches under the interpreter and triton versions whose launch protocol is not the one checked
here (3.4-3.9: ``CompiledKernel.run(grid..., stream, function, packed_metadata, launch_metadata, enter_hook,
exit_hook, *every_parameter)``).

``HF_RBF_TRITON_DIRECT_LAUNCH=0`` (or ``kernels_launch.DIRECT_LAUNCH = False``) turns it off; ``direct_launch_state()``
says whether it is on and why not.
"""

from __future__ import annotations

import inspect
import logging
import operator
import os

import torch

try:
    import triton
    from triton import knobs as _knobs
except ImportError:  # the package works without triton
    triton = None
    _knobs = None

logger = logging.getLogger(__name__)

DIRECT_LAUNCH = os.environ.get("HF_RBF_TRITON_DIRECT_LAUNCH", "1").strip().lower() not in ("0", "false", "no", "off")
# one entry per distinct call signature (shapes and strides are part of it); a decode loop over growing lengths makes
# one per length, so the dict is emptied when it reaches this size (the next launches go through triton and refill it)
CACHE_LIMIT = 4096
_CHECKED_VERSIONS = ((3, 4), (3, 9))  # the launch protocol above, read in triton 3.6 and 3.9


def _triton_version() -> tuple[int, int] | None:
    if triton is None:
        return None
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def direct_launch_state() -> str | None:
    """None when :func:`launch_jit` launches compiled kernels directly, else why not (a sentence)."""
    if not DIRECT_LAUNCH:
        return "turned off (HF_RBF_TRITON_DIRECT_LAUNCH=0 or kernels_launch.DIRECT_LAUNCH = False)"
    version = _triton_version()
    if version is None:
        return "triton is not installed or its version is unreadable"
    lo, hi = _CHECKED_VERSIONS
    if not lo <= version <= hi:
        return f"triton {triton.__version__}: the launch protocol was checked for {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]} only"
    return None


_STATE: dict = {}  # DIRECT_LAUNCH -> direct_launch_state()


def _enabled() -> bool:
    """:func:`direct_launch_state` is None, computed once per value of ``DIRECT_LAUNCH`` (logged once)."""
    state = _STATE.get(DIRECT_LAUNCH, "unset")
    if state == "unset":
        state = direct_launch_state()
        _STATE[DIRECT_LAUNCH] = state
        if state is None:
            logger.info("hf_rbf: Triton kernels are launched directly after their first launch (kernels_launch.py)")
        else:
            logger.info("hf_rbf: Triton kernels go through triton's launcher at every launch: %s", state)
    return state is None


def _hooks_installed(fn) -> bool:
    """Whether a launch would run code of someone else's that the direct path skips."""
    if fn.pre_run_hooks:
        return True
    runtime = _knobs.runtime
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime, name, None)
        if hook is not None and getattr(hook, "calls", True):  # HookChain (3.6+): installed when it holds calls
            return True
    return getattr(runtime, "add_stages_inspection_hook", None) is not None


def _getter(positions: list[int]):
    """``args -> tuple(args[i] for i in positions)`` at C speed (``itemgetter`` returns a bare item for one index)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        index = positions[0]
        return lambda args: (args[index],)
    return operator.itemgetter(*positions)


def _layout(types: tuple) -> tuple:
    """Getters of the tensor arguments and of the specialised non-tensor ones (everything but floats, which triton
    never specialises) for one tuple of argument types."""
    tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
    others = [i for i, t in enumerate(types) if not issubclass(t, torch.Tensor) and t is not float]
    return _getter(tensors), _getter(others)


_LAYOUTS: dict = {}  # tuple of argument types -> (tensor getter, other getter)


def call_key(args, kwargs, device: int) -> tuple:
    """The cache key of a launch: every argument's type; tensors by dtype and 16-byte alignment (what triton
    specialises a tensor on); floats by type alone (triton never specialises them); every other argument (integers,
    None, flags) and every keyword by value.  Equal keys mean equal specialisations."""
    types = tuple(map(type, args))
    layout = _LAYOUTS.get(types)
    if layout is None:
        layout = _LAYOUTS[types] = _layout(types)
    tensors, others = layout
    return (
        device,
        tuple(kwargs.items()),
        types,
        others(args),
        *[(t.dtype, t.data_ptr() & 15) for t in tensors(args)],
    )


def _tail(fn, n_args: int, kwargs) -> tuple:
    """The values of the parameters after the positional ones, in signature order (keywords, then defaults): the
    launcher takes every parameter, constexprs included."""
    tail = []
    for param in fn.params[n_args:]:
        name = param.name
        if name in kwargs:
            tail.append(kwargs[name])
        else:
            default = param.default
            if default is inspect.Parameter.empty:
                raise TypeError(f"{fn.__name__}: no value for the parameter `{name}`")
            tail.append(default)
    return tuple(tail)


def launch_jit(fn, grid, args, kwargs):
    """``fn[grid](*args, **kwargs)`` for a ``triton.jit`` function, through the compiled kernel's launcher directly
    when this exact call signature was launched before (see the module docstring).  ``grid``: a tuple or a callable
    of the keyword arguments (``meta["BLOCK_M"]``)."""
    cache = fn.__dict__.get("_hf_rbf_direct")
    if cache is None:  # a compiled kernel's JIT function (the interpreter's stand-in has no compiled launcher)
        cache = fn._hf_rbf_direct = {} if isinstance(fn, triton.runtime.jit.JITFunction) else False
    if cache is False or not _enabled() or _hooks_installed(fn):
        return fn.run(*args, grid=grid, warmup=False, **kwargs)
    device = torch.cuda.current_device()
    key = call_key(args, kwargs, device)
    try:
        entry = cache.get(key)
    except TypeError:  # an unhashable argument (a tensor descriptor, say): triton's own path
        return fn.run(*args, grid=grid, warmup=False, **kwargs)
    if entry is None:
        compiled = fn.run(*args, grid=grid, warmup=False, **kwargs)
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            if len(cache) >= CACHE_LIMIT:
                cache.clear()
            cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, _tail(fn, len(args), kwargs))
        return compiled
    launcher, function, packed_metadata, tail = entry
    if callable(grid):
        grid = grid(kwargs)
    stream = torch._C._cuda_getCurrentRawStream(device)
    n = len(grid)
    launcher(
        grid[0],
        grid[1] if n > 1 else 1,
        grid[2] if n > 2 else 1,
        stream,
        function,
        packed_metadata,
        None,  # launch metadata: only built for launch hooks, and there are none (checked above)
        None,
        None,
        *args,
        *tail,
    )
    return None
