"""Checkpoint interop with Hugging Face / PyTorch (LLaMA, OpenLLaMA, LongLLaMA).

CLI: `python -m fot_jax.convert import_hf|import_gguf|export_hf ...`; Python: `fot_jax.from_pretrained`.
torch, transformers and safetensors are imported only inside the functions that use them.
"""
from fot_jax.convert.api import (Pretrained, export_hf, from_pretrained, import_gguf, import_hf, load_any,
                                 load_gguf, load_hf)
from fot_jax.checkpoint import ConvertError

__all__ = ["ConvertError", "Pretrained", "export_hf", "from_pretrained", "import_gguf", "import_hf", "load_any",
           "load_gguf", "load_hf"]
