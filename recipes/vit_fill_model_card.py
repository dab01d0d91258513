"""Fill the GKA ViT model card's result tables from results files (nothing typed by hand).

    PYTHONPATH=$PWD python recipes/vit_fill_model_card.py \\
        --cpu-results model_cards/gka_vit_results/cpu_quick --gpu-results model_cards/gka_vit_results/gpu

The card (``--card``, default ``model_cards/gka_vit.md``) holds blocks between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->``; each block is rewritten from its source and the rest of the card is left alone:

* ``accounting``: parameters and FLOPs of Ti/S/B (and the MNIST size) beside the paper, computed from the models by
  ``recipes/vit_accounting.py`` (or read from ``--accounting`` JSON);
* ``mnist_cpu`` / ``mnist_gpu``: GKA vs DeiT on MNIST from ``--cpu-results`` / ``--gpu-results``, folders holding
  ``gka/results.json`` and ``dot/results.json`` (as ``recipes/train_vit.py`` writes them) or ``gka_results.json``
  and ``dot_results.json`` (as ``recipes/gpu_vit_mnist.sh`` returns them).

A block whose source is not given keeps its current content.  ``--output`` writes the filled card elsewhere;
``--summary`` also writes the MNIST table(s) alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def load_results(folder: str) -> list[dict]:
    """The gka and dot results.json of a run folder (either layout), in that order."""
    out = []
    for kind in ("gka", "dot"):
        for path in (os.path.join(folder, kind, "results.json"), os.path.join(folder, f"{kind}_results.json")):
            if os.path.exists(path):
                with open(path) as f:
                    out.append(json.load(f))
                break
    if not out:
        raise FileNotFoundError(f"no gka/dot results.json (or *_results.json) in {folder}")
    return out


def _fmt(v, spec, scale=1.0):
    return "n/a" if v is None else format(v * scale, spec)


def results_table(results: list[dict]) -> str:
    head = (
        "| model | params (M) | attention params (M) | test accuracy (%) | test loss | train images/s | "
        "inference images/s (batch) | train peak GPU memory (MiB) | inference peak GPU memory (MiB) | "
        "train time (s) |\n" + "|---" * 10 + "|\n"
    )
    rows = ""
    for r in results:
        inf = r["inference"]
        name = {"gka": "GKA", "dot": "DeiT (dot)"}[r["attention_type"]]
        rows += (
            f"| {name} | {r['parameters']['total'] / 1e6:.3f} | {r['parameters']['attention'] / 1e6:.3f} | "
            f"{_fmt(r['test_accuracy'], '.2f', 100)} | {_fmt(r['test_loss'], '.4f')} | "
            f"{r['train_images_per_s']:.0f} | {inf['images_per_s']:.0f} ({inf['batch_size']}) | "
            f"{_fmt(r.get('train_peak_memory_mb'), '.0f')} | {_fmt(inf.get('peak_memory_mb'), '.0f')} | "
            f"{r['train_time_s']:.0f} |\n"
        )
    r0 = results[0]
    cfg = r0["config"]
    setup = (
        f"\nSetup: preset `{r0['preset']}` (image {cfg['image_size']}, patch {cfg['patch_size']}, "
        f"D {cfg['hidden_size']}, "
        f"L {cfg['num_hidden_layers']}, H {cfg['num_attention_heads']}, MLP {cfg['intermediate_size']}, drop path "
        f"{cfg['drop_path_rate']}); {r0['train_examples']:,} train / {r0['test_examples']:,} test images, "
        f"{r0['epochs']:g} epochs, batch {r0['batch_size']}, peak lr {r0['learning_rate']:g}, "
        f"{r0['optimizer_steps']} optimizer steps; device: {r0['device']}; bf16 autocast: {r0['bf16']}; "
        f"versions: " + ", ".join(f"{k} {v}" for k, v in r0.get("versions", {}).items()) + ".\n"
        "Train images/s counts the whole `Trainer.train()` (data loading and logging included); inference images/s "
        "is the forward pass alone at the given batch (after warm-up).  Peak memory is `torch.cuda."
        "max_memory_allocated` (n/a on the CPU).\n"
    )
    commands = []
    for r in results:
        c = r.get("command")
        if c and c.startswith("recipes/"):
            c = "PYTHONPATH=$PWD python " + c
        if c and c not in commands:
            commands.append(c)
    cmds = "".join(f"\n    {c}" for c in commands)
    gka = next((r for r in results if r["attention_type"] == "gka" and r.get("learned_log_sigma")), None)
    sig = ""
    if gka:
        import math

        sig = "\nLearned sigma of the GKA model (layers x heads): " + "; ".join(
            "[" + ", ".join(f"{math.exp(v):.2f}" for v in layer) + "]" for layer in gka["learned_log_sigma"]
        ) + ".\n"
    return head + rows + setup + sig + ("\nCommands (as recorded in results.json):\n" + cmds + "\n" if cmds else "")


def accounting_table(path: str | None) -> str:
    import vit_accounting

    if path:
        with open(path) as f:
            rows = json.load(f)
    else:
        rows = [vit_accounting.account(p, k) for p in ("tiny", "small", "base", "mnist") for k in ("dot", "gka")]
    return vit_accounting.to_markdown(rows) + "\n" + vit_accounting.NOTES


def replace_block(text: str, name: str, content: str) -> str:
    pattern = re.compile(rf"(<!-- {re.escape(name)}:start -->\n).*?(<!-- {re.escape(name)}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"the card has no <!-- {name}:start --> ... <!-- {name}:end --> block")
    return pattern.sub(lambda m: m.group(1) + content.rstrip("\n") + "\n" + m.group(2), text, count=1)


def main(argv=None):
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--card", default=os.path.join(here, "model_cards", "gka_vit.md"))
    ap.add_argument("--output", default=None, help="write the filled card here (default: overwrite --card)")
    ap.add_argument("--cpu-results", default=None)
    ap.add_argument("--gpu-results", default=None)
    ap.add_argument("--accounting", default=None, help="vit_accounting.json (default: computed from the models)")
    ap.add_argument("--no-accounting", action="store_true", help="leave the accounting block as it is")
    ap.add_argument("--summary", default=None, help="also write the MNIST result table(s) to this file")
    args = ap.parse_args(argv)
    with open(args.card) as f:
        text = f.read()
    summary = ""
    if not args.no_accounting:
        text = replace_block(text, "accounting", accounting_table(args.accounting))
    for name, folder in (("mnist_cpu", args.cpu_results), ("mnist_gpu", args.gpu_results)):
        if folder:
            try:
                table = results_table(load_results(folder))
            except FileNotFoundError:
                # only the run's own summary.md came back (the JSON files were not returned): use its table as is
                path = os.path.join(folder, "summary.md")
                if not os.path.exists(path):
                    raise
                with open(path) as f:
                    table = "".join(line for line in f if not line.startswith("<!--") and not line.startswith("     "))
            text = replace_block(text, name, table)
            summary += table + "\n"
    out = args.output or args.card
    with open(out, "w") as f:
        f.write(text)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(summary)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
