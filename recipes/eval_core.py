"""CORE evaluation (DCLM's in-context-learning suite, scored as nanochat does) of any causal LM.

    python recipes/eval_core.py --model <dir or hub name> --bundle <dir> [--tasks a,b,...] [--max-per-task N]
        [--batch-size B] [--baselines v1|v2] [--device cpu|cuda] [--dtype auto|float32|bfloat16|float16]
        [--trust-remote-code] [--output results.json]

With the project's bundle (``shared/data/core``: 20 of the 22 tasks, squad and coqa are missing) the mean is
reported as "CORE-20".  Also importable: ``from recipes.eval_core import eval_core``.  See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


try:
    import hf_rbf  # noqa: F401  (registers the project's models with the Auto classes)
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_rbf.eval.core import evaluate_core, format_table  # noqa: E402
from hf_rbf.eval.loading import load_model_and_tokenizer  # noqa: E402


def eval_core(
    model: str,
    bundle: str,
    *,
    tasks: list[str] | None = None,
    max_per_task: int = -1,
    batch_size: int = 16,
    baselines: str = "v1",
    meta_csv: str | None = None,
    max_seq_len: int | str | None = "auto",
    bos="auto",
    device: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    output: str | None = None,
    log=print,
) -> dict:
    """Load ``model`` (folder or hub name), evaluate it on ``bundle`` and optionally write the JSON to ``output``.

    Returns :func:`hf_rbf.eval.core.evaluate_core`'s dict with ``model`` added.
    """
    lm, tokenizer = load_model_and_tokenizer(model, device, dtype, trust_remote_code)
    out = evaluate_core(
        lm,
        tokenizer,
        bundle,
        tasks=tasks,
        max_per_task=max_per_task,
        batch_size=batch_size,
        baselines=baselines,
        meta_csv=meta_csv,
        max_seq_len=max_seq_len,
        bos=bos,
        device=next(lm.parameters()).device,
        log=log,
    )
    out = {"model": model, **out}
    out["settings"]["dtype"] = str(next(lm.parameters()).dtype)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out


def _max_seq_len(value: str):
    if value == "auto":
        return "auto"
    if value == "none":
        return None
    return int(value)


def _bos(value: str):
    return value if value in ("auto", "none") else int(value)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder or hub name (AutoModelForCausalLM)")
    p.add_argument("--bundle", required=True, help="eval bundle folder (core.yaml, eval_data/, meta CSVs)")
    p.add_argument("--tasks", default=None, help="comma-separated task labels (default: all tasks with data)")
    p.add_argument("--max-per-task", type=int, default=-1, help="examples per task after the seed-1337 shuffle (-1: all)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--baselines", choices=["v1", "v2"], default="v1",
                   help="random baselines: v1 (nanochat, default) or v2 (DCLM Core_v2)")
    p.add_argument("--meta-csv", default=None, help="take the baselines from this DCLM eval_meta_data CSV")
    p.add_argument("--max-seq-len", type=_max_seq_len, default="auto",
                   help="left-crop prompts to this many tokens: auto (model config), none, or an int")
    p.add_argument("--bos", type=_bos, default="auto", help="token prepended to prompts: auto (BOS else EOS), none, or an id")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modeling code")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    out = eval_core(
        args.model,
        args.bundle,
        tasks=tasks,
        max_per_task=args.max_per_task,
        batch_size=args.batch_size,
        baselines=args.baselines,
        meta_csv=args.meta_csv,
        max_seq_len=args.max_seq_len,
        bos=args.bos,
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        output=args.output,
    )
    print(format_table(out))
    return out


if __name__ == "__main__":
    main()
