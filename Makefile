# `make demo` and `make test` set everything up on a fresh machine (scripts/bootstrap.sh) and run.
PY := .venv/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED := 1
# Open MPI refuses root without these; containers and CI run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup demo test
setup:
	@bash scripts/bootstrap.sh

RANKS ?= 2
demo: setup
	.venv/bin/mpiexec --oversubscribe -np $(RANKS) $(PY) examples/wide_deep.py $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)
