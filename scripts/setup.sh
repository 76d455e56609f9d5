#!/usr/bin/env bash
# Installs what building tpfuse needs and is missing, and only that:
#   - libclang (for bindgen), from apt, when no libclang.so is found;
#   - when no CUDA toolkit is found, the pinned CUDA 13.0 + NCCL wheels from PyPI
#     into a project-local virtual environment (.venv).
# A second run installs nothing. Prints the environment to use, one `export` a line,
# so that callers can `eval "$(scripts/setup.sh)"`. Progress goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "setup: $*" >&2; }

# Pinned: unpinned, nvcc's own dependencies float to releases whose PTX the
# 13.0 drivers cannot load.
WHEELS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-nccl-cu13==2.28.9
)

have_libclang() {
  # bindgen needs libclang itself and clang's builtin headers (stddef.h), both in libclang-dev.
  local lib="" hdr=""
  for f in ${LIBCLANG_PATH:+"$LIBCLANG_PATH"/libclang*.so*} /usr/lib/llvm-*/lib/libclang*.so* \
           /usr/lib/*-linux-gnu/libclang-*.so* /usr/lib64/libclang.so*; do
    [ -e "$f" ] && { lib=$f; break; }
  done
  for f in /usr/lib/llvm-*/lib/clang/*/include/stddef.h /usr/lib/clang/*/include/stddef.h \
           /usr/lib64/clang/*/include/stddef.h; do
    [ -e "$f" ] && { hdr=$f; break; }
  done
  [ -n "$lib" ] && [ -n "$hdr" ]
}

if ! have_libclang; then
  log "libclang not found: installing libclang-dev with apt"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq libclang-dev >/dev/null
fi

system_cuda() {
  # The same search order as build.rs.
  if [ -n "${NVCC:-}" ] && [ -x "${NVCC}" ]; then echo "$NVCC"; return 0; fi
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then echo "$d/bin/nvcc"; return 0; fi
  done
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return 0; fi
  if [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda/bin/nvcc; return 0; fi
  return 1
}

venv="$root/.venv"
if nvcc_path=$(system_cuda); then
  log "using the CUDA toolkit at $nvcc_path"
else
  site_nvidia() { "$venv/bin/python" -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0] + "/"))' 2>/dev/null; }
  want=$(printf '%s\n' "${WHEELS[@]}")
  have=$([ -x "$venv/bin/pip" ] && "$venv/bin/pip" freeze 2>/dev/null | grep -i '^nvidia-' | tr 'A-Z_' 'a-z-' || true)
  missing=$(comm -23 <(echo "$want" | tr 'A-Z_' 'a-z-' | sort) <(echo "$have" | sort))
  if [ -n "$missing" ]; then
    log "no CUDA toolkit found: installing the pinned wheels into $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check "${WHEELS[@]}" >&2
  fi
  nv=$(site_nvidia)
  # The wheels keep nvcc under nvidia/cu13/bin and the headers/libs under nvidia/cu13.
  cu="$nv/cu13"
  nvcc_path="$cu/bin/nvcc"
  [ -x "$nvcc_path" ] || { log "nvcc not found in the wheels at $nvcc_path"; exit 1; }
  echo "export NVCC=$nvcc_path"
  echo "export CUDA_HOME=$cu"
  nccl_dir=$(dirname "$(ls "$nv"/nccl/include/nccl.h "$cu"/include/nccl.h 2>/dev/null | head -n1)")
  echo "export NCCL_HOME=$(dirname "$nccl_dir")"
  lib=$(dirname "$(ls "$nv"/nccl/lib/libnccl.so* "$cu"/lib/libnccl.so* 2>/dev/null | head -n1)")
  echo "export TPFUSE_NCCL_LIB=$(ls "$lib"/libnccl.so* | head -n1)"
fi
