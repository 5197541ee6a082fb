"""Memory inference against the training-time crossbatch forward and plain attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fot_jax import crossbatch
from fot_jax.inference import MemoryInference
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel

T = 8


def _params(cfg, seed=0):
  params = init_params(cfg, seed)
  # Larger weights than the default init so attention is far from uniform and any
  # mismatch in which keys are visible shows up in the logits.
  return jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, params)


@pytest.mark.parametrize("positions", ["first", "none"])
@pytest.mark.parametrize("mem_layers", [(1,), (0, 2)])
def test_memory_of_positives_equals_crossbatch_forward(positions, mem_layers):
  cfg = get_size("tiny", mem_positions=positions, mem_layers=mem_layers)
  params = _params(cfg)
  w, slots = 2, 3
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (slots * (w + 1), T)).astype(np.int32)
  if len(mem_layers) == 1:
    plan = crossbatch.analysis_plan(len(tokens), d=1, w=w)  # the last window sees its positives
  else:
    # With several memory layers, window j's keys in a higher memory layer depend on what
    # window j saw in the lower one, so every window must see its own earlier windows, as at
    # inference: segments (0,0), (1,0), (2,0).
    plan = crossbatch.segments_plan(len(tokens), [(j, 0) for j in range(w + 1)])
  train_logits, _ = LlamaModel(cfg).apply({"params": params}, jnp.asarray(tokens), plan=plan.as_tuple())
  infer = MemoryInference(cfg, params, window=T, mode="dense")
  for s in range(slots):
    stream = tokens[s * (w + 1):(s + 1) * (w + 1)].reshape(1, -1)  # the slot's windows in order
    logits = infer.process(stream, infer.new_memory(1))
    last = (s + 1) * (w + 1) - 1
    np.testing.assert_allclose(logits[0, w * T:], np.asarray(train_logits[last]), atol=2e-5, rtol=1e-5)


def test_negatives_in_memory_match_crossbatch_with_negatives():
  """Memory = positives + another slot's windows equals the d=2 crossbatch row."""
  cfg = get_size("tiny", mem_layers=(1,))
  params = _params(cfg)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, cfg.vocab_size, (4, T)).astype(np.int32)  # 2 slots x 2 windows
  plan = crossbatch.analysis_plan(4, d=2, w=1)
  train_logits, _ = LlamaModel(cfg).apply({"params": params}, jnp.asarray(tokens), plan=plan.as_tuple())
  infer = MemoryInference(cfg, params, window=T, mode="dense")
  memory = infer.new_memory(1)
  infer.process(tokens[2:3], memory)  # slot 1's first window (the negative)
  logits = infer.process(tokens[0:2].reshape(1, -1), memory)  # slot 0's windows
  np.testing.assert_allclose(logits[0, T:], np.asarray(train_logits[1]), atol=2e-5, rtol=1e-5)


def test_topk_with_k_covering_memory_equals_dense():
  cfg = get_size("tiny", mem_layers=(1,))
  params = _params(cfg)
  toks = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 5 * T)).astype(np.int32)
  dense = MemoryInference(cfg, params, T, "dense")
  topk = MemoryInference(cfg, params, T, "topk", topk=4 * T, chunk=T)
  a = dense.process(toks, dense.new_memory(2))
  b = topk.process(toks, topk.new_memory(2))
  np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_dense_memory_in_small_chunks_skips_dead_ones_and_equals_one_chunk():
  """Memory capacity (1,024) far above its fill: chunks of T are mostly dead and skipped."""
  cfg = get_size("tiny", mem_layers=(1,))
  params = _params(cfg)
  toks = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 5 * T)).astype(np.int32)
  whole = MemoryInference(cfg, params, T, "dense")
  chunked = MemoryInference(cfg, params, T, "dense", chunk=T)
  np.testing.assert_allclose(chunked.process(toks, chunked.new_memory(2)), whole.process(toks, whole.new_memory(2)),
                             atol=2e-5, rtol=1e-5)


def test_topk_selects_the_best_keys():
  """With k < memory, top-k keeps only the k highest-scoring entries (NumPy check on one layer); a
  chunk with no live entry (16-31) is skipped, a partly live one is searched."""
  from fot_jax.model import memory as mem
  rng = np.random.default_rng(3)
  q = rng.normal(size=(1, 3, 1, 2, 4)).astype(np.float32)  # [B, T, KV, G, D]
  k = rng.normal(size=(1, 50, 1, 4)).astype(np.float32)
  v = rng.normal(size=(1, 50, 1, 4)).astype(np.float32)
  live = np.ones((1, 50), bool)
  live[0, 7] = False
  live[0, 16:32] = False
  part = mem.topk_memory_partial(jnp.asarray(q), [mem.MemoryBlock(jnp.asarray(k), jnp.asarray(v),
                                                                  jnp.asarray(live))], k=5, chunk=16)
  out = np.asarray(mem.finish(part))  # [B, T, KV, G, D]
  for t in range(3):
    for g in range(2):
      s = k[0, :, 0] @ q[0, t, 0, g]
      s[~live[0]] = -np.inf
      idx = np.argsort(-s)[:5]
      p = np.exp(s[idx] - s[idx].max())
      p /= p.sum()
      np.testing.assert_allclose(out[0, t, 0, g], p @ v[0, idx, 0], atol=1e-5)


@pytest.mark.parametrize("n,k", [(64, 5), (64, 8), (48, 6), (60, 5), (64, 8 * 8)])
def test_grouped_top_k_equals_top_k(n, k):
  """The two-stage search returns lax.top_k's values and indices (masked entries too); shapes it
  cannot split (60 % 8, k * 8 >= n) fall back to top_k."""
  from fot_jax.model import memory as mem
  s = np.random.default_rng(n + k).normal(size=(3, 2, n)).astype(np.float32)
  s[0, 0, : n // 2] = mem.NEG  # a chunk half masked
  s[1, 1, 1:] = mem.NEG  # one live entry
  want, got = jax.lax.top_k(jnp.asarray(s), k), mem.grouped_top_k(jnp.asarray(s), k)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  live = np.asarray(want[0]) > mem.NEG / 2  # among masked ties any index will do
  np.testing.assert_array_equal(np.asarray(got[1])[live], np.asarray(want[1])[live])


def test_topk_gradient_reaches_queries_through_the_entries_read():
  """train.memory differentiates the top-k read w.r.t. the queries: the gradient equals plain softmax
  attention over each query's k best entries (chosen in NumPy), for a memory shared by the batch."""
  from fot_jax.model import memory as mem
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.normal(size=(2, 3, 1, 2, 4)), jnp.float32)  # [B, T, KV, G, D]
  k = rng.normal(size=(1, 96, 1, 4)).astype(np.float32)
  v = rng.normal(size=(1, 96, 1, 4)).astype(np.float32)
  w = jnp.asarray(rng.normal(size=(2, 3, 1, 2, 4)), jnp.float32)  # a random cotangent
  block = mem.MemoryBlock(jnp.asarray(k), jnp.asarray(v), jnp.ones((1, 96), bool))
  # chunks of 48: each searched in groups of 8 (mem.grouped_top_k), then merged
  got = jax.grad(lambda q: jnp.sum(w * mem.finish(mem.topk_memory_partial(q, [block], k=5, chunk=48))))(q)
  idx = np.argsort(-np.einsum("btkgd,skd->btkgs", np.asarray(q), k[0]), axis=-1)[..., :5]  # [B, T, KV, G, 5]
  ks, vs = k[0, idx, 0], v[0, idx, 0]  # [B, T, KV, G, 5, D]

  def plain(q):
    p = jax.nn.softmax(jnp.einsum("btkgd,btkgsd->btkgs", q, ks), axis=-1)
    return jnp.sum(w * jnp.einsum("btkgs,btkgsd->btkgd", p, vs))

  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.grad(plain)(q)), atol=1e-5)
  assert np.abs(np.asarray(got)).max() > 1e-3


def test_memory_is_cleared_per_document_in_single_doc_mode():
  cfg = get_size("tiny", mem_layers=(1,))
  params = _params(cfg)
  rng = np.random.default_rng(4)
  docs = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (3 * T, 2 * T + 3)]
  infer = MemoryInference(cfg, params, T, "dense")
  single = infer.documents(docs, "single_doc", batch=2)
  alone = infer.process(docs[1][None], infer.new_memory(1))[0]
  np.testing.assert_allclose(single[1], alone, atol=2e-5)
  multi = infer.documents(docs, "multi_doc")
  np.testing.assert_allclose(multi[0], single[0], atol=2e-5)  # first document: nothing earlier
  assert np.abs(multi[1] - single[1]).max() > 1e-3  # second: the first one is in memory


def test_memory_grows_past_initial_capacity():
  cfg = get_size("tiny", mem_layers=(1,))
  params = _params(cfg)
  infer = MemoryInference(cfg, params, T, "dense")
  memory = infer.new_memory(1)
  memory.initial_capacity = 2 * T
  toks = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 7 * T))
  infer.process(toks, memory)
  assert memory.size == 7 * T and memory.capacity >= 7 * T
  ref = MemoryInference(cfg, params, T, "dense")
  big = ref.new_memory(1)
  big.initial_capacity = 1024
  np.testing.assert_allclose(infer.process(toks, infer.new_memory(1)), ref.process(toks, big), atol=1e-5)


def test_bad_mode_is_rejected():
  cfg = get_size("tiny")
  with pytest.raises(ValueError, match="inference.mode"):
    MemoryInference(cfg, init_params(cfg, 0), T, "knn")


def test_short_last_window_is_padded_to_a_bucket_with_the_same_logits_and_memory():
  """The last window is padded to a power of two, not the whole window: the logits and what enters
  memory equal the full-window padding's (independent: the last window placed by hand in a full
  window of padding, through forward_window)."""
  from fot_jax.inference import forward_window
  cfg = get_size("tiny", mem_layers=(1,))
  params = _params(cfg)
  window = 64
  toks = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, window + 19)).astype(np.int32)
  infer = MemoryInference(cfg, params, window, "dense")
  memory = infer.new_memory(2)
  got = infer.process(toks, memory)
  assert got.shape == (2, window + 19, cfg.vocab_size)
  ref_memory = infer.new_memory(2)
  first = infer.process(toks[:, :window], ref_memory)
  padded = np.zeros((2, window), np.int32)
  padded[:, :19] = toks[:, window:]
  mask = np.zeros((2, window), bool)
  mask[:, :19] = True
  logits, mem_kv = forward_window(params, jnp.asarray(padded), jnp.asarray(mask), ref_memory.blocks(), cfg,
                                  "dense", 32, 65536)
  ref_memory.add(mem_kv, jnp.asarray(mask))
  np.testing.assert_allclose(got, np.concatenate([first, np.asarray(logits)[:, :19]], 1), atol=2e-5, rtol=1e-5)
  assert memory.size == window + 32 < ref_memory.size == 2 * window  # the bucket, not the window
  for layer, (k, v, m) in memory.buffers.items():  # the same live entries, in the same order
    rk, rv, rm = ref_memory.buffers[layer]
    live, ref_live = np.asarray(m).astype(bool), np.asarray(rm).astype(bool)
    assert live.sum() == ref_live.sum() == 2 * (window + 19)
    np.testing.assert_allclose(np.asarray(k)[live], np.asarray(rk)[ref_live], atol=2e-5)
    np.testing.assert_allclose(np.asarray(v)[live], np.asarray(rv)[ref_live], atol=2e-5)
