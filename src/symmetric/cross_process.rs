//! One rank per process: every rank's buffers exported as CUDA IPC handles, the handles
//! all-gathered over the group's NCCL communicator, and every peer's opened
//! ([`ipc`], [`ipc_outcome`]); the record exchange they use ([`exchange`]).

use super::*;

/// All-gathers one fixed-size record per rank over `comm` (through a small device `u8`
/// buffer on the communicator's stream) and returns every rank's record, index = rank.
/// Every rank must pass a record of the same length.
pub(crate) fn exchange(comm: &Comm, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let stream = comm.stream();
    let send = stream
        .clone_htod(mine)
        .map_err(cuda("uploading an exchange record"))?;
    let mut recv = stream
        .alloc_zeros::<u8>(mine.len() * comm.world())
        .map_err(cuda("allocating the exchange buffer"))?;
    comm.all_gather(&send, &mut recv)?;
    comm.synchronize()?;
    let all = stream
        .clone_dtoh(&recv)
        .map_err(cuda("downloading the exchange records"))?;
    stream
        .synchronize()
        .map_err(cuda("waiting for the exchange records"))?;
    Ok(all.chunks(mine.len().max(1)).map(<[u8]>::to_vec).collect())
}

/// The outcome of [`ipc_outcome`]: a workspace, or why CUDA IPC is not possible between
/// the ranks (every rank gets the same answer).
pub(crate) enum IpcOutcome {
    /// Every rank opened every peer's buffers.
    Ready(SymmetricWorkspace),
    /// Some rank could not export or open a handle; the reason names it.
    Unavailable(String),
}

/// Phase-one record: `magic, status, code, reserved, capacity, data handle, pad handle`.
const IPC_MAGIC: [u8; 4] = *b"TPI1";
const IPC_RECORD_BYTES: usize = 160;
const STATUS_OK: u32 = 0;
/// Allocation or zeroing failed (a hard error).
const STATUS_FAILED: u32 = 1;
/// `cuIpcGetMemHandle` failed (IPC unavailable).
const STATUS_EXPORT_FAILED: u32 = 2;
/// `cuIpcOpenMemHandle` failed (IPC unavailable).
const STATUS_OPEN_FAILED: u32 = 3;

struct IpcRecord {
    status: u32,
    code: u32,
    capacity: u64,
    data: [u8; IPC_HANDLE_BYTES],
    pad: [u8; IPC_HANDLE_BYTES],
}

impl IpcRecord {
    fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; IPC_RECORD_BYTES];
        b[0..4].copy_from_slice(&IPC_MAGIC);
        b[4..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..12].copy_from_slice(&self.code.to_le_bytes());
        b[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        b[24..88].copy_from_slice(&self.data);
        b[88..152].copy_from_slice(&self.pad);
        b
    }

    fn decode(rank: usize, b: &[u8]) -> Result<IpcRecord> {
        if b.len() != IPC_RECORD_BYTES || b[0..4] != IPC_MAGIC {
            return Err(Error::Rendezvous {
                peer: format!("rank {rank}"),
                reason: "sent something that is not a tpfuse IPC record".to_string(),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut capacity = [0u8; 8];
        capacity.copy_from_slice(&b[16..24]);
        let mut data = [0u8; IPC_HANDLE_BYTES];
        data.copy_from_slice(&b[24..88]);
        let mut pad = [0u8; IPC_HANDLE_BYTES];
        pad.copy_from_slice(&b[88..152]);
        Ok(IpcRecord {
            status: u32_at(4),
            code: u32_at(8),
            capacity: u64::from_le_bytes(capacity),
            data,
            pad,
        })
    }
}

/// What failed on this rank before the first exchange.
enum LocalFailure {
    /// Allocation or zeroing: a hard error.
    Failed(Error),
    /// Export: IPC is not possible.
    Export(DriverError),
}

/// This rank's buffers and their handles.
struct Exported {
    data: Arc<DeviceMemory>,
    pad: Arc<DeviceMemory>,
    data_handle: [u8; IPC_HANDLE_BYTES],
    pad_handle: [u8; IPC_HANDLE_BYTES],
}

fn export_local(
    ctx: &Arc<CudaContext>,
    capacity: usize,
) -> std::result::Result<Exported, LocalFailure> {
    let (data, pad) = allocate_rank(ctx, capacity).map_err(LocalFailure::Failed)?;
    ctx.synchronize()
        .map_err(|e| LocalFailure::Failed(cuda("waiting for the signal pad to be zeroed")(e)))?;
    let data_handle = data.export().map_err(LocalFailure::Export)?;
    let pad_handle = pad.export().map_err(LocalFailure::Export)?;
    Ok(Exported {
        data: Arc::new(data),
        pad: Arc::new(pad),
        data_handle,
        pad_handle,
    })
}

/// Multi-process: this rank's buffers, and every peer's opened through CUDA IPC. The
/// handles (64 bytes each, data buffer and pad) are all-gathered over `comm` (a collective:
/// every rank of `comm` must call this, with the same `capacity`); peers' handles are
/// opened with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`. Every rank reaches the same outcome.
///
/// Errors: [`Error::InvalidArgument`] for a world outside 2 ..= [`MAX_RANKS`], a zero
/// capacity, or ranks that passed different capacities, and, naming the rank and the peer,
/// when a handle cannot be exported or opened (CUDA IPC is not possible between these
/// processes, for instance across containers without a shared IPC namespace, or on
/// machines that report peer access but refuse IPC); [`Error::Cuda`] when an allocation
/// fails here, [`Error::Rendezvous`] when it failed on a peer; the communicator's errors.
pub fn ipc(comm: &Comm, capacity: usize) -> Result<SymmetricWorkspace> {
    match ipc_outcome(comm, capacity)? {
        IpcOutcome::Ready(ws) => Ok(ws),
        IpcOutcome::Unavailable(reason) => Err(Error::invalid("comm", reason)),
    }
}

/// [`ipc`], with "IPC is not possible here" as [`IpcOutcome::Unavailable`] so that a group
/// can fall back to NCCL instead of failing.
pub(crate) fn ipc_outcome(comm: &Comm, capacity: usize) -> Result<IpcOutcome> {
    let world = comm.world();
    let rank = comm.rank();
    check_world("comm", world)?;
    let capacity = checked_capacity("capacity", capacity)?;
    require_driver()?;
    let ctx = comm.stream().context().clone();

    // Phase 1: allocate, zero, export; everyone learns everyone's handles and status.
    let local = export_local(&ctx, capacity);
    let mine = match &local {
        Ok(e) => IpcRecord {
            status: STATUS_OK,
            code: 0,
            capacity: capacity as u64,
            data: e.data_handle,
            pad: e.pad_handle,
        },
        Err(f) => IpcRecord {
            status: match f {
                LocalFailure::Failed(_) => STATUS_FAILED,
                LocalFailure::Export(_) => STATUS_EXPORT_FAILED,
            },
            code: match f {
                LocalFailure::Failed(Error::Cuda { source, .. }) => source.0 as u32,
                LocalFailure::Failed(_) => 0,
                LocalFailure::Export(e) => e.0 as u32,
            },
            capacity: capacity as u64,
            data: [0; IPC_HANDLE_BYTES],
            pad: [0; IPC_HANDLE_BYTES],
        },
    };
    let records = exchange(comm, &mine.encode())?
        .iter()
        .enumerate()
        .map(|(r, b)| IpcRecord::decode(r, b))
        .collect::<Result<Vec<_>>>()?;
    // Every rank decides from the same records, in the same order, so every rank reaches
    // the same outcome; this rank's own error only makes its message more precise.
    let (local, mut own_failure) = match local {
        Ok(e) => (Some(e), None),
        Err(f) => (None, Some(f)),
    };
    if let Some((r, rec)) = records
        .iter()
        .enumerate()
        .find(|(_, rec)| rec.status == STATUS_FAILED)
    {
        if r == rank {
            if let Some(LocalFailure::Failed(e)) = own_failure.take() {
                return Err(e);
            }
        }
        return Err(Error::Rendezvous {
            peer: format!("rank {r}"),
            reason: format!(
                "could not allocate its symmetric buffers of 2 x {} bytes (CUDA error {})",
                rec.capacity, rec.code
            ),
        });
    }
    if let Some((r, rec)) = records
        .iter()
        .enumerate()
        .find(|(_, rec)| rec.capacity != capacity as u64)
    {
        return Err(Error::invalid(
            "capacity",
            format!(
                "rank {r} asked for {} bytes, rank {rank} for {capacity} (both rounded up to \
                 {CAPACITY_ALIGN}): every rank must pass the same capacity",
                rec.capacity
            ),
        ));
    }
    if let Some((r, rec)) = records
        .iter()
        .enumerate()
        .find(|(_, rec)| rec.status == STATUS_EXPORT_FAILED)
    {
        let detail = match &own_failure {
            Some(LocalFailure::Export(e)) if r == rank => e.to_string(),
            _ => format!("CUDA error {}", rec.code),
        };
        return Ok(IpcOutcome::Unavailable(format!(
            "rank {r} cannot export its buffers for CUDA IPC (cuIpcGetMemHandle: {detail}); \
             CUDA IPC is not possible here"
        )));
    }
    let Some(local) = local else {
        // Unreachable: this rank's status was not OK, so one of the checks above returned.
        return Err(Error::Rendezvous {
            peer: format!("rank {rank}"),
            reason: "reported success without buffers".to_string(),
        });
    };

    // Phase 2: open every peer's handles; everyone learns whether everyone succeeded.
    let mut data = Vec::with_capacity(world);
    let mut signals = Vec::with_capacity(world);
    let mut failure: Option<(usize, &'static str, DriverError)> = None;
    for (p, rec) in records.iter().enumerate() {
        if p == rank {
            data.push(local.data.clone());
            signals.push(local.pad.clone());
            continue;
        }
        match DeviceMemory::open(&ctx, &rec.data, 2 * capacity) {
            Ok(m) => data.push(Arc::new(m)),
            Err(e) => {
                failure = Some((p, "data buffer", e));
                break;
            }
        }
        match DeviceMemory::open(&ctx, &rec.pad, SIGNAL_PAD_BYTES) {
            Ok(m) => signals.push(Arc::new(m)),
            Err(e) => {
                failure = Some((p, "signal pad", e));
                break;
            }
        }
    }
    let mut status = [0u8; 16];
    if let Some((peer, what, e)) = &failure {
        status[0..4].copy_from_slice(&STATUS_OPEN_FAILED.to_le_bytes());
        status[4..8].copy_from_slice(&(*peer as u32).to_le_bytes());
        status[8..12].copy_from_slice(&(e.0 as u32).to_le_bytes());
        status[12] = u8::from(*what == "signal pad");
    }
    let statuses = exchange(comm, &status)?;
    let failed = statuses.iter().enumerate().find(|(_, s)| s[0..4] != [0; 4]);
    let Some((r, s)) = failed else {
        return Ok(IpcOutcome::Ready(SymmetricWorkspace {
            rank,
            capacity,
            data,
            signals,
        }));
    };
    let u32_at = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let what = if s[12] == 1 {
        "signal pad"
    } else {
        "data buffer"
    };
    let detail = match &failure {
        Some((_, _, e)) if r == rank => e.to_string(),
        _ => format!("CUDA error {}", u32_at(8)),
    };
    let reason = format!(
        "rank {r} could not open the {what} of rank {} through CUDA IPC \
         (cuIpcOpenMemHandle: {detail}); CUDA IPC is not possible here, even where the driver \
         reports peer access",
        u32_at(4)
    );
    // Close what this rank opened, wait until every peer has closed what it opened of ours,
    // then free ours (freeing an exported allocation that a peer still maps is undefined).
    drop(data);
    drop(signals);
    let _ = comm.barrier();
    drop(local);
    Ok(IpcOutcome::Unavailable(reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_records_round_trip() {
        let rec = IpcRecord {
            status: STATUS_EXPORT_FAILED,
            code: 801,
            capacity: 1 << 23,
            data: [7; IPC_HANDLE_BYTES],
            pad: [9; IPC_HANDLE_BYTES],
        };
        let bytes = rec.encode();
        assert_eq!(bytes.len(), IPC_RECORD_BYTES);
        let back = IpcRecord::decode(3, &bytes).unwrap();
        assert_eq!(back.status, STATUS_EXPORT_FAILED);
        assert_eq!(back.code, 801);
        assert_eq!(back.capacity, 1 << 23);
        assert_eq!(back.data, [7; IPC_HANDLE_BYTES]);
        assert_eq!(back.pad, [9; IPC_HANDLE_BYTES]);
        let e = IpcRecord::decode(3, &bytes[1..]).err().unwrap().to_string();
        assert!(e.contains("rank 3"), "{e}");
    }
}
