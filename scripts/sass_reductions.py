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

The copies (cuda/copy.cuh and the gathers) are checked the same way: each kernel that copies
must show, at least once, a run of at least the loads its copy issues together before the
first store: kCopyInFlight = 4 local loads (the stage copies: LDG.E.128), 4 peer loads (the
fused two-shot gather of a row), or one load per rank (the two-shot all-reduce gathers a
vector of the other ranks together, in waves of four: min(W, 4) loads; the all-gather every
rank, all 8). A read-only load (LDG.E.128.CONSTANT, the bias) counts toward a reduction's
epilogue loads only, never toward a copy's.

The packets (cuda/packets.cuh: ld.relaxed.sys.v2.u64, LDG.E.128.STRONG.SYS) of the fused
kernel and of the one-shot all-reduce by packets are counted apart: each must show a run of
at least 8, a wave of four ranks' 32 bytes.
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
# kernel -> the copy runs it must hold: (peer loads, local loads) at least, with the worlds
# for which it must hold it (None: a run of min(W, 4) peer loads for every world W).
COPIES = {
    "one_shot_kernel<": [(0, 4)],
    "two_shot_kernel<": [(0, 4), (None, 0)],
    "reduce_scatter_kernel<": [(0, 4)],
    "all_gather_kernel": [(0, 4), (8, 0)],
    "gemm_all_reduce_kernel<": [(4, 0)],
    "all_gather_gemm_kernel<": [(0, 4)],
    # The one-shot all-reduce by packets: its input's loads (one a vector) before the packets'
    # stores; its reduction is a run of packets (below).
    "one_shot_packets_kernel<": [(0, 1)],
}
# kernel -> the packet loads (LDG.E.128.STRONG.SYS) one run must hold at least.
PACKETS = {"gemm_all_reduce_kernel<": 8, "one_shot_packets_kernel<": 8}
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
packet_runs = defaultdict(int)  # (arch, kernel) -> the longest run of packet loads
run, pending = [0, 0, 0, 0], set()  # peer, local, packet, read-only (CONSTANT) loads


def close(key):
    global run, pending
    if run[0] or run[1] or run[3]:
        runs[key][(run[0], run[1], run[3])] += 1
    packet_runs[key] = max(packet_runs[key], run[2])
    run, pending = [0, 0, 0, 0], set()


def kernel_of(name):
    """The KERNELS or COPIES key a function's name holds, and the function's short name."""
    kernel = next((k for k in list(KERNELS) + list(COPIES) if k in name), None)
    if kernel is None or not kernel.endswith("<"):
        return kernel, kernel
    return kernel, kernel + name.split(kernel, 1)[1].split(")", 1)[0].split(">(", 1)[0] + ">"


for arch, name, guard, op, operands in instructions(sys.stdin):
    kernel, func = kernel_of(name)
    if kernel is None:
        continue
    if op is None:  # a function's header
        run, pending = [0, 0, 0, 0], set()
        continue
    # (LDG.E.128.CONSTANT: a local load ptxas proved read-only, ld.global.nc: the bias. It
    # counts as an epilogue load of a reduction, never as a copy's.)
    kinds = {"LDG.E.128.STRONG.GPU": 0, "LDG.E.128": 1, "LDG.E.128.STRONG.SYS": 2, "LDG.E.128.CONSTANT": 3}
    if op in kinds:
        dest = int(re.match(r"\s*R(\d+)", operands).group(1))
        if registers(operands.split(",", 1)[1]) & pending:
            close((arch, func))
        run[kinds[op]] += 1
        pending |= set(range(dest, dest + 4))
        continue
    sources = operands if op.startswith(STORES) else (operands.split(",", 1)[1] if "," in operands else "")
    if op.startswith(("CALL", "EXIT", "RET", "BAR")) or registers(sources + guard) & pending:
        close((arch, func))

failures = []
for (arch, func), found in sorted(runs.items()):
    print("%-8s %-62s loads in flight together (peer+local[+read-only]): %s%s"
          % (arch, func, " ".join("%d+%d%sx%d" % (p, l, "+%d" % c if c else "", n)
                                  for (p, l, c), n in sorted(found.items())),
             "; packets %d" % packet_runs[(arch, func)] if packet_runs[(arch, func)] else ""))
    reduction = next((v for k, v in KERNELS.items() if func.startswith(k)), None)
    if reduction is not None:
        worlds, places = reduction
        epilogue = Counter()  # W -> places with W peer loads and one or two epilogue loads
        for (p, l, c), n in found.items():
            if l + c in (1, 2):
                epilogue[p] += n
        missing = [w for w in worlds if epilogue[w] < places]
        if missing:
            failures.append("%s %s: fewer than %d runs of the W ranks' loads with the epilogue's for W = %s"
                            % (arch, func, places, ", ".join(map(str, missing))))
    for peer, local in next((v for k, v in COPIES.items() if func.startswith(k)), []):
        if peer is None:  # a run of min(W, 4) peer loads for every world
            missing = [w for w in range(2, 9) if not found[(min(w, 4), local, 0)]]
            if missing:
                failures.append("%s %s: no copy run of min(W, 4) peer loads for W = %s"
                                % (arch, func, ", ".join(map(str, missing))))
        elif not any(p >= peer and l >= local for p, l, _ in found):
            failures.append("%s %s: no copy run of at least %d peer and %d local loads"
                            % (arch, func, peer, local))
    need = next((v for k, v in PACKETS.items() if func.startswith(k)), 0)
    if packet_runs[(arch, func)] < need:
        failures.append("%s %s: the longest run of packet loads is %d, not %d"
                        % (arch, func, packet_runs[(arch, func)], need))
seen = {func for _, func in runs}
for kernel in list(KERNELS) + list(COPIES):
    if not any(f.startswith(kernel) for f in seen):
        failures.append("no %s kernel in the SASS" % kernel)
for f in failures:
    print("FAIL " + f)
sys.exit(1 if failures else 0)
