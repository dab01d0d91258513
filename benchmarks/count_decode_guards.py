"""What Dynamo guards on in the compiled decode step of ``generate(..., cache_implementation="static")``: guarded
tensors, every leaf guard by kind, and the time one check of the guards takes, for tiny models of 2, 4 and 12 layers
(Llama with transformers' ``StaticCache`` as the yardstick, rbf and gka with ``StaticKeyValueLayer``, scalar_sort
with ``StaticSortedLayer`` on its torch and its fused Triton decode step, hybrid_sort).

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/count_decode_guards.py [--layers 2,4,12]
        [--variants llama,rbf,gka,scalar_sort,scalar_sort_triton,hybrid_sort] [--iters 20000] [--out DIR]
        [--compile transformers|eager] [--json PATH] [--verbose]
    # on a GPU: the d768 models, transformers' own compile of the decode step, and ms per generated token
    python benchmarks/count_decode_guards.py --device cuda --size d768 --layers 12 --no-interpret \
        --variants llama,scalar_sort,rbf [--prompt 512] [--new-tokens 33]

Why: on an H100, the host time of a batch-1 decode step of the scalar_sort family (d768, 12 layers, 512k-token cache)
was about 1.2 ms, of which ``TorchDynamo Cache Lookup`` (the guards of the compiled step) took 474 us: 270 guarded
tensors against Llama's 150 (issue 13).  ``generate`` waits for every step's token, so this host time is on the
critical path.

How: each model runs ``generate`` (a 5-token prompt, 8 new tokens, greedy) with the static cache and the decode step
compiled as transformers compiles it (``--compile transformers``, the default: ``torch.compile(model.__call__,
**CompileConfig().to_dict())`` from ``get_compiled_call``, i.e. inductor, "reduce-overhead", ``fullgraph=False``,
``dynamic=None``; on the CPU ``_compile_all_devices`` lets ``generate`` compile at all, and "reduce-overhead" has no
CUDA graphs there; the guards are the same).  ``--compile eager`` (``CompileConfig(backend="eager", fullgraph=True,
mode=None)``) builds the same guard tree in seconds instead of an inductor compile per model (checked: 1363 / 1699 leaf
guards for Llama / scalar_sort, 12 tiny layers, with either).  ``torch._dynamo.guards.guard_manager_testing_hook_fn``
hands over the guard manager of the decode step and the frame's locals it was built for.  Reported per model:

* ``tensors``: the ``TENSOR_MATCH`` guards (one per tensor the step reads from its inputs: parameters, buffers, the
  cache's tensors, the inputs), and how many of them belong to the cache (their source goes through the cache);
* ``guards``: every leaf guard of the tree by kind (``NO_TENSOR_ALIASING``, ``DIMENSION_DYNAMIC_MARKING_GUARD``,
  ``ID_MATCH``, ...);
* ``check_us``: microseconds per ``guard_manager.check(frame locals)`` (the C++ guard tree), the fastest of 20
  rounds of ``--iters / 20`` calls on this CPU (``check_us_median``: their median): the part of ``TorchDynamo Cache
  Lookup`` that grows with the guards;
* ``lookup_us``: the median ``TorchDynamo Cache Lookup`` (torch.profiler) of the decode steps of 3 more ``generate``
  calls of the same length (the compiled step warm): the guards as a step meets them, after the step's other work has
  left the CPU's caches cold (with the same guard tree it is 2-3x ``check_us`` on this CPU; the H200 profile's 233
  us per token for scalar_sort is this number);
* ``recompiles``: guard trees built for a frame beyond the first (the decode step must compile once);
* ``per_layer``: the growth of each count per layer between the smallest and the largest model.

``--host-step ROUNDS`` measures something else instead: host microseconds per generated token of static ``generate``
with the step compiled but its graph replaced by the outputs of its first call (``generate``'s Python per step, the
guards and the compiled frame's bytecode, not the graph's work), the models interleaved; writes ``host_step.json`` /
``host_step.md``.  ``--interleave ROUNDS`` (one ``--layers``): every model stays compiled, and ``check_us`` /
``lookup_us`` come from ROUNDS rounds that visit the models in turn (a block of checks, one profiled ``generate``
each), so a change of the machine's speed during the run reaches every model alike.  ``--out DIR`` writes
``guards.json`` (every row) and ``guards.md`` (the table).

Only the decode step's cache entry is read (the last compiled one); the prefill runs eagerly, as in ``generate``.

``--device cuda``: the models in bfloat16 on the GPU (``--size d768``: the d768 / 12-head models of
``bench_generate.py``, ``--layers`` deep, a ``--prompt``-token prompt; the sorted families with ``decode_window``
64) and ``generate`` with transformers' own ``compile_config`` (inductor, CUDA graphs: what a user gets); the
scalar_sort variants there take "auto", the fused step.  Also ``ms_per_token``: ``(t(n) - t(1)) / (n - 1)`` of
static ``generate`` calls, ``n = --new-tokens``, the best of 3 after a warm-up (batch 1: the host time of a step,
guards included, is on the critical path).

Measured (issue 13; before = one tensor per layer and buffer kind, after = ``StackedBuffers``):

* every family against Llama, transformers' compile, the hybrid's per-head lists, the lookup inside ``generate`` and
  the null-graph host step: ``benchmarks/results/cpu-guards-2026-11-28/README.md``;

* this 2-core CPU, torch 2.13, transformers 5.24, 12 tiny layers (``--layers 2,4,12``; check us: the fastest round,
  two interleaved runs): guarded tensors / of the cache / check us: Llama 151 / 36 / 75-77 (unchanged); scalar_sort
  (torch step) 258 / 121 / 97-99 -> 148 / 11 / 80; scalar_sort (fused step) 270 / 133 / 108-110 -> 149 / 12 / 78-81;
  rbf 199 / 61 / 84-86 -> 144 / 6 / 76-77.  Per layer the step now guards its parameters only (11 tensors: scalar_sort,
  rbf; 12 with Llama's 3 cache tensors).
* an H100 host, torch 2.11, transformers 5.17, d768 scalar_sort, 12 layers, fused step (``--device cuda --size d768
  --layers 12 --variants scalar_sort --prompt 64 --new-tokens 9``, one run each): 271 -> 150 guarded tensors (cache
  133 -> 12), 2077 -> 1808 leaf guards, check 64.6 -> 41.9 us (median 78.1 -> 46.9); ms per token 1.34 -> 1.38
  (8 decode steps, best of 3: the ~25-30 us saved is within that measurement's noise).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

if not os.environ.get("TRITON_INTERPRET") and "--no-interpret" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # the fused sorted step on the CPU (read when triton is first imported)

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64)
D768 = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_attention_heads=12)
VARIANTS = ("llama", "rbf", "gka", "scalar_sort", "scalar_sort_triton", "hybrid_sort")
NEW_TOKENS = 8  # new tokens of the CPU's generate calls (the guard capture and the profiled call: the same cache)


def build(variant: str, layers: int, device: str = "cpu", size: str = "tiny", positions: int = 64, heads=None):
    """A model of ``variant`` with ``layers`` layers (random weights, greedy, no EOS): tiny float32 on the CPU, or
    ``size`` on ``device`` (bfloat16 on CUDA); ``heads``: that many heads of the tiny model's head dim (8)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_rbf  # noqa: F401

    torch.manual_seed(0)
    dims = dict(TINY if size == "tiny" else D768, max_position_embeddings=positions)
    if heads is not None:
        dims.update(num_attention_heads=heads, hidden_size=8 * heads, intermediate_size=16 * heads)
    window = 4 if size == "tiny" else 64
    if variant == "llama":
        model = LlamaForCausalLM(LlamaConfig(**dims, num_hidden_layers=layers))
    else:
        family = variant.removesuffix("_triton")
        extra = {"decode_window": window} if family in ("scalar_sort", "hybrid_sort") else {}
        if device == "cpu":
            extra["attention_backend"] = "naive"
        cfg = AutoConfig.for_model(family, **dims, num_hidden_layers=layers, **extra)
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return model.to(device, dtype).eval()


def walk(manager, counts: collections.Counter, tensors: list) -> None:
    """Count the leaf guards of a guard-manager tree by kind; collect the sources of the tensor guards."""
    for leaf in manager.get_leaf_guards():
        kind = type(leaf).__name__
        counts[kind] += 1
        if kind == "TENSOR_MATCH":
            tensors.append(manager.get_source())
    children = list(manager.get_child_managers())
    if hasattr(manager, "get_key_value_managers"):  # a DictGuardManager's entries (e.g. a module's `_parameters`)
        for key_manager, value_manager in manager.get_key_value_managers().values():
            children += [m for m in (key_manager, value_manager) if m is not None]
    for child in children:
        walk(child, counts, tensors)


def compile_config(model, how: str = "transformers"):
    """The ``compile_config`` to pass to ``generate``: None on CUDA with ``how="transformers"`` (transformers' own
    default, ``CompileConfig()``); elsewhere that default (or the eager backend) with ``_compile_all_devices``."""
    from transformers import CompileConfig

    if how == "transformers":
        if model.device.type == "cuda":
            return None
        config = CompileConfig()  # what `get_compiled_call` compiles with when none is given
    elif how == "eager":
        config = CompileConfig(backend="eager", fullgraph=True, mode=None)
    else:
        raise ValueError(f"compile: 'transformers' or 'eager', not {how!r}")
    config._compile_all_devices = True  # the CPU compiles only when told to
    return config


def generate_kwargs(model, variant: str, new_tokens: int, how: str = "transformers") -> dict:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    if variant.endswith("_triton"):
        kwargs["cache_config"] = {"static_decode_backend": "triton"}
    config = compile_config(model, how)
    if config is not None:
        kwargs["compile_config"] = config
    return kwargs


class GuardCapture:
    """While active, every guard tree Dynamo builds: ``(guard manager, frame locals, code)``, in order."""

    def __init__(self):
        self.trees = []

    def __enter__(self):
        import torch._dynamo.guards as guards

        self.previous = guards.guard_manager_testing_hook_fn
        guards.guard_manager_testing_hook_fn = self._hook
        return self

    def _hook(self, manager, scope, builder):
        self.trees.append((manager, dict(scope), getattr(builder, "f_code", None)))

    def __exit__(self, *exc):
        import torch._dynamo.guards as guards

        guards.guard_manager_testing_hook_fn = self.previous

    @property
    def recompiles(self) -> int:
        """Guard trees built for a code object that already had one (graph breaks' frames are not recompiles)."""
        return len(self.trees) - len({id(code) for _, _, code in self.trees})


def decode_step_guards(
    model, variant: str, ids: torch.Tensor, new_tokens: int, how: str = "transformers", reset: bool = True
):
    """Run a static ``generate`` with the decode step compiled; return ((guard manager, frame locals) of the step,
    the number of guard trees built, the capture)."""
    if reset:
        torch._dynamo.reset()
    with GuardCapture() as capture, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs(model, variant, new_tokens, how))
    if not capture.trees:  # no compiled step, or a torch without the hook
        return (None, None), 0, capture
    manager, scope, _ = capture.trees[-1]
    return (manager, scope), len(capture.trees), capture


def lookup_us(
    model, variant: str, ids: torch.Tensor, new_tokens: int, how: str = "transformers", calls: int = 3, raw=False
):
    """Median ``TorchDynamo Cache Lookup`` microseconds (torch.profiler) over the decode steps of ``calls`` static
    ``generate`` calls (the step compiled by an earlier call of the same length): the guard evaluation as ``generate``
    meets it, between steps whose other work leaves the host caches cold."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            model.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs(model, variant, new_tokens, how))
    times = [e.cpu_time_total for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]
    if raw:
        return times
    return round(statistics.median(times), 1) if times else None


def ms_per_token(model, variant: str, ids: torch.Tensor, new_tokens: int, how: str = "transformers") -> float:
    """``(t(n) - t(1)) / (n - 1)`` ms of static ``generate`` calls (the compiled step warm), the best of 3."""

    def timed(n: int) -> float:
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs(model, variant, n, how))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(new_tokens)  # warm (the cache of the right capacity, CUDA graphs recorded)
    best = []
    for _ in range(3):
        t1, tn = timed(1), timed(new_tokens)
        best.append((tn - t1) / (new_tokens - 1) * 1e3)
    return min(best)


def time_check(manager, scope: dict, iters: int) -> tuple[float, float]:
    """Microseconds per ``manager.check(scope)`` (under ``no_grad``, as the step was compiled): the fastest and the
    median of 20 rounds of ``iters / 20`` calls (the fastest round is the one least disturbed by other processes on a
    shared machine)."""
    if not manager.check(scope):
        raise RuntimeError(f"the guards fail on the locals they were built for: {manager.check_verbose(scope)}")
    rounds = []
    n = max(1, iters // 20)
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(n):
            manager.check(scope)
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return min(rounds), statistics.median(rounds)


def measure(
    variant: str,
    layers: int,
    iters: int,
    verbose: bool = False,
    device: str = "cpu",
    size: str = "tiny",
    prompt: int = 5,
    new_tokens: int = NEW_TOKENS,
    how: str = "transformers",
    lookup: bool = True,
    keep: list | None = None,
) -> dict:
    model = build(variant, layers, device, size, positions=max(64, prompt + new_tokens + 8))
    ids = torch.randint(2, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)
    (manager, scope), compiles, capture = decode_step_guards(model, variant, ids, new_tokens, how, keep is None)
    counts, tensors = collections.Counter(), []
    if manager is None:
        print(f"{variant}: no guard manager captured (no compiled decode step, or no guard_manager_testing_hook_fn)")
    else:
        walk(manager.root, counts, tensors)
    cache_tensors = [s for s in tensors if "['cache']" in s or "['past_key_values']" in s]
    row = {
        "variant": variant,
        "layers": layers,
        "compile": how,
        "compiled_frames": compiles,
        "tensors": len(tensors),
        "cache_tensors": len(cache_tensors),
        "guards": sum(counts.values()),
        "by_kind": dict(sorted(counts.items())),
        "check_us": None,
        "check_us_median": None,
        "lookup_us": None,
    }
    if manager is not None:
        with torch.no_grad():
            best, median = time_check(manager, scope, iters)
        row["check_us"], row["check_us_median"] = round(best, 2), round(median, 2)
    with GuardCapture() as later:
        if lookup and manager is not None:
            row["lookup_us"] = lookup_us(model, variant, ids, new_tokens, how)
        if device == "cuda":
            row["ms_per_token"] = round(ms_per_token(model, variant, ids, new_tokens, how), 4)
    row["recompiles"] = capture.recompiles + len(later.trees)  # the later calls must reuse the step
    if verbose:
        row["cache_tensor_sources"] = cache_tensors
    if keep is not None:  # --interleave: the model and its compiled step stay for the interleaved rounds
        keep.append((row, model, ids, manager, scope))
        return row
    del manager, scope, capture
    torch._dynamo.reset()
    return row


def interleaved(kept: list, rounds: int, iters: int, new_tokens: int, how: str) -> None:
    """``rounds`` rounds over the kept models, each round a timed block of guard checks and one profiled
    ``generate`` per model in turn, so that a drift of the machine's speed (other processes, clocks) reaches every
    model alike; the rows get the medians over the rounds (``check_us_median``, ``lookup_us``)."""
    checks = {id(k[0]): [] for k in kept}
    lookups = {id(k[0]): [] for k in kept}
    n = max(1, iters // rounds)
    with GuardCapture() as later, torch.no_grad():
        for _ in range(rounds):
            for row, model, ids, manager, scope in kept:
                if manager is None:
                    continue
                start = time.perf_counter()
                for _ in range(n):
                    manager.check(scope)
                checks[id(row)].append((time.perf_counter() - start) / n * 1e6)
                lookups[id(row)] += lookup_us(model, row["variant"], ids, new_tokens, how, calls=1, raw=True)
    for row, *_ in kept:
        if checks[id(row)]:
            row["check_us"] = round(min(checks[id(row)]), 2)
            row["check_us_median"] = round(statistics.median(checks[id(row)]), 2)
            row["lookup_us"] = round(statistics.median(lookups[id(row)]), 1)
            row["lookup_samples"] = len(lookups[id(row)])
    for row, *_ in kept:
        row["recompiles"] += len(later.trees)  # (not told apart by model: any is a failure)


def host_step_us(variants: list[str], layers: int, rounds: int, new_tokens: int = 41, device: str = "cpu",
                 size: str = "tiny") -> dict:
    """Host microseconds per generated token of static ``generate`` with the decode step compiled by Dynamo but its
    graph replaced by the outputs of its first call (a "null graph"): ``generate``'s per-step Python, the cache
    lookup (guards) and the compiled frame's own bytecode, without the graph's work.  ``(t(n) - t(1)) / (n - 1)``,
    the models' calls interleaved over ``rounds`` rounds; median and fastest round per model."""
    from transformers import CompileConfig

    def null_backend():
        outs = {}

        def backend(gm, example_inputs):
            def run(*args):
                if "out" not in outs:
                    outs["out"] = gm(*args)
                return outs["out"]

            return run

        return backend

    torch._dynamo.reset()
    models = {}
    for variant in sorted(variants, key=lambda v: v == "llama"):  # (Llama last: see --interleave)
        model = build(variant, layers, device, size, positions=max(64, new_tokens + 16))
        config = CompileConfig(backend=null_backend(), mode=None)
        config._compile_all_devices = True
        ids = torch.randint(2, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
        models[variant] = (model, config, ids.to(model.device))

    def timed(variant: str, n: int) -> float:
        model, config, ids = models[variant]
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
        if variant.endswith("_triton"):
            kwargs["cache_config"] = {"static_decode_backend": "triton"}
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), compile_config=config, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for variant in models:  # compile, warm
        timed(variant, new_tokens), timed(variant, 1)
    per = {v: [] for v in models}
    with GuardCapture() as later:
        for _ in range(rounds):
            for variant in models:
                t1, tn = timed(variant, 1), timed(variant, new_tokens)
                per[variant].append((tn - t1) / (new_tokens - 1) * 1e6)
    torch._dynamo.reset()
    return {
        v: {"variant": v, "layers": layers, "host_us_per_token": round(statistics.median(t), 1),
            "host_us_per_token_fastest": round(min(t), 1), "recompiles": len(later.trees)}
        for v, t in per.items()
    }  # fmt: skip


COLUMNS = (
    ("model", "variant"),
    ("layers", "layers"),
    ("guards", "guards"),
    ("guarded tensors", "tensors"),
    ("of the cache", "cache_tensors"),
    ("guard check us (median)", "check_us_median"),
    ("guard check us (fastest round)", "check_us"),
    ("cache lookup us in generate (median)", "lookup_us"),
    ("recompiles", "recompiles"),
)


def markdown(rows: list[dict], title: str) -> str:
    names = [c for c, _ in COLUMNS] + (["ms per token"] if any("ms_per_token" in r for r in rows) else [])
    lines = [f"# {title}", "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in rows:
        cells = ["-" if r.get(key) is None else str(r[key]) for _, key in COLUMNS]
        if len(names) > len(COLUMNS):
            cells.append(str(r.get("ms_per_token", "-")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,4,12")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "scalar_sort_triton"))
    parser.add_argument("--iters", type=int, default=20000, help="guard checks timed per model (20 rounds)")
    parser.add_argument("--compile", default="transformers", choices=["transformers", "eager"],
                        help="transformers' own compile of the decode step, or the eager backend (same guards, fast)")
    parser.add_argument("--no-lookup", action="store_true", help="skip the profiled generate (lookup_us)")
    parser.add_argument("--out", default=None, help="directory for guards.json and guards.md")
    parser.add_argument("--host-step", type=int, default=0, metavar="ROUNDS",
                        help="instead: host us per generated token with a null graph, ROUNDS interleaved rounds")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="keep every model compiled and time them in ROUNDS interleaved rounds (one --layers)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--no-interpret", action="store_true", help="leave TRITON_INTERPRET as it is")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "d768"])
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (5 on the CPU, 512 on CUDA)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens (8 on the CPU, 33 on CUDA)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    cuda = args.device == "cuda"
    prompt = args.prompt or (512 if cuda else 5)
    new_tokens = args.new_tokens or (33 if cuda else NEW_TOKENS)
    layer_counts = [int(x) for x in args.layers.split(",")]
    variants = args.variants.split(",")
    if args.host_step:
        rows = host_step_us(variants, layer_counts[-1], args.host_step, device=args.device, size=args.size)
        rows = list(rows.values())
        lines = ["| model | layers | host us per token, null graph (median) | fastest round | recompiles |",
                 "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['variant']} | {r['layers']} | {r['host_us_per_token']} | {r['host_us_per_token_fastest']} | "
                  f"{r['recompiles']} |" for r in rows]  # fmt: skip
        table = f"# Host time per token of static generate, null graph ({args.device}, {args.size})\n\n"
        table += "\n".join(lines) + "\n"
        print(table)
        if args.out:
            write_results(args.out, "host_step", rows, table)
        return
    if args.interleave and len(layer_counts) > 1:
        parser.error("--interleave takes one --layers (models of one class would share the step's cache entries)")
    rows, kept = [], ([] if args.interleave else None)
    if kept is not None:
        torch._dynamo.reset()
        # Llama's step guards on the length of transformers' `_CAN_RECORD_REGISTRY`, which grows when a model class
        # first runs: compiled before the others, its step would recompile in the rounds
        variants = sorted(variants, key=lambda v: v == "llama")
    for variant in variants:
        for layers in layer_counts:
            row = measure(variant, layers, args.iters, args.verbose, args.device, args.size, prompt, new_tokens,
                          args.compile, not args.no_lookup and kept is None, kept)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if kept:
        interleaved(kept, args.interleave, args.iters, new_tokens, args.compile)
        for row in rows:
            print(json.dumps({k: row[k] for k in ("variant", "check_us", "check_us_median", "lookup_us")}))
    title = (f"Guards of the compiled static decode step ({args.device}, {args.size}, compile={args.compile}, "
             f"torch {torch.__version__})")  # fmt: skip
    table = markdown(rows, title)
    print()
    print(table)
    if len(layer_counts) > 1:
        lo, hi = min(layer_counts), max(layer_counts)
        print(f"per layer ({lo} -> {hi} layers):")
        for variant in variants:
            a = next(r for r in rows if r["variant"] == variant and r["layers"] == lo)
            b = next(r for r in rows if r["variant"] == variant and r["layers"] == hi)
            per = {k: round((b[k] - a[k]) / (hi - lo), 2) for k in ("tensors", "cache_tensors", "guards", "check_us")}
            print(f"  {variant}: {per}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.out:
        write_results(args.out, "guards", rows, table)



def write_results(out: str, name: str, rows: list, table: str) -> None:
    """``rows`` as ``OUT/NAME.json`` and the markdown ``table`` as ``OUT/NAME.md``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table)


if __name__ == "__main__":
    main()
