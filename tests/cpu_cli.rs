//! The `tpfuse` command line, run as a user would.

use std::process::{Command, Output};

fn tpfuse(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tpfuse"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run tpfuse")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn doctor_reports_build_nccl_and_driver_and_exits_zero() {
    let o = tpfuse(&["doctor"], &[]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    for section in [
        "Build",
        "CUDA architectures",
        "NCCL",
        "CUDA driver",
        "Verdict",
    ] {
        assert!(text.contains(section), "missing {section}:\n{text}");
    }
    assert!(text.contains("reduce_ranks_kernel<float>"), "{text}");
    assert!(text.contains("found "), "NCCL should be found:\n{text}");
}

#[test]
#[cfg_attr(
    any(feature = "gpu-tests", feature = "emulator"),
    ignore = "asserts the behaviour without a driver (the emulator is one)"
)]
fn doctor_explains_a_machine_without_a_gpu() {
    let text = stdout(&tpfuse(&["doctor"], &[]));
    assert!(text.contains("no NVIDIA driver"), "{text}");
    assert!(text.contains("an NVIDIA driver and GPU"), "{text}");
}

#[test]
fn doctor_build_lists_every_kernel_with_its_resources() {
    let text = stdout(&tpfuse(&["doctor", "--build"], &[]));
    assert!(text.contains("spill stores"), "{text}");
    assert!(text.contains("GEMM paths per architecture"), "{text}");
    for arch in tpfuse::build_info::architectures() {
        let row = text
            .lines()
            .find(|l| l.trim_start().starts_with(arch) && l.contains("sm80-"));
        assert!(row.is_some(), "no GEMM path row for {arch}:\n{text}");
    }
    for k in tpfuse::build_info::kernel_resources() {
        let row = text
            .lines()
            .find(|l| l.contains(&k.arch) && l.trim_end().ends_with(&k.kernel));
        assert!(
            row.is_some(),
            "no row for {} on {}:\n{text}",
            k.kernel,
            k.arch
        );
    }
}

#[test]
fn doctor_names_a_missing_nccl() {
    let o = tpfuse(
        &["doctor"],
        &[("TPFUSE_NCCL_LIB", "/nonexistent/libnccl.so.2")],
    );
    let text = stdout(&o);
    assert!(o.status.success());
    assert!(text.contains("NCCL not found"), "{text}");
    assert!(text.contains("/nonexistent/libnccl.so.2"), "{text}");
}

#[test]
fn selftest_runs_what_this_machine_can_run() {
    let o = tpfuse(&["selftest"], &[]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("ok      NCCL loads"), "{text}");
    assert!(text.contains(" 0 failed"), "{text}");
}

#[test]
fn unknown_arguments_exit_with_usage() {
    let o = tpfuse(&["frobnicate"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("usage: tpfuse"));
}

#[test]
#[cfg_attr(
    feature = "emulator",
    ignore = "asserts the refusal of a build without the emulator"
)]
fn selftest_counters_need_the_emulator_build() {
    let o = tpfuse(&["selftest", "--counters"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--features emulator"), "{err}");
}

#[test]
fn selftest_refuses_unknown_options() {
    let o = tpfuse(&["selftest", "--fast"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("\"--fast\""), "{err}");
    assert!(err.contains("usage: tpfuse"), "{err}");
}
