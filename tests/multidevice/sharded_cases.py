"""Sharding cases on 8 fake CPU devices. Run by tests/test_parallel.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the main suite runs on 1 device)."""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax import crossbatch, parallel
from fot_jax.model.config import get_size
from fot_jax.train import init_state, make_train_step, stacked_plan, state_shardings

TASK = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=8, n_queries=8)
CFG = get_size("tiny", vocab_size=TASK.vocab_size, mem_layers=(1,))
MESH_222 = {"data": 2, "fsdp": 2, "tensor": 2}
RULES = parallel.DEFAULT_RULES


def setup_module():
  assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


def test_mesh_sizes_fill_one_auto_axis_and_reject_bad_products():
  mesh = parallel.make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2, "context": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="= 12 but there are 8 devices"):
    parallel.make_mesh({"data": 3, "fsdp": 2, "tensor": 2})
  with pytest.raises(ValueError, match="only one axis may be -1"):
    parallel.make_mesh({"data": -1, "fsdp": -1})
  with pytest.raises(ValueError, match="multiply to 3, which does not divide the 8"):
    parallel.make_mesh({"data": 3, "fsdp": -1})
  # Across slices: 2 slices of 4 devices (dcn), ici sizes per slice.
  ici, dcn = parallel.mesh_shape({"data": 1, "fsdp": -1, "tensor": 2, "dcn_data": 2}, 8, num_slices=2)
  assert ici == {"data": 1, "fsdp": 2, "tensor": 2, "context": 1} and dcn["data"] == 2
  with pytest.raises(ValueError, match="job has 2 slice"):
    parallel.mesh_shape({"fsdp": -1}, 8, num_slices=2)


def test_parameter_and_optimizer_partition_specs():
  mesh = parallel.make_mesh(MESH_222)
  opt = optax.adamw(1e-3)
  state = init_state(CFG, opt, 0, mesh, RULES)
  p = state.params
  expected = {
      ("embed_tokens", "embedding"): P("tensor", "fsdp"),
      ("layers_1", "self_attn", "q_proj", "kernel"): P("fsdp", "tensor"),
      ("layers_1", "self_attn", "k_proj", "kernel"): P("fsdp", "tensor"),
      ("layers_1", "self_attn", "o_proj", "kernel"): P("tensor", "fsdp"),
      ("layers_0", "mlp", "gate_proj", "kernel"): P("fsdp", "tensor"),
      ("layers_0", "mlp", "down_proj", "kernel"): P("tensor", "fsdp"),
      ("lm_head", "kernel"): P("fsdp", "tensor"),
      ("norm", "weight"): P(None),
  }
  for path, spec in expected.items():
    leaf = p
    for k in path:
      leaf = leaf[k]
    assert leaf.sharding.spec == spec, path
    assert leaf.sharding.mesh.shape == mesh.shape
  mu = state.opt_state[0].mu  # adamw's first moment mirrors the parameters' shardings
  assert mu["layers_1"]["self_attn"]["q_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
  # q_proj [32, 32] over fsdp=2 x tensor=2: each device holds a [16, 16] block.
  q = p["layers_1"]["self_attn"]["q_proj"]["kernel"]
  assert {s.data.shape for s in q.addressable_shards} == {(16, 16)}


def test_indivisible_dimension_fails_before_tracing():
  mesh = parallel.make_mesh({"tensor": 8})
  cfg = get_size("tiny", intermediate_size=36)
  with pytest.raises(ValueError, match=r"down_proj.*kernel.*: dimension 0 of size 36 is not divisible by mesh axes tensor of size 8"):
    state_shardings(cfg, optax.sgd(1.0), mesh, RULES)
  with pytest.raises(ValueError, match="6 rows are not divisible by the 4 batch shards"):
    parallel.check_batch_rows(6, parallel.make_mesh(MESH_222), RULES)


def _step(mesh, spec, accum=1, groups=1, cfg=CFG, grouped=True):
  """One SGD(1) step: returns (metrics, parameter update = -gradient). grouped: pass the plan's
  static widths (rows attend to only their own contexts); False: every row to all N, masked."""
  opt = optax.sgd(1.0)
  batch = DictionaryBatches(TASK, slots=8, window=TASK.doc_len // 2, seed=0)(0)
  rows = batch["inputs"].shape[0]
  batch["loss_mask"] = batch["loss_mask"] & crossbatch.scored_rows(rows, 2, "last")[:, None]
  state = init_state(cfg, opt, 0, mesh, RULES)
  before = jax.tree_util.tree_map(np.asarray, state.params)
  sources, positive = stacked_plan(spec, rows, accum, groups)
  step = make_train_step(cfg, opt, accum, mesh, RULES)
  state, metrics = step(state, parallel.global_batch(batch, parallel.batch_sharding(mesh, RULES)),
                        parallel.global_replicated(sources, mesh), parallel.global_replicated(positive, mesh),
                        crossbatch.pack_widths(sources, crossbatch.pack_size(spec)) if grouped else None)
  delta = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - b, state.params, before)
  return {k: float(v) for k, v in metrics.items()}, delta


_ONE_DEVICE = {}


def _one_device_step(spec, accum=1):
  """The unsharded step, computed once per (spec, accum) for every case that compares to it."""
  key = (repr(spec), accum)
  if key not in _ONE_DEVICE:
    _ONE_DEVICE[key] = _step(parallel.make_mesh(None, devices=jax.devices()[:1]), spec, accum=accum, grouped=False)
  return _ONE_DEVICE[key]


def _assert_same(a, b):
  (ma, da), (mb, db) = a, b
  for k in ("loss", "accuracy", "rd", "grad_norm", "tokens_scored"):
    assert ma[k] == pytest.approx(mb[k], rel=2e-5, abs=1e-7), k
  for x, y in zip(jax.tree_util.tree_leaves(da), jax.tree_util.tree_leaves(db)):
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-7)


def test_sharded_fot_step_matches_one_device():
  """data=2, fsdp=2, tensor=2: 16 rows over 4 batch shards, 2 accumulation groups of 8 rows
  (4 slots, spread over the 4 shards). With d=4 every last window sees the first windows
  of 3 other slots, which live on other devices."""
  spec = {"d": 4, "w": 1}
  one = _one_device_step(spec, accum=2)  # every row to all N contexts, masked
  eight = _step(parallel.make_mesh(MESH_222), spec, accum=2)  # rows grouped by width, sharded
  assert np.isfinite(one[0]["rd"]) and one[0]["rd"] < 1.0  # negatives present
  _assert_same(one, eight)


def test_device_scope_crossbatch_matches_one_device_and_stays_local():
  """crossbatch_scope='device': one plan per batch shard (4 groups of 2 slots)."""
  sources, _ = stacked_plan({"d": 2, "w": 1}, 16, 1, groups=4)
  assert sources.shape == (1, 4, 4, 2)  # indices local to each group of 4 rows
  assert sources.max() < 4
  spec = {"d": 2, "w": 1}
  one = _step(parallel.make_mesh(None, devices=jax.devices()[:1]), spec, groups=4, grouped=False)
  eight = _step(parallel.make_mesh(MESH_222), spec, groups=4)
  _assert_same(one, eight)
