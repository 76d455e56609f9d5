//! The policy: which algorithms a set of ranks can use, and why not.
//!
//! Ranks are named by CUDA ordinal (what the process passes to `CudaContext::new`). The
//! custom all-reduce reads peers' memory directly, so it needs peer access between every
//! pair; on PCIe it only pays off for two GPUs (beyond that NCCL's ring wins, as vLLM
//! measured); across hosts it cannot run at all. NVLink SHARP (multicast) needs Hopper or
//! newer behind NVSwitches.

use super::model::{Ancestor, Gpu, P2pStatus, Topology};
use serde::{Deserialize, Serialize};

/// What joins the GPUs of a group, slowest pair first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Interconnect {
    /// Every GPU hangs off NVSwitches: full bandwidth between every pair.
    NvSwitch,
    /// Every pair has direct NVLink links (a mesh or a bridge).
    NvLink,
    /// At least one pair talks over PCIe only.
    Pcie,
}

impl Interconnect {
    /// Words for a report.
    pub fn describe(self) -> &'static str {
        match self {
            Interconnect::NvSwitch => "NVLink through NVSwitch",
            Interconnect::NvLink => "NVLink full mesh",
            Interconnect::Pcie => "PCIe",
        }
    }
}

/// Why the custom all-reduce cannot serve a group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Refusal {
    /// A rank's GPU is not in the topology (or hidden from CUDA).
    UnknownGpu {
        /// The CUDA ordinal asked for.
        ordinal: u32,
    },
    /// The same GPU twice: the custom kernels need one GPU per rank (use virtual ranks).
    DuplicateGpu {
        /// The CUDA ordinal listed twice.
        ordinal: u32,
    },
    /// The ranks are on more than one host.
    MultiHost {
        /// The hosts, in rank order, deduplicated.
        hosts: Vec<String>,
    },
    /// Two GPUs cannot read or write each other's memory.
    NoPeerAccess {
        /// CUDA ordinal of the first GPU.
        a: u32,
        /// CUDA ordinal of the second GPU.
        b: u32,
        /// Peer reads.
        read: P2pStatus,
        /// Peer writes.
        write: P2pStatus,
        /// Where their PCIe paths meet.
        ancestor: Ancestor,
    },
    /// More than two GPUs with PCIe only: NCCL is faster there.
    PcieBeyondTwo {
        /// The number of ranks.
        world: usize,
    },
}

impl Refusal {
    /// One sentence for a report.
    pub fn describe(&self) -> String {
        match self {
            Refusal::UnknownGpu { ordinal } => {
                format!("GPU {ordinal} is not visible to CUDA on this host")
            }
            Refusal::DuplicateGpu { ordinal } => format!(
                "GPU {ordinal} is listed twice (one GPU per rank; use virtual ranks to rehearse)"
            ),
            Refusal::MultiHost { hosts } => format!(
                "the ranks span {} hosts ({}); the custom kernels need one host, NCCL carries the rest",
                hosts.len(),
                hosts.join(", ")
            ),
            Refusal::NoPeerAccess {
                a,
                b,
                read,
                write,
                ancestor,
            } => {
                let why = if !read.is_ok() { read } else { write };
                format!(
                    "GPU {a} and GPU {b} have no peer access ({}), they meet {}",
                    why.describe(),
                    ancestor.describe()
                )
            }
            Refusal::PcieBeyondTwo { world } => format!(
                "{world} GPUs on PCIe only: beyond 2 GPUs NCCL's ring is faster than a custom all-reduce"
            ),
        }
    }
}

/// What a set of ranks can use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The ranks' CUDA ordinals, in rank order.
    pub ordinals: Vec<u32>,
    /// Whether every rank is on this topology's host.
    pub single_host: bool,
    /// What joins the GPUs; `None` for one rank, an unknown GPU or several hosts.
    pub interconnect: Option<Interconnect>,
    /// `None` when the custom all-reduce can serve the group, else why not.
    pub custom_all_reduce_refused: Option<Refusal>,
    /// `None` when NVLink SHARP multicast may be used (still subject to the driver's
    /// multicast support, checked at run time), else why not.
    pub multicast_refused: Option<String>,
}

impl Verdict {
    /// Whether the custom all-reduce may run.
    pub fn custom_all_reduce(&self) -> bool {
        self.custom_all_reduce_refused.is_none()
    }

    /// "custom all-reduce: yes, NVLink full mesh" / "custom all-reduce: no: …".
    pub fn describe(&self) -> String {
        match (&self.custom_all_reduce_refused, self.interconnect) {
            (Some(r), _) => format!("custom all-reduce: no: {}", r.describe()),
            (None, Some(i)) => format!("custom all-reduce: yes, {}", i.describe()),
            (None, None) => "custom all-reduce: yes (one rank: nothing to exchange)".to_string(),
        }
    }
}

/// Where one rank runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlace {
    /// Host name.
    pub host: String,
    /// CUDA ordinal on that host.
    pub ordinal: u32,
}

/// The verdict for ranks on the GPUs `ordinals` (CUDA ordinals) of this topology's host.
pub fn assess(topo: &Topology, ordinals: &[u32]) -> Verdict {
    let places: Vec<RankPlace> = ordinals
        .iter()
        .map(|&ordinal| RankPlace {
            host: topo.hostname.clone(),
            ordinal,
        })
        .collect();
    assess_places(topo, &places)
}

/// The verdict for ranks that may live on several hosts; `topo` describes the host of the
/// ranks whose `host` equals its hostname.
pub fn assess_places(topo: &Topology, places: &[RankPlace]) -> Verdict {
    let ordinals: Vec<u32> = places.iter().map(|p| p.ordinal).collect();
    let mut hosts: Vec<String> = Vec::new();
    for p in places {
        if !hosts.contains(&p.host) {
            hosts.push(p.host.clone());
        }
    }
    let mut verdict = Verdict {
        ordinals: ordinals.clone(),
        single_host: hosts.len() <= 1 && hosts.iter().all(|h| *h == topo.hostname),
        interconnect: None,
        custom_all_reduce_refused: None,
        multicast_refused: None,
    };
    if !verdict.single_host {
        verdict.custom_all_reduce_refused = Some(Refusal::MultiHost { hosts });
        verdict.multicast_refused = Some("the ranks span several hosts".to_string());
        return verdict;
    }
    let mut gpus: Vec<&Gpu> = Vec::new();
    for (i, &o) in ordinals.iter().enumerate() {
        if ordinals[..i].contains(&o) {
            verdict.custom_all_reduce_refused = Some(Refusal::DuplicateGpu { ordinal: o });
            verdict.multicast_refused = Some(format!("GPU {o} is listed twice"));
            return verdict;
        }
        match topo.gpu_by_ordinal(o) {
            Some(g) => gpus.push(g),
            None => {
                verdict.custom_all_reduce_refused = Some(Refusal::UnknownGpu { ordinal: o });
                verdict.multicast_refused = Some(format!("GPU {o} is not visible"));
                return verdict;
            }
        }
    }
    if gpus.len() < 2 {
        verdict.multicast_refused = Some("one rank: nothing to exchange".to_string());
        return verdict;
    }
    verdict.interconnect = Some(interconnect(topo, &gpus));
    verdict.custom_all_reduce_refused = peer_refusal(topo, &gpus).or_else(|| {
        (verdict.interconnect == Some(Interconnect::Pcie) && gpus.len() > 2)
            .then_some(Refusal::PcieBeyondTwo { world: gpus.len() })
    });
    verdict.multicast_refused = multicast_refusal(&gpus, verdict.interconnect);
    verdict
}

/// The GPU sets worth a verdict: all of `ordinals`, then for every tensor-parallel size
/// 2, 4, … below it that divides it, the consecutive groups of that size ("TP2", …).
pub fn groups(ordinals: &[u32]) -> Vec<(String, Vec<u32>)> {
    let mut out = vec![("all GPUs".to_string(), ordinals.to_vec())];
    let n = ordinals.len();
    let mut tp = 2;
    while tp < n {
        if n % tp == 0 {
            out.extend(ordinals.chunks(tp).map(|g| (format!("TP{tp}"), g.to_vec())));
        }
        tp *= 2;
    }
    out
}

fn pairs<'a>(gpus: &'a [&'a Gpu]) -> impl Iterator<Item = (&'a Gpu, &'a Gpu)> + 'a {
    gpus.iter()
        .enumerate()
        .flat_map(move |(i, a)| gpus[i + 1..].iter().map(move |b| (*a, *b)))
}

fn interconnect(topo: &Topology, gpus: &[&Gpu]) -> Interconnect {
    let all_nvlink = pairs(gpus).all(|(a, b)| topo.nvlinks_between(a.nvml_index, b.nvml_index) > 0);
    if !all_nvlink {
        Interconnect::Pcie
    } else if gpus.iter().all(|g| g.switch_links() > 0) {
        Interconnect::NvSwitch
    } else {
        Interconnect::NvLink
    }
}

/// The first pair (in rank order) without peer reads and writes.
fn peer_refusal(topo: &Topology, gpus: &[&Gpu]) -> Option<Refusal> {
    pairs(gpus).find_map(|(a, b)| {
        let ordinal = |g: &Gpu| g.cuda_ordinal.unwrap_or(g.nvml_index);
        let (read, write, ancestor) = match topo.pair(a.nvml_index, b.nvml_index) {
            Some(p) => (p.p2p.read, p.p2p.write, p.common_ancestor),
            None => (P2pStatus::Unknown, P2pStatus::Unknown, Ancestor::System),
        };
        (!read.is_ok() || !write.is_ok()).then_some(Refusal::NoPeerAccess {
            a: ordinal(a),
            b: ordinal(b),
            read,
            write,
            ancestor,
        })
    })
}

fn multicast_refusal(gpus: &[&Gpu], interconnect: Option<Interconnect>) -> Option<String> {
    if let Some(old) = gpus.iter().find(|g| g.compute_capability.major < 9) {
        return Some(format!(
            "needs Hopper or newer; {} is sm_{}{}",
            old.name, old.compute_capability.major, old.compute_capability.minor
        ));
    }
    if interconnect != Some(Interconnect::NvSwitch) {
        return Some("needs every GPU behind NVSwitches".to_string());
    }
    None
}

/// The algorithm for one all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllReduceAlgo {
    /// Every rank reads every peer and reduces in rank order.
    OneShot,
    /// Reduce-scatter then all-gather over peer memory.
    TwoShot,
    /// NCCL.
    Nccl,
}

/// Message-size limits of the custom all-reduce for groups of up to `max_world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SizeLimits {
    /// The largest world size these limits apply to.
    pub max_world: usize,
    /// One-shot below this many bytes.
    pub one_shot_below: usize,
    /// Two-shot below this many bytes (from `one_shot_below` up); NCCL from here.
    pub two_shot_below: usize,
}

/// The rule that chooses between the custom kernels and NCCL by message size.
///
/// The defaults are the published rules of vLLM's custom all-reduce on NVLink (one-shot
/// for 2 ranks, below 512 KiB for up to 4 and 256 KiB for up to 8; custom kernels up to
/// 8 MiB). They are placeholders: the all-reduce work measures tpfuse's own kernels against
/// NCCL (whose 2.27+ symmetric kernels moved the bar) and fills in measured limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllReduceRule {
    /// Limits for NVLink / NVSwitch groups, by increasing `max_world`.
    pub nvlink: Vec<SizeLimits>,
    /// Limits for PCIe groups (two GPUs at most; see [`Refusal::PcieBeyondTwo`]).
    pub pcie: Vec<SizeLimits>,
}

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

impl Default for AllReduceRule {
    fn default() -> Self {
        let limits = |max_world, one_shot_below, two_shot_below| SizeLimits {
            max_world,
            one_shot_below,
            two_shot_below,
        };
        AllReduceRule {
            nvlink: vec![
                limits(2, 8 * MIB, 8 * MIB),
                limits(4, 512 * KIB, 8 * MIB),
                limits(8, 256 * KIB, 8 * MIB),
            ],
            pcie: vec![limits(2, 8 * MIB, 8 * MIB)],
        }
    }
}

impl AllReduceRule {
    /// The algorithm for an all-reduce of `bytes` bytes (per rank) on the group of
    /// `verdict`. NCCL whenever the custom all-reduce is refused, or the group or message
    /// is larger than any limit covers.
    pub fn choose(&self, verdict: &Verdict, bytes: usize) -> AllReduceAlgo {
        Self::choose_within(self.limits_for(verdict), bytes)
    }

    /// The algorithm for `bytes` under `limits` (`None`: the custom all-reduce may not run).
    pub fn choose_within(limits: Option<SizeLimits>, bytes: usize) -> AllReduceAlgo {
        match limits {
            Some(l) if bytes < l.one_shot_below => AllReduceAlgo::OneShot,
            Some(l) if bytes < l.two_shot_below => AllReduceAlgo::TwoShot,
            _ => AllReduceAlgo::Nccl,
        }
    }

    /// The limits that apply to `verdict`'s group, if the custom kernels may run at all.
    pub fn limits_for(&self, verdict: &Verdict) -> Option<SizeLimits> {
        let world = verdict.ordinals.len();
        match (verdict.custom_all_reduce(), verdict.interconnect) {
            (true, Some(Interconnect::NvSwitch | Interconnect::NvLink)) => {
                self.nvlink_limits(world)
            }
            (true, Some(Interconnect::Pcie)) => self.pcie_limits(world),
            _ => None,
        }
    }

    /// The NVLink limits for a group of `world` ranks (also what groups without a verdict,
    /// such as virtual ranks, use).
    pub fn nvlink_limits(&self, world: usize) -> Option<SizeLimits> {
        limits_in(&self.nvlink, world)
    }

    /// The PCIe limits for a group of `world` ranks.
    pub fn pcie_limits(&self, world: usize) -> Option<SizeLimits> {
        limits_in(&self.pcie, world)
    }
}

/// The first limits of `table` that cover `world` ranks.
fn limits_in(table: &[SizeLimits], world: usize) -> Option<SizeLimits> {
    table.iter().find(|l| world <= l.max_world).copied()
}

/// The fused kernels [`FusionRule`] decides for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FusedKernel {
    /// A row-parallel layer's GEMM + all-reduce ([`crate::ops::gemm_all_reduce()`]) or GEMM +
    /// reduce-scatter ([`crate::ops::gemm_reduce_scatter`]): per-tile flags.
    RowParallel,
    /// A column-parallel layer's all-gather + GEMM ([`crate::ops::all_gather_gemm()`]).
    AllGather,
}

/// When a layer under [`Fusion::Auto`](crate::ops::linear::Fusion::Auto) runs its GEMM and
/// its collective as one kernel. `m` is the call's rows, all ranks' for the sequence-parallel
/// forms. Fused up to the kernel's most rows, on groups whose custom all-reduce may run;
/// unfused beyond (FIELD-NOTES: Flux's GEMM + reduce-scatter got slower at m = 8192 on
/// 8×H100).
///
/// What one GPU measured (an H200, two virtual ranks sharing it, `docs/performance.md`,
/// "Measured on an H200"): the all-gather + GEMM ran at 0.87x the unfused all-gather then
/// GEMM (Llama-3-70B's QKV at TP 8, m = 16), so it fuses up to
/// [`all_gather_max_m`](Self::all_gather_max_m) = 64 (a placeholder bound past the measured
/// m). The row-parallel GEMM + all-reduce and GEMM + reduce-scatter ran at 1.6-2.6x the
/// unfused GEMM then collective at every measured m (1, 16, 64), so
/// [`row_parallel_max_m`](Self::row_parallel_max_m) is 0: `Auto` never fuses them until a
/// GPU measures them faster. [`Fusion::Fused`](crate::ops::linear::Fusion::Fused) still runs
/// them (the same bits as unfused either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FusionRule {
    /// The most rows (tokens) the fused all-gather + GEMM takes under `Auto`.
    pub all_gather_max_m: usize,
    /// The most rows the fused GEMM + all-reduce and GEMM + reduce-scatter take under `Auto`
    /// (0: never).
    pub row_parallel_max_m: usize,
}

impl Default for FusionRule {
    fn default() -> Self {
        FusionRule {
            all_gather_max_m: 64,
            row_parallel_max_m: 0,
        }
    }
}

impl FusionRule {
    /// The most rows `kernel` takes under `Auto` (0: never).
    pub fn max_m(&self, kernel: FusedKernel) -> usize {
        match kernel {
            FusedKernel::RowParallel => self.row_parallel_max_m,
            FusedKernel::AllGather => self.all_gather_max_m,
        }
    }

    /// Whether a call of `m` (> 0) rows runs `kernel` on a group with `verdict` (`None`:
    /// virtual ranks, or a topology NVML could not show, where the custom kernels run as on
    /// NVLink).
    pub fn fuse(&self, kernel: FusedKernel, verdict: Option<&Verdict>, m: usize) -> bool {
        m > 0 && m <= self.max_m(kernel) && verdict.map_or(true, Verdict::custom_all_reduce)
    }
}
