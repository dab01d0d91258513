"""Pieces shared by the fused Triton kernels: the triton import guard, mask arithmetic and autotune helpers.

Every family reduces to one online-softmax loop over key tiles whose score is (log2 units, ``log2(e)`` folded in)

    s_ij = a_h * (q_i . k_j) + kb_j - beta_i * (qs_i - ks_j)^2        (dot part, key bias, scalar part)

``kb_j`` (the *key bias*) holds ``b_h * ||k_j||^2`` (RBF and GKA, ``b_h < 0``), ``log w_j`` (``key_log_weights``)
and ``-inf`` for padded keys.  Where there are key log-weights or padding it is a per-key fp32 vector written once by
:func:`key_bias` (``_key_bias_kernel``), the norm term folded in, so the inner loop spends one load and the same
``fma(qk, a, kb_j)`` that a dot-product kernel spends on its scale.  Where the key norms are the only term (training
without padding: the common case) the kernels compute ``||k_j||^2`` from the key tile they have just loaded
(``KNORM_INLINE``) instead: ``D`` multiply-adds per key and tile, a ``1 / BLOCK_M`` fraction of the tile's dot, and
the key-bias launch and its two ``[B, H, Nk]`` buffers disappear from every call (measured on an H100, each triton
launch costs about 0.15 ms of host time: ``benchmarks/results/h100-profile-2026-11-25``).  Per-query constants (the
query norm of GKA / softmax-free RBF) never enter the inner loop: they are folded into the row statistics (see
``kernels_flash_fwd.py``).

Masks are index arithmetic: for a block of queries the allowed sequence keys form an interval per row, so key tiles
split into a fully allowed middle range (no mask at all) and at most two partly masked edge ranges (the diagonal and
the window's far edge); tiles outside are never visited, which makes windowed attention cost O(N * W).  The first
``P`` keys (register tokens, sinks) are a prefix visible to every query and get their own short loop, so causal tile
skipping is kept for the sequence part.

Triton is optional: without it this module still imports (``HAS_TRITON = False``) and defines no kernels, so a
checkpoint's remote-code copy works on machines without triton.
"""

from __future__ import annotations

import inspect
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the package works without triton; the "triton" backend then reports why it cannot serve
    triton = None
    tl = None
    HAS_TRITON = False

from .kernels_launch import launch_cached, launch_jit  # noqa: E402  (after the triton guard, as its own)

try:
    # Imported under its bare name on purpose: the kernel launches of the ``torch.library.triton_op`` path are literal
    # ``wrap_triton(KERNEL)[grid](...)`` calls, the only form that AOTAutograd's cache key (an AST scan of the op's
    # body, ``torch._library.triton.get_inner_triton_kernels``) recognises (see docs/triton_op_plan.md).
    from torch.library import wrap_triton
except ImportError:  # torch without triton_op support: the traced path is never taken
    wrap_triton = None


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MIN_HEAD_DIM = 1
MIN_DOT_DIM = 16  # the smallest tl.dot operand size: smaller head dims are zero-padded to it
MAX_HEAD_DIM = 256


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _interpreter_state() -> tuple[bool, bool]:
    """(our kernels are interpreted functions, triton's own library functions are too).

    ``@triton.jit`` reads TRITON_INTERPRET when it decorates (triton 3.9) or once at import (3.6), so the variable
    alone can disagree with what was built; and when it is set after triton was imported, triton's own ``@jit``
    library functions (``tl.cdiv``) stay compiled while ours become interpreted, a mix that cannot run at all.
    """
    if not HAS_TRITON:
        return False, False

    def _probe():
        pass

    ours = type(triton.jit(_probe)).__name__ == "InterpretedFunction"
    library = type(tl.cdiv).__name__ == "InterpretedFunction"
    return ours, library


_OURS_INTERPRETED, _LIBRARY_INTERPRETED = _interpreter_state()
# Whether the kernels in this process run in Triton's CPU interpreter (decided when triton decorated them).
DEFINED_INTERPRETED = _OURS_INTERPRETED and _LIBRARY_INTERPRETED
MIXED_INTERPRETER = _OURS_INTERPRETED != _LIBRARY_INTERPRETED


def autotune_enabled() -> bool:
    """Autotuning is on by default on the GPU; ``HF_RBF_TRITON_AUTOTUNE=0`` keeps each kernel's first fitting config.

    The GPU check script turns it off: it compiles dozens of shape/mask variants and correctness does not depend on
    the tile choice.  The interpreter always uses one small config (tiles of 16 exercise every mask edge case).
    """
    return not DEFINED_INTERPRETED and os.environ.get("HF_RBF_TRITON_AUTOTUNE", "1") != "0"


# Below this sequence-length bucket a kernel is a handful of tiles and launch overhead dominates, so the first fitting
# config is taken without timing the others: on the H200 the first TinyStories run (N = 256 training, then float32
# evaluation, generation and CORE at every length bucket from 16 up) spent most of its wall time compiling configs
# for buckets where the choice cannot matter.
SMALL_N_BUCKET = 128


def autotune_subset(configs, nargs):
    """The configs the autotuner times: all of them, one when autotuning is off or the problem is small."""
    if not autotune_enabled() or nargs.get("N_BUCKET", SMALL_N_BUCKET + 1) <= SMALL_N_BUCKET:
        return configs[:1]
    return configs


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bcast_strides(t: torch.Tensor, shape) -> tuple[int, ...]:
    """Strides of ``t`` broadcast to ``shape`` (dims aligned on the right, 0 on broadcast dims), computed in Python:
    ``t.expand(shape).stride()`` would cost an aten op per tensor and call on the host path."""
    n = len(shape)
    if t.dim() == n:  # the common case (every launch of a decode step), without the padding lists: 0.8 us, not 1.4
        return tuple([0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())])
    sizes = [1] * (n - t.dim()) + list(t.shape)
    strides = [0] * (n - t.dim()) + list(t.stride())
    return tuple(0 if size == 1 else stride for size, stride in zip(sizes, strides))


def padded_dim(d: int) -> int:
    """Head dims are padded (with masked loads) to the next power of two, at least 16 (the smallest tl.dot size)."""
    return max(MIN_DOT_DIM, next_pow2(d))


def n_bucket(n: int) -> int:
    """The sequence-length bucket used as autotune key (the best tiles change with N only by orders of magnitude)."""
    return max(16, next_pow2(n))


def key_block_grid(num_prefix_keys: int, nk: int, planes: int):
    """The grid of a dK/dV launch (one program per key block and (batch, value group) plane): the prefix keys' blocks,
    then the sequence keys' blocks, so that no block mixes the two."""
    return lambda meta: (ceil_div(num_prefix_keys, meta["BLOCK_N"]) + ceil_div(nk - num_prefix_keys, meta["BLOCK_N"]),
                         planes)  # fmt: skip


def planes_bucket(planes: int) -> int:
    """The autotune key for how many (batch, head) planes one launch covers: 16, 64, 256 or 1024 (for 1024 and more).

    The best tiles depend on how many programs a launch has for the GPU's SMs, not only on the length: a few planes
    favour small tiles (more programs), many planes large ones (fewer, longer programs).  Without it the first launch
    of a length bucket chose for every later one, and the choice persists on disk (``cache_results``): a batch-2
    warm-up, an evaluation batch or a ``generate`` prefill chose the tiles that training at batch 64 then used.  The
    H100 kernel table of 2026-11-27 shows the pattern: at N = 512, the one length its parallel warm-up (B2) tuned, the
    forward of rbf, GKA and hybrid ran at 1.30-1.32x SDPA-flash, against 1.0-1.1x at the lengths tuned at their own
    batch (``benchmarks/results/h100-2026-11-27i``).  Powers of 4: few keys (each costs one timing round per config,
    not a compile: the value is a plain integer argument, divisible by 16 like every other bucket, so it adds no
    specialisation)."""
    bucket = 16
    while bucket < min(int(planes), 1024):
        bucket *= 4
    return bucket


def triton_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dims=()) -> str | None:
    """None when the fused kernels can serve tensors on ``device`` of ``dtype``; otherwise why not."""
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    if MIXED_INTERPRETER:
        return (
            "TRITON_INTERPRET changed after triton was imported (triton's own functions and these kernels were "
            "built in different modes); set it before importing triton, or not at all"
        )
    if device.type == "cuda":
        if DEFINED_INTERPRETED:
            return "the kernels were defined under TRITON_INTERPRET=1 and cannot run on CUDA tensors"
    elif device.type == "cpu":
        if not DEFINED_INTERPRETED:
            return "the inputs are on the CPU and TRITON_INTERPRET=1 was not set before triton was imported"
    else:
        return f"the inputs are on {device.type}; the triton kernels run on CUDA (or the CPU under TRITON_INTERPRET=1)"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} is not supported by the triton kernels (float16, bfloat16 or float32)"
    for name, d in head_dims:
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            return f"{name} = {d} is outside the triton kernels' range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    return None


_TMA_CAPABLE: dict = {}  # cuda device index -> compute capability >= 9.0 (Hopper's TMA unit)


def tma_unavailable_reason(device: torch.device, views, traced: bool = False) -> str | None:
    """None when the streamed tiles of ``views`` can be read through TMA tensor descriptors; otherwise why not.

    ``views``: ``(name, tensor, strides)`` with ``strides`` the element strides that address its tiles (batch, head,
    row; the last dim is contiguous).  TMA (Hopper and later; the CPU interpreter emulates it, so CI runs this path)
    needs every tile base 16-byte aligned: the data pointer and each of those strides in bytes a multiple of 16.
    ``traced``: the tensors are fake (a ``triton_op`` traced by ``torch.compile``; no data pointer): the storage
    offset in bytes stands for the address (Inductor's buffers and the caching allocator's blocks start 16-byte
    aligned, and Inductor copies graph inputs that are not: ``assume_aligned_inputs`` is off)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capable = _TMA_CAPABLE.get(index)
        if capable is None:
            capable = _TMA_CAPABLE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
        if not capable:
            return "the GPU has no TMA unit (compute capability below 9.0)"
    for name, t, strides in views:
        el = t.element_size()
        if (t.storage_offset() * el if traced else t.data_ptr()) % 16:
            return f"{name} starts at an address that is not 16-byte aligned"
        for s in strides:
            if (s * el) % 16:
                return f"{name} has a stride of {s} elements ({s * el} bytes), not a multiple of 16 bytes"
    return None


def _tma_scratch(size: int, alignment: int, stream):
    """Global memory for the kernels' device-side tensor descriptors (128 bytes each, per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Install :func:`_tma_scratch` as triton's allocator in this thread's context unless one is set (the user's is
    kept).  Triton keeps it in a ``ContextVar``: a forward recomputed in autograd's worker thread (activation
    checkpointing) finds none there, so every launch that creates descriptors checks (one ``ContextVar.get``)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for float32 inputs: tf32 only where torch itself allows tf32 matmuls."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def make_configs(entries, interpret_entries):
    """``triton.Config`` list from ``(kwargs, num_warps, num_stages)`` tuples; the interpreter gets small configs
    (one entry, or a list of them)."""
    if DEFINED_INTERPRETED:
        entries = interpret_entries if isinstance(interpret_entries, list) else [interpret_entries]
    return [triton.Config(dict(kw), num_warps=w, num_stages=s) for kw, w, s in entries]


def shared_memory_fits(block_rows: int, block_cols: int, d_pad: int, dv_pad: int, stages: int, elsize: int) -> bool:
    """Shared-memory estimate against Hopper's 227 KB: the stationary tiles, one buffer per pipeline stage of the
    streamed tiles, and a quarter more for layout-conversion scratch (calibrated on head dim 256, where an estimate
    without it let a 263 KB kernel through)."""
    stationary = block_rows * (d_pad + dv_pad) * elsize
    streamed = max(1, stages) * block_cols * (d_pad + dv_pad) * elsize
    return 1.25 * (stationary + streamed) <= 227 * 1024


def autotune(configs, key, prune):
    """``triton.autotune`` with our pruning; ``cache_results`` (persist choices on disk) where this triton has it."""
    kwargs = {"configs": configs, "key": key, "prune_configs_by": {"early_config_prune": prune}}
    params = inspect.signature(triton.autotune).parameters
    if "cache_results" in params and not DEFINED_INTERPRETED:  # triton 3.6 would ask the (absent) GPU driver
        kwargs["cache_results"] = True
    # short timing runs per config (the default 25 + 100 ms per config adds up over dozens of keys)
    if "do_bench" in params:
        kwargs["do_bench"] = _quick_bench
    else:
        kwargs.update(warmup=5, rep=25)
    return triton.autotune(**kwargs)


def pin_triton_cache_dir() -> str | None:
    """Set ``TRITON_CACHE_DIR`` to the directory Triton uses now (its default, ``~/.triton/cache``), unless it is set.

    Inductor sets ``TRITON_CACHE_DIR`` to its own directory (``<tmp>/torchinductor_<user>/triton/<device>``) when it
    first compiles a kernel in a process, but not when it loads a compiled graph from its disk cache.  So, in a process
    that also runs ``torch.compile`` (the compiled register stream of ``modeling_decoder``), our kernels compiled after
    inductor's first compilation land in inductor's directory, and the next process, whose inductor only loads, looks
    for them in Triton's default one: every kernel compiled and autotuned again on a warm machine (32-38 s at the first
    training step on an H100, ``benchmarks/results/h100-2026-11-26e``).  One directory for the whole process, chosen
    before anything compiles, keeps both caches warm.  Returns the directory (None without Triton)."""
    if not HAS_TRITON:
        return None
    if not os.environ.get("TRITON_CACHE_DIR"):
        knobs = getattr(triton, "knobs", None)
        directory = getattr(getattr(knobs, "cache", None), "dir", None)
        os.environ["TRITON_CACHE_DIR"] = directory or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return os.environ["TRITON_CACHE_DIR"]


def launch_tuned(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` for a kernel wrapped by :func:`autotune`, asking the autotuner only once per
    tuning key.

    triton's ``Autotuner.run`` builds a dict of every argument and scans them for tensor dtypes at every launch: for
    our kernels of 40-60 arguments that is about 0.15 ms of host time per launch on an H100 host, on top of the JIT
    launcher's own 0.15 ms, and a forward+backward makes three tuned launches
    (``benchmarks/results/h100-profile-2026-11-25/host_python.txt``).  The key is computed here from the same inputs
    (the values of the autotuner's ``key`` arguments, then the dtypes of the tensor arguments, in order, exactly as
    ``Autotuner.run`` does); when the autotuner already holds a config for it (chosen in this process or loaded from
    its disk cache), the JIT function is launched directly with that config.  Otherwise the autotuner runs as usual
    and records its choice.  Once a call signature has been launched with a known config, its repeats skip even this
    key: :func:`hf_rbf.kernels_launch.launch_cached` launches the compiled kernel through its launcher directly.
    """
    if getattr(kernel, "configs", None) is None:  # not autotuned
        return launch_jit(kernel, grid, args, kwargs)
    return launch_cached(kernel, kernel.fn, grid, args, kwargs, lambda: _launch_with_config(kernel, grid, args, kwargs))


def _launch_with_config(kernel, grid, args, kwargs):
    """Launch through the JIT function with the autotuner's config for this call when it holds one (returns the
    compiled kernel and the keywords with the config's), else through the autotuner (returns ``(None, None)``: its
    choice is known from the next call on)."""
    configs = kernel.configs
    if len(configs) == 1:
        config = configs[0]
    else:
        n = len(args)
        key = [
            args[i] if 0 <= i < n else kwargs[name]
            for name, i in _key_positions(kernel)
            if 0 <= i < n or name in kwargs
        ]
        for arg in args:
            if hasattr(arg, "dtype"):
                key.append(str(arg.dtype))
        config = kernel.cache.get(tuple(key))
        if config is None or config.pre_hook is not None:
            kernel[grid](*args, **kwargs)
            return None, None
    launched = {**kwargs, **_config_kwargs(config)}
    return kernel.fn.run(*args, grid=grid, warmup=False, **launched), launched


_CONFIG_KWARGS: dict = {}  # id(config) -> (config, config.all_kwargs())


def _config_kwargs(config) -> dict:
    """``config.all_kwargs()`` (its constexprs and compile options), built once per config.  Kept here, not on the
    config: triton's autotuner writes ``config.__dict__`` into its disk cache and rebuilds ``Config(**that)`` in the
    next process, so an attribute of ours there breaks every later process (session 14's FSDP2 call)."""
    entry = _CONFIG_KWARGS.get(id(config))
    if entry is None or entry[0] is not config:
        entry = _CONFIG_KWARGS[id(config)] = (config, config.all_kwargs())
    return entry[1]


def _key_positions(kernel) -> list[tuple[str, int]]:
    """``(name, position in the kernel's signature)`` of each autotune key argument (-1 when the kernel has no such
    argument), computed once per kernel."""
    positions = kernel.__dict__.get("_hf_rbf_key_positions")
    if positions is None:
        names = list(kernel.arg_names)
        positions = [(name, names.index(name) if name in names else -1) for name in kernel.keys]
        kernel._hf_rbf_key_positions = positions
    return positions


def _quick_bench(fn, quantiles=None, **kwargs):
    if DEFINED_INTERPRETED:
        # triton 3.6 times even a single remaining config; the interpreter has no device to time on
        return [1.0] * len(quantiles) if quantiles else 1.0
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


if HAS_TRITON:

    @triton.jit
    def _tile_range(lo_first, lo_last, hi_first, hi_last, n, BLOCK: tl.constexpr):
        """Tiles of ``BLOCK`` over ``[0, n)`` for a block of rows whose allowed index sets are ``[lo(r), hi(r)]``.

        ``lo``/``hi`` are nondecreasing over the rows of the block, so ``lo_first``/``hi_first`` belong to its first row
        and ``lo_last``/``hi_last`` to its last.  Returns tile starts ``start <= full_lo <= full_hi <= end`` (multiples
        of BLOCK): tiles in ``[full_lo, full_hi)`` are allowed for every row and need no mask, the edge ranges
        ``[start, full_lo)`` and ``[full_hi, end)`` need the position mask, and nothing outside is visited.
        """
        lo_f = tl.minimum(tl.maximum(lo_first, 0), n)
        lo_l = tl.minimum(tl.maximum(lo_last, 0), n)
        hi_f = tl.minimum(tl.maximum(hi_first, -1), n - 1)
        hi_l = tl.minimum(tl.maximum(hi_last, -1), n - 1)
        start = (lo_f // BLOCK) * BLOCK
        end = tl.maximum(((hi_l + BLOCK) // BLOCK) * BLOCK, start)
        full_lo = ((lo_l + BLOCK - 1) // BLOCK) * BLOCK
        full_hi = ((hi_f + 1) // BLOCK) * BLOCK
        full_lo = tl.minimum(tl.maximum(full_lo, start), end)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
        return start, full_lo, full_hi, end

    @triton.jit
    def _key_range(t_first, t_last, S, WINDOW, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK: tl.constexpr):
        """Sequence-key tiles for queries at positions ``t_first .. t_last`` (see :func:`_tile_range`)."""
        if HAS_WINDOW:
            lo_first = t_first - WINDOW + 1
            lo_last = t_last - WINDOW + 1
        else:
            lo_first = t_first * 0
            lo_last = t_first * 0
        if CAUSAL:
            hi_first = t_first
            hi_last = t_last
        elif HAS_WINDOW:
            hi_first = t_first + WINDOW - 1
            hi_last = t_last + WINDOW - 1
        else:
            hi_first = t_first * 0 + S - 1
            hi_last = t_first * 0 + S - 1
        return _tile_range(lo_first, lo_last, hi_first, hi_last, S, BLOCK)

    @triton.jit
    def _query_range(
        s_first, s_last, t0, NQ, WINDOW, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Query-row tiles that see the sequence keys ``s_first .. s_last``; query row i sits at position t0 + i."""
        if CAUSAL:
            lo_first = s_first - t0
            lo_last = s_last - t0
        elif HAS_WINDOW:
            lo_first = s_first - WINDOW + 1 - t0
            lo_last = s_last - WINDOW + 1 - t0
        else:
            lo_first = s_first * 0
            lo_last = s_first * 0
        if HAS_WINDOW:
            hi_first = s_first + WINDOW - 1 - t0
            hi_last = s_last + WINDOW - 1 - t0
        else:
            hi_first = s_first * 0 + NQ - 1
            hi_last = s_first * 0 + NQ - 1
        return _tile_range(lo_first, lo_last, hi_first, hi_last, NQ, BLOCK)

    @triton.jit
    def _allowed(t, s, WINDOW, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """Position mask for query positions ``t`` and sequence-key positions ``s`` (broadcastable tensors)."""
        if CAUSAL:
            ok = s <= t
            if HAS_WINDOW:
                ok = ok & (t - s < WINDOW)
        elif HAS_WINDOW:
            ok = (t - s < WINDOW) & (s - t < WINDOW)
        else:
            ok = (s + t) == (t + s)  # every position: all True in the broadcast shape
        return ok

    # Triton's CPU interpreter (3.9) computes tl.dot on bfloat16 operands wrongly; there the operands (already
    # rounded to the input dtype, as on the GPU) are multiplied in fp32 instead.
    _DOT_UPCAST = tl.constexpr(DEFINED_INTERPRETED)

    @triton.jit
    def _dot(a, b, acc, DOT_PREC: tl.constexpr):
        """``tl.dot(a, b, acc)``: tensor-core product with fp32 accumulation (``acc`` may be None)."""
        if _DOT_UPCAST:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc, input_precision=DOT_PREC)
        return out

    @triton.jit
    def _load_tile(ptrs, rows_ok, cols, NCOLS: tl.constexpr, NCOLS_PAD: tl.constexpr, ROW_MASK: tl.constexpr):
        """Load a ``[rows, NCOLS_PAD]`` tile, masking the padded head-dim columns and (optionally) the rows."""
        if ROW_MASK:
            if NCOLS == NCOLS_PAD:
                x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
            else:
                x = tl.load(ptrs, mask=rows_ok[:, None] & (cols[None, :] < NCOLS), other=0.0)
        else:
            if NCOLS == NCOLS_PAD:
                x = tl.load(ptrs)
            else:
                x = tl.load(ptrs, mask=cols[None, :] < NCOLS, other=0.0)
        return x

    @triton.jit
    def _row_sq_norms(ptrs, rows_ok, cols, NCOLS: tl.constexpr, NCOLS_PAD: tl.constexpr, ROW_MASK: tl.constexpr):
        """``||row||^2`` (fp32) of a ``[rows, NCOLS_PAD]`` tile, read by a load of its own.

        The streamed key tile of the forward and dQ loops feeds ``tl.dot`` (transposed, and as the value / dQ operand
        too); reducing that same tile in registers made triton 3.6 on Hopper (H200, bf16, pipelined loops) return
        wrong scores: GKA outputs and rbf dQ / dgamma off by 10-30% relative, while the CPU interpreter was exact
        (benchmarks/results/h200x4-2026-11-26, ``pytest -m gpu``).  A separate load (a different eviction policy, so
        that it is not merged with the operand's) keeps the reduction off the operand tile; it reads the tile again
        from L1/L2, ``1 / BLOCK_M`` of the tile's dot product in work.
        """
        mask = cols[None, :] < NCOLS
        if ROW_MASK:
            mask = mask & rows_ok[:, None]
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        return tl.sum(x * x, 1)

    @triton.jit
    def _key_bias_kernel(
        K,
        PK,
        KLW,
        AM,
        COEF,
        KB,
        KN,
        skb,
        skh,
        skn,
        spkb,
        spkh,
        spkn,
        slb,
        slh,
        sln,
        smb,
        H,
        NK,
        P,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        KNORM: tl.constexpr,
        SEP_PREFIX: tl.constexpr,
        HAS_KLW: tl.constexpr,
        HAS_AM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """kb_j = log2(e) * (b_h * ||k_j||^2 + log w_j), -inf for padded keys; kn_j = ||k_j||^2 (fp32).  With
        SEP_PREFIX key ``j < P`` is row ``j`` of the prefix keys ``PK`` and key ``j >= P`` row ``j - P`` of ``K``."""
        pid = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        ok = offs < NK
        kb = tl.zeros([BLOCK], dtype=tl.float32)
        if KNORM:
            offs_d = tl.arange(0, D_PAD)
            col_ok = offs_d[None, :] < D
            if SEP_PREFIX:
                in_prefix = offs < P
                seq_ptrs = K + b * skb + h * skh + (offs[:, None] - P) * skn + offs_d[None, :]
                prefix_ptrs = PK + b * spkb + h * spkh + offs[:, None] * spkn + offs_d[None, :]
                k = tl.load(seq_ptrs, mask=(ok & ~in_prefix)[:, None] & col_ok, other=0.0).to(tl.float32)
                k += tl.load(prefix_ptrs, mask=in_prefix[:, None] & col_ok, other=0.0).to(tl.float32)
            else:
                k = tl.load(
                    K + b * skb + h * skh + offs[:, None] * skn + offs_d[None, :],
                    mask=ok[:, None] & col_ok,
                    other=0.0,
                ).to(tl.float32)
            kn = tl.sum(k * k, 1)
            tl.store(KN + bh * NK + offs, kn, mask=ok)
            kb = kn * tl.load(COEF + h)
        if HAS_KLW:
            kb += tl.load(KLW + b * slb + h * slh + offs * sln, mask=ok, other=0.0).to(tl.float32)
        kb = kb * 1.4426950408889634
        if HAS_AM:
            real = tl.load(AM + b * smb + offs, mask=ok, other=0)
            kb = tl.where(real != 0, kb, float("-inf"))
        tl.store(KB + bh * NK + offs, kb, mask=ok)


def key_bias(
    k, coef, key_log_weights, attention_mask, heads: int, nk: int, batch: int, knorm: bool, prefix_k=None,
    block: int | None = None, num_warps: int | None = None, traced: bool = False,
):
    """The per-key bias (log2 units, fp32 ``[B, H, Nk]``) and the key norms (``[B, H, Nk]`` or an empty tensor).

    ``k``: keys ``[B, H, Nk, D]`` (read only when ``knorm``); with ``prefix_k`` (``[B|1, H, P, D]``, separate prefix
    keys, last dim contiguous) ``k`` holds the ``Nk - P`` keys after them; ``coef``: fp32 ``[H]``, the ``b_h`` of
    ``b_h ||k||^2`` (natural-log units, negative for a distance);
    ``key_log_weights``: ``[B|1, H|1, Nk]`` or None; ``attention_mask``: bool ``[B, Nk]`` or None.
    Returns ``(None, None)`` when there is nothing to add (no norm, no weights, no padding); ``kn`` is an empty
    tensor unless ``knorm``.  ``block`` / ``num_warps``: keys per program and warps (``None``: the shipped choice,
    :func:`key_bias_config`); benchmarks/probe_key_bias.py sweeps them.  ``traced``: launched from a ``triton_op``
    that ``torch.compile`` traces (``wrap_triton``: Inductor launches the kernel from its generated code).
    """
    if not knorm and key_log_weights is None and attention_mask is None:
        return None, None
    device = (k if knorm else key_log_weights if key_log_weights is not None else attention_mask).device
    kn = torch.empty(0, device=device, dtype=torch.float32)
    kb = torch.empty(batch, heads, nk, device=device, dtype=torch.float32)
    if knorm:
        kn = torch.empty(batch, heads, nk, device=device, dtype=torch.float32)
    d = k.shape[-1] if knorm else 16
    klw = key_log_weights
    if klw is not None:
        slb = 0 if klw.shape[0] == 1 else klw.stride(0)
        slh = 0 if klw.shape[1] == 1 else klw.stride(1)
        sln = klw.stride(2)
    else:
        slb = slh = sln = 0
    am = attention_mask
    if am is not None:
        am = am.to(torch.int8)
    block = key_bias_config()[0] if block is None else block
    num_warps = key_bias_config()[1] if num_warps is None else num_warps
    dummy = kb
    sep_prefix = knorm and prefix_k is not None
    pk = prefix_k if sep_prefix else dummy
    grid = (triton.cdiv(nk, block), batch * heads)
    args = (
        k if knorm else dummy,
        pk,
        klw if klw is not None else dummy,
        am if am is not None else dummy,
        coef if knorm else dummy,
        kb,
        kn if knorm else dummy,
        k.stride(0) if knorm else 0,
        k.stride(1) if knorm else 0,
        k.stride(2) if knorm else 0,
        (0 if pk.shape[0] == 1 else pk.stride(0)) if sep_prefix else 0,
        pk.stride(1) if sep_prefix else 0,
        pk.stride(2) if sep_prefix else 0,
        slb,
        slh,
        sln,
        am.stride(0) if am is not None else 0,
        heads,
        nk,
        prefix_k.shape[2] if sep_prefix else 0,
    )
    kwargs = dict(
        D=d,
        D_PAD=padded_dim(d),
        KNORM=knorm,
        SEP_PREFIX=sep_prefix,
        HAS_KLW=klw is not None,
        HAS_AM=am is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    if traced:
        wrap_triton(_key_bias_kernel)[grid](*args, **kwargs)
    else:
        launch_jit(_key_bias_kernel, grid, args, kwargs)
    return kb, kn


def key_bias_config() -> tuple[int, int]:
    """(keys per program, warps) of the key-bias pass.  One choice for every head dim: on an H100 every choice from
    32 to 512 keys and 1 to 8 warps read the keys at 2.2-2.7 TB/s (benchmarks/probe_key_bias.py,
    benchmarks/results/h100-2026-11-27n, section 3)."""
    if DEFINED_INTERPRETED:
        return 16, 4
    return 128, 4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# At most this many query rows count as decoding for the backend order (see `auto_order`).
DECODE_ROWS = 16


def auto_order(candidates: dict, device: torch.device, num_queries: int) -> dict:
    """The order "auto" tries a family's backends in: the family's own order, with two moves.

    - "triton" goes last on the CPU: there the kernels only run in Triton's interpreter (``TRITON_INTERPRET=1``,
      for tests), far slower than the naive reference; an explicit ``backend="triton"`` still can.
    - For a handful of query rows (decoding, at most ``DECODE_ROWS``) "naive" goes first on the CPU.  On CUDA every
      family's "triton" serves them with a split-K decode kernel (the scalar family through the distance family's,
      with the scalar term alone, since 2026-11-27).

    Why, measured (benchmarks/bench_decode_backends.py, benchmarks/probe_scalar_decode.py,
    recipes/bench_sorted_decode.py; results under benchmarks/results/):
    - CPU (this project's 2-core machine, torch 2.13, H=16, D=64, 4096 keys): the padding trick copies every key
      and value into padded tensors on each call, which a decode step cannot amortise; one query row took 1.1-2.5 ms
      naive against 4.0-8.7 ms through SDPA across the four families, 16 rows 4.6-6.4 ms against 5.1-9.4 ms; at 64
      rows SDPA wins (11-25 ms against 25-37 ms).
    - H200 (scalar, H=16, G=4, Dv=64, bf16): torch's SDPA picks cuDNN for the padded call with a mask, and cuDNN
      builds a new execution plan for every new key length: ~27 ms per generated token at any context from 4096
      keys on (so the scalar family keeps SDPA out of decode calls).  The scalar family's own Triton forward has
      no split-K: 0.16 ms at 1K keys but 2.7 ms at 64K and 42 ms at 1M; naive took 0.4-0.6 ms up to 64K keys, as
      ~25 torch ops of host work per layer and step (a dynamic-cache decode step is bound by host work).
    """
    first, last = [], []
    if device.type == "cpu" and num_queries <= DECODE_ROWS:
        first.append("naive")
    if device.type != "cuda":
        last.append("triton")
    names = [n for n in first if n in candidates]
    names += [n for n in candidates if n not in first and n not in last]
    names += [n for n in last if n in candidates]
    return {n: candidates[n] for n in names}
