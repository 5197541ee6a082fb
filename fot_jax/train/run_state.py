"""A training run's saved state, its orbax checkpoints in the workdir (a model checkpoint for
inference and export is fot_jax/checkpoint.py's format): the manager (which clears writes cut by a crash),
restoring a step (a damaged one is one error naming its folder, without orbax's log lines or
tracebacks), the recurrent carry's restore target, NoCheckpoint, and `train.init_from`
(params_from_checkpoint: another run's parameters).

A process killed mid-save (kill -9, OOM, a lost host) leaves orbax's temporary step folder
(`<step>.orbax-checkpoint-tmp...`, renamed to `<step>` only as the write's last act; on storage
without atomic renames, a step folder without orbax's commit_success.txt). orbax never lists
such a folder as a step, so a resume falls back to the last finished step by itself; the
trainer's manager also deletes the leftovers (`unfinished_writes`).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys

import jax
import orbax.checkpoint as ocp

from fot_jax import checkpoint, parallel
from fot_jax.model.config import ModelConfig


class NoCheckpoint(FileNotFoundError):
  """A workdir to restore (evaluation) that holds no restorable checkpoint step."""


TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's name for a step folder being written


def checkpoint_manager(workdir: str, keep: int = 2, clear_unfinished: bool = False):
  """The workdir's CheckpointManager. clear_unfinished: delete the folders of writes that never
  finished (a crash mid-save); the trainer sets it, evaluation does not: it may read a workdir
  whose run is training, and that run's write in progress looks the same."""
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                    cleanup_tmp_directories=clear_unfinished))


def unfinished_writes(ckpt_dir: str) -> list:
  """Names of the step folders in ckpt_dir whose write never finished (orbax's temporary folders)."""
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(n for n in os.listdir(ckpt_dir) if TMP_MARK in n)


def describe_folder(path: str) -> str:
  if not os.path.isdir(path):
    return "the folder does not exist"
  entries = sorted(os.listdir(path))
  if not entries:
    return "the folder is empty"
  return f"it holds only {', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}"


@contextlib.contextmanager
def orbax_logs_off():
  """No absl log lines while orbax opens or restores checkpoints: a damaged step's metadata is
  logged as an ERROR before the failure that train() reports as one line naming the step."""
  from absl import logging as absl_logging
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.FATAL)
  try:
    yield
  finally:
    absl_logging.set_verbosity(verbosity)


def _quiet_closed_loop_callbacks():
  """When a restore fails, tensorstore's reads still in flight post their results to orbax's
  closed event loop, each printing a 'RuntimeError: Event loop is closed' traceback (an
  unraisable exception) around the one-line error, during the restore and after it; those alone
  are dropped. Returns the previous sys.unraisablehook."""
  previous = sys.unraisablehook
  if getattr(previous, "_fot_jax_quiet", False):
    return previous

  def hook(unraisable):
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
      return
    previous(unraisable)
  hook._fot_jax_quiet = True
  sys.unraisablehook = hook
  return previous


def saved_carry_target(step: int, ckpt_dir: str, mesh, rules):
  """The abstract recurrent carry saved with `step`, from the saved arrays' metadata, in the
  batch's sharding; None when that step has none."""
  folder = os.path.join(ckpt_dir, str(step), "carry")
  if not os.path.isdir(folder):
    return None
  with orbax_logs_off():
    meta = ocp.StandardCheckpointer().metadata(folder)
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  sharding = parallel.batch_sharding(mesh, rules)
  return jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding),
                                dict(tree), is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def restore_step(manager, step: int, target, ckpt_dir: str, carry_target=None):
  """The train state and extra JSON of `step` (and the recurrent carry, given its target); a step
  that does not restore (files truncated or deleted) is a ValueError naming its folder."""
  previous_hook = _quiet_closed_loop_callbacks()
  items = {} if carry_target is None else {"carry": ocp.args.StandardRestore(carry_target)}
  try:
    with orbax_logs_off():  # orbax logs a damaged file's error before raising it
      restored = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore(), **items))
    sys.unraisablehook = previous_hook  # restored: nothing is left in flight
    return restored
  except Exception as e:  # orbax raises KeyError, ValueError, JSONDecodeError... for a damaged step
    earlier = [s for s in manager.all_steps() if s < step]
    hint = (f"delete that folder to resume from step {max(earlier)}" if earlier else
            "delete that folder to start again")
    cause = " ".join(str(e).split())[:300]
    raise ValueError(f"checkpoint {os.path.join(ckpt_dir, str(step))} does not restore "
                     f"({type(e).__name__}: {cause}); {hint}") from e


def params_from_checkpoint(path: str, model_cfg: ModelConfig):
  """`train.init_from`: the parameters of an fot_jax checkpoint (import_hf output or a training
  workdir), checked against model_cfg; the caller starts a fresh optimizer state."""
  try:
    ck = checkpoint.load(path)
    checkpoint.check_params(ck.params, model_cfg, path)
  except checkpoint.ConvertError as e:
    raise ValueError(f"train.init_from: {e}") from None
  # Positions and the norm's epsilon leave no trace in parameter shapes: a run with another RoPE
  # or epsilon would train silently wrong (GGUF stores the epsilon as float32: compared loosely).
  for field in ("rope_theta", "rope_scaling", "rms_norm_eps"):
    have, want = getattr(ck.cfg, field), getattr(model_cfg, field)
    if have != want and not (field == "rms_norm_eps" and math.isclose(have, want, rel_tol=1e-6)):
      raise ValueError(f"train.init_from: {path} was trained with {field}={have!r}, the model config has "
                       f"{want!r}; set model.overrides.{field} to the checkpoint's")
  return ck.params
