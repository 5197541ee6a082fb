"""The exported model in PyTorch (memory path), generation, and training from an import."""
import warnings

import numpy as np
import pytest
from transformers import LlamaForCausalLM

import fot_jax
from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax.convert import import_hf
from fot_jax.convert.torch_reference import TorchMemoryLlama
from fot_jax.curriculum import Schedule
from fot_jax.model.config import ModelConfig
from fot_jax.train import train
from tests.hf_models import VOCAB, make_hf, torch_logits

WINDOW = 8


@pytest.mark.parametrize("positions,layers,mem_layers", [("first", 2, (1,)), ("none", 2, (0, 1))])
def test_torch_reference_equals_fot_jax_memory_inference(tmp_path, positions, layers, mem_layers):
  make_hf(tmp_path / "hf", kv_heads=2, layers=layers)
  model = fot_jax.from_pretrained(str(tmp_path / "hf"), mem_layers=mem_layers, mem_positions=positions)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.save_hf(str(tmp_path / "out"))
  assert any("mem_positions='none'" in str(w.message) for w in caught) == (positions == "none")
  ref = TorchMemoryLlama(str(tmp_path / "out"))
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 5 * WINDOW + 3))  # 6 windows, the last partial
  ours = model.logits_with_memory(tokens)
  assert ours.shape == (2, 5 * WINDOW + 3, VOCAB)
  np.testing.assert_allclose(ref.logits_with_memory(tokens), ours, atol=1e-4, rtol=1e-4)
  # the memory matters: without it the later windows differ
  alone = model.logits_with_memory(tokens[:, WINDOW:2 * WINDOW])
  assert np.abs(alone - ours[:, WINDOW:2 * WINDOW]).max() > 1e-2
  if positions == "none":
    return  # memory layers without RoPE: plain LLaMA code would differ (export warns)
  # with 'first', the reference's first window is plain LLaMA: transformers agrees
  hf = torch_logits(LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval(), tokens[:, :WINDOW])
  np.testing.assert_allclose(ref.logits_with_memory(tokens[:, :WINDOW]), hf, atol=1e-4)


def test_generate_follows_memory_inference(tmp_path):
  make_hf(tmp_path / "hf")
  model = fot_jax.from_pretrained(str(tmp_path / "hf"), mem_layers=(1,))
  prompt = np.random.default_rng(2).integers(0, VOCAB, (2, WINDOW + 3))
  # crosses two window boundaries; windows from token 0, as logits_with_memory places them
  out = model.generate(prompt, max_new_tokens=2 * WINDOW, last_context_length=0)
  assert out.shape == (2, 3 * WINDOW + 3) and np.array_equal(out[:, :WINDOW + 3], prompt)
  logits = model.logits_with_memory(out)
  np.testing.assert_array_equal(logits[:, WINDOW + 2:-1].argmax(-1), out[:, WINDOW + 3:])
  sampled = model.generate(prompt, max_new_tokens=4, temperature=1.0, seed=0)
  assert np.array_equal(sampled, model.generate(prompt, max_new_tokens=4, temperature=1.0, seed=0))


TASK = DictionaryTask(num_symbols=16, num_value_symbols=12, key_len=1, value_len=1, n_defs=4, n_queries=4)


def _run_cfg(ck, steps):
  return {"steps": steps, "seed": 0, "loss_on": "last", "log_every": 100, "init_from": ck,
          "optim": {"lr": 1e-2, "warmup_steps": 0}}


def test_imported_checkpoint_continues_as_fot_run(tmp_path):
  assert TASK.vocab_size <= VOCAB and TASK.doc_len == 2 * WINDOW
  make_hf(tmp_path / "hf")
  ck = str(tmp_path / "ck")
  cfg = import_hf(str(tmp_path / "hf"), ck, mem_layers=(1,)).cfg
  slots = 4
  batches = DictionaryBatches(TASK, slots=slots, window=WINDOW, seed=0)
  # crossbatch d=4, w=1: each slot's last window sees its own first window (positive)
  # and the first windows of the 3 other slots (negatives)
  schedule = Schedule({"kind": "constant", "spec": {"d": slots, "w": 1}})
  b = batches(0)
  out = train(cfg, _run_cfg(ck, 8), schedule, lambda step: b, str(tmp_path / "run"))  # one batch: a clear trend
  losses = [h["loss"] for h in out["history"]]
  assert losses[-1] < losses[0] - 0.5 and losses[-1] == min(losses)
  # Step 1 started from the imported weights: its loss is the PyTorch reference's memory
  # inference loss with all slots' first windows in memory (one memory layer, so the
  # order in which they enter memory does not change their keys).
  fot_jax.from_pretrained(ck).save_hf(str(tmp_path / "out"))
  ref = TorchMemoryLlama(str(tmp_path / "out"))
  firsts = b["inputs"][0::2]
  nll, count = 0.0, 0
  for s in range(slots):
    stream = np.concatenate([np.delete(firsts, s, 0).reshape(-1), firsts[s], b["inputs"][2 * s + 1]])
    logits = ref.logits_with_memory(stream[None])[0, -WINDOW:]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    mask = b["loss_mask"][2 * s + 1]
    nll -= np.take_along_axis(logp, b["targets"][2 * s + 1][:, None], -1)[:, 0][mask].sum()
    count += mask.sum()
  assert losses[0] == pytest.approx(nll / count, rel=1e-4)
  # the run's workdir is itself an fot_jax checkpoint: it exports
  fot_jax.from_pretrained(str(tmp_path / "run")).save_hf(str(tmp_path / "run_out"))
  assert (tmp_path / "run_out" / "model.safetensors").exists()


def test_init_from_with_a_mismatched_model_is_refused(tmp_path):
  make_hf(tmp_path / "hf")
  ck = str(tmp_path / "ck")
  cfg = import_hf(str(tmp_path / "hf"), ck).cfg
  wrong = ModelConfig(**{**cfg.__dict__, "intermediate_size": 64})
  batches = DictionaryBatches(TASK, slots=2, window=WINDOW, seed=0)
  with pytest.raises(ValueError, match=r"train.init_from: .*layers_0/mlp/down_proj/kernel has shape \(48, 32\)"):
    train(wrong, _run_cfg(ck, 1), Schedule({"kind": "constant", "spec": {"d": 1, "w": 1}}), batches,
          str(tmp_path / "run"))


def test_verify_export_compares_with_the_torch_reference(tmp_path):
  from fot_jax.checkpoint import ConvertError
  from fot_jax.convert.verify import verify_export
  make_hf(tmp_path / "hf", vocab_size=260)  # byte ids fit
  model = fot_jax.from_pretrained(str(tmp_path / "hf"), mem_layers=(1,))
  model.save(str(tmp_path / "ck"))
  model.save_hf(str(tmp_path / "out"))
  (tmp_path / "t.txt").write_text("def f(x):\n  return x + 1\n" * 4)
  r = verify_export(str(tmp_path / "ck"), str(tmp_path / "out"), text_path=str(tmp_path / "t.txt"),
                    tokens=3 * WINDOW + 2, vocab="byte")
  assert (r["tokens"], r["window"], r["windows"], r["mem_layers"]) == (3 * WINDOW + 2, WINDOW, 4, [1])
  assert r["max_abs_logit_diff"] < 1e-4 and r["argmax_agree"] == 1.0 and r["ok"] and not r["failures"]
  assert abs(r["nll_fot_jax"] - r["nll_torch"]) < 1e-5
  fot_jax.from_pretrained(str(tmp_path / "hf"), mem_layers=(0,)).save_hf(str(tmp_path / "other"))
  with pytest.raises(ConvertError, match="memory layers"):
    verify_export(str(tmp_path / "ck"), str(tmp_path / "other"), vocab="byte")
  with pytest.raises(ConvertError, match="fewer than"):
    verify_export(str(tmp_path / "ck"), str(tmp_path / "out"), text_path=str(tmp_path / "t.txt"),
                  tokens=10_000, vocab="byte")
