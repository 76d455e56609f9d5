//! What connects a machine's GPUs, as plain data.
//!
//! Filled from NVML on a live machine ([`super::discover`]) or read back from JSON (what
//! `tpfuse doctor --json` writes), so that a topology recorded on one machine can be examined
//! on another. GPUs are identified by their NVML index (PCI bus order); `cuda_ordinal` is the
//! index a CUDA program of this process uses (after `CUDA_VISIBLE_DEVICES`), `None` for a GPU
//! that is hidden from CUDA.

use serde::{Deserialize, Serialize};

/// A machine's GPUs and how they are connected.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Host name of the machine.
    pub hostname: String,
    /// Where the data came from: "nvml" or a description of the recording.
    pub source: String,
    /// NVIDIA driver version, e.g. "580.95.05".
    #[serde(default)]
    pub driver_version: Option<String>,
    /// `CUDA_VISIBLE_DEVICES` as it was when the topology was taken.
    #[serde(default)]
    pub cuda_visible_devices: Option<String>,
    /// Every GPU NVML sees, in NVML index order.
    pub gpus: Vec<Gpu>,
    /// One entry per unordered pair of GPUs (`a < b`, NVML indices).
    pub pairs: Vec<GpuPair>,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML index (PCI bus order).
    pub nvml_index: u32,
    /// CUDA device ordinal in this process, `None` when `CUDA_VISIBLE_DEVICES` hides it.
    pub cuda_ordinal: Option<u32>,
    /// Product name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// "GPU-…" UUID.
    pub uuid: String,
    /// PCI bus id in NVML's form, "00000000:18:00.0".
    pub pci_bus_id: String,
    /// Architecture name, e.g. "Hopper".
    pub architecture: String,
    /// CUDA compute capability.
    pub compute_capability: ComputeCapability,
    /// Total device memory in bytes.
    pub memory_bytes: u64,
    /// NUMA node of the GPU's PCIe root, when the platform reports one.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// CPUs close to the GPU, as a Linux cpu list ("0-55,112-167"); empty when unknown.
    #[serde(default)]
    pub cpu_affinity: String,
    /// The GPU's NVLink links (empty without NVLink).
    #[serde(default)]
    pub nvlinks: Vec<NvLink>,
}

/// A CUDA compute capability, e.g. 9.0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ComputeCapability {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// One NVLink link of a GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NvLink {
    /// Link number on the GPU.
    pub link: u32,
    /// Whether the link is up.
    pub active: bool,
    /// NVLink version (3 on A100, 4 on H100, 5 on B200), when known.
    #[serde(default)]
    pub version: Option<u32>,
    /// PCI bus id of the far end, when known.
    #[serde(default)]
    pub remote_pci_bus_id: Option<String>,
    /// What the far end is.
    pub remote: LinkRemote,
}

/// The far end of an NVLink link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkRemote {
    /// Another GPU (direct link or bridge).
    Gpu,
    /// An NVSwitch.
    NvSwitch,
    /// Something else (a CPU on Grace systems, say) or unknown.
    Other,
}

/// How two GPUs reach each other.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuPair {
    /// NVML index of the first GPU (`a < b`).
    pub a: u32,
    /// NVML index of the second GPU.
    pub b: u32,
    /// Peer-to-peer capabilities as NVML reports them.
    pub p2p: P2p,
    /// Where their PCIe paths meet.
    pub common_ancestor: Ancestor,
}

/// NVML's peer-to-peer status per capability.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct P2p {
    /// Peer reads.
    pub read: P2pStatus,
    /// Peer writes.
    pub write: P2pStatus,
    /// Peer atomics.
    pub atomics: P2pStatus,
    /// Peer access over NVLink.
    pub nvlink: P2pStatus,
}

/// One peer-to-peer capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum P2pStatus {
    /// Supported.
    Ok,
    /// The chipset does not support it.
    ChipsetNotSupported,
    /// The GPU does not support it (GeForce cards, typically).
    GpuNotSupported,
    /// The IOH topology does not support it.
    IohTopologyNotSupported,
    /// Disabled by a driver registry key.
    DisabledByRegkey,
    /// Not supported, for another reason.
    NotSupported,
    /// NVML could not tell.
    Unknown,
}

impl P2pStatus {
    /// Whether the capability is there.
    pub fn is_ok(self) -> bool {
        self == P2pStatus::Ok
    }

    /// Words for a report.
    pub fn describe(self) -> &'static str {
        match self {
            P2pStatus::Ok => "supported",
            P2pStatus::ChipsetNotSupported => "not supported by the chipset",
            P2pStatus::GpuNotSupported => "not supported by the GPU",
            P2pStatus::IohTopologyNotSupported => "not supported by the PCIe topology",
            P2pStatus::DisabledByRegkey => "disabled by a driver registry key",
            P2pStatus::NotSupported => "not supported",
            P2pStatus::Unknown => "unknown",
        }
    }
}

/// Where the PCIe paths of two GPUs meet, nearest first (NVML's topology levels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ancestor {
    /// The same board (a multi-GPU card).
    Board,
    /// One PCIe switch.
    PcieSwitch,
    /// Several PCIe switches, without crossing the host bridge.
    PcieSwitches,
    /// The same PCIe host bridge.
    HostBridge,
    /// The same NUMA node (across host bridges).
    NumaNode,
    /// Across NUMA nodes / CPU sockets (SMP interconnect).
    System,
}

impl Ancestor {
    /// The `nvidia-smi topo -m` code: PIX, PXB, PHB, NODE or SYS.
    pub fn smi_code(self) -> &'static str {
        match self {
            Ancestor::Board | Ancestor::PcieSwitch => "PIX",
            Ancestor::PcieSwitches => "PXB",
            Ancestor::HostBridge => "PHB",
            Ancestor::NumaNode => "NODE",
            Ancestor::System => "SYS",
        }
    }

    /// Words for a report ("they meet at …").
    pub fn describe(self) -> &'static str {
        match self {
            Ancestor::Board => "on the same board",
            Ancestor::PcieSwitch => "at one PCIe switch",
            Ancestor::PcieSwitches => "across several PCIe switches",
            Ancestor::HostBridge => "at the host bridge",
            Ancestor::NumaNode => "at the NUMA node, across host bridges",
            Ancestor::System => "only across CPU sockets",
        }
    }
}

impl Topology {
    /// The GPU with NVML index `index`.
    pub fn gpu(&self, index: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.nvml_index == index)
    }

    /// The GPU CUDA calls `ordinal` in the recorded process.
    pub fn gpu_by_ordinal(&self, ordinal: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.cuda_ordinal == Some(ordinal))
    }

    /// The pair entry of two GPUs (NVML indices, either order).
    pub fn pair(&self, x: u32, y: u32) -> Option<&GpuPair> {
        let (a, b) = if x < y { (x, y) } else { (y, x) };
        self.pairs.iter().find(|p| p.a == a && p.b == b)
    }

    /// The CUDA ordinals of this topology, in order.
    pub fn cuda_ordinals(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.gpus.iter().filter_map(|g| g.cuda_ordinal).collect();
        v.sort_unstable();
        v
    }

    /// Writes the topology as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Reads a topology back from JSON.
    pub fn from_json(text: &str) -> crate::Result<Topology> {
        serde_json::from_str(text)
            .map_err(|e| crate::Error::invalid("topology JSON", e.to_string()))
    }
}

impl Gpu {
    /// Active NVLink links to other GPUs (direct or bridged), by the far end's bus id.
    pub fn active_links(&self) -> impl Iterator<Item = &NvLink> {
        self.nvlinks.iter().filter(|l| l.active)
    }

    /// Number of active links to NVSwitches.
    pub fn switch_links(&self) -> usize {
        self.active_links()
            .filter(|l| l.remote == LinkRemote::NvSwitch)
            .count()
    }

    /// Number of active direct links to the GPU with PCI bus id `bus`.
    pub fn links_to(&self, bus: &str) -> usize {
        self.active_links()
            .filter(|l| {
                l.remote == LinkRemote::Gpu
                    && l.remote_pci_bus_id
                        .as_deref()
                        .is_some_and(|r| same_bus_id(r, bus))
            })
            .count()
    }
}

/// Compares PCI bus ids written with 4 or 8 domain digits, in any case.
pub fn same_bus_id(x: &str, y: &str) -> bool {
    normalize_bus_id(x) == normalize_bus_id(y)
}

/// "0000:18:00.0" and "00000000:18:00.0" -> "00000000:18:00.0", lower case.
pub fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if rest.contains(':') => {
            let domain = domain.trim_start_matches('0');
            format!("{domain:0>8}:{rest}")
        }
        _ => id,
    }
}

impl Topology {
    /// Active NVLink links joining two GPUs (NVML indices): direct links, or, when both hang
    /// off NVSwitches, the smaller of their switch link counts (as `nvidia-smi topo -m`
    /// counts them). 0 when they share no NVLink.
    pub fn nvlinks_between(&self, x: u32, y: u32) -> usize {
        let (Some(a), Some(b)) = (self.gpu(x), self.gpu(y)) else {
            return 0;
        };
        let direct = a.links_to(&b.pci_bus_id);
        if direct > 0 {
            return direct;
        }
        a.switch_links().min(b.switch_links())
    }
}
