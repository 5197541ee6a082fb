"""KV-cached generation against `process` (memory inference of the whole sequence)."""

import jax
import numpy as np
import pytest

from fot_jax.generation import sample
from fot_jax.inference import MemoryInference, end_aligned
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

W = 4


def _infer(mode="dense", window=W, **kw):
  kw = {"num_layers": 2, "mem_layers": (1,), **kw}
  cfg = get_size("tiny", **kw)
  params = jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, init_params(cfg, 0))
  return MemoryInference(cfg, params, window=window, mode=mode, topk=3)


def _process_placed(infer, prompt, row, tail):
  """`process` logits of row (prompt + new tokens) placed as generate places the prompt."""
  pad = 0 if tail == 0 else int(end_aligned([prompt], infer.window, tail)[2][0])
  placed = np.concatenate([np.zeros(pad, np.int32), row])[None]
  mask = np.arange(placed.shape[1])[None] >= pad
  return infer.process(placed, infer.new_memory(1), mask)[0, pad:], pad


@pytest.mark.parametrize("mode,kw,last", [
    ("dense", {"mem_positions": "first"}, 0),
    ("dense", {"mem_positions": "first"}, 3),
    ("topk", {"mem_positions": "none", "mem_layers": (0, 1), "attention_impl": "blockwise",
              "attention_block": 3}, None),
])
def test_cached_generation_logits_equal_process(mode, kw, last):
  """Prompts of different lengths (within the first window, on a boundary, several windows);
  the new tokens cross window boundaries, so full caches move into memory at different steps.
  last: the prompt's tokens in the current window (0: windows from token 0, as `process`;
  None: the default, W - min(new, W // 2) = 2); `process` runs on the row placed the same way."""
  infer = _infer(mode, **kw)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, infer.cfg.vocab_size, n) for n in (3, 8, 10)]
  new = 7
  out, logits = infer.generate(prompts, new, return_logits=True, last_context_length=last)
  assert isinstance(out, list) and logits.shape == (3, new, infer.cfg.vocab_size)
  tail = W - min(new, W // 2) if last is None else last
  for row, prompt, got in zip(out, prompts, logits):
    np.testing.assert_array_equal(row[:len(prompt)], prompt)
    assert len(row) == len(prompt) + new
    want, pad = _process_placed(infer, prompt, row, tail)
    assert pad == (0 if tail == 0 or len(prompt) <= tail else (tail - len(prompt)) % W)
    np.testing.assert_allclose(got, want[len(prompt) - 1:-1], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(row[len(prompt):], got.argmax(-1))  # greedy
  assert infer.stats["new_tokens"] == 3 * new and infer.stats["tokens_per_s"] > 0


def test_cache_holds_the_slots_in_use():
  """A window of 32 with prompts of 3 and 9 tokens and 4 new ones: 9 + 3 decoded tokens need
  16 cache slots, not the window's 32; 2 rows of 3 need 8. The logits still equal `process`."""
  infer = _infer(window=32)
  rng = np.random.default_rng(2)
  for lens, slots in (((3, 9), 16), ((3, 3), 8)):
    prompts = [rng.integers(0, infer.cfg.vocab_size, n) for n in lens]
    out, logits = infer.generate(prompts, 4, return_logits=True)
    assert infer.stats["cache_slots"] == slots
    for row, prompt, got in zip(out, prompts, logits):
      want, _ = _process_placed(infer, prompt, row, 32 - 4)
      np.testing.assert_allclose(got, want[len(prompt) - 1:-1], atol=1e-4, rtol=1e-4)


def test_sampling_on_device_equals_step_by_step_sampling():
  """The on-device loop (split where rows' caches move into memory) draws token s with
  fold_in(key(seed), s): the same tokens as sampling each step from `process` logits."""
  infer = _infer()
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, infer.cfg.vocab_size, n) for n in (3, 8, 10)]
  new, key = 7, jax.random.key(5)
  out = infer.generate(prompts, new, temperature=1.5, top_p=0.9, seed=5)
  seqs = [list(p) for p in prompts]
  for s in range(new):
    last = [_process_placed(infer, p, np.asarray(q), W - min(new, W // 2))[0][-1] for p, q in zip(prompts, seqs)]
    for q, t in zip(seqs, np.asarray(sample(np.stack(last), jax.random.fold_in(key, s), 1.5, 0.9))):
      q.append(int(t))
  for row, q in zip(out, seqs):
    np.testing.assert_array_equal(row, q)


def test_eos_stops_rows():
  infer = _infer()
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, infer.cfg.vocab_size, n) for n in (5, 9)]
  free = infer.generate(prompts, 6)
  eos = int(free[0][5 + 2])  # row 0's third new token
  cut = infer.generate(prompts, 6, eos_token_id=[eos, -1])
  made = 0
  for f, c, n in zip(free, cut, (5, 9)):
    hit = np.flatnonzero(f[n:] == eos)
    stop = n + (hit[0] + 1 if len(hit) else 6)
    np.testing.assert_array_equal(c[:stop], f[:stop])  # identical up to and including eos
    assert (c[stop:] == eos).all()
    made += stop - n
  assert infer.stats["new_tokens"] == made
  out, logits = infer.generate(prompts[:1], 6, eos_token_id=eos, return_logits=True)
  assert (logits[0, 3:] == 0).all() and (logits[0, :3] != 0).any()  # steps after eos: none computed


def test_end_aligned_places_the_last_tokens_in_the_last_window():
  toks, mask, pads = end_aligned([np.arange(1, 11), np.arange(1, 3), np.arange(1, 6)], 4, 3)
  assert pads.tolist() == [1, 0, 2] and toks.shape == (3, 12)  # 10 -> 1 pad: windows 3 | 4 | 3 real
  assert toks[0, :4].tolist() == [0, 1, 2, 3] and toks[0, 8:].tolist() == [8, 9, 10, 0]
  assert mask.sum(1).tolist() == [10, 2, 5] and not mask[0, 0] and not mask[2, :2].any()
  assert toks[2, 4:7].tolist() == [3, 4, 5]  # the last 3 tokens share the last window
  with pytest.raises(ValueError, match="last_context_length"):
    end_aligned([np.arange(3)], 4, 5)


def test_prompt_forms_and_sampling():
  infer = _infer()
  prompt = np.arange(1, 7)
  one = infer.generate(prompt, 3)  # a 1-D prompt gives a 1-D result
  assert one.shape == (9,)
  np.testing.assert_array_equal(infer.generate(prompt[None], 3), one[None])  # [B, L] gives [B, L + n]
  a = infer.generate(prompt, 5, temperature=1.0, seed=3)
  np.testing.assert_array_equal(a, infer.generate(prompt, 5, temperature=1.0, seed=3))
  assert any((infer.generate(prompt, 5, temperature=1.0, seed=s) != a).any() for s in range(4, 8))
  # top_p so small that only the most likely token is left: greedy
  np.testing.assert_array_equal(infer.generate(prompt, 5, temperature=2.0, top_p=1e-6), infer.generate(prompt, 5))
  with pytest.raises(ValueError, match="at least one token"):
    infer.generate([prompt, prompt[:0]], 2)
  with pytest.raises(ValueError, match="top_p"):
    infer.generate(prompt, 2, temperature=1.0, top_p=0.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
  probs = np.array([0.05, 0.6, 0.3, 0.05])
  logits = np.log(np.tile(probs, (400, 1)))
  draws = np.asarray(sample(logits, jax.random.key(0), temperature=1.0, top_p=0.8))
  assert set(draws.tolist()) == {1, 2}  # 0.6 < 0.8: the next token joins; 0.9 >= 0.8: no more
  assert abs((draws == 1).mean() - 2 / 3) < 0.1  # renormalised 0.6 : 0.3
  draws = np.asarray(sample(logits[:50], jax.random.key(0), temperature=1.0, top_p=1.0))
  assert {0, 3} & set(draws.tolist())
  np.testing.assert_array_equal(sample(logits[:3], jax.random.key(0)), [1, 1, 1])  # greedy


def test_approx_topk_mode():
  """On CPU XLA computes approx_max_k exactly, so the mode equals exact top-k here (on TPU
  it is the approximate kNN at the recall target; benchmarks/approx_topk measures it)."""
  exact = _infer("topk")
  approx = MemoryInference(exact.cfg, exact.params, window=W, mode="approx_topk", topk=3, recall=0.9)
  tokens = np.random.default_rng(1).integers(0, exact.cfg.vocab_size, (2, 14))
  want = exact.process(tokens, exact.new_memory(2))
  np.testing.assert_allclose(approx.process(tokens, approx.new_memory(2)), want, atol=1e-5)
  with pytest.raises(ValueError, match="inference.recall"):
    MemoryInference(exact.cfg, exact.params, window=W, mode="approx_topk", recall=1.5)


def test_retrieval_scoring_logits_are_the_end_aligned_process_logits():
  """eval.retrieval.InferenceModel: each row placed so its end fills its last window, and only
  the windows holding the answers keep logits (process's logits_from)."""
  from fot_jax.eval.retrieval import InferenceModel
  infer = _infer()
  rng = np.random.default_rng(1)
  lens, starts = (11, 6, 3), (8, 4, 2)
  toks = np.zeros((3, 11), np.int32)
  mask = np.zeros((3, 11), bool)
  for r, n in enumerate(lens):
    toks[r, :n], mask[r, :n] = rng.integers(0, infer.cfg.vocab_size, n), True
  got = InferenceModel(infer).answer_logits(toks, mask, starts)
  for r, (n, s) in enumerate(zip(lens, starts)):
    pad = (-n) % W if n > W else 0  # 11 -> 1: windows 3 | 4 | 4 tokens
    placed = np.concatenate([np.zeros(pad, np.int32), toks[r, :n]])[None]
    want = infer.process(placed, infer.new_memory(1), np.arange(pad + n)[None] >= pad)[0, pad:]
    assert got[r].shape == (n - s + 1, infer.cfg.vocab_size)
    np.testing.assert_allclose(got[r], want[s - 1:], atol=1e-5, rtol=1e-5)
  full = infer.process(toks, infer.new_memory(3), mask)
  tail = infer.process(toks, infer.new_memory(3), mask, logits_from=5)  # windows from column 4 on
  np.testing.assert_allclose(tail, full[:, 4:], atol=1e-6)
