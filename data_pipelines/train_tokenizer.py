"""Train a SentencePiece model on a task's text.

python -m data_pipelines.train_tokenizer --task=stdlib --vocab_size=8000 --output=runs/spm/stdlib
  -> runs/spm/stdlib.model (use it as --config.data.vocab=runs/spm/stdlib.model)

Ids: pad 0, bos 1, eos 2, unk 3 (LLaMA's bos/eos ids); byte fallback on, so any text encodes;
no normalisation, so whitespace (code indentation) round-trips.
"""
from __future__ import annotations

import argparse
import os

from fot_jax.cli import expected_errors

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def task_lines(task: str, split: str = "train", max_docs: int = 0, max_line_bytes: int = 4000):
  """The task's documents as lines (SentencePiece trains on sentences; long lines are cut)."""
  from data_pipelines import tasks
  provider = tasks.get_provider(task)
  if tasks.TEXT not in provider.output_features:
    raise ValueError(f"train_tokenizer: task {task!r} holds token ids, not text")
  ds = provider.get_dataset(sequence_length=None, split=split, shuffle=False, num_epochs=1, use_cached=False,
                            try_in_mem_cache=False)
  for n, ex in enumerate(ds.as_numpy_iterator()):
    if max_docs and n >= max_docs:
      return
    for line in ex[tasks.TEXT].decode("utf-8", errors="replace").splitlines():
      if line.strip():
        yield line[:max_line_bytes]


def train_tokenizer(task: str, output: str, vocab_size: int, split: str = "train", max_docs: int = 0,
                    model_type: str = "bpe") -> str:
  import sentencepiece as spm
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  lines = task_lines(task, split, max_docs)
  first = next(lines, None)
  if first is None:
    raise ValueError(f"train_tokenizer: task {task!r} split {split!r} has no text")
  def all_lines():
    yield first
    yield from lines
  spm.SentencePieceTrainer.train(
      sentence_iterator=all_lines(), model_prefix=output, vocab_size=vocab_size, model_type=model_type,
      pad_id=0, bos_id=1, eos_id=2, unk_id=3, byte_fallback=True, character_coverage=1.0,
      # Code and prose keep their whitespace exactly (newlines fall back to byte pieces).
      normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
      split_digits=True,
      input_sentence_size=2_000_000, shuffle_input_sentence=True, hard_vocab_limit=False,
      minloglevel=2)
  return output + ".model"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--task", required=True)
  p.add_argument("--output", required=True, help="model prefix: writes PREFIX.model and PREFIX.vocab")
  p.add_argument("--vocab_size", type=int, default=8000)
  p.add_argument("--split", default="train")
  p.add_argument("--max_docs", type=int, default=0, help="0: all documents")
  p.add_argument("--model_type", default="bpe", choices=["bpe", "unigram"])
  a = p.parse_args(argv)
  with expected_errors("data_pipelines.train_tokenizer"):
    path = train_tokenizer(a.task, a.output, a.vocab_size, a.split, a.max_docs, a.model_type)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
