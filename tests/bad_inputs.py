"""Every entry point on bad input, run as a user runs it: one line `PROG: message`, no traceback.

  .venv/bin/python tests/bad_inputs.py [--out TABLE.md] [--only NAME,...] [--jobs 2] [--keep] [--list]

Builds every bad input once in a temporary directory ($TMP in the table), runs each command as a
subprocess (this venv's python, cwd the repository root, JAX_PLATFORMS=cpu, TF_CPP_MIN_LOG_LEVEL=2,
FOT_JAX_TRACEBACK unset), at most --jobs at a time, and prints one row per case: the command, its
exit status, how many stderr lines are not log noise, the last of them, and a verdict. PASS: the
exit status is the case's (2; 1 for verify_export beyond its tolerances), stderr holds no
'Traceback', and the last non-noise stderr line starts with `PROG: ` and contains the case's
substrings (the input it must name). Exit status 1 when any case fails. --out writes the table as
Markdown (docs/errors.md holds a measured one). Not a pytest file (the name does not start with
test_): each case is a fresh Python + JAX import, a few seconds; the whole run a few minutes on 2
cores. The slowest input is a real one-step training run (fot_jax.main on a tiny LM, ~20 s) whose
workdir serves the resume, evaluate, export, ask and lm_harness cases; it is built first, beside the
cheap cases.

Log noise (not counted, never the "last line"): what TensorFlow, XLA, absl and Python print on
their own while a program imports and starts, matched by NOISE below:
  * C++ / absl log lines: a severity letter and MMDD then a time, `I0000 00:00:1796... port.cc:153]`,
    `E0000 ... cuda_platform.cc:52] failed call to cuInit ...`, `W1202 04:30:47.1 ...`;
  * `WARNING: All log messages before absl::InitializeLog() is called are written to STDERR`;
  * Python logging's default format, `WARNING:absl:...`, `INFO:tensorflow:...` (LEVEL:logger:);
  * any line containing `cuInit` (a CPU machine's CUDA probe);
  * a Python warning (`FILE:LINE: SomethingWarning: ...`) and the indented source line after it.
Everything else on stderr counts, so a case printing two lines of its own shows 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 180  # one command (the slowest, the one-step training run, ~40 s on 2 busy cores); a hang: FAIL

NOISE = [re.compile(p) for p in (
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d",  # C++/absl log line: I0000 00:00:1796185222.14 20389 port.cc:153] ...
    r"^WARNING: All log messages before absl::InitializeLog\(\)",
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]+:",  # Python logging's default format: WARNING:absl:...
    r"cuInit",
)]
PY_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")  # warnings.warn: FILE:LINE: XWarning: msg, then a source line


def signal_lines(stderr: str) -> List[str]:
  """stderr's lines less log noise (see the module docstring) and blank lines."""
  out, after_warning = [], False
  for line in stderr.splitlines():
    if after_warning and line.startswith((" ", "\t")):
      after_warning = False
      continue  # the source line Python prints under a warning
    after_warning = bool(PY_WARNING.match(line))
    if after_warning or not line.strip() or any(p.search(line) for p in NOISE):
      continue
    out.append(line)
  return out


# ---------------------------------------------------------------- the cases

@dataclasses.dataclass
class Case:
  name: str
  what: str  # what is wrong with the input, for the table
  module: str  # python -m MODULE; the program name the line must start with
  args: Sequence[str]  # "{T}" is the temporary directory
  want: Tuple[str, ...]  # substrings of the last line (with "{T}"): the input it names
  status: int = 2
  needs: Tuple[str, ...] = ()  # slow inputs built before the case runs: "trained", "export"


TINY_LM = '''"""A one-step FoT LM on stdlib bytes (tests/bad_inputs.py): a real workdir to resume, evaluate, export."""
import ml_collections

from experiments.base_lm import base_config


def get_config():
  c = base_config()
  c.model.overrides = ml_collections.ConfigDict({
      "vocab_size": 260, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
      "num_kv_heads": 4, "mem_layers": (1,)})
  c.data.slots, c.data.windows_per_slot, c.data.window = 2, 2, 32
  c.optim.lr, c.optim.warmup_steps, c.optim.schedule = 1e-3, 0, "constant"
  c.train.steps, c.train.checkpoint_every, c.train.log_every = 1, 1, 1
  c.baseline.enabled = False
  c.eval.memory_tokens, c.eval.score_tokens, c.eval.n_docs, c.eval.batch = (0,), 16, 1, 1
  return c
'''

from test_convert_guards import STUDY_FILE as STUDY  # noqa: E402  (its default arm: inference 'kv')

MAIN, EVAL, CONV, STUDY_M = "fot_jax.main", "fot_jax.evaluate", "fot_jax.convert", "fot_jax.study"
PREVIEW, TOKENIZER = "data_pipelines.preview", "data_pipelines.train_tokenizer"
TINY = "--config={T}/tiny_lm.py"
PREVIEW_SMALL = ["--slots=1", "--windows=1", "--seq_len=8", "--batches=1"]
ASK, HARNESS, READOUT = "fot_jax.ask", "fot_jax.eval.lm_harness", "fot_jax.eval.readout"
SWEEP, TPU = "launch.sweep", "launch.tpu"
QUESTION = "What does f return?"
LONG_QUESTION = ("In the code above, what value does the function f return when it is called with the argument 41, "
                 "and why?")  # 105 bytes
HARNESS_TASKS = ["--tasks", "niah_single_1", "--limit", "1"]  # never reached: the model_args fail first

CASES = [
    # ---- the ten
    Case("main_init_from_empty", "train.init_from is an empty folder", MAIN,
         ["--config=experiments/stdlib_lm_tiny.py", "--config.train.init_from={T}/empty", "--workdir={T}/w_init"],
         ("train.init_from", "{T}/empty")),
    Case("main_init_from_textfile", "train.init_from is a text file", MAIN,
         ["--config=experiments/stdlib_lm_tiny.py", "--config.train.init_from={T}/notes.txt",
          "--workdir={T}/w_init"], ("train.init_from", "{T}/notes.txt")),
    Case("main_evaluate_empty_ckpt", "--mode=evaluate on a workdir whose checkpoints folder is empty", MAIN,
         ["--config=experiments/dictionary_lookup.py", "--mode=evaluate", "--workdir={T}/w_empty_ckpt"],
         ("{T}/w_empty_ckpt/fot/checkpoints",)),
    Case("main_missing_config", "the experiment file does not exist", MAIN,
         ["--config=experiments/no_such_experiment.py", "--workdir={T}/w"], ("no_such_experiment.py",)),
    Case("evaluate_bad_model_json", 'fot_jax_model.json has "num_layers": "two"', EVAL,
         ["--checkpoint={T}/ck_layers", "--suite=ppl", "--workdir={T}/ev_out"],
         ("{T}/ck_layers/fot_jax_model.json", "num_layers")),
    Case("import_hf_nonnumeric", 'config.json has "hidden_size": "big"', CONV,
         ["import_hf", "--hf_dir", "{T}/hf_big", "--out", "{T}/out"], ("{T}/hf_big/config.json", "hidden_size")),
    Case("verify_missing_text", "verify_export --text names a missing file", CONV,
         ["verify_export", "--checkpoint", "{T}/trained/fot", "--export", "{T}/out", "--text", "{T}/missing.txt"],
         ("--text {T}/missing.txt",), needs=("trained",)),
    Case("main_no_workdir", "no --workdir", MAIN, ["--config=experiments/stdlib_lm_tiny.py"], ("--workdir",)),
    Case("evaluate_missing_checkpoint", "--checkpoint does not exist", EVAL,
         ["--checkpoint={T}/nowhere", "--suite=ppl", "--workdir={T}/ev_out"], ("{T}/nowhere",)),
    Case("preview_unknown_task", "--task names no task", PREVIEW, ["--task=nope"] + PREVIEW_SMALL, ("'nope'",)),
    # ---- more
    Case("main_corrupt_step", "resume: every file of the last orbax step truncated to 0 bytes", MAIN,
         [TINY, "--workdir={T}/w_corrupt"], ("{T}/w_corrupt/fot/checkpoints/1",), needs=("trained",)),
    Case("main_changed_lr", "resume with another optim.lr than the run's", MAIN,
         [TINY, "--config.optim.lr=0.5", "--workdir={T}/w_lr"], ("optim.lr",), needs=("trained",)),
    Case("main_unknown_sweep_run", "--sweep_run names no run of get_sweep()", MAIN,
         ["--config=experiments/analysis_184m_c4.py", "--sweep_run=nosuch", "--workdir={T}/w"],
         ("--sweep_run=nosuch",)),
    Case("main_init_from_bad_json", "train.init_from's fot_jax_model.json is truncated JSON", MAIN,
         ["--config=experiments/stdlib_lm_tiny.py", "--config.train.init_from={T}/ck_badjson", "--workdir={T}/w_init"],
         ("{T}/ck_badjson/fot_jax_model.json",)),
    Case("main_bad_schedule", "optim.schedule is neither 'constant' nor 'cosine'", MAIN,
         [TINY, "--config.optim.schedule=linear", "--workdir={T}/w_sched"], ("optim.schedule",)),
    Case("import_hf_truncated_safetensors", "model.safetensors cut in half", CONV,
         ["import_hf", "--hf_dir", "{T}/hf_trunc", "--out", "{T}/out"], ("{T}/hf_trunc/model.safetensors",)),
    Case("export_missing_checkpoint", "export_hf --checkpoint does not exist", CONV,
         ["export_hf", "--checkpoint", "{T}/nowhere", "--out", "{T}/out"], ("{T}/nowhere",)),
    Case("export_window_not_int", 'fot_jax_model.json has "window": "x"', CONV,
         ["export_hf", "--checkpoint", "{T}/ck_window", "--out", "{T}/out"],
         ("{T}/ck_window/fot_jax_model.json", "window")),
    Case("export_tokenizer_too_big", "--tokenizer has 302 tokens, the embedding 260 rows", CONV,
         ["export_hf", "--checkpoint", "{T}/trained/fot", "--out", "{T}/out", "--tokenizer", "{T}/tok/tokenizer.json"],
         ("{T}/tok/tokenizer.json",), needs=("trained",)),
    Case("verify_tampered_export", "an export whose final norm weight was changed by 0.5 (one element)", CONV,
         ["verify_export", "--checkpoint", "{T}/trained/fot", "--export", "{T}/f32_bad", "--text", "{T}/code.txt",
          "--tokens", "98", "--vocab", "byte"], ("{T}/f32_bad", "--max_logit_diff"), status=1, needs=("export",)),
    Case("study_unknown_inference", "a study method with inference 'kv'", STUDY_M,
         ["--config={T}/study.py", "--workdir={T}/out"], ("{T}/study.py", "'kv'")),
    Case("study_misspelt_key", "a study method with the key 'overides'", STUDY_M,
         ["--config={T}/study.py:misspelt", "--workdir={T}/out"], ("'overides'",)),
    Case("study_unknown_arm", "--config=FILE:ARG with an ARG get_config() does not know", STUDY_M,
         ["--config={T}/study.py:nosuch", "--workdir={T}/out"], ("{T}/study.py:nosuch",)),
    Case("study_missing_file", "the study file does not exist", STUDY_M,
         ["--config={T}/nowhere.py", "--workdir={T}/out"], ("{T}/nowhere.py",)),
    Case("preview_files_glob_nothing", "files: pattern matching no file", PREVIEW,
         ["--task=files:{T}/nothing/*.txt"] + PREVIEW_SMALL, ("{T}/nothing/*.txt",)),
    Case("preview_unknown_split", "--split=test of a files: task (splits: train, validation)", PREVIEW,
         ["--task=files:{T}/corpus", "--split=test"] + PREVIEW_SMALL, ("'test'",)),
    Case("preview_jsonl_all_broken", "jsonl: file whose every line is broken JSON", PREVIEW,
         ["--task=jsonl:{T}/broken.jsonl"] + PREVIEW_SMALL, ("{T}/broken.jsonl",)),
    Case("evaluate_unknown_suite", "--suite=nosuch", EVAL,
         ["--checkpoint={T}/trained/fot", "--suite=nosuch", "--workdir={T}/ev_out"], ("'nosuch'",), needs=("trained",)),
    Case("evaluate_bad_mem_layers", "--mem_layers=x,y", EVAL,
         ["--checkpoint={T}/trained/fot", "--suite=ppl", "--mem_layers=x,y", "--workdir={T}/ev_out"],
         ("--mem_layers",), needs=("trained",)),
    Case("evaluate_bad_model_overrides", "--model_overrides with a field ModelConfig lacks", EVAL,
         ["--checkpoint={T}/trained/fot", "--suite=ppl", '--model_overrides={"nope": 1}', "--workdir={T}/ev_out"],
         ("--model_overrides", "nope"), needs=("trained",)),
    Case("evaluate_no_checkpoint_flag", "no --checkpoint", EVAL, ["--suite=ppl", "--workdir={T}/ev_out"],
         ("--checkpoint",)),
    Case("evaluate_compare_empty", "compare on a workdir with no eval/*.json", EVAL,
         ["compare", "{T}/empty_run", "--workdir={T}/cmp_out"], ("{T}/empty_run",)),
    Case("evaluate_truncated_result_json", "compare on a workdir whose eval/ppl.json is truncated", EVAL,
         ["compare", "{T}/trunc_run", "--workdir={T}/cmp_out"], ("{T}/trunc_run/eval/ppl.json",)),
    Case("train_tokenizer_unknown_task", "--task names no task", TOKENIZER,
         ["--task=nope", "--output={T}/spm/m", "--vocab_size=300"], ("'nope'",)),
    # ---- fot_jax.ask and fot_jax.eval.lm_harness (each fails before lm-eval indexes or builds a task)
    Case("ask_missing_document", "--document does not exist", ASK,
         ["--checkpoint={T}/trained/fot", "--document={T}/missing.txt", QUESTION], ("--document {T}/missing.txt",),
         needs=("trained",)),
    Case("ask_empty_document", "--document holds only blank lines", ASK,
         ["--checkpoint={T}/trained/fot", "--document={T}/blank.txt", QUESTION], ("{T}/blank.txt", "empty"),
         needs=("trained",)),
    Case("ask_binary_document", "--document is a PDF (binary, NUL bytes)", ASK,
         ["--checkpoint={T}/trained/fot", "--document={T}/paper.pdf", QUESTION], ("{T}/paper.pdf", "binary"),
         needs=("trained",)),
    Case("ask_question_too_long", "a question of 105 bytes, the checkpoint's window 32 (byte vocabulary)", ASK,
         ["--checkpoint={T}/trained/fot", "--document={T}/code.txt", LONG_QUESTION],
         ("the question takes", "--window"), needs=("trained",)),
    Case("ask_missing_checkpoint", "--checkpoint does not exist", ASK,
         ["--checkpoint={T}/nowhere", "--document={T}/code.txt", QUESTION], ("{T}/nowhere",)),
    Case("lm_harness_unknown_model_arg", "--model_args with 'windw' (misspelt window)", HARNESS,
         ["--model", "fot_jax", "--model_args", "checkpoint={T}/trained/fot,windw=8"] + HARNESS_TASKS,
         ("windw", "unknown argument"), needs=("trained",)),
    Case("lm_harness_bad_window", "--model_args window=0", HARNESS,
         ["--model", "fot_jax", "--model_args", "checkpoint={T}/trained/fot,window=0"] + HARNESS_TASKS,
         ("window", ">= 1, got 0"), needs=("trained",)),
    Case("lm_harness_bad_mode", "--model_args mode=approx (modes: dense, topk)", HARNESS,
         ["--model", "fot_jax", "--model_args", "checkpoint={T}/trained/fot,mode=approx"] + HARNESS_TASKS,
         ("mode", "'approx'"), needs=("trained",)),
    Case("lm_harness_missing_checkpoint", "--model_args checkpoint= a path that does not exist", HARNESS,
         ["--model", "fot_jax", "--model_args", "checkpoint={T}/nowhere,window=32"] + HARNESS_TASKS,
         ("checkpoint", "{T}/nowhere")),
    Case("readout_missing_checkpoint", "--checkpoint does not exist", READOUT,
         ["--checkpoint={T}/nowhere", "--length=300"], ("{T}/nowhere",)),
    Case("readout_prompt_in_one_window", "--length 40 with --window 512: memory holds nothing", READOUT,
         ["--checkpoint={T}/trained/fot", "--length=40", "--mem_layers=0", "--vocab=byte"], ("one window",),
         needs=("trained",)),
    Case("readout_depth_out_of_range", "--depths 2 (depths lie in [0, 1])", READOUT,
         ["--checkpoint={T}/nowhere", "--length=300", "--depths=0.5,2"], ("--depths", "'0.5,2'")),
    Case("lm_harness_mem_layers_with_commas", "--model_args mem_layers=0,1 (commas separate model_args)", HARNESS,
         ["--model", "fot_jax", "--model_args", "checkpoint={T}/nowhere,mem_layers=0,1"] + HARNESS_TASKS,
         ("mem_layers", "':'")),
    Case("readout_no_memory_layers", "--mem_layers=none: a model without memory layers", READOUT,
         ["--checkpoint={T}/trained/fot", "--length=300", "--mem_layers=none", "--vocab=byte"],
         ("no memory layers", "--mem_layers"), needs=("trained",)),
    Case("main_memory_refresh_zero", "train.memory.refresh=0 (the long memory rewritten every 0 steps)", MAIN,
         ["--config=experiments/smollm2_retrieval.py:longmem", "--config.train.init_from=",
          "--config.train.memory.refresh=0", "--workdir={T}/w_memory"], ("train.memory.refresh", "positive")),
    Case("main_override_list_item", "--config.train.curriculum.phases.0.steps=2 (a list item: no override reaches it)",
         MAIN, ["--config=experiments/stdlib_lm_tiny.py", "--config.train.curriculum.phases.0.steps=2",
                "--workdir={T}/w_list"], ("phases.0.steps=2", "not list items")),
    # ---- issue 33: your corpus, checked before the first step
    Case("main_misspelt_field", "--config.train.stpes=3 (a field that does not exist)", MAIN,
         ["--config=experiments/stdlib_lm_tiny.py", "--config.train.stpes=3", "--workdir={T}/w_typo"],
         ("--config.train.stpes=3", "did you mean 'steps'")),
    Case("evaluate_misspelt_field", "--eval.ppl.n_dcs=3 (a suite field that does not exist)", EVAL,
         ["--checkpoint={T}/nowhere", "--eval.ppl.n_dcs=3", "--workdir={T}/ev_typo"],
         ("--eval.ppl.n_dcs=3", "did you mean 'n_docs'")),
    Case("main_unknown_corpus", "data.corpus names no task", MAIN,
         [TINY, "--config.data.corpus=nope", "--workdir={T}/w_corpus"], ("data.corpus='nope'", "unknown task")),
    Case("main_eval_docs_short", "the corpus's held-out documents are shorter than the evaluation needs", MAIN,
         [TINY, "--config.data.corpus=jsonl:{T}/short.jsonl", "--config.eval.memory_tokens=(0,512)",
          "--workdir={T}/w_short"], ("eval.n_docs=1", "jsonl:{T}/short.jsonl", "lower")),
    # ---- issue 33: launch
    Case("sweep_tpu_local_workdir", "launch.sweep --tpu with a local --workdir", SWEEP,
         ["--config=experiments/analysis_184m_c4.py", "--workdir={T}/sweep", "--tpu=fot", "--zone=us-central2-b",
          "--dry_run"], ("--workdir={T}/sweep", "gs://BUCKET/PATH")),
    Case("tpu_up_local_workdir", "launch.tpu up with a local --workdir after --", TPU,
         ["--name=fot", "--zone=us-central2-b", "--dry_run", "up", "--", "--config=experiments/longllama_3b.py",
          "--workdir=runs/l3b"], ("--workdir=runs/l3b", "gs://BUCKET/PATH")),
    Case("tpu_bad_install", "launch.tpu --install names no source", TPU,
         ["--name=fot", "--zone=us-central2-b", "--install=pypi", "--dry_run", "install"], ("--install=pypi",)),
]


# ---------------------------------------------------------------- the inputs

def _env():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
  env.pop("FOT_JAX_TRACEBACK", None)
  return env


def _run(cmd: List[str]) -> Tuple[Optional[int], str, str]:
  """(exit status, stdout, stderr); status None: killed after TIMEOUT_S (a hang)."""
  try:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    return p.returncode, p.stdout, p.stderr
  except subprocess.TimeoutExpired as e:
    def text(b):
      return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
    return None, text(e.stdout), text(e.stderr)


def _model_json(directory: str, **changes):
  """A checkpoint directory holding only fot_jax_model.json (its fields are read before any parameter)."""
  from fot_jax.model.config import get_size
  info = {"model": get_size("tiny").to_dict(), "window": 16, "tokenizer": None, "vocab": "byte"}
  for key, value in changes.items():
    (info["model"] if key in info["model"] else info)[key] = value
  os.makedirs(directory)
  with open(os.path.join(directory, "fot_jax_model.json"), "w") as f:
    json.dump(info, f)


def build_cheap(t: str) -> None:
  """Every input that takes no training run (a second or two: numpy, safetensors, tokenizers)."""
  import numpy as np
  from safetensors.numpy import save_file

  def write(rel, text):
    path = os.path.join(t, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
    return path

  os.makedirs(os.path.join(t, "empty"))
  write("notes.txt", "not a checkpoint\n")
  os.makedirs(os.path.join(t, "w_empty_ckpt", "fot", "checkpoints"))
  write("tiny_lm.py", TINY_LM)
  write("study.py", STUDY)
  write("code.txt", "def f(x):\n  return x + 1\n" * 8)
  write("blank.txt", "\n  \n\t\n")
  with open(os.path.join(t, "paper.pdf"), "wb") as f:
    f.write(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Length 8 >>\nstream\n\x00\x01\x02\x00\nendstream\n")
  _model_json(os.path.join(t, "ck_layers"), num_layers="two")
  _model_json(os.path.join(t, "ck_window"), window="x")
  _model_json(os.path.join(t, "ck_badjson"))
  path = os.path.join(t, "ck_badjson", "fot_jax_model.json")
  text = open(path).read()
  write(path, text[:len(text) // 2])
  hf = {"model_type": "llama", "vocab_size": 37, "hidden_size": "big", "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8}
  write("hf_big/config.json", json.dumps(hf))
  write("hf_trunc/config.json", json.dumps(dict(hf, hidden_size=32)))
  st = os.path.join(t, "hf_trunc", "model.safetensors")
  save_file({"model.norm.weight": np.ones(32, np.float32)}, st, metadata={"format": "pt"})
  data = open(st, "rb").read()
  with open(st, "wb") as f:
    f.write(data[:len(data) // 2])
  from tokenizers import Tokenizer
  from tokenizers.models import WordLevel
  vocab = {f"w{i}": i for i in range(300)}
  vocab.update({"<s>": 300, "</s>": 301})
  os.makedirs(os.path.join(t, "tok"))
  Tokenizer(WordLevel(vocab, unk_token="w0")).save(os.path.join(t, "tok", "tokenizer.json"))
  for n in ("a.txt", "b.txt"):
    write(f"corpus/{n}", f"the document {n}")
  write("broken.jsonl", "{broken\n{also broken\n")
  write("short.jsonl", "".join(json.dumps({"text": f"note {i}: a short line of text."}) + "\n" for i in range(400)))
  os.makedirs(os.path.join(t, "empty_run"))
  write("trunc_run/eval/ppl.json", '{"suite": "ppl", "name": "trunc_run", "perplexity": [1.5, ')


def build_trained(t: str) -> None:
  """A one-step fot_jax.main run on tiny_lm.py ($TMP/trained), copied for the resume cases."""
  rc, out, err = _run([sys.executable, "-m", "fot_jax.main", f"--config={t}/tiny_lm.py", f"--workdir={t}/trained"])
  if rc != 0 or not os.path.isdir(f"{t}/trained/fot/checkpoints/1"):
    raise RuntimeError(f"the one-step training run failed (exit {rc}): {err[-2000:]}")
  shutil.copytree(f"{t}/trained", f"{t}/w_lr")
  shutil.copytree(f"{t}/trained", f"{t}/w_corrupt")
  for d, _, files in os.walk(f"{t}/w_corrupt/fot/checkpoints/1"):
    for name in files:
      open(os.path.join(d, name), "wb").close()  # a crash or a full disk: every file empty


def build_export(t: str) -> None:
  """The trained checkpoint exported (float32), and a copy with one final-norm weight + 0.5."""
  from safetensors.numpy import load_file, save_file
  rc, out, err = _run([sys.executable, "-m", "fot_jax.convert", "export_hf", "--checkpoint", f"{t}/trained/fot",
                       "--out", f"{t}/f32"])
  if rc != 0:
    raise RuntimeError(f"export_hf of the trained checkpoint failed (exit {rc}): {err[-2000:]}")
  shutil.copytree(f"{t}/f32", f"{t}/f32_bad")
  path = f"{t}/f32_bad/model.safetensors"
  tensors = {k: v.copy() for k, v in load_file(path).items()}
  tensors["model.norm.weight"][3] += 0.5
  save_file(tensors, path, metadata={"format": "pt"})


class Inputs:
  """The slow inputs, each built once by whoever needs it first (others wait)."""
  BUILDERS = {"trained": ((), build_trained), "export": (("trained",), build_export)}

  def __init__(self, tmp: str):
    self.tmp, self.done, self.errors = tmp, {}, {}
    self.locks = {k: threading.Lock() for k in self.BUILDERS}

  def need(self, name: str) -> None:
    deps, fn = self.BUILDERS[name]
    for d in deps:
      self.need(d)
    with self.locks[name]:
      if name in self.errors:
        raise RuntimeError(self.errors[name])
      if name not in self.done:
        t0 = time.time()
        try:
          fn(self.tmp)
        except Exception as e:  # noqa: BLE001 - reported as the dependent cases' failure
          self.errors[name] = f"building input {name!r}: {e}"
          raise RuntimeError(self.errors[name]) from None
        self.done[name] = time.time() - t0
        print(f"  built {name} in {self.done[name]:.0f}s", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- running and judging

@dataclasses.dataclass
class Result:
  case: Case
  command: str  # as shown: python -m ..., the temporary directory as $TMP
  status: Optional[int]
  lines: List[str]  # stderr less noise
  stderr: str
  verdict: str
  why: str
  seconds: float


def _shown(cmd: List[str], tmp: str) -> str:
  import shlex
  words = ["python"] + [w.replace(tmp, "$TMP") for w in cmd[1:]]
  return " ".join(w if re.fullmatch(r"[\w@%+=:,./$*-]+", w) else shlex.quote(w) for w in words)


def judge(case: Case, status: Optional[int], stderr: str, tmp: str) -> Tuple[str, str]:
  lines = signal_lines(stderr)
  last = lines[-1] if lines else ""
  problems = []
  if status is None:
    problems.append(f"no exit within {TIMEOUT_S}s (killed: a hang?)")
  elif status != case.status:
    problems.append(f"exit status {status}, wanted {case.status}")
  if "Traceback" in stderr:
    problems.append("a traceback")
  if not last.startswith(f"{case.module}: "):
    problems.append(f"the last line does not start with '{case.module}: '")
  missing = [w.replace("{T}", tmp) for w in case.want if w.replace("{T}", tmp) not in last]
  if missing:
    problems.append("the last line lacks " + ", ".join(repr(m.replace(tmp, "$TMP")) for m in missing))
  return ("FAIL" if problems else "PASS"), "; ".join(problems)


def run_case(case: Case, tmp: str, inputs: Inputs) -> Result:
  cmd = [sys.executable, "-m", case.module] + [a.replace("{T}", tmp) for a in case.args]
  try:
    for n in case.needs:
      inputs.need(n)
  except RuntimeError as e:
    return Result(case, _shown(cmd, tmp), None, [], str(e), "FAIL", str(e), 0.0)
  t0 = time.time()
  status, _, stderr = _run(cmd)
  verdict, why = judge(case, status, stderr, tmp)
  return Result(case, _shown(cmd, tmp), status, signal_lines(stderr), stderr, verdict, why, time.time() - t0)


def _cell(text: str) -> str:
  """A Markdown table cell holding `text` as code (backticks and pipes inside survive)."""
  text = text.replace("|", "\\|")
  return f"`` {text} ``" if text else ""


def markdown(results: List[Result], tmp: str, header: str) -> str:
  rows = [header, "",
          "| case | what is wrong | command | exit | lines | the last stderr line (what the user sees) | verdict |",
          "|---|---|---|---|---|---|---|"]
  for r in results:
    last = r.lines[-1].replace(tmp, "$TMP") if r.lines else ""
    verdict = r.verdict + (f": {r.why.replace(tmp, '$TMP')}" if r.why else "")
    status = "killed" if r.status is None and r.seconds else r.status
    rows.append(f"| {r.case.name} | {r.case.what} | {_cell(r.command)} | {status} | {len(r.lines)} | "
                f"{_cell(last)} | {verdict} |")
  return "\n".join(rows) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None, help="write the table as Markdown to this file")
  p.add_argument("--only", default="", help="comma-separated case names (default: all)")
  p.add_argument("--jobs", type=int, default=2, help="subprocesses at a time")
  p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
  p.add_argument("--list", action="store_true", help="list the cases and exit")
  args = p.parse_args(argv)
  if args.list:
    for c in CASES:
      print(f"{c.name:34s} {c.what}")
    return 0
  cases = CASES
  if args.only:
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
      p.error(f"--only: unknown case(s) {unknown}; --list shows them")
    cases = [c for c in CASES if c.name in names]
  t_start = time.time()
  tmp = tempfile.mkdtemp(prefix="fot_bad_inputs_")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  try:
    build_cheap(tmp)
    inputs = Inputs(tmp)
    needed = []
    for c in cases:
      for n in c.needs:
        for d in Inputs.BUILDERS[n][0] + (n,):
          if d not in needed:
            needed.append(d)
    # The slow inputs first, beside the cheap cases; the cases that need them last.
    order = [c for c in cases if not c.needs] + [c for c in cases if c.needs]
    results: Dict[str, Result] = {}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
      builds = [pool.submit(inputs.need, n) for n in needed[-1:]]  # the last one needs the others
      futures = {pool.submit(run_case, c, tmp, inputs): c for c in order}
      for f, c in futures.items():
        r = f.result()
        results[c.name] = r
        print(f"  {r.verdict} {c.name} ({r.seconds:.0f}s)", file=sys.stderr, flush=True)
      for b in builds:
        b.exception()  # reported through the cases that needed it
    ordered = [results[c.name] for c in cases]
    seconds = time.time() - t_start
    n_pass = sum(r.verdict == "PASS" for r in ordered)
    command = "python tests/bad_inputs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"Measured {datetime.date.today().isoformat()} by `{command.strip()}`: "
              f"{n_pass} PASS, {len(ordered) - n_pass} FAIL of {len(ordered)} cases in {seconds:.0f}s "
              f"($TMP: a temporary directory).")
    table = markdown(ordered, tmp, header)
    print(table)
    multi = [r for r in ordered if len(r.lines) > 1]
    for r in multi + [r for r in ordered if r.verdict == "FAIL" and r not in multi]:
      print(f"--- {r.case.name}: {r.verdict} {r.why}; stderr less noise ({len(r.lines)} lines):")
      print("\n".join("    " + x.replace(tmp, "$TMP") for x in r.lines[-20:]))
    if args.out:
      with open(args.out, "w") as f:
        f.write(table)
    return 0 if n_pass == len(ordered) else 1
  finally:
    if args.keep:
      print(f"kept {tmp}", file=sys.stderr)
    else:
      shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
