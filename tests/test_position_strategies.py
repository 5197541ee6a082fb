"""Self-Extend and LM-Infinite against a NumPy re-derivation from the papers' definitions.

The reference is written per (query i, key j) from the relative distance each method
assigns, without fot_jax code: RoPE depends only on the distance, so a pair's score is
(R(r_ij) q_i) . k_j / sqrt(d) with the unrotated key (HF rotate-half layout).
* Self-Extend: r = d for d < W, else (i // G + W - W // G) - j // G; all causal keys visible.
* LM-Infinite: r = min(d, L); key j visible if j < G or d < M (and causal).
"""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fot_jax.model import position_strategies
from fot_jax.model.attention import Attention
from fot_jax.model.attention_rotated import attend_rotated
from fot_jax.model.config import ModelConfig
from fot_jax.model.memory import finish

T = 12
SELF_EXTEND = {"kind": "self_extend", "window": 4, "group": 3}
LM_INFINITE = {"kind": "lm_infinite", "global_tokens": 2, "local_window": 4, "max_distance": 6}


def _cfg(**kw):
  return ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=4,
                     num_kv_heads=2, **kw)


def _distance_and_visible(strategy, t):
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  d = i - j
  visible = d >= 0
  if strategy is None:
    return d, visible
  if strategy["kind"] == "self_extend":
    w, g = strategy["window"], strategy["group"]
    return np.where(d < w, d, (i // g + w - w // g) - j // g), visible
  keep = (j < strategy["global_tokens"]) | (d < strategy["local_window"])
  return np.minimum(d, strategy["max_distance"]), visible & keep


def _rotate(x, angle):
  """x [..., D] rotated by angle [..., D/2] (rotate-half layout)."""
  half = x.shape[-1] // 2
  cos, sin = np.cos(np.concatenate([angle, angle], -1)), np.sin(np.concatenate([angle, angle], -1))
  return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def reference(params, x, cfg, strategy, factor=1.0):
  p = {n: np.asarray(params[n]["kernel"], np.float64) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
  b, t, _ = x.shape
  h, kv, d = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
  inv_freq = cfg.rope_theta ** (-np.arange(0, d, 2) / d) / factor
  dist, visible = _distance_and_visible(strategy, t)
  out = np.zeros((b, t, h * d))
  for row in range(b):
    q = (x[row] @ p["q_proj"]).reshape(t, h, d)
    k = (x[row] @ p["k_proj"]).reshape(t, kv, d)
    v = (x[row] @ p["v_proj"]).reshape(t, kv, d)
    for head in range(h):
      s = np.full((t, t), -np.inf)
      for i in range(t):
        for j in range(t):
          if visible[i, j]:
            s[i, j] = _rotate(q[i, head], dist[i, j] * inv_freq) @ k[j, head // (h // kv)] / np.sqrt(d)
      w = np.exp(s - s.max(-1, keepdims=True))
      out[row, :, head * d:(head + 1) * d] = (w / w.sum(-1, keepdims=True)) @ v[:, head // (h // kv)]
  return out @ p["o_proj"]


def _run(cfg, x):
  mod = Attention(cfg)
  b, t, _ = x.shape
  pos, mask = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), bool)
  variables = flax.linen.meta.unbox(jax.eval_shape(mod.init, jax.random.PRNGKey(0), x, pos, mask))
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), jnp.float32),
                                  variables["params"])
  out, _ = mod.apply({"params": params}, jnp.asarray(x, jnp.float32), pos, mask)
  return np.asarray(out), params


@pytest.mark.parametrize("strategy", [SELF_EXTEND, LM_INFINITE], ids=["self_extend", "lm_infinite"])
@pytest.mark.parametrize("scaling,impl", [((), "dense"), ({"rope_type": "linear", "factor": 2.0}, "dense"),
                                          ((), "blockwise")], ids=["rope", "linear", "streamed"])
def test_strategy_equals_numpy_rederivation(strategy, scaling, impl):
  """'streamed': blocks of 5 over 12 tokens (ragged query chunks and key blocks, skipped pairs)."""
  x = np.random.default_rng(1).normal(size=(2, T, 32))
  cfg = _cfg(position_strategy=strategy, rope_scaling=scaling, attention_impl=impl, attention_block=5)
  cfg.validate()
  ours, params = _run(cfg, x)
  factor = dict(cfg.rope_scaling).get("factor", 1.0)
  np.testing.assert_allclose(ours, reference(params, x, cfg, strategy, factor), atol=2e-5)
  # the strategy changes the output at this length: plain attention differs
  assert np.abs(reference(params, x, cfg, None, factor) - ours).max() > 1e-3


@pytest.mark.parametrize("strategy", [dict(SELF_EXTEND, window=T), dict(LM_INFINITE, local_window=T, max_distance=T)],
                         ids=["self_extend", "lm_infinite"])
def test_within_the_window_both_are_plain_attention(strategy):
  x = np.random.default_rng(2).normal(size=(2, T, 32))
  ours, params = _run(_cfg(position_strategy=strategy), x)
  plain, _ = _run(_cfg(), x)
  np.testing.assert_allclose(ours, plain, atol=1e-5)
  np.testing.assert_allclose(plain, reference(params, x, _cfg(), None), atol=2e-5)


@pytest.mark.parametrize("spec,words", [
    ({"kind": "stream"}, "kind must be one of"),
    ({"kind": "self_extend", "window": 4}, "self_extend takes exactly ['window', 'group']"),
    ({"kind": "lm_infinite", "global_tokens": 2, "local_window": 0, "max_distance": 6}, "local_window must be"),
])
def test_bad_strategy_is_refused(spec, words):
  with pytest.raises(ValueError) as info:
    _cfg(position_strategy=spec).validate()
  assert str(info.value).startswith("model.position_strategy: ") and words in str(info.value)


@pytest.mark.parametrize("strategy", [SELF_EXTEND, LM_INFINITE], ids=["self_extend", "lm_infinite"])
def test_streamed_equals_dense_with_padding_and_gradients(strategy):
  """Streamed (blocks of 5: ragged last block, 3 query chunks) against the materialised scores,
  in a memory layer whose window merges with a crossbatch context (so the log-sum-exp of the
  streamed partial gets a cotangent), with padding: row 1's first queries see no local key,
  only row 0's window. Outputs and the gradients with respect to the input and the weights."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, T, 32)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  mask = jnp.asarray([np.arange(T) < 9, np.arange(T) >= 3])  # right padding; left (keys real tokens must not see)
  plan = (jnp.asarray([[1], [0]], jnp.int32), jnp.asarray([[False], [False]]))
  cfg = lambda impl: _cfg(position_strategy=strategy, attention_impl=impl, attention_block=5, mem_layers=(0,))
  variables = flax.linen.meta.unbox(jax.eval_shape(Attention(cfg("dense"), is_memory=True).init,
                                                   jax.random.PRNGKey(0), x, pos, mask, plan))
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), jnp.float32),
                                  variables["params"])
  weights = jnp.sin(jnp.arange(2 * T * 32, dtype=jnp.float32)).reshape(2, T, 32)

  def loss(impl):
    mod = Attention(cfg(impl), is_memory=True)
    return lambda p, x: jnp.sum(mod.apply({"params": p}, x, pos, mask, plan)[0] * weights)

  want = jax.value_and_grad(loss("dense"), argnums=(0, 1))(params, x)
  got = jax.jit(jax.value_and_grad(loss("blockwise"), argnums=(0, 1)))(params, x)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(np.abs(b).max())), rtol=1e-4)


def test_streamed_training_keeps_no_per_block_scores():
  """The custom VJP recomputes scores in the backward pass: the compiled gradient's temporaries
  stay under half of one [G, T, T] score matrix (JAX's own differentiation of the stream keeps
  every block's scores: 11.6 MiB here, against 0.28 MiB)."""
  r, b, t, kv, g, d = 2, 1, 512, 1, 2, 8
  choose = lambda qp, kp: position_strategies.choice_visible(tuple(sorted(SELF_EXTEND.items())), qp, kp)
  pos, mask = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), bool)
  f = lambda qs, ks, v: jnp.sum(finish(attend_rotated(qs, ks, v, mask, pos, pos, choose, 32)))
  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((r, b, t, kv, g, d), (r, b, t, kv, d), (b, t, kv, d))]
  compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*shapes).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < g * t * t * 4 / 2
