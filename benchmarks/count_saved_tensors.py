"""What a training step saves for its backward, per model: every tensor that autograd (or a compiled graph's
``CompiledFunction``) packs during the forward, by shape and dtype, and the bytes of their distinct storages.

    PYTHONPATH=. python benchmarks/count_saved_tensors.py [--variants "llama;rbf (1 register, SuSiE)"] [--compile]
        [--backend triton] [--device cpu] [--size 128,2,2,256,128,2]

Why: under ``torch.compile`` the d768 models of rbf and hybrid_sort peaked at 1.11-1.12x Llama's activation memory on an
H200 (``benchmarks/results/h200-2026-11-29``, call 5), against 0.80x in eager mode.  Saved tensors are the part of
the peak that a model's code decides (the rest is the backward's transients): the models are built by
``profile_training.build`` (the benchmark's configs), run under bf16 autocast, and
``torch.autograd.graph.saved_tensors_hooks`` records what is packed, with the bytes of each tensor's whole storage (a
saved view keeps its base alive).  On a CPU the fused kernels run in Triton's interpreter (``--backend triton``, slow:
keep the size small) or through the padding trick (``sdpa``); but what Inductor keeps can differ between devices
(``F.rms_norm`` is one fused op on CUDA and a chain on the CPU), so the GPU is the measurement: the 1.11x came from
every norm's normalised rows kept beside the residual, which ``benchmarks/probe_compiled_memory.py`` found by the
allocating lines (``benchmarks/results/h200-2026-11-29c``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def saved_tensors(model, ids, device_type: str, compile_model: bool) -> list[tuple]:
    """``(shape, dtype, bytes, storage pointer)`` of every tensor packed for the backward in one step (the second of
    two, so that a compiled model is traced already)."""
    import torch

    forward = torch.compile(model) if compile_model else model
    saved: list[tuple] = []

    def pack(t):
        # the storage's bytes, not the view's: a saved view keeps its whole base alive (a compiled d768 step kept
        # every layer's float32 residual through a one-row view of it, which the view's own bytes hid)
        storage = t.untyped_storage()
        saved.append((tuple(t.shape), t.dtype, storage.nbytes(), storage.data_ptr()))
        return t

    for _ in range(2):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    return list(saved)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="llama;rbf (1 register, SuSiE)", help="profile_training.VARIANTS names, ';'")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (default mode)")
    p.add_argument("--backend", default="triton", help="our models' attention_backend (auto, triton, sdpa, ...)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", default="128,2,2,256,128,2", help="hidden,layers,heads,intermediate,seq,batch")
    p.add_argument("--top", type=int, default=12, help="shape/dtype rows listed per model")
    args = p.parse_args(argv)
    if args.device == "cpu" and args.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import profile_training as pt

    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "seq", "batch")
    values = [int(x) for x in args.size.split(",")]
    if len(values) != len(keys):
        p.error(f"--size takes {len(keys)} integers ({','.join(keys)}); got {args.size!r}")
    size = dict(zip(keys, values))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (size["batch"], size["seq"]), generator=gen).to(args.device)
    mode = "compiled" if args.compile else "eager"
    print(f"# Saved for the backward: {mode}, size {size}, attention_backend {args.backend}, {args.device}")
    for variant in args.variants.split(";"):
        torch.manual_seed(0)
        model = pt.build(variant, size, device=args.device)
        if hasattr(model.config, "attention_backend"):
            model.config.attention_backend = args.backend
        saved = saved_tensors(model, ids, torch.device(args.device).type, args.compile)
        storages: dict = {}
        for _, _, nbytes, ptr in saved:
            storages[ptr] = max(storages.get(ptr, 0), nbytes)
        total = sum(storages.values()) / 2**20
        print(f"\n## {variant}: {len(saved)} saved tensors, {len(storages)} storages, {total:.2f} MiB of storage")
        counts = collections.Counter((shape, str(dtype)) for shape, dtype, _, _ in saved)
        for (shape, dtype), n in counts.most_common(args.top):
            print(f"- {n} x {list(shape)} {dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
