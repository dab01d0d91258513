"""Fill the result blocks of ``model_cards/*.md`` from results files (never typed by hand).

    python recipes/fill_model_cards.py --results RESULTS --store   # copy the result files into model_cards/results
    python recipes/fill_model_cards.py                              # fill from model_cards/results (the stored ones)
    python recipes/fill_model_cards.py --check                      # exit 1 if a card is not what the files give

A card marks each generated block with a pair of HTML comments; everything between them is replaced::

    <!-- results:tinystories:gka -->   ...   <!-- /results:tinystories:gka -->

Blocks (``KIND:FAMILY``; the family's rows are in bold):

* ``accounting:FAMILY``: parameters and forward FLOPs per token against the dot baseline, computed from the model
  classes by ``recipes/accounting.py`` (or read from ``--accounting``); no results folder needed.
* ``tinystories:FAMILY``: every ``tinystories_*`` run of the results folder: parameters, training tokens, validation
  loss, bits per byte, CORE-20, tokens/s of the run.
* ``sssl:FAMILY``: ``gka_sssl`` against ``dot_sssl``.
* ``throughput:FAMILY``: the family's training tokens/s against Llama (SDPA) from ``throughput.json``.
* ``story:FAMILY``: the story ``tinystories_<family>`` generated at the end of training.
* ``cpu_quick:FAMILY``: the CPU main job's summary (``cpu_quick/summary.json``).
* ``multigpu:FAMILY``: 1 GPU vs DDP vs FSDP at the same global batch (``multi/comparison.json``).

Blocks of other kinds belong to other scripts (e.g. ``captured_mass``, filled by ``recipes/measure_captured_mass.py``)
and are left as they are.

The results folder is what ``recipes/gpu_all.sh RESULTS`` writes: ``<run>/summary.json`` (pretrain.py),
``<run>/core.json`` (eval_core.py), ``throughput.json`` (throughput.py), ``multi/comparison.json``
(compare_runs.py), and ``cpu_quick/summary.json`` if you copy the CPU run there.  A block whose files are missing says
so and names the command that makes them.  ``--store`` copies the small files the blocks read (``summary.json``,
``core.json``, ``metrics.csv`` per run, ``throughput.json``, ``multi/comparison.json``) into ``model_cards/results/``,
the default results folder, so the cards can be refilled from what the repository holds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARDS_DIR = os.path.join(REPO_ROOT, "model_cards")
STORED_RESULTS = os.path.join(CARDS_DIR, "results")
BLOCK = re.compile(r"(<!-- results:([a-z_0-9]+):([a-z_0-9]+) -->\n)(.*?)(<!-- /results:\2:\3 -->)", re.DOTALL)
MISSING = (
    "_No results yet: run `bash recipes/gpu_all.sh RESULTS`, then "
    "`python recipes/fill_model_cards.py --results RESULTS --store`._\n"
)


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_results(results_dir: str | None) -> dict:
    """``{"runs": {run name: summary (+ "core")}, "throughput": ..., "multi": ..., "source": dir}``."""
    out = {"runs": {}, "throughput": None, "multi": None, "source": results_dir}
    if not results_dir:
        return out
    for summary_path in sorted(glob.glob(os.path.join(results_dir, "*", "summary.json"))):
        run_dir = os.path.dirname(summary_path)
        summary = _read_json(summary_path)
        if summary is None or "eval_loss" not in summary:
            continue
        core = _read_json(os.path.join(run_dir, "core.json"))
        if core is not None:
            summary["core"] = core
        out["runs"][summary.get("run_name") or os.path.basename(run_dir)] = summary
    out["throughput"] = _read_json(os.path.join(results_dir, "throughput.json"))
    out["multi"] = _read_json(os.path.join(results_dir, "multi", "comparison.json"))
    return out


def _f(value, spec: str, empty: str = "") -> str:
    return empty if value is None else format(value, spec)


def _core(summary: dict):
    core = summary.get("core")
    if not core:
        return None, None
    return core.get("core_metric"), core.get("label")


def block_tinystories(family: str, results: dict, prefixes=("tinystories_",)) -> str:
    runs = {k: v for k, v in results["runs"].items() if k.startswith(prefixes)}
    if not runs:
        return MISSING
    core_label = next((_core(s)[1] for s in runs.values() if _core(s)[1]), "CORE")
    lines = [
        (
            f"| run | family | parameters | training tokens | validation loss | bits per byte | {core_label} | "
            "tokens/s (training) | device |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in sorted(runs.items(), key=lambda kv: (kv[1].get("eval_loss") is None, kv[1].get("eval_loss"))):
        label = f"**{name}**" if s.get("family") == family else name
        versions = s.get("versions") or {}
        device = versions.get("cuda") or s.get("device", "")
        lines.append(
            f"| {label} | {s.get('family')} | {_f(s.get('num_parameters'), ',d')} | {_f(s.get('train_tokens'), ',d')} | "
            f"{_f(s.get('eval_loss'), '.4f')} | {_f(s.get('bits_per_byte'), '.4f')} | {_f(_core(s)[0], '.4f')} | "
            f"{_f(s.get('tokens_per_second'), ',.0f')} | {device} |"
        )
    lines.append("")
    lines.append(
        f"Validation loss: nats per token on the held-out blocks; bits per byte on the validation text (tokenizer-"
        f"independent); {core_label}: mean centered accuracy (v1 baselines), see docs/evaluation.md. "
        "Source: each run's `summary.json` (recipes/pretrain.py) and `core.json` (recipes/eval_core.py)."
    )
    return "\n".join(lines) + "\n"


def block_sssl(family: str, results: dict) -> str:
    return block_tinystories(family, results, prefixes=("gka_sssl", "dot_sssl"))


def block_throughput(family: str, results: dict) -> str:
    report = results.get("throughput")
    if not report:
        return MISSING
    from recipes.throughput import markdown_table

    table = markdown_table(report)
    lines = []
    for line in table.splitlines():
        cells = line.split("|")
        if len(cells) > 2 and cells[2].strip() == family:
            line = line.replace(f"| {cells[1].strip()} |", f"| **{cells[1].strip()}** |", 1)
        lines.append(line)
    return "\n".join(lines) + "\n"


def block_story(family: str, results: dict) -> str:
    s = results["runs"].get(f"tinystories_{family}")
    if not s or not s.get("story"):
        return MISSING
    prompt = s.get("generation_prompt") or "Once upon a time"
    return (
        f'Sampled from `tinystories_{family}` after training (prompt "{prompt}", temperature 0.7, top-k 40):\n\n'
        "```text\n" + s["story"].strip() + "\n```\n"
    )


def block_cpu_quick(family: str, results: dict) -> str:
    s = results["runs"].get("cpu_quick")
    if not s:
        return "_No results yet: run the README's first command, copy `outputs/cpu_quick` into RESULTS, then fill._\n"
    return (
        "| parameters | steps | training tokens | wall time (total) | validation loss | bits per byte | device |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {_f(s.get('num_parameters'), ',d')} | {s.get('steps')} | {_f(s.get('train_tokens'), ',d')} | "
        f"{_f(s.get('total_seconds'), '.0f')} s | {_f(s.get('eval_loss'), '.4f')} | {_f(s.get('bits_per_byte'), '.4f')} | "
        f"{s.get('device')} |\n\n```text\n{(s.get('story') or '').strip()}\n```\n"
    )


def block_multigpu(family: str, results: dict) -> str:
    rows = results.get("multi")
    if not rows:
        return MISSING
    from recipes.compare_runs import markdown_table

    return markdown_table(rows)


def block_accounting(family: str, results: dict, accounting: dict | None) -> str:
    from recipes.accounting import markdown_table

    ts = [r for r in accounting["setups"]["tinystories"] if r.get("family") in (family, "dot", "llama")]
    d768 = [r for r in accounting["setups"]["d768"] if r.get("family") in (family, "dot", "llama")]
    if not any(r.get("family") == family and "skipped" not in r for r in ts + d768):
        return (
            f"_The `{family}` family is not registered in this checkout; `python recipes/accounting.py` fills this._\n"
        )
    return (
        "TinyStories recipes (d=256, 4 layers, sequence 256, vocabulary 8192, parameter budgets matched):\n\n"
        + markdown_table(ts, highlight=family)
        + "\nd=768, 12 layers, sequence 1024, SwiGLU 2048, vocabulary 32000, no matching (what the attention "
        "function itself changes):\n\n"
        + markdown_table(d768, highlight=family)
        + "\nForward matrix-product FLOPs per token counted by `FlopCounterMode` on the model classes (meta device, "
        'reference attention path); "causal" scales each layer\'s attention core by the fraction of query-key pairs '
        "its mask allows. Training costs about 3x these. Computed by `recipes/accounting.py`.\n"
    )


GENERATORS = {
    "tinystories": block_tinystories,
    "sssl": block_sssl,
    "throughput": block_throughput,
    "story": block_story,
    "cpu_quick": block_cpu_quick,
    "multigpu": block_multigpu,
}


def fill_text(text: str, results: dict, accounting: dict | None) -> str:
    def replace(match):
        head, kind, family, _, tail = match.groups()
        if kind == "accounting":
            body = block_accounting(family, results, accounting)
        elif kind in GENERATORS:
            body = GENERATORS[kind](family, results)
        else:
            return match.group(0)  # another script's block (e.g. captured_mass: recipes/measure_captured_mass.py)
        return head + body + tail

    return BLOCK.sub(replace, text)


def fill_cards(cards_dir: str, results: dict, accounting: dict | None, check: bool = False) -> list[str]:
    """Fill every ``*.md`` card in ``cards_dir``; returns the files changed (with ``check``: that would change)."""
    changed = []
    for path in sorted(glob.glob(os.path.join(cards_dir, "*.md"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if "<!-- results:" not in text:
            continue
        new = fill_text(text, results, accounting)
        if new != text:
            changed.append(path)
            if not check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    return changed


def store_results(results_dir: str, target: str = STORED_RESULTS) -> str:
    """Copy the files the result blocks read from ``results_dir`` into ``target`` (replacing what was there)."""
    import shutil

    if os.path.abspath(results_dir) == os.path.abspath(target):
        return target
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for summary_path in sorted(glob.glob(os.path.join(results_dir, "*", "summary.json"))):
        run = os.path.basename(os.path.dirname(summary_path))
        os.makedirs(os.path.join(target, run), exist_ok=True)
        for name in ("summary.json", "core.json", "metrics.csv"):
            src = os.path.join(results_dir, run, name)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(target, run, name))
    for rel in ("throughput.json", os.path.join("multi", "comparison.json")):
        src = os.path.join(results_dir, rel)
        if os.path.exists(src):
            os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
            shutil.copy(src, os.path.join(target, rel))
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--results",
        default=None,
        help="results folder (gpu_all.sh output); default: model_cards/results when it exists",
    )
    parser.add_argument("--store", action="store_true", help="copy the result files into model_cards/results first")
    parser.add_argument("--cards", default=CARDS_DIR)
    parser.add_argument("--accounting", default=None, help="accounting.json (default: computed now)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a card would change")
    args = parser.parse_args(argv)
    results_dir = args.results
    if results_dir and args.store:
        results_dir = store_results(results_dir)
    if results_dir is None and os.path.isdir(STORED_RESULTS):
        results_dir = STORED_RESULTS
    results = load_results(results_dir)
    if args.accounting:
        accounting = _read_json(args.accounting)
    else:
        from recipes.accounting import run as run_accounting

        accounting = run_accounting()
    changed = fill_cards(args.cards, results, accounting, check=args.check)
    for path in changed:
        print(("would change " if args.check else "filled ") + os.path.relpath(path))
    if not changed:
        print("model cards are up to date")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
