"""benchmarks/accelerator_check.sh stays green on CPU in its reduced form."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import accelerator_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accelerator_check_reduced_runs_on_cpu(tmp_path):
  env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, JAX_PLATFORMS="cpu")
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "accelerator_check.sh"), "--reduced"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  r = json.loads((tmp_path / "tiny_dense_d2.json").read_text())
  assert r["backend"] == "cpu" and r["mfu"] is None and r["dtype"] == "bfloat16"
  assert r["peak_source"] == "memory_analysis" and r["peak_bytes"] == r["compiled_bytes"] > 0
  assert r["step_s"] > 0 and np.isfinite(r["loss"]) and len(r["times_s"]) == 2
  # Model FLOPs from the tiny model's shape (2 layers: hidden 32, 4 heads of 8 and 2 kv heads,
  # intermediate 64, vocab 64, untied), 4 rows x 16 tokens, d=2: the 2 last windows see 2 extra windows.
  h, kv, mlp, vocab, t, rows = 32, 16, 64, 64, 16, 4
  matmul = 2 * (h * h + 2 * h * kv + h * h + 3 * h * mlp) + h * vocab
  attention = 12 * t * t * h * (rows * 2 + 2 * 2)  # every row's window in 2 layers + 4 extra windows
  assert r["model_flops"] == 6 * matmul * rows * t + attention
  assert "tiny d=2" in proc.stdout and "(0 failed)" in proc.stdout


def test_accelerator_peak_table():
  assert accelerator_check.peak_flops("NVIDIA H200") == 989e12
  assert accelerator_check.peak_flops("NVIDIA H100 PCIe") == 756e12
  assert accelerator_check.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert accelerator_check.peak_flops("TPU v5 lite") == 197e12
  assert accelerator_check.peak_flops("TPU v4") == 275e12
  assert accelerator_check.peak_flops("cpu") is None


def test_long_forward_runs_every_variant(tmp_path):
  from benchmarks import long_forward
  out = long_forward.main(["--size", "tiny", "--layers", "1", "--lengths", "48", "--block", "16", "--runs", "1",
                           "--json", str(tmp_path / "r.json")])
  assert len(out["rows"]) == 6 and len(out["ratios"]) == 3
  assert all(r["seconds"] > 0 and r["temp_bytes"] > 0 for r in out["rows"])
  assert json.loads((tmp_path / "r.json").read_text())["ratios"] == out["ratios"]


def test_compile_time_compiles_both_variants(tmp_path):
  from benchmarks import compile_time
  out = compile_time.main(["--size", "tiny", "--overrides", '{"num_layers": 3, "mem_layers": [2]}', "--rows", "2",
                           "--window", "8", "--repeats", "1", "--json", str(tmp_path / "r.json")])
  assert [r["variant"] for r in out["results"]] == ["unrolled", "scanned"]
  assert all(r["median_total_s"] > 0 and r["temp_bytes"] > 0 and len(r["total_s"]) == 1 for r in out["results"])
  assert json.loads((tmp_path / "r.json").read_text())["unrolled_over_scanned"] == out["unrolled_over_scanned"]


def test_host_memory_benchmark_reads_one_prompt_both_ways(tmp_path):
  from benchmarks import host_memory
  from fot_jax import checkpoint
  from fot_jax.model.config import get_size
  from fot_jax.model.init import init_params
  cfg = get_size("tiny", vocab_size=260)
  ck = str(tmp_path / "ckpt")
  checkpoint.save(ck, init_params(cfg, 0), cfg, 16)
  out = host_memory.main(["--checkpoint", ck, "--vocab", "byte", "--window", "16", "--lengths", "200",
                          "--variants", "dense,host_flat", "--topk", "4", "--json", str(tmp_path / "r.json")])
  assert [r["variant"] for r in out["rows"]] == ["dense", "host_flat"]
  assert all(r["seconds"] > 0 for r in out["rows"]) and len(out["ratios"]) == 1
  assert json.loads((tmp_path / "r.json").read_text())["ratios"] == out["ratios"]


def test_memory_write_benchmark_times_capacities_and_chunks(tmp_path):
  from benchmarks import memory_write
  from fot_jax import checkpoint
  from fot_jax.model.config import get_size
  from fot_jax.model.init import init_params
  cfg = get_size("tiny", vocab_size=260)
  ck = str(tmp_path / "ckpt")
  checkpoint.save(ck, init_params(cfg, 0), cfg, 16)
  out = memory_write.main(["--checkpoint", ck, "--window", "16", "--tokens", "64", "--topk", "4",
                           "--chunks", "16,64", "--json", str(tmp_path / "w.json")])
  assert [(r["capacity"], r["chunk"]) for r in out["rows"]] == [("full", 16), ("full", 64), ("grow", 16), ("grow", 64)]
  assert all(r["seconds"] > 0 for r in out["rows"]) and out["rows"][0]["over_first"] == 1.0
  saved = json.loads((tmp_path / "w.json").read_text())["rows"]
  assert saved[2]["over_first"] == pytest.approx(out["rows"][2]["seconds"] / out["rows"][0]["seconds"])
  with pytest.raises(SystemExit, match="--chunks"):
    memory_write.main(["--checkpoint", ck, "--window", "16", "--tokens", "64", "--chunks", "0"])
  with pytest.raises(SystemExit, match="multiple of --window"):
    memory_write.main(["--checkpoint", ck, "--window", "16", "--tokens", "40"])
