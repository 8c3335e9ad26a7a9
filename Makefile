PYTHON ?= python3

.PHONY: install demo test test-fast

install:
	PYTHON=$(PYTHON) scripts/install.sh

# The main job: generate with the embedded default model (shipped in the package).
demo:
	PYTHON=$(PYTHON) scripts/install.sh serve
	$(PYTHON) -m torch_shift generate "And God said" "In the beginning" --max-tokens 40

# Every test, the slow ones included (what CI runs).
test:
	PYTHON=$(PYTHON) scripts/install.sh serve,dev
	$(PYTHON) -m pytest -q --timeout=900 tests

# The quick subset, while developing (the dev extras installed first where pytest is missing, as after `make demo`).
test-fast:
	$(PYTHON) -c "import pytest" 2>/dev/null || PYTHON=$(PYTHON) scripts/install.sh serve,dev
	$(PYTHON) -m pytest -q -m "not slow" tests
