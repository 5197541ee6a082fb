"""Print the batches a run would get, so the pinning of documents to slots can be seen.

python -m data_pipelines.preview --task=stdlib --slots=4 --windows=2 --seq_len=64 --batches=2 [--json]

Text: per batch, one line per row (slot, window, document ids in the row, a decoded snippet).
JSON (--json): one object per batch with, per row, its slot, window, document ids per token
and the text. --split=validation shows a task's held-out documents (data_pipelines.tasks).

A bad input (an unknown task, a pattern matching nothing, a split the task lacks, a missing
vocabulary file) ends in one line `data_pipelines.preview: message` and exit status 2
(fot_jax.cli.expected_errors).
"""
from __future__ import annotations

import argparse
import json
import os

from fot_jax.cli import expected_errors

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def render(vocab, ids, tokens) -> str:
  """Row tokens -> text with <bos>/<eos>/<pad> marks (token ids as they are for token tasks)."""
  import seqio
  from data_pipelines import vocab as vocab_lib
  special = {v: f"<{k}>" for k, v in vocab_lib.special_ids(vocab).items()}
  if isinstance(vocab, seqio.PassThroughVocabulary):
    return " ".join(special.get(int(t), str(int(t))) for t in tokens)
  out, run = [], []
  for t in tokens:
    t = int(t)
    if t in special:
      if run:
        out.append(vocab.decode(run))
        run = []
      out.append(special[t])
    else:
      run.append(t)
  if run:
    out.append(vocab.decode(run))
  return "".join(out)


def preview(task, slots, windows, seq_len, batches, vocab="byte", split="train", seed=0, min_doc_len=1,
            as_json=False) -> str:
  from data_pipelines import pipeline, vocab as vocab_lib
  import seqio
  v = vocab_lib.get_vocabulary(vocab)
  batcher = pipeline.lm_batches(task, v, slots=slots, windows=windows, window=seq_len, split=split, seed=seed,
                                min_doc_len=min_doc_len, shard_info=seqio.ShardInfo(0, 1))
  batcher.check_nonempty()
  out = []
  for step in range(batches):
    b = batcher(step)
    rows = []
    for r in range(slots * windows):
      ids = b["doc_ids"][r]
      rows.append({"row": r, "slot": r // windows, "window": r % windows, "doc_ids": ids.tolist(),
                   "text": render(v, ids, b["inputs"][r])})
    if as_json:
      out.append(json.dumps({"batch": step, "rows": rows}))
      continue
    out.append(f"== batch {step}: [{slots * windows}, {seq_len}] ({slots} slots x {windows} windows)")
    for row in rows:
      docs = list(dict.fromkeys(d for d in row["doc_ids"] if d >= 0))
      snippet = row["text"][:70].encode("unicode_escape").decode("ascii")
      out.append(f"slot {row['slot']:>3} window {row['window']} docs {docs!s:<14} | {snippet}")
  if not as_json:
    out.append(f"-- {batcher.report()}; bad input: {batcher.bad_input().report()}")
  return "\n".join(out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--task", required=True, help="registered task/mixture, or tfds:NAME, files:GLOB, jsonl:GLOB")
  p.add_argument("--slots", type=int, default=4)
  p.add_argument("--windows", type=int, default=2, help="windows per slot (k)")
  p.add_argument("--seq_len", type=int, default=64, help="tokens per row (T)")
  p.add_argument("--batches", type=int, default=2)
  p.add_argument("--vocab", default="byte", help="'byte', 'dictionary_lookup' or a SentencePiece model path")
  p.add_argument("--split", default="train")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--min_doc_len", type=int, default=1)
  p.add_argument("--json", action="store_true", help="one JSON object per batch, doc_ids per row")
  a = p.parse_args(argv)
  with expected_errors("data_pipelines.preview"):
    print(preview(a.task, a.slots, a.windows, a.seq_len, a.batches, a.vocab, a.split, a.seed, a.min_doc_len,
                  a.json))


if __name__ == "__main__":
  main()
