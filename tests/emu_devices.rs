//! Several emulated devices in one process (`TPFUSE_EMU_DEVICES=4`, set by this binary before
//! its first CUDA call): one primary context per device, streams on their device's own SMs,
//! peer access enabled through the driver calls tpfuse makes on a GPU
//! ([`symmetric::peer_access`]), and the one-shot and two-shot all-reduce kernels run
//! across the four devices' symmetric memory, one rank per device, bitwise equal to the
//! reference. (A [`TpGroup`](tpfuse::TpGroup) over several devices builds an NCCL
//! communicator, which needs a GPU: the kernels are driven through the C ABI here.)
#![cfg(feature = "emulator")]

mod common;
use common::assert_same_bits;
use common::gpu::{random_ranks, splitmix64};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, Once};
use tpfuse::emulator::abi;
use tpfuse::reference::reduce_ranks_exact;
use tpfuse::symmetric::{self, SymmetricWorkspace};
use tpfuse::Error;

const DEVICES: usize = 4;
static SETUP: Once = Once::new();
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The four devices' contexts (the environment is set before the first CUDA call).
fn contexts() -> Vec<Arc<CudaContext>> {
    SETUP.call_once(|| std::env::set_var("TPFUSE_EMU_DEVICES", DEVICES.to_string()));
    (0..DEVICES)
        .map(|d| tpfuse::device::open(d).unwrap_or_else(|e| panic!("device {d}: {e}")))
        .collect()
}

#[test]
fn four_devices_each_with_its_context() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ctxs = contexts();
    assert_eq!(
        tpfuse::device::device_count().expect("device count"),
        DEVICES
    );
    for (d, ctx) in ctxs.iter().enumerate() {
        assert_eq!(ctx.ordinal(), d);
    }
    // The same device twice is refused, naming both ranks.
    match symmetric::peer_access(&[ctxs[1].clone(), ctxs[1].clone()], 1 << 16) {
        Err(Error::InvalidArgument { arg, reason }) => {
            assert_eq!(arg, "ctxs");
            assert!(reason.contains("ranks 0 and 1"), "{reason}");
        }
        other => panic!("device listed twice: expected InvalidArgument, got {other:?}"),
    }
}

/// Rank r's all-reduce on device r's stream, through the C ABI.
fn launch(
    ws: &SymmetricWorkspace,
    algo: i32,
    blocks: i32,
    input: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    stream: &Arc<CudaStream>,
) {
    let mut peers = abi::tpfuse_peers {
        data: [std::ptr::null_mut(); abi::TPFUSE_MAX_RANKS as usize],
        signals: [std::ptr::null_mut(); abi::TPFUSE_MAX_RANKS as usize],
    };
    for (p, (&d, &s)) in ws
        .data_pointers()
        .iter()
        .zip(&ws.signal_pointers())
        .enumerate()
    {
        peers.data[p] = d as *mut c_void;
        peers.signals[p] = s as *mut u32;
    }
    let args = abi::tpfuse_group_args {
        rank: ws.rank() as i32,
        world: ws.world() as i32,
        blocks,
        capacity: ws.capacity() as u64,
        timeout_ns: 10_000_000_000,
        backstop_cycles: 80_000_000_000,
        host_error: std::ptr::null_mut(),
        packet_bytes: 0,
    };
    let n = input.len();
    let (ip, _g1) = input.device_ptr(stream);
    let (op, _g2) = out.device_ptr_mut(stream);
    // SAFETY: the workspace's tables and both buffers are live device memory of n elements.
    let code = unsafe {
        abi::tpfuse_all_reduce(
            abi::TPFUSE_DTYPE_BF16 as i32,
            algo,
            &peers,
            &args,
            ip as *const c_void,
            std::ptr::null(),
            std::ptr::null_mut(),
            std::ptr::null(),
            0.0,
            op as *mut c_void,
            1,
            n,
            stream.cu_stream() as *mut c_void,
        )
    };
    assert_eq!(code, 0, "rank {}: launch", ws.rank());
}

#[test]
fn peer_access_all_reduce_across_four_devices() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ctxs = contexts();
    let capacity = 1 << 20;
    let workspaces = symmetric::peer_access(&ctxs, capacity).expect("peer access on 4 devices");
    // Enabling it again (a second group on the same devices) is fine.
    let again = symmetric::peer_access(&ctxs, capacity).expect("peer access again");
    drop(again);
    assert_eq!(workspaces.len(), DEVICES);
    for (r, ws) in workspaces.iter().enumerate() {
        assert_eq!((ws.rank(), ws.world(), ws.device()), (r, DEVICES, r));
        assert_eq!(ws.data_pointers(), workspaces[0].data_pointers());
        assert_eq!(ws.signal_pointers(), workspaces[0].signal_pointers());
    }
    let streams: Vec<Arc<CudaStream>> = ctxs
        .iter()
        .map(|c| c.new_stream().expect("stream"))
        .collect();
    let blocks = 8;
    for (i, (algo, n)) in [
        (abi::TPFUSE_ALGO_ONE_SHOT, 8 * 1000 + 3),
        (abi::TPFUSE_ALGO_TWO_SHOT, 8 * 4096),
    ]
    .into_iter()
    .enumerate()
    {
        let label = format!("algo {algo} n={n}");
        let hosts: Vec<Vec<bf16>> = random_ranks(DEVICES, n, |r| {
            splitmix64(0xde71 ^ (i as u64) << 8 ^ r as u64)
        });
        let ins: Vec<CudaSlice<bf16>> = streams
            .iter()
            .zip(&hosts)
            .map(|(s, h)| s.clone_htod(h).expect("upload"))
            .collect();
        let mut outs: Vec<CudaSlice<bf16>> = streams
            .iter()
            .map(|s| s.clone_htod(&vec![bf16::NAN; n]).expect("upload"))
            .collect();
        for r in 0..DEVICES {
            launch(
                &workspaces[r],
                algo as i32,
                blocks,
                &ins[r],
                &mut outs[r],
                &streams[r],
            );
        }
        let slices: Vec<&[bf16]> = hosts.iter().map(Vec::as_slice).collect();
        let want = reduce_ranks_exact(&slices);
        for r in 0..DEVICES {
            streams[r]
                .synchronize()
                .unwrap_or_else(|e| panic!("{label}: rank {r}: {e}"));
            let got = streams[r].clone_dtoh(&outs[r]).expect("download");
            assert_same_bits(&format!("{label}: rank {r} on device {r}"), &got, &want);
        }
    }
}
