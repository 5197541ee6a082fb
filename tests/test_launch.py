"""launch/: TPU pod dry run for a v4-32 and each --install source, the gs:// workdir check, sweep
expansion (locally and to a pod); --mode=plan, its JSON and its errors."""
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from fot_jax import configs
from launch import sweep, tpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZONE = "us-central2-b"


def _printed(capsys):
  return [shlex.split(line[2:]) for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]


def test_v4_32_dry_run_prints_every_command(capsys):
  args = ["--name=fot-v4", f"--zone={ZONE}", "--accelerator=v4-32", "--project=proj", "--dry_run", "up", "--",
          "--config=experiments/longllama_3b.py", "--workdir=gs://bucket/l3b"]
  assert tpu.main(args) == 0
  out = capsys.readouterr().out
  assert "v4-32, 4 worker(s)" in out
  cmds = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("$ ")]
  base = ["gcloud", "compute", "tpus", "tpu-vm"]
  where = [f"--zone={ZONE}", "--project=proj"]
  assert cmds[0] == base + ["describe", "fot-v4", "--format=value(state)"] + where
  assert cmds[1] == base + ["create", "fot-v4", "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base"] + where
  assert cmds[2][:2] == ["tar", "czf"]
  assert cmds[3] == base + ["scp", cmds[2][2], "fot-v4:~/fot_jax_checkout.tar.gz", "--worker=all"] + where
  assert cmds[4][:6] == base + ["ssh", "fot-v4"] and cmds[4][6] == "--worker=all"
  assert "pip install -q -e '.[core,tpu]'" in cmds[4][7] and "requirements.txt" not in cmds[4][7]
  run = cmds[5]
  assert run[:7] == base + ["ssh", "fot-v4", "--worker=all"]
  assert run[7] == ("--command=cd ~/fot_jax && nohup .venv/bin/python -m fot_jax.main "
                    "--config=experiments/longllama_3b.py --workdir=gs://bucket/l3b --jax_distributed "
                    "> ~/fot_jax_run.log 2>&1 < /dev/null & echo $! > ~/fot_jax_run.pid")
  assert cmds[6][:7] == base + ["ssh", "fot-v4", "--worker=0"] and "tail" in cmds[6][7]
  assert len(cmds) == 7
  tpu.main(["--name=fot-v4", f"--zone={ZONE}", "--dry_run", "stop"])
  assert _printed(capsys) == [base + ["ssh", "fot-v4", "--worker=all", "--command=kill -TERM $(cat ~/fot_jax_run.pid)",
                                      f"--zone={ZONE}"]]


def _refused(capsys, call, *want):
  """call() exits with status 2 and one stderr line holding every `want`."""
  with pytest.raises(SystemExit) as e:
    call()
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and all(w in err[0] for w in want), err
  return err[0]


def test_tpu_launcher_rejects_unknown_accelerators(capsys):
  line = _refused(capsys, lambda: tpu.main(["--name=x", f"--zone={ZONE}", "--accelerator=v9-8", "--dry_run", "delete"]),
                  "--accelerator=v9-8")
  assert line.startswith("launch.tpu: ")
  assert tpu.workers("v4-32") == 4 and tpu.workers("v3-8") == 1 and tpu.workers("v5p-128") == 16


def test_tpu_install_sources_dry_run(capsys):
  """--install: a git URL and ref, a gs:// tarball, or only a check; each an ssh to every worker that
  ends in the same editable install (check: none), then the run."""
  base = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "fot", "--worker=all"]
  main_args = ["--", "--config=experiments/longllama_3b.py", "--workdir=gs://b/l3b"]
  pip = "cd ~/fot_jax && (test -x .venv/bin/python || python3 -m venv .venv) && .venv/bin/python -m pip install -q -e '.[core,tpu]'"
  want = {
      "git+https://github.com/me/fot_jax.git@v1.2": "mkdir -p ~/fot_jax && cd ~/fot_jax && (test -d .git || git init -q) && "
      "git fetch -q https://github.com/me/fot_jax.git v1.2 && git checkout -q -f FETCH_HEAD && " + pip,
      "git+git@github.com:me/fot_jax.git": "git fetch -q git@github.com:me/fot_jax.git HEAD && ",  # scp-style: '@' kept
      "gs://b/src/fot_jax.tar.gz": "gcloud storage cp gs://b/src/fot_jax.tar.gz ~/fot_jax_checkout.tar.gz && "
      "mkdir -p ~/fot_jax && tar xzf ~/fot_jax_checkout.tar.gz -C ~/fot_jax && " + pip,
      "check": "cd ~/fot_jax && .venv/bin/python -c 'import fot_jax'"}
  for source, command in want.items():
    assert tpu.main(["--name=fot", f"--zone={ZONE}", f"--install={source}", "--dry_run", "install"]) == 0
    cmds = _printed(capsys)
    assert len(cmds) == 1 and cmds[0][:7] == base and command in cmds[0][7], (source, cmds)
  # `run` checks the import on every worker before it starts anything
  assert tpu.main(["--name=fot", f"--zone={ZONE}", "--dry_run", "run", *main_args]) == 0
  cmds = _printed(capsys)
  assert cmds[0] == base + ["--command=cd ~/fot_jax && .venv/bin/python -c 'import fot_jax'", f"--zone={ZONE}"]
  assert "nohup .venv/bin/python -m fot_jax.main" in cmds[1][7] and len(cmds) == 3
  _refused(capsys, lambda: tpu.main(["--name=fot", f"--zone={ZONE}", "--install=pypi", "--dry_run", "install"]),
           "--install=pypi", "git+URL")


def test_tpu_and_sweep_refuse_a_workdir_the_workers_cannot_share(capsys):
  for workdir in ("runs/l3b", "/tmp/l3b", "gs://"):
    line = _refused(capsys, lambda: tpu.main(["--name=fot", f"--zone={ZONE}", "--dry_run", "up", "--",
                                               "--config=experiments/longllama_3b.py", f"--workdir={workdir}"]),
                    f"--workdir={workdir}", "gs://BUCKET/PATH")
    assert line.startswith("launch.tpu: ")
  _refused(capsys, lambda: tpu.main(["--name=fot", f"--zone={ZONE}", "--dry_run", "run", "--",
                                     "--config=experiments/longllama_3b.py", "--workdir", "runs/x"]), "--workdir=runs/x")
  _refused(capsys, lambda: tpu.main(["--name=fot", f"--zone={ZONE}", "--dry_run", "run", "--",
                                     "--config=experiments/longllama_3b.py"]), "no --workdir")
  line = _refused(capsys, lambda: sweep.main(["--config=experiments/analysis_184m_c4.py", "--workdir=runs/an",
                                               "--tpu=fot", f"--zone={ZONE}", "--dry_run"]), "--workdir=runs/an", "gs://")
  assert line.startswith("launch.sweep: ")
  assert sweep.main(["--config=experiments/analysis_184m_c4.py", "--workdir=runs/an", "--dry_run"]) == 0  # locally: fine


def test_sweep_to_a_pod_installs_once_then_runs_each(capsys):
  """sweep --tpu --dry_run: the install (default: this checkout; --install=check: the import check)
  once, then each named run started on every worker with its own gs:// workdir and its log streamed."""
  path = "experiments/analysis_184m_c4.py"
  names = [r["name"] for r in configs.sweep_runs(path)]
  base = ["gcloud", "compute", "tpus", "tpu-vm"]
  assert sweep.main([f"--config={path}", "--workdir=gs://b/an/", "--tpu=fot", f"--zone={ZONE}", "--dry_run"]) == 0
  cmds = _printed(capsys)
  assert cmds[0][:2] == ["tar", "czf"] and cmds[1][:5] == base + ["scp"] and "pip install" in cmds[2][7]
  runs = cmds[3:]
  assert len(runs) == 2 * len(names)
  for name, start, logs in zip(names, runs[::2], runs[1::2]):
    assert start[:7] == base + ["ssh", "fot", "--worker=all"]
    assert start[7] == (f"--command=cd ~/fot_jax && nohup .venv/bin/python -m fot_jax.main --config={path} "
                        f"--sweep_run={name} --workdir=gs://b/an/{name} --jax_distributed "
                        "> ~/fot_jax_run.log 2>&1 < /dev/null & echo $! > ~/fot_jax_run.pid")
    assert logs[:7] == base + ["ssh", "fot", "--worker=0"] and "tail" in logs[7]
  assert sweep.main([f"--config={path}", "--workdir=gs://b/an", "--tpu=fot", f"--zone={ZONE}", "--install=check",
                     "--dry_run"]) == 0
  cmds = _printed(capsys)
  assert cmds[0][7] == "--command=cd ~/fot_jax && .venv/bin/python -c 'import fot_jax'"
  assert len(cmds) == 1 + 2 * len(names)


def test_a_failed_import_check_is_one_line_saying_how_to_install(capsys, monkeypatch):
  """What a worker without fot_jax gives: the check's ssh fails (stubbed), the sweep stops before any
  run with one line naming the VM and the --install choices."""
  ran = []

  def call(cmd):
    ran.append(cmd)
    return 1  # the check fails on some worker
  monkeypatch.setattr(tpu.subprocess, "call", call)
  line = _refused(capsys, lambda: sweep.main(["--config=experiments/analysis_184m_c4.py", "--workdir=gs://b/an",
                                               "--tpu=fot", f"--zone={ZONE}", "--install=check"]),
                  "launch.sweep: fot_jax does not import on every worker of TPU VM fot", "--install=checkout",
                  "--install=git+URL@REF", "--install=gs://BUCKET/FILE.tar.gz")
  assert len(ran) == 1 and "import fot_jax" in ran[0][7], line


def test_sweep_expands_into_named_runs_with_their_own_workdirs(capsys):
  path = "experiments/analysis_184m_c4.py"
  assert sweep.main([f"--config={path}", "--workdir=runs/an", "--dry_run"]) == 0
  cmds = _printed(capsys)
  names = [r["name"] for r in configs.sweep_runs(path)]
  assert names == ["d2to64_w1", "d1_w1", "d2to64_w2", "d1_w2"]
  assert [c[-2:] for c in cmds] == [[f"--sweep_run={n}", f"--workdir=runs/an/{n}"] for n in names]
  # Each run's overrides give a valid config with its own w and d schedule.
  from experiments import analysis_184m_c4
  for run in configs.sweep_runs(path):
    config = configs.apply_overrides(analysis_184m_c4.get_config(), run)
    configs.resolve(config, check_data=False)  # C4 and its tokenizer are not on this machine
    w = int(run["name"][-1])
    assert config.data.windows_per_slot == w + 1
    assert [s[1]["d"] for s in config.train.curriculum.stages] == ([2, 64] if "d2to64" in run["name"] else [1])
  with pytest.raises(ValueError, match="no field 'nope'"):
    configs.apply_overrides(analysis_184m_c4.get_config(), {"train.nope": 1})


def test_every_experiment_file_validates():
  """Files whose data (C4, arXiv, OpenLLaMA tokenizer) is not on this machine validate without
  the data checks; the others with them."""
  from fot_jax.study import settings as study_settings
  from fot_jax.model.config import get_size
  for name in sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "experiments"))
                     if f.endswith(".py") and f not in ("__init__.py", "base_lm.py")):
    config = configs.load_module(f"experiments/{name}.py").get_config()
    if name.startswith("study_"):  # controlled studies: the base's training config and every method
      base = get_size("tiny", num_layers=32)  # a checkpoint base (absent here): a deep stand-in
      if config.base.get("train") is not None:
        base = configs.resolve(config.base.train, check_data=True).model
      for method in study_settings.StudySettings.from_dict(config).methods:  # the study file read, fine-tunes too
        method.model_config(base)
      continue
    local_data = name in ("dictionary_lookup", "stdlib_lm_tiny")
    configs.resolve(config, check_data=local_data)
    # ml_collections overrides tuples from the command line (--config.eval.memory_tokens='(32,4096)')
    # but refuses lists: a list of numbers or strings in an experiment file cannot be overridden.
    assert not [path for path, v in _leaves(config) if isinstance(v, list) and v
                and all(isinstance(x, (int, float, str)) for x in v)], name


def _leaves(c, path=""):
  for k, v in c.items():
    p = f"{path}.{k}" if path else k
    yield from (_leaves(v, p) if hasattr(v, "items") and not isinstance(v, dict) else [(p, v)])


def _main(*args):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "fot_jax.main", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def test_plan_mode_reports_params_flops_and_memory_without_a_workdir():
  proc = _main("--config=experiments/dictionary_lookup.py", "--mode=plan", "--config.mesh.data=2",
               "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = proc.stdout
  from fot_jax.model.init import init_params
  cfg = configs.resolve(configs.load_module("experiments/dictionary_lookup.py").get_config()).model
  import jax
  n = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(init_params(cfg, 0)))
  assert f"parameters         {n:,}" in out
  assert "data=2 x fsdp=2 x tensor=2 x context=1 (8 devices)" in out
  assert "32 rows x 32 tokens" in out  # 16 slots x 2 windows of 32
  assert "(scope batch)" in out
  assert "FLOPs per step" in out and "memory per device" in out
  assert "model FLOPs" in out  # the formula itself: tests/test_benchmarks.py (accelerator check)


_TINY_PLAN = ("--config=experiments/dictionary_lookup.py", "--mode=plan", "--config.mesh.data=2",
              "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
_SIZE = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def test_plan_mode_lists_the_largest_buffers_live_at_the_peak(tmp_path, monkeypatch):
  """--plan_top=N: a table of the N largest buffers live at the step's peak, largest first, each
  with its size, kind, shape, live span, HLO instruction and op_name (source); XLA's dump is removed."""
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the plan's XLA dump goes
  proc = _main(*_TINY_PLAN, "--plan_top=5", f"--plan_json={tmp_path / 'plan.json'}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  _check_plan_json(tmp_path / "plan.json", proc.stdout, _TINY_PLAN + ("--plan_top=5",))
  lines = proc.stdout.splitlines()
  head = next(i for i, line in enumerate(lines) if line.startswith("largest buffers    live at the step's peak"))
  m = re.search(r"the temporaries are one ([\d.]+) (\w+) block", lines[head + 1])
  temporaries = float(m.group(1)) * _SIZE[m.group(2)]
  assert lines[head + 3].split()[:4] == ["size", "kind", "shape", "live"]
  rows = [line.split() for line in lines[head + 4:]]
  assert len(rows) == 5
  sizes = [float(r[0]) * _SIZE[r[1]] for r in rows]
  assert sizes == sorted(sizes, reverse=True) and 0 < sizes[0] <= temporaries
  for r in rows:
    assert r[2] in ("temporary", "argument", "output", "constant", "thread-local"), r
    assert re.fullmatch(r"(pred|[sufc]\d+|bf16|f8\w*)\[[\d,]*\]", r[3]), r
    assert re.fullmatch(r"\d+-\d+%", r[4]), r
  assert any("jvp(LlamaModel)/" in line and "(fot_jax/model/" in line for line in lines[head + 4:])
  assert not [f for f in os.listdir(tmp_path) if f.startswith("fot_jax_plan_xla_")]


def _check_plan_json(path, stdout, args):
  """--plan_json: the printed plan, word for word, and every figure of it as a number (read back from
  the printed text here, independently of plan.py), the command, what the planning process used."""
  from fot_jax import plan
  with open(path) as f:
    record = json.load(f)
  assert record["printed"] + "\n" == stdout
  assert plan.format_plan(record["plan"]) == record["printed"]  # the figures alone give the same text
  p, text = record["plan"], record["printed"]
  params = int(re.search(r"^parameters\s+([\d,]+)", text, re.M).group(1).replace(",", ""))
  mem = [float(x) for x in re.search(r"^memory per device\s+([\d.]+) GiB = arguments ([\d.]+) \+ outputs ([\d.]+) "
                                     r"\+ temporaries ([\d.]+)", text, re.M).groups()]
  assert p["params"] == params
  m = p["memory_per_device"]
  assert [round(m[k] / 2 ** 30, 2) for k in ("total", "arguments", "outputs", "temporaries")] == mem
  assert f"{p['flops_per_step']:.3e}" in text and f"{p['model_flops']:.3e}" in text and p["mesh"] in text
  assert record["command"] == "python -m fot_jax.main " + " ".join(args) + f" --plan_json={path}"
  assert record["resources"]["cpu_seconds"] > 0 and record["resources"]["max_rss_bytes"] > 2 ** 20
  assert record["provenance"]["commit"] and record["provenance"]["date"]


def test_plan_buffers_are_live_together_and_fit_the_memory_analysis(tmp_path):
  """Every buffer live at the peak, exactly: the temporaries sit at disjoint offsets of XLA's
  temp block and add up to at most its size, the arguments to at most the step's arguments."""
  script = """if True:
    import json, os, sys
    dump = sys.argv[1]
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 --xla_dump_to={dump} --xla_dump_hlo_as_text"
    from fot_jax import configs, plan
    c = configs.load_module("experiments/dictionary_lookup.py").get_config()
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    p = plan.plan(configs.resolve(c, check_data=False), dump, 10_000)
    print(json.dumps({"memory": p["memory_per_device"], "buffers": p["largest_buffers"]}))
  """
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = json.loads(proc.stdout.splitlines()[-1])
  mem, b = out["memory"], out["buffers"]
  rows = b["buffers"]
  assert len(rows) == b["live_at_peak"] > 10
  assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)
  assert rows[0]["bytes"] <= mem["total"] and b["peak_bytes"] <= mem["total"]
  temps = sorted((r["offset"], r["bytes"]) for r in rows if r["kind"] == "temporary")
  assert len({r["allocation"] for r in rows if r["kind"] == "temporary"}) == 1  # XLA:CPU's one temp block
  assert all(a + n <= b_ for (a, n), (b_, _) in zip(temps, temps[1:]))  # live together: no shared bytes
  assert sum(n for _, n in temps) == b["peak_by_kind"]["temporary"] <= mem["temporaries"]
  assert temps[-1][0] + temps[-1][1] <= mem["temporaries"]
  assert b["peak_by_kind"]["argument"] <= mem["arguments"]
  assert all(r["op_name"] for r in rows[:10]), rows[:10]


def test_plan_mode_rejects_a_bad_mesh_before_tracing(tmp_path, monkeypatch):
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # the XLA dump folder is removed on an error too
  proc = _main("--config=experiments/longllama_3b.py", "--mode=plan", "--plan_devices=256",
               "--config.mesh.fsdp=64", "--config.mesh.tensor=2")
  assert proc.returncode != 0
  assert "config error: mesh: data*fsdp*tensor*context = 128 but there are 256 devices" in proc.stderr
  assert "Traceback" not in proc.stderr
  proc = _main("--config=experiments/longllama_3b.py", "--mode=plan", "--config.mesh.fsdp=256",
               "--config.mesh.tensor=1")
  assert proc.returncode != 0
  assert re.search(r"config error: model parameter .*: dimension \d of size 3200 is not divisible by mesh axes "
                   r"fsdp of size 256", proc.stderr)
  assert "Traceback" not in proc.stderr
  assert not [f for f in os.listdir(tmp_path) if f.startswith("fot_jax_plan_xla_")]
  # A dictionary run's crossbatch scope is its `fot` arm's, as training reads it: with 'device' each of
  # the 4 batch shards holds 4 of the 16 slots, too few for the negatives phase's d=16 (the same mesh
  # plans with scope 'batch' in test_plan_mode_reports_params_flops_and_memory_without_a_workdir).
  proc = _main(*_TINY_PLAN, "--config.fot.crossbatch_scope=device")
  assert proc.returncode != 0
  assert "config error: crossbatch.d: d=16 needs 16 slots (1 positive + 15 negative) but the batch has 4" in proc.stderr
