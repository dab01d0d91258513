"""Shared fixtures of the model tests: a private HF cache, tiny configs of every family, random-but-sane weights.

HF_HOME / HF_MODULES_CACHE point at a temporary directory *before* transformers is imported (the remote-code module
cache path is read at import time), so tests that save and load with ``trust_remote_code`` never touch the user's
cache or another process's.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile


# The repository root on the path: the recipe tests import `recipes.*` (scripts, not part of the installed package),
# also when the suite is started as `pytest` rather than `python -m pytest`.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

_HF_HOME = tempfile.mkdtemp(prefix="hf_rbf_test_hf_home_")
os.environ["HF_HOME"] = _HF_HOME
os.environ["HF_MODULES_CACHE"] = os.path.join(_HF_HOME, "modules")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers.utils.logging  # noqa: E402,F401  (installs Logger.warning_once, cleared per test below)


# Without CUDA the Triton kernels can only run in Triton's CPU interpreter, and the flag is read when triton is first
# imported (``import hf_rbf`` imports it): set it before any test module imports hf_rbf, so the kernel tests run in
# this process instead of re-running themselves in a subprocess.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The model tests compare float32 results to 1e-5 and time themselves in a few minutes on 2 cores.
# Under pytest-xdist (``-n``) every worker is a process of its own: one thread each, so that N workers on N cores do
# not oversubscribe them.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.1,
    attention_backend="naive",
)

# (id, family, overrides): the configurations most tests run on.  They cover both families, every position type,
# normalize on/off, registers 0 and 2, windows ("SSSL") and mixed layer kinds ("dot" layers in both families).
FAMILY_CASES = [
    ("rbf-susie-r1", "rbf", dict()),
    ("rbf-rope-r0", "rbf", dict(position_embedding_type="rope", num_register_tokens=0)),
    ("rbf-none-nonorm-r2", "rbf", dict(position_embedding_type="none", rbf_normalize=False, num_register_tokens=2)),
    (
        "rbf-mixed-window-r2",
        "rbf",
        dict(
            num_hidden_layers=4,
            attention_layers=["rbf", "dot"],
            window_pattern="SSL",
            sliding_window=3,
            num_register_tokens=2,
            rbf_learnable_gamma=True,
            tie_word_embeddings=False,
        ),
    ),
    ("gka-rope-r0", "gka", dict()),
    (
        "gka-sssl-dot-r2",
        "gka",
        dict(
            num_hidden_layers=4,
            attention_layers=["gka", "gka", "gka", "dot"],
            window_pattern="SSSL",
            sliding_window=3,
            num_register_tokens=2,
        ),
    ),
    ("gka-none-nonorm-r1", "gka", dict(position_embedding_type="none", gka_feature_norm=False, num_register_tokens=1)),
]

# A smaller set for the slower generate / Trainer / PEFT tests.
CORE_CASES = [c for c in FAMILY_CASES if c[0] in ("rbf-susie-r1", "rbf-mixed-window-r2", "gka-sssl-dot-r2")]


def make_config(family: str, **overrides):
    from transformers import AutoConfig

    import hf_rbf  # noqa: F401  (registers the model types)

    kwargs = dict(TINY)
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    """Perturb every parameter (registers, their positions, SuSiE weights, sigmas, norms) so that tests see
    non-trivial attention patterns instead of the zero / constant initial values."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
        if name.endswith("log_sigma") or name.endswith("log_gamma"):
            p.add_(0.3 * noise)
        elif "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif p.dim() >= 2 and "register" not in name and "susie" not in name:
            p.add_(0.1 * noise)
        else:
            p.add_(scale * noise)
    return model


def build_model(family: str, overrides: dict, seed: int = 0, randomize: bool = True):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **overrides))
    if randomize:
        randomize_(model, seed=seed)
    return model.eval()


def generate_with_logits(model, ids, mask, *, use_cache: bool, seed: int = 0, pad: int = 0, **kwargs):
    """``model.generate`` with the step logits returned (``return_dict_in_generate``), seeded, without gradients."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            use_cache=use_cache,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )


def enable_activation_checkpointing(model, **checkpoint_kwargs) -> None:
    """Gradient (activation) checkpointing under the installed transformers' name: ``activation_checkpointing_enable``
    from 5.24 on, ``gradient_checkpointing_enable`` (deprecated there) before."""
    kwargs = checkpoint_kwargs or None
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_activation_checkpointing(model) -> None:
    """The inverse of :func:`enable_activation_checkpointing`, under the installed name."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


@pytest.fixture(params=FAMILY_CASES, ids=[c[0] for c in FAMILY_CASES])
def family_case(request):
    """(case id, family, config overrides) for every configuration in FAMILY_CASES."""
    return request.param


@pytest.fixture(params=CORE_CASES, ids=[c[0] for c in CORE_CASES])
def core_case(request):
    """(case id, family, config overrides) for the smaller CORE_CASES set."""
    return request.param


class _DeprecationRecords(logging.Handler):
    """Collects transformers' deprecation messages: transformers announces renames (``past_key_values`` -> ``cache``
    in 5.24) through its logger, with ``warning_once``, not through the warnings module."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecat" in message.lower():
            self.messages.append(f"{record.name}: {message}")


@pytest.fixture(autouse=True)
def fail_on_transformers_deprecations(request):
    """Every test fails when transformers logs a deprecation while it runs: a deprecated name used by our code (or by
    a test) is the warning that announced the 5.24 cache rename.  ``warning_once``'s memory is cleared first, so a
    message already logged by an earlier test is seen again.  Python's DeprecationWarning / FutureWarning are errors
    through setup.cfg's ``filterwarnings``."""
    logging.Logger.warning_once.cache_clear()
    handler = _DeprecationRecords()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.messages and request.node.get_closest_marker("allows_deprecations") is None:
        pytest.fail("transformers logged a deprecation during the test:\n" + "\n".join(handler.messages))


@pytest.fixture
def hf_home():
    """The private HF_HOME of this test session."""
    return _HF_HOME


@pytest.fixture
def one_rank_gloo_group():
    """A one-process gloo group (what FSDP2 and DDP runs have initialised), destroyed afterwards."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_HF_HOME, ignore_errors=True)


# The start of a child script that must not see hf_rbf (what a user with `trust_remote_code=True` and without the
# package has): every import of hf_rbf fails from here on.
HIDE_HF_RBF = """\
import importlib.abc, json, sys

class BlockHfRbf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "hf_rbf" or name.startswith("hf_rbf."):
            raise ImportError("hf_rbf is hidden in this process")
        return None

sys.meta_path.insert(0, BlockHfRbf())
"""
