"""The retrieval curriculum's documents (data_pipelines/retrieval_docs.py), checked from their
decoded text: facts stated before the questions that ask for them, scored tokens that are exactly
the asked values, keys never shared between two documents of a batch (a crossbatch negative must
not contradict its positive), no evaluation template in any training document, natural-text slots
scored on their last window only; and the curriculum tasks wired into an LM run."""
import collections
import re

import numpy as np
import pytest

from data_pipelines import passkey, retrieval_docs as rd, vocab as vocab_lib
from fot_jax import configs
from fot_jax.eval import niah, ruler
from tests.test_vocab_hf import make_tokenizer

KEY = r"(?:[a-z]+-[a-z]+|[A-Z][a-z]+ [A-Z]\. [A-Z][a-z]+|unit \d{4}|[0-9a-f]{8})"
KIND = "(?:" + "|".join(re.escape(k) for k in rd.KINDS) + ")"


def _statement_regexes():
  """Every template's statement as a regex with key / value groups (independent of the generator)."""
  out = []
  for statement, _ in rd.TEMPLATES:
    pat = re.escape(statement).replace(r"\{key\}", f"(?P<key>{KEY})").replace(r"\{kind\}", KIND)
    out.append(re.compile(pat.replace(r"\{value\}", r"(?P<value>\d{5,7})")))
  return out


STATEMENTS = _statement_regexes()


def facts_in(text):
  return [(m.group("key"), m.group("value"), m.start()) for r in STATEMENTS for m in r.finditer(text)]


@pytest.fixture(scope="module", params=["byte", "tokenizer.json"])
def vocab(request, tmp_path_factory):
  if request.param == "byte":
    return vocab_lib.get_vocabulary("byte")
  return vocab_lib.get_vocabulary(make_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _docs(batch, doc_windows):
  """(input ids with the last target, loss mask over them) per document of a retrieval batch."""
  t = batch["inputs"].shape[1]
  for r in range(0, len(batch["inputs"]), doc_windows):
    rows = slice(r, r + doc_windows)
    if (batch["doc_ids"][rows] >= 2 ** 40).any():  # a natural-text slot
      continue
    ids = np.concatenate([batch["inputs"][rows].reshape(-1), batch["targets"][rows].reshape(-1)[-1:]])
    mask = np.concatenate([[False], batch["loss_mask"][rows].reshape(-1)])
    assert len(ids) == doc_windows * t + 1
    yield ids, mask


# A 'text' haystack's documents: sentences with no digits (the values are the only 5-7 digit numbers)
PROSE = ["\n\n".join(" ".join(f"The {w} of part {chr(97 + d)} is told in sentence {chr(97 + i)} of this note."
                               for i in range(3)) for w in ("river", "mill", "road", "bell"))
         for d in range(6)] + ["too short. only two."]


@pytest.mark.parametrize("doc_windows,facts,queries,haystacks", [
    (2, (1, 2), (1, 1), rd.HAYSTACKS), (4, (3, 6), (1, 3), ("facts",)), (8, (2, 12), (1, 4), rd.HAYSTACKS)])
def test_documents_state_facts_before_questions_with_distinct_keys(vocab, doc_windows, facts, queries, haystacks):
  spec = rd.RetrievalSpec(doc_windows=doc_windows, facts=facts, queries=queries, haystacks=haystacks,
                          haystack_task="prose")
  window = 128  # both vocabularies are about a byte a token
  batches = rd.RetrievalBatches(spec, vocab, slots=4, windows=8, window=window, seed=3, haystack_texts=PROSE)
  in_memory = asked_total = 0
  for step in range(3):
    batch = batches(step)
    assert batch["inputs"].shape == (32, window) and (batch["accuracy_mask"] == batch["loss_mask"]).all()
    owner = {}  # key -> (document, value): over the whole batch
    for d, (ids, mask) in enumerate(_docs(batch, doc_windows)):
      text = vocab.decode(ids[1:].tolist())
      stated = facts_in(text)
      assert stated, text
      for key, value, _ in stated:
        assert owner.setdefault(key, (d, value)) == (d, value), f"key {key!r} stated twice in a batch"
      # the scored tokens are the asked values, each stated under its key before the question block
      q_start = text.index("\n")
      answers = re.findall(r"\d{5,7}", vocab.decode(ids[mask].tolist()))
      assert queries[0] <= len(answers) <= queries[1], (answers, text)
      values = {}
      for _, v, pos in stated:  # the first statement (a question + its answer may match one too)
        values[v] = min(pos, values.get(v, pos))
      for v in answers:
        assert v in values and values[v] < q_start, (v, text)
      # how many asked facts lie before the question's window (in memory at inference)
      first_scored = int(np.nonzero(mask)[0][0])
      q_window = (first_scored - 1) // window * window
      for v in answers:
        prefix = vocab.decode(ids[1:q_window + 1].tolist())
        in_memory += v in prefix
        asked_total += 1
  assert in_memory / asked_total >= 0.6, (in_memory, asked_total)  # memory_fraction 0.9, minus overflow


def test_mentions_name_asked_keys_with_no_value_before_the_questions():
  """`mentions`: sentences with an asked key and its kind, ending in words, in the haystack, never a
  value and never another document's key; none without the option."""
  mention_res = [re.compile(re.escape(m).replace(r"\{key\}", f"(?P<key>{KEY})").replace(r"\{kind\}", KIND))
                 for m in rd.MENTIONS]
  vocab = vocab_lib.get_vocabulary("byte")
  seen = {}
  for mentions in (0.0, 1.0):
    spec = rd.RetrievalSpec(doc_windows=4, facts=(3, 6), queries=(1, 3), haystacks=("repeat", "facts"),
                            mentions=mentions)
    batches = rd.RetrievalBatches(spec, vocab, slots=4, windows=8, window=128, seed=5)
    docs = with_mention = 0
    for step in range(2):
      for ids, mask in _docs(batches(step), 4):
        text = vocab.decode(ids[1:].tolist())
        q_start = text.index("\n")
        by_value = {v: k for k, v, _ in facts_in(text[:q_start])}
        asked = {by_value[v] for v in re.findall(r"\d{5,7}", vocab.decode(ids[mask].tolist()))}
        found = [(m.group("key"), m.start(), m.group(0)) for r in mention_res for m in r.finditer(text)]
        for key, at, sentence in found:
          assert key in asked and at < q_start and not re.search(r"\d{5}", sentence.replace(key, "")), (key, sentence)
        docs, with_mention = docs + 1, with_mention + bool(found)
    seen[mentions] = with_mention / docs
  assert seen[0.0] == 0 and seen[1.0] > 0.8, seen


def test_plain_questions_end_in_is_and_are_answered_with_the_asked_value():
  """`plain_questions=1`: every lookup question is a plain sentence ending where its value goes on
  ("The {kind} of {key} is"), answered with the value its key was stated with."""
  plain = [re.compile(re.escape(q).replace(r"\{key\}", f"(?P<key>{KEY})").replace(r"\{kind\}", KIND)
                      + r" (?P<value>\d{5,7})\.") for q in rd.PLAIN_QUESTIONS]
  vocab = vocab_lib.get_vocabulary("byte")
  spec = rd.RetrievalSpec(doc_windows=4, facts=(3, 6), queries=(2, 3), haystacks=("repeat",), plain_questions=1.0,
                          mentions=1.0)
  batches = rd.RetrievalBatches(spec, vocab, slots=4, windows=8, window=128, seed=2)
  asked = 0
  for ids, mask in _docs(batches(0), 4):
    text = vocab.decode(ids[1:].tolist())
    q_start = text.index("\n")
    stated = {k: v for k, v, _ in facts_in(text[:q_start])}
    lines = text[q_start:].strip().splitlines()
    answers = re.findall(r"\d{5,7}", vocab.decode(ids[mask].tolist()))
    assert len(lines) == len(answers), (lines, answers)
    for line, value in zip(lines, answers):
      m = next(filter(None, (r.fullmatch(line) for r in plain)), None)
      assert m and m.group("value") == value == stated[m.group("key")], (line, stated)
      asked += 1
  assert asked >= 8


CHAIN_KEY = r"(?:[a-z]+-[a-z]+|[A-Z][a-z]+ [A-Z]\. [A-Z][a-z]+|unit \d{4}|[0-9a-f]{8}|[A-Z]{5})"


def _chain_regexes():
  """Value statements (key, value) and alias statements (key, other) of the chain documents,
  written from the templates independently of the generator."""
  def rx(template, **groups):
    pat = re.escape(template).replace(r"\{kind\}", KIND)
    for name, g in groups.items():
      pat = pat.replace(r"\{" + name + r"\}", f"(?P<{name}>{g})", 1).replace(r"\{" + name + r"\}", f"(?P={name})")
    return re.compile(pat)
  values = [rx(st, key=CHAIN_KEY, value=r"\d{5,7}") for st, _ in rd.TEMPLATES]
  aliases = [rx(a, key=CHAIN_KEY, other=CHAIN_KEY) for a in rd.ALIAS_TEMPLATES]
  return values, aliases


@pytest.mark.parametrize("haystacks", [("repeat",), ("facts", "text")])
def test_chain_documents_answer_every_key_of_the_asked_chain_in_order(vocab, haystacks):
  """Following the chain in the decoded text (value statement, then 'key takes the kind of other'
  statements) gives exactly the scored answer; keys are never shared between documents."""
  values_rx, aliases_rx = _chain_regexes()
  spec = rd.RetrievalSpec(doc_windows=4, haystacks=haystacks, haystack_task="prose", doc_kinds=("chain",))
  batches = rd.RetrievalBatches(spec, vocab, slots=4, windows=4, window=128, seed=1, haystack_texts=PROSE)
  hops = []
  for step in range(4):
    owner = {}
    for d, (ids, mask) in enumerate(_docs(batches(step), 4)):
      text = vocab.decode(ids[1:].tolist())
      body, question = text.rsplit("\n", 2)[0], vocab.decode(ids[mask].tolist())
      value = re.search(r"\d{5,7}", text[len(body):]).group()  # the question names the value
      holders = [m.group("key") for r in values_rx for m in r.finditer(body) if m.group("value") == value]
      assert len(holders) == 1, (value, text)
      chain, links = holders, [(m.group("key"), m.group("other"), m.start()) for r in aliases_rx for m in r.finditer(body)]
      for key, other, _ in links:
        assert owner.setdefault(key, d) == d, f"key {key!r} in two documents of a batch"
      while any(o == chain[-1] for _, o, _ in links):
        (nxt, at), = [(k, p) for k, o, p in links if o == chain[-1]]
        assert body.index(chain[-1]) < at  # a key is defined before it is passed on
        chain.append(nxt)
      assert question == " " + ", ".join(chain), (question, chain, text)
      hops.append(len(chain) - 1)
  assert set(hops) >= {1, 2, 3}, hops


def test_tally_documents_answer_the_most_frequent_entries_in_order(vocab):
  """Counting the decoded list's entries gives the scored answer: the n most frequent, most first,
  each strictly more frequent than the next and than every other entry."""
  spec = rd.RetrievalSpec(doc_windows=4, doc_kinds=("tally",))
  batches = rd.RetrievalBatches(spec, vocab, slots=2, windows=4, window=128, seed=2)
  forms = set()
  for step in range(6):
    for ids, mask in _docs(batches(step), 4):
      text = vocab.decode(ids[1:].tolist())
      listed, question = text.rsplit("\n", 2)[0], text.rsplit("\n", 2)[1]
      n = int(re.search(r"\d", question).group())
      words = re.findall(r"(?:^|\s)(?:\d+\. |#\d+ |\(\d+\) |- )?([a-z]+)(?=;|\s|$)", listed.split(" The ")[0])
      counts = sorted(collections.Counter(words).items(), key=lambda wc: -wc[1])
      assert all(a[1] > b[1] for a, b in zip(counts[:n], counts[1:n + 1])), counts[:n + 1]
      assert vocab.decode(ids[mask].tolist()) == " " + ", ".join(w for w, _ in counts[:n]), (text, counts[:n + 1])
      forms.add(re.sub(r"[a-z]+", "w", listed.split()[0] + " " + listed.split()[1])[:4])
  assert len(forms) >= 3, forms


def test_chat_framed_documents_ask_and_answer_in_the_vocabularys_chat_template(tmp_path):
  """With chat=0.5 about half the lookup documents are a chat in the tokenizer's own template: the
  template's system and user opening first, each answer (a stated value) right after the assistant's
  opening (and the question form's lead); a vocabulary without a template is refused by name."""
  import json
  from tests.test_lm_harness import _tokenizer_dir
  vocab = vocab_lib.get_vocabulary(f"{_tokenizer_dir(str(tmp_path / 'tok'))}/tokenizer.json")
  spec = rd.RetrievalSpec(doc_windows=4, facts=(2, 4), queries=(1, 3), haystacks=("repeat",), chat=0.5)
  batches = rd.RetrievalBatches(spec, vocab, slots=4, windows=4, window=256, seed=0)
  framed = total = 0
  for step in range(8):
    for ids, mask in _docs(batches(step), 4):
      total += 1
      text = vocab._decode(ids.tolist())  # seqio's decode stops at eos, which closes every chat turn
      values = [vocab._decode(ids[a:b].tolist()).strip() for a, b in _runs(mask)]
      stated = {v for _, v, _ in facts_in(text)}
      assert values and set(values) <= stated, (values, text)
      if text.startswith("<|im_start|>user\n"):  # the template has no system turn
        framed += 1
        turns = re.findall(r"<\|im_start\|>assistant\n([^<]*?)(\d{5,7})\.", text)
        assert [v for _, v in turns] == values, (turns, values, text)
        assert text.count("<|im_start|>user\n") == len(values)
      else:  # bos is <|im_start|> in this tokenizer (as in SmolLM2's): only the first one
        assert text.count("<|im_start|>") == 1 and "<|im_end|>" not in text, text
  assert total == 32 and 0.3 < framed / total < 0.7, framed
  plain = str(tmp_path / "plain")
  _tokenizer_dir(plain, template=None)
  with pytest.raises(ValueError, match="no chat template"):
    rd.RetrievalBatches(spec, vocab_lib.get_vocabulary(f"{plain}/tokenizer.json"), slots=1, windows=4, window=256, seed=0)
  with pytest.raises(ValueError, match="chat > 0 needs a tokenizer.json vocabulary"):
    rd.RetrievalBatches(spec, vocab_lib.get_vocabulary("byte"), slots=1, windows=4, window=256, seed=0)


def _runs(mask):
  """(start, end) of each run of True in a 1-d mask."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
  return list(zip(edges[::2], edges[1::2]))


def test_text_haystack_is_consecutive_sentences_of_one_document():
  units = rd.text_units(PROSE)
  assert len(units) == 6 and all(len(u) == 12 for u in units)  # the two-sentence document is dropped
  assert units[0][:2] == ["The river of part a is told in sentence a of this note.",
                          "The river of part a is told in sentence b of this note."]
  vocab = vocab_lib.get_vocabulary("byte")
  spec = rd.RetrievalSpec(doc_windows=2, facts=(1, 2), queries=(1, 1), haystacks=("text",), haystack_task="p")
  batch = rd.RetrievalBatches(spec, vocab, slots=2, windows=2, window=256, seed=0, haystack_texts=PROSE)(0)
  for ids, _ in _docs(batch, 2):
    text = vocab.decode(ids[1:].tolist())
    sentences = re.findall(r"The (\w+) of part (\w) is told in sentence (\w) of this note\.", text)
    assert len(sentences) >= 5 and len({p for _, p, _ in sentences}) == 1  # one document's units
    # in order: each sentence follows the one before it in its document (wrapping round)
    order = [units[ord(p) - 97].index(f"The {w} of part {p} is told in sentence {i} of this note.")
             for w, p, i in sentences]
    assert all((b - a) % 12 == 1 for a, b in zip(order, order[1:])), order
    assert facts_in(text)
  with pytest.raises(ValueError, match="needs a haystack_task"):
    rd.RetrievalSpec(haystacks=("text",)).validate()
  with pytest.raises(ValueError, match="no document of 8 or more sentences"):
    rd.RetrievalBatches(spec, vocab, slots=2, windows=2, window=256, seed=0, haystack_texts=PROSE[-1:])


def _key_parts(key):
  """The parts a near key may share: adjective / noun, first / last name, 'unit' + 2 digits, 4 hex."""
  if re.fullmatch(r"[a-z]+-[a-z]+", key):
    return {"adj:" + key.split("-")[0], "noun:" + key.split("-")[1]}
  if key.startswith("unit "):
    return {"unit:" + key[5:7]}
  if " " in key:
    return {"first:" + key.split(" ")[0], "last:" + key.split(" ")[2]}
  return {"hex:" + key[:4]}


def test_lookalike_negatives_share_the_shape_and_parts_of_the_asked_keys():
  """shared_shape: every document of a step in one template (each crossbatch negative a look-alike
  fact), keys still distinct over the batch; near_keys: the haystack's other keys share a part of
  an asked key far more often than independent keys do."""
  vocab = vocab_lib.get_vocabulary("byte")
  near = far = total = 0
  for near_keys in (1.0, 0.0):
    spec = rd.RetrievalSpec(doc_windows=4, facts=(2, 4), queries=(1, 2), haystacks=("facts",),
                            shared_shape=1.0, near_keys=near_keys)
    batches = rd.RetrievalBatches(spec, vocab, slots=4, windows=4, window=256, seed=5)
    shared = 0
    for step in range(3):
      templates, owner = set(), {}
      for ids, mask in _docs(batches(step), 4):
        text = vocab.decode(ids[1:].tolist())
        head = text[:text.index("\n")]
        found = [i for i, r in enumerate(STATEMENTS) if r.search(head)]
        assert len(found) == 1, head  # one template per document
        templates.add(found[0])
        stated = [(m.group("key"), m.group("value")) for m in STATEMENTS[found[0]].finditer(head)]
        for key, value in stated:
          assert owner.setdefault(key, (id(ids), value)) == (id(ids), value), key
        answers = re.findall(r"\d{5,7}", vocab.decode(ids[mask].tolist()))
        asked = {k for k, v in stated if v in answers}
        asked_parts = set().union(*(_key_parts(k) for k in asked))
        others = [k for k, _ in stated if k not in asked]
        hits = sum(bool(_key_parts(k) & asked_parts) for k in others)
        if near_keys:
          near, total = near + hits, total + len(others)
        else:
          far += hits
      shared += len(templates) == 1
    assert shared == 3  # every step in one shape
  assert total > 50 and near / total > 0.6 and far < near / 4, (near, total, far)


def _eight_grams(text):
  words = re.findall(r"[a-z0-9]+", text.lower())
  return {" ".join(words[i:i + 8]) for i in range(len(words) - 7)}


def _lm_eval_ruler_templates():
  """The fixed text of lm-evaluation-harness's RULER prompts (read from its sources, nothing run)."""
  import importlib.util
  import pathlib
  spec = importlib.util.find_spec("lm_eval")
  if spec is None:
    pytest.skip("lm-eval is not installed (setup.cfg extra lm_eval)")
  ruler_dir = pathlib.Path(spec.origin).parent / "tasks" / "ruler"
  strings = []
  for f in sorted(ruler_dir.glob("*.py")) + sorted(ruler_dir.glob("*.yaml")):
    src = f.read_text()
    # (not a tokenizer probe such as tok("The quick brown fox ..."): no prompt holds it)
    strings += re.findall(r'"""(.*?)"""', src, re.S) + re.findall(r'(?<!tok\()"([^"\n]{40,})"', src)
  fragments = [p for t in strings for p in re.split(r"\{[a-z_0-9]*\}", t)]
  assert any("special magic" in p for p in fragments), "lm-eval's RULER templates not found"
  return fragments


def test_no_evaluation_template_in_training_documents():
  """Neither the synthetic documents nor the mixed recipe's real-text haystacks (every unit of the
  installed packages' READMEs it reads) hold an 8-gram or phrase of an evaluation prompt."""
  from data_pipelines import pipeline
  from experiments import smollm2_retrieval
  prose = pipeline.document_texts(smollm2_retrieval.PROSE, "train")
  assert len(prose) > 20, "the recipe's README haystack is missing: run the tests from the checkout's root after make install"
  vocab = vocab_lib.get_vocabulary("byte")
  spec = rd.RetrievalSpec(doc_windows=8, facts=(2, 12), queries=(1, 4), near_keys=0.5, shared_shape=0.5, mentions=0.5, plain_questions=0.5,
                          haystacks=rd.HAYSTACKS, haystack_task=smollm2_retrieval.PROSE, doc_kinds=rd.DOC_KINDS,
                          memory_tokens=3000, memory_haystacks=rd.MEMORY_HAYSTACKS)
  batches = rd.RetrievalBatches(spec, vocab, slots=8, windows=8, window=128, seed=0, haystack_texts=prose)
  text = "\n".join(vocab.decode(ids.tolist()) for step in range(16) for ids, _ in _docs(batches(step), 8))
  assert len(text) > 120_000  # 128 documents
  text += "\n".join(" ".join(units) for units in batches.passages)
  text += "\n".join(vocab.decode(batches.memory_tokens(step)[1:].tolist()) for step in range(6))  # train.memory's
  # no 8-gram of lm-eval's RULER prompts or of the project's own evaluation prompts
  eval_grams = set().union(*(_eight_grams(f) for f in _lm_eval_ruler_templates()))
  eval_grams |= set().union(*(_eight_grams(p) for p in ruler.EVAL_TEMPLATES))
  assert len(eval_grams) > 30
  assert not eval_grams & _eight_grams(text), sorted(eval_grams & _eight_grams(text))[:5]
  eval_phrases = list(ruler.EVAL_TEMPLATES) + [
      passkey.QUESTION, passkey.needle(12345).split("12345")[0], niah.needle(1).split(" is ")[0],
      niah.needle(1, style="plain").split(" is ")[0], niah.question(style="plain"),
      "special magic", "pass key", "secret number"]
  eval_phrases += [s.strip() for s in passkey.SENTENCES]  # the passkey haystack is the evaluation's own
  for phrase in eval_phrases:
    assert phrase.strip() and phrase.strip().lower() not in text.lower(), phrase


def test_text_slots_scored_on_their_last_window_and_state_round_trip():
  vocab = vocab_lib.get_vocabulary("byte")

  class Text:  # a stand-in slot batcher: every token scored, with a state
    def __init__(self):
      self.n = 0

    def __call__(self, step):
      self.n += 1
      x = np.full((2 * 4, 128), 7, np.int32)
      return {"inputs": x, "targets": x, "loss_mask": np.ones_like(x, bool), "doc_ids": np.zeros_like(x)}

    def state_dict(self):
      return {"n": self.n}

    def load_state_dict(self, s):
      self.n = s["n"]

  spec = rd.RetrievalSpec(doc_windows=2, facts=(1, 1), queries=(1, 1), text_task="stdlib", text_slots=0.5)
  text = Text()
  b = rd.RetrievalBatches(spec, vocab, slots=4, windows=4, window=128, seed=1, text_batches=text)
  batch = b(0)
  text_mask = batch["loss_mask"][8:].reshape(2, 4, 128)
  assert text_mask[:, 3].all() and not text_mask[:, :3].any() and not batch["accuracy_mask"][8:].any()
  assert (batch["doc_ids"][8:] >= 2 ** 40).all() and (batch["doc_ids"][:8] < 2 ** 40).all()
  assert b.state_dict() == {"seed": 1, "text": {"n": 1}}
  again = rd.RetrievalBatches(spec, vocab, slots=4, windows=4, window=128, seed=1, text_batches=Text())
  again.load_state_dict(b.state_dict())
  assert again.text.n == 1 and (again(0)["inputs"][:8] == batch["inputs"][:8]).all()  # a pure function of the step


def test_memory_haystack_is_the_steps_own_with_no_fact():
  """memory_tokens(step): exactly memory_tokens tokens, bos first, of one drawn kind, no fact; the
  same for the same step (a resumed run writes the same memory), another for another step."""
  vocab = vocab_lib.get_vocabulary("byte")
  spec = rd.RetrievalSpec(doc_windows=2, facts=(1, 2), queries=(1, 1), haystack_task="p", memory_tokens=2000,
                          memory_haystacks=rd.MEMORY_HAYSTACKS)
  batches = rd.RetrievalBatches(spec, vocab, slots=2, windows=2, window=256, seed=0, haystack_texts=PROSE)
  bos = vocab_lib.special_ids(vocab)["bos"]
  kinds = set()
  for step in range(8):
    tokens = batches.memory_tokens(step)
    assert tokens.shape == (2000,) and tokens[0] == bos and tokens.dtype == np.int32
    text = vocab.decode(tokens[1:].tolist())
    assert not facts_in(text) and not re.search(r"\d{5}", text)
    kinds.add("text" if "of this note" in text else "other")
    np.testing.assert_array_equal(tokens, batches.memory_tokens(step))
  assert kinds == {"text", "other"}  # both real text and filler/prose drawn
  assert not np.array_equal(batches.memory_tokens(0), batches.memory_tokens(1))
  assert rd.RetrievalBatches(rd.RetrievalSpec(doc_windows=2), vocab, slots=1, windows=2, window=256,
                             seed=0).memory_tokens(0) is None


def test_bad_specs_name_the_field():
  with pytest.raises(ValueError, match="data.retrieval.x: unknown field"):
    rd.RetrievalSpec.from_dict({"doc_window": 2}, "data.retrieval.x")
  with pytest.raises(ValueError, match="doc_windows=3 must divide data.windows_per_slot=8"):
    rd.RetrievalSpec(doc_windows=3).validate(windows=8)
  with pytest.raises(ValueError, match="haystacks"):
    rd.RetrievalSpec(haystacks=("essay",)).validate()
  with pytest.raises(ValueError, match="doc_kinds: choose from"):
    rd.RetrievalSpec(doc_kinds=("lookup", "count")).validate()
  with pytest.raises(ValueError, match="memory_haystacks: choose from"):  # a fact in every row's memory could contradict
    rd.RetrievalSpec(memory_tokens=100, memory_haystacks=("facts",)).validate()
  with pytest.raises(ValueError, match="needs a haystack_task"):
    rd.RetrievalSpec(memory_tokens=100, memory_haystacks=("text",)).validate()
  with pytest.raises(ValueError, match="needs a text_task"):
    rd.RetrievalSpec(text_slots=0.25).validate()
  spec = rd.RetrievalSpec(doc_windows=2, facts=(8, 8), queries=(4, 4))
  with pytest.raises(ValueError, match="do not fit a document of 65 tokens"):
    rd.RetrievalBatches(spec, vocab_lib.get_vocabulary("byte"), slots=1, windows=2, window=32, seed=0)(0)


def test_experiment_config_validates_and_names_its_tasks():
  from experiments import smollm2_retrieval
  config = smollm2_retrieval.get_config()
  exp = configs.resolve(config, check_data=False)
  assert [exp.lm.feeds[p["task"]].doc_windows for p in config.train.curriculum.phases] == [2, 4, 8]
  assert exp.model.mem_layers == smollm2_retrieval.MEM_LAYERS
  lookalike = smollm2_retrieval.get_config("lookalike")  # `--config=...smollm2_retrieval.py:lookalike`
  feeds = configs.resolve(lookalike, check_data=False).lm.feeds
  assert [feeds[p["task"]].doc_windows for p in lookalike.train.curriculum.phases] == [2, 4, 4]
  assert feeds["far"].shared_shape == 0.5 and lookalike.data.window == 128
  mixed = configs.resolve(smollm2_retrieval.get_config("mixed"), check_data=False).lm
  assert mixed.feeds["far"].haystack_task == smollm2_retrieval.PROSE and "text" in mixed.feeds["far"].haystacks
  assert any(view.endswith("text haystacks") and task == smollm2_retrieval.PROSE for view, _, task, _ in mixed.views)
  assert mixed.feeds["far"].doc_kinds == ("lookup",)
  aggregate = smollm2_retrieval.get_config("aggregate")  # a second stage from the mixed recipe's model
  feeds = configs.resolve(aggregate, check_data=False).lm.feeds
  assert aggregate.train.init_from == smollm2_retrieval.MIXED_CHECKPOINT
  assert set(feeds["near"].doc_kinds) == set(feeds["far"].doc_kinds) == set(rd.DOC_KINDS)
  assert feeds["far"].chat == smollm2_retrieval.AGG_CHAT > 0 and mixed.feeds["far"].chat == 0
  mentions = configs.resolve(smollm2_retrieval.get_config("mentions"), check_data=False).lm.feeds
  assert mentions["far"].mentions == mentions["near"].mentions == smollm2_retrieval.MENTIONS > 0
  assert feeds["far"].mentions == 0 and mentions["far"].doc_kinds == feeds["far"].doc_kinds
  plain = configs.resolve(smollm2_retrieval.get_config("plain"), check_data=False).lm.feeds
  assert plain["far"].plain_questions == smollm2_retrieval.PLAIN > 0 == mentions["far"].plain_questions
  assert plain["far"].mentions == smollm2_retrieval.MENTIONS
  longmem64 = smollm2_retrieval.get_config("longmem64")  # a third stage, from the longmem stage's model
  feeds = configs.resolve(longmem64, check_data=False).lm.feeds
  assert longmem64.train.init_from == smollm2_retrieval.LONGMEM_CHECKPOINT and longmem64.train.memory.enabled
  assert feeds["far"].memory_tokens == 4 * smollm2_retrieval.LONGMEM_TOKENS == longmem64.train.memory.window * 128
  assert [p["task"] for p in longmem64.train.curriculum.phases] == ["far"] and longmem64.train.steps == 16
  direct = smollm2_retrieval.get_config("longmem64_direct")  # the same memory, straight from the mixed model
  direct_feeds = configs.resolve(direct, check_data=False).lm.feeds
  assert direct.train.init_from == smollm2_retrieval.MIXED_CHECKPOINT and direct.train.memory.enabled
  assert direct_feeds["near"].memory_tokens == direct_feeds["far"].memory_tokens == feeds["far"].memory_tokens
  assert [p["task"] for p in direct.train.curriculum.phases] == ["near", "far"] and direct.train.steps == 20
  assert direct.train.memory.refresh >= direct.train.steps  # one write a phase
  with pytest.raises(ValueError, match="variant must be one of"):
    smollm2_retrieval.get_config("passkey")
