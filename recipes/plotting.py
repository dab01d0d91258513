"""Loss-curve plots shared by ``pretrain.py``, ``compare_runs.py`` and ``visualize.py`` (matplotlib, Agg, PNG)."""

from __future__ import annotations

import json
import os


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir_or_file: str) -> dict:
    """A run's ``metrics.json`` (a folder holding one, or the file itself)."""
    path = run_dir_or_file
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def curves(metrics: dict, x: str = "step") -> dict:
    """``{"train": (xs, losses), "eval": (xs, losses)}`` from a metrics dict (``x``: "step" or "tokens")."""
    train_x, train_y, eval_x, eval_y = [], [], [], []
    for row in metrics["log_history"]:
        xv = row.get(x if x != "tokens" else "tokens_seen", row.get("step"))
        if "loss" in row and xv is not None:
            train_x.append(xv)
            train_y.append(row["loss"])
        if "eval_loss" in row and xv is not None:
            eval_x.append(xv)
            eval_y.append(row["eval_loss"])
    return {"train": (train_x, train_y), "eval": (eval_x, eval_y)}


def plot_loss_curves(runs: dict, path: str, *, x: str = "step", title: str | None = None, log_y: bool = False) -> str:
    """One PNG with the training loss (lines) and validation loss (markers) of every run in ``runs``
    (``{label: metrics dict}``); returns ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, metrics) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        c = curves(metrics, x)
        if c["train"][0]:
            ax.plot(*c["train"], color=color, lw=1.2, label=f"{label} train")
        if c["eval"][0]:
            ax.plot(*c["eval"], color=color, lw=0, marker="o", ms=4, label=f"{label} validation")
    ax.set_xlabel("optimizer step" if x == "step" else "training tokens")
    ax.set_ylabel("cross-entropy (nats / token)")
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "loss")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["curves", "plot_loss_curves", "read_metrics"]
