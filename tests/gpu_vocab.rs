//! GPU tests of the vocabulary-parallel layers ([`VocabParallelEmbedding`],
//! [`ParallelLMHead`]; feature `gpu-tests`, or `emulator` on the CPU; with neither every test
//! here is listed as ignored), on virtual ranks of GPU 0, with vocabularies that need padding
//! (a rank may hold padding only).
//!
//! - The embedding gives every rank the table's rows of the tokens, bit for bit (signed zeros
//!   planted in the table), from host ids and from device ids.
//! - An id past the vocabulary: from the host, an error naming the layer and the position,
//!   with nothing launched (the output keeps its poison); from the device, a row of NaN on
//!   every rank, the other rows still right.
//! - The LM head's gathered logits `[m, vocab]`: within the DESIGN.md tolerance of the f64
//!   reference, and bit for bit each rank's real columns of `forward`; no padding column in
//!   them, and each rank's padding columns zero.
//! - A tied LM head shares the embedding's device table and gives the bits of an untied head
//!   loaded from the same tensor.
//! - Wrong shapes and calls are refused naming the layer; a collective over the group's
//!   capacity is refused before anything is copied or launched (outputs keep their poison).

mod common;
use common::assert_same_bits;
use common::gpu::{
    assert_close, assert_poisoned, base_seed, expect_invalid_saying, mix_seed, random_vec,
    splitmix64,
};
use common::ranks::{
    check_all, download, gpu, poisoned_ranks, round, upload, upload_copies, virtual_group,
};

use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use half::{bf16, f16};
use std::sync::Arc;
use tpfuse::ops::gemm::GemmElement;
use tpfuse::ops::linear::{ParallelLMHead, VocabParallelEmbedding};
use tpfuse::reference::gemm_f64;
use tpfuse::shard::{HostWeight, VocabParallelSpec};
use tpfuse::{Element, GroupOptions, NcclType, TpGroup};

/// The element types the layers take.
trait TestElement: common::gpu::TestElement + GemmElement + NcclType + Default {}
impl TestElement for bf16 {}
impl TestElement for f16 {}

/// (world, vocab, hidden): padded to 1024 (P 256, rank 3 holds 24 padding rows); to 384
/// (P 128, rank 1 holds 56 padding rows, rank 2 only padding); no padding at all.
const SHAPES: [(usize, usize, usize); 3] = [(4, 1000, 64), (3, 200, 32), (2, 256, 40)];

fn seed_of<T: TestElement>(parts: &[u64]) -> u64 {
    mix_seed(splitmix64(base_seed(0x766f_6361_6200_0013) ^ T::ID), parts)
}

/// A random `[vocab, hidden]` table (±1) with +0.0 and -0.0 planted every 5th element.
fn table<T: TestElement>(seed: u64, vocab: usize, hidden: usize) -> Vec<T> {
    let mut t: Vec<T> = random_vec(seed, vocab * hidden, -1.0, 1.0);
    for (i, x) in t.iter_mut().enumerate().step_by(5) {
        *x = T::from_f32(if i % 2 == 0 { -0.0 } else { 0.0 });
    }
    t
}

/// `m` ids: the first and last token, the first token of every rank's range that is a
/// token, then random ones.
fn ids(spec: &VocabParallelSpec, m: usize, seed: u64) -> Vec<u32> {
    let vocab = spec.vocab();
    let mut ids = vec![0, vocab as u32 - 1];
    for r in 0..spec.world() {
        let rows = spec.valid_rows(r).expect("rank");
        if !rows.is_empty() {
            ids.extend([rows.start as u32, rows.end as u32 - 1]);
        }
    }
    let mut s = seed;
    while ids.len() < m {
        s = splitmix64(s);
        ids.push((s % vocab as u64) as u32);
    }
    ids.truncate(m);
    ids
}

/// The rows of `ids` in `table`.
fn rows_of<T: Copy>(table: &[T], hidden: usize, ids: &[u32]) -> Vec<T> {
    ids.iter()
        .flat_map(|&id| table[id as usize * hidden..(id as usize + 1) * hidden].to_vec())
        .collect()
}

fn spec(world: usize, vocab: usize, hidden: usize) -> VocabParallelSpec {
    VocabParallelSpec::new("model.embed_tokens", vocab, hidden, world).expect("spec")
}

fn embeddings<T: TestElement>(
    groups: &[TpGroup],
    spec: &VocabParallelSpec,
    table: &[T],
) -> Vec<VocabParallelEmbedding<T>> {
    let (v, h) = (spec.vocab(), spec.hidden());
    groups
        .iter()
        .map(|g| {
            VocabParallelEmbedding::from_host(g, spec.clone(), HostWeight::new(table, v, h))
                .expect("embedding")
        })
        .collect()
}

fn embedding_case<T: TestElement>(
    ctx: &Arc<CudaContext>,
    (world, vocab, hidden): (usize, usize, usize),
    m: usize,
) {
    let seed = seed_of::<T>(&[1, world as u64, m as u64]);
    let label = format!(
        "embedding {} W={world} vocab={vocab} m={m} seed={seed:#x}",
        T::NAME
    );
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let spec = spec(world, vocab, hidden);
    let t = table::<T>(seed, vocab, hidden);
    let layers = embeddings(&groups, &spec, &t);
    let ids = ids(&spec, m, splitmix64(seed ^ 7));
    let want = rows_of(&t, hidden, &ids);
    let mut ids_dev: Vec<CudaSlice<u32>> = groups
        .iter()
        .map(|g| g.stream().alloc_zeros(m).expect("alloc"))
        .collect();
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
    round(&groups, &format!("{label} host ids"), |r| {
        layers[r].forward(&groups[r], &ids, &mut ids_dev[r], &mut outs[r])
    });
    for (r, g) in groups.iter().enumerate() {
        assert_same_bits(
            &format!("{label} host ids rank {r}"),
            &download(g, &outs[r]),
            &want,
        );
    }
    // The same ids already on the device (the copies `forward` made).
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * hidden);
    round(&groups, &format!("{label} device ids"), |r| {
        layers[r].forward_device_ids(&groups[r], &ids_dev[r], &mut outs[r])
    });
    for (r, g) in groups.iter().enumerate() {
        assert_same_bits(
            &format!("{label} device ids rank {r}"),
            &download(g, &outs[r]),
            &want,
        );
    }
}

/// `case` for every shape of [`SHAPES`] and every m of `ms`.
fn matrix(ms: [usize; 3], case: impl Fn(&Arc<CudaContext>, (usize, usize, usize), usize)) {
    let gpu = gpu();
    for shape in SHAPES {
        for m in ms {
            case(&gpu.ctx, shape, m);
        }
    }
}

fn out_of_range_ids() {
    let gpu = gpu();
    let (world, vocab, hidden) = SHAPES[0];
    let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
    let spec = spec(world, vocab, hidden);
    let t = table::<bf16>(seed_of::<bf16>(&[2]), vocab, hidden);
    let layers = embeddings(&groups, &spec, &t);
    // From the host: refused before anything runs, naming the layer and the position. The
    // first invalid id is `vocab` itself, a padding row that rank 3 holds.
    let bad = [3u32, vocab as u32, 7];
    for (r, g) in groups.iter().enumerate() {
        let mut ids_dev = g.stream().alloc_zeros::<u32>(bad.len()).expect("alloc");
        let mut out: CudaSlice<bf16> = common::ranks::poisoned(g, bad.len() * hidden);
        expect_invalid_saying(
            &format!("rank {r}"),
            layers[r].forward(g, &bad, &mut ids_dev, &mut out),
            "vocab-parallel 'model.embed_tokens'",
            &["token id 1000", "position 1", "1000 tokens"],
        );
        assert_poisoned(
            &format!("rank {r}: out after a refused call"),
            &download(g, &out),
        );
        assert_eq!(
            download(g, &ids_dev),
            vec![0; 3],
            "rank {r}: ids_dev written"
        );
    }
    // From the device: a NaN row on every rank for the invalid ids, the others right.
    let ids = [3u32, vocab as u32, 999, u32::MAX];
    let ids_dev = upload_copies(&groups, &ids);
    // Filled with 7.0 first: an unwritten row is not a NaN.
    let sevens = vec![bf16::from_f32(7.0); ids.len() * hidden];
    let mut outs = upload_copies(&groups, &sevens);
    round(&groups, "device ids past the vocabulary", |r| {
        layers[r].forward_device_ids(&groups[r], &ids_dev[r], &mut outs[r])
    });
    for (r, g) in groups.iter().enumerate() {
        let got = download(g, &outs[r]);
        for (i, &id) in ids.iter().enumerate() {
            let row = &got[i * hidden..(i + 1) * hidden];
            if (id as usize) < vocab {
                assert_same_bits(
                    &format!("rank {r} token {i}"),
                    row,
                    &rows_of(&t, hidden, &[id]),
                );
            } else {
                // A NaN (which one depends on the hardware's NaN arithmetic in the sum), not
                // a failed collective's marker.
                assert!(
                    row.iter().all(|x| x.is_nan() && !x.is_failed_output()),
                    "rank {r} token {i} (id {id}): {:?}, want NaN",
                    &row[..4]
                );
            }
        }
    }
}

fn lm_head_case<T: TestElement>(
    ctx: &Arc<CudaContext>,
    (world, vocab, hidden): (usize, usize, usize),
    m: usize,
) {
    let seed = seed_of::<T>(&[3, world as u64, m as u64]);
    let label = format!(
        "lm_head {} W={world} vocab={vocab} m={m} seed={seed:#x}",
        T::NAME
    );
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let spec = VocabParallelSpec::new("lm_head", vocab, hidden, world).expect("spec");
    let w = table::<T>(seed, vocab, hidden);
    let x: Vec<T> = random_vec(splitmix64(seed ^ 3), m * hidden, -1.0, 1.0);
    let want = gemm_f64(&x, &w, None, None, m, vocab, hidden);
    let heads: Vec<ParallelLMHead<T>> = groups
        .iter()
        .map(|g| {
            ParallelLMHead::from_host(g, spec.clone(), HostWeight::new(&w, vocab, hidden))
                .expect("head")
        })
        .collect();
    let p = spec.rows_per_rank();
    let xs = upload_copies(&groups, &x);
    let mut local: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * p);
    let mut gathered: Vec<CudaSlice<T>> = poisoned_ranks(&groups, world * m * p);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, m * vocab);
    round(&groups, &label, |r| {
        heads[r].forward_gather(
            &groups[r],
            &xs[r],
            &mut local[r],
            &mut gathered[r],
            &mut outs[r],
        )
    });
    // The real columns of every rank's local logits, side by side, are the gathered logits.
    let mut side_by_side = vec![T::from_f32(0.0); m * vocab];
    for (r, g) in groups.iter().enumerate() {
        let l = download(g, &local[r]);
        let valid = spec.valid_rows(r).expect("rank");
        for i in 0..m {
            for (c, j) in valid.clone().enumerate() {
                side_by_side[i * vocab + j] = l[i * p + c];
            }
            for c in valid.len()..p {
                assert_eq!(
                    l[i * p + c].to_f32(),
                    0.0,
                    "{label} rank {r}: padding column {c} of row {i}"
                );
            }
        }
    }
    for (r, g) in groups.iter().enumerate() {
        let got = download(g, &outs[r]);
        assert_close(&format!("{label} rank {r}"), &got, &want, T::TOLERANCE);
        assert_same_bits(
            &format!("{label} rank {r} vs the local logits"),
            &got,
            &side_by_side,
        );
    }
}

fn tied_lm_head() {
    let gpu = gpu();
    let (world, vocab, hidden) = SHAPES[1];
    let m = 4;
    let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
    let spec = spec(world, vocab, hidden);
    let t = table::<f16>(seed_of::<f16>(&[4]), vocab, hidden);
    let embeddings = embeddings(&groups, &spec, &t);
    let tied: Vec<ParallelLMHead<f16>> = embeddings
        .iter()
        .map(|e| ParallelLMHead::tied("lm_head", e).expect("tied"))
        .collect();
    let untied: Vec<ParallelLMHead<f16>> = groups
        .iter()
        .map(|g| {
            let spec = VocabParallelSpec::new("lm_head", vocab, hidden, world).expect("spec");
            ParallelLMHead::from_host(g, spec, HostWeight::new(&t, vocab, hidden)).expect("head")
        })
        .collect();
    for (r, g) in groups.iter().enumerate() {
        let s = g.stream();
        assert_eq!(
            tied[r].weight().device_ptr(s).0,
            embeddings[r].table().device_ptr(s).0,
            "rank {r}: the tied head has its own copy of the table"
        );
        assert_eq!(tied[r].spec().label(), "vocab-parallel 'lm_head'");
    }
    let x: Vec<f16> = random_vec(seed_of::<f16>(&[5]), m * hidden, -1.0, 1.0);
    let xs = upload_copies(&groups, &x);
    let p = spec.rows_per_rank();
    let mut results = Vec::new();
    for (what, heads) in [("tied", &tied), ("untied", &untied)] {
        let mut local: Vec<CudaSlice<f16>> = poisoned_ranks(&groups, m * p);
        let mut gathered: Vec<CudaSlice<f16>> = poisoned_ranks(&groups, world * m * p);
        let mut outs: Vec<CudaSlice<f16>> = poisoned_ranks(&groups, m * vocab);
        round(&groups, what, |r| {
            heads[r].forward_gather(
                &groups[r],
                &xs[r],
                &mut local[r],
                &mut gathered[r],
                &mut outs[r],
            )
        });
        results.push(download(&groups[0], &outs[0]));
    }
    assert_same_bits("tied vs untied logits", &results[0], &results[1]);
}

fn bad_shapes_and_calls() {
    let gpu = gpu();
    let (world, vocab, hidden) = SHAPES[0];
    let groups = virtual_group(&gpu.ctx, world, GroupOptions::default());
    let g = &groups[1];
    let spec = spec(world, vocab, hidden);
    let t = table::<bf16>(seed_of::<bf16>(&[6]), vocab, hidden);
    let layer = "vocab-parallel 'model.embed_tokens'";
    expect_invalid_saying(
        "transposed table",
        VocabParallelEmbedding::from_host(g, spec.clone(), HostWeight::new(&t, hidden, vocab)),
        layer,
        &[
            "[vocab, hidden] = [1000, 64]",
            "got [64, 1000]",
            "transposed?",
        ],
    );
    let other_world = VocabParallelSpec::new("model.embed_tokens", vocab, hidden, 2).expect("spec");
    expect_invalid_saying(
        "another world",
        ParallelLMHead::from_host(g, other_world, HostWeight::new(&t, vocab, hidden)),
        layer,
        &["world 2", "4 ranks"],
    );
    expect_invalid_saying(
        "a shard of the wrong length",
        VocabParallelEmbedding::from_shard(
            g,
            spec.clone(),
            upload(g, &t[..vocab / world * hidden]),
        ),
        layer,
        &["the table shard", "[256, 64]"],
    );
    let head = ParallelLMHead::from_host(g, spec.clone(), HostWeight::new(&t, vocab, hidden))
        .expect("head");
    let m = 2;
    let x = upload(g, &vec![bf16::ONE; m * hidden]);
    let mut local: CudaSlice<bf16> = common::ranks::poisoned(g, m * 256);
    let mut gathered: CudaSlice<bf16> = common::ranks::poisoned(g, world * m * 256);
    // The padded width is not the logits' width.
    let mut padded_out: CudaSlice<bf16> = common::ranks::poisoned(g, m * 1024);
    expect_invalid_saying(
        "out with the padding",
        head.forward_gather(g, &x, &mut local, &mut gathered, &mut padded_out),
        layer,
        &["out", "[2, 1000]"],
    );
    let mut short_local: CudaSlice<bf16> = common::ranks::poisoned(g, m * 250);
    expect_invalid_saying(
        "local of the wrong width",
        head.forward(g, &x, &mut short_local),
        layer,
        &["local", "[2, 256]"],
    );
    assert_poisoned("local after refused calls", &download(g, &local));
    let embedding = VocabParallelEmbedding::from_host(g, spec, HostWeight::new(&t, vocab, hidden))
        .expect("embedding");
    let mut ids_dev = g.stream().alloc_zeros::<u32>(3).expect("alloc");
    let mut out: CudaSlice<bf16> = common::ranks::poisoned(g, 2 * hidden);
    expect_invalid_saying(
        "ids_dev of the wrong length",
        embedding.forward(g, &[1, 2], &mut ids_dev, &mut out),
        layer,
        &["ids_dev", "holds 3"],
    );
    expect_invalid_saying(
        "another rank's group",
        embedding.forward(&groups[0], &[1, 2], &mut ids_dev, &mut out),
        layer,
        &["rank 1", "rank 0"],
    );
    check_all(&groups, "after refused calls");
}

/// A group whose symmetric memory is too small for the collective (no NCCL to fall back on):
/// refused before the ids are copied, the lookup runs or the GEMM runs.
fn over_capacity() {
    let gpu = gpu();
    let (world, vocab, hidden) = SHAPES[0];
    let options = GroupOptions {
        capacity_bytes: 4096,
        ..GroupOptions::default()
    };
    let groups = virtual_group(&gpu.ctx, world, options);
    let spec = spec(world, vocab, hidden);
    let t = table::<bf16>(seed_of::<bf16>(&[7]), vocab, hidden);
    let layers = embeddings(&groups, &spec, &t);
    let head =
        ParallelLMHead::from_host(&groups[2], spec.clone(), HostWeight::new(&t, vocab, hidden))
            .expect("head");
    let g = &groups[2];
    let m = 64; // 64 rows of 64 bf16: 8 KiB
    let ids: Vec<u32> = (0..m as u32).collect();
    let mut ids_dev = g.stream().alloc_zeros::<u32>(m).expect("alloc");
    let mut out: CudaSlice<bf16> = common::ranks::poisoned(g, m * hidden);
    expect_invalid_saying(
        "embedding over capacity",
        layers[2].forward(g, &ids, &mut ids_dev, &mut out),
        "vocab-parallel 'model.embed_tokens'",
        &["out", "capacity"],
    );
    expect_invalid_saying(
        "embedding over capacity, device ids",
        layers[2].forward_device_ids(g, &ids_dev, &mut out),
        "vocab-parallel 'model.embed_tokens'",
        &["out", "capacity"],
    );
    assert_poisoned("embedding out after refused calls", &download(g, &out));
    assert_eq!(
        download(g, &ids_dev),
        vec![0; m],
        "ids_dev written by a refused call"
    );
    let m = 16; // local: 16 rows of 256 bf16, 8 KiB
    let x = upload(g, &vec![bf16::ONE; m * hidden]);
    let p = spec.rows_per_rank();
    let mut local: CudaSlice<bf16> = common::ranks::poisoned(g, m * p);
    let mut gathered: CudaSlice<bf16> = common::ranks::poisoned(g, world * m * p);
    let mut logits: CudaSlice<bf16> = common::ranks::poisoned(g, m * vocab);
    expect_invalid_saying(
        "LM head over capacity",
        head.forward_gather(g, &x, &mut local, &mut gathered, &mut logits),
        "vocab-parallel 'model.embed_tokens'",
        &["local", "capacity"],
    );
    assert_poisoned("LM head local after a refused call", &download(g, &local));
    check_all(&groups, "after refused calls");
}

gpu_tests! {
    embedding_rows_bitwise_on_every_rank_bf16 => matrix([1, 5, 33], embedding_case::<bf16>);
    embedding_rows_bitwise_on_every_rank_f16 => matrix([1, 5, 33], embedding_case::<f16>);
    ids_past_the_vocabulary_are_refused_or_nan => out_of_range_ids();
    lm_head_gathers_the_logits_without_padding_bf16 => matrix([1, 3, 17], lm_head_case::<bf16>);
    lm_head_gathers_the_logits_without_padding_f16 => matrix([1, 3, 17], lm_head_case::<f16>);
    tied_lm_head_shares_the_embedding_table => tied_lm_head();
    wrong_shapes_and_calls_name_the_layer => bad_shapes_and_calls();
    over_capacity_is_refused_before_anything_runs => over_capacity();
}
