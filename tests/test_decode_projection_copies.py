"""The eager decode step's kept concatenation of the attention projections (``modeling_decoder.
decode_projection_copies``): one GEMM per layer for q / k / v / scalar q / scalar k, the values of the one-by-one
GEMMs, a copy rebuilt when the weights change, dropped by every ``generate`` and by ``train()``."""

import collections
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_generate import build  # noqa: E402
from decoder_settings import decoder_settings  # noqa: E402

SIZE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
# attention projections of one layer that the copy joins into one GEMM
PROJECTIONS = {"rbf": 3, "scalar_sort": 3, "hybrid_sort": 5}


def _model(family: str):
    torch.manual_seed(0)
    return build(family, 64, "cpu", SIZE)


def _generate(model, ids, setting: str, seen: list | None = None):
    """Greedy ``generate`` under ``decode_projection_copies = setting``; ``seen`` collects, at every step, the copies
    the model holds while the generation runs."""
    from transformers import LogitsProcessorList

    def look(input_ids, scores):
        seen.append(dict(model.model.projection_copies))
        return scores

    extra = {} if seen is None else {"logits_processor": LogitsProcessorList([look])}
    with decoder_settings({"decode_projection_copies": setting}), torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, output_logits=True,
            return_dict_in_generate=True, **extra,
        )


@pytest.mark.parametrize("family", sorted(PROJECTIONS))
def test_copies_give_the_tokens_and_logits_of_separate_gemms(family):
    """Greedy generate with the copies ("on") against the one-by-one GEMMs ("off"): the same tokens, logits equal to
    float32 rounding (one GEMM over concatenated rows computes each output as the separate GEMM does).  While the
    generation runs the model keeps one concatenation per layer, as wide as the layer's projections together; none
    once ``generate`` returns."""
    model = _model(family)
    ids = torch.randint(2, SIZE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    seen_off, seen_on = [], []
    off = _generate(model, ids, "off", seen_off)
    assert not any(seen_off)
    on = _generate(model, ids, "on", seen_on)
    assert torch.equal(on.sequences, off.sequences)
    for a, b in zip(on.logits, off.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    copies = seen_on[-1]
    assert len(copies) == SIZE["num_hidden_layers"]
    for attention in (layer.self_attn for layer in model.model.layers):
        linears = [m for m in attention.modules() if isinstance(m, torch.nn.Linear) and m is not attention.o_proj]
        (kept,) = [v for k, v in copies.items() if set(k) == {id(m) for m in linears}]
        assert kept[1].shape == (sum(m.out_features for m in linears), SIZE["hidden_size"])
        assert len(linears) == PROJECTIONS[family]
    assert model.model.projection_copies == {}


def _decode_by_hand(model, ids, setting: str = "on"):
    """A prompt and two decode steps through a cache, outside ``generate``: logits of the last step."""
    cache = model.make_cache()
    n = ids.shape[1] - 2
    with decoder_settings({"decode_projection_copies": setting}), torch.no_grad():
        model(input_ids=ids[:, :n], attention_mask=torch.ones(1, n, dtype=ids.dtype), past_key_values=cache)
        for t in (n, n + 1):
            mask = torch.ones(1, t + 1, dtype=ids.dtype)
            out = model(input_ids=ids[:, t : t + 1], attention_mask=mask, past_key_values=cache)
    return out.logits


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _gemms_of_one_decode_step(model, setting: str) -> int:
    ids = torch.randint(2, SIZE["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(2))
    cache = model.make_cache()
    with decoder_settings({"decode_projection_copies": setting}), torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        mask = torch.ones(1, ids.shape[1] + 1, dtype=ids.dtype)
        with _CountGemms() as count:
            model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cache, use_cache=True)
    return count.ops["mm"] + count.ops["addmm"]


@pytest.mark.parametrize("family", sorted(PROJECTIONS))
def test_a_decode_step_runs_one_gemm_for_the_layers_projections(family):
    model = _model(family)
    separate = _gemms_of_one_decode_step(model, "off")
    together = _gemms_of_one_decode_step(model, "on")
    assert separate - together == (PROJECTIONS[family] - 1) * SIZE["num_hidden_layers"]


def test_copies_follow_in_place_updates_and_generate_drops_them():
    """A decode loop by hand keeps its copies; an in-place update (an optimiser step: the version moves) remakes them
    at the next step; a write through ``.data`` (no version) is seen by the next ``generate``, which starts without
    copies (and frees its own when it returns); ``train()`` frees them."""
    model = _model("hybrid_sort")
    ids = torch.randint(2, SIZE["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(3))
    attention = model.model.layers[0].self_attn
    _decode_by_hand(model, ids)
    (key,) = [k for k in model.model.projection_copies if id(attention.v_proj) in k]
    first = model.model.projection_copies[key][1]
    with torch.no_grad():
        attention.v_proj.weight.mul_(1.5)
    torch.testing.assert_close(_decode_by_hand(model, ids), _decode_by_hand(copy.deepcopy(model), ids, "off"))
    second = model.model.projection_copies[key][1]
    assert second is not first
    rows = [id(m) for m in model.model.layers[0].self_attn._input_projections()]
    at = sum(m.out_features for m in attention._input_projections()[: rows.index(id(attention.v_proj))])
    torch.testing.assert_close(second[at : at + attention.v_proj.out_features], attention.v_proj.weight, rtol=0, atol=0)

    attention.v_proj.weight.data.mul_(-1.0)  # no version bump: the kept copies (of the loop by hand) miss it
    reference = copy.deepcopy(model)
    on = _generate(model, ids, "on")
    off = _generate(reference, ids, "off")
    for a, b in zip(on.logits, off.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert model.model.projection_copies == {}
    _decode_by_hand(model, ids)
    assert model.model.projection_copies
    model.train()
    assert model.model.projection_copies == {}


def test_auto_keeps_no_copies_on_the_cpu_and_a_bad_setting_is_named():
    model = _model("scalar_sort")
    ids = torch.randint(2, SIZE["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(4))
    seen = []
    _generate(model, ids, "auto", seen)
    assert not any(seen)
    with pytest.raises(ValueError, match=r"decode_projection_copies must be one of \('auto', 'on', 'off'\)"):
        _generate(model, ids, "always")


def test_no_copies_in_a_distributed_process(one_rank_gloo_group):
    """FSDP2 writes each forward's gathered weights into the same tensors with their versions unchanged, so a copy
    would go stale unseen (and hold unsharded weights): with torch.distributed initialised none is kept."""
    model = _model("hybrid_sort")
    ids = torch.randint(2, SIZE["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(5))
    seen = []
    _generate(model, ids, "on", seen)
    assert not any(seen)
