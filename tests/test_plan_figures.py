"""docs/scale_out.md's plan figures are generated: docs/plan_figures.py fills the `plan-figures`
blocks from plan JSON (fot_jax.main --mode=plan --plan_json=FILE), replacing those blocks and
nothing else, and the committed doc holds exactly what the committed docs/plans/*.json give."""
import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30


def _plan_figures():
  spec = importlib.util.spec_from_file_location("plan_figures", os.path.join(ROOT, "docs", "plan_figures.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _record(config, mesh, total_gib, extra=""):
  """A plan JSON as --plan_json writes it, with made-up figures."""
  total = int(total_gib * GIB)
  printed = f"mesh               {mesh}\nmemory per device  {total / GIB:.2f} GiB{extra}"
  return {"command": f"python -m fot_jax.main --config=experiments/{config}.py --mode=plan --plan_devices=256 "
                     f"--plan_json=docs/plans/{config}.json",
          "plan": {"mesh": mesh, "window": 2048, "compile_seconds": 61.6, "model_flops": 6.0e15, "flops_6nt": 5.0e15,
                   "memory_per_device": {"total": total}},
          "printed": printed, "resources": {"cpu_seconds": 70.2, "max_rss_bytes": int(1.6 * GIB)},
          "provenance": {"date": "2000-01-02T03:04:05+00:00", "commit": "0123456789abcdef", "dirty": False,
                         "cores": 2, "cpu": "Some CPU"}}


def _setup(tmp_path, pf, total_7b=6.2, names=None):
  plans = tmp_path / "docs" / "plans"
  plans.mkdir(parents=True)
  for name, mesh, gib in (("longllama_3b", "data=1 x fsdp=128 x tensor=2 x context=1 (256 devices)", 6.18),
                          ("longllama_7b", "data=1 x fsdp=64 x tensor=4 x context=1 (256 devices)", total_7b),
                          ("longllama_3b_32k", "data=1 x fsdp=8 x tensor=2 x context=8 (128 devices)", 31.37)):
    (plans / f"{name}.json").write_text(json.dumps(_record(name, mesh, gib, extra=f"\n({name} table)")))
  doc = "top\n"
  for name in names or pf.BLOCKS:
    begin, end = pf.markers(name)
    doc += f"\ntext before {name}\n\n{begin} -->\nold {name}\n{end}\n\ntext after {name}\n"
  (tmp_path / "docs" / "scale_out.md").write_text(doc + "bottom\n")
  return tmp_path / "docs" / "scale_out.md"


def _block(text, name, pf):
  begin, end = pf.markers(name)
  return text[text.index(begin):text.index(end) + len(end)]


def test_write_fills_every_block_from_the_plans_json(tmp_path):
  pf = _plan_figures()
  path = _setup(tmp_path, pf)
  pf.main(["--write", "--root", str(tmp_path)])
  doc = path.read_text()
  assert doc.startswith("top\n") and doc.endswith("bottom\n") and "old" not in doc
  for name in pf.BLOCKS:
    assert f"text before {name}\n\n" in doc and f"\n\ntext after {name}" in doc
  b3 = _block(doc, "longllama_3b", pf)
  assert "`python -m fot_jax.main --config=experiments/longllama_3b.py --mode=plan --plan_devices=256`" in b3
  assert "--plan_json" not in b3.split("`docs/plans")[0]  # the command as a reader types it
  assert "on 256 fake CPU devices" in b3
  assert "compiled in 62 s; 70 s of CPU and 1.6 GiB of memory in all, 2000-01-02, commit 0123456789" in b3
  assert "`docs/plans/longllama_3b.json`" in b3
  assert "```\nmesh               data=1 x fsdp=128 x tensor=2 x context=1 (256 devices)\n" \
         "memory per device  6.18 GiB\n(longllama_3b table)\n```" in b3
  fit = _block(doc, "fit", pf)
  assert "LongLLaMA-3B **6.18 GiB**" in fit and "fsdp=64 x tensor=4) **6.20 GiB**, both within a v4 chip's 32 GiB" in fit
  b32 = _block(doc, "longllama_3b_32k", pf)
  assert "on 128 fake CPU devices" in b32 and "(longllama_3b_32k table)" in b32
  assert "The model FLOPs (6.000e+15) are 1.20 x 6 x params x tokens (5.000e+15)" in b32
  # again with a 7B plan that does not fit: the sentence says so
  (tmp_path / "docs" / "plans" / "longllama_7b.json").write_text(
      json.dumps(_record("longllama_7b", "data=1 x fsdp=64 x tensor=4 x context=1 (256 devices)", 40.0)))
  pf.main(["--write", "--root", str(tmp_path)])
  fit = _block(path.read_text(), "fit", pf)
  assert "**40.00 GiB**, not both within a v4 chip's 32 GiB" in fit


def test_write_refuses_a_doc_missing_a_block(tmp_path):
  pf = _plan_figures()
  path = _setup(tmp_path, pf, names=["longllama_3b", "longllama_3b_32k"])  # no `fit` block
  before = path.read_text()
  with pytest.raises(SystemExit, match=r"plan_figures: .*scale_out.md has no <!-- plan-figures:fit:begin"):
    pf.main(["--write", "--root", str(tmp_path)])
  assert path.read_text() == before  # nothing written, not even the blocks that were there


def test_the_doc_holds_what_the_committed_plans_give():
  """docs/scale_out.md's blocks are the generator's output for docs/plans/*.json, and each JSON's
  printed text is what plan.format_plan makes of its figures."""
  from fot_jax import plan
  pf = _plan_figures()
  with open(os.path.join(ROOT, pf.SCALE_OUT_MD)) as f:
    doc = f.read()
  plans = {}
  for name in pf.PLANS:
    with open(os.path.join(ROOT, pf.PLANS_DIR, f"{name}.json")) as f:
      plans[name] = json.load(f)
    assert plan.format_plan(plans[name]["plan"]) == plans[name]["printed"], name
    assert re.search(rf"--config=experiments/{name}\.py --mode=plan", plans[name]["command"]), name
  for name in pf.BLOCKS:
    assert _block(doc, name, pf) == pf.block(name, plans), f"run python docs/plan_figures.py --write ({name})"
