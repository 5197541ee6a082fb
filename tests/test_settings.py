"""fot_jax/settings.py: each typed section is read by one validator, whose errors name the field, and
the objects it returns drive the code below (here: the optimiser make_optimizer builds)."""
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from experiments import dictionary_lookup
from fot_jax import configs
from fot_jax.settings import OptimSettings, TrainSettings
from fot_jax.study import settings as study_settings
from fot_jax.train import make_optimizer


@pytest.mark.parametrize("fields,message", [
    ({"lr": 0.0}, r"optim\.lr: must be positive"),
    ({"lr": 1e-3, "schedule": "linear"}, r"optim\.schedule: must be 'constant' or 'cosine'"),
    ({"lr": 1e-3, "warmup_steps": -1}, r"optim\.warmup_steps: must not be negative"),
    ({"lr": 1e-3, "warmup_steps": 2.5}, r"optim\.warmup_steps: must be an integer"),
    ({"lr": 1e-3, "b2": 1.0}, r"optim\.b2: must be in \[0, 1\)"),
    ({"lr": "fast"}, r"optim\.lr: must be a number"),
    ({"lr": 1e-3, "momentum": 0.9}, r"optim: unknown field\(s\) \['momentum'\]"),
    ({"schedule": "constant"}, r"optim\.lr: required"),
])
def test_optim_settings_name_the_bad_field(fields, message):
  with pytest.raises(ValueError, match=message):
    OptimSettings.from_dict(fields)


@pytest.mark.parametrize("fields,message", [
    ({"loss_on": "first"}, r"fot\.loss_on: must be one of \('all', 'last'\)"),
    ({"crossbatch_scope": "host"}, r"fot\.crossbatch_scope: must be one of \('batch', 'device'\)"),
    ({"accum_steps": 0}, r"fot\.accum_steps: must be at least 1"),
    ({"steps": -1}, r"fot\.steps: must be at least 0"),
    ({"shuffle": True}, r"fot: unknown field\(s\) \['shuffle'\]"),
])
def test_train_settings_name_the_bad_field(fields, message):
  with pytest.raises(ValueError, match=message):
    TrainSettings.from_dict(dict({"steps": 3, "optim": {"lr": 1e-3}}, **fields), "fot")


def test_train_settings_of_an_experiment_are_read_once_from_its_sections():
  """configs.resolve: the dictionary arms' training settings, typed; it fails on a bad one naming the
  section it sits in."""
  config = dictionary_lookup.get_config()
  exp = configs.resolve(config)
  fot, base = exp.train, exp.dictionary.baseline_train
  assert (fot.steps, fot.seed, fot.loss_on, fot.optim.lr) == (config.fot.steps, 0, "last", config.optim.lr)
  assert (base.steps, base.seed, base.loss_on) == (0, 0, config.baseline.get("loss_on", "all"))
  config.baseline.crossbatch_scope = "host"
  with pytest.raises(ValueError, match=r"^baseline\.crossbatch_scope"):
    configs.resolve(config)


def test_every_reader_of_optim_settings_is_the_one_validator():
  """An experiment's c.optim, a study's finetune.optim and make_optimizer refuse the same bad value
  with the same words, each naming where it sits."""
  config = dictionary_lookup.get_config()
  config.optim.b1 = 1.5
  with pytest.raises(ValueError, match=r"^optim\.b1: must be in \[0, 1\)"):
    configs.resolve(config)
  study = ml_collections.ConfigDict({"finetune": {"steps": 2, "length": 64, "slots": 2, "task": "stdlib",
                                             "optim": {"lr": 1e-3, "b1": 1.5}}})
  with pytest.raises(ValueError, match=r"^study method 'm': finetune\.optim\.b1: must be in \[0, 1\)"):
    study_settings.MethodSpec.from_dict({"name": "m", "finetune": True}, study.finetune)
  with pytest.raises(ValueError, match=r"^optim\.b1: must be in \[0, 1\)"):
    make_optimizer({"lr": 1e-3, "b1": 1.5})


def test_make_optimizer_reads_the_settings_it_is_given():
  """A dict and its OptimSettings build the same optimiser: the same updates, step by step, for
  AdamW with warm-up, cosine decay, weight decay and clipping (against a NumPy AdamW)."""
  fields = {"lr": 0.1, "schedule": "cosine", "warmup_steps": 2, "total_steps": 6, "final_lr_fraction": 0.1,
            "weight_decay": 0.01, "clip_norm": 0.5, "b1": 0.8, "b2": 0.9}
  s = OptimSettings.from_dict(fields)
  params = {"w": jnp.asarray([1.0, -2.0, 3.0])}
  grads = [{"w": jnp.asarray(g)} for g in ([0.3, -0.4, 1.2], [0.1, 0.2, -0.3], [-0.5, 0.5, 0.5])]
  got = []
  for opt in (make_optimizer(fields), make_optimizer(s)):
    state, p, out = opt.init(params), params, []
    for g in grads:
      upd, state = opt.update(g, state, p)
      p = {"w": p["w"] + upd["w"]}
      out.append(np.asarray(p["w"]))
    got.append(out)
  np.testing.assert_array_equal(np.stack(got[0]), np.stack(got[1]))
  # NumPy AdamW: clip by global norm, bias-corrected moments, decoupled weight decay, the schedule's lr
  w, m, v = np.array([1.0, -2.0, 3.0]), np.zeros(3), np.zeros(3)
  for t, g in enumerate(grads, start=1):
    g = np.asarray(g["w"], np.float64)
    g = g * min(1.0, 0.5 / np.linalg.norm(g))
    m, v = 0.8 * m + 0.2 * g, 0.9 * v + 0.1 * g * g
    step = t - 1  # optax evaluates the schedule at the count before the update
    lr = 0.1 * step / 2 if step < 2 else 0.01 + 0.5 * (0.1 - 0.01) * (1 + np.cos(np.pi * (step - 2) / 4))
    w = w - lr * ((m / (1 - 0.8 ** t)) / (np.sqrt(v / (1 - 0.9 ** t)) + 1e-8) + 0.01 * w)
    np.testing.assert_allclose(got[0][t - 1], w, rtol=1e-5, atol=1e-6)


def test_fingerprints_recorded_before_the_typed_settings_still_match():
  """Older code recorded the train and optim dicts its caller gave (fields left out, init_from None);
  the typed settings record every field. Defaults the old record lacks and unset values that differ
  only in kind change nothing; a value that differs from the recorded one is still refused."""
  from fot_jax.curriculum import Schedule
  from fot_jax.model.config import get_size
  from fot_jax.train import fingerprint_differences, run_fingerprint
  cfg, sched = get_size("tiny"), Schedule({"kind": "constant", "spec": {"d": 2, "w": 1}})
  old_tc = {"steps": 10, "seed": 0, "loss_on": "all", "log_every": 5, "checkpoint_every": 0, "init_from": None,
            "trainable": [], "optim": {"lr": 1e-3, "schedule": "cosine", "total_steps": 10, "b1": 0.8}}
  old = run_fingerprint(cfg, old_tc, sched)
  old["train"] = {k: v for k, v in old_tc.items() if k != "optim"}  # as older code wrote it
  old["optim"] = dict(old_tc["optim"])
  same = dict(old_tc, init_from="", trainable=None)
  assert fingerprint_differences(old, run_fingerprint(cfg, same, sched)) == []
  changed = dict(old_tc, optim={"lr": 1e-3, "schedule": "cosine", "total_steps": 10}, accum_steps=2)
  diffs = {f for f, _, _ in fingerprint_differences(old, run_fingerprint(cfg, changed, sched))}
  assert diffs == {"optim.b1", "train.accum_steps"}  # b1 back to its default 0.9: a change all the same


@pytest.mark.parametrize("field,value,message", [
    ("mode", "approx", r"eval\.mode: must be 'dense' or 'topk'"),
    ("doc_mode", "multi_doc", r"eval\.doc_mode: only 'single_doc'"),
    ("memory_tokens", (0, -8), r"eval\.memory_tokens: must be >= 0"),
    ("score_tokens", 0, r"eval\.score_tokens: must be positive"),
    ("topk", 0, r"eval\.topk: must be positive"),
])
def test_an_lm_experiments_eval_section_is_read_once(field, value, message):
  from experiments import stdlib_lm_tiny
  config = stdlib_lm_tiny.get_config()
  ev = configs.resolve(config, check_data=False).lm.eval
  assert ev.memory_tokens == tuple(config.eval.memory_tokens) and ev.score_tokens == config.eval.score_tokens
  config.eval[field] = value
  with pytest.raises(ValueError, match=message):
    configs.resolve(config, check_data=False)


@pytest.mark.parametrize("field,value,message", [
    ("slots", 0, r"data\.slots: must be positive"),
    ("max_doc_len", -1, r"data\.max_doc_len: must be >= 0"),
    ("task", 3, r"data\.task: must be a string"),
])
def test_an_lm_experiments_data_section_is_read_once(field, value, message):
  from experiments import stdlib_lm_tiny
  config = stdlib_lm_tiny.get_config()
  exp = configs.resolve(config, check_data=False)
  d = exp.lm.data
  assert (d.corpus, d.slots, d.windows_per_slot, d.window) == (config.data.corpus, config.data.slots,
                                                               config.data.windows_per_slot, config.data.window)
  assert d.task == d.eval_task == d.corpus  # the file names its text once: every view reads the corpus
  assert exp.train_shape()[:2] == (d.slots * d.windows_per_slot, d.window)
  for fields, error in (({field: value}, message), ({"windows": 2}, r"data: unknown field\(s\) \['windows'\]")):
    bad = stdlib_lm_tiny.get_config()
    bad.data = ml_collections.ConfigDict(dict(config.data.to_dict(), **fields))
    with pytest.raises(ValueError, match=error):
      configs.resolve(bad, check_data=False)


def test_the_dictionary_experiments_sections_are_read_once():
  """The demo's arms and evaluation, typed: the values the runner uses, and errors naming the field."""
  config = dictionary_lookup.get_config()
  exp = configs.resolve(config)
  fot, base = exp.dictionary.arms["fot"], exp.dictionary.arms["baseline"]
  assert (fot.window, fot.slots, fot.disjoint_keys) == (config.fot.window, config.fot.slots, True)
  assert (base.window, base.enabled, base.disjoint_keys) == (config.baseline.window, True, False)
  ev = exp.dictionary.eval
  assert ev.memory_tokens == tuple(config.eval.memory_tokens) and ev.rd_ds == tuple(config.eval.rd_ds)
  assert exp.train_shape()[:2] == (fot.slots * 2, fot.window)  # packs of 2 windows of 32
  for section, field, value, message in (("fot", "slots", 0, r"fot\.slots: must be positive"),
                                         ("eval", "chunk", 0, r"eval\.chunk: must be positive"),
                                         ("eval", "mode", "ivf", r"eval\.mode: must be 'dense' or 'topk'")):
    bad = dictionary_lookup.get_config()
    bad[section][field] = value
    with pytest.raises(ValueError, match=message):
      configs.resolve(bad)


def test_the_copy_warmup_is_read_once_for_either_experiment():
  """c.warmup, typed: the LM run's span / slots / ids, the dictionary's ids; off without a section."""
  from experiments import stdlib_lm_tiny
  lm = stdlib_lm_tiny.get_config()
  exp = configs.resolve(lm, check_data=False)
  w = exp.warmup
  assert exp.lm.feeds[w.task] is w  # the curriculum's copy phases read the warm-up
  assert (w.enabled, w.task, w.span, w.slots, w.symbol_offset, w.distinct) == (
      True, lm.warmup.task, lm.warmup.span, lm.warmup.slots, lm.warmup.symbol_offset, True)
  task = w.copy_task("baseline")
  assert (task.span, task.chunks, task.num_symbols) == (w.span, lm.warmup.baseline_chunks, w.num_symbols)
  del lm.warmup
  assert not configs.resolve(lm, check_data=False).warmup.enabled
  dl = dictionary_lookup.get_config()
  assert configs.resolve(dl).warmup.num_symbols == dl.warmup.num_symbols
  for config, field, value, message in ((stdlib_lm_tiny.get_config(), "slots", 0, r"warmup\.slots: required"),
                                        (stdlib_lm_tiny.get_config(), "baseline_chunks", 0,
                                         r"warmup\.baseline_chunks: must be positive"),
                                        (dictionary_lookup.get_config(), "spans", 2, r"warmup: unknown field")):
    config.warmup[field] = value
    with pytest.raises(ValueError, match=message):
      configs.resolve(config, check_data=False)
  off = stdlib_lm_tiny.get_config()
  off.warmup.enabled, off.warmup.slots = False, 0  # a switched-off warm-up needs no shape
  assert not configs.resolve(off, check_data=False).warmup.enabled


def test_the_baselines_section_is_read_once():
  """c.baselines, typed: which arms each seed trains, and errors naming the field."""
  from experiments import baselines_stdlib
  config = baselines_stdlib.get_config()
  b = configs.resolve(config, check_data=False).baselines
  assert b.arms_of_seed(b.seeds[0]) == tuple(config.baselines.arms)
  config.baselines.extra_seed_arms = ("fot", "plain", "hybrid")  # hybrid: not in this run
  config.baselines.arms = ("fot", "memorizing", "plain")
  assert configs.resolve(config, check_data=False).baselines.arms_of_seed(1) == ("fot", "plain")
  for field, value, message in (("suites", ("rd", "ppl"), r"baselines\.suites: any of \('rd', 'passkey'\)"),
                                ("hybrid_steps", 0, r"baselines\.hybrid_steps: must be positive"),
                                ("topk", -1, r"baselines\.topk: must be >= 0"),
                                ("seeds", (), r"baselines\.seeds: at least one seed")):
    bad = baselines_stdlib.get_test_config()
    bad.baselines[field] = value
    with pytest.raises(ValueError, match=message):
      configs.resolve(bad, check_data=False)


def test_a_misspelt_field_in_an_experiment_file_fails_naming_it():
  """resolve refuses what no reader would read: a misspelt field of a section it reads whole, or an
  unknown section (the command line's parser catches only misspelt overrides)."""
  from experiments import stdlib_lm_tiny
  for make, section, field, message in (
      (stdlib_lm_tiny.get_config, "train", "stpes", r"^train: unknown field\(s\) \['stpes'\]"),
      (dictionary_lookup.get_config, "baseline", "windw", r"^baseline: unknown field\(s\) \['windw'\]"),
      (dictionary_lookup.get_config, "fot", "stpes", r"^fot: unknown field\(s\) \['stpes'\]"),
      (dictionary_lookup.get_config, "model", "sise", r"^model: unknown field\(s\) \['sise'\]")):
    config = make()
    config[section][field] = 3
    with pytest.raises(ValueError, match=message):
      configs.resolve(config, check_data=False)
  config = dictionary_lookup.get_config()
  config.evall = ml_collections.ConfigDict({"n_docs": 2})
  with pytest.raises(ValueError, match=r"^unknown section\(s\) \['evall'\] for experiment 'dictionary_lookup'"):
    configs.resolve(config)


def test_curriculum_errors_name_their_path_in_the_experiment_file():
  """A bad phase or crossbatch spec is named where the file holds it: `train.curriculum...` in an LM
  experiment, `fot.curriculum...` in the dictionary one (the Schedule alone says `curriculum...`)."""
  from experiments import stdlib_lm_tiny
  config = stdlib_lm_tiny.get_config()
  config.train.curriculum.phases[0]["stpes"] = 3
  with pytest.raises(ValueError, match=r"^train\.curriculum\.phases\[0\]: unknown field\(s\) \['stpes'\]"):
    configs.resolve(config, check_data=False)
  config = dictionary_lookup.get_config()
  config.fot.curriculum.phases[-1]["spec"] = {"d": 10 ** 6, "w": 1}
  with pytest.raises(ValueError, match=r"^fot\.curriculum, spec \{'d': 1000000, 'w': 1\}: crossbatch\.d"):
    configs.resolve(config, check_data=False)
