"""Meshes and placement rules (knows meshes and collectives, not requests)."""
from .mesh import AXES, make_mesh
from .rules import param_shardings, param_spec

__all__ = ["AXES", "make_mesh", "param_shardings", "param_spec"]
