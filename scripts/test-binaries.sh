#!/usr/bin/env bash
# Builds test targets and prints their executables, one per line:
#   scripts/test-binaries.sh CARGO_TEST_ARGS...   (e.g. --features emulator --test emu_ops)
# The arguments go to `cargo test --no-run`; only test executables are printed (not the
# crate's binaries that integration tests also build).
set -euo pipefail
cargo test --no-run --message-format=json "$@" |
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])
'
