"""The evaluation suite behind `python -m fot_jax.evaluate`: each suite writes
W/eval/<suite>.json and its PNG plot(s); `report.write_report` gathers them in W/eval/report.md.

Suites: ppl (perplexity against memory, single_doc and multi_doc), rd (positive attention
mass against documents in memory), passkey, niah (single and multi-needle), dict
(dictionary lookup: dense, exact top-k and approximate top-k; host faiss memory past the
device limit), ruler (RULER-style synthetic tasks scored on greedy generation). Every suite
is seeded by `seed` and prints its progress. heads (retrieval-head probe: per-head copy scores,
the layers picked for memory) needs no memory.

passkey, niah and ruler resume prompt by prompt: each scored batch goes to
W/eval/<grid>.prompts.jsonl (passkey, niah, niah_multi, ruler) at once, and the same command
after a kill scores only the prompts not recorded there for the same model and settings
(retrieval.PromptRecords, Context.model_key); their JSON lists every prompt's expected and
generated answer.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Dict, List

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from data_pipelines import pipeline, tasks, vocab as vocab_lib
from data_pipelines.dictionary_lookup import DictionaryTask
from fot_jax import jsonio
from fot_jax.convert.api import from_pretrained
from fot_jax.eval import dictionary, heads, niah, passkey, perplexity, report, retrieval, ruler
from fot_jax.eval.config import SUITES
from fot_jax.eval.effective_length import effective_length
from fot_jax.eval.rd import positive_attention_mass
from fot_jax.inference import MemoryInference


class Context:
  """A loaded model and what every suite needs from it."""

  def __init__(self, checkpoint: str, config: ml_collections.ConfigDict, **overrides):
    self.path, self.config = checkpoint, config
    self.model = from_pretrained(checkpoint, **overrides)  # e.g. mem_layers
    self.cfg, self.params = self.model.cfg, self.model.params
    self.window = int(config.window or self.model.window or 0)
    if not self.window:
      raise ValueError(f"{checkpoint}: the checkpoint records no window; pass --eval.window")
    ck = self.model.checkpoint
    spec = vocab_lib.checkpoint_vocab_spec(checkpoint, ck.meta, ck.tokenizer_path, config.vocab)
    # the dictionary task's ids as they are, for the task the dict settings describe
    self.vocab = (vocab_lib.TokenVocab(dict_task(config).vocab_size) if spec == "dictionary_lookup"
                  else vocab_lib.get_vocabulary(spec))
    self.vocab_spec = spec
    vocab_lib.check_fits(self.vocab.vocab_size, self.cfg.vocab_size, f"vocabulary {spec}", checkpoint)

  def model_key(self) -> str:
    """What a scored prompt depends on besides its tokens: the model config, the parameters (a
    checksum: each array's sum and sum of squares in float32, reduced on the device, so a 3B
    model costs no host copy), the window, vocabulary and inference settings. Prompt records of
    another checkpoint step or setting are never reused."""
    if getattr(self, "_model_key", None) is None:
      def sums(x):
        x = x.astype(jnp.float32)
        return jnp.stack([jnp.sum(x), jnp.sum(x * x)])
      checksum = jax.tree_util.tree_map(lambda a: np.asarray(a).tolist(), jax.jit(
          lambda p: jax.tree_util.tree_map(sums, p))(self.params))
      c = self.config
      text = json.dumps({"model": self.cfg.to_dict(), "params": checksum, "window": self.window,
                         "vocab": str(self.vocab_spec), "mode": c.mode, "topk": c.topk, "chunk": c.chunk},
                        sort_keys=True, default=str)
      self._model_key = hashlib.sha1(text.encode()).hexdigest()
    return self._model_key

  def records(self, grid: str) -> "retrieval.PromptRecords":
    """The prompt records of one grid of prompts (W/eval/<grid>.prompts.jsonl); in memory only for
    a context that `run` did not make (the study's and the baselines' own inference objects are
    more than model_key describes)."""
    if not getattr(self, "out_dir", None):
      return retrieval.PromptRecords()
    return retrieval.PromptRecords(os.path.join(self.out_dir, f"{grid}.prompts.jsonl"), self.model_key())

  def inference(self, mode=None):
    c = self.config
    return MemoryInference(self.cfg, self.params, self.window, mode or c.mode, c.topk, c.chunk)

  def docs(self, need: int, n: int, wrap: bool = True, split: str = "") -> List[np.ndarray]:
    """n held-out documents of at least `need` tokens (`bos doc eos` when wrap), in stored order."""
    c = self.config
    split = split or c.split
    if c.task == "dictionary_lookup":  # the dict suite's task, documents straight from its generator
      task = dict_task(c)
      rng = np.random.default_rng([c.seed, 7])
      return [task.document(rng)["tokens"].astype(np.int32) for _ in range(n)]
    ids = vocab_lib.special_ids(self.vocab)
    out = pipeline.long_documents(c.task, self.vocab, split, need, n,
                                  wrap=(ids["bos"], ids["eos"]) if wrap else None)
    if len(out) == n:
      return out
    raise ValueError(f"eval: task {c.task!r} split {split!r} has only {len(out)} documents of at least "
                     f"{need} tokens, {n} are needed; lower the sizes or the document count")

  def texts(self, n: int) -> List[str]:
    c = self.config
    provider = tasks.get_provider(c.task)
    if tasks.TEXT not in provider.output_features:
      raise ValueError(f"niah: task {c.task!r} holds token ids, not text; use a text task (eval.task=stdlib)")
    ds = provider.get_dataset(sequence_length=None, split=c.split, shuffle=False, use_cached=False)
    return [t.decode("utf-8", "replace") for t in
            ds.map(lambda ex: ex[tasks.TEXT]).take(n).as_numpy_iterator()]


def dict_task(c):
  task = DictionaryTask(**c.dict.task.to_dict())
  task.validate()
  return task


def run_ppl(ctx: Context) -> Dict:
  p = ctx.config.ppl
  mems = [int(m) for m in p.memory_tokens]
  distract = int(p.distractor_tokens) if p.distractor_tokens >= 0 else max(mems)
  docs = ctx.docs(perplexity.needed_length(mems, int(p.score_tokens)), int(p.n_docs))
  out = {"n_docs": len(docs), "score_tokens": int(p.score_tokens)}
  for doc_mode in p.doc_modes:
    out[doc_mode] = perplexity.perplexity_vs_memory(ctx.inference(), docs, mems, int(p.score_tokens),
                                                    ctx.config.batch, doc_mode, name=ctx.name,
                                                    distractor_tokens=distract)
  return out


def run_rd(ctx: Context) -> Dict:
  r = ctx.config.rd
  need = (int(r.context_windows) + 1) * ctx.window
  docs = ctx.docs(need, int(r.n_docs), wrap=ctx.config.task != "dictionary_lookup", split=r.split)
  out = positive_attention_mass(ctx.cfg, ctx.params, docs, ctx.window, [int(d) for d in r.ds],
                                int(r.context_windows), ctx.config.batch, name=ctx.name)
  out["split"] = r.split or ctx.config.split
  return out


def _grid(ctx: Context, suite: str, make_prompt) -> Dict:
  g = ctx.config[suite] if suite in ctx.config else ctx.config.niah
  return retrieval.grid(retrieval.InferenceModel(ctx.inference()), ctx.vocab, make_prompt, list(g.lengths),
                        retrieval.depth_list(g.depths), int(g.trials), int(ctx.config.seed), ctx.config.batch,
                        float(g.threshold), ctx.name, suite, ctx.records(suite))


def run_passkey(ctx: Context) -> Dict:
  return _grid(ctx, "passkey", passkey.make_prompt_fn(ctx.vocab))


def run_niah(ctx: Context) -> Dict:
  hay = niah.Haystack(ctx.vocab, ctx.texts(int(ctx.config.niah.corpus_docs)))
  out = {"haystack_tokens": int(len(hay.ids)), "task": ctx.config.task}
  out["single"] = _grid(ctx, "niah", niah.make_prompt_fn(ctx.vocab, hay, 1))
  out["multi"] = _grid(ctx, "niah_multi", niah.make_prompt_fn(ctx.vocab, hay, int(ctx.config.niah.n_needles)))
  out["multi"]["n_needles"] = int(ctx.config.niah.n_needles)
  return out


def run_dict(ctx: Context) -> Dict:
  d = ctx.config.dict
  task = dict_task(ctx.config)
  mems = [int(m) for m in d.memory_tokens]
  evalset = dictionary.DictionaryEvalSet(task, int(d.n_docs), max(mems), int(d.seed))
  out = {"window": ctx.window, "topk": int(d.topk), "nprobe": int(d.nprobe),
         "device_max_tokens": int(d.device_max_tokens), "threshold": float(d.threshold)}
  for mode in d.modes:
    host = mode in ("flat", "ivf")
    sizes = mems if host else [m for m in mems if m <= d.device_max_tokens]
    if len(sizes) < len(mems):
      print(f"[{ctx.name}] dict {mode}: memory past {d.device_max_tokens:,} tokens is left to the host index",
            flush=True)
    res = dictionary.evaluate(ctx.cfg, ctx.params, evalset, ctx.window, sizes, "topk" if host else mode,
                              int(d.topk), ctx.config.batch, ctx.config.chunk, name=ctx.name,
                              retrieval=mode if host else None, nprobe=int(d.nprobe))
    res["effective_length"] = effective_length(res["memory_tokens"], res["accuracy"], float(d.threshold))
    out[mode] = res
  return out


def run_ruler(ctx: Context) -> Dict:
  r = ctx.config.ruler
  return ruler.evaluate(ctx.inference(), ctx.vocab, list(r.tasks), [int(x) for x in r.lengths], int(r.trials),
                        int(ctx.config.seed), float(r.threshold), ctx.config.batch, ctx.name,
                        records=ctx.records("ruler"))


def run_heads(ctx: Context) -> Dict:
  return heads.run_heads(ctx)


RUNNERS = {"ppl": run_ppl, "rd": run_rd, "passkey": run_passkey, "niah": run_niah, "dict": run_dict,
           "ruler": run_ruler, "heads": run_heads}


def run(checkpoint: str, suites: List[str], workdir: str, config: ml_collections.ConfigDict,
        name: str = "", **overrides) -> Dict[str, Dict]:
  """overrides: ModelConfig fields over the checkpoint's (e.g. mem_layers=(8, 16, 24))."""
  unknown = [s for s in suites if s not in RUNNERS]
  if unknown:
    raise ValueError(f"--suite: unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
  ctx = Context(checkpoint, config, **overrides)
  ctx.name = name or os.path.basename(os.path.normpath(checkpoint))
  out_dir = ctx.out_dir = os.path.join(workdir, "eval")  # heads writes its heat map there
  os.makedirs(out_dir, exist_ok=True)
  results = {}
  for i, suite in enumerate(suites):
    print(f"[{ctx.name}] suite {suite} ({i + 1}/{len(suites)})", flush=True)
    t0 = time.time()
    res = RUNNERS[suite](ctx)
    res.update(suite=suite, checkpoint=os.path.abspath(checkpoint), name=ctx.name, seed=int(config.seed),
               window=ctx.window, vocab=ctx.vocab_spec, mem_layers=list(ctx.cfg.mem_layers),
               seconds=time.time() - t0,
               config={k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in config.items()
                       if k not in SUITES or k == suite})
    jsonio.write_json(os.path.join(out_dir, f"{suite}.json"), res)
    report.plot_suite(suite, {ctx.name: res}, out_dir)
    results[suite] = res
    print(f"[{ctx.name}] suite {suite} done in {res['seconds']:.0f}s -> {out_dir}/{suite}.json", flush=True)
  report.write_report(workdir)
  return results
