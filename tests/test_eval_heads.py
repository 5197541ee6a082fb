"""The retrieval-head probe (fot_jax/eval/heads.py): attention weights equal a NumPy reference
and reproduce the model's attention output (memory-layer and position-strategy variants), a
planted copy head is found and ranked first (and is not once zeroed), the prompts, the
layer-pick rule, `--mem_layers=auto:N` and the `heads` suite."""
import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

from fot_jax import checkpoint
from fot_jax.eval import heads, suite
from fot_jax.eval import settings as eval_settings
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params


def _np_attention(cfg, params, tokens):
  """Plain NumPy LLaMA forward of one row -> per layer softmax(QK^T/sqrt(d) + causal mask) [L, H, T, T]."""
  t, h, kv, d = len(tokens), cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
  p = jax.tree_util.tree_map(np.asarray, params)
  rms = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d) / dict(cfg.rope_scaling).get("factor", 1.0)
  ang = np.arange(t)[:, None] * inv
  cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
  rope = lambda x: x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin
  x = p["embed_tokens"]["embedding"][tokens]
  out = []
  for i in range(cfg.num_layers):
    lp = p[f"layers_{i}"]
    a = lp["self_attn"]
    y = rms(x, lp["input_layernorm"]["weight"])
    q = rope((y @ a["q_proj"]["kernel"]).reshape(t, h, d))
    k = np.repeat(rope((y @ a["k_proj"]["kernel"]).reshape(t, kv, d)), h // kv, axis=1)
    v = np.repeat((y @ a["v_proj"]["kernel"]).reshape(t, kv, d), h // kv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + np.where(np.tril(np.ones((t, t))), 0.0, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out.append(w)
    x = x + np.einsum("hts,shd->thd", w, v).reshape(t, h * d) @ a["o_proj"]["kernel"]
    y = rms(x, lp["post_attention_layernorm"]["weight"])
    m = lp["mlp"]
    g = y @ m["gate_proj"]["kernel"]
    x = x + (g / (1 + np.exp(-g)) * (y @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
  return np.stack(out)


@pytest.mark.parametrize("scaling", [(), {"rope_type": "linear", "factor": 2.0}])
def test_attention_weights_equal_numpy_reference(scaling):
  # GQA (4 query heads on 2 kv heads), a non-default theta and RoPE variant; weights scaled up so the
  # attention is far from uniform. A memory layer without memory is the same plain attention.
  cfg = get_size("tiny", mem_layers=(), rope_theta=500.0, rope_scaling=scaling)
  params = jax.tree_util.tree_map(lambda x: x * 6.0 if x.ndim == 2 else x, init_params(cfg, 3))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
  got = heads.attention_weights(cfg, params, tokens)
  assert got.shape == (3, 2, 4, 12, 12)
  for b in range(2):
    np.testing.assert_allclose(got[:, b], _np_attention(cfg, params, tokens[b]), atol=2e-5)
  assert got.max() > 0.9  # not near-uniform: the comparison means something
  as_memory = heads.attention_weights(dataclasses.replace(cfg, mem_layers=(1,)), params, tokens)
  np.testing.assert_allclose(as_memory, got, atol=1e-6)


@pytest.mark.parametrize("variant", [dict(mem_layers=(1,), mem_qk_norm=True),
                                     dict(mem_layers=(1,), mem_positions="none"),
                                     dict(position_strategy={"kind": "self_extend", "window": 4, "group": 2})])
def test_attention_weights_reproduce_the_models_attention_output(variant):
  # The other transforms the probe follows (memory-layer q/k norm and temperature, no RoPE,
  # Self-Extend): its weights times the layer's values, through o_proj, give the layer's output.
  cfg = get_size("tiny", **variant)
  params = jax.tree_util.tree_map(lambda x: x * 6.0 if x.ndim == 2 else x + 1.0, init_params(cfg, 4))
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
  w = heads.attention_weights(cfg, params, tokens)
  from fot_jax.model.llama import LlamaModel
  _, state = LlamaModel(cfg).apply({"params": params}, tokens, capture_intermediates=True, mutable=["intermediates"])
  for i in range(cfg.num_layers):
    att = state["intermediates"][f"layers_{i}"]["self_attn"]
    v = np.repeat(np.asarray(att["v_proj"]["__call__"][0]).reshape(2, 12, cfg.kv_heads, -1), 2, axis=2)
    out = np.einsum("bhts,bshd->bthd", w[i], v).reshape(2, 12, -1) @ np.asarray(
        params[f"layers_{i}"]["self_attn"]["o_proj"]["kernel"])
    np.testing.assert_allclose(out, np.asarray(att["__call__"][0][0]), atol=2e-4, rtol=1e-4)
  assert w.max() > 0.9


class WordVocab:
  """A small token vocabulary: each word, digit and punctuation mark one id (spaces dropped)."""

  def __init__(self, size):
    self.vocab_size, self.bos_id, self.ids = size, 1, {}

  def encode(self, text):
    out = [self.ids.setdefault(w, len(self.ids) + 3) for w in re.findall(r"\d|[A-Za-z']+|[^\sA-Za-z\d]", text)]
    assert max(out, default=0) < self.vocab_size, "WordVocab: too many distinct words"
    return out


V, D = 160, 160  # vocabulary (one-hot residual blocks) and head dimension
HIDDEN = 1 + 3 * V  # [bias | current token | previous token | the token before it]
CUR, PREV1, PREV2 = (slice(1 + j * V, 1 + (j + 1) * V) for j in range(3))


def _rope_np(x, pos, theta):
  inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
  ang = np.concatenate([pos * inv, pos * inv])
  return x * np.cos(ang) + np.concatenate([-x[D // 2:], x[:D // 2]]) * np.sin(ang)


def _induction_model(copy_head=True):
  """A 2-layer bigram induction circuit; layer 1 head 3 is the copy head.

  RoPE with theta 1e20 and head_dim 160: pairs 0-12 turn fast (positions), pairs 16-79 turn less
  than 0.05 rad over the prompt (token content; RoPE there is close to the identity).
  Layer 0: heads 0 / 1 have constant q/k (from the bias unit) whose RoPE score peaks at distance
  1 / 2 (q = R(-delta) w, k = w: score sum_m w_m^2 cos(theta_m (j - i + delta))); they copy the
  one-hot token of position i-1 / i-2 into the PREV1 / PREV2 blocks. Layer 1 head 3 matches the
  query's (current, previous) token codes with the key's (previous, one before): it attends to the
  position after an earlier occurrence of the last two tokens, which holds the next token. Every
  other head has a zero query (uniform attention, argmax at position 0); MLPs write nothing."""
  theta = 1e20
  cfg = get_size("tiny", vocab_size=V, hidden_size=HIDDEN, intermediate_size=8, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=D, rope_theta=theta, mem_layers=())
  p = jax.tree_util.tree_map(lambda x: np.array(x, np.float32), init_params(cfg, 0))  # writable copies
  emb = np.zeros((V, HIDDEN), np.float32)
  emb[:, 0] = 1.0
  emb[np.arange(V), 1 + np.arange(V)] = 1.0
  p["embed_tokens"]["embedding"] = emb
  for i, norm in ((0, 2.0), (1, 4.0)):  # RMSNorm weights undo the norm: its input's squared length
    p[f"layers_{i}"]["input_layernorm"]["weight"][:] = np.sqrt(norm / HIDDEN)
    p[f"layers_{i}"]["mlp"]["down_proj"]["kernel"][:] = 0.0
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      p[f"layers_{i}"]["self_attn"][name]["kernel"][:] = 0.0
  a0 = p["layers_0"]["self_attn"]
  w = np.zeros(D, np.float32)
  w[:13] = np.sqrt(800.0)  # score gap >= 0.686 * 800 / sqrt(160) = 43 between distance delta and any other
  a0["k_proj"]["kernel"][0, :D] = w
  a0["v_proj"]["kernel"][CUR, :D] = np.eye(V)
  for head, delta, block in ((0, 1, PREV1), (1, 2, PREV2)):
    a0["q_proj"]["kernel"][0, head * D:(head + 1) * D] = _rope_np(w, -delta, theta)
    a0["o_proj"]["kernel"][head * D:(head + 1) * D, block] = np.eye(V)
  static = np.r_[16:80, 96:160]  # the slow RoPE pairs: 128 dims, two codes of 64
  codes = np.random.default_rng(1).normal(size=(V, 64))
  codes = 8.0 * codes / np.linalg.norm(codes, axis=1, keepdims=True)
  a1 = p["layers_1"]["self_attn"]
  if copy_head:
    q = a1["q_proj"]["kernel"]
    q[CUR, 3 * D + static[:64]], q[PREV1, 3 * D + static[64:]] = codes, codes
  k = a1["k_proj"]["kernel"]  # kv head 1 (query heads 2 and 3)
  k[PREV1, D + static[:64]], k[PREV2, D + static[64:]] = codes, codes
  return cfg, p


def test_planted_copy_head_is_found_and_ranked_first():
  cfg, params = _induction_model()
  vocab = WordVocab(V)
  res = heads.copy_scores(cfg, params, vocab, n_prompts=4, length=160, seed=0)
  s = np.asarray(res["scores"])
  assert s.shape == (2, 4) and res["answer_tokens"] >= 4 * 5
  assert s[1, 3] > 0.8, s
  assert np.delete(s.ravel(), 7).max() < 0.2, s  # every other head: near zero
  assert res["ranking"][0] == 1 and res["top_heads"][0][:2] == [1, 3]
  assert heads.pick_layers(res, 1) == (1,)
  assert "locker code" in res["prompts"][0] and len(res["prompts"]) == 2
  # the same model with the copy head's query zeroed: nothing copies, layer 1 is not ranked first
  zeroed = heads.copy_scores(*_induction_model(copy_head=False), vocab, n_prompts=4, length=160, seed=0)
  assert np.asarray(zeroed["scores"]).max() < 0.2 and zeroed["ranking"][0] != 1


def test_prompts_are_seeded_and_hold_the_needle():
  from data_pipelines import vocab as vocab_lib
  voc = vocab_lib.get_vocabulary("byte")
  a = heads.make_prompt(voc, 384, np.random.default_rng(5))
  b = heads.make_prompt(voc, 384, np.random.default_rng(5))
  assert np.array_equal(a.ids, b.ids) and 300 <= len(a.ids) <= 384
  lo, hi = a.needle
  fact = voc.decode(a.ids[lo:hi].tolist())
  value = voc.decode(a.ids[a.answer_start:].tolist()).strip()
  assert fact.startswith("Keep in mind: the locker code of ") and fact.endswith(f" is {value}.\n")
  assert 5 <= len(value) <= 7 and value.isdigit() and lo > 1  # filler before the needle too
  for banned in ("pass key", "special magic", "secret number", "needle"):
    assert banned not in a.text.lower()
  with pytest.raises(ValueError, match="too short"):
    heads.make_prompt(voc, 60, np.random.default_rng(0))


def test_pick_layers_rule_and_ties():
  table = {"scores": [[0.5, 0.1], [0.5, 0.3], [0.2, 0.9], [0.5, 0.3], [0.0, 0.0]]}
  # best head first (layer 2: 0.9); layers 0, 1, 3 tie at 0.5, their means 0.3, 0.4, 0.4; 1 before 3
  assert heads.rank_layers(table["scores"]) == [2, 1, 3, 0, 4]
  assert [heads.pick_layers(table, n) for n in (1, 2, 3, 4)] == [(2,), (1, 2), (1, 2, 3), (0, 1, 2, 3)]
  for bad in (0, 6, True):
    with pytest.raises(ValueError, match="pick 1..5 layers"):
      heads.pick_layers(table, bad)


def _tiny_checkpoint(tmp_path):
  # q/k-norm memory layer: its extra parameter (inv_temperature) must be dropped for the probe
  cfg = get_size("tiny", vocab_size=260, mem_qk_norm=True)
  ck = str(tmp_path / "ck")
  checkpoint.save(ck, init_params(cfg, 0), cfg, 512, vocab="byte")
  return ck, cfg


def test_mem_layers_one_parser_for_every_command():
  """evaluate, ask, the readout and lm_harness (after its ':' -> ',') read --mem_layers with cli.parse_mem_layers."""
  from fot_jax import cli
  assert cli.parse_mem_layers(" 6,17 ") == (6, 17) and cli.parse_mem_layers("None") == ()
  assert cli.parse_mem_layers("ALL") == "all" and cli.parse_mem_layers("auto:3", auto=True) == "auto:3"
  for bad, auto in (("x,y", True), ("-1", False), ("6,,7", False), ("auto:0", True), ("auto:3", False)):
    with pytest.raises(ValueError, match="mem_layers"):
      cli.parse_mem_layers(bad, auto=auto)


def test_mem_layers_auto(tmp_path, capsys):
  from fot_jax import cli
  ck, cfg = _tiny_checkpoint(tmp_path)
  assert cli.parse_mem_layers("AUTO:2", auto=True) == "auto:2"  # checked on the command line, resolved once the model loads
  got = heads.resolve_auto_layers("auto:2", ck)
  assert "memory layers" in capsys.readouterr().out
  from data_pipelines import vocab as vocab_lib
  plain = dataclasses.replace(cfg, mem_layers=())
  params = init_params(cfg, 0)
  del params["layers_1"]["self_attn"]["inv_temperature"]
  res = heads.copy_scores(plain, params, vocab_lib.get_vocabulary("byte"))  # the probe's defaults
  assert got == heads.pick_layers(res, 2) and len(got) == 2 and list(got) == sorted(got)
  assert heads.resolve_auto_layers("AUTO:1", ck) == heads.pick_layers(res, 1)  # the helper, any case
  for bad, msg in (("auto:0", "positive"), ("auto:x", "positive"), ("auto:", "positive")):
    with pytest.raises(ValueError, match=msg) as e:
      cli.parse_mem_layers(bad, auto=True)  # before anything loads
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="only 3 layers") as e:
    heads.resolve_auto_layers("auto:4", ck)
  assert "\n" not in str(e.value)


def test_heads_suite_writes_json_plot_and_report(tmp_path):
  ck, _ = _tiny_checkpoint(tmp_path)
  c = eval_settings.SuiteSettings.from_dict({"vocab": "byte", "heads": {"n_prompts": 2, "length": 200, "top": 2}})
  work = str(tmp_path / "w")
  out = suite.run(ck, ["heads"], work, c, name="tiny")["heads"]
  assert np.shape(out["scores"]) == (3, 4) and len(out["picked"]) == 2
  saved = json.load(open(os.path.join(work, "eval", "heads.json")))
  assert saved["picked"] == out["picked"] and saved["suite"] == "heads"
  assert os.path.getsize(os.path.join(work, "eval", "heads.png")) > 1000
  text = open(os.path.join(work, "eval", "report.md")).read()
  assert "## heads" in text and "![heads](heads.png)" in text
  assert ", ".join(map(str, out["picked"])) in text
