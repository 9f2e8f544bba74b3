#!/usr/bin/env bash
# Builds the peers that `tokenmill bench peers` measures tokenmill against; on demand, never in CI.
# llama.cpp's llama-server, llama-bench and llama-batched-bench are built from the llama.cpp source
# vendored in the llama-cpp-python sdist on PyPI (no other download), into
# ${TOKENMILL_PEERS_DIR:-~/.cache/tokenmill/peers}, outside the repository; the binaries are linked
# from $PEERS_DIR/bin. About 6 minutes on 2 cores (15 on an AMX CPU, which builds llama-batched-bench
# a second time, below). Safe to run again: a finished build is kept.
set -euo pipefail
VERSION=0.3.36
PEERS_DIR="${TOKENMILL_PEERS_DIR:-$HOME/.cache/tokenmill/peers}"
JOBS="${JOBS:-2}"
SOURCE="$PEERS_DIR/llama_cpp_python-$VERSION"
TARGETS=(llama-server llama-bench llama-batched-bench)

if [ -x "$PEERS_DIR/bin/llama-server" ] && [ -x "$PEERS_DIR/bin/llama-bench" ] \
    && [ -x "$PEERS_DIR/bin/llama-batched-bench" ]; then
  echo "llama.cpp peers already built in $PEERS_DIR/bin"
  exit 0
fi
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
  apt-get update -qq && apt-get install -y -qq cmake build-essential
fi
mkdir -p "$PEERS_DIR/bin"
if [ ! -d "$SOURCE" ]; then
  download="$(mktemp -d)"
  python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$download"
  tar -xzf "$download/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS_DIR"
  rm -rf "$download"
fi
cd "$SOURCE/vendor/llama.cpp"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF
cmake --build build -j"$JOBS" --target "${TARGETS[@]}"
# The binaries find their shared ggml/llama libraries through the build tree's rpath, so the tree
# stays where it is and bin/ only links to it.
for target in "${TARGETS[@]}"; do
  ln -sf "$PWD/build/bin/$target" "$PEERS_DIR/bin/$target"
done
# ggml's AMX kernels die by SIGILL (at tilezero) once 4 or more sequences decode together (gdb on
# an Intel Xeon with AMX, 2026-12-06), so on an AMX CPU llama-batched-bench is built again without
# them, with the AVX-512 extensions the CPU has: the reference bench_engine.py runs.
if grep -qw amx_tile /proc/cpuinfo; then
  flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
         -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  for extension in avx512vbmi:VBMI avx512_vnni:VNNI avx512_bf16:BF16; do
    if grep -qw "${extension%%:*}" /proc/cpuinfo; then
      flags+=("-DGGML_AVX512_${extension##*:}=ON")
    fi
  done
  cmake -B build-noamx -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF "${flags[@]}"
  cmake --build build-noamx -j"$JOBS" --target llama-batched-bench
  ln -sf "$PWD/build-noamx/bin/llama-batched-bench" "$PEERS_DIR/bin/llama-batched-bench"
fi
echo "built: $(ls "$PEERS_DIR/bin")"
