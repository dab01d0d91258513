"""Triton's per-launch argument binding and cache key for the distance forward kernel, timed on the CPU (no GPU).

    PYTHONPATH=. python benchmarks/probe_triton_binder_offline.py      # in a venv with the GPU machines' triton (3.6)

``offline_kernel_report.py``'s stand-in sm_90 driver compiles the kernel through the real host code (rbf's training
call, B1 H4 N128 D64 bf16); then the two pure-host pieces of every launch are timed: the binder (argument binding and
specialisation of every argument and constexpr) and the cache-key hash.  They bound what packing arguments or
constexpr flags could save against the 0.12-0.18 ms per launch measured on H100 hosts
(``benchmarks/results/h100-2026-11-27j``); the driver call itself needs a GPU (``probe_triton_launch.py``).
"""

from __future__ import annotations

import collections
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offline_kernel_report as okr  # noqa: E402  (sets the offline environment before triton and hf_rbf load)
import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key  # noqa: E402


def _per_call_us(fn, calls: int = 20000) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    driver.set_active(okr.OfflineDriver(90))
    triton.testing.do_bench = lambda fn, *a, quantiles=None, **k: [1.0] * len(quantiles) if quantiles else 1.0
    captured = []
    original = JITFunction.run

    def compile_and_capture(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        captured.append((self, args, dict(kwargs), grid))
        return kernel

    JITFunction.run = compile_and_capture
    from hf_rbf import kernels_common, kernels_flash_fwd, kernels_launch
    from hf_rbf.kernels_flash_fwd import distance_forward

    tuned_calls = []

    def capture_tuned(kernel, grid, *args, **kwargs):
        tuned_calls.append((kernel, grid, args, kwargs))
        return kernels_common.launch_tuned(kernel, grid, *args, **kwargs)

    kernels_flash_fwd.launch_tuned = capture_tuned
    kernels_launch.DIRECT_LAUNCH = False  # compiling: the offline driver cannot load a kernel for the direct path

    h, n, d = 4, 128, 64
    q, k, v = (torch.randn(1, h, n, d).bfloat16() for _ in range(3))
    flags = dict(causal=True, window=None, num_prefix_keys=0, normalize=True, qnorm=False, kv_same=False, eps=0.0)
    distance_forward(q, k, v, None, None, None, None, torch.full((h,), 0.125), None, knorm_inline=True, **flags)
    fn, args, kwargs, _grid = captured[-1]
    kwargs.update(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    _cache, key_cache, _target, _backend, binder = fn.device_caches[0]
    _bound, specialization, options = binder(*args, **kwargs)
    types = collections.Counter(type(a).__name__ for a in args)
    print(f"triton {triton.__version__}; {len(args)} arguments {dict(types)}, {len(kwargs)} keyword arguments")
    print(f"binder: {_per_call_us(lambda: binder(*args, **kwargs)):.1f} us per launch")
    print(f"cache key: {_per_call_us(lambda: compute_cache_key(key_cache, specialization, options)):.1f} us per launch")

    # The whole launch path up to the driver call: triton's JITFunction.run against kernels_launch.launch_jit, both
    # ending in a launcher that does nothing (no GPU here), on the device / stream stand-ins of the offline driver.
    JITFunction.run = original
    compiled = fn.device_caches[0][0][compute_cache_key(key_cache, specialization, options)]
    compiled._run, compiled.function = (lambda *launch_args: None), 0
    compiled._init_handles = lambda: None  # the module is "loaded"
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    kernels_launch.DIRECT_LAUNCH = True
    grid = captured[-1][3]
    kw = {k: v for k, v in kwargs.items() if k not in ("debug", "instrumentation_mode")}
    us = _per_call_us(lambda: fn.run(*args, grid=grid, warmup=False, **kw))
    print(f"JITFunction.run without the driver call: {us:.1f} us per launch")
    kernels_launch.launch_jit(fn, grid, args, kw)  # records the call signature
    us = _per_call_us(lambda: kernels_launch.launch_jit(fn, grid, args, kw))
    print(f"kernels_launch.launch_jit, the same: {us:.1f} us per launch")
    print(f"  of which its key: {_per_call_us(lambda: kernels_launch.call_key(args, kw, 0)):.1f} us")
    # the same launch as our kernels make it: kernels_common.launch_tuned (the autotuner's choice, then launch_jit)
    tuned, tgrid, targs, tkw = tuned_calls[-1]
    kernels_common.launch_tuned(tuned, tgrid, *targs, **tkw)
    us = _per_call_us(lambda: kernels_common.launch_tuned(tuned, tgrid, *targs, **tkw))
    print(f"kernels_common.launch_tuned (autotuned kernel, direct launches): {us:.1f} us per launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
