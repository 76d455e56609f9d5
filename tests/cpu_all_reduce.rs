//! The all-reduce's checks and algorithm choice, without a GPU: `plan` on buffer
//! descriptions and group facts, and the CPU references of the fused epilogue.

use half::bf16;
use std::sync::LazyLock;
use tpfuse::ops::all_reduce::{plan, Algorithm, Desc, GroupFacts, Plan};
use tpfuse::reference::{all_reduce_epilogue_exact, all_reduce_fused_f64, relative_error};
use tpfuse::topology::{assess, AllReduceAlgo, AllReduceRule, Topology};
use tpfuse::validate::BufferInfo;
use tpfuse::Error;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

static RULE: LazyLock<AllReduceRule> = LazyLock::new(AllReduceRule::default);

fn virtual_group(world: usize) -> GroupFacts<'static> {
    GroupFacts {
        device: 0,
        world,
        capacity: 8 * MIB,
        virtual_ranks: true,
        has_comm: false,
        verdict: None,
        rule: &RULE,
    }
}

/// Buffers at distinct, aligned addresses: partial, out, then the epilogue's.
fn flat(len: usize) -> Desc {
    Desc {
        input: BufferInfo::new(0x1000_0000, len, 0),
        out: BufferInfo::new(0x2000_0000, len, 0),
        bias: None,
        residual: None,
        gamma: None,
        eps: 1e-6,
    }
}

fn fused(rows: usize, hidden: usize) -> Desc {
    let mut d = flat(rows * hidden);
    d.residual = Some(BufferInfo::new(0x3000_0000, rows * hidden, 0));
    d.gamma = Some(BufferInfo::new(0x4000_0000, hidden, 0));
    d.bias = Some(BufferInfo::new(0x5000_0000, hidden, 0));
    d
}

fn refused(e: Error) -> (String, String) {
    match e {
        Error::InvalidArgument { arg, reason } => (arg, reason),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

fn algo(desc: &Desc, facts: &GroupFacts, a: Algorithm) -> AllReduceAlgo {
    plan::<bf16>(desc, facts, a).unwrap().algo
}

#[test]
fn virtual_ranks_pick_one_shot_then_two_shot_by_size() {
    let g4 = virtual_group(4);
    assert_eq!(algo(&flat(8), &g4, Algorithm::Auto), AllReduceAlgo::OneShot);
    // 512 KiB of bf16 is the one-shot limit for world <= 4.
    assert_eq!(
        algo(&flat(256 * KIB - 1), &g4, Algorithm::Auto),
        AllReduceAlgo::OneShot
    );
    assert_eq!(
        algo(&flat(256 * KIB), &g4, Algorithm::Auto),
        AllReduceAlgo::TwoShot
    );
    let g8 = virtual_group(8);
    assert_eq!(
        algo(&flat(128 * KIB), &g8, Algorithm::Auto),
        AllReduceAlgo::TwoShot
    );
    // Overrides.
    assert_eq!(
        algo(&flat(8), &g8, Algorithm::TwoShot),
        AllReduceAlgo::TwoShot
    );
    assert_eq!(
        algo(&flat(4 * MIB), &g8, Algorithm::OneShot),
        AllReduceAlgo::OneShot
    );
}

#[test]
fn virtual_ranks_refuse_nccl_and_messages_above_capacity() {
    let g = virtual_group(2);
    let (arg, reason) = refused(plan::<bf16>(&flat(8), &g, Algorithm::Nccl).unwrap_err());
    assert_eq!(arg, "algorithm");
    assert!(reason.contains("no communicator"), "{reason}");
    let big = flat(4 * MIB + 8); // 8 MiB + 16 bytes of bf16
    for a in [Algorithm::Auto, Algorithm::OneShot, Algorithm::TwoShot] {
        let (arg, reason) = refused(plan::<bf16>(&big, &g, a).unwrap_err());
        assert_eq!(arg, "partial");
        assert!(reason.contains("capacity"), "{reason}");
    }
}

#[test]
fn real_groups_follow_the_topology_verdict() {
    let fixture = |name: &str| {
        let path = format!(
            "{}/tests/fixtures/topology/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        Topology::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let h100 = fixture("h100_sxm_8x_nvswitch");
    let h100_verdict = assess(&h100, &[0, 1, 2, 3, 4, 5, 6, 7]);
    let mut g = GroupFacts {
        device: 0,
        world: 8,
        capacity: 8 * MIB,
        virtual_ranks: false,
        has_comm: true,
        verdict: Some(&h100_verdict),
        rule: &RULE,
    };
    assert_eq!(
        algo(&flat(4 * KIB), &g, Algorithm::Auto),
        AllReduceAlgo::OneShot
    );
    assert_eq!(
        algo(&flat(MIB), &g, Algorithm::Auto),
        AllReduceAlgo::TwoShot
    );
    // Beyond the rule's two-shot limit (and the capacity): NCCL.
    assert_eq!(
        algo(&flat(16 * MIB), &g, Algorithm::Auto),
        AllReduceAlgo::Nccl
    );
    assert_eq!(algo(&flat(8), &g, Algorithm::Nccl), AllReduceAlgo::Nccl);

    // A pair without peer access: always NCCL.
    let rtx = fixture("rtx4090_2x_no_p2p");
    let rtx_verdict = assess(&rtx, &[0, 1]);
    g.world = 2;
    g.verdict = Some(&rtx_verdict);
    assert_eq!(algo(&flat(8), &g, Algorithm::Auto), AllReduceAlgo::Nccl);
    // Without a communicator the custom kernels are the only way (the caller's choice).
    g.has_comm = false;
    assert_eq!(algo(&flat(8), &g, Algorithm::Auto), AllReduceAlgo::TwoShot);
}

#[test]
fn fused_calls_are_planned_as_rows_of_hidden() {
    let g = virtual_group(4);
    let p = plan::<bf16>(&fused(16, 8192), &g, Algorithm::Auto).unwrap();
    assert_eq!(
        p,
        Plan {
            algo: AllReduceAlgo::OneShot,
            rows: 16,
            hidden: 8192
        }
    );
    let p = plan::<bf16>(&flat(1000), &g, Algorithm::Auto).unwrap();
    assert_eq!((p.rows, p.hidden), (1, 1000));
}

#[test]
fn shape_errors_name_the_argument() {
    let g = virtual_group(2);
    let check = |d: Desc, want_arg: &str, want_text: &str| {
        let (arg, reason) = refused(plan::<bf16>(&d, &g, Algorithm::Auto).unwrap_err());
        assert_eq!(arg, want_arg, "{reason}");
        assert!(reason.contains(want_text), "{arg}: {reason}");
    };
    let mut d = flat(100);
    d.out.len = 99;
    check(d, "out", "holds 99 elements");

    let mut d = fused(4, 64);
    d.residual.as_mut().unwrap().len = 255;
    check(d, "residual", "255");

    let mut d = fused(4, 64);
    d.bias.as_mut().unwrap().len = 32;
    check(d, "bias", "gamma holds 64");

    let mut d = fused(4, 60);
    d.bias = None;
    check(d, "gamma", "multiple of 8");

    let mut d = fused(4, 64);
    d.input.len = 4 * 64 + 8;
    d.out.len = d.input.len;
    d.residual.as_mut().unwrap().len = d.input.len;
    check(d, "partial", "not whole rows");

    let mut d = fused(4, 64);
    d.eps = -1.0;
    check(d, "eps", "-1");

    let mut d = fused(4, 64);
    d.gamma.as_mut().unwrap().device = 1;
    check(d, "gamma", "device 1");
}

#[test]
fn misaligned_buffers_are_refused_before_launch() {
    let g = virtual_group(2);
    let mut d = flat(64);
    d.input.addr += 2;
    let (arg, reason) = refused(plan::<bf16>(&d, &g, Algorithm::Auto).unwrap_err());
    assert_eq!(arg, "partial");
    assert!(reason.contains("16-byte aligned"), "{reason}");
    let mut d = fused(2, 64);
    d.residual.as_mut().unwrap().addr += 8;
    let (arg, _) = refused(plan::<bf16>(&d, &g, Algorithm::Auto).unwrap_err());
    assert_eq!(arg, "residual");
}

#[test]
fn aliasing_is_refused_except_in_place() {
    let g = virtual_group(2);
    // The very same buffer: in place.
    let mut d = flat(64);
    d.out = d.input;
    assert!(plan::<bf16>(&d, &g, Algorithm::Auto).is_ok());
    // Overlapping but shifted.
    let mut d = flat(64);
    d.out.addr = d.input.addr + 32;
    let (arg, _) = refused(plan::<bf16>(&d, &g, Algorithm::Auto).unwrap_err());
    assert_eq!(arg, "out");
    // Residual on top of out.
    let mut d = fused(2, 64);
    d.residual.as_mut().unwrap().addr = d.out.addr;
    let (arg, _) = refused(plan::<bf16>(&d, &g, Algorithm::Auto).unwrap_err());
    assert_eq!(arg, "residual");
    // Gamma inside the residual.
    let mut d = fused(2, 64);
    d.gamma.as_mut().unwrap().addr = d.residual.unwrap().addr + 64;
    let (arg, _) = refused(plan::<bf16>(&d, &g, Algorithm::Auto).unwrap_err());
    assert_eq!(arg, "gamma");
}

#[test]
fn the_exact_epilogue_matches_the_f64_reference_of_sharded_sums() {
    // A [rows, hidden] activation split into W partial sums (as a row-parallel layer's
    // ranks hold them), plus bias and residual.
    let (rows, hidden) = (8, 256);
    let value = |i: usize, salt: usize| (((i * 31 + salt * 17) % 97) as f64 / 13.0) - 3.5;
    let full: Vec<f64> = (0..rows * hidden).map(|i| value(i, 1)).collect();
    let bias: Vec<bf16> = (0..hidden)
        .map(|i| bf16::from_f64(value(i, 2) / 4.0))
        .collect();
    let residual: Vec<bf16> = (0..rows * hidden)
        .map(|i| bf16::from_f64(value(i, 3)))
        .collect();
    let gamma: Vec<bf16> = (0..hidden)
        .map(|i| bf16::from_f64(0.5 + value(i, 4) / 8.0))
        .collect();
    for w in [2usize, 4, 8] {
        let parts: Vec<Vec<bf16>> = (0..w)
            .map(|_| full.iter().map(|x| bf16::from_f64(x / w as f64)).collect())
            .collect();
        let slices: Vec<&[bf16]> = parts.iter().map(Vec::as_slice).collect();
        let exact = all_reduce_epilogue_exact(&slices, Some(&bias), Some(&residual), hidden);
        let (h, normed) = all_reduce_fused_f64(
            &slices,
            Some(&bias),
            Some(&residual),
            Some(&gamma),
            1e-6,
            hidden,
        );
        let err = relative_error(&exact, &h);
        assert!(err < 1e-2, "W={w}: h relative error {err}");
        // The normed output has unit RMS per row before gamma: spot-check one row.
        let row: f64 = normed[..hidden]
            .iter()
            .zip(&gamma)
            .map(|(y, g)| (y / g.to_f64()).powi(2))
            .sum::<f64>()
            / hidden as f64;
        assert!((row - 1.0).abs() < 1e-3, "W={w}: mean square {row}");
    }
}
