# Two entry points: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
# Each creates the virtualenv $(VENV) with python3 (3.11 or newer) on first use.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: demo test setup clean train-tiny train-demo train-reference train-reference-sweeps \
	accelerator-check

# pip builds the native CPU kernels (spsjax/native) too: rebuild when their sources change.
$(VENV)/.installed: setup.py pyproject.toml $(wildcard spsjax/native/*.cc spsjax/native/*.h spsjax/native/*.inc)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# The main job: datasets, tokenizer, the demo target and its distilled draft (skipped when their
# checkpoints are complete), then a short speedup table (results/speedup_demo/).
demo: train-demo
	$(PY) experiments/speedup_table.py --config=configs/speedup.py:root=checkpoints/demo,draft=draft_wide_distill,demo

# Two pytest workers (pytest-xdist), a test file each at a time, the longest files first
# (tests/conftest.py's LONGEST_FIRST): the suite is mostly XLA compiles of small programs, each on
# one core (~19 min on a 2-core AVX2 EPYC with the tests' XLA flags, tests/xla_env.py).
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

# Exactness, one program per generation and decode figures on the default JAX backend (a GPU or
# TPU: bench150m and llama1b; a CPU: tiny sizes); the report goes to results/accelerator_check.md.
accelerator-check: $(VENV)/.installed
	$(PY) experiments/accelerator_check.py

# The tiny family (tokenizer, target, wide-shallow draft) in checkpoints/tiny; resumes if killed.
train-tiny: $(VENV)/.installed
	$(PY) experiments/train.py --config=configs/train.py:size=tiny,model=target
	$(PY) experiments/train.py --config=configs/train.py:size=tiny,model=draft_wide

# The demo family (tokenizer, target, wide-shallow draft distilled from it) in checkpoints/demo.
train-demo: $(VENV)/.installed
	$(PY) experiments/train.py --config=configs/train.py:size=demo,model=target
	$(PY) experiments/train.py --config=configs/train.py:size=demo,model=draft_wide,distill=1

# The reference pair Table 1 measures, in checkpoints/reference, one run after the other: the target
# (2000 steps, ~50 min of both cores on a 2-core Zen 3), its best draft, the target's first layer
# distilled for 3000 steps (draft_trunc_distill_3000, ~40 min there), and an EAGLE head over the
# target's features (feature, 2000 steps, ~38 min on a 2-vCPU Xeon Cascade Lake) and six parallel
# heads (heads, 600 steps, ~33 min there). Every run resumes from its last checkpoint and a
# finished one is skipped, so after an interruption the same command continues where it
# stopped:  nohup make train-reference > train_reference.log 2>&1 &
REFERENCE_RUNS := model=target model=draft_trunc,distill=1,steps=3000,name=draft_trunc_distill_3000 \
	model=feature,steps=2000 model=heads
train-reference: $(VENV)/.installed
	set -e; for run in $(REFERENCE_RUNS); do \
	  $(PY) experiments/train.py --config=configs/train.py:size=reference,$$run; done

# The drafts of Figure 1's sweeps (after train-reference), on the same 2-core machine: the wide, mid
# and deep topologies, plain and distilled, 600 steps each (~4 min on the LM loss, ~8 min
# distilled), then the wide draft distilled for 3000 steps (~40 min), by total variation on its own
# samples (600 steps, on-policy: slower than plain distillation; not timed) and for 8000 steps
# (not timed; ~8/3 of the 3000-step run).
SWEEP_RUNS := model=draft_wide,distill=1 model=draft_wide model=draft_mid model=draft_deep \
	model=draft_mid,distill=1 model=draft_deep,distill=1 \
	model=draft_wide,distill=1,steps=3000,name=draft_wide_distill_3000 \
	model=draft_wide,distill=1,divergence=tv,distill_data=student \
	model=draft_wide,distill=1,steps=8000,name=draft_wide_distill_8000
train-reference-sweeps: train-reference
	set -e; for run in $(SWEEP_RUNS); do \
	  $(PY) experiments/train.py --config=configs/train.py:size=reference,$$run; done

clean:
	rm -rf $(VENV) *.egg-info
