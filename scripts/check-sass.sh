#!/usr/bin/env bash
# Compiler evidence for the GEMM kernels: disassembles the built objects of cuda/gemm.cu,
# gemm_all_reduce.cu and all_gather_gemm.cu (target/*/build/tpfuse-*/out/*gemm*.o, every SASS
# architecture in them) and checks that every kernel that runs the sm80 mainloop
# (gemm_sm80_kernel, and the fused gemm_all_reduce_kernel and all_gather_gemm_kernel) contains
#   - tensor-core MMAs of its type: HMMA.16816.F32.BF16 (bf16) or HMMA.16816.F32 (f16),
#   - ldmatrix (LDSM) and cp.async (LDGSTS) instructions,
#   - no local-memory traffic (LDL / STL: spills or stack arrays),
# on every architecture, and prints the counts. Exits non-zero on any failure or when no
# object is found (build first: cargo build, or scripts/test.sh).
#
# cuobjdump and nvdisasm come from the pinned nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm
# wheels (13.2.86: 13.0's cuobjdump is not in the wheels), installed into .venv-tools when
# missing. Usage: scripts/check-sass.sh [object ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.venv-tools"
TOOL_WHEELS=(nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86)
log() { echo "check-sass: $*" >&2; }

find_tool() {
  [ -d "$tools" ] || return 1
  find "$tools" -path "*/nvidia/*/bin/$1" -type f -perm -u+x 2>/dev/null | head -n 1
}

if [ -z "$(find_tool cuobjdump || true)" ] || [ -z "$(find_tool nvdisasm || true)" ]; then
  command -v python3 >/dev/null || { log "python3 is needed to install ${TOOL_WHEELS[*]}"; exit 1; }
  [ -x "$tools/bin/pip" ] || python3 -m venv "$tools" >&2
  log "installing ${TOOL_WHEELS[*]} into $tools"
  "$tools/bin/pip" install -q --disable-pip-version-check "${TOOL_WHEELS[@]}" >&2
fi
cuobjdump=$(find_tool cuobjdump)
nvdisasm=$(find_tool nvdisasm)
[ -n "$cuobjdump" ] && [ -n "$nvdisasm" ] || { log "cuobjdump / nvdisasm not found in $tools"; exit 1; }
# cuobjdump runs nvdisasm to print SASS: from PATH, or NVDISASM_PATH.
export PATH="$(dirname "$nvdisasm"):$PATH"
export NVDISASM_PATH="$nvdisasm"

if [ $# -gt 0 ]; then
  objects=("$@")
else
  mapfile -t objects < <(ls -1 "$root"/target/*/build/tpfuse-*/out/*gemm*.o 2>/dev/null || true)
fi
if [ ${#objects[@]} -eq 0 ]; then
  log "no gemm object under target/*/build/tpfuse-*/out: build the crate first"
  exit 1
fi

status=0
for obj in "${objects[@]}"; do
  echo "== $obj"
  "$cuobjdump" -sass "$obj" | c++filt | python3 -c '
import re, sys
arch, func, counts = None, None, {}
for line in sys.stdin:
    m = re.match(r"\s*arch = (sm_\w+)", line)
    if m:
        arch, func = m.group(1), None
        continue
    m = re.match(r"\s*Function : (.*)$", line)
    if m:
        func = m.group(1).strip()
        counts.setdefault((arch, func), {})
        continue
    if func is None:
        continue
    m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if m:
        op = m.group(1)
        c = counts[(arch, func)]
        c[op] = c.get(op, 0) + 1

def total(c, pred):
    return sum(v for k, v in c.items() if pred(k))

failures = []
rows = []
KERNELS = ("gemm_sm80_kernel<", "gemm_all_reduce_kernel<", "all_gather_gemm_kernel<")
for (arch, func), c in sorted(counts.items()):
    kernel = next((k for k in KERNELS if k in func), None)
    if kernel is None:
        continue
    bf16 = func.split(kernel, 1)[1].startswith("__nv_bfloat16")
    want = "HMMA.16816.F32.BF16" if bf16 else "HMMA.16816.F32"
    hmma = c.get(want, 0)
    other_hmma = total(c, lambda k: k.startswith("HMMA") and k != want)
    ldsm = total(c, lambda k: k.startswith("LDSM"))
    ldgsts = total(c, lambda k: k.startswith("LDGSTS"))
    local = total(c, lambda k: k.startswith("LDL") or k.startswith("STL"))
    short = re.sub(r"tpfuse::(gemm::)?", "", func.replace("(anonymous namespace)::", "").split("(")[0])
    short = re.sub(r",\s*GemmEpilogue<[^>]*>\s*", "", short)
    rows.append((arch, short, want, hmma, ldsm, ldgsts, local))
    problems = []
    if hmma == 0: problems.append("no " + want)
    if other_hmma: problems.append("%d HMMA of another kind" % other_hmma)
    if ldsm == 0: problems.append("no LDSM (ldmatrix)")
    if ldgsts == 0: problems.append("no LDGSTS (cp.async)")
    if local: problems.append("%d LDL/STL (local memory)" % local)
    if problems:
        failures.append("%s %s: %s" % (arch, short, "; ".join(problems)))

if not rows:
    print("no GEMM kernel found")
    sys.exit(1)
print("%-8s %-58s %-20s %5s %5s %6s %5s" % ("arch", "kernel", "mma", "HMMA", "LDSM", "LDGSTS", "local"))
for r in rows:
    print("%-8s %-58s %-20s %5d %5d %6d %5d" % r)
archs = sorted({r[0] for r in rows})
print("%d kernels on %d architectures (%s)" % (len(rows), len(archs), ", ".join(archs)))
for f in failures:
    print("FAIL " + f)
sys.exit(1 if failures else 0)
' || status=1
done
exit $status
