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
