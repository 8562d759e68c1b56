"""Meshes (over one process or many), placement rules and memory accounting (knows meshes and
collectives, not requests).
Imports nothing from kimik3 or serve: the layers that compute under these placements live in
kimik3/layers/."""
from .distributed import DistributedError, broadcast_json, host_value, initialize_distributed, is_primary
from .mesh import AXES, HOST_AXES, make_mesh
from .memory import memory_report
from .moe import moe_param_specs, place_moe_params
from .rules import MoEAxes, moe_axes, param_shardings, param_spec, place_model

__all__ = ["DistributedError", "broadcast_json", "host_value", "initialize_distributed", "is_primary", "memory_report", "AXES",
           "HOST_AXES", "make_mesh", "param_shardings", "param_spec", "MoEAxes", "moe_axes",
           "moe_param_specs", "place_model", "place_moe_params"]
