"""Meshes and placement rules (knows meshes and collectives, not requests)."""
from .mesh import AXES, make_mesh
from .moe_dedup import moe_layer_tp, moe_param_specs, place_moe_params
from .rules import param_shardings, param_spec

__all__ = ["AXES", "make_mesh", "param_shardings", "param_spec", "moe_layer_tp", "moe_param_specs",
           "place_moe_params"]
