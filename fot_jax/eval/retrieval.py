"""Retrieval prompts (passkey, needle in a haystack) and their scoring.

A prompt is text that ends in a question, plus the answer text. The model is scored
by teacher forcing: the answer counts when every answer token is the argmax of the
logits before it, which is exactly when greedy decoding would produce the answer (and
costs one pass instead of one per token). Prompts are processed window by window with
memory (`fot_jax.inference`), each prompt its own document.

`model` is anything with `logits(tokens [B, L] int32, mask [B, L] bool) -> [B, L, V]`:
`InferenceModel` for a real model; tests use stubs to check the scoring alone.

Evaluations resume prompt by prompt: `PromptRecords` keeps each scored prompt (its expected and
generated answer, right or not) in a JSON-lines file, written after every batch; a run killed
midway, started again, scores only the prompts that file does not hold (the RULER suite,
fot_jax/eval/ruler.py, keeps its records the same way).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from fot_jax.eval.effective_length import effective_length
from fot_jax.inference import end_aligned


class InferenceModel:
  """A real model through MemoryInference: fresh memory for every batch of prompts. Each
  prompt's windows are aligned at its end (`inference.end_aligned`, LongLLaMA's
  last_context_length = the window), so the question and answer keep a full window of local
  context, as `generate` gives them; `align_end=False` starts windows at token 0."""

  def __init__(self, inference, align_end: bool = True):
    self.inference, self.align_end = inference, align_end

  def logits(self, tokens, mask):
    inf = self.inference
    if not self.align_end:
      return inf.process(tokens, inf.new_memory(len(tokens)), mask)
    return np.stack([np.pad(x, [(0, tokens.shape[1] - len(x)), (0, 0)])
                     for x in self.answer_logits(tokens, mask, [1] * len(tokens))])

  def answer_logits(self, tokens, mask, starts) -> List[np.ndarray]:
    """Per row, the logits before each token from starts[r] on ([len - start + 1, V]): only the
    windows holding them keep logits."""
    inf = self.inference
    lens = np.asarray(mask).sum(1)  # prompts are left-aligned in `tokens` (score's layout)
    rows = [np.asarray(t[:n]) for t, n in zip(tokens, lens)]
    if self.align_end and inf.window:  # window 0: one window as wide as the input (study.PlainInference)
      placed, placed_mask, pads = end_aligned(rows, inf.window, inf.window)
    else:
      placed, placed_mask, pads = np.asarray(tokens), np.asarray(mask), np.zeros(len(rows), int)
    first = int(min(p + s - 1 for p, s in zip(pads, starts)))
    skip = first // inf.window * inf.window if inf.window else 0  # the column the kept logits start at
    out = inf.process(placed, inf.new_memory(len(rows)), placed_mask, logits_from=first)
    return [out[r, p + s - 1 - skip:p + n - skip] for r, (n, p, s) in enumerate(zip(lens, pads, starts))]


def encode(vocab, prompt: str, answer: str) -> Tuple[np.ndarray, int]:
  """-> (bos + prompt + answer ids, index of the first answer token). The whole text is
  encoded at once (as a user's prompt would be) when the prompt's own ids are a prefix of
  it; otherwise (a merge across the boundary) prompt and answer are encoded apart."""
  p = list(vocab.encode(prompt))
  full = list(vocab.encode(prompt + answer))
  a = full[len(p):] if full[:len(p)] == p else list(vocab.encode(answer))
  if not a:
    raise ValueError(f"retrieval: the answer {answer!r} encodes to no tokens")
  return np.asarray([int(vocab.bos_id)] + p + a, np.int32), len(p) + 1


def _batches(examples: Sequence[Tuple[np.ndarray, int]], batch: int) -> List[np.ndarray]:
  """Example indices in batches, similar lengths together (fixed by the examples alone, so a
  resumed run forms the batches an uninterrupted one does)."""
  order = np.argsort([len(ids) for ids, _ in examples], kind="stable")
  return [order[s:s + batch] for s in range(0, len(order), batch)]


def score_batches(model, examples: Sequence[Tuple[np.ndarray, int]], batch: int = 8,
                  skip: Optional[Callable[[np.ndarray], bool]] = None
                  ) -> Iterator[Tuple[np.ndarray, np.ndarray, List[np.ndarray]]]:
  """Scores batch by batch: yields (indices, hits [b] bool, predicted ids at each answer's
  positions). The predicted ids are the argmax at every answer position given the right answer
  tokens before it (teacher forcing): equal to greedy generation up to the first wrong token,
  after which greedy decoding would go on from its own token. skip(indices) -> True: the batch is
  not run (its prompts are already recorded)."""
  for idx in _batches(examples, batch):
    if skip is not None and skip(idx):
      continue
    width = max(len(examples[i][0]) for i in idx)
    toks = np.zeros((len(idx), width), np.int32)
    mask = np.zeros((len(idx), width), bool)
    for r, i in enumerate(idx):
      ids = examples[i][0]
      toks[r, :len(ids)], mask[r, :len(ids)] = ids, True
    if hasattr(model, "answer_logits"):  # only the answers' logits (a real model's are large)
      got = model.answer_logits(toks, mask, [examples[i][1] for i in idx])
    else:
      logits = model.logits(toks, mask)
      got = [logits[r, examples[i][1] - 1:] for r, i in enumerate(idx)]
    hits, preds = np.zeros(len(idx), bool), []
    for r, i in enumerate(idx):
      ids, start = examples[i]
      preds.append(np.argmax(got[r][:len(ids) - start], -1))
      hits[r] = bool(np.all(preds[-1] == ids[start:]))
    yield idx, hits, preds


def score(model, examples: Sequence[Tuple[np.ndarray, int]], batch: int = 8) -> np.ndarray:
  """examples: (ids, answer_start) -> bool [n]: every answer token predicted (argmax)."""
  hits = np.zeros(len(examples), bool)
  for idx, got, _ in score_batches(model, examples, batch):
    hits[idx] = got
  return hits


def ids_hash(ids) -> str:
  """A prompt's identity in PromptRecords: a hash of its token ids."""
  return hashlib.sha1(np.asarray(ids, np.int32).tobytes()).hexdigest()[:16]


class PromptRecords:
  """A suite's scored prompts, one JSON line each (W/eval/<suite>.prompts.jsonl): appended and
  fsynced after every scored batch and read back when the suite runs again, so a killed
  evaluation resumes where it stopped. A record is found by its identity (`key`): the suite, the
  prompt's place (length, depth index or task, trial), the seed, a hash of its token ids and
  `model_key` (the model and the inference settings: suite.Context.model_key); a prompt whose
  identity changed in anything is scored anew. path None keeps records in memory only."""

  def __init__(self, path: Optional[str] = None, model_key: str = ""):
    self.path, self.model_key, self.found = path, model_key, {}
    if not path or not os.path.exists(path):
      return
    with open(path, "rb") as f:
      data = f.read()
    if data and not data.endswith(b"\n"):  # a line cut by a kill: later records must not join it
      with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)
    for line in data.splitlines(keepends=True):
      try:
        record = json.loads(line) if line.endswith(b"\n") else None
      except ValueError:
        record = None
      if isinstance(record, dict) and "key" in record:
        self.found[record["key"]] = record

  def key(self, **identity) -> str:
    text = json.dumps({**identity, "model": self.model_key}, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()

  def get(self, key: str) -> Optional[dict]:
    return self.found.get(key)

  def add(self, records: Sequence[dict]) -> None:
    """records: dicts with their 'key'; on disk before this returns (fsync)."""
    for r in records:
      self.found[r["key"]] = r
    if self.path:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      with open(self.path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


PromptFn = Callable[[int, float, np.random.Generator], Tuple[str, str]]


def cell_rng(seed: int, length: int, depth_index: int) -> np.random.Generator:
  """The generator of a grid cell's prompts (`grid`; the memory readout rebuilds the same prompts)."""
  return np.random.default_rng([int(seed), int(length), int(depth_index)])


def grid(model, vocab, make_prompt: PromptFn, lengths: Sequence[int], depths: Sequence[float],
         trials: int, seed: int, batch: int = 8, threshold: float = 0.9, name: str = "",
         suite: str = "", records: Optional[PromptRecords] = None) -> Dict:
  """Accuracy per (length, depth) cell over `trials` seeded prompts each.

  make_prompt(target_tokens, depth in [0, 1], rng) -> (prompt text, answer text).
  Returns {'lengths', 'depths', 'accuracy' [len][depth], 'tokens' (mean prompt tokens per
  length), 'accuracy_per_length' (mean over depths), 'effective_length', 'threshold',
  'prompts' (each prompt: length, depth, trial, tokens, expected answer text, the model's
  answer text (argmax at the answer positions, teacher-forced: greedy generation up to the
  first wrong token), correct)}.
  records: prompts already recorded there are not scored again (a resumed evaluation); each
  newly scored batch is recorded as soon as it is scored.
  """
  records = records if records is not None else PromptRecords()
  acc = np.zeros((len(lengths), len(depths)))
  tokens, prompts = [], []
  t0 = time.time()
  for li, length in enumerate(lengths):
    examples, cells, trial, answers, keys = [], [], [], [], []
    for di, depth in enumerate(depths):
      rng = cell_rng(seed, length, di)
      for t in range(trials):
        prompt, answer = make_prompt(int(length), float(depth), rng)
        examples.append(encode(vocab, prompt, answer))
        cells.append(di)
        trial.append(t)
        answers.append(answer)
        keys.append(records.key(suite=suite, length=int(length), depth_index=di, trial=t, seed=int(seed),
                                ids=ids_hash(examples[-1][0])))
    done = {i: r for i, r in ((i, records.get(k)) for i, k in enumerate(keys)) if r is not None}
    reused = len(done)
    for idx, hits, preds in score_batches(model, examples, batch, skip=lambda idx: all(i in done for i in idx)):
      new = [{"key": keys[i], "suite": suite, "length": int(length), "depth": float(depths[cells[i]]),
              "depth_index": cells[i], "trial": trial[i], "seed": int(seed), "tokens": len(examples[i][0]),
              "expected": answers[i], "answer": vocab.decode([int(x) for x in p]), "correct": bool(h)}
             for i, h, p in zip(idx, hits, preds)]
      records.add(new)
      done.update(zip(idx, new))
    right = np.asarray([done[i]["correct"] for i in range(len(examples))])
    for di in range(len(depths)):
      acc[li, di] = right[np.asarray(cells) == di].mean()
    tokens.append(float(np.mean([len(ids) for ids, _ in examples])))
    prompts += [{k: done[i][k] for k in ("length", "depth", "trial", "tokens", "expected", "answer", "correct")}
                for i in range(len(examples))]
    again = f", {reused} of {len(examples)} prompts from {records.path}" if reused else ""
    print(f"[{name}] {suite}: length {int(length):>7,} ({tokens[-1]:,.0f} tokens): accuracy by depth "
          f"{' '.join(f'{a:.2f}' for a in acc[li])} ({li + 1}/{len(lengths)}, {time.time() - t0:.0f}s{again})",
          flush=True)
  per_length = acc.mean(axis=1)
  return {"lengths": [int(x) for x in lengths], "depths": [float(d) for d in depths],
          "accuracy": acc.tolist(), "tokens": tokens, "accuracy_per_length": per_length.tolist(),
          "trials": int(trials), "seed": int(seed), "threshold": threshold,
          "effective_length": effective_length(lengths, per_length, threshold), "prompts": prompts}


def fit_repeats(vocab, fixed: str, unit: str, target_tokens: int) -> int:
  """How many copies of `unit` bring bos + fixed + copies to about target_tokens."""
  n_unit = max(1, len(vocab.encode(unit)))
  return max(0, (target_tokens - 1 - len(vocab.encode(fixed))) // n_unit)


def insert_at_depth(text: str, needle: str, depth: float, boundary: Optional[str] = "\n") -> str:
  """Inserts `needle` at fraction `depth` of `text`, moved forward to just after the next
  `boundary` (a line break keeps the haystack's lines whole); depth 1 appends."""
  at = int(round(depth * len(text)))
  if boundary and 0 < at < len(text):
    nxt = text.find(boundary, at - 1)
    at = len(text) if nxt < 0 else nxt + len(boundary)
  return text[:at] + needle + text[at:]


def depth_list(values) -> List[float]:
  out = [float(v) for v in values]
  if any(not 0.0 <= v <= 1.0 for v in out):
    raise ValueError(f"depths must lie in [0, 1], got {out}")
  return out
