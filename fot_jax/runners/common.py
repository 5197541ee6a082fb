"""What every runner shares: training (or restoring) one arm, the schedule of an arm that follows
FoT's phases as they ran, and the perplexity evaluation of a trained arm (results.json and its table:
fot_jax.results)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import numpy as np

from fot_jax.curriculum import Schedule
from fot_jax.eval import perplexity
from fot_jax.model.config import ModelConfig
from fot_jax.settings import LMEvalSettings, TrainSettings
from fot_jax.train import NoCheckpoint, train


def train_arm(*, model: ModelConfig, settings: TrainSettings, name: str, schedule: Schedule, batches,
              workdir: str, vocab: str, do_train: bool = True, window: Optional[int] = None,
              run_fields: Optional[Dict[str, Any]] = None, init_params=None) -> Dict[str, Any]:
  """Trains (or resumes) one arm in its workdir (the experiments' arms, a study's fine-tunes);
  do_train=False (--mode=evaluate) restores its latest checkpoint and trains nothing, refusing a
  workdir with no restorable step. `window`: the run's local window, recorded for evaluation (not a
  warm-up phase's own window); init_params: the parameters to start from (a fine-tune's base). Adds
  to train()'s output the arm's final training accuracy and loss (means over the last 5 and 10
  logged steps) and steps_run."""
  vocab = os.path.abspath(vocab) if os.path.isfile(vocab) else vocab  # evaluation finds it from anywhere
  meta = {"vocab": vocab} if window is None else {"vocab": vocab, "window": int(window)}
  try:
    out = train(model, settings, schedule, batches, workdir, name=name, init_params_tree=init_params,
                model_meta=meta, run_fields=run_fields, restore_only=not do_train)
  except NoCheckpoint as e:
    raise NoCheckpoint(f"--mode=evaluate: nothing to evaluate for arm {name!r}: {e}; train first "
                       f"(--mode=train) or point --workdir at a trained run") from None
  hist = out["history"]
  out["final_accuracy"] = float(np.mean([h["accuracy"] for h in hist[-5:]])) if hist else None
  out["final_loss"] = float(np.mean([h["loss"] for h in hist[-10:]])) if hist else None
  out["steps_run"] = hist[-1]["step"] if hist else _checkpoint_step(workdir)
  return out


def _checkpoint_step(workdir: str) -> int:
  """The step of the latest checkpoint under workdir (a finished run resumed or re-evaluated)."""
  ckpt = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
  return max(steps, default=0)


def phases_as_run(fot_phases: List[dict], fot_steps: int) -> List[dict]:
  """FoT's phases as they ran (name, task, spec, steps), without the empty ones."""
  phases = [{"name": p["name"], "task": p["task"], "spec": p["spec"],
             "steps": (p["end"] if p["end"] is not None else fot_steps) - p["start"]} for p in fot_phases]
  return [p for p in phases if p["steps"] > 0]


def following_schedule(fot_phases: List[dict], fot_steps: int, spec: Optional[dict] = None) -> Schedule:
  """The schedule of an arm that follows FoT: its phases as they ran (same tasks, same numbers of
  steps), each with `spec` in place of crossbatch ({}: none)."""
  if not fot_phases:  # a random curriculum has no phases: the same steps on the one task
    return Schedule({"kind": "constant", "spec": spec or {}})
  phases = [dict(p, spec=spec or {}) for p in phases_as_run(fot_phases, fot_steps)]
  return Schedule({"kind": "phases", "phases": phases, "stop_after_last": True})


def perplexity_of(inference, docs: List[np.ndarray], ev: LMEvalSettings, name: str) -> Dict[str, Any]:
  """Perplexity of the held-out docs' scored tails against the memory before them (eval settings `ev`)."""
  return perplexity.perplexity_vs_memory(inference, docs, ev.memory_tokens, ev.score_tokens, ev.batch,
                                         ev.doc_mode, name=name)
