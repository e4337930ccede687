# Two commands for a fresh machine: `make demo` and `make test`.
# The interpreter: PYTHON if given, else python3.11, else python3 when it is 3.11 or newer.
PYTHON ?= $(shell for candidate in python3.11 python3; do \
	$$candidate -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$candidate; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench-smoke clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || test -n "$(PYTHON)" || { echo "make: no Python 3.11 or newer found (tried python3.11, python3); run make PYTHON=/path/to/python3.11" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[engine,serve,dev,redis,mooncake,events]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hybridcache demo

# The project's suite, then the lmdeploy integration tests in their own environment (they
# drive lmdeploy 0.16.0's real Scheduler; the main environment has no lmdeploy, and without
# lmdeploy those tests fail collection rather than skip).
test: $(STAMP)
	$(BIN)/python -m pytest -q --ignore=tests/integrations
	$(MAKE) test-lmdeploy

bench-smoke: $(STAMP)
	$(BIN)/hybridcache bench all --smoke

# Model-based soak of the cache protocol (tests/reliability/soak.py, run from the repository
# root so that `tests` imports): SOAK_SECONDS (default 600) of random protocol runs, SOAK_SEED
# optional; prints the steps executed and the violations found (must be 0). `make test` runs
# the same machine for a few dozen examples only.
.PHONY: soak
soak: $(STAMP)
	$(BIN)/python -m tests.reliability.soak

# The reference implementation for `hybridcache bench --compare`: lmdeploy's CPU-side prefix
# cache (BlockTrie, checkpoint lifecycle, scheduler sequences). Installed with --no-deps so pip
# never touches torch, plus exactly the packages its scheduler-side imports need (pillow and
# packaging unpinned: the dev extras already bring them). Idempotent.
LMDEPLOY_PKGS := lmdeploy==0.18.0 \
	addict==2.4.0 annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 certifi==2026.10.19.post1 \
	h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface-hub==2.4.0 idna==3.20 \
	mmengine-lite==0.10.7 packaging pillow platformdirs==4.14.8 psutil==7.2.2 pybase64==1.5.1 \
	pydantic==2.14.4 pydantic-core==2.50.5 pyyaml==6.0.4 pyzmq==27.3.0 regex==2026.11.19 \
	requests==2.34.2 safetensors==0.8.0 shortuuid==1.0.13 termcolor==3.3.0 tqdm==4.70.1 \
	transformers==5.24.0 truststore==0.10.5 typing-inspection==0.4.5 urllib3==2.8.0 \
	xgrammar==0.2.9 yapf==0.43.0

.PHONY: compare-setup
compare-setup: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps $(LMDEPLOY_PKGS)
	$(BIN)/python -W ignore -c "import torch, lmdeploy.pytorch.paging.scheduler, lmdeploy.pytorch.strategies.ar.sequence; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('lmdeploy reference ready (torch', torch.__version__ + ')')"

# lmdeploy 0.16.0 for the adapter (hybridcache.integrations.lmdeploy), in its own environment
# beside the bench's 0.18.0: the wheel with --no-deps (pip never touches torch, CPU 2.13.0),
# plus exactly what its scheduler-side imports need, msgspec (hybridcache.cli imports
# hybridcache.events), plus hybridcache itself (editable).
# LMDEPLOY_VENV=<dir> (command line or environment) uses an environment built elsewhere by
# `make lmdeploy-env` as it is: checked, never rebuilt or reinstalled from this tree. Its
# editable install may point at another checkout, so the test targets put this tree's src first.
LMDEPLOY_VENV ?= .venv-lmdeploy
LMDEPLOY_BIN := $(abspath $(LMDEPLOY_VENV))/bin
LMDEPLOY_STAMP := $(abspath $(LMDEPLOY_VENV))/.installed-stamp
LMDEPLOY_RUN := PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(LMDEPLOY_BIN)/python
ifeq ($(origin LMDEPLOY_VENV),file)
LMDEPLOY_READY := $(LMDEPLOY_STAMP)
else
LMDEPLOY_READY := lmdeploy-venv-check
endif
LMDEPLOY16_PKGS := lmdeploy==0.16.0 $(filter-out lmdeploy==0.18.0,$(LMDEPLOY_PKGS))

$(LMDEPLOY_STAMP): pyproject.toml Makefile
	test -x $(LMDEPLOY_BIN)/python || $(PYTHON) -m venv $(LMDEPLOY_VENV)
	$(LMDEPLOY_BIN)/python -m pip install --quiet torch==2.13.0 numpy 'rich>=13' 'pytest>=8' pytest-asyncio packaging pillow msgspec==0.22.0
	$(LMDEPLOY_BIN)/python -m pip install --quiet --no-deps $(LMDEPLOY16_PKGS)
	$(LMDEPLOY_BIN)/python -m pip install --quiet --no-deps -e .
	$(LMDEPLOY_BIN)/python -W ignore -c "import lmdeploy.pytorch.paging.scheduler, hybridcache.integrations.lmdeploy as a; import lmdeploy; assert lmdeploy.__version__ == a.SUPPORTED_VERSION, lmdeploy.__version__"
	touch $(LMDEPLOY_STAMP)

.PHONY: lmdeploy-env lmdeploy-venv-check test-lmdeploy lmdeploy-conformance
lmdeploy-env: $(LMDEPLOY_STAMP)

lmdeploy-venv-check:
	@test -f $(LMDEPLOY_STAMP) || { echo "make: $(LMDEPLOY_VENV) is not an environment built by make lmdeploy-env (no .installed-stamp)" >&2; exit 1; }

test-lmdeploy: $(LMDEPLOY_READY)
	$(LMDEPLOY_RUN) -m pytest -q -p no:cacheprovider --confcutdir=tests/integrations tests/integrations

# lmdeploy's own tests (tag v0.16.0, from a snapshot of the public repository: never in this
# repository) against the adapter: LMDEPLOY_TESTS=<dir holding tests/pytorch>. Local only.
LMDEPLOY_CONFORMANCE := tests/pytorch/paging/test_scheduler.py tests/pytorch/engine/test_inputs_maker.py \
	tests/pytorch/paging/test_block_trie/test_trie.py tests/pytorch/paging/test_block_trie/test_checkpoint_lifecycle.py
# Tests of lmdeploy's private internals, not applicable to a replacement (reasons: docs/integrations.md).
LMDEPLOY_TRIE_TESTS := tests/pytorch/paging/test_block_trie/test_trie.py::TestBlockTrie
LMDEPLOY_LIFECYCLE_TESTS := tests/pytorch/paging/test_block_trie/test_checkpoint_lifecycle.py::TestStateCheckpointLifecycle
LMDEPLOY_NOT_APPLICABLE := $(LMDEPLOY_TRIE_TESTS)::test_recompute_overlap_cursor_rebuilds_after_eviction \
	$(LMDEPLOY_LIFECYCLE_TESTS)::test_ssm_checkpoint_published_index_is_idempotent \
	$(LMDEPLOY_LIFECYCLE_TESTS)::test_ssm_checkpoint_unindex_removes_duplicate_entries \
	$(LMDEPLOY_LIFECYCLE_TESTS)::test_ssm_checkpoint_publish_failure_discards_detached_pending_slot \
	$(LMDEPLOY_LIFECYCLE_TESTS)::test_ssm_checkpoint_publish_index_error_rolls_back_publication \
	$(LMDEPLOY_LIFECYCLE_TESTS)::test_ssm_checkpoint_replaces_partial_variant_at_same_anchor \
	$(LMDEPLOY_LIFECYCLE_TESTS)::test_evict_ssm_releases_state_checkpoint
lmdeploy-conformance: $(LMDEPLOY_READY)
	test -n "$(LMDEPLOY_TESTS)" || (echo "set LMDEPLOY_TESTS to a directory holding lmdeploy v0.16.0's tests/pytorch" && false)
	cd $(LMDEPLOY_TESTS) && $(LMDEPLOY_RUN) -m pytest -q -p no:cacheprovider \
		-p hybridcache.integrations.lmdeploy.pytest_plugin $(LMDEPLOY_CONFORMANCE) \
		$(addprefix --deselect ,$(LMDEPLOY_NOT_APPLICABLE))

clean:
	rm -rf $(VENV) .venv-lmdeploy build src/*.egg-info .pytest_cache
