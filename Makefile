PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test demo lint

$(STAMP): pyproject.toml
	test -d .venv || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/demo.py

lint: $(STAMP)
	$(PY) -m ruff check .
