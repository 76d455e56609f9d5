//! GPU tests of loading a merged column-parallel layer section by section
//! ([`MergedColumnParallelLinear::loader`], [`SectionLoader`]; feature `gpu-tests`, or
//! `emulator` on the CPU; with neither every test here is listed as ignored), on virtual
//! ranks W = 2, 4, 8 of GPU 0.
//!
//! - Loaded one host tensor per section, in a scrambled order, each rank's device shard
//!   (weight and bias) is bit for bit the one [`MergedColumnParallelLinear::from_host`] cuts
//!   from the stacked weight and [`MergedColumnParallelLinear::from_host_parts`] from the
//!   parts: QKV with KV heads split and replicated, QKV with value heads of another size,
//!   gate_up. The loader's shard starts zeroed and the weights are random (never zero), so a
//!   section written to the wrong rows, or not at all, fails the comparison.
//! - Optional biases per section: q and v with a bias, k without, gives the bias shard of the
//!   stacked bias whose k part is zero; no bias at all gives a layer without one.
//! - A section never loaded is named by `finish`; a section loaded twice, an unknown
//!   section, a transposed weight, a bias of the wrong length are refused naming the layer,
//!   and a refused call changes nothing (the loader still finishes to the right shard).

mod common;
use common::assert_same_bits;
use common::gpu::{base_seed, expect_invalid_saying, mix_seed, random_vec, splitmix64};
use common::ranks::{download, gpu, virtual_group};

use cudarc::driver::CudaContext;
use half::{bf16, f16};
use std::sync::Arc;
use tpfuse::ops::gemm::GemmElement;
use tpfuse::ops::linear::MergedColumnParallelLinear;
use tpfuse::shard::{HostWeight, MergedColumnSpec};
use tpfuse::{GroupOptions, NcclType, TpGroup};

const WORLDS: [usize; 3] = [2, 4, 8];

/// The element types the layers take.
trait TestElement: common::gpu::TestElement + GemmElement + NcclType {}
impl TestElement for bf16 {}
impl TestElement for f16 {}

fn seed_of<T: TestElement>(parts: &[u64]) -> u64 {
    mix_seed(splitmix64(base_seed(0x6c6f_6164_6572_0013) ^ T::ID), parts)
}

/// One section's full host tensors, as a checkpoint holds them.
struct Part<T> {
    name: &'static str,
    rows: usize,
    weight: Vec<T>,
    /// `None`: the checkpoint has no bias for this section.
    bias: Option<Vec<T>>,
}

/// Random parts for every section of `spec` (values in ±1, never all zero); a bias for the
/// sections in `with_bias`.
fn parts<T: TestElement>(spec: &MergedColumnSpec, seed: u64, with_bias: &[&str]) -> Vec<Part<T>> {
    let names: [&'static str; 5] = ["q", "k", "v", "gate", "up"];
    spec.sections()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let name = names
                .into_iter()
                .find(|n| *n == s.name)
                .expect("a known section name");
            let seed = splitmix64(seed ^ (i as u64 + 1));
            Part {
                name,
                rows: s.rows(),
                weight: random_vec(seed, s.rows() * spec.in_features(), -1.0, 1.0),
                bias: with_bias
                    .contains(&name)
                    .then(|| random_vec(splitmix64(seed ^ 0xb1a5), s.rows(), -1.0, 1.0)),
            }
        })
        .collect()
}

/// The parts stacked into the full weight `[out_features, in_features]`, and the full bias
/// with zeros for the sections without one (`None` when no section has a bias).
fn stacked<T: TestElement>(parts: &[Part<T>]) -> (Vec<T>, Option<Vec<T>>) {
    let weight = parts.iter().flat_map(|p| p.weight.clone()).collect();
    let any_bias = parts.iter().any(|p| p.bias.is_some());
    let bias = any_bias.then(|| {
        parts
            .iter()
            .flat_map(|p| {
                p.bias
                    .clone()
                    .unwrap_or_else(|| vec![T::from_f32(0.0); p.rows])
            })
            .collect()
    });
    (weight, bias)
}

/// A part's weight as stored, `[rows, in_features]`.
fn weight<T>(p: &Part<T>, k: usize) -> HostWeight<'_, T> {
    HostWeight::new(&p.weight, p.rows, k)
}

/// Rank `group`'s layer loaded section by section, in `order` (indices into `parts`).
fn load<T: TestElement + cudarc::driver::ValidAsZeroBits>(
    group: &TpGroup,
    spec: &MergedColumnSpec,
    parts: &[Part<T>],
    order: &[usize],
) -> MergedColumnParallelLinear<T> {
    let k = spec.in_features();
    let mut loader = MergedColumnParallelLinear::<T>::loader(group, spec.clone()).expect("loader");
    for &i in order {
        let p = &parts[i];
        loader
            .load_section(
                p.name,
                HostWeight::new(&p.weight, p.rows, k),
                p.bias.as_deref(),
            )
            .unwrap_or_else(|e| panic!("loading section '{}': {e}", p.name));
    }
    assert!(loader.missing().is_empty());
    loader.finish().expect("finish")
}

/// Asserts that two layers of one rank hold the same weight and bias shards, bit for bit.
fn assert_same_shards<T: TestElement>(
    label: &str,
    group: &TpGroup,
    got: &MergedColumnParallelLinear<T>,
    want: &MergedColumnParallelLinear<T>,
) {
    assert_same_bits(
        &format!("{label}: weight shard"),
        &download(group, got.weight()),
        &download(group, want.weight()),
    );
    match (got.bias(), want.bias()) {
        (Some(g), Some(w)) => assert_same_bits(
            &format!("{label}: bias shard"),
            &download(group, g),
            &download(group, w),
        ),
        (None, None) => {}
        (g, w) => panic!(
            "{label}: bias {} but the whole-layer load has {}",
            if g.is_some() { "present" } else { "absent" },
            if w.is_some() { "one" } else { "none" }
        ),
    }
}

/// Every rank of a `world`-rank group: the loaded layer equals `from_host` of the stacked
/// tensors and `from_host_parts` (when every or no section has a bias) of the parts.
fn case<T: TestElement + cudarc::driver::ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    label: &str,
    world: usize,
    spec_of: impl Fn(usize) -> MergedColumnSpec,
    with_bias: &[&str],
    order: &[usize],
) {
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let spec = spec_of(world);
    let seed = seed_of::<T>(&[world as u64, order.len() as u64, with_bias.len() as u64]);
    let label = format!("{label} {} W={world} seed={seed:#x}", T::NAME);
    let parts = parts::<T>(&spec, seed, with_bias);
    let (weight, bias) = stacked(&parts);
    let (n, k) = (spec.out_features(), spec.in_features());
    for (r, g) in groups.iter().enumerate() {
        let loaded = load(g, &spec, &parts, order);
        let whole = MergedColumnParallelLinear::from_host(
            g,
            spec.clone(),
            HostWeight::new(&weight, n, k),
            bias.as_deref(),
        )
        .expect("from_host");
        assert_same_shards(
            &format!("{label} rank {r} vs from_host"),
            g,
            &loaded,
            &whole,
        );
        if with_bias.is_empty() || with_bias.len() == parts.len() {
            let weights: Vec<HostWeight<'_, T>> = parts
                .iter()
                .map(|p| HostWeight::new(&p.weight, p.rows, k))
                .collect();
            let biases: Option<Vec<&[T]>> = parts.iter().map(|p| p.bias.as_deref()).collect();
            let from_parts = MergedColumnParallelLinear::from_host_parts(
                g,
                spec.clone(),
                &weights,
                biases.as_deref(),
            )
            .expect("from_host_parts");
            assert_same_shards(
                &format!("{label} rank {r} vs from_host_parts"),
                g,
                &loaded,
                &from_parts,
            );
        }
        g.check().expect("healthy");
    }
}

fn qkv(q_heads: usize, kv_heads: usize) -> impl Fn(usize) -> MergedColumnSpec {
    move |world| {
        MergedColumnSpec::qkv("attn.qkv_proj", 64, 8, q_heads, kv_heads, world).expect("spec")
    }
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn sections_loaded_one_at_a_time_equal_the_whole_layer() {
    let gpu = gpu();
    for world in WORLDS {
        // KV heads split (W = 2) and replicated (W = 4, 8); every section with a bias.
        case::<bf16>(
            &gpu.ctx,
            "qkv 8/2",
            world,
            qkv(8, 2),
            &["q", "k", "v"],
            &[2, 0, 1],
        );
        case::<f16>(
            &gpu.ctx,
            "qkv 16/8",
            world,
            qkv(16, 8),
            &["q", "k", "v"],
            &[1, 2, 0],
        );
        // q and v biases, none on k (Qwen-style checkpoints have all three; some have not).
        case::<bf16>(
            &gpu.ctx,
            "qkv 8/2 q,v bias",
            world,
            qkv(8, 2),
            &["q", "v"],
            &[0, 1, 2],
        );
        // No bias at all: the layer has none.
        case::<f16>(
            &gpu.ctx,
            "qkv 8/2 no bias",
            world,
            qkv(8, 2),
            &[],
            &[1, 0, 2],
        );
        // Value heads of another size.
        let wide_v = |world| {
            MergedColumnSpec::qkv_with_v_head_dim("attn.qkv_proj", 64, 8, 16, 8, 2, world)
                .expect("spec")
        };
        case::<bf16>(
            &gpu.ctx,
            "qkv v_head_dim 16",
            world,
            wide_v,
            &["k"],
            &[2, 1, 0],
        );
        // gate_up, up first.
        let gate_up =
            |world| MergedColumnSpec::gate_up("mlp.gate_up_proj", 64, 128, world).expect("spec");
        case::<bf16>(&gpu.ctx, "gate_up", world, gate_up, &[], &[1, 0]);
    }
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn bad_loads_are_refused_naming_the_layer() {
    type T = bf16;
    let gpu = gpu();
    let groups = virtual_group(&gpu.ctx, 2, GroupOptions::default());
    let g = &groups[1];
    let spec = qkv(8, 2)(2);
    let label = "merged-column-parallel 'attn.qkv_proj'";
    let k = spec.in_features();
    let parts = parts::<T>(&spec, seed_of::<T>(&[99]), &["q", "k", "v"]);
    let (q, kp, v) = (&parts[0], &parts[1], &parts[2]);

    // A spec for another world than the group's.
    expect_invalid_saying(
        "spec of world 4",
        MergedColumnParallelLinear::<T>::loader(g, qkv(8, 2)(4)),
        label,
        &["world 4", "2 ranks"],
    );

    // Nothing loaded: every section is named.
    let loader = MergedColumnParallelLinear::<T>::loader(g, spec.clone()).expect("loader");
    assert_eq!(loader.missing(), vec!["q", "k", "v"]);
    expect_invalid_saying(
        "nothing loaded",
        loader.finish(),
        label,
        &["sections 'q', 'k', 'v' never loaded"],
    );

    let mut loader = MergedColumnParallelLinear::<T>::loader(g, spec.clone()).expect("loader");
    loader
        .load_section("q", weight(q, k), q.bias.as_deref())
        .expect("q");
    // Loaded twice.
    expect_invalid_saying(
        "q twice",
        loader.load_section("q", weight(q, k), q.bias.as_deref()),
        label,
        &["section 'q' is already loaded"],
    );
    // No such section (Hugging Face's name instead of the section's).
    expect_invalid_saying(
        "unknown section",
        loader.load_section("k_proj", weight(kp, k), None),
        label,
        &["no section is named 'k_proj'", "'q', 'k', 'v'"],
    );
    // k_proj [16, 64] given transposed, [64, 16]: same element count.
    expect_invalid_saying(
        "transposed k",
        loader.load_section("k", HostWeight::new(&kp.weight, k, kp.rows), None),
        label,
        &[
            "the host weight of section 'k'",
            "expected [heads · head_dim, in_features] = [16, 64], got [64, 16] (transposed?)",
        ],
    );
    // A weight whose data does not fill its shape; a bias of the wrong length.
    expect_invalid_saying(
        "short k",
        loader.load_section("k", HostWeight::new(&kp.weight[1..], kp.rows, k), None),
        label,
        &["section 'k'", "holds 1023 elements"],
    );
    let bias = kp.bias.as_deref().expect("a k bias");
    expect_invalid_saying(
        "short k bias",
        loader.load_section("k", weight(kp, k), Some(&bias[1..])),
        label,
        &["the host bias of section 'k' holds 15"],
    );
    // Only q is in: k and v are missing, and finish says so.
    assert_eq!(loader.missing(), vec!["k", "v"]);
    loader
        .load_section("v", weight(v, k), v.bias.as_deref())
        .expect("v");
    expect_invalid_saying(
        "k missing",
        loader.finish(),
        label,
        &["section 'k' never loaded"],
    );

    // After refused calls the loader is unchanged: it finishes to the whole layer's shard.
    let mut loader = MergedColumnParallelLinear::<T>::loader(g, spec.clone()).expect("loader");
    for p in &parts {
        let bias = p.bias.as_deref().expect("a bias");
        if p.rows != k {
            let transposed = HostWeight::new(&p.weight, k, p.rows);
            assert!(loader.load_section(p.name, transposed, Some(bias)).is_err());
        }
        assert!(loader
            .load_section(p.name, weight(p, k), Some(&bias[..p.rows - 8]))
            .is_err());
        loader
            .load_section(p.name, weight(p, k), Some(bias))
            .expect("load");
        // Again, with other data: refused, and the first load stays.
        let other = vec![T::from_f32(7.0); p.weight.len()];
        let other = HostWeight::new(&other, p.rows, k);
        assert!(loader.load_section(p.name, other, None).is_err());
    }
    let loaded = loader.finish().expect("finish");
    let (w, b) = stacked(&parts);
    let whole = MergedColumnParallelLinear::from_host(
        g,
        spec.clone(),
        HostWeight::new(&w, spec.out_features(), k),
        b.as_deref(),
    )
    .expect("from_host");
    assert_same_shards("after refused calls", g, &loaded, &whole);
    g.check().expect("healthy");
}
