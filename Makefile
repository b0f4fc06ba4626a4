# `make demo` and `make test` set everything up on a fresh machine (scripts/bootstrap.sh) and run.
PY := .venv/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED := 1
# Open MPI refuses root without these; containers and CI run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup demo dlrm stream-demo test test-quick test-image bench bench-short
setup:
	@bash scripts/bootstrap.sh

RANKS ?= 2
demo: setup
	.venv/bin/mpiexec --oversubscribe -np $(RANKS) $(PY) examples/wide_deep.py $(ARGS)

# DLRM on Criteo Kaggle-shaped data read from Parquet (examples/dlrm.py; ARGS="--format tfrecord" for the
# same samples from TFRecord): the data is written once.
DLRM_DATA ?= /tmp/shardrec-dlrm
dlrm: setup
	@[ -d $(DLRM_DATA)/parquet ] || $(PY) examples/dlrm.py write --out $(DLRM_DATA)
	.venv/bin/mpiexec --oversubscribe -np $(RANKS) $(PY) examples/dlrm.py train --data $(DLRM_DATA) $(ARGS)

# Online training: a Redis server, a producer of click events and the job on 2 ranks, for a minute
# (examples/stream_wide_deep.py; ARGS="--source directory" for a directory stream).
stream-demo: setup
	$(PY) examples/stream_wide_deep.py demo $(ARGS)

# Two workers, each taking a whole test file at a time (its module fixtures are built once): the
# suite waits on process start-ups and timeouts a third of its time, which the other worker fills.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-quick: setup
	$(PY) -m pytest -m quick $(ARGS)

# The container image and the multi-container runs (root, podman; about 12 minutes the first time on 2 cores).
test-image:
	bash docker/test-image.sh

# The benchmark's own peer (not needed by the tests): TFRA 0.7.2 is the last release for TF 2.15.
bench-setup: setup
	@$(PY) -c "import tensorflow_recommenders_addons" 2>/dev/null || \
	  $(PY) -m pip install -q --no-deps tensorflow-recommenders-addons==0.7.2

bench: bench-setup
	$(PY) bench/run.py $(ARGS)

bench-short: bench-setup
	$(PY) bench/run.py --short $(ARGS)
