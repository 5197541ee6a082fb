"""Tiny random Hugging Face LLaMA models for the conversion tests (made on the spot, no download)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 37  # odd, like 32016


def make_hf(directory, kv_heads=2, tied=False, dtype=torch.float32, layers=2, **config):
  """A random LlamaForCausalLM saved to `directory`; returns the fp32 model (weights as saved).
  config: LlamaConfig fields over the defaults below (e.g. rope_scaling, max_position_embeddings)."""
  torch.manual_seed(100 * layers + 10 * kv_heads + int(tied))
  fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=kv_heads, rope_theta=5000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=tied, max_position_embeddings=8,
                initializer_range=0.3)
  cfg = LlamaConfig(**{**fields, **config})
  model = LlamaForCausalLM(cfg).eval()
  with torch.no_grad():  # random norms too, so a swapped norm weight shows
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.3 * torch.randn_like(p))
  if dtype == torch.float32:
    model.save_pretrained(directory)
    return model
  model.to(dtype).save_pretrained(directory)  # the fp32 reference reloads the rounded weights
  return LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.numpy()
