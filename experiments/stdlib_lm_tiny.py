"""A tiny FoT language model on the Python standard library's sources, on CPU.

Byte vocabulary, a 3-layer model (hidden 64) with one memory layer, 128-token windows,
8 slots x 2 windows (2K tokens a step). The curriculum (phases over data tasks):
  1. copy        the induction warm-up on byte ids (c.warmup): 32 distinct random bytes, then the
                 same again, split into two 32-token windows, d=1, so the repeat finds its source
                 only through the memory layer; until 95% copy accuracy (at most 2,500 steps);
  2. text_copy   the copy on real text (`repeat`, c.data.repeats): each slot's second
                 128-byte window repeats its first, only the repeat scored, d=1; until 95%
                 (at most 600 steps);
  3. text_copy_d8  the same with d=8 (7 other slots' windows as negatives), 300 steps;
  4. lm_d8       the stdlib corpus at d=8 with a quarter of the slots still repeated
                 (`mixed`), so the circuit that reads memory survives on text;
  5. lm_passkey  the same with short passkey documents beside the stdlib files (`stdlib_pk`: the
                 `stdlib_passkey` mixture, about a quarter of the slot-steps a 192-256-byte passkey
                 document: the key in filler, the question in the next window or the same one),
                 2,000 steps: a byte model of Python sources has no English to retrieve a passkey
                 with (docs/data.md).
The baseline is the same model trained on the same phases without crossbatch (its copy
documents whole in one row, the repeat in 4 shuffled pieces; its repeated text windows are
rows it cannot see the source of). Both are evaluated on held-out stdlib files (single-document
mode): perplexity of each file's last 512 bytes with 0, 2K, 8K and 32K earlier bytes in memory.
The evaluation suite (`python -m fot_jax.evaluate --checkpoint RUN/fot --suite=ppl,rd,passkey,niah`)
adds r_d, passkey and NIAH (docs/data.md lists the commands and the measured results).
"""
import ml_collections

from experiments.base_lm import base_config

COPY_MAX, TEXT_MAX, TEXT_D8, LM_D8, LM_PASSKEY = 2500, 600, 300, 600, 2000
STEPS = COPY_MAX + TEXT_MAX + TEXT_D8 + LM_D8 + LM_PASSKEY


def get_config():
  c = base_config()
  c.model.size = "tiny"
  c.model.overrides = ml_collections.ConfigDict({
      "vocab_size": 260, "hidden_size": 64, "intermediate_size": 192, "num_layers": 3, "num_heads": 4,
      "num_kv_heads": 4, "mem_layers": (1,), "mem_positions": "first",
      # The dictionary recipe's init (issue 10): with the default 0.02 the copy warm-up stayed
      # at chance for 600 steps here; large random embeddings make the induction circuit form.
      "init_std": 0.1, "embed_init_std": 1.0})
  c.data.corpus, c.data.vocab = "stdlib", "byte"
  c.data.slots, c.data.windows_per_slot, c.data.window = 8, 2, 128
  c.data.min_doc_len = 64
  # The copy warm-up (fot_jax.runners.lm_data.feed_batches). Measured (docs/data.md): over the 37
  # characters of the text form (`copy_text`) with 64-256-byte spans most characters repeat
  # within a span, so "find this byte earlier, predict what followed" is ambiguous and the
  # copy never formed (2,000 steps); with distinct bytes in 32-token windows it does.
  c.warmup = ml_collections.ConfigDict({
      "enabled": True, "task": "copy", "span": 32, "num_symbols": 256, "symbol_offset": 3,  # byte ids
      "distinct": True, "slots": 32, "baseline_chunks": 4})
  # The copy on real text (docs/data.md): every slot, only the repeat scored; then a quarter of
  # the slots, next to plain text, in the LM phase.
  c.data.repeats = ml_collections.ConfigDict({
      "repeat": {"fraction": 1.0, "score_first": False},
      "mixed": {"fraction": 0.25, "score_first": True},
      "stdlib_pk": {"task": "stdlib_passkey", "fraction": 0.25, "score_first": True}})
  c.optim.lr, c.optim.warmup_steps, c.optim.total_steps = 3e-3, 20, STEPS
  c.train.steps, c.train.checkpoint_every, c.train.log_every = STEPS, 200, 20
  c.train.curriculum = ml_collections.ConfigDict({"kind": "phases", "stop_after_last": True, "phases": [
      {"name": "copy", "task": "copy", "spec": {"d": 1, "w": 1}, "metric": "accuracy", "threshold": 0.95,
       "window": 5, "max_steps": COPY_MAX},
      {"name": "text_copy", "task": "repeat", "spec": {"d": 1, "w": 1}, "metric": "accuracy",
       "threshold": 0.95, "window": 5, "max_steps": TEXT_MAX},
      {"name": "text_copy_d8", "task": "repeat", "spec": {"d": 8, "w": 1}, "steps": TEXT_D8},
      {"name": "lm_d8", "task": "mixed", "spec": {"d": 8, "w": 1}, "steps": LM_D8},
      {"name": "lm_passkey", "task": "stdlib_pk", "spec": {"d": 8, "w": 1}, "steps": LM_PASSKEY}]})
  c.eval.memory_tokens = [0, 2048, 8192, 32768]
  # 7: the held-out stdlib files (Python 3.11) long enough for 32K bytes of memory + 512 scored; a
  # run checks the count before its first step
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 512, 7, 8
  return c


def get_test_config():
  """A few-second variant for tests: 2-layer model, one step per phase (copy on ids, the repeat
  view twice, the mixed LM view, the passkey mixture), small memories."""
  c = get_config()
  c.model.overrides.update({"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "mem_layers": (1,)})
  c.data.slots, c.data.window = 4, 32
  c.warmup.span, c.warmup.slots = 32, 4  # FoT: copy rows of the LM rows' shape (one compile)
  c.train.steps, c.train.checkpoint_every, c.train.log_every = 5, 0, 1
  c.optim.total_steps = 5
  phases = c.train.curriculum.phases
  for p in phases:
    p.update(steps=1, metric=None, threshold=None, max_steps=None)
  for p in phases:  # one plan shape: one compile of the train step
    p["spec"] = {"d": 2, "w": 1}
  c.train.curriculum.phases = phases
  c.eval.memory_tokens = [0, 64, 128]
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 32, 2, 2
  return c
