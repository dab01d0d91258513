"""hf_rbf: distance-based attention (RBF, GKA, scalar sort, hybrid) as first-class Hugging Face models.

``import hf_rbf`` exposes the attention functions and registers every config and model with the
``transformers`` Auto classes (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification,
AutoImageProcessor).
"""

import logging as _logging

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
)

from .attention_interface import RBF_ATTENTION_IMPLEMENTATIONS, register_attention_functions
from .cache_names import CACHE_NAME
from .attention_dot import dot_attention
from .attention_gka import gka_attention
from .attention_hybrid import hybrid_attention
from .attention_rbf import rbf_attention
from .attention_scalar import scalar_attention
from .attention_utils import BACKENDS, last_backend
from .cache_sorted_scalar import SortedScalarCache, SortedScalarCacheLayer
from .configuration_decoder import DecoderConfig
from .configuration_gka import GkaConfig
from .configuration_gka_vit import GkaVitConfig
from .configuration_hybrid_sort import HybridSortConfig
from .configuration_rbf import RbfConfig
from .configuration_scalar_sort import ScalarSortConfig
from .geometry_equirect import equirect_key_log_weights, equirect_patch_centers, equirect_patch_solid_angles
from .geometry_measure import log_weights_from_measure
from .geometry_mesh import (
    graph_key_log_weights,
    graph_node_degree,
    mesh_key_log_weights,
    mesh_vertex_areas,
    triangle_areas,
)
from .geometry_sphere import (
    SphereGrid,
    equiangular_grid,
    gauss_legendre_grid,
    latlon_grid_from_edges,
)
from .geometry_warp import grid_key_log_weights, grid_patch_areas, warp_key_log_weights, warp_patch_areas
from .image_processing_gka_vit import GkaVitImageProcessor
from .modeling_decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderModel,
    DecoderPreTrainedModel,
    DotAttention,
)
from .modeling_gka import GkaAttention, GkaForCausalLM, GkaModel, GkaPreTrainedModel, ValueLessAttention
from .modeling_gka_vit import GkaVitForImageClassification, GkaVitModel
from .modeling_hybrid_sort import (
    HybridSortAttention,
    HybridSortForCausalLM,
    HybridSortModel,
    HybridSortPreTrainedModel,
)
from .modeling_rbf import RbfAttention, RbfForCausalLM, RbfModel, RbfPreTrainedModel
from .modeling_scalar_sort import (
    ScalarSortAttention,
    ScalarSortCausalLMOutput,
    ScalarSortForCausalLM,
    ScalarSortModel,
    ScalarSortPreTrainedModel,
)
from .sorted_decode import sorted_window_attention, sorted_window_attention_reference

__version__ = "0.1.0"

# Language-model families: (config, base model, causal LM).  exist_ok: re-importing (e.g. importlib.reload) is harmless.
_FAMILIES = (
    (RbfConfig, RbfModel, RbfForCausalLM),
    (GkaConfig, GkaModel, GkaForCausalLM),
    (ScalarSortConfig, ScalarSortModel, ScalarSortForCausalLM),
    (HybridSortConfig, HybridSortModel, HybridSortForCausalLM),
)
for _config, _model, _lm in _FAMILIES:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

# The GKA vision transformer.
AutoConfig.register(GkaVitConfig.model_type, GkaVitConfig, exist_ok=True)
AutoModel.register(GkaVitConfig, GkaVitModel, exist_ok=True)
AutoModelForImageClassification.register(
    GkaVitConfig, GkaVitForImageClassification, exist_ok=True
)
try:
    AutoImageProcessor.register(
        GkaVitConfig, slow_image_processor_class=GkaVitImageProcessor, exist_ok=True
    )
except ImportError as _err:  # AutoImageProcessor is gated on PIL / torchvision; the class itself works
    # Debug level: `import hf_rbf` prints nothing on an install without the vision extras.
    _logging.getLogger("hf_rbf").debug(
        "GkaVitImageProcessor is not registered with AutoImageProcessor (%s); use GkaVitImageProcessor directly",
        str(_err).strip().splitlines()[0],
    )

# attn_implementation="rbf" / "rbf_softmax_free" for stock transformers models (hf_rbf/attention_interface.py)
register_attention_functions()

__all__ = [
    "BACKENDS",
    "RBF_ATTENTION_IMPLEMENTATIONS",
    "register_attention_functions",
    "CACHE_NAME",
    "DecoderAttention",
    "DecoderConfig",
    "DecoderForCausalLM",
    "DecoderModel",
    "DecoderPreTrainedModel",
    "DotAttention",
    "GkaAttention",
    "ValueLessAttention",
    "GkaConfig",
    "GkaForCausalLM",
    "GkaModel",
    "GkaPreTrainedModel",
    "GkaVitConfig",
    "GkaVitForImageClassification",
    "GkaVitImageProcessor",
    "GkaVitModel",
    "HybridSortAttention",
    "HybridSortConfig",
    "HybridSortForCausalLM",
    "HybridSortModel",
    "HybridSortPreTrainedModel",
    "RbfAttention",
    "RbfConfig",
    "RbfForCausalLM",
    "RbfModel",
    "RbfPreTrainedModel",
    "SphereGrid",
    "ScalarSortAttention",
    "ScalarSortCausalLMOutput",
    "ScalarSortConfig",
    "ScalarSortForCausalLM",
    "ScalarSortModel",
    "ScalarSortPreTrainedModel",
    "SortedScalarCache",
    "SortedScalarCacheLayer",
    "dot_attention",
    "equiangular_grid",
    "equirect_key_log_weights",
    "equirect_patch_centers",
    "equirect_patch_solid_angles",
    "gauss_legendre_grid",
    "gka_attention",
    "graph_key_log_weights",
    "graph_node_degree",
    "grid_key_log_weights",
    "grid_patch_areas",
    "hybrid_attention",
    "last_backend",
    "latlon_grid_from_edges",
    "log_weights_from_measure",
    "mesh_key_log_weights",
    "mesh_vertex_areas",
    "rbf_attention",
    "scalar_attention",
    "sorted_window_attention",
    "sorted_window_attention_reference",
    "triangle_areas",
    "warp_key_log_weights",
    "warp_patch_areas",
]
