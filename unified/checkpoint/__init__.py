from unified.checkpoint.hf_config import UnsupportedModelError
from unified.checkpoint.loader import LoadedModel, export_hf, hf_state_dict, load_model
from unified.checkpoint.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "LoadedModel", "UnsupportedModelError", "export_hf", "hf_state_dict", "load_model"]
