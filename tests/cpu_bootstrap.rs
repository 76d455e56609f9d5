//! Unique ids and their bootstrap: launcher environments, the file and TCP rendezvous,
//! across threads and across processes. Needs no GPU.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use rand::Rng;
use tpfuse::comm::bootstrap::{
    join_tcp, publish_file, read_file, serve_tcp, serve_tcp_on, unique_id_from_env, LaunchEnv,
    Launcher,
};
use tpfuse::comm::{UniqueId, UNIQUE_ID_BYTES};
use tpfuse::Error;

// ----------------------------------------------------------------------------------------
// helpers
// ----------------------------------------------------------------------------------------

fn random_id() -> UniqueId {
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    rand::rng().fill(&mut bytes[..]);
    UniqueId::from_bytes(&bytes).unwrap()
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tpfuse-test-{}-{tag}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A variable getter over a fixed set of pairs.
fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

fn launch_env_error(pairs: &[(&str, &str)]) -> String {
    match LaunchEnv::from_vars(vars(pairs)) {
        Err(Error::LaunchEnv(message)) => message,
        other => panic!("expected Error::LaunchEnv for {pairs:?}, got {other:?}"),
    }
}

fn assert_elapsed_within(start: Instant, timeout: Duration) {
    let elapsed = start.elapsed();
    assert!(
        elapsed >= timeout && elapsed <= timeout + Duration::from_millis(500),
        "took {elapsed:?} for a timeout of {timeout:?}"
    );
}

fn local_listener() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// A hello of run [`RUN`], possibly lying about its rank and world.
fn hello(rank: u32, world: u32) -> Vec<u8> {
    let mut bytes = b"TPFUSE02".to_vec();
    bytes.extend_from_slice(&rank.to_le_bytes());
    bytes.extend_from_slice(&world.to_le_bytes());
    bytes.extend_from_slice(&(RUN.len() as u32).to_le_bytes());
    bytes.extend_from_slice(RUN.as_bytes());
    bytes
}

const SHORT: Duration = Duration::from_secs(1);
const LONG: Duration = Duration::from_secs(3);
/// The run id of the TCP tests.
const RUN: &str = "test-run";

// ----------------------------------------------------------------------------------------
// unique ids
// ----------------------------------------------------------------------------------------

#[test]
fn unique_id_round_trips_through_bytes_and_hex() {
    for _ in 0..20 {
        let id = random_id();
        assert_eq!(UniqueId::from_bytes(id.as_bytes()).unwrap(), id);

        let hex = id.to_hex();
        assert_eq!(hex.len(), 2 * UNIQUE_ID_BYTES);
        assert!(hex
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)));
        assert_eq!(UniqueId::from_hex(&hex).unwrap(), id);
        assert_eq!(hex.parse::<UniqueId>().unwrap(), id);
        assert_eq!(id.to_string(), hex);
        assert_eq!(
            UniqueId::from_hex(&format!("  {}\n", hex.to_uppercase())).unwrap(),
            id
        );

        let debug = format!("{id:?}");
        assert_eq!(debug, format!("UniqueId({}…)", &hex[..8]));
    }
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    bytes[0] = 0x0f;
    bytes[127] = 0xa0;
    let hex = UniqueId::from_bytes(&bytes).unwrap().to_hex();
    assert!(hex.starts_with("0f00") && hex.ends_with("00a0"), "{hex}");
}

#[test]
fn a_thousand_random_ids_are_distinct() {
    let ids: Vec<UniqueId> = (0..1000).map(|_| random_id()).collect();
    let distinct: HashSet<UniqueId> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), ids.len());
    let hexes: HashSet<String> = ids.iter().map(UniqueId::to_hex).collect();
    assert_eq!(hexes.len(), ids.len());
}

#[test]
fn malformed_ids_are_rejected() {
    let good = random_id().to_hex();
    let malformed = |result: tpfuse::Result<UniqueId>| match result {
        Err(Error::MalformedUniqueId(message)) => message,
        other => panic!("expected MalformedUniqueId, got {other:?}"),
    };

    assert!(malformed(UniqueId::from_hex(&good[..255])).contains("255"));
    assert!(malformed(UniqueId::from_hex(&format!("{good}0"))).contains("257"));
    assert!(malformed(UniqueId::from_hex("")).contains('0'));

    let mut bad = good.clone().into_bytes();
    bad[17] = b'g';
    let message = malformed(UniqueId::from_hex(std::str::from_utf8(&bad).unwrap()));
    assert!(
        message.contains("'g'") && message.contains("17"),
        "{message}"
    );
    let message = malformed(format!("é{}", &good[1..]).parse::<UniqueId>());
    assert!(
        message.contains("'é'") && message.contains("position 0"),
        "{message}"
    );

    assert!(malformed(UniqueId::from_bytes(&[0; 127])).contains("127"));
    assert!(malformed(UniqueId::from_bytes(&[0; 129])).contains("129"));
    assert!(malformed(UniqueId::from_bytes(&[])).contains('0'));
}

// ----------------------------------------------------------------------------------------
// launcher environments
// ----------------------------------------------------------------------------------------

#[test]
fn launch_env_from_torchrun() {
    let env = LaunchEnv::from_vars(vars(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node-0"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RUN_ID", "job-42"),
    ]))
    .unwrap();
    assert_eq!(env.launcher, Launcher::Torchrun);
    assert_eq!((env.rank, env.world, env.local_rank), (5, 8, 1));
    assert_eq!(env.master_addr.as_deref(), Some("node-0"));
    assert_eq!(env.master_port, Some(29500));
    assert_eq!(env.run_id.as_deref(), Some("job-42"));
    assert_eq!(env.rendezvous_port(), Some(29501));
    assert_eq!(env.rendezvous_file, None);

    // torchrun's default rendezvous id is "none" in every run: no run id at all.
    let env = LaunchEnv::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("TORCHELASTIC_RUN_ID", "none"),
    ]))
    .unwrap();
    assert_eq!(env.run_id, None);
}

#[test]
fn launch_env_from_slurm() {
    let env = LaunchEnv::from_vars(vars(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "3"),
        ("SLURM_JOB_ID", "1234"),
        ("SLURM_STEP_ID", "7"),
        ("TPFUSE_RENDEZVOUS_FILE", "/shared/run.id"),
    ]))
    .unwrap();
    assert_eq!(env.launcher, Launcher::Slurm);
    assert_eq!((env.rank, env.world, env.local_rank), (3, 4, 3));
    assert_eq!(env.run_id.as_deref(), Some("1234.7"));
    assert_eq!(env.master_addr, None);
    assert_eq!(env.rendezvous_port(), None);
    assert_eq!(env.rendezvous_file, Some(PathBuf::from("/shared/run.id")));
}

#[test]
fn launch_env_from_open_mpi() {
    let base = [
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("TPFUSE_MASTER_PORT", "4000"),
        ("OMPI_MCA_ess_base_jobid", "99"),
    ];
    let env = LaunchEnv::from_vars(vars(&base)).unwrap();
    assert_eq!(env.launcher, Launcher::OpenMpi);
    assert_eq!((env.rank, env.world, env.local_rank), (0, 2, 0));
    assert_eq!(env.run_id.as_deref(), Some("99"));
    assert_eq!(env.master_port, None);
    assert_eq!(env.rendezvous_port(), Some(4000));

    let with_pmix = [&base[..], &[("PMIX_NAMESPACE", "prterun-host-123@1")]].concat();
    let env = LaunchEnv::from_vars(vars(&with_pmix)).unwrap();
    assert_eq!(env.run_id.as_deref(), Some("prterun-host-123@1"));
}

#[test]
fn launch_env_precedence() {
    let torchrun = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")];
    let mpi = [
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ];
    let slurm = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_LOCALID", "0"),
    ];

    let all = [&torchrun[..], &mpi, &slurm].concat();
    let env = LaunchEnv::from_vars(vars(&all)).unwrap();
    assert_eq!((env.launcher, env.rank), (Launcher::Torchrun, 1));

    // mpirun inside a Slurm allocation inherits SLURM_* variables of the allocation.
    let mpi_in_slurm = [&mpi[..], &slurm].concat();
    let env = LaunchEnv::from_vars(vars(&mpi_in_slurm)).unwrap();
    assert_eq!(
        (env.launcher, env.rank, env.world),
        (Launcher::OpenMpi, 2, 4)
    );
}

#[test]
fn launch_env_errors_name_the_variable() {
    let none = launch_env_error(&[("MASTER_ADDR", "x")]);
    for name in ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"] {
        assert!(none.contains(name), "{none}");
    }
    assert!(launch_env_error(&[("RANK", "  ")]).contains("no launcher"));

    let missing = launch_env_error(&[("RANK", "0"), ("LOCAL_RANK", "0")]);
    assert!(missing.contains("WORLD_SIZE"), "{missing}");
    let missing = launch_env_error(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]);
    assert!(missing.contains("SLURM_LOCALID"), "{missing}");

    let torchrun = |rank: &'static str, world: &'static str, local: &'static str| {
        launch_env_error(&[("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local)])
    };
    let bad = torchrun("one", "2", "0");
    assert!(bad.contains("RANK") && bad.contains("one"), "{bad}");
    let bad = torchrun("-1", "2", "0");
    assert!(bad.contains("-1"), "{bad}");
    let bad = torchrun("2", "2", "0");
    assert!(
        bad.contains("RANK=2") && bad.contains("WORLD_SIZE=2"),
        "{bad}"
    );
    let bad = torchrun("0", "2", "5");
    assert!(bad.contains("LOCAL_RANK=5"), "{bad}");
    let bad = torchrun("0", "0", "0");
    assert!(bad.contains("WORLD_SIZE=0"), "{bad}");
    let bad = launch_env_error(&[
        ("OMPI_COMM_WORLD_RANK", "4"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ]);
    assert!(bad.contains("OMPI_COMM_WORLD_RANK=4"), "{bad}");

    let good = [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")];
    for (name, value) in [
        ("MASTER_PORT", "http"),
        ("MASTER_PORT", "70000"),
        ("MASTER_PORT", "0"),
        ("TPFUSE_MASTER_PORT", "-5"),
    ] {
        let bad = launch_env_error(&[&good[..], &[(name, value)]].concat());
        assert!(bad.contains(name) && bad.contains(value), "{bad}");
    }
}

#[test]
fn rendezvous_port_rules() {
    let env = |extra: &[(&str, &str)]| {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")];
        LaunchEnv::from_vars(vars(&[&base[..], extra].concat())).unwrap()
    };
    assert_eq!(env(&[]).rendezvous_port(), None);
    assert_eq!(
        env(&[("MASTER_PORT", "29500")]).rendezvous_port(),
        Some(29501)
    );
    assert_eq!(env(&[("MASTER_PORT", "65535")]).rendezvous_port(), None);
    assert_eq!(
        env(&[("TPFUSE_MASTER_PORT", "1234")]).rendezvous_port(),
        Some(1234)
    );
    let both = env(&[("MASTER_PORT", "29500"), ("TPFUSE_MASTER_PORT", "1234")]);
    assert_eq!(both.rendezvous_port(), Some(1234));
    assert_eq!(both.master_port, Some(29500));
}

// ----------------------------------------------------------------------------------------
// file rendezvous
// ----------------------------------------------------------------------------------------

type Publisher = thread::JoinHandle<tpfuse::Result<()>>;

/// Rank 0 of the file rendezvous, on a thread.
fn publisher(path: &Path, run: &str, world: usize, id: UniqueId, timeout: Duration) -> Publisher {
    let (path, run) = (path.to_path_buf(), run.to_owned());
    thread::spawn(move || publish_file(&path, &run, world, &id, timeout))
}

/// Ranks `1..world` of the file rendezvous, on threads.
fn readers(path: &Path, run: &str, world: usize, timeout: Duration) -> Vec<Peer> {
    (1..world)
        .map(|rank| {
            let (path, run) = (path.to_path_buf(), run.to_owned());
            thread::spawn(move || read_file(&path, &run, rank, world, timeout))
        })
        .collect()
}

/// A whole file rendezvous of run `run`, which leaves its file at `path`; returns its id.
fn finished_rendezvous(path: &Path, run: &str, world: usize) -> UniqueId {
    let id = random_id();
    let readers = readers(path, run, world, LONG);
    publish_file(path, run, world, &id, LONG).unwrap();
    for reader in readers {
        assert_eq!(reader.join().unwrap().unwrap(), id);
    }
    id
}

#[test]
fn file_rendezvous_across_threads() {
    let dir = TempDir::new("file-threads");
    for world in 2..=8 {
        let path = dir.file(&format!("world-{world}.id"));
        let run = format!("run-{world}");
        let id = random_id();
        let readers = readers(&path, &run, world, LONG);
        thread::sleep(Duration::from_millis(20 * (world as u64 % 3)));
        publish_file(&path, &run, world, &id, LONG).unwrap();
        for reader in readers {
            assert_eq!(reader.join().unwrap().unwrap(), id);
        }
    }
    // Only the published files remain: no temporary file or arrival is left behind.
    let names: Vec<_> = std::fs::read_dir(&dir.0).unwrap().collect();
    assert_eq!(names.len(), 7, "{names:?}");
}

#[test]
fn a_late_reader_never_takes_a_finished_rendezvous() {
    // A reader that comes after rank 0 has published cannot tell that file from an earlier
    // attempt's: it waits for a rank 0 of its own.
    let dir = TempDir::new("late");
    let path = dir.file("id");
    finished_rendezvous(&path, "r", 2);
    let wait = Duration::from_millis(200);
    match read_file(&path, "r", 1, 2, wait) {
        Err(Error::Timeout { what, .. }) => assert!(what.contains("earlier attempt"), "{what}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn a_file_of_another_run_is_never_returned_and_is_replaced_mid_wait() {
    let dir = TempDir::new("replaced");
    let path = dir.file("id");
    finished_rendezvous(&path, "run-1", 4);
    let old_rank_0 = publisher(&path, "run-1", 4, random_id(), SHORT);
    let new = random_id();
    let readers = readers(&path, "run-2", 4, LONG);
    thread::sleep(Duration::from_millis(300));
    assert!(
        readers.iter().all(|r| !r.is_finished()),
        "a reader returned the id of another run"
    );
    assert!(matches!(
        old_rank_0.join().unwrap(),
        Err(Error::Timeout { .. })
    ));
    let start = Instant::now();
    publish_file(&path, "run-2", 4, &new, LONG).unwrap();
    for reader in readers {
        assert_eq!(reader.join().unwrap().unwrap(), new);
    }
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn file_world_mismatch_and_garbage() {
    let dir = TempDir::new("garbage");
    let path = dir.file("id");
    let rank_0 = publisher(&path, "r", 4, random_id(), Duration::from_millis(300));
    thread::sleep(Duration::from_millis(50));
    match read_file(&path, "r", 1, 2, SHORT) {
        Err(Error::WorldSizeMismatch {
            expected: 2,
            got: 4,
            ..
        }) => {}
        other => panic!("expected WorldSizeMismatch, got {other:?}"),
    }
    assert!(matches!(rank_0.join().unwrap(), Err(Error::Timeout { .. })));

    for content in [
        "tpfuse-rendezvous v2\nrun_id r\nworld two\nnonce 00\nstate open\n",
        "tpfuse-rendezvous v2\nrun_id r\nworld 2\nstate open\n",
        "tpfuse-rendezvous v2\nrun_id r\nworld 2\nnonce 00\nstate closed\n",
    ] {
        std::fs::write(&path, content).unwrap();
        let start = Instant::now();
        match read_file(&path, "r", 1, 2, LONG) {
            Err(Error::Rendezvous { peer, .. }) => assert!(peer.contains("id"), "{peer}"),
            other => panic!("expected Error::Rendezvous for {content:?}, got {other:?}"),
        }
        assert!(start.elapsed() < SHORT, "garbage was not reported at once");
    }

    // A file in another format might be replaced; it is waited on, and named on timeout.
    std::fs::write(&path, "hello\n").unwrap();
    let wait = Duration::from_millis(200);
    match read_file(&path, "r", 1, 2, wait) {
        Err(Error::Timeout { what, .. }) => assert!(what.contains("not a tpfuse"), "{what}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    // Nothing at all: a plain timeout, on both sides.
    let start = Instant::now();
    match read_file(&dir.file("missing"), "r", 1, 2, wait) {
        Err(Error::Timeout { after, .. }) => assert_eq!(after, wait),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_elapsed_within(start, wait);
    let start = Instant::now();
    match publish_file(&dir.file("alone"), "r", 3, &random_id(), wait) {
        Err(Error::Timeout { what, after }) => {
            assert_eq!(after, wait);
            assert!(what.contains("[1, 2]"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_elapsed_within(start, wait);
}

#[test]
fn file_arguments_are_checked() {
    let dir = TempDir::new("args");
    let path = dir.file("id");
    let id = random_id();
    for run in ["", "two\nlines"] {
        assert!(matches!(
            publish_file(&path, run, 2, &id, SHORT),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            read_file(&path, run, 1, 2, SHORT),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert!(matches!(
        publish_file(&path, "r", 0, &id, SHORT),
        Err(Error::InvalidArgument { .. })
    ));
    for rank in [0, 2] {
        assert!(matches!(
            read_file(&path, "r", rank, 2, SHORT),
            Err(Error::RankOutOfRange { .. })
        ));
    }
    assert!(matches!(
        publish_file(&dir.file("no/such/dir/id"), "r", 2, &id, SHORT),
        Err(Error::Io { .. })
    ));
}

// ----------------------------------------------------------------------------------------
// TCP rendezvous
// ----------------------------------------------------------------------------------------

#[test]
fn tcp_rendezvous_across_threads() {
    for world in 2..=8 {
        let (listener, addr) = local_listener();
        let id = random_id();
        let server = thread::spawn(move || serve_tcp_on(listener, RUN, world, &id, LONG));
        let peers: Vec<_> = (1..world)
            .rev()
            .map(|rank| thread::spawn(move || join_tcp(addr, RUN, rank, world, LONG)))
            .collect();
        for peer in peers {
            assert_eq!(peer.join().unwrap().unwrap(), id);
        }
        server.join().unwrap().unwrap();
    }
}

#[test]
fn tcp_peers_may_come_before_the_server() {
    let (listener, addr) = local_listener();
    let id = random_id();
    drop(listener);
    let peers: Vec<_> = (1..3)
        .map(|rank| thread::spawn(move || join_tcp(addr, RUN, rank, 3, LONG)))
        .collect();
    thread::sleep(Duration::from_millis(200));
    serve_tcp(addr, RUN, 3, &id, LONG).unwrap();
    for peer in peers {
        assert_eq!(peer.join().unwrap().unwrap(), id);
    }
}

type Server = thread::JoinHandle<tpfuse::Result<()>>;
type Peer = thread::JoinHandle<tpfuse::Result<UniqueId>>;

/// Starts a server for `world` and good peers `ranks`, and waits until they are connected.
fn server_with_good_peers(world: usize, ranks: &[usize]) -> (SocketAddr, Server, Vec<Peer>) {
    let (listener, addr) = local_listener();
    let id = random_id();
    let server = thread::spawn(move || serve_tcp_on(listener, RUN, world, &id, LONG));
    let peers = ranks
        .iter()
        .map(|&rank| thread::spawn(move || join_tcp(addr, RUN, rank, world, LONG)))
        .collect();
    thread::sleep(Duration::from_millis(300));
    (addr, server, peers)
}

/// Every good peer got an error from rank 0 quickly, not a timeout.
fn assert_peers_told(peers: Vec<Peer>, start: Instant) {
    for peer in peers {
        match peer.join().unwrap() {
            Err(Error::Rendezvous { peer, .. }) => assert!(peer.contains("rank 0"), "{peer}"),
            other => panic!("expected Error::Rendezvous on a good peer, got {other:?}"),
        }
    }
    assert!(
        start.elapsed() < SHORT,
        "peers waited {:?}",
        start.elapsed()
    );
}

#[test]
fn tcp_world_size_mismatch() {
    let (addr, server, good) = server_with_good_peers(4, &[1, 2]);
    let start = Instant::now();
    match join_tcp(addr, RUN, 2, 3, LONG) {
        Err(Error::Rendezvous { reason, .. }) => assert!(reason.contains("mismatch"), "{reason}"),
        other => panic!("expected Error::Rendezvous on the bad peer, got {other:?}"),
    }
    match server.join().unwrap() {
        Err(Error::WorldSizeMismatch {
            expected: 4,
            rank: 2,
            got: 3,
        }) => {}
        other => panic!("expected WorldSizeMismatch on rank 0, got {other:?}"),
    }
    assert_peers_told(good, start);
}

#[test]
fn tcp_duplicate_rank() {
    let (addr, server, good) = server_with_good_peers(3, &[1]);
    let start = Instant::now();
    assert!(matches!(
        join_tcp(addr, RUN, 1, 3, LONG),
        Err(Error::Rendezvous { .. })
    ));
    assert!(matches!(
        server.join().unwrap(),
        Err(Error::DuplicateRank(1))
    ));
    assert_peers_told(good, start);
}

#[test]
fn tcp_rank_out_of_range() {
    assert!(matches!(
        join_tcp("127.0.0.1:1", RUN, 0, 2, SHORT),
        Err(Error::RankOutOfRange { rank: 0, world: 2 })
    ));
    assert!(matches!(
        join_tcp("127.0.0.1:1", RUN, 2, 2, SHORT),
        Err(Error::RankOutOfRange { rank: 2, world: 2 })
    ));

    // A peer that claims rank 0 (or 5 of 3) on the wire.
    for rank in [0, 5] {
        let (addr, server, good) = server_with_good_peers(3, &[2]);
        let start = Instant::now();
        let mut liar = TcpStream::connect(addr).unwrap();
        liar.write_all(&hello(rank, 3)).unwrap();
        match server.join().unwrap() {
            Err(Error::RankOutOfRange { rank: r, world: 3 }) => assert_eq!(r, rank as usize),
            other => panic!("expected RankOutOfRange, got {other:?}"),
        }
        assert_peers_told(good, start);
    }
}

#[test]
fn tcp_garbage_peer_is_dropped_and_the_rendezvous_goes_on() {
    let (addr, server, good) = server_with_good_peers(3, &[1]);
    let mut junk = TcpStream::connect(addr).unwrap();
    junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    junk.set_read_timeout(Some(SHORT)).unwrap();
    // Rank 0 closes the connection without a word.
    let mut answer = Vec::new();
    match junk.read_to_end(&mut answer) {
        Ok(0) => {}
        // Closed with our bytes unread.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected rank 0 to hang up, got {other:?} and {answer:?}"),
    }
    // A peer that connects and hangs up without a hello.
    drop(TcpStream::connect(addr).unwrap());
    // A tpfuse peer of an older protocol.
    let mut old = TcpStream::connect(addr).unwrap();
    old.write_all(b"TPFUSE01\x02\x00\x00\x00\x03\x00\x00\x00")
        .unwrap();
    thread::sleep(Duration::from_millis(100));
    assert!(
        !server.is_finished(),
        "rank 0 gave up on a stray connection"
    );
    assert!(good.iter().all(|peer| !peer.is_finished()));
    assert!(join_tcp(addr, RUN, 2, 3, SHORT).is_ok());
    for peer in good {
        assert!(peer.join().unwrap().is_ok());
    }
    server.join().unwrap().unwrap();
}

#[test]
fn tcp_garbage_server() {
    for reply in [
        &b"HTTP/1.0 400 Bad Request\r\n\r\n"[..],
        b"TPFUSE02\x07",
        b"TPFUSE02\x00\x01",
    ] {
        let (listener, addr) = local_listener();
        let server = thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut hello = [0u8; 16];
            stream.read_exact(&mut hello).unwrap();
            stream.write_all(reply).unwrap();
        });
        let start = Instant::now();
        match join_tcp(addr, RUN, 1, 2, LONG) {
            Err(Error::Rendezvous { peer, .. }) => assert!(peer.contains(&addr.to_string())),
            other => panic!("expected Error::Rendezvous for {reply:?}, got {other:?}"),
        }
        assert!(start.elapsed() < SHORT);
        server.join().unwrap();
    }
}

#[test]
fn tcp_join_with_nobody_listening_times_out() {
    let (listener, addr) = local_listener();
    drop(listener);
    let start = Instant::now();
    match join_tcp(addr, RUN, 1, 2, SHORT) {
        Err(Error::Timeout { after, what }) => {
            assert_eq!(after, SHORT);
            assert!(what.contains(&addr.to_string()), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_elapsed_within(start, SHORT);
}

#[test]
fn tcp_serve_with_missing_peers_times_out() {
    let (listener, addr) = local_listener();
    let id = random_id();
    let start = Instant::now();
    let server = thread::spawn(move || serve_tcp_on(listener, RUN, 4, &id, SHORT));
    let peer = thread::spawn(move || join_tcp(addr, RUN, 2, 4, LONG));
    match server.join().unwrap() {
        Err(Error::Timeout { what, after }) => {
            assert_eq!(after, SHORT);
            assert!(what.contains("[1, 3]"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_elapsed_within(start, SHORT);
    // The peer that came is told at once, not left to its own, longer timeout.
    assert!(matches!(
        peer.join().unwrap(),
        Err(Error::Rendezvous { .. })
    ));
    assert!(start.elapsed() < SHORT + Duration::from_millis(500));

    // A peer that connects but never says hello holds nobody past the deadline.
    let (listener, addr) = local_listener();
    let start = Instant::now();
    let server = thread::spawn(move || serve_tcp_on(listener, RUN, 2, &id, SHORT));
    let _silent = TcpStream::connect(addr).unwrap();
    assert!(matches!(server.join().unwrap(), Err(Error::Timeout { .. })));
    assert_elapsed_within(start, SHORT);
}

#[test]
fn tcp_world_of_one_needs_nobody() {
    let start = Instant::now();
    serve_tcp("127.0.0.1:0", RUN, 1, &random_id(), LONG).unwrap();
    assert!(start.elapsed() < Duration::from_millis(100));
    assert!(matches!(
        serve_tcp("127.0.0.1:0", RUN, 0, &random_id(), LONG),
        Err(Error::InvalidArgument { .. })
    ));
}

// ----------------------------------------------------------------------------------------
// unique_id_from_env
// ----------------------------------------------------------------------------------------

fn free_port() -> u16 {
    local_listener().1.port()
}

fn env_of(rank: usize, world: usize, extra: &[(&str, &str)]) -> LaunchEnv {
    let (rank, world) = (rank.to_string(), world.to_string());
    let base = [
        ("RANK", rank.as_str()),
        ("WORLD_SIZE", world.as_str()),
        ("LOCAL_RANK", "0"),
    ];
    LaunchEnv::from_vars(vars(&[&base[..], extra].concat())).unwrap()
}

#[test]
fn unique_id_from_env_over_tcp() {
    let port = free_port().to_string();
    let id = random_id();
    let extra = [
        ("MASTER_ADDR", "127.0.0.1"),
        ("TPFUSE_MASTER_PORT", port.as_str()),
    ];
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            let env = env_of(rank, 3, &extra);
            thread::spawn(move || {
                let create = move || {
                    assert_eq!(rank, 0, "only rank 0 creates the id");
                    Ok(id)
                };
                unique_id_from_env(&env, create, LONG)
            })
        })
        .collect();
    for rank in ranks {
        assert_eq!(rank.join().unwrap().unwrap(), id);
    }
}

#[test]
fn unique_id_from_env_over_a_file() {
    let dir = TempDir::new("env-file");
    let file = dir.file("id");
    let file = file.to_str().unwrap();
    let id = random_id();
    let extra = [
        ("TPFUSE_RENDEZVOUS_FILE", file),
        ("TORCHELASTIC_RUN_ID", "abc"),
    ];
    let ranks: Vec<_> = (0..4)
        .rev()
        .map(|rank| {
            let env = env_of(rank, 4, &extra);
            thread::spawn(move || unique_id_from_env(&env, move || Ok(id), LONG))
        })
        .collect();
    for rank in ranks {
        assert_eq!(rank.join().unwrap().unwrap(), id);
    }
}

#[test]
fn unique_id_from_env_needs_a_rendezvous() {
    let id = random_id();
    let create = || Ok(id);
    // A world of one exchanges nothing.
    assert_eq!(
        unique_id_from_env(&env_of(0, 1, &[]), create, SHORT).unwrap(),
        id
    );

    let launch_error = |env: LaunchEnv| match unique_id_from_env(&env, create, SHORT) {
        Err(Error::LaunchEnv(message)) => message,
        other => panic!("expected Error::LaunchEnv, got {other:?}"),
    };
    let message = launch_error(env_of(1, 2, &[]));
    assert!(
        message.contains("MASTER_ADDR") && message.contains("TPFUSE_RENDEZVOUS_FILE"),
        "{message}"
    );
    let message = launch_error(env_of(1, 2, &[("MASTER_ADDR", "127.0.0.1")]));
    assert!(message.contains("MASTER_PORT"), "{message}");
    let message = launch_error(env_of(1, 2, &[("TPFUSE_RENDEZVOUS_FILE", "/tmp/x")]));
    assert!(message.contains("run id"), "{message}");
}

// ----------------------------------------------------------------------------------------
// across processes
// ----------------------------------------------------------------------------------------

const CHILD_RANK: &str = "TPFUSE_TEST_CHILD_RANK";
const CHILD_WORLD: &str = "TPFUSE_TEST_CHILD_WORLD";
const CHILD_ADDR: &str = "TPFUSE_TEST_CHILD_ADDR";
const CHILD_FILE: &str = "TPFUSE_TEST_CHILD_FILE";
const CHILD_RUN: &str = "TPFUSE_TEST_CHILD_RUN";

/// Not a test of its own: the body of a child process of `*_across_processes`. Without
/// its environment variables it does nothing.
#[test]
fn child_rank() {
    let Ok(rank) = std::env::var(CHILD_RANK) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let world: usize = std::env::var(CHILD_WORLD).unwrap().parse().unwrap();
    let id = if let Ok(addr) = std::env::var(CHILD_ADDR) {
        join_tcp(addr.as_str(), RUN, rank, world, LONG).unwrap()
    } else {
        let file = std::env::var(CHILD_FILE).unwrap();
        let run = std::env::var(CHILD_RUN).unwrap();
        read_file(Path::new(&file), &run, rank, world, LONG).unwrap()
    };
    // On a line of its own: the test harness has printed "test child_rank ... " before.
    println!("\nID {id}");
}

/// Child processes, killed and reaped on drop whatever happened.
struct Children(Vec<Child>);

impl Children {
    fn spawn(world: usize, vars: &[(&str, String)]) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut children = Children(Vec::new());
        for rank in 1..world {
            let child = Command::new(&exe)
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env(CHILD_RANK, rank.to_string())
                .env(CHILD_WORLD, world.to_string())
                .envs(vars.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            children.0.push(child);
        }
        children
    }

    /// Waits (bounded) for every child and returns the id each printed.
    fn ids(&mut self, within: Duration) -> Vec<UniqueId> {
        let deadline = Instant::now() + within;
        let mut ids = Vec::new();
        for child in &mut self.0 {
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                assert!(
                    Instant::now() < deadline,
                    "a child did not finish in {within:?}"
                );
                thread::sleep(Duration::from_millis(10));
            };
            let mut out = String::new();
            let mut err = String::new();
            child
                .stdout
                .take()
                .unwrap()
                .read_to_string(&mut out)
                .unwrap();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            assert!(status.success(), "child failed ({status}):\n{out}\n{err}");
            let printed: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix("ID ")).collect();
            assert_eq!(printed.len(), 1, "child printed:\n{out}");
            ids.push(printed[0].parse().unwrap());
        }
        ids
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn tcp_rendezvous_across_processes() {
    for world in [2, 4, 8] {
        let (listener, addr) = local_listener();
        let id = random_id();
        let mut children = Children::spawn(world, &[(CHILD_ADDR, addr.to_string())]);
        serve_tcp_on(listener, RUN, world, &id, LONG).unwrap();
        let ids = children.ids(LONG);
        assert_eq!(ids.len(), world - 1);
        assert!(
            ids.iter().all(|got| *got == id),
            "world {world}: {ids:?} != {id:?}"
        );
    }
}

#[test]
fn file_rendezvous_across_processes() {
    let dir = TempDir::new("file-processes");
    for world in [2, 4, 8] {
        let path = dir.file("id");
        let run = format!("run-{}-{world}", std::process::id());
        // A file of another run, or of an earlier attempt of this very run id (a requeue,
        // a restart), is there first; the children must wait past it.
        let earlier = if world == 2 {
            finished_rendezvous(&path, "an-earlier-run", world)
        } else {
            finished_rendezvous(&path, &run, world)
        };
        let id = random_id();
        let mut children = Children::spawn(
            world,
            &[
                (CHILD_FILE, path.to_str().unwrap().to_owned()),
                (CHILD_RUN, run.clone()),
            ],
        );
        thread::sleep(Duration::from_millis(100));
        publish_file(&path, &run, world, &id, LONG).unwrap();
        let ids = children.ids(LONG);
        assert!(
            !ids.contains(&earlier),
            "world {world}: a child took the earlier id"
        );
        assert_eq!(ids.len(), world - 1);
        assert!(
            ids.iter().all(|got| *got == id),
            "world {world}: {ids:?} != {id:?}"
        );
    }
}

// ----------------------------------------------------------------------------------------
// issue 11: jobs that share a port or a path, repeated run ids, stray connections
// ----------------------------------------------------------------------------------------

fn slurm_env(extra: &[(&str, &str)]) -> LaunchEnv {
    let base = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_ID", "1234"),
        ("SLURM_STEP_ID", "7"),
    ];
    LaunchEnv::from_vars(vars(&[&base[..], extra].concat())).unwrap()
}

#[test]
fn run_id_holds_the_restart_count_and_tpfuse_run_id_wins() {
    let first = slurm_env(&[]).run_id.unwrap();
    let requeued = slurm_env(&[("SLURM_RESTART_COUNT", "1")]).run_id.unwrap();
    let again = slurm_env(&[("SLURM_RESTART_COUNT", "2")]).run_id.unwrap();
    assert!(first.starts_with("1234.7"), "{first}");
    assert!(
        requeued.starts_with("1234.7") && requeued.contains('1'),
        "{requeued}"
    );
    assert!(
        first != requeued && requeued != again,
        "{first} {requeued} {again}"
    );

    let torchrun = |extra: &[(&str, &str)]| env_of(1, 2, extra).run_id;
    let run = [("TORCHELASTIC_RUN_ID", "abc")];
    let restarted = [&run[..], &[("TORCHELASTIC_RESTART_COUNT", "3")]].concat();
    assert_ne!(torchrun(&run), torchrun(&restarted));
    assert!(torchrun(&restarted).unwrap().contains('3'));

    // The user's own run id replaces the launcher's; the restart count still counts.
    let mine = slurm_env(&[("TPFUSE_RUN_ID", "mine")]).run_id.unwrap();
    assert!(mine.starts_with("mine") && !mine.contains("1234"), "{mine}");
    assert_eq!(torchrun(&[("TPFUSE_RUN_ID", "x")]).as_deref(), Some("x"));
    let mine_again = slurm_env(&[("TPFUSE_RUN_ID", "mine"), ("SLURM_RESTART_COUNT", "1")]);
    assert_ne!(mine_again.run_id.unwrap(), mine);
    assert_eq!(torchrun(&[]), None);
}

#[test]
fn launch_env_refuses_a_stray_world_of_one_under_another_launcher() {
    let stray = [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")];
    let mpi = [
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
    ];
    let srun = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "1"),
    ];
    let message = launch_env_error(&[&stray[..], &mpi].concat());
    assert!(
        message.contains("WORLD_SIZE=1") && message.contains("OMPI_COMM_WORLD_SIZE=4"),
        "{message}"
    );
    let message = launch_env_error(&[&stray[..], &srun].concat());
    assert!(
        message.contains("WORLD_SIZE=1") && message.contains("SLURM_NTASKS=2"),
        "{message}"
    );

    // Nested launchers are normal: `srun torchrun` with one task per node.
    let nested = [("RANK", "5"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "5")];
    let env = LaunchEnv::from_vars(vars(&[&nested[..], &srun].concat())).unwrap();
    assert_eq!(
        (env.launcher, env.rank, env.world),
        (Launcher::Torchrun, 5, 16)
    );
    // `mpirun -np 1` inside a Slurm allocation of several tasks.
    let single_mpi = [
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "1"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ];
    let env = LaunchEnv::from_vars(vars(&[&single_mpi[..], &srun].concat())).unwrap();
    assert_eq!((env.launcher, env.world), (Launcher::OpenMpi, 1));
}

#[test]
fn master_port_65535_says_why_it_cannot_be_used() {
    let env = env_of(
        1,
        2,
        &[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "65535")],
    );
    match unique_id_from_env(&env, || Ok(random_id()), SHORT) {
        Err(Error::LaunchEnv(message)) => assert!(
            message.contains("MASTER_PORT=65535")
                && message.contains("MASTER_PORT + 1")
                && message.contains("TPFUSE_MASTER_PORT"),
            "{message}"
        ),
        other => panic!("expected Error::LaunchEnv, got {other:?}"),
    }
}

#[test]
fn tcp_bind_error_names_the_address_the_port_and_rank_0() {
    let blocker = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = blocker.local_addr().unwrap().port();
    let master = (port - 1).to_string();
    let env = env_of(
        0,
        2,
        &[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &master)],
    );
    let start = Instant::now();
    let message = unique_id_from_env(&env, || Ok(random_id()), SHORT)
        .unwrap_err()
        .to_string();
    assert!(start.elapsed() < SHORT, "took {:?}", start.elapsed());
    for part in [
        format!("0.0.0.0:{port}"),
        String::from("MASTER_PORT + 1"),
        String::from("TPFUSE_MASTER_PORT"),
        String::from("RANK=0"),
    ] {
        assert!(message.contains(&part), "no {part:?} in: {message}");
    }
}

#[test]
fn tcp_jobs_sharing_a_port_do_not_mix() {
    let port = free_port().to_string();
    let (id_a, id_b) = (random_id(), random_id());
    let job = |rank: usize, run: &str| {
        env_of(
            rank,
            2,
            &[
                ("MASTER_ADDR", "127.0.0.1"),
                ("TPFUSE_MASTER_PORT", &port),
                ("TORCHELASTIC_RUN_ID", run),
            ],
        )
    };
    let start = Instant::now();
    let a0 = {
        let env = job(0, "job-A");
        thread::spawn(move || unique_id_from_env(&env, move || Ok(id_a), LONG))
    };
    thread::sleep(Duration::from_millis(100));
    // Job B's rank 0 cannot listen: the port is job A's.
    assert!(unique_id_from_env(&job(0, "job-B"), move || Ok(id_b), SHORT).is_err());
    // Job B's rank 1 reaches job A's rank 0 and is turned away, at once.
    match unique_id_from_env(&job(1, "job-B"), || unreachable!(), SHORT) {
        Err(Error::Rendezvous { reason, .. }) => {
            assert!(
                reason.contains("job-A") && reason.contains("job-B"),
                "{reason}"
            )
        }
        other => panic!("expected Error::Rendezvous for job B's rank 1, got {other:?}"),
    }
    assert!(start.elapsed() < SHORT, "took {:?}", start.elapsed());
    // Job A's rank 0 kept waiting for its own rank 1.
    assert!(!a0.is_finished());
    let a1 = unique_id_from_env(&job(1, "job-A"), || unreachable!(), SHORT).unwrap();
    assert_eq!(a1, id_a);
    assert_eq!(a0.join().unwrap().unwrap(), id_a);
}

#[test]
fn tcp_stray_connections_do_not_break_the_rendezvous() {
    let (listener, addr) = local_listener();
    let id = random_id();
    let start = Instant::now();
    let server = thread::spawn(move || serve_tcp_on(listener, RUN, 3, &id, LONG));
    // A connection that never speaks, an HTTP request and a port scan come first.
    let _silent = TcpStream::connect(addr).unwrap();
    let mut http = TcpStream::connect(addr).unwrap();
    http.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    drop(TcpStream::connect(addr).unwrap());
    thread::sleep(Duration::from_millis(50));
    let peers: Vec<_> = [1, 2]
        .into_iter()
        .map(|rank| thread::spawn(move || join_tcp(addr, RUN, rank, 3, LONG)))
        .collect();
    for peer in peers {
        assert_eq!(peer.join().unwrap().unwrap(), id);
    }
    server.join().unwrap().unwrap();
    assert!(start.elapsed() < SHORT, "stalled for {:?}", start.elapsed());
}

#[test]
fn a_file_of_another_run_names_its_run_id_and_the_expected_one() {
    let dir = TempDir::new("other-run");
    let path = dir.file("id");
    let env = |rank: usize, run: &str| {
        env_of(
            rank,
            2,
            &[
                ("TPFUSE_RENDEZVOUS_FILE", path.to_str().unwrap()),
                ("TORCHELASTIC_RUN_ID", run),
            ],
        )
    };
    let other = thread::spawn({
        let env = env(0, "job-other");
        move || unique_id_from_env(&env, || Ok(random_id()), Duration::from_millis(600))
    });
    thread::sleep(Duration::from_millis(100));
    match unique_id_from_env(
        &env(1, "job-mine"),
        || unreachable!(),
        Duration::from_millis(300),
    ) {
        Err(Error::Timeout { what, .. }) => {
            assert!(
                what.contains("\"job-other\"") && what.contains("expected \"job-mine\""),
                "{what}"
            );
            assert!(!what.contains("stale"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let _ = other.join().unwrap();
}

#[test]
fn file_rendezvous_never_hands_out_the_id_of_an_earlier_attempt() {
    let dir = TempDir::new("attempts");
    let path = dir.file("id");
    let env = |rank: usize| {
        env_of(
            rank,
            3,
            &[
                ("TPFUSE_RENDEZVOUS_FILE", path.to_str().unwrap()),
                ("TORCHELASTIC_RUN_ID", "same-every-attempt"),
            ],
        )
    };
    let attempt = |readers_first: bool| {
        let id = random_id();
        let spawn = |rank: usize| {
            let env = env(rank);
            thread::spawn(move || unique_id_from_env(&env, move || Ok(id), LONG))
        };
        let mut ranks = Vec::new();
        if readers_first {
            ranks.push(spawn(1));
            ranks.push(spawn(2));
            thread::sleep(Duration::from_millis(300));
            assert!(
                ranks.iter().all(|r| !r.is_finished()),
                "a reader returned before rank 0 came"
            );
            ranks.push(spawn(0));
        } else {
            ranks.push(spawn(0));
            thread::sleep(Duration::from_millis(100));
            ranks.push(spawn(1));
            ranks.push(spawn(2));
        }
        for rank in ranks {
            assert_eq!(rank.join().unwrap().unwrap(), id);
        }
    };
    attempt(false);
    // The same run id again (a requeue, a restart, a reused --rdzv-id): the previous
    // attempt's file is there, and the readers come first.
    attempt(true);
    attempt(true);
    attempt(false);
}
