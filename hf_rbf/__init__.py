"""hf_rbf: distance-based attention (RBF, GKA, scalar sort, hybrid) as first-class Hugging Face models.

``import hf_rbf`` exposes the four attention functions and registers every config and model with the
``transformers`` Auto classes.
"""

from .attention_gka import gka_attention
from .attention_hybrid import hybrid_attention
from .attention_rbf import rbf_attention
from .attention_scalar import scalar_attention
from .attention_utils import BACKENDS, last_backend


__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "gka_attention",
    "hybrid_attention",
    "last_backend",
    "rbf_attention",
    "scalar_attention",
]
