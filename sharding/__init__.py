"""Meshes and placement rules (knows meshes and collectives, not requests)."""
from .mesh import AXES, make_mesh
from .memory import memory_report
from .moe import moe_layer, moe_layer_tp, moe_param_specs, moe_sharded, place_moe_params
from .rules import moe_axes, param_shardings, param_spec, place_model

__all__ = ["memory_report", "AXES", "make_mesh", "param_shardings", "param_spec", "moe_axes", "moe_layer",
           "moe_layer_tp", "moe_param_specs", "moe_sharded", "place_model", "place_moe_params"]
