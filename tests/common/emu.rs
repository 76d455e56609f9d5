//! Helpers of the emulator tests (tests/emu_*.rs): one emulated device per test binary,
//! used by one test at a time, and the command that reproduces a failure.

use std::sync::{Mutex, MutexGuard};
use tpfuse::emulator::{self, Config, Schedule};

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

/// [`session_with`] 8 SMs and the environment's deadlock horizon (TPFUSE_EMU_DEADLOCK_NS,
/// default 60 s of virtual time).
pub fn session(file: &'static str, test: &'static str) -> Session {
    session_with(file, test, 8, deadlock_ns_from_env())
}

fn deadlock_ns_from_env() -> u64 {
    std::env::var("TPFUSE_EMU_DEADLOCK_NS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60_000_000_000)
}

impl Session {
    /// The command line that reruns this test with its schedule and data seed.
    pub fn repro(&self) -> String {
        let schedule = match self.config.schedule {
            Schedule::Forward => "TPFUSE_EMU_SCHEDULE=forward".to_string(),
            Schedule::Reverse => "TPFUSE_EMU_SCHEDULE=reverse".to_string(),
            Schedule::Random(seed) => format!("TPFUSE_EMU_SCHEDULE=random TPFUSE_EMU_SEED={seed}"),
        };
        let data = std::env::var("TPFUSE_TEST_SEED")
            .map(|s| format!(" TPFUSE_TEST_SEED={s}"))
            .unwrap_or_default();
        format!(
            "{schedule}{data} cargo test --features emulator --test {} -- {} --exact",
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
