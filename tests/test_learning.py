"""Learning test: a tiny FoT model, trained for real with the demo's curriculum (copy warm-up
through memory, then dictionary lookup at d=1), answers lookups from memory.

Documents hold 16 single-token definitions in one window and the 16 queries in the next,
so every answer is only in memory; keys are asked once each, in random order, so earlier
queries in the local window do not help. Chance is 1/64. The same model given another
document's definitions in memory answers near chance, which shows the accuracy comes
from retrieval in memory.
"""
import numpy as np

from data_pipelines.copy_task import CopyBatches, CopyTask
from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax.curriculum import Schedule
from fot_jax.inference import MemoryInference
from fot_jax.model.config import get_size
from fot_jax.train import train

TASK = DictionaryTask(num_symbols=64, num_value_symbols=64, key_len=1, value_len=1, n_defs=16, n_queries=16)
SLOTS = 16


def _accuracy(logits, docs):
  hits = []
  for lg, d in zip(logits, docs):
    q = d["tokens"][TASK.defs_len:]
    pos = np.nonzero(d["value_mask"][TASK.defs_len:])[0]
    hits.append(np.argmax(lg[pos - 1], -1) == q[pos])
  return float(np.mean(hits))


def test_fot_model_answers_lookups_from_memory(tmp_path):
  cfg = get_size("dict_cpu", vocab_size=TASK.vocab_size, intermediate_size=32)
  window = TASK.defs_len  # 32: definitions in one window, queries in the next
  copy = CopyTask(span=window, num_symbols=TASK.num_symbols + TASK.num_value_symbols)
  feeds = {"copy": CopyBatches(copy, SLOTS, window, seed=0), "dictionary": DictionaryBatches(TASK, SLOTS, window, 0)}
  schedule = Schedule({"kind": "phases", "stop_after_last": True, "phases": [
      {"name": "copy", "task": "copy", "spec": {"d": 1, "w": 1}, "threshold": 0.95, "window": 5,
       "max_steps": 1800},
      {"name": "lookup", "task": "dictionary", "spec": {"d": 1, "w": 1}, "threshold": 0.95, "window": 5,
       "max_steps": 1000}]})
  out = train(cfg, {"steps": 2800, "seed": 0, "loss_on": "last", "log_every": 100, "tensorboard": False,
                    "optim": {"lr": 3e-3, "warmup_steps": 20, "clip_norm": 1.0}},
              schedule, feeds, str(tmp_path))
  rng = np.random.default_rng(99)
  docs = [TASK.document(rng) for _ in range(16)]
  infer = MemoryInference(cfg, out["params"], window, "dense")
  own = np.stack([d["tokens"] for d in docs])
  # Control: each document's queries after another document's definitions.
  swapped = np.stack([np.concatenate([docs[(i + 1) % 16]["tokens"][:TASK.defs_len],
                                      docs[i]["tokens"][TASK.defs_len:]]) for i in range(16)])
  acc_own = _accuracy(infer.process(own, infer.new_memory(16))[:, TASK.defs_len:], docs)
  acc_swapped = _accuracy(infer.process(swapped, infer.new_memory(16))[:, TASK.defs_len:], docs)
  phases = [(p["name"], p["start"], p["end"]) for p in out["phases"]]
  assert acc_own >= 0.9, (acc_own, acc_swapped, phases)
  assert acc_swapped <= 0.2, (acc_own, acc_swapped, phases)
