"""The controlled-study runner (fot_jax/study.py) on a tiny random checkpoint: every method gets the
same suites, the table and figures are written, a rerun skips finished methods; a method's overrides
reach the model (checked against a direct forward of the overridden ModelConfig)."""
import dataclasses
import json
import os

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fot_jax import study
from fot_jax.convert import checkpoint
from fot_jax.eval import suite
from fot_jax.model.config import get_size
from fot_jax.model.llama import LlamaModel
from fot_jax.train import init_params

L0 = 16
PI = {"name": "pi", "inference": "plain", "overrides": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("study")
  cfg = get_size("tiny", vocab_size=260)
  ck = str(tmp / "ckpt")
  checkpoint.save(ck, init_params(cfg, 0), cfg, L0)
  corpus = tmp / "corpus"
  corpus.mkdir()
  for i in range(5):
    (corpus / f"f{i}.py").write_text(f"# file {i}\n" + "".join(f"x{i}_{j} = {j * i}\n" for j in range(40)))
  c = ml_collections.ConfigDict()
  c.base = ml_collections.ConfigDict({"checkpoint": ck})
  c.lengths = (32, 64)
  c.methods = [{"name": "none", "inference": "plain"}, PI,
               {"name": "fot_memory", "inference": "memory", "overrides": {"mem_layers": (1,)}}]
  c.suites = ("ppl", "niah", "rd")  # passkey is the same grid runner with longer prompts (a compile more)
  c.pad = 256  # every plain input (ppl 32/64, NIAH prompts ~100-200 tokens) in one compiled width
  c.ppl = ml_collections.ConfigDict({"score_tokens": 8, "n_docs": 2, "tolerance": 1.1})
  e = suite.default_config()
  e.task, e.split, e.vocab, e.batch = f"files:{corpus}/*.py", "train", "byte", 4
  for g in (e.passkey, e.niah):
    g.depths, g.trials = (0.0, 1.0), 1
  e.niah.n_needles, e.niah.corpus_docs = 2, 5
  e.rd.ds, e.rd.n_docs = (1, 2), 2
  c.eval = e
  return ck, c, tmp


def test_study_writes_one_table_and_figures_and_resumes(tiny, capsys):
  ck, c, tmp = tiny
  work = str(tmp / "w")
  out = study.run(c, work)
  methods = out["methods"]
  assert list(methods) == ["none", "pi", "fot_memory"]
  for name, r in methods.items():
    assert r["ppl"]["lengths"] == [32, 64] and len(r["ppl"]["perplexity"]) == 2
    assert r["niah"]["single"]["lengths"] == [32, 64]  # the study's lengths on every grid
    assert np.shape(r["niah"]["multi"]["accuracy"]) == (2, 2)
    assert ("rd" in r) == (name == "fot_memory")  # r_d only where memory is read
  assert methods["fot_memory"]["rd"]["r_d"][0] == 1.0
  # the same scored tokens for every method: at the base window, PI's squeezed positions differ
  assert methods["pi"]["ppl"]["perplexity"][1] != methods["none"]["ppl"]["perplexity"][1]
  with open(os.path.join(work, "study.json")) as f:
    assert set(json.load(f)["methods"]) == set(methods)
  table = open(os.path.join(work, "study.md")).read()
  for name in methods:
    assert f"| {name} |" in table
  for fig in ("study_ppl.png", "study_accuracy.png", "study_niah.png", "study_rd.png"):
    assert os.path.getsize(os.path.join(work, fig)) > 0, fig
  capsys.readouterr()
  # rerun: finished methods are skipped; a method whose spec changed is evaluated again
  c2 = ml_collections.ConfigDict(c.to_dict())
  c2.methods = [c.methods[0], dict(PI, overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}})]
  again = study.run(c2, work)
  log = capsys.readouterr().out
  assert "none: done before" in log and "pi: its spec or the study's settings changed" in log
  assert again["methods"]["none"] == methods["none"]
  assert again["methods"]["pi"]["method"]["overrides"]["rope_scaling"]["factor"] == 2.0


def test_method_overrides_reach_the_model(tiny):
  ck, c, _ = tiny
  base = suite.Context(ck, c.eval)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (2, 40)).astype(np.int32)  # 40 > L0 = 16, padded to 64 by the plain path

  def study_logits(method):
    inf = study._method_context(base, method, 64).inference()
    return inf.process(tokens, inf.new_memory(2))

  def direct_logits(cfg):  # the reference: one unpadded forward of the overridden config
    return np.asarray(LlamaModel(cfg).apply({"params": base.params}, jnp.asarray(tokens))[0])

  none, pi = study_logits({"name": "none"}), study_logits(PI)
  np.testing.assert_allclose(none, direct_logits(base.cfg), atol=1e-5)
  pi_cfg = dataclasses.replace(base.cfg, rope_scaling={"rope_type": "linear", "factor": 4.0})
  np.testing.assert_allclose(pi, direct_logits(pi_cfg), atol=1e-5)
  assert np.abs(pi[:, L0:] - none[:, L0:]).max() > 1e-3
  # LM-Infinite with its window and cap past the input length is plain attention
  wide = {"name": "lmi", "overrides": {"position_strategy": {"kind": "lm_infinite", "global_tokens": 2,
                                                             "local_window": 64, "max_distance": 64}}}
  np.testing.assert_allclose(study_logits(wide), none, atol=1e-5)
  with pytest.raises(ValueError, match="study method 'bad'.*unknown ModelConfig field"):
    study.method_model_config(base.cfg, {"name": "bad", "overrides": {"rope": 1}})
  with pytest.raises(ValueError, match="study method 'x': inference must be"):
    study._method_context(base, {"name": "x", "inference": "kv"}, 64)
