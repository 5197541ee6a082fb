"""Retrieval training documents for pretrained models: facts stated under keys, asked for
windows later, among filler and other facts (the `c.data.retrieval` curriculum tasks).

A batch gives each retrieval slot `windows` windows of `window` tokens filled exactly with
documents of `doc_windows` windows each (bos, haystack with facts, then a block of questions
whose answers are the facts' values). Only the answer values are scored (and counted by the
`accuracy` metric), so every scored token has to be read back from a fact, most of them from a
window the question no longer sees (memory: crossbatch positives in training).

What the model may learn from, and what it must not (docs/retrieval.md):
* Keys are distinct across the whole batch: another slot's document (a crossbatch negative)
  never states a fact under a key of this slot's documents, so a negative never contradicts
  the positive; it only distracts.
* Several statement templates and question forms per fact, some questions paraphrasing the
  statement (the answer has to be found by its key, not by repeating the sentence).
* Haystacks: a short cycle of sentences repeated (near-identical distractors, as passkey
  filler is), varied generated prose, real text of another task (`haystack_task`: consecutive
  sentences of one document), or other facts under other keys (the multi-key case).
  Hard negatives: `near_keys` of those other keys share a part with an asked key (its adjective
  or noun, first or last name, leading digits), so a fact is found by its whole key; and with
  `shared_shape` a step's documents all state their facts in one template, kind and key kind,
  so the crossbatch negatives (other slots' windows) are look-alike facts too, never the same
  key (the multi-key case at the scale of memory, not only of one document).
* Words after the question's words (`mentions`, `plain_questions`): sentences that name an asked key
  and its kind and go on with a word, never a value ("The {kind} of {key} is kept somewhere in
  these notes."), and questions asked as a plain sentence ending in "is" ("The {kind} of {key}
  is"), so that copying what followed the question's words in memory is wrong unless it is the
  stated value (a passkey's first line "...the important information there." is what a tuned
  model copied instead of the key: docs/retrieval.md).
* Document kinds (`doc_kinds`): 'lookup' asks a key for its value; 'chain' states a value for
  one key and passes it from key to key, and asks the value for every key of its chain; 'tally'
  lists entries of which a few recur, and asks for the most frequent ones in order. The last two
  gather an answer from several windows of memory (what RULER's variable tracking and common-word
  tasks ask), in their own templates.
* No evaluation template: the phrases of `fot_jax.eval` prompts (passkey, NIAH, the RULER-style
  suite) never occur here (tests/test_retrieval_docs.py checks generated documents).
* A `text_slots` share of the slots is natural text from an LM task (the slot batcher, resumable),
  scored on its last `text_scored_windows` windows, so the language is kept (every window: also
  the first ones, read with no memory, which a document's first window at inference is).

Batch n is a pure function of (seed, n) for the retrieval slots; the text slots' state is the
slot batcher's.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
              "keen", "lunar", "mellow", "narrow", "olive", "plain", "quiet", "rapid", "silver", "tidy",
              "upper", "vivid", "woven", "young", "zesty", "bold", "crisp", "dense", "early", "fuzzy",
              "grand", "humble", "ivory", "jagged", "kind", "lofty", "misty", "noble", "odd", "proud")
NOUNS = ("falcon", "harbor", "lantern", "meadow", "orchid", "pebble", "quarry", "ribbon", "saddle", "tunnel",
         "violin", "walnut", "anchor", "beacon", "canyon", "dolphin", "ember", "fjord", "glacier", "hazel",
         "island", "jasmine", "kettle", "lagoon", "magnet", "nectar", "otter", "parrot", "quill", "raven",
         "summit", "thistle", "umbra", "velvet", "willow", "yarrow", "zephyr", "badger", "cobalt", "domino")
FIRST_NAMES = ("Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
               "Keiko", "Lars", "Mira", "Nikolai", "Olga", "Pablo", "Quinn", "Rosa", "Stefan", "Tala")
LAST_NAMES = ("Abbott", "Bianchi", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Horvat", "Ito", "Jensen",
              "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Sato", "Torres", "Weber")
KINDS = ("access code", "badge number", "room number", "order number", "account id", "tracking number",
         "seat number", "batch id", "voucher code", "shelf number")
KEY_KINDS = ("word", "name", "number", "hex")
# 'code': five capital letters (an id); drawn by the chain documents only, so the lookup documents
# (and every recipe measured before it) keep their key kinds
CHAIN_KEY_KINDS = KEY_KINDS + ("code",)

# (statement, questions): {key}, {kind}, {value}. A question ends where the value follows.
TEMPLATES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Note: {key} has the {kind} {value}.",
     ("Which {kind} does {key} have? {key} has the {kind}", "{key}: {kind}?")),
    ("Remember that the {kind} of {key} equals {value}.",
     ("What does the {kind} of {key} equal? It equals", "Q: the {kind} of {key}? A:")),
    ("{key}'s {kind} was set to {value} today.",
     ("To what was {key}'s {kind} set? It was set to", "Give the {kind} of {key}:")),
    ("In the records, {key} is listed with {kind} {value}.",
     ("How is {key} listed? {key} is listed with {kind}", "{kind} listed for {key} =")),
    ("The {kind} assigned to {key} reads {value}.",
     ("What does the {kind} assigned to {key} read? It reads", "Look up {key}. Its {kind}:")),
    ("Write down {value} as the {kind} for {key}.",
     ("What was written down as the {kind} for {key}? Written down:", "{key} -> {kind}:")),
    ("Fact: {kind}({key}) = {value}.",
     ("Fact: {kind}({key}) =", "Query {kind} for {key}. Result:")),
    ("Record: {key} | {kind} | {value}.",
     ("Record: {key} | {kind} |", "Find the record of {key}; its {kind} is")),
)

# Filler: short sentences; a 'repeat' haystack cycles a few of them (many near-identical
# "X is Y" sentences around the facts), a 'prose' haystack draws sentences from the grammar.
FILLER_SENTENCES = ("The river is wide.", "The hills are quiet.", "A cart rolls by.", "The bread is warm.",
                    "Rain falls on the roof.", "The lamp is lit.", "Two boats drift south.", "The door is open.",
                    "A dog sleeps in the sun.", "The tea is hot.", "Snow covers the field.", "The bell is loud.")
SUBJECTS = ("the old miller", "a tired courier", "the council", "my neighbour", "the harbour master",
            "a young painter", "the night guard", "our teacher", "the baker", "a travelling merchant")
VERBS = ("walked to", "wrote about", "looked at", "talked about", "repaired", "visited", "described",
         "painted", "forgot about", "cleaned")
OBJECTS = ("the stone bridge", "a broken wheel", "the northern road", "an empty barn", "the village well",
           "a letter from home", "the market square", "a wooden chest", "the west tower", "the orchard")
ENDINGS = ("before noon", "in the evening", "after the storm", "with great care", "once again",
           "without a word", "for an hour", "during the festival", "at first light", "last winter")
HAYSTACKS = ("repeat", "prose", "facts", "text")
# Document kinds: 'lookup' (facts under keys, asked by key: the value), 'chain' (a value stated for
# one key and passed on from key to key: asked by the value, every key of the chain) and 'tally'
# (a list in which a few entries recur: asked for the most frequent ones, most first). The two
# last ones ask for what no single fact holds: a list gathered from several windows of memory.
MEMORY_HAYSTACKS = ("repeat", "prose", "text")  # a memory haystack's kinds: no facts
DOC_KINDS = ("lookup", "chain", "tally")
# chain: {key} gets the kind of {other}; questions end where " k0, k1, ..." follows
ALIAS_TEMPLATES = ("{key} takes the {kind} of {other}.", "Copy the {kind} of {other} to {key}.",
                   "{key} := {other};", "Let {key} have the same {kind} as {other}.",
                   "{key} shares its {kind} with {other}.", "set {key} = {other}")
CHAIN_QUESTIONS = ("Which keys end up with the {kind} {value}? They are:", "Every key whose {kind} is {value}:",
                   "{value} is the {kind} of:", "Q: all keys holding {value}? A:",
                   "Trace {value} through the assignments. Keys:")
# tally: one entry per list item; questions end where " w1, w2, ..." follows (most frequent first)
TALLY_ENTRIES = ("{i}. {w}", "#{i} {w}", "({i}) {w}", "{w};", "- {w}")
TALLY_QUESTIONS = ("Which {n} entries occur most often in the list above, most frequent first?",
                   "The {n} most repeated entries above:", "Top {n} entries by count:",
                   "Count the entries above; the {n} commonest are")
# tally words without a 'text' haystack: the key words
TALLY_WORDS = tuple(sorted(set(ADJECTIVES + NOUNS)))
# Mentions (`mentions`): sentences that name an asked key and its kind, as its question does, and
# go on with words, never a value. After "...the pass key is" a model that copies what followed the
# question's words anywhere in memory writes a word; with mentions in the haystack the only
# continuation that answers is the fact's value. A mention never states a value, so it never
# contradicts the fact.
# Plain questions (`plain_questions`): a sentence that stops where the value goes on, ending in
# "is" as most English statements of a value do, where the haystack's "X is Y." sentences and the
# mentions go on with a word. The template's own forms mostly end in a verb or a colon.
PLAIN_QUESTIONS = ("The {kind} of {key} is", "{key}'s {kind} is", "As noted above, the {kind} for {key} is",
                   "The {kind} that {key} has is", "For {key}, the {kind} is")
MENTIONS = ("The {kind} of {key} is kept somewhere in these notes.", "Nobody remembers the {kind} of {key} offhand.",
            "{key} asked twice about its {kind} yesterday.", "Ask the front desk about the {kind} of {key} first.",
            "The {kind} for {key} is printed on a card there.", "{key} moved desks, and its {kind} went along.",
            "We talked about {key} and the {kind} it has.", "Is the {kind} of {key} still the same? Probably so.")
# with plain questions, mentions in their words too (the plain forms' openings, then a word)
PLAIN_MENTIONS = ("{key}'s {kind} is easy to find.", "For {key}, the {kind} is on file.",
                  "The {kind} that {key} has is short.")
# A 'text' haystack is real text (the view's `haystack_task`), cut into sentence-like units: a run
# of consecutive units from one document, so the facts sit in prose the model did not see made.
_UNIT_SPLIT = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
_WORD = re.compile(r"[A-Za-z]{2,}")


def text_units(texts: Sequence[str], min_words: int = 4, max_chars: int = 400) -> List[List[str]]:
  """Each document's sentence-like units (split at sentence ends and blank lines, whitespace
  folded), keeping units of at least `min_words` words (headers, code and tables mostly go) cut to
  `max_chars`; documents with fewer than 8 units are dropped."""
  out = []
  for text in texts:
    units = [" ".join(u.split())[:max_chars] for u in _UNIT_SPLIT.split(text)]
    units = [u for u in units if len(_WORD.findall(u)) >= min_words]
    if len(units) >= 8:
      out.append(units)
  return out


def make_key(kind: str, rng: np.random.Generator) -> str:
  if kind == "word":
    return f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"
  if kind == "name":
    initial = chr(ord("A") + int(rng.integers(26)))
    return f"{FIRST_NAMES[rng.integers(len(FIRST_NAMES))]} {initial}. {LAST_NAMES[rng.integers(len(LAST_NAMES))]}"
  if kind == "number":
    return f"unit {int(rng.integers(1000, 10000))}"
  if kind == "hex":
    return "".join(rng.choice(list("0123456789abcdef"), 8))
  if kind == "code":
    return "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5))
  raise ValueError(f"retrieval: unknown key kind {kind!r}; known: {CHAIN_KEY_KINDS}")


def make_similar_key(key: str, kind: str, rng: np.random.Generator) -> str:
  """A key of the same kind sharing a visible part with `key`: a hard negative that only the
  whole key tells apart (word: the adjective or the noun; name: the first or last name; number:
  the first two digits; hex: the first four characters)."""
  if kind == "word":
    adj, noun = key.split("-")
    keep_adj = rng.random() < 0.5
    other = make_key("word", rng).split("-")
    return f"{adj}-{other[1]}" if keep_adj else f"{other[0]}-{noun}"
  if kind == "name":
    first, initial, last = key.split(" ")
    new_first, new_initial, new_last = make_key("name", rng).split(" ")
    return (f"{first} {new_initial} {new_last}" if rng.random() < 0.5 else f"{new_first} {new_initial} {last}")
  if kind == "number":
    return f"unit {key[5:7]}{int(rng.integers(100)):02d}"
  if kind == "hex":
    return key[:4] + "".join(rng.choice(list("0123456789abcdef"), 4))
  if kind == "code":
    return key[:2] + "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 3))
  raise ValueError(f"retrieval: unknown key kind {kind!r}; known: {CHAIN_KEY_KINDS}")


def make_value(rng: np.random.Generator) -> str:
  return str(int(rng.integers(10 ** int(rng.integers(4, 7)), 10 ** 7)))  # 5 to 7 digits


class KeyPool:
  """Keys drawn without repetition for one batch: no two documents of a batch share a key."""

  def __init__(self, rng: np.random.Generator):
    self.rng, self.used = rng, set()

  def draw(self, kind: str, like: Optional[str] = None) -> str:
    """A fresh key; `like`: one sharing a part with that key (make_similar_key), else any."""
    for attempt in range(1000):
      near = like is not None and attempt < 50  # a near key's space can be small: then any key
      key = make_similar_key(like, kind, self.rng) if near else make_key(kind, self.rng)
      if key not in self.used:
        self.used.add(key)
        return key
    raise ValueError(f"retrieval: the {kind!r} key space is exhausted for one batch; use fewer facts")


def prose_sentence(rng: np.random.Generator) -> str:
  parts = [SUBJECTS[rng.integers(len(SUBJECTS))], VERBS[rng.integers(len(VERBS))],
           OBJECTS[rng.integers(len(OBJECTS))], ENDINGS[rng.integers(len(ENDINGS))]]
  return parts[0][0].upper() + " ".join(parts)[1:] + "."


@dataclasses.dataclass
class RetrievalSpec:
  """One curriculum task's documents. facts/queries: (min, max) per document."""
  doc_windows: int = 2  # windows per document; divides the slot's windows
  facts: Tuple[int, int] = (1, 4)
  queries: Tuple[int, int] = (1, 2)
  memory_fraction: float = 0.9  # share of asked facts placed before the question's window
  haystacks: Tuple[str, ...] = HAYSTACKS[:3]  # the synthetic ones; 'text' needs a haystack_task
  # hard negatives: the share of a 'facts' haystack's keys made like an asked key, and the share
  # of steps whose documents all share one statement template, kind and key kind with a 'facts'
  # haystack (every crossbatch negative then a look-alike fact under another key)
  near_keys: float = 0.0
  shared_shape: float = 0.0
  text_task: str = ""  # LM task of the natural-text slots ('' = none)
  haystack_task: str = ""  # text task of the 'text' haystacks (configs.resolve: '' = the corpus)
  text_slots: float = 0.0  # share of the slots (rounded down) holding natural text
  text_scored_windows: int = 1
  doc_kinds: Tuple[str, ...] = ("lookup",)  # drawn per document (DOC_KINDS)
  # share of the lookup documents framed as a chat in the vocabulary's own chat template: the
  # haystack and the first question in the user's turn, each answer in an assistant's turn
  chat: float = 0.0
  # per asked fact of a lookup document, the chance that one or two mentions of its key and kind
  # (MENTIONS: the question's words, then words, no value) lie in the haystack
  mentions: float = 0.0
  # the share of a lookup document's questions asked as a plain sentence (PLAIN_QUESTIONS)
  plain_questions: float = 0.0
  # a long haystack per step (`RetrievalBatches.memory_tokens`) of this many tokens, drawn from
  # memory_haystacks and holding no fact: what train.memory writes into the memory every row reads
  memory_tokens: int = 0
  memory_haystacks: Tuple[str, ...] = ("repeat", "text")

  @property
  def reads_text(self) -> bool:
    """Whether a haystack (a document's or the memory's) is real text: haystack_task's passages."""
    return "text" in self.haystacks or bool(self.memory_tokens and "text" in self.memory_haystacks)

  @property
  def wants_passages(self) -> bool:
    return self.reads_text or "tally" in self.doc_kinds

  @classmethod
  def from_dict(cls, d: dict, where: str = "data.retrieval") -> "RetrievalSpec":
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"{where}: unknown field(s) {unknown}; known: {[f.name for f in dataclasses.fields(cls)]}")
    d = dict(d)
    for f in ("facts", "queries", "haystacks", "doc_kinds", "memory_haystacks"):
      if f in d:
        d[f] = tuple(d[f])
    spec = cls(**d)
    spec.validate(where)
    return spec

  def validate(self, where: str = "data.retrieval", windows: Optional[int] = None):
    if self.doc_windows < 2:
      raise ValueError(f"{where}.doc_windows: a document needs at least 2 windows (facts, then questions), "
                       f"got {self.doc_windows}")
    if windows is not None and windows % self.doc_windows:
      raise ValueError(f"{where}.doc_windows={self.doc_windows} must divide data.windows_per_slot={windows}")
    lo, hi = self.facts
    qlo, qhi = self.queries
    if not 1 <= lo <= hi or not 1 <= qlo <= qhi or qlo > lo:
      raise ValueError(f"{where}: need 1 <= facts[0] <= facts[1] and 1 <= queries[0] <= facts[0], queries[0] <= queries[1], "
                       f"got facts={self.facts} queries={self.queries}")
    bad = sorted(set(self.haystacks) - set(HAYSTACKS))
    if bad or not self.haystacks:
      raise ValueError(f"{where}.haystacks: choose from {HAYSTACKS}, got {list(self.haystacks)}")
    bad = sorted(set(self.doc_kinds) - set(DOC_KINDS))
    if bad or not self.doc_kinds:
      raise ValueError(f"{where}.doc_kinds: choose from {DOC_KINDS}, got {list(self.doc_kinds)}")
    for name in ("near_keys", "shared_shape", "chat", "mentions", "plain_questions"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"{where}.{name}: must be in [0, 1], got {getattr(self, name)}")
    if not 0.0 <= self.memory_fraction <= 1.0 or not 0.0 <= self.text_slots < 1.0:
      raise ValueError(f"{where}: memory_fraction in [0, 1] and text_slots in [0, 1) expected, got "
                       f"{self.memory_fraction} / {self.text_slots}")
    if self.text_scored_windows < 1:
      raise ValueError(f"{where}.text_scored_windows: must be >= 1, got {self.text_scored_windows}")
    if self.text_slots and not self.text_task:
      raise ValueError(f"{where}: text_slots={self.text_slots} needs a text_task")
    if self.memory_tokens < 0:
      raise ValueError(f"{where}.memory_tokens: must be >= 0, got {self.memory_tokens}")
    bad = sorted(set(self.memory_haystacks) - set(MEMORY_HAYSTACKS))
    if bad or not self.memory_haystacks:
      raise ValueError(f"{where}.memory_haystacks: choose from {MEMORY_HAYSTACKS} (no 'facts': a fact in the memory "
                       f"every row reads could contradict a document of the batch), got {list(self.memory_haystacks)}")
    if self.reads_text and not self.haystack_task:
      raise ValueError(f"{where}: a 'text' haystack needs a haystack_task (a text task: files:PATTERN, jsonl:...)")


class _Tokens:
  """Sentence-by-sentence encoding with a cache: filler sentences repeat a lot."""

  def __init__(self, vocab):
    self.vocab, self.cache = vocab, {}

  def __call__(self, text: str) -> List[int]:
    ids = self.cache.get(text)
    if ids is None:
      ids = [int(i) for i in self.vocab.encode(text)]
      if len(self.cache) < 50000:
        self.cache[text] = ids
    return ids


def _answered(head: List[int], answer: List[int], end: List[int]) -> Tuple[List[int], List[bool]]:
  """(head + answer + end, mask of the answer's tokens): a question and its scored answer."""
  return head + answer + end, [False] * len(head) + [True] * len(answer) + [False] * len(end)


def _question(questions, plain: float, rng: np.random.Generator) -> str:
  """A question form: a plain one (PLAIN_QUESTIONS) with probability `plain` (no draw at 0: the
  documents of recipes without plain questions stay the same), else one of the template's."""
  if plain and rng.random() < plain:
    return PLAIN_QUESTIONS[rng.integers(len(PLAIN_QUESTIONS))]
  return questions[rng.integers(len(questions))]


def question_block(tokens, questions, kind: str, asked: List[Tuple[str, str]], rng: np.random.Generator,
                   plain: float = 0.0):
  """'\n' + question + ' ' + value + '.' per asked fact -> (ids, mask of the value tokens)."""
  ids = list(tokens("\n"))  # a copy: the cache must not grow with it
  mask = [False] * len(ids)
  for key, value in asked:
    q = _question(questions, plain, rng).format(key=key, kind=kind)
    q_ids, q_mask = _answered(tokens(q), tokens(" " + value), tokens(".\n"))  # each question starts a line
    ids += q_ids
    mask += q_mask
  return ids, mask


@dataclasses.dataclass(frozen=True)
class ChatFrame:
  """A chat template's framing as token ids: prefix (the system prompt and the user's turn opening,
  bos dropped: a document begins with it), reply (the user's turn closing and the assistant's
  opening), next (the assistant's turn closing and the user's opening)."""
  prefix: Tuple[int, ...]
  reply: Tuple[int, ...]
  next: Tuple[int, ...]


def chat_frame(vocab, bos: int) -> ChatFrame:
  """The framing of `vocab`'s chat template (a tokenizer.json whose directory ships one), read off
  a rendered user / assistant / user conversation of marker texts."""
  from fot_jax import chat
  directory = chat.tokenizer_dir(getattr(vocab, "path", ""))
  if directory is None:
    raise ValueError("retrieval: chat > 0 needs a tokenizer.json vocabulary with a chat template "
                     f"(data.vocab), got {type(vocab).__name__}")
  marks = ("\x01U", "\x01A", "\x01V")
  text = chat.chat_prompt(directory, [{"role": r, "content": m} for r, m in zip(("user", "assistant", "user"), marks)])
  prefix, rest = text.split(marks[0])
  reply, rest = rest.split(marks[1])
  nxt, reply2 = rest.split(marks[2])
  if reply != reply2:
    raise ValueError(f"retrieval: {directory}'s chat template opens the assistant's turn in two ways "
                     f"({reply!r}, {reply2!r}); chat framing needs one")
  ids = [int(i) for i in vocab.encode(prefix)]
  return ChatFrame(tuple(ids[1:] if ids[:1] == [bos] else ids), tuple(int(i) for i in vocab.encode(reply)),
                   tuple(int(i) for i in vocab.encode(nxt)))


def chat_question_block(tokens, questions, kind: str, asked: List[Tuple[str, str]], rng: np.random.Generator,
                        frame: ChatFrame, plain: float = 0.0):
  """question_block framed as a chat: the first question ends the user's turn that holds the
  haystack, each later one opens a user turn of its own; a question form's part up to its '?' is
  the user's, the rest leads the assistant's answer (a form without '?' is the user's whole and
  the answer is the bare value) -> (ids, mask of the value tokens)."""
  ids, mask = [], []
  for n, (key, value) in enumerate(asked):
    q = _question(questions, plain, rng).format(key=key, kind=kind)
    cut = q.find("?") + 1
    ask, lead = (q[:cut], q[cut:].strip()) if cut else (q, "")
    head = (tokens("\n" + ask) if n == 0 else list(frame.next) + tokens(ask)) + list(frame.reply)
    head += tokens(lead) if lead else []
    q_ids, q_mask = _answered(head, tokens(" " + value if lead else value), tokens("."))
    ids += q_ids
    mask += q_mask
  return ids, mask


def draw_shape(spec: RetrievalSpec, rng: np.random.Generator) -> Tuple[int, str, str, str]:
  """(template index, kind, key kind, haystack) of a document."""
  return (int(rng.integers(len(TEMPLATES))), KINDS[rng.integers(len(KINDS))],
          KEY_KINDS[rng.integers(len(KEY_KINDS))], spec.haystacks[rng.integers(len(spec.haystacks))])


def haystack_pieces(haystack: str, budget: int, tokens, rng: np.random.Generator,
                    passages: Optional[List[List[str]]] = None, other_fact=None) -> List[List[int]]:
  """Filler sentences (token lists) of exactly `budget` tokens in all, the last one cut: a short
  cycle repeated ('repeat'), generated prose ('prose'), consecutive units of one real document
  ('text', from `passages`) or `other_fact()` statements ('facts')."""
  cycle = [FILLER_SENTENCES[j] for j in rng.permutation(len(FILLER_SENTENCES))[:int(rng.integers(3, 7))]]
  pieces, used = [], 0
  if haystack == "text":
    if not passages:
      raise ValueError("retrieval: a 'text' haystack needs passages (text_units of the haystack_task)")
    passage = passages[rng.integers(len(passages))]
    first = int(rng.integers(len(passage)))
  while used < budget:
    if haystack == "repeat":
      s = cycle[len(pieces) % len(cycle)]
    elif haystack == "prose":
      s = prose_sentence(rng)
    elif haystack == "text":
      s = passage[(first + len(pieces)) % len(passage)]
    else:
      s = other_fact()
    pieces.append(tokens(" " + s)[:budget - used])
    used += len(pieces[-1])
  return pieces


def _interleave(pieces: List[List[int]], statements: List[List[int]], inserts: Dict[int, List[int]]) -> List[int]:
  """The haystack's pieces with statements[i] for i in inserts[b] (in that order) before piece b."""
  out = []
  for b in range(len(pieces) + 1):
    for i in inserts.get(b, ()):
      out += statements[i]
    if b < len(pieces):
      out += pieces[b]
  return out


def document(spec: RetrievalSpec, tokens: _Tokens, length: int, keys: KeyPool, rng: np.random.Generator,
             bos: int, shape: Optional[Tuple[int, str, str, str]] = None,
             passages: Optional[List[List[str]]] = None, frame: Optional[ChatFrame] = None) -> Dict:
  """One document of exactly `length` tokens (bos first): haystack with facts, then the questions.
  shape: (template index, kind, key kind, haystack), drawn when not given (`draw_shape`).
  passages: the units of the 'text' haystack's documents (`text_units`). frame: a chat framing
  (`chat_frame`): its prefix first, the questions and answers as chat turns (`chat_question_block`).
  Returns tokens, answer_mask (the value tokens of the answers) and the facts for tests."""
  template_i, kind, key_kind, haystack = draw_shape(spec, rng) if shape is None else shape
  statement, questions = TEMPLATES[template_i]
  n_facts = int(rng.integers(spec.facts[0], spec.facts[1] + 1))
  facts = [(keys.draw(key_kind), make_value(rng)) for _ in range(n_facts)]
  n_asked = min(n_facts, int(rng.integers(spec.queries[0], spec.queries[1] + 1)))
  asked = [int(i) for i in rng.permutation(n_facts)[:n_asked]]
  fact_ids = [tokens(" " + statement.format(key=k, kind=kind, value=v)) for k, v in facts]
  # Fit: drop unasked facts, then questions (and their facts), until facts + questions fit with
  # room for some filler; a document that cannot hold one fact and its question is a config error.
  prefix = list(frame.prefix) if frame is not None else []
  while True:
    if frame is None:
      q_ids, q_mask = question_block(tokens, questions, kind, [facts[i] for i in asked], rng, spec.plain_questions)
    else:
      q_ids, q_mask = chat_question_block(tokens, questions, kind, [facts[i] for i in asked], rng, frame,
                                          spec.plain_questions)
    budget = length - 1 - len(prefix) - len(q_ids)
    if budget >= sum(len(fact_ids[i]) for i in range(n_facts)) + 8:
      break
    unasked = [i for i in range(n_facts) if i not in asked]
    if unasked:
      drop = unasked[-1]
    elif len(asked) > 1:
      drop = asked.pop()
    else:
      raise ValueError(f"retrieval: a fact and its question do not fit a document of {length} tokens; "
                       f"use longer documents (doc_windows or the window)")
    facts, fact_ids = facts[:drop] + facts[drop + 1:], fact_ids[:drop] + fact_ids[drop + 1:]
    asked = [i - (i > drop) for i in asked]
    n_facts -= 1
  if spec.mentions:  # no draw without mentions: the documents of the recipes measured before stay the same
    forms = MENTIONS + PLAIN_MENTIONS if spec.plain_questions else MENTIONS
    for i in list(asked):
      if rng.random() < spec.mentions:
        for _ in range(int(rng.integers(1, 3))):
          m = forms[rng.integers(len(forms))].format(key=facts[i][0], kind=kind)
          fact_ids.append(tokens(" " + m))
    while fact_ids[n_facts:] and budget < sum(len(f) for f in fact_ids) + 8:
      fact_ids.pop()  # mentions go first when the document is full
  n_statements = len(fact_ids)  # the facts', then the mentions' statements (inserted alike, never asked)
  window = length // spec.doc_windows
  # The haystack: filler sentences up to the budget left by the facts (the last one cut), then
  # each fact inserted whole at the sentence boundary nearest its drawn offset. An asked fact
  # lies before the question's window with probability memory_fraction.
  filler_budget = budget - sum(len(f) for f in fact_ids)

  def other_fact():  # under a key no document of the batch uses, never asked; some like an asked one
    like = facts[asked[int(rng.integers(len(asked)))]][0] if spec.near_keys and rng.random() < spec.near_keys else None
    return statement.format(key=keys.draw(key_kind, like), kind=kind, value=make_value(rng))

  pieces = haystack_pieces(haystack, filler_budget, tokens, rng, passages, other_fact)
  bounds = np.cumsum([0] + [len(p) for p in pieces])  # token offset of every sentence boundary
  # haystack offset of the question's window
  q_window_start = (length - len(q_ids)) // window * window - 1 - len(prefix)
  inserts = collections.defaultdict(list)
  for i in rng.permutation(n_statements):
    memory = i in asked and rng.random() < spec.memory_fraction
    # before the question's window: the boundary must leave room for this fact (and those before it)
    last = q_window_start - len(fact_ids[i]) if memory else filler_budget
    at = int(rng.integers(0, max(1, last) + 1))
    inserts[int(np.searchsorted(bounds, at, side="right") - 1)].append(i)
  out = prefix + _interleave(pieces, fact_ids, inserts)
  ids = [bos] + out + q_ids
  mask = [False] * (1 + len(out)) + q_mask
  return {"tokens": np.asarray(ids, np.int32), "answer_mask": np.asarray(mask, bool), "facts": facts,
          "asked": [facts[i] for i in asked], "template": template_i, "haystack": haystack, "chat": frame is not None}


def _fit_error(what: str, length: int):
  return ValueError(f"retrieval: {what} does not fit a document of {length} tokens; use longer documents "
                    f"(doc_windows or the window)")


def chain_document(spec: RetrievalSpec, tokens: _Tokens, length: int, keys: KeyPool, rng: np.random.Generator,
                   bos: int, passages: Optional[List[List[str]]] = None) -> Dict:
  """A 'chain' document of exactly `length` tokens: a value stated for one key, then passed from key
  to key ("{key} takes the {kind} of {other}."), 1-4 hops, with 0-2 other chains of other values in
  the same words, in a haystack; the question gives the value and the answer is every key of its
  chain in order (" k0, k1, k2"). Statements keep their chain's order; with probability
  memory_fraction the asked chain lies wholly before the question's window.
  Returns tokens, answer_mask, chains ([(value, [keys])], the asked one first) and asked."""
  template_i, kind = int(rng.integers(len(TEMPLATES))), KINDS[rng.integers(len(KINDS))]
  key_kind = CHAIN_KEY_KINDS[rng.integers(len(CHAIN_KEY_KINDS))]
  haystack = spec.haystacks[rng.integers(len(spec.haystacks))]
  alias = ALIAS_TEMPLATES[rng.integers(len(ALIAS_TEMPLATES))]
  statement = TEMPLATES[template_i][0]
  values = set()
  chains = []
  for _ in range(1 + int(rng.integers(3))):
    value = make_value(rng)
    while value in values:
      value = make_value(rng)
    values.add(value)
    chains.append((value, [keys.draw(key_kind) for _ in range(2 + int(rng.integers(4)))]))

  def chain_ids(value, ks):
    first = tokens(" " + statement.format(key=ks[0], kind=kind, value=value))
    return [first] + [tokens(" " + alias.format(key=k, other=prev, kind=kind)) for prev, k in zip(ks, ks[1:])]

  question = CHAIN_QUESTIONS[rng.integers(len(CHAIN_QUESTIONS))]
  while True:  # fit: drop other chains, then the asked chain's last hops
    value, ks = chains[0]
    q_ids, q_mask = _answered(tokens("\n" + question.format(kind=kind, value=value)), tokens(" " + ", ".join(ks)),
                              tokens(".\n"))
    stmts = [chain_ids(v, c) for v, c in chains]
    budget = length - 1 - len(q_ids) - sum(len(x) for c in stmts for x in c)
    if budget >= 8:
      break
    if len(chains) > 1:
      chains.pop()
    elif len(ks) > 2:
      chains[0] = (value, ks[:-1])
    else:
      raise _fit_error("a chain of two keys and its question", length)
  pieces = haystack_pieces(haystack, budget, tokens, rng, passages,
                           lambda: statement.format(key=keys.draw(key_kind), kind=kind, value=make_value(rng)))
  bounds = np.cumsum([0] + [len(p) for p in pieces])
  window = length // spec.doc_windows
  q_window_start = (length - len(q_ids)) // window * window - 1
  flat, inserts = [], collections.defaultdict(list)
  for c, chain in enumerate(stmts):
    size = sum(len(x) for x in chain)
    last = q_window_start - size if c == 0 and rng.random() < spec.memory_fraction else budget
    for at, statement_ids in zip(np.sort(rng.integers(0, max(1, last) + 1, len(chain))), chain):
      inserts[int(np.searchsorted(bounds, at, side="right") - 1)].append(len(flat))
      flat.append(statement_ids)
  out = _interleave(pieces, flat, inserts)
  ids, mask = [bos] + out + q_ids, [False] * (1 + len(out)) + q_mask
  return {"tokens": np.asarray(ids, np.int32), "answer_mask": np.asarray(mask, bool), "chains": chains,
          "asked": [chains[0]], "haystack": haystack}


def tally_words(passages: Optional[List[List[str]]]) -> Tuple[str, ...]:
  """The words a tally list draws from: the lower-case words (4-10 letters) of the 'text'
  haystack's documents when there are at least 200, else TALLY_WORDS."""
  words = sorted({w.lower() for units in passages or () for u in units for w in re.findall(r"\b[A-Za-z]{4,10}\b", u)})
  return tuple(words) if len(words) >= 200 else TALLY_WORDS


def tally_document(spec: RetrievalSpec, tokens: _Tokens, length: int, rng: np.random.Generator, bos: int,
                   words: Sequence[str], word_tokens: int) -> Dict:
  """A 'tally' document of exactly `length` tokens: a list ("12. word", "- word", ...) in which n+1
  words recur (weights (n+1)^2 .. 1) among words seen once or twice, then repeated filler to the
  exact length and the question for the n (2-5) most frequent ones, most frequent first
  (" w1, w2, w3"). Counts are drawn until the n asked ones are strictly ordered and above the rest
  (n lowered when a short list keeps failing). word_tokens: the most tokens of " {word}," over
  `words`. Returns tokens, answer_mask, counts ({word: count}) and asked (the answer's words)."""
  entry = TALLY_ENTRIES[rng.integers(len(TALLY_ENTRIES))]
  question = TALLY_QUESTIONS[rng.integers(len(TALLY_QUESTIONS))]
  n = int(rng.integers(2, 6))
  # room for the question and the longest answer
  reserve = len(tokens("\n" + question.format(n=n) + ".\n")) + n * word_tokens
  budget = length - 1 - reserve - 8
  if budget < 40:
    raise _fit_error("a tally list and its question", length)
  for attempt in range(40):
    if attempt and attempt % 10 == 0:
      n = max(2, n - 1)  # a short list rarely orders 5 counts strictly: ask fewer
    drawn = [str(words[i]) for i in (rng.choice(len(words), 2 * length, replace=False)
                                     if len(words) >= 2 * length else rng.permutation(len(words)))]
    common, rare = drawn[:n + 1], iter(drawn[n + 1:])
    weights = np.arange(n + 1, 0, -1, dtype=float) ** 2  # spread counts: strictly ordered more often
    seen_rare, entries, used = [], [], 0
    while True:
      if rng.random() < 0.6:
        w = common[rng.choice(n + 1, p=weights / weights.sum())]
      elif seen_rare and rng.random() < 0.3:
        w = seen_rare.pop(int(rng.integers(len(seen_rare))))  # a rare word's second (and last) time
      else:
        w = next(rare, None)
        if w is None:
          break
        seen_rare.append(w)
      ids = tokens(" " + entry.format(i=len(entries) + 1, w=w))
      if used + len(ids) > budget:
        break
      entries.append((w, ids))
      used += len(ids)
    counts = collections.Counter(w for w, _ in entries)
    top = sorted(counts, key=lambda w: -counts[w])[:n + 1]
    ranked = [counts[w] for w in top]
    if len(ranked) == n + 1 and all(a > b for a, b in zip(ranked, ranked[1:])) and ranked[n - 1] > 2:
      break
  else:
    raise _fit_error(f"a tally list with {n} distinct top counts", length)
  answer = top[:n]
  q_ids, q_mask = _answered(tokens("\n" + question.format(n=n)), tokens(" " + ", ".join(answer)), tokens(".\n"))
  listed = [t for _, ids in entries for t in ids]
  filler = haystack_pieces("repeat", length - 1 - len(listed) - len(q_ids), tokens, rng)
  out = listed + [t for p in filler for t in p]
  ids, mask = [bos] + out + q_ids, [False] * (1 + len(out)) + q_mask
  return {"tokens": np.asarray(ids, np.int32), "answer_mask": np.asarray(mask, bool), "counts": dict(counts),
          "asked": answer}


class RetrievalBatches:
  """Slot batches of retrieval documents (and natural text in a share of the slots), in the
  slot batcher's layout: rows slot * windows + j, fields inputs/targets/loss_mask/accuracy_mask/
  doc_ids [slots * windows, window]."""

  def __init__(self, spec: RetrievalSpec, vocab, *, slots: int, windows: int, window: int, seed: int,
               text_batches=None, haystack_texts: Optional[Sequence[str]] = None):
    spec.validate(windows=windows)
    self.passages = None
    if spec.wants_passages:
      self.passages = text_units(haystack_texts or ())
      if not self.passages and spec.reads_text:
        raise ValueError(f"retrieval: the 'text' haystack's task {spec.haystack_task!r} has no document of 8 or "
                         f"more sentences")
    self.spec, self.slots, self.windows, self.window, self.seed = spec, slots, windows, window, seed
    self.n_text = int(spec.text_slots * slots)
    if self.n_text and text_batches is None:
      raise ValueError("retrieval: text_slots > 0 needs the text task's slot batches")
    self.text = text_batches
    self.tokens = _Tokens(vocab)
    self.words = tally_words(self.passages) if "tally" in spec.doc_kinds else ()
    self.frame = None
    self.word_tokens = max((len(vocab.encode(" " + w + ",")) for w in self.words), default=0)
    from data_pipelines import vocab as vocab_lib
    self.bos = vocab_lib.special_ids(vocab)["bos"]
    if spec.chat:
      self.frame = chat_frame(vocab, self.bos)

  def __call__(self, step: int) -> Dict[str, np.ndarray]:
    k, t = self.windows, self.window
    n_ret = self.slots - self.n_text
    per_slot = k // self.spec.doc_windows
    doc_len = self.spec.doc_windows * t + 1  # + 1: the last target
    rng = np.random.default_rng([self.seed, step, 29])
    keys = KeyPool(rng)
    shared = None  # one shape for every document of the step: look-alike crossbatch negatives
    if self.spec.shared_shape and rng.random() < self.spec.shared_shape:
      shared = draw_shape(self.spec, rng)[:3] + ("facts",)
    rows = {f: [] for f in ("inputs", "targets", "loss_mask", "accuracy_mask", "doc_ids")}
    for s in range(n_ret):
      for j in range(per_slot):
        d = self.document(doc_len, keys, rng, shared)
        toks, m = d["tokens"], d["answer_mask"]
        rows["inputs"].append(toks[:-1].reshape(-1, t))
        rows["targets"].append(toks[1:].reshape(-1, t))
        rows["loss_mask"].append(m[1:].reshape(-1, t))
        rows["accuracy_mask"].append(m[1:].reshape(-1, t))
        rows["doc_ids"].append(np.full((self.spec.doc_windows, t), (step * self.slots + s) * per_slot + j,
                                       np.int64))
    batch = {f: np.concatenate(v) if v else np.zeros((0, t), np.int32) for f, v in rows.items()}
    if self.n_text:
      text = self.text(step)
      lm = np.array(text["loss_mask"]).reshape(self.n_text, k, t)
      lm[:, :max(0, k - self.spec.text_scored_windows)] = False  # the last windows (all: also those without memory)
      text = dict(text, loss_mask=lm.reshape(-1, t), accuracy_mask=np.zeros((self.n_text * k, t), bool),
                  doc_ids=np.where(np.asarray(text["doc_ids"]) < 0, -1, np.asarray(text["doc_ids"], np.int64) + 2 ** 40))
      batch = {f: np.concatenate([batch[f], np.asarray(text[f]).astype(batch[f].dtype)]) for f in batch}
    batch["inputs"], batch["targets"] = batch["inputs"].astype(np.int32), batch["targets"].astype(np.int32)
    return batch

  def memory_tokens(self, step: int) -> Optional[np.ndarray]:
    """The step's memory haystack: spec.memory_tokens tokens (bos first) of one kind drawn from
    spec.memory_haystacks, with no fact; None when the spec makes none. A pure function of (seed,
    step), like the retrieval slots: a resumed run writes the same memory."""
    if not self.spec.memory_tokens:
      return None
    rng = np.random.default_rng([self.seed, step, 31])
    kind = self.spec.memory_haystacks[rng.integers(len(self.spec.memory_haystacks))]
    pieces = haystack_pieces(kind, self.spec.memory_tokens - 1, self.tokens, rng, self.passages)
    return np.asarray([self.bos] + [t for p in pieces for t in p], np.int32)

  def document(self, length: int, keys: KeyPool, rng: np.random.Generator, shared) -> Dict:
    """One document of a kind drawn from spec.doc_kinds (no draw for one kind: a lookup-only
    spec's documents are those of the recipes measured before the other kinds existed)."""
    kinds = self.spec.doc_kinds
    kind = kinds[rng.integers(len(kinds))] if len(kinds) > 1 else kinds[0]
    if kind == "chain":
      return chain_document(self.spec, self.tokens, length, keys, rng, self.bos, self.passages)
    if kind == "tally":
      return tally_document(self.spec, self.tokens, length, rng, self.bos, self.words, self.word_tokens)
    frame = self.frame if self.spec.chat and rng.random() < self.spec.chat else None  # no draw without chat
    return document(self.spec, self.tokens, length, keys, rng, self.bos, shared, self.passages, frame)

  # state, reports: the text slots' batcher (the retrieval slots are a pure function of the step)
  def state_dict(self) -> dict:
    return {"seed": self.seed, "text": self.text.state_dict() if self.text is not None else None}

  def load_state_dict(self, state: dict) -> None:
    if self.text is not None and state.get("text") is not None:
      self.text.load_state_dict(state["text"])

  def report(self) -> str:
    return self.text.report() if self.text is not None else "synthetic retrieval documents"

  def bad_input(self):
    from data_pipelines import sources
    return self.text.bad_input() if self.text is not None else sources.BadInputStats()
