"""Hugging Face tokenizer.json as a seqio vocabulary (data_pipelines.vocab.HFVocab), against
transformers' tokenizer on the same file, in the data pipeline and the evaluation prompts; and
the end of the silent byte fallback (a checkpoint without a tokenizer fails, naming it)."""
import dataclasses
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data_pipelines import pipeline
from data_pipelines.vocab import HFVocab, checkpoint_vocab_spec, get_vocabulary
from fot_jax import checkpoint
from fot_jax.eval import passkey, retrieval, suite
from fot_jax.eval import settings as eval_settings
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

TEXTS = ["def f(x):\n    return x * 2  # double\n", "The pass key is 4821. Remember it.\n",
         "naïve café — ünïcödé 日本語 \t tabs  and   spaces\n", "class A:\n    pass\n" * 3]


def make_tokenizer(directory, special_config=True):
  """A tiny byte-level BPE tokenizer.json (GPT-2/SmolLM2 style) trained on the spot."""
  os.makedirs(directory, exist_ok=True)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXTS * 4, trainer)
  path = os.path.join(directory, "tokenizer.json")
  tok.save(path)
  if special_config:
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "pad_token": None}, f)
  return path


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
  return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_round_trip_matches_transformers(tok_path):
  vocab = get_vocabulary(tok_path)
  ref = PreTrainedTokenizerFast(tokenizer_file=tok_path)
  assert isinstance(vocab, HFVocab) and vocab.vocab_size == len(ref)
  assert (vocab.bos_id, vocab.eos_id, vocab.pad_id) == (1, 2, 2)  # from tokenizer_config.json; pad = eos
  for text in TEXTS:
    ids = list(vocab.encode(text))
    assert ids == ref.encode(text, add_special_tokens=False)
    assert vocab.decode(ids) == ref.decode(ids) == text
  # special tokens survive decoding, and decoding stops at eos (seqio's contract)
  ids = [vocab.bos_id] + list(vocab.encode("x = 1")) + [vocab.eos_id] + list(vocab.encode("after"))
  assert vocab.decode(ids) == "<|im_start|>x = 1<|im_end|>"
  # TensorFlow side (the data pipeline encodes with encode_tf)
  import tensorflow as tf
  assert vocab.encode_tf(tf.constant(TEXTS[2])).numpy().tolist() == ref.encode(TEXTS[2], add_special_tokens=False)
  assert vocab.decode_tf(tf.constant(vocab.encode(TEXTS[1]), tf.int32)).numpy().decode() == TEXTS[1]


def test_special_tokens_without_config(tmp_path):
  path = make_tokenizer(str(tmp_path / "plain"), special_config=False)
  vocab = get_vocabulary(path)  # '<|endoftext|>' is GPT-2's bos and eos
  assert vocab.bos_id == vocab.eos_id == 0
  with open(path) as f:
    data = json.load(f)
  data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|endoftext|>"]
  del data["model"]["vocab"]["<|endoftext|>"]
  with open(path, "w") as f:
    json.dump(data, f)
  with pytest.raises(ValueError, match="no bos/eos token.*tokenizer_config.json"):
    get_vocabulary(path)


def test_pipeline_and_prompts_match_transformers(tok_path, tmp_path):
  vocab = get_vocabulary(tok_path)
  ref = PreTrainedTokenizerFast(tokenizer_file=tok_path)
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i, text in enumerate(TEXTS):
    (corpus / f"f{i}.py").write_text(text)
  docs = [d.tolist() for d in pipeline.document_tokens(f"files:{corpus}/*.py", vocab, "train", seed=None)]
  assert sorted(docs) == sorted(ref.encode(t, add_special_tokens=False) for t in TEXTS)
  # an evaluation prompt: bos + the text's ids, the answer where transformers puts it
  prompt, answer = passkey.make_prompt_fn(vocab)(120, 0.5, np.random.default_rng(0))
  ids, start = retrieval.encode(vocab, prompt, answer)
  assert ids[0] == vocab.bos_id == ref.convert_tokens_to_ids("<|im_start|>")
  assert ids[1:].tolist() == ref.encode(prompt + answer, add_special_tokens=False)
  assert ref.decode(ids[start:].tolist()) == answer and vocab.decode(ids[1:]) == prompt + answer


def _ckpt(tmp_path, name, vocab_size, **meta):
  cfg = get_size("tiny", vocab_size=vocab_size)
  path = str(tmp_path / name)
  checkpoint.save(path, init_params(cfg, 0), cfg, 16, **meta)
  return path


def test_checkpoint_vocabulary_no_silent_byte(tmp_path, tok_path):
  c = eval_settings.SuiteSettings()
  bare = _ckpt(tmp_path, "bare", 260)
  with pytest.raises(ValueError, match=f"{bare}: no tokenizer found.*--eval.vocab=byte"):
    suite.Context.from_checkpoint(bare, c)  # (the evaluate CLI prints a ValueError as one `evaluate error:` line)
  # a vocabulary too large for the model fails naming both
  with pytest.raises(ValueError, match=f"tokenizer.json has 300 tokens but {bare}'s embedding has vocab_size=260"):
    suite.Context.from_checkpoint(bare, dataclasses.replace(c, vocab=tok_path))
  # byte when asked, or when the checkpoint records it was trained with it (what training writes)
  assert checkpoint_vocab_spec(bare, {}, None, "byte") == "byte"
  assert checkpoint_vocab_spec(bare, {"vocab": "byte"}, None) == "byte"
  # a checkpoint that ships tokenizer.json (with its tokenizer_config.json) uses it
  shipped = _ckpt(tmp_path, "shipped", 300, tokenizer=tok_path)
  assert sorted(os.listdir(shipped)) == ["fot_jax_model.json", "params", "tokenizer.json", "tokenizer_config.json"]
  ctx = suite.Context.from_checkpoint(shipped, c)
  assert isinstance(ctx.vocab, HFVocab) and ctx.vocab.bos_id == 1 and ctx.vocab_spec.endswith("tokenizer.json")
