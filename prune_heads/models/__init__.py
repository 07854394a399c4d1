"""Model loading and the per-family architecture adapters."""
from prune_heads.models.adapters import ADAPTERS, ArchAdapter, adapter_for, supported_model_types
from prune_heads.models.loading import LoadedModel, load_model

__all__ = [
    "ADAPTERS",
    "ArchAdapter",
    "LoadedModel",
    "adapter_for",
    "load_model",
    "supported_model_types",
]
