"""The controlled context-extension study: one base checkpoint, several methods, one evaluation.

  python -m fot_jax.study --config=experiments/study_tiny.py --workdir=W

A method is a set of ModelConfig overrides applied to the base (`rope_scaling`,
`position_strategy`, `mem_layers`, ...) plus its inference path:
  * `plain`:  a long-context forward, the whole input in one window (no memory);
  * `memory`: FoT memory inference, windows of the base's length (or the method's `window`),
              earlier windows in the memory layers' memory (fot_jax/inference.py).
Every method gets the same evaluation (the suites of fot_jax/eval, run on the method's model):
  * ppl:     perplexity of the same last `ppl.score_tokens` tokens of each held-out document,
             with L - score_tokens tokens of context before them, at every study length L (one
             step of the study's sliding-window evaluation);
  * passkey, niah (single and multi-needle): accuracy grids over lengths x depths, with
             their effective length (fot_jax/eval/effective_length.py);
  * rd:      positive attention mass, for methods with memory layers.
Results: W/methods/<name>.json per method (a finished method is skipped on a rerun with the same
spec), then W/study.json, W/study.md (one table) and figures W/study_*.png.
The base is `base.checkpoint`, or trained first into W/base by `fot_jax.runs.run_lm` from
`base.train` (an LM experiment config; skipped when W/base already holds the finished run).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Dict, List

import numpy as np

INFERENCE_PATHS = ("plain", "memory")
SUITES = ("ppl", "passkey", "niah", "rd")


class PlainInference:
  """MemoryInference's interface for a long-context forward: each `process` call is one window as
  wide as its input rounded up to a power of two, at least `pad` (masked padding at the end), so
  all suites of a method share a few compiled widths. (Dynamic NTK measures the padded width.)"""

  def __init__(self, cfg, params, pad: int = 64, chunk: int = 65536):
    if not (cfg.mem_qk_norm or cfg.mem_gating):  # a plain layer then equals a memory layer without memory
      cfg = dataclasses.replace(cfg, mem_layers=())
    self.cfg, self.params, self.pad, self.chunk = cfg, params, int(pad), chunk
    self.window = 0

  def new_memory(self, batch: int):
    from fot_jax.inference import Memory
    return Memory(self.cfg, batch)

  def process(self, tokens, memory, token_mask=None, want_logits: bool = True):
    from fot_jax.inference import MemoryInference
    width = max(self.pad, 1 << (int(np.shape(tokens)[1]) - 1).bit_length())
    return MemoryInference(self.cfg, self.params, width, "dense", 1, self.chunk).process(
        tokens, memory, token_mask, want_logits)


def method_model_config(base_cfg, method: Dict):
  """The base ModelConfig with the method's overrides, validated (errors name the method)."""
  name = method.get("name", "?")
  fields = {f.name for f in dataclasses.fields(base_cfg)}
  overrides = dict(method.get("overrides", {}))
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"study method {name!r}: unknown ModelConfig field(s) {unknown}")
  if "mem_layers" in overrides:
    overrides["mem_layers"] = tuple(int(x) for x in overrides["mem_layers"])
  cfg = dataclasses.replace(base_cfg, **overrides)
  try:
    cfg.validate()
  except ValueError as e:
    raise ValueError(f"study method {name!r}: {e}") from None
  return cfg


def _method_context(base, method: Dict, pad: int):
  """A suite Context for one method: the loaded base (params, vocab, data) with the method's config
  and inference path; the suite runners of fot_jax/eval/suite.py then run on it unchanged."""
  from fot_jax.eval import suite as suite_lib
  from fot_jax.inference import MemoryInference
  path = method.get("inference", "plain")
  if path not in INFERENCE_PATHS:
    raise ValueError(f"study method {method.get('name')!r}: inference must be one of {INFERENCE_PATHS}, "
                     f"got {path!r}")
  cfg = method_model_config(base.cfg, method)
  if path == "memory" and not cfg.mem_layers:
    raise ValueError(f"study method {method['name']!r}: inference 'memory' needs mem_layers")

  class MethodContext(suite_lib.Context):
    def __init__(self):  # shares the loaded base; nothing is read again
      self.__dict__.update(base.__dict__)
      self.cfg, self.name, self.inference_path = cfg, method["name"], path
      self.window = int(method.get("window") or base.window)  # the memory path's local window

    def inference(self, mode=None):
      c = self.config
      if path == "memory":
        return MemoryInference(self.cfg, self.params, self.window, mode or c.mode, c.topk, c.chunk)
      return PlainInference(self.cfg, self.params, pad, c.chunk)

  return MethodContext()


def perplexity_vs_length(ctx, lengths: List[int], score_tokens: int, n_docs: int, batch: int) -> Dict:
  """The same scored span (each document's last score_tokens targets) with L - score_tokens tokens
  of context before it, for every L in lengths: the L-token input goes through the method's
  `process` from its first token (so at L = the base window, memory methods equal plain ones)."""
  from fot_jax.eval import perplexity
  top = max(lengths)
  if min(lengths) <= score_tokens:
    raise ValueError(f"study: ppl.score_tokens {score_tokens} must be below the shortest length {min(lengths)}")
  docs = ctx.docs(top + 1, n_docs)
  tails = np.stack([np.asarray(d[-(top + 1):], np.int32) for d in docs])
  out = {"lengths": [int(x) for x in lengths], "perplexity": [], "nll": [], "score_tokens": int(score_tokens),
         "n_docs": len(docs)}
  for length in lengths:
    t0 = time.time()
    nlls = []
    for s in range(0, len(tails), batch):  # plain: one window; memory: windows from the first token
      nlls.append(perplexity.one_call_nll(ctx.inference(), tails[s:s + batch, top - length:], score_tokens))
    mean = float(np.concatenate(nlls).mean())
    out["nll"].append(mean)
    out["perplexity"].append(math.exp(mean))
    print(f"[{ctx.name}] ppl: length {length:>7,}: perplexity {math.exp(mean):.3f} ({time.time() - t0:.0f}s)",
          flush=True)
  return out


def evaluate_method(base, method: Dict, config) -> Dict:
  """All suites of the study for one method -> its result dict."""
  from fot_jax.eval import suite as suite_lib
  from fot_jax.eval.effective_length import effective_length
  ctx = _method_context(base, method, int(config.pad))
  res = {"method": _spec(method), "settings": settings(config), "seconds": {}}
  for suite in config.suites:
    t0 = time.time()
    if suite == "ppl":
      r = perplexity_vs_length(ctx, list(config.lengths), int(config.ppl.score_tokens), int(config.ppl.n_docs),
                               int(config.eval.batch))
      # the longest length whose perplexity stays within ppl.tolerance x that at the shortest length
      r["effective_length"] = effective_length(r["lengths"], r["perplexity"],
                                               float(config.ppl.tolerance) * r["perplexity"][0], False)
    elif suite == "passkey":
      r = suite_lib.run_passkey(ctx)
    elif suite == "niah":
      r = suite_lib.run_niah(ctx)
    elif suite == "rd":
      if not (ctx.inference_path == "memory" and ctx.cfg.mem_layers):
        continue  # r_d measures memory attention: only for methods that read memory
      r = suite_lib.run_rd(ctx)
    else:
      raise ValueError(f"study: unknown suite {suite!r}; known: {SUITES}")
    res[suite] = r
    res["seconds"][suite] = time.time() - t0
  return res


def settings(config) -> Dict:
  """What a method's results depend on besides its spec: a finished method is reused only if equal."""
  return json.loads(json.dumps({k: (config[k].to_dict() if hasattr(config[k], "to_dict") else config[k])
                                for k in ("lengths", "suites", "pad", "ppl", "eval")}, default=list))


def _spec(method: Dict) -> Dict:
  return json.loads(json.dumps(method, default=list))  # tuples -> lists, as stored


def ensure_base(config, workdir: str) -> str:
  """The base checkpoint: config.base.checkpoint, or the run trained into W/base (once)."""
  path = config.base.get("checkpoint") or ""
  if path:
    if not os.path.exists(path):
      raise ValueError(f"study: base checkpoint {path!r} does not exist; {config.base.get('missing_hint', '')}"
                       .rstrip("; "))
    return path
  if "train" not in config.base:
    raise ValueError("study: set base.checkpoint or base.train (an LM experiment config)")
  base_dir = os.path.join(workdir, "base")
  ck = os.path.join(base_dir, "fot")
  if os.path.exists(os.path.join(base_dir, "results.json")):
    print(f"[study] base: {ck} (trained before)", flush=True)
    return ck
  from fot_jax import configs, runs
  train_cfg = config.base.train
  configs.validate(train_cfg)
  print(f"[study] base: training {train_cfg.train.steps} steps into {base_dir}", flush=True)
  t0 = time.time()
  runs.run_lm(train_cfg, base_dir)
  print(f"[study] base trained in {time.time() - t0:.0f}s", flush=True)
  return ck


def eval_config(config):
  """The suite settings of the study: fot_jax/eval defaults, the study's lengths on every grid."""
  e = config.eval
  for g in (e.passkey, e.niah):
    g.lengths = tuple(int(x) for x in config.lengths)
  return e


def run(config, workdir: str) -> Dict:
  from fot_jax.eval import suite as suite_lib
  names = [m["name"] for m in config.methods]
  if len(set(names)) != len(names):
    raise ValueError(f"study: method names must be unique, got {names}")
  t_start = time.time()
  os.makedirs(os.path.join(workdir, "methods"), exist_ok=True)
  base_path = ensure_base(config, workdir)
  base = suite_lib.Context(base_path, eval_config(config))
  base.name = "base"
  for m in config.methods:  # every method's config is checked before the first one runs
    _method_context(base, m, int(config.pad))
  results, spent = {}, []
  for i, m in enumerate(config.methods):
    name = m["name"]
    out = os.path.join(workdir, "methods", f"{name}.json")
    if os.path.exists(out):
      with open(out) as f:
        prev = json.load(f)
      if prev.get("method") == _spec(m) and prev.get("settings") == settings(config):
        print(f"[study] method {i + 1}/{len(names)} {name}: done before ({out}), skipped", flush=True)
        results[name] = prev
        continue
      print(f"[study] method {name}: its spec or the study's settings changed since {out} was written; "
            "evaluating again", flush=True)
    print(f"[study] method {i + 1}/{len(names)} {name}: {_describe(m)}", flush=True)
    t0 = time.time()
    res = evaluate_method(base, m, config)
    res["wall_seconds"] = time.time() - t0
    with open(out, "w") as f:
      json.dump(res, f, indent=1)
    results[name] = res
    spent.append(res["wall_seconds"])
    left = sum(1 for mm in config.methods[i + 1:]
               if not os.path.exists(os.path.join(workdir, "methods", f"{mm['name']}.json")))
    print(f"[study] method {name} done in {spent[-1]:.0f}s; {left} left, ETA {np.mean(spent) * left:.0f}s",
          flush=True)
  study = {"base": os.path.abspath(base_path), "window": base.window, "lengths": [int(x) for x in config.lengths],
           "methods": results, "wall_seconds": time.time() - t_start}
  with open(os.path.join(workdir, "study.json"), "w") as f:
    json.dump(study, f, indent=1)
  with open(os.path.join(workdir, "study.md"), "w") as f:
    f.write(markdown(study))
  plot(study, workdir)
  print(f"[study] wrote {workdir}/study.md, study.json and figures ({study['wall_seconds']:.0f}s)", flush=True)
  return study


def _describe(m: Dict) -> str:
  o = m.get("overrides", {})
  return f"{m.get('inference', 'plain')} path" + (f", {dict(o)}" if o else "")


def _fmt(x, digits=3):
  if x is None:
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _grids(r: Dict) -> Dict[str, Dict]:
  out = {}
  if "passkey" in r:
    out["passkey"] = r["passkey"]
  if "niah" in r:
    out["NIAH single"], out["NIAH multi"] = r["niah"]["single"], r["niah"]["multi"]
  return out


def _grid_names(methods: Dict) -> List[str]:
  names = []
  for r in methods.values():
    names += [g for g in _grids(r) if g not in names]
  return names


def markdown(study: Dict) -> str:
  """One table: perplexity per length, mean accuracy and effective length per retrieval grid, r_d,
  wall time; then accuracy per length for each grid."""
  lengths = study["lengths"]
  methods = study["methods"]
  grid_names = _grid_names(methods)
  head = (["method", "path"] + [f"ppl {x:,}" for x in lengths] + ["ppl eff. len"]
          + [f"{g} acc / eff. len" for g in grid_names] + ["r_d (d) / 1/d", "wall s"])
  rows = []
  for name, r in methods.items():
    row = [name, r["method"].get("inference", "plain")]
    p = r.get("ppl")
    row += [_fmt(v) for v in p["perplexity"]] if p else ["-"] * len(lengths)
    row.append(_fmt(p["effective_length"]) if p else "-")
    for gn in grid_names:
      g = _grids(r).get(gn)
      row.append(f"{np.mean(g['accuracy_per_length']):.2f} / {_fmt(g['effective_length'])}" if g else "-")
    rd = r.get("rd")
    row.append(f"{rd['r_d'][-1]:.3f} ({rd['d'][-1]}) / {1 / rd['d'][-1]:.3f}" if rd else "n/a")
    row.append(f"{r['wall_seconds']:.0f}")
    rows.append(row)
  lines = [f"# Context-extension study: base {study['base']} (window {study['window']:,})", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  for g in grid_names:
    lines += ["", f"Accuracy per length, {g} (mean over depths):", "",
              "| method | " + " | ".join(f"{x:,}" for x in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, r in methods.items():
      if g in _grids(r):
        lines.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in _grids(r)[g]["accuracy_per_length"]) + " |")
  lines += ["", f"Study wall time {study['wall_seconds']:.0f}s (methods evaluated before are not re-timed)."]
  return "\n".join(lines) + "\n"


def plot(study: Dict, workdir: str) -> List[str]:
  """study_ppl.png, study_accuracy.png (accuracy against length per method, one panel per grid),
  study_passkey.png / study_niah.png (heatmaps side by side), study_rd.png."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no figure written")
    return []
  from fot_jax.eval import report
  methods = study["methods"]
  files = []
  with_ppl = {n: r["ppl"] for n, r in methods.items() if "ppl" in r}
  if with_ppl:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for n, p in with_ppl.items():
      ax.plot(p["lengths"], p["perplexity"], "-o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("perplexity of the last tokens")
    ax.axvline(study["window"], color="k", ls=":", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Perplexity against length (dotted: base window)")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "study_ppl.png"), dpi=110)
    plt.close(fig)
    files.append("study_ppl.png")
  grid_names = _grid_names(methods)
  if grid_names:
    fig, axes = plt.subplots(1, len(grid_names), figsize=(4.6 * len(grid_names), 3.8), squeeze=False)
    for ax, g in zip(axes[0], grid_names):
      for n, r in methods.items():
        if g not in _grids(r):
          continue
        gr = _grids(r)[g]
        ax.plot(gr["lengths"], gr["accuracy_per_length"], "-o", label=n)
      ax.set_xscale("log", base=2)
      ax.set_ylim(-0.03, 1.03)
      ax.set_xlabel("length (tokens)")
      ax.set_ylabel("accuracy")
      ax.set_title(g)
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "study_accuracy.png"), dpi=110)
    plt.close(fig)
    files.append("study_accuracy.png")
  for suite in ("passkey", "niah", "rd"):
    runs = {n: r[suite] for n, r in methods.items() if suite in r}
    if runs:
      files += report.plot_suite(suite, runs, workdir, prefix="study_")
  return files


def main(argv):
  del argv
  from absl import flags, logging
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  if f.config is None or not f.workdir:
    sys.exit("fot_jax.study: --config=experiments/study_*.py and --workdir=DIR are required")
  try:
    run(f.config, f.workdir)
  except ValueError as e:
    sys.exit(f"study error: {e}")


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from absl import app, flags as _flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "Study file (one get_config()).")
  _flags.DEFINE_string("workdir", None, "Where the base, per-method results, table and figures go.")
  app.run(main)
