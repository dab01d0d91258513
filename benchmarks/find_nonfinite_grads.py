"""Find where a training run's gradients first stop being finite: which step, which parameters, which layer's
attention.  A diagnosis script for the GPU (the scaling benchmark's 1B rbf runs logged ``grad_norm: nan``), not a
benchmark.

    python benchmarks/find_nonfinite_grads.py --config recipes/configs/scale_1b_rbf.yaml --steps 40 \\
        --backends triton sdpa --out DIR [--anomaly] [--set KEY=VALUE ...]

Each backend (``model.config.attention_backend``) trains the recipe through ``recipes/pretrain.py``'s ``run``
(``train_only``, one process, same seed and data) with hooks that record, every step, before gradient clipping:

* every parameter whose gradient holds a NaN or an infinity (hooks after accumulation, so clipping has not yet
  spread one non-finite gradient over all of them);
* per decoder layer, whether the gradient reaching the attention output and the gradient it sends to its input
  (hidden states) are finite: a finite output gradient with a non-finite input gradient means that attention created
  the NaN;
* the loss, the small parameters (at most 64 elements: bandwidths, temperatures, gammas) as min / max, and the
  largest absolute activation entering and leaving each attention.

The run stops at the first non-finite step.  ``--anomaly`` turns on ``torch.autograd.set_detect_anomaly(check_nan=True)``
for that backend's run, so the error names the backward node that made the first NaN and the warning shows its forward
stack.  Results: ``<out>/<backend>/nonfinite.json`` and the run's own logs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scaling import BENCH_OVERRIDES  # noqa: E402

# the scaling benchmark's training-only overrides (no evaluation, no saving), logging every step
SPEED_OVERRIDES = [*BENCH_OVERRIDES, "training.logging_steps=1"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps at most")
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=8,
        help="blocks per step (the scaling runs' 8)",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["triton"],
        help="attention_backend values to run in turn",
    )
    parser.add_argument(
        "--anomaly",
        action="store_true",
        help="autograd anomaly detection (check_nan) in every run",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides",
    )
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    for name in ("steps", "global_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return args


def _finite(t) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


class NonFiniteRecorder:
    """Hooks on a model's parameters and attention modules; ``records`` holds one dict per step."""

    def __init__(self, model):
        import torch

        self.model = model
        self.step = 0
        self.records: list[dict] = []
        self.current: dict = {}
        self.handles = []
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._param_hook(name)))
        for name, module in model.named_modules():
            if name.endswith("self_attn"):
                self.handles.append(module.register_forward_pre_hook(self._attn_pre_hook(name), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._attn_hook(name)))
        self.small = {n: p for n, p in model.named_parameters() if p.numel() <= 64}
        self._torch = torch

    def begin_step(self, step: int) -> None:
        self.step = step
        self.current = {"step": step, "nonfinite_grads": [], "attention": {}}

    def end_step(self, loss=None) -> dict:
        record = self.current
        record["loss"] = loss
        record["small_parameters"] = {
            n: [float(p.detach().float().min()), float(p.detach().float().max())] for n, p in self.small.items()
        }
        self.records.append(record)
        return record

    def _layer(self, name: str) -> dict:
        return self.current.setdefault("attention", {}).setdefault(name, {})

    def _param_hook(self, name):
        def hook(param):
            if param.grad is not None and not _finite(param.grad):
                self.current.setdefault("nonfinite_grads", []).append(name)

        return hook

    def _attn_pre_hook(self, name):
        def hook(module, args, kwargs):
            # the flat-rows path (registers) computes on ``rows``, of which the hidden states are only a view
            hidden = kwargs.get("rows")
            if hidden is None:
                hidden = kwargs.get("hidden_states", args[0] if args else None)
            if hidden is None or not self._torch.is_tensor(hidden):
                return
            entry = self._layer(name)
            entry["input_absmax"] = float(hidden.detach().abs().max())
            if hidden.requires_grad:
                hidden.register_hook(lambda g: entry.__setitem__("input_grad_finite", _finite(g)))

        return hook

    def _attn_hook(self, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not self._torch.is_tensor(out):
                return
            entry = self._layer(name)
            entry["output_absmax"] = float(out.detach().abs().max())
            entry["output_finite"] = _finite(out)
            if out.requires_grad:
                out.register_hook(lambda g: entry.__setitem__("output_grad_finite", _finite(g)))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def recorder_callback(out_dir: str):
    from transformers import TrainerCallback

    class RecorderCallback(TrainerCallback):
        recorder = None
        first_bad = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.recorder = NonFiniteRecorder(model)
            self.recorder.begin_step(state.global_step + 1)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.recorder is None or not logs or "loss" not in logs:
                return
            if self.recorder.records and self.recorder.records[-1]["step"] == state.global_step:
                self.recorder.records[-1]["loss"] = logs["loss"]
                self.recorder.records[-1]["grad_norm"] = logs.get("grad_norm")

        def on_step_end(self, args, state, control, **kwargs):
            record = self.recorder.end_step()
            bad = record["nonfinite_grads"] or any(
                not v.get("output_finite", True) or not v.get("input_grad_finite", True)
                for v in record["attention"].values()
            )
            self._write()
            if bad and self.first_bad is None:
                self.first_bad = record["step"]
                control.should_training_stop = True
            self.recorder.begin_step(state.global_step + 1)

        def on_train_end(self, args, state, control, **kwargs):
            self._write()
            self.recorder.remove()

        def _write(self):
            with open(os.path.join(out_dir, "nonfinite.json"), "w") as f:
                json.dump(
                    {
                        "first_nonfinite_step": self.first_bad,
                        "steps": self.recorder.records,
                    },
                    f,
                    indent=1,
                )

    return RecorderCallback()


def summarize(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    lines = [f"first non-finite step: {data['first_nonfinite_step']}"]
    for record in data["steps"][-3:]:
        born = [
            n
            for n, v in record["attention"].items()
            if v.get("output_grad_finite", True) and not v.get("input_grad_finite", True)
        ]
        lines.append(
            f"step {record['step']}: loss {record.get('loss')} grad_norm {record.get('grad_norm')}; "
            f"{len(record['nonfinite_grads'])} non-finite grads {record['nonfinite_grads'][:6]}; "
            f"NaN born in attention of {born[:4]}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    from recipes.pretrain import run
    from recipes.pretrain_config import load_config

    args = parse_args(argv)
    status = 0
    for backend in args.backends:
        out = os.path.join(os.path.abspath(args.out), backend)
        os.makedirs(out, exist_ok=True)
        overrides = [
            *SPEED_OVERRIDES,
            f"training.max_steps={args.steps}",
            f"global_batch_size={args.global_batch_size}",
            f"model.config.attention_backend={backend}",
            *args.overrides,
        ]
        cfg = load_config(os.path.join(REPO, args.config), overrides, output_dir=out)
        callback = recorder_callback(out)
        caught = []
        try:
            # anomaly mode prints the forward stack of the failing node as a warning: keep the warnings
            with (
                warnings.catch_warnings(record=True) as caught,
                torch.autograd.set_detect_anomaly(args.anomaly, check_nan=True),
            ):
                warnings.simplefilter("always")
                run(cfg, train_only=True, callbacks=[callback])
        except Exception as exc:  # noqa: BLE001 (the anomaly error is the finding: keep it and go on)
            status = 1
            with open(os.path.join(out, "error.txt"), "w") as f:
                f.write(traceback.format_exc())
                f.writelines(f"\n--- warning: {w.message}\n" for w in caught)
            print(f"[{backend}] {exc!r}", flush=True)
        if os.path.exists(os.path.join(out, "nonfinite.json")):
            print(
                f"[{backend}] " + summarize(os.path.join(out, "nonfinite.json")),
                flush=True,
            )
        del callback
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return status


if __name__ == "__main__":
    raise SystemExit(main())
