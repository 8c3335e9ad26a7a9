from torch_shift.models.decoder import DecoderLM
from torch_shift.models.hub import resolve_model_dir
from torch_shift.models.loader import CheckpointReader, load_model, load_weights

__all__ = ["CheckpointReader", "DecoderLM", "load_model", "load_weights", "resolve_model_dir"]
