"""The evaluation suite end to end on a tiny checkpoint: every suite writes its JSON and
plot, report.md gathers them, `compare` puts two runs side by side (CLI)."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np

from fot_jax import checkpoint
from fot_jax.eval import perplexity, suite
from fot_jax.eval import settings as eval_settings
from fot_jax.inference import MemoryInference
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_run(tmp_path):
  cfg = get_size("tiny", vocab_size=260)
  ck = str(tmp_path / "ckpt")
  checkpoint.save(ck, init_params(cfg, 0), cfg, 16)
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(5):
    (corpus / f"f{i}.py").write_text(f"# file {i}\n" + "".join(f"x{i}_{j} = {j * i}\n" for j in range(40)))
  c = eval_settings.SuiteSettings.from_dict({  # over the defaults
      "task": f"files:{corpus}/*.py", "split": "train", "vocab": "byte", "batch": 4,
      "ppl": {"memory_tokens": (0, 32), "score_tokens": 16, "n_docs": 3},
      "rd": {"ds": (1, 2, 4), "n_docs": 4},
      "passkey": {"lengths": (300, 400), "depths": (0.0, 1.0), "trials": 1},
      "niah": {"lengths": (64, 128), "depths": (0.0, 1.0), "trials": 1, "n_needles": 2, "corpus_docs": 5},
      "ruler": {"tasks": ("niah_noise", "fwe"), "lengths": (600, 800), "trials": 1},
      "dict": {"task": {"num_symbols": 32, "num_value_symbols": 16, "n_defs": 8, "n_queries": 4},
               "memory_tokens": (32, 128), "n_docs": 2, "topk": 4, "modes": ("dense", "topk", "flat", "ivf"),
               "device_max_tokens": 32}})
  return ck, c


def test_all_suites_report_and_compare(tmp_path):
  ck, c = _tiny_run(tmp_path)
  work = str(tmp_path / "w")
  out = suite.run(ck, list(eval_settings.SUITES), work, c, name="tiny")
  files = set(os.listdir(os.path.join(work, "eval")))
  for s in eval_settings.SUITES:
    assert f"{s}.json" in files and f"{s}.png" in files, s
    with open(os.path.join(work, "eval", f"{s}.json")) as f:
      saved = json.load(f)
    assert saved["seed"] == 0 and saved["suite"] == s and saved["name"] == "tiny"
  assert out["rd"]["r_d"][0] == 1.0 and len(out["rd"]["r_d"]) == 3
  assert out["ppl"]["multi_doc"]["distractor_tokens"] == 32
  assert np.shape(out["niah"]["multi"]["accuracy"]) == (2, 2)
  # device modes stop at device_max_tokens; host modes go on
  assert out["dict"]["dense"]["memory_tokens"] == [32] and out["dict"]["ivf"]["memory_tokens"] == [32, 128]
  assert out["dict"]["flat"]["recall"][-1] == 1.0
  text = open(os.path.join(work, "eval", "report.md")).read()
  for s in eval_settings.SUITES:
    assert f"## {s}" in text and f"![{s}]({s}.png)" in text
  # compare: the same run evaluated again with another seed, through the CLI
  work2 = str(tmp_path / "w2")
  suite.run(ck, ["rd", "passkey"], work2, dataclasses.replace(c, seed=1), name="tiny_seed1")
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-m", "fot_jax.evaluate", "compare", work, work2,
                         f"--workdir={tmp_path / 'cmp'}"], capture_output=True, text=True, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  md = open(tmp_path / "cmp" / "compare.md").read()
  assert "r_d tiny | r_d tiny_seed1" in md and "accuracy tiny | accuracy tiny_seed1" in md
  assert os.path.isfile(tmp_path / "cmp" / "compare_rd.png")
  proc = subprocess.run([sys.executable, "-m", "fot_jax.evaluate", "compare", str(tmp_path / "nothing")],
                        capture_output=True, text=True, env=env, cwd=ROOT)
  assert proc.returncode != 0 and "holds no eval/*.json" in proc.stderr


def test_multi_doc_memory_holds_the_preceding_documents(tmp_path):
  # multi_doc at memory M equals single_doc on the stream (preceding documents + own tokens)
  # with distractor_tokens + M tokens of memory.
  cfg = get_size("tiny", vocab_size=64)
  infer = MemoryInference(cfg, init_params(cfg, 0), window=8, mode="dense")
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 64, n).astype(np.int32) for n in (40, 30, 50)]
  got = perplexity.perplexity_vs_memory(infer, docs, [0, 16], 8, batch=3, doc_mode="multi_doc",
                                        distractor_tokens=24)
  for k, m in enumerate([0, 16]):
    nll = []
    for i, d in enumerate(docs):
      prev = perplexity.preceding_documents(docs, i, 24)
      stream = np.concatenate([prev, d[-(m + 9):]])[None]
      nll.append(perplexity.span_nll(infer, stream, 24 + m, 8))
    np.testing.assert_allclose(got["nll"][k], np.mean(nll), rtol=1e-5)
  prev = perplexity.preceding_documents(docs, 0, 60)
  np.testing.assert_array_equal(prev, np.concatenate([docs[2], docs[1]])[-60:])  # docs[1] nearest, last


def test_model_overrides_flag_parses_fields_and_names_bad_ones():
  import pytest
  from fot_jax.evaluate import _model_overrides
  out = _model_overrides('{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "attention_impl": "blockwise"}')
  assert out == {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "attention_impl": "blockwise"}
  assert _model_overrides(None) == {}
  with pytest.raises(ValueError, match="not JSON"):
    _model_overrides("{rope: 1}")
  with pytest.raises(ValueError, match=r"unknown: \['rope'\]"):
    _model_overrides('{"rope": 1}')
  with pytest.raises(ValueError, match="--mem_layers"):
    _model_overrides('{"mem_layers": [1]}')


def test_passkey_killed_midway_resumes_prompt_by_prompt(tmp_path, monkeypatch, capsys):
  """suite.run's passkey killed after its first batch (of 2): the same command scores only the
  second batch, its JSON equals an uninterrupted run's (each prompt's expected and generated
  answer listed), and records of another checkpoint (other parameters) are not reused."""
  import pytest
  from fot_jax.eval import retrieval
  ck, c = _tiny_run(tmp_path)
  c = dataclasses.replace(c, batch=2)
  calls, kill_after = [], [None]
  answer_logits = retrieval.InferenceModel.answer_logits

  def counted(self, tokens, mask, starts):
    if kill_after[0] is not None and len(calls) >= kill_after[0]:
      raise KeyboardInterrupt("killed")
    calls.append(len(tokens))
    return answer_logits(self, tokens, mask, starts)

  monkeypatch.setattr(retrieval.InferenceModel, "answer_logits", counted)
  reference = suite.run(ck, ["passkey"], str(tmp_path / "ref"), c, name="tiny")["passkey"]
  assert calls == [2, 2] and len(reference["prompts"]) == 4
  assert {"expected", "answer", "correct", "length", "depth", "trial"} <= set(reference["prompts"][0])
  calls.clear()
  kill_after[0] = 1
  with pytest.raises(KeyboardInterrupt):
    suite.run(ck, ["passkey"], str(tmp_path / "w"), c, name="tiny")
  calls.clear()
  kill_after[0] = None
  capsys.readouterr()
  out = suite.run(ck, ["passkey"], str(tmp_path / "w"), c, name="tiny")["passkey"]
  assert calls == [2] and "2 of 2 prompts from" in capsys.readouterr().out
  assert {k: v for k, v in out.items() if k != "seconds"} == {k: v for k, v in reference.items() if k != "seconds"}
  saved = json.load(open(tmp_path / "w" / "eval" / "passkey.json"))
  assert saved["prompts"] == reference["prompts"]
  # other parameters, same everything else: a new model key, every prompt scored again
  cfg = get_size("tiny", vocab_size=260)
  checkpoint.save(str(tmp_path / "ckpt2"), init_params(cfg, 1), cfg, 16)
  calls.clear()
  suite.run(str(tmp_path / "ckpt2"), ["passkey"], str(tmp_path / "w"), c, name="tiny")
  assert calls == [2, 2]
