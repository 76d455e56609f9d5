//! The human report of a topology: GPUs, a connection matrix in the style of
//! `nvidia-smi topo -m`, peer access, NVLink, NUMA affinity, and the policy's verdicts.

use super::model::{LinkRemote, Topology};
use super::policy::{assess, groups, AllReduceRule, Verdict};
use std::fmt::Write as _;

/// Renders `topo` for people. Deterministic: the same topology gives the same text.
pub fn render(topo: &Topology) -> String {
    let mut out = String::new();
    header(&mut out, topo);
    if topo.gpus.is_empty() {
        out.push_str("\nNo GPUs.\n");
        return out;
    }
    gpus(&mut out, topo);
    matrix(&mut out, topo);
    peer_access(&mut out, topo);
    nvlink(&mut out, topo);
    numa(&mut out, topo);
    verdicts(&mut out, topo);
    out.lines().map(|l| format!("{}\n", l.trim_end())).collect()
}

fn header(out: &mut String, topo: &Topology) {
    let _ = writeln!(
        out,
        "Host {}, driver {} (source: {})",
        topo.hostname,
        topo.driver_version.as_deref().unwrap_or("unknown"),
        topo.source
    );
    if let Some(v) = &topo.cuda_visible_devices {
        let _ = writeln!(out, "CUDA_VISIBLE_DEVICES={v}");
    }
}

fn gpus(out: &mut String, topo: &Topology) {
    out.push_str("\nGPUs\n");
    let _ = writeln!(
        out,
        "  {:<5} {:<6} {:<26} {:<10} {:<4} {:>8}  {:<17} {:<5} CPUs",
        "nvml", "cuda", "name", "arch", "cc", "memory", "PCI bus id", "NUMA"
    );
    for g in &topo.gpus {
        let cuda = g
            .cuda_ordinal
            .map_or("hidden".to_string(), |o| o.to_string());
        let numa = g.numa_node.map_or("-".to_string(), |n| n.to_string());
        let cpus = if g.cpu_affinity.is_empty() {
            "-"
        } else {
            &g.cpu_affinity
        };
        let _ = writeln!(
            out,
            "  {:<5} {:<6} {:<26} {:<10} {:<4} {:>5} GiB  {:<17} {:<5} {}",
            g.nvml_index,
            cuda,
            g.name,
            g.architecture,
            format!(
                "{}.{}",
                g.compute_capability.major, g.compute_capability.minor
            ),
            (g.memory_bytes + (1 << 29)) >> 30,
            g.pci_bus_id,
            numa,
            cpus
        );
    }
}

fn matrix(out: &mut String, topo: &Topology) {
    out.push_str(
        "\nConnections (rows and columns by NVML index; NV# = NVLink links, \
         PIX/PXB/PHB/NODE/SYS = PCIe path)\n",
    );
    let _ = write!(out, "  {:<6}", "");
    for g in &topo.gpus {
        let _ = write!(out, " {:<5}", format!("GPU{}", g.nvml_index));
    }
    out.push('\n');
    for a in &topo.gpus {
        let _ = write!(out, "  {:<6}", format!("GPU{}", a.nvml_index));
        for b in &topo.gpus {
            let cell = if a.nvml_index == b.nvml_index {
                "X".to_string()
            } else {
                match topo.nvlinks_between(a.nvml_index, b.nvml_index) {
                    0 => topo
                        .pair(a.nvml_index, b.nvml_index)
                        .map_or("?", |p| p.common_ancestor.smi_code())
                        .to_string(),
                    n => format!("NV{n}"),
                }
            };
            let _ = write!(out, " {cell:<5}");
        }
        out.push('\n');
    }
}

fn peer_access(out: &mut String, topo: &Topology) {
    out.push_str("\nPeer access\n");
    let lacking: Vec<_> = topo
        .pairs
        .iter()
        .filter(|p| !(p.p2p.read.is_ok() && p.p2p.write.is_ok() && p.p2p.atomics.is_ok()))
        .collect();
    if topo.pairs.is_empty() {
        out.push_str("  one GPU: no pairs\n");
    } else if lacking.is_empty() {
        out.push_str("  every pair can read, write and use atomics on the other's memory\n");
    }
    for p in lacking {
        let _ = writeln!(
            out,
            "  GPU{} - GPU{}: read {}, write {}, atomics {}",
            p.a,
            p.b,
            p.p2p.read.describe(),
            p.p2p.write.describe(),
            p.p2p.atomics.describe()
        );
    }
}

fn nvlink(out: &mut String, topo: &Topology) {
    out.push_str("\nNVLink\n");
    if topo.gpus.iter().all(|g| g.nvlinks.is_empty()) {
        out.push_str("  no NVLink\n");
        return;
    }
    for g in &topo.gpus {
        let active = g.active_links().count();
        let versions: Vec<u32> = {
            let mut v: Vec<u32> = g.active_links().filter_map(|l| l.version).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let version = match versions.as_slice() {
            [] => String::new(),
            [v] => format!(", NVLink {v}"),
            many => format!(", NVLink {many:?}"),
        };
        let mut ends: Vec<String> = Vec::new();
        if g.switch_links() > 0 {
            ends.push(format!("{} to NVSwitch", g.switch_links()));
        }
        for peer in &topo.gpus {
            let n = g.links_to(&peer.pci_bus_id);
            if n > 0 {
                ends.push(format!("{n} to GPU{}", peer.nvml_index));
            }
        }
        let other = g
            .active_links()
            .filter(|l| l.remote == LinkRemote::Other)
            .count();
        if other > 0 {
            ends.push(format!("{other} to other devices"));
        }
        let ends = if ends.is_empty() {
            String::new()
        } else {
            format!(": {}", ends.join(", "))
        };
        let _ = writeln!(
            out,
            "  GPU{}  {active} of {} links active{version}{ends}",
            g.nvml_index,
            g.nvlinks.len()
        );
    }
}

fn numa(out: &mut String, topo: &Topology) {
    out.push_str("\nNUMA affinity\n");
    let mut nodes: Vec<Option<u32>> = topo.gpus.iter().map(|g| g.numa_node).collect();
    nodes.sort_unstable();
    nodes.dedup();
    for node in nodes {
        let members: Vec<_> = topo.gpus.iter().filter(|g| g.numa_node == node).collect();
        let names: Vec<String> = members
            .iter()
            .map(|g| format!("GPU{}", g.nvml_index))
            .collect();
        let mut cpus: Vec<&str> = members
            .iter()
            .map(|g| g.cpu_affinity.as_str())
            .filter(|c| !c.is_empty())
            .collect();
        cpus.dedup();
        let label = node.map_or("unknown node".to_string(), |n| format!("node {n}"));
        let cpus = if cpus.is_empty() {
            String::new()
        } else {
            format!(" (CPUs {})", cpus.join(" / "))
        };
        let _ = writeln!(out, "  {label}: {}{cpus}", names.join(" "));
    }
}

fn verdicts(out: &mut String, topo: &Topology) {
    out.push_str("\nVerdicts (GPU numbers are CUDA ordinals)\n");
    let ordinals = topo.cuda_ordinals();
    if ordinals.is_empty() {
        out.push_str("  no GPU is visible to CUDA\n");
        return;
    }
    let rule = AllReduceRule::default();
    for (label, group) in groups(&ordinals) {
        verdict_line(out, &label, &assess(topo, &group), &rule);
    }
}

fn verdict_line(out: &mut String, label: &str, v: &Verdict, rule: &AllReduceRule) {
    let gpus: Vec<String> = v.ordinals.iter().map(u32::to_string).collect();
    let _ = writeln!(out, "  {label} [{}]: {}", gpus.join(","), v.describe());
    if v.ordinals.len() > 1 {
        let multicast = match &v.multicast_refused {
            None => {
                "possible (NVLink SHARP; the driver's multicast support is checked at run time)"
                    .to_string()
            }
            Some(why) => format!("no ({why})"),
        };
        let _ = writeln!(out, "    multicast: {multicast}");
    }
    if let Some(l) = rule.limits_for(v) {
        let two_shot = if l.two_shot_below > l.one_shot_below {
            format!(", two-shot below {}", bytes(l.two_shot_below))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "    by message size: one-shot below {}{two_shot}, NCCL from there",
            bytes(l.one_shot_below),
        );
    } else if v.ordinals.len() > 1 {
        out.push_str("    every all-reduce goes to NCCL\n");
    }
}

fn bytes(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}
