"""The controlled context-extension study: one base checkpoint, several methods, one evaluation.

  python -m fot_jax.study --config=experiments/study_tiny.py --workdir=W

A method is a set of ModelConfig overrides applied to the base (`rope_scaling`,
`position_strategy`, `mem_layers`, ...) plus its inference path:
  * `plain`:  a long-context forward, the whole input in one window (no memory);
  * `memory`: FoT memory inference, windows of the base's length (or the method's `window`),
              earlier windows in the memory layers' memory (fot_jax/inference.py), read as the
              suite config's eval.mode / eval.topk say, or as the method's own `memory` retrieval
              (`memory_settings`: e.g. {"mode": "blocks", "block_size": 128, "block_reps": 16,
              "block_topk": 8}, InfLLM-style block memory, or {"mode": "topk", "topk": 32}).
A method with `"finetune": True` (or a dict overriding fields of the study's shared `finetune`)
is first trained from the base's parameters with its own model config into W/finetune/<name>
(`fot_jax.train.train`: resumable, the same data, steps, optimiser and tokens per step for every
fine-tuned method; see `finetune_settings`), then evaluated with the fine-tuned parameters.
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
The base is `base.checkpoint`, or trained first into W/base by `fot_jax.runs.run_lm` from
`base.train` (an LM experiment config; skipped when W/base already holds the finished run).
A bad input (a study file that does not load, a method with an unknown key or inference path, an
unknown suite, a missing base) ends in one line `fot_jax.study: ...` naming it, exit status 2
(fot_jax.cli); results are written atomically (fot_jax.jsonio).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, List

import numpy as np

from fot_jax.jsonio import read_json, write_json

INFERENCE_PATHS = ("plain", "memory")
SUITES = ("ppl", "passkey", "niah", "rd")
METHOD_KEYS = ("name", "inference", "overrides", "window", "finetune", "memory")
# a method's `memory` retrieval: per mode, its fields (fot_jax.inference.MemoryInference's arguments)
MEMORY_FIELDS = {"dense": (), "topk": ("topk",), "approx_topk": ("topk",),
                 "blocks": ("block_size", "block_reps", "block_topk")}
CONFIG_KEYS = ("base", "lengths", "methods", "suites", "pad", "ppl", "eval")


class PlainInference:
  """MemoryInference's interface for a long-context forward: each `process` call is one window as
  wide as its input rounded up to a multiple of `pad` and of 1/16 of the next power of two (masked
  padding at the end; at most ~6% over), so all suites of a method share a few compiled widths
  (a power of two would double a 16,390-token prompt to 32,768). (Dynamic NTK measures the padded width.)

  The model is the method's, memory layers included, with an empty memory: what the model
  computes on the window alone. (A memory layer without memory is not always a plain layer:
  with mem_positions='none' it applies no RoPE at all, with mem_qk_norm it normalises q and k.)
  The plain path reads no memory: `memory` is never read or written, so each call sees its own
  input only, however the caller reuses a memory object."""

  def __init__(self, cfg, params, pad: int = 64, chunk: int = 65536):
    self.cfg, self.params, self.pad, self.chunk = cfg, params, int(pad), chunk
    self.window = 0

  def new_memory(self, batch: int):
    from fot_jax.inference import Memory
    return Memory(self.cfg, batch)

  def process(self, tokens, memory, token_mask=None, want_logits: bool = True, logits_from: int = 0):
    """tokens [B, L] -> logits [B, L, V] of one causal window over the whole input (None if not
    wanted). `memory` and `logits_from` are accepted for MemoryInference's interface; one window
    holds every column, so all logits are kept."""
    import jax.numpy as jnp
    from fot_jax.inference import forward_window
    del memory, logits_from
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    mask = np.ones((b, t), bool) if token_mask is None else np.asarray(token_mask, bool)
    width = plain_width(t, self.pad)
    tok = np.pad(tokens, [(0, 0), (0, width - t)])
    msk = np.pad(mask, [(0, 0), (0, width - t)])
    logits, _ = forward_window(self.params, jnp.asarray(tok), jnp.asarray(msk), None, self.cfg, "dense", 1,
                               self.chunk)
    return np.asarray(logits[:, :t]) if want_logits else None


def plain_width(t: int, pad: int) -> int:
  """The compiled width for t tokens: t rounded up to a multiple of max(pad, next power of two / 16)."""
  step = max(pad, (1 << max(t - 1, 0).bit_length()) // 16)
  return -(-max(t, 1) // step) * step


def method_model_config(base_cfg, method: Dict):
  """The base ModelConfig with the method's overrides, validated (errors name the method)."""
  name = method.get("name", "?")
  return type(base_cfg).from_dict(dict(method.get("overrides", {})), f"study method {name!r}", base=base_cfg)


def select_methods(methods: List[Dict], only: str, source: str) -> List[Dict]:
  """The methods named in `only` ("NAME,NAME": an experiment file's `--config=FILE:NAME,NAME`;
  empty: all), in the file's order; an unknown name is an error listing the file's methods."""
  names = [n for n in only.split(",") if n]
  if not names:
    return list(methods)
  known = [m["name"] for m in methods]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"{source}: unknown method(s) {unknown}; the methods: {known}")
  return [m for m in methods if m["name"] in names]


def memory_settings(method: Dict):
  """The method's own memory retrieval, resolved (None: the suite config's eval.mode / eval.topk).
  `memory` is {"mode": M, ...fields of M}: "dense"; "topk" / "approx_topk" with "topk" (required);
  "blocks" with "block_size", "block_reps", "block_topk" (each defaulting to memory.BlockSpec's:
  128, 16, 8). Only for the memory path. Errors name the method and the field."""
  from fot_jax.model.memory import BlockSpec
  name = method.get("name", "?")
  mem = method.get("memory")
  if mem is None:
    return None
  if not hasattr(mem, "keys"):
    raise ValueError(f"study method {name!r}: memory must be a dict such as {{'mode': 'blocks', 'block_size': 128, "
                     f"'block_reps': 16, 'block_topk': 8}}, got {mem!r}")
  mem = dict(mem)
  if method.get("inference", "plain") != "memory":
    raise ValueError(f"study method {name!r}: memory (its memory retrieval) needs inference 'memory', "
                     f"got inference {method.get('inference', 'plain')!r}")
  mode = mem.get("mode")
  if mode not in MEMORY_FIELDS:
    raise ValueError(f"study method {name!r}: memory.mode must be one of {list(MEMORY_FIELDS)}, got {mode!r}")
  fields = MEMORY_FIELDS[mode]
  unknown = sorted(set(mem) - {"mode"} - set(fields))
  if unknown:
    raise ValueError(f"study method {name!r}: memory field(s) {unknown} unknown for mode {mode!r}; "
                     f"its fields: {list(fields)}")
  if mode in ("topk", "approx_topk") and "topk" not in mem:
    raise ValueError(f"study method {name!r}: memory.topk is required for mode {mode!r} (memory tokens "
                     "attended per query)")
  out = {"mode": mode}
  defaults = BlockSpec()._asdict() if mode == "blocks" else {}
  for f in fields:
    value = mem.get(f, defaults.get(f))
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError(f"study method {name!r}: memory.{f} must be a positive integer, got {value!r}")
    out[f] = int(value)
  return out


def _memory_label(method: Dict) -> str:
  """The table's path cell: the inference path, with the method's own memory retrieval."""
  path = method.get("inference", "plain")
  ms = memory_settings(method) if path == "memory" else None
  if not ms:
    return path
  if ms["mode"] == "blocks":
    return f"memory, blocks {ms['block_size']} x {ms['block_topk']} (reps {ms['block_reps']})"
  return f"memory, {ms['mode']}" + (f" {ms['topk']}" if "topk" in ms else "")


def _method_context(base, method: Dict, pad: int, params=None):
  """A suite Context for one method: the loaded base (params, vocab, data) with the method's config
  and inference path (and `params` instead of the base's: a fine-tuned method); the suite runners
  of fot_jax/eval/suite.py then run on it unchanged."""
  from fot_jax.eval import suite as suite_lib
  from fot_jax.inference import MemoryInference
  path = method.get("inference", "plain")
  if path not in INFERENCE_PATHS:
    raise ValueError(f"study method {method.get('name')!r}: inference must be one of {INFERENCE_PATHS}, "
                     f"got {path!r}")
  cfg = method_model_config(base.cfg, method)
  if path == "memory" and not cfg.mem_layers:
    raise ValueError(f"study method {method['name']!r}: inference 'memory' needs mem_layers")
  own = memory_settings(method)  # the method's memory retrieval (None: the suite config's)

  class MethodContext(suite_lib.Context):
    def __init__(self):  # shares the loaded base; nothing is read again
      self.__dict__.update(base.__dict__)
      self.cfg, self.name, self.inference_path = cfg, method["name"], path
      if params is not None:
        self.params = params
      self.window = int(method.get("window") or base.window)  # the memory path's local window
      self.memory = own

    def inference(self, mode=None):
      """The method's inference: a method's own `memory` retrieval wins over `mode` and the suite
      config's eval.mode / eval.topk."""
      c = self.config
      if path != "memory":
        return PlainInference(self.cfg, self.params, pad, c.chunk)
      retrieval = dict(own or {"mode": mode or c.mode})
      return MemoryInference(self.cfg, self.params, self.window, retrieval.pop("mode"), retrieval.pop("topk", c.topk),
                             c.chunk, **retrieval)  # the rest: a block mode's block_size, block_reps, block_topk

  return MethodContext()


FINETUNE_FIELDS = ("steps", "optim", "task", "vocab", "split", "slots", "length", "seed", "min_doc_len",
                   "crossbatch", "checkpoint_every", "log_every", "tensorboard")
_SPEC_KINDS = {"constant": ("spec",), "metric": ("before", "after")}  # where each kind keeps its specs


def finetune_settings(config, method: Dict):
  """The fine-tune of a method, as JSON (None: a frozen method): the study's `finetune` with the
  method's dict (if `finetune` is one) over it. Fields:
    steps, optim (an LM config's c.optim; total_steps defaults to steps), seed (the documents'
    order), task, split, vocab ('' = the base checkpoint's, as the evaluation), slots,
    min_doc_len: the data; length: the extended context L_ft trained at; crossbatch: memory
    methods' spec or curriculum (fot_jax/curriculum.py; a spec {"d": D} without w / segments
    means every window sees all earlier windows of its slot and as many of D - 1 other slots');
    checkpoint_every, log_every, tensorboard.
  Every fine-tuned method sees the same tokens per step: `slots` streams of `length` tokens each
  (the plain path: one window of `length`, no crossbatch; the memory path: length / window
  windows of the base's window, with crossbatch). Plain methods drop `crossbatch` (not theirs)."""
  ft = method.get("finetune")
  if not ft:
    return None
  name = method.get("name", "?")
  if ft is not True and not hasattr(ft, "keys"):
    raise ValueError(f"study method {name!r}: finetune must be True or a dict of finetune fields, got {ft!r}")
  if "finetune" not in config:
    raise ValueError(f"study method {name!r}: fine-tuned, but the study has no shared `finetune` settings")
  s = _jsonable(config.finetune)
  own = _jsonable(ft) if ft is not True else {}
  unknown = sorted((set(s) | set(own)) - set(FINETUNE_FIELDS))
  if unknown:
    raise ValueError(f"study method {name!r}: unknown finetune field(s) {unknown}; known: {list(FINETUNE_FIELDS)}")
  optim = dict(s.get("optim") or {}, **own.pop("optim", {}))
  s.update(own, optim=optim)
  for f, default in (("vocab", ""), ("split", "train"), ("seed", 0), ("min_doc_len", 1), ("log_every", 10),
                     ("checkpoint_every", 0), ("tensorboard", False)):
    s.setdefault(f, default)
  for f in ("steps", "length", "slots"):
    if not isinstance(s.get(f), int) or s[f] <= 0:
      raise ValueError(f"study method {name!r}: finetune.{f} must be a positive integer, got {s.get(f)!r}")
  if not s.get("task"):
    raise ValueError(f"study method {name!r}: finetune.task must name the training data (a SeqIO task)")
  if float(optim.get("lr", 0)) <= 0:
    raise ValueError(f"study method {name!r}: finetune.optim.lr must be positive, got {optim.get('lr')!r}")
  if optim.get("schedule", "constant") not in ("constant", "cosine"):
    raise ValueError(f"study method {name!r}: finetune.optim.schedule must be 'constant' or 'cosine', "
                     f"got {optim['schedule']!r}")
  optim.setdefault("total_steps", s["steps"])
  if method.get("inference", "plain") == "plain":
    s.pop("crossbatch", None)
  elif not s.get("crossbatch"):
    raise ValueError(f"study method {name!r}: a memory method fine-tunes with crossbatch; set finetune.crossbatch "
                     "(e.g. {'d': 2})")
  return s


def _jsonable(x) -> Dict:
  return json.loads(json.dumps(x.to_dict() if hasattr(x, "to_dict") else dict(x), default=list))


def _crossbatch_curriculum(crossbatch_cfg: Dict, k: int) -> Dict:
  """finetune.crossbatch as a Schedule config for packs of k windows: a bare spec is a constant
  curriculum; a spec {"d": D} (no w, no segments) becomes segments (j, (D - 1) j) per window j."""
  c = json.loads(json.dumps(crossbatch_cfg))
  if "kind" not in c:
    c = {"kind": "constant", "spec": c}

  def fill(spec):
    if spec and "d" in spec and "w" not in spec and "segments" not in spec:
      return {"segments": [[j, (int(spec["d"]) - 1) * j] for j in range(k)]}
    return spec

  kind = c["kind"]
  for key in _SPEC_KINDS.get(kind, ()):
    c[key] = fill(c.get(key))
  if kind == "stages":
    c["stages"] = [[start, fill(spec)] for start, spec in c.get("stages", [])]
  elif kind == "random":
    c["choices"] = [fill(spec) for spec in c.get("choices", [])]
  elif kind == "phases":
    c["phases"] = [dict(p, spec=fill(p.get("spec"))) for p in c.get("phases", [])]
  return c


def _finetune_plan(base, method: Dict, config):
  """(settings, method context, window, windows per slot, Schedule) of a fine-tuned method,
  checked against the base (errors name the method)."""
  from fot_jax import crossbatch
  from fot_jax import checkpoint
  from fot_jax.curriculum import Schedule
  s = finetune_settings(config, method)
  name = method["name"]
  ctx = _method_context(base, method, int(config.pad))
  length = s["length"]
  if ctx.inference_path == "plain":
    window, k, schedule = length, 1, Schedule({"kind": "constant", "spec": {}})
  else:
    window = ctx.window
    if length % window or length // window < 2:
      raise ValueError(f"study method {name!r}: finetune.length {length} must be a multiple (at least 2x) of the "
                       f"memory method's window {window}: the memory path trains on length / window windows "
                       "per slot")
    k = length // window
    try:
      schedule = Schedule(_crossbatch_curriculum(s["crossbatch"], k))
      if schedule.tasks() != [None]:
        raise ValueError("its phases name data tasks; the fine-tune trains on finetune.task only")
      if schedule.pack != k:
        raise ValueError(f"pack size {schedule.pack} (w + 1 or len(segments)) must be length / window = {k}")
      for spec in schedule.all_specs():
        crossbatch.plan_from_spec(s["slots"] * k, spec)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"study method {name!r}: finetune.crossbatch: {e}") from None
  try:  # the fine-tune starts from the base's parameters: the method may not add any
    checkpoint.check_params(base.params, ctx.cfg, f"the base for fine-tuning {name!r}")
  except checkpoint.ConvertError as e:
    raise ValueError(f"study method {name!r}: {e}") from None
  return s, ctx, window, k, schedule


def finetune_batches(base, name: str, s: Dict, window: int, k: int):
  """The fine-tune's slot batcher: finetune.slots streams, k windows of `window` tokens per slot
  (k * window = finetune.length): the same tokens for every method, cut differently."""
  from data_pipelines import pipeline, vocab as vocab_lib
  vocab = vocab_lib.get_vocabulary(s["vocab"]) if s["vocab"] else base.vocab
  try:
    vocab_lib.check_fits(vocab.vocab_size, base.cfg.vocab_size, f"finetune.vocab of {name!r}")
    batches = pipeline.lm_batches(s["task"], vocab, slots=pipeline.host_slots(s["slots"]), windows=k,
                                  window=window, split=s["split"], seed=int(s["seed"]),
                                  min_doc_len=int(s["min_doc_len"]))
    batches.check_nonempty()
  except ValueError as e:
    raise ValueError(f"study method {name!r}: finetune data: {e}") from None
  return batches


def finetune_method(base, method: Dict, config, workdir: str):
  """Trains a fine-tuned method from the base's parameters into W/finetune/<name> (resumes its
  checkpoints; a directory of other settings is trained again) -> (params, summary)."""
  import shutil
  import jax
  from fot_jax.model.init import init_params
  from fot_jax.train import train
  s, ctx, window, k, schedule = _finetune_plan(base, method, config)
  name = method["name"]
  out_dir = os.path.join(workdir, "finetune", name)
  record_path = os.path.join(out_dir, "finetune.json")
  record = {"method": _spec(method), "finetune": s}
  prev = {}
  if os.path.exists(record_path):
    prev = read_json(record_path, f"fine-tune record of {name!r}")
  if os.path.isdir(out_dir) and {k_: prev.get(k_) for k_ in record} != record:
    print(f"[study] fine-tune {name}: {out_dir} holds another fine-tune (its settings changed); training again",
          flush=True)
    shutil.rmtree(out_dir)
    prev = {}
  os.makedirs(out_dir, exist_ok=True)
  write_json(record_path, dict(prev, **record))
  batches = finetune_batches(base, name, s, window, k)
  tc = {"steps": s["steps"], "seed": int(s["seed"]), "loss_on": "all", "optim": s["optim"],
        "log_every": int(s["log_every"]), "checkpoint_every": int(s["checkpoint_every"]),
        "tensorboard": bool(s["tensorboard"])}
  # the base's parameters in the dtypes training keeps (an imported checkpoint may store bf16)
  abstract = jax.eval_shape(lambda: init_params(ctx.cfg, 0))
  init = jax.tree_util.tree_map(lambda x, a: np.asarray(x, a.dtype), base.params, abstract)
  done = prev.get("result")
  print(f"[study] fine-tune {name}: " + ("done before, restoring its parameters" if done else
        f"{s['steps']} steps of {s['slots']} x {s['length']:,} tokens ({k} window(s) of {window:,} per slot) "
        f"into {out_dir}"), flush=True)
  out = train(ctx.cfg, tc, schedule, batches, out_dir, name=f"ft {name}", init_params_tree=init,
              model_meta={"vocab": s["vocab"] or base.vocab_spec})
  hist = out["history"]
  if hist:
    rds = [h["rd"] for h in hist[-10:] if np.isfinite(h["rd"])]
    done = {"seconds": out["seconds"], "steps": s["steps"], "steps_run_last_session": len(hist),
            "tokens_per_step": s["slots"] * s["length"], "window": window, "windows_per_slot": k,
            "final_loss": float(np.mean([h["loss"] for h in hist[-10:]])),
            "final_rd": float(np.mean(rds)) if rds else None, "phases": out["phases"]}
    write_json(record_path, dict(record, result=done))
  elif not done:  # finished checkpoints without a record of them (interrupted between the two)
    done = {"seconds": 0.0, "steps": s["steps"], "steps_run_last_session": 0}
  return out["params"], done


def perplexity_vs_length(ctx, lengths: List[int], score_tokens: int, n_docs: int, batch: int) -> Dict:
  """The same scored span (each document's last score_tokens targets) with L - score_tokens tokens
  of context before it, for every L in lengths: the L-token input goes through the method's
  `process` from its first token (so at L = the base window, memory methods equal plain ones)."""
  from fot_jax.eval import perplexity
  top = max(lengths)
  if min(lengths) <= score_tokens:
    raise ValueError(f"study: ppl.score_tokens {score_tokens} must be below the shortest length {min(lengths)}")
  docs = ctx.docs(top + 1, n_docs)
  tails = np.stack([np.asarray(d[-(top + 1):], np.int32) for d in docs])
  out = {"lengths": [int(x) for x in lengths], "perplexity": [], "nll": [], "score_tokens": int(score_tokens),
         "n_docs": len(docs)}
  for length in lengths:
    t0 = time.time()
    nlls = []
    for s in range(0, len(tails), batch):  # plain: one window; memory: windows from the first token
      nlls.append(perplexity.one_call_nll(ctx.inference(), tails[s:s + batch, top - length:], score_tokens))
    mean = float(np.concatenate(nlls).mean())
    out["nll"].append(mean)
    out["perplexity"].append(math.exp(mean))
    print(f"[{ctx.name}] ppl: length {length:>7,}: perplexity {math.exp(mean):.3f} ({time.time() - t0:.0f}s)",
          flush=True)
  return out


def evaluate_method(base, method: Dict, config, params=None, done=None, save=None) -> Dict:
  """All suites of the study for one method (with `params`, e.g. fine-tuned, instead of the
  base's) -> its result dict. `done`: an earlier result of the same method and settings whose
  suites are kept (only the missing ones run); `save(res)` is called after every suite, so an
  interrupted method resumes at its next suite."""
  from fot_jax.eval import suite as suite_lib
  from fot_jax.eval.effective_length import effective_length
  ctx = _method_context(base, method, int(config.pad), params)
  res = {"method": _spec(method), "settings": settings(config, method), "seconds": {}, "suites_done": []}
  for suite in (done or {}).get("suites_done", []):
    if suite in config.suites:
      res["suites_done"].append(suite)
      if suite in done:
        res[suite], res["seconds"][suite] = done[suite], done["seconds"][suite]
  for suite in config.suites:
    if suite in res["suites_done"]:
      print(f"[{ctx.name}] {suite}: done before, kept", flush=True)
      continue
    t0 = time.time()
    if suite == "ppl":
      r = perplexity_vs_length(ctx, list(config.lengths), int(config.ppl.score_tokens), int(config.ppl.n_docs),
                               int(config.eval.batch))
      # the longest length whose perplexity stays within ppl.tolerance x that at the shortest length
      r["effective_length"] = effective_length(r["lengths"], r["perplexity"],
                                               float(config.ppl.tolerance) * r["perplexity"][0], False)
    elif suite == "passkey":
      r = suite_lib.run_passkey(ctx)
    elif suite == "niah":
      r = suite_lib.run_niah(ctx)
    elif suite == "rd":
      r = None  # r_d measures memory attention: only for methods that read memory, all of it
      reads_all = (ctx.memory or {}).get("mode", "dense") == "dense"  # eval/rd.py attends to all of memory
      if ctx.inference_path == "memory" and ctx.cfg.mem_layers and reads_all:
        r = suite_lib.run_rd(ctx)
      elif ctx.memory:  # a retrieving method's r_d would be its dense twin's figure, not its own
        print(f"[{ctx.name}] rd: skipped (r_d is measured with dense memory; this method reads "
              f"{ctx.memory['mode']})", flush=True)
    else:
      raise ValueError(f"study: unknown suite {suite!r}; known: {SUITES}")
    if r is not None:
      res[suite] = r
      res["seconds"][suite] = time.time() - t0
    res["suites_done"].append(suite)
    if save is not None:
      save(res)
  return res


def same_settings(a: Dict, b: Dict) -> bool:
  """Two methods' settings equal but for the list of suites (a suite's result stays valid when
  others are added or dropped)."""
  strip = lambda x: {k: v for k, v in (x or {}).items() if k != "suites"}
  return strip(a) == strip(b)


def settings(config, method=None) -> Dict:
  """What a method's results depend on besides its spec: a finished method is reused only if equal.
  A fine-tuned method's include its resolved fine-tune (a changed one trains and evaluates again)."""
  out = json.loads(json.dumps({k: (config[k].to_dict() if hasattr(config[k], "to_dict") else config[k])
                               for k in ("lengths", "suites", "pad", "ppl", "eval")}, default=list))
  ft = finetune_settings(config, method) if method is not None else None
  if ft is not None:
    out["finetune"] = ft
  own = memory_settings(method) if method is not None else None
  if own is not None:  # the method's memory retrieval, defaults resolved
    out["memory"] = own
  return out


def _spec(method: Dict) -> Dict:
  return json.loads(json.dumps(method, default=list))  # tuples -> lists, as stored


def ensure_base(config, workdir: str) -> str:
  """The base checkpoint: config.base.checkpoint, or the run trained into W/base (once)."""
  path = config.base.get("checkpoint") or ""
  if path:
    if not os.path.exists(path):
      raise ValueError(f"study: base checkpoint {path!r} does not exist; {config.base.get('missing_hint', '')}"
                       .rstrip("; "))
    return path
  if "train" not in config.base:
    raise ValueError("study: set base.checkpoint or base.train (an LM experiment config)")
  base_dir = os.path.join(workdir, "base")
  ck = os.path.join(base_dir, "fot")
  if os.path.exists(os.path.join(base_dir, "results.json")):
    print(f"[study] base: {ck} (trained before)", flush=True)
    return ck
  from fot_jax import configs, runs
  train_cfg = config.base.train
  configs.validate(train_cfg)
  print(f"[study] base: training {train_cfg.train.steps} steps into {base_dir}", flush=True)
  t0 = time.time()
  runs.run_lm(train_cfg, base_dir)
  print(f"[study] base trained in {time.time() - t0:.0f}s", flush=True)
  return ck


def eval_config(config):
  """The suite settings of the study: fot_jax/eval defaults, the study's lengths on every grid."""
  e = config.eval
  for g in (e.passkey, e.niah):
    g.lengths = tuple(int(x) for x in config.lengths)
  return e


def check_config(config) -> None:
  """The study file's shape, before anything is loaded or trained: its fields, the suites, and
  every method an entry the study knows (no misspelt key such as 'overides' silently ignored).
  Errors name the field or the method."""
  if not hasattr(config, "keys"):
    raise ValueError(f"study: get_config() returned {config!r}, not a ConfigDict")
  missing = [k for k in CONFIG_KEYS if k not in config]
  if missing:
    raise ValueError(f"study: the study config has no {missing}; a study file sets {list(CONFIG_KEYS)}")
  unknown = [s for s in config.suites if s not in SUITES]
  if unknown:
    raise ValueError(f"study: unknown suite(s) {unknown} in suites; known: {list(SUITES)}")
  lengths = list(config.lengths)
  if not lengths or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in lengths):
    raise ValueError(f"study: lengths must be positive integers, got {lengths}")
  methods = list(config.methods)
  if not methods:
    raise ValueError("study: no methods")
  for i, m in enumerate(methods):
    if not hasattr(m, "keys"):
      raise ValueError(f"study: method {i} is {m!r}, not a dict of {list(METHOD_KEYS)}")
    name = m.get("name")
    if not isinstance(name, str) or not name or not all(ch.isalnum() or ch in "_-." for ch in name) \
        or name.startswith("."):
      raise ValueError(f"study: method {i} needs a 'name' of letters, digits, _, - or . (it names its "
                       f"result files), got {name!r}")
    unknown = sorted(set(m.keys()) - set(METHOD_KEYS))
    if unknown:
      raise ValueError(f"study method {name!r}: unknown key(s) {unknown}; a method has {list(METHOD_KEYS)}")
    path = m.get("inference", "plain")
    if path not in INFERENCE_PATHS:
      raise ValueError(f"study method {name!r}: unknown inference path {path!r}; the paths are "
                       f"{list(INFERENCE_PATHS)}")
    if not hasattr(m.get("overrides", {}), "keys"):
      raise ValueError(f"study method {name!r}: overrides must be a dict of ModelConfig fields, "
                       f"got {m['overrides']!r}")
    window = m.get("window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
      raise ValueError(f"study method {name!r}: window must be a positive integer (0: the base's), got {window!r}")
    memory_settings(m)
  names = [m["name"] for m in methods]
  if len(set(names)) != len(names):
    raise ValueError(f"study: method names must be unique, got {names}")


def run(config, workdir: str) -> Dict:
  check_config(config)
  for m in config.methods:  # the fine-tune fields, before a base is trained
    finetune_settings(config, m)
  from fot_jax.eval import suite as suite_lib
  names = [m["name"] for m in config.methods]
  t_start = time.time()
  os.makedirs(os.path.join(workdir, "methods"), exist_ok=True)
  base_path = ensure_base(config, workdir)
  base = suite_lib.Context(base_path, eval_config(config))
  base.name = "base"
  for m in config.methods:  # every method's config is checked before the first one runs
    _method_context(base, m, int(config.pad))
    if m.get("finetune"):  # and its data (one slot filled; the fine-tune builds its own batcher)
      s, _, window, k, _ = _finetune_plan(base, m, config)
      finetune_batches(base, m["name"], s, window, k)
  results, spent = {}, []
  for i, m in enumerate(config.methods):
    name = m["name"]
    out = os.path.join(workdir, "methods", f"{name}.json")
    partial = os.path.join(workdir, "methods", f"{name}.partial.json")  # the suites finished so far
    prev = None
    for path in (out, partial):
      if prev is None and os.path.exists(path):
        prev = read_json(path, f"study result of method {name!r}")
        if not isinstance(prev, dict):
          raise ValueError(f"study result {path} is not a JSON object; delete it to evaluate {name!r} again")
        # a file from before suites_done was written once all of its settings' suites had run
        prev.setdefault("suites_done", list(prev.get("settings", {}).get("suites", [])))
        if prev.get("method") != _spec(m) or not same_settings(prev.get("settings"), settings(config, m)):
          print(f"[study] method {name}: its spec or the study's settings changed since {path} was written; "
                "evaluating again", flush=True)
          prev = None
    todo = [x for x in config.suites if x not in (prev or {}).get("suites_done", [])]
    if prev is not None and not todo:
      print(f"[study] method {i + 1}/{len(names)} {name}: done before ({out}), skipped", flush=True)
      results[name] = dict(prev, settings=settings(config, m))
      continue
    print(f"[study] method {i + 1}/{len(names)} {name}: {_describe(m)}"
          + (f"; suites {todo} (the others done before)" if prev else ""), flush=True)
    t0 = time.time()
    wall_before = (prev or {}).get("wall_seconds", 0.0)

    def save(res, path=partial, t0=t0, wall_before=wall_before):
      write_json(path, dict(res, wall_seconds=wall_before + time.time() - t0))

    params, ft = finetune_method(base, m, config, workdir) if m.get("finetune") else (None, None)
    res = evaluate_method(base, m, config, params, done=prev, save=save)
    if ft is not None:
      res["finetune"] = ft
    res["wall_seconds"] = wall_before + time.time() - t0  # fine-tune (this session's part) and evaluation
    write_json(out, res)
    if os.path.exists(partial):
      os.remove(partial)
    results[name] = res
    spent.append(res["wall_seconds"])
    left = sum(1 for mm in config.methods[i + 1:]
               if not os.path.exists(os.path.join(workdir, "methods", f"{mm['name']}.json")))
    print(f"[study] method {name} done in {spent[-1]:.0f}s; {left} left, ETA {np.mean(spent) * left:.0f}s",
          flush=True)
  study = {"base": os.path.abspath(base_path), "window": base.window, "lengths": [int(x) for x in config.lengths],
           "methods": results, "wall_seconds": time.time() - t_start}
  if "finetune" in config:
    study["finetune"] = _jsonable(config.finetune)
  write_json(os.path.join(workdir, "study.json"), study)
  with open(os.path.join(workdir, "study.md"), "w") as f:
    f.write(markdown(study))
  plot(study, workdir)
  print(f"[study] wrote {workdir}/study.md, study.json and figures ({study['wall_seconds']:.0f}s)", flush=True)
  return study


def _describe(m: Dict) -> str:
  o = m.get("overrides", {})
  path = m.get("inference", "plain")
  retrieval = _memory_label(m)[len(path):]  # ", blocks 128 x 8 (reps 16)" for a method's own memory retrieval
  return f"{path} path{retrieval}" + (f", {dict(o)}" if o else "") + (", fine-tuned" if m.get("finetune") else "")


def _ft_label(r: Dict) -> str:
  """The table's fine-tune cell: 'frozen', or 'N steps @ L_ft' (+ the memory path's crossbatch)."""
  ft = r.get("settings", {}).get("finetune")
  if not ft:
    return "frozen"
  cb = ft.get("crossbatch")
  return f"{ft['steps']:,} steps @ {ft['length']:,}" + (f", {json.dumps(cb).replace(chr(34), '')}" if cb else "")


def _fmt(x, digits=3):
  if x is None:
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _grids(r: Dict) -> Dict[str, Dict]:
  out = {}
  if "passkey" in r:
    out["passkey"] = r["passkey"]
  if "niah" in r:
    out["NIAH single"], out["NIAH multi"] = r["niah"]["single"], r["niah"]["multi"]
  return out


def _grid_names(methods: Dict) -> List[str]:
  names = []
  for r in methods.values():
    names += [g for g in _grids(r) if g not in names]
  return names


def markdown(study: Dict) -> str:
  """One table: perplexity per length, mean accuracy and effective length per retrieval grid, r_d,
  wall time; then accuracy per length for each grid."""
  lengths = study["lengths"]
  methods = study["methods"]
  grid_names = _grid_names(methods)
  head = (["method", "path", "fine-tune"] + [f"ppl {x:,}" for x in lengths] + ["ppl eff. len"]
          + [f"{g} acc / eff. len" for g in grid_names] + ["r_d (d) / 1/d", "train s", "wall s"])
  rows = []
  for name, r in methods.items():
    row = [name, _memory_label(r["method"]), _ft_label(r)]
    p = r.get("ppl")
    row += [_fmt(v) for v in p["perplexity"]] if p else ["-"] * len(lengths)
    row.append(_fmt(p["effective_length"]) if p else "-")
    for gn in grid_names:
      g = _grids(r).get(gn)
      row.append(f"{np.mean(g['accuracy_per_length']):.2f} / {_fmt(g['effective_length'])}" if g else "-")
    rd = r.get("rd")
    row.append(f"{rd['r_d'][-1]:.3f} ({rd['d'][-1]}) / {1 / rd['d'][-1]:.3f}" if rd else "n/a")
    row.append(f"{r['finetune']['seconds']:.0f}" if r.get("finetune") else "-")
    row.append(f"{r['wall_seconds']:.0f}")
    rows.append(row)
  lines = [f"# Context-extension study: base {study['base']} (window {study['window']:,})", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  for g in grid_names:
    lines += ["", f"Accuracy per length, {g} (mean over depths):", "",
              "| method | " + " | ".join(f"{x:,}" for x in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, r in methods.items():
      if g in _grids(r):
        lines.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in _grids(r)[g]["accuracy_per_length"]) + " |")
  lines += ["", f"Study wall time {study['wall_seconds']:.0f}s (methods evaluated before are not re-timed). "
            "train s: the fine-tune's training (its last session when resumed); wall s: fine-tune and evaluation."]
  return "\n".join(lines) + "\n"


def _line_styles(methods: Dict) -> Dict[str, Dict]:
  """One colour per method spec (a fine-tuned method shares its frozen twin's), dashed when
  fine-tuned: 15 methods stay readable where the default colour cycle repeats after 10."""
  import matplotlib.pyplot as plt
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"] + ["#000000", "#7f7f00", "#004c99", "#993300"]
  family, out = {}, {}
  for n, r in methods.items():
    spec = {k: v for k, v in (r.get("method") or {"name": n}).items() if k not in ("name", "finetune")}
    key = json.dumps(spec, sort_keys=True, default=str)
    family.setdefault(key, colours[len(family) % len(colours)])
    out[n] = {"color": family[key], "ls": "--" if (r.get("method") or {}).get("finetune") else "-"}
  return out


def plot(study: Dict, workdir: str) -> List[str]:
  """study_ppl.png, study_accuracy.png (accuracy against length per method, one panel per grid),
  study_passkey.png / study_niah.png (heatmaps side by side), study_rd.png."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no figure written")
    return []
  from fot_jax.eval import report
  methods = study["methods"]
  files = []
  style = _line_styles(methods)
  with_ppl = {n: r["ppl"] for n, r in methods.items() if "ppl" in r}
  if with_ppl:
    fig, ax = plt.subplots(figsize=(8.0, 4.4))
    for n, p in with_ppl.items():
      ax.plot(p["lengths"], p["perplexity"], marker="o", label=n, **style[n])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("perplexity of the last tokens")
    ax.axvline(study["window"], color="k", ls=":", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, handlelength=3, loc="center left", bbox_to_anchor=(1.01, 0.5))  # long enough to show the dashes
    ax.set_title("Perplexity against length (dotted: base window; dashed: fine-tuned)")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "study_ppl.png"), dpi=110)
    plt.close(fig)
    files.append("study_ppl.png")
  grid_names = _grid_names(methods)
  if grid_names:
    fig, axes = plt.subplots(1, len(grid_names), figsize=(4.6 * len(grid_names), 3.8), squeeze=False)
    for ax, g in zip(axes[0], grid_names):
      for n, r in methods.items():
        if g not in _grids(r):
          continue
        gr = _grids(r)[g]
        ax.plot(gr["lengths"], gr["accuracy_per_length"], marker="o", label=n, **style[n])
      ax.set_xscale("log", base=2)
      ax.set_ylim(-0.03, 1.03)
      ax.set_xlabel("length (tokens)")
      ax.set_ylabel("accuracy")
      ax.set_title(g)
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, handlelength=3)  # long enough to show the dashes
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "study_accuracy.png"), dpi=110)
    plt.close(fig)
    files.append("study_accuracy.png")
  for suite in ("passkey", "niah", "rd"):
    runs = {n: r[suite] for n, r in methods.items() if suite in r}
    if runs:
      files += report.plot_suite(suite, runs, workdir, prefix="study_")
  return files


PROG = "fot_jax.study"


def _config_arg(argv) -> str:
  """The --config value on the command line ('' if none)."""
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      return a[len("--config="):]
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def parse_flags(argv):
  """absl's flag parsing, where loading the study file happens (ml_collections), with one line for
  a failure: a flag error, or the study file raising (e.g. `--config=FILE:ARG` naming an argument
  its get_config() does not know). FOT_JAX_TRACEBACK=1 keeps the traceback."""
  from absl import flags
  from fot_jax import cli
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - only flag parsing and the study file's own code run here
    if os.environ.get("FOT_JAX_TRACEBACK"):
      raise
    if isinstance(e, flags.Error):  # the study file's TypeError / ValueError come wrapped, with its traceback
      lines = [x.strip() for x in str(e).splitlines() if x.strip()]
      text = lines[0] + (" " + lines[-1] if len(lines) > 1 else "")
    else:
      text = f"--config={_config_arg(argv)}: loading the study file raised {type(e).__name__}: {e}"
    if "get_config() takes 0 positional arguments" in text:
      text += f"; {_config_arg(argv).split(':', 1)[0]} takes no ':ARG' after its path"
    cli.fail(PROG, text)


def main(argv):
  from absl import flags, logging
  from ml_collections import config_flags
  from fot_jax import cli
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  with cli.expected_errors(PROG):
    if len(argv) > 1:
      raise ValueError(f"unexpected arguments {argv[1:]}")
    spec = config_flags.get_config_filename(f["config"]) if f["config"].present else ""
    path = spec.split(":", 1)[0]  # FILE or FILE:ARG (ARG goes to get_config)
    if not path or not f.workdir:
      raise ValueError("--config=experiments/study_*.py and --workdir=DIR are required")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"--config: no study file at {path}")
    config = f.config
    try:
      getattr(config, "methods", None)  # ml_collections defers a study file's own IOError to here
    except OSError as e:
      raise ValueError(f"--config={spec}: the study file failed to load: {e}") from None
    try:
      check_config(config)
    except ValueError as e:
      raise ValueError(f"{spec}: {e}") from None
    run(config, f.workdir)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from absl import app, flags as _flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "Study file (one get_config()).")
  _flags.DEFINE_string("workdir", None, "Where the base, per-method results, table and figures go.")
  app.run(main, flags_parser=parse_flags)
