"""HF import/export against transformers on tiny random LLaMA models (no download)."""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

import fot_jax
from fot_jax.convert import ConvertError, export_hf, import_hf
from fot_jax.convert.__main__ import main as convert_main
from fot_jax.checkpoint import load
from tests.hf_models import VOCAB, make_hf, torch_logits

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 11))


def leaves(params):
  return jax.tree_util.tree_flatten_with_path(params)[0]


@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, False), (4, True), (2, True)],
                         ids=["mha-untied", "gqa-untied", "mha-tied", "gqa-tied"])
def test_import_export_match_transformers(tmp_path, kv_heads, tied):
  hf = make_hf(tmp_path / "hf", kv_heads, tied)
  ref = torch_logits(hf, TOKENS)
  ck = tmp_path / "ck"
  import_hf(str(tmp_path / "hf"), str(ck), mem_layers=(1,))
  model = fot_jax.from_pretrained(str(ck))
  assert model.cfg.kv_heads == kv_heads and model.cfg.tie_embeddings == tied and model.window == 8
  assert np.abs(model.logits(TOKENS) - ref).max() <= 1e-4
  # export -> transformers loads it as a drop-in LLaMA with the same logits
  model.save_hf(str(tmp_path / "out"))
  back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert np.abs(torch_logits(back, TOKENS) - model.logits(TOKENS)).max() <= 1e-4
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["mem_layers"] == [1] and config["mem_positionals"] is True
  assert config["last_context_length"] == 8 and config["mem_attention_grouping"] is None
  # import -> export -> import: bitwise-identical parameters
  import_hf(str(tmp_path / "out"), str(tmp_path / "ck2"))
  first, second = leaves(load(str(ck)).params), leaves(load(str(tmp_path / "ck2")).params)
  assert [p for p, _ in first] == [p for p, _ in second]
  for (_, a), (_, b) in zip(first, second):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  assert load(str(tmp_path / "ck2")).cfg == load(str(ck)).cfg
  # ModelConfig overrides over an fot_jax checkpoint: checked against its parameters
  assert fot_jax.from_pretrained(str(ck), mem_layers=(0, 1)).cfg.mem_layers == (0, 1)
  with pytest.raises(ConvertError, match="intermediate_size|mlp"):
    fot_jax.from_pretrained(str(ck), intermediate_size=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sources(tmp_path, dtype):
  hf = make_hf(tmp_path / "hf", dtype=dtype)
  model = fot_jax.from_pretrained(str(tmp_path / "hf"))
  assert np.abs(model.logits(TOKENS) - torch_logits(hf, TOKENS)).max() <= 1e-4
  model.save_hf(str(tmp_path / "out"), dtype="bfloat16" if dtype == torch.bfloat16 else "float16")
  again = fot_jax.from_pretrained(str(tmp_path / "out"))
  for (_, a), (_, b) in zip(leaves(model.params), leaves(again.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))  # half values survive the trip exactly


def test_sharded_and_bin_sources(tmp_path):
  hf = make_hf(tmp_path / "hf")
  ref = torch_logits(hf, TOKENS)
  hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
  assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
  state = {k: v.clone() for k, v in hf.state_dict().items()}
  for name in ("bin", "bin_sharded"):
    os.makedirs(tmp_path / name)
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / name)
  torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
  names = list(state)
  parts = {"pytorch_model-00001-of-00002.bin": names[:9], "pytorch_model-00002-of-00002.bin": names[9:]}
  for fname, keys in parts.items():
    torch.save({k: state[k] for k in keys}, tmp_path / "bin_sharded" / fname)
  (tmp_path / "bin_sharded" / "pytorch_model.bin.index.json").write_text(json.dumps(
      {"weight_map": {k: f for f, keys in parts.items() for k in keys}}))
  for name in ("sharded", "bin", "bin_sharded"):
    model = fot_jax.from_pretrained(str(tmp_path / name))
    assert np.abs(model.logits(TOKENS) - ref).max() <= 1e-4, name
  # our own sharded export loads in transformers
  model.save_hf(str(tmp_path / "out"), max_shard_size="10KB")
  index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert np.abs(torch_logits(back, TOKENS) - ref).max() <= 1e-4


def _error(fn, *args, **kwargs):
  with pytest.raises(ConvertError) as info:
    fn(*args, **kwargs)
  return str(info.value)


def test_errors_name_the_file_or_tensor(tmp_path):
  hf_dir = tmp_path / "hf"
  hf = make_hf(hf_dir)
  # missing shard listed in the index
  hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
  shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
  shard.unlink()
  msg = _error(fot_jax.from_pretrained, str(tmp_path / "sharded"))
  assert str(shard) in msg and "missing weight file" in msg
  # truncated safetensors / .bin
  trunc = tmp_path / "trunc"
  shutil.copytree(hf_dir, trunc)
  data = (trunc / "model.safetensors").read_bytes()
  (trunc / "model.safetensors").write_bytes(data[:len(data) // 2])
  msg = _error(fot_jax.from_pretrained, str(trunc))
  assert str(trunc / "model.safetensors") in msg and "truncated" in msg
  (trunc / "model.safetensors").unlink()
  torch.save(hf.state_dict(), trunc / "pytorch_model.bin")
  data = (trunc / "pytorch_model.bin").read_bytes()
  (trunc / "pytorch_model.bin").write_bytes(data[:len(data) // 2])
  msg = _error(fot_jax.from_pretrained, str(trunc))
  assert str(trunc / "pytorch_model.bin") in msg
  # a tensor the config needs is absent
  (trunc / "pytorch_model.bin").unlink()
  torch.save({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}, trunc / "pytorch_model.bin")
  msg = _error(fot_jax.from_pretrained, str(trunc))
  assert "tensor lm_head.weight is missing" in msg and str(trunc) in msg
  # not LLaMA-like: mixture of experts, and a foreign model_type
  config = json.loads((hf_dir / "config.json").read_text())
  for change, word in (({"num_local_experts": 8}, "mixture-of-experts"), ({"model_type": "gpt2"}, "gpt2")):
    bad = tmp_path / f"bad_{word}"
    shutil.copytree(hf_dir, bad)
    (bad / "config.json").write_text(json.dumps(dict(config, **change)))
    msg = _error(fot_jax.from_pretrained, str(bad))
    assert str(bad / "config.json") in msg and word in msg
  # config.json disagrees with the tensors
  bad = tmp_path / "bad_shape"
  shutil.copytree(hf_dir, bad)
  (bad / "config.json").write_text(json.dumps(dict(config, intermediate_size=64)))
  msg = _error(fot_jax.from_pretrained, str(bad))
  assert "model.layers.0.mlp.gate_proj.weight" in msg and str(bad / "model.safetensors") in msg
  # export over an existing non-empty directory
  ck = tmp_path / "ck"
  import_hf(str(hf_dir), str(ck))
  msg = _error(export_hf, str(ck), str(hf_dir))
  assert str(hf_dir) in msg and "not an empty directory" in msg
  msg = _error(import_hf, str(hf_dir), str(ck))
  assert str(ck) in msg


def test_non_llama_parameters_need_fot_jax_only(tmp_path):
  make_hf(tmp_path / "hf")
  model = fot_jax.from_pretrained(str(tmp_path / "hf"), mem_layers=(1,), mem_gating=True, mem_qk_norm=True)
  rng = np.random.default_rng(0)
  # the imported model starts without these parameters' values from HF: give them some
  layer = model.checkpoint.params["layers_1"]["self_attn"]
  layer["mem_gate"] = rng.normal(size=4).astype(np.float32)
  layer["inv_temperature"] = rng.normal(size=4).astype(np.float32)
  msg = _error(model.save_hf, str(tmp_path / "out"))
  assert "mem_qk_norm" in msg and "mem_gating" in msg and "--fot_jax_only" in msg
  model.save_hf(str(tmp_path / "out"), fot_jax_only=True)
  again = fot_jax.from_pretrained(str(tmp_path / "out"))
  assert again.cfg.mem_gating and again.cfg.mem_qk_norm
  np.testing.assert_array_equal(again.checkpoint.params["layers_1"]["self_attn"]["mem_gate"], layer["mem_gate"])


def test_cli_round_trip_and_error(tmp_path, capsys):
  hf = make_hf(tmp_path / "hf", tied=True)
  convert_main(["import_hf", "--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"),
                "--mem_layers", "0,1", "--mem_positions", "none"])
  with pytest.warns(UserWarning, match="mem_positions='none'"):
    convert_main(["export_hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "out"),
                  "--dtype", "float32", "--max_shard_size", "15KB"])
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["mem_layers"] == [0, 1] and config["mem_positionals"] is False
  back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert np.abs(torch_logits(back, TOKENS) - torch_logits(hf, TOKENS)).max() <= 1e-4
  capsys.readouterr()
  with pytest.raises(SystemExit) as info:
    convert_main(["export_hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "out")])
  err = capsys.readouterr().err
  assert info.value.code == 2 and err.startswith("fot_jax.convert: ") and str(tmp_path / "out") in err


def test_tokenizer_travels_with_the_checkpoint(tmp_path):
  import sentencepiece as spm
  text = tmp_path / "text.txt"
  text.write_text("\n".join(["bad cab dab face bead fade"] * 50))  # few characters: fits 37 ids
  spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=VOCAB,
                                 model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                 minloglevel=2)
  make_hf(tmp_path / "hf")
  shutil.copy(tmp_path / "sp.model", tmp_path / "hf" / "tokenizer.model")
  import_hf(str(tmp_path / "hf"), str(tmp_path / "ck"))
  export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
  assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
  assert tok("cab face")["input_ids"] == [1] + sp.encode("cab face")


def test_import_fot_jax_stays_light():
  code = ("import sys, fot_jax, fot_jax.convert; "
          "assert not {'torch', 'transformers', 'safetensors'} & set(sys.modules), sorted(sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
