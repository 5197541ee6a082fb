"""Vocabularies: bytes, a SentencePiece model file, and the size check against a model.

`get_vocabulary("byte")` is UTF-8 bytes with pad/eos/unk (seqio's ByteVocabulary,
ids 0/1/2, byte b -> b + 3) plus one bos id at the end (259), so a stream can mark
document starts as LongLLaMA does. Anything else is a path to a SentencePiece
`.model` file (e.g. OpenLLaMA's `tokenizer.model`, or one written by
`python -m data_pipelines.train_tokenizer`).
"""
from __future__ import annotations

import os
from typing import Optional

import seqio


class ByteVocab(seqio.ByteVocabulary):
  """seqio's byte vocabulary with a bos id (its one extra id, 259); vocab_size 260."""

  def __init__(self):
    super().__init__(extra_ids=1)

  @property
  def bos_id(self) -> Optional[int]:
    return self._base_vocab_size


def get_vocabulary(spec: str) -> seqio.Vocabulary:
  """'byte', 'dictionary_lookup' (token ids as they are) or a SentencePiece model path -> a seqio vocabulary with bos/eos/pad ids."""
  if spec == "byte":
    return ByteVocab()
  if spec == "dictionary_lookup":  # the synthetic task's own ids (data_pipelines.dictionary_lookup)
    from data_pipelines.dictionary_lookup import DictionaryTask
    return TokenVocab(DictionaryTask().vocab_size)
  path = os.path.expanduser(str(spec))
  if not os.path.isfile(path):
    raise ValueError(f"data.vocab: {spec!r} is neither 'byte' nor an existing SentencePiece model file; "
                     f"train one with `python -m data_pipelines.train_tokenizer --task=NAME --output=PATH`")
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


def check_fits(vocab_size: int, embedding_size: int) -> None:
  """A vocabulary must fit the model's embedding table; fail before training, naming both sizes."""
  if vocab_size > embedding_size:
    raise ValueError(f"data.vocab has {vocab_size} tokens but the model's embedding has "
                     f"model.vocab_size={embedding_size} rows; set model.overrides.vocab_size >= "
                     f"{vocab_size} or use a smaller vocabulary")


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
