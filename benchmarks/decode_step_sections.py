"""Where the host time of a dynamic-cache decode step goes, without a profiler: per layer part, per family against
``LlamaForCausalLM`` of the same size, in interleaved rounds.

    PYTHONPATH=. python benchmarks/decode_step_sections.py --out DIR [--case 1x512] [--tokens 33] [--rounds 5]
        [--variants "llama;scalar_sort;hybrid_sort"] [--device cuda] [--size JSON]

Why: ``profile_decode.py``'s profiler adds its own cost to every op (10-20 us on the H200 hosts), so a step with more
ops looks slower in proportion, and its figures disagreed with the unprofiled ones (2026-11-29, call 4: hybrid_sort
15.3 against Llama's 17.6 ms profiled-run ms/token; ``bench_generate.py`` in the next call: hybrid_sort 0.77x Llama).
Here the only instruments are ``time.perf_counter`` pairs: forward hooks on the model, on every direct child of each
decoder layer (``self_attn``, ``mlp``, the norms) and on the attention's ``o_proj``, and wrappers around a few
methods (the attention's ``project`` / ``temperature`` / ``attend_with_prefix`` ..., the caches' ``update`` /
``append`` / ``exact_view`` / ``end_step``, Llama's ``apply_rotary_pos_emb``).  Nothing synchronises: a time is what
the host spent issuing that part, plus any wait for the GPU that part causes (a device-to-host copy, a pageable
host-to-device copy), which is what a host-bound step is made of.

Per model and round: ``generate`` of 1 and of ``--tokens`` new tokens with the instruments, and the same two without
them; every figure is the difference of the long and the short call over ``tokens - 1`` (the prefill and the first
token cancel).  ``step ms`` is the uninstrumented time per token, ``instrumented`` the same with the hooks (their
own cost is the difference); ``forward`` the model's forward, ``outside forward`` what ``generate`` does around it.
Part figures are per layer (the sum over layers / layers) in microseconds, inclusive of their children; "layer,
own" is the layer's time less its children's.  Rounds interleave the models (rotated order), and each figure is the
median over the rounds.  Writes ``sections.json`` and ``sections.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import SIZE, build, parse_variant  # noqa: E402
from decoder_settings import decoder_settings  # noqa: E402
from profile_decode import _generate  # noqa: E402  (seconds of one greedy generate of N tokens, synchronised)

# methods of the attention modules timed where a module has them (per instance: a subclass's override is what runs)
ATTENTION_METHODS = (
    "project",
    "_project",
    "temperature",
    "register_forward",
    "sink_entries",
    "attend_with_prefix",
    "_attend_sorted",
    "_exact_over_cache",
    "_decode_directly",
)
# "module:Class.method" or "module:function" patched for the run (what the calls look up: the class attribute, or
# the module global its callers read); a name missing from the installed versions is skipped
PATCHED = (
    "transformers.cache_utils:DynamicLayer.update",
    "transformers.models.llama.modeling_llama:apply_rotary_pos_emb",
    "hf_rbf.cache_sorted_scalar:SortedScalarCacheLayer.append",
    "hf_rbf.cache_sorted_scalar:SortedScalarCacheLayer.exact_view",
    "hf_rbf.cache_sorted_scalar:SortedScalarCacheLayer.end_step",
    "hf_rbf.attention_distance_triton:distance_decode",
    "hf_rbf.modeling_hybrid_sort:hybrid_attention_triton",
    "hf_rbf.modeling_scalar_sort:scalar_attention_triton",
    "hf_rbf.modeling_decoder:apply_rotary",
    "hf_rbf.modeling_decoder:project_together",
)


class Sections:
    """Accumulated host seconds per section name (inclusive), and call counts."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self._starts: dict[int, list[float]] = defaultdict(list)

    def start(self, key: int) -> None:
        self._starts[key].append(time.perf_counter())

    def stop(self, key: int, name: str) -> None:
        self.seconds[name] += time.perf_counter() - self._starts[key].pop()
        self.calls[name] += 1

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed

    def snapshot(self) -> dict:
        return {k: (self.seconds[k], self.calls[k]) for k in self.seconds}


def _hook(sections: Sections, module: torch.nn.Module, name: str) -> list:
    key = id(module)
    return [
        module.register_forward_pre_hook(lambda m, a: sections.start(key)),
        module.register_forward_hook(lambda m, a, o: sections.stop(key, name)),
    ]


@contextlib.contextmanager
def instrumented(model: torch.nn.Module, sections: Sections):
    """Hooks and wrappers of the module docstring, removed on exit."""
    handles = _hook(sections, model, "forward")
    base = getattr(model, "model", model)
    for child in ("embed_tokens", "norm"):
        if isinstance(getattr(base, child, None), torch.nn.Module):
            handles += _hook(sections, getattr(base, child), child)
    if isinstance(getattr(model, "lm_head", None), torch.nn.Module):
        handles += _hook(sections, model.lm_head, "lm_head")
    instance_patches = []
    for layer in base.layers:
        handles += _hook(sections, layer, "layer")
        for name, child in layer.named_children():
            handles += _hook(sections, child, name)
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        # (only the output projection: a hook on an input projection would make `project_together` call the
        # projections one by one instead of its one GEMM, another path than the one measured)
        if isinstance(getattr(attn, "o_proj", None), torch.nn.Module):
            handles += _hook(sections, attn.o_proj, "self_attn.o_proj")
        for meth in ATTENTION_METHODS:
            fn = getattr(attn, meth, None)
            if callable(fn) and not isinstance(fn, torch.nn.Module):
                setattr(attn, meth, sections.wrap(fn, f"self_attn.{meth}()"))
                instance_patches.append((attn, meth))
    global_patches = []
    for spec in PATCHED:
        module_name, _, qual = spec.partition(":")
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attr):
            continue
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        label = f"{qual}()"
        setattr(owner, attr, sections.wrap(original, label))
        global_patches.append((owner, attr, original))
    try:
        yield sections
    finally:
        for h in handles:
            h.remove()
        for obj, meth in instance_patches:
            del obj.__dict__[meth]
        for owner, attr, original in global_patches:
            setattr(owner, attr, original)


def measure(model, ids, tokens: int, device: str) -> dict:
    """One round of one model: the figures of the module docstring, per generated token (ms) / per layer (us)."""
    plain = _generate(model, ids, tokens, device) - _generate(model, ids, 1, device)
    snaps, walls = [], []
    for n in (1, tokens):
        sections = Sections()
        with instrumented(model, sections):
            walls.append(_generate(model, ids, n, device))
        snaps.append(sections.snapshot())
    per = tokens - 1
    short, long = snaps
    diff = {k: (v[0] - short.get(k, (0.0, 0))[0], (v[1] - short.get(k, (0.0, 0))[1]) / per) for k, v in long.items()}
    layers = len(getattr(model, "model", model).layers)
    row = dict(
        step_ms=1e3 * plain / per,
        instrumented_ms=1e3 * (walls[1] - walls[0]) / per,
        forward_ms=1e3 * diff.get("forward", (0.0, 0))[0] / per,
    )
    row["outside_forward_ms"] = row["instrumented_ms"] - row["forward_ms"]
    parts = {}
    for name, (seconds, calls) in diff.items():
        if name == "forward":
            continue
        per_layer = name not in ("embed_tokens", "norm", "lm_head")
        parts[name] = dict(
            us=1e6 * seconds / per / (layers if per_layer else 1), calls_per_token=calls, per_layer=per_layer
        )
    children = [k for k in parts if k != "layer" and "." not in k and not k.endswith("()") and parts[k]["per_layer"]]
    if "layer" in parts:
        parts["layer, own"] = dict(
            us=parts["layer"]["us"] - sum(parts[k]["us"] for k in children), calls_per_token=0, per_layer=True
        )
    if "self_attn" in parts:
        attn_children = [k for k in parts if k.startswith("self_attn.") and not k.endswith("()")]
        parts["self_attn, own"] = dict(
            us=parts["self_attn"]["us"] - sum(parts[k]["us"] for k in attn_children), calls_per_token=0,
            per_layer=True,
        )
    row["parts"] = parts
    return row


def median_rows(rounds: list[dict]) -> dict:
    """The median over the rounds of every figure (a part missing from a round counts as absent there)."""
    out = {k: statistics.median(r[k] for r in rounds) for k in ("step_ms", "instrumented_ms", "forward_ms",
                                                                 "outside_forward_ms")}
    names = {name for r in rounds for name in r["parts"]}
    out["parts"] = {}
    for name in names:
        vals = [r["parts"][name] for r in rounds if name in r["parts"]]
        out["parts"][name] = dict(
            us=statistics.median(v["us"] for v in vals),
            calls_per_token=statistics.median(v["calls_per_token"] for v in vals),
            per_layer=vals[0]["per_layer"],
        )
    return out


def to_markdown(res: dict) -> str:
    rows = [r for r in res["rows"] if "error" not in r]
    lines = [
        f"# Host time of a dynamic-cache decode step by part ({res['device']}, torch {res['torch']}, transformers "
        f"{res['transformers']}; case {res['case']}, {res['tokens']} tokens less 1, median of {res['rounds']} "
        "interleaved rounds)",
        "",
        "| model | step ms | instrumented ms | forward ms | outside forward ms |",
        "|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][:150]} | | | |")
            continue
        m = r["median"]
        lines.append(
            f"| {r['variant']} | {m['step_ms']:.2f} | {m['instrumented_ms']:.2f} | {m['forward_ms']:.2f} | "
            f"{m['outside_forward_ms']:.2f} |"
        )
    first = rows[0]["median"]["parts"] if rows else {}
    names = sorted({n for r in rows for n in r["median"]["parts"]},
                   key=lambda n: (not first.get(n, {}).get("per_layer", True), n))
    lines += [
        "",
        "Per layer (or per step: embed_tokens, norm, lm_head), host us per token, inclusive (calls per token):",
        "",
        "| part | " + " | ".join(r["variant"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for name in names:
        cells = []
        for r in rows:
            p = r["median"]["parts"].get(name)
            cells.append("" if p is None else f"{p['us']:.1f} ({p['calls_per_token']:.0f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", default="1x512", help="BATCHxPROMPT")
    ap.add_argument("--tokens", type=int, default=33, help="generated tokens of the long call (the short one: 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="llama;scalar_sort;hybrid_sort")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default=None, help="JSON of config overrides (default: bench_generate's d768 L12 H12)")
    args = ap.parse_args()
    if args.tokens < 2:
        raise ValueError(f"--tokens must be >= 2, got {args.tokens}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = dict(SIZE, **json.loads(args.size)) if args.size else dict(SIZE)
    batch, prompt = (int(x) for x in args.case.split("x"))
    ids = torch.randint(2, size["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    import transformers

    variants = args.variants.split(";")
    models, errors = {}, {}
    for variant in variants:
        try:
            models[variant] = build(variant, prompt + args.tokens + 8, args.device, size)
            with decoder_settings(parse_variant(variant)[2]):
                _generate(models[variant], ids, 4, args.device)  # compile and tune
        except Exception as err:  # noqa: BLE001  (a failing family must not hide the others)
            errors[variant] = f"{type(err).__name__}: {err}"[:400]
    rounds = defaultdict(list)
    live = [v for v in variants if v in models]
    for k in range(args.rounds):
        for variant in live[k % len(live):] + live[: k % len(live)]:
            with decoder_settings(parse_variant(variant)[2]):
                rounds[variant].append(measure(models[variant], ids, args.tokens, args.device))
        print(json.dumps({v: round(rounds[v][-1]["step_ms"], 3) for v in live}), flush=True)
    res = dict(
        device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        case=args.case,
        tokens=args.tokens,
        rounds=args.rounds,
        rows=[dict(variant=v, error=errors[v]) if v in errors else dict(variant=v, median=median_rows(rounds[v]),
                                                                          rounds=rounds[v]) for v in variants],
    )
    (out / "sections.json").write_text(json.dumps(res, indent=1))
    text = to_markdown(res)
    (out / "sections.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
