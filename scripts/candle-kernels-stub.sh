#!/usr/bin/env bash
# A check-only candle-kernels, for `cargo check`/`clippy`/`doc` of candle-core's `cuda` feature
# without nvcc: candle-kernels' build compiles its CUDA (GGUF MMQ templates among it, tens of
# minutes on two cores) even for `cargo check`. The stub is the crate that the graph in the
# current directory resolves to (its Rust sources and manifest, from cargo's registry, unchanged:
# the module constants, the `Id`s, the FFI declarations candle-core calls) with its build script
# replaced by one that writes every PTX module as an empty string and no build dependency
# (cudaforge). It type-checks exactly as the real crate does; a binary linked against it would
# load empty modules and miss its static library, so it is for checking only: never `cargo
# build`/`test`/`run` with it.
#   scripts/candle-kernels-stub.sh DEST   (run where `cargo metadata` resolves candle-kernels)
# Use it as `--config 'patch.crates-io.candle-kernels.path="DEST"'`, or in a [patch.crates-io]
# table, and check that it was used (`cargo tree -i candle-kernels` names DEST): a stub whose
# version candle-core does not accept is ignored with a warning, and the real crate builds.
set -euo pipefail
dest=${1:?usage: candle-kernels-stub.sh DEST}
real=$(cargo metadata --format-version 1 --quiet --all-features | python3 -c '
import json, sys
m = json.load(sys.stdin)
dirs = [p["manifest_path"].rsplit("/", 1)[0] for p in m["packages"] if p["name"] == "candle-kernels"]
if len(dirs) != 1:
    sys.exit("candle-kernels-stub: the graph here holds %d candle-kernels, not one" % len(dirs))
print(dirs[0])')
# The sources are extracted from cargo's download cache on first use.
[ -f "$real/src/lib.rs" ] || cargo fetch --quiet
[ -f "$real/src/lib.rs" ] || { echo "candle-kernels-stub: no sources at $real" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/src"
cp "$real"/src/*.rs "$dest/src/"
# The manifest without [build-dependencies] (cudaforge, which only the real build script uses).
awk '/^\[/ { skip = ($0 ~ /^\[build-dependencies/) } !skip' "$real/Cargo.toml" >"$dest/Cargo.toml"
cat >"$dest/build.rs" <<'EOF'
// Check-only: each `mdl!(NAME, Id)` module of src/lib.rs gets `pub const NAME: &str = "";` in
// OUT_DIR/ptx.rs, where the real build writes the PTX nvcc compiled.
fn main() {
    let lib = std::fs::read_to_string("src/lib.rs").expect("src/lib.rs");
    let consts: String = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("mdl!("))
        .map(|rest| format!("pub const {}: &str = \"\";\n", rest.split(',').next().unwrap().trim()))
        .collect();
    assert!(!consts.is_empty(), "no mdl!(..) module in src/lib.rs");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    std::fs::write(out.join("ptx.rs"), consts).expect("ptx.rs");
}
EOF
echo "$dest"
