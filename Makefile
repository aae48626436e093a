# `make train` and `make test` create .venv on first use (a stamp makes later calls instant).
# To use an interpreter you already have (e.g. a GPU image with CUDA torch and no network):
#   make test PYTHON=python3
VENV := .venv
ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
ENV := $(VENV)/.stamp
else
ENV :=
endif
ARGS ?=

.PHONY: train test profile clean
train: $(ENV)
	$(PYTHON) train.py $(ARGS)

profile: $(ENV)
	rm -rf runs/profile  # a fresh profile each time
	$(PYTHON) train.py run.out_dir=runs/profile train.max_steps=8 train.profile=true $(ARGS)

test: $(ENV)
	$(PYTHON) -m pytest $(ARGS)

$(VENV)/.stamp: requirements.lock pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.lock
	touch $@

clean:
	rm -rf $(VENV) runs data/cache
