"""``kernels_launch.launch_jit``: a repeated call signature goes to the compiled launcher directly, with the same
launch arguments triton's own ``JITFunction.run`` would pass; anything that could change the launch goes through
``run``.

The CPU tests drive it with a real ``triton.runtime.jit.JITFunction`` whose ``run`` is replaced by a recorder (the
CPU has no compiled kernels); the GPU test compares real kernels launched both ways."""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from hf_rbf import kernels_launch  # noqa: E402


def _kernel(x_ptr, n, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = False):  # noqa: F821
    pass  # never compiled: the test replaces ``run``


class _Compiled:
    """What ``JITFunction.run`` returns: the launcher and what it is called with."""

    def __init__(self, launches):
        self.function = 1234
        self.packed_metadata = ("meta",)
        self.launches = launches

    def run(self, *launch_args):
        self.launches.append(launch_args)


@pytest.fixture
def jit(monkeypatch):
    """A JIT function whose ``run`` records its calls and returns a fake compiled kernel; device 0, stream 77."""
    fn = JITFunction(_kernel)
    runs, launches = [], []
    compiled = _Compiled(launches)

    def run(*args, grid, warmup, **kwargs):
        runs.append((args, grid, kwargs))
        return compiled

    fn.run = run
    monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(kernels_launch, "direct_launch_state", lambda: None)
    monkeypatch.setattr(kernels_launch, "_STATE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    return fn, runs, launches


def test_second_launch_goes_to_the_launcher_with_runs_arguments(jit):
    fn, runs, launches = jit
    x = torch.zeros(64)
    grid = lambda meta: (triton.cdiv(100, meta["BLOCK"]), 3)  # noqa: E731
    kwargs = {"BLOCK": 32, "num_warps": 4}
    kernels_launch.launch_jit(fn, grid, (x, 100, 0.5), kwargs)
    assert len(runs) == 1 and launches == []
    kernels_launch.launch_jit(fn, grid, (x, 100, 0.25), kwargs)  # another float value: the same specialisation
    assert len(runs) == 1
    # grid from the keywords, stream of the current device, no launch metadata or hooks, then every parameter in
    # signature order: the positional ones (tensors as their data pointers), the constexpr from the keywords, the
    # default of the one not given
    assert launches == [(4, 3, 1, 77, 1234, ("meta",), None, None, None, x.data_ptr(), 100, 0.25, 32, False)]


@pytest.mark.parametrize(
    "change",
    ["dtype", "alignment", "int value", "int class", "int type", "keyword", "new keyword"],
)
def test_anything_triton_specialises_on_goes_through_run(jit, change):
    fn, runs, launches = jit
    x = torch.zeros(64)
    args, kwargs = (x, 16, 0.5), {"BLOCK": 32}
    kernels_launch.launch_jit(fn, (1,), args, kwargs)
    other_args, other_kwargs = list(args), dict(kwargs)
    if change == "dtype":
        other_args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        other_args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int value":
        other_args[1] = 1  # triton makes 1 a constant, 16 is "divisible by 16"
    elif change == "int class":
        other_args[1] = 17  # not divisible by 16
    elif change == "int type":
        other_args[1] = 16.0
    elif change == "keyword":
        other_kwargs["BLOCK"] = 64
    else:
        other_kwargs["FLAG"] = True
    kernels_launch.launch_jit(fn, (1,), tuple(other_args), other_kwargs)
    assert len(runs) == 2 and launches == []
    kernels_launch.launch_jit(fn, (1,), tuple(other_args), other_kwargs)  # now known: direct
    assert len(runs) == 2 and len(launches) == 1


def test_call_key_is_at_least_as_fine_as_triton_specialisation():
    """Equal keys must mean equal specialisations: tensors by dtype and 16-byte alignment, integers by what triton
    specialises them on (1; type i32 / i64 / u64; divisible by 16), an autotuner's positional key by value."""
    x = torch.zeros(64)
    key = kernels_launch.call_key
    assert key((x, 3), {}, 0) == key((torch.ones(64), 3), {}, 0)
    assert key((x, 3), {}, 0) != key((x[4:], 3), {}, 0) or x[4:].data_ptr() % 16 == x.data_ptr() % 16
    assert key((x[1:], 3), {}, 0) != key((x, 3), {}, 0)
    assert key((x, 3), {}, 0) != key((x, 3), {}, 1)  # device
    assert key((x, 2**31), {}, 0) != key((x, 2**31 - 16), {}, 0)  # i64 against i32, both divisible by 16
    assert key((x, 2**63), {}, 0) != key((x, 2**63 - 16), {}, 0)  # u64 against i64
    assert key((x, True), {}, 0) == key((x, True), {}, 0) != key((x, False), {}, 0)
    assert key((x, None), {"A": 1}, 0) != key((x, None), {"A": 2}, 0)
    # a decode step's growing length keeps its key while triton's specialisation stays the same
    assert key((x, 17), {}, 0) == key((x, 18), {}, 0) == key((x, 4099), {}, 0) == key((x, 0 - 3), {}, 0)
    assert key((x, 32), {}, 0) == key((x, 4096), {}, 0) == key((x, 0), {}, 0) != key((x, 33), {}, 0)
    assert key((x, 1), {}, 0) != key((x, 17), {}, 0) and key((x, 1), {}, 0) != key((x, 16), {}, 0)
    # an autotuner's key argument, passed positionally: by value
    assert key((x, 17), {}, 0, frozenset({1})) != key((x, 18), {}, 0, frozenset({1}))
    assert key((x, 17), {}, 0, frozenset({1})) == key((x, 17), {}, 0, frozenset({1}))


def test_integer_classes_are_memoised_and_bounded(monkeypatch):
    """The integer classes of a launch come from a per-layout memo of the raw values (a training shape repeats its
    values at every step): a memoised key equals the key computed afresh, the memo holds at most
    ``CLASS_MEMO_LIMIT`` entries, and an unhashable argument neither raises nor launches directly."""
    monkeypatch.setattr(kernels_launch, "CLASS_MEMO_LIMIT", 4)
    monkeypatch.setattr(kernels_launch, "_LAYOUTS", {})
    x = torch.zeros(64)
    values = [0, 1, 2, 3, 15, 16, 17, 32, -17, 2**31, 2**31 - 16, 2**63, 2**63 - 16]
    memoised = {}
    for _ in range(2):  # the second round reads the memo (or refills it after a clear)
        for v in values:
            memoised[v] = kernels_launch.call_key((x, v, 5), {}, 0)
    (layout,) = kernels_launch._LAYOUTS.values()
    assert 0 < len(layout[-1]) <= 4
    for v in values:
        kernels_launch._LAYOUTS.clear()
        assert kernels_launch.call_key((x, v, 5), {}, 0) == memoised[v], v
    assert memoised[17] == memoised[3]  # one class: neither 1 nor divisible by 16, i32
    assert memoised[16] != memoised[17] and memoised[1] != memoised[16] and memoised[2**31] != memoised[2**31 - 16]


def test_an_unhashable_argument_goes_through_run(jit):
    fn, runs, launches = jit
    x = torch.zeros(64)
    for _ in range(2):
        kernels_launch.launch_jit(fn, (1,), (x, 16, [0.5]), {"BLOCK": 32})
    assert len(runs) == 2 and launches == []


def test_call_key_classes_match_triton_specialisation():
    """:func:`kernels_launch._int_class` against triton's own specialisation of an integer argument: equal classes
    exactly where triton specialises equally."""
    jit = pytest.importorskip("triton.runtime.jit")
    specialize = getattr(jit, "native_specialize_impl", None)
    if specialize is None:
        pytest.skip("this triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    values = [0, 1, 2, 3, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 3, -(2**31),
              -(2**31) - 16, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 1]
    triton_class = {v: specialize(BaseBackend, v, False, True, True) for v in values}
    ours = {v: kernels_launch._int_class(v) for v in values}
    for a in values:
        for b in values:
            assert (triton_class[a] == triton_class[b]) == (ours[a] == ours[b]), (a, b, triton_class[a])


@pytest.mark.parametrize("what", ["turned off", "enter hook", "pre-run hook", "not a compiled kernel"])
def test_direct_path_stays_out_of_the_way(jit, monkeypatch, what):
    fn, runs, launches = jit
    x = torch.zeros(64)
    if what == "turned off":
        monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", False)
        monkeypatch.setattr(kernels_launch, "direct_launch_state", lambda: "off")
    elif what == "enter hook":
        hook = kernels_launch._knobs.runtime.launch_enter_hook
        if hasattr(hook, "calls"):  # triton 3.6+: a HookChain
            monkeypatch.setattr(hook, "calls", [print])
        else:
            monkeypatch.setattr(kernels_launch._knobs.runtime, "launch_enter_hook", print)
    elif what == "pre-run hook":
        monkeypatch.setattr(fn, "pre_run_hooks", [lambda *a, **k: None])
    else:
        monkeypatch.setitem(fn.__dict__, "_hf_rbf_direct", False)
    for _ in range(3):
        kernels_launch.launch_jit(fn, (1,), (x, 5, 1.0), {"BLOCK": 16})
    assert len(runs) == 3 and launches == []


def test_a_bad_switch_value_is_named(monkeypatch):
    """``HF_RBF_TRITON_DIRECT_LAUNCH=maybe`` is neither on nor off: the first launch says so, naming the variable and
    the values it takes, instead of picking one."""
    assert kernels_launch.parse_switch(" OFF ") is False and kernels_launch.parse_switch("1") is True
    fn = JITFunction(_kernel)
    runs = []
    fn.run = lambda *args, grid, warmup, **kwargs: runs.append(args)
    monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", kernels_launch.parse_switch("maybe"))
    monkeypatch.setattr(kernels_launch, "_STATE", {})
    with pytest.raises(ValueError, match=r"HF_RBF_TRITON_DIRECT_LAUNCH .* must be one of 1, true, .*'maybe'"):
        kernels_launch.launch_jit(fn, (1,), (torch.zeros(4), 1, 1.0), {"BLOCK": 16})
    assert runs == []


def test_cache_is_bounded(jit, monkeypatch):
    fn, runs, launches = jit
    monkeypatch.setattr(kernels_launch, "CACHE_LIMIT", 4)
    x = torch.zeros(64)
    for block in range(10):  # ten signatures
        kernels_launch.launch_jit(fn, (1,), (x, 5, 1.0), {"BLOCK": 16 * (block + 1)})
    assert len(fn._hf_rbf_direct) <= 4
    kernels_launch.launch_jit(fn, (1,), (x, 5, 1.0), {"BLOCK": 160})
    assert len(runs) == 10 and len(launches) == 1


def test_a_decode_loop_over_growing_lengths_launches_directly(jit):
    """The lengths of a decode loop (one more cached key per step) change the integer arguments' values, not what
    triton specialises them on: after the first launch of each class (1, divisible by 16 or not) every step goes to
    the launcher directly, with the step's own values."""
    fn, runs, launches = jit
    x = torch.zeros(64)
    for n in range(1, 41):
        kernels_launch.launch_jit(fn, (1,), (x, n, 1.0), {"BLOCK": 16})
    assert [r[0][1] for r in runs] == [1, 2, 16]  # the classes' first lengths went through triton
    assert [launch[10] for launch in launches] == [n for n in range(1, 41) if n not in (1, 2, 16)]


def test_autotuned_kernel_launches_its_chosen_config_then_directly(jit):
    """``kernels_common.launch_tuned``: the autotuner's cached choice for the call's tuning key is launched through
    the JIT function with the config's keywords; the repeat goes to the launcher, its grid from the config."""
    from hf_rbf import kernels_common

    fn, runs, launches = jit
    configs = [triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 64}, num_warps=4)]
    tuned = triton.autotune(configs=configs, key=["n"])(fn)
    x = torch.zeros(64)
    tuned.cache[(100, str(x.dtype))] = configs[1]  # what the autotuner chose for n = 100
    grid = lambda meta: (triton.cdiv(100, meta["BLOCK"]),)  # noqa: E731
    kernels_common.launch_tuned(tuned, grid, x, 100, 0.5, FLAG=True)
    assert len(runs) == 1 and runs[0][2] == {"FLAG": True, **configs[1].all_kwargs()}
    kernels_common.launch_tuned(tuned, grid, x, 100, 0.5, FLAG=True)
    assert len(runs) == 1
    assert launches == [(2, 1, 1, 77, 1234, ("meta",), None, None, None, x.data_ptr(), 100, 0.5, 64, True)]
    # n is the autotuner's key: another value (same specialisation class) is another tuning key, asked for again
    tuned.cache[(116, str(x.dtype))] = configs[0]
    kernels_common.launch_tuned(tuned, grid, x, 116, 0.5, FLAG=True)
    assert len(runs) == 2 and runs[1][2] == {"FLAG": True, **configs[0].all_kwargs()}
    # the autotuner's disk cache stores config.__dict__ and rebuilds Config(**it) in the next process: nothing of ours
    # may be added to a config
    for config in configs:
        rebuilt = triton.Config(**config.__dict__)
        assert rebuilt.all_kwargs() == config.all_kwargs()


def test_tail_names_a_missing_parameter():
    fn = JITFunction(_kernel)
    with pytest.raises(TypeError, match="BLOCK"):
        kernels_launch._tail(fn, 3, {})
    assert kernels_launch._tail(fn, 3, {"BLOCK": 8}) == (8, False)
    assert inspect.Parameter.empty is not False


def test_a_plan_launches_the_recorded_launch_with_other_addresses(jit):
    """``direct_plan`` keeps what the repeat of a launch passes but the tensors' addresses; ``launch_plan`` calls the
    launcher with the addresses of other tensors of the same signature and everything else as recorded."""
    fn, runs, launches = jit
    x, y = torch.zeros(64), torch.ones(64)
    grid = lambda meta: (triton.cdiv(100, meta["BLOCK"]), 3)  # noqa: E731
    kwargs = {"BLOCK": 32, "num_warps": 4}
    assert kernels_launch.direct_plan(fn, grid, (x, 100, 0.5), kwargs, 1) is None  # never launched: no entry
    kernels_launch.launch_jit(fn, grid, (x, 100, 0.5), kwargs)
    plan = kernels_launch.direct_plan(fn, grid, (x, 100, 0.5), kwargs, 1)
    assert plan is not None and kernels_launch.plan_allowed(plan)
    assert kernels_launch.direct_plan(fn, grid, (x, 100, 0.5), kwargs, 2) is None  # argument 1 is no tensor
    kernels_launch.launch_plan(plan, [y.data_ptr()], 0)
    assert len(runs) == 1
    assert launches == [(4, 3, 1, 77, 1234, ("meta",), None, None, None, y.data_ptr(), 100, 0.5, 32, False)]


def _kernel_tensors_later(n, x_ptr, scale, y_ptr, BLOCK: "tl.constexpr"):  # noqa: F821
    pass  # never compiled


def test_a_plan_puts_tensors_between_other_arguments_in_their_slots(jit):
    """A kernel whose tensors are not its first arguments (the scalar kernels: a float between them): the plan keeps
    every other argument in place and the new addresses go to the tensors' slots."""
    _, runs, launches = jit
    fn = JITFunction(_kernel_tensors_later)
    fn.run = lambda *args, grid, warmup, **kwargs: (runs.append(args), _Compiled(launches))[1]
    x, y = torch.zeros(64), torch.zeros(32)
    kernels_launch.launch_jit(fn, (2,), (7, x, 0.5, y), {"BLOCK": 16})
    plan = kernels_launch.direct_plan(fn, (2,), (7, x, 0.5, y), {"BLOCK": 16}, 2)
    assert plan[-1] == (1, 3)
    x2, y2 = torch.ones(64), torch.ones(32)
    kernels_launch.launch_plan(plan, [x2.data_ptr(), y2.data_ptr()], 0)
    assert launches == [(2, 1, 1, 77, 1234, ("meta",), None, None, None, 7, x2.data_ptr(), 0.5, y2.data_ptr(), 16)]


def test_plans_stay_out_of_the_way(jit, monkeypatch):
    """No plan is launched with direct launches off or a launch hook installed, and none is made then; the dict of
    plans is bounded."""
    fn, runs, launches = jit
    x = torch.zeros(64)
    kernels_launch.launch_jit(fn, (1,), (x, 100, 0.5), {"BLOCK": 32})
    plan = kernels_launch.direct_plan(fn, (1,), (x, 100, 0.5), {"BLOCK": 32}, 1)
    assert plan[4:7] == (1, 1, 1)  # a tuple grid, padded
    fn.pre_run_hooks = [lambda *a, **k: None]
    assert not kernels_launch.plan_allowed(plan)
    assert kernels_launch.direct_plan(fn, (1,), (x, 100, 0.5), {"BLOCK": 32}, 1) is None
    fn.pre_run_hooks = []
    monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", False)
    monkeypatch.setattr(kernels_launch, "direct_launch_state", lambda: "off")
    assert not kernels_launch.plan_allowed(plan)
    assert kernels_launch.direct_plan(fn, (1,), (x, 100, 0.5), {"BLOCK": 32}, 1) is None
    monkeypatch.setattr(kernels_launch, "PLAN_LIMIT", 3)
    plans = {}
    for i in range(7):
        kernels_launch.keep_plan(plans, i, plan)
    assert 0 < len(plans) <= 3 and 6 in plans


def _launch_record(kernel, grid, args, kwargs, n_tensors):
    """What a launch passes but the tensors' addresses: a stand-in for ``direct_plan`` on the CPU."""
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    assert len(tensors) == n_tensors
    meta = tuple((t.dtype, t.data_ptr() % 16) for t in tensors)
    others = tuple(None if isinstance(x, torch.Tensor) else x for x in args)
    g = grid({"BLOCK_M": 16, "BLOCK_N": 32, "ROWS": 32, "HP": 2}) if callable(grid) else grid
    return (kernel.fn.__name__, tuple(g), meta, others, tuple(kwargs.items()))


def _recorded_plans(monkeypatch, *modules) -> list:
    """Launches in ``modules`` recorded, not run: the list receives ``(plan key, _launch_record)`` of each kept plan
    (a backward's pair as two records)."""
    recorded = []

    def keep(plans, key, plan):  # a record, or a tuple holding records (a pair; the distance forward's (plan, TMA))
        recorded.extend((key, p) for p in ((plan,) if isinstance(plan[0], str) else plan) if isinstance(p, tuple))

    for mod in modules:
        monkeypatch.setattr(mod, "launch_tuned", lambda *a, **k: None)
        monkeypatch.setattr(mod, "direct_plan", _launch_record)
        monkeypatch.setattr(mod, "keep_plan", keep)
    return recorded


def _one_launch_per_key(keys: dict, recorded: list, label: str):
    """Check one forward+backward's records against ``keys`` (key -> first label and launch) and clear them; returns
    the forward's key."""
    assert len(recorded) == 3, label  # the forward, the backward's dQ and dK/dV launches
    for key, plan in recorded:
        first, first_plan = keys.setdefault((key, plan[0]), (label, plan))
        assert first_plan == plan, f"{label} and {first}: one key, two launches"
    forward = recorded[0][0]
    recorded.clear()
    return forward


def _plan_cases():
    """Calls of the fused forward that differ in one thing each (shape, stride, offset, dtype, flag, optional
    input): ``name -> make()``, where ``make`` builds fresh random inputs and the keywords."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    def make(n=20, d=16, dtype=torch.float32, qview=None, b=True, scalar=None, kb=False, prefix=False, **flags):
        bsz, h = 2, 2
        q = t(bsz, h, n, d, dtype=dtype)
        if qview == "transposed":
            q = t(bsz, n, h, d, dtype=dtype).transpose(1, 2)
        elif qview == "offset":
            q = t(bsz, h, n, d + 1, dtype=dtype)[..., 1:]
        k, v = t(bsz, h, n, d, dtype=dtype), t(bsz, h, n, d, dtype=dtype)
        if flags.get("kv_same"):
            v = k
        p = 2 if prefix else 0
        args = dict(q=q, k=k, v=v, kb=t(bsz, h, n + p) if kb else None, qs=None, ks=None, beta=None)
        if scalar is not None:
            args.update(qs=t(bsz, h, n), ks=t(bsz, h, n + p), beta=t(bsz, h, n) if scalar == "rows" else t(1, h, 1))
        args.update(a=t(h), b=t(h) if b else None)
        kw = dict(causal=True, window=None, num_prefix_keys=p, normalize=True, qnorm=True, kv_same=False, eps=0.0)
        kw.update(flags)
        if prefix:
            kw["prefix"] = (t(1, h, p, d, dtype=dtype), t(1, h, p, d, dtype=dtype))
        return args, kw

    cases = {
        "base": {},
        "n21": {"n": 21},
        "d24": {"d": 24},
        "bf16": {"dtype": torch.bfloat16},
        "full": {"causal": False},
        "window5": {"window": 5},
        "window7": {"window": 7},
        "eps-small": {"eps": 1e-6},
        "eps-large": {"eps": 0.05},
        "unnormalized": {"normalize": False},
        "no-qnorm": {"qnorm": False},
        "tied": {"b": False},
        "kv-same": {"kv_same": True},
        "gka": {"b": False, "kv_same": True},
        "gka-log-bandwidth": {"b": False, "kv_same": True, "a_log": True},
        "transposed-q": {"qview": "transposed"},
        "offset-q": {"qview": "offset"},
        "scalar-head": {"scalar": "head"},
        "scalar-rows": {"scalar": "rows"},
        "scalar-tau": {"scalar": "head", "tau_in": True},
        "key-bias": {"kb": True},
        "key-bias-inline": {"kb": True, "knorm_inline": True},
        "prefix": {"prefix": True},
        "pointer-loads": {"tma": False},
    }
    return {name: (lambda c=c: make(**c)) for name, c in cases.items()}


def test_equal_plan_keys_mean_equal_launches(monkeypatch):
    """The plan key of the fused forward and backward (``forward_plan_key`` / ``backward_plan_key``) holds everything
    the launches are computed from: over calls that differ in one shape, stride, offset, dtype, flag or optional
    input each, and repeats of each with other tensors, every key maps to one launch (non-tensor arguments,
    keywords, grid, tensor dtypes and alignment).  A key missing any of these maps two launches.  (CPU: the launches
    are recorded, not run.)"""
    from hf_rbf import kernels_flash_bwd, kernels_flash_fwd

    recorded = _recorded_plans(monkeypatch, kernels_flash_fwd, kernels_flash_bwd)
    keys, forward_keys = {}, set()
    for name, make in _plan_cases().items():
        for _ in range(2):
            args, kw = make()
            out, lse = kernels_flash_fwd.distance_forward(**args, **kw)
            backward_kw = {k: v for k, v in kw.items() if k != "tma"}  # (the backward reads pointers only)
            kernels_flash_bwd.distance_backward(
                torch.randn_like(out), **args, out=out, lse=lse, need_dbeta=args["qs"] is not None, knorm=True,
                **backward_kw,
            )
            forward_keys.add(_one_launch_per_key(keys, recorded, name))
    # every case is its own forward signature; (key, kernel) entries: one per forward, two per backward signature
    # (the backward has no TMA choice: pointer-loads shares base's)
    assert len(forward_keys) == len(_plan_cases()) and len(keys) == 3 * len(_plan_cases()) - 2


def _scalar_plan_cases():
    """Calls of the scalar forward that differ in one thing each: ``name -> make()`` (fresh inputs, keywords)."""
    g = torch.Generator().manual_seed(1)

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    def make(n=20, dv=16, groups=2, dtype=torch.float32, tau=2.0, kb=False, qs_view=None, need_dtau=False, **kw):
        bsz, h = 2, 4
        qs = t(bsz, h, n, dtype=dtype)
        if qs_view == "transposed":
            qs = t(bsz, n, h, dtype=dtype).transpose(1, 2)
        if tau == "head":
            tau = t(1, h, 1).exp()
        elif tau == "rows":
            tau = t(bsz, h, n).exp()
        flags = dict(causal=True, window=None, num_prefix_keys=0)
        flags.update(kw)
        args = dict(qs=qs, ks=t(bsz, h, n, dtype=dtype), v=t(bsz, groups, n, dv, dtype=dtype),
                    kb=t(bsz, h, n) if kb else None, tau=tau)  # fmt: skip
        return args, flags, need_dtau

    cases = {
        "base": {},
        "n21": {"n": 21},
        "dv24": {"dv": 24},
        "groups4": {"groups": 4},
        "bf16": {"dtype": torch.bfloat16},
        "full": {"causal": False},
        "window5": {"window": 5},
        "prefix2": {"num_prefix_keys": 2},
        "tau3": {"tau": 3.0},
        "tau-head": {"tau": "head"},
        "tau-rows": {"tau": "rows"},
        "tau-rows-grad": {"tau": "rows", "need_dtau": True},
        "key-bias": {"kb": True},
        "transposed-qs": {"qs_view": "transposed"},
    }
    return {name: (lambda c=c: make(**c)) for name, c in cases.items()}


def test_equal_scalar_plan_keys_mean_equal_launches(monkeypatch):
    """The scalar kernels' plan key (``scalar_plan_key``) as the distance kernels' (see the test above): one launch per
    key over calls that differ in one shape, stride, dtype, flag, temperature form or value each, forward and
    backward; the heads-per-program setting is part of it."""
    from hf_rbf import kernels_scalar_bwd, kernels_scalar_fwd

    recorded = _recorded_plans(monkeypatch, kernels_scalar_fwd, kernels_scalar_bwd)
    keys, forward_keys = {}, set()
    cases = _scalar_plan_cases()
    for hp in ("0", "2"):
        monkeypatch.setenv("HF_RBF_SCALAR_HEADS_PER_PROGRAM", hp)
        for name, make in cases.items():
            for _ in range(2):
                args, flags, need_dtau = make()
                out, lse = kernels_scalar_fwd.scalar_forward(**args, **flags)
                kernels_scalar_bwd.scalar_backward(torch.randn_like(out), **args, lse=lse, need_dtau=need_dtau, **flags)
                forward_keys.add(_one_launch_per_key(keys, recorded, f"{name}, HP {hp}"))
    # every case is its own forward signature but tau-rows-grad (need_dtau is the backward's alone), at each HP
    assert len(forward_keys) == 2 * (len(cases) - 1) and len(keys) == 2 * (3 * len(cases) - 1)


def _addresses(args) -> list:
    return [x.data_ptr() for x in args if isinstance(x, torch.Tensor)]


def _labels(pointers, named: dict) -> list:
    """Each address as the name of the tensor at it (``?`` for a buffer the call keeps to itself, e.g. ``work``)."""
    by_address = {t.data_ptr(): name for name, t in named.items() if isinstance(t, torch.Tensor)}
    return [by_address.get(p, "?") for p in pointers]


def _call_family(family: str, make, fwd, bwd) -> dict:
    """One forward+backward of a case of ``_plan_cases`` / ``_scalar_plan_cases``; every tensor of it by name."""
    if family == "distance":
        args, kw = make()
        out, lse = fwd.distance_forward(**args, **kw)
        dout = torch.randn_like(out)
        backward_kw = {k: v for k, v in kw.items() if k != "tma"}
        grads = bwd.distance_backward(
            dout, **args, out=out, lse=lse, need_dbeta=args["qs"] is not None, knorm=True, **backward_kw
        )
        named = {**args, **dict(zip(("pk", "pv"), kw.get("prefix", ())))}
        names = ("dq", "dk", "dv", "dkb", "dab", "dqs", "dks", "dbeta", "dpk", "dpv")
    else:
        args, flags, need_dtau = make()
        out, lse = fwd.scalar_forward(**args, **flags)
        dout = torch.randn_like(out)
        grads = bwd.scalar_backward(dout, **args, lse=lse, need_dtau=need_dtau, **flags)
        named = dict(args)
        names = ("dqs", "dks", "dv_grad", "dkb", "dtau")
    named.update(out=out, lse=lse, dout=dout)
    named.update(zip(names, grads))
    return named


@pytest.mark.parametrize("family", ["distance", "scalar"])
def test_a_planned_call_puts_each_tensor_in_the_slot_of_the_long_way(monkeypatch, family):
    """The hit path of every planned launch (the distance and scalar forward, dQ and dK/dV): the addresses it passes
    name, slot by slot, the tensors the long way passes for a call of the same signature (placeholders included).
    (CPU: the launches are recorded, not run; on the GPU the planned results are compared bitwise.)"""
    from hf_rbf import kernels_flash_bwd, kernels_flash_fwd, kernels_scalar_bwd, kernels_scalar_fwd

    fwd, bwd = (kernels_flash_fwd, kernels_flash_bwd)
    if family == "scalar":
        fwd, bwd = kernels_scalar_fwd, kernels_scalar_bwd
    long_way, planned = [], []  # per launch: its tensors' addresses, in argument order
    for mod in (fwd, bwd):
        monkeypatch.setattr(mod, "launch_tuned", lambda kernel, grid, *a, **k: long_way.append(_addresses(a)))
        monkeypatch.setattr(mod, "direct_plan", lambda kernel, grid, args, kwargs, n: (kernel.fn.__name__,))
        monkeypatch.setattr(mod, "plan_allowed", lambda plan: True)
        monkeypatch.setattr(mod, "launch_plan", lambda plan, pointers, device: planned.append(list(pointers)))
    cases = _plan_cases() if family == "distance" else _scalar_plan_cases()
    for name, make in cases.items():
        fwd._FWD_PLANS.clear()
        bwd._BWD_PLANS.clear()
        named = _call_family(family, make, fwd, bwd)  # the long way; its plans kept
        expected = [_labels(p, named) for p in long_way]
        named = _call_family(family, make, fwd, bwd)  # the same signature, other tensors: from the plans
        got = [_labels(p, named) for p in planned]
        assert len(expected) == 3 and len(planned) == 3 and not long_way[3:], name
        assert got == expected, name
        long_way.clear()
        planned.clear()
    fwd._FWD_PLANS.clear()
    bwd._BWD_PLANS.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: compiled kernels")
def test_direct_launches_compute_what_triton_launches_compute(monkeypatch):
    """rbf / GKA / hybrid / scalar forward+backward on the fused kernels: the first call goes through triton, the
    repeats through the direct path; results equal (bitwise) those with the direct path off."""
    from hf_rbf import gka_attention, hybrid_attention, rbf_attention, scalar_attention
    from hf_rbf import kernels_common, kernels_flash_bwd, kernels_flash_fwd, kernels_scalar_bwd, kernels_scalar_fwd

    if kernels_launch.direct_launch_state() is not None:
        pytest.skip(f"direct launches not available: {kernels_launch.direct_launch_state()}")
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 200, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qs, ks = (torch.randn(b, h, n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    log_sigma = torch.zeros(h, device="cuda", requires_grad=True)
    tau_h = torch.full((h,), 2.0, device="cuda", requires_grad=True)
    q_bnhd = q.detach().transpose(1, 2).contiguous().requires_grad_(True)  # [B, N, H, D]: the queries as a view
    calls = {
        "rbf": lambda: rbf_attention(q, k, v, backend="triton", window=64),
        "rbf, prefix and key weights": lambda: rbf_attention(
            q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], backend="triton", prefix_keys=k[:1, :, :2],
            prefix_values=v[:1, :, :2], num_prefix_keys=2, key_log_weights=qs[:, :, :].float().sigmoid().log(),
        ),  # fmt: skip
        "rbf, strided queries": lambda: rbf_attention(q_bnhd.transpose(1, 2), k, v, backend="triton"),
        "gka": lambda: gka_attention(q, 0.5, backend="triton"),
        "gka, learnable bandwidth": lambda: gka_attention(q, log_sigma, backend="triton"),
        "hybrid": lambda: hybrid_attention(q, k, v, qs, ks, tau=2.0, backend="triton"),
        "scalar": lambda: scalar_attention(qs, ks, v, tau=2.0, backend="triton"),
        "scalar, learnable tau per head": lambda: scalar_attention(qs, ks, v, tau=tau_h, backend="triton"),
    }

    def run(fn):
        leaves = (q, k, v, qs, ks, log_sigma, tau_h, q_bnhd)
        for t in leaves:
            t.grad = None
        out = fn()
        out.float().square().sum().backward()
        return [out.detach().clone()] + [t.grad.clone() for t in leaves if t.grad is not None]

    planned = []  # launches of a kept plan (the distance kernels': kernels_launch.direct_plan)
    for mod in (kernels_flash_fwd, kernels_flash_bwd, kernels_scalar_fwd, kernels_scalar_bwd):
        monkeypatch.setattr(mod, "launch_plan", lambda *a, _launch=mod.launch_plan: (planned.append(a), _launch(*a)))
    for name, fn in calls.items():
        monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", False)
        monkeypatch.setattr(kernels_launch, "_STATE", {})
        expected = run(fn)
        monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", True)
        run(fn)  # records the call signatures
        planned.clear()
        got = run(fn)  # launched directly
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        assert len(planned) == 3, (name, len(planned))  # forward, dQ, dK/dV from their plans
    assert kernels_common.HAS_TRITON
    assert _recorded_signatures() > 0  # the repeats had something to launch directly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: compiled kernels")
def test_decode_steps_over_growing_lengths_launch_directly(monkeypatch):
    """A decode loop (one query row over one more cached key per step, no gradients): the split-K decode and its
    combine kernel, keyed by what triton specialises the lengths on, launch directly after the first step of each
    class; every step's output equals (bitwise) the one launched through triton.  (The sorted-window decode kernel
    launches the same way; its GPU tests in test_sorted_cache_decode.py check its steps against the reference.)"""
    from hf_rbf import kernels_flash_fwd, rbf_attention

    if kernels_launch.direct_launch_state() is not None:
        pytest.skip(f"direct launches not available: {kernels_launch.direct_launch_state()}")
    torch.manual_seed(0)
    b, h, n, d = 1, 12, 300, 64
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)

    def steps():
        with torch.no_grad():
            return [
                rbf_attention(q[:, :, t - 1 : t], k[:, :, :t], v[:, :, :t], backend="triton") for t in range(200, 260)
            ]

    monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", False)
    expected = steps()
    monkeypatch.setattr(kernels_launch, "DIRECT_LAUNCH", True)
    for cache_owner in (kernels_flash_fwd._distance_decode, kernels_flash_fwd._decode_combine_kernel):
        cache_owner.__dict__.pop("_hf_rbf_direct", None)
    got = steps()
    for t, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"step {t}: {m}")
    # 60 lengths, a handful of signatures (the lengths' classes, the split counts), not one per length
    assert 0 < len(kernels_flash_fwd._decode_combine_kernel._hf_rbf_direct) <= 8
    assert 0 < len(kernels_flash_fwd._distance_decode._hf_rbf_direct) <= 8


def _recorded_signatures() -> int:
    """Call signatures recorded for direct launches by the fused kernels: on the autotuners (``launch_tuned``) and
    on the JIT functions (``launch_jit``)."""
    from hf_rbf import kernels_flash_bwd, kernels_flash_fwd, kernels_scalar_bwd, kernels_scalar_fwd

    count = 0
    for module in (kernels_flash_fwd, kernels_flash_bwd, kernels_scalar_fwd, kernels_scalar_bwd):
        for value in vars(module).values():
            for owner in (value, getattr(value, "fn", None)):
                cache = getattr(owner, "__dict__", {}).get("_hf_rbf_direct")
                count += len(cache) if cache else 0
    return count
