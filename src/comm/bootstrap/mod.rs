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
//!   every rank sees. Each file carries a *run id* so that another job's file is never
//!   mistaken for this run's, and a handshake (each reader's fresh token, quoted back by
//!   rank 0) so that an earlier attempt's file with the same run id never is either.
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
//!     std::thread::spawn(move || bootstrap::read_file(&path, "job-17", 1, 2, Duration::from_secs(5)))
//! };
//! bootstrap::publish_file(&path, "job-17", 2, &id, Duration::from_secs(5))?;
//! assert_eq!(reader.join().unwrap()?, id);
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), tpfuse::Error>(())
//! ```

mod file;
mod launch_env;
mod tcp;

pub use file::{publish_file, read_file};
pub use launch_env::{LaunchEnv, Launcher};
pub use tcp::{join_tcp, serve_tcp, serve_tcp_on};

use crate::comm::unique_id::UniqueId;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// Errors unless the world has at least one rank.
pub(crate) fn check_world(world: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::invalid("world", "the world size must be at least 1"));
    }
    Ok(())
}

/// The instant `timeout` from now; a timeout too long to represent is cut to a year.
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

/// What is left until `deadline`, or `None` once it has passed.
pub(crate) fn time_left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

/// What a rank 0 that cannot listen on `port` should know: where the port came from, and
/// the two usual causes of a port that is taken.
fn listen_advice(env: &LaunchEnv, port: u16) -> String {
    let origin = match (env.tpfuse_master_port, env.master_port) {
        (Some(_), _) => format!(
            "port {port} comes from TPFUSE_MASTER_PORT (without it, the port is MASTER_PORT + 1)"
        ),
        (None, Some(master)) => format!(
            "port {port} is MASTER_PORT + 1 ({master} + 1); set TPFUSE_MASTER_PORT to use another"
        ),
        (None, None) => {
            format!("port {port} (MASTER_PORT + 1 by default; TPFUSE_MASTER_PORT overrides it)")
        }
    };
    let rank_variable = env.launcher.rank_variable();
    format!(
        "{origin}. This process is rank 0 because {} says so ({rank_variable}=0), so whoever holds \
         the port is another job on this node using the same port (give each job its own MASTER_PORT \
         or TPFUSE_MASTER_PORT), or another process of this job that also believes it is rank 0 \
         (every process saw {rank_variable}=0: a stray {rank_variable}=0 in the shell under \
         mpirun or srun?)",
        env.launcher
    )
}

/// Gets this run's unique id on every rank, the way the launcher environment `env` says.
///
/// Rank 0 calls `create` (the other ranks never do) and shares the result:
///
/// - **TCP**, when `MASTER_ADDR` is set: the hello of every rank carries
///   [`LaunchEnv::run_id`] (empty when there is none) and the world size, and rank 0 turns
///   away ranks of another run. Rank 0 serves on port
///   [`LaunchEnv::rendezvous_port`] of all its interfaces (`0.0.0.0`, or `[::]` when
///   `MASTER_ADDR` is an IPv6 address), not only on `MASTER_ADDR`'s address: a host's own
///   name often resolves to a loopback address on the host itself (`127.0.1.1` in
///   Debian's `/etc/hosts`), which the other nodes could not reach. The other ranks
///   connect to `MASTER_ADDR`.
/// - **a file**, when `MASTER_ADDR` is not set and `TPFUSE_RENDEZVOUS_FILE` is: rank 0
///   publishes at that path, with [`LaunchEnv::run_id`] as the run id, once every rank has
///   arrived; a reader never takes the id of an earlier attempt with the same run id.
///
/// With `world == 1`, `create` is called and nothing is exchanged. Every wait is bounded
/// by `timeout`.
///
/// # Errors
///
/// [`Error::LaunchEnv`] when neither rendezvous is configured, when `MASTER_ADDR` is set
/// but no port is (or `MASTER_PORT` is 65535, leaving no room for `MASTER_PORT + 1`), or when the file rendezvous is chosen but the launcher gave no run id;
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
            Error::LaunchEnv(match env.master_port {
                Some(port) => format!(
                    "MASTER_PORT={port} leaves no port for the TCP rendezvous, which listens on MASTER_PORT + 1 \
                     (and {port} + 1 is past 65535): set TPFUSE_MASTER_PORT to a free port, or use a lower MASTER_PORT"
                ),
                None => String::from(
                    "MASTER_ADDR is set but no rendezvous port: set MASTER_PORT (the rendezvous uses MASTER_PORT + 1) or TPFUSE_MASTER_PORT",
                ),
            })
        })?;
        let host = master.trim_start_matches('[').trim_end_matches(']');
        let run_id = env.run_id.as_deref().unwrap_or("");
        if env.rank == 0 {
            let any = if host.parse::<std::net::Ipv6Addr>().is_ok() {
                "::"
            } else {
                "0.0.0.0"
            };
            let listener = tcp::bind_listener((any, port), &listen_advice(env, port))?;
            let id = create()?;
            serve_tcp_on(listener, run_id, env.world, &id, timeout)?;
            Ok(id)
        } else {
            join_tcp((host, port), run_id, env.rank, env.world, timeout)
        }
    } else if let Some(path) = &env.rendezvous_file {
        let run_id = env.run_id.as_deref().ok_or_else(|| {
            Error::LaunchEnv(format!(
                "TPFUSE_RENDEZVOUS_FILE is set but {} gave no run id to tell this run's file from another job's; set TPFUSE_RUN_ID to a token that is the same on every rank of this run, or set MASTER_ADDR and MASTER_PORT to use TCP instead",
                env.launcher
            ))
        })?;
        if env.rank == 0 {
            let id = create()?;
            publish_file(path, run_id, env.world, &id, timeout)?;
            Ok(id)
        } else {
            read_file(path, run_id, env.rank, env.world, timeout)
        }
    } else {
        Err(Error::LaunchEnv(String::from(
            "no rendezvous configured: set MASTER_ADDR and MASTER_PORT (or TPFUSE_MASTER_PORT) for TCP, or TPFUSE_RENDEZVOUS_FILE to a path that every rank sees",
        )))
    }
}
