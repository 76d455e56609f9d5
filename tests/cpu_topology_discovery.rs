//! NVML discovery without a GPU: the pure helpers it is built from (CUDA ordinals from
//! `CUDA_VISIBLE_DEVICES` or from bus ids, CPU lists from affinity masks, architecture
//! names), and what `discover()` says on a machine with no NVIDIA driver.

use tpfuse::topology::{
    architecture_name, cpu_list_from_mask, cuda_ordinals_from_bus_ids, cuda_ordinals_from_env,
    discover, ComputeCapability, Discovery,
};

/// Four GPUs, listed in NVML order, which is PCI bus order.
const FOUR: [(u32, &str, &str); 4] = [
    (
        0,
        "GPU-0a1b2c3d-0000-0000-0000-000000000000",
        "00000000:18:00.0",
    ),
    (
        1,
        "GPU-0a1b9999-1111-1111-1111-111111111111",
        "00000000:2A:00.0",
    ),
    (
        2,
        "GPU-7f000000-2222-2222-2222-222222222222",
        "00000000:3a:00.0",
    ),
    (
        3,
        "GPU-c0ffee00-3333-3333-3333-333333333333",
        "00000000:5d:00.0",
    ),
];

fn env(visible: Option<&str>) -> Vec<Option<u32>> {
    cuda_ordinals_from_env(visible, None, &FOUR)
}

#[test]
fn unset_shows_every_gpu_in_order() {
    assert_eq!(env(None), [Some(0), Some(1), Some(2), Some(3)]);
    assert_eq!(
        cuda_ordinals_from_env(None, Some("PCI_BUS_ID"), &FOUR),
        [Some(0), Some(1), Some(2), Some(3)]
    );
}

#[test]
fn a_list_of_indices_reorders_and_hides() {
    assert_eq!(env(Some("2,0")), [Some(1), None, Some(0), None]);
    assert_eq!(env(Some("3")), [None, None, None, Some(0)]);
    assert_eq!(env(Some("0,1,2,3")), [Some(0), Some(1), Some(2), Some(3)]);
    assert_eq!(env(Some("3,2,1,0")), [Some(3), Some(2), Some(1), Some(0)]);
    assert_eq!(
        cuda_ordinals_from_env(Some("1,0"), Some("PCI_BUS_ID"), &FOUR),
        [Some(1), Some(0), None, None]
    );
}

#[test]
fn the_empty_string_hides_every_gpu() {
    assert_eq!(env(Some("")), [None; 4]);
    assert_eq!(env(Some("  ")), [None; 4]);
    assert_eq!(env(Some("-1")), [None; 4]);
    assert_eq!(env(Some("NoDevFiles")), [None; 4]);
}

#[test]
fn whitespace_around_entries_is_ignored() {
    assert_eq!(env(Some(" 2 , 0 ")), [Some(1), None, Some(0), None]);
    assert_eq!(env(Some("\t1,\t3")), [None, Some(0), None, Some(1)]);
}

#[test]
fn uuid_prefixes_name_gpus() {
    // Full UUID, and the shortest unique prefixes.
    assert_eq!(
        env(Some("GPU-c0ffee00-3333-3333-3333-333333333333")),
        [None, None, None, Some(0)]
    );
    assert_eq!(
        env(Some("GPU-7f,GPU-0a1b2")),
        [Some(1), None, Some(0), None]
    );
    // Case-insensitive, and mixed with indices.
    assert_eq!(env(Some("gpu-C0FFEE,1")), [None, Some(1), None, Some(0)]);
}

#[test]
fn an_invalid_entry_drops_itself_and_every_later_one() {
    // Out of range.
    assert_eq!(env(Some("1,4,2")), [None, Some(0), None, None]);
    // Not a number.
    assert_eq!(env(Some("0,x,2")), [Some(0), None, None, None]);
    assert_eq!(env(Some("0,1a,2")), [Some(0), None, None, None]);
    // Negative.
    assert_eq!(env(Some("3,-1,0")), [None, None, None, Some(0)]);
    // Empty entry.
    assert_eq!(env(Some("0,,2")), [Some(0), None, None, None]);
    // Ambiguous UUID prefix (two GPUs start with 0a1b), unknown UUID, bare "GPU-".
    assert_eq!(env(Some("2,GPU-0a1b,0")), [None, None, Some(0), None]);
    assert_eq!(env(Some("2,GPU-ffff,0")), [None, None, Some(0), None]);
    assert_eq!(env(Some("2,GPU-,0")), [None, None, Some(0), None]);
    // MIG instances are not resolved.
    assert_eq!(
        env(Some("1,MIG-0a1b2c3d-0000-0000-0000-000000000000,0")),
        [None, Some(0), None, None]
    );
    // Invalid first entry: nothing visible.
    assert_eq!(env(Some("9,0,1")), [None; 4]);
}

#[test]
fn a_duplicate_drops_itself_and_every_later_one() {
    assert_eq!(env(Some("1,1,2")), [None, Some(0), None, None]);
    assert_eq!(
        env(Some("3,0,GPU-c0ffee,1")),
        [Some(1), None, None, Some(0)]
    );
}

#[test]
fn indices_follow_pci_order_not_the_order_given() {
    // The same GPUs handed over out of order, with mixed bus id spellings: index 0 is still
    // the lowest bus, and each result lines up with its input.
    let shuffled = [FOUR[2], FOUR[0], FOUR[3], FOUR[1]];
    let mixed: Vec<(u32, &str, &str)> = shuffled
        .iter()
        .map(|&(i, uuid, bus)| (i, uuid, if i == 0 { "0000:18:00.0" } else { bus }))
        .collect();
    assert_eq!(
        cuda_ordinals_from_env(None, None, &mixed),
        [Some(2), Some(0), Some(3), Some(1)]
    );
    assert_eq!(
        cuda_ordinals_from_env(Some("0,2"), None, &mixed),
        [Some(1), Some(0), None, None]
    );
}

#[test]
fn no_gpus_no_ordinals() {
    assert!(cuda_ordinals_from_env(None, None, &[]).is_empty());
    assert!(cuda_ordinals_from_env(Some("0"), None, &[]).is_empty());
}

#[test]
fn bus_ids_match_cuda_ordinals_to_gpus() {
    let gpus = [
        "00000000:18:00.0",
        "00000000:2A:00.0",
        "00000000:3a:00.0",
        "",
    ];
    // CUDA writes 4 domain digits, upper case; it shows two GPUs, in its own order.
    let cuda = ["0000:3A:00.0", "0000:18:00.0"];
    assert_eq!(
        cuda_ordinals_from_bus_ids(&cuda, &gpus),
        [Some(1), None, Some(0), None]
    );
    assert_eq!(cuda_ordinals_from_bus_ids(&[], &gpus), [None; 4]);
    // An empty bus id never matches.
    assert_eq!(cuda_ordinals_from_bus_ids(&[""], &[""]), [None]);
}

#[test]
fn cpu_masks_become_cpu_lists() {
    assert_eq!(cpu_list_from_mask(&[0xff, 0], 64), "0-7");
    assert_eq!(cpu_list_from_mask(&[0b1011], 64), "0-1,3");
    assert_eq!(cpu_list_from_mask(&[1 << 63, 1], 64), "63-64");
    assert_eq!(cpu_list_from_mask(&[0, 0b100], 64), "66");
    // Two sockets of 56 cores with hyperthreads: 0-55 and 112-167.
    let mut words = [0u64; 4];
    for cpu in (0..56).chain(112..168) {
        words[cpu / 64] |= 1 << (cpu % 64);
    }
    assert_eq!(cpu_list_from_mask(&words, 64), "0-55,112-167");
    // 32-bit words: bits above 32 are not CPUs.
    assert_eq!(cpu_list_from_mask(&[0xffff_ffff, 1], 32), "0-32");
    assert_eq!(cpu_list_from_mask(&[1 << 40, 0], 32), "");
    // Nothing set.
    assert_eq!(cpu_list_from_mask(&[], 64), "");
    assert_eq!(cpu_list_from_mask(&[0; 16], 64), "");
    assert_eq!(cpu_list_from_mask(&[u64::MAX; 2], 64), "0-127");
}

#[test]
fn architectures_have_names() {
    let none = ComputeCapability { major: 0, minor: 0 };
    let cc = |major, minor| ComputeCapability { major, minor };
    assert_eq!(architecture_name(7, cc(8, 0)), "Ampere");
    assert_eq!(architecture_name(8, cc(8, 9)), "Ada");
    assert_eq!(architecture_name(9, cc(9, 0)), "Hopper");
    assert_eq!(architecture_name(10, cc(10, 0)), "Blackwell");
    assert_eq!(architecture_name(5, none), "Volta");
    // NVML does not know: the compute capability decides.
    let unknown = 0xffff_ffff;
    assert_eq!(architecture_name(unknown, cc(9, 0)), "Hopper");
    assert_eq!(architecture_name(unknown, cc(8, 6)), "Ampere");
    assert_eq!(architecture_name(unknown, cc(8, 9)), "Ada");
    assert_eq!(architecture_name(unknown, cc(7, 5)), "Turing");
    assert_eq!(architecture_name(unknown, cc(7, 0)), "Volta");
    assert_eq!(architecture_name(unknown, cc(12, 0)), "Blackwell");
    assert_eq!(architecture_name(unknown, none), "Unknown");
    // A code newer than the table, with nothing else to go on, keeps the code.
    assert_eq!(
        architecture_name(42, none),
        "Unknown (NVML architecture 42)"
    );
    assert_eq!(architecture_name(42, cc(10, 3)), "Blackwell");
}

#[test]
#[cfg_attr(
    any(feature = "gpu-tests", feature = "emulator"),
    ignore = "asserts the behaviour without a driver (the emulator is one)"
)]
fn without_a_driver_discovery_says_so() {
    match discover() {
        Discovery::NoDriver => {}
        other => panic!("expected NoDriver on a machine without a driver, got {other:?}"),
    }
}
