//! The README's code that cannot be a doc test: its candle block is
//! `examples/candle_tp_mlp.rs` between the example's `[README: candle]` markers (the example
//! is what CI type-checks, `scripts/candle-check.sh`; a doc test would have to link candle's
//! CUDA build).

fn read(path: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The text between `start` and `end` in `text`, exactly once there.
fn between<'a>(text: &'a str, start: &str, end: &str, what: &str) -> &'a str {
    assert_eq!(
        text.matches(start).count(),
        1,
        "{what}: {start:?} must appear once"
    );
    let rest = &text[text.find(start).unwrap() + start.len()..];
    &rest[..rest
        .find(end)
        .unwrap_or_else(|| panic!("{what}: no {end:?} after {start:?}"))]
}

#[test]
fn the_readmes_candle_block_is_the_examples_code() {
    let example = read("examples/candle_tp_mlp.rs");
    let readme = read("README.md");
    let code = between(
        &example,
        "// [README: candle]\n",
        "// [/README: candle]\n",
        "example",
    );
    let after = "CI type-checks the example (scripts/candle-check.sh). -->\n\n```rust,ignore\n";
    let block = between(&readme, after, "```\n", "README");
    assert!(
        code.contains("row_parallel_residual_rmsnorm"),
        "the marked code is the MLP"
    );
    assert_eq!(
        block, code,
        "README.md's candle block differs from examples/candle_tp_mlp.rs's marked code: copy \
         the example's code into the README"
    );
}
