"""The fused Triton decode kernel (``hf_rbf.kernels_sorted_decode``) against the torch decode step it replaces.

Without CUDA the kernel runs in Triton's CPU interpreter, which must be switched on (``TRITON_INTERPRET=1``) before
triton is imported; the pytest process has usually imported it already (``hf_rbf`` imports the kernel module), so the
comparisons run in a fresh subprocess with the variable set.  With CUDA they run in-process on the GPU.  Cases:
both sort schemes, buffer sizes 1 and 4 (merges between steps), odd and even windows, windows larger than the cache,
multi-token steps (causality inside the buffer), padding and a row with nothing visible, key log-weights, the hybrid
dot term with a per-head scale, no prefix, float32 and bfloat16; then a whole ``generate`` with
``decode_backend="triton"`` against ``"torch"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch


pytest.importorskip("triton")

CHECKS = textwrap.dedent(
    """
    import json, sys
    import torch
    from hf_rbf.cache_sorted_scalar import SortedScalarCacheLayer
    from hf_rbf.kernels_sorted_decode import sorted_window_attention_triton
    from hf_rbf.sorted_decode import sorted_window_attention

    device = sys.argv[1]
    results = []

    def run_case(name, *, scheme="per_head", buffer=4, window=3, hybrid=False, log_weights=False, prefix=True,
                 dtype=torch.float32, steps=(6, 1, 3), dead_row=False):
        gen = torch.Generator().manual_seed(len(results))
        b, h, g, dv, d = 2, 4, 2, 5, 6
        r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
        layer = SortedScalarCacheLayer(num_heads=h, num_value_groups=g, decode_window=window, sort_scheme=scheme,
                                       sort_head=1, cache_buffer_size=buffer)
        err = 0.0
        for n in steps:
            valid = (torch.rand(b, n, generator=gen) > 0.25).to(device)
            if dead_row:
                valid[0] = False
            lw = 0.3 * r(b, h, n) if log_weights else None
            layer.append(r(b, h, n), r(b, g, n, dv), r(b, h, n, d) if hybrid else None, valid=valid, log_weight=lw)
            qs, tau = r(b, h, n), (torch.rand(b, h, n, generator=gen) + 0.3).to(device)
            q = r(b, h, n, d) if hybrid else None
            scale = torch.tensor([0.4, 0.0, 0.3, 0.5], device=device) if hybrid else None
            kw = dict(window=window, query_token_index=torch.arange(layer.seen_tokens - n, layer.seen_tokens,
                                                                    device=device), q=q, scale=scale)
            if prefix:
                kw.update(prefix_ks=torch.zeros(1, h, 2, device=device, dtype=dtype), prefix_v=r(1, g, 2, dv))
                if hybrid:
                    kw["prefix_k"] = r(1, h, 2, d)
            ref = sorted_window_attention(layer.state(), qs, tau, **kw).float()
            got = sorted_window_attention_triton(layer.state(), qs, tau, **kw).float()
            err = max(err, ((got - ref).norm() / ref.norm().clamp_min(1e-6)).item())
        results.append(dict(name=name, rel_err=err, tol=1e-5 if dtype == torch.float32 else 2e-2))

    for scheme in ("per_head", "sort_head"):
        for buffer, window in ((1, 1), (1, 4), (4, 5)):
            run_case(f"{scheme}-R{buffer}-k{window}", scheme=scheme, buffer=buffer, window=window)
    run_case("window-larger-than-cache", window=64)
    run_case("only-buffer", buffer=64)
    run_case("dead-row", dead_row=True)
    run_case("log-weights", log_weights=True, window=2)
    run_case("hybrid", hybrid=True, log_weights=True)
    run_case("hybrid-sort-head", hybrid=True, scheme="sort_head", window=4)
    run_case("no-prefix", prefix=False)
    run_case("bf16", dtype=torch.bfloat16)

    # generate through the kernel equals generate through the torch step
    from transformers import AutoConfig, AutoModelForCausalLM
    import hf_rbf
    cfg = AutoConfig.for_model("hybrid_sort", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, head_kinds=["hybrid", "scalar"], num_value_groups=2,
                               num_register_tokens=1, attention_backend="naive", decode_window=3, cache_buffer_size=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device).eval()
    ids = torch.randint(1, 64, (1, 7), device=device)
    outs = {}
    for backend in ("torch", "triton"):
        cache = hf_rbf.SortedScalarCache(decode_backend=backend)
        with torch.no_grad():
            out = model.generate(ids, **{hf_rbf.CACHE_NAME: cache}, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        outs[backend] = out
        results.append(dict(name=f"generate-{backend}-served", rel_err=0.0 if cache.layers[0].last_decode_backend == backend else 1.0, tol=0.5))
    same = torch.equal(outs["torch"].sequences, outs["triton"].sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(outs["torch"].logits, outs["triton"].logits))
    results.append(dict(name="generate-tokens", rel_err=0.0 if same else 1.0, tol=0.5))
    results.append(dict(name="generate-logits", rel_err=diff, tol=1e-4))
    print(json.dumps(results))
    """
)


def _run_checks():
    if torch.cuda.is_available():
        from hf_rbf.kernels_sorted_decode import kernel_unavailable_reason

        if kernel_unavailable_reason(torch.device("cuda")) is None:
            env = dict(os.environ)
            env.pop("TRITON_INTERPRET", None)
            device = "cuda"
        else:
            pytest.skip("the kernel was defined in interpreter mode in this process")
    else:
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        device = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS, device], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fused_kernel_matches_the_torch_decode_step():
    failures = [r for r in _run_checks() if not r["rel_err"] <= r["tol"]]
    assert not failures, failures


def test_backend_choice_is_explicit():
    """The layer records which implementation served it; "triton" where the kernel cannot run raises with the
    reason; "auto" (the default) takes the kernel on CUDA only and torch here, visibly (the attribute), also where
    the interpreter could run it."""
    from hf_rbf.cache_sorted_scalar import AUTO_FUSED_MAX_WINDOW, SortedScalarCacheLayer
    from hf_rbf.kernels_sorted_decode import kernel_unavailable_reason

    runs_here = kernel_unavailable_reason(torch.device("cpu")) is None
    cases = (
        ("triton", "triton" if runs_here else None),
        ("auto", "torch"),
        ("torch", "torch"),
    )
    assert SortedScalarCacheLayer(num_heads=2, num_value_groups=1).decode_backend == "auto"
    for backend, expect in cases:
        layer = SortedScalarCacheLayer(num_heads=2, num_value_groups=1, decode_window=2, decode_backend=backend)
        layer.append(torch.randn(1, 2, 5), torch.randn(1, 1, 5, 3))
        if expect is None:
            with pytest.raises(ValueError, match="decode_backend='triton' cannot serve"):
                layer.attend(torch.randn(1, 2, 1), 0.5, num_new=1)
        else:
            layer.attend(torch.randn(1, 2, 1), 0.5, num_new=1)
            assert layer.last_decode_backend == expect
            assert (layer.last_decode_reason is None) == (expect == "triton")
    # "auto" on the CPU says why it kept torch: CUDA only where the interpreter could run the kernel, else the reason
    # the kernel cannot run here
    reason = layer_reason("auto", 2)
    assert ("CUDA only" in reason) if runs_here else (reason == kernel_unavailable_reason(torch.device("cpu")))
    # "auto" keeps the fused step to windows it was measured at (2k candidates per program sit in registers)
    big = layer_reason("auto", AUTO_FUSED_MAX_WINDOW + 1)
    assert f"windows up to {AUTO_FUSED_MAX_WINDOW} keys" in big


def layer_reason(backend: str, window: int) -> str | None:
    from hf_rbf.cache_sorted_scalar import SortedScalarCacheLayer

    layer = SortedScalarCacheLayer(num_heads=2, num_value_groups=1, decode_window=window, decode_backend=backend)
    layer.append(torch.randn(1, 2, window + 3), torch.randn(1, 1, window + 3, 3))
    layer.attend(torch.randn(1, 2, 1), 0.5, num_new=1)
    assert layer.last_decode_backend == "torch"
    return layer.last_decode_reason


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_default_dynamic_generate_on_cuda_takes_the_fused_step(family):
    """The default ``decode_backend`` ("auto") serves a windowed dynamic-cache ``generate`` on CUDA with the fused
    kernel, and gives the torch step's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import hf_rbf
    from conftest import build_model

    model = build_model(family, dict(num_register_tokens=1, decode_window=4)).cuda()
    ids = torch.randint(1, 128, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = {}
    for backend in ("auto", "torch"):
        cache = hf_rbf.SortedScalarCache(decode_backend=backend)
        with torch.no_grad():
            out[backend] = model.generate(
                input_ids=ids, **{hf_rbf.CACHE_NAME: cache}, max_new_tokens=8, do_sample=False, pad_token_id=0
            )
        assert cache.layers[0].last_decode_backend == ("triton" if backend == "auto" else "torch")
    assert torch.equal(out["auto"], out["torch"])
