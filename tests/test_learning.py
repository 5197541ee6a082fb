"""Learning test: a tiny FoT model, trained for real with crossbatch, reads answers from memory.

Full key->value lookup needs a two-step in-context circuit that a model this small
does not find within a test's budget, so the documents here hold only two distinct
definitions (repeated): the answer to every query is one of two values that appear
only in the previous window, i.e. only in memory (earlier queries in the local window also reveal them, once asked).
Chance is 1/32. The same model given another document's memory loses most of its
accuracy, which shows that the accuracy comes from memory.
"""
import numpy as np

from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax.curriculum import Schedule
from fot_jax.inference import MemoryInference
from fot_jax.model.config import get_size
from fot_jax.train import train

TASK = DictionaryTask(num_symbols=256, num_value_symbols=32, key_len=1, value_len=1, n_defs=32, n_queries=32)
DISTINCT = 2


def _accuracy(logits, docs):
  hits = []
  for lg, d in zip(logits, docs):
    q = d["tokens"][TASK.defs_len:]
    pos = np.nonzero(d["value_mask"][TASK.defs_len:])[0]
    hits.append(np.argmax(lg[pos - 1], -1) == q[pos])
  return float(np.mean(hits))


def test_fot_model_answers_from_memory(tmp_path):
  cfg = get_size("dict_cpu", vocab_size=TASK.vocab_size, num_layers=2, mem_layers=(1,), hidden_size=64,
                 intermediate_size=128, num_heads=4, num_kv_heads=4, head_dim=16, init_std=0.1,
                 embed_init_std=1.0)
  window = TASK.defs_len  # 64: definitions in one window, queries in the next
  batches = DictionaryBatches(TASK, slots=8, window=window, seed=0, distinct_start=DISTINCT,
                              distinct_every=10 ** 9)
  out = train(cfg, {"steps": 150, "seed": 0, "loss_on": "last", "log_every": 50,
                    "optim": {"lr": 3e-3, "warmup_steps": 20, "clip_norm": 1.0}},
              Schedule({"kind": "constant", "spec": {"d": 1, "w": 1}}), batches, str(tmp_path))
  rng = np.random.default_rng(99)
  docs = [TASK.document(rng, distinct=DISTINCT) for _ in range(16)]
  infer = MemoryInference(cfg, out["params"], window, "dense")
  own = np.stack([d["tokens"] for d in docs])
  # Control: each document's queries after another document's definitions.
  swapped = np.stack([np.concatenate([docs[(i + 1) % 16]["tokens"][:TASK.defs_len],
                                      docs[i]["tokens"][TASK.defs_len:]]) for i in range(16)])
  acc_own = _accuracy(infer.process(own, infer.new_memory(16))[:, TASK.defs_len:], docs)
  acc_swapped = _accuracy(infer.process(swapped, infer.new_memory(16))[:, TASK.defs_len:], docs)
  chance = 1 / TASK.num_value_symbols
  assert acc_own > 10 * chance, (acc_own, acc_swapped)
  assert acc_own > acc_swapped + 0.15, (acc_own, acc_swapped)
