"""Every attention implementation equals the reference (docs/semantics.md, "One attention path").

The op is checked against `dense` on random blocks (causal window with padding,
fully visible extra contexts, a generation cache's per-row query slots, partials
merged under one softmax, gradients including the log-sum-exp path), and the
memory-layer module with `blockwise` against the NumPy re-derivation of the
crossbatch semantics in test_attention_reference (forward, r_d, gradients).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fot_jax import crossbatch as cb
from fot_jax.model import attention_ops as ops
from fot_jax.model import memory as mem
from tests.test_attention_reference import (PLANS, _cfg, _inputs, _model_setup, _params,
                                            _weights, reference)

B, T, KV, G, D = 3, 7, 2, 2, 4


def _blocks(seed=0, s_extra=10):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(0, 1, shape), jnp.float32)
  q, k, v = f(B, T, KV, G, D), f(B, T, KV, D), f(B, T, KV, D)
  ek, ev = f(B, s_extra, KV, D), f(B, s_extra, KV, D)
  mask = np.ones((B, T), bool)
  mask[1, 5:] = False  # right padding
  mask[2, 0] = False  # left padding: query 0 of row 2 sees no key at all
  emask = rng.random((B, s_extra)) < 0.7
  emask[[0, 2]] = False  # rows without extra contexts (row 2's query 0 sees nothing at all)
  positive = rng.random((B, s_extra)) < 0.5
  q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return q, k, v, jnp.asarray(mask), q_pos, ek, ev, jnp.asarray(emask), jnp.asarray(positive)


def _merged(impl, block, q, k, v, mask, q_pos, ek, ev, emask, positive):
  local = ops.attend(q, k, v, mask, q_pos, impl=impl, block=block)
  extra = ops.attend(q, ek, ev, emask, positive=positive, impl=impl, block=block)
  return mem.finish(mem.merge(local, extra)), mem.finish(local), extra


@pytest.mark.optimized_xla
@pytest.mark.parametrize("block", [3])  # several blocks, a ragged last block
def test_blockwise_op_equals_dense(block):
  args = _blocks()
  out, local, extra = jax.jit(functools.partial(_merged, "blockwise", block))(*args)
  want, want_local, want_extra = jax.jit(functools.partial(_merged, "dense", block))(*args)
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(local, want_local, atol=1e-5, rtol=1e-5)
  live = np.asarray(want_extra.l > 0)
  np.testing.assert_array_equal(np.asarray(extra.l > 0), live)
  np.testing.assert_allclose(np.where(live, extra.pos / jnp.maximum(extra.l, 1e-30), 0),
                             np.where(live, want_extra.pos / jnp.maximum(want_extra.l, 1e-30), 0),
                             atol=1e-5)

  def loss(impl, q, k, v, ek, ev):
    a = args
    o = _merged(impl, block, q, k, v, a[3], a[4], ek, ev, a[7], a[8])[0]
    w = jnp.sin(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o * w)  # through the merge: the log-sum-exp gets a cotangent too

  diff = (0, 1, 2, 5, 6)
  grad = lambda impl: jax.grad(lambda *x: loss(impl, *x), argnums=range(5))
  # Eager on purpose: there, a query that sees no key (row 2, token 0) once turned the
  # blockwise gradients into NaN, which XLA's simplifications hid under jit.
  grads = grad("blockwise")(*(args[i] for i in diff))
  want_g = jax.jit(grad("dense"))(*(args[i] for i in diff))
  for name, a, b in zip(("q", "k", "v", "ek", "ev"), grads, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("block", [2, 12])  # key blocks within a window; the whole window
def test_sources_read_in_scan_equal_dense_over_gathered_copies(block):
  """attend_sources (crossbatch sources read by index inside the scan) against `dense` over
  each row's gathered copies: forward, positive mass and gradients, with dead columns (-1),
  a row with no source, a source shared by two rows (its gradients add up), padded keys
  and a ragged last key block."""
  rng = np.random.default_rng(3)
  bk, s, w = 4, 5, 3
  f = lambda *shape: jnp.asarray(rng.normal(0, 1, shape), jnp.float32)
  q, k, v = f(B, T, KV, G, D), f(bk, s, KV, D), f(bk, s, KV, D)
  kmask = np.ones((bk, s), bool)
  kmask[2, 3:] = False
  sources = jnp.asarray([[1, 2, -1], [-1, -1, -1], [2, 0, 3]], jnp.int32)
  positive = jnp.asarray([[True, False, False], [False] * 3, [False, True, True]])

  def gathered(q, k, v):
    idx = jnp.maximum(sources, 0)
    ek, ev = (x[idx].reshape(B, w * s, KV, D) for x in (k, v))
    emask = ((sources >= 0)[..., None] & jnp.asarray(kmask)[idx]).reshape(B, w * s)
    epos = jnp.repeat(positive, s, axis=1)
    return ops.attend(q, ek, ev, emask, positive=epos, impl="dense")

  read = lambda q, k, v: ops.attend_sources(q, k, v, jnp.asarray(kmask), sources, positive, block=block)
  got, want = jax.jit(read)(q, k, v), gathered(q, k, v)
  live = np.asarray(want.l > 0)
  assert live[0].all() and not live[1].any()
  np.testing.assert_array_equal(np.asarray(got.l > 0), live)
  live_out = live.transpose(0, 3, 1, 2)[..., None]  # finish() is [B, T, KV, G, D]
  np.testing.assert_allclose(np.where(live_out, mem.finish(got), 0),
                             np.where(live_out, mem.finish(want), 0), atol=1e-5)
  ratio = lambda p: np.where(live, p.pos / jnp.maximum(p.l, 1e-30), 0)
  np.testing.assert_allclose(ratio(got), ratio(want), atol=1e-5)

  def loss(attend, q, k, v):
    base = ops.attend(q, k[:B, :T], v[:B, :T], jnp.ones((B, s), bool), impl="dense")
    o = mem.finish(mem.merge(base, attend(q, k, v)))  # a cotangent on the log-sum-exp too
    return jnp.sum(o * jnp.sin(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape))

  grads = jax.grad(functools.partial(loss, read), argnums=(0, 1, 2))(q, k, v)
  want_g = jax.grad(functools.partial(loss, gathered), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", grads, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)


def test_blockwise_op_cache_slots_and_jit():
  """Generation: one query per row at its own slot of a cache, keys beyond the fill dead."""
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(0, 1, (B, 1, KV, G, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(0, 1, (B, 9, KV, D)), jnp.float32) for _ in range(2))
  fill = jnp.asarray([0, 4, 8], jnp.int32)
  mask = jnp.arange(9)[None] <= fill[:, None]
  want = mem.finish(ops.attend(q, k, v, mask, fill[:, None], impl="dense"))
  got = jax.jit(lambda q, k, v: mem.finish(ops.attend(q, k, v, mask, fill[:, None], impl="blockwise",
                                                      block=4)))(q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_allclose(got[0, 0], np.broadcast_to(v[0, 0][:, None], (KV, G, D)), atol=1e-6)


# ----------------------------------------------------------------------------- the module

@pytest.mark.parametrize("positions_mode,plan_name,masked,impl", [
    ("first", "segments", True, "blockwise"),
    ("none", "analysis_d3_w1", True, "fused"),  # a memory layer with a plan: blockwise on any backend
])
@pytest.mark.optimized_xla
def test_module_blockwise_matches_reference(positions_mode, plan_name, masked, impl):
  plan = PLANS[plan_name]()
  batch = plan.sources.shape[0]
  cfg = _cfg(mem_positions=positions_mode, attention_impl=impl, attention_block=2)
  mod, params = _params(cfg, batch)
  x, positions, mask = _inputs(batch, masked=masked)
  out, aux = jax.jit(lambda p: mod.apply({"params": p}, jnp.asarray(x), jnp.asarray(positions),
                                         jnp.asarray(mask), plan=plan.as_tuple()))(params)
  want, rd_num, rd_den = reference(params, x, positions, mask, plan.sources, plan.positive, cfg)
  valid = mask[..., None]
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, want, 0), atol=2e-5, rtol=1e-4)
  assert float(aux["rd_den"]) == rd_den
  np.testing.assert_allclose(float(aux["rd_num"]), rd_num, rtol=1e-4, atol=1e-6)
  weights = _weights(batch, mask)
  sg = jnp.asarray(positions), jnp.asarray(mask)

  def loss_module(params, x):
    return jnp.sum(mod.apply({"params": params}, x, *sg, plan=plan.as_tuple())[0] * weights)

  def loss_ref(params, x):
    out, _, _ = reference(params, x, positions, mask, plan.sources, plan.positive, cfg, xp=jnp)
    return jnp.sum(out * weights)

  g_mod = jax.jit(jax.grad(loss_module, argnums=(0, 1)))(params, jnp.asarray(x))
  g_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1)))(params, jnp.asarray(x))
  for a, b in zip(jax.tree_util.tree_leaves(g_mod), jax.tree_util.tree_leaves(g_ref)):
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max(), rtol=1e-3)


def test_gating_blockwise_equals_dense():
  plan = PLANS["segments"]()
  x, positions, mask = _inputs(6, masked=True)
  outs = []
  for impl in ("dense", "blockwise"):
    mod, params = _params(_cfg(mem_gating=True, attention_impl=impl, attention_block=3), 6)
    params = dict(params, mem_gate=jnp.linspace(-1, 1, 4))
    outs.append(jax.jit(lambda p: mod.apply({"params": p}, jnp.asarray(x), jnp.asarray(positions),
                                            jnp.asarray(mask), plan=plan.as_tuple())[0])(params))
  valid = mask[..., None]
  np.testing.assert_allclose(np.where(valid, outs[1], 0), np.where(valid, outs[0], 0), atol=2e-5)


@pytest.mark.optimized_xla
def test_memory_inference_blockwise_equals_dense():
  """The whole model at inference: a blockwise local window merged with dense memory."""
  from fot_jax.inference import MemoryInference
  cfg, _, variables, _ = _model_setup()
  params = variables["params"]
  long = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 11))
  dense = MemoryInference(cfg, params, window=4)
  want = dense.process(long, dense.new_memory(2))
  blockwise = dataclasses.replace(cfg, attention_impl="blockwise", attention_block=3)
  infer = MemoryInference(blockwise, params, window=4)
  np.testing.assert_allclose(infer.process(long, infer.new_memory(2)), want, atol=2e-5, rtol=1e-4)


def test_unknown_impl_is_rejected():
  with pytest.raises(ValueError, match="model.attention_impl"):
    _cfg(attention_impl="flash")
  with pytest.raises(ValueError, match="model.attention_block"):
    _cfg(attention_block=0)


# ----------------------------------------------------------------------------- rows pay for their own contexts

LONGLLAMA = [(0, 0), (1, 1), (2, 1), (3, 0)]  # LongLLaMA-3B's segments plan: widths 0, 2, 3, 3


def test_pack_widths():
  plan = cb.segments_plan(8, LONGLLAMA)
  assert plan.widths == (0, 2, 3, 3) and plan.pack == 4
  assert cb.analysis_plan(6, 3, 1).widths == (0, 3)
  assert cb.empty_plan(4).widths == (0,)
  stacked = np.stack([plan.sources, np.full_like(plan.sources, -1)])  # [accum, rows, N]
  assert cb.pack_widths(stacked, 4) == (0, 2, 3, 3)
  ragged = plan.sources.copy()
  ragged[5, :] = -1
  ragged[5, 2] = 3  # a live source behind a dead column still counts
  assert cb.pack_widths(ragged, 4) == (0, 3, 3, 3)
  with pytest.raises(ValueError, match="whole packs"):
    cb.pack_widths(plan.sources, 3)


@pytest.mark.optimized_xla
@pytest.mark.parametrize("impl,device_groups,grad", [("dense", False, False), ("blockwise", True, True)])
def test_grouped_by_width_equals_padded(impl, device_groups, grad):
  """Static widths (each pack position's rows attend to only their own contexts) give the
  padded result (every row attends to all N columns, masked): forward, r_d, gradients
  (the grouping is the same code for every impl; blockwise's custom VJP is the harder case)."""
  plan = cb.segments_plan(8, LONGLLAMA)
  sources, positive = plan.sources, plan.positive
  if device_groups:  # crossbatch_scope='device': [G, rows/G, N], indices local to a group
    sources, positive = np.stack([sources, sources]), np.stack([positive, positive])
  batch = 16 if device_groups else 8
  cfg = _cfg(attention_impl=impl, attention_block=4)
  mod, params = _params(cfg, batch)
  x, positions, mask = _inputs(batch, masked=True)
  weights = _weights(batch, mask)

  def run(params, x, widths):
    plan_arg = (sources, positive) if widths is None else (sources, positive, widths)
    out, aux = mod.apply({"params": params}, x, jnp.asarray(positions), jnp.asarray(mask), plan=plan_arg)
    return jnp.sum(out * weights), (out, aux)

  def both(params, x):  # one compile for the two paths
    f = jax.value_and_grad(run, argnums=(0, 1), has_aux=True) if grad else run
    return f(params, x, None), f(params, x, plan.widths)

  padded, grouped = jax.jit(both)(params, jnp.asarray(x))
  if grad:
    (padded, g_p), (grouped, g_g) = padded, grouped
    for a, b in zip(jax.tree_util.tree_leaves(g_g), jax.tree_util.tree_leaves(g_p)):
      np.testing.assert_allclose(a, b, atol=1e-6 * np.abs(b).max(), rtol=1e-5)
  (_, (out_p, aux_p)), (_, (out_g, aux_g)) = padded, grouped
  np.testing.assert_allclose(out_g, out_p, atol=1e-6, rtol=1e-6)
  assert float(aux_g["rd_den"]) == float(aux_p["rd_den"]) > 0
  np.testing.assert_allclose(float(aux_g["rd_num"]), float(aux_p["rd_num"]), rtol=1e-6)


def test_grouped_by_width_computes_only_live_contexts():
  """XLA's FLOP count of the memory layer: the extra-context work of the grouped path is the
  padded path's times (sum of widths) / (k * N), i.e. only the live contexts are computed."""
  plan = cb.segments_plan(8, LONGLLAMA)
  cfg = _cfg(attention_impl="dense")
  mod, params = _params(cfg, 8)
  x, positions, mask = (jnp.asarray(a) for a in _inputs(8))

  def flops(plan_arg):
    f = jax.jit(lambda p, x: mod.apply({"params": p}, x, positions, mask, plan=plan_arg)[0])
    cost = f.lower(params, x).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

  base = flops(None)
  padded = flops(plan.as_tuple(grouped=False)) - base
  grouped = flops(plan.as_tuple()) - base
  want = sum(plan.widths) / (plan.pack * plan.num_sources)  # 8 / 12
  assert grouped / padded == pytest.approx(want, rel=0.1)


# ----------------------------------------------------------------------------- bf16 compute

def test_bf16_softmax_statistics_stay_float32():
  """bf16 queries/keys/values: every impl's running max, sum, weighted values and positive mass
  (and memory's) are float32."""
  q, k, v, mask, q_pos, ek, ev, emask, positive = (
      a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _blocks())
  for impl in ("dense", "blockwise"):
    for part in (jax.eval_shape(functools.partial(ops.attend, impl=impl, block=3), q, k, v, mask, q_pos),
                 jax.eval_shape(functools.partial(ops.attend, impl=impl, block=3), q, ek, ev, emask,
                                positive=positive)):
      assert {str(x.dtype) for x in part if x is not None} == {"float32"}, (impl, part)
  block = mem.MemoryBlock(ek, ev, emask, positive)
  for part in (jax.eval_shape(lambda q: ops.attend_memory(q, [block], 4), q),
               jax.eval_shape(lambda q: mem.topk_memory_partial(q, [block], 3, 4), q)):
    assert {str(x.dtype) for x in part if x is not None} == {"float32"}


def test_bf16_forward_close_to_float32_and_memory_in_bf16():
  """bf16 compute (float32 parameters) against float32: logits within 3% of their largest
  magnitude, with crossbatch (r_d too); inference memory is stored in the compute dtype
  (LongLLaMA's mem_dtype) unless mem_dtype is given."""
  from fot_jax.inference import MemoryInference
  from fot_jax.model.llama import LlamaModel
  cfg, model, variables, tokens = _model_setup()
  plan = cb.analysis_plan(6, 2, 1).as_tuple()
  bf16 = dataclasses.replace(cfg, dtype="bfloat16")
  run = lambda m: jax.jit(lambda v: m.apply(v, tokens, plan=plan))(variables)
  want, aux = run(model)
  got, aux16 = run(LlamaModel(bf16))
  err = float(jnp.abs(got - want).max())
  assert 0 < err <= 0.03 * float(jnp.abs(want).max()), err
  assert float(aux16["rd_den"]) == float(aux["rd_den"])
  np.testing.assert_allclose(float(aux16["rd_num"]), float(aux["rd_num"]), rtol=0.03)

  # Inference memory: the compute dtype unless mem_dtype says otherwise.
  kv = (jnp.ones((2, 4, cfg.kv_heads, cfg.dim_per_head)),) * 2
  for c, mem_dtype, want_dtype in ((cfg, None, jnp.float32), (bf16, None, jnp.bfloat16),
                                   (cfg, jnp.bfloat16, jnp.bfloat16)):
    memory = MemoryInference(c, variables["params"], window=4, mem_dtype=mem_dtype).new_memory(2)
    memory.add({1: kv}, np.ones((2, 4), bool))
    assert memory.buffers[1][0].dtype == want_dtype and memory.buffers[1][1].dtype == want_dtype


def test_grouped_widths_pass_through_remat():
  """With remat (LongLLaMA's configs) the plan's static widths must stay concrete through the
  checkpointed layers: the remat model's logits and r_d equal the plain model's, grouped."""
  from fot_jax.model.config import get_size
  from fot_jax.model.init import init_params
  from fot_jax.model.llama import LlamaModel
  plan = cb.segments_plan(8, LONGLLAMA)
  cfg = get_size("tiny", vocab_size=64, mem_layers=(1,), num_layers=2, hidden_size=32, intermediate_size=32)
  params = init_params(cfg, 0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 8)))

  @jax.jit
  def both(params, tokens):  # the widths stay a Python tuple, closed over
    return [LlamaModel(dataclasses.replace(cfg, remat=remat)).apply(
        {"params": params}, tokens, plan=(plan.sources, plan.positive, plan.widths)) for remat in (False, True)]

  outs = both(params, tokens)
  np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-6)
  np.testing.assert_allclose(float(outs[1][1]["rd_num"]), float(outs[0][1]["rd_num"]), rtol=1e-6)
