"""``hf_rbf.modeling_decoder``'s module settings (``register_path``, ``register_compile_mode``, ``rotary_backend``,
...) applied while a block runs and restored after it: how the benchmarks run A/B variants of one model side by side
in one process."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def decoder_settings(settings: dict):
    """``settings`` (name -> value) set on ``hf_rbf.modeling_decoder`` while the block runs; a name of the form
    ``"module.name"`` sets ``hf_rbf.<module>.<name>`` instead (``"kernels_launch.DIRECT_LAUNCH"``)."""
    import importlib

    def owner_and_name(key: str):
        module, _, name = key.rpartition(".")
        return importlib.import_module(f"hf_rbf.{module or 'modeling_decoder'}"), name

    saved = {k: getattr(*owner_and_name(k)) for k in settings}
    for k, v in settings.items():
        setattr(*owner_and_name(k), v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(*owner_and_name(k), v)
