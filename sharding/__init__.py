"""Meshes and placement rules (knows meshes and collectives, not requests)."""
from .mesh import AXES, make_mesh
from .memory import memory_report
from .moe_dedup import moe_layer_tp, moe_param_specs, place_moe_params
from .rules import param_shardings, param_spec

__all__ = ["memory_report", "AXES", "make_mesh", "param_shardings", "param_spec", "moe_layer_tp", "moe_param_specs",
           "place_moe_params"]
