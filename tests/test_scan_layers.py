"""ModelConfig.scan_layers and remat_policy: the scanned model computes what the unrolled one does
(logits, r_d, gradients), with the same parameter tree (docs/scan_and_remat.md)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fot_jax import crossbatch as cb
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel

# Layers 0-1 and 3-4 scan as two runs around the memory layer 2.
CFG = get_size("tiny", num_layers=5, mem_layers=(2,))
PLAN = cb.segments_plan(8, [(0, 0), (1, 1)]).as_tuple()
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 8)), jnp.int32)


def variant(**kw):
  return dataclasses.replace(CFG, **kw)


def forward(cfg, params, plan=PLAN, **kw):
  return LlamaModel(cfg).apply({"params": params}, TOKENS, plan=plan, **kw)


def loss_and_grad(cfg, params):
  weights = jnp.asarray(np.random.default_rng(1).normal(size=(8, 8, CFG.vocab_size)), jnp.float32)

  def loss(params):  # no plan: the memory layer runs the same code either way (r_d: the forward tests)
    return jnp.sum(forward(cfg, params, plan=None)[0] * weights)

  return jax.jit(jax.value_and_grad(loss))(params)


def scans(cfg, params):
  jaxpr = jax.make_jaxpr(lambda p: forward(cfg, p))(params)
  return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, 0)


def test_init_tree_is_the_same_with_scan(params):
  scanned = init_params(variant(scan_layers=True), 0)
  assert jax.tree.structure(scanned) == jax.tree.structure(params)
  assert sorted(k for k in params if k.startswith("layers_")) == [f"layers_{i}" for i in range(5)]
  jax.tree.map(np.testing.assert_array_equal, scanned, params)


def test_scanned_runs_around_the_memory_layer(params):
  assert len(scans(variant(scan_layers=True), params)) == 2  # layers 0-1 and 3-4
  assert not scans(CFG, params)


def test_scanned_forward_equals_unrolled(params):
  (lu, au), (ls, as_) = (jax.jit(lambda p, c=c: forward(c, p))(params) for c in (CFG, variant(scan_layers=True)))
  np.testing.assert_allclose(ls, lu, atol=1e-5)
  assert float(au["rd_den"]) > 0
  np.testing.assert_allclose(float(as_["rd_num"]), float(au["rd_num"]), rtol=1e-5)
  assert float(as_["rd_den"]) == float(au["rd_den"])


def test_stop_after_cuts_the_runs(params):
  outs = [jax.jit(lambda p, c=c: forward(c, p, stop_after=3, want_mem_kv=True)[1])(params)
          for c in (CFG, variant(scan_layers=True))]
  np.testing.assert_allclose(outs[1]["mem_kv"][2][1], outs[0]["mem_kv"][2][1], atol=1e-5)
  np.testing.assert_allclose(float(outs[1]["rd_num"]), float(outs[0]["rd_num"]), rtol=1e-5)


def test_gradients_and_remat_policies_equal_unrolled(params):
  want_loss, want = loss_and_grad(CFG, params)
  for kw in ({"scan_layers": True}, {"remat": True}, {"remat": True, "remat_policy": "dots"},
             {"scan_layers": True, "remat": True}, {"scan_layers": True, "remat": True, "remat_policy": "dots"}):
    got_loss, got = loss_and_grad(variant(**kw), params)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5, err_msg=str(kw))
    for path, g in jax.tree_util.tree_leaves_with_path(got):
      w = want
      for k in path:
        w = w[k.key]
      np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"{kw} {jax.tree_util.keystr(path)}")


def test_bf16_scanned_weights_are_half_precision_and_close(params):
  bf16 = variant(dtype="bfloat16")
  scanned = variant(dtype="bfloat16", scan_layers=True)
  (lu, _), (ls, _) = (jax.jit(lambda p, c=c: forward(c, p))(params) for c in (bf16, scanned))
  np.testing.assert_allclose(ls, lu, atol=2e-2)
  # The loop's stacked inputs: matrices in bf16 (what an FSDP gather moves), norms in float32.
  for eqn in scans(scanned, params):
    stacked = [v.aval for v in eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:]]
    assert {a.dtype for a in stacked if a.ndim >= 3} == {jnp.dtype(jnp.bfloat16)}
    assert {a.dtype for a in stacked if a.ndim == 2} == {jnp.dtype(jnp.float32)}


def test_intermediates_run_unrolled(params):
  """sow / capture_intermediates (fot_jax.eval.heads, host_index) need the layers as modules: with
  the intermediates collection mutable the scanned config runs unrolled and collects the same."""
  outs = [LlamaModel(c).apply({"params": params}, TOKENS, capture_intermediates=True, mutable=["intermediates"])
          for c in (CFG, variant(scan_layers=True))]
  np.testing.assert_array_equal(outs[1][0][0], outs[0][0][0])
  assert jax.tree.structure(outs[1][1]) == jax.tree.structure(outs[0][1])
  assert "mem_queries" in outs[1][1]["intermediates"]["layers_2"]["self_attn"]


def test_bad_remat_policy():
  with pytest.raises(ValueError, match=r"model\.remat_policy: must be one of \('full', 'dots'\), got 'all'"):
    get_size("tiny", remat_policy="all")
