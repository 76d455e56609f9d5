//! GPU tests of the NCCL communicator [`tpfuse::comm::Comm`] (feature `gpu-tests`; without
//! it every test here is listed as ignored).
//!
//! - One process, world 1: every collective, every reduction and every NCCL dtype, with the
//!   results checked bitwise (at world 1 every output equals its input, Avg included), and
//!   the length and rank checks, which must fail before anything is enqueued.
//! - Several processes on one GPU: the test re-executes its own binary once per rank
//!   (`--exact child_... --include-ignored`), the rank, world size and NCCL unique id in
//!   environment variables, each child with its own `NCCL_HOSTID` and
//!   `NCCL_SOCKET_IFNAME=lo` so that NCCL treats the ranks as separate hosts (socket
//!   transport) instead of refusing two ranks on one GPU. Each child checks its own results,
//!   writes a marker file when every check passed, and exits non-zero otherwise; the parent
//!   waits with a bound and kills every child on every path.
//! - A dead peer: rank 1 leaves after init; rank 0's all-reduce must return an error within
//!   its timeout and a margin, never hang.

use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tpfuse::comm::{group, Comm, CommOptions, ReduceOp, UniqueId};
use tpfuse::{Error, NcclType};

mod common;
use common::children::{clock_nanos, small_int, ChildEnv, Children, Spawn};
use common::gpu::{open_gpu0, refill, splitmix64, upload};
use common::{assert_same_bits, Bits};

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Avg,
];

/// Lengths of the world-1 checks.
const WORLD_ONE_LENGTHS: [usize; 4] = [1, 17, 4097, 1 << 20];

/// A value type the tests move through NCCL.
trait Val: NcclType + Bits + PartialEq {
    const NAME: &'static str;
    /// A random value; never [`Bits::poison`].
    fn random(rng: &mut StdRng) -> Self;
}

macro_rules! val {
    ($($t:ty => $name:literal, |$rng:ident| $random:expr);* $(;)?) => {
        $(impl Val for $t {
            const NAME: &'static str = $name;
            fn random($rng: &mut StdRng) -> Self {
                $random
            }
        })*
    };
}

val! {
    f32 => "f32", |rng| rng.random_range(-4.0f32..4.0);
    f64 => "f64", |rng| rng.random_range(-4.0f64..4.0);
    f16 => "f16", |rng| f16::from_f32(rng.random_range(-4.0f32..4.0));
    bf16 => "bf16", |rng| bf16::from_f32(rng.random_range(-4.0f32..4.0));
    i32 => "i32", |rng| rng.random_range(-1_000_000..1_000_000);
    u8 => "u8", |rng| rng.random_range(0..=254);
}

fn fresh_id() -> UniqueId {
    UniqueId::new().unwrap_or_else(|e| panic!("ncclGetUniqueId: {e}"))
}

/// A world-1 communicator on GPU 0 (a missing driver or NCCL fails the test).
fn world_one(options: CommOptions) -> Comm {
    let id = fresh_id();
    Comm::init_rank_on_device(&id, 0, 1, 0, options)
        .unwrap_or_else(|e| panic!("a world-1 communicator on GPU 0: {e}"))
}

fn download<T: Val>(comm: &Comm, buf: &CudaSlice<T>) -> Vec<T> {
    comm.synchronize()
        .unwrap_or_else(|e| panic!("rank {}: synchronize: {e}", comm.rank()));
    comm.stream()
        .clone_dtoh(buf)
        .expect("downloading from the GPU")
}

/// Every collective on a world-1 communicator: each output must equal its input.
fn world_one_collectives<T: Val>(comm: &Comm) {
    let stream = comm.stream().clone();
    let name = T::NAME;
    for &n in &WORLD_ONE_LENGTHS {
        let dtype = name.bytes().fold(0u64, |h, b| splitmix64(h ^ u64::from(b)));
        let mut rng = StdRng::seed_from_u64(splitmix64(dtype ^ n as u64));
        let host: Vec<T> = (0..n).map(|_| T::random(&mut rng)).collect();
        let poison = vec![T::poison(); n];
        let send = upload(&stream, &host);
        let mut recv = upload(&stream, &poison);
        let label = |what: &str| format!("world 1, {name}, n={n}: {what}");

        for op in OPS {
            refill(&stream, &mut recv, &poison);
            comm.all_reduce(&send, &mut recv, op)
                .unwrap_or_else(|e| panic!("{}: {e}", label(&format!("all_reduce {op:?}"))));
            let got = download(comm, &recv);
            assert_same_bits(&label(&format!("all_reduce {op:?}")), &got, &host);

            let mut buf = upload(&stream, &host);
            comm.all_reduce_in_place(&mut buf, op).unwrap_or_else(|e| {
                panic!("{}: {e}", label(&format!("all_reduce_in_place {op:?}")))
            });
            let got = download(comm, &buf);
            assert_same_bits(&label(&format!("all_reduce_in_place {op:?}")), &got, &host);

            refill(&stream, &mut recv, &poison);
            comm.reduce_scatter(&send, &mut recv, op)
                .unwrap_or_else(|e| panic!("{}: {e}", label(&format!("reduce_scatter {op:?}"))));
            let got = download(comm, &recv);
            assert_same_bits(&label(&format!("reduce_scatter {op:?}")), &got, &host);

            refill(&stream, &mut recv, &poison);
            comm.reduce(&send, &mut recv, op, 0)
                .unwrap_or_else(|e| panic!("{}: {e}", label(&format!("reduce {op:?}"))));
            let got = download(comm, &recv);
            assert_same_bits(&label(&format!("reduce {op:?} to root 0")), &got, &host);
        }

        refill(&stream, &mut recv, &poison);
        comm.all_gather(&send, &mut recv)
            .unwrap_or_else(|e| panic!("{}: {e}", label("all_gather")));
        let got = download(comm, &recv);
        assert_same_bits(&label("all_gather"), &got, &host);

        let mut buf = upload(&stream, &host);
        comm.broadcast(&mut buf, 0)
            .unwrap_or_else(|e| panic!("{}: {e}", label("broadcast")));
        let got = download(comm, &buf);
        assert_same_bits(&label("broadcast from root 0"), &got, &host);

        refill(&stream, &mut recv, &poison);
        group(&[comm], || {
            comm.send(&send, 0)?;
            comm.recv(&mut recv, 0)
        })
        .unwrap_or_else(|e| panic!("{}: {e}", label("send/recv to self in a group")));
        let got = download(comm, &recv);
        assert_same_bits(&label("send/recv to self"), &got, &host);

        // The input was only read.
        let got = download(comm, &send);
        assert_same_bits(&label("send buffer after every collective"), &got, &host);
    }
}

#[test]
#[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU")]
fn world_one_every_collective_every_dtype() {
    let comm = world_one(CommOptions::default());
    assert_eq!((comm.rank(), comm.world()), (0, 1));
    comm.sanity_check().expect("sanity_check");
    comm.barrier().expect("barrier");
    comm.check_async().expect("check_async");
    world_one_collectives::<f32>(&comm);
    world_one_collectives::<f16>(&comm);
    world_one_collectives::<bf16>(&comm);
    world_one_collectives::<f64>(&comm);
    world_one_collectives::<i32>(&comm);
    world_one_collectives::<u8>(&comm);
    comm.barrier().expect("barrier after the collectives");
    comm.check_async()
        .expect("check_async after the collectives");
    comm.sanity_check()
        .expect("sanity_check after the collectives");
}

/// Asserts `result` is `Error::InvalidArgument` whose `arg` contains `arg`.
fn expect_invalid(label: &str, result: tpfuse::Result<()>, arg: &str) {
    match result {
        Err(Error::InvalidArgument { arg: got, reason }) => assert!(
            got.contains(arg),
            "{label}: InvalidArgument names `{got}` ({reason}), expected `{arg}`"
        ),
        Err(e) => panic!("{label}: expected InvalidArgument ({arg}), got {e:?}"),
        Ok(()) => panic!("{label}: expected InvalidArgument ({arg}), got Ok"),
    }
}

#[test]
#[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU")]
fn world_one_bad_lengths_and_ranks_are_invalid_arguments() {
    let comm = world_one(CommOptions::default());
    let stream = comm.stream().clone();
    let n = 1000;
    let mut rng = StdRng::seed_from_u64(0x6261_6421);
    let host: Vec<f32> = (0..n).map(|_| f32::random(&mut rng)).collect();
    let send = upload(&stream, &host);
    let mut long = upload(&stream, &vec![f32::NAN; n + 1]);
    let mut short = upload(&stream, &vec![f32::NAN; n - 1]);
    let mut same = upload(&stream, &vec![f32::NAN; n]);

    expect_invalid(
        "all_gather recv != world x send",
        comm.all_gather(&send, &mut long),
        "all_gather: recv",
    );
    expect_invalid(
        "all_gather recv shorter than send",
        comm.all_gather(&send, &mut short),
        "all_gather: recv",
    );
    expect_invalid(
        "reduce_scatter send != world x recv",
        comm.reduce_scatter(&send, &mut long, ReduceOp::Sum),
        "reduce_scatter: send",
    );
    expect_invalid(
        "all_reduce length mismatch",
        comm.all_reduce(&send, &mut long, ReduceOp::Sum),
        "all_reduce: recv",
    );
    expect_invalid(
        "reduce length mismatch",
        comm.reduce(&send, &mut short, ReduceOp::Max, 0),
        "reduce: recv",
    );
    expect_invalid(
        "reduce to root 1 of a world of 1",
        comm.reduce(&send, &mut same, ReduceOp::Sum, 1),
        "reduce",
    );
    expect_invalid(
        "broadcast from root 1 of a world of 1",
        comm.broadcast(&mut same, 1),
        "broadcast",
    );
    expect_invalid("send to rank 1", comm.send(&send, 1), "send");
    expect_invalid("recv from rank 1", comm.recv(&mut same, 1), "recv");

    // Nothing was enqueued: the outputs still hold their poison.
    for (what, buf) in [("long", &long), ("short", &short), ("same", &same)] {
        let got = download(&comm, buf);
        assert!(
            got.iter().all(|x| x.is_nan()),
            "{what}: a rejected call wrote to its output"
        );
    }
    // A rejected call does not break the communicator.
    comm.check_async()
        .expect("check_async after rejected calls");
    comm.sanity_check()
        .expect("sanity_check after rejected calls");
    comm.all_reduce(&send, &mut same, ReduceOp::Sum)
        .expect("a valid all_reduce after rejected calls");
    assert_same_bits(
        "all_reduce after rejected calls",
        &download(&comm, &same),
        &host,
    );
}

#[test]
#[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU")]
fn world_one_abort_makes_the_communicator_unusable() {
    let comm = world_one(CommOptions::default());
    let stream = comm.stream().clone();
    comm.sanity_check().expect("sanity_check before abort");
    let send = upload(&stream, &[1.0f32; 8]);
    let mut recv = upload(&stream, &[f32::NAN; 8]);
    comm.abort();
    let unusable = |what: &str, r: tpfuse::Result<()>| match r {
        Err(Error::CommUnusable(_)) => {}
        other => panic!("{what} after abort: expected CommUnusable, got {other:?}"),
    };
    unusable(
        "all_reduce",
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum),
    );
    unusable("sanity_check", comm.sanity_check());
    unusable("barrier", comm.barrier());
    unusable("synchronize", comm.synchronize());
    unusable("check_async", comm.check_async());
    comm.abort(); // twice is harmless
    drop(comm); // must not finalize an aborted communicator
}

#[test]
#[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU: NCCL")]
fn an_engines_communicator_is_borrowed_never_destroyed() {
    // The engine's communicator: one tpfuse made here, handed over as a raw ncclComm_t.
    let engine = world_one(CommOptions::default());
    let stream = open_gpu0().new_stream().expect("the engine's stream");
    // SAFETY: `engine` outlives `borrowed`, and the two are never used at once.
    let borrowed =
        unsafe { Comm::from_raw(engine.as_raw(), stream.clone(), CommOptions::default()) }
            .unwrap_or_else(|e| panic!("from_raw: {e}"));
    assert!(!borrowed.is_owned() && engine.is_owned());
    assert!(Arc::ptr_eq(borrowed.stream(), &stream));
    assert_eq!((borrowed.rank(), borrowed.world()), (0, 1));
    borrowed
        .sanity_check()
        .expect("a collective on the borrowed communicator");
    // A healthy borrowed communicator dropped: nothing is finalized or destroyed.
    drop(borrowed);
    engine
        .sanity_check()
        .expect("the engine's communicator after a borrowed one was dropped");
    // SAFETY: as above.
    let borrowed =
        unsafe { Comm::from_raw(engine.as_raw(), stream.clone(), CommOptions::default()) }
            .unwrap_or_else(|e| panic!("from_raw again: {e}"));
    // An abort of the borrowed one only marks it unusable; drop destroys nothing.
    borrowed.abort();
    assert!(borrowed.is_broken());
    assert!(matches!(
        borrowed.sanity_check(),
        Err(Error::CommUnusable(_))
    ));
    drop(borrowed);
    engine
        .sanity_check()
        .expect("the engine's communicator still works");
    // A null communicator is refused.
    // SAFETY: null is refused before any use.
    let null = unsafe { Comm::from_raw(std::ptr::null_mut(), stream, CommOptions::default()) };
    assert!(
        matches!(null, Err(Error::InvalidArgument { .. })),
        "{null:?}"
    );
}

#[test]
#[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU")]
fn world_one_init_variants() {
    // On the engine's own stream: the communicator uses exactly that stream.
    let stream = open_gpu0().new_stream().expect("creating a stream");
    let comm = Comm::init_rank(&fresh_id(), 0, 1, stream.clone(), CommOptions::default())
        .unwrap_or_else(|e| panic!("init_rank on the caller's stream: {e}"));
    assert!(Arc::ptr_eq(comm.stream(), &stream));
    comm.sanity_check().expect("sanity_check (init_rank)");
    drop(comm);

    // init_all over the one device.
    let comms = Comm::init_all(&[0], CommOptions::default())
        .unwrap_or_else(|e| panic!("init_all(&[0]): {e}"));
    assert_eq!(comms.len(), 1);
    assert_eq!((comms[0].rank(), comms[0].world()), (0, 1));
    comms[0].sanity_check().expect("sanity_check (init_all)");
    drop(comms);

    // Rejected before NCCL is asked.
    match Comm::init_all(&[0, 0], CommOptions::default()) {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("init_all(&[0, 0]): expected InvalidArgument, got {other:?}"),
    }
    match Comm::init_all(&[], CommOptions::default()) {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("init_all(&[]): expected InvalidArgument, got {other:?}"),
    }
    match Comm::init_rank_on_device(&fresh_id(), 1, 1, 0, CommOptions::default()) {
        Err(Error::RankOutOfRange { rank: 1, world: 1 }) => {}
        other => panic!("rank 1 of world 1: expected RankOutOfRange, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Several processes on one GPU.
// ---------------------------------------------------------------------------------------

/// Bound on a whole multi-process collective test (children started to all exited).
const COLLECTIVES_BOUND: Duration = Duration::from_secs(240);
/// The dead-peer test: rank 0's communicator timeout, the slack allowed beyond it for the
/// error to surface (abort included), and the bound on the whole test.
const DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(10);
const DEAD_PEER_MARGIN: Duration = Duration::from_secs(20);
const DEAD_PEER_BOUND: Duration = Duration::from_secs(120);

/// One multi-process test at a time in this process: they share the GPU, and the
/// dead-peer bound should not absorb another test's load.
static MULTI_PROCESS: Mutex<()> = Mutex::new(());

/// Starts `world` children running the test `child_test` as `role`, with a seed from the
/// clock and `env` added to their environment.
fn spawn(child_test: &'static str, role: &str, world: usize, env: &[(&str, &str)]) -> Children {
    Children::spawn(Spawn {
        test: child_test,
        role,
        world,
        seed: splitmix64(clock_nanos() as u64 ^ u64::from(std::process::id())),
        dir_prefix: "tpfuse-gpu-comm",
        host_prefix: "tpfuse-test",
        env,
    })
}

/// Lengths of the multi-process checks.
const MULTI_LENGTHS: [usize; 3] = [1, 4099, 262_147];

fn child_check_collectives(env: &ChildEnv) {
    let (rank, world) = (env.rank, env.world);
    let comm = env.comm(Duration::from_secs(90));
    comm.sanity_check()
        .unwrap_or_else(|e| panic!("rank {rank}/{world}: sanity_check: {e}"));
    let stream = comm.stream().clone();
    for &n in &MULTI_LENGTHS {
        let label = |what: &str| format!("rank {rank}/{world} n={n}: {what}");

        // all_reduce Sum, f32 and bf16: exact sums of small integers.
        let seed = env.seed ^ 0xa11;
        let mine: Vec<f32> = (0..n).map(|i| small_int(seed, rank, i)).collect();
        let want: Vec<f32> = (0..n)
            .map(|i| (0..world).map(|r| small_int(seed, r, i)).sum())
            .collect();
        let send = upload(&stream, &mine);
        let mut recv = upload(&stream, &vec![f32::NAN; n]);
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{}: {e}", label("all_reduce f32")));
        assert_same_bits(&label("all_reduce Sum f32"), &download(&comm, &recv), &want);

        let mut buf = upload(&stream, &mine);
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{}: {e}", label("all_reduce_in_place f32")));
        assert_same_bits(
            &label("all_reduce_in_place Sum f32"),
            &download(&comm, &buf),
            &want,
        );

        let to_bf16 = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
        let send16 = upload(&stream, &to_bf16(&mine));
        let mut recv16 = upload(&stream, &vec![bf16::NAN; n]);
        comm.all_reduce(&send16, &mut recv16, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{}: {e}", label("all_reduce bf16")));
        assert_same_bits(
            &label("all_reduce Sum bf16"),
            &download(&comm, &recv16),
            &to_bf16(&want),
        );

        // all_gather f32: rank r's block at r * n.
        let seed = env.seed ^ 0xa6;
        let mine: Vec<f32> = (0..n).map(|i| small_int(seed, rank, i)).collect();
        let want: Vec<f32> = (0..world * n)
            .map(|j| small_int(seed, j / n, j % n))
            .collect();
        let send = upload(&stream, &mine);
        let mut recv = upload(&stream, &vec![f32::NAN; world * n]);
        comm.all_gather(&send, &mut recv)
            .unwrap_or_else(|e| panic!("{}: {e}", label("all_gather")));
        assert_same_bits(&label("all_gather f32"), &download(&comm, &recv), &want);

        // reduce_scatter Sum f32: block `rank` of the sum over ranks.
        let seed = env.seed ^ 0x55;
        let mine: Vec<f32> = (0..world * n).map(|j| small_int(seed, rank, j)).collect();
        let want: Vec<f32> = (0..n)
            .map(|i| (0..world).map(|r| small_int(seed, r, rank * n + i)).sum())
            .collect();
        let send = upload(&stream, &mine);
        let mut recv = upload(&stream, &vec![f32::NAN; n]);
        comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{}: {e}", label("reduce_scatter")));
        assert_same_bits(
            &label("reduce_scatter Sum f32"),
            &download(&comm, &recv),
            &want,
        );
    }
    comm.barrier()
        .unwrap_or_else(|e| panic!("rank {rank}/{world}: final barrier: {e}"));
    env.mark_ok("all_reduce, all_reduce_in_place, all_gather, reduce_scatter checked");
}

/// Child entry point of the multi-process collective tests; does nothing in any other run.
#[test]
#[ignore = "child process of the multi-process tests (they run it with --include-ignored)"]
fn child_collectives() {
    match ChildEnv::from_env("collectives") {
        Some(env) => child_check_collectives(&env),
        None => println!("child_collectives: not started by a multi-process test; nothing to do"),
    }
}

fn multi_process_collectives(world: usize) {
    let _one_at_a_time = MULTI_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let mut children = spawn("child_collectives", "collectives", world, &[]);
    children.wait_all(COLLECTIVES_BOUND);
    let notes = children.notes();
    println!(
        "world {world}: every rank passed in {:?}: {notes:?}",
        children.started.elapsed()
    );
}

gpu_only_tests! { "needs a CUDA GPU: NCCL" => {
    multi_process_collectives_world_2 => multi_process_collectives(2);
    multi_process_collectives_world_4 => multi_process_collectives(4);
} }

const ENV_DEAD_AFTER: &str = "TPFUSE_TEST_DEAD_PEER_AFTER";

fn child_check_dead_peer(env: &ChildEnv) {
    let (rank, world) = (env.rank, env.world);
    assert_eq!(world, 2, "the dead-peer test runs with two ranks");
    // "sanity": the peer joins one all-reduce (connections are up) and then leaves;
    // "init": the peer leaves right after init (rank 0's first collective must connect).
    let after = std::env::var(ENV_DEAD_AFTER).unwrap_or_else(|_| "sanity".into());
    let comm = env.comm(DEAD_PEER_TIMEOUT);
    if after == "sanity" {
        comm.sanity_check()
            .unwrap_or_else(|e| panic!("rank {rank}/{world}: sanity_check: {e}"));
    }
    if rank == 1 {
        // Let NCCL's proxy flush what it still owes rank 0, then vanish without joining
        // anything else and without running a destructor.
        std::thread::sleep(Duration::from_secs(1));
        env.mark_ok(&format!("left after {after}"));
        std::process::exit(0);
    }
    // Rank 0: make sure the peer is gone before the collective starts.
    std::thread::sleep(Duration::from_secs(3));
    let stream = comm.stream().clone();
    let send = upload(&stream, &vec![1.0f32; 1 << 16]);
    let mut recv = upload(&stream, &vec![f32::NAN; 1 << 16]);
    let started = Instant::now();
    let result = comm
        .all_reduce(&send, &mut recv, ReduceOp::Sum)
        .and_then(|()| comm.synchronize());
    let elapsed = started.elapsed();
    let kind = match &result {
        Ok(()) => panic!("rank 0: all_reduce + synchronize succeeded without its peer"),
        Err(Error::Timeout { .. }) => "Timeout",
        Err(Error::Nccl { .. }) => "Nccl",
        Err(Error::CommUnusable(_)) => "CommUnusable",
        Err(e) => panic!("rank 0: expected Timeout, Nccl or CommUnusable, got {e:?}"),
    };
    let err = result.unwrap_err();
    println!("rank 0: all_reduce with a dead peer failed after {elapsed:?} with {kind}: {err}");
    assert!(
        elapsed <= DEAD_PEER_TIMEOUT + DEAD_PEER_MARGIN,
        "rank 0: the error took {elapsed:?}, more than the timeout {DEAD_PEER_TIMEOUT:?} + \
         {DEAD_PEER_MARGIN:?}"
    );
    // The communicator is broken for good.
    match comm.sanity_check() {
        Err(Error::CommUnusable(_)) => {}
        other => panic!("rank 0: after the failure expected CommUnusable, got {other:?}"),
    }
    env.mark_ok(&format!(
        "peer left after {after}; {kind} after {} ms",
        elapsed.as_millis()
    ));
    // Skip teardown (contexts, buffers) of a process whose NCCL kernels were aborted.
    std::process::exit(0);
}

/// Child entry point of the dead-peer tests; does nothing in any other run.
#[test]
#[ignore = "child process of the dead-peer tests (they run it with --include-ignored)"]
fn child_dead_peer() {
    match ChildEnv::from_env("dead_peer") {
        Some(env) => child_check_dead_peer(&env),
        None => println!("child_dead_peer: not started by a dead-peer test; nothing to do"),
    }
}

fn dead_peer(after: &str) {
    let _one_at_a_time = MULTI_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let mut children = spawn(
        "child_dead_peer",
        "dead_peer",
        2,
        &[(ENV_DEAD_AFTER, after)],
    );
    children.wait_all(DEAD_PEER_BOUND);
    let notes = children.notes();
    println!(
        "dead peer ({after}): {notes:?}; whole test {:?}",
        children.started.elapsed()
    );
    assert!(
        notes[0].contains("Timeout")
            || notes[0].contains("Nccl")
            || notes[0].contains("CommUnusable"),
        "rank 0's marker does not name the error: {:?}",
        notes[0]
    );
}

gpu_only_tests! { "needs a CUDA GPU: NCCL" => {
    multi_process_dead_peer_after_first_collective_is_an_error_not_a_hang => dead_peer("sanity");
    multi_process_dead_peer_before_first_collective_is_an_error_not_a_hang => dead_peer("init");
} }
