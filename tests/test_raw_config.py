"""An experiment's ConfigDict is read in one place: `fot_jax.configs.resolve` (and the entry points
that hand it over). Everything below takes the typed `Experiment` or the part it needs.

Two checks. Statically, every function of fot_jax/ and data_pipelines/ with a `config` parameter
(the project's name for a raw ConfigDict) or a ConfigDict annotation is listed in RAW_CONFIG_READERS
with its reason, like the lazy-import list of test_import_graph.py. At run time,
`record_config_reads` (used by the end-to-end runs of test_main.py and test_data_train.py) records
every project function that reads a field of a ConfigDict while a whole experiment runs, whatever
its parameters are called, unless a listed function (resolve) is up its stack.
"""
import ast
import contextlib
import os
import sys
from typing import Dict, Set, Tuple

import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fot_jax", "data_pipelines")

# (file under the repository, function qualname) -> why it may take or read the raw ConfigDict.
RAW_CONFIG_READERS: Dict[Tuple[str, str], str] = {
    ("fot_jax/main.py", "_main"): "the entry point: resolves --config (and a sweep run's overrides) once",
    ("fot_jax/main.py", "_plan_devices"): "entry point: --mode=plan must count fake devices before JAX starts",
    ("fot_jax/main.py", "_experiment_config"): "entry point: loads --config and reports a file that does not load",
    ("fot_jax/configs.py", "resolve"): "the one reader: ConfigDict -> Experiment",
    ("fot_jax/configs.py", "_resolve_dictionary"): "resolve's part for the dictionary-lookup experiment",
    ("fot_jax/configs.py", "_resolve_lm"): "resolve's part for the LM experiments",
    ("fot_jax/configs.py", "_model_config"): "resolve's reader of c.model",
    ("fot_jax/configs.py", "_train_settings"): "resolve's reader of an arm's training section and c.optim",
    ("fot_jax/configs.py", "_copy_warmup"): "resolve's reader of c.warmup",
    ("fot_jax/configs.py", "_dictionary_task"): "resolve's reader of the dictionary task (c.data)",
    ("fot_jax/configs.py", "_plain"): "resolve's ConfigDict -> dict",
    ("fot_jax/configs.py", "_lm_run_fields"): "resolve's record of what defines an LM arm's training (fingerprint)",
    ("fot_jax/configs.py", "_dictionary_run_fields"): "resolve's record of what defines a dictionary arm's training",
    ("fot_jax/configs.py", "_check_known"): "resolve's check that every section and field of the file is one it reads",
    ("fot_jax/configs.py", "apply_overrides"): "a sweep run's overrides are applied to the ConfigDict before it is resolved",
    ("fot_jax/curriculum.py", "Schedule.__init__"):
        "the curriculum's own reader: takes the plain dict resolve keeps (Experiment.curriculum)",
    ("fot_jax/convert/torch_reference.py", "_inv_freq"): "a transformers model config, not an experiment's",
    ("fot_jax/study/settings.py", "StudySettings.from_dict"): "the study's one reader: its file -> typed settings",
    ("fot_jax/study/__main__.py", "main"): "the study's command line: loads and checks the study file",
    ("fot_jax/evaluate.py", "main"): "the evaluation command line: reads its suite flags into typed settings",
    ("fot_jax/eval/settings.py", "SuiteSettings.from_dict"): "the suite's one reader: its ConfigDict -> SuiteSettings",
}


def _functions_taking_a_config():
  """(file, qualname) of every function in the packages with a `config` parameter or a ConfigDict annotation."""
  found = set()
  for pkg in PACKAGES:
    for root, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if not f.endswith(".py"):
          continue
        path = os.path.join(root, f)
        rel = os.path.relpath(path, ROOT)

        def visit(node, prefix=""):
          for n in ast.iter_child_nodes(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
              args = n.args.posonlyargs + n.args.args + n.args.kwonlyargs
              if any(a.arg == "config" or (a.annotation is not None and "ConfigDict" in ast.unparse(a.annotation))
                     for a in args):
                found.add((rel, prefix + n.name))
              visit(n, prefix + n.name + ".")
            elif isinstance(n, ast.ClassDef):
              visit(n, prefix + n.name + ".")
        with open(path) as fh:
          visit(ast.parse(fh.read()))
  return found


def test_only_the_listed_functions_take_the_raw_config():
  found = _functions_taking_a_config()
  unlisted = sorted(found - set(RAW_CONFIG_READERS))
  assert not unlisted, f"functions taking a raw ConfigDict outside the allow-list: {unlisted}"
  for (rel, _), reason in RAW_CONFIG_READERS.items():
    assert os.path.isfile(os.path.join(ROOT, rel)) and reason, rel


@contextlib.contextmanager
def record_config_reads():
  """Every (file, function) of the project that reads a ConfigDict field inside the block with no
  listed reader (configs.resolve, an entry point) up its stack: the set the block fills. Reads made
  for resolve (fot_jax/settings.py's section readers, a comprehension inside resolve) are its own."""
  readers: Set[Tuple[str, str]] = set()
  cls = ml_collections.ConfigDict
  originals = {name: getattr(cls, name) for name in ("__getattr__", "__getitem__", "get", "to_dict")}

  def wrap(name, fn):
    def reading(self, *args, **kwargs):
      reader, frame = None, sys._getframe(1)
      while frame is not None:  # the innermost project frame reads; a listed one up the stack allows it
        where = (os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_code.co_qualname)
        if where in RAW_CONFIG_READERS:
          reader = None
          break
        if reader is None and where[0].split(os.sep)[0] in PACKAGES:
          reader = where
        frame = frame.f_back
      if reader is not None:
        readers.add(reader)
      return fn(self, *args, **kwargs)
    return reading
  for name, fn in originals.items():
    setattr(cls, name, wrap(name, fn))
  try:
    yield readers
  finally:
    for name, fn in originals.items():
      setattr(cls, name, fn)


def assert_only_listed_readers(readers):
  unlisted = sorted(r for r in readers if r not in RAW_CONFIG_READERS)
  assert not unlisted, f"read the raw ConfigDict outside configs.resolve and the entry points: {unlisted}"


def test_the_recorder_catches_a_reader_below_resolve():
  """The run-time check can fail: a project function outside the list that reads a ConfigDict (here
  the curriculum's dict helper, which runs only when handed a ConfigDict) is caught."""
  import pytest
  from fot_jax import curriculum
  with record_config_reads() as readers:
    curriculum._as_dict(ml_collections.ConfigDict({"kind": "constant"}))
  assert ("fot_jax/curriculum.py", "_as_dict") in readers
  with pytest.raises(AssertionError, match="curriculum.py"):
    assert_only_listed_readers(readers)
  assert ml_collections.ConfigDict.get is _ORIGINAL_GET  # the class is restored after the block


_ORIGINAL_GET = ml_collections.ConfigDict.get
