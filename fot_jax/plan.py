"""--mode=plan: what one training step costs on the configured mesh, before booking it.

The train step is lowered and compiled against abstract shapes (jax.ShapeDtypeStruct
with shardings) on fake CPU devices, so nothing of the model is allocated. Reports
the parameter count, FLOPs per step (XLA's count of the compiled per-device program,
times the devices, next to the 6 x params x tokens estimate) and per-device memory of
the compiled step (arguments, outputs, temporaries; donated state is counted once).
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from fot_jax import configs, crossbatch, parallel
from fot_jax.model import context_parallel
from fot_jax.train import make_optimizer, make_train_step, resolve_trainable, stacked_plan, state_shardings


def _widest_spec(schedule, rows: int):
  """The schedule's most expensive spec (most extra contexts over all rows): the one that must fit."""
  return max(schedule.all_specs(), key=lambda s: int((crossbatch.plan_from_spec(rows, s).sources >= 0).sum()))


def compile_step(cfg, optimizer, mesh, rules, rows: int, window: int, accum: int = 1, spec=None, groups: int = 1,
                 trainable=None):
  """The train step lowered and compiled against abstract shapes -> (compiled, abstract state)."""
  abstract, shardings = state_shardings(cfg, optimizer, mesh, rules, trainable)
  if context_parallel.context_size(mesh) > 1:
    context_parallel.check_length(window, context_parallel.context_size(mesh), cfg.context_layout)
  sources, positive = stacked_plan(spec or {}, rows, accum, groups)
  state = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                 abstract, shardings)
  bsh, rep = parallel.batch_sharding(mesh, rules), parallel.replicated(mesh)
  batch = {"inputs": jax.ShapeDtypeStruct((rows, window), jnp.int32, sharding=bsh),
           "targets": jax.ShapeDtypeStruct((rows, window), jnp.int32, sharding=bsh),
           "loss_mask": jax.ShapeDtypeStruct((rows, window), jnp.bool_, sharding=bsh)}
  plan_args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for x in (sources, positive)]
  step = make_train_step(cfg, optimizer, accum, mesh, rules, trainable)
  widths = crossbatch.pack_widths(sources, crossbatch.pack_size(spec or {}))
  return step.lower(state, batch, *plan_args, widths).compile(), abstract


def memory_per_device(compiled) -> dict:
  """Bytes per device of a compiled program (donated arguments counted once)."""
  mem = compiled.memory_analysis()
  out = {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
         "temporaries": int(mem.temp_size_in_bytes), "aliased": int(mem.alias_size_in_bytes)}
  out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
  return out


def plan(config) -> dict:
  cfg = configs.model_config(config)
  rows, window, accum, schedule = configs.train_shape(config)
  mesh_cfg = config.get("mesh")
  mesh, rules = parallel.make_mesh(mesh_cfg), parallel.rules_from_config(mesh_cfg)
  optimizer = make_optimizer(config.optim)
  trainable = resolve_trainable(config.train.get("trainable"), cfg) if "train" in config else None
  state_shardings(cfg, optimizer, mesh, rules, trainable)  # indivisible parameters fail before the batch check
  parallel.check_batch_rows(rows // accum, mesh, rules, "data.slots x windows_per_slot / train.accum_steps")
  scope = config.get("train", {}).get("crossbatch_scope", "batch") if "train" in config else "batch"
  groups = parallel.batch_shards(mesh, rules) if scope == "device" else 1
  spec = _widest_spec(schedule, rows // accum // groups)
  t0 = time.time()
  compiled, abstract = compile_step(cfg, optimizer, mesh, rules, rows, window, accum, spec, groups, trainable)
  seconds = time.time() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract.params))
  tokens = rows * window
  per_device = memory_per_device(compiled)
  flops_device = float(cost.get("flops", float("nan"))) if cost else float("nan")
  return {"mesh": parallel.describe(mesh), "params": n_params, "tokens_per_step": tokens,
          "rows": rows, "window": window, "accum_steps": accum, "crossbatch_spec": spec,
          "crossbatch_scope": scope, "flops_per_device": flops_device,
          "flops_per_step": flops_device * mesh.size, "flops_6nt": 6.0 * n_params * tokens,
          "memory_per_device": per_device, "compile_seconds": seconds}


def format_plan(p: dict) -> str:
  gib = 1 << 30
  m = p["memory_per_device"]
  return "\n".join([
      f"mesh               {p['mesh']}",
      f"parameters         {p['params']:,} ({p['params'] / 1e9:.2f}B)",
      f"step               {p['rows']} rows x {p['window']} tokens = {p['tokens_per_step']:,} tokens, "
      f"accum_steps={p['accum_steps']}, crossbatch {p['crossbatch_spec']} (scope {p['crossbatch_scope']})",
      f"FLOPs per step     {p['flops_per_step']:.3e} (XLA: {p['flops_per_device']:.3e} per device; "
      f"6 x params x tokens = {p['flops_6nt']:.3e})",
      f"memory per device  {m['total'] / gib:.2f} GiB = arguments {m['arguments'] / gib:.2f} + outputs "
      f"{m['outputs'] / gib:.2f} + temporaries {m['temporaries'] / gib:.2f} - donated {m['aliased'] / gib:.2f} GiB",
      f"(compiled for fake CPU devices in {p['compile_seconds']:.0f}s; a TPU/GPU compiler may fuse "
      f"and lay out differently)"])
