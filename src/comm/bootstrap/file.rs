//! The file rendezvous: rank 0 publishes the id in a file every rank sees.

use std::collections::hash_map::RandomState;
use std::fs;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, SystemTime};

use super::{check_world, deadline_after, time_left};
use crate::comm::unique_id::UniqueId;
use crate::error::{Error, Result};

// A run id can repeat: a Slurm requeue keeps the job and step ids, torchrun keeps its run
// id across restarts, a user reuses `--rdzv-id`. Then the previous attempt's file, with the
// same run id, is still at the path when the next attempt starts, and a reader that simply
// took the file of its run id would take the previous attempt's id. Comparing modification
// times with a start time would need the nodes' clocks to agree. Instead, a reader accepts
// only a file that proves it was written after the reader arrived, by quoting a random
// token that the reader made up on arrival.
//
// Files, in the directory of the path P (every one written to a temporary name in that
// directory and renamed into place, so a reader sees a whole file or none):
//
//   P              rank 0's file, in one of two states:
//                    tpfuse-rendezvous v2        tpfuse-rendezvous v2
//                    run_id <run id>             run_id <run id>
//                    world <world size>          world <world size>
//                    nonce <32 hex digits>       nonce <32 hex digits>
//                    state open                  state ready
//                                                id <256 hex digits>
//                                                arrival <rank> <token>   (one per rank 1..world)
//   P.rank<r>      the arrival of rank r:
//                    tpfuse-rendezvous-arrival v2
//                    run_id <run id>
//                    world <world size>
//                    rank <r>
//                    nonce <the nonce of the open file it answers>
//                    token <32 hex digits>
//
// Rank 0 ([`publish_file`]) makes a fresh random nonce, writes P in state `open` with it
// (replacing whatever was there), then waits until every rank 1..world has an arrival of
// this run quoting that nonce, and writes P in state `ready` with the id and every
// arrival's token. It counts no arrival of an earlier attempt: none can quote a nonce that
// did not exist before this call.
//
// Rank r ([`read_file`]) makes a fresh random token, then polls P:
//
// - `open` of its run with a nonce it has not answered yet: it writes its arrival quoting
//   that nonce and its token;
// - `ready` of its run that lists its own rank and token: that is the id;
// - anything else (no file, another run, a `ready` file without its token, which is an
//   earlier attempt's): it waits.
//
// Both orders work. Rank 0 first: the readers find `open` and answer it. Readers first:
// they find the earlier attempt's `ready` file (or an `open` one left by a rank 0 that
// died), never see their token in it, and answer rank 0's `open` file once it replaces it.
// A reader can only see its token in a file that rank 0 wrote after reading the reader's
// arrival, so an id from an earlier attempt is never returned, whatever the clocks say.
// Once `ready` is written, rank 0 removes the arrivals and returns; it does not wait for
// the readers to read P.
//
// One path serves one job at a time: two jobs that share a path (different run ids) see
// each other's files, wait, and time out naming the other run.

const FILE_MAGIC: &str = "tpfuse-rendezvous v2";
const ARRIVAL_MAGIC: &str = "tpfuse-rendezvous-arrival v2";

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

/// 128 random bits as 32 hex digits, from the operating system's generator when it can be
/// read, else from the standard library's randomly keyed hasher.
fn fresh_token() -> String {
    let mut bytes = [0u8; 16];
    let from_os = fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if from_os.is_err() {
        for half in bytes.chunks_mut(8) {
            let mut hasher = RandomState::new().build_hasher();
            hasher.write_u32(std::process::id());
            hasher.write_u64(TEMP_FILES.fetch_add(1, Ordering::Relaxed));
            if let Ok(now) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
                hasher.write_u128(now.as_nanos());
            }
            half.copy_from_slice(&hasher.finish().to_le_bytes());
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The directory and file name of `path`.
fn split_path(path: &Path) -> Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::invalid("path", format!("{} names no file", path.display())))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((dir, name.to_string_lossy().into_owned()))
}

/// The path of rank `rank`'s arrival next to `path`.
fn arrival_path(path: &Path, rank: usize) -> Result<PathBuf> {
    let (dir, name) = split_path(path)?;
    Ok(dir.join(format!("{name}.rank{rank}")))
}

/// Writes `content` at `path` atomically: to a temporary name in the same directory, then
/// renamed over `path`.
fn write_atomically(path: &Path, content: &str, what: &str) -> Result<()> {
    let (dir, name) = split_path(path)?;
    let temp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        TEMP_FILES.fetch_add(1, Ordering::Relaxed)
    ));
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
        Error::io(format!("writing {what} at {}", path.display()), e)
    })
}

/// The `key value` lines of a file whose first line is `magic`, or `None` when the file is
/// missing or in another format. Errors only when the file exists but cannot be read.
fn read_fields(path: &Path, magic: &str) -> Result<Option<Vec<(String, String)>>> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
    };
    let text = String::from_utf8_lossy(&bytes);
    let mut lines = text.lines();
    if lines.next() != Some(magic) {
        return Ok(None);
    }
    Ok(Some(
        lines
            .filter_map(|line| line.split_once(' '))
            .map(|(key, value)| (key.to_owned(), value.to_owned()))
            .collect(),
    ))
}

fn field<'a>(fields: &'a [(String, String)], key: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Publishes `id` for run `run_id` of `world` ranks at `path` (rank 0's side of the file
/// rendezvous), returning once ranks `1..world` have all arrived and the id is written.
///
/// Writes `path` in state `open` with a fresh nonce, waits (polling, at most `timeout`) until
/// every rank has answered it with an arrival file (`path` + `.rank<r>`), then atomically
/// replaces `path` with the id and the tokens of those arrivals, and removes the arrivals.
/// The protocol, and why no reader can take the id of an earlier attempt with the same run
/// id, is described in this module's source. `run_id` must be the token the readers pass to
/// [`read_file`]: [`LaunchEnv::run_id`](super::LaunchEnv::run_id) or any other token that
/// is the same on every rank of this run. One path serves one job at a time.
///
/// # Errors
///
/// - [`Error::Timeout`] when some ranks have not arrived within `timeout`; the text lists
///   them.
/// - [`Error::WorldSizeMismatch`] for an arrival of this attempt with another world size.
/// - [`Error::InvalidArgument`] for an empty run id, one with control characters, a world
///   of 0 or a path that names no file; [`Error::Io`] when a file cannot be written, read
///   or renamed.
pub fn publish_file(
    path: &Path,
    run_id: &str,
    world: usize,
    id: &UniqueId,
    timeout: Duration,
) -> Result<()> {
    check_run_id(run_id)?;
    check_world(world)?;
    let deadline = deadline_after(timeout);
    let nonce = fresh_token();
    let head = format!("{FILE_MAGIC}\nrun_id {run_id}\nworld {world}\nnonce {nonce}\n");
    write_atomically(path, &format!("{head}state open\n"), "the rendezvous file")?;

    let arrivals = (1..world)
        .map(|rank| arrival_path(path, rank))
        .collect::<Result<Vec<_>>>()?;
    let mut tokens: Vec<Option<String>> = vec![None; world];
    let mut pause = Duration::from_millis(10);
    loop {
        for (rank, arrival) in (1..world).zip(&arrivals) {
            if tokens[rank].is_none() {
                tokens[rank] = answered(arrival, run_id, world, rank, &nonce)?;
            }
        }
        if tokens[1..].iter().all(Option::is_some) {
            break;
        }
        let Some(left) = time_left(deadline) else {
            let missing: Vec<usize> = (1..world).filter(|&r| tokens[r].is_none()).collect();
            return Err(Error::Timeout {
                what: format!(
                    "ranks {missing:?} of run {run_id:?} to arrive at the rendezvous file {}",
                    path.display()
                ),
                after: timeout,
            });
        };
        thread::sleep(pause.min(left));
        pause = (pause * 3 / 2).min(Duration::from_millis(100));
    }

    let mut ready = format!("{head}state ready\nid {id}\n");
    for (rank, token) in tokens.iter().enumerate().skip(1) {
        if let Some(token) = token {
            ready.push_str(&format!("arrival {rank} {token}\n"));
        }
    }
    write_atomically(path, &ready, "the unique id")?;
    for arrival in &arrivals {
        // Best effort: a leftover arrival is harmless, its nonce is never current again.
        let _ = fs::remove_file(arrival);
    }
    Ok(())
}

/// The token of rank `rank`'s arrival at `arrival` if it answers `nonce` of this run.
fn answered(
    arrival: &Path,
    run_id: &str,
    world: usize,
    rank: usize,
    nonce: &str,
) -> Result<Option<String>> {
    let Some(fields) = read_fields(arrival, ARRIVAL_MAGIC)? else {
        return Ok(None);
    };
    let this_attempt = field(&fields, "run_id") == Some(run_id)
        && field(&fields, "nonce") == Some(nonce)
        && field(&fields, "rank") == Some(rank.to_string().as_str());
    if !this_attempt {
        return Ok(None);
    }
    let got = field(&fields, "world").and_then(|w| w.parse().ok());
    if got != Some(world) {
        return Err(Error::WorldSizeMismatch {
            expected: world,
            rank,
            got: got.unwrap_or(0),
        });
    }
    Ok(field(&fields, "token").map(str::to_owned))
}

/// What a reader's look at rank 0's file found.
enum FileState {
    /// No file at the path.
    Missing,
    /// A file that is not in the tpfuse format.
    Foreign,
    /// A tpfuse file of another run; holds its run id.
    OtherRun(String),
    /// Rank 0 of this run collects arrivals; holds the nonce to answer.
    Open(String),
    /// A `ready` file of this run that does not list this reader's token: an earlier
    /// attempt's.
    Earlier,
    /// The id, in a `ready` file that lists this reader's token.
    Ready(UniqueId),
}

fn inspect_file(
    path: &Path,
    run_id: &str,
    rank: usize,
    world: usize,
    token: &str,
) -> Result<FileState> {
    let Some(fields) = read_fields(path, FILE_MAGIC)? else {
        return Ok(if path.exists() {
            FileState::Foreign
        } else {
            FileState::Missing
        });
    };
    match field(&fields, "run_id") {
        Some(found) if found == run_id => {}
        found => return Ok(FileState::OtherRun(found.unwrap_or("<none>").to_owned())),
    }
    let garbage = |reason: String| Error::Rendezvous {
        peer: path.display().to_string(),
        reason: format!("run {run_id:?}: {reason}"),
    };
    let got: usize = field(&fields, "world")
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| garbage(String::from("no valid `world` line")))?;
    if got != world {
        return Err(Error::WorldSizeMismatch {
            expected: world,
            rank: 0,
            got,
        });
    }
    let nonce = field(&fields, "nonce").ok_or_else(|| garbage(String::from("no `nonce` line")))?;
    match field(&fields, "state") {
        Some("open") => Ok(FileState::Open(nonce.to_owned())),
        Some("ready") => {
            let mine = format!("{rank} {token}");
            if !fields.iter().any(|(k, v)| k == "arrival" && *v == mine) {
                return Ok(FileState::Earlier);
            }
            let hex = field(&fields, "id").ok_or_else(|| garbage(String::from("no `id` line")))?;
            let id = UniqueId::from_hex(hex).map_err(|e| garbage(e.to_string()))?;
            Ok(FileState::Ready(id))
        }
        other => Err(garbage(format!("unknown state {other:?}"))),
    }
}

/// Waits for rank 0's [`publish_file`] of run `run_id` at `path` and returns its id, as rank
/// `rank` of `world` (the other ranks' side of the file rendezvous).
///
/// Makes a fresh random token, answers rank 0's `open` file with an arrival file
/// (`path` + `.rank<rank>`) and returns the id once rank 0's `ready` file lists that token.
/// So the id of an earlier attempt with the same run id (a Slurm requeue, a torchrun restart)
/// is never returned, however long its file stays, and without comparing clocks; the
/// protocol is described in this module's source. A file of another run is never returned
/// either. Polls, sleeping 10 ms at first and up to 100 ms between looks.
///
/// # Errors
///
/// - [`Error::Timeout`] when no id for this reader appeared within `timeout`; its text says
///   what was found instead: the run id of another run's file and the one expected, an
///   earlier attempt's file, or a file in another format.
/// - [`Error::WorldSizeMismatch`] when the file of this run is for another world size.
/// - [`Error::Rendezvous`] when the file of this run is malformed.
/// - [`Error::RankOutOfRange`] when `rank` is not in `1..world`.
/// - [`Error::Io`] when a file exists but cannot be read, or the arrival cannot be written.
/// - [`Error::InvalidArgument`] for a bad `run_id` or a world of 0.
pub fn read_file(
    path: &Path,
    run_id: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<UniqueId> {
    check_run_id(run_id)?;
    check_world(world)?;
    if rank == 0 || rank >= world {
        return Err(Error::RankOutOfRange { rank, world });
    }
    let arrival = arrival_path(path, rank)?;
    let token = fresh_token();
    let mut answered_nonce: Option<String> = None;
    let deadline = deadline_after(timeout);
    let mut pause = Duration::from_millis(10);
    let last_seen = loop {
        let state = inspect_file(path, run_id, rank, world, &token)?;
        match &state {
            FileState::Ready(id) => return Ok(*id),
            FileState::Open(nonce) if answered_nonce.as_ref() != Some(nonce) => {
                let content = format!(
                    "{ARRIVAL_MAGIC}\nrun_id {run_id}\nworld {world}\nrank {rank}\nnonce {nonce}\ntoken {token}\n"
                );
                write_atomically(&arrival, &content, "the arrival of this rank")?;
                answered_nonce = Some(nonce.clone());
                // Rank 0 may be quick: look again at once.
                continue;
            }
            _ => {}
        }
        let Some(left) = time_left(deadline) else {
            break state;
        };
        thread::sleep(pause.min(left));
        pause = (pause * 3 / 2).min(Duration::from_millis(100));
    };
    let seen = match last_seen {
        FileState::OtherRun(other) => format!(
            "; found a file of run {other:?}, expected {run_id:?} (another job using this path, or one that ran before)"
        ),
        FileState::Foreign => String::from("; found a file that is not a tpfuse rendezvous file"),
        FileState::Earlier => String::from(
            "; found only the file of an earlier attempt of this run id (rank 0 of this attempt has not come)",
        ),
        FileState::Open(_) => String::from(
            "; rank 0 is waiting for the other ranks (this one has arrived)",
        ),
        FileState::Missing | FileState::Ready(_) => String::new(),
    };
    Err(Error::Timeout {
        what: format!(
            "the unique id file {} of run {run_id:?} for rank {rank}{seen}",
            path.display()
        ),
        after: timeout,
    })
}
