"""Held-out splits of files: and jsonl: tasks (a hash of a file's relative path / a JSON line's
bytes puts ~5% of the documents in `validation`), splits a task lacks, and the one-line errors of
`python -m data_pipelines.preview` on bad input."""
import json
import re

import pytest
import seqio

from data_pipelines import pipeline, preview, sources, tasks
from data_pipelines.vocab import get_vocabulary


def _texts(task, split):
  ds = tasks.get_provider(task).get_dataset(sequence_length=None, split=split, shuffle=False, use_cached=False)
  return [ex[tasks.TEXT].decode() for ex in ds.as_numpy_iterator()]


def _files(d, names):
  d.mkdir(exist_ok=True)
  for n in names:
    (d / n).write_text(f"the document {n}")
  return {f"the document {n}" for n in names}


def test_files_task_validation_is_heldout_and_shares_no_file_with_train(tmp_path):
  d = tmp_path / "c"
  names = [f"d{i:03d}.txt" for i in range(60)]
  docs = _files(d, names)
  for task in (f"files:{d}", f"files:{d}/*.txt"):  # the same corpus root: the same split
    train, val = _texts(task, "train"), _texts(task, "validation")
    assert val and not set(train) & set(val)
    assert sorted(train + val) == sorted(docs)  # each file once, in one split
    assert len(val) < len(train) / 5
  # stable when files are added: no document changes split
  more = _files(d, [f"e{i:03d}.txt" for i in range(40)])
  train2, val2 = _texts(f"files:{d}", "train"), _texts(f"files:{d}", "validation")
  assert set(val) <= set(val2) and set(train) <= set(train2) and sorted(train2 + val2) == sorted(docs | more)
  # validation is what the documented rule says: a hash of the path relative to the corpus root
  assert set(val) == {f"the document {n}" for n in names if sources.heldout(n, sources.HELDOUT_PERCENT)}


def test_jsonl_task_validation_is_heldout_by_line_and_shares_no_line(tmp_path):
  d = tmp_path / "j"
  d.mkdir()
  lines = [json.dumps({"text": f"line {i}"}) for i in range(200)]
  (d / "a.jsonl").write_text("\n".join(lines[:120]) + "\n")
  (d / "b.jsonl").write_text("\n".join(lines[120:] + lines[:3]) + "\n")  # 3 duplicates: same split as the first
  train, val = _texts(f"jsonl:{d}/*.jsonl", "train"), _texts(f"jsonl:{d}/*.jsonl", "validation")
  assert val and not set(train) & set(val)
  assert sorted(train + val) == sorted([f"line {i}" for i in range(200)] + [f"line {i}" for i in range(3)])
  assert set(val) == {json.loads(l)["text"] for l in lines if sources.heldout(l, sources.HELDOUT_PERCENT)}


def test_unknown_split_fails_naming_the_task_and_its_splits(tmp_path):
  d = tmp_path / "c"
  _files(d, ["a.txt", "b.txt"])
  (tmp_path / "x.jsonl").write_text(json.dumps({"text": "t"}) + "\n")
  byte = get_vocabulary("byte")
  for task in (f"files:{d}", f"jsonl:{tmp_path}/x.jsonl", "stdlib", "passkey"):
    with pytest.raises(ValueError, match=re.escape(f"data task '{task}' has no split 'test'; its splits: "
                                                   f"train, validation") + "$"):
      pipeline.lm_batches(task, byte, slots=1, windows=1, window=8, split="test",
                          shard_info=seqio.ShardInfo(0, 1)).check_nonempty()
  # heldout_percent=0: every file trains, and there is no validation split
  tasks.register_files_task("test_all_train", str(d), heldout_percent=0)
  assert sorted(_texts("test_all_train", "train")) == ["the document a.txt", "the document b.txt"]
  with pytest.raises(ValueError, match="'test_all_train' has no split 'validation'; its splits: train$"):
    _texts("test_all_train", "validation")
  with pytest.raises(ValueError, match=r"heldout_percent must be in \[0, 100\)"):
    tasks.register_files_task("test_bad_share", str(d), heldout_percent=100)
  # a mixture reads a split from every member, never from only those that have it
  tasks.register_mixture("test_mix_all_train", {"stdlib": 0.5, "test_all_train": 0.5})
  with pytest.raises(ValueError, match=r"'test_mix_all_train': its members \['test_all_train'\] have no split "
                                       "'validation'"):
    pipeline.lm_batches("test_mix_all_train", byte, slots=1, windows=1, window=8, split="validation",
                        shard_info=seqio.ShardInfo(0, 1)).check_nonempty()


def test_a_split_without_files_fails_naming_the_pattern(tmp_path):
  d = tmp_path / "one"
  _files(d, ["a.txt"])  # a.txt trains: validation has no file
  assert not sources.heldout("a.txt", sources.HELDOUT_PERCENT)
  with pytest.raises(ValueError, match=r"none of the 1 files matching .*one.* is in split 'validation'"):
    _texts(f"files:{d}", "validation")


@pytest.mark.parametrize("args, message", [
    (["--task=nope"], "unknown task or mixture 'nope'"),
    (["--task=files:{tmp}/nothing/*.txt"], r"data task 'files:{tmp}/nothing/\*.txt': no files match"),
    (["--task=files:{tmp}/c", "--split=test"], "data task 'files:{tmp}/c' has no split 'test'; its splits: "
                                               "train, validation"),
    (["--task=jsonl:{tmp}/bad.jsonl"], r"yielded no documents .*bad input: bad_json: 2 \(e.g. {tmp}/bad.jsonl:1\)"),
    (["--task=stdlib", "--vocab={tmp}/missing.model"], "data.vocab: '{tmp}/missing.model' is neither"),
], ids=["unknown_task", "glob_matches_nothing", "unknown_split", "jsonl_every_line_broken", "missing_vocab_file"])
def test_preview_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch, args, message):
  monkeypatch.delenv("FOT_JAX_TRACEBACK", raising=False)
  _files(tmp_path / "c", ["a.txt"])
  (tmp_path / "bad.jsonl").write_text("{broken\n{also broken\n")
  tmp = str(tmp_path)
  message = message.replace("{tmp}", re.escape(tmp))
  with pytest.raises(SystemExit) as e:
    preview.main([a.replace("{tmp}", tmp) for a in args] + ["--slots=1", "--windows=1", "--seq_len=8", "--batches=1"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("data_pipelines.preview: ")
  assert re.search(message, err[0]), err[0]
