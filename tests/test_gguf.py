"""GGUF import (fot_jax.convert.import_gguf / from_pretrained(FILE.gguf)) on a tiny random LLaMA
written as GGUF on the spot with the `gguf` package, against transformers reading the same file
and against the model the file was made from; refused files; the real SmolLM2 when present."""
import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import fot_jax  # noqa: E402
from fot_jax.convert import ConvertError, import_gguf  # noqa: E402
from fot_jax.convert.__main__ import main as convert_main  # noqa: E402
from tests.hf_models import make_hf, torch_logits  # noqa: E402
from tests.test_vocab_hf import TEXTS, make_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q = gguf.GGMLQuantizationType


def _permute(w, heads):
  """llama.cpp's q/k row order (interleaved rotary halves), which transformers undoes on reading."""
  out, inp = w.shape
  return w.reshape(heads, 2, out // heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def write_gguf(path, hf, tok_dir, arch="llama", qtype=Q.F32, raw=None):
  """A LlamaForCausalLM and a tokenizer.json as a GGUF file (llama.cpp tensor names and metadata).
  qtype: type of the 2-D weights (F32, or e.g. Q8_0, quantized here); raw: {name: (bytes, type)}."""
  c = hf.config
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_block_count(c.num_hidden_layers)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  tok = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
  vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
  tokens = sorted(vocab, key=vocab.get)
  special = {t["content"] for t in tok["added_tokens"]}
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens)
  w.add_token_types([3 if t in special else 1 for t in tokens])
  w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
  w.add_bos_token_id(vocab["<|im_start|>"])
  w.add_eos_token_id(vocab["<|im_end|>"])
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
  if not c.tie_word_embeddings:
    names["lm_head.weight"] = "output.weight"
  for i in range(c.num_hidden_layers):
    for hf_name, g in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                       ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                       ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
                       ("post_attention_layernorm", "ffn_norm")):
      names[f"model.layers.{i}.{hf_name}.weight"] = f"blk.{i}.{g}.weight"
  for hf_name, g in names.items():
    arr = sd[hf_name]
    if ".attn_q." in g:
      arr = _permute(arr, c.num_attention_heads)
    elif ".attn_k." in g:
      arr = _permute(arr, c.num_key_value_heads)
    if raw and g in raw:
      data, t = raw[g]
      w.add_tensor(g, data, raw_shape=data.shape, raw_dtype=t)
    elif arr.ndim == 2 and qtype != Q.F32 and arr.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
      w.add_tensor(g, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    else:
      w.add_tensor(g, np.ascontiguousarray(arr))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(directory, HF model, tokenizer dir): a tiny tied GQA LLaMA whose vocabulary is the tiny tokenizer's."""
  d = tmp_path_factory.mktemp("gguf")
  tok_dir = str(d / "tok")
  make_tokenizer(tok_dir)
  n = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json")).__len__()
  import tests.hf_models as hm
  old, hm.VOCAB = hm.VOCAB, n
  try:
    hf = make_hf(d / "hf", kv_heads=2, tied=True)
  finally:
    hm.VOCAB = old
  return d, hf, tok_dir


def test_gguf_import_matches_transformers(tiny):
  d, hf, tok_dir = tiny
  path = write_gguf(d / "tiny.gguf", hf, tok_dir)
  ref = LlamaForCausalLM.from_pretrained(str(d), gguf_file="tiny.gguf", dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 11))
  want = torch_logits(ref, tokens)
  assert np.abs(want - torch_logits(hf, tokens)).max() <= 1e-4  # the file holds the original model
  ck = str(d / "ck")
  convert_main(["import_gguf", "--gguf", path, "--out", ck, "--mem_layers", "1"])
  model = fot_jax.from_pretrained(ck)
  assert model.cfg.tie_embeddings and model.cfg.kv_heads == 2 and model.cfg.mem_layers == (1,)
  assert model.window == 8 and model.cfg.rope_theta == 5000.0
  assert np.abs(model.logits(tokens) - want).max() <= 1e-4
  # the tokenizer travels with the checkpoint and encodes as the original tokenizer.json does
  vocab = model.vocab
  orig = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"))
  for text in TEXTS:
    assert list(vocab.encode(text)) == orig.encode(text, add_special_tokens=False)
    assert vocab.decode(vocab.encode(text)) == text
  assert (vocab.bos_id, vocab.eos_id) == (1, 2)
  # export_hf ships tokenizer.json + tokenizer_config.json, which transformers' AutoTokenizer reads back
  model.save_hf(str(d / "exported"))
  back = AutoTokenizer.from_pretrained(str(d / "exported"))
  assert back.bos_token == "<|im_start|>" and back.eos_token == "<|im_end|>"
  assert back.encode(TEXTS[2], add_special_tokens=False) == list(vocab.encode(TEXTS[2]))
  # and from_pretrained reads the .gguf file directly, with model overrides
  direct = fot_jax.from_pretrained(path, mem_layers="all")
  assert direct.cfg.mem_layers == (0, 1)
  assert np.abs(direct.logits(tokens) - want).max() <= 1e-4


def test_quantized_gguf(tiny):
  d, hf, tok_dir = tiny
  path = write_gguf(d / "q8.gguf", hf, tok_dir, qtype=Q.Q8_0)
  ref = LlamaForCausalLM.from_pretrained(str(d), gguf_file="q8.gguf", dtype=torch.float32).eval()
  tokens = np.random.default_rng(1).integers(0, hf.config.vocab_size, (1, 9))
  want = torch_logits(ref, tokens)
  assert np.abs(want - torch_logits(hf, tokens)).max() > 1e-4  # really quantized
  assert np.abs(fot_jax.from_pretrained(path).logits(tokens) - want).max() <= 1e-4


def test_refused_gguf(tiny, tmp_path, capsys):
  d, hf, tok_dir = tiny
  other = write_gguf(tmp_path / "gpt2.gguf", hf, tok_dir, arch="gpt2")
  with pytest.raises(ConvertError, match="architecture 'gpt2'.*not supported"):
    import_gguf(other, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()  # refused before anything is written
  bs, ts = gguf.GGML_QUANT_SIZES[Q.Q8_1]
  rows, cols = hf.config.intermediate_size, hf.config.hidden_size
  q81 = np.zeros((rows, cols // bs * ts), np.uint8)
  bad = write_gguf(tmp_path / "q81.gguf", hf, tok_dir, raw={"blk.0.ffn_up.weight": (q81, Q.Q8_1)})
  with pytest.raises(SystemExit) as e:  # the CLI: one line
    convert_main(["import_gguf", "--gguf", bad, "--out", str(tmp_path / "out2")])
  assert e.value.code == 2
  msg = capsys.readouterr().err
  assert msg.startswith("fot_jax.convert: ") and msg.count("\n") == 1
  assert "blk.0.ffn_up.weight uses quantization Q8_1" in msg
  with pytest.raises(ConvertError, match="not a readable GGUF file"):
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all")
    fot_jax.from_pretrained(str(tmp_path / "garbage.gguf"))


SMOLLM2 = [os.environ.get("FOT_JAX_SMOLLM2", ""), os.path.join(ROOT, "checkpoints", "smollm2-135m")]


def test_real_smollm2():
  path = next((p for p in SMOLLM2 if p and os.path.isfile(os.path.join(p, "fot_jax_model.json"))), None)
  if path is None:
    pytest.skip("SmolLM2-135M not imported: run `make smollm2` (checkpoints/smollm2-135m) or set "
                "FOT_JAX_SMOLLM2 to an import_gguf checkpoint")
  model = fot_jax.from_pretrained(path)
  assert (model.cfg.num_layers, model.cfg.hidden_size, model.cfg.vocab_size) == (30, 576, 49152)
  vocab = model.vocab
  prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci("
  ids = [vocab.bos_id] + list(vocab.encode(prompt))
  logits = model.logits(np.asarray([ids]))[0]
  assert vocab.decode([int(logits[-1].argmax())]) == "n"  # a pretrained model completes its own code
  nll = -np.mean([logits[i][ids[i + 1]] - np.logaddexp.reduce(logits[i]) for i in range(len(ids) - 1)])
  assert nll < 2.0, nll  # a random model of this vocabulary scores ~10.8 nats
