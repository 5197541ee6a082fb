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
instruction's op_name and source line), read by `largest_buffers`.
"""
from __future__ import annotations

import glob
import math
import os
import re
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


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dump_file(dump_dir: str, module: str, suffix: str):
  """The newest dump of `module` ending in `suffix` (module_NNNN.<module>.<...><suffix>), or None."""
  files = sorted(glob.glob(os.path.join(glob.escape(dump_dir), f"module_*.{glob.escape(module)}.*{suffix}")))
  return files[-1] if files else None


def _allocation_kind(header: str) -> str:
  flags = re.sub(r"\|[^|]*\|", "", header)  # drop the |shape| texts
  if re.search(r"\bparameter \d+", flags):
    return "argument"
  for flag, kind in (("constant", "constant"), ("thread-local", "thread-local"), ("maybe-live-out", "output")):
    if re.search(rf"\b{flag}\b", flags):
      return kind
  return "temporary"


def _buffer_assignment(path: str) -> dict:
  """value key 'name{index}' -> (allocation index, kind, size, offset, shape without layout)."""
  values, alloc, kind = {}, None, None
  value_re = re.compile(r"^\s*value: <\d+ ([^\s{>]+)(\{[^}]*\})?[^>]*> \(size=(\d+),offset=(\d+)\): (.*)$")
  with open(path) as f:
    for line in f:
      if line.startswith("allocation "):
        m = re.match(r"allocation (\d+): size (\d+), ?(.*)$", line)
        alloc, kind = int(m.group(1)), _allocation_kind(m.group(3))
        continue
      m = value_re.match(line)
      if m and alloc is not None:
        shape = re.sub(r"\{[^{}]*\}", "", m.group(5).strip())
        values[m.group(1) + (m.group(2) or "{}")] = (alloc, kind, int(m.group(3)), int(m.group(4)), shape)
  return values


def _live_ranges(path: str) -> dict:
  """XLA's HloLiveRange dump -> schedule length, the peak's position and its live values, every value's range."""
  out = {"length": None, "peak_at": None, "peak": [], "ranges": {}, "sequence": {}}
  section = None
  with open(path) as f:
    for line in f:
      m = re.match(r"HloLiveRange \(max (\d+)\)", line)
      if m:
        out["length"] = int(m.group(1))
        continue
      m = re.match(r"\s+Live ranges at (\d+) \(peak\):", line)
      if m:
        section, out["peak_at"] = "peak", int(m.group(1))
        continue
      stripped = line.strip()
      if stripped == "InstructionSequence:":
        section = "sequence"
        continue
      if stripped == "BufferLiveRange:":
        section = "ranges"
        continue
      if not line.startswith("    "):  # another section's header (the stack-trace breakdown: not read)
        section = section if not line.strip() else None
        continue
      if section == "sequence":
        m = re.match(r"\s+(\d+):(\S+)", line)
        if m:
          out["sequence"][int(m.group(1))] = m.group(2)
      elif section == "ranges":
        m = re.match(r"\s+(\S+?)(\{[^}]*\}):(\d+)-(\d+)\s*$", line)
        if m:
          out["ranges"][m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
      elif section == "peak":
        m = re.match(r"\s+(\S+?)(\{[^}]*\}): (\d+) bytes", line)
        if m:
          out["peak"].append((m.group(1) + m.group(2), int(m.group(3))))
  return out


def _source_frames(lines, wanted) -> dict:
  """The optimized HLO text's stack-frame tables -> {frame id: [(file, line), ... outwards]} for `wanted`."""
  tables, name = {}, None
  for line in lines:
    if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      name = line.strip()
      tables[name] = {}
      continue
    if name is None or not line.strip():
      name = None
      continue
    m = re.match(r"(\d+) (.*)$", line.strip())
    if m:
      tables[name][int(m.group(1))] = m.group(2)
  if "StackFrames" not in tables:
    return {}
  files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
  locations = {}
  for k, v in tables.get("FileLocations", {}).items():
    m = re.search(r"file_name_id=(\d+).*?\bline=(\d+)", v)
    if m:
      locations[k] = (files.get(int(m.group(1)), "?"), int(m.group(2)))
  frames = {}
  for k, v in tables["StackFrames"].items():
    m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v)
    if m:
      frames[k] = (int(m.group(1)), int(m.group(2)))
  # This XLA prints parent_frame_id as the parent's id + 1 (0 + 1 for the outermost frame, so
  # frame 1 names itself): seen as a frame naming itself; otherwise the ids are taken as printed.
  shift = 1 if any(p == k for k, (_, p) in frames.items()) else 0

  def chain(k):
    out, seen = [], set()
    while k in frames and k not in seen:
      seen.add(k)
      loc, parent = frames[k]
      if loc in locations:
        out.append(locations[loc])
      k = parent - shift
    return out
  return {k: chain(k) for k in wanted}


def _hlo_index(path: str):
  """The optimized HLO text -> ({instruction: [opcode, op_name, source, stack frame, operands, called
  computation]}, {computation: its ROOT instruction}, the stack-frame table's lines)."""
  index, roots, header, computation = {}, {}, [], None
  inst_re = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(([^)]*)\)")  # name = shape opcode(operands)
  with open(path) as f:
    for line in f:
      if computation is None and not line.startswith(("%", "ENTRY")):
        header.append(line)  # the stack-frame tables come before the first computation
        continue
      if line.startswith(("%", "ENTRY")):
        m = re.match(r"(?:ENTRY )?%?([\w.\-]+) ", line)
        computation = m.group(1) if m else ""
        continue
      m = inst_re.match(line)
      if not m:
        continue
      op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
      source = re.search(r'source_file="((?:[^"\\]|\\.)*)" source_line=(\d+)', line)
      frame = re.search(r"stack_frame_id=(\d+)", line)
      calls = re.search(r"calls=%([\w.\-]+)", line)
      index[m.group(2)] = [m.group(3), op_name.group(1).replace("\\'", "'").replace('\\"', '"') if op_name else "",
                           f"{source.group(1)}:{source.group(2)}" if source else "",
                           int(frame.group(1)) if frame else None, re.findall(r"%([\w.\-]+)", m.group(4)),
                           calls.group(1) if calls else None]
      if m.group(1):
        roots[computation] = m.group(2)
  return index, roots, header


def _producers(path: str, names) -> dict:
  """name -> (opcode, op_name, source 'file:line', via) for instructions of the optimized HLO text.

  An instruction without an op_name of its own (XLA made it: a copy, a fusion of a dot it
  rewrote) is described by its fused computation's root, else by its first user that has one
  (`via` names that user: a copy XLA inserted is there for its user, e.g. the zeroed target of a
  scatter-add, where its operand could be a broadcast shared by several layers)."""
  index, roots, header = _hlo_index(path)
  names = [n for n in names if n in index]
  users = {n: [] for n in names}
  for user, inst in index.items():
    for operand in inst[4]:
      if operand in users and user not in users[operand]:
        users[operand].append(user)

  def own(name):  # name, or its fused computation's root, if either has an op_name
    if name in index and index[name][1]:
      return name
    root = roots.get(index[name][5]) if name in index and index[name][5] else None
    return root if root in index and index[root][1] else None

  picked = {}
  for name in names:
    source = own(name)
    via = ""
    if source is None:
      source = next((own(u) for u in users[name] if own(u)), None)
      via = next((u for u in users[name] if own(u)), "")
    picked[name] = (source or name, via)
  chains = _source_frames(header, {index[s][3] for s, _ in picked.values() if index[s][3] is not None})
  out = {}
  for name, (source, via) in picked.items():
    opcode, op_name, where, frame = index[name][0], index[source][1], index[source][2], index[source][3]
    own_frames = [(f, n) for f, n in chains.get(frame, []) if "site-packages" not in f and not f.startswith("<")]
    if own_frames and not where:
      f, n = own_frames[0]
      where = f"{os.path.relpath(f, _ROOT) if f.startswith(_ROOT + os.sep) else f}:{n}"
    out[name] = (opcode, op_name, where, via)
  return out


def _short_op_name(op_name: str) -> str:
  """jit(step)/while/body/closed_call/jvp(LlamaModel)/layers_1/... -> jvp(LlamaModel)/layers_1/..."""
  parts = [p for p in op_name.split("/") if p not in ("while", "body", "closed_call", "cond")]
  if parts and parts[0].startswith("jit(") and len(parts) > 1:
    parts = parts[1:]
  return "/".join(parts)


def largest_buffers(dump_dir: str, module: str, top: int = 10) -> dict:
  """The `top` largest buffers live at the peak of `module`'s compiled schedule, from XLA's dump.

  XLA:CPU puts every temporary in one block (memory_analysis' temp size) and packs it: values
  that are never live at the same time share its bytes, so the values live together at the
  schedule's peak are what the block must hold at once (its size adds what packing wastes).
  Buffers live at the peak that share an allocation and an offset (aliases of one buffer) are
  counted once; each row's `kind` is its allocation's: argument (a parameter of the step),
  output (live out, not an argument), temporary, constant or thread-local; `live` its first
  and last position in the schedule; op_name and source as `_producers` finds them (`via`: the
  user they were taken from, when the instruction has none).
  """
  paths = {s: _dump_file(dump_dir, module, s) for s in
           ("-buffer-assignment.txt", "-live-range.txt", "after_optimizations.txt")}
  missing = [s.strip("-") for s, p in paths.items() if p is None]
  if missing:
    return {"error": f"XLA wrote no {', '.join(missing)} for {module} in {dump_dir}"}
  values = _buffer_assignment(paths["-buffer-assignment.txt"])
  live = _live_ranges(paths["-live-range.txt"])
  if live["peak_at"] is None:
    return {"error": "XLA's live-range dump names no peak"}
  rows, seen = [], set()
  for key, size in live["peak"]:
    alloc, kind, vsize, offset, shape = values.get(key, (None, "?", size, None, "?"))
    if alloc is not None:
      if (alloc, offset) in seen:  # one buffer seen through two values (an alias)
        continue
      seen.add((alloc, offset))
    rows.append({"key": key, "name": key.split("{")[0], "bytes": vsize, "kind": kind, "shape": shape,
                 "allocation": alloc, "offset": offset, "live": live["ranges"].get(key)})
  rows.sort(key=lambda r: (-r["bytes"], r["name"]))
  listed = rows[:top]
  peak_name = live["sequence"].get(live["peak_at"], "")
  meta = _producers(paths["after_optimizations.txt"], [r["name"] for r in listed] + [peak_name])
  for r in listed:
    r["opcode"], op_name, r["source"], r["via"] = meta.get(r["name"], ("", "", "", ""))
    r["op_name"] = _short_op_name(op_name)
  by_kind = {}
  for r in rows:
    by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + r["bytes"]
  return {"peak_at": live["peak_at"], "schedule_length": live["length"],
          "peak_instruction": peak_name, "peak_op_name": _short_op_name(meta.get(peak_name, ("", ""))[1]),
          "live_at_peak": len(rows), "peak_bytes": sum(r["bytes"] for r in rows), "peak_by_kind": by_kind,
          "buffers": listed}


def model_flops(cfg, params, rows: int, window: int, live_sources: int) -> float:
  """Model FLOPs of one training step (PaLM's convention: what the model needs, not what remat
  recomputes or an implementation skips): 6 x matmul parameters x tokens, plus 12 x T x keys x
  heads x head_dim per row and layer for the local window (T keys) and per live crossbatch
  source in each memory layer (T more keys). Unlike XLA's count it does not depend on how the
  step is written (XLA counts a loop body once: scanned layers, blockwise key blocks)."""
  matmul = sum(math.prod(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
               if jax.tree_util.keystr(path).endswith("['kernel']"))
  if cfg.tie_embeddings:  # the output projection is the embedding table
    matmul += cfg.vocab_size * cfg.hidden_size
  hd = cfg.num_heads * cfg.dim_per_head
  local = 12.0 * window * window * hd * rows * cfg.num_layers
  extra = 12.0 * window * window * hd * live_sources * len(cfg.mem_layers)
  return 6.0 * matmul * rows * window + local + extra


def plan(config, dump_dir: str | None = None, top: int = 10) -> dict:
  """What one train step of `config` costs on its mesh. dump_dir: the folder XLA_FLAGS'
  --xla_dump_to names (set before jax starts), to list the `top` largest buffers live at the peak."""
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
  if dump_dir:  # a program read from the compilation cache is not compiled, so XLA would dump nothing
    jax.config.update("jax_enable_compilation_cache", False)
  t0 = time.time()
  compiled, abstract = compile_step(cfg, optimizer, mesh, rules, rows, window, accum, spec, groups, trainable)
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
         "flops_per_step": flops_device * mesh.size, "flops_6nt": 6.0 * n_params * tokens,
         "model_flops": model_flops(cfg, abstract.params, rows, window,
                                    int((stacked_plan(spec or {}, rows, accum, groups)[0] >= 0).sum())),
         "memory_per_device": per_device, "compile_seconds": seconds}
  if dump_dir:
    out["largest_buffers"] = largest_buffers(dump_dir, compiled.runtime_executable().hlo_modules()[0].name, top)
  return out


def format_plan(p: dict) -> str:
  gib = 1 << 30
  m = p["memory_per_device"]
  return "\n".join([
      f"mesh               {p['mesh']}",
      f"parameters         {p['params']:,} ({p['params'] / 1e9:.2f}B)",
      f"step               {p['rows']} rows x {p['window']} tokens = {p['tokens_per_step']:,} tokens, "
      f"accum_steps={p['accum_steps']}, crossbatch {p['crossbatch_spec']} (scope {p['crossbatch_scope']})",
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
