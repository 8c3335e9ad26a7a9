from torch_shift.models.decoder import DecoderLM
from torch_shift.models.hub import resolve_model_dir
from torch_shift.models.loader import CheckpointReader, build_model, load_model

__all__ = ["CheckpointReader", "DecoderLM", "build_model", "load_model", "resolve_model_dir"]
