"""RULER-style suite (fot_jax/eval/ruler.py): prompts under three vocabularies, the string-match
scoring, evaluate() end to end with an answering stub, and one tiny random model through
MemoryInference.generate.

The stub below reads the answer off the prompt text with regexes: it exists only to check the
scoring and never appears in results."""
import collections
import os
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_pipelines import train_tokenizer
from data_pipelines.vocab import get_vocabulary
from fot_jax import checkpoint
from fot_jax.eval import report, ruler, suite
from fot_jax.eval import settings as eval_settings
from fot_jax.inference import MemoryInference, end_aligned
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

BYTE = get_vocabulary("byte")
# the training task's wording (data_pipelines/retrieval_docs.py): held out of every evaluation template
TRAINING_PHRASES = ("has the", "equals", "was set to", "is listed with", "assigned to", "Write down", "Fact:",
                    "Record", "ledger")


def _sample_text():
  rng = np.random.default_rng(123)
  return "\n".join(ruler.make_task(t, BYTE)(1024, rng)[0] for t in ruler.TASKS)


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory):
  """byte, a SentencePiece model and a byte-level BPE tokenizer.json, both trained on the spot."""
  d = tmp_path_factory.mktemp("ruler_vocab")
  (d / "text.txt").write_text(_sample_text())
  spm = train_tokenizer.train_tokenizer(f"files:{d}/*.txt", str(d / "spm" / "t"), vocab_size=400)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([_sample_text()], trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(d / "tokenizer.json"))
  return {"byte": BYTE, "spm": get_vocabulary(spm), "hf": get_vocabulary(str(d / "tokenizer.json"))}


def _count(text, value):
  return len(re.findall(rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])", text))


def _needles(prompt):
  """(key, value) of every needle of the NIAH templates, and the question's keys."""
  pairs, asked = [], []
  for needle, question, _ in ruler.NEEDLE_TEMPLATES:
    pat = re.escape(needle).replace(r"\{key\}", r"([0-9a-z-]+)").replace(r"\{value\}", r"(\d+)")
    pairs += re.findall(pat, prompt)
    q = re.search(re.escape(question).replace(r"\{keys\}", "(.+?)"), prompt)
    if q:
      asked = re.split(r", | and ", q.group(1))
  return pairs, asked


def _vt_answer(prompt):
  """The variables of the asked chain, resolved from the VAR lines."""
  value = re.search(r"hold the value (\d+) in the text above", prompt).group(1)
  holds = {}
  for name, src in re.findall(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+)\.", prompt):
    holds[name] = src if src.isdigit() else holds[src[4:]]
  return [n for n, v in holds.items() if v == value]


def _fwe_answer(prompt):
  body = prompt[len(ruler.FWE_INTRO):prompt.index("\n" + ruler.FWE_QUESTION)]
  return [w for w, _ in collections.Counter(body.split()).most_common(3)]


def answer(prompt):
  """The stub's answer: what a perfect reader would say."""
  if prompt.startswith(ruler.VT_INTRO):
    return _vt_answer(prompt)
  if prompt.startswith(ruler.FWE_INTRO):
    return _fwe_answer(prompt)
  pairs, asked = _needles(prompt)
  return [v for k, v in pairs if k in asked]


@pytest.mark.parametrize("vocab_name", ["byte", "spm", "hf"])
def test_prompts_decode_fit_and_hold_their_answers(vocab_name, vocabs):
  vocab = vocabs[vocab_name]
  for task in ruler.TASKS:
    make = ruler.make_task(task, vocab)
    for length in (1024, 4096):
      prompt, expected = make(length, np.random.default_rng([length, 5]))
      ids = vocab.encode(prompt)
      assert vocab.decode(ids) == prompt, (task, vocab_name)
      assert abs(len(ids) + 1 - length) <= 0.1 * length, (task, vocab_name, len(ids))
      assert prompt.endswith(("are", "are:")) and answer(prompt) and sorted(answer(prompt)) == sorted(expected)
      if task == "fwe":
        counts = collections.Counter(prompt[len(ruler.FWE_INTRO):].split("\n")[0].split())
        ranked = sorted(counts.values(), reverse=True)
        assert ranked[2] > ranked[3] and min(counts[w] for w in expected) == ranked[2]
        continue
      for v in expected:  # each value / name stated once (a vt name once defined, once used)
        assert _count(prompt, v) == (2 if task == "vt" and v != expected[-1] else 1), (task, v)
      if task == "vt":
        assert len(expected) == ruler.VT_NAMES and len(re.findall("VAR [A-Z]+ = ", prompt)) == (
            ruler.VT_NAMES * ruler.VT_CHAINS)
        continue
      pairs, asked = _needles(prompt)
      keys = [k for k, _ in pairs]
      assert all(k in keys for k in asked)
      if task == "multikey":  # a haystack of needles: distinct keys, the asked one once
        assert len(asked) == 1 and len(set(keys)) == len(keys) >= length // 200
        assert len({v for _, v in pairs}) == len(pairs)
      elif task == "multivalue":
        assert len(asked) == 1 and keys == asked * ruler.N_VALUES and len(expected) == ruler.N_VALUES
      elif task == "multiquery":
        assert sorted(asked) == sorted(keys) and len(set(keys)) == ruler.N_VALUES == len(expected)
      else:
        assert len(pairs) == 1 and asked == keys


def test_prompts_are_seeded_and_varied():
  for task in ruler.TASKS:
    make = ruler.make_task(task, BYTE)
    a, b = make(1024, np.random.default_rng(7)), make(1024, np.random.default_rng(7))
    assert a == b
    assert make(1024, np.random.default_rng(8)) != a
  # templates and key kinds vary across prompts; the essay is not one repeated block
  rng = np.random.default_rng(0)
  prompts = [ruler.make_task("niah_essay", BYTE)(600, rng)[0] for _ in range(30)]
  assert all(any(t[0].split("{")[0] in p for p in prompts) for t in ruler.NEEDLE_TEMPLATES)
  keys = [_needles(p)[1][0] for p in prompts]
  assert any(k.isdigit() for k in keys) and any(re.fullmatch("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}", k) for k in keys)
  assert any(re.fullmatch("[a-z]+-[a-z]+", k) for k in keys)
  sentences = re.split(r"(?<=\.) ", prompts[0])
  assert len(set(sentences)) > 0.9 * len(sentences)


def test_templates_held_out_from_training():
  assert len(ruler.EVAL_TEMPLATES) >= 10
  for phrase in ruler.EVAL_TEMPLATES:
    assert not any(t.lower() in phrase.lower() for t in TRAINING_PHRASES), phrase
  text = _sample_text()
  assert any(p in text for p in ruler.EVAL_TEMPLATES)


def test_score_output():
  s = ruler.score_output
  assert s(" 1234567.", ["1234567"]) == 1.0
  assert s(" 1234567, 765432 and 5550001.", ["765432", "1234567", "5550001", "999999"]) == 0.75
  assert s(" The number is 1234567; I am sure. Other numbers: 42, 77.", ["1234567"]) == 1.0
  assert s(" 91234567 and 12345678", ["1234567"]) == 0.0  # inside longer numbers
  assert s(" 1234567.5", ["1234567"]) == 1.0  # '.' is not a digit
  assert s("", ["1234567", "765432"]) == 0.0
  assert s(" ABCDE, fghij and XABCDEX", ["ABCDE", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)  # case-insensitive
  assert s(" defo, defos", ["defo", "puvu"]) == 0.5
  with pytest.raises(ValueError, match="no expected values"):
    s("x", [])


def test_evaluate_end_to_end_with_an_answering_stub(capsys):
  calls = []

  def perfect(prompts, max_new_tokens):
    calls.append(max_new_tokens)
    return [" " + ", ".join(answer(p)) + "." for p in prompts]

  res = ruler.evaluate(perfect, BYTE, ruler.TASKS, [2048, 1024], trials=2, seed=0, name="stub")
  assert res["lengths"] == [1024, 2048] and res["trials"] == 2 and res["threshold"] == ruler.THRESHOLD
  for task in ruler.TASKS:
    r = res["tasks"][task]
    assert r["accuracy"] == [1.0, 1.0] and r["effective_length"] == 2048
    assert abs(r["tokens"][1] - 2048) < 100
    sample = res["samples"][task][0]
    assert sample["score"] == 1.0 and sorted(sample["output"].strip(" .").split(", ")) == sorted(sample["expected"])
  assert res["average"] == [1.0, 1.0] and res["effective_length"] == 2048
  assert min(calls) >= 8 + 2 and "ruler vt: length   2,048" in capsys.readouterr().out

  # first value only, and nothing at all for prompts past 1,500 tokens
  def partial(prompts, max_new_tokens):
    return [" " + answer(p)[0] if len(p) < 1500 else " none" for p in prompts]

  res = ruler.evaluate(partial, BYTE, ["niah_noise", "multivalue", "fwe"], [1024, 2048], trials=2, seed=0)
  assert res["tasks"]["niah_noise"]["accuracy"] == [1.0, 0.0]
  assert res["tasks"]["multivalue"]["accuracy"] == [0.25, 0.0]
  assert res["tasks"]["fwe"]["accuracy"] == pytest.approx([1 / 3, 0.0])
  assert res["average"] == pytest.approx([(1 + 0.25 + 1 / 3) / 3, 0.0])
  assert res["tasks"]["niah_noise"]["effective_length"] == 1024 and res["effective_length"] is None


def test_a_killed_evaluation_resumes_prompt_by_prompt(tmp_path):
  """4 prompts, 2 a batch: killed after the first batch, the same call generates only the other
  two and returns what an uninterrupted run returns, every prompt's output and score included."""
  from fot_jax.eval.retrieval import PromptRecords
  seen = []

  def half(prompts, max_new_tokens, fail=False):  # the first value only: multivalue scores 0.25
    if fail and seen:
      raise KeyboardInterrupt("killed")
    seen.append(len(prompts))
    return [" " + answer(p)[0] for p in prompts]

  args = (BYTE, ["multivalue"], [1024, 2048], 2, 0)
  reference = ruler.evaluate(half, *args, batch=2)
  assert seen == [2, 2] and reference["tasks"]["multivalue"]["accuracy"] == [0.25, 0.25]
  path = str(tmp_path / "ruler.prompts.jsonl")
  seen.clear()
  with pytest.raises(KeyboardInterrupt):
    ruler.evaluate(lambda p, n: half(p, n, fail=True), *args, batch=2, records=PromptRecords(path, "m"))
  seen.clear()
  out = ruler.evaluate(half, *args, batch=2, records=PromptRecords(path, "m"))
  assert seen == [2] and out == reference
  listed = out["prompts"]["multivalue"]
  assert [(p["length"], p["trial"]) for p in listed] == [(1024, 0), (1024, 1), (2048, 0), (2048, 1)]
  assert all(p["output"].strip() in p["expected"] and p["score"] == 0.25 for p in listed)


def test_real_tiny_model_through_generate_and_the_suite(tmp_path):
  # a random model answers nothing; this checks the plumbing: bos + prompt windows with memory,
  # greedy continuation decoded from the new tokens only; then the suite's JSON, plot and report
  cfg = get_size("tiny", vocab_size=BYTE.vocab_size)
  params = init_params(cfg, 0)
  infer = MemoryInference(cfg, params, window=16, mode="dense")
  prompts = [ruler.make_task("niah_noise", BYTE)(600, np.random.default_rng(i))[0] for i in range(2)]
  out = ruler.Generator(infer, BYTE, batch=2)(prompts, 6)
  ids = [np.asarray([BYTE.bos_id] + BYTE.encode(p), np.int32) for p in prompts]
  done = infer.generate(ids, 6)
  assert out == [BYTE.decode(d[len(i):].tolist()) for i, d in zip(ids, done)]
  for i, d in zip(ids, done):  # greedy: each new token is the argmax of a plain forward pass over what
    # precedes it, windows placed as generate places them (the prompt's last 16 - 6 tokens in the current one)
    placed, mask, pads = end_aligned([i], 16, 10)
    placed = np.concatenate([placed[:, :pads[0] + len(i)], d[None, len(i):]], 1)
    logits = infer.process(placed, infer.new_memory(1), np.arange(placed.shape[1])[None] >= pads[0])[0, pads[0]:]
    np.testing.assert_array_equal(logits[len(i) - 1:-1].argmax(-1), d[len(i):])
  ck = str(tmp_path / "ckpt")
  checkpoint.save(ck, params, cfg, 16, vocab="byte")
  c = eval_settings.default_config()
  c.batch = 2
  c.ruler.update(tasks=("niah_noise",), lengths=(600,), trials=2)
  res = suite.run(ck, ["ruler"], str(tmp_path / "w"), c, name="tiny")["ruler"]
  assert 0.0 <= res["tasks"]["niah_noise"]["accuracy"][0] <= 1.0 and len(res["samples"]["niah_noise"]) == 1
  assert res["window"] == 16 and res["config"]["ruler"]["trials"] == 2
  files = os.listdir(tmp_path / "w" / "eval")
  assert {"ruler.json", "ruler.png", "report.md"} <= set(files)
  assert "## ruler" in (tmp_path / "w" / "eval" / "report.md").read_text()


def test_report_table_and_plot(tmp_path):
  res = {"tasks": {"vt": {"lengths": [512, 1024], "accuracy": [1.0, 0.5], "effective_length": 512},
                   "fwe": {"lengths": [512, 1024], "accuracy": [0.5, 0.0], "effective_length": None}},
         "lengths": [512, 1024], "average": [0.75, 0.25], "effective_length": None, "threshold": 0.856}
  text = report.tables("ruler", {"a": res, "b": res})
  assert "| 1,024 | 0.500 | 0.000 | 0.250 |" in text and "effective length" in text
  assert report.plot_suite("ruler", {"a": res}, str(tmp_path)) == ["ruler.png"]
  assert (tmp_path / "ruler.png").stat().st_size > 0
