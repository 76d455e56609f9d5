//! The rank, world size and rendezvous settings that torchrun, Open MPI or Slurm give a process.

use std::fmt;
use std::path::PathBuf;

use crate::error::{Error, Result};

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

impl Launcher {
    /// The variable that gives a process its rank under this launcher: `RANK`,
    /// `SLURM_PROCID` or `OMPI_COMM_WORLD_RANK`.
    pub fn rank_variable(self) -> &'static str {
        LAUNCHERS
            .iter()
            .find(|vars| vars.launcher == self)
            .map_or("RANK", |vars| vars.rank)
    }
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
    /// A token that is the same on every rank of this run and differs between runs:
    /// `TPFUSE_RUN_ID` if set, else the launcher's job id, followed by the launcher's restart
    /// count when it sets one (see [`LaunchEnv::from_vars`]). `None` when there is no id.
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

/// The restart counts that `launcher` sets, appended to the run id.
fn restart_counts(launcher: Launcher) -> &'static [&'static str] {
    match launcher {
        // torchrun restarts its workers with the same run id; `srun torchrun` is requeued
        // by Slurm with the same one too.
        Launcher::Torchrun => &["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"],
        Launcher::Slurm => &["SLURM_RESTART_COUNT"],
        // Every mpirun has a new namespace and job id.
        Launcher::OpenMpi => &[],
    }
}

/// Refuses a world of one when another launcher's variables say the job is larger: a stray
/// `RANK=0 WORLD_SIZE=1` under `mpirun` or `srun` would make every process rank 0 of its own
/// world. Open MPI's world of one inside a Slurm allocation is allowed (`mpirun -np 1` there
/// inherits the allocation's `SLURM_*` variables).
fn check_no_stray_world_of_one(
    chosen: &LauncherVars,
    world: usize,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<()> {
    if world != 1 {
        return Ok(());
    }
    for other in LAUNCHERS.iter().filter(|v| v.launcher != chosen.launcher) {
        if chosen.launcher == Launcher::OpenMpi && other.launcher == Launcher::Slurm {
            continue;
        }
        let other_world = get(other.rank)
            .and_then(|_| get(other.world))
            .and_then(|w| w.parse::<usize>().ok());
        if let Some(other_world) = other_world.filter(|&w| w > 1) {
            return Err(Error::LaunchEnv(format!(
                "{}=1 ({} says this process is alone) but {}={other_world} ({} says the job has {other_world} processes): \
                 a stray {}/{} in the environment would make every process a world of one; unset them, \
                 or set them consistently",
                chosen.world, chosen.launcher, other.world, other.launcher, chosen.rank, chosen.world
            )));
        }
    }
    Ok(())
}

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
    /// `TPFUSE_RUN_ID`, when set, is the run id whatever the launcher.
    ///
    /// A run id can repeat: a Slurm requeue keeps the job and step ids, torchrun keeps its
    /// run id across restarts, a user may reuse `--rdzv-id`. So the restart counts that the
    /// launcher sets are appended, as `+NAME=VALUE` (for example `1234.7+SLURM_RESTART_COUNT=1`):
    /// `TORCHELASTIC_RESTART_COUNT` and `SLURM_RESTART_COUNT` under torchrun (which may run
    /// under `srun`), `SLURM_RESTART_COUNT` under Slurm. Open MPI sets none: every `mpirun`
    /// has a new namespace and job id.
    ///
    /// # Precedence
    ///
    /// Launchers nest (`srun torchrun` gives every process both `SLURM_PROCID` and a
    /// different `RANK`), so the innermost launcher wins: torchrun, then Open MPI, then Slurm.
    /// Open MPI is tried before Slurm: `mpirun` inside a Slurm allocation inherits `SLURM_*`
    /// variables that describe the allocation, not the MPI process.
    ///
    /// One disagreement is refused: the launcher chosen says the world is 1 while another
    /// launcher's variables say it is larger. That is a stray `RANK=0 WORLD_SIZE=1` left in
    /// the shell under `mpirun` or `srun`, which would make every process a world of one.
    /// (`mpirun -np 1` inside a Slurm allocation of several tasks is allowed, for the reason
    /// above.)
    ///
    /// Whatever the launcher, `MASTER_ADDR`, `MASTER_PORT`, `TPFUSE_MASTER_PORT` and
    /// `TPFUSE_RENDEZVOUS_FILE` are read too.
    ///
    /// # Errors
    ///
    /// [`Error::LaunchEnv`] when no launcher's variables are set, when the launcher chosen
    /// says the world is 1 and another says more (naming both), when one of the three
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

        check_no_stray_world_of_one(vars, world, &get)?;

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

        let launcher_run_id = match vars.launcher {
            // torchrun's default `--rdzv-id` is "none", the same in every run.
            Launcher::Torchrun => get("TORCHELASTIC_RUN_ID").filter(|id| id != "none"),
            Launcher::OpenMpi => get("PMIX_NAMESPACE").or_else(|| get("OMPI_MCA_ess_base_jobid")),
            Launcher::Slurm => match (get("SLURM_JOB_ID"), get("SLURM_STEP_ID")) {
                (Some(job), Some(step)) => Some(format!("{job}.{step}")),
                (job, _) => job,
            },
        };
        let run_id = get("TPFUSE_RUN_ID").or(launcher_run_id).map(|mut id| {
            for name in restart_counts(vars.launcher) {
                if let Some(count) = get(name) {
                    id.push_str(&format!("+{name}={count}"));
                }
            }
            id
        });

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
