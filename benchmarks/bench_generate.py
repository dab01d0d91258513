"""Milliseconds per generated token of every family against ``LlamaForCausalLM`` of the same size, with the dynamic
cache and with ``cache_implementation="static"`` (where transformers compiles the decode step), in one process.

    PYTHONPATH=. python benchmarks/bench_generate.py --out DIR [--cases 1x512,8x2048] [--new-tokens 64]
        [--variants "llama;rbf;gka;scalar_sort;hybrid_sort (1 register);rbf (rows)"] [--modes dynamic,static]
        [--rounds 2]

d768 L12 H12 (110M parameters with the 8192-token vocabulary), bf16 weights, greedy, random prompt tokens, no EOS.
The time per token is ``(t(new_tokens) - t(1)) / (new_tokens - 1)``: the prefill and the first token cancel; with
``--step-clock`` it is the time between the first and the last generated token's step inside one ``generate`` (a CUDA
event recorded per step by a logits processor), over the steps between: one prefill per measurement, for prompts
whose prefill takes minutes (8 x 131k).  Every (model, case, mode) runs once as a warm-up (compilation,
autotuning), then ``--rounds`` interleaved rounds (5), each round in another order of the models (rotated by one);
one case after the other (a model's static cache, and the CUDA graphs recorded for its buffers, serve every call of
one batch size, as transformers' own static cache does).  Writes ``generate.json`` and ``generate.md``.

The column "cache bytes/token" is computed, not measured: the bytes one more cached token takes in the cache of the
mode, per batch row, summed over the layers (:func:`hf_rbf.cache_static.cache_bytes_per_token` for the hf_rbf
families, incl. the sorted structure's index buffers and, for the static caches, the token index shared by the rows;
``2 * layers * kv_heads * head_dim * dtype bytes`` for Llama, from its config, in both modes).

Statistics: a batch-1 decode step is bound by the host, and this host's speed drifts by 2x between seconds (an H200
run, 2026-11-29: Llama's dynamic step 15.5 ms in one round, 9.2 in the next; hybrid_sort's static step 0.73x Llama's
best in one call and 1.25x in the next).  So each row reports the median and the best of its rounds, and "x Llama" is
the median over the rounds of ``Llama's ms / the model's ms`` *of the same round* (paired: a slow phase of the host
slows both), with the lowest and highest round's ratio beside it.  With ``--sequential`` the pairs are not measured
close in time and the ratio compares different moments.

Long prompts: ``--prefill-chunk N`` passes transformers' ``prefill_chunk_size`` to ``generate`` (the prompt goes
through the cache N tokens at a time, so 32k-512k prompts fit), e.g.
``--cases 1x8192,1x32768,1x131072 --prefill-chunk 8192``.  Each row also reports the peak GPU memory of its timed
``generate`` (``torch.cuda.max_memory_allocated`` after a reset: the whole process's, so with interleaved rounds every
model's weights, and what earlier calls left allocated), and the call's own part of it: that peak less what was
allocated when the call started (its cache, activations and anything it keeps).  The largest over the timed rounds
(not the warm-up).

``--agreement``: for the sorted families (scalar_sort, hybrid_sort), the share of generated tokens that the
windowed decode (the config's ``decode_window``) has in common with exact decode over every cached token
(``decode_window=None``) from the same prompt, per case and mode: the models are untrained, so this measures the
mechanism (ties and near-ties of random weights), not a trained model's captured mass
(``recipes/measure_captured_mass.py`` does that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decoder_settings import decoder_settings  # noqa: E402

SIZE = dict(vocab_size=8192, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048)


def parse_variant(variant: str) -> tuple[str, dict, dict]:
    """``"family"`` or ``"family (option, ...)"`` -> ``(family, config overrides, hf_rbf.modeling_decoder settings)``.
    Options: ``N register(s)`` (``num_register_tokens``), ``window K`` (the sorted families' ``decode_window``: a
    decode step over the ``K`` keys nearest in scalar space, O(log n + K); without it they decode exactly over every
    cached key), ``rows`` (``register_path = "rows"``: the flat register rows, the default before 2026-11-26, for an
    A/B against the register stream in one process), ``no copies`` (``decode_projection_copies = "off"``: the
    attention projections of an eager decode step one GEMM each, as before 2026-11-29, for an A/B in one process),
    ``checked decode`` (``direct_decode_calls = "off"``: the sorted families' exact decode steps through the public
    attention functions and their checks, as before 2026-11-29), ``torch inserts`` (the sorted families'
    ``decode_backend = "torch"``: a decode step's token written into the cache by five slice copies, not one launch,
    as before 2026-11-29; it also takes the windowed step's torch path), ``rope launch`` (``rope_in_insert =
    "off"``: hybrid_sort's decode-step RoPE in a launch of its own, not in the cache's insert, as until session 35 on
    2026-11-29), ``split decode`` (``kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS = 0``: an eager decode step over
    at most 1,024 keys split over programs with a combine launch, as until session 35)."""
    family, _, rest = variant.partition(" (")
    overrides, settings = {}, {}
    for option in filter(None, (o.strip() for o in rest.rstrip(")").split(","))):
        words = option.split()
        if len(words) == 2 and words[0].isdigit() and words[1] in ("register", "registers"):
            overrides["num_register_tokens"] = int(words[0])
        elif len(words) == 2 and words[0] == "window" and words[1].isdigit():
            if family not in SORTED:
                raise ValueError(f"variant {variant!r}: 'window K' is the sorted families' decode_window ({SORTED})")
            overrides["decode_window"] = int(words[1])
        elif option == "rows":
            settings["register_path"] = "rows"
        elif option == "no copies":
            settings["decode_projection_copies"] = "off"
        elif option == "checked decode":
            settings["direct_decode_calls"] = "off"
        elif option == "rope launch":
            settings["rope_in_insert"] = "off"
        elif option == "split decode":
            settings["kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS"] = 0
        elif option == "torch inserts":
            if family not in SORTED:
                raise ValueError(f"variant {variant!r}: 'torch inserts' is the sorted families' decode_backend")
            overrides["decode_backend"] = "torch"
        else:
            raise ValueError(
                f"variant {variant!r}: unknown option {option!r} (allowed: 'N registers', 'window K', 'rows', "
                "'no copies', 'checked decode', 'torch inserts', 'rope launch', 'split decode')"
            )
    return family, overrides, settings


def build(variant: str, max_positions: int, device: str = "cuda", size: dict | None = None):
    """The variant's model of ``size`` (default :data:`SIZE`), bf16 on CUDA (float32 elsewhere), greedy, no EOS."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_rbf  # noqa: F401

    size = SIZE if size is None else size
    family, overrides, _ = parse_variant(variant)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**size, max_position_embeddings=max_positions, attn_implementation="sdpa"))
    else:
        cfg = AutoConfig.for_model(family, **size, max_position_embeddings=max_positions, **overrides)
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device, torch.bfloat16 if device == "cuda" else torch.float32).eval()


def cache_bytes_per_token(variant: str, model, mode: str, batch: int) -> float:
    """Bytes one more cached token takes per batch row, summed over the layers, in the cache ``generate`` builds in
    ``mode`` (computed from the config; see the module docstring)."""
    from hf_rbf.cache_static import cache_bytes_per_token as family_bytes

    cfg = model.config
    if variant == "llama":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        item = torch.empty((), dtype=model.dtype).element_size()
        return float(2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * item)
    return family_bytes(cfg, mode, model.dtype).total(batch) / batch


SORTED = ("scalar_sort", "hybrid_sort")


def release_caches(model, compiled: bool = False) -> None:
    """Drop the static cache hf_rbf's ``generate`` keeps on a model between calls (``_generation_static_cache``;
    transformers builds its own per call) and return the allocator's free memory; with ``compiled`` also every
    compiled decode step and the memory pools of its CUDA graphs (``torch.compiler.reset()``: every model's).  After a
    call that ran out of memory the next model's calls would otherwise run in what is left."""
    import gc

    model.__dict__.pop("_generation_static_cache", None)
    if compiled:
        torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate_kwargs(model, new_tokens: int, mode: str, prefill_chunk: int | None, exact: bool = False) -> dict:
    """``generate`` arguments of one mode; ``exact``: the sorted families decode over every cached token."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if prefill_chunk:
        kwargs["prefill_chunk_size"] = prefill_chunk
    if mode == "static":
        kwargs["cache_implementation"] = "static"
        if exact:
            kwargs["cache_config"] = {"decode_window": None}
    elif exact:
        from hf_rbf.cache_names import CACHE_NAME

        kwargs[CACHE_NAME] = model.make_cache(decode_window=None)
    return kwargs


def allocated_bytes(like: torch.Tensor) -> int:
    """GPU bytes allocated now (0 off CUDA): where a timed call's own peak starts."""
    return torch.cuda.memory_allocated() if like.is_cuda else 0


def timed_generate(model, ids, new_tokens: int, mode: str, prefill_chunk: int | None = None) -> tuple[float, int]:
    """Seconds of one greedy ``generate`` and its peak allocated GPU bytes."""
    kwargs = generate_kwargs(model, new_tokens, mode, prefill_chunk)
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    if cuda:
        torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated() if cuda else 0


class StepClock:
    """A logits processor that only records when each step's logits reach it: a CUDA event per step on the GPU (no
    synchronisation: the step stream runs as without it), the host clock on the CPU.  ``ms_per_step()`` is the time
    from the first generated token's step to the last one's over the steps between: the decode steps alone, without
    the prefill, from one ``generate``."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def __call__(self, input_ids, scores):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        return scores

    def ms_per_step(self, skip: int = 0) -> float:
        """Per step from the ``skip``-th generated token's step on (the first decode steps compile and capture)."""
        marks = self.marks[skip:]
        if len(marks) < 2:
            raise ValueError(f"StepClock: needs at least {skip + 2} generated tokens (--new-tokens > --skip-steps + 1)")
        first, last = marks[0], marks[-1]
        ms = first.elapsed_time(last) if self.cuda else 1e3 * (last - first)
        return ms / (len(marks) - 1)


def step_timed_generate(model, ids, new_tokens: int, mode: str, prefill_chunk: int | None = None, skip: int = 0):
    """``(ms per decode step, peak allocated GPU bytes)`` of one greedy ``generate`` (:class:`StepClock`): one
    prefill per measurement instead of ``timed_generate``'s two, for prompts whose prefill takes minutes."""
    from transformers import LogitsProcessorList

    kwargs = generate_kwargs(model, new_tokens, mode, prefill_chunk)
    cuda = ids.is_cuda
    clock = StepClock(cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([clock]),
                             **kwargs)
    if cuda:
        torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens and len(clock.marks) == new_tokens
    return clock.ms_per_step(skip), torch.cuda.max_memory_allocated() if cuda else 0


def round_statistics(by_round: dict, llama_by_round: dict) -> dict:
    """A row's figures from its rounds (``{round: ms per token}``) and Llama's in the same case and mode: the median
    and best ms, and the median, lowest and highest of ``Llama's ms / this ms`` over the rounds both have (None
    without any: Llama not measured, or failed)."""
    ms = sorted(by_round.values())
    ratios = sorted(llama_by_round[r] / by_round[r] for r in by_round if r in llama_by_round and by_round[r] > 0)
    return dict(
        ms_per_token=statistics.median(ms),
        ms_best=ms[0],
        ms_rounds=[by_round[r] for r in sorted(by_round)],
        x_llama=statistics.median(ratios) if ratios else None,
        x_llama_lowest=ratios[0] if ratios else None,
        x_llama_highest=ratios[-1] if ratios else None,
    )


def agreement(model, ids, new_tokens: int, mode: str, prefill_chunk: int | None) -> float:
    """Share of the generated tokens (all rows) equal between the windowed and the exact decode."""
    with torch.no_grad():
        outs = [
            model.generate(
                ids, attention_mask=torch.ones_like(ids), **generate_kwargs(model, new_tokens, mode, prefill_chunk, ex)
            )[:, ids.shape[1] :]
            for ex in (False, True)
        ]
    return (outs[0] == outs[1]).float().mean().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="1x512,8x2048")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", default="llama;rbf;gka;scalar_sort;hybrid_sort")
    ap.add_argument("--modes", default="dynamic,static")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="generate's prefill_chunk_size (long prompts)")
    ap.add_argument("--agreement", action="store_true", help="sorted families: windowed vs exact decode tokens")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (float32, with --size)")
    ap.add_argument("--size", default=None, help="JSON of config overrides (default: the d768 L12 H12 size)")
    ap.add_argument("--step-clock", action="store_true",
                    help="time the decode steps inside one generate (a CUDA event per step) instead of t(n) - t(1): "
                         "one prefill per measurement (long prompts)")
    ap.add_argument("--skip-steps", type=int, default=0,
                    help="--step-clock: time from this generated token's step on; with --rounds 0 the warm-up generate "
                         "itself is timed (its first steps compile: skip them, e.g. 16), one prefill per model")
    ap.add_argument("--sequential", action="store_true",
                    help="one model at a time (built, measured, released) instead of interleaved rounds: for caches "
                         "too large for every model at once; Llama's ratio then compares different moments")
    args = ap.parse_args()
    if args.rounds < 0:
        ap.error(f"--rounds must be >= 0; got {args.rounds}")
    if args.rounds == 0 and not args.step_clock:
        ap.error("--rounds 0 times the warm-up generate itself: it needs --step-clock")
    if args.skip_steps and not args.step_clock:
        ap.error("--skip-steps needs --step-clock")
    if not 0 <= args.skip_steps <= args.new_tokens - 2:
        ap.error(f"--skip-steps must be in [0, --new-tokens - 2] = [0, {args.new_tokens - 2}]; got {args.skip_steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    max_pos = max(n for _, n in cases) + args.new_tokens + 8
    size = dict(SIZE, **json.loads(args.size)) if args.size else dict(SIZE)
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    res = dict(
        gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        torch=torch.__version__,
        triton=triton_version,
        transformers=transformers.__version__,
        rows=[],
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    prompts = {c: torch.randint(2, size["vocab_size"], c, generator=g).to(args.device) for c in cases}
    failed: set = set()  # (variant, case, mode) of a call that raised: not measured again
    times: dict = {}  # (variant, case, mode) -> {round: ms per token}
    peak: dict = {}  # key -> the process's peak allocated bytes during the timed generate
    peak_own: dict = {}  # key -> that peak less what was allocated when the generate started

    def measure(variant, model, case, mode, rnd):
        key = (variant, case, mode)
        if key in failed:
            return
        timed = rnd > 0 or (args.step_clock and args.rounds == 0)  # round 0 is the warm-up, unless it is timed
        try:
            with decoder_settings(parse_variant(variant)[2]):
                if args.step_clock:
                    t0 = time.perf_counter()
                    start = allocated_bytes(prompts[case])
                    ms, mem = step_timed_generate(model, prompts[case], args.new_tokens, mode, args.prefill_chunk,
                                                  args.skip_steps)
                    t1, tn = 0.0, time.perf_counter() - t0
                else:
                    t1, _ = timed_generate(model, prompts[case], 1, mode, args.prefill_chunk)
                    start = allocated_bytes(prompts[case])
                    tn, mem = timed_generate(model, prompts[case], args.new_tokens, mode, args.prefill_chunk)
                    ms = 1e3 * (tn - t1) / (args.new_tokens - 1)
            if timed:  # (a warm-up's compilation and autotuning allocate what no measured call does)
                peak[key] = max(peak.get(key, 0), mem)
                peak_own[key] = max(peak_own.get(key, 0), mem - start)
        except Exception as err:  # a failing family or mode must not hide the others
            failed.add(key)
            res["rows"].append(dict(variant=variant, batch=case[0], prompt=case[1], mode=mode, error=f"{err}"[:300]))
            print(f"[error] {key}: {err}", flush=True)
            release_caches(model, compiled=args.sequential)  # what the failed call held must not fail the next model
            return
        if not timed:
            # no per-token figure: the first (1-token) call also compiles and tunes, so t(n) - t(1) can be negative
            what = "one generate" if args.step_clock else f"1 token {t1:.2f} s,"
            print(f"[warm-up] {variant} {case} {mode}: {what} {args.new_tokens} tokens {tn:.2f} s", flush=True)
            return
        times.setdefault(key, {})[rnd] = ms
        print(f"[round {rnd}] {variant} {case} {mode}: {ms:.2f} ms/token", flush=True)

    def rows_of(variant, model, only_case=None):
        for (name, case, mode), by_round in list(times.items()):
            if name != variant or (name, case, mode) in failed or only_case not in (None, case):
                continue
            stats = round_statistics(by_round, times.get(("llama", case, mode), {}))
            per_token = cache_bytes_per_token(parse_variant(variant)[0], model, mode, case[0])
            agree = None
            if args.agreement and parse_variant(variant)[0] in SORTED:
                try:
                    agree = agreement(model, prompts[case], args.new_tokens, mode, args.prefill_chunk)
                except Exception as err:  # noqa: BLE001  (reported in the row, the table goes on)
                    agree = f"error: {err}"[:200]
            res["rows"].append(
                dict(
                    variant=variant,
                    batch=case[0],
                    prompt=case[1],
                    mode=mode,
                    **stats,
                    cache_bytes_per_token=per_token,
                    peak_gib=peak.get((variant, case, mode), 0) / 2**30,
                    call_peak_gib=peak_own.get((variant, case, mode), 0) / 2**30,
                    agreement_with_exact=agree,
                )
            )

    def write_tables(final: bool):
        (out / "generate.json").write_text(json.dumps(res, indent=1))
        lines = [
            f"# ms per generated token ({res['gpu']}, torch {res['torch']}, triton {res['triton']}, transformers "
            f"{res['transformers']}; {'d768 L12 H12' if size == SIZE else json.dumps(size)} "
            f"{'bf16' if args.device == 'cuda' else 'float32'}, greedy, {args.new_tokens} new tokens, "
            + ", ".join(
                [f"the warm-up timed from step {args.skip_steps}" if args.rounds == 0
                 else f"median and best of {args.rounds} {'rounds' if args.sequential else 'interleaved rounds'}"]
                + (["one model at a time"] if args.sequential else [])
            )
            + "; "
            f"{'decode steps timed inside one generate' if args.step_clock else '(t(n) - t(1)) / (n - 1)'})",
            "",
            "| model | batch x prompt | mode | ms/token (median) | best | x Llama (median of rounds) | "
            "lowest - highest round | cache bytes/token | peak GiB (process) | the call's own GiB | "
            "tokens as exact decode |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            if "error" in r:
                lines.append(
                    f"| {r['variant']} | {r.get('batch', '')}x{r.get('prompt', '')} | {r.get('mode', '')} | "
                    f"error: {r['error'][:100]} | | | | | | | |"
                )
                continue
            ratio = "" if r["x_llama"] is None else f"{r['x_llama']:.2f}x"
            spread = "" if r["x_llama"] is None else f"{r['x_llama_lowest']:.2f} - {r['x_llama_highest']:.2f}"
            agree = r.get("agreement_with_exact")
            agree = "" if agree is None else (f"{agree:.3f}" if isinstance(agree, float) else agree)
            lines.append(
                f"| {r['variant']} | {r['batch']}x{r['prompt']} | {r['mode']} | {r['ms_per_token']:.2f} | "
                f"{r['ms_best']:.2f} | {ratio} | {spread} | {r['cache_bytes_per_token']:.0f} | {r['peak_gib']:.2f} | "
                f"{r['call_peak_gib']:.2f} | {agree} |"
            )
        (out / "generate.md").write_text("\n".join(lines) + "\n")
        if final:
            print("\n".join(lines))

    variants = args.variants.split(";")
    if args.sequential:
        # one model at a time: built, measured (its rounds back to back), released; for caches so large that two
        # models' do not fit together (8 x 131k: Llama's static cache alone is 38.7 GB)
        for variant in variants:
            try:
                model = build(variant, max_pos, args.device, size)
            except Exception as err:
                res["rows"].append(dict(variant=variant, error=f"{type(err).__name__}: {err}"))
                continue
            for case in cases:
                for rnd in range(args.rounds + 1):
                    for mode in args.modes.split(","):
                        measure(variant, model, case, mode, rnd)
            rows_of(variant, model)
            write_tables(final=False)  # a call cut by its time limit keeps the models measured so far
            release_caches(model, compiled=True)
            del model
            torch.cuda.empty_cache()
    else:
        models = {}
        for variant in variants:
            try:
                models[variant] = build(variant, max_pos, args.device, size)
            except Exception as err:
                res["rows"].append(dict(variant=variant, error=f"{type(err).__name__}: {err}"))
        # cases outermost: a model's static cache (and the CUDA graphs recorded for its buffers) serves every call of
        # one batch size, as transformers' own static cache does; alternating cases would rebuild it at every call
        order = list(models)
        for case in cases:
            for rnd in range(args.rounds + 1):  # round 0 is the warm-up
                # each round in another order: a model always measured right after the same one would carry what
                # that one leaves behind (the host's caches, the GPU's clocks) in every round
                turn = order[rnd % len(order):] + order[: rnd % len(order)] if order else []
                for mode in args.modes.split(","):
                    for variant in turn:
                        measure(variant, models[variant], case, mode, rnd)
            for variant, model in models.items():
                rows_of(variant, model, case)
            write_tables(final=False)  # a call cut by its time limit keeps the cases measured so far

    write_tables(final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
