"""Host memory (fot_jax/host_memory.py): memory layers read each query's top-k from a faiss index on
the host, the stack run piecewise at the memory layers. An exact index must give what the device's
own top-k memory gives, and with k past the memory size what dense memory gives."""
import jax
import numpy as np
import pytest

from fot_jax.host_memory import HostMemoryInference
from fot_jax.inference import MemoryInference
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

WINDOW = 16


def _model(mem_layers):
  cfg = get_size("tiny", mem_layers=mem_layers)
  # Sharper attention than at init, so top-k choices matter.
  params = jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, init_params(cfg, 0))
  return cfg, params


def _prompts(windows=3):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 64, (2, windows * WINDOW + 7)).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  mask[1, :WINDOW + 5] = False  # a shorter prompt, padded in front (as end-aligned prompts are)
  return tokens, mask


def _logits(inference, tokens, mask):
  return inference.process(tokens, inference.new_memory(len(tokens)), mask)


@pytest.mark.parametrize("mem_layers", [(0, 2), (1, 2)])
def test_exact_host_memory_equals_the_devices_topk_and_dense_memory(mem_layers):
  cfg, params = _model(mem_layers)
  tokens, mask = _prompts()
  host = _logits(HostMemoryInference(cfg, params, WINDOW, topk=8, kind="flat"), tokens, mask)
  device = _logits(MemoryInference(cfg, params, WINDOW, "topk", 8), tokens, mask)
  live = mask  # padded positions are never scored
  np.testing.assert_allclose(host[live], device[live], atol=2e-4, rtol=1e-4)
  # k past every row's memory: every entry is read, as dense memory reads it
  host_all = _logits(HostMemoryInference(cfg, params, WINDOW, topk=128, kind="flat"), tokens, mask)
  dense = _logits(MemoryInference(cfg, params, WINDOW, "dense"), tokens, mask)
  np.testing.assert_allclose(host_all[live], dense[live], atol=2e-4, rtol=1e-4)
  # and memory matters here: without it the logits differ
  none = _logits(MemoryInference(cfg, params, WINDOW, "dense"), tokens[:, -7:], mask[:, -7:])
  assert np.abs(none[0] - dense[0, -7:]).max() > 1e-2


def test_ivf_host_memory_measures_its_recall():
  cfg, params = _model((1,))
  tokens, mask = _prompts(windows=12)  # memory of ~190 entries: inverted lists of ~40 (nlist 4)
  exact = _logits(HostMemoryInference(cfg, params, WINDOW, topk=4, kind="flat"), tokens, mask)
  # every list probed: the inverted lists find what the exact index finds
  full = HostMemoryInference(cfg, params, WINDOW, topk=4, kind="ivf", nprobe=1024, ivf_from=64)
  mem = full.new_memory(2)
  np.testing.assert_allclose(full.process(tokens, mem, mask)[mask], exact[mask], atol=2e-4, rtol=1e-4)
  assert mem.recall == 1.0
  coarse = HostMemoryInference(cfg, params, WINDOW, topk=4, kind="ivf", nprobe=1, ivf_from=64)
  mem = coarse.new_memory(2)
  coarse.process(tokens, mem, mask)
  assert mem.recall is not None and 0.0 < mem.recall < 1.0  # one list of 4 searched: some top-k missed
  assert coarse.recall == mem.recall and full.recall == 1.0  # the inference's count over its prompts
  # every window kept (logits_from 0): the scored recall counts every query of every searched window,
  # as the sampled recall does when its sample is every query (whole windows: no padded last one)
  assert full.scored_recall == 1.0
  mem = coarse.new_memory(2)
  mem.recall_queries = 10 ** 6
  coarse.process(tokens[:, 7:], mem, mask[:, 7:])
  assert (mem.scored_hits, mem.scored_total) == (mem.hits, mem.total) and mem.scored_total > 0
  # logits kept from the last window on: only its positions count
  mem = coarse.new_memory(2)
  coarse.process(tokens, mem, mask, logits_from=tokens.shape[1] - 3)
  assert mem.scored_total == 2 * 4 * cfg.num_heads * 3  # rows x k x query heads x 3 positions (one memory layer)


def test_the_scored_recall_counts_the_queries_of_the_scored_positions():
  """Queries of positions [s, e) of a window count as the same queries searched alone do."""
  from fot_jax.host_memory import HostMemory
  cfg, _ = _model((1,))
  rng = np.random.default_rng(3)
  kv, d, g = cfg.kv_heads, cfg.dim_per_head, cfg.num_heads // cfg.kv_heads
  keys = rng.normal(size=(1, 300, kv, d)).astype(np.float32)
  queries = rng.normal(size=(1, WINDOW, kv, g, d)).astype(np.float32)
  counts = []
  for q, scored in ((queries, (11, 14)), (queries[:, 11:14], (0, 3)), (queries[:, 11:], (0, 3))):
    mem = HostMemory(cfg, 1, "ivf", nprobe=1, ivf_from=64)
    mem.add({1: (keys, keys)}, np.ones((1, 300), bool))
    mem.scored = scored
    mem.gather(1, q, 4)
    counts.append((mem.scored_hits, mem.scored_total))
  assert counts[0] == counts[1] == counts[2] and counts[0][1] == 4 * kv * g * 3
  assert counts[0][0] < counts[0][1]  # one list searched: the count can tell a miss


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_host_generation_equals_the_devices_topk_generation(temperature):
  """Greedy and sampled generation through an exact host index: the tokens and logits of
  MemoryInference.generate with top-k memory, windows crossed while generating (the current window
  joins memory), rows of different lengths, and a row that stops at eos."""
  cfg, params = _model((0, 2))
  tokens, mask = _prompts()
  rows = [tokens[0], tokens[1][mask[1]]]  # 55 and 34 tokens
  kw = dict(max_new_tokens=13, temperature=temperature, seed=3, return_logits=True)
  host = HostMemoryInference(cfg, params, WINDOW, topk=8, kind="flat")
  device = MemoryInference(cfg, params, WINDOW, "topk", 8)
  got, got_logits = host.generate(rows, **kw)
  want, want_logits = device.generate(rows, **kw)
  for g, r in zip(got, want):
    np.testing.assert_array_equal(g, r)
  np.testing.assert_allclose(got_logits, want_logits, atol=2e-4, rtol=1e-4)
  assert host.stats["new_tokens"] == 26 and host.stats["memory_entries"] > 0
  # eos: the row that samples it stops there, the rest of its tokens are eos, its logits 0
  eos = int(got[0][len(rows[0]) + 2])
  got, got_logits = host.generate(rows, eos_token_id=eos, **kw)
  want, want_logits = device.generate(rows, eos_token_id=eos, **kw)
  for g, r in zip(got, want):
    np.testing.assert_array_equal(g, r)
  np.testing.assert_allclose(got_logits, want_logits, atol=2e-4, rtol=1e-4)
  assert (got[0][len(rows[0]) + 2:] == eos).all()
  # no new tokens: the prompts back, eos or not
  for inference in (host, device):
    assert all((g == r).all() for g, r in zip(inference.generate(rows, 0, eos_token_id=eos), rows))


def test_bad_host_memory_settings_are_refused():
  cfg, params = _model((1,))
  for kwargs, message in (({"kind": "hnsw"}, "kind must be one of"), ({"topk": 0}, "topk must be at least 1"),
                          ({"window": 0}, "window must be positive")):
    args = dict({"window": WINDOW}, **kwargs)
    with pytest.raises(ValueError, match=message):
      HostMemoryInference(cfg, params, **args)


def test_the_passkey_suite_reads_through_host_memory(tmp_path):
  """Suite mode 'host' (exact index) answers every passkey prompt as the device's top-k does."""
  import dataclasses

  from fot_jax.eval import suite
  from test_eval_suite import _tiny_run
  ck, c = _tiny_run(tmp_path)
  c = dataclasses.replace(c, topk=4, passkey=dataclasses.replace(c.passkey, lengths=(160,)))
  host = suite.run(ck, ["passkey"], str(tmp_path / "h"), dataclasses.replace(c, mode="host", host_index="flat"),
                   name="host")["passkey"]
  device = suite.run(ck, ["passkey"], str(tmp_path / "d"), dataclasses.replace(c, mode="topk"), name="topk")["passkey"]
  assert [p["answer"] for p in host["prompts"]] == [p["answer"] for p in device["prompts"]]
  assert len(host["prompts"]) == 2
