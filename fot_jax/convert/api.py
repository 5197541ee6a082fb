"""import_hf / import_gguf / export_hf and the user-facing `from_pretrained` model object."""
from __future__ import annotations

import atexit
import os
import shutil
import warnings
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax import checkpoint
from fot_jax.checkpoint import Checkpoint, ConvertError, ensure_empty_dir, read_json
from fot_jax.convert import mapping
from fot_jax.convert.gguf_files import TensorReader, check_gguf, read_gguf
from fot_jax.convert.hf_files import WeightReader, keep_chat_template, parse_size, write_safetensors
from fot_jax.host_memory import HostMemoryInference
from fot_jax.inference import MemoryInference, _prompt_rows
from fot_jax.jsonio import write_json
from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MEMORY_MODES, READ_CHUNK

TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _hf_config_path(hf_dir: str) -> str:
  if not os.path.isdir(hf_dir):
    raise ConvertError(f"{hf_dir}: not a directory (expected a Hugging Face model directory)")
  return os.path.join(hf_dir, "config.json")


def load_hf(hf_dir: str, **overrides) -> Checkpoint:
  """Reads a Hugging Face LLaMA-family directory into memory as float32 fot_jax params.

  overrides: ModelConfig fields, e.g. mem_layers=(6, 12, 18), mem_positions='first',
  dtype='bfloat16' (compute dtype); LongLLaMA fields in config.json are used otherwise.
  """
  config_path = _hf_config_path(hf_dir)
  hf = read_json(config_path)
  cfg, window = mapping.model_config_from_hf(hf, config_path, **overrides)
  params = mapping.params_from_hf(WeightReader(hf_dir), cfg, config_path)
  tokenizer = checkpoint.find_tokenizer(hf_dir)
  if tokenizer:  # imported all the same (another vocabulary may be used); evaluation and export refuse it
    try:
      checkpoint.check_tokenizer_fits(tokenizer, cfg.vocab_size, config_path)
    except ConvertError as e:
      warnings.warn(str(e), stacklevel=2)
  meta = {"source": os.path.abspath(hf_dir), "hf": {k: hf[k] for k in TOKEN_ID_FIELDS if k in hf},
          "tokenizer": tokenizer}
  return Checkpoint(cfg, params, window, meta, os.path.abspath(hf_dir))


def _is_gguf(path: str) -> bool:
  return os.path.isfile(path) and path.lower().endswith(".gguf")


def load_gguf(path: str, **overrides) -> Checkpoint:
  """Reads a GGUF file (a LLaMA-architecture model, dequantized by transformers) into memory
  as float32 fot_jax params; its tokenizer becomes tokenizer.json (a temporary copy until
  saved). overrides: as load_hf."""
  hf, tensors, tok_dir = read_gguf(path)
  atexit.register(shutil.rmtree, tok_dir, True)
  cfg, window = mapping.model_config_from_hf(hf, path, **overrides)
  params = mapping.params_from_hf(TensorReader(tensors, path), cfg, path)
  meta = {"source": os.path.abspath(path), "hf": {k: hf[k] for k in TOKEN_ID_FIELDS if hf.get(k) is not None},
          "tokenizer": os.path.join(tok_dir, "tokenizer.json")}
  return Checkpoint(cfg, params, window, meta, os.path.abspath(path))


def import_hf(hf_dir: str, out: str, **overrides) -> Checkpoint:
  """HF directory -> fot_jax checkpoint at `out` (a new or empty directory)."""
  config_path = _hf_config_path(hf_dir)  # a wrong config fails before anything is created
  mapping.model_config_from_hf(read_json(config_path), config_path, **overrides)
  created = not os.path.exists(out)
  ensure_empty_dir(out)  # and a used output before gigabytes are read
  try:
    ck = load_hf(hf_dir, **overrides)
  except BaseException:  # unreadable weights: no empty output directory left behind
    if created and os.path.isdir(out) and not os.listdir(out):
      os.rmdir(out)
    raise
  checkpoint.save(out, ck.params, ck.cfg, ck.window, tokenizer=ck.tokenizer_path,
                  source=ck.meta["source"], hf=ck.meta["hf"])
  if ck.tokenizer_path and ck.tokenizer_path.endswith(".json"):  # a chat_template.jinja beside it
    keep_chat_template(os.path.dirname(ck.tokenizer_path), out)
  return ck


def import_gguf(gguf: str, out: str, **overrides) -> Checkpoint:
  """GGUF file -> fot_jax checkpoint at `out` (a new or empty directory), with tokenizer.json."""
  check_gguf(gguf)  # a refused file fails before anything is created
  ensure_empty_dir(out)
  ck = load_gguf(gguf, **overrides)
  try:
    checkpoint.save(out, ck.params, ck.cfg, ck.window, tokenizer=ck.tokenizer_path,
                    source=ck.meta["source"], hf=ck.meta["hf"])
  finally:
    shutil.rmtree(os.path.dirname(ck.tokenizer_path), ignore_errors=True)  # the temporary tokenizer copy
  return checkpoint.load(out)


def _override(ck: Checkpoint, overrides: dict, path: str) -> Checkpoint:
  """ModelConfig fields over a loaded checkpoint's (another compute dtype or other memory layers
  over the same weights), checked against its parameters."""
  overrides = {k: v for k, v in overrides.items() if v is not None}
  if not overrides:
    return ck
  if overrides.get("mem_layers") == "all":
    overrides["mem_layers"] = range(ck.cfg.num_layers)
  try:
    ck.cfg = ModelConfig.from_dict(overrides, path, base=ck.cfg)
  except ValueError as e:
    raise ConvertError(str(e)) from None
  checkpoint.check_params(ck.params, ck.cfg, path)
  return ck


def load_any(path: str, **overrides) -> Checkpoint:
  """An fot_jax checkpoint (imported or a training workdir), a Hugging Face directory or a GGUF file.
  overrides: ModelConfig fields; mem_layers='all' puts memory in every layer."""
  every = overrides.get("mem_layers") == "all"
  first = dict(overrides, mem_layers=None) if every else overrides  # 'all' needs the layer count
  if _is_gguf(path):
    ck = load_gguf(path, **first)
  elif os.path.isfile(os.path.join(path, checkpoint.MODEL_JSON)):
    return _override(checkpoint.load(path), overrides, path)
  elif os.path.isfile(os.path.join(path, "config.json")):
    ck = load_hf(path, **first)
  else:  # a run's workdir holds its arms' checkpoints one level down (W/fot, W/no_crossbatch)
    arms = sorted(d for d in (os.listdir(path) if os.path.isdir(path) else ())
                  if os.path.isfile(os.path.join(path, d, checkpoint.MODEL_JSON)))
    raise ConvertError(f"{path}: neither an fot_jax checkpoint ({checkpoint.MODEL_JSON}), a "
                       f"Hugging Face directory (config.json) nor a .gguf file" +
                       (f"; it is a run's workdir: load one arm, e.g. {os.path.join(path, arms[0])}" if arms else ""))
  return _override(ck, {"mem_layers": "all"}, path) if every else ck


def _write_tokenizer(src: str, out: str, window: int) -> None:
  if checkpoint.copy_tokenizer(src, out).endswith(".json"):  # Hugging Face tokenizers
    config_path = os.path.join(out, checkpoint.HF_TOKENIZER_CONFIG)
    config = read_json(config_path) if os.path.isfile(config_path) else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config["model_max_length"] = window
    write_json(config_path, config)
    return
  special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
  write_json(os.path.join(out, "tokenizer_config.json"),
             {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
              "model_max_length": window, **special})
  write_json(os.path.join(out, "special_tokens_map.json"), special)


def export_hf(source: Union[str, Checkpoint], out: str, dtype: str = "float32", max_shard_size="5GB",
              fot_jax_only: bool = False, window: Optional[int] = None, tokenizer: Optional[str] = None,
              mem_dtype: str = "bfloat16") -> str:
  """fot_jax checkpoint -> a directory LlamaForCausalLM.from_pretrained loads (LongLLaMA fields included).

  window: HF max_position_embeddings / LongLLaMA last_context_length (default: the
  checkpoint's window). tokenizer: a SentencePiece model or a tokenizer.json to ship (default: the
  tokenizer file a training workdir records it trained with, else the one the checkpoint ships).
  """
  ck = source if isinstance(source, Checkpoint) else checkpoint.load(source)
  extras = mapping.non_llama_params(ck.cfg)
  if extras and not fot_jax_only:
    raise ConvertError(f"{ck.path}: the model has parameters plain LLaMA lacks ({', '.join(extras)}); "
                       f"LlamaForCausalLM would drop them. Pass --fot_jax_only for an export only "
                       f"fot_jax reads back")
  window = window or ck.window
  if not window:
    raise ConvertError(f"{ck.path}: the checkpoint does not record its window; pass --window")
  trained_with = ck.meta.get("vocab")  # what training records (`data.vocab`): a file, 'byte', ...
  if not (isinstance(trained_with, str) and trained_with.endswith((".json", ".model"))
          and os.path.isfile(trained_with)):
    trained_with = None
  tokenizer = tokenizer or trained_with or ck.tokenizer_path
  if tokenizer and not os.path.isfile(tokenizer):
    raise ConvertError(f"{tokenizer}: tokenizer file not found")
  if tokenizer:  # a tokenizer with ids past the embedding would index rows the export lacks
    checkpoint.check_tokenizer_fits(tokenizer, ck.cfg.vocab_size, ck.path)
  if ck.meta.get("vocab") == "byte" and not tokenizer:
    warnings.warn(f"{ck.path}: trained on the byte vocabulary, which Hugging Face has no tokenizer file "
                  f"for; the export ships none", stacklevel=2)
  max_bytes = parse_size(max_shard_size)
  ensure_empty_dir(out)
  write_safetensors(out, mapping.hf_tensors(ck.params, ck.cfg), dtype, max_bytes)
  config = mapping.hf_config(ck.cfg, int(window), dtype, mem_dtype, fot_jax_only, ck.meta.get("hf"))
  write_json(os.path.join(out, "config.json"), config, indent=2)
  if tokenizer:
    _write_tokenizer(tokenizer, out, int(window))
  if ck.cfg.mem_positions == "none":
    warnings.warn(f"{ck.path}: mem_positions='none' (memory layers without RoPE) is exported as LongLLaMA's "
                  f"mem_positionals=false; plain LlamaForCausalLM applies RoPE in every layer and so "
                  f"differs from this model (fot_jax.convert.torch_reference follows it)", stacklevel=2)
  return out


class Pretrained:
  """A loaded model: `.logits`, `.logits_with_memory`, `.generate`, `.save_hf`, `.save`, `.vocab`.

  cfg (ModelConfig), params (float32 tree), window (local window for memory inference).
  Prompts are token ids or text (a string, or a list of strings as a batch): text is encoded
  with the model's vocabulary (`encode`) and `generate` answers text with text (`decode`).
  """

  def __init__(self, ck: Checkpoint):
    self.checkpoint = ck
    self.cfg, self.window = ck.cfg, ck.window
    self.params = jax.tree_util.tree_map(jnp.asarray, ck.params)
    self._forward = None
    self._vocab = None
    self._warned_no_memory = False

  def vocabulary(self, spec: str = ""):
    """The seqio vocabulary of this model (data_pipelines.vocab): `spec` when given, else the one
    it was trained with or the tokenizer it ships; checked to fit the embedding."""
    from data_pipelines import vocab as vocab_lib
    ck = self.checkpoint
    spec = vocab_lib.checkpoint_vocab_spec(ck.path, ck.meta, ck.tokenizer_path, spec)
    vocab = vocab_lib.get_vocabulary(spec)
    vocab_lib.check_fits(vocab.vocab_size, self.cfg.vocab_size, f"vocabulary {spec}", ck.path)
    return vocab

  @property
  def vocab(self):
    """The model's own vocabulary (see `vocabulary`), loaded once."""
    if self._vocab is None:
      self._vocab = self.vocabulary()
    return self._vocab

  def _text_vocab(self):
    """-> (the vocabulary text goes through, whether it is a Hugging Face tokenizer.json: an HFVocab,
    whose `.tokenizer` is the `tokenizers` object). The spec is the one `vocabulary` picks (the
    vocabulary trained with, else the tokenizer shipped); a checkpoint without one, or with an
    ids-only one, fails naming what to pass instead."""
    ck = self.checkpoint
    spec = str(ck.meta.get("vocab") or ck.tokenizer_path or "")
    if not spec:
      raise ValueError(f"{ck.path}: text needs a tokenizer and this checkpoint has none (no tokenizer.json or "
                       f"tokenizer.model, no 'vocab' in its {checkpoint.MODEL_JSON}); pass token ids, or load it "
                       f"with fot_jax.from_pretrained({ck.path!r}, vocab='byte' or a tokenizer.json / "
                       f"tokenizer.model path)")
    if spec == "dictionary_lookup":
      raise ValueError(f"{ck.path}: its vocabulary ({spec}) is token ids, not text; pass token ids")
    return self.vocab, spec.endswith(".json")

  def encode(self, text: str, bos: Optional[bool] = None) -> np.ndarray:
    """text -> int32 ids as the model reads a text prompt. bos=None: as Hugging Face's tokenizer
    encodes the text (a tokenizer.json: its own post-processor decides, so SmolLM2's adds no bos
    and a LLaMA tokenizer.json's adds <s>); a SentencePiece or byte vocabulary (LLaMA's tokenizer,
    fot_jax's training streams) gets bos first. bos=True / False: bos first or not, whatever the
    tokenizer does."""
    if not isinstance(text, str):
      raise ValueError(f"encode: expected a string, got {type(text).__name__}")
    vocab, hf = self._text_vocab()
    if bos is None and hf:  # add_special_tokens=True: the tokenizer's post-processor, as transformers
      return np.asarray(vocab.tokenizer.encode(text).ids, np.int32)
    ids = [int(i) for i in vocab.encode(text)]
    return np.asarray(([int(vocab.bos_id)] if bos is not False else []) + ids, np.int32)

  def decode(self, ids) -> str:
    """ids -> text with the special tokens (bos, eos, pad, a tokenizer.json's special tokens) left
    out, as transformers' decode(ids, skip_special_tokens=True)."""
    vocab, hf = self._text_vocab()
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if hf:
      return vocab.tokenizer.decode(ids, skip_special_tokens=True)
    special = {int(i) for i in (vocab.bos_id, vocab.eos_id, vocab.pad_id) if i is not None and i >= 0}
    return vocab.decode([i for i in ids if i not in special])

  def _texts(self, prompt, what: str) -> Optional[list]:
    """A string or a list of strings -> that list; token ids -> None."""
    if isinstance(prompt, str):
      return [prompt]
    if isinstance(prompt, (list, tuple)) and prompt and any(isinstance(p, str) for p in prompt):
      if not all(isinstance(p, str) for p in prompt):
        raise ValueError(f"{what}: a list of prompts must be all strings or all token ids")
      return list(prompt)
    return None

  def _ids(self, tokens, what: str) -> np.ndarray:
    """Token ids [B, T], or text (a string: one row; a list of strings that encode to one length)."""
    texts = self._texts(tokens, what)
    if texts is None:
      return np.asarray(tokens, np.int32)
    rows = [self.encode(t) for t in texts]
    lens = sorted({len(r) for r in rows})
    if len(lens) > 1:
      raise ValueError(f"{what}: the texts encode to different lengths ({', '.join(map(str, lens))} tokens); "
                       f"pass them one at a time, or ids with a token_mask")
    if not lens[0]:
      raise ValueError(f"{what}: the text encodes to no tokens")
    return np.stack(rows)

  def _no_memory_notice(self, reads_memory: bool, window: int) -> None:
    """One warning per object when a call that would read memory (input past one window) runs on a
    model without memory layers: the earlier windows are dropped, not read (Python's warnings:
    stacklevel 3 names the line that called logits_with_memory / generate)."""
    if self.cfg.mem_layers or self._warned_no_memory or not reads_memory:
      return
    self._warned_no_memory = True
    n = self.cfg.num_layers
    example = tuple(sorted({min(n - 1, n * k // 4) for k in (1, 2, 3)}))
    path = self.checkpoint.path
    warnings.warn(f"{path}: this model has no memory layers (mem_layers=()): memory is not read, attention "
                  f"sees only the local window of {window} tokens; load with fot_jax.from_pretrained({path!r}, "
                  f"mem_layers={example}) (or mem_layers='all') to add them", stacklevel=3)

  def logits(self, tokens) -> np.ndarray:
    """tokens int [B, T] (or text: see `_ids`) -> float32 [B, T, V]: one plain causal pass,
    positions 0..T-1."""
    tokens = self._ids(tokens, "logits")
    if self._forward is None:
      model = LlamaModel(self.cfg)
      self._forward = jax.jit(lambda p, t: model.apply({"params": p}, t)[0])
    return np.asarray(self._forward(self.params, jnp.asarray(tokens)))

  def _inference(self, window, mode, topk, chunk, mem_dtype):
    window = window or self.window
    if not window:
      raise ValueError("window: this checkpoint records no window; pass window=")
    if mode not in MEMORY_MODES + ("host",):
      raise ValueError(f"mode: must be one of {', '.join(MEMORY_MODES + ('host',))}, got {mode!r}")
    if mode == "host":  # each query's top-k from a faiss index on the host (fot_jax.host_memory): long prompts
      return HostMemoryInference(self.cfg, self.params, window, topk)
    return MemoryInference(self.cfg, self.params, window, mode, topk, chunk, mem_dtype)

  def logits_with_memory(self, tokens, window: Optional[int] = None, mode: str = "dense", topk: int = 32,
                         token_mask=None, chunk: int = READ_CHUNK, mem_dtype=None) -> np.ndarray:
    """FoT memory inference (fot_jax.inference): windows of `window` tokens, earlier windows'
    memory-layer keys/values in memory. tokens [B, L] (or text: see `_ids`) -> [B, L, V]. mode: a
    device memory mode (fot_jax.model.memory) or 'host' (top-k from a faiss index on the host,
    fot_jax.host_memory; generate takes it too)."""
    infer = self._inference(window, mode, topk, chunk, mem_dtype)
    tokens = self._ids(tokens, "logits_with_memory")
    self._no_memory_notice(tokens.shape[-1] > infer.window, infer.window)
    return infer.process(tokens, infer.new_memory(tokens.shape[0]), token_mask)

  def generate(self, prompt, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, window: Optional[int] = None, mode: str = "dense", topk: int = 32,
               chunk: int = READ_CHUNK, mem_dtype=None, last_context_length: Optional[int] = None,
               eos_token_id=None):
    """prompt: 1-D tokens, [B, L] tokens or a list of 1-D prompts -> the same form with
    max_new_tokens appended; greedy (temperature 0) or sampled (temperature, top_p), with a
    key/value cache of the current window and memory of the earlier ones (mode 'host': in a faiss
    index on the host, ivf with nprobe 8); the prompt's last
    `last_context_length` tokens in the current window (MemoryInference.generate; 0: windows
    from token 0, as logits_with_memory); a row stops at `eos_token_id` (one id or several;
    the rest of its tokens are that id). Timings and tokens/s: `self.generation_stats`.

    Text: a string (or a list of strings, a batch) is encoded (`encode`) and answered with the
    continuation only, up to its first stop token, decoded without special tokens (`decode`);
    for text eos_token_id defaults to the vocabulary's eos (() generates all max_new_tokens)."""
    texts, single = self._texts(prompt, "generate"), isinstance(prompt, str)
    if texts is not None:
      rows = [self.encode(t) for t in texts]
      empty = [t for t, r in zip(texts, rows) if not len(r)]
      if empty:
        raise ValueError(f"generate: the prompt {empty[0]!r} encodes to no tokens")
      prompt = rows
      if eos_token_id is None:
        eos_token_id = int(self.vocab.eos_id)
    infer = self._inference(window, mode, topk, chunk, mem_dtype)
    # Memory is read when a row's first tokens fall before its last window (end-aligned: more than
    # last_context_length tokens; as MemoryInference.generate places them) or decoding (the prompt
    # and max_new_tokens - 1 fed tokens) runs past the window.
    w = infer.window
    lcl = w - min(max_new_tokens, w // 2) if last_context_length is None else last_context_length
    lens = [len(r) for r in _prompt_rows(prompt)[0]]
    self._no_memory_notice(bool(lcl) and max(lens) > lcl or max(lens) + max_new_tokens - 1 > w, w)
    out = infer.generate(prompt, max_new_tokens, temperature, top_p, seed,
                         last_context_length=last_context_length, eos_token_id=eos_token_id)
    self.generation_stats = infer.stats
    if texts is None:
      return out
    stops = {int(e) for e in np.atleast_1d(eos_token_id)}
    answers = []
    for row, full in zip(rows, out):
      new = [int(t) for t in full[len(row):]]
      answers.append(self.decode(new[:next((i for i, t in enumerate(new) if t in stops), len(new))]))
    return answers[0] if single else answers

  def save_hf(self, out: str, **kwargs) -> str:
    """See export_hf (dtype, max_shard_size, fot_jax_only, window, tokenizer, mem_dtype)."""
    return export_hf(self.checkpoint, out, **kwargs)

  def save(self, out: str) -> None:
    """Writes an fot_jax checkpoint (what `init_from` reads), with its tokenizer."""
    ck = self.checkpoint
    checkpoint.save(out, ck.params, ck.cfg, ck.window, tokenizer=ck.tokenizer_path,
                    **{k: v for k, v in ck.meta.items() if k != "tokenizer"})


def from_pretrained(path: str, vocab: Optional[str] = None, **overrides) -> Pretrained:
  """An HF LLaMA directory, a LLaMA GGUF file or an fot_jax checkpoint -> Pretrained.
  overrides: ModelConfig fields such as mem_layers, mem_positions, dtype. vocab: the vocabulary
  ('byte', a tokenizer.json or SentencePiece model path) for a checkpoint that records none or
  another one; `save` and `save_hf` then record and ship it."""
  ck = load_any(path, **overrides)
  if vocab:  # a file as an absolute path: the spec outlives the working directory (save records it)
    path_like = os.path.expanduser(str(vocab))
    ck.meta["vocab"] = os.path.abspath(path_like) if os.path.isfile(path_like) else str(vocab)
  return Pretrained(ck)
