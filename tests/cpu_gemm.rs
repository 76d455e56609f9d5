//! gemm without a GPU: the validation that runs before any launch, the choice of path and
//! tile configuration, and the f64 reference the GPU tests compare against.

use half::{bf16, f16};
use tpfuse::ops::gemm::{
    check_gemm, gemm_paths, select_config, split_parts, GemmBuffers, GemmConfig, GemmPath,
    GemmShape, MAX_DIM, SMALL_M_MAX,
};
use tpfuse::reference::{gemm_f64, relative_error};
use tpfuse::validate::BufferInfo;
use tpfuse::Error;

const MB: u64 = 1 << 20;

fn shape(m: usize, n: usize, k: usize) -> GemmShape {
    GemmShape { m, n, k }
}

/// Disjoint, 16-byte aligned buffers of the right lengths on device 0, with bias and residual.
fn buffers(s: GemmShape) -> GemmBuffers {
    GemmBuffers {
        a: BufferInfo::new(0x1000_0000, s.m * s.k, 0),
        b: BufferInfo::new(0x2000_0000, s.n * s.k, 0),
        bias: Some(BufferInfo::new(0x3000_0000, s.n, 0)),
        residual: Some(BufferInfo::new(0x4000_0000, s.m * s.n, 0)),
        c: BufferInfo::new(0x5000_0000, s.m * s.n, 0),
    }
}

fn invalid_arg(e: Error) -> (String, String) {
    match e {
        Error::InvalidArgument { arg, reason } => (arg, reason),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

fn expect_invalid<T: tpfuse::ops::gemm::GemmElement>(
    bufs: &GemmBuffers,
    s: GemmShape,
    arg: &str,
) -> String {
    let (got, reason) = invalid_arg(check_gemm::<T>(bufs, s, 0).unwrap_err());
    assert_eq!(got, arg, "wrong argument named ({reason})");
    reason
}

#[test]
fn valid_calls_pass() {
    for s in [
        shape(1, 1280, 8192),
        shape(16, 8192, 1024),
        shape(17, 7168, 8192),
        shape(4096, 8192, 3584),
        shape(3, 8, 8),
    ] {
        let mut b = buffers(s);
        check_gemm::<bf16>(&b, s, 0).unwrap();
        check_gemm::<f16>(&b, s, 0).unwrap();
        b.bias = None;
        b.residual = None;
        check_gemm::<bf16>(&b, s, 0).unwrap();
    }
}

#[test]
fn m_zero_is_valid_and_skips_the_pointer_checks() {
    let s = shape(0, 64, 32);
    let mut b = buffers(s);
    // Nothing is launched for m = 0, so the (empty) buffers' addresses do not matter...
    b.a.addr = 0x1000_0002;
    b.c.addr = 0x1000_0002;
    check_gemm::<bf16>(&b, s, 0).unwrap();
    // ... but the weight and bias lengths still do.
    b.b.len -= 8;
    expect_invalid::<bf16>(&b, s, "b");
}

#[test]
fn k_and_n_must_be_positive_multiples_of_8() {
    for (s, arg) in [
        (shape(4, 64, 12), "k"),
        (shape(4, 64, 0), "k"),
        (shape(4, 64, 4), "k"),
        (shape(4, 20, 64), "n"),
        (shape(4, 0, 64), "n"),
        (shape(4, 1, 64), "n"),
    ] {
        let reason = expect_invalid::<bf16>(&buffers(s), s, arg);
        assert!(reason.contains("multiple of 8"), "{reason}");
    }
    // k is checked before n.
    let s = shape(4, 20, 12);
    expect_invalid::<f16>(&buffers(s), s, "k");
}

#[test]
fn dimensions_above_2_pow_30_are_errors() {
    for (s, arg) in [
        (shape(MAX_DIM + 1, 8, 8), "m"),
        (shape(1, MAX_DIM + 8, 8), "n"),
        (shape(1, 8, MAX_DIM + 8), "k"),
    ] {
        let reason = expect_invalid::<bf16>(&buffers(s), s, arg);
        assert!(reason.contains("2^30"), "{reason}");
    }
    // The limit itself is allowed (buffers 16 GiB apart, so that they do not overlap).
    let s = shape(MAX_DIM, 8, 8);
    let mut b = buffers(s);
    for (i, info) in [&mut b.a, &mut b.b, &mut b.c].into_iter().enumerate() {
        info.addr = (i as u64 + 1) << 34;
    }
    b.bias = None;
    b.residual = None;
    check_gemm::<bf16>(&b, s, 0).unwrap();
}

#[test]
fn every_length_is_checked_and_named() {
    let s = shape(5, 24, 40);
    type Edit = fn(&mut GemmBuffers);
    let cases: [(&str, Edit, &str); 6] = [
        ("a", |b| b.a.len += 1, "m * k = 200"),
        ("b", |b| b.b.len -= 40, "n * k = 960"),
        ("bias", |b| b.bias.as_mut().unwrap().len = 5, "n = 24"),
        (
            "residual",
            |b| b.residual.as_mut().unwrap().len = 24,
            "m * n = 120",
        ),
        ("c", |b| b.c.len = 0, "m * n = 120"),
        // a transposed weight [k, n] has the right element count: only the shape can tell, so
        // a wrong m shows up on a.
        ("a", |b| b.a.len = 40 * 6, "m * k = 200"),
    ];
    for (arg, edit, want) in cases {
        let mut b = buffers(s);
        edit(&mut b);
        let reason = expect_invalid::<bf16>(&b, s, arg);
        assert!(reason.contains(want), "{arg}: {reason}");
    }
}

#[test]
fn a_buffer_on_another_device_is_named() {
    let s = shape(4, 16, 16);
    type Edit = fn(&mut GemmBuffers);
    let cases: [(&str, Edit); 5] = [
        ("a", |b| b.a.device = 1),
        ("b", |b| b.b.device = 2),
        ("bias", |b| b.bias.as_mut().unwrap().device = 1),
        ("residual", |b| b.residual.as_mut().unwrap().device = 3),
        ("c", |b| b.c.device = 1),
    ];
    for (arg, edit) in cases {
        let mut b = buffers(s);
        edit(&mut b);
        let reason = expect_invalid::<f16>(&b, s, arg);
        assert!(reason.contains("device"), "{reason}");
    }
    // A call on device 1 with every buffer there is fine.
    let mut b = buffers(s);
    for info in [&mut b.a, &mut b.b, &mut b.c] {
        info.device = 1;
    }
    b.bias.as_mut().unwrap().device = 1;
    b.residual.as_mut().unwrap().device = 1;
    check_gemm::<f16>(&b, s, 1).unwrap();
}

#[test]
fn every_pointer_must_be_16_byte_aligned() {
    let s = shape(4, 16, 16);
    type Edit = fn(&mut GemmBuffers);
    let cases: [(&str, Edit); 5] = [
        ("a", |b| b.a.addr += 2),
        ("b", |b| b.b.addr += 8),
        ("bias", |b| b.bias.as_mut().unwrap().addr += 4),
        ("residual", |b| b.residual.as_mut().unwrap().addr += 14),
        ("c", |b| b.c.addr += 2),
    ];
    for (arg, edit) in cases {
        let mut b = buffers(s);
        edit(&mut b);
        let reason = expect_invalid::<bf16>(&b, s, arg);
        assert!(reason.contains("16-byte aligned"), "{reason}");
    }
    // 32-byte and 256-byte offsets are fine.
    let mut b = buffers(s);
    b.a.addr += 32;
    b.b.addr += 256;
    check_gemm::<bf16>(&b, s, 0).unwrap();
}

#[test]
fn c_must_not_overlap_a_b_or_bias() {
    let s = shape(4, 16, 16);
    // c (64 elements = 128 bytes of bf16) ending inside a, b, or bias.
    for (arg, start) in [
        ("a", 0x1000_0000u64),
        ("b", 0x2000_0000),
        ("bias", 0x3000_0000),
    ] {
        let mut b = buffers(s);
        b.c.addr = start - 112;
        let reason = expect_invalid::<bf16>(&b, s, "c");
        assert!(reason.contains(arg), "{reason}");
        // Directly before is fine.
        b.c.addr = start - 128;
        check_gemm::<bf16>(&b, s, 0).unwrap();
    }
    // c equal to a (an in-place GEMM) is rejected too.
    let s = shape(4, 16, 16);
    let mut b = buffers(s);
    b.c.addr = b.a.addr;
    expect_invalid::<f16>(&b, s, "c");
}

#[test]
fn residual_may_be_c_exactly_but_not_overlap_it_otherwise() {
    let s = shape(8, 32, 64);
    let mut b = buffers(s);
    // In-place accumulation: residual is c.
    b.residual = Some(b.c);
    check_gemm::<bf16>(&b, s, 0).unwrap();
    // Shifted by one 16-byte vector: a race, rejected.
    let mut shifted = b.c;
    shifted.addr += 16;
    b.residual = Some(shifted);
    let reason = expect_invalid::<bf16>(&b, s, "residual");
    assert!(reason.contains("gemm_accumulate"), "{reason}");
    // Inputs may overlap each other (they are only read): residual inside a, bias inside b.
    let mut b = buffers(s);
    b.residual.as_mut().unwrap().addr = b.a.addr;
    b.bias.as_mut().unwrap().addr = b.b.addr + 64;
    check_gemm::<bf16>(&b, s, 0).unwrap();
    // Overlap is judged in bytes of the element type: c right after residual's last element.
    let mut b = buffers(s);
    b.c.addr = b.residual.unwrap().addr + 2 * (s.m * s.n) as u64;
    check_gemm::<bf16>(&b, s, 0).unwrap();
    b.c.addr -= 16;
    expect_invalid::<bf16>(&b, s, "residual");
    // Far apart never overlaps.
    let mut b = buffers(s);
    b.c.addr = 16 * MB;
    check_gemm::<bf16>(&b, s, 0).unwrap();
}

#[test]
fn the_path_follows_m_and_the_compute_capability() {
    let h100 = ((9, 0), 132);
    let a100 = ((8, 0), 108);
    let l40s = ((8, 9), 142);
    for (cc, sms) in [h100, a100, l40s, ((12, 0), 84), ((10, 0), 148)] {
        for m in 1..=SMALL_M_MAX {
            let c = select_config(shape(m, 8192, 1024), cc, sms).unwrap();
            assert_eq!(c.path(), GemmPath::Sm80SmallM, "m = {m} on {cc:?}");
        }
        for m in [SMALL_M_MAX + 1, 64, 1000, 8192] {
            let c = select_config(shape(m, 8192, 1024), cc, sms).unwrap();
            assert_eq!(c.path(), GemmPath::Sm80Tiled, "m = {m} on {cc:?}");
        }
    }
    // Before sm_80 there is no path.
    for cc in [(7, 5), (7, 0), (6, 1)] {
        assert_eq!(select_config(shape(1, 1280, 8192), cc, 80), None);
        assert_eq!(select_config(shape(4096, 1280, 8192), cc, 80), None);
    }
}

#[test]
fn the_tile_configuration_fills_the_gpu() {
    let h100 = (9, 0);
    // The split of k: the fewest parts that give 64-column tiles x parts enough blocks for
    // the SMs (at least 90% busy, the busiest at most 1.25x the mean), whatever m is.
    assert_eq!(split_parts(8192, 1024, 132), 1); // 128 tiles: 97% of 132 SMs
    assert_eq!(split_parts(1280, 8192, 132), 6); // 20 tiles x 6 = 120
    assert_eq!(split_parts(768, 4096, 132), 10); // Llama-3-8B qkv at TP 8: 12 x 10
    assert_eq!(split_parts(7168, 8192, 132), 2); // 112 x 2 = 224 (1.18x the mean)
    assert_eq!(split_parts(8192, 1024, 108), 3); // A100: 128 would leave 20 SMs a second tile
    assert_eq!(split_parts(64, 200, 132), 1); // k of one part (128 at least per part)
    assert_eq!(split_parts(8, 1 << 20, 132), 16); // at most 16 parts
                                                  // Decode without a split: the widest small-m block that still gives each SM a block.
    assert_eq!(
        select_config(shape(16, 8192, 1024), h100, 132),
        Some(GemmConfig::SmallM16x32)
    );
    // A split runs 16x64 (m <= 16) or 64x64 tiles, at every m.
    assert_eq!(
        select_config(shape(1, 1280, 8192), h100, 132),
        Some(GemmConfig::SmallM16x64)
    );
    assert_eq!(
        select_config(shape(1, 8192, 1024), (8, 0), 108),
        Some(GemmConfig::SmallM16x64)
    );
    assert_eq!(
        select_config(shape(64, 1280, 8192), h100, 132),
        Some(GemmConfig::Tile64x64)
    );
    assert_eq!(
        select_config(shape(4096, 1280, 8192), h100, 132),
        Some(GemmConfig::Tile64x64)
    );
    // Prefill without a split: 128x128 once those tiles give at least 90% of the SMs a
    // block (128 of 132 measured faster on an H200; 120 of 132 do, 118 do not), 64x64 before.
    assert_eq!(
        select_config(shape(256, 8192, 1024), h100, 132),
        Some(GemmConfig::Tile128x128)
    );
    assert_eq!(
        select_config(shape(256, 7680, 1024), h100, 132),
        Some(GemmConfig::Tile128x128)
    );
    assert_eq!(
        select_config(shape(256, 7552, 1024), h100, 132),
        Some(GemmConfig::Tile64x64)
    );
    assert_eq!(
        select_config(shape(1024, 8192, 3584), h100, 132),
        Some(GemmConfig::Tile128x128)
    );
    assert!(!GemmConfig::Tile128x128.splits_k());
    assert!(GemmConfig::ALL.iter().filter(|c| c.splits_k()).count() == 4);
}

#[test]
fn the_configurations_describe_themselves() {
    let mut seen = Vec::new();
    for c in GemmConfig::ALL {
        let info = c.info();
        assert_eq!(info.path, c.path());
        let small = info.block_m == 16;
        assert_eq!(
            info.path,
            if small {
                GemmPath::Sm80SmallM
            } else {
                GemmPath::Sm80Tiled
            },
            "{c:?}"
        );
        assert!(info.block_k == 32 || info.block_k == 64, "{info:?}");
        assert!((2..=16).contains(&info.stages), "{info:?}");
        assert_eq!(info.threads % 32, 0, "{info:?}");
        // Every configuration must fit the smallest opt-in limit among the built
        // architectures (99 KiB per block on sm_86 / sm_89 / sm_120), with the largest
        // static shared memory of a kernel that runs it (the fused GEMM + all-reduce's 256 B,
        // cuda/emu/kernel_resources.inc).
        assert!(info.smem_bytes + 256 <= 99 * 1024, "{info:?}");
        let stage = (info.block_m + info.block_n) * info.block_k * 2;
        assert!(info.smem_bytes >= info.stages * stage, "{info:?}");
        assert!(!c.name().is_empty());
        seen.push((info.block_m, info.block_n));
        // The fused kernels' variant: the same tiles (the same bits), the same limits; only
        // tile-64x64 streams deeper slices there.
        let fused = c.fused_info();
        assert_eq!(
            (fused.path, fused.block_m, fused.block_n, fused.threads),
            (info.path, info.block_m, info.block_n, info.threads),
            "{c:?}"
        );
        assert!(fused.smem_bytes + 256 <= 99 * 1024, "{fused:?}");
        let fused_stage = (fused.block_m + fused.block_n) * fused.block_k * 2;
        assert!(fused.smem_bytes >= fused.stages * fused_stage, "{fused:?}");
        if c == GemmConfig::Tile64x64 {
            assert_eq!((info.block_k, fused.block_k), (32, 64));
        } else {
            assert_eq!(fused, info, "{c:?}");
        }
    }
    assert_eq!(
        seen,
        vec![(16, 16), (16, 32), (16, 64), (64, 64), (128, 128)]
    );
}

#[test]
fn every_built_architecture_has_both_paths() {
    let table = gemm_paths();
    let rows = if tpfuse::build_info::EMULATED {
        // No GPU architecture is compiled; the emulator runs the sm80 paths.
        assert!(tpfuse::build_info::architectures().is_empty());
        vec!["emulator"]
    } else {
        tpfuse::build_info::architectures()
    };
    assert!(!rows.is_empty());
    assert_eq!(table.iter().map(|(a, _)| *a).collect::<Vec<_>>(), rows);
    for (arch, paths) in table {
        assert_eq!(
            paths,
            vec![GemmPath::Sm80SmallM, GemmPath::Sm80Tiled],
            "{arch}"
        );
    }
    assert_eq!(GemmPath::Sm80SmallM.name(), "sm80-small-m");
    assert_eq!(GemmPath::Sm80Tiled.name(), "sm80-tiled");
}

#[test]
fn gemm_f64_multiplies_by_the_transposed_weight() {
    // A [2, 2] = [[1, 2], [3, 4]]; B [3, 2] = [[5, 6], [7, 8], [9, 10]] (rows are outputs).
    let a: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
    let b: Vec<f32> = vec![5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
    let c = gemm_f64(&a, &b, None, None, 2, 3, 2);
    // Row i, column j is a[i] . b[j].
    assert_eq!(c, vec![17.0, 23.0, 29.0, 39.0, 53.0, 67.0]);
    // + bias[j] on every row, + residual[i, j].
    let bias = [0.5f32, -1.0, 2.0];
    let residual = [1.0f32, 2.0, 3.0, -4.0, -5.0, -6.0];
    let c = gemm_f64(&a, &b, Some(&bias), Some(&residual), 2, 3, 2);
    assert_eq!(c, vec![18.5, 24.0, 34.0, 35.5, 47.0, 63.0]);
    // m = 0 gives nothing; m = 1 is the first row.
    assert!(gemm_f64(&a[..0], &b, Some(&bias), None, 0, 3, 2).is_empty());
    assert_eq!(
        gemm_f64(&a[..2], &b, None, None, 1, 3, 2),
        vec![17.0, 23.0, 29.0]
    );
}

#[test]
fn gemm_f64_is_exact_where_f32_is_not() {
    // 2^24 + 1 - 2^24: f32 accumulation in this order loses the 1, f64 keeps it.
    let big = 16_777_216.0f32;
    let a = [big, 1.0, -big, 0.0, 0.0, 0.0, 0.0, 0.0];
    let b = [1.0f32; 8];
    assert_eq!(gemm_f64(&a, &b, None, None, 1, 1, 8), vec![1.0]);
    let f32_sum = ((big + 1.0) - big) + 0.0;
    assert_eq!(f32_sum, 0.0);
}

#[test]
fn gemm_f64_reads_half_precision_inputs_exactly() {
    let a: Vec<bf16> = [1.5f32, -2.0, 0.25, 8.0]
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let b: Vec<bf16> = [2.0f32, 0.5, -4.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    // k = 4, n = 2: row 0 = 3 - 1 - 1 + 8 = 9, row 1 = 1.5 - 2 + 0.25 + 8 = 7.75.
    assert_eq!(gemm_f64(&a, &b, None, None, 1, 2, 4), vec![9.0, 7.75]);
    let a16: Vec<f16> = a.iter().map(|x| f16::from_f32(x.to_f32())).collect();
    let b16: Vec<f16> = b.iter().map(|x| f16::from_f32(x.to_f32())).collect();
    let bias = [f16::from_f32(-9.0), f16::from_f32(0.25)];
    assert_eq!(
        gemm_f64(&a16, &b16, Some(&bias), None, 1, 2, 4),
        vec![0.0, 8.0]
    );
    // The relative error of a rounded result against it is what the GPU tests bound.
    let want = gemm_f64(&a, &b, None, None, 1, 2, 4);
    let got = [bf16::from_f32(9.0), bf16::from_f32(7.75)];
    assert_eq!(relative_error(&got, &want), 0.0);
}

#[test]
#[should_panic(expected = "b must hold n * k elements")]
fn gemm_f64_rejects_a_wrong_length() {
    let a = [1.0f32; 8];
    let b = [1.0f32; 12];
    gemm_f64(&a, &b, None, None, 1, 2, 8);
}

/// The fused GEMM + all-reduce's reduction: the layer's algorithm, or under Auto one-shot below
/// the group's one-shot bound and two-shot from it where m splits into W slices; two-shot
/// with uneven slices and NCCL are refused naming `algorithm`; the gathered input of the fused
/// all-gather + GEMM must fit in half the capacity.
#[test]
fn the_fused_reduction_follows_the_algorithm_and_the_size() {
    use tpfuse::ops::all_gather_gemm::unfusable_all_gather;
    use tpfuse::ops::gemm_all_reduce::{fused_all_reduce_algo, unfusable, FusedFacts};
    use tpfuse::ops::Algorithm;
    use tpfuse::topology::AllReduceAlgo::{OneShot, TwoShot};
    let facts = FusedFacts {
        device: 0,
        world: 8,
        capacity: 8 << 20,
        compute_capability: (9, 0),
        sms: 132,
        blocks: 132,
        group_sms: (132, 132),
        blocks_per_sm: [1; 5],
        gather_blocks_per_sm: [1; 5],
        one_shot_below: Some(256 << 10),
        packet_bytes: 0,
    };
    let algo = |m, a| fused_all_reduce_algo::<bf16>(shape(m, 8192, 1024), &facts, a);
    // 8 rows of 16 KiB = 128 KiB: one-shot; 16 rows = 256 KiB: two-shot; 17: uneven, one-shot.
    assert_eq!(algo(8, Algorithm::Auto).unwrap(), OneShot);
    assert_eq!(algo(16, Algorithm::Auto).unwrap(), TwoShot);
    assert_eq!(algo(17, Algorithm::Auto).unwrap(), OneShot);
    assert_eq!(algo(64, Algorithm::OneShot).unwrap(), OneShot);
    assert_eq!(algo(8, Algorithm::TwoShot).unwrap(), TwoShot);
    let (arg, reason) = invalid_arg(algo(9, Algorithm::TwoShot).unwrap_err());
    assert_eq!(arg, "algorithm");
    assert!(
        reason.contains("m = 9") && reason.contains("8 equal slices"),
        "{reason}"
    );
    let (arg, reason) = invalid_arg(algo(8, Algorithm::Nccl).unwrap_err());
    assert_eq!(arg, "algorithm");
    assert!(reason.contains("NCCL"), "{reason}");
    // No custom all-reduce on the group: never two-shot by size.
    let refused = FusedFacts {
        one_shot_below: None,
        ..facts
    };
    let auto = fused_all_reduce_algo::<bf16>(shape(64, 8192, 1024), &refused, Algorithm::Auto);
    assert_eq!(auto.unwrap(), OneShot);
    // All-gather + GEMM: [m, k] in half of 8 MiB, m ≤ 256 at k = 8192.
    assert_eq!(
        unfusable_all_gather::<bf16>(shape(256, 1280, 8192), &facts),
        None
    );
    let reason = unfusable_all_gather::<bf16>(shape(264, 1280, 8192), &facts).expect("too large");
    assert!(reason.contains("[264, 8192]"), "{reason}");
    // GPUs of different SM counts (each rank would choose its tiles and split from its own):
    // neither fused kernel runs.
    assert_eq!(unfusable::<bf16>(shape(16, 8192, 1024), &facts), None);
    let mixed = FusedFacts {
        group_sms: (114, 132),
        ..facts
    };
    for reason in [
        unfusable::<bf16>(shape(16, 8192, 1024), &mixed),
        unfusable_all_gather::<bf16>(shape(16, 1280, 8192), &mixed),
    ] {
        let reason = reason.expect("GPUs of different SM counts");
        assert!(reason.contains("114 to 132 SMs"), "{reason}");
    }
}
