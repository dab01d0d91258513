"""Plumbing of the fused Triton kernels: backend choice and reasons, torch.compile through the custom ops, the
package without triton, and the split-K decode path being exercised.  Numerics are in ``test_kernels_<family>.py``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernel_env import DEVICE, IN_PROCESS, ON_GPU, check_compiled_matches_eager  # noqa: E402 (first: sets TRITON_INTERPRET)

import kernel_checks as kc  # noqa: E402

import hf_rbf  # noqa: E402
from hf_rbf import kernels_common, kernels_flash_fwd  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OPS = {"rbf": "rbf_attention", "gka": "gka_attention", "scalar": "scalar_attention", "hybrid": "hybrid_attention"}


@pytest.fixture(autouse=True)
def _kernels_runnable(request):
    if not IN_PROCESS and request.function.__name__ not in (
        "test_in_interpreter_subprocess",
        "test_package_works_without_triton",
    ):
        pytest.skip(
            "triton was imported without TRITON_INTERPRET=1 in this process; test_in_interpreter_subprocess "
            "runs these checks"
        )


def test_in_interpreter_subprocess():
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def _small_inputs(family, device, dtype=torch.float32):
    case = kc.Case(family, dtype=dtype, b=1, h=2, nq=21, nk=21, d=16, dv=16, window=9, prefix=2, klw="b")
    made = kc.make_inputs(case, device)
    return case, made["tensors"], made["args"]


@pytest.mark.parametrize("family", kc.FAMILIES)
def test_explicit_triton_is_used_and_auto_prefers_it_only_on_cuda(family):
    case, tensors, args = _small_inputs(family, DEVICE)
    kc.call(case, tensors, args, "triton")
    assert hf_rbf.last_backend(OPS[family]) == "triton"
    kc.call(case, tensors, args, "auto")
    if ON_GPU:
        assert hf_rbf.last_backend(OPS[family]) == "triton"
    else:  # the interpreter is a test vehicle, never an "auto" choice
        assert hf_rbf.last_backend(OPS[family]) != "triton"


@pytest.mark.parametrize("family", kc.FAMILIES)
def test_unsupported_dtype_names_the_reason(family):
    case, tensors, args = _small_inputs(family, DEVICE)
    tensors = {k: v.double() for k, v in tensors.items()}
    with pytest.raises(ValueError, match="float64"):
        kc.call(case, tensors, args, "triton")


def test_head_dim_out_of_range_names_the_reason():
    q = torch.randn(1, 1, 8, 300, device=DEVICE)
    with pytest.raises(ValueError, match="300"):
        hf_rbf.rbf_attention(q, q, q, backend="triton")


def test_decode_cases_exercise_the_split_k_merge():
    # the small decode cases (3 queries over 83 keys, 1 over 70) must run with more than one key split
    for nq, span in ((3, 79), (1, 70), (2, 60)):
        assert kernels_flash_fwd.decode_splits(2, 4, nq, span, torch.device(DEVICE)) > 1


@pytest.mark.parametrize("family", kc.FAMILIES)
def test_torch_compile_forward_and_backward(family):
    """torch.compile traces the public function into the custom ops (fake kernels, registered autograd).

    On the CPU the interpreter's kernels cannot be compiled by Inductor, so the CPU run uses the aot_eager backend:
    it still traces both graphs through the fake implementations and the autograd formula; the GPU run uses Inductor.
    """
    case, tensors, args = _small_inputs(family, DEVICE)

    def loss_fn(t):
        out = kc.call(case, t, args, "triton")
        return (out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum()

    check_compiled_matches_eager(loss_fn, tensors)


def test_package_works_without_triton():
    """A machine (or a checkpoint's remote-code copy) without triton: the package imports, "auto" falls back, and
    an explicit backend="triton" says why it cannot serve."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch, hf_rbf
        from hf_rbf import kernels_common
        assert not kernels_common.HAS_TRITON
        q = torch.randn(1, 2, 7, 16)
        out = hf_rbf.rbf_attention(q, q, q)
        assert hf_rbf.last_backend("rbf_attention") != "triton"
        try:
            hf_rbf.gka_attention(q, 0.1, backend="triton")
        except ValueError as exc:
            assert "triton is not installed" in str(exc), exc
        else:
            raise AssertionError("backend='triton' without triton did not raise")
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_autotune_subset_times_every_config_only_for_large_buckets(monkeypatch):
    """Small sequence buckets take the first fitting config untimed (compile time, not tile choice, dominates
    there); larger ones time all of them unless HF_RBF_TRITON_AUTOTUNE=0."""
    configs = ["a", "b", "c"]
    monkeypatch.setattr(kernels_common, "DEFINED_INTERPRETED", False)
    monkeypatch.setenv("HF_RBF_TRITON_AUTOTUNE", "1")
    small = kernels_common.SMALL_N_BUCKET
    assert kernels_common.autotune_subset(configs, {"N_BUCKET": small}) == ["a"]
    assert kernels_common.autotune_subset(configs, {"N_BUCKET": 2 * small}) == configs
    monkeypatch.setenv("HF_RBF_TRITON_AUTOTUNE", "0")
    assert kernels_common.autotune_subset(configs, {"N_BUCKET": 2 * small}) == ["a"]


def test_planes_bucket_is_a_power_of_four_from_16_to_1024():
    from hf_rbf.kernels_common import planes_bucket

    assert [planes_bucket(n) for n in (1, 16, 17, 64, 65, 192, 256, 257, 1024, 2048, 10**6)] == [
        16, 16, 64, 64, 256, 256, 256, 1024, 1024, 1024, 1024
    ]


def test_every_tuned_launch_keys_on_the_planes(monkeypatch):
    """The autotune key of each fused kernel holds the bucket of batch x heads (``PLANES``), so a launch at batch 2
    (a warm-up, an evaluation, a prefill) and one at batch 64 are tuned apart: recorded here from the launcher's
    arguments for the forward, dQ and dK/dV passes of a distance family and the three scalar passes."""
    from hf_rbf import kernels_flash_bwd, kernels_scalar_bwd, kernels_scalar_fwd

    seen = []
    real = kernels_common.launch_tuned

    def recording(kernel, grid, *args, **kwargs):
        assert "PLANES" in kernel.keys, kernel.fn.__name__
        names = dict(kernels_common._key_positions(kernel))
        seen.append((kernel.fn.__name__, args[names["PLANES"]]))
        return real(kernel, grid, *args, **kwargs)

    for module in (kernels_flash_fwd, kernels_flash_bwd, kernels_scalar_fwd, kernels_scalar_bwd):
        monkeypatch.setattr(module, "launch_tuned", recording)
    for bsz, heads, planes in ((1, 2, 16), (8, 4, 64)):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(bsz, heads, 19, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
        hf_rbf.rbf_attention(q, k, v, causal=True, backend="triton").sum().backward()
        qs, ks = (torch.randn(bsz, heads, 19, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
        hf_rbf.scalar_attention(qs, ks, v.detach(), tau=0.5, causal=True, backend="triton").sum().backward()
        names = sorted(name for name, p in seen if p == planes)
        assert len(names) == 6 and len(set(names)) == 6, (bsz, heads, seen)
        seen.clear()


@pytest.mark.gpu
def test_every_tuned_launch_keys_on_the_planes_on_gpu(monkeypatch):
    """The same on the GPU (``pytest -m gpu``), where every pass has several configs and the autotuner chooses."""
    if not ON_GPU:
        pytest.skip("needs a CUDA device")
    test_every_tuned_launch_keys_on_the_planes(monkeypatch)


def test_auto_order_for_decoding():
    """Decode rows: naive first on the CPU for every family; on CUDA the family's order (every family's triton has
    a split-K decode kernel); prefill keeps the family's order, with triton last on the CPU."""
    fam = {"triton": 1, "sdpa": 2, "flex": 3, "naive": 4}
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rows = kernels_common.DECODE_ROWS
    assert list(kernels_common.auto_order(fam, cuda, 1)) == ["triton", "sdpa", "flex", "naive"]
    assert list(kernels_common.auto_order({"sdpa": 1, "triton": 2, "naive": 3}, cuda, rows + 1)) == [
        "sdpa", "triton", "naive"
    ]  # fmt: skip
    assert list(kernels_common.auto_order(fam, cpu, rows)) == ["naive", "sdpa", "flex", "triton"]
    assert list(kernels_common.auto_order(fam, cpu, rows + 1)) == ["sdpa", "flex", "naive", "triton"]


class _FakeConfig:
    def __init__(self, block):
        self.kwargs = {"BLOCK": block}
        self.pre_hook = None

    def all_kwargs(self):
        return dict(self.kwargs)


class _FakeAutotuned:
    """The parts of triton's Autotuner that ``launch_tuned`` reads; records which path served each launch."""

    def __init__(self, configs):
        self.configs = configs
        self.arg_names = ["x", "y", "n", "N_BUCKET", "FLAG"]
        self.keys = ["N_BUCKET", "FLAG"]
        self.cache = {}
        self.launches = []
        outer = self

        class _Fn:
            def run(self, *args, grid, warmup, **kwargs):
                outer.launches.append(("direct", kwargs.get("BLOCK")))

        self.fn = _Fn()

    def __getitem__(self, grid):
        def tune_and_launch(*args, **kwargs):
            # what Autotuner.run keys its cache on: the key arguments' values, then the tensor arguments' dtypes
            named = dict(zip(self.arg_names, args), **kwargs)
            key = [named[k] for k in self.keys if k in named] + [str(a.dtype) for a in named.values() if hasattr(a, "dtype")]
            self.cache[tuple(key)] = self.configs[-1]
            self.launches.append(("autotuner", self.configs[-1].kwargs["BLOCK"]))

        return tune_and_launch


def test_launch_tuned_asks_the_autotuner_once_per_key():
    """After the autotuner chose a config for a key (dtypes included), launches with that key go straight to the
    kernel with the chosen config; a new key (another N bucket, another dtype) goes through the autotuner again."""
    from hf_rbf.kernels_common import launch_tuned

    kernel = _FakeAutotuned([_FakeConfig(32), _FakeConfig(64)])
    x, y = torch.zeros(2), torch.zeros(2)
    for _ in range(3):
        launch_tuned(kernel, (1,), x, y, 5, 256, FLAG=True)
    launch_tuned(kernel, (1,), x, y, 5, 512, FLAG=True)  # another bucket
    launch_tuned(kernel, (1,), x.half(), y, 5, 256, FLAG=True)  # another dtype
    launch_tuned(kernel, (1,), x, y, 5, 256, FLAG=False)  # another constexpr
    assert kernel.launches == [
        ("autotuner", 64),
        ("direct", 64),
        ("direct", 64),
        ("autotuner", 64),
        ("autotuner", 64),
        ("autotuner", 64),
    ]
    single = _FakeAutotuned([_FakeConfig(16)])
    launch_tuned(single, (1,), x, y, 5, 256, FLAG=True)
    assert single.launches == [("direct", 16)]
