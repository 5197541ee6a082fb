"""The README stays true: its Python example runs, and its demo summary table is the same numbers
as docs/results.md's generated figures (both written by docs/demo_figures.py)."""
import importlib.util
import json
import os
import re
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "docs", "results.md")
CHECKPOINT = "runs/demo/fot"  # the path the example reads; the test makes one there in a scratch directory


def _read(path):
  with open(path) as f:
    return f.read()


def _demo_figures():
  spec = importlib.util.spec_from_file_location("demo_figures", os.path.join(ROOT, "docs", "demo_figures.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _block(text, begin, end):
  assert begin in text and end in text, f"no {begin} ... {end} block"
  return text[text.index(begin):text.index(end) + len(end)]


def test_readme_python_example_runs(tmp_path, monkeypatch):
  """The README's one python block, run as written in a directory where `runs/demo/fot` is a
  random checkpoint of the demo's model (its size, window and vocabulary)."""
  from fot_jax import checkpoint
  from fot_jax.model.config import get_size
  from fot_jax.model.init import init_params
  blocks = re.findall(r"^```python\n(.*?)^```", _read(README), re.M | re.S)
  assert len(blocks) == 1, f"expected one python block in README.md, found {len(blocks)}"
  code = blocks[0]
  assert f'"{CHECKPOINT}"' in code
  cfg = get_size("dict_cpu")
  checkpoint.save(str(tmp_path / CHECKPOINT), init_params(cfg, 0), cfg, 32, vocab="dictionary_lookup")
  monkeypatch.chdir(tmp_path)
  scope = {"__name__": "readme_example"}
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*mem_positions='none'")  # the export warning the README explains
    exec(compile(code, "README.md (python block)", "exec"), scope)
  length = scope["tokens"].shape[1]
  assert scope["logits"].shape == (1, 32, cfg.vocab_size)
  assert scope["dense"].shape == scope["topk"].shape == (1, length, cfg.vocab_size)
  assert scope["out"].shape == (length + 8,)
  for out in ("runs/demo/hf", "runs/demo/hf_bf16"):
    assert os.path.isfile(tmp_path / out / "config.json"), out


def _rows(text):
  """{context tokens: [numbers]} of a markdown table's rows that start with a token count."""
  return {int(m.group(1).replace(",", "")): re.findall(r"\d+\.\d+", m.group(2))
          for m in re.finditer(r"^\| ([\d,]+) \|(.*)$", text, re.M)}


def test_readme_summary_is_the_results_figures():
  df = _demo_figures()
  summary = _rows(_block(_read(README), df.SUMMARY_BEGIN, df.SUMMARY_END))
  figures = _rows(_block(_read(RESULTS), df.BEGIN, df.END))
  assert summary and set(summary) <= set(figures)
  for tokens, (fot, baseline) in summary.items():
    row = figures[tokens]  # FoT seed 0, seeds min, max, baseline
    assert (fot, baseline) == (row[0], row[-1]), tokens


def _results():
  mem = [32, 256, 4096, 65536]
  return {"fot": {"memory_tokens": mem, "accuracy": [1.0, 0.99, 0.98, 0.97], "window": 32, "train_steps": 10},
          "baseline": {"memory_tokens": mem, "accuracy": [0.9, 0.5, 0.4, 0.3], "window": 64, "train_steps": 10},
          "seeds": {"seeds": [0], "memory_tokens": mem, "min": [1.0, 0.99, 0.98, 0.97], "max": [1.0, 0.99, 0.98, 0.97]},
          "wall_seconds": 1.0, "provenance": {"date": "2000-01-01T00:00:00", "commit": "abc", "cores": 2}}


def test_write_replaces_both_blocks_and_nothing_else(tmp_path):
  df = _demo_figures()
  (tmp_path / "docs").mkdir()
  (tmp_path / "README.md").write_text(f"head\n{df.SUMMARY_BEGIN} -->\nold\n{df.SUMMARY_END}\ntail\n")
  (tmp_path / "docs" / "results.md").write_text(f"top\n{df.BEGIN} -->\nold\n{df.END}\nbottom\n")
  (tmp_path / "r.json").write_text(json.dumps(_results()))
  df.main([str(tmp_path / "r.json"), "--write", "--root", str(tmp_path)])
  readme, results = (tmp_path / "README.md").read_text(), (tmp_path / "docs" / "results.md").read_text()
  assert readme.startswith("head\n") and readme.endswith("\ntail\n") and "old" not in readme
  assert results.startswith("top\n") and results.endswith("\nbottom\n") and "old" not in results
  assert _rows(readme) == {32: ["1.000", "0.900"], 256: ["0.990", "0.500"], 4096: ["0.980", "0.400"],
                           65536: ["0.970", "0.300"]}
  assert _rows(results)[4096] == ["0.980", "0.400"]


def test_write_refuses_a_file_without_its_markers(tmp_path):
  df = _demo_figures()
  (tmp_path / "docs").mkdir()
  (tmp_path / "README.md").write_text("no markers\n")
  (tmp_path / "docs" / "results.md").write_text(f"{df.BEGIN} -->\nold\n{df.END}\n")
  (tmp_path / "r.json").write_text(json.dumps(_results()))
  with pytest.raises(SystemExit, match="README.md has no"):
    df.main([str(tmp_path / "r.json"), "--write", "--root", str(tmp_path)])
  assert "old" in (tmp_path / "docs" / "results.md").read_text()  # neither file written
