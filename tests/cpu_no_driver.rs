//! On a machine without an NVIDIA driver every entry point returns `Error::NoCudaDriver`,
//! never a panic. (On a GPU machine these assertions do not hold, so the gpu-tests build
//! ignores them.)
#![cfg_attr(any(feature = "gpu-tests", feature = "emulator"), allow(unused))]

use tpfuse::comm::{Comm, CommOptions, UniqueId};
use tpfuse::Error;

fn assert_no_driver<T: std::fmt::Debug>(what: &str, r: tpfuse::Result<T>) {
    match r {
        Err(Error::NoCudaDriver) => {}
        other => panic!("{what}: expected NoCudaDriver, got {other:?}"),
    }
}

#[test]
#[cfg_attr(
    any(feature = "gpu-tests", feature = "emulator"),
    ignore = "asserts the behaviour without a driver (the emulator is one)"
)]
fn every_entry_point_reports_no_driver() {
    assert!(!tpfuse::device::driver_present());
    assert_no_driver("require_driver", tpfuse::device::require_driver());
    assert_no_driver("open", tpfuse::device::open(0));
    assert_no_driver("device_count", tpfuse::device::device_count());
    assert_no_driver("driver_version", tpfuse::device::driver_version());
    let id = UniqueId::new().expect("unique ids need no GPU");
    assert_no_driver(
        "Comm::init_rank_on_device",
        Comm::init_rank_on_device(&id, 0, 1, 0, CommOptions::default()),
    );
    assert_no_driver(
        "Comm::init_all",
        Comm::init_all(&[0, 1], CommOptions::default()),
    );
}

#[test]
#[cfg_attr(
    any(feature = "gpu-tests", feature = "emulator"),
    ignore = "asserts the behaviour without a driver (the emulator is one)"
)]
fn the_error_says_what_is_missing() {
    let text = tpfuse::device::open(0).unwrap_err().to_string();
    assert!(
        text.contains("no CUDA driver") && text.contains("libcuda"),
        "{text}"
    );
}
