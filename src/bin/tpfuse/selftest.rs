//! `tpfuse selftest`: the checks this machine can run. With a GPU, or on the CPU emulator
//! (`cargo run --features emulator --bin tpfuse -- selftest`), every kernel family on
//! virtual ranks against the crate's references ([`kernel_checks`](crate::kernel_checks)).

use crate::kernel_checks::{self, TOLERANCE};
use crate::traffic;
use std::process::ExitCode;
use tpfuse::comm::{nccl_info, UniqueId};

/// Seed of the kernel checks' inputs when `TPFUSE_TEST_SEED` is unset.
const DEFAULT_SEED: u64 = 0x7470_6675_7365_5e1f;

/// What `tpfuse selftest` was asked for.
pub struct Options {
    /// Print the emulator's counters per op (needs the `emulator` feature).
    pub counters: bool,
}

impl Options {
    pub fn parse(args: &[&str]) -> Result<Options, String> {
        let mut counters = false;
        for a in args {
            match *a {
                "--counters" => counters = true,
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        if counters && !cfg!(feature = "emulator") {
            return Err(
                "--counters reads the CPU emulator's counters: build with --features emulator"
                    .into(),
            );
        }
        Ok(Options { counters })
    }
}

/// Runs what this machine can run; fails (exit 1) on any failed check.
pub fn run(options: &Options) -> ExitCode {
    let mut failed = 0;
    let mut passed = 0;
    let mut check = |name: &str, result: tpfuse::Result<()>| match result {
        Ok(()) => {
            passed += 1;
            println!("ok      {name}");
        }
        Err(e) => {
            failed += 1;
            println!("FAILED  {name}: {e}");
        }
    };
    check("NCCL loads", nccl_info().map(|_| ()));
    check("unique ids are distinct and round-trip", unique_ids());
    if tpfuse::device::driver_present() {
        match kernels(options) {
            Ok(all_passed) => check("kernel families", ok_or_mismatch(all_passed)),
            Err(e) => check("kernel families", Err(e)),
        }
        if cfg!(feature = "emulator") {
            println!(
                "skipped  one-rank NCCL communicator: NCCL needs a GPU (this is the emulator)"
            );
        } else {
            check("one-rank NCCL communicator", gpu::one_rank_comm());
        }
    } else {
        println!("skipped GPU checks: no CUDA driver on this machine");
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn ok_or_mismatch(passed: bool) -> tpfuse::Result<()> {
    if passed {
        Ok(())
    } else {
        Err(tpfuse::Error::Mismatch(
            "a kernel family disagrees with its reference (table above)".into(),
        ))
    }
}

/// The kernel checks with their table (and the counters' table); whether all passed.
fn kernels(options: &Options) -> tpfuse::Result<bool> {
    // Virtual ranks need a hardware queue per stream; read when the context is created.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    let seed = std::env::var("TPFUSE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    let where_ = if cfg!(feature = "emulator") {
        "the CPU emulator"
    } else {
        "GPU 0"
    };
    println!(
        "kernel families on {where_}, bf16, virtual ranks W = 2, 4, 8 (TPFUSE_TEST_SEED={seed}):"
    );
    let reports = kernel_checks::run(seed, options.counters)?;
    println!(
        "{:<42} {:>6} {:>9} {:>15}  verdict",
        "op", "cases", "bitwise", "max rel. error"
    );
    let mut all = true;
    for r in &reports {
        let passed = r.passed(TOLERANCE);
        all &= passed;
        println!(
            "{:<42} {:>6} {:>4}/{:<4} {:>15.3e}  {}",
            r.name,
            r.cases,
            r.bitwise,
            r.cases,
            r.max_error,
            if passed { "ok" } else { "FAILED" }
        );
    }
    println!(
        "bitwise: equal to the exact emulation of the kernels' arithmetic, on every rank (and\n\
         across GEMM configurations and batch sizes); error: relative Frobenius error against\n\
         f64, bound {TOLERANCE:e} (bf16)"
    );
    if options.counters {
        let rows: Vec<(&str, &traffic::Traffic)> =
            reports.iter().map(|r| (r.name, &r.traffic)).collect();
        traffic::print_table(&rows);
    }
    Ok(all)
}

fn unique_ids() -> tpfuse::Result<()> {
    let a = UniqueId::new()?;
    let b = UniqueId::new()?;
    if a == b {
        return Err(tpfuse::Error::Mismatch("two unique ids are equal".into()));
    }
    if UniqueId::from_hex(&a.to_hex())? != a || UniqueId::from_bytes(a.as_bytes())? != a {
        return Err(tpfuse::Error::Mismatch(
            "unique id round trip changed it".into(),
        ));
    }
    Ok(())
}

mod gpu {
    use tpfuse::comm::{Comm, CommOptions};
    use tpfuse::Result;

    pub fn one_rank_comm() -> Result<()> {
        let id = tpfuse::comm::UniqueId::new()?;
        let comm = Comm::init_rank_on_device(&id, 0, 1, 0, CommOptions::default())?;
        comm.sanity_check()
    }
}
