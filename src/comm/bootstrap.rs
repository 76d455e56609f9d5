//! Bootstrap: how rank 0's NCCL unique id reaches every rank.
//!
//! Before ranks can build a communicator, rank 0 creates a [`UniqueId`] and every other
//! rank must receive the same 128 bytes. This module does that exchange without NCCL,
//! in one of two ways:
//!
//! - **TCP** ([`serve_tcp`] on rank 0, [`join_tcp`] on the others): rank 0 listens, the
//!   others connect, say who they are, and get the id back. Use it whenever the ranks can
//!   reach rank 0's host, e.g. through the `MASTER_ADDR` a launcher already sets.
//! - **a file** ([`publish_file`] on rank 0, [`read_file`] on the others) on a filesystem
//!   every rank sees. Each file carries a *run id* so that a file left over from an earlier
//!   run is never mistaken for this run's.
//!
//! [`LaunchEnv`] reads rank, world size and rendezvous settings from the variables of
//! torchrun, Open MPI or Slurm, and [`unique_id_from_env`] puts it all together. Every wait
//! is bounded by a timeout; none of these functions can hang.
//!
//! # Example
//!
//! Under `torchrun --nproc-per-node 8 my_engine` (or `srun`, or `mpirun` with `MASTER_ADDR`
//! and `MASTER_PORT` exported), every process runs:
//!
//! ```no_run
//! use std::time::Duration;
//! use tpfuse::comm::{bootstrap::{unique_id_from_env, LaunchEnv}, UniqueId};
//!
//! # fn create_with_nccl() -> tpfuse::Result<UniqueId> { UniqueId::from_bytes(&[0; 128]) }
//! let env = LaunchEnv::from_env()?;
//! // `create_with_nccl` stands for `UniqueId::new`, which asks NCCL for a new id;
//! // only rank 0 calls it.
//! let id = unique_id_from_env(&env, create_with_nccl, Duration::from_secs(60))?;
//! // ... build the communicator of `env.world` ranks with `id` on rank `env.rank`.
//! # Ok::<(), tpfuse::Error>(())
//! ```
//!
//! The file rendezvous, here between two threads:
//!
//! ```
//! use std::time::Duration;
//! use tpfuse::comm::{bootstrap, UniqueId};
//!
//! let path = std::env::temp_dir().join(format!("tpfuse-doc-{}.id", std::process::id()));
//! let id = UniqueId::from_bytes(&[42; 128])?;
//! let reader = {
//!     let path = path.clone();
//!     std::thread::spawn(move || bootstrap::read_file(&path, "job-17", 2, Duration::from_secs(5)))
//! };
//! bootstrap::publish_file(&path, "job-17", 2, &id)?;
//! assert_eq!(reader.join().unwrap()?, id);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), tpfuse::Error>(())
//! ```

use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::unique_id::{UniqueId, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};

// ---------------------------------------------------------------------------------------
// Launcher environment
// ---------------------------------------------------------------------------------------

/// The program that started this process and told it its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// PyTorch's `torchrun` (or anything that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`).
    Torchrun,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`).
    OpenMpi,
}

impl fmt::Display for Launcher {
    /// The launcher's usual name: `torchrun`, `slurm` or `openmpi`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::OpenMpi => "openmpi",
        })
    }
}

/// Rank, world size and rendezvous settings of this process, as its launcher set them.
///
/// Built by [`LaunchEnv::from_env`]; the fields are public so that an engine with its own
/// launcher can fill one in by hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Which launcher's variables were found.
    pub launcher: Launcher,
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// The number of processes (ranks) in the job, at least 1.
    pub world: usize,
    /// This process's rank among the processes on its node; usually its GPU index.
    pub local_rank: usize,
    /// `MASTER_ADDR`: the host of rank 0, where the TCP rendezvous listens.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`: torchrun's own store port. See [`LaunchEnv::rendezvous_port`].
    pub master_port: Option<u16>,
    /// A token that is the same on every rank of this run and differs between runs: the
    /// launcher's job id. `None` when the launcher sets none.
    pub run_id: Option<String>,
    /// `TPFUSE_MASTER_PORT`: the port of the TCP rendezvous, when it should not be
    /// `MASTER_PORT + 1`.
    pub tpfuse_master_port: Option<u16>,
    /// `TPFUSE_RENDEZVOUS_FILE`: the path of the file rendezvous, used when `MASTER_ADDR`
    /// is not set.
    pub rendezvous_file: Option<PathBuf>,
}

/// The variables of one launcher: rank, world size, local rank.
struct LauncherVars {
    launcher: Launcher,
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
}

/// In the order they are tried. Open MPI comes before Slurm because `mpirun` inside a Slurm
/// allocation inherits the allocation's `SLURM_*` variables, which then describe the
/// allocation, not this process.
const LAUNCHERS: [LauncherVars; 3] = [
    LauncherVars {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        world: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
    },
    LauncherVars {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    },
    LauncherVars {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        world: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
    },
];

impl LaunchEnv {
    /// Reads the launcher's variables from this process's environment.
    ///
    /// See [`LaunchEnv::from_vars`] for what is read.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the launcher's variables through `get`, which returns a variable's value or
    /// `None` when it is unset. A value that is empty or only whitespace counts as unset.
    ///
    /// The launcher is the first of these whose rank variable is set:
    ///
    /// | launcher | rank, world, local rank | run id |
    /// |---|---|---|
    /// | torchrun | `RANK`, `WORLD_SIZE`, `LOCAL_RANK` | `TORCHELASTIC_RUN_ID` (unless `none`) |
    /// | Open MPI | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` | `PMIX_NAMESPACE`, else `OMPI_MCA_ess_base_jobid` |
    /// | Slurm | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` | `SLURM_JOB_ID.SLURM_STEP_ID` |
    ///
    /// torchrun sets `TORCHELASTIC_RUN_ID` to its `--rdzv-id`, which is `none` unless given
    /// (or `--standalone` is used); `none` is the same in every run, so it is no run id.
    ///
    /// Open MPI is tried before Slurm: `mpirun` inside a Slurm allocation inherits `SLURM_*`
    /// variables that describe the allocation, not the MPI process.
    ///
    /// Whatever the launcher, `MASTER_ADDR`, `MASTER_PORT`, `TPFUSE_MASTER_PORT` and
    /// `TPFUSE_RENDEZVOUS_FILE` are read too.
    ///
    /// # Errors
    ///
    /// [`Error::LaunchEnv`] when no launcher's variables are set, when one of the three
    /// variables of the launcher found is missing, when a value is not a number (or not a
    /// port), when the world size is 0, or when the rank or local rank is not below the
    /// world size; the message names the variable and its value.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let lookup = get;
        let get = |name: &str| {
            lookup(name)
                .map(|value| value.trim().to_owned())
                .filter(|value| !value.is_empty())
        };
        let vars = LAUNCHERS
            .iter()
            .find(|vars| get(vars.rank).is_some())
            .ok_or_else(|| {
                let looked_for: Vec<String> = LAUNCHERS
                    .iter()
                    .map(|v| format!("{} ({}, {}, {})", v.launcher, v.rank, v.world, v.local_rank))
                    .collect();
                Error::LaunchEnv(format!(
                    "no launcher found: looked for {}",
                    looked_for.join("; ")
                ))
            })?;

        let number = |name: &str| -> Result<usize> {
            let value = get(name).ok_or_else(|| {
                Error::LaunchEnv(format!(
                    "{name} is not set ({} sets {}, {} and {})",
                    vars.launcher, vars.rank, vars.world, vars.local_rank
                ))
            })?;
            value.parse().map_err(|_| {
                Error::LaunchEnv(format!("{name}={value:?} is not a non-negative integer"))
            })
        };
        let rank = number(vars.rank)?;
        let world = number(vars.world)?;
        let local_rank = number(vars.local_rank)?;
        if world == 0 {
            return Err(Error::LaunchEnv(format!(
                "{}=0: the world is empty",
                vars.world
            )));
        }
        for (name, value) in [(vars.rank, rank), (vars.local_rank, local_rank)] {
            if value >= world {
                return Err(Error::LaunchEnv(format!(
                    "{name}={value} is out of range for {}={world}",
                    vars.world
                )));
            }
        }

        let port = |name: &str| -> Result<Option<u16>> {
            let Some(value) = get(name) else {
                return Ok(None);
            };
            match value.parse::<u16>() {
                Ok(port) if port > 0 => Ok(Some(port)),
                _ => Err(Error::LaunchEnv(format!(
                    "{name}={value:?} is not a port number (1..=65535)"
                ))),
            }
        };

        let run_id = match vars.launcher {
            // torchrun's default `--rdzv-id` is "none", the same in every run.
            Launcher::Torchrun => get("TORCHELASTIC_RUN_ID").filter(|id| id != "none"),
            Launcher::OpenMpi => get("PMIX_NAMESPACE").or_else(|| get("OMPI_MCA_ess_base_jobid")),
            Launcher::Slurm => match (get("SLURM_JOB_ID"), get("SLURM_STEP_ID")) {
                (Some(job), Some(step)) => Some(format!("{job}.{step}")),
                (job, _) => job,
            },
        };

        Ok(LaunchEnv {
            launcher: vars.launcher,
            rank,
            world,
            local_rank,
            master_addr: get("MASTER_ADDR"),
            master_port: port("MASTER_PORT")?,
            run_id,
            tpfuse_master_port: port("TPFUSE_MASTER_PORT")?,
            rendezvous_file: get("TPFUSE_RENDEZVOUS_FILE").map(PathBuf::from),
        })
    }

    /// The port of the TCP rendezvous: `TPFUSE_MASTER_PORT` if set, else `MASTER_PORT + 1`.
    ///
    /// Not `MASTER_PORT` itself, because under torchrun rank 0's c10d store already listens
    /// there. `None` when neither is set (or `MASTER_PORT` is 65535).
    pub fn rendezvous_port(&self) -> Option<u16> {
        self.tpfuse_master_port
            .or_else(|| self.master_port.and_then(|port| port.checked_add(1)))
    }
}

/// The instant `timeout` from now; a timeout too long to represent is cut to a year.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

/// What is left until `deadline`, or `None` once it has passed.
fn time_left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

// ---------------------------------------------------------------------------------------
// File rendezvous
// ---------------------------------------------------------------------------------------
//
// The file is small text, written to a temporary name in the same directory and renamed
// over the final path, so a reader sees either no file, an old file or the whole new one:
//
//     tpfuse-unique-id v1
//     run_id <run id>
//     world <world size>
//     id <256 hex digits>

const FILE_MAGIC: &str = "tpfuse-unique-id v1";

/// Counts temporary files of this process, so that two threads never share one.
static TEMP_FILES: AtomicU64 = AtomicU64::new(0);

fn check_run_id(run_id: &str) -> Result<()> {
    if run_id.is_empty() || run_id.chars().any(char::is_control) {
        return Err(Error::invalid(
            "run_id",
            format!("{run_id:?}: must be non-empty, on one line, without control characters"),
        ));
    }
    Ok(())
}

fn check_world(world: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::invalid("world", "the world size must be at least 1"));
    }
    Ok(())
}

/// Publishes `id` for run `run_id` of `world` ranks at `path` (rank 0's side of the file
/// rendezvous).
///
/// The write is atomic: the file is written under a temporary name in the same directory
/// and renamed over `path`, replacing any file already there (such as one from an earlier
/// run). `run_id` must be the token the readers pass to [`read_file`]: the launcher's job id
/// ([`LaunchEnv::run_id`]) or any other token that is the same on every rank of this run
/// and new for each run.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an empty run id, one with control characters, or a world
/// of 0; [`Error::Io`] when the file cannot be written or renamed.
pub fn publish_file(path: &Path, run_id: &str, world: usize, id: &UniqueId) -> Result<()> {
    check_run_id(run_id)?;
    check_world(world)?;
    let name = path
        .file_name()
        .ok_or_else(|| Error::invalid("path", format!("{} names no file", path.display())))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let temp = dir.join(format!(
        ".{}.{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        TEMP_FILES.fetch_add(1, Ordering::Relaxed)
    ));
    let content = format!("{FILE_MAGIC}\nrun_id {run_id}\nworld {world}\nid {id}\n");

    let written = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .and_then(|mut file| {
            file.write_all(content.as_bytes())?;
            file.sync_all()
        })
        .and_then(|()| fs::rename(&temp, path));
    written.map_err(|e| {
        // Best effort: the temporary file may not even exist.
        let _ = fs::remove_file(&temp);
        Error::io(format!("publishing the unique id at {}", path.display()), e)
    })
}

/// What a look at the rendezvous file found.
enum FileState {
    /// No file at the path.
    Missing,
    /// A file that is not in the tpfuse format.
    Foreign,
    /// A tpfuse file of another run; holds its run id.
    Stale(String),
    /// The file of this run, with its id.
    Ready(UniqueId),
}

fn inspect_file(path: &Path, run_id: &str, world: usize) -> Result<FileState> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(FileState::Missing),
        Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
    };
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    if lines.first() != Some(&FILE_MAGIC) {
        return Ok(FileState::Foreign);
    }
    let field = |key: &str| {
        lines
            .iter()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix(' '))
    };
    match field("run_id") {
        Some(found) if found == run_id => {}
        Some(found) => return Ok(FileState::Stale(found.to_owned())),
        None => return Ok(FileState::Stale(String::from("<none>"))),
    }
    let garbage = |reason: String| Error::Rendezvous {
        peer: path.display().to_string(),
        reason,
    };
    let got: usize = field("world")
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| garbage(format!("run {run_id:?}: no valid `world` line")))?;
    if got != world {
        return Err(Error::WorldSizeMismatch {
            expected: world,
            rank: 0,
            got,
        });
    }
    let hex = field("id").ok_or_else(|| garbage(format!("run {run_id:?}: no `id` line")))?;
    let id = UniqueId::from_hex(hex).map_err(|e| garbage(format!("run {run_id:?}: {e}")))?;
    Ok(FileState::Ready(id))
}

/// Waits for rank 0's [`publish_file`] of run `run_id` at `path` and returns its id (the
/// other ranks' side of the file rendezvous).
///
/// Polls the file, sleeping 10 ms at first and up to 100 ms between looks. The run id
/// decides what is stale: a file with another run id is left over from an earlier run and
/// is never returned, however long it stays; the wait goes on until rank 0 replaces it or
/// the timeout passes. Pass the launcher's job id ([`LaunchEnv::run_id`]) or any other
/// token that is the same on every rank of this run and new for each run.
///
/// # Errors
///
/// - [`Error::Timeout`] when no file of this run appeared within `timeout`; its text says
///   when a stale file (naming its run) or a file in another format was found.
/// - [`Error::WorldSizeMismatch`] when the file of this run was published for another
///   world size.
/// - [`Error::Rendezvous`] when the file of this run has no valid world or id.
/// - [`Error::Io`] when the file exists but cannot be read.
/// - [`Error::InvalidArgument`] for a bad `run_id` or a world of 0.
pub fn read_file(path: &Path, run_id: &str, world: usize, timeout: Duration) -> Result<UniqueId> {
    check_run_id(run_id)?;
    check_world(world)?;
    let deadline = deadline_after(timeout);
    let mut pause = Duration::from_millis(10);
    let last_seen = loop {
        let state = inspect_file(path, run_id, world)?;
        if let FileState::Ready(id) = state {
            return Ok(id);
        }
        let Some(left) = time_left(deadline) else {
            break state;
        };
        thread::sleep(pause.min(left));
        pause = (pause * 3 / 2).min(Duration::from_millis(100));
    };
    let seen = match last_seen {
        FileState::Stale(other) => format!("; found a stale file from run {other:?}"),
        FileState::Foreign => String::from("; found a file that is not a tpfuse unique id file"),
        FileState::Missing | FileState::Ready(_) => String::new(),
    };
    Err(Error::Timeout {
        what: format!(
            "the unique id file {} of run {run_id:?}{seen}",
            path.display()
        ),
        after: timeout,
    })
}

// ---------------------------------------------------------------------------------------
// TCP rendezvous
// ---------------------------------------------------------------------------------------
//
// Protocol (all integers little-endian):
//
//   peer -> rank 0   hello:  b"TPFUSE01", u32 rank, u32 world                 (16 bytes)
//   rank 0 -> peer   reply:  b"TPFUSE01", u8 status, then
//                            status 0: the 128 bytes of the unique id
//                            status 1: u32 length, that many bytes of UTF-8 error message
//
// Rank 0 accepts connections until ranks 1..world have each said hello once, then sends
// every peer the id. A hello with bad magic, another world size, a rank outside 1..world
// or a rank already seen aborts the rendezvous: rank 0 sends an error reply to the
// offender and to every peer already waiting (so nobody waits for the timeout) and
// returns the error. Each side closes its connection after the reply.

const TCP_MAGIC: [u8; 8] = *b"TPFUSE01";
const HELLO_BYTES: usize = 16;
const STATUS_OK: u8 = 0;
const STATUS_ERROR: u8 = 1;
/// The longest error message a peer accepts.
const MAX_MESSAGE_BYTES: u32 = 64 * 1024;
/// How long a reply may take to write; replies are small, so this only matters for a peer
/// that stopped reading.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// The pause between two looks for a new connection on rank 0.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Serves `id` to ranks `1..world` on `listener_addr` (rank 0's side of the TCP
/// rendezvous).
///
/// Binds a listener and runs [`serve_tcp_on`]. With `world == 1` there is nobody to serve:
/// it returns at once without binding.
///
/// # Errors
///
/// [`Error::Io`] when the address cannot be bound, otherwise as [`serve_tcp_on`].
pub fn serve_tcp(
    listener_addr: impl ToSocketAddrs,
    world: usize,
    id: &UniqueId,
    timeout: Duration,
) -> Result<()> {
    check_world(world)?;
    if world == 1 {
        return Ok(());
    }
    let listener = TcpListener::bind(listener_addr)
        .map_err(|e| Error::io("binding the rendezvous listener", e))?;
    serve_tcp_on(listener, world, id, timeout)
}

/// Serves `id` to ranks `1..world` on an already bound `listener`, returning once every one
/// of them has received it.
///
/// Connections are accepted until each of ranks `1..world` has said hello once, all within
/// `timeout`; then each gets the id. A peer that breaks the protocol aborts the rendezvous
/// for everybody: the offender and every peer already connected get an error reply.
///
/// # Errors
///
/// - [`Error::Rendezvous`] (naming the peer's address) for a peer that sends something that
///   is not a tpfuse hello or closes its connection early, or when a reply cannot be sent.
/// - [`Error::WorldSizeMismatch`] for a peer with another world size.
/// - [`Error::RankOutOfRange`] for a peer whose rank is not in `1..world`.
/// - [`Error::DuplicateRank`] for a second peer with the same rank.
/// - [`Error::Timeout`] when some ranks have not said hello within `timeout`; the text
///   lists them.
/// - [`Error::Io`] when the listener fails; [`Error::InvalidArgument`] for `world == 0`.
pub fn serve_tcp_on(
    listener: TcpListener,
    world: usize,
    id: &UniqueId,
    timeout: Duration,
) -> Result<()> {
    check_world(world)?;
    if world == 1 {
        return Ok(());
    }
    let deadline = deadline_after(timeout);
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("making the rendezvous listener non-blocking", e))?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut joined = 0;
    while joined < world - 1 {
        match accept_peer(&listener, world, &peers, deadline, timeout) {
            Accepted::Peer(rank, stream) => {
                peers[rank] = Some(stream);
                joined += 1;
            }
            Accepted::Nobody => match time_left(deadline) {
                Some(left) => thread::sleep(ACCEPT_POLL.min(left)),
                None => {
                    let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
                    let error = Error::Timeout {
                        what: format!("ranks {missing:?} to join the TCP rendezvous"),
                        after: timeout,
                    };
                    abort_peers(&peers, None, &error);
                    return Err(error);
                }
            },
            Accepted::Refused(error, offender) => {
                abort_peers(&peers, offender, &error);
                return Err(error);
            }
        }
    }

    let mut reply = Vec::with_capacity(TCP_MAGIC.len() + 1 + UNIQUE_ID_BYTES);
    reply.extend_from_slice(&TCP_MAGIC);
    reply.push(STATUS_OK);
    reply.extend_from_slice(id.as_bytes());
    let mut first_failure = None;
    for (rank, stream) in peers.iter().enumerate() {
        let Some(stream) = stream else { continue };
        if let Err(e) = write_reply(stream, &reply) {
            first_failure.get_or_insert(Error::Rendezvous {
                peer: format!("rank {rank}"),
                reason: format!("sending the unique id failed: {e}"),
            });
        }
    }
    first_failure.map_or(Ok(()), Err)
}

/// What one look for a new connection on rank 0 found.
enum Accepted {
    /// Nobody is waiting to connect.
    Nobody,
    /// A peer with a good hello, and its rank.
    Peer(usize, TcpStream),
    /// A failure, with the connection of the peer that broke the protocol (if one did), to
    /// send it the error.
    Refused(Error, Option<TcpStream>),
}

/// Accepts at most one connection and checks its hello.
fn accept_peer(
    listener: &TcpListener,
    world: usize,
    peers: &[Option<TcpStream>],
    deadline: Instant,
    timeout: Duration,
) -> Accepted {
    let (mut stream, addr) = match listener.accept() {
        Ok(accepted) => accepted,
        Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {
            return Accepted::Nobody
        }
        // The peer gave up before we took its connection; it will retry or time out.
        Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => return Accepted::Nobody,
        Err(e) => {
            return Accepted::Refused(Error::io("accepting a rendezvous connection", e), None)
        }
    };
    match read_hello(&mut stream, addr, world, peers, deadline, timeout) {
        Ok(rank) => Accepted::Peer(rank, stream),
        Err(error) => Accepted::Refused(error, Some(stream)),
    }
}

/// Reads and checks one hello; returns the peer's rank.
fn read_hello(
    stream: &mut TcpStream,
    addr: SocketAddr,
    world: usize,
    peers: &[Option<TcpStream>],
    deadline: Instant,
    timeout: Duration,
) -> Result<usize> {
    let garbage = |reason: String| Error::Rendezvous {
        peer: addr.to_string(),
        reason,
    };
    let timed_out = || Error::Timeout {
        what: format!("a hello from {addr}"),
        after: timeout,
    };
    let left = time_left(deadline).ok_or_else(timed_out)?;
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(left)))
        .map_err(|e| Error::io(format!("configuring the connection from {addr}"), e))?;

    let mut hello = [0u8; HELLO_BYTES];
    if let Err(e) = stream.read_exact(&mut hello) {
        return Err(if is_timeout(&e) {
            timed_out()
        } else {
            garbage(format!("reading its hello failed: {e}"))
        });
    }
    let (magic, numbers) = hello.split_at(TCP_MAGIC.len());
    if magic != TCP_MAGIC {
        return Err(garbage(format!(
            "not a tpfuse rendezvous hello (starts with {magic:02x?})"
        )));
    }
    let rank = u32_at(numbers, 0) as usize;
    let got = u32_at(numbers, 4) as usize;
    if got != world {
        return Err(Error::WorldSizeMismatch {
            expected: world,
            rank,
            got,
        });
    }
    if rank == 0 || rank >= world {
        return Err(Error::RankOutOfRange { rank, world });
    }
    if peers[rank].is_some() {
        return Err(Error::DuplicateRank(rank));
    }
    Ok(rank)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn write_reply(mut stream: &TcpStream, reply: &[u8]) -> io::Result<()> {
    stream.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))?;
    stream.write_all(reply)?;
    stream.flush()
}

/// Sends `error` to the offender and to every connected peer, best effort.
fn abort_peers(peers: &[Option<TcpStream>], offender: Option<TcpStream>, error: &Error) {
    let message = error.to_string();
    let length = message.len().min(MAX_MESSAGE_BYTES as usize);
    let mut reply = Vec::with_capacity(TCP_MAGIC.len() + 5 + length);
    reply.extend_from_slice(&TCP_MAGIC);
    reply.push(STATUS_ERROR);
    reply.extend_from_slice(&(length as u32).to_le_bytes());
    reply.extend_from_slice(&message.as_bytes()[..length]);
    for stream in peers.iter().flatten().chain(offender.as_ref()) {
        // A peer that is gone does not need the message.
        let _ = write_reply(stream, &reply);
    }
}

/// Fetches the unique id from rank 0's [`serve_tcp`] at `addr`, as rank `rank` of `world`
/// (the other ranks' side of the TCP rendezvous).
///
/// Connection attempts are retried, with pauses growing from 10 ms to 250 ms, until rank 0
/// listens or `timeout` passes; the whole exchange finishes within `timeout`.
///
/// # Errors
///
/// - [`Error::RankOutOfRange`] when `rank` is not in `1..world`.
/// - [`Error::Timeout`] when rank 0 could not be reached, or did not answer, in time.
/// - [`Error::Rendezvous`] when rank 0 reports a failure (its message is the reason) or
///   answers something that is not the tpfuse protocol.
pub fn join_tcp(
    addr: impl ToSocketAddrs,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<UniqueId> {
    if rank == 0 || rank >= world {
        return Err(Error::RankOutOfRange { rank, world });
    }
    let (Ok(wire_rank), Ok(wire_world)) = (u32::try_from(rank), u32::try_from(world)) else {
        return Err(Error::invalid(
            "world",
            format!("{world} does not fit in 32 bits"),
        ));
    };
    let deadline = deadline_after(timeout);
    let (mut stream, peer) = connect_until(&addr, deadline, timeout)?;
    let server = format!("rank 0 at {peer}");
    let timed_out = || Error::Timeout {
        what: format!("the unique id from {server}"),
        after: timeout,
    };
    let garbage = |reason: String| Error::Rendezvous {
        peer: server.clone(),
        reason,
    };
    let left = time_left(deadline).ok_or_else(timed_out)?;
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|e| Error::io(format!("configuring the connection to {server}"), e))?;

    let mut hello = [0u8; HELLO_BYTES];
    hello[..8].copy_from_slice(&TCP_MAGIC);
    hello[8..12].copy_from_slice(&wire_rank.to_le_bytes());
    hello[12..].copy_from_slice(&wire_world.to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| garbage(format!("sending the hello failed: {e}")))?;

    let mut read = |buf: &mut [u8]| -> Result<()> {
        stream.read_exact(buf).map_err(|e| {
            if is_timeout(&e) {
                timed_out()
            } else if e.kind() == io::ErrorKind::UnexpectedEof {
                garbage(String::from(
                    "connection closed before the reply was complete",
                ))
            } else {
                garbage(format!("reading the reply failed: {e}"))
            }
        })
    };
    let mut head = [0u8; 9];
    read(&mut head)?;
    if head[..8] != TCP_MAGIC {
        return Err(garbage(format!(
            "not a tpfuse rendezvous reply (starts with {:02x?})",
            &head[..8]
        )));
    }
    match head[8] {
        STATUS_OK => {
            let mut id = [0u8; UNIQUE_ID_BYTES];
            read(&mut id)?;
            Ok(UniqueId(id))
        }
        STATUS_ERROR => {
            let mut length = [0u8; 4];
            read(&mut length)?;
            let length = u32::from_le_bytes(length);
            if length > MAX_MESSAGE_BYTES {
                return Err(garbage(format!(
                    "error message of {length} bytes is too long"
                )));
            }
            let mut message = vec![0u8; length as usize];
            read(&mut message)?;
            Err(garbage(String::from_utf8_lossy(&message).into_owned()))
        }
        status => Err(garbage(format!("unknown reply status {status}"))),
    }
}

/// Connects to the first address of `addr` that accepts, retrying until `deadline`.
fn connect_until(
    addr: &impl ToSocketAddrs,
    deadline: Instant,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr)> {
    let mut pause = Duration::from_millis(10);
    let mut last_error = String::from("no attempt made");
    loop {
        match addr.to_socket_addrs() {
            Ok(candidates) => {
                for candidate in candidates {
                    let Some(left) = time_left(deadline) else {
                        break;
                    };
                    let attempt = left.min(Duration::from_secs(1));
                    match TcpStream::connect_timeout(&candidate, attempt) {
                        Ok(stream) => {
                            // Lower latency for the tiny messages; failure is harmless.
                            let _ = stream.set_nodelay(true);
                            return Ok((stream, candidate));
                        }
                        Err(e) => last_error = format!("{candidate}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("resolving the address: {e}"),
        }
        let Some(left) = time_left(deadline) else {
            return Err(Error::Timeout {
                what: format!(
                    "rank 0's TCP rendezvous to accept a connection (last error: {last_error})"
                ),
                after: timeout,
            });
        };
        thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

// ---------------------------------------------------------------------------------------
// From the launcher's environment
// ---------------------------------------------------------------------------------------

/// Gets this run's unique id on every rank, the way the launcher environment `env` says.
///
/// Rank 0 calls `create` (the other ranks never do) and shares the result:
///
/// - **TCP**, when `MASTER_ADDR` is set: rank 0 serves on port
///   [`LaunchEnv::rendezvous_port`] of all its interfaces (`0.0.0.0`, or `[::]` when
///   `MASTER_ADDR` is an IPv6 address), not only on `MASTER_ADDR`'s address: a host's own
///   name often resolves to a loopback address on the host itself (`127.0.1.1` in
///   Debian's `/etc/hosts`), which the other nodes could not reach. The other ranks
///   connect to `MASTER_ADDR`.
/// - **a file**, when `MASTER_ADDR` is not set and `TPFUSE_RENDEZVOUS_FILE` is: rank 0
///   publishes at that path, with [`LaunchEnv::run_id`] as the run id.
///
/// With `world == 1`, `create` is called and nothing is exchanged. Every wait is bounded
/// by `timeout`.
///
/// # Errors
///
/// [`Error::LaunchEnv`] when neither rendezvous is configured, when `MASTER_ADDR` is set
/// but no port is, or when the file rendezvous is chosen but the launcher gave no run id;
/// otherwise the errors of `create` and of the rendezvous functions.
pub fn unique_id_from_env(
    env: &LaunchEnv,
    create: impl FnOnce() -> Result<UniqueId>,
    timeout: Duration,
) -> Result<UniqueId> {
    if env.rank >= env.world {
        return Err(Error::RankOutOfRange {
            rank: env.rank,
            world: env.world,
        });
    }
    if env.world == 1 {
        return create();
    }
    if let Some(master) = &env.master_addr {
        let port = env.rendezvous_port().ok_or_else(|| {
            Error::LaunchEnv(String::from(
                "MASTER_ADDR is set but no rendezvous port: set MASTER_PORT (the rendezvous uses MASTER_PORT + 1) or TPFUSE_MASTER_PORT",
            ))
        })?;
        let host = master.trim_start_matches('[').trim_end_matches(']');
        if env.rank == 0 {
            let id = create()?;
            let any = if host.parse::<std::net::Ipv6Addr>().is_ok() {
                "::"
            } else {
                "0.0.0.0"
            };
            serve_tcp((any, port), env.world, &id, timeout)?;
            Ok(id)
        } else {
            join_tcp((host, port), env.rank, env.world, timeout)
        }
    } else if let Some(path) = &env.rendezvous_file {
        let run_id = env.run_id.as_deref().ok_or_else(|| {
            Error::LaunchEnv(format!(
                "TPFUSE_RENDEZVOUS_FILE is set but {} gave no run id to tell this run's file from an old one; set MASTER_ADDR and MASTER_PORT to use TCP instead",
                env.launcher
            ))
        })?;
        if env.rank == 0 {
            let id = create()?;
            publish_file(path, run_id, env.world, &id)?;
            Ok(id)
        } else {
            read_file(path, run_id, env.world, timeout)
        }
    } else {
        Err(Error::LaunchEnv(String::from(
            "no rendezvous configured: set MASTER_ADDR and MASTER_PORT (or TPFUSE_MASTER_PORT) for TCP, or TPFUSE_RENDEZVOUS_FILE to a path that every rank sees",
        )))
    }
}
