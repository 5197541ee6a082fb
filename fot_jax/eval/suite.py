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

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from data_pipelines import pipeline, tasks, vocab as vocab_lib
from fot_jax import jsonio
from fot_jax.convert.api import from_pretrained
from fot_jax.eval import dictionary, heads, niah, passkey, perplexity, report, retrieval, ruler
from fot_jax.eval.settings import SUITES, SuiteSettings
from fot_jax.eval.effective_length import effective_length
from fot_jax.eval.rd import positive_attention_mass
from fot_jax.host_memory import HostMemoryInference
from fot_jax.inference import MemoryInference
from fot_jax.model.config import ModelConfig


@dataclasses.dataclass(eq=False)
class Context:
  """A model and what every suite needs from it: its config and parameters, the local window, the
  vocabulary (and how it was named: vocab_spec), the suite settings, the name in tables and plots.
  `from_checkpoint` loads one; a model already in memory (a trained baseline arm, a study method)
  is built directly, with `own_inference` the inference object every suite then uses, whatever
  the settings' mode (a Transformer-XL arm's, a study method's plain path or own retrieval).
  out_dir: W/eval, where prompt records and the heads heat map go ('': records in memory only: an
  own inference is more than model_key describes)."""
  path: str
  settings: SuiteSettings
  cfg: ModelConfig
  params: Any
  window: int
  vocab: Any
  vocab_spec: str
  name: str = ""
  out_dir: str = ""
  own_inference: Any = None
  _model_key: Optional[str] = dataclasses.field(default=None, init=False, repr=False)

  @classmethod
  def from_checkpoint(cls, checkpoint: str, settings: SuiteSettings, *, name: str = "", out_dir: str = "",
                      **overrides) -> "Context":
    """The checkpoint loaded (overrides: ModelConfig fields over its own, e.g. mem_layers), its
    window unless settings.window, its vocabulary unless settings.vocab; name: its folder's."""
    model = from_pretrained(checkpoint, **overrides)
    window = int(settings.window or model.window or 0)
    if not window:
      raise ValueError(f"{checkpoint}: the checkpoint records no window; pass --eval.window")
    ck = model.checkpoint
    spec = vocab_lib.checkpoint_vocab_spec(checkpoint, ck.meta, ck.tokenizer_path, settings.vocab)
    # the dictionary task's ids as they are, for the task the dict settings describe
    vocab = (vocab_lib.TokenVocab(settings.dict.task.vocab_size) if spec == "dictionary_lookup"
             else vocab_lib.get_vocabulary(spec))
    vocab_lib.check_fits(vocab.vocab_size, model.cfg.vocab_size, f"vocabulary {spec}", checkpoint)
    return cls(checkpoint, settings, model.cfg, model.params, window, vocab, spec,
               name=name or os.path.basename(os.path.normpath(checkpoint)), out_dir=out_dir)

  def model_key(self) -> str:
    """What a scored prompt depends on besides its tokens: the model config, the parameters (a
    checksum: each array's sum and sum of squares in float32, reduced on the device, so a 3B
    model costs no host copy), the window, vocabulary and inference settings. Prompt records of
    another checkpoint step or setting are never reused."""
    if self._model_key is None:
      def sums(x):
        x = x.astype(jnp.float32)
        return jnp.stack([jnp.sum(x), jnp.sum(x * x)])
      checksum = jax.tree_util.tree_map(lambda a: np.asarray(a).tolist(), jax.jit(
          lambda p: jax.tree_util.tree_map(sums, p))(self.params))
      s = self.settings
      text = json.dumps({"model": self.cfg.to_dict(), "params": checksum, "window": self.window,
                         "vocab": str(self.vocab_spec), "mode": s.mode, "topk": s.topk, "chunk": s.chunk,
                         **({"host_index": s.host_index, "nprobe": s.nprobe} if s.mode == "host" else {})},
                        sort_keys=True, default=str)
      self._model_key = hashlib.sha1(text.encode()).hexdigest()
    return self._model_key

  def records(self, grid: str) -> "retrieval.PromptRecords":
    """The prompt records of one grid of prompts (W/eval/<grid>.prompts.jsonl); in memory only
    without an out_dir."""
    if not self.out_dir:
      return retrieval.PromptRecords()
    return retrieval.PromptRecords(os.path.join(self.out_dir, f"{grid}.prompts.jsonl"), self.model_key())

  def inference(self, mode=None):
    """own_inference if there is one; else memory inference read as `mode` (default: the settings')."""
    if self.own_inference is not None:
      return self.own_inference
    s = self.settings
    if (mode or s.mode) == "host":
      return HostMemoryInference(self.cfg, self.params, self.window, s.topk, s.host_index, s.nprobe)
    return MemoryInference(self.cfg, self.params, self.window, mode or s.mode, s.topk, s.chunk)

  def docs(self, need: int, n: int, wrap: bool = True, split: str = "") -> List[np.ndarray]:
    """n held-out documents of at least `need` tokens (`bos doc eos` when wrap), in stored order."""
    s = self.settings
    split = split or s.split
    if s.task == "dictionary_lookup":  # the dict suite's task, documents straight from its generator
      task = s.dict.task
      rng = np.random.default_rng([s.seed, 7])
      return [task.document(rng)["tokens"].astype(np.int32) for _ in range(n)]
    ids = vocab_lib.special_ids(self.vocab)
    out = pipeline.long_documents(s.task, self.vocab, split, need, n,
                                  wrap=(ids["bos"], ids["eos"]) if wrap else None)
    if len(out) == n:
      return out
    raise ValueError(f"eval: task {s.task!r} split {split!r} has only {len(out)} documents of at least "
                     f"{need} tokens, {n} are needed; lower the sizes or the document count")

  def texts(self, n: int) -> List[str]:
    return pipeline.document_texts(self.settings.task, self.settings.split, n)


def run_ppl(ctx: Context) -> Dict:
  p = ctx.settings.ppl
  mems = list(p.memory_tokens)
  distract = p.distractor_tokens if p.distractor_tokens >= 0 else max(mems)
  docs = ctx.docs(perplexity.needed_length(mems, p.score_tokens), p.n_docs)
  out = {"n_docs": len(docs), "score_tokens": p.score_tokens}
  for doc_mode in p.doc_modes:
    out[doc_mode] = perplexity.perplexity_vs_memory(ctx.inference(), docs, mems, p.score_tokens,
                                                    ctx.settings.batch, doc_mode, name=ctx.name,
                                                    distractor_tokens=distract)
  return out


def run_rd(ctx: Context) -> Dict:
  s = ctx.settings
  r = s.rd
  docs = ctx.docs((r.context_windows + 1) * ctx.window, r.n_docs, wrap=s.task != "dictionary_lookup", split=r.split)
  out = positive_attention_mass(ctx.cfg, ctx.params, docs, ctx.window, list(r.ds), r.context_windows, s.batch,
                                name=ctx.name)
  out["split"] = r.split or s.split
  return out


def _grid(ctx: Context, suite: str, make_prompt) -> Dict:
  s = ctx.settings
  g = s.passkey if suite == "passkey" else s.niah  # niah_multi: the niah grid
  inference = ctx.inference()
  out = retrieval.grid(retrieval.InferenceModel(inference), ctx.vocab, make_prompt, list(g.lengths),
                       retrieval.depth_list(g.depths), g.trials, s.seed, s.batch, g.threshold, ctx.name, suite,
                       ctx.records(suite))
  if getattr(inference, "recall", None) is not None:  # an approximate top-k against exact search
    out["recall"] = inference.recall  # a sample of every window's queries
  if getattr(inference, "scored_recall", None) is not None:  # host memory: every query at the answers' positions
    out["scored_recall"] = inference.scored_recall
  return out


def run_passkey(ctx: Context) -> Dict:
  return _grid(ctx, "passkey", passkey.make_prompt_fn(ctx.vocab))


def run_niah(ctx: Context) -> Dict:
  s = ctx.settings
  hay = niah.Haystack(ctx.vocab, ctx.texts(s.niah.corpus_docs))
  out = {"haystack_tokens": int(len(hay.ids)), "task": s.task}
  out["single"] = _grid(ctx, "niah", niah.make_prompt_fn(ctx.vocab, hay, 1, s.niah.style))
  out["multi"] = _grid(ctx, "niah_multi", niah.make_prompt_fn(ctx.vocab, hay, s.niah.n_needles, s.niah.style))
  out["multi"]["n_needles"] = s.niah.n_needles
  return out


def run_dict(ctx: Context) -> Dict:
  s = ctx.settings
  d = s.dict
  mems = list(d.memory_tokens)
  evalset = dictionary.DictionaryEvalSet(d.task, d.n_docs, max(mems), d.seed)
  out = {"window": ctx.window, "topk": d.topk, "nprobe": d.nprobe, "device_max_tokens": d.device_max_tokens,
         "threshold": d.threshold}
  for mode in d.modes:
    host = mode in ("flat", "ivf")
    sizes = mems if host else [m for m in mems if m <= d.device_max_tokens]
    if len(sizes) < len(mems):
      print(f"[{ctx.name}] dict {mode}: memory past {d.device_max_tokens:,} tokens is left to the host index",
            flush=True)
    res = dictionary.evaluate(ctx.cfg, ctx.params, evalset, ctx.window, sizes, "topk" if host else mode,
                              d.topk, s.batch, s.chunk, name=ctx.name, retrieval=mode if host else None,
                              nprobe=d.nprobe)
    res["effective_length"] = effective_length(res["memory_tokens"], res["accuracy"], d.threshold)
    out[mode] = res
  return out


def run_ruler(ctx: Context) -> Dict:
  s = ctx.settings
  r = s.ruler
  return ruler.evaluate(ctx.inference(), ctx.vocab, list(r.tasks), list(r.lengths), r.trials, s.seed, r.threshold,
                        s.batch, ctx.name, records=ctx.records("ruler"))


def run_heads(ctx: Context) -> Dict:
  return heads.run_heads(ctx)


RUNNERS = {"ppl": run_ppl, "rd": run_rd, "passkey": run_passkey, "niah": run_niah, "dict": run_dict,
           "ruler": run_ruler, "heads": run_heads}


def run(checkpoint: str, suites: List[str], workdir: str, settings: SuiteSettings, name: str = "",
        **overrides) -> Dict[str, Dict]:
  """overrides: ModelConfig fields over the checkpoint's (e.g. mem_layers=(8, 16, 24))."""
  unknown = [s for s in suites if s not in RUNNERS]
  if unknown:
    raise ValueError(f"--suite: unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
  out_dir = os.path.join(workdir, "eval")  # heads writes its heat map there
  ctx = Context.from_checkpoint(checkpoint, settings, name=name, out_dir=out_dir, **overrides)
  os.makedirs(out_dir, exist_ok=True)
  recorded = settings.to_dict()
  results = {}
  for i, suite in enumerate(suites):
    print(f"[{ctx.name}] suite {suite} ({i + 1}/{len(suites)})", flush=True)
    t0 = time.time()
    res = RUNNERS[suite](ctx)
    res.update(suite=suite, checkpoint=os.path.abspath(checkpoint), name=ctx.name, seed=settings.seed,
               window=ctx.window, vocab=ctx.vocab_spec, mem_layers=list(ctx.cfg.mem_layers),
               seconds=time.time() - t0,
               config={k: v for k, v in recorded.items() if k not in SUITES or k == suite})
    jsonio.write_json(os.path.join(out_dir, f"{suite}.json"), res)
    report.plot_suite(suite, {ctx.name: res}, out_dir)
    results[suite] = res
    print(f"[{ctx.name}] suite {suite} done in {res['seconds']:.0f}s -> {out_dir}/{suite}.json", flush=True)
  report.write_report(workdir)
  return results
