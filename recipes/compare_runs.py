"""Compare pretraining runs: one loss-curve plot and a table (markdown + JSON) against a reference run.

    python recipes/compare_runs.py --runs 1gpu=out/1gpu ddp=out/ddp fsdp=out/fsdp --output out/compare \
        [--x step|tokens] [--title "..."]

Each run folder holds ``metrics.json`` (and ``summary.json`` when the run finished) written by ``pretrain.py``.  The
first run is the reference: for every other run the table gives the largest and the mean absolute difference of the
logged training losses at the steps both runs logged, and the ratio of their tokens per second.  Writes
``<output>/loss_curves.png``, ``<output>/comparison.md`` and ``<output>/comparison.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes.plotting import plot_loss_curves, read_metrics


def _train_losses(metrics: dict) -> dict:
    return {row["step"]: row["loss"] for row in metrics["log_history"] if "loss" in row and "step" in row}


def _summary(run_dir: str) -> dict:
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def compare(runs: dict[str, str]) -> list[dict]:
    """One row per run (``{label: run folder}``, the first is the reference)."""
    rows = []
    ref_losses = ref_tps = None
    for i, (label, run_dir) in enumerate(runs.items()):
        metrics = read_metrics(run_dir)
        summary = _summary(run_dir)
        losses = _train_losses(metrics)
        row = {
            "run": label,
            "dir": os.path.abspath(run_dir),
            "world_size": summary.get("world_size"),
            "global_batch_size": summary.get("global_batch_size"),
            "steps": metrics.get("global_step"),
            "final_train_loss": losses[max(losses)] if losses else None,
            "eval_loss": summary.get("eval_loss"),
            "bits_per_byte": summary.get("bits_per_byte"),
            "tokens_per_second": summary.get("tokens_per_second"),
            "num_parameters": summary.get("num_parameters"),
        }
        if i == 0:
            ref_losses, ref_tps = losses, row["tokens_per_second"]
        else:
            common = sorted(set(losses) & set(ref_losses))
            diffs = [abs(losses[s] - ref_losses[s]) for s in common]
            row["compared_steps"] = len(common)
            row["max_abs_loss_diff"] = max(diffs) if diffs else None
            row["mean_abs_loss_diff"] = sum(diffs) / len(diffs) if diffs else None
            if ref_tps and row["tokens_per_second"]:
                row["speedup"] = row["tokens_per_second"] / ref_tps
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    ref = rows[0]["run"]
    lines = [
        (
            f"| run | processes | global batch | steps | final train loss | validation loss | bits/byte | tokens/s | "
            f"speed vs {ref} | max abs loss diff vs {ref} | mean abs loss diff |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["run"],
                    _fmt(r["world_size"], "d"),
                    _fmt(r["global_batch_size"], "d"),
                    _fmt(r["steps"], "d"),
                    _fmt(r["final_train_loss"], ".4f"),
                    _fmt(r["eval_loss"], ".4f"),
                    _fmt(r["bits_per_byte"], ".4f"),
                    _fmt(r["tokens_per_second"], ",.0f"),
                    "1.00x" if r is rows[0] else (_fmt(r.get("speedup"), ".2f") + "x" if r.get("speedup") else ""),
                    "(reference)" if r is rows[0] else _fmt(r.get("max_abs_loss_diff"), ".2e"),
                    "" if r is rows[0] else _fmt(r.get("mean_abs_loss_diff"), ".2e"),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def _parse_runs(items: list[str]) -> dict[str, str]:
    runs = {}
    for item in items:
        label, _, path = item.partition("=")
        if not path:
            label, path = os.path.basename(os.path.normpath(item)), item
        runs[label] = path
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="label=folder (or folder), the reference first")
    parser.add_argument("--output", required=True, help="folder for loss_curves.png, comparison.md, comparison.json")
    parser.add_argument("--x", choices=("step", "tokens"), default="step")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    runs = _parse_runs(args.runs)
    os.makedirs(args.output, exist_ok=True)
    plot_loss_curves(
        {label: read_metrics(path) for label, path in runs.items()},
        os.path.join(args.output, "loss_curves.png"),
        x=args.x,
        title=args.title or "loss curves",
    )
    rows = compare(runs)
    table = markdown_table(rows)
    with open(os.path.join(args.output, "comparison.md"), "w", encoding="utf-8") as f:
        f.write(table)
    with open(os.path.join(args.output, "comparison.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
