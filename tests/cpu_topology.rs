//! The topology policy and report on recorded topologies (tests/fixtures/topology, written
//! from public specifications and published `nvidia-smi topo -m` layouts; see its README).
//!
//! The report snapshots live in tests/snapshots/topology; after an intended change of the
//! report, regenerate them with `TPFUSE_UPDATE_SNAPSHOTS=1 cargo test --test cpu_topology`
//! and review the diff.

use std::path::{Path, PathBuf};
use std::process::Command;
use tpfuse::topology::{
    assess, assess_places, render, AllReduceAlgo, AllReduceRule, Interconnect, P2pStatus,
    RankPlace, Refusal, Topology,
};

const FIXTURES: [&str; 6] = [
    "h100_sxm_8x_nvswitch",
    "a100_sxm_8x_nvswitch",
    "l40s_4x_pcie_2socket",
    "rtx4090_2x_no_p2p",
    "a100_pcie_2x_nvlink_bridge",
    "cuda_visible_devices_reordered",
];

fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/topology")
        .join(format!("{name}.json"))
}

fn fixture(name: &str) -> Topology {
    let text = std::fs::read_to_string(fixture_path(name)).expect("read fixture");
    Topology::from_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn all(t: &Topology) -> Vec<u32> {
    t.cuda_ordinals()
}

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

#[test]
fn every_fixture_is_consistent() {
    for name in FIXTURES {
        let t = fixture(name);
        let n = t.gpus.len();
        assert_eq!(t.pairs.len(), n * (n - 1) / 2, "{name}: one entry per pair");
        for (i, g) in t.gpus.iter().enumerate() {
            assert_eq!(g.nvml_index, i as u32, "{name}: NVML indices in order");
        }
        for p in &t.pairs {
            assert!(p.a < p.b && t.gpu(p.b).is_some(), "{name}: pair {p:?}");
        }
    }
}

#[test]
fn json_round_trips_without_loss() {
    for name in FIXTURES {
        let t = fixture(name);
        let again = Topology::from_json(&t.to_json()).unwrap();
        assert_eq!(again, t, "{name}");
    }
}

#[test]
fn hgx_h100_allows_everything_on_nvswitch() {
    let t = fixture("h100_sxm_8x_nvswitch");
    let v = assess(&t, &all(&t));
    assert!(v.custom_all_reduce(), "{}", v.describe());
    assert!(v.single_host);
    assert_eq!(v.interconnect, Some(Interconnect::NvSwitch));
    assert_eq!(v.multicast_refused, None);
    assert_eq!(
        v.describe(),
        "custom all-reduce: yes, NVLink through NVSwitch"
    );
    for (a, b) in [(0, 7), (3, 4), (1, 2)] {
        assert_eq!(
            t.nvlinks_between(a, b),
            18,
            "NV18 between GPU{a} and GPU{b}"
        );
    }
    let rule = AllReduceRule::default();
    assert_eq!(rule.choose(&v, 8 * KIB), AllReduceAlgo::OneShot);
    assert_eq!(rule.choose(&v, 256 * KIB - 1), AllReduceAlgo::OneShot);
    assert_eq!(rule.choose(&v, 256 * KIB), AllReduceAlgo::TwoShot);
    assert_eq!(rule.choose(&v, 8 * MIB - 1), AllReduceAlgo::TwoShot);
    assert_eq!(rule.choose(&v, 8 * MIB), AllReduceAlgo::Nccl);
    // TP4 and TP2 sub-groups are on NVSwitch too; world 2 is one-shot up to the limit.
    let tp2 = assess(&t, &[4, 5]);
    assert_eq!(tp2.interconnect, Some(Interconnect::NvSwitch));
    assert_eq!(rule.choose(&tp2, 4 * MIB), AllReduceAlgo::OneShot);
}

#[test]
fn hgx_a100_allows_the_custom_all_reduce_but_not_multicast() {
    let t = fixture("a100_sxm_8x_nvswitch");
    let v = assess(&t, &all(&t));
    assert!(v.custom_all_reduce(), "{}", v.describe());
    assert_eq!(v.interconnect, Some(Interconnect::NvSwitch));
    let why = v.multicast_refused.as_deref().unwrap_or_default();
    assert!(why.contains("Hopper or newer"), "{why}");
    assert_eq!(t.nvlinks_between(0, 5), 12);
}

#[test]
fn pcie_l40s_across_sockets_goes_to_nccl() {
    let t = fixture("l40s_4x_pcie_2socket");
    let v = assess(&t, &all(&t));
    assert_eq!(v.interconnect, Some(Interconnect::Pcie));
    assert!(!v.custom_all_reduce());
    assert_eq!(
        AllReduceRule::default().choose(&v, 8 * KIB),
        AllReduceAlgo::Nccl
    );
    match v.custom_all_reduce_refused.as_ref().unwrap() {
        Refusal::NoPeerAccess { a, b, .. } => {
            // The first pair without peer access crosses the sockets.
            let ga = t.gpu_by_ordinal(*a).unwrap();
            let gb = t.gpu_by_ordinal(*b).unwrap();
            assert_ne!(ga.numa_node, gb.numa_node, "{}", v.describe());
        }
        Refusal::PcieBeyondTwo { world } => assert_eq!(*world, 4),
        other => panic!("unexpected refusal {other:?}"),
    }
    assert!(t.gpus.iter().all(|g| g.nvlinks.is_empty()));
    assert_eq!(t.nvlinks_between(0, 1), 0);
}

#[test]
fn rtx_4090_pair_has_no_peer_access() {
    let t = fixture("rtx4090_2x_no_p2p");
    let v = assess(&t, &[0, 1]);
    assert_eq!(v.interconnect, Some(Interconnect::Pcie));
    match v.custom_all_reduce_refused.as_ref().unwrap() {
        Refusal::NoPeerAccess { a, b, read, .. } => {
            assert_eq!((*a, *b), (0, 1));
            assert_eq!(*read, P2pStatus::GpuNotSupported);
        }
        other => panic!("unexpected refusal {other:?}"),
    }
    let text = v.describe();
    assert!(
        text.starts_with("custom all-reduce: no: GPU 0 and GPU 1 have no peer access"),
        "{text}"
    );
    assert!(text.contains("not supported by the GPU"), "{text}");
    assert!(text.contains("they meet"), "{text}");
}

#[test]
fn a100_pcie_pair_on_an_nvlink_bridge_is_a_direct_mesh() {
    let t = fixture("a100_pcie_2x_nvlink_bridge");
    let v = assess(&t, &[0, 1]);
    assert!(v.custom_all_reduce(), "{}", v.describe());
    assert_eq!(v.interconnect, Some(Interconnect::NvLink));
    assert_eq!(v.describe(), "custom all-reduce: yes, NVLink full mesh");
    assert_eq!(t.nvlinks_between(0, 1), 12);
    assert!(v.multicast_refused.is_some());
}

#[test]
fn cuda_visible_devices_maps_ranks_to_the_right_gpus() {
    let t = fixture("cuda_visible_devices_reordered");
    assert_eq!(t.cuda_visible_devices.as_deref(), Some("2,0"));
    assert_eq!(all(&t), vec![0, 1]);
    assert_eq!(t.gpu_by_ordinal(0).unwrap().nvml_index, 2);
    assert_eq!(t.gpu_by_ordinal(1).unwrap().nvml_index, 0);
    let v = assess(&t, &[0, 1]);
    assert!(v.custom_all_reduce(), "{}", v.describe());
    // CUDA ordinal 2 does not exist in this process.
    let v = assess(&t, &[0, 2]);
    assert_eq!(
        v.custom_all_reduce_refused,
        Some(Refusal::UnknownGpu { ordinal: 2 })
    );
    assert!(
        v.describe().contains("GPU 2 is not visible"),
        "{}",
        v.describe()
    );
}

#[test]
fn ranks_on_several_hosts_or_twice_on_one_gpu_are_refused() {
    let t = fixture("h100_sxm_8x_nvswitch");
    let places = [
        RankPlace {
            host: t.hostname.clone(),
            ordinal: 0,
        },
        RankPlace {
            host: "node-b".into(),
            ordinal: 0,
        },
    ];
    let v = assess_places(&t, &places);
    assert!(!v.single_host);
    assert!(matches!(
        v.custom_all_reduce_refused,
        Some(Refusal::MultiHost { .. })
    ));
    assert_eq!(
        AllReduceRule::default().choose(&v, KIB),
        AllReduceAlgo::Nccl
    );
    let v = assess(&t, &[3, 3]);
    assert_eq!(
        v.custom_all_reduce_refused,
        Some(Refusal::DuplicateGpu { ordinal: 3 })
    );
    let one = assess(&t, &[5]);
    assert!(one.custom_all_reduce());
    assert_eq!(one.interconnect, None);
}

#[test]
fn reports_match_their_snapshots() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/topology");
    let update = std::env::var_os("TPFUSE_UPDATE_SNAPSHOTS").is_some();
    let mut stale = Vec::new();
    for name in FIXTURES {
        let text = render(&fixture(name));
        let path = dir.join(format!("{name}.txt"));
        if update {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run with TPFUSE_UPDATE_SNAPSHOTS=1)",
                path.display()
            )
        });
        if want != text {
            stale.push(format!("--- {name}: want\n{want}\n--- got\n{text}"));
        }
    }
    assert!(stale.is_empty(), "reports changed:\n{}", stale.join("\n"));
}

#[test]
fn the_h100_report_reads_like_nvidia_smi_and_says_yes() {
    let text = render(&fixture("h100_sxm_8x_nvswitch"));
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("GPU0 ") && l.contains(" X "))
        .unwrap_or_else(|| panic!("no matrix row for GPU0:\n{text}"));
    assert_eq!(row.matches("NV18").count(), 7, "{row}");
    assert!(
        text.contains("18 of 18 links active, NVLink 4: 18 to NVSwitch"),
        "{text}"
    );
    assert!(
        text.contains(
            "all GPUs [0,1,2,3,4,5,6,7]: custom all-reduce: yes, NVLink through NVSwitch"
        ),
        "{text}"
    );
}

fn tpfuse(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tpfuse"))
        .args(args)
        .output()
        .expect("run tpfuse");
    assert!(out.status.success(), "tpfuse {args:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn doctor_examines_a_recorded_topology_and_its_own_json() {
    let path = fixture_path("rtx4090_2x_no_p2p");
    let text = tpfuse(&["doctor", "--topology", path.to_str().unwrap()]);
    assert!(text.contains("recorded topology from"), "{text}");
    assert!(
        text.contains("GPU 0 and GPU 1 have no peer access"),
        "{text}"
    );

    // doctor --json with a recorded topology, read back by doctor --topology.
    let json = tpfuse(&["doctor", "--json", "--topology", path.to_str().unwrap()]);
    let value: serde_json::Value = serde_json::from_str(&json).expect("doctor --json is JSON");
    let recorded: Topology = serde_json::from_value(value["topology"].clone()).unwrap();
    assert_eq!(recorded, fixture("rtx4090_2x_no_p2p"));
    assert_eq!(
        value["verdicts"][0]["verdict"]["custom_all_reduce_refused"]["kind"],
        "no_peer_access"
    );
    let saved = std::env::temp_dir().join(format!("tpfuse-doctor-{}.json", std::process::id()));
    std::fs::write(&saved, json).unwrap();
    let again = tpfuse(&["doctor", "--topology", saved.to_str().unwrap()]);
    std::fs::remove_file(&saved).ok();
    let report = |t: &str| t[t.find("Topology").unwrap()..].to_string();
    assert_eq!(
        report(&again).replace(saved.to_str().unwrap(), "X"),
        report(&text).replace(path.to_str().unwrap(), "X")
    );
}
