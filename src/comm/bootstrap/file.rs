//! The file rendezvous: rank 0 publishes the id in a file every rank sees.

use std::fs;
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use super::{check_world, deadline_after, time_left};
use crate::comm::unique_id::UniqueId;
use crate::error::{Error, Result};

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

/// Publishes `id` for run `run_id` of `world` ranks at `path` (rank 0's side of the file
/// rendezvous).
///
/// The write is atomic: the file is written under a temporary name in the same directory
/// and renamed over `path`, replacing any file already there (such as one from an earlier
/// run). `run_id` must be the token the readers pass to [`read_file`]: the launcher's job id
/// ([`LaunchEnv::run_id`](super::LaunchEnv::run_id)) or any other token that is the same on every rank of this run
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
/// the timeout passes. Pass the launcher's job id ([`LaunchEnv::run_id`](super::LaunchEnv::run_id)) or any other
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
