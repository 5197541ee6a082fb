"""Figures every layer writes: the one matplotlib import (Agg backend; a missing matplotlib prints a
line and the figure is skipped, nothing fails), curves on a log2 axis, and the dictionary-lookup
accuracy panel shared by the demo run and far_end. Imports nothing of the project, so runners and
eval both use it without an import running back up the layers."""
from __future__ import annotations


def pyplot():
  """matplotlib.pyplot on the Agg backend, or None (printed) when matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no plot written")
    return None
  return plt


def plot_curves(path, curves, xlabel, ylabel, title, ylim=None, xticks=None):
  """curves: {label: (xs, ys)} on a log2 x axis -> PNG at path."""
  plt = pyplot()
  if plt is None:
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  for label, (xs, ys) in curves.items():
    ax.plot(xs, ys, marker="o", label=label)
  ax.set_xscale("log", base=2)
  if xticks:
    ax.set_xticks(*xticks)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if ylim:
    ax.set_ylim(*ylim)
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_dictionary_accuracy(ax, results, fot_label, band_label, baseline_note):
  """A dictionary run's accuracy against context tokens on `ax`: FoT's seed mean (a min-max band
  over several seeds) and the baseline's curve, on a log2 axis (the demo's figure and far_end's)."""
  sd = results["seeds"]
  ax.plot(sd["memory_tokens"], sd["mean"], marker="o", color="C0", label=fot_label)
  if len(sd["seeds"]) > 1:
    ax.fill_between(sd["memory_tokens"], sd["min"], sd["max"], color="C0", alpha=0.25, label=band_label)
  if "baseline" in results:
    b = results["baseline"]
    ax.plot(b["memory_tokens"], b["accuracy"], marker="s", color="C3",
            label=f"baseline (window {b['window']}, no crossbatch){baseline_note}")
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel("context tokens (target's definitions among other dictionaries')")
  ax.set_ylabel("accuracy (queries answered)")
