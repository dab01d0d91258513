"""Results of ``recipes/science_table.py``: statistics over seeds, the claim verdicts, the card blocks, the figures.

Spread: the sample standard deviation over seeds (``ddof=1``); it needs 2 seeds, so a variant with 1 seed shows
its value without a spread and every claim that reads it is "inconclusive".

Verdict rule of a claim comparing ``a`` with ``b`` (a variant or a constant), ``d`` the difference in the claimed
direction (positive when the claim holds) and ``s = sqrt(s_a^2 + f^2 s_b^2)`` the spread of that difference between
single runs (``f`` the claim's factor; a constant has no spread):

* ``less`` / ``greater`` (``a < f b`` / ``a > f b``): reproduced if ``d > 2 s``, not reproduced if ``d < -2 s``, else
  inconclusive.
* ``close`` (``|a - b| <= tolerance``): reproduced if ``|a - b| + 2 s <= tolerance``, not reproduced if
  ``|a - b| - 2 s > tolerance``, else inconclusive.
* ``within`` (``lo <= a <= hi``): reproduced if ``[a - 2 s_a, a + 2 s_a]`` lies inside, not reproduced if it lies
  wholly outside, else inconclusive.

Fewer than 2 seeds on a side that is a variant gives "inconclusive (n < 2)"; no result at all gives "not run".
"""

from __future__ import annotations

import math
import os
import re

CLAIM_TESTS = ("less", "greater", "close", "within")
VERDICTS = ("reproduced", "not reproduced", "inconclusive", "not run")


def stats(values) -> dict:
    """``{"n", "mean", "std", "min", "max"}`` of the non-None values (``std``: sample, None below 2 values)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {
        "n": len(vals),
        "mean": mean,
        "std": std,
        "min": min(vals),
        "max": max(vals),
    }


def variant_stats(results: dict, variant: str, metric: str) -> dict:
    """:func:`stats` of ``metric`` over the seeds of ``variant`` in ``results`` (``{variant: {seed: run result}}``)."""
    runs = results.get(variant, {})
    return stats(r["metrics"].get(metric) for r in runs.values())


def fmt_stat(s: dict, spec: str = ".4f") -> str:
    if not s or s["n"] == 0:
        return "not run"
    if s["n"] == math.inf:
        return format(s["mean"], "g")  # a constant of a claim
    if s["std"] is None:
        return f"{format(s['mean'], spec)} (n=1)"
    return f"{format(s['mean'], spec)} ± {format(s['std'], spec)} (n={s['n']})"


def _side(results: dict, side, metric: str) -> tuple[dict, str]:
    """Statistics of one side of a claim: a variant's over its seeds, or a constant (spread 0, "infinitely many"
    samples)."""
    if isinstance(side, (int, float)) and not isinstance(side, bool):
        return {
            "n": math.inf,
            "mean": float(side),
            "std": 0.0,
            "min": side,
            "max": side,
        }, format(side, "g")
    return variant_stats(results, side, metric), str(side)


def check_claim(claim: dict) -> dict:
    """The claim with its checked fields (``test``, ``metric``, ``a``, and ``b`` / ``tolerance`` / ``range``)."""
    for key in ("claim", "source", "metric", "test", "a"):
        if key not in claim:
            raise ValueError(f"claim {claim.get('claim', claim)!r}: missing `{key}`")
    from recipes.science_measure import RUN_METRICS

    if claim["metric"] not in RUN_METRICS:
        raise ValueError(f"claim {claim['claim']!r}: `metric` must be one of {RUN_METRICS}; got {claim['metric']!r}")
    if claim["test"] not in CLAIM_TESTS:
        raise ValueError(f"claim {claim['claim']!r}: `test` must be one of {CLAIM_TESTS}; got {claim['test']!r}")
    if claim["test"] in ("less", "greater", "close") and "b" not in claim:
        raise ValueError(f"claim {claim['claim']!r}: test {claim['test']!r} needs `b` (a variant or a number)")
    if claim["test"] == "close" and not isinstance(claim.get("tolerance"), (int, float)):
        raise ValueError(f"claim {claim['claim']!r}: test 'close' needs a numeric `tolerance`")
    if claim["test"] == "within":
        rng = claim.get("range")
        if not (isinstance(rng, (list, tuple)) and len(rng) == 2 and rng[0] <= rng[1]):
            raise ValueError(f"claim {claim['claim']!r}: test 'within' needs `range: [lo, hi]` with lo <= hi")
    return claim


def verdict(claim: dict, results: dict) -> dict:
    """``{"verdict", "measurement", "difference", "spread"}`` of one claim by the module's rule."""
    check_claim(claim)
    metric, test = claim["metric"], claim["test"]
    a, a_name = _side(results, claim["a"], metric)
    spec = claim.get("format", ".4f")
    out = {"difference": None, "spread": None}
    if a["n"] == 0:
        return dict(out, verdict="not run", measurement=f"{a_name}: not run")
    if test == "within":
        lo, hi = claim["range"]
        out["measurement"] = f"{a_name} {fmt_stat(a, spec)}; claimed range [{lo:g}, {hi:g}]"
        if a["n"] < 2:
            return dict(out, verdict="inconclusive (n < 2)")
        s = a["std"]
        out["spread"] = s
        if lo <= a["mean"] - 2 * s and a["mean"] + 2 * s <= hi:
            return dict(out, verdict="reproduced")
        if a["mean"] + 2 * s < lo or a["mean"] - 2 * s > hi:
            return dict(out, verdict="not reproduced")
        return dict(out, verdict="inconclusive")
    b, b_name = _side(results, claim["b"], metric)
    factor = float(claim.get("factor", 1.0))
    scaled = f"{factor:g} x {b_name}" if factor != 1.0 else b_name
    if b["n"] == 0:
        return dict(
            out,
            verdict="not run",
            measurement=f"{a_name} {fmt_stat(a, spec)} vs {b_name}: not run",
        )
    raw = a["mean"] - factor * b["mean"]
    b_text = b_name if b["n"] == math.inf else f"{scaled} {fmt_stat(b, spec)}"
    out["measurement"] = f"{a_name} {fmt_stat(a, spec)} vs {b_text}; difference {raw:+{spec}}"
    out["difference"] = raw
    if a["n"] < 2 or b["n"] < 2:
        return dict(out, verdict="inconclusive (n < 2)")
    s = math.sqrt(a["std"] ** 2 + (factor * b["std"]) ** 2)
    out["spread"] = s
    out["measurement"] += f" ± {s:{spec}}"
    if test in ("less", "greater"):
        d = -raw if test == "less" else raw
        if d > 2 * s:
            return dict(out, verdict="reproduced")
        if d < -2 * s:
            return dict(out, verdict="not reproduced")
        return dict(out, verdict="inconclusive")
    tol = float(claim["tolerance"])
    out["measurement"] += f"; tolerance {tol:g}"
    if abs(raw) + 2 * s <= tol:
        return dict(out, verdict="reproduced")
    if abs(raw) - 2 * s > tol:
        return dict(out, verdict="not reproduced")
    return dict(out, verdict="inconclusive")


# ----------------------------------------------------------------------------------------------------------------
# markdown
# ----------------------------------------------------------------------------------------------------------------

TABLE_COLUMNS = (
    ("eval_loss", "validation loss", ".4f"),
    ("best_eval_loss", "lowest validation loss", ".4f"),
    ("best_eval_step", "at step", ".0f"),
    ("bits_per_byte", "bits per byte", ".4f"),
    ("core", "CORE", ".4f"),
    ("train_val_gap", "validation - train loss", ".4f"),
    ("first_eval_loss", "validation loss at 1st eval", ".4f"),
    ("register_mass_max", "register mass (max layer)", ".3f"),
    ("tau_start", "tau start", ".3f"),
    ("tau_end", "tau end", ".3f"),
    ("captured_mass_longest", "captured mass (longest context)", ".3f"),
)


EVERY_RUN_METRICS = (
    "eval_loss",
    "best_eval_loss",
    "best_eval_step",
    "bits_per_byte",
    "core",
    "train_val_gap",
    "first_eval_loss",
)


def _status(results: dict, variant: str, seeds: list[int], failures: dict) -> str:
    done = sorted(results.get(variant, {}))
    missing = [s for s in seeds if s not in done]
    if not missing:
        return "done"
    failed = [s for s in missing if (variant, s) in failures]
    parts = []
    if failed:
        parts.append("failed: seed " + ", ".join(map(str, failed)))
    rest = [s for s in missing if s not in failed]
    if rest:
        parts.append("not run: seed " + ", ".join(map(str, rest)))
    return "; ".join(parts)


def _integer_cell(results: dict, variant: str, metric: str) -> str:
    s = variant_stats(results, variant, metric)
    if s["n"] == 0:
        return ""
    return f"{s['mean']:,.0f}" if s["min"] == s["max"] else f"{s['min']:,.0f}-{s['max']:,.0f}"


def results_table(results: dict, variants: list[str], seeds: list[int], failures: dict | None = None) -> str:
    """One row per variant of the config, in its order: those without results say "not run" (never dropped)."""
    failures = failures or {}
    head = ["variant", "seeds", "parameters", "attention parameters"] + [c[1] for c in TABLE_COLUMNS] + ["status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        n = len(results.get(v, {}))
        cells = [
            v,
            f"{n}/{len(seeds)}",
            _integer_cell(results, v, "num_parameters"),
            _integer_cell(results, v, "attention_parameters"),
        ]
        for metric, _, spec in TABLE_COLUMNS:
            s = variant_stats(results, v, metric)
            if s["n"] or not n:
                cells.append(fmt_stat(s, spec))
            else:  # runs exist without this number: not measured (CORE off) or not a quantity of the family
                cells.append("not measured" if metric in EVERY_RUN_METRICS else "")
        cells.append(_status(results, v, seeds, failures))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Mean ± sample standard deviation over the seeds (n = seeds with results; n=1: no spread). Validation loss: "
        "nats per token of the language-model term on every held-out block, the final model in float32 (the same "
        "computation for every variant; Trainer's eval loss of a regularized scalar-sort model adds the "
        "regularizers); lowest validation loss: the lowest of Trainer's evaluations during training (left out for "
        "regularized models), at the step named beside it: below the final loss where a run repeats its data until "
        "it overfits; validation loss at 1st eval: Trainer's, left out for regularized models; validation - train "
        "loss: the final model's loss on validation blocks minus on as many training blocks (the first packed ones: "
        "the first training source's text); register mass: the largest over layers of the mean attention share on the "
        "register keys; tau: mean over layers and heads at initialisation and after training; captured mass: share of "
        "exact attention mass in the sorted cache's window at the longest measured context. `not measured`: the "
        "config did not ask for it (CORE off, or no bundle); an empty cell: the variant has no such quantity."
    )
    return "\n".join(lines) + "\n"


def claim_rule(claim: dict) -> str:
    """The claim's test in words, e.g. ``gka < 0.5 x dot`` or ``abs(hybrid_sort - dot) <= 0.05``."""
    a, b, test = claim["a"], claim.get("b"), claim["test"]
    if test == "within":
        lo, hi = claim["range"]
        return f"{lo:g} <= {a} <= {hi:g}"
    factor = float(claim.get("factor", 1.0))
    rhs = f"{factor:g} x {b}" if factor != 1.0 else f"{b}"
    if test == "close":
        return f"abs({a} - {rhs}) <= {claim['tolerance']:g}"
    return f"{a} {'<' if test == 'less' else '>'} {rhs}"


def claims_table(claims: list[dict], results: dict) -> str:
    lines = [
        "| claim | source | measurement (mean ± std over seeds) | rule | verdict |",
        "|---|---|---|---|---|",
    ]
    for claim in claims:
        v = verdict(claim, results)
        rule = claim_rule(claim)
        lines.append(
            f"| {claim['claim']} | {claim['source']} | {claim['metric']}: {v['measurement']} | {rule} | "
            f"**{v['verdict']}** |"
        )
    lines.append("")
    lines.append(
        "Verdict rule (recipes/science_report.py): with d the difference in the claimed direction and s = sqrt(s_a^2 + "
        "s_b^2) the seed spread of a difference of single runs, reproduced if d > 2 s (close: |a - b| + 2 s <= tol; "
        "within: mean ± 2 s inside the range), not reproduced if d < -2 s (close: |a - b| - 2 s > tol; within: mean "
        "± 2 s wholly outside), else inconclusive; fewer than 2 seeds is inconclusive; a variant without results is "
        "not run."
    )
    return "\n".join(lines) + "\n"


def _per_layer_table(results: dict, variants: list[str], key, title: str, spec: str) -> str:
    """Per-layer values (``key(run) -> list | None``), mean ± std over seeds per layer."""
    rows = []
    for v in variants:
        per_seed = [key(r) for r in results.get(v, {}).values()]
        per_seed = [p for p in per_seed if p]
        if not per_seed:
            continue
        layers = max(len(p) for p in per_seed)
        cells = [fmt_stat(stats(p[i] for p in per_seed if i < len(p)), spec) for i in range(layers)]
        rows.append((v, cells))
    if not rows:
        return f"{title}: no run measured it yet.\n"
    layers = max(len(c) for _, c in rows)
    lines = [
        f"{title}:",
        "",
        "| variant | " + " | ".join(f"layer {i}" for i in range(layers)) + " |",
        "|" + "---|" * (layers + 1),
    ]
    for v, cells in rows:
        lines.append(f"| {v} | " + " | ".join(cells + [""] * (layers - len(cells))) + " |")
    return "\n".join(lines) + "\n"


def captured_mass_table(results: dict, variants: list[str], k: int | None) -> str:
    rows = {}
    contexts = set()
    for v in variants:
        for r in results.get(v, {}).values():
            cm = (r.get("measurements") or {}).get("captured_mass")
            if not cm or not cm.get("contexts"):
                continue
            kk = k if k is not None else cm["windows"][-1]
            for c in cm["contexts"]:
                contexts.add(c)
                rows.setdefault(v, {}).setdefault(c, []).append(cm["mean_mass"].get(f"{c}:{kk}"))
    if not rows:
        return "Captured mass of the sorted window: no scalar / hybrid run measured it yet.\n"
    contexts = sorted(contexts)
    title = (
        f"Captured mass of the sorted window (k = {k}, per-head windows; mean over layers, heads and queries) "
        "against the context length:"
    )
    lines = [
        title,
        "",
        "| variant | " + " | ".join(str(c) for c in contexts) + " |",
        "|" + "---|" * (len(contexts) + 1),
    ]
    for v, by_context in rows.items():
        lines.append(f"| {v} | " + " | ".join(fmt_stat(stats(by_context.get(c, [])), ".3f") for c in contexts) + " |")
    return "\n".join(lines) + "\n"


def measurements_block(results: dict, variants: list[str], k: int | None) -> str:
    meas = lambda name: lambda r: (r.get("measurements") or {}).get(name)
    parts = [
        _per_layer_table(
            results,
            variants,
            meas("register_mass"),
            "Attention share on the register keys per layer (validation blocks)",
            ".3f",
        ),
        _per_layer_table(
            results,
            variants,
            lambda r: (meas("tau")(r) or {}).get("start"),
            "tau per layer at initialisation",
            ".3f",
        ),
        _per_layer_table(
            results,
            variants,
            lambda r: (meas("tau")(r) or {}).get("end"),
            "tau per layer after training",
            ".3f",
        ),
        _per_layer_table(
            results,
            variants,
            meas("self_weight"),
            "Attention share of each text query on its own key per layer (validation blocks; Llama: not measured)",
            ".3f",
        ),
        _per_layer_table(
            results,
            variants,
            lambda r: (meas("gka_sigma")(r) or {}).get("end"),
            "GKA bandwidth sigma per layer after training (mean over heads)",
            ".3f",
        ),
        captured_mass_table(results, variants, k),
    ]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# figures and the card
# ----------------------------------------------------------------------------------------------------------------


def mean_curve(histories: list[list[dict]]) -> dict:
    """A metrics dict (as ``plotting.curves`` reads) whose rows are the mean over seeds of the losses logged at each
    step by every seed."""
    by_step: dict = {}
    for history in histories:
        for row in history:
            for key in ("loss", "eval_loss"):
                if key in row and "step" in row:
                    by_step.setdefault((row["step"], key), []).append((row[key], row.get("tokens_seen")))
    rows: dict = {}
    for (step, key), values in sorted(by_step.items()):
        if len(values) != len(histories):
            continue  # a step not logged by every seed would mix seeds
        row = rows.setdefault(step, {"step": step, "tokens_seen": values[0][1]})
        row[key] = sum(v for v, _ in values) / len(values)
    return {"log_history": [rows[s] for s in sorted(rows)]}


def comparison_figures(results: dict, comparisons: list[dict], figures_dir: str, prefix: str) -> list[tuple]:
    """One loss-curve PNG per comparison (seed-mean curves of its variants with results); returns ``[(comparison,
    path or None, variants plotted)]``."""
    from recipes.plotting import plot_loss_curves

    out = []
    for comp in comparisons:
        runs = {}
        for v in comp["variants"]:
            histories = [r["log_history"] for r in results.get(v, {}).values() if r.get("log_history")]
            if histories:
                runs[f"{v} (n={len(histories)})"] = mean_curve(histories)
        if not runs:
            out.append((comp, None, []))
            continue
        path = os.path.join(figures_dir, f"{prefix}_{comp['name']}.png")
        plot_loss_curves(
            runs,
            path,
            x="tokens",
            title=comp.get("title", comp["name"]) + " (mean over seeds)",
        )
        out.append((comp, path, list(runs)))
    return out


def figures_block(figures: list[tuple], card_dir: str) -> str:
    lines = []
    for comp, path, plotted in figures:
        title = comp.get("title", comp["name"])
        if path is None:
            lines.append(f"- {title}: not run ({', '.join(comp['variants'])} have no results yet)")
        else:
            rel = os.path.relpath(path, card_dir).replace(os.sep, "/")
            lines.append(f"**{title}**\n\n![{title}]({rel})\n")
    return "\n".join(lines) + "\n"


def fill_blocks(text: str, blocks: dict[str, str]) -> str:
    """Replace the ``<!-- results:science:NAME -->`` blocks of ``text`` (the marker syntax of
    ``recipes/fill_model_cards.py``); a block the text lacks is appended with its markers."""
    from recipes.fill_model_cards import BLOCK

    seen = set()

    def replace(match):
        head, kind, name, _, tail = match.groups()
        if kind != "science" or name not in blocks:
            return match.group(0)
        seen.add(name)
        return head + blocks[name] + tail

    text = BLOCK.sub(replace, text)
    for name, body in blocks.items():
        if name not in seen:
            if not re.fullmatch(r"[a-z_0-9]+", name):
                raise ValueError(f"block name {name!r}: only a-z, 0-9 and _ (the marker syntax)")
            text = text.rstrip("\n") + f"\n\n<!-- results:science:{name} -->\n{body}<!-- /results:science:{name} -->\n"
    return text


__all__ = [
    "CLAIM_TESTS",
    "VERDICTS",
    "check_claim",
    "claim_rule",
    "claims_table",
    "comparison_figures",
    "figures_block",
    "fill_blocks",
    "mean_curve",
    "measurements_block",
    "results_table",
    "stats",
    "variant_stats",
    "verdict",
]
