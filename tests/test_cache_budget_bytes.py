"""Cache memory per token and eviction budgets in bytes.

* ``cache_bytes_per_token`` (the formula of docs/decoding.md) equals the bytes the tensors of every family's cache
  layers hold (rbf, gka, scalar_sort, hybrid_sort with "dot" / "vlt" / sliding layers; dynamic and static caches);
* ``max_cache_bytes`` (config field, ``SortedScalarCache`` argument) becomes each layer's token bound from its own
  bytes per token, keeps the buffers within the budget, behaves as the equivalent ``max_cache_tokens``, is saved and
  loaded (AutoConfig, remote code) and excludes ``max_cache_tokens``;
* the static caches of the sorted families can be sized in bytes (``make_static_cache(max_cache_bytes=...)``,
  ``generate(..., cache_config={"max_cache_bytes": ...})``), and ``cache_config`` reaches ``static_decode_backend``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import FAMILY_CASES, HIDE_HF_RBF, build_model, make_config
from sorted_cache_helpers import SORT_CASES, check_layer_invariants, left_padded
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hf_rbf.cache_names import CACHE_NAME, output_cache
from hf_rbf.cache_sorted_scalar import (
    ByteBudgetSlidingWindowLayer,
    SortedScalarCache,
    SortedScalarCacheLayer,
)
from hf_rbf.cache_sorted_static import StaticSortedLayer
from hf_rbf.cache_static import (
    StaticDecoderCache,
    StaticKeyValueLayer,
    cache_bytes_per_token,
    static_cache_bytes_per_token,
    static_cache_len_for_bytes,
)

_DENSE = {c[0]: c for c in FAMILY_CASES}
_SORT = {c[0]: c for c in SORT_CASES}
MEMORY_CASES = [
    ("rbf", _DENSE["rbf-mixed-window-r2"][2]),  # rbf, dot, sliding layers, registers
    ("gka", _DENSE["gka-sssl-dot-r2"][2]),  # gka (sliding), dot
    ("gka", dict(num_hidden_layers=2, attention_layers=["gka", "vlt"])),
    ("scalar_sort", _SORT["scalar-pertoken-r2-g2"][2]),  # per_head orders, G < H
    ("scalar_sort", dict(_SORT["scalar-global-nosink-dot-window"][2], sort_scheme="sort_head")),  # dot, sliding
    ("hybrid_sort", _SORT["hybrid-kinds-r1-g2"][2]),  # full hybrid layers (vector keys, recent vector queries)
    ("hybrid_sort", _SORT["hybrid-mixed-layers-window"][2]),  # sliding hybrid, scalar, dot
]
PROMPT = 15  # + one decode step = 16 tokens: the dynamic sorted layers' initial capacity, the static capacity
CAPACITY = 16
BLOCK = 4


def held_bytes(layer) -> int:
    """The bytes of every tensor a cache layer holds (each storage once, whole: a view keeps its whole storage),
    except the static layers' slot mask of the last decode step (rebuilt at every step, see docs/decoding.md).  The
    static layers' buffers are their slices of the cache's stacked tensors (``StackedBuffers``): their bytes."""
    if isinstance(layer, (StaticKeyValueLayer, StaticSortedLayer)):
        assert not any(isinstance(v, torch.Tensor) for k, v in vars(layer).items() if k != "slot_mask")
        return sum(t.nbytes for t in layer.buffers().values())
    seen, total = set(), 0
    for name, value in vars(layer).items():
        if not isinstance(value, torch.Tensor) or name == "slot_mask":
            continue
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def held_slots(layer) -> int:
    """The token slots a layer's buffers hold (what the formula multiplies)."""
    if isinstance(layer, (StaticKeyValueLayer, StaticSortedLayer)):
        return layer.capacity
    if isinstance(layer, SortedScalarCacheLayer):
        assert layer.num_sorted == layer.num_slots == layer.capacity
        return layer.capacity
    if isinstance(layer, DynamicSlidingWindowLayer):
        # transformers keeps the last window - 1 tokens as a view of the step's concatenation: window tokens held
        return layer.sliding_window
    assert type(layer) is DynamicLayer
    return layer.keys.shape[-2]


def fill(model, cache, batch_lengths=(PROMPT, 12)):
    """A left-padded prompt and one decode step through ``cache``."""
    ids, mask = left_padded(model.config.vocab_size, list(batch_lengths))
    static = isinstance(cache, StaticDecoderCache)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: cache})
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step_mask = mask[:, -1:] if static else mask
        model(input_ids=ids[:, -1:], attention_mask=step_mask, **{CACHE_NAME: cache})
    return len(batch_lengths)


@pytest.mark.parametrize("cache_type", ["dynamic", "static"])
@pytest.mark.parametrize("case", MEMORY_CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MEMORY_CASES)])
def test_cache_bytes_per_token_equals_the_held_tensors(case, cache_type):
    family, overrides = case
    model = build_model(family, overrides)
    sorted_family = family in ("scalar_sort", "hybrid_sort")
    if cache_type == "static":
        cache = model.make_static_cache(CAPACITY, block_size=BLOCK) if sorted_family else model.make_static_cache(16)
    else:
        cache = model.make_cache()
    batch = fill(model, cache)
    memory = cache_bytes_per_token(model.config, cache_type, torch.float32, block_size=BLOCK)
    assert len(memory.per_row) == model.config.num_hidden_layers
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, SortedScalarCacheLayer):
            layer._merge_buffer()  # the steady state: every slot also in the sorted arrays
            assert layer.bytes_per_token() == memory.per_row[idx]
        slots = held_slots(layer)
        expected = (
            slots * (batch * memory.per_row[idx] + memory.shared[idx])
            + batch * memory.fixed_per_row[idx]
            + memory.fixed_shared[idx]
        )
        assert held_bytes(layer) == expected, (family, cache_type, idx, type(layer).__name__)
    if cache_type == "static":
        assert static_cache_bytes_per_token(model.config, torch.float32) == list(memory.per_row)
    # per_layer / total at a batch
    assert memory.per_layer(3) == [3 * r + s for r, s in zip(memory.per_row, memory.shared)]
    assert memory.total(3) == pytest.approx(sum(memory.per_layer(3)))


def test_cache_bytes_per_token_formula_by_kind():
    """The documented formulas at the 110M size (d768, H12), bf16: rbf / dot 2 H D item, gka H D item, a scalar
    per_head layer (G = 3, Dv = 64) and a hybrid layer (G = 12) of the dynamic cache."""
    size = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=64, vocab_size=64)
    rbf = cache_bytes_per_token(make_config("rbf", **size, attention_layers=["rbf", "dot"]), "dynamic")
    assert rbf.per_row == (2 * 12 * 64 * 2, 2 * 12 * 64 * 2) and rbf.total() == 6144
    gka = cache_bytes_per_token(make_config("gka", **size), "dynamic")
    assert gka.per_row == (12 * 64 * 2,) * 2
    scalar = cache_bytes_per_token(make_config("scalar_sort", **size), "dynamic")
    # by slot: 12 scalar keys + 3 * 64 values (bf16), validity, int64 token index; 12 orders of (bf16 key, int64 slot)
    assert scalar.per_row[0] == (12 + 192) * 2 + 1 + 8 + 12 * 10
    hybrid = cache_bytes_per_token(make_config("hybrid_sort", **size), "dynamic")
    assert hybrid.per_row[0] == (12 + 12 * 64 + 12 * 64) * 2 + 1 + 8 + 12 * 10
    density = cache_bytes_per_token(make_config("scalar_sort", **size, cache_eviction="density"), "dynamic")
    assert density.per_row[0] == scalar.per_row[0] + 13 * 2  # log-weight per head and multiplicity
    static = cache_bytes_per_token(make_config("scalar_sort", **size), "static")
    # the token index is shared by the rows; the static sorted runs keep int32 slots
    assert static.per_row[0] == scalar.per_row[0] - 8 - 12 * 4 and static.shared[0] == 8
    with pytest.raises(ValueError, match="`cache`"):
        cache_bytes_per_token(make_config("rbf", **size), "paged")


def test_density_eviction_layer_bytes_per_token():
    """After density merging (log-weights and multiplicities allocated), the by-slot and sorted tensors per slot /
    sorted entry add up to the formula."""
    model = build_model("scalar_sort", dict(decode_window=3, max_cache_tokens=8, cache_eviction="density"))
    ids, mask = left_padded(model.config.vocab_size, [14, 11])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
    memory = cache_bytes_per_token(model.config, "dynamic", torch.float32)
    for idx, layer in enumerate(output_cache(out).layers):
        assert layer.multiplicity is not None and layer.log_weight is not None
        b = layer.batch_size
        by_slot = sum(getattr(layer, n).nbytes for n, _ in layer._slot_tensors() if getattr(layer, n) is not None)
        by_entry = layer.sorted_keys.nbytes + layer.sorted_slots.nbytes
        per_token = by_slot / (b * layer.capacity) + by_entry / (b * layer.num_sorted)
        assert per_token == memory.per_row[idx] == layer.bytes_per_token()


# -- eviction budgets in bytes --------------------------------------------------------------------------------------
def test_max_cache_bytes_excludes_max_cache_tokens():
    with pytest.raises(ValueError, match=r"max_cache_tokens.*max_cache_bytes"):
        make_config("scalar_sort", max_cache_tokens=8, max_cache_bytes=4096)
    with pytest.raises(ValueError, match=r"max_cache_tokens.*max_cache_bytes"):
        SortedScalarCache(max_cache_tokens=8, max_cache_bytes=4096)
    with pytest.raises(ValueError, match=r"max_cache_tokens.*max_cache_bytes"):
        SortedScalarCacheLayer(num_heads=2, num_value_groups=1, max_cache_tokens=8, max_cache_bytes=4096)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_cache_bytes"):
            make_config("hybrid_sort", max_cache_bytes=bad)
    with pytest.raises(ValueError, match="max_cache_bytes"):
        ByteBudgetSlidingWindowLayer(0)


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_max_cache_bytes_round_trip(family, tmp_path):
    from transformers import AutoConfig

    cfg = make_config(family, max_cache_bytes=12345, cache_eviction="oldest")
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["max_cache_bytes"] == 12345
    back = AutoConfig.from_pretrained(tmp_path)
    assert type(back) is type(cfg) and back.max_cache_bytes == 12345 and back.max_cache_tokens is None
    assert back.sorted_cache_settings()["max_cache_bytes"] == 12345


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("scalar_sort", _SORT["scalar-global-nosink-dot-window"][2]),
        ("hybrid_sort", _SORT["hybrid-mixed-layers-window"][2]),
        ("hybrid_sort", _SORT["hybrid-kinds-r1-g2"][2]),
    ],
)
def test_max_cache_bytes_is_each_layers_token_bound(family, overrides):
    """Every layer turns the budget into its own token bound from its bytes per token (so layers of different kinds
    keep different numbers of tokens), holds at most that many tokens, and its per-token buffers stay within the
    budget (the sorted layers' slot capacity never grows past the bound)."""
    budget = 2500
    model = build_model(family, dict(overrides, max_cache_bytes=budget, decode_window=3, cache_eviction="oldest"))
    ids, mask = left_padded(model.config.vocab_size, [20, 13])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
    memory = cache_bytes_per_token(model.config, "dynamic", torch.float32)
    bounds = []
    for idx, layer in enumerate(output_cache(out).layers):
        per_token = memory.per_row[idx]
        if isinstance(layer, SortedScalarCacheLayer):
            check_layer_invariants(layer)
            assert layer.max_cache_tokens == budget // per_token == budget // layer.bytes_per_token()
            assert layer.capacity <= layer.max_cache_tokens
            b = layer.batch_size
            held = sum(getattr(layer, n).nbytes for n, _ in layer._slot_tensors() if getattr(layer, n) is not None)
            held += layer.sorted_keys.nbytes + layer.sorted_slots.nbytes
            assert held <= b * budget
        else:
            assert isinstance(layer, ByteBudgetSlidingWindowLayer)
            assert layer.bytes_per_token == per_token and layer.max_cache_tokens == budget // per_token
            window = model.config.layer_window(idx)
            expected = budget // per_token + 1 if window is None else min(window, budget // per_token + 1)
            assert layer.sliding_window == expected
            assert layer.keys.shape[-2] == expected - 1 and layer.keys.shape[-2] * per_token <= budget
        bounds.append(layer.max_cache_tokens)
    if len(set(memory.per_row)) > 1:  # kinds with different costs keep different token counts
        assert len(set(bounds)) > 1


def test_max_cache_bytes_equals_the_equivalent_token_bound():
    """A scalar-only model: ``max_cache_bytes = 6 * bytes per token`` evicts exactly as ``max_cache_tokens = 6``
    (same tokens and logits, eviction every step)."""
    base = dict(num_hidden_layers=2, decode_window=3, cache_eviction="geometric", eviction_batch=1)
    per_token = cache_bytes_per_token(make_config("scalar_sort", **base), "dynamic", torch.float32).per_row
    assert per_token[0] == per_token[1]
    by_tokens = build_model("scalar_sort", dict(base, max_cache_tokens=6))
    by_bytes = build_model("scalar_sort", dict(base, max_cache_bytes=int(6 * per_token[0] + per_token[0] - 1)))
    ids, mask = left_padded(by_tokens.config.vocab_size, [11, 8])
    results = []
    for model in (by_tokens, by_bytes):
        with torch.no_grad():
            results.append(
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=10,
                    do_sample=False,
                    pad_token_id=0,
                    return_dict_in_generate=True,
                    output_logits=True,
                )
            )
    assert torch.equal(results[0].sequences, results[1].sequences)
    assert max((a - b).abs().max().item() for a, b in zip(results[0].logits, results[1].logits)) == 0.0
    for layer in output_cache(results[1]).layers:
        assert layer.max_cache_tokens == 6 and int(layer.valid_counts().max()) <= 6
    # and differs from no eviction (the bound is reached)
    free = build_model("scalar_sort", base)
    with torch.no_grad():
        unbounded = free.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    assert max((a - b).abs().max().item() for a, b in zip(unbounded.logits, results[1].logits)) > 1e-4


def test_a_cache_budget_replaces_the_configs_budget_in_the_other_unit():
    model = build_model("scalar_sort", dict(max_cache_bytes=4000, decode_window=3))
    cache = SortedScalarCache(max_cache_tokens=5)
    settings = cache.resolved_settings(model.config)
    assert settings["max_cache_tokens"] == 5 and settings["max_cache_bytes"] is None
    assert SortedScalarCache(max_cache_tokens=None).resolved_settings(model.config)["max_cache_bytes"] is None
    layers = model.make_cache(max_cache_tokens=5).layers
    assert all(layer.max_cache_tokens == 5 and layer.max_cache_bytes is None for layer in layers)
    other = build_model("scalar_sort", dict(max_cache_tokens=5))
    settings = SortedScalarCache(max_cache_bytes=900).resolved_settings(other.config)
    assert settings["max_cache_tokens"] is None and settings["max_cache_bytes"] == 900


def test_a_budget_below_one_token_is_refused():
    model = build_model("scalar_sort", dict(max_cache_bytes=10))
    ids, mask = left_padded(model.config.vocab_size, [5, 3])
    with pytest.raises(ValueError, match="max_cache_bytes"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True)
    layer = SortedScalarCacheLayer(num_heads=2, num_value_groups=1, max_cache_bytes=200, eviction_batch=50)
    with pytest.raises(ValueError, match=r"eviction_batch.*max_cache_bytes"):
        layer.append(torch.zeros(1, 2, 3), torch.zeros(1, 1, 3, 4))


def test_prompt_longer_than_the_budget_gives_the_memory_back():
    model = build_model("scalar_sort", dict(max_cache_bytes=2000, cache_eviction="oldest", eviction_batch=1))
    ids = torch.randint(1, model.config.vocab_size, (1, 40))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    for layer in output_cache(out).layers:
        check_layer_invariants(layer)
        assert layer.capacity == layer.max_cache_tokens == 2000 // layer.bytes_per_token() < 40


_REMOTE_SCRIPT = (
    HIDE_HF_RBF
    + """
import torch
from transformers import AutoModelForCausalLM

ckpt, data = sys.argv[1], sys.argv[2]
ref = torch.load(data)
model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
with torch.no_grad():
    out = model.generate(ref["ids"], attention_mask=ref["mask"], max_new_tokens=8, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
cache = out.get("cache") or out.get("past_key_values")
print(json.dumps({
    "tokens_equal": bool(torch.equal(out.sequences, ref["tokens"])),
    "max_cache_bytes": model.config.max_cache_bytes,
    "bounds": [getattr(layer, "max_cache_tokens", None) for layer in cache.layers],
    "hf_rbf_loaded": any(m == "hf_rbf" or m.startswith("hf_rbf.") for m in sys.modules),
}))
"""
)


def test_max_cache_bytes_through_remote_code(tmp_path, hf_home):
    overrides = dict(_SORT["hybrid-mixed-layers-window"][2], decode_window=3, max_cache_bytes=2000)
    model = build_model("hybrid_sort", overrides)
    ids, mask = left_padded(model.config.vocab_size, [12, 9])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
    bounds = [layer.max_cache_tokens for layer in output_cache(out).layers]
    model.save_pretrained(tmp_path / "ckpt")
    torch.save({"ids": ids, "mask": mask, "tokens": out.sequences}, tmp_path / "ref.pt")
    (tmp_path / "load.py").write_text(_REMOTE_SCRIPT)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["HF_HOME"] = hf_home
    env["HF_MODULES_CACHE"] = os.path.join(str(tmp_path), "modules")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "load.py"), str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens_equal"] and result["max_cache_bytes"] == 2000 and not result["hf_rbf_loaded"], result
    assert result["bounds"] == bounds and None not in bounds


# -- static caches ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_static_cache_sized_in_bytes(family):
    overrides = _SORT["scalar-global-nosink-dot-window" if family == "scalar_sort" else "hybrid-mixed-layers-window"][2]
    model = build_model(family, dict(overrides, decode_window=3))
    budget = 9000
    capacity = static_cache_len_for_bytes(model.config, budget, torch.float32, block_size=BLOCK)
    cache = model.make_static_cache(max_cache_bytes=budget, block_size=BLOCK)
    assert cache.max_cache_len == capacity
    memory = cache_bytes_per_token(model.config, "static", torch.float32, block_size=BLOCK)
    fill(model, cache, (7, 5))
    costs = memory.per_layer(1)
    assert any((capacity + BLOCK) * cost > budget for cost in costs)  # the largest capacity within the budget
    for idx, layer in enumerate(cache.layers):
        assert layer.capacity * costs[idx] <= budget
    # generate: the same tokens as the dynamic cache; a budget too small for prompt + new tokens is refused
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    params = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dynamic = model.generate(ids, attention_mask=mask, **params)
        static = model.generate(
            ids,
            attention_mask=mask,
            cache_implementation="static",
            cache_config={"max_cache_bytes": budget, "block_size": BLOCK},
            **params,
        )
        assert torch.equal(dynamic, static)
        with pytest.raises(ValueError, match="max_cache_bytes"):
            model.generate(
                ids,
                attention_mask=mask,
                cache_implementation="static",
                cache_config={"max_cache_bytes": 300, "block_size": BLOCK},
                **params,
            )
    with pytest.raises(ValueError, match="max_cache_len.*max_cache_bytes"):
        model.make_static_cache(capacity + 1, block_size=BLOCK, max_cache_bytes=budget)
    with pytest.raises(ValueError, match="max_cache_len"):
        model.make_static_cache()


@pytest.mark.parametrize("family", ["rbf", "gka"])
def test_dense_static_cache_sized_in_bytes(family):
    """rbf / gka (``DecoderModel.make_static_cache``): the capacity from the byte budget, every layer within it, the
    same tokens as the dynamic cache, and the errors naming the arguments."""
    model = build_model(family, {"num_register_tokens": 1})
    budget = 4000
    capacity = static_cache_len_for_bytes(model.config, budget, torch.float32)
    cache = model.make_static_cache(max_cache_bytes=budget)
    assert cache.max_cache_len == capacity
    costs = cache_bytes_per_token(model.config, "static", torch.float32).per_layer(1)
    assert all(capacity * c <= budget < (capacity + 1) * c for c in costs)  # every layer full: the same cost
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    params = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dynamic = model.generate(ids, attention_mask=mask, **params)
        static = model.generate(
            ids, attention_mask=mask, cache_implementation="static", cache_config={"max_cache_bytes": budget}, **params
        )
        assert torch.equal(dynamic, static)
        with pytest.raises(ValueError, match="max_cache_bytes"):
            model.generate(
                ids, attention_mask=mask, cache_implementation="static", cache_config={"max_cache_bytes": 200}, **params
            )
    with pytest.raises(ValueError, match="max_cache_len.*max_cache_bytes"):
        model.make_static_cache(capacity + 1, max_cache_bytes=budget)
    with pytest.raises(ValueError, match="max_cache_len"):
        model.make_static_cache()


def test_static_cache_refuses_the_configs_byte_budget():
    model = build_model("scalar_sort", dict(max_cache_bytes=4000))
    with pytest.raises(ValueError, match="max_cache_bytes"):
        model.make_static_cache(16)
    # an explicit size in bytes (or no budget) replaces the config's eviction budget
    assert model.make_static_cache(max_cache_bytes=4000).max_cache_len >= 1
    assert model.make_static_cache(16, max_cache_bytes=None, max_cache_tokens=None).max_cache_len == 16


def test_static_cache_len_for_bytes_bounds():
    cfg = make_config("scalar_sort", num_hidden_layers=2, attention_layers=["scalar", "dot"])
    costs = cache_bytes_per_token(cfg, "static", torch.float32).per_layer(1)
    assert static_cache_len_for_bytes(cfg, int(10 * max(costs)), torch.float32, block_size=64) == 10  # < one block
    assert static_cache_len_for_bytes(cfg, int(130 * max(costs)), torch.float32, block_size=64) == 130
    scalar_only = make_config("scalar_sort", num_hidden_layers=1, attention_layers=["scalar"])
    cost = cache_bytes_per_token(scalar_only, "static", torch.float32).per_layer(1)[0]
    assert static_cache_len_for_bytes(scalar_only, int(130 * cost), torch.float32, block_size=64) == 128
    with pytest.raises(ValueError, match="max_cache_bytes"):
        static_cache_len_for_bytes(cfg, 3, torch.float32)


def test_generate_cache_config_reaches_static_decode_backend():
    model = build_model("scalar_sort", dict(_SORT["scalar-pertoken-r2-g2"][2], decode_window=3))
    ids, mask = left_padded(model.config.vocab_size, [9, 6])
    params = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            cache_implementation="static",
            cache_config={"static_decode_backend": "torch", "block_size": BLOCK},
            **params,
        )
        default = model.generate(
            ids, attention_mask=mask, cache_implementation="static", cache_config={"block_size": BLOCK}, **params
        )
        with pytest.raises(ValueError, match="static_decode_backend"):
            model.generate(
                ids,
                attention_mask=mask,
                cache_implementation="static",
                cache_config={"static_decode_backend": "cuda-graphs"},
                **params,
            )
    chosen = [layer for layer in output_cache(out).layers if isinstance(layer, StaticSortedLayer)]
    assert chosen and all(layer.static_decode_backend == "torch" for layer in chosen)
    assert all(layer.decode_backend_used == "torch" for layer in chosen)
    defaults = [layer for layer in output_cache(default).layers if isinstance(layer, StaticSortedLayer)]
    assert all(layer.static_decode_backend == "auto" for layer in defaults)  # the layer's own default
    assert torch.equal(out.sequences, default.sequences)
