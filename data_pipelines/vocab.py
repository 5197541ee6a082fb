"""Vocabularies: bytes, a SentencePiece model file, a Hugging Face `tokenizer.json`, and
the size check against a model.

`get_vocabulary("byte")` is UTF-8 bytes with pad/eos/unk (seqio's ByteVocabulary,
ids 0/1/2, byte b -> b + 3) plus one bos id at the end (259), so a stream can mark
document starts as LongLLaMA does. A path ending in `.json` is a Hugging Face
`tokenizer.json` (HFVocab; its bos/eos/pad tokens come from the `tokenizer_config.json`
beside it). Any other path is a SentencePiece `.model` file (e.g. OpenLLaMA's
`tokenizer.model`, or one written by `python -m data_pipelines.train_tokenizer`).

`checkpoint_vocabulary` picks a checkpoint's vocabulary: the one it was trained with
(fot_jax_model.json 'vocab') or the tokenizer it ships; there is no silent fallback.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import seqio
import tensorflow as tf

from fot_jax.jsonio import read_json


class ByteVocab(seqio.ByteVocabulary):
  """seqio's byte vocabulary with a bos id (its one extra id, 259); vocab_size 260."""

  def __init__(self):
    super().__init__(extra_ids=1)

  @property
  def bos_id(self) -> Optional[int]:
    return self._base_vocab_size


def get_vocabulary(spec: str) -> seqio.Vocabulary:
  """'byte', 'dictionary_lookup' (token ids as they are), a Hugging Face tokenizer.json or a
  SentencePiece model path -> a seqio vocabulary with bos/eos/pad ids."""
  if spec == "byte":
    return ByteVocab()
  if spec == "dictionary_lookup":  # the synthetic task's own ids (data_pipelines.dictionary_lookup)
    from data_pipelines.dictionary_lookup import DictionaryTask
    return TokenVocab(DictionaryTask().vocab_size)
  path = os.path.expanduser(str(spec))
  if not os.path.isfile(path):
    raise ValueError(f"data.vocab: {spec!r} is neither 'byte' nor an existing SentencePiece model or "
                     f"Hugging Face tokenizer.json; train a SentencePiece model with "
                     f"`python -m data_pipelines.train_tokenizer --task=NAME --output=PATH`")
  if path.endswith(".json"):
    return HFVocab(path)
  vocab = seqio.SentencePieceVocabulary(path)
  try:
    vocab.tokenizer  # loads the model now, so a bad file fails here and not mid-run
  except Exception as e:
    raise ValueError(f"data.vocab: {spec!r} is not a readable SentencePiece model ({e})") from None
  if vocab.bos_id is None or vocab.bos_id < 0 or vocab.eos_id is None or vocab.eos_id < 0:
    raise ValueError(f"data.vocab: SentencePiece model {spec!r} has no bos/eos ids; "
                     f"train it with bos_id/eos_id set (train_tokenizer does)")
  return vocab


def special_ids(vocab: seqio.Vocabulary) -> dict:
  """bos/eos/pad ids the slot batcher writes into streams."""
  pad = vocab.pad_id if vocab.pad_id is not None and vocab.pad_id >= 0 else 0
  return {"bos": int(vocab.bos_id), "eos": int(vocab.eos_id), "pad": int(pad)}


def check_fits(vocab_size: int, embedding_size: int, vocab_name: str = "", model_name: str = "") -> None:
  """A vocabulary must fit the model's embedding table; fail before training (default names) or
  evaluation (the tokenizer and the checkpoint), naming both and their sizes."""
  if vocab_size <= embedding_size:
    return
  if model_name:
    raise ValueError(f"{vocab_name} has {vocab_size} tokens but {model_name}'s embedding has "
                     f"vocab_size={embedding_size} rows; use the model's own tokenizer or a smaller vocabulary")
  raise ValueError(f"{vocab_name or 'data.vocab'} has {vocab_size} tokens but the model's embedding has "
                   f"model.vocab_size={embedding_size} rows; set model.overrides.vocab_size >= "
                   f"{vocab_size} or use a smaller vocabulary")


def checkpoint_vocab_spec(path: str, meta: dict, tokenizer_path: Optional[str], spec: str = "") -> str:
  """The vocabulary spec of a checkpoint: `spec` when given, else the vocabulary it was trained
  with (fot_jax_model.json 'vocab'), else the tokenizer it ships. Never a guess: a checkpoint
  with neither fails, naming it."""
  spec = spec or meta.get("vocab") or tokenizer_path or ""
  if spec:
    return str(spec)
  raise ValueError(f"{path}: no tokenizer found (no tokenizer.model or tokenizer.json in the checkpoint and "
                   f"no 'vocab' recorded in its fot_jax_model.json); pass the vocabulary it was trained "
                   f"with (e.g. --eval.vocab=byte or --eval.vocab=PATH/tokenizer.json)")


class TokenVocab(seqio.PassThroughVocabulary):
  """Ids used as they are (token tasks such as dictionary lookup): pad 0, bos 1, eos 2."""

  def __init__(self, size: int):
    super().__init__(size, eos_id=2)

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def pad_id(self) -> int:
    return 0


def _token_name(value) -> Optional[str]:
  """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


class HFVocab(seqio.Vocabulary):
  """A Hugging Face `tokenizer.json` (the `tokenizers` library) as a seqio vocabulary.

  encode adds no special tokens (the pipeline and the prompts add bos/eos themselves);
  decode keeps them, as transformers' `decode` does, but (seqio's Vocabulary.decode) ends the text
  at the first eos; `_decode` (or `.tokenizer.decode(ids, skip_special_tokens=False)`) gives all of
  it, e.g. a chat whose turns end in eos. bos/eos/pad/unk are the tokens named in
  `tokenizer_config.json` beside the file (Hugging Face's own record of them); without that
  file, '<s>'/'</s>' or '<|endoftext|>' when the vocabulary has them. pad defaults to eos.
  """

  GUESSES = {"bos_token": ("<s>", "<|endoftext|>"), "eos_token": ("</s>", "<|endoftext|>")}

  def __init__(self, path: str):
    from tokenizers import Tokenizer
    super().__init__(extra_ids=0)
    self.path = os.path.abspath(path)
    try:
      self.tokenizer = Tokenizer.from_file(self.path)
    except Exception as e:
      raise ValueError(f"data.vocab: {path!r} is not a readable Hugging Face tokenizer.json ({e})") from None
    config_path = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
      config = read_json(config_path, "tokenizer config", hint="")
      if not isinstance(config, dict):
        raise ValueError(f"tokenizer config {config_path} is not a JSON object")
    ids = {}
    for field in ("bos_token", "eos_token", "pad_token", "unk_token"):
      names = [_token_name(config.get(field))] if field in config else list(self.GUESSES.get(field, ()))
      found = [self.tokenizer.token_to_id(n) for n in names if n]
      ids[field] = next((i for i in found if i is not None), None)
    if ids["bos_token"] is None or ids["eos_token"] is None:
      raise ValueError(f"data.vocab: {path!r} has no bos/eos token; name them (bos_token, eos_token) in "
                       f"{config_path}")
    self._bos, self._eos, self._unk = ids["bos_token"], ids["eos_token"], ids["unk_token"]
    self._pad = ids["pad_token"] if ids["pad_token"] is not None else self._eos

  @property
  def bos_id(self) -> int:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def unk_id(self) -> Optional[int]:
    return self._unk

  @property
  def _base_vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def _encode(self, s: str) -> Sequence[int]:
    return self.tokenizer.encode(s, add_special_tokens=False).ids

  def _decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    def encode(text) -> np.ndarray:  # bytes in a graph (tf.data), a 0-d object array eagerly
      text = text.item() if isinstance(text, np.ndarray) else text
      return np.asarray(self._encode(text.decode("utf-8", "replace")), np.int32)
    out = tf.numpy_function(encode, [s], tf.int32, stateful=False)
    out.set_shape([None])
    return out

  def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    def decode(row: np.ndarray) -> bytes:
      return self._decode(row.tolist()).encode("utf-8")
    out = tf.numpy_function(decode, [ids], tf.string, stateful=False)
    out.set_shape([])
    return out

  def __eq__(self, other) -> bool:
    return isinstance(other, HFVocab) and other.path == self.path
