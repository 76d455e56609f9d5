//! The shard math of the tensor-parallel linear layers, without a GPU ([`tpfuse::shard`]):
//! for every layer type and world 1 to 8, the ranks' results computed in f64 from the host
//! slices of a full weight, concatenated (column-parallel, merged) or summed (row-parallel),
//! equal the unsharded layer's result; grouped-query splits (KV heads split or replicated);
//! and every validation error, with the layer it names.
//!
//! Column and merged shards compute each output element with the same dot product (same
//! row, same order over `k`) as the unsharded layer, so those comparisons are exact for any
//! values. Row-parallel sums regroup the dot products, so they are exact on small-integer
//! inputs (every partial sum is an integer below 2^53) and within 1e-12 on random ones.

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::ops::Range;
use tpfuse::reference::{
    gated_mlp_f64, gemm_f64, gemm_f64_wide, relative_error, rms_norm_f64, silu_mul_f64,
};
use tpfuse::shard::{
    describe, qkv_bias_from_megatron, qkv_from_megatron, ColumnParallelSpec, HostWeight, LayerKind,
    MergedColumnSpec, RowParallelSpec, Section, VocabParallelSpec, VOCAB_PADDING,
};
use tpfuse::{Element, Error};

const WORLDS: Range<usize> = 1..9;
const M: usize = 3;

fn random<T: Element>(seed: u64, n: usize) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

/// Small integers in -4..=4: exact in bf16, and every sum of products exact in f64.
fn integers<T: Element>(seed: u64, n: usize) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f32(rng.random_range(-4i32..=4) as f32))
        .collect()
}

/// Columns `cols` of a row-major `[m, n]` matrix.
fn columns(y: &[f64], n: usize, cols: Range<usize>) -> Vec<f64> {
    y.chunks_exact(n)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

/// Row-major `[m, Σ n_r]` from per-rank `[m, n_r]` blocks, side by side.
fn concat_columns(parts: &[Vec<f64>], m: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for i in 0..m {
        for p in parts {
            let n = p.len() / m;
            out.extend_from_slice(&p[i * n..(i + 1) * n]);
        }
    }
    out
}

fn invalid(e: Error) -> (String, String) {
    match e {
        Error::InvalidArgument { arg, reason } => (arg, reason),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// Asserts `result` is an InvalidArgument naming `label` whose reason contains every word.
#[track_caller]
fn expect_error<R: std::fmt::Debug>(result: tpfuse::Result<R>, label: &str, words: &[&str]) {
    let (arg, reason) = invalid(result.expect_err("expected an error"));
    assert_eq!(arg, label, "wrong layer named ({reason})");
    for w in words {
        assert!(reason.contains(w), "`{w}` missing from: {reason}");
    }
}

// ---------------------------------------------------------------------------------------
// Column-parallel.
// ---------------------------------------------------------------------------------------

#[test]
fn column_parallel_ranks_concatenate_to_the_full_layer() {
    let (k, n) = (24, 840); // 840 = lcm(1..=8): every world divides it
    let x = random::<f32>(1, M * k);
    let w = random::<f32>(2, n * k);
    let b = random::<f32>(3, n);
    let full = gemm_f64(&x, &w, Some(&b), None, M, n, k);
    for world in WORLDS {
        let spec = ColumnParallelSpec::new("lm_head", k, n, world).unwrap();
        assert_eq!(spec.out_per_rank() * world, n);
        let mut parts = Vec::new();
        let mut rows_seen = Vec::new();
        for r in 0..world {
            let rows = spec.rows(r).unwrap();
            assert_eq!(rows, r * n / world..(r + 1) * n / world, "world {world}");
            rows_seen.extend(rows.clone());
            let ws = spec.shard_weight(r, HostWeight::new(&w, n, k)).unwrap();
            let bs = spec.shard_bias(r, &b).unwrap();
            assert_eq!(ws.len(), spec.out_per_rank() * k);
            assert_eq!(ws[..], w[rows.start * k..rows.end * k]);
            assert_eq!(bs[..], b[rows.clone()]);
            let y = gemm_f64(&x, &ws, Some(&bs), None, M, spec.out_per_rank(), k);
            // Each rank's output is its columns of the full output, exactly.
            assert_eq!(y, columns(&full, n, rows), "world {world} rank {r}");
            parts.push(y);
        }
        assert_eq!(rows_seen, (0..n).collect::<Vec<_>>());
        assert_eq!(concat_columns(&parts, M), full, "world {world}");
    }
}

#[test]
fn column_parallel_in_bf16_takes_the_same_bits() {
    let (k, n, world) = (8, 32, 4);
    let w = random::<bf16>(4, n * k);
    let spec = ColumnParallelSpec::new("c", k, n, world).unwrap();
    let all: Vec<bf16> = (0..world)
        .flat_map(|r| spec.shard_weight(r, HostWeight::new(&w, n, k)).unwrap())
        .collect();
    assert_eq!(
        all.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        w.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

// ---------------------------------------------------------------------------------------
// Row-parallel.
// ---------------------------------------------------------------------------------------

/// `Σ_r x_r · W_rᵀ` over the ranks of `spec`, plus the bias once.
fn row_parallel_sum<T: Element>(spec: &RowParallelSpec, x: &[T], w: &[T], b: &[T]) -> Vec<f64> {
    let (k, n) = (spec.in_features(), spec.out_features());
    let m = x.len() / k;
    let mut sum = vec![0.0f64; m * n];
    for r in 0..spec.world() {
        let cols = spec.columns(r).unwrap();
        let xr: Vec<T> = x
            .chunks_exact(k)
            .flat_map(|row| row[cols.clone()].to_vec())
            .collect();
        let wr = spec.shard_weight(r, HostWeight::new(w, n, k)).unwrap();
        assert_eq!(wr.len(), n * spec.in_per_rank());
        let partial = gemm_f64(&xr, &wr, None, None, m, n, spec.in_per_rank());
        for (s, p) in sum.iter_mut().zip(partial) {
            *s += p;
        }
    }
    spec.check_bias(b).unwrap();
    for (i, s) in sum.iter_mut().enumerate() {
        *s += b[i % n].to_f64();
    }
    sum
}

#[test]
fn row_parallel_partials_sum_to_the_full_layer() {
    let (k, n) = (840, 24);
    for world in WORLDS {
        let spec = RowParallelSpec::new("layers.0.mlp.down_proj", k, n, world).unwrap();
        assert_eq!(spec.in_per_rank() * world, k);
        let cols: Vec<usize> = (0..world).flat_map(|r| spec.columns(r).unwrap()).collect();
        assert_eq!(cols, (0..k).collect::<Vec<_>>(), "world {world}");
        for r in 0..world {
            assert_eq!(spec.columns(r).unwrap(), r * k / world..(r + 1) * k / world);
        }

        // Exact on integers (bf16 holds them exactly).
        let x = integers::<bf16>(10 + world as u64, M * k);
        let w = integers::<bf16>(20 + world as u64, n * k);
        let b = integers::<bf16>(30 + world as u64, n);
        let full = gemm_f64(&x, &w, Some(&b), None, M, n, k);
        assert_eq!(row_parallel_sum(&spec, &x, &w, &b), full, "world {world}");

        // Within f64 rounding on random values.
        let x = random::<f32>(40 + world as u64, M * k);
        let w = random::<f32>(50 + world as u64, n * k);
        let b = random::<f32>(60 + world as u64, n);
        let full = gemm_f64(&x, &w, Some(&b), None, M, n, k);
        let sum = row_parallel_sum(&spec, &x, &w, &b);
        let wide: Vec<f32> = sum.iter().map(|&v| v as f32).collect();
        assert!(relative_error(&wide, &full) < 1e-6);
        let err = sum
            .iter()
            .zip(&full)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-12, "world {world}: {err:e}");
    }
}

#[test]
fn row_parallel_shard_holds_the_columns() {
    // [out 2, in 6] on 3 ranks: rank 1 takes columns 2..4 of both rows.
    let spec = RowParallelSpec::new("o_proj", 6, 2, 3).unwrap();
    let w: Vec<u32> = (0..12).collect();
    let w = HostWeight::new(&w, 2, 6);
    assert_eq!(spec.shard_weight(0, w).unwrap(), vec![0, 1, 6, 7]);
    assert_eq!(spec.shard_weight(1, w).unwrap(), vec![2, 3, 8, 9]);
    assert_eq!(spec.shard_weight(2, w).unwrap(), vec![4, 5, 10, 11]);
}

// ---------------------------------------------------------------------------------------
// Merged: QKV with grouped-query attention.
// ---------------------------------------------------------------------------------------

/// Whether `q_heads / kv_heads` can be sharded on `world` ranks.
fn qkv_valid(q: usize, kv: usize, world: usize) -> bool {
    q % world == 0 && q % kv == 0 && (kv % world == 0 || world % kv == 0)
}

/// One QKV configuration on one world size, checked against the full f64 output.
fn qkv_case(q_heads: usize, kv_heads: usize, world: usize) {
    let (hidden, head_dim) = (16, 4);
    let label = format!("q {q_heads} / kv {kv_heads} at W={world}");
    let spec = MergedColumnSpec::qkv("qkv_proj", hidden, head_dim, q_heads, kv_heads, world)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let (q_rows, kv_rows) = (q_heads * head_dim, kv_heads * head_dim);
    let out = q_rows + 2 * kv_rows;
    assert_eq!(spec.out_features(), out);
    let seed = (q_heads * 100 + kv_heads * 10 + world) as u64;
    let x = random::<f32>(seed, M * hidden);
    let w = random::<f32>(seed + 1, out * hidden);
    let b = random::<f32>(seed + 2, out);
    let full = gemm_f64(&x, &w, Some(&b), None, M, out, hidden);
    // The full output's columns of heads `heads` of the section at row offset `offset`.
    let head_cols = |offset: usize, heads: Range<usize>| {
        columns(
            &full,
            out,
            offset + heads.start * head_dim..offset + heads.end * head_dim,
        )
    };
    let split = spec.qkv_split().unwrap();
    assert!(spec.gate_up_split().is_none());
    let kv_per_rank = (kv_heads / world).max(1);
    assert_eq!(split.q_heads, q_heads / world, "{label}");
    assert_eq!(split.kv_heads, kv_per_rank, "{label}");
    assert_eq!(split.head_dim, head_dim);
    assert_eq!(split.q, 0..q_heads / world * head_dim);
    assert_eq!(split.k, split.q.end..split.q.end + kv_per_rank * head_dim);
    assert_eq!(split.v, split.k.end..split.k.end + kv_per_rank * head_dim);
    assert_eq!(split.width(), spec.out_per_rank());
    assert_eq!(spec.replicas(0), 1);
    assert_eq!(spec.replicas(1), (world / kv_heads).max(1));

    let parts = [
        HostWeight::new(&w[..q_rows * hidden], q_rows, hidden),
        HostWeight::new(
            &w[q_rows * hidden..(q_rows + kv_rows) * hidden],
            kv_rows,
            hidden,
        ),
        HostWeight::new(&w[(q_rows + kv_rows) * hidden..], kv_rows, hidden),
    ];
    let bias_parts = [
        &b[..q_rows],
        &b[q_rows..q_rows + kv_rows],
        &b[q_rows + kv_rows..],
    ];
    let mut q_seen = Vec::new();
    let mut kv_count = vec![0usize; kv_heads];
    for r in 0..world {
        let ws = spec
            .shard_weight(r, HostWeight::new(&w, out, hidden))
            .unwrap();
        let bs = spec.shard_bias(r, &b).unwrap();
        assert_eq!(ws, spec.shard_weight_parts(r, &parts).unwrap(), "{label}");
        assert_eq!(
            bs,
            spec.shard_bias_parts(r, &bias_parts).unwrap(),
            "{label}"
        );
        let n = spec.out_per_rank();
        let y = gemm_f64(&x, &ws, Some(&bs), None, M, n, hidden);

        let q = spec.heads_of(0, r).unwrap();
        let k = spec.heads_of(1, r).unwrap();
        let v = spec.heads_of(2, r).unwrap();
        assert_eq!(k, v, "{label}: k and v heads of rank {r}");
        // The rank's heads: q split evenly; kv split, or head r / (W / kv) replicated.
        assert_eq!(q, r * q_heads / world..(r + 1) * q_heads / world);
        if kv_heads >= world {
            assert_eq!(k, r * kv_heads / world..(r + 1) * kv_heads / world);
        } else {
            let h = r / (world / kv_heads);
            assert_eq!(k, h..h + 1, "{label}: rank {r}");
        }
        // Grouped-query attention: every query head's KV head is on this rank.
        let group = q_heads / kv_heads;
        for h in q.clone() {
            assert!(k.contains(&(h / group)), "{label}: q head {h} on rank {r}");
        }
        // The rank's sections are the full output's columns of its heads, exactly.
        assert_eq!(columns(&y, n, split.q.clone()), head_cols(0, q.clone()));
        assert_eq!(
            columns(&y, n, split.k.clone()),
            head_cols(q_rows, k.clone())
        );
        assert_eq!(
            columns(&y, n, split.v.clone()),
            head_cols(q_rows + kv_rows, v)
        );
        // The rows the rank takes, in the full weight.
        let rows = spec.rows(r).unwrap();
        assert_eq!(rows[0], q.start * head_dim..q.end * head_dim);
        assert_eq!(
            rows[1],
            q_rows + k.start * head_dim..q_rows + k.end * head_dim
        );
        q_seen.extend(q);
        for h in k {
            kv_count[h] += 1;
        }
    }
    assert_eq!(q_seen, (0..q_heads).collect::<Vec<_>>(), "{label}");
    let copies = (world / kv_heads).max(1);
    assert!(
        kv_count.iter().all(|&c| c == copies),
        "{label}: {kv_count:?}"
    );
}

#[test]
fn qkv_shards_match_the_full_projection_for_every_world() {
    let configs = [(64, 8), (32, 8), (8, 2), (8, 8), (4, 1), (16, 4), (8, 1)];
    let mut checked = 0;
    for (q, kv) in configs {
        for world in WORLDS {
            if qkv_valid(q, kv, world) {
                qkv_case(q, kv, world);
                checked += 1;
            } else {
                let result = MergedColumnSpec::qkv("qkv_proj", 16, 4, q, kv, world);
                let word = if q % world != 0 {
                    "q_heads"
                } else {
                    "kv_heads"
                };
                expect_error(
                    result,
                    "merged-column-parallel 'qkv_proj'",
                    &[word, &format!("world {world}")],
                );
            }
        }
    }
    // The cases the issue names are among the valid ones.
    for (q, kv, world) in [
        (64, 8, 8),
        (32, 8, 2),
        (32, 8, 4),
        (32, 8, 8),
        (8, 2, 4),
        (8, 2, 8),
    ] {
        assert!(qkv_valid(q, kv, world), "{q}/{kv} at {world}");
    }
    assert!(checked > 20, "{checked}");
}

/// Value heads of another size than query and key heads (`v_head_dim` 6, `head_dim` 4):
/// the split says where each section is and both head sizes, and each rank's sections are
/// exactly the full output's columns of its heads, for every world the heads allow (split
/// and replicated KV heads). The same layer built from named sections has the same spec.
#[test]
fn qkv_with_another_v_head_dim_has_the_real_split() {
    let (hidden, head_dim, v_head_dim) = (16, 4, 6);
    for (q_heads, kv_heads) in [(8, 2), (16, 4), (8, 8)] {
        let (q_rows, k_rows, v_rows) = (
            q_heads * head_dim,
            kv_heads * head_dim,
            kv_heads * v_head_dim,
        );
        let out = q_rows + k_rows + v_rows;
        let seed = (q_heads * 10 + kv_heads) as u64;
        let x = random::<f32>(seed, M * hidden);
        let w = random::<f32>(seed + 1, out * hidden);
        let b = random::<f32>(seed + 2, out);
        let full = gemm_f64(&x, &w, Some(&b), None, M, out, hidden);
        for world in WORLDS.filter(|&w| qkv_valid(q_heads, kv_heads, w)) {
            let label = format!("q {q_heads} / kv {kv_heads} at W={world}");
            let spec = MergedColumnSpec::qkv_with_v_head_dim(
                "attn.qkv_proj",
                hidden,
                head_dim,
                v_head_dim,
                q_heads,
                kv_heads,
                world,
            )
            .unwrap();
            assert_eq!(spec.out_features(), out, "{label}");
            let split = spec.qkv_split().expect("a QKV layer has a split");
            let (q_per, kv_per) = (q_heads / world, (kv_heads / world).max(1));
            assert_eq!((split.head_dim, split.v_head_dim), (head_dim, v_head_dim));
            assert_eq!((split.q_heads, split.kv_heads), (q_per, kv_per), "{label}");
            assert_eq!(split.q, 0..q_per * head_dim, "{label}");
            assert_eq!(
                split.k,
                split.q.end..split.q.end + kv_per * head_dim,
                "{label}"
            );
            assert_eq!(
                split.v,
                split.k.end..split.k.end + kv_per * v_head_dim,
                "{label}"
            );
            assert_eq!(split.width(), spec.out_per_rank(), "{label}");

            // The same layer from named sections: the same spec, the same split.
            let section = |name: &str, heads, head_dim, replicate| Section {
                name: name.to_string(),
                heads,
                head_dim,
                replicate,
            };
            let from_sections = MergedColumnSpec::new(
                "attn.qkv_proj",
                hidden,
                vec![
                    section("q", q_heads, head_dim, false),
                    section("k", kv_heads, head_dim, true),
                    section("v", kv_heads, v_head_dim, true),
                ],
                world,
            )
            .unwrap();
            assert_eq!(from_sections, spec, "{label}");
            assert_eq!(from_sections.qkv_split(), Some(split.clone()), "{label}");

            let n = spec.out_per_rank();
            for r in 0..world {
                let ws = spec
                    .shard_weight(r, HostWeight::new(&w, out, hidden))
                    .unwrap();
                let bs = spec.shard_bias(r, &b).unwrap();
                let y = gemm_f64(&x, &ws, Some(&bs), None, M, n, hidden);
                let (q, k) = (spec.heads_of(0, r).unwrap(), spec.heads_of(1, r).unwrap());
                assert_eq!(spec.heads_of(2, r).unwrap(), k, "{label}");
                let want = |offset: usize, dim: usize, heads: Range<usize>| {
                    columns(
                        &full,
                        out,
                        offset + heads.start * dim..offset + heads.end * dim,
                    )
                };
                assert_eq!(
                    columns(&y, n, split.q.clone()),
                    want(0, head_dim, q),
                    "{label} q"
                );
                assert_eq!(
                    columns(&y, n, split.k.clone()),
                    want(q_rows, head_dim, k.clone()),
                    "{label} k"
                );
                assert_eq!(
                    columns(&y, n, split.v.clone()),
                    want(q_rows + k_rows, v_head_dim, k),
                    "{label} v"
                );
            }
        }
    }
    expect_error(
        MergedColumnSpec::qkv_with_v_head_dim("attn.qkv_proj", 16, 4, 0, 8, 2, 2),
        "merged-column-parallel 'attn.qkv_proj'",
        &["v_head_dim is 0"],
    );
    // Sections not named q, k, v (or of another structure) are not a QKV layer.
    let section = |name: &str, head_dim| Section {
        name: name.to_string(),
        heads: 4,
        head_dim,
        replicate: false,
    };
    let qkv_named = |names: [&str; 3], dims: [usize; 3]| {
        MergedColumnSpec::new(
            "m",
            8,
            names.iter().zip(dims).map(|(n, d)| section(n, d)).collect(),
            2,
        )
        .unwrap()
        .qkv_split()
    };
    assert!(qkv_named(["q", "k", "v"], [4, 4, 6]).is_some());
    assert!(qkv_named(["q", "v", "k"], [4, 4, 6]).is_none());
    assert!(qkv_named(["q", "k", "v"], [4, 2, 2]).is_none()); // q and k heads differ
}

#[test]
fn kv_heads_are_replicated_on_consecutive_ranks() {
    // 8 q / 2 kv at W = 8: ranks 0-3 hold KV head 0, ranks 4-7 KV head 1.
    let spec = MergedColumnSpec::qkv("qkv", 64, 8, 8, 2, 8).unwrap();
    let heads: Vec<Range<usize>> = (0..8).map(|r| spec.heads_of(1, r).unwrap()).collect();
    assert_eq!(heads, vec![0..1, 0..1, 0..1, 0..1, 1..2, 1..2, 1..2, 1..2]);
    assert_eq!(spec.replicas(1), 4);
    // At W = 4: two ranks each.
    let spec = MergedColumnSpec::qkv("qkv", 64, 8, 8, 2, 4).unwrap();
    let heads: Vec<Range<usize>> = (0..4).map(|r| spec.heads_of(2, r).unwrap()).collect();
    assert_eq!(heads, vec![0..1, 0..1, 1..2, 1..2]);
    // Llama-3-70B at TP-8: one KV head per rank, 8 q heads per rank.
    let spec = MergedColumnSpec::qkv("qkv", 8192, 128, 64, 8, 8).unwrap();
    assert_eq!(spec.out_per_rank(), 1280); // the DESIGN reference shape
    spec.check_gemm_dims().unwrap();
    assert_eq!(spec.replicas(1), 1);
}

// ---------------------------------------------------------------------------------------
// Megatron's interleaved QKV.
// ---------------------------------------------------------------------------------------

/// A hand-built Megatron QKV: 4 query heads and 2 KV heads, q/k heads of 2 rows, v heads of
/// 1 row, hidden 2. Row `i` of head `h` of section q/k/v holds `[c, -c]` with
/// `c = 100·section + 10·h + i` (section 1, 2, 3), so every row says where it belongs.
#[test]
fn megatron_qkv_converts_to_the_stacked_layout() {
    let spec = MergedColumnSpec::qkv_with_v_head_dim("attn.qkv_proj", 2, 2, 1, 4, 2, 2).unwrap();
    let rows = |codes: &[i32]| -> Vec<i32> { codes.iter().flat_map(|&c| [c, -c]).collect() };
    #[rustfmt::skip]
    let megatron = rows(&[
        // KV group 0: q heads 0 and 1, k_0, v_0.
        110, 111, 120, 121, 200, 201, 300,
        // KV group 1: q heads 2 and 3, k_1, v_1.
        130, 131, 140, 141, 210, 211, 310,
    ]);
    #[rustfmt::skip]
    let stacked = rows(&[
        110, 111, 120, 121, 130, 131, 140, 141, // q
        200, 201, 210, 211, // k
        300, 310, // v
    ]);
    assert_eq!(spec.out_features(), 14);
    let got = qkv_from_megatron(&spec, HostWeight::new(&megatron, 14, 2)).unwrap();
    assert_eq!(got, stacked);
    // The bias: one element a row.
    let bias: Vec<i32> = megatron.iter().step_by(2).copied().collect();
    let want: Vec<i32> = stacked.iter().step_by(2).copied().collect();
    assert_eq!(qkv_bias_from_megatron(&spec, &bias).unwrap(), want);
    // Rank 1 of 2 then holds q heads 2, 3, k_1 and v_1.
    let shard = spec.shard_weight(1, HostWeight::new(&got, 14, 2)).unwrap();
    assert_eq!(shard, rows(&[130, 131, 140, 141, 210, 211, 310]));

    // Errors name the layer.
    let label = "merged-column-parallel 'attn.qkv_proj'";
    expect_error(
        qkv_from_megatron(&spec, HostWeight::new(&megatron, 2, 14)),
        label,
        &[
            "the Megatron QKV weight",
            "expected [out_features, in_features] = [14, 2]",
            "transposed?",
        ],
    );
    expect_error(
        qkv_from_megatron(&spec, HostWeight::new(&megatron[2..], 14, 2)),
        label,
        &["holds 26 elements"],
    );
    expect_error(
        qkv_bias_from_megatron(&spec, &bias[1..]),
        label,
        &["the host bias holds 13"],
    );
    let gate_up = MergedColumnSpec::gate_up("mlp.gate_up_proj", 2, 8, 2).unwrap();
    expect_error(
        qkv_from_megatron(&gate_up, HostWeight::new(&[0i32; 32], 16, 2)),
        "merged-column-parallel 'mlp.gate_up_proj'",
        &["not a QKV layer"],
    );
    let section = |name: &str, heads| Section {
        name: name.to_string(),
        heads,
        head_dim: 1,
        replicate: false,
    };
    let odd = MergedColumnSpec::new(
        "qkv",
        2,
        vec![section("q", 6), section("k", 4), section("v", 4)],
        2,
    )
    .unwrap();
    expect_error(
        qkv_from_megatron(&odd, HostWeight::new(&[0i32; 28], 14, 2)),
        "merged-column-parallel 'qkv'",
        &["q heads 6 are not whole groups of kv heads 4"],
    );
}

/// Megatron's layout built independently (head by head, from the stacked weight) for real
/// GQA shapes (value heads of the same and of another size): the conversion gives the
/// stacked weight back.
#[test]
fn megatron_qkv_round_trips_for_gqa_shapes() {
    let hidden = 8;
    for (q_heads, kv_heads, head_dim, v_head_dim) in
        [(8, 2, 4, 4), (8, 8, 2, 2), (16, 4, 4, 2), (4, 1, 2, 3)]
    {
        let spec = MergedColumnSpec::qkv_with_v_head_dim(
            "qkv", hidden, head_dim, v_head_dim, q_heads, kv_heads, 1,
        )
        .unwrap();
        let out = spec.out_features();
        let stacked = random::<f32>((q_heads * kv_heads) as u64, out * hidden);
        let (q_rows, k_rows) = (q_heads * head_dim, kv_heads * head_dim);
        let head = |first_row: usize, dim: usize, h: usize| {
            let start = (first_row + h * dim) * hidden;
            &stacked[start..start + dim * hidden]
        };
        let group = q_heads / kv_heads;
        let mut megatron = Vec::new();
        for g in 0..kv_heads {
            for h in g * group..(g + 1) * group {
                megatron.extend_from_slice(head(0, head_dim, h));
            }
            megatron.extend_from_slice(head(q_rows, head_dim, g));
            megatron.extend_from_slice(head(q_rows + k_rows, v_head_dim, g));
        }
        // With one KV group the two layouts coincide; with more they differ.
        assert_eq!(
            megatron == stacked,
            kv_heads == 1,
            "q {q_heads} / kv {kv_heads}"
        );
        let got = qkv_from_megatron(&spec, HostWeight::new(&megatron, out, hidden)).unwrap();
        assert_eq!(got, stacked, "q {q_heads} / kv {kv_heads}");
    }
}

// ---------------------------------------------------------------------------------------
// Merged gate_up and the row-parallel down projection: the MLP.
// ---------------------------------------------------------------------------------------

#[test]
fn gate_up_shards_match_the_full_projection() {
    let (hidden, inter) = (16, 840);
    let x = random::<f32>(70, M * hidden);
    let w = random::<f32>(71, 2 * inter * hidden);
    let full = gemm_f64(&x, &w, None, None, M, 2 * inter, hidden);
    for world in WORLDS {
        let spec = MergedColumnSpec::gate_up("gate_up_proj", hidden, inter, world).unwrap();
        let split = spec.gate_up_split().unwrap();
        assert!(spec.qkv_split().is_none());
        let per = inter / world;
        assert_eq!(
            (split.gate.clone(), split.up.clone()),
            (0..per, per..2 * per)
        );
        let mut gates = Vec::new();
        let mut ups = Vec::new();
        for r in 0..world {
            let ws = spec
                .shard_weight(r, HostWeight::new(&w, 2 * inter, hidden))
                .unwrap();
            let y = gemm_f64(&x, &ws, None, None, M, 2 * per, hidden);
            assert_eq!(
                spec.rows(r).unwrap(),
                vec![
                    r * per..(r + 1) * per,
                    inter + r * per..inter + (r + 1) * per
                ]
            );
            gates.push(columns(&y, 2 * per, split.gate.clone()));
            ups.push(columns(&y, 2 * per, split.up.clone()));
        }
        assert_eq!(
            concat_columns(&gates, M),
            columns(&full, 2 * inter, 0..inter)
        );
        assert_eq!(
            concat_columns(&ups, M),
            columns(&full, 2 * inter, inter..2 * inter)
        );
    }
}

#[test]
fn a_tensor_parallel_mlp_equals_the_unsharded_mlp() {
    let (hidden, inter) = (24, 840);
    let x = random::<f32>(80, M * hidden);
    let gate_up = random::<f32>(81, 2 * inter * hidden);
    let down = random::<f32>(82, hidden * inter);
    let bias = random::<f32>(83, hidden);
    let want = gated_mlp_f64(&x, &gate_up, &down, Some(&bias), M, hidden, inter);
    for world in WORLDS {
        let gu = MergedColumnSpec::gate_up("mlp.gate_up_proj", hidden, inter, world).unwrap();
        let dn = RowParallelSpec::new("mlp.down_proj", inter, hidden, world).unwrap();
        let per = inter / world;
        let mut sum = vec![0.0f64; M * hidden];
        for r in 0..world {
            // Rank r: [gate_r | up_r] -> SiLU(gate_r)·up_r = columns r·per.. of the full
            // activation, which is exactly the input columns its down shard takes.
            let h = gemm_f64(
                &x,
                &gu.shard_weight(r, HostWeight::new(&gate_up, 2 * inter, hidden))
                    .unwrap(),
                None,
                None,
                M,
                2 * per,
                hidden,
            );
            let act = silu_mul_f64(&h, per);
            assert_eq!(dn.columns(r).unwrap(), r * per..(r + 1) * per);
            let wr: Vec<f64> = dn
                .shard_weight(r, HostWeight::new(&down, hidden, inter))
                .unwrap()
                .iter()
                .map(|v| f64::from(*v))
                .collect();
            let partial = gemm_f64_wide(&act, &wr, None, M, hidden, per);
            for (s, p) in sum.iter_mut().zip(partial) {
                *s += p;
            }
        }
        for (i, s) in sum.iter_mut().enumerate() {
            *s += f64::from(bias[i % hidden]);
        }
        let err = sum
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-12, "world {world}: {err:e}");
    }
}

// ---------------------------------------------------------------------------------------
// The reference helpers.
// ---------------------------------------------------------------------------------------

#[test]
fn silu_mul_rms_norm_and_wide_gemm_references() {
    // SiLU(0) = 0, SiLU(g) -> g for large g, SiLU(-g) -> 0.
    let gu = [0.0, 50.0, 1.0, 3.0, 2.0, -1.0]; // one row, width 3: [gate | up]
    let act = silu_mul_f64(&gu, 3);
    assert_eq!(act[0], 0.0);
    assert!((act[1] - 100.0).abs() < 1e-12);
    let silu1 = 1.0 / (1.0 + (-1.0f64).exp());
    assert!((act[2] - -silu1).abs() < 1e-15);

    // RMSNorm of [3, 4]: mean square 12.5.
    let out = rms_norm_f64(&[3.0, 4.0], &[1.0f32, 2.0], 0.0);
    let r = 12.5f64.sqrt();
    assert_eq!(out, vec![3.0 / r, 8.0 / r]);

    // The wide GEMM is gemm_f64 on f64 inputs.
    let a = random::<f32>(90, 3 * 16);
    let b = random::<f32>(91, 8 * 16);
    let bias = random::<f32>(92, 8);
    let wide = |v: &[f32]| v.iter().map(|x| f64::from(*x)).collect::<Vec<f64>>();
    assert_eq!(
        gemm_f64_wide(&wide(&a), &wide(&b), Some(&wide(&bias)), 3, 8, 16),
        gemm_f64(&a, &b, Some(&bias), None, 3, 8, 16)
    );

    // The MLP: hidden 1, intermediate 1, x = 2, gate weight 1, up weight 3, down 0.5, b 1:
    // y = SiLU(2) · 6 · 0.5 + 1.
    let y = gated_mlp_f64(&[2.0f32], &[1.0, 3.0], &[0.5], Some(&[1.0]), 1, 1, 1);
    let silu2 = 2.0 / (1.0 + (-2.0f64).exp());
    assert!((y[0] - (silu2 * 3.0 + 1.0)).abs() < 1e-12, "{y:?}");
}

// ---------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------

#[test]
fn the_issue_example_error_reads_as_written() {
    let err = RowParallelSpec::new("layers.0.mlp.down_proj", 14336, 4096, 6).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument `row-parallel 'layers.0.mlp.down_proj'`: in_features 14336 is not \
         divisible by world 6"
    );
    let (arg, _) = invalid(err);
    assert_eq!(
        arg,
        describe(LayerKind::RowParallel, "layers.0.mlp.down_proj")
    );
}

#[test]
fn divisibility_errors_name_the_layer() {
    let col = "column-parallel 'lm_head'";
    for world in [3, 6, 7] {
        expect_error(
            ColumnParallelSpec::new("lm_head", 64, 1000, world),
            col,
            &[&format!(
                "out_features 1000 is not divisible by world {world}"
            )],
        );
    }
    // A column-parallel layer does not split its input: in_features need not divide.
    ColumnParallelSpec::new("lm_head", 1001, 1000, 8).unwrap();
    // A row-parallel layer does not split its output.
    RowParallelSpec::new("o", 1000, 1001, 8).unwrap();
    expect_error(
        RowParallelSpec::new("o", 1001, 1000, 2),
        "row-parallel 'o'",
        &["in_features 1001 is not divisible by world 2"],
    );
    let gu = "merged-column-parallel 'mlp.gate_up_proj'";
    expect_error(
        MergedColumnSpec::gate_up("mlp.gate_up_proj", 64, 1000, 3),
        gu,
        &["intermediate_size 1000 is not divisible by world 3"],
    );
}

#[test]
fn head_errors_name_the_layer() {
    let qkv = "merged-column-parallel 'attn.qkv_proj'";
    let spec = |q, kv, world| MergedColumnSpec::qkv("attn.qkv_proj", 64, 8, q, kv, world);
    // Query heads not divisible by the world.
    expect_error(
        spec(12, 4, 8),
        qkv,
        &["q_heads 12 is not divisible by world 8"],
    );
    expect_error(spec(30, 6, 4), qkv, &["q_heads 30", "world 4"]);
    // Query heads not whole groups of KV heads.
    expect_error(
        spec(8, 3, 2),
        qkv,
        &["q_heads 8 is not a multiple of kv_heads 3"],
    );
    // KV heads neither dividing nor divisible by the world.
    expect_error(spec(24, 6, 4), qkv, &["kv_heads 6", "world 4", "neither"]);
    expect_error(spec(24, 3, 2), qkv, &["kv_heads 3", "world 2"]);
    expect_error(spec(12, 4, 6), qkv, &["kv_heads 4", "world 6"]);
    // 3 KV heads at W = 6 divide the world: replicated, valid.
    spec(12, 3, 6).unwrap();
    // Zero heads, head_dim, hidden, world.
    expect_error(spec(0, 1, 1), qkv, &["q_heads is 0"]);
    expect_error(spec(8, 0, 1), qkv, &["kv_heads is 0"]);
    expect_error(
        MergedColumnSpec::qkv("attn.qkv_proj", 64, 0, 8, 8, 1),
        qkv,
        &["head_dim is 0"],
    );
    expect_error(
        MergedColumnSpec::qkv("attn.qkv_proj", 0, 8, 8, 8, 1),
        qkv,
        &["hidden is 0"],
    );
    expect_error(spec(8, 8, 0), qkv, &["world 0"]);
}

#[test]
fn zero_sizes_are_errors() {
    expect_error(
        ColumnParallelSpec::new("c", 0, 8, 1),
        "column-parallel 'c'",
        &["in_features is 0"],
    );
    expect_error(
        ColumnParallelSpec::new("c", 8, 0, 1),
        "column-parallel 'c'",
        &["out_features is 0"],
    );
    expect_error(
        ColumnParallelSpec::new("c", 8, 8, 0),
        "column-parallel 'c'",
        &["world 0"],
    );
    expect_error(
        RowParallelSpec::new("r", 0, 8, 1),
        "row-parallel 'r'",
        &["in_features is 0"],
    );
    expect_error(
        RowParallelSpec::new("r", 8, 8, 0),
        "row-parallel 'r'",
        &["world 0"],
    );
    expect_error(
        MergedColumnSpec::gate_up("g", 8, 0, 1),
        "merged-column-parallel 'g'",
        &["intermediate_size is 0"],
    );
    expect_error(
        ColumnParallelSpec::new("huge", usize::MAX / 2, 4, 1),
        "column-parallel 'huge'",
        &["overflows"],
    );
}

#[test]
fn host_slices_of_the_wrong_length_are_errors() {
    let col = ColumnParallelSpec::new("c", 8, 16, 2).unwrap();
    expect_error(
        col.shard_weight(0, HostWeight::new(&[0.0f32; 127], 16, 8)),
        "column-parallel 'c'",
        &["the host weight holds 127 elements", "[16, 8]", "128"],
    );
    // A weight one row short, declared as such: the wrong shape.
    expect_error(
        col.shard_weight(1, HostWeight::new(&[0.0f32; 120], 15, 8)),
        "column-parallel 'c'",
        &["expected [out_features, in_features] = [16, 8], got [15, 8]"],
    );
    expect_error(
        col.shard_bias(0, &[0.0f32; 8]),
        "column-parallel 'c'",
        &["the host bias holds 8 elements", "16"],
    );

    let row = RowParallelSpec::new("r", 16, 8, 2).unwrap();
    expect_error(
        row.shard_weight(0, HostWeight::new(&[0u8; 129], 8, 16)),
        "row-parallel 'r'",
        &["the host weight holds 129"],
    );
    // A row-parallel bias is whole: a sharded one is wrong.
    expect_error(
        row.check_bias(&[0u8; 4]),
        "row-parallel 'r'",
        &["the host bias holds 4", "whole on every rank"],
    );
    row.check_bias(&[0u8; 8]).unwrap();

    let qkv = MergedColumnSpec::qkv("qkv", 8, 2, 4, 2, 2).unwrap();
    let label = "merged-column-parallel 'qkv'";
    assert_eq!(qkv.out_features(), 16);
    expect_error(
        qkv.shard_weight(0, HostWeight::new(&[0u8; 16 * 8 - 1], 16, 8)),
        label,
        &["the host weight holds 127", "[16, 8]"],
    );
    expect_error(
        qkv.shard_bias(0, &[0u8; 15]),
        label,
        &["the host bias holds 15"],
    );
    let (q, kv) = (vec![0u8; 8 * 8], vec![0u8; 4 * 8]);
    let (wq, wkv) = (HostWeight::new(&q, 8, 8), HostWeight::new(&kv, 4, 8));
    qkv.shard_weight_parts(1, &[wq, wkv, wkv]).unwrap();
    expect_error(
        qkv.shard_weight_parts(0, &[wq, wkv]),
        label,
        &["2 host weight parts given for 3 sections"],
    );
    expect_error(
        qkv.shard_weight_parts(0, &[wq, wkv, HostWeight::new(&kv[1..], 4, 8)]),
        label,
        &["section 'v'", "holds 31"],
    );
    expect_error(
        qkv.shard_bias_parts(0, &[&q[..8], &kv[..4], &kv[..3]]),
        label,
        &["section 'v'", "holds 3"],
    );
}

/// The issue's case: an o_proj `[4096, 3584]` (out, in) given as `[3584, 4096]` has the
/// right element count and was accepted before shapes were checked; now every loader
/// refuses it, naming the layer, the expected and the given shape.
#[test]
fn transposed_weights_are_refused_naming_the_layer() {
    let (out, inp) = (4096, 3584);
    let data = vec![0u8; out * inp];
    let transposed = HostWeight::new(&data, inp, out);
    let row = RowParallelSpec::new("layers.0.self_attn.o_proj", inp, out, 4).unwrap();
    let err = row.shard_weight(0, transposed).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument `row-parallel 'layers.0.self_attn.o_proj'`: the host weight: \
         expected [out_features, in_features] = [4096, 3584], got [3584, 4096] (transposed?)"
    );
    row.shard_weight(0, HostWeight::new(&data, out, inp))
        .unwrap();
    // The same data in the layer's shape is taken.
    let col = ColumnParallelSpec::new("lm_head", inp, out, 4).unwrap();
    expect_error(
        col.shard_weight(3, transposed),
        "column-parallel 'lm_head'",
        &[
            "expected [out_features, in_features] = [4096, 3584]",
            "got [3584, 4096]",
            "transposed?",
        ],
    );
    // Another wrong shape with the same count is not called transposed.
    let (a, b) = (out * 2, inp / 2);
    let err = col
        .shard_weight(0, HostWeight::new(&data, a, b))
        .unwrap_err();
    let (_, reason) = invalid(err);
    assert!(
        reason.contains("got [8192, 1792]") && !reason.contains("transposed"),
        "{reason}"
    );

    // Merged: the whole weight, and one section (k_proj of Llama-3-8B, [1024, 4096]).
    let qkv = MergedColumnSpec::qkv("layers.0.self_attn.qkv_proj", 4096, 128, 32, 8, 4).unwrap();
    let label = "merged-column-parallel 'layers.0.self_attn.qkv_proj'";
    let full = vec![0u8; qkv.out_features() * 4096];
    expect_error(
        qkv.shard_weight(0, HostWeight::new(&full, 4096, qkv.out_features())),
        label,
        &[
            "expected [out_features, in_features] = [6144, 4096]",
            "got [4096, 6144]",
            "transposed?",
        ],
    );
    let (q, kv) = (vec![0u8; 4096 * 4096], vec![0u8; 1024 * 4096]);
    let wq = HostWeight::new(&q, 4096, 4096);
    let wkv = HostWeight::new(&kv, 1024, 4096);
    let k_t = HostWeight::new(&kv, 4096, 1024);
    qkv.shard_weight_parts(1, &[wq, wkv, wkv]).unwrap();
    expect_error(
        qkv.shard_weight_parts(1, &[wq, k_t, wkv]),
        label,
        &[
            "the host weight of section 'k'",
            "expected [heads · head_dim, in_features] = [1024, 4096], got [4096, 1024] \
             (transposed?)",
        ],
    );
    expect_error(
        qkv.section_shard_weight(1, 2, k_t),
        label,
        &["section 'v'", "transposed?"],
    );
}

#[test]
fn ranks_out_of_range_are_errors() {
    let col = ColumnParallelSpec::new("c", 8, 16, 2).unwrap();
    expect_error(
        col.rows(2),
        "column-parallel 'c'",
        &["rank 2 is out of range for world 2"],
    );
    expect_error(
        col.shard_weight(5, HostWeight::new(&[0u8; 128], 16, 8)),
        "column-parallel 'c'",
        &["rank 5"],
    );
    let row = RowParallelSpec::new("r", 16, 8, 4).unwrap();
    expect_error(row.columns(4), "row-parallel 'r'", &["rank 4"]);
    let qkv = MergedColumnSpec::qkv("qkv", 8, 2, 4, 2, 2).unwrap();
    expect_error(qkv.rows(2), "merged-column-parallel 'qkv'", &["rank 2"]);
    expect_error(
        qkv.heads_of(3, 0),
        "merged-column-parallel 'qkv'",
        &["section 3 does not exist"],
    );
}

#[test]
fn gemm_dimension_errors_name_the_layer() {
    // 840 / 8 = 105 rows a rank: not a multiple of 8.
    let col = ColumnParallelSpec::new("lm_head", 64, 840, 8).unwrap();
    expect_error(
        col.check_gemm_dims(),
        "column-parallel 'lm_head'",
        &["out_features / world 105", "multiple of 8"],
    );
    ColumnParallelSpec::new("lm_head", 64, 840, 7)
        .unwrap()
        .check_gemm_dims()
        .unwrap();
    expect_error(
        ColumnParallelSpec::new("c", 20, 16, 2)
            .unwrap()
            .check_gemm_dims(),
        "column-parallel 'c'",
        &["in_features 20"],
    );
    expect_error(
        RowParallelSpec::new("r", 40, 16, 2)
            .unwrap()
            .check_gemm_dims(),
        "row-parallel 'r'",
        &["in_features / world 20"],
    );
    expect_error(
        RowParallelSpec::new("r", 32, 12, 2)
            .unwrap()
            .check_gemm_dims(),
        "row-parallel 'r'",
        &["out_features 12"],
    );
    // 4 q heads of 4 + 2 · 1 kv head of 4 a rank: 24 rows, fine; with head_dim 2, 12 are not.
    MergedColumnSpec::qkv("qkv", 8, 4, 8, 2, 2)
        .unwrap()
        .check_gemm_dims()
        .unwrap();
    expect_error(
        MergedColumnSpec::qkv("qkv", 8, 2, 8, 2, 2)
            .unwrap()
            .check_gemm_dims(),
        "merged-column-parallel 'qkv'",
        &["out_per_rank 12"],
    );
    // The DESIGN reference shapes at TP-8 all pass.
    MergedColumnSpec::gate_up("gate_up", 8192, 28672, 8)
        .unwrap()
        .check_gemm_dims()
        .unwrap();
    RowParallelSpec::new("down", 28672, 8192, 8)
        .unwrap()
        .check_gemm_dims()
        .unwrap();
    RowParallelSpec::new("o_proj", 8192, 8192, 8)
        .unwrap()
        .check_gemm_dims()
        .unwrap();
}

#[test]
fn general_sections_are_checked() {
    let label = "merged-column-parallel 'm'";
    let section = |name: &str, heads, head_dim, replicate| Section {
        name: name.to_string(),
        heads,
        head_dim,
        replicate,
    };
    expect_error(
        MergedColumnSpec::new("m", 8, vec![], 2),
        label,
        &["no sections"],
    );
    expect_error(
        MergedColumnSpec::new("m", 8, vec![section("a", 3, 8, false)], 2),
        label,
        &["section 'a'", "3 heads are not divisible by world 2"],
    );
    expect_error(
        MergedColumnSpec::new("m", 8, vec![section("a", 3, 8, true)], 2),
        label,
        &["section 'a'", "neither"],
    );
    expect_error(
        MergedColumnSpec::new("m", 8, vec![section("a", 2, 0, true)], 2),
        label,
        &["section 'a': head_dim is 0"],
    );
    // A replicated section with one head on 4 ranks; a split one of 8 heads.
    let spec = MergedColumnSpec::new(
        "m",
        8,
        vec![section("a", 8, 2, false), section("b", 1, 4, true)],
        4,
    )
    .unwrap();
    assert_eq!(spec.out_per_rank(), 2 * 2 + 4);
    assert_eq!(spec.section_columns(1), 4..8);
    assert_eq!(spec.rows(3).unwrap(), vec![12..16, 16..20]);
    assert!(spec.qkv_split().is_none() && spec.gate_up_split().is_none());
    assert_eq!(spec.replicas(1), 4);
}

/// vLLM's split where it has one: the vocabulary padded to a multiple of 64, divided by the
/// world size when that divides it (`None` otherwise: vLLM refuses).
fn vllm_rows_per_rank(vocab: usize, world: usize) -> Option<usize> {
    let padded = vocab.div_ceil(64) * 64;
    (padded % world == 0).then_some(padded / world)
}

#[test]
fn vocab_padding_rule_and_the_ranks_rows() {
    // Real vocabularies: Llama 2 and 3, Qwen2, Gemma, Mistral, GPT-2; and small ones.
    let vocabs = [
        32_000, 128_256, 151_936, 256_000, 32_768, 50_257, 1, 63, 64, 65, 1000,
    ];
    for vocab in vocabs {
        for world in WORLDS {
            let spec = VocabParallelSpec::new("embed", vocab, 64, world).unwrap();
            let (padded, p) = (spec.padded_vocab(), spec.rows_per_rank());
            let label = format!("vocab {vocab} world {world}");
            assert_eq!(padded % (VOCAB_PADDING * world), 0, "{label}");
            assert!(
                padded >= vocab && padded - vocab < VOCAB_PADDING * world,
                "{label}"
            );
            assert_eq!(p * world, padded, "{label}");
            // The same split as vLLM's wherever vLLM's pads to a multiple of 64·W.
            if vocab.div_ceil(64) % world == 0 {
                assert_eq!(vllm_rows_per_rank(vocab, world), Some(p), "{label}");
            }
            // The ranks' rows tile the padded table; the real ones tile the vocabulary, and a
            // shard is its real rows then zeros.
            let spec8 = VocabParallelSpec::new("embed", vocab, 8, world).unwrap();
            let full8: Vec<u32> = (1..=(vocab as u32 * 8)).collect(); // [vocab, 8], no zero
            let mut next = 0;
            for r in 0..world {
                let rows = spec.rows(r).unwrap();
                let valid = spec.valid_rows(r).unwrap();
                assert_eq!(rows, r * p..(r + 1) * p, "{label} rank {r}");
                assert_eq!(valid.start, next.min(vocab), "{label} rank {r}");
                assert!(
                    valid.end <= vocab && valid.end <= rows.end,
                    "{label} rank {r}"
                );
                next = rows.end;
                let shard = spec8
                    .shard_table(r, HostWeight::new(&full8, vocab, 8))
                    .unwrap();
                assert_eq!(shard.len(), p * 8, "{label} rank {r}");
                let real = valid.len() * 8;
                assert_eq!(
                    shard[..real],
                    full8[valid.start * 8..valid.end * 8],
                    "{label} rank {r}"
                );
                assert!(
                    shard[real..].iter().all(|&x| x == 0),
                    "{label} rank {r}: padding"
                );
            }
            assert_eq!(spec.valid_rows(world - 1).unwrap().end, vocab, "{label}");
        }
    }
    // Llama 3 on 8 ranks, as the docs state it.
    let llama3 = VocabParallelSpec::new("lm_head", 128_256, 4096, 8).unwrap();
    assert_eq!(
        (llama3.padded_vocab(), llama3.rows_per_rank()),
        (128_512, 16_064)
    );
    assert_eq!(vllm_rows_per_rank(128_256, 8), Some(16_032));
}

#[test]
fn vocab_spec_errors_name_the_layer() {
    let label = "vocab-parallel 'embed'";
    assert_eq!(describe(LayerKind::VocabParallel, "embed"), label);
    expect_error(
        VocabParallelSpec::new("embed", 0, 64, 2),
        label,
        &["vocab is 0"],
    );
    expect_error(
        VocabParallelSpec::new("embed", 100, 0, 2),
        label,
        &["hidden is 0"],
    );
    expect_error(
        VocabParallelSpec::new("embed", 100, 64, 0),
        label,
        &["world 0"],
    );
    expect_error(
        VocabParallelSpec::new("embed", 100, 60, 2),
        label,
        &["hidden 60", "multiple of 8"],
    );
    expect_error(
        VocabParallelSpec::new("embed", (1 << 32) + 1, 8, 2),
        label,
        &["2^32 rows"],
    );
    let spec = VocabParallelSpec::new("embed", 100, 8, 2).unwrap();
    expect_error(spec.rows(2), label, &["rank 2", "world 2"]);
    let table = vec![0u8; 100 * 8];
    expect_error(
        spec.shard_table(0, HostWeight::new(&table, 8, 100)),
        label,
        &["transposed?"],
    );
    expect_error(
        spec.shard_table(0, HostWeight::new(&table[1..], 100, 8)),
        label,
        &["holds 799"],
    );
}
