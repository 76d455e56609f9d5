//! The collectives and point-to-point calls of [`Comm`], each validated before it is
//! enqueued on the communicator's stream.

use super::communicator::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::ffi::nccl_sys as sys;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// A reduction for [`Comm::all_reduce`], [`Comm::reduce`] and [`Comm::reduce_scatter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Average (sum divided by the world size).
    Avg,
}

impl ReduceOp {
    /// NCCL's operator for this one on a communicator of `world` ranks. On one rank every
    /// operator returns its input, and `Avg` goes to NCCL as `Sum` (the same bits, x * 1/1 = x):
    /// NCCL before 2.29.7 leaves the tail of a one-rank `ncclAvg` unwritten (NVIDIA/nccl#1950;
    /// seen here with n = 4097 f32 on an H200, docs/gpu-runs/2026-11-26-h200-suite).
    fn raw(self, world: usize) -> sys::ncclRedOp_t {
        if world == 1 && self == ReduceOp::Avg {
            return sys::ncclRedOp_t_ncclSum;
        }
        match self {
            ReduceOp::Sum => sys::ncclRedOp_t_ncclSum,
            ReduceOp::Prod => sys::ncclRedOp_t_ncclProd,
            ReduceOp::Max => sys::ncclRedOp_t_ncclMax,
            ReduceOp::Min => sys::ncclRedOp_t_ncclMin,
            ReduceOp::Avg => sys::ncclRedOp_t_ncclAvg,
        }
    }
}

type Stream = sys::cudaStream_t;

impl Comm {
    /// `recv[i] = op over ranks of send[i]`. `send` and `recv` have the same length.
    pub fn all_reduce<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<()> {
        same_len("all_reduce", send.len(), recv.len())?;
        let f = self.func("ncclAllReduce", &self.nccl().lib.ncclAllReduce)?;
        let n = send.len();
        // SAFETY (closure): both buffers hold `n` elements of T on this device.
        self.send_recv("ncclAllReduce", send, recv, 0, |s, r, stream| unsafe {
            f(s, r, n, T::NCCL, op.raw(self.world()), self.raw(), stream)
        })
    }

    /// In-place [`Comm::all_reduce`].
    pub fn all_reduce_in_place<T: NcclType>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let f = self.func("ncclAllReduce", &self.nccl().lib.ncclAllReduce)?;
        let n = buf.len();
        // SAFETY (closure): NCCL allows sendbuff == recvbuff; `n` elements of T.
        self.in_place("ncclAllReduce", buf, |p, stream| unsafe {
            f(p, p, n, T::NCCL, op.raw(self.world()), self.raw(), stream)
        })
    }

    /// `recv[r * n .. (r + 1) * n] = send` of rank r, where n = `send.len()`;
    /// `recv.len()` must be `world * send.len()`.
    pub fn all_gather<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        times_world(
            "all_gather",
            "recv",
            recv.len(),
            "send",
            send.len(),
            self.world(),
        )?;
        let f = self.func("ncclAllGather", &self.nccl().lib.ncclAllGather)?;
        let n = send.len();
        let in_place_at = (self.rank() * n) as i128;
        // SAFETY (closure): lengths checked above.
        self.send_recv(
            "ncclAllGather",
            send,
            recv,
            in_place_at,
            |s, r, stream| unsafe { f(s, r, n, T::NCCL, self.raw(), stream) },
        )
    }

    /// `recv = (op over ranks of send)[rank * n .. (rank + 1) * n]`, where n = `recv.len()`;
    /// `send.len()` must be `world * recv.len()`.
    pub fn reduce_scatter<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let n = recv.len();
        times_world(
            "reduce_scatter",
            "send",
            send.len(),
            "recv",
            n,
            self.world(),
        )?;
        let f = self.func("ncclReduceScatter", &self.nccl().lib.ncclReduceScatter)?;
        let in_place_at = -((self.rank() * n) as i128);
        // SAFETY (closure): lengths checked above.
        self.send_recv(
            "ncclReduceScatter",
            send,
            recv,
            in_place_at,
            |s, r, stream| unsafe { f(s, r, n, T::NCCL, op.raw(self.world()), self.raw(), stream) },
        )
    }

    /// Copies `buf` of rank `root` into `buf` of every rank (in place).
    pub fn broadcast<T: NcclType>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        check_peer("broadcast", root, self.world())?;
        let f = self.func("ncclBroadcast", &self.nccl().lib.ncclBroadcast)?;
        let n = buf.len();
        // SAFETY (closure): in-place broadcast is allowed; `n` elements of T.
        self.in_place("ncclBroadcast", buf, |p, stream| unsafe {
            f(p, p, n, T::NCCL, root as i32, self.raw(), stream)
        })
    }

    /// `recv = op over ranks of send`, written on rank `root` only (`recv` is untouched
    /// elsewhere). `send` and `recv` have the same length.
    pub fn reduce<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        same_len("reduce", send.len(), recv.len())?;
        check_peer("reduce", root, self.world())?;
        let f = self.func("ncclReduce", &self.nccl().lib.ncclReduce)?;
        let n = send.len();
        // SAFETY (closure): lengths checked above.
        self.send_recv("ncclReduce", send, recv, 0, |s, r, stream| unsafe {
            f(
                s,
                r,
                n,
                T::NCCL,
                op.raw(self.world()),
                root as i32,
                self.raw(),
                stream,
            )
        })
    }

    /// Sends `buf` to rank `peer`, which must post a matching [`Comm::recv`]. Pair sends and
    /// receives between the same ranks inside [`super::group`] to avoid deadlock.
    pub fn send<T: NcclType>(&self, buf: &impl DevicePtr<T>, peer: usize) -> Result<()> {
        check_peer("send", peer, self.world())?;
        let f = self.func("ncclSend", &self.nccl().lib.ncclSend)?;
        self.on_device("send", buf, buf)?;
        let stream = self.stream().clone();
        let (p, _guard) = buf.device_ptr(&stream);
        let _issuing = self.issuing()?;
        // SAFETY: `len` elements of T on this device, borrowed until enqueued.
        let rc = unsafe {
            f(
                p as *const c_void,
                buf.len(),
                T::NCCL,
                peer as i32,
                self.raw(),
                self.cu_stream(),
            )
        };
        self.after("ncclSend", rc)
    }

    /// Receives into `buf` from rank `peer` (see [`Comm::send`]).
    pub fn recv<T: NcclType>(&self, buf: &mut impl DevicePtrMut<T>, peer: usize) -> Result<()> {
        check_peer("recv", peer, self.world())?;
        let f = self.func("ncclRecv", &self.nccl().lib.ncclRecv)?;
        let n = buf.len();
        // SAFETY (closure): `n` elements of T on this device.
        self.in_place("ncclRecv", buf, |p, stream| unsafe {
            f(p, n, T::NCCL, peer as i32, self.raw(), stream)
        })
    }

    /// Enqueues `call` on a send and a receive buffer: checks their device, holds cudarc's
    /// stream-ordering guards while the call is issued, and handles the result.
    ///
    /// `send` and `recv` must be disjoint, or overlap exactly the way NCCL's in-place form
    /// of the call wants: `send` starting `in_place_at` elements after `recv`.
    fn send_recv<T>(
        &self,
        call: &'static str,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        in_place_at: i128,
        issue: impl FnOnce(*const c_void, *mut c_void, Stream) -> sys::ncclResult_t,
    ) -> Result<()> {
        self.on_device(call, send, &*recv)?;
        let (send_len, recv_len) = (send.len(), recv.len());
        let stream = self.stream().clone();
        let (s, _send_guard) = send.device_ptr(&stream);
        let (r, _recv_guard) = recv.device_ptr_mut(&stream);
        let send_span = (s, send_len);
        check_in_place::<T>(call, send_span, (r, recv_len), in_place_at)?;
        let _issuing = self.issuing()?;
        let rc = issue(s as *const c_void, r as *mut c_void, self.cu_stream());
        self.after(call, rc)
    }

    /// As [`Comm::send_recv`] for a single buffer that is written.
    fn in_place<T>(
        &self,
        call: &'static str,
        buf: &mut impl DevicePtrMut<T>,
        issue: impl FnOnce(*mut c_void, Stream) -> sys::ncclResult_t,
    ) -> Result<()> {
        self.on_device(call, &*buf, &*buf)?;
        let stream = self.stream().clone();
        let (p, _guard) = buf.device_ptr_mut(&stream);
        let _issuing = self.issuing()?;
        let rc = issue(p as *mut c_void, self.cu_stream());
        self.after(call, rc)
    }
}

/// `send` and `recv` (address, elements) are disjoint, or `send` starts exactly
/// `in_place_at` elements after `recv`.
fn check_in_place<T>(
    call: &str,
    (send, send_len): (u64, usize),
    (recv, recv_len): (u64, usize),
    in_place_at: i128,
) -> Result<()> {
    let size = std::mem::size_of::<T>() as i128;
    let (s0, r0) = (send as i128, recv as i128);
    let overlap = s0 < r0 + recv_len as i128 * size && r0 < s0 + send_len as i128 * size;
    if overlap && send_len > 0 && recv_len > 0 && s0 - r0 != in_place_at * size {
        return Err(Error::invalid(
            call,
            format!(
                "send and recv overlap; in place, send must start {in_place_at} elements into recv"
            ),
        ));
    }
    Ok(())
}

fn check_peer(op: &str, peer: usize, world: usize) -> Result<()> {
    if peer >= world {
        return Err(Error::invalid(
            format!("{op}: peer/root"),
            format!("rank {peer} does not exist in a world of {world}"),
        ));
    }
    Ok(())
}

fn same_len(op: &str, send: usize, recv: usize) -> Result<()> {
    if send != recv {
        return Err(Error::invalid(
            format!("{op}: recv"),
            format!("holds {recv} elements but send holds {send}"),
        ));
    }
    Ok(())
}

/// Checks `big == world * small` for the gather/scatter pairs.
fn times_world(
    op: &str,
    big_name: &str,
    big: usize,
    small_name: &str,
    small: usize,
    world: usize,
) -> Result<()> {
    if small.checked_mul(world) != Some(big) {
        return Err(Error::invalid(
            format!("{op}: {big_name}"),
            format!(
                "holds {big} elements but must hold world ({world}) x {small_name} ({small}) = {}",
                small.saturating_mul(world)
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_checks_name_the_argument() {
        let e = times_world("all_gather", "recv", 10, "send", 3, 4).unwrap_err();
        assert!(e.to_string().contains("all_gather: recv"), "{e}");
        assert!(e.to_string().contains("world (4) x send (3) = 12"), "{e}");
        assert!(times_world("all_gather", "recv", 12, "send", 3, 4).is_ok());
        assert!(times_world("reduce_scatter", "send", 0, "recv", 0, 8).is_ok());
        assert!(same_len("all_reduce", 3, 4).is_err());
        assert!(same_len("all_reduce", 4, 4).is_ok());
        assert!(check_peer("broadcast", 4, 4).is_err());
        assert!(check_peer("broadcast", 3, 4).is_ok());
    }

    #[test]
    fn overlapping_buffers_must_be_the_in_place_form() {
        let base = 0x1000u64;
        // all_reduce: disjoint or identical.
        assert!(check_in_place::<f32>("ar", (base, 16), (base + 64, 16), 0).is_ok());
        assert!(check_in_place::<f32>("ar", (base, 16), (base, 16), 0).is_ok());
        assert!(check_in_place::<f32>("ar", (base + 4, 16), (base, 16), 0).is_err());
        // all_gather, rank 2 of 4, n = 8: send = recv + 16 elements.
        let recv = (base, 32);
        assert!(check_in_place::<u16>("ag", (base + 32, 8), recv, 16).is_ok());
        assert!(check_in_place::<u16>("ag", (base + 30, 8), recv, 16).is_err());
        // reduce_scatter, rank 1, n = 8: recv = send + 8 elements.
        assert!(check_in_place::<f64>("rs", (base, 32), (base + 64, 8), -8).is_ok());
        let e = check_in_place::<f64>("rs", (base, 32), (base + 128, 8), -8).unwrap_err();
        assert!(e.to_string().contains("-8 elements"), "{e}");
    }

    #[test]
    fn avg_goes_to_nccl_as_sum_on_one_rank_only() {
        assert_eq!(ReduceOp::Avg.raw(1), sys::ncclRedOp_t_ncclSum);
        assert_eq!(ReduceOp::Avg.raw(2), sys::ncclRedOp_t_ncclAvg);
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min] {
            assert_eq!(op.raw(1), op.raw(8), "{op:?}");
        }
    }
}
