"""experiments/smollm2_retrieval.py end to end on a tiny random LLaMA of SmolLM2's kind (no
download): the three retrieval phases (documents of 2 then 4 windows, positives then every
negative) with a quarter of the slots stdlib text, only the memory layer's attention trained, and
the tuned model loadable by from_pretrained and the retrieval scoring."""
import json

import jax
import numpy as np
from flax import traverse_util

import fot_jax
from experiments import smollm2_retrieval
from fot_jax import configs
from fot_jax.runners import lm
from fot_jax import checkpoint
from fot_jax.eval import retrieval, ruler
from fot_jax.model.init import init_params
from tests.test_vocab_hf import make_tokenizer


def test_smollm2_retrieval_tiny_end_to_end(tmp_path):
  ck = str(tmp_path / "ck")
  config = smollm2_retrieval.get_test_config(ck)
  cfg = configs.resolve(config, check_data=False).model
  imported = cfg.__class__(**{**cfg.__dict__, "mem_layers": ()})
  rng = np.random.default_rng(0)
  before = jax.tree_util.tree_map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32),
                                  jax.eval_shape(lambda: init_params(imported, 0)))
  checkpoint.save(ck, before, imported, window=128, tokenizer=make_tokenizer(str(tmp_path / "tok")))
  lm.run(configs.resolve(config), str(tmp_path / "run"))
  saved = json.loads((tmp_path / "run" / "results.json").read_text())
  assert [(p["name"], p["task"], p["start"], p["end"]) for p in saved["fot"]["phases"]] == [
      ("near", "near", 0, 1), ("mid", "mid", 1, 2), ("far", "far", 2, 3)]
  history = [json.loads(line) for line in (tmp_path / "run" / "fot" / "metrics.jsonl").read_text().splitlines()]
  assert len(history) == 3 and all(0.0 <= h["accuracy"] <= 1.0 for h in history)
  after = traverse_util.flatten_dict(checkpoint.load(str(tmp_path / "run" / "fot")).params, sep="/")
  for k, v in traverse_util.flatten_dict(before, sep="/").items():
    assert np.array_equal(np.asarray(after[k]), np.asarray(v)) != k.startswith("layers_1/self_attn/"), k
  model = fot_jax.from_pretrained(str(tmp_path / "run" / "fot"))  # the tuned model, its tokenizer
  assert model.cfg.mem_layers == (1,) and model.window == 128
  prompt, expected = ruler.make_task("niah_noise", model.vocab)(700, np.random.default_rng(0))
  hits = retrieval.score(retrieval.InferenceModel(model._inference(128, "dense", 32, 65536, None)),
                         [retrieval.encode(model.vocab, prompt, " " + expected[0])])
  assert hits.shape == (1,)  # a random model answers nothing; this checks the plumbing
