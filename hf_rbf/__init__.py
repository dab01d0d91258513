"""hf_rbf: distance-based attention (RBF, GKA, scalar sort, hybrid) as first-class Hugging Face models.

``import hf_rbf`` exposes the four attention functions and registers every config and model with the
``transformers`` Auto classes.
"""

from .attention_gka import gka_attention
from .attention_hybrid import hybrid_attention
from .attention_rbf import rbf_attention
from .attention_scalar import scalar_attention
from .attention_utils import BACKENDS, last_backend


# --- GKA vision transformer (geometry helper): config, models and image processor with the Auto classes ---------
from transformers import (  # noqa: E402
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageClassification,
)

from .configuration_gka_vit import GkaVitConfig  # noqa: E402
from .image_processing_gka_vit import GkaVitImageProcessor  # noqa: E402
from .modeling_gka_vit import GkaVitForImageClassification, GkaVitModel  # noqa: E402

AutoConfig.register(GkaVitConfig.model_type, GkaVitConfig, exist_ok=True)
AutoModel.register(GkaVitConfig, GkaVitModel, exist_ok=True)
AutoModelForImageClassification.register(GkaVitConfig, GkaVitForImageClassification, exist_ok=True)
try:
    AutoImageProcessor.register(GkaVitConfig, slow_image_processor_class=GkaVitImageProcessor, exist_ok=True)
except ImportError as _err:  # transformers 5.17 gates AutoImageProcessor on torchvision; the class itself works
    import logging as _logging

    _logging.getLogger("hf_rbf").warning(
        "GkaVitImageProcessor is not registered with AutoImageProcessor (%s); use GkaVitImageProcessor directly",
        str(_err).strip().splitlines()[0],
    )
# --- end GKA vision transformer ---------------------------------------------------------------------------------


__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "GkaVitConfig",
    "GkaVitForImageClassification",
    "GkaVitImageProcessor",
    "GkaVitModel",
    "gka_attention",
    "hybrid_attention",
    "last_backend",
    "rbf_attention",
    "scalar_attention",
]
