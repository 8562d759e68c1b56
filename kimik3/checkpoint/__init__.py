"""Checkpoint I/O: HF safetensors directories (bf16, fp32, MXFP4 experts) and Orbax."""
from .hf import load_hf
from .orbax_io import is_orbax_dir, load_orbax, save
from .safetensors_io import CheckpointError, SafetensorsFile, write_safetensors

__all__ = ["load_hf", "is_orbax_dir", "load_orbax", "save", "CheckpointError", "SafetensorsFile",
           "write_safetensors"]
