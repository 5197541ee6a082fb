"""SeqIO tasks through the pipeline: local files and JSON lines (gzip), bad input, shards,
resume through tf.data, mock TFDS, the stdlib corpus, synthetic tasks, mixtures, vocabularies,
preview and the train_tokenizer command."""
import collections
import gzip
import json
import os
import re

import numpy as np
import pytest
import seqio
import tensorflow_datasets as tfds

from data_pipelines import pipeline, preview, tasks, train_tokenizer
from data_pipelines.slots import EmptySourceError
from data_pipelines.vocab import check_fits, get_vocabulary

BYTE = get_vocabulary("byte")


def _corpus(tmp_path, n=9):
  texts = [f"document {i}: " + "abcdefghij"[i % 10] * (5 + 7 * i) for i in range(n)]
  d = tmp_path / "corpus"
  d.mkdir()
  for i, t in enumerate(texts):
    if i % 3 == 0:
      with gzip.open(d / f"{i:02d}.txt.gz", "wt") as f:
        f.write(t)
    else:
      (d / f"{i:02d}.txt").write_text(t)
  return str(d), texts


def _drain(batcher, limit=10000):
  out = []
  for step in range(limit):
    try:
      out.append(batcher(step))
    except StopIteration:
      return out
  return out


def _documents_seen(batches, vocab=BYTE):
  """doc id -> decoded text of its scored targets (document tokens, without the eos)."""
  toks = collections.defaultdict(list)
  for b in batches:
    m = b["loss_mask"] & (b["targets"] != vocab.eos_id)
    for d, t in zip(b["doc_ids"][m].tolist(), b["targets"][m].tolist()):
      toks[d].append(t)
  return {d: vocab.decode(t) for d, t in toks.items()}


def _batcher(task, **kw):
  args = dict(slots=2, windows=2, window=8, seed=0, repeat=False)
  args.update(kw)
  return pipeline.lm_batches(task, BYTE, **args)


def test_files_task_emits_every_document_once_including_gzip(tmp_path):
  path, texts = _corpus(tmp_path)
  seen = _documents_seen(_drain(_batcher(f"files:{path}")))
  assert sorted(seen.values()) == sorted(texts)


def test_two_shards_never_share_a_document_and_cover_the_corpus(tmp_path):
  path, texts = _corpus(tmp_path, n=11)
  shards = [_documents_seen(_drain(_batcher(f"files:{path}", shard_info=seqio.ShardInfo(i, 2)))) for i in (0, 1)]
  assert not set(shards[0].values()) & set(shards[1].values())
  assert not set(shards[0]) & set(shards[1])  # document ids are unique across shards too
  assert sorted(list(shards[0].values()) + list(shards[1].values())) == sorted(texts)


def test_resume_through_tf_data_continues_exactly_across_epochs(tmp_path):
  path, _ = _corpus(tmp_path)
  full = _batcher(f"files:{path}", repeat=True)
  full_batches = [full(s) for s in range(30)]  # several shuffled epochs
  first = _batcher(f"files:{path}", repeat=True)
  for s in range(11):
    first(s)
  resumed = _batcher(f"files:{path}", repeat=True)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as saved in a checkpoint
  for s in range(11, 30):
    b = resumed(s)
    for k in b:
      np.testing.assert_array_equal(b[k], full_batches[s][k])
  assert len(full.reader.epoch_starts) > 2


def test_jsonl_task_with_bad_input_is_counted_and_skipped(tmp_path):
  d = tmp_path / "j"
  d.mkdir()
  with gzip.open(d / "a.jsonl.gz", "wt") as f:
    f.write(json.dumps({"text": "first good document"}) + "\n{broken json\n")
    f.write(json.dumps({"body": "no text field"}) + "\n" + json.dumps({"text": ""}) + "\n")
  (d / "b.jsonl").write_text(json.dumps({"text": "second good document"}) + "\n")
  (d / "c.jsonl.gz").write_bytes(b"not gzip at all")
  tasks.register_jsonl_task("test_jsonl", str(d / "*.jsonl*"), heldout_percent=0)  # every line in train
  b = _batcher("test_jsonl")
  seen = _documents_seen(_drain(b))
  assert sorted(seen.values()) == ["first good document", "second good document"]
  counts = b.bad_input().counts
  assert counts["bad_json"] == 1 and counts["missing_field"] == 1 and counts["empty"] == 1
  assert counts["unreadable"] == 1


def test_text_files_bad_input_skip_truncate_and_report(tmp_path):
  d = tmp_path / "t"
  d.mkdir()
  (d / "empty.txt").write_text("")
  (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
  (d / "huge.txt").write_text("x" * 5000)
  (d / "ok.txt").write_text("fine text")
  os.symlink(str(d / "missing-target"), str(d / "dangling.txt"))
  tasks.register_files_task("test_bad_files", str(d / "*.txt"), invalid_utf8="skip", max_bytes=100,
                            heldout_percent=0)  # every file in train
  b = _batcher("test_bad_files")
  seen = sorted(_documents_seen(_drain(b)).values())
  assert seen == ["fine text", "x" * 100]
  stats = b.bad_input()
  assert dict(stats.counts) == {"empty": 1, "invalid_utf8": 1, "truncated": 1, "unreadable": 1}
  assert "dangling.txt" in stats.report()


def test_empty_source_fails_at_start_naming_it(tmp_path):
  with pytest.raises(ValueError, match="no files match.*nothing-here"):
    pipeline.lm_batches(f"files:{tmp_path}/nothing-here/*.txt", BYTE, slots=2, windows=1, window=8).check_nonempty()
  (tmp_path / "e").mkdir()
  (tmp_path / "e" / "a.txt").write_text("")
  with pytest.raises(EmptySourceError, match="yielded no documents"):
    pipeline.lm_batches(f"files:{tmp_path}/e", BYTE, slots=2, windows=1, window=8).check_nonempty()
  with pytest.raises(ValueError, match="unknown task or mixture 'nope'"):
    tasks.get_provider("nope")


def test_missing_tfds_data_fails_clearly_without_downloading(tmp_path, monkeypatch):
  tasks.register_tfds_task("test_pg19_missing", "pg19:0.1.1", text_key="book_text", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="cannot read 'test_pg19_missing'.*could not find data"):
    _batcher("test_pg19_missing").check_nonempty()
  assert not list(tmp_path.iterdir())


def test_mock_tfds_tasks_load():
  with tfds.testing.mock_data(num_examples=4):
    for name in ("pg19", "c4", "tfds:c4/en:3.1.0"):  # the last: any TFDS text dataset by name
      batch = _batcher(name, repeat=True)(0)
      assert batch["inputs"].shape == (4, 8)
      assert (batch["doc_ids"] >= 0).all() and batch["loss_mask"].any()


def test_stdlib_corpus_and_its_heldout_split():
  train_paths = tasks.sources.stdlib_paths("train")
  heldout = tasks.sources.stdlib_paths("validation")
  assert len(train_paths) + len(heldout) > 500 and heldout and not set(train_paths) & set(heldout)
  batch = _batcher("stdlib", split="validation", window=64)(0)
  text = preview.render(BYTE, None, batch["inputs"][0])
  assert text.startswith("<bos>") and len(text) > 30


def test_synthetic_tasks_and_longllama_mixture(tmp_path):
  b = pipeline.lm_batches("dictionary_lookup", get_vocabulary("dictionary_lookup"), slots=2, windows=2,
                          window=16)
  assert b(0)["inputs"].max() < get_vocabulary("dictionary_lookup").vocab_size
  with pytest.raises(ValueError, match="holds token ids"):
    pipeline.lm_batches("dictionary_lookup", BYTE, slots=1, windows=1, window=8)(0)
  text = preview.render(BYTE, None, _batcher("passkey", window=64, repeat=True)(0)["inputs"][0])
  assert "important info" in text
  path, texts = _corpus(tmp_path)
  tasks.register_files_task("test_python", path)
  mix = tasks.register_longllama_mixture("test_longllama", {"python": "test_python", "book": "passkey"})
  rates = {t.name: mix.get_rate(t) for t in mix.tasks}
  assert rates["test_python"] / rates["passkey"] == pytest.approx(0.25 / 0.10)
  batch = _batcher("test_longllama", repeat=True, window=32)(0)
  assert batch["loss_mask"].any()
  with pytest.raises(ValueError, match="map some of"):
    tasks.register_longllama_mixture("bad", {"novels": "passkey"})


def test_preview_prints_pinned_slots_and_json(tmp_path, capsys):
  path, _ = _corpus(tmp_path)
  preview.main([f"--task=files:{path}", "--slots=2", "--windows=3", "--seq_len=8", "--batches=2", "--json"])
  lines = capsys.readouterr().out.strip().splitlines()
  batches = [json.loads(l) for l in lines]
  assert [b["batch"] for b in batches] == [0, 1] and len(batches[0]["rows"]) == 6
  for b in batches:
    for row in b["rows"]:
      assert row["slot"] == row["row"] // 3 and len(row["doc_ids"]) == 8
  # the slot's last document id in batch 0 continues at the start of batch 1
  for s in range(2):
    assert batches[1]["rows"][s * 3]["doc_ids"][0] == batches[0]["rows"][s * 3 + 2]["doc_ids"][-1]
  text = preview.preview(f"files:{path}", 2, 3, 8, 1)
  assert "slot   1 window 2" in text and "<bos>documen" in text


def test_vocab_mismatch_and_sentencepiece_training(tmp_path):
  with pytest.raises(ValueError, match="260 tokens.*model.vocab_size=100"):
    check_fits(BYTE.vocab_size, 100)
  path, _ = _corpus(tmp_path)
  model = train_tokenizer.train_tokenizer(f"files:{path}", str(tmp_path / "spm" / "t"), vocab_size=300)
  vocab = get_vocabulary(model)
  text = "document 3:  dddd\n  indented"
  assert vocab.decode(vocab.encode(text)) == text
  assert (vocab.bos_id, vocab.eos_id) == (1, 2)
  with pytest.raises(ValueError, match="neither 'byte' nor an existing SentencePiece"):
    get_vocabulary(str(tmp_path / "missing.model"))


def test_short_passkey_documents_fit_their_windows():
  from data_pipelines import passkey
  rng = np.random.default_rng(0)
  docs = [passkey.short_passkey_document(rng, 256, 192) for _ in range(200)]
  lengths = [len(d["text"]) for d in docs]
  assert max(lengths) <= 256 and np.mean(lengths) > 192 - 20  # whole sentences: a little under min_bytes
  for d in docs:
    key = d["passkey"]
    assert d["text"].count(passkey.needle(key)) == 1
    assert d["text"].endswith(f"{passkey.QUESTION} {key}.")
  assert len({d["depth"] for d in docs}) > 3  # the needle moves through the filler
  with pytest.raises(ValueError, match="max_bytes"):
    passkey.short_passkey_document(rng, 64)
  # the registered mixture: both kinds of document (about a quarter of the slot-steps passkeys only
  # once the slots settle: at the start every slot draws, 95% of them passkeys, and stdlib files last longer)
  b = _batcher("stdlib_passkey", slots=8, window=128, repeat=True)
  rows = [BYTE.decode([int(t) for t in r if t > 2]) for s in range(6) for r in b(s)["inputs"]]
  share = np.mean(["pass key" in r for r in rows])
  assert 0.05 < share < 0.95, share


def test_broken_tokenizer_config_fails_naming_the_file(tmp_path):
  from tokenizers import Tokenizer, models
  tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, unk_token="a"))
  tok.save(str(tmp_path / "tokenizer.json"))
  config = tmp_path / "tokenizer_config.json"
  config.write_text('{"bos_token": "<s>", ')  # cut while written
  with pytest.raises(ValueError, match=re.escape(f"tokenizer config {config} is not valid JSON")):
    get_vocabulary(str(tmp_path / "tokenizer.json"))
  config.write_text('["<s>"]')
  with pytest.raises(ValueError, match=re.escape(f"tokenizer config {config} is not a JSON object")):
    get_vocabulary(str(tmp_path / "tokenizer.json"))
  config.write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
  assert get_vocabulary(str(tmp_path / "tokenizer.json")).bos_id == 0
