"""FSDP2 with the register stream against the rows path, on the CPU (gloo): what a GPU run cannot show cheaply.

For each register path ("rows", "compiled") a tiny model with one register, every decoder layer ``fully_shard``-ed,
trains a few steps in each of the launched processes, and rank 0 prints:

* the order of FSDP2's per-layer ``pre_backward`` (unshard for the backward) and ``post_backward`` (reduce-scatter)
  calls in the last step's backward: a path that unsharded layers early, or out of order, would show here;
* dynamo's graph and recompile counters (the compiled register step must compile once, not per step or per layer);
* the losses (the two paths must agree) and the host time per step (at this size the CPU time is host work).

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 benchmarks/diagnose_fsdp2_register_stream.py \
        [--family rbf] [--layers 4] [--steps 6]

Session 9 (2026-11-26, torch 2.13 CPU): the same order on both paths (the stream adds a second, no-op
``pre_backward`` per layer, whose outputs are two tensors needing gradients), one compiled graph and no recompile,
equal losses, host time per step within the run-to-run spread.  It did not explain FSDP2's GPU slowdown
(``benchmarks/results/h100-2026-11-26f``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def run(family: str, layers: int, steps: int, path: str) -> dict:
    import torch._dynamo as dynamo
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_rbf import modeling_decoder

    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        family, vocab_size=97, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, attention_backend="naive", num_register_tokens=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    modeling_decoder.register_path = path
    modeling_decoder.register_compile_backend = "aot_eager"  # the captured graphs, no code generation on the CPU
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    events: list = []
    saved = {}
    for name in ("pre_backward", "post_backward"):
        orig = saved[name] = getattr(param_group.FSDPParamGroup, name)

        def wrapped(self, *args, _orig=orig, _name=name, **kwargs):
            events.append(f"{_name.split('_')[0]}:{self._module_fqn.replace('model.layers.', 'L') or 'root'}")
            return _orig(self, *args, **kwargs)

        setattr(param_group.FSDPParamGroup, name, wrapped)
    losses, times = [], []
    try:
        for _ in range(steps):
            events.clear()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(round(total.item() / dist.get_world_size(), 6))
    finally:
        for name, orig in saved.items():
            setattr(param_group.FSDPParamGroup, name, orig)
    counters = dynamo.utils.counters
    return dict(
        path=model.model.last_register_path,
        backward_order=list(events),
        unique_graphs=counters["stats"].get("unique_graphs", 0),
        recompiles=sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
        losses=losses,
        host_ms_per_step=round(1e3 * sorted(times[1:])[len(times[1:]) // 2], 2) if len(times) > 1 else None,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="rbf")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import hf_rbf  # noqa: F401

    try:
        rows = {path: run(args.family, args.layers, args.steps, path) for path in ("rows", "compiled")}
        if dist.get_rank() == 0:
            print(json.dumps(dict(family=args.family, world_size=dist.get_world_size(), **rows)))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
