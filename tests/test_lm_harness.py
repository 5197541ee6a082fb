"""fot_jax inside EleutherAI's lm-evaluation-harness (fot_jax/eval/lm_harness.py) and chat prompts
(fot_jax/chat.py), on a tiny checkpoint with a memory layer and a byte-level BPE tokenizer made on
the spot: log-likelihoods against log-softmax of independent forward passes (one plain causal pass
when the text fits a window, `logits_with_memory` placed the same way when it does not),
generation against `Pretrained.generate`, chat prompts against transformers, lm-eval's own command
line end to end on local tasks, and one-line errors for bad model arguments."""
import json
import os

import jax
import numpy as np
import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from fot_jax import chat, checkpoint
from fot_jax.convert.api import from_pretrained
from fot_jax.eval import lm_harness
from fot_jax.inference import end_aligned
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from tests.test_vocab_hf import make_tokenizer

W = 8  # the local window the tests read with (the checkpoint records 16)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LONG = "The pass key is 4821. Remember it. " * 3 + "What is the pass key? The pass key is"


def _tokenizer_dir(directory, template=TEMPLATE):
  """The tiny tokenizer.json with a tokenizer_config.json that transformers reads (and a chat template)."""
  make_tokenizer(directory)
  config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
  if template:
    config["chat_template"] = template
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  return directory


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """An fot_jax checkpoint: 2 layers, memory in layer 1, weights x4 (peaked predictions), window 16."""
  d = tmp_path_factory.mktemp("lmh")
  tok = _tokenizer_dir(str(d / "tok"))
  cfg = get_size("tiny", vocab_size=Tokenizer.from_file(f"{tok}/tokenizer.json").get_vocab_size(True),
                 num_layers=2, mem_layers=(1,))
  params = jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, init_params(cfg, 0))
  checkpoint.save(str(d / "ck"), params, cfg, 16, tokenizer=f"{tok}/tokenizer.json")
  return str(d / "ck")


@pytest.fixture(scope="module")
def lm(ckpt):
  return lm_harness.FotJaxLM(checkpoint=ckpt, window=W, batch_size=2, max_gen_toks=6)


def _logp(logits, targets):
  """log-softmax of float32 logits [T, V] (float64 here) at targets [T] (the first T rows), and argmax == target."""
  logits = np.asarray(logits)[:len(targets)]
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  return lp[np.arange(len(targets)), targets], logits.argmax(-1) == targets


def _plain(model, tokens):
  """One causal pass without memory over up to W tokens (padded at the end to W: one compiled shape)."""
  assert len(tokens) <= W
  return model.logits([list(tokens) + [0] * (W - len(tokens))])[0, :len(tokens)]


def _reqs(kind, args):
  return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _greedy_pair(lm, model):
  """A (context, continuation) whose continuation is the model's greedy next token, as text."""
  for context in ("class A:", "def f", "The pass key", "return x", "x = 1"):
    ids = [lm.bos] + lm.tok_encode(context)
    if len(ids) > W - 1:
      continue
    token = int(_plain(model, ids)[-1].argmax())
    text = lm.vocab.decode([token])
    if text.strip() and lm.tok_encode(context + text)[len(ids) - 1:] == [token]:
      return context, text
  raise AssertionError("no context whose greedy token round-trips as text")


def test_loglikelihood_with_memory(lm):
  model = lm.model
  short, greedy, long = ("class A:", " pass"), _greedy_pair(lm, model), (LONG, " 4821")
  got = lm.loglikelihood(_reqs("loglikelihood", [short, greedy, long, ("", "class A")]))
  # fits one window: one plain causal pass over bos + context + continuation
  for i, (context, cont) in ((0, short), (1, greedy), (3, ("", "class A"))):
    ctx = [lm.bos] + lm.tok_encode(context)
    seq = ctx + (lm.tok_encode(context + cont)[len(ctx) - 1:] if context else lm.tok_encode(cont))
    assert len(seq) - 1 <= W
    lp, top = _logp(_plain(model, seq[:-1]), np.array(seq[1:]))
    n = len(seq) - len(ctx)
    assert got[i][0] == pytest.approx(float(lp[-n:].sum()), abs=1e-4) and got[i][1] == bool(top[-n:].all())
  assert got[1][1] is True and got[0][1] is False  # a greedy continuation is recognised as one
  # past the window: memory inference with the input's end in a full last window
  ctx = [lm.bos] + lm.tok_encode(LONG)
  seq = ctx + lm.tok_encode(LONG + " 4821")[len(ctx) - 1:]
  inp, n = np.array(seq[:-1]), len(seq) - len(ctx)
  assert len(inp) > 3 * W and n >= 1
  toks, mask, pads = end_aligned([inp], W, W)
  logits = model.logits_with_memory(toks, window=W, token_mask=mask)[0, pads[0]:pads[0] + len(inp)]
  lp, top = _logp(logits, np.array(seq[1:]))
  assert got[2][0] == pytest.approx(float(lp[-n:].sum()), abs=1e-4) and got[2][1] == bool(top[-n:].all())
  # memory is read: the last window alone (no memory) scores the continuation otherwise
  alone, _ = _logp(_plain(model, inp[-W:]), np.array(seq[1:])[-W:])
  assert abs(float(alone[-n:].sum()) - got[2][0]) > 1e-3


def test_loglikelihood_rolling_with_memory(lm):
  text = LONG + " 4821."
  seq = [lm.bos] + lm.tok_encode(text)
  assert len(seq) > 3 * W and (len(seq) - 1) % W
  (got,) = lm.loglikelihood_rolling(_reqs("loglikelihood_rolling", [(text,)]))
  lp, _ = _logp(lm.model.logits_with_memory([seq[:-1]], window=W)[0], np.array(seq[1:]))
  assert got == pytest.approx(float(lp.sum()), abs=1e-3)
  # windows read without memory give another number
  alone = sum(float(_logp(_plain(lm.model, seq[s:s + W]), np.array(seq[s + 1:s + W + 1]))[0].sum())
              for s in range(0, len(seq) - 1, W))
  assert abs(alone - got) > 1e-2


def test_generate_until_is_greedy_generation_cut_at_until(lm, ckpt):
  hf = AutoTokenizer.from_pretrained(chat.tokenizer_dir(ckpt))
  contexts = [LONG, "def f(x):"]
  rows = [np.array([lm.bos] + lm.tok_encode(c), np.int32) for c in contexts]
  ref = lm.model.generate(rows, max_new_tokens=6, window=W, eos_token_id=lm.eos)  # a batch, as lm batches it
  texts = []
  for row, full in zip(rows, ref):
    new = full[len(row):].tolist()
    new = new[:new.index(lm.eos)] if lm.eos in new else new
    texts.append(hf.decode(new, skip_special_tokens=True))
  assert len(texts[0]) >= 3, texts
  until = texts[0][1:3]  # a stop string inside the first continuation
  got = lm.generate_until(_reqs("generate_until", [(c, {"until": [until], "max_gen_toks": 6}) for c in contexts]))
  assert got == [t.split(until)[0] for t in texts] and got[0] == texts[0][:texts[0].index(until)]
  assert lm.generate_until(_reqs("generate_until", [(c, {"until": []}) for c in contexts])) == texts  # max_gen_toks 6


def test_host_memory_mode_reads_as_dense_memory(lm, ckpt):
  """mode=host with an exact index and k past every memory: every request scored and generated as
  dense memory reads it (fot_jax.host_memory); an approximate index's arguments are checked."""
  host = lm_harness.FotJaxLM(checkpoint=ckpt, window=W, batch_size=2, max_gen_toks=6, mode="host",
                             host_index="flat", topk=1000)
  ll = [("class A:", " pass"), (LONG, " 4821"), (LONG[:40], " key")]
  for kind, args in (("loglikelihood", ll), ("loglikelihood_rolling", [(LONG + " 4821.",)]),
                     ("generate_until", [(c, {"until": []}) for c in (LONG, "def f(x):")])):
    got, want = (getattr(m, kind)(_reqs(kind, args)) for m in (host, lm))
    assert np.allclose(np.array(got, float), np.array(want, float), atol=1e-3) if kind != "generate_until" \
        else got == want, (kind, got, want)
  assert host.infer.mode == "host" and host.infer.kind == "flat"
  approx = lm_harness.settings({"checkpoint": ckpt, "mode": "host", "nprobe": "4"})
  assert (approx.host_index, approx.nprobe) == ("ivf", 4)


def test_capped_ruler_samples_are_the_first_of_the_uncapped(ckpt):
  """--ruler_samples N: each RULER generator makes the first N of the prompts it makes uncapped."""
  import random

  from lm_eval.tasks.ruler import cwe_utils, fwe_utils, niah_utils, vt_utils
  tok = AutoTokenizer.from_pretrained(chat.tokenizer_dir(ckpt))
  calls = {"niah": lambda: niah_utils.generate_samples(
               niah_utils.get_haystack(type_haystack="repeat"), max_seq_length=600, template=niah_utils.TEMPLATE,
               type_haystack="repeat", type_needle_k="words", type_needle_v="numbers", num_samples=3, TOKENIZER=tok),
           "vt": lambda: vt_utils.sys_vartrack_w_noise_random(tokenizer=tok, num_samples=3, max_seq_length=2500),
           "cwe": lambda: cwe_utils.sys_word_pair_random(num_samples=3, max_seq_length=2500, tokenizer=tok),
           "fwe": lambda: fwe_utils.sys_kwext(tokenizer=tok, max_seq_length=600, num_samples=3)}

  def made(name):  # the random states lm-eval seeds (and cwe's own), as a fresh process has them
    random.seed(0)
    np.random.seed(0)
    cwe_utils.RNG.seed(0)
    return [(d["input"], d["outputs"]) for d in calls[name]()]
  try:
    full = {name: made(name) for name in calls}
    assert lm_harness._ruler_samples(["--tasks", "x", "--ruler_samples", "2"]) == ["--tasks", "x"]
    for name in calls:
      assert made(name) == full[name][:2] and len(full[name]) == 3 and full[name][1] != full[name][2], name
  finally:
    lm_harness.cap_ruler_samples(0)
  assert len(made("niah")) == 3  # undone
  with pytest.raises(ValueError, match="--ruler_samples: expected a number of prompts >= 1, got 'x'"):
    lm_harness._ruler_samples(["--ruler_samples=x"])


def test_chat_template(lm, ckpt, tmp_path):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
  hf = AutoTokenizer.from_pretrained(chat.tokenizer_dir(ckpt))
  want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  assert want.endswith("<|im_start|>assistant\n")
  assert lm.apply_chat_template(msgs) == chat.chat_prompt(ckpt, msgs) == chat.chat_prompt(lm.model, msgs) == want
  cont = msgs + [{"role": "assistant", "content": "It is"}]
  assert lm.apply_chat_template(cont, add_generation_prompt=False) == hf.apply_chat_template(
      cont, tokenize=False, continue_final_message=True) and not want.endswith("It is")
  assert lm.chat_template(True) == TEMPLATE and lm.tokenizer_name == chat.tokenizer_dir(ckpt).replace("/", "__")
  # no template: one clear error
  bare = _tokenizer_dir(str(tmp_path / "bare"), template=None)
  with pytest.raises(ValueError, match="no chat template"):
    chat.chat_prompt(bare, msgs)
  with pytest.raises(ValueError, match="no Hugging Face tokenizer"):
    chat.chat_prompt(str(tmp_path), msgs)


def test_gguf_and_hf_imports_keep_the_chat_template(tmp_path, monkeypatch):
  gguf = pytest.importorskip("gguf")
  from fot_jax.convert import import_gguf, import_hf
  from tests import hf_models
  from tests.test_gguf import write_gguf
  tok = _tokenizer_dir(str(tmp_path / "tok"), template=None)
  monkeypatch.setattr(hf_models, "VOCAB", len(AutoTokenizer.from_pretrained(tok)))
  hf = hf_models.make_hf(tmp_path / "hf", kv_heads=2, tied=True)
  header = gguf.GGUFWriter.write_header_to_file
  monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file",
                      lambda self, *a, **k: (self.add_chat_template(TEMPLATE), header(self, *a, **k))[1])
  import_gguf(write_gguf(tmp_path / "t.gguf", hf, tok), str(tmp_path / "from_gguf"))
  # an HF directory whose template is a chat_template.jinja (transformers' save_pretrained)
  AutoTokenizer.from_pretrained(tok).save_pretrained(str(tmp_path / "hf"))
  with open(tmp_path / "hf" / "chat_template.jinja", "w") as f:
    f.write(TEMPLATE)
  import_hf(str(tmp_path / "hf"), str(tmp_path / "from_hf"))
  msgs = [{"role": "user", "content": "hi"}]
  for out in ("from_gguf", "from_hf"):
    assert json.load(open(tmp_path / out / "tokenizer_config.json"))["chat_template"] == TEMPLATE
    assert chat.chat_prompt(str(tmp_path / out), msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _tasks(tmp_path):
  """Two local lm-eval tasks: generation (exact match) and a two-way multiple choice."""
  docs = tmp_path / "docs.jsonl"
  rows = [{"question": LONG, "answer": " 4821", "choices": [" 4821", " 1234"], "label": 0},
          {"question": "def f(x):", "answer": " return", "choices": [" return", " pass"], "label": 1}]
  docs.write_text("".join(json.dumps(r) + "\n" for r in rows))
  common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\ntest_split: test\n"
  (tmp_path / "gen.yaml").write_text(
      "task: fotjax_tiny_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
      "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
      "metric_list:\n  - metric: exact_match\n")
  (tmp_path / "mc.yaml").write_text(
      "task: fotjax_tiny_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
      "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
  return rows


def test_cli_runs_lm_eval_end_to_end(lm, ckpt, tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  # lm-eval indexes its ~14,000 built-in task files on every run (over 10 s here); these tasks are local
  monkeypatch.setattr(TaskManager.__init__, "__defaults__", (None, None, False, None))
  rows = _tasks(tmp_path)
  out = tmp_path / "out"
  lm_harness.main(["--model", "fot_jax", "--model_args", f"checkpoint={ckpt},window={W},mem_layers=1",
                   "--include_path", str(tmp_path), "--tasks", "fotjax_tiny_gen,fotjax_tiny_mc",
                   "--batch_size", "2", "--output_path", str(out), "--log_samples", "--apply_chat_template"])
  assert get_model("fot_jax") is lm_harness.FotJaxLM
  results = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs if f.startswith("results")]
  res = json.load(open(results[0]))
  assert set(res["results"]) == {"fotjax_tiny_gen", "fotjax_tiny_mc"}
  assert res["config"]["model_args"]["tokenizer"] == chat.tokenizer_dir(ckpt)  # what RULER tasks read
  samples = {task: [json.loads(line) for r, _, fs in os.walk(out) for f in fs if f.startswith(f"samples_{task}_")
                    for line in open(os.path.join(r, f))] for task in res["results"]}
  # the responses are this model's answers to the requests lm-eval logged
  gen = sorted(samples["fotjax_tiny_gen"], key=lambda s: s["doc_id"])
  asked = [tuple(s["arguments"]["gen_args_0"].values()) for s in gen]
  prompts = [chat.chat_prompt(ckpt, [{"role": "user", "content": r["question"]}]) for r in rows]
  assert [a[0] for a in asked] == prompts and asked[0][1]["until"] == ["\n"]  # --apply_chat_template
  assert [s["resps"][0][0] for s in gen] == lm.generate_until(_reqs("generate_until", asked))
  mc = sorted(samples["fotjax_tiny_mc"], key=lambda s: s["doc_id"])
  asked = [tuple(a.values()) for s in mc for a in s["arguments"].values()]
  assert [a[1].strip() for a in asked] == [c.strip() for r in rows for c in r["choices"]]
  scores = lm.loglikelihood(_reqs("loglikelihood", asked))
  assert [float(x[0][0]) for s in mc for x in s["resps"]] == pytest.approx([s[0] for s in scores], abs=1e-4)
  acc = np.mean([int(np.argmax([scores[2 * i][0], scores[2 * i + 1][0]]) == r["label"]) for i, r in enumerate(rows)])
  assert res["results"]["fotjax_tiny_mc"]["acc,none"] == pytest.approx(acc)


@pytest.mark.parametrize("args,message", [
    ("checkpoint={ck},windw=8", "windw: unknown argument"),
    ("checkpoint={ck},window=abc", "window: expected an integer >= 1, got 'abc'"),
    ("window=8", "checkpoint: required"),
    ("checkpoint={ck},mem_layers=1:x", "mem_layers: expected 0-based layers separated by ':'"),
    ("checkpoint={ck},mode=approx", "mode: expected one of dense|topk|host"),
    ("checkpoint={ck},mode=host,host_index=hnsw", "host_index: expected one of flat|ivf"),
    ("checkpoint={ck},nprobe=4", "nprobe: only for mode=host, not mode=dense"),
    ("checkpoint={ck},mode=host,host_index=flat,nprobe=4", "nprobe: only for host_index=ivf"),
    ("checkpoint={ck},rope_scaling=yarn", "rope_scaling: expected TYPE:FACTOR or TYPE:FACTOR:ORIGINAL_POSITIONS"),
    ("checkpoint={ck},rope_scaling=warp:4", "rope_scaling: "),
])
def test_bad_model_args_one_line(ckpt, tmp_path, capsys, args, message):
  _tasks(tmp_path)
  with pytest.raises(SystemExit) as e:
    lm_harness.main(["--model", "fot_jax", "--model_args", args.format(ck=ckpt), "--include_path", str(tmp_path),
                     "--tasks", "fotjax_tiny_mc"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err[-1].startswith("fot_jax.eval.lm_harness: fot_jax model_args: ")
  assert message in err[-1]


def test_model_errors_name_the_argument(ckpt, tmp_path):
  with pytest.raises(ValueError, match=r"^fot_jax model_args: checkpoint: .*nowhere.*neither an fot_jax checkpoint"):
    lm_harness.FotJaxLM(checkpoint=str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match=r"^fot_jax model_args: last_context_length: must be in 0..window \(8\)"):
    lm_harness.FotJaxLM(checkpoint=ckpt, window=8, last_context_length=9)
  args = lm_harness.settings({"pretrained": ckpt, "mem_layers": "6:17:18:20", "batch_size": "4"})
  assert (args.checkpoint, args.mem_layers, args.batch_size) == (ckpt, (6, 17, 18, 20), 4)
  assert lm_harness.settings({"checkpoint": ckpt, "mem_layers": None}).mem_layers == ()  # lm-eval reads 'none' as None
  assert lm_harness.settings({"checkpoint": ckpt, "mem_layers": "all"}).mem_layers == "all"
  assert lm_harness.with_tokenizer(f"pretrained={ckpt},window=8") == {"pretrained": ckpt, "window": 8,
                                                                      "tokenizer": chat.tokenizer_dir(ckpt)}


def test_rope_scaling_and_attention_impl_reach_the_model(lm, ckpt):
  """rope_scaling=yarn:4:8 and attention_impl=blockwise read text as from_pretrained with those
  ModelConfig fields does (the YaRN row of a comparison), and not as the plain checkpoint."""
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
  scaled = lm_harness.FotJaxLM(checkpoint=ckpt, window=W, rope_scaling="yarn:4:8", attention_impl="blockwise")
  assert dict(scaled.model.cfg.rope_scaling) == yarn and scaled.model.cfg.attention_impl == "blockwise"
  text = "x = 1"
  ids = [scaled.bos] + scaled.tok_encode(text)
  assert len(ids) <= W
  (got,), (plain,) = (m.loglikelihood_rolling(_reqs("loglikelihood_rolling", [(text,)])) for m in (scaled, lm))
  want = _logp(_plain(from_pretrained(ckpt, rope_scaling=yarn, attention_impl="blockwise"), ids), ids[1:])[0].sum()
  assert got == pytest.approx(want, abs=1e-3) and abs(got - plain) > 1e-3
