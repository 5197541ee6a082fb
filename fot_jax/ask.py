"""Ask a long document a question: LongLLaMA's "ask a PDF" demo, on a CPU.

  python -m fot_jax.ask --checkpoint CKPT --document FILE [--window W] [--mode dense|topk|host]
      [--topk K] [--max_new_tokens N] [--no_chat] [--mem_layers 8,16,24|all|none] [--verbose] "question"

The document (a UTF-8 text file) and the question make one prompt. With the checkpoint's chat
template (fot_jax.chat; the default when its tokenizer ships one) it is one user turn holding the
document, a blank line and the question, then the assistant's turn opened; without one (or with
--no_chat) it is `DOCUMENT\\n\\nQuestion: QUESTION\\nAnswer:`. The prompt starts with bos, once.
The document and what follows it (the question and the chat scaffolding: the *tail*) are encoded
as `eval.retrieval.encode` encodes a prompt and its answer.

The prompt is aligned at its end (`inference.end_aligned`, LongLLaMA's last_context_length): the
tail and as much of the document's end as `MemoryInference.generate`'s default leaves (the window
less the new tokens, at least half of it) sit in the current local window, and the document's
earlier windows are read into FoT memory window by window. A tail longer than the window is
refused. Decoding is greedy and stops at the vocabulary's eos or the template's end-of-turn token
(e.g. `<|im_end|>`); the answer is decoded and stripped.

A bad input (a missing, empty or binary document, a question longer than the window, a checkpoint
that does not load) ends in one line, `fot_jax.ask: message`, exit status 2 (fot_jax.cli).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Sequence, Tuple, Union

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from fot_jax.chat import chat_prompt, chat_template, load_tokenizer, tokenizer_dir  # noqa: E402
from fot_jax.cli import expected_errors, parse_mem_layers  # noqa: E402
from fot_jax.convert.api import Pretrained, from_pretrained  # noqa: E402
from fot_jax.eval.retrieval import encode  # noqa: E402
from fot_jax.inference import end_aligned  # noqa: E402

PROG = "fot_jax.ask"
MODES = ("dense", "topk", "host")  # Pretrained.generate's memory modes (host: fot_jax.host_memory)
PLAIN_TAIL = "\n\nQuestion: {question}\nAnswer:"
CHAT_JOIN = "\n\n"  # between the document and the question in the user turn
_MARK = "fot_jax-ask-answer"  # an assistant message whose end shows the template's end-of-turn token


@dataclasses.dataclass
class Answer:
  """What `answer` returns: the text and how the prompt was read."""
  text: str
  tokens: list  # the generated ids, up to (without) the stop token
  chat: bool  # the chat template was used
  prompt_tokens: int  # bos + document + tail
  document_tokens: int
  tail_tokens: int  # question and scaffolding after the document
  window: int
  last_context_length: int
  memory_windows: int  # prompt windows read into memory before the local one
  stop_ids: Tuple[int, ...]
  stats: dict  # Pretrained.generation_stats: prefill_s, decode_s, tokens_per_s, new_tokens, ...

  def summary(self) -> str:
    """The --verbose lines."""
    s = self.stats
    prompt = "chat template" if self.chat else "plain prompt"
    return (f"document: {self.document_tokens:,} tokens; prompt: {self.prompt_tokens:,} tokens ({prompt}, "
            f"question and scaffolding {self.tail_tokens}); window {self.window}, last_context_length "
            f"{self.last_context_length}: {self.memory_windows} windows in memory\n"
            f"prefill {s['prefill_s']:.2f} s ({self.prompt_tokens / max(s['prefill_s'], 1e-9):,.1f} tokens/s); "
            f"decode {s['decode_s']:.2f} s, {s['new_tokens']} new tokens ({s['tokens_per_s']:.1f} tokens/s)")


def read_document(path: str) -> str:
  """A text file's contents (UTF-8); a missing, empty or binary file fails naming it."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"--document {path}: no such file")
  if os.path.isdir(path):
    raise IsADirectoryError(f"--document {path}: a directory, not a text file")
  with open(path, "rb") as f:
    data = f.read()
  if b"\0" in data:
    raise ValueError(f"--document {path}: a binary file (it holds NUL bytes); give a UTF-8 text file "
                     f"(convert a PDF to text first, e.g. with pdftotext)")
  try:
    text = data.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise ValueError(f"--document {path}: not UTF-8 text ({e.reason} at byte {e.start}); give a UTF-8 "
                     f"text file") from None
  if not text.strip():
    raise ValueError(f"--document {path}: empty")
  return text


def has_template(model: Pretrained) -> bool:
  """Does the model's tokenizer ship a chat template? (One transformers cannot read fails, naming it.)"""
  if tokenizer_dir(model) is None:  # bytes, SentencePiece: no Hugging Face tokenizer, no template
    return False
  try:
    load_tokenizer(model)
  except ValueError as e:  # whether it has a template is unknown: no silent plain prompt
    raise ValueError(f"{e}; pass --no_chat (chat=False) for a plain prompt") from None
  try:
    chat_template(model)
  except ValueError:  # none shipped: a base model
    return False
  return True


def prompt_parts(model: Pretrained, document: str, question: str, use_chat: bool) -> Tuple[str, str]:
  """-> (head, tail): the prompt text up to the document's end, and the rest (question and
  scaffolding). A template's leading bos token is left out of the head (`encode` adds the id)."""
  if not use_chat:
    return document, PLAIN_TAIL.format(question=question)
  content = document + CHAT_JOIN + question
  text = chat_prompt(model, [{"role": "user", "content": content}])
  at = text.find(content)
  if at < 0:
    raise ValueError("the chat template does not render the user message as it is; pass chat=False "
                     "(--no_chat) for a plain prompt")
  head, tail = text[:at + len(document)], text[at + len(document):]
  bos = model.vocab.decode([int(model.vocab.bos_id)])
  if bos and head.startswith(bos):
    head = head[len(bos):]
  return head, tail


def end_of_turn_id(model: Pretrained) -> Optional[int]:
  """The special token the chat template closes an assistant turn with (`<|im_end|>`), if any."""
  text = chat_prompt(model, [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}],
                     add_generation_prompt=False, continue_final_message=False)
  after = text[text.rfind(_MARK) + len(_MARK):].lstrip() if _MARK in text else ""
  tokenizer = getattr(model.vocab, "tokenizer", None)  # HFVocab: the `tokenizers` object
  if not after or tokenizer is None:
    return None
  for i, token in tokenizer.get_added_tokens_decoder().items():
    if token.special and after.startswith(token.content):
      return int(i)
  return None


def context_length(tail: int, window: int, max_new_tokens: int, question_tokens: int) -> int:
  """last_context_length: generate's default (the window less the new tokens, at least half of
  it), raised to hold the whole tail; a tail longer than the window is refused."""
  if tail > window:
    raise ValueError(f"the question takes {question_tokens} tokens ({tail} with the prompt around it) but the "
                     f"local window is {window}; ask a shorter question or pass a larger --window")
  return max(tail, window - min(max_new_tokens, window // 2))


def memory_windows(prompt_tokens: int, window: int, last_context_length: int) -> int:
  """How many windows of an end-aligned prompt go to memory before the local one."""
  _, _, pads = end_aligned([np.zeros(prompt_tokens, np.int32)], window, last_context_length)
  return (prompt_tokens + int(pads[0]) - 1) // window


def answer(model_or_path: Union[str, Pretrained], document: str, question: str, *, window: Optional[int] = None,
           mode: str = "dense", topk: int = 32, max_new_tokens: int = 64, chat: bool = True,
           **overrides) -> Answer:
  """Reads `document` (text) into memory and answers `question` after it (module docstring).
  model_or_path: a loaded model or a path for from_pretrained (with overrides such as mem_layers);
  chat: use the checkpoint's chat template when it ships one."""
  document, question = document.strip(), question.strip()
  if not document:
    raise ValueError("the document is empty")
  if not question:
    raise ValueError("the question is empty")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if mode not in MODES:
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
  if mode != "dense" and topk < 1:
    raise ValueError(f"topk must be >= 1, got {topk}")
  if isinstance(model_or_path, Pretrained):
    if overrides:
      raise ValueError(f"overrides {sorted(overrides)} need a path, not a loaded model")
    model = model_or_path
  else:
    model = from_pretrained(model_or_path, **overrides)
  window = int(window or model.window or 0)
  if window <= 0:
    raise ValueError(f"{model.checkpoint.path} records no window; pass --window")
  use_chat = bool(chat) and has_template(model)
  vocab = model.vocab
  head, tail = prompt_parts(model, document, question, use_chat)
  ids, tail_start = encode(vocab, head, tail)
  tail_tokens = len(ids) - tail_start
  lcl = context_length(tail_tokens, window, max_new_tokens, len(vocab.encode(question)))
  stops = [int(vocab.eos_id)]
  eot = end_of_turn_id(model) if use_chat else None
  if eot is not None and eot not in stops:
    stops.append(eot)
  out = model.generate(ids, max_new_tokens, window=window, mode=mode, topk=topk, last_context_length=lcl,
                       eos_token_id=stops)
  new = [int(t) for t in out[len(ids):]]
  cut = next((i for i, t in enumerate(new) if t in stops), len(new))
  return Answer(text=vocab.decode(new[:cut]).strip(), tokens=new[:cut], chat=use_chat, prompt_tokens=len(ids),
                document_tokens=len(vocab.encode(document)), tail_tokens=tail_tokens, window=window,
                last_context_length=lcl, memory_windows=memory_windows(len(ids), window, lcl),
                stop_ids=tuple(stops), stats=dict(model.generation_stats))


def ask(model_or_path: Union[str, Pretrained], document: str, question: str, *, window: Optional[int] = None,
        mode: str = "dense", topk: int = 32, max_new_tokens: int = 64, chat: bool = True, **overrides) -> str:
  """The answer's text (see `answer` for the stats)."""
  return answer(model_or_path, document, question, window=window, mode=mode, topk=topk,
                max_new_tokens=max_new_tokens, chat=chat, **overrides).text


def _layers(text: str):
  """--mem_layers: '8,16,24', 'all' or 'none' (argparse's type: its error, not a traceback)."""
  try:
    return parse_mem_layers(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=f"python -m {PROG}", description="Ask a long document a question, "
                              "the document read into FoT memory window by window.")
  p.add_argument("question", nargs="+", help="the question (several words are joined by spaces)")
  p.add_argument("--checkpoint", required=True, help="fot_jax checkpoint, Hugging Face directory or .gguf file")
  p.add_argument("--document", required=True, help="a UTF-8 text file (.txt, .md, ...)")
  p.add_argument("--window", type=int, default=None, help="local window (default: the checkpoint's)")
  p.add_argument("--mode", choices=MODES, default="dense",
                 help="memory attention: dense, topk, or host (top-k from a faiss index on the host: long documents)")
  p.add_argument("--topk", type=int, default=32, help="memory keys per query in --mode topk or host")
  p.add_argument("--max_new_tokens", type=int, default=64)
  p.add_argument("--no_chat", action="store_true", help="a plain prompt even when the checkpoint has a chat template")
  p.add_argument("--mem_layers", type=_layers, default=None,
                 help="memory layers over the checkpoint's: 0-based, comma-separated, 'all' or 'none'")
  p.add_argument("--verbose", action="store_true", help="also print token counts, memory and timings (stderr)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = _parser().parse_args(argv)
  with expected_errors(PROG):
    document = read_document(args.document)  # a bad file fails before the model loads
    overrides = {} if args.mem_layers is None else {"mem_layers": args.mem_layers}
    result = answer(args.checkpoint, document, " ".join(args.question), window=args.window, mode=args.mode,
                    topk=args.topk, max_new_tokens=args.max_new_tokens, chat=not args.no_chat, **overrides)
  print(result.text, flush=True)
  if args.verbose:
    print(result.summary(), file=sys.stderr, flush=True)


if __name__ == "__main__":
  main()
