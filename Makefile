PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: test demo lint sysdeps

$(STAMP): pyproject.toml
	test -d .venv || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

# Debian packages a dependency needs: libibverbs1 for the Mooncake store's transfer engine (libibverbs.so.1)
sysdeps:
	@if ! /sbin/ldconfig -p | grep -q libibverbs.so.1; then \
	  sudo=""; if [ "$$(id -u)" != 0 ]; then sudo=sudo; fi; \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends libibverbs1; \
	fi

test: sysdeps $(STAMP)
	$(PY) -m ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

# the layout A/B on the built-in trained pair: 5 layouts x 2 contexts x 3 concurrencies, with and without DDTree
DEMO_ARGS := -m parallel=tp8,ep8,dp8_ep8,tp2_ep4,tp2xdp4_ep8 model=tiny_kimi 'bench.context=[32,96]' 'bench.concurrency=[1,2,4]' \
	'bench.spec=[none,ddtree]' bench.output_len=4 bench.warmup=4 bench.output_dir=outputs/demo

demo: sysdeps $(STAMP)
	rm -rf outputs/demo
	OMP_NUM_THREADS=1 $(PY) scripts/bench_layouts.py $(DEMO_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
