"""LongLLaMA-3B: FoT fine-tuning of OpenLLaMA-3B (FoT paper Section 4, App. A.2).

Memory layers 6/12/18 with 'first' positions; each slot holds 4 windows of 2K tokens
with segments [(0,0),(1,1),(2,1),(3,0)] (positives, negatives per position), every
window scored; 256K tokens per batch (32 slots x 4 x 2048); constant lr 2e-5, weight
decay 0.01, 10B tokens; starts from an imported OpenLLaMA-3B checkpoint.
Mesh: fully sharded over all devices with 2-way tensor parallelism; on a v4-32 (16
chips) that is fsdp=8 x tensor=2, on 256 devices fsdp=128 x tensor=2 (python -m
fot_jax.main --config=experiments/longllama_3b.py --mode=plan --plan_devices=256).
"""
from experiments.base_lm import base_config, segments_spec

TOKENS = 10_000_000_000
SEGMENTS = [(0, 0), (1, 1), (2, 1), (3, 0)]


def get_config():
  c = base_config()
  c.model.size = "openllama_3b"
  # Streamed attention (O(T x block) scores, crossbatch sources read inside its scan): the
  # dense reference needs 55 GiB per device here (docs/scale_out.md, "What fills memory").
  c.model.overrides.attention_impl = "blockwise"
  # Runs of plain layers as one lax.scan: FSDP gathers one layer's weights at a time
  # (docs/scan_and_remat.md); the size's remat (policy 'full') keeps one layer's activations.
  c.model.overrides.scan_layers = True
  c.data.corpus, c.data.eval_task = "longllama", "pg19"  # the RedPajama + Python mixture (data_pipelines.tasks)
  c.data.vocab = "checkpoints/open_llama_3b/tokenizer.model"
  c.data.slots, c.data.windows_per_slot, c.data.window = 32, len(SEGMENTS), 2048
  c.data.min_doc_len = 2048
  steps = TOKENS // (c.data.slots * c.data.windows_per_slot * c.data.window)
  c.optim.lr, c.optim.warmup_steps, c.optim.schedule, c.optim.total_steps = 2e-5, 0, "constant", steps
  c.optim.weight_decay, c.optim.clip_norm = 0.01, 1.0
  c.train.steps, c.train.loss_on = steps, "all"
  c.train.checkpoint_every, c.train.log_every = 1000, 10
  c.train.curriculum = {"kind": "constant", "spec": segments_spec(SEGMENTS)}
  # Written by fot_jax.convert (imported from the Hugging Face OpenLLaMA-3B weights).
  c.train.init_from = "checkpoints/open_llama_3b/fot"
  c.baseline.enabled = False  # no second 10B-token run without crossbatch
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 2
  c.eval.memory_tokens = [0, 8192, 32768, 131072]
  return c
