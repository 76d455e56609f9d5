//! Helpers of the emulator tests (tests/emu_*.rs): one emulated device per test binary,
//! used by one test at a time, and the command that reproduces a failure; virtual ranks
//! for the custom kernels' C ABI ([`Ranks`]).

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};
use tpfuse::emulator::{self, abi, Config, DeviceBuffer, Fault, Memory, Schedule, Stream};

static DEVICE: Mutex<()> = Mutex::new(());

/// Holds the emulated device for one test; on a panic, prints the command that reruns the
/// test with the same schedule and data.
pub struct Session {
    test: &'static str,
    file: &'static str,
    config: Config,
    _device: MutexGuard<'static, ()>,
}

/// Takes the device for `test` (in tests/`file`.rs) with `sms` SMs and the environment's
/// schedule, and a deadlock horizon of `deadlock_ns`.
pub fn session_with(file: &'static str, test: &'static str, sms: u32, deadlock_ns: u64) -> Session {
    let guard = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    let mut config = emulator::config();
    config.sms = sms;
    config.deadlock_ns = deadlock_ns;
    // The environment's architecture and memory model (a test may have set others).
    config.memory = memory_from_env();
    config.arch = std::env::var("TPFUSE_EMU_ARCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(90);
    // What the previous test left queued (cudarc's frees of its dropped buffers).
    emulator::drain();
    emulator::set_config(&config).expect("emulator idle between tests");
    Session {
        test,
        file,
        config,
        _device: guard,
    }
}

/// [`session_with`] [`SESSION_SMS`] SMs and the environment's deadlock horizon
/// (TPFUSE_EMU_DEADLOCK_NS, default 60 s of virtual time).
pub fn session(file: &'static str, test: &'static str) -> Session {
    session_with(file, test, SESSION_SMS, deadlock_ns_from_env())
}

/// The SMs of a test's device: room for every block of 8 virtual ranks of 4 blocks each at
/// once, since the custom kernels' blocks wait for their peers' (an all-reduce block holds a
/// whole SM: 512 threads of 78 registers on sm_90a).
pub const SESSION_SMS: u32 = 32;

/// TPFUSE_EMU_MEMORY (sc, weak or weak-random; default sc).
pub fn memory_from_env() -> Memory {
    match std::env::var("TPFUSE_EMU_MEMORY").as_deref() {
        Ok("weak") => Memory::Weak,
        Ok("weak-random") => Memory::WeakRandom,
        _ => Memory::Sc,
    }
}

pub fn deadlock_ns_from_env() -> u64 {
    std::env::var("TPFUSE_EMU_DEADLOCK_NS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60_000_000_000)
}

impl Session {
    /// The same session under another memory model.
    pub fn with_memory(mut self, memory: Memory) -> Session {
        self.config.memory = memory;
        emulator::set_config(&self.config).expect("emulator idle between tests");
        self
    }

    /// The same session under another schedule.
    pub fn with_schedule(mut self, schedule: Schedule) -> Session {
        self.config.schedule = schedule;
        emulator::set_config(&self.config).expect("emulator idle between tests");
        self
    }

    /// The schedule in force.
    pub fn schedule(&self) -> Schedule {
        self.config.schedule
    }

    /// The command line that reruns this test with its schedule and data seed.
    pub fn repro(&self) -> String {
        let schedule = match self.config.schedule {
            Schedule::Forward => "TPFUSE_EMU_SCHEDULE=forward".to_string(),
            Schedule::Reverse => "TPFUSE_EMU_SCHEDULE=reverse".to_string(),
            Schedule::Random(seed) => format!("TPFUSE_EMU_SCHEDULE=random TPFUSE_EMU_SEED={seed}"),
            Schedule::Pct(seed) => format!("TPFUSE_EMU_SCHEDULE=pct TPFUSE_EMU_SEED={seed}"),
        };
        let memory = match self.config.memory {
            Memory::Sc => "",
            Memory::Weak => " TPFUSE_EMU_MEMORY=weak",
            Memory::WeakRandom => " TPFUSE_EMU_MEMORY=weak-random",
        };
        let data = std::env::var("TPFUSE_TEST_SEED")
            .map(|s| format!(" TPFUSE_TEST_SEED={s}"))
            .unwrap_or_default();
        format!(
            "{schedule}{memory}{data} cargo test --features emulator --test {} -- {} --exact",
            self.file, self.test
        )
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\nemulator test failed; reproduce with:\n  {}\n",
                self.repro()
            );
        }
    }
}

/// Panics with the emulator's message unless `code` is 0.
pub fn launched(what: &str, code: i32) {
    if code != 0 {
        // SAFETY: returns a static string for any code.
        let msg = unsafe { std::ffi::CStr::from_ptr(emulator::abi::tpfuse_error_string(code)) };
        panic!("{what}: launch returned {code} ({})", msg.to_string_lossy());
    }
}

/// W virtual ranks: each a stream, a data buffer (staging + result) and a signal pad that
/// every rank addresses.
pub struct Ranks {
    pub world: usize,
    pub blocks: i32,
    pub timeout_ns: u64,
    pub data: Vec<DeviceBuffer<u8>>,
    pub signals: Vec<DeviceBuffer<u32>>,
    /// Each rank's "host-mapped" error word (emulated device memory is host memory).
    pub host_errors: Vec<DeviceBuffer<u32>>,
    pub streams: Vec<Stream>,
    /// Bytes of staging (and of result) per rank.
    pub capacity: usize,
    /// Bytes of each half of the packet area the fused GEMM + all-reduce may use (all of it
    /// unless a test sets less; 0: flags only).
    pub packet_bytes: u64,
}

impl Ranks {
    /// W ranks with 64 KiB of staging each.
    pub fn new(world: usize, blocks: i32, timeout_ns: u64) -> Ranks {
        Ranks::with_capacity(world, blocks, timeout_ns, 64 * 1024)
    }

    /// W ranks with `capacity` bytes of staging (and of result) each. The launches' deadline
    /// is `timeout_ns`, or TPFUSE_TEST_TIMEOUT_NS where that is shorter (scripts/mutants.sh:
    /// a planted bug that leaves a wait unanswered fails at 1 s of virtual time, not 60).
    pub fn with_capacity(world: usize, blocks: i32, timeout_ns: u64, capacity: usize) -> Ranks {
        let timeout_ns = std::env::var("TPFUSE_TEST_TIMEOUT_NS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(timeout_ns, |cap| timeout_ns.min(cap));
        // As a group does: a kernel's first use between two ranks' launches would wait for
        // the earlier rank's kernel (CUDA's lazy loading, cuda/emu/loading.cpp).
        let ctx = tpfuse::device::open(0).expect("device 0");
        tpfuse::device::load_kernels(&ctx).expect("loading the kernels");
        let pad_words = abi::TPFUSE_SIGNAL_PAD_BYTES as usize / 4;
        Ranks {
            world,
            blocks,
            timeout_ns,
            data: (0..world)
                .map(|_| DeviceBuffer::new(2 * capacity))
                .collect(),
            signals: (0..world)
                .map(|_| DeviceBuffer::from_slice(&vec![0u32; pad_words]))
                .collect(),
            host_errors: (0..world)
                .map(|_| DeviceBuffer::from_slice(&[0u32]))
                .collect(),
            streams: (0..world)
                .map(|rank| {
                    let s = Stream::new();
                    s.set_rank(rank);
                    s
                })
                .collect(),
            capacity,
            packet_bytes: abi::TPFUSE_PACKET_HALF_BYTES as u64,
        }
    }

    /// W ranks where rank `stopped` never runs and the %globaltimer of rank `frozen`'s
    /// kernels stands still.
    pub fn stopped_and_frozen(
        world: usize,
        blocks: i32,
        timeout_ns: u64,
        stopped: usize,
        frozen: usize,
    ) -> Ranks {
        let ranks = Ranks::new(world, blocks, timeout_ns);
        ranks.streams[stopped].set_fault(Fault {
            stop: true,
            ..Fault::default()
        });
        ranks.streams[frozen].set_fault(Fault {
            freeze_timer: true,
            ..Fault::default()
        });
        ranks
    }

    pub fn peers(&self) -> abi::tpfuse_peers {
        let mut p = abi::tpfuse_peers {
            data: [std::ptr::null_mut(); 8],
            signals: [std::ptr::null_mut(); 8],
        };
        for r in 0..self.world {
            p.data[r] = self.data[r].ptr().cast();
            p.signals[r] = self.signals[r].ptr();
        }
        p
    }

    pub fn args(&self, rank: usize) -> abi::tpfuse_group_args {
        abi::tpfuse_group_args {
            rank: rank as i32,
            world: self.world as i32,
            blocks: self.blocks,
            capacity: self.capacity as u64,
            timeout_ns: self.timeout_ns,
            // 4 x the timeout at the emulated 1.98 GHz clock, rounded up.
            backstop_cycles: self.timeout_ns.saturating_mul(8),
            host_error: self.host_errors[rank].ptr(),
            packet_bytes: self.packet_bytes,
        }
    }

    pub fn stream(&self, rank: usize) -> *mut c_void {
        self.streams[rank].raw()
    }

    pub fn synchronize(&self) {
        for (r, s) in self.streams.iter().enumerate() {
            s.synchronize().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    }

    /// The rank's error word in its signal pad.
    pub fn error_word(&self, rank: usize) -> u32 {
        self.signals[rank].to_vec()[abi::TPFUSE_SIGNAL_ERROR_OFFSET as usize / 4]
    }

    /// What the rank's kernels published to the host.
    pub fn host_error_word(&self, rank: usize) -> u32 {
        self.host_errors[rank].to_vec()[0]
    }
}
