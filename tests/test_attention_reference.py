"""The FoT memory layer against a NumPy re-derivation of docs/semantics.md, "Crossbatch (training)".

The reference below is written from the design text, row by row and head by head,
without using any fot_jax code: q/k/v projections (x @ kernel), HF rotate-half RoPE,
grouped-query heads, scale 1/sqrt(head_dim), a causal local window, extra contexts
= the unrotated keys and the values of the plan's source rows (fully visible,
masked where the source is -1 or the source token is masked out), one softmax over
[local | extra], then o_proj. With positions 'none' the memory layer uses no
rotary at all. It runs with xp=numpy (float64, forward checks) or xp=jax.numpy
(float32, gradient checks).
"""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fot_jax import crossbatch as cb
from fot_jax.model.attention import Attention
from fot_jax.model.config import get_size
from fot_jax.model.llama import LlamaModel

T = 5
HIDDEN = 32


def _cfg(**kw):
  kw.setdefault("num_layers", 1)
  kw.setdefault("mem_layers", (0,))
  return get_size("tiny", **kw)


# ----------------------------------------------------------------------------- the reference

def _rope(xp, x, positions, theta):
  """x [T, H, D], positions [T] -> HF rotate-half rotary."""
  d = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  freqs = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos = xp.asarray(np.cos(emb)[:, None, :], x.dtype)
  sin = xp.asarray(np.sin(emb)[:, None, :], x.dtype)
  rot = xp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
  return x * cos + rot * sin


def reference(params, x, positions, token_mask, sources, positive, cfg, xp=np,
              stop_gradient=False):
  """-> (out [B, T, hidden], rd_num, rd_den) for one memory-layer attention module."""
  dt = np.float64 if xp is np else jnp.float32
  p = {name: xp.asarray(params[name]["kernel"], dt) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
  x = xp.asarray(x, dt)
  positions = np.asarray(positions)
  token_mask = np.asarray(token_mask, bool)
  sources = np.asarray(sources)
  positive = np.asarray(positive, bool)
  b_size, t_len, _ = x.shape
  h_num, kv_num, d = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
  group = h_num // kv_num
  rotary = cfg.mem_positions != "none"
  outs, rd_num, rd_den = [], 0.0, 0
  for b in range(b_size):
    q = (x[b] @ p["q_proj"]).reshape(t_len, h_num, d)
    k = (x[b] @ p["k_proj"]).reshape(t_len, kv_num, d)
    v = (x[b] @ p["v_proj"]).reshape(t_len, kv_num, d)
    if rotary:
      q, k = _rope(xp, q, positions[b], cfg.rope_theta), _rope(xp, k, positions[b], cfg.rope_theta)
    keys, vals = [k], [v]
    visible = [np.tril(np.ones((t_len, t_len), bool)) & token_mask[b][None, :]]
    is_pos = [np.zeros(t_len, bool)]
    n_extra = 0
    for src, pos in zip(sources[b], positive[b]):
      if src < 0:
        continue
      ek = (x[src] @ p["k_proj"]).reshape(t_len, kv_num, d)  # unrotated: position 0 / none
      ev = (x[src] @ p["v_proj"]).reshape(t_len, kv_num, d)
      if stop_gradient:
        ek, ev = jax.lax.stop_gradient(ek), jax.lax.stop_gradient(ev)
      keys.append(ek)
      vals.append(ev)
      visible.append(np.broadcast_to(token_mask[src][None, :], (t_len, t_len)))
      is_pos.append(np.full(t_len, bool(pos)))
      n_extra += int(token_mask[src].sum())
    keys, vals = xp.concatenate(keys, 0), xp.concatenate(vals, 0)
    visible, is_pos = np.concatenate(visible, 1), np.concatenate(is_pos)
    extra_cols = np.arange(visible.shape[1]) >= t_len
    # Grouped-query: query head h reads kv head h // group.
    k_heads = xp.concatenate([keys[:, h // group][:, None] for h in range(h_num)], axis=1)
    v_heads = xp.concatenate([vals[:, h // group][:, None] for h in range(h_num)], axis=1)
    s = xp.einsum("thd,shd->hts", q, k_heads) / np.sqrt(d)  # [H, T, S]
    s = xp.where(visible[None], s, -1e30)
    e = xp.exp(s - xp.max(s, axis=-1, keepdims=True)) * visible[None]
    probs = e / xp.maximum(xp.sum(e, -1, keepdims=True), 1e-30)
    heads = xp.einsum("hts,shd->thd", probs, v_heads).reshape(t_len, h_num * d)
    if n_extra and xp is np:
      for h in range(h_num):
        for t in range(t_len):
          if token_mask[b, t]:
            rd_num += probs[h, t, extra_cols & is_pos].sum() / probs[h, t, extra_cols].sum() / h_num
    if n_extra:
      rd_den += int(token_mask[b].sum())
    outs.append(heads @ p["o_proj"])
  return xp.stack(outs), rd_num, rd_den


# ----------------------------------------------------------------------------- helpers

def _params(cfg, batch, seed=0, scale=0.2):
  """The module's parameter shapes, filled with kernels larger than the init ones (O(1)
  scores, so position and masking errors are visible at tight tolerances)."""
  mod = Attention(cfg, is_memory=True)
  x = jnp.zeros((batch, T, cfg.hidden_size))
  pos = jnp.zeros((batch, T), jnp.int32)
  variables = flax.linen.meta.unbox(
      jax.eval_shape(mod.init, jax.random.PRNGKey(0), x, pos, jnp.ones((batch, T), bool)))
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map(
      lambda a: jnp.asarray(rng.normal(0, scale, a.shape), jnp.float32), variables["params"])
  return mod, params


def _inputs(batch, seed=1, masked=False):
  rng = np.random.default_rng(seed)
  x = rng.normal(0, 1, (batch, T, HIDDEN)).astype(np.float32)
  # Row-dependent offsets: memory keys must not depend on their row's positions.
  positions = (np.arange(T)[None, :] + 3 * np.arange(batch)[:, None]).astype(np.int32)
  mask = np.ones((batch, T), bool)
  if masked:
    mask[1, 3:] = False  # right padding in a source / query row
    mask[2, 0] = False  # left padding
    mask[-1, 1] = False
    mask[0, 1:] = False  # a mostly masked source row: only its first token is a key
  return x, positions, mask


def _module(mod, params, x, positions, mask, plan):
  out, aux = mod.apply({"params": params}, jnp.asarray(x), jnp.asarray(positions),
                       jnp.asarray(mask), plan=None if plan is None else plan.as_tuple())
  return np.asarray(out), aux


# All with 6 rows (eager JAX reuses its per-op compilations across tests).
PLANS = {
    "analysis_d2_w1": lambda: cb.analysis_plan(6, 2, 1),  # 3 slots, rows 0/2/4 have no sources
    "analysis_d3_w1": lambda: cb.analysis_plan(6, 3, 1),  # two negatives per last window
    "segments": lambda: cb.segments_plan(6, [(0, 0), (1, 1), (2, 1)]),  # 2 slots, k = 3
}


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("positions_mode", ["first", "none"])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_reference(positions_mode, plan_name, masked):
  plan = PLANS[plan_name]()
  batch = plan.sources.shape[0]
  cfg = _cfg(mem_positions=positions_mode)
  mod, params = _params(cfg, batch)
  x, positions, mask = _inputs(batch, masked=masked)
  out, aux = _module(mod, params, x, positions, mask, plan)
  want, rd_num, rd_den = reference(params, x, positions, mask, plan.sources, plan.positive, cfg)
  valid = mask[..., None]  # outputs of masked-out query tokens are don't-care
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, want, 0), atol=2e-5, rtol=1e-4)
  assert out.shape == (batch, T, HIDDEN)
  # r_d: positive mass / all extra mass, per head and valid query of rows with extra context.
  assert float(aux["rd_den"]) == rd_den
  np.testing.assert_allclose(float(aux["rd_num"]), rd_num, rtol=1e-4, atol=1e-6)
  r_d = float(aux["rd_num"]) / float(aux["rd_den"])
  assert 0.0 < r_d < 1.0


def test_row_without_extra_context_is_plain_attention():
  cfg = _cfg()
  plan = cb.analysis_plan(6, 2, 1)
  mod, params = _params(cfg, 6)
  x, positions, mask = _inputs(6)
  out, _ = _module(mod, params, x, positions, mask, plan)
  plain, _ = Attention(cfg, is_memory=False).apply({"params": params}, jnp.asarray(x),
                                                  jnp.asarray(positions), jnp.asarray(mask))
  plain = np.asarray(plain)
  no_src = (plan.sources < 0).all(1)
  assert no_src.any() and (~no_src).any()
  np.testing.assert_allclose(out[no_src], plain[no_src], atol=1e-6)
  assert np.abs(np.asarray(out[~no_src]) - np.asarray(plain[~no_src])).max() > 1e-3


def test_memory_keys_carry_no_position():
  """'first': a row's output does not change when its sources' positions change,
  but does when its own positions change (queries/local keys are rotated)."""
  cfg = _cfg(mem_positions="first")
  plan = cb.analysis_plan(6, 2, 1)
  mod, params = _params(cfg, 6)
  x, positions, mask = _inputs(6)
  out, _ = _module(mod, params, x, positions, mask, plan)
  moved = positions.copy()
  moved[[0, 2, 4]] += 17  # the source rows of rows 1, 3, 5
  out2, _ = _module(mod, params, x, moved, mask, plan)
  np.testing.assert_allclose(out[[1, 3, 5]], out2[[1, 3, 5]], atol=1e-6)
  # Shifting *every* position of row 1 by the same amount changes its output only
  # through the relative position to memory keys (which stay at 0).
  own = positions.copy()
  own[1] += 7
  out3, _ = _module(mod, params, x, own, mask, plan)
  assert np.abs(np.asarray(out3[1]) - np.asarray(out[1])).max() > 1e-4


def test_none_mode_is_translation_free():
  """'none': no rotary in the memory layer, so positions do not matter at all."""
  cfg = _cfg(mem_positions="none")
  plan = PLANS["segments"]()
  mod, params = _params(cfg, 6)
  x, positions, mask = _inputs(6)
  out, _ = _module(mod, params, x, positions, mask, plan)
  out2, _ = _module(mod, params, x, positions * 5 + 11, mask, plan)
  np.testing.assert_allclose(out, out2, atol=1e-6)
  # Other layers keep RoPE even when the memory layers use none.
  plain = Attention(cfg, is_memory=False)
  a, _ = plain.apply({"params": params}, jnp.asarray(x), jnp.asarray(positions), jnp.asarray(mask))
  b, _ = plain.apply({"params": params}, jnp.asarray(x), jnp.asarray(positions * 5 + 11),
                     jnp.asarray(mask))
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4


# ----------------------------------------------------------------------------- gradients

def _weights(batch, mask, rows=None, seed=7):
  r = np.random.default_rng(seed).normal(0, 1, (batch, T, HIDDEN)).astype(np.float32)
  r = r * mask[..., None]
  if rows is not None:
    keep = np.zeros(batch, bool)
    keep[list(rows)] = True
    r = r * keep[:, None, None]
  return jnp.asarray(r)


@pytest.mark.parametrize("positions_mode,plan_name,masked,stop_gradient", [
    ("first", "analysis_d2_w1", True, False),
    ("first", "segments", False, True),
    ("none", "segments", True, False),
    ("none", "analysis_d3_w1", False, True),
])
@pytest.mark.optimized_xla
def test_gradients_match_jax_reference(positions_mode, plan_name, masked, stop_gradient):
  plan = PLANS[plan_name]()
  batch = plan.sources.shape[0]
  cfg = _cfg(mem_positions=positions_mode, mem_stop_gradient=stop_gradient)
  mod, params = _params(cfg, batch)
  x, positions, mask = _inputs(batch, masked=masked)
  weights = _weights(batch, mask)

  def loss_module(params, x):
    out, _ = mod.apply({"params": params}, x, jnp.asarray(positions), jnp.asarray(mask),
                       plan=plan.as_tuple())
    return jnp.sum(out * weights)

  def loss_ref(params, x):
    out, _, _ = reference(params, x, positions, mask, plan.sources, plan.positive, cfg, xp=jnp,
                          stop_gradient=stop_gradient)
    return jnp.sum(out * weights)

  x = jnp.asarray(x)
  # jitted: one program each (op by op, the reference's per-row loops compile hundreds)
  l_mod, g_mod = jax.jit(jax.value_and_grad(loss_module, argnums=(0, 1)))(params, x)
  l_ref, g_ref = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1)))(params, x)
  np.testing.assert_allclose(float(l_mod), float(l_ref), rtol=1e-5)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    a, b = np.asarray(g_mod[0][name]["kernel"]), np.asarray(g_ref[0][name]["kernel"])
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max(), rtol=1e-3, err_msg=name)
  a, b = np.asarray(g_mod[1]), np.asarray(g_ref[1])
  np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max(), rtol=1e-3, err_msg="x")


def test_reference_gradient_against_finite_differences():
  """Sanity check of the jnp reference itself, in float64 NumPy finite differences."""
  cfg = _cfg()
  plan = cb.analysis_plan(6, 2, 1)
  _, params = _params(cfg, 6)
  x, positions, mask = _inputs(6, masked=True)
  weights = np.asarray(_weights(6, mask, rows=[1]))

  def f_np(x):
    out, _, _ = reference(params, x, positions, mask, plan.sources, plan.positive, cfg)
    return float(np.sum(out * weights))

  g = np.asarray(jax.grad(lambda x: jnp.sum(
      reference(params, x, positions, mask, plan.sources, plan.positive, cfg, xp=jnp)[0] * weights))(
          jnp.asarray(x)))
  rng = np.random.default_rng(3)
  x64 = x.astype(np.float64)
  for row in (1, 0, 2):  # the query row, its positive, its negative
    for _ in range(3):
      t, c = rng.integers(T), rng.integers(HIDDEN)
      if not mask[row, t]:
        continue
      eps = 1e-5
      xp_, xm_ = x64.copy(), x64.copy()
      xp_[row, t, c] += eps
      xm_[row, t, c] -= eps
      fd = (f_np(xp_) - f_np(xm_)) / (2 * eps)
      np.testing.assert_allclose(g[row, t, c], fd, rtol=2e-3, atol=2e-5)


@pytest.mark.optimized_xla
def test_gradients_reach_negatives_and_stop_gradient_blocks_them():
  # analysis d=2, w=1, 3 slots: row 1 sees row 0 (positive) and row 2 (negative).
  plan = cb.analysis_plan(6, 2, 1)
  assert plan.sources[1].tolist() == [0, 2] and plan.positive[1].tolist() == [True, False]
  x, positions, mask = _inputs(6)
  weights = _weights(6, mask, rows=[1])  # only row 1's output enters the scalar

  def grads(stop):
    cfg = _cfg(mem_stop_gradient=stop)
    mod, params = _params(cfg, 6)

    def loss(x):
      out, _ = mod.apply({"params": params}, x, jnp.asarray(positions), jnp.asarray(mask),
                         plan=plan.as_tuple())
      return jnp.sum(out * weights), out

    (_, out), g = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(x))
    return np.asarray(out), np.abs(np.asarray(g)).reshape(6, -1).max(1)

  out, g = grads(False)
  assert g[2] > 1e-4, "no gradient into the negative source row"
  assert g[0] > 1e-4, "no gradient into the positive source row"
  assert g[1] > 1e-4
  np.testing.assert_array_equal(g[[3, 4, 5]], 0.0)  # rows row 1 never sees

  out_sg, g_sg = grads(True)
  np.testing.assert_allclose(out_sg, out, atol=0, rtol=0)
  assert g_sg[2] == 0.0 and g_sg[0] == 0.0
  assert g_sg[1] > 1e-4
  np.testing.assert_array_equal(g_sg[[3, 4, 5]], 0.0)


# ----------------------------------------------------------------------------- full model

def _apply(model, variables, tokens, plan=None):
  return model.apply(variables, tokens, plan=plan)


def _model_setup(**kw):
  cfg = get_size("tiny", **kw)  # 3 layers, memory layer 1, GQA 4/2 heads
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (6, 8)), jnp.int32)
  model = LlamaModel(cfg)
  shapes = flax.linen.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens))
  rng = np.random.default_rng(5)
  # Random weights (norm weights around 1) instead of a compiled init.
  variables = jax.tree_util.tree_map_with_path(
      lambda path, a: jnp.asarray(rng.normal(0, 0.1, a.shape)
                                  + (jax.tree_util.keystr(path).endswith("['weight']")), jnp.float32),
      shapes)
  return cfg, model, variables, tokens


def test_no_plan_is_plain_llama():
  cfg, model, variables, tokens = _model_setup()
  logits_none, aux = _apply(model, variables, tokens, plan=None)
  plain_cfg = get_size("tiny", mem_layers=())
  plain_vars = flax.linen.meta.unbox(
      jax.eval_shape(LlamaModel(plain_cfg).init, jax.random.PRNGKey(1), tokens))
  # Default memory options add no parameters: the trees are identical.
  assert (jax.tree_util.tree_structure(plain_vars) == jax.tree_util.tree_structure(variables))
  logits_plain, _ = _apply(LlamaModel(plain_cfg), variables, tokens)
  np.testing.assert_allclose(logits_none, logits_plain, atol=1e-6)
  assert float(aux["rd_den"]) == 0.0
  # ...while a non-empty plan changes exactly the rows that have sources.
  plan = cb.analysis_plan(6, 2, 1)
  logits_plan, aux = _apply(model, variables, tokens, plan=plan.as_tuple())
  has = (plan.sources >= 0).any(1)
  np.testing.assert_allclose(logits_plan[~has], logits_plain[~has], atol=1e-6)
  assert np.abs(np.asarray(logits_plan[has]) - np.asarray(logits_plain[has])).max() > 1e-4
  assert float(aux["rd_den"]) == has.sum() * tokens.shape[1]


def test_none_positions_memory_layer_differs_from_plain_llama():
  _, model, variables, tokens = _model_setup(mem_positions="none")
  logits, _ = _apply(model, variables, tokens)
  plain, _ = _apply(LlamaModel(get_size("tiny", mem_layers=())), variables, tokens)
  np.testing.assert_allclose(logits[:, 0], plain[:, 0], atol=1e-6)  # one token: nothing to rotate
  assert np.abs(np.asarray(logits[:, 1:]) - np.asarray(plain[:, 1:])).max() > 1e-4


def test_model_rd_over_memory_layers():
  _, model, variables, tokens = _model_setup(mem_layers=(0, 2))
  only_pos, aux1 = _apply(model, variables, tokens, plan=cb.analysis_plan(6, 1, 2).as_tuple())
  np.testing.assert_allclose(float(aux1["rd_num"]) / float(aux1["rd_den"]), 1.0, rtol=1e-6)
  assert float(aux1["rd_den"]) == 2 * 2 * tokens.shape[1]  # 2 layers x 2 last windows x T
  _, aux2 = _apply(model, variables, tokens, plan=cb.analysis_plan(6, 2, 2).as_tuple())
  r_d = float(aux2["rd_num"]) / float(aux2["rd_den"])
  assert 0.0 < r_d < 1.0


@pytest.mark.parametrize("make_plan", [lambda: cb.empty_plan(6), lambda: cb.plan_from_spec(6, {}),
                                       lambda: cb.analysis_plan(6, 1, 0)],
                         ids=["empty_plan", "spec_none", "analysis_d1_w0"])
def test_empty_plan_equals_no_plan(make_plan):
  plan = make_plan()
  assert plan.sources.shape == (6, 0)
  _, model, variables, tokens = _model_setup()
  logits_none, _ = _apply(model, variables, tokens, plan=None)
  logits_empty, aux = _apply(model, variables, tokens, plan=plan.as_tuple())
  np.testing.assert_allclose(logits_empty, logits_none, atol=1e-6)
  assert float(aux["rd_den"]) == 0.0
