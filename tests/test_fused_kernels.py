"""`attention_impl='fused'` (fot_jax/model/fused_kernels.py) against the dense reference.

Splash runs through the Pallas interpreter on CPU (forward and its VJP), alone and inside
the attention module (through a one-device mesh: the shard_map path); the cuDNN call's
layout runs through XLA; a backend with no kernel says so once and runs blockwise.
"""
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from fot_jax import parallel
from fot_jax.model import attention_ops as ops
from fot_jax.model import fused_kernels as fk
from fot_jax.model import memory as mem
from fot_jax.model.attention import Attention
from tests.test_attention_reference import _cfg


def _window(b, t, kv, g, d, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(0, 1, shape), jnp.float32)
  q, k, v = f(b, t, kv, g, d) * d ** -0.5, f(b, t, kv, d), f(b, t, kv, d)
  mask = np.ones((b, t), bool)
  mask[0, :5] = False  # left padding: query 0 sees no key at all in the reference
  mask[-1, t - 130:] = False  # right padding over a whole key block
  return q, k, v, jnp.asarray(mask)


def _dense(q, k, v, mask):
  q_pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), mask.shape)
  return mem.finish(ops.attend(q, k, v, mask, q_pos, impl="dense"))


def test_select_by_backend():
  assert fk.select("gpu", jnp.bfloat16, 128, 7).name == "cudnn"
  assert fk.select("gpu", jnp.float32, 128, 2048) is None
  assert fk.select("gpu", jnp.bfloat16, 100, 2048) is None  # cuDNN: head_dim a multiple of 8
  assert fk.select("tpu", jnp.bfloat16, 100, 2048).name == "splash"
  assert fk.select("tpu", jnp.float32, 128, 2048).name == "splash"
  assert fk.select("tpu", jnp.bfloat16, 128, 1000) is None  # not whole blocks of 128
  assert fk.select("cpu", jnp.float32, 128, 2048) is None
  assert fk.select("cpu", jnp.bfloat16, 128, 2048) is None


def test_xla_call_layout():
  """The cuDNN call's layout (GQA heads, mask, scale 1) equals the reference, through
  jax.nn.dot_product_attention's XLA implementation."""
  q, k, v, mask = _window(3, 140, 2, 2, 8)
  got = fk.KERNELS["xla"].call(q, k, v, mask)
  valid = np.asarray(mask)[:, :, None, None, None]  # padding queries are don't-care
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, _dense(q, k, v, mask), 0), atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()


def test_splash_interpret_equals_dense(monkeypatch):
  """Splash (3 blocks of 128, GQA 2x2, head_dim 128, left and right padding) through the
  Pallas interpreter: forward and dq, dk, dv, with padding queries' cotangents zero."""
  monkeypatch.setattr(fk, "INTERPRET", True)
  q, k, v, mask = _window(2, 384, 2, 2, 128)
  w = jnp.asarray(np.random.default_rng(1).normal(0, 1, q.shape), jnp.float32) * mask[..., None, None, None]

  def loss(f):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, mask) * w), argnums=(0, 1, 2)))

  (_, grads), (_, want_grads) = loss(fk.KERNELS["splash"].call)(q, k, v), loss(_dense)(q, k, v)
  out, want = jax.jit(fk.KERNELS["splash"].call)(q, k, v, mask), _dense(q, k, v, mask)
  valid = np.asarray(mask)[:, :, None, None, None]
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, want, 0), atol=2e-6)  # measured 4e-7
  assert np.isfinite(np.asarray(out)).all()
  for got, ref in zip(grads, want_grads):  # measured: max error / max |ref| 5e-7 to 1e-6
    np.testing.assert_allclose(got, ref, atol=4e-6 * np.abs(ref).max())


def test_module_fused_runs_splash_under_a_mesh(monkeypatch):
  """The module with 'fused' runs the splash kernel (interpreted) and equals 'blockwise'."""
  monkeypatch.setattr(fk, "INTERPRET", True)
  b, t = 2, 128
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(0, 1, (b, t, 32)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  mask = jnp.asarray(np.arange(t)[None] >= np.array([[0], [3]]))  # row 1 left-padded
  mods = {impl: Attention(_cfg(attention_impl=impl, attention_block=32)) for impl in ("fused", "blockwise")}
  params = mods["blockwise"].init(jax.random.PRNGKey(0), x, positions, mask)
  mesh = jax.make_mesh((1,) * len(parallel.AXES), parallel.AXES, axis_types=(AxisType.Auto,) * len(parallel.AXES))

  def run(impl):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(parallel.DEFAULT_RULES):
      f = lambda p: mods[impl].apply(p, x, positions, mask)[0]
      return jax.jit(f)(params), str(jax.make_jaxpr(f)(params))

  (out, jaxpr), (want, _) = run("fused"), run("blockwise")
  assert "pallas_call" in jaxpr and "shard_map" in jaxpr
  valid = np.asarray(mask)[..., None]
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, want, 0), atol=1e-5)


def test_no_kernel_said_once(monkeypatch, caplog):
  """'fused' on CPU: one line, once per process, then blockwise."""
  monkeypatch.setattr(fk, "_noticed", False)
  cfg = _cfg(attention_impl="fused")
  with caplog.at_level(logging.WARNING, logger=fk.__name__):
    assert fk.for_window(cfg, 7) is None
    assert fk.for_window(cfg, 256) is None
  lines = [r.getMessage() for r in caplog.records if r.name == fk.__name__]
  assert lines == ["model.attention_impl='fused': no fused kernel on cpu for float32 (head_dim 8, window 7); "
                   "using blockwise"]
