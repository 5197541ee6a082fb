"""Train state, FoT train step, training loop, checkpoints and metrics."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from fot_jax import crossbatch
from fot_jax.curriculum import Schedule
from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel


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
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(int(opt["total_steps"]), warmup + 1),
                                               end_value=lr * float(opt.get("final_lr_fraction", 0.1)))
  else:
    raise ValueError(f"optim.schedule: must be 'constant' or 'cosine', got {kind!r}")
  chain = []
  if opt.get("clip_norm"):
    chain.append(optax.clip_by_global_norm(float(opt["clip_norm"])))
  chain.append(optax.adamw(sched, b1=float(opt.get("b1", 0.9)), b2=float(opt.get("b2", 0.95)),
                           weight_decay=float(opt.get("weight_decay", 0.0))))
  return optax.chain(*chain)


def init_params(cfg: ModelConfig, seed: int, seq_len: int = 8):
  model = LlamaModel(cfg)
  variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, seq_len), jnp.int32))
  return nn.meta.unbox(variables)["params"]


def lm_loss_sums(logits, targets, mask):
  """(sum of token losses, sum of correct tokens, count) over the masked tokens."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(correct * mask), jnp.sum(mask)


def make_train_step(cfg: ModelConfig, optimizer, accum_steps: int = 1):
  """Returns step(state, batch, sources, positive) -> (state, metrics).

  batch: inputs/targets [B, T] int32, loss_mask [B, T] bool (already restricted
  to scored rows); optional accuracy_mask [B, T]: the tokens the `accuracy` metric
  counts (default: loss_mask). With accum_steps > 1 the batch is split into consecutive
  groups of whole packs and the plan arrays hold one plan per group
  ([accum, B/accum, N], indices local to the group).
  """
  model = LlamaModel(cfg)

  def micro_sums(params, inputs, targets, mask, acc_mask, sources, positive):
    plan = (sources, positive) if sources.shape[-1] else None
    logits, aux = model.apply({"params": params}, inputs, plan=plan)
    loss_sum, _, count = lm_loss_sums(logits, targets, mask)
    _, correct, acc_count = lm_loss_sums(jax.lax.stop_gradient(logits), targets, acc_mask)
    return loss_sum, (correct, acc_count, count, aux["rd_num"], aux["rd_den"])

  def step(state: TrainState, batch, sources, positive):
    def split(x):
      return x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:])

    acc_mask = batch.get("accuracy_mask", batch["loss_mask"])
    xs = (split(batch["inputs"]), split(batch["targets"]), split(batch["loss_mask"]), split(acc_mask),
          sources, positive)
    grad_fn = jax.value_and_grad(micro_sums, has_aux=True)

    def body(carry, x):
      grads, sums = carry
      (loss_sum, rest), g = grad_fn(state.params, *x)
      grads = jax.tree_util.tree_map(jnp.add, grads, g)
      sums = sums + jnp.stack([loss_sum, *rest])
      return (grads, sums), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    (grads, sums), _ = jax.lax.scan(body, (zeros, jnp.zeros(6, jnp.float32)), xs)
    loss_sum, correct, acc_count, count, rd_num, rd_den = sums
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss_sum / denom, "accuracy": correct / jnp.maximum(acc_count, 1.0),
               "tokens_scored": count,
               "rd": jnp.where(rd_den > 0, rd_num / jnp.maximum(rd_den, 1.0), jnp.nan),
               "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.step + 1, params, opt_state), metrics

  return jax.jit(step, donate_argnums=(0,))


def stacked_plan(spec, batch_rows: int, accum_steps: int):
  """One plan per gradient-accumulation group, stacked: [accum, rows/accum, N]."""
  micro = batch_rows // accum_steps
  plan = crossbatch.plan_from_spec(micro, spec)
  return (np.broadcast_to(plan.sources, (accum_steps,) + plan.sources.shape).copy(),
          np.broadcast_to(plan.positive, (accum_steps,) + plan.positive.shape).copy())


class MetricsLog:
  """metrics.jsonl + TensorBoard scalars in the workdir (process 0 only)."""

  def __init__(self, workdir: str, name: str = ""):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.writer = None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
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
  from fot_jax.convert import checkpoint  # a training run that never imports stays light
  try:
    params = checkpoint.load(path).params
    checkpoint.check_params(params, model_cfg, path)
  except checkpoint.ConvertError as e:
    raise ValueError(f"train.init_from: {e}") from None
  return params


def _extra_state(schedule: Schedule, batch_fn) -> dict:
  """JSON saved next to the train state: the curriculum's state and, when the batch source
  keeps one (a resumable pipeline: `state_dict()` / `load_state_dict()`), its position."""
  extra = {"schedule": schedule.state_dict()}
  if hasattr(batch_fn, "load_state_dict"):
    extra["data"] = batch_fn.state_dict()
  return extra


def train(model_cfg: ModelConfig, train_cfg, schedule: Schedule, batch_fn: Callable[[int], Dict[str, np.ndarray]],
          workdir: str, name: str = "train", init_params_tree=None) -> Dict[str, Any]:
  """Runs (or resumes) training; returns {'params', 'history', 'steps', 'seconds'}.

  train_cfg: steps, seed, loss_on ('all'|'last'), accum_steps, log_every,
  checkpoint_every, optim (see make_optimizer), init_from (fot_jax checkpoint to start from;
  resuming from workdir's own checkpoints wins over it).
  batch_fn(step) -> inputs/targets/loss_mask [B, T]; rows in packs of schedule.pack. A
  batch_fn with state_dict()/load_state_dict() has its state checkpointed and restored.
  """
  steps = int(train_cfg["steps"])
  accum = int(train_cfg.get("accum_steps", 1))
  pack = schedule.pack
  optimizer = make_optimizer(train_cfg["optim"])
  manager = _checkpoint_manager(workdir)
  if init_params_tree is None and train_cfg.get("init_from") and manager.latest_step() is None:
    init_params_tree = params_from_checkpoint(train_cfg["init_from"], model_cfg)
  params = init_params_tree if init_params_tree is not None else init_params(model_cfg, int(train_cfg.get("seed", 0)))
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  start = 0
  if manager.latest_step() is not None:
    start = manager.latest_step()
    restored = manager.restore(start, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(state), extra=ocp.args.JsonRestore()))
    state = restored["state"]
    schedule.load_state_dict(restored["extra"]["schedule"])
    if hasattr(batch_fn, "load_state_dict") and "data" in restored["extra"]:
      batch_fn.load_state_dict(restored["extra"]["data"])  # the data pipeline's position
    print(f"[{name}] resumed from step {start}")
  step_fn = make_train_step(model_cfg, optimizer, accum)
  log = MetricsLog(workdir, name)
  log_every = int(train_cfg.get("log_every", 10))
  ckpt_every = int(train_cfg.get("checkpoint_every", 0))
  history = []
  t0, tokens_seen, last_print = time.time(), 0, time.time()
  for step in range(start, steps):
    spec = schedule.spec(step)
    batch = batch_fn(step)
    rows, seq = batch["inputs"].shape
    if rows % (pack * accum):
      raise ValueError(f"train.accum_steps={accum}: batch of {rows} rows does not split into "
                       f"{accum} groups of whole packs of {pack}")
    scored = crossbatch.scored_rows(rows, pack, train_cfg.get("loss_on", "all"))
    batch = dict(batch, loss_mask=batch["loss_mask"] & scored[:, None])
    if "accuracy_mask" in batch:
      batch["accuracy_mask"] = batch["accuracy_mask"] & scored[:, None]
    if step == start:  # lets export_hf / from_pretrained read this workdir
      from fot_jax.convert.checkpoint import write_model_json
      write_model_json(workdir, model_cfg, window=seq)
    sources, positive = stacked_plan(spec, rows, accum)
    state, metrics = step_fn(state, batch, sources, positive)
    metrics = {k: float(v) for k, v in metrics.items()}
    schedule.observe(step, metrics)
    tokens_seen += rows * seq
    record = dict(metrics, **{k: float(v) for k, v in spec.items() if k in ("d", "w")})
    history.append({"step": step + 1, **record})
    if (step + 1) % log_every == 0 or step + 1 == steps:
      elapsed = time.time() - t0
      tps = tokens_seen / max(elapsed, 1e-9)
      eta = elapsed / (step + 1 - start) * (steps - step - 1)
      log.write(step + 1, dict(record, tokens_per_second=tps))
      if jax.process_index() == 0:
        rd = f" r_d {metrics['rd']:.3f}" if np.isfinite(metrics["rd"]) else ""
        print(f"[{name}] step {step + 1}/{steps} loss {metrics['loss']:.4f} acc {metrics['accuracy']:.3f}"
              f"{rd} spec {spec} | {tps:,.0f} tok/s | ETA {eta:.0f}s", flush=True)
    if ckpt_every and (step + 1) % ckpt_every == 0 or step + 1 == steps:
      manager.save(step + 1, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(_extra_state(schedule, batch_fn))))
  manager.wait_until_finished()
  manager.close()
  return {"params": state.params, "history": history, "steps": steps, "seconds": time.time() - t0}
