"""The fused static sorted decode step (``hf_rbf.kernels_sorted_static_decode``) against the PyTorch static path it
replaces (``StaticSortedLayer`` with ``static_decode_backend="torch"``) and the float64 brute-force definition.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest sets ``TRITON_INTERPRET=1`` before triton is
imported); with CUDA the same tests launch it on the GPU.  Cases: both sort schemes, scalar and hybrid layers (a
per-head dot scale with a zero), block sizes 1 / 2 / 4 / 8 (the first decode step in a fresh block and in a partly
filled one), windows 1 / 3 / 5 and one covering every token (= dense decode), left padding (rows of different
lengths), a padded decode token, a row with no token at all (no NaN), no prefix, float32, bfloat16 and float64.  Every
step compares the output and the layer's buffers (by-slot entries, sorted runs, fill copies, length) of the two paths.
"""

from __future__ import annotations

import re

import pytest
import torch

from hf_rbf.cache_sorted_static import STATIC_DECODE_BACKENDS, StaticSortedLayer
from hf_rbf.kernels_common import next_pow2
from hf_rbf.kernels_sorted_static_decode import MAX_CANDIDATES, candidate_span, static_decode_unavailable_reason
from hf_rbf.sorted_decode import sorted_window_attention_reference

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the fused kernel against the torch path (same dtype): summation order only
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}
# either path against the float64 definition (the inputs rounded to the dtype first)
REF_TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 5e-2}


def _layer(backend, *, b_heads, scheme, window, block_size, capacity):
    h, g = b_heads
    order_heads = list(range(h)) if scheme == "per_head" else [grp * (h // g) + 1 for grp in range(g)]
    return StaticSortedLayer(
        max_cache_len=capacity,
        num_heads=h,
        num_value_groups=g,
        order_heads=order_heads,
        decode_window=window,
        block_size=block_size,
        static_decode_backend=backend,
    )


def run_both(
    *,
    scheme="per_head",
    hybrid=False,
    window=3,
    block_size=4,
    prompt=5,
    steps=4,
    dtype=torch.float32,
    prefix=True,
    batch=2,
    heads=4,
    groups=2,
    capacity=None,
    dead_row=False,
    seed=0,
    ref_window="same",
    discrete=False,
    keys=None,
    query=None,
    pad=3,
):
    """Feed the same prompt and single-token steps to a torch-path and a triton-path layer; per step
    ``(out_torch, out_triton, out_reference_float64)`` and, after each step, the two layers (checked equal).
    ``ref_window``: the window of the float64 definition (default: the layers' window; None: dense attention);
    ``keys`` ``[B, H, n]`` / ``query`` (a float): the scalar keys / every scalar query instead of random ones;
    ``pad``: left-padding slots of row 1 (its first block's run ends in as many empty, ``+inf``, entries)."""
    gen = torch.Generator().manual_seed(seed)
    n = prompt + steps
    capacity = capacity or n + 3
    b, h, g, dv, d = batch, heads, groups, 3, 5
    kw = dict(b_heads=(h, g), scheme=scheme, window=window, block_size=block_size, capacity=capacity)
    ref_layer, fused = _layer("torch", **kw), _layer("triton", **kw)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    ks, v = r(b, h, n), r(b, g, n, dv)
    if keys is not None:
        ks = keys.to(dtype)
    if discrete:  # keys in {-2, ..., 2}: ties everywhere, at the window's edges, across blocks and with the new token
        ks = torch.randint(-2, 3, (b, h, n), generator=gen).to(dtype)
    vk = r(b, h, n, d) if hybrid else None
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :pad] = False  # left padding: row 1 is shorter
    valid[0, prompt + 1] = False  # a padded decode token
    if dead_row:
        valid[b - 1] = False
    ks[0, :, 2] = ks[0, :, 1]  # equal order keys (ties by slot)
    tau = torch.rand(h, generator=gen, dtype=torch.float64) + 0.3
    scale = torch.tensor([0.4, 0.0, 0.3, 0.5][:h], dtype=torch.float64) if hybrid else None
    pre = dict(prefix_ks=r(1, h, 2), prefix_v=r(1, g, 2, dv), prefix_k=r(1, h, 2, d) if hybrid else None)
    if not prefix:
        pre = dict(prefix_ks=None, prefix_v=None, prefix_k=None)

    def dev(x):
        return None if x is None else x.to(DEVICE)

    def part(x, lo, hi):
        return None if x is None else dev(x[:, :, lo:hi])

    for layer in (ref_layer, fused):
        layer.append(part(ks, 0, prompt), part(v, 0, prompt), part(vk, 0, prompt), valid=dev(valid[:, :prompt]))
    results = []
    for t in range(prompt, n):
        qs, q = r(b, h, 1), (r(b, h, 1, d) if hybrid else None)
        if discrete:  # on a key value, or between two
            qs = torch.randint(-4, 5, (b, h, 1), generator=gen).to(dtype) / 2
        if query is not None:
            qs = torch.full((b, h, 1), query, dtype=dtype)
        outs = []
        for layer in (ref_layer, fused):
            layer.append(part(ks, t, t + 1), part(v, t, t + 1), part(vk, t, t + 1), valid=dev(valid[:, t : t + 1]))
            args = {name: dev(x) for name, x in pre.items()}
            scale_arg = dev(scale.to(dtype)) if hybrid else None
            outs.append(layer.attend(dev(qs), dev(tau.to(dtype)), q=dev(q), scale=scale_arg, **args).cpu())
        ref = sorted_window_attention_reference(
            ks[:, :, : t + 1],
            v[:, :, : t + 1],
            valid[:, : t + 1],
            torch.arange(t + 1).expand(b, -1),
            qs,
            tau.to(dtype),
            window=window if ref_window == "same" else ref_window,
            query_token_index=torch.tensor([t]),
            order_head=torch.tensor(ref_layer.order_heads),
            vector_keys=vk[:, :, : t + 1] if hybrid else None,
            q=q,
            scale=None if scale is None else scale.to(dtype),
            **pre,
        )
        assert_same_state(ref_layer, fused, t)
        results.append((outs[0], outs[1], ref))
    return results, ref_layer, fused


def assert_same_state(a: StaticSortedLayer, b: StaticSortedLayer, step) -> None:
    """The torch-path layer ``a`` and the fused one ``b`` hold the same state: by-slot buffers, length, every block
    but the one being filled, and that block's run, which the fused step keeps in fill copy ``n % 2`` only (it writes
    the block buffer when the block completes; the torch insert writes both)."""
    assert a.decode_backend_used == "torch" and b.decode_backend_used == "triton"
    assert b._pending is None
    for name in ("keys", "values", "vector_keys", "valid", "token_index", "cumulative_length"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None
            continue
        assert torch.equal(x, y), (name, step)
    n, t = int(a.cumulative_length), a.block_size
    settled = torch.ones(a.num_blocks, dtype=torch.bool)
    if n % t:
        settled[n // t] = False
        parity = n % 2
        assert torch.equal(a.fill_keys[:, :, parity], b.fill_keys[:, :, parity]), step
        assert torch.equal(a.sorted_keys[:, :, n // t], b.fill_keys[:, :, parity]), step
        current = torch.isfinite(a.fill_keys[:, :, parity])
        assert torch.equal(a.fill_slots[:, :, parity][current], b.fill_slots[:, :, parity][current]), step
    assert torch.equal(a.sorted_keys[:, :, settled], b.sorted_keys[:, :, settled]), step
    # slots of empty (+inf) entries carry no meaning
    finite = torch.isfinite(a.sorted_keys[:, :, settled])
    assert torch.equal(a.sorted_slots[:, :, settled][finite], b.sorted_slots[:, :, settled][finite]), step
    assert int(b.decode_counter) == 0


def check(results, dtype) -> None:
    for i, (torch_out, fused_out, ref) in enumerate(results):
        assert torch.isfinite(fused_out).all(), i
        assert (fused_out.double() - torch_out.double()).abs().max().item() <= TOL[dtype], i
        assert (fused_out.double() - ref).abs().max().item() <= REF_TOL[dtype], i


CASES = {
    "scalar-per_head-T4-k3": dict(),
    "hybrid-sort_head-T8-k5": dict(hybrid=True, scheme="sort_head", window=5, block_size=8, prompt=6),
    "scalar-k1-T2-fresh-block": dict(window=1, block_size=2, prompt=4, steps=3),
    "hybrid-per_head-T1-k2": dict(hybrid=True, window=2, block_size=1, prompt=4, steps=3),
    "scalar-sort_head-no-prefix-G1": dict(scheme="sort_head", prefix=False, groups=1, window=4),
    "bf16-hybrid": dict(hybrid=True, dtype=torch.bfloat16, window=4, block_size=8),
    "float64-hybrid": dict(hybrid=True, dtype=torch.float64, window=3, block_size=4, steps=3),
    "ties-scalar-T4-k3": dict(discrete=True, prompt=9, steps=5),
    "ties-hybrid-sort_head-T2-k2": dict(discrete=True, hybrid=True, scheme="sort_head", window=2, block_size=2),
    # a block length that is no power of two (what "blocksN" block sizes give: N blocks of ceil(C / N))
    "scalar-T6-k3": dict(block_size=6, prompt=9, steps=5),
    "hybrid-T12-k5": dict(hybrid=True, window=5, block_size=12, prompt=14, steps=4),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_step_equals_the_torch_path_and_the_definition(case):
    kwargs = CASES[case]
    results, _, _ = run_both(**kwargs)
    check(results, kwargs.get("dtype", torch.float32))


@pytest.mark.parametrize("seed", range(8))
def test_k_candidates_per_block_hold_the_window_on_random_layouts(seed):
    """The kernel takes ``k`` entries of each block's run around the query's insertion point (``CANDIDATE_SPAN``
    "k"; the torch path takes ``2k``), which holds the window only if the clamps at the ends are right: random odd
    and even windows, several blocks, long left padding (runs ending in empty ``+inf`` entries), ties, and queries
    below every key, above every key (the window shifted down: up to ``k`` keys below the query from one padded
    block) or among them."""
    g = torch.Generator().manual_seed(100 + seed)
    window = int(torch.randint(2, 8, (1,), generator=g))
    block = int(torch.randint(window, 3 * window + 2, (1,), generator=g))
    prompt = int(torch.randint(2 * block, 4 * block + 1, (1,), generator=g))
    pad = int(torch.randint(1, block + 1, (1,), generator=g))
    results, _, _ = run_both(
        window=window, block_size=block, prompt=prompt, steps=3, pad=pad, query=(None, 6.0, -6.0)[seed % 3],
        discrete=seed % 2 == 1, hybrid=seed % 4 == 0, seed=seed,
    )  # fmt: skip
    check(results, torch.float32)


def test_candidate_span_and_fanout_settings(monkeypatch):
    """``CANDIDATE_SPAN`` "2k" (the torch path's candidates, for A/B runs) and another ``FANOUT`` give the same
    steps; values the kernel cannot take are refused naming the setting and the allowed values."""
    import hf_rbf.kernels_sorted_static_decode as static_decode

    assert static_decode.candidate_span(64, 66816) == (64, 32)
    assert static_decode.candidate_span(64, 40) == (40, 32)
    monkeypatch.setattr(static_decode, "CANDIDATE_SPAN", "2k")
    assert static_decode.candidate_span(64, 66816) == (128, 64)
    monkeypatch.setattr(static_decode, "FANOUT", 4)
    results, _, _ = run_both(window=3, block_size=8, prompt=13, steps=3, query=100.0)
    check(results, torch.float32)
    monkeypatch.setattr(static_decode, "CANDIDATE_SPAN", "3k")
    with pytest.raises(ValueError, match='CANDIDATE_SPAN must be "k" or "2k"; got \'3k\''):
        static_decode.candidate_span(64, 128)
    monkeypatch.setattr(static_decode, "CANDIDATE_SPAN", "k")
    monkeypatch.setattr(static_decode, "FANOUT", 12)
    with pytest.raises(ValueError, match="FANOUT must be a power of two from 2 to 256; got 12"):
        run_both(window=3, block_size=8, prompt=13, steps=2)


def test_window_at_the_top_of_a_block_with_padding():
    """A query above every key takes the ``k`` largest, here all from one block whose run ends in padding (``+inf``):
    the block's candidates must reach ``k`` entries below the insertion point even though the run is not full."""
    n = 24
    keys = torch.linspace(-1.0, 0.0, n, dtype=torch.float64).expand(2, 4, n).clone()
    keys[:, :, 5:16] += 10.0  # slots 5..15 (block 0 of 16, after 4 padding slots of row 1) hold the largest keys
    results, _, _ = run_both(keys=keys, query=100.0, window=2, block_size=16, prompt=20, steps=4, capacity=32)
    check(results, torch.float32)


def test_window_covering_the_tokens_equals_dense_decode():
    """``decode_window >= n`` (and < capacity, so the windowed path runs) gives exact attention over every token, in
    float64: the fused step equals the definition without a window."""
    dtype, window = torch.float64, 12
    results, _, fused = run_both(
        hybrid=True, dtype=dtype, window=window, prompt=6, steps=3, capacity=16, ref_window=None
    )
    assert fused.windowed and fused.capacity > window >= int(fused.cumulative_length)
    check(results, dtype)


def test_rows_without_tokens_give_the_prefix_or_zeros():
    """A row whose every token is padding attends to the prefix alone (no NaN); without a prefix its output is 0."""
    results, _, _ = run_both(dead_row=True, steps=2)
    check(results, torch.float32)
    results, _, _ = run_both(dead_row=True, steps=2, prefix=False, hybrid=True)
    check(results, torch.float32)
    for _, fused_out, _ in results:
        assert torch.equal(fused_out[-1], torch.zeros_like(fused_out[-1]))


def test_backend_choice_and_errors():
    kw = dict(b_heads=(4, 2), scheme="per_head", window=3, block_size=4, capacity=16)
    with pytest.raises(ValueError, match=r"`static_decode_backend` must be one of \('auto', 'triton', 'torch'\)"):
        _layer("cuda", **kw)
    assert STATIC_DECODE_BACKENDS == ("auto", "triton", "torch")
    layer = _layer("auto", **kw)
    layer.append(torch.randn(1, 4, 3, device=DEVICE), torch.randn(1, 2, 3, 2, device=DEVICE))
    if DEVICE.type == "cuda":
        assert layer.decode_backend_used == "triton" and layer.decode_backend_reason is None
    else:  # "auto" takes the kernel on CUDA only; the interpreter is for tests
        assert layer.decode_backend_used == "torch" and "CUDA" in layer.decode_backend_reason
    layer.static_decode_backend = "triton"
    assert layer.decode_backend_used == "triton"
    with pytest.raises(ValueError, match="static_decode_backend"):
        layer.static_decode_backend = "fused"
    # a candidate tile too large for the kernel: "triton" refuses and names block_size, "auto" keeps torch
    blocks = MAX_CANDIDATES // 2  # x min(2k, T) = 4 candidates per block: twice the limit
    big = dict(kw, capacity=blocks * 4, window=64)
    reason = static_decode_unavailable_reason(
        DEVICE, torch.float32, num_blocks=blocks, block_size=4, window=64, value_dim=2
    )
    assert reason is not None and "block_size" in reason
    layer = _layer("triton", **big)
    with pytest.raises(ValueError, match="block_size"):
        layer.append(torch.randn(1, 4, 1, device=DEVICE), torch.randn(1, 2, 1, 2, device=DEVICE))
    layer = _layer("auto", **big)
    layer.append(torch.randn(1, 4, 1, device=DEVICE), torch.randn(1, 2, 1, 2, device=DEVICE))
    assert layer.decode_backend_used == "torch"
    # a layer without a window reads every slot exactly: nothing for the kernel to do
    layer = _layer("triton", **dict(kw, window=None))
    layer.append(torch.randn(1, 4, 3, device=DEVICE), torch.randn(1, 2, 3, 2, device=DEVICE))
    assert layer.decode_backend_used == "torch" and not layer.windowed


def test_switching_backends_between_steps_and_reading_in_between():
    """The backends share the layer's state: alternating them step by step (and reading the layer between ``append``
    and ``attend``, which inserts the recorded token through the torch path) gives the torch path's outputs."""
    gen = torch.Generator().manual_seed(3)
    kw = dict(b_heads=(4, 2), scheme="sort_head", window=2, block_size=4, capacity=16)
    ref, mixed = _layer("torch", **kw), _layer("triton", **kw)
    prompt = torch.randn(2, 4, 5, generator=gen), torch.randn(2, 2, 5, 3, generator=gen)
    for layer in (ref, mixed):
        layer.append(*(x.to(DEVICE) for x in prompt))
    for step in range(5):
        mixed.static_decode_backend = ("triton", "torch")[step % 2]
        token = torch.randn(2, 4, 1, generator=gen), torch.randn(2, 2, 1, 3, generator=gen)
        qs = torch.randn(2, 4, 1, generator=gen)
        outs = []
        for layer in (ref, mixed):
            layer.append(*(x.to(DEVICE) for x in token))
            if step == 2:
                assert int(layer.get_seq_length()) == 5 + step + 1  # the recorded token is inserted first
            outs.append(layer.attend(qs.to(DEVICE), 0.7))
        assert (outs[0] - outs[1]).abs().max().item() < TOL[torch.float32], step
        assert torch.equal(current_runs(ref), current_runs(mixed)), step
        n, t = int(mixed.cumulative_length), mixed.block_size
        if step % 2 == 0 and n % t:  # after a fused step the block being filled is current in its fill copy only
            assert not torch.equal(mixed.sorted_keys[:, :, n // t], current_runs(mixed)[:, :, n // t]), step


def current_runs(layer: StaticSortedLayer) -> torch.Tensor:
    """The layer's sorted runs as they are now: the block buffers, with the block being filled taken from fill copy
    ``n % 2`` (the fused step writes a block's buffer only when it completes the block)."""
    runs = layer.sorted_keys.clone()
    n, t = int(layer.cumulative_length), layer.block_size
    if n % t:
        runs[:, :, n // t] = layer.fill_keys[:, :, n % 2]
    return runs


def test_compiled_step_is_one_graph():
    """``torch.compile(fullgraph=True)`` of ``append`` + ``attend`` through the fused op: one graph for every step
    (the length is a device tensor, nothing is read back), the torch path's outputs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(4)
    kw = dict(b_heads=(4, 2), scheme="per_head", window=3, block_size=4, capacity=16)
    ref, fused = _layer("torch", **kw), _layer("triton", **kw)
    prompt = [torch.randn(2, 4, 6, generator=gen), torch.randn(2, 2, 6, 3, generator=gen), torch.randn(2, 4, 6, 5)]
    for layer in (ref, fused):
        layer.append(*(x.to(DEVICE) for x in prompt))

    def step(layer, ks, v, vk, qs, q):
        layer.append(ks, v, vk)
        return layer.attend(qs, 0.5, q=q, scale=0.3)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i in range(3):
        args = [torch.randn(2, 4, 1), torch.randn(2, 2, 1, 3), torch.randn(2, 4, 1, 5), torch.randn(2, 4, 1)]
        args = [x.to(DEVICE) for x in args + [torch.randn(2, 4, 1, 5)]]
        expected = step(ref, *args)
        got = compiled(fused, *args)
        assert (expected - got).abs().max().item() < TOL[torch.float32], i
    assert counter.frame_count == 1
    assert_same_state(ref, fused, "compiled")


def test_model_decode_with_the_fused_step_equals_the_torch_path():
    """A hybrid model (per-head kinds: "dot" heads read every slot, registers and the sink in the prefix) decodes
    through static caches with the fused step the logits of the torch path."""
    from conftest import build_model
    from sorted_cache_helpers import SORT_CASES, left_padded

    from hf_rbf.cache_names import CACHE_NAME

    case = {c[0]: c for c in SORT_CASES}["hybrid-kinds-r1-g2"]
    overrides = dict(case[2], decode_window=3)
    model = build_model("hybrid_sort", overrides).to(DEVICE)
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    caches = {}
    logits = {}
    with torch.no_grad():
        for backend in ("torch", "triton"):
            cache = model.make_static_cache(16, block_size=4)
            for layer in cache.layers:
                if isinstance(layer, StaticSortedLayer):
                    layer.static_decode_backend = backend
            out = model(input_ids=ids, attention_mask=mask, **{CACHE_NAME: cache})
            steps = [out.logits[:, -1]]
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(3):
                out = model(input_ids=token, attention_mask=torch.ones_like(token), **{CACHE_NAME: cache})
                steps.append(out.logits[:, -1])
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            caches[backend], logits[backend] = cache, torch.stack(steps)
    sorted_layers = [layer for layer in caches["triton"].layers if isinstance(layer, StaticSortedLayer)]
    assert sorted_layers and all(layer.decode_backend_used == "triton" for layer in sorted_layers)
    assert (logits["torch"] - logits["triton"]).abs().max().item() < 3e-5


def test_benchmark_smoke_run(tmp_path):
    """The GPU benchmark's CPU check (``--smoke``): tiny shapes, both backends, JSON and markdown written."""
    import json

    from benchmarks.bench_sorted_static_decode import main  # the repository root is on the path (conftest)

    assert main(["--smoke", "--kinds", "scalar", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sorted_static_decode.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [60, 250]
    for r in rows:
        assert r["torch_us"] > 0 and r["dense_sdpa_us"] > 0
        if DEVICE.type == "cpu":  # the interpreter serves "triton" on the CPU in this process
            assert r["triton_us"] > 0, r
    assert "| scalar | 2 | 4 | 250 |" in (tmp_path / "sorted_static_decode.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
def test_gpu_long_cache_and_cuda_graph(scheme, dtype):
    """The real launch at a realistic shape (H12, G3, D64, k = 64, 2k-token prompt, blocks of 256 and a block boundary
    crossed): eager steps and CUDA-graph replays equal the torch path, and the layers' states stay equal."""
    torch.manual_seed(0)
    b, h, g, dv, d, k, t, prompt, steps = 2, 12, 3, 64, 64, 64, 256, 2040, 24
    order_heads = list(range(h)) if scheme == "per_head" else [grp * (h // g) for grp in range(g)]
    kw = dict(max_cache_len=4096, num_heads=h, num_value_groups=g, order_heads=order_heads, decode_window=k,
              block_size=t)  # fmt: skip
    ref, fused = StaticSortedLayer(static_decode_backend="torch", **kw), StaticSortedLayer(**kw)
    dev = torch.device("cuda")

    def r(*shape):
        return torch.randn(*shape, device=dev).to(dtype)

    valid = torch.ones(b, prompt, dtype=torch.bool, device=dev)
    valid[1, :100] = False
    data = r(b, h, prompt), r(b, g, prompt, dv), r(b, h, prompt, d)
    for layer in (ref, fused):
        layer.append(*data, valid=valid)
    assert fused.decode_backend_used == "triton"
    tau, scale = torch.full((h,), 0.5, device=dev), torch.full((h,), d**-0.5, device=dev)
    prefix = dict(prefix_ks=r(1, h, 1), prefix_v=r(1, g, 1, dv), prefix_k=torch.zeros(1, h, 1, d, device=dev).to(dtype))
    token = [r(b, h, 1), r(b, g, 1, dv), r(b, h, 1, d), r(b, h, 1), r(b, h, 1, d)]

    def step(layer):
        layer.append(token[0], token[1], token[2])
        return layer.attend(token[3], tau, q=token[4], scale=scale, **prefix)

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for i in range(steps // 2):  # eager
        for x in token:
            x.copy_(torch.randn_like(x.float()).to(dtype))
        assert (step(ref) - step(fused)).float().abs().max().item() < tol, i
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        snapshot = {n: getattr(fused, n).clone() for n in ("keys", "values", "vector_keys", "valid", "token_index",
                    "sorted_keys", "sorted_slots", "fill_keys", "fill_slots", "cumulative_length")}  # fmt: skip
        with torch.cuda.graph(graph, stream=stream):
            graph_out = step(fused)
        for name, saved in snapshot.items():  # capture ran the step once without effect: restore nothing changed
            assert torch.equal(getattr(fused, name), saved), name
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(steps // 2):  # replays
        for x in token:
            x.copy_(torch.randn_like(x.float()).to(dtype))
        expected = step(ref)
        graph.replay()
        assert (expected - graph_out).float().abs().max().item() < tol, i
    torch.cuda.synchronize()
    assert torch.equal(current_runs(ref), current_runs(fused)) and torch.equal(ref.keys, fused.keys)
    assert int(ref.cumulative_length) == int(fused.cumulative_length) == prompt + steps


def test_warps_per_program_setting(monkeypatch):
    """``NUM_WARPS`` overrides the heuristic (what ``bench_sorted_static_decode.py --num-warps`` times); a count the
    GPU cannot launch is refused naming the setting, by the module and by the benchmark's arguments."""
    import hf_rbf.kernels_sorted_static_decode as static_decode
    from benchmarks.bench_sorted_static_decode import main

    assert [static_decode.decode_num_warps(t) for t in (512, 4096, 32768)] == [4, 8, 16]
    monkeypatch.setattr(static_decode, "NUM_WARPS", 1)
    assert static_decode.decode_num_warps(32768) == 1
    monkeypatch.setattr(static_decode, "NUM_WARPS", 3)
    with pytest.raises(ValueError, match="NUM_WARPS must be 1, 2, 4, 8, 16 or 32; got 3"):
        static_decode.decode_num_warps(512)
    with pytest.raises(SystemExit):
        main(["--smoke", "--out", "unused", "--num-warps", "1", "3"])
    # --alternatives: the module settings each entry times
    from benchmarks.bench_sorted_static_decode import parse_alternative

    assert parse_alternative("span=2k,fanout=64,warps=8") == {"CANDIDATE_SPAN": "2k", "FANOUT": 64, "NUM_WARPS": 8}
    for bad in ("span=3k", "fanout=12", "warps=3", "depth=2"):
        with pytest.raises(ValueError, match=re.escape("is not span=k|2k, fanout=")):
            parse_alternative(bad)
        with pytest.raises(SystemExit):
            main(["--smoke", "--out", "unused", "--alternatives", bad])


@pytest.mark.parametrize(
    "capacity, window, batch, orders, blocks",
    [
        # the lengths of benchmarks/results/h100-2026-11-28 (call 4; the bench's capacity: tokens + its timed steps):
        # at batch 1, 4 / 8 blocks at 128k / 512k, the measured best with the insert writing 30 bytes per entry (2k
        # candidates per block, int64 slots: 12.6 / 18.3 us per layer step, against 24.9 / 39.2 with the former
        # next_pow2(sqrt(2kC)), i.e. 17 / 33 blocks; with k candidates, h200-2026-11-29i, call 3: 512k 16.2 us with
        # 8 blocks, 16.7 with 16).  At 1M, 8 blocks: the model's choice once the insert writes 12 bytes per entry
        # (int32 slots, one copy; not yet measured: with 30 bytes, 8 blocks took 23.1 us, 16 blocks 19.6)
        (131072 + 1232, 64, 1, 12, 4),
        (524288 + 1232, 64, 1, 12, 8),
        (1048576 + 1232, 64, 1, 12, 8),
        # eight rows: the insert's traffic grows with them, so more and shorter blocks (30 bytes per entry: 16 blocks
        # measured 43.3 us, 8 blocks 75.3 us, writer-bound; 12 bytes: the model takes 16)
        (524288 + 1232, 64, 8, 12, 16),
        (8192 + 256, 64, 1, 12, 1),
        (100, 4, 1, 1, 1),
    ],
)
def test_default_block_size_takes_a_power_of_two_block_count(capacity, window, batch, orders, blocks):
    """Without a ``block_size`` a windowed layer takes ``NB`` blocks of ``T = ceil(C / NB)`` keys (a multiple of 64)
    for a power-of-two ``NB`` (the kernel pads the candidate tile's block rows to one), the count whose modeled step
    (readers: the candidate tile; writers: ``batch x orders x T`` insert entries) is the shortest."""
    from hf_rbf.cache_sorted_static import default_block_size

    t = default_block_size(capacity, window, batch_size=batch, num_orders=orders)
    assert -(-capacity // t) == blocks, t
    assert t % 64 == 0 or t == capacity
    tile = next_pow2(blocks) * next_pow2(candidate_span(window, t)[0])
    assert tile <= MAX_CANDIDATES
    # sized in bytes, the capacity is rounded down to whole blocks: `round_down` keeps a power-of-two count inside it
    down = default_block_size(capacity, window, batch_size=batch, num_orders=orders, round_down=True)
    n_down = capacity // down
    assert n_down & (n_down - 1) == 0 and n_down * down <= capacity


@pytest.mark.parametrize(
    "capacity, window, expected",
    [(1000, None, 64), (40, None, 40), (4096, 4096, 64), (1 << 20, 4096, None), (131072, 64, None), (8192, 64, None)],
)
def test_default_block_size_keeps_long_contexts_on_the_fused_step(capacity, window, expected):
    """Every default block length gives a candidate tile the fused kernel serves (a fixed 64, the default before
    2026-11-27, gave 2,048 blocks at 131,072 tokens, a 131,072-entry tile it refused, and the PyTorch path then sorted
    those candidates at every step: 0.18 ms per layer step on an H100), also for a window so wide that only a few
    long blocks fit; 64 without a window.  The layer takes it, one order per head."""
    from hf_rbf.cache_sorted_static import default_block_size

    t = default_block_size(capacity, window, num_orders=4)
    if expected is not None:
        assert t == expected
    assert 1 <= t <= capacity
    layer = _layer("auto", b_heads=(4, 2), scheme="per_head", window=window, block_size=None, capacity=capacity)
    assert layer.block_size == t and layer.capacity % t == 0
    if layer.windowed:
        tile = next_pow2(layer.num_blocks) * next_pow2(candidate_span(window, t)[0])
        assert tile <= MAX_CANDIDATES
        # what the fused kernel's own check says of the shape (its device / dtype part aside)
        reason = static_decode_unavailable_reason(
            torch.device("cuda"), torch.bfloat16, num_blocks=layer.num_blocks, block_size=t, window=window,
            value_dim=64, head_dim=64,
        )
        assert reason is None or "candidate" not in reason, reason


def test_model_static_cache_takes_the_default_block_size():
    """``make_static_cache`` / ``generate(cache_implementation="static")`` without ``block_size``: every sorted layer
    takes :func:`default_block_size` of the capacity and window; sized in bytes, the capacity is a multiple of it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_rbf  # noqa: F401
    from hf_rbf.cache_sorted_static import default_block_size

    cfg = AutoConfig.for_model("scalar_sort", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64, decode_window=8)
    model = AutoModelForCausalLM.from_config(cfg)
    cache = model.make_static_cache(20000)
    sorted_layers = [layer for layer in cache.layers if isinstance(layer, StaticSortedLayer)]
    # one order per head (sort_scheme "per_head"): 4 orders; batch 1 unless told
    expected = default_block_size(20000, 8, num_orders=4)
    assert sorted_layers and all(layer.block_size == expected for layer in sorted_layers)
    blocks = -(-20000 // expected)
    assert blocks & (blocks - 1) == 0  # a power of two: no padded block rows in the kernel's candidate tile
    wide = default_block_size(20000, 8, num_orders=4, batch_size=64)
    assert wide < expected  # more rows, more insert traffic per entry: shorter blocks
    assert all(layer.block_size == wide for layer in model.make_static_cache(20000, batch_size=64).layers
               if isinstance(layer, StaticSortedLayer))  # fmt: skip
    assert model.make_static_cache(20000, block_size=64).layers[0].block_size == 64  # an explicit one stays
    from hf_rbf.cache_static import static_cache_len_for_bytes

    unrounded = static_cache_len_for_bytes(model.config, 400_000, model.dtype, block_size=1)
    sized = model.make_static_cache(max_cache_bytes=400_000)
    t = default_block_size(unrounded, 8, num_orders=4, round_down=True)
    assert t > 64 and sized.max_cache_len == unrounded - unrounded % t
    for layer in sized.layers:
        if isinstance(layer, StaticSortedLayer):
            assert layer.block_size == t and layer.capacity == sized.max_cache_len


@pytest.mark.parametrize(
    "capacity, window, named",
    [(0, 8, "max_cache_len"), (16.0, 8, "max_cache_len"), (16, 0, "decode_window"), (16, True, "decode_window")],
)
def test_default_block_size_names_a_bad_argument(capacity, window, named):
    from hf_rbf.cache_sorted_static import default_block_size

    with pytest.raises(ValueError, match=f"`{named}` must be"):
        default_block_size(capacity, window)
    with pytest.raises(ValueError, match="`block_size` must be None or an int >= 1"):
        _layer("auto", b_heads=(4, 2), scheme="per_head", window=4, block_size=0, capacity=16)


@pytest.mark.parametrize("batch_size", [0, -2, 1.5, True])
def test_block_size_batch_hint_names_a_bad_value(batch_size):
    """The batch that sizes the default blocks (``generate`` passes it): a value that is no row count is refused
    wherever it enters, naming ``batch_size``, rather than read as one row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_rbf  # noqa: F401
    from hf_rbf.cache_sorted_static import default_block_size

    with pytest.raises(ValueError, match="`batch_size` must be an int >= 1"):
        default_block_size(4096, 8, batch_size=batch_size)
    with pytest.raises(ValueError, match="`num_orders` must be an int >= 1"):
        default_block_size(4096, 8, num_orders=0)
    with pytest.raises(ValueError, match="StaticSortedLayer: `batch_size` must be None or an int >= 1"):
        StaticSortedLayer(max_cache_len=64, num_heads=2, num_value_groups=1, order_heads=[0, 1], decode_window=4,
                          batch_size=batch_size)  # fmt: skip
    for family in ("scalar_sort", "rbf"):
        cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=64)  # fmt: skip
        model = AutoModelForCausalLM.from_config(cfg)
        with pytest.raises(ValueError, match="`batch_size` must be"):
            model.make_static_cache(256, batch_size=batch_size)


def test_sorted_runs_keep_int32_slots_and_the_capacity_is_bounded():
    """The sorted runs and fill copies keep int32 slots (the insert's traffic); a capacity past int32 is refused
    naming ``max_cache_len``."""
    results, ref_layer, fused = run_both(window=3, block_size=4, prompt=9, steps=2)
    for layer in (ref_layer, fused):
        assert layer.sorted_slots.dtype == torch.int32 and layer.fill_slots.dtype == torch.int32
    with pytest.raises(ValueError, match=r"`max_cache_len` rounded up to whole blocks \(2147483648\) must be at most"):
        _layer("torch", b_heads=(4, 2), scheme="per_head", window=3, block_size=2**20, capacity=2**31)
