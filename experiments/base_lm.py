"""Shared defaults of language-model experiment files (the field names all LM runs use).

An experiment file calls `base_config()` and changes what it needs. `c.experiment`
selects the runner in fot_jax.main ('lm': train, then perplexity against memory size).
`c.mesh` is the device mesh (fot_jax.parallel): axis sizes within a slice (one may be
-1: the rest of the devices), `dcn_*` sizes across slices, and the one table of
logical-axis rules.
"""
import ml_collections

from fot_jax import parallel


def base_config():
  c = ml_collections.ConfigDict()
  c.experiment = "lm"
  c.seed = 0
  c.model = ml_collections.ConfigDict({
      "size": "tiny",  # a name from fot_jax.model.config.SIZES
      "overrides": ml_collections.ConfigDict({}),  # ModelConfig fields
  })
  c.data = ml_collections.ConfigDict({
      # The text the experiment reads, named once: a registered SeqIO task or mixture
      # (data_pipelines.tasks), files:PATTERN or jsonl:PATTERN. Every view below that names no task
      # of its own ('' or absent) reads it: the training text, repeat views, retrieval views'
      # natural-text slots and the held-out evaluation (a run prints what each view reads).
      "corpus": "stdlib",
      "task": "",  # the training text ('': the corpus)
      "vocab": "byte",  # 'byte', a SentencePiece model path or a Hugging Face tokenizer.json
      "slots": 8,  # S, over all hosts (each host feeds slots / process_count)
      "windows_per_slot": 2,  # k
      "window": 256,  # T, tokens per row
      "min_doc_len": 1,
      "max_doc_len": 0,  # longer documents are truncated (0: never)
      "split": "train",
      "eval_task": "",  # held-out documents for perplexity ('': the corpus)
      "eval_split": "validation",
      # Repeat views: curriculum task names for an LM task whose slots (a `fraction` of them) repeat
      # their first window in the later ones, a copy of real text through memory
      # (data_pipelines.copy_task.RepeatedWindows), e.g.
      # {"repeat": {"fraction": 1.0, "score_first": False}} (a view's own "task": other text than the corpus).
      "repeats": ml_collections.ConfigDict({}),
      # Retrieval documents: curriculum task names for synthetic fact/question documents in the
      # run's tokenizer (data_pipelines.retrieval_docs.RetrievalSpec fields), e.g.
      # {"near": {"doc_windows": 2, "facts": (1, 2), "text_slots": 0.25}} (text slots read the corpus
      # unless the view names its own "text_task").
      "retrieval": ml_collections.ConfigDict({}),
  })
  c.optim = ml_collections.ConfigDict({
      "lr": 1e-3, "warmup_steps": 20, "schedule": "cosine", "total_steps": 1000,
      "weight_decay": 0.0, "clip_norm": 1.0, "b1": 0.9, "b2": 0.95,
  })
  c.train = ml_collections.ConfigDict({
      "steps": 1000, "loss_on": "all", "accum_steps": 1, "log_every": 10, "checkpoint_every": 100,
      # The same format as c.fot.curriculum in experiments/dictionary_lookup.py.
      "curriculum": ml_collections.ConfigDict({"kind": "constant", "spec": {"d": 2, "w": 1}}),
      "init_from": "",  # a string (not None) so --config.train.init_from=CKPT can set it
      # 'batch': negatives from any slot of the global batch (crossing devices);
      # 'device': only from slots on the same device (no cross-device gather).
      "crossbatch_scope": "batch",
      # Which parameters train (fot_jax.train.resolve_trainable): () = all; or regexes over
      # parameter paths ('layers_8/self_attn/.*') and the groups 'memory_attention' /
      # 'memory_layers'. The others stay frozen (no gradient, no optimizer state).
      "trainable": (),
      # Training beside a long memory written without gradient (docs/semantics.md; fot_jax/train/far_memory.py):
      # every row's memory layers also read the top `topk` entries of the haystack a retrieval view makes
      # (data.retrieval.NAME.memory_tokens), written in windows of `window` every `refresh` steps.
      "memory": ml_collections.ConfigDict({"enabled": False, "window": 512, "topk": 32, "refresh": 5}),
  })
  # The same model trained without crossbatch (a local-window transformer), evaluated alike.
  c.baseline = ml_collections.ConfigDict({"enabled": True})
  c.mesh = ml_collections.ConfigDict({
      "data": -1, "fsdp": 1, "tensor": 1, "context": 1,
      "dcn_data": 1, "dcn_fsdp": 1, "dcn_tensor": 1, "dcn_context": 1,
      "rules": [list(r) for r in parallel.DEFAULT_RULES],
  })
  c.eval = ml_collections.ConfigDict({
      "memory_tokens": (0, 2048, 8192, 32768),  # a tuple: --config.eval.memory_tokens="(0,4096)" sets it
      "score_tokens": 512,  # the scored tail of each held-out document
      "n_docs": 16, "batch": 8, "mode": "dense", "topk": 32, "doc_mode": "single_doc",
  })
  return c


def segments_spec(segments):
  return {"segments": [list(s) for s in segments]}
