"""Hugging Face LLaMA <-> fot_jax: config fields and parameter names.

fot_jax's RoPE uses the HF "rotate half" layout, so a weight converts by a
rename, plus a transpose for linear layers (HF stores [out, in], Flax [in, out]).
LongLLaMA's config fields map to ModelConfig as follows (see docs/interop.md):
  mem_layers -> mem_layers (0-based in both), mem_positionals True/False ->
  mem_positions 'first'/'none', max_position_embeddings -> the inference window.
RoPE scaling (rope_scaling / rope_parameters) -> ModelConfig.rope_scaling: rope_from_hf,
rope_to_hf (docs/context_extension.md).
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

from fot_jax.checkpoint import ConvertError
from fot_jax.model.config import ModelConfig
from fot_jax.model.init import param_shapes
from fot_jax.model.rope import VARIANTS, scaling_tuple

LLAMA_TYPES = ("llama", "longllama")
MOE_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


def rope_from_hf(hf: dict, source: str) -> Tuple[float, tuple]:
  """config.json -> (rope_theta, ModelConfig.rope_scaling), resolved as transformers resolves it.

  Both spellings: `rope_scaling` (+ top-level `rope_theta`, transformers 4.x) and
  `rope_parameters` (transformers 5.x, theta inside); `rope_scaling` wins when both are set,
  as in transformers. Defaults transformers fills in are made explicit: yarn/llama3's
  original_max_position_embeddings (top-level field, else max_position_embeddings), yarn's
  factor (max_position_embeddings / original). HF's dynamic NTK measures the length against
  max_position_embeddings; fot_jax keeps that as original_max_position_embeddings, since its
  window is a separate thing. A config exported from fot_jax's frozen NTK ('ntk', a plain RoPE
  with a raised base) carries `fot_jax_rope`, which restores the variant.
  """
  params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
  theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
  if any(isinstance(v, dict) for v in params.values()):
    raise ConvertError(f"{source}: per-layer-type RoPE parameters are not supported (LLaMA has one RoPE)")
  if params.pop("partial_rotary_factor", 1.0) != 1.0:
    raise ConvertError(f"{source}: partial_rotary_factor != 1 is not supported (LLaMA rotates the whole head)")
  kind = params.get("rope_type", params.get("type")) or "default"
  params["rope_type"] = kind
  params.pop("type", None)
  mpe = hf.get("max_position_embeddings", 2048)
  if kind in ("yarn", "llama3"):
    params["original_max_position_embeddings"] = (hf.get("original_max_position_embeddings")
                                                  or params.get("original_max_position_embeddings") or mpe)
  if kind == "yarn" and params.get("factor") is None:
    params["factor"] = mpe / params["original_max_position_embeddings"]
  if kind == "dynamic":
    params["original_max_position_embeddings"] = mpe
  if kind in VARIANTS:  # keys transformers ignores (with a warning) are dropped here too
    unused = sorted(set(params) - {"rope_type", *VARIANTS[kind][0], *VARIANTS[kind][1]})
    if unused:
      warnings.warn(f"{source}: RoPE keys {unused} are not used by rope_type {kind!r}; ignored")
      params = {k: v for k, v in params.items() if k not in unused}
  frozen = hf.get("fot_jax_rope") or {}
  if kind == "default" and frozen.get("rope_type") == "ntk":
    d = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if math.isclose(frozen["rope_theta"] * frozen["factor"] ** (d / (d - 2)), theta, rel_tol=1e-12):
      theta, params = float(frozen["rope_theta"]), {"rope_type": "ntk", "factor": frozen["factor"]}
  return theta, scaling_tuple(params)


def rope_to_hf(cfg: ModelConfig, window: int) -> dict:
  """config.json fields of cfg's RoPE: both spellings, so transformers 4.x and 5.x read it."""
  p = dict(cfg.rope_scaling)
  kind, theta = p.pop("rope_type", "default"), cfg.rope_theta
  out = {"max_position_embeddings": window}
  if kind == "ntk":  # transformers has no frozen NTK: it is plain RoPE with the raised base
    out["fot_jax_rope"] = {"rope_type": "ntk", "factor": p["factor"], "rope_theta": theta}
    d = cfg.dim_per_head
    theta, kind, p = theta * p["factor"] ** (d / (d - 2)), "default", {}
  if kind == "dynamic":  # transformers measures the length against max_position_embeddings
    out["max_position_embeddings"] = p.pop("original_max_position_embeddings")
  scaling = {"rope_type": kind, **p}
  out.update(rope_theta=theta, rope_parameters={**scaling, "rope_theta": theta})
  if kind != "default":
    out["rope_scaling"] = scaling
  return out


def check_llama_like(hf: dict, source: str) -> None:
  """Refuses configs fot_jax's decoder cannot reproduce, naming the field."""
  model_type = hf.get("model_type")
  moe = [k for k in MOE_FIELDS if hf.get(k)]
  if model_type not in LLAMA_TYPES or moe:
    what = f"mixture-of-experts fields {moe}" if moe else f"model_type {model_type!r}"
    raise ConvertError(f"{source}: {what} is not a LLaMA-like dense decoder; fot_jax converts "
                       f"model_type {LLAMA_TYPES} without experts")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConvertError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (LLaMA uses 'silu')")
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      raise ConvertError(f"{source}: {field}=true is not supported (fot_jax layers have no biases)")


HF_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "last_context_length",
                 "original_max_position_embeddings")
HF_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
HF_BOOL_FIELDS = ("tie_word_embeddings", "mem_positionals", "attention_bias", "mlp_bias")


def _is_int(v) -> bool:  # 8, 8.0 (and NumPy's), not True or "8"
  if isinstance(v, bool):
    return False
  return isinstance(v, numbers.Integral) or (isinstance(v, numbers.Real) and float(v).is_integer())


def check_hf_types(hf: dict, source: str) -> None:
  """The config.json fields fot_jax reads have JSON types it can use (a size is a number, not
  "big"); the error names the file and the field."""
  def fail(field, want):
    raise ConvertError(f"{source}: {field} must be {want}, got {hf[field]!r}")
  for field in HF_INT_FIELDS:
    if hf.get(field) is not None and not _is_int(hf[field]):
      fail(field, "an integer")
  for field in HF_FLOAT_FIELDS:
    v = hf.get(field)
    if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
      fail(field, "a number")
  for field in HF_BOOL_FIELDS:
    if hf.get(field) is not None and not isinstance(hf[field], bool) and hf[field] not in (0, 1):
      fail(field, "true or false")
  v = hf.get("mem_layers")
  if v is not None and not (isinstance(v, list) and all(_is_int(x) for x in v)):
    fail("mem_layers", "a list of layer numbers")
  for field in ("rope_scaling", "rope_parameters", "fot_jax"):
    if hf.get(field) is not None and not isinstance(hf[field], dict):
      fail(field, "an object")


def model_config_from_hf(hf: dict, source: str, **overrides) -> Tuple[ModelConfig, int]:
  """config.json dict -> (ModelConfig, inference window). overrides: ModelConfig fields
  (e.g. mem_layers, mem_positions) that win over what the file says."""
  check_llama_like(hf, source)
  check_hf_types(hf, source)
  try:
    return _model_config_from_hf(hf, source, overrides)
  except ConvertError:
    raise
  except (TypeError, ValueError) as e:  # e.g. a RoPE parameter of the wrong type
    raise ConvertError(f"{source}: {e}") from None


def _model_config_from_hf(hf: dict, source: str, overrides: dict) -> Tuple[ModelConfig, int]:
  try:
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = hf.get("head_dim")
    fields = dict(
        vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=None if head_dim in (None, hidden // heads) else int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mem_layers=tuple(int(x) for x in hf.get("mem_layers") or ()),
        mem_positions="first" if hf.get("mem_positionals", True) else "none")
    fields["rope_theta"], fields["rope_scaling"] = rope_from_hf(hf, source)
  except KeyError as e:
    raise ConvertError(f"{source}: missing field {e.args[0]}") from None
  extras = hf.get("fot_jax") or {}
  fields.update(mem_qk_norm=bool(extras.get("mem_qk_norm", False)),
                mem_gating=bool(extras.get("mem_gating", False)))
  fields.update({k: v for k, v in overrides.items() if v is not None})
  try:
    cfg = ModelConfig.from_dict(fields, source)
  except ValueError as e:
    raise ConvertError(str(e)) from None
  window = hf.get("max_position_embeddings", 2048)
  if cfg.rope_type == "dynamic":  # max_position_embeddings is NTK's reference there (rope_to_hf)
    window = hf.get("last_context_length") or window
  return cfg, int(window)


def hf_config(cfg: ModelConfig, window: int, dtype: str, mem_dtype: str, fot_jax_extras: bool,
              extra: Optional[dict] = None) -> dict:
  """config.json for LlamaForCausalLM, plus LongLLaMA's memory fields (ignored by plain LLaMA)."""
  out = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
      "head_dim": cfg.dim_per_head, "hidden_act": "silu", **rope_to_hf(cfg, window),
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "dtype": dtype, "torch_dtype": dtype, "use_cache": True,
      # LongLLaMA fields.
      "mem_layers": list(cfg.mem_layers), "mem_positionals": cfg.mem_positions == "first",
      "last_context_length": window, "mem_dtype": mem_dtype, "mem_attention_grouping": None,
      "torch_attention": False,
  }
  out.update(extra or {})
  if fot_jax_extras:
    out["fot_jax"] = {"mem_qk_norm": cfg.mem_qk_norm, "mem_gating": cfg.mem_gating}
  return out


def non_llama_params(cfg: ModelConfig):
  """Names of the ModelConfig options that add parameters plain LLaMA lacks."""
  return [name for name in ("mem_qk_norm", "mem_gating") if getattr(cfg, name)]


# fot_jax-only parameters start as attention.py initialises them when the source lacks them.
FOT_ONLY_INIT = {
    "inv_temperature": lambda cfg: np.full((cfg.num_heads,), cfg.dim_per_head ** 0.5, np.float32),
    "mem_gate": lambda cfg: np.zeros((cfg.num_heads,), np.float32),
}


def tensor_map(cfg: ModelConfig) -> Iterator[Tuple[str, Tuple[str, ...], bool]]:
  """(HF name, fot_jax param path, transpose) for every parameter of `cfg`."""
  yield "model.embed_tokens.weight", ("embed_tokens", "embedding"), False
  for i in range(cfg.num_layers):
    hf, fj = f"model.layers.{i}.", f"layers_{i}"
    for n in ("q", "k", "v", "o"):
      yield f"{hf}self_attn.{n}_proj.weight", (fj, "self_attn", f"{n}_proj", "kernel"), True
    for n in ("gate", "up", "down"):
      yield f"{hf}mlp.{n}_proj.weight", (fj, "mlp", f"{n}_proj", "kernel"), True
    for n in ("input_layernorm", "post_attention_layernorm"):
      yield f"{hf}{n}.weight", (fj, n, "weight"), False
    if i in cfg.mem_layers:  # fot_jax-only parameters (exported only on request)
      if cfg.mem_qk_norm:
        yield f"{hf}self_attn.inv_temperature", (fj, "self_attn", "inv_temperature"), False
      if cfg.mem_gating:
        yield f"{hf}self_attn.mem_gate", (fj, "self_attn", "mem_gate"), False
  yield "model.norm.weight", ("norm", "weight"), False
  if not cfg.tie_embeddings:
    yield "lm_head.weight", ("lm_head", "kernel"), True


def _set(tree: dict, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_from_hf(reader, cfg: ModelConfig, source: str) -> dict:
  """Reads every tensor of `cfg` from `reader` (hf_files.WeightReader) into a param tree."""
  shapes = param_shapes(cfg)
  known = set()
  params = {}
  for name, path, transpose in tensor_map(cfg):
    known.add(name)
    if path[-1] in FOT_ONLY_INIT and name not in reader.files:  # plain LLaMA -> FoT with these options
      _set(params, path, FOT_ONLY_INIT[path[-1]](cfg))
      continue
    raw = reader.get(name)
    arr = raw.T if transpose else raw
    if tuple(arr.shape) != shapes[path]:
      raise ConvertError(f"{reader.files[name]}: tensor {name} has shape {tuple(raw.shape)}, "
                         f"but {source} implies {shapes[path][::-1] if transpose else shapes[path]}; "
                         f"the config does not match the weights")
    _set(params, path, np.ascontiguousarray(arr, np.float32))
  if cfg.tie_embeddings:
    known.add("lm_head.weight")  # some tied checkpoints still store the copy
  for name in reader.names():
    if name not in known and not name.endswith(IGNORED_SUFFIXES):
      raise ConvertError(f"{reader.files[name]}: tensor {name} has no place in the LLaMA decoder that "
                         f"{source} describes (not LLaMA-like, or a config field is missing)")
  return params


def hf_tensors(params: dict, cfg: ModelConfig) -> Dict[str, np.ndarray]:
  """fot_jax param tree -> {HF name: float32 array}."""
  out = {}
  for name, path, transpose in tensor_map(cfg):
    node = params
    for key in path:
      node = node[key]
    arr = np.asarray(node, np.float32)
    out[name] = np.ascontiguousarray(arr.T if transpose else arr)
  return out
