"""Every variant x seed of a science config trained, evaluated and measured, then one table, the claim verdicts and
the loss-curve figures written into a model card; resumable.

    python recipes/science_table.py --config recipes/configs/science/tinystories.yaml [--only rbf,llama]
        [--seeds 0,1,2] [--output outputs/science] [--set training.max_steps=500 ...] [--stop-at-step N]
        [--max-minutes M] [--workers N] [--report-only] [--no-report] [--card model_cards/science.md]
        [--figures model_cards/figures] [--store DIR]

A science config (``recipes/configs/science_*.yaml``) names the pretraining recipes the variants start from
(``recipes/configs/*.yaml``, read by ``recipes/pretrain_config.load_config``) and the overrides that make each
variant, so every variant shares the recipe's data, tokenizer, parameter budget (``model.match_parameters``) and
token budget; the script refuses a config whose variants differ in data, tokenizer or tokens per run.

Per (variant, seed), in ``<output>/runs/<variant>/seed<seed>/``, each stage skipped when its file exists:

1. ``pretrain.run`` (``recipes/pretrain.py``) with the shared tokenizer and packed data of ``<output>/prepare``:
   ``summary.json`` (validation loss, bits per byte), ``metrics.json`` (the loss curve), ``final/``.  A run cut
   mid-way (killed, or ``--stop-at-step``) continues from its latest Trainer checkpoint.
2. CORE (``recipes/eval_core.eval_core``) into ``core.json`` when the config enables it and the bundle exists.
3. ``recipes/science_measure.measure_run`` into ``measure.json``: attention parameters, train-validation gap,
   register mass per layer, tau at the start and end per layer, captured mass against the context.
4. ``results.json``: the numbers the report reads.  A (variant, seed) with ``results.json`` is never redone.

Runs go seed by seed (every variant's seed 0 first), so a cut session leaves whole seeds.  ``--workers N`` trains N
runs at once, each in its own process (``--only V --seeds S --no-report``, its log in ``<run dir>/worker.log``): the
small models leave one GPU mostly idle (the host is the bottleneck at d=256), so several processes share it.

Then ``recipes/science_report``: the table (mean ± std over seeds; variants or seeds without results are listed
as "not run", failed ones as "failed"), the claims with their verdicts, the per-layer measurements, and one loss
plot per comparison, into the ``<!-- results:science:<name>_* -->`` blocks of the card.  A run that fails is recorded
in its ``failure.json`` and the others go on; the exit status is 1 when any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from recipes.pretrain_config import load_config, resolve_path

CONFIG_KEYS = (
    "description",
    "output_dir",
    "seeds",
    "set",
    "variants",
    "measurements",
    "core",
    "report",
    "comparisons",
    "claims",
)
VARIANT_KEYS = ("recipe", "set", "description")
MEASUREMENT_DEFAULTS = {
    "blocks": 16,
    "batch_size": 16,
    "train_gap_blocks": 64,
    "device": "auto",
    "captured_mass": None,
}
CORE_DEFAULTS = {
    "enabled": False,
    "bundle": "{data_root}/core",
    "max_per_task": 50,
    "batch_size": 64,
    "tasks": None,
    "max_seq_len": "auto",
    "dtype": "float32",
}
RESULT_FILE = "results.json"


# ----------------------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------------------


def load_science_config(path: str) -> dict:
    """The science config with its defaults filled in and checked (unknown keys, empty variants, claims naming
    variants the config does not have are errors)."""
    from recipes.science_report import check_claim

    with open(path, encoding="utf-8") as f:
        import yaml

        cfg = yaml.safe_load(f) or {}
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; allowed: {list(CONFIG_KEYS)}")
    if not isinstance(cfg.get("variants"), dict) or not cfg["variants"]:
        raise ValueError(f"{path}: `variants` must map variant names to {{recipe: FILE, set: {{key: value}}}}")
    here = os.path.dirname(os.path.abspath(path))
    for name, variant in cfg["variants"].items():
        if not isinstance(variant, dict) or "recipe" not in variant:
            raise ValueError(f"{path}: variant {name!r} needs `recipe` (a recipes/configs/*.yaml file)")
        bad = sorted(set(variant) - set(VARIANT_KEYS))
        if bad:
            raise ValueError(f"{path}: variant {name!r} has unknown keys {bad}; allowed: {list(VARIANT_KEYS)}")
        recipe = variant["recipe"]
        variant["recipe"] = recipe if os.path.isabs(recipe) else os.path.join(here, recipe)
        if not os.path.exists(variant["recipe"]):
            raise FileNotFoundError(f"{path}: variant {name!r}: recipe {recipe!r} not found next to the config")
        variant.setdefault("set", {})
    seeds = cfg.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"{path}: `seeds` must be a non-empty list of ints; got {seeds!r}")
    cfg["seeds"] = seeds
    cfg.setdefault(
        "output_dir",
        os.path.join("outputs", os.path.splitext(os.path.basename(path))[0]),
    )
    cfg["set"] = cfg.get("set") or {}
    cfg["measurements"] = dict(MEASUREMENT_DEFAULTS, **(cfg.get("measurements") or {}))
    cfg["core"] = dict(CORE_DEFAULTS, **(cfg.get("core") or {}))
    report = dict(cfg.get("report") or {})
    report.setdefault("name", os.path.splitext(os.path.basename(path))[0].replace("-", "_"))
    report.setdefault("card", "model_cards/science.md")
    report.setdefault("figures", "model_cards/figures")
    report.setdefault("title", report["name"])
    cfg["report"] = report
    cfg["comparisons"] = cfg.get("comparisons") or [{"name": "all", "variants": list(cfg["variants"])}]
    for comp in cfg["comparisons"]:
        missing = [v for v in comp.get("variants", []) if v not in cfg["variants"]]
        if missing or "name" not in comp:
            raise ValueError(
                f"{path}: comparison {comp!r} needs `name` and variants of the config (unknown: {missing})"
            )
    cfg["claims"] = [check_claim(c) for c in cfg.get("claims") or []]
    for claim in cfg["claims"]:
        for side in ("a", "b"):
            value = claim.get(side)
            if isinstance(value, str) and value not in cfg["variants"]:
                raise ValueError(f"{path}: claim {claim['claim']!r}: `{side}: {value}` is not a variant of the config")
    cfg["config_file"] = os.path.abspath(path)
    return cfg


def _assignment(key: str, value) -> str:
    """``key=value`` for ``load_config``'s overrides (JSON is YAML, so every value round-trips)."""
    return f"{key}={json.dumps(value)}"


def run_dir(output: str, variant: str, seed: int) -> str:
    return os.path.join(output, "runs", variant, f"seed{seed}")


def variant_recipe(
    science: dict,
    variant: str,
    seed: int,
    output: str,
    extra=(),
    prepared: str | None = None,
) -> dict:
    """The ``pretrain.py`` recipe of one (variant, seed): the variant's recipe file, the config's shared ``set``, the
    variant's ``set``, ``--set`` items (``extra``), the seed, and the shared tokenizer / data cache when prepared."""
    spec = science["variants"][variant]
    overrides = [_assignment(k, v) for k, v in science["set"].items()]
    overrides += [_assignment(k, v) for k, v in spec["set"].items()]
    overrides += list(extra)
    overrides += [
        _assignment("seed", seed),
        _assignment("run_name", f"{variant}-seed{seed}"),
    ]
    overrides.append(_assignment("data.cache_dir", os.path.abspath(os.path.join(output, "data_cache"))))
    if prepared is not None:
        overrides.append(_assignment("tokenizer.path", prepared))
    return load_config(spec["recipe"], overrides, output_dir=run_dir(output, variant, seed))


def token_budget(cfg: dict) -> int:
    """Training tokens of a recipe: steps x global batch x block size (``global_batch_size`` required)."""
    gbs = cfg["global_batch_size"]
    if gbs is None or "max_steps" not in cfg["training"]:
        raise ValueError(f"{cfg['run_name']}: a science run needs `global_batch_size` and `training.max_steps`")
    return int(cfg["training"]["max_steps"]) * int(gbs) * int(cfg["data"]["block_size"])


def check_shared_setup(recipes: dict[str, dict]) -> dict:
    """Every variant must train on the same data and tokenizer settings and the same number of tokens; returns the
    shared ``{"data", "tokenizer", "tokens"}``."""
    first_name, first = next(iter(recipes.items()))
    shared = {
        "data": {k: v for k, v in first["data"].items() if k != "cache_dir"},
        "tokenizer": first["tokenizer"],
        "tokens": token_budget(first),
    }
    for name, cfg in recipes.items():
        data = {k: v for k, v in cfg["data"].items() if k != "cache_dir"}
        for key, value in (
            ("data", data),
            ("tokenizer", cfg["tokenizer"]),
            ("tokens", token_budget(cfg)),
        ):
            if value != shared[key]:
                raise ValueError(
                    f"variant {name!r} differs from {first_name!r} in `{key}` ({value!r} vs {shared[key]!r}): a "
                    "science table compares variants on the same data, tokenizer and token budget"
                )
    return shared


# ----------------------------------------------------------------------------------------------------------------
# one run
# ----------------------------------------------------------------------------------------------------------------


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def training_done(out_dir: str) -> dict | None:
    """The run's summary when training finished (validation loss evaluated, final model saved), else None."""
    summary = _read_json(os.path.join(out_dir, "summary.json"))
    finished = summary and "eval_loss" in summary and "stopped_at_step" not in summary
    return summary if finished and os.path.exists(os.path.join(out_dir, "final", "config.json")) else None


def complete_checkpoint(out_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder that holds ``trainer_state.json``: Trainer writes that file last and deletes
    older checkpoints only after it, so a run killed while saving leaves an incomplete newest folder and a complete
    older one, which is the one to resume from."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(out_dir):
        return None
    steps = []
    for name in os.listdir(out_dir):
        head, _, step = name.rpartition("-")
        if head == PREFIX_CHECKPOINT_DIR and step.isdigit():
            steps.append(int(step))
    for step in sorted(steps, reverse=True):
        folder = os.path.join(out_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if os.path.exists(os.path.join(folder, "trainer_state.json")):
            return folder
    return None


def run_core(science: dict, cfg: dict, summary: dict, out_dir: str, log) -> dict | None:
    """CORE of the final model (``core.json``, reused when present); None when disabled or without a bundle."""
    core_cfg = science["core"]
    path = os.path.join(out_dir, "core.json")
    if not core_cfg["enabled"]:
        return None
    cached = _read_json(path)
    if cached is not None:
        return cached
    try:
        bundle = resolve_path(core_cfg["bundle"], cfg["data"]["root"])
    except FileNotFoundError as err:
        log(f"[core] skipped: {err}")
        return {"skipped": str(err)}
    from recipes.eval_core import eval_core

    return eval_core(
        summary["final_dir"],
        bundle,
        tasks=core_cfg["tasks"],
        max_per_task=int(core_cfg["max_per_task"]),
        batch_size=int(core_cfg["batch_size"]),
        max_seq_len=core_cfg["max_seq_len"],
        device=None if science["measurements"]["device"] == "auto" else science["measurements"]["device"],
        dtype=core_cfg["dtype"],
        output=path,
        log=lambda *a, **k: None,
    )


def run_one(
    science: dict,
    variant: str,
    seed: int,
    output: str,
    *,
    prepared: str,
    extra=(),
    stop_at_step=None,
    log=print,
) -> str:
    """Train / evaluate / measure one (variant, seed), each stage resumed from its files; returns "done" (already
    finished), "finished" or "stopped" (``stop_at_step`` reached; run again to continue)."""
    from recipes import pretrain
    from recipes.science_measure import flat_metrics, language_model_curve, measure_run

    out_dir = run_dir(output, variant, seed)
    if os.path.exists(os.path.join(out_dir, RESULT_FILE)):
        log(f"[science] {variant} seed {seed}: done, not redone ({os.path.join(out_dir, RESULT_FILE)})")
        return "done"
    cfg = variant_recipe(science, variant, seed, output, extra, prepared)
    summary = training_done(out_dir)
    if summary is None:
        resume = complete_checkpoint(out_dir)
        log(f"[science] {variant} seed {seed}: training" + (f" (resuming from {resume})" if resume else ""))
        summary = pretrain.run(cfg, resume=resume, stop_at_step=stop_at_step, log=log)
        if "stopped_at_step" in summary:
            return "stopped"
    core = run_core(science, cfg, summary, out_dir, log)
    measured = _read_json(os.path.join(out_dir, "measure.json"))
    if measured is None:
        measured = measure_run(cfg, summary, science["measurements"], log)
        _write_json(os.path.join(out_dir, "measure.json"), measured)
    metrics = _read_json(os.path.join(out_dir, "metrics.json")) or {"log_history": []}
    curve = language_model_curve(metrics["log_history"], summary["model_config"])
    cm_settings = science["measurements"].get("captured_mass") or {}
    small = dict(measured)
    if small.get("captured_mass"):
        small["captured_mass"] = {k: v for k, v in small["captured_mass"].items() if k != "rows"}
    result = {
        "variant": variant,
        "seed": seed,
        "metrics": flat_metrics(
            summary,
            measured,
            core if core and "core_metric" in core else None,
            curve,
            cm_settings.get("claim_window"),
        ),
        "measurements": small,
        "core": {k: core[k] for k in ("core_metric", "label", "skipped") if k in core} if core else None,
        "log_history": curve,
        "summary": {
            k: summary.get(k)
            for k in (
                "family",
                "model_type",
                "num_parameters",
                "train_tokens",
                "steps",
                "tokens_per_second",
                "device",
                "versions",
                "resumed_from",
            )
        },
    }
    _write_json(os.path.join(out_dir, RESULT_FILE), result)
    failure = os.path.join(out_dir, "failure.json")
    if os.path.exists(failure):
        os.remove(failure)
    log(f"[science] {variant} seed {seed}: finished ({os.path.join(out_dir, RESULT_FILE)})")
    return "finished"


def prepare(science: dict, output: str, extra=(), log=print) -> str:
    """The tokenizer and packed data every run shares (``<output>/prepare``), built once; returns the tokenizer."""
    from recipes import pretrain

    tokenizer = os.path.abspath(os.path.join(output, "prepare", "tokenizer"))
    if os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
        return tokenizer
    first = next(iter(science["variants"]))
    cfg = variant_recipe(science, first, science["seeds"][0], output, extra)
    cfg["output_dir"] = os.path.join(output, "prepare")
    pretrain.run(cfg, prepare_only=True, log=log)
    return tokenizer


# ----------------------------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------------------------


def collect_results(science: dict, output: str) -> tuple[dict, dict]:
    """``({variant: {seed: results.json}}, {(variant, seed): failure message})`` for the config's variants and seeds."""
    from recipes.science_measure import curve_metrics

    results, failures = {}, {}
    for variant in science["variants"]:
        for seed in science["seeds"]:
            d = run_dir(output, variant, seed)
            r = _read_json(os.path.join(d, RESULT_FILE))
            if r is not None:
                # numbers of the curve added to the report after a run was stored are derived from its curve
                r["metrics"] = {**curve_metrics(r.get("log_history") or []), **r["metrics"]}
                results.setdefault(variant, {})[seed] = r
                continue
            f = _read_json(os.path.join(d, "failure.json"))
            if f is not None:
                failures[(variant, seed)] = f.get("error", "failed")
    return results, failures


def write_report(science: dict, output: str, card: str, figures_dir: str, log=print) -> str:
    """Fill the card's science blocks and draw the comparison figures from the results under ``output``."""
    from recipes.science_report import (
        claims_table,
        comparison_figures,
        figures_block,
        fill_blocks,
        measurements_block,
        results_table,
    )

    results, failures = collect_results(science, output)
    name = science["report"]["name"]
    variants = list(science["variants"])
    k = (science["measurements"].get("captured_mass") or {}).get("claim_window")
    figures = comparison_figures(results, science["comparisons"], figures_dir, f"science_{name}")
    card_dir = os.path.dirname(os.path.abspath(card))
    done = sum(len(v) for v in results.values())
    planned = len(variants) * len(science["seeds"])
    header = (
        f"{science['report']['title']}: {done} of {planned} runs ({len(variants)} variants x seeds "
        f"{science['seeds']}) have results. Config: `{os.path.relpath(science['config_file'], REPO_ROOT)}`; "
        f"regenerate with `python recipes/science_table.py --config "
        f"{os.path.relpath(science['config_file'], REPO_ROOT)}`.\n\n"
    )
    blocks = {
        f"{name}_table": header + results_table(results, variants, science["seeds"], failures),
        f"{name}_claims": claims_table(science["claims"], results) if science["claims"] else "No claims listed.\n",
        f"{name}_measurements": measurements_block(results, variants, k),
        f"{name}_figures": figures_block(figures, card_dir),
    }
    text = ""
    if os.path.exists(card):
        with open(card, encoding="utf-8") as f:
            text = f.read()
    else:
        text = "# Science runs: the seeds' claims, tested over several seeds\n"
    new = fill_blocks(text, blocks)
    os.makedirs(card_dir, exist_ok=True)
    with open(card, "w", encoding="utf-8") as f:
        f.write(new)
    log(f"[science] wrote {card} ({done} of {planned} runs with results) and {sum(1 for f in figures if f[1])} figures")
    return card


def store_run(output: str, target: str | None, variant: str, seed: int) -> None:
    """Copy one run's ``results.json`` (small: numbers and curves) to ``target`` in the same layout; nothing when the
    run has none or ``target`` is None or ``output`` itself."""
    src = os.path.join(run_dir(output, variant, seed), RESULT_FILE)
    if target and os.path.exists(src) and os.path.abspath(output) != os.path.abspath(target):
        dst = os.path.join(run_dir(target, variant, seed), RESULT_FILE)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(src, dst)


def store(science: dict, output: str, target: str) -> None:
    """Copy every ``results.json`` to ``target`` (:func:`store_run`), so the card can be refilled from the repository
    with ``--report-only --output target``.  Runs are also stored one by one as they finish, so a session cut by its
    time limit keeps what finished."""
    for variant in science["variants"]:
        for seed in science["seeds"]:
            store_run(output, target, variant, seed)


def _past_deadline(args, output: str, variant: str, seed: int, t_start: float) -> bool:
    """True when ``--max-minutes`` has passed: the run is not started (and says so unless it is already done)."""
    if args.max_minutes is None or time.time() - t_start < 60 * args.max_minutes:
        return False
    if not os.path.exists(os.path.join(run_dir(output, variant, seed), RESULT_FILE)):
        print(f"[science] {variant} seed {seed}: not started (--max-minutes {args.max_minutes:g})")
    return True


def _run_guarded(science: dict, variant: str, seed: int, output: str, tokenizer: str, args) -> bool:
    """One run in this process; a failure is written to its ``failure.json`` and reported, not raised."""
    t0 = time.time()
    try:
        status = run_one(
            science,
            variant,
            seed,
            output,
            prepared=tokenizer,
            extra=args.overrides,
            stop_at_step=args.stop_at_step,
        )
    except Exception as err:  # noqa: BLE001  (one failed run must not stop the table: recorded, reported, exit 1)
        d = run_dir(output, variant, seed)
        os.makedirs(d, exist_ok=True)
        _write_json(
            os.path.join(d, "failure.json"),
            {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()},
        )
        print(f"[science] {variant} seed {seed}: FAILED ({type(err).__name__}: {err}); see failure.json")
        return False
    print(f"[science] {variant} seed {seed}: {status} in {time.time() - t0:.0f}s")
    return True


def worker_command(args, variant: str, seed: int, output: str) -> list[str]:
    """The command line of one ``--workers`` process: this script on one (variant, seed), without the report."""
    cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--only", variant]
    cmd += ["--seeds", str(seed), "--output", output, "--no-report"]
    if args.overrides:
        cmd += ["--set", *args.overrides]
    if args.stop_at_step is not None:
        cmd += ["--stop-at-step", str(args.stop_at_step)]
    return cmd


def visible_gpus() -> list[str]:
    """The GPUs a worker may be pinned to, as ``CUDA_VISIBLE_DEVICES`` entries: the parent's own list when it set one,
    else ``0 .. n-1`` for the devices torch counts (NVML, without initialising CUDA here); empty without CUDA."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001  (no torch / no driver: the workers run on the CPU)
        return []


def pick_gpu(gpus: list[str], busy: list[str]) -> str | None:
    """The GPU with the fewest running workers (``busy``: one entry per running worker), the lowest first on a tie;
    None without GPUs.  On a machine of several GPUs the runs spread out instead of all sharing ``cuda:0``."""
    if not gpus:
        return None
    return min(gpus, key=lambda g: (busy.count(g), gpus.index(g)))


def run_in_workers(args, jobs: list, output: str, t_start: float) -> int:
    """Run ``jobs`` (``(variant, seed)`` pairs) in up to ``args.workers`` processes at once; returns how many failed.
    Finished runs are skipped without a process; each process writes its own files, so the only shared state is the
    prepared tokenizer and data, built before.  With several GPUs each process sees one (``CUDA_VISIBLE_DEVICES``),
    the least busy (``pick_gpu``); with one GPU they share it."""
    import subprocess

    pending = [(v, s) for v, s in jobs if not os.path.exists(os.path.join(run_dir(output, v, s), RESULT_FILE))]
    gpus = visible_gpus()
    running: dict = {}
    failed = 0
    while pending or running:
        while pending and len(running) < args.workers:
            variant, seed = pending.pop(0)
            if _past_deadline(args, output, variant, seed, t_start):
                continue
            d = run_dir(output, variant, seed)
            os.makedirs(d, exist_ok=True)
            log = open(os.path.join(d, "worker.log"), "a", encoding="utf-8")  # noqa: SIM115  (closed when it exits)
            gpu = pick_gpu(gpus, [r[4] for r in running.values()]) if len(gpus) > 1 else None
            env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            cmd = worker_command(args, variant, seed, output)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[proc] = (variant, seed, log, time.time(), gpu)
            where = "" if gpu is None else f", GPU {gpu}"
            print(f"[science] {variant} seed {seed}: started (pid {proc.pid}{where}, log {log.name})", flush=True)
        if not running:
            break
        time.sleep(1.0)
        for proc in [p for p in running if p.poll() is not None]:
            variant, seed, log, t0, _ = running.pop(proc)
            log.close()
            ok = proc.returncode == 0
            failed += 0 if ok else 1
            store_run(output, args.store, variant, seed)
            state = "finished" if ok else f"FAILED (exit {proc.returncode}; see {log.name})"
            print(f"[science] {variant} seed {seed}: {state} in {time.time() - t0:.0f}s", flush=True)
    return failed


# ----------------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        required=True,
        help="science config (recipes/configs/science_*.yaml)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated variants to run (default: all of the config)",
    )
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the config's)")
    p.add_argument(
        "--output",
        default=None,
        help="results folder (default: the config's output_dir)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides for every run, after the config's (e.g. data.root=/data)",
    )
    p.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="stop each unfinished run at this step with a checkpoint (continue by running again)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no new run after this many minutes (one already started finishes, or is cut by the caller's "
        "time limit and resumes next time); the runs left are listed as not run",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="runs trained at once, each in its own process sharing the device (default 1: in this process)",
    )
    p.add_argument(
        "--no-report",
        action="store_true",
        help="train and measure only; leave the card and figures alone (what each --workers process runs)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write the card and figures from existing results",
    )
    p.add_argument(
        "--card",
        default=None,
        help="the card to fill (default: the config's report.card)",
    )
    p.add_argument(
        "--figures",
        default=None,
        help="folder for the PNGs (default: the config's report.figures)",
    )
    p.add_argument(
        "--store",
        default=None,
        help="also copy every results.json here (e.g. model_cards/results/...)",
    )
    args = p.parse_args(argv)
    args.overrides = [item for group in args.overrides for item in group]
    if args.workers < 1:
        p.error(f"--workers must be a positive integer; got {args.workers}")
    return args


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated integers; got {text!r}") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    science = load_science_config(args.config)
    seeds = science["seeds"] if args.seeds is None else _int_list(args.seeds, "seeds")  # the table keeps all seeds
    output = args.output or science["output_dir"]
    card = args.card or science["report"]["card"]
    figures = args.figures or science["report"]["figures"]
    variants = list(science["variants"])
    if args.only:
        chosen = [v.strip() for v in args.only.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in science["variants"]]
        if unknown:
            raise SystemExit(f"--only: unknown variants {unknown}; the config has {variants}")
        variants = chosen
    failed = 0
    t_start = time.time()
    if not args.report_only:
        os.makedirs(output, exist_ok=True)
        recipes = {
            v: variant_recipe(science, v, science["seeds"][0], output, args.overrides) for v in science["variants"]
        }
        check_shared_setup(recipes)
        tokenizer = prepare(science, output, args.overrides)
        jobs = [
            (variant, seed) for seed in seeds for variant in variants
        ]  # seed-major: a cut session keeps whole seeds
        if args.workers > 1:
            failed = run_in_workers(args, jobs, output, t_start)
        else:
            for variant, seed in jobs:
                if _past_deadline(args, output, variant, seed, t_start):
                    continue
                if not _run_guarded(science, variant, seed, output, tokenizer, args):
                    failed += 1
                store_run(output, args.store, variant, seed)
    if args.store:
        store(science, output, args.store)
    if not args.no_report:
        write_report(science, output, card, figures)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
