"""Where the host time of a fused attention call's backward goes (CUDA only): inclusive wall time of each phase of our
path, the autotuner fall-throughs, and torch.profiler's view of every autograd node on the engine's thread, for each
fused family call at a tiny shape (B1 H4 N128 D64, bf16; the GPU idle, so the host is the whole cost), next to SDPA.

    PYTHONPATH=. python benchmarks/probe_backward_host.py --out DIR [--calls 300] [--only rbf,gka] [--direct-rounds 3]
        [--shape B,H,N,D]

Why: on an H100 host a fused forward+backward cost 0.97 ms of host time against SDPA's 0.16 ms (session 12,
``benchmarks/results/h100-2026-11-27i``), and the Python and aten work counted on the CPU explained only about half of
it.  cProfile attributes the rest to ``run_backward``'s own time, which is the autograd engine: its thread hand-off,
the C++ nodes (``AccumulateGrad``, the casts and sums of the loss), and what it does around a Python node (unpacking
the saved tensors, checking every returned gradient).  This splits that time:

* ``timers``: wall time inside each wrapped function of our path (inclusive), per call; ``backward()`` minus
  ``Function.backward`` is what the engine spends outside our Python;
* ``autotuner fall-throughs``: launches that reached triton's ``Autotuner.run`` (``launch_tuned`` found no cached
  config): each costs about 0.15 ms, and should be 0 after warm-up;
* ``profiler``: ``torch.profiler`` (CPU activity, every thread) over ``--profile-calls`` calls, the top ops and
  autograd nodes by self CPU time.

* ``synchronisations``: host-device synchronisations of one forward+backward (``torch.cuda.set_sync_debug_mode``),
  which serialise the host's and the GPU's time (a call then costs their sum, not their maximum): 0 expected;

* ``direct launches``: forward+backward host time with ``hf_rbf.kernels_launch``'s direct launches off (triton's
  ``JITFunction.run`` at every launch) and on, in interleaved rounds in this process (the host differs between
  machines by 2-3x: compare only within one run).

Writes ``DIR/backward_host.md`` and ``DIR/backward_host.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from count_host_ops import _clear, host_ms, make_calls  # noqa: E402

CALLS = (
    "sdpa (dot product, reference)",
    "rbf_attention",
    "rbf_attention + 1 register (prefix_keys)",
    "gka_attention",
    "hybrid_attention",
    "scalar_attention (tau per head)",
)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timers:
    """Accumulated inclusive wall time and call counts of wrapped functions (only while ``active``)."""

    def __init__(self):
        self.active = False
        self.seconds = collections.Counter()
        self.count = collections.Counter()

    def wrap(self, owner, attr: str, label: str, static: bool = False):
        original = getattr(owner, attr)
        inner = original

        def timed(*args, **kwargs):
            if not self.active:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.count[label] += 1

        setattr(owner, attr, staticmethod(timed) if static else timed)


def _install(timers: _Timers) -> None:
    import triton.runtime.autotuner as autotuner

    from hf_rbf import attention_distance_triton as adt
    from hf_rbf import attention_scalar_triton as ast
    from hf_rbf import kernels_common, kernels_flash_bwd, kernels_flash_fwd, kernels_scalar_bwd, kernels_scalar_fwd

    timers.wrap(adt._DistanceFunction, "forward", "distance Function.forward", static=True)
    timers.wrap(adt._DistanceFunction, "backward", "distance Function.backward", static=True)
    timers.wrap(adt, "distance_backward", "  distance_backward (allocations, 2 launches, 1 sum)")
    timers.wrap(adt, "distance_forward", "  distance_forward")
    timers.wrap(ast._ScalarFunction, "forward", "scalar Function.forward", static=True)
    timers.wrap(ast._ScalarFunction, "backward", "scalar Function.backward", static=True)
    timers.wrap(ast, "scalar_backward", "  scalar_backward")
    for mod, label in (
        (kernels_flash_fwd, "    launch_tuned (forward)"),
        (kernels_flash_bwd, "    launch_tuned (backward)"),
        (kernels_scalar_fwd, "    launch_tuned (scalar forward)"),
        (kernels_scalar_bwd, "    launch_tuned (scalar backward)"),
    ):
        if hasattr(mod, "launch_tuned"):
            timers.wrap(mod, "launch_tuned", label)
    timers.wrap(kernels_common, "key_bias", "  key_bias")
    timers.wrap(autotuner.Autotuner, "run", "autotuner fall-through (Autotuner.run)")


def _phases(fn, leaves, calls: int, timers: _Timers) -> dict:
    """Per call: forward wall, backward() wall, and each wrapped function's inclusive wall time (ms)."""
    out = fn()
    dout = torch.ones_like(out.detach())
    out.backward(dout)
    _clear(leaves)
    _sync()
    timers.seconds.clear()
    timers.count.clear()
    timers.active = True
    fwd = bwd = 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        _clear(leaves)
        fwd += t1 - t0
        bwd += t2 - t1
    timers.active = False
    _sync()
    row = {"forward call": 1e3 * fwd / calls, "backward() call": 1e3 * bwd / calls}
    for label, s in timers.seconds.items():
        row[label] = 1e3 * s / calls
        row[label + " [calls per call]"] = timers.count[label] / calls
    return row


def _synchronisations(fn, leaves) -> int:
    """Host-device synchronisations of one forward+backward, as ``torch.cuda.set_sync_debug_mode("warn")`` reports
    them (CUDA only; -1 elsewhere)."""
    import warnings

    if not torch.cuda.is_available():
        return -1
    out = fn()
    dout = torch.ones_like(out.detach())
    _clear(leaves)
    _sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn().backward(dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _clear(leaves)
    return sum("synchroniz" in str(w.message) for w in caught)


def _profile(fn, leaves, calls: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    out = fn()
    dout = torch.ones_like(out.detach())
    _sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            out = fn()
            out.backward(dout)
            _clear(leaves)
        _sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--profile-calls", type=int, default=50)
    p.add_argument("--only", default="", help="comma-separated substrings of the call names")
    p.add_argument(
        "--shape",
        default="1,4,128,64",
        help="B,H,N,D (default: tiny, so that the GPU idles and the host is the whole cost; a benchmark shape shows "
        "whether its calls are host-bound: compare the host ms with the kernels' time)",
    )
    p.add_argument(
        "--direct-rounds",
        type=int,
        default=3,
        help="interleaved rounds of forward+backward host time, kernels_launch's direct launches off / on (0: skip)",
    )
    args = p.parse_args(argv)
    from hf_rbf import kernels_launch
    cuda = torch.cuda.is_available()
    if not cuda:  # a smoke run only (kernels in triton's interpreter): the numbers say nothing about a GPU host
        print("no CUDA: running in triton's interpreter at the same shape; the times are not host costs")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    timers = _Timers()
    _install(timers)
    b, h, n, d = (int(x) for x in args.shape.split(","))
    calls = make_calls(b, h, n, d, torch.bfloat16 if cuda else torch.float32, "cuda" if cuda else "cpu")
    only = [s for s in args.only.split(",") if s]
    env = f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'cpu (TRITON_INTERPRET=1)'}"
    md = [f"# Host time of a fused call's backward ({env}; B{b} H{h} N{n} D{d} bf16, {args.calls} calls)", ""]
    rows = {}
    for name in CALLS:
        if only and not any(s in name for s in only):
            continue
        fn, leaves = calls[name]
        row = {}
        if args.direct_rounds:  # the same call with triton's launcher at every launch, then with direct launches
            times = {False: [], True: []}
            for _ in range(args.direct_rounds):
                for direct in (False, True):
                    kernels_launch.DIRECT_LAUNCH = direct
                    times[direct].append(host_ms(fn, leaves, args.calls, backward=True))
            kernels_launch.DIRECT_LAUNCH = True
            row["host ms forward+backward, triton's launch path (best of rounds)"] = min(times[False])
            row["host ms forward+backward, direct launches (best of rounds)"] = min(times[True])
            row["  rounds, triton's launch path"] = times[False]
            row["  rounds, direct launches"] = times[True]
        row["host ms forward"] = host_ms(fn, leaves, args.calls, backward=False)
        row["host ms forward+backward"] = host_ms(fn, leaves, args.calls, backward=True)
        row.update(_phases(fn, leaves, args.calls, timers))
        row["synchronisations per forward+backward"] = float(_synchronisations(fn, leaves))
        rows[name] = row
        section = [f"## {name}", "", "| phase | ms per call |", "|---|---|"]
        section += [
            f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {', '.join(f'{x:.4f}' for x in v)} |"
            for k, v in row.items()
        ]
        table = _profile(fn, leaves, args.profile_calls)
        section += ["", f"torch.profiler, {args.profile_calls} forward+backward calls (CPU, all threads):", ""]
        section += ["```", table, "```", ""]
        print("\n".join(section), flush=True)
        md += section
    (out_dir / "backward_host.md").write_text("\n".join(md))
    (out_dir / "backward_host.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
