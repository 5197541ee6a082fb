"""python -m fot_jax.convert import_hf --hf_dir DIR --out CKPT [--mem_layers 6,12,18 ...]
python -m fot_jax.convert import_gguf --gguf FILE.gguf --out CKPT [--mem_layers 6,12,18 ...]
python -m fot_jax.convert export_hf --checkpoint CKPT --out DIR [--dtype bfloat16 ...]
python -m fot_jax.convert verify_export --checkpoint CKPT --export DIR [--text FILE --tokens N --window W]
    [--max_logit_diff 1e-3 (float32 exports) --min_argmax_agree 0.98 --max_nll_diff 0.01 (bf16/fp16)]

A bad input ends in one line, `fot_jax.convert: message` naming it, exit status 2 (fot_jax.cli);
verify_export exits 1 with one line saying what exceeded which tolerance (fot_jax/convert/verify.py).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from fot_jax.cli import expected_errors  # noqa: E402
from fot_jax.convert import verify  # noqa: E402
from fot_jax.convert.api import export_hf, import_gguf, import_hf  # noqa: E402


def _layers(text: str):
  text = text.strip()
  if text.lower() in ("", "none"):
    return ()
  try:
    return tuple(int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}")


def _model_options(p: argparse.ArgumentParser) -> None:
  p.add_argument("--mem_layers", type=_layers, default=None,
                 help="0-based memory layers, e.g. 6,12,18 (default: config.json's, else none)")
  p.add_argument("--mem_positions", choices=("first", "none"), default=None,
                 help="default: from LongLLaMA's mem_positionals, else 'first'")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="fot_jax compute dtype (parameters stay float32)")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m fot_jax.convert")
  sub = p.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import_hf", help="Hugging Face LLaMA directory -> fot_jax checkpoint")
  imp.add_argument("--hf_dir", required=True)
  imp.add_argument("--out", required=True, help="new or empty directory")
  _model_options(imp)
  gg = sub.add_parser("import_gguf", help="LLaMA-architecture GGUF file (llama.cpp) -> fot_jax checkpoint")
  gg.add_argument("--gguf", required=True, help="a .gguf file (dequantized by transformers)")
  gg.add_argument("--out", required=True, help="new or empty directory")
  _model_options(gg)
  exp = sub.add_parser("export_hf", help="fot_jax checkpoint -> LlamaForCausalLM / LongLLaMA directory")
  exp.add_argument("--checkpoint", required=True, help="import_hf output or a training workdir")
  exp.add_argument("--out", required=True, help="new or empty directory")
  exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
  exp.add_argument("--max_shard_size", default="5GB")
  exp.add_argument("--window", type=int, default=None, help="max_position_embeddings (default: recorded)")
  exp.add_argument("--tokenizer", default=None,
                   help="SentencePiece model or tokenizer.json to ship (default: recorded)")
  exp.add_argument("--mem_dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
  exp.add_argument("--fot_jax_only", action="store_true",
                   help="also write parameters plain LLaMA lacks (gating, temperature)")
  ver = sub.add_parser("verify_export", help="fot_jax's memory logits vs the PyTorch reference on an export")
  ver.add_argument("--checkpoint", required=True, help="what was exported (import output or training workdir)")
  ver.add_argument("--export", required=True, help="the export_hf directory (float32 or bfloat16 weights)")
  ver.add_argument("--text", default=None, help="a text file to encode (default: Python's inspect.py)")
  ver.add_argument("--tokens", type=int, default=512, help="tokens compared (bos included)")
  ver.add_argument("--window", type=int, default=None, help="default: the export's last_context_length")
  ver.add_argument("--vocab", default="", help="vocabulary spec (default: the checkpoint's own)")
  ver.add_argument("--max_logit_diff", type=float, default=verify.MAX_LOGIT_DIFF,
                   help="float32 exports: the largest max |logit difference| that passes (default %(default)g)")
  ver.add_argument("--min_argmax_agree", type=float, default=verify.MIN_ARGMAX_AGREE,
                   help="bfloat16/float16 exports: the least fraction of equal argmax tokens (default %(default)g)")
  ver.add_argument("--max_nll_diff", type=float, default=verify.MAX_NLL_DIFF,
                   help="bfloat16/float16 exports: the largest |mean NLL difference| in nats (default %(default)g)")
  return p


PROG = "fot_jax.convert"


def main(argv=None) -> None:
  """Exit status 0: done (verify_export: within its tolerances); 1: verify_export found the export
  beyond a tolerance (one line on stderr says which); 2: a bad input (one line naming it)."""
  args = _parser().parse_args(argv)
  with expected_errors(PROG):
    if args.command in ("import_hf", "import_gguf"):
      src = args.hf_dir if args.command == "import_hf" else args.gguf
      fn = import_hf if args.command == "import_hf" else import_gguf
      ck = fn(src, args.out, mem_layers=args.mem_layers, mem_positions=args.mem_positions, dtype=args.dtype)
      print(f"imported {src} -> {args.out} ({ck.cfg.num_layers} layers, vocab {ck.cfg.vocab_size}, "
            f"memory layers {list(ck.cfg.mem_layers)}, window {ck.window}, "
            f"tokenizer {ck.meta.get('tokenizer')})")
    elif args.command == "verify_export":
      r = verify.verify_export(args.checkpoint, args.export, text_path=args.text, tokens=args.tokens,
                               window=args.window, vocab=args.vocab, max_logit_diff=args.max_logit_diff,
                               min_argmax_agree=args.min_argmax_agree, max_nll_diff=args.max_nll_diff)
      print(" ".join(f"{k}={v}" for k, v in r.items() if k not in ("ok", "failures")), flush=True)
      if not r["ok"]:
        print(f"{PROG}: verify_export: {args.export} ({r['export_dtype']}) differs from {args.checkpoint}: "
              + "; ".join(r["failures"]), file=sys.stderr, flush=True)
        sys.exit(1)
      print(f"verify_export: {args.export} ({r['export_dtype']}) reproduces {args.checkpoint} within tolerance")
    else:
      export_hf(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                fot_jax_only=args.fot_jax_only, window=args.window, tokenizer=args.tokenizer,
                mem_dtype=args.mem_dtype)
      print(f"exported {args.checkpoint} -> {args.out}")


if __name__ == "__main__":
  main()
