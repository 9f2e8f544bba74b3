.PHONY: setup test serve bench

setup:
	bash scripts/setup.sh

test: setup
	python -m pytest -q -x

serve: setup
	tokenmill serve

bench:
	python benchmarks/bench_engine.py
