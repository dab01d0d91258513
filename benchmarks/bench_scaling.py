"""Scaling benchmark: tokens/s per GPU, peak memory per GPU and scaling efficiency of the pretraining recipe under
``accelerate launch`` with DDP and FSDP2, for several process counts, families and sizes.  One command:

    python benchmarks/bench_scaling.py --output benchmarks/results/scaling            # every GPU count up to 8 lent
    python benchmarks/bench_scaling.py --processes 1 2 4 --strategies ddp fsdp2 --steps 30 \\
        --configs recipes/configs/scale_d768_llama.yaml recipes/configs/scale_1b_rbf.yaml --output DIR

For every (recipe, strategy, N) it runs ``accelerate launch --config_file recipes/accelerate/<ddp|fsdp2>.yaml
--num_processes N`` on ``recipes/pretrain.py``'s training (through this file's ``worker`` mode, which adds the peak
memory of each process) for ``--steps`` optimizer steps, and writes ``scaling.json`` and ``scaling.md``:

* tokens/s per GPU: the recipe's own measure (``ThroughputCallback``: the steps after the first 5, evaluation and
  saving excluded) divided by N;
* peak memory per GPU: the largest ``torch.cuda.max_memory_allocated`` over the N processes during training (from the
  first step to the last, the weights included; evaluation and saving come after); on the CPU dry run the largest
  resident set size (``ru_maxrss``, the whole process so far, interpreter included: only a sanity figure);
* scaling efficiency: tokens/s per GPU at N over tokens/s per GPU at 1 process, same recipe and strategy.

Weak scaling: every process gets ``--blocks-per-gpu`` blocks per step (``global_batch_size = blocks x N``), so the work
per GPU is the same at every N and an efficiency of 1.0 means linear scaling.  The Llama recipe is wrapped for FSDP by
its ``LlamaDecoderLayer`` (the accelerate config names hf_rbf's ``DecoderLayer``).  ``--cpu`` runs the same commands
with gloo processes on the CPU (DDP only: accelerate's FSDP needs GPUs), as a dry run of the whole chain.

The tokenizer and the packed data are prepared once per distinct (tokenizer, data) recipe section (``pretrain.py
--prepare-only``) and shared by the runs; each run's ``final/`` model is deleted after its numbers are read (a ~1B model
is 4.4 GB in float32), its logs and summary kept under ``<output>/runs``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ACCELERATE_CONFIGS = {"ddp": "recipes/accelerate/ddp.yaml", "fsdp2": "recipes/accelerate/fsdp2.yaml"}
SIZES = ("d768", "1b")
FAMILIES = ("llama", "rbf", "gka", "scalar_sort", "hybrid_sort")
DEFAULT_CONFIGS = [f"recipes/configs/scale_{size}_{family}.yaml" for size in SIZES for family in FAMILIES]
# a short run measures speed only: no evaluation, checkpoints, story, bits per byte or remote-code check
BENCH_OVERRIDES = [
    "training.eval_strategy='no'",
    "training.save_strategy='no'",
    "training.logging_steps=5",
    "evaluation.generation.enabled=false",
    "evaluation.bpb.enabled=false",
    "evaluation.remote_code_check=false",
    "model.expected_num_parameters=null",
    "data.max_validation_blocks=16",  # run() still evaluates the final weights once
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for scaling.json, scaling.md and the runs' logs")
    parser.add_argument(
        "--processes", type=int, nargs="+", default=None, help="process counts (default: 1 2 4 8 up to the GPUs here)"
    )
    parser.add_argument("--strategies", nargs="+", default=list(ACCELERATE_CONFIGS), choices=list(ACCELERATE_CONFIGS))
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="recipe YAMLs (default: scale_*.yaml)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (the first 5 are not timed)")
    parser.add_argument("--blocks-per-gpu", type=int, default=8, help="blocks of block_size tokens per GPU and step")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE", help="recipe overrides")
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (a dry run; DDP only)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run before it counts as failed")
    args = parser.parse_args(argv)
    if args.steps < 6:
        parser.error(f"--steps must be at least 6 (the first 5 steps are not timed); got {args.steps}")
    if args.blocks_per_gpu < 1:
        parser.error(f"--blocks-per-gpu must be a positive int; got {args.blocks_per_gpu}")
    if args.cpu and "fsdp2" in args.strategies:
        parser.error("--cpu runs DDP only (accelerate's FSDP needs GPUs): pass --strategies ddp")
    if args.processes is None:
        args.processes = default_process_counts(args.cpu)
    if not args.processes or min(args.processes) < 1:
        parser.error(f"--processes must be positive ints; got {args.processes}")
    return args


def default_process_counts(cpu: bool) -> list[int]:
    """1, 2, 4, 8 up to the GPUs of this machine (1 and 2 processes on the CPU)."""
    if cpu:
        return [1, 2]
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        raise SystemExit("no GPU here: pass --cpu for a dry run with gloo processes")
    return [n for n in (1, 2, 4, 8) if n <= available]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _recipe(config: str, overrides) -> dict:
    from recipes.pretrain_config import load_config

    return load_config(os.path.join(REPO, config), list(overrides))


def _env(args) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.cpu:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
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


def launch_command(config: str, strategy: str, processes: int, run_dir: str, args, prepared=()) -> list[str]:
    """The ``accelerate launch`` command of one run (``prepared``: the overrides from :func:`prepare`)."""
    family = _recipe(config, args.overrides)["model"]["family"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ACCELERATE_CONFIGS[strategy]]
    cmd += ["--num_processes", str(processes), "--main_process_port", str(_free_port())]
    if strategy == "fsdp2" and family == "llama":
        cmd += ["--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"]
    if args.cpu:  # gloo: Trainer sets it up for several CPU processes; bf16 autocast is the GPU recipes' setting
        cmd += ["--mixed_precision", "no"]
    cmd += [os.path.abspath(__file__), "worker", "--config", config, "--output-dir", run_dir, "--set"]
    cmd += [*BENCH_OVERRIDES, f"training.max_steps={args.steps}"]
    cmd += [f"global_batch_size={args.blocks_per_gpu * processes}", *args.overrides, *prepared]
    if args.cpu:
        cmd += ["training.bf16=false", "training.optim=adamw_torch", "training.dataloader_num_workers=0"]
    return cmd


def run_one(config: str, strategy: str, processes: int, args, prepared=()) -> dict:
    name = f"{os.path.splitext(os.path.basename(config))[0]}-{strategy}-{processes}"
    run_dir = os.path.join(os.path.abspath(args.output), "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier invocation must not be read as this one's
    os.makedirs(run_dir)
    cmd = launch_command(config, strategy, processes, run_dir, args, prepared)
    env = _env(args)
    row = {"config": config, "strategy": strategy, "processes": processes, "run_dir": run_dir}
    t0 = time.time()
    with open(os.path.join(run_dir, "launch.log"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(
                cmd, check=False, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            )
            row["returncode"] = proc.returncode
        except subprocess.TimeoutExpired:
            row["returncode"] = None
    row["wall_seconds"] = time.time() - t0
    shutil.rmtree(os.path.join(run_dir, "final"), ignore_errors=True)
    summary_path = os.path.join(run_dir, "summary.json")
    if row["returncode"] != 0 or not os.path.exists(summary_path):
        row["error"] = f"failed (returncode {row['returncode']}); see {os.path.join(run_dir, 'launch.log')}"
        return row
    with open(summary_path) as f:
        s = json.load(f)
    peaks = []
    for rank in range(processes):
        with open(os.path.join(run_dir, f"peak_memory_rank{rank}.json")) as f:
            peaks.append(json.load(f))
    tokens_per_second = s["tokens_per_second"]
    row.update(
        family=s["family"],
        num_parameters=s["num_parameters"],
        world_size=s["world_size"],
        global_batch_size=s["global_batch_size"],
        tokens_per_step=s["tokens_per_step"],
        steps=s["steps"],
        measured_steps=s["throughput"]["measured_steps"],
        tokens_per_second=tokens_per_second,
        tokens_per_second_per_gpu=tokens_per_second / s["world_size"] if tokens_per_second else None,
        peak_memory_gib=max(p["peak_bytes"] for p in peaks) / 2**30,
        peak_memory_kind=peaks[0]["kind"],
        attention_backends=s["attention_backends"],
        final_train_loss=s["final_train_loss"],
        device=s["device"],
        versions=s["versions"],
    )
    if s["world_size"] != processes:
        row["error"] = f"the recipe ran on {s['world_size']} processes, not {processes}"
    return row


def add_efficiency(rows: list[dict]) -> None:
    """``scaling_efficiency``: tokens/s per GPU over the same recipe and strategy's at 1 process."""
    base = {
        (r["config"], r["strategy"]): r["tokens_per_second_per_gpu"]
        for r in rows
        if r["processes"] == 1 and r.get("tokens_per_second_per_gpu")
    }
    for r in rows:
        one = base.get((r["config"], r["strategy"]))
        per_gpu = r.get("tokens_per_second_per_gpu")
        r["scaling_efficiency"] = per_gpu / one if one and per_gpu else None


def markdown_table(rows: list[dict], title: str) -> str:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    lines = [
        f"# {title}",
        "",
        (
            "| recipe | family | parameters | strategy | processes (GPUs) | tokens/s per GPU "
            "| peak memory per GPU (GiB) | efficiency |"
        ),
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        recipe = os.path.splitext(os.path.basename(r["config"]))[0]
        if "error" in r:
            lines.append(f"| {recipe} | | | {r['strategy']} | {r['processes']} | {r['error']} | | |")
            continue
        lines.append(
            f"| {recipe} | {r['family']} | {r['num_parameters']:,} | {r['strategy']} | {r['processes']} | "
            f"{fmt(r['tokens_per_second_per_gpu'], ',.0f')} | {r['peak_memory_gib']:.2f} | "
            f"{fmt(r['scaling_efficiency'], '.3f')} |"
        )
    ok = [r for r in rows if "error" not in r]
    if ok:
        r = ok[0]
        lines += [
            "",
            f"Device: {r['device']} ({r['versions'].get('cuda') or 'CPU'}); torch {r['versions']['torch']}, "
            f"transformers {r['versions']['transformers']}.  Weak scaling: {r['tokens_per_step'] // r['world_size']} "
            "tokens per GPU and step.  Peak memory: "
            + ("torch.cuda.max_memory_allocated" if r["peak_memory_kind"] == "cuda" else "max resident set size")
            + ", largest over the processes.",
        ]
    return "\n".join(lines) + "\n"


def peak_memory_callback(output_dir: str):
    """A ``TrainerCallback`` that writes this process's peak memory of the training loop (from the first step to the
    last, the model's weights included) to ``<output_dir>/peak_memory_rank<RANK>.json``."""
    import torch
    from transformers import TrainerCallback

    class PeakMemoryCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                peak = {"kind": "cuda", "peak_bytes": torch.cuda.max_memory_allocated()}
            else:  # Linux reports ru_maxrss in KiB
                peak = {"kind": "rss", "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            rank = int(os.environ.get("RANK", "0"))
            with open(os.path.join(output_dir, f"peak_memory_rank{rank}.json"), "w") as f:
                json.dump(peak, f)

    return PeakMemoryCallback()


def worker(argv) -> int:
    """One process of a run: ``recipes/pretrain.py``'s ``run`` with the peak-memory callback."""
    from recipes.pretrain import parse_args as pretrain_args
    from recipes.pretrain import run
    from recipes.pretrain_config import load_config

    args = pretrain_args(argv)
    cfg = load_config(args.config, args.overrides, output_dir=args.output_dir)
    run(cfg, callbacks=[peak_memory_callback(cfg["output_dir"])])
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    rows, prepared = [], {}
    for config in args.configs:
        data_overrides = prepare(config, args, prepared)
        for strategy in args.strategies:
            for processes in args.processes:
                row = run_one(config, strategy, processes, args, data_overrides)
                rows.append(row)
                print(
                    f"{os.path.basename(config)} {strategy} x{processes}: "
                    + (row.get("error") or f"{row['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU"),
                    flush=True,
                )
    add_efficiency(rows)
    title = "Scaling: tokens/s per GPU, peak memory and efficiency (" + ("CPU dry run" if args.cpu else "GPUs") + ")"
    with open(os.path.join(args.output, "scaling.json"), "w") as f:
        json.dump(
            {"title": title, "steps": args.steps, "blocks_per_gpu": args.blocks_per_gpu, "rows": rows}, f, indent=2
        )
    with open(os.path.join(args.output, "scaling.md"), "w") as f:
        f.write(markdown_table(rows, title))
    print(markdown_table(rows, title))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
