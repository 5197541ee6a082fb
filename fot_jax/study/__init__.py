"""The controlled context-extension study: one base checkpoint, several methods, one evaluation.

  python -m fot_jax.study --config=experiments/study_tiny.py --workdir=W

A method is a set of ModelConfig overrides applied to the base (`rope_scaling`,
`position_strategy`, `mem_layers`, ...) plus its inference path:
  * `plain`:  a long-context forward, the whole input in one window (no memory);
  * `memory`: FoT memory inference, windows of the base's length (or the method's `window`),
              earlier windows in the memory layers' memory (fot_jax/inference.py), read as the
              suite settings' eval.mode / eval.topk say, or as the method's own `memory` retrieval
              (`MemoryRetrieval`: e.g. {"mode": "blocks", "block_size": 128, "block_reps": 16,
              "block_topk": 8}, InfLLM-style block memory, or {"mode": "topk", "topk": 32}).
A method with `"finetune": True` (or a dict overriding fields of the study's shared `finetune`)
is first trained from the base's parameters with its own model config into W/finetune/<name>
(`fot_jax.train.train`: resumable, the same data, steps, optimiser and tokens per step for every
fine-tuned method; see `FinetuneSettings`), then evaluated with the fine-tuned parameters.
Every method gets the same evaluation (the suites of fot_jax/eval, run on the method's model):
  * ppl:     perplexity of the same last `ppl.score_tokens` tokens of each held-out document,
             with L - score_tokens tokens of context before them, at every study length L (one
             step of the study's sliding-window evaluation);
  * passkey, niah (single and multi-needle): accuracy grids over lengths x depths, with
             their effective length (fot_jax/eval/effective_length.py);
  * rd:      positive attention mass, for methods with memory layers that read all of memory
             (eval/rd.py attends densely: a method with its own top-k or block retrieval skips it).
Results: W/methods/<name>.json per method (a finished method is skipped on a rerun with the same
spec and settings; W/methods/<name>.partial.json holds its suites finished so far, so a stopped run
resumes at the next suite, and adding a suite to `suites` runs only that suite), then
W/study.json, W/study.md (one table) and figures W/study_*.png.
The base is `base.checkpoint`, or trained first into W/base by `fot_jax.runners.lm.run` from
`base.train` (an LM experiment config; skipped when W/base already holds the finished run).
A bad input (a study file that does not load, a method with an unknown key or inference path, an
unknown suite, a missing base) ends in one line `fot_jax.study: ...` naming it, exit status 2
(fot_jax.cli); results are written atomically (fot_jax.jsonio).

The package, a module per job: config (the study file read once into StudySettings, a MethodSpec per
method; light, no JAX or TensorFlow), methods (a method as a suite Context and its inference), finetune, evaluation
(the suites for one method), run (the whole study) and report (table and figures); __main__ is the
command line.
"""
