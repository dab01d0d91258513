"""``TrainerCallback``s of the pretraining recipe: metrics files and loss curve, throughput, simulated interruption."""

from __future__ import annotations

import csv
import json
import os
import statistics
import time

import torch
from transformers import TrainerCallback

from .plotting import plot_loss_curves

# optimizer steps left out of tokens/s (compilation, autotuning and allocator warm-up); bench_scaling.py profiles the
# last of them
THROUGHPUT_WARMUP_STEPS = 5

CSV_FIELDS = ("step", "epoch", "tokens_seen", "loss", "grad_norm", "learning_rate", "eval_loss", "eval_runtime")


class MetricsCallback(TrainerCallback):
    """Writes ``metrics.json`` (every logged row of ``state.log_history`` with ``tokens_seen`` added),
    ``metrics.csv`` and ``loss_curve.png`` to ``output_dir`` on the main process.

    The rows come from the trainer state, which checkpoints carry: a resumed run's files hold the whole curve.
    """

    def __init__(self, output_dir: str, tokens_per_step: int, run_name: str):
        self.output_dir = output_dir
        self.tokens_per_step = tokens_per_step
        self.run_name = run_name

    def rows(self, state) -> list[dict]:
        out = []
        for row in state.log_history:
            row = dict(row)
            if "step" in row:
                row["tokens_seen"] = int(row["step"]) * self.tokens_per_step
            out.append(row)
        return out

    def metrics(self, state) -> dict:
        return {
            "run_name": self.run_name,
            "tokens_per_step": self.tokens_per_step,
            "max_steps": state.max_steps,
            "global_step": state.global_step,
            "log_history": self.rows(state),
        }

    def write(self, state, plot: bool) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        metrics = self.metrics(state)
        tmp = os.path.join(self.output_dir, "metrics.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=1)
        os.replace(tmp, os.path.join(self.output_dir, "metrics.json"))
        with open(os.path.join(self.output_dir, "metrics.csv"), "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
            writer.writeheader()
            for row in metrics["log_history"]:
                if "loss" in row or "eval_loss" in row:
                    writer.writerow(row)
        if plot:
            plot_loss_curves(
                {self.run_name: metrics},
                os.path.join(self.output_dir, "loss_curve.png"),
                title=f"{self.run_name}: loss",
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            self.write(state, plot=False)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if state.is_world_process_zero:
            self.write(state, plot=True)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.write(state, plot=True)


class ThroughputCallback(TrainerCallback):
    """Training tokens per second of the optimizer steps after ``warmup_steps`` (compilation, autotuning and allocator
    warm-up excluded), with evaluation and checkpoint saving excluded too: time is taken (CUDA-synchronised) only
    where a measured stretch of steps starts or ends, around each evaluation / save, so steps run unsynchronised.

    Each measured step's own duration is kept too, without a synchronisation: on a GPU a timing event is recorded on
    the current stream where each step ends (the time between two such events is the step as the GPU lived it, host
    stalls included) and read when the stretch ends; on the CPU the clock is read there.  A mean over a few steps hides
    whether one step stalled or all ran slower: ``step_seconds_median`` and ``step_seconds_max`` tell them apart."""

    def __init__(self, tokens_per_step: int, warmup_steps: int = THROUGHPUT_WARMUP_STEPS):
        self.tokens_per_step = tokens_per_step
        self.warmup_steps = warmup_steps
        self.seconds = 0.0
        self.steps = 0
        self.step_seconds: list[float] = []
        self._segment = None  # (start step, start time) of the stretch being measured
        self._marks = []  # the stretch's step boundaries: CUDA events or perf_counter readings

    @staticmethod
    def _cuda() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    @classmethod
    def _now(cls) -> float:
        if cls._cuda():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _mark(self) -> None:
        if self._cuda():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
            # a long stretch (no evaluation or save for many steps) must not keep an event per step: the steps whose
            # end the GPU has passed are read now (``query`` does not synchronise)
            done = 0
            while done + 1 < len(self._marks) and self._marks[done + 1].query():
                done += 1
            if done >= 64:
                self._close_marks(done)
        else:
            self._marks.append(time.perf_counter())

    def _close_marks(self, upto: int | None = None) -> None:
        """Turn the stretch's boundaries up to mark ``upto`` (all: after the synchronisation that ends the stretch)
        into step durations; mark ``upto`` stays as the start of the next step."""
        upto = len(self._marks) - 1 if upto is None else upto
        marks = self._marks[: upto + 1]
        for start, end in zip(marks, marks[1:]):
            seconds = start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start
            self.step_seconds.append(seconds)
        self._marks = self._marks[upto:] if self._segment is not None else []

    def on_step_begin(self, args, state, control, **kwargs):
        if self._segment is None and state.global_step >= self.warmup_steps:
            self._segment = (state.global_step, self._now())
            self._mark()

    def on_step_end(self, args, state, control, **kwargs):
        if self._segment is None:
            return
        self._mark()
        pausing = control.should_evaluate or control.should_save or control.should_training_stop
        if pausing or state.global_step >= state.max_steps:
            start_step, start_time = self._segment
            self.seconds += self._now() - start_time
            self.steps += state.global_step - start_step
            self._segment = None
            self._close_marks()

    def result(self) -> dict:
        if self.steps == 0:
            return {"tokens_per_second": None, "measured_steps": 0}
        median = statistics.median(self.step_seconds) if self.step_seconds else None
        return {
            "tokens_per_second": self.steps * self.tokens_per_step / self.seconds,
            "measured_steps": self.steps,
            "measured_seconds": self.seconds,
            "warmup_steps": self.warmup_steps,
            # the durations themselves stay on the callback (``step_seconds``): a long run's summary keeps the figures
            "step_seconds_median": median,
            "step_seconds_max": max(self.step_seconds) if self.step_seconds else None,
            "tokens_per_second_median_step": self.tokens_per_step / median if median else None,
        }


class StopAtStepCallback(TrainerCallback):
    """Stops training after ``step`` optimizer steps and saves a checkpoint there, as a preempted job would, while the
    learning-rate schedule keeps its full ``max_steps`` (used to show that ``--resume`` continues exactly)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
            control.should_save = True
        return control


__all__ = ["THROUGHPUT_WARMUP_STEPS", "MetricsCallback", "StopAtStepCallback", "ThroughputCallback"]
