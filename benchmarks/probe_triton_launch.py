"""Where triton's launch path spends the host time of one fused-kernel launch (CUDA only): the whole
``JITFunction.run`` against its parts (the argument binder with its specialisation, the cache-key lookup, the launch
metadata, the driver's ``CompiledKernel.run``), for the distance forward kernel at a tiny shape (the GPU idle, so the
host is the whole cost), next to ``torch.nn.functional.scaled_dot_product_attention``.

    PYTHONPATH=. python benchmarks/probe_triton_launch.py [--calls 2000] [--json PATH]

This decides the next host-cost step of the training-speed issue: if the binder dominates, a launcher that reuses
the bound specialisation for a repeated shape (as inductor's generated launchers do) pays; if the driver call does,
only CUDA graphs help.  It reads triton internals (``device_caches``, ``binder``, ``compute_cache_key``,
``CompiledKernel.run``'s argument order of triton 3.4-3.9) and says so when they differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA: the compiled launcher is what is measured")
    import triton
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import compute_cache_key

    import hf_rbf
    from hf_rbf import kernels_common, kernels_flash_fwd

    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    gamma = torch.full((4,), 0.125, device="cuda")
    hf_rbf.rbf_attention(q, k, v, gamma=gamma, causal=True, backend="triton")  # compile, tune

    # capture the exact arguments of the forward kernel's launch
    captured = {}
    original = kernels_common.launch_tuned

    def capture(kernel, grid, *a, **kw):
        captured.update(kernel=kernel, grid=grid, args=a, kwargs=kw)
        return original(kernel, grid, *a, **kw)

    kernels_flash_fwd.launch_tuned = capture
    try:
        hf_rbf.rbf_attention(q, k, v, gamma=gamma, causal=True, backend="triton")
    finally:
        kernels_flash_fwd.launch_tuned = original
    kernel, grid, a, kw = captured["kernel"], captured["grid"], captured["args"], captured["kwargs"]
    config = kernel.cache[next(iter(kernel.cache))] if getattr(kernel, "cache", None) else kernel.configs[0]
    full_kwargs = dict(kw, **config.all_kwargs())
    fn = kernel.fn
    rows = {"triton": triton.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    rows["arguments"] = len(a) + len(kw)

    rows["sdpa_fwd_us"] = _per_call_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), args.calls
    )
    rows["rbf_attention_fwd_us"] = _per_call_us(
        lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, causal=True, backend="triton"), args.calls
    )
    rows["launch_tuned_us"] = _per_call_us(lambda: original(kernel, grid, *a, **kw), args.calls)
    rows["jit_run_us"] = _per_call_us(lambda: fn.run(*a, grid=grid, warmup=False, **full_kwargs), args.calls)
    try:
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        kernel_cache, kernel_key_cache, _target, _backend, binder = fn.device_caches[device]
        opts = dict(full_kwargs, debug=False)
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                opts[name] = getattr(knobs.compilation, name)
        bound, specialization, options = binder(*a, **opts)
        key = compute_cache_key(kernel_key_cache, specialization, options)
        compiled = kernel_cache[key]
        g = grid(bound) if callable(grid) else grid
        g = tuple(g) + (1,) * (3 - len(g))
        values = tuple(bound.values())
        rows["binder_us"] = _per_call_us(lambda: binder(*a, **opts), args.calls)
        rows["cache_key_us"] = _per_call_us(
            lambda: compute_cache_key(kernel_key_cache, specialization, options), args.calls
        )
        rows["launch_metadata_us"] = _per_call_us(lambda: compiled.launch_metadata(g, stream, *values), args.calls)

        def direct():
            compiled.run(
                g[0],
                g[1],
                g[2],
                stream,
                compiled.function,
                compiled.packed_metadata,
                None,
                knobs.runtime.launch_enter_hook,
                knobs.runtime.launch_exit_hook,
                *values,
            )

        rows["compiled_run_us"] = _per_call_us(direct, args.calls)
    except Exception as err:  # noqa: BLE001  (internals of another triton version: report, keep the totals)
        rows["internals_error"] = f"{type(err).__name__}: {err}"
    for key_, value in rows.items():
        print(f"{key_}: {value:.1f}" if isinstance(value, float) else f"{key_}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
