"""The evaluation suite's settings and their defaults (`--eval.*` of python -m fot_jax.evaluate,
a study file's `eval`): light, no JAX or TensorFlow, so entry points and experiment files read them
before anything heavy loads."""
from __future__ import annotations

import ml_collections

SUITES = ("ppl", "rd", "passkey", "niah", "dict", "ruler", "heads")


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "stdlib"  # held-out documents (ppl, rd) and the NIAH haystack; 'dictionary_lookup' for dict models
  c.split = "validation"
  c.vocab = ""  # 'byte', a tokenizer path, 'dictionary_lookup'; '' = the checkpoint's own (never guessed)
  c.window = 0  # local window; 0 = the checkpoint's
  c.mode = "dense"  # memory mode of ppl/passkey/niah: dense or topk
  c.topk = 32
  c.batch = 8
  c.chunk = 8192
  c.ppl = ml_collections.ConfigDict({
      "memory_tokens": (0, 2048, 8192, 32768), "score_tokens": 512, "n_docs": 16,
      "distractor_tokens": -1,  # multi_doc: earlier documents' tokens in memory; -1 = max(memory_tokens)
      "doc_modes": ("single_doc", "multi_doc")})
  c.rd = ml_collections.ConfigDict({"ds": (1, 2, 4, 8, 16, 32, 64), "context_windows": 1, "n_docs": 64,
                                    "split": ""})  # '' = eval.split; stdlib's validation split has ~40 files
  grid = {"lengths": (256, 512, 1024, 2048, 4096), "depths": (0.0, 0.25, 0.5, 0.75, 1.0), "trials": 4,
          "threshold": 0.9}
  c.passkey = ml_collections.ConfigDict(dict(grid))
  c.niah = ml_collections.ConfigDict(dict(grid, n_needles=4, corpus_docs=200))
  c.dict = ml_collections.ConfigDict({
      # data_pipelines.dictionary_lookup.DictionaryTask (the demo's task by default)
      "task": {"num_symbols": 256, "num_value_symbols": 64, "key_len": 1, "value_len": 1, "n_defs": 16,
               "n_queries": 16, "layout": "kv"},
      "memory_tokens": (256, 1024, 4096, 16384, 65536, 262144, 1048576), "n_docs": 8, "topk": 32,
      "modes": ("dense", "topk", "ivf"),  # 'flat' = exact top-k from a host index
      "nprobe": 8, "nlist": 0,  # IVF lists searched / total (0: 4 sqrt(M), at most 1024)
      "device_max_tokens": 262144,  # beyond this, memory stays on the host (faiss): dense/topk skipped
      "threshold": 0.5, "seed": 1234})
  # RULER-style tasks scored on greedy generation (fot_jax/eval/ruler.py); 0.856 = RULER's Llama-2-7B at 4K
  c.ruler = ml_collections.ConfigDict({
      "tasks": ("niah_noise", "niah_essay", "multikey", "multivalue", "multiquery", "vt", "fwe"),
      "lengths": (1024, 4096, 16384), "trials": 4, "threshold": 0.856})
  # retrieval-head probe (fot_jax/eval/heads.py): copy scores per head, the `top` layers picked
  c.heads = ml_collections.ConfigDict({"n_prompts": 8, "length": 384, "top": 4})
  return c


def parse_auto(spec: str) -> int:
  """'auto:N' -> N (a positive integer); anything else raises one ValueError line."""
  text = str(spec).strip().lower()
  head, _, n = text.partition(":")
  if head != "auto" or not n.strip().isdigit() or int(n) < 1:
    raise ValueError(f"--mem_layers={spec}: expected auto:N with N a positive number of layers")
  return int(n)
