"""LongLLaMA-3B with 32K-token windows split over 8 devices (sequence parallelism).

As experiments/longllama_3b.py (OpenLLaMA-3B, memory layers 6/12/18, 'first' positions,
segments [(0,0),(1,1),(2,1),(3,0)], constant lr 2e-5) but each window holds 32,768 tokens,
16 times LongLLaMA's 2K, so the causal window alone is 32K and a memory layer's softmax
spans up to 4 x 32K keys. A window does not fit one device's activations, so the mesh's
`context` axis (8) splits every window: ring attention (fot_jax/model/context_parallel.py)
with the zigzag layout for causal balance; the extra contexts travel the same ring. 2 slots
x 4 windows x 32K = 262,144 tokens per step (LongLLaMA's 256K), one row per fsdp shard.
Mesh: data=1 x fsdp=8 x tensor=2 x context=8 = 128 devices (python -m fot_jax.main
--config=experiments/longllama_3b_32k.py --mode=plan).
"""
from experiments import longllama_3b

WINDOW = 32768


def get_config():
  c = longllama_3b.get_config()
  c.data.slots, c.data.window = 2, WINDOW
  c.data.min_doc_len = WINDOW
  steps = longllama_3b.TOKENS // (c.data.slots * c.data.windows_per_slot * c.data.window)
  c.optim.total_steps = c.train.steps = steps
  c.model.overrides.attention_impl = "blockwise"  # O(T x block) scores within each device's chunk
  c.model.overrides.attention_block = 1024
  c.model.overrides.context_parallel = "ring"
  c.model.overrides.context_layout = "zigzag"
  # Unrolled here: with the ring over `context`, XLA:CPU's plan of the scanned step held 35.76 GiB
  # per device against 31.37 unrolled (docs/scan_and_remat.md).
  c.model.overrides.scan_layers = False
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.context = 1, 8, 2, 8
  c.eval.memory_tokens = [0, 65536, 262144]
  return c
