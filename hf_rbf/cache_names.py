"""The name of the KV cache in transformers' API, on either side of its rename.

transformers 5.24 renamed the cache argument of every forward and ``generate``, the output field of every
``ModelOutput`` and the key of ``generate``'s model kwargs from ``past_key_values`` to ``cache`` (the old name is
deprecated until 5.40).  A model that only knows one name breaks silently on the other side: ``cache=`` lands in
``**kwargs``, every decode step sees an empty cache and ``generate`` writes wrong text.

hf_rbf supports both ends of its range, so every forward takes the cache under both names
(:func:`resolve_cache_argument`), builds its outputs with the field name the installed ``ModelOutput`` classes declare
(:data:`CACHE_NAME`, :func:`cache_field`) and reads them the same way (:func:`output_cache`): no deprecation warning on
either side.  The name is read from transformers itself, never from its version string.
"""

from __future__ import annotations

import dataclasses

from transformers.modeling_outputs import BaseModelOutputWithPast


def _installed_cache_name() -> str:
    names = {field.name for field in dataclasses.fields(BaseModelOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


# "cache" (transformers >= 5.24) or "past_key_values" (older): the forward argument, the ModelOutput field and the key
# of ``generate``'s model kwargs.
CACHE_NAME: str = _installed_cache_name()
# The other spelling, still accepted by every hf_rbf forward.
OTHER_CACHE_NAME: str = "past_key_values" if CACHE_NAME == "cache" else "cache"


def resolve_cache_argument(cache=None, past_key_values=None):
    """The cache a forward was given under either name (``None`` when neither); both at once is an error."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError(
            "Pass the KV cache once: as `cache` (its name from transformers 5.24 on) or as `past_key_values` (its "
            "name before), not both"
        )
    return past_key_values


def cache_field(cache) -> dict:
    """``{CACHE_NAME: cache}``: the keyword for building a ``ModelOutput`` with the installed field name."""
    return {CACHE_NAME: cache}


def output_cache(output):
    """The cache held by a model output (``None`` when it holds none), read without the deprecated alias."""
    return getattr(output, CACHE_NAME, None)


def generation_cache(model_kwargs: dict):
    """The cache ``generate`` keeps in its model kwargs (under the installed name)."""
    return model_kwargs.get(CACHE_NAME)


__all__ = [
    "CACHE_NAME",
    "OTHER_CACHE_NAME",
    "cache_field",
    "generation_cache",
    "output_cache",
    "resolve_cache_argument",
]
