"""A real two-process jax.distributed run on localhost: 2 CPU processes x 2 devices.

    python -m launch.two_process_check --workdir=/tmp/two_process

Launches two workers (jax.distributed on localhost, gloo CPU collectives), each
feeding only its own half of the slots (its host-local rows), on a mesh fsdp=2
(across the processes) x tensor=2 (within each). They train a tiny FoT model (with
crossbatch negatives from the other process's slots) for 2 steps, stop, and resume
from the orbax checkpoint both hosts wrote to 4 steps. Then the same 4 steps run in
this one process on one device; the losses and final parameters must agree.
Too slow for the test suite (~110 s of CPU on 2 cores); run it by hand.
"""
import argparse
import json
import os
import socket
import subprocess
import sys

import numpy as np

STEPS, SLOTS = 4, 8


def setup():
  from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
  from fot_jax.curriculum import Schedule
  from fot_jax.model.config import get_size
  task = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=8, n_queries=8)
  cfg = get_size("tiny", vocab_size=task.vocab_size, mem_layers=(1,))
  batches = DictionaryBatches(task, slots=SLOTS, window=task.doc_len // 2, seed=0)
  schedule = Schedule({"kind": "constant", "spec": {"d": 4, "w": 1}})
  return cfg, batches, schedule


def train_cfg(steps, mesh):
  return {"steps": steps, "seed": 0, "loss_on": "last", "log_every": 1, "checkpoint_every": 2,
          "optim": {"lr": 1e-2, "warmup_steps": 2}, "mesh": mesh, "tensorboard": False}


def worker(args):
  import jax
  from fot_jax import parallel
  from fot_jax.train import train
  parallel.initialize_distributed(coordinator_address=f"localhost:{args.port}", num_processes=2,
                                  process_id=args.process_id)
  assert jax.process_count() == 2 and jax.device_count() == 4
  cfg, batches, _ = setup()
  pid, n = jax.process_index(), jax.process_count()

  def local_rows(step):  # this host's own slots only
    batch = batches(step)
    rows = batch["inputs"].shape[0] // n
    return {k: v[pid * rows:(pid + 1) * rows] for k, v in batch.items()}

  mesh = {"data": 1, "fsdp": 2, "tensor": 2}
  _, _, schedule = setup()
  first = train(cfg, train_cfg(2, mesh), schedule, local_rows, args.workdir, name=f"p{pid}")
  _, _, schedule = setup()
  second = train(cfg, train_cfg(STEPS, mesh), schedule, local_rows, args.workdir, name=f"p{pid}")
  params = jax.tree_util.tree_map(lambda x: np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True)),
                                  second["params"])
  if pid == 0:
    flat = {jax.tree_util.keystr(k): v.tolist() for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    with open(os.path.join(args.workdir, "two_process.json"), "w") as f:
      json.dump({"losses": [h["loss"] for h in first["history"] + second["history"]], "params": flat}, f)


def launch(workdir: str) -> dict:
  """Runs the two workers; returns what process 0 wrote."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
  procs = [subprocess.Popen([sys.executable, "-m", "launch.two_process_check", "--worker",
                             f"--process_id={i}", f"--port={port}", f"--workdir={workdir}"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    if p.returncode:
      raise RuntimeError(f"worker failed ({p.returncode}):\n{out[-4000:]}")
  with open(os.path.join(workdir, "two_process.json")) as f:
    result = json.load(f)
  result["log"] = outs[0]
  return result


def one_process(workdir: str) -> dict:
  import jax
  from fot_jax.train import train
  cfg, batches, schedule = setup()
  out = train(cfg, train_cfg(STEPS, None), schedule, batches, workdir, name="one")
  flat = {jax.tree_util.keystr(k): np.asarray(v).tolist()
          for k, v in jax.tree_util.tree_flatten_with_path(out["params"])[0]}
  return {"losses": [h["loss"] for h in out["history"]], "params": flat}


def compare(two: dict, one: dict) -> float:
  """Largest parameter difference; raises if the losses differ."""
  np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
  return max(float(np.max(np.abs(np.asarray(two["params"][k]) - np.asarray(v)))) for k, v in one["params"].items())


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--worker", action="store_true")
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--workdir", required=True)
  a = parser.parse_args()
  if a.worker:
    worker(a)
  else:
    two = launch(os.path.join(a.workdir, "two"))
    one = one_process(os.path.join(a.workdir, "one"))
    diff = compare(two, one)
    print(f"two processes (4 devices) vs one process: losses {two['losses']} == {one['losses']}; "
          f"max parameter difference {diff:.2e}")
