"""Compiler evidence for the custom reductions (cuda/reduce.cuh's reduce_vector): reads the
SASS of all_reduce.o and gemm_all_reduce.o (cuobjdump -sass | c++filt, on stdin) and finds, in
each kernel that reduces, the runs of 16-byte loads a thread issues before the first
instruction that uses one of their results (the loads in flight together; a branch does not
end a run, a call, an exit or a barrier does). Each place a kernel reduces must show its run:
the ranks' vectors (LDG.E.128.STRONG.GPU: ld.cg, through L2) with the epilogue's bias and
residual vectors (two LDG.E.128), W + 2 loads, or W + 1 where ptxas hoists one of them out of
the loop (the bias of a whole-row block, the same column in every row: loaded earlier still). The one-shot all-reduce reduces in three places
(reduce_range, the whole-row and the one-segment RMSNorm paths) and the two-shot in one, each
instantiated for W = 2..8; the fused GEMM + all-reduce in one predicated path for every world
(all TPFUSE_MAX_RANKS = 8 loads). The plan counts these loads
(CollectiveLaunch::loads_in_flight_per_thread). Prints each kernel's runs as peer+epilogue
loads (xN: N places); exits non-zero when a place is missing its run.
"""
import re
import sys
from collections import Counter, defaultdict

from sass_listing import instructions

# kernel -> (the worlds whose run of W peer loads + 2 epilogue loads it must hold, how many
# places hold it per world)
KERNELS = {
    "one_shot_kernel<": (range(2, 9), 3),
    "two_shot_kernel<": (range(2, 9), 1),
    "gemm_all_reduce_kernel<": ((8,), 1),
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


runs = defaultdict(Counter)  # (arch, kernel) -> {(peer loads, epilogue loads): places}
run, pending = [0, 0], set()


def close(key):
    global run, pending
    if run[0]:
        runs[key][tuple(run)] += 1
    run, pending = [0, 0], set()


for arch, name, guard, op, operands in instructions(sys.stdin):
    kernel = next((k for k in KERNELS if k in name), None)
    if kernel is None:
        continue
    func = kernel + name.split(kernel, 1)[1].split(")", 1)[0].split(">(", 1)[0] + ">"
    if op is None:  # a function's header
        run, pending = [0, 0], set()
        continue
    if op in ("LDG.E.128.STRONG.GPU", "LDG.E.128"):
        dest = int(re.match(r"\s*R(\d+)", operands).group(1))
        if registers(operands.split(",", 1)[1]) & pending:
            close((arch, func))
        run[0 if op.endswith("STRONG.GPU") else 1] += 1
        pending |= set(range(dest, dest + 4))
        continue
    sources = operands if op.startswith(STORES) else (operands.split(",", 1)[1] if "," in operands else "")
    if op.startswith(("CALL", "EXIT", "RET", "BAR")) or registers(sources + guard) & pending:
        close((arch, func))

failures = []
for (arch, func), found in sorted(runs.items()):
    worlds, places = next(v for k, v in KERNELS.items() if func.startswith(k))
    missing = [w for w in worlds if found[(w, 1)] + found[(w, 2)] < places]
    print("%-8s %-62s loads in flight together (peer+epilogue): %s"
          % (arch, func, " ".join("%d+%dx%d" % (r + (n,)) for r, n in sorted(found.items()))))
    if missing:
        failures.append("%s %s: fewer than %d runs of the W ranks' loads with the epilogue's for W = %s"
                        % (arch, func, places, ", ".join(map(str, missing))))
if not runs:
    failures.append("no reduction kernel in the SASS")
for f in failures:
    print("FAIL " + f)
sys.exit(1 if failures else 0)
