"""No silent wrong answers from a workdir: a resume with other run-defining settings is refused
naming them (allowed ones resume), evaluation refuses a workdir with nothing to restore, a damaged
checkpoint step is one error naming it, and fot_jax.main prints bad inputs as one line."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax.curriculum import Schedule
from fot_jax.model.config import get_size
from fot_jax.train import RUN_FINGERPRINT, NoCheckpoint, train

ROOT = Path(__file__).resolve().parents[1]
TASK = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=8, n_queries=8)
CFG = get_size("tiny", vocab_size=TASK.vocab_size, num_layers=2, mem_layers=(1,))  # the fewest ops that compile
BATCHES = DictionaryBatches(TASK, slots=2, window=TASK.doc_len // 2, seed=0)


def _tc(steps=1, **kw):
  return dict({"steps": steps, "seed": 0, "loss_on": "last", "log_every": 1, "checkpoint_every": 1,
               "tensorboard": False, "optim": {"lr": 1e-2}}, **kw)


def _schedule():
  return Schedule({"kind": "constant", "spec": {"d": 2, "w": 1}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir after one step (checkpoint 1 and its fingerprint); tests work on copies."""
  workdir = tmp_path_factory.mktemp("guards") / "run"
  train(CFG, _tc(), _schedule(), BATCHES, str(workdir))
  return workdir


def _copy(trained, tmp_path):
  shutil.copytree(trained, tmp_path / "run")
  return tmp_path / "run"


def test_resume_with_another_lr_or_model_is_refused_naming_the_fields(trained, tmp_path):
  workdir = str(_copy(trained, tmp_path))
  with pytest.raises(ValueError, match=r"optim\.lr: 0\.01 -> 0\.001\.") as e:
    train(CFG, _tc(2, optim={"lr": 1e-3}), _schedule(), BATCHES, workdir)
  assert "model." not in str(e.value) and RUN_FINGERPRINT in str(e.value)
  import dataclasses
  with pytest.raises(ValueError, match=r"model\.hidden_size: 32 -> 64") as e:  # by name, before any restore
    train(dataclasses.replace(CFG, hidden_size=64), _tc(2), _schedule(), BATCHES, workdir)
  with pytest.raises(ValueError, match=r"curriculum\.spec\.d: 2 -> 1"):
    train(CFG, _tc(2), Schedule({"kind": "constant", "spec": {"d": 1, "w": 1}}), BATCHES, workdir)
  with pytest.raises(ValueError, match=r"data\.slots: \(unset\) -> 2"):  # a caller's run field
    train(CFG, _tc(2), _schedule(), BATCHES, workdir, run_fields={"data": {"slots": 2}})
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1"]  # nothing trained


def test_resume_with_allowed_changes_continues(trained, tmp_path):
  """steps (extending the run), logging and checkpoint cadence, TensorBoard and the mesh may
  change (fot_jax.train.RESUMABLE_FIELDS); the fingerprint keeps the run's start."""
  workdir = _copy(trained, tmp_path)
  out = train(CFG, _tc(2, log_every=5, checkpoint_every=0, tensorboard=False, mesh={"data": -1}), _schedule(),
              BATCHES, str(workdir))
  assert [h["step"] for h in out["history"]] == [2]
  recorded = json.loads((workdir / RUN_FINGERPRINT).read_text())
  assert recorded["recorded_at_step"] == 0 and recorded["run"]["optim"]["lr"] == 0.01
  assert recorded["run"]["train"]["steps"] == 1 and recorded["run"]["train"]["log_every"] == 1


def test_workdir_without_fingerprint_resumes_and_records_one(trained, tmp_path):
  """A workdir written before fingerprints resumes as before, and records its settings then."""
  workdir = _copy(trained, tmp_path)
  (workdir / RUN_FINGERPRINT).unlink()
  out = train(CFG, _tc(2), _schedule(), BATCHES, str(workdir))
  assert [h["step"] for h in out["history"]] == [2]
  recorded = json.loads((workdir / RUN_FINGERPRINT).read_text())
  assert recorded["recorded_at_step"] == 1 and recorded["run"]["optim"]["lr"] == 0.01


def test_evaluate_refuses_a_workdir_with_no_restorable_step(tmp_path):
  """--mode=evaluate (train=False) on an arm whose checkpoints folder holds only a half-written
  save: one error naming the folder and what it holds, no freshly initialised model evaluated."""
  from experiments import dictionary_lookup
  from fot_jax import configs
  from fot_jax.runners import dictionary
  exp = configs.resolve(dictionary_lookup.get_test_config())
  (tmp_path / "fot" / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir(parents=True)
  with pytest.raises(NoCheckpoint, match=r"--mode=evaluate: nothing to evaluate for arm 'fot': .*fot/checkpoints: "
                                         r"no restorable checkpoint step \(it holds only 6\.orbax-checkpoint-tmp-1\)"):
    dictionary.run(exp, str(tmp_path), train=False)
  with pytest.raises(NoCheckpoint, match=r"the folder does not exist"):
    dictionary.run(exp, str(tmp_path / "never_trained"), train=False)
  assert not (tmp_path / "never_trained" / "fot" / "checkpoints").exists()  # evaluation creates nothing


def test_a_damaged_checkpoint_step_is_one_error_naming_it(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  for f in (workdir / "checkpoints" / "1").rglob("*"):
    if f.is_file():
      f.write_bytes(b"")  # truncated by a crash or a full disk
  with pytest.raises(ValueError, match=r"checkpoint .*checkpoints/1 does not restore \(.*\); delete that folder"):
    train(CFG, _tc(2), _schedule(), BATCHES, str(workdir))


def _main(*args):
  env = {k: v for k, v in os.environ.items() if k != "FOT_JAX_TRACEBACK"}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run([sys.executable, "-m", "fot_jax.main", *args], capture_output=True, text=True,
                        timeout=300, cwd=ROOT, env=env)


@pytest.mark.parametrize("case", ["missing_config", "init_from_empty_folder", "evaluate_empty_checkpoints"])
def test_cli_bad_inputs_end_in_one_line(tmp_path, case):
  if case == "missing_config":
    args, names = ["--config=experiments/no_such_experiment.py", f"--workdir={tmp_path}"], \
        "--config=experiments/no_such_experiment.py: no such experiment file"
  elif case == "init_from_empty_folder":
    (tmp_path / "ckpt").mkdir()
    args = ["--config=experiments/stdlib_lm_tiny.py", f"--config.train.init_from={tmp_path / 'ckpt'}",
            f"--workdir={tmp_path / 'w'}"]
    names = f"train.init_from: '{tmp_path / 'ckpt'}' is not an fot_jax checkpoint: it has no fot_jax_model.json"
  else:
    (tmp_path / "w" / "fot" / "checkpoints").mkdir(parents=True)
    args = ["--config=experiments/dictionary_lookup.py", "--mode=evaluate", f"--workdir={tmp_path / 'w'}"]
    names = f"{tmp_path / 'w' / 'fot' / 'checkpoints'}: no restorable checkpoint step (the folder is empty)"
  proc = _main(*args)
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("fot_jax.main: "), proc.stderr
  assert names in lines[0]
