"""Train state, FoT train step, training loop, checkpoints and metrics."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import traverse_util

from fot_jax import checkpoint, crossbatch, jsonio, parallel
from fot_jax import recurrent as recurrent_lib
from fot_jax.curriculum import Schedule
from fot_jax.model import context_parallel as cp
from fot_jax.model.config import ModelConfig
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel, weights_in_compute_dtype
from fot_jax.recurrent import RecurrentSpec


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def make_optimizer(opt) -> optax.GradientTransformation:
  """opt: lr, warmup_steps, schedule ('constant'|'cosine'), total_steps, weight_decay, clip_norm, b1, b2."""
  warmup = int(opt.get("warmup_steps", 0))
  lr = float(opt["lr"])
  kind = opt.get("schedule", "constant")
  if kind == "constant":
    sched = optax.join_schedules([optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr)],
                                 [max(warmup, 1)]) if warmup else optax.constant_schedule(lr)
  elif kind == "cosine":
    warm = max(warmup, 1)  # optax needs a warmup of at least one step and a decay after it
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(int(opt["total_steps"]), warm + 1),
                                               end_value=lr * float(opt.get("final_lr_fraction", 0.1)))
  else:
    raise ValueError(f"optim.schedule: must be 'constant' or 'cosine', got {kind!r}")
  chain = []
  if opt.get("clip_norm"):
    chain.append(optax.clip_by_global_norm(float(opt["clip_norm"])))
  chain.append(optax.adamw(sched, b1=float(opt.get("b1", 0.9)), b2=float(opt.get("b2", 0.95)),
                           weight_decay=float(opt.get("weight_decay", 0.0))))
  return optax.chain(*chain)


# `train.trainable` names for groups that depend on the model config (expanded to regexes).
TRAINABLE_GROUPS = {
    "memory_attention": "the attention (q/k/v/o and any memory-only parameters) of the memory layers",
    "memory_layers": "every parameter of the memory layers (attention, MLP, norms)",
}


@dataclasses.dataclass(frozen=True)
class Trainable:
  """The parameters a run updates: regexes, each fully matching '/'-joined parameter paths
  ('layers_8/self_attn/q_proj/kernel'). Frozen parameters get no gradient (the step
  differentiates the trainable subtree only, so no weight gradients and no backward pass below
  the lowest trainable layer), no optimizer state and no update: they stay bit-identical."""
  patterns: Tuple[str, ...]

  def matches(self, path: str) -> bool:
    return any(re.fullmatch(p, path) for p in self.patterns)

  def select(self, tree):
    """The trainable leaves of a parameter tree (boxed or not), as a nested dict."""
    flat = traverse_util.flatten_dict(tree, sep="/")
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if self.matches(k)}, sep="/")

  def merge(self, full, sub):
    """`full` with the trainable leaves taken from `sub` (same structure as `full`)."""
    flat = traverse_util.flatten_dict(full, sep="/")
    flat.update(traverse_util.flatten_dict(sub, sep="/"))
    return traverse_util.unflatten_dict(flat, sep="/")


def _select(trainable: Optional[Trainable], tree):
  return tree if trainable is None else trainable.select(tree)


def _merge(trainable: Optional[Trainable], full, sub):
  return sub if trainable is None else trainable.merge(full, sub)


@functools.lru_cache(maxsize=8)  # one trace of the model's init per config: resolve + count at start-up
def parameter_paths(cfg: ModelConfig) -> Dict[str, int]:
  """{'/'-joined parameter path: size} of a model config (abstract: nothing is allocated; callers
  must not mutate the returned dict, which is shared)."""
  shapes = jax.eval_shape(lambda: init_params(cfg, 0))
  return {k: math.prod(v.shape) for k, v in traverse_util.flatten_dict(shapes, sep="/").items()}


def resolve_trainable(spec, cfg: ModelConfig, field: str = "train.trainable") -> Optional[Trainable]:
  """`train.trainable` -> Trainable, or None (every parameter trains). spec: None, 'all', or a
  string / list of regexes over parameter paths and group names (TRAINABLE_GROUPS). A pattern
  that matches no parameter is an error naming it."""
  if spec is None or spec == "all" or (not isinstance(spec, str) and len(spec) == 0):
    return None
  items = [spec] if isinstance(spec, str) else [str(x) for x in spec]
  layers = "|".join(str(i) for i in cfg.mem_layers)
  patterns = []
  for item in items:
    if item == "all":
      return None
    if item in TRAINABLE_GROUPS:
      if not cfg.mem_layers:
        raise ValueError(f"{field}: {item!r} needs memory layers (model.mem_layers is empty)")
      item = f"layers_({layers})/self_attn/.*" if item == "memory_attention" else f"layers_({layers})/.*"
    try:
      re.compile(item)
    except re.error as e:
      raise ValueError(f"{field}: {item!r} is not a regular expression ({e})") from None
    patterns.append(item)
  paths = parameter_paths(cfg)
  for p, item in zip(patterns, items):
    if not any(re.fullmatch(p, k) for k in paths):
      raise ValueError(f"{field}: {item!r} matches no parameter (paths look like "
                       f"{sorted(paths)[:3]}...; groups: {sorted(TRAINABLE_GROUPS)})")
  return Trainable(tuple(patterns))


def count_trainable(cfg: ModelConfig, trainable: Optional[Trainable]) -> Tuple[int, int]:
  """(trainable parameters, all parameters) of a model config."""
  paths = parameter_paths(cfg)
  total = sum(paths.values())
  return (total if trainable is None else sum(n for k, n in paths.items() if trainable.matches(k))), total


def state_shardings(cfg: ModelConfig, optimizer, mesh, rules, trainable: Optional[Trainable] = None):
  """(abstract TrainState, its NamedShardings), from the parameters' logical axis names.

  Nothing is allocated (eval_shape); the optimizer state inherits the boxes of the
  parameters it mirrors (the trainable ones only). Fails before tracing if a dimension does
  not split over its axes.
  """
  def boxed_state():
    params = init_params(cfg, 0, boxed=True)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(_select(trainable, params)))

  boxed = jax.eval_shape(boxed_state)
  specs = parallel.to_mesh_specs(nn.get_partition_spec(boxed), rules)
  abstract = nn.meta.unbox(boxed)
  parallel.check_divisible(abstract, specs, mesh, "model parameter")
  return abstract, parallel.shardings_from_specs(specs, mesh)


def init_state(cfg: ModelConfig, optimizer, seed: int, mesh, rules, params=None,
               trainable: Optional[Trainable] = None) -> TrainState:
  """A TrainState created directly in its shardings (jitted init with out_shardings)."""
  _, shardings = state_shardings(cfg, optimizer, mesh, rules, trainable)
  if params is None:
    def fresh():
      p = init_params(cfg, seed)
      return TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(_select(trainable, p)))
    return jax.jit(fresh, out_shardings=shardings)()
  params = jax.device_put(params, shardings.params)
  return jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(_select(trainable, p))),
                 out_shardings=shardings)(params)


def lm_loss_sums(logits, targets, mask):
  """(sum of token losses, sum of correct tokens, count) over the masked tokens."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(correct * mask), jnp.sum(mask)


def make_train_step(cfg: ModelConfig, optimizer, accum_steps: int = 1, mesh=None, rules=None,
                    trainable: Optional[Trainable] = None, recurrent: Optional[RecurrentSpec] = None):
  """Returns step(state, batch, sources, positive, widths=None) -> (state, metrics), jitted over `mesh`.

  batch: inputs/targets [B, T] int32, loss_mask [B, T] bool (already restricted
  to scored rows); optional accuracy_mask [B, T]: the tokens the `accuracy` metric
  counts (default: loss_mask). With accum_steps > 1 the batch is split into consecutive
  groups of whole packs and the plan arrays hold one plan per group
  ([accum, B/accum, N], indices local to the group; or [accum, G, B/(accum G), N] with
  G crossbatch groups, see stacked_plan). widths (static, a tuple: crossbatch.pack_widths of
  the plan) lets each pack position's rows attend to only their own extra contexts; None
  makes every row attend to all N plan columns (masked), with the same result.

  recurrent (a fot_jax.recurrent.RecurrentSpec: the Memorizing Transformer / Transformer-XL
  baselines) instead returns step(state, batch, carry) -> (state, metrics, carry): no plan; each
  slot's `recurrent.windows` rows run in order and `carry` (recurrent.init_carry: per slot, split
  over the batch axes like the rows) is what the last window left; batch['doc_ids'] [B, T] int32
  is required (recurrent.step_doc_ids).

  trainable: only those parameters are differentiated and updated (the optimizer state holds
  them alone: init it with `trainable.select(params)`); None: all.

  State shardings come from the logical-axis `rules` (default parallel.DEFAULT_RULES),
  the batch is split over the batch axes, plans and metrics are replicated; the state is
  donated. mesh=None: one device.
  """
  model = LlamaModel(cfg)
  rules = parallel.DEFAULT_RULES if rules is None else rules
  if mesh is None:
    mesh = parallel.make_mesh(None, devices=jax.devices()[:1])

  context = cp.context_size(mesh)

  def micro_sums(train_params, all_params, inputs, targets, mask, acc_mask, sources, positive, widths):
    params = _merge(trainable, all_params, train_params)  # frozen leaves enter as constants
    params = weights_in_compute_dtype(params, cfg.dtype, state_sh.params)
    plan = None
    if sources.shape[-1]:
      plan = (sources, positive) if widths is None else (sources, positive, widths)
    positions = None
    if context > 1:  # the window split over `context`: tokens in the layout's order (losses are sums)
      perm = cp.permutation(inputs.shape[1], context, cfg.context_layout)
      inputs, targets, mask, acc_mask = (cp.to_layout(x, perm) for x in (inputs, targets, mask, acc_mask))
      positions = jnp.broadcast_to(jnp.asarray(perm), inputs.shape)
    logits, aux = model.apply({"params": params}, inputs, positions=positions, plan=plan)
    loss_sum, _, count = lm_loss_sums(logits, targets, mask)
    _, correct, acc_count = lm_loss_sums(jax.lax.stop_gradient(logits), targets, acc_mask)
    return loss_sum, (correct, acc_count, count, aux["rd_num"], aux["rd_den"], None)

  def micro_recurrent(train_params, all_params, inputs, targets, mask, acc_mask, doc, carry, widths):
    del widths
    params = _merge(trainable, all_params, train_params)
    params = weights_in_compute_dtype(params, cfg.dtype, state_sh.params)
    (loss_sum, correct, acc_count, count), carry = recurrent_lib.recurrent_sums(
        model, params, recurrent, lm_loss_sums, inputs, targets, mask, acc_mask, doc, carry)
    zero = jnp.zeros((), jnp.float32)
    return loss_sum, (correct, acc_count, count, zero, zero, carry)

  shards = parallel.batch_shards(mesh, rules)

  def split(x):  # [B, ...] -> [accum, B/accum, ...]: each group is spread over all batch shards again
    x = x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:])
    return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))

  def step(state: TrainState, batch, sources, positive, widths=None):
    rows = batch["inputs"].shape[0] // accum_steps
    if widths is not None and (rows % shards or (rows // shards) % len(widths)):
      # Grouping rows by pack position regroups them across batch shards when a shard does not
      # hold whole packs (LongLLaMA-3B: 1 row per fsdp shard): GSPMD then replicates the groups
      # (measured: 67.10 GiB per device against 33.25 padded). The padded path is the same result.
      widths = None
    with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      acc_mask = batch.get("accuracy_mask", batch["loss_mask"])
      xs = tuple(split(batch[f]) for f in ("inputs", "targets", "loss_mask")) + (split(acc_mask), sources, positive)
      state, metrics, _ = step_body(state, micro_sums, xs, widths)
      return state, metrics

  def step_recurrent(state: TrainState, batch, carry):
    with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      acc_mask = batch.get("accuracy_mask", batch["loss_mask"])
      xs = tuple(split(batch[f]) for f in ("inputs", "targets", "loss_mask")) + (
          split(acc_mask), split(batch["doc_ids"]), jax.tree_util.tree_map(split, carry))
      state, metrics, carries = step_body(state, micro_recurrent, xs, None)
      return state, metrics, jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), carries)

  def step_body(state: TrainState, micro, xs, widths):
    """Gradients summed over the accumulation groups xs (leading axis accum) -> (state, metrics,
    the groups' stacked outputs: the recurrent carry, or None)."""
    grad_fn = jax.value_and_grad(micro, has_aux=True)
    train_params = _select(trainable, state.params)

    def body(carry, x):
      grads, sums = carry
      (loss_sum, rest), g = grad_fn(train_params, state.params, *x, widths)
      grads = jax.tree_util.tree_map(jnp.add, grads, g)
      sums = sums + jnp.stack([loss_sum, *rest[:-1]])
      return (grads, sums), rest[-1]

    zeros = jax.tree_util.tree_map(jnp.zeros_like, train_params)
    (grads, sums), outs = jax.lax.scan(body, (zeros, jnp.zeros(6, jnp.float32)), xs)
    loss_sum, correct, acc_count, count, rd_num, rd_den = sums
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, train_params)
    params = _merge(trainable, state.params, optax.apply_updates(train_params, updates))
    metrics = {"loss": loss_sum / denom, "accuracy": correct / jnp.maximum(acc_count, 1.0),
               "tokens_scored": count,
               "rd": jnp.where(rd_den > 0, rd_num / jnp.maximum(rd_den, 1.0), jnp.nan),
               "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.step + 1, params, opt_state), metrics, outs

  _, state_sh = state_shardings(cfg, optimizer, mesh, rules, trainable)
  rep = parallel.replicated(mesh)
  batch_sh = parallel.batch_sharding(mesh, rules)
  if recurrent is not None:
    return jax.jit(step_recurrent, in_shardings=(state_sh, batch_sh, batch_sh),
                   out_shardings=(state_sh, rep, batch_sh), donate_argnums=(0, 2))
  return jax.jit(step, in_shardings=(state_sh, batch_sh, rep, rep),
                 out_shardings=(state_sh, rep), donate_argnums=(0,), static_argnums=(4,))


def stacked_plan(spec, batch_rows: int, accum_steps: int, groups: int = 1):
  """One plan per gradient-accumulation group, stacked: [accum, rows/accum, N].

  groups > 1 splits each accumulation group further into `groups` consecutive blocks
  that only see each other's rows ([accum, groups, rows/(accum groups), N]); with
  groups = the batch shards, negatives never cross devices.
  """
  micro = batch_rows // accum_steps
  if micro % groups:
    raise ValueError(f"train.crossbatch_scope='device': {micro} rows per accumulation group do not split "
                     f"into {groups} device groups")
  plan = crossbatch.plan_from_spec(micro // groups, spec)
  lead = (accum_steps,) if groups == 1 else (accum_steps, groups)
  return (np.broadcast_to(plan.sources, lead + plan.sources.shape).copy(),
          np.broadcast_to(plan.positive, lead + plan.positive.shape).copy())


class MetricsLog:
  """metrics.jsonl + TensorBoard scalars in the workdir (process 0 only)."""

  def __init__(self, workdir: str, name: str = "", tensorboard: bool = True):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.writer = None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
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


def _checkpoint_manager(workdir: str, keep: int = 2):
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def params_from_checkpoint(path: str, model_cfg: ModelConfig):
  """`train.init_from`: the parameters of an fot_jax checkpoint (import_hf output or a training
  workdir), checked against model_cfg; the caller starts a fresh optimizer state."""
  try:
    ck = checkpoint.load(path)
    checkpoint.check_params(ck.params, model_cfg, path)
  except checkpoint.ConvertError as e:
    raise ValueError(f"train.init_from: {e}") from None
  # Positions and the norm's epsilon leave no trace in parameter shapes: a run with another RoPE
  # or epsilon would train silently wrong (GGUF stores the epsilon as float32: compared loosely).
  for field in ("rope_theta", "rope_scaling", "rms_norm_eps"):
    have, want = getattr(ck.cfg, field), getattr(model_cfg, field)
    if have != want and not (field == "rms_norm_eps" and math.isclose(have, want, rel_tol=1e-6)):
      raise ValueError(f"train.init_from: {path} was trained with {field}={have!r}, the model config has "
                       f"{want!r}; set model.overrides.{field} to the checkpoint's")
  return ck.params


# -- the run's fingerprint: a workdir resumes only the run it was started for --------------------
RUN_FINGERPRINT = "run_fingerprint.json"

# Fields that may change when a workdir resumes: the run's length, bookkeeping, and how a step is
# computed (the same mathematics on another layout or implementation). Every other field of the
# fingerprint (run_fingerprint) defines the run; a resume with another value is refused.
RESUMABLE_FIELDS = {
    "train.steps": "the run's length: raise it to extend a run (a cosine schedule keeps optim.total_steps)",
    "train.log_every": "logging cadence",
    "train.checkpoint_every": "checkpoint cadence",
    "train.tensorboard": "TensorBoard scalars on or off",
    "train.mesh": "device mesh sizes and rules (orbax restores into the new shardings)",
    "model.remat": "rematerialisation (the same gradients, less memory)",
    "model.remat_policy": "what rematerialisation saves (the same gradients)",
    "model.scan_layers": "layers run as a scan (the same parameters and gradients)",
    "model.attention_impl": "the score/softmax implementation (the same attention)",
    "model.attention_block": "the blockwise implementation's key block",
    "model.context_parallel": "the sequence-parallel attention strategy",
    "model.context_layout": "the tokens' layout over the context axis",
    "data.eval_task": "held-out documents of the evaluation (LM runs)",
    "data.eval_split": "held-out split of the evaluation (LM runs)",
}


def _plain_json(x):
  """x as JSON would give it back (tuples -> lists, ConfigDicts -> dicts, numpy scalars -> numbers)."""
  def default(o):
    if hasattr(o, "to_dict"):
      return o.to_dict()
    if isinstance(o, np.generic):
      return o.item()
    if dataclasses.is_dataclass(o):
      return dataclasses.asdict(o)
    return str(o)
  return json.loads(json.dumps(x, default=default))


def run_fingerprint(model_cfg: ModelConfig, train_cfg, schedule: Schedule, run_fields=None) -> dict:
  """The fields that define a run, in groups: model (every ModelConfig field), optim, train (the
  train config but optim), curriculum (the schedule's config), and the caller's `run_fields`
  (the data settings; a group given there replaces the derived one of that name)."""
  tc = dict(train_cfg)
  groups = {"model": dataclasses.asdict(model_cfg), "optim": tc.pop("optim", {}), "train": tc,
            "curriculum": schedule.cfg}
  groups.update(run_fields or {})
  return _plain_json(groups)


_UNSET = "(unset)"


def _leaf_differences(old, new, path):
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for k in sorted(set(old) | set(new)):
      out += _leaf_differences(old.get(k, _UNSET), new.get(k, _UNSET), f"{path}.{k}")
    return out
  if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
    return [d for i, (a, b) in enumerate(zip(old, new)) for d in _leaf_differences(a, b, f"{path}[{i}]")]
  return [] if old == new else [(path, old, new)]


def fingerprint_differences(old: dict, new: dict):
  """[(field, old value, new value)] of the run-defining fields that differ (RESUMABLE_FIELDS
  left out). A field the old fingerprint lacks (newer code) counts only if its new value is
  not its default (empty, or ModelConfig's default); a field the new one lacks is not compared."""
  defaults = _plain_json({f.name: f.default for f in dataclasses.fields(ModelConfig)})
  out = []
  for group in sorted(new):
    old_g, new_g = old.get(group, {}), new[group]
    if not isinstance(old_g, dict) or not isinstance(new_g, dict):
      out += _leaf_differences(old_g, new_g, group)
      continue
    for field in sorted(new_g):
      name = f"{group}.{field}"
      if name in RESUMABLE_FIELDS:
        continue
      if field not in old_g:  # recorded by older code: a new field at its default changes nothing
        value = new_g[field]
        if value is None or value is False or value in ("", [], {}):
          continue
        if group == "model" and defaults.get(field, _UNSET) == value:
          continue
      out += _leaf_differences(old_g.get(field, _UNSET), new_g[field], name)
  return out


def _short(value, limit: int = 60) -> str:
  text = value if value == _UNSET else json.dumps(value, separators=(",", ":"))
  return text if len(text) <= limit else text[:limit - 3] + "..."


def check_run_fingerprint(workdir: str, fingerprint: dict, resuming: bool, write: bool = True,
                          step: int = 0) -> None:
  """Resuming: the workdir's recorded fingerprint must match `fingerprint` (one ValueError naming
  every differing field, old -> new); a workdir written before fingerprints records this one.
  A fresh start records it. Only process 0 writes."""
  path = os.path.join(workdir, RUN_FINGERPRINT)
  if resuming and os.path.exists(path):
    recorded = jsonio.read_json(path, "run fingerprint")
    diffs = fingerprint_differences(recorded.get("run", {}) if isinstance(recorded, dict) else {}, fingerprint)
    if diffs:
      changes = "; ".join(f"{f}: {_short(a)} -> {_short(b)}" for f, a, b in diffs)
      raise ValueError(f"{workdir} holds a run started with other settings, and resuming it with these would "
                       f"mix two runs: {changes}. Restore those settings, use another workdir, or delete {path} "
                       f"to continue this run with the new ones on purpose")
    return
  if write and jax.process_index() == 0:
    jsonio.write_json(path, {"run": fingerprint, "recorded_at_step": int(step),
                             "resumable": sorted(RESUMABLE_FIELDS)})


class NoCheckpoint(FileNotFoundError):
  """A workdir to restore (evaluation) that holds no restorable checkpoint step."""


def _describe_folder(path: str) -> str:
  if not os.path.isdir(path):
    return "the folder does not exist"
  entries = sorted(os.listdir(path))
  if not entries:
    return "the folder is empty"
  return f"it holds only {', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}"


@contextlib.contextmanager
def _orbax_logs_off():
  """No absl log lines while orbax opens or restores checkpoints: a damaged step's metadata is
  logged as an ERROR before the failure that train() reports as one line naming the step."""
  from absl import logging as absl_logging
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.FATAL)
  try:
    yield
  finally:
    absl_logging.set_verbosity(verbosity)


def _quiet_closed_loop_callbacks():
  """When a restore fails, tensorstore's reads still in flight post their results to orbax's
  closed event loop, each printing a 'RuntimeError: Event loop is closed' traceback (an
  unraisable exception) around the one-line error, during the restore and after it; those alone
  are dropped. Returns the previous sys.unraisablehook."""
  previous = sys.unraisablehook
  if getattr(previous, "_fot_jax_quiet", False):
    return previous

  def hook(unraisable):
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
      return
    previous(unraisable)
  hook._fot_jax_quiet = True
  sys.unraisablehook = hook
  return previous


def _new_carry(cfg: ModelConfig, rspec: RecurrentSpec, slots: int, window: int, mesh, rules):
  """An empty recurrent carry for the global batch's slots, created in the batch's sharding."""
  parallel.check_batch_rows(slots, mesh, rules, "recurrent memory (one carry row per slot)")
  return jax.jit(lambda: recurrent_lib.init_carry(cfg, rspec, slots, window),
                 out_shardings=parallel.batch_sharding(mesh, rules))()


def _carry_target(step: int, ckpt_dir: str, mesh, rules):
  """The abstract recurrent carry saved with `step`, from the saved arrays' metadata, in the
  batch's sharding; None when that step has none."""
  folder = os.path.join(ckpt_dir, str(step), "carry")
  if not os.path.isdir(folder):
    return None
  with _orbax_logs_off():
    meta = ocp.StandardCheckpointer().metadata(folder)
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  sharding = parallel.batch_sharding(mesh, rules)
  return jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding),
                                dict(tree), is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def _restore(manager, step: int, target, ckpt_dir: str, carry_target=None):
  """The train state and extra JSON of `step` (and the recurrent carry, given its target); a step
  that does not restore (files truncated or deleted) is a ValueError naming its folder."""
  previous_hook = _quiet_closed_loop_callbacks()
  items = {} if carry_target is None else {"carry": ocp.args.StandardRestore(carry_target)}
  try:
    with _orbax_logs_off():  # orbax logs a damaged file's error before raising it
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore(), **items))
    sys.unraisablehook = previous_hook  # restored: nothing is left in flight
    return restored
  except Exception as e:  # orbax raises KeyError, ValueError, JSONDecodeError... for a damaged step
    earlier = [s for s in manager.all_steps() if s < step]
    hint = (f"delete that folder to resume from step {max(earlier)}" if earlier else
            "delete that folder to start again")
    cause = " ".join(str(e).split())[:300]
    raise ValueError(f"checkpoint {os.path.join(ckpt_dir, str(step))} does not restore "
                     f"({type(e).__name__}: {cause}); {hint}") from e


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

  train_cfg: steps, seed, loss_on ('all'|'last'), accum_steps, log_every,
  checkpoint_every, optim (see make_optimizer), init_from (fot_jax checkpoint to start from;
  resuming from workdir's own checkpoints wins over it), tensorboard (default True); mesh
  (parallel.make_mesh sizes and rules; default: data parallel over all devices);
  crossbatch_scope ('batch': negatives from any row of the global batch, 'device': only
  rows on the same device); trainable (resolve_trainable: regexes over parameter paths or
  'memory_attention' / 'memory_layers'; default all).
  batch_fn(step) -> this host's rows: inputs/targets/loss_mask [B_host, T], in packs of
  schedule.pack; the global batch is the hosts' rows in process order. A batch_fn with
  state_dict()/load_state_dict() has its state checkpointed and restored. When the
  schedule's phases name data tasks, batch_fn is a mapping {task: batch function} and each
  step draws from its phase's task; a schedule with `stop_after_last` ends the run (with a
  checkpoint) when its last phase ends, before `steps`.
  A SIGTERM saves a checkpoint at the next step boundary and raises Preempted (exit 0);
  the same call resumes from it. model_meta: more fields for the workdir's fot_jax_model.json
  (e.g. the vocabulary trained with, which evaluation then uses; `window`, the local window
  evaluation uses, defaults to the first step's row length, which a warm-up phase with its own
  window does not share with the run).
  The workdir records the run's fingerprint (run_fingerprint: the model, optimiser, train config
  and curriculum, with the caller's `run_fields` such as the data settings) at the first start;
  a resume whose run-defining fields differ (RESUMABLE_FIELDS may change) is refused naming them.
  restore_only: restore the latest checkpoint and train nothing (evaluation); a workdir with no
  restorable step raises NoCheckpoint, a step that does not restore a ValueError naming it.
  """
  steps = int(train_cfg["steps"])
  accum = int(train_cfg.get("accum_steps", 1))
  optimizer = make_optimizer(train_cfg["optim"])
  feeds = _batch_sources(schedule, batch_fn)
  mesh_cfg = train_cfg.get("mesh")
  mesh, rules = parallel.make_mesh(mesh_cfg), parallel.rules_from_config(mesh_cfg)
  scope = train_cfg.get("crossbatch_scope", "batch")
  if scope not in ("batch", "device"):
    raise ValueError(f"train.crossbatch_scope: must be 'batch' or 'device', got {scope!r}")
  groups = parallel.batch_shards(mesh, rules) if scope == "device" else 1
  trainable = resolve_trainable(train_cfg.get("trainable"), model_cfg)
  n_train, n_total = count_trainable(model_cfg, trainable)
  _print(f"[{name}] trainable: {n_train:,} of {n_total:,} parameters ({100 * n_train / n_total:.2f}%)"
         + (f": {', '.join(trainable.patterns)}" if trainable else ""))
  abstract, shardings = state_shardings(model_cfg, optimizer, mesh, rules, trainable)
  ckpt_dir = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if restore_only and not os.path.isdir(ckpt_dir):  # the manager would create it
    raise NoCheckpoint(f"{ckpt_dir}: no checkpoint to restore ({_describe_folder(ckpt_dir)})")
  with _orbax_logs_off():
    manager = _checkpoint_manager(workdir)
  try:
    latest = manager.latest_step()
    if restore_only and latest is None:
      raise NoCheckpoint(f"{ckpt_dir}: no restorable checkpoint step ({_describe_folder(ckpt_dir)})")
    # before anything is restored: a changed model fails here by name, not as a shape error
    check_run_fingerprint(workdir, run_fingerprint(model_cfg, train_cfg, schedule, run_fields),
                          resuming=latest is not None, write=not restore_only, step=latest or 0)
    if init_params_tree is None and train_cfg.get("init_from") and latest is None:
      init_params_tree = params_from_checkpoint(train_cfg["init_from"], model_cfg)
    start = 0
    carry, carry_phase = None, None  # recurrent memory (fot_jax/recurrent.py) and the phase it belongs to
    if latest is not None:
      start = latest
      target = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      abstract, shardings)
      carry_target = _carry_target(start, ckpt_dir, mesh, rules)
      restored = _restore(manager, start, target, ckpt_dir, carry_target)
      state = restored["state"]
      if carry_target is not None:
        carry = {name: tuple(c) for name, c in restored["carry"].items()}
        carry_phase = restored["extra"]["carry_phase"]
      schedule.load_state_dict(restored["extra"]["schedule"])
      _restore_data(restored["extra"], feeds)
      _print(f"[{name}] resumed from step {start}")
    else:
      state = init_state(model_cfg, optimizer, int(train_cfg.get("seed", 0)), mesh, rules, init_params_tree,
                         trainable)
  except BaseException:
    manager.close()
    raise
  if restore_only:
    steps = start
  step_fn = make_train_step(model_cfg, optimizer, accum, mesh, rules, trainable)
  recurrent_steps = {}  # RecurrentSpec -> its step function
  batch_sharding = parallel.batch_sharding(mesh, rules)
  log = MetricsLog(workdir, name, bool(train_cfg.get("tensorboard", True)) and not restore_only)
  log_every = int(train_cfg.get("log_every", 10))
  ckpt_every = int(train_cfg.get("checkpoint_every", 0))
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
      scored = crossbatch.scored_rows(rows, pack, train_cfg.get("loss_on", "all"))
      batch = dict(batch, loss_mask=batch["loss_mask"] & scored[:, None])
      if "accuracy_mask" in batch:
        batch["accuracy_mask"] = batch["accuracy_mask"] & scored[:, None]
      if step == start and jax.process_index() == 0:  # lets export_hf / from_pretrained read this workdir
        checkpoint.write_model_json(workdir, model_cfg, **{"window": seq, **(model_meta or {})})
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
        state, metrics = step_fn(state, parallel.global_batch(batch, batch_sharding),
                                 parallel.global_replicated(sources, mesh), parallel.global_replicated(positive, mesh),
                                 crossbatch.pack_widths(sources, pack))
      metrics = {k: float(v) for k, v in metrics.items()}
      schedule.observe(step, metrics)
      tokens_seen += global_rows * seq
      record = dict(metrics, phase=float(phase), **{k: float(v) for k, v in spec.items() if k in ("d", "w")})
      history.append({"step": step + 1, **record})
      if (step + 1) % log_every == 0 or step + 1 == steps:
        elapsed = time.time() - t0
        tps = tokens_seen / max(elapsed, 1e-9)
        eta = elapsed / (step + 1 - start) * (steps - step - 1)
        log.write(step + 1, dict(record, tokens_per_second=tps))
        rd = f" r_d {metrics['rd']:.3f}" if np.isfinite(metrics["rd"]) else ""
        bound = " (at most: the curriculum may end sooner)" if schedule.stop_after_last else ""
        where = f"{schedule.phase(step).get('name', f'phase {phase}')} " if len(schedule.phases) > 1 else ""
        _print(f"[{name}] step {step + 1}/{steps} loss {metrics['loss']:.4f} acc {metrics['accuracy']:.3f}"
               f"{rd} {where}spec {spec} | {tps:,.0f} tok/s | ETA {eta:.0f}s{bound}")
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
          "trainable_params": n_train,
          "phases": schedule.summary() if schedule.phases else []}


def _print(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)
