"""--mode=plan: what one training step costs on the configured mesh, before booking it.

The train step is lowered and compiled against abstract shapes (jax.ShapeDtypeStruct
with shardings) on fake CPU devices, so nothing of the model is allocated. Reports
the parameter count, FLOPs per step (XLA's count of the compiled per-device program,
times the devices, next to the 6 x params x tokens estimate) and per-device memory of
the compiled step (arguments, outputs, temporaries; donated state is counted once).

With the XLA dump of the compile (main.py points --xla_dump_to at a temporary folder), it also
lists the largest buffers live at the step's peak: XLA's buffer assignment (which allocation
holds each value: a parameter, a live-out, the one packed block of temporaries), its live
ranges (which values are live at the peak of the schedule) and the optimized HLO (each
instruction's op_name and source line), read by `xla_buffers.largest_buffers`.

`write_plan_json` (--plan_json=FILE) keeps the plan as JSON: every figure format_plan prints,
the printed text, the command and where it ran; docs/plan_figures.py fills docs/scale_out.md's
plan figures from such files, so the docs quote what the current code compiles.
"""
from __future__ import annotations

import math
import resource
import shlex
import sys
import time

import jax
import jax.numpy as jnp

from fot_jax import configs, crossbatch, jsonio, parallel, provenance
from fot_jax.model import context_parallel
from fot_jax.model.memory import MemoryBlock
from fot_jax.train import make_optimizer, make_train_step, resolve_trainable, stacked_plan, state_shardings
from fot_jax.xla_buffers import largest_buffers


def _widest_spec(schedule, rows: int):
  """The schedule's most expensive spec (most extra contexts over all rows): the one that must fit."""
  return max(schedule.all_specs(), key=lambda s: int((crossbatch.plan_from_spec(rows, s).sources >= 0).sum()))


def compile_step(cfg, optimizer, mesh, rules, rows: int, window: int, accum: int = 1, spec=None, groups: int = 1,
                 trainable=None, memory=None, memory_tokens: int = 0):
  """The train step lowered and compiled against abstract shapes -> (compiled, abstract state).
  memory (train.memory's MemorySettings): the step that also reads a memory of memory_tokens entries."""
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
  step = make_train_step(cfg, optimizer, accum, mesh, rules, trainable,
                         memory_topk=memory.topk if memory is not None else None)
  if memory is not None:  # one block [1, M, KV, D] per memory layer, replicated (fot_jax/train/far_memory.py)
    entry = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    kv, dh = cfg.kv_heads, cfg.dim_per_head
    plan_args.append({layer: [MemoryBlock(entry(cfg.dtype, 1, memory_tokens, kv, dh),
                                          entry(cfg.dtype, 1, memory_tokens, kv, dh),
                                          entry(jnp.bool_, 1, memory_tokens))] for layer in cfg.mem_layers})
  widths = crossbatch.pack_widths(sources, crossbatch.pack_size(spec or {}))
  return step.lower(state, batch, *plan_args, widths).compile(), abstract


def memory_per_device(compiled) -> dict:
  """Bytes per device of a compiled program (donated arguments counted once)."""
  mem = compiled.memory_analysis()
  out = {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
         "temporaries": int(mem.temp_size_in_bytes), "aliased": int(mem.alias_size_in_bytes)}
  out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
  return out


def model_flops(cfg, params, rows: int, window: int, live_sources: int, memory_tokens: int = 0) -> float:
  """Model FLOPs of one training step (PaLM's convention: what the model needs, not what remat
  recomputes or an implementation skips): 6 x matmul parameters x tokens, plus 12 x T x keys x
  heads x head_dim per row and layer for the local window (T keys) and per live crossbatch
  source in each memory layer (T more keys). Unlike XLA's count it does not depend on how the
  step is written (XLA counts a loop body once: scanned layers, blockwise key blocks). With
  train.memory, each memory layer's queries also score memory_tokens keys (2 x T x M x heads x
  head_dim per row, forward only: the backward pass and p.v reach only the top-k)."""
  matmul = sum(math.prod(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if jax.tree_util.keystr(path).endswith("['kernel']"))
  if cfg.tie_embeddings:  # the output projection is the embedding table
    matmul += cfg.vocab_size * cfg.hidden_size
  hd = cfg.num_heads * cfg.dim_per_head
  local = 12.0 * window * window * hd * rows * cfg.num_layers
  extra = 12.0 * window * window * hd * live_sources * len(cfg.mem_layers)
  memory = 2.0 * window * memory_tokens * hd * rows * len(cfg.mem_layers)
  return 6.0 * matmul * rows * window + local + extra + memory


def plan(exp: configs.Experiment, dump_dir: str | None = None, top: int = 10) -> dict:
  """What one FoT train step of the experiment costs on its mesh. dump_dir: the folder XLA_FLAGS'
  --xla_dump_to names (set before jax starts), to list the `top` largest buffers live at the peak."""
  cfg, ts, schedule = exp.model, exp.train, exp.schedule()  # FoT's step: a dictionary run's `fot` section
  rows, window, accum = exp.train_shape()
  mesh, rules = parallel.make_mesh(ts.mesh), parallel.rules_from_config(ts.mesh)
  optimizer = make_optimizer(ts.optim)
  trainable = resolve_trainable(ts.trainable, cfg)
  state_shardings(cfg, optimizer, mesh, rules, trainable)  # indivisible parameters fail before the batch check
  parallel.check_batch_rows(rows // accum, mesh, rules, "data.slots x windows_per_slot / train.accum_steps")
  scope = ts.crossbatch_scope
  groups = parallel.batch_shards(mesh, rules) if scope == "device" else 1
  spec = _widest_spec(schedule, rows // accum // groups)
  if dump_dir:  # a program read from the compilation cache is not compiled, so XLA would dump nothing
    jax.config.update("jax_enable_compilation_cache", False)
  t0 = time.time()
  # train.memory: the longest memory haystack a phase's data makes
  memory_tokens = max((getattr(f, "memory_tokens", 0) for f in exp.lm.feeds.values()), default=0) if exp.lm else 0
  compiled, abstract = compile_step(cfg, optimizer, mesh, rules, rows, window, accum, spec, groups, trainable,
                                    ts.memory, memory_tokens)
  seconds = time.time() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract.params))
  tokens = rows * window
  per_device = memory_per_device(compiled)
  flops_device = float(cost.get("flops", float("nan"))) if cost else float("nan")
  out = {"mesh": parallel.describe(mesh), "params": n_params, "tokens_per_step": tokens,
         "rows": rows, "window": window, "accum_steps": accum, "crossbatch_spec": spec,
         "crossbatch_scope": scope, "flops_per_device": flops_device,
         "train_memory": None if ts.memory is None else dict(tokens=memory_tokens, topk=ts.memory.topk),
         "flops_per_step": flops_device * mesh.size, "flops_6nt": 6.0 * n_params * tokens,
         "model_flops": model_flops(cfg, abstract.params, rows, window,
                                    int((stacked_plan(spec or {}, rows, accum, groups)[0] >= 0).sum()),
                                    memory_tokens if ts.memory is not None else 0),
         "memory_per_device": per_device, "compile_seconds": seconds}
  if dump_dir:
    out["largest_buffers"] = largest_buffers(dump_dir, compiled.runtime_executable().hlo_modules()[0].name, top)
  return out


def resources() -> dict:
  """This process's CPU seconds so far and its peak resident memory (what planning cost here)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return {"cpu_seconds": time.process_time(),
          "max_rss_bytes": int(peak if sys.platform == "darwin" else peak * 1024)}


def write_plan_json(path: str, p: dict, argv=None) -> dict:
  """Writes `p` (plan()'s dict) to `path` as {"command", "plan", "printed", "resources",
  "provenance"}: `printed` is format_plan(p), what the command printed, `command` the command
  line (argv: sys.argv of `python -m fot_jax.main`), `resources` what the planning process used
  (CPU seconds, peak memory). Returns what it wrote."""
  command = "python -m fot_jax.main" + ("".join(" " + shlex.quote(a) for a in argv[1:]) if argv else "")
  record = {"command": command, "plan": p, "printed": format_plan(p), "resources": resources(),
            "provenance": provenance.provenance()}
  jsonio.write_json(path, record, indent=1)
  return record


def format_plan(p: dict) -> str:
  gib = 1 << 30
  m = p["memory_per_device"]
  return "\n".join([
      f"mesh               {p['mesh']}",
      f"parameters         {p['params']:,} ({p['params'] / 1e9:.2f}B)",
      f"step               {p['rows']} rows x {p['window']} tokens = {p['tokens_per_step']:,} tokens, "
      f"accum_steps={p['accum_steps']}, crossbatch {p['crossbatch_spec']} (scope {p['crossbatch_scope']})"
      + (f", reading train.memory: {p['train_memory']['tokens']:,} entries, top-{p['train_memory']['topk']}"
         if p.get("train_memory") else ""),
      f"FLOPs per step     {p['flops_per_step']:.3e} (XLA: {p['flops_per_device']:.3e} per device; "
      f"6 x params x tokens = {p['flops_6nt']:.3e}; a loop body counts once)",
      f"model FLOPs        {p['model_flops']:.3e} (6 x matmul params x tokens + attention over the window "
      f"and live extra contexts)",
      f"memory per device  {m['total'] / gib:.2f} GiB = arguments {m['arguments'] / gib:.2f} + outputs "
      f"{m['outputs'] / gib:.2f} + temporaries {m['temporaries'] / gib:.2f} - donated {m['aliased'] / gib:.2f} GiB",
      f"(compiled for fake CPU devices in {p['compile_seconds']:.0f}s; a TPU/GPU compiler may fuse "
      f"and lay out differently)"] + format_buffers(p))


def _size(n: int) -> str:
  return (f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20
          else f"{n / (1 << 10):.1f} KiB" if n >= 1 << 10 else f"{n} B")


def format_buffers(p: dict) -> list:
  """The largest buffers live at the peak, one table (empty without a dump)."""
  b = p.get("largest_buffers")
  if not b:
    return []
  if "error" in b:
    return [f"largest buffers    not listed: {b['error']}"]
  plural = {"argument": "arguments", "output": "outputs", "temporary": "temporaries"}
  kinds = " + ".join(f"{plural.get(k, k)} {_size(v)}"
                     for k, v in sorted(b["peak_by_kind"].items(), key=lambda kv: -kv[1]))
  where = b["peak_instruction"] + (f", {b['peak_op_name']}" if b["peak_op_name"] else "")
  lines = [
      f"largest buffers    live at the step's peak (instruction {b['peak_at']} of {b['schedule_length']}"
      + (f" = {100 * b['peak_at'] // b['schedule_length']}%" if b["schedule_length"] else "") + f": {where}):",
      f"                   {_size(b['peak_bytes'])} in {b['live_at_peak']} buffers = {kinds}; the temporaries are "
      f"one {_size(p['memory_per_device']['temporaries'])} block",
      f"                   in which buffers never live at the same time share bytes. The {len(b['buffers'])} largest "
      f"(live: span of the schedule):"]
  rows = [("size", "kind", "shape", "live", "HLO instruction", "op_name (source)")]
  for r in b["buffers"]:
    live = (f"{100 * r['live'][0] // b['schedule_length']}-{100 * r['live'][1] // b['schedule_length']}%"
            if r["live"] and b["schedule_length"] else "?")
    op = r["op_name"] + (f" ({r['source']})" if r["source"] else "")
    if r["via"] and op:  # the instruction has no op_name: its first user's, named
      op = f"used by {r['via']}: {op}"
    rows.append((_size(r["bytes"]), r["kind"], r["shape"], live, r["name"], op or r["opcode"]))
  widths = [max(len(row[i]) for row in rows) for i in range(5)]
  for row in rows:
    lines.append("  " + "  ".join([row[0].rjust(widths[0])] + [c.ljust(w) for c, w in zip(row[1:5], widths[1:])]
                                  + [row[5]]))
  return lines
