"""Compiler evidence for the custom reductions (cuda/reduce.cuh's reduce_vector): reads the
SASS of all_reduce.o and gemm_all_reduce.o (cuobjdump -sass | c++filt, on stdin) and finds, in
each kernel that reduces, the runs of 16-byte loads a thread issues before the first
instruction that uses one of their results (the loads in flight together; branches do not end
a run, an exit or a barrier does). Some run must hold the ranks' vectors (LDG.E.128.STRONG.GPU:
ld.cg, through L2) with the epilogue's bias and residual vectors (two LDG.E.128): for every
world W = 2..8 in the all-reduce kernels (one instantiation per world), and for the fused GEMM
+ all-reduce's one predicated path, all TPFUSE_MAX_RANKS = 8. The plan counts these loads
(CollectiveLaunch::loads_in_flight_per_thread). Prints each kernel's runs as peer+epilogue
loads; exits non-zero when one is missing.
"""
import re
import sys
from collections import defaultdict

# kernel -> the worlds whose run (W peer loads + 2 epilogue loads) it must hold
KERNELS = {
    "one_shot_kernel<": range(2, 9),
    "two_shot_kernel<": range(2, 9),
    "gemm_all_reduce_kernel<": (8,),
}
STORES = ("STG", "STS", "ST.", "RED", "ATOM")


def registers(operand_text):
    """The registers an operand list names (R2.64: R2 and R3)."""
    regs = set()
    for r, wide in re.findall(r"\bR(\d+)(\.64)?\b", operand_text):
        regs.add(int(r))
        if wide:
            regs.add(int(r) + 1)
    return regs


arch, func = None, None
runs = defaultdict(set)  # (arch, kernel) -> {(peer loads, epilogue loads)}
run, pending = [0, 0], set()


def close():
    global run, pending
    if run[0]:
        runs[(arch, func)].add(tuple(run))
    run, pending = [0, 0], set()


for line in sys.stdin:
    m = re.match(r"\s*arch = (sm_\w+)", line)
    if m:
        arch, func = m.group(1), None
        continue
    m = re.match(r"\s*Function : (.*)$", line)
    if m:
        name = m.group(1).strip()
        kernel = next((k for k in KERNELS if k in name), None)
        func = None if kernel is None else kernel + name.split(kernel, 1)[1].split(")", 1)[0].split(">(", 1)[0] + ">"
        run, pending = [0, 0], set()
        continue
    if func is None:
        continue
    m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", line)
    if not m:
        continue
    guard, op, operands = m.group(1) or "", m.group(2), m.group(3)
    if op in ("LDG.E.128.STRONG.GPU", "LDG.E.128"):
        dest = int(re.match(r"\s*R(\d+)", operands).group(1))
        if registers(operands.split(",", 1)[1]) & pending:
            close()
        run[0 if op.endswith("STRONG.GPU") else 1] += 1
        pending |= set(range(dest, dest + 4))
        continue
    sources = operands if op.startswith(STORES) else (operands.split(",", 1)[1] if "," in operands else "")
    if op.startswith(("EXIT", "RET", "BAR")) or registers(sources + guard) & pending:
        close()

failures = []
for (arch, func), found in sorted(runs.items()):
    worlds = next(v for k, v in KERNELS.items() if func.startswith(k))
    missing = [w for w in worlds if (w, 2) not in found]
    print("%-8s %-62s loads in flight together (peer+epilogue): %s"
          % (arch, func, " ".join("%d+%d" % r for r in sorted(found))))
    if missing:
        failures.append("%s %s: no run of the W ranks' loads with the bias and residual loads for W = %s"
                        % (arch, func, ", ".join(map(str, missing))))
if not runs:
    failures.append("no reduction kernel in the SASS")
for f in failures:
    print("FAIL " + f)
sys.exit(1 if failures else 0)
