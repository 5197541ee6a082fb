"""fot_jax: Focused Transformer (FoT) long-context training and evaluation in JAX/Flax."""


def from_pretrained(path: str, **overrides):
  """An HF LLaMA directory or an fot_jax checkpoint -> fot_jax.convert.Pretrained
  (`.logits`, `.logits_with_memory`, `.generate`, `.save_hf`). Imported lazily so
  `import fot_jax` stays light."""
  from fot_jax.convert.api import from_pretrained as _from_pretrained
  return _from_pretrained(path, **overrides)
