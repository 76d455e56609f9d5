//! What the ranks of an IPC group ([`TpGroup::from_comm`]) tell each other before the group
//! is built (a [`RankRecord`] per rank), what they agree on from the records (the CTA
//! budget, one host or several), and rank 0's topology verdict, broadcast so that every rank
//! chooses the same algorithm for every message.
//!
//! [`TpGroup::from_comm`]: super::TpGroup::from_comm

use super::{cta_budget, sm_count, GroupOptions};
use crate::comm::Comm;
use crate::device::cuda;
use crate::error::{Error, Result};
use crate::topology::{self, Discovery, RankPlace, Topology, Verdict};
use cudarc::driver::{sys, CudaContext};
use std::ffi::c_char;
use std::time::Duration;

/// What one rank of an IPC group tells the others before the group is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct RankRecord {
    sms: u32,
    /// The CUDA ordinal of the rank's device, as its own process numbers it.
    ordinal: u32,
    /// `options.blocks`, 0 for none.
    blocks: u32,
    /// `options.fused_blocks_per_sm`, 0 for none.
    fused_blocks_per_sm: u32,
    /// `options.fused_packets`, 0 or 1.
    fused_packets: u32,
    /// `options.all_reduce_packets`, 0 or 1.
    all_reduce_packets: u32,
    capacity: u64,
    timeout_ns: u64,
    bus_id: String,
    boot_id: String,
    hostname: String,
}

const RANK_MAGIC: [u8; 4] = *b"TPG1";
const RANK_RECORD_BYTES: usize = 256;
const BUS_ID: std::ops::Range<usize> = 32..64;
const BOOT_ID: std::ops::Range<usize> = 64..128;
const HOSTNAME: std::ops::Range<usize> = 128..224;
const FUSED_BLOCKS_PER_SM: usize = 224;
const FUSED_PACKETS: usize = 228;
const ALL_REDUCE_PACKETS: usize = 232;

fn put_str(buf: &mut [u8], range: std::ops::Range<usize>, s: &str) {
    let field = &mut buf[range];
    let n = s.len().min(field.len());
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn get_str(buf: &[u8], range: std::ops::Range<usize>) -> String {
    let field = &buf[range];
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl RankRecord {
    pub(super) fn local(ctx: &CudaContext, options: &GroupOptions) -> Result<RankRecord> {
        let mut bus = [0 as c_char; 32];
        // SAFETY: writes at most 32 bytes, NUL-terminated, for a valid device.
        unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, ctx.cu_device()) }
            .result()
            .map_err(cuda("reading the PCI bus id"))?;
        let bus: Vec<u8> = bus.iter().map(|&c| c as u8).collect();
        let mut hostname = read_trimmed("/proc/sys/kernel/hostname");
        if hostname.is_empty() {
            hostname = std::env::var("HOSTNAME").unwrap_or_default();
        }
        Ok(RankRecord {
            sms: sm_count(ctx)? as u32,
            ordinal: ctx.ordinal() as u32,
            blocks: options.blocks.unwrap_or(0) as u32,
            fused_blocks_per_sm: options.fused_blocks_per_sm.unwrap_or(0) as u32,
            fused_packets: u32::from(options.fused_packets),
            all_reduce_packets: u32::from(options.all_reduce_packets),
            capacity: options.capacity_bytes as u64,
            timeout_ns: options.timeout_ns(),
            bus_id: get_str(&bus, 0..bus.len()),
            boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
            hostname,
        })
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; RANK_RECORD_BYTES];
        b[0..4].copy_from_slice(&RANK_MAGIC);
        b[4..8].copy_from_slice(&self.sms.to_le_bytes());
        b[8..12].copy_from_slice(&self.blocks.to_le_bytes());
        b[12..16].copy_from_slice(&self.ordinal.to_le_bytes());
        b[16..24].copy_from_slice(&self.capacity.to_le_bytes());
        b[24..32].copy_from_slice(&self.timeout_ns.to_le_bytes());
        put_str(&mut b, BUS_ID, &self.bus_id);
        put_str(&mut b, BOOT_ID, &self.boot_id);
        put_str(&mut b, HOSTNAME, &self.hostname);
        b[FUSED_BLOCKS_PER_SM..FUSED_BLOCKS_PER_SM + 4]
            .copy_from_slice(&self.fused_blocks_per_sm.to_le_bytes());
        b[FUSED_PACKETS..FUSED_PACKETS + 4].copy_from_slice(&self.fused_packets.to_le_bytes());
        b[ALL_REDUCE_PACKETS..ALL_REDUCE_PACKETS + 4]
            .copy_from_slice(&self.all_reduce_packets.to_le_bytes());
        b
    }

    pub(super) fn decode(rank: usize, b: &[u8]) -> Result<RankRecord> {
        if b.len() != RANK_RECORD_BYTES || b[0..4] != RANK_MAGIC {
            return Err(Error::Rendezvous {
                peer: format!("rank {rank}"),
                reason: "sent something that is not a tpfuse group record".to_string(),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(v)
        };
        Ok(RankRecord {
            sms: u32_at(4),
            blocks: u32_at(8),
            ordinal: u32_at(12),
            capacity: u64_at(16),
            timeout_ns: u64_at(24),
            bus_id: get_str(b, BUS_ID),
            boot_id: get_str(b, BOOT_ID),
            hostname: get_str(b, HOSTNAME),
            fused_blocks_per_sm: u32_at(FUSED_BLOCKS_PER_SM),
            fused_packets: u32_at(FUSED_PACKETS),
            all_reduce_packets: u32_at(ALL_REDUCE_PACKETS),
        })
    }

    /// Whether this rank runs on the same host (same kernel boot) as `other`.
    fn same_host(&self, other: &RankRecord) -> bool {
        if !self.boot_id.is_empty() && !other.boot_id.is_empty() {
            self.boot_id == other.boot_id
        } else {
            self.hostname == other.hostname
        }
    }
}

/// What the ranks of an IPC group agree on, computed identically on every rank.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Agreement {
    pub(super) blocks: usize,
    /// The smallest SM count of the ranks' GPUs.
    pub(super) fewest_sms: usize,
    /// The largest.
    pub(super) most_sms: usize,
    /// `Some(hosts)` when the ranks are not all on rank 0's host.
    pub(super) several_hosts: Option<String>,
}

pub(super) fn agree(records: &[RankRecord]) -> Result<Agreement> {
    let first = &records[0];
    for (r, rec) in records.iter().enumerate().skip(1) {
        let mismatch = |field: &str, a: String, b: String| {
            Error::invalid(
                format!("options.{field}"),
                format!("rank 0 passed {a}, rank {r} {b}: every rank must pass the same options"),
            )
        };
        if rec.capacity != first.capacity {
            return Err(mismatch(
                "capacity_bytes",
                first.capacity.to_string(),
                rec.capacity.to_string(),
            ));
        }
        if rec.timeout_ns != first.timeout_ns {
            return Err(mismatch(
                "timeout",
                format!("{:?}", Duration::from_nanos(first.timeout_ns)),
                format!("{:?}", Duration::from_nanos(rec.timeout_ns)),
            ));
        }
        // An Option<usize> option as the record holds it: 0 for None.
        let show = |b: u32| {
            if b == 0 {
                "None".to_string()
            } else {
                format!("Some({b})")
            }
        };
        if rec.blocks != first.blocks {
            return Err(mismatch("blocks", show(first.blocks), show(rec.blocks)));
        }
        if rec.fused_blocks_per_sm != first.fused_blocks_per_sm {
            return Err(mismatch(
                "fused_blocks_per_sm",
                show(first.fused_blocks_per_sm),
                show(rec.fused_blocks_per_sm),
            ));
        }
        if rec.fused_packets != first.fused_packets {
            return Err(mismatch(
                "fused_packets",
                (first.fused_packets != 0).to_string(),
                (rec.fused_packets != 0).to_string(),
            ));
        }
        if rec.all_reduce_packets != first.all_reduce_packets {
            return Err(mismatch(
                "all_reduce_packets",
                (first.all_reduce_packets != 0).to_string(),
                (rec.all_reduce_packets != 0).to_string(),
            ));
        }
    }
    let world = records.len();
    let fewest_sms = records.iter().map(|r| r.sms as usize).min().unwrap_or(1);
    let most_sms = records.iter().map(|r| r.sms as usize).max().unwrap_or(1);
    if first.blocks as usize > fewest_sms {
        return Err(Error::invalid(
            "options.blocks",
            format!(
                "{} blocks, but a rank's GPU has {fewest_sms} SMs: every block of a custom \
                 kernel must be resident at once (one block per SM)",
                first.blocks
            ),
        ));
    }
    let blocks = if first.blocks > 0 {
        first.blocks as usize
    } else {
        records
            .iter()
            .map(|r| cta_budget(r.sms as usize, world, false))
            .min()
            .unwrap_or(1)
    };
    let several_hosts = records
        .iter()
        .any(|r| !r.same_host(first))
        .then(|| host_list(records));
    Ok(Agreement {
        blocks,
        fewest_sms,
        most_sms,
        several_hosts,
    })
}

/// The ranks' hosts in rank order, deduplicated; two machines with one host name are told
/// apart by their boot ids.
fn host_list(records: &[RankRecord]) -> String {
    let mut hosts: Vec<String> = Vec::new();
    for r in records {
        let twin = records
            .iter()
            .any(|o| o.hostname == r.hostname && !o.same_host(r));
        let name = if twin {
            let boot: String = r.boot_id.chars().take(8).collect();
            format!("{} (boot {boot})", r.hostname)
        } else {
            r.hostname.clone()
        };
        if !hosts.contains(&name) {
            hosts.push(name);
        }
    }
    hosts.join(", ")
}

/// Rank 0's verdict for the group described by `records`, from its own NVML view.
fn verdict_of(topo: &Topology, records: &[RankRecord], agreed: &Agreement) -> Option<Verdict> {
    let first = &records[0];
    if agreed.several_hosts.is_some() {
        let places: Vec<RankPlace> = records
            .iter()
            .map(|r| RankPlace {
                host: if r.same_host(first) {
                    topo.hostname.clone()
                } else if r.hostname == topo.hostname {
                    format!("{} (another machine)", r.hostname)
                } else {
                    r.hostname.clone()
                },
                ordinal: r.ordinal,
            })
            .collect();
        return Some(topology::assess_places(topo, &places));
    }
    let mut gpus = Vec::with_capacity(records.len());
    for r in records {
        gpus.push(
            topo.gpus
                .iter()
                .find(|g| topology::same_bus_id(&g.pci_bus_id, &r.bus_id))?,
        );
    }
    let ordinals: Option<Vec<u32>> = gpus.iter().map(|g| g.cuda_ordinal).collect();
    if let Some(ordinals) = ordinals {
        return Some(topology::assess(topo, &ordinals));
    }
    // Rank 0's process does not see every GPU of the group: name them by NVML index.
    let mut by_index = topo.clone();
    for g in &mut by_index.gpus {
        g.cuda_ordinal = Some(g.nvml_index);
    }
    let indices: Vec<u32> = gpus.iter().map(|g| g.nvml_index).collect();
    Some(topology::assess(&by_index, &indices))
}

/// Rank 0 computes the verdict and broadcasts it (as JSON) so that every rank holds the
/// same one and chooses the same algorithm for every message.
pub(super) fn agreed_verdict(
    comm: &Comm,
    records: &[RankRecord],
    agreed: &Agreement,
) -> Result<Option<Verdict>> {
    const BYTES: usize = 16 << 10;
    let mut host = vec![0u8; BYTES];
    if comm.rank() == 0 {
        let verdict = match topology::discover() {
            Discovery::Found(topo) => verdict_of(&topo, records, agreed),
            Discovery::NoDriver | Discovery::Broken(_) => None,
        };
        let mut json = serde_json::to_vec(&verdict).unwrap_or_else(|_| b"null".to_vec());
        if json.len() > BYTES - 4 {
            json = b"null".to_vec();
        }
        host[0..4].copy_from_slice(&(json.len() as u32).to_le_bytes());
        host[4..4 + json.len()].copy_from_slice(&json);
    }
    let stream = comm.stream();
    let mut buf = stream
        .clone_htod(&host)
        .map_err(cuda("uploading the verdict"))?;
    comm.broadcast(&mut buf, 0)?;
    comm.synchronize()?;
    let got = stream
        .clone_dtoh(&buf)
        .map_err(cuda("downloading the verdict"))?;
    stream
        .synchronize()
        .map_err(cuda("waiting for the verdict"))?;
    let len = u32::from_le_bytes([got[0], got[1], got[2], got[3]]) as usize;
    if len > BYTES - 4 {
        return Err(Error::Rendezvous {
            peer: "rank 0".to_string(),
            reason: format!("sent a verdict of {len} bytes"),
        });
    }
    Ok(serde_json::from_slice::<Option<Verdict>>(&got[4..4 + len]).unwrap_or(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(host: &str, boot: &str) -> RankRecord {
        RankRecord {
            sms: 132,
            ordinal: 3,
            blocks: 0,
            fused_blocks_per_sm: 0,
            fused_packets: 1,
            all_reduce_packets: 0,
            capacity: 8 << 20,
            timeout_ns: 10_000_000_000,
            bus_id: "00000000:18:00.0".to_string(),
            boot_id: boot.to_string(),
            hostname: host.to_string(),
        }
    }

    #[test]
    fn rank_records_round_trip() {
        let mut r = record("node-1", "0b1f7c1e-8f7e-4c55-9a3a-1f2e3d4c5b6a");
        r.blocks = 17;
        r.fused_blocks_per_sm = 2;
        r.fused_packets = 0;
        r.all_reduce_packets = 1;
        let b = r.encode();
        assert_eq!(b.len(), RANK_RECORD_BYTES);
        assert_eq!(RankRecord::decode(0, &b).unwrap(), r);
        let long = "h".repeat(300);
        let r2 = record(&long, "");
        let back = RankRecord::decode(1, &r2.encode()).unwrap();
        assert_eq!(back.hostname.len(), HOSTNAME.len());
        let mut bad = b.clone();
        bad[0] = b'X';
        let e = RankRecord::decode(5, &bad).unwrap_err().to_string();
        assert!(e.contains("rank 5"), "{e}");
    }

    #[test]
    fn ranks_agree_on_blocks_and_hosts() {
        let mut records = vec![record("a", "boot"), record("a", "boot")];
        records[1].sms = 78;
        let agreed = agree(&records).unwrap();
        assert_eq!(agreed.blocks, 39);
        assert_eq!((agreed.fewest_sms, agreed.most_sms), (78, 132));
        assert_eq!(agreed.several_hosts, None);

        records[0].blocks = 8;
        records[1].blocks = 8;
        assert_eq!(agree(&records).unwrap().blocks, 8);
        // More blocks than the smallest GPU has SMs: they could not all be resident.
        let mut big = records.clone();
        big[0].blocks = 79;
        big[1].blocks = 79;
        let e = agree(&big).unwrap_err().to_string();
        assert!(e.contains("options.blocks") && e.contains("78 SMs"), "{e}");

        // Same hostname, other boot: another machine.
        records[1].boot_id = "other".to_string();
        assert_eq!(
            agree(&records).unwrap().several_hosts.as_deref(),
            Some("a (boot boot), a (boot other)")
        );
        // No boot ids: hostnames decide.
        records[0].boot_id.clear();
        records[1].boot_id.clear();
        assert!(agree(&records).unwrap().several_hosts.is_none());
        records[1].hostname = "b".to_string();
        assert_eq!(
            agree(&records).unwrap().several_hosts.as_deref(),
            Some("a, b")
        );
    }

    #[test]
    fn ranks_with_different_options_are_refused() {
        let base = vec![record("a", "x"), record("a", "x"), record("a", "x")];
        let mut r = base.clone();
        r[2].capacity = 1 << 20;
        let e = agree(&r).unwrap_err().to_string();
        assert!(
            e.contains("options.capacity_bytes") && e.contains("rank 2"),
            "{e}"
        );
        let mut r = base.clone();
        r[1].timeout_ns = 1;
        let e = agree(&r).unwrap_err().to_string();
        assert!(e.contains("options.timeout"), "{e}");
        let mut r = base.clone();
        r[1].blocks = 4;
        let e = agree(&r).unwrap_err().to_string();
        assert!(e.contains("options.blocks") && e.contains("Some(4)"), "{e}");
        let mut r = base.clone();
        r[2].fused_blocks_per_sm = 1;
        let e = agree(&r).unwrap_err().to_string();
        assert!(
            e.contains("options.fused_blocks_per_sm")
                && e.contains("None")
                && e.contains("Some(1)"),
            "{e}"
        );
        let mut r = base.clone();
        r[1].fused_packets = 0;
        let e = agree(&r).unwrap_err().to_string();
        assert!(
            e.contains("options.fused_packets") && e.contains("true") && e.contains("false"),
            "{e}"
        );
        let mut r = base;
        r[1].all_reduce_packets = 1;
        let e = agree(&r).unwrap_err().to_string();
        assert!(
            e.contains("options.all_reduce_packets") && e.contains("true") && e.contains("false"),
            "{e}"
        );
    }

    fn fixture(name: &str) -> Topology {
        let path = format!(
            "{}/tests/fixtures/topology/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        Topology::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn on_gpus(topo: &Topology, nvml: &[u32]) -> Vec<RankRecord> {
        nvml.iter()
            .map(|&i| RankRecord {
                bus_id: topo.gpu(i).unwrap().pci_bus_id.clone(),
                ..record(&topo.hostname, "boot")
            })
            .collect()
    }

    #[test]
    fn rank_0_names_the_gpus_by_bus_id() {
        let topo = fixture("h100_sxm_8x_nvswitch");
        let records = on_gpus(&topo, &[5, 2]);
        let agreed = agree(&records).unwrap();
        let v = verdict_of(&topo, &records, &agreed).unwrap();
        let want: Vec<u32> = [5, 2]
            .iter()
            .map(|&i| topo.gpu(i).unwrap().cuda_ordinal.unwrap())
            .collect();
        assert_eq!(v.ordinals, want);
        assert!(v.custom_all_reduce(), "{}", v.describe());

        // Rank 0 does not see every GPU: NVML indices, same policy.
        let mut hidden = topo.clone();
        hidden.gpus[2].cuda_ordinal = None;
        let v = verdict_of(&hidden, &records, &agreed).unwrap();
        assert_eq!(v.ordinals, vec![5, 2]);
        assert!(v.custom_all_reduce(), "{}", v.describe());

        // A bus id NVML does not show: no verdict.
        let mut stranger = records.clone();
        stranger[1].bus_id = "0000:ff:00.0".to_string();
        assert_eq!(verdict_of(&topo, &stranger, &agreed), None);
    }

    #[test]
    fn rank_0_refuses_what_the_policy_refuses() {
        let topo = fixture("rtx4090_2x_no_p2p");
        let records = on_gpus(&topo, &[0, 1]);
        let v = verdict_of(&topo, &records, &agree(&records).unwrap()).unwrap();
        assert!(!v.custom_all_reduce(), "{}", v.describe());

        let topo = fixture("h100_sxm_8x_nvswitch");
        let mut records = on_gpus(&topo, &[0, 1]);
        records[1].boot_id = "elsewhere".to_string();
        records[1].hostname = "node-b".to_string();
        let agreed = agree(&records).unwrap();
        assert!(agreed.several_hosts.is_some());
        let v = verdict_of(&topo, &records, &agreed).unwrap();
        assert!(
            v.describe().contains("hosts") && !v.single_host,
            "{}",
            v.describe()
        );
    }
}
