"""``hf_rbf.modeling_decoder``'s module settings (``register_path``, ``register_compile_mode``, ``rotary_backend``,
...) applied while a block runs and restored after it: how the benchmarks run A/B variants of one model side by side
in one process."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def decoder_settings(settings: dict):
    """``settings`` (name -> value) set on ``hf_rbf.modeling_decoder`` while the block runs."""
    from hf_rbf import modeling_decoder

    saved = {k: getattr(modeling_decoder, k) for k in settings}
    for k, v in settings.items():
        setattr(modeling_decoder, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(modeling_decoder, k, v)
