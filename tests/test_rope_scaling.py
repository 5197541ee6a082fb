"""RoPE scaling variants against transformers: import, logits past the original length, export.

Tiny random LlamaForCausalLM (tests/hf_models.py) with original_max_position_embeddings=16,
run at 40 tokens; dynamic NTK also at 12 (below 16, where it is plain RoPE).
"""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import LlamaForCausalLM

import fot_jax
from fot_jax.convert import ConvertError, import_hf
from fot_jax.checkpoint import load
from fot_jax.convert.mapping import model_config_from_hf
from fot_jax.convert.torch_reference import TorchMemoryLlama
from fot_jax.model import rope
from fot_jax.model.config import ModelConfig
from tests.hf_models import VOCAB, make_hf, torch_logits

ORIG, LONG, SHORT = 16, 40, 12
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, LONG))

# id -> (rope_scaling as HF writes it, max_position_embeddings)
VARIANTS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIG),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}, 64),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIG,
                     "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5}, 48),
    "llama3": ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIG}, 64),
}


def _max_diff(a, b):
  return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.fixture(scope="module")
def plain_logits(tmp_path_factory):
  """transformers' plain-RoPE logits of the one-layer model every variant test builds (same seed)."""
  hf = make_hf(tmp_path_factory.mktemp("plain"), layers=1)
  return {n: torch_logits(hf, TOKENS[:, :n]) for n in (SHORT, LONG)}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_imports_and_exports_like_transformers(tmp_path, name, plain_logits):
  scaling, mpe = VARIANTS[name]
  hf = make_hf(tmp_path / "hf", layers=1, rope_scaling=dict(scaling), max_position_embeddings=mpe)
  lengths = (SHORT, LONG) if name == "dynamic" else (LONG,)
  refs = {n: torch_logits(hf, TOKENS[:, :n]) for n in lengths}  # transformers' dynamic NTK grows: short first
  model = fot_jax.from_pretrained(str(tmp_path / "hf"))
  assert model.cfg.rope_type == scaling["rope_type"]
  ours = {n: model.logits(TOKENS[:, :n]) for n in lengths}
  for n in lengths:
    assert _max_diff(ours[n], refs[n]) <= 1e-4, n
  # the scaling matters at this length: plain RoPE gives other logits
  assert _max_diff(plain_logits[LONG], refs[LONG]) > 1e-2
  if name == "dynamic":  # below the original length dynamic NTK is plain RoPE
    assert _max_diff(plain_logits[SHORT], refs[SHORT]) <= 1e-4
  # export -> transformers reproduces fot_jax; re-import gives the same config
  model.save_hf(str(tmp_path / "out"))
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["rope_scaling"]["rope_type"] == config["rope_parameters"]["rope_type"] == scaling["rope_type"]
  back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  for n in lengths:
    assert _max_diff(torch_logits(back, TOKENS[:, :n]), ours[n]) <= 1e-4, n
  again = fot_jax.from_pretrained(str(tmp_path / "out"))
  assert again.cfg == model.cfg and again.window == model.window


def test_frozen_ntk_is_plain_rope_with_the_raised_base(tmp_path):
  """'ntk' (not a transformers rope_type) equals transformers' plain RoPE with base theta*s^(d/(d-2))."""
  d, s = 8, 4.0  # head_dim of the tiny model
  hf = make_hf(tmp_path / "hf", layers=1, rope_theta=5000.0 * s ** (d / (d - 2)))
  make_hf(tmp_path / "base", layers=1)  # same weights, base 5000
  model = fot_jax.from_pretrained(str(tmp_path / "base"), rope_scaling={"rope_type": "ntk", "factor": s})
  ref = torch_logits(hf, TOKENS)
  assert _max_diff(model.logits(TOKENS), ref) <= 1e-4
  model.save_hf(str(tmp_path / "out"))
  back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert _max_diff(torch_logits(back, TOKENS), ref) <= 1e-4
  again = fot_jax.from_pretrained(str(tmp_path / "out"))
  assert again.cfg.rope_scaling == model.cfg.rope_scaling and again.cfg.rope_theta == 5000.0


def _hf_dict(scaling, mpe, spelling):
  base = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": mpe}
  if spelling == "rope_scaling":  # transformers 4.x: theta beside, "type" in older files
    legacy = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    return {**base, "rope_theta": 5000.0, "rope_scaling": legacy}
  return {**base, "rope_parameters": {**scaling, "rope_theta": 5000.0}}  # transformers 5.x


@pytest.mark.parametrize("name", list(VARIANTS))
def test_both_config_spellings_give_one_config(name):
  scaling, mpe = VARIANTS[name]
  old, _ = model_config_from_hf(_hf_dict(scaling, mpe, "rope_scaling"), "old.json")
  new, _ = model_config_from_hf(_hf_dict(scaling, mpe, "rope_parameters"), "new.json")
  assert old == new and old.rope_theta == 5000.0 and old.rope_type == scaling["rope_type"]


def test_hf_defaults_made_explicit():
  # yarn without factor: max_position_embeddings / original; llama3 without original: max_position_embeddings
  cfg, _ = model_config_from_hf(_hf_dict({"rope_type": "yarn", "original_max_position_embeddings": 16}, 64,
                                         "rope_parameters"), "c.json")
  assert dict(cfg.rope_scaling)["factor"] == 4.0
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  cfg, _ = model_config_from_hf(_hf_dict(llama3, 128, "rope_scaling"), "c.json")
  assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 128
  # dynamic: transformers' reference length is max_position_embeddings
  cfg, window = model_config_from_hf(_hf_dict({"rope_type": "dynamic", "factor": 2.0}, 32, "rope_scaling"), "c.json")
  assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 32 and window == 32


@pytest.mark.parametrize("scaling,words", [
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0], "original_max_position_embeddings": 16},
     ["longrope", "not supported"]),
    ({"rope_type": "llama3", "factor": 8.0}, ["llama3", "low_freq_factor"]),
    ({"rope_type": "linear", "factor": 0.5}, ["factor", ">= 1"]),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
])
def test_bad_scaling_is_refused_with_the_field(scaling, words):
  with pytest.raises(ConvertError) as info:
    model_config_from_hf(_hf_dict(scaling, 64, "rope_parameters"), "bad/config.json")
  assert all(w in str(info.value) for w in ["bad/config.json"] + words), str(info.value)


def test_model_config_validates_and_stays_hashable():
  cfg = ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8})
  cfg.validate()
  assert hash(cfg) == hash(ModelConfig(rope_scaling=dict(cfg.rope_scaling)))
  assert ModelConfig(rope_scaling={"rope_type": "default"}).rope_scaling == ()
  with pytest.raises(ValueError, match=r"model.rope_scaling: rope_type 'yarn' does not use \['low_freq_factor'\]"):
    ModelConfig(rope_scaling=dict(cfg.rope_scaling, low_freq_factor=1.0)).validate()


@pytest.mark.parametrize("name", list(VARIANTS) + ["ntk"])
def test_memory_key_at_position_zero_is_a_local_key_at_zero(name):
  """mem_positions='first': a memory key is what apply_rope makes of a key at position 0, under
  every variant (YaRN: the key times its attention factor)."""
  scaling = dict(VARIANTS[name][0]) if name != "ntk" else {"rope_type": "ntk", "factor": 4.0}
  if name == "dynamic":  # fot_jax keeps transformers' reference length explicitly
    scaling["original_max_position_embeddings"] = ORIG
  cfg = ModelConfig(hidden_size=32, num_heads=4, rope_scaling=scaling)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 2, 8)), jnp.float32)
  zero = rope.apply_rope(x, jnp.zeros((1, 3), jnp.int32), cfg)
  np.testing.assert_allclose(rope.rope_at_position_zero(x, cfg), zero, rtol=1e-6, atol=1e-6)
  if name.startswith("yarn"):
    assert rope.position_zero_scale(cfg) > 1.0


@pytest.mark.parametrize("name", ["yarn", "dynamic"])
def test_memory_inference_matches_the_torch_reference(tmp_path, name):
  """Windows of 24 (> original 16) with memory: fot_jax equals the PyTorch reference, whose RoPE is
  transformers' own (YaRN: memory keys at position 0 carry the attention factor; dynamic NTK:
  scaled for the window length)."""
  scaling, mpe = VARIANTS[name]
  make_hf(tmp_path / "hf", rope_scaling=dict(scaling), max_position_embeddings=mpe)
  model = fot_jax.from_pretrained(str(tmp_path / "hf"), mem_layers=(1,))
  model.save_hf(str(tmp_path / "out"), window=24)
  ref = TorchMemoryLlama(str(tmp_path / "out"))
  assert ref.window == 24
  ours = model.logits_with_memory(TOKENS, window=24)
  assert _max_diff(ref.logits_with_memory(TOKENS), ours) <= 1e-4


def test_scaling_survives_the_fot_jax_checkpoint(tmp_path):
  """import_hf -> fot_jax_model.json (what init_from and a training workdir write) -> the same
  config; training itself is untouched by the scaling (test_convert_memory trains from an import)."""
  scaling, mpe = VARIANTS["llama3"]
  make_hf(tmp_path / "hf", rope_scaling=dict(scaling), max_position_embeddings=mpe)
  cfg = import_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), mem_layers=(1,)).cfg
  assert cfg.rope_type == "llama3" and load(str(tmp_path / "ck")).cfg == cfg
