"""The controlled context-extension study in miniature, on CPU:

  python -m fot_jax.study --config=experiments/study_tiny.py --workdir=runs/study_tiny

Base: the tiny byte-level FoT model of experiments/stdlib_lm_tiny.py (3 layers of 64, memory
layer 1, window 128), trained here first (W/base) on that file's whole curriculum (the copy
warm-up on byte ids, the copy of stdlib text through memory at d=1 and d=8, then stdlib with a
quarter of the slots repeated, at d=8, then the same with short passkey documents; docs/data.md),
FoT arm only, so the base can copy and retrieve a passkey at all. The same model trained by `stdlib_lm_tiny` can stand in for it:
`--config.base.checkpoint=runs/stdlib/fot`. The methods extend it from L0 = 128 to 1,024 tokens (8x). Frozen (no fine-tuning):
RoPE scaling with factor 8 (PI, NTK-frozen, YaRN; dynamic NTK with the study's s = C'/(2C) = 4),
Self-Extend, LM-Infinite, and FoT memory (the base's trained memory layer, and memory in every
layer, which the base was never trained with), and `block_memory`: the trained memory layer read as
InfLLM-style block memory (blocks of 32, the 4 best per window; see BLOCKS) instead of all of it. Fine-tuned twins (`none_ft`, `pi_ft`, `ntk_ft`,
`dynamic_ntk_ft`, `yarn_ft`, `fot_ft`: the same specs with `"finetune": True`), all with the same
c.finetune: FT_STEPS steps from the base on the stdlib corpus, 8 slots x L_FT = 512 tokens a step,
the same AdamW; the plain ones as one 512-token window per slot, `fot_ft` as 4 windows of 128 per
slot with crossbatch d=2 (docs/context_extension.md, "Controlled study"). About 14 minutes of
training on 2 cores, before their evaluation.
"""
import ml_collections

from experiments import stdlib_lm_tiny
from fot_jax.study.settings import select_methods
from fot_jax.eval import settings as eval_settings

L0, FACTOR = 128, 8
LENGTHS = (128, 256, 512, 1024)
L_FT, FT_STEPS = 512, 100  # the fine-tuned methods: FT_STEPS steps at L_FT tokens per slot (~13 min here)
# Block memory (InfLLM-style, memory mode 'blocks', docs/block_memory.md) at this scale: memory holds
# at most 896 tokens (7 windows of 128 before the last at 1,024), so the defaults (blocks of 128,
# top 8) would retrieve every block there, which is dense memory. Blocks of 32 slots, the 4 best
# per window and kv head: 128 memory tokens attended (as many as the local window) out of 128 /
# 384 / 896 at 256 / 512 / 1,024 (all of it at 256, a seventh at 1,024); 8 representatives per
# block, the quarter of a block that 16 of 64 are in docs/block_memory.md's measurement.
BLOCKS = {"mode": "blocks", "block_size": 32, "block_reps": 8, "block_topk": 4}


def base_train_config():
  c = stdlib_lm_tiny.get_config()  # its curriculum unchanged: a base that copies through memory
  c.train.checkpoint_every, c.train.log_every = 0, 50
  c.baseline.enabled = False
  c.eval.memory_tokens, c.eval.score_tokens, c.eval.n_docs = [0], 64, 4  # the study evaluates
  return c


def methods(l0=L0, factor=FACTOR, memory_layers=(1,), all_layers=(0, 1, 2), se_window=64, se_group=16,
            sinks=10, blocks=BLOCKS):
  """The study's methods for a base of context l0 extended `factor` times; `block_memory` is
  fot_memory (the same memory layers, the base's window as its local window) reading its memory
  as `blocks` (the study method's `memory` retrieval) instead of all of it."""
  def rope(kind, **kw):
    return {"rope_scaling": dict({"rope_type": kind, "factor": float(kw.pop("f", factor))}, **kw)}
  return [
      {"name": "none", "inference": "plain"},
      {"name": "pi", "inference": "plain", "overrides": rope("linear")},
      {"name": "ntk_frozen", "inference": "plain", "overrides": rope("ntk")},
      {"name": "dynamic_ntk", "inference": "plain",
       "overrides": rope("dynamic", f=factor / 2, original_max_position_embeddings=l0)},
      {"name": "yarn", "inference": "plain", "overrides": rope("yarn", original_max_position_embeddings=l0)},
      {"name": "self_extend", "inference": "plain",
       "overrides": {"position_strategy": {"kind": "self_extend", "window": se_window, "group": se_group}}},
      {"name": "lm_infinite", "inference": "plain",
       "overrides": {"position_strategy": {"kind": "lm_infinite", "global_tokens": sinks, "local_window": l0,
                                           "max_distance": l0}}},
      {"name": "fot_memory", "inference": "memory", "overrides": {"mem_layers": tuple(memory_layers)}},
      {"name": "fot_memory_all", "inference": "memory", "overrides": {"mem_layers": tuple(all_layers)}},
      {"name": "block_memory", "inference": "memory", "overrides": {"mem_layers": tuple(memory_layers)},
       "memory": dict(blocks)},
      # block_memory's budget token by token (4 blocks of 32 = 128 memory tokens): what the blocks cost
      {"name": "topk_memory", "inference": "memory", "overrides": {"mem_layers": tuple(memory_layers)},
       "memory": {"mode": "topk", "topk": blocks["block_size"] * blocks["block_topk"]}},
  ]


def finetuned(frozen, names=("none", "pi", "ntk_frozen", "dynamic_ntk", "yarn", "fot_memory")):
  """The fine-tuned twins of frozen methods: the same spec with `finetune` (ntk_frozen -> ntk_ft)."""
  by_name = {m["name"]: m for m in frozen}
  return [dict(by_name[n], name=n.replace("_frozen", "").replace("_memory", "") + "_ft", finetune=True)
          for n in names]


def finetune_config(base_cfg, length=L_FT, steps=FT_STEPS):
  """What every fine-tuned method shares: the base's corpus and slots, `steps` steps of 8 slots x
  `length` tokens (plain: one window of `length`; FoT: length / L0 windows of L0 with crossbatch d=2,
  as the base's LM phase), AdamW from 1e-3 (10 warm-up steps, cosine to 1e-4)."""
  return ml_collections.ConfigDict({
      "steps": steps, "length": length, "slots": base_cfg.data.slots, "task": base_cfg.data.corpus,
      "split": "train", "min_doc_len": base_cfg.data.min_doc_len, "seed": 0,
      "optim": {"lr": 1e-3, "warmup_steps": 10, "schedule": "cosine", "total_steps": steps,
                "final_lr_fraction": 0.1, "weight_decay": 0.0, "clip_norm": 1.0, "b1": 0.9, "b2": 0.95},
      "crossbatch": {"d": 2}, "checkpoint_every": 50, "log_every": 25})


def get_config(only: str = ""):
  """`--config=experiments/study_tiny.py:NAME,NAME` evaluates only the methods named."""
  c = ml_collections.ConfigDict()
  c.base = ml_collections.ConfigDict({"checkpoint": "", "train": base_train_config()})
  c.lengths = LENGTHS
  frozen = methods()
  c.methods = select_methods(frozen + finetuned(frozen), only, "study_tiny")
  c.finetune = finetune_config(c.base.train)
  c.suites = ("ppl", "passkey", "niah", "rd")
  c.pad = 64  # plain path: inputs padded to a multiple of this (study.plain_width; one compile per width)
  c.ppl = ml_collections.ConfigDict({"score_tokens": 64, "n_docs": 8, "tolerance": 1.1})
  e = eval_settings.default_config()
  e.task, e.batch = "stdlib", 8
  for g in (e.passkey, e.niah):
    g.depths, g.trials = (0.0, 0.5, 1.0), 2
  e.niah.n_needles, e.niah.corpus_docs = 2, 40
  e.rd.ds, e.rd.n_docs = (1, 2, 4, 8), 8
  c.eval = e
  return c
