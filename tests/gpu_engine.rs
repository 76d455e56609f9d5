//! What an engine hands tpfuse (feature `gpu-tests`, or `emulator` on the CPU; with neither
//! every test here is listed as ignored), on virtual ranks of GPU 0:
//!
//! - a group built on the engine's streams enqueues every op there (the group's stream is
//!   the engine's, and the result is there once that stream is synchronised); the same
//!   stream twice, or an empty list, is refused;
//! - a group is shared by reference across threads (`TpGroup: Sync`): every rank's op issued
//!   from its own thread through `&TpGroup`;
//! - a layer borrows the engine's weights (a `CudaView` of the engine's buffer, no copy), and
//!   gives the bits of the layer that owns a copy;
//! - a fused row-parallel call needs no `partial` workspace;
//! - an embedding borrows the engine's table, and its tied LM head shares it: the rows and
//!   logits of the owning layers, bit for bit.

mod common;

use common::gpu::{base_seed, mix_seed, random_vec, splitmix64};
use common::ranks::{download, gpu, poisoned, upload};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use std::sync::Arc;
use tpfuse::ops::linear::{
    Fusion, ParallelLMHead, RowParallelLinear, RowParallelPath, VocabParallelEmbedding,
};
use tpfuse::ops::{all_reduce_in_place, Algorithm};
use tpfuse::shard::{HostWeight, RowParallelSpec, VocabParallelSpec};
use tpfuse::{Error, GroupOptions, TpGroup};

type T = bf16;

/// One rank's row-parallel forward: (rank, partial, out).
type Forward<'a> =
    &'a dyn Fn(usize, &mut CudaSlice<T>, &mut CudaSlice<T>) -> tpfuse::Result<RowParallelPath>;

fn engine_streams(ctx: &Arc<cudarc::driver::CudaContext>, world: usize) -> Vec<Arc<CudaStream>> {
    (0..world)
        .map(|_| ctx.new_stream().expect("the engine's stream"))
        .collect()
}

/// The sum over ranks as the kernels make it (f32 in rank order, rounded once).
fn exact_sum(inputs: &[Vec<T>]) -> Vec<T> {
    let refs: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
    tpfuse::reference::reduce_ranks_exact(&refs)
}

gpu_tests! {
    groups_run_on_the_engines_streams => {
        let gpu = gpu();
        let world = 4;
        let streams = engine_streams(&gpu.ctx, world);
        let groups = TpGroup::virtual_ranks_on(&streams, GroupOptions::default())
            .expect("virtual ranks on the engine's streams");
        for (r, g) in groups.iter().enumerate() {
            assert_eq!(g.stream().cu_stream(), streams[r].cu_stream(), "rank {r}");
            assert_eq!((g.rank(), g.world()), (r, world));
        }
        // Small integers: the sum is exact in bf16 whatever the order.
        let seed = mix_seed(base_seed(0xe46e), &[world as u64]);
        let n = 4096;
        let inputs: Vec<Vec<T>> = (0..world)
            .map(|r| {
                (0..n)
                    .map(|i| T::from_f32(((splitmix64(seed ^ (r * n + i) as u64) % 17) as f32) - 8.0))
                    .collect()
            })
            .collect();
        let mut bufs: Vec<CudaSlice<T>> =
            groups.iter().zip(&inputs).map(|(g, h)| upload(g, h)).collect();
        // Each rank's op from its own thread, the group shared by reference.
        std::thread::scope(|s| {
            for (g, buf) in groups.iter().zip(bufs.iter_mut()) {
                s.spawn(move || all_reduce_in_place(g, buf, Algorithm::Auto).expect("all-reduce"));
            }
        });
        let want = exact_sum(&inputs);
        for (r, s) in streams.iter().enumerate() {
            // The engine synchronises its own stream: the result is there.
            s.synchronize().expect("the engine's stream");
            let got: Vec<T> = s.clone_dtoh(&bufs[r]).expect("download");
            assert!(got == want, "rank {r}: the all-reduce on the engine's stream differs");
        }
    };

    streams_the_ranks_cannot_share_are_refused => {
        let gpu = gpu();
        let s = gpu.ctx.new_stream().expect("a stream");
        match TpGroup::virtual_ranks_on(&[s.clone(), s], GroupOptions::default()) {
            Err(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, "streams");
                assert!(reason.contains("same stream"), "{reason}");
            }
            other => panic!("one stream for two ranks: {other:?}"),
        }
        assert!(matches!(
            TpGroup::virtual_ranks_on(&[], GroupOptions::default()),
            Err(Error::InvalidArgument { .. })
        ));
        // CUDA's legacy default stream cannot carry a rank.
        let mine = gpu.ctx.new_stream().expect("a stream");
        match TpGroup::virtual_ranks_on(&[gpu.ctx.default_stream(), mine], GroupOptions::default()) {
            Err(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, "streams");
                assert!(reason.contains("legacy default stream"), "{reason}");
            }
            other => panic!("the legacy default stream for a rank: {other:?}"),
        }
    };

    a_layer_borrows_the_engines_weights => {
        let gpu = gpu();
        let world = 2;
        let groups = TpGroup::virtual_ranks(&gpu.ctx, world, GroupOptions::default())
            .expect("virtual ranks");
        let (n, k, m) = (64, 128, 8);
        let seed = mix_seed(base_seed(0xb0e0), &[n as u64, k as u64]);
        let w_full: Vec<T> = random_vec(seed, n * k, -1.0, 1.0);
        let bias: Vec<T> = random_vec(seed ^ 1, n, -1.0, 1.0);
        let spec = RowParallelSpec::new("o_proj", k, n, world).expect("spec");
        // The engine's weights: one buffer per rank holding [bias | W_r], the layer's parts
        // borrowed as views of it.
        let engine: Vec<CudaSlice<T>> = groups
            .iter()
            .map(|g| {
                let mut host = bias.clone();
                host.extend(spec.shard_weight(g.rank(), HostWeight::new(&w_full, n, k)).unwrap());
                upload(g, &host)
            })
            .collect();
        let xs: Vec<CudaSlice<T>> = groups
            .iter()
            .map(|g| upload(g, &random_vec::<T>(seed ^ (2 + g.rank() as u64), m * k / world, -1.0, 1.0)))
            .collect();
        let run = |layer: Forward<'_>| {
            let mut outs: Vec<CudaSlice<T>> = groups.iter().map(|g| poisoned(g, m * n)).collect();
            let mut partials: Vec<CudaSlice<T>> = groups.iter().map(|g| poisoned(g, m * n)).collect();
            for r in 0..world {
                layer(r, &mut partials[r], &mut outs[r]).expect("forward");
            }
            groups.iter().for_each(|g| g.check().expect("healthy"));
            groups.iter().zip(&outs).map(|(g, o)| download(g, o)).collect::<Vec<Vec<T>>>()
        };
        for fusion in [Fusion::Unfused, Fusion::Fused] {
            let borrowed: Vec<RowParallelLinear<T, _>> = groups
                .iter()
                .zip(&engine)
                .map(|(g, buf)| {
                    let (w, b) = (buf.slice(n..), Some(buf.slice(..n)));
                    RowParallelLinear::from_shard(g, spec.clone(), w, b)
                        .expect("a layer over the engine's buffer")
                        .with_fusion(fusion)
                })
                .collect();
            // No copy: the layer's weight is the engine's memory, n elements in.
            for (g, (layer, buf)) in groups.iter().zip(borrowed.iter().zip(&engine)) {
                let (base, _a) = buf.device_ptr(g.stream());
                let (weight, _b) = layer.weight().device_ptr(g.stream());
                assert_eq!(weight, base + (n * std::mem::size_of::<T>()) as u64);
            }
            let owned: Vec<RowParallelLinear<T>> = groups
                .iter()
                .map(|g| {
                    let w = HostWeight::new(&w_full, n, k);
                    RowParallelLinear::from_host(g, spec.clone(), w, Some(&bias))
                        .expect("an owning layer")
                        .with_fusion(fusion)
                })
                .collect();
            let from_views = run(&|r, p, o| borrowed[r].forward(&groups[r], &xs[r], Some(p), o));
            let from_copies = run(&|r, p, o| owned[r].forward(&groups[r], &xs[r], Some(p), o));
            for r in 0..world {
                assert!(
                    from_views[r].iter().all(|v| !v.is_nan()),
                    "{fusion:?}, rank {r}: an output was never written"
                );
                let (a, b): (Vec<u16>, Vec<u16>) = (
                    from_views[r].iter().map(|v| v.to_bits()).collect(),
                    from_copies[r].iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(a, b, "{fusion:?}, rank {r}: borrowed and owned weights differ");
            }
        }
    };

    an_embedding_and_its_tied_head_borrow_the_engines_table => {
        let gpu = gpu();
        let world = 2;
        let groups = TpGroup::virtual_ranks(&gpu.ctx, world, GroupOptions::default())
            .expect("virtual ranks");
        let (vocab, hidden) = (200, 64);
        let seed = mix_seed(base_seed(0x7ab1e), &[vocab as u64]);
        let full: Vec<T> = random_vec(seed, vocab * hidden, -1.0, 1.0);
        let spec = VocabParallelSpec::new("embed_tokens", vocab, hidden, world).expect("spec");
        let rows = spec.rows_per_rank();
        // The engine's buffer per rank: 8 elements of its own, then the rank's table.
        let engine: Vec<CudaSlice<T>> = groups
            .iter()
            .map(|g| {
                let mut host = vec![T::ZERO; 8];
                host.extend(spec.shard_table(g.rank(), HostWeight::new(&full, vocab, hidden)).unwrap());
                upload(g, &host)
            })
            .collect();
        let ids: Vec<u32> = vec![0, 7, 199, 100, 7];
        let m = ids.len();
        let lookups = |borrowed: bool| -> (Vec<Vec<T>>, Vec<Vec<T>>) {
            let mut outs: Vec<CudaSlice<T>> = groups.iter().map(|g| poisoned(g, m * hidden)).collect();
            let mut logits: Vec<CudaSlice<T>> = groups.iter().map(|g| poisoned(g, m * rows)).collect();
            for (r, g) in groups.iter().enumerate() {
                let mut ids_dev = upload(g, &ids);
                if borrowed {
                    let table = engine[r].slice(8..);
                    let embedding = VocabParallelEmbedding::from_shard(g, spec.clone(), table)
                        .expect("an embedding over the engine's buffer");
                    let head = ParallelLMHead::tied("lm_head", &embedding).expect("tied");
                    let (base, _a) = engine[r].device_ptr(g.stream());
                    let (w, _b) = head.weight().device_ptr(g.stream());
                    assert_eq!(w, base + (8 * std::mem::size_of::<T>()) as u64, "a copy");
                    embedding.forward(g, &ids, &mut ids_dev, &mut outs[r]).expect("lookup");
                    head.forward(g, &outs[r].slice(..), &mut logits[r]).expect("logits");
                } else {
                    let w = HostWeight::new(&full, vocab, hidden);
                    let embedding = VocabParallelEmbedding::from_host(g, spec.clone(), w)
                        .expect("an owning embedding");
                    let head = ParallelLMHead::tied("lm_head", &embedding).expect("tied");
                    embedding.forward(g, &ids, &mut ids_dev, &mut outs[r]).expect("lookup");
                    head.forward(g, &outs[r].slice(..), &mut logits[r]).expect("logits");
                }
            }
            groups.iter().for_each(|g| g.check().expect("healthy"));
            let down = |bufs: &[CudaSlice<T>]| {
                groups.iter().zip(bufs).map(|(g, b)| download(g, b)).collect::<Vec<Vec<T>>>()
            };
            (down(&outs), down(&logits))
        };
        let (rows_b, logits_b) = lookups(true);
        let (rows_o, logits_o) = lookups(false);
        let bits = |v: &[T]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        for r in 0..world {
            assert!(rows_b[r].iter().all(|v| !v.is_nan()), "rank {r}: a row never written");
            // The looked-up rows are the table's rows.
            for (i, &id) in ids.iter().enumerate() {
                let want = &full[id as usize * hidden..(id as usize + 1) * hidden];
                assert_eq!(bits(&rows_b[r][i * hidden..(i + 1) * hidden]), bits(want), "rank {r} id {id}");
            }
            assert_eq!(bits(&rows_b[r]), bits(&rows_o[r]), "rank {r}: rows");
            assert_eq!(bits(&logits_b[r]), bits(&logits_o[r]), "rank {r}: logits");
        }
    };

    a_fused_row_parallel_call_needs_no_workspace => {
        let gpu = gpu();
        let world = 2;
        let groups = TpGroup::virtual_ranks(&gpu.ctx, world, GroupOptions::default())
            .expect("virtual ranks");
        let (n, k, m) = (64, 128, 4);
        let seed = mix_seed(base_seed(0xf00d), &[n as u64]);
        let w_full: Vec<T> = random_vec(seed, n * k, -1.0, 1.0);
        let spec = RowParallelSpec::new("down_proj", k, n, world).expect("spec");
        let layers: Vec<RowParallelLinear<T>> = groups
            .iter()
            .map(|g| {
                RowParallelLinear::from_host(g, spec.clone(), HostWeight::new(&w_full, n, k), None)
                    .expect("layer")
                    .with_fusion(Fusion::Fused)
                    .with_algorithm(Algorithm::OneShot)
            })
            .collect();
        assert!(!layers[0].needs_partial(&groups[0], m).unwrap());
        let xs: Vec<CudaSlice<T>> = groups
            .iter()
            .map(|g| upload(g, &random_vec::<T>(seed ^ (1 + g.rank() as u64), m * k / world, -1.0, 1.0)))
            .collect();
        let mut outs: Vec<CudaSlice<T>> = groups.iter().map(|g| poisoned(g, m * n)).collect();
        for r in 0..world {
            let ran = layers[r].forward(&groups[r], &xs[r], None, &mut outs[r]).expect("fused");
            assert!(matches!(ran, RowParallelPath::Fused(_)), "{ran:?}");
        }
        groups.iter().for_each(|g| g.check().expect("healthy"));
        let first: Vec<T> = download(&groups[0], &outs[0]);
        assert!(first.iter().all(|v| !v.is_nan()), "an output was never written");
        assert_eq!(
            first.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            download(&groups[1], &outs[1]).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "the ranks differ"
        );
    };
}
