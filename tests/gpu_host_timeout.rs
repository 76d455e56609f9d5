//! The host's own timeout path, on the CPU emulator (feature `emulator`): `TpGroup::check()`
//! polls its stream with cuStreamQuery under a bound of its own (5 x the timeout plus one
//! second), and the emulator answers a query after a slice of device time
//! (CUDA_ERROR_NOT_READY while work remains), so a kernel that outlives that bound turns
//! into `Error::Timeout` and a poisoned group. A file of its own: while its kernel waits, a
//! device-wide synchronize of another test would wait for it.
#![cfg(feature = "emulator")]

use std::time::{Duration, Instant};
use tpfuse::emulator::{set_cuda_stream_fault, Fault};
use tpfuse::ops::{self, Algorithm};
use tpfuse::{Error, GroupOptions, TpGroup};

/// The host's own timeout path: rank 1 never launches, and rank 0's kernel waits for it on an
/// emulated SM whose `%globaltimer` stands still and whose `%clock64` runs a million times
/// slower than the peak, so neither the kernel's deadline nor its `%clock64` backstop (4 x the
/// timeout at the peak clock) ends the wait before `check()`'s bound (5 x the timeout plus
/// one second of the host's clock): `check()` must give up on the stream itself.
#[test]
fn a_kernel_that_outlives_the_host_bound_is_a_host_timeout() {
    let ctx = tpfuse::device::open(0).unwrap();
    let timeout = Duration::from_millis(20);
    let options = GroupOptions {
        timeout,
        ..GroupOptions::default()
    };
    let groups = TpGroup::virtual_ranks(&ctx, 2, options).unwrap();
    let s = groups[0].stream();
    set_cuda_stream_fault(
        s,
        Fault {
            freeze_timer: true,
            clock_divisor: 1_000_000,
            ..Fault::default()
        },
    );
    let input = s.clone_htod(&vec![1.0f32; 1024]).unwrap();
    let mut out = s.alloc_zeros::<f32>(1024).unwrap();
    ops::all_reduce(&groups[0], &input, &mut out, Algorithm::OneShot).unwrap();
    let bound = timeout * 5 + Duration::from_secs(1);
    let start = Instant::now();
    match groups[0].check() {
        Err(Error::Timeout { what, after }) => {
            assert_eq!(after, bound, "{what}");
            assert!(what.contains("stream"), "{what}");
        }
        other => panic!("expected the host's Timeout, got {other:?}"),
    }
    assert!(
        start.elapsed() >= bound,
        "check() gave up after {:?}, before its bound {bound:?}",
        start.elapsed()
    );
    for g in &groups {
        assert!(g.is_poisoned(), "rank {} is not poisoned", g.rank());
        assert!(matches!(g.check(), Err(Error::GroupPoisoned(_))));
    }
    // Let the kernel end (its clocks run again: the backstop ends its wait) so that nothing
    // is left waiting on the device, and the group's Drop finds its stream drained.
    set_cuda_stream_fault(s, Fault::default());
    s.synchronize().unwrap();
}
