"""Host time of ``kernels_launch``'s launch key for the fused kernels' real arguments, on the CPU (no GPU needed), and
on a GPU the whole direct launch split into its parts.

    PYTHONPATH=. python benchmarks/probe_launch_key.py [--call rbf_attention] [--reps 5000] [--device cuda]

``launch_tuned`` computes a key of every launch (``kernels_launch._key_and_pointers``: argument types, tensor dtypes,
16-byte alignment and device, the specialisation class of each integer) to find the compiled kernel and launch it
directly.  On the H200 host a whole ``launch_tuned`` took 0.07-0.14 ms, three per forward+backward
(``benchmarks/results/h200-2026-11-29``, call 3).  This script runs one forward+backward of the call in Triton's
interpreter, keeps the arguments of each ``launch_tuned``, then times the key alone (best of 7 rounds) and its
dictionary lookup, per kernel.  The numbers scale with the host (the GPU machines' CPUs were 3-5x slower per
operation than this project's), so compare them only within one run or against the same machine.

With ``--device cuda`` the launches are captured at B1 H4 N128 D64 bf16 on the GPU (the kernels take a few
microseconds, so the host is the whole cost) and each part of ``launch_cached``'s hit path is timed on its own: the
current device, the launch-hook check, the key, its lookup, the stream, the compiled launcher called with the cached
entry (the driver call), and the whole ``launch_tuned``; what the parts leave of the whole is the wrapper's own Python.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

if "cuda" not in sys.argv:  # the CPU mode runs the kernels in triton's interpreter to capture their arguments
    os.environ.setdefault("TRITON_INTERPRET", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def captured_launches(call: str, device: str = "cpu") -> list:
    """``(kernel name, autotuned kernel, grid, args, kwargs)`` of every ``launch_tuned`` in one forward+backward of
    ``call`` (a name of ``count_host_ops.make_calls``)."""
    import torch

    import count_host_ops
    from hf_rbf import kernels_common, kernels_flash_bwd, kernels_flash_fwd, kernels_scalar_bwd, kernels_scalar_fwd

    captured = []
    original = kernels_common.launch_tuned

    def keep(kernel, grid, *args, **kwargs):
        fn = getattr(kernel, "fn", kernel)
        captured.append((getattr(fn, "__name__", type(fn).__name__), kernel, grid, args, kwargs))
        return original(kernel, grid, *args, **kwargs)

    modules = (kernels_flash_fwd, kernels_flash_bwd, kernels_scalar_fwd, kernels_scalar_bwd)
    saved = [getattr(m, "launch_tuned", None) for m in modules]
    for m in modules:
        if hasattr(m, "launch_tuned"):
            m.launch_tuned = keep
    try:
        if device == "cpu":
            fn, _ = count_host_ops.make_calls(1, 2, 20, 16, torch.float32, "cpu")[call]
        else:
            fn, _ = count_host_ops.make_calls(1, 4, 128, 64, torch.bfloat16, device)[call]
        out = fn()
        out.backward(torch.ones_like(out))
    finally:
        for m, s in zip(modules, saved):
            if s is not None:
                m.launch_tuned = s
    return captured


def _by_value(kernel) -> frozenset:
    """The positions of an autotuner's key arguments (keyed by value), as ``launch_cached`` computes them."""
    names = set(getattr(kernel, "keys", ()) or ())
    fn = getattr(kernel, "fn", kernel)
    params = [p.name for p in getattr(fn, "params", [])] or list(inspect.signature(fn.fn).parameters)
    return frozenset(i for i, name in enumerate(params) if name in names)


def _best_us(fn, reps: int, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def gpu_parts(call: str, reps: int) -> None:
    """The hit path of ``launch_cached`` for each captured launch, part by part (microseconds, best of 7 rounds)."""
    import torch

    from hf_rbf import kernels_common, kernels_launch

    launches = captured_launches(call, "cuda")
    for _, kernel, grid, a, kw in launches:  # twice more: tuned, compiled and cached from here on
        kernels_common.launch_tuned(kernel, grid, *a, **kw)
        kernels_common.launch_tuned(kernel, grid, *a, **kw)
    torch.cuda.synchronize()
    print(f"# Direct launch parts per kernel ({call}; {torch.cuda.get_device_name()}; best of 7 rounds of {reps})")
    cols = ["device", "hooks", "key", "lookup", "stream", "launcher", "launch_tuned", "rest"]
    print("| kernel | arguments | " + " | ".join(f"{c} us" for c in cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for name, kernel, grid, a, kw in launches:
        fn = getattr(kernel, "fn", kernel)
        by_value = _by_value(kernel) if kernel is not fn else frozenset()
        device = torch.cuda.current_device()
        key, positions, pointers = kernels_launch._key_and_pointers(a, kw, device, by_value)
        cache = kernel.__dict__.get("_hf_rbf_direct") or {}
        entry = cache.get(key)
        if entry is None:
            print(f"| {name} | {len(a)} | not launched directly: {kernels_launch.direct_launch_state()} |")
            continue
        launcher, function, packed, tail, launched_kw = entry
        g = grid(launched_kw) if callable(grid) else grid
        g = tuple(g) + (1,) * (3 - len(g))
        args = list(a)
        for i, ptr in zip(positions, pointers):
            args[i] = ptr
        stream = torch._C._cuda_getCurrentRawStream(device)
        t = {
            "device": _best_us(torch.cuda.current_device, reps),
            "hooks": _best_us(lambda: kernels_launch._hooks_installed(fn), reps),
            "key": _best_us(lambda: kernels_launch._key_and_pointers(a, kw, device, by_value), reps),
            "lookup": _best_us(lambda: cache.get(key), reps),
            "stream": _best_us(lambda: torch._C._cuda_getCurrentRawStream(device), reps),
            "launcher": _best_us(lambda: launcher(*g, stream, function, packed, None, None, None, *args, *tail), reps),
            "launch_tuned": _best_us(lambda: kernels_common.launch_tuned(kernel, grid, *a, **kw), reps),
        }
        torch.cuda.synchronize()
        t["rest"] = t["launch_tuned"] - sum(v for k, v in t.items() if k != "launch_tuned")
        print(f"| {name} | {len(a)} | " + " | ".join(f"{t[c]:.2f}" for c in cols) + " |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--call", default="rbf_attention", help="a count_host_ops.make_calls name")
    p.add_argument("--reps", type=int, default=5000)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the direct launch part by part")
    args = p.parse_args(argv)
    from hf_rbf import kernels_launch

    if args.device == "cuda":
        for call in args.call.split(","):
            gpu_parts(call, args.reps)
        return 0

    print(f"# Launch key per kernel ({args.call}; best of 7 rounds of {args.reps})")
    print("| kernel | arguments | integers | keywords | key us | lookup us |")
    print("|---|---|---|---|---|---|")
    for name, kernel, _, a, kw in captured_launches(args.call):
        by_value = _by_value(kernel)
        key = kernels_launch._key_and_pointers(a, kw, 0, by_value)[0]
        table = {key: None}
        best_key = best_lookup = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(args.reps):
                kernels_launch._key_and_pointers(a, kw, 0, by_value)
            t1 = time.perf_counter()
            for _ in range(args.reps):
                table.get(key)
            t2 = time.perf_counter()
            best_key = min(best_key, (t1 - t0) / args.reps * 1e6)
            best_lookup = min(best_lookup, (t2 - t1) / args.reps * 1e6)
        ints = sum(type(x) is int for x in a)
        print(f"| {name} | {len(a)} | {ints} | {len(kw)} | {best_key:.2f} | {best_lookup:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
