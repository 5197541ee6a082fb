"""Trainer: stop-and-resume equals uninterrupted training; loss masking; accumulation."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax import crossbatch
from fot_jax.curriculum import Schedule
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel, weights_in_compute_dtype
from fot_jax.train import answer_sums, lm_loss_sums, make_optimizer, make_train_step, train, TrainState

TASK = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=8, n_queries=8)
CFG = get_size("tiny", vocab_size=TASK.vocab_size, mem_layers=(1,))


def _train_cfg(steps, every=0):
  return {"steps": steps, "seed": 0, "loss_on": "last", "log_every": 1, "checkpoint_every": every,
          "optim": {"lr": 1e-2, "warmup_steps": 2}}


def _metric_schedule():
  # Threshold 0 switches after the first step, so the resumed run must restore the switch.
  return Schedule({"kind": "metric", "before": {"d": 1, "w": 1}, "after": {"d": 4, "w": 1},
                   "metric": "accuracy", "threshold": 0.0, "window": 1})


def test_stop_and_resume_equals_uninterrupted(tmp_path):
  batches = DictionaryBatches(TASK, slots=4, window=TASK.doc_len // 2, seed=0)
  full = train(CFG, _train_cfg(6), _metric_schedule(), batches, str(tmp_path / "full"))
  part_dir = str(tmp_path / "part")
  train(CFG, _train_cfg(3, every=3), _metric_schedule(), batches, part_dir)  # "stopped" at 3
  resumed_schedule = _metric_schedule()
  resumed = train(CFG, _train_cfg(6, every=3), resumed_schedule, batches, part_dir)
  assert resumed_schedule.switched_at == 1
  assert [h["d"] for h in resumed["history"]] == [4.0, 4.0, 4.0]
  flat_a = jax.tree_util.tree_leaves(full["params"])
  flat_b = jax.tree_util.tree_leaves(resumed["params"])
  for a, b in zip(flat_a, flat_b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [h["loss"] for h in full["history"][3:]] == [h["loss"] for h in resumed["history"]]


def test_metrics_and_checkpoints_are_written(tmp_path):
  batches = DictionaryBatches(TASK, slots=2, window=TASK.doc_len // 2, seed=0)
  train(CFG, _train_cfg(2), Schedule({"kind": "constant", "spec": {"d": 2, "w": 1}}), batches, str(tmp_path))
  lines = (tmp_path / "metrics.jsonl").read_text().strip().splitlines()
  assert len(lines) == 2 and '"rd"' in lines[0] and '"tokens_per_second"' in lines[0]
  assert (tmp_path / "checkpoints" / "2").exists()


@pytest.mark.optimized_xla
def test_loss_sums_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 5))
  mask = rng.random((2, 5)) < 0.6
  loss, correct, count = lm_loss_sums(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), (nll * mask).sum(), rtol=1e-5)
  assert float(correct) == ((logits.argmax(-1) == targets) & mask).sum()
  assert float(count) == mask.sum()


def test_answer_sums_count_whole_answers_like_a_loop():
  rng = np.random.default_rng(1)
  targets = rng.integers(0, 5, (4, 19))
  pred = np.where(rng.random(targets.shape) < 0.8, targets, rng.integers(0, 5, targets.shape))
  mask = rng.random(targets.shape) < 0.5
  right, answers = answer_sums(jnp.asarray(np.eye(5)[pred]), jnp.asarray(targets), jnp.asarray(mask))
  want_right = want = 0
  for row, p, t in zip(mask, pred, targets):  # runs of masked tokens, one answer each
    t0 = 0
    while t0 < len(row):
      if not row[t0]:
        t0 += 1
        continue
      t1 = t0
      while t1 < len(row) and row[t1]:
        t1 += 1
      want, want_right = want + 1, want_right + bool((p[t0:t1] == t[t0:t1]).all())
      t0 = t1
  assert (float(right), float(answers)) == (want_right, want) and 0 < want_right < want


@pytest.mark.optimized_xla
def test_accumulation_matches_one_batch_without_crossbatch():
  """Without crossbatch, 2 accumulation groups give the same update as one batch."""
  params = init_params(CFG, 0)
  opt = optax.sgd(1.0)  # the update is the gradient itself: compares gradients directly
  batch = DictionaryBatches(TASK, slots=4, window=TASK.doc_len // 2, seed=0)(0)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  out = []
  for accum in (1, 2):
    plan = crossbatch.empty_plan(8 // accum)
    src = np.broadcast_to(plan.sources, (accum,) + plan.sources.shape).copy()
    pos = np.broadcast_to(plan.positive, (accum,) + plan.positive.shape).copy()
    p = jax.tree_util.tree_map(jnp.array, params)
    state = TrainState(jnp.zeros((), jnp.int32), p, opt.init(p))
    state, metrics = make_train_step(CFG, opt, accum)(state, batch, src, pos)
    out.append((state.params, float(metrics["loss"])))
  assert out[0][1] == pytest.approx(out[1][1], rel=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(out[0][0]), jax.tree_util.tree_leaves(out[1][0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_accumulation_that_splits_a_pack_is_rejected(tmp_path):
  batches = DictionaryBatches(TASK, slots=3, window=TASK.doc_len // 2, seed=0)
  cfg = dict(_train_cfg(1), accum_steps=2)
  with pytest.raises(ValueError, match="accum_steps"):
    train(CFG, cfg, Schedule({"kind": "constant", "spec": {"d": 1, "w": 1}}), batches, str(tmp_path))


def test_init_from_refuses_other_positions(tmp_path):
  """RoPE and the norm's epsilon leave no trace in parameter shapes: init_from compares
  rope_theta, rope_scaling and rms_norm_eps."""
  import dataclasses
  from fot_jax import checkpoint
  from fot_jax.train import params_from_checkpoint
  cfg = dataclasses.replace(CFG, rope_scaling={"rope_type": "linear", "factor": 2.0})
  checkpoint.save(str(tmp_path / "ck"), init_params(cfg, 0), cfg, window=16)
  params = params_from_checkpoint(str(tmp_path / "ck"), cfg)
  assert params["embed_tokens"]["embedding"].shape[0] == TASK.vocab_size
  with pytest.raises(ValueError, match="rope_scaling"):
    params_from_checkpoint(str(tmp_path / "ck"), CFG)
  with pytest.raises(ValueError, match="rope_theta=10000.0"):
    params_from_checkpoint(str(tmp_path / "ck"), dataclasses.replace(cfg, rope_theta=500.0))
  with pytest.raises(ValueError, match="rms_norm_eps=1e-06"):
    params_from_checkpoint(str(tmp_path / "ck"), dataclasses.replace(cfg, rms_norm_eps=1e-5))


def test_bf16_step_keeps_float32_parameters_and_optimizer_state():
  """bf16 compute: the step's parameters, AdamW moments and gradient norm stay float32
  (traced with eval_shape: nothing is compiled)."""
  import dataclasses
  cfg = dataclasses.replace(CFG, dtype="bfloat16")
  opt = make_optimizer({"lr": 1e-3, "weight_decay": 0.1, "clip_norm": 1.0})
  params = jax.eval_shape(lambda: init_params(cfg, 0))
  state = jax.eval_shape(lambda p: TrainState(jnp.zeros((), jnp.int32), p, opt.init(p)), params)
  batch = {"inputs": jax.ShapeDtypeStruct((4, 8), jnp.int32), "targets": jax.ShapeDtypeStruct((4, 8), jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct((4, 8), jnp.bool_)}
  src, pos = (np.asarray(a)[None] for a in crossbatch.analysis_plan(4, 2, 1).as_tuple(grouped=False))
  new_state, metrics = jax.eval_shape(make_train_step(cfg, opt), state, batch, src, pos)
  floats = {str(x.dtype) for x in jax.tree_util.tree_leaves((new_state.params, new_state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)}
  assert floats == {"float32"}
  assert metrics["grad_norm"].dtype == jnp.float32


def test_weights_cast_to_compute_dtype_before_use_change_nothing():
  """The train step casts the decoder's kernels to bf16 on their shards (what FSDP gathers);
  the layers cast them to bf16 anyway, so the loss and gradients are those of the float32
  parameters. The embedding, lm_head and norms stay float32."""
  import dataclasses
  from flax import traverse_util
  cfg = dataclasses.replace(CFG, dtype="bfloat16")
  params = init_params(cfg, 0)
  cast = traverse_util.flatten_dict(weights_in_compute_dtype(params, "bfloat16"), sep="/")
  kinds = {k: str(v.dtype) for k, v in cast.items()}
  assert kinds["layers_0/mlp/up_proj/kernel"] == "bfloat16"
  assert kinds["layers_0/self_attn/q_proj/kernel"] == "bfloat16"
  assert {v for k, v in kinds.items() if not k.endswith("/kernel") or k.startswith("lm_head")} == {"float32"}
  assert weights_in_compute_dtype(params, "float32") is params
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)

  def loss(p, cast):
    p = weights_in_compute_dtype(p, cfg.dtype) if cast else p
    return jnp.sum(LlamaModel(cfg).apply({"params": p}, tokens)[0][..., 0])

  for a, b in zip(jax.tree_util.tree_leaves(jax.value_and_grad(loss)(params, True)),
                  jax.tree_util.tree_leaves(jax.value_and_grad(loss)(params, False))):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)



# trainable-subset tests: 2 layers, the second a memory layer (the fewest ops that compile)
CFG2 = get_size("tiny", vocab_size=TASK.vocab_size, num_layers=2, mem_layers=(1,))


@pytest.fixture(scope="module")
def init2():
  return init_params(CFG2, 0)


def _flat(tree):
  from flax import traverse_util
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def test_trainable_subset_gets_the_full_models_gradient_and_the_rest_none(init2):
  """train.trainable: the step differentiates only the selected leaves; with SGD(1) their update is
  the gradient, which must equal the one the all-parameter step computes; the rest stay put."""
  from fot_jax.train import resolve_trainable
  trainable = resolve_trainable(["memory_attention", "norm/weight"], CFG2)
  assert trainable.patterns == ("layers_(1)/self_attn/.*", "norm/weight")
  params = init2
  opt = optax.sgd(1.0)
  batch = {k: jnp.asarray(v) for k, v in DictionaryBatches(TASK, slots=4, window=TASK.doc_len // 2, seed=0)(0).items()}
  src, pos = (np.asarray(a)[None] for a in crossbatch.analysis_plan(8, 2, 1).as_tuple(grouped=False))
  out = {}
  for name, t in (("all", None), ("subset", trainable)):
    p = jax.tree_util.tree_map(jnp.array, params)
    state = TrainState(jnp.zeros((), jnp.int32), p, opt.init(p if t is None else t.select(p)))
    out[name] = _flat(make_train_step(CFG2, opt, trainable=t)(state, batch, src, pos)[0].params)
  before = _flat(params)
  picked = [k for k in before if trainable.matches(k)]
  assert sorted(picked) == ["layers_1/self_attn/k_proj/kernel", "layers_1/self_attn/o_proj/kernel",
                            "layers_1/self_attn/q_proj/kernel", "layers_1/self_attn/v_proj/kernel", "norm/weight"]
  for k in before:
    if k in picked:
      assert not np.array_equal(out["subset"][k], before[k]), k
      np.testing.assert_allclose(out["subset"][k], out["all"][k], rtol=1e-5, atol=1e-7, err_msg=k)
    else:
      np.testing.assert_array_equal(out["subset"][k], before[k], err_msg=k)


def test_trainable_frozen_bit_identical_no_optimizer_state_and_resume(tmp_path, init2):
  """A trained subset (memory attention only), stopped after a step and resumed: frozen parameters
  bit-identical after training, the trainable ones changed; the optimizer state holds moments of
  the trainable ones only (what the checkpoint saves and the resume restores)."""
  from fot_jax import parallel
  from fot_jax.train import count_trainable, resolve_trainable, state_shardings
  init = init2
  before = _flat(init)
  batches = DictionaryBatches(TASK, slots=4, window=TASK.doc_len // 2, seed=0)
  tc = dict(_train_cfg(2, every=1), trainable=("memory_attention",))
  sched = lambda: Schedule({"kind": "constant", "spec": {"d": 2, "w": 1}})  # noqa: E731
  first = train(CFG2, dict(tc, steps=1), sched(), batches, str(tmp_path), init_params_tree=init)
  resumed = train(CFG2, tc, sched(), batches, str(tmp_path))
  assert [h["step"] for h in resumed["history"]] == [2]  # resumed from step 1's checkpoint
  trainable = resolve_trainable(tc["trainable"], CFG2)
  one, two = _flat(first["params"]), _flat(resumed["params"])
  for k in before:
    assert np.array_equal(two[k], before[k]) != trainable.matches(k), k
    assert np.array_equal(two[k], one[k]) != trainable.matches(k), k  # the resumed step updated them again
  n_train, n_total = count_trainable(CFG2, trainable)
  assert resumed["trainable_params"] == n_train == sum(v.size for k, v in before.items() if trainable.matches(k))
  assert 0 < n_train < n_total
  mesh = parallel.make_mesh(None, devices=jax.devices()[:1])
  abstract, _ = state_shardings(CFG2, make_optimizer(tc["optim"]), mesh, parallel.DEFAULT_RULES, trainable)
  moments = sum(x.size for x in jax.tree_util.tree_leaves(abstract.opt_state) if x.ndim)
  assert moments == 2 * n_train  # AdamW's mu and nu, nothing for frozen parameters


def test_trainable_pattern_matching_nothing_is_named():
  from fot_jax.train import resolve_trainable
  with pytest.raises(ValueError, match=r"train.trainable: 'layers_9/.\*' matches no parameter"):
    resolve_trainable(["memory_attention", "layers_9/.*"], CFG)
  with pytest.raises(ValueError, match=r"train.trainable: '\(' is not a regular expression"):
    resolve_trainable("(", CFG)
  assert resolve_trainable((), CFG) is None and resolve_trainable("all", CFG) is None
