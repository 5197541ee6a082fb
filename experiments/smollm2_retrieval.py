"""FoT tuning of SmolLM2-135M for retrieval from memory far past its window (issue 22).

  make smollm2   # once: checkpoints/smollm2-135m (docs/real_models.md)
  nice -n 10 python -m fot_jax.main --config=experiments/smollm2_retrieval.py --workdir=runs/smollm2_retrieval_base

leaves the base recipe's model in runs/smollm2_retrieval_base/fot (fot_jax.from_pretrained, the
evaluate CLI and export_hf read it; `make smollm2-retrieval-base`). The best recipe measured is two
variants in turn, 'mixed' then 'aggregate' (`make smollm2-retrieval` -> runs/smollm2_retrieval/fot).
docs/retrieval.md has the evaluation commands and the measured results.

Memory layers 6, 17, 18, 20 (0-based, of 30): the layers of SmolLM2's best copy heads found by the
retrieval-head probe (`python -m fot_jax.evaluate --suite=heads`, docs/evaluation.md), not
LongLLaMA's layer numbers; 'first' positions (memory keys rotated as at position 0, LongLLaMA's
default). Only those layers' attention trains (`memory_attention`, 2.6% of the parameters): the rest
stays bit-identical, so the model keeps its language and what changes is how four layers read memory.

Data (data_pipelines/retrieval_docs.py): synthetic documents in SmolLM2's tokenizer that state facts
under keys (8 statement templates, 16 question forms, words / names / numbers / hex keys) in filler
(a repeated cycle of sentences, generated prose, or other facts under other keys), with the questions
windows later; only the answer values are scored. Keys are distinct over the whole batch, so the
crossbatch negatives (other slots' windows) never contradict a positive. A quarter of the slots is
stdlib text, scored on every window (the first without memory, the last with 7 earlier windows). Slots of
8 windows of 64 tokens (4,096 tokens a step); the phases lengthen the documents and add negatives:
  1. near  documents of 2 windows (1-2 facts, 1 question), positives only (d=1), until 90% answer
           accuracy over 3 steps (at most NEAR steps);
  2. mid   documents of 4 windows (2-8 facts, 1-3 questions), every earlier window of the slot and
           7 times as many of other slots (the last window: 3 positives + 21 negatives), MID steps;
  3. far   documents of 8 windows (4-16 facts, 1-4 questions), the last window sees 7 positives and
           49 negatives (3,584 tokens of extra context), FAR steps.
Optimizer: AdamW, lr 3e-4 constant after 5 warm-up steps (the rate that formed the circuit in the
measurements behind issue 22), weight decay 0.01, clip 1.0.

Measured (2026-12-02, 2 CPU cores): the near phase reached its threshold at step 15, so 70 steps,
286,720 tokens, 1,298 s of training on idle cores (3,487 s on cores shared with other jobs; the
same held-out perplexities to the last digit). Window 512, dense memory: passkey 8/8 at 4K, 8/8 at
16K, 3/4 at 32K; held-out perplexity 7.69 without memory (the import: 7.76) and 4.87 with 2,048
tokens of memory; RULER-style held-out needles 0.00-0.50 and multi-key 0 (docs/retrieval.md).
Retrained 2026-12-05 (70 steps, 2,004 s on shared cores): through host memory (--eval.mode=host,
faiss IVF, top-32) passkey 2/4 at 64K and 2/4 at 128K (misses drop one digit of five).
On a GPU/TPU only sizes change, e.g. --config.model.overrides.dtype=bfloat16 and more slots.

Variant 'lookalike' (issue 35; `--config=experiments/smollm2_retrieval.py:lookalike`): hard
negatives for the multi-key case. Windows of 128 tokens, 4 per slot (4,096 tokens a step, the
same), documents of 2 (near) then 4 windows; half of a 'facts' haystack's keys share a part of an
asked key (`near_keys`), and on half the far steps every slot's document states its facts in one
template, kind and key kind (`shared_shape`), so the 21 crossbatch negative windows of the last
window are look-alike facts under other keys too. Measured in docs/retrieval.md (lm-evaluation-
harness's RULER): not better than the base recipe on niah_multikey_2 yet, hence not the default.

Variant 'multikey' (`--config=experiments/smollm2_retrieval.py:multikey`): multi-key documents only
(facts under other keys, half near an asked key, 4-8 asked in the far phase), whole-answer accuracy
as the near phase's metric, and every layer's attention trains (19.7% of the parameters), lr 2e-4;
120 steps. Measured (2026-12-05, docs/retrieval.md): lm-evaluation-harness's niah_multikey_2 through
memory, window 512: 0.7 at 4K and 0.6 at 16K (10 prompts each; the base recipe 0.25 / 0.0).

Variant 'mixed' (`--config=experiments/smollm2_retrieval.py:mixed`): multikey's settings, with the
asked facts hidden in three kinds of haystack: look-alike facts (a quarter of the documents),
consecutive sentences of real prose (half: the package READMEs `make install` leaves in the
virtualenv, PROSE; no evaluation haystack is among them) and repeated filler (a quarter). 120 steps,
491,520 tokens, 3,561 s on 2 cores. Measured in docs/retrieval.md ("The mixed recipe").

Variant 'aggregate' (`--config=experiments/smollm2_retrieval.py:aggregate`): a second stage that
starts from the mixed recipe's model (MIXED_CHECKPOINT; another with --config.train.init_from) and
adds documents whose answer is gathered from several windows: 'chain' (a value passed from key to
key, asked for every key that holds it) and 'tally' (a list, asked for its most frequent entries),
beside the mixed recipe's lookups (a third of the near documents, half of the far ones), for the
multi-hop and counting tasks the lookups never ask for (RULER's ruler_vt and ruler_cwe); a quarter
of the lookups are framed in SmolLM2's chat template (AGG_CHAT: lm-eval's --apply_chat_template).
40 steps, 1,499 s on 2 cores. Measured (2026-12-06, docs/retrieval.md "The aggregate stage"): at 4K
every offline RULER task at or above the import reading the whole prompt in its own window
(niah_multikey_2 0.7, with the chat template 0.7; ruler_vt 0.06, ruler_cwe 0.27, ruler_fwe 0.77).

Variants 'mentions' and 'plain' (second stages like 'aggregate': the mixed model first, i.e. the
first command of `make smollm2-retrieval`, then e.g.
`python -m fot_jax.main --config=experiments/smollm2_retrieval.py:mentions --workdir=runs/smollm2_mentions`):
'aggregate' with mentions of half the
asked keys in the haystack (the key and its kind, then words, no value: MENTIONS), and 'plain' also
with half the lookups' questions ending in "is" (PLAIN), for the passkey's miss past 32K (the model
writes the word that followed similar words in memory, " there", where the key's " " belongs).
Measured (2026-12-07, docs/retrieval.md "What the misses are"): 1,652 s / 1,449 s on 2 cores;
passkey at 64K through host memory 2/4 and 1/4 on the suite's prompts (aggregate: 2/4), so not
adopted.

Variant 'longmem' (`--config=experiments/smollm2_retrieval.py:longmem --workdir=runs/smollm2_longmem`,
a second stage from the mixed model like 'aggregate'): aggregate, with every row's memory layers
also reading a long memory (train.memory, fot_jax/train/far_memory.py): a haystack of 16,384 tokens
with no fact (the filler cycle or README prose) written by the model being trained, without
gradient, in the evaluation's windows of 512 with top-32 reads, every 5 steps; the step reads its
top-32 per query beside the window and the crossbatch contexts. For the passkey's miss past 32K (a
training step's memory was 3K tokens, the evaluation's 64K-128K). Measured in docs/retrieval.md
("Training beside a long memory").

Variant 'longmem64' (`--config=experiments/smollm2_retrieval.py:longmem64 --workdir=runs/smollm2_longmem64`,
a third stage: the mixed, then the longmem stage first): from the longmem model
(LONGMEM_CHECKPOINT), 16 steps of the far phase beside a memory of 65,536 tokens, as long as the
64K evaluation's, rewritten every 8 steps, documents of data seed 1. Measured in docs/retrieval.md
("A training memory as long as the evaluation's").

Variant 'longmem64_direct' (`--config=experiments/smollm2_retrieval.py:longmem64_direct
--workdir=runs/smollm2_longmem64_direct`, a second stage from the mixed model like 'aggregate'):
the same 64K-token memory without the 16K stage between, so that mixed and this stage fit the
issue's 2 hours of training: aggregate's documents, near (at most 6 steps) then far (14 steps), the
memory written once a phase. Measured (2026-12-07): 2,609 s (the chain 1.37 h), passkey at 64K
1/4 through host memory (longmem64: 3/4), so not adopted; docs/retrieval.md ("A training memory as
long as the evaluation's").
"""
from experiments.base_lm import base_config, segments_spec
from experiments.smollm2_fot import CHECKPOINT, TINY
import ml_collections

MEM_LAYERS = (6, 17, 18, 20)  # `--mem_layers=auto:4` on the import (docs/evaluation.md, "Retrieval-head probe")
SLOTS = 8
NEAR, MID, FAR = 25, 20, 35
# Text slots scored on every window: scored on the last one only (read with 7 windows of memory), the
# tuned model lost 15% perplexity in a document's first window (no memory); scored on all, 1% better.
TEXT = {"text_slots": 0.25}  # natural text from the corpus


def _shape(windows: int, window: int):
  """(windows per slot, window, positives-only spec, every-negative spec)."""
  return (windows, window, segments_spec([(j, 0) for j in range(windows)]),
          segments_spec([(j, j * (SLOTS - 1)) for j in range(windows)]))


# second stages from the mixed recipe's model: aggregate, and aggregate with mentions / plain questions
SECOND_STAGES = ("aggregate", "mentions", "plain", "longmem", "mentions_longmem", "longmem64", "longmem64_direct")
VARIANTS = ("base", "lookalike", "multikey", "mixed") + SECOND_STAGES
# aggregate: a second stage that starts from the mixed recipe's tuned model
MIXED_CHECKPOINT = "runs/smollm2_mixed/fot"
AGG_NEAR, AGG_FAR = 15, 25
AGG_CHAT = 0.25  # share of the aggregate stage's lookups framed as a chat (lm-eval's --apply_chat_template)
# mentions: per asked fact, the chance of mentions of its key in the haystack (the question's words
# followed by words, no value: data_pipelines/retrieval_docs.py MENTIONS)
MENTIONS = 0.5
# plain: mentions, and this share of the lookups' questions asked as a sentence ending in "is"
PLAIN = 0.5
# longmem: aggregate, every row also reading a long haystack's memory (train.memory: written without
# gradient by the model being trained, in windows of the evaluation's 512 tokens, top-32 reads, every
# LONGMEM_REFRESH steps): repeated filler or real prose, no fact (fot_jax/train/far_memory.py)
LONGMEM_TOKENS, LONGMEM_REFRESH = 16384, 5
LONGMEM_STAGES = ("longmem", "mentions_longmem", "longmem64", "longmem64_direct")  # the stages beside that memory
# longmem64: a third stage from the longmem model, its far phase only, beside a memory as long as the
# 64K evaluation's (4x the reads, ~4x each write: written every LONGMEM64_REFRESH steps), data seed 1
# (documents the longmem stage did not see)
LONGMEM_CHECKPOINT = "runs/smollm2_longmem/fot"
LONGMEM64_TOKENS, LONGMEM64_REFRESH, LONGMEM64_STEPS = 65536, 8, 16
# longmem64_direct: the 64K-token memory in a second stage straight from the mixed model (no 16K
# stage between), so the chain fits the 2 hours of training: aggregate's near and far
# phases, shortened, the memory written once a phase (a new phase writes one; DIRECT64_REFRESH is longer)
DIRECT64_NEAR, DIRECT64_FAR, DIRECT64_REFRESH = 6, 14, 20
# Real prose for the 'text' haystacks: the long descriptions (READMEs) of the packages `make install`
# put in .venv (~1.7 MB of English, markdown), not the evaluation's held-out prose (vim's manuals).
PROSE = "files:.venv/lib/python3.11/site-packages/*.dist-info/METADATA"
# multikey: every attention layer trains (the in-window key match feeds the memory layers' queries)
ALL_ATTENTION = r"layers_\d+/self_attn/.*"
MK_NEAR, MK_FAR = 30, 90


def get_config(variant: str = "base"):
  """variant 'base' (issue 22's recipe: windows of 64, documents up to 8 of them), 'lookalike'
  (`--config=experiments/smollm2_retrieval.py:lookalike`: windows of 128, documents of 4 of them,
  hard negatives: look-alike facts in the document and, on half the far steps, in every other
  slot; not better on multi-key), 'multikey' (multi-key documents only, whole-answer metric, every
  attention layer trains: the one that reads multi-key needles from memory; docs/retrieval.md),
  'mixed' (multikey's documents in three kinds of haystack, real prose among them), 'aggregate'
  (a second stage from the mixed recipe's model, with chain and tally documents), 'mentions'
  (aggregate with mentions of asked keys that give no value), 'plain' (mentions, and questions
  ending in "is"), 'longmem' (aggregate beside a 16K-token memory written without gradient),
  'mentions_longmem' (both levers that moved the 64K passkey's first-token margin, together),
  'longmem64' (from the longmem model: 16 far steps beside a 64K-token memory) or 'longmem64_direct'
  (that memory straight from the mixed model: 20 steps)."""
  if variant not in VARIANTS:
    raise ValueError(f"smollm2_retrieval: variant must be one of {VARIANTS}, got {variant!r}")
  c = base_config()
  c.model.size = "smollm2_135m"
  c.model.overrides = ml_collections.ConfigDict({
      "mem_layers": MEM_LAYERS, "mem_positions": "first", "dtype": "float32", "remat": False,
      "attention_impl": "dense"})
  c.train.init_from = CHECKPOINT
  c.train.trainable = ("memory_attention",)
  c.data.corpus = "stdlib"
  c.data.vocab = f"{CHECKPOINT}/tokenizer.json"
  windows, window, positives, negatives = _shape(8, 64) if variant == "base" else _shape(4, 128)
  c.data.slots, c.data.windows_per_slot, c.data.window = SLOTS, windows, window
  c.data.min_doc_len = windows * window  # a text slot's pack is mostly one file
  text = dict(TEXT, text_scored_windows=windows)
  if variant == "base":
    c.data.retrieval = ml_collections.ConfigDict({
        "near": dict(doc_windows=2, facts=(1, 2), queries=(1, 1), **text),
        "mid": dict(doc_windows=4, facts=(2, 8), queries=(1, 3), **text),
        "far": dict(doc_windows=windows, facts=(4, 16), queries=(1, 4), **text)})
  elif variant == "multikey":
    # Multi-key only: every retrieval document is facts in one template under other keys (half of
    # them near an asked key), 4-8 of them asked, so a step holds ~30 answers whose only cue is the
    # whole key; on half the far steps every slot shares the shape (look-alike crossbatch negatives).
    mk = dict(near_keys=0.5, haystacks=("facts",), **text)
    c.data.retrieval = ml_collections.ConfigDict({
        "near": dict(doc_windows=2, facts=(3, 6), queries=(2, 4), **mk),
        "far": dict(doc_windows=windows, facts=(6, 12), queries=(4, 8), shared_shape=0.5, **mk)})
  elif variant == "mixed" or variant in SECOND_STAGES:
    # multikey's look-alike facts, plus facts in real prose (consecutive sentences of package
    # READMEs) and in repeated filler: the same keys and questions, three kinds of haystack
    mixed = dict(near_keys=0.5, haystacks=("facts", "text", "text", "repeat"), haystack_task=PROSE, **text)
    near_kinds = far_kinds = ("lookup",)
    if variant in SECOND_STAGES:  # answers gathered from several windows: chains and tallies, lookups kept,
      # a quarter of them asked and answered in SmolLM2's chat template
      near_kinds, far_kinds = ("lookup", "chain", "tally"), ("lookup", "lookup", "chain", "tally")
      mixed["chat"] = AGG_CHAT
    if variant in ("mentions", "plain", "mentions_longmem"):
      mixed["mentions"] = MENTIONS
    if variant == "plain":
      mixed["plain_questions"] = PLAIN
    if variant in LONGMEM_STAGES:
      mixed.update(memory_tokens=LONGMEM64_TOKENS if variant.startswith("longmem64") else LONGMEM_TOKENS,
                   memory_haystacks=("repeat", "text"))
    c.data.retrieval = ml_collections.ConfigDict({
        "near": dict(doc_windows=2, facts=(3, 6), queries=(2, 4), doc_kinds=near_kinds, **mixed),
        "far": dict(doc_windows=windows, facts=(6, 12), queries=(4, 8), shared_shape=0.5, doc_kinds=far_kinds,
                    **mixed)})
  else:
    # Look-alikes: the local window (128 tokens, ~6 facts) and memory hold facts in the asked
    # fact's own template under other keys, half of them sharing a part of an asked key; on half
    # the far steps every slot's document has the same template, so the 21 crossbatch negative
    # windows are look-alike facts too (never the same key: keys are distinct over the batch).
    hard = dict(near_keys=0.5, **text)
    c.data.retrieval = ml_collections.ConfigDict({
        "near": dict(doc_windows=2, facts=(1, 2), queries=(1, 1), **hard),
        "mid": dict(doc_windows=4, facts=(2, 8), queries=(1, 3), **hard),
        "far": dict(doc_windows=windows, facts=(4, 16), queries=(1, 4), shared_shape=0.5,
                    haystacks=("repeat", "prose", "facts", "facts"), **hard)})
  second = (DIRECT64_NEAR, DIRECT64_FAR) if variant == "longmem64_direct" else (AGG_NEAR, AGG_FAR)
  steps = sum(second) if variant in SECOND_STAGES else {
      "multikey": MK_NEAR + MK_FAR, "mixed": MK_NEAR + MK_FAR}.get(variant, NEAR + MID + FAR)
  c.optim.lr, c.optim.warmup_steps, c.optim.schedule, c.optim.total_steps = 3e-4, 5, "constant", steps
  c.optim.weight_decay, c.optim.clip_norm = 0.01, 1.0
  c.train.steps, c.train.loss_on = steps, "all"
  c.train.checkpoint_every, c.train.log_every = 10, 1
  c.train.curriculum = ml_collections.ConfigDict({"kind": "phases", "stop_after_last": True, "phases": [
      {"name": "near", "task": "near", "spec": positives, "metric": "accuracy",
       "threshold": 0.9, "window": 3, "max_steps": NEAR},
      {"name": "mid", "task": "mid", "spec": negatives, "steps": MID},
      {"name": "far", "task": "far", "spec": negatives, "steps": FAR}]})
  if variant in ("multikey", "mixed") + SECOND_STAGES:
    c.train.trainable = (ALL_ATTENTION,)
    c.optim.lr = 2e-4
    near, far = second if variant in SECOND_STAGES else (MK_NEAR, MK_FAR)
    c.train.curriculum.phases = [
        {"name": "near", "task": "near", "spec": positives, "metric": "answer_accuracy",
         "threshold": 0.8, "window": 3, "max_steps": near},
        {"name": "far", "task": "far", "spec": negatives, "steps": far}]
  if variant in SECOND_STAGES:
    c.train.init_from = LONGMEM_CHECKPOINT if variant == "longmem64" else MIXED_CHECKPOINT
  if variant in LONGMEM_STAGES:
    c.train.memory.update(enabled=True, window=512, topk=32, refresh={
        "longmem64": LONGMEM64_REFRESH, "longmem64_direct": DIRECT64_REFRESH}.get(variant, LONGMEM_REFRESH))
  if variant == "longmem64":
    c.seed = 1
    c.train.steps = c.optim.total_steps = LONGMEM64_STEPS
    c.optim.warmup_steps = 2
    c.train.curriculum.phases = [{"name": "far", "task": "far", "spec": negatives, "steps": LONGMEM64_STEPS}]
  c.baseline.enabled = False
  # The run's own check (window = the training window): perplexity with 0 and 448 tokens of memory on
  # 4 held-out files. The measurements (window 512) come from the evaluate CLI (docs/retrieval.md).
  c.eval.memory_tokens = (0, 448)
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 64, 4, 4
  return c


def get_test_config(checkpoint: str):
  """A few-second variant on a tiny random LLaMA (experiments/smollm2_fot.py TINY): one step per
  phase, 4 slots of 4 windows of 128."""
  c = get_config()
  c.model.overrides.update(TINY)
  c.train.init_from, c.data.vocab = checkpoint, f"{checkpoint}/tokenizer.json"
  # the test tokenizer is about a byte a token: windows of 128 hold a fact and its question
  c.data.slots, c.data.windows_per_slot, c.data.window, c.data.min_doc_len = 4, 4, 128, 64
  for name in ("near", "mid", "far"):
    c.data.retrieval[name].doc_windows = 2 if name == "near" else 4
    c.data.retrieval[name].text_slots = 0.25
  c.data.retrieval.far.facts, c.data.retrieval.far.queries = (2, 4), (1, 2)
  c.data.retrieval.mid.facts = (2, 4)
  c.train.steps, c.optim.total_steps, c.optim.warmup_steps = 3, 3, 0
  c.train.checkpoint_every = 0
  phases = c.train.curriculum.phases
  for p, spec in zip(phases, ([(j, 0) for j in range(4)], [(j, 3 * j) for j in range(4)],
                              [(j, 3 * j) for j in range(4)])):
    p.update(steps=1, metric=None, threshold=None, max_steps=None, spec=segments_spec(spec))
  c.train.curriculum.phases = phases
  c.eval.memory_tokens = (0, 64)
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 16, 2, 2
  return c
