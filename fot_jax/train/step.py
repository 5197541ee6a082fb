"""The jitted train step and its state: TrainState, the state's shardings and initialisation, the
LM loss sums (lm_loss_sums), make_train_step (FoT crossbatch plans or a recurrent carry, gradient
accumulation, trainable subsets) and stacked_plan (one crossbatch plan per accumulation group).
"""
from __future__ import annotations

from typing import Any, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fot_jax import crossbatch, parallel
from fot_jax import recurrent as recurrent_lib
from fot_jax.model import context_parallel as cp
from fot_jax.model.config import ModelConfig
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel, weights_in_compute_dtype
from fot_jax.recurrent import RecurrentSpec
from fot_jax.train.far_memory import MEMORY_CHUNK
from fot_jax.train.optimizer import Trainable


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def _select(trainable: Optional[Trainable], tree):
  return tree if trainable is None else trainable.select(tree)


def _merge(trainable: Optional[Trainable], full, sub):
  return sub if trainable is None else trainable.merge(full, sub)


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


def answer_sums(logits, targets, mask):
  """(whole answers right, answers) over the masked tokens [B, T]: an answer is a run of masked
  tokens in a row, right when every token of it is the argmax (what greedy decoding writes; a
  token-level accuracy credits the later digits of a wrong value, which follow once its first digit
  is chosen)."""
  mask = mask.astype(bool)
  wrong = (mask & (jnp.argmax(logits, -1) != targets)).astype(jnp.int32)
  before = jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
  after = jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
  start, end = mask & ~before, mask & ~after
  errors = jnp.cumsum(wrong, axis=1)  # errors up to and including t
  # errors before the current run's first token: nondecreasing, so a running max over the starts
  at_start = jax.lax.cummax(jnp.where(start, errors - wrong, -1), axis=1)
  right = end & (errors == at_start)
  return jnp.sum(right.astype(jnp.float32)), jnp.sum(end.astype(jnp.float32))


def make_train_step(cfg: ModelConfig, optimizer, accum_steps: int = 1, mesh=None, rules=None,
                    trainable: Optional[Trainable] = None, recurrent: Optional[RecurrentSpec] = None,
                    memory_topk: Optional[int] = None):
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

  memory_topk (train.memory): step(state, batch, sources, positive, memories, widths=None), where
  memories {memory layer: [MemoryBlock]} (one block of keys [1, M, KV, D] shared by every row: a
  long haystack written by the model without gradient, fot_jax/train/far_memory.py) is read by
  each memory layer's queries, its top memory_topk entries per query under one softmax with the
  local window and the crossbatch contexts; gradients reach the queries, not the memory.
  """
  model = LlamaModel(cfg)
  rules = parallel.DEFAULT_RULES if rules is None else rules
  if mesh is None:
    mesh = parallel.make_mesh(None, devices=jax.devices()[:1])

  context = cp.context_size(mesh)

  def micro_sums(train_params, all_params, inputs, targets, mask, acc_mask, sources, positive, widths,
                 memories=None):
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
    read = {} if memories is None else {"memories": memories, "mem_mode": "topk", "mem_topk": memory_topk,
                                        "mem_chunk": MEMORY_CHUNK}
    logits, aux = model.apply({"params": params}, inputs, positions=positions, plan=plan, **read)
    loss_sum, _, count = lm_loss_sums(logits, targets, mask)
    _, correct, acc_count = lm_loss_sums(jax.lax.stop_gradient(logits), targets, acc_mask)
    answers_right, answers = answer_sums(jax.lax.stop_gradient(logits), targets, acc_mask)
    return loss_sum, (correct, acc_count, count, aux["rd_num"], aux["rd_den"], answers_right, answers, None)

  def micro_recurrent(train_params, all_params, inputs, targets, mask, acc_mask, doc, carry, widths):
    del widths
    params = _merge(trainable, all_params, train_params)
    params = weights_in_compute_dtype(params, cfg.dtype, state_sh.params)
    (loss_sum, correct, acc_count, count), carry = recurrent_lib.recurrent_sums(
        model, params, recurrent, lm_loss_sums, inputs, targets, mask, acc_mask, doc, carry)
    zero = jnp.zeros((), jnp.float32)
    return loss_sum, (correct, acc_count, count, zero, zero, zero, zero, carry)

  shards = parallel.batch_shards(mesh, rules)

  def split(x):  # [B, ...] -> [accum, B/accum, ...]: each group is spread over all batch shards again
    x = x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:])
    return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))

  def step(state: TrainState, batch, sources, positive, widths=None, memories=None):
    rows = batch["inputs"].shape[0] // accum_steps
    if widths is not None and (rows % shards or (rows // shards) % len(widths)):
      # Grouping rows by pack position regroups them across batch shards when a shard does not
      # hold whole packs (LongLLaMA-3B: 1 row per fsdp shard): GSPMD then replicates the groups
      # (measured: 67.10 GiB per device against 33.25 padded). The padded path is the same result.
      widths = None
    with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      acc_mask = batch.get("accuracy_mask", batch["loss_mask"])
      xs = tuple(split(batch[f]) for f in ("inputs", "targets", "loss_mask")) + (split(acc_mask), sources, positive)
      state, metrics, _ = step_body(state, micro_sums, xs, widths, memories)
      return state, metrics

  def step_with_memory(state: TrainState, batch, sources, positive, memories, widths=None):
    return step(state, batch, sources, positive, widths, memories)

  def step_recurrent(state: TrainState, batch, carry):
    with nn.logical_axis_rules(rules), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      acc_mask = batch.get("accuracy_mask", batch["loss_mask"])
      xs = tuple(split(batch[f]) for f in ("inputs", "targets", "loss_mask")) + (
          split(acc_mask), split(batch["doc_ids"]), jax.tree_util.tree_map(split, carry))
      state, metrics, carries = step_body(state, micro_recurrent, xs, None)
      return state, metrics, jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), carries)

  def step_body(state: TrainState, micro, xs, widths, memories=None):
    """Gradients summed over the accumulation groups xs (leading axis accum) -> (state, metrics,
    the groups' stacked outputs: the recurrent carry, or None)."""
    grad_fn = jax.value_and_grad(micro, has_aux=True)
    train_params = _select(trainable, state.params)

    def body(carry, x):
      grads, sums = carry
      (loss_sum, rest), g = grad_fn(train_params, state.params, *x, widths,
                                    *(() if memories is None else (memories,)))
      grads = jax.tree_util.tree_map(jnp.add, grads, g)
      sums = sums + jnp.stack([loss_sum, *rest[:-1]])
      return (grads, sums), rest[-1]

    zeros = jax.tree_util.tree_map(jnp.zeros_like, train_params)
    (grads, sums), outs = jax.lax.scan(body, (zeros, jnp.zeros(8, jnp.float32)), xs)
    loss_sum, correct, acc_count, count, rd_num, rd_den, answers_right, answers = sums
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, train_params)
    params = _merge(trainable, state.params, optax.apply_updates(train_params, updates))
    metrics = {"loss": loss_sum / denom, "accuracy": correct / jnp.maximum(acc_count, 1.0),
               "tokens_scored": count, "answer_accuracy": answers_right / jnp.maximum(answers, 1.0),
               "rd": jnp.where(rd_den > 0, rd_num / jnp.maximum(rd_den, 1.0), jnp.nan),
               "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.step + 1, params, opt_state), metrics, outs

  _, state_sh = state_shardings(cfg, optimizer, mesh, rules, trainable)
  rep = parallel.replicated(mesh)
  batch_sh = parallel.batch_sharding(mesh, rules)
  if recurrent is not None:
    return jax.jit(step_recurrent, in_shardings=(state_sh, batch_sh, batch_sh),
                   out_shardings=(state_sh, rep, batch_sh), donate_argnums=(0, 2))
  if memory_topk is not None:
    return jax.jit(step_with_memory, in_shardings=(state_sh, batch_sh, rep, rep, rep),
                   out_shardings=(state_sh, rep), donate_argnums=(0,), static_argnums=(5,))
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
