"""Where training time goes: host cost per attention call, a torch.profiler view of whole training steps, and the
kernels' share, for every family against dot-product SDPA and ``LlamaForCausalLM`` in one process on one GPU.

    PYTHONPATH=. python benchmarks/profile_training.py --out benchmarks/results/<name> [--quick]

1. Host cost per call: milliseconds of CPU time spent in one forward call (and one forward+backward) of each
   attention function with its default CUDA backend, at a tiny shape (B1 H4 N128 D64) where the GPU finishes every
   kernel long before the host issues the next, so wall time per call over a loop without synchronisation is the
   host's cost.  The same for ``F.scaled_dot_product_attention``.
2. Training steps (bf16 autocast, fused AdamW, weights in float32 as Trainer keeps them, random tokens): ms per step
   and tokens/s of each family's default model (rbf with 1 register and SuSiE, rbf without registers with RoPE, gka,
   scalar_sort, hybrid_sort) against Llama (SDPA) of the same width, at d256 L4 H4 T256 B64 and d768 L12 H12 T1024
   B16.  For rbf-default, gka and Llama at d256, a torch.profiler trace of 3 steps summarised: CPU self time and CUDA
   time of the top operators, kernel launches per step, GPU busy time against step time (the host-bound gap).
3. Kernel time per pass (forward, backward) of the fused kernels at N 1024 and 8192 from the profiler.

Writes ``profile.md`` (tables and the summary) and ``profile.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decoder_settings import decoder_settings  # noqa: E402


def _sync():
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# 1. host cost per call
# ----------------------------------------------------------------------------------------------------------------


def attention_calls(b, h, n, d, dtype, grad):
    """name -> (zero-argument call, leaves): one call per family through its public function (default backend)."""
    import hf_rbf

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to("cuda", dtype).requires_grad_(grad)

    def par(x):
        return x.to("cuda").requires_grad_(grad)

    q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
    qs, ks = rnd(b, h, n), rnd(b, h, n)
    vg = rnd(b, h, n, d)
    tau = par(torch.full((h,), 0.3))
    log_sigma = par(torch.full((h,), 0.25 * math.log(d)))
    gamma = par(torch.full((h,), 1.0 / math.sqrt(d)))
    calls = {
        "sdpa (dot product)": (
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            [q, k, v],
        ),
        "rbf_attention": (lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, causal=True), [q, k, v, gamma]),
        "rbf_attention + 1 prefix key": (
            lambda: hf_rbf.rbf_attention(q, k, v, gamma=gamma, causal=True, num_prefix_keys=1),
            [q, k, v, gamma],
        ),
        "gka_attention": (lambda: hf_rbf.gka_attention(q, log_sigma, causal=True), [q, log_sigma]),
        "scalar_attention": (lambda: hf_rbf.scalar_attention(qs, ks, vg, tau, causal=True), [qs, ks, vg, tau]),
        "scalar_attention (triton)": (
            lambda: hf_rbf.scalar_attention(qs, ks, vg, tau, causal=True, backend="triton"),
            [qs, ks, vg, tau],
        ),
        "hybrid_attention": (
            lambda: hf_rbf.hybrid_attention(q, k, vg, qs, ks, tau, causal=True),
            [q, k, vg, qs, ks, tau],
        ),
    }
    return calls


def _custom_op_args(*args):
    """``_DistanceFunction.apply``'s arguments as ``distance_fwd``'s: without the trailing ``a_log``, a log bandwidth
    turned into ``c`` (recorded by autograd, as before the fused call took it)."""
    *args, a_log = args
    if a_log:
        from hf_rbf.attention_distance_triton import inverse_two_variances

        args[6] = inverse_two_variances(args[6])
    return args


class _CustomOpPath:
    """Within the block the fused kernels run through their ``torch.library`` custom ops in eager mode too (the path
    before the eager ``autograd.Function`` went in), so both are timed in one process."""

    def __enter__(self):
        from hf_rbf import attention_distance_triton as adt
        from hf_rbf import attention_scalar_triton as ast

        self.saved = (adt._DistanceFunction.apply, ast._ScalarFunction.apply)
        adt._DistanceFunction.apply = staticmethod(lambda *args: adt.distance_fwd(*_custom_op_args(*args))[0])
        ast._ScalarFunction.apply = staticmethod(lambda *args: ast.scalar_fwd(*args)[0])
        return self

    def __exit__(self, *exc):
        from hf_rbf import attention_distance_triton as adt
        from hf_rbf import attention_scalar_triton as ast

        adt._DistanceFunction.apply, ast._ScalarFunction.apply = self.saved


def host_cost(reps: int = 200) -> list[dict]:
    rows = []
    for path in ("autograd.Function", "custom op"):
        with _CustomOpPath() if path == "custom op" else _NoOp():
            rows += _host_cost(path, reps)
    return rows


class _NoOp:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _host_cost(path: str, reps: int) -> list[dict]:
    rows = []
    for grad in (False, True):
        calls = attention_calls(1, 4, 128, 64, torch.bfloat16, grad)
        for name, (fn, leaves) in calls.items():
            if path == "custom op" and name.startswith("sdpa"):
                continue

            def step():
                out = fn()
                if grad:
                    out.float().sum().backward()
                return out

            for _ in range(10):
                step()
            _sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            t_host = (time.perf_counter() - t0) / reps
            _sync()
            t_all = (time.perf_counter() - t0) / reps
            backend = None
            op = name.split(" ")[0]
            if op != "sdpa":
                import hf_rbf

                backend = hf_rbf.last_backend(op)
            rows.append(
                dict(
                    call=name,
                    path=path,
                    backward=grad,
                    host_ms=1e3 * t_host,
                    wall_ms_synced=1e3 * t_all,
                    backend=backend,
                )
            )
            print(
                f"[host] {path:18s} {name:32s} {'fwd+bwd' if grad else 'fwd':7s} {1e3 * t_host:7.3f} ms  ({backend})",
                flush=True,
            )
    return rows


# ----------------------------------------------------------------------------------------------------------------
# 2. training steps
# ----------------------------------------------------------------------------------------------------------------

VARIANTS = {
    "llama": None,
    "rbf (1 register, SuSiE)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "rbf (no registers, RoPE)": ("rbf", dict(num_register_tokens=0, position_embedding_type="rope")),
    "rbf (1 register, RoPE)": ("rbf", dict(num_register_tokens=1, position_embedding_type="rope")),
    "rbf (no registers, SuSiE)": ("rbf", dict(num_register_tokens=0, position_embedding_type="susie")),
    "gka": ("gka", dict()),
    "scalar_sort": ("scalar_sort", dict()),
    "hybrid_sort": ("hybrid_sort", dict()),
    # the recipes' setting (recipes/configs/tinystories_*_sort.yaml, scale_*_sort.yaml): one register
    "scalar_sort (1 register)": ("scalar_sort", dict(num_register_tokens=1)),
    "hybrid_sort (1 register)": ("hybrid_sort", dict(num_register_tokens=1)),
    # the same models with RoPE through the torch reference instead of the fused kernel (hf_rbf.kernels_rotary): an
    # A/B of the kernel in one process (the step sets `modeling_decoder.rotary_backend` while it runs)
    "rbf (no registers, RoPE, torch RoPE)": ("rbf", dict(num_register_tokens=0, position_embedding_type="rope")),
    "hybrid_sort (1 register, torch RoPE)": ("hybrid_sort", dict(num_register_tokens=1)),
    # the register rows in the flat [B * N + R, D] buffer (`modeling_decoder.register_path = "rows"`, the default
    # until 2026-11-26) instead of the compiled register stream that "auto" picks on CUDA: an A/B in one process
    "rbf (1 register, SuSiE, rows)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "scalar_sort (1 register, rows)": ("scalar_sort", dict(num_register_tokens=1)),
    "hybrid_sort (1 register, rows)": ("hybrid_sort", dict(num_register_tokens=1)),
    # the compiled register step replayed as CUDA graphs (`register_compile_mode = "reduce-overhead"`, an opt-in)
    "rbf (1 register, SuSiE, cudagraph)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "scalar_sort (1 register, cudagraph)": ("scalar_sort", dict(num_register_tokens=1)),
    "hybrid_sort (1 register, cudagraph)": ("hybrid_sort", dict(num_register_tokens=1)),
    # the same with inductor's kernels launched one by one (the default mode), named for A/Bs where the default moves
    "rbf (1 register, SuSiE, no cudagraph)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "scalar_sort (1 register, no cudagraph)": ("scalar_sort", dict(num_register_tokens=1)),
    "hybrid_sort (1 register, no cudagraph)": ("hybrid_sort", dict(num_register_tokens=1)),
    # each layer's compiled register step captured as CUDA graphs of our own (`register_path = "graphed"`,
    # hf_rbf/modeling_register_graph.py), and the compiled stream named for A/Bs where "auto" moves
    "rbf (1 register, SuSiE, graphed)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "scalar_sort (1 register, graphed)": ("scalar_sort", dict(num_register_tokens=1)),
    "hybrid_sort (1 register, graphed)": ("hybrid_sort", dict(num_register_tokens=1)),
    "rbf (1 register, SuSiE, compiled)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "scalar_sort (1 register, compiled)": ("scalar_sort", dict(num_register_tokens=1)),
    "hybrid_sort (1 register, compiled)": ("hybrid_sort", dict(num_register_tokens=1)),
    # triton's JITFunction.run at every kernel launch instead of hf_rbf.kernels_launch's direct launches: an A/B
    "rbf (1 register, SuSiE, triton launch path)": (
        "rbf",
        dict(num_register_tokens=1, position_embedding_type="susie"),
    ),
    "gka (triton launch path)": ("gka", dict()),
    "scalar_sort (1 register, triton launch path)": ("scalar_sort", dict(num_register_tokens=1)),
    "hybrid_sort (1 register, triton launch path)": ("hybrid_sort", dict(num_register_tokens=1)),
    # the distance attention (RBF, GKA, hybrid) traced as triton_ops under torch.compile
    # (`attention_distance_triton.TRITON_OP`, HF_RBF_TRITON_OP=1: Inductor launches the fused kernels from its
    # generated code; docs/triton_op_plan.md step 0 and "Then"), for an A/B against the same model through the custom
    # op, with --compile
    "rbf (no registers, RoPE, triton_op)": ("rbf", dict(num_register_tokens=0, position_embedding_type="rope")),
    "rbf (1 register, SuSiE, triton_op)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "gka (triton_op)": ("gka", dict()),
    "hybrid_sort (1 register, triton_op)": ("hybrid_sort", dict(num_register_tokens=1)),
    # the same through the custom ops (HF_RBF_TRITON_OP=0; the default until 2026-11-28), for the A/B from the other
    # side now that the triton_ops are the default
    "rbf (no registers, RoPE, custom op)": ("rbf", dict(num_register_tokens=0, position_embedding_type="rope")),
    "rbf (1 register, SuSiE, custom op)": ("rbf", dict(num_register_tokens=1, position_embedding_type="susie")),
    "gka (custom op)": ("gka", dict()),
    "hybrid_sort (1 register, custom op)": ("hybrid_sort", dict(num_register_tokens=1)),
    # the scalar family through its custom ops scalar_fwd / scalar_bwd (HF_RBF_SCALAR_TRITON_OP=0; the default until
    # session 25) against its triton_ops (the default since: "scalar_sort (1 register)" is the same as
    # "scalar_sort (1 register, triton_op)"; docs/triton_op_plan.md, "Scalar as built")
    "scalar_sort (1 register, custom op)": ("scalar_sort", dict(num_register_tokens=1)),
    "scalar_sort (1 register, triton_op)": ("scalar_sort", dict(num_register_tokens=1)),
}
# variant-name suffix -> the `hf_rbf.modeling_decoder` settings its steps run with (restored after each step)
SETTING_SUFFIXES = {
    ", graphed)": {"register_path": "graphed"},
    ", compiled)": {"register_path": "compiled"},
    ", torch RoPE)": {"rotary_backend": "torch"},
    ", rows)": {"register_path": "rows"},
    ", no cudagraph)": {"register_compile_mode": "default"},
    ", cudagraph)": {"register_compile_mode": "reduce-overhead"},
    "triton launch path)": {"kernels_launch.DIRECT_LAUNCH": False},
    # read while dynamo traces the step, which guards on it: each model keeps the value its steps run with
    # (", triton_op)" and "gka (triton_op)")
    # (the scalar family's own flag with it: attention_scalar_triton.SCALAR_TRITON_OP, on by default since session 25)
    "triton_op)": {"attention_distance_triton.TRITON_OP": True, "attention_scalar_triton.SCALAR_TRITON_OP": True},
    "custom op)": {"attention_distance_triton.TRITON_OP": False, "attention_scalar_triton.SCALAR_TRITON_OP": False},
}


def module_settings_of(variant: str) -> dict:
    """The ``hf_rbf.modeling_decoder`` settings a variant's steps run with (the defaults unless its name says so)."""
    for suffix, settings in SETTING_SUFFIXES.items():
        if variant.endswith(suffix):
            return settings
    return {}


def module_settings(variant: str):
    """``module_settings_of(variant)`` applied to ``hf_rbf.modeling_decoder`` while the block runs."""
    return decoder_settings(module_settings_of(variant))


SIZES = {
    "d256": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=688, seq=256, batch=64),
    "d768": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048, seq=1024, batch=16
    ),
    # the scale-out recipes' 1B body (recipes/configs/_scale_1b.yaml: D128 heads), 8 blocks as the scaling runs
    "d2048": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, intermediate_size=8192, seq=1024, batch=8
    ),
}


def build(variant: str, size: dict, device: str = "cuda"):
    import hf_rbf  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    common = dict(
        vocab_size=8192,
        hidden_size=size["hidden_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"],
        intermediate_size=size["intermediate_size"],
        max_position_embeddings=size["seq"],
    )
    if VARIANTS[variant] is None:
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
    else:
        family, extra = VARIANTS[variant]
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **common, **extra))
    return model.to(device).train()


def train_steps(model, size, steps: int, warmup: int, profile_steps: int = 0):
    b, t = size["batch"], size["seq"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 8192, (b, t), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    _sync()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    result = dict(
        ms_per_step=ms,
        tokens_per_s=b * t / (ms / 1e3),
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        first_step_s=first_s,
    )
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(profile_steps):
                step()
            _sync()
        result["profile"] = summarise_profile(prof, profile_steps, ms)
    return result


def interleaved_steps(
    variants,
    size: dict,
    steps: int,
    rounds: int,
    compile_model: bool = False,
    compile_mode=None,
    save=None,
    profile_steps: int = 0,
) -> dict:
    """Every variant's model built side by side, then ``rounds`` rounds in which each model runs ``steps`` timed steps
    in turn: the best round of each is reported (the hosts are noisy: one Llama step took 13.6 and 29.7 ms in one
    process), with the step's activation peak (peak allocated during its own steps minus what was allocated before:
    the other models' weights are resident too).

    ``compile_model``: ``torch.compile(model, mode=compile_mode)`` for every model.  ``save(rows)`` is called after
    each model's first steps and after each round, so that a job cut at its time limit keeps what it measured (a
    call compiling five d768 models lost the first four's first steps: benchmarks/results/h100-2026-11-28b call 3).
    ``profile_steps``: after the rounds, that many more steps of each model under torch.profiler, summarised in its
    row's ``profile`` (``--profile-all``: the compiled models' kernel time per op, which the plain path cannot give)."""
    b, t = size["batch"], size["seq"]
    ids = torch.randint(0, 8192, (b, t), device="cuda")
    runs, rows = {}, {}
    save = save or (lambda rows: None)
    for variant in variants:
        try:
            model = build(variant, size)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            forward = torch.compile(model, mode=compile_mode) if compile_model else model

            def step(model=forward, opt=opt, variant=variant):
                with module_settings(variant), torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            t0 = time.perf_counter()
            step()
            _sync()
            rows[variant] = dict(first_step_s=time.perf_counter() - t0, ms_per_step=float("inf"), rounds_ms=[])
            for _ in range(3):
                step()
            _sync()
            runs[variant] = step
        except Exception as err:  # a failing family must not hide the others' numbers
            rows[variant] = dict(error=f"{type(err).__name__}: {err}")
        r = rows[variant]
        shown = f"{r['first_step_s']:.1f} s" if "error" not in r else "failed"
        print(f"[first step] {variant:26s} {shown}", flush=True)
        save(rows)
    for _ in range(rounds):
        for variant, step in runs.items():
            _sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            _sync()
            ms = 1e3 * (time.perf_counter() - t0) / steps
            r = rows[variant]
            r["rounds_ms"].append(ms)
            r["ms_per_step"] = min(r["ms_per_step"], ms)
            r["tokens_per_s"] = b * t / (r["ms_per_step"] / 1e3)
            r["activation_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            r["peak_gib"] = r["activation_peak_gib"]  # the markdown's peak column: activations only, here
        save(rows)
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        for variant, step in runs.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                for _ in range(profile_steps):
                    step()
                _sync()
            rows[variant]["profile"] = summarise_profile(prof, profile_steps, rows[variant]["ms_per_step"])
            for e in rows[variant]["profile"]["gpu_top"][:12]:
                shown = f"gpu {e['ms_per_step']:8.2f} ms {e['calls_per_step']:5.0f}x {e['name']}"
                print(f"    {variant}: {shown}", flush=True)
            save(rows)
    for variant, r in rows.items():
        print(
            f"[interleaved] {variant:26s} "
            + (
                f"best {r['ms_per_step']:.1f} ms, rounds {[round(x, 1) for x in r['rounds_ms']]}, activation peak "
                f"{r['activation_peak_gib']:.2f} GiB, first step {r['first_step_s']:.1f} s"
                if "error" not in r
                else r["error"][:200]
            ),
            flush=True,
        )
    return rows


def summarise_profile(prof, steps: int, step_ms: float) -> dict:
    events = prof.key_averages()
    # Kernels only: not the GPU-timeline ranges of user annotations (``record_function``: inductor's "## Call
    # CompiledFxGraph ... ##", "Optimizer.step#AdamW.step"), which span the host gaps between their kernels and were
    # counted as busy time (the compiled register step's ranges added 24 ms to a 50 ms step, h100-2026-11-26e).
    kernels = [
        e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    gpu_top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:20]
    return dict(
        op_top=ops_by_device_time(prof, steps),
        gpu_busy_ms_per_step=gpu_us / 1e3 / steps,
        step_ms=step_ms,
        kernel_launches_per_step=launches / steps,
        cpu_top=[
            dict(
                name=e.key[:90],
                calls_per_step=e.count / steps,
                self_cpu_ms_per_step=e.self_cpu_time_total / 1e3 / steps,
            )
            for e in cpu_top
        ],
        gpu_top=[
            dict(name=e.key[:90], calls_per_step=e.count / steps, ms_per_step=e.self_device_time_total / 1e3 / steps)
            for e in gpu_top
        ],
    )


def ops_by_device_time(prof, steps: int, top: int = 30) -> list[dict]:
    """The aten ops (with their input shapes) whose kernels took the most GPU time per step: which elementwise ops,
    copies and casts on which tensors a step pays for, where the kernel names alone (``elementwise_kernel<...>``) do
    not say.  Needs ``record_shapes=True``; empty when the profile has no shapes."""
    try:
        events = prof.key_averages(group_by_input_shape=True)
    except Exception:  # noqa: BLE001  (a profile without shapes: nothing to group)
        return []
    ops = [e for e in events if e.key.startswith("aten::") and e.self_device_time_total > 0]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [
        dict(
            name=e.key,
            shapes=str(e.input_shapes)[:120],
            calls_per_step=e.count / steps,
            ms_per_step=e.self_device_time_total / 1e3 / steps,
        )
        for e in ops[:top]
    ]


# ----------------------------------------------------------------------------------------------------------------
# 3. kernel time per pass
# ----------------------------------------------------------------------------------------------------------------


def kernel_passes(n_values, d: int = 64) -> list[dict]:
    import hf_rbf
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for n in n_values:
        b, h = max(1, 32768 // n), 16
        for name in ("rbf_attention", "sdpa (dot product)"):
            fn, leaves = attention_calls(b, h, n, d, torch.bfloat16, True)[name]
            for _ in range(3):
                fn().float().sum().backward()
            _sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn().float().sum().backward()
                _sync()
            for e in prof.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
                    rows.append(
                        dict(
                            n=n,
                            d=d,
                            call=name,
                            kernel=e.key[:80],
                            calls=e.count / 5,
                            ms=e.self_device_time_total / 1e3 / 5,
                        )
                    )
        _ = hf_rbf
    return rows


# ----------------------------------------------------------------------------------------------------------------


def write_markdown(res: dict, path: Path) -> None:
    lines = [
        "# Training-time profile",
        "",
        f"GPU: {res['gpu']}; torch {res['torch']}; triton {res['triton']}; transformers {res['transformers']}",
        "",
    ]
    lines += [
        "## Host cost per attention call (B1 H4 N128 D64, bf16; no synchronisation)",
        "",
        "| call | path | pass | host ms | backend |",
        "|---|---|---|---|---|",
    ]
    for r in res["host"]:
        lines.append(
            f"| {r['call']} | {r.get('path', '')} | {'fwd+bwd' if r['backward'] else 'fwd'} | {r['host_ms']:.3f} | "
            f"{r['backend'] or ''} |"
        )
    for size, rows in res["steps"].items():
        base = rows.get("llama", {}).get("tokens_per_s")
        lines += [
            "",
            f"## Training steps, {size}",
            "",
            "| model | ms/step | tokens/s | vs Llama | peak GiB | first step s | GPU busy ms/step | launches/step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error'][:120]} | | | | | | |")
                continue
            p = r.get("profile", {})
            ratio = r["tokens_per_s"] / base if base else float("nan")
            # (a run without a profile, e.g. --interleave without --profile-all, has no GPU busy time or launches)
            busy = f"{p['gpu_busy_ms_per_step']:.1f}" if "gpu_busy_ms_per_step" in p else "-"
            launches = f"{p['kernel_launches_per_step']:.0f}" if "kernel_launches_per_step" in p else "-"
            lines.append(
                f"| {name} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {ratio:.2f}x | {r['peak_gib']:.2f} | "
                f"{r['first_step_s']:.1f} | {busy} | {launches} |"
            )
        for name, r in rows.items():
            p = r.get("profile")
            if not p:
                continue
            lines += [
                "",
                f"### {size} {name}: top CPU self time per step",
                "",
                "| op | calls/step | self CPU ms/step |",
                "|---|---|---|",
            ]
            lines += [
                f"| `{e['name']}` | {e['calls_per_step']:.0f} | {e['self_cpu_ms_per_step']:.2f} |" for e in p["cpu_top"]
            ]
            lines += [
                "",
                f"### {size} {name}: top GPU kernels per step",
                "",
                "| kernel | calls/step | ms/step |",
                "|---|---|---|",
            ]
            lines += [f"| `{e['name']}` | {e['calls_per_step']:.0f} | {e['ms_per_step']:.2f} |" for e in p["gpu_top"]]
            if p.get("op_top"):
                lines += [
                    "",
                    f"### {size} {name}: aten ops by the GPU time of their own kernels, per step",
                    "",
                    "| op | input shapes | calls/step | ms/step |",
                    "|---|---|---|---|",
                ]
                lines += [
                    f"| `{e['name']}` | `{e['shapes']}` | {e['calls_per_step']:.0f} | {e['ms_per_step']:.2f} |"
                    for e in p["op_top"]
                ]
    lines += [
        "",
        "## Kernel time per pass (fwd+bwd, B = 32768/N, H16, D64, bf16, causal)",
        "",
        "| N | call | kernel | calls | ms |",
        "|---|---|---|---|---|",
    ]
    for r in res["kernels"]:
        lines.append(f"| {r['n']} | {r['call']} | `{r['kernel']}` | {r['calls']:.0f} | {r['ms']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="d256 only, fewer steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--sizes", type=lambda x: x.split(","), default=None, help="comma-separated subset of: d256,d768,d2048"
    )
    ap.add_argument("--profile-all", action="store_true", help="a torch.profiler summary for every variant and size")
    ap.add_argument("--no-host", action="store_true", help="skip the host-cost section")
    ap.add_argument("--interleave", type=int, default=0, help="R rounds of interleaved timing, all models resident")
    ap.add_argument(
        "--compile", action="store_true", help="with --interleave: torch.compile every model (default mode)"
    )
    ap.add_argument(
        "--compile-mode",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="with --compile: torch.compile's mode (reduce-overhead: CUDA graphs, no per-kernel host launches)",
    )
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel-time section")
    ap.add_argument(
        "--variants",
        type=lambda x: x.split(";"),
        default=None,
        help=f"semicolon-separated subset of: {'; '.join(VARIANTS)}",
    )
    ap.add_argument(
        "--first-steps",
        action="store_true",
        help="only the first training step of every model at d256 (run it in a second process after a full run: "
        "the first step on a warm machine, where the autotuner's choices are cached on disk)",
    )
    args = ap.parse_args()
    unknown = [name for name in (args.sizes or []) if name not in SIZES]
    if unknown:
        ap.error(f"--sizes takes a comma-separated subset of {', '.join(SIZES)}; got {unknown}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.first_steps:
        firsts = {}
        for variant in args.variants or VARIANTS:
            model = build(variant, SIZES["d256"])
            firsts[variant] = train_steps(model, SIZES["d256"], steps=1, warmup=0)["first_step_s"]
            print(f"[first step, warm machine] {variant:26s} {firsts[variant]:.1f} s", flush=True)
            del model
        (out / "first_steps.json").write_text(json.dumps(firsts, indent=1))
        return 0
    import transformers
    import triton

    res = dict(
        gpu=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
    )
    res["host"] = [] if args.no_host else host_cost()
    res["steps"] = {}
    sizes = args.sizes or (["d256"] if args.quick else ["d256", "d768"])
    for size_name in sizes:
        size = SIZES[size_name]
        if args.interleave:
            def save(rows, size_name=size_name):
                res["steps"][size_name] = rows
                (out / "profile.json").write_text(json.dumps(res, indent=1))

            res["steps"][size_name] = interleaved_steps(
                args.variants or VARIANTS,
                size,
                args.steps,
                args.interleave,
                compile_model=args.compile,
                compile_mode=args.compile_mode,
                save=save,
                profile_steps=3 if args.profile_all else 0,
            )
            (out / "profile.json").write_text(json.dumps(res, indent=1))
            gc.collect()
            torch.cuda.empty_cache()
            continue
        rows = {}
        for variant in args.variants or VARIANTS:
            profiled = ("llama", "rbf (1 register, SuSiE)", "gka")
            profile = 3 if args.profile_all or (size_name == "d256" and variant in profiled) else 0
            try:
                model = build(variant, size)
                with module_settings(variant):
                    rows[variant] = train_steps(model, size, steps=args.steps, warmup=5, profile_steps=profile)
                del model
            except Exception as err:  # a failing family must not hide the others' numbers
                rows[variant] = dict(error=f"{type(err).__name__}: {err}")
            torch.cuda.empty_cache()
            r = rows[variant]
            res["steps"][size_name] = rows
            (out / "profile.json").write_text(json.dumps(res, indent=1))
            for e in r.get("profile", {}).get("gpu_top", [])[:12]:
                print(f"    gpu {e['ms_per_step']:8.2f} ms {e['calls_per_step']:5.0f}x {e['name']}", flush=True)
            for e in r.get("profile", {}).get("cpu_top", [])[:8]:
                print(
                    f"    cpu {e['self_cpu_ms_per_step']:8.2f} ms {e['calls_per_step']:5.0f}x {e['name']}", flush=True
                )
            print(
                f"[step] {size_name} {variant:26s} "
                + (f"{r['ms_per_step']:.1f} ms" if "ms_per_step" in r else r["error"][:200]),
                flush=True,
            )
        res["steps"][size_name] = rows
        (out / "profile.json").write_text(json.dumps(res, indent=1))
    res["kernels"] = [] if args.no_kernels else kernel_passes([1024, 8192])
    (out / "profile.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, out / "profile.md")
    print((out / "profile.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
