# Two entry points: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
# Each creates the virtualenv $(VENV) with python3 (3.11 or newer) on first use.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: demo test setup clean train-tiny

# pip builds the native CPU kernels (spsjax/native) too: rebuild when their sources change.
$(VENV)/.installed: setup.py pyproject.toml $(wildcard spsjax/native/*.cc spsjax/native/*.h spsjax/native/*.inc)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# The main job: datasets, tokenizer, tiny target and draft (skipped when their checkpoints are
# complete), then a short speedup table (results/speedup_tiny/).
demo: train-tiny
	$(PY) experiments/speedup_table.py --config=configs/speedup.py:root=checkpoints/tiny,demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

# The tiny family (tokenizer, target, wide-shallow draft) in checkpoints/tiny; resumes if killed.
train-tiny: $(VENV)/.installed
	$(PY) experiments/train.py --config=configs/train.py:size=tiny,model=target
	$(PY) experiments/train.py --config=configs/train.py:size=tiny,model=draft_wide

clean:
	rm -rf $(VENV) *.egg-info
