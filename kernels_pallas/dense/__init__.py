"""Skinny matmuls: the model's dense projections at decode widths (a few to a few hundred rows)
as one Pallas launch per group of weights that share an input (kernel.py), beside the plain-JAX
product they replace (reference.py). Entry point: ops.py; configuration: tuning.py."""
from .ops import MAX_ROWS, skinny_matmul
from .reference import skinny_matmul_reference
from .tuning import SkinnyConfig

__all__ = ["MAX_ROWS", "skinny_matmul", "skinny_matmul_reference", "SkinnyConfig"]
