"""The context-extension study on a real base: SmolLM2-135M (8K native context), imported by
`make smollm2` to checkpoints/smollm2-135m (the config fails with that hint when it is absent).

  nice -n 10 python -m fot_jax.study --config=experiments/study_smollm2.py --workdir=runs/study_smollm2

All methods without fine-tuning, from 4,096 through the native 8,192 to 16,384 tokens (2x). RoPE
scaling with factor 2 (dynamic NTK with the study's s = C'/(2C) = 1: scaled by the current length
only), Self-Extend and LM-Infinite with the study's LLaMA-2 settings (W=1024, G=64; 10 sinks,
M = L0), and FoT memory without fine-tuning in every layer and in three, with a 512-token local
window (an earlier probe: passkey 2/2 at 16,874 tokens with memory in all 30 layers), and the same
two reading memory as InfLLM-style blocks (`block_memory_all`, `block_memory_3`: blocks of 128, the
8 best per window; docs/block_memory.md). Every method
streams its attention (`attention_impl='blockwise'`, blocks of 1,024: no 16K x 16K scores, the
future skipped; on 2 cores 1,024 runs a 16K window 1.3x faster than 512).

CPU-sized grid: one document for perplexity (its last 256 tokens) and the passkey at one depth
(0.5), one trial per cell: two forwards per length and method (a 16K forward of the 30 layers is
most of it). NIAH is configured (1 and 4 needles, same depth) but not in the default suites: on
SmolLM2 it found no needle in a code haystack with any memory configuration or none, up to 16K
(docs/real_models.md), and it doubles the cost; add it with --config.suites='("ppl","passkey","niah")'
(only the NIAH suite then runs on finished methods). Resumable per method and suite
(W/methods/<name>.json, <name>.partial.json); on an accelerator widen it, e.g.
--config.ppl.n_docs=8 --config.eval.passkey.depths='(0.1,0.3,0.5,0.7,0.9)' --config.eval.passkey.trials=5.
Some methods only: `--config=experiments/study_smollm2.py:block_memory_all,block_memory_3`.
"""
import ml_collections

from experiments import study_tiny
from fot_jax.study.settings import select_methods
from fot_jax.eval import settings as eval_settings

CHECKPOINT = "checkpoints/smollm2-135m"
BLOCKS = {"mode": "blocks"}  # memory.BlockSpec's defaults (study.settings.MemoryRetrieval): blocks of 128, 16 reps, top 8
L0, FACTOR = 8192, 2
LENGTHS = (4096, 8192, 16384)


def methods():
  out = [m for m in study_tiny.methods(l0=L0, factor=FACTOR, se_window=1024, se_group=64)
         if not m["name"].startswith(("fot_memory", "block_memory", "topk_memory"))]
  out += [{"name": "fot_memory_all", "inference": "memory", "window": 512,
           "overrides": {"mem_layers": tuple(range(30))}},
          {"name": "fot_memory_3", "inference": "memory", "window": 512,
           "overrides": {"mem_layers": (9, 19, 29)}}]
  # The same two, reading memory as InfLLM-style blocks (docs/block_memory.md) instead of all of it:
  # the defaults (blocks of 128 slots, 16 representatives, the 8 best per window and kv head) attend
  # 1,024 memory tokens, 2/7 to 1/15 of the 3,584-15,872 in memory at 4K-16K, and were measured
  # within 0.005 nats of dense on this frozen model (every layer, window 256, 2K tokens; InfLLM's
  # own 128-token blocks, with 16 representatives where its 4 did worse). InfLLM's local window is the
  # memory path's window (512; each window's own first tokens stand where InfLLM's sink tokens do:
  # fot_jax has no separate sinks on the memory path).
  out += [{"name": "block_memory_all", "inference": "memory", "window": 512, "memory": dict(BLOCKS),
           "overrides": {"mem_layers": tuple(range(30))}},
          {"name": "block_memory_3", "inference": "memory", "window": 512, "memory": dict(BLOCKS),
           "overrides": {"mem_layers": (9, 19, 29)}}]
  for m in out:  # streamed attention: a 16K window without 16K x 16K scores, the future skipped
    m["overrides"] = dict(m.get("overrides", {}), attention_impl="blockwise", attention_block=1024)
  order = ("none", "yarn", "self_extend", "lm_infinite", "fot_memory_3", "fot_memory_all", "block_memory_3",
           "block_memory_all")
  return sorted(out, key=lambda m: order.index(m["name"]) if m["name"] in order else len(order))


def get_config(only: str = ""):
  """`--config=experiments/study_smollm2.py:NAME,NAME` evaluates only the methods named (e.g.
  `:block_memory_all,block_memory_3`); finished methods are kept whatever the subset."""
  c = ml_collections.ConfigDict()
  c.base = ml_collections.ConfigDict({"checkpoint": CHECKPOINT,
                                      "missing_hint": "import SmolLM2-135M first: `make smollm2`"})
  c.lengths = LENGTHS
  c.methods = select_methods(methods(), only, "study_smollm2")
  c.suites = ("ppl", "passkey")
  c.pad = 1024
  c.ppl = ml_collections.ConfigDict({"score_tokens": 256, "n_docs": 1, "tolerance": 1.1})
  e = eval_settings.default_config()
  e.task, e.batch, e.window = "stdlib", 1, L0
  for g in (e.passkey, e.niah):
    g.depths, g.trials = (0.5,), 1
  e.niah.n_needles, e.niah.corpus_docs = 4, 200
  c.eval = e
  return c
