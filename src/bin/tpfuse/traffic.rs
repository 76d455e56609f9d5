//! The emulator's counters summed per op, for `tpfuse selftest --counters`: global-memory
//! bytes against the minimum the op must move (its inputs read and outputs written once),
//! bytes read from or written to other ranks, synchronisation rounds, load balance of the peer
//! reads and ldmatrix bank conflicts. Counts, not times: nothing here says how fast a GPU would be.

use tpfuse::Result;

/// One op's sums over the launches of its cases.
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    pub launches: u64,
    pub blocks: u64,
    pub read: u64,
    pub written: u64,
    /// The minimum bytes of the measured cases.
    pub minimum: u64,
    pub peer: u64,
    /// Most cross-rank barriers one block passed in one launch.
    pub rounds: u64,
    /// Of the launch that read the most peer bytes: its busiest block's peer bytes over the
    /// mean (0: no peer reads).
    pub balance: f64,
    #[cfg(feature = "emulator")]
    largest_peer_launch: u64,
    pub conflicts: u64,
}

impl Traffic {
    /// Runs `f` (which must finish its device work); with `counting`, adds what the
    /// emulator counted, and `minimum` bytes, to the sums. Without the `emulator` feature
    /// `counting` has no effect.
    pub fn measure<R>(
        &mut self,
        counting: bool,
        minimum: u64,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        #[cfg(feature = "emulator")]
        if counting {
            let (result, launches) = tpfuse::emulator::counters::count(f);
            if result.is_ok() {
                self.minimum += minimum;
                for l in &launches {
                    self.add(l);
                }
            }
            return result;
        }
        let _ = (counting, minimum);
        f()
    }

    #[cfg(feature = "emulator")]
    fn add(&mut self, launch: &tpfuse::emulator::counters::LaunchCounters) {
        let t = launch.total();
        self.launches += 1;
        self.blocks += launch.blocks.len() as u64;
        self.read += t.global_read_bytes;
        self.written += t.global_write_bytes;
        self.peer += t.peer_bytes();
        self.conflicts += t.ldmatrix_conflicts;
        let rounds = launch.blocks.iter().map(|b| b.barriers).max().unwrap_or(0);
        self.rounds = self.rounds.max(rounds);
        if let Some(balance) = launch.peer_read_balance() {
            if t.peer_read_bytes > self.largest_peer_launch {
                self.largest_peer_launch = t.peer_read_bytes;
                self.balance = balance;
            }
        }
    }
}

/// The table, one row per op.
pub fn print_table(rows: &[(&str, &Traffic)]) {
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "\n{:<42} {:>8} {:>8} {:>10} {:>10} {:>9} {:>10} {:>7} {:>8} {:>9}",
        "op (emulator counters)",
        "launches",
        "blocks",
        "read MB",
        "write MB",
        "/minimum",
        "peer MB",
        "rounds",
        "balance",
        "conflicts"
    );
    for (name, t) in rows {
        let ratio = if t.minimum == 0 {
            0.0
        } else {
            (t.read + t.written) as f64 / t.minimum as f64
        };
        println!(
            "{:<42} {:>8} {:>8} {:>10.3} {:>10.3} {:>8.2}x {:>10.3} {:>7} {:>8.3} {:>9}",
            name,
            t.launches,
            t.blocks,
            mb(t.read),
            mb(t.written),
            ratio,
            mb(t.peer),
            t.rounds,
            t.balance,
            t.conflicts
        );
    }
    println!(
        "minimum: each op's inputs read and outputs written once; rounds: most cross-rank \
         barriers a block passed in one launch;\n\
         balance: the busiest block's peer bytes over the mean, in the launch that read the most \
         from peers; conflicts: ldmatrix shared-memory bank conflicts"
    );
}
