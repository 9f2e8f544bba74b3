.PHONY: setup test serve bench bench-peers

setup:
	bash scripts/setup.sh

test: setup
	python -m pytest -q -x

serve: setup
	tokenmill serve

bench:
	python benchmarks/bench_engine.py

# tokenmill against hf-generate, transformers serve and llama-server (docs/benchmarks.md)
bench-peers: setup
	bash scripts/build_peers.sh
	tokenmill bench peers --datasets shared-prefix,mixed --concurrency 1,16 --num-prompts 6,32 \
		--output-len 64 --hf-num-prompts 4 --max-duration 60 \
		--output-json benchmarks/results/bench_peers.json --plot-dir docs/img --plot-prefix bench_peers
