"""Training, one job per module:

  optimizer    make_optimizer; which parameters train (`train.trainable`: resolve_trainable,
               count_trainable, Trainable)
  step         TrainState, its shardings and init, the loss sums, the jitted train step, stacked_plan
  fingerprint  the run's fingerprint: a workdir resumes only the run it was started for
  checkpoints  the workdir's orbax checkpoints (manager, restore, NoCheckpoint) and `train.init_from`
  loop         train(): the training loop, the metrics log, preemption (SIGTERM -> checkpoint)

The names below are re-exported so `from fot_jax.train import X` names them all.
"""
from fot_jax.train.run_state import NoCheckpoint, params_from_checkpoint
from fot_jax.train.fingerprint import (RESUMABLE_FIELDS, RUN_FINGERPRINT, check_run_fingerprint,
                                       fingerprint_differences, run_fingerprint)
from fot_jax.train.loop import MetricsLog, Preempted, train
from fot_jax.train.optimizer import (TRAINABLE_GROUPS, Trainable, count_trainable, make_optimizer,
                                     parameter_paths, resolve_trainable)
from fot_jax.train.step import (TrainState, answer_sums, init_state, lm_loss_sums, make_train_step, stacked_plan,
                                state_shardings)

__all__ = [
    "MetricsLog", "NoCheckpoint", "Preempted", "RESUMABLE_FIELDS", "RUN_FINGERPRINT", "TRAINABLE_GROUPS",
    "TrainState", "Trainable", "check_run_fingerprint", "count_trainable", "fingerprint_differences",
    "answer_sums", "init_state", "lm_loss_sums", "make_optimizer", "make_train_step", "params_from_checkpoint",
    "parameter_paths", "resolve_trainable", "run_fingerprint", "stacked_plan", "state_shardings", "train",
]
