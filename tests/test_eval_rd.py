"""r_d of the evaluation suite: exact on a crafted model, and equal to the training-time
crossbatch metric (the analysis plan (d, w)) on a random one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fot_jax import crossbatch
from fot_jax.eval.rd import positive_attention_mass
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel

T = 8


def _docs(cfg, n, w, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, cfg.vocab_size, (w + 1) * T).astype(np.int32) for _ in range(n)]


def test_uniform_attention_gives_exactly_one_over_d():
  # Zero query projection in the memory layer: every memory score is 0, so attention
  # spreads evenly over the d * w * T memory entries, of which w * T are positives.
  cfg = get_size("tiny")
  params = init_params(cfg, 0)
  layer = f"layers_{cfg.mem_layers[0]}"
  params[layer]["self_attn"]["q_proj"]["kernel"] = jnp.zeros_like(params[layer]["self_attn"]["q_proj"]["kernel"])
  res = positive_attention_mass(cfg, params, _docs(cfg, 5, 2), T, ds=(1, 2, 5), context_windows=2, batch=5)
  np.testing.assert_allclose(res["r_d"], [1.0, 0.5, 0.2], rtol=1e-5)  # float32 sums
  assert res["queries"] == [5 * T] * 3


@pytest.mark.parametrize("positions", ["first", "none"])
def test_rd_equals_crossbatch_metric(positions):
  cfg = get_size("tiny", mem_positions=positions)
  params = jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, init_params(cfg, 1))
  n, w = 4, 1
  docs = _docs(cfg, n, w, seed=2)
  res = positive_attention_mass(cfg, params, docs, T, ds=(1, 2, 3, 4), context_windows=w, batch=4)
  tokens = jnp.asarray(np.concatenate([d.reshape(w + 1, T) for d in docs]))  # slot s = rows s*(w+1)...
  for d, got in zip(res["d"], res["r_d"]):
    plan = crossbatch.analysis_plan(len(tokens), d=d, w=w)
    _, aux = LlamaModel(cfg).apply({"params": params}, tokens, plan=plan.as_tuple())
    want = float(aux["rd_num"] / aux["rd_den"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
  assert res["r_d"][0] == pytest.approx(1.0)
  assert res["r_d"][-1] < 0.9  # random weights: the measure can fall below 1


def test_rd_rejects_too_few_documents():
  cfg = get_size("tiny")
  with pytest.raises(ValueError, match="at least that many documents"):
    positive_attention_mass(cfg, init_params(cfg, 0), _docs(cfg, 2, 1), T, ds=(1, 4))
