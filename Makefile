.PHONY: setup test serve bench bench-peers

# Reports are named <benchmark>-<machine kind>-<date>.json (docs/benchmarks.md).
MACHINE_KIND ?= $(shell if grep -q "AMD EPYC" /proc/cpuinfo 2>/dev/null; then echo amd-epyc; \
	elif grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then echo intel-xeon-amx; else echo cpu; fi)
DATE := $(shell date +%F)

setup:
	bash scripts/setup.sh

test: setup
	python -m pytest -q -x

serve: setup
	tokenmill serve

bench:
	python benchmarks/bench_engine.py \
		--output-json benchmarks/results/bench_engine-$(MACHINE_KIND)-$(DATE).json

# tokenmill against hf-generate, transformers serve and llama-server (docs/benchmarks.md)
bench-peers: setup
	bash scripts/build_peers.sh
	tokenmill bench peers --datasets shared-prefix,mixed --concurrency 1,16 --num-prompts 6,32 \
		--output-len 64 --hf-num-prompts 4 --max-duration 60 \
		--output-json benchmarks/results/bench_peers-$(MACHINE_KIND)-$(DATE).json \
		--plot-dir docs/img --plot-prefix bench_peers
