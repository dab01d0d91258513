"""Correctness checks of the fused Triton kernels against the float64 naive reference.

One definition of the checks, used at small shapes by ``tests/test_kernels_*.py`` (CPU, ``TRITON_INTERPRET=1``) and
at full shapes by ``benchmarks/check_kernels_gpu.py`` and the GPU tests.  A :class:`Case` describes one call of a
public function (family, dtype, shapes, masks, which parameters are learnable); :func:`check_case` runs it with
``backend="triton"`` and with ``backend="naive"`` on float64 copies of the same inputs, and compares the output and
every gradient by relative error ``||x - ref|| / ||ref||``.

Tolerances are relative to that float64 reference.  float32: the kernels accumulate in fp32 (and use IEEE fp32
dots unless torch allows tf32), so errors are ~1e-6; bf16 / fp16: the inputs are the same rounded values for both
sides, the kernel rounds the weights to the input dtype before the value product (as FlashAttention does) and
rounds its outputs, which gives ~2^-8 (bf16) / 2^-11 (fp16) relative error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

import hf_rbf

FAMILIES = ("rbf", "gka", "scalar", "hybrid")

# (output, gradients) relative-error bounds against float64
TOLERANCES = {
    torch.float32: (2e-5, 5e-5),
    torch.bfloat16: (1.5e-2, 3e-2),
    torch.float16: (3e-3, 6e-3),
}


@dataclass(frozen=True)
class Case:
    family: str
    dtype: torch.dtype = torch.float32
    b: int = 2
    h: int = 4
    nq: int = 29
    nk: int = 29
    d: int = 24
    dv: int = 24
    groups: int = 0  # value groups for scalar/hybrid (0: one per head)
    causal: bool = True
    window: int | None = None
    prefix: int = 0
    pad: int = 0  # left padding of batch element 1 (keys); with causal and no prefix, its first rows see nothing
    klw: str = "none"  # none | b (per batch) | bh (per batch and head) | 1h (broadcast batch)
    learn: bool = True  # per-head / per-token parameters are tensors that require grad
    tau: str = "head"  # scalar / hybrid temperature: float | head | token
    normalize: bool = True  # rbf
    eps: float = 1e-6  # gka
    scale: str = "head"  # hybrid: head | zero | default
    grad: bool = True  # check the backward (False: forward only, no_grad: the decode path for few rows)
    scale_inputs: float = 1.0  # multiply q/k/x by this (large-norm checks)
    seed: int = 0

    @property
    def name(self) -> str:
        parts = [
            self.family,
            str(self.dtype).replace("torch.", ""),
            f"B{self.b}H{self.h}",
            f"Nq{self.nq}Nk{self.nk}D{self.d}",
        ]
        if self.family in ("scalar", "hybrid"):
            parts.append(f"Dv{self.dv}G{self.groups or self.h}")
        parts.append("causal" if self.causal else "full")
        if self.window:
            parts.append(f"W{self.window}")
        if self.prefix:
            parts.append(f"P{self.prefix}")
        if self.pad:
            parts.append(f"pad{self.pad}")
        if self.klw != "none":
            parts.append(f"klw-{self.klw}")
        if self.family == "rbf" and not self.normalize:
            parts.append("nosoftmax")
        if self.family == "gka":
            parts.append(f"eps{self.eps:g}")
        if self.family in ("scalar", "hybrid"):
            parts.append(f"tau-{self.tau}")
        if self.family == "hybrid" and self.scale != "head":
            parts.append(f"scale-{self.scale}")
        if not self.learn:
            parts.append("fixed")
        if not self.grad:
            parts.append("fwd")
        if self.scale_inputs != 1.0:
            parts.append(f"x{self.scale_inputs:g}")
        return "-".join(parts)


def make_inputs(case: Case, device) -> dict:
    """Leaf tensors (in ``case.dtype``, or float32 for per-head parameters) and plain arguments of one call."""
    gen = torch.Generator(device="cpu").manual_seed(case.seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=case.dtype)

    b, h, nq, nk, d, dv = case.b, case.h, case.nq, case.nk, case.d, case.dv
    g = case.groups or h
    inputs: dict = {}
    tensors: dict = {}
    if case.family == "rbf":
        tensors.update(
            q=randn(b, h, nq, d, scale=case.scale_inputs),
            k=randn(b, h, nk, d, scale=case.scale_inputs),
            v=randn(b, h, nk, dv),
        )
        gamma = (0.3 + 0.4 * torch.rand(h, generator=gen)) / math.sqrt(d) / case.scale_inputs**2
        if case.learn:
            tensors["gamma"] = gamma.to(device)
        else:
            inputs["gamma"] = float(gamma[0])
        inputs["normalize"] = case.normalize
    elif case.family == "gka":
        tensors["x"] = randn(b, h, nk, d, scale=case.scale_inputs)
        if nq != nk:
            tensors["query"] = randn(b, h, nq, d, scale=case.scale_inputs)
        log_sigma = 0.5 * math.log(d) + math.log(case.scale_inputs) + 0.2 * torch.randn(h, generator=gen)
        if case.learn:
            tensors["log_sigma"] = log_sigma.to(device)
        else:
            inputs["log_sigma"] = float(log_sigma[0])
        inputs["eps"] = case.eps
    else:
        if case.family == "hybrid":
            tensors.update(q=randn(b, h, nq, d), k=randn(b, h, nk, d))
        tensors.update(qs=randn(b, h, nq), ks=randn(b, h, nk), v=randn(b, g, nk, dv))
        if case.tau == "float" or not case.learn:
            inputs["tau"] = 0.8
        elif case.tau == "head":
            tensors["tau"] = (0.5 + torch.rand(h, generator=gen)).to(device)
        else:
            tensors["tau"] = (0.5 + torch.rand(b, h, nq, generator=gen)).to(device)
        if case.family == "hybrid":
            if case.scale == "zero":
                inputs["scale"] = 0.0
            elif case.scale == "default" or not case.learn:
                inputs["scale"] = None
            else:
                tensors["scale"] = ((0.5 + torch.rand(h, generator=gen)) / math.sqrt(d)).to(device)
    if case.klw != "none":
        shape = {"b": (b, nk), "bh": (b, h, nk), "1h": (1, h, nk)}[case.klw]
        tensors["key_log_weights"] = (0.5 * torch.randn(*shape, generator=gen)).to(device)
    if case.pad:
        am = torch.ones(b, nk, dtype=torch.long)
        am[min(1, b - 1), : case.pad] = 0
        inputs["attention_mask"] = am.to(device)
    inputs.update(causal=case.causal, window=case.window, num_prefix_keys=case.prefix)
    return {"tensors": tensors, "args": inputs}


def call(case: Case, tensors: dict, args: dict, backend: str) -> torch.Tensor:
    kw = dict(args)
    kw.update({k: v for k, v in tensors.items()})
    f = case.family
    if f == "rbf":
        return hf_rbf.rbf_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), backend=backend, **kw)
    if f == "gka":
        return hf_rbf.gka_attention(kw.pop("x"), kw.pop("log_sigma"), backend=backend, **kw)
    if f == "scalar":
        return hf_rbf.scalar_attention(kw.pop("qs"), kw.pop("ks"), kw.pop("v"), kw.pop("tau"), backend=backend, **kw)
    return hf_rbf.hybrid_attention(
        kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("qs"), kw.pop("ks"), kw.pop("tau"), backend=backend, **kw
    )


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


@dataclass
class Result:
    case: Case
    errors: dict = field(default_factory=dict)  # name -> (error, tolerance)
    error: str | None = None  # an exception message

    @property
    def ok(self) -> bool:
        return self.error is None and all(e <= t for e, t in self.errors.values())

    def summary(self) -> str:
        if self.error:
            return f"ERROR {self.error}"
        worst = max(self.errors.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1e-30))
        return f"worst {worst[0]} {worst[1][0]:.2e} (tol {worst[1][1]:.0e})"


def _run(case, tensors, args, backend, dout):
    leaves = {k: v.detach().clone().requires_grad_(case.grad and v.is_floating_point()) for k, v in tensors.items()}
    if case.grad:
        out = call(case, leaves, args, backend)
        out.backward(dout.to(out.dtype))
        grads = {k: v.grad for k, v in leaves.items()}
    else:
        with torch.no_grad():
            out = call(case, leaves, args, backend)
        grads = {}
    return out.detach(), grads


def check_case(case: Case, device) -> Result:
    """Run ``case`` through the triton backend and the float64 naive reference; compare output and gradients."""
    res = Result(case)
    try:
        made = make_inputs(case, device)
        tensors, args = made["tensors"], made["args"]
        ref_tensors = {k: v.double() for k, v in tensors.items()}
        out_ref, grads_ref = _run(case, ref_tensors, args, "naive", _dout(case, device, tensors))
        out, grads = _run(case, tensors, args, "triton", _dout(case, device, tensors))
        if (
            hf_rbf.last_backend(
                {
                    "rbf": "rbf_attention",
                    "gka": "gka_attention",
                    "scalar": "scalar_attention",
                    "hybrid": "hybrid_attention",
                }[case.family]
            )
            != "triton"
        ):
            raise RuntimeError("the triton backend did not serve the call")
        tol_out, tol_grad = TOLERANCES[case.dtype]
        if out.dtype != case.dtype:
            raise RuntimeError(f"output dtype {out.dtype}, expected {case.dtype}")
        res.errors["out"] = (rel_err(out, out_ref), tol_out)
        for name, g_ref in grads_ref.items():
            g = grads.get(name)
            if g is None:
                res.errors[f"d{name}"] = (float("inf"), tol_grad)
                continue
            if g.shape != tensors[name].shape:
                raise RuntimeError(
                    f"gradient of {name} has shape {tuple(g.shape)}, expected {tuple(tensors[name].shape)}"
                )
            res.errors[f"d{name}"] = (rel_err(g, g_ref), tol_grad)
        if case.pad and case.causal and not case.prefix and case.nq == case.nk:
            # rows of batch element 1 whose allowed keys are all padding must be exactly zero
            dead = out[1, :, : case.pad]
            res.errors["masked rows"] = (float(dead.abs().max().item()) if dead.numel() else 0.0, 0.0)
    except Exception as exc:  # noqa: BLE001 - reported per case by the callers
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return res


def _dout(case: Case, device, tensors) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(case.seed + 1000)
    dv = case.d if case.family == "gka" else case.dv
    return torch.randn(case.b, case.h, case.nq, dv, generator=gen).to(device=device, dtype=torch.float64)


def small_cases() -> dict[str, list[Case]]:
    """CPU-interpreter cases per family: odd lengths, head dims 8..64, every mask feature, every parameter form."""
    out = {}
    for fam in FAMILIES:
        base = Case(fam)
        cases = [
            base,
            replace(base, dtype=torch.bfloat16, d=16, dv=16, causal=True, window=7, prefix=3),
            replace(base, dtype=torch.float16, d=40, dv=40, causal=False, prefix=2, klw="1h", seed=1),
            replace(base, causal=False, window=6, d=64, dv=64, klw="bh", seed=2),
            replace(base, pad=5, klw="b", window=9, seed=3),  # fully masked rows (left padding, no prefix)
            replace(base, nq=11, nk=37, prefix=2, window=8, pad=3, seed=4),  # queries = the last 11 positions
            replace(base, nq=5, nk=40, causal=False, klw="bh", d=8, dv=8, seed=5),
            replace(base, nq=3, nk=83, prefix=4, klw="b", grad=False, seed=6),  # decode path (split-K, no grad)
            replace(base, nq=1, nk=70, window=20, pad=4, grad=False, dtype=torch.bfloat16, seed=7),
            replace(base, learn=False, seed=8),
        ]
        if fam == "rbf":
            cases += [
                replace(base, normalize=False, window=5, prefix=2, seed=9),
                replace(base, normalize=False, nq=4, nk=50, grad=False, klw="b", seed=10),
                replace(base, scale_inputs=20.0, seed=11),
            ]
        if fam == "gka":
            cases += [
                replace(base, eps=0.05, pad=4, seed=9),
                replace(base, eps=0.0, klw="bh", seed=10),
                replace(base, eps=0.05, nq=2, nk=60, grad=False, seed=11),
                replace(base, scale_inputs=20.0, seed=12),
            ]
        if fam in ("scalar", "hybrid"):
            cases += [
                replace(base, groups=2, tau="token", seed=9),
                replace(base, groups=1, tau="float", klw="bh", window=5, dtype=torch.bfloat16, seed=10),
                replace(base, h=6, groups=2, dv=20, tau="head", prefix=1, seed=11),  # 3 heads per group
                replace(base, groups=2, nq=9, nk=33, tau="token", prefix=2, seed=12),
                # decode rows (split-K, no grad) with grouped values and each temperature form
                replace(base, groups=2, nq=1, nk=45, tau="token", prefix=2, pad=3, grad=False, seed=15),
                replace(base, h=6, groups=2, dv=20, tau="head", nq=2, nk=51, klw="bh", window=9, grad=False,
                        dtype=torch.float16, seed=16),  # fmt: skip
                replace(base, groups=1, tau="float", nq=1, nk=40, grad=False, dtype=torch.bfloat16, seed=17),
            ]
        if fam == "hybrid":
            cases += [replace(base, scale="zero", seed=13), replace(base, scale="default", dv=16, seed=14)]
        out[fam] = cases
    return out


def full_cases() -> list[Case]:
    """GPU cases at training shapes (N up to 4096, head dims 40..256, every dtype, masks and parameter forms)."""
    cases = []
    for fam in FAMILIES:
        base = Case(fam, b=2, h=8, nq=2048, nk=2048, d=64, dv=64)
        fam_cases = [
            replace(base, dtype=torch.bfloat16),
            replace(base, dtype=torch.bfloat16, d=128, dv=128, window=512, prefix=4, klw="b"),
            replace(base, dtype=torch.float16, nq=1999, nk=1999, d=40, dv=40, causal=False, pad=37, klw="bh"),
            replace(base, dtype=torch.float32, nq=1023, nk=1023, d=96, dv=96, window=300, pad=11),
            replace(base, dtype=torch.bfloat16, nq=4096, nk=4096, b=1, h=4, window=1024, prefix=8),
            replace(base, dtype=torch.bfloat16, nq=1024, nk=1024, d=256, dv=256, h=4, prefix=3),
            replace(base, dtype=torch.bfloat16, nq=1000, nk=3000, causal=True, window=700, prefix=2, pad=100),
            replace(base, dtype=torch.bfloat16, nq=1, nk=32768, b=2, h=8, prefix=4, pad=64, grad=False),
            replace(base, dtype=torch.float16, nq=4, nk=9000, window=4096, grad=False, klw="b"),
            # an eager decode step over at most kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS keys: one unsplit launch
            replace(base, dtype=torch.bfloat16, nq=1, nk=777, b=2, h=8, prefix=4, pad=64, grad=False),
        ]
        if fam == "rbf":
            fam_cases.append(replace(base, dtype=torch.bfloat16, normalize=False, window=256))
        if fam == "gka":
            fam_cases.append(replace(base, dtype=torch.bfloat16, eps=0.05, pad=64))
        if fam in ("scalar", "hybrid"):
            fam_cases += [
                replace(base, dtype=torch.bfloat16, h=16, groups=4, tau="token"),
                replace(base, dtype=torch.bfloat16, h=12, groups=4, dv=80, tau="head", window=512, prefix=4),
            ]
        cases += fam_cases
    return cases
