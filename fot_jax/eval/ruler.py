"""RULER-style synthetic long-context tasks (Hsieh et al. 2024), scored on greedy generation.

Tasks (every prompt built from nothing downloaded, seeded, fitted to about `length` tokens of
the vocabulary, ending in an answer prefix so that a base model continues with the values):

* niah_noise: one needle in the passkey filler noise;
* niah_essay: one needle in English-like text from a small seeded grammar;
* multikey: the haystack is all needles of the same template with other (distinct) keys;
* multivalue: one key, several values in separate needles; all must be produced;
* multiquery: several keys asked at once; all their values must be produced;
* vt: variable tracking, chains `VAR A = 12345` .. `VAR B = VAR A` (and a distractor chain);
  the answer is every variable of the asked chain;
* fwe: frequent-word extraction from coded words drawn from a Zipf law; the answer is the 3
  most frequent.

Needle templates (RULER's own wording and two of ours) and key kinds (adjective-noun words,
5-digit numbers, 8-4-4 hex ids) are drawn per prompt; values have 6-7 digits. None of this
wording is used by a training task (EVAL_TEMPLATES holds its fixed phrases for that check).

Scoring (RULER's string match): a prompt scores the fraction of expected values found in the
greedy continuation, each as a whole string (case-insensitive; '12345' does not count inside
'912345'). A task's accuracy at a length is the mean over trials; the effective length is the
longest length whose score, and every shorter length's, meets `threshold` (0.856: RULER's
Llama-2-7B score at 4K).

`generate` is any callable (prompts: list of str, max_new_tokens) -> continuations (list of
str), called with `batch` prompts at most: `Generator` runs a model through
`MemoryInference.generate` (KV cache + memory); tests pass stubs.

Each batch's prompts are recorded as soon as they are scored (retrieval.PromptRecords: expected
values, the continuation, its score), and a run started again after a kill generates only the
prompts not recorded.
"""
from __future__ import annotations

import re
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from data_pipelines.passkey import FILLER
from fot_jax.eval.effective_length import effective_length
from fot_jax.eval.retrieval import PromptRecords, ids_hash

TASKS = ("niah_noise", "niah_essay", "multikey", "multivalue", "multiquery", "vt", "fwe")
THRESHOLD = 0.856
N_VALUES = 4  # multivalue: values of the key; multiquery: keys asked
VT_NAMES, VT_CHAINS = 4, 2  # names per chain; chains (the first is asked, the others distract)
FWE_TOP = 3

# (needle, question, answer prefix); {keys} is one key or "k1, k2, k3 and k4".
NEEDLE_TEMPLATES = (
    ("One of the special magic numbers for {key} is: {value}.",
     "What are all the special magic numbers for {keys} mentioned in the provided text?",
     "Answer: The special magic numbers for {keys} mentioned in the provided text are"),
    ("Keep in mind that one hidden code of {key} is {value}.",
     "Which hidden codes of {keys} appear in the text above?",
     "Answer: The hidden codes of {keys} in the text above are"),
    ("Among other things, the lucky number of {key} is {value}.",
     "What are the lucky numbers of {keys} in the text above?",
     "Answer: The lucky numbers of {keys} are"),
)
NIAH_INTRO = ("Some special numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n")
VT_INTRO = "Memorize and track the chains of variable assignments hidden in the following text.\n"
VT_FIRST, VT_HOP = "VAR {name} = {value}.", "VAR {name} = VAR {prev}."
VT_QUESTION = "Question: Find all variables that hold the value {value} in the text above."
VT_ANSWER = "Answer: The variables that hold the value {value} are:"
FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. "
             "Find the three most frequent coded words.\n")
FWE_QUESTION = "Question: What are the three most frequent coded words in the text above?"
FWE_ANSWER = "Answer: The three most frequent coded words are:"


def _phrases(templates: Sequence[str], min_chars: int = 12) -> Tuple[str, ...]:
  """The fixed text between the {placeholders}, long enough to be distinctive."""
  out = []
  for t in templates:
    out += [p.strip() for p in re.split(r"\{[a-z]+\}", t) if len(p.strip()) >= min_chars]
  return tuple(dict.fromkeys(out))


# The fixed phrases of every task's templates: no training document may contain one.
EVAL_TEMPLATES = _phrases([s for t in NEEDLE_TEMPLATES for s in t] + [
    NIAH_INTRO, VT_INTRO, VT_FIRST, VT_HOP, VT_QUESTION, VT_ANSWER, FWE_INTRO, FWE_QUESTION, FWE_ANSWER])

KEY_ADJ = ("amber", "bold", "brisk", "calm", "clever", "crimson", "dusty", "eager", "faint", "fierce", "gentle",
           "gloomy", "golden", "hollow", "humble", "icy", "jolly", "keen", "lively", "lonely", "mellow", "misty",
           "noble", "odd", "pale", "proud", "quiet", "rapid", "rusty", "shy", "silent", "silver", "sleepy",
           "smooth", "steady", "stormy", "sturdy", "sunny", "tame", "tender", "tidy", "vivid", "wary", "wicked",
           "wild", "witty", "young", "zealous", "ashen", "breezy", "chilly", "dainty", "fancy", "fuzzy", "glossy",
           "hasty", "jagged", "lucky", "murky", "nimble", "plucky", "rugged", "snowy", "thorny")
KEY_NOUN = ("anchor", "badger", "barrel", "beacon", "bishop", "blanket", "bucket", "cactus", "canyon", "carpet",
            "castle", "cherry", "compass", "cottage", "dolphin", "engine", "falcon", "fiddle", "garden", "glacier",
            "hammer", "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern", "magnet", "meadow",
            "mirror", "monkey", "needle", "orchard", "otter", "parrot", "pebble", "pillow", "rabbit", "saddle",
            "shovel", "spider", "tunnel", "turtle", "violin", "wagon", "walrus", "window", "acorn", "biscuit",
            "candle", "donkey", "feather", "goblet", "hornet", "igloo", "jigsaw", "lemon", "mitten", "noodle",
            "oyster", "puppet", "rocket", "thimble")

# The essay grammar's words (no digits, so the needles' numbers are the only numbers).
_DET = ("the", "a", "every", "one", "that")
_ADJ = ("old", "small", "bright", "narrow", "distant", "careful", "patient", "strange", "simple", "broken",
        "early", "heavy", "busy", "warm", "open", "quiet", "modern", "ancient", "common", "rare")
_NOUN = ("river", "teacher", "village", "machine", "letter", "garden", "student", "market", "bridge", "idea",
         "painter", "forest", "road", "question", "city", "farmer", "story", "window", "engineer", "song",
         "company", "friend", "problem", "season", "language", "voice", "map", "island", "factory", "lesson")
_VERB = ("found", "crossed", "changed", "followed", "built", "watched", "described", "opened", "carried",
         "remembered", "explained", "visited", "ignored", "repaired", "admired", "answered", "noticed")
_PREP = ("near", "behind", "beyond", "across", "under", "beside", "through", "around", "after", "before")
_ADV = ("slowly", "quickly", "often", "rarely", "quietly", "eventually", "suddenly", "always", "carefully")
_CONJ = ("and", "but", "so", "while", "because")
_OPEN = ("In the morning", "Years later", "At first", "Without warning", "For a long time", "In the end",
         "Meanwhile", "Later that year", "Even so", "Once again")


def _noun_phrase(rng, plural=False) -> str:
  """A noun phrase: determiner, maybe an adjective, a noun."""
  adj = f"{rng.choice(_ADJ)} " if rng.random() < 0.6 else ""
  if plural:
    return f"{rng.choice(('the', 'many', 'some', 'few'))} {adj}{rng.choice(_NOUN)}s"
  return f"{rng.choice(_DET)} {adj}{rng.choice(_NOUN)}"


def _clause(rng) -> str:
  c = f"{_noun_phrase(rng, rng.random() < 0.3)} {rng.choice(_VERB)} {_noun_phrase(rng)}"
  if rng.random() < 0.5:
    c += f" {rng.choice(_PREP)} {_noun_phrase(rng)}"
  if rng.random() < 0.3:
    c += f" {rng.choice(_ADV)}"
  return c


def essay_sentence(rng: np.random.Generator) -> str:
  """One sentence of the essay haystack (a unit ending in its separator); paragraphs now and then."""
  form = rng.random()
  if form < 0.4:
    s = _clause(rng)
  elif form < 0.7:
    s = f"{rng.choice(_OPEN)}, {_clause(rng)}"
  else:
    s = f"{_clause(rng)}, {rng.choice(_CONJ)} {_clause(rng)}"
  return s[0].upper() + s[1:] + "." + ("\n\n" if rng.random() < 0.15 else " ")


def noise_unit(rng: np.random.Generator) -> str:
  return FILLER


class _Draw:
  """Distinct keys and values of one prompt (no value may appear twice in a haystack)."""

  def __init__(self, rng: np.random.Generator, kind: str):
    self.rng, self.kind, self.used = rng, kind, set()

  def _distinct(self, make, space: int, what: str) -> str:
    if len(self.used) >= space:
      raise ValueError(f"ruler: out of distinct {what} ({space}); lower the length")
    while (x := make()) in self.used:
      pass
    self.used.add(x)
    return x

  def key(self) -> str:
    r = self.rng
    if self.kind == "word":
      return self._distinct(lambda: f"{r.choice(KEY_ADJ)}-{r.choice(KEY_NOUN)}", len(KEY_ADJ) * len(KEY_NOUN),
                            "word keys")
    if self.kind == "number":
      return self._distinct(lambda: str(r.integers(10000, 100000)), 90000, "number keys")
    return self._distinct(lambda: "-".join(f"{int(r.integers(16 ** n)):0{n}x}" for n in (8, 4, 4)), 2 ** 63, "ids")

  def value(self) -> str:  # 6 or 7 digits
    return self._distinct(lambda: str(self.rng.integers(100000, 10000000)), 9_900_000, "values")


def _join(items: Sequence[str]) -> str:
  return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _take(vocab, budget: int, next_unit: Callable[[], str]) -> List[str]:
  """Haystack units whose joined text comes to about `budget` tokens. Units are counted one
  by one (memoised: filler repeats); the joined text is then measured once and the units cut
  or extended by that ratio, since tokens can merge across unit boundaries."""
  memo: Dict[str, int] = {}
  units: List[str] = []
  total = 0

  def cost(u):
    if u not in memo:
      memo[u] = max(1, len(vocab.encode(u)))
    return memo[u]

  def grow(limit):
    nonlocal total
    while total < limit:
      u = next_unit()
      units.append(u)
      total += cost(u)

  grow(budget)
  if units:
    ratio = len(vocab.encode("".join(units))) / total  # joined tokens per counted token
    limit = budget / ratio
    grow(limit)
    while units and total - limit > cost(units[-1]) / 2:  # the nearest count: the last unit stays
      total -= cost(units.pop())                          # when it crosses by less than half of it
  return units


def _place(units: List[str], needles: Sequence[str], rng: np.random.Generator) -> str:
  """Needles between haystack units at seeded positions, in the order given."""
  at = np.sort(rng.integers(0, len(units) + 1, len(needles)))
  out, prev = [], 0
  for pos, needle in zip(at, needles):
    out += units[prev:pos] + [needle]
    prev = pos
  return "".join(out + units[prev:]).rstrip()


def _fixed(vocab, length: int, text: str) -> int:
  """Tokens of a prompt's fixed part (intro, needles, question), which must fit the length."""
  n = len(vocab.encode(text)) + 1
  if n > length:
    raise ValueError(f"ruler: a prompt's needles and question take {n} tokens, more than the length {length}; "
                     f"use longer lengths")
  return n


def _fit(vocab, length: int, intro: str, needles: Sequence[str], tail: str, next_unit, rng) -> str:
  """intro + haystack with the needles + "\\n" + tail, about `length` tokens with bos."""
  fixed = _fixed(vocab, length, intro + "".join(needles) + "\n" + tail)
  units = _take(vocab, length - fixed, next_unit)
  return intro + _place(units, needles, rng) + "\n" + tail


def _niah(vocab, length, rng, haystack: str, n_keys: int = 1, n_values: int = 1) -> Tuple[str, List[str]]:
  """The NIAH family: n_keys asked keys with n_values needles each; multikey's haystack is
  needles of other keys, the others' is noise or essay text."""
  needle, question, answer = NEEDLE_TEMPLATES[int(rng.integers(len(NEEDLE_TEMPLATES)))]
  draw = _Draw(rng, ("word", "number", "uuid")[int(rng.integers(3))])
  keys = [draw.key() for _ in range(n_keys)]
  pairs = [(k, draw.value()) for k in keys for _ in range(n_values)]
  needles = [needle.format(key=k, value=v) + ("\n" if haystack != "essay" else " ") for k, v in pairs]
  needles = [needles[i] for i in rng.permutation(len(needles))]
  unit = {"noise": lambda: noise_unit(rng), "essay": lambda: essay_sentence(rng),
          "needles": lambda: needle.format(key=draw.key(), value=draw.value()) + "\n"}[haystack]
  tail = f"{question.format(keys=_join(keys))} {answer.format(keys=_join(keys))}"
  return _fit(vocab, length, NIAH_INTRO, needles, tail, unit, rng), [v for _, v in pairs]


def _name(rng, used) -> str:
  while (n := "".join(chr(65 + int(c)) for c in rng.integers(0, 26, 5))) in used:
    pass
  used.add(n)
  return n


def _vt(vocab, length, rng) -> Tuple[str, List[str]]:
  used = set()
  values = [str(v) for v in rng.choice(np.arange(10000, 100000), VT_CHAINS, replace=False)]
  chains = [[_name(rng, used) for _ in range(VT_NAMES)] for _ in range(VT_CHAINS)]
  # the chains interleave at random, each in its own order (a variable is defined before use)
  order = rng.permutation(np.repeat(np.arange(VT_CHAINS), VT_NAMES))
  step = [0] * VT_CHAINS
  needles = []
  for c in order:
    i, names = step[c], chains[c]
    needles.append((VT_FIRST.format(name=names[0], value=values[c]) if i == 0 else
                    VT_HOP.format(name=names[i], prev=names[i - 1])) + "\n")
    step[c] += 1
  tail = f"{VT_QUESTION.format(value=values[0])} {VT_ANSWER.format(value=values[0])}"
  return _fit(vocab, length, VT_INTRO, needles, tail, lambda: noise_unit(rng), rng), chains[0]


def _coded_words(rng, n: int) -> List[str]:
  """n distinct pronounceable nonsense words (consonant-vowel syllables)."""
  out = set()
  while len(out) < n:
    out.add("".join(rng.choice(list("bdfgklmnprstvz")) + rng.choice(list("aeiou"))
                    for _ in range(int(rng.integers(2, 4)))))
  return sorted(out)


def _fwe(vocab, length, rng) -> Tuple[str, List[str]]:
  words = _coded_words(rng, 200)
  words = [words[i] for i in rng.permutation(len(words))]  # rank -> word
  p = 1.0 / np.arange(1, len(words) + 1) ** 1.5  # Zipf-like
  p /= p.sum()
  tail = f"{FWE_QUESTION} {FWE_ANSWER}"
  fixed = _fixed(vocab, length, FWE_INTRO + "\n" + tail)
  text = _take(vocab, length - fixed, lambda: words[int(rng.choice(len(words), p=p))] + " ")
  counts = {w: 0 for w in words}
  for w in text:
    counts[w.strip()] += 1
  top = sorted(words, key=lambda w: -counts[w])[:FWE_TOP + 1]
  # the answer must be unambiguous: the 3rd most frequent word strictly above the 4th
  while len(text) > FWE_TOP and counts[top[FWE_TOP - 1]] <= counts[top[FWE_TOP]]:
    i = int(rng.integers(len(text)))
    if text[i].strip() not in top[:FWE_TOP]:
      counts[text[i].strip()] -= 1
      counts[top[FWE_TOP - 1]] += 1
      text[i] = top[FWE_TOP - 1] + " "
      top = sorted(words, key=lambda w: -counts[w])[:FWE_TOP + 1]
  return FWE_INTRO + "".join(text).rstrip() + "\n" + tail, top[:FWE_TOP]


def make_task(task: str, vocab) -> Callable[[int, np.random.Generator], Tuple[str, List[str]]]:
  """-> make(length_tokens, rng) -> (prompt text, expected values)."""
  makers = {
      "niah_noise": lambda n, r: _niah(vocab, n, r, "noise"),
      "niah_essay": lambda n, r: _niah(vocab, n, r, "essay"),
      "multikey": lambda n, r: _niah(vocab, n, r, "needles"),
      "multivalue": lambda n, r: _niah(vocab, n, r, "essay", n_values=N_VALUES),
      "multiquery": lambda n, r: _niah(vocab, n, r, "essay", n_keys=N_VALUES),
      "vt": lambda n, r: _vt(vocab, n, r),
      "fwe": lambda n, r: _fwe(vocab, n, r),
  }
  if task not in makers:
    raise ValueError(f"ruler: unknown task {task!r}; known: {', '.join(TASKS)}")
  return makers[task]


def score_output(output: str, expected: Sequence[str]) -> float:
  """Fraction of expected values found in the output as whole strings (case-insensitive):
  a value must not touch a letter or digit, so '12345' does not count inside '912345'."""
  if not expected:
    raise ValueError("ruler: no expected values to score")
  found = [re.search(rf"(?<![0-9a-z]){re.escape(v.lower())}(?![0-9a-z])", output.lower()) is not None
           for v in expected]
  return sum(found) / len(expected)


class Generator:
  """prompts (text) -> greedy continuations (text) through MemoryInference.generate: each
  prompt is bos + its tokens, processed window by window with memory, batch at a time."""

  def __init__(self, inference, vocab, batch: int = 8):
    self.inference, self.vocab, self.batch = inference, vocab, max(1, int(batch))

  def __call__(self, prompts: Sequence[str], max_new_tokens: int) -> List[str]:
    rows = [np.asarray([int(self.vocab.bos_id)] + list(self.vocab.encode(p)), np.int32) for p in prompts]
    out = []
    for s in range(0, len(rows), self.batch):
      group = rows[s:s + self.batch]
      done = self.inference.generate(group, max_new_tokens)  # greedy; a list in, a list out
      out += [self.vocab.decode(d[len(r):].tolist()) for r, d in zip(group, done)]
    return out


def evaluate(generate, vocab, tasks: Sequence[str] = TASKS, lengths: Sequence[int] = (1024, 4096, 16384),
             trials: int = 4, seed: int = 0, threshold: float = THRESHOLD, batch: int = 8, name: str = "",
             tail_chars: int = 300, records: Optional[PromptRecords] = None) -> Dict:
  """Accuracy per task and length over `trials` seeded prompts each.

  generate: a callable (prompts, max_new_tokens) -> continuations, called with `batch` prompts
  at most, or a MemoryInference (run through `Generator`). Returns {'tasks': {task: {'lengths',
  'accuracy', 'tokens' (mean prompt tokens), 'effective_length'}}, 'lengths', 'average' (per
  length, mean over tasks), 'effective_length' (of the average), 'threshold', 'trials', 'seed',
  'samples' ({task: the first trial at each length: prompt tail, expected, output}), 'prompts'
  ({task: every prompt: length, trial, tokens, expected, output, score})}.
  records: prompts already recorded there are not generated again (a resumed evaluation); each
  batch is recorded as soon as it is scored.
  """
  batch = max(1, int(batch))
  if not callable(generate):
    generate = Generator(generate, vocab, batch)
  records = records if records is not None else PromptRecords()
  lengths = sorted(int(x) for x in lengths)
  makers = {t: make_task(t, vocab) for t in tasks}
  out: Dict = {"tasks": {}, "samples": {}, "prompts": {}}
  t0, n_cells = time.time(), len(tasks) * len(lengths)
  for ti, task in enumerate(tasks):
    acc, tokens, samples, listed = [], [], [], []
    for li, length in enumerate(lengths):
      rng = np.random.default_rng([seed, TASKS.index(task), length])  # same prompts whatever else runs
      prompts, expected = zip(*[makers[task](length, rng) for _ in range(trials)])
      ids = [[int(vocab.bos_id)] + list(vocab.encode(p)) for p in prompts]
      keys = [records.key(suite="ruler", task=task, length=length, trial=t, seed=int(seed), ids=ids_hash(i))
              for t, i in enumerate(ids)]
      done = {t: records.get(k) for t, k in enumerate(keys) if records.get(k) is not None}
      reused = len(done)
      new = max(len(vocab.encode(" " + ", ".join(e))) for e in expected) + 8  # the answer and some slack
      for s in range(0, trials, batch):
        group = [t for t in range(s, min(s + batch, trials)) if t not in done]
        if not group:
          continue
        if len(group) < min(batch, trials - s):  # a batch cut by a kill: run whole, as first formed
          group = list(range(s, min(s + batch, trials)))
        outputs = generate([prompts[t] for t in group], new)
        scored = [{"key": keys[t], "suite": "ruler", "task": task, "length": length, "trial": t, "seed": int(seed),
                   "tokens": len(ids[t]), "expected": list(expected[t]), "output": o,
                   "score": score_output(o, expected[t])} for t, o in zip(group, outputs)]
        records.add(scored)
        done.update(zip(group, scored))
      scores = [done[t]["score"] for t in range(trials)]
      acc.append(float(np.mean(scores)))
      tokens.append(float(np.mean([len(i) for i in ids])))
      samples.append({"length": length, "prompt_tail": prompts[0][-tail_chars:], "expected": list(expected[0]),
                      "output": done[0]["output"], "score": scores[0]})
      listed += [{k: done[t][k] for k in ("length", "trial", "tokens", "expected", "output", "score")}
                 for t in range(trials)]
      again = f", {reused} of {trials} prompts from {records.path}" if reused else ""
      print(f"[{name}] ruler {task}: length {length:>7,} ({tokens[-1]:,.0f} tokens): score {acc[-1]:.2f} "
            f"({ti * len(lengths) + li + 1}/{n_cells}, {time.time() - t0:.0f}s{again})", flush=True)
    out["tasks"][task] = {"lengths": lengths, "accuracy": acc, "tokens": tokens,
                          "effective_length": effective_length(lengths, acc, threshold)}
    out["samples"][task] = samples
    out["prompts"][task] = listed
  average = np.mean([r["accuracy"] for r in out["tasks"].values()], axis=0).tolist() if tasks else []
  out.update(lengths=lengths, average=average, threshold=float(threshold), trials=int(trials), seed=int(seed),
             effective_length=effective_length(lengths, average, threshold) if tasks else None)
  return out
