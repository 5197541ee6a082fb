"""The memory readout (fot_jax/eval/readout.py): its answers at each k are what a whole read with that
top-k answers (the passkey suite's own path), and its top entries are the index's own choice."""
import numpy as np
import pytest

from fot_jax.eval import readout
from fot_jax.eval.retrieval import InferenceModel
from fot_jax.host_memory import HostMemoryInference
from fot_jax.inference import MemoryInference
from tests.test_host_memory import WINDOW, _model


class _Vocab:
  def decode(self, ids):
    return " ".join(str(i) for i in ids)


def _prompt():
  """bos, random tokens with the answer planted twice in the first window, then the answer: 3 windows and 5."""
  rng = np.random.default_rng(1)
  ids = rng.integers(1, 64, 3 * WINDOW + 5).astype(np.int32)
  answer = np.array([60, 61, 62, 63], np.int32)
  ids[3:7], ids[20:24], ids[-4:] = answer, answer, answer
  return ids, len(ids) - 4


def _suite_answer(inference, ids, start):
  """The passkey suite's argmax at the answer's positions (InferenceModel.answer_logits)."""
  got = InferenceModel(inference).answer_logits(ids[None], np.ones((1, len(ids)), bool), [start])[0]
  return " ".join(str(int(x)) for x in np.argmax(got[:len(ids) - start], -1))


def test_the_readout_answers_as_a_whole_read_with_each_k():
  cfg, params = _model((1,))  # keys of layer 1 do not depend on memory: memory is the same for every k
  ids, start = _prompt()
  inf = HostMemoryInference(cfg, params, WINDOW, topk=4, kind="flat")
  r = readout.read_out(inf, _Vocab(), ids, start, ks=(1, 4, 1000))
  assert r["occurrences"] == [3, 20] and r["expected"] == "60 61 62 63" and inf.topk == 4
  for k in (1, 4):
    assert r["by_k"][str(k)]["answer"] == _suite_answer(HostMemoryInference(cfg, params, WINDOW, k, "flat"), ids, start)
  # k past memory: dense memory's answer
  assert r["by_k"]["1000"]["answer"] == _suite_answer(MemoryInference(cfg, params, WINDOW, "dense"), ids, start)
  for v in list(r["by_k"].values()) + list(r["layer_off"].values()):  # each token's margin: > 0 iff it is written
    assert [m > 0 for m in v["margins"]] == [a == b for a, b in zip(v["answer"].split(), ["60", "61", "62", "63"])]
    assert v["first_margin"] == v["margins"][0]
  lines = readout.summary_lines("p", r)
  assert "window 16, written reading top-4 of a flat index" in lines[0] and "margins by answer token at k = 4" in lines[-1]
  # memory left out at the question's window: the answer of that window read alone
  alone = _suite_answer(MemoryInference(cfg, params, WINDOW, "dense"), ids[-WINDOW:], WINDOW - 4)
  assert r["layer_off"]["1"]["answer"] == r["layer_off"]["all"]["answer"] == alone
  assert alone != r["by_k"]["1000"]["answer"]  # memory matters to this answer
  assert r["layer_off"]["only 1"] == r["by_k"]["4"]  # the one memory layer kept alone: the whole read at own k
  (per_token,) = r["layers"].values()
  assert [t["token"] for t in per_token] == ["60", "61", "62", "63"]
  for t in per_token:
    assert t["rank"] >= 0 and 0.0 <= t["mass"] <= 1.0 and len(t["top_tokens"]) == 4
    assert 0.0 <= t["whole"] <= t["mass"] + 1e-6 and len(t["memory_shares"]) == cfg.num_heads
    assert len(t["starts"]) == cfg.num_heads and all(x in [i / 4 for i in range(5)] for x in t["starts"])
  # the token written instead of the answer's first, where memory holds it (none when it is right)
  first = r["by_k"]["4"]["answer"].split()[0]
  assert (r["rival"] is None) == (first == "60")
  if r["rival"] is not None:
    assert r["rival"]["token"] == first and r["rival"]["entries"] == int((ids[:len(ids) - WINDOW] == int(first)).sum())


def test_the_readouts_top_entries_are_the_indexs():
  """The top entries the readout ranks by its own scores are those faiss's exact search returns."""
  cfg, params = _model((1,))
  ids, start = _prompt()
  inf = HostMemoryInference(cfg, params, WINDOW, topk=4, kind="flat")
  memory = inf.new_memory(1)
  inf.process(ids[None, :2 * WINDOW], memory)  # two windows in memory, the third reads it
  memory.seen_queries = {}
  inf._window(ids[None, 2 * WINDOW:3 * WINDOW], np.ones((1, WINDOW), bool), memory, want_logits=False)
  q = memory.seen_queries[1][0, 5]  # [KV, G, D]
  store = memory.stores[0][1]
  got = readout._targets_read(store, q, np.array([0]), 4)
  head = got["head"]
  kv, g = divmod(head, q.shape[1])
  assert sorted(got["top"]) == sorted(store.search(q, 4)[kv, g].tolist())
  # the shares by k: the own k's is `mass`; k past memory is the whole memory's softmax
  targets = np.array([3, 20])
  got = readout._targets_read(store, q, targets, 4, ks=(1, 4, 10 ** 6))
  assert got["mass_by_k"]["4"] == pytest.approx(got["mass"])
  scores = np.einsum("nhd,hgd->hgn", store.keys[:store.size], q)
  soft = np.exp(scores - scores.max(-1, keepdims=True))
  dense = (soft[..., targets].sum(-1) / soft.sum(-1)).max()
  assert got["mass_by_k"][str(10 ** 6)] == pytest.approx(dense, rel=1e-5)
  # the whole softmax (local window beside the top-k): local keys far below memory's leave the top-k's
  # shares; far above, memory gets nothing; equal to the head's best memory score, memory's share is k / (k + S)
  kv, g, _ = q.shape
  best = scores.max(-1)  # [KV, G]
  for offset, want_memory in ((-1e4, 1.0), (1e4, 0.0)):
    got = readout._targets_read(store, q, targets, 4, local=np.broadcast_to((best + offset)[..., None], (kv, g, 7)))
    assert got["memory_shares"] == pytest.approx([want_memory] * (kv * g), abs=1e-6)
    assert got["whole"] == pytest.approx(got["mass"] if want_memory else 0.0, abs=1e-6)
  got = readout._targets_read(store, q, targets, 1, local=np.broadcast_to(best[..., None], (kv, g, 3)))
  assert got["memory_shares"] == pytest.approx([1 / 4] * (kv * g))
  # entries marked as window starts: each head's share of its top-k among them
  marked = np.zeros(store.size, bool)
  marked[::2] = True
  got = readout._targets_read(store, q, targets, 4, at_start=marked)
  top4 = np.argsort(-scores, -1)[..., :4].reshape(kv * g, 4)
  assert got["starts"] == pytest.approx([marked[t].mean() for t in top4])


def test_readout_refuses_what_it_cannot_read():
  cfg, params = _model((1,))
  ids, start = _prompt()
  inf = HostMemoryInference(cfg, params, WINDOW, topk=4, kind="flat")
  absent = ids.copy()
  absent[3:7] = absent[20:24] = 1
  with pytest.raises(ValueError, match="do not occur"):
    readout.read_out(inf, _Vocab(), absent, start, ks=(4,))
  late = absent.copy()
  late[-12:-8] = ids[-4:]  # only in the question's window
  with pytest.raises(ValueError, match="only in the question's own window"):
    readout.read_out(inf, _Vocab(), late, start, ks=(4,))
  with pytest.raises(ValueError, match="one window"):
    readout.read_out(inf, _Vocab(), np.concatenate([ids[:11], ids[-4:]]), 11, ks=(4,))


def test_the_readout_cli_reads_the_passkey_suites_prompts(tmp_path):
  """`python -m fot_jax.eval.readout` on a checkpoint: its prompt is the passkey suite's (same seed
  and depth), and its answer at the inference's own k is the suite's through host memory."""
  import dataclasses
  import json

  from fot_jax.eval import suite
  from test_eval_suite import _tiny_run
  ck, c = _tiny_run(tmp_path)
  c = dataclasses.replace(c, topk=4, mode="host", host_index="flat", window=64,
                          passkey=dataclasses.replace(c.passkey, lengths=(300,), depths=(0.5,)))
  out = tmp_path / "r.json"
  readout.main(["--checkpoint", ck, "--length", "300", "--depths", "0.5", "--window", "64", "--topk", "4",
                "--ks", "2,4", "--index", "flat", "--mem_layers", "1", "--vocab", "byte", "--out", str(out)])
  (r,) = json.loads(out.read_text())["readouts"]
  from fot_jax import checkpoint
  ck_mem = str(tmp_path / "ck_mem")  # the same weights with memory layer 1, as --mem_layers reads them
  loaded = checkpoint.load(ck)
  checkpoint.save(ck_mem, loaded.params, dataclasses.replace(loaded.cfg, mem_layers=(1,), mem_positions="first"), 16)
  (p,) = suite.run(ck_mem, ["passkey"], str(tmp_path / "w"), c, name="host")["passkey"]["prompts"]
  assert r["expected"] == p["expected"] and r["tokens"] == p["tokens"]
  assert r["by_k"]["4"]["answer"] == p["answer"] and r["by_k"]["4"]["correct"] == p["correct"]
  assert set(r["layers"]) == {"1"} and len(r["layers"]["1"]) == len(p["expected"])  # bytes: a token a character


def test_write_local_memory_holds_each_window_read_alone():
  """Every layer in HostMemory.quiet_layers (the readout's --write_local): each window's memory entries are its keys and
  values with no memory read, those of the window run alone; reading, a later memory layer's keys differ."""
  cfg, params = _model((0, 1))  # layer 1's keys depend on layer 0's memory read
  ids, _ = _prompt()
  inf = HostMemoryInference(cfg, params, WINDOW, topk=4, kind="flat")
  local, read = inf.new_memory(1), inf.new_memory(1)
  local.quiet_layers = frozenset((0, 1))
  inf.process(ids[None, :3 * WINDOW], local, want_logits=False)
  inf.process(ids[None, :3 * WINDOW], read, want_logits=False)
  for w in range(3):
    _, alone = inf._window(ids[None, w * WINDOW:(w + 1) * WINDOW], np.ones((1, WINDOW), bool), inf.new_memory(1),
                           want_logits=False)
    for layer in (0, 1):
      np.testing.assert_allclose(local.stores[0][layer].keys[w * WINDOW:(w + 1) * WINDOW], alone[layer][0][0],
                                 rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(local.stores[0][0].keys[:3 * WINDOW], read.stores[0][0].keys[:3 * WINDOW])
  assert np.abs(local.stores[0][1].keys[WINDOW:3 * WINDOW] - read.stores[0][1].keys[WINDOW:3 * WINDOW]).max() > 1e-3
