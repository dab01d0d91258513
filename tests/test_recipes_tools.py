"""The recipe tools: throughput.py (1 step of every registered family on the CPU), accounting.py (against hand
formulas), compare_runs.py, and fill_model_cards.py filling the cards' result blocks from results files."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from recipes import accounting, compare_runs, fill_model_cards, throughput

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_throughput_runs_every_family_and_writes_a_table(tmp_path):
    out = tmp_path / "tp"
    assert (
        throughput.main(
            [
                "--device",
                "cpu",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--output",
                str(out),
                "--model-set",
                "hidden_size=32",
                "num_hidden_layers=1",
                "num_attention_heads=2",
                "intermediate_size=64",
                "vocab_size=128",
            ]
        )
        == 0
    )
    report = json.loads(Path(str(out) + ".json").read_text())
    rows = {r["name"]: r for r in report["results"]}
    for name in ("tinystories_llama", "tinystories_dot", "tinystories_rbf", "tinystories_gka"):
        assert rows[name]["tokens_per_second"] > 0 and rows[name]["seq_len"] == 16
    assert rows["tinystories_llama"]["relative_to_llama"] == 1.0
    assert rows["tinystories_rbf"]["attention_backends"] and rows["tinystories_rbf"]["attention_backends"][
        0
    ].startswith("rbf:")
    # the GKA recipe is still matched to the dot budget at the overridden size
    assert abs(rows["tinystories_gka"]["num_parameters"] - rows["tinystories_dot"]["num_parameters"]) < 100
    table = Path(str(out) + ".md").read_text()
    assert "| tinystories_rbf | rbf |" in table and "vs Llama (SDPA)" in table


def test_accounting_matches_hand_formulas():
    d, layers, ffn, vocab, t, heads = 64, 2, 128, 100, 32, 4
    base = dict(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=t,
    )
    dot = accounting.account_model("dot", base, t)
    linear = layers * (4 * d * d + 3 * d * ffn) + vocab * d  # matmul parameters per token (tied head counted once)
    core = layers * 2 * 2 * t * d  # scores and weighted values, dense
    f = dot["flops_per_token"]
    assert f["total_dense"] == pytest.approx(2 * linear + core)
    assert f["attention_core_causal"] == pytest.approx(core * (t + 1) / (2 * t))
    assert dot["num_parameters"] == layers * (4 * d * d + 3 * d * ffn + 2 * d) + d + vocab * d
    llama = accounting.account_model("llama", base, t)
    # (some transformers versions compute Llama's RoPE angles with a tiny matmul: 2 x head_dim/2 FLOPs per token)
    assert llama["flops_per_token"] == pytest.approx(f, rel=1e-3) and llama["num_parameters"] == dot["num_parameters"]
    gka = accounting.account_model("gka", base, t)
    assert gka["flops_per_token"]["attention_projections"] == pytest.approx(f["attention_projections"] / 4)
    assert gka["num_parameters"] == dot["num_parameters"] - layers * (3 * d * d - heads)
    windowed = accounting.account_model("dot", dict(base, window_pattern="S", sliding_window=4), t)
    allowed = sum(min(i + 1, 4) for i in range(t)) / (t * t)
    assert windowed["flops_per_token"]["attention_core_causal"] == pytest.approx(core * allowed)


def _write_json(path, obj) -> None:
    Path(path).write_text(json.dumps(obj))


def _fake_results(root):
    """A results folder as gpu_all.sh writes it, with made-up numbers for two runs."""
    for name, family, loss in (("tinystories_rbf", "rbf", 2.25), ("tinystories_dot", "dot", 2.5)):
        run = root / name
        run.mkdir(parents=True)
        _write_json(
            run / "summary.json",
            {
                "run_name": name,
                "family": family,
                "num_parameters": 5311744,
                "train_tokens": 16384000,
                "eval_loss": loss,
                "bits_per_byte": loss / 2,
                "tokens_per_second": 123456.0,
                "story": f"Once upon a time {family} story.",
                "generation_prompt": "Once upon a time",
                "device": "cuda:0",
                "versions": {"cuda": "NVIDIA H100"},
            },
        )
        Path(run / "core.json").write_text(json.dumps({"core_metric": 0.0123, "label": "CORE-20"}))
        _write_json(
            run / "metrics.json",
            {"log_history": [{"step": s, "loss": loss + 1.0 / s} for s in range(1, 6)], "global_step": 5},
        )
    _write_json(
        root / "throughput.json",
        {
            "device": "NVIDIA H100",
            "dtype": "bf16",
            "batch_size": 64,
            "steps": 30,
            "warmup": 10,
            "results": [
                {
                    "name": "tinystories_llama",
                    "family": "llama",
                    "num_parameters": 5310720,
                    "seq_len": 256,
                    "tokens_per_second": 2.0e6,
                    "ms_per_step": 8.0,
                    "relative_to_llama": 1.0,
                    "attention_backends": ["dot:sdpa"],
                },
                {
                    "name": "tinystories_rbf",
                    "family": "rbf",
                    "num_parameters": 5311744,
                    "seq_len": 256,
                    "tokens_per_second": 1.5e6,
                    "ms_per_step": 11.0,
                    "relative_to_llama": 0.75,
                    "attention_backends": ["rbf:sdpa"],
                },
            ],
        },
    )


def test_fill_model_cards_from_results(tmp_path):
    results = tmp_path / "results"
    _fake_results(results)
    cards = tmp_path / "cards"
    shutil.copytree(os.path.join(REPO, "model_cards"), cards)
    acc = accounting.run()
    changed = fill_model_cards.fill_cards(str(cards), fill_model_cards.load_results(str(results)), acc)
    assert str(cards / "rbf.md") in changed
    text = (cards / "rbf.md").read_text()
    assert (
        "| **tinystories_rbf** | rbf | 5,311,744 | 16,384,000 | 2.2500 | 1.1250 | 0.0123 | 123,456 | NVIDIA H100 |"
        in text
    )
    assert "| tinystories_dot | dot |" in text and "Once upon a time rbf story." in text
    assert "| **tinystories_rbf** | rbf | 5,311,744 | 256 | 1,500,000 | 11.00 | 0.75x |" in text
    assert "| **tinystories_rbf** | rbf | 5,311,744 | 3,214,592 |" in text  # accounting block, from the model class
    assert "No results yet" in text  # blocks without files (multi-GPU, cpu_quick) say so
    # idempotent, and --check sees no change after filling
    assert fill_model_cards.fill_cards(str(cards), fill_model_cards.load_results(str(results)), acc, check=True) == []
    # the stored copy of the results gives the same cards
    stored = fill_model_cards.store_results(str(results), str(tmp_path / "stored"))
    assert sorted(os.listdir(stored)) == ["throughput.json", "tinystories_dot", "tinystories_rbf"]
    assert fill_model_cards.fill_cards(str(cards), fill_model_cards.load_results(stored), acc, check=True) == []
    # blocks of other scripts are left alone
    foreign = cards / "other.md"
    foreign.write_text("x\n<!-- results:captured_mass:rbf -->\nkept as is\n<!-- /results:captured_mass:rbf -->\n")
    fill_model_cards.fill_cards(str(cards), fill_model_cards.load_results(str(results)), acc)
    assert "kept as is" in foreign.read_text()
    # the shipped cards have result blocks the filler knows
    for name in ("rbf.md", "gka.md", "scalar_sort.md", "hybrid_sort.md"):
        blocks = fill_model_cards.BLOCK.findall(Path(REPO, "model_cards", name).read_text())
        assert any(kind in fill_model_cards.GENERATORS for _, kind, _, _, _ in blocks), name


def test_compare_runs_table_and_plot(tmp_path):
    results = tmp_path / "results"
    _fake_results(results)
    out = tmp_path / "cmp"
    assert (
        compare_runs.main(
            ["--runs", f"dot={results / 'tinystories_dot'}", f"rbf={results / 'tinystories_rbf'}", "--output", str(out)]
        )
        == 0
    )
    rows = json.loads(Path(out / "comparison.json").read_text())
    assert rows[1]["max_abs_loss_diff"] == pytest.approx(0.25) and rows[1]["compared_steps"] == 5
    assert os.path.getsize(out / "loss_curves.png") > 10000
    assert "(reference)" in Path(out / "comparison.md").read_text()


def test_kernel_benchmarks_refuse_bad_arguments():
    """benchmarks/offline_kernel_report.py, find_nonfinite_grads.py, bench_attention.py and bench_generate.py name the
    argument and what it takes before they compile, train or time anything."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo)
    for script, args, message in (
        ("offline_kernel_report.py", ["--cases", "rbf,nope"], "--cases takes"),
        ("offline_kernel_report.py", ["--checks", "rbf,dot"], "--checks takes families"),
        ("offline_kernel_report.py", ["--config", "BLOCK_M128"], "--config takes KEY=INT"),
        ("offline_kernel_report.py", ["--prefix-keys", "-2"], "--prefix-keys takes a count"),
        ("find_nonfinite_grads.py", ["--config", "c.yaml", "--out", "unused", "--steps", "0"], "--steps must be >= 1"),
        ("bench_attention.py", ["--out", "unused", "--tokens", "0"], "--tokens must be a positive number"),
        ("bench_attention.py", ["--out", "unused", "--profile-n", "256,0"], "--profile-n takes positive"),
        ("bench_generate.py", ["--out", "unused", "--rounds", "0"], "it needs --step-clock"),
        ("bench_generate.py", ["--out", "unused", "--step-clock", "--skip-steps", "-1"], "--skip-steps must be in"),
        ("bench_generate.py", ["--out", "unused", "--step-clock", "--skip-steps", "63"], "--skip-steps must be in"),
    ):
        cmd = [sys.executable, os.path.join(repo, "benchmarks", script), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 2 and message in proc.stderr, (script, args, proc.stderr[-500:])


def test_bench_generate_variant_names_carry_registers_and_the_register_path():
    """benchmarks/bench_generate.py: "family (N registers, rows)" builds the family with N registers and runs it on the
    flat register rows (an A/B against the register stream in one process); an unknown option is named."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_variant("llama") == ("llama", {}, {})
    assert bench.parse_variant("hybrid_sort (1 register, rows)") == (
        "hybrid_sort",
        {"num_register_tokens": 1},
        {"register_path": "rows"},
    )
    assert bench.parse_variant("scalar_sort (window 64)") == ("scalar_sort", {"decode_window": 64}, {})
    assert bench.parse_variant("hybrid_sort (rope launch, split decode)") == (
        "hybrid_sort",
        {},
        {"rope_in_insert": "off", "kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS": 0},
    )
    from hf_rbf import kernels_flash_fwd

    with bench.decoder_settings({"kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS": 0}):
        assert kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS == 0
    assert kernels_flash_fwd.EAGER_SINGLE_SPLIT_MAX_KEYS == 1024
    with pytest.raises(ValueError, match="sorted families' decode_window"):
        bench.parse_variant("rbf (window 64)")
    with pytest.raises(ValueError, match="unknown option 'fast'"):
        bench.parse_variant("rbf (fast)")
    from hf_rbf import modeling_decoder

    before = modeling_decoder.register_path
    with bench.decoder_settings({"register_path": "rows"}):
        assert modeling_decoder.register_path == "rows"
    assert modeling_decoder.register_path == before


def test_profile_summary_counts_kernels_not_annotation_ranges():
    """benchmarks/profile_training.py: GPU busy time and launches sum the kernels only; the GPU-timeline ranges of user
    annotations (inductor's "## Call CompiledFxGraph ... ##") span host gaps and are left out."""
    import importlib.util
    import sys
    from types import SimpleNamespace

    import torch

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench_dir))
    try:
        spec = importlib.util.spec_from_file_location("profile_training_under_test", bench_dir / "profile_training.py")
        profile_training = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(profile_training)
    finally:
        sys.path.remove(str(bench_dir))
    cuda = torch.autograd.DeviceType.CUDA

    def event(key, device_us, annotation=False):
        return SimpleNamespace(key=key, device_type=cuda, self_device_time_total=device_us, count=2,
                               self_cpu_time_total=0.0, is_user_annotation=annotation, input_shapes=[])

    events = [event("gemm", 3000.0), event("triton_fused", 1000.0), event("## Call CompiledFxGraph x ##", 9000.0, True)]
    prof = SimpleNamespace(key_averages=lambda **kw: events)
    summary = profile_training.summarise_profile(prof, steps=2, step_ms=10.0)
    assert summary["gpu_busy_ms_per_step"] == 2.0  # (3000 + 1000) us over 2 steps
    assert summary["kernel_launches_per_step"] == 2.0
    assert [e["name"] for e in summary["gpu_top"]] == ["gemm", "triton_fused"]

    # the markdown: a run with a profile shows its GPU busy time and launches; one without (an --interleave run
    # without --profile-all) shows "-" there, not "nan"
    timed = dict(ms_per_step=10.0, tokens_per_s=1000.0, peak_gib=1.0, first_step_s=2.0)
    res = dict(gpu="x", torch="t", triton="tr", transformers="tf", host=[], kernels=[],
               steps={"d256": {"llama": dict(timed, profile=summary), "gka": dict(timed)}})  # fmt: skip
    out = Path(tempfile.mkdtemp()) / "profile.md"
    profile_training.write_markdown(res, out)
    text = out.read_text()
    assert "| llama | 10.0 | 1,000 | 1.00x | 1.00 | 2.0 | 2.0 | 2 |" in text
    assert "| gka | 10.0 | 1,000 | 1.00x | 1.00 | 2.0 | - | - |" in text and "nan" not in text


def test_diagnose_fsdp2_register_stream_runs_on_two_gloo_processes():
    """The FSDP2 diagnostic (2 gloo processes): both register paths give the same losses, FSDP2 unshards and
    reduce-scatters layer by layer from the last, and the compiled register step is one graph without recompiles."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    import socket

    with socket.socket() as sock:  # a free port, so parallel test runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(root / "benchmarks" / "diagnose_fsdp2_register_stream.py"), "--layers", "2", "--steps", "2"]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    rows, compiled = result["rows"], result["compiled"]
    assert rows["losses"] == pytest.approx(compiled["losses"], rel=1e-6)
    for run in (rows, compiled):
        layers = [e for e in run["backward_order"] if not e.endswith("root")]
        assert [e.split(":")[1] for e in layers if e.startswith("post")] == ["L1", "L0"]
    assert compiled["path"].startswith("compiled") and compiled["unique_graphs"] == 1 and compiled["recompiles"] == 0


@pytest.mark.parametrize(
    "script, marker",
    [
        # the forward and backward variants with the key norms compute the float64 reference's attention
        ("probe_forward_variants.py", "agree with the float64 reference"),
        # the key-bias pass at several keys-per-program / warps choices, both key layouts, odd lengths: torch's norms
        ("probe_key_bias.py", "every key-bias config agrees"),
        # the split-K decode variants (inline key norms, stored norms as a per-key bias, the GKA form): float64's
        ("probe_decode_kernel.py", "decode variants agree with the float64 reference"),
    ],
)
def test_kernel_probes_check_their_variants_in_the_interpreter(script, marker):
    """``benchmarks/<probe> --check`` (the interpreter): every variant a GPU probe times computes what the reference
    does, so its timings compare equal work."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    cmd = [sys.executable, str(root / "benchmarks" / script), "--check"]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker in proc.stdout


@pytest.mark.parametrize("sequential", [False, True])
def test_bench_generate_runs_every_model_interleaved_or_one_at_a_time(tmp_path, sequential):
    """benchmarks/bench_generate.py on the CPU (a tiny size, float32): a row per (model, case, mode) with a per-token
    time and the cache bytes, interleaved or ``--sequential`` (each model built, measured and released before the
    next: for caches too large for every model at once; here with ``--step-clock``, the steps timed inside one
    generate); ``release_caches`` drops what a model kept."""
    import importlib.util
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    size = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128}
    cmd = [sys.executable, str(root / "benchmarks" / "bench_generate.py"), "--out", str(tmp_path), "--device", "cpu",
           "--size", json.dumps(size), "--cases", "1x12", "--new-tokens", "4", "--rounds", "1", "--modes",
           "dynamic,static", "--variants", "llama;gka;scalar_sort (window 4)"]
    # one model at a time, the steps timed inside its one (warm-up) generate from the second on
    cmd += ["--sequential", "--step-clock", "--rounds", "0", "--skip-steps", "1"] if sequential else []
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(root)), cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    got = {(r["variant"], r["mode"]) for r in rows}
    assert got == {(v, m) for v in ("llama", "gka", "scalar_sort (window 4)") for m in ("dynamic", "static")}
    assert all(isinstance(r["ms_per_token"], float) and r["cache_bytes_per_token"] > 0 for r in rows)
    assert all(r["ms_per_token"] > 0 for r in rows) or not sequential  # t(n) - t(1) may dip below 0 on the CPU
    assert all(len(r["ms_rounds"]) == 1 and r["ms_best"] == r["ms_per_token"] for r in rows)
    assert all(r["x_llama"] is not None for r in rows if r["ms_per_token"] > 0)
    assert all(r["call_peak_gib"] == 0 and r["peak_gib"] == 0 for r in rows)  # no CUDA: no memory figures
    header = (tmp_path / "generate.md").read_text().splitlines()[0]
    assert ("one model at a time" in header) == sequential
    assert ("inside one generate" in header) == sequential
    spec = importlib.util.spec_from_file_location("bench_generate_release", root / "benchmarks" / "bench_generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import torch

    model = torch.nn.Linear(2, 2)
    model._generation_static_cache = ("key", object())
    bench.release_caches(model)
    assert not hasattr(model, "_generation_static_cache")


def test_bench_generate_pairs_each_round_with_llamas_same_round():
    """bench_generate.round_statistics: "x Llama" is the median of the per-round ratios (a slow round of the host slows
    Llama and the model together and cancels), not the ratio of the medians or of the best rounds; rounds Llama
    lacks are left out of the ratio, not of the model's times."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate_rounds", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    llama = {1: 10.0, 2: 20.0, 3: 9.0}
    model = {1: 8.0, 2: 16.0, 3: 12.0, 4: 7.0}  # faster than Llama in rounds 1 and 2, slower in 3
    got = bench.round_statistics(model, llama)
    assert got["ms_per_token"] == 10.0 and got["ms_best"] == 7.0 and got["ms_rounds"] == [8.0, 16.0, 12.0, 7.0]
    assert got["x_llama"] == 1.25  # the rounds' ratios 1.25, 1.25, 0.75 (best-of would say 9 / 7 = 1.29x)
    assert (got["x_llama_lowest"], got["x_llama_highest"]) == (0.75, 1.25)
    assert bench.round_statistics(model, {})["x_llama"] is None


def test_diagnose_register_paths_reports_every_path_and_backend(tmp_path):
    """benchmarks/diagnose_register_paths.py on the CPU (one family, one register, two steps): a row per register
    path and backend, each step's errors against the float64 rows run; rbf stays at float32 rounding."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(root / "benchmarks" / "diagnose_register_paths.py"), "--device", "cpu", "--families",
           "rbf", "--registers", "1", "--steps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "register_paths.json").read_text())
    assert set(report) == {f"rbf R1 {p} {b}" for p in ("rows", "stream") for b in ("auto", "naive")}
    for rows in report.values():
        assert len(rows) == 2 and all(r["logits"] < 1e-4 and r["grad"] < 1e-3 for r in rows), rows


def test_profile_decode_reports_every_family_per_token(tmp_path):
    """benchmarks/profile_decode.py on the CPU (a tiny size, Llama and one family): a row per model with the ms per
    token and the profiles' per-token differences (aten ops, host ops, Python functions of the decode step)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    size = '{"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}'
    cmd = [sys.executable, str(root / "benchmarks" / "profile_decode.py"), "--device", "cpu", "--case", "1x16",
           "--tokens", "3", "--variants", "llama;scalar_sort", "--size", size, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "profile_decode.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["llama", "scalar_sort"] and not any("error" in r for r in rows), rows
    for r in rows:
        # the time is a difference of two timings (noisy on a loaded CPU: it can come out negative), the counts are not
        assert math.isfinite(r["ms_per_token"]) and r["aten_ops_per_token"] > 10 and r["top_host_ops"] and r["python"]
    assert "## scalar_sort" in (tmp_path / "profile_decode.md").read_text()
    assert rows[1]["aten_ops_per_token"] != rows[0]["aten_ops_per_token"]
