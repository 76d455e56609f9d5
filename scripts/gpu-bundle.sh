#!/usr/bin/env bash
# Builds the GPU test and bench binaries and the tpfuse CLI here (no GPU needed), for one
# CUDA architecture, and packs them with a run.sh for a GPU machine that has no Rust
# toolchain and no network:
#
#   dist/tpfuse-gpu-bundle/
#     bin/tpfuse            the CLI (doctor, selftest)
#     tests/gpu_*           the gpu-tests binaries (cargo test --release --features gpu-tests)
#     benches/*             the criterion bench binaries (every benches/*.rs)
#     run.sh                runs everything there; see its header
#     BUILD-INFO            what was built, from which commit, for which architecture
#   dist/tpfuse-gpu-bundle.tar.xz   the same, packed (about 9 MB against 86 MB unpacked: every
#                                   binary holds the same kernels), what a lent machine is sent
#
# Usage: scripts/gpu-bundle.sh            (TPFUSE_CUDA_ARCHS picks the architecture;
#                                          default sm_90a, the H100 / H200)
# Fails if the packed bundle is larger than 60 MB. NCCL is not shipped (the wheel's
# libnccl.so.2 alone is over 200 MB); run.sh finds the GPU machine's own.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { echo "gpu-bundle: $*" >&2; }

eval "$(scripts/setup.sh)"
export TPFUSE_CUDA_ARCHS=${TPFUSE_CUDA_ARCHS:-sm_90a}
limit_mb=60
bundle=dist/tpfuse-gpu-bundle
log "building for $TPFUSE_CUDA_ARCHS"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Executables of the given cargo target kind (and, for tests, sources tests/gpu_*.rs) from
# cargo's JSON messages, one path per line.
pick() { # kind json_file
  python3 - "$1" "$2" <<'PY'
import json, os, sys
kind, path = sys.argv[1], sys.argv[2]
seen = set()
for line in open(path):
    line = line.strip()
    if not line.startswith("{"):
        continue
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    target = msg["target"]
    if kind not in target["kind"]:
        continue
    src = target["src_path"]
    if kind == "test" and not (os.path.basename(os.path.dirname(src)) == "tests"
                               and os.path.basename(src).startswith("gpu_")):
        continue
    if kind == "bench" and os.path.basename(os.path.dirname(src)) != "benches":
        continue
    exe = msg["executable"]
    if exe not in seen:
        seen.add(exe)
        print(target["name"] + "\t" + exe)
PY
}

log "cargo test --release --features gpu-tests --no-run"
cargo test --release --features gpu-tests --no-run --message-format=json >"$tmp/tests.json"
log "cargo bench --no-run"
cargo bench --no-run --message-format=json >"$tmp/benches.json"
log "cargo build --release --bin tpfuse"
cargo build --release --bin tpfuse --message-format=json >"$tmp/bin.json"

pick test "$tmp/tests.json" >"$tmp/tests.list"
pick bench "$tmp/benches.json" >"$tmp/benches.list"
pick bin "$tmp/bin.json" | awk -F'\t' '$1 == "tpfuse"' >"$tmp/bin.list"
[ -s "$tmp/tests.list" ] || { log "no tests/gpu_*.rs executables in cargo's output"; exit 1; }
[ -s "$tmp/benches.list" ] || { log "no bench executables in cargo's output"; exit 1; }
[ -s "$tmp/bin.list" ] || { log "no tpfuse binary in cargo's output"; exit 1; }

rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/benches" "$bundle/bin"
copy_all() { # list dir
  while IFS=$'\t' read -r name exe; do
    cp "$exe" "$2/$name"
    # Debug info goes; the symbol table stays, so that panics print function names.
    strip --strip-debug "$2/$name"
    log "  $2/$name"
  done <"$1"
}
copy_all "$tmp/tests.list" "$bundle/tests"
copy_all "$tmp/benches.list" "$bundle/benches"
copy_all "$tmp/bin.list" "$bundle/bin"

{
  echo "tpfuse $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
  echo "commit        $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built         $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "architectures $TPFUSE_CUDA_ARCHS"
  echo "nvcc          $("$NVCC" --version 2>/dev/null | tail -n1 || echo "${NVCC:-nvcc}")"
  echo "rustc         $(rustc --version)"
  echo "tests         $(cut -f1 "$tmp/tests.list" | tr '\n' ' ')"
  echo "benches       $(cut -f1 "$tmp/benches.list" | tr '\n' ' ')"
} >"$bundle/BUILD-INFO"

cat >"$bundle/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the tpfuse GPU suite from this bundle on a machine with an NVIDIA GPU and driver;
# needs no Rust and no network.
#
#   ./run.sh [OUTDIR]        (or OUT=dir ./run.sh; default: ./out beside this script)
#
# Steps, each logged to OUTDIR/<step>.log and recorded (command and exit code) in
# OUTDIR/summary.txt: tpfuse doctor --build, tpfuse selftest, every tests/ binary with
# --include-ignored --test-threads=1 (less the child_* entry points), then every benches/ binary with short criterion
# settings (criterion's files go to OUTDIR/criterion). A failing step does not stop the
# others; the exit code is non-zero if any step failed.
#
# Knobs (environment):
#   TPFUSE_NCCL_LIB       libnccl.so.2 to use (else: ldconfig, the Python nvidia-nccl
#                         wheel, then lib/ in this bundle)
#   TPFUSE_BUNDLE_STEPS   which of doctor,selftest,tests,bench to run (default: all)
#   TPFUSE_BENCH_ARGS     criterion arguments (default: short warm-up and measurement,
#                         no plots; each bench binary takes a few minutes)
#   TPFUSE_BUNDLE_TESTS   which tests/ binaries to run, by name (default: all)
#   TPFUSE_STEP_TIMEOUT   seconds before a step is killed (default 1200)
#   TPFUSE_BUNDLE_DEADLINE  a time (seconds since the epoch) no step may run past: a step is
#                         cut to end there, and one that would start after it is recorded
#                         as skipped (for a lease of fixed length; default: none)
#   CUDA_DEVICE_MAX_CONNECTIONS  hardware queues per device (default here 32, the maximum):
#                         virtual-rank tests and benches run one stream per rank, and two
#                         ranks whose streams share a queue are serialised into a deadlock
#                         that only the kernels' deadline ends; the driver reads it when a
#                         process creates its CUDA context, so it is exported here
set -u
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-$here/out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
steps=${TPFUSE_BUNDLE_STEPS:-doctor,selftest,tests,bench}
step_timeout=${TPFUSE_STEP_TIMEOUT:-1200}
deadline=${TPFUSE_BUNDLE_DEADLINE:-}
bench_args=${TPFUSE_BENCH_ARGS:---warm-up-time 0.5 --measurement-time 1.5 --nresamples 10000 --noplot}
failed=0
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
wants() { case ",$steps," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

note "tpfuse GPU bundle run, $(date -u +%Y-%m-%dT%H:%M:%SZ), on $(hostname)"
sed 's/^/  /' "$here/BUILD-INFO" | tee -a "$summary"
note "  CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 |
    sed 's/^/  gpu /' | tee -a "$summary"
else
  note "  nvidia-smi not found"
fi

find_nccl() {
  if [ -n "${TPFUSE_NCCL_LIB:-}" ]; then
    [ -e "$TPFUSE_NCCL_LIB" ] && { echo "$TPFUSE_NCCL_LIB"; return 0; }
    echo "TPFUSE_NCCL_LIB=$TPFUSE_NCCL_LIB does not exist" >&2
  fi
  local p
  p=$(ldconfig -p 2>/dev/null | awk '$1 == "libnccl.so.2" { print $NF; exit }')
  [ -n "$p" ] && [ -e "$p" ] && { echo "$p"; return 0; }
  for py in python3 python; do
    command -v "$py" >/dev/null 2>&1 || continue
    p=$("$py" - 2>/dev/null <<'PY'
import os
import nvidia.nccl as m
for d in list(getattr(m, "__path__", [])) + [os.path.dirname(getattr(m, "__file__", "") or "")]:
    for sub in ("lib", "."):
        f = os.path.join(d, sub, "libnccl.so.2")
        if d and os.path.exists(f):
            print(os.path.realpath(f))
            raise SystemExit
PY
)
    [ -n "$p" ] && [ -e "$p" ] && { echo "$p"; return 0; }
    p=$("$py" - 2>/dev/null <<'PY'
import os, nvidia
for d in nvidia.__path__:
    for sub in ("cu13/lib", "cu12/lib", "nccl/lib"):
        f = os.path.join(d, sub, "libnccl.so.2")
        if os.path.exists(f):
            print(os.path.realpath(f))
            raise SystemExit
PY
)
    [ -n "$p" ] && [ -e "$p" ] && { echo "$p"; return 0; }
  done
  [ -e "$here/lib/libnccl.so.2" ] && { echo "$here/lib/libnccl.so.2"; return 0; }
  return 1
}

if nccl=$(find_nccl); then
  export TPFUSE_NCCL_LIB=$nccl
  note "  NCCL $TPFUSE_NCCL_LIB"
else
  note "  NCCL not found (set TPFUSE_NCCL_LIB): the NCCL steps will fail"
  failed=1
fi
note ""

# run_step NAME CMD...: runs CMD with a time limit, tees it to NAME.log, records the result.
run_step() {
  local name=$1
  shift
  local log="$out/$name.log" rc start limit=$step_timeout
  start=$(date +%s)
  if [ -n "$deadline" ]; then
    [ $((deadline - start)) -lt "$limit" ] && limit=$((deadline - start))
    if [ "$limit" -le 0 ]; then
      printf '%-28s skipped (past TPFUSE_BUNDLE_DEADLINE)  %s\n' "$name" "$*" >>"$summary"
      failed=1
      return
    fi
  fi
  echo "===== $name: $*" | tee "$log"
  if command -v timeout >/dev/null 2>&1; then
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  else
    "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  fi
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && echo "===== $name: killed after ${limit}s" | tee -a "$log"
  echo "===== $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$log"
  printf '%-28s exit %-4s %5s s  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$*" >>"$summary"
  [ "$rc" -eq 0 ] || failed=1
}

if wants doctor; then
  run_step doctor "$here/bin/tpfuse" doctor --build
fi
if wants selftest; then
  run_step selftest "$here/bin/tpfuse" selftest
fi
if wants tests; then
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU ' || true)
  skip=(--skip child_)
  # child_* tests are entry points the multi-process tests start themselves; the tests that
  # need several GPUs are skipped, and said so, on a machine with fewer.
  if [ "${gpus:-0}" -lt 2 ]; then
    skip+=(--skip one_process_several_gpus)
    note "  skipped on ${gpus:-0} GPU(s): gpu_group::one_process_several_gpus (needs two or more)"
  fi
  for t in "$here"/tests/*; do
    [ -x "$t" ] || continue
    if [ -n "${TPFUSE_BUNDLE_TESTS:-}" ]; then
      case " $TPFUSE_BUNDLE_TESTS " in *" $(basename "$t") "*) ;; *) continue ;; esac
    fi
    run_step "test-$(basename "$t")" "$t" --include-ignored --test-threads=1 "${skip[@]}"
  done
fi
if wants bench; then
  export CRITERION_HOME="$out/criterion"
  for b in "$here"/benches/*; do
    [ -x "$b" ] || continue
    # shellcheck disable=SC2086 # bench_args is a list of words
    run_step "bench-$(basename "$b")" "$b" --bench $bench_args
  done
fi

echo
echo "summary ($summary):"
cat "$summary"
if [ "$failed" -ne 0 ]; then
  echo "FAILED: at least one step failed (see above)"
  exit 1
fi
echo "all steps passed"
RUN
chmod +x "$bundle/run.sh"

du -sh "$bundle"/* >&2
tar -C "$(dirname "$bundle")" -cf - "$(basename "$bundle")" | xz -T0 -6 >"$bundle.tar.xz"
size_kb=$(du -sk "$bundle.tar.xz" | cut -f1)
size_mb=$(( (size_kb + 1023) / 1024 ))
log "bundle: $root/$bundle ($(du -sh "$bundle" | cut -f1)), packed $root/$bundle.tar.xz, $size_mb MB"
if [ "$size_kb" -gt $((limit_mb * 1024)) ]; then
  log "the packed bundle is larger than $limit_mb MB"
  exit 1
fi
echo "$root/$bundle"
