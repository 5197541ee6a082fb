"""fot_jax checkpoints in EleutherAI's lm-evaluation-harness (lm-eval 0.4.13), read with FoT memory.

  python -m fot_jax.eval.lm_harness --model fot_jax \\
      --model_args checkpoint=CKPT,window=512,mem_layers=6:17:18:20 \\
      --tasks niah_single_1,niah_multikey_2 --metadata='{"max_seq_lengths":[4096]}' \\
      --limit 10 --output_path W

(one RULER length per command: `--limit` keeps the first prompts of the lengths in order) takes
lm-eval's own command line (`python -m lm_eval ...`) and registers the model `fot_jax`
first: lm-eval 0.4.13 finds models only in its registry, with no entry points. Importing this
module registers it too, so `lm_eval.simple_evaluate(model="fot_jax", model_args=...)` works after
`import fot_jax.eval.lm_harness` (pass `with_tokenizer(model_args)` for RULER tasks).

Model arguments (`--model_args key=value,...`; docs/evaluation.md "lm-evaluation-harness"):
checkpoint (or pretrained), tokenizer, window, mode (dense, topk, or host: each query's top-k from a
faiss index on the host, fot_jax.host_memory, for prompts of 64K tokens and more), topk, host_index
(flat or ivf), nprobe, mem_layers (layers separated by ':'), dtype, batch_size, max_gen_toks, last_context_length, seed, rope_scaling (TYPE:FACTOR[:ORIGINAL], e.g.
yarn:4:8192), attention_impl. Every request is read window by window
with memory (fot_jax.inference; mode=host: fot_jax.host_memory): generation through
`MemoryInference.generate` (`HostMemoryInference.generate`; prompts aligned at their end),
log-likelihoods from the same windows (`forward_window`; `HostMemoryInference.process`), rolling
log-likelihoods with windows from token 0, as `Pretrained.logits_with_memory`. `--ruler_samples N`
caps RULER's prompts per length (`cap_ruler_samples`). Text is encoded with the checkpoint's
own vocabulary (`Pretrained.vocab`), bos first, as fot_jax.eval.ruler's prompts.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  lm-eval's own models first: its get_model imports them only into an empty registry
import numpy as np
from lm_eval._cli import HarnessCLI
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import setup_logging, simple_parse_args_string
from tqdm import tqdm

from data_pipelines.vocab import HFVocab
from fot_jax import chat, cli
from fot_jax.convert.api import from_pretrained
from fot_jax.eval import heads
from fot_jax.host_memory import KINDS as HOST_KINDS
from fot_jax.host_memory import HostMemoryInference
from fot_jax.inference import MemoryInference, end_aligned, forward_window, start_aligned
from fot_jax.model.config import ATTENTION_IMPLS

PROG = "fot_jax.eval.lm_harness"
MODEL_NAME = "fot_jax"
TARGET = "fot_jax.eval.lm_harness:FotJaxLM"  # the module's name also when it runs as __main__
MODES = ("dense", "topk", "host")  # dense / topk: fot_jax.model.memory; host: fot_jax.host_memory
LAYER_SEPARATOR = ":"  # commas separate lm-eval's model_args
IGNORED_ARGS = ("max_batch_size", "device", "trust_remote_code")  # lm-eval passes them to every model
ARGS = ("checkpoint", "pretrained", "tokenizer", "window", "mode", "topk", "host_index", "nprobe", "mem_layers",
        "dtype", "batch_size", "max_gen_toks", "last_context_length", "seed", "rope_scaling",
        "attention_impl") + IGNORED_ARGS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The model arguments, checked. mem_layers: None (the checkpoint's), a tuple, 'all' or 'auto:N'."""
  checkpoint: str
  tokenizer: Optional[str] = None
  window: Optional[int] = None
  mode: str = "dense"
  topk: int = 32
  host_index: str = "ivf"  # mode host: the faiss index, flat (exact) or ivf with nprobe lists searched
  nprobe: int = 8
  mem_layers: object = None
  dtype: Optional[str] = None
  batch_size: int = 1
  max_gen_toks: int = 256
  last_context_length: Optional[int] = None
  seed: int = 0
  rope_scaling: Optional[dict] = None  # config.json's rope_scaling over the checkpoint's
  attention_impl: Optional[str] = None


def _fail(name: str, message: str):
  raise ValueError(f"fot_jax model_args: {name}: {message}")


def _int(args: dict, name: str, default, least: int = 1):
  """An integer model argument (lm-eval passes numbers parsed, or text) of at least `least`."""
  value = args.get(name)
  if value is None or value == "":
    return default
  try:
    number = int(str(value).strip())
  except ValueError:
    number = None
  if number is None or number < least or isinstance(value, bool):
    _fail(name, f"expected an integer >= {least}, got {value!r}")
  return number


def _mem_layers(value):
  """lm-eval's value of mem_layers -> None (not given), () (none), a tuple of layers, 'all' or 'auto:N'.
  Text separates layers with ':' ('6:17:18:20'); lm-eval's own parsers may give an int, a list,
  or None for 'none'."""
  if isinstance(value, bool):
    _fail("mem_layers", f"expected layers separated by '{LAYER_SEPARATOR}', 'all', 'none' or 'auto:N', got {value!r}")
  if value is None:  # lm-eval reads 'none' / 'None' as None
    return ()
  if isinstance(value, int):
    value = str(value)
  if isinstance(value, (list, tuple)):
    value = ",".join(str(v) for v in value)
  text = str(value).strip().lower()
  if not text.startswith("auto"):
    text = text.replace(LAYER_SEPARATOR, ",").replace("+", ",")
  try:
    return cli.parse_mem_layers(text, auto=True)
  except ValueError:
    _fail("mem_layers", f"expected 0-based layers separated by '{LAYER_SEPARATOR}' (e.g. 6:17:18:20), 'all', "
                        f"'none' or 'auto:N', got {value!r}")


def _rope_scaling(value) -> Optional[dict]:
  """'TYPE:FACTOR[:ORIGINAL]' (e.g. yarn:4:8192: YaRN x4 of a model trained on 8,192 positions) ->
  config.json's rope_scaling dict; ModelConfig checks the type and its fields when the model loads."""
  if value is None or value == "":
    return None
  parts = str(value).strip().split(":")
  try:
    if not 2 <= len(parts) <= 3 or not parts[0]:
      raise ValueError
    out = {"rope_type": parts[0].lower(), "factor": float(parts[1])}
    if len(parts) == 3:
      out["original_max_position_embeddings"] = int(parts[2])
  except ValueError:
    _fail("rope_scaling", f"expected TYPE:FACTOR or TYPE:FACTOR:ORIGINAL_POSITIONS (e.g. yarn:4:8192), got {value!r}")
  return out


def settings(args: dict) -> Settings:
  """model_args (a dict as lm-eval passes them) -> Settings; a bad one raises one ValueError line naming it."""
  unknown = sorted(set(args) - set(ARGS))
  if unknown:
    _fail(unknown[0], f"unknown argument (known: {', '.join(ARGS[:-len(IGNORED_ARGS)])})")
  checkpoint = args.get("checkpoint") or args.get("pretrained")
  if args.get("checkpoint") and args.get("pretrained") and str(args["checkpoint"]) != str(args["pretrained"]):
    _fail("pretrained", f"an alias of checkpoint, but both are given and differ ({args['checkpoint']!r}, "
                        f"{args['pretrained']!r})")
  if not checkpoint or not isinstance(checkpoint, str):
    _fail("checkpoint", "required: checkpoint=PATH (an fot_jax checkpoint or training workdir, a Hugging Face "
                        "LLaMA directory or a .gguf file; pretrained= is an alias)")
  mode = str(args.get("mode") or "dense").strip().lower()
  if mode not in MODES:
    _fail("mode", f"expected one of {'|'.join(MODES)}, got {args.get('mode')!r}")
  host_index = str(args.get("host_index") or "ivf").strip().lower()
  if host_index not in HOST_KINDS:
    _fail("host_index", f"expected one of {'|'.join(HOST_KINDS)}, got {args.get('host_index')!r}")
  if mode != "host" and ("host_index" in args or "nprobe" in args):
    _fail("host_index" if "host_index" in args else "nprobe", f"only for mode=host, not mode={mode}")
  if "nprobe" in args and host_index != "ivf":
    _fail("nprobe", f"only for host_index=ivf (the inverted lists searched), not host_index={host_index}")
  batch = args.get("batch_size")
  if isinstance(batch, str) and batch.strip().lower().startswith("auto"):
    _fail("batch_size", f"{batch!r} is not supported; give a number of rows (e.g. --batch_size 8)")
  dtype = args.get("dtype")
  if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
    _fail("dtype", f"expected float32, bfloat16 or float16, got {dtype!r}")
  impl = args.get("attention_impl")
  if impl is not None and impl not in ATTENTION_IMPLS:
    _fail("attention_impl", f"expected one of {'|'.join(ATTENTION_IMPLS)}, got {impl!r}")
  tokenizer = args.get("tokenizer")
  if tokenizer is not None and not isinstance(tokenizer, str):
    _fail("tokenizer", f"expected a tokenizer directory, got {tokenizer!r}")
  return Settings(
      checkpoint=checkpoint, tokenizer=tokenizer or None, window=_int(args, "window", None), mode=mode,
      topk=_int(args, "topk", 32), host_index=host_index, nprobe=_int(args, "nprobe", 8), mem_layers=_mem_layers(args["mem_layers"]) if "mem_layers" in args else None,
      dtype=dtype, batch_size=_int(args, "batch_size", 1), max_gen_toks=_int(args, "max_gen_toks", 256, least=0),
      last_context_length=_int(args, "last_context_length", None, least=0), seed=_int(args, "seed", 0, least=0),
      rope_scaling=_rope_scaling(args.get("rope_scaling")), attention_impl=impl)


def with_tokenizer(model_args) -> dict:
  """model_args (a dict or lm-eval's 'k=v,k2=v2' text) with `tokenizer` set to the checkpoint's
  tokenizer directory when it is not given: lm-eval hands the model arguments to its tasks, and
  its RULER tasks size their prompts with transformers' AutoTokenizer of `tokenizer` (or
  `pretrained`). A checkpoint without a tokenizer.json (a .gguf file, bytes) is left as it is."""
  args = simple_parse_args_string(model_args) if isinstance(model_args, str) else dict(model_args or {})
  source = args.get("checkpoint") or args.get("pretrained")
  if not args.get("tokenizer") and isinstance(source, str) and source:
    directory = chat.tokenizer_dir(source)
    if directory:
      args["tokenizer"] = directory
  return args


@jax.jit
def _token_scores(logits, targets, scored):
  """logits [B, T, V], targets [B, T], scored bool [B, T] -> (sum of the scored targets' log-probabilities
  [B], whether each scored target is the argmax [B])."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  greedy = jnp.argmax(logits, axis=-1) == targets
  return jnp.where(scored, picked, 0.0).sum(-1), jnp.all(greedy | ~scored, axis=-1)


def stop_at(text: str, until: Sequence[str]) -> str:
  """The text before the first occurrence of any stop string (lm-eval's HF model's cut)."""
  for term in until:
    if term:
      text = text.split(term)[0]
  return text


class FotJaxLM(LM):
  """An fot_jax checkpoint as an lm-eval model, every request read with FoT memory (module docstring)."""

  def __init__(self, **model_args):
    super().__init__()
    self.settings = s = settings(model_args)
    overrides = {}
    layers = s.mem_layers
    if isinstance(layers, str) and layers.startswith("auto"):  # the retrieval-head probe picks them
      layers = heads.resolve_auto_layers(layers, s.checkpoint)
    if layers is not None:
      overrides["mem_layers"] = layers
    if s.dtype:
      overrides["dtype"] = s.dtype
    if s.attention_impl:
      overrides["attention_impl"] = s.attention_impl
    if s.rope_scaling:
      overrides["rope_scaling"] = s.rope_scaling
    try:
      self.model = from_pretrained(s.checkpoint, **overrides)
    except (ValueError, OSError) as e:
      _fail("rope_scaling" if s.rope_scaling and "rope_scaling" in str(e) else "checkpoint", cli.one_line(e))
    self.window = s.window or self.model.window
    if not self.window:
      _fail("window", f"{s.checkpoint} records no window; pass window=N")
    if s.last_context_length is not None and not s.last_context_length <= self.window:
      _fail("last_context_length", f"must be in 0..window ({self.window}), got {s.last_context_length}")
    if s.mode == "host":
      self.infer = HostMemoryInference(self.model.cfg, self.model.params, self.window, s.topk, s.host_index,
                                       s.nprobe)
    else:
      self.infer = MemoryInference(self.model.cfg, self.model.params, self.window, s.mode, s.topk)
    self.vocab = self.model.vocab
    self.bos, self.eos = int(self.vocab.bos_id), int(self.vocab.eos_id)
    self.batch_size, self.max_gen_toks = s.batch_size, s.max_gen_toks
    self._samples = 0  # sampled generation: each batch gets its own seed
    self._warned = set()
    how = {"dense": "dense", "topk": f"top-{s.topk}", "host": f"host {s.host_index} top-{s.topk}"}[s.mode]
    log.info("fot_jax: %s, window %d, memory layers %s, %s memory", s.checkpoint, self.window,
             list(self.model.cfg.mem_layers), how)

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None):
    return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None):
    """lm-eval passes its --batch_size / --device beside the model arguments; a model argument
    given both ways keeps the model_args value (lm-eval's own would raise a duplicate keyword)."""
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
    return cls(**{**extra, **arg_dict})

  # ---- text <-> tokens

  def tok_encode(self, text: str) -> List[int]:
    return [int(t) for t in self.vocab.encode(text)]

  def _with_bos(self, ids: List[int]) -> List[int]:
    """bos first, unless the text already began with it (a chat template that writes it)."""
    return ids if ids[:1] == [self.bos] else [self.bos] + ids

  def _decode(self, ids) -> str:
    """Generated ids up to eos -> text; a tokenizer.json's special tokens are dropped, as lm-eval's
    HF model decodes (skip_special_tokens)."""
    ids = [int(t) for t in ids]
    if self.eos in ids:
      ids = ids[:ids.index(self.eos)]
    if isinstance(self.vocab, HFVocab):
      return self.vocab.tokenizer.decode(ids, skip_special_tokens=True)
    return self.vocab.decode(ids)

  def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """As lm-eval's TemplateLM: trailing spaces of the context go to the continuation, the
    continuation's tokens are those of context + continuation past the context's; bos first."""
    if not context:
      return [self.bos], self.tok_encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
    return self._with_bos(ctx), whole[len(ctx):]

  # ---- scoring with memory

  def _score(self, seqs: Sequence[List[int]], n_scored: Sequence[int], end_aligned_tail: Optional[int]):
    """Each sequence read window by window with memory; its last n_scored tokens scored (each
    predicted from everything before it) -> [(sum of log-probabilities, all greedy)]. Windows are
    placed so that the input's last `end_aligned_tail` tokens share its last window (None: windows
    from token 0). Windows before any scored token only fill memory (up to the last memory layer)."""
    rows = [np.asarray(s[:-1], np.int32) for s in seqs]
    w = self.window
    toks, mask, pads = (end_aligned(rows, w, end_aligned_tail) if end_aligned_tail
                        else start_aligned(rows, w))
    targets = np.zeros_like(toks)
    scored = np.zeros_like(mask)
    for i, (s, p, n) in enumerate(zip(seqs, pads, n_scored)):
      targets[i, p:p + len(s) - 1] = s[1:]
      scored[i, p + len(s) - 1 - n:p + len(s) - 1] = True
    total, greedy = np.zeros(len(seqs)), np.ones(len(seqs), bool)
    if not scored.any():
      return list(zip(total.tolist(), greedy.tolist()))
    last = int(np.nonzero(scored.any(0))[0].max())
    memory = self.infer.new_memory(len(seqs))
    if self.infer.mode == "host":  # the windows through the host index; logits from the first scored one
      first_col = int(np.nonzero(scored.any(0))[0].min())  # the scored recall counts from this column on
      first, end = first_col // w * w, (last // w + 1) * w
      logits = self.infer.process(toks[:, :end], memory, mask[:, :end], logits_from=first_col)
      lp, gr = _token_scores(jnp.asarray(logits), jnp.asarray(targets[:, first:end]),
                             jnp.asarray(scored[:, first:end]))
      return list(zip(np.asarray(lp, np.float64).tolist(), np.asarray(gr).tolist()))
    layers = self.model.cfg.mem_layers
    args = (self.model.cfg, self.infer.mode, self.infer.topk, self.infer.chunk)
    for start in range(0, last + 1, w):
      cols = slice(start, start + w)
      needed = scored[:, cols].any()
      if not needed and not layers:  # no memory to fill
        continue
      tok, msk = jnp.asarray(toks[:, cols]), jnp.asarray(mask[:, cols])
      logits, mem_kv = forward_window(self.model.params, tok, msk, memory.blocks(), *args,
                                      None if needed else max(layers), self.infer.recall)
      if start + w <= last:  # a later window reads it
        memory.add(mem_kv, msk)
      if needed:
        lp, gr = _token_scores(logits, jnp.asarray(targets[:, cols]), jnp.asarray(scored[:, cols]))
        total += np.asarray(lp, np.float64)
        greedy &= np.asarray(gr)
    return list(zip(total.tolist(), greedy.tolist()))

  def _batches(self, items: Sequence, length, desc: str, disable: bool):
    """Indices of items, longest first, in batches of batch_size (similar lengths share a batch)."""
    order = sorted(range(len(items)), key=lambda i: -length(items[i]))
    bar = tqdm(total=len(items), desc=desc, disable=disable)
    for s in range(0, len(order), self.batch_size):
      batch = order[s:s + self.batch_size]
      yield batch
      bar.update(len(batch))
    bar.close()

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
    """(context, continuation) -> (log-probability of the continuation's tokens, whether greedy decoding
    produces them), the context read with memory and the input's last last_context_length tokens
    (default: the window) in its last window; 0 puts windows from token 0."""
    pairs = [self._encode_pair(*req.args) for req in requests]
    seqs = [ctx + cont for ctx, cont in pairs]
    tail = self.settings.last_context_length
    tail = self.window if tail is None else tail or None  # 0: windows from token 0, as in generation
    out: List = [None] * len(requests)
    for batch in self._batches(seqs, len, "fot_jax loglikelihood", disable_tqdm):
      scores = self._score([seqs[i] for i in batch], [len(pairs[i][1]) for i in batch], tail)
      for i, res in zip(batch, scores):
        out[i] = res
        self.cache_hook.add_partial("loglikelihood", requests[i].args, res)
    self._log_recall()
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
    """(text,) -> the log-probability of every token of the text after bos, read window by window
    from token 0 with every earlier window in memory (Pretrained.logits_with_memory's placement)."""
    seqs = [[self.bos] + self.tok_encode(req.args[0]) for req in requests]
    out: List = [None] * len(requests)
    for batch in self._batches(seqs, len, "fot_jax loglikelihood_rolling", disable_tqdm):
      scores = self._score([seqs[i] for i in batch], [len(seqs[i]) - 1 for i in batch], None)
      for i, (logp, _) in zip(batch, scores):
        out[i] = logp
        self.cache_hook.add_partial("loglikelihood_rolling", requests[i].args, logp)
    self._log_recall()
    return out

  def _log_recall(self):
    """mode=host with an approximate index: its recall@k against exact search so far, sampled and
    at the scored (or newest) positions (fot_jax.host_memory)."""
    if getattr(self.infer, "recall", None) is not None and self.infer.mode == "host":
      log.info("fot_jax host memory: recall@%d %.4f (sampled queries), %s at the scored positions",
               self.infer.topk, self.infer.recall,
               "-" if self.infer.scored_recall is None else f"{self.infer.scored_recall:.4f}")

  def _warn_once(self, key: str, message: str):
    if key not in self._warned:
      self._warned.add(key)
      log.warning(message)

  def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
    """(context, gen_kwargs) -> the continuation, from MemoryInference.generate (greedy unless
    do_sample with a temperature; top_p honoured), up to max_gen_toks, stopped at eos and cut at
    the first `until` string. Requests with the same gen_kwargs and similar lengths share a batch."""
    groups: Dict[str, List[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    prompts = [self._with_bos(self.tok_encode(req.args[0])) for req in requests]
    out: List = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="fot_jax generate_until", disable=disable_tqdm)
    for members in groups.values():
      kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
      until = [u for u in kwargs.pop("until") if isinstance(u, str)]
      new_tokens = int(kwargs.pop("max_gen_toks"))
      sample, temperature = kwargs.pop("do_sample", False), float(kwargs.pop("temperature", 0.0) or 0.0)
      temperature = temperature if sample else 0.0
      top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
      if kwargs:
        self._warn_once(",".join(sorted(kwargs)), f"fot_jax: generation ignores {sorted(kwargs)} (it takes "
                                                  f"until, max_gen_toks, do_sample, temperature, top_p)")
      order = sorted(members, key=lambda i: -len(prompts[i]))
      for s in range(0, len(order), self.batch_size):
        batch = order[s:s + self.batch_size]
        rows = [np.asarray(prompts[i], np.int32) for i in batch]
        done = self.infer.generate(rows, new_tokens, temperature, top_p, self.settings.seed + self._samples,
                                   last_context_length=self.settings.last_context_length, eos_token_id=self.eos)
        self._samples += 1
        for i, row, full in zip(batch, rows, done):
          out[i] = stop_at(self._decode(full[len(row):]), until)
          self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        bar.update(len(batch))
        self._log_recall()
    bar.close()
    return out

  # ---- chat templates (--apply_chat_template)

  @property
  def _chat_source(self):
    return self.settings.tokenizer or self.model

  @property
  def tokenizer_name(self) -> str:
    return str(chat.tokenizer_dir(self._chat_source) or self.settings.checkpoint).replace("/", "__")

  def chat_template(self, chat_template=False) -> Optional[str]:
    return chat.chat_template(self._chat_source) if chat_template else None

  def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
    return chat.chat_prompt(self._chat_source, chat_history, add_generation_prompt)


def register() -> None:
  """Registers FotJaxLM as lm-eval's model `fot_jax` (lazily, by its import path; once)."""
  if MODEL_NAME not in model_registry:
    model_registry.register(MODEL_NAME, target=TARGET)


register()


# RULER's sample generators in lm-eval 0.4.13 (module, function): each makes `num_samples` prompts
# (500 per length) in order from the random state lm-eval seeds, whatever --limit keeps
RULER_GENERATORS = (("niah_utils", "generate_samples"), ("vt_utils", "sys_vartrack_w_noise_random"),
                    ("cwe_utils", "sys_word_pair_random"), ("fwe_utils", "sys_kwext"))
RULER_SAMPLES = "--ruler_samples"


def cap_ruler_samples(n: int) -> None:
  """RULER's tasks make 500 prompts for each length before `--limit` keeps the first few: at 128K
  tokens that is most of an evaluation's time (each prompt built and tokenized, often twice). Caps
  every RULER generator at n prompts: the first n of the 500, since each draws its prompts one
  after the other from one random state (tests/test_lm_harness.py checks the prefix). n < 1 undoes it."""
  import importlib
  for module, name in RULER_GENERATORS:
    mod = importlib.import_module(f"lm_eval.tasks.ruler.{module}")
    original = getattr(getattr(mod, name), "__wrapped__", getattr(mod, name))
    if n < 1:
      setattr(mod, name, original)
      continue

    @functools.wraps(original)
    def capped(*args, _original=original, **kwargs):
      kwargs["num_samples"] = min(int(kwargs.get("num_samples", 500)), n)
      return _original(*args, **kwargs)
    setattr(mod, name, capped)


def _ruler_samples(argv: List[str]) -> List[str]:
  """Takes `--ruler_samples N` (or =N) out of lm-eval's command line and caps RULER's prompts at N."""
  out, it = [], iter(argv)
  for arg in it:
    if arg == RULER_SAMPLES or arg.startswith(RULER_SAMPLES + "="):
      value = arg.split("=", 1)[1] if "=" in arg else next(it, "")
      if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{RULER_SAMPLES}: expected a number of prompts >= 1, got {value!r}")
      cap_ruler_samples(int(value))
    else:
      out.append(arg)
  return out


def _check_layer_commas(argv: Sequence[str]) -> None:
  """`mem_layers=6,17` in --model_args: lm-eval's own parser would say only "expected `key=value`,
  got '17'" (commas separate model arguments), so the layers' separator is named first."""
  for i, a in enumerate(argv):
    if a == "--model_args" and i + 1 < len(argv):
      text = argv[i + 1]
    elif a.startswith("--model_args="):
      text = a[len("--model_args="):]
    else:
      continue
    pieces = text.split(",")
    for before, piece in zip(pieces, pieces[1:]):
      if before.strip().startswith("mem_layers=") and "=" not in piece:
        _fail("mem_layers", f"separate layers with '{LAYER_SEPARATOR}' (e.g. mem_layers=6{LAYER_SEPARATOR}17), "
                            f"not ',' (commas separate model_args), got {text!r}")


def main(argv: Optional[Sequence[str]] = None) -> None:
  """lm-eval's command line (`python -m lm_eval ...`) with the model `fot_jax` registered; for
  --model fot_jax, model_args get the checkpoint's tokenizer directory (with_tokenizer) and are
  checked (and the checkpoint path's existence) before lm-eval starts. `--ruler_samples N` (ours,
  not lm-eval's): RULER tasks make N prompts per length instead of 500 (`cap_ruler_samples`)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  with cli.expected_errors(PROG):
    setup_logging()
    # fot_jax's own lines (the model read, host memory's recall and timings) beside lm-eval's
    ours = logging.getLogger("fot_jax")
    if not ours.handlers:
      ours.setLevel(logging.getLogger("lm_eval").level)
      ours.handlers, ours.propagate = list(logging.getLogger("lm_eval").handlers), False
    argv = _ruler_samples(argv)
    _check_layer_commas(argv)
    parser = HarnessCLI()
    saved, sys.argv = sys.argv, ["lm-eval"] + argv  # lm-eval's parser reads sys.argv
    try:
      args = parser.parse_args()
    finally:
      sys.argv = saved
    if getattr(args, "command", None) == "run" and getattr(args, "model", None) == MODEL_NAME:
      args.model_args = with_tokenizer(args.model_args)
      checkpoint = settings(args.model_args).checkpoint
      if not os.path.exists(checkpoint):  # before lm-eval indexes its task files (over 10 s) and logs
        _fail("checkpoint", f"{checkpoint}: no such file or directory")
    parser.execute(args)


if __name__ == "__main__":
  main()
