"""Passkey / NIAH prompts and the scoring code of the retrieval suites.

The stub models below exist only to check the scoring: they are not models and never
appear in results. The one real-model check (teacher-forced scoring = greedy decoding)
uses a tiny random fot_jax model."""
import numpy as np
import pytest

from data_pipelines import train_tokenizer
from data_pipelines.vocab import get_vocabulary
from fot_jax.eval import niah, passkey, retrieval
from fot_jax.eval.effective_length import effective_length
from fot_jax.inference import MemoryInference
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

BYTE = get_vocabulary("byte")
CODE = ["import os\n\ndef f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n# a comment line\n" * 30]


class PerfectStub:
  """Scoring-only stub: 'predicts' every next token of the sequence it is given."""

  def __init__(self, vocab_size, fail_lengths=()):
    self.v, self.fail = vocab_size, fail_lengths

  def logits(self, tokens, mask):
    out = np.zeros(tokens.shape + (self.v,), np.float32)
    b, l = tokens.shape
    nxt = np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    out[np.arange(b)[:, None], np.arange(l)[None], nxt] = 1.0
    for r in range(b):  # rows whose length falls in a failing band get the wrong answer
      n = int(mask[r].sum())
      if any(lo <= n < hi for lo, hi in self.fail):
        out[r, :n - 1] = np.roll(out[r, :n - 1], 1, axis=-1)
    return out


@pytest.fixture(scope="module")
def spm_vocab(tmp_path_factory):
  d = tmp_path_factory.mktemp("spm")
  (d / "a.py").write_text("".join(CODE) + passkey.FILLER * 5 + passkey.PREFIX + "The pass key is 12345.\n")
  return get_vocabulary(train_tokenizer.train_tokenizer(f"files:{d}/*.py", str(d / "m" / "t"), vocab_size=400))


@pytest.mark.parametrize("vocab_name", ["byte", "spm"])
def test_passkey_prompt_decodes_to_the_intended_text(vocab_name, spm_vocab):
  vocab = BYTE if vocab_name == "byte" else spm_vocab
  make = passkey.make_prompt_fn(vocab)
  for depth in (0.0, 0.5, 1.0):
    prompt, answer = make(1024, depth, np.random.default_rng(1))
    ids, start = retrieval.encode(vocab, prompt, answer)
    assert ids[0] == vocab.bos_id
    assert vocab.decode(ids[1:start].tolist()) == prompt
    assert vocab.decode(ids[start:].tolist()).strip() == answer.strip()
    key = int(answer)
    assert prompt.startswith(passkey.PREFIX) and prompt.endswith(passkey.QUESTION)
    assert prompt.count(passkey.needle(key)) == 1
    before = prompt.split(passkey.needle(key))[0][len(passkey.PREFIX):]
    after = prompt.split(passkey.needle(key))[1][:-len(passkey.QUESTION)]
    n_before, n_after = before.count(passkey.FILLER), after.count(passkey.FILLER)
    assert n_before == round(depth * (n_before + n_after))
    if vocab_name == "byte":  # filler fits in whole blocks: within one block of the target
      assert 1024 - len(passkey.FILLER) < len(ids) - len(answer) <= 1024


@pytest.mark.parametrize("vocab_name", ["byte", "spm"])
def test_niah_prompts_decode_with_needles_where_intended(vocab_name, spm_vocab):
  vocab = BYTE if vocab_name == "byte" else spm_vocab
  hay = niah.Haystack(vocab, CODE)
  single = niah.make_prompt_fn(vocab, hay, 1)
  prompt, answer = single(512, 0.0, np.random.default_rng(0))
  ids, start = retrieval.encode(vocab, prompt, answer)
  assert vocab.decode(ids[1:start].tolist()) == prompt
  assert prompt.startswith(niah.needle(int(answer)))  # depth 0: the first line
  assert prompt.endswith(niah.question())
  prompt, answer = single(512, 1.0, np.random.default_rng(0))
  assert prompt.endswith(niah.needle(int(answer)) + niah.question())  # depth 1: just before the question
  prompt, _ = single(512, 0.5, np.random.default_rng(0))
  at = prompt.index("# The secret number is")
  assert prompt[at - 1] == "\n" and 0.3 < at / len(prompt) < 0.7  # on a line of its own, mid-way
  multi = niah.make_prompt_fn(vocab, hay, 4)
  prompt, answer = multi(512, 0.5, np.random.default_rng(2))
  asked = prompt.rsplit("secret number for ", 1)[1].split(" is")[0]
  assert prompt.count("# The secret number for ") == 4
  assert niah.needle(int(answer), asked) in prompt
  if vocab_name == "byte":
    assert abs(len(ids) - 512) <= 8


def test_scoring_with_a_perfect_stub_and_a_dip():
  make = passkey.make_prompt_fn(BYTE)
  res = retrieval.grid(PerfectStub(BYTE.vocab_size), BYTE, make, [512, 1024], [0.0, 1.0], trials=2, seed=0)
  assert res["accuracy"] == [[1.0, 1.0], [1.0, 1.0]] and res["effective_length"] == 1024
  # Wrong on prompts of 600-1100 tokens: the 1024 row fails though 2048 passes, so the
  # effective length stops at 512.
  stub = PerfectStub(BYTE.vocab_size, fail_lengths=[(600, 1100)])
  res = retrieval.grid(stub, BYTE, make, [512, 1024, 2048], [0.0, 0.5], trials=2, seed=0)
  assert res["accuracy_per_length"] == [1.0, 0.0, 1.0]
  assert res["effective_length"] == 512


def test_effective_length_rules():
  assert effective_length([1, 2, 4, 8], [1.0, 0.95, 0.5, 1.0], 0.9) == 2  # a dip ends it
  assert effective_length([8, 1, 4, 2], [1.0, 1.0, 1.0, 1.0], 0.9) == 8  # order of the input does not matter
  assert effective_length([1, 2], [0.1, 1.0], 0.9) is None
  assert effective_length([1, 2, 4], [3.0, 5.0, 12.0], 6.0, higher_is_better=False) == 2
  with pytest.raises(ValueError, match="2 lengths but 1 scores"):
    effective_length([1, 2], [1.0], 0.5)


def test_teacher_forced_score_equals_greedy_decoding():
  # A random tiny model with memory (prompts span several windows): take its own greedy
  # continuation as the "answer"; scoring must accept it and reject a changed last token.
  cfg = get_size("tiny", vocab_size=BYTE.vocab_size)
  infer = MemoryInference(cfg, init_params(cfg, 0), window=16, mode="dense")
  model = retrieval.InferenceModel(infer)
  rng = np.random.default_rng(0)
  examples, wrong = [], []
  for n in (37, 50):
    prompt = np.concatenate([[BYTE.bos_id], rng.integers(3, 259, n - 1)]).astype(np.int32)
    full = infer.generate(prompt[None], 4)[0]
    examples.append((full, n))
    bad = full.copy()
    bad[-1] = (bad[-1] + 1) % cfg.vocab_size
    wrong.append((bad, n))
  assert retrieval.score(model, examples, batch=2).tolist() == [True, True]
  assert retrieval.score(model, wrong, batch=2).tolist() == [False, False]
