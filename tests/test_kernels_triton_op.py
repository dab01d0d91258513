"""The triton_op path of the fused distance attention (the default; ``HF_RBF_TRITON_OP=0`` turns it off,
``attention_distance_triton.TRITON_OP``; docs/triton_op_plan.md, step 0 and "Then": RBF, GKA and the hybrid).

While ``torch.compile`` traces, the distance op (RBF, GKA, hybrid) goes through the triton_ops ``distance_fwd_t`` /
``distance_bwd_t``, whose kernel launches AOTAutograd decomposes into ``triton_kernel_wrapper_functional`` nodes that
Inductor launches from its generated code.  Neither Triton's CPU interpreter nor a CPU can run that path, so:

* the trace tests run in a child process (this file run as a script: a stub Triton driver reporting an sm90 GPU, no
  interpreter, real ``@triton.jit`` kernels, CPU tensors; the driver cannot leak into other tests) and compile with an
  AOTAutograd backend that keeps the partitioned forward and backward graphs (Inductor's partitioner) and stops there.
  They check that the graphs hold exactly the expected kernel launches, that Triton's TTIR mutation analysis succeeded
  (only the kernels' fresh outputs are cloned, never q / k / v or another graph input; no "assuming every input is
  mutated" warning), that our pruned autotune configs reach the traced launches, and that the ops' kernel lists (the
  AOTAutograd cache key) name our kernels;
* in this process (the interpreter): the flag is ignored there, visibly (logged once), and ``torch.compile`` of an
  RBF attention forward+backward with the flag on still matches eager;
* ``gpu``-marked: Inductor compiles RBF, GKA and hybrid forwards+backwards with the flag on, and they match the
  float64 reference.

The scalar family (``scalar_fwd_t`` / ``scalar_bwd_t``, its own kernels) takes the same path only with
``attention_scalar_triton.SCALAR_TRITON_OP`` on as well (``HF_RBF_SCALAR_TRITON_OP``, on by default since its
``gpu``-marked test passed on an H200); the child turns it on unless a spec says ``scalar_flag=False``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ != "__main__":
    import pytest
    import torch

    from kernel_env import IN_PROCESS, ON_GPU, check_compiled_matches_eager  # noqa: E402 (first: sets TRITON_INTERPRET)

    import hf_rbf  # noqa: E402
    from hf_rbf import attention_distance_triton as adt  # noqa: E402

_REPO = Path(__file__).resolve().parents[1]

# The kernels' tensor parameters that they write (outputs and scratch): the only names the TTIR analysis may report
# as mutated, so the only ones functionalization may clone.
OUTPUT_PARAMS = {
    "_distance_fwd_kernel": {"OUT", "LSE"},
    "_key_bias_kernel": {"KB", "KN"},
    "_distance_bwd_dq_kernel": {"WORK", "DQ", "DQS", "DBETA"},
    "_distance_bwd_dkdv_kernel": {"WORK", "DK", "DV", "DKB", "DKS", "DPK", "DPV"},
    "_scalar_fwd_kernel": {"OUT", "LSE"},
    "_scalar_bwd_dq_kernel": {"WORK", "DQS", "DTAU"},
    "_scalar_bwd_dkv_kernel": {"DV", "DKS", "DKB"},
}
# Every other node of the traced graphs: allocations, the HOPs' output unpacking, and the torch ops of the adapter,
# the loss and the gradient reductions.  No clone / copy: a graph input copied for a kernel would show up as one.
OTHER_OPS = {
    "empty",
    "empty_like",
    "empty_strided",
    "getitem",
    "_to_copy",
    "sum",
    "detach",
    "expand",
    "slice",
    "unbind",
    "mul",
    "view",
    "neg",
    "squeeze",
    "unsqueeze",
    "alias",
    "exp",  # GKA's adapter: 1 / (2 sigma^2) from log sigma
    "add",  # GKA's backward: x's gradient as query plus as key (and value)
    "full",  # the hybrid's fixed temperature (a constant vector)
    "cat",  # the scalar family's separate prefix values, in front of v (as in eager: scalar_attention_triton)
}

# (id, spec): the rbf forms traced in the child.  n 256: above SMALL_N_BUCKET, so the autotuner keeps several configs.
TRACE_CASES = [
    ("causal-d64-bf16", dict(d=64, dtype="bfloat16", causal=True)),
    ("bidirectional-window-d256-f32", dict(d=256, dtype="float32", causal=False, window=100)),
    ("causal-window-registers", dict(d=64, dtype="bfloat16", causal=True, window=64, registers=2)),
    ("susie-register", dict(d=64, dtype="bfloat16", causal=True, registers=1, susie=True)),
    ("padding-softmax-free", dict(d=32, dtype="float32", causal=True, padding=True, normalize=False)),
]

# (id, spec): the GKA forms (x as query, key and value: kv_same) and the hybrid forms (the scalar term, tau_in)
GKA_CASES = [
    ("gka-causal-d64-bf16", dict(form="gka", d=64, dtype="bfloat16", causal=True)),
    ("gka-bidirectional-window-d128-f32", dict(form="gka", d=128, dtype="float32", causal=False, window=100)),
    ("gka-causal-window-register-susie", dict(form="gka", d=64, dtype="bfloat16", causal=True, window=64,
                                              registers=2, susie=True)),  # fmt: skip
]
HYBRID_CASES = [
    ("hybrid-learnable-tau", dict(form="hybrid", d=64, dtype="bfloat16", causal=True, tau="head")),
    ("hybrid-fixed-tau-window", dict(form="hybrid", d=32, dtype="float32", causal=False, window=100)),
    ("hybrid-register-padding", dict(form="hybrid", d=64, dtype="bfloat16", causal=True, tau="head", registers=1,
                                     padding=True)),  # fmt: skip
]
# (id, spec): the scalar family (its own kernels, scalar_fwd_t / scalar_bwd_t; SCALAR_TRITON_OP on in the child
# unless the spec says otherwise).  tau: "head" (learnable [H]), "token" (learnable [B, H, N]) or "float" (fixed);
# groups: value groups (G < H: grouped values); registers: separate prefix values (in front of v, num_prefix_keys)
SCALAR_CASES = [
    ("scalar-causal-d64-bf16", dict(form="scalar", d=64, dtype="bfloat16", causal=True, tau="head")),
    ("scalar-window-grouped-f32", dict(form="scalar", d=32, dtype="float32", causal=False, window=100, groups=2,
                                       tau="token")),  # fmt: skip
    ("scalar-register-susie-fixed-tau", dict(form="scalar", d=64, dtype="bfloat16", causal=True, registers=1,
                                             susie=True, tau="float")),  # fmt: skip
    ("scalar-causal-window-padding-grouped", dict(form="scalar", d=128, dtype="bfloat16", causal=True, window=64,
                                                  groups=1, padding=True, tau="head")),  # fmt: skip
]

# ----------------------------------------------------------------------------------------------------------------
# the child: trace with a stub driver (no GPU, no interpreter)
# ----------------------------------------------------------------------------------------------------------------


def _child(spec: dict) -> dict:
    import logging
    import types

    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    class StubDriver:
        """What tracing asks of triton's active driver: the target the TTIR is generated for."""

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_current_stream(self, *args):
            return 0

        def map_python_to_cpp_type(self, ty):
            return "void*"

        def get_benchmarker(self):
            raise RuntimeError("the stub driver cannot time kernels")

    triton.runtime.driver.set_active(StubDriver())

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(f"{record.name}: {record.getMessage()}")

    records = Records()
    # triton_kernel_wrap logs through "torch._dynamo", which torch's logging setup keeps from propagating
    for name in ("torch", "torch._dynamo", "torch._higher_order_ops", "torch._inductor"):
        logging.getLogger(name).addHandler(records)

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._library.triton import triton_ops_to_kernels

    import hf_rbf
    from hf_rbf import attention_distance_triton as adt
    from hf_rbf import attention_rbf, kernels_common

    from hf_rbf import attention_gka, attention_hybrid

    assert not kernels_common.DEFINED_INTERPRETED
    adt.TRITON_OP = spec.get("flag", True)
    from hf_rbf import attention_scalar_triton

    attention_scalar_triton.SCALAR_TRITON_OP = spec.get("scalar_flag", spec.get("flag", True))
    # the public functions' triton backends refuse CPU tensors without the interpreter: let the trace through
    for module in (attention_rbf, attention_gka, attention_hybrid):
        module.distance_reason = lambda *args, **kwargs: None
    attention_scalar_triton.triton_unavailable_reason = lambda *args, **kwargs: None

    if spec.get("break_analysis"):
        # the negative control: Triton's TTIR generation fails, as it does without a GPU target
        from torch._higher_order_ops import triton_kernel_wrap

        def no_ttir(*args, **kwargs):
            raise RuntimeError("no TTIR (test)")

        triton_kernel_wrap.generate_ttir = no_ttir

    captured = {}

    class Stop(Exception):
        pass

    def partition(joint, inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        captured["fw"], captured["bw"] = fw, bw
        return fw, bw

    def fw_compiler(gm, example_inputs):
        raise Stop  # the graphs are kept: nothing here can run the kernels

    backend = aot_autograd(fw_compiler=fw_compiler, partition_fn=partition)

    def kernel_name(kernel) -> str:
        """The Python function's name under an Autotuner / JITFunction."""
        while not isinstance(kernel, types.FunctionType):
            kernel = kernel.fn
        return kernel.__name__

    d, b, h, n = spec["d"], 2, 4, spec.get("n", 256)
    dtype = getattr(torch, spec["dtype"])
    gen = torch.Generator().manual_seed(0)
    leaf = lambda *shape, dt=dtype: torch.randn(*shape, generator=gen).to(dt).requires_grad_(True)  # noqa: E731
    t = {"q": leaf(b, h, n, d), "k": leaf(b, h, n, d), "v": leaf(b, h, n, d), "gamma": leaf(h, dt=torch.float32)}
    r = spec.get("registers", 0)
    form = spec.get("form", "rbf")
    if form == "gka":  # x as query, key and value; the bandwidth's log
        t = {"x": leaf(b, h, n, d), "log_sigma": leaf(h, dt=torch.float32)}
        if r:
            t["prefix_features"] = leaf(1, h, r, d)
    elif r:
        t["prefix_keys"], t["prefix_values"] = leaf(1, h, r, d), leaf(1, h, r, d)
    if form == "scalar":  # the scalar family (its own kernels and ops): grouped values, the keys cover the registers
        g = spec.get("groups", h)
        t = {"qs": leaf(b, h, n), "ks": leaf(b, h, r + n), "v": leaf(b, g, n, d)}
        if r:
            t["prefix_values"] = leaf(1, g, r, d)
        tau_kind = spec.get("tau", "head")
        if tau_kind != "float":
            t["tau"] = leaf(h, dt=torch.float32) if tau_kind == "head" else leaf(b, h, n, dt=torch.float32)
            with torch.no_grad():
                t["tau"].abs_().add_(0.5)
    if form == "hybrid":  # the scalar term: scalar queries / keys (the keys cover the registers), per-head scale
        t.update(qs=leaf(b, h, n), ks=leaf(b, h, r + n), scale=leaf(h, dt=torch.float32))
        if spec.get("tau") == "head":  # a learnable temperature per head, with its gradient
            t["tau"] = leaf(h, dt=torch.float32)
    if spec.get("susie"):
        t["key_log_weights"] = leaf(1, h, r + n, dt=torch.float32)
    weight = torch.randn(b, h, n, d, generator=gen)
    mask = None
    if spec.get("padding"):
        mask = torch.ones(b, r + n, dtype=torch.bool)  # (every key, the registers included)
        mask[1, : n // 3] = False

    def loss(t):
        if form == "gka":
            out = hf_rbf.gka_attention(
                t["x"], t["log_sigma"], causal=spec["causal"], window=spec.get("window"), num_prefix_keys=r,
                prefix_features=t.get("prefix_features"), key_log_weights=t.get("key_log_weights"),
                attention_mask=mask, backend="triton",
            )  # fmt: skip
        elif form == "scalar":
            out = hf_rbf.scalar_attention(
                t["qs"], t["ks"], t["v"], t.get("tau", 0.8), causal=spec["causal"], window=spec.get("window"),
                key_log_weights=t.get("key_log_weights"), attention_mask=mask, num_prefix_keys=r,
                prefix_values=t.get("prefix_values"), backend="triton",
            )  # fmt: skip
        elif form == "hybrid":
            out = hf_rbf.hybrid_attention(
                t["q"], t["k"], t["v"], t["qs"], t["ks"], t.get("tau", 0.8), scale=t["scale"], causal=spec["causal"],
                window=spec.get("window"), key_log_weights=t.get("key_log_weights"), attention_mask=mask,
                num_prefix_keys=r, prefix_keys=t.get("prefix_keys"), prefix_values=t.get("prefix_values"),
                backend="triton",
            )  # fmt: skip
        else:
            out = hf_rbf.rbf_attention(
                t["q"],
                t["k"],
                t["v"],
                gamma=t["gamma"],
                causal=spec["causal"],
                window=spec.get("window"),
                normalize=spec.get("normalize", True),
                key_log_weights=t.get("key_log_weights"),
                attention_mask=mask,
                num_prefix_keys=r,
                prefix_keys=t.get("prefix_keys"),
                prefix_values=t.get("prefix_values"),
                backend="triton",
            )
        # a weighted sum: the output gradient is then a contiguous tensor (a plain sum's is a stride-0 expand, which
        # distance_backward makes contiguous with a clone of its own, unrelated to the kernels)
        return (out.float() * weight).sum()

    def run():
        if not spec.get("model"):
            return torch.compile(loss, backend=backend, fullgraph=True)(t)
        # the profile's "rbf (1 register, SuSiE, triton_op)", "gka (triton_op)" and "hybrid_sort (1 register,
        # triton_op)" models in small: every layer's attention in one graph
        from transformers import AutoConfig, AutoModelForCausalLM

        model_type = spec["model"] if isinstance(spec["model"], str) else "rbf"
        extra = {
            "rbf": dict(num_register_tokens=1, position_embedding_type="susie"),
            "gka": dict(),
            "hybrid_sort": dict(num_register_tokens=1),
            "scalar_sort": dict(num_register_tokens=1),
        }[model_type]
        config = AutoConfig.for_model(
            model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=n, attention_backend="triton", **extra,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config).train()
        ids = torch.randint(0, 128, (2, n), generator=gen)
        return torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()

    error = None
    try:
        run()
        error = "the compiled function ran: the capture did not stop it"
    except Exception as err:  # noqa: BLE001 (the expected Stop arrives wrapped by dynamo)
        if "Stop" not in f"{type(err).__name__}: {err}" and not isinstance(err.__cause__, Stop):
            error = f"{type(err).__name__}: {err}"[:2000]

    def describe(gm):
        if gm is None:
            return None
        nodes = []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            # OpOverloads and HOPs by name() ("aten::empty.memory_format", "triton_kernel_wrapper_functional")
            named = callable(getattr(target, "name", None))
            name = target.name() if named else getattr(target, "__name__", str(target))
            entry = {"op": name}
            if "triton_kernel_wrapper" in name:
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                args = node.kwargs["kwargs"]
                sources = {}
                for param in node.kwargs.get("tensors_to_clone", []):
                    src = args.get(param)
                    sources[param] = (
                        None if src is None else f"{src.op}:{getattr(src.target, '__name__', str(src.target))}"
                    )
                entry.update(
                    kernel=kernel_name(kernel),
                    clone=list(node.kwargs.get("tensors_to_clone", [])),
                    clone_sources=sources,
                    configs=[
                        [c.kwargs.get("BLOCK_M"), c.kwargs.get("BLOCK_N"), c.num_warps, c.num_stages]
                        for c in getattr(kernel, "configs", [])
                    ],
                    constants={k: v for k, v in args.items() if k in ("TMA", "HAS_KB", "KNORM_INLINE", "SEP_PREFIX")},
                )
            nodes.append(entry)
        return nodes

    ops = {name: [kernel_name(k) for k in kernels] for name, kernels in triton_ops_to_kernels.items()
           if name.startswith((adt._NS + "::", attention_scalar_triton._NS + "::"))}  # fmt: skip
    return {
        "error": error,
        "fw": describe(captured.get("fw")),
        "bw": describe(captured.get("bw")),
        "messages": [m for m in records.messages if "mutated" in m or "identify_mutated_tensors" in m],
        "op_kernels": ops,
    }


def run_child(spec: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"child failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


if __name__ == "__main__":
    print("RESULT " + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
    sys.exit(0)


# ----------------------------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------------------------


def _hops(nodes):
    return [n for n in nodes if "kernel" in n]


def _check_graph(nodes, expected_kernels, where):
    assert nodes is not None, f"no {where} graph was captured"
    hops = _hops(nodes)
    assert [n["kernel"] for n in hops] == expected_kernels, (where, nodes)
    for n in hops:
        assert n["op"] == "triton_kernel_wrapper_functional", (where, n)
        # the mutation analysis found the kernel's own outputs, and they are fresh buffers: no graph input is copied
        assert n["clone"], (where, n)
        assert set(n["clone"]) <= OUTPUT_PARAMS[n["kernel"]], (where, n)
        for param, source in n["clone_sources"].items():
            assert source is not None and not source.startswith("placeholder"), (where, param, source)
    others = [n["op"].split("::")[-1].split(".")[0] for n in nodes if "kernel" not in n]
    unexpected = [op for op in others if op not in OTHER_OPS]
    assert not unexpected, (where, unexpected, nodes)


@pytest.mark.parametrize("spec", [c[1] for c in TRACE_CASES], ids=[c[0] for c in TRACE_CASES])
def test_traced_graphs_launch_the_kernels(spec):
    """Flag on, stub driver: the forward graph launches the key-bias pass (key weights, padding) and the forward
    kernel, the backward graph the dQ and dK/dV kernels, as triton_kernel_wrapper_functional nodes; the TTIR mutation
    analysis succeeded for each (no fallback warning, only outputs cloned); the pruned configs reach the launches."""
    res = run_child(spec)
    assert res["error"] is None, res["error"]
    assert not res["messages"], res["messages"]
    # the key-bias pass: key log-weights, padding, or the key norms from head dim KNORM_PASS_MIN_HEAD_DIM (128) on
    key_bias = bool(spec.get("susie") or spec.get("padding") or spec["d"] >= adt.KNORM_PASS_MIN_HEAD_DIM)
    fw_kernels = (["_key_bias_kernel"] if key_bias else []) + ["_distance_fwd_kernel"]
    _check_graph(res["fw"], fw_kernels, "forward")
    _check_graph(res["bw"], ["_distance_bwd_dq_kernel", "_distance_bwd_dkdv_kernel"], "backward")
    fwd = [n for n in res["fw"] if n.get("kernel") == "_distance_fwd_kernel"][0]
    assert set(fwd["clone"]) == {"OUT", "LSE"}
    # autotuned with our pruning (_prune_fwd): a subset of FWD_CONFIGS, several at N 256 (above SMALL_N_BUCKET) where
    # they fit, one at head dim 256 in float32 (the others exceed the register / shared-memory estimates)
    from hf_rbf.kernels_flash_fwd import FWD_CONFIGS

    shipped = [[kw["BLOCK_M"], kw["BLOCK_N"], warps, stages] for kw, warps, stages in FWD_CONFIGS]
    assert fwd["configs"] and all(c in shipped for c in fwd["configs"]), fwd
    assert (len(fwd["configs"]) > 1) is (spec["d"] <= 128), fwd
    assert fwd["constants"]["TMA"] is (spec["d"] <= 128), fwd  # TMA up to head dim 128 (tma_path)
    assert fwd["constants"]["HAS_KB"] is key_bias, fwd
    assert fwd["constants"]["SEP_PREFIX"] is bool(spec.get("registers")), fwd
    dkdv = [n for n in res["bw"] if n.get("kernel") == "_distance_bwd_dkdv_kernel"][0]
    expected = {"WORK", "DK", "DV"} | ({"DPK", "DPV"} if spec.get("registers") else set())
    expected |= {"DKB"} if spec.get("susie") else set()
    assert set(dkdv["clone"]) == expected, dkdv
    # the ops' kernel lists (AOTAutograd's cache key): every kernel a literal wrap_triton call launches
    kernels = res["op_kernels"]
    assert set(kernels[f"{adt._NS}::distance_fwd_t"]) == {"_distance_fwd_kernel", "_key_bias_kernel"}, kernels
    assert set(kernels[f"{adt._NS}::distance_bwd_t"]) == {"_distance_bwd_dq_kernel", "_distance_bwd_dkdv_kernel"}


@pytest.mark.parametrize(
    "spec", [c[1] for c in GKA_CASES + HYBRID_CASES], ids=[c[0] for c in GKA_CASES + HYBRID_CASES]
)
def test_traced_graphs_launch_the_kernels_gka_hybrid(spec):
    """Flag on, stub driver, GKA and the hybrid: the same kernel launches as the RBF form's, each written name a fresh
    buffer.  GKA (``kv_same``: one tensor as q, k and v, ``dk`` also passed as DV, the placeholder as DPV) has only
    DK / DPK of them written (the dK/dV kernel stores no DV / DPV with ``KV_SAME``), so no tensor is written under two
    names (docs/triton_op_plan.md, fix 9) and GKA never reads through TMA; the hybrid's extra outputs (DQS, DKS, and
    DBETA where the temperature is learnable: its gradient through ``tau_in``) are cloned as fresh outputs."""
    res = run_child(spec)
    assert res["error"] is None, res["error"]
    assert not res["messages"], res["messages"]
    gka = spec["form"] == "gka"
    knorm_pass = gka and spec["d"] >= adt.KNORM_PASS_MIN_HEAD_DIM  # GKA's key norms (the hybrid has none)
    key_bias = bool(spec.get("susie") or spec.get("padding") or knorm_pass)
    _check_graph(res["fw"], (["_key_bias_kernel"] if key_bias else []) + ["_distance_fwd_kernel"], "forward")
    _check_graph(res["bw"], ["_distance_bwd_dq_kernel", "_distance_bwd_dkdv_kernel"], "backward")
    fwd = [n for n in res["fw"] if n.get("kernel") == "_distance_fwd_kernel"][0]
    assert set(fwd["clone"]) == {"OUT", "LSE"}
    from hf_rbf.kernels_flash_fwd import FWD_CONFIGS

    shipped = [[kw["BLOCK_M"], kw["BLOCK_N"], warps, stages] for kw, warps, stages in FWD_CONFIGS]
    assert fwd["configs"] and all(c in shipped for c in fwd["configs"]), fwd
    # N 256 (above SMALL_N_BUCKET), head dims up to 64: our pruning keeps several (one at d128 f32: the estimates)
    assert (len(fwd["configs"]) > 1) is (spec["d"] <= 64), fwd
    assert fwd["constants"]["TMA"] is (not gka and spec["d"] <= 128), fwd  # GKA never takes TMA (tma_path)
    assert fwd["constants"]["HAS_KB"] is key_bias, fwd
    assert fwd["constants"]["SEP_PREFIX"] is bool(spec.get("registers")), fwd
    for n in _hops(res["bw"]):
        assert n["configs"], n  # autotuned launches (our configs, pruned), not a bare JITFunction
    dq = [n for n in res["bw"] if n.get("kernel") == "_distance_bwd_dq_kernel"][0]
    dkdv = [n for n in res["bw"] if n.get("kernel") == "_distance_bwd_dkdv_kernel"][0]
    registers = bool(spec.get("registers"))
    if gka:
        assert set(dq["clone"]) == {"WORK", "DQ"}, dq
        expected = {"WORK", "DK"} | ({"DPK"} if registers else set())
    else:
        assert set(dq["clone"]) == {"WORK", "DQ", "DQS"} | ({"DBETA"} if spec.get("tau") else set()), dq
        expected = {"WORK", "DK", "DV", "DKS"} | ({"DPK", "DPV"} if registers else set())
    expected |= {"DKB"} if spec.get("susie") else set()
    assert set(dkdv["clone"]) == expected, dkdv
    kernels = res["op_kernels"]
    assert set(kernels[f"{adt._NS}::distance_fwd_t"]) == {"_distance_fwd_kernel", "_key_bias_kernel"}, kernels
    assert set(kernels[f"{adt._NS}::distance_bwd_t"]) == {"_distance_bwd_dq_kernel", "_distance_bwd_dkdv_kernel"}


@pytest.mark.parametrize("spec", [c[1] for c in SCALAR_CASES], ids=[c[0] for c in SCALAR_CASES])
def test_traced_graphs_launch_the_kernels_scalar(spec):
    """Flags on (``SCALAR_TRITON_OP`` and ``TRITON_OP``), stub driver, the scalar family: the forward graph launches
    ``[_key_bias_kernel,] _scalar_fwd_kernel`` (the pass for key log-weights / padding), the backward
    ``_scalar_bwd_dq_kernel, _scalar_bwd_dkv_kernel``, as triton_kernel_wrapper_functional nodes, the mutation
    analysis succeeded (no fallback warning), and each clones exactly its fresh outputs (docs/triton_op_plan.md, fix
    9: the placeholders ``KB`` / ``TAU`` = ``lse``, ``DTAU`` = ``work`` without a learnable tau, ``DKB`` = ``dks``
    without key bias are constexpr-dead names, neither written nor cloned)."""
    res = run_child(spec)
    assert res["error"] is None, res["error"]
    assert not res["messages"], res["messages"]
    key_bias = bool(spec.get("susie") or spec.get("padding"))
    _check_graph(res["fw"], (["_key_bias_kernel"] if key_bias else []) + ["_scalar_fwd_kernel"], "forward")
    _check_graph(res["bw"], ["_scalar_bwd_dq_kernel", "_scalar_bwd_dkv_kernel"], "backward")
    fwd = [n for n in res["fw"] if n.get("kernel") == "_scalar_fwd_kernel"][0]
    assert set(fwd["clone"]) == {"OUT", "LSE"}, fwd
    assert fwd["constants"]["HAS_KB"] is key_bias, fwd
    for n in _hops(res["fw"]) + _hops(res["bw"]):
        assert n["configs"], n  # autotuned launches (our configs, pruned), not a bare JITFunction
    dq, dkv = _hops(res["bw"])
    learnable_tau = spec.get("tau", "head") != "float"
    assert set(dq["clone"]) == {"WORK", "DQS"} | ({"DTAU"} if learnable_tau else set()), dq
    assert set(dkv["clone"]) == {"DV", "DKS"} | ({"DKB"} if key_bias else set()), dkv  # WORK: only read there
    kernels = res["op_kernels"]
    assert set(kernels[f"{adt._NS}::scalar_fwd_t"]) == {"_scalar_fwd_kernel", "_key_bias_kernel"}, kernels
    assert set(kernels[f"{adt._NS}::scalar_bwd_t"]) == {"_scalar_bwd_dq_kernel", "_scalar_bwd_dkv_kernel"}, kernels


@pytest.mark.parametrize("spec", [TRACE_CASES[0][1], SCALAR_CASES[0][1]], ids=["rbf", "scalar"])
def test_a_failed_mutation_analysis_is_seen(spec):
    """The negative control of the checks above: where the TTIR analysis fails, the child sees torch's "assuming
    every input is mutated" warning (and the compile fails in the partitioner: functionalization clones every
    kernel argument then, outputs of the op's inputs included), so its absence above means the analysis succeeded."""
    res = run_child(dict(spec, break_analysis=True))
    assert any("assuming every input is mutated" in m for m in res["messages"]), res
    assert res["error"] is not None, res


@pytest.mark.parametrize("model", ["rbf", "gka", "hybrid_sort"])
def test_model_graph_launches_the_kernels(model):
    """A small model with the profile variant's settings (rbf: 1 register, SuSiE; gka; hybrid_sort: 1 register),
    compiled whole: with the flag on its graphs launch each layer's forward, dQ and dK/dV kernels (the register
    through the prefix pointers) instead of the custom ops, and hold the same other ops as with the flag off (the
    path adds no copy)."""
    on = run_child(dict(TRACE_CASES[0][1], model=model))
    off = run_child(dict(TRACE_CASES[0][1], model=model, flag=False))
    for res in (on, off):
        assert res["error"] is None, res["error"]
        assert not res["messages"], res["messages"]
    assert [n["kernel"] for n in _hops(on["fw"])] == ["_distance_fwd_kernel"] * 2, on["fw"]
    assert [n["kernel"] for n in _hops(on["bw"])] == ["_distance_bwd_dq_kernel", "_distance_bwd_dkdv_kernel"] * 2
    for n in _hops(on["fw"]) + _hops(on["bw"]):
        assert set(n["clone"]) <= OUTPUT_PARAMS[n["kernel"]], n
        assert all(not src.startswith("placeholder") for src in n["clone_sources"].values()), n
    if model != "gka":
        assert {"DPK", "DPV"} <= set(_hops(on["bw"])[1]["clone"])  # the register's gradients
    if model == "hybrid_sort":
        assert {"DQS"} <= set(_hops(on["bw"])[0]["clone"]) and {"DKS"} <= set(_hops(on["bw"])[1]["clone"])
    for where in ("fw", "bw"):
        ours = [n["op"] for n in on[where] if n["op"].startswith(adt._NS + "::")]
        assert not ours, ours
        assert len([n for n in off[where] if n["op"].startswith(adt._NS + "::")]) == 2
        others_on = sorted(n["op"] for n in on[where] if "kernel" not in n and n["op"] not in ("getitem",))
        others_off = sorted(
            n["op"] for n in off[where] if not n["op"].startswith(adt._NS + "::") and n["op"] not in ("getitem",)
        )
        # the same model ops, plus the kernels' output allocations and the backward's gradient reductions
        extra = list(others_on)
        for op in others_off:
            assert op in extra, (where, op, others_on)
            extra.remove(op)
        assert all(op.split("::")[-1].split(".")[0] in OTHER_OPS for op in extra), (where, extra)


def test_flag_off_keeps_the_custom_op():
    """Flag off (the default): the traced graphs call the custom ops distance_fwd / distance_bwd, no kernel HOP."""
    res = run_child(dict(TRACE_CASES[0][1], flag=False))
    assert res["error"] is None, res["error"]
    for where, op in (("fw", "distance_fwd"), ("bw", "distance_bwd")):
        assert not _hops(res[where]), res[where]
        assert [n["op"] for n in res[where] if n["op"].startswith(adt._NS + "::")] == [f"{adt._NS}::{op}"], res[where]


@pytest.mark.parametrize("flags", [dict(scalar_flag=False), dict(flag=False, scalar_flag=True)],
                         ids=["scalar-flag-off", "triton-op-off"])  # fmt: skip
def test_scalar_flag_off_keeps_the_custom_op(flags):
    """The scalar family keeps its custom ops scalar_fwd / scalar_bwd unless both ``SCALAR_TRITON_OP`` (on by
    default, ``HF_RBF_SCALAR_TRITON_OP=0`` turns it off) and ``TRITON_OP`` are on."""
    from hf_rbf import attention_scalar_triton

    ns = attention_scalar_triton._NS
    res = run_child(dict(SCALAR_CASES[0][1], **flags))
    assert res["error"] is None, res["error"]
    assert not _hops(res["fw"]) and not _hops(res["bw"])
    for where, op in (("fw", "scalar_fwd"), ("bw", "scalar_bwd")):
        assert [n["op"] for n in res[where] if n["op"].startswith(ns + "::")] == [f"{ns}::{op}"], res[where]


def test_model_graph_launches_the_kernels_scalar_sort():
    """A small scalar_sort model with 1 register (the profile's "scalar_sort (1 register)"), compiled whole: with
    both flags on its graphs launch each layer's scalar forward, dQ and dK/dV kernels instead of the custom ops
    (the register's values concatenated in front of v, as in eager), each cloning only fresh outputs; with
    ``SCALAR_TRITON_OP`` off (the default) they call the custom ops."""
    from hf_rbf import attention_scalar_triton

    ns = attention_scalar_triton._NS
    on = run_child(dict(TRACE_CASES[0][1], model="scalar_sort"))
    off = run_child(dict(TRACE_CASES[0][1], model="scalar_sort", scalar_flag=False))
    for res in (on, off):
        assert res["error"] is None, res["error"]
        assert not res["messages"], res["messages"]
    fw_kernels = [n["kernel"] for n in _hops(on["fw"])]
    assert [k for k in fw_kernels if k != "_key_bias_kernel"] == ["_scalar_fwd_kernel"] * 2, on["fw"]
    assert [n["kernel"] for n in _hops(on["bw"])] == ["_scalar_bwd_dq_kernel", "_scalar_bwd_dkv_kernel"] * 2
    for n in _hops(on["fw"]) + _hops(on["bw"]):
        assert set(n["clone"]) <= OUTPUT_PARAMS[n["kernel"]], n
        assert all(not src.startswith("placeholder") for src in n["clone_sources"].values()), n
    for where in ("fw", "bw"):
        assert not [n["op"] for n in on[where] if n["op"].startswith(ns + "::")], on[where]
        assert not _hops(off[where]), off[where]
        ours = [n["op"] for n in off[where] if n["op"].startswith(ns + "::")]
        assert ours == [f"{ns}::scalar_{'fwd' if where == 'fw' else 'bwd'}"] * 2, ours


def test_flag_values(monkeypatch):
    """``use_triton_op``: on by default (where the kernels are not interpreted), every form of the distance op (RBF,
    GKA, hybrid) with it on, never under the interpreter; a bad value raises."""
    if "HF_RBF_TRITON_OP" not in os.environ:
        assert adt.TRITON_OP is True and adt.TRITON_OP_REQUESTED is False
        assert adt.use_triton_op() is (not adt.DEFINED_INTERPRETED)
    monkeypatch.setattr(adt, "TRITON_OP", True)
    interpreted = adt.DEFINED_INTERPRETED
    assert adt.use_triton_op() is (not interpreted)
    monkeypatch.setattr(adt, "TRITON_OP", False)
    assert adt.use_triton_op() is False
    monkeypatch.setattr(adt, "TRITON_OP", "maybe")
    with pytest.raises(ValueError, match="HF_RBF_TRITON_OP"):
        adt.use_triton_op()


def test_scalar_flag_values(monkeypatch):
    """``use_scalar_triton_op``: on by default (``HF_RBF_SCALAR_TRITON_OP``); on only with ``TRITON_OP`` on too and
    the kernels not interpreted; a bad value raises."""
    from hf_rbf import attention_scalar_triton as ast

    if "HF_RBF_SCALAR_TRITON_OP" not in os.environ:
        assert ast.SCALAR_TRITON_OP is True
        assert ast.use_scalar_triton_op() is (adt.use_triton_op() and ast._wrapping_triton is not None)
    monkeypatch.setattr(ast, "SCALAR_TRITON_OP", True)
    monkeypatch.setattr(adt, "TRITON_OP", True)
    assert ast.use_scalar_triton_op() is (not adt.DEFINED_INTERPRETED)
    monkeypatch.setattr(adt, "TRITON_OP", False)
    assert ast.use_scalar_triton_op() is False
    monkeypatch.setattr(ast, "SCALAR_TRITON_OP", "maybe")
    with pytest.raises(ValueError, match="HF_RBF_SCALAR_TRITON_OP"):
        ast.use_scalar_triton_op()


@pytest.mark.skipif(not IN_PROCESS or ON_GPU, reason="the interpreter's fallback (CPU, TRITON_INTERPRET=1)")
def test_flag_ignored_under_the_interpreter(monkeypatch, caplog):
    """Under Triton's interpreter (which cannot trace a triton_op) the flag is ignored, with one warning where
    HF_RBF_TRITON_OP asked for it (none at the default), and the compiled forward+backward (aot_eager, through the
    custom op) still matches eager."""
    import logging

    monkeypatch.setattr(adt, "TRITON_OP", True)
    monkeypatch.setattr(adt, "TRITON_OP_REQUESTED", True)
    monkeypatch.setattr(adt, "_TRITON_OP_IGNORED_LOGGED", [])
    gen = torch.Generator().manual_seed(3)
    t = {
        "q": torch.randn(2, 2, 40, 16, generator=gen),
        "k": torch.randn(2, 2, 40, 16, generator=gen),
        "v": torch.randn(2, 2, 40, 16, generator=gen),
        "prefix_keys": torch.randn(1, 2, 1, 16, generator=gen),
        "prefix_values": torch.randn(1, 2, 1, 16, generator=gen),
        "gamma": torch.rand(2, generator=gen) + 0.1,
    }

    def loss_fn(x):
        out = hf_rbf.rbf_attention(
            x["q"], x["k"], x["v"], gamma=x["gamma"], num_prefix_keys=1, prefix_keys=x["prefix_keys"],
            prefix_values=x["prefix_values"], backend="triton",
        )  # fmt: skip
        return (out * torch.linspace(-1, 1, out.shape[-1])).sum()

    with caplog.at_level(logging.WARNING, logger=adt.__name__):
        check_compiled_matches_eager(loss_fn, t)
        check_compiled_matches_eager(loss_fn, t)
    ignored = [r for r in caplog.records if "HF_RBF_TRITON_OP" in r.getMessage()]
    assert len(ignored) == 1, [r.getMessage() for r in caplog.records]
    # at the default (nobody asked for the triton_ops): no warning
    monkeypatch.setattr(adt, "TRITON_OP_REQUESTED", False)
    monkeypatch.setattr(adt, "_TRITON_OP_IGNORED_LOGGED", [])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=adt.__name__):
        torch._dynamo.reset()
        check_compiled_matches_eager(loss_fn, t)
    assert not [r for r in caplog.records if "HF_RBF_TRITON_OP" in r.getMessage()]


@pytest.mark.skipif(not IN_PROCESS or ON_GPU, reason="the interpreter's fallback (CPU, TRITON_INTERPRET=1)")
def test_flag_read_when_traced(monkeypatch):
    """The flag is read when dynamo traces ``distance_attention`` and guarded: a compiled function traced with one
    value is traced again when it runs with the other (so the benchmark's per-model setting, applied around each
    model's steps, holds for each model), and not again while the value stays."""
    from torch._dynamo.testing import CompileCounterWithBackend

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))

    def fn(q, k, v):
        return hf_rbf.rbf_attention(q, k, v, backend="triton").sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    monkeypatch.setattr(adt, "TRITON_OP", False)
    compiled(q, k, v)
    compiled(q, k, v)
    assert counter.frame_count == 1
    monkeypatch.setattr(adt, "_TRITON_OP_IGNORED_LOGGED", [True])  # (the interpreter's warning is not the subject)
    monkeypatch.setattr(adt, "TRITON_OP", True)
    compiled(q, k, v)
    assert counter.frame_count == 2
    compiled(q, k, v)
    assert counter.frame_count == 2
    torch._dynamo.reset()


# the tolerances of test_kernels_distance_op's GPU test (bfloat16 inputs against the float64 reference)
GPU_TOL_OUT, GPU_TOL_GRAD, GPU_TOL_GAMMA = 1.5e-2, 3e-2, 8e-2


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "d, n, registers, susie, window",
    [(64, 1024, 0, False, None), (64, 1023, 1, True, None), (128, 512, 2, False, 300), (256, 512, 1, True, None)],
)
def test_compiled_triton_op_on_gpu(d, n, registers, susie, window, monkeypatch):
    """Flag on, Inductor: the compiled RBF forward+backward launches our kernels from Inductor's generated code (not
    through the custom op) and matches the float64 naive reference, output and every gradient."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(adt, "TRITON_OP", True)
    gen = torch.Generator().manual_seed(d + n)
    b, h = 2, 4
    t = {
        "q": torch.randn(b, h, n, d, generator=gen),
        "k": torch.randn(b, h, n, d, generator=gen),
        "v": torch.randn(b, h, n, d, generator=gen),
        "gamma": (0.3 + 0.4 * torch.rand(h, generator=gen)) / d**0.5,
    }
    if registers:
        t["prefix_keys"] = torch.randn(1, h, registers, d, generator=gen)
        t["prefix_values"] = torch.randn(1, h, registers, d, generator=gen)
    if susie:
        t["key_log_weights"] = 0.5 * torch.randn(1, h, registers + n, generator=gen)
    dout = torch.randn(b, h, n, d, generator=gen).bfloat16()

    def attention(x, backend):
        return hf_rbf.rbf_attention(
            x["q"], x["k"], x["v"], gamma=x["gamma"], window=window, key_log_weights=x.get("key_log_weights"),
            num_prefix_keys=registers, prefix_keys=x.get("prefix_keys"), prefix_values=x.get("prefix_values"),
            backend=backend,
        )  # fmt: skip

    def run(dtype, compiled):
        leaves = {
            name: x.to("cuda", dtype if x.dim() == 4 else torch.float32 if dtype != torch.float64 else dtype)
            .detach()
            .requires_grad_(True)
            for name, x in t.items()
        }
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(lambda x: attention(x, "triton"), backend="inductor", fullgraph=True)

            def step():
                out = fn(leaves)
                out.backward(dout.to("cuda", out.dtype))
                return out

            out, codes = run_and_get_code(step)
            code = "\n".join(codes)
            assert "_distance_fwd_kernel" in code and "_distance_bwd_dkdv_kernel" in code, code[:4000]
            assert "distance_fwd.default" not in code and "distance_bwd.default" not in code
        else:
            out = attention(leaves, "naive")
            out.backward(dout.to("cuda", out.dtype))
        return out.detach(), {name: x.grad for name, x in leaves.items()}

    def rel_err(x, ref):
        x, ref = x.double(), ref.double()
        assert torch.isfinite(x).all(), "non-finite values"
        den = ref.norm().item()
        return (x - ref).norm().item() / (den if den > 0 else 1.0)

    out, grads = run(torch.bfloat16, True)
    t = {name: (x.bfloat16().double() if x.dim() == 4 else x.double()) for name, x in t.items()}
    out_ref, grads_ref = run(torch.float64, False)
    assert rel_err(out, out_ref) <= GPU_TOL_OUT
    for name, ref in grads_ref.items():
        tol = GPU_TOL_GAMMA if name == "gamma" else GPU_TOL_GRAD
        assert rel_err(grads[name], ref) <= tol, (name, rel_err(grads[name], ref))


def _compiled_case_errors(case, device: str, backend: str) -> dict:
    """A ``benchmarks/kernel_checks.py`` case (GKA, hybrid) through ``torch.compile`` with the fused backend against
    the float64 naive reference (eager): ``{name: (relative error, tolerance)}`` for the output and every gradient
    (the bandwidth, temperature and scale parameters included), with kernel_checks' tolerances, those of the
    families' GPU tests (``test_kernels_gka.py`` / ``test_kernels_hybrid.py``: ``test_full_shapes_on_gpu``).  With
    Inductor the generated code must launch our kernels, not the custom ops."""
    import kernel_checks as kc
    from torch._inductor.utils import run_and_get_code

    made = kc.make_inputs(case, device)
    tensors, args = made["tensors"], made["args"]
    dout = kc._dout(case, device, tensors)
    out_ref, grads_ref = kc._run(case, {k: v.double() for k, v in tensors.items()}, args, "naive", dout)
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    torch._dynamo.reset()
    fn = torch.compile(lambda x: kc.call(case, x, args, "triton"), backend=backend, fullgraph=True)

    def step():
        out = fn(leaves)
        out.backward(dout.to(out.dtype))
        return out

    if backend == "inductor":
        out, codes = run_and_get_code(step)
        code = "\n".join(codes)
        op = "scalar" if case.family == "scalar" else "distance"
        dkv = "_scalar_bwd_dkv_kernel" if op == "scalar" else "_distance_bwd_dkdv_kernel"
        assert f"_{op}_fwd_kernel" in code and dkv in code, code[:4000]
        assert f"{op}_fwd.default" not in code and f"{op}_bwd.default" not in code
    else:
        out = step()
    torch._dynamo.reset()
    tol_out, tol_grad = kc.TOLERANCES[case.dtype]
    assert out.dtype == case.dtype
    errors = {"out": (kc.rel_err(out.detach(), out_ref), tol_out)}
    for name, ref in grads_ref.items():
        grad = leaves[name].grad
        errors[f"d{name}"] = (float("inf") if grad is None else kc.rel_err(grad, ref), tol_grad)
    return errors


def _gpu_cases():
    """GKA and hybrid cases at training shapes: causal, windows, prefix keys, padding, key log-weights, grouped
    values, a learnable bandwidth, temperatures per head, per token and fixed, a learnable scale."""
    import kernel_checks as kc
    from dataclasses import replace

    gka = kc.Case("gka", dtype=torch.bfloat16, b=2, h=8, nq=1024, nk=1024, d=64, dv=64)
    hyb = replace(gka, family="hybrid")
    return [
        gka,
        replace(gka, d=128, dv=128, window=300, prefix=2, klw="b", seed=1),
        replace(gka, nq=1023, nk=1023, eps=0.05, pad=64, causal=False, seed=2),
        hyb,  # tau and scale per head, learnable
        replace(hyb, h=8, groups=4, tau="token", window=300, prefix=2, klw="bh", seed=3),
        replace(hyb, tau="float", d=128, dv=128, nq=1023, nk=1023, pad=37, seed=4),  # a fixed temperature
    ]


def _cases_or_none(make_cases):
    """``make_cases()``, or no cases where ``kernel_checks`` is not importable (the parametrisation is then empty)."""
    try:
        return make_cases()
    except Exception:  # noqa: BLE001
        return []


GPU_CASES = _cases_or_none(_gpu_cases)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_compiled_triton_op_gka_hybrid_on_gpu(case, monkeypatch):
    """Flag on, Inductor: compiled GKA and hybrid forward+backward launch our kernels from Inductor's generated code
    and match the float64 naive reference, output and every gradient (log sigma, tau, scale, the scalar queries and
    keys, the key log-weights)."""
    monkeypatch.setattr(adt, "TRITON_OP", True)
    errors = _compiled_case_errors(case, "cuda", "inductor")
    bad = {name: e for name, e in errors.items() if not e[0] <= e[1]}
    assert not bad, (case.name, bad, errors)


def _scalar_gpu_cases():
    """Scalar cases at training shapes: causal, windows, in-sequence prefix keys, padding, key log-weights, grouped
    values, temperatures per head, per token and fixed; bfloat16 and float32."""
    import kernel_checks as kc
    from dataclasses import replace

    sc = kc.Case("scalar", dtype=torch.bfloat16, b=2, h=8, nq=1024, nk=1024, d=64, dv=64)
    return [
        sc,  # tau per head, learnable
        replace(sc, groups=4, tau="token", window=300, prefix=2, klw="bh", seed=1),
        replace(sc, tau="float", dv=128, nq=1023, nk=1023, pad=37, causal=False, seed=2),
        replace(sc, dtype=torch.float32, groups=2, dv=32, window=100, klw="b", seed=3),
    ]


SCALAR_GPU_CASES = _cases_or_none(_scalar_gpu_cases)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("case", SCALAR_GPU_CASES, ids=lambda c: c.name)
def test_compiled_triton_op_scalar_on_gpu(case, monkeypatch):
    """Both flags on (``SCALAR_TRITON_OP``, ``TRITON_OP``), Inductor: compiled scalar forward+backward launch the
    scalar kernels from Inductor's generated code (not the custom ops) and match the float64 naive reference,
    output and every gradient (qs, ks, v, tau, the key log-weights).  Passed on an H200 (session 25), after which
    ``SCALAR_TRITON_OP`` became the default (docs/triton_op_plan.md, "Scalar as built")."""
    from hf_rbf import attention_scalar_triton as ast

    monkeypatch.setattr(adt, "TRITON_OP", True)
    monkeypatch.setattr(ast, "SCALAR_TRITON_OP", True)
    errors = _compiled_case_errors(case, "cuda", "inductor")
    bad = {name: e for name, e in errors.items() if not e[0] <= e[1]}
    assert not bad, (case.name, bad, errors)


@pytest.mark.skipif(not IN_PROCESS or ON_GPU, reason="the interpreter's fallback (CPU, TRITON_INTERPRET=1)")
@pytest.mark.parametrize("family", ["gka", "hybrid", "scalar"])
def test_compiled_case_check_in_the_interpreter(family, monkeypatch):
    """The GPU test's comparison itself, at a small shape under the interpreter (aot_eager, the flag ignored there):
    every gradient of the case is compared, and within kernel_checks' float32 tolerances."""
    import kernel_checks as kc

    monkeypatch.setattr(adt, "TRITON_OP", True)
    monkeypatch.setattr(adt, "_TRITON_OP_IGNORED_LOGGED", [True])
    from hf_rbf import attention_scalar_triton as ast

    monkeypatch.setattr(ast, "SCALAR_TRITON_OP", True)  # (ignored there too: use_triton_op is False)
    case = kc.Case(family, nq=29, nk=29, d=16, dv=16, window=9, prefix=2, klw="bh")
    errors = _compiled_case_errors(case, "cpu", "aot_eager")
    expected = {
        "gka": {"out", "dx", "dlog_sigma"},
        "hybrid": {"out", "dq", "dk", "dv", "dqs", "dks", "dtau", "dscale"},
        "scalar": {"out", "dqs", "dks", "dv", "dtau"},
    }
    assert expected[family] | {"dkey_log_weights"} == set(errors), errors
    bad = {name: e for name, e in errors.items() if not e[0] <= e[1]}
    assert not bad, errors
