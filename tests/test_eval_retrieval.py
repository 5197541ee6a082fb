"""Passkey / NIAH prompts and the scoring code of the retrieval suites.

The stub models below exist only to check the scoring: they are not models and never
appear in results. The one real-model check (teacher-forced scoring = greedy decoding)
uses a tiny random fot_jax model."""
import os

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
  plain = niah.make_prompt_fn(vocab, hay, 1, style="plain")  # for prose haystacks: no comment marks
  prompt, answer = plain(512, 1.0, np.random.default_rng(0))
  assert prompt.endswith(f"The secret number is {int(answer)}.\n\nQuestion: what is the secret number? "
                         f"Answer: the secret number is")
  with pytest.raises(ValueError, match="style must be one of"):
    niah.make_prompt_fn(vocab, hay, 1, style="markdown")(512, 0.5, np.random.default_rng(0))


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
  # the recorded answer (argmax at the answer positions) is greedy's continuation up to the first
  # wrong token: here the last one, so all of it
  ((idx, hits, preds),) = list(retrieval.score_batches(model, wrong, batch=2))  # the shapes score compiled
  assert not hits.any() and [preds[r].tolist() for r in np.argsort(idx)] == [f[n:].tolist() for f, n in examples]


class CountingStub(PerfectStub):
  """PerfectStub that counts the prompts it scores and can fail (a simulated kill) after
  `fail_after` batches."""

  def __init__(self, vocab_size, fail_lengths=(), fail_after=None):
    super().__init__(vocab_size, fail_lengths)
    self.rows, self.batches, self.fail_after = 0, 0, fail_after

  def logits(self, tokens, mask):
    if self.fail_after is not None and self.batches >= self.fail_after:
      raise KeyboardInterrupt("killed")
    self.batches += 1
    self.rows += len(tokens)
    return super().logits(tokens, mask)


def test_a_killed_grid_resumes_prompt_by_prompt(tmp_path):
  """4 prompts, 1 a batch, wrong on the 1024-token ones: killed after 2 batches, the same call
  scores only the other 2 and returns what an uninterrupted run returns, answers included."""
  make = passkey.make_prompt_fn(BYTE)
  args = (BYTE, make, [512, 1024], [0.0, 1.0], 1, 0)
  kw = dict(batch=1, suite="passkey")
  whole = CountingStub(BYTE.vocab_size, fail_lengths=[(900, 1100)])
  reference = retrieval.grid(whole, *args, **kw)
  assert whole.rows == 4 and reference["accuracy"] == [[1.0, 1.0], [0.0, 0.0]]
  path = str(tmp_path / "passkey.prompts.jsonl")
  with pytest.raises(KeyboardInterrupt):
    retrieval.grid(CountingStub(BYTE.vocab_size, [(900, 1100)], fail_after=2), *args, **kw,
                   records=retrieval.PromptRecords(path, "model-a"))
  assert len(open(path).read().splitlines()) == 2
  resumed = CountingStub(BYTE.vocab_size, fail_lengths=[(900, 1100)])
  out = retrieval.grid(resumed, *args, **kw, records=retrieval.PromptRecords(path, "model-a"))
  assert resumed.rows == 2 and out == reference
  for p in out["prompts"]:  # each prompt's expected and teacher-forced answer text
    assert p["correct"] == (p["length"] == 512) and p["expected"].strip() == str(int(p["expected"]))
    assert (p["answer"] == p["expected"]) == p["correct"]
  # another model (key) or seed: nothing reused
  other = CountingStub(BYTE.vocab_size)
  retrieval.grid(other, *args, **kw, records=retrieval.PromptRecords(path, "model-b"))
  assert other.rows == 4
  # a line cut by a kill is dropped (and cut off the file), its prompt scored again
  with open(path, "a") as f:
    f.write('{"key": "')
  again = CountingStub(BYTE.vocab_size, fail_lengths=[(900, 1100)])
  assert retrieval.grid(again, *args, **kw, records=retrieval.PromptRecords(path, "model-a")) == reference
  assert again.rows == 0 and open(path).read().endswith("}\n")


SLOW_GRID = """# A 4-prompt grid, one prompt a batch, each batch taking SLEEP seconds:
# python slow_grid.py RECORDS SLEEP
import sys
import time

import numpy as np

from fot_jax.eval import retrieval


class Vocab:  # one id per character, bos 1
  bos_id, vocab_size = 1, 130

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids if i > 1)


class Slow:  # predicts every next token, after a sleep
  def __init__(self, sleep=0.0):
    self.sleep, self.rows = sleep, 0

  def logits(self, tokens, mask):
    time.sleep(self.sleep)
    self.rows += len(tokens)
    out = np.zeros(tokens.shape + (130,), np.float32)
    nxt = np.concatenate([tokens[:, 1:], tokens[:, :1]], 1)
    out[np.arange(len(tokens))[:, None], np.arange(tokens.shape[1])[None], nxt] = 1.0
    return out


def make(length, depth, rng):
  key = int(rng.integers(10000, 99999))
  return "x" * length + f"key {key} at {depth}? ", str(key)


def run(model, records=None):
  return retrieval.grid(model, Vocab(), make, [20, 40], [0.0, 1.0], 1, 0, batch=1, suite="s", records=records)


if __name__ == "__main__":
  print(run(Slow(float(sys.argv[2])), retrieval.PromptRecords(sys.argv[1], "m"))["accuracy"])
"""


def test_sigkill_mid_evaluation_then_only_the_missing_prompts_run(tmp_path):
  """A real kill -9 of a 4-prompt evaluation after 2 recorded prompts: the resumed run scores
  only the prompts not recorded and returns what an uninterrupted run returns."""
  import importlib.util
  import json
  import signal
  import subprocess
  import sys
  import time
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script, path = tmp_path / "slow_grid.py", tmp_path / "s.prompts.jsonl"
  script.write_text(SLOW_GRID)
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, str(script), str(path), "1.0"], env=env, cwd=root,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 120
  while time.time() < deadline and proc.poll() is None and not (path.exists() and path.read_text().count("\n") >= 2):
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  recorded = {json.loads(line)["key"] for line in path.read_text().splitlines()}
  assert 2 <= len(recorded) < 4, proc.stdout.read()
  spec = importlib.util.spec_from_file_location("slow_grid", script)
  slow = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(slow)
  model = slow.Slow()
  out = slow.run(model, retrieval.PromptRecords(str(path), "m"))
  assert model.rows == 4 - len(recorded)
  assert out == slow.run(slow.Slow())  # an uninterrupted run, no records
