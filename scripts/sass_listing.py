"""Reads a SASS listing (cuobjdump -sass | c++filt) for the checks of scripts/check-sass.sh:
instructions(lines) yields, for each instruction, (arch, function, guard, opcode, operands),
where guard is its predicate ("@P0 ", or ""), operands the text up to the ';'. A function's
header alone yields (arch, function, None, None, None), so a reader can set up per function."""
import re


def instructions(lines):
    arch, func = None, None
    for line in lines:
        m = re.match(r"\s*arch = (sm_\w+)", line)
        if m:
            arch, func = m.group(1), None
            continue
        m = re.match(r"\s*Function : (.*)$", line)
        if m:
            func = m.group(1).strip()
            yield arch, func, None, None, None
            continue
        if func is None:
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*)", line)
        if m:
            yield arch, func, m.group(1) or "", m.group(2), m.group(3)
