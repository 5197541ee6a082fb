"""Device mesh, logical-axis rules, shardings, multi-host start-up and per-host feeding.

One code path for 1 device and N devices on M hosts:

* `make_mesh(config.mesh)` builds a mesh with axes AXES. Sizes come from the
  config (`data`, `fsdp`, `tensor`, `context`; one may be -1, filled from the
  device count) for devices within a slice, and `dcn_*` for the product across
  slices (multi-slice pods). Axis types are Auto: the model only names logical
  axes, and GSPMD propagates shardings from the parameter/batch shardings and
  the logical constraints inside the model.
* One table of rules (`config.mesh.rules`, default DEFAULT_RULES) maps the
  model's logical axis names to mesh axes; parameters, optimizer state and the
  batch all get their shardings from it.
* `check_divisible` fails before tracing when a dimension does not split evenly
  over its mesh axes (jax would silently pad).
* Each host feeds only its own rows: `global_batch` turns host-local numpy
  arrays into global arrays with `jax.make_array_from_process_local_data`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

# 'context' splits each window (sequence parallelism: fot_jax/model/context_parallel.py).
AXES = ("data", "fsdp", "tensor", "context")

# Logical axis name -> mesh axes. Parameters: 'embed' is split over fsdp (ZeRO-3 style:
# gathered on use), 'heads'/'kv_heads'/'mlp'/'vocab' over tensor (Megatron style). The
# batch is split over data and fsdp; activations follow the same table.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", "context"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("head_dim", None),
)


def _get(cfg, key, default):
  if cfg is None:
    return default
  return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def rules_from_config(mesh_cfg) -> Tuple[Tuple[str, Any], ...]:
  """The logical-axis rules table as a tuple of (logical name, mesh axes) pairs."""
  table = _get(mesh_cfg, "rules", None) or DEFAULT_RULES
  out = []
  for entry in table:
    if len(entry) != 2:
      raise ValueError(f"mesh.rules: each rule is (logical_name, mesh_axes), got {entry!r}")
    name, axes = entry
    axes = tuple(axes) if isinstance(axes, (list, tuple)) else axes
    for a in (axes if isinstance(axes, tuple) else (axes,)):
      if a is not None and a not in AXES:
        raise ValueError(f"mesh.rules: rule for {name!r} names mesh axis {a!r}; mesh axes are {AXES}")
    out.append((str(name), axes))
  return tuple(out)


def mesh_shape(mesh_cfg, num_devices: int, num_slices: int = 1) -> Tuple[Dict[str, int], Dict[str, int]]:
  """(ici sizes, dcn sizes) per axis; one ici size may be -1 (auto-filled).

  ici sizes multiply to the devices of one slice, dcn sizes to the number of slices.
  """
  dcn = {a: int(_get(mesh_cfg, f"dcn_{a}", 1)) for a in AXES}
  dcn_total = math.prod(dcn.values())
  if any(v <= 0 for v in dcn.values()):
    raise ValueError(f"mesh.dcn_*: sizes must be positive, got {dcn}")
  if dcn_total != num_slices:
    raise ValueError(f"mesh.dcn_*: product of dcn sizes {dcn} is {dcn_total} but the job has "
                     f"{num_slices} slice(s); set the dcn_* sizes to multiply to {num_slices}")
  per_slice = num_devices // num_slices
  ici = {a: int(_get(mesh_cfg, a, 1)) for a in AXES}
  if mesh_cfg is None:  # no mesh section: data parallel over every device
    ici["data"] = -1
  auto = [a for a, v in ici.items() if v == -1]
  if len(auto) > 1:
    raise ValueError(f"mesh: only one axis may be -1, got {auto}")
  if any(v == 0 or v < -1 for v in ici.values()):
    raise ValueError(f"mesh: axis sizes must be positive or -1, got {ici}")
  known = math.prod(v for v in ici.values() if v != -1)
  if auto:
    if per_slice % known:
      raise ValueError(f"mesh: the fixed axes {ici} multiply to {known}, which does not divide the "
                       f"{per_slice} devices per slice; cannot fill mesh.{auto[0]}=-1")
    ici[auto[0]] = per_slice // known
  elif known != per_slice:
    raise ValueError(f"mesh: data*fsdp*tensor*context = {known} but there are {per_slice} devices "
                     f"per slice ({num_devices} devices, {num_slices} slice(s)); make the sizes "
                     f"multiply to {per_slice} or set one to -1")
  return ici, dcn


def _num_slices(devices) -> int:
  return len({getattr(d, "slice_index", 0) for d in devices})


def make_mesh(mesh_cfg, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """The device mesh of the config (all devices by default)."""
  devices = list(jax.devices() if devices is None else devices)
  slices = _num_slices(devices)
  ici, dcn = mesh_shape(mesh_cfg, len(devices), slices)
  types = (AxisType.Auto,) * len(AXES)
  if slices > 1:
    from jax.experimental import mesh_utils
    arr = mesh_utils.create_hybrid_device_mesh([ici[a] for a in AXES], [dcn[a] for a in AXES], devices)
    return Mesh(arr, AXES, axis_types=types)
  return jax.make_mesh([ici[a] for a in AXES], AXES, axis_types=types, devices=devices)


def describe(mesh: Mesh) -> str:
  return " x ".join(f"{a}={mesh.shape[a]}" for a in AXES) + f" ({mesh.size} devices)"


def to_mesh_specs(logical_specs, rules):
  return nn.logical_to_mesh(logical_specs, rules)


def _axis_size(mesh, axes) -> int:
  if axes is None:
    return 1
  axes = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in axes)


def check_divisible(abstract, mesh_specs, mesh, what: str) -> None:
  """Every sharded dimension must split evenly over its mesh axes; fails naming both numbers.

  mesh: anything with a `.shape` dict of axis sizes (a Mesh, or sizes from a config)."""
  leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
  specs = jax.tree_util.tree_leaves(mesh_specs, is_leaf=lambda x: isinstance(x, P))
  for (path, leaf), spec in zip(leaves, specs):
    for dim, axes in enumerate(spec):
      n = _axis_size(mesh, axes)
      if leaf.shape[dim] % n:
        name = jax.tree_util.keystr(path).lstrip(".")
        raise ValueError(f"{what} {name}: dimension {dim} of size {leaf.shape[dim]} is not divisible by "
                         f"mesh axes {axes} of size {n}; change the mesh sizes (mesh.*) or the model size")


def batch_axes(rules):
  return dict(rules).get("batch")


def batch_axes_tuple(rules) -> Tuple[str, ...]:
  axes = batch_axes(rules)
  return () if axes is None else (axes if isinstance(axes, tuple) else (axes,))


def batch_shards(mesh: Mesh, rules) -> int:
  """How many pieces the batch dimension is split into (data x fsdp by default)."""
  return _axis_size(mesh, batch_axes(rules))


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """Rows split over the batch axes; every other dimension replicated."""
  return NamedSharding(mesh, P(batch_axes(rules)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_batch_rows(rows: int, mesh: Mesh, rules, what: str = "batch") -> None:
  """The rows of one (accumulation) step must split evenly over the batch shards."""
  shards = batch_shards(mesh, rules)
  if rows % shards:
    raise ValueError(f"{what}: {rows} rows are not divisible by the {shards} batch shards "
                     f"(mesh axes {batch_axes(rules)}); change the slots, train.accum_steps or the mesh")


def global_batch(local: Dict[str, np.ndarray], sharding: NamedSharding) -> Dict[str, jax.Array]:
  """Host-local rows (this host's slots) -> global arrays split over the batch axes.

  The global batch is the hosts' rows in process order, so every host must
  pass the same number of rows.
  """
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}


def global_replicated(x: np.ndarray, mesh: Mesh) -> jax.Array:
  """A value every host computes identically (e.g. a crossbatch plan) as a replicated array."""
  x = np.asarray(x)
  return jax.make_array_from_process_local_data(replicated(mesh), x, x.shape)


def initialize_distributed(auto: bool = False, coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None, process_id: Optional[int] = None) -> bool:
  """Starts jax.distributed for a job of several processes; returns whether it did.

  auto: let jax detect the cluster (TPU pod workers, SLURM, Open MPI; what
  launch/tpu.py passes on every worker). Explicit coordinator/num_processes/process_id
  serve GPU/CPU clusters and localhost runs. Neither: a single process.
  """
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise ValueError("--coordinator_address needs --num_processes and --process_id")
    jax.distributed.initialize(coordinator_address, int(num_processes), int(process_id))
    return True
  if auto:
    jax.distributed.initialize()
    return True
  return False


def shardings_from_specs(mesh_specs, mesh: Mesh):
  """Tree of mesh PartitionSpecs -> tree of NamedShardings."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), mesh_specs,
                                is_leaf=lambda x: isinstance(x, P))
