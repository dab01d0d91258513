"""Where a compiled training step's activation peak comes from (CUDA only): for each model, the blocks alive at the
step's peak, grouped by the line that allocated them, with that line's source (for a compiled model, a line of
Inductor's generated code, followed by the lines that use the buffer), and the peak of each phase of the step.

    PYTHONPATH=. python benchmarks/probe_compiled_memory.py --out DIR [--size d768]
        [--variants "llama;rbf (1 register, SuSiE)"] [--eager] [--top 20] [--time-steps 20]

Why: under ``torch.compile`` the d768 rbf and hybrid_sort models peaked at 1.11-1.12x Llama's activation memory on an
H200 (``benchmarks/results/h200-2026-11-29``, call 5), while a count of the tensors packed for their backward said
they saved less than Llama.  That count summed the saved views' own bytes; what stays alive is decided by the buffers
behind them, which only the allocator's trace and the generated code show.  This probe found the cause: every norm
kept its normalised rows beside the whole residual (``benchmarks/results/h200-2026-11-29c``).

The step is ``profile_training``'s (bf16 autocast, fused AdamW, random tokens, the benchmark's configs).  Three steps
compile and warm the caches; the fourth gives each phase's peak (forward, backward, optimizer step); in the fifth
``torch.cuda.memory._record_memory_history`` records every allocation with its Python stack, and the trace is
replayed to find the peak of what the step allocated (what was resident before it is not counted: weights, optimizer
state).  The blocks alive then are summed per allocating line, and each forward graph among those lines is read for
what it keeps for the backward (:func:`kept_by_forward_graph`).  ``--time-steps`` more steps give a rough step time.
Writes ``DIR/compiled_memory.md`` and copies the generated code the lines point into (``DIR/code/``).
"""

from __future__ import annotations

import argparse
import collections
import linecache
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profile_training as pt  # noqa: E402

_TORCH_DIR = os.path.dirname(torch.__file__)


def allocation_site(frames: list[dict]) -> tuple[str, int]:
    """The innermost frame outside torch's own package (Inductor's generated code counts as outside: it lives in a
    cache directory), as ``(filename, line)``; ``("?", 0)`` when every frame is torch's."""
    for f in frames:
        name = f.get("filename", "")
        if name and not name.startswith(_TORCH_DIR) and not name.startswith("<"):
            return name, int(f.get("line", 0))
    return "?", 0


def replay(events: list[dict]):
    """``(peak bytes, index of the event that reached it, alive blocks then)`` over alloc / free events, where alive
    blocks map address -> (size, site)."""
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])
    alive = {}
    for e in events[: at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = (e["size"], allocation_site(e.get("frames", [])))
        elif e["action"] == "free_requested":
            alive.pop(e["addr"], None)
    return peak, at, alive


_BUFFER = re.compile(r"(buf\d+) = empty_strided_cuda\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")


def kept_by_forward_graph(source: str) -> dict:
    """What an Inductor forward graph (its generated code) keeps for the backward: the buffers it allocates that its
    ``call`` returns, whole (a returned view keeps its buffer alive), as ``{(shape, dtype): [count, bytes]}``.  The
    graph's inputs (``primals_*``: weights, ids) are not counted.  Empty for a backward graph (its inputs include
    ``tangents_*``; it returns gradients) and for code without such a return."""
    start = source.find("    def call(self, args):")
    if start < 0 or "return (" not in source[start:] or "tangents_" in source[start:]:
        return {}
    body = source[start:]
    sizes = {}
    for name, shape, _, dtype in _BUFFER.findall(body):
        dims = tuple(int(x) for x in shape.split(",") if x.strip())
        sizes[name] = (dims, dtype, math.prod(dims) * getattr(torch, dtype).itemsize)
    ret = body[body.rindex("return ("):]
    ret = ret[: ret.index(")\n")]
    kept: dict = collections.defaultdict(lambda: [0, 0])
    for name in set(re.findall(r"\b(buf\d+)\b", ret)):
        if name in sizes:
            dims, dtype, nbytes = sizes[name]
            kept[(dims, dtype)][0] += 1
            kept[(dims, dtype)][1] += nbytes
    return dict(kept)


def source_context(filename: str, line: int, after: int = 3) -> str:
    rows = [linecache.getline(filename, n).rstrip() for n in range(line, line + after + 1)]
    return " / ".join(r.strip() for r in rows if r.strip())[:400]


def probe(variant: str, size: dict, compile_model: bool, top: int, code_dir: Path, time_steps: int = 0) -> list[str]:
    b, t = size["batch"], size["seq"]
    torch.manual_seed(0)
    model = pt.build(variant, size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compile_model else model
    ids = torch.randint(0, 8192, (b, t), device="cuda")
    phases = {}

    def step(record: bool = False):
        def mark(name):
            if record:
                torch.cuda.synchronize()
                phases[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
                torch.cuda.reset_peak_memory_stats()

        with pt.module_settings(variant), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
            mark("forward")
            loss.backward()
            mark("backward")
        opt.step()
        mark("optimizer step")
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(record=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    t0 = time.perf_counter()
    for _ in range(time_steps):
        step()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / max(time_steps, 1)
    events = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_requested")]
    peak, at, alive = replay(events)
    by_site: dict = collections.defaultdict(lambda: [0, 0])
    for size_b, site in alive.values():
        by_site[site][0] += size_b
        by_site[site][1] += 1
    peak_site = allocation_site(events[at].get("frames", [])) if at >= 0 else ("?", 0)
    lines = [
        f"## {variant} ({'compiled' if compile_model else 'eager'})",
        "",
        "Peak per phase (GiB above what was resident before the step): "
        + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()),
        "",
        f"Traced step: peak {peak / 2**30:.2f} GiB at event {at} of {len(events)}, reached by an allocation at "
        f"`{os.path.basename(peak_site[0])}:{peak_site[1]}`; {len(alive)} blocks alive then.",
        "",
        f"Step time after the trace: {ms:.1f} ms ({time_steps} steps; models run one after another, not interleaved: "
        "a rough figure)." if time_steps else "",
        "",
        "| MiB alive at the peak | blocks | allocated at | source (that line and the next three) |",
        "|---|---|---|---|",
    ]
    for (filename, line), (nbytes, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        ctx = source_context(filename, line).replace("|", "\\|")
        lines.append(f"| {nbytes / 2**20:.1f} | {count} | `{os.path.basename(filename)}:{line}` | `{ctx}` |")
        if "torchinductor" in filename or filename.startswith("/tmp"):
            dest = code_dir / os.path.basename(filename)
            if not dest.exists() and os.path.exists(filename):
                shutil.copy(filename, dest)
    lines.append("")
    for path in sorted({site[0] for _, site in alive.values()}):
        if not os.path.exists(path):
            continue
        kept = kept_by_forward_graph(Path(path).read_text())
        if not kept:
            continue
        total = sum(v[1] for v in kept.values())
        lines += [
            f"Kept for the backward by the forward graph `{os.path.basename(path)}`: {total / 2**20:,.0f} MiB in "
            f"{sum(v[0] for v in kept.values())} buffers; the largest kinds:",
            "",
            "| buffers | shape | dtype | MiB |",
            "|---|---|---|---|",
        ]
        for (dims, dtype), (count, nbytes) in sorted(kept.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"| {count} | {list(dims)} | {dtype} | {nbytes / 2**20:,.1f} |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="d768", choices=sorted(pt.SIZES))
    p.add_argument("--variants", default="llama;rbf (1 register, SuSiE);hybrid_sort (1 register)")
    p.add_argument("--eager", action="store_true", help="no torch.compile")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--time-steps", type=int, default=20, help="steps timed after the traced one (0: none)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    out = Path(args.out)
    code_dir = out / "code"
    code_dir.mkdir(parents=True, exist_ok=True)
    size = pt.SIZES[args.size]
    text = [f"# Activation peak of one training step, {args.size} ({torch.cuda.get_device_name()}, torch "
            f"{torch.__version__})", ""]
    for variant in args.variants.split(";"):
        try:
            text += probe(variant, size, not args.eager, args.top, code_dir, args.time_steps)
        except Exception as err:  # one model failing must not hide the others
            text += [f"## {variant}: failed: {type(err).__name__}: {err}", ""]
        torch.cuda.empty_cache()  # the model is gone with probe's frame
        (out / "compiled_memory.md").write_text("\n".join(text) + "\n")
        print("\n".join(text[-args.top - 10:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
