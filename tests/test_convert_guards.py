"""No silent wrong answers from fot_jax.convert and fot_jax.study: verify_export judges an export by
tolerances (a tampered export fails, exit status 1, one line saying what exceeded which tolerance),
and bad inputs end in one line naming them (exit status 2, no traceback), run from the command line."""
import json
import os
import shutil
import subprocess
import sys

import ml_collections
import pytest

from fot_jax.study import settings as study_settings
from fot_jax import checkpoint
from fot_jax.convert import ConvertError, mapping
from fot_jax.convert.__main__ import main as convert_main
from fot_jax.model.config import ModelConfig, get_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 8


# ---------------------------------------------------------------- verify_export's tolerances

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """A tiny checkpoint (byte ids fit), its float32 and bfloat16 exports, and a text."""
  import fot_jax
  from tests.hf_models import make_hf
  tmp = tmp_path_factory.mktemp("verify")
  make_hf(tmp / "hf", vocab_size=260)
  model = fot_jax.from_pretrained(str(tmp / "hf"), mem_layers=(1,))
  model.save(str(tmp / "ck"))
  model.save_hf(str(tmp / "f32"))
  model.save_hf(str(tmp / "bf16"), dtype="bfloat16")
  (tmp / "t.txt").write_text("def f(x):\n  return x + 1\n" * 4)
  return tmp


def _tamper(src, dst, change):
  """A copy of an export with change(tensors) applied to its safetensors."""
  from safetensors.torch import load_file, save_file
  shutil.copytree(src, dst)
  tensors = load_file(str(dst / "model.safetensors"))
  change(tensors)
  save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  return dst


def _verify(tmp, export, *flags):
  convert_main(["verify_export", "--checkpoint", str(tmp / "ck"), "--export", str(export), "--text",
                str(tmp / "t.txt"), "--tokens", str(3 * WINDOW + 2), "--vocab", "byte", *flags])


def test_verify_export_passes_good_exports_and_fails_a_tampered_one(exported, tmp_path, capsys):
  tmp = exported
  for name in ("f32", "bf16"):
    _verify(tmp, tmp / name)  # no SystemExit: within the default tolerances
    out = capsys.readouterr().out
    assert f"export_dtype={'float32' if name == 'f32' else 'bfloat16'}" in out and "within tolerance" in out

  def one_weight(t):  # one element of the final norm: every logit moves a little
    t["model.norm.weight"][3] += 0.5

  bad = _tamper(tmp / "f32", tmp_path / "f32_bad", one_weight)
  with pytest.raises(SystemExit) as info:
    _verify(tmp, bad)
  err = capsys.readouterr().err.strip().splitlines()
  assert info.value.code == 1 and len(err) == 1
  assert err[-1].startswith(f"fot_jax.convert: verify_export: {bad} (float32) differs from {tmp / 'ck'}: "
                            "max |Δ logit| ")
  assert err[-1].endswith(" exceeds --max_logit_diff=0.001")
  _verify(tmp, bad, "--max_logit_diff", "100")  # the flag: a loose tolerance passes it
  assert "within tolerance" in capsys.readouterr().out

  def sharper(t):  # the output layer x3: the same argmax, a different NLL
    t["lm_head.weight"] *= 3

  bad16 = _tamper(tmp / "bf16", tmp_path / "bf16_bad", sharper)
  with pytest.raises(SystemExit) as info:
    _verify(tmp, bad16)
  err = capsys.readouterr().err.strip().splitlines()
  assert info.value.code == 1 and len(err) == 1
  assert f"{bad16} (bfloat16) differs" in err[-1] and "exceeds --max_nll_diff=0.01" in err[-1]
  assert "argmax" not in err[-1]  # the argmax agreement stayed within its tolerance
  with pytest.raises(SystemExit):
    _verify(tmp, tmp / "bf16", "--min_argmax_agree", "1.5")  # a tolerance out of range is a bad input
  assert "--min_argmax_agree must be in [0, 1]" in capsys.readouterr().err


def test_verify_failures_by_dtype():
  from fot_jax.convert.verify import failures
  r = {"export_dtype": "float32", "max_abs_logit_diff": 2e-3, "argmax_agree": 0.5, "nll_fot_jax": 1.0,
       "nll_torch": 2.0}
  assert failures(r) == ["max |Δ logit| 0.002 exceeds --max_logit_diff=0.001"]  # float32: the logits only
  assert failures(dict(r, max_abs_logit_diff=float("nan")))  # NaN is no pass
  half = dict(r, export_dtype="bfloat16", max_abs_logit_diff=0.3, argmax_agree=0.97, nll_torch=1.005)
  assert failures(half) == ["argmax agreement 0.9700 is below --min_argmax_agree=0.98"]
  assert failures(dict(half, argmax_agree=0.99)) == []
  assert failures(dict(half, export_dtype="float16", nll_torch=1.02), min_argmax_agree=0.9) == [
      "|Δ NLL| 0.02 exceeds --max_nll_diff=0.01"]


# ---------------------------------------------------------------- types in the files convert reads

def _model_json(directory, **changes):
  """A checkpoint directory holding only fot_jax_model.json (its fields are read before any parameter)."""
  info = {"model": get_size("tiny").to_dict(), "window": 16, "tokenizer": None, "vocab": "byte"}
  for key, value in changes.items():
    if key in info["model"]:
      info["model"][key] = value
    else:
      info[key] = value
  os.makedirs(directory)
  (directory / checkpoint.MODEL_JSON).write_text(json.dumps(info))
  return directory


@pytest.mark.parametrize("field,value", [
    ("num_layers", "two"), ("vocab_size", 64.0), ("hidden_size", None), ("num_kv_heads", "2"),
    ("rope_theta", "1e4"), ("tie_embeddings", "yes"), ("dtype", 32), ("mem_layers", "1"),
    ("rope_scaling", "linear"), ("window", "x"), ("window", 0), ("vocab", ["byte"])])
def test_model_json_field_of_the_wrong_type_names_file_and_field(tmp_path, field, value):
  ck = _model_json(tmp_path / "ck", **{field: value})
  with pytest.raises(ConvertError) as info:
    checkpoint.load(str(ck))
  msg = str(info.value)
  assert msg.startswith(str(ck / checkpoint.MODEL_JSON) + ": ") and field in msg and repr(value) in msg


def test_model_config_from_dict_is_the_one_parser():
  cfg = get_size("tiny")
  d = cfg.to_dict()
  assert d["mem_layers"] == [1] and json.loads(json.dumps(d)) == d  # what fot_jax_model.json holds
  assert ModelConfig.from_dict(d, "here") == cfg
  assert ModelConfig.from_dict({"mem_layers": [0, "2"]}, "here", base=cfg).mem_layers == (0, 2)
  with pytest.raises(ValueError, match=r"^SRC: unknown ModelConfig field\(s\) \['nope'\]"):
    ModelConfig.from_dict({"nope": 1, "num_layers": 2}, "SRC")
  with pytest.raises(ValueError, match=r"^SRC: model.mem_layers: layer 5 is outside 0..2"):
    ModelConfig.from_dict({"mem_layers": [5]}, "SRC", base=cfg)


def test_model_json_unknown_field_is_named(tmp_path):
  ck = tmp_path / "ck"
  _model_json(ck)
  info = json.loads((ck / checkpoint.MODEL_JSON).read_text())
  info["model"]["nope"] = 1
  (ck / checkpoint.MODEL_JSON).write_text(json.dumps(info))
  with pytest.raises(ConvertError, match=r"fot_jax_model.json: unknown ModelConfig field\(s\) \['nope'\]"):
    checkpoint.load(str(ck))


def test_every_model_config_field_has_a_type_check():
  import dataclasses
  for f in dataclasses.fields(ModelConfig):
    annotation = str(f.type)
    annotation = annotation[len("Optional["):-1] if annotation.startswith("Optional[") else annotation
    assert annotation in checkpoint.FIELD_TYPES, f"{f.name}: {f.type} (add it to checkpoint.FIELD_TYPES)"


@pytest.mark.parametrize("field,value", [
    ("hidden_size", "big"), ("num_key_value_heads", 2.5), ("rms_norm_eps", "x"), ("tie_word_embeddings", "no"),
    ("mem_layers", "1,2"), ("rope_scaling", "linear"), ("max_position_embeddings", [8])])
def test_hf_config_field_of_the_wrong_type_names_file_and_field(field, value):
  good = {"model_type": "llama", "vocab_size": 37, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 8}
  mapping.model_config_from_hf(good, "SRC/config.json")
  with pytest.raises(ConvertError, match=f"^SRC/config.json: {field} must be "):
    mapping.model_config_from_hf(dict(good, **{field: value}), "SRC/config.json")
  rope = dict(good, rope_scaling={"rope_type": "linear", "factor": "x"})
  with pytest.raises(ConvertError, match="^SRC/config.json: .*factor"):  # inside the RoPE parameters
    mapping.model_config_from_hf(rope, "SRC/config.json")


def test_study_config_checks_name_the_method():
  c = ml_collections.ConfigDict({"base": {"checkpoint": "x"}, "lengths": (32,), "suites": ("ppl",), "pad": 64,
                                 "ppl": {"score_tokens": 8, "n_docs": 1, "tolerance": 1.1}, "eval": {}})
  c.methods = [{"name": "a"}]
  study_settings.StudySettings.from_dict(c)
  for methods, match in (([{"name": "a", "inference": "kv"}], "study method 'a': unknown inference path 'kv'"),
                         ([{"name": "a", "overides": {}}], r"study method 'a': unknown key\(s\) \['overides'\]"),
                         ([{"name": "../a"}], "method 0 needs a 'name'"),
                         ([{"name": "a", "overrides": [1]}], "study method 'a': overrides must be a dict"),
                         ([{"name": "a"}, {"name": "a"}], "method names must be unique")):
    c.methods = methods
    with pytest.raises(ValueError, match=match):
      study_settings.StudySettings.from_dict(c)
  c.methods, c.suites = [{"name": "a"}], ("ppl", "perplexity")
  with pytest.raises(ValueError, match=r"unknown suite\(s\) \['perplexity'\]"):
    study_settings.StudySettings.from_dict(c)


# ---------------------------------------------------------------- bad inputs on the command line

STUDY_FILE = '''
import ml_collections

def get_config(arm="unknown_method"):
  methods = {"unknown_method": {"name": "m", "inference": "kv"},
             "misspelt": {"name": "m", "overides": {"mem_layers": (1,)}}}[arm]
  c = ml_collections.ConfigDict()
  c.base = ml_collections.ConfigDict({"checkpoint": "/nowhere"})
  c.lengths, c.suites, c.pad = (32,), ("ppl",), 64
  c.ppl, c.eval = ml_collections.ConfigDict(), ml_collections.ConfigDict()
  c.methods = [{"name": "none"}, methods]
  return c
'''


def _bad_inputs(tmp):
  """(id, command, what the last line of stderr must hold): one subprocess each."""
  from safetensors.torch import save_file
  import torch
  hf = tmp / "hf"
  os.makedirs(hf)
  config = {"model_type": "llama", "vocab_size": 37, "hidden_size": "big", "intermediate_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8}
  (hf / "config.json").write_text(json.dumps(config))
  trunc = tmp / "trunc"
  os.makedirs(trunc)
  (trunc / "config.json").write_text(json.dumps(dict(config, hidden_size=32)))
  save_file({"model.norm.weight": torch.ones(32)}, str(trunc / "model.safetensors"))
  data = (trunc / "model.safetensors").read_bytes()
  (trunc / "model.safetensors").write_bytes(data[:len(data) // 2])
  layers = _model_json(tmp / "ck_layers", num_layers="two")
  window = _model_json(tmp / "ck_window", window="x")
  tokenizer = tmp / "tok" / "tokenizer.json"
  _big_tokenizer(tokenizer, 300)
  small = _small_checkpoint(tmp / "ck")
  (tmp / "study.py").write_text(STUDY_FILE)
  (tmp / "study_noarg.py").write_text(STUDY_FILE.replace('get_config(arm="unknown_method")', "get_config()")
                                      .replace("[arm]", '["unknown_method"]'))
  conv, st = [sys.executable, "-m", "fot_jax.convert"], [sys.executable, "-m", "fot_jax.study"]
  out = str(tmp / "out")  # no command may create it
  return [
      ("import_hf_non_numeric_size", conv + ["import_hf", "--hf_dir", str(hf), "--out", out],
       f"fot_jax.convert: {hf / 'config.json'}: hidden_size must be an integer, got 'big'"),
      ("import_hf_truncated_safetensors", conv + ["import_hf", "--hf_dir", str(trunc), "--out", out],
       f"fot_jax.convert: {trunc / 'model.safetensors'}: unreadable safetensors file, truncated or corrupt"),
      ("export_hf_missing_checkpoint", conv + ["export_hf", "--checkpoint", str(tmp / "nowhere"), "--out", out],
       f"fot_jax.convert: {tmp / 'nowhere'}: checkpoint directory does not exist"),
      ("export_hf_num_layers_two", conv + ["export_hf", "--checkpoint", str(layers), "--out", out],
       f"fot_jax.convert: {layers / checkpoint.MODEL_JSON}: model.num_layers must be an integer, got 'two'"),
      ("export_hf_window_x", conv + ["export_hf", "--checkpoint", str(window), "--out", out],
       f"fot_jax.convert: {window / checkpoint.MODEL_JSON}: window must be a positive integer or null, got 'x'"),
      ("export_hf_tokenizer_too_big", conv + ["export_hf", "--checkpoint", str(small), "--out", out,
                                              "--tokenizer", str(tokenizer)],
       f"fot_jax.convert: {tokenizer}: the tokenizer has 302 tokens but {small}'s embedding has vocab_size=64 rows"),
      ("verify_export_missing_text", conv + ["verify_export", "--checkpoint", str(small), "--export", out,
                                             "--text", str(tmp / "missing.txt")],
       f"fot_jax.convert: verify_export: --text {tmp / 'missing.txt'}: file not found"),
      ("study_unknown_method", st + [f"--config={tmp / 'study.py'}", f"--workdir={out}"],
       f"fot_jax.study: {tmp / 'study.py'}: study method 'm': unknown inference path 'kv'"),
      ("study_misspelt_method_key", st + [f"--config={tmp / 'study.py'}:misspelt", f"--workdir={out}"],
       f"fot_jax.study: {tmp / 'study.py'}:misspelt: study method 'm': unknown key(s) ['overides']"),
      ("study_unknown_arm", st + [f"--config={tmp / 'study.py'}:nosuch", f"--workdir={out}"],
       f"fot_jax.study: --config={tmp / 'study.py'}:nosuch: loading the experiment file raised KeyError: 'nosuch'"),
      ("study_arm_of_a_file_without_arms", st + [f"--config={tmp / 'study_noarg.py'}:fast", f"--workdir={out}"],
       "takes no ':ARG' after its path"),
      ("study_missing_file", st + [f"--config={tmp / 'nowhere.py'}", f"--workdir={out}"],
       f"fot_jax.study: --config: no study file at {tmp / 'nowhere.py'}"),
  ]


def _big_tokenizer(path, n):
  """A tokenizer.json of n words plus <s> and </s>."""
  from tokenizers import Tokenizer
  from tokenizers.models import WordLevel
  vocab = {f"w{i}": i for i in range(n)}
  vocab.update({"<s>": n, "</s>": n + 1})
  os.makedirs(path.parent)
  Tokenizer(WordLevel(vocab, unk_token="w0")).save(str(path))


def _small_checkpoint(path):
  from fot_jax.model.init import init_params
  cfg = get_size("tiny")
  checkpoint.save(str(path), init_params(cfg, 0), cfg, 16, vocab="byte")
  return path


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
  """Every bad-input command, three at a time (each mostly imports) -> (tmp, {id: (command, want,
  exit status, stderr)})."""
  from concurrent.futures import ThreadPoolExecutor
  tmp = tmp_path_factory.mktemp("bad_inputs")
  cases = _bad_inputs(tmp)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
  env.pop("FOT_JAX_TRACEBACK", None)

  def one(case):
    name, cmd, want = case
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return name, (cmd, want, p.returncode, p.stderr)

  with ThreadPoolExecutor(3) as pool:
    return tmp, dict(pool.map(one, cases))


CLI_CASES = ["import_hf_non_numeric_size", "import_hf_truncated_safetensors", "export_hf_missing_checkpoint",
             "export_hf_num_layers_two", "export_hf_window_x", "export_hf_tokenizer_too_big",
             "verify_export_missing_text", "study_unknown_method", "study_misspelt_method_key",
             "study_unknown_arm", "study_arm_of_a_file_without_arms", "study_missing_file"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_input_ends_in_one_line_naming_it(cli_runs, case):
  tmp, runs = cli_runs
  cmd, want, rc, stderr = runs[case]
  lines = [x for x in stderr.splitlines() if x.strip()]
  assert rc == 2, (cmd, stderr)
  assert "Traceback" not in stderr, stderr
  assert lines and want in lines[-1], (cmd, lines[-1:])


def test_refused_commands_write_nothing(cli_runs):
  tmp, _ = cli_runs
  assert not os.path.exists(tmp / "out")  # every command above is refused before its output is made


def test_a_runs_workdir_points_at_its_arm(tmp_path):
  """from_pretrained on a training run's workdir (what make smollm2-tune's WORKDIR names) says which
  folder inside it is the checkpoint."""
  from fot_jax.convert.api import load_any
  (tmp_path / "fot").mkdir()
  (tmp_path / "fot" / "fot_jax_model.json").write_text("{}")
  with pytest.raises(ValueError, match=f"it is a run's workdir: load one arm, e.g. {tmp_path / 'fot'}"):
    load_any(str(tmp_path))
