"""HF checkpoints in and out: config translation, safetensors reading and writing, loading and export."""
from unified.lazy import lazy_exports

_EXPORTS = {"UnsupportedModelError": "unified.checkpoint.hf_config", "LoadedModel": "unified.checkpoint.loader",
            "export_hf": "unified.checkpoint.loader", "hf_state_dict": "unified.checkpoint.loader",
            "load_model": "unified.checkpoint.loader", "CheckpointError": "unified.checkpoint.safetensors_io"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
