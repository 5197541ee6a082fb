"""FoT fine-tuning of SmolLM2-135M: the LongLLaMA recipe in miniature (issue 11, item 4).

Starts from the imported SmolLM2-135M (`make smollm2` -> checkpoints/smollm2-135m; docs/real_models.md)
with memory layers 8, 16, 24 (0-based, of 30; LongLLaMA-7B's layers) and 'first' positions (memory
keys rotated as at position 0, LongLLaMA's default), and trains only those layers' attention
(`train.trainable = ("memory_attention",)`: 2,654,208 of 134,515,008 parameters, 1.97%; the rest
stays bit-identical, so what changes is how the memory layers read memory).

  nice -n 10 python -m fot_jax.main --config=experiments/smollm2_fot.py --workdir=runs/smollm2_fot

Crossbatch as LongLLaMA-3B (experiments/longllama_3b.py): each slot holds 4 consecutive windows, plan
segments [(0,0),(1,1),(2,1),(3,0)] (positives, negatives per position), every window scored; here
windows of 128 tokens (LongLLaMA: 2,048) and 4 slots: 16 rows, 2,048 tokens a step (LongLLaMA: 256K).
Optimizer: LongLLaMA's AdamW (weight decay 0.01, clip 1.0, constant rate after a 10-step warm-up), the
rate scaled by width as muP does for hidden matrices, 2e-5 x 3200 / 576 ~ 1e-4.

Data: the Python standard library's sources (task 'stdlib') through SmolLM2's byte-level BPE
(the checkpoint's tokenizer.json), files of at least 512 tokens. The curriculum, over repeat views of
that text (`c.data.repeats`, data_pipelines/copy_task.RepeatedWindows; on the tiny model this raised
r_d and let memory lower perplexity: docs/data.md):
  1. copy_d1   in every slot the later windows repeat the first (only the repeats scored) and no
               negatives: text the memory layers can copy only from memory; until 90% accuracy over
               5 steps, at most COPY_D1 steps (the imported model starts at ~50%);
  2. copy      the same with LongLLaMA's plan (positives and negatives), COPY steps;
  3. lm        plain stdlib text with a quarter of the slots still repeated (every window scored),
               LongLLaMA's plan, LM steps.
No baseline run (LongLLaMA has none either): compare with the imported model through
`python -m fot_jax.evaluate` (docs/real_models.md has the before/after and export commands).

Sizes from measured speed (`python -m benchmarks.trainable_speed`, random weights of this shape, the
LongLLaMA plan; 2 CPU cores shared with three other training/evaluation jobs, 2026-12-01): 80 tokens/s
training the memory attention only against 45 training every parameter (1.79x; XLA's step memory
4.10 against 7.23 GiB). At 25.5 s a step, the at most 140 steps (287K tokens) take ~60 minutes, plus
~1 minute of compilation (two plan shapes), checkpoints every 20 steps and the final perplexity
evaluation (8 held-out files, 0 / 512 / 2,048 tokens of memory). On a GPU/TPU only sizes change, e.g.
--config.data.window=2048 --config.data.slots=32 (LongLLaMA-3B's batch) --config.train.steps=...
--config.model.overrides.dtype=bfloat16, and the phases' step counts.
"""
import ml_collections

from experiments.base_lm import base_config, segments_spec

CHECKPOINT = "checkpoints/smollm2-135m"
SEGMENTS = [(0, 0), (1, 1), (2, 1), (3, 0)]  # LongLLaMA-3B
NO_NEGATIVES = [(j, 0) for j, _ in SEGMENTS]  # the same positives, d = 1
COPY_D1, COPY, LM = 40, 30, 70
STEPS = COPY_D1 + COPY + LM


# Variants (--config=experiments/smollm2_fot.py:NAME): 'quick' is the same recipe sized for a 2-core
# CPU on a corpus of one's own (`make smollm2-tune CORPUS=jsonl:FILE`, README): 15 + 10 + 15 steps
# (11-15 minutes at 17-22 s a step, measured) and an evaluation that fits a small held-out split (2 documents of
# at least 1,153 tokens: 1,024 of memory, 128 scored).
QUICK = {"copy_d1": 15, "copy": 10, "lm": 15}
VARIANTS = ("", "quick")


def get_config(variant: str = ""):
  if variant not in VARIANTS:
    raise ValueError(f"experiments/smollm2_fot.py: variant {variant!r} unknown; variants: 'quick' (or none)")
  c = base_config()
  c.model.size = "smollm2_135m"  # the import's architecture (fot_jax/model/config.py)
  # Fields a run may change from the command line (e.g. --config.model.overrides.dtype=bfloat16 on an
  # accelerator, --config.model.overrides.mem_layers='(7,15,23)'); the rest must stay the checkpoint's.
  c.model.overrides = ml_collections.ConfigDict({
      "mem_layers": (8, 16, 24), "mem_positions": "first", "dtype": "float32", "remat": False,
      "attention_impl": "dense"})
  c.train.init_from = CHECKPOINT
  c.train.trainable = ("memory_attention",)
  c.data.corpus = "stdlib"  # every view reads it: --config.data.corpus=jsonl:YOUR.jsonl tunes on your text
  c.data.vocab = f"{CHECKPOINT}/tokenizer.json"
  c.data.slots, c.data.windows_per_slot, c.data.window = 4, len(SEGMENTS), 128
  c.data.min_doc_len = 512  # a pack of 4 windows is mostly one file: memory has something to find
  c.data.repeats = ml_collections.ConfigDict({
      "repeat": {"fraction": 1.0, "score_first": False},
      "mixed": {"fraction": 0.25, "score_first": True}})
  c.optim.lr, c.optim.warmup_steps, c.optim.schedule, c.optim.total_steps = 1e-4, 10, "constant", STEPS
  c.optim.weight_decay, c.optim.clip_norm = 0.01, 1.0
  c.train.steps, c.train.loss_on = STEPS, "all"
  c.train.checkpoint_every, c.train.log_every = 20, 1
  c.train.curriculum = ml_collections.ConfigDict({"kind": "phases", "stop_after_last": True, "phases": [
      {"name": "copy_d1", "task": "repeat", "spec": segments_spec(NO_NEGATIVES), "metric": "accuracy",
       "threshold": 0.9, "window": 5, "max_steps": COPY_D1},
      {"name": "copy", "task": "repeat", "spec": segments_spec(SEGMENTS), "steps": COPY},
      {"name": "lm", "task": "mixed", "spec": segments_spec(SEGMENTS), "steps": LM}]})
  c.baseline.enabled = False
  c.eval.memory_tokens = (0, 512, 2048)
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 256, 8, 4
  if variant == "quick":
    for phase in c.train.curriculum.phases:
      phase["max_steps" if phase["name"] == "copy_d1" else "steps"] = QUICK[phase["name"]]
    c.train.steps = c.optim.total_steps = sum(QUICK.values())
    c.train.checkpoint_every = 10
    c.eval.memory_tokens, c.eval.score_tokens, c.eval.n_docs, c.eval.batch = (0, 256, 1024), 128, 2, 2
  return c


# A tiny LLaMA of the same kind (GQA, tied embeddings, byte-level BPE) for tests.
TINY = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_embeddings": True,
        "mem_layers": (1,)}


def get_test_config(checkpoint: str):
  """A few-second variant on a tiny random LLaMA: `checkpoint` is an fot_jax checkpoint of the
  TINY architecture (no memory layers, as an import) that ships a tokenizer.json of at most 320
  tokens (tests/test_smollm2_fot.py makes one). One step per phase, one plan shape, small memories."""
  c = get_config()
  c.model.overrides.update(TINY)
  c.train.init_from, c.data.vocab = checkpoint, f"{checkpoint}/tokenizer.json"
  c.data.window, c.data.min_doc_len = 16, 64
  c.train.steps, c.optim.total_steps, c.optim.warmup_steps = 3, 3, 0
  c.train.checkpoint_every = 0
  phases = c.train.curriculum.phases
  for p in phases:
    p.update(steps=1, metric=None, threshold=None, max_steps=None, spec=segments_spec(SEGMENTS))
  c.train.curriculum.phases = phases
  c.optim.lr = 1e-2  # large enough that one step visibly moves the trained parameters
  c.eval.memory_tokens = (0, 32)
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 16, 2, 2
  return c
