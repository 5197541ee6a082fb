"""'blocks' memory mode (InfLLM-style retrieval of whole memory blocks): docs/block_memory.md."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fot_jax.inference import MemoryInference
from fot_jax.model import attention_ops as ops
from fot_jax.model import memory as mem
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

T = 8


def _params(cfg):
  # Larger weights than the default init: attention far from uniform, so a missing key shows.
  return jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, init_params(cfg, 0))


def test_every_block_retrieved_equals_dense_memory():
  """block_size 6 does not divide the window: blocks span windows and the last is partly dead;
  a padded row leaves dead slots mid-memory and dead queries in its last window."""
  cfg = get_size("tiny", mem_layers=(1,))
  params = _params(cfg)
  toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5 * T)).astype(np.int32)
  mask = np.ones(toks.shape, bool)
  mask[1, 2 * T + 3:] = False
  dense = MemoryInference(cfg, params, T, "dense")
  blocks = MemoryInference(cfg, params, T, "blocks", block_size=6, block_reps=2, block_topk=11)
  a = dense.process(toks, dense.new_memory(2, 64), mask)
  b = blocks.process(toks, blocks.new_memory(2, 64), mask)  # 64 slots: 11 blocks of 6, all retrieved
  np.testing.assert_allclose(b[0], a[0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(b[1, :2 * T + 3], a[1, :2 * T + 3], atol=1e-5, rtol=1e-5)


def test_every_block_retrieved_gives_dense_r_d():
  rng = np.random.default_rng(1)
  b, t, kv, g, d, m = 2, 4, 2, 2, 8, 20
  q = jnp.asarray(rng.normal(size=(b, t, kv, g, d)), jnp.float32)
  block = mem.MemoryBlock(jnp.asarray(rng.normal(size=(1, m, kv, d)), jnp.float32),
                          jnp.asarray(rng.normal(size=(1, m, kv, d)), jnp.float32),
                          jnp.asarray(rng.random((b, m)) < 0.8), jnp.asarray(rng.random((b, m)) < 0.5))
  got = mem.block_memory_partial(q, [block], mem.BlockSpec(4, 2, 5), jnp.ones((b, t), bool))
  want = ops.attend_memory(q, [block], 8)
  np.testing.assert_allclose(mem.finish(got), mem.finish(want), atol=1e-5)
  np.testing.assert_allclose(got.pos / got.l, want.pos / want.l, atol=1e-5)


def _onehot_values(n, size, kv, d):
  """Every slot of block j holds value e_j: attention output = the chosen blocks' mix."""
  v = np.zeros((1, n * size, kv, d), np.float32)
  for j in range(n):
    v[0, j * size:(j + 1) * size, :, j] = 1.0
  return jnp.asarray(v)


def test_retrieval_picks_the_block_holding_the_matching_key():
  rng = np.random.default_rng(2)
  n, size, kv, g, d, t = 6, 4, 2, 2, 8, 5
  direction = rng.normal(size=(kv, d))
  direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
  q = direction[None, None, :, None, :] + 0.3 * rng.normal(size=(1, t, kv, g, d))  # noisy queries
  keys = 0.3 * rng.normal(size=(1, n * size, kv, d))
  keys[0, 2 * size + 1, 0] = 3 * direction[0]  # kv head 0: block 2; kv head 1: block 4
  keys[0, 4 * size + 3, 1] = 3 * direction[1]
  ortho = rng.normal(size=(kv, d))
  ortho -= np.sum(ortho * direction, -1, keepdims=True) * direction
  keys[0, 5 * size, :] = 50 * ortho / np.linalg.norm(ortho, axis=-1, keepdims=True)  # distractor: block 5
  block = mem.MemoryBlock(jnp.asarray(keys, jnp.float32), _onehot_values(n, size, kv, d),
                          jnp.ones((1, n * size), bool))
  qmask = jnp.ones((1, t), bool)
  out = mem.finish(mem.block_memory_partial(jnp.asarray(q, jnp.float32), [block], mem.BlockSpec(size, 1, 1),
                                            qmask))  # [1, T, KV, G, D]
  np.testing.assert_allclose(out[0, :, 0, :, :n], np.broadcast_to(np.eye(n)[2], (t, g, n)), atol=1e-6)
  np.testing.assert_allclose(out[0, :, 1, :, :n], np.broadcast_to(np.eye(n)[4], (t, g, n)), atol=1e-6)
  # Two blocks: the planted one and another, never the distractor.
  out = mem.finish(mem.block_memory_partial(jnp.asarray(q, jnp.float32), [block], mem.BlockSpec(size, 2, 2),
                                            qmask))
  weight = np.asarray(out[0, :, :, :, :n]).sum(axis=(0, 2))  # [KV, blocks]
  assert (weight[0, 2] > 0) and (weight[1, 4] > 0) and (weight[:, 5] == 0).all()
  assert ((weight > 0).sum(-1) == 2).all()


def test_dead_slots_and_blocks_are_never_chosen():
  """Blocks 0-1 and half of block 2 are live; the dead slots hold the best-matching keys, block 0
  the best live one."""
  rng = np.random.default_rng(3)
  n, size, kv, g, d, t = 6, 4, 2, 1, 8, 3
  q = rng.normal(size=(1, t, kv, g, d))
  keys = 0.1 * rng.normal(size=(1, n * size, kv, d))
  keys[0, 1] = 2 * q.mean(axis=(1, 3))[0]
  keys[0, 2 * size + 3:] = 10 * q.mean(axis=(1, 3))
  live = np.zeros((1, n * size), bool)
  live[0, :2 * size + 2] = True
  block = mem.MemoryBlock(jnp.asarray(keys, jnp.float32), _onehot_values(n, size, kv, d), jnp.asarray(live))
  q, qmask = jnp.asarray(q, jnp.float32), jnp.ones((1, t), bool)
  out = mem.finish(mem.block_memory_partial(q, [block], mem.BlockSpec(size, 4, 1), qmask))
  np.testing.assert_allclose(out[..., :n], np.broadcast_to(np.eye(n)[0], (1, t, kv, g, n)), atol=1e-6)
  # More blocks asked for than are live: the live keys only, as dense attention over them.
  out = mem.finish(mem.block_memory_partial(q, [block], mem.BlockSpec(size, 2, 5), qmask))
  dense = mem.block_partial(mem.scores(q, block.keys), jnp.asarray(live)[:, None, None, None], block.values)
  np.testing.assert_allclose(out, mem.finish(dense), atol=1e-6)


@pytest.mark.parametrize("field", ["block_size", "block_reps", "block_topk"])
@pytest.mark.parametrize("value", [0, -1])
def test_bad_block_parameters_name_the_field(field, value):
  cfg = get_size("tiny")
  with pytest.raises(ValueError, match=f"inference.{field}: must be a positive integer"):
    MemoryInference(cfg, None, T, "blocks", **{field: value})
  with pytest.raises(ValueError, match="inference.block_topk"):
    mem.block_spec(0)  # the model's own check: an int mem_topk is block_topk
