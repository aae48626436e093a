# `make train` and `make test` create .venv on first use (a stamp makes later calls instant).
# To use an interpreter you already have (e.g. a GPU image with CUDA torch and no network):
#   make test PYTHON=python3
# make test runs every test on two pytest workers (pytest-xdist, in the venv; each takes whole test
# files) and prints the 15 slowest; make test-fast leaves out those marked slow, for an edit-test
# loop. JOBS=1 for one worker; with PYTHON=, whose interpreter may lack xdist, one unless JOBS says
# otherwise.
VENV := .venv
ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
ENV := $(VENV)/.stamp
JOBS ?= 2
else
ENV :=
JOBS ?= 1
endif
ARGS ?=
# make bench: the scaffold vs a bare loop, then the checkpoint stall (bench/; a benchmark, not a test).
# BENCH_CONFIG and BENCH_OVERRIDES (key=value ...) go to both, ARGS (e.g. --variant) to the first.
BENCH_CONFIG ?= configs/default.yaml
BENCH_OVERRIDES ?=
BENCH_STEPS ?= 50
BENCH_REPS ?= 3

.PHONY: train test test-fast verify profile bench new-project clean
train: $(ENV)
	$(PYTHON) train.py $(ARGS)

# make verify: audits on a config (resume, determinism, accumulation, clipping, data, eval; ddp
# with --nproc 2): ARGS="--config configs/mnist.yaml" or any overrides (tools/verify.py)
verify: $(ENV)
	$(PYTHON) -m tools.verify $(ARGS)

profile: $(ENV)
	rm -rf runs/profile  # a fresh profile each time (with ARGS="run.out_dir=X": a new X each time)
	$(PYTHON) train.py run.out_dir=runs/profile train.max_steps=8 train.profile=true $(ARGS)

bench: $(ENV)
	$(PYTHON) -m bench.loop_vs_bare --config $(BENCH_CONFIG) --steps $(BENCH_STEPS) --reps $(BENCH_REPS) \
		$(ARGS) $(BENCH_OVERRIDES)
	$(PYTHON) -m bench.ckpt_stall --config $(BENCH_CONFIG) --reps $(BENCH_REPS) $(BENCH_OVERRIDES)

PYTEST = $(PYTHON) -m pytest $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile)

test: $(ENV)
	$(PYTEST) --durations=15 $(ARGS)

test-fast: $(ENV)
	$(PYTEST) -m "not slow" $(ARGS)

# make new-project DEST=../myproj [EXAMPLES=1]: a project of your own, ready to train (EXAMPLES=0, no or false: none)
# (tools/new_project.py); it copies files, so any python3 does.
new-project:
	@test -n "$(DEST)" || { echo "make new-project: DEST is not set; expected a new directory, e.g. make new-project DEST=../myproj" >&2; exit 2; }
	python3 -m tools.new_project "$(DEST)" $(if $(filter-out 0 no false,$(EXAMPLES)),--examples)

$(VENV)/.stamp: requirements.lock pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.lock
	touch $@

# make clean: the venv and the prepared data cache, both made again on demand; never runs/, whose
# checkpoints and results are the user's to delete.
clean:
	rm -rf $(VENV) data/cache
