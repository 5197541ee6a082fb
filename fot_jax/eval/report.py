"""Tables and plots of suite results: one run's W/eval/report.md, and `compare` of several
runs (one table per suite, a column per run, shared plots)."""
from __future__ import annotations

import glob
import os
from typing import Dict, List

import numpy as np

from fot_jax import jsonio, plots

Runs = Dict[str, dict]  # run name -> one suite's result JSON


def load_runs(workdirs: List[str]) -> Dict[str, Runs]:
  """{suite: {run name: result}} from each workdir's eval/*.json."""
  out: Dict[str, Runs] = {}
  for w in workdirs:
    files = sorted(glob.glob(os.path.join(w, "eval", "*.json")))
    if not files:
      raise ValueError(f"compare: {w} holds no eval/*.json; run `python -m fot_jax.evaluate --checkpoint CKPT --workdir {w}` first")
    for path in files:
      res = jsonio.read_json(path, "evaluation result")
      if not isinstance(res, dict) or "suite" not in res:
        raise ValueError(f"compare: {path} is not an evaluation result (no 'suite' field)")
      name = res.get("name") or os.path.basename(os.path.normpath(w))
      runs = out.setdefault(res["suite"], {})
      if name in runs:  # two workdirs evaluated checkpoints of the same name
        name = f"{name} ({os.path.basename(os.path.normpath(w))})"
      runs[name] = res
  return out


def _fmt(x, digits=3) -> str:
  if x is None:
    return "-"
  if isinstance(x, float):
    return f"{x:.{digits}f}"
  return f"{x:,}" if isinstance(x, int) else str(x)


def _table(header: List[str], rows: List[List], digits: int = 3) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_fmt(c, digits) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _union(values) -> list:
  return sorted({v for vs in values for v in vs})


def _at(xs, ys, x):
  return ys[xs.index(x)] if x in xs else None


def tables(suite: str, runs: Runs) -> str:
  names = list(runs)
  if suite == "ppl":
    modes = [m for m in ("single_doc", "multi_doc") if any(m in r for r in runs.values())]
    mems = _union(r[m]["memory_tokens"] for r in runs.values() for m in modes if m in r)
    header = ["memory tokens"] + [f"{n} {m}" for n in names for m in modes]
    rows = [[m] + [_at(r[mode]["memory_tokens"], r[mode]["perplexity"], m) if mode in r else None
                   for r in runs.values() for mode in modes] for m in mems]
    extra = {n: r["multi_doc"]["distractor_tokens"] for n, r in runs.items() if "multi_doc" in r}
    note = ("\n\nPerplexity of each document's last "
            f"{next(iter(runs.values()))['score_tokens']} tokens; multi_doc memory also holds "
            + ", ".join(f"{v:,} earlier-document tokens ({n})" for n, v in extra.items()) + ".") if extra else ""
    return _table(header, rows) + note
  if suite == "rd":
    ds = _union(r["d"] for r in runs.values())
    rows = [[d, 1.0 / d] + [_at(r["d"], r["r_d"], d) for r in runs.values()] for d in ds]
    return _table(["d", "1/d"] + [f"r_d {n}" for n in names], rows, digits=4)
  if suite in ("passkey", "niah"):
    parts = []
    for variant in (["single", "multi"] if suite == "niah" else [None]):
      grids = {n: (r[variant] if variant else r) for n, r in runs.items()}
      lengths = _union(g["lengths"] for g in grids.values())
      rows = [[x] + [_at(g["lengths"], g["accuracy_per_length"], x) for g in grids.values()] for x in lengths]
      rows.append(["effective length"] + [g["effective_length"] for g in grids.values()])
      title = f"**{variant}-needle**" + (f" ({next(iter(grids.values())).get('n_needles', 1)} needles)"
                                         if variant == "multi" else "") + "\n\n" if variant else ""
      parts.append(title + _table(["length (target tokens)"] + [f"accuracy {n}" for n in names], rows))
      if len(grids) == 1:  # one run: the full grid too
        g = next(iter(grids.values()))
        parts.append(_table(["length \\ depth"] + [f"{d:g}" for d in g["depths"]],
                            [[x] + row for x, row in zip(g["lengths"], g["accuracy"])]))
    thr = next(iter(runs.values()))
    thr = thr.get("threshold", thr.get("single", {}).get("threshold"))
    return "\n\n".join(parts) + f"\n\nAccuracy per length = mean over depths; effective length at threshold {thr}."
  if suite == "dict":
    cols = [(n, m) for n, r in runs.items() for m in ("dense", "topk", "flat", "ivf") if m in r]
    mems = _union(runs[n][m]["memory_tokens"] for n, m in cols)
    header = ["memory tokens"] + [f"{n} {m}" for n, m in cols]
    rows = [[x] + [_at(runs[n][m]["memory_tokens"], runs[n][m]["accuracy"], x) for n, m in cols] for x in mems]
    rec = [(n, m) for n, m in cols if "recall" in runs[n][m]]
    out = _table(header, rows)
    if rec:
      out += "\n\nRecall@k of the host index against the exact top-k:\n\n" + _table(
          ["memory tokens"] + [f"{n} {m}" for n, m in rec],
          [[x] + [_at(runs[n][m]["memory_tokens"], runs[n][m]["recall"], x) for n, m in rec] for x in mems])
    eff = [[f"{n} {m}", runs[n][m].get("effective_length")] for n, m in cols]
    thr = next(iter(runs.values()))["threshold"]
    return out + f"\n\nEffective length (accuracy >= {thr}):\n\n" + _table(["run", "tokens"], eff)
  if suite == "ruler":  # a table per run: lengths x tasks, the average, effective lengths
    parts = []
    for n, r in runs.items():
      tasks = list(r["tasks"])
      rows = [[x] + [_at(r["tasks"][t]["lengths"], r["tasks"][t]["accuracy"], x) for t in tasks]
              + [_at(r["lengths"], r["average"], x)] for x in r["lengths"]]
      rows.append(["effective length"] + [r["tasks"][t]["effective_length"] for t in tasks] + [r["effective_length"]])
      parts.append((f"**{n}**\n\n" if len(runs) > 1 else "")
                   + _table(["length (target tokens)"] + tasks + ["average"], rows))
    r = next(iter(runs.values()))
    return "\n\n".join(parts) + (f"\n\nScore: fraction of the expected values in the greedy output, mean over "
                                 f"{r.get('trials', '?')} prompts; effective length at threshold {r['threshold']}.")
  if suite == "heads":  # retrieval-head probe: the layers picked and the best heads, a row per run
    best = lambda r: ", ".join(f"L{lay}.H{h} {sc:.2f}" for lay, h, sc in r["top_heads"][:5])
    rows = [[n, ", ".join(map(str, r["picked"])), best(r), r["answer_tokens"]] for n, r in runs.items()]
    return _table(["run", "picked layers", "best heads (copy score)", "answer tokens"], rows) + (
        "\n\nCopy score: the fraction of answer tokens where the head's attention argmax lands on the needle "
        "token it predicts; picked: the layers whose best head copies most often (ties: mean head score, "
        "lower layer).")
  raise ValueError(f"unknown suite {suite!r}")


def plot_suite(suite: str, runs: Runs, out_dir: str, prefix: str = "") -> List[str]:
  """Writes the suite's PNG(s) into out_dir; returns their file names."""
  plt = plots.pyplot()
  if plt is None:
    return []
  files = []

  def save(fig, ax, xlabel, ylabel, title, name):  # the line plots: log2 x, grid, legend
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, prefix + name), dpi=110)
    plt.close(fig)
    files.append(prefix + name)

  if suite == "ppl":
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, r in runs.items():
      for mode, style in (("single_doc", "-o"), ("multi_doc", "--s")):
        if mode in r:
          ax.plot([max(m, 1) for m in r[mode]["memory_tokens"]], r[mode]["perplexity"], style, label=f"{n} {mode}")
    save(fig, ax, "memory tokens from the document (0 plotted at 1)", "perplexity", "Perplexity against memory",
         "ppl.png")
  elif suite == "rd":
    fig, ax = plt.subplots(figsize=(6, 4))
    ds = _union(r["d"] for r in runs.values())
    ax.plot(ds, [1 / d for d in ds], "k--", label="1/d")
    for n, r in runs.items():
      ax.plot(r["d"], r["r_d"], "-o", label=n)
    ax.set_yscale("log", base=2)
    save(fig, ax, "documents in memory d", "positive attention mass r_d",
         "Positive attention mass of the memory layers", "rd.png")
  elif suite in ("passkey", "niah"):
    variants = ["single", "multi"] if suite == "niah" else [None]
    fig, axes = plt.subplots(len(variants), len(runs), figsize=(4.2 * len(runs) + 1.2, 3.4 * len(variants)),
                             squeeze=False, constrained_layout=True)
    for vi, variant in enumerate(variants):
      for ri, (n, r) in enumerate(runs.items()):
        g = r[variant] if variant else r
        ax = axes[vi, ri]
        im = ax.imshow(g["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        for (li, di), a in np.ndenumerate(np.asarray(g["accuracy"])):
          ax.text(di, li, f"{a:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(g["depths"])), [f"{d:g}" for d in g["depths"]])
        ax.set_yticks(range(len(g["lengths"])), [f"{x:,}" for x in g["lengths"]])
        ax.set_xlabel("depth")
        ax.set_ylabel("length (tokens)")
        ax.set_title(f"{n}" + (f" ({variant})" if variant else ""), fontsize=8)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    fig.savefig(os.path.join(out_dir, prefix + f"{suite}.png"), dpi=110)
    plt.close(fig)
    files.append(prefix + f"{suite}.png")
  elif suite == "dict":
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, r in runs.items():
      for mode, style in (("dense", "-o"), ("topk", "-s"), ("flat", ":^"), ("ivf", "--x")):
        if mode in r:
          ax.plot(r[mode]["memory_tokens"], r[mode]["accuracy"], style, label=f"{n} {mode}")
    ax.set_ylim(-0.02, 1.02)
    save(fig, ax, "context tokens (memory + local)", "accuracy (all value tokens)",
         "Dictionary lookup: dense, exact and approximate top-k", "dict.png")
  elif suite == "ruler":  # a panel per run: each task's score against length, the average in bold
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, (n, r) in zip(axes[0], runs.items()):
      for t, g in r["tasks"].items():
        ax.plot(g["lengths"], g["accuracy"], "-o", ms=3, alpha=0.7, label=t)
      ax.plot(r["lengths"], r["average"], "k-s", lw=2.5, label="average")
      ax.axhline(r["threshold"], color="grey", ls=":", label=f"threshold {r['threshold']}")
      ax.set_xscale("log", base=2)
      ax.set_ylim(-0.02, 1.02)
      ax.set_xlabel("prompt length (tokens)")
      ax.set_ylabel("score (expected values produced)")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
      ax.set_title(f"RULER-style tasks: {n}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, prefix + "ruler.png"), dpi=110)
    plt.close(fig)
    files.append(prefix + "ruler.png")
  elif suite == "heads":  # a heat map (layers x heads) per run
    plot_heads(runs, os.path.join(out_dir, prefix + "heads.png"))
    files.append(prefix + "heads.png")
  return files


def _markdown(by_suite: Dict[str, Runs], out_dir: str, title: str, prefix: str = "") -> str:
  lines = [f"# {title}", ""]
  for suite in ("ppl", "rd", "passkey", "niah", "dict", "ruler", "heads"):
    if suite not in by_suite:
      continue
    runs = by_suite[suite]
    lines += [f"## {suite}", ""]
    for n, r in runs.items():
      lines.append(f"- {n}: `{r['checkpoint']}`, window {r['window']}, vocab {r['vocab']}, seed {r['seed']}, "
                   f"{r['seconds']:.0f}s")
    lines += ["", tables(suite, runs), ""]
    for f in plot_suite(suite, runs, out_dir, prefix):
      lines += [f"![{suite}]({f})", ""]
  return "\n".join(lines)


def write_report(workdir: str) -> str:
  """W/eval/report.md from the suites that ran (their JSON files)."""
  out_dir = os.path.join(workdir, "eval")
  text = _markdown(load_runs([workdir]), out_dir, f"Evaluation: {workdir}")
  path = os.path.join(out_dir, "report.md")
  with open(path, "w") as f:
    f.write(text)
  return path


def compare(workdirs: List[str], out_dir: str) -> str:
  """One table per suite over several runs, shared plots; prints the tables, writes out_dir/compare.md."""
  by_suite = load_runs(workdirs)
  os.makedirs(out_dir, exist_ok=True)
  text = _markdown(by_suite, out_dir, "Comparison: " + ", ".join(workdirs), prefix="compare_")
  with open(os.path.join(out_dir, "compare.md"), "w") as f:
    f.write(text)
  print(text, flush=True)
  return text


def plot_heads(runs: Dict[str, dict], path: str) -> str:
  """Heat map of copy scores (layers x heads), one panel per run; picked layers marked '*'."""
  plt = plots.pyplot()
  if plt is None:
    return path
  shapes = [np.shape(r["scores"]) for r in runs.values()]
  layers, heads = max(s[0] for s in shapes), max(s[1] for s in shapes)
  fig, axes = plt.subplots(1, len(runs), figsize=(len(runs) * max(3.5, 1.2 + 0.45 * heads), 1.6 + 0.25 * layers),
                           squeeze=False, constrained_layout=True)
  for ax, (name, r) in zip(axes[0], runs.items()):
    s = np.asarray(r["scores"])
    im = ax.imshow(s, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
    if s.size <= 600:
      for (li, hi), v in np.ndenumerate(s):
        ax.text(hi, li, f"{v:.2f}"[1:] if 0 < v < 1 else f"{v:.0f}", ha="center", va="center", fontsize=6,
                color="white" if v < 0.5 else "black")
    picked = set(r.get("picked", ()))
    ax.set_yticks(range(len(s)), [f"{i}*" if i in picked else str(i) for i in range(len(s))], fontsize=7)
    ax.set_xticks(range(s.shape[1]), [str(j) for j in range(s.shape[1])], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer (* picked)")
    ax.set_title(f"{name}: copy score, {r['answer_tokens']} answer tokens", fontsize=8)
  fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="copy score")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
