"""One corpus field: an LM experiment names its text once (`data.corpus`) and every text view reads
it unless the view names its own; the held-out documents are checked before the first step."""
import json

import pytest

from data_pipelines import sources
from experiments import smollm2_fot, smollm2_retrieval, stdlib_lm_tiny
from fot_jax import configs
from fot_jax.runners import lm_data

MINE = "jsonl:/data/my_corpus.jsonl"


@pytest.mark.parametrize("make", [lambda: smollm2_fot.get_config(), lambda: smollm2_fot.get_config("quick"),
                                  lambda: smollm2_retrieval.get_config(), lambda: smollm2_retrieval.get_config("lookalike"),
                                  lambda: stdlib_lm_tiny.get_config()],
                         ids=["smollm2_fot", "smollm2_fot:quick", "smollm2_retrieval", "smollm2_retrieval:lookalike",
                              "stdlib_lm_tiny"])
def test_one_override_moves_every_view_to_your_corpus(make):
  config = make()
  config.data.corpus = MINE
  lm = configs.resolve(config, check_data=False).lm
  views = lm.views
  assert views[-1][0] == "held-out evaluation" and views[-1][3] == "validation"
  for view, field, task, _ in views:
    if task == "stdlib_passkey":  # stdlib_lm_tiny's passkey view names its own mixture
      assert field == "data.repeats.stdlib_pk.task", view
      continue
    assert (task, field) == (MINE, "data.corpus"), view
  # what a run prints first: the corpus, then every view with what it reads
  text = lm_data.format_corpus_views(lm)
  assert text.splitlines()[0] == f"data: corpus {MINE!r} (data.corpus); each view reads:"
  assert len(text.splitlines()) == len(views) + 1
  assert ("<- not the corpus" in text) == any(t != MINE for _, _, t, _ in views)


def test_a_view_that_names_its_own_text_and_an_unread_task_show_at_the_start():
  config = smollm2_fot.get_config()
  config.data.corpus, config.data.eval_task = MINE, "stdlib"
  config.data.repeats.mixed.task = "stdlib"
  lm = configs.resolve(config, check_data=False).lm
  views = {v[0]: v for v in lm.views}
  assert views["repeat view 'repeat'"][1:3] == ("data.corpus", MINE)
  assert views["repeat view 'mixed'"][1:3] == ("data.repeats.mixed.task", "stdlib")
  assert views["held-out evaluation"][1:3] == ("data.eval_task", "stdlib")
  assert lm_data.format_corpus_views(lm).count("<- not the corpus") == 2
  # the way docs used to say (data.task): no phase of this curriculum reads it, and the run says so
  config = smollm2_fot.get_config()
  config.data.task = MINE
  assert "note: data.task='jsonl:/data/my_corpus.jsonl' is read by no phase" in lm_data.format_corpus_views(
      configs.resolve(config, check_data=False).lm)


def test_an_experiment_without_text_fails_naming_the_corpus_field():
  config = stdlib_lm_tiny.get_config()
  config.data.corpus = ""
  with pytest.raises(ValueError, match=r"data\.corpus: required"):
    configs.resolve(config, check_data=False)


def jsonl_corpus(path, held_out_lengths, train_docs=24):
  """A jsonl corpus whose held-out split (sources.heldout of each line) is documents of the given
  character lengths, and whose training split is `train_docs` documents of 600 characters."""
  lines, want, i = [], list(held_out_lengths), 0
  n_train = 0
  while want or n_train < train_docs:
    size = want[0] if want else 600
    line = json.dumps({"text": (f"doc {i}: " + "the quick brown fox jumps. " * 40)[:size]})
    i += 1
    if sources.heldout(line.encode(), sources.HELDOUT_PERCENT):
      if want and len(json.loads(line)["text"]) == want[0]:
        lines.append(line)
        want.pop(0)
    elif n_train < train_docs:
      lines.append(line)
      n_train += 1
  path.write_text("\n".join(lines) + "\n")
  return f"jsonl:{path}"


def test_held_out_documents_too_short_for_the_evaluation_fail_before_training(tmp_path):
  """Byte vocabulary: a document of n characters is n + 2 tokens (bos, eos). Two held-out documents
  of 100 and 300 characters: the evaluation needs 2 of 161 tokens (128 memory + 32 scored + 1)."""
  config = stdlib_lm_tiny.get_test_config()
  config.data.corpus = jsonl_corpus(tmp_path / "mine.jsonl", [300, 100])
  with pytest.raises(ValueError, match=r"eval: 1 of the eval.n_docs=2 held-out documents of 'jsonl:.*mine.jsonl' "
                                       r"split 'validation' have the 161 tokens .* its 2 longest at least 102 tokens: make "
                                       r"max\(eval.memory_tokens\) \+ eval.score_tokens at most 101"):
    configs.resolve(config)
  config.eval.memory_tokens, config.eval.score_tokens = (0, 64), 32  # 64 + 32 + 1 <= 102: it fits
  docs = configs.resolve(config).lm.held_out()
  assert sorted(len(d) for d in docs) == [102, 302]
