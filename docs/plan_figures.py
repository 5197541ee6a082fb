"""Regenerates docs/scale_out.md's plan figures from the plans' JSON, as demo_figures.py does the demo's.

  python -m fot_jax.main --config=experiments/longllama_3b.py --mode=plan --plan_devices=256 \\
      --plan_json=docs/plans/longllama_3b.json
  python -m fot_jax.main --config=experiments/longllama_7b.py --mode=plan --plan_devices=256 \\
      --plan_json=docs/plans/longllama_7b.json
  python -m fot_jax.main --config=experiments/longllama_3b_32k.py --mode=plan \\
      --plan_json=docs/plans/longllama_3b_32k.json
  python docs/plan_figures.py [--plans docs/plans] [--write]

Each plan runs a minute or more on fake CPU devices (the 32K one much longer): run them one at a
time. The script prints the blocks (the printed plans, where and when they ran, the per-device
memory that fits or not); with --write it replaces docs/scale_out.md's blocks between the
`plan-figures:NAME` markers (demo_figures.replace_in, the same marker code), so the plan figures
the doc quotes are what the plans of the current code printed. The JSON files are committed
beside it (docs/plans/).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_figures  # noqa: E402  (docs/ is no package: the sibling script, for its marker code)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALE_OUT_MD = os.path.join("docs", "scale_out.md")
PLANS_DIR = os.path.join("docs", "plans")
PLANS = ("longllama_3b", "longllama_7b", "longllama_3b_32k")  # docs/plans/NAME.json
CHIP_GIB = 32  # a TPU v4 chip's HBM, what the fit sentence compares against
GIB = 1 << 30


def markers(name: str):
  return f"<!-- plan-figures:{name}:begin", f"<!-- plan-figures:{name}:end -->"


def _load(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    sys.exit(f"plan_figures: {path}: {e}")


def command(record: dict) -> str:
  """The plan's command as a reader types it: without --plan_json (the JSON is named beside it)."""
  return re.sub(r" --plan_json(=| )\S+", "", record["command"])


def where(record: dict, name: str) -> str:
  """When, on which commit and machine the plan ran, what it cost, and its JSON file."""
  p = record.get("provenance") or {}
  r = record.get("resources") or {}
  commit = (p.get("commit") or "unknown")[:10] + (" with uncommitted changes" if p.get("dirty") else "")
  cost = f"compiled in {record['plan']['compile_seconds']:.0f} s"
  if r:
    cost += f"; {r['cpu_seconds']:.0f} s of CPU and {r['max_rss_bytes'] / GIB:.1f} GiB of memory in all"
  return (f"{cost}, {(p.get('date') or '?')[:10]}, commit {commit}, {p.get('cores', '?')} cores "
          f"({p.get('cpu') or p.get('machine') or '?'}); `{PLANS_DIR}/{name}.json`")


def gib(record: dict) -> str:
  return f"{record['plan']['memory_per_device']['total'] / GIB:.2f} GiB"


def printed(record: dict) -> list:
  return ["```", record["printed"], "```"]


def block_3b(plans: dict) -> list:
  r = plans["longllama_3b"]
  devices = r["plan"]["mesh"].split("(")[-1].rstrip(")")
  return [f"**Plan before booking a pod**: `{command(r)}` compiles the train step against abstract shapes "
          f"on {devices.replace('devices', 'fake CPU devices')} (nothing allocated; {where(r, 'longllama_3b')}) "
          f"and prints:", ""] + printed(r)


def block_fit(plans: dict) -> list:
  r3, r7 = plans["longllama_3b"], plans["longllama_7b"]
  fits = all(r["plan"]["memory_per_device"]["total"] <= CHIP_GIB * GIB for r in (r3, r7))
  mesh7 = r7["plan"]["mesh"].split(" (")[0].replace("data=1 x ", "").replace(" x context=1", "")
  return [f"Per device, with the files' defaults (blockwise attention, crossbatch sources read inside its scan, "
          f"layers scanned, remat `full`, bf16 kernels cast on their shards before FSDP gathers them): "
          f"LongLLaMA-3B **{gib(r3)}** and LongLLaMA-7B (`experiments/longllama_7b.py`, {mesh7}) **{gib(r7)}**, "
          + ("both within" if fits else "not both within") + f" a v4 chip's {CHIP_GIB} GiB (7B: `{command(r7)}`; "
          f"{where(r7, 'longllama_7b')})."]


def block_32k(plans: dict) -> list:
  r = plans["longllama_3b_32k"]
  p = r["plan"]
  devices = p["mesh"].split("(")[-1].rstrip(")")
  return ([f"`{command(r)}` compiles its step on {devices.replace('devices', 'fake CPU devices')}:", ""] + printed(r)
          + ["", f"({where(r, 'longllama_3b_32k')}; the temporaries are XLA:CPU's, an upper bound as above.) "
                 f"The model FLOPs ({p['model_flops']:.3e}) are {p['model_flops'] / p['flops_6nt']:.2f} x "
                 f"6 x params x tokens ({p['flops_6nt']:.3e}): the attention over {p['window']:,}-token windows "
                 f"and the extra contexts of each memory layer."])


BLOCKS = {"longllama_3b": block_3b, "fit": block_fit, "longllama_3b_32k": block_32k}


def block(name: str, plans: dict) -> str:
  begin, end = markers(name)
  return "\n".join([f"{begin} (generated by `python docs/plan_figures.py`; do not edit by hand) -->"]
                   + BLOCKS[name](plans) + [end])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--plans", default=None, help=f"the folder of NAME.json plans (default: {PLANS_DIR})")
  ap.add_argument("--write", action="store_true", help=f"replace the plan-figures blocks of {SCALE_OUT_MD}")
  ap.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)  # tests write into a copy
  args = ap.parse_args(argv)
  folder = args.plans or os.path.join(args.root, PLANS_DIR)
  plans = {name: _load(os.path.join(folder, f"{name}.json")) for name in PLANS}
  texts = {name: block(name, plans) for name in BLOCKS}
  if not args.write:
    print("\n\n".join(texts.values()))
    return
  path = os.path.join(args.root, SCALE_OUT_MD)
  with open(path) as f:
    doc = f.read()
  for name, text in texts.items():  # every block checked before the file is written
    doc = demo_figures.replace_in(doc, *markers(name), text, path, prog="plan_figures")
  with open(path, "w") as f:
    f.write(doc)
  print(f"plan_figures: wrote {len(texts)} blocks of {path}")


if __name__ == "__main__":
  main()
