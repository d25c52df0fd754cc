#!/usr/bin/env bash
# Build llama.cpp, a peer in `specdecode bench --speed --llama-cpp BIN_DIR` (never a dependency), from the
# llama-cpp-python sdist on PyPI (it vendors llama.cpp; PyPI is reachable where GitHub may not be).
#
#   scripts/build_llama_cpp.sh DEST [VERSION]     # VERSION defaults to 0.3.36
#
# Idempotent: the sdist is downloaded, unpacked and configured only once; cmake rebuilds only what changed.
# CPU only, one build job per core, at the lowest priority. Prints the bin directory to pass to --llama-cpp.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 DEST [VERSION]   (builds llama.cpp under DEST; prints its bin directory)" >&2
    exit 2
fi
DEST=$(mkdir -p "$1" && cd "$1" && pwd)
VERSION=${2:-0.3.36}
SRC="$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp"
JOBS=$(nproc)

if [[ ! -f "$DEST/llama_cpp_python-$VERSION.tar.gz" ]]; then
    python -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$DEST"
fi
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    tar -xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST"
fi

cd "$SRC"
if [[ ! -f build/CMakeCache.txt ]]; then
    # LLAMA_CURL is gone from recent llama.cpp (it became LLAMA_OPENSSL); both are off: nothing is downloaded.
    nice -n 19 cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
fi

# What the benchmark runs first; llama-cli (which links the whole server) last, and only if it builds.
nice -n 19 cmake --build build -j"$JOBS" \
    --target llama-completion llama-lookup llama-tokenize llama-quantize llama-bench
nice -n 19 cmake --build build -j"$JOBS" --target llama-cli || echo "llama-cli did not build (not needed by the bench)" >&2

echo "llama.cpp binaries: $SRC/build/bin"
echo "use: specdecode bench --speed --llama-cpp $SRC/build/bin"
