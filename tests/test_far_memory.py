"""train.memory: a training step's memory layers read a long memory (written without gradient) under
one softmax with their window and crossbatch contexts; the loop writes it every `refresh` steps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax.curriculum import Schedule
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MemoryBlock
from fot_jax.settings import MemorySettings
from fot_jax.train import train
from fot_jax.train.far_memory import write_memory

TASK = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=8, n_queries=8)
CFG = get_size("tiny", vocab_size=TASK.vocab_size, mem_layers=(0, 1))


def test_crossbatch_and_memory_are_one_softmax_with_the_window():
  """Row r with crossbatch sources S and memory M reads what it reads with no plan and memory M
  followed by the sources' memory keys/values (the memory path, checked against NumPy elsewhere)."""
  params = init_params(CFG, 0)
  rng = np.random.default_rng(0)
  b, t, m = 4, 16, 24
  tokens = jnp.asarray(rng.integers(0, TASK.vocab_size, (b, t)), jnp.int32)
  kv, d = CFG.kv_heads, CFG.dim_per_head
  memory = {layer: [MemoryBlock(jnp.asarray(rng.standard_normal((1, m, kv, d)), jnp.float32),
                                jnp.asarray(rng.standard_normal((1, m, kv, d)), jnp.float32),
                                jnp.ones((1, m), bool))] for layer in CFG.mem_layers}
  sources = jnp.asarray([[-1, -1], [0, -1], [-1, -1], [0, 2]], jnp.int32)
  positive = jnp.asarray([[False, False], [True, False], [False, False], [True, False]])
  model = LlamaModel(CFG)
  # top-k over all m entries: every entry read (the training step's mode)
  both, aux = model.apply({"params": params}, tokens, plan=(sources, positive), memories=memory,
                          mem_mode="topk", mem_topk=m, want_mem_kv=True)
  rows, width = (1, 3), m + 2 * t  # rows 1 and 3 (one and two sources) in one call: memory padded, masked

  def moved(layer, i):  # [rows, width, KV, D] keys (i=0) or values (i=1): memory, then the row's sources
    whole = [jnp.concatenate([(memory[layer][0].keys, memory[layer][0].values)[i][0]]
                             + [aux["mem_kv"][layer][i][s] for s in sources[r] if s >= 0]) for r in rows]
    return jnp.stack([jnp.pad(x, ((0, width - len(x)), (0, 0), (0, 0))) for x in whole])

  live = jnp.asarray([[j < m + t * int(jnp.sum(sources[r] >= 0)) for j in range(width)] for r in rows])
  blocks = {layer: [MemoryBlock(moved(layer, 0), moved(layer, 1), live)] for layer in CFG.mem_layers}
  alone, _ = model.apply({"params": params}, tokens[jnp.asarray(rows)], memories=blocks, mem_mode="dense")
  np.testing.assert_allclose(np.asarray(both[jnp.asarray(rows)]), np.asarray(alone), rtol=2e-4, atol=2e-4)
  plain, _ = model.apply({"params": params}, tokens, plan=(sources, positive))
  assert not np.allclose(np.asarray(plain[0]), np.asarray(both[0]), atol=1e-3)  # the memory is read


class _WithMemory:
  """Dictionary batches and a memory haystack of random tokens per step (counted)."""

  def __init__(self, tokens=40):
    self.batches = DictionaryBatches(TASK, slots=4, window=TASK.doc_len // 2, seed=0)
    self.asked, self.tokens = [], tokens

  def __call__(self, step):
    return self.batches(step)

  def memory_tokens(self, step):
    self.asked.append(step)
    return np.random.default_rng(step).integers(0, TASK.vocab_size, self.tokens).astype(np.int32)


def _settings(steps, memory=None):
  return {"steps": steps, "seed": 0, "loss_on": "last", "log_every": 1, "optim": {"lr": 1e-2},
          "tensorboard": False, "memory": memory}


SCHEDULE = {"kind": "constant", "spec": {"d": 2, "w": 1}}


def test_loop_writes_memory_every_refresh_steps_and_the_step_reads_it(tmp_path):
  feed = _WithMemory()
  out = train(CFG, _settings(3, {"window": 16, "topk": 4, "refresh": 2}), Schedule(SCHEDULE), feed,
              str(tmp_path / "mem"))
  assert feed.asked == [0, 2] and out["memory_writes"] == 2  # the periods' first steps
  plain = train(CFG, _settings(1), Schedule(SCHEDULE), _WithMemory(), str(tmp_path / "plain"))
  assert all(np.isfinite(h["loss"]) for h in out["history"])
  assert out["history"][0]["loss"] != plain["history"][0]["loss"]  # the first step already reads memory


def test_a_phase_whose_data_makes_no_haystack_trains_without_memory(tmp_path):
  """A copy warm-up or text phase before the retrieval phases: its steps read no memory."""
  feed = _WithMemory()
  schedule = Schedule({"kind": "phases", "phases": [
      {"name": "plain", "task": "plain", "spec": {"d": 2, "w": 1}, "steps": 2},
      {"name": "mem", "task": "mem", "spec": {"d": 2, "w": 1}, "steps": 2}]})
  out = train(CFG, _settings(4, {"window": 16, "topk": 4, "refresh": 5}), schedule,
              {"plain": DictionaryBatches(TASK, slots=4, window=TASK.doc_len // 2, seed=1), "mem": feed},
              str(tmp_path))
  assert [h["memory_read"] for h in out["history"]] == [0.0, 0.0, 1.0, 1.0]
  assert feed.asked == [0] and out["memory_writes"] == 1  # the task's step 2 is period 0 of refresh 5


def test_memory_is_written_as_inference_writes_it():
  """write_memory's keys are those MemoryInference.process leaves (windows of `window`, top-k reads),
  also when its search scores the buffer in chunks of 12 (most of them empty for the first windows,
  skipped): layer 1's keys depend on what layer 0 read."""
  from fot_jax.inference import MemoryInference
  params = init_params(CFG, 1)
  tokens = np.random.default_rng(3).integers(0, TASK.vocab_size, 50).astype(np.int32)
  reader = MemoryInference(CFG, params, 16, mode="topk", topk=4)
  ref = reader.new_memory(1)
  reader.process(tokens[None], ref, want_logits=False)
  for chunk in (4096, 12):  # 12: windows of 16 leave chunks partly written
    blocks = write_memory(CFG, params, tokens, MemorySettings(window=16, topk=4), chunk=chunk)
    for layer in CFG.mem_layers:
      n = int(blocks[layer][0].mask.sum())
      assert n == 50 and int(ref.blocks()[layer][0].mask.sum()) == 50
      np.testing.assert_allclose(np.asarray(blocks[layer][0].keys[0, :n]), np.asarray(ref.blocks()[layer][0].keys[0, :n]),
                                 rtol=1e-5, atol=1e-5)


def test_memory_without_a_haystack_is_named(tmp_path):
  batches = DictionaryBatches(TASK, slots=4, window=TASK.doc_len // 2, seed=0)
  with pytest.raises(ValueError, match="no batch source makes a memory haystack"):
    train(CFG, _settings(1, {"window": 16}), Schedule(SCHEDULE), batches, str(tmp_path))


def test_plan_compiles_the_step_that_reads_the_memory():
  """--mode=plan lowers the step with train.memory's input (abstract, replicated) and counts the
  memory's q.k in the model FLOPs: 2 x T x M x heads x head_dim per row and memory layer."""
  from fot_jax import parallel, plan
  from fot_jax.train import make_optimizer
  mesh, rules = parallel.make_mesh(None), parallel.DEFAULT_RULES
  optimizer = make_optimizer({"lr": 1e-3})
  spec = {"d": 2, "w": 1}
  plain, abstract = plan.compile_step(CFG, optimizer, mesh, rules, 8, 16, spec=spec)
  read, _ = plan.compile_step(CFG, optimizer, mesh, rules, 8, 16, spec=spec, memory=MemorySettings(topk=4),
                              memory_tokens=64)
  flops = lambda c: float((c.cost_analysis()[0] if isinstance(c.cost_analysis(), list) else c.cost_analysis())["flops"])
  assert flops(read) > flops(plain)
  hd = CFG.num_heads * CFG.dim_per_head
  extra = plan.model_flops(CFG, abstract.params, 8, 16, 2, 64) - plan.model_flops(CFG, abstract.params, 8, 16, 2)
  assert extra == 2 * 16 * 64 * hd * 8 * len(CFG.mem_layers)
