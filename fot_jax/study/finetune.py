"""Fine-tuning a study method from the base's parameters: the plan (window, windows per slot and
crossbatch curriculum, checked against the base), the same batches for every method, and the
resumable training run into W/finetune/<name>."""
from __future__ import annotations

import os
import shutil

import jax
import numpy as np

from data_pipelines import pipeline, vocab as vocab_lib
from fot_jax import checkpoint, crossbatch
from fot_jax.curriculum import Schedule
from fot_jax.jsonio import read_json, write_json
from fot_jax.runners import common
from fot_jax.model.init import init_params
from fot_jax.settings import TrainSettings
from fot_jax.study.settings import FinetuneSettings, MethodSpec, crossbatch_curriculum
from fot_jax.study.methods import method_context


def finetune_plan(base, method: MethodSpec, pad: int):
  """(method context, window, windows per slot, Schedule) of a fine-tuned method, checked against
  the base (errors name the method)."""
  s, name = method.finetune, method.name
  ctx = method_context(base, method, pad)
  if method.inference == "plain":
    window, k, schedule = s.length, 1, Schedule({"kind": "constant", "spec": {}})
  else:
    window = ctx.window
    if s.length % window or s.length // window < 2:
      raise ValueError(f"study method {name!r}: finetune.length {s.length} must be a multiple (at least 2x) of the "
                       f"memory method's window {window}: the memory path trains on length / window windows "
                       "per slot")
    k = s.length // window
    try:
      schedule = Schedule(crossbatch_curriculum(s.crossbatch, k))
      if schedule.tasks() != [None]:
        raise ValueError("its phases name data tasks; the fine-tune trains on finetune.task only")
      if schedule.pack != k:
        raise ValueError(f"pack size {schedule.pack} (w + 1 or len(segments)) must be length / window = {k}")
      for spec in schedule.all_specs():
        crossbatch.plan_from_spec(s.slots * k, spec)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"study method {name!r}: finetune.crossbatch: {e}") from None
  try:  # the fine-tune starts from the base's parameters: the method may not add any
    checkpoint.check_params(base.params, ctx.cfg, f"the base for fine-tuning {name!r}")
  except checkpoint.ConvertError as e:
    raise ValueError(f"study method {name!r}: {e}") from None
  return ctx, window, k, schedule


def finetune_batches(base, name: str, s: FinetuneSettings, window: int, k: int):
  """The fine-tune's slot batcher: finetune.slots streams, k windows of `window` tokens per slot
  (k * window = finetune.length): the same tokens for every method, cut differently."""
  vocab = vocab_lib.get_vocabulary(s.vocab) if s.vocab else base.vocab
  try:
    vocab_lib.check_fits(vocab.vocab_size, base.cfg.vocab_size, f"finetune.vocab of {name!r}")
    batches = pipeline.lm_batches(s.task, vocab, slots=pipeline.host_slots(s.slots), windows=k, window=window,
                                  split=s.split, seed=s.seed, min_doc_len=s.min_doc_len)
    batches.check_nonempty()
  except ValueError as e:
    raise ValueError(f"study method {name!r}: finetune data: {e}") from None
  return batches


def finetune_method(base, method: MethodSpec, pad: int, workdir: str):
  """Trains a fine-tuned method from the base's parameters into W/finetune/<name> (resumes its
  checkpoints; a directory of other settings is trained again) -> (params, summary)."""
  ctx, window, k, schedule = finetune_plan(base, method, pad)
  s, name = method.finetune, method.name
  out_dir = os.path.join(workdir, "finetune", name)
  record_path = os.path.join(out_dir, "finetune.json")
  record = {"method": method.spec, "finetune": s.to_dict()}
  prev = {}
  if os.path.exists(record_path):
    prev = read_json(record_path, f"fine-tune record of {name!r}")
  if os.path.isdir(out_dir) and {k_: prev.get(k_) for k_ in record} != record:
    print(f"[study] fine-tune {name}: {out_dir} holds another fine-tune (its settings changed); training again",
          flush=True)
    shutil.rmtree(out_dir)
    prev = {}
  os.makedirs(out_dir, exist_ok=True)
  write_json(record_path, dict(prev, **record))
  batches = finetune_batches(base, name, s, window, k)
  tc = TrainSettings.from_dict(
      {"steps": s.steps, "seed": s.seed, "loss_on": "all", "optim": s.optim, "log_every": s.log_every,
       "checkpoint_every": s.checkpoint_every, "tensorboard": s.tensorboard}, f"study method {name!r}: finetune")
  # the base's parameters in the dtypes training keeps (an imported checkpoint may store bf16)
  abstract = jax.eval_shape(lambda: init_params(ctx.cfg, 0))
  init = jax.tree_util.tree_map(lambda x, a: np.asarray(x, a.dtype), base.params, abstract)
  done = prev.get("result")
  print(f"[study] fine-tune {name}: " + ("done before, restoring its parameters" if done else
        f"{s.steps} steps of {s.slots} x {s.length:,} tokens ({k} window(s) of {window:,} per slot) "
        f"into {out_dir}"), flush=True)
  out = common.train_arm(model=ctx.cfg, settings=tc, name=f"ft {name}", schedule=schedule, batches=batches,
                         workdir=out_dir, vocab=s.vocab or base.vocab_spec, init_params=init)
  hist = out["history"]
  if hist:
    rds = [h["rd"] for h in hist[-10:] if np.isfinite(h["rd"])]
    done = {"seconds": out["seconds"], "steps": s.steps, "steps_run_last_session": len(hist),
            "tokens_per_step": s.slots * s.length, "window": window, "windows_per_slot": k,
            "final_loss": out["final_loss"],
            "final_rd": float(np.mean(rds)) if rds else None, "phases": out["phases"]}
    write_json(record_path, dict(record, result=done))
  elif not done:  # finished checkpoints without a record of them (interrupted between the two)
    done = {"seconds": 0.0, "steps": s.steps, "steps_run_last_session": 0}
  return out["params"], done
