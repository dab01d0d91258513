"""Recipe configuration for ``recipes/pretrain.py``: YAML files, ``base:`` inheritance, ``--set`` overrides, checks.

A recipe file has these top-level sections (every key is described in ``docs/recipes.md``)::

    run_name: cpu_quick                # a label for the results
    output_dir: outputs/cpu_quick      # checkpoints, metrics, the final model (relative to the current directory)
    seed: 0
    base: _tinystories_base.yaml       # optional: a file (relative to this one) whose values this file overrides
    model:      {family, config, match_parameters, expected_num_parameters, register_path}
    tokenizer:  {path} or {vocab_size, min_frequency, eos_token, pad_token, max_train_chars}
    data:       {root, train: [source, ...], validation: [source, ...], validation_fraction, block_size, cache_dir,
                 max_validation_blocks, num_proc}
    global_batch_size: 64              # optional: sets per_device_train_batch_size from the number of processes
    cpu_threads: 1                     # optional: torch.set_num_threads on a machine without CUDA
    fsdp_prefetch_layers: 1            # optional: under FSDP2, each layer issues the next N layers' all-gathers
    training:   {TrainingArguments keyword arguments}
    evaluation: {bpb: {...}, generation: {...}, remote_code_check: true}

A data source is ``{files: [...], format: text|json, text_column: text, separator: "<|endoftext|>", max_documents}`` or
``{hub: <dataset name>, hub_config, split, text_column, separator, max_documents}``.  ``{data_root}`` in a file path is
replaced by ``data.root``.

``--set a.b.c=value`` overrides one key (the value is parsed as YAML: ``--set training.max_steps=50``,
``--set model.config.attention_layers=[dot]``); a key that the file does not have is an error unless its section is
free-form (``model.config``, ``training``, ``evaluation.generation``), so typos do not pass silently.
"""

from __future__ import annotations

import copy
import os
import re

import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-4`` as a float (YAML 1.1, and so PyYAML, wants ``3.0e-4``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
    list("-+0123456789."),
)


def parse_value(text: str):
    """A ``--set`` value: YAML (numbers, booleans, null, lists, dicts), else the string itself."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


DEFAULTS: dict = {
    "run_name": None,
    "output_dir": None,
    "seed": 0,
    "model": {
        "family": None,
        "config": {},
        "match_parameters": None,
        "expected_num_parameters": None,
        "register_path": None,
    },
    "tokenizer": {
        "path": None,
        "vocab_size": 4096,
        "min_frequency": 2,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "max_train_chars": None,
    },
    "data": {
        "root": None,
        "train": [],
        "validation": [],
        "validation_fraction": 0.05,
        "block_size": 128,
        "cache_dir": None,
        "max_validation_blocks": None,
        "num_proc": None,
    },
    "global_batch_size": None,
    "cpu_threads": None,
    "fsdp_prefetch_layers": None,
    "training": {},
    "evaluation": {
        "bpb": {"enabled": True, "max_documents": None, "max_chars": None, "stride": None, "batch_size": 16},
        "generation": {
            "enabled": True,
            "prompt": "Once upon a time",
            "max_new_tokens": 120,
            "do_sample": True,
            "temperature": 0.8,
            "top_k": 40,
            "seed": 0,
        },
        "remote_code_check": True,
        "device": "auto",
    },
}

# Sections whose keys are not fixed here (they are passed on to transformers or are per-family).
FREE_FORM = {("model", "config"), ("model", "match_parameters"), ("training",), ("evaluation", "generation")}
SOURCE_KEYS = {"files", "format", "text_column", "separator", "max_documents", "hub", "hub_config", "split"}


def deep_merge(base: dict, update: dict) -> dict:
    """``base`` with ``update`` merged in (dicts recursively, everything else replaced)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: str) -> dict:
    """One recipe file with its ``base:`` chain merged in (the file's own values win)."""
    with open(path, encoding="utf-8") as f:
        cfg = yaml.load(f, Loader=_Loader) or {}
    if not isinstance(cfg, dict):
        raise TypeError(f"{path}: a recipe must be a YAML mapping; got {type(cfg).__name__}")
    base = cfg.pop("base", None)
    if base is not None:
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(os.path.abspath(path)), base)
        cfg = deep_merge(read_yaml(base_path), cfg)
    return cfg


def _check_keys(cfg: dict, reference: dict, where: tuple[str, ...]) -> None:
    if where in FREE_FORM:
        return
    for key, value in cfg.items():
        if key not in reference:
            name = ".".join(where + (key,))
            allowed = ", ".join(sorted(reference))
            raise ValueError(f"unknown recipe key `{name}`; allowed keys here: {allowed}")
        if isinstance(value, dict) and isinstance(reference[key], dict):
            _check_keys(value, reference[key], where + (key,))


def set_override(cfg: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place."""
    if "=" not in assignment:
        raise ValueError(f"--set {assignment!r}: expected key.path=value (e.g. training.max_steps=50)")
    path, text = assignment.split("=", 1)
    keys = path.strip().split(".")
    node = cfg
    for i, key in enumerate(keys[:-1]):
        if not isinstance(node.get(key), dict):
            if node.get(key) is None:
                node[key] = {}
            else:
                raise ValueError(f"--set {path}: `{'.'.join(keys[: i + 1])}` is not a section")
        node = node[key]
    node[keys[-1]] = parse_value(text)


def _check_source(source, where: str) -> None:
    if not isinstance(source, dict):
        raise TypeError(f"`{where}` must be a mapping with `files` or `hub`; got {source!r}")
    unknown = set(source) - SOURCE_KEYS
    if unknown:
        raise ValueError(f"`{where}`: unknown keys {sorted(unknown)}; allowed: {sorted(SOURCE_KEYS)}")
    if ("files" in source) == ("hub" in source):
        raise ValueError(f"`{where}` needs exactly one of `files` (local paths) or `hub` (a dataset name)")
    if "files" in source and (not isinstance(source["files"], (list, str)) or not source["files"]):
        raise ValueError(f"`{where}.files` must be a path or a non-empty list of paths")
    fmt = source.get("format")
    if fmt not in (None, "text", "json"):
        raise ValueError(f"`{where}.format` must be 'text' or 'json' (inferred from the extension when absent)")


def validate(cfg: dict) -> dict:
    """Check the merged recipe; returns it."""
    _check_keys(cfg, dict(DEFAULTS, config_file=None), ())
    model = cfg["model"]
    if not isinstance(model.get("family"), str) or not model["family"]:
        raise ValueError("`model.family` must name a model family (e.g. rbf, gka, dot, llama)")
    if not isinstance(model.get("config"), dict):
        raise TypeError("`model.config` must be a mapping of config keyword arguments")
    data = cfg["data"]
    if not data["train"]:
        raise ValueError("`data.train` must list at least one source ({files: [...]} or {hub: name})")
    for name in ("train", "validation"):
        if not isinstance(data[name], list):
            raise TypeError(f"`data.{name}` must be a list of sources")
        for i, source in enumerate(data[name]):
            _check_source(source, f"data.{name}[{i}]")
    if not isinstance(data["block_size"], int) or data["block_size"] < 2:
        raise ValueError(f"`data.block_size` must be an int >= 2; got {data['block_size']!r}")
    if not data["validation"] and not 0 < float(data["validation_fraction"]) < 1:
        raise ValueError("without `data.validation` sources, `data.validation_fraction` must be in (0, 1)")
    tok = cfg["tokenizer"]
    if tok["path"] is None and (not isinstance(tok["vocab_size"], int) or tok["vocab_size"] < 260):
        raise ValueError("`tokenizer.vocab_size` must be an int >= 260 (256 bytes + special tokens)")
    gbs = cfg["global_batch_size"]
    if gbs is not None and (not isinstance(gbs, int) or gbs < 1):
        raise ValueError(f"`global_batch_size` must be a positive int or null; got {gbs!r}")
    threads = cfg["cpu_threads"]
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"`cpu_threads` must be a positive int or null (torch's default); got {threads!r}")
    prefetch = cfg["fsdp_prefetch_layers"]
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1):
        raise ValueError(
            f"`fsdp_prefetch_layers` must be null (FSDP2's implicit prefetching) or an int >= 1; got {prefetch!r}"
        )
    if not cfg.get("output_dir"):
        raise ValueError("`output_dir` must be set (in the file or with --output-dir)")
    return cfg


def load_config(path: str, overrides=(), output_dir: str | None = None) -> dict:
    """The recipe at ``path`` merged over :data:`DEFAULTS`, with ``overrides`` (``a.b=value`` strings) applied."""
    cfg = read_yaml(path)
    _check_keys(cfg, DEFAULTS, ())
    for assignment in overrides:
        set_override(cfg, assignment)
    if output_dir is not None:
        cfg["output_dir"] = output_dir
    merged = deep_merge(DEFAULTS, cfg)
    merged["config_file"] = os.path.abspath(path)
    if merged["run_name"] is None:
        merged["run_name"] = os.path.splitext(os.path.basename(path))[0]
    if merged["output_dir"] is None:
        merged["output_dir"] = os.path.join("outputs", merged["run_name"])
    return validate(merged)


def default_data_root() -> str | None:
    """``data.root`` when the recipe leaves it null: ``$HF_RBF_DATA_ROOT``, else ``shared/data`` beside the repository
    (``../shared/data``) or inside it, whichever exists."""
    env = os.environ.get("HF_RBF_DATA_ROOT")
    if env:
        return env
    for candidate in (os.path.join(REPO_ROOT, "..", "shared", "data"), os.path.join(REPO_ROOT, "shared", "data")):
        if os.path.isdir(candidate):
            return os.path.abspath(candidate)
    return None


def resolve_path(path: str, data_root: str | None = None) -> str:
    """Expand ``{data_root}`` and ``~``; a relative path is taken from the current directory, else from the
    repository root (so the shipped sample works from anywhere)."""
    if "{data_root}" in path:
        root = data_root if data_root is not None else default_data_root()
        if root is None:
            raise FileNotFoundError(
                f"data file {path!r} needs `data.root` (the folder holding tinystories/ and gutenberg_children/): "
                "none of ../shared/data, shared/data exists; pass --set data.root=<dir> or set HF_RBF_DATA_ROOT"
            )
        path = path.replace("{data_root}", root)
    path = os.path.expanduser(path)
    if os.path.exists(path):
        return os.path.abspath(path)
    in_repo = os.path.join(REPO_ROOT, path)
    if not os.path.isabs(path) and os.path.exists(in_repo):
        return in_repo
    raise FileNotFoundError(
        f"data file {path!r} not found (relative paths are looked up in {os.getcwd()} and {REPO_ROOT}); pass "
        "another folder with --set data.root=<dir> (or $HF_RBF_DATA_ROOT) or edit the recipe's data sources"
    )


__all__ = [
    "DEFAULTS",
    "REPO_ROOT",
    "deep_merge",
    "default_data_root",
    "load_config",
    "parse_value",
    "read_yaml",
    "resolve_path",
    "validate",
]
