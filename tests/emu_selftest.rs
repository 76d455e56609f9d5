//! `tpfuse selftest --counters` on the CPU emulator, run as a newcomer runs it: every kernel
//! family passes its checks, and the counters' table shows what the emulator tests assert
//! (no ldmatrix bank conflicts in the GEMM, 2 synchronisation rounds for one-shot, 3 for
//! two-shot, no peer bytes for reduce_ranks).
#![cfg(feature = "emulator")]

use std::process::Command;

/// The whitespace-separated fields of the row of `op` in the table headed by `header`.
fn row<'a>(text: &'a str, header: &str, op: &str) -> Vec<&'a str> {
    let table = &text[text
        .find(header)
        .unwrap_or_else(|| panic!("no {header}:\n{text}"))..];
    let line = table
        .lines()
        .find(|l| l.starts_with(op))
        .unwrap_or_else(|| panic!("no row {op}:\n{text}"));
    line[op.len()..].split_whitespace().collect()
}

#[test]
fn selftest_checks_every_kernel_family_and_prints_the_counters() {
    let o = Command::new(env!("CARGO_BIN_EXE_tpfuse"))
        .args(["selftest", "--counters"])
        .output()
        .expect("run tpfuse");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(text.contains("on the CPU emulator"), "{text}");
    assert!(text.contains("ok      kernel families"), "{text}");
    let ops = [
        "reduce_ranks",
        "all_reduce one-shot",
        "all_reduce two-shot",
        "all_reduce + bias + residual + RMSNorm",
        "all_gather",
        "reduce_scatter",
        "gemm (every configuration)",
        "row-parallel linear (GEMM + all-reduce)",
    ];
    for op in ops {
        let r = row(&text, "op  ", op);
        assert_eq!(r.last(), Some(&"ok"), "{op}: {r:?}");
        // cases, then "bitwise/cases" with nothing lost.
        assert_eq!(r[1], format!("{}/{}", r[0], r[0]), "{op}: {r:?}");
    }
    // Counters: launches blocks read write /minimum peer rounds balance conflicts.
    let header = "op (emulator counters)";
    let gemm = row(&text, header, "gemm (every configuration)");
    assert_eq!(gemm[8], "0", "GEMM ldmatrix bank conflicts: {gemm:?}");
    // Rounds: no barrier closes a launch (cuda/barrier.cuh, "Finished launches").
    assert_eq!(row(&text, header, "all_reduce one-shot")[6], "1");
    assert_eq!(row(&text, header, "all_reduce two-shot")[6], "2");
    assert_eq!(row(&text, header, "reduce_ranks")[5], "0.000");
}
