"""Explicit FSDP2 prefetching (``hf_rbf.trainer.FSDPPrefetchCallback``, recipe key ``fsdp_prefetch_layers``).

FSDP2 runs on the CPU with a one-process gloo group: the all-gathers are trivial there, but the order in which FSDP2
issues them (what the callback changes) is the same as on GPUs.  Whether it speeds up a GPU step is for the scaling
benchmark (``benchmarks/bench_scaling.py``, docs/recipes.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_rbf.trainer import FSDPPrefetchCallback, fsdp_layer_units, set_fsdp_prefetch
from recipes.pretrain_config import load_config

LAYERS = 3


@pytest.fixture
def gloo(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised (another test leaked one)")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_rbf  # noqa: F401

    size = dict(vocab_size=97, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**size, max_position_embeddings=32))
    config = AutoConfig.for_model(family, **size, max_position_embeddings=32, num_register_tokens=1)
    return AutoModelForCausalLM.from_config(config)


def _sharded(family: str):
    from torch.distributed.fsdp import fully_shard

    model = _model(family)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _unshard_order(model, monkeypatch) -> tuple[list, torch.Tensor, list]:
    """One forward + backward of ``model``: the events ("unshard", fqn) / ("forward", i) in host order, the loss and the
    gradients."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    events = []
    unshard = _fsdp_param_group.FSDPParamGroup.unshard

    def recording_unshard(self, *args, **kwargs):
        events.append(("unshard", self._module_fqn))
        return unshard(self, *args, **kwargs)

    monkeypatch.setattr(_fsdp_param_group.FSDPParamGroup, "unshard", recording_unshard)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: events.append(("forward", i)))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.full_tensor().clone() for p in model.parameters() if p.grad is not None]
    return events, loss.detach(), grads


@pytest.mark.parametrize("family", ["rbf", "llama"])
def test_each_layer_issues_the_next_layers_all_gathers_before_its_forward(family, gloo, monkeypatch):
    """Without the callback FSDP2 all-gathers layer i+1 when layer i+1's forward starts on the host (too late for a
    host-bound step); with ``layers = n`` layer i's pre-forward has issued the all-gathers of layers i+1 .. i+n.
    Prefetching changes when parameters are gathered, never the numbers: loss and gradients are identical."""
    results = {}
    for n in (None, 1, 2):
        model = _sharded(family)
        if n is not None:
            assert set_fsdp_prefetch(model, n) == LAYERS
        events, loss, grads = _unshard_order(model, monkeypatch)
        first_unshard = {}
        for k, (kind, what) in enumerate(events):
            if kind == "unshard" and what.startswith("model.layers."):
                first_unshard.setdefault(int(what.rsplit(".", 1)[1]), k)
        forward = {what: k for k, (kind, what) in enumerate(events) if kind == "forward"}
        assert sorted(forward) == list(range(LAYERS))
        for i in range(LAYERS - 1):
            ahead = [j for j in range(i + 1, LAYERS) if first_unshard[j] < forward[i]]
            assert ahead == list(range(i + 1, min(LAYERS, i + 1 + (n or 0)))), (n, i, events)
        results[n] = (loss, grads)
    for n in (1, 2):
        torch.testing.assert_close(results[n][0], results[None][0], rtol=0, atol=0)
        for a, b in zip(results[n][1], results[None][1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_prefetch_runs_the_layers_in_reverse(gloo):
    model = _sharded("rbf")
    set_fsdp_prefetch(model, 2)
    units = fsdp_layer_units(model)
    assert units == list(model.model.layers)
    states = [unit._get_fsdp_state() for unit in units]
    assert units[0]._get_fsdp_state()._states_to_backward_prefetch == []
    assert units[2]._get_fsdp_state()._states_to_backward_prefetch == [states[1], states[0]]
    assert units[0]._get_fsdp_state()._states_to_forward_prefetch == [states[1], states[2]]
    assert units[2]._get_fsdp_state()._states_to_forward_prefetch == []


def test_the_callback_sets_a_sharded_model_and_leaves_others_alone(gloo):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args, state, control = TrainingArguments(output_dir="unused", report_to=[]), TrainerState(), TrainerControl()
    callback = FSDPPrefetchCallback(1)
    callback.on_train_begin(args, state, control, model=_model("rbf"))
    assert callback.units == 0  # no FSDP2: nothing to set
    sharded = _sharded("gka")
    callback.on_train_begin(args, state, control, model=sharded)
    assert callback.units == LAYERS
    assert sharded.model.layers[0]._get_fsdp_state()._states_to_forward_prefetch == [
        sharded.model.layers[1]._get_fsdp_state()
    ]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_bad_prefetch_values_are_refused(bad):
    with pytest.raises(ValueError, match=r"FSDPPrefetchCallback: layers must be an integer >= 1; got"):
        FSDPPrefetchCallback(bad)
    with pytest.raises(ValueError, match=r"FSDP prefetch: layers must be an integer >= 1; got"):
        set_fsdp_prefetch(torch.nn.Linear(2, 2), bad)


def test_recipe_key_fsdp_prefetch_layers(tmp_path):
    recipe = "recipes/configs/scale_d768_rbf.yaml"
    # the scale recipes prefetch one layer ahead by default (_scale_d768.yaml); null gives FSDP2's own order back
    assert load_config(recipe, output_dir=str(tmp_path))["fsdp_prefetch_layers"] == 1
    assert load_config(recipe, ["fsdp_prefetch_layers=null"], output_dir=str(tmp_path))["fsdp_prefetch_layers"] is None
    assert load_config("recipes/configs/tinystories_rbf.yaml", output_dir=str(tmp_path))["fsdp_prefetch_layers"] is None
    assert load_config(recipe, ["fsdp_prefetch_layers=2"], output_dir=str(tmp_path))["fsdp_prefetch_layers"] == 2
    with pytest.raises(ValueError, match=r"`fsdp_prefetch_layers` must be null .* or an int >= 1; got 0"):
        load_config(recipe, ["fsdp_prefetch_layers=0"], output_dir=str(tmp_path))
