"""Text in, text out on `fot_jax.from_pretrained(...)`: a string (or a list of strings) is encoded as
transformers' AutoTokenizer encodes it from the same tokenizer files (bos only where the tokenizer
adds one), `generate` answers it with the decoded continuation, and a checkpoint without a
tokenizer fails naming what to pass. A model without memory layers warns, once, when memory would
have been read. Tiny random checkpoints (3 layers, window 32) with byte-level BPE tokenizers made on
the spot, one that adds no bos (as SmolLM2's) and one whose post-processor adds it (as LLaMA's)."""
import json
import os
import shutil
import warnings

import numpy as np
import pytest
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

import fot_jax
from fot_jax import checkpoint
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from tests.test_vocab_hf import make_tokenizer

WINDOW = 32
NEW = 8  # new tokens in every generate call: one set of compiled shapes
SHORT = "def f(x): return x * 2"
LONG = " The pass key is 4821. Remember it. class A: pass def f(x): return x * 2" * 2  # > 2 windows


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """{'plain': a checkpoint whose tokenizer adds no bos (as SmolLM2's), 'none': the same weights
  without a tokenizer, 'tokenizer': the plain tokenizer.json, 'bos_tokenizer': the same with a
  post-processor that puts <|im_start|> (the configured bos) first, as LLaMA's}; memory layer 1 of 3."""
  root = tmp_path_factory.mktemp("text_io")
  tok = make_tokenizer(str(root / "tok"), special_config=False)
  with open(root / "tok" / "tokenizer_config.json", "w") as f:  # bos <|im_start|> (1), eos <|im_end|> (2)
    json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}, f)
  bos_dir = root / "tok_bos"
  shutil.copytree(root / "tok", bos_dir)
  t = Tokenizer.from_file(str(bos_dir / "tokenizer.json"))
  t.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
  t.save(str(bos_dir / "tokenizer.json"))
  cfg = get_size("tiny", vocab_size=300, init_std=0.3, embed_init_std=1.0)
  params = init_params(cfg, 0)
  out = {}
  for name, src in [("plain", tok), ("none", None)]:
    checkpoint.save(str(root / name), params, cfg, WINDOW, tokenizer=src)
    out[name] = str(root / name)
  out["tokenizer"], out["bos_tokenizer"] = tok, str(bos_dir / "tokenizer.json")
  return out


@pytest.fixture(scope="module")
def model(ckpts):
  return fot_jax.from_pretrained(ckpts["plain"])


def _ref(path):
  """transformers' own tokenizer of the checkpoint (tokenizer.json + tokenizer_config.json)."""
  return AutoTokenizer.from_pretrained(path)


def test_text_in_equals_ids_in(model, ckpts):
  ref = _ref(ckpts["plain"])
  ids = ref(LONG)["input_ids"]
  assert ids[0] != ref.bos_token_id and len(ids) > 2 * WINDOW  # SmolLM2-like: no bos added
  np.testing.assert_array_equal(model.encode(LONG), ids)
  np.testing.assert_array_equal(model.logits(LONG), model.logits([ids]))
  np.testing.assert_array_equal(model.logits_with_memory(LONG), model.logits_with_memory([ids]))
  batch = [SHORT, SHORT.replace("2", "3")]  # a list of strings of one length is a batch
  np.testing.assert_array_equal(model.logits(batch), model.logits([ref(t)["input_ids"] for t in batch]))
  with pytest.raises(ValueError, match="different lengths"):
    model.logits([SHORT, LONG])
  # a LLaMA-style tokenizer: its post-processor puts bos first, and so does encode, as transformers
  llama = fot_jax.from_pretrained(ckpts["plain"], vocab=ckpts["bos_tokenizer"])
  ref_bos = _ref(os.path.dirname(ckpts["bos_tokenizer"]))
  ids_bos = ref_bos(SHORT)["input_ids"]
  assert ids_bos[0] == ref_bos.bos_token_id == llama.vocab.bos_id
  np.testing.assert_array_equal(llama.encode(SHORT), ids_bos)
  assert model.encode(SHORT, bos=True).tolist() == ids_bos  # bos by choice
  assert llama.encode(SHORT, bos=False).tolist() == ids_bos[1:]


def test_generate_text_returns_the_decoded_continuation(model, ckpts):
  ref = _ref(ckpts["plain"])
  rows = {p: ref(p)["input_ids"] for p in (SHORT, LONG)}
  free = {}
  for prompt, ids in rows.items():  # LONG: its first windows go to memory
    free[prompt] = model.generate(np.asarray(ids), NEW, eos_token_id=()).tolist()[len(ids):]
    assert model.generate(prompt, NEW, eos_token_id=()) == ref.decode(free[prompt], skip_special_tokens=True)
  # a stop token cuts the text before it (greedy: the same tokens up to it); by default the vocabulary's eos
  new = free[LONG]
  stop = new[3]
  assert model.generate(LONG, NEW, eos_token_id=stop) == ref.decode(new[:new.index(stop)], skip_special_tokens=True)
  new, eos = free[SHORT], ref.eos_token_id
  assert model.generate(SHORT, NEW) == ref.decode(new[:new.index(eos)] if eos in new else new,
                                                  skip_special_tokens=True)
  # a list of strings is a batch, answered as generate answers the list of their ids
  batch = [SHORT, "class A: pass"]
  rows = [ref(t)["input_ids"] for t in batch]
  outs = model.generate([np.asarray(r) for r in rows], NEW, eos_token_id=())
  texts = model.generate(batch, NEW, eos_token_id=())
  assert texts == [ref.decode(o[len(r):].tolist(), skip_special_tokens=True) for r, o in zip(rows, outs)]
  assert all(isinstance(t, str) for t in texts)
  with pytest.raises(ValueError, match="all strings or all token ids"):
    model.generate([SHORT, [1, 2, 3]], 2)


def test_text_needs_a_tokenizer(ckpts):
  bare = fot_jax.from_pretrained(ckpts["none"])
  ids = _ref(ckpts["plain"])(SHORT)["input_ids"]
  assert bare.generate(np.asarray(ids), NEW).shape == (len(ids) + NEW,)  # ids work as before
  with pytest.raises(ValueError, match=r"has none .*pass token ids, or load it with "
                                       r"fot_jax.from_pretrained\(.*vocab="):
    bare.generate(SHORT, 2)
  named = fot_jax.from_pretrained(ckpts["none"], vocab=ckpts["tokenizer"])
  np.testing.assert_array_equal(named.encode(SHORT), ids)
  assert isinstance(named.generate(SHORT, NEW), str)


def _warnings(fn):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn()
  return [str(w.message) for w in caught if "memory layers" in str(w.message)]


def test_no_memory_layers_warns_once(ckpts, model):
  bare = fot_jax.from_pretrained(ckpts["plain"], mem_layers=())

  def calls():
    bare.logits_with_memory(SHORT)  # one window: nothing would be read from memory
    bare.logits_with_memory(LONG)
    bare.generate(LONG, NEW)

  found = _warnings(calls)
  assert len(found) == 1, found
  assert "mem_layers=()" in found[0] and "mem_layers=(0, 1, 2)" in found[0] and "\n" not in found[0]
  fresh = fot_jax.from_pretrained(ckpts["plain"], mem_layers=())
  assert len(_warnings(lambda: fresh.generate(LONG, NEW))) == 1  # generate alone warns too
  assert not _warnings(lambda: (model.logits_with_memory(LONG), model.generate(LONG, NEW, eos_token_id=())))
