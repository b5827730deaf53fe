# The two commands of the README: `make demo` and `make test`. Both set up everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch lies on disk on these machines; a range would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint typecheck unit install dev etcd clean bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev,etcd]"
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

# etcd comes from Debian's etcd-server package (binary /usr/bin/etcd).
etcd:
	@command -v etcd >/dev/null 2>&1 || { \
		echo "installing etcd-server (Debian)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; }

demo: $(VENV)/.installed
	$(BIN)/cellmesh demo

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check cellmesh comm services coordinator tests bench examples
	$(BIN)/mypy

# three test processes on two cores: the multi-process tests spend much of their time waiting (process
# starts, rendezvous, sockets), so two left the cores a quarter idle (measured: 9:58 with -n 2, 8:10 with -n 3).
# The type check (half a minute) runs beside the tests, in those idle moments; either failing fails the target.
test: $(VENV)/.dev-installed etcd
	$(BIN)/ruff check cellmesh comm services coordinator tests bench examples
	@$(BIN)/mypy > .mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --max-worker-restart 0; tests=$$?; \
	wait $$mypy; typed=$$?; cat .mypy.log; rm -f .mypy.log; \
	if [ $$typed -ne 0 ]; then echo "make test: mypy failed (above)"; fi; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

bench: $(VENV)/.installed
	$(BIN)/python bench/comm.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
