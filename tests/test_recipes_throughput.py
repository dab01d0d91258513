"""recipes/pretrain_callbacks.ThroughputCallback: the measured stretch's tokens/s and each measured step's duration."""

import time
from types import SimpleNamespace

import pytest

from recipes.pretrain_callbacks import ThroughputCallback


def _train(callback, sleeps, max_steps, evaluate_at=()):
    """Drive the callback as Trainer does: step i (1-based) sleeps sleeps[i - 1] seconds between begin and end."""
    state = SimpleNamespace(global_step=0, max_steps=max_steps)
    for i in range(1, max_steps + 1):
        control = SimpleNamespace(should_evaluate=False, should_save=False, should_training_stop=False)
        callback.on_step_begin(None, state, control)
        time.sleep(sleeps[i - 1])
        state.global_step = i
        control.should_evaluate = i in evaluate_at
        callback.on_step_end(None, state, control)
        if control.should_evaluate:
            time.sleep(0.2)  # an evaluation: outside every measured step and stretch


def test_step_durations_show_a_stalled_step_that_the_mean_hides():
    cb = ThroughputCallback(tokens_per_step=1000, warmup_steps=2)
    sleeps = [0.5, 0.5, 0.02, 0.02, 0.25, 0.02, 0.02, 0.02]  # two warm-up steps, then one stall among six
    _train(cb, sleeps, max_steps=8, evaluate_at=(5,))
    r = cb.result()
    steps = cb.step_seconds
    assert r["measured_steps"] == 6 and len(steps) == 6 and "step_seconds" not in r
    # the evaluation after step 5 is in neither the stretches nor the steps
    assert r["measured_seconds"] == pytest.approx(sum(steps), abs=0.02)
    assert r["measured_seconds"] < 0.45
    assert steps[2] == max(steps) == r["step_seconds_max"] >= 0.25
    assert 0.02 <= r["step_seconds_median"] < 0.1
    assert r["tokens_per_second_median_step"] == pytest.approx(1000 / r["step_seconds_median"])
    assert r["tokens_per_second"] == pytest.approx(6000 / r["measured_seconds"])
    # the mean-based tokens/s is pulled down by the one stall, the median-based one is not
    assert r["tokens_per_second"] < 0.6 * r["tokens_per_second_median_step"]


def test_no_measured_step():
    cb = ThroughputCallback(tokens_per_step=1000, warmup_steps=5)
    _train(cb, [0.0] * 4, max_steps=4)
    assert cb.result() == {"tokens_per_second": None, "measured_steps": 0}


class _FakeEvent:
    """A CUDA timing event on a fake clock: recorded at ``clock[0]``, complete once the clock has passed it."""

    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock[0]

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3  # milliseconds, as torch's


def test_a_long_stretch_on_the_gpu_keeps_few_events(monkeypatch):
    """Without evaluation or saving for many steps, the events of steps the GPU has finished are read as the run goes
    (``query``, no synchronisation), so the callback never holds an event per step; the durations are the same."""
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(ThroughputCallback, "_cuda", staticmethod(lambda: True))
    cb = ThroughputCallback(tokens_per_step=10, warmup_steps=1)
    state = SimpleNamespace(global_step=0, max_steps=301)
    most_marks = 0
    for i in range(1, 302):
        control = SimpleNamespace(should_evaluate=False, should_save=False, should_training_stop=False)
        cb.on_step_begin(None, state, control)
        _FakeEvent.clock[0] += 0.001 * (1 + i % 3)  # steps of 1, 2 and 3 ms
        state.global_step = i
        cb.on_step_end(None, state, control)
        most_marks = max(most_marks, len(cb._marks))
    assert most_marks <= 66 and cb._marks == []
    assert cb.step_seconds == pytest.approx([0.001 * (1 + i % 3) for i in range(2, 302)])
    assert cb.result()["step_seconds_median"] == pytest.approx(0.002)
