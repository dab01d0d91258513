"""hf_rbf: distance-based attention (RBF, GKA, scalar sort, hybrid) as first-class Hugging Face models.

``import hf_rbf`` exposes the four attention functions and registers every config and model with the
``transformers`` Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .attention_dot import dot_attention
from .attention_gka import gka_attention
from .attention_hybrid import hybrid_attention
from .attention_rbf import rbf_attention
from .attention_scalar import scalar_attention
from .attention_utils import BACKENDS, last_backend
from .configuration_decoder import DecoderConfig
from .configuration_gka import GkaConfig
from .configuration_rbf import RbfConfig
from .modeling_decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderModel,
    DecoderPreTrainedModel,
    DotAttention,
)
from .modeling_gka import GkaAttention, GkaForCausalLM, GkaModel, GkaPreTrainedModel
from .modeling_rbf import RbfAttention, RbfForCausalLM, RbfModel, RbfPreTrainedModel

# scalar sort / hybrid sort families and the sorted KV cache
from .cache_sorted_scalar import SortedScalarCache, SortedScalarCacheLayer
from .configuration_hybrid_sort import HybridSortConfig
from .configuration_scalar_sort import ScalarSortConfig
from .modeling_hybrid_sort import HybridSortAttention, HybridSortForCausalLM, HybridSortModel, HybridSortPreTrainedModel
from .modeling_scalar_sort import (
    ScalarSortAttention,
    ScalarSortCausalLMOutput,
    ScalarSortForCausalLM,
    ScalarSortModel,
    ScalarSortPreTrainedModel,
)
from .sorted_decode import sorted_window_attention, sorted_window_attention_reference


__version__ = "0.1.0"

# Model families: (config, base model, causal LM).  exist_ok: re-importing (e.g. after importlib.reload) is harmless.
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

__all__ = [
    "BACKENDS",
    "DecoderAttention",
    "DecoderConfig",
    "DecoderForCausalLM",
    "DecoderModel",
    "DecoderPreTrainedModel",
    "DotAttention",
    "GkaAttention",
    "GkaConfig",
    "GkaForCausalLM",
    "GkaModel",
    "GkaPreTrainedModel",
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
    "ScalarSortAttention",
    "ScalarSortCausalLMOutput",
    "ScalarSortConfig",
    "ScalarSortForCausalLM",
    "ScalarSortModel",
    "ScalarSortPreTrainedModel",
    "SortedScalarCache",
    "SortedScalarCacheLayer",
    "dot_attention",
    "gka_attention",
    "hybrid_attention",
    "last_backend",
    "rbf_attention",
    "scalar_attention",
    "sorted_window_attention",
    "sorted_window_attention_reference",
]
