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
    assert main_job.startswith("pip install torch==2.13.0 && pip install -e ")
    assert main_job.endswith("python recipes/pretrain.py --config recipes/configs/cpu_quick.yaml")
    assert tests.startswith("pip install torch==2.13.0 && ") and tests.endswith("python -m pytest -q")
    assert os.path.exists(os.path.join(REPO, "recipes", "configs", "cpu_quick.yaml"))


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _readme_commands()
    ci = Path(os.path.join(REPO, ".ci", "run")).read_text(encoding="utf-8")
    lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert tests in lines
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    assert os.access(os.path.join(REPO, ".ci", "run"), os.X_OK)


def test_the_extras_cover_what_the_recipes_and_tests_import():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    project = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = lambda reqs: {re.split(r"[<>=\[ ]", r)[0].lower() for r in reqs}
    core = names(project["dependencies"])
    assert {"torch", "transformers", "accelerate", "tokenizers", "safetensors"} <= core
    assert {"datasets", "matplotlib", "pyyaml", "pillow", "evaluate"} <= names(extras["recipes"])
    assert "pytest" in names(extras["test"]) and "hf_rbf[eval]" in extras["test"]
