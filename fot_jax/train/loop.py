"""The training loop: train() (run or resume a curriculum, checkpoint, answer SIGTERM), the metrics
log (metrics.jsonl + TensorBoard) and the batch sources' checkpointed positions.

Crash anywhere, lose nothing: a process killed at any moment (kill -9 included, mid-checkpoint
too) resumes with the same command from its last finished checkpoint (an unfinished write is
never a step: fot_jax/train/run_state.py), and the logs are cut back to that step first, so
metrics.jsonl and TensorBoard hold every step once with the values of an uninterrupted run
(tests/kill_resume.py measures it).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from fot_jax import checkpoint, crossbatch, parallel
from fot_jax import recurrent as recurrent_lib
from fot_jax.curriculum import Schedule
from fot_jax.model.config import ModelConfig
from fot_jax.recurrent import RecurrentSpec
from fot_jax.settings import TrainSettings
from fot_jax.train.run_state import (NoCheckpoint, checkpoint_manager, describe_folder, orbax_logs_off,
                                       params_from_checkpoint, restore_step, saved_carry_target,
                                       unfinished_writes)
from fot_jax.train.far_memory import FarMemory
from fot_jax.train.fingerprint import check_run_fingerprint, run_fingerprint
from fot_jax.train.optimizer import count_trainable, make_optimizer, resolve_trainable
from fot_jax.train.step import init_state, make_train_step, stacked_plan, state_shardings


class MetricsLog:
  """metrics.jsonl + TensorBoard scalars in the workdir (process 0 only).

  resume_step: the step training restarts from (0 for a fresh start); records of later steps,
  written after that step's checkpoint by a process that then died, and a line or TensorBoard
  record cut by the kill, are dropped first, so every step is logged once. None (evaluation,
  which may read a workdir whose run is training) leaves the files alone."""

  def __init__(self, workdir: str, name: str = "", tensorboard: bool = True, resume_step: Optional[int] = None):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.writer = None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
    if self.enabled and resume_step is not None:
      dropped = trim_metrics(self.path, resume_step)
      dropped_tb = trim_event_files(os.path.join(workdir, "tb"), resume_step)
      if dropped or dropped_tb:
        _print(f"[{name}] resuming at step {resume_step}: dropped {dropped} metrics.jsonl line(s) and "
               f"{dropped_tb} TensorBoard record(s) written after it (or cut by a crash)")
    if self.enabled and tensorboard:  # TensorFlow's import costs seconds; tests skip it
      try:
        from clu import metric_writers
        self.writer = metric_writers.SummaryWriter(os.path.join(workdir, "tb"))
      except Exception as e:  # TensorBoard is optional for a run to proceed
        print(f"[{name}] TensorBoard disabled: {e}")

  def write(self, step: int, scalars: Dict[str, float]):
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": step, **scalars}) + "\n")
    if self.writer is not None:
      self.writer.write_scalars(step, {k: v for k, v in scalars.items() if np.isfinite(v)})
      self.writer.flush()


TRIM_TMP = ".trim.tmp"  # a trimmed file on its way; its name holds no "tfevents", which TensorBoard would read


def _replace_file(path: str, data: bytes) -> None:
  """Writes `data` to a temporary file next to `path` and renames it over `path`: a crash
  while trimming leaves the old file or the new one (and maybe a stray TRIM_TMP file), never a part."""
  tmp = os.path.join(os.path.dirname(path), TRIM_TMP)
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def trim_metrics(path: str, step: int) -> int:
  """Keeps the metrics.jsonl records of steps <= `step`; a line that does not parse (cut by a
  kill mid-write) goes too. Returns how many lines were dropped."""
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    data = f.read()
  kept, dropped = [], 0
  for line in data.splitlines():
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      keep = int(record["step"]) <= step
    except (ValueError, KeyError, TypeError):
      keep = False
    if keep:
      kept.append(line)
    else:
      dropped += 1
  out = b"".join(line + b"\n" for line in kept)
  if out != data:  # also a whole last line that lost only its newline
    _replace_file(path, out)
  return dropped


def trim_event_files(folder: str, step: int) -> int:
  """TensorBoard's event files in `folder` without the summaries of steps > `step` and without
  a record cut by a kill (TFRecord framing: length u64, its crc u32, data, data crc u32); kept
  records are copied byte for byte. Returns how many records were dropped."""
  if not os.path.isdir(folder):
    return 0
  names = [n for n in os.listdir(folder) if "tfevents" in n]
  if not names:
    return 0
  from google.protobuf.message import DecodeError
  from tensorboard.compat.proto import event_pb2  # only a run with TensorBoard files gets here
  dropped = 0
  for name in names:
    path = os.path.join(folder, name)
    with open(path, "rb") as f:
      data = f.read()
    kept, at = [], 0
    while at < len(data):
      size = int.from_bytes(data[at:at + 8], "little") if at + 12 <= len(data) else -1
      end = at + 12 + size + 4
      if size < 0 or end > len(data):
        dropped += 1  # a record cut short: the end of the file
        break
      try:
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
      except DecodeError:  # garbage where a record should be: nothing after it is trusted
        dropped += 1
        break
      if event.step <= step or not event.HasField("summary"):  # the file-version header stays
        kept.append(data[at:end])
      else:
        dropped += 1
      at = end
    out = b"".join(kept)
    if out != data:
      _replace_file(path, out)
  return dropped


def _new_carry(cfg: ModelConfig, rspec: RecurrentSpec, slots: int, window: int, mesh, rules):
  """An empty recurrent carry for the global batch's slots, created in the batch's sharding."""
  parallel.check_batch_rows(slots, mesh, rules, "recurrent memory (one carry row per slot)")
  return jax.jit(lambda: recurrent_lib.init_carry(cfg, rspec, slots, window),
                 out_shardings=parallel.batch_sharding(mesh, rules))()


def _batch_sources(schedule: Schedule, batch_fn) -> Dict[Optional[str], Callable]:
  """{task name: batch function}: a mapping of the curriculum's tasks, or one function (task None)."""
  if not isinstance(batch_fn, Mapping):
    named = sorted(t for t in schedule.tasks() if t is not None)
    if named:
      raise ValueError(f"curriculum: phases name data tasks {named}; give train() a mapping of them to batch "
                       f"functions")
    return {None: batch_fn}
  missing = sorted({str(t) for t in schedule.tasks() if t not in batch_fn})
  if missing:
    raise ValueError(f"curriculum: phase task(s) {missing} have no batch function; given: {sorted(batch_fn)}")
  return dict(batch_fn)


def _extra_state(schedule: Schedule, sources: Dict[Optional[str], Callable]) -> dict:
  """JSON saved next to the train state: the curriculum's state and, for each batch source
  that keeps one (a resumable pipeline: `state_dict()` / `load_state_dict()`), its position."""
  extra = {"schedule": schedule.state_dict()}
  stateful = {k: fn for k, fn in sources.items() if hasattr(fn, "load_state_dict")}
  if None in stateful:  # one source: the layout checkpoints have always had
    extra["data"] = stateful[None].state_dict()
  elif stateful:
    extra["data_by_task"] = {k: fn.state_dict() for k, fn in stateful.items()}
  return extra


def _restore_data(extra: dict, sources: Dict[Optional[str], Callable]) -> None:
  if None in sources and "data" in extra and hasattr(sources[None], "load_state_dict"):
    sources[None].load_state_dict(extra["data"])  # the data pipeline's position
  for k, state in extra.get("data_by_task", {}).items():
    if k in sources and hasattr(sources[k], "load_state_dict"):
      sources[k].load_state_dict(state)


class Preempted(SystemExit):
  """Raised after a SIGTERM was answered with a checkpoint: the process exits with status 0."""

  def __init__(self, step: int):
    super().__init__(0)
    self.step = step


class _PreemptionWatch:
  """SIGTERM -> save at the next step boundary. With several processes, jax's preemption
  sync point makes every host stop at the same step."""

  def __init__(self):
    self.flag = False
    self.previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self.previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    self.flag = True

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return self.flag

  def close(self):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)


def train(model_cfg: ModelConfig, train_cfg, schedule: Schedule, batch_fn, workdir: str, name: str = "train",
          init_params_tree=None, model_meta=None, run_fields=None, restore_only: bool = False) -> Dict[str, Any]:
  """Runs (or resumes) training; returns {'params', 'history', 'steps', 'seconds', 'phases'}.

  train_cfg: a fot_jax.settings.TrainSettings, or a dict of its fields (read by its from_dict):
  steps, optim, seed, loss_on, accum_steps, log_every, checkpoint_every, tensorboard, init_from
  (resuming from the workdir's own checkpoints wins over it), mesh, crossbatch_scope, trainable.
  batch_fn(step) -> this host's rows: inputs/targets/loss_mask [B_host, T], in packs of
  schedule.pack; the global batch is the hosts' rows in process order. A batch_fn with
  state_dict()/load_state_dict() has its state checkpointed and restored. When the
  schedule's phases name data tasks, batch_fn is a mapping {task: batch function} and each
  step draws from its phase's task; a schedule with `stop_after_last` ends the run (with a
  checkpoint) when its last phase ends, before `steps`.
  A SIGTERM saves a checkpoint at the next step boundary and raises Preempted (exit 0);
  the same call resumes from it. After a kill -9 the same call resumes from the last finished
  checkpoint: unfinished writes are deleted, metrics.jsonl and TensorBoard cut back to it
  (MetricsLog). model_meta: more fields for the workdir's fot_jax_model.json
  (e.g. the vocabulary trained with, which evaluation then uses; `window`, the local window
  evaluation uses, defaults to the first step's row length, which a warm-up phase with its own
  window does not share with the run).
  The workdir records the run's fingerprint (run_fingerprint: the model, optimiser, train config
  and curriculum, with the caller's `run_fields` such as the data settings) at the first start;
  a resume whose run-defining fields differ (RESUMABLE_FIELDS may change) is refused naming them.
  restore_only: restore the latest checkpoint and train nothing (evaluation); a workdir with no
  restorable step raises NoCheckpoint, a step that does not restore a ValueError naming it.
  """
  ts = TrainSettings.from_dict(train_cfg)
  steps, accum = ts.steps, ts.accum_steps
  optimizer = make_optimizer(ts.optim)
  feeds = _batch_sources(schedule, batch_fn)
  mesh, rules = parallel.make_mesh(ts.mesh), parallel.rules_from_config(ts.mesh)
  groups = parallel.batch_shards(mesh, rules) if ts.crossbatch_scope == "device" else 1
  trainable = resolve_trainable(ts.trainable, model_cfg)
  n_train, n_total = count_trainable(model_cfg, trainable)
  _print(f"[{name}] trainable: {n_train:,} of {n_total:,} parameters ({100 * n_train / n_total:.2f}%)"
         + (f": {', '.join(trainable.patterns)}" if trainable else ""))
  abstract, shardings = state_shardings(model_cfg, optimizer, mesh, rules, trainable)
  ckpt_dir = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if restore_only and not os.path.isdir(ckpt_dir):  # the manager would create it
    raise NoCheckpoint(f"{ckpt_dir}: no checkpoint to restore ({describe_folder(ckpt_dir)})")
  unfinished = [] if restore_only else unfinished_writes(ckpt_dir)
  if unfinished:
    _print(f"[{name}] deleting {len(unfinished)} unfinished checkpoint write(s), cut by a crash: "
           f"{', '.join(unfinished)}")
  with orbax_logs_off():
    manager = checkpoint_manager(workdir, clear_unfinished=not restore_only)
  try:
    latest = manager.latest_step()
    if restore_only and latest is None:
      raise NoCheckpoint(f"{ckpt_dir}: no restorable checkpoint step ({describe_folder(ckpt_dir)})")
    # before anything is restored: a changed model fails here by name, not as a shape error
    check_run_fingerprint(workdir, run_fingerprint(model_cfg, ts, schedule, run_fields),
                          resuming=latest is not None, write=not restore_only, step=latest or 0)
    if init_params_tree is None and ts.init_from and latest is None:
      init_params_tree = params_from_checkpoint(ts.init_from, model_cfg)
    start = 0
    carry, carry_phase = None, None  # recurrent memory (fot_jax/recurrent.py) and the phase it belongs to
    if latest is not None:
      start = latest
      target = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      abstract, shardings)
      carry_target = saved_carry_target(start, ckpt_dir, mesh, rules)
      restored = restore_step(manager, start, target, ckpt_dir, carry_target)
      state = restored["state"]
      if carry_target is not None:
        carry = {name: tuple(c) for name, c in restored["carry"].items()}
        carry_phase = restored["extra"]["carry_phase"]
      schedule.load_state_dict(restored["extra"]["schedule"])
      _restore_data(restored["extra"], feeds)
      _print(f"[{name}] resumed from step {start}")
    else:
      state = init_state(model_cfg, optimizer, ts.seed, mesh, rules, init_params_tree,
                         trainable)
  except BaseException:
    manager.close()
    raise
  if restore_only:
    steps = start
  step_fn = make_train_step(model_cfg, optimizer, accum, mesh, rules, trainable)
  far = None  # train.memory: the long memory every row reads (fot_jax/train/far_memory.py)
  if ts.memory is not None:
    if not any(hasattr(f, "memory_tokens") for f in feeds.values()):
      raise ValueError("train.memory: no batch source makes a memory haystack (a data.retrieval view with "
                       "memory_tokens > 0)")
    far = FarMemory(model_cfg, ts.memory, lambda blocks: jax.device_put(blocks, parallel.replicated(mesh)))
    step_with_memory = make_train_step(model_cfg, optimizer, accum, mesh, rules, trainable,
                                       memory_topk=ts.memory.topk)
  recurrent_steps = {}  # RecurrentSpec -> its step function
  batch_sharding = parallel.batch_sharding(mesh, rules)
  log = MetricsLog(workdir, name, ts.tensorboard and not restore_only, None if restore_only else start)
  log_every, ckpt_every = ts.log_every, ts.checkpoint_every
  history = []
  watch = _PreemptionWatch()
  t0, tokens_seen = time.time(), 0
  try:
    for step in range(start, steps):
      if schedule.finished(step):
        break
      spec, phase = schedule.spec(step), schedule.phase_index(step)
      pack = crossbatch.pack_size(spec)
      rspec = recurrent_lib.recurrent_spec(spec)
      batch = feeds[schedule.task(step)](schedule.task_step(step))  # each task's batches in order
      rows, seq = batch["inputs"].shape
      if rows % pack:
        raise ValueError(f"batch: {rows} rows on this host are not whole packs of {pack}")
      global_rows = rows * jax.process_count()
      if global_rows % (pack * accum):
        raise ValueError(f"train.accum_steps={accum}: batch of {global_rows} rows does not split into "
                         f"{accum} groups of whole packs of {pack}")
      parallel.check_batch_rows(global_rows // accum, mesh, rules, f"batch (per accumulation group of {accum})")
      scored = crossbatch.scored_rows(rows, pack, ts.loss_on)
      batch = dict(batch, loss_mask=batch["loss_mask"] & scored[:, None])
      if "accuracy_mask" in batch:
        batch["accuracy_mask"] = batch["accuracy_mask"] & scored[:, None]
      if step == start and jax.process_index() == 0:  # lets export_hf / from_pretrained read this workdir
        checkpoint.write_model_json(workdir, model_cfg, **{"window": seq, **(model_meta or {})})
      if rspec is not None and far is not None:
        raise ValueError("train.memory: not with a Memorizing Transformer / Transformer-XL phase (a carry is "
                         "their memory)")
      if rspec is not None:  # the Memorizing Transformer / Transformer-XL: a carry instead of a plan
        if carry is None or carry_phase != phase:  # a new phase starts with empty memory
          carry = _new_carry(model_cfg, rspec, global_rows // pack, seq, mesh, rules)
          carry_phase = phase
        if rspec not in recurrent_steps:
          recurrent_steps[rspec] = make_train_step(model_cfg, optimizer, accum, mesh, rules, trainable, rspec)
        batch = dict(batch, doc_ids=recurrent_lib.step_doc_ids(batch, step, pack).astype(np.int32))
        state, metrics, carry = recurrent_steps[rspec](state, parallel.global_batch(batch, batch_sharding), carry)
      else:
        carry = carry_phase = None
        sources, positive = stacked_plan(spec, global_rows, accum, groups)
        args = (state, parallel.global_batch(batch, batch_sharding), parallel.global_replicated(sources, mesh),
                parallel.global_replicated(positive, mesh))
        widths = crossbatch.pack_widths(sources, pack)
        memories = None if far is None else far.for_step(step, state.params, feeds[schedule.task(step)], name)
        if memories is None:  # (a phase whose data makes no memory haystack trains without one)
          state, metrics = step_fn(*args, widths)
        else:
          state, metrics = step_with_memory(*args, memories, widths)
      metrics = {k: float(v) for k, v in metrics.items()}
      schedule.observe(step, metrics)
      tokens_seen += global_rows * seq
      record = dict(metrics, phase=float(phase), **{k: float(v) for k, v in spec.items() if k in ("d", "w")})
      if far is not None:  # train.memory: writes so far and their seconds (metrics.jsonl, TensorBoard)
        record.update(memory_read=float(memories is not None), memory_writes=float(far.writes),
                      memory_write_seconds=far.seconds)
      history.append({"step": step + 1, **record})
      if (step + 1) % log_every == 0 or step + 1 == steps:
        elapsed = time.time() - t0
        tps = tokens_seen / max(elapsed, 1e-9)
        eta = elapsed / (step + 1 - start) * (steps - step - 1)
        log.write(step + 1, dict(record, tokens_per_second=tps))
        rd = f" r_d {metrics['rd']:.3f}" if np.isfinite(metrics["rd"]) else ""
        bound = " (at most: the curriculum may end sooner)" if schedule.stop_after_last else ""
        where = f"{schedule.phase(step).get('name', f'phase {phase}')} " if len(schedule.phases) > 1 else ""
        answers = f" answers {metrics['answer_accuracy']:.3f}" if "accuracy_mask" in batch else ""
        _print(f"[{name}] step {step + 1}/{steps} loss {metrics['loss']:.4f} acc {metrics['accuracy']:.3f}"
               f"{answers}{rd} {where}spec {spec} | {tps:,.0f} tok/s | ETA {eta:.0f}s{bound}")
      if schedule.phase_index(step + 1) != phase and step + 1 < steps:
        _print(f"[{name}] step {step + 1}: {schedule.phase(step + 1).get('name', 'next phase')} begins "
               f"(task {schedule.task(step + 1)}, spec {schedule.spec(step + 1)})")
      done = schedule.finished(step + 1)
      if done:
        _print(f"[{name}] the curriculum's last phase ended at step {step + 1}: training stops")
      preempted = watch.reached(step + 1)
      if (ckpt_every and (step + 1) % ckpt_every == 0) or step + 1 == steps or preempted or done:
        items = {"state": ocp.args.StandardSave(state)}
        extra = _extra_state(schedule, feeds)
        if carry is not None:  # a resumed run's memory is the one it stopped with
          items["carry"] = ocp.args.StandardSave(carry)
          extra["carry_phase"] = int(carry_phase)
        manager.save(step + 1, args=ocp.args.Composite(extra=ocp.args.JsonSave(extra), **items))
      if preempted and step + 1 < steps:
        manager.wait_until_finished()
        _print(f"[{name}] SIGTERM: saved step {step + 1}; the same command resumes from it")
        raise Preempted(step + 1)
  finally:
    watch.close()
    manager.wait_until_finished()
    manager.close()
  return {"params": state.params, "history": history, "steps": steps, "seconds": time.time() - t0,
          "trainable_params": n_train, "memory_writes": far.writes if far else 0,
          "memory_write_seconds": far.seconds if far else 0.0,
          "phases": schedule.summary() if schedule.phases else []}


def _print(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)
