#!/usr/bin/env bash
# Installs what building tpfuse needs and is missing, and only that:
#   - libclang and clang's headers (for bindgen), with apt, when not found;
#   - boost.context (libboost-context-dev, for the CPU emulator's fibers), with apt;
#   - when no CUDA toolkit is found (NVCC, CUDA_HOME, CUDA_PATH, nvcc on PATH,
#     /usr/local/cuda), the pinned CUDA 13.0 wheels from PyPI in a project-local virtual
#     environment (.venv), with NCCL;
#   - with a system toolkit but no nccl.h, only the pinned NCCL wheel, in .venv.
# A second run installs nothing. Prints the environment to use, one `export` a line, so that
# callers can `eval "$(scripts/setup.sh)"`. Progress goes to stderr.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
log() { echo "setup: $*" >&2; }

# Pinned, every one: unpinned, nvcc's own dependencies float to newer releases whose PTX
# the 13.0 drivers cannot load.
CUDA_WHEELS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
)
NCCL_WHEEL=nvidia-nccl-cu13==2.28.9

apt_updated=""
apt_install() {
  local sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  if [ -z "$apt_updated" ]; then
    $sudo_cmd apt-get update -qq >&2
    apt_updated=1
  fi
  log "installing $* with apt"
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$@" >/dev/null
}

first_existing() {
  for f in "$@"; do
    [ -e "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}

# bindgen needs libclang itself and clang's builtin headers (stddef.h): both in libclang-dev.
have_libclang() {
  first_existing ${LIBCLANG_PATH:+"$LIBCLANG_PATH"/libclang*.so*} /usr/lib/llvm-*/lib/libclang*.so* \
    /usr/lib/*-linux-gnu/libclang-*.so* /usr/lib64/libclang.so* >/dev/null &&
    first_existing /usr/lib/llvm-*/lib/clang/*/include/stddef.h /usr/lib/clang/*/include/stddef.h \
      /usr/lib64/clang/*/include/stddef.h >/dev/null
}
have_libclang || apt_install libclang-dev

# The CPU emulator (cargo feature `emulator`, run by scripts/test.sh) switches fibers with
# boost.context.
[ -f /usr/include/boost/context/detail/fcontext.hpp ] &&
  first_existing /usr/lib/*-linux-gnu/libboost_context.so /usr/lib64/libboost_context.so >/dev/null ||
  apt_install libboost-context-dev

# The same search order as build.rs.
system_nvcc() {
  if [ -n "${NVCC:-}" ] && [ -x "$NVCC" ]; then echo "$NVCC"; return 0; fi
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then echo "$d/bin/nvcc"; return 0; fi
  done
  command -v nvcc 2>/dev/null && return 0
  first_existing /usr/local/cuda/bin/nvcc
}

# Installs the given pinned wheels into .venv unless every one is there already.
venv_install() {
  local want have missing
  want=$(printf '%s\n' "$@" | tr 'A-Z_' 'a-z-' | sort)
  have=""
  [ -x "$venv/bin/pip" ] && have=$("$venv/bin/pip" freeze 2>/dev/null | tr 'A-Z_' 'a-z-' | sort)
  missing=$(comm -23 <(echo "$want") <(echo "$have"))
  [ -z "$missing" ] && return 0
  if [ ! -x "$venv/bin/python" ]; then
    command -v python3 >/dev/null || apt_install python3
    python3 -c 'import ensurepip' 2>/dev/null || apt_install python3-venv
    python3 -m venv "$venv" >&2
  fi
  log "installing into $venv: $(echo $missing)"
  "$venv/bin/pip" install -q --disable-pip-version-check "$@" >&2
}

site_nvidia() {
  "$venv/bin/python" -c 'import os, nvidia; print(os.path.dirname(list(nvidia.__path__)[0] + "/"))'
}

if nvcc_path=$(system_nvcc); then
  log "using the CUDA toolkit of $nvcc_path"
  cuda_root=$(dirname "$(dirname "$nvcc_path")")
  if ! first_existing ${NCCL_INCLUDE_DIR:+"$NCCL_INCLUDE_DIR"/nccl.h} ${NCCL_HOME:+"$NCCL_HOME"/include/nccl.h} \
      "$cuda_root/include/nccl.h" /usr/include/nccl.h /usr/local/include/nccl.h >/dev/null; then
    venv_install "$NCCL_WHEEL"
    nv=$(site_nvidia)
    echo "export NCCL_HOME=$nv/nccl"
    echo "export TPFUSE_NCCL_LIB=$nv/nccl/lib/libnccl.so.2"
  fi
else
  venv_install "${CUDA_WHEELS[@]}" "$NCCL_WHEEL"
  nv=$(site_nvidia)
  # The CUDA 13 wheels share one root, nvidia/cu13 (bin/, include/, lib/); NCCL has its own.
  [ -x "$nv/cu13/bin/nvcc" ] || { log "nvcc is not where the wheels put it ($nv/cu13/bin)"; exit 1; }
  echo "export NVCC=$nv/cu13/bin/nvcc"
  echo "export CUDA_HOME=$nv/cu13"
  echo "export NCCL_HOME=$nv/nccl"
  echo "export TPFUSE_NCCL_LIB=$nv/nccl/lib/libnccl.so.2"
fi

# cudarc's build (its default CUDA version, `cuda-version-from-build-system`) runs the `nvcc`
# on PATH: put the toolkit's bin/ first unless that nvcc is already the one found.
nvcc_used=${nvcc_path:-$nv/cu13/bin/nvcc}
if [ "$(command -v nvcc 2>/dev/null)" != "$nvcc_used" ]; then
  echo "export PATH=$(dirname "$nvcc_used"):\$PATH"
fi
