"""The README's first lines give the two commands (main job, tests) and .ci/run runs the test command verbatim."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands() -> list[str]:
    text = Path(os.path.join(REPO, "README.md")).read_text(encoding="utf-8")
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL)][:2]


def test_readme_starts_with_the_two_commands():
    text = Path(os.path.join(REPO, "README.md")).read_text(encoding="utf-8")
    main_job, tests = _readme_commands()
    assert text.index(main_job) < text.index(tests) < text.index("## ")  # before any section
    setup = (
        "python -m venv .venv && . .venv/bin/activate && pip install --retries 1 torch==2.13.0 "
        "--extra-index-url https://download.pytorch.org/whl/cpu && pip install -e "
    )
    assert main_job.startswith(setup) and tests.startswith(setup)  # own venv, CPU torch from the CPU wheel index
    assert main_job.endswith("python recipes/pretrain.py --config recipes/configs/cpu_quick.yaml")
    assert tests.endswith("python -m pytest -q -n 2")  # two pytest-xdist workers (one thread each)
    assert os.path.exists(os.path.join(REPO, "recipes", "configs", "cpu_quick.yaml"))


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _readme_commands()
    ci = Path(os.path.join(REPO, ".ci", "run")).read_text(encoding="utf-8")
    lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert tests in lines
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    assert os.access(os.path.join(REPO, ".ci", "run"), os.X_OK)


def test_ci_also_runs_the_contract_tests_on_the_oldest_versions():
    ci = Path(os.path.join(REPO, ".ci", "run")).read_text(encoding="utf-8")
    lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert "bash .ci/oldest-env.sh test" in lines
    script = Path(os.path.join(REPO, ".ci", "oldest-env.sh")).read_text(encoding="utf-8")
    assert '-m "contract and not gpu"' in script and "-c .ci/oldest-versions.txt" in script


def _floors() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for group in project["optional-dependencies"].values() for r in group]
    floors = {}
    for req in reqs:
        match = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", req)
        if match:
            floors[match.group(1).lower()] = match.group(2)
    return floors


def test_the_oldest_pins_are_the_declared_floors():
    """.ci/oldest-versions.txt pins exactly the floors pyproject.toml declares (padded with .0: 5.17 -> 5.17.0)."""
    floors = _floors()
    pins = {}
    for line in Path(REPO, ".ci", "oldest-versions.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    assert set(pins) == {"torch", "transformers", "accelerate", "peft", "datasets", "numpy"}
    for name, version in pins.items():
        floor = floors[name]
        padded = floor + ".0" * (2 - floor.count("."))
        assert version == padded, f"{name}: pinned {version}, pyproject's floor is {floor}"


def test_the_contract_marker_covers_the_transformers_facing_tests():
    """Every module that exercises generate, caches, save/load, remote code, Trainer or PEFT is marked `contract`."""
    expected = {
        "test_model_generate.py", "test_model_cache.py", "test_model_auto.py", "test_model_peft.py",
        "test_model_training.py", "test_model_conformance.py", "test_model_attentions.py",
        "test_scalar_sort_generate.py", "test_scalar_sort_cache.py", "test_scalar_sort_hf.py",
        "test_recipes_pretrain.py", "test_attention_interface.py", "test_recipes_convert.py",
        "test_model_static_cache.py", "test_seed_qk_norm_registers.py", "test_seed_gka_variants.py",
        "test_seed_deit_recipe.py",
        "test_scalar_sort_schedule.py", "test_scalar_sort_sink.py", "test_scalar_sort_captured_mass_callback.py",
        "test_recipes_science.py", "test_model_static_compile.py", "test_recipes_scaling.py",
    }  # fmt: skip
    for name in sorted(expected):
        text = Path(REPO, "tests", name).read_text(encoding="utf-8")
        assert "pytestmark = pytest.mark.contract" in text or "pytest.mark.contract" in text, name


def test_the_extras_cover_what_the_recipes_and_tests_import():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    project = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = lambda reqs: {re.split(r"[<>=\[ ]", r)[0].lower() for r in reqs}
    core = names(project["dependencies"])
    assert {"torch", "transformers", "accelerate", "tokenizers", "safetensors"} <= core
    assert {"datasets", "matplotlib", "pyyaml", "pillow", "evaluate"} <= names(extras["recipes"])
    assert "pytest" in names(extras["test"]) and "hf_rbf[eval]" in extras["test"]
