"""Outputs get the mode open() gives a new file (0o666 & ~umask), like the PNGs beside them.

tempfile.mkstemp (jsonio.write_json's atomic write) and safetensors' save_file make 0600 files;
jsonio.honour_umask chmods them. Checked under umask 022 (0644: readable by others) and 077 (0600:
the user's choice honoured, not a fixed 0644), for a JSON result, an evaluation suite's JSON (ppl.json;
passkey.json and the others are written the same way), an
imported checkpoint's fot_jax_model.json and a Hugging Face export (config.json, model.safetensors,
shards and their index).
"""
import os
import stat
import warnings

import pytest

from fot_jax import checkpoint, jsonio
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o077])
def mask(request):
  old = os.umask(request.param)
  yield request.param
  os.umask(old)


def test_umask_is_read_without_changing_it(mask):
  assert jsonio.umask() == mask
  assert jsonio.umask() == mask  # still the same: reading it did not reset it


def test_write_json_honours_the_umask(tmp_path, mask):
  path = tmp_path / "results.json"
  jsonio.write_json(path, {"a": 1})
  assert _mode(path) == 0o666 & ~mask
  with open(tmp_path / "plot.png", "w") as f:  # what matplotlib's savefig gets: open()
    f.write("png")
  assert _mode(path) == _mode(tmp_path / "plot.png")
  jsonio.write_json(path, {"a": 2})  # replacing an existing file: the same
  assert _mode(path) == 0o666 & ~mask and jsonio.read_json(path) == {"a": 2}
  assert sorted(os.listdir(tmp_path)) == ["plot.png", "results.json"]  # no temporary file left


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  cfg = get_size("tiny", vocab_size=260)
  path = str(tmp_path_factory.mktemp("ck") / "ckpt")
  old = os.umask(0o077)  # made private on purpose: the tests below must change every file they check
  try:
    checkpoint.save(path, init_params(cfg, 0), cfg, 16)
  finally:
    os.umask(old)
  return path


def test_checkpoint_and_hf_export_files_honour_the_umask(tmp_path, mask, tiny_checkpoint):
  from fot_jax.convert import api
  ck = str(tmp_path / "ckpt")
  cfg = get_size("tiny", vocab_size=260)
  checkpoint.save(ck, init_params(cfg, 0), cfg, 16)
  assert _mode(os.path.join(ck, checkpoint.MODEL_JSON)) == 0o666 & ~mask
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # mem_positions / byte vocabulary notices
    one = api.export_hf(tiny_checkpoint, str(tmp_path / "hf"))
    sharded = api.export_hf(tiny_checkpoint, str(tmp_path / "hf_shards"), max_shard_size="20KB")
  files = [os.path.join(one, f) for f in ("config.json", "model.safetensors")]
  shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
  assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(sharded)
  files += [os.path.join(sharded, f) for f in shards + ["model.safetensors.index.json", "config.json"]]
  assert {f: oct(_mode(f)) for f in files} == {f: oct(0o666 & ~mask) for f in files}


def test_an_evaluation_suite_json_honours_the_umask(tmp_path, tiny_checkpoint):
  from fot_jax.eval import settings as eval_settings
  from fot_jax.eval import suite
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(3):
    (corpus / f"f{i}.py").write_text("".join(f"x{i}_{j} = {j * i}\n" for j in range(40)))
  c = eval_settings.SuiteSettings.from_dict({  # ppl: the cheapest suite; all write through write_json
      "task": f"files:{corpus}/*.py", "split": "train", "vocab": "byte", "batch": 2,
      "ppl": {"memory_tokens": (0,), "score_tokens": 16, "n_docs": 1}})
  old = os.umask(0o022)
  try:
    suite.run(tiny_checkpoint, ["ppl"], str(tmp_path / "w"), c, name="tiny")
  finally:
    os.umask(old)
  out = tmp_path / "w" / "eval"
  assert oct(_mode(out / "ppl.json")) == oct(0o644) == oct(_mode(out / "ppl.png"))
