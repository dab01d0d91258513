"""Launching a compiled Triton kernel again without triton's per-launch Python.

``fn[grid](*args, **kwargs)`` (``JITFunction.run``) does the same work at every launch: it binds and specialises
every argument (the "binder": the type, 16-byte alignment and small-integer flags of each of our 40-60 arguments and
20-30 constexprs), turns that into a string cache key, looks the compiled kernel up, evaluates the grid, builds the
launch metadata for the profiler hooks and finally calls the compiled launcher.  On the CPU of this project's
machines everything before the launcher takes 27-31 us per forward launch, against 11-13 us here (triton 3.6,
``benchmarks/probe_triton_binder_offline.py``); on the H100 hosts a whole launch cost 0.05-0.18 ms
(``benchmarks/results/h100-2026-11-27j``), three per forward+backward of every layer.

:func:`launch_jit` (and, for autotuned kernels, ``kernels_common.launch_tuned`` through :func:`launch_cached`) keeps,
per kernel, a dict from a cheap key of the call (tensor dtypes, 16-byte alignment and being on a GPU, what triton
specialises integers on, the values of the other non-float arguments, the keyword arguments, the device) to what triton
compiled for it (the launcher, the CUDA function and its packed metadata, the constexpr values in signature order, the
keywords it launched with: an autotuned kernel's config among them).  The key is at least as fine as triton's
specialisation and the autotuner's tuning key (equal keys mean equal specialisations and configs), so a hit launches
exactly the kernel ``fn.run`` would, through the same launcher call, the tensors passed as data pointers; a miss goes
through triton (which compiles and tunes if needed) and records the result.  Measured offline (triton 3.6, this
project's CPU): an autotuned forward launch through ``launch_tuned`` costs 15 us before the driver call, against 32 us
for the autotune key plus ``JITFunction.run`` before.  Nothing is skipped that could change the launch: launches with
triton's launch hooks (proton, ``knobs.runtime.launch_enter_hook``), pre-run hooks or a stage-inspection hook installed
go through triton, as do launches under the interpreter and triton versions whose launch protocol is not the one checked
here (3.4-3.9: ``CompiledKernel.run(grid..., stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*every_parameter)``).

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
except ImportError:  # the package works without triton
    triton = None
# triton's settings and hooks (3.4+; older tritons are refused by direct_launch_state before the hooks are read)
_knobs = getattr(triton, "knobs", None)

logger = logging.getLogger(__name__)

_SWITCH_VALUES = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


def parse_switch(value: str):
    """``HF_RBF_TRITON_DIRECT_LAUNCH``'s value as a bool; an unknown value is kept as it is, and the first fused
    launch then raises (:func:`direct_launch_state`) instead of guessing."""
    return _SWITCH_VALUES.get(value.strip().lower(), value)


DIRECT_LAUNCH = parse_switch(os.environ.get("HF_RBF_TRITON_DIRECT_LAUNCH", "1"))
# one entry per distinct call signature (integers by their specialisation class, so a decode loop over growing
# lengths makes a handful); the dict is emptied when it reaches this size (the next launches go through triton and
# refill it)
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
    """None when :func:`launch_jit` launches compiled kernels directly, else why not (a sentence).  Raises
    ``ValueError`` for a ``DIRECT_LAUNCH`` (``HF_RBF_TRITON_DIRECT_LAUNCH``) that is not one of the switch values."""
    if not isinstance(DIRECT_LAUNCH, bool):
        raise ValueError(
            f"HF_RBF_TRITON_DIRECT_LAUNCH (hf_rbf.kernels_launch.DIRECT_LAUNCH) must be one of "
            f"{', '.join(_SWITCH_VALUES)} (or True / False); got {DIRECT_LAUNCH!r}"
        )
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
    if getattr(fn, "pre_run_hooks", None):
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


def _layout(types: tuple, by_value: frozenset) -> tuple:
    """For one tuple of argument types: a getter of the tensor arguments, a getter of the specialised non-tensor ones
    (everything but floats, which triton never specialises), the tensors' positions, and which of the non-tensor ones
    are integers keyed by their specialisation class (:func:`_int_class`; those in ``by_value`` are keyed by value)."""
    tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
    others = [i for i, t in enumerate(types) if not issubclass(t, torch.Tensor) and t is not float]
    classed = tuple(j for j, i in enumerate(others) if types[i] is int and i not in by_value)
    # the last item: this layout's memo of _classed (raw non-tensor values -> their key form)
    return _getter(tensors), _getter(others), tuple(tensors), classed, {}


_LAYOUTS: dict = {}  # (tuple of argument types, by-value positions) -> _layout(...)
_I32, _I64 = range(-(2**31), 2**31), range(-(2**63), 2**63)
# Entries per layout of the memo of integer classes: a training shape repeats its values at every step, a decode step
# brings new lengths (one entry each); cleared when full, like the launch cache.
CLASS_MEMO_LIMIT = 1024
# the tensors' parts of a key, C-level maps over the call's tensors / pointers: (dtype, on a GPU), 16-byte alignment
_DTYPE_CUDA = operator.attrgetter("dtype", "is_cuda")
_ALIGNMENT = (15).__and__


def _int_class(x: int) -> tuple:
    """What triton specialises an integer argument on (``native_specialize_impl``, triton 3.4-3.9): 1 is a
    constant; any other value by its type (i32, i64 or u64, from its range) and whether it is divisible by 16.
    Lengths, offsets and strides that change from call to call (a decode step's cache length) but keep their
    class run the same compiled kernel, which reads the value at launch."""
    if x == 1:
        return (1,)
    return (x % 16 == 0, x in _I32, x in _I64)


def _classed(others: tuple, classed: tuple, memo: dict) -> tuple:
    """``others`` with the integers at the positions ``classed`` replaced by :func:`_int_class`, through ``memo``:
    measured on this project's CPU, the 35-41 integers of a fused launch took 10-16 us to class one by one, a lookup of
    the same values about 1 us."""
    try:
        hit = memo.get(others)
    except TypeError:  # an unhashable argument: the key will not be usable either (launch_cached falls back)
        hit = None
        memo = None
    if hit is not None:
        return hit
    out = list(others)
    for j in classed:
        out[j] = _int_class(out[j])
    out = tuple(out)
    if memo is not None:
        if len(memo) >= CLASS_MEMO_LIMIT:
            memo.clear()
        memo[others] = out
    return out


def _key_and_pointers(args, kwargs, device: int, by_value: frozenset = frozenset()):
    """``(key, tensor positions, tensor data pointers)`` of a launch: see :func:`call_key`."""
    types = tuple(map(type, args))
    layout = _LAYOUTS.get((types, by_value))
    if layout is None:
        layout = _LAYOUTS[(types, by_value)] = _layout(types, by_value)
    tensor_getter, other_getter, positions, classed, memo = layout
    tensors = tensor_getter(args)
    pointers = [t.data_ptr() for t in tensors]
    others = other_getter(args)
    if classed:
        others = _classed(others, classed, memo)
    key = (
        device,
        tuple(kwargs.items()),
        types,
        others,
        tuple(map(_DTYPE_CUDA, tensors)),
        tuple(map(_ALIGNMENT, pointers)),
    )
    return key, positions, pointers


def call_key(args, kwargs, device: int, by_value: frozenset = frozenset()) -> tuple:
    """The cache key of a launch: every argument's type; tensors by dtype, 16-byte alignment (what triton
    specialises a tensor on) and whether they are on a GPU; floats by type alone (triton never specialises them);
    integers by what triton specialises them on (:func:`_int_class`), those at the positions ``by_value`` (an
    autotuner's key arguments) by value; every other argument (None, flags) and every keyword by value; the device.
    Equal keys mean equal specialisations (and equal autotuning keys)."""
    return _key_and_pointers(args, kwargs, device, by_value)[0]


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

    def through_triton():
        return fn.run(*args, grid=grid, warmup=False, **kwargs), kwargs

    return launch_cached(fn, fn, grid, args, kwargs, through_triton)


def launch_cached(owner, fn, grid, args, kwargs, through_triton):
    """Launch ``fn`` (a ``triton.jit`` function) for ``args`` / ``kwargs`` directly when ``owner`` (``fn`` itself, or
    the autotuner around it) has launched this call signature before; otherwise ``through_triton()``, which launches
    the usual way and returns ``(compiled kernel or None, the keywords it launched with)``: a compiled kernel is
    recorded under this call's key, with those keywords (the autotuner's config included) for the grid.

    On a hit the tensors go to the launcher as their data pointers (integers): the launcher then neither calls
    ``data_ptr()`` nor asks the driver to check each pointer (``cuPointerGetAttribute``), which triton did for this
    signature at its first launch (the key holds each tensor's dtype, alignment and being on a GPU)."""
    cache = owner.__dict__.get("_hf_rbf_direct")
    if cache is None:  # a compiled kernel's JIT function (the interpreter's stand-in has no compiled launcher)
        cache = owner._hf_rbf_direct = {} if isinstance(fn, triton.runtime.jit.JITFunction) else False
    if cache is False or not _enabled() or _hooks_installed(fn):
        return through_triton()[0]
    device = torch.cuda.current_device()
    by_value = owner.__dict__.get("_hf_rbf_by_value")
    if by_value is None:  # an autotuner's key arguments given positionally: its choice depends on their values
        names = list(getattr(owner, "keys", ()))
        by_value = frozenset(i for i, p in enumerate(fn.params) if p.name in names) if owner is not fn else frozenset()
        owner._hf_rbf_by_value = by_value
    key, positions, pointers = _key_and_pointers(args, kwargs, device, by_value)
    try:
        entry = cache.get(key)
    except TypeError:  # an unhashable argument (a tensor descriptor, say): triton's own path
        return through_triton()[0]
    if entry is None:
        compiled, launched_kwargs = through_triton()
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            if len(cache) >= CACHE_LIMIT:
                cache.clear()
            tail = _tail(fn, len(args), launched_kwargs)
            cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail, launched_kwargs)
        return compiled
    launcher, function, packed_metadata, tail, launched_kwargs = entry
    if callable(grid):
        grid = grid(launched_kwargs)
    launch_args = list(args)
    for i, p in zip(positions, pointers):
        launch_args[i] = p
    n = len(grid)
    launcher(
        grid[0],
        grid[1] if n > 1 else 1,
        grid[2] if n > 2 else 1,
        torch._C._cuda_getCurrentRawStream(device),
        function,
        packed_metadata,
        None,  # launch metadata: only built for launch hooks, and there are none (checked above)
        None,
        None,
        *launch_args,
        *tail,
    )
    return None


# --------------------------------------------------------------------------------------------------------------------
# Launch plans: a fused call's whole preparation, kept per call signature
# --------------------------------------------------------------------------------------------------------------------
# A direct launch still pays for the preparation in front of it at every call: the broadcast strides, the argument
# tuples, the constexpr dict, the TMA check, then the launch key over 50-60 arguments (5-17 us on the H200 host,
# ``benchmarks/probe_launch_key.py --device cuda``).  Everything but the tensors' addresses is a function of the
# tensors' shapes, strides, dtypes and alignment and of the call's flags, so a caller keeps, per such signature
# (``tensor_signature`` plus its flags), what :func:`direct_plan` takes from the launch it prepared the long way: the
# compiled launcher, the grid and every non-tensor argument.  A call with a known signature then only reads its
# tensors' addresses and launches (:func:`launch_plan`).  The signature is at least as fine as the launch key of
# :func:`launch_cached` (the same dtypes, alignment and GPU flags, and the shapes and strides that every integer
# argument is computed from), so a plan launches what the long way would launch.

PLAN_LIMIT = 512  # signatures kept per dict of plans (a model has a few per kernel); emptied when full
_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_META = operator.attrgetter("shape", "dtype", "is_cuda")


def tensor_signature(tensors) -> tuple[tuple, list[int]]:
    """``(signature, data pointers)`` of the tensors a launch takes: their shapes, dtypes, being on a GPU, strides
    and 16-byte alignment (the part of a plan's key that the tensors give), and their addresses for the launch."""
    pointers = list(map(_DATA_PTR, tensors))
    return (tuple(map(_META, tensors)), tuple(map(_STRIDE, tensors)), tuple(map(_ALIGNMENT, pointers))), pointers


def direct_plan(kernel, grid, args, kwargs, n_tensors: int):
    """What :func:`launch_plan` needs to launch this call again with other tensors of the same signature: ``(JIT
    function, launcher, CUDA function, packed metadata, grid x, y, z, fixed arguments, tensor slots)``, or None while
    the call has no direct-launch entry yet (its first launch through the autotuner, direct launches off, a launch
    hook installed) or it does not pass exactly ``n_tensors`` tensors.  With the tensors first (slots None) the fixed
    arguments are every argument after them; otherwise every argument with None in the tensors' slots (their
    positions).  Call it right after launching ``kernel[grid](*args, **kwargs)`` through :func:`launch_jit` /
    ``launch_tuned``."""
    fn = kernel if getattr(kernel, "configs", None) is None else kernel.fn  # an autotuner's JIT function
    cache = kernel.__dict__.get("_hf_rbf_direct")
    if not cache or not _enabled() or _hooks_installed(fn):
        return None
    by_value = kernel.__dict__.get("_hf_rbf_by_value") or frozenset()
    key, positions, _ = _key_and_pointers(args, kwargs, torch.cuda.current_device(), by_value)
    entry = cache.get(key)
    if entry is None or len(positions) != n_tensors:
        return None
    launcher, function, packed_metadata, tail, launched_kwargs = entry
    g = tuple(grid(launched_kwargs) if callable(grid) else grid) + (1, 1)
    if positions == tuple(range(n_tensors)):
        fixed, slots = tuple(args[n_tensors:]) + tail, None
    else:
        taken = set(positions)
        fixed, slots = tuple(None if i in taken else x for i, x in enumerate(args)) + tail, positions
    return (fn, launcher, function, packed_metadata, g[0], g[1], g[2], fixed, slots)


def plan_allowed(plan) -> bool:
    """Whether a :func:`direct_plan` may be launched now: direct launches on and no launch hook installed (else the
    caller takes the long way, which goes through triton)."""
    return _enabled() and not _hooks_installed(plan[0])


def launch_plan(plan, pointers, device: int) -> None:
    """Launch a :func:`direct_plan` (:func:`plan_allowed` checked) with these tensor addresses, in the order of the
    planned call's tensors, on the current stream of ``device``."""
    _, launcher, function, packed_metadata, gx, gy, gz, fixed, slots = plan
    stream = torch._C._cuda_getCurrentRawStream(device)
    if slots is None:
        launcher(gx, gy, gz, stream, function, packed_metadata, None, None, None, *pointers, *fixed)
        return
    args = list(fixed)
    for i, pointer in zip(slots, pointers):
        args[i] = pointer
    launcher(gx, gy, gz, stream, function, packed_metadata, None, None, None, *args)


def keep_plan(plans: dict, key, plan) -> None:
    """``plans[key] = plan``, the dict emptied first when it holds ``PLAN_LIMIT`` plans."""
    if len(plans) >= PLAN_LIMIT:
        plans.clear()
    plans[key] = plan
