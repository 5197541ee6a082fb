"""Reads XLA's dump of a compiled program: its buffer assignment (which allocation holds each
value: a parameter, a live-out, the one packed block of temporaries), its live ranges (which
values are live at the peak of the schedule) and the optimized HLO (each instruction's op_name and
source line), into `largest_buffers`: the largest buffers live at the peak (--mode=plan's table).
"""
from __future__ import annotations

import glob
import os
import re

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
