"""Scaling benchmark: tokens/s per GPU, peak memory per GPU and scaling efficiency of the pretraining recipe on one GPU
and under ``accelerate launch`` with DDP and FSDP2, for several process counts, families and sizes.  One command:

    python benchmarks/bench_scaling.py --output benchmarks/results/scaling            # every GPU count up to 8 here
    python benchmarks/bench_scaling.py --processes 1 2 4 --strategies ddp fsdp2 --steps 40 --concurrent \\
        --configs recipes/configs/scale_d768_llama.yaml recipes/configs/scale_1b_rbf.yaml --output DIR

Runs:

* 1 process ("single"): ``recipes/pretrain.py``'s training in one plain process on one GPU, what a user runs without
  ``accelerate``: the baseline of both strategies;
* N > 1 processes: ``accelerate launch --config_file recipes/accelerate/<ddp|fsdp2>.yaml --num_processes N``.

One *launch* trains every recipe in turn (``worker`` mode: the recipe's ``run`` with ``train_only``, no evaluation,
saving, story or checks, plus a callback for peak memory and FSDP units), so a process group, the imports and the
Triton kernels' compile/autotune cache are paid once per (strategy, N), not once per recipe.  Under FSDP2 the worker
leaves the layer class to wrap to each model's ``_no_split_modules`` (``DecoderLayer`` for hf_rbf families,
``LlamaDecoderLayer`` for Llama: the classes the accelerate config and its documented Llama override name), and every
row reports the FSDP units it found, so a model that was not sharded per layer shows.

``--concurrent`` runs launches on disjoint GPUs at once: the single-GPU runs spread over every GPU (one process per GPU,
the recipes dealt round-robin); N-process launches fill the GPUs N at a time: two 2-GPU launches (DDP and FSDP2) side
by side on 4 GPUs, or, with one strategy, its recipes dealt over two 2-GPU launches.  It saves device time; the
host's CPUs are then shared, which the table states.  Results are written after every launch (a run cut by a time limit
keeps what finished), to ``scaling.json`` and ``scaling.md``:

* tokens/s per GPU: the recipe's own measure (``ThroughputCallback``: the steps after the first 5) divided by N;
* peak memory per GPU: the largest ``torch.cuda.max_memory_allocated`` over the N processes during training (weights,
  optimizer state and activations; evaluation and saving are not run); on the CPU dry run the largest resident set
  size (``ru_maxrss``, the whole process so far, interpreter included: only a sanity figure);
* scaling efficiency: tokens/s per GPU at N over the single-GPU run's tokens/s, same recipe;
* with ``--strategy-baselines``, also against the same strategy launched on one process (accelerate with one process:
  FSDP2's bf16 parameters and its host work without communication; DDP without an all-reduce partner).  A single-GPU
  Trainer run keeps float32 parameters under bf16 autocast (the embedding's output and the residual stream stay
  float32), FSDP2 casts them to bf16 once per step and everything downstream runs in bf16: a model with much unfused
  elementwise work (Llama's norms, RoPE and residual adds: about 50 ms of a 144 ms single-GPU d768 step) gains speed
  under FSDP2 that is not scaling, and its efficiency over the plain run exceeds 1 (Llama 1.14 at d768 on 4 x H100,
  our families, whose norms are fused, 0.99-1.04; h100x4-2026-11-28c).  The second column isolates what N processes
  cost.

Weak scaling: every process gets the same blocks per step at every N (``global_batch_size = blocks x N``), so the
work per GPU is the same at every N and an efficiency of 1.0 means linear scaling: ``--blocks-per-gpu`` for every
recipe, by default 64 for the d768 recipes, 16 for the 1B ones and 8 for the others (``BLOCKS_PER_GPU``; the table has a column for it).
``--cpu`` runs the same commands with gloo processes on the CPU (DDP only: accelerate's FSDP needs GPUs), as a dry run
of the whole chain.

The tokenizer and the packed data are prepared once per distinct (tokenizer, data) recipe section (``pretrain.py
--prepare-only``) and shared by the runs; each run's logs and ``summary.json`` stay under ``<output>/runs``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from recipes.pretrain_callbacks import THROUGHPUT_WARMUP_STEPS as WARMUP_STEPS  # noqa: E402 (after the path)

ACCELERATE_CONFIGS = {
    "ddp": "recipes/accelerate/ddp.yaml",
    "fsdp2": "recipes/accelerate/fsdp2.yaml",
    "fsdp2_zero2": "recipes/accelerate/fsdp2_zero2.yaml",  # no reshard after the forward: opt-in
}
DEFAULT_STRATEGIES = ["ddp", "fsdp2"]
# Blocks of block_size tokens per GPU and step where --blocks-per-gpu is not given, by recipe file name: the settings
# of the committed table (benchmarks/results/h100x4-2026-11-28c).  The d768 recipes at 64, the micro-batch of GPT-2
# small training on one 80 GB GPU (llm.c's B=64, T=1024; 35-39 GiB here); the 1B recipes at 16 (48-52 GiB on one GPU).
# Shorter steps measure the host: FSDP2's own host work (hooks, DTensor optimizer and clipping) takes 130-150 ms a
# d768 step whatever the model, so at 32 blocks (our families' GPU step 76-91 ms) FSDP2 x2 ran at 0.63-0.76 of one GPU
# and Llama (107 ms) at 0.95 (h100x2-2026-11-28); at 8 blocks every model, Llama too, was host-bound (DDP x4 0.77).
BLOCKS_PER_GPU = {"scale_d768_": 64, "scale_1b_": 16}
FALLBACK_BLOCKS_PER_GPU = 8
SINGLE = "single"  # one plain process on one GPU: the baseline of every strategy
SIZES = ("d768", "1b")
FAMILIES = ("llama", "rbf", "gka", "scalar_sort", "hybrid_sort")
DEFAULT_CONFIGS = [f"recipes/configs/scale_{size}_{family}.yaml" for size in SIZES for family in FAMILIES]
# a short run measures speed only: no evaluation or checkpoints (and train_only skips the final evaluation, the saved
# model, the story and the checks)
BENCH_OVERRIDES = [
    "training.eval_strategy='no'",
    "training.save_strategy='no'",
    "training.logging_steps=5",
    "model.expected_num_parameters=null",
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for scaling.json, scaling.md and the runs' logs")
    parser.add_argument(
        "--processes", type=int, nargs="+", default=None, help="process counts (default: 1 2 4 8 up to the GPUs here)"
    )
    parser.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES, choices=list(ACCELERATE_CONFIGS))
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="recipe YAMLs (default: scale_*.yaml)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (the first 5 are not timed)")
    parser.add_argument(
        "--blocks-per-gpu",
        type=int,
        default=None,
        help=f"blocks of block_size tokens per GPU and step, for every recipe (default: by recipe, {BLOCKS_PER_GPU}, "
        f"else {FALLBACK_BLOCKS_PER_GPU})",
    )
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE", help="recipe overrides")
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (a dry run; DDP only)")
    parser.add_argument(
        "--concurrent", action="store_true", help="run launches on disjoint GPUs at the same time (GPUs only)"
    )
    parser.add_argument(
        "--strategy-baselines",
        action="store_true",
        help="also launch every strategy on 1 process and report the efficiency against it (see the module text)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch before it counts as failed")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help=f"torch.profiler on rank 0 over the last N (1-{WARMUP_STEPS - 1}) of the untimed warm-up steps; the "
        "summary (step wall time, compute and NCCL kernel time, top kernels and CPU ops) goes into scaling.md",
    )
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(
            f"--steps must be at least {WARMUP_STEPS + 1} (the first {WARMUP_STEPS} steps are not timed); got {args.steps}"
        )
    if not 0 <= args.profile_steps < WARMUP_STEPS:
        parser.error(
            f"--profile-steps must be in 0..{WARMUP_STEPS - 1} (the untimed warm-up steps); got {args.profile_steps}"
        )
    if args.blocks_per_gpu is not None and args.blocks_per_gpu < 1:
        parser.error(f"--blocks-per-gpu must be a positive int; got {args.blocks_per_gpu}")
    if args.cpu and any(s.startswith("fsdp") for s in args.strategies):
        parser.error("--cpu runs DDP only (accelerate's FSDP needs GPUs): pass --strategies ddp")
    if args.cpu and args.concurrent:
        parser.error("--concurrent places launches on disjoint GPUs: it needs GPUs, not --cpu")
    if args.processes is None:
        args.processes = default_process_counts(args.cpu)
    if not args.processes or min(args.processes) < 1:
        parser.error(f"--processes must be positive ints; got {args.processes}")
    args.processes = sorted(set(args.processes))
    return args


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def default_process_counts(cpu: bool) -> list[int]:
    """1, 2, 4, 8 up to the GPUs of this machine (1 and 2 processes on the CPU)."""
    if cpu:
        return [1, 2]
    available = gpu_count()
    if available == 0:
        raise SystemExit("no GPU here: pass --cpu for a dry run with gloo processes")
    return [n for n in (1, 2, 4, 8) if n <= available]


def plan_waves(
    configs, processes, strategies, gpus: int, concurrent: bool, strategy_baselines: bool = False
) -> list[list[dict]]:
    """The launches, grouped in waves that run at the same time.  A launch is ``{"strategy", "processes", "gpus"
    (device indices, None on the CPU), "configs"}``.  Without ``concurrent`` every wave holds one launch (on the first
    GPUs); with it, the one-GPU launches are dealt round-robin over all ``gpus`` and launches of N processes fill the
    GPUs N at a time.  ``strategy_baselines``: at 1 process every strategy runs too, after the plain run."""
    launches = []
    for n in processes:
        for strategy in ([SINGLE, *(strategies if strategy_baselines else [])] if n == 1 else strategies):
            launches.append({"strategy": strategy, "processes": n, "configs": list(configs)})
    if not concurrent:
        for launch in launches:
            launch["gpus"] = list(range(launch["processes"])) if gpus else None
        return [[launch] for launch in launches]
    waves = []
    for index, launch in enumerate(launches):
        n = launch["processes"]
        if n > gpus:
            raise ValueError(f"--processes {n} needs {n} GPUs; this machine has {gpus}")
        if n == 1:  # one process per GPU, each with a share of the recipes
            shares = [launch["configs"][i::gpus] for i in range(gpus)]
            waves.append([dict(launch, gpus=[i], configs=share) for i, share in enumerate(shares) if share])
            continue
        # N processes: one launch per block of N GPUs that the other strategies' launches of this N leave free, the
        # recipes dealt round-robin over those launches (every recipe still runs once per strategy and N)
        wave = waves[-1] if waves and waves[-1][0]["processes"] == n else None
        used = sum(len(x["gpus"]) for x in wave) if wave else gpus
        if wave is None or used + n > gpus:
            wave = []
            waves.append(wave)
            used = 0
        sharing = sum(1 for x in launches[index:] if x["processes"] == n)  # this strategy and the ones after it
        blocks = max(1, min((gpus - used) // n, gpus // n // sharing))
        shares = [launch["configs"][i::blocks] for i in range(blocks)]
        for share in (s for s in shares if s):
            wave.append(dict(launch, gpus=list(range(used, used + n)), configs=share))
            used += n
    return waves


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _recipe(config: str, overrides) -> dict:
    from recipes.pretrain_config import load_config

    return load_config(os.path.join(REPO, config), list(overrides))


def _env(args, gpus=None) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.cpu:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    elif gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def prepare(config: str, args, prepared: dict) -> list[str]:
    """Train the tokenizer and pack the data once per distinct (tokenizer, data) recipe section; returns the ``--set``
    overrides that point the runs of ``config`` at them."""
    cfg = _recipe(config, args.overrides)
    key = hashlib.sha1(json.dumps([cfg["tokenizer"], cfg["data"]], sort_keys=True).encode()).hexdigest()[:12]
    root = os.path.join(os.path.abspath(args.output), "prepared", key)
    overrides = [f"data.cache_dir={os.path.join(root, 'data_cache')}"]
    if cfg["tokenizer"]["path"] is None:
        overrides.append(f"tokenizer.path={os.path.join(root, 'tokenizer')}")
    if key not in prepared:
        cmd = [sys.executable, os.path.join(REPO, "recipes", "pretrain.py"), "--config", config, "--prepare-only"]
        cmd += ["--output-dir", root, "--set", *args.overrides, overrides[0]]
        subprocess.run(cmd, cwd=REPO, env=_env(args), check=True)
        prepared[key] = root
    return overrides


def run_name(config: str, strategy: str, processes: int) -> str:
    return f"{os.path.splitext(os.path.basename(config))[0]}-{strategy}-{processes}"


def blocks_per_gpu(config: str, args) -> int:
    """Blocks per GPU and step of ``config``'s runs: ``--blocks-per-gpu``, else by file name (``BLOCKS_PER_GPU``)."""
    if args.blocks_per_gpu is not None:
        return args.blocks_per_gpu
    name = os.path.basename(config)
    return next((b for prefix, b in BLOCKS_PER_GPU.items() if name.startswith(prefix)), FALLBACK_BLOCKS_PER_GPU)


def launch_command(launch: dict, args, prepared: dict) -> list[str]:
    """The command of one launch (``prepared``: config -> the overrides from :func:`prepare`)."""
    strategy, processes = launch["strategy"], launch["processes"]
    if strategy == SINGLE:
        cmd = [sys.executable]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ACCELERATE_CONFIGS[strategy]]
        cmd += ["--num_processes", str(processes), "--main_process_port", str(_free_port())]
        if args.cpu:  # gloo: Trainer sets it up for several CPU processes; bf16 autocast is the GPU recipes' setting
            cmd += ["--mixed_precision", "no"]
    cmd += [os.path.abspath(__file__), "worker", "--root", os.path.join(os.path.abspath(args.output), "runs")]
    cmd += ["--strategy", strategy, "--processes", str(processes), "--profile-steps", str(args.profile_steps)]
    cpu = ["training.bf16=false", "training.optim=adamw_torch", "training.dataloader_num_workers=0"] if args.cpu else []
    for config in launch["configs"]:
        batch = f"global_batch_size={blocks_per_gpu(config, args) * processes}"
        cmd += ["--config", config, *BENCH_OVERRIDES, f"training.max_steps={args.steps}", batch, *args.overrides]
        cmd += [*cpu, *prepared.get(config, [])]
    return cmd


def worker_runs(argv) -> tuple[argparse.Namespace, list[tuple[str, list[str]]]]:
    """Parse ``worker --root R --strategy S --processes N (--config C KEY=VALUE ...)+``."""
    parser = argparse.ArgumentParser(prog="bench_scaling.py worker")
    parser.add_argument("--root", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--profile-steps", type=int, default=0)
    head, runs, current = [], [], None
    for item in argv:
        if item == "--config":
            current = [None, []]
            runs.append(current)
        elif current is None:
            head.append(item)
        elif current[0] is None:
            current[0] = item
        else:
            current[1].append(item)
    args = parser.parse_args(head)
    if not runs or any(c is None for c, _ in runs):
        parser.error("worker needs one or more '--config FILE [KEY=VALUE ...]'")
    return args, [(c, o) for c, o in runs]


def is_kernel(event) -> bool:
    """A GPU event that is a kernel (or a memcpy/memset), not the GPU-timeline range of a user annotation
    (``record_function``: "DistributedDataParallel.forward", "Optimizer.step#AdamW.step", inductor's "## Call
    CompiledFxGraph ##"), which spans every host gap between its kernels: counted as busy, it hid the gaps of DDP's
    whole forward (session 10's first tables counted a 45 ms "DistributedDataParallel.forward" as compute)."""
    import torch

    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def summarise_step_profile(prof, steps: int, wall_ms: float, top: int = 25, cpu_top: int = 25) -> dict:
    """What one rank's GPU did per step: wall time, compute kernel time and NCCL kernel time (NCCL runs on its own
    streams and may overlap compute: compute + NCCL > wall means overlap, wall > compute means the compute stream waited
    for the host or for communication), launches, the top kernels, the top CPU ops by self time, and the top CPU ranges
    by inclusive time (``cpu_ranges``: FSDP2's per-layer hooks such as "FSDP::pre_forward", DDP's forward, the
    optimizer step, our autograd Functions, a compiled region: where a host-bound step's time goes, layer work
    included, which self times split into thousands of small ops)."""
    import torch

    events = prof.key_averages()
    kernels = [e for e in events if is_kernel(e)]
    is_nccl = lambda e: "nccl" in e.key.lower()
    per_step = lambda us: us / 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms / steps,
        "compute_kernel_ms_per_step": per_step(sum(e.self_device_time_total for e in kernels if not is_nccl(e))),
        "nccl_kernel_ms_per_step": per_step(sum(e.self_device_time_total for e in kernels if is_nccl(e))),
        "kernel_launches_per_step": sum(e.count for e in kernels) / steps,
        "gpu_top": [
            {"name": e.key[:80], "calls_per_step": e.count / steps, "ms_per_step": per_step(e.self_device_time_total)}
            for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
        ],
        "cpu_top": [
            {"name": e.key[:80], "calls_per_step": e.count / steps, "ms_per_step": per_step(e.self_cpu_time_total)}
            for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:cpu_top]
        ],
        "cpu_ranges": [
            {"name": e.key[:80], "calls_per_step": e.count / steps, "ms_per_step": per_step(e.cpu_time_total)}
            for e in sorted(
                (e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                key=lambda e: getattr(e, "cpu_time_total", 0.0),
                reverse=True,
            )[:cpu_top]
        ],
    }


def _path(op, depth: int = 2) -> str:
    """An op's place in the host's call tree: its outermost ``depth`` ancestors, then the op itself."""
    chain = []
    while op is not None:
        chain.append(op.name[:60])
        op = op.cpu_parent
    chain.reverse()
    if len(chain) > depth + 1:
        chain = chain[:depth] + ["...", chain[-1]]
    return " > ".join(chain)


def kernel_launchers(prof) -> dict:
    """``(start, end)`` of each GPU event (microseconds from the trace start, as ``FunctionEvent.time_range`` has
    them) -> the id (``FunctionEvent.id``) of the host op that launched it, from the profiler's kineto results:
    torch 2.11's ``FunctionEvent`` does not carry the link (``linked_correlation_id``), newer ones do."""
    import torch

    results = prof.profiler.kineto_results
    t0 = results.trace_start_ns()
    links = {}
    for ev in results.events():
        if ev.device_type() == torch.autograd.DeviceType.CUDA and ev.linked_correlation_id() > 0:
            links[((ev.start_ns() - t0) / 1000, (ev.end_ns() - t0) / 1000)] = ev.linked_correlation_id()
    return links


def summarise_idle_gaps(events, steps: int, launchers: dict, min_gap_us: float = 50.0, top: int = 8) -> dict:
    """Where the GPU's compute stood idle, from the profiler's events (``prof.events()``): the stretches of at least
    ``min_gap_us`` in which no compute kernel (any stream, NCCL excluded) ran, each named by the host op that launched
    the kernel ending it.  A gap is "host late" when that op began on the host after the gap began (the GPU waited for
    Python and launches), "waiting" when it began before (the kernel waited on the device: another stream, e.g. an
    NCCL collective, or an event).  Totals per step, the groups of gaps by launching op, and the largest gaps with the
    host ops that ran during them.  ``launchers``: :func:`kernel_launchers`."""
    import torch

    cpu = torch.autograd.DeviceType.CPU
    kernels = [e for e in events if is_kernel(e) and "nccl" not in e.name.lower()]
    kernels.sort(key=lambda e: e.time_range.start)
    # the host ops: not the CUDA runtime's calls (cudaLaunchKernel, ...), which carry ids of their own
    host_ops = [e for e in events if e.device_type == cpu and not e.is_async and not e.name.startswith("cuda")]
    by_id = {e.id: e for e in host_ops}
    gaps, busy_until = [], None
    for k in kernels:
        if busy_until is not None and k.time_range.start - busy_until >= min_gap_us:
            launcher = launchers.get((k.time_range.start, k.time_range.end))
            gaps.append((busy_until, k.time_range.start, by_id.get(launcher), k.name))
        busy_until = k.time_range.end if busy_until is None else max(busy_until, k.time_range.end)
    groups: dict = {}
    host_late = waiting = 0.0
    rows = []
    for start, end, op, kernel in gaps:
        late = op is not None and op.time_range.start > start
        length = end - start
        if late:
            host_late += length
        else:
            waiting += length
        key = ("host late" if late else "waiting", _path(op) if op is not None else f"(unknown op) {kernel[:40]}")
        total, count = groups.get(key, (0.0, 0))
        groups[key] = (total + length, count + 1)
        rows.append((length, start, end, key, kernel))
    per_step = lambda us: us / 1e3 / steps
    largest = []
    for length, start, end, key, kernel in sorted(rows, reverse=True)[:top]:
        during = sorted(
            (
                (min(end, o.time_range.end) - max(start, o.time_range.start), o.name[:60])
                for o in host_ops
                if o.time_range.start < end and o.time_range.end > start and o.time_range.end - o.time_range.start
                < 2 * length
            ),
            reverse=True,
        )[:3]
        largest.append(
            {"ms": length / 1e3, "kind": key[0], "next_op": key[1], "next_kernel": kernel[:60],
             "host_ops_during": [f"{name} ({us / 1e3:.2f} ms)" for us, name in during]}
        )
    return {
        "min_gap_us": min_gap_us,
        "idle_ms_per_step": per_step(host_late + waiting),
        "host_late_ms_per_step": per_step(host_late),
        "waiting_ms_per_step": per_step(waiting),
        "gaps_per_step": len(gaps) / steps,
        "groups": [
            {"kind": kind, "next_op": path, "ms_per_step": per_step(total), "gaps_per_step": count / steps}
            for (kind, path), (total, count) in sorted(groups.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
        ],
        "largest": largest,
    }


def bench_callback(output_dir: str, profile_steps: int = 0):
    """A ``TrainerCallback`` that writes this process's peak memory of the training loop and the FSDP units of the
    prepared model to ``<output_dir>/peak_memory_rank<RANK>.json``; with ``profile_steps``, rank 0 also runs
    torch.profiler over the last ``profile_steps`` untimed warm-up steps and writes :func:`summarise_step_profile` to
    ``<output_dir>/profile_rank0.json`` (inside the warm-up, so the profiler does not slow the measured steps)."""
    import torch
    from transformers import TrainerCallback

    from recipes.pretrain_callbacks import ThroughputCallback

    rank = int(os.environ.get("RANK", "0"))

    class BenchCallback(TrainerCallback):
        fsdp_units = None
        _profiler = None
        _t0 = 0.0
        _now = staticmethod(ThroughputCallback._now)  # CUDA-synchronised wall clock, as the recipe's own measure

        def on_step_begin(self, args, state, control, **kwargs):
            if profile_steps and rank == 0 and state.global_step == WARMUP_STEPS - profile_steps:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                self._profiler = profile(activities=activities)
                self._profiler.__enter__()
                self._t0 = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            if self._profiler is not None and state.global_step >= WARMUP_STEPS:
                wall_ms = 1e3 * (self._now() - self._t0)
                self._profiler.__exit__(None, None, None)
                summary = summarise_step_profile(self._profiler, profile_steps, wall_ms)
                try:  # a diagnosis: it must not cost the run
                    launchers = kernel_launchers(self._profiler)
                    summary["idle_gaps"] = summarise_idle_gaps(self._profiler.events(), profile_steps, launchers)
                except Exception as exc:  # noqa: BLE001
                    summary["idle_gaps_error"] = repr(exc)
                self._profiler = None
                with open(os.path.join(output_dir, "profile_rank0.json"), "w") as f:
                    json.dump(summary, f, indent=2)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            try:
                from torch.distributed.fsdp import FSDPModule
            except ImportError:  # torch without FSDP2
                return
            if model is not None:
                self.fsdp_units = sum(isinstance(m, FSDPModule) for m in model.modules())

        def on_train_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                peak = {"kind": "cuda", "peak_bytes": torch.cuda.max_memory_allocated()}
            else:  # Linux reports ru_maxrss in KiB
                peak = {"kind": "rss", "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            peak["fsdp_units"] = self.fsdp_units
            with open(os.path.join(output_dir, f"peak_memory_rank{rank}.json"), "w") as f:
                json.dump(peak, f)

    return BenchCallback()


def reset_fsdp_wrap_policy(plugin) -> None:
    """Let an FSDP plugin wrap the next model by that model's own ``_no_split_modules``.

    accelerate's ``set_auto_wrap_policy`` (called when a model is prepared) writes the first model's layer classes into
    the plugin (``transformer_cls_names_to_wrap`` and a ``functools.partial`` policy), and the plugin lives on in the
    process-wide ``AcceleratorState``: without this, the second recipe of a launch (Llama after an hf_rbf family, or
    the reverse) stops with "Could not find the transformer layer class"."""
    if plugin is None:
        return
    plugin.transformer_cls_names_to_wrap = None
    if isinstance(plugin.auto_wrap_policy, functools.partial):
        plugin.auto_wrap_policy = plugin.auto_wrap_policy.func


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker(argv) -> int:
    """One process of a launch: ``recipes/pretrain.py``'s ``run`` (``train_only``) for each recipe in turn, each in its
    own run folder; a recipe that fails writes ``failure_rank<RANK>.json`` there.  In a single process the next recipe
    then runs; in a launch of several processes this one stops (returns 1): a rank that failed alone (e.g. rank 0 in
    its profiler) would start the next recipe while the others still train the last one, and their collectives would
    hang until the launch's timeout (the first 4-GPU call of 2026-11-26 lost 130 s that way)."""
    from recipes.pretrain import run
    from recipes.pretrain_config import load_config

    args, runs = worker_runs(argv)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # one launch serves Llama (LlamaDecoderLayer) and the hf_rbf families (DecoderLayer): each model's
        # _no_split_modules names its layer class, which accelerate wraps when no class list is given
        os.environ.pop("FSDP_TRANSFORMER_CLS_TO_WRAP", None)
    failures = 0
    for config, overrides in runs:
        out = os.path.join(args.root, run_name(config, args.strategy, args.processes))
        os.makedirs(out, exist_ok=True)
        from accelerate.state import AcceleratorState

        reset_fsdp_wrap_policy(AcceleratorState._shared_state.get("fsdp_plugin"))
        try:
            cfg = load_config(os.path.join(REPO, config), overrides, output_dir=out)
            run(cfg, train_only=True, callbacks=[bench_callback(out, args.profile_steps)])
        except Exception as exc:  # noqa: BLE001 (keep the launch going: the other recipes still run)
            failures += 1
            with open(os.path.join(out, f"failure_rank{os.environ.get('RANK', '0')}.json"), "w") as f:
                json.dump({"error": repr(exc), "traceback": traceback.format_exc()}, f, indent=2)
            traceback.print_exc()
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                return 1
        _release_memory()
    return 1 if failures else 0


def read_row(config: str, launch: dict, root: str, returncode, wall_seconds: float) -> dict:
    """The table row of one recipe of a finished launch, from its run folder."""
    strategy, processes = launch["strategy"], launch["processes"]
    run_dir = os.path.join(root, run_name(config, strategy, processes))
    row = {"config": config, "strategy": strategy, "processes": processes, "gpus": launch.get("gpus")}
    row.update(run_dir=run_dir, launch_returncode=returncode, launch_wall_seconds=wall_seconds)
    summary_path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(summary_path):
        failures = [f for f in sorted(os.listdir(run_dir)) if f.startswith("failure")] if os.path.isdir(run_dir) else []
        why = ""
        if failures:
            with open(os.path.join(run_dir, failures[0])) as f:
                why = json.load(f)["error"][:200]
        row["error"] = f"failed (launch returncode {returncode}) {why}".strip()
        return row
    with open(summary_path) as f:
        s = json.load(f)
    peaks = []
    for rank in range(processes):
        path = os.path.join(run_dir, f"peak_memory_rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                peaks.append(json.load(f))
    tokens_per_second = s["tokens_per_second"]
    row.update(
        family=s["family"],
        num_parameters=s["num_parameters"],
        num_hidden_layers=s["model_config"].get("num_hidden_layers"),
        world_size=s["world_size"],
        global_batch_size=s["global_batch_size"],
        tokens_per_step=s["tokens_per_step"],
        steps=s["steps"],
        measured_steps=s["throughput"]["measured_steps"],
        # each measured step's duration (recipes/pretrain_callbacks.py): a stalled step shows in the max
        step_ms_median=_ms(s["throughput"].get("step_seconds_median")),
        step_ms_max=_ms(s["throughput"].get("step_seconds_max")),
        tokens_per_second=tokens_per_second,
        tokens_per_second_per_gpu=tokens_per_second / s["world_size"] if tokens_per_second else None,
        peak_memory_gib=max(p["peak_bytes"] for p in peaks) / 2**30 if peaks else None,
        peak_memory_kind=peaks[0]["kind"] if peaks else None,
        fsdp_units=peaks[0].get("fsdp_units") if peaks else None,
        attention_backends=s["attention_backends"],
        final_train_loss=s["final_train_loss"],
        device=s["device"],
        versions=s["versions"],
    )
    profile_path = os.path.join(run_dir, "profile_rank0.json")
    if os.path.exists(profile_path):
        with open(profile_path) as f:
            row["profile"] = json.load(f)
    if s["world_size"] != processes:
        row["error"] = f"the recipe ran on {s['world_size']} processes, not {processes}"
    elif len(peaks) != processes:
        row["error"] = f"{len(peaks)} of {processes} processes reported their peak memory"
    return row


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def run_wave(wave: list[dict], args, prepared: dict) -> list[dict]:
    """Start every launch of a wave, wait for all of them, return their rows."""
    root = os.path.join(os.path.abspath(args.output), "runs")
    started = []
    for launch in wave:
        for config in launch["configs"]:  # a run of an earlier invocation must not be read as this one's
            shutil.rmtree(os.path.join(root, run_name(config, launch["strategy"], launch["processes"])), True)
        name = f"launch-{launch['strategy']}-{launch['processes']}-gpu{'_'.join(map(str, launch['gpus'] or ['cpu']))}"
        os.makedirs(root, exist_ok=True)
        log = open(os.path.join(root, name + ".log"), "w")  # noqa: SIM115 (closed when the launch ends)
        cmd = launch_command(launch, args, prepared)
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(args, launch["gpus"]), stdout=log, stderr=subprocess.STDOUT)
        started.append((launch, proc, log, time.time()))
    rows = []
    for i, (launch, proc, log, t0) in enumerate(started):
        try:
            returncode = proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
        except KeyboardInterrupt:
            # Cut from outside (a device call's `timeout --signal=INT`): a launch runs its recipes one after the
            # other, so the recipes that finished before the cut have their summaries; keep their rows and raise.
            for launch_, proc_, log_, t0_ in started[i:]:
                proc_.kill()
                proc_.wait()
                log_.close()
                rows += [
                    read_row(config, launch_, root, None, time.time() - t0_)
                    for config in launch_["configs"]
                    if os.path.exists(os.path.join(root, run_name(config, launch_["strategy"], launch_["processes"]),
                                                   "summary.json"))
                ]
            raise WaveInterrupted(rows) from None
        log.close()
        wall = time.time() - t0
        rows += [read_row(config, launch, root, returncode, wall) for config in launch["configs"]]
    return rows


class WaveInterrupted(KeyboardInterrupt):
    """An interrupted wave, with the rows of the recipes that finished before the interrupt."""

    def __init__(self, rows: list[dict]):
        super().__init__("interrupted")
        self.rows = rows


def add_efficiency(rows: list[dict]) -> None:
    """``scaling_efficiency``: tokens/s per GPU over the same recipe's single-GPU run; ``strategy_efficiency``: over
    the same recipe and strategy on one process (``--strategy-baselines``; None without that run)."""
    single = {r["config"]: r.get("tokens_per_second_per_gpu") for r in rows if r["strategy"] == SINGLE}
    one_process = {
        (r["config"], r["strategy"]): r.get("tokens_per_second_per_gpu") for r in rows if r["processes"] == 1
    }
    for r in rows:
        per_gpu = r.get("tokens_per_second_per_gpu")
        for key, base in (("scaling_efficiency", single.get(r["config"])),
                          ("strategy_efficiency", one_process.get((r["config"], r["strategy"])))):
            r[key] = per_gpu / base if base and per_gpu else None  # None when the baseline run failed


def _order(rows: list[dict]) -> list[dict]:
    strategies = [SINGLE, *ACCELERATE_CONFIGS]
    key = lambda r: (r["config"], strategies.index(r["strategy"]) if r["strategy"] in strategies else 9, r["processes"])
    return sorted(rows, key=key)


def markdown_table(rows: list[dict], title: str, concurrent: bool = False) -> str:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    # the column of --strategy-baselines: only where a strategy ran on one process
    baselines = any(r["strategy"] != SINGLE and r["processes"] == 1 for r in rows)
    lines = [
        f"# {title}",
        "",
        (
            "| recipe | family | parameters | strategy | processes (GPUs) | tokens per GPU and step | tokens/s per GPU "
            "| step ms (median / max) | peak memory per GPU (GiB) | FSDP units | efficiency |"
            + (" vs the strategy on 1 process |" if baselines else "")
        ),
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if baselines else ""),
    ]
    for r in _order(rows):
        recipe = os.path.splitext(os.path.basename(r["config"]))[0]
        if "error" in r:
            empty = " | | | |" + (" |" if baselines else "")
            lines.append(f"| {recipe} | | | {r['strategy']} | {r['processes']} | | {r['error']} |{empty}")
            continue
        lines.append(
            f"| {recipe} | {r['family']} | {r['num_parameters']:,} | {r['strategy']} | {r['processes']} | "
            f"{r['tokens_per_step'] // r['world_size']:,} | {fmt(r['tokens_per_second_per_gpu'], ',.0f')} | "
            f"{fmt(r.get('step_ms_median'), '.1f')} / {fmt(r.get('step_ms_max'), '.1f')} | "
            f"{fmt(r['peak_memory_gib'], '.2f')} | "
            f"{fmt(r['fsdp_units'], 'd') if r['strategy'].startswith('fsdp') else ''} | "
            f"{fmt(r['scaling_efficiency'], '.3f')} |"
            + (f" {'' if r['strategy'] == SINGLE else fmt(r['strategy_efficiency'], '.3f')} |" if baselines else "")
        )
    ok = [r for r in rows if "error" not in r]
    if ok:
        r = ok[0]
        lines += [
            "",
            f"Device: {r['device']} ({r['versions'].get('cuda') or 'CPU'}); torch {r['versions']['torch']}, "
            f"transformers {r['versions']['transformers']}.  Weak scaling: a recipe's tokens per GPU and step are the "
            "same at every process count; efficiency = tokens/s per GPU over the same recipe's single-GPU run"
            + ("; the last column over the same recipe and strategy launched on 1 process" if baselines else "")
            + ".  Step ms: the measured steps' median and longest duration on rank 0 (a stall shows in the longest).  "
            "Peak memory: "
            + ("torch.cuda.max_memory_allocated" if r["peak_memory_kind"] == "cuda" else "max resident set size")
            + ", largest over the processes.  FSDP units: modules sharded by fully_shard (the decoder layers and the "
            "root).",
        ]
        if concurrent:
            lines.append(
                "Launches on disjoint GPUs ran at the same time (--concurrent): the single-GPU runs one per GPU, the "
                "N-process launches side by side where N GPUs were free (by strategy, then by recipe); the host's CPUs "
                "were shared."
            )
    lines += profile_section(rows)
    return "\n".join(lines) + "\n"


def profile_section(rows: list[dict]) -> list[str]:
    """The ``--profile-steps`` summaries: one line per profiled run, then each run's top GPU kernels."""
    profiled = [r for r in _order(rows) if r.get("profile")]
    if not profiled:
        return []
    lines = [
        "",
        "## Per-step profile (rank 0, torch.profiler over the last untimed warm-up steps)",
        "",
        (
            "Compute / NCCL: kernel time per step on any stream.  NCCL kernels may overlap compute; a wall time above "
            "the compute time is time the GPU's compute waited for the host or for communication."
        ),
        "",
        "| recipe | strategy | processes | wall ms/step | compute kernel ms | NCCL kernel ms | wall - compute | "
        + "launches |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in profiled:
        p = r["profile"]
        recipe = os.path.splitext(os.path.basename(r["config"]))[0]
        lines.append(
            f"| {recipe} | {r['strategy']} | {r['processes']} | {p['wall_ms_per_step']:.1f} | "
            f"{p['compute_kernel_ms_per_step']:.1f} | {p['nccl_kernel_ms_per_step']:.1f} | "
            f"{p['wall_ms_per_step'] - p['compute_kernel_ms_per_step']:.1f} | {p['kernel_launches_per_step']:.0f} |"
        )
    for r in profiled:
        recipe = os.path.splitext(os.path.basename(r["config"]))[0]
        lines += ["", f"{recipe} {r['strategy']} x{r['processes']}, top GPU kernels (ms/step, calls/step):"]
        top = r["profile"]["gpu_top"][:8]  # the JSON keeps 25
        lines += [f"- {k['ms_per_step']:.2f} ms, {k['calls_per_step']:.0f}x `{k['name']}`" for k in top]
        lines += [
            "  top CPU ops (self ms/step): "
            + "; ".join(f"`{k['name']}` {k['ms_per_step']:.1f}" for k in r["profile"]["cpu_top"][:5])
        ]
        ranges = r["profile"].get("cpu_ranges")
        if ranges:
            lines.append(
                "  top CPU ranges (inclusive ms/step): "
                + "; ".join(f"`{k['name']}` {k['ms_per_step']:.1f}" for k in ranges[:8])
            )
        if r["profile"].get("idle_gaps_error"):
            lines.append(f"  idle-gap summary failed: {r['profile']['idle_gaps_error']}")
        gaps = r["profile"].get("idle_gaps")
        if gaps:
            lines += [
                f"  compute idle {gaps['idle_ms_per_step']:.1f} ms/step in {gaps['gaps_per_step']:.0f} gaps of >= "
                f"{gaps['min_gap_us']:.0f} us: host late {gaps['host_late_ms_per_step']:.1f}, waiting on the device "
                f"{gaps['waiting_ms_per_step']:.1f}; by the op that ended them:"
            ]
            lines += [
                f"  - {g['ms_per_step']:.1f} ms ({g['gaps_per_step']:.0f} gaps), {g['kind']}: `{g['next_op']}`"
                for g in gaps["groups"][:5]
            ]
    return lines


def write_results(rows: list[dict], args) -> str:
    add_efficiency(rows)
    title = "Scaling: tokens/s per GPU, peak memory and efficiency (" + ("CPU dry run" if args.cpu else "GPUs") + ")"
    meta = {
        "steps": args.steps,
        "blocks_per_gpu": {config: blocks_per_gpu(config, args) for config in args.configs},
        "concurrent": args.concurrent,
    }
    with open(os.path.join(args.output, "scaling.json"), "w") as f:
        json.dump({"title": title, **meta, "rows": _order(rows)}, f, indent=2)
    table = markdown_table(rows, title, args.concurrent)
    with open(os.path.join(args.output, "scaling.md"), "w") as f:
        f.write(table)
    return table


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    prepared_roots, prepared = {}, {}
    for config in args.configs:
        prepared[config] = prepare(config, args, prepared_roots)
    gpus = 0 if args.cpu else gpu_count()
    rows = []
    for wave in plan_waves(
        args.configs, args.processes, args.strategies, gpus, args.concurrent, args.strategy_baselines
    ):
        try:
            wave_rows = run_wave(wave, args, prepared)
        except WaveInterrupted as cut:
            rows += cut.rows
            print(write_results(rows, args))
            print(f"interrupted: kept the {len(cut.rows)} finished run(s) of the cut wave", flush=True)
            return 130
        for row in wave_rows:
            rows.append(row)
            print(
                f"{os.path.basename(row['config'])} {row['strategy']} x{row['processes']}: "
                + (row.get("error") or f"{row['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU"),
                flush=True,
            )
        write_results(rows, args)
    print(write_results(rows, args))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
