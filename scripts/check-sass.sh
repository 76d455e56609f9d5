#!/usr/bin/env bash
# Compiler evidence for the GEMM kernels: disassembles the built objects of cuda/gemm.cu,
# gemm_all_reduce.cu and all_gather_gemm.cu (target/*/build/tpfuse-*/out/*gemm*.o, every SASS
# architecture in them) and checks that every kernel that runs the sm80 mainloop
# (gemm_sm80_kernel, and the fused gemm_all_reduce_kernel and all_gather_gemm_kernel) contains
#   - tensor-core MMAs of its type: HMMA.16816.F32.BF16 (bf16) or HMMA.16816.F32 (f16),
#   - ldmatrix (LDSM) and cp.async (LDGSTS) instructions,
#   - no local-memory traffic (LDL / STL: spills or stack arrays),
#   - the bytes in flight its configuration was written for (cuda/gemm_sm80.cuh's TileConfig
#     line, read here): every LDGSTS 16 bytes wide (.128), the deepest cp.async wait
#     (DEPBAR.LE SB0, N) leaving N = STAGES - 2 groups outstanding, and every commit group
#     (the LDGSTS between two LDGDEPBAR, in the text's order: the prologue's and the main
#     loop's) holding one k-slice of A and B per thread, so that STAGES - 1 slices are in
#     flight per block, as tpfuse::plan counts (the GEMM's copies carry their zero-fill
#     predicate; a commit group of copies without it is the fused GEMM + all-reduce's RMSNorm
#     stage of a row, allowed in that kernel alone and left out of the GEMM's count),
# on every architecture (gemm_split_kernel too), and prints the counts and each block's bytes
# in flight; and, beside each build's gemm_all_reduce.o, that the reductions and copies of all_reduce.o
# and gemm_all_reduce.o issue every rank's loads with the epilogue's before the first use
# (scripts/sass_reductions.py). Exits non-zero on any failure or when no object is found
# (build first: cargo build, or scripts/test.sh).
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

# Each object's check, and the reductions' beside gemm_all_reduce.o, runs as its own job (one
# per core: each is one single-threaded pipeline); their outputs print in order once all end.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
jobs_max=$(nproc 2>/dev/null || echo 2)
throttle() { while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done; }
# The same build's reductions (all-reduce and fused kernels), beside each gemm_all_reduce.o:
# the loads in flight together. First: the longest check (three objects' SASS).
for i in "${!objects[@]}"; do
  obj=${objects[$i]}
  [ "$(basename "$obj")" = gemm_all_reduce.o ] || continue
  throttle
  dir=$(dirname "$obj")
  {
    echo "== $dir/all_reduce.o, all_reduce_packets.o, gemm_all_reduce.o, all_gather_gemm.o: reductions and copies"
    { "$cuobjdump" -sass "$dir/all_reduce.o"; "$cuobjdump" -sass "$dir/all_reduce_packets.o"; "$cuobjdump" -sass "$obj"
      "$cuobjdump" -sass "$dir/all_gather_gemm.o"; } | c++filt |
      python3 "$root/scripts/sass_reductions.py"
  } >"$work/$i.reductions.log" 2>&1 || : >"$work/$i.reductions.failed" &
done
for i in "${!objects[@]}"; do
  obj=${objects[$i]}
  throttle
  {
  echo "== $obj"
  "$cuobjdump" -sass "$obj" | c++filt | PYTHONPATH="$root/scripts" python3 -c '
import re, sys
from collections import Counter
from sass_listing import instructions
# The tile configurations, from their definitions: name -> (BM, BN, BK, threads, stages).
CONFIGS = {}
for line in open(sys.argv[1]):
    m = re.match(r"struct (\w+) : TileConfig<(\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)", line)
    if m:
        bm, bn, bk, wm, wn, stages = (int(v) for v in m.groups()[1:7])
        CONFIGS[m.group(1)] = (bm, bn, bk, wm * wn * 32, stages)
if not CONFIGS:
    print("found no TileConfig line in %s" % sys.argv[1])
    sys.exit(1)
counts = {}
# Per function: the deepest cp.async wait, the LDGSTS of each commit group (the GEMM'"'"'s copies,
# with their zero-fill predicate: cp_async_16 of a tile edge), their widths, and the commit
# groups of whole copies (no zero-fill operand: the fused kernels'"'"' RMSNorm stage of a row,
# cuda/epilogue.cuh, which is not the GEMM'"'"'s pipeline).
depbar, groups, widths = {}, {}, {}
for arch, func, _, op, operands in instructions(sys.stdin):
    key = (arch, func)
    if op is None:  # the header of a function
        counts.setdefault(key, {})
        depbar[key], groups[key], widths[key] = -1, [[0, 0]], Counter()
        continue
    c = counts[key]
    c[op] = c.get(op, 0) + 1
    if op.startswith("LDGSTS"):
        groups[key][-1][0] += 1
        if re.search(r",\s*!?P[0-6T]\s*$", operands):
            groups[key][-1][1] += 1
        widths[key][op.rsplit(".", 1)[-1]] += 1
    elif op == "LDGDEPBAR":
        groups[key].append([0, 0])
    elif op == "DEPBAR.LE":
        w = re.match(r"\s*SB0,\s*(0x[0-9a-f]+|\d+)", operands)
        if w:
            depbar[key] = max(depbar[key], int(w.group(1), 0))

def total(c, pred):
    return sum(v for k, v in c.items() if pred(k))

failures = []
rows = []
KERNELS = ("gemm_sm80_kernel<", "gemm_split_kernel<", "gemm_all_reduce_kernel<", "all_gather_gemm_kernel<")
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
    problems = []
    config = next((name for name in CONFIGS if re.search(r"\b%s\b" % name, func)), None)
    in_flight = 0
    if config is None:
        problems.append("no tile configuration in its name")
    else:
        bm, bn, bk, threads, stages = CONFIGS[config]
        slice_loads = (bm + bn) * bk * 2 // 16 // threads  # 16-byte cp.async per thread
        # A group of whole copies only is a RMSNorm stage (the fused GEMM + all-reduce'"'"'s alone).
        whole = [n for n, fill in groups[(arch, func)] if n and not fill]
        if whole and kernel != "gemm_all_reduce_kernel<":
            problems.append("%d commit groups of copies without zero-fill" % len(whole))
        committed = Counter(n for n, fill in groups[(arch, func)] if fill)
        per_group = committed.most_common(1)[0][0] if committed else 0
        if len(committed) > 1:
            problems.append("commit groups of %s LDGSTS" % "/".join(str(n) for n in sorted(committed)))
        if depbar[(arch, func)] != stages - 2:
            problems.append("deepest cp.async wait leaves %d groups outstanding, not STAGES - 2 = %d"
                            % (depbar[(arch, func)], stages - 2))
        if per_group != slice_loads:
            problems.append("%d LDGSTS per commit group, not a k-slice'"'"'s %d" % (per_group, slice_loads))
        narrow = sum(v for k, v in widths[(arch, func)].items() if k != "128")
        if narrow:
            problems.append("%d LDGSTS narrower than 16 bytes" % narrow)
        if not problems:
            in_flight = (depbar[(arch, func)] + 1) * per_group * 16 * threads
    rows.append((arch, short, want, hmma, ldsm, ldgsts, local, in_flight))
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
print("%-8s %-58s %-20s %5s %5s %6s %5s %9s" % ("arch", "kernel", "mma", "HMMA", "LDSM", "LDGSTS", "local",
                                                  "in flight"))
for r in rows:
    print("%-8s %-58s %-20s %5d %5d %6d %5d %9d" % r)
print("in flight: bytes of A and B one block keeps loading, from the SASS: (deepest wait + 1) "
      "commit groups x LDGSTS per group x 16 B x threads")
archs = sorted({r[0] for r in rows})
print("%d kernels on %d architectures (%s)" % (len(rows), len(archs), ", ".join(archs)))
for f in failures:
    print("FAIL " + f)
sys.exit(1 if failures else 0)
' "$root/cuda/gemm_sm80.cuh"
  } >"$work/$i.gemm.log" 2>&1 || : >"$work/$i.gemm.failed" &
done
wait
status=0
for i in "${!objects[@]}"; do
  for check in gemm reductions; do
    [ ! -f "$work/$i.$check.log" ] || cat "$work/$i.$check.log"
    [ ! -f "$work/$i.$check.failed" ] || status=1
  done
done
exit $status
