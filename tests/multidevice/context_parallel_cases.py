"""Sequence parallelism on 8 fake CPU devices (fot_jax/model/context_parallel.py), against one
device. Run by tests/test_parallel.py in the same subprocess as sharded_cases.py."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fot_jax import crossbatch as cb
from fot_jax import parallel
from fot_jax.model import attention_ops as ops
from fot_jax.model import context_parallel as cp
from fot_jax.model import memory as mem
from fot_jax.model.config import get_size
from fot_jax.model.llama import LlamaModel
from tests.multidevice.sharded_cases import CFG, _assert_same, _one_device_step, _step

RULES = parallel.DEFAULT_RULES


def setup_module():
  assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def _under(mesh, fn):
  """fn traced the way the train step traces the model: logical rules + the abstract mesh."""
  def wrapped(*args):
    with nn.logical_axis_rules(RULES), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)
  return wrapped


def _put(mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P()))


# ----------------------------------------------------------------------------- the op

B, T, KV, G, D, N = 2, 32, 2, 4, 8, 2  # GQA 8/2 heads; 2 extra contexts per row


def test_every_strategy_and_layout_equals_one_device_attention():
  """context=8: the causal window merged with fully visible extra contexts under one softmax,
  each strategy x layout against dense single-device attention (output, positive mass for
  r_d, gradients into queries, keys, values and the extra contexts). Padding: a row's first
  key and another row's tail are masked; one row has no live extra context."""
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(0, 1, s), jnp.float32)
  args = (f(B, T, KV, G, D), f(B, T, KV, D), f(B, T, KV, D), f(B, N, T, KV, D), f(B, N, T, KV, D))
  mask = np.ones((B, T), bool)
  mask[1, 27:] = False
  mask[0, 0] = False
  emask = rng.random((B, N, T)) < 0.7
  emask[1] = False
  epos = rng.random((B, N, T)) < 0.5
  weights = jnp.sin(jnp.arange(B * T * KV * G * D, dtype=jnp.float32)).reshape(B, T, KV, G, D)

  def reference(q, k, v, ek, ev):
    local = ops.attend(q, k, v, mask, jnp.broadcast_to(jnp.arange(T), (B, T)), impl="dense")
    extra = ops.attend(q, ek.reshape(B, N * T, KV, D), ev.reshape(B, N * T, KV, D), emask.reshape(B, N * T),
                       positive=epos.reshape(B, N * T), impl="dense")
    out = mem.finish(mem.merge(local, extra))
    return jnp.sum(out * weights), (out, extra.pos / jnp.maximum(extra.l, 1e-30))

  def sharded(strategy, layout):
    perm = cp.permutation(T, 8, layout)
    impl = "blockwise" if strategy == "ring" else "dense"  # the ring always merges blockwise

    def loss(q, k, v, ek, ev):
      lay = lambda x, axis=1: cp.to_layout(x, perm, axis)
      kw = dict(strategy=strategy, layout=layout, impl=impl, block=3)
      local = cp.attend(lay(q), lay(k), lay(v), lay(mask), causal=True, **kw)
      extra = cp.attend(lay(q), lay(ek, 2), lay(ev, 2), lay(emask, 2), causal=False, positive=lay(epos, 2), **kw)
      out = cp.from_layout(mem.finish(mem.merge(local, extra)), perm)
      return jnp.sum(out * weights), (out, cp.from_layout(extra.pos / jnp.maximum(extra.l, 1e-30), perm, 3))
    return loss

  mesh = parallel.make_mesh({"data": 1, "context": 8})
  combos = [(s, l) for s in cp.STRATEGIES for l in cp.LAYOUTS]
  grad = lambda fn: jax.value_and_grad(fn, argnums=range(5), has_aux=True)
  everything = jax.jit(_under(mesh, lambda *a: [grad(reference)(*a)] + [grad(sharded(*c))(*a) for c in combos]))
  (_, (want, want_rd)), want_g = (results := everything(*_put(mesh, args)))[0]
  live_q = mask[:, :, None, None, None]
  rd_q = emask.any((1, 2))[:, None, None, None] & mask[:, None, None, :]
  for (strategy, layout), ((_, (out, rd)), grads) in zip(combos, results[1:]):
    what = f"{strategy}/{layout}"
    np.testing.assert_allclose(np.where(live_q, out, 0), np.where(live_q, want, 0), atol=2e-6, err_msg=what)
    np.testing.assert_allclose(np.where(rd_q, rd, 0), np.where(rd_q, want_rd, 0), atol=2e-6, err_msg=what)
    for name, a, b in zip(("q", "k", "v", "extra k", "extra v"), grads, want_g):
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=f"{what} d{name}")


# ----------------------------------------------------------------------------- the model

def test_memory_layer_model_with_crossbatch_and_memory_under_context_parallel():
  """data=2 x tensor=2 x context=2 (heads split over tensor too), Ulysses (kv heads split: 4
  heads, 2 per tensor shard) with striped tokens, memory positions 'none': logits, r_d and
  parameter gradients of a crossbatch forward, and logits of memory inference (dense memory
  of earlier windows), equal the unsharded model's."""
  cfg = get_size("tiny", num_kv_heads=4, mem_positions="none", context_parallel="ulysses",
                 context_layout="striped")
  model = LlamaModel(cfg)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 16)), jnp.int32)
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens))
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(0, 0.2, a.shape), jnp.float32), shapes)
  plan = cb.analysis_plan(4, 2, 1).as_tuple()
  memory = {1: [mem.MemoryBlock(jnp.asarray(rng.normal(0, 1, (4, 24, 4, 8)), jnp.float32),
                                jnp.asarray(rng.normal(0, 1, (4, 24, 4, 8)), jnp.float32),
                                jnp.asarray(rng.random((4, 24)) < 0.8))]}
  weights = jnp.asarray(rng.normal(0, 1, (4, 16, cfg.vocab_size)), jnp.float32)

  def run(perm):
    lay = (lambda x: x) if perm is None else (lambda x: cp.to_layout(x, perm))
    unlay = (lambda x: x) if perm is None else (lambda x: cp.from_layout(x, perm))
    positions = None if perm is None else jnp.broadcast_to(jnp.asarray(perm), tokens.shape)

    def loss(params):
      logits, aux = model.apply(params, lay(tokens), positions=positions, plan=plan)
      return jnp.sum(unlay(logits) * weights), (unlay(logits), aux["rd_num"] / aux["rd_den"])

    def both(params):
      (_, (logits, rd)), grads = jax.value_and_grad(loss, has_aux=True)(params)
      with_memory, _ = model.apply(params, lay(tokens), positions=positions, memories=memory)
      return logits, rd, grads, unlay(with_memory)
    return both

  one_mesh = parallel.make_mesh(None, devices=jax.devices()[:1])
  want = jax.jit(_under(one_mesh, run(None)))(params)
  mesh = parallel.make_mesh({"data": 2, "tensor": 2, "context": 2})
  got = jax.jit(_under(mesh, run(cp.permutation(16, 2, "striped"))))(_put(mesh, params))
  assert 0 < float(want[1]) < 1
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4)


def test_fot_train_step_with_context_4_and_data_2_equals_one_device():
  """The full FoT step (ring, zigzag, positions 'first', GQA, 2 accumulation groups, d=4: last
  windows see other slots' windows on other devices) against the unsharded step: loss, r_d,
  gradient norm and the SGD update (= -gradient)."""
  cfg = dataclasses.replace(CFG, context_parallel="ring", context_layout="zigzag")
  spec = {"d": 4, "w": 1}
  sharded = _step(parallel.make_mesh({"data": 2, "context": 4}), spec, accum=2, cfg=cfg)
  one = _one_device_step(spec, accum=2)
  assert np.isfinite(one[0]["rd"]) and one[0]["rd"] < 1.0
  _assert_same(one, sharded)


def test_scanned_layers_under_fsdp_and_context_equal_one_device_unrolled():
  """LongLLaMA files' layout: layers 0-1 run as one scan, memory layer 2 unrolled, with fsdp=2 x
  context=4 and a crossbatch plan, against the unrolled step on one device (scan with remat:
  tests/test_scan_layers.py)."""
  cfg = dataclasses.replace(CFG, mem_layers=(2,), attention_impl="blockwise", attention_block=4)
  spec = {"d": 4, "w": 1}
  scanned = _step(parallel.make_mesh({"fsdp": 2, "context": 4}), spec,
                  cfg=dataclasses.replace(cfg, scan_layers=True))
  _assert_same(_step(parallel.make_mesh(None, devices=jax.devices()[:1]), spec, cfg=cfg, grouped=False), scanned)
