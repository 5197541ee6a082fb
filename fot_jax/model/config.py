"""Model hyperparameters and the named sizes used across fot_jax."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional, Tuple

from fot_jax.model import position_strategies, rope

MEM_POSITIONS = ("first", "none")
ATTENTION_IMPLS = ("dense", "blockwise", "fused")
CONTEXT_PARALLEL = ("ring", "allgather", "ulysses")  # fot_jax.model.context_parallel
CONTEXT_LAYOUTS = ("contiguous", "striped", "zigzag")
REMAT_POLICIES = ("full", "dots")  # fot_jax/model/llama.py: what a remat layer saves


class BlockSpec(NamedTuple):
  """'blocks' mode (docs/block_memory.md): memory in blocks of block_size slots, each represented
  by block_reps of its keys; a window's queries attend to the block_topk best blocks. The model
  takes it as mem_topk (a hashable tuple: static under jit and remat)."""
  block_size: int = 128
  block_reps: int = 16  # InfLLM uses 4 (chosen by attention received); 16 measured better here
  block_topk: int = 8

  def checked(self) -> "BlockSpec":
    for name, value in self._asdict().items():
      if value <= 0 or int(value) != value:
        raise ValueError(f"inference.{name}: must be a positive integer, got {value!r}")
    return BlockSpec(*map(int, self))  # NumPy integers hash as the same static argument


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A LLaMA decoder; `mem_layers` are the FoT memory layers (0-based)."""
  vocab_size: int = 32000
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: Optional[int] = None  # None: multi-head attention
  head_dim: Optional[int] = None  # None: hidden_size // num_heads
  rope_theta: float = 10000.0
  # RoPE scaling as config.json's rope_scaling / rope_parameters spells it, e.g.
  # {"rope_type": "llama3", "factor": 8.0, ...}; kept as sorted (key, value) pairs so the config
  # stays hashable (a static jit argument). () is plain RoPE. Variants: fot_jax/model/rope.py.
  rope_scaling: Tuple[Tuple[str, Any], ...] = ()
  # Inference-time position/mask strategy of the local attention, e.g. {"kind": "self_extend",
  # "window": 1024, "group": 64}; () = plain attention. See fot_jax/model/position_strategies.py.
  position_strategy: Tuple[Tuple[str, Any], ...] = ()
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  dtype: str = "float32"  # compute dtype; parameters stay float32
  remat: bool = False
  # With remat: 'full' saves each layer's input only (least memory), 'dots' also the matmul
  # outputs without batch dimensions (less recompute, more memory). docs/scan_and_remat.md.
  remat_policy: str = "full"
  # Plain forwards run each run of consecutive non-memory layers as one lax.scan over their
  # stacked weights (one layer's weights gathered at a time, one compiled body); the parameter
  # tree stays per layer. docs/scan_and_remat.md.
  scan_layers: bool = False
  init_std: float = 0.02  # normal init of every weight matrix
  embed_init_std: Optional[float] = None  # embedding init; None: init_std
  # FoT memory layers.
  mem_layers: Tuple[int, ...] = ()
  mem_positions: str = "first"  # 'first' (LongLLaMA) or 'none' (paper analysis)
  mem_qk_norm: bool = False  # q/k normalisation + learnable per-head temperature
  mem_gating: bool = False  # Memorizing-Transformer gate instead of concatenation
  mem_stop_gradient: bool = False  # non-differentiable extra contexts (ablation)
  # Score/softmax implementation (fot_jax.model.attention_ops): 'dense' (reference),
  # 'blockwise' (key blocks of attention_block, O(T x block) scores in both passes),
  # 'fused' (the backend's kernel where it has one, blockwise elsewhere).
  attention_impl: str = "dense"
  attention_block: int = 512
  # Sequence parallelism when the mesh's `context` axis is > 1 (fot_jax.model.context_parallel):
  # the attention strategy and the tokens' layout over devices; nothing changes at context 1.
  context_parallel: str = "ring"
  context_layout: str = "zigzag"

  def __post_init__(self):  # a dict (experiment file, fot_jax_model.json) becomes the pairs
    object.__setattr__(self, "rope_scaling", rope.scaling_tuple(self.rope_scaling))
    object.__setattr__(self, "position_strategy", position_strategies.strategy_tuple(self.position_strategy))

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str, base: Optional["ModelConfig"] = None) -> "ModelConfig":
    """The one parser of ModelConfig fields (an experiment's overrides, fot_jax_model.json, a study
    method, config.json's fields, load overrides): `base` (default: the defaults) with the fields
    of `d`, list-valued integer fields as tuples of ints, validated. Every error is a ValueError
    that starts with `where`; an unknown key is named."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
      raise ValueError(f"{where}: unknown ModelConfig field(s) {unknown}; known: {sorted(known)}")
    fields = dict(d)
    for name, value in fields.items():
      if str(known[name].type) == "Tuple[int, ...]" and value is not None:
        fields[name] = tuple(int(x) for x in value)
    try:
      cfg = dataclasses.replace(base or cls(), **fields)
      cfg.validate()
    except (TypeError, ValueError) as e:  # e.g. a RoPE parameter of the wrong type
      raise ValueError(f"{where}: {e}") from None
    return cfg

  def to_dict(self) -> dict:
    """The fields as JSON values (what fot_jax_model.json holds; from_dict reads it back)."""
    d = dataclasses.asdict(self)
    d["mem_layers"] = list(self.mem_layers)
    d["rope_scaling"] = dict(self.rope_scaling)
    d["position_strategy"] = dict(self.position_strategy)
    return d

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def rope_type(self) -> str:
    return dict(self.rope_scaling).get("rope_type", "default")

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  def validate(self) -> None:
    def fail(field, msg):
      raise ValueError(f"model.{field}: {msg}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
      if getattr(self, name) <= 0:
        fail(name, f"must be positive, got {getattr(self, name)}")
    if self.head_dim is None and self.hidden_size % self.num_heads:
      fail("num_heads", f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
    if self.num_heads % self.kv_heads:
      fail("num_kv_heads", f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")
    if self.dim_per_head % 2:
      fail("head_dim", f"RoPE needs an even head dimension, got {self.dim_per_head}")
    try:
      rope.validate_scaling(self.rope_scaling, self.dim_per_head)
    except ValueError as e:
      fail("rope_scaling", str(e))
    if self.position_strategy:
      try:
        position_strategies.validate_strategy(self.position_strategy)
      except ValueError as e:
        fail("position_strategy", str(e))
    for layer in self.mem_layers:
      if not 0 <= layer < self.num_layers:
        fail("mem_layers", f"layer {layer} is outside 0..{self.num_layers - 1}")
    if len(set(self.mem_layers)) != len(self.mem_layers):
      fail("mem_layers", f"repeated layer in {self.mem_layers}")
    if self.mem_positions not in MEM_POSITIONS:
      fail("mem_positions", f"must be one of {MEM_POSITIONS}, got {self.mem_positions!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      fail("attention_impl", f"must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
    if self.attention_block <= 0:
      fail("attention_block", f"must be positive, got {self.attention_block}")
    if self.context_parallel not in CONTEXT_PARALLEL:
      fail("context_parallel", f"must be one of {CONTEXT_PARALLEL}, got {self.context_parallel!r}")
    if self.context_layout not in CONTEXT_LAYOUTS:
      fail("context_layout", f"must be one of {CONTEXT_LAYOUTS}, got {self.context_layout!r}")
    if self.remat_policy not in REMAT_POLICIES:
      fail("remat_policy", f"must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      fail("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")


# Named sizes. Memory layers follow the FoT paper / LongLLaMA.
SIZES = {
    # Unit tests: fast on CPU, with GQA and one memory layer.
    "tiny": ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                        num_heads=4, num_kv_heads=2, mem_layers=(1,)),
    # The CPU demo's dictionary model: 2 layers of 64, the memory layer last (issue 10's recipe:
    # induction warm-up, then lookup; trains in about a minute on 2 cores).
    "dict_cpu": ModelConfig(vocab_size=520, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, head_dim=16, mem_layers=(1,), mem_positions="none",
                            init_std=0.1, embed_init_std=1.0),
    # The paper's 37M dictionary-lookup model (App. F), 8 layers of 512.
    "dict_37m": ModelConfig(vocab_size=520, hidden_size=512, intermediate_size=1408, num_layers=8,
                            num_heads=8, mem_layers=(5,), mem_positions="none"),
    # The paper's 184M 12-layer analysis model (memory layer 8, no positions in it).
    "analysis_184m": ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                 num_layers=12, num_heads=8, mem_layers=(8,), mem_positions="none",
                                 tie_embeddings=True),
    # OpenLLaMA-3B shape, LongLLaMA-3B memory layers.
    "openllama_3b": ModelConfig(vocab_size=32000, hidden_size=3200, intermediate_size=8640,
                                num_layers=26, num_heads=32, mem_layers=(6, 12, 18),
                                mem_positions="first", dtype="bfloat16", remat=True),
    # SmolLM2-135M (`make smollm2`: docs/real_models.md), memory layers as LongLLaMA-7B's.
    "smollm2_135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, rope_theta=100000.0,
                                rms_norm_eps=1e-5, tie_embeddings=True, mem_layers=(8, 16, 24),
                                mem_positions="first"),
    # OpenLLaMA-7B shape, LongLLaMA-7B memory layers.
    "openllama_7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                num_layers=32, num_heads=32, mem_layers=(8, 16, 24),
                                mem_positions="first", dtype="bfloat16", remat=True),
}


def get_size(name: str, **overrides) -> ModelConfig:
  if name not in SIZES:
    raise ValueError(f"model.size: unknown size {name!r}; known sizes: {sorted(SIZES)}")
  cfg = dataclasses.replace(SIZES[name], **overrides)
  cfg.validate()
  return cfg
