"""The main job end to end on a few-second config, and config validation."""
import json
import subprocess
import sys

import pytest

from experiments import dictionary_lookup
from fot_jax import configs
from fot_jax.runners import dictionary
from tests.test_raw_config import assert_only_listed_readers, record_config_reads


def test_dictionary_job_writes_results_and_plot(tmp_path):
  config = dictionary_lookup.get_test_config()
  with record_config_reads() as readers:  # the experiment's ConfigDict is read by configs.resolve alone
    exp = configs.resolve(config)
    results = dictionary.run(exp, str(tmp_path))
  assert_only_listed_readers(readers)
  saved = json.loads((tmp_path / "results.json").read_text())
  for arm in ("fot", "fot_seed1", "baseline"):
    assert saved[arm]["memory_tokens"] == [256, 1024, 2048]
    assert len(saved[arm]["accuracy"]) == 3
    assert all(0.0 <= a <= 1.0 for a in saved[arm]["accuracy"])
  assert saved["fot"]["tokens_in_memory"] == [256, 1024, 2048]
  assert saved["baseline"]["tokens_in_memory"] == [256, 1024, 2048]
  # The curriculum: copy and lookup end at max_steps (2 each), negatives run 2 steps, then stop.
  assert [(p["name"], p["task"], p["start"], p["end"]) for p in saved["fot"]["phases"]] == [
      ("copy", "copy", 0, 2), ("lookup", "dictionary", 2, 4), ("negatives", "dictionary", 4, 6)]
  assert saved["fot"]["train_steps"] == 6 < config.fot.steps
  # The baseline trains on the same tasks for the same steps, without crossbatch.
  assert [(p["task"], p["spec"], p["start"], p["end"]) for p in saved["baseline"]["phases"]] == [
      ("copy", {}, 0, 2), ("dictionary", {}, 2, 4), ("dictionary", {}, 4, 6)]
  assert saved["seeds"]["seeds"] == [0, 1] and len(saved["seeds"]["min"]) == 3
  for label in ("independent", "disjoint_keys"):
    rd = saved["rd"]["fot"][label]
    assert rd["d"] == [1, 2, 4] and rd["r_d"][0] == pytest.approx(1.0) and rd["n_docs"] == 4
  assert (tmp_path / "dictionary_lookup.png").stat().st_size > 1000
  assert (tmp_path / "fot" / "metrics.jsonl").exists()
  # Running again resumes from the checkpoints (finished curricula) instead of training again.
  again = dictionary.run(exp, str(tmp_path))
  assert again["fot"]["accuracy"] == results["fot"]["accuracy"]
  assert again["fot"]["train_steps"] == 6 and again["fot"]["phases"] == saved["fot"]["phases"]


@pytest.mark.parametrize("field,value,message", [
    ("fot.window", 200, "fot.window"),
    ("eval.memory_tokens", (300,), "eval.memory_tokens"),
    ("fot.slots", 17, "distinct keys"),
    ("fot.curriculum.phases", [{"task": "dictionary", "spec": {"d": 64, "w": 1}}], "crossbatch.d"),
    ("fot.curriculum.phases", [{"task": "dictionary", "spec": {"d": 1, "w": 3}}], "pack size"),
    ("fot.curriculum.phases", [{"task": "books", "spec": {"d": 1, "w": 1}}], "books"),
    ("baseline.window", 48, "baseline.window"),
    ("model.overrides.vocab_size", 100, "vocab_size"),
    ("model.size", "huge", "model.size"),
    ("optim.lr", -1.0, "optim.lr"),
])
def test_validate_names_the_bad_field(field, value, message):
  config = dictionary_lookup.get_config()
  node = config
  *parents, leaf = field.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ValueError, match=message):
    configs.resolve(config)


@pytest.mark.parametrize("field,value,message", [
    ("warmup.num_symbols", 300, "warmup: symbol ids 3..302"),
    ("warmup.span", 300, "num_symbols >= span"),
])
def test_lm_warmup_errors_name_the_field(field, value, message):
  from experiments import stdlib_lm_tiny
  config = stdlib_lm_tiny.get_config()
  config.warmup[field.split(".")[1]] = value
  with pytest.raises(ValueError, match=message):
    configs.resolve(config, check_data=False)
  # A curriculum that never names the warm-up (a constant d) is still a valid LM config.
  config = stdlib_lm_tiny.get_config()
  config.train.curriculum = {"kind": "constant", "spec": {"d": 8, "w": 1}}
  configs.resolve(config, check_data=False)


def test_cli_reports_config_errors_without_traceback(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "fot_jax.main", "--config=experiments/dictionary_lookup.py",
                         "--config.fot.window=200", f"--workdir={tmp_path}"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode != 0
  assert "config error: fot.window=200" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_a_misspelt_config_field_is_one_line_with_the_suggestion(tmp_path):
  """ml_collections raises it inside absl's flag parsing (three chained tracebacks before)."""
  proc = subprocess.run([sys.executable, "-m", "fot_jax.main", "--config=experiments/stdlib_lm_tiny.py",
                         "--config.train.stpes=3", f"--workdir={tmp_path}"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == ("fot_jax.main: --config.train.stpes=3: no field 'stpes' in the "
                                                  "config; did you mean 'steps'?")
