"""Host-side work of one fused attention call: triton launches and aten ops per forward and forward+backward.

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/count_host_ops.py            # CPU: counts only
    PYTHONPATH=. python benchmarks/count_host_ops.py --time --calls 200             # CUDA: counts and host ms/call

For each fused family call (``backend="triton"``: rbf_attention, with a key-log-weight / a prefix key variant,
gka_attention, hybrid_attention, scalar_attention with each form of tau and with key log-weights) this counts, after warm-up (autotuning, compilation):

- **triton launches**: every ``run`` of a triton JIT function (``JITFunction.run`` on the GPU,
  ``InterpretedFunction.run`` in the interpreter; ``kernel[grid](...)``, the autotuner and
  ``kernels_common.launch_tuned`` all end there), by kernel name;
- **aten ops**: every op that reaches the dispatcher below autograd (a ``TorchDispatchMode``), by name, outside the
  triton launches (the interpreter's own tensor work is not the host path being measured).  Views and allocations
  count: each is a dispatcher round trip on the host.  "of which compute": the ops other than allocations and views
  (``NO_KERNEL_OPS``), each of which launches a kernel on CUDA.

The backward is ``out.backward(dout)`` with the leaves' ``.grad`` cleared first, so gradient accumulation is a
fresh ``AccumulateGrad`` copy (as in the first micro-batch of a training step).

With ``--time`` (CUDA only) it also measures the host cost per call: wall time of ``--calls`` calls in a loop
without synchronisation at a tiny shape, where the GPU finishes each kernel before the host issues the next (the
method of ``benchmarks/profile_training.py``), next to SDPA's.  ``--json PATH`` writes every number.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():
    # the kernels only run on the CPU in triton's interpreter, which must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_rbf

# aten ops that only allocate or make views: no kernel on the device (the others each launch at least one on CUDA)
NO_KERNEL_OPS = frozenset(
    (
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "alias",
        "view",
        "_unsafe_view",
        "slice",
        "select",
        "unbind",
        "expand",
        "unsqueeze",
        "squeeze",
        "t",
        "transpose",
        "permute",
        "as_strided",
    )
)


class _Counter:
    """Triton launches and aten ops seen while ``active``."""

    def __init__(self):
        self.active = False
        self.skip_kernels = False  # --stub-kernels: launches return at once (the host path without the kernels)
        self.in_launch = 0
        self.launches = collections.Counter()
        self.ops = collections.Counter()

    def reset(self):
        self.launches.clear()
        self.ops.clear()


_COUNTER = _Counter()


def _patch_triton_run():
    """Wrap the ``run`` of triton's JIT function classes (compiled and interpreted) to count launches."""
    from triton.runtime import jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - older triton
        pass
    for cls in classes:
        if getattr(cls.run, "_hf_rbf_counting", False):
            continue
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if kwargs.get("warmup"):
                return _original(self, *args, **kwargs)
            if _COUNTER.active:
                _COUNTER.launches[getattr(self, "__name__", type(self).__name__)] += 1
            if _COUNTER.skip_kernels:
                return None
            _COUNTER.in_launch += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                _COUNTER.in_launch -= 1

        run._hf_rbf_counting = True
        cls.run = run


class _OpCounter(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _COUNTER.active and not _COUNTER.in_launch:
            _COUNTER.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    _COUNTER.reset()
    _COUNTER.active = True
    try:
        with _OpCounter():
            yield _COUNTER
    finally:
        _COUNTER.active = False


def make_calls(b: int, h: int, n: int, d: int, dtype: torch.dtype, device: str) -> dict:
    """name -> (zero-argument call, leaves) of the fused path of each family."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(True)

    def par(x):
        return x.to(device).requires_grad_(True)

    q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
    kr, vr = rnd(1, h, 1, d), rnd(1, h, 1, d)
    qs, ks = rnd(b, h, n), rnd(b, h, n)
    klw = par(0.1 * torch.randn(b, n, generator=g))
    tau = par(torch.full((h,), 0.3))
    log_sigma = par(torch.full((h,), 0.25 * math.log(d)))
    gamma = par(torch.full((h,), 1.0 / math.sqrt(d)))
    scale = par(torch.full((h,), 1.0 / math.sqrt(d)))
    tri = {"causal": True, "backend": "triton"}
    # scalar sort attention: grouped values (two heads per group where H allows), the three forms of tau
    vg = rnd(b, max(1, h // 2), n, d)
    tau_token = par(torch.full((b, h, n), 0.3))
    return {
        "sdpa (dot product, reference)": (
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            [q, k, v],
        ),
        "rbf_attention": (lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, **tri), [q, k, v, gamma]),
        "rbf_attention + 1 prefix key": (
            lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, num_prefix_keys=1, **tri),
            [q, k, v, gamma],
        ),
        # a register shared by the batch, as the model's layer passes it: concatenated in front of k / v (what
        # modeling_rbf does today) or through the kernels' prefix pointers
        "rbf_attention + 1 register (torch.cat)": (
            lambda: hf_rbf.rbf_attention(
                q,
                torch.cat([kr.expand(b, -1, -1, -1), k], dim=2),
                torch.cat([vr.expand(b, -1, -1, -1), v], dim=2),
                gamma=gamma,
                num_prefix_keys=1,
                **tri,
            ),
            [q, k, v, kr, vr, gamma],
        ),
        "rbf_attention + 1 register (prefix_keys)": (
            lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, prefix_keys=kr, prefix_values=vr, **tri),
            [q, k, v, kr, vr, gamma],
        ),
        "rbf_attention + key_log_weights": (
            lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, key_log_weights=klw, **tri),
            [q, k, v, gamma, klw],
        ),
        "rbf_attention normalize=False": (
            lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, normalize=False, **tri),
            [q, k, v, gamma],
        ),
        "gka_attention": (lambda: hf_rbf.gka_attention(q, log_sigma, **tri), [q, log_sigma]),
        "hybrid_attention": (
            lambda: hf_rbf.hybrid_attention(q, k, v, qs, ks, tau, scale=scale, **tri),
            [q, k, v, qs, ks, tau, scale],
        ),
        "scalar_attention (tau per head)": (lambda: hf_rbf.scalar_attention(qs, ks, vg, tau, **tri), [qs, ks, vg, tau]),
        "scalar_attention (tau per token)": (
            lambda: hf_rbf.scalar_attention(qs, ks, vg, tau_token, **tri),
            [qs, ks, vg, tau_token],
        ),
        "scalar_attention (tau float)": (lambda: hf_rbf.scalar_attention(qs, ks, vg, 0.3, **tri), [qs, ks, vg]),
        "scalar_attention + key_log_weights": (
            lambda: hf_rbf.scalar_attention(qs, ks, vg, tau, key_log_weights=klw, **tri),
            [qs, ks, vg, tau, klw],
        ),
    }


def _clear(leaves):
    for t in leaves:
        t.grad = None


def count_call(fn, leaves) -> dict:
    """Launches and aten ops of one forward and of one forward+backward (after a warm-up call)."""
    out = fn()
    out.backward(torch.ones_like(out))
    _clear(leaves)
    dout = torch.ones_like(out.detach())
    with counting() as c:
        fn()
    fwd = (dict(c.launches), dict(c.ops))
    with counting() as c:
        out = fn()
        out.backward(dout)
    both = (dict(c.launches), dict(c.ops))
    _clear(leaves)
    return {
        "fwd_launches": sum(fwd[0].values()),
        "fwd_aten_ops": sum(fwd[1].values()),
        "fwdbwd_launches": sum(both[0].values()),
        "fwdbwd_aten_ops": sum(both[1].values()),
        "fwdbwd_aten_compute_ops": sum(n for op, n in both[1].items() if op not in NO_KERNEL_OPS),
        "fwdbwd_launches_by_kernel": both[0],
        "fwdbwd_aten_ops_by_name": both[1],
    }


def host_ms(fn, leaves, calls: int, backward: bool) -> float:
    """Wall ms per call over ``calls`` calls without synchronisation (CUDA: the host's cost at a tiny shape, where
    the GPU finishes each kernel before the host issues the next; CPU with ``--stub-kernels``: the Python and aten
    work around the launches, the kernels and triton's launcher left out)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(10):
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
            _clear(leaves)
    dout = torch.ones_like(out.detach())
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
        if backward:
            out.backward(dout)
            _clear(leaves)
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) * 1e3 / calls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--shape", default="1,4,128,64" if cuda else "1,2,20,16", help="B,H,N,D")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--time", action="store_true", help="also time host ms per call (CUDA, or CPU with --stub-kernels)")
    p.add_argument(
        "--stub-kernels",
        action="store_true",
        help="with --time on the CPU: triton launches return at once, so the time is the Python and aten work around "
        "them (not comparable with CUDA host times, which include triton's launcher)",
    )
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--only", default="", help="comma-separated substrings of the call names to run")
    p.add_argument("--verbose", action="store_true", help="print the launches and aten ops by name")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    if args.time and not cuda and not args.stub_kernels:
        p.error("--time needs CUDA, or --stub-kernels on the CPU (where the kernels run in the interpreter)")
    b, h, n, d = (int(x) for x in args.shape.split(","))
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    _patch_triton_run()
    calls = make_calls(b, h, n, d, dtype, device)
    only = [s for s in args.only.split(",") if s]
    rows = []
    env = f"torch {torch.__version__}, device {torch.cuda.get_device_name() if cuda else 'cpu (TRITON_INTERPRET=1)'}"
    print(f"# {env}; B{b} H{h} N{n} D{d} {args.dtype}")
    header = "| call | fwd launches | fwd aten ops | fwd+bwd launches | fwd+bwd aten ops | of which compute |"
    if args.time:
        header += " host ms fwd | host ms fwd+bwd |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, (fn, leaves) in calls.items():
        if only and not any(s in name for s in only):
            continue
        try:
            row = {"call": name, **count_call(fn, leaves)}
        except TypeError as exc:  # an argument this version of hf_rbf does not have (comparing against older code)
            print(f"| {name} | n/a: {exc} |")
            continue
        line = (
            f"| {name} | {row['fwd_launches']} | {row['fwd_aten_ops']} | {row['fwdbwd_launches']} | "
            f"{row['fwdbwd_aten_ops']} | {row['fwdbwd_aten_compute_ops']} |"
        )
        if args.time:
            _COUNTER.skip_kernels = args.stub_kernels
            row["host_ms_fwd"] = host_ms(fn, leaves, args.calls, backward=False)
            row["host_ms_fwdbwd"] = host_ms(fn, leaves, args.calls, backward=True)
            _COUNTER.skip_kernels = False
            line += f" {row['host_ms_fwd']:.3f} | {row['host_ms_fwdbwd']:.3f} |"
        print(line, flush=True)
        if args.verbose:
            print(f"    launches: {row['fwdbwd_launches_by_kernel']}")
            print(f"    aten ops: {dict(sorted(row['fwdbwd_aten_ops_by_name'].items()))}")
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "shape": [b, h, n, d], "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
