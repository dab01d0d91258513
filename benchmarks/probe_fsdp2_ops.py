"""Which aten ops FSDP2 (recipes/accelerate/fsdp2_zero2.yaml) adds to a training step, per family, on the CPU (gloo).

Issue 17: under FSDP2 Llama's GPU compute per step shrinks while the hf_rbf families' grows (more elementwise float
kernels, bf16 adds, layer_norm kernels switching from float to bf16).  This probe runs, for each family of the d768
scale recipes (recipes/configs/scale_d768_<family>.yaml, shrunk to a tiny size) and Llama:

* "plain": the model as ``Trainer`` runs it on one process or under DDP: float32 parameters, the forward under
  ``torch.autocast(bf16)`` (accelerate wraps the forward in it), the backward outside;
* "fsdp2": the same model prepared by accelerate's own ``fsdp2_prepare_model`` with the plugin that
  ``accelerate launch --config_file recipes/accelerate/fsdp2_zero2.yaml`` gives the processes (each decoder layer, the
  tail [final norm, tied embedding] and the root ``fully_shard``-ed, ``MixedPrecisionPolicy`` from
  ``plugin.set_mixed_precision("bf16")``), the forward under the same autocast and accelerate's
  ``convert_outputs_to_fp32``;

in a 2-process gloo group, and counts on rank 0 the aten ops (``TorchDispatchMode``: after autocast and autograd, so
every cast autocast makes shows) of one forward + backward after two warm-up steps, keyed by op and dtypes.  View ops
(``is_view``), ops that allocate only and the profiler's ranges are left out: what is left is roughly what launches a
kernel on a GPU.  Each op is attributed to the innermost frame of hf_rbf / transformers' model code / FSDP2 /
accelerate on the Python stack; in the backward, to the autograd node that runs it and its forward's source line
(anomaly mode's traceback).

    PYTHONPATH=. .venv/bin/python benchmarks/probe_fsdp2_ops.py [--families gka llama] [--out README.md]

The CPU's autocast casts fewer ops than CUDA's (CUDA also runs layer_norm, softmax, pow, exp, rsqrt ... in float32),
the attention runs the CPU backends (no Triton kernels) and the register step takes the rows path (no CUDA graphs): the
probe shows what FSDP2 changes in the model's own code, not the GPU's exact kernel list.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("llama", "rbf", "gka", "scalar_sort", "hybrid_sort")
TINY = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
    vocab_size=512,
)  # fmt: skip
BATCH, SEQ = 2, 64
BIG = BATCH * SEQ * TINY["hidden_size"]  # what costs memory traffic on a GPU, not only a launch
SKIP = {"aten.detach.default", "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
        "aten.lift_fresh.default", "aten._local_scalar_dense.default", "aten.set_.source_Storage_storage_offset",
        "aten.set_.source_Tensor", "aten.resize_.default", "aten.new_empty.default",
        "aten.new_empty_strided.default"}  # fmt: skip
SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64", torch.bool: "b"}
OURS = ("/hf_rbf/", "/transformers/models/", "/transformers/integrations/", "/transformers/masking_utils")
FRAMEWORK = ("/torch/distributed/fsdp/", "/accelerate/")


def _short(dtype) -> str:
    return SHORT.get(dtype, str(dtype).replace("torch.", ""))


def _where(filename: str, lineno: int) -> str:
    for marker in ("/site-packages/", REPO + "/"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
    return f"{filename}:{lineno}"


def _source_of_frames(frames) -> str | None:
    """The innermost frame of the model code or of FSDP2 / accelerate (frames: innermost first)."""
    for filename, lineno in frames:
        if any(m in filename for m in OURS) or any(m in filename for m in FRAMEWORK):
            return _where(filename, lineno)
    return None


class OpCounter(TorchDispatchMode):
    active: OpCounter | None = None  # the counter of the step being counted (for the fused rms_norm below)

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.sources: dict = collections.defaultdict(collections.Counter)
        self.paused = False
        self.big: collections.Counter = collections.Counter()  # ops over a [tokens, hidden] tensor or larger

    def __enter__(self):
        OpCounter.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        OpCounter.active = None
        return super().__exit__(*exc)

    def record(self, key: str) -> None:
        self.counts[key] += 1
        self.sources[key][self._source()] += 1

    def _source(self) -> str:
        frames = []
        f = sys._getframe(2)
        while f is not None:
            frames.append((f.f_code.co_filename, f.f_lineno))
            f = f.f_back
        own = _source_of_frames(frames)
        node = torch._C._current_autograd_node()
        if node is not None:
            # in the backward: the node and where its forward op ran (anomaly mode keeps the forward's traceback)
            tb = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
            frames = []
            for entry in tb or []:  # traceback.format_stack()'s strings, outermost first
                match = re.match(r'\s*File "([^"]+)", line (\d+)', entry)
                if match:
                    frames.append((match.group(1), int(match.group(2))))
            fwd = _source_of_frames(reversed(frames))
            if own is not None and any(m in own for m in ("fsdp/", "accelerate/")):
                return f"bwd {type(node).__name__.replace('Backward0', 'Bwd')} @ {own}"
            return f"bwd {node.name()} <- {fwd or own or '?'}"
        return own or "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if self.paused or func.is_view or name in SKIP or name.startswith("profiler."):
            return out
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        in_dt = "/".join(sorted({_short(t.dtype) for t in ins if t.is_floating_point()}))
        out_dt = _short(outs[0].dtype) if outs else (_short(ins[0].dtype) if ins else "-")
        if name in ("aten.copy_.default", "aten._to_copy.default") and ins:
            key = f"{name.replace('aten.', '').replace('.default', '')} {_short(ins[-1].dtype)}->{out_dt}"
        else:
            key = f"{name.replace('aten.', '').replace('.default', '')} [{in_dt}]->{out_dt}"
        self.record(key)
        if max((t.numel() for t in ins + outs), default=0) >= BIG:
            self.big[key] += 1
        return out


_RMS_NORM = torch.nn.functional.rms_norm


class _FusedRMSNorm(torch.autograd.Function):
    """``F.rms_norm`` counted as the one kernel forward and one backward that CUDA runs (``_fused_rms_norm``); on the
    CPU it decomposes into the chain of pow, mean, rsqrt and products, which would hide what fusing it saves."""

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        counter = OpCounter.active
        dtypes = "/".join(sorted({_short(t.dtype) for t in (x, weight) if t is not None}))
        if counter is not None:
            counter.paused = True
        try:
            with torch.enable_grad():
                inputs = [x.detach().requires_grad_(x.requires_grad)]
                if weight is not None:
                    inputs.append(weight.detach().requires_grad_(weight.requires_grad))
                out = _RMS_NORM(inputs[0], shape, inputs[1] if weight is not None else None, eps)
        finally:
            if counter is not None:
                counter.paused = False
                counter.record(f"fused_rms_norm [{dtypes}]->{_short(out.dtype)}")
        ctx.graph = (inputs, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.graph
        counter = OpCounter.active
        if counter is not None:
            counter.paused = True
        try:
            wanted = [t for t in inputs if t.requires_grad]
            got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
            grads = [next(got) if t.requires_grad else None for t in inputs]
        finally:
            if counter is not None:
                counter.paused = False
                counter.record(f"fused_rms_norm_backward [{_short(grad.dtype)}]->{_short(grad.dtype)}")
        return grads[0], (grads[1] if len(grads) > 1 else None), None, None


def fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    """What ``F.rms_norm`` is on CUDA: under autocast its inputs are cast to float32 (``rms_norm`` is on CUDA
    autocast's float32 list, not on the CPU's), then one fused kernel."""
    if torch.is_autocast_enabled("cpu") and input.dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", enabled=False):
            input = input.float()
            weight = weight.float() if weight is not None and weight.dtype != torch.float32 else weight
    return _FusedRMSNorm.apply(input, weight, tuple(normalized_shape), eps)


def _plugin():
    """The FSDP plugin of ``accelerate launch --config_file recipes/accelerate/fsdp2_zero2.yaml`` (as
    tests/test_recipes_scaling.py builds it), with the layer class left to each model's ``_no_split_modules`` (as
    benchmarks/bench_scaling.py's worker does) and bf16 set as ``AcceleratorState`` sets it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", os.path.join(REPO, "recipes", "accelerate", "fsdp2_zero2.yaml")]
    args = launch_command_parser().parse_args([*argv, os.path.join(REPO, "recipes", "pretrain.py")])
    args, _, _ = _validate_launch_command(args)
    for key, value in prepare_multi_gpu_env(args).items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            os.environ[key] = value
    os.environ.pop("FSDP_TRANSFORMER_CLS_TO_WRAP", None)
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision("bf16")
    return plugin


def _model(family: str):
    from recipes.pretrain_config import load_config
    from recipes.pretrain_models import build_config, build_model

    cfg = load_config(os.path.join(REPO, "recipes", "configs", f"scale_d768_{family}.yaml"))
    kwargs = dict(cfg["model"].get("config") or {})
    kwargs.update(TINY)
    torch.manual_seed(0)
    return build_model(build_config(family, kwargs))


def _fsdp2(model):
    import types

    from accelerate.utils import convert_outputs_to_fp32
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = _plugin()
    fake = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16", is_main_process=False,
        device=torch.device("cpu"), torch_device_mesh=None,
    )  # fmt: skip
    model = fsdp2_prepare_model(fake, model)
    forward = model.forward.__func__
    model.forward = convert_outputs_to_fp32(forward).__get__(model)  # what Accelerator.prepare_model adds
    return model, plugin.mixed_precision_policy


def _step(model, ids, counter=None):
    model.zero_grad(set_to_none=True)
    with counter if counter is not None else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return float(loss.detach())


def _count(model, ids):
    for _ in range(2):
        _step(model, ids)
    counter = OpCounter()
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        loss = _step(model, ids, counter)
    return counter, loss


def worker(rank: int, world: int, port: int, families, queue) -> None:
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    torch.nn.functional.rms_norm = fused_rms_norm  # count it as CUDA runs it (see fused_rms_norm)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import hf_rbf  # noqa: F401

    try:
        results = {}
        ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
        for family in families:
            plain, plain_loss = _count(_model(family), ids)
            model, policy = _fsdp2(_model(family))
            sharded, fsdp_loss = _count(model, ids)
            results[family] = dict(
                plain=(dict(plain.counts), {k: dict(v) for k, v in plain.sources.items()}),
                fsdp2=(dict(sharded.counts), {k: dict(v) for k, v in sharded.sources.items()}),
                losses=(plain_loss, fsdp_loss), policy=repr(policy),
                big=(sum(plain.big.values()), sum(sharded.big.values())),
            )
            del model
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def table(results: dict, top: int = 14) -> str:
    lines = []
    for family, r in results.items():
        plain, plain_src = r["plain"]
        sharded, sharded_src = r["fsdp2"]
        n_plain, n_sharded = sum(plain.values()), sum(sharded.values())
        lines += [
            f"### {family}",
            "",
            (
                f"non-view aten ops per forward + backward: plain {n_plain}, FSDP2 {n_sharded} "
                f"({n_sharded - n_plain:+d}); of them over a [tokens, hidden] tensor or larger: plain {r['big'][0]}, "
                f"FSDP2 {r['big'][1]} ({r['big'][1] - r['big'][0]:+d}); loss plain {r['losses'][0]:.4f}, "
                f"FSDP2 {r['losses'][1]:.4f}"
            ),
            "",
            "| op [input dtypes]->output | plain | FSDP2 | diff | FSDP2's sources (count) | plain's sources (count) |",
            "|---|---:|---:|---:|---|---|",
        ]
        keys = set(plain) | set(sharded)
        diffs = sorted(keys, key=lambda k: (-abs(sharded.get(k, 0) - plain.get(k, 0)), k))
        for key in diffs[:top]:
            d = sharded.get(key, 0) - plain.get(key, 0)
            if d == 0:
                break

            def srcs(src, k=key):
                items = sorted(src.get(k, {}).items(), key=lambda kv: -kv[1])[:4]
                return "; ".join(f"{s} ({n})" for s, n in items).replace("|", "/")

            lines.append(
                f"| `{key}` | {plain.get(key, 0)} | {sharded.get(key, 0)} | {d:+d} | {srcs(sharded_src)} |"
                f" {srcs(plain_src)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    ap.add_argument("--json", default=None, help="also write the raw counts to this file")
    args = ap.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(worker, args=(2, port, args.families, queue), nprocs=2, start_method="spawn", join=False)
    results = queue.get()  # before joining: rank 0 blocks on a full pipe until this reads it
    while not procs.join():
        pass
    policy = next(iter(results.values()))["policy"]
    text = f"MixedPrecisionPolicy (accelerate, fsdp2_zero2.yaml, bf16): `{policy}`\n\n" + table(results, args.top)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    raise SystemExit(main())
