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
    if tpfuse::build_info::EMULATED {
        // The emulator build says what it is, not that GPU kernels are missing.
        assert!(text.contains("the CPU emulator"), "{text}");
        assert!(
            text.contains("CUDA architectures  none (emulated)"),
            "{text}"
        );
        assert!(!text.contains("linked statically"), "{text}");
        assert!(!text.contains("NO kernels"), "{text}");
        assert!(!text.contains("rebuild with"), "{text}");
    } else {
        assert!(text.contains("reduce_ranks_kernel<float>"), "{text}");
        assert!(text.contains("linked statically"), "{text}");
    }
    assert!(text.contains("found "), "NCCL should be found:\n{text}");
}

#[test]
#[cfg_attr(
    not(feature = "emulator"),
    ignore = "asserts the emulator build's report (cargo feature `emulator`)"
)]
fn doctor_describes_the_emulator_as_the_driver() {
    let o = tpfuse(&["doctor"], &[]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("emulated on the CPU"), "{text}");
    assert!(text.contains("(the CPU emulator"), "{text}");
    assert!(text.contains("Verdict"), "{text}");
    let o = tpfuse(&["doctor", "--json"], &[]);
    let value: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(value["build"]["emulated"], true, "{value}");
    assert_eq!(
        value["build"]["architectures"],
        serde_json::json!([]),
        "{value}"
    );
    assert_eq!(value["cuda_driver"]["found"], true, "{value}");
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
    // What does run here.
    assert!(
        text.contains("cargo run --features emulator --bin tpfuse -- selftest"),
        "{text}"
    );
    let o = tpfuse(&["doctor", "--json"], &[]);
    let value: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(value["build"]["emulated"], false, "{value}");
    let minimum = &value["build"]["minimum_driver"];
    let (major, _) = tpfuse::build_info::cudart_version();
    assert_eq!(minimum["cuda"], format!("{major}.0"), "{value}");
    assert_eq!(
        value["cuda_driver"]["sufficient"],
        serde_json::Value::Null,
        "{value}"
    );
}

#[test]
fn doctor_build_lists_every_kernel_with_its_resources() {
    let text = stdout(&tpfuse(&["doctor", "--build"], &[]));
    assert!(text.contains("GEMM paths per architecture"), "{text}");
    for (arch, _) in tpfuse::ops::gemm::gemm_paths() {
        let row = text
            .lines()
            .find(|l| l.trim_start().starts_with(arch) && l.contains("sm80-"));
        assert!(row.is_some(), "no GEMM path row for {arch}:\n{text}");
    }
    if tpfuse::build_info::EMULATED {
        assert!(text.contains("ptxas resource report: none"), "{text}");
        return;
    }
    assert!(text.contains("spill stores"), "{text}");
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

/// Waits at most `within` for `child`, killing it if it takes longer.
fn wait_bounded(mut child: std::process::Child, within: std::time::Duration) -> Output {
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().expect("poll tpfuse").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tpfuse did not finish in {within:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.wait_with_output().expect("collect tpfuse")
}

#[test]
fn doctor_into_a_closed_pipe_exits_quietly() {
    use std::process::Stdio;
    for args in [
        &["doctor"][..],
        &["doctor", "--json"],
        &["doctor", "--build"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tpfuse"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run tpfuse");
        // `tpfuse doctor | head -0`: the reader is gone before the first line is written.
        drop(child.stdout.take());
        let o = wait_bounded(child, std::time::Duration::from_secs(20));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
#[cfg_attr(
    any(feature = "gpu-tests", feature = "emulator"),
    ignore = "asserts the behaviour without a driver (the emulator is one)"
)]
fn bench_without_a_gpu_fails_with_the_reason() {
    let o = tpfuse(&["bench"], &[]);
    assert_ne!(o.status.code(), Some(0));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no CUDA driver"), "{err}");
}

#[test]
fn doctor_with_an_unreadable_topology_is_an_error() {
    let dir = std::env::temp_dir();
    let missing = dir.join(format!(
        "tpfuse-no-such-topology-{}.json",
        std::process::id()
    ));
    let malformed = dir.join(format!(
        "tpfuse-malformed-topology-{}.json",
        std::process::id()
    ));
    std::fs::write(&malformed, "{ not json").unwrap();
    for path in [&missing, &malformed] {
        for json in [false, true] {
            let mut args = vec!["doctor", "--topology", path.to_str().unwrap()];
            if json {
                args.push("--json");
            }
            let o = tpfuse(&args, &[]);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains(path.to_str().unwrap()), "{err}");
        }
    }
    std::fs::remove_file(&malformed).ok();
}

#[test]
fn version_prints_the_crate_version() {
    for flag in ["--version", "-V"] {
        let o = tpfuse(&[flag], &[]);
        assert!(o.status.success());
        assert_eq!(
            stdout(&o).trim(),
            format!("tpfuse {}", env!("CARGO_PKG_VERSION"))
        );
    }
}

#[test]
fn doctor_json_reports_working_unique_ids() {
    let o = tpfuse(&["doctor", "--json"], &[]);
    let value: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(value["nccl"]["found"], true, "{value}");
    assert_eq!(value["nccl"]["unique_ids"]["works"], true, "{value}");

    let o = tpfuse(
        &["doctor", "--json"],
        &[("TPFUSE_NCCL_LIB", "/nonexistent/libnccl.so.2")],
    );
    let value: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(value["nccl"]["found"], false, "{value}");
}
