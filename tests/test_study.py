"""The controlled-study runner (fot_jax/study.py) on a tiny random checkpoint: every method gets the
same suites, the table and figures are written, a rerun skips finished methods and resumes a
stopped one at its next suite; a method's overrides
reach the model (checked against a direct forward of the overridden ModelConfig)."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fot_jax.study import settings as study_settings
from fot_jax.study import evaluation as study_evaluation
from fot_jax.study import finetune as study_finetune
from fot_jax.study import methods as study_methods
from fot_jax.study import report as study_report
from fot_jax.study import run as study_run
from fot_jax import checkpoint
from fot_jax.eval import suite
from fot_jax.eval import settings as eval_settings
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel
from tests.test_raw_config import assert_only_listed_readers, record_config_reads

L0 = 16
read = study_settings.StudySettings.from_dict  # a study file's ConfigDict -> StudySettings
method = study_settings.MethodSpec.from_dict  # one method entry (and the study's finetune) -> MethodSpec
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
  e = eval_settings.default_config()
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
  with record_config_reads() as readers:  # the study file is read once, by StudySettings.from_dict
    out = study_run.run(read(c), work)
  assert_only_listed_readers(readers)
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
  again = study_run.run(read(c2), work)
  log = capsys.readouterr().out
  assert "none: done before" in log and "pi: its spec or the study's settings changed" in log
  assert again["methods"]["none"] == methods["none"]
  assert again["methods"]["pi"]["method"]["overrides"]["rope_scaling"]["factor"] == 2.0
  # a run stopped after a method's ppl suite resumes at its next suite, keeping what it had
  done = os.path.join(work, "methods", "fot_memory.json")
  with open(done) as f:
    full = json.load(f)
  stopped = {k: v for k, v in full.items() if k not in ("niah", "rd")}
  stopped["suites_done"], stopped["seconds"] = ["ppl"], {"ppl": full["seconds"]["ppl"]}
  os.remove(done)
  with open(os.path.join(work, "methods", "fot_memory.partial.json"), "w") as f:
    json.dump(stopped, f)
  resumed = study_run.run(read(c), work)["methods"]["fot_memory"]
  log = capsys.readouterr().out
  assert "fot_memory: memory path" in log and "suites ['niah', 'rd'] (the others done before)" in log
  assert "[fot_memory] ppl: done before, kept" in log and "[fot_memory] ppl: length" not in log
  assert resumed["ppl"] == full["ppl"] and resumed["rd"]["r_d"] == full["rd"]["r_d"]
  assert resumed["niah"]["single"]["accuracy"] == full["niah"]["single"]["accuracy"]
  assert os.path.exists(done) and not os.path.exists(done.replace(".json", ".partial.json"))
  # a file written before suites_done (a plain method: no rd key) counts as done with its suites
  plain = os.path.join(work, "methods", "none.json")
  with open(plain) as f:
    old = json.load(f)
  del old["suites_done"]
  with open(plain, "w") as f:
    json.dump(old, f)
  study_run.run(read(c), work)
  assert "none: done before" in capsys.readouterr().out


def test_method_overrides_reach_the_model(tiny):
  ck, c, _ = tiny
  base = suite.Context.from_checkpoint(ck, read(c).eval)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (2, 40)).astype(np.int32)  # 40 > L0 = 16, padded to 64 by the plain path

  def study_logits(entry):
    inf = study_methods.method_context(base, method(entry), 64).inference()
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
    method({"name": "bad", "overrides": {"rope": 1}}).model_config(base.cfg)
  with pytest.raises(ValueError, match="study method 'x': unknown inference path"):
    method({"name": "x", "inference": "kv"})



@pytest.mark.parametrize("positions,qk_norm", [("first", False), ("none", False), ("first", True)],
                         ids=["first", "none", "first-qk_norm"])
def test_plain_inference_is_the_model_with_an_empty_memory(positions, qk_norm):
  """The plain path computes what the model computes on the window alone: the memory layers stay
  memory layers (with mem_positions='none' one has no RoPE at all, so dropping it would change
  the logits), and a memory object passed back in is never read."""
  from fot_jax.inference import MemoryInference
  cfg = get_size("tiny", vocab_size=64, mem_layers=(1,), mem_positions=positions, mem_qk_norm=qk_norm,
                 init_std=0.3)  # weights large enough that attention depends on positions
  params = init_params(cfg, 0)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 40)).astype(np.int32)
  direct = np.asarray(LlamaModel(cfg).apply({"params": params}, jnp.asarray(tokens))[0])
  inf = study_methods.PlainInference(cfg, params, pad=64)  # 40 tokens: one window of 64, padding masked
  memory = inf.new_memory(2)
  np.testing.assert_allclose(inf.process(tokens, memory), direct, atol=1e-4, rtol=1e-4)
  # the same as memory inference's first window (nothing in memory yet)
  first = MemoryInference(cfg, params, 64)
  np.testing.assert_allclose(first.process(tokens, first.new_memory(2))[:, :40], direct, atol=1e-4, rtol=1e-4)
  # a second call with the same memory object: still the window alone
  np.testing.assert_allclose(inf.process(tokens, memory), direct, atol=1e-4, rtol=1e-4)
  if positions == "none":  # a plain layer in place of the memory layer differs here
    plain = LlamaModel(dataclasses.replace(cfg, mem_layers=())).apply({"params": params}, jnp.asarray(tokens))[0]
    assert np.abs(np.asarray(plain) - direct).max() > 1e-2


def _ft_config(c):
  """The tiny study with a fine-tuned memory method (2 steps of 2 slots x 32 tokens: 2 windows of 16
  per slot, d=2) next to the frozen one; and a plain fine-tuned method (1 window of 32 per slot), only
  configured (its training is train()'s plain LM step: another compile here for nothing new)."""
  c = ml_collections.ConfigDict(c.to_dict())
  c.finetune = ml_collections.ConfigDict({
      "steps": 2, "length": 32, "slots": 2, "task": c.eval.task, "split": "train", "seed": 0,
      "optim": {"lr": 1e-2, "schedule": "constant"}, "crossbatch": {"d": 2}, "log_every": 1,
      "checkpoint_every": 0})
  c.suites = ("ppl",)
  mem = {"name": "fot_memory", "inference": "memory", "overrides": {"mem_layers": (1,)}}
  c.methods = [mem, dict(mem, name="fot_ft", finetune=True)]
  return c, {"name": "none_ft", "inference": "plain", "finetune": True}


def test_finetuned_method_trains_from_the_base_with_crossbatch_and_is_evaluated_with_its_parameters(tiny, capsys):
  ck, c, tmp = tiny
  c, plain_ft = _ft_config(c)
  work = str(tmp / "ft")
  study = read(c)
  out = study_run.run(study, work)["methods"]
  ft = c.methods[1]
  base = suite.Context.from_checkpoint(ck, study.eval)
  # the fine-tuned parameters (read back from the fine-tune's workdir) differ from the base's ...
  tuned = checkpoint.load(os.path.join(work, "finetune", "fot_ft")).params
  assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree_util.tree_leaves(tuned), jax.tree_util.tree_leaves(base.params))) > 1e-4
  # ... and are the ones evaluated: the perplexity recomputed from the checkpoint, not the frozen one's
  ctx = study_methods.method_context(base, study.methods[1], int(c.pad), tuned)
  again = study_evaluation.perplexity_vs_length(ctx, list(c.lengths), 8, 2, 4)["perplexity"]
  np.testing.assert_allclose(out["fot_ft"]["ppl"]["perplexity"], again, rtol=1e-5)
  assert abs(out["fot_ft"]["ppl"]["perplexity"][1] - out["fot_memory"]["ppl"]["perplexity"][1]) > 1e-4
  # trained with crossbatch: at d=2 the memory layer's attention splits between its own slot's
  # earlier window and another slot's (r_d < 1; without negatives it would be exactly 1)
  with open(os.path.join(work, "finetune", "fot_ft", "metrics.jsonl")) as f:
    log = [json.loads(line) for line in f]
  assert [r["step"] for r in log] == [1, 2] and all(0 < r["rd"] < 0.99 for r in log)
  assert out["fot_ft"]["finetune"]["final_rd"] == pytest.approx(np.mean([r["rd"] for r in log]))
  assert out["fot_ft"]["finetune"]["tokens_per_step"] == 2 * 32 and "finetune" not in out["fot_memory"]
  table = open(os.path.join(work, "study.md")).read()
  assert "| fot_memory | memory | frozen |" in table and "| fot_ft | memory | 2 steps @ 32, {d: 2} |" in table
  # the same tokens for both paths: the memory path's 2 windows of 16 per slot are the plain path's 32
  s_mem, s_plain = study.methods[1].finetune, method(plain_ft, c.finetune).finetune
  assert "crossbatch" not in s_plain.to_dict()
  assert s_plain.to_dict() == {k: v for k, v in s_mem.to_dict().items() if k != "crossbatch"}
  mem = study_finetune.finetune_batches(base, "fot_ft", s_mem, L0, 2)(0)
  plain = study_finetune.finetune_batches(base, "none_ft", s_plain, 32, 1)(0)
  for key in ("inputs", "targets", "loss_mask"):
    np.testing.assert_array_equal(mem[key].reshape(2, 32), plain[key])
  capsys.readouterr()
  # rerun after the evaluation was lost: the finished fine-tune is restored, not trained again
  os.remove(os.path.join(work, "methods", "fot_ft.json"))
  c1 = ml_collections.ConfigDict(c.to_dict())
  c1.methods = [ft]
  again = study_run.run(read(c1), work)["methods"]
  printed = capsys.readouterr().out
  assert "fine-tune fot_ft: done before" in printed and "[ft fot_ft] step" not in printed
  assert again["fot_ft"]["ppl"] == out["fot_ft"]["ppl"]
  # a changed fine-tune is a changed setting of the fine-tuned methods only (they run again)
  c2 = ml_collections.ConfigDict(c.to_dict())
  c2.finetune.steps = 3
  study2 = read(c2)
  (frozen2, ft2), (frozen1, ft1) = study2.methods, study.methods
  assert study2.settings_of(ft2) != study.settings_of(ft1) and study2.settings_of(frozen2) == study.settings_of(frozen1)


def test_finetune_config_errors_name_the_method(tiny):
  ck, c, tmp = tiny
  c, plain_ft = _ft_config(c)
  ft = c.methods[1]
  bad = ml_collections.ConfigDict(c.to_dict())
  bad.methods = [dict(ft, finetune={"length": 24})]
  with pytest.raises(ValueError, match="study method 'fot_ft': finetune.length 24 must be a multiple"):
    study_run.run(read(bad), str(tmp / "bad"))
  assert not os.path.exists(tmp / "bad" / "finetune")  # checked before anything trains
  with pytest.raises(ValueError, match="study method 'none_ft': unknown finetune field.*'lr'"):
    method(dict(plain_ft, finetune={"lr": 1.0}), c.finetune)
  with pytest.raises(ValueError, match="study method 'fot_ft': a memory method fine-tunes with crossbatch"):
    method(dict(ft, finetune={"crossbatch": {}}), c.finetune)
  base = suite.Context.from_checkpoint(ck, read(c).eval)
  with pytest.raises(ValueError, match="study method 'fot_ft': finetune.crossbatch:.*d=3"):  # 2 slots
    study_finetune.finetune_plan(base, method(dict(ft, finetune={"crossbatch": {"d": 3, "w": 1}}), c.finetune), c.pad)
  with pytest.raises(ValueError, match="study method 'fot_ft': finetune.crossbatch: pack size 3"):
    study_finetune.finetune_plan(base, method(dict(ft, finetune={"crossbatch": {"d": 2, "w": 2}}), c.finetune), c.pad)


def test_finetune_crossbatch_d_alone_gives_every_window_its_earlier_windows():
  """{"d": D} without w: window j of a slot sees the slot's j earlier windows and j (D - 1) of other
  slots (as memory inference reads every earlier window); stages keep their switch step."""
  from fot_jax import crossbatch
  from fot_jax.curriculum import Schedule
  k, slots = 3, 4
  sched = Schedule(study_settings.crossbatch_curriculum({"kind": "stages", "stages": [(0, {"d": 1}), (5, {"d": 3})]}, k))
  assert sched.pack == k
  for step, d in ((0, 1), (4, 1), (5, 3)):
    plan = crossbatch.plan_from_spec(slots * k, sched.spec(step))
    for row in range(slots * k):
      slot, j = divmod(row, k)
      live = plan.sources[row] >= 0
      own = plan.sources[row][live & plan.positive[row]]
      assert sorted(own) == [slot * k + i for i in range(j)]  # all earlier windows of its slot
      others = plan.sources[row][live & ~plan.positive[row]]
      assert len(others) == j * (d - 1) and all(o // k != slot and o % k < j for o in others)
  # an explicit spec passes through unchanged
  assert study_settings.crossbatch_curriculum({"d": 2, "w": 2}, k) == {"kind": "constant", "spec": {"d": 2, "w": 2}}


BLOCKS = {"name": "blocks", "inference": "memory", "overrides": {"mem_layers": (1,)},
          "memory": {"mode": "blocks", "block_size": 8, "block_reps": 2, "block_topk": 8}}


def test_method_memory_retrieval_is_validated_naming_the_method_and_field(tiny):
  _, c, _ = tiny
  assert method(dict(BLOCKS, memory={"mode": "blocks"})).memory.to_dict() == {  # memory.BlockSpec's defaults
      "mode": "blocks", "block_size": 128, "block_reps": 16, "block_topk": 8}
  assert method(dict(BLOCKS, memory={"mode": "topk", "topk": 4})).memory.to_dict() == {"mode": "topk", "topk": 4}
  bad = [({"mode": "blocks", "block_topk": 0}, r"study method 'blocks': memory.block_topk must be a positive integer"),
         ({"mode": "blocks", "block_size": True}, "memory.block_size must be a positive integer"),
         ({"mode": "blocks", "topk": 4}, r"memory field\(s\) \['topk'\] unknown for mode 'blocks'"),
         ({"mode": "topk"}, "study method 'blocks': memory.topk is required for mode 'topk'"),
         ({"mode": "topk", "topk": 2.5}, "memory.topk must be a positive integer"),
         ({"mode": "kv"}, "study method 'blocks': memory.mode must be one of"),
         ({"block_size": 8}, "memory.mode must be one of"),
         ("blocks", "study method 'blocks': memory must be a dict")]
  for memory, match in bad:
    bad_c = ml_collections.ConfigDict(c.to_dict())
    bad_c.methods = [dict(BLOCKS, memory=memory)]
    with pytest.raises(ValueError, match=match):
      read(bad_c)
  bad_c.methods = [{"name": "p", "inference": "plain", "memory": {"mode": "blocks"}}]
  with pytest.raises(ValueError, match="study method 'p': memory .* needs inference 'memory'"):
    read(bad_c)


def test_block_memory_method_reads_blocks_and_every_block_retrieved_is_dense_memory(tiny):
  """A method's `memory` reaches MemoryInference (mode 'blocks' with its BlockSpec); with every
  block retrieved its perplexity is dense memory's, computed here without the study's code; with
  one block of 4 retrieved it is not; its settings hold the retrieval, so the resume cache tells
  it from the dense method and from other block settings."""
  from fot_jax.inference import MemoryInference
  from fot_jax.model.memory import BlockSpec
  ck, c, _ = tiny
  c = ml_collections.ConfigDict(c.to_dict())
  c.suites = ("ppl", "rd")
  study = read(c)
  base = suite.Context.from_checkpoint(ck, study.eval)
  few = dict(BLOCKS, name="few", memory={"mode": "blocks", "block_size": 4, "block_reps": 2, "block_topk": 1})
  inf = study_methods.method_context(base, method(BLOCKS), int(c.pad)).inference("dense")  # the method's mode wins
  assert inf.mode == "blocks" and inf.topk == BlockSpec(8, 2, 8) and inf.window == L0
  # at 64 tokens memory holds 3 windows of 16 = 6 blocks of 8: block_topk 8 retrieves all of them
  res = {m["name"]: study_evaluation.evaluate_method(base, method(m), study) for m in (BLOCKS, few)}
  assert "rd" not in res["blocks"] and res["blocks"]["suites_done"] == ["ppl", "rd"]  # r_d is dense memory's
  top = max(c.lengths)
  tails = np.stack([np.asarray(d[-(top + 1):], np.int32) for d in base.docs(top + 1, int(c.ppl.n_docs))])
  cfg = dataclasses.replace(base.cfg, mem_layers=(1,))
  dense = []
  for length in c.lengths:
    ref = MemoryInference(cfg, base.params, L0, "dense")
    streams = tails[:, top - length:]
    logits = ref.process(streams[:, :-1], ref.new_memory(len(streams)))[:, -8:]
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1)
    nll = -np.take_along_axis(np.asarray(logp), streams[:, -8:, None], -1)
    dense.append(float(np.exp(nll.mean())))
  np.testing.assert_allclose(res["blocks"]["ppl"]["perplexity"], dense, rtol=1e-5)
  assert min(abs(a / b - 1) for a, b in zip(res["few"]["ppl"]["perplexity"], dense)) > 1e-4
  # the settings name the retrieval (defaults resolved); a method without `memory` keeps the old ones
  dense_m = {"name": "fot_memory", "inference": "memory", "overrides": {"mem_layers": (1,)}}
  s_blocks, s_few, s_dense = (study.settings_of(method(m)) for m in (BLOCKS, few, dense_m))
  assert s_blocks["memory"] == {"mode": "blocks", "block_size": 8, "block_reps": 2, "block_topk": 8}
  assert "memory" not in s_dense and s_dense == study.settings_of()
  assert not study_settings.same_settings(s_blocks, s_dense) and not study_settings.same_settings(s_blocks, s_few)
  assert res["blocks"]["settings"] == s_blocks
  table = study_report.markdown({"base": ck, "window": L0, "lengths": list(c.lengths), "wall_seconds": 0.0,
                          "methods": {n: dict(r, wall_seconds=0.0) for n, r in res.items()}})
  assert "| blocks | memory, blocks 8 x 8 (reps 2) | frozen |" in table


def test_smollm2_study_config_fits_the_import():
  """experiments/study_smollm2.py: every method is a valid config of the imported architecture,
  streams its attention (no 16K x 16K scores) and is evaluated past the native 8K."""
  from experiments import study_smollm2
  c = study_smollm2.get_config()
  base = get_size("smollm2_135m", mem_layers=())
  study = read(c)
  for m in study.methods:
    cfg = m.model_config(base)
    assert cfg.attention_impl == "blockwise", m.name
  assert max(c.lengths) > 8192 and len({m["name"] for m in c.methods}) == len(c.methods)
  blocks = {m.name: m.memory for m in study.methods if m.memory}
  assert set(blocks) == {"block_memory_all", "block_memory_3"} and all(b.mode == "blocks" for b in blocks.values())
  only = study_smollm2.get_config("block_memory_all,block_memory_3")  # --config=...:NAME,NAME
  assert [m["name"] for m in only.methods] == ["block_memory_3", "block_memory_all"]
  with pytest.raises(ValueError, match=r"unknown method\(s\) \['nosuch'\]"):
    study_smollm2.get_config("nosuch")
  from experiments import study_tiny  # the same selection in the tiny study, in the file's order
  assert [m["name"] for m in study_tiny.get_config("block_memory,fot_memory").methods] == ["fot_memory", "block_memory"]


def test_plain_width_rounds_up_by_at_most_a_sixteenth_of_the_octave():
  assert study_methods.plain_width(16390, 1024) == 18432  # not 32,768
  assert study_methods.plain_width(16384, 1024) == 16384 and study_methods.plain_width(8198, 1024) == 9216
  assert study_methods.plain_width(100, 256) == 256 and study_methods.plain_width(300, 256) == 512
  for t in (1, 63, 65, 1000, 5000, 70000):
    w = study_methods.plain_width(t, 64)
    assert t <= w <= max(64, t + t // 8 + 64) and w % 64 == 0
