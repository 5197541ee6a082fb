"""fot_jax.ask: a long document read into FoT memory, a question asked after it (LongLLaMA's
"ask a PDF" demo). A tiny random checkpoint with a memory layer and a byte-level BPE tokenizer
made on the spot, once with a ChatML chat template and once without. The answer is checked
against `Pretrained.generate` on a prompt built by hand with transformers' tokenizer; the
document's early windows are shown to reach the answer through memory only."""
import json
import os

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

import fot_jax
from fot_jax import ask, checkpoint
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from tests.test_vocab_hf import make_tokenizer

WINDOW = 32
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
            "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% endif %}")
REST = " The pass key is 4821. Remember it. def f(x): return x * 2 class A: pass" * 3  # ~140 tokens
FIRSTS = ["naïve café", "class A: pass", "def f(x):", "tabs and spaces"]  # ~5 tokens: in memory only
QUESTION = "pass key?"
EOS, IM_END = "<|endoftext|>", "<|im_end|>"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """{'chat': checkpoint with a chat template, 'plain': the same weights without one}; bos = eos =
  <|endoftext|> (id 0), the template's end of turn <|im_end|> (id 2)."""
  root = tmp_path_factory.mktemp("ask")
  tok = make_tokenizer(str(root / "tok"))
  cfg = get_size("tiny", vocab_size=300, init_std=0.3, embed_init_std=1.0)  # memory layer 1 of 3
  params = init_params(cfg, 0)
  out = {}
  for name, config in [("plain", {}), ("chat", {"chat_template": TEMPLATE})]:
    with open(root / "tok" / "tokenizer_config.json", "w") as f:
      json.dump({"bos_token": EOS, "eos_token": EOS, "pad_token": EOS, **config}, f)
    checkpoint.save(str(root / name), params, cfg, WINDOW, tokenizer=tok)
    out[name] = str(root / name)
  return out


@pytest.fixture(scope="module")
def model(ckpts):
  return fot_jax.from_pretrained(ckpts["chat"])


@pytest.fixture(scope="module")
def no_memory(ckpts):
  """The same weights without memory layers: nothing before the local window is seen."""
  return fot_jax.from_pretrained(ckpts["chat"], mem_layers=())


def _by_hand(m, path, document, question, max_new_tokens, chat):
  """The prompt built independently (transformers' tokenizer, the template written out), end-aligned
  with the tail in the local window, through Pretrained.generate -> (answer, stop ids, prompt ids)."""
  ref = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
  if chat:
    head, tail = f"<|im_start|>user\n{document}", f"\n\n{question}<|im_end|>\n<|im_start|>assistant\n"
  else:
    head, tail = document, f"\n\nQuestion: {question}\nAnswer:"
  whole = ref.encode(head + tail, add_special_tokens=False)
  n_head = len(ref.encode(head, add_special_tokens=False))
  assert whole[:n_head] == ref.encode(head, add_special_tokens=False)  # encoded at once, as retrieval.encode
  ids = [ref.convert_tokens_to_ids(EOS)] + whole
  n_tail = len(whole) - n_head
  lcl = max(n_tail, WINDOW - min(max_new_tokens, WINDOW // 2))
  stops = [ref.convert_tokens_to_ids(EOS)] + ([ref.convert_tokens_to_ids(IM_END)] if chat else [])
  out = m.generate(np.asarray(ids), max_new_tokens, last_context_length=lcl, eos_token_id=stops).tolist()
  new = out[len(ids):]
  new = new[:next((i for i, t in enumerate(new) if t in stops), len(new))]
  return ref.decode(new).strip(), stops, ids, lcl


@pytest.mark.parametrize("chat", [True, False])
def test_answer_equals_generate_on_the_prompt_built_by_hand(model, ckpts, chat):
  document = FIRSTS[0] + REST
  got = ask.answer(model, document, QUESTION, max_new_tokens=8, chat=chat)
  text, stops, ids, lcl = _by_hand(model, ckpts["chat"], document, QUESTION, 8, chat)
  assert got.chat is chat and got.text == text and got.tokens
  assert got.stop_ids == tuple(stops) and got.prompt_tokens == len(ids) and got.last_context_length == lcl
  assert ask.ask(model, document, QUESTION, max_new_tokens=8, chat=chat) == text
  # the prompt is longer than the window: its windows before the local one went to memory
  pad = (lcl - len(ids)) % WINDOW
  assert len(ids) > 3 * WINDOW and got.memory_windows == (len(ids) + pad - 1) // WINDOW >= 3
  assert got.stats["prompt_tokens"] == len(ids) and got.stats["prefill_s"] > 0


def test_no_template_means_a_plain_prompt(ckpts, model):
  plain = fot_jax.from_pretrained(ckpts["plain"])
  assert ask.has_template(model) and not ask.has_template(plain)
  document = FIRSTS[1] + REST
  got = ask.answer(plain, document, QUESTION, max_new_tokens=8)  # chat=True, but there is none
  assert not got.chat and got.stop_ids == (0,)
  assert got.text == _by_hand(plain, ckpts["plain"], document, QUESTION, 8, chat=False)[0]


def test_the_documents_early_windows_reach_the_answer_through_memory(model, no_memory):
  """Documents that differ only in their first words (which lie windows before the local one):
  with memory some answers differ; without memory layers (the same weights) none can."""
  def tokens(m, first):  # plain prompts: the compiled programs of the other tests serve (same stop ids)
    return tuple(ask.answer(m, first + REST, QUESTION, max_new_tokens=8, chat=False).tokens)
  with_memory, without = [tokens(model, f) for f in FIRSTS], [tokens(no_memory, f) for f in FIRSTS]
  assert len(set(without)) == 1 and len(set(with_memory)) > 1


def test_host_memory_answers_as_the_devices_memory(model):
  """--mode host (a faiss index on the host; exact below 16,384 entries): the answers of the device's
  top-k memory with the same k, and of dense memory with k past the memory's size."""
  def tokens(mode, topk):
    return ask.answer(model, FIRSTS[3] + REST, QUESTION, max_new_tokens=8, chat=False, mode=mode, topk=topk).tokens
  assert tokens("host", 2) == tokens("topk", 2)
  assert tokens("host", 1000) == tokens("dense", 32)


def test_cli_prints_the_answer(ckpts, model, no_memory, tmp_path, capsys):
  doc = tmp_path / "doc.md"
  doc.write_text(FIRSTS[2] + REST + "\n", encoding="utf-8")
  expected = ask.ask(model, doc.read_text(encoding="utf-8"), QUESTION, max_new_tokens=8)
  ask.main(["--checkpoint", ckpts["chat"], "--document", str(doc), "--max_new_tokens", "8", "--verbose",
            "pass", "key?"])
  out, err = capsys.readouterr()
  assert out == expected + "\n"
  assert "windows in memory" in err and "tokens/s" in err and "chat template" in err
  # --mem_layers over the checkpoint's, --no_chat: the plain prompt on the model without memory
  plain = ask.ask(no_memory, doc.read_text(encoding="utf-8"), QUESTION, max_new_tokens=8, chat=False)
  ask.main(["--checkpoint", ckpts["chat"], "--document", str(doc), "--max_new_tokens", "8", "--mem_layers",
            "none", "--no_chat", QUESTION])
  out, err = capsys.readouterr()
  assert out == plain + "\n" and plain != expected and not err
  assert ask._layers("0,2") == (0, 2) and ask._layers("all") == "all"


def _one_line_error(capsys, argv, match):
  with pytest.raises(SystemExit) as e:
    ask.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("fot_jax.ask: ") and match in err, err


def test_errors_are_one_line(ckpts, tmp_path, capsys):
  base = ["--checkpoint", ckpts["chat"], "--document"]
  _one_line_error(capsys, base + [str(tmp_path / "missing.txt"), "q?"], "missing.txt: no such file")
  (tmp_path / "empty.txt").write_text(" \n")
  _one_line_error(capsys, base + [str(tmp_path / "empty.txt"), "q?"], "empty.txt: empty")
  (tmp_path / "doc.pdf").write_bytes(b"%PDF-1.4\n\x00\x01\x02binary")
  _one_line_error(capsys, base + [str(tmp_path / "doc.pdf"), "q?"], "doc.pdf: a binary file")
  (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
  _one_line_error(capsys, base + [str(tmp_path / "latin1.txt"), "q?"], "latin1.txt: not UTF-8 text")
  (tmp_path / "doc.txt").write_text(REST)
  long_question = " ".join(["pass key?"] * 12)
  _one_line_error(capsys, base + [str(tmp_path / "doc.txt"), long_question], f"local window is {WINDOW}")
  # no model is loaded for a bad document: a checkpoint that does not exist is not reached
  _one_line_error(capsys, ["--checkpoint", str(tmp_path / "nowhere"), "--document", str(tmp_path / "missing.txt"),
                           "q?"], "missing.txt: no such file")
