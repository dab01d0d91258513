"""Compile the fused kernels for a GPU that is not here (default sm_90, the H100 / H200) and report what the compiler
made of them: registers, spills, shared memory, SASS instruction mix and layout conversions, per kernel variant.

    PYTHONPATH=. python benchmarks/offline_kernel_report.py [--arch 90] [--cases rbf,gka,hybrid,hybrid_tau,scalar] \\
        [--n 1024] [--d 64] [--config BLOCK_M=128,BLOCK_N=64,num_warps=4,num_stages=3] [--forward-only] \\
        [--out DIR] [--asm-dir DIR]

No GPU is needed: a stand-in driver reports the target, our host code (``distance_forward`` / ``distance_backward`` /
``scalar_forward`` / ``scalar_backward``) builds every argument exactly as for a real call on CPU tensors, and every
triton launch is turned into a compile (``warmup``).  The cubin's resource usage comes from ``cuobjdump`` (shipped
with triton), the instruction mix from ``nvdisasm``.  Timing needs the GPU; these numbers are what to look at between
GPU sessions: a spilling kernel (local memory traffic) or a score tile converted through shared memory
(``convert_layout`` ops in TTGIR, ``STS`` / ``LDS`` in the loop) is slow whatever the tile sizes.

The ``probe_*`` cases compile ``benchmarks/probe_hopper_forward.py``'s two-loop descriptor kernel the same way (its
launch function on CPU tensors), to set the shipped forward's code next to it; the ``loops`` column gives each loop
body of the SASS (instructions / MMAs / local loads and stores), where a spill costs every tile.

``--checks FAMILIES`` compiles instead every variant that the GPU tests' cases (``kernel_checks.full_cases``: dtypes,
head dims, masks, prefix, padding, key weights, decode) launch, at shortened lengths, and reports each kernel's
spills: a kernel change that no longer compiles for the GPU shows here, without one.

A kernel that does not compile is a row of the report with its error's first 300 characters (``OFFLINE_FULL_ERRORS=1``:
the whole message).

Autotuning is off (each kernel's first fitting config, or the one ``--config`` names, applied to every kernel whose
parameters it names).  Run it with the triton version of the GPU machines (3.6) for numbers that match them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["HF_RBF_TRITON_AUTOTUNE"] = "0"
# every launch here is a compile: no launcher to call directly (hf_rbf.kernels_launch would ask for a CUDA device)
os.environ["HF_RBF_TRITON_DIRECT_LAUNCH"] = "0"
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as _driver
from triton.runtime.jit import JITFunction


class OfflineDriver:
    """The parts of triton's active driver that compiling (not launching) a kernel asks for."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True

    def __getattr__(self, name):  # anything else means the code wanted a real GPU
        raise RuntimeError(f"offline compile: the triton driver was asked for {name!r}")


COMPILED: list = []
FORCED_CONFIG: dict = {}


def _compile_only(self, *args, grid, warmup, **kwargs):
    names = [p.name for p in self.params]
    for key, value in FORCED_CONFIG.items():
        if key in names or key in ("num_warps", "num_stages"):
            kwargs[key] = value
    kernel = _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    constexprs = {p.name: bound.get(p.name) for p in self.params if p.is_constexpr}
    COMPILED.append((self.fn.__name__, constexprs, kernel))
    return kernel


_ORIGINAL_RUN = JITFunction.run


def resource_usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of the kernel in a cubin (``cuobjdump --dump-resource-usage``)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=False
        ).stdout
    out = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"{key}:(\d+)", text)
        out[key.lower()] = int(m.group(1)) if m else None
    return out


def sass_text(cubin: bytes) -> str:
    """The cubin's SASS (``nvdisasm -c``)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=False).stdout


_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?(.*)")


def sass_loop_bodies(text: str) -> list:
    """The loop bodies of a SASS listing, in program order, as a Counter of instruction names each: a loop is a
    backward branch before the kernel's last ``EXIT`` (the retry loops of barrier waits, placed after it, are left
    out), its body the instructions from the branch target to the branch."""
    ops, labels = [], {}
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = _SASS_OP.search(line)
        if m:
            ops.append((m.group(1), m.group(2)))
    exits = [i for i, (op, _) in enumerate(ops) if op == "EXIT"]
    bodies = []
    for i, (op, rest) in enumerate(ops[: exits[-1] if exits else len(ops)]):
        target = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
        if target and labels.get(target.group(1), i + 1) <= i:
            bodies.append(collections.Counter(o for o, _ in ops[labels[target.group(1)] : i + 1]))
    return bodies


def sass_loops(text: str) -> str:
    """The loop bodies (:func:`sass_loop_bodies`) as ``instructions/MMAs/local loads+stores`` each.  Spills outside
    the loops cost little; in a tile loop they cost every tile."""
    loops = []
    for body in sass_loop_bodies(text):
        mma = sum(body[o] for o in ("HGMMA", "HMMA", "WGMMA"))
        loops.append(f"{sum(body.values())}/{mma}/{body['LDL'] + body['STL']}")
    return " ".join(loops)


# the per-element work of a tile loop: fp32 arithmetic, exponentials, the casts of P to 16 bits
_LOOP_MIX_OPS = ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "F2FP", "FSEL", "ISETP")


def sass_loop_mix(text: str) -> str:
    """Each loop body's count of the instructions a score element costs (``_LOOP_MIX_OPS``), as
    ``total: FADD a FMUL b ...`` per loop, separated by ``; ``."""
    return "; ".join(
        f"{sum(body.values())}: " + " ".join(f"{o} {body[o]}" for o in _LOOP_MIX_OPS if body[o])
        for body in sass_loop_bodies(text)
    )


def sass_mix(cubin: bytes) -> dict:
    """Counts of the instruction classes that tell the story: tensor-core MMAs, shared-memory traffic, local-memory
    (spill) traffic, special-function (exp2) ops and layout shuffles; ``loops``: see :func:`sass_loops`."""
    text = sass_text(cubin)
    ops = collections.Counter()
    for line in text.splitlines():
        m = _SASS_OP.search(line)
        if m:
            ops[m.group(1)] += 1
    groups = {
        "mma": ("HGMMA", "HMMA", "WGMMA"),
        "shared_st": ("STS", "STSM"),
        "shared_ld": ("LDS", "LDSM"),
        "ldl_stl": ("LDL", "STL"),
        "mufu": ("MUFU",),
        "shfl": ("SHFL",),
        "bar": ("BAR",),
    }
    out = {name: sum(ops[o] for o in names) for name, names in groups.items()}
    out["total"] = sum(ops.values())
    out["loops"] = sass_loops(text)
    out["loop_mix"] = sass_loop_mix(text)
    return out


def write_asm(folder: str, stem: str, kernel) -> None:
    """``stem.ttgir`` / ``.ptx`` / ``.sass`` of a compiled kernel (SASS by ``nvdisasm -c``)."""
    os.makedirs(folder, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(folder, f"{stem}.{ext}"), "w") as f:
            f.write(kernel.asm.get(ext, ""))
    with open(os.path.join(folder, f"{stem}.sass"), "w") as f:
        f.write(sass_text(kernel.asm["cubin"]))


def report_kernel(name: str, constexprs: dict, kernel) -> dict:
    ttgir = kernel.asm.get("ttgir", "")
    row = {"kernel": name, **resource_usage(kernel.asm["cubin"]), **sass_mix(kernel.asm["cubin"])}
    row["convert_layout"] = ttgir.count("ttg.convert_layout")
    row["local_alloc"] = ttgir.count("ttg.local_alloc")
    row["num_warps"] = kernel.metadata.num_warps
    row["num_stages"] = kernel.metadata.num_stages
    row["shared_bytes"] = kernel.metadata.shared
    tiles = {k: v for k, v in constexprs.items() if k in ("BLOCK_M", "BLOCK_N", "ROWS", "HP")}
    row["tiles"] = " ".join(f"{k}={v}" for k, v in tiles.items())
    flags = [k for k, v in constexprs.items() if v is True]
    row["flags"] = " ".join(flags)
    return row


def cases(names, n: int, d: int, dtype, prefix_keys: int = 0, forward_only: bool = False):
    """Inputs of each family's training call (B1 H4, causal), as CPU tensors: the host code builds the launch."""
    from hf_rbf.kernels_common import key_bias
    from hf_rbf.kernels_flash_bwd import distance_backward
    from hf_rbf.kernels_flash_fwd import distance_decode, distance_forward
    from hf_rbf.kernels_scalar_bwd import scalar_backward
    from hf_rbf.kernels_scalar_fwd import scalar_forward

    b, h = 1, 4
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    out = {}
    for name in names:
        if name in ("rbf", "gka", "gka_log", "hybrid", "hybrid_tau", "rbf_nonorm", "rbf_pass"):
            # prefix keys (registers, the sorted families' sink) sit before the text keys, as the models pass them
            nk = n + prefix_keys
            q, k = rnd(b, h, n, d), rnd(b, h, nk, d)
            gka = name in ("gka", "gka_log")  # gka_log: a learnable bandwidth in training (A_LOG: c formed in-kernel)
            v = k if gka else rnd(b, h, nk, d)
            qs = ks = beta = None
            hybrid = name in ("hybrid", "hybrid_tau")
            if hybrid:
                qs, ks, beta = rnd(b, h, n).float(), rnd(b, h, nk).float(), torch.ones(b, h, n)
            if name == "hybrid_tau":  # the model's / bench_attention.py's call: a per-head tau, 1 / tau in the kernels
                beta = torch.ones(1, h, 1)
            a = torch.full((h,), 0.125)
            bb = None if not hybrid else torch.zeros(h)
            flags = dict(
                causal=True,
                window=None,
                num_prefix_keys=prefix_keys,
                normalize=True,
                qnorm=gka,
                kv_same=gka,
                eps=1e-6 if gka else 0.0,
                tau_in=name == "hybrid_tau",
            )
            # rbf_nonorm: the same kernel without the key-norm term (a plain scaled softmax: the kernel's own shape);
            # rbf_pass: the norms from the key-bias pass (one fp32 bias per key) instead of the key tiles
            knorm = name not in ("hybrid", "hybrid_tau", "rbf_nonorm")
            inline = knorm and name != "rbf_pass"
            kb = key_bias(k, -a, None, None, h, nk, b, True)[0] if name == "rbf_pass" else None

            # (every value the body reads is bound here: the cases run after this loop, whose `name` is then the last)
            def run(q=q, k=k, v=v, kb=kb, qs=qs, ks=ks, beta=beta, a=a, bb=bb, flags=flags, knorm=knorm, inline=inline,
                    a_log=name == "gka_log"):  # fmt: skip
                o, lse = distance_forward(
                    q, k, v, kb, qs, ks, beta, a, bb, knorm_inline=inline, a_log=a_log, **flags
                )
                if forward_only:
                    return
                distance_backward(
                    o, q, k, v, kb, qs, ks, beta, a, bb, o, lse, knorm=knorm, knorm_inline=inline,
                    need_dbeta=qs is not None, a_log=a_log, **flags
                )

            out[name] = run
        elif name.removesuffix("_overlap") in ("probe_tile", "probe_bias", "probe_nonorm"):
            # benchmarks/probe_hopper_forward.py's compact two-loop causal forward (tensor descriptors, an unmasked
            # off-band loop and a masked diagonal loop): norm from the key tile, from a bias vector, or none; with
            # "_overlap" the off-band loop issues the next tile's product before this tile's softmax
            import probe_hopper_forward as probe

            q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
            c = torch.full((h,), 0.5 / d**0.5)
            kb = probe.key_bias_vector(k, c)
            norm = {"probe_tile": 2, "probe_bias": 1, "probe_nonorm": 0}[name.removesuffix("_overlap")]
            cfg = (
                FORCED_CONFIG.get("BLOCK_M", 128),
                FORCED_CONFIG.get("BLOCK_N", 64),
                FORCED_CONFIG.get("num_warps", 4),
                FORCED_CONFIG.get("num_stages", 3),
            )

            loop = "overlap" if name.endswith("_overlap") else "plain"

            def run(q=q, k=k, v=v, c=c, kb=kb, norm=norm, cfg=cfg, loop=loop):
                probe.probe_forward(q, k, v, c, kb, norm, loop, cfg)

            out[name] = run
        elif name == "gluon":
            # benchmarks/probe_gluon_forward.py: the causal rbf forward in Gluon with FlashAttention-3's waits; tiles
            # from --config (BLOCK_M, BLOCK_N, num_warps), else its first config
            import probe_gluon_forward as gluon_probe
            import probe_hopper_forward as probe

            q, k, v = (rnd(b, h, n, d).to(torch.bfloat16) for _ in range(3))
            c = torch.full((h,), 0.5 / d**0.5)
            cfg = tuple(FORCED_CONFIG.get(key, dflt) for key, dflt in zip(("BLOCK_M", "BLOCK_N", "num_warps"),
                                                                         gluon_probe.CONFIGS[0]))

            def run(q=q, k=k, v=v, c=c, kb=probe.key_bias_vector(k, c), cfg=cfg):
                gluon_probe.gluon_forward(q, k, v, c, kb, cfg)

            out[name] = run
        elif name in ("rbf_decode", "gka_decode"):
            q, k = rnd(b, h, 1, d), rnd(b, h, n, d)
            v = k if name == "gka_decode" else rnd(b, h, n, d)
            gka = name == "gka_decode"

            def run(q=q, k=k, v=v, gka=gka):
                distance_decode(
                    q,
                    k,
                    v,
                    None,
                    None,
                    None,
                    None,
                    torch.full((h,), 0.125),
                    None,
                    causal=True,
                    window=None,
                    num_prefix_keys=0,
                    normalize=True,
                    qnorm=gka,
                    knorm=True,
                    kv_same=gka,
                    eps=1e-6 if gka else 0.0,
                )

            out[name] = run
        elif name in ("sorted_static_scalar", "sorted_static_hybrid"):  # the static sorted cache's fused step
            import bench_sorted_static_decode as bench

            for mod_name, module in list(sys.modules.items()):  # CPU tensors: let the "triton" backend be chosen
                if mod_name.startswith("hf_rbf") and hasattr(module, "static_decode_unavailable_reason"):
                    module.static_decode_unavailable_reason = lambda *a, **k: None
            kind = name.rsplit("_", 1)[1]

            def run(kind=kind):
                dev = torch.device("cpu")
                layer, g_ = bench.build_layer(
                    kind,
                    "triton",
                    b=1,
                    h=12,
                    d=d,
                    n=n,
                    capacity=n + 64,
                    window=64,
                    block_size=max(64, n // 4),
                    device=dev,
                    dtype=dtype,
                    fill_chunk=4096,
                    gen=g,
                )
                bench.step_fn(layer, kind, b=1, h=12, g=g_, d=d, device=dev, dtype=dtype, gen=g)()

            out[name] = run
        elif name == "scalar":
            qs, ks, v = rnd(b, h, n).float(), rnd(b, h, n).float(), rnd(b, 1, n, d)

            def run(qs=qs, ks=ks, v=v):
                tau = torch.ones(b, h, 1)
                o, lse = scalar_forward(qs, ks, v, None, tau, causal=True, window=None, num_prefix_keys=0)
                scalar_backward(
                    o, qs, ks, v, None, tau, lse, causal=True, window=None, num_prefix_keys=0, need_dtau=True
                )

            out[name] = run
    return out


def compile_checks(families) -> int:
    """Compile the kernels of every GPU-test case of ``families`` (see the module docstring); returns the failures."""
    import dataclasses

    import kernel_checks

    from hf_rbf import kernels_common

    # the fused path refuses CPU tensors outside the interpreter: let the calls through (they only compile here)
    for name, module in list(sys.modules.items()):
        if name.startswith("hf_rbf") and hasattr(module, "triton_unavailable_reason"):
            module.triton_unavailable_reason = lambda *a, **k: None
    kernels_common.triton_unavailable_reason = lambda *a, **k: None
    failures = 0
    for case in kernel_checks.full_cases():
        if case.family not in families:
            continue
        short = dataclasses.replace(case, b=1, nq=min(case.nq, 300), nk=min(case.nk, 300 if case.nq > 16 else 600))
        COMPILED.clear()
        try:
            made = kernel_checks.make_inputs(short, "cpu")
            tensors, args = made["tensors"], made["args"]
            kernel_checks._run(short, tensors, args, "triton", kernel_checks._dout(short, "cpu", tensors))
            spills = [f"{n}: {resource_usage(k.asm['cubin'])['stack']} B" for n, _, k in COMPILED]
            print(f"ok    {short.name}  spills {', '.join(spills)}")
        except Exception as exc:  # noqa: BLE001 (every case is reported)
            failures += 1
            print(f"FAIL  {short.name}  {type(exc).__name__}: {str(exc)[:300]}")
    print(f"{failures} failures")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument(
        "--cases",
        default="rbf,gka,hybrid,scalar",
        help="of rbf, gka, hybrid, scalar, rbf_nonorm (no key-norm term), rbf_pass (norms from the key-bias pass), "
        "rbf_decode, gka_decode, sorted_static_scalar, sorted_static_hybrid, probe_tile / probe_bias / probe_nonorm "
        "(benchmarks/probe_hopper_forward.py's two-loop kernel, NORM 2 / 1 / 0, no warp specialisation; its tiles "
        "from --config, else (128, 64, 4, 3)); each with _overlap (the off-band loop issuing the next tile's product "
        "before this tile's softmax), gluon (benchmarks/probe_gluon_forward.py)",
    )
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--forward-only", action="store_true", help="rbf, gka, hybrid...: compile the forward kernel alone")
    ap.add_argument("--prefix-keys", type=int, default=0, help="prefix keys before the N text keys (rbf, gka, hybrid)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--config", default="", help="KEY=VALUE,... forced on every kernel that has the parameter")
    ap.add_argument("--out", default=None, help="folder for report.json / report.md")
    ap.add_argument("--asm-dir", default=None, help="also write each kernel's TTGIR, PTX and SASS there")
    ap.add_argument("--checks", default=None, help="compile the GPU tests' variants of these families instead")
    args = ap.parse_args(argv)
    known = (
        "rbf",
        "rbf_nonorm",
        "rbf_pass",
        "gka",
        "gka_log",
        "hybrid",
        "hybrid_tau",
        "scalar",
        "rbf_decode",
        "gka_decode",
        "sorted_static_scalar",
        "sorted_static_hybrid",
        "probe_tile",
        "probe_bias",
        "probe_nonorm",
        "probe_tile_overlap",
        "probe_bias_overlap",
        "probe_nonorm_overlap",
        "gluon",
    )
    unknown = [c for c in args.cases.split(",") if c not in known]
    if unknown:
        ap.error(f"--cases takes {', '.join(known)}; got {unknown}")
    if args.prefix_keys < 0:
        ap.error(f"--prefix-keys takes a count of keys >= 0; got {args.prefix_keys}")
    checks = args.checks.split(",") if args.checks else []
    if any(f not in ("rbf", "gka", "hybrid", "scalar") for f in checks):
        ap.error(f"--checks takes families of rbf, gka, hybrid, scalar; got {args.checks!r}")
    for item in filter(None, args.config.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            ap.error(f"--config takes KEY=INT items separated by commas (e.g. BLOCK_M=128,num_warps=8); got {item!r}")
        FORCED_CONFIG[key] = int(value)
    _driver.set_active(OfflineDriver(args.arch))
    JITFunction.run = _compile_only
    # triton 3.6's autotuner "times" even a single config before caching it: nothing to time here
    triton.testing.do_bench = lambda fn, *a, quantiles=None, **k: [1.0] * len(quantiles) if quantiles else 1.0
    if args.checks:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        return 1 if compile_checks(checks) else 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rows = []
    made = cases(args.cases.split(","), args.n, args.d, getattr(torch, args.dtype), args.prefix_keys, args.forward_only)
    for name, run in made.items():
        COMPILED.clear()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 (a kernel that does not compile is a row, not the end of the report)
            limit = None if os.environ.get("OFFLINE_FULL_ERRORS") else 300  # the whole message where asked for
            message = f"{type(exc).__name__}: {exc}"
            if limit is None and exc.__cause__ is not None:  # triton's CompilationError keeps the reason there
                message += f"\ncaused by {type(exc.__cause__).__name__}: {exc.__cause__}"
            rows.append({"case": name, "error": message[:limit]})
        for kname, constexprs, kernel in COMPILED:
            if kname.startswith("_key_bias"):
                continue
            rows.append({"case": name, **report_kernel(kname, constexprs, kernel)})
            if args.asm_dir:
                write_asm(args.asm_dir, f"{name}{kname}", kernel)
    cols = ["case", "kernel", "tiles", "num_warps", "num_stages", "reg", "stack", "local", "shared_bytes", "mma"]
    cols += ["shared_st", "shared_ld", "ldl_stl", "mufu", "bar", "convert_layout", "total", "loops"]
    lines = [
        (
            f"# Offline compile for sm_{args.arch} (triton {triton.__version__}), N {args.n}, D {args.d}, "
            f"{args.dtype}, {args.prefix_keys} prefix keys; loops: each loop body of the SASS in program order as "
            "instructions / MMAs / local loads + stores"
        ),
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} |")
            continue
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    lines += ["", "Each loop body's instructions of the per-element kinds (`sass_loop_mix`):", ""]
    lines += [f"- {r['case']} `{r['kernel']}`: {r['loop_mix']}" for r in rows if r.get("loop_mix")]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
