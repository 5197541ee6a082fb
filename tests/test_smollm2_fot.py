"""experiments/smollm2_fot.py end to end on a tiny random LLaMA of its kind (no download): a
checkpoint with a byte-level BPE tokenizer.json, FoT fine-tuning of the memory layers' attention
only through the curriculum over repeat views of a jsonl corpus, then the perplexity evaluation."""
import json

import jax
import numpy as np
from flax import traverse_util

from experiments import smollm2_fot
from fot_jax import configs
from fot_jax.runners import lm
from fot_jax import checkpoint
from fot_jax.convert import export_hf
from fot_jax.model.init import init_params
from tests.test_corpus import jsonl_corpus
from tests.test_vocab_hf import make_tokenizer


def test_smollm2_fot_tiny_end_to_end(tmp_path, capsys):
  """On a corpus of one's own: one field (data.corpus) moves every view to it, and the run's start
  says what each view reads."""
  ck = str(tmp_path / "ck")
  config = smollm2_fot.get_test_config(ck)
  config.data.corpus = mine = jsonl_corpus(tmp_path / "mine.jsonl", [600, 600])
  cfg = configs.resolve(config, check_data=False).model
  imported = cfg.__class__(**{**cfg.__dict__, "mem_layers": ()})  # an import has no memory layers
  rng = np.random.default_rng(0)  # random weights straight from NumPy: no init to compile
  before = jax.tree_util.tree_map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32),
                                  jax.eval_shape(lambda: init_params(imported, 0)))
  checkpoint.save(ck, before, imported, window=64, tokenizer=make_tokenizer(str(tmp_path / "tok")))
  results = lm.run(configs.resolve(config), str(tmp_path / "run"))
  saved = json.loads((tmp_path / "run" / "results.json").read_text())
  start = capsys.readouterr().out.split("data: corpus ", 1)[1].splitlines()
  assert start[0] == f"{mine!r} (data.corpus); each view reads:"
  assert [line.split()[:3] for line in start[1:4]] == [["repeat", "view", "'repeat'"], ["repeat", "view", "'mixed'"],
                                                      ["held-out", "evaluation", repr(mine)]]
  assert all(repr(mine) in line and "not the corpus" not in line for line in start[1:4])
  assert sorted(saved["data"]["fot"]) == ["mixed", "repeat"]  # the reports of both views' readers
  assert {v[2] for v in saved["corpus_views"]} == {mine}
  assert [(p["name"], p["task"], p["start"], p["end"]) for p in saved["fot"]["phases"]] == [
      ("copy_d1", "repeat", 0, 1), ("copy", "repeat", 1, 2), ("lm", "mixed", 2, 3)]
  assert saved["fot"]["memory_tokens"] == [0, 32] and "no_crossbatch" not in saved
  assert all(np.isfinite(p) and p > 1 for p in results["fot"]["perplexity"])
  # only the memory layer's attention moved; everything else is the checkpoint's, bit for bit
  after = traverse_util.flatten_dict(checkpoint.load(str(tmp_path / "run" / "fot")).params, sep="/")
  for k, v in traverse_util.flatten_dict(before, sep="/").items():
    assert np.array_equal(np.asarray(after[k]), np.asarray(v)) != k.startswith("layers_1/self_attn/"), k
  # the run records the vocabulary it trained with (evaluation and export read it)
  meta = json.loads((tmp_path / "run" / "fot" / "fot_jax_model.json").read_text())
  assert meta["vocab"].endswith("ck/tokenizer.json") and meta["model"]["mem_layers"] == [1]
  # export_hf of the run ships that tokenizer (with its tokenizer_config.json)
  export_hf(str(tmp_path / "run" / "fot"), str(tmp_path / "hf"))
  assert (tmp_path / "hf" / "tokenizer.json").read_text() == (tmp_path / "ck" / "tokenizer.json").read_text()
  assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["bos_token"] == "<|im_start|>"


def test_smollm2_fot_config_is_the_import_plus_memory_layers():
  """The full config: SmolLM2-135M's architecture (as import_gguf writes it) with memory layers
  8/16/24, 'first' positions, LongLLaMA's plan, memory attention trained (validated without data)."""
  config = smollm2_fot.get_config()
  cfg = configs.resolve(config, check_data=False).model
  assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.kv_heads,
          cfg.rope_theta, cfg.tie_embeddings) == (49152, 576, 1536, 30, 9, 3, 1e5, True)
  assert cfg.mem_layers == (8, 16, 24) and cfg.mem_positions == "first"
  assert config.train.init_from == smollm2_fot.CHECKPOINT and tuple(config.train.trainable) == ("memory_attention",)
