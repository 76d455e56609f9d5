//! Multi-process tests: the test re-executes its own binary once per rank
//! (`--exact <child test> --include-ignored`), the role, rank, world size, NCCL unique id,
//! a shared seed and a directory in environment variables, each child with its own
//! `NCCL_HOSTID` and `NCCL_SOCKET_IFNAME=lo` so that NCCL treats the ranks as separate hosts
//! (socket transport) instead of refusing two ranks on one GPU. Each child logs to its own
//! file in the directory, checks its own results and writes a marker file there when every
//! check passed; the parent waits with a bound and kills every child on every path.
#![allow(dead_code)]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use tpfuse::comm::{Comm, CommOptions, UniqueId};

pub const ENV_ROLE: &str = "TPFUSE_TEST_CHILD_ROLE";
pub const ENV_RANK: &str = "TPFUSE_TEST_CHILD_RANK";
pub const ENV_WORLD: &str = "TPFUSE_TEST_CHILD_WORLD";
pub const ENV_ID: &str = "TPFUSE_TEST_CHILD_ID";
pub const ENV_DIR: &str = "TPFUSE_TEST_CHILD_DIR";
pub const ENV_SEED: &str = "TPFUSE_TEST_CHILD_SEED";

/// Nanoseconds since the Unix epoch (0 if the clock is before it).
pub fn clock_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// What a child learns from its environment.
pub struct ChildEnv {
    pub rank: usize,
    pub world: usize,
    pub id: UniqueId,
    pub dir: PathBuf,
    pub seed: u64,
}

impl ChildEnv {
    /// `None` when this process was not started as a child with `role`.
    pub fn from_env(role: &str) -> Option<ChildEnv> {
        if std::env::var(ENV_ROLE).ok()? != role {
            return None;
        }
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("child without {k}"));
        let num = |k: &str| -> u64 {
            var(k)
                .parse()
                .unwrap_or_else(|_| panic!("{k}={:?} is not a number", var(k)))
        };
        Some(ChildEnv {
            rank: num(ENV_RANK) as usize,
            world: num(ENV_WORLD) as usize,
            id: UniqueId::from_hex(&var(ENV_ID))
                .unwrap_or_else(|e| panic!("{ENV_ID} does not parse: {e}")),
            dir: PathBuf::from(var(ENV_DIR)),
            seed: num(ENV_SEED),
        })
    }

    /// This rank's NCCL communicator on GPU 0, whose operations give up after `timeout`.
    pub fn comm(&self, timeout: Duration) -> Comm {
        let (rank, world) = (self.rank, self.world);
        Comm::init_rank_on_device(&self.id, rank, world, 0, CommOptions { timeout })
            .unwrap_or_else(|e| panic!("rank {rank}/{world}: NCCL init: {e}"))
    }

    /// Tells the parent that every check of this rank passed, with `note` for its log.
    pub fn mark_ok(&self, note: &str) {
        std::fs::write(self.dir.join(format!("rank{}.ok", self.rank)), note)
            .expect("writing the marker file");
        println!("rank {}/{}: ok: {note}", self.rank, self.world);
        let _ = std::io::stdout().flush();
    }
}

/// How to start the children of one multi-process test.
pub struct Spawn<'a> {
    /// The `#[test]` every child runs.
    pub test: &'static str,
    /// What the child test finds in [`ENV_ROLE`] ([`ChildEnv::from_env`]).
    pub role: &'a str,
    pub world: usize,
    /// The seed every child finds in [`ENV_SEED`].
    pub seed: u64,
    /// The children's directory is `{dir_prefix}-{pid}-{role}-w{world}-{nanos}` in the
    /// temporary directory.
    pub dir_prefix: &'a str,
    /// Rank r's `NCCL_HOSTID` is `{host_prefix}-{pid}-rank{r}`.
    pub host_prefix: &'a str,
    /// More environment variables, the same for every child.
    pub env: &'a [(&'a str, &'a str)],
}

/// The children of one multi-process test. Dropping it kills (through each child's own
/// handle) and reaps every child still running, whatever path the test takes.
pub struct Children {
    test: &'static str,
    dir: PathBuf,
    procs: Vec<Child>,
    pub started: Instant,
}

impl Children {
    /// Starts `spawn.world` copies of this test binary running the test `spawn.test`, with
    /// a fresh NCCL unique id.
    pub fn spawn(spawn: Spawn<'_>) -> Self {
        let Spawn {
            test,
            role,
            world,
            seed,
            dir_prefix,
            host_prefix,
            env,
        } = spawn;
        let exe = std::env::current_exe().expect("the path of this test binary");
        let dir = std::env::temp_dir().join(format!(
            "{dir_prefix}-{}-{role}-w{world}-{}",
            std::process::id(),
            clock_nanos()
        ));
        std::fs::create_dir_all(&dir).expect("creating the children's directory");
        let id = UniqueId::new().unwrap_or_else(|e| panic!("ncclGetUniqueId: {e}"));
        let mut children = Children {
            test,
            dir,
            procs: Vec::new(),
            started: Instant::now(),
        };
        for rank in 0..world {
            let log = std::fs::File::create(children.log_path(rank)).expect("creating a log");
            let mut cmd = Command::new(&exe);
            cmd.args([
                "--exact",
                test,
                "--nocapture",
                "--test-threads=1",
                "--include-ignored",
            ])
            .env(ENV_ROLE, role)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD, world.to_string())
            .env(ENV_ID, id.to_hex())
            .env(ENV_DIR, &children.dir)
            .env(ENV_SEED, seed.to_string())
            // Separate "hosts" for NCCL, so that ranks may share the GPU (socket transport).
            .env(
                "NCCL_HOSTID",
                format!("{host_prefix}-{}-rank{rank}", std::process::id()),
            )
            .env("NCCL_SOCKET_IFNAME", "lo")
            .env("NCCL_IB_DISABLE", "1")
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("duplicating a log handle"))
            .stderr(log);
            if std::env::var_os("NCCL_DEBUG").is_none() {
                cmd.env("NCCL_DEBUG", "WARN");
            }
            for (k, v) in env {
                cmd.env(k, v);
            }
            let child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("starting rank {rank} ({}): {e}", exe.display()));
            children.procs.push(child);
        }
        children
    }

    fn log_path(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank{rank}.log"))
    }

    fn marker(&self, rank: usize) -> Option<String> {
        std::fs::read_to_string(self.dir.join(format!("rank{rank}.ok"))).ok()
    }

    /// Every child's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for rank in 0..self.procs.len() {
            let log = std::fs::read_to_string(self.log_path(rank))
                .unwrap_or_else(|e| format!("(no log: {e})"));
            s += &format!("\n----- {} rank {rank} -----\n{log}", self.test);
        }
        s
    }

    fn kill_all(&mut self) {
        for c in &mut self.procs {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }

    /// Waits until every child has exited, at most `bound` after the start; a child that
    /// fails, or the bound expiring, kills the rest and fails the test with every log.
    pub fn wait_all(&mut self, bound: Duration) -> Vec<ExitStatus> {
        let mut status: Vec<Option<ExitStatus>> = vec![None; self.procs.len()];
        loop {
            for (s, c) in status.iter_mut().zip(&mut self.procs) {
                if s.is_none() {
                    *s = c.try_wait().expect("polling a child");
                }
            }
            if let Some((rank, s)) = status
                .iter()
                .enumerate()
                .find_map(|(r, s)| s.filter(|s| !s.success()).map(|s| (r, s)))
            {
                self.kill_all();
                panic!(
                    "{}: rank {rank} failed ({s}) after {:?}; the others were killed{}",
                    self.test,
                    self.started.elapsed(),
                    self.logs()
                );
            }
            if status.iter().all(Option::is_some) {
                return status.into_iter().flatten().collect();
            }
            if self.started.elapsed() > bound {
                self.kill_all();
                panic!(
                    "{}: children still running after {bound:?} (a hang); killed{}",
                    self.test,
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every rank's marker note; a rank that exited 0 without one fails the test (so a child
    /// that ran no test cannot pass).
    pub fn notes(&self) -> Vec<String> {
        (0..self.procs.len())
            .map(|rank| {
                self.marker(rank).unwrap_or_else(|| {
                    panic!(
                        "{}: rank {rank} exited 0 but never wrote its marker (did the child \
                         test run at all?){}",
                        self.test,
                        self.logs()
                    )
                })
            })
            .collect()
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.kill_all();
        if std::thread::panicking() {
            eprintln!("children's logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A small integer in [-32, 31] for (seed, rank, index): sums over up to 8 ranks stay exact
/// in bf16 (8 significant bits) and f32, whatever the order of the additions.
pub fn small_int(seed: u64, rank: usize, i: usize) -> f32 {
    let h = super::gpu::splitmix64(seed ^ ((rank as u64) << 48) ^ i as u64);
    (h % 64) as f32 - 32.0
}
